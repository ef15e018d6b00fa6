"""Gradient transforms around a bucket step: unscale, clip, and the measure pass.

Used by the plain stepper (``layeropt/engine/stepper.py``, before each step) and by ``layeropt.backward``'s
measure pass. Every op is the one torch itself uses
(``GradScaler.unscale_``, ``clip_grad_norm_``, ``clip_grad_value_``), so the
results stay bit-identical. Clipping by value runs ``clip_grad_value_``'s
own body (:func:`clip_value`) rather than the public function: the same
grouping and the same clamps, without its wrapper and the watcher layeropt
puts on it for the loop's own calls - a third of its cost on a small bucket,
which ``bucket_cap_mb=0`` pays once per layer (``benchmarks/bench_clip.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch.utils._foreach_utils import _group_tensors_by_device_and_dtype, _has_foreach_support

def clip_value(params: list[Tensor], value: float) -> None:
    """``torch.nn.utils.clip_grad_value_(params, value)``'s body: each (device, dtype)
    group of gradients clamped to ``[-value, value]`` in place, by ``_foreach_clamp_min_``
    and ``_foreach_clamp_max_`` where torch's check allows them, else ``clamp_``."""
    grads = [p.grad for p in params if p.grad is not None]
    value = float(value)
    prior = torch.is_grad_enabled()
    if prior:  # (torch's runs under no_grad)
        torch._C._set_grad_enabled(False)
    try:
        first = grads[0] if grads else None
        if first is not None and all(  # one group, as torch's grouping would return it
                g.device == first.device and g.dtype == first.dtype for g in grads):
            groups: Any = [(first.device, grads)]
        else:
            groups = [(d, gs) for (d, _), ([gs], _)
                      in _group_tensors_by_device_and_dtype([grads]).items()]
        for device, group in groups:
            if _has_foreach_support(group, device):
                torch._foreach_clamp_min_(group, -value)
                torch._foreach_clamp_max_(group, value)
            else:
                for g in group:
                    g.clamp_(min=-value, max=value)
    finally:
        if prior:
            torch._C._set_grad_enabled(True)


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
        # of those, the ones left in .grad to accumulate onto (by id: that .grad tensor)
        self.summed: dict[int, Tensor] = {}
        self.seen: set[int] = set()

    def take(self, param: Tensor) -> None:
        grad = param.grad
        param.grad = None
        self.seen.add(id(param))
        if self.norm_type is None and self.found_inf is None:
            return  # (an engine the pass reaches without measuring it: its gradient waits)
        held = None if id(param) in self.summed else self.stash.get(param)
        # AccumulateGrad would compute held + grad; addition commutes bitwise.
        self.reduce(param, grad if held is None else held + grad)

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


@contextlib.contextmanager
def unscaled_in_kernel(optimizer: Any, scale: Tensor, found_inf: Tensor | None = None
                       ) -> Iterator[None]:
    """The steps inside unscale in a fused optimizer's kernel, as ``scaler.step(optimizer)``
    has them: ``grad_scale`` (and ``found_inf``) set on the optimizer, and after them put
    back as they were (none: removed)."""
    names = ("grad_scale",) if found_inf is None else ("grad_scale", "found_inf")
    prior = {name: vars(optimizer)[name] for name in names if name in vars(optimizer)}
    optimizer.grad_scale = scale
    if found_inf is not None:
        optimizer.found_inf = found_inf
    try:
        yield
    finally:
        for name in names:
            if name in prior:
                setattr(optimizer, name, prior[name])
            else:
                delattr(optimizer, name)


def total_norm(norms: list[Tensor], norm_type: float) -> Tensor:
    """``clip_grad_norm_``'s total norm of per-tensor norms given in its order
    (:func:`grad_order`)."""
    if not norms:
        return torch.tensor(0.0)
    first = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)


def grad_order(measured: dict[Tensor, Tensor], parameters: list[Tensor]) -> list[Tensor]:
    """Norms in the order ``clip_grad_norm_(parameters)`` stacks them.

    The total norm sums the per-tensor norms; its last bit depends on their
    order, so it follows ``parameters``, grouped by device and dtype in the order
    torch's own grouping gives (not first appearance: a model mixing bf16 and
    float32 layers).
    """
    seen: set[int] = set()
    ordered = []
    for p in parameters:
        if p in measured and id(p) not in seen:
            seen.add(id(p))
            ordered.append(p)
    if not ordered:
        return []
    grouped = _group_tensors_by_device_and_dtype([ordered], with_indices=True)
    return [measured[ordered[i]] for _, (_, indices) in grouped.items() for i in indices]


def grads_total_norm(grads: list[Tensor], norm_type: float = 2.0) -> Tensor:
    """``torch.nn.utils.get_total_norm(grads, norm_type)``, also on torch < 2.6,
    which computes it only inside ``clip_grad_norm_``: the same per-tensor norms,
    stacked in the same order."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(grads, norm_type)
    grouped = _group_tensors_by_device_and_dtype([list(grads)])
    return total_norm([_norm(g, norm_type) for [group], _ in grouped.values() for g in group],
                      norm_type)


class Transform(NamedTuple):
    """What ``layeropt.backward``'s step pass does to every gradient before its step:
    ``GradScaler.unscale_`` (``inv_scale``), then ``clip_grad_norm_``'s coefficient
    (``coef``) on the parameters it clips (``clipped``: their ids; ``None``: all)."""

    inv_scale: Tensor | None
    coef: Tensor | None
    clipped: frozenset[int] | None = None


ENTERED = Transform(None, None)  # inside layeropt.backward, nothing to apply (compared by `is`)


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
        clip_value(params, settings.clip_value)
    if settings.bucket_max_norm is not None:
        torch.nn.utils.clip_grad_norm_(params, settings.bucket_max_norm, settings.norm_type)
