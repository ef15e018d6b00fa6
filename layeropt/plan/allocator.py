"""PyTorch's CUDA caching allocator, simulated: what a sequence of tensors reserves.

A plan counts live tensor bytes; a GPU holds more: the caching allocator takes
memory from the driver in *segments* and never gives it back during training,
so what a step costs the device is the segments it ever needed
(``torch.cuda.max_memory_reserved``), not the live bytes
(``max_memory_allocated``). :class:`CachingAllocator` replays a sequence of
allocations and frees through the rules of ``c10/cuda/CUDACachingAllocator.cpp``
(torch 2.x, default settings: no ``expandable_segments``, no
``max_split_size_mb``, one stream):

* every request is rounded up to a multiple of 512 bytes;
* requests up to 1 MiB come from the *small* pool, whose segments are 2 MiB;
  larger ones from the *large* pool, whose new segments are 20 MiB for
  requests under 10 MiB, else the request rounded up to 2 MiB;
* a request takes the smallest cached free block of its pool that is large
  enough (best fit, the lowest address among equals), and splits it when the
  rest is at least 512 bytes (small pool) or more than 1 MiB (large pool);
  a large block not split counts whole as allocated;
* a freed block merges with free neighbours of its segment and stays cached.

Reserved memory grows above the live bytes when lifetimes interleave: a freed
block is reused for a smaller request and the rest cannot hold a later larger
one, so a new segment is taken while the cached blocks are free. Activation
checkpointing makes such interleaving (forward activations freed, then
recomputed one block at a time among gradients): on an H200 the checkpointed
steps of gpt2 and llama-3.2-1b reserved 10.6% to 31.6% above their planned
peak, the others 4.7% to 10.7% (``docs/plan.md``).

Example:
    >>> a = CachingAllocator()
    >>> a.malloc("x", 3 * 2**20)   # 3 MiB: a new 20 MiB segment, split
    >>> a.malloc("y", 100)         # 100 B: a new 2 MiB small segment, 512 B used
    >>> a.allocated, a.reserved, a.segments
    (3146240, 23068672, 2)
    >>> a.free("x"); a.malloc("z", 18 * 2**20)   # 18 MiB fits the cached 20 MiB segment
    >>> a.reserved == 22 * 2**20
    True
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Hashable, Iterable

__all__ = [
    "CUBLAS_WORKSPACES",
    "MIN_BLOCK",
    "SMALL_SIZE",
    "CachingAllocator",
    "alive",
    "round_size",
    "segment_size",
    "steady_reserved",
]

#: One event of a log: ``(key, nbytes)``, an allocation when ``nbytes > 0``, the
#: free of ``key``'s allocation when 0 (:attr:`~layeropt.plan.tracker.LiveBytes.log`).
Event = tuple[Hashable, int]

#: Every request is rounded up to a multiple of this (``kMinBlockSize``).
MIN_BLOCK = 512
#: The largest request the small pool serves (``kSmallSize``).
SMALL_SIZE = 2**20
_SMALL_BUFFER = 2 * 2**20  # a small segment (kSmallBuffer)
_LARGE_BUFFER = 20 * 2**20  # a large segment for a request under 10 MiB (kLargeBuffer)
_MIN_LARGE_ALLOC = 10 * 2**20  # kMinLargeAlloc
_ROUND_LARGE = 2 * 2**20  # kRoundLarge
#: Blocks cuBLAS takes from the caching allocator and keeps: one workspace per
#: (thread, stream) - forward runs on the Python thread, backward on autograd's
#: device thread - of 32 MiB on a Hopper GPU (torch's default, ``:4096:8``;
#: 8 MiB + 128 KiB on older GPUs, so 32 MiB is the larger case).
CUBLAS_WORKSPACES = (32 * 2**20, 32 * 2**20)


def round_size(nbytes: int) -> int:
    """The bytes the allocator hands out for a request of ``nbytes`` (512-byte steps).

    Example:
        >>> round_size(1), round_size(512), round_size(513)
        (512, 512, 1024)
    """
    return max(MIN_BLOCK, -(-nbytes // MIN_BLOCK) * MIN_BLOCK)


def segment_size(size: int) -> int:
    """The segment a new request of ``size`` (rounded) bytes takes from the driver.

    Example:
        >>> [segment_size(s) // 2**20 for s in (512, 2**20 + 512, 10 * 2**20, 33 * 2**20)]
        [2, 20, 10, 34]
    """
    if size <= SMALL_SIZE:
        return _SMALL_BUFFER
    if size < _MIN_LARGE_ALLOC:
        return _LARGE_BUFFER
    return -(-size // _ROUND_LARGE) * _ROUND_LARGE


@dataclasses.dataclass
class _Block:
    size: int
    segment: int
    small: bool
    allocated: bool = False


class CachingAllocator:
    """Replay allocations and frees as PyTorch's CUDA caching allocator serves them.

    Attributes:
        allocated: bytes of the blocks handed out now (rounded, as
            ``torch.cuda.memory_allocated`` counts them).
        reserved: bytes of all segments (``torch.cuda.memory_reserved``);
            segments are never released (no ``empty_cache`` in a step).
        peak_allocated / peak_reserved: their highest values.
        segments: number of segments taken from the driver.
    """

    def __init__(self) -> None:
        self._blocks: dict[int, _Block] = {}  # address -> block
        self._ends: dict[int, int] = {}  # end address -> address of the block ending there
        self._free: dict[bool, list[tuple[int, int]]] = {True: [], False: []}  # (size, address)
        self._live: dict[Hashable, int] = {}  # key -> address
        self._top = 0  # next segment's address
        self.allocated = self.reserved = 0
        self.peak_allocated = self.peak_reserved = 0
        self.segments = 0
        self.steps = 0  # steps replayed by :func:`steady_reserved`, the first one too

    def malloc(self, key: Hashable, nbytes: int) -> None:
        """Allocate ``nbytes`` for ``key`` (a tensor storage; 0 bytes takes nothing)."""
        if nbytes <= 0:
            return
        if key in self._live:
            raise ValueError(f"{key!r} is allocated already; free it first")
        size = round_size(nbytes)
        small = size <= SMALL_SIZE
        pool = self._free[small]
        i = bisect.bisect_left(pool, (size, -1))
        address = pool.pop(i)[1] if i < len(pool) else self._new_segment(size, small)
        block = self._blocks[address]
        rest = block.size - size
        if rest >= MIN_BLOCK if small else rest > SMALL_SIZE:
            self._put(address + size, _Block(rest, block.segment, small))
            block.size = size
            self._ends[address + size] = address
        block.allocated = True
        self._live[key] = address
        self.allocated += block.size
        self.peak_allocated = max(self.peak_allocated, self.allocated)

    def free(self, key: Hashable) -> None:
        """Free ``key``'s block (unknown keys - 0-byte storages - are ignored)."""
        address = self._live.pop(key, None)
        if address is None:
            return
        block = self._blocks[address]
        block.allocated = False
        self.allocated -= block.size
        after = self._blocks.get(address + block.size)
        if after is not None and not after.allocated and after.segment == block.segment:
            self._take(address + block.size)
            block.size += after.size
        before_at = self._ends.get(address)
        before = self._blocks.get(before_at) if before_at is not None else None
        if before is not None and not before.allocated and before.segment == block.segment:
            self._take(before_at)
            del self._blocks[address]
            before.size += block.size
            address, block = before_at, before
        self._put(address, block)

    def replay(self, events: Iterable[tuple[Hashable, int]]) -> CachingAllocator:
        """Run ``(key, nbytes)`` events in order: ``nbytes > 0`` allocates, ``0`` frees."""
        for key, nbytes in events:
            if nbytes:
                self.malloc(key, nbytes)
            else:
                self.free(key)
        return self

    def layout(self) -> list[tuple[int, int, bool]]:
        """Every block as ``(address, size, allocated)``, by address: the allocator's
        state, whoever holds the blocks."""
        return sorted((address, b.size, b.allocated) for address, b in self._blocks.items())

    # -- blocks -------------------------------------------------------------
    def _new_segment(self, size: int, small: bool) -> int:
        """cudaMalloc: a segment for ``size`` bytes, as one free block (not in the pool)."""
        total = segment_size(size)
        address = self._top
        self._top += total + _SMALL_BUFFER  # a gap: blocks never merge across segments
        self._blocks[address] = _Block(total, self.segments, small)
        self._ends[address + total] = address
        self.segments += 1
        self.reserved += total
        self.peak_reserved = max(self.peak_reserved, self.reserved)
        return address

    def _put(self, address: int, block: _Block) -> None:
        """Cache a free block (its size may have changed: its end is recorded again)."""
        self._blocks[address] = block
        self._ends[address + block.size] = address
        bisect.insort(self._free[block.small], (block.size, address))

    def _take(self, address: int) -> None:
        """Remove a cached free block that is being merged into a neighbour."""
        block = self._blocks.pop(address)
        self._ends.pop(address + block.size, None)
        pool = self._free[block.small]
        del pool[bisect.bisect_left(pool, (block.size, address))]


# -- a training step's log, replayed as a run of steps ------------------------
def alive(events: Iterable[Event]) -> list[Event]:
    """The allocations of ``events`` not freed within them, in order."""
    out: dict[Hashable, int] = {}
    for key, nbytes in events:
        if nbytes:
            out[key] = nbytes
        else:
            out.pop(key, None)
    return list(out.items())


def _again(events: list[Event], tag: int) -> list[Event]:
    """``events`` with the keys they allocate renamed (a later step's own tensors);
    frees of older keys keep them."""
    mine = {key for key, nbytes in events if nbytes}
    return [((tag, key), n) if key in mine else (key, n) for key, n in events]


def steady_reserved(
    built: list[Event],
    first: list[Event],
    keep: list[Event],
    step: list[Event],
    max_steps: int = 8,
) -> CachingAllocator:
    """Replay a training run - the model built, a first step, then steady-state steps
    until the allocator's blocks repeat - and return the allocator (``.reserved``: what
    the run took from the driver; ``.steps``: the steps replayed).

    The run starts with cuBLAS's workspaces (:data:`CUBLAS_WORKSPACES`), then
    ``built`` (parameters, buffers, the batch), then ``first``, the first step,
    then ``step``, the steady-state step, again and again with fresh keys. At the
    end of each step what it allocated and did not free is freed (``zero_grad()``
    drops the gradients, the loss goes) except ``keep``: allocations of the first
    step that stay (the optimizer state it creates). The same requests from the same
    blocks give the same blocks, so once a step ends with the blocks the step before
    ended with, no later step takes a segment more: the replay stops there (at least
    three steps in all), or after ``max_steps``.

    Args:
        built: the events before the first step.
        first: the first step's events.
        keep: allocations of ``first`` that outlive it (their keys).
        step: one steady-state step's events.
        max_steps: the most steps to replay.
    """
    a = CachingAllocator()
    for i, nbytes in enumerate(CUBLAS_WORKSPACES):
        a.malloc(("cublas", i), nbytes)
    a.replay(built)
    kept = {key for key, _ in keep}
    a.replay(first)
    a.replay((key, 0) for key, _ in alive(first) if key not in kept)
    before = None
    for n in range(2, max_steps + 1):
        a.steps = n
        again = _again(step, n)
        a.replay(again)
        a.replay((key, 0) for key, _ in alive(again))
        after = a.layout()
        if after == before:
            break
        before = after
    return a
