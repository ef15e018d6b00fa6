"""The offloaded state's host memory, allocated once when offload starts.

Without a pool each host tensor is allocated when its state first reaches the
host, in the first step, from torch's caching host allocator. On CUDA that
allocator pins each request the first time its size is asked for, and rounds
it up to a power of two (``ATen/core/CachingHostAllocator.h``). A Llama-2-7B
MLP weight of 4096 x 11008 bf16 values (86 MiB) then takes 128 MiB of pinned
memory.

:class:`HostPool` learns the state's layout (which tensors, their shapes,
strides and dtypes) by stepping a copy of the optimizer on meta tensors: no
memory, no numbers. It then allocates one block of exactly those bytes (pinned
when the parameters are on CUDA) and carves one tensor per state entry from it,
each a storage of its own over its bytes (``torch.save`` of one state tensor
saves that tensor, not the block).
:meth:`StateOffload._new_host <layeropt.offload.state.StateOffload>` takes an
entry's tensor from the pool when the layout matches. Otherwise (an
optimizer the meta step cannot run, a state tensor of another shape) it
allocates as before. Held gradients in host memory get a pool of their own at
the first backward that holds one (none in a loop without accumulation): one
sum per parameter (``HELD_SUM``), given to ``HostHeld`` in every window. A
pool goes with its optimizer (:meth:`HostPool.release`). ``offload_state`` uses
the pools on a CPU device only until a GPU run has shown them on CUDA
(``StateOffload(pooled=True)`` builds them anywhere).
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Hashable
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode

from . import streams

__all__ = ["HostPool", "state_layout", "HELD_SUM"]

HELD_SUM = "held gradient"  # the key of a parameter's held gradient sum: (id(param), HELD_SUM)

_ALIGN = 512  # bytes: each tensor's start (CUDA's own allocation granularity)
Layout = dict[Hashable, tuple[torch.Size, tuple[int, ...], torch.dtype]]


def state_layout(optimizer: Any) -> Layout | None:
    """``{(id(param), state key): (size, stride, dtype)}`` of the state tensors with one
    or more dimensions the optimizer's first step creates on its parameters' device;
    ``None`` where stepping a meta copy of it fails (its layout is then learned as it
    is created). Found by stepping a fresh instance of the optimizer's torch class on
    meta parameters with meta gradients; ``fused``, ``foreach`` and ``capturable`` are
    turned off for it (they change how the state is computed, not its layout), and a
    value it reads on the host is 1."""
    base = getattr(type(optimizer), "_lo_base", type(optimizer))
    metas: dict[int, Tensor] = {}
    groups = []
    for g in optimizer.param_groups:
        params = []
        for p in g["params"]:
            m = torch.empty_strided(p.size(), p.stride(), dtype=p.dtype, device="meta",
                                    requires_grad=p.requires_grad)
            if p.requires_grad:
                m.grad = torch.empty_like(m)
            metas[id(m)] = p
            params.append(m)
        group = {k: v for k, v in g.items() if k != "params"}
        group.update({k: False for k in ("fused", "foreach", "capturable") if k in group})
        groups.append({**group, "params": params})
    try:
        with warnings.catch_warnings(), torch.no_grad(), _HostReadsAnswered():
            warnings.simplefilter("ignore")
            shadow = base(groups)
            shadow.step()
    except Exception:  # noqa: BLE001 - any optimizer: no pool, state allocated as created
        return None
    layout: Layout = {}
    for m, state in shadow.state.items():
        for key, v in state.items():
            if isinstance(v, Tensor) and v.device.type == "meta" and v.dim() > 0:
                layout[(id(metas[id(m)]), key)] = (v.size(), v.stride(), v.dtype)
    return layout


class _HostReadsAnswered(TorchDispatchMode):
    """A meta tensor's value read on the host (``.item()``, Adafactor's norm) answers 1:
    the step goes on to create its state, whose layout does not depend on the value."""

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if func is torch.ops.aten._local_scalar_dense.default:
            return True if args[0].dtype == torch.bool else 1
        return func(*args, **(kwargs or {}))


def _extent(size: torch.Size, stride: tuple[int, ...]) -> int:
    """Elements a tensor of ``size`` and ``stride`` spans in its storage."""
    if any(s == 0 for s in size):
        return 0
    return 1 + sum((s - 1) * st for s, st in zip(size, stride))


def _entry(block: Any, offset: int, size: torch.Size, stride: tuple[int, ...],
           dtype: torch.dtype) -> Tensor:
    """A tensor of ``size``/``stride``/``dtype`` over ``block``'s bytes from ``offset``."""
    count = _extent(size, stride)
    if count == 0:
        return torch.empty_strided(size, stride, dtype=dtype)
    flat = torch.frombuffer(block, dtype=dtype, count=count, offset=offset)
    return torch.empty(0, dtype=dtype).set_(flat.untyped_storage(), 0, size, stride)


