"""Distributed training: in-backward updates on DDP and FSDP2, never on local gradients.

A data-parallel replica may only be updated with the gradient averaged over
all processes, so layeropt steps where torch's engines finish averaging:

* **DDP** (:func:`attach_ddp`): a communication hook all-reduces each bucket
  and frees its parameters' local ``.grad``; once the average has landed (at
  the end of backward on CPU, in the future's ``.then()`` on CUDA) the
  bucket's parameters are stepped on it; the reducer is told an optimizer ran
  in backward, so it leaves ``.grad`` alone afterwards.
* **FSDP2**: ``fully_shard`` calls the sharded parameters' post-accumulate-grad
  hooks itself right after each reduce-scatter, so ``layeropt.attach`` works.
* :func:`check_local_hooks_allowed`: the plain hooks' guard against stepping
  a replica on its local gradient.

See ``docs/distributed.md`` for accumulation, checkpointing and memory.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterable, Iterator
from functools import partial
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.autograd import Variable
from torch.optim import Optimizer

from ._nesting import _graph_task_id
from ._registry import allow_local_updates, check_local_hooks_allowed, hooked_by
from .attaching import layer_buckets, register_wrapper, resolve_owners
from .errors import AttachError

__all__ = [
    "DDPAttachment",
    "attach_ddp",
    "check_local_hooks_allowed",
    "allow_local_updates",
]

# DDP instance -> its comm-hook state (DDP accepts one comm hook, for good).
_DDP_STATES: "weakref.WeakKeyDictionary[nn.Module, _HookState]" = weakref.WeakKeyDictionary()


class _HookState:
    """What the DDP comm hook needs; the reducer keeps it alive with the DDP."""

    def __init__(self, ddp: nn.Module, overlap: bool) -> None:
        self.group = ddp.process_group
        self.world = self.group.size()
        self.overlap = overlap
        self.owner: dict[Tensor, weakref.ref] = {}  # param -> its optimizer (weakly)
        self.attachment: DDPAttachment | None = None  # lives as long as the DDP model
        self.active = False
        self.lock = threading.Lock()  # bucket steps may land on comm threads
        self.fresh = True  # DDP ran a forward since the last training step began
        self.steps: dict[int, int] = {}  # id(optimizer) -> updates this backward
        self.recording: list[list[Tensor]] | None = None  # buckets seen in a measure pass
        self.buckets: list[list[Tensor]] = []  # those of the latest measure pass
        self.deferred: list[tuple[_Landing, Any]] = []  # to land at the end, in bucket order
        self.flush_task = _NONE  # graph task whose end lands ``deferred``
        self.flushes = 0  # flush callbacks queued so far (the latest may abort)

    def forward(self, module: nn.Module, args: Any) -> None:
        """DDP forward pre-hook: the next synchronised backward is a new training step."""
        self.fresh = True

    def __reduce__(self) -> tuple[type, tuple[()]]:
        # copy.deepcopy / torch.save of the DDP model: DDP builds the copy's reducer
        # afresh, without this hook, so the copy is plain DDP (and can be attached).
        return (_Copied, ())

    def begin(self) -> None:
        """A bucket is ready: the first one after a forward starts a training step.

        DDP runs one synchronised backward per forward; its buckets may land in
        several autograd graph tasks (the nested backwards of reentrant
        checkpoints), all of them one step.
        """
        if not self.fresh:
            return
        with self.lock:
            self.fresh = False
            refs = {id(r): r for r in self.owner.values()} if self.active else {}
            for ref in refs.values():  # (a set would hash the refs: dead ones cannot)
                opt = ref()
                if opt is not None:
                    _check_engine(opt._lo_engine)
                    opt._lo_engine.last_backward_steps = 0
                    if opt._lo_engine.measure is None:
                        opt._lo_engine.txn += 1  # a new training step (transaction)
            self.steps = {}

    def defer(self, landing: _Landing, fut: Any) -> None:
        """Land ``landing`` when the running graph task ends, on this thread.

        The flush is queued in the graph task of the bucket (the first one
        deferred there since the last flush), before the reducer's own
        end-of-backward callback, which DDP queues when its last bucket is
        ready (after this hook ran for it).
        """
        self.deferred.append((landing, fut))
        task = _graph_task_id()
        if task != self.flush_task:
            self.flush_task = task
            self.flushes += 1
            Variable._execution_engine.queue_callback(_Flush(self, self.flushes))

    def flush(self) -> None:
        """Land the deferred buckets. An optimizer's landed parameters wait, in
        bucket order, until they hold its ``cap_bytes`` (attach's
        ``bucket_cap_mb``), and are then stepped with one call."""
        deferred, self.deferred = self.deferred, []
        self.flush_task = _NONE
        waiting: dict[Any, tuple[list[Tensor], list[int]]] = {}  # optimizer -> (params, [bytes])
        with _stepping(self):
            for landing, fut in deferred:
                fut.wait()  # re-raises a failed all-reduce
                for opt, params in landing.apply().items():
                    queue, size = waiting.setdefault(opt, ([], [0]))
                    queue += params
                    size[0] += sum(p.grad.nbytes for p in params)
                    if size[0] >= opt._lo_engine.cap_bytes:
                        _step(self, opt, queue)
                        del waiting[opt]
            for opt, (queue, _) in waiting.items():
                _step(self, opt, queue)

    def abort(self, serial: int) -> None:
        """The backward raised: nothing of its deferred buckets is applied."""
        if serial == self.flushes:  # the latest flush queued (an older one may go later)
            self.deferred = []
            self.flush_task = _NONE


class _Copied:
    """What a copied or pickled DDP model keeps of layeropt's hook state: nothing."""

    def forward(self, module: nn.Module, args: Any) -> None:
        """The copy's forward pre-hook: a no-op."""


