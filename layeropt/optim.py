"""The in-backward optimizer family.

Every layeropt optimizer is the ``torch.optim`` class of the same name with one
extra ability: it can step *any subset* of its parameters with torch's own
``step`` code. That ability is what the backward hooks use (see
``layeropt/engine/landing.py``), so the update math is never re-derived here and the
results equal ``torch.optim`` bit for bit.

Until ``layeropt.attach`` hooks a model, a layeropt optimizer *is* its torch
counterpart: same constructor, same ``step``, same ``state_dict`` format.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import sys
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch
from torch import Tensor
from torch.optim import Optimizer

from .engine.registry import ENGINES
from .engine.subset import SubsetStepper, narrowable
from .errors import (COMPILED_STEP_ERROR, LOAD_BETWEEN_ERROR, WRAPPED_STEP_ERROR, AttachError,
                     BackwardStateError, LayeroptError)
from .engine.landing import Engine
from .engine.nesting import _dynamo_switches

__all__ = [
    "InBackwardOptimizer",
    "in_backward",
    "unwrap_optimizer",
    "SGD",
    "Adam",
    "AdamW",
    "Adagrad",
    "RMSprop",
    "is_in_backward",
]

_O = TypeVar("_O", bound=Optimizer)

# Optimizers whose update of one parameter depends on the others (or that need
# a closure), so stepping a subset as soon as its gradient lands cannot match
# stepping all of them at once.
_NOT_PER_PARAMETER = {"LBFGS": "it needs a closure and keeps one state for all parameters"}


def _raw_step(cls: type) -> Callable[..., Any]:
    """Return ``cls.step`` without torch's profiling/hook wrapper.

    ``Optimizer.__init__`` wraps each class's ``step`` once with
    ``profile_hook_step`` (record_function + user step hooks). Bucket steps
    inside backward skip that wrapper: user step hooks run once per
    ``optimizer.step()`` call, not once per layer.
    """
    for klass in cls.__mro__:
        fn = klass.__dict__.get("step")
        if fn is not None:
            return fn.__wrapped__ if getattr(fn, "hooked", False) else fn
    raise LayeroptError(f"{cls.__name__} has no step() method")


def check_groups(optimizer: Optimizer) -> None:
    """Refuse param groups whose in-backward updates could not equal torch's one ``step()``:
    torch steps a parameter listed twice in a group twice (layeropt once per gradient);
    a ``differentiable`` update builds a graph; torch's Adafactor with ``eps[0]=None``
    takes one epsilon per call from the dtype of its first parameter, so a group mixing
    dtypes gets the epsilon of whichever parameter a call starts with."""
    name = type(optimizer).__name__
    for i, g in enumerate(optimizer.param_groups):
        if g.get("differentiable", False):
            raise AttachError(
                f"{name}(differentiable=True) builds a graph through its update, which "
                "cannot happen inside backward. Use differentiable=False to attach, or keep "
                "this optimizer un-attached.")
        params = g["params"]
        if len({id(p) for p in params}) < len(params):
            raise AttachError(
                f"param group {i} of {name} lists a parameter more than once: torch.optim "
                "updates it once per listing in each step() (and warns that this will be an "
                "error), layeropt once per gradient. List each parameter once (e.g. "
                "deduplicate with dict.fromkeys(params)).")
        eps = g.get("eps")
        if not (isinstance(optimizer, getattr(torch.optim, "Adafactor", ()))
                and isinstance(eps, (tuple, list)) and eps and eps[0] is None):
            continue
        dtypes = {p.dtype for p in params if p.requires_grad}
        if len(dtypes) > 1:
            raise AttachError(
                f"param group {i} of {name} mixes parameter dtypes "
                f"({', '.join(sorted(str(d) for d in dtypes))}) with eps[0]=None: torch's "
                "Adafactor then takes one epsilon per step() from the dtype of the first "
                "parameter it updates, which differs between a whole step and one layer's. "
                "Give eps a number (e.g. eps=(torch.finfo(torch.bfloat16).eps, 1e-3)) or put "
                "each dtype in its own param group.")


class InBackwardOptimizer(Optimizer):
    """Mixin that gives a ``torch.optim.Optimizer`` subclass in-backward updates.

    Use it through the concrete classes (``layeropt.Adam`` ...) or
    :func:`in_backward`. It adds:

    * ``no_step()`` - a context in which attached backwards accumulate
      gradients instead of stepping (gradient accumulation);
    * ``step()`` - unchanged before ``attach``; after it, steps only the
      parameters that still hold a gradient the hooks did not consume, and
      frees those gradients;
    * ``stepped_in_backward`` - how many parameter updates the hooks made in
      the last backward (for logging and tests).
    """

    _torch_step: Callable[..., Any]  # set on each concrete class

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._lo_engine = Engine(self)
        self._lo_stepper = self._new_stepper()
        self._lo_group_index: dict[int, tuple[int, Tensor]] | None = None
        self._lo_groups_seen: list[tuple[int, ...]] = []
        self.last_grad_norm: Tensor | None = None  # set by layeropt.backward(max_norm=...)
        super().__init__(*args, **kwargs)
        ENGINES.add(self._lo_engine)  # (once torch's __init__ accepted the arguments)

    @classmethod
    def _new_stepper(cls) -> SubsetStepper:
        return SubsetStepper(cls.__name__, _call_torch_step, narrowable(cls._torch_step))

    # ------------------------------------------------------------------
    # The one primitive: step a subset of parameters with torch's code.
    # ------------------------------------------------------------------
    def _group_index(self) -> dict[int, tuple[int, Tensor]]:
        """``id(param) -> (index of its param group, param)``.

        Keyed by ``id`` (no Python-level tensor hash); holding the parameter
        keeps its id from being reused while the index lives.
        """
        if self._lo_group_index is None:
            self._lo_group_index = {
                id(p): (i, p) for i, g in enumerate(self.param_groups) for p in g["params"]
            }
            self._lo_groups_seen = [tuple(map(id, g["params"])) for g in self.param_groups]
        return self._lo_group_index

    def _regrouped(self) -> bool:
        """Whether ``param_groups`` were edited in place since the index was built (a
        parameter moved, removed or added by hand, groups reordered); then the index is
        dropped, to be rebuilt. The engine asks at each backward and ``step()``."""
        seen, groups = self._lo_groups_seen, self.param_groups
        if self._lo_group_index is None:
            return False
        same = len(seen) == len(groups)
        for ids, g in zip(seen, groups) if same else ():  # (loops: once per backward)
            if ids != tuple(map(id, g["params"])):
                same = False
                break
        if not same:
            self._lo_group_index = None
        return not same

    def owns(self, param: Tensor) -> bool:
        """Whether ``param`` is in one of this optimizer's param groups."""
        entry = self._group_index().get(id(param))
        return entry is not None and entry[1] is param

    def _step_params(self, params: list[Tensor]) -> None:
        """Update exactly ``params`` (each must hold a ``.grad``) with torch's step.

        One call of the torch class's own ``step`` (``layeropt/engine/subset.py``:
        narrowed param groups for torch's classes, whole groups with the other
        gradients hidden for any other), in the current training step's
        transaction; everything else (hyperparameters, lazily created state,
        foreach/fused dispatch) is torch's.
        """
        engine = self._lo_engine
        engine.stepper.apply(self, params, engine.txn)  # (its state where the stepper keeps it)

    # ------------------------------------------------------------------
    # Public surface on top of torch's.
    # ------------------------------------------------------------------
    @property
    def attached(self) -> bool:
        """Whether backward hooks currently step (some of) these parameters."""
        return bool(self._lo_engine.attachments)

    @property
    def stepped_in_backward(self) -> int:
        """Parameter updates made by hooks in the most recent attached backward."""
        return self._lo_engine.last.steps

    @property
    def stepped_params(self) -> list[Tensor]:
        """The parameters updated during the latest attached backward.

        After a backward that raised part-way (an error in a custom autograd
        Function, a ``KeyboardInterrupt``), these were fully stepped - their
        optimizer state too - and every other parameter was not touched.
        """
        return list(self._lo_engine.last.stepped)

    @contextlib.contextmanager
    def no_step(self) -> Iterator[None]:
        """Accumulate gradients in attached backwards instead of stepping.

        Like DDP's ``no_sync()``: inside the context, gradients are summed in
        ``.grad`` as plain PyTorch would; the first attached backward outside it
        steps every parameter with its accumulated gradient and frees it.

        Example:
            >>> model = torch.nn.Linear(4, 2)
            >>> opt = Adam(model.parameters())
            >>> handle = layeropt.attach(model, opt)  # doctest: +SKIP
            >>> for i, batch in enumerate(micro_batches):  # doctest: +SKIP
            ...     ctx = opt.no_step() if i < len(micro_batches) - 1 else nullcontext()
            ...     with ctx:
            ...         (model(batch).sum() / len(micro_batches)).backward()
        """
        with self._lo_engine.no_step():
            yield

    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Torch's ``step``; once attached, only for gradients the hooks left.

        Before ``attach`` this is exactly the torch class's ``step``. After it,
        the hooks have already updated every parameter whose gradient landed in
        backward and freed its ``.grad``; ``step()`` then updates the parameters
        that still hold a gradient (assigned by hand, or accumulated under
        ``no_step()``) and frees those gradients, as ``step(); zero_grad()``
        would. With no such gradient it does nothing, so existing loops keep
        working unchanged.
        """
        if not self.attached:
            engine = self._lo_engine
            return engine.stepper.detached_step_call(
                engine, lambda: type(self)._torch_step(self, closure), closure)
        set_eval_frame = _dynamo_switches()[0]  # (this frame is skipped by dynamo: below)
        prior = set_eval_frame(None)
        set_eval_frame(prior)
        if prior is not None:  # called inside a torch.compile'd function
            raise LayeroptError(COMPILED_STEP_ERROR.format(name=type(self).__name__))
        engine = self._lo_engine
        return engine.stepper.step_call(engine, closure)  # (a closure's backward is held)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Torch's ``zero_grad``; also forgets gradients held by ``no_step()``."""
        engine = self._lo_engine
        engine.stepper.zero_grad(engine, set_to_none, super().zero_grad)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Torch's ``add_param_group``; attached models hook the new parameters."""
        super().add_param_group(param_group)
        self._lo_group_index = None
        if self.__dict__.get("_lo_engine") is not None and self.attached:
            try:
                check_groups(self)
            except AttachError:
                self.param_groups.pop()  # (refused: the optimizer as it was)
                self._lo_group_index = None
                raise
        if hasattr(self, "_lo_engine"):
            self._lo_engine.on_param_groups_changed()

    def state_dict(self) -> dict[str, Any]:
        """Torch's ``state_dict``, its ``state`` in parameter order as torch's usually is
        (in-backward updates create the state in the order gradients land). Warns where
        it holds an update torch's would not yet have (docs/rules.md)."""
        self._lo_engine.saving()
        out = super().state_dict()
        state = out.get("state")
        if isinstance(state, dict) and all(type(k) is int for k in state):  # (torch's keys)
            out["state"] = dict(sorted(state.items()))
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Torch's ``load_state_dict`` (same format both ways); refused between an attached
        backward that stepped and ``step()`` (it would drop that backward's update)."""
        engine = self._lo_engine
        if engine.attachments and engine.stepped_since_boundary:
            raise BackwardStateError(LOAD_BETWEEN_ERROR.format(name=type(self).__name__))
        with self._lo_engine.stepper.loading(self):  # (offloaded state: loads to the host)
            super().load_state_dict(state_dict)
        self._lo_group_index = None

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        if "_lo_engine" not in self.__dict__:
            self._lo_engine = Engine(self)
            self._lo_stepper = self._new_stepper()
            self._lo_group_index = None
        self.__dict__.setdefault("last_grad_norm", None)
        ENGINES.add(self._lo_engine)

    def __reduce_ex__(self, protocol: Any) -> Any:
        """Pickle by the class it wraps: ``in_backward(X)`` classes are made at run time."""
        return (_new_in_backward, (type(self)._lo_base,), self.__getstate__())

    def __getstate__(self) -> dict[str, Any]:
        state = dict(super().__getstate__())
        state.pop("_lo_engine", None)
        state.pop("_lo_stepper", None)
        state["_lo_group_index"] = None
        state["last_grad_norm"] = self.__dict__.get("last_grad_norm")  # public: keep it
        return state


_GENERATED: dict[type, type] = {}


def in_backward(optimizer_class: type[_O]) -> type[_O]:
    """Make an in-backward variant of any ``torch.optim.Optimizer`` subclass.

    The new class takes exactly the arguments of ``optimizer_class`` and, until
    ``layeropt.attach``, behaves exactly like it. The optimizer's state must be
    per parameter (true of every ``torch.optim`` optimizer except LBFGS, and of
    most third-party ones), so that updating a layer as soon as its gradient
    lands equals updating all layers together.

    Args:
        optimizer_class: a ``torch.optim.Optimizer`` subclass.

    Returns:
        A subclass of both ``optimizer_class`` and :class:`InBackwardOptimizer`.
        Calling ``in_backward`` twice on one class returns the same class;
        ``in_backward(torch.optim.Adam) is layeropt.Adam``.

    Example:
        >>> NAdam = in_backward(torch.optim.NAdam)
        >>> opt = NAdam(torch.nn.Linear(2, 2).parameters(), lr=1e-3)
        >>> isinstance(opt, torch.optim.NAdam)
        True
    """
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, Optimizer)):
        raise TypeError(
            f"in_backward() needs a torch.optim.Optimizer subclass, got {optimizer_class!r}"
        )
    if issubclass(optimizer_class, InBackwardOptimizer):
        return optimizer_class
    if optimizer_class in _GENERATED:
        return _GENERATED[optimizer_class]  # type: ignore[return-value]
    reason = _NOT_PER_PARAMETER.get(optimizer_class.__name__)
    if isinstance(inspect.getattr_static(optimizer_class, "param_groups", None), property):
        reason = (
            "it wraps other optimizers (its param_groups are computed, not its own); "
            "torchao's CPUOffloadOptimizer, for one, runs every update inside step() on "
            "CPU copies of the gradients. Make the optimizer it wraps in-backward "
            "instead, e.g. layeropt.in_backward(torchao.optim.AdamW8bit)"
        )
    if reason is None:
        reason = _step_signature_problem(optimizer_class)
    if reason is not None:
        raise TypeError(
            f"{optimizer_class.__name__} cannot step in backward: {reason}. "
            "Use it as a plain torch.optim optimizer instead."
        )
    cls = type(
        optimizer_class.__name__,
        (InBackwardOptimizer, optimizer_class),
        {
            # str(cls) is X's: tools that special-case X by name keep doing so
            # (transformers' Trainer gives bitsandbytes' embeddings 32-bit state)
            "__module__": optimizer_class.__module__,
            "__qualname__": optimizer_class.__qualname__,
            "__doc__": (
                f"In-backward {optimizer_class.__module__}.{optimizer_class.__qualname__}: "
                "same arguments and math; call ``layeropt.attach(model)`` to update "
                "each layer as soon as its gradient is complete.\n\n"
                + (optimizer_class.__doc__ or "")
            ),
            "_lo_base": optimizer_class,
            "_torch_step": staticmethod(_raw_step(optimizer_class)),
        },
    )
    init = cls.__init__

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)

    __init__.__signature__ = inspect.signature(optimizer_class.__init__)  # type: ignore[attr-defined]
    __init__.__doc__ = optimizer_class.__init__.__doc__
    cls.__init__ = __init__  # type: ignore[misc]
    _GENERATED[optimizer_class] = cls
    return cls  # type: ignore[return-value]