class HostPool:
    """One block of host memory carved into a tensor per state entry (see the module
    docstring). ``take(key, like)`` gives the entry's tensor when ``like`` has its
    layout, the same tensor each time (state written back lands in it).

    Attributes:
        nbytes: the block's size in bytes (the entries, each aligned to 512 bytes).
        pinned: whether the block is pinned (parameters on CUDA).
        devices: the devices whose queued copies :meth:`release` waits for.
    """

    def __init__(self, layout: Layout, pin: bool) -> None:
        offsets = {}
        end = 0
        for key, (size, stride, dtype) in layout.items():
            end = -(-end // _ALIGN) * _ALIGN
            offsets[key] = end
            end += _extent(size, stride) * dtype.itemsize
        self.nbytes = end
        self.pinned = pin
        self.devices: list[torch.device] = []  # whose queued copies release() waits for
        # Each entry is a storage of its own over its bytes of the block (torch.save of one
        # state tensor saves that tensor, not the block); each keeps the block alive.
        block = torch.empty(end, dtype=torch.uint8, pin_memory=pin).numpy()
        self._block = weakref.ref(block)
        self._entries = {key: _entry(block, offsets[key], size, stride, dtype)
                         for key, (size, stride, dtype) in layout.items()}

    @classmethod
    def for_optimizer(cls, optimizer: Any, what: str = "state") -> HostPool | None:
        """The pool for ``optimizer``'s ``"state"``, or for a ``"held"`` gradient sum of
        each parameter that requires grad. Released when the optimizer is deleted, as
        torch.optim's state is freed. ``None`` if there is nothing to pool (a layout the
        meta step cannot find) or the block cannot be allocated: a warning says so, and
        host tensors are then allocated one by one as they are needed."""
        params = [p for g in optimizer.param_groups for p in g["params"]]
        if what == "state":
            layout = state_layout(optimizer)
        else:
            layout = {(id(p), HELD_SUM): (p.size(), p.stride(), p.dtype)
                      for p in params if p.requires_grad}
        if not layout:
            return None
        pin = any(p.device.type == "cuda" for p in params)
        try:
            pool = cls(layout, pin)
        except RuntimeError as exc:  # (pinned memory limits: ulimit -l, a container's)
            warnings.warn(
                f"offload_state: could not allocate the {what} host memory in one block "
                f"({sum(_extent(s, st) * d.itemsize for s, st, d in layout.values()):,} "
                f"bytes{', pinned' if pin else ''}: {exc}); allocating it tensor by tensor "
                "instead.", RuntimeWarning, stacklevel=3)
            return None
        pool.devices = sorted({p.device for p in params}, key=str)
        weakref.finalize(optimizer, pool.release).atexit = False  # (not at shutdown)
        return pool

    def take(self, key: Hashable, like: Tensor) -> Tensor | None:
        """The entry ``key``'s tensor if ``like`` has its size, stride and dtype; else
        ``None``. The same tensor each time: state written back, a held sum of the next
        window, lands in it."""
        t = self._entries.get(key)
        if t is None or t.size() != like.size() or t.stride() != like.stride() \
                or t.dtype != like.dtype:
            return None
        return t

    @property
    def allocated(self) -> bool:
        """Whether the block is still allocated (an entry of it still alive)."""
        return self._block() is not None

    def release(self) -> None:
        """Let go of every entry (the optimizer was deleted, or offload removed): the
        block is freed when no state tensor of it is left. First the host waits for the
        work queued on the parameters' devices: a copy may still read or write an entry,
        and memory the pool carved is not kept for it as torch's caching host allocator
        keeps its own blocks (by events recorded at each copy)."""
        if self._entries:
            for device in self.devices:
                streams.host_waits_all(device)
        self._entries.clear()
