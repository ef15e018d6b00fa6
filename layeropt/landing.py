"""What happens when a gradient lands.

This module is the whole in-backward update rule. ``layeropt.attach`` registers
one post-accumulate-grad hook per parameter (:meth:`Engine.hook`). The hook
runs once per parameter per backward, so its common case - same backward, no
mode on, no pin - is a few inlined lines (rule 3); everything else goes
through :meth:`Engine.on_grad`. From there:

1. autograd fires a parameter's hook exactly once per backward, *after* every
   contribution to its gradient has been summed into ``.grad`` (skip
   connections, tied weights and loops included);
2. inside ``optimizer.no_step()`` the gradient is only held: it keeps
   accumulating in ``.grad`` over the next backwards;
3. otherwise the parameter is marked as arrived in its :class:`Bucket`
   (one module's own parameters); when every parameter of the bucket has
   arrived, the bucket is *complete*. Complete buckets queue in arrival order
   until together they hold ``bucket_cap_mb`` of gradient (default 1 MiB;
   a large layer alone reaches it), then are stepped with one call of
   torch's ``step`` (one foreach/fused launch; unscaling and clipping applied
   per bucket first, ``layeropt/_transforms.py``) and their gradients freed -
   after any post-accumulate-grad hook registered later than layeropt's on the
   parameter that completed the queue, as torch's ``step()`` comes after them;
4. when the backward ends (an autograd engine callback queued at the first
   arrival, which queues itself once more when it runs: so it runs after the
   callbacks queued since, such as FSDP2's final reduce-scatter of a second
   root module), the queue, buckets that only partly arrived - some parameters
   got no gradient this time - and gradients held from ``no_step()`` are
   stepped together, and freed;
5. activation checkpointing (``layeropt/checkpointing.py``) keeps this exact:

   * a parameter that a non-reentrant ``layeropt.checkpoint`` segment read in
     forward is *pinned* until this backward has recomputed the segment: a
     gradient that lands while pinned waits, and enters rule 3 when the pin
     is released (so no recomputation sees an updated weight);
   * ``torch.utils.checkpoint(..., use_reentrant=True)`` runs a nested
     backward per segment, in which shared parameters land once per segment
     with partial gradients. Its segments are watched from forward on; a
     backward that will run one *defers*: every gradient is held and all are
     stepped together when the outermost backward ends (exact, but without
     the memory saving; a warning says so);
   * any other backward nested inside an autograd Function's backward raises
     :class:`BackwardStateError`;
6. one torch training step is one step here. A backward whose gradients
   torch's recipe checks or changes before the update is *held* (as under
   ``no_step()``) and stepped by ``step()``: a backward through a
   ``GradScaler``-scaled loss (``layeropt/_watch.py``), and one inside
   ``optimizer.step(closure)`` (the caller may clip); one that keeps its
   graph (``create_graph=True``, ``retain_graph=True``) is held as under
   ``no_step()`` (a gradient penalty's backward, or another backward over the
   same graph, may follow). Once the loop has called
   ``step()`` or ``zero_grad()``, a second attached backward before the next
   call is torch-style accumulation, which in-backward updates would turn
   into several steps: it is refused before anything of it is applied;
   ``step()``/``zero_grad()`` after two such backwards raise too; and once it
   has called ``step()``, a ``zero_grad()`` (the optimizer's or a module's)
   that discards what a backward already applied is refused
   (:meth:`Engine.check_discard`). Each
   training step is one transaction of ``layeropt/_subset.py``;
7. parameters unfrozen (``requires_grad_(True)``) after ``attach`` are picked
   up at the next backward: that backward steps every gradient it left when
   it ends (holds them, under ``no_step()``) and the hooks are rebuilt (also
   at a ``step()`` that found gradients no hook took); frozen ones leave their
   buckets. ``layeropt.backward``'s two passes rebuild the hooks before the
   first, which must measure every gradient the step uses;
8. a DDP model's gradients come from its communication hook
   (``layeropt/_ddp_hook.py``), averaged, a DDP bucket at a time: the first
   bucket of a training step opens this engine's record with the same rules
   (:meth:`Engine.begin_averaged`: refused accumulation, held gradients), and
   each averaged bucket is stepped by the same :meth:`Engine._step`
   (:meth:`Engine.step_averaged`). FSDP2 calls the hooks themselves.

If a backward raises, autograd drops it; its end callback is then released
without running, and the partial gradients it left (arrived but not
stepped) are freed and the bookkeeping reset, before the exception reaches
the caller. Gradients held by ``no_step()`` are kept.

Parameters that receive no gradient are never stepped, as in torch; nor
are those whose ``.grad`` another hook freed. A sparse gradient is refused
(:class:`AttachError`) before anything in its step call is updated.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import torch
from torch import Tensor

from . import _between, _watch
from . import _nesting as nesting
from ._nesting import TaskEnd, _graph_task_id, watch_torch_checkpoint
from ._transforms import Measure, Transform, prepare_grads
from ._registry import check_local_hooks_allowed, world_size
from .errors import IN_A_TRAINER, AttachError, BackwardStateError, warn

__all__ = ["Bucket", "Engine", "Settings"]

_IDLE = -2  # no backward in progress

SPARSE_ERROR = (
    "a parameter got a sparse gradient; layeropt steps dense gradients only. Use a "
    "dense embedding (sparse=False) or leave this parameter to a separate, plain "
    "torch.optim optimizer."
)


ACCUMULATION_ERROR = (
    "{what} before optimizer.step() or zero_grad(): torch would sum these "
    "gradients into one step (gradient accumulation), but layeropt applies each "
    "attached backward at once, so the result would differ. {outcome} Run all but the last micro-batch inside "
    "`with opt.no_step():` (or use layeropt.LoopAccumulator); if every backward is "
    "meant to be a full step, call opt.step() after each one; " + IN_A_TRAINER
)
DISCARD_ERROR = (
    "{where} discards gradients that an attached backward since the last step() has "
    "already applied to {n} parameter(s) (the first: {name}): torch would drop them "
    "here, but layeropt updated the parameters in that backward, so the results "
    "differ from here on (a GAN's generator loss backpropagating into the "
    "discriminator, an actor's loss into the critic). That update was applied; "
    "nothing more is. Keep such a backward from updating these parameters: freeze "
    "them during it (model.requires_grad_(False), then requires_grad_(True) after "
    "it), or run it inside `with opt.no_step():` so that its gradients wait in .grad "
    "and zero_grad() drops them as torch does."
)
RETAIN_HOLD_WARNING = (
    "this backward keeps its graph (retain_graph=True), so more backwards over it may "
    "follow before the update: layeropt holds its gradients in .grad, and the next "
    "backward that does not keep its graph, or step(), applies their sum, exactly as "
    "torch does - nothing is saved in this step. If no second backward over this graph "
    "follows, drop retain_graph=True to update each layer during backward."
)
SCALER_HOLD_WARNING = (
    "this backward runs through a GradScaler-scaled loss (scaler.scale(loss).backward()), "
    "whose gradients must all be checked for inf/NaN before any update: layeropt "
    "holds them until scaler.step(opt), exactly as torch does, so nothing is saved "
    "in this step. Call layeropt.backward(scaler.scale(loss), scaler=scaler) instead "
    "to update each layer during backward (or use bf16 autocast, which needs no scaler)."
)
ORPHAN_WARNING = (
    "the layeropt optimizer attached to these parameters was deleted, so this "
    "backward does not update them: their gradients stay in .grad, as without "
    "layeropt, and the hooks are removed. Keep a reference to the optimizer for as "
    "long as you train (opt = layeropt.AdamW(...))."
)
CLOSURE_HOLD_WARNING = (
    "this backward runs inside optimizer.step(closure), whose caller may clip or "
    "inspect the gradients before the update: layeropt holds them until the "
    "closure returns, exactly as torch does, so nothing is saved in this step. In "
    "Lightning use layeropt.integrations.lightning.LayeroptCallback; otherwise "
    "call loss.backward() and then optimizer.step() without a closure."
)

SCALED_CLIP_ERROR = (
    "attach(clip_value=/bucket_max_norm=) clips each bucket's gradients before its "
    "update, but GradScaler.step hands this fused optimizer its gradients still scaled "
    "(the kernel unscales them), so they would be clipped at the wrong scale. Call "
    "scaler.unscale_(opt) before scaler.step(opt), or use layeropt.backward("
    "scaler.scale(loss), scaler=scaler). Nothing of this step was applied."
)
NO_GRAPH_TASK_ERROR = (
    "a gradient landed outside any autograd graph task, so layeropt cannot tell "
    "when this backward ends (torch's compiled autograd does this in some versions, "
    "2.4 to 2.6 among them; nothing of this backward was applied). Turn "
    "torch._dynamo.config.compiled_autograd off, or upgrade torch."
)


def _queue_callback(fn: Any) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


@functools.cache
def _dynamo_switches() -> tuple[Callable[[Any], Any], Callable[[Any], None]]:
    """dynamo's frame-evaluation switch and code skipper (imported at first attach)."""
    try:
        from torch._dynamo import eval_frame
    except ImportError:  # pragma: no cover - a torch build without dynamo: nothing to hide from
        return (lambda callback: None), (lambda code: None)
    set_eval_frame = getattr(eval_frame, "set_eval_frame", None)
    if set_eval_frame is None:  # torch 2.5 keeps it in the C module only
        from torch._C._dynamo.eval_frame import set_eval_frame
    return set_eval_frame, functools.cache(eval_frame.skip_code)


