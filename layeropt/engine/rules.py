"""Beside the plain path: a backward's start and end, and the modes (``layeropt/engine/landing.py``).

The plain path steps each bucket once its gradients have landed. These are
the rules around it, as methods of the engine (:class:`Rules`, the base of
``landing.Engine``; a training step's side is its own base,
``layeropt/engine/boundaries.py``) and the two records they keep:

* a :class:`BackwardRecord` is made when a backward reaches the engine (its
  first gradient, :meth:`Rules.on_grad`) and dropped when it ends (an autograd
  engine callback) or raises; ``engine.last`` keeps the latest one (what it
  stepped). Nothing of a backward is reset by hand: the next gets a new record;
* a :class:`StepRecord` is made at each training-step boundary (``step()``,
  ``zero_grad()``): the backwards since then that stepped or held, the
  gradients held for ``step()``, the param groups as the step's first update
  read them.

The rules, numbered as the docs number them:

4. when a backward ends, complete buckets still queued, buckets that only
   partly arrived (a parameter got no gradient this time) and gradients held
   from ``no_step()`` are stepped together and freed (the end callback queues
   itself once more when it first runs, so that it runs after callbacks
   queued since, such as FSDP2's final reduce-scatter of a second root);
5. activation checkpointing stays exact: a gradient a non-reentrant
   ``layeropt.checkpoint`` segment *pins* waits until the segment was
   recomputed; a backward that runs ``torch.utils.checkpoint(...,
   use_reentrant=True)`` segments *defers* every gradient to its end (a warning
   says nothing is saved); any other backward nested in an autograd
   Function's backward is refused;
6. one torch training step is one step. A backward whose gradients torch's
   recipe checks or changes before the update is *held* (as under
   ``no_step()``) and stepped by ``step()``: one through a
   ``GradScaler``-scaled loss, one inside ``optimizer.step(closure)``, one that
   keeps its graph (``retain_graph=True``, ``create_graph=True``). Once the
   loop has called ``step()`` or ``zero_grad()``, a second stepping backward
   before the next call is refused before anything of it is applied (and
   ``step()``/``zero_grad()`` after two); once it has called ``step()``, a
   ``zero_grad()`` that discards what a backward applied is refused
   (``StepRules.check_discard``, ``layeropt/engine/boundaries.py``). Each training
   step is one transaction (``txn``) of ``layeropt/engine/subset.py``;
7. parameters unfrozen after ``attach`` are picked up at the next backward,
   which steps every gradient it left at its end (holds them, under
   ``no_step()``); the hooks are rebuilt then (also at a ``step()`` that found
   gradients no hook took);
8. a DDP model's gradients come from its communication hook, averaged, a
   bucket at a time: the first bucket of a training step makes the record
   (:meth:`Rules.begin_averaged`, the same rules), :meth:`Rules.averaged_route`
   says where each bucket's averaged gradients go, and those to step land in
   the record's ready queue (``Engine.land_averaged``), stepped by the same
   ``Engine._step``. FSDP2 calls the hooks themselves.

If a backward raises, autograd drops it; its end callback is then released
without running, the gradients it left unstepped are freed and its record
dropped, before the exception reaches the caller. Held gradients are kept.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import Tensor

from ..checking import watch as _watch
from . import nesting
from .nesting import TaskEnd, _graph_task_id
from .registry import check_local_hooks_allowed, refuse_local_gradients, world_size
from .boundaries import Group, StepRecord, StepRules
from .zeroing import ZEROS_IN_GRAD
from .wholestep import whole_step
from .transforms import ENTERED, Measure, Transform
from ..errors import (
    ACCUMULATION_ERROR, CLOSURE_HOLD_WARNING, COMPILED_AUTOGRAD_TWO_PASSES, DEFER_WARNING,
    FAULT_WARNING, NESTED_ERROR, NO_GRAPH_TASK_ERROR, RETAIN_HOLD_WARNING, SCALER_HOLD_WARNING,
    SPARSE_ERROR, AttachError, BackwardStateError, warn,
)

__all__ = ["BackwardRecord", "Rules", "hooked_last", "IDLE"]

# A backward's route (BackwardRecord.route): where its gradients go. Its graph task
# id (>= 0): the plain path, in the hook; else one of these, through Rules.on_grad.
IDLE = -2  # no backward in progress (a record's task before it has one)
MEASURE = -3  # layeropt.backward's measure pass: reduced to a norm, not stepped
HOLD = -4  # held for a later step (no_step(), GradScaler, step(closure), a kept graph)
DEFER = -5  # kept to the end of the backward (a torch reentrant segment in it)
CHECK = -6  # stepped, each gradient checked first (several processes: not a replica's)
_SERIALS = itertools.count(1)  # one id per backward record (buckets compare it)


def hooked_last(param: Tensor) -> bool:
    """Whether layeropt's hook is the last of ``param``'s post-accumulate-grad hooks. torch
    runs them in registration order and ``step()`` after them all: one registered after
    attach (noise, scaling, logging) must see, and may change, the gradient first."""
    hooks = param._post_accumulate_grad_hooks  # (none left: the attachment was removed)
    return not hooks or len(hooks) == 1 or hasattr(next(reversed(hooks.values())),
                                                   "_lo_engine_ref")


class BackwardRecord:
    """What one backward did at one engine; made at its first gradient, dropped at its end.

    Attributes:
        task: the autograd graph task.
        serial: this record's id (a bucket's arrivals belong to one serial).
        route: where its gradients go (``MEASURE``, ``HOLD``, ...; its ``task``: the
            plain path), set by :meth:`Rules._route` only: when it begins and when a
            mode is entered or left.
        ready: complete buckets queued, and their gradient bytes.
        partial / incomplete: buckets whose first gradient landed, how many still
            incomplete.
        gated: gradients waiting for a checkpoint pin (``param -> (bucket, index)``);
            unpinned: a pin was released since (they go on at the next gradient).
        deferred: gradients kept to the end (torch's reentrant segments; the measure
            pass's, for hooks registered after layeropt's).
        defer / hold / graph / sweep: the backward defers everything; holds for
            ``step()`` (GradScaler, closure); keeps its graph; found layers
            (un)frozen since attach.
        unchecked: rule 6's decision waits for this engine's first gradient.
        scaled / distributed: through a GradScaler-scaled loss; several processes.
        stepped / steps / counted: what it updated, how many updates; counted as a
            stepping backward of its training step. by_backward: once a ``step()``
            updated more after it, how many of ``stepped`` the backward itself did.
        zeroed: a ``zero_grad()`` came after it (its updates are not the next one's).
    """

    __slots__ = ("task", "serial", "route", "ready", "ready_bytes", "partial", "incomplete", "gated",
                 "deferred", "defer", "hold", "graph", "sweep", "unchecked", "scaled",
                 "distributed", "stepped", "steps", "counted", "zeroed", "unpinned",
                 "by_backward")

    def __init__(self, task: int) -> None:
        self.task = task
        self.serial = next(_SERIALS)
        self.route = IDLE
        self.ready: list[Any] = []
        self.ready_bytes = 0
        self.partial: list[Any] = []
        self.incomplete = 0
        self.gated: dict[Tensor, tuple[Any, int]] = {}
        self.unpinned = False
        self.deferred: dict[Tensor, Any] = {}
        self.defer = self.hold = self.graph = self.sweep = self.unchecked = False
        self.scaled = self.distributed = False  # (set by whoever begins it)
        self.stepped: list[Tensor] = []
        self.by_backward: int | None = None  # of stepped, the backward's (then step()'s)
        self.steps = 0
        self.counted = self.zeroed = False


class Rules(StepRules):
    """The engine's rules beside the plain path (see the module docstring)."""

    attachments: dict[Any, None]
    _optimizer: Callable[[], Any]

    def __init__(self) -> None:
        self.backward: BackwardRecord | None = None  # the backward in progress
        self.last = BackwardRecord(IDLE)  # the latest backward that reached the engine
        self.train_step = StepRecord()  # the training step in progress
        self.txn = 0  # its transaction, renewed at each backward and boundary
        # boundary calls the loop made ("step()", "zero_grad()"), and what their rules
        # remember of them (boundaries.py: a step() tried, a discard before the first)
        self.calls: set[str] = set()
        # zero_grad(set_to_none=False): the parameters (by id) whose .grad torch would keep
        # as zeros - and step at every step(), used or not. None: set_to_none=True.
        self.kept_grads: dict[int, Tensor] | None = None
        self.no_step_depth = 0  # open optimizer.no_step() contexts (> 0: hold gradients)
        self.closure_depth = 0  # inside optimizer.step(closure)
        self.measure: Measure | None = None  # layeropt.backward's measure pass
        self.transform: Transform | None = None  # layeropt.backward's step pass

    def _route(self) -> None:
        """Decide the route of the backward in progress (and of the latest one: a DDP
        step's, whose averaged buckets ask it) from the modes and what it found."""
        for rec in (self.backward, self.last):
            if rec is not None:
                rec.route = (
                    MEASURE if self.measure is not None
                    else HOLD if self.no_step_depth or rec.hold or rec.graph
                    else DEFER if rec.defer
                    else CHECK if rec.distributed or ZEROS_IN_GRAD in self.calls
                    else rec.task)

    # -- modes ----------------------------------------------------------------
    @contextlib.contextmanager
    def no_step(self) -> Iterator[None]:
        """Attached backwards hold their gradients in ``.grad`` (rule 6's accumulation)."""
        self.no_step_depth += 1
        self._route()
        try:
            yield
        finally:
            self.no_step_depth -= 1
            self._route()

    @contextlib.contextmanager
    def closure(self) -> Iterator[None]:
        """Inside ``optimizer.step(closure)``: its backward is held (the caller may clip)."""
        self.closure_depth += 1
        try:
            yield
        finally:
            self.closure_depth -= 1

    @contextlib.contextmanager
    def backward_call(self, transform: Transform | None) -> Iterator[None]:
        """Inside ``layeropt.backward``'s (step) pass: ``transform`` applies to every step."""
        self.transform = ENTERED if transform is None else transform
        try:
            yield
            if transform is not None:
                self.step_held()
        finally:
            self.transform = None

    def start_measure(self, measured: dict[Tensor, Tensor], norm_type: float | None,
                      inv_scale: Tensor | None, found_inf: Tensor | None) -> None:
        """``layeropt.backward``'s measure pass begins: gradients are reduced, not stepped;
        held gradients are set aside (restored by :meth:`finish_measure`)."""
        self.measure = m = Measure(measured, norm_type, inv_scale, found_inf)
        self._route()
        held, optimizer = self.train_step.held, self._optimizer()
        for attachment in list(self.attachments):  # a gradient already in .grad (set by
            if getattr(attachment, "averaged", False):  # hand, or from before the layer
                continue  # was hooked) is summed and clipped as a held one (DDP's: its own)
            clipped = self.train_step.clipped_zeros  # (not the kept zeros: step()'s)
            for p in attachment.owned:
                if (p.grad is not None and p not in held and optimizer.owns(p)
                        and clipped.get(id(p)) is not p.grad):
                    held[p] = None
        # torch's reentrant segments deliver a gradient in several pieces, which torch
        # adds to the accumulated one in turn ((held + a) + b): measured in place then,
        # and restored from a copy; else set aside and added once (held + grad)
        in_place = bool(nesting._TORCH_SEGMENTS)
        if in_place and self.train_step.held:  # (the pieces add onto the held sum in
            self.stepper.held.up(list(self.train_step.held))  # .grad: back for good)
        for p in self.train_step.held:
            if p.grad is not None:
                m.stash[p] = p.grad.clone() if in_place else p.grad
                if in_place:
                    m.summed[id(p)] = p.grad
                else:
                    p.grad = None

    def finish_measure(self) -> None:
        """The measure pass ended (or raised): the held gradients back in ``.grad``."""
        m, self.measure = self.measure, None
        self._route()
        store = self.stepper.held
        for p in list(self.train_step.held) if m is not None and store else ():
            if p in store and id(p) not in m.seen:  # held in a store, no gradient now
                m.reduce(p, store.fetch(p))
        for p, held in m.stash.items() if m is not None else ():
            if id(p) not in m.seen:  # no gradient this pass: measure the held one
                m.reduce(p, held.clone())
            kept = m.summed.get(id(p))  # (summed in place: restored into the .grad tensor
            if kept is not None and kept.shape == held.shape:  # torch kept, not a new one)
                p.grad = kept.copy_(held)
            else:
                p.grad = held

    # -- a backward reaches the engine -----------------------------------------
    def on_grad(self, bucket: Any, index: int, param: Tensor) -> bool:
        """``param``'s gradient has fully accumulated, off the plain path: a new backward,
        a mode, or checkpoint pins. Returns whether it takes the plain path now."""
        task = _graph_task_id()
        if task == -1 and self.no_step_depth and self.measure is None:  # (FSDP2 reducing
            self.train_step.held[param] = bucket  # after a pipeline schedule's backwards:
            self.stepper.held.up([param])  # held as in no_step(), no backward's end to wait)
            return False
        rec = self.backward
        if rec is None or task != rec.task and not nesting.segment_depth[0]:
            # a new backward (else: the nested one of a torch reentrant segment, deferring)
            try:
                if nesting.nested_in_function_backward():
                    raise BackwardStateError(NESTED_ERROR)
                if rec is not None:
                    self._abort(rec)  # the previous backward died without being finalized
                if self.train_step.stepped_backwards:  # (a loop without step() meets here
                    self.refuse_regrown("the next backward", landing=param)  # what's written)
                rec = self._begin(task)
            except BackwardStateError:
                if param not in self.train_step.held:
                    param.grad = None  # this backward is refused as a whole
                raise
        if rec.unpinned:
            self._ungate(rec)
        if rec.unchecked:
            try:
                self._decide(rec)
            except BackwardStateError:
                param.grad = None
                raise
        if rec.distributed:
            check_local_hooks_allowed(param)  # never step a DDP replica's local gradient
        grad = param.grad
        if grad is None:  # another hook freed it; nothing to do
            return False
        if ZEROS_IN_GRAD in self.calls and self.kept_zeros(param):
            return False  # (nothing landed: a compiled region's hook; step() steps them)
        if grad.is_sparse:
            raise AttachError(SPARSE_ERROR)
        route = rec.route
        if route == MEASURE:
            if rec.defer or not hooked_last(param):  # (measured at the end)
                rec.deferred[param] = bucket
            else:
                self._take(param)
            return False
        if route == HOLD:
            self.train_step.held[param] = bucket
            store = self.stepper.held
            if rec.hold or torch.is_grad_enabled():  # the loop reads .grad before step()
                store.up([param])
            else:
                store.land(param, bucket, rec.serial, rec.defer)
            return False
        if route == DEFER:
            if self.train_step.held:  # the pieces add onto the held sum, as autograd's
                self.stepper.held.up([param])
            rec.deferred[param] = bucket
            return False
        if nesting._PINS and nesting.pinned(param):
            rec.gated[param] = (bucket, index)
            return False
        return True

    def enter_torch_segment(self, task: int) -> None:
        """A torch reentrant segment is about to run its nested backward (rule 5)."""
        rec = self.backward
        if rec is None:
            if self.attachments:
                self._begin(task, defer=True)
        elif not rec.defer:
            rec.defer = True  # a segment recorded during this backward
            self._route()
            if not rec.unchecked:  # (else _decide warns, if a gradient of ours lands)
                warn(DEFER_WARNING)

    def _begin(self, task: int, defer: bool = False) -> BackwardRecord:
        """A new backward reaches this engine: its record.

        ``defer``: begun by a torch reentrant segment, which runs whether or
        not this engine's parameters take part; what concerns only a
        backward that reaches them (:meth:`_decide`, which makes it ``last``)
        waits for the first gradient that lands here; one that none reaches ends
        without touching the engine (:meth:`_end`).
        """
        if task == -1:  # before any state changes: nothing of this backward is applied
            raise BackwardStateError(NO_GRAPH_TASK_ERROR)
        if (self.measure is not None or self.transform is not None) and getattr(
                sys.modules.get("torch._dynamo.compiled_autograd"),
                "in_compiled_autograd_region", False):
            raise BackwardStateError(COMPILED_AUTOGRAD_TWO_PASSES)
        self.backward = rec = BackwardRecord(task)
        if not defer:
            nesting.outside_segments()  # a first hook outside any segment: nothing is nested
            self.last = rec
            self.txn += 1  # a transaction of its own
        rec.scaled = _watch.scaled_backward()
        _watch.WATCHERS.watch_tools()  # (a tool imported since attach: guarded first)
        rec.distributed = world_size() > 1
        segments = nesting._TORCH_SEGMENTS
        rec.defer = defer or bool(
            segments and any(map(torch._C._will_engine_execute_node, list(segments))))
        self._route()
        torch.autograd.Variable._execution_engine.queue_callback(
            TaskEnd(functools.partial(self._end, rec), functools.partial(self._dropped, rec),
                    last=True))
        if defer:
            rec.unchecked = True
        else:
            self._decide(rec)
        return rec

    def begin_averaged(self) -> None:
        """A DDP training step reaches this engine (its comm hook's first bucket).

        The same record and the same rules as a plain backward (rules 6, 7);
        each bucket then asks :meth:`averaged_route` where its averaged
        gradients go, and those to step land in the record's ready queue
        (``Engine.land_averaged``).
        """
        self.last = rec = BackwardRecord(IDLE)  # (no end callback: not the current record)
        self.txn += 1
        rec.scaled = _watch.scaled_backward()
        self._decide(rec)
        if rec.hold:
            self.train_step.held_backwards += 1

    def averaged_route(self) -> Any:
        """Where a DDP bucket's averaged gradients go, as :meth:`on_grad` routes a hook's:
        the measure pass's ``Measure``; ``None``, held for ``step()`` (the comm hook
        leaves them in ``.grad``, as DDP would); or this engine, to step them."""
        route = self.last.route
        return self.measure if route == MEASURE else None if route == HOLD else self

    def _decide(self, rec: BackwardRecord) -> None:
        """Rules 6 and 7 for a backward that reaches this engine's parameters."""
        if rec.distributed:  # (before any of it steps: a hook checks only its own)
            refuse_local_gradients(self.attachments)
        rec.unchecked = False
        if self.last is not rec:  # begun by a torch segment: it reaches the engine now
            self.last = rec
            self.txn += 1
        # backward(create_graph=True): the gradients' graph is for something the loop
        # does before the update (a gradient penalty's backward); retain_graph=True: more
        # backwards over this graph may follow before it (truncated BPTT's next time step)
        created = torch.is_grad_enabled()
        kept = self.measure is None and self.transform is None and _watch.graph_kept()
        rec.graph = created or kept
        plain = self.measure is None and not self.no_step_depth
        holds = self.measure is None and self.transform is None and (
            self.no_step_depth or rec.graph or self.closure_depth or rec.scaled)
        if self.train_step.stepped_backwards and holds:  # (before the first step(): said
            self.train_step.held_after_step = True  # at the step() ending both)
        if self.train_step.stepped_backwards and self.bounded and (holds or plain):
            # (held for step(): torch sums it with the one already applied, into one step)
            raise BackwardStateError(ACCUMULATION_ERROR.format(
                what=("a backward held for step() (inside no_step(), or keeping its graph) "
                      if holds else "a second backward ") + "after an attached backward that "
                "updated the parameters",
                outcome="Nothing of this second backward was applied.",
            ))
        optimizer = self._optimizer()
        if optimizer is not None and optimizer._regrouped():  # param_groups edited by hand
            self.on_param_groups_changed(in_backward=True)
        for attachment in list(self.attachments):  # layers (un)frozen since attach (rule 7)
            if attachment.sync(in_backward=True):
                rec.sweep = True
        if plain and self.transform is None:
            if self.closure_depth:
                rec.hold = True
                warn(CLOSURE_HOLD_WARNING)
            elif rec.scaled:
                rec.hold = True
                warn(SCALER_HOLD_WARNING)
            elif kept and not created:
                warn(RETAIN_HOLD_WARNING)
        # torch's step picks its update by the whole list this step (engine/wholestep.py):
        # the gradients wait for the end of backward, one call over them all
        whole = (plain and not holds and not rec.defer and optimizer is not None
                 and whole_step(optimizer))
        if whole and rec.task == IDLE:  # (a DDP step: its buckets step as they come)
            raise BackwardStateError(whole[1])
        rec.defer = bool(rec.defer or whole)
        self._route()
        if rec.defer:
            warn(whole[0] if whole else DEFER_WARNING)

    # -- a backward ends --------------------------------------------------------
    def _dropped(self, rec: BackwardRecord) -> None:
        """The backward raised: autograd dropped its end callback uncalled."""
        if self.backward is rec:
            self._abort(rec)

    def _end(self, rec: BackwardRecord) -> None:
        if self.backward is not rec:
            return
        self.backward = None
        held = self.train_step.held
        store = self.stepper.held
        try:
            if rec.unchecked:  # begun by a torch segment, none of ours reached: not ours
                return
            if held:
                store.flush()  # buckets that only partly landed in a holding backward
            if self.measure is not None:
                for p in rec.deferred:
                    if p.grad is not None:
                        self._take(p)
            elif rec.hold:
                self.train_step.held_backwards += 1
                self.show_kept()
            elif self.no_step_depth or rec.graph:
                self.show_kept()
                if rec.sweep:  # unfrozen since attach: no hook held them (rule 7)
                    for p in self._swept():
                        held.setdefault(p, None)
            else:
                if held and store:  # landed here but not stepped yet (partly landed buckets)
                    store.up([p for p in held if p.grad is not None])
                self._step(rec.ready + self._leftovers(rec))
                if held:
                    self._step_stored()
                held.clear()
        finally:
            self._route()
            for attachment in list(self.attachments):
                if attachment.stale:
                    attachment._rebuild()
            self.regrouped = False

    def _leftovers(self, rec: BackwardRecord) -> list[Any]:
        """Gradients that landed but were not stepped, grouped as their buckets."""
        held = self.train_step.held
        if not (rec.incomplete or rec.gated or rec.deferred or held or rec.sweep):
            return []
        groups: dict[Any, list[Tensor]] = {}
        settings: dict[Any, Any] = {}
        if rec.sweep:  # parameters unfrozen since attach have no hook yet
            swept = [p for p in self._swept() if p not in held]
            for i, g in enumerate(self.placed(swept)):
                groups[("swept", i)], settings[("swept", i)] = g.params, g.settings
        for b in rec.partial if rec.incomplete else ():
            if b.serial == rec.serial and b.arrived != b.full:
                groups[id(b)] = [p for i, p in enumerate(b.params) if b.arrived >> i & 1]
                settings[id(b)] = b.settings
        buckets: dict[int, Any] = {}  # (gathered in arrival order: put back in the bucket's,
        for p, (b, _) in rec.gated.items():  # which a per-bucket norm is summed in)
            groups.setdefault(id(b), []).append(p)
            settings[id(b)], buckets[id(b)] = b.settings, b
        for source in (rec.deferred, held):
            for p, b in source.items():
                groups.setdefault(id(b), []).append(p)
                settings.setdefault(id(b), None if b is None else b.settings)
                if b is not None:
                    buckets[id(b)] = b
        # (a sweep also finds the complete buckets queued in ready: those are stepped there)
        seen: set[int] = {id(p) for b in rec.ready for p in b.params} if rec.sweep else set()
        out = []
        for key, g in groups.items():
            g = [p for p in g if p.grad is not None and id(p) not in seen and not seen.add(id(p))]
            if len(g) > 1 and key in buckets:
                where = {id(q): i for i, q in enumerate(buckets[key].params)}
                g.sort(key=lambda p: where.get(id(p), len(where)))
            if g:
                out.append(Group(g, settings[key]))
        return out

    def _swept(self) -> list[Tensor]:
        """This optimizer's parameters of the attached models that hold a gradient."""
        optimizer = self._optimizer()
        if optimizer is None:
            return []
        zeros = ZEROS_IN_GRAD in self.calls  # (kept zeros nothing landed on: for step())
        return [p for attachment in list(self.attachments) for p in attachment.owned
                if p.grad is not None and optimizer.owns(p)
                and not (zeros and self.kept_zeros(p))]

    def _abort(self, rec: BackwardRecord) -> None:
        """The backward raised: what it left unstepped stays in ``.grad`` (or held), as
        torch keeps it; parameters it already updated are said now, and the step's next
        ``step()``/``zero_grad()`` is refused (torch would have applied none of it)."""
        if self.train_step.held:
            self.stepper.held.flush()  # what landed stays held, as torch keeps it in .grad
        nesting.outside_segments()
        if rec.counted:  # a backward that raised is not a step of its own
            self.train_step.stepped_backwards -= 1
            rec.counted = False
        if self.backward is rec:
            self.backward = None
        self._route()
        if rec.stepped:  # (said last: a warning made an error must find all this done)
            n, name = len(rec.stepped), self.name_of(rec.stepped[0])
            self.train_step.faulted = (n, name)
            warn(FAULT_WARNING.format(n=n, name=name))

    def pins_released(self) -> None:
        """Pins were released, from inside the recomputation that released them (its
        autocast, selective checkpointing's dispatch mode): the gradients no longer pinned
        go on at this backward's next gradient (:meth:`_ungate`), or at its end."""
        rec = self.backward
        if rec is not None and rec.gated:
            rec.unpinned = True

    def _ungate(self, rec: BackwardRecord) -> None:
        """Gradients no longer pinned enter the plain path (their hook runs again)."""
        rec.unpinned = False
        for p in [p for p in rec.gated if not nesting.pinned(p)]:
            bucket, index = rec.gated.pop(p)
            if p.grad is not None:
                bucket.hooks[index](p)
