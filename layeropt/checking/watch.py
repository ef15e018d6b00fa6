"""Torch APIs whose use around an attached backward layeropt must notice.

Each one is a call of the loop on something layeropt does not own; what
layeropt knows (the parameters a backward updated, the ones its optimizers
own) decides whether the loop's numbers would differ from torch's:

* ``GradScaler.scale``: a backward through a scaled loss has gradients that
  must not be applied before ``scaler.step`` has checked them all for
  inf/NaN. :func:`scaled_backward` tells whether the running backward is one;
  the engine then holds its gradients for ``step()`` (exactly torch's recipe).
* ``torch.autograd.backward`` (what ``Tensor.backward`` calls): a backward that
  keeps its graph (``retain_graph=True``) says more backwards over it may
  follow before the update; :func:`graph_kept` tells the engine, which holds
  its gradients for the next stepping backward or ``step()``, as torch sums them.
* ``torch.nn.utils.clip_grad_norm_`` / ``clip_grad_value_`` /
  ``clip_grads_with_norm_``: after an
  attached backward the gradients were already applied and freed, so
  clipping them does nothing and returns 0. Called with parameters stepped
  that way, they raise (a finite ``max_norm``, or by value) or warn (an
  infinite ``max_norm``: a measurement) instead of silently doing nothing.
* accelerate's ``Accelerator.clip_grad_norm_`` / ``clip_grad_value_``: the
  public clipping entry of accelerate loops and of the Hugging Face Trainer,
  guarded as torch's functions are (:meth:`Watchers.watch_tools`). accelerate >= 1.16
  keeps only parameters whose ``.grad`` is set before it reaches torch, so
  torch's functions alone cannot see such a clip.
* torch's pipeline schedules' ``step`` (``torch.distributed.pipelining``, once
  imported): it sums its micro-batches' gradients before the loop steps, so the
  attached optimizers hold theirs while it runs (``layeropt/distributed/pipelining.py``).
* ``nn.Module.zero_grad``: gradients a backward already applied, discarded
  by the loop (``Engine.check_discard``; the optimizer's ``zero_grad`` is
  layeropt's own).
* any optimizer's ``step`` (torch's global step pre-hook): a plain optimizer
  about to step a parameter an attached backward already updated and freed,
  which it would skip.
* ``torch.optim.swa_utils.AveragedModel.update_parameters`` (SWA, EMA): called
  between an attached backward and ``step()`` in a loop that calls ``step()``, it
  would average weights that backward already updated, where torch's loop averages
  them before the update: refused (:func:`refuse_average_ahead`).
* ``nn.Module.state_dict`` (a checkpoint, an EMA that reads it - timm's
  ``ModelEmaV2``): there, parameters an attached backward updated ahead of the
  loop's ``step()`` are a step ahead of torch's; warned as ``optimizer.state_dict()``
  warns (``Engine.saving``, once per optimizer).
* ``DistributedDataParallel.forward``: a DDP model whose parameters carry plain
  hooks (attached before wrapping, or on ``ddp_model.module``) would have each
  gradient applied before DDP averages it, then DDP's average written back
  into ``.grad``: refused before that forward runs (:func:`refuse_plain_hooks`).

Also torch's reentrant ``CheckpointFunction.forward`` (``layeropt/engine/nesting.py``).
:data:`WATCHERS` installs them all when the first attachment is made and undoes
them when the last one goes: neither importing layeropt nor constructing an
optimizer patches anything of torch.
"""

from __future__ import annotations

import functools
import math
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor
from torch.optim.optimizer import register_optimizer_step_pre_hook

from ..engine.registry import ENGINES, HOOKED, hooked_by
from ..engine.subset import INSIDE
from .verify import Verifier
from ..errors import (
    CLIP_EMPTY,
    ALSO_APPLIED,
    AttachError,
    BackwardStateError,
    CLIP_AFTER_BACKWARD,
    CLIP_HELD_ON_HOST,
    LayeroptError,
    SHARED_PARAMETER_ERROR,
    warn,
)

__all__ = ["WATCHERS", "Watchers", "scaled_backward", "graph_kept", "refuse_plain_hooks",
           "CLIP_AFTER_BACKWARD"]

_SCALED: list[weakref.ref] = []  # outputs of GradScaler.scale still alive
_CALLING: list[str] = []  # guarded clipping functions running now (the outermost checks)
_READING: list[bool] = []  # nn.Module.state_dict calls running now (the outermost checks)
_KEPT: list[bool] = []  # retain_graph of the torch.autograd.backward calls running now


