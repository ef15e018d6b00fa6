"""Nested backwards and pinned parameters: what keeps checkpointing exact.

Rule 5 of ``layeropt/engine/landing.py`` in detail. Three situations make a
parameter's hook fire before its gradient (or its use) is complete:

* a non-reentrant ``layeropt.checkpoint`` segment will *recompute* with the
  weight later in this backward: the segment's parameters are pinned
  (:class:`Pin`) until the recompute ran, and a gradient that lands while
  pinned waits (``BackwardRecord.gated``);
* ``torch.utils.checkpoint(use_reentrant=True)`` runs a nested backward per
  segment: its segments are watched from forward on, and a backward that will
  run one defers every step to its end;
* any other backward nested in an autograd Function's backward cannot be made
  exact and raises ``BackwardStateError`` (``errors.NESTED_ERROR``).
"""

from __future__ import annotations

import functools
import sys
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .registry import ENGINES

__all__ = ["Pin", "checkpoint_function", "segment_watcher"]

_graph_task_id = getattr(torch._C, "_current_graph_task_id", lambda: -1)


@functools.cache
def _dynamo_switches() -> tuple[Callable[[Any], Any], Callable[[Any], None]]:
    """dynamo's frame-evaluation switch and code skipper (imported at first attach).

    What the engine runs - hooks, the end of a backward (:class:`TaskEnd`), the
    optimizer's ``step()`` - runs eagerly, with frame evaluation off: a compiled
    function that calls ``backward()`` leaves dynamo's callback set, and torch's
    step traced there computes otherwise (Adam's step count as a tensor)."""
    try:
        from torch._dynamo import eval_frame
    except ImportError:  # pragma: no cover - a torch build without dynamo: nothing to hide from
        return (lambda callback: None), (lambda code: None)
    set_eval_frame = getattr(eval_frame, "set_eval_frame", None)
    if set_eval_frame is None:  # torch 2.5 keeps it in the C module only
        from torch._C._dynamo.eval_frame import set_eval_frame
    skip_code = functools.cache(eval_frame.skip_code)
    skip_code(TaskEnd.__call__.__code__)
    return set_eval_frame, skip_code


class TaskEnd:
    """A callback queued in autograd's running graph task (``queue_callback``).

    ``end()`` runs when the task ends. If the backward raises, autograd drops
    the task with the callback uncalled, and releasing it runs ``dropped()``.
    ``last``: when first called, it queues itself once more, so ``end()`` runs
    after the callbacks queued since it was (autograd runs callbacks queued by
    callbacks after those already queued).
    """

    __slots__ = ("end", "dropped", "called", "last")

    def __init__(self, end: Any, dropped: Any, last: bool = False) -> None:
        self.end, self.dropped, self.called, self.last = end, dropped, False, last

    def __call__(self) -> None:
        if self.last:
            self.last = False
            torch.autograd.Variable._execution_engine.queue_callback(self)
            return
        self.called = True
        set_eval_frame = _dynamo_switches()[0]
        prior = set_eval_frame(None)  # (eagerly, as the hooks: _dynamo_switches)
        try:
            self.end()
        finally:
            set_eval_frame(prior)

    def __del__(self) -> None:
        if not self.called:
            self.dropped()


# Segments of torch.utils.checkpoint(use_reentrant=True) recorded with grad and
# still alive (their autograd nodes), and how many run their nested backward now.
_TORCH_SEGMENTS: weakref.WeakSet[Any] = weakref.WeakSet()
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


def pinned(param: Tensor) -> bool:
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
    for engine in list(ENGINES):
        engine.pins_released()


def checkpoint_function() -> Any:
    """torch's reentrant ``CheckpointFunction`` (``None`` where a torch has none)."""
    from torch.utils import checkpoint as tc

    return getattr(tc, "CheckpointFunction", None)


def segment_watcher(original: Any) -> Any:
    """``CheckpointFunction.forward`` watched (rule 5; installed by ``_watch.WATCHERS``):
    after torch's own forward, the segment's autograd node is recorded and gets a
    pre-hook and a hook around its nested backward. Nothing else changes."""

    def forward(ctx: Any, *args: Any) -> Any:
        out = original(ctx, *args)
        _TORCH_SEGMENTS.add(ctx)
        ctx.register_prehook(_segment_enter)
        ctx.register_hook(_segment_exit)
        return out

    return forward


# How many torch reentrant segments run their nested backward right now.
segment_depth = [0]


def _segment_enter(grad_outputs: Any) -> None:
    segment_depth[0] += 1
    task = _graph_task_id()
    for engine in list(ENGINES):
        engine.enter_torch_segment(task)


def _segment_exit(grad_inputs: Any, grad_outputs: Any) -> None:
    segment_depth[0] = max(0, segment_depth[0] - 1)


def outside_segments() -> None:
    """A backward began (or ended) outside every torch reentrant segment: none runs."""
    segment_depth[0] = 0


_FUNCTION_BACKWARD_CODES = {
    getattr(torch.autograd.function.BackwardCFunction, name).__code__
    for name in ("apply", "apply_boxed")
    if hasattr(torch.autograd.function.BackwardCFunction, name)
}


_UNSET = object()


def nested_in_function_backward() -> bool:
    """Whether this hook runs in a backward started by an autograd Function's backward."""
    node: Any = _UNSET  # looked up only when a Function's backward is on the stack
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code in _FUNCTION_BACKWARD_CODES:
            if node is _UNSET:
                node = torch._C._current_autograd_node()
            if frame.f_locals.get("self") is not node:
                return True
        frame = frame.f_back
    return False


