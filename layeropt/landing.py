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
   together, and freed;
5. activation checkpointing (``layeropt/checkpoint.py``) keeps this exact:

   * ``layeropt.checkpoint(..., use_reentrant=True)`` makes every parameter a
     segment reads an input of the segment's autograd node, so autograd itself
     fires each hook once, after the recomputation: nothing changes here;
   * a parameter that a non-reentrant ``layeropt.checkpoint`` segment read in
     forward is *pinned* until this backward has recomputed the segment: a
     gradient that lands while pinned waits, and enters rule 3 when the pin
     is released (so no recomputation sees an updated weight);
   * ``torch.utils.checkpoint(..., use_reentrant=True)`` runs a nested
     backward per segment, in which shared parameters land once per segment
     with partial gradients. Its segments are watched from forward on; a
     backward that will run one *defers*: every gradient is held and all are
     stepped together when the outermost backward ends (exact, but without
     the memory saving; a warning says so);
   * any other backward nested inside an autograd Function's backward raises
     :class:`BackwardStateError`.

If a backward raises, autograd drops it; its end callback is then finalized
without running, and the partial gradients it left (arrived but not
stepped) are freed and the bookkeeping reset, before the exception reaches
the caller. Gradients held by ``no_step()`` are kept.

Parameters that receive no gradient are never stepped, as in torch.
"""

from __future__ import annotations

import sys
import warnings
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from .errors import AttachError, BackwardStateError, LayeroptError

if TYPE_CHECKING:
    from .optim import InBackwardOptimizer

__all__ = ["Bucket", "Engine", "Pin"]

_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


def _queue_callback(fn: Any) -> None:
    torch.autograd.Variable._execution_engine.queue_callback(fn)


_IDLE = -2  # no backward in progress
_ENGINES: weakref.WeakSet[Engine] = weakref.WeakSet()
# Segments of torch.utils.checkpoint(use_reentrant=True) recorded with grad and
# still alive (their autograd nodes), and how many run their nested backward now.
_TORCH_SEGMENTS: weakref.WeakSet[Any] = weakref.WeakSet()
_segment_depth = 0
# parameter -> for each live pin on it, the graph tasks that recomputed its segment
_PINS: dict[Tensor, list[set[int]]] = {}


class Pin:
    """Holds the gradients of ``params`` back until :meth:`release` (rule 5).

    Created by a non-reentrant ``layeropt.checkpoint`` segment in forward and
    released by each backward that recomputes it; dropped with its graph.
    """

    def __init__(self, params: list[Tensor]) -> None:
        params = list(dict.fromkeys(params))
        self._done: set[int] = set()  # graph tasks that recomputed the segment
        for p in params:
            _PINS.setdefault(p, []).append(self._done)
        weakref.finalize(self, _unpin, params, self._done).atexit = False

    def release(self) -> None:
        """The running backward recomputed the segment: gradients waiting for it go on."""
        self._done.add(_graph_task_id())
        _ungate_all()


def _pinned(param: Tensor) -> bool:
    """Whether a segment reading ``param`` is still to be recomputed in this backward."""
    task = _graph_task_id()
    return any(task not in done for done in _PINS.get(param, ()))


def _unpin(params: list[Tensor], done: set[int]) -> None:
    for p in params:
        left = [d for d in _PINS.get(p, ()) if d is not done]
        if left:
            _PINS[p] = left
        else:
            _PINS.pop(p, None)
    _ungate_all()


def _ungate_all() -> None:
    for engine in list(_ENGINES):
        if engine._gated:
            engine._ungate()


def watch_torch_checkpoint() -> None:
    """Watch ``torch.utils.checkpoint``'s reentrant segments (rule 5).

    Wraps ``CheckpointFunction.forward`` once per process: after torch's own
    forward, the segment's autograd node is recorded and gets a pre-hook and a
    hook around its nested backward. Nothing else changes.
    """
    from torch.utils import checkpoint as tc

    cls = getattr(tc, "CheckpointFunction", None)
    if cls is None or getattr(cls.forward, "_layeropt_watch", False):
        return
    original = cls.forward

    def forward(ctx: Any, *args: Any) -> Any:
        out = original(ctx, *args)
        _TORCH_SEGMENTS.add(ctx)
        ctx.register_prehook(_segment_enter)
        ctx.register_hook(_segment_exit)
        return out

    forward._layeropt_watch = True  # type: ignore[attr-defined]
    cls.forward = staticmethod(forward)


def _segment_enter(grad_outputs: Any) -> None:
    global _segment_depth
    _segment_depth += 1
    task = _graph_task_id()
    for engine in list(_ENGINES):
        engine._enter_torch_segment(task)


def _segment_exit(grad_inputs: Any, grad_outputs: Any) -> None:
    global _segment_depth
    _segment_depth = max(0, _segment_depth - 1)


_FUNCTION_BACKWARD_CODES = {
    getattr(torch.autograd.function.BackwardCFunction, name).__code__
    for name in ("apply", "apply_boxed")
    if hasattr(torch.autograd.function.BackwardCFunction, name)
}


def _nested_in_function_backward() -> bool:
    """Whether this hook runs in a backward started by an autograd Function's backward."""
    node = torch._C._current_autograd_node()
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _FUNCTION_BACKWARD_CODES and frame.f_locals.get("self") is not node:
            return True
        frame = frame.f_back
    return False


