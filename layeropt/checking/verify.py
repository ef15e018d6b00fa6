"""Check it in your own loop: the first N training steps run both ways.

``LAYEROPT_VERIFY=N python train.py`` (or ``layeropt.attach(model, opt,
verify=N)``) makes an attached optimizer run its first ``N`` training steps
with torch's own semantics, for real: gradients stay in ``.grad`` until
``step()``, which applies them with the torch class's own ``step`` after
whatever the loop did in between. Beside it, every update the hooks would
have made during backward is computed on a *shadow* of its bucket - the
bucket's parameters and optimizer state are saved, the in-backward update
runs on copies of the gradients exactly as it would (the same grouping, the
same unscaling and clipping, ``InBackwardOptimizer._step_params``), its
result is fingerprinted, and everything is restored. Only fingerprints are
kept (a 128-bit hash of the bytes, with the sum and the norm to say how
large a difference is), one bucket's copies at a time.

At each ``step()`` the real results are compared with the shadow's, bit for
bit (``-0.0`` and ``0.0`` are one value, as ``torch.equal`` has it). The
first difference raises :class:`~layeropt.errors.VerifyError`, naming the
parameter, the training step, how large the difference is and its likely
cause - a gradient edited or discarded after backward, gradients not zeroed
between steps, ``step()`` called again on a gradient it applied, a parameter
or its optimizer state changed after its update would have run, or an
update that differs with the same inputs (an optimizer whose ``step()``
reads other parameters' gradients; a bug in layeropt) - with the fix. The
loop's own refusals (accumulation, clipping after backward, ...) are raised
as usual: in-backward updating would refuse them too. After ``N`` equal
steps a warning says so once, and the optimizer updates in backward from
then on, at no further cost.

A forward between a backward and its ``step()`` that reads a parameter the
backward updated (an actor's loss through a critic) is refused at that forward
once the loop has called ``step()``, verified or not; in its first training
step, only verify finds it: a forward pre-hook on each module while verifying
(``layeropt/checking/forwards.py``), :class:`~layeropt.errors.VerifyError` at
the ``step()`` after it.

A loop that never calls ``step()`` (each ``layeropt.backward`` is a step)
goes on to a ``zero_grad()`` or to its next forward instead (the attached
model's pre-hook): there
(:meth:`Verifier.settle`) the pending step is applied with torch's ``step``
and compared, a warning says the loop steps in backward, and verification
ends - the loop trains as it does without ``LAYEROPT_VERIFY``; a ``step()``
after that forward (a loop with a loss for each of two optimizers before
their steps) warns that the steps since were not verified. After a
``zero_grad()`` the verifier stays, updating in backward, to see whether the
loop calls ``step()`` after all: then that ``zero_grad()`` discarded a
backward that in-backward updating had already applied (a skipped first
batch), and :class:`~layeropt.errors.VerifyError` says so. A program that
ends before ``N`` steps were verified says so when it exits.

Memory during verified steps is torch's: every gradient is kept until
``step()``.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import os
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from ..engine.registry import is_dtensor
from ..engine.stepper import Wrapper, outside_autocast
from ..engine.subset import _restore, _Saved, _snapshot
from ..engine.transforms import prepare_grads, unscaled_in_kernel
from .forwards import read_ahead, say_at_next_step, watch
from ..errors import (
    VERIFY_CAUSES,
    VERIFY_ENDED,
    VERIFY_ERROR,
    VERIFY_NO_STEP,
    VERIFY_OFFLOAD_ERROR,
    VERIFY_PASSED,
    LayeroptError,
    VerifyError,
    warn,
)

__all__ = ["Verifier", "verify", "verify_steps"]

# The causes errors.VERIFY_CAUSES names, and those the loop's order of calls decides.
CAUSES = {
    **VERIFY_CAUSES,
    "state": (
        "its optimizer state changed between backward and step() (a reset or an edit of "
        "optimizer.state, e.g. state['exp_avg'].zero_()): torch's step() reads the changed "
        "state, but in-backward updating had already read and updated it, so the change is "
        "overwritten. Change optimizer state before backward or after step()."
    ),
    "again": (
        "step() was called again on a gradient already applied (no backward since): "
        "torch applies it a second time, while in-backward updating applied each backward's "
        "gradient once and freed it. Call step() once per backward, zero_grad() between."
    ),
    "skipped": (
        "a backward's gradients discarded by zero_grad() before the first step(): layeropt "
        "had already applied them (before a loop's first step() it takes each backward for "
        "a training step of its own, as in a loop that never calls step()), where torch "
        "drops them. Keep that backward from updating the parameters (requires_grad_(False) "
        "during it, or it inside `with opt.no_step():`), or skip the batch before backward."
    ),
}


def verify_steps(verify: int | None) -> int:
    """How many training steps to verify: ``verify`` if given, else ``LAYEROPT_VERIFY``."""
    if verify is None:
        text = os.environ.get("LAYEROPT_VERIFY", "").strip() or "0"
        try:
            verify = int(text)
        except ValueError:
            raise ValueError(
                f"LAYEROPT_VERIFY={text!r}: give the number of training steps to verify, "
                "e.g. LAYEROPT_VERIFY=3 (0 or unset: none)") from None
    if verify < 0:
        raise ValueError(f"verify must be >= 0 training steps, got {verify}")
    return verify


def verify(engine: Any, steps: int) -> None:
    """Run ``engine``'s next ``steps`` training steps both ways; 0: stop verifying.

    A verifier already running goes on with the new count and what it has seen (a
    gradient a ``step()`` applied is still known when the model is attached again). A
    backward shadowed and waiting for ``step()`` stays with its verifier, as the first
    of those steps (the last, for 0): its gradients are still in ``.grad``, which the
    engine counts as applied already (unwrapped, ``step()`` would refuse them)."""
    current = engine.find(Verifier)
    if current is not None and (current.shadows or steps > 0):
        current.left = max(steps, 1)
        return
    if current is not None:
        current.unwatch()
        engine.unwrap(current)
    if steps > 0:
        engine.wrap(Verifier(engine, steps))


def _alone(engine: Any) -> None:
    """The shadow saves and restores the state where torch keeps it: no other feature
    (``offload_state``) may wrap the stepper under the verifier."""
    inner = engine.stepper
    while isinstance(inner, Verifier):
        inner = inner.inner
    if isinstance(inner, Wrapper):
        raise LayeroptError(VERIFY_OFFLOAD_ERROR)


class Print(NamedTuple):
    """A tensor's fingerprint: its bytes' hash (``-0.0`` as ``0.0``), sum and norm."""

    digest: bytes
    total: float
    norm: float


def _local(t: Tensor) -> Tensor:
    """``t``, or this process's shard of a DTensor."""
    return t.to_local() if is_dtensor(t) else t


