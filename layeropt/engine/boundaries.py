"""Training steps at one engine: what a step holds for later, and its boundaries.

The base of ``rules.Rules`` (and so of ``landing.Engine``). A
:class:`StepRecord` is made at each training-step boundary - ``step()``,
``zero_grad()`` - and holds what belongs to one training step: how many of
its backwards updated parameters or held every gradient (the accumulation
rule), the gradients held for a later step, the param groups as its first
update read them. Here also:

* held gradients: kept in ``.grad`` (or in the store a feature installs:
  ``layeropt/engine/stepper.py``) by ``no_step()`` and the other holds, stepped
  with their bucket when it completes, at the end of the next stepping
  backward, by ``layeropt.backward``'s step pass or by ``step()``;
* the boundaries (rule 6 of ``layeropt/engine/rules.py``): ``step()`` steps what the
  hooks left (held, assigned by hand; a zero gradient for what
  ``zero_grad(set_to_none=False)`` keeps) and refuses a gradient set on a
  parameter backward already updated; ``step()``/``zero_grad()`` refuse what
  torch would take as one step of several, hyperparameters changed after
  backward, and a ``zero_grad()`` that discards what a backward applied
  (what torch keeps for ``zero_grad()``: its base, ``layeropt/engine/zeroing.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor, nn

from . import between as _between
from .registry import ENGINES, hooked_by
from .stepper import _autocast_on
from .zeroing import DETACHED, Zeroing
from ..errors import (
    ACCUMULATION_ERROR,
    AUTOCAST_STEP_ERROR,
    AttachError,
    DISCARD_ERROR,
    EARLY_DISCARD_APPLIED,
    EARLY_DISCARD_ERROR,
    FAULT_ERROR,
    SAVE_OPEN_WARNING,
    SCALED_CLIP_ERROR,
    BackwardStateError,
    LayeroptError,
    warn,
)

__all__ = ["StepRecord", "StepRules", "Group", "take_over", "refuse_open_updates"]

# in ``calls``: a zero_grad() discarded applied gradients before the loop's first step()
_EARLY_DISCARD = "discarded before the first step()"
_STEP_TRIED = "step() called"  # (its first may be refused: a loop that calls step())
_STEP_EXPECTED = "step() expected"  # (expect_step(): the loop is known to call step())
REMOVE_WARNED = "remove() warned"  # (REMOVE_OPEN_WARNING, said once per optimizer)
SAVE_WARNED = "state_dict() warned"  # (a checkpoint ahead of torch's, said once)
EARLY_DISCARD_BACKWARD_ERROR = (
    "this backward's update raised {error}, on optimizer state that an earlier attached "
    "backward's update made before a zero_grad() discarded that backward's gradients. If "
    "this loop calls step(), torch dropped those gradients (a batch skipped before the "
    "first step, say) and never made that state, so the results differ from there on: "
    "skip a batch before its backward, or run that backward inside `with opt.no_step():` "
    "so that zero_grad() drops its gradients as torch does. (In a loop without step(), "
    "where each backward is a step, this is torch's own error.)"
)


class Group(NamedTuple):
    """Parameters stepped in one call, with the ``Settings`` that clip them: the part of
    a bucket that landed, an averaged DDP bucket, one module's held gradients."""

    params: list[Tensor]
    settings: Any


# torch.optim's updates that autocast leaves as they are: elementwise, reading no tensor
# of another dtype that an op autocast casts would change (Adafactor multiplies matrices)
_ELEMENTWISE = {"SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "NAdam", "RAdam",
                "ASGD", "Rprop", "RMSprop", "SparseAdam"}


def _autocast_may_change(optimizer: Any) -> bool:
    """Whether ``optimizer``'s update may differ under ``torch.autocast`` (not one of
    torch.optim's elementwise ones, with torch's own step)."""
    base = next((c for c in type(optimizer).__mro__ if c.__module__.startswith("torch.optim")
                 and c.__name__ in _ELEMENTWISE), None)
    return base is None or not getattr(optimizer._lo_stepper, "narrow", False)