_NONE = -2  # _HookState.flush_task: no flush queued


class _Flush:
    """End-of-graph-task callback; a backward that raises drops it uncalled (abort)."""

    __slots__ = ("state", "serial", "called")

    def __init__(self, state: _HookState, serial: int) -> None:
        self.state, self.serial, self.called = state, serial, False

    def __call__(self) -> None:
        self.called = True
        self.state.flush()

    def __del__(self) -> None:
        if not self.called:
            self.state.abort(self.serial)


# Engine settings the DDP hook does not apply: (attribute, what sets it).
_NOT_UNDER_DDP = (
    ("max_grad_norm", "attach(..., max_grad_norm=...)"),
    ("clip_value", "attach(..., clip_value=...)"),
    ("bucket_max_norm", "attach(..., bucket_max_norm=...)"),
)


def _check_engine(engine: Any) -> None:
    for name, what in _NOT_UNDER_DDP:
        if getattr(engine, name, None) is not None:
            raise AttachError(
                f"{what} is not supported with attach_ddp: under DDP clip the global norm "
                "(and use a GradScaler) with layeropt.backward(loss, max_norm=..., "
                "scaler=...), which averages each bucket before measuring it."
            )


def _grad_view(p: Tensor, g: Tensor) -> Tensor:
    """The bucket slice of ``p`` with ``p``'s strides (the reducer's layout)."""
    return g if p.is_contiguous() else g.as_strided(p.size(), p.stride())


def _write_back(p: Tensor, view: Tensor) -> None:
    """Leave the averaged gradient in ``p.grad`` as DDP's reducer would."""
    if p.grad is None:
        return  # unused (static_graph): DDP leaves a globally unused grad alone
    if p.grad.data_ptr() != view.data_ptr():  # gradient_as_bucket_view: already there
        p.grad.copy_(view)


_UNUSED = (
    "a parameter DDP synchronises got no gradient in this backward (an unused "
    "parameter under static_graph=True); layeropt cannot tell whether other "
    "processes used it, so it would step on a wrong gradient. Use every parameter "
    "in every forward, or leave the unused ones to a plain torch.optim optimizer."
)