def fingerprint(t: Tensor) -> Print:
    t = _local(t).detach()  # (each process checks its own shard)
    if t.is_floating_point() or t.is_complex():
        t = t + 0  # -0.0 + 0 is 0.0: the two zeros are one value, as torch.equal has it
    data = t.contiguous().cpu().reshape(-1)  # (a 0-dim step counter too)
    digest = hashlib.blake2b(data.view(torch.uint8).numpy().tobytes(), digest_size=16).digest()
    as_double = data.double() if not data.is_complex() else data.abs().double()
    return Print(digest, float(as_double.sum()), float(as_double.norm()))


class _Shadow(NamedTuple):
    """What the in-backward update of one parameter would have done, and its inputs."""

    grad: Print  # the gradient it would have applied (after unscaling and clipping)
    param_before: Print
    param_after: Print
    state_after: dict[str, Print]
    name: str
    state: dict[str, tuple[Tensor, int]]  # its state's tensors, and their versions, as found


_ACTIVE: weakref.WeakSet = weakref.WeakSet()  # verifiers still verifying (reported at exit)


@atexit.register
def _report_unfinished() -> None:
    """A program that ends before its verifiers finished: how far they got."""
    for v in list(_ACTIVE):
        pending = "; the last backward's update was not applied: no step() followed it" \
            if v.shadows else ""
        warn(VERIFY_ENDED.format(n=v.done, total=v.done + v.left, pending=pending))


