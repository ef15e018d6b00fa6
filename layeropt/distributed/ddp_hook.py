"""The DDP communication hook: what happens when a bucket is ready and when its average lands.

One training step begins at the first bucket after a DDP forward
(:meth:`_HookState.begin`; DDP runs one synchronised backward per forward, its
buckets possibly landing in several autograd graph tasks when reentrant
checkpoints nest backwards); under ``find_unused_parameters`` it begins at each
optimizer once it reaches one of its parameters (:meth:`_HookState.begin_engine`).
For each bucket, :func:`_allreduce_then_step`
sorts its parameters (:class:`_Landing`: stepped by their optimizer - their
local ``.grad``, already copied into the bucket, freed at once - measured by
``layeropt.backward``'s first pass, or written back as DDP would), scales it by
``1/world_size`` and starts its all-reduce. The average then lands:

* CPU buckets (and CUDA ones with ``overlap=False``): at the end of the graph
  task the bucket was handed over in, on the autograd thread
  (:meth:`_HookState.flush`, queued before DDP's own end-of-backward callback);
  an optimizer's landed parameters are stepped together up to its cap;
* CUDA buckets: in the all-reduce future's ``.then()``, on a stream that waits
  for the all-reduce, each bucket alone.

``layeropt/distributed/__init__.py`` registers the hook (``attach_ddp``) and owns the
rest: the attachment handle and ``layeropt.backward``'s two passes.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn
from torch.autograd import Variable

from ..checking.verify import Verifier
from ..engine.nesting import TaskEnd, _graph_task_id
from ..engine.transforms import ENTERED
from ..errors import (
    AttachError,
    BackwardStateError,
    DDP_JOIN_ERROR,
    DDP_UNUSED_ERROR,
    LayeroptError,
)

KEPT_HOOK_ERROR = (
    "a backward of this DDP model began while torch would still hold the gradients "
    "step() applied to {n} parameter(s) (the first: {name}; no zero_grad() since), and "
    "its buckets are reduced through {hook}, which keeps state: torch's DDP reduces each "
    "parameter's .grad through it, those gradients included, where in-backward updating "
    "has freed them, so the hook's state would differ from torch's. Call "
    "optimizer.zero_grad() after step() (before the next backward). Nothing of this "
    "backward was applied."
)


def stateless(hook: Any) -> bool:
    """Whether a DDP comm hook gives the same result however often, and after whatever,
    it runs on a bucket: layeropt's own average, and torch's default hooks."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    return hook is None or hook in (default_hooks.allreduce_hook,
                                    default_hooks.fp16_compress_hook,
                                    default_hooks.bf16_compress_hook)


def hook_name(hook: Any) -> str:
    """A comm hook as a message names it."""
    if hook is None:
        return "layeropt's own average (no comm_hook)"
    return f"comm_hook={getattr(hook, '__qualname__', type(hook).__name__)}"