class StepRecord:
    """One training step at one engine, from a ``step()``/``zero_grad()`` to the next.

    Attributes:
        stepped_backwards / held_backwards: its backwards that updated parameters,
            or held every gradient for ``step()`` (the accumulation rule);
            ``held_after_step``: a backward held for ``step()`` after a stepping one.
        held: gradients kept for a later step (``no_step()`` and the other holds),
            with their bucket (``None``: not hooked yet); in ``.grad``, or in the
            stepper's store (``layeropt/engine/stepper.py``).
        hyper / hyper_txn: the param groups as its first update read them, and
            the transaction that update belonged to (``layeropt/engine/between.py``).
        skipped: parameters torch still holds a ``.grad`` for, which no record of a
            backward lists: those of a step ``GradScaler`` skipped (inf/NaN;
            ``scaler_skipped``: carried through the ``step()`` a fused optimizer's
            ``scaler.step`` calls), and those the previous ``step()`` updated;
            ``zero_grad(set_to_none=False)`` keeps them as zeros.
        faulted: a backward of it raised after updating parameters: how many and the
            first one's name (:meth:`StepRules.check_boundary` refuses the step's end).
        updated: the parameters its backwards updated, with their version counters
            just after (``layeropt/engine/between.py``: a write since is refused).
        clipped_zeros: the kept zeros ``layeropt.backward`` clipped into ``.grad`` (by
            ``id`` of the parameter), which ``step()`` updates on: not gradients a later
            clipped backward of the step holds and steps.
    """

    __slots__ = ("stepped_backwards", "held_backwards", "held_after_step", "held", "hyper",
                 "hyper_txn", "skipped", "scaler_skipped", "faulted", "clipped_zeros",
                 "updated", "__weakref__")  # (a watcher's note names a step without keeping it)

    def __init__(self) -> None:
        self.stepped_backwards = self.held_backwards = 0
        self.held_after_step = False  # a held backward came after a stepping one
        self.held: dict[Tensor, Any] = {}
        self.skipped: list[Tensor] = []
        self.scaler_skipped: list[Tensor] = []  # (what skip() added to skipped)
        self.faulted: tuple[int, str] | None = None
        self.hyper: list[dict[str, Any]] | None = None
        self.hyper_txn = -1
        self.clipped_zeros: dict[int, Tensor] = {}
        self.updated: dict[Tensor, int] = {}


