"""Memory-lean losses: recompute a loss in backward, chunk the LM-head loss.

Three tools, each for a different way a loss wastes memory:

- :func:`recompute` / :class:`Recompute`: store none of a loss's intermediates
  between its forward and its backward; rebuild them in backward
  (non-reentrant ``torch.utils.checkpoint``, RNG replayed). Helps when several
  loss terms (or more forward work) are alive before ``backward()``.
- :func:`linear_cross_entropy` / :class:`ChunkedLMHead`: the LM head's
  ``(tokens, vocab)`` logits exist one chunk of rows at a time, in forward and
  in backward.
- :func:`sum_product`: ``torch.sum(x * y)`` without the broadcast product.

``python benchmarks/bench_losses.py [--tiny]`` prints the measured-bytes
table of ``docs/losses.md``.

Example:
    >>> import torch
    >>> h, w = torch.randn(6, 4, requires_grad=True), torch.randn(10, 4)
    >>> loss = linear_cross_entropy(h, w, torch.randint(0, 10, (6,)), chunk_size=2)
    >>> loss.backward()
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

__all__ = [
    "recompute",
    "Recompute",
    "sum_product",
    "linear_cross_entropy",
    "ChunkedLMHead",
    "default_chunk_size",
    "has_native_linear_cross_entropy",
    "IMPLS",
]

_F = TypeVar("_F", bound=Callable[..., Any])

#: The implementations ``linear_cross_entropy(impl=...)`` accepts.
IMPLS = ("auto", "torch", "chunked")
_REDUCTIONS = ("mean", "sum", "none")


def recompute(loss_fn: _F) -> _F:
    """Wrap a loss so its intermediates are recomputed in backward, not stored.

    Args:
        loss_fn: any function (or loss module) of tensors. Randomness inside it
            (dropout) is replayed exactly in backward.

    Returns:
        A function with the same signature and the same values and gradients.
        Under ``torch.no_grad()`` it calls ``loss_fn`` directly.

    Example:
        >>> lean = recompute(lambda a, b: torch.tanh(a @ b.T).sum())
        >>> lean(torch.randn(3, 2, requires_grad=True), torch.randn(4, 2)).backward()
    """
    if not callable(loss_fn):
        raise TypeError(f"recompute() needs a callable loss, got {type(loss_fn).__name__}")

    def lean(*args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return loss_fn(*args, **kwargs)
        return checkpoint(loss_fn, *args, use_reentrant=False, preserve_rng_state=True, **kwargs)

    functools.update_wrapper(lean, loss_fn, updated=())  # name and doc, not a module's state
    return lean  # type: ignore[return-value]


class Recompute(nn.Module):
    """Module form of :func:`recompute`: ``Recompute(nn.MSELoss())(x, y)``.

    Args:
        loss: the loss module; registered as a submodule, so its parameters
            (a learnable temperature, say) stay visible to optimizers.

    Example:
        >>> crit = Recompute(nn.SmoothL1Loss())
        >>> crit(torch.randn(4, requires_grad=True), torch.randn(4)).backward()
    """

    def __init__(self, loss: nn.Module) -> None:
        super().__init__()
        self.loss = loss

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return recompute(self.loss)(*args, **kwargs)


def sum_product(x: Tensor, y: Tensor) -> Tensor:
    """``torch.sum(x * y)`` without materialising the (broadcast) product.

    Dimensions where only one operand is broadcast are summed out of the other
    first, then one ``torch.dot`` finishes. Equal to ``torch.sum(x * y)`` up to
    float reassociation.

    Args:
        x: a tensor.
        y: a tensor broadcastable with ``x``.

    Returns:
        A 0-dim tensor.

    Example:
        >>> a, b = torch.randn(8, 1, 3), torch.randn(1, 5, 3)
        >>> torch.allclose(sum_product(a, b), torch.sum(a * b), atol=1e-5)
        True
    """
    shape = torch.broadcast_shapes(x.shape, y.shape)
    x = x.reshape((1,) * (len(shape) - x.dim()) + tuple(x.shape))
    y = y.reshape((1,) * (len(shape) - y.dim()) + tuple(y.shape))
    only_x = tuple(i for i in range(len(shape)) if x.shape[i] != 1 and y.shape[i] == 1)
    only_y = tuple(i for i in range(len(shape)) if y.shape[i] != 1 and x.shape[i] == 1)
    if only_x:
        x = x.sum(only_x, keepdim=True)
    if only_y:
        y = y.sum(only_y, keepdim=True)
    dtype = torch.promote_types(x.dtype, y.dtype)
    return torch.dot(x.reshape(-1).to(dtype), y.reshape(-1).to(dtype))


def has_native_linear_cross_entropy() -> bool:
    """Whether this torch has ``F.linear_cross_entropy`` with a chunked path (>= 2.13)."""
    return hasattr(F, "linear_cross_entropy") and hasattr(nn, "LinearCrossEntropyOptions")


def default_chunk_size(tokens: int, in_features: int, vocab: int) -> int:
    """Rows per chunk: logits about the size of ``hidden``, but at least 256 rows.

    Each chunk adds its share into the whole ``(V, D)`` weight gradient, so a
    chunk of ``c`` rows does about ``c / 4`` flops per byte of that update;
    below a few hundred rows the loss becomes memory-bound and slow on CPU.

    Args:
        tokens: number of rows of ``hidden`` (all leading dims multiplied).
        in_features: hidden size ``D``.
        vocab: number of classes ``V``.

    Returns:
        ``max(ceil(tokens / ceil(V / D)), min(tokens, 256))``, at least 1.

    Example:
        >>> default_chunk_size(65536, 4096, 131072), default_chunk_size(100, 64, 32768)
        (2048, 100)
    """
    by_bytes = math.ceil(tokens / math.ceil(vocab / max(in_features, 1)))
    return max(1, by_bytes, min(tokens, 256))


def linear_cross_entropy(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    bias: Tensor | None = None,
    *,
    chunk_size: int | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    impl: str = "auto",
) -> Tensor:
    """``F.cross_entropy(F.linear(hidden, weight, bias), targets)`` one chunk at a time.

    The full ``(tokens, vocab)`` logits never exist: forward and backward each
    hold one ``(chunk_size, vocab)`` block (plus the gradients of the inputs).

    Args:
        hidden: ``(..., D)`` features before the output projection.
        weight: ``(V, D)`` projection, e.g. a tied ``embedding.weight``.
        targets: ``(...)`` class indices (integer), ``ignore_index`` allowed.
        bias: optional ``(V,)`` bias.
        chunk_size: rows per chunk; default :func:`default_chunk_size`.
        ignore_index: target value that adds no loss and no gradient.
        reduction: ``"mean"`` (over non-ignored rows; with none, NaN and zero
            gradients, as ``F.cross_entropy``), ``"sum"`` or ``"none"``.
        label_smoothing: as in ``F.cross_entropy``.
        impl: ``"torch"`` uses ``F.linear_cross_entropy`` (torch >= 2.13,
            ``label_smoothing == 0``); ``"chunked"`` uses layeropt's own
            (any torch, recomputes each chunk's logits in backward); ``"auto"``
            picks ``"torch"`` when it can.

    Returns:
        The loss: a scalar, or shape ``targets.shape`` for ``reduction="none"``.

    Example:
        >>> h = torch.randn(2, 5, 8, requires_grad=True)
        >>> w = torch.randn(100, 8, requires_grad=True)
        >>> linear_cross_entropy(h, w, torch.randint(0, 100, (2, 5))).backward()
    """
    _check_options(chunk_size, ignore_index, reduction, label_smoothing, impl)
    if weight.dim() != 2 or hidden.dim() < 1 or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden (..., D) and weight (V, D), got {tuple(hidden.shape)} and "
            f"{tuple(weight.shape)}; pass the projection as (vocab, hidden) like nn.Linear"
        )
    if tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise ValueError(
            f"targets shape {tuple(targets.shape)} must equal hidden.shape[:-1] = "
            f"{tuple(hidden.shape[:-1])}"
        )
    if targets.dtype.is_floating_point or targets.dtype.is_complex or targets.dtype == torch.bool:
        raise TypeError(
            f"targets must hold class indices (an integer dtype), got {targets.dtype}; "
            "for soft labels use F.cross_entropy on materialised logits"
        )
    if bias is not None and tuple(bias.shape) != (weight.shape[0],):
        raise ValueError(f"bias must have shape ({weight.shape[0]},), got {tuple(bias.shape)}")
    native_ok = has_native_linear_cross_entropy() and label_smoothing == 0.0
    if impl == "torch" and not native_ok:
        raise ValueError(
            "impl='torch' needs torch >= 2.13 (F.linear_cross_entropy) and label_smoothing=0; "
            "use impl='chunked' or impl='auto'"
        )
    h2 = hidden.reshape(-1, hidden.shape[-1])
    t1 = targets.reshape(-1).long()
    chunk = chunk_size or default_chunk_size(h2.shape[0], weight.shape[1], weight.shape[0])
    chunk = min(chunk, max(h2.shape[0], 1))
    if impl == "torch" or (impl == "auto" and native_ok):
        if reduction == "mean":
            no_targets = (t1 == ignore_index).all()
            h2, weight, bias = _ZeroGradWithoutTargets.apply(no_targets, h2, weight, bias)
        out = F.linear_cross_entropy(
            h2, weight, t1, linear_bias=bias, reduction=reduction, ignore_index=ignore_index,
            options=nn.LinearCrossEntropyOptions(batch_chunk_size=chunk),
        )  # fmt: skip
    else:
        out = _ChunkedLinearCE.apply(
            h2, weight, bias, t1, chunk, ignore_index, float(label_smoothing), reduction
        )
    return out.reshape(targets.shape) if reduction == "none" else out


def _check_options(
    chunk_size: int | None, ignore_index: int, reduction: str, label_smoothing: float, impl: str
) -> None:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if chunk_size is not None and (not isinstance(chunk_size, int) or chunk_size < 1):
        raise ValueError(f"chunk_size must be a positive int or None, got {chunk_size!r}")
    if not isinstance(ignore_index, int):
        raise TypeError(f"ignore_index must be an int, got {type(ignore_index).__name__}")


class _ZeroGradWithoutTargets(torch.autograd.Function):
    """Identity; zeroes the gradients in backward when no row has a target.

    torch's op divides by the number of counted rows when it precomputes the
    mean's gradients, so with none it returns NaN gradients where
    ``F.cross_entropy`` returns zeros (one all-prompt micro-batch would turn
    the weights NaN). The flag stays a tensor, so this needs no host sync.
    """

    @staticmethod
    def forward(ctx: Any, no_targets: Tensor, *xs: Tensor | None) -> tuple[Tensor | None, ...]:
        ctx.set_materialize_grads(False)  # no zero tensors for inputs without grad
        ctx.save_for_backward(no_targets)
        return xs

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        (no_targets,) = ctx.saved_tensors
        # In place: the op's backward hands over fresh tensors, and a copy of the
        # weight-sized gradient would raise the peak.
        return (None, *(g if g is None else g.masked_fill_(no_targets, 0) for g in grads))


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype


class _ChunkedLinearCE(torch.autograd.Function):
    """Logits by row chunks; saves only each row's log-sum-exp for backward."""

    @staticmethod
    def forward(ctx: Any, hidden, weight, bias, targets, chunk, ignore_index, eps, reduction):
        valid = targets != ignore_index
        safe = torch.where(valid, targets, torch.zeros_like(targets))
        acc = _acc_dtype(hidden.dtype)
        n = hidden.shape[0]
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        losses = torch.empty(n, dtype=acc, device=hidden.device)
        ctx.dtype = hidden.dtype  # the logits' (under autocast: its dtype, for backward)
        for s in range(0, n, chunk):
            z = F.linear(hidden[s : s + chunk], weight, bias)
            ctx.dtype, z = z.dtype, z.to(acc)
            row = -(1.0 - eps) * z.gather(1, safe[s : s + chunk, None]).squeeze(1)
            if eps:
                row -= eps * z.mean(1)
            top = z.amax(1, keepdim=True)
            lse[s : s + chunk] = z.sub_(top).exp_().sum(1).log_().add_(top.squeeze(1))
            losses[s : s + chunk] = row.add_(lse[s : s + chunk])
            del z  # free this chunk's logits before the next one exists
        losses = losses.masked_fill(~valid, 0.0)
        ctx.save_for_backward(hidden, weight, bias, safe, valid, lse)
        ctx.chunk, ctx.eps, ctx.reduction = chunk, eps, reduction
        if reduction == "none":
            return losses.to(hidden.dtype)
        total = losses.sum()
        return (total if reduction == "sum" else total / valid.sum()).to(hidden.dtype)

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor):
        hidden, weight, bias, safe, valid, lse = ctx.saved_tensors
        chunk, eps, n = ctx.chunk, ctx.eps, hidden.shape[0]
        acc = lse.dtype
        if ctx.reduction == "mean":
            grad_out = grad_out / valid.sum()  # inf when every row is ignored
        # where, not `* valid`: ignored rows get exactly 0 even then (inf * 0 is NaN)
        scale = torch.where(valid, grad_out.to(acc).expand(n), 0.0).unsqueeze(1)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        gh = torch.empty_like(hidden) if need_h else None
        gw = torch.zeros(weight.shape, dtype=acc, device=weight.device) if need_w else None
        gb = torch.zeros(weight.shape[0], dtype=acc, device=weight.device) if need_b else None
        cd = ctx.dtype  # forward's logits were computed in it (autocast casts to it)
        w = weight.to(cd)
        b = None if bias is None else bias.to(cd)
        for s in range(0, n, chunk):
            h = hidden[s : s + chunk]
            g = F.linear(h.to(cd), w, b).to(acc).sub_(lse[s : s + chunk, None]).exp_()
            if eps:
                g.sub_(eps / weight.shape[0])
            g.scatter_add_(1, safe[s : s + chunk, None], g.new_full((g.shape[0], 1), eps - 1.0))
            g.mul_(scale[s : s + chunk])  # d loss / d logits for this chunk
            if gh is not None and cd == hidden.dtype:
                torch.mm(g.to(cd), w, out=gh[s : s + chunk])
            elif gh is not None:  # (under autocast: computed in its dtype, as autograd's)
                gh[s : s + chunk] = torch.mm(g.to(cd), w)
            if gw is not None:
                gw.addmm_(g.t(), h.to(acc))
            if gb is not None:
                gb.add_(g.sum(0))
            del g
        gw = gw.to(weight.dtype) if gw is not None else None
        gb = gb.to(bias.dtype) if gb is not None else None
        return gh, gw, gb, None, None, None, None, None


