"""Share a plan's configurations between forked worker processes.

A fake training step is pure Python work: one process uses one core. Each
worker forks from the planning process (the workload's functions need no
pickling), builds its own fake model, measures its share of the
configurations and sends back the measurements. The numbers do not depend on
the sharing: every measurement is of its own steady-state step.

A fork copies one thread: a lock another thread held stays held in the child
for good. So workers are forked only from a process with no other Python
thread and no CUDA context (a notebook's kernel, a test runner's worker, a
process that trained on the GPU: the rows run in the process instead), each
child runs torch on one thread (as DataLoader's workers do: a parent's OpenMP
pool is not there), and a worker that dies without a word is an error rather
than a wait.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import pickle
import sys
import traceback
from collections.abc import Callable
from typing import Any

import torch

from .workloads import PlanError

__all__ = ["can_fork", "run_sharded"]


def can_fork() -> bool:
    """Whether workers can be forked here: Linux, this the process's one Python thread
    (threads started with ``_thread`` too: :func:`sys._current_frames` has them all), and
    CUDA not initialized (a forked child cannot use it)."""
    return (sys.platform.startswith("linux")
            and "fork" in multiprocessing.get_all_start_methods()
            and len(sys._current_frames()) == 1
            and not torch.cuda.is_initialized())


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


def _worker(simulate: Callable[..., Any], workload: Any, variants: list[Any], conn: Any,
            options: dict[str, Any]) -> None:  # fmt: skip
    torch.set_num_threads(1)  # (the parent's OpenMP pool did not come with the fork)
    try:
        result = simulate(
            workload, variants, jobs=1, progress=lambda i, n, v: conn.send(("tick", v)),
            **options,
        )  # fmt: skip
        conn.send(("done", result))
    except BaseException as e:  # sent to the parent, raised there
        try:
            pickle.dumps(e)
            conn.send(("error", e))
        except Exception:
            text = "".join(traceback.format_exception(type(e), e, e.__traceback__))
            conn.send(("error", PlanError(text)))


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
        when the exception cannot be sent); a :class:`PlanError` for a worker
        that ended without its measurements (killed, out of memory).
    """
    ctx = multiprocessing.get_context("fork")
    workers = []  # (a worker's pipe, the worker)
    for shard in _shards(units, jobs):
        reader, writer = ctx.Pipe(duplex=False)
        w = ctx.Process(target=_worker, args=(simulate, workload, shard, writer, options),
                        daemon=True)  # fmt: skip
        w.start()
        writer.close()  # (the child's copy stays open: a dead child reads as end of file)
        workers.append((reader, w))
    pending = dict(workers)  # until each answers "done" or "error"
    results: dict[Any, Any] = {}
    n_params, ticks, error = 0, 0, None
    try:
        while pending:
            for reader in multiprocessing.connection.wait(list(pending)):
                try:
                    kind, payload = reader.recv()
                except EOFError:  # it ended without "done" or "error"
                    w = pending[reader]
                    w.join(timeout=5)
                    kind, payload = "error", PlanError(
                        f"a plan worker process ended without its measurements (exit code "
                        f"{w.exitcode}: killed, or out of memory?); rerun with --jobs 1 "
                        "(plan(jobs=1)) to measure in one process"
                    )
                if kind == "tick":
                    if progress is not None:
                        progress(ticks, len(variants), payload)
                    ticks += 1
                    continue
                del pending[reader]
                if kind == "done":
                    n_params = payload[0]
                    results.update((m.variant, m) for m in payload[1])
                else:
                    error = error or payload
    finally:
        for reader, w in workers:
            w.join(timeout=5 if reader not in pending else 0)
            if w.is_alive():
                w.terminate()
                w.join()
            reader.close()
    if error is not None:
        raise error
    return n_params, [results[v] for v in variants]
