"""What the target device's kernels do that fake tensors cannot show.

A plan runs on fake CPU tensors (torch cannot make fake CUDA tensors without
CUDA), so the operators are CPU's and every tensor they return is counted.
Two things differ on the real device, and each target here models them:

* **kernel choice** - on CPU, attention with dropout falls back to the *math*
  kernel, which keeps the ``(T, T)`` attention matrix for backward; a GPU runs
  flash (or memory-efficient) attention, which keeps only ``logsumexp``. The
  ``"cuda"`` target sends every ``scaled_dot_product_attention`` to the flash
  kernel's operator.
* **buffers a kernel allocates and frees inside itself**, which no
  dispatcher-level count sees: FlashAttention-2's backward accumulates ``dq``
  in fp32 (``"cuda"``); CPU's reference convolution unfolds its input into a
  columns buffer, a ``mse_loss`` keeps its unreduced storage (``"cpu"``).

And CPU memory a GPU step also uses, which only the ``"cpu"`` target counts:
checkpointing saves the CPU generator state. (Python scalars that torch wraps
into 8-byte tensors and autograd saves - GPT-2's GELU keeps three per layer -
reach the dispatcher as Python numbers: not counted.)

What neither target sees at the dispatcher - cuBLAS's workspaces, the caching
allocator's rounding and fragmentation - is what the allocator replay adds on
``"cuda"`` (:mod:`layeropt.plan.allocator`); the CUDA context is the plan's
margin (``docs/plan.md``).

Example:
    >>> target("cuda").name
    'cuda'
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["Target", "target", "TARGETS"]

aten = torch.ops.aten
#: The devices a plan can model.
TARGETS = ("cuda", "cpu")


class Target:
    """How one kind of device runs the kernels of a training step.

    Args:
        name: ``"cuda"`` (a GPU: flash attention, its fp32 backward buffer)
            or ``"cpu"`` (torch's reference CPU kernels, as the tests measure
            them with oneDNN off).
    """

    def __init__(self, name: str) -> None:
        if name not in TARGETS:
            raise ValueError(f"unknown target device {name!r}; choose one of {TARGETS}")
        self.name = name

    def __repr__(self) -> str:
        return f"Target({self.name!r})"

    def prepare(self) -> None:
        """What it asks of this torch before a step is planned, outside its modes (a
        fake tensor mode, the tracker): whether the CPU flash operator takes GQA."""
        if self.name == "cuda":
            _flash_takes_gqa()

    @contextlib.contextmanager
    def kernels(self, tracker: Any) -> Iterator[None]:
        """Inside: operators run (and allocate) as on this device.

        Args:
            tracker: the :class:`~layeropt.plan.tracker.LiveBytes` counting
                the step; its ``workspace`` and ``storage_size`` hooks are set.
        """
        tracker.workspace = self.workspace
        tracker.storage_size = self.storage_size
        with contextlib.ExitStack() as stack:
            if self.name == "cuda":
                sdpa = _flash_attention(F.scaled_dot_product_attention, _flash_takes_gqa())
                stack.enter_context(_patched(F, "scaled_dot_product_attention", sdpa))
            else:
                stack.enter_context(_rng_state_counted(tracker))
            try:
                yield
            finally:
                tracker.workspace = tracker.storage_size = None

    # -- hooks called by the tracker after each operator -------------------
    def workspace(self, func: Any, args: tuple, kwargs: dict) -> int:
        """Bytes ``func`` allocates and frees inside itself on this device."""
        if self.name == "cuda":
            if func is aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
                return _flash_backward_workspace(args[1], args[2])
            return 0
        if func is aten.convolution.default:
            return _columns(args[0], args[1], args[3], args[4], args[5], args[6], args[8])
        if func is aten.convolution_backward.default:
            if not any(args[10][:2]):
                return 0
            return _columns(args[1], args[2], args[4], args[5], args[6], args[7], args[9])
        return 0

    def storage_size(self, func: Any, args: tuple, kwargs: dict, out: Any) -> int | None:
        """The real ``nbytes`` of ``out``'s storage when it differs from the fake one."""
        if self.name == "cpu" and func is aten.mse_loss.default:
            reduction = args[2] if len(args) > 2 else kwargs.get("reduction", 1)
            if reduction != 0:  # the reduced loss lives in the unreduced storage
                x = args[0]
                return x.numel() * x.element_size()
        return None


def target(name: str | Target) -> Target:
    """``"cuda"`` / ``"cpu"`` -> :class:`Target` (a Target passes through)."""
    return name if isinstance(name, Target) else Target(name)