def _allreduce_then_step(state, bucket):  # no annotations: DDP inspects them
    """DDP comm hook: average the bucket; step its parameters once the average lands."""
    state.begin()
    landing = _Landing(state, bucket)  # sorted now: frees the local gradients at once
    buffer = bucket.buffer()
    buffer.mul_(1.0 / state.world)  # what the built-in reducer does, bit for bit
    fut = state.group.allreduce([buffer]).get_future()  # (a sum, as dist.all_reduce)
    if state.overlap and buffer.device.type != "cpu":
        # A device future's .then() runs on a stream that waits for the all-reduce.
        return fut.then(landing.then)
    state.defer(landing, fut)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(buffer)  # as torch's own optimizer-in-backward hook: stepped by the flush
    return done


class _Landing:
    """One bucket's parameters, sorted when DDP hands the bucket over.

    Sorting runs in the comm hook on the autograd thread: each parameter is
    either stepped by its optimizer (its local ``.grad``, already copied into
    the bucket, is freed now), reduced by ``layeropt.backward``'s measure pass,
    or left to get the averaged gradient written back into ``.grad`` (not
    owned, or ``no_step()``), as DDP would. :meth:`apply` does that once the
    bucket's all-reduce has landed.
    """

    __slots__ = ("state", "steps", "measures", "write_back")

    def __init__(self, state: _HookState, bucket: Any) -> None:
        self.state = state
        self.steps: dict[Any, list[tuple[Tensor, Tensor]]] = {}  # optimizer -> (param, view)
        self.measures: list[tuple[Any, Tensor, Tensor]] = []
        self.write_back: list[tuple[Tensor, Tensor]] = []
        owner = state.owner if state.active else {}
        modes: dict[int, Any] = {}  # id(owner ref) -> what its parameters get, this bucket
        for p, g in zip(bucket.parameters(), bucket.gradients()):
            view = _grad_view(p, g)
            ref = owner.get(p)
            mode = modes.get(id(ref), _WRITE_BACK if ref is None else None)
            if mode is None:  # the optimizer's first parameter in this bucket
                opt = ref()  # type: ignore[misc]
                if opt is None or opt._lo_engine.no_step_depth:
                    mode = _WRITE_BACK
                elif opt._lo_engine.measure is not None:  # layeropt.backward's first pass
                    mode = opt._lo_engine.measure
                else:
                    mode = self.steps.setdefault(opt, [])
                modes[id(ref)] = mode
            if mode is _WRITE_BACK:
                self.write_back.append((p, view))
            elif p.grad is None:
                raise AttachError(_UNUSED)
            elif type(mode) is list:
                mode.append((p, view))
                p.grad = None  # the bucket holds it now
            else:
                self.measures.append((mode, p, view))
        if state.recording is not None:
            state.recording.append(list(bucket.parameters()))

    def then(self, fut: Any) -> Tensor:
        """``.then()`` callback: the all-reduce has landed; step this bucket alone."""
        buffer = fut.value()[0]  # re-raises a failed all-reduce
        with _stepping(self.state):
            for opt, params in self.apply().items():
                _step(self.state, opt, params)
        return buffer

    def apply(self) -> dict[Any, list[Tensor]]:
        """Write back or measure the averaged gradients; point ``.grad`` at those to step.

        Returns the parameters to step, by optimizer (their ``.grad`` are the
        bucket's averaged slices: no memory of their own).
        """
        for p, view in self.write_back:
            _write_back(p, view)
        for measure, p, view in self.measures:
            measure.reduce(p, view.clone())
            measure.seen.add(id(p))
        todo = {}
        for opt, owned in self.steps.items():
            for p, view in owned:
                p.grad = view
            todo[opt] = [p for p, _ in owned]
        return todo


@contextlib.contextmanager
def _stepping(state: _HookState) -> Iterator[None]:
    """Bucket steps: one at a time (``.then()`` may run on comm threads), without grad."""
    with state.lock:
        grad_mode = torch.is_grad_enabled()  # not inherited by comm threads
        torch._C._set_grad_enabled(False)  # what torch.no_grad() does, for less
        try:
            yield
        finally:
            torch._C._set_grad_enabled(grad_mode)


def _step(state: _HookState, opt: Any, params: list[Tensor]) -> None:
    """Step ``params`` (``.grad`` = averaged bucket slices) and free their ``.grad``."""
    opt._step_params(params)
    for p in params:
        p.grad = None
    n = state.steps[id(opt)] = state.steps.get(id(opt), 0) + len(params)
    opt._lo_engine.last_backward_steps = n


