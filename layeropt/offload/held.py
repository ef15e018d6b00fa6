"""Held gradients in host memory: ``offload_state(opt)``'s ``held_grads=True`` (the default).

A gradient *held* for a later step (``optimizer.no_step()``, a backward that
keeps its graph with ``retain_graph=True``) would stay in ``.grad`` on the
device, summed there by autograd across micro-batches: one more copy of the
parameters. With the optimizer state offloaded, the engine
(``layeropt/engine/rules.py``) gives it to a :class:`HostHeld` instead:

1. **down**: in a backward that holds, once every parameter of a layer bucket
   has landed, each gradient is copied to a host tensor (pinned on CUDA) and
   its ``.grad`` freed. The first micro-batch's copy *is* the host sum; a
   later one is added into it on the host, ``host + new`` in the gradient's
   dtype - the one addition autograd makes, ``acc + new``, which IEEE
   arithmetic rounds the same on either side (addition commutes bit for bit;
   bf16 and fp16 sums computed in fp32 and rounded once more are still
   correctly rounded). A backward that may deliver one gradient in several
   pieces (torch's reentrant checkpoint) moves each piece as it lands, so
   the sums associate as autograd's do. Buckets that only partly landed move
   when the backward ends (or raises: what landed stays, as torch keeps it
   in ``.grad``).
2. **up**: just before the bucket is stepped - its gradients complete in the
   stepping backward, or the end of that backward, ``layeropt.backward``'s
   step pass or ``step()`` for a bucket the stepping backward did not reach -
   the host sum is copied back and the new gradient added, ``held + new``,
   as autograd would; ``.grad`` is then what it would have been on the device.
3. what the loop reads between backward and ``step()`` stays in ``.grad``:
   a GradScaler-scaled backward, ``step(closure)``'s and a
   ``create_graph=True`` backward (its gradients carry a graph) bring the
   host sum back as their gradients land, and hold on the device.

Nothing of this is in ``state_dict()``: torch's optimizer state holds no
gradients either.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import streams
from ..errors import LayeroptError
from .pool import HELD_SUM, HostPool

__all__ = ["HostHeld", "empty_like"]


def empty_like(t: Tensor, device: torch.device | str) -> Tensor:
    """An empty tensor like ``t`` (its strides) on ``device``: the one way offload makes
    its tensors. On the host it is pinned when ``t`` is on CUDA (copies overlap)."""
    pin = torch.device(device).type == "cpu" and t.device.type == "cuda"
    return torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device,
                               pin_memory=pin)


WRITTEN_BACK_ERROR = (
    "held gradients in host memory (offload_state's held_grads=True): {n} gradient(s) "
    "(the first of shape {shape}) were written back into .grad after layeropt moved them "
    "to host memory in this backward - DistributedDataParallel's reducer does that at the "
    "end of backward when its model's submodules are attached one by one with plain "
    "hooks - and the step would add them to the held sum again. Attach the DDP model "
    "itself (layeropt.attach(ddp_model, opt)), or keep held gradients on the device "
    "(offload_state(opt, held_grads=False)). The copies were dropped; the held sums "
    "are kept."
)


class HostHeld:
    """One optimizer's held gradients, summed in host memory (see the module docstring).

    Attributes:
        down_bytes: bytes copied device -> host so far (each held micro-batch's gradient).
        up_bytes: bytes copied host -> device so far (each sum, once, for its step).
    """

    def __init__(self, device_bytes: int = 0,
                 pool_factory: Callable[[], HostPool | None] | None = None,
                 add_on_device: bool = False) -> None:
        self.host: dict[Tensor, Tensor] = {}  # parameter -> its held gradient, on the host
        # held gradients of whole buckets left in .grad, up to device_bytes (budget)
        self.budget = device_bytes
        self.kept: set[Tensor] = set()  # parameters whose held gradient is left in .grad
        self._kept_buckets: set[int] = set()  # id(bucket): its held gradients stay in .grad
        self._kept_bytes = 0
        self._pending: dict[int, list[Tensor]] = {}  # id(bucket) -> landed, not moved yet
        self._serial = -1  # the backward record the pending gradients landed in
        self._moved: set[Tensor] = set()  # moved to the host since the last flush()
        self.down_bytes = 0
        self.up_bytes = 0
        # prefetch (layeropt/offload/prefetch.py): (param, host sum) -> its copy fetched ahead
        self.ahead: Callable[[Tensor, Tensor], Tensor | None] | None = None
        # offload's HostPool: each sum in the parameter's tensor of it (given every window),
        # made by pool_factory at the first holding backward (none without accumulation)
        self.pool: HostPool | None = None
        self.pool_factory = pool_factory
        # a later micro-batch: the sum brought up, added on the device and sent back down,
        # instead of the gradient sent down and added on the host (the same addition)
        self.add_on_device = add_on_device

    def __contains__(self, param: Tensor) -> bool:
        return param in self.host

    def __len__(self) -> int:
        return len(self.host)

    @property
    def host_bytes(self) -> int:
        """Bytes of held gradients in host memory now."""
        return sum(t.nbytes for t in self.host.values())

    def _new_host(self, like: Tensor) -> Tensor:
        """An empty host tensor for ``like`` (pinned when ``like`` is on CUDA)."""
        return empty_like(like, "cpu")

    # -- down: a holding backward ----------------------------------------------
    def land(self, param: Tensor, bucket: Any, serial: int, at_once: bool) -> None:
        """``param``'s gradient landed in a holding backward (record ``serial``): moved
        with its bucket once the bucket has landed, or now (``at_once``: the backward
        may deliver it again)."""
        if id(bucket) in self._kept_buckets or self._keep(bucket):
            self.kept.add(param)
            return  # (stays in .grad: autograd sums it there, as without offload)
        if at_once:
            self.down([param])
            return
        if serial != self._serial:
            self.flush()
            self._serial = serial
        landed = self._pending.setdefault(id(bucket), [])
        landed.append(param)
        if len(landed) == len(bucket.params):
            del self._pending[id(bucket)]
            self.down(landed)

    def _keep(self, bucket: Any) -> bool:
        """Whether ``bucket``'s held gradients fit the device budget (decided at its first
        landing in a window, for the window: the first-landed buckets stay). Not one whose
        sum is in host memory already (the budget freed mid-window by a ``create_graph``
        backward): autograd's ``(g1 + g2) + g3`` must stay the order of its additions."""
        if (bucket is None or self._kept_bytes + bucket.nbytes > self.budget
                or any(p in self.host for p in bucket.params)):
            return False
        self._kept_buckets.add(id(bucket))
        self._kept_bytes += bucket.nbytes
        return True

    def flush(self) -> None:
        """Move what landed and waits for the rest of its bucket (a backward ended), then
        refuse a gradient written back into ``.grad`` after it was moved: no autograd
        accumulation does that, DistributedDataParallel's reducer does, at the end of
        backward, for a DDP model whose submodules carry plain hooks (the step would add
        that copy to the sum). The engine's end of backward runs after the callbacks
        queued during it (``TaskEnd(last=True)``, ``layeropt/engine/nesting.py``), DDP's
        among them, so its ``flush`` sees the copies. They are dropped, the sums kept."""
        pending, self._pending = self._pending, {}
        for landed in pending.values():
            self.down(landed)
        again = [p for p in self._moved if p.grad is not None and p in self.host]
        self._moved.clear()
        if again:
            for p in again:
                p.grad = None
            raise LayeroptError(WRITTEN_BACK_ERROR.format(n=len(again),
                                                          shape=tuple(again[0].shape)))

    def down(self, params: list[Tensor]) -> None:
        """Add each parameter's ``.grad`` into its host sum and free it."""
        if self.pool_factory is not None:
            self.pool, self.pool_factory = self.pool_factory(), None
        staged = []
        for p in params:
            g = p.grad
            if g is None:
                continue
            acc = self.host.get(p)
            if acc is not None and self.add_on_device:  # (the host never touches acc)
                work = self.fetch(p)
                work.add_(g)  # acc + new: autograd's accumulation, on the device
                acc.copy_(work, non_blocking=streams.asynchronous(g.device))
                p.grad = None
                self._moved.add(p)
                self.down_bytes += acc.nbytes
                continue
            buf = None
            if self.pool is not None and p not in self.host:  # its sum: the pool's tensor
                buf = self.pool.take((id(p), HELD_SUM), g)
            if buf is None:
                buf = self._new_host(g)
            buf.copy_(g, non_blocking=streams.asynchronous(g.device))
            staged.append((p, buf, g.device))
            p.grad = None
            self._moved.add(p)
            self.down_bytes += buf.nbytes
        for device in {d for _, _, d in staged if streams.asynchronous(d)}:
            streams.host_waits(device)  # the copies have landed
        for p, buf, _ in staged:
            acc = self.host.get(p)
            if acc is None:
                self.host[p] = buf
            else:
                acc.add_(buf)  # acc + new: autograd's accumulation, on the host

    # -- up: a step ---------------------------------------------------------------
    def up(self, params: list[Tensor]) -> None:
        """Each parameter's host sum back in ``.grad``, plus what landed there since
        (``held + new``, autograd's order); the host tensor is dropped."""
        for p in params:
            if p in self.kept:
                self.kept.discard(p)
                if not self.kept:  # every kept gradient is back with the engine:
                    self._kept_buckets.clear()  # the window's budget is free again
                    self._kept_bytes = 0
            if p not in self.host:
                continue
            work = self.fetch(p)
            del self.host[p]
            g = p.grad
            if g is not None:
                work = work + g if g.requires_grad else work.add_(g)  # (a graph: kept)
            p.grad = work

    def give_back(self) -> None:
        """The optimizer was deleted with gradients held here (no ``remove()``): each host
        sum back in ``.grad`` (``held + new``), where torch's ``.grad`` holds it for
        whatever steps those parameters next."""
        self.ahead = None  # (the prefetcher went with the optimizer)
        self.up(list(self.host))

    def fetch(self, param: Tensor) -> Tensor:
        """A device copy of ``param``'s host sum, which stays held
        (``layeropt.backward``'s measure pass)."""
        acc = self.host[param]
        work = None if self.ahead is None else self.ahead(param, acc)
        if work is None:
            work = empty_like(acc, param.device)
            work.copy_(acc, non_blocking=streams.asynchronous(param.device))
        self.up_bytes += acc.nbytes
        return work

    def drop(self, set_to_none: bool = True, params: list[Tensor] | None = None) -> None:
        """Forget the held gradients (``zero_grad()``, a skipped step), or those of
        ``params`` (``module.zero_grad()``); with ``set_to_none=False`` each parameter gets
        a zero ``.grad``, as torch's ``zero_grad`` leaves a held gradient."""
        gone = None if params is None else set(params)
        for p in [p for p in self.host if gone is None or p in gone]:
            acc = self.host.pop(p)
            if not set_to_none:
                p.grad = empty_like(acc, p.device).zero_()  # (the device's own zeros)
        if gone is None:
            self._pending.clear()
            self.kept.clear()
        else:
            for landed in self._pending.values():
                landed[:] = [p for p in landed if p not in gone]
            self.kept -= gone  # (torch's zero_grad clears or zeroes their .grad)
        if not self.kept:  # the window's budget is free again
            self._kept_buckets.clear()
            self._kept_bytes = 0
