"""What happens when a gradient lands: the plain path.

``layeropt.attach`` registers one post-accumulate-grad hook per parameter
(:meth:`Engine.hook`). Autograd fires it exactly once per backward, *after*
every contribution to the parameter's gradient has been summed into ``.grad``
(skip connections, tied weights and loops included). Its common case - the
backward in progress, no mode on, no checkpoint pin - is this module, and
nothing else:

1. the parameter is marked as arrived in its :class:`Bucket` (one module's own
   parameters); when every parameter of the bucket has arrived, the bucket is
   *complete*;
2. complete buckets queue in arrival order until together they hold their
   attachment's ``bucket_cap_mb`` of gradient (:class:`Settings`; default 1
   MiB, which a large layer alone reaches) - and until any post-accumulate-grad
   hook registered later than layeropt's on the parameter that completed the
   queue has run, as torch's ``step()`` comes after them;
3. then they are stepped with one call of torch's ``step`` on exactly their
   parameters, through the engine's stepper (:meth:`Engine._step`, then
   ``Stepper.step`` in ``layeropt/engine/stepper.py``: unscaling and clipping
   first, ``layeropt/engine/transforms.py``, per bucket where they differ by
   bucket; the update itself one call of the optimizer's ``SubsetStepper``,
   ``layeropt/engine/subset.py``), and their gradients freed.

Everything else - the start and end of a backward, modes that hold gradients
(``no_step()``, a GradScaler-scaled loss, ``step(closure)``, a kept graph),
``layeropt.backward``'s measure pass, checkpoint pins and deferral, DDP's
averaged buckets, the training-step boundaries ``step()`` / ``zero_grad()`` -
is beside it, in ``layeropt/engine/rules.py``, which the hook enters through
:meth:`Engine.on_grad`.

Parameters that receive no gradient are never stepped, as in torch; nor
are those whose ``.grad`` another hook freed. A sparse gradient is refused
(:class:`AttachError`) before anything in its step call is updated.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from typing import Any, TypeVar

import torch
from torch import Tensor

from . import nesting
from .between import snapshot
from .nesting import _dynamo_switches, _graph_task_id
from .boundaries import DETACHED, REMOVE_WARNED, Group
from .rules import IDLE, Rules
from .stepper import PLAIN, Stepper, Wrapper
from ..errors import ORPHAN_WARNING, REMOVE_OPEN_WARNING, SPARSE_ERROR, AttachError, warn

__all__ = ["Bucket", "Engine", "Settings"]

_W = TypeVar("_W", bound=Wrapper)


# The backward (graph task) that warned about deleted optimizers, once per backward.
_ORPHAN_WARNED = [IDLE]


def _orphaned(param: Tensor, attachment_ref: Any) -> None:
    """A hook whose optimizer (and with it the engine) was deleted: warn once per
    backward; at its end remove the attachment - or, where another of its optimizers
    lives (``attach(model, [opt1, opt2])``), re-hook it for those alone (at their end of
    backward, or here) - and the dead hooks of ``param``. The gradient stays in
    ``.grad``, as without layeropt."""
    task = _graph_task_id()
    if _ORPHAN_WARNED[0] != task:
        _ORPHAN_WARNED[0] = task
        warn(ORPHAN_WARNING, RuntimeWarning)
    attachment = attachment_ref()
    if attachment is not None:
        attachment.stale = True  # (a live engine ending this backward re-hooks it)

    def remove() -> None:
        attachment = attachment_ref()
        if attachment is not None:
            live = attachment.optimizers
            if not live:
                attachment.remove()
            elif attachment.stale and all(o._lo_engine.backward is None for o in live):
                attachment._rebuild()
        drop_dead_hooks(param)

    torch.autograd.Variable._execution_engine.queue_callback(remove)


def drop_dead_hooks(param: Tensor) -> None:
    """Remove ``param``'s layeropt hooks whose optimizer was deleted."""
    hooks = param._post_accumulate_grad_hooks or {}
    for key, fn in list(hooks.items()):
        ref = getattr(fn, "_lo_engine_ref", None)
        if ref is not None and ref() is None:
            del hooks[key]


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
            if name == "bucket_cap_mb" and not isinstance(value, (int, float)):
                raise TypeError(f"bucket_cap_mb must be a number of MiB (0: one parameter "
                                f"per bucket; default 1.0), got {value!r}")
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