class StepRules(Zeroing):
    """The engine's training-step side (see the module docstring)."""

    # What it uses of the rest of the engine: its state (set in Rules.__init__ and
    # Engine.__init__) and the methods Rules and Engine define.
    train_step: StepRecord
    attachments: dict[Any, None]
    _optimizer: Callable[[], Any]
    stepper: Any  # how a step call updates; its ``held`` store (layeropt/engine/stepper.py)
    last: Any  # the latest BackwardRecord (rules.py)
    measure: Any  # layeropt.backward's measure pass, or None
    no_step_depth: int
    calls: set[str]
    clips: bool  # (Engine.clips)
    _step: Callable[[list[Any]], None]  # (Engine._step: one step call)
    placed: Callable[[list[Tensor]], list[Group]]  # (Engine.placed)
    name_of: Callable[[Tensor], str]  # (Engine.name_of)
    _abort: Callable[[Any], None]  # (Rules._abort: a backward that raised)
    closure: Callable[[], contextlib.AbstractContextManager[None]]  # (Rules.closure)
    on_param_groups_changed: Callable[..., None]  # (Engine.on_param_groups_changed)

    # -- held gradients ----------------------------------------------------------
    def _take(self, param: Tensor) -> None:
        """The measure pass reduces ``param``'s gradient, plus its held one (in a store:
        a copy for the moment)."""
        m = self.measure
        store = self.stepper.held
        if param not in store or id(param) in m.summed:
            m.take(param)
            return
        m.stash[param] = store.fetch(param)
        try:
            m.take(param)
        finally:
            del m.stash[param]

    def unhold(self, bucket: Any) -> None:
        """``bucket`` completed: its accumulated gradients are stepped with it (those in
        a store brought back now)."""
        held = self.train_step.held
        store = self.stepper.held
        if store:
            store.up([p for p in bucket.params if p in held])
        for p in bucket.params:
            held.pop(p, None)

    def _step_stored(self) -> None:
        """Step the held gradients still in a store, a bucket at a time, each brought
        back just before its step (the stepper brings the bucket's state with it)."""
        store = self.stepper.held
        if not store:
            return
        buckets: dict[int, tuple[Any, list[Tensor]]] = {}
        for p, b in self.train_step.held.items():
            if p in store:
                buckets.setdefault(id(b), (b, []))[1].append(p)
        for b, params in buckets.values():  # (a bucket's in its order: clip_grad_norm_'s)
            ids = {id(p) for p in params}
            for g in self.placed(params) if b is None else [
                    Group([p for p in b.params if id(p) in ids], b.settings)]:
                store.up(g.params)
                self._step([g])

    def _up_landed(self, params: list[Tensor]) -> None:
        """``params`` have a gradient in ``.grad`` about to be stepped: those whose held
        sum waits in a store get it back first (``held + new``, as in the bucket's own
        step), or it would stay there, never applied - a layer frozen during a holding
        backward lands the next one without a hook (rule 7), so no bucket brings it."""
        store = self.stepper.held
        if store:
            store.up([p for p in params if p in store])

    @property
    def holds_gradients(self) -> bool:
        """Whether gradients wait for a later step (in ``.grad`` or in a store)."""
        store = self.stepper.held
        return any(p.grad is not None or p in store for p in self.train_step.held)

    def held_elsewhere(self) -> list[Tensor]:
        """Parameters whose held gradient waits in a store (``.grad`` is ``None``)."""
        store = self.stepper.held
        return [p for p in self.train_step.held if p in store] if store else []

    def step_held(self) -> None:
        """After ``layeropt.backward``'s step pass, with its transform still set: step
        the held gradients of parameters that pass did not reach."""
        held = self.train_step.held
        if held and not self.no_step_depth:
            landed = [p for p in held if p.grad is not None]
            self._up_landed(landed)
            self._step(self.placed(landed))
            self._step_stored()
            held.clear()

    def forget_stepped(self, ids: set[int]) -> None:
        """Another optimizer took these parameters (by ``id``) over (:func:`take_over`),
        or a module's ``zero_grad`` zeroed them: the latest backward no longer counts as
        having updated them."""
        rec = self.last
        if any(id(p) in ids for p in rec.stepped):
            if rec.by_backward is not None:  # (the backward's part, then step()'s)
                rec.by_backward = sum(id(p) not in ids for p in rec.stepped[:rec.by_backward])
            rec.stepped = [p for p in rec.stepped if id(p) not in ids]
        updated = self.train_step.updated
        for p in [p for p in updated if id(p) in ids]:
            del updated[p]

    def applied_late(self, params: list[Tensor]) -> None:
        """``params``' updates were applied after their backward (by a stepper wrapper, at
        the loop's next forward): their gradients freed, as an update in backward frees
        them, and their version counters taken again for ``step()`` to compare with."""
        updated = self.train_step.updated
        for p in params:
            p.grad = None
            if p in updated:
                updated[p] = p._version

    def skip(self, had_grad: list[Tensor]) -> None:
        """This optimizer's step was skipped (an inf/NaN under ``GradScaler``): drop its
        gradients - ``had_grad``, those it had, and those its stepper's store holds,
        which torch's ``.grad`` holds too - as torch's ``zero_grad`` later would."""
        store, ids = self.stepper.held, {id(p) for p in had_grad}
        had_grad = had_grad + [p for p in self.train_step.held
                               if id(p) not in ids and p in store]
        self.train_step.skipped += had_grad
        self.train_step.scaler_skipped = had_grad
        self.discard_held()
        optimizer = self._optimizer()
        for g in optimizer.param_groups if optimizer is not None else ():
            for p in g["params"]:
                p.grad = None
        _fused_skip_state(optimizer, had_grad)

    def discard_held(self) -> None:
        """Drop the held gradients (their optimizer's step was skipped)."""
        self.stepper.held.drop()
        for p in self.train_step.held:
            p.grad = None
        self.train_step.held.clear()

    # -- training-step boundaries (rule 6) ------------------------------------------
    def step_call(self, closure: Callable[[], Any] | None) -> Any:
        """``optimizer.step(closure)`` once attached: run the closure (its backward held),
        then step and free every gradient the hooks did not consume."""
        loss = None
        if closure is not None:
            with self.closure(), torch.enable_grad():
                loss = closure()
        optimizer = self._optimizer()
        if optimizer is None:
            return loss
        if optimizer._regrouped():  # param_groups edited by hand: its hooks follow now
            self.on_param_groups_changed()
        early = self.first_step()
        self.check_boundary("step()")
        if _autocast_on() and self._this_step() and _autocast_may_change(optimizer):
            raise BackwardStateError(AUTOCAST_STEP_ERROR.format(name=type(optimizer).__name__))
        self.show_kept()  # (torch steps them on a zero gradient)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if params and self.train_step.stepped_backwards:  # set after backward (_between.py)
            _between.refuse_second_update(self.last.stepped, params)
        if params and getattr(optimizer, "grad_scale", None) is not None and self.clips:
            raise BackwardStateError(SCALED_CLIP_ERROR)
        rec = self.last
        steps = rec.steps  # (stepped_in_backward counts the backward's updates only)
        if rec.by_backward is None:  # (step()'s updates - kept zeros among them - are not
            rec.by_backward = len(rec.stepped)  # the backward's: torch still keeps zeros)
        self._up_landed(params)
        with _refused_first(early):
            self._step(self.placed(params))
            self._step_stored()
        ended = getattr(optimizer._lo_stepper, "step_ended", None)  # (a test's stand-in: a
        if ended is not None:  # function) - group values, which torch's step() moves
            ended(optimizer, rec.steps != steps or self.train_step.stepped_backwards > 0)
        rec.steps = steps
        self.end_step(params)
        self.took_leftovers(params)
        if early:  # (this step() was torch's; the discarded batch's update was not)
            raise BackwardStateError(EARLY_DISCARD_ERROR.format(this=EARLY_DISCARD_APPLIED))
        return loss

    def took_leftovers(self, params: list[Tensor]) -> None:
        """``step()`` applied ``params``' gradients, which no hook took: layers unfrozen
        (or hooks lost) since the hooks were built are hooked now (rule 7)."""
        if params:
            for attachment in list(self.attachments):
                attachment.sync()

    def end_step(self, stepped: list[Tensor]) -> None:
        """``step()`` ended the training step. torch keeps a ``.grad`` until a ``zero_grad``
        for what it ``stepped`` and for what a skipped ``GradScaler`` step left (a fused
        optimizer's ``scaler.step`` calls this ``step()``)."""
        skipped = self.train_step.scaler_skipped
        rec = self.last  # (its gradients too, past the next backward: until a zero_grad)
        self.boundary("step()")
        self.train_step.skipped += skipped + stepped + ([] if rec.zeroed else rec.stepped)

    def first_step(self) -> bool:
        """A ``step()`` was called (attached or not): whether it is the loop's first and a
        ``zero_grad()`` before it discarded gradients an attached backward had applied
        (said now: the loop calls ``step()``, so those backwards were not steps)."""
        early = _EARLY_DISCARD in self.calls and "step()" not in self.calls
        self.calls.discard(_EARLY_DISCARD)
        self.calls.add(_STEP_TRIED)
        return early

    def refuse_after_early_discard(self, error: BaseException) -> None:
        """A backward's update raised ``error`` (torch's RMSprop finding no momentum buffer
        in state an earlier backward's update made, a scheduler having set momentum since)
        after a ``zero_grad()`` discarded the gradients of an attached backward, before the
        loop's first ``step()``: the discard, not what it tripped on (as
        :func:`_refused_first` says at that ``step()``)."""
        if (_EARLY_DISCARD in self.calls and "step()" not in self.calls
                and isinstance(error, Exception) and not isinstance(error, LayeroptError)):
            raise BackwardStateError(EARLY_DISCARD_BACKWARD_ERROR.format(
                error=f"{type(error).__name__}: {error}")) from error

    def saving(self, what: str = "optimizer.state_dict()") -> None:
        """``optimizer.state_dict()`` (a checkpoint, say), or ``what`` else read the
        parameters this optimizer's backward updated, inside a training step of a loop
        that calls ``step()`` (:attr:`awaits_step`): it holds the update an attached
        backward applied, torch's would not yet; warn, once per optimizer. (Before the
        loop's first ``step()`` each backward may be a step: not said.)"""
        if SAVE_WARNED not in self.calls and self.awaits_step:
            self.calls.add(SAVE_WARNED)
            warn(SAVE_OPEN_WARNING.format(what=what))

    def detached_step(self, torch_step: Callable[[], Any],
                      closure: Callable[[], Any] | None = None) -> Any:
        """``step()`` once the last attachment left (``torch_step``: torch's own, which
        runs ``closure``). A training step ``remove()`` left open - a backward updated
        parameters, no ``step()``/``zero_grad()`` since - ends here as an attached
        ``step()`` ends it: refused where torch's would differ (a hyperparameter set, a
        gradient since - the closure's too - on a parameter that backward updated); the
        other gradients stepped in that backward's transaction, so that group values
        (schedule-free's ``k``) move once, as in torch's one ``step()``. A discard before
        the loop's first ``step()`` is said after it."""
        if DETACHED not in self.calls:  # (never attached: torch.optim's, untouched)
            return torch_step()
        if not self.stepped_since_boundary:
            early = self.first_step()
            with _refused_first(early):
                loss = torch_step()
        else:
            self.check_boundary("step()")
            loss = None
            if closure is not None:
                with torch.enable_grad():
                    loss = closure()
            optimizer = self._optimizer()
            params = [p for g in optimizer.param_groups for p in g["params"]
                      if p.grad is not None]
            _between.refuse_second_update(self.last.stepped, params)
            early = self.first_step()
            if params:
                with _refused_first(early):
                    optimizer._lo_stepper(optimizer, params, self.txn)
        self.boundary("step()")
        if early:
            raise BackwardStateError(EARLY_DISCARD_ERROR.format(this=EARLY_DISCARD_APPLIED))
        return loss

    @property
    def bounded(self) -> bool:
        """Whether the loop's steps are known: it has called ``step()`` or ``zero_grad()``,
        or is known to call ``step()`` (:meth:`expect_step`)."""
        return bool({"step()", "zero_grad()", _STEP_EXPECTED} & self.calls)

    def expect_step(self, expected: bool = True) -> None:
        """The loop is known to call ``step()`` (a trainer integration's contract, such as
        accelerate's): from its first training step on, a second stepping backward
        before ``step()`` is refused at that backward, before anything of it is applied
        (rule 6), as it is once any loop has called ``step()`` - not taken for a loop
        where each backward is a step. ``expected=False``: no longer known (the
        integration let the optimizer go)."""
        if expected:
            self.calls.add(_STEP_EXPECTED)
        else:
            self.calls.discard(_STEP_EXPECTED)

    @property
    def awaits_step(self) -> bool:
        """Whether an attached backward updated parameters that a loop calling ``step()``
        (or known to) has not stepped since: torch would apply that update at its coming
        ``step()``, so a read of those parameters now is ahead of torch's."""
        return self.stepped_since_boundary and bool({"step()", _STEP_EXPECTED} & self.calls)

    @property
    def stepped_since_boundary(self) -> bool:
        """Whether an attached backward updated parameters since the last step()/zero_grad()."""
        return self.train_step.stepped_backwards > 0

    def check_boundary(self, where: str) -> None:
        """Refuse a step()/zero_grad() that ends what torch would take as one step of
        several, or after the hyperparameters the updates used were changed, or that
        follows a backward which raised after updating parameters (said once)."""
        step = self.train_step
        if step.faulted is not None:
            (n, name), step.faulted = step.faulted, None
            raise BackwardStateError(FAULT_ERROR.format(where=where, n=n, name=name))
        if step.hyper is not None:
            before, step.hyper = step.hyper, None
            optimizer = self._optimizer()
            if optimizer is not None:
                _between.check_unchanged(before, optimizer.param_groups, where)
        if step.updated and where == "step()":
            updated, step.updated = step.updated, {}
            _between.refuse_written(updated, self.name_of)
        stepped, held = step.stepped_backwards, step.held_backwards
        if stepped and not held and where == "step()" and step.held_after_step:
            held = 1  # a no_step() / kept-graph backward after the stepping one, before the
            # loop's first step() (after it, refused at that backward); a zero_grad() there
            # may end a step-less loop's window (LoopAccumulator's block form)
        if stepped >= 2 or (stepped and held):
            step.stepped_backwards = step.held_backwards = 0
            raise BackwardStateError(ACCUMULATION_ERROR.format(
                what=f"{where} ends {stepped + held} backwards, {stepped} of which already "
                "updated the parameters,",
                outcome="Each of those was applied as its own step; nothing more is.",
            ))

    def boundary(self, where: str) -> None:
        """``step()`` or ``zero_grad()`` (``where``) ended a training step."""
        self.train_step = StepRecord()
        self.calls.add(where)
        self.txn += 1

    def refuse_regrown(self, where: str, params: Callable[[], Iterable[Tensor]] | None = None,
                       landing: Tensor | None = None) -> None:
        """Refuse a gradient found on a parameter the latest backward updated, no
        ``step()`` since, by ``where``: a ``zero_grad()`` (the optimizer's, or a
        module's over ``params()``) or the next backward (``landing``: the gradient it
        brings, not one set since). ``step()`` refuses it too (``step_call``); a loop
        without ``step()`` would drop it here, or add it to the next backward's."""
        if not self.train_step.stepped_backwards:
            return
        again = [p for p in self.stepper.regrown(self.last.stepped) if p is not landing]
        if again and params is not None:
            ids = {id(p) for p in params()}
            again = [p for p in again if id(p) in ids]
        if again:
            _between.refuse_second_update(self.last.stepped, again, where)

    def check_discard(self, params: Callable[[], Iterable[Tensor]] | None, where: str) -> None:
        """Refuse a ``zero_grad`` (``where``: the optimizer's, or ``model.zero_grad()``
        over ``params()``) that discards gradients an attached backward has already
        applied: once the loop calls ``step()``, a backward whose updates no ``step()``
        followed is one whose gradients torch would drop here (a GAN's generator loss
        reaching the discriminator, an actor's loss the critic)."""
        step = self.train_step
        if step.stepped_backwards != 1 or step.held_backwards:
            return
        if "step()" not in self.calls:  # (a loop without step() takes backwards as steps:
            if _STEP_TRIED not in self.calls:  # said at its first step(), if one comes;
                self.calls.add(_EARLY_DISCARD)  # a held backward may have come since)
            return
        stepped = self.last.stepped
        if not stepped:
            return
        if params is not None:
            ids = {id(p) for p in params()}
            stepped = [p for p in stepped if id(p) in ids]
            if not stepped:
                return
        step.stepped_backwards = 0  # said once: the loop may go on
        raise BackwardStateError(DISCARD_ERROR.format(
            where=where, n=len(stepped), name=self.name_of(stepped[0])))


