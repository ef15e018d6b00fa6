"""Run training steps on fake tensors and measure each one's peak.

For each :class:`~layeropt.plan.variants.Variant`, on one model built under
``FakeTensorMode``, the steady-state step ``loss = loss_fn(model, batch);
loss.backward(); opt.step(); opt.zero_grad()`` is counted by
:class:`~layeropt.plan.tracker.LiveBytes` with the target device's kernels
(:mod:`layeropt.plan.devices`):

* *in-backward* (layeropt) variants: every trainable parameter gets a zero
  gradient and the optimizer steps once, which creates its state exactly as a
  first real step would; then the model is attached (:func:`layeropt.attach`)
  and the whole step is measured. On the ``"cuda"`` target (state offload
  apart) a real first step after attaching makes the state instead, each
  bucket's as its gradients land, as a real run places it;
* optimizers that step after backward leave forward and backward alone, so
  those are measured once per (checkpointing, loss) and the optimizer's state
  added; then each optimizer steps once on the gradients (warm-up) and its
  second ``step()`` is measured. The larger peak is the step's.

With ``max_norm`` the step clips as a training loop would: torch's rows call
``clip_grad_norm_`` before ``step()`` (counted in the step's phase), layeropt's
last backward is ``layeropt.backward(loss, max_norm=...)`` (its measure pass and
its step pass, both run).

On the ``"cuda"`` target the tracker also logs every allocation and free
(:attr:`~layeropt.plan.tracker.LiveBytes.log`), and a run of steps made of
them - the model built, the first step, steady-state steps until the
allocator's blocks repeat - is replayed through PyTorch's caching allocator
(:mod:`layeropt.plan.allocator`): what it reserves is each row's
``reserved_bytes``.

Gradients are recognised by a post-accumulate-grad hook registered before
layeropt's, parameters and optimizer state by identity. Library code that
treats a fake tensor as a sign of tracing is patched for the run (see
:func:`library_quirks`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from .allocator import Event, alive, steady_reserved
from .devices import Target, _patched, target
from .tracker import GRADIENTS, PARAMETERS, STATE, LiveBytes
from .variants import Variant
from .workloads import PlanError, Workload

__all__ = ["Measurement", "simulate", "library_quirks"]

PHASES = ("forward", "backward", "optimizer step", "zero_grad")


@dataclasses.dataclass
class Measurement:
    """The memory of one variant's steady-state training step, in bytes.

    Attributes:
        variant: the configuration measured.
        peak_bytes: live tensor bytes at the step's peak (parameters and
            optimizer state included).
        start_bytes: live bytes when the step started (parameters, optimizer
            state, buffers, the batch).
        end_bytes: live bytes when it ended (equal to ``start_bytes`` in a
            steady state).
        at_peak: bytes per category at the peak (sums to ``peak_bytes``).
        phase: ``"forward"``, ``"backward"``, ``"optimizer step"`` or
            ``"zero_grad"``: where the peak falls.
        phase_progress: how far into that phase, from 0 (its first operator)
            to 1 (its last).
        peak_op: the operator at the peak.
        host_bytes: host memory the step keeps besides: the optimizer state
            of a ``offload`` variant, and the held gradients' sums of a
            ``held_on_host`` one (not in ``peak_bytes``); of which
            ``held_host_bytes`` the held gradients'.
        to_device_bytes / to_host_bytes: bytes a training step copies over the
            host link each way (offloaded state in and out; held gradients down
            once per held micro-batch, their sums up once), counted as the
            offload code copies them.
        reserved_bytes: what PyTorch's CUDA caching allocator reserves over a
            run of these steps (``torch.cuda.max_memory_reserved``: the model
            built, then steps until its blocks repeat), their allocations and
            frees replayed in order through
            :class:`~layeropt.plan.allocator.CachingAllocator` with cuBLAS's
            workspaces; 0 when not replayed (the ``"cpu"`` target).
    """

    variant: Variant
    peak_bytes: int
    start_bytes: int
    end_bytes: int
    at_peak: dict[str, int]
    phase: str
    phase_progress: float
    peak_op: str
    host_bytes: int = 0
    to_device_bytes: int = 0
    to_host_bytes: int = 0
    held_host_bytes: int = 0
    reserved_bytes: int = 0


def simulate(
    workload: Workload,
    variants: list[Variant],
    *,
    device: str | Target = "cuda",
    bucket_cap_mb: float | None = None,
    progress: Callable[[int, int, Variant], None] | None = None,
    jobs: int = 1,
    accumulate: int = 1,
    max_norm: float | None = None,
) -> tuple[int, list[Measurement]]:
    """Measure one steady-state training step per variant, on fake tensors.

    With ``accumulate`` > 1 the step is an accumulation window: torch.optim
    sums every micro-batch's gradient, then steps; layeropt runs all but the
    last inside ``no_step()``. Micro-batches 2 to N-1 repeat the same memory,
    so at most three are run (the first, one of those, the last) and the bytes
    moved per held micro-batch are counted N-1 times.

    Args:
        workload: the model, batch and loss.
        variants: the configurations to measure.
        device: the device whose kernels to model (``"cuda"`` or ``"cpu"``).
        bucket_cap_mb: ``layeropt.attach``'s ``bucket_cap_mb`` (``None``:
            the library default).
        progress: called as ``progress(i, n, variant)`` before each variant.
        jobs: worker processes sharing the variants (forked, Linux only, from
            a process with no other Python thread and no CUDA context; each
            builds its own fake model; the numbers do not depend on it).
        accumulate: micro-batches per training step (the same batch each time).
        max_norm: clip the gradients' total norm to it, as ``clip_grad_norm_``
            (torch) and ``layeropt.backward(max_norm=)`` (layeropt) do; ``None``:
            no clipping.

    Returns:
        ``(number of parameters, one Measurement per variant)``.

    Raises:
        PlanError: a variant does not apply to this workload.
    """
    tgt = target(device)
    if isinstance(accumulate, bool) or not isinstance(accumulate, int) or accumulate < 1:
        raise PlanError(f"accumulate must be a whole number of micro-batches >= 1, got "
                        f"{accumulate!r}")
    if max_norm is not None and (isinstance(max_norm, bool)
                                 or not isinstance(max_norm, (int, float))
                                 or not 0 < max_norm < float("inf")):
        raise PlanError(f"max_norm must be a positive number (or None: no clipping), got "
                        f"{max_norm!r}")
    for v in variants:
        if v.checkpointing and workload.checkpoint is None:
            raise PlanError(
                f"{v.label}: this workload has no checkpointing; pass checkpoint= "
                "(e.g. lambda m: layeropt.checkpoint_modules(m, names='blocks.*').remove)"
            )
        if v.chunked_loss and workload.chunked_loss is None:
            raise PlanError(f"{v.label}: this workload has no chunked loss (chunked_loss=)")
    units = _units(variants)
    if jobs > 1 and len(units) > 1:
        from .parallel import can_fork, run_sharded

        if can_fork():
            options = {"device": device, "bucket_cap_mb": bucket_cap_mb,
                       "accumulate": accumulate, "max_norm": max_norm}
            try:
                return run_sharded(simulate, workload, variants, units, jobs, progress, options)
            except RuntimeError as e:  # (the rows run here instead: below)
                if "Autograd-and-Fork" not in str(e):
                    raise
                # autograd's device threads run in this process (a CUDA build starts them
                # at a backward on fake tensors: an earlier plan's), and a forked child
                # cannot backward; nothing tells beforehand
    from torch._subclasses.fake_tensor import FakeTensorMode

    _prime_caches(variants)
    tgt.prepare()  # (before its modes; not before forking: a backward there stops theirs)
    live = LiveBytes()
    live.log = [] if tgt.name == "cuda" else None
    with contextlib.ExitStack() as stack:
        stack.enter_context(_older_objects_frozen())
        fake = stack.enter_context(FakeTensorMode())
        stack.enter_context(live)
        stack.enter_context(tgt.kernels(live))
        stack.enter_context(library_quirks(live, fake, variants))
        model = workload.build()
        params = _unique(model.parameters())
        n_params = sum(p.numel() for p in params)
        live.track(params, PARAMETERS)
        trainable = [p for p in params if p.requires_grad]
        if not trainable:
            raise PlanError(f"{workload.name} has no trainable parameters")
        for p in trainable:
            p.register_post_accumulate_grad_hook(_GradMarker(live))
        batch = workload.inputs(model)
        built = _taken(live)
        done = [0]

        def tick(v: Variant) -> None:
            if progress is not None:
                progress(done[0], len(variants), v)
            done[0] += 1

        run = _Run(model, batch, trainable, workload, live, bucket_cap_mb, tick, accumulate,
                   built, max_norm)
        results: dict[Variant, Measurement] = {}
        for unit in units:
            if unit[0].in_backward:
                results[unit[0]] = _measure_in_backward(run, unit[0])
            else:
                first = unit[0]
                for m in _measure_plain(run, first.checkpointing, first.chunked_loss, unit):
                    results[m.variant] = m
    return n_params, [results[v] for v in variants]


def _units(variants: list[Variant]) -> list[list[Variant]]:
    """What one forward and backward measures: each in-backward variant alone,
    the other variants by (checkpointing, chunked loss)."""
    units: list[list[Variant]] = []
    groups: dict[tuple[bool, bool], list[Variant]] = {}
    for v in dict.fromkeys(variants):
        if v.in_backward:
            units.append([v])
        else:
            key = (v.checkpointing, v.chunked_loss)
            if key not in groups:
                groups[key] = []
                units.append(groups[key])
            groups[key].append(v)
    return units


def _prime_caches(variants: list[Variant]) -> None:
    """Fill caches that libraries fill lazily by reading tensor values.

    torchao builds its quantization maps with ``.tolist()`` on first use,
    which a fake tensor cannot answer: build them now, on real tensors.
    """
    if any(v.base.startswith("torchao.") for v in variants):
        for name in ("torchao.optim.subclass_8bit", "torchao.optim.subclass_4bit"):
            try:
                module = importlib.import_module(name)
            except ImportError:  # pragma: no cover - another torchao layout
                continue
            for fn in ("get_qmap_signed", "get_qmap_unsigned"):
                if hasattr(module, fn):
                    getattr(module, fn)()


def _unique(params: Any) -> list[nn.Parameter]:
    return list({id(p): p for p in params}.values())


class _GradMarker:
    """Post-accumulate-grad hook: the parameter's ``.grad`` is a gradient."""

    def __init__(self, live: LiveBytes) -> None:
        self.live = live

    def __call__(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.live.track(p.grad, GRADIENTS)


@dataclasses.dataclass
class _Run:
    """What one simulation needs: the model, its batch, the tracker, the options."""

    model: nn.Module
    batch: Any
    params: list[nn.Parameter]
    workload: Workload
    live: LiveBytes
    bucket_cap_mb: float | None
    tick: Callable[[Variant], None]
    accumulate: int = 1
    built: list[Event] | None = None  # the allocations before the steps (None: not logged)
    max_norm: float | None = None  # clipping (None: none)

    @property
    def micro(self) -> int:
        """Micro-batches run: the first, one of the middle ones, the last."""
        return min(self.accumulate, 3)


def _taken(live: LiveBytes) -> list[Event]:
    """The tracker's log so far, and an empty log from here (``[]`` if not logging)."""
    if live.log is None:
        return []
    out, live.log = live.log, []
    return out


def _reserved(run: _Run, first: list[Event], keep: list[Event], step: list[Event]) -> int:
    """What the caching allocator reserves over the built model, the ``first`` step and
    steady-state ``step`` (:func:`~layeropt.plan.allocator.steady_reserved`; 0 without a
    log: the ``"cpu"`` target)."""
    if run.live.log is None or run.built is None:
        return 0
    return steady_reserved(run.built, first, keep, step).reserved


def _snapshot(live: LiveBytes) -> dict[str, Any]:
    phase = live.peak_phase
    ops = live.ops_per_phase.get(phase, 1)
    return dict(
        peak_bytes=live.peak,
        at_peak=dict(live.at_peak),
        phase=phase,
        phase_progress=min(live.peak_op_in_phase / max(ops - 1, 1), 1.0),
        peak_op=live.op_names_at_peak,
    )


@contextlib.contextmanager
def _older_objects_frozen() -> Iterator[None]:
    """The objects alive before planning (torch's, transformers', the caller's) left out
    of the collections that each measurement starts with: those scan only what planning
    made (a fifth of a small model's plan was collecting torch's modules again). Not where
    the caller has frozen objects itself: unfreezing would undo theirs."""
    if gc.get_freeze_count():
        yield
        return
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """As in PeakMemory: tensors kept by reference cycles count until the step ends."""
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


@contextlib.contextmanager
def _configured(run: _Run, checkpointing: bool) -> Iterator[None]:
    """Checkpointing on (if asked) for the block; gradients dropped after it."""
    undo = run.workload.checkpoint(run.model) if checkpointing else None  # type: ignore[misc]
    try:
        yield
    finally:
        for p in run.params:
            p.grad = None
        if undo is not None:
            undo()


def _measure_plain(
    run: _Run, checkpointing: bool, chunked: bool, variants: list[Variant]
) -> list[Measurement]:
    """Optimizers that step after backward: one forward and backward for all of them.

    Forward and backward do not touch the optimizer, so a step's memory there
    is the optimizer's (constant) state plus what forward and backward
    allocate, the same for every such optimizer: they are measured once,
    without an optimizer, then each optimizer's ``step()`` on the resulting
    gradients. The step's peak is the larger of the two.
    """
    live = run.live
    loss_fn = run.workload.chunked_loss if chunked else run.workload.loss
    out = []
    with _configured(run, checkpointing), _gc_paused():
        _taken(live)
        live.start()
        try:
            for _ in range(run.micro):  # (torch sums the micro-batches' gradients)
                live.phase = "forward"
                loss = loss_fn(run.model, run.batch)  # type: ignore[misc]
                live.phase = "backward"
                loss.backward()
        finally:
            live.phase = "idle"
        start, passes = live.start_bytes, _snapshot(live)
        passes_log = _taken(live)
        for v in variants:
            run.tick(v)
            before = live.total
            opt = v.make_optimizer(run.params)
            opt.step()  # warm-up on these gradients: creates the state
            live.track(list(opt.state.values()), STATE)
            kept = live.total - before  # the optimizer's state (and its maps)
            warm_up = _taken(live)
            live.start()
            try:
                live.phase = "optimizer step"
                if run.max_norm is not None:
                    torch.nn.utils.clip_grad_norm_(run.params, run.max_norm)
                opt.step()
            finally:
                live.phase = "idle"
            step = _snapshot(live)
            # a run: forward and backward, the first step (making the state), zero_grad;
            # then forward and backward, the step, zero_grad; ...
            step["reserved_bytes"] = _reserved(run, passes_log + warm_up, alive(warm_up),
                                               passes_log + _taken(live))  # fmt: skip
            del opt
            top = dict(passes)
            top["peak_bytes"] += kept
            top["at_peak"] = dict(passes["at_peak"])
            top["at_peak"][STATE] += kept
            top["reserved_bytes"] = step["reserved_bytes"]
            best = step if step["peak_bytes"] > top["peak_bytes"] else top
            out.append(Measurement(v, start_bytes=start + kept, end_bytes=start + kept, **best))
        del loss
    return out


def _measure_in_backward(run: _Run, variant: Variant) -> Measurement:
    """A layeropt variant: make the optimizer state (:func:`_first_step`), attach, and
    measure a step."""
    run.tick(variant)
    live = run.live
    loss_fn = run.workload.chunked_loss if variant.chunked_loss else run.workload.loss
    opt = variant.make_optimizer(run.params)
    attached: list[Any] = []
    try:
        with _configured(run, variant.checkpointing):
            offload, first = _first_step(run, variant, opt, loss_fn, attached)
            with _gc_paused():
                live.start()
                _step(run.model, run.batch, loss_fn, opt, live, run.micro, run.max_norm)
            host, link = _link(offload, run)
            reserved = _reserved(run, first, alive(first), _taken(live))
            return Measurement(
                variant, start_bytes=live.start_bytes, end_bytes=live.total, **_snapshot(live),
                host_bytes=sum(host), held_host_bytes=host[1], to_device_bytes=link[0],
                to_host_bytes=link[1], reserved_bytes=reserved,
            )
    finally:
        for handle in attached:
            handle.remove()
        del opt


def _first_step(
    run: _Run, variant: Variant, opt: Any, loss_fn: Any, attached: list[Any]
) -> tuple[Any, list[Event]]:
    """Make ``opt``'s state and attach the model (the handle appended to ``attached``);
    ``(the state offload or None, the log of the first step)``.

    Where the caching allocator is replayed (the ``"cuda"`` target), a real first
    step makes the state, each bucket's as its gradients land in backward, as in
    a real run: where the state lands among the activations sets what the run
    reserves. Otherwise, and with state offload (the state must exist to be moved
    to host memory before the model is attached), every gradient is set to zero
    and the optimizer steps once: the same state, without a forward and backward.
    """
    import layeropt

    live = run.live
    cap = {} if run.bucket_cap_mb is None else {"bucket_cap_mb": run.bucket_cap_mb}
    _taken(live)
    if variant.offload or live.log is None:
        with torch.no_grad():
            for p in run.params:
                p.grad = torch.zeros_like(p)
        opt.step()
        opt.zero_grad(set_to_none=True)
        live.track(list(opt.state.values()), STATE)
        offload = _offloaded(opt, live, variant) if variant.offload else None
        attached.append(layeropt.attach(run.model, opt, **cap))
        return offload, alive(_taken(live))  # the state (the zero gradients are gone)
    attached.append(layeropt.attach(run.model, opt, **cap))
    with _gc_paused():
        _step(run.model, run.batch, loss_fn, opt, live, run.micro, run.max_norm)
    live.track(list(opt.state.values()), STATE)
    return None, _taken(live)


def _link(offload: Any, run: _Run) -> tuple[tuple[int, int], tuple[int, int]]:
    """Host bytes (state, held gradients), and ``(to device, to host)`` bytes per training
    step of ``run.accumulate`` micro-batches, from what the offload code copied in the
    ``run.micro`` it ran."""
    if offload is None:
        return (0, 0), (0, 0)
    state = offload.copied_bytes // 2  # in and out, once each per step
    held = offload.held
    if held is None or run.micro < 2:
        return (offload.host_bytes, 0), (state, state)
    per_micro = held.down_bytes // (run.micro - 1)  # each held micro-batch's gradient down
    return ((offload.host_bytes, per_micro),
            (state + held.up_bytes, state + per_micro * (run.accumulate - 1)))


def _offloaded(opt: Any, live: LiveBytes, variant: Variant) -> Any:
    """``layeropt.offload.offload_state(opt)``, its host tensors left out of the count.

    The real offload code runs: each bucket's state is copied into working
    tensors (counted, as optimizer state) for its step and back to the host;
    with ``variant.held_on_host``, held gradients go to host tensors (not
    counted) and their sums come back as gradients, but for the buckets kept
    in ``.grad`` under ``variant.held_device_bytes``.
    """
    from ..offload.held import HostHeld
    from ..offload.state import StateOffload, _install

    class PlannedHeld(HostHeld):
        def _new_host(self, like: torch.Tensor) -> torch.Tensor:
            with live.paused():  # host memory: not the device's
                return super()._new_host(like)

        def fetch(self, param: torch.Tensor) -> torch.Tensor:
            work = super().fetch(param)
            live.track(work, GRADIENTS)
            return work

    class Planned(StateOffload):
        def _new_host(self, p: Any, key: Any, v: torch.Tensor) -> torch.Tensor:
            with live.paused():  # host memory: not the device's
                return super()._new_host(p, key, v)

        def _to_device(self, host: torch.Tensor, device: torch.device) -> torch.Tensor:
            work = super()._to_device(host, device)
            live.track(work, STATE)
            return work

    handle = Planned(opt, max_buckets=2, overlap=False, held_grads=False)
    if variant.held_on_host:
        handle.held = PlannedHeld(variant.held_device_bytes)
    return _install(opt, handle)


def _step(model: nn.Module, batch: Any, loss_fn: Any, opt: Any, live: LiveBytes,
          micro: int = 1, max_norm: float | None = None) -> None:
    """``loss = loss_fn(model, batch); loss.backward(); opt.step(); opt.zero_grad()``,
    the first ``micro - 1`` backwards inside ``opt.no_step()``; with ``max_norm`` the
    last through ``layeropt.backward(loss, max_norm=max_norm)``."""
    import layeropt

    try:
        for _ in range(micro - 1):
            live.phase = "forward"
            loss = loss_fn(model, batch)
            live.phase = "backward"
            with opt.no_step():
                loss.backward()
            del loss
        live.phase = "forward"
        loss = loss_fn(model, batch)
        live.phase = "backward"
        if max_norm is None:
            loss.backward()
        else:
            layeropt.backward(loss, max_norm=max_norm)
        live.phase = "optimizer step"
        opt.step()
        live.phase = "zero_grad"
        opt.zero_grad()
    finally:
        live.phase = "idle"


@contextlib.contextmanager
def library_quirks(live: LiveBytes, fake: Any, variants: list[Variant]) -> Iterator[None]:
    """Patch, for one fake run, library code that misreads fake tensors.

    * ``transformers.masking_utils.find_packed_sequence_indices`` treats a
      fake tensor as tracing and reports packed sequences, so a
      ``[b, 1, T, T]`` causal mask is built (and attention cannot use
      ``is_causal``). The plan's batches are never packed: it returns ``None``
      for fake position ids.
    * ``torch.compile`` (torchao's low-bit optimizers compile their update)
      cannot run inside ``FakeTensorMode``; the compiled function is a no-op
      (:func:`_fused_kernel`).
    * bitsandbytes builds its quantization map with ``.tolist()``, which a
      fake tensor cannot answer: it is built on real tensors, then made fake.

    Args:
        live: the tracker.
        fake: the ``FakeTensorMode`` of the run.
        variants: the variants to run (which libraries to patch).
    """
    with contextlib.ExitStack() as stack:
        if "transformers" in sys.modules:
            try:
                masking = importlib.import_module("transformers.masking_utils")
            except ImportError:  # pragma: no cover - old transformers
                masking = None
            if masking is not None and hasattr(masking, "find_packed_sequence_indices"):
                stack.enter_context(
                    _patched(masking, "find_packed_sequence_indices",
                             _unpacked(masking.find_packed_sequence_indices))
                )  # fmt: skip
        stack.enter_context(_patched(torch, "compile", _fused_kernel))
        if any(v.base.startswith("bitsandbytes.") for v in variants):
            bnb = importlib.import_module("bitsandbytes.functional")
            real = _computed_for_real(bnb.create_dynamic_map, live, fake)
            stack.enter_context(_patched(bnb, "create_dynamic_map", real))
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*gradient_checkpointing.*deprecated")
            # torch 2.4-2.5's own checkpoint calls its deprecated torch.cpu.amp.autocast
            warnings.filterwarnings("ignore", message=r".*torch\.cpu\.amp\.autocast",
                                    category=FutureWarning)
            yield


def _unpacked(original: Callable[..., Any]) -> Callable[..., Any]:
    from torch._subclasses.fake_tensor import FakeTensor

    def find_packed_sequence_indices(position_ids: torch.Tensor) -> Any:
        if isinstance(position_ids, FakeTensor):
            return None
        return original(position_ids)

    return find_packed_sequence_indices


def _computed_for_real(fn: Callable[..., Any], live: LiveBytes, fake: Any) -> Callable[..., Any]:
    """``fn`` run on real tensors; its tensor result made fake (and counted)."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    def run(*args: Any, **kwargs: Any) -> Any:
        with unset_fake_temporarily(), live.paused():
            out = fn(*args, **kwargs)
        if isinstance(out, torch.Tensor):
            out = fake.from_tensor(out)
            live.track(out)
        return out

    return run


def _fused_kernel(model: Any = None, **kwargs: Any) -> Any:
    """``torch.compile`` for a fake run: the compiled function becomes a no-op.

    torchao compiles each low-bit update into one kernel that works in place
    (its temporaries stay in registers), so in memory it is a no-op; running it
    eagerly would count temporaries the kernel never makes (and be slow).
    """
    if model is None:
        return lambda fn: _fused_kernel(fn, **kwargs)

    def run(*args: Any, **kw: Any) -> None:
        return None

    return run
