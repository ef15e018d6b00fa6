"""Optimizer state in host memory, brought to the device one bucket at a time.

``offload_state(opt)`` keeps a layeropt optimizer's state tensors in host
memory (pinned when the parameters are on CUDA). Each bucket step inside
backward (``InBackwardOptimizer._step_params``, the one place every update of
an offloaded optimizer goes through) runs in :meth:`StateOffload.stepping`:

1. each of the bucket's host state tensors is copied into a working tensor on
   the parameter's device, and ``optimizer.state[p][k]`` is that working
   tensor for the call;
2. torch's own ``step`` runs on it (state it creates lazily is created on the
   device, as torch does);
3. every working tensor - and any state tensor the step created or replaced -
   is copied back into host memory, and ``optimizer.state[p][k]`` is the host
   tensor again.

Copies are exact, so parameters and state equal the same loop without
offload bit for bit. Between steps ``optimizer.state`` holds the host
tensors, so ``state_dict()`` is torch's format; ``load_state_dict`` loads
straight into host memory (torch's casting rule applied to host stand-ins of
the parameters), and state found on the device at a step is moved too.

What stays where torch puts it: 0-dim tensors (Adam's ``step``: on the CPU,
or on the device for ``fused``/``capturable``), tensors on another device than
their parameter, and tensor subclasses. On a CPU "device" the host tensors are
still separate storage from the working ones, so the same copies run (and are
tested).

``overlap=True`` (CUDA only): the copy back of a bucket runs on a side stream
while the next bucket steps; at most ``max_buckets`` buckets' working state
is alive at once. A bucket's step waits for every copy back in flight; with two
copy streams (``copy_streams=2``) a copy that reads or writes a host tensor waits
for the copy back into it still in flight, and nothing else (its event). Reading
``optimizer.state`` tensors directly then needs ``handle.synchronize()`` first
(``state_dict()`` does it itself). ``layeropt/offload/streams.py`` makes every
stream, event and asynchronous copy; ``tests/test_stream_order.py`` checks their
order on simulated streams.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections import deque
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from . import streams
from .held import HostHeld, empty_like
from .loading import loading_into_host
from .pool import HELD_SUM, HostPool
from .prefetch import LandingOrder
from ..checking.verify import Verifier
from ..engine.stepper import Wrapper
from ..errors import OVERLAP_HELD_ERROR, VERIFY_OFFLOAD_ERROR, LayeroptError
from ..optim import InBackwardOptimizer

__all__ = ["offload_state", "StateOffload"]


def _offloadable(p: Tensor, v: Any) -> bool:
    """A state tensor that lives on its parameter's device and is worth moving."""
    return (isinstance(v, Tensor) and not is_traceable_wrapper_subclass(v)  # DTensor, torchao
            and v.dim() > 0 and v.device == p.device)


class _Flight:
    """One bucket's copy back in progress on the side stream (``overlap=True``): its event,
    the working tensors it reads, the ids of the host tensors it writes, its bytes."""

    def __init__(self, event: Any, tensors: list[Tensor], hosts: list[int],
                 nbytes: int) -> None:
        self.event, self.tensors, self.hosts, self.nbytes = event, tensors, hosts, nbytes


def _held_pool(ref: weakref.ref) -> HostPool | None:
    """The held gradient sums' pool of the optimizer ``ref`` (``HostHeld.pool_factory``)."""
    optimizer = ref()
    return None if optimizer is None else HostPool.for_optimizer(optimizer, "held")


def _hook(method: str, ref: weakref.ref, *args: Any) -> None:
    handle = ref()
    if handle is not None:
        getattr(handle, method)(*args)