@contextlib.contextmanager
def _refused_first(early: bool) -> Iterator[None]:
    """The loop's first ``step()``, refused after it for a discard before it (``early``):
    should that step raise on the way (torch's RMSprop finding no momentum buffer in state
    the discarded backward's update made, which torch's never did), the refusal, not
    what it tripped on."""
    try:
        yield
    except Exception as e:
        if early and not isinstance(e, BackwardStateError):
            raise BackwardStateError(EARLY_DISCARD_ERROR.format(
                this=f"This step() then raised {type(e).__name__}: {e} (on state that update "
                "made).")) from e
        raise


def _fused_skip_state(optimizer: Any, params: list[Tensor]) -> None:
    """``scaler.step`` on a fused Adam(W) whose step GradScaler skips still runs its step,
    with ``found_inf`` set: the kernel changes nothing, but the step creates the state of
    each parameter that had a gradient (zeros, ``step`` 0). The same step, on zero
    gradients: ``state_dict()`` as torch's. (Fused SGD's momentum there is torch's
    uninitialised memory: nothing to equal.)"""
    if (optimizer is None or not optimizer.defaults.get("fused")
            or not isinstance(optimizer, (torch.optim.Adam, torch.optim.AdamW))):
        return
    new = [p for p in params if not optimizer.state.get(p)]
    if not new or hasattr(optimizer, "found_inf"):
        return
    for p in new:
        p.grad = torch.zeros_like(p)
    optimizer.found_inf = torch.ones((), device=new[0].device)
    try:
        optimizer._step_params(new)
    finally:
        del optimizer.found_inf
        for p in new:
            p.grad = None