_WRITE_BACK = object()  # _Landing: leave the averaged gradient in .grad, as DDP would


class _TwoPasses:
    """``layeropt.backward``'s two passes on DDP models (clipping, GradScaler).

    Pass 1 (measure): the comm hook averages each bucket as usual and the
    engines reduce the averaged gradients to norms / inf flags; the buckets
    are recorded. Each parameter's ``.grad`` is then put back as it was
    before the pass (only what ``no_step()`` accumulated), since the reducer
    left the pass's local gradient in it. Pass 2 (step): DDP's reducer does
    not run a second time for one forward, so post-accumulate hooks average
    each recorded bucket exactly as DDP does (one flat buffer in the bucket's
    layout, ``mul_(1 / world)``, all-reduce), then unscale / clip and step it.
    """

    def __init__(self, engines: list[Any]) -> None:
        self.states = []
        for e in engines:
            for a in list(e.attachments):
                if isinstance(a, DDPAttachment) and a._state not in self.states:
                    self.states.append(a._state)
        self._before: dict[Tensor, Tensor | None] = {}

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        if not self.states:
            yield
            return
        params = [p for state in self.states for p in state.owner]
        self._before = {p: None if p.grad is None else p.grad.detach().clone() for p in params}
        for state in self.states:
            state.recording = []
        try:
            yield
        finally:
            for state in self.states:
                state.buckets, state.recording = state.recording, None
            for p, grad in self._before.items():
                p.grad = grad
            self._before = {}

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if not self.states:
            yield
            return
        passes = [_StepPass(state) for state in self.states]
        try:
            yield
            for one in passes:
                one.check_done()
        finally:
            for one in passes:
                one.remove()


class _StepPass:
    """Pass 2 on one DDP model: average each recorded bucket, then step it."""

    def __init__(self, state: _HookState) -> None:
        self.state = state
        self.buckets = state.buckets
        self.left = [len(b) for b in self.buckets]
        where = {id(p): i for i, b in enumerate(self.buckets) for p in b}
        self.handles = [
            p.register_post_accumulate_grad_hook(partial(self._landed, where[id(p)]))
            for b in self.buckets for p in b
        ]

    def _landed(self, index: int, param: Tensor) -> None:
        self.left[index] -= 1
        if self.left[index] == 0:
            self._average_and_step(self.buckets[index])

    def _average_and_step(self, params: list[Tensor]) -> None:
        state = self.state
        first = params[0]
        buffer = torch.empty(sum(p.numel() for p in params), dtype=first.dtype,
                             device=first.device)
        views, offset = [], 0
        for p in params:  # the layout of DDP's bucket: each gradient with its parameter's strides
            view = buffer.as_strided(p.size(), p.stride(), offset)
            view.copy_(p.grad)
            views.append(view)
            offset += p.numel()
        buffer.mul_(1.0 / state.world)  # as the comm hook (and DDP's reducer) does
        dist.all_reduce(buffer, group=state.group)
        todo: dict[Any, list[Tensor]] = {}
        for p, view in zip(params, views):
            p.grad = view
            ref = state.owner.get(p)
            opt = None if ref is None else ref()
            if opt is not None and not opt._lo_engine.no_step_depth:
                todo.setdefault(opt, []).append(p)
        for opt, owned in todo.items():
            opt._lo_engine.step_averaged(owned)
            n = state.steps[id(opt)] = state.steps.get(id(opt), 0) + len(owned)
            opt._lo_engine.last_backward_steps = n

    def check_done(self) -> None:
        if any(self.left):
            raise AttachError(_UNUSED)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def two_passes(engines: list[Any]) -> _TwoPasses:
    """The DDP side of ``layeropt.backward``'s passes for these engines (no-op without DDP)."""
    return _TwoPasses(engines)


