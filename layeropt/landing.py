"""What happens when a gradient lands.

This module is the whole in-backward update rule. ``layeropt.attach`` registers
one post-accumulate-grad hook per parameter; the hook calls
:meth:`Engine.on_grad`. From there:

1. autograd fires a parameter's hook exactly once per backward, *after* every
   contribution to its gradient has been summed into ``.grad`` (skip
   connections, tied weights and loops included);
2. inside ``optimizer.no_step()`` the gradient is only held: it keeps
   accumulating in ``.grad`` over the next backwards;
3. otherwise the parameter is marked as arrived in its :class:`Bucket`
   (one module's own parameters); when every parameter of the bucket has
   arrived, the bucket is stepped with one call of torch's ``step`` (one
   foreach/fused kernel launch per bucket) and the gradients are freed;
4. when the backward ends (an autograd engine callback queued at the first
   arrival), buckets that only partly arrived - some parameters got no
   gradient this time - and gradients held from ``no_step()`` are stepped
   together, and freed.

Parameters that receive no gradient are never stepped, as in torch.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .errors import AttachError, BackwardStateError, LayeroptError

if TYPE_CHECKING:
    from .optim import InBackwardOptimizer

__all__ = ["Bucket", "Engine"]

_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _queue_callback(fn: Any) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


class Bucket:
    """Parameters that are stepped together once all of their gradients landed.

    Attributes:
        name: the module (or modules) the parameters belong to, for messages.
        params: the parameters, in module registration order.
    """

    __slots__ = ("name", "params", "arrived", "count", "stepped_serial", "__weakref__")

    def __init__(self, name: str, params: list[Tensor]) -> None:
        self.name = name
        self.params = params
        self.arrived = [False] * len(params)
        self.count = 0
        self.stepped_serial = -1  # the backward serial in which it was last stepped

    @property
    def nbytes(self) -> int:
        """Gradient bytes of the bucket (what it holds while waiting)."""
        return sum(p.numel() * p.element_size() for p in self.params)

    def reset(self) -> None:
        self.arrived = [False] * len(self.params)
        self.count = 0

    def __repr__(self) -> str:
        return f"Bucket({self.name!r}, {len(self.params)} params, {self.nbytes} bytes)"


class Engine:
    """Per-optimizer bookkeeping of one backward pass (see the module docstring)."""

    def __init__(self, optimizer: InBackwardOptimizer) -> None:
        self._optimizer = weakref.ref(optimizer)
        self.no_step_depth = 0
        self.held: dict[Tensor, None] = {}  # gradients accumulated under no_step()
        self.hook_count = 0
        self.attachments: weakref.WeakSet[Any] = weakref.WeakSet()
        self._pending: dict[Bucket, None] = {}  # buckets with some arrivals
        self._active_task = -2  # autograd graph task of the backward in progress
        self._serial = 0  # counts attached backwards
        self._steps = 0
        self.last_backward_steps = 0
        # Clipping / scaling (set by attach(...) and layeropt.backward).
        self.max_grad_norm: float | None = None
        self.norm_type = 2.0
        self.clip_value: float | None = None
        self.bucket_max_norm: float | None = None
        self.entered = False  # inside layeropt.backward
        self.measure: _Measure | None = None  # the measure pass of layeropt.backward
        self.transform: tuple[Tensor | None, Tensor | None] | None = None  # (inv_scale, coef)

    def configure_clipping(
        self,
        *,
        max_grad_norm: float | None,
        norm_type: float,
        clip_value: float | None,
        bucket_max_norm: float | None,
    ) -> None:
        self.max_grad_norm = max_grad_norm
        self.norm_type = float(norm_type)
        self.clip_value = clip_value
        self.bucket_max_norm = bucket_max_norm

    # -- the hook -------------------------------------------------------
    def on_grad(self, bucket: Bucket, index: int, param: Tensor) -> None:
        """Called by autograd once ``param``'s gradient has fully accumulated."""
        optimizer = self._optimizer()
        if optimizer is None:
            return
        task = _graph_task_id()
        if task != self._active_task or self._active_task == -2:
            self._begin(task)
        grad = param.grad
        if grad is None:  # another hook freed it; nothing to do
            return
        if grad.is_sparse:
            raise AttachError(
                f"parameter in {bucket.name!r} got a sparse gradient; layeropt "
                "steps dense gradients only. Use a dense embedding "
                "(sparse=False) or leave this parameter to a separate, plain "
                "torch.optim optimizer."
            )
        if self.measure is not None:
            self.measure.take(param)
            return
        if self.max_grad_norm is not None and not self.entered:
            raise LayeroptError(
                "this optimizer was attached with max_grad_norm, which needs the global "
                "gradient norm before the first update: call layeropt.backward(loss) "
                "instead of loss.backward(). Nothing was updated."
            )
        if self.no_step_depth:
            self.held[param] = None
            return
        if bucket.arrived[index] or bucket.stepped_serial == self._serial:
            raise BackwardStateError(
                f"a parameter of {bucket.name!r} received a second gradient in the "
                "same backward pass, so it would be stepped on a partial gradient. "
                "This happens with reentrant activation checkpointing "
                "(torch.utils.checkpoint(..., use_reentrant=True)): use "
                "use_reentrant=False."
            )
        bucket.arrived[index] = True
        bucket.count += 1
        if bucket.count == 1:
            self._pending[bucket] = None
        if bucket.count == len(bucket.params):
            del self._pending[bucket]
            bucket.reset()
            bucket.stepped_serial = self._serial
            self._step(optimizer, bucket.params)

    # -- backward boundaries ---------------------------------------------
    def _begin(self, task: int) -> None:
        if self._active_task != -2:
            # The previous backward never reached its end callback (it raised):
            # forget its half-filled buckets; their gradients stay in .grad.
            self._reset()
        self._active_task = task
        self._serial += 1
        self._steps = 0
        _queue_callback(self._end)

    def _end(self) -> None:
        optimizer = self._optimizer()
        try:
            if optimizer is not None and not self.no_step_depth and self.measure is None:
                leftovers = [
                    p for b in self._pending for p, a in zip(b.params, b.arrived) if a
                ]
                leftovers += [p for p in self.held if p.grad is not None]
                if leftovers:
                    self._step(optimizer, list(dict.fromkeys(leftovers)))
                self.held.clear()
        finally:
            self.last_backward_steps = self._steps
            self._reset()

    def _reset(self) -> None:
        for bucket in self._pending:
            bucket.reset()
        self._pending.clear()
        self._active_task = -2

    # -- stepping ---------------------------------------------------------
    def _step(self, optimizer: InBackwardOptimizer, params: list[Tensor]) -> None:
        self._prepare_grads(params)
        optimizer._step_params(params)
        for p in params:
            p.grad = None
            self.held.pop(p, None)
        self._steps += len(params)

    def _prepare_grads(self, params: list[Tensor]) -> None:
        """Unscale, then clip (global coefficient, by value, per bucket) in place."""
        if self.transform is not None:
            inv_scale, coef = self.transform
            grads = [p.grad for p in params]
            if inv_scale is not None:
                for device_grads in _by_device_dtype(grads):
                    found = torch.zeros((), device=device_grads[0].device)
                    torch._amp_foreach_non_finite_check_and_unscale_(
                        device_grads, found, inv_scale.to(device_grads[0].device)
                    )
            if coef is not None:
                for device_grads in _by_device_dtype(grads):
                    torch._foreach_mul_(device_grads, coef.to(device_grads[0].device))
        if self.clip_value is not None:
            torch.nn.utils.clip_grad_value_(params, self.clip_value)
        if self.bucket_max_norm is not None:
            torch.nn.utils.clip_grad_norm_(params, self.bucket_max_norm, self.norm_type)

    # -- layeropt.backward's measure pass ------------------------------------
    def start_measure(
        self,
        measured: dict[Tensor, Tensor],
        norm_type: float | None,
        inv_scale: Tensor | None,
        found_inf: Tensor | None,
    ) -> None:
        self.measure = _Measure(measured, norm_type, inv_scale, found_inf)
        for p in self.held:  # set accumulated gradients aside; restored afterwards
            if p.grad is not None:
                self.measure.stash[p] = p.grad
                p.grad = None

    def finish_measure(self) -> None:
        m = self.measure
        if m is None:
            return
        for p, held in m.stash.items():
            if id(p) not in m.seen:  # no gradient this pass: measure the held one
                m.reduce(p, held.clone())
            p.grad = held

    def discard_held(self) -> None:
        for p in self.held:
            p.grad = None
        self.held.clear()

    def flush_leftovers(self) -> None:
        """Step and free every gradient the hooks did not consume (``step()``)."""
        optimizer = self._optimizer()
        if optimizer is None:
            return
        params = [
            p for g in optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        if params:
            self._step(optimizer, params)
        self.held.clear()

    def on_param_groups_changed(self) -> None:
        for attachment in list(self.attachments):
            attachment._rebuild()


def _by_device_dtype(tensors: list[Tensor]) -> list[list[Tensor]]:
    groups: dict[tuple[Any, Any], list[Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.device, t.dtype), []).append(t)
    return list(groups.values())


class _Measure:
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
        self.seen: set[int] = set()

    def take(self, param: Tensor) -> None:
        grad = param.grad
        param.grad = None
        held = self.stash.get(param)
        # AccumulateGrad would compute held + grad; addition commutes bitwise.
        self.reduce(param, grad if held is None else held + grad)
        self.seen.add(id(param))

    def reduce(self, param: Tensor, grad: Tensor) -> None:
        if self.inv_scale is not None and self.found_inf is not None:
            torch._amp_foreach_non_finite_check_and_unscale_(
                [grad], self.found_inf, self.inv_scale.to(grad.device)
            )
        if self.norm_type is not None:
            self.measured[param] = _norm(grad, self.norm_type)


def _norm(grad: Tensor, norm_type: float) -> Tensor:
    """The per-tensor norm exactly as torch.nn.utils.clip_grad_norm_ computes it."""
    from torch.utils._foreach_utils import _has_foreach_support

    if _has_foreach_support([grad], grad.device):
        return torch._foreach_norm([grad], norm_type)[0]
    return torch.linalg.vector_norm(grad, norm_type)