def _columns(
    x: Tensor, w: Tensor, stride: Any, padding: Any, dilation: Any, transposed: bool, groups: int
) -> int:
    """CPU ``slow_conv2d``'s unfolded input: ``N x (C k k) x (H_out W_out)``."""
    if x.dim() != 4 or transposed or groups != 1 or any(d != 1 for d in dilation):
        return 0  # other CPU convolutions: not modelled
    kh, kw = w.shape[-2:]
    if (kh, kw) == (1, 1) and all(s == 1 for s in stride) and all(p == 0 for p in padding):
        return 0  # a 1x1 convolution reads its input directly
    h_out = (x.shape[2] + 2 * padding[0] - kh) // stride[0] + 1
    w_out = (x.shape[3] + 2 * padding[1] - kw) // stride[1] + 1
    return x.shape[0] * x.shape[1] * kh * kw * h_out * w_out * x.element_size()


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _flash_backward_workspace(q: Tensor, k: Tensor) -> int:
    """FlashAttention-2's backward buffers: fp32 ``dq`` accumulator and ``softmax_d``.

    With fewer key/value heads than query heads (GQA) it also expands ``dk``
    and ``dv`` to every query head before summing them.
    """
    b, h, t, d = q.shape
    t_rounded = _round_up(t, 128)
    d_rounded = _round_up(d, 32 if d <= 128 else 64)
    total = b * t_rounded * h * d_rounded * 4 + b * h * t_rounded * 4
    if k.shape[1] != h:
        total += 2 * b * k.shape[2] * h * d * q.element_size()
    return total


@functools.cache
def _flash_takes_gqa() -> bool:
    """Whether this torch's CPU flash operator takes fewer key/value heads than query
    heads (grouped-query attention) in backward. torch 2.6's returns the key's gradient
    with the query's heads (autograd refuses it; on real tensors the kernel reads past
    the key); 2.13's takes them. Tried on fake tensors: nothing runs."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    try:
        with FakeTensorMode():
            q, k, v = (torch.empty(1, h, 8, 8, requires_grad=True) for h in (4, 2, 2))
            out, _ = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True)
            out.sum().backward()
            return tuple(k.grad.shape) == tuple(k.shape)
    except RuntimeError:
        return False


def _flash_attention(original: Any, gqa: bool = True) -> Any:
    """``F.scaled_dot_product_attention`` that always takes the flash kernel's operator.

    The GPU picks flash attention (memory-efficient attention with a mask:
    the same memory, outputs and ``logsumexp``), never the math fallback CPU
    takes for dropout; the CPU flash operator has the same outputs. (A
    function, not a ``TorchFunctionMode``: modes are not active when
    checkpointing recomputes in backward.) Grouped-query attention goes to it
    as it is where the operator takes it (``gqa``); elsewhere the key and value
    heads are repeated first, as ``transformers``' ``repeat_kv`` does - the
    copies are counted, where a GPU's flash kernel makes none.
    """
    names = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale")

    def scaled_dot_product_attention(*args: Any, **kwargs: Any) -> Tensor:
        bound = dict(zip(names, args), **kwargs)
        q, k, v = bound["query"], bound["key"], bound["value"]
        if q.dim() != 4 or q.shape[-1] > 256 or q.shape[1] % k.shape[1]:
            return original(*args, **kwargs)  # nothing the flash kernel would take
        if not gqa and k.shape[1] != q.shape[1]:  # (this torch's operator: one head each)
            groups = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        mask = bound.get("attn_mask")
        if mask is not None and mask.dtype == torch.bool:
            mask = mask.new_zeros(mask.shape, dtype=q.dtype)  # as the kernel's additive mask
        out, _ = aten._scaled_dot_product_flash_attention_for_cpu(
            q,
            k,
            v,
            float(bound.get("dropout_p", 0.0)),
            bool(bound.get("is_causal", False)),
            attn_mask=mask,
            scale=bound.get("scale"),
        )
        return out

    return scaled_dot_product_attention


@contextlib.contextmanager
def _patched(owner: Any, name: str, value: Any) -> Iterator[None]:
    original = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, original)


@contextlib.contextmanager
def _rng_state_counted(tracker: Any) -> Iterator[None]:
    """Count ``torch.get_rng_state()`` tensors (checkpointing saves one per segment).

    They are made without the dispatcher, in CPU memory: they count on a CPU
    target only.
    """
    original = torch.get_rng_state

    def get_rng_state() -> Tensor:
        state = original()
        tracker.track(state)
        return state

    with _patched(torch, "get_rng_state", get_rng_state):
        yield