def _record_scaled(out: Any) -> None:
    if isinstance(out, Tensor):
        if out.grad_fn is not None:
            _SCALED.append(weakref.ref(out))
    elif isinstance(out, (list, tuple)):
        for o in out:
            _record_scaled(o)


def scaled_backward() -> bool:
    """Whether the backward running now goes through a ``GradScaler.scale`` output."""
    if not _SCALED:
        return False
    _SCALED[:] = [r for r in _SCALED if r() is not None]
    will_execute = torch._C._will_engine_execute_node
    for ref in _SCALED:
        t = ref()
        node = None if t is None else t.grad_fn
        if node is None:
            continue
        # The root of a backward does not count as "will execute": ask its inputs too.
        if will_execute(node) or any(
            n is not None and will_execute(n) for n, _ in node.next_functions
        ):
            return True
    return False


def graph_kept() -> bool:
    """Whether the outermost ``torch.autograd.backward`` running now keeps its graph."""
    return bool(_KEPT) and _KEPT[0]


def _stepped_ids() -> set[int]:
    """Parameters updated by an attached backward since their optimizer's last step()."""
    ids: set[int] = set()
    for engine in list(ENGINES):
        if engine.stepped_since_boundary:
            ids.update(id(p) for p in engine.last.stepped)
    return ids


def _guard(fn: Callable[..., Any], by_norm: bool, name: str) -> Callable[..., Any]:
    @functools.wraps(fn)
    def guarded(parameters: Any, *args: Any, **kwargs: Any) -> Any:
        if _CALLING:  # called by another guarded function (clip_grad_norm_ -> clip_grads_with_norm_)
            return fn(parameters, *args, **kwargs)
        if isinstance(parameters, Tensor):
            parameters = [parameters]
        parameters = list(parameters)
        label = name if "." in name else f"torch.nn.utils.{name}"
        # only parameters without a gradient can have lost it to an attached backward:
        # a bucket clipped in backward has all of its own (O(1) per bucket, not O(model))
        missing = [p for p in parameters if p.grad is None] if ENGINES else []
        stepped = _stepped_ids() if missing or not parameters else ()
        # none at all right after an attached backward: a list filtered on `p.grad is not
        # None` (fairseq, accelerate's style) finds none of the gradients torch's loop has
        empty = not parameters and bool(stepped)
        if empty or stepped and any(id(p) in stepped for p in missing):
            max_norm = args[0] if args else kwargs.get("max_norm", math.inf)
            message = CLIP_AFTER_BACKWARD.format(
                fn=label,
                result="it returns a norm of 0" if by_norm else "no gradient is left",
            )
            if empty:
                message = message.replace("on parameters that an attached backward has "
                                          "already updated", CLIP_EMPTY)
            ids = {id(p) for p in parameters}
            applied = max((e.train_step.stepped_backwards for e in list(ENGINES)
                           if any(id(p) in ids for p in e.last.stepped)), default=0)
            if applied > 1:  # the first refusal names all that was already applied
                message += ALSO_APPLIED.format(n=applied)
            if by_norm and math.isinf(float(max_norm)):
                warn(message.replace("nothing would be clipped", "the norm is not measured"))
            else:
                raise LayeroptError(message)
        hidden = {id(p) for e in list(ENGINES) for p in e.held_elsewhere()} if missing else ()
        if hidden and any(id(p) in hidden for p in missing):
            raise LayeroptError(CLIP_HELD_ON_HOST.format(fn=label))
        _CALLING.append(name)
        try:
            return fn(parameters, *args, **kwargs)
        finally:
            _CALLING.pop()

    guarded._layeropt_guard = True  # type: ignore[attr-defined]
    return guarded


def _guard_method(method: Callable[..., Any], by_norm: bool, name: str) -> Callable[..., Any]:
    """:func:`_guard` for a tool's clipping method ``(self, parameters, ...)``."""

    @functools.wraps(method)
    def guarded(self: Any, parameters: Any, *args: Any, **kwargs: Any) -> Any:
        return _guard(functools.partial(method, self), by_norm, name)(parameters, *args, **kwargs)

    guarded._layeropt_guard = True  # type: ignore[attr-defined]
    return guarded


