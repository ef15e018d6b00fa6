"""Share a plan's configurations between forked worker processes.

A fake training step is pure Python work: one process uses one core. Each
worker forks from the planning process (the workload's functions need no
pickling), builds its own fake model, measures its share of the
configurations and sends back the measurements. The numbers do not depend on
the sharing: every measurement is of its own steady-state step.
"""

from __future__ import annotations

import multiprocessing
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any

from .workloads import PlanError

__all__ = ["can_fork", "run_sharded"]


def can_fork() -> bool:
    """Whether workers can be forked here (Linux)."""
    return sys.platform.startswith("linux") and "fork" in multiprocessing.get_all_start_methods()


def _cost(unit: list[Any]) -> float:
    """Forward-and-backward runs a unit takes (an optimizer step is a fifth of one)."""
    if unit[0].in_backward:
        return 2.0 if "bitsandbytes" in unit[0].optimizer else 1.0
    return 1.0 + 0.2 * len(unit)


def _shards(units: list[list[Any]], jobs: int) -> list[list[Any]]:
    """Longest first onto the least loaded shard."""
    shards: list[list[Any]] = [[] for _ in range(jobs)]
    load = [0.0] * jobs
    for unit in sorted(units, key=_cost, reverse=True):
        i = load.index(min(load))
        shards[i] += unit
        load[i] += _cost(unit)
    return [s for s in shards if s]


def _worker(simulate: Callable[..., Any], workload: Any, variants: list[Any], queue: Any,
            options: dict[str, Any]) -> None:  # fmt: skip
    try:
        result = simulate(
            workload, variants, jobs=1, progress=lambda i, n, v: queue.put(("tick", v)),
            **options,
        )  # fmt: skip
        queue.put(("done", result))
    except BaseException as e:  # sent to the parent, raised there
        try:
            pickle.dumps(e)
            queue.put(("error", e))
        except Exception:
            text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            queue.put(("error", PlanError(text)))


def run_sharded(
    simulate: Callable[..., Any],
    workload: Any,
    variants: list[Any],
    units: list[list[Any]],
    jobs: int,
    progress: Callable[[int, int, Any], None] | None,
    options: dict[str, Any],
) -> tuple[int, list[Any]]:
    """Run ``simulate`` on ``jobs`` forked workers; the measurements in ``variants``' order.

    Raises:
        Whatever a worker raised (a :class:`PlanError` with its traceback
        when the exception cannot be sent).
    """
    ctx = multiprocessing.get_context("fork")
    queue = ctx.SimpleQueue()
    shards = _shards(units, jobs)
    workers = [
        ctx.Process(target=_worker, args=(simulate, workload, shard, queue, options), daemon=True)
        for shard in shards
    ]
    for w in workers:
        w.start()
    results: dict[Any, Any] = {}
    n_params, done, ticks, error = 0, 0, 0, None
    try:
        while done < len(workers):
            kind, payload = queue.get()
            if kind == "tick":
                if progress is not None:
                    progress(ticks, len(variants), payload)
                ticks += 1
            elif kind == "done":
                n_params = payload[0]
                results.update((m.variant, m) for m in payload[1])
                done += 1
            else:
                error = error or payload
                done += 1
    finally:
        for w in workers:
            w.join(timeout=5)
            if w.is_alive():
                w.terminate()
    if error is not None:
        raise error
    return n_params, [results[v] for v in variants]