class OffloadStepper(Wrapper):
    """``offload_state``'s seam (``layeropt/engine/stepper.py``): each update with its
    parameters' state on the device around it; held gradients in the handle's host
    store (``held_grads=True``), else where the inner stepper keeps them."""

    def __init__(self, place: StateOffload) -> None:
        super().__init__()
        self.place = place

    @property
    def held(self) -> Any:
        held = self.place.held
        return self.inner.held if held is None else held

    def step(self, engine: Any, optimizer: Any, groups: list[Any], params: list[Tensor],
             transform: Any) -> list[Tensor]:
        with self.place.stepping(optimizer, params):
            return self.inner.step(engine, optimizer, groups, params, transform)

    def apply(self, optimizer: Any, params: list[Tensor], txn: int) -> None:
        with self.place.stepping(optimizer, params):
            self.inner.apply(optimizer, params, txn)

    def loading(self, optimizer: Any) -> contextlib.AbstractContextManager[None]:
        return self.place.loading(optimizer)


class StateOffload:
    """Where an optimizer's state lives while offloaded (see the module docstring).

    Attributes:
        device_bytes: bytes of state on the device now (working tensors).
        peak_device_bytes: the most there have been at once.
        copied_bytes: bytes of state copied host->device and back so far.
        held: the held gradients in host memory (:class:`layeropt.offload.held.HostHeld`;
            ``None`` with ``held_grads=False``).
        order: with ``prefetch``, the recorded landing order
            (:class:`layeropt.offload.prefetch.LandingOrder`); else ``None``.
        prefetched_bytes / wasted_bytes: bytes fetched ahead, and of those the ones
            dropped unused (out of order, stale).
        pool: the state's host memory, allocated when offload started
            (:class:`layeropt.offload.pool.HostPool`; ``None`` where the layout was not
            known: host tensors are then allocated as the state is created). The held
            gradient sums get a pool of their own at the first holding backward
            (``held.pool``).
        copy_streams: 1 (the default): copies in and out share one side stream; 2: each
            direction has its own (not offered by ``offload_state`` until a GPU run shows
            it; ``tests/test_stream_order.py`` checks its order on the CPU). The
            constructor's ``add_on_device`` is ``HostHeld``'s (not offered either).
    """

    def __init__(self, optimizer: InBackwardOptimizer, max_buckets: int, overlap: bool,
                 held_grads: bool = True, prefetch: bool = False,
                 held_device_bytes: int = 0, copy_streams: int = 1,
                 pooled: bool = False, add_on_device: bool = False) -> None:
        self._optimizer = weakref.ref(optimizer)  # (the optimizer keeps this handle)
        self.max_buckets = max_buckets
        self.overlap = overlap
        self.copy_streams = copy_streams  # 2: copies in and out on streams of their own
        self.pool = HostPool.for_optimizer(optimizer) if pooled else None
        self.held: HostHeld | None = None
        self._give_back: weakref.finalize | None = None
        if held_grads:  # (the sums' pool: at the first hold)
            made = functools.partial(_held_pool, weakref.ref(optimizer)) if pooled else None
            self.held = HostHeld(held_device_bytes, made, add_on_device)
            # (an optimizer deleted mid-window: torch's .grad still holds the sums)
            self._give_back = weakref.finalize(optimizer, self.held.give_back)
            self._give_back.atexit = False
        self.order: LandingOrder | None = LandingOrder() if prefetch else None
        self.prefetched_bytes = self.wasted_bytes = 0
        self._calls: dict[tuple[int, ...], list[Tensor]] = {}  # step call key -> its params
        self._ahead: dict[tuple[int, ...], list[tuple[int, Any]]] = {}  # key -> its copies
        # (id(param), state key or HELD_SUM) -> (host tensor, its version, device copy, event)
        self._copies: dict[tuple[int, Any], tuple[Tensor, int, Tensor, Any]] = {}
        if prefetch and self.held is not None:
            self.held.ahead = self._take_held
        self.device_bytes = 0
        self.peak_device_bytes = 0
        self.copied_bytes = 0
        self._hosts: dict[int, dict[Any, weakref.ref]] = {}  # id(param) -> key -> host tensor
        self._flights: deque[_Flight] = deque()
        self._writes: dict[int, Any] = {}  # id(host tensor) -> event of a copy back into it
        self._streams: dict[tuple[torch.device, str], Any] = {}  # (device, in/out) ->
        self.stepper = OffloadStepper(self)  # installed by _install, removed by remove()
        ref = weakref.ref(self)
        self._hooks = [
            optimizer.register_state_dict_pre_hook(
                functools.partial(_hook, "_before_read", ref)),
            optimizer.register_step_pre_hook(functools.partial(_hook, "_before_step", ref)),
        ]

    @property
    def optimizer(self) -> InBackwardOptimizer | None:
        """The optimizer whose state this handle keeps (``None`` once it was deleted)."""
        return self._optimizer()

    # -- host tensors -------------------------------------------------------
    def _host(self, p: Tensor, key: Any, v: Any) -> bool:
        """Whether ``v`` is the host tensor this handle keeps for ``state[p][key]``."""
        ref = self._hosts.get(id(p), {}).get(key)
        return ref is not None and ref() is v

    def _new_host(self, p: Tensor, key: Any, v: Tensor) -> Tensor:
        host = None if self.pool is None else self.pool.take((id(p), key), v)
        if host is None:
            host = empty_like(v, "cpu")
        self._hosts.setdefault(id(p), {})[key] = weakref.ref(host)
        return host

    def _params(self) -> list[Tensor]:
        opt = self.optimizer
        return [] if opt is None else [p for g in opt.param_groups for p in g["params"]]

    def _to_host_all(self) -> None:
        """Move every device state tensor of the optimizer to the host (now)."""
        state = self.optimizer.state
        for p in self._params():
            s = state.get(p)
            for k, v in list(s.items()) if s else ():
                if not self._host(p, k, v) and _offloadable(p, v):
                    s[k] = self._new_host(p, k, v)
                    s[k].copy_(v)

    # -- the bucket step ------------------------------------------------------
    @contextlib.contextmanager
    def stepping(self, optimizer: Any, params: list[Tensor]) -> Iterator[None]:
        """``params``' state on their device for the call, back on the host after it."""
        self._retire(block_until=self.max_buckets - 1)
        state = optimizer.state
        working: dict[tuple[int, Any], tuple[Tensor, Tensor]] = {}  # -> (host, work)
        if self._flights and self.copy_streams == 1:  # every copy back in flight first: the
            # order a GPU run showed exact (2026-12-04); two copy streams wait for exactly
            # the copies back into what they read (_after_writes), checked on the CPU only
            waiting = {p.device: streams.current(p.device) for p in params}
            for s in waiting.values():
                for f in self._flights:
                    s.wait_event(f.event)
        key = tuple(map(id, params)) if self.order is not None else ()
        try:
            for p in params:
                s = state.get(p)
                for k, v in list(s.items()) if s else ():
                    if self._host(p, k, v):
                        work = self._take(p, k, v) if self._copies else None
                        if work is None:
                            self._after_writes(v, p.device)
                            work = self._to_device(v, p.device)
                            self._count(v.nbytes, copied=True)
                        s[k] = work
                        working[(id(p), k)] = (v, work)
            yield
        finally:
            self._write_back(state, params, working)
            if self.order is not None:
                self._calls[key] = params
                self.order.landed(key, optimizer._lo_engine.last.serial)
                self._fetch_ahead(self.order.upcoming(self.max_buckets))

    def _to_device(self, host: Tensor, device: torch.device) -> Tensor:
        work = empty_like(host, device)
        work.copy_(host, non_blocking=streams.asynchronous(device))  # (pinned host)
        return work

    def _write_back(self, state: Any, params: list[Tensor],
                    working: dict[tuple[int, Any], tuple[Tensor, Tensor]]) -> None:
        moves = []  # (state dict, key, device tensor, host tensor)
        for p in params:
            s = state.get(p)
            for k, v in list(s.items()) if s else ():
                entry = working.get((id(p), k))
                if entry is not None and entry[1] is v:
                    moves.append((s, k, v, entry[0]))
                elif not self._host(p, k, v) and _offloadable(p, v):  # created or replaced
                    moves.append((s, k, v, self._new_host(p, k, v)))
                    self._count(v.nbytes)
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)
        nbytes = self._bucket_bytes(working, moves)
        if self.overlap:
            self._copy_back_async(moves, nbytes)
        else:
            for s, k, v, host in moves:
                self._after_writes(host, v.device)
                host.copy_(v)
                s[k] = host
            self.device_bytes -= nbytes
        self.copied_bytes += sum(v.nbytes for _, _, v, _ in moves)

    @staticmethod
    def _bucket_bytes(working: dict[Any, tuple[Tensor, Tensor]], moves: list[Any]) -> int:
        """Bytes counted on the device for this bucket: its working and new tensors."""
        seen = {id(w): w.nbytes for _, w in working.values()}
        seen.update((id(v), v.nbytes) for _, _, v, _ in moves)
        return sum(seen.values())

    def _count(self, nbytes: int, copied: bool = False) -> None:
        self.device_bytes += nbytes
        if copied:
            self.copied_bytes += nbytes

    # -- prefetch in landing order ----------------------------------------------
    def _fetch_ahead(self, keys: list[tuple[int, ...]]) -> None:
        """Copy the state (and held gradient sums) of the step calls ``keys`` to the
        device now (a side stream on CUDA); drop the copies of calls no longer expected."""
        for old in [k for k in self._ahead if k not in keys]:
            self._drop_ahead(old)
        state = self.optimizer.state
        for key in keys:
            params = self._calls.get(key)
            if key in self._ahead or params is None:
                continue
            entries = []
            side = None
            for p in params:
                sources = [(k, v) for k, v in (state.get(p) or {}).items() if self._host(p, k, v)]
                if self.held is not None and p in self.held.host:
                    sources.append((HELD_SUM, self.held.host[p]))
                for k, v in sources:
                    if side is None and streams.asynchronous(p.device):
                        side = self._side_stream(p.device, "in")
                    if side is not None:
                        self._after_writes(v, p.device, side)
                    with streams.on(side):
                        work = self._to_device(v, p.device)
                    self._copies[(id(p), k)] = (v, v._version, work, None)
                    entries.append((id(p), k))
                    self._count(v.nbytes, copied=k is not HELD_SUM)
                    self.prefetched_bytes += v.nbytes
            if side is not None:
                event = streams.new_event()
                event.record(side)
                for e in entries:
                    self._copies[e] = (*self._copies[e][:3], event)
            self._ahead[key] = entries
        self.peak_device_bytes = max(self.peak_device_bytes, self.device_bytes)

    def _side_stream(self, device: torch.device, direction: str = "out") -> Any:
        """The stream for copies ``"in"`` (fetched ahead) or ``"out"`` (copies back),
        after the work queued so far: the steps it copies back, a held sum written on
        the device. One stream for both (``copy_streams=1``: in issue order) or one each
        (``2``: in beside out; a copy in also waits for the copy back into the host
        tensor it reads, :meth:`_after_writes`)."""
        key = (device, "in" if self.copy_streams == 2 and direction == "in" else "out")
        side = self._streams.get(key)
        if side is None:
            side = self._streams[key] = streams.new_stream(device)
        side.wait_stream(streams.current(device))
        return side

    def _take(self, p: Tensor, k: Any, host: Tensor) -> Tensor | None:
        """The copy fetched ahead of ``host`` (``state[p][k]`` or the held sum), if it is
        still that tensor's value; else ``None`` (fetch it now)."""
        entry = self._copies.pop((id(p), k), None)
        if entry is None:
            return None
        source, version, work, event = entry
        if source is not host or source._version != version:  # written since: stale
            self._wasted(work, event)
            return None
        if event is not None:
            current = streams.current(work.device)
            current.wait_event(event)
            streams.keep_for(work, current)
        if k is HELD_SUM:  # a gradient from now on, not state
            self.device_bytes -= work.nbytes
        return work

    def _take_held(self, p: Tensor, acc: Tensor) -> Tensor | None:
        return self._take(p, HELD_SUM, acc) if self._copies else None

    def _drop_ahead(self, key: tuple[int, ...] | None = None, host: bool = False) -> None:
        """Forget the copies fetched ahead for ``key`` (all: ``None``) not used yet; what
        runs next (the host too, with ``host``) waits for them."""
        for k in list(self._ahead) if key is None else [key]:
            for entry in self._ahead.pop(k, ()):
                copy = self._copies.pop(entry, None)
                if copy is not None:
                    self._wasted(copy[2], copy[3], host)

    def _wasted(self, work: Tensor, event: Any, host: bool = False) -> None:
        """A copy fetched ahead, dropped: it may still be reading its host tensor, which
        a later write (a step's copy back, a load into the pool's tensors) must follow,
        so the current stream - and with ``host`` the host - waits for it."""
        self.device_bytes -= work.nbytes
        self.wasted_bytes += work.nbytes
        if event is not None:
            if host:
                event.synchronize()
            else:
                streams.current(work.device).wait_event(event)

    # -- overlap (CUDA) ------------------------------------------------------
    def _copy_back_async(self, moves: list[Any], nbytes: int) -> None:
        if not moves:
            self.device_bytes -= nbytes
            return
        side = self._side_stream(moves[0][2].device)
        with streams.on(side):
            for s, k, v, host in moves:
                host.copy_(v, non_blocking=True)
                streams.keep_for(v, side)
                s[k] = host  # (its values arrive with the event: see synchronize())
        event = streams.new_event()
        event.record(side)
        hosts = [id(host) for _, _, _, host in moves]
        self._writes.update((h, event) for h in hosts)
        self._flights.append(_Flight(event, [v for _, _, v, _ in moves], hosts, nbytes))

    def _after_writes(self, host: Tensor, device: torch.device, stream: Any = None) -> None:
        """``stream`` (default: ``device``'s current one) waits for the copy back into
        ``host`` still in flight, if any: what a copy reading or writing it must follow."""
        event = self._writes.get(id(host))
        if event is not None:
            (stream or streams.current(device)).wait_event(event)

    def _retire(self, block_until: int) -> None:
        """Forget finished copies back; wait for the oldest until at most ``block_until``."""
        while self._flights and (len(self._flights) > block_until
                                 or self._flights[0].event.query()):
            f = self._flights.popleft()
            f.event.synchronize()
            self.device_bytes -= f.nbytes
            for h in f.hosts:
                if self._writes.get(h) is f.event:
                    del self._writes[h]

    def _landed(self) -> None:
        """Make the host wait for every copy back still in flight (``overlap=True``)."""
        self._retire(block_until=0)

    def synchronize(self) -> None:
        """Wait until every copy back has landed in host memory (``overlap=True``)."""
        self._retire(block_until=0)
        self._drop_ahead(host=True)

    # -- optimizer hooks -------------------------------------------------------
    def _before_read(self, *args: Any) -> None:
        self.synchronize()

    def loading(self, optimizer: Any) -> contextlib.AbstractContextManager[None]:
        """Around ``optimizer.load_state_dict`` (``InBackwardOptimizer``): the state loads
        into host memory (``layeropt/offload/loading.py``)."""
        return loading_into_host(self, optimizer)

    def _before_step(self, optimizer: Any, *args: Any) -> None:
        if not optimizer.attached:
            raise LayeroptError(
                "optimizer.step() of an optimizer that is not attached steps every "
                "parameter at once, but its state is offloaded to host memory "
                "(layeropt.offload.offload_state) and is brought to the device one bucket "
                "at a time inside backward. Attach it first (layeropt.attach(model, opt)), "
                "or call handle.remove() to bring the state back to the device."
            )

    # -- the handle ------------------------------------------------------------
    def remove(self) -> None:
        """Bring the state back to the parameters' devices and stop offloading; held
        gradients in host memory go back into ``.grad`` (as without offload)."""
        self.synchronize()
        opt = self.optimizer
        if self.held is not None:
            self.held.flush()
            self.held.up(list(self.held.host))
            if self.held.pool is not None:
                self.held.pool.release()
            self.held = None
            self._give_back.detach()
        if opt is None:
            return
        state = opt.state
        for p in self._params():
            s = state.get(p)
            for k, v in list(s.items()) if s else ():
                if self._host(p, k, v):
                    s[k] = empty_like(v, p.device).copy_(v)  # (a copy on the CPU too)
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self._hosts.clear()
        if self.pool is not None:
            self.pool.release()
            self.pool = None
        if opt._lo_engine.find(OffloadStepper) is self.stepper:
            opt._lo_engine.unwrap(self.stepper)
            opt._lo_stepper.use_fast_path(True)  # learned again from the device state
            opt._lo_stepper.wait_before_probes(None)

    @property
    def host_bytes(self) -> int:
        """Bytes of state kept in host memory now."""
        opt = self.optimizer
        state = opt.state if opt is not None else {}
        return sum(v.nbytes for p in self._params() for k, v in (state.get(p) or {}).items()
                   if self._host(p, k, v))


