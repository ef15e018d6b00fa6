"""Where offload's copies run and what they wait for: CUDA streams and events, in one place.

Every copy offload makes between host and device memory, and every wait
that orders one, goes through these functions. On CUDA they are torch's
streams and events; on another device copies are synchronous
(:func:`asynchronous` is ``False``) and no stream is made.

``tests/streamsim.py`` swaps them for a simulation on the CPU in which every
copy is asynchronous, and checks that each read and write of a tensor is
ordered after the writes and reads it depends on (vector clocks over the
streams and the host). That is how the copy pipeline's order is tested
without a GPU.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import Tensor

__all__ = ["asynchronous", "current", "new_stream", "on", "new_event", "keep_for", "host_waits",
           "host_waits_all"]


def asynchronous(device: torch.device) -> bool:
    """Whether copies between host memory and ``device`` run asynchronously (on a stream)."""
    return device.type == "cuda"


def current(device: torch.device) -> Any:
    """The stream the caller's work on ``device`` runs on now."""
    return torch.cuda.current_stream(device)


def new_stream(device: torch.device) -> Any:
    """A side stream on ``device``."""
    return torch.cuda.Stream(device)


def on(stream: Any) -> contextlib.AbstractContextManager[Any]:
    """Run what follows on ``stream`` (``None``: where it runs now)."""
    return contextlib.nullcontext() if stream is None else torch.cuda.stream(stream)


def new_event() -> Any:
    """An event to record on a stream and wait for (``record``, ``query``, ``synchronize``)."""
    return torch.cuda.Event()


def keep_for(tensor: Tensor, stream: Any) -> None:
    """Keep ``tensor``'s memory from reuse until the work queued on ``stream`` is done."""
    tensor.record_stream(stream)


def host_waits(device: torch.device) -> None:
    """Block the host until the work queued on ``device``'s current stream is done."""
    torch.cuda.current_stream(device).synchronize()


def host_waits_all(device: torch.device) -> None:
    """Block the host until everything queued on ``device``, on any stream, is done
    (nothing to wait for where copies are synchronous)."""
    if asynchronous(device):
        torch.cuda.synchronize(device)
