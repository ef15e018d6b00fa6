"""torch's pipeline schedules (``torch.distributed.pipelining``) with attached optimizers.

A schedule's ``step()`` runs every micro-batch's forward and backward on this rank's
stages and sums their gradients (scaled by the number of micro-batches, reduced over a
data-parallel wrapper at the last one); the loop then steps once. An attached backward
steps at once, so the first micro-batch's backward would update the parameters the next
ones' graphs saved (GPipe: torch's in-place error) or each micro-batch would be its own
step (1F1B: refused at ``step()``, after the updates).

Inside a schedule's ``step()`` every attached optimizer holds its gradients for
``optimizer.step()`` (its ``no_step()``), as torch.optim keeps them: parameters and state
equal torch.optim's, bit for bit (``tests/test_pipelining.py``: GPipe, 1F1B, interleaved,
looped-BFS, zero-bubble and DualPipeV schedules; stages under FSDP2, whose reduction
after the last backward lands outside any backward and is held the same way), and no
gradient is freed during those backwards. :data:`~layeropt.checking.watch.WATCHERS`
wraps the schedules' ``step`` methods while an attachment lives, once
``torch.distributed.pipelining`` is imported.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any

from ..engine.registry import ENGINES
from ..errors import warn

__all__ = ["watch_schedules", "PIPELINE_HOLD_WARNING"]

PIPELINE_HOLD_WARNING = (
    "a pipeline schedule's step() sums its micro-batches' gradients before the optimizer "
    "steps: layeropt holds them for optimizer.step() inside it, as torch.optim does. The "
    "results equal torch.optim's; no gradient memory is saved during these backwards."
)


def watch_schedules(replace: Callable[[Any, str, Callable[[Any], Any]], None],
                    module: Any) -> bool:
    """``replace`` (``Watchers._replace``) the ``step`` of every schedule class
    ``module`` (``torch.distributed.pipelining.schedules``) defines with one that holds
    the attached optimizers' gradients while it runs. Returns whether it found them."""
    base = getattr(module, "_PipelineSchedule", None)
    for cls in list(vars(module).values()) if base else ():
        if isinstance(cls, type) and issubclass(cls, base) and "step" in cls.__dict__:
            replace(cls, "step", _held_step)
    return bool(base)


def _held_step(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def step(self: Any, *args: Any, **kwargs: Any) -> Any:
        held = [e for e in list(ENGINES) if e.attachments]  # (each optimizer's no_step())
        if held:
            warn(PIPELINE_HOLD_WARNING)
        with contextlib.ExitStack() as stack:
            for engine in held:
                stack.enter_context(engine.no_step())
            return original(self, *args, **kwargs)

    return step
