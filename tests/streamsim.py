"""CUDA streams simulated on the CPU: is every read and write of offload's copies ordered?

``layeropt/offload/streams.py`` is the one place offload makes streams, events
and asynchronous copies. :func:`simulate` swaps it for a :class:`Sim` in
which every copy between host and device memory is asynchronous, as on
CUDA, and watches every aten op (a ``TorchDispatchMode``):

* an op that touches a tensor in device memory runs on the current
  simulated stream; one that touches only host memory runs on the host;
* each stream and the host keep a vector clock. An op issued by the host
  follows what the host did before; ``wait_event``/``wait_stream`` order a
  stream after another's past; ``synchronize``, a blocking copy and a value
  read by the host (``.item()``) order the host after a stream's past;
* each storage remembers its last write and the reads since. An op that
  reads a storage whose last write it is not ordered after, or writes one
  whose reads or write it is not ordered after, is a race: recorded in
  :attr:`Sim.races` with both ops.

The values are computed at once (the CPU runs each op when issued), so a
race does not change a number here: it is reported instead. Host memory is
what offload allocates as host memory (``HostHeld._new_host``,
``StateOffload._new_host``, ``HostPool.take``) and what host-only ops make; everything else is device
memory. A storage a tensor adopts with ``set_`` (``copy.deepcopy``,
``torch.frombuffer`` make storages without an op seen here) is new memory. Not
modelled: the caching allocator's reuse of freed memory
across streams (``record_stream``); events are never done when queried
unless ``query`` says otherwise.
"""

from __future__ import annotations

import contextlib
import itertools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from layeropt.offload import held, pool, state, streams
from layeropt.offload.state import StateOffload, _install

HOST = "host"
aten = torch.ops.aten
_UNINITIALIZED = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default,
                  aten.new_empty.default, aten.new_empty_strided.default}
_ADOPT = {aten.set_.source_Storage, aten.set_.source_Storage_storage_offset}
_TO_HOST = {aten._local_scalar_dense.default, aten.equal.default, aten.is_nonzero.default}


@dataclass
class _Record:
    """One storage's accesses: its last write and the reads since, as (agent, tick)."""
    write: tuple[str, int] | None = None
    reads: dict[str, int] = field(default_factory=dict)


class SimStream:
    def __init__(self, sim: Sim, name: str) -> None:
        self.sim, self.name = sim, name
        sim.clocks[name] = {name: 0}

    def wait_event(self, event: SimEvent) -> None:
        self.sim._issue(self.name)
        self.sim._join(self.name, event.clock)

    def wait_stream(self, other: SimStream) -> None:
        self.sim._issue(self.name)
        self.sim._join(self.name, self.sim.clocks[other.name])

    def synchronize(self) -> None:
        self.sim._join(HOST, self.sim.clocks[self.name])

    def __repr__(self) -> str:
        return f"<stream {self.name}>"


class SimEvent:
    def __init__(self, sim: Sim) -> None:
        self.sim, self.clock = sim, {}

    def record(self, stream: SimStream | None = None) -> None:
        stream = stream or self.sim.current
        self.sim._issue(stream.name)
        self.clock = dict(self.sim.clocks[stream.name])

    def query(self) -> bool:
        done = self.sim.query()
        if done:  # the host has seen it finish
            self.synchronize()
        return done

    def synchronize(self) -> None:
        self.sim._join(HOST, self.clock)


