"""The training configurations a plan compares, and the optimizers behind them.

A :class:`Variant` is one row of the plan: an optimizer (``torch.optim.AdamW``,
``layeropt.AdamW``, a low-bit AdamW, alone or made in-backward with
:func:`layeropt.in_backward`), how it is implemented (``"fused"`` or
``"foreach"``, set explicitly: torch would pick the slow per-tensor loop for
fake parameters, not what it picks on a GPU), whether activations are
checkpointed and whether the LM loss is chunked.

Example:
    >>> v = Variant("layeropt.AdamW", checkpointing=True)
    >>> v.label
    'layeropt.AdamW (fused) + checkpointing'
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from ..memory import format_bytes
from .workloads import PlanError, Workload

__all__ = ["Variant", "OPTIMIZERS", "LOW_BIT", "available", "default_variants"]

#: Low-bit optimizers: display name -> (module, class).
LOW_BIT: dict[str, tuple[str, str]] = {
    "torchao.optim.AdamW8bit": ("torchao.optim", "AdamW8bit"),
    "torchao.optim.AdamW4bit": ("torchao.optim", "AdamW4bit"),
    "bitsandbytes.optim.AdamW8bit": ("bitsandbytes.optim", "AdamW8bit"),
}

#: Every optimizer name a :class:`Variant` accepts.
OPTIMIZERS: tuple[str, ...] = (
    "torch.optim.AdamW",
    "layeropt.AdamW",
    *LOW_BIT,
    *(f"layeropt.in_backward({name})" for name in LOW_BIT),
)
IMPLEMENTATIONS = ("fused", "foreach")


@dataclasses.dataclass(frozen=True)
class Variant:
    """One configuration of the training step.

    Args:
        optimizer: one of :data:`OPTIMIZERS`.
        implementation: ``"fused"`` or ``"foreach"`` for the AdamW of torch
            and layeropt; low-bit optimizers have one kernel (``"fused"``).
        checkpointing: activation checkpointing on (``use_reentrant=False``).
        chunked_loss: the LM loss through
            :func:`layeropt.losses.linear_cross_entropy` (no full logits).
        offload: the optimizer state in host memory, one bucket's at a time
            on the device (:func:`layeropt.offload.offload_state`;
            ``layeropt.AdamW`` only).
        held_on_host: with ``offload``, gradients held across an accumulation
            window wait in host memory too (``offload_state``'s
            ``held_grads=True``, its default); without it they stay on the device
            (``held_grads=False``). Planned apart only with accumulation.
        held_device_bytes: with ``held_on_host``, the held gradients of whole
            buckets kept on the GPU up to this many bytes, only the rest moved
            (``offload_state(opt, held_device_bytes=N)``). A plan adds such a
            row to fill the room its recommendation leaves (:func:`~layeropt.plan.plan`).
    """

    optimizer: str = "torch.optim.AdamW"
    implementation: str = "fused"
    checkpointing: bool = False
    chunked_loss: bool = False
    offload: bool = False
    held_on_host: bool = False
    held_device_bytes: int = 0

    def __post_init__(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            raise PlanError(
                f"unknown optimizer {self.optimizer!r}; choose one of {', '.join(OPTIMIZERS)}"
            )
        if self.implementation not in IMPLEMENTATIONS:
            raise PlanError(
                f"implementation must be one of {IMPLEMENTATIONS}, got {self.implementation!r}"
            )
        if self.base in LOW_BIT and self.implementation != "fused":
            raise PlanError(f"{self.base} has one implementation: use implementation='fused'")
        if self.offload and self.optimizer != "layeropt.AdamW":
            raise PlanError(
                f"offload=True plans layeropt.AdamW's state in host memory, not {self.optimizer}'s"
            )
        if self.held_on_host and not self.offload:
            raise PlanError("held_on_host=True is part of state offload: set offload=True too")
        n = self.held_device_bytes
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise PlanError(f"held_device_bytes must be an int >= 0 (bytes), got {n!r}")
        if self.held_device_bytes and not self.held_on_host:
            raise PlanError("held_device_bytes keeps part of the held gradients that "
                            "held_on_host=True moves: set held_on_host=True too")

    @property
    def in_backward(self) -> bool:
        """Whether layeropt updates each layer during backward."""
        return self.optimizer.startswith("layeropt.")

    @property
    def base(self) -> str:
        """The optimizer without layeropt: ``"torch.optim.AdamW"``, ``"torchao..."``."""
        if self.optimizer == "layeropt.AdamW":
            return "torch.optim.AdamW"
        if self.optimizer.startswith("layeropt.in_backward("):
            return self.optimizer[len("layeropt.in_backward(") : -1]
        return self.optimizer

    @property
    def label(self) -> str:
        """A short name for tables: ``"layeropt.AdamW (fused) + checkpointing"``."""
        text = self.optimizer
        if self.base not in LOW_BIT:
            text += f" ({self.implementation})"
        if self.checkpointing:
            text += " + checkpointing"
        if self.chunked_loss:
            text += " + chunked loss"
        if self.offload:
            text += " + state offload"
        if self.held_on_host:
            text += " + held grads in host memory"
        if self.held_device_bytes:
            text += f", up to {format_bytes(self.held_device_bytes)} of them on the GPU"
        return text

    @property
    def run_on_a_gpu(self) -> bool:
        """Whether layeropt has run this configuration on a GPU (``docs/results/``).

        State offload has (``offload_state``'s defaults, on an H200, 2026-12-04:
        a Llama-2-7B-shaped model with checkpointing and its held gradients in
        host memory, and ``benchmarks/offload_bench.py`` with them on the GPU,
        bit-identical to torch.optim). Not yet: a low-bit optimizer made
        in-backward (its CUDA kernel inside backward), and held gradients kept
        on the GPU under a budget (``held_device_bytes``: exact on the CPU). A plan that says such a
        row fits says, on the same line, that it has not run on a GPU.
        """
        return not (self.in_backward and self.base in LOW_BIT) and not self.held_device_bytes

    def changes(self) -> set[str]:
        """What differs from plain ``torch.optim.AdamW`` (foreach, torch's GPU default).

        ``"fused"``, ``"layeropt"``, ``"low-bit"``, ``"checkpointing"``,
        ``"chunked loss"``, ``"state offload"``, ``"held grads offload"``. A low-bit optimizer is one
        change (``"low-bit"``:
        its own states and its own one-kernel update), not also ``"fused"``.
        """
        out = set()
        if self.implementation == "fused" and self.base not in LOW_BIT:
            out.add("fused")
        if self.in_backward:
            out.add("layeropt")
        if self.base in LOW_BIT:
            out.add("low-bit")
        if self.checkpointing:
            out.add("checkpointing")
        if self.chunked_loss:
            out.add("chunked loss")
        if self.offload:
            out.add("state offload")
        if self.held_on_host:
            out.add("held grads offload")
        return out

    def make_optimizer(self, params: list[Tensor]) -> torch.optim.Optimizer:
        """Build this variant's optimizer for ``params``.

        Raises:
            PlanError: the low-bit library is not installed.
        """
        import layeropt

        if self.base == "torch.optim.AdamW":
            cls: Any = layeropt.AdamW if self.in_backward else torch.optim.AdamW
            impl = {"fused": True} if self.implementation == "fused" else {"foreach": True}
            return cls(params, **impl)
        cls = _low_bit_class(self.base)
        if self.in_backward:
            cls = layeropt.in_backward(cls)
        return cls(params)


def _low_bit_class(name: str) -> type:
    module, attr = LOW_BIT[name]
    try:
        return getattr(importlib.import_module(module), attr)
    except Exception as e:  # ImportError, or a library that fails to load on this machine
        raise PlanError(
            f"{name} is not available here ({type(e).__name__}: {e}); "
            f"pip install {module.split('.')[0]} or leave it out of the variants"
        ) from None


def available(name: str) -> bool:
    """Whether the optimizer ``name`` (one of :data:`OPTIMIZERS`) can be built here."""
    base = Variant(name).base
    if base not in LOW_BIT:
        return True
    try:
        _low_bit_class(base)
    except PlanError:
        return False
    return True


def default_variants(
    workload: Workload, optimizers: Iterable[str] | None = None, every: bool = False,
    accumulate: int = 1,
) -> list[Variant]:
    """The rows of a plan.

    ``torch.optim.AdamW`` (foreach and fused) and ``layeropt.AdamW`` (fused),
    each with checkpointing off and on, and with the full and the chunked LM
    loss where they apply; ``layeropt.AdamW`` with its state offloaded to host
    memory, the same ways; every installed low-bit AdamW with checkpointing
    off and on, and in-backward with checkpointing (``every``: all of these
    with the chunked loss too).

    Args:
        workload: the model (whether checkpointing and chunking apply).
        optimizers: keep only these optimizer names (default: all).
        every: every combination (half as many rows again).
        accumulate: micro-batches per step; above 1 each state offload row also
            comes with its held gradients in host memory.

    Returns:
        The variants, in a fixed order.
    """
    ckpts = (False, True) if workload.checkpoint is not None else (False,)
    chunks = (False, True) if workload.chunked_loss is not None else (False,)
    rows: list[Variant] = []
    for opt, impl in (("torch.optim.AdamW", "foreach"), ("torch.optim.AdamW", "fused"),
                      ("layeropt.AdamW", "fused")):
        rows += [Variant(opt, impl, c, k) for c in ckpts for k in chunks]
    rows += [Variant("layeropt.AdamW", "fused", c, k, offload=True) for c in ckpts for k in chunks]
    if accumulate > 1:
        rows += [Variant("layeropt.AdamW", "fused", c, k, offload=True, held_on_host=True)
                 for c in ckpts for k in chunks]
    low_chunks = chunks if every else (False,)
    for name in LOW_BIT:
        rows += [Variant(name, "fused", c, k) for c in ckpts for k in low_chunks]
        in_backward = f"layeropt.in_backward({name})"
        rows += [Variant(in_backward, "fused", c, k)
                 for c in (ckpts if every else ckpts[-1:]) for k in low_chunks]  # fmt: skip
    if optimizers is not None:
        wanted = list(optimizers)
        unknown = [o for o in wanted if o not in OPTIMIZERS]
        if unknown:
            raise PlanError(
                f"unknown optimizer {unknown[0]!r}; choose from {', '.join(OPTIMIZERS)}"
            )
        rows = [v for v in rows if v.optimizer in wanted]
    return [v for v in rows if available(v.optimizer)]