class DDPAttachment:
    """Handle returned by :func:`attach_ddp`; ``remove()`` restores plain DDP.

    DDP cannot unregister a communication hook, so after ``remove()`` the
    hook stays and does exactly DDP's own job (average, leave the result in
    ``.grad``); attaching the same DDP model again re-activates it.

    The handle refers to the optimizers weakly (as :class:`layeropt.Attachment`
    does); a deleted optimizer's parameters are then only averaged, as by DDP.

    Attributes:
        params: the DDP-managed parameters stepped in backward.
    """

    def __init__(self, ddp: nn.Module, optimizers: list[Any], state: _HookState) -> None:
        self._ddp = weakref.ref(ddp)
        self._optimizers = [weakref.ref(o) for o in optimizers]
        self._state = state
        self.params: list[Tensor] = []
        self._removed = False
        self._hook_all()

    def _hook_all(self) -> None:
        ddp = self._ddp()
        if ddp is None:
            return
        managed = {id(p) for p in ddp.parameters() if not hasattr(p, "_ddp_ignored")}
        owner = {}
        for opt, b in layer_buckets(ddp.module, self.optimizers):
            for p in b.params:
                if id(p) in managed:
                    owner[p] = opt
        if not owner:
            raise AttachError(
                "the optimizer owns none of the parameters DDP synchronises. Build it "
                "from ddp_model.parameters() before attaching."
            )
        self.params = list(owner)
        for opt in owner.values():
            opt._lo_engine.ddp_count += 1  # opt.attached is True
        for opt in self.optimizers:
            opt._lo_engine.attachments.add(self)  # add_param_group -> _rebuild
        with self._state.lock:
            self._state.owner = {p: weakref.ref(o) for p, o in owner.items()}
            self._state.attachment = self
            self._state.active = True
            self._state.fresh = True  # (attached between a forward and its backward)

    @property
    def optimizers(self) -> list[Any]:
        """The (still alive) layeropt optimizers whose parameters are stepped."""
        return [o for o in (r() for r in self._optimizers) if o is not None]

    def _release(self) -> None:
        with self._state.lock:
            owner, self._state.owner = self._state.owner, {}
            self._state.active = False
        for ref in owner.values():
            opt = ref()
            if opt is not None:
                opt._lo_engine.ddp_count -= 1
        self.params = []

    stale = False  # requires_grad changes are not followed under DDP
    owned: list[Tensor] = []

    @property
    def model(self) -> nn.Module | None:
        """The DDP model (``None`` once it was deleted)."""
        return self._ddp()

    def sync(self, in_backward: bool = False) -> bool:
        """DDP fixes the set of synchronised parameters when wrapping: nothing to follow."""
        return False

    def _rebuild(self) -> None:
        """Re-read the optimizers' param groups (called on add_param_group)."""
        if not self._removed:
            self._release()
            self._hook_all()

    @property
    def stepped_in_backward(self) -> int:
        """Parameter updates made in the last synchronised backward."""
        return sum(self._state.steps.values())

    def remove(self) -> None:
        """Stop stepping in backward; DDP then averages into ``.grad`` as usual."""
        if not self._removed:
            self._release()
            for opt in self.optimizers:
                opt._lo_engine.attachments.discard(self)
            self._removed = True

    def __enter__(self) -> "DDPAttachment":
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else f"{len(self.params)} params"
        return f"<layeropt.DDPAttachment {state}>"


def _check_ddp(ddp: nn.Module) -> None:
    problems = {
        "find_unused_parameters=True": ddp.find_unused_parameters,
        "mixed_precision": getattr(ddp, "mixed_precision", None) is not None,
        "the Python reducer (compiled DDP)": getattr(ddp, "_use_python_reducer", False),
        "delayed all-reduce of every parameter": getattr(
            ddp, "_delay_all_reduce_all_params", False
        ),
    }
    for what, bad in problems.items():
        if bad:
            raise AttachError(
                f"layeropt cannot step in backward under DDP with {what}: a bucket's "
                "parameters would be stepped without knowing their global gradient. "
                "Construct DistributedDataParallel without it, or keep a plain "
                "torch.optim optimizer for this model."
            )
    if any(hooked_by(p) is not None for p in ddp.parameters()):
        raise AttachError(
            "some parameters of this DDP model carry plain layeropt hooks (attached "
            "before wrapping, or on ddp_model.module), which would step on local "
            "gradients. Call .remove() on that attachment, then attach the DDP model."
        )