class _HookState:
    """What the DDP comm hook needs; the reducer keeps it alive with the DDP."""

    def __init__(self, ddp: nn.Module, overlap: bool, comm_hook: Any = None,
                 comm_state: Any = None) -> None:
        self.group = ddp.process_group
        self.world = self.group.size()
        self.overlap = overlap
        self.comm_hook, self.comm_state = comm_hook, comm_state  # the user's, if any
        self.owner: dict[Tensor, weakref.ref] = {}  # param -> its optimizer (weakly)
        self.settings: Any = None  # the attachment's Settings (layeropt/engine/landing.py)
        self.active = False
        self.attachment: weakref.ref | None = None  # the DDPAttachment that set owner
        self.verifying = False  # this step: an optimizer's LAYEROPT_VERIFY checks it
        self.lock = threading.Lock()  # bucket steps may land on comm threads
        self.fresh = True  # DDP ran a forward since the last training step began
        self.deferred: list[tuple[_Landing, Any]] = []  # to land at the end, in bucket order
        self.flush_task = _NONE  # graph task whose end lands ``deferred``
        self.flushes = 0  # flush callbacks queued so far (the latest may abort)
        # find_unused_parameters=True: a parameter may get no gradient on some
        # processes. As DDP, one used-flag all-reduce per synchronised backward
        # tells which are used anywhere; ``fired`` holds those whose gradient
        # was accumulated here since the last sync (no_sync() included).
        self.find_unused = bool(ddp.find_unused_parameters)
        self.ddp = weakref.ref(ddp)
        self.bucket_view = bool(ddp.gradient_as_bucket_view)
        self.fired: set[int] = set()
        self.begun: set[int] = set()  # ids of the engines this training step reached
        self.refused: LayeroptError | None = None  # by an engine begun: raised at the flush
        if self.find_unused:  # (a hook reaches this state weakly: it holds the parameters)
            fired = partial(_fired, weakref.ref(self))
            for p in ddp.parameters():
                if p.requires_grad:
                    p.register_post_accumulate_grad_hook(fired)


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
        ddp = self.ddp()
        if ddp is not None and getattr(getattr(ddp, "_join_config", None), "enable", False):
            raise AttachError(DDP_JOIN_ERROR)  # on every process: no all-reduce of this backward ran
        with self.lock:
            refs = {id(r): r for r in self.owner.values()} if self.active else {}
            optimizers = [o for o in (r() for r in refs.values()) if o is not None]
            if not stateless(self.comm_hook):
                self.refuse_freed_kept(optimizers)
            self.begun, self.refused = set(), None
            for opt in optimizers:  # every one gets a gradient (DDP requires it), or one
                if not self.find_unused or not _ordinary(opt._lo_engine):  # of layeropt.
                    self.begin_engine(opt)  # backward's passes: each engine's rules now
            self.verifying = any(o._lo_engine.find(Verifier) is not None for o in optimizers)
            if self.verifying and not self.find_unused:  # (every trainable one has a gradient)
                self.check_zeroed([p for p in self.owner if p.requires_grad])
            self.fresh = False

    def begin_engine(self, opt: Any) -> None:
        """This training step reaches ``opt``: its engine's rules, as for a plain backward
        (they may refuse it: nothing of it was applied yet), once per step.

        Under ``find_unused_parameters`` an ordinary backward begins an engine only once
        it reaches one of its parameters - a gradient accumulated here when its bucket
        is handed over, or (:meth:`_Landing.apply`) one some process used - as a plain
        backward that gives an optimizer nothing leaves its engine alone: its latest
        backward stays the one that reached it (the gradients ``zero_grad`` keeps as
        zeros; no refusal of a second backward for a loss that missed it). Its refusal
        then waits for :meth:`flush`, where every process knows which ones were reached,
        before any bucket lands (one raising in a bucket's hook would leave the others
        waiting in all-reduces)."""
        engine = opt._lo_engine
        if id(engine) in self.begun:
            return
        self.begun.add(id(engine))
        try:
            engine.begin_averaged()
        except LayeroptError as e:
            if not self.find_unused:
                raise  # (every engine begun at once, at the first bucket)
            self.refused = self.refused or e
            return
        if engine.averaged_route() is None:  # held for step(): at its end, the zeros
            Variable._execution_engine.queue_callback(  # torch keeps, in .grad (as _end)
                partial(_show_kept, weakref.ref(engine)))

    def refuse_freed_kept(self, optimizers: list[Any]) -> None:
        """A hook that keeps state: torch's DDP reduces every parameter's ``.grad`` through
        it, a gradient ``step()`` applied and no ``zero_grad()`` removed since included
        (added onto, or as it is where this backward leaves the parameter unused);
        in-backward updating freed it. Refused before the hook runs."""
        for opt in optimizers:
            if opt._lo_engine.find(Verifier) is not None:  # (torch's .grad stay: its own
                continue  # check, check_zeroed)
            kept = opt._lo_engine.freed_kept(list(self.owner))  # (this model's alone)
            if kept:
                raise BackwardStateError(KEPT_HOOK_ERROR.format(
                    hook=hook_name(self.comm_hook), n=len(kept),
                    name=opt._lo_engine.name_of(kept[0])))

    def check_zeroed(self, params: list[Tensor]) -> None:
        """LAYEROPT_VERIFY: refuse local gradients accumulated onto the last step's (a
        parameter this backward leaves without gradient - unused, frozen - is torch's
        unchanged: not checked), before any is stepped."""
        by_owner: dict[int, tuple[Any, list[Tensor]]] = {}
        for p in params:
            ref = self.owner.get(p)  # (None: no layeropt optimizer's)
            opt = None if ref is None else ref()
            if opt is not None:
                self.begin_engine(opt)  # (a gradient of it: this step reaches it)
                by_owner.setdefault(id(opt), (opt, []))[1].append(p)
        for opt, owned in by_owner.values():
            engine = opt._lo_engine
            verifier = engine.find(Verifier)
            # (a held backward's too where the user's hook keeps state: its reduction of
            # what this adds onto stays in that state, whatever zero_grad() comes next)
            if verifier is not None and (engine.averaged_route() is engine
                                         or not stateless(self.comm_hook)):
                verifier.check_zeroed(owned)

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
            end = TaskEnd(self.flush, partial(self.abort, self.flushes))
            Variable._execution_engine.queue_callback(end)

    def flush(self) -> None:
        """Land the deferred buckets, in bucket order, in their engines' ready queue
        (stepped as it reaches the attachment's ``bucket_cap_mb``; the rest at the end)."""
        deferred, self.deferred = self.deferred, []
        self.flush_task = _NONE
        used = self._used_anywhere([landing for landing, _ in deferred])
        for landing, _ in deferred:
            landing.reach(used)
        if self.refused is not None:  # (after the all-reduce every process joins, before
            refused, self.refused = self.refused, None  # any bucket lands)
            raise refused
        engines: dict[Any, None] = {}
        with _stepping(self):
            for landing, fut in deferred:
                fut.wait()  # re-raises a failed all-reduce
                for opt, params in landing.apply(used).items():
                    opt._lo_engine.land_averaged(params, self.settings)
                    engines[opt._lo_engine] = None
            for engine in engines:
                engine.step_ready()

    def _used_anywhere(self, landings: list[_Landing]) -> set[int] | None:
        """``find_unused_parameters``: ids of these buckets' parameters some process used.

        One all-reduce of a flag per parameter, as DDP's reducer does; the flags
        are then reset (DDP resets its map at each synchronised backward).
        """
        if not self.find_unused or not landings:
            return None
        params = [p for landing in landings for p in landing.params]
        flags = torch.tensor([id(p) in self.fired for p in params], dtype=torch.int32,
                             device=landings[0].device)
        self.group.allreduce([flags]).wait()
        self.fired.difference_update(id(p) for p in params)
        return {id(p) for p, f in zip(params, flags.tolist()) if f}

    def abort(self, serial: int) -> None:
        """The backward raised: nothing of its deferred buckets is applied."""
        if serial == self.flushes:  # the latest flush queued (an older one may go later)
            self.deferred = []
            self.flush_task = _NONE