def _before_any_step(optimizer: Any, args: Any, kwargs: Any) -> None:
    """torch's global step pre-hook: refuse a step that would skip a parameter another
    optimizer's attached backward updated and freed (torch would update it twice).

    While that optimizer verifies (``LAYEROPT_VERIFY``) torch's gradient is still in
    ``.grad``: its verifier says which ones in-backward updating would have freed, and
    the step is refused as it would be without verifying."""
    if INSIDE:  # (the step of an optimizer a stepped one wraps: Lookahead's base)
        return
    inner = optimizer  # (a wrapper's step - accelerate's, Lightning's - is the one inside)
    while not hasattr(inner, "_lo_engine") and isinstance(
            getattr(inner, "optimizer", None), torch.optim.Optimizer):
        inner = inner.optimizer
    own = getattr(inner, "_lo_engine", None)
    ahead = _AHEAD.pop(own, None) if own is not None else None
    if ahead is not None and ahead[0]() is own.train_step:  # (an average before this step())
        raise BackwardStateError(AVERAGE_AHEAD.format(
            name=ahead[1], this="the", holds="holds",
            done="It was taken before this step(), the loop's first."))
    ids: set[int] | None = None
    for engine in list(ENGINES):
        if engine is own or engine._optimizer() is None:  # (deleted: its records are done)
            continue
        if engine.kept_grads:  # zeros torch keeps for them (zero_grad(set_to_none=False)):
            if ids is None:  # this step updates on them, as torch's
                ids = {id(p) for g in optimizer.param_groups for p in g["params"]}
            engine.give_back_kept(ids)
        verifier = engine.find(Verifier)
        freed = verifier.freed() if verifier is not None else ()
        rec = engine.last  # (a zero_grad() since: torch's gradients are gone too)
        stepped = {id(p) for p in rec.stepped} if not rec.zeroed else ()
        if not stepped and not freed:
            continue
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is None and id(p) in stepped or id(p) in freed:
                    cls = type(optimizer)
                    owners = [a.describe() for a in list(engine.attachments)]
                    raise BackwardStateError(SHARED_PARAMETER_ERROR.format(
                        optimizer=f"{cls.__module__}.{cls.__qualname__}",
                        name=engine.name_of(p), owner=" and ".join(owners) or "layeropt"))


def _backward_watcher(original: Callable[..., Any]) -> Callable[..., Any]:
    """``torch.autograd.backward`` (``Tensor.backward`` calls it through the module),
    recording whether the running backward keeps its graph."""

    @functools.wraps(original)  # (tensors, grad_tensors, retain_graph, create_graph, ...)
    def backward(*args: Any, **kwargs: Any) -> Any:
        retain = kwargs.get("retain_graph", args[2] if len(args) > 2 else None)
        if retain is None:  # torch's default: keep the graph where one is created
            retain = kwargs.get("create_graph", args[3] if len(args) > 3 else False)
        _KEPT.append(bool(retain))
        try:
            return original(*args, **kwargs)
        finally:
            _KEPT.pop()

    return backward