_ORPHAN_WARNED = [_IDLE]  # the backward (graph task) that warned about deleted optimizers


def _orphaned(param: Tensor, attachment_ref: Any) -> None:
    """A hook whose optimizer (and with it the engine) was deleted: warn once per
    backward; at its end remove the attachment, or, if that is gone too, the dead
    hooks of ``param``. The gradient stays in ``.grad``, as without layeropt."""
    task = _graph_task_id()
    if _ORPHAN_WARNED[0] != task:
        _ORPHAN_WARNED[0] = task
        warn(ORPHAN_WARNING, RuntimeWarning)

    def remove() -> None:
        attachment = attachment_ref()
        if attachment is not None:
            attachment.remove()
        drop_dead_hooks(param)

    _queue_callback(remove)


def drop_dead_hooks(param: Tensor) -> None:
    """Remove ``param``'s layeropt hooks whose optimizer was deleted."""
    hooks = param._post_accumulate_grad_hooks or {}
    for key, fn in list(hooks.items()):
        ref = getattr(fn, "_lo_engine_ref", None)
        if ref is not None and ref() is None:
            del hooks[key]


def _hooked_last(param: Tensor) -> bool:
    """Whether layeropt's hook is the last of ``param``'s post-accumulate-grad hooks. torch
    runs them in registration order and ``step()`` after them all: one registered after
    attach (noise, scaling, logging) must see, and may change, the gradient first."""
    hooks = param._post_accumulate_grad_hooks  # (none left: the attachment was removed)
    return not hooks or len(hooks) == 1 or hasattr(next(reversed(hooks.values())),
                                                   "_lo_engine_ref")