def _show_kept(engine_ref: weakref.ref) -> None:
    """The end of a DDP backward held for ``step()``: a zero ``.grad`` for each layer
    it did not reach whose gradient torch keeps (``zero_grad(set_to_none=False)``), as
    a plain held backward's end gives them - a ``clip_grad_norm_`` before ``step()``
    then sums the same terms as torch's (queued before the averaged gradients are
    written back: those reached still hold their local gradient then)."""
    engine = engine_ref()
    if engine is not None:
        engine.show_kept()


def _applied_by_step(opt: Any, p: Tensor) -> bool:
    """LAYEROPT_VERIFY, where torch's gradients stay after ``step()``: ``p.grad`` is the
    one ``step()`` applied (not zeroed since), not one a ``no_step()`` backward held."""
    verifier = opt._lo_engine.find(Verifier)
    return verifier is not None and verifier.kept_since_step(p)


def _fired(state_ref: weakref.ref, param: Tensor) -> None:
    """``find_unused_parameters``: ``param``'s gradient was accumulated here."""
    state = state_ref()
    if state is not None:
        state.fired.add(id(param))


class _Copied:
    """What a copied or pickled DDP model keeps of layeropt's hook state: nothing."""

    def forward(self, module: nn.Module, args: Any) -> None:
        """The copy's forward pre-hook: a no-op."""


_NONE = -2  # _HookState.flush_task: no flush queued


def _grad_view(p: Tensor, g: Tensor) -> Tensor:
    """The bucket slice of ``p`` with ``p``'s strides (the reducer's layout)."""
    return g if p.is_contiguous() else g.as_strided(p.size(), p.stride())


def _write_back(p: Tensor, view: Tensor, bucket_view: bool | None = None) -> None:
    """Leave the averaged gradient in ``p.grad`` as DDP's reducer would.

    ``bucket_view`` (``find_unused_parameters``, ``p`` used on some process):
    a parameter without a local gradient gets the bucket's slice itself
    (``gradient_as_bucket_view``) or a copy of it.
    """
    if p.grad is None:
        if bucket_view is not None:
            p.grad = view if bucket_view else view.clone()
        return  # unused (static_graph): DDP leaves a globally unused grad alone
    if p.grad.data_ptr() != view.data_ptr():  # gradient_as_bucket_view: already there
        p.grad.copy_(view)


