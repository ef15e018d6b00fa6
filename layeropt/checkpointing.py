"""Activation checkpointing that stays exact with in-backward updates.

``layeropt.checkpoint`` takes the arguments of ``torch.utils.checkpoint.checkpoint``
and guarantees, in both modes, that every parameter is stepped once per backward
with its full gradient and that no recomputation sees an updated weight:

* ``use_reentrant=False`` (default) is torch's non-reentrant checkpoint. The
  parameters the segment reads in forward are *pinned* (``landing.Pin``) until
  backward has recomputed it, so one whose gradient completes early - it reaches
  the segment only through a mask, an ``argmax``, a ``detach()`` - waits.
* ``use_reentrant=True`` recomputes the segment in a nested backward, like
  torch's, but the parameters (and captured tensors) it reads in forward become
  inputs of its autograd node, and the nested pass uses ``torch.autograd.grad``
  (which accumulates nothing): the gradients flow back through the outer graph,
  so autograd fires each hook once, after every segment that reads the
  parameter has been recomputed. ``context_fn`` works here too.

``checkpoint_modules`` turns either mode on for chosen submodules in one line.
What happens when the gradients land is in ``layeropt/landing.py`` (rule 5).
"""

from __future__ import annotations

import contextlib
import fnmatch
import inspect
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.utils.checkpoint as tc
from torch import Tensor, nn
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_leaves, tree_unflatten

from .errors import BackwardStateError
from ._nesting import Pin

__all__ = ["checkpoint", "checkpoint_modules", "CheckpointHandle"]

_SWAPS: list[dict[int, Tensor]] = []  # captured tensors replaced in recomputations running now


def _resolve(t: Tensor) -> Tensor:
    for swap in reversed(_SWAPS):
        t = swap.get(id(t), t)
    return t


class _Reads(TorchFunctionMode):
    """Sees the tensors every torch function reads; records or replaces some of them.

    Records those that require grad (only leaves with ``leaves_only``), except
    ``skip`` ids and tensors the function created itself (``created``: e.g. a
    ``torch.zeros(...)`` it marks ``requires_grad``, as Hugging Face's T5 does
    under checkpointing - not a parameter, its gradient is thrown away, as in
    torch's checkpoint); replaces those in ``swap`` (by id) with their stand-ins.
    """

    def __init__(
        self,
        skip: Iterable[int] = (),
        leaves_only: bool = False,
        swap: dict[int, Tensor] | None = None,
    ) -> None:
        super().__init__()
        self.skip = set(skip)
        self.leaves_only = leaves_only
        self.swap = swap
        self.found: dict[int, Tensor] = {}
        self.created: set[int] = set()

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.swap is not None:
            flat, spec = tree_flatten((args, kwargs))
            flat = [self.swap.get(id(x), x) if isinstance(x, Tensor) else x for x in flat]
            args, kwargs = tree_unflatten(flat, spec)
        else:
            for x in tree_leaves((args, kwargs)):
                if (
                    isinstance(x, Tensor)
                    and x.requires_grad
                    and (x.is_leaf or not self.leaves_only)
                    and id(x) not in self.skip
                    and id(x) not in self.created
                ):
                    self.found.setdefault(id(x), x)
        result = func(*args, **kwargs)
        for x in tree_leaves(result):
            if isinstance(x, Tensor):
                self.created.add(id(x))
        return result

    def __enter__(self) -> _Reads:
        if self.swap is not None:
            _SWAPS.append(self.swap)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        super().__exit__(*exc)
        if self.swap is not None:
            _SWAPS.remove(self.swap)