def _stamps(optimizer: Any, p: Tensor) -> dict[str, tuple[Tensor, int]]:
    """``p``'s optimizer state tensors and their versions: any in-place edit, or another
    tensor put there, shows (O(1) each, nothing copied)."""
    return {k: (v, v._version) for k, v in optimizer.state.get(p, {}).items()
            if isinstance(v, Tensor)}


def _same(stamps: dict[str, tuple[Tensor, int]], now: dict[str, tuple[Tensor, int]]) -> bool:
    return stamps.keys() == now.keys() and all(
        now[k][0] is t and now[k][1] == v for k, (t, v) in stamps.items())


def _digests(optimizer: Any, p: Tensor) -> tuple[bytes, dict[str, bytes]]:
    """What ``p`` and its optimizer state are, as fingerprints' digests."""
    return fingerprint(p).digest, {k: fingerprint(v).digest for k, v in
                                   optimizer.state.get(p, {}).items() if isinstance(v, Tensor)}


def _zero_watch(verifier: Verifier, param: Tensor) -> Callable[[Tensor], None]:
    """A tensor hook on ``param`` (it runs before its gradient is added onto ``.grad``):
    calls :meth:`Verifier.before_accumulating`; weak both ways, as the forward hook."""
    refs = weakref.ref(verifier), weakref.ref(param)

    def hook(grad: Tensor) -> None:
        v, p = refs[0](), refs[1]()
        if v is not None and p is not None:
            v.before_accumulating(p)

    return hook


def _remove_hooks(handles: dict[int, Any]) -> None:
    for handle in handles.values():
        handle.remove()
    handles.clear()


