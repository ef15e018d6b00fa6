"""Activation checkpointing that stays exact with in-backward updates.

``layeropt.checkpoint`` takes the arguments of ``torch.utils.checkpoint.checkpoint``
and guarantees that every parameter is stepped once per backward with its full
gradient and that no recomputation sees an updated weight. It is torch's
non-reentrant checkpoint, plus one thing: the parameters the segment reads in
forward are *pinned* (``layeropt/engine/nesting.py``, ``Pin``) until backward has
recomputed it, so one whose gradient completes early - it reaches the segment
only through a mask, an ``argmax``, a ``detach()`` - waits. ``use_reentrant=True``
is accepted (torch's signature) and runs the same: bit-exact, and leaner than a
nested backward per segment would be.

``checkpoint_modules`` turns it on for chosen submodules in one line.
What happens when the gradients land is in ``layeropt/engine/landing.py`` (rule 5).
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
import weakref
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils.checkpoint as tc
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from .engine.nesting import Pin

__all__ = ["checkpoint", "checkpoint_modules", "CheckpointHandle"]

class _Reads(TorchFunctionMode):
    """Records the leaf tensors requiring grad (the parameters) a segment's torch calls read.

    Tensors the segment created itself are skipped (``created``: e.g. a
    ``torch.zeros(...)`` it marks ``requires_grad``, as Hugging Face's T5 does
    under checkpointing - not a parameter, its gradient is thrown away, as in
    torch's checkpoint).
    """

    def __init__(self) -> None:
        super().__init__()
        self.found: dict[int, Tensor] = {}
        self.created: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        for x in tree_leaves((args, kwargs)):
            if (isinstance(x, Tensor) and x.requires_grad and x.is_leaf
                    and id(x) not in self.created):
                self.found.setdefault(id(x), x)
        result = func(*args, **kwargs)
        for x in tree_leaves(result):
            if isinstance(x, Tensor):
                self.created.add(id(x))
        return result


_TORCH_TAKES_EARLY_STOP = "early_stop" in inspect.signature(tc.checkpoint).parameters


@torch.compiler.disable  # (run as it is inside compiled code: its pins are not traced)
def _non_reentrant(
    fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], **options: Any
) -> Any:
    pin: list[Pin] = []

    def run(*a: Any, **k: Any) -> Any:
        if pin:  # backward recomputing the segment: unpin once it is done
            try:
                return fn(*a, **k)
            finally:
                pin[0].release()
        reads = _Reads()
        with reads:
            out = fn(*a, **k)
        pin.append(Pin(list(reads.found.values())))
        return out

    if _TORCH_TAKES_EARLY_STOP:
        return tc.checkpoint(run, *args, use_reentrant=False, **options, **kwargs)
    # torch 2.4-2.5: early stop is only a global setting, read when the segment runs forward
    early_stop = options.pop("early_stop")
    with contextlib.nullcontext() if early_stop else tc.set_checkpoint_early_stop(False):
        return tc.checkpoint(run, *args, use_reentrant=False, **options, **kwargs)


def checkpoint(
    function: Callable[..., Any],
    *args: Any,
    use_reentrant: bool = False,
    context_fn: Callable[[], tuple[Any, Any]] = tc.noop_context_fn,
    determinism_check: str = tc._DEFAULT_DETERMINISM_MODE,
    debug: bool = False,
    early_stop: bool = True,
    preserve_rng_state: bool = True,
    **kwargs: Any,
) -> Any:
    """``torch.utils.checkpoint.checkpoint`` that is exact with attached layeropt optimizers.

    Runs ``function(*args, **kwargs)`` without keeping its activations and
    recomputes them in backward (torch's non-reentrant checkpoint). With
    layeropt optimizers attached, every parameter is still stepped exactly
    once per backward, with its full gradient, after every recomputation that
    reads it (module docstring). Without them it is plain activation
    checkpointing.

    Args:
        function: the segment to checkpoint (a module, or any callable).
        *args: its positional arguments.
        use_reentrant: accepted for torch's signature; either value runs the
            non-reentrant checkpoint (same gradient, bit for bit).
        context_fn: returns two context managers, for the forward and the
            recomputation (e.g. ``create_selective_checkpoint_contexts``).
        determinism_check: as torch's.
        debug: as torch's.
        early_stop: as torch's.
        preserve_rng_state: replay the forward's RNG state when recomputing,
            so dropout masks match.
        **kwargs: keyword arguments of ``function``.

    Returns:
        What ``function`` returns.

    Example:
        >>> import torch, layeropt
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = layeropt.checkpoint(block, x)
        >>> y.sum().backward()
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    return _non_reentrant(
        function,
        args,
        kwargs,
        context_fn=context_fn,
        determinism_check=determinism_check,
        debug=debug,
        early_stop=early_stop,
        preserve_rng_state=preserve_rng_state,
    )


class CheckpointHandle:
    """Returned by :func:`checkpoint_modules`; ``remove()`` restores the modules.

    Also a context manager (removed on exit).

    Attributes:
        modules: the qualified names of the wrapped modules, in order.
    """

    def __init__(self, wrapped: list[tuple[str, nn.Module, Any]]) -> None:
        self._wrapped = wrapped
        self.modules = [name for name, _, _ in wrapped]

    def remove(self) -> None:
        """Unwrap every module (idempotent)."""
        for _, module, previous in self._wrapped:
            if previous is None:
                module.__dict__.pop("forward", None)
            else:
                module.forward = previous
        self._wrapped = []

    def __enter__(self) -> CheckpointHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        return f"<layeropt.CheckpointHandle {len(self._wrapped)} modules>"


def _select(
    model: nn.Module,
    types: type | tuple[type, ...] | None,
    names: str | Iterable[str] | None,
) -> list[tuple[str, nn.Module]]:
    patterns = [names] if isinstance(names, str) else list(names or [])
    chosen: list[tuple[str, nn.Module]] = []
    for name, module in model.named_modules():
        if any(name == c or name.startswith(c + ".") for c, _ in chosen if c):
            continue  # inside a module already chosen: checkpoint the outermost only
        by_type = types is not None and isinstance(module, types)
        by_name = any(fnmatch.fnmatchcase(name, p) for p in patterns)
        if by_type or by_name:
            chosen.append((name, module))
    return chosen


def checkpoint_modules(
    model: nn.Module,
    *,
    types: type | tuple[type, ...] | None = None,
    names: str | Iterable[str] | None = None,
    every: int = 1,
    use_reentrant: bool = False,
    **checkpoint_kwargs: Any,
) -> CheckpointHandle:
    """Checkpoint chosen submodules of ``model`` in place, in one line.

    Each chosen module's ``forward`` is replaced (on the instance, so
    ``state_dict`` keys and hooks are unchanged) by one that runs the original
    under :func:`checkpoint`. Only the outermost of nested matches is wrapped.

    Args:
        model: the model to modify.
        types: wrap submodules that are instances of these classes.
        names: ``fnmatch`` patterns on qualified names (``"blocks.*"``).
            With neither ``types`` nor ``names``, ``model`` must be an
            ``nn.Sequential`` or ``nn.ModuleList``: its children are chosen.
        every: keep every ``every``-th chosen module (0, k, 2k, ...).
        use_reentrant: accepted, as by :func:`checkpoint`.
        **checkpoint_kwargs: other :func:`checkpoint` options (``context_fn``,
            ``preserve_rng_state``, ``determinism_check``, ...).

    Returns:
        A :class:`CheckpointHandle`; ``.remove()`` (or leaving its ``with``
        block) puts the original ``forward`` methods back.

    Raises:
        ValueError: nothing matched, no selector for a non-container model, a
            bad ``every``, or a module that is already wrapped.

    Example:
        >>> import layeropt
        >>> from layeropt.models import TinyGPT
        >>> model = TinyGPT()
        >>> handle = layeropt.checkpoint_modules(model, names="blocks.*")
        >>> handle.modules
        ['blocks.0', 'blocks.1']
        >>> handle.remove()
    """
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    if types is None and names is None:
        if not isinstance(model, (nn.Sequential, nn.ModuleList)):
            raise ValueError(
                f"say which submodules of {type(model).__name__} to checkpoint: pass "
                "types=(Block,) or names='blocks.*', or pass an nn.Sequential / "
                "nn.ModuleList to checkpoint its children."
            )
        chosen = list(model.named_children())
    else:
        chosen = _select(model, types, names)
    chosen = chosen[::every]
    if not chosen:
        raise ValueError(f"no submodule matched types={types!r}, names={names!r}")
    wrapped = []
    for name, module in chosen:
        if getattr(module.forward, "_layeropt_checkpointed", False):
            raise ValueError(
                f"module {name!r} is already checkpointed; remove() the handle that wrapped "
                "it first (a copy or an unpickled model is checkpointed as its original: to "
                "undo it there, copy the handle along: copy.deepcopy((model, handle)))")
        previous = module.__dict__.get("forward")
        wrapped.append((name, module, previous))
        module.forward = _Checkpointed(module, previous, use_reentrant, checkpoint_kwargs)
    return CheckpointHandle(wrapped)


class _Checkpointed:
    """A checkpointed module's ``forward``: ``previous`` (the instance's own forward, or
    None: its class's) run under :func:`checkpoint`.

    It refers to the module weakly: the module keeps it in its ``__dict__``, and a
    cycle would free the model only at a garbage collection (torch.optim's models go
    at ``del``). A class, not a closure, so that it follows its module: a closure is
    copied by reference - a ``copy.deepcopy`` of the model (an EMA, a teacher) ran the
    original's layers - and cannot be pickled. ``__reduce__`` gives the module to
    rebuild it with, so ``copy.deepcopy`` (through its memo) and ``pickle`` /
    ``torch.save`` rebind it to the copy's module: a copy is checkpointed the same
    way, on its own weights. To undo it on a copy, copy the handle along:
    ``copy.deepcopy((model, handle))``.
    """

    _layeropt_checkpointed = True

    def __init__(self, module: nn.Module, previous: Any, use_reentrant: bool,
                 options: dict[str, Any]) -> None:
        self.module_ref = weakref.ref(module)
        self.previous = previous
        self.use_reentrant = use_reentrant
        self.options = options

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        own = self.module_ref()
        if own is None:
            raise ReferenceError("this checkpointed forward's module was freed: call the "
                                 "module itself, not a forward kept (or copied) apart from it")
        forward = self.previous if self.previous is not None else type(own).forward.__get__(own)
        return checkpoint(forward, *args, use_reentrant=self.use_reentrant, **self.options,
                          **kwargs)

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return type(self), (self.module_ref(), self.previous, self.use_reentrant, self.options)