def _allreduce_then_step(state, bucket):  # no annotations: DDP inspects them
    """DDP comm hook: sort the bucket's parameters (:class:`_Landing`), average the
    bucket as DDP's reducer does, bit for bit; step them once the average lands."""
    state.begin()
    if state.find_unused and state.verifying:  # (those with a gradient here: added now)
        state.check_zeroed([p for p in bucket.parameters() if id(p) in state.fired])
    buffer = bucket.buffer()
    landing = _Landing(state, bucket, buffer)  # sorted now: frees the local gradients at once
    if state.comm_hook is not None:  # the user's reduction, as DDP runs it
        fut = state.comm_hook(state.comm_state, bucket).then(partial(_into, buffer))
    else:
        buffer.mul_(1.0 / state.world)
        fut = state.group.allreduce([buffer]).get_future()  # (a sum: dist.all_reduce)
    if state.overlap and landing.device.type != "cpu" and not state.find_unused:
        # A device future's .then() runs on a stream that waits for the all-reduce.
        return fut.then(landing.then)
    state.defer(landing, fut)
    done: torch.futures.Future = torch.futures.Future()
    done.set_result(buffer)  # as torch's optimizer-in-backward hook: the flush steps
    return done


def _into(buffer: Tensor, fut: Any) -> list[Tensor]:
    """A comm hook's result, written into the bucket (DDP copies it into the gradients),
    as the all-reduce's future gives it: ``[buffer]``."""
    result = fut.value()  # (re-raises a failed reduction)
    if result is not buffer:
        buffer.copy_(result)
    return [buffer]