_LOSS_DEFAULTS: dict[str, Any] = dict(
    chunk_size=None, ignore_index=-100, reduction="mean", label_smoothing=0.0, impl="auto"
)


class ChunkedLMHead(nn.Module):
    """An LM output head whose forward returns the loss, never the full logits.

    Args:
        in_features: hidden size ``D`` (ignored when ``weight`` is given).
        vocab_size: number of classes ``V`` (ignored when ``weight`` is given).
        weight: an existing ``(V, D)`` parameter to tie to, e.g.
            ``model.embed.weight``; otherwise a new one is created.
        bias: add a learnable ``(V,)`` bias.
        **loss_options: ``chunk_size``, ``ignore_index``, ``reduction``,
            ``label_smoothing``, ``impl`` of :func:`linear_cross_entropy`.

    Example:
        >>> emb = nn.Embedding(50, 8)
        >>> head = ChunkedLMHead(weight=emb.weight)
        >>> head(torch.randn(3, 8), torch.tensor([1, 2, 3])).backward()
    """

    def __init__(
        self,
        in_features: int | None = None,
        vocab_size: int | None = None,
        *,
        weight: nn.Parameter | None = None,
        bias: bool = False,
        **loss_options: Any,
    ) -> None:
        super().__init__()
        if weight is None:
            if in_features is None or vocab_size is None:
                raise ValueError("give in_features and vocab_size, or weight= to tie a parameter")
            weight = nn.Parameter(torch.empty(vocab_size, in_features))
            nn.init.normal_(weight, std=in_features**-0.5)
        self.weight = weight
        self.bias = nn.Parameter(torch.zeros(weight.shape[0])) if bias else None
        unknown = set(loss_options) - set(_LOSS_DEFAULTS)
        if unknown:
            raise TypeError(f"unknown loss options {sorted(unknown)}; use {sorted(_LOSS_DEFAULTS)}")
        self.loss_options = {**_LOSS_DEFAULTS, **loss_options}
        _check_options(**self.loss_options)

    def forward(self, hidden: Tensor, targets: Tensor) -> Tensor:
        return linear_cross_entropy(hidden, self.weight, targets, self.bias, **self.loss_options)

    def extra_repr(self) -> str:
        v, d = self.weight.shape
        opts = ", ".join(f"{k}={o!r}" for k, o in self.loss_options.items())
        return f"in_features={d}, vocab_size={v}, bias={self.bias is not None}, {opts}"

    def logits(self, hidden: Tensor) -> Tensor:
        """Materialised logits, for generation or evaluation of a few positions."""
        return F.linear(hidden, self.weight, self.bias)