def _all_dense(groups: list[list[Tensor]]) -> bool:
    for g in groups:
        for p in g:
            grad = p.grad
            if grad is None or grad.is_sparse:
                return False
    return True


class Settings:
    """What one ``attach(...)`` call was given; its attachment's buckets share it.

    Settings belong to the attachment they were given to: attaching a second
    model to the same optimizer leaves the first one's as they were.
    """

    __slots__ = ("cap_bytes", "clip_value", "bucket_max_norm", "norm_type")

    def __init__(self, bucket_cap_mb: float = 1.0, clip_value: float | None = None,
                 bucket_max_norm: float | None = None, norm_type: float = 2.0) -> None:
        self.cap_bytes = 0  # complete buckets wait, in arrival order, up to this size
        self.clip_value: float | None = None
        self.bucket_max_norm: float | None = None
        self.norm_type = 2.0  # of bucket_max_norm
        self.configure(bucket_cap_mb=bucket_cap_mb, clip_value=clip_value,
                       bucket_max_norm=bucket_max_norm, norm_type=norm_type)

    def configure(self, **values: Any) -> None:
        """Set the given values (``attach``'s argument names), checked first."""
        for name, value in values.items():
            if name not in ("bucket_cap_mb", "clip_value", "bucket_max_norm", "norm_type"):
                raise TypeError(f"configure() got an unexpected keyword argument {name!r}")
            if name != "norm_type" and value is not None and not value >= 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        for name, value in values.items():
            if name == "bucket_cap_mb":
                self.cap_bytes = int(value * 2**20)
            elif name == "norm_type":
                self.norm_type = float(value)
            else:
                setattr(self, name, value)

    @property
    def clips(self) -> bool:
        """Whether each bucket's gradients are clipped before its step."""
        return self.clip_value is not None or self.bucket_max_norm is not None

    def __repr__(self) -> str:
        return (f"Settings(cap_bytes={self.cap_bytes}, clip_value={self.clip_value}, "
                f"bucket_max_norm={self.bucket_max_norm}, norm_type={self.norm_type})")


_DEFAULT = Settings()


class Bucket:
    """Parameters that are stepped together once all of their gradients landed.

    Attributes:
        name: the module (or modules) the parameters belong to, for messages.
        params: the parameters, in module registration order.
        settings: the :class:`Settings` of the attachment the bucket belongs to.
    """

    __slots__ = ("name", "params", "settings", "nbytes", "full", "arrived", "serial",
                 "__weakref__")

    def __init__(self, name: str, params: list[Tensor], settings: Settings = _DEFAULT) -> None:
        self.name = name
        self.params = params
        self.settings = settings
        self.nbytes = sum(p.numel() * p.element_size() for p in params)  # its gradients
        self.full = (1 << len(params)) - 1  # ``arrived`` once every gradient landed
        self.arrived = 0  # bit i: params[i]'s gradient landed in backward ``serial``
        self.serial = -1

    def __repr__(self) -> str:
        return f"Bucket({self.name!r}, {len(self.params)} params, {self.nbytes} bytes)"