class _Segment:
    """What the reentrant backward needs to recompute one segment.

    Its node's inputs are ``args`` (the tensor arguments), ``leaves`` (leaf
    tensors the function reads, i.e. parameters) and ``captured`` (non-leaf
    tensors it reads without taking them as arguments). When recomputing,
    every read of an argument or captured tensor is swapped (by the id of the
    object the function sees) for a detached stand-in, so the nested pass
    stops there and returns their gradients through the outer graph.
    """

    def __init__(self, fn: Callable[..., Any], flat: list[Any], spec: Any) -> None:
        self.fn, self.flat, self.spec = fn, flat, spec
        self.tensor_at = [i for i, x in enumerate(flat) if isinstance(x, Tensor)]
        tensors = [flat[i] for i in self.tensor_at]
        self.device_type = tc._infer_device_type(*tensors)
        self.autocast = tc._get_autocast_kwargs(self.device_type)
        self.outputs: tuple[Tensor, ...] | None = None
        self.arg_ids = [id(t) for t in tensors]
        self.captured_ids: list[int] = []
        self.n_leaves = 0
        self.leaves: list[Tensor] = []  # the leaf tensors (parameters) the function reads
        self.rng: tuple[Tensor, list[int], list[Tensor]] | None = None
        self.recompute_ctx: Any = contextlib.nullcontext()

    def save_rng(self) -> None:
        devices: list[int] = []
        states: list[Tensor] = []
        if getattr(tc._get_device_module(self.device_type), "_initialized", False):
            devices, states = tc.get_device_states(*[self.flat[i] for i in self.tensor_at])
        self.rng = (torch.get_rng_state(), devices, states)

    def backward(self, saved: tuple[Tensor, ...], grads: tuple[Tensor | None, ...]) -> tuple:
        n = len(self.tensor_at)
        args = [t.detach().requires_grad_(t.requires_grad) for t in saved[:n]]
        # the leaves themselves: under an outer non-reentrant checkpoint, the saved ones
        # unpack as recomputed aliases, while the recomputation reads the leaves
        leaves = self.leaves
        stand_ins = [t.detach().requires_grad_() for t in saved[n + self.n_leaves :]]
        swap = {i: t for i, t in zip(self.arg_ids, args) if t.requires_grad}
        swap.update(zip(self.captured_ids, stand_ins))
        flat = list(self.flat)
        for i, t in zip(self.tensor_at, args):
            flat[i] = t
        fn_args, fn_kwargs = tree_unflatten(flat, self.spec)
        devices = self.rng[1] if self.rng else []
        with contextlib.ExitStack() as stack:
            stack.enter_context(
                torch.random.fork_rng(
                    devices=devices, enabled=self.rng is not None, device_type=self.device_type
                )
            )
            if self.rng is not None:
                torch.set_rng_state(self.rng[0])
                if devices:
                    tc.set_device_states(devices, self.rng[2], device_type=self.device_type)
            device_kwargs, cpu_kwargs = self.autocast
            if device_kwargs is not None:
                stack.enter_context(torch.amp.autocast(self.device_type, **device_kwargs))
            stack.enter_context(torch.amp.autocast("cpu", **cpu_kwargs))
            stack.enter_context(torch.enable_grad())
            stack.enter_context(self.recompute_ctx)
            reads = stack.enter_context(_Reads(swap=swap))
            out = self.fn(*fn_args, **fn_kwargs)
        outputs = [x for x in tree_leaves(out) if isinstance(x, Tensor)]
        pairs = [(o, g) for o, g in zip(outputs, grads) if g is not None and o.requires_grad]
        targets = [t for t in args if t.requires_grad] + leaves + stand_ins
        if not pairs or not targets:
            return (None,) * len(saved)
        _check_leaves([o for o, _ in pairs], targets, reads.created)
        found = iter(
            torch.autograd.grad(
                [o for o, _ in pairs], targets, [g for _, g in pairs], allow_unused=True
            )
        )
        return tuple(next(found) if t.requires_grad else None for t in args) + tuple(
            next(found) for _ in leaves + stand_ins
        )


def _check_leaves(outputs: list[Tensor], targets: list[Tensor], created: set[int]) -> None:
    """Fail loudly if the recomputation reached a leaf the forward did not see.

    Leaves the recomputation created itself are not parameters: skipped.
    """
    known = {id(t) for t in targets} | created
    stack = [o.grad_fn for o in outputs if o.grad_fn is not None]
    seen: set[Any] = set()
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if variable is not None and id(variable) not in known:
            raise BackwardStateError(
                f"layeropt.checkpoint(use_reentrant=True): the recomputation uses a tensor "
                f"of shape {tuple(variable.shape)} requiring grad that the forward did not "
                "see (read through an operation that bypasses __torch_function__), so its "
                "gradient would be lost. Pass it to the function as an argument, or use "
                "use_reentrant=False."
            )
        stack.extend(fn for fn, _ in node.next_functions)


class _ReentrantFunction(torch.autograd.Function):
    """One reentrant segment; its inputs are the arguments, parameters and captured tensors."""

    @staticmethod
    def forward(ctx: Any, segment: _Segment, *inputs: Tensor) -> tuple[Tensor, ...]:  # type: ignore[override]
        ctx.segment = segment
        ctx.save_for_backward(*inputs)
        outputs, segment.outputs = segment.outputs, None
        return outputs  # computed by _reentrant under no_grad, returned as this node's

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        return (None,) + ctx.segment.backward(ctx.saved_tensors, grads)