class Verifier(Wrapper):
    """The first ``steps`` training steps of one optimizer, run both ways (module docstring).

    A stepper wrapper (``layeropt/engine/stepper.py``): a step call in backward runs on
    a shadow (:meth:`shadow`), ``optimizer.step()`` applies torch's own step and
    compares, ``zero_grad()`` may settle a loop without ``step()``.

    Args:
        engine: the optimizer's engine (``layeropt/engine/landing.py``).
        steps: how many ``step()`` calls to verify.
    """

    def __init__(self, engine: Any, steps: int) -> None:
        super().__init__()
        _alone(engine)
        self.engine = engine
        self.left = steps
        self.done = 0  # training steps verified
        self.shadows: dict[Tensor, _Shadow] = {}  # this training step's in-backward updates
        # id(param) -> its .grad after the last step(), and that tensor's version then
        self.unzeroed: dict[int, tuple[Tensor, int]] = {}
        # the latest backward's record when step() ran, and the parameters it applied
        # (held, not ids: an id of a freed tensor is another tensor's later)
        self.applied: tuple[Any, list[Tensor]] = (None, [])
        self.discarded: tuple[str, int] | None = None  # settled at a zero_grad(): see settle
        self.settled: set[Tensor] | None = None  # settled at a forward: see settle
        self.read: str | None = None  # that forward read them: said at a step() after it
        self.kernel_scale: Tensor | None = None  # see unscale_in_kernel
        self.forward_hooks: dict[int, Any] = {}  # id(module) -> its forward pre-hook's handle
        self.grad_hooks: dict[int, Any] = {}  # id(param) -> its tensor hook's handle
        # (a verifier dropped while verifying, its optimizer deleted: its hooks go with it)
        weakref.finalize(self, _remove_hooks, self.forward_hooks)
        weakref.finalize(self, _remove_hooks, self.grad_hooks)
        _ACTIVE.add(self)

    # -- the stepper ---------------------------------------------------------------
    def step(self, engine: Any, optimizer: Any, groups: list[Any], params: list[Tensor],
             transform: Any) -> list[Tensor]:
        if self.discarded is not None:  # (settled: updating in backward, watching step())
            return self.inner.step(engine, optimizer, groups, params, transform)
        return self.shadow(optimizer, groups, transform)

    def zero_grad(self, engine: Any, set_to_none: bool,
                  torch_zero_grad: Callable[[bool], None]) -> None:
        self.settle("optimizer.zero_grad()")  # (a loop that never calls step())
        self.zeroed(None)
        self.inner.zero_grad(engine, set_to_none, torch_zero_grad)

    def regrown(self, params: list[Tensor]) -> list[Tensor]:
        """A shadowed update leaves torch's gradient in ``.grad`` for ``step()``: not
        one written since."""
        return [p for p in self.inner.regrown(params) if p not in self.shadows]

    # -- the in-backward side ---------------------------------------------------
    def shadow(self, optimizer: Any, groups: list[Any], transform: Any) -> list[Tensor]:
        """The in-backward update of ``groups`` (Bucket / Group), on a shadow: computed,
        fingerprinted, and undone; the real ``.grad`` stay for ``step()``. Returns the
        parameters in-backward updating would have stepped.

        Not a leaf frozen after its forward whose ``.grad`` was kept since ``step()``:
        torch still adds its gradient onto it and runs its hooks, where in-backward
        updating (whose ``.grad`` was freed) never sees one. A frozen one's gradient
        held by ``no_step()`` is stepped, as in backward (DDP hands it over)."""
        self._watch_forwards()
        stepped = [p for g in groups for p in g.params if self._steps(p)]
        # the groups' parameters in one step call, as the engine's stepper makes it
        # (torch picks some updates by the whole list: engine/wholestep.py)
        each = [[p for p in g.params if p not in self.shadows and self._steps(p)]
                for g in groups]
        params = [p for ps in each for p in ps]
        if not params:
            return stepped
        self.check_zeroed(params)
        saved, values = _Saved(optimizer, params), _snapshot(optimizer)
        grads = [p.grad for p in params]
        before = {p: fingerprint(p) for p in params}
        try:
            for p in params:
                p.grad = p.grad.clone()  # unscaling and clipping act on copies
            for g, ps in zip(groups, each):
                s = g.settings
                if ps and (transform is not None or (s is not None and s.clips)):
                    prepare_grads(ps, transform, s)
            used = {p: fingerprint(p.grad) for p in params}  # the gradient it applies
            with outside_autocast():  # (as in backward: layeropt/engine/stepper.py)
                optimizer._step_params(params)
            for p in params:
                state = optimizer.state.get(p, {})
                self.shadows[p] = _Shadow(
                    used[p], before[p], fingerprint(p),
                    {k: fingerprint(v) for k, v in state.items() if isinstance(v, Tensor)},
                    self.engine.name_of(p), {})
        finally:
            for p, grad in zip(params, grads):
                # a DDP bucket's averaged slice: its own memory, as DDP's write-back
                p.grad = grad if grad._base is None else grad.clone()
            saved.restore(optimizer)
            _restore(optimizer, values)
        for p in params:  # (restored in place: torch's step() must find these unchanged)
            self.shadows[p] = self.shadows[p]._replace(state=_stamps(optimizer, p))
        return stepped

    def _steps(self, p: Tensor) -> bool:
        kept = self.unzeroed.get(id(p))
        return p.requires_grad or kept is None or p.grad is not kept[0]

    def check_zeroed(self, params: list[Tensor]) -> None:
        """Refuse gradients accumulated onto the last step's: autograd adds into the
        ``.grad`` it finds, in place, so a gradient no ``zero_grad()`` (or ``p.grad =
        None``) removed since ``step()`` is still the same tensor."""
        for p in params:
            if self.kept_since_step(p):
                self._fail(p, "not zeroed", self.engine.name_of(p), "")

    def kept_since_step(self, p: Tensor) -> bool:
        """Whether ``p.grad`` is the gradient the last ``step()`` applied, kept by torch
        (no ``zero_grad()`` since): not one a ``no_step()`` backward holds."""
        kept = self.unzeroed.get(id(p))
        return kept is not None and p.grad is kept[0]

    def before_accumulating(self, p: Tensor) -> None:
        """``p``'s gradient is about to be added onto ``p.grad``: a ``.grad`` kept since
        ``step()`` but zeroed in place (``p.grad.zero_()``, wherever the loop does it) is
        not the last step's gradient any more - adding onto zeros is exact."""
        kept = self.unzeroed.get(id(p))
        if kept is not None and p.grad is kept[0] and not _local(kept[0]).any():
            del self.unzeroed[id(p)]

    def freed(self) -> set[int]:
        """Parameters (by ``id``) whose gradient in-backward updating would have applied and
        freed by now, while torch's stays in ``.grad``: those of pending shadows, and those
        ``step()`` applied after the latest backward. Another optimizer's ``step()`` on them
        is refused, as the attached loop's (``layeropt/checking/watch.py``). None once
        detached: its optimizer is torch's again."""
        if not self.engine.attachments:
            return set()
        record, params = self.applied  # (a zero_grad() since: torch's are gone too)
        applied = record is self.engine.last and not record.zeroed
        return {id(p) for p in [*self.shadows, *(params if applied else ())]}

    def unscale_in_kernel(self, scale: Tensor) -> None:
        """After ``layeropt.backward(scaler=)``'s step pass on a fused optimizer: torch's
        recipe, ``scaler.step(opt)``, divides by the scale in the fused kernel
        (``grad_scale``). The real step does so itself: the scaler, which layeropt left
        as after ``unscale_``, keeps what ``grad_scale`` it finds (torch 2.6 and later)
        or sets none (earlier), and ``opt.step()`` alone sets none."""
        self.kernel_scale = scale

    def transform_real(self, params: list[Tensor], transform: Any) -> None:
        """After ``layeropt.backward``'s step pass: its unscaling and clipping applied to
        the real gradients it shadowed, as torch's recipe applies them before step()."""
        grads = [p for p in params if p.grad is not None]
        if grads and (transform.inv_scale is not None or transform.coef is not None):
            prepare_grads(grads, transform, None)

    def transform_kept(self, optimizer: Any, transform: Any) -> None:
        """After ``layeropt.backward``'s step pass: the zeros ``zero_grad(set_to_none=False)``
        kept in ``.grad`` of parameters this backward did not reach, scaled as torch's
        ``clip_grad_norm_`` scales every ``.grad`` it is given (0 times a non-finite
        coefficient: NaN). A DDP bucket hands them back only after backward, past the
        shadowing; scaling a zero again changes nothing."""
        chosen = transform.clipped
        if transform.coef is None:  # (unscaling keeps a zero a zero)
            return
        zeros = [p for g in optimizer.param_groups for p in g["params"]
                 if p.grad is not None and p not in self.shadows
                 and (chosen is None or id(p) in chosen) and not _local(p.grad).any()]
        if zeros:
            prepare_grads(zeros, transform._replace(inv_scale=None), None)

    def zeroed(self, params: Callable[[], Any] | None) -> None:
        """``zero_grad()`` (the optimizer's: all; a module's: ``params()``)."""
        if params is None:
            self.unzeroed.clear()
        else:
            gone = {id(p) for p in params()}
            for i in gone:
                self.unzeroed.pop(i, None)
            record, applied = self.applied  # (not freed by the step any more: zeroed)
            self.applied = (record, [p for p in applied if id(p) not in gone])

    # -- the real side ----------------------------------------------------------
    def step_call(self, engine: Any, closure: Callable[[], Any] | None) -> Any:
        """``optimizer.step()``: the in-backward step's leftovers on the shadow, torch's
        own step for real, then the comparison (raises :class:`VerifyError`)."""
        if self.discarded is not None:  # (settle: that zero_grad() discarded a step)
            name, step = self.discarded
            self._end()
            raise VerifyError(VERIFY_ERROR.format(name=name, step=step, size="-",
                                                  cause=CAUSES["skipped"]))
        optimizer = engine._optimizer()
        _alone(engine)
        loss = None
        if closure is not None:
            with engine.closure(), torch.enable_grad():
                loss = closure()
        engine.check_boundary("step()")  # (what in-backward updating refuses, refused)
        leftovers = self._apply(optimizer)
        self.done += 1
        self.left -= 1
        if self.left > 0:
            engine.end_step([])  # (real .grad stays: only what a skipped step dropped is kept)
        else:
            # In backward from here: this step() ends as in-backward updating's does. It
            # leaves no gradient it applied in .grad (kept, they were stepped again as new
            # where a layer frozen after its forward is reached), and the engine knows
            # what torch keeps there (the zeros of a zero_grad(set_to_none=False)).
            for p in self.applied[1]:
                p.grad = None
            engine.end_step(leftovers)
            warn(VERIFY_PASSED.format(n=self.done))
            self._end()
        engine.took_leftovers(leftovers)  # (the hooks as in-backward updating's step() leaves them)
        return loss

    def detached_step_call(self, engine: Any, torch_step: Callable[[], Any],
                           closure: Callable[[], Any] | None) -> Any:
        """``step()`` after ``remove()`` ended the attachment of a verified backward:
        its gradients in ``.grad`` are torch's, not applied yet, so this ``step()`` is
        verified as an attached one (torch's own step, then the comparison)."""
        if self.shadows:
            return self.step_call(engine, closure)
        return self.inner.detached_step_call(engine, torch_step, closure)

    def settle(self, where: str, discards: bool = True) -> None:
        """The loop went on (``where``: a ``zero_grad()``, its next forward) after a
        backward whose updates wait for a ``step()``, and has never called ``step()``:
        each backward is its own training step. Apply this one as ``step()`` would,
        compare, and end verification (the loop updates in backward from now on).

        At a ``zero_grad()`` (``discards``) the verifier stays, updating in backward:
        torch drops those gradients there, so a loop that calls ``step()`` later was not
        one without ``step()`` - its ``zero_grad()`` discarded a backward (a skipped first
        batch) that in-backward updating applied, and that ``step()`` raises. At a
        forward, verification ends; a ``step()`` after it says that forward came between
        a backward and its ``step()`` (another loss's), and that the steps since were not
        verified (a warning, by a step pre-hook of the optimizer's that goes with it) - or
        raises where a forward before it read what was applied here."""
        engine = self.engine
        optimizer = engine._optimizer()
        if not engine.attachments:  # detached: nothing of it acts any more
            self.unwatch()
            return
        if not self.shadows or "step()" in engine.calls or optimizer is None:
            return  # (a loop that calls step(): the usual rules decide)
        stepped = list(self.shadows)
        name = self.shadows[stepped[0]].name
        self._apply(optimizer)
        engine.applied_late(stepped)
        self.unzeroed.clear()
        self.done += 1
        warn(VERIFY_NO_STEP.format(where=where, n=self.done))
        if discards:
            self.discarded = (name, self.done)
            self.unwatch()
        else:
            self.settled = set(stepped)  # read before a step(): said at that step()
            self.engine.unwrap(self)  # in backward from the next backward on
            say_at_next_step(optimizer, self)  # (the watch ends there, or at the next forward)

    def _watch_forwards(self) -> None:
        """Forward pre-hooks on the attached models and their modules
        (``layeropt/checking/forwards.py``)."""
        watch(self, self.forward_hooks)

    def on_forward(self, module: Any, root: bool) -> None:
        """A watched forward begins. An attached model's (``root``) applies a pending
        step (:meth:`settle`), and a gradient the loop zeroed in place since ``step()``
        (``p.grad.zero_()``) is no longer the last step's (also where no tensor hook sees
        it: FSDP2's sharded gradients are written by FSDP, not accumulated by autograd).
        One in the forward that settled it, reading what was applied, is noted for the
        ``step()`` after it, if one comes (``forwards.read_ahead``)."""
        if root and self.settled is not None:  # the forward after a settled one: no
            self.unwatch()  # step() came between (a loop without step())
            return
        if root:
            self.settle("its next forward", discards=False)
            for key in [k for k, (g, _) in self.unzeroed.items() if not g.any()]:
                del self.unzeroed[key]
        self.read = self.read or read_ahead(module, self)  # (said at a step() after it)

    def _end(self) -> None:
        self.unwatch()
        self.engine.unwrap(self)  # in backward from the next backward on

    def unwatch(self) -> None:
        """Its hooks off, and off the list of verifiers reported at exit."""
        _ACTIVE.discard(self)
        _remove_hooks(self.forward_hooks)
        _remove_hooks(self.grad_hooks)

    def _apply(self, optimizer: Any) -> list[Tensor]:
        """Torch's own step on what the loop left in ``.grad``, then the comparison with
        the shadows (raises :class:`VerifyError`). Returns the parameters whose gradients
        ``step()`` itself applies in backward mode (no hook took them)."""
        engine = self.engine
        engine.show_kept()  # (zeros torch keeps, .grad dropped since by a skipped step)
        leftovers = [p for g in optimizer.param_groups for p in g["params"]
                     if p.grad is not None and p not in self.shadows]
        # step() again on the gradient it applied (nothing added to it, nothing done to
        # it): in backward mode it finds no gradient and leaves these as they are
        # (not the zeros zero_grad(set_to_none=False) keeps, nothing added since: step()
        # updates on them each time in backward mode too, as torch's - engine.unused_kept)
        kept_zeros, used = engine.kept_grads or {}, {id(p) for p in engine._this_step()}
        for p in leftovers:
            if kept_zeros.get(id(p)) is p and id(p) not in used and not _local(p.grad).any():
                self.unzeroed.pop(id(p), None)
        again = {p: _digests(optimizer, p) for p in leftovers
                 if (kept := self.unzeroed.get(id(p))) is not None
                 and p.grad is kept[0] and _local(kept[0])._version == kept[1]}
        leftovers = [p for p in leftovers if p not in again]
        if leftovers:  # what step() itself updates in backward mode (held, set by hand)
            self.shadow(optimizer, engine.placed(leftovers), None)
        for g in engine.placed(list(self.shadows)):  # attach's clipping, as in backward
            if g.settings is not None and g.settings.clips:
                prepare_grads([p for p in g.params if p.grad is not None], None, g.settings)
        grads = {p: None if p.grad is None else fingerprint(p.grad) for p in self.shadows}
        moved = {p for p, shadow in self.shadows.items()
                 if fingerprint(p).digest != shadow.param_before.digest}
        restated = {p for p, shadow in self.shadows.items()
                    if not _same(shadow.state, _stamps(optimizer, p))}
        scale, self.kernel_scale = self.kernel_scale, None
        with contextlib.nullcontext() if scale is None else unscaled_in_kernel(optimizer, scale):
            type(optimizer)._torch_step(optimizer)  # torch's own step, on what the loop left
        optimizer._opt_called = True
        try:
            for p, before in again.items():
                if _digests(optimizer, p) != before:
                    self._fail(p, "again", engine.name_of(p), "")
            for p, shadow in self.shadows.items():
                self._compare(optimizer, p, shadow, grads[p], p in moved, p in restated)
        finally:
            self.applied = (engine.last, list(self.shadows))
            self.shadows = {}
            self._keep(optimizer)
        return leftovers

    def _keep(self, optimizer: Any) -> None:
        """After ``step()``: the gradients torch keeps, each to be zeroed before it is added
        onto (:meth:`check_zeroed`), with a tensor hook to see a zeroing in place."""
        self.unzeroed = {}
        for g in optimizer.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                self.unzeroed[id(p)] = (p.grad, _local(p.grad)._version)  # (FSDP2 adds
                # into the shard itself, sharded_param.grad._local_tensor += new)
                if id(p) not in self.grad_hooks and p.requires_grad:
                    self.grad_hooks[id(p)] = p.register_hook(_zero_watch(self, p))

    def _compare(self, optimizer: Any, p: Tensor, shadow: _Shadow, grad: Print | None,
                 moved: bool, restated: bool) -> None:
        state = optimizer.state.get(p, {})
        real = {k: fingerprint(v) for k, v in state.items() if isinstance(v, Tensor)}
        after = fingerprint(p)
        if after.digest == shadow.param_after.digest and {
                k: v.digest for k, v in real.items()} == {
                k: v.digest for k, v in shadow.state_after.items()}:
            return
        size = (f"the parameter's sum differs by {abs(after.total - shadow.param_after.total):.3g} "
                f"and its norm by {abs(after.norm - shadow.param_after.norm):.3g}")
        if grad is None:
            cause = "discarded"
        elif grad.digest != shadow.grad.digest:
            cause = "edited"
        elif moved:
            cause = "moved"
        elif restated:
            cause = "state"
        else:
            cause = "update"
        self._fail(p, cause, shadow.name, size)

    def _fail(self, p: Tensor, cause: str, name: str, size: str) -> None:
        self.shadows = {}
        self.unwatch()  # (the error says how it ended)
        raise VerifyError(VERIFY_ERROR.format(
            name=name, step=self.done + 1, size=size or "-", cause=CAUSES[cause]))