class Bucket:
    """Parameters that are stepped together once all of their gradients landed.

    Attributes:
        name: the module (or modules) the parameters belong to, for messages.
        params: the parameters, in module registration order.
        settings: the :class:`Settings` of the attachment the bucket belongs to.
    """

    __slots__ = ("name", "params", "settings", "nbytes", "full", "arrived", "serial", "hooks",
                 "__weakref__")

    def __init__(self, name: str, params: list[Tensor], settings: Settings | None = None
                 ) -> None:
        self.name = name
        self.params = params
        self.settings = Settings() if settings is None else settings
        self.nbytes = sum(p.numel() * p.element_size() for p in params)  # its gradients
        self.full = (1 << len(params)) - 1  # ``arrived`` once every gradient landed
        self.arrived = 0  # bit i: params[i]'s gradient landed in backward ``serial``
        self.serial = -1
        self.hooks: list[Callable[[Tensor], None]] = []  # params[i]'s layeropt hook

    def __repr__(self) -> str:
        return f"Bucket({self.name!r}, {len(self.params)} params, {self.nbytes} bytes)"


class Engine(Rules):
    """One per layeropt optimizer: what lands, and how it is stepped.

    Its state, each changed only by its own methods (here, in
    ``layeropt/engine/rules.py``, ``layeropt/engine/boundaries.py`` and
    ``layeropt/engine/zeroing.py``):

    * what it steps: the optimizer (weakly) and its ``attachments``, with the
      placement of their parameters (settings, bucket) derived from them;
    * the backward in progress (``backward``, a record dropped when it ends)
      and the latest one (``last``: what it stepped);
    * the training step in progress (``train_step``, a record replaced at each
      ``step()`` / ``zero_grad()``) and its transaction id ``txn``;
    * the modes the loop has entered (``no_step()``, ``step(closure)``,
      ``layeropt.backward``'s passes) and what it has called (``calls``,
      ``kept_grads``).
    """

    def __init__(self, optimizer: Any) -> None:  # an InBackwardOptimizer (layeropt/optim.py)
        self._optimizer = weakref.ref(optimizer)
        self.attachments: dict[Any, None] = {}  # in the order they were attached (kept alive:
        # the hooks reach them only weakly)
        # id(param) -> (its attachment's Settings, its layer bucket's key), made when needed
        self._places: dict[int, tuple[Settings, tuple[int, str]]] | None = None
        self.stepper: Stepper = PLAIN  # how a step call updates (features wrap it)
        self.regrouped = False  # param_groups edited in place in this backward: hooks stale
        Rules.__init__(self)
        # deleted: what torch's .grad would hold of it goes back there (remove() and more)
        weakref.finalize(optimizer, self.let_go).atexit = False

    def wrap(self, outer: Wrapper) -> None:
        """Install a feature: ``outer`` wraps the stepper (``layeropt/engine/stepper.py``)."""
        outer.inner, self.stepper = self.stepper, outer

    def unwrap(self, outer: Wrapper) -> None:
        """Remove a feature :meth:`wrap` installed (wherever it is in the chain)."""
        if self.stepper is outer:
            self.stepper = outer.inner
            return
        s = self.stepper
        while s.inner is not None:
            if s.inner is outer:
                s.inner = outer.inner
                return
            s = s.inner

    def find(self, kind: type[_W]) -> _W | None:
        """The installed feature of type ``kind``, or ``None``."""
        s: Stepper | None = self.stepper
        while s is not None and not isinstance(s, kind):
            s = s.inner
        return s

    # -- the hook ---------------------------------------------------------
    def hook(self, bucket: Bucket, index: int, attachment: Any) -> Callable[[Tensor], None]:
        """The post-accumulate-grad hook of ``bucket.params[index]``.

        It reaches its engine, bucket and attachment through weak references
        only: torch keeps a tensor's hooks in C++, where no garbage collection
        sees them, so a hook that reached its own tensor (the bucket lists it)
        would keep the model alive forever. The optimizer keeps its engine,
        the engine its attachments, an attachment its buckets. Once the
        optimizer is gone the hook warns and is removed at the end of that
        backward (:func:`_orphaned`); the gradient stays, as without layeropt.

        ``hook(param)`` takes the plain path (the module docstring's rules 1-3;
        the gradient itself is checked once per step call, in :meth:`_step`),
        after :meth:`on_grad` for a gradient off it (which says whether it
        goes on to the plain path). It runs
        with dynamo's frame evaluation off, and dynamo graph-breaks at a call
        to it (``_torchdynamo_disable``; the hook's own code is skipped):
        compiled autograd lifts hooks into a graph it traces, and the engine
        (weakrefs, autograd callbacks, torch's step) must run eagerly. Same
        contract as ``torch.compiler.disable(fn, recursive=True)`` at a
        seventh of its cost.
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
                rec = engine.backward
                if rec is None or rec.route != task_id() or pins:
                    if not engine.on_grad(bucket, index, param):
                        return
                    rec = engine.backward  # the plain path: rules 1-3
                if bucket.serial != rec.serial:  # its first gradient in this backward
                    bucket.serial, bucket.arrived = rec.serial, 0
                arrived = bucket.arrived = bucket.arrived | bit
                if arrived == bucket.full:
                    if arrived != bit:
                        rec.incomplete -= 1
                    if engine.train_step.held:
                        engine.unhold(bucket)  # its accumulated gradient is in the bucket now
                    rec.ready.append(bucket)
                    rec.ready_bytes += bucket.nbytes
                    if rec.ready_bytes >= bucket.settings.cap_bytes:
                        hooks = param._post_accumulate_grad_hooks  # (hooked_last, inlined;
                        # none left: the attachment was removed during this backward)
                        if not hooks or len(hooks) == 1 or hasattr(
                                next(reversed(hooks.values())), "_lo_engine_ref"):
                            ready, rec.ready, rec.ready_bytes = rec.ready, [], 0
                            engine._step(ready)
                elif arrived == bit:
                    rec.partial.append(bucket)
                    rec.incomplete += 1
            finally:
                set_eval_frame(prior)

        bucket.hooks.append(hook)  # (pins released: the hook runs again, Rules.pins_released)
        hook._lo_engine_ref = engine_ref  # type: ignore[attr-defined]
        hook._torchdynamo_disable = True  # type: ignore[attr-defined]
        skip_code(hook.__code__)  # one code object for every hook
        return hook

    # -- stepping ---------------------------------------------------------
    def _step(self, groups: list[Any]) -> None:
        """Step several groups' parameters (:class:`Bucket` / :class:`Group`) with one call
        of torch's step, after unscaling and clipping each group; free their gradients."""
        optimizer = self._optimizer()
        if not groups or optimizer is None:
            return
        params: list[Tensor] = []
        for g in groups:
            params += g.params
        if self.regrouped:  # (hooks of parameters it no longer owns: torch leaves .grad)
            groups = [Group([p for p in g.params if optimizer.owns(p)], g.settings)
                      for g in groups]
            params = [p for g in groups for p in g.params]
        for p in params:  # the plain path does not look at gradients: this does, once
            grad = p.grad
            if grad is None or grad.is_sparse:
                groups = self._dense(groups)
                params = []
                for g in groups:
                    params += g.params
                break
        if not params:
            return
        t = self.transform
        if t is not None and t.inv_scale is None and t.coef is None:
            t = None  # (layeropt.backward without clipping or scaler)
        params = self.stepper.step(self, optimizer, groups, params, t)
        if not params:
            return
        step = self.train_step
        if step.held:
            for p in params:
                step.held.pop(p, None)
        rec = self.last
        rec.steps += len(params)
        rec.stepped += params
        updated = step.updated  # (their version counters now: a write since is refused)
        for p in params:
            updated[p] = p._version
        if not rec.counted:  # this backward updated parameters (the accumulation rule)
            rec.counted = True
            step.stepped_backwards += 1
        if step.hyper_txn != self.txn:  # the transaction's first update: what it read
            step.hyper_txn = self.txn
            step.hyper = snapshot(optimizer.param_groups)

    def _dense(self, groups: list[Any]) -> list[Group]:
        """``groups`` without gradients another hook freed; refuse a sparse one (nothing of
        the call stepped; what backward left freed, as an abort would)."""
        if any(p.grad is not None and p.grad.is_sparse for g in groups for p in g.params):
            held = self.train_step.held
            for g in groups:
                for p in g.params:
                    if p not in held:
                        p.grad = None
            raise AttachError(SPARSE_ERROR)
        dense = (Group([p for p in g.params if p.grad is not None], g.settings) for g in groups)
        return [g for g in dense if g.params]

    def step_averaged(self, params: list[Tensor], settings: Settings | None) -> None:
        """Step ``params`` now: their gradients are complete and averaged (a DDP
        bucket); unscaling and clipping apply as to any bucket."""
        self._step([Group(params, settings)])

    def land_averaged(self, params: list[Tensor], settings: Settings) -> None:
        """Averaged DDP gradients landed: queue them as a complete bucket, step the queue
        at the cap (the rest by :meth:`step_ready`)."""
        rec = self.last
        rec.ready.append(Group(params, settings))
        for p in params:
            rec.ready_bytes += p.grad.nbytes
        if rec.ready_bytes >= settings.cap_bytes:
            self.step_ready()

    def step_ready(self) -> None:
        """Step the ready queue of the latest backward (a DDP backward's last buckets)."""
        rec = self.last
        ready, rec.ready, rec.ready_bytes = rec.ready, [], 0
        self._step(ready)

    # -- attachments and their settings -------------------------------------
    def add_attachment(self, attachment: Any) -> None:
        """``attachment`` steps some of this optimizer's parameters (kept alive here:
        the hooks reach it only weakly); called again when it re-hooks."""
        if attachment not in self.attachments:
            self.take_kept(list(attachment.owned))
        store = self.stepper.held  # sums held in a store for layers frozen now: back in
        if store:  # .grad, where autograd adds onto them once unfrozen, before any hook
            store.up([p for p in attachment.owned if p in store and not p.requires_grad])
        self.attachments[attachment] = None  # (multifuzz seed 541,054: g1 + (g3 + g4))
        self._places = None

    def remove_attachment(self, attachment: Any) -> None:
        store = self.stepper.held  # sums held in a store, not in .grad: back in .grad, where
        if store:  # torch's are, and the backwards from here add to them as autograd does
            store.up([p for p in attachment.owned if p in store])
        self.give_back_kept({id(p) for p in attachment.covered})
        self.attachments.pop(attachment, None)
        self._places = None
        if not self.attachments:
            self.calls.add(DETACHED)
            if ("step()" in self.calls and self.stepped_since_boundary  # (not a step-less
                    and REMOVE_WARNED not in self.calls):  # loop; said once)
                self.calls.add(REMOVE_WARNED)
                warn(REMOVE_OPEN_WARNING)
            self.warn_unwatched()

    @property
    def clips(self) -> bool:
        """Whether an attachment clips each bucket (``clip_value``/``bucket_max_norm``)."""
        return any(a.settings.clips for a in self.attachments)

    def placed(self, params: list[Tensor]) -> list[Group]:
        """``params`` grouped as their layer buckets are - one module's own parameters of
        one attachment, with its settings - for per-bucket clipping; also those not
        hooked yet (unfrozen late). Parameters outside every attached model are never
        clipped; without clipping, one group."""
        if not params:
            return []
        if not self.clips:
            return [Group(params, None)]
        if self._places is None:  # id -> (settings, bucket key, place in the module)
            self._places = {
                id(p): (a.settings, (id(a), name.rpartition(".")[0]), i)
                for a in list(self.attachments) for i, (name, p) in enumerate(a.named)
            }
        groups: dict[Any, Group] = {}  # (each in its module's order: clip_grad_norm_ sums
        places = [(self._places.get(id(p), (None, id(p), -1)), p) for p in params]  # the
        for (settings, key, _), p in sorted(places, key=lambda place: place[0][2]):  # norms
            groups.setdefault(key, Group([], settings)).params.append(p)  # in that order)
        return list(groups.values())

    def name_of(self, param: Tensor) -> str:
        """``param``'s name in its attached model, for messages."""
        for attachment in list(self.attachments):
            for name, p in attachment.named:
                if p is param:
                    return repr(name)
        return f"of shape {tuple(param.shape)}"

    def on_param_groups_changed(self, in_backward: bool = False) -> None:
        """The optimizer's param groups changed (``add_param_group``, or edited in place:
        ``Attachment.sync``): the attachments re-hook - inside a backward at its end, and
        until then the engine steps only what the optimizer owns now."""
        if in_backward:
            self.regrouped = True
            for attachment in list(self.attachments):
                attachment.stale = True
            return
        for attachment in list(self.attachments):
            attachment._rebuild()