# -- parameters taken over from another optimizer (attaching.py) ----------------------
def take_over(params: list[Tensor], optimizers: list[Any], when: str) -> None:
    """``optimizers`` take ``params`` over from the other layeropt optimizers: the latest
    backward of another optimizer stops counting as having updated them.

    That record refuses a ``step()`` of another optimizer that finds those
    parameters' gradients freed (torch's global step pre-hook,
    ``layeropt/checking/watch.py``): torch would still hold the gradients the backward left.
    It stops counting once torch's would be gone or superseded; left in place, an
    optimizer abandoned with it - a finished Trainer's, one whose handle was
    removed - refused the next optimizer's every ``step()`` (docs/rules.md, "A model
    another optimizer trained"). ``when``:

    * ``"attach"``: where that optimizer's ``zero_grad()`` followed the backward;
    * ``"backward"``: the parameters the running backward reaches (an attachment's
      first backward: it sums onto or replaces what torch would hold);
    * ``"run"``: all of them - a trainer integration's ``train()`` / ``fit()``
      begins, whose first step zeroes the gradients (the Hugging Face Trainer zeroes
      the model's before its first step, Lightning's closure before each backward);
    * ``"reload"``: all of them, from an open training step too - the parameters
      were loaded since (``train(resume_from_checkpoint=...)``, ``fit(ckpt_path=...)``):
      nothing of an earlier backward is left in them.

    Otherwise never from an optimizer whose training step is open (see
    :func:`refuse_open_updates`), nor during its backward.
    """
    mine = [o._lo_engine for o in optimizers]
    ids: set[int] | None = None
    for engine in list(ENGINES):
        rec = engine.last
        if (not rec.stepped or any(engine is e for e in mine) or engine.backward is not None
                or (when != "reload" and _open(engine))
                or (when == "attach" and not rec.zeroed)):
            continue
        if ids is None:
            ids = {id(p) for p in (_reached(params) if when == "backward" else params)}
        engine.forget_stepped(ids)