def attach_ddp(
    ddp_model: nn.Module,
    optimizer: Optimizer | Iterable[Optimizer] | None = None,
    *,
    bucket_cap_mb: float = 1.0,
    overlap: bool = True,
) -> DDPAttachment:
    """Step a DistributedDataParallel model's buckets on their averaged gradients, in backward.

    Registers a DDP communication hook that, per bucket, frees the parameters'
    local ``.grad`` (DDP has copied them into the bucket) and averages the
    bucket over the process group, scaled by ``1/world_size`` and summed
    exactly as DDP's built-in reducer does; each parameter is then updated with
    torch's own ``step`` on its averaged slice, and ``.grad`` is ``None`` again
    when ``backward()`` returns. Results equal DDP + ``torch.optim`` bit for bit.

    Where the updates run: CPU buckets (gloo) are stepped at the end of
    backward, on the autograd thread, in bucket order (a communication thread
    would compete for the cores backward runs on; the gradients live in DDP's
    buckets either way). CUDA buckets are stepped in the all-reduce future's
    ``.then()``, on a stream that waits for the all-reduce, while backward
    computes earlier layers (``overlap=False``: at the end, as on CPU).

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` instance,
            with ``find_unused_parameters=False`` and no other comm hook.
        optimizer: a layeropt optimizer, several, or ``None`` for every live
            layeropt optimizer owning some of the model's parameters.
        bucket_cap_mb: at the end of backward, an optimizer's landed buckets
            wait, in bucket order, until together they hold this many MiB, and
            are then stepped with one call (as ``attach``'s option: fewer step
            calls; ``0`` steps each DDP bucket alone). Buckets stepped in
            ``.then()`` are stepped alone.
        overlap: ``True`` (default) steps CUDA buckets in ``.then()``;
            ``False`` steps every bucket at the end of backward.

    Returns:
        A :class:`DDPAttachment`; ``.remove()`` returns to plain DDP behaviour.

    Raises:
        TypeError: ``ddp_model`` is not DistributedDataParallel.
        AttachError: unsupported DDP option, another comm hook, parameters with
            plain layeropt hooks, or no owned parameters (see the message).

    Example:
        >>> ddp = DistributedDataParallel(model)  # doctest: +SKIP
        >>> opt = layeropt.Adam(ddp.parameters(), lr=1e-3)  # doctest: +SKIP
        >>> handle = attach_ddp(ddp, opt)  # doctest: +SKIP
        >>> loss_fn(ddp(x), y).backward()  # doctest: +SKIP
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"attach_ddp() needs a DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}; use layeropt.attach for other models."
        )
    if not bucket_cap_mb >= 0:
        raise ValueError(f"bucket_cap_mb must be >= 0, got {bucket_cap_mb}")
    optimizers = resolve_owners(ddp_model.module, optimizer)
    _check_ddp(ddp_model)
    state = _DDP_STATES.get(ddp_model)
    if state is not None and state.active:
        raise AttachError(
            "this DDP model is already attached; call .remove() on that handle first."
        )
    if state is None:
        hooks = getattr(ddp_model, "_comm_hooks", None)
        if hooks and all(type(st) is _Copied for _, st in hooks):
            hooks.clear()  # a copy of an attached model: its reducer was built without them
        if hooks:
            raise AttachError(
                "this DDP model already has a communication hook, and DDP accepts only "
                "one. layeropt needs its own (it averages, then steps each bucket): "
                "build the DDP model without register_comm_hook."
            )
        state = _HookState(ddp_model, overlap)
        ddp_model.register_forward_pre_hook(state.forward)
        ddp_model.register_comm_hook(state, _allreduce_then_step)
        # The reducer must not copy buckets back into .grad after the hook.
        ddp_model.reducer._set_optimizer_in_backward()
        _DDP_STATES[ddp_model] = state
    state.overlap = overlap
    for opt in optimizers:
        opt._lo_engine.cap_bytes = int(bucket_cap_mb * 2**20)
    return DDPAttachment(ddp_model, optimizers, state)


register_wrapper(torch.nn.parallel.DistributedDataParallel, attach_ddp)  # layeropt.attach(ddp)