def offload_state(optimizer: Any, *, max_buckets: int = 2, overlap: bool = False,
                  held_grads: bool = True, prefetch: bool = False,
                  held_device_bytes: int = 0) -> StateOffload:
    """Keep ``optimizer``'s state in host memory; each bucket's comes to the device to step.

    Exact: parameters and optimizer state equal the same loop without offload
    bit for bit (copies only; torch's own ``step`` does the update; held
    gradients are summed with autograd's additions).

    Args:
        optimizer: a layeropt optimizer (``layeropt.AdamW``, ``layeropt.in_backward(X)``).
        max_buckets: with ``overlap``, the most buckets whose state is on the device
            at once (>= 1); without it, one bucket's is.
        overlap: copy each bucket's state back on a side stream while the next one
            steps (CUDA only). With ``held_grads`` it needs ``prefetch`` too: overlap
            alone with held gradients in host memory has not run exact on a GPU yet and
            is refused (docs/offload.md).
        held_grads: gradients held for a later step (``no_step()`` accumulation, a
            ``retain_graph=True`` backward) wait in host memory too, each bucket's
            moved as soon as it has landed and brought back for its step
            (``layeropt/offload/held.py``); ``.grad`` is ``None`` meanwhile. ``False``
            keeps them in ``.grad`` on the device.
        held_device_bytes: with ``held_grads``, the held gradients of whole buckets
            stay in ``.grad`` on the device up to this many bytes (the first buckets
            to land in a window); only the rest move. Default 0: all of them move.
            ``layeropt plan MODEL --gpu-memory SIZE --accumulate N`` gives the
            budget that fits, the most of up to three it plans (docs/plan.md).
        prefetch: fetch the state (and held gradient sums) of the buckets expected
            next, in the order they landed in the previous backward, while the
            backward goes on, at most ``max_buckets`` ahead (``layeropt/offload/prefetch.py``;
            CUDA only, off by default; with ``overlap``, bit-identical to torch.optim on
            an H200, 2026-12-04, also at 7B).

    Returns:
        A :class:`StateOffload`; ``handle.remove()`` brings the state back.

    Example:
        >>> opt = layeropt.AdamW(model.parameters(), lr=1e-4)  # doctest: +SKIP
        >>> layeropt.attach(model, opt)  # doctest: +SKIP
        >>> handle = layeropt.offload.offload_state(opt)  # doctest: +SKIP
    """
    if not isinstance(optimizer, InBackwardOptimizer):
        raise TypeError(
            f"offload_state() needs a layeropt optimizer (layeropt.AdamW, "
            f"layeropt.in_backward(X)), got {type(optimizer).__qualname__}: only updates "
            "made inside backward, one bucket at a time, can bring the state in piece by piece."
        )
    if isinstance(held_device_bytes, bool) or not isinstance(held_device_bytes, int) or \
            held_device_bytes < 0:
        raise ValueError("offload_state(held_device_bytes=...) must be an int >= 0 (bytes), "
                         f"got {held_device_bytes!r}")
    if isinstance(max_buckets, bool) or not isinstance(max_buckets, int) or max_buckets < 1:
        raise ValueError(f"offload_state(max_buckets=...) must be an int >= 1, got {max_buckets!r}")
    if optimizer._lo_engine.find(OffloadStepper) is not None:
        raise LayeroptError(
            "this optimizer's state is already offloaded; call remove() on the handle "
            "offload_state() returned before offloading it again."
        )
    if optimizer._lo_engine.find(Verifier) is not None:  # (its first steps run both ways)
        raise LayeroptError(VERIFY_OFFLOAD_ERROR)
    params = [p for g in optimizer.param_groups for p in g["params"]]
    odd = sorted({type(p).__name__ for p in params if type(p) not in (Tensor, torch.nn.Parameter)})
    if odd:
        raise LayeroptError(
            f"offload_state() moves plain tensors; these parameters are {', '.join(odd)} "
            "(FSDP2's DTensor shards, or another tensor subclass). Use it on a model that "
            "is not sharded, or without offload."
        )
    refusal = mode_refusal(overlap, prefetch, held_grads, [p.device for p in params],
                           torch.cuda.is_available())
    if refusal is not None:
        raise LayeroptError(refusal)
    # the host pools (offload/pool.py): on CUDA not yet, as no GPU run has shown them; the
    # CUDA tests and benchmarks/offload_7b.py build them with StateOffload(pooled=True)
    pooled = not any(p.device.type == "cuda" for p in params)
    return _install(optimizer,
                    StateOffload(optimizer, max_buckets, overlap, held_grads, prefetch,
                                 held_device_bytes, pooled=pooled))