_NESTED_ERROR = (
    "a gradient landed in a backward nested inside the backward of an autograd "
    "Function (a reentrant activation checkpoint other than torch's, e.g. DeepSpeed's "
    "or a custom one), so parameters would be stepped on partial gradients. Use "
    "layeropt.checkpoint(fn, *args) (either mode) or torch.utils.checkpoint.checkpoint("
    "fn, *args, use_reentrant=False) instead."
)
_DEFER_WARNING = (
    "torch.utils.checkpoint(..., use_reentrant=True) runs a nested backward per "
    "segment; to stay exact, layeropt holds every gradient of this backward and steps "
    "them all when it ends, so in-backward updates save no memory here. Use "
    "layeropt.checkpoint(fn, *args) or use_reentrant=False (Hugging Face: "
    "gradient_checkpointing_enable(gradient_checkpointing_kwargs={'use_reentrant': "
    "False})) to update layers during backward again."
)


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
        self._active_task = _IDLE  # autograd graph task of the backward in progress
        self._serial = 0  # counts attached backwards
        self._steps = 0
        self.last_backward_steps = 0
        self.stepped: list[Tensor] = []  # parameters updated in the latest backward
        # Clipping / scaling (set by attach(...) and layeropt.backward).
        self.max_grad_norm: float | None = None
        self.norm_type = 2.0
        self.clip_value: float | None = None
        self.bucket_max_norm: float | None = None
        self.entered = False  # inside layeropt.backward
        self.measure: _Measure | None = None  # the measure pass of layeropt.backward
        self.transform: tuple[Tensor | None, Tensor | None] | None = None  # (inv_scale, coef)
        # Checkpointing (rule 5): gradients waiting for a pin, or deferred to the end.
        self._gated: dict[Tensor, tuple[Bucket, int]] = {}
        self._defer = False
        self._deferred: dict[Tensor, None] = {}
        _ENGINES.add(self)
        watch_torch_checkpoint()

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
        if task != self._active_task:
            self._enter(task, param)
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
            if self._defer:
                self._deferred[param] = None
            else:
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
        if self._defer:
            self._deferred[param] = None
            return
        if _PINS and _pinned(param):
            self._gated[param] = (bucket, index)
            return
        self._arrive(optimizer, bucket, index, param)

    def _arrive(
        self, optimizer: InBackwardOptimizer, bucket: Bucket, index: int, param: Tensor
    ) -> None:
        if bucket.arrived[index] or bucket.stepped_serial == self._serial:
            param.grad = None  # a partial gradient: drop it, as an aborted backward would
            raise BackwardStateError(
                f"a parameter of {bucket.name!r} received a second gradient in the "
                "same backward pass, so it would be stepped on a partial gradient (a "
                "custom autograd Function or hook that delivers it twice?). For "
                "activation checkpointing use layeropt.checkpoint(fn, *args)."
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
    def _enter(self, task: int, param: Tensor) -> None:
        """A gradient landed in a graph task other than the active backward's."""
        if self._active_task != _IDLE and _segment_depth:
            return  # the nested backward of a torch reentrant segment (deferring)
        if _nested_in_function_backward():
            if param not in self.held:
                param.grad = None  # a partial gradient: drop it (the abort drops the rest)
            raise BackwardStateError(_NESTED_ERROR)
        if self._active_task != _IDLE:
            self._abort()  # the previous backward died without being finalized
        self._begin(task)

    def _enter_torch_segment(self, task: int) -> None:
        """A torch reentrant segment is about to run its nested backward (rule 5)."""
        if self.hook_count and self._active_task == _IDLE:
            self._begin(task, defer=True)
        elif self._active_task != _IDLE and not self._defer:
            self._defer = True  # a segment recorded during this backward
            warnings.warn(_DEFER_WARNING, stacklevel=2)

    def _begin(self, task: int, defer: bool = False) -> None:
        global _segment_depth
        if not defer:
            _segment_depth = 0  # a first hook outside any segment: nothing is nested
        self._active_task = task
        self._serial += 1
        self._steps = 0
        self.stepped = []
        will_run = torch._C._will_engine_execute_node
        self._defer = defer or any(will_run(n) for n in list(_TORCH_SEGMENTS))
        if self._defer:
            warnings.warn(_DEFER_WARNING, stacklevel=3)
        # The end callback lives in autograd's graph task. If the backward raises,
        # the task is dropped with the callback uncalled: its finalizer aborts.
        called = [False]

        def end() -> None:
            called[0] = True
            self._end()

        weakref.finalize(end, self._dropped, called, self._serial).atexit = False
        _queue_callback(end)

    def _dropped(self, called: list[bool], serial: int) -> None:
        if not called[0] and serial == self._serial and self._active_task != _IDLE:
            self._abort()

    def _end(self) -> None:
        optimizer = self._optimizer()
        try:
            if optimizer is None:
                pass
            elif self.measure is not None:
                for p in self._deferred:
                    if p.grad is not None:
                        self.measure.take(p)
            elif not self.no_step_depth:
                leftovers = [
                    p for b in self._pending for p, a in zip(b.params, b.arrived) if a
                ]
                leftovers += list(self._gated) + list(self._deferred)
                leftovers += [p for p in self.held if p.grad is not None]
                leftovers = [p for p in leftovers if p.grad is not None]
                if leftovers:
                    self._step(optimizer, list(dict.fromkeys(leftovers)))
                self.held.clear()
        finally:
            self.last_backward_steps = self._steps
            self._reset()

    def _abort(self) -> None:
        """The backward raised: free the partial gradients it left, keep no_step()'s."""
        global _segment_depth
        partial = [p for b in self._pending for p, a in zip(b.params, b.arrived) if a]
        for p in partial + list(self._gated) + list(self._deferred):
            if p not in self.held:
                p.grad = None
        _segment_depth = 0
        self.last_backward_steps = self._steps
        self._reset()

    def _reset(self) -> None:
        for bucket in self._pending:
            bucket.reset()
        self._pending.clear()
        self._gated.clear()
        self._deferred.clear()
        self._defer = False
        self._active_task = _IDLE

    def _ungate(self) -> None:
        """Pins were released: gradients no longer pinned enter rule 3."""
        optimizer = self._optimizer()
        for p in [p for p in self._gated if not _pinned(p)]:
            bucket, index = self._gated.pop(p)
            if optimizer is not None and p.grad is not None:
                self._arrive(optimizer, bucket, index, p)

    # -- stepping ---------------------------------------------------------
    def _step(self, optimizer: InBackwardOptimizer, params: list[Tensor]) -> None:
        self._prepare_grads(params)
        optimizer._step_params(params)
        for p in params:
            p.grad = None
            self.held.pop(p, None)
        self._steps += len(params)
        self.stepped.extend(params)

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