def _open(engine: Any) -> bool:
    """Whether ``engine``'s training step is open: a backward of it updated parameters and
    its loop, which calls ``step()``, has not called ``step()`` or ``zero_grad()`` since."""
    return engine.bounded and engine.stepped_since_boundary


def refuse_open_updates(model: nn.Module, params: list[Tensor],
                         optimizers: list[Any]) -> None:
    """Refuse attaching ``params`` that another layeropt optimizer's open training step
    updated: torch would apply that update only at that optimizer's ``step()``, and the
    parameters have it already (a run interrupted between backward and step). Not for
    parameters that optimizer still hooks: its attachment is refused first."""
    ids = {id(p) for p in params}
    mine = [o._lo_engine for o in optimizers]
    for engine in list(ENGINES):
        if (any(engine is e for e in mine) or engine.backward is not None
                or not _open(engine)):
            continue
        for p in engine.last.stepped:
            if id(p) not in ids or hooked_by(p) is not None:
                continue
            optimizer = engine._optimizer()
            name = next((repr(n) for n, q in model.named_parameters() if q is p),
                        f"of shape {tuple(p.shape)}")
            raise AttachError(
                f"parameter {name} was updated during a backward of "
                f"{type(optimizer).__name__}, another layeropt optimizer, and that "
                "optimizer's step() has not come since (a run interrupted between backward "
                "and step?): torch would apply that update only at its step(), and the "
                "parameter has it already. Load the parameters again (resume from a "
                "checkpoint: Trainer.train(resume_from_checkpoint=...), Lightning's "
                "fit(ckpt_path=...)), or delete that optimizer to train on from the "
                "parameters as they are."
            )


def _reached(params: list[Tensor]) -> list[Tensor]:
    """Those of ``params`` whose gradient the running backward computes (``inputs=`` and
    the graph decide); one that cannot be told (a DTensor) counts as not reached."""
    will_execute = torch._C._will_engine_execute_node
    out = []
    with torch.enable_grad():
        for p in params:
            try:
                node = p.view_as(p).grad_fn  # (its AccumulateGrad node is the next one)
                if node is not None and will_execute(node.next_functions[0][0]):
                    out.append(p)
            except (RuntimeError, AttributeError, IndexError):
                continue
    return out
