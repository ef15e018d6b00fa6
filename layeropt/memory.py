"""Measure the memory of a training step, in bytes.

On CPU, torch has no allocator statistics, so :class:`PeakMemory` replays the
profiler's allocation events (``profile_memory=True``): every allocation and
free of tensor storage, in order. The result is exact and deterministic: the
live tensor bytes at the peak, relative to the start of the block. On CUDA it
reads the caching allocator's ``max_memory_allocated``.

Example:
    >>> import torch
    >>> with PeakMemory() as mem:
    ...     x = torch.empty(1024, dtype=torch.float32)
    ...     del x
    >>> mem.peak
    4096
"""

from __future__ import annotations

import contextlib
import gc
import os
import warnings
from typing import Any

import torch

__all__ = ["PeakMemory", "peak_bytes", "format_bytes"]


class PeakMemory:
    """Context manager recording peak allocated bytes above the starting level.

    Args:
        device: ``"cpu"`` (profiler events) or a CUDA device (allocator stats).

    Attributes:
        peak: the highest number of bytes allocated inside the block and live
            at the same time, on top of what was live when it started.
        end: bytes allocated in the block still live at its end (may be
            negative when the block freed tensors that existed before it).

    Python's cyclic garbage collector is paused inside the block, so the
    reading does not depend on when it happens to run: tensors kept by
    reference cycles made in the block count until the block ends.
    """

    def __init__(self, device: str | torch.device = "cpu") -> None:
        self.device = torch.device(device)
        self.peak = 0
        self.end = 0
        self._prof: Any = None
        self._start = 0
        self._gc_was_enabled = True

    def __enter__(self) -> PeakMemory:
        self._gc_was_enabled = _pause_gc()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self._start = torch.cuda.memory_allocated(self.device)
        else:
            from torch.profiler import ProfilerActivity, profile

            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            with _muted():
                self._prof.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self._read(*exc)
        finally:
            _resume_gc(self._gc_was_enabled)

    def _read(self, *exc: object) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            self.peak = torch.cuda.max_memory_allocated(self.device) - self._start
            self.end = torch.cuda.memory_allocated(self.device) - self._start
            return
        with _muted():
            self._prof.__exit__(*exc)
        events = [
            (e.start_ns(), e.nbytes())
            for e in self._prof.profiler.kineto_results.events()
            if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU
        ]
        events.sort(key=lambda t: t[0])
        current = peak = 0
        for _, nbytes in events:
            current += nbytes
            peak = max(peak, current)
        self.peak, self.end = peak, current
        self._prof = None


def peak_bytes(fn: Any, *args: Any, device: str | torch.device = "cpu", **kwargs: Any) -> int:
    """Peak bytes allocated (above the starting level) while calling ``fn``."""
    with PeakMemory(device) as mem:
        fn(*args, **kwargs)
    return mem.peak


def format_bytes(n: float) -> str:
    """``1536`` -> ``'1.5 KiB'``."""
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"  # pragma: no cover


def _pause_gc() -> bool:
    """Pause Python's cyclic collector (readings must not depend on when it runs)."""
    was_enabled = gc.isenabled()
    gc.disable()
    return was_enabled


def _resume_gc(was_enabled: bool) -> None:
    if was_enabled:
        gc.enable()


@contextlib.contextmanager
def _muted() -> Any:
    """Silence warnings and the profiler's native start/stop lines on fd 2."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            saved = os.dup(2)
        except OSError:  # pragma: no cover - no fd 2
            yield
            return
        try:
            with open(os.devnull, "w") as devnull:
                os.dup2(devnull.fileno(), 2)
                yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