def _zero_grad_watcher(original: Callable[..., Any]) -> Callable[..., Any]:
    """``nn.Module.zero_grad``: what it discards, told to every engine first."""

    @functools.wraps(original)
    def zero_grad(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        set_to_none = kwargs.get("set_to_none", args[0] if args else True)
        params = list(self.parameters())
        for engine in list(ENGINES):
            where = f"{type(self).__name__}.zero_grad()"
            engine.check_discard(self.parameters, where)
            verifier = engine.find(Verifier)
            optimizer = engine._optimizer()
            if verifier is not None and optimizer is not None and any(  # (LAYEROPT_VERIFY:
                    optimizer.owns(p) for p in params):  # these were zeroed; another
                verifier.settle(where)  # model's are not
                verifier.zeroed(self.parameters)  # this loop's)
            engine.refuse_regrown(where, self.parameters)  # (what a verifier held: settled)
            engine.module_zero_grad(params, bool(set_to_none))
        return original(self, *args, **kwargs)

    return zero_grad


AVERAGE_AHEAD = (
    "AveragedModel.update_parameters(model) between an attached backward and step(): "
    "that backward already updated parameter {name} (and the others it reached), which "
    "torch.optim updates at step(), so {this} average {holds} this step's weights where "
    "torch's holds the last step's. {done} Call update_parameters() after optimizer.step()."
)
# engine -> the training step in which an average was taken ahead, before its loop's first
# step() (each backward might have been the loop's step): said at that step(), if it comes
_AHEAD: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


def refuse_average_ahead(model: torch.nn.Module) -> None:
    """Refuse an average of ``model``'s parameters that an attached backward updated
    ahead of its loop's ``step()`` (:attr:`Engine.awaits_step`); before the loop's first
    ``step()``, note it for that ``step()`` (:func:`_before_any_step`)."""
    ids = {id(p) for p in model.parameters()}
    for engine in list(ENGINES):
        if not engine.stepped_since_boundary:
            continue
        p = next((p for p in engine.last.stepped if id(p) in ids), None)
        if p is not None and engine.awaits_step:
            raise BackwardStateError(AVERAGE_AHEAD.format(
                name=engine.name_of(p), this="this", holds="would hold",
                done="Nothing was averaged."))
        if p is not None:
            _AHEAD[engine] = (weakref.ref(engine.train_step), engine.name_of(p))


def _averaging_watcher(original: Callable[..., Any]) -> Callable[..., Any]:
    """``AveragedModel.update_parameters``: :func:`refuse_average_ahead` first."""

    @functools.wraps(original)
    def update_parameters(self: torch.nn.Module, model: torch.nn.Module) -> Any:
        refuse_average_ahead(model)
        return original(self, model)

    return update_parameters


def _state_dict_watcher(original: Callable[..., Any]) -> Callable[..., Any]:
    """``nn.Module.state_dict``: read ahead of ``step()``, said by the engines whose
    backward updated its parameters (the outermost call; submodules' are inside it)."""

    @functools.wraps(original)
    def state_dict(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if _READING:
            return original(self, *args, **kwargs)
        ids: set[int] | None = None
        for engine in list(ENGINES):
            if engine.awaits_step:
                ids = {id(p) for p in self.parameters()} if ids is None else ids
                if any(id(p) in ids for p in engine.last.stepped):
                    engine.saving(f"{type(self).__name__}.state_dict()")
        _READING.append(True)
        try:
            return original(self, *args, **kwargs)
        finally:
            _READING.pop()

    return state_dict


PLAIN_UNDER_DDP = (
    "parameter {name!r} of this DistributedDataParallel model carries a plain layeropt "
    "hook, of {other} (attached before DDP(model), or to ddp_model.module): it would "
    "update with this process's gradient as it lands, before DDP averages it (and rounds "
    "it, with a comm hook), and DDP would write its average back into .grad after. "
    "Nothing was run. {release}, then attach the DDP model itself, after wrapping: "
    "layeropt.attach(ddp_model, opt)."
)


def refuse_plain_hooks(ddp: torch.nn.Module) -> None:
    """Refuse a DDP model a parameter of which (one DDP reduces: trainable, not in
    ``_ddp_params_and_buffers_to_ignore``) carries a plain attachment's hook."""
    for name, p in ddp.module.named_parameters():
        other = hooked_by(p)
        if other is not None and p.requires_grad and not getattr(p, "_ddp_ignored", False):
            raise AttachError(PLAIN_UNDER_DDP.format(name=name, other=other.describe(),
                                                     release=other.release))


def _ddp_forward_watcher(original: Callable[..., Any]) -> Callable[..., Any]:
    """``DistributedDataParallel.forward``: :func:`refuse_plain_hooks` first (a dict's
    truth where no plain attachment lives)."""

    @functools.wraps(original)
    def forward(self: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        if HOOKED:
            refuse_plain_hooks(self)
        return original(self, *args, **kwargs)

    return forward


def _scale_watcher(original: Callable[..., Any]) -> Callable[..., Any]:
    """``GradScaler.scale``: its outputs recorded (:func:`scaled_backward`)."""

    @functools.wraps(original)
    def scale(self: Any, outputs: Any) -> Any:
        out = original(self, outputs)
        if self._enabled:
            _record_scaled(out)
        return out

    return scale


class Watchers:
    """The watchers of the module docstring, as one object: installed when the first
    attachment is made (:meth:`acquire`), each with what undoes it, and undone when the
    last attachment goes (:meth:`release`: ``remove()`` or garbage collection).
    Constructing an optimizer patches nothing; ``import layeropt`` neither."""

    def __init__(self) -> None:
        self.users = 0  # live attachments
        self.undo: list[Callable[[], None]] = []  # newest last
        self.tools: set[str] = set()  # the TOOLS watched

    def acquire(self) -> None:
        self.users += 1
        if self.users == 1:
            self._install()

    def release(self) -> None:
        self.users -= 1
        if self.users == 0:
            while self.undo:
                self.undo.pop()()
            self.tools = set()

    def _replace(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """``owner.name`` wrapped by ``make``; undone only while it is still ours (a
        library that wrapped it since keeps its wrapper, around ours)."""
        original = owner.__dict__[name] if name in owner.__dict__ else getattr(owner, name)
        ours = make(original.__func__ if isinstance(original, staticmethod) else original)
        ours = staticmethod(ours) if isinstance(original, staticmethod) else ours
        setattr(owner, name, ours)

        def undo() -> None:
            if owner.__dict__.get(name) is ours:
                setattr(owner, name, original)

        self.undo.append(undo)

    def _install(self) -> None:
        from torch.nn.utils import clip_grad

        from ..engine import nesting as _nesting

        self._replace(torch.autograd, "backward", _backward_watcher)
        self._replace(torch.nn.Module, "zero_grad", _zero_grad_watcher)
        self._replace(torch.nn.Module, "state_dict", _state_dict_watcher)
        self._replace(torch.amp.GradScaler, "scale", _scale_watcher)
        self.undo.append(register_optimizer_step_pre_hook(_before_any_step).remove)
        self._replace(torch.nn.parallel.DistributedDataParallel, "forward", _ddp_forward_watcher)
        self._replace(torch.optim.swa_utils.AveragedModel, "update_parameters",
                      _averaging_watcher)
        self.undo.append(_AHEAD.clear)
        checkpoint_cls = _nesting.checkpoint_function()
        if checkpoint_cls is not None:
            self._replace(checkpoint_cls, "forward", _nesting.segment_watcher)
        names = [("clip_grad_norm_", True), ("clip_grad_value_", False)]
        if hasattr(torch.nn.utils, "clip_grads_with_norm_"):  # torch >= 2.6
            names.append(("clip_grads_with_norm_", True))
        for name, by_norm in names:
            fn = getattr(torch.nn.utils, name, None) or getattr(clip_grad, name)
            if not self._guard_inside(fn, by_norm, name):  # a torch without _no_grad
                guard = functools.partial(_guard, by_norm=by_norm, name=name)
                for module in {torch.nn.utils, clip_grad}:
                    if getattr(module, name, None) is fn:
                        self._replace(module, name, guard)
        self.watch_tools()

    def _guard_inside(self, fn: Callable[..., Any], by_norm: bool, name: str) -> bool:
        """Guard the function torch's ``_no_grad`` wrapper ``fn`` calls, in its closure cell.

        torch's public clipping functions are ``_no_grad`` wrappers around the
        real function, held in the wrapper's closure. Replacing that cell's
        content (not a module attribute) reaches every reference to the public
        function, ``from torch.nn.utils import clip_grad_norm_`` made before
        layeropt was imported included. torch offers no hook here; this is the
        one place layeropt reaches past its public surface to see a call.
        """
        for cell in getattr(fn, "__closure__", None) or ():
            inner = cell.cell_contents
            if callable(inner) and getattr(inner, "__name__", None) in (name, "_" + name):
                ours = _guard(inner, by_norm, name)
                cell.cell_contents = ours

                def undo(cell: Any = cell, inner: Any = inner, ours: Any = ours) -> None:
                    if cell.cell_contents is ours:
                        cell.cell_contents = inner

                self.undo.append(undo)
                return True
        return False

    def watch_tools(self) -> None:
        """Watch the training tools imported by now (:data:`TOOLS`); called at install and
        when a backward reaches an engine, so a tool imported after ``attach`` is watched
        before its first clip (O(1) once all are)."""
        if not self.users or len(self.tools) == len(TOOLS):
            return
        for name, watch in TOOLS.items():
            module = sys.modules.get(name)
            if name not in self.tools and module is not None and watch(self._replace, module):
                self.tools.add(name)  # (not while the module is still being imported)


def _watch_accelerate(replace: Callable[..., None], module: Any) -> bool:
    """accelerate's ``Accelerator.clip_grad_norm_`` / ``clip_grad_value_``, guarded as
    torch's functions are."""
    cls = getattr(module, "Accelerator", None)
    for name, by_norm in (("clip_grad_norm_", True), ("clip_grad_value_", False)):
        if cls is not None and name in cls.__dict__:
            replace(cls, name, functools.partial(
                _guard_method, by_norm=by_norm, name=f"Accelerator.{name}"))
    return cls is not None


def _watch_pipelining(replace: Callable[..., None], module: Any) -> bool:
    """torch's pipeline schedules: ``step()`` holds the attached gradients
    (``layeropt/distributed/pipelining.py``)."""
    from ..distributed.pipelining import watch_schedules

    return watch_schedules(replace, module)


# the tools watched once imported: module -> what watches it
TOOLS: dict[str, Callable[[Callable[..., None], Any], bool]] = {
    "accelerate": _watch_accelerate,
    "torch.distributed.pipelining.schedules": _watch_pipelining,
}


WATCHERS = Watchers()
