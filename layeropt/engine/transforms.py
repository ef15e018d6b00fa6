"""Gradient transforms around a bucket step: unscale, clip, and the measure pass.

Used by ``Engine._step`` (before each step) and by ``layeropt.backward``'s
measure pass. Every op is the one torch itself uses
(``GradScaler.unscale_``, ``clip_grad_norm_``, ``clip_grad_value_``), so the
results stay bit-identical.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

def by_device_dtype(tensors: list[Tensor]) -> list[list[Tensor]]:
    groups: dict[tuple[Any, Any], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


class Measure:
    """Reduces each gradient of the measure pass to its norm / inf flag, then frees it."""

    def __init__(
        self,
        measured: dict[Tensor, Tensor],
        norm_type: float | None,
        inv_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        self.measured = measured
        self.norm_type = norm_type
        self.inv_scale = inv_scale
        self.found_inf = found_inf
        self.stash: dict[Tensor, Tensor] = {}  # gradients held by no_step()
        self.summed: set[int] = set()  # of those, the ones left in .grad to accumulate onto
        self.seen: set[int] = set()

    def take(self, param: Tensor) -> None:
        grad = param.grad
        param.grad = None
        held = None if id(param) in self.summed else self.stash.get(param)
        # AccumulateGrad would compute held + grad; addition commutes bitwise.
        self.reduce(param, grad if held is None else held + grad)
        self.seen.add(id(param))

    def take_copy(self, param: Tensor, grad: Tensor) -> None:
        """Measure a copy of ``grad`` as ``param``'s (an averaged DDP bucket's slice)."""
        self.reduce(param, grad.clone())
        self.seen.add(id(param))

    def reduce(self, param: Tensor, grad: Tensor) -> None:
        norm = reduce_grad(grad, self.norm_type, self.inv_scale, self.found_inf)
        if norm is not None:
            self.measured[param] = norm


def reduce_grad(grad: Tensor, norm_type: float | None, inv_scale: Tensor | None,
                found_inf: Tensor | None) -> Tensor | None:
    """Unscale ``grad`` in place, flagging an inf/NaN in ``found_inf``
    (``GradScaler.unscale_``), then its norm (``clip_grad_norm_``'s per-tensor norm)."""
    if inv_scale is not None and found_inf is not None:
        torch._amp_foreach_non_finite_check_and_unscale_(
            [grad], found_inf, inv_scale.to(grad.device)
        )
    return None if norm_type is None else _norm(grad, norm_type)


def _norm(grad: Tensor, norm_type: float) -> Tensor:
    """The per-tensor norm exactly as torch.nn.utils.clip_grad_norm_ computes it."""
    from torch.utils._foreach_utils import _has_foreach_support

    if _has_foreach_support([grad], grad.device):
        return torch._foreach_norm([grad], norm_type)[0]
    return torch.linalg.vector_norm(grad, norm_type)


class Transform(NamedTuple):
    """What ``layeropt.backward``'s step pass does to every gradient before its step:
    ``GradScaler.unscale_`` (``inv_scale``), then ``clip_grad_norm_``'s coefficient
    (``coef``) on the parameters it clips (``clipped``: their ids; ``None``: all)."""

    inv_scale: Tensor | None
    coef: Tensor | None
    clipped: frozenset[int] | None = None


def prepare_grads(params: list[Tensor], transform: Transform | None, settings: Any) -> None:
    """Unscale, then clip (the global coefficient, then the attachment's ``settings``:
    by value, per bucket) in place."""
    if transform is not None:
        grads = [p.grad for p in params]
        if transform.inv_scale is not None:
            for device_grads in by_device_dtype(grads):
                found = torch.zeros((), device=device_grads[0].device)
                torch._amp_foreach_non_finite_check_and_unscale_(
                    device_grads, found, transform.inv_scale.to(device_grads[0].device)
                )
        if transform.coef is not None:
            clipped = transform.clipped
            if clipped is not None:
                grads = [p.grad for p in params if id(p) in clipped]
            for device_grads in by_device_dtype(grads):
                torch._foreach_mul_(device_grads, transform.coef.to(device_grads[0].device))
    if settings is None:
        return
    if settings.clip_value is not None:
        torch.nn.utils.clip_grad_value_(params, settings.clip_value)
    if settings.bucket_max_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, settings.bucket_max_norm, settings.norm_type)