def _reentrant(
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    preserve_rng_state: bool,
    context_fn: Callable[[], tuple[Any, Any]],
) -> Any:
    flat, spec = tree_flatten((args, kwargs))
    segment = _Segment(fn, flat, spec)
    if preserve_rng_state:
        segment.save_rng()
    forward_ctx, segment.recompute_ctx = context_fn()
    arg_tensors = [flat[i] for i in segment.tensor_at]
    for i in segment.tensor_at:
        segment.flat[i] = None  # kept as saved tensors of the node instead
    reads = _Reads(skip=segment.arg_ids)
    with torch.no_grad(), forward_ctx, reads:
        out = fn(*args, **kwargs)
    found = list(reads.found.values())
    captured = [t for t in found if not t.is_leaf or _resolve(t) is not t]
    leaves = [t for t in found if t.is_leaf and _resolve(t) is t]
    segment.n_leaves = len(leaves)
    segment.leaves = leaves
    segment.captured_ids = [id(t) for t in captured]
    # Inside another segment's recomputation, the objects it swaps are read as
    # their stand-ins: those are this node's inputs (the ids above stay the
    # objects this function reads).
    inputs = [_resolve(t) for t in arg_tensors + leaves + captured]
    out_flat, out_spec = tree_flatten(out)
    at = [i for i, x in enumerate(out_flat) if isinstance(x, Tensor)]
    segment.outputs = tuple(out_flat[i] for i in at)
    if not at:
        return out
    results = _ReentrantFunction.apply(segment, *inputs)
    for i, t in zip(at, results):
        out_flat[i] = t
    return tree_unflatten(out_flat, out_spec)


_TORCH_TAKES_EARLY_STOP = "early_stop" in inspect.signature(tc.checkpoint).parameters


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
        reads = _Reads(leaves_only=True)
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
    recomputes them in backward. With layeropt optimizers attached, every
    parameter is still stepped exactly once per backward, with its full
    gradient, after every recomputation that reads it (module docstring).
    Without them it is plain activation checkpointing.

    Args:
        function: the segment to checkpoint (a module, or any callable).
        *args: its positional arguments (tensors anywhere in nested lists,
            tuples and dicts are tracked).
        use_reentrant: ``False`` (default): torch's non-reentrant checkpoint,
            plus pins on the parameters the segment reads. ``True``: a nested
            backward per segment whose parameters are inputs of its node;
            keyword arguments and ``context_fn`` work here too.
        context_fn: returns two context managers, for the forward and the
            recomputation (e.g. ``create_selective_checkpoint_contexts``).
        determinism_check: as torch's (non-reentrant mode only; ignored, as by
            torch, when reentrant).
        debug: as torch's (non-reentrant mode only).
        early_stop: as torch's (non-reentrant mode only).
        preserve_rng_state: replay the forward's RNG state when recomputing,
            so dropout masks match.
        **kwargs: keyword arguments of ``function``.

    Returns:
        What ``function`` returns.

    Raises:
        ValueError: ``debug=True`` with ``use_reentrant=True``.

    Example:
        >>> import torch, layeropt
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = layeropt.checkpoint(block, x)
        >>> y.sum().backward()
    """
    if not torch.is_grad_enabled():
        return function(*args, **kwargs)
    if use_reentrant:
        if debug:
            raise ValueError("debug=True needs use_reentrant=False (as in torch).")
        return _reentrant(function, args, kwargs, preserve_rng_state, context_fn)
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
        use_reentrant: the :func:`checkpoint` mode.
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
            raise ValueError(f"module {name!r} is already checkpointed; remove() the first handle.")
        previous = module.__dict__.get("forward")
        wrapped.append((name, module, previous))
        module.forward = _checkpointed(module.forward, use_reentrant, checkpoint_kwargs)
    return CheckpointHandle(wrapped)


def _checkpointed(forward: Callable[..., Any], use_reentrant: bool, options: dict[str, Any]) -> Any:
    def checkpointed_forward(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=use_reentrant, **options, **kwargs)

    checkpointed_forward._layeropt_checkpointed = True  # type: ignore[attr-defined]
    return checkpointed_forward