class Sim:
    """The simulated streams, events and accesses (see the module docstring).

    Attributes:
        races: one line per unordered access (empty: every access was ordered).
        ops: how many aten ops ran on each agent (the host or a stream).
    """

    def __init__(self, query: Callable[[], bool] = lambda: False) -> None:
        self.query = query
        self.clocks: dict[str, dict[str, int]] = {HOST: {HOST: 0}}
        self.default = SimStream(self, "default")
        self.current = self.default
        self._names = itertools.count(1)
        self.records: dict[int, _Record] = {}
        self.host: set[int] = set()  # storages (or pool entries) in host memory
        self.pooled: set[int] = set()  # storages of HostPool entries (given again and again)
        self.races: list[str] = []
        self.ops: dict[str, int] = {}

    # -- clocks ---------------------------------------------------------------
    def _join(self, agent: str, other: dict[str, int]) -> None:
        mine = self.clocks[agent]
        for k, v in other.items():
            if mine.get(k, 0) < v:
                mine[k] = v

    def _issue(self, agent: str) -> None:
        """The host queues work on ``agent``: it follows everything the host did."""
        if agent != HOST:
            self._join(agent, self.clocks[HOST])

    def _tick(self, agent: str) -> int:
        self._issue(agent)
        clock = self.clocks[agent]
        clock[agent] += 1
        self.ops[agent] = self.ops.get(agent, 0) + 1
        return clock[agent]

    def _after(self, agent: str, access: tuple[str, int] | None) -> bool:
        return access is None or access[0] == agent or \
            self.clocks[agent].get(access[0], 0) >= access[1]

    # -- streams.py's functions -----------------------------------------------
    def new_stream(self, device: torch.device) -> SimStream:
        return SimStream(self, f"side{next(self._names)}")

    def current_stream(self, device: torch.device) -> SimStream:
        return self.current

    @contextlib.contextmanager
    def on(self, stream: SimStream | None) -> Iterator[None]:
        before = self.current
        self.current = stream or before
        try:
            yield
        finally:
            self.current = before

    def new_event(self) -> SimEvent:
        return SimEvent(self)

    def host_waits(self, device: torch.device) -> None:
        self.current.synchronize()

    def synchronize(self) -> None:
        """The host waits for every stream (``torch.cuda.synchronize()``)."""
        for name in list(self.clocks):
            self._join(HOST, self.clocks[name])

    def make_host(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` is host memory from now on: a fresh allocation (no accesses yet), or a
        pool's entry given again (its accesses so far still count)."""
        key = _key(t)
        if key is not None and key not in self.pooled:
            self.host.add(key)
            self.records[key] = _Record()
        return t

    def pool_entry(self, t: torch.Tensor | None) -> torch.Tensor | None:
        """``t`` is a pool's entry: host memory, whose accesses count across the times
        it is given."""
        key = None if t is None else _key(t)
        if key is not None and key not in self.pooled:
            self.pooled.add(key)
            self.host.add(key)
            self.records[key] = _Record()
        return t

    # -- the ops --------------------------------------------------------------
    def observe(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        if func in _ADOPT:  # a storage made outside the ops seen here (deepcopy,
            key = _key(args[0])  # frombuffer): new memory, no accesses yet
            self.host.discard(key)
            self.records.pop(key, None)
            return
        reads, writes = _accesses(func, args, kwargs)
        inputs = {_key(t) for t in reads + writes} - {None}
        fresh = [k for k in map(_key, _tensors(out)) if k is not None and k not in inputs]
        touched = inputs | set(fresh)
        agent = HOST if inputs and inputs <= self.host else self.current.name
        tick = self._tick(agent)
        for t in reads + writes:
            rec = self.records.get(_key(t))
            if rec is not None and not self._after(agent, rec.write):
                self._race(func, agent, "reads", rec.write, t)
        for t in writes:
            rec = self.records.get(_key(t))
            if rec is None:
                continue
            for other in rec.reads.items():
                if not self._after(agent, other):
                    self._race(func, agent, "overwrites what was read by", other, t)
        for t in reads:
            key = _key(t)
            if key is not None:
                self.records.setdefault(key, _Record()).reads[agent] = tick
        for t in writes:
            key = _key(t)
            if key is not None:
                self.records[key] = _Record(write=(agent, tick))
        for key in fresh:
            self.host.discard(key)
            if agent == HOST:
                self.host.add(key)
            self.records[key] = _Record(None if func in _UNINITIALIZED else (agent, tick))
        if agent != HOST and _blocking(func, args, kwargs, touched & self.host):
            self._join(HOST, self.clocks[agent])

    def _race(self, func: Any, agent: str, what: str, other: tuple[str, int],
              t: torch.Tensor) -> None:
        self.races.append(f"{func} on {agent} {what} {other[0]}'s op #{other[1]} unordered "
                          f"(tensor {tuple(t.shape)} {t.dtype}, "
                          f"{'host' if _key(t) in self.host else 'device'} memory)")


def _key(t: torch.Tensor) -> int | None:
    try:
        storage = t.untyped_storage()
    except (RuntimeError, NotImplementedError):
        return None
    return storage.data_ptr() if storage.nbytes() else None


def _tensors(x: Any) -> list[torch.Tensor]:
    return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]


def _accesses(func: Any, args: tuple, kwargs: dict) -> tuple[list, list]:
    """The tensors ``func`` reads and the ones it writes (by its schema); views are neither."""
    reads, writes = [], []
    for i, arg in enumerate(func._schema.arguments):
        value = args[i] if i < len(args) and not arg.kwarg_only else kwargs.get(arg.name)
        tensors = _tensors(value)
        alias = arg.alias_info
        if alias is None:
            reads += tensors
        elif alias.is_write:
            writes += tensors
    return reads, writes


def _blocking(func: Any, args: tuple, kwargs: dict, host: set[int]) -> bool:
    """Whether the host waits for ``func``: a value read back, or a copy between host
    and device memory without ``non_blocking``."""
    if func in _TO_HOST:
        return True
    if func is aten.copy_.default and host:
        non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
        return not non_blocking
    return False


class _Watch(TorchDispatchMode):
    def __init__(self, sim: Sim) -> None:
        super().__init__()
        self.sim = sim

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.sim.observe(func, args, kwargs, out)
        return out


@contextlib.contextmanager
def simulate(monkeypatch: Any, query: Callable[[], bool] = lambda: False) -> Iterator[Sim]:
    """Offload's streams simulated on the CPU for the block; yields the :class:`Sim`."""
    sim = Sim(query)
    for name, value in (("asynchronous", lambda device: True), ("current", sim.current_stream),
                        ("new_stream", sim.new_stream), ("on", sim.on),
                        ("new_event", sim.new_event), ("keep_for", lambda t, s: None),
                        ("host_waits", sim.host_waits),
                        ("host_waits_all", lambda device: sim.synchronize())):
        monkeypatch.setattr(streams, name, value)
    for cls in (held.HostHeld, state.StateOffload):
        original = cls._new_host
        monkeypatch.setattr(cls, "_new_host",
                            lambda self, *a, _o=original: sim.make_host(_o(self, *a)))
    take = pool.HostPool.take
    monkeypatch.setattr(pool.HostPool, "take",
                        lambda self, key, like: sim.pool_entry(take(self, key, like)))
    with _Watch(sim):
        yield sim


# -- offload's modes -----------------------------------------------------------------
# name -> StateOffload arguments (built directly: offload_state refuses the streams on CPU)
MODES = {
    "sync": dict(overlap=False),
    "overlap, held on device": dict(overlap=True, held_grads=False),
    "overlap, one bucket": dict(overlap=True, held_grads=False, max_buckets=1),
    "prefetch": dict(prefetch=True),
    "overlap + prefetch": dict(overlap=True, prefetch=True),
    "overlap + prefetch, 3 buckets": dict(overlap=True, prefetch=True, max_buckets=3),
    "overlap + prefetch, half held on device": dict(overlap=True, prefetch=True,
                                                     held_device_bytes=-2),
    "overlap alone, held in host memory (refused)": dict(overlap=True),
    # copies in and out on streams of their own (not offered by offload_state yet)
    "overlap + prefetch, 2 copy streams": dict(overlap=True, prefetch=True, copy_streams=2),
    "overlap + prefetch, 2 copy streams, all in flight": dict(
        overlap=True, prefetch=True, copy_streams=2, max_buckets=64),
    # a later micro-batch's sum added on the device (HostHeld.add_on_device)
    "sync, sums added on the device": dict(add_on_device=True),
    "overlap + prefetch, 2 copy streams, sums added on the device": dict(
        overlap=True, prefetch=True, copy_streams=2, add_on_device=True),
}


def offload_in_mode(opt: Any, kw: dict[str, Any]) -> StateOffload:
    """``opt``'s state offloaded in the mode ``kw`` (a value of :data:`MODES`;
    ``held_device_bytes=-2``: half of the parameters' bytes), with a host pool."""
    kw = dict(kw)
    if kw.get("held_device_bytes") == -2:  # half of the model's gradient bytes
        kw["held_device_bytes"] = sum(p.nbytes for g in opt.param_groups
                                      for p in g["params"]) // 2
    kw.setdefault("overlap", False)
    return _install(opt, StateOffload(opt, kw.pop("max_buckets", 2), pooled=True, **kw))