def mode_refusal(overlap: bool, prefetch: bool, held_grads: bool,
                 devices: list[torch.device], cuda: bool) -> str | None:
    """Why :func:`offload_state` refuses a mode for parameters on ``devices`` (``cuda``:
    whether CUDA is available), or ``None``: a side stream needs CUDA parameters (said
    first: not a fix that fails too); overlap alone with held gradients has not been
    shown exact on a GPU."""
    for name, on in (("overlap", overlap), ("prefetch", prefetch)):
        where = sorted({str(d) for d in devices if d.type != "cuda"})
        if on and (where or not cuda):
            return (f"offload_state({name}=True) copies on a CUDA side stream, but parameters "
                    f"are on {', '.join(where) or 'no CUDA device'}. Use {name}=False (the "
                    "default): the same results, the copies in line with the steps.")
    if overlap and held_grads and not prefetch:  # (the one mode no GPU run has shown exact)
        return OVERLAP_HELD_ERROR
    return None


def _install(optimizer: Any, handle: StateOffload) -> StateOffload:
    """Make ``handle`` where ``optimizer``'s state lives (its state moved to the host now)."""
    handle._to_host_all()
    optimizer._lo_stepper.use_fast_path(False)  # it keeps lists of the state tensors
    optimizer._lo_stepper.wait_before_probes(handle._landed)  # (copies back in flight)
    optimizer._lo_engine.wrap(handle.stepper)
    return handle