def _step_signature_problem(optimizer_class: type) -> str | None:
    """Why ``step`` cannot be called as torch's ``step(closure=None)``, if it cannot."""
    step = _raw_step(optimizer_class)
    try:
        params = list(inspect.signature(step).parameters.values())[1:]  # after self
    except (TypeError, ValueError):  # a builtin without a signature: trust it
        return None
    required = [p.name for p in params if p.default is inspect.Parameter.empty
                and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    if not required:
        return None
    return (
        f"its step() requires {', '.join(map(repr, required))}, but torch's optimizers "
        "take step(closure=None) and update every parameter that holds a .grad; "
        "layeropt calls step() that way, once per layer bucket, with only that "
        "bucket's gradients set. Give step() torch's signature (loop over "
        "self.param_groups and skip parameters whose .grad is None)"
    )


def in_backward_spelling(optimizer_class: type) -> str:
    """How a user writes the in-backward version of ``optimizer_class``.

    ``layeropt.SGD`` for the torch classes layeropt names, else
    ``layeropt.in_backward(module.Class)`` (what error messages suggest).
    """
    name = f"{optimizer_class.__module__}.{optimizer_class.__qualname__}"
    builtin = getattr(sys.modules[__name__], optimizer_class.__name__, None)
    if getattr(builtin, "_lo_base", None) is optimizer_class:
        return f"layeropt.{optimizer_class.__name__}"
    return f"layeropt.in_backward({name})"


def is_in_backward(optimizer: object) -> bool:
    """Whether ``optimizer`` is a layeropt (in-backward) optimizer."""
    return isinstance(optimizer, InBackwardOptimizer)


# step() and zero_grad() run eagerly inside compiled code (dynamo breaks the graph at
# them; step() refuses it there)
for _eager in (InBackwardOptimizer.step, InBackwardOptimizer.zero_grad):
    _eager._torchdynamo_disable = True  # type: ignore[attr-defined]
    _dynamo_switches()[1](_eager.__code__)

SGD = in_backward(torch.optim.SGD)
Adam = in_backward(torch.optim.Adam)
AdamW = in_backward(torch.optim.AdamW)
Adagrad = in_backward(torch.optim.Adagrad)
RMSprop = in_backward(torch.optim.RMSprop)
if hasattr(torch.optim, "Adafactor"):  # torch >= 2.5
    Adafactor = in_backward(torch.optim.Adafactor)
    __all__.append("Adafactor")
if hasattr(torch.optim, "Muon"):  # torch >= 2.9
    Muon = in_backward(torch.optim.Muon)
    __all__.append("Muon")


def _new_in_backward(base: type) -> Any:
    """An empty instance of ``in_backward(base)`` (unpickling fills in its state)."""
    cls = in_backward(base)
    return cls.__new__(cls)


def _call_torch_step(optimizer: InBackwardOptimizer) -> None:
    """The torch class's own ``step``, without torch's profiling/hook wrapper."""
    type(optimizer)._torch_step(optimizer)


@contextlib.contextmanager
def no_step_all(optimizers: Iterable[InBackwardOptimizer]) -> Iterator[None]:
    """``no_step()`` of several optimizers at once (for trainer integrations)."""
    with contextlib.ExitStack() as stack:
        for o in optimizers:
            stack.enter_context(o.no_step())
        yield


def unwrap_optimizer(optimizer: Any) -> Any:
    """The optimizer inside wrappers that hold it as ``.optimizer``.

    accelerate's ``AcceleratedOptimizer`` and Lightning's ``LightningOptimizer``
    forward ``step``/``zero_grad``/``param_groups`` to the optimizer they wrap;
    layeropt attaches that one.

    Args:
        optimizer: an optimizer, possibly wrapped (several times).

    Returns:
        The innermost optimizer (``optimizer`` itself if it is not wrapped).

    Example:
        >>> opt = Adam(torch.nn.Linear(2, 2).parameters())
        >>> unwrap_optimizer(opt) is opt
        True
    """
    while not isinstance(optimizer, InBackwardOptimizer) and isinstance(
        getattr(optimizer, "optimizer", None), Optimizer
    ):
        cls = type(optimizer)
        if (isinstance(optimizer, Optimizer) and cls.step is not Optimizer.step
                and not cls.__module__.startswith(_FORWARDING)
                and isinstance(unwrap_optimizer(optimizer.optimizer), InBackwardOptimizer)):
            raise AttachError(WRAPPED_STEP_ERROR.format(name=cls.__qualname__))
        optimizer = optimizer.optimizer
    return optimizer


# Wrappers whose step() only forwards to the optimizer they hold (and the GradScaler)
_FORWARDING = ("accelerate.", "lightning.", "pytorch_lightning.", "lightning_fabric.",
               "transformers.", "layeropt.")


def optimizer_list(optimizer: Any) -> list[Any]:
    """``None`` -> ``[]``, one optimizer -> ``[it]``, an iterable -> a list; unwrapped."""
    if optimizer is None:
        return []
    if isinstance(optimizer, Optimizer) or hasattr(optimizer, "optimizer"):
        return [unwrap_optimizer(optimizer)]
    return [unwrap_optimizer(o) for o in optimizer]


def live_optimizers() -> list[InBackwardOptimizer]:
    """Every layeropt optimizer still alive, in the order they were made (used by
    ``attach(model)``)."""
    return [o for o in (e._optimizer() for e in list(ENGINES)) if o is not None]


def owners_of(params: list[Tensor]) -> list[InBackwardOptimizer]:
    """The live layeropt optimizers owning any of ``params`` (``attach(model)``, the
    Hugging Face callback). Where there are several, garbage is collected first: one
    that only a reference cycle keeps alive (bitsandbytes' ``load_state_dict`` leaves
    one) was deleted by its user, and is no owner."""
    def find() -> list[InBackwardOptimizer]:
        return [o for o in live_optimizers() if any(o.owns(p) for p in params)]
    owners = find()
    if len(owners) > 1:
        owners.clear()  # (no reference of ours keeps one alive)
        gc.collect()
        owners = find()
    return owners
