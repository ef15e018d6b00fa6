"""What is alive on a CUDA device at its peak, from the caching allocator's own trace.

``torch.cuda.memory._record_memory_history()`` makes the allocator log every
allocation and free with the Python stack that made it;
``torch.cuda.memory._snapshot()`` returns that log (``device_traces``). This
replays the log from the bytes allocated when recording began, finds the moment
the allocated bytes peak, and groups the blocks alive then - those allocated
while recording - by where they were made: the innermost frame outside torch's
own files (a line of transformers' model, of layeropt, of the training script)
and the torch function under it. What was allocated before recording began (the
parameters, the optimizer state) is one line, ``before recording``.

It answers what ``layeropt plan``'s replay cannot see: memory the CUDA kernels
take for themselves, and what a run holds outside its steps
(docs/plan.md#limits). ``benchmarks/offload_7b.py --memory-trace PATH`` records
the second step of one mode and writes this summary (``device_check.sh``: the
synchronous mode of the Llama-2-7B-shaped run).

    from memory_peak import record, summarize
    with record() as trace:        # CUDA only
        train_step()
    print(summarize(trace.snapshot, trace.baseline))
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from typing import Any

MiB = 2**20


@dataclasses.dataclass
class Trace:
    """What :func:`record` leaves: the snapshot taken at its end, the bytes allocated
    when recording began."""

    baseline: int = 0
    snapshot: dict[str, Any] = dataclasses.field(default_factory=dict)


@contextlib.contextmanager
def record(device: Any = None, max_entries: int = 1_000_000) -> Iterator[Trace]:
    """Record the caching allocator's actions inside (Python stacks of each allocation);
    the trace's ``snapshot`` and ``baseline`` are set on leaving."""
    import torch

    trace = Trace(baseline=torch.cuda.memory_allocated(device))
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    try:
        yield trace
    finally:
        trace.snapshot = torch.cuda.memory._snapshot(device)
        torch.cuda.memory._record_memory_history(enabled=None)


def _where(frames: list[dict[str, Any]]) -> str:
    """``"name (file:line) <- torch_function"``: the innermost frame outside torch's own
    files (frames come innermost first) and the innermost torch one under it."""
    inner = next((f for f in frames if "/torch/" in f.get("filename", "")), None)
    outer = next((f for f in frames if "/torch/" not in f.get("filename", "")), None)
    if outer is None:
        return "(no Python frame)" if inner is None else f"torch: {inner.get('name', '?')}"
    name = outer["filename"].rsplit("/", 2)
    place = f"{outer.get('name', '?')} ({'/'.join(name[-2:])}:{outer.get('line', 0)})"
    return place + (f" <- {inner.get('name', '?')}" if inner is not None else "")


def peak(snapshot: dict[str, Any], baseline: int = 0,
         device: int = 0) -> tuple[int, int, dict[int, tuple[int, str]]]:
    """Replay ``snapshot['device_traces'][device]``: ``(peak allocated bytes, index of the
    trace entry that reached it, {address: (size, where) of the blocks alive then that
    were allocated while recording})``. A free of a block allocated before recording
    lowers the count by its size (its address is unknown to the replay)."""
    traces = snapshot.get("device_traces") or [[]]
    entries = traces[device] if device < len(traces) else []
    live: dict[int, tuple[int, str]] = {}
    now = top = baseline
    at, kept = -1, {}
    for i, e in enumerate(entries):
        action = e.get("action")
        if action == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
            now += e["size"]
            if now > top:
                top, at, kept = now, i, None  # (the live set taken once it stops growing)
        elif action == "free_requested":
            if kept is None:
                kept = dict(live)
            live.pop(e["addr"], None)
            now -= e["size"]
    if kept is None:
        kept = dict(live)
    return top, at, kept


def summarize(snapshot: dict[str, Any], baseline: int = 0, device: int = 0,
              top: int = 25) -> str:
    """The peak and what is alive at it, grouped by where it was allocated, largest
    first (``top`` groups, the rest summed), in MiB."""
    most, at, alive = peak(snapshot, baseline, device)
    groups: dict[str, list[int]] = {}
    for size, where in alive.values():
        g = groups.setdefault(where, [0, 0])
        g[0] += size
        g[1] += 1
    traced = sum(s for s, _ in alive.values())
    lines = [f"peak allocated {most / MiB:,.1f} MiB (trace entry {at}): "
             f"{baseline / MiB:,.1f} MiB before recording, {traced / MiB:,.1f} MiB in "
             f"{len(alive)} blocks allocated while recording"
             + ("" if most == baseline + traced else
                f" (and {(baseline + traced - most) / MiB:,.1f} MiB of the earlier blocks "
                "freed since)"),
             f"{'MiB':>10} {'blocks':>6}  allocated at"]
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    for where, (size, n) in ranked[:top]:
        lines.append(f"{size / MiB:>10,.1f} {n:>6}  {where}")
    rest = ranked[top:]
    if rest:
        lines.append(f"{sum(g[0] for _, g in rest) / MiB:>10,.1f} "
                     f"{sum(g[1] for _, g in rest):>6}  ({len(rest)} more places)")
    return "\n".join(lines)
