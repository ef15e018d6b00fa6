"""Live tensor bytes, counted at the dispatcher, by category and phase.

:class:`LiveBytes` is a ``TorchDispatchMode``: every tensor an operator returns
is looked at, and each storage it has not seen yet is counted (its ``nbytes``)
until the storage is freed (a weak reference on the storage's Python object,
which torch keeps alive exactly as long as the storage). Views share their
base's storage, so they cost nothing; in-place operators make nothing new.
Under ``FakeTensorMode`` no memory is used at all, yet the count is the one a
real run would see: on CPU it equals the profiler's live bytes to the byte.

Each storage has a category (:data:`CATEGORIES`): ``"activations"`` when made
with autograd recording (the forward pass, and checkpointed recomputation in
backward), ``"other"`` when made without (gradients of activations,
optimizer temporaries, inputs). :meth:`LiveBytes.track` moves known storages
(parameters, optimizer state, gradients) to their category.

Example:
    >>> import torch
    >>> with LiveBytes() as live:
    ...     x = torch.empty(256)
    ...     live.start()
    ...     y = x * 2
    ...     del y
    ...     z = x + 1
    >>> live.peak, live.start_bytes
    (2048, 1024)
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_flatten

__all__ = ["CATEGORIES", "LiveBytes", "storages"]

#: What a live byte is for, in the order the report stacks them.
CATEGORIES: tuple[str, ...] = (
    "parameters",
    "optimizer state",
    "gradients",
    "activations",
    "other",
)
PARAMETERS, STATE, GRADIENTS, ACTIVATIONS, OTHER = CATEGORIES


def storages(t: Tensor) -> list[Any]:
    """The untyped storages behind ``t`` (a wrapper subclass's inner tensors too).

    Args:
        t: a tensor, a fake tensor or a traceable wrapper subclass (such as
            torchao's low-bit optimizer states).

    Returns:
        The storages, without repeats.

    Example:
        >>> x = torch.zeros(4)
        >>> len(storages(x)), len(storages(x[1:]))
        (1, 1)
    """
    out: dict[int, Any] = {}
    todo = [t]
    while todo:
        obj = todo.pop()
        if is_traceable_wrapper_subclass(obj):
            names, _ = obj.__tensor_flatten__()
            todo += [v for v in (getattr(obj, n) for n in names) if isinstance(v, Tensor)]
        elif isinstance(obj, Tensor):
            st = obj.untyped_storage()
            out.setdefault(id(st), st)
    return list(out.values())


_RECORDING = ("forward", "backward")
_RESIZING = {"resize_", "resize_as_", "set_", "_resize_output_"}


def _plain_types() -> tuple[type, ...]:
    from torch._subclasses.fake_tensor import FakeTensor

    return (Tensor, torch.nn.Parameter, FakeTensor)


_PLAIN = _plain_types()


def _may_allocate(func: Any) -> bool:
    """Whether ``func`` can return a storage it did not get as an input.

    Views and in-place operators return their inputs' storages, except the
    few that resize a storage in place.
    """
    schema = getattr(func, "_schema", None)
    if schema is None:
        return True
    if schema.name.split("::")[-1] in _RESIZING:
        return True
    returns = schema.returns
    return not returns or any(r.alias_info is None for r in returns)


_UNKNOWN = object()
# A tensor's metadata asked through the mode (``t.device`` of a fake tensor): no operator
# runs, and how often it is asked depends on what the process cached before (torch.optim's
# device checks), so counting it would move a peak's place in its phase from run to run.
_QUERIES = frozenset(getattr(torch.ops.prim, name).default for name in ("device", "layout")
                     if hasattr(torch.ops.prim, name))


def _python_body(func: Any) -> Any:
    """The Python function behind a ``torch.library.custom_op``, else ``None``."""
    try:
        from torch._library.custom_ops import _maybe_get_opdef

        opdef = _maybe_get_opdef(func)
    except Exception:  # pragma: no cover - private torch API moved
        return None
    return getattr(opdef, "_init_fn", None)


class _Storage:
    __slots__ = ("nbytes", "fake_nbytes", "category", "ref", "serial")

    def __init__(self, nbytes: int, category: str, serial: int = 0) -> None:
        self.nbytes = self.fake_nbytes = nbytes
        self.category = category
        self.ref: Any = None
        self.serial = serial


class LiveBytes(TorchDispatchMode):
    """Count the bytes of every live tensor storage, as operators make and free them.

    Use it as a context manager, under ``FakeTensorMode`` for a plan (no memory
    is used) or on real tensors. Storages that existed before it was entered
    are unknown to it: enter it before the model is built.

    Attributes:
        total: bytes live now.
        by_category: bytes live now, per category in :data:`CATEGORIES`.
        phase: a label the caller sets (``"forward"``, ``"backward"``, ...);
            the peak remembers the phase it fell in.
        peak: highest ``total`` since :meth:`start`.
        at_peak: ``by_category`` at that moment.
        peak_phase: ``phase`` at that moment.
        peak_op: index (since :meth:`start`) of the operator that made the peak.
        peak_op_in_phase: index of that operator within its phase.
        ops_per_phase: operators seen per phase since :meth:`start`.
        start_bytes: ``total`` when :meth:`start` was called.
        log: ``None``, or a list to which every allocation and free is appended
            in order, as ``(serial, nbytes)`` for an allocation and
            ``(serial, 0)`` for its free (a kernel's workspace is both, at once):
            what :class:`~layeropt.plan.allocator.CachingAllocator` replays.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: dict[int, _Storage] = {}
        self.total = 0
        self.by_category = dict.fromkeys(CATEGORIES, 0)
        self.phase = "setup"
        self.start_bytes = 0
        self.peak = 0
        self.at_peak = dict(self.by_category)
        self.peak_phase = self.phase
        self.peak_op = 0
        self.peak_op_in_phase = 0
        self.ops_per_phase: dict[str, int] = {}
        self.op_names_at_peak = ""
        self._ops = 0
        self._fresh: dict[Any, bool] = {}
        self._bodies: dict[Any, Any] = {}
        self._paused = 0
        #: ``(func, args, kwargs) -> bytes`` a kernel allocates and frees
        #: inside itself (counted at the peak only, as "other").
        self.workspace: Any = None
        #: ``(func, args, kwargs, out) -> nbytes | None``: the real size of
        #: ``out``'s storage when it differs from the fake one.
        self.storage_size: Any = None
        self.log: list[tuple[int, int]] | None = None
        self._serial = 0

    # -- counting ---------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func in _QUERIES:
            return func(*args, **(kwargs or {}))
        body = self._bodies.get(func, _UNKNOWN)
        if body is _UNKNOWN:
            body = self._bodies[func] = _python_body(func)
        if body is not None and not self._paused:
            out = self._run_body(func, body, args, kwargs or {})
        else:
            out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        fresh = self._fresh.get(func)
        if fresh is None:
            fresh = self._fresh[func] = _may_allocate(func)
        if fresh:
            grad_mode = torch.is_grad_enabled()
            category = ACTIVATIONS if grad_mode and self.phase in _RECORDING else OTHER
            if isinstance(out, Tensor):
                self._see_tensor(out, category)
            elif isinstance(out, (tuple, list)):
                for t in out:
                    if isinstance(t, Tensor):
                        self._see_tensor(t, category)
                    elif isinstance(t, (tuple, list)):
                        self.track(t, None, category)
            if self.storage_size is not None and isinstance(out, Tensor):
                real = self.storage_size(func, args, kwargs or {}, out)
                if real is not None:
                    self._count_as(out.untyped_storage(), real)
        extra = self.workspace(func, args, kwargs or {}) if self.workspace is not None else 0
        if extra and self.log is not None:
            self._serial += 1
            self.log += ((self._serial, extra), (self._serial, 0))
        self._ops += 1
        n = self.ops_per_phase.get(self.phase, 0)
        self.ops_per_phase[self.phase] = n + 1
        if self.total + extra > self.peak:
            self._new_peak(func, n, extra)
        return out

    def _run_body(self, func: Any, body: Any, args: Any, kwargs: dict) -> Any:
        """Run a Python custom op's own code, so its temporaries are counted too.

        Its registered fake kernel makes only the outputs; a real run also
        allocates whatever the body does (a chunked loss's chunk of logits).
        Bodies that read tensor values cannot run on fake tensors: those fall
        back to the fake kernel.
        """
        from torch._subclasses.fake_tensor import DataDependentOutputException

        try:
            with self:  # count the body's operators (a mode is off in its own handler)
                return body(*args, **kwargs)
        except (DataDependentOutputException, RuntimeError, NotImplementedError):
            self._bodies[func] = None
            return func(*args, **kwargs)

    def _see_tensor(self, t: Tensor, category: str) -> None:
        if type(t) in _PLAIN:
            self._see(t.untyped_storage(), category)
        else:
            for st in storages(t):
                self._see(st, category)

    def _see(self, st: Any, category: str) -> None:
        key = id(st)
        info = self._live.get(key)
        if info is not None:
            if info.fake_nbytes != st.nbytes():  # resized in place (resize_, set_)
                info.fake_nbytes = st.nbytes()
                self._count_as(st, info.fake_nbytes)
            return
        self._serial += 1
        info = _Storage(st.nbytes(), category, self._serial)
        info.ref = weakref.ref(st, _Freed(self, key, info))
        self._live[key] = info
        self._add(category, info.nbytes)
        if self.log is not None and info.nbytes:
            self.log.append((info.serial, info.nbytes))

    def _add(self, category: str, nbytes: int) -> None:
        self.by_category[category] += nbytes
        self.total += nbytes

    def _freed(self, key: int, info: _Storage) -> None:
        if self._live.get(key) is info:
            del self._live[key]
            self._add(info.category, -info.nbytes)
            if self.log is not None and info.nbytes:
                self.log.append((info.serial, 0))

    def _count_as(self, st: Any, nbytes: int) -> None:
        info = self._live.get(id(st))
        if info is not None and info.nbytes != nbytes:
            self._add(info.category, nbytes - info.nbytes)
            if self.log is not None:
                self._relog(info, nbytes)
            info.nbytes = nbytes

    def _relog(self, info: _Storage, nbytes: int) -> None:
        """Log a storage's new size as a new block, then the old one freed (as
        ``resize_`` does: allocate, copy, free)."""
        old = info.serial
        self._serial += 1
        info.serial = self._serial
        if nbytes:
            self.log.append((info.serial, nbytes))
        if info.nbytes:
            self.log.append((old, 0))

    def _new_peak(self, func: Any, op_in_phase: int, workspace: int = 0) -> None:
        self.peak = self.total + workspace
        self.at_peak = dict(self.by_category)
        self.at_peak[OTHER] += workspace
        self.peak_phase = self.phase
        self.peak_op = self._ops
        self.peak_op_in_phase = op_in_phase
        self.op_names_at_peak = str(func)

    # -- control ----------------------------------------------------------
    def start(self) -> None:
        """Start measuring: the peak is taken from here on."""
        self.start_bytes = self.total
        self.peak = self.total
        self.at_peak = dict(self.by_category)
        self.peak_phase = self.phase
        self.peak_op = self.peak_op_in_phase = 0
        self.ops_per_phase = {}
        self._ops = 0

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """Inside: operators run uncounted (a fused kernel's temporaries)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def track(self, tensors: Any, category: str | None = None, new: str = "other") -> None:
        """Count the storages of ``tensors`` (any nesting) if not yet counted.

        Args:
            tensors: tensors, possibly in lists, tuples and dicts.
            category: the category to give them, also when already counted
                (default: keep the category of those already counted).
            new: the category of storages not counted yet when ``category``
                is ``None``.
        """
        for t in tree_flatten(tensors)[0]:
            if not isinstance(t, Tensor):
                continue
            for st in storages(t):
                self._see(st, category or new)
                if category is not None:
                    self._recategorise(st, category)

    def _recategorise(self, st: Any, category: str) -> None:
        info = self._live.get(id(st))
        if info is not None and info.category != category:
            self.by_category[info.category] -= info.nbytes
            self.by_category[category] += info.nbytes
            info.category = category
            if self._ops == self.peak_op and self.total == self.peak:
                self.at_peak = dict(self.by_category)  # the peak's op made it


class _Freed:
    """Weak-reference callback: the storage is gone, stop counting it."""

    __slots__ = ("tracker", "key", "info")

    def __init__(self, tracker: LiveBytes, key: int, info: _Storage) -> None:
        self.tracker = weakref.ref(tracker)
        self.key = key
        self.info = info

    def __call__(self, _ref: Any) -> None:
        tracker = self.tracker()
        if tracker is not None:
            tracker._freed(self.key, self.info)