class Engine:
    """Per-optimizer bookkeeping of one backward pass (see the module docstring)."""

    def __init__(self, optimizer: Any) -> None:  # an InBackwardOptimizer (layeropt/optim.py)
        self._optimizer = weakref.ref(optimizer)
        self._detour = False  # a gradient must leave the plain path (see route)
        self.no_step_depth = 0  # open optimizer.no_step() contexts (> 0: hold gradients)
        # gradients accumulated under no_step(), with their bucket
        self.held: dict[Tensor, Bucket | None] = {}
        self._ready: list[list[Tensor]] = []  # complete buckets not yet stepped
        self._ready_bytes = 0
        self.hook_count = 0  # parameters with this engine's post-accumulate-grad hook
        self.attachments: dict[Any, None] = {}  # in the order they were attached (kept alive:
        # the hooks reach them only weakly); changed by add/remove_attachment
        # id(param) -> (its attachment's Settings, its layer bucket's key), made when needed
        self._places: dict[int, tuple[Settings, tuple[int, str]]] | None = None
        self._partial: list[Bucket] = []  # buckets whose first gradient landed incomplete
        self._incomplete = 0  # how many of them are still incomplete
        self._active_task = _IDLE  # autograd graph task of the backward in progress
        self._serial = 0  # counts attached backwards
        self._steps = 0  # parameter updates of the latest backward
        self._counted = False  # the latest backward is counted in _stepped_backwards
        self._distributed = False  # several processes in this backward (checked per backward)
        self.stepped: list[Tensor] = []  # parameters updated in the latest backward
        # layeropt.backward (clipping per bucket is the attachments' Settings)
        self.entered = False  # inside layeropt.backward
        self.measure: Measure | None = None  # the measure pass of layeropt.backward
        self.transform: Transform | None = None  # its step pass: unscale, global clip
        # Checkpointing (rule 5): gradients waiting for a pin, or deferred to the end.
        self._gated: dict[Tensor, tuple[Bucket, int]] = {}
        self._defer = False
        self._deferred: dict[Tensor, Bucket] = {}
        # Steps torch would take as one (rule 6): gradients held for step(), and the
        # backwards since the last step()/zero_grad() that stepped or held.
        self._hold = False  # this backward's gradients wait for step()
        self._graph = False  # backward(create_graph= or retain_graph=True): held as no_step()
        self._sweep = False  # requires_grad changed: step every gradient left at the end
        self._orphaned = False  # the optimizer was deleted: detach when this backward ends
        self._unchecked = False  # rule 6's check waits for this backward's first gradient
        self._scaled = False  # this backward runs through a GradScaler-scaled loss
        self.closure_depth = 0  # inside optimizer.step(closure)
        self.txn = 0  # the training step (transaction) step calls belong to
        self._open_txn = self._zeroed_txn = 0  # txn of the latest backward / zero_grad()
        # A loop that never calls step() steps every backward; once it calls step() or
        # zero_grad() (the calls it made: _calls), a second stepping backward before the
        # next call is refused, and so is a zero_grad() that discards gradients a
        # backward applied, once the loop steps with step().
        self._calls: set[str] = set()
        self._stepped_backwards = 0
        self._held_backwards = 0
        # zero_grad(set_to_none=False): ids of the parameters whose .grad torch would
        # keep as zeros - and step at every step(), used or not. None: set_to_none=True.
        self.kept_grads: set[int] | None = None
        # param_groups as this training step's first update read them (layeropt/_between.py)
        self.hyper: list[dict[str, Any]] | None = None
        self.hyper_txn = -1
        watch_torch_checkpoint()
        _watch.watch()

    # -- modes that take a gradient off the plain path ---------------------
    def route(self) -> None:
        """Recompute ``_detour``: one flag the hook checks instead of five (call it after
        setting ``no_step_depth`` or ``measure``)."""
        self._detour = bool(
            self._distributed
            or self.measure is not None
            or self.no_step_depth
            or self._defer
            or self._hold
            or self._graph
        )

    # -- the hook -------------------------------------------------------
    def hook(self, bucket: Bucket, index: int, attachment: Any) -> Callable[[Tensor], None]:
        """The post-accumulate-grad hook of ``bucket.params[index]``.

        It reaches its engine, bucket and attachment through weak references
        only: torch keeps a tensor's hooks in C++, where no garbage collection
        sees them, so a hook that reached its own tensor (the bucket lists it)
        would keep the model alive forever. The optimizer keeps its engine,
        the engine its attachments, an attachment its buckets. Once the
        optimizer is gone the hook warns and is removed at the end of that
        backward (:func:`_orphaned`); the gradient stays, as without layeropt.

        ``hook(param)`` takes the plain path inline - same backward, no mode
        on, no pin: mark it arrived (:meth:`_arrive`; the gradient itself is
        checked once per step call, :meth:`_dense`) - and hands anything
        else to :meth:`on_grad`. It runs with dynamo's frame
        evaluation off, and dynamo graph-breaks at a call to it
        (``_torchdynamo_disable``; the hook's own code is skipped): compiled
        autograd lifts hooks into a graph it traces, and the engine (weakrefs,
        autograd callbacks, torch's step) must run eagerly. Same contract as
        ``torch.compiler.disable(fn, recursive=True)`` at a seventh of its cost.
        """
        set_eval_frame, skip_code = _dynamo_switches()
        engine_ref, bucket_ref, bit = weakref.ref(self), weakref.ref(bucket), 1 << index
        attachment_ref = weakref.ref(attachment)
        pins, task_id = nesting._PINS, _graph_task_id

        def hook(param: Tensor) -> None:
            prior = set_eval_frame(None)
            try:
                engine, bucket = engine_ref(), bucket_ref()
                if engine is None or bucket is None:
                    _orphaned(param, attachment_ref)
                    return
                if task_id() != engine._active_task or engine._detour or pins:
                    engine.on_grad(bucket, index, param)
                    return
                # _arrive(bucket, index), inlined: this runs for every parameter
                if bucket.serial != engine._serial:
                    bucket.serial, bucket.arrived = engine._serial, 0
                arrived = bucket.arrived
                if arrived & bit:
                    engine._second_gradient(bucket, index)
                bucket.arrived = arrived = arrived | bit
                if arrived == bucket.full:
                    engine._complete(bucket, arrived != bit, param)
                elif arrived == bit:
                    engine._partial.append(bucket)
                    engine._incomplete += 1
            finally:
                set_eval_frame(prior)

        hook._lo_engine_ref = engine_ref  # type: ignore[attr-defined]
        hook._torchdynamo_disable = True  # type: ignore[attr-defined]
        skip_code(hook.__code__)  # one code object for every hook
        return hook

    def on_grad(self, bucket: Bucket, index: int, param: Tensor) -> None:
        """``param``'s gradient has fully accumulated: the general path.

        The hook calls this for a new backward, a mode (``no_step()``, the
        measure pass of ``layeropt.backward``, deferring, several processes)
        or while checkpoint pins exist.
        """
        task = _graph_task_id()
        if task != self._active_task:
            self._enter(task, param)
        if self._unchecked:
            try:
                self._decide()
            except BackwardStateError:
                param.grad = None
                raise
        if self._distributed:
            check_local_hooks_allowed(param)  # never step a DDP replica's local gradient
        grad = param.grad
        if grad is None:  # another hook freed it; nothing to do
            return
        if grad.is_sparse:
            raise AttachError(SPARSE_ERROR)
        if self.measure is not None:
            if self._defer or not _hooked_last(param):  # (measured at the end)
                self._deferred[param] = bucket
            else:
                self.measure.take(param)
            return
        if self.no_step_depth or self._hold or self._graph:
            self.held[param] = bucket
            return
        if self._defer:
            self._deferred[param] = bucket
            return
        if nesting._PINS and nesting.pinned(param):
            self._gated[param] = (bucket, index)
            return
        self._arrive(bucket, index)

    def _arrive(self, bucket: Bucket, index: int) -> None:
        """Mark ``bucket.params[index]`` arrived; queue the bucket once complete.

        The hook runs an inlined copy of this for the plain path.
        """
        bit = 1 << index
        if bucket.serial != self._serial:  # its first gradient in this backward
            bucket.serial, bucket.arrived = self._serial, 0
        arrived = bucket.arrived
        if arrived & bit:
            self._second_gradient(bucket, index)
        bucket.arrived = arrived = arrived | bit
        if arrived == bucket.full:
            self._complete(bucket, arrived != bit, bucket.params[index])
        elif arrived == bit:
            self._partial.append(bucket)
            self._incomplete += 1

    def _complete(self, bucket: Bucket, was_partial: bool, param: Tensor) -> None:
        """Every gradient of ``bucket`` landed (``param``'s last): queue it, step the queue
        at the cap - unless hooks registered after layeropt's are still to run on
        ``param`` (the next step call, or the end of backward, then takes it)."""
        if was_partial:
            self._incomplete -= 1
        if self.held:
            for p in bucket.params:
                self.held.pop(p, None)  # its accumulated gradient is in the bucket now
        self._ready.append(bucket.params)
        self._ready_bytes += bucket.nbytes
        if self._ready_bytes >= bucket.settings.cap_bytes and _hooked_last(param):
            self._flush_ready()

    def _second_gradient(self, bucket: Bucket, index: int) -> NoReturn:
        bucket.params[index].grad = None  # a partial gradient: drop it, as an abort would
        raise BackwardStateError(
            f"a parameter of {bucket.name!r} received a second gradient in the "
            "same backward pass, so it would be stepped on a partial gradient (a "
            "custom autograd Function or hook that delivers it twice?). For "
            "activation checkpointing use layeropt.checkpoint(fn, *args)."
        )

    # -- backward boundaries ---------------------------------------------
    def _enter(self, task: int, param: Tensor) -> None:
        """A gradient landed in a graph task other than the active backward's."""
        if self._active_task != _IDLE and nesting.segment_depth.value:
            return  # the nested backward of a torch reentrant segment (deferring)
        if nesting.nested_in_function_backward():
            if param not in self.held:
                param.grad = None  # a partial gradient: drop it (the abort drops the rest)
            raise BackwardStateError(nesting.NESTED_ERROR)
        if self._active_task != _IDLE:
            self._abort()  # the previous backward died without being finalized
        try:
            self._begin(task)
        except BackwardStateError:
            if param not in self.held:
                param.grad = None  # this backward is refused as a whole
            raise

    def _enter_torch_segment(self, task: int) -> None:
        """A torch reentrant segment is about to run its nested backward (rule 5)."""
        if self.hook_count and self._active_task == _IDLE:
            self._begin(task, defer=True)
        elif self._active_task != _IDLE and not self._defer:
            self._defer = True  # a segment recorded during this backward
            self.route()
            if not self._unchecked:  # (else _decide warns, if a gradient of ours lands)
                warn(nesting.DEFER_WARNING)

    def _begin(self, task: int, defer: bool = False) -> None:
        """A new backward reaches this engine: reset the per-backward state.

        ``defer``: begun by a torch reentrant segment, which runs whether or
        not this engine's parameters take part; what concerns only a
        backward that reaches them (:meth:`_decide`) waits for the first
        gradient that lands here.
        """
        if task == -1:  # before any state changes: nothing of this backward is applied
            raise BackwardStateError(NO_GRAPH_TASK_ERROR)
        if not defer:
            nesting.segment_depth.value = 0  # a first hook outside any segment: nothing is nested
        # asked now: a deferred begin runs in the outer backward, _decide maybe in a nested one
        self._scaled = _watch.scaled_backward()
        self._active_task = task
        self._serial += 1
        self._open()
        segments = nesting._TORCH_SEGMENTS
        self._defer = defer or bool(
            segments and any(map(torch._C._will_engine_execute_node, list(segments)))
        )
        self.route()
        dropped = functools.partial(self._dropped, self._serial)
        _queue_callback(TaskEnd(functools.partial(self._end_last, dropped), dropped))
        if defer:
            self._unchecked = True
        else:
            self._decide()

    def _open(self) -> None:
        """A backward reaches this engine: its record (what it stepped) starts empty."""
        self._steps = 0
        self._counted = False
        self._distributed = world_size() > 1
        self.stepped = []
        self.txn += 1
        self._open_txn = self.txn

    def begin_averaged(self) -> bool:
        """A DDP training step reaches this engine (its comm hook's first bucket).

        The same record and the same rules as a plain backward (rules 6, 7);
        its averaged gradients then come through :meth:`step_averaged`.

        Returns:
            Whether this backward's gradients are held for ``step()``
            (``no_step()``, a GradScaler-scaled loss, ``step(closure)``):
            the comm hook then leaves them in ``.grad``, as DDP would.
        """
        self._open()
        self._scaled = _watch.scaled_backward()
        self._decide()
        hold, graph = self._hold, self._graph
        if hold:
            self._held_backwards += 1
        self._hold = self._graph = False  # (no end-of-backward reset on this path)
        self.route()
        return hold or graph or bool(self.no_step_depth)

    def _decide(self) -> None:
        """Rules 6 and 7 for a backward that reaches this engine's parameters."""
        self._unchecked = False
        # backward(create_graph=True): the gradients' graph is for something the loop
        # does before the update (a gradient penalty's backward); retain_graph=True: more
        # backwards over this graph may follow before it (truncated BPTT's next time step)
        created = torch.is_grad_enabled()
        kept = self.measure is None and not self.entered and _watch.graph_kept()
        self._graph = created or kept
        plain = self.measure is None and not self.no_step_depth
        if plain and self._calls and self._stepped_backwards:
            raise BackwardStateError(ACCUMULATION_ERROR.format(
                what="a second backward after an attached backward that updated the parameters",
                outcome="Nothing of this second backward was applied.",
            ))
        for attachment in list(self.attachments):  # layers (un)frozen since attach (rule 7)
            if attachment.sync(in_backward=True):
                self._sweep = True
        if self._optimizer() is None:  # deleted while its parameters still train
            self._hold = self._orphaned = True
            warn(ORPHAN_WARNING, RuntimeWarning)
        elif plain and not self.entered:
            if self.closure_depth:
                self._hold = True
                warn(CLOSURE_HOLD_WARNING)
            elif self._scaled:
                self._hold = True
                warn(SCALER_HOLD_WARNING)
            elif kept and not created:
                warn(RETAIN_HOLD_WARNING)
        self.route()
        if self._defer:
            warn(nesting.DEFER_WARNING)

    def _end_last(self, dropped: Callable[[], None]) -> None:
        """The backward's callbacks run: end it after those queued since it began (FSDP2
        queues a root's final reduce-scatter when backward reaches that root's output,
        after the first gradient of an earlier root landed here)."""
        _queue_callback(TaskEnd(self._end, dropped))

    def _dropped(self, serial: int) -> None:
        if serial == self._serial and self._active_task != _IDLE:
            self._abort()

    def _end(self) -> None:
        try:
            if self.measure is not None:
                for p in self._deferred:
                    if p.grad is not None:
                        self.measure.take(p)
            elif self._hold:
                self._held_backwards += 1
            elif self.no_step_depth or self._graph:
                if self._sweep:  # unfrozen since attach: no hook held them (rule 7)
                    for p in self._swept():
                        self.held.setdefault(p, None)
            else:
                self._step(self._ready + self._leftovers())
                self.held.clear()
        finally:
            self._reset()
            for attachment in list(self.attachments):
                if self._orphaned:
                    attachment.remove()
                elif attachment.stale:
                    attachment._rebuild()
            self._orphaned = False

    def _leftovers(self) -> list[list[Tensor]]:
        """Gradients that landed but were not stepped, grouped by bucket."""
        if not (self._incomplete or self._gated or self._deferred or self.held or self._sweep):
            return []
        groups: dict[Any, list[Tensor]] = {}
        if self._sweep:  # parameters unfrozen since attach have no hook yet
            swept = [p for p in self._swept() if p not in self.held]
            for i, g in enumerate(self._by_bucket(swept)):
                groups[("swept", i)] = g
        for b in self._partial if self._incomplete else ():
            if b.serial == self._serial and b.arrived != b.full:
                groups[id(b)] = [p for i, p in enumerate(b.params) if b.arrived >> i & 1]
        for p, (b, _) in self._gated.items():
            groups.setdefault(id(b), []).append(p)
        for source in (self._deferred, self.held):
            for p, b in source.items():
                groups.setdefault(id(b), []).append(p)
        # (a sweep also finds the complete buckets queued in _ready: those are stepped there)
        seen: set[int] = {id(p) for g in self._ready for p in g} if self._sweep else set()
        out = []
        for g in groups.values():
            g = [p for p in g if p.grad is not None and id(p) not in seen and not seen.add(id(p))]
            if g:
                out.append(g)
        return out

    def _swept(self) -> list[Tensor]:
        """This optimizer's parameters of the attached models that hold a gradient."""
        optimizer = self._optimizer()
        if optimizer is None:
            return []
        return [p for attachment in list(self.attachments) for p in attachment.owned
                if p.grad is not None and optimizer.owns(p)]

    def _abort(self) -> None:
        """The backward raised: free the gradients it left unstepped, keep no_step()'s."""
        for group in self._ready + self._leftovers():
            for p in group:
                if p not in self.held:
                    p.grad = None
        nesting.segment_depth.value = 0
        if self._counted:  # a backward that raised is not a step of its own
            self._stepped_backwards -= 1
            self._counted = False
        self._reset()

    def _reset(self) -> None:
        self._partial = []
        self._incomplete = 0
        self._ready = []
        self._ready_bytes = 0
        self._gated.clear()
        self._deferred.clear()
        self._defer = False
        self._hold = False
        self._graph = False
        self._sweep = False
        self._unchecked = False
        self._active_task = _IDLE
        self.route()

    def _ungate(self) -> None:
        """Pins were released: gradients no longer pinned enter rule 3."""
        for p in [p for p in self._gated if not nesting.pinned(p)]:
            bucket, index = self._gated.pop(p)
            if p.grad is not None:
                self._arrive(bucket, index)

    # -- stepping ---------------------------------------------------------
    def _flush_ready(self) -> None:
        groups, self._ready, self._ready_bytes = self._ready, [], 0
        self._step(groups)

    def _step(self, groups: list[list[Tensor]]) -> None:
        """Step several buckets' parameters with one call of torch's step, free grads."""
        optimizer = self._optimizer()
        if not groups or optimizer is None:
            return
        groups = self._dense(groups)
        if self.transform is not None or self.clips:
            places = self._placed()
            for group in groups:  # unscaling and clipping are per bucket (one attachment's)
                place = places.get(id(group[0]))
                prepare_grads(group, self.transform, None if place is None else place[0])
        params = groups[0] if len(groups) == 1 else [p for g in groups for p in g]
        try:
            optimizer._step_params(params)
        except BaseException:
            for p in params:  # refused or failed: drop these gradients, as an abort would
                if p not in self.held:
                    p.grad = None
            raise
        for p in params:
            p.grad = None
        if self.held:
            for p in params:
                self.held.pop(p, None)
        self._steps += len(params)
        self.stepped.extend(params)
        if not self._counted:  # this backward updated parameters (rule 6)
            self._counted = True
            self._stepped_backwards += 1

    def _dense(self, groups: list[list[Tensor]]) -> list[list[Tensor]]:
        """``groups`` without gradients another hook freed; refuse a sparse one.

        The hook's plain path does not look at the gradient; this does, once
        per step call.
        """
        if _all_dense(groups):
            return groups
        if any(p.grad is not None and p.grad.is_sparse for g in groups for p in g):
            for g in groups:  # nothing here is stepped: free what backward left, as an abort
                for p in g:
                    if p not in self.held:
                        p.grad = None
            raise AttachError(SPARSE_ERROR)
        return [k for k in ([p for p in g if p.grad is not None] for g in groups) if k]

    # -- layeropt.backward's measure pass ------------------------------------
    def start_measure(
        self,
        measured: dict[Tensor, Tensor],
        norm_type: float | None,
        inv_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        self.measure = m = Measure(measured, norm_type, inv_scale, found_inf)
        self.route()
        # torch's reentrant segments deliver a gradient in several pieces, which torch
        # adds to the accumulated one in turn ((held + a) + b): measured in place then,
        # and restored from a copy; else set aside and added once (held + grad)
        in_place = bool(nesting._TORCH_SEGMENTS)
        for p in self.held:  # accumulated gradients, restored afterwards
            if p.grad is not None:
                m.stash[p] = p.grad.clone() if in_place else p.grad
                if in_place:
                    m.summed.add(id(p))
                else:
                    p.grad = None

    def finish_measure(self) -> None:
        """The measure pass ended (or raised): the held gradients back in ``.grad``."""
        m, self.measure = self.measure, None
        self.route()
        for p, held in m.stash.items() if m is not None else ():
            if id(p) not in m.seen:  # no gradient this pass: measure the held one
                m.reduce(p, held.clone())
            p.grad = held

    def step_held(self) -> None:
        """After ``layeropt.backward``'s step pass, with its transform still set: step
        the ``no_step()`` gradients of parameters that pass did not reach."""
        if self.held and not self.no_step_depth:
            self._step(self._by_bucket([p for p in self.held if p.grad is not None]))
            self.held.clear()

    def discard_held(self) -> None:
        for p in self.held:
            p.grad = None
        self.held.clear()

    @property
    def last_backward_steps(self) -> int:
        """Parameter updates made by the latest attached backward."""
        return self._steps

    def step_averaged(self, params: list[Tensor]) -> None:
        """Step ``params`` now: their gradients are complete and averaged (a DDP
        bucket); unscaling and clipping apply as to any bucket."""
        self._step([params])

    def _by_bucket(self, params: list[Tensor]) -> list[list[Tensor]]:
        """``params`` grouped as their layer buckets are - one module's own parameters of
        one attachment - for per-bucket clipping (rule 3); also those not hooked yet
        (unfrozen late). Parameters outside every attached model are never clipped."""
        if not params or not self.clips:
            return [params] if params else []
        places = self._placed()
        groups: dict[Any, list[Tensor]] = {}
        for p in params:
            place = places.get(id(p))
            groups.setdefault(id(p) if place is None else place[1], []).append(p)
        return list(groups.values())

    # -- attachments and their settings ---------------------------------------
    def add_attachment(self, attachment: Any) -> None:
        """``attachment`` steps some of this optimizer's parameters (kept alive here:
        the hooks reach it only weakly); called again when it re-hooks."""
        self.attachments[attachment] = None
        self._places = None

    def remove_attachment(self, attachment: Any) -> None:
        self.attachments.pop(attachment, None)
        self._places = None

    @property
    def clips(self) -> bool:
        """Whether an attachment clips each bucket (``clip_value``/``bucket_max_norm``)."""
        return any(a.settings.clips for a in self.attachments)

    def _placed(self) -> dict[int, tuple[Settings, tuple[int, str]]]:
        """``id(param) -> (Settings, bucket key)`` for every attached model's parameters."""
        if self._places is None:
            self._places = {
                id(p): (a.settings, (id(a), name.rpartition(".")[0]))
                for a in list(self.attachments) for name, p in a.named
            }
        return self._places

    def flush_leftovers(self) -> None:
        """Step and free every gradient the hooks did not consume (``step()``)."""
        optimizer = self._optimizer()
        if optimizer is None:
            return
        self.check_boundary("step()")
        self._zero_kept_grads(optimizer)
        params = [
            p for g in optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        if params and self._stepped_backwards:  # set after backward (layeropt/_between.py)
            _between.refuse_second_update(self.stepped, params)
        if params and getattr(optimizer, "grad_scale", None) is not None and self.clips:
            raise BackwardStateError(SCALED_CLIP_ERROR)
        steps = self._steps  # (stepped_in_backward counts the backward's updates only)
        self._step(self._by_bucket(params))
        self._steps = steps
        self.held.clear()
        self.boundary("step()")
        if params:  # gradients no hook took: layers unfrozen (or hooks lost) since
            for attachment in list(self.attachments):
                attachment.sync()

    # -- zero_grad(set_to_none=False) (layeropt/_between.py) ----------------
    def zero_grad_called(self, set_to_none: bool) -> None:
        self.kept_grads = _between.kept_after_zero_grad(self.kept_grads, self._this_step(),
                                                        set_to_none)
        self._zeroed_txn = self.txn

    def unused_kept(self, optimizer: Any) -> list[Tensor]:
        """Parameters torch would update on a kept zero gradient at this ``step()``."""
        return _between.unused_kept(self.kept_grads, self._this_step(), optimizer.param_groups)

    def _this_step(self) -> list[Tensor]:
        """What backwards stepped since the last ``zero_grad()`` (if none reached this
        optimizer, ``stepped`` is an earlier training step's)."""
        return self.stepped if self._open_txn > self._zeroed_txn else []

    def _zero_kept_grads(self, optimizer: Any) -> None:
        for p in self.unused_kept(optimizer):  # torch steps them on a zero gradient
            p.grad = torch.zeros_like(p)

    # -- training-step boundaries (rule 6) ---------------------------------
    @property
    def stepped_since_boundary(self) -> bool:
        """Whether an attached backward updated parameters since the last step()/zero_grad()."""
        return self._stepped_backwards > 0

    def check_boundary(self, where: str) -> None:
        """Refuse a step()/zero_grad() that ends what torch would take as one step of
        several, or after the hyperparameters the updates used were changed."""
        if self.hyper is not None:
            before, self.hyper = self.hyper, None
            optimizer = self._optimizer()
            if optimizer is not None:
                _between.check_unchanged(before, optimizer.param_groups, where)
        stepped, held = self._stepped_backwards, self._held_backwards
        if stepped >= 2 or (stepped and held):
            self._stepped_backwards = self._held_backwards = 0
            raise BackwardStateError(ACCUMULATION_ERROR.format(
                what=f"{where} ends {stepped + held} backwards, {stepped} of which already "
                "updated the parameters,",
                outcome="Each of those was applied as its own step; nothing more is.",
            ))

    def boundary(self, where: str) -> None:
        """``step()`` or ``zero_grad()`` (``where``) ended a training step."""
        self.hyper = None  # (updates step() itself made read the values of that moment)
        self._stepped_backwards = self._held_backwards = 0
        self._calls.add(where)
        self.txn += 1

    def check_discard(self, params: Callable[[], Iterable[Tensor]] | None, where: str) -> None:
        """Refuse a ``zero_grad`` (``where``: the optimizer's, or ``model.zero_grad()``
        over ``params()``) that discards gradients an attached backward has already
        applied: once the loop calls ``step()``, a backward whose updates no ``step()``
        followed is one whose gradients torch would drop here (a GAN's generator loss
        reaching the discriminator, an actor's loss the critic)."""
        if (self._stepped_backwards != 1 or self._held_backwards or "step()" not in self._calls
                or not self.stepped):
            return
        stepped = self.stepped
        if params is not None:
            ids = {id(p) for p in params()}
            stepped = [p for p in stepped if id(p) in ids]
            if not stepped:
                return
        self._stepped_backwards = 0  # said once: the loop may go on
        raise BackwardStateError(DISCARD_ERROR.format(
            where=where, n=len(stepped), name=self.name_of(stepped[0])))

    def name_of(self, param: Tensor) -> str:
        """``param``'s name in its attached model, for messages."""
        for attachment in list(self.attachments):
            for name, p in attachment.named:
                if p is param:
                    return repr(name)
        return f"of shape {tuple(param.shape)}"

    def on_param_groups_changed(self) -> None:
        for attachment in list(self.attachments):
            attachment._rebuild()