class _Landing:
    """One bucket's parameters, sorted when DDP hands the bucket over.

    Sorting runs in the comm hook on the autograd thread: each parameter is
    either stepped by its optimizer (its local ``.grad``, already copied into
    the bucket, is freed now), reduced by ``layeropt.backward``'s measure pass,
    or left to get the averaged gradient written back into ``.grad`` (not
    owned, or ``no_step()``), as DDP would. :meth:`apply` does that once the
    bucket's all-reduce has landed.
    """

    __slots__ = ("device", "held", "measures", "params", "pending", "stale", "state",
                 "steps", "write_back")

    def __init__(self, state: _HookState, bucket: Any, buffer: Tensor) -> None:
        self.state = state
        self.steps: dict[Any, list[tuple[Tensor, Tensor]]] = {}  # optimizer -> (param, view)
        self.measures: list[tuple[Any, Tensor, Tensor]] = []
        self.write_back: list[tuple[Tensor, Tensor]] = []
        self.params = params = bucket.parameters()
        self.device = buffer.device
        # find_unused_parameters: gradients not produced since the last sync
        # (held by no_step()); stepped as they are if no process used them.
        self.held: dict[Tensor, Tensor] = {}
        # LAYEROPT_VERIFY: gradients torch's step() applied and nothing zeroed since, and the
        # zeros zero_grad(set_to_none=False) left; DDP leaves them in .grad if no process
        # used the parameter, for the next step()
        self.stale: dict[Tensor, Tensor] = {}
        # find_unused_parameters: those of optimizers this step has not reached yet,
        # sorted by apply() once it knows whether some process used them
        self.pending: list[tuple[Tensor, Tensor, weakref.ref]] = []
        owner = state.owner if state.active else {}
        here = {id(owner.get(p)) for p in params if id(p) in state.fired}  # (reached)
        modes: dict[int, Any] = {}  # id(owner ref) -> what its parameters get, this bucket
        for p, g in zip(params, bucket.gradients()):
            ref = owner.get(p)
            mode = modes.get(id(ref), _WRITE_BACK if ref is None else None)
            if mode is None:  # the optimizer's first parameter in this bucket
                opt = ref()  # type: ignore[misc]
                mode = modes[id(ref)] = (
                    _PENDING if opt is not None and state.find_unused and id(ref) not in here
                    and id(opt._lo_engine) not in state.begun else self._mode(opt))
            if mode is _PENDING:
                self.pending.append((p, _grad_view(p, g), ref))
            else:
                self._sort(p, _grad_view(p, g), mode, ref)

    def _mode(self, opt: Any) -> Any:
        """Where ``opt``'s averaged gradients go in this bucket (its engine says, begun
        now if this step had not reached it): stepped, measured, or written back."""
        if opt is None:
            return _WRITE_BACK
        self.state.begin_engine(opt)
        route = opt._lo_engine.averaged_route()
        if route is None:  # held for step(): as DDP would
            return _WRITE_BACK
        if route is opt._lo_engine:
            return self.steps.setdefault(opt, [])
        return route  # layeropt.backward's measure pass

    def _sort(self, p: Tensor, view: Tensor, mode: Any, ref: Any) -> None:
        """``p`` to ``mode``'s list; a gradient to step leaves ``.grad`` now."""
        state = self.state
        if mode is _WRITE_BACK:
            self.write_back.append((p, view))
        elif p.grad is None and not state.find_unused:
            raise AttachError(DDP_UNUSED_ERROR)
        elif type(mode) is list:
            mode.append((p, view))
            if state.find_unused and p.grad is not None and id(p) not in state.fired:
                kept = self.stale if state.verifying and (  # (or torch's kept zeros)
                    _applied_by_step(ref(), p) or not p.grad.any()) else self.held
                kept[p] = p.grad
            p.grad = None  # the bucket holds it now
        else:
            self.measures.append((mode, p, view))

    def reach(self, used: set[int] | None) -> None:
        """The flush (``find_unused_parameters``): begin the optimizers of the parameters
        waiting here that some process used."""
        for p, _, ref in self.pending:
            opt = ref()
            if opt is not None and used is not None and id(p) in used:
                self.state.begin_engine(opt)

    def then(self, fut: Any) -> Tensor:
        """``.then()`` callback: the all-reduce has landed; step this bucket alone."""
        buffer = fut.value()[0]  # re-raises a failed all-reduce
        with _stepping(self.state):
            for opt, params in self.apply().items():
                opt._lo_engine.step_averaged(params, self.state.settings)
        return buffer

    def apply(self, used: set[int] | None = None) -> dict[Any, list[Tensor]]:
        """Write back or measure the averaged gradients; point ``.grad`` at those to step.

        ``used`` (``find_unused_parameters``): the ids of parameters some
        process used; the others are left alone, as DDP leaves them.

        Returns the parameters to step, by optimizer (their ``.grad`` are the
        bucket's averaged slices: no memory of their own).
        """
        for p, view, ref in self.pending:  # of the optimizers reached (others: left alone)
            opt = ref()
            if opt is not None and id(opt._lo_engine) in self.state.begun:
                self._sort(p, view, self._mode(opt), ref)
        self.pending = []
        for p, view in self.write_back:
            if used is None or id(p) in used:
                _write_back(p, view, None if used is None else self.state.bucket_view)
        for measure, p, view in self.measures:
            if used is None or id(p) in used:
                measure.take_copy(p, view)
            elif p.grad is not None:  # held, untouched by DDP: measured as it is
                measure.take_copy(p, p.grad)
        todo = {}
        for opt, owned in self.steps.items():
            if used is not None:  # no process used it: as without DDP, its held gradient
                steps_held = _steps_held(opt._lo_engine)  # (else: it waits in .grad)
                now = self.held if steps_held else {}
                for p, _ in owned:  # for step(), unless layeropt.backward's step pass
                    if id(p) not in used and p not in now:  # steps it now (step_held);
                        g = self.stale.get(p, self.held.get(p))  # a stale one waits too
                        if g is not None:
                            p.grad = g
                if steps_held and self.stale:
                    # LAYEROPT_VERIFY, as without DDP: a gradient the last step() applied,
                    # which the step pass would take for a held one (torch's clip measured it)
                    self.state.check_zeroed([p for p, _ in owned
                                             if p in self.stale and id(p) not in used])
                owned = [(p, view if id(p) in used else now.get(p)) for p, view in owned]
                owned = [(p, g) for p, g in owned if g is not None]
            for p, view in owned:
                p.grad = view
            if owned:
                todo[opt] = [p for p, _ in owned]
        return todo


def _steps_held(engine: Any) -> bool:
    """Inside ``layeropt.backward``'s step pass (clipping, a scaler): the held gradients it
    does not reach are stepped at its end, transformed (``step_held``); after any other
    backward they wait in ``.grad`` for ``step()``."""
    return engine.transform is not None and engine.transform is not ENTERED


def _ordinary(engine: Any) -> bool:
    """Neither of ``layeropt.backward``'s passes: an engine such a backward need not
    reach (the passes measure and step the held gradients of every engine)."""
    return engine.measure is None and engine.transform is None


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


_WRITE_BACK = object()  # _Landing: leave the averaged gradient in .grad, as DDP would
_PENDING = object()  # _Landing: an optimizer this step has not reached yet
