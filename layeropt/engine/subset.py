"""Stepping a subset of an optimizer's parameters with its own ``step``.

The one primitive behind every in-backward update. The rule it keeps:
stepping the parameters a bucket at a time during one training step gives
what one ``step()`` over all of them gives - or it is refused, with nothing
changed.

Two ways to call ``step`` on a subset:

* **narrowed**: each param group's ``params`` list is cut to the subset's
  members for the call. Only for torch.optim's own classes, whose ``step``
  reads nothing but the parameters it is handed and never writes its param
  groups. Cheapest: O(subset) per call.
* **whole**: the param groups stay as they are and the gradients of the
  parameters outside the subset are hidden (``.grad = None``) for the call -
  torch's contract that a parameter without a gradient is skipped, which
  every torch-style optimizer honours. Configuration keyed by group or
  parameter *index* (bitsandbytes' ``register_module_override``) then stays
  right. For every other optimizer; O(all parameters) per call.

**Param-group state.** Some optimizers keep state in the param-group dict and
advance it in every ``step`` call (schedule-free's ``k``, ``weight_sum``,
``lr_max``). One training step is one *transaction* (from one
``step()``/``zero_grad()`` boundary, or one attached backward, to the next):
every call in it starts from the group values the transaction started with and
must end with the values the first call ended with, which the groups then keep.
If a call ends with different values, the group state depends on which
gradients it saw - a global estimate such as D-Adaptation's or Prodigy's ``d``
- and cannot be stepped a layer at a time. In the first
:attr:`SubsetStepper.PROBED_STEPS` training steps (D-Adaptation agrees with
itself on its first step) the first parameters of a step are stepped one at
a time from saved copies, and on a mismatch they are restored (parameters,
state and groups) and :class:`~layeropt.errors.BackwardStateError` is raised
before anything else is updated; later steps are checked on every call too.
"""

from __future__ import annotations

import copy
import math
import numbers
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from .fastpath import fast_path_for
from ..errors import (
    BackwardStateError,
    GLOBAL_ESTIMATE_ERROR,
    LATE_MOVE_ERROR,
    RANDOM_STEP_ERROR,
    SKIP_CONTRACT_ERROR,
)

__all__ = ["INSIDE", "SubsetStepper", "narrowable"]


def narrowable(step: Callable[..., Any]) -> bool:
    """Whether ``step`` is one of torch.optim's own (a narrowed call is exact)."""
    return getattr(step, "__module__", "").startswith("torch.optim")


_MISSING = object()

#: The third-party optimizers whose own ``step`` runs now, for a subset of their parameters
#: (innermost last): a step they call on an optimizer they wrap (Lookahead's base) is part
#: of the update, not a second optimizer (``layeropt/checking/watch.py``).
INSIDE: list[Any] = []


def _same(a: Any, b: Any) -> bool:
    if a is b:
        return True
    if isinstance(a, Tensor) or isinstance(b, Tensor):
        return (
            isinstance(a, Tensor)
            and isinstance(b, Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and bool(torch.equal(a, b))
        )
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    if isinstance(a, (tuple, list)) and type(a) is type(b):  # (tensor betas: each item)
        return len(a) == len(b) and all(map(_same, a, b))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - an unusual value that cannot be compared
        return False


def _copy(v: Any) -> Any:
    """A group value as it is now: tensors copied, also inside a tuple or list (betas)."""
    if isinstance(v, Tensor):
        return v.detach().clone()
    if isinstance(v, (tuple, list)) and any(isinstance(x, Tensor) for x in v):
        return type(v)(map(_copy, v))
    return v


def _values(group: dict[str, Any]) -> dict[str, Any]:
    """A group's values other than ``params``; tensors copied (steps may update them in place)."""
    return {k: _copy(v) for k, v in group.items() if k != "params"}


def _changed(before: dict[str, Any], group: dict[str, Any]) -> list[str]:
    keys = set(before) | (set(group) - {"params"})
    return sorted(k for k in keys if not _same(before.get(k, _MISSING), group.get(k, _MISSING)))


def _identical(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` holds ``b``'s values bit for bit (the sign of a zero too)."""
    if a.dtype != b.dtype or a.device != b.device or not torch.equal(a, b):
        return False
    return not a.is_floating_point() or torch.equal(a.signbit(), b.signbit())


def _restore_values(target: dict[str, Any], values: dict[str, Any], now: Any) -> None:
    """Put ``values`` back into ``target`` (a param group, or the optimizer's ``vars``);
    keys of ``now`` (what the snapshot covers) that it lacks were made since: deleted."""
    for k in [k for k in now if k not in values]:
        del target[k]
    for k, v in values.items():
        old = target.get(k)
        if isinstance(v, Tensor) and isinstance(old, Tensor) and old.shape == v.shape:
            if not _identical(old, v):  # (unchanged: left alone, its version too - a
                with torch.no_grad():  # tensor lr's, which the loop's own check reads)
                    old.copy_(v)  # the same tensor object, as torch code may hold it
        else:  # (a container: a copy, the snapshot stays as it was for the next call)
            target[k] = v.clone() if isinstance(v, Tensor) else copy.deepcopy(v)


# Instance attributes that are the optimizer's machinery, not its algorithm's state.
_MACHINERY = {"param_groups", "state", "defaults", "_opt_called", "last_grad_norm",
              "_zero_grad_profile_name", "_warned_capturable_if_run_uncaptured"}
_PLAIN = (bool, int, float, complex, str, type(None), numbers.Number)  # (numpy's too)
_SCALARS = (*_PLAIN, Tensor)


def _small_container(v: Any) -> bool:
    """A small dict / list / tuple of plain values (``self.counters = {"t": 0}``)."""
    if isinstance(v, (list, tuple)) and len(v) <= 64:
        return all(isinstance(x, _PLAIN) for x in v)
    if isinstance(v, dict) and len(v) <= 64:
        return all(isinstance(x, _PLAIN) for x in v.values())
    return False


def _kept(items: Any, clone: bool) -> dict[Any, Any]:
    """The scalars, tensors and small containers of plain values among ``items``: tensors
    and containers copied (``clone``), or as they are to compare."""
    return {k: (v.detach().clone() if clone and isinstance(v, Tensor) else
                copy.deepcopy(v) if clone and not isinstance(v, _PLAIN) else v)
            for k, v in items if isinstance(v, _SCALARS) or _small_container(v)}


def _own(optimizer: Any, copy: bool = True) -> dict[str, Any]:
    """Values the optimizer keeps on itself (``self.t += 1`` in ``step``, a counter in a
    dict on it): one training step moves them once, as its param-group values."""
    return _kept(((k, v) for k, v in vars(optimizer).items()
                  if k not in _MACHINERY and not k.startswith("_lo_")), copy)


def _state_own(optimizer: Any, copy: bool = True) -> dict[Any, Any]:
    """Entries of ``optimizer.state`` not keyed by a parameter (``state["step"]``)."""
    return _kept(((k, v) for k, v in optimizer.state.items() if not isinstance(k, Tensor)),
                 copy)


def _snapshot(optimizer: Any) -> list[dict[str, Any]]:
    """Every param group's values, then the optimizer's own (:func:`_own`), then its
    state's entries not keyed by a parameter."""
    return [*(_values(g) for g in optimizer.param_groups), _own(optimizer),
            _state_own(optimizer)]


def _diff(snapshot: list[dict[str, Any]], optimizer: Any) -> list[str]:
    """The keys whose values differ now from ``snapshot`` (``self.x`` for own values)."""
    keys = {k for b, g in zip(snapshot[:-2], optimizer.param_groups) for k in _changed(b, g)}
    keys.update(f"self.{k}" for k in _changed(snapshot[-2], _own(optimizer, copy=False)))
    keys.update(f"state[{k!r}]" for k in _changed(snapshot[-1], _state_own(optimizer, False)))
    return sorted(keys)


def _restore(optimizer: Any, snapshot: list[dict[str, Any]]) -> None:
    for g, values in zip(optimizer.param_groups, snapshot[:-2]):
        _restore_values(g, values, [k for k in g if k != "params"])
    # (an attribute a step call made since is deleted: ``self.t = getattr(...) + 1``)
    _restore_values(vars(optimizer), snapshot[-2], list(_own(optimizer, copy=False)))
    _restore_values(optimizer.state, snapshot[-1], list(_state_own(optimizer, copy=False)))


def _inner(t: Tensor) -> list[Tensor]:
    """The plain tensors a tensor is stored in (a quantized state's codes and scales)."""
    if type(t) is not Tensor and hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()  # (a DTensor lists its device mesh too)
        parts = [getattr(t, n) for n in names]
        return [x for part in parts if isinstance(part, Tensor) for x in _inner(part)]
    return [t]


class _Witness(NamedTuple):
    """A parameter a step call has no gradient for: its plain tensors and its state's
    (copied), and its state's keys, to see that the call left them as they were."""

    group: int
    param: Tensor
    copies: list[tuple[Tensor, Tensor]]
    keys: list[str]

    def changed(self, optimizer: Any) -> bool:
        return (sorted(map(str, optimizer.state.get(self.param, {}))) != self.keys
                or not all(torch.equal(x, c) for x, c in self.copies))


def _witnesses(optimizer: Any, params: list[Tensor]) -> list[_Witness]:
    """Each param group's smallest parameter outside ``params`` (the plain tensors of it
    and of its state: a DTensor's local shard): a step call over ``params`` leaves them
    as they are (torch's contract: no gradient, no change; an average of every weight
    kept in the state breaks it too). None on fake or meta tensors (``layeropt plan``),
    which hold no values."""
    inside = {id(p) for p in params}
    out = []
    for i, g in enumerate(optimizer.param_groups):
        rest = [q for q in g["params"] if id(q) not in inside]
        if rest:
            q = min(rest, key=lambda t: t.numel())
            state = optimizer.state.get(q, {})
            plain = [x for t in (q.detach(), *(v for v in state.values()
                                                if isinstance(v, Tensor))) for x in _inner(t)]
            if any(x.is_meta or is_fake(x) for x in plain):
                return []
            out.append(_Witness(i, q, [(x, x.clone()) for x in plain], sorted(map(str, state))))
    return out


def _rng_states(params: list[Tensor]) -> list[Tensor]:
    """The random generators a step call on ``params`` could draw from (the CPU's, and
    each CUDA device's of theirs)."""
    devices = {p.device for p in params if p.device.type == "cuda"}
    return [torch.random.get_rng_state(),
            *(torch.cuda.get_rng_state(d) for d in sorted(devices, key=str))]


class _Saved:
    """Copies of some parameters and their optimizer state, to undo a step call.

    Tensors are restored in place (``copy_``), so code holding them sees the
    old values again; tensor subclasses (torchao's quantized states) through
    the plain tensors they are made of.
    """

    def __init__(self, optimizer: Any, params: list[Tensor]) -> None:
        self.items = []
        for p in params:
            state = optimizer.state.get(p, _MISSING)
            if state is not _MISSING:
                state = dict(state)  # the same objects; tensor contents copied below
            tensors = [p, *(v for v in (state.values() if state is not _MISSING else ())
                            if isinstance(v, Tensor))]
            copies = [(x, x.detach().clone()) for t in tensors for x in _inner(t)]
            others = {} if state is _MISSING else {
                k: copy.deepcopy(v) for k, v in state.items() if not isinstance(v, Tensor)
            }
            self.items.append((p, state, copies, others))

    def restore(self, optimizer: Any) -> None:
        with torch.no_grad():
            for p, state, copies, others in self.items:
                for x, saved in copies:
                    x.copy_(saved)
                if state is _MISSING:
                    optimizer.state.pop(p, None)
                else:
                    optimizer.state[p] = {**state, **others}


class SubsetStepper:
    """Steps any subset of one optimizer's parameters (see the module docstring).

    Args:
        name: the optimizer's class name, for messages.
        step: calls the optimizer's own ``step``, as ``step(optimizer)``.
        narrow: step on narrowed param groups (torch.optim's own classes).
    """

    #: Training steps whose first two parameters are stepped one at a time from
    #: saved copies, so that a mismatch is refused with nothing changed. Later
    #: steps are still checked on every call (a mismatch then raises too).
    PROBED_STEPS = 3

    def __init__(self, name: str, step: Callable[..., Any], narrow: bool) -> None:
        self.step = step
        self.narrow = narrow
        self.name = name
        self._key: object = None  # the open transaction
        self._pre: list[dict[str, Any]] | None = None  # values it started with (_snapshot)
        self._post: list[dict[str, Any]] | None = None  # and those its first call ended with
        self._moved = False  # whether the transaction's first call changed group values
        self._probes_left = self.PROBED_STEPS
        self._probing = False  # this transaction's first parameters go one at a time
        self._saved: list[_Saved] = []  # undo records of the probe calls
        self.fast: Any = _MISSING  # narrowed calls: torch's update on prepared lists, or None
        self._settle: Callable[[], None] | None = None  # (wait_before_probes)

    def use_fast_path(self, on: bool) -> None:
        """Let narrowed calls take the fast path (learned afresh), or not: a feature that
        moves the state tensors it keeps lists of (``offload_state``) turns it off."""
        self.fast = _MISSING if on else None

    def wait_before_probes(self, settle: Callable[[], None] | None) -> None:
        """Call ``settle`` before a probe reads other parameters' state: a feature whose
        writes to it may still be in flight (``offload_state``'s copies back) waits for
        them there; ``None``: nothing to wait for."""
        self._settle = settle

    # -- transactions ------------------------------------------------------
    def open(self, key: object) -> None:
        """Start the transaction ``key`` unless it is the open one."""
        if key != self._key:
            self._key, self._pre, self._post, self._saved = key, None, None, []
            self._probing = self._probes_left > 0

    def __call__(self, optimizer: Any, params: list[Tensor], key: object) -> None:
        """Update exactly ``params`` (each holds a ``.grad``) within transaction ``key``."""
        if key != self._key:
            self.open(key)
        if self.narrow:
            fast = self.fast
            if fast is not None and fast is not _MISSING and fast.step(optimizer, params):
                return  # torch's functional on the lists step would build (fastpath.py)
            self._narrowed(optimizer, params)
            return
        order = sorted(params, key=lambda p: p.numel()) if self._probing else params
        while self._probing and order:  # one at a time from saved copies (smallest first)
            p = order.pop(0)
            record = _Saved(optimizer, [p])
            self._saved.append(record)
            values = not (p.is_meta or is_fake(p))  # (layeropt plan's tensors hold none)
            if self._settle is not None:
                self._settle()
            witnesses = _witnesses(optimizer, [p])
            rng = _rng_states([p]) if values else []
            self._transact(optimizer, [p])
            self._check_skipped(optimizer, record, witnesses)
            if values and not all(map(torch.equal, rng, _rng_states([p]))):
                self._refuse_probe(optimizer, record, RANDOM_STEP_ERROR)
        if order:
            self._transact(optimizer, order)

    def _transact(self, optimizer: Any, params: list[Tensor]) -> None:
        if self._pre is None:  # the transaction's first call
            self._pre = _snapshot(optimizer)
            self._whole(optimizer, params)
            self._post = _snapshot(optimizer)
            self._moved = bool(_diff(self._pre, optimizer))
            if not self._moved:  # static group values this step: nothing to compare
                self._end_probe()
            return
        assert self._post is not None
        added = optimizer.param_groups[len(self._pre) - 2:]  # (add_param_group since)
        if added:  # their values now start the transaction; its next call ends them
            self._pre[-2:-2] = [_values(g) for g in added]
        if self._moved:
            _restore(optimizer, self._pre)
        self._whole(optimizer, params)
        if added:
            self._post[-2:-2] = [_values(g) for g in added]
        keys = _diff(self._post, optimizer)
        if keys:
            self._refuse(optimizer, keys, GLOBAL_ESTIMATE_ERROR if self._moved else LATE_MOVE_ERROR)
        self._end_probe()

    def step_ended(self, optimizer: Any, stepped: bool) -> None:
        """``step()`` ends a training step; ``stepped``: whether a call of it ran. torch's
        ``step()`` moves every group's values once, gradients or not (schedule-free's
        ``k``, ``weight_sum``): a group no call of the step moved - none ran, no parameter
        having a gradient, or the group was added since - gets a call with no gradient
        now. (torch's own classes change nothing without one.)"""
        if self.narrow:
            return
        if not stepped:  # (a transaction of its own)
            self._key, self._pre, self._post, self._saved = object(), None, None, []
            self._probing = False
        elif self._key is None or self._pre is None or len(
                optimizer.param_groups) <= len(self._pre) - 2:
            return
        self._transact(optimizer, [])

    def _check_skipped(self, optimizer: Any, record: _Saved,
                       witnesses: list[_Witness]) -> None:
        """Refuse a probed step call (``record``: its undo) that changed a parameter it had
        no gradient for, or its state; the call is undone, with the witnesses."""
        for w in witnesses:
            if w.changed(optimizer):
                with torch.no_grad():
                    for x, saved in (c for v in witnesses for c in v.copies):
                        x.copy_(saved)
                self._refuse_probe(optimizer, record, SKIP_CONTRACT_ERROR.replace(
                    "{shape}", str(tuple(w.param.shape))).replace("{group}", str(w.group)))

    def _refuse_probe(self, optimizer: Any, record: _Saved, message: str) -> None:
        if not any(r is record for r in self._saved):  # (cleared by _end_probe)
            self._saved.append(record)
        self._refuse(optimizer, [], message)

    def _end_probe(self) -> None:
        if self._probing:
            self._probing, self._saved = False, []
            self._probes_left -= 1

    def _refuse(self, optimizer: Any, keys: list[str], message: str) -> None:
        saved, self._saved = self._saved, []
        for record in reversed(saved):
            record.restore(optimizer)
        if self._pre is not None:
            _restore(optimizer, self._pre)
        self._key = None
        outcome = (
            "Nothing was updated." if saved else
            "Layers stepped earlier in this backward were updated with partial values."
        )
        raise BackwardStateError(
            message.format(name=self.name, keys=", ".join(keys), outcome=outcome)
        )

    # -- the two ways to call step ----------------------------------------
    def _narrowed(self, optimizer: Any, params: list[Tensor]) -> None:
        fast = self.fast  # (the fast path was tried: it has no lists for these yet)
        if fast is _MISSING:
            fast = self.fast = fast_path_for(optimizer)
            if fast is not None and fast.step(optimizer, params):
                return
        groups = optimizer.param_groups
        if len(groups) == 1:
            order, members = [0], [params]
        else:
            index = optimizer._group_index()
            by_group: dict[int, list[Tensor]] = {}
            for p in params:
                by_group.setdefault(index[id(p)][0], []).append(p)
            order = sorted(by_group)
            members = [by_group[i] for i in order]
        narrowed = [groups[i] for i in order]
        saved = [g["params"] for g in narrowed]
        try:
            for g, ps in zip(narrowed, members):
                g["params"] = ps
            optimizer.param_groups = narrowed
            self.step(optimizer)
        finally:
            optimizer.param_groups = groups
            for g, ps in zip(narrowed, saved):
                g["params"] = ps
        if fast is not None:
            fast.learn(optimizer, params, order, members)

    def _whole(self, optimizer: Any, params: list[Tensor]) -> None:
        keep = {id(p) for p in params}
        hidden = [
            (p, p.grad)
            for g in optimizer.param_groups
            for p in g["params"]
            if p.grad is not None and id(p) not in keep
        ]
        INSIDE.append(optimizer)
        try:
            for p, _ in hidden:
                p.grad = None
            self.step(optimizer)
        finally:
            INSIDE.pop()
            for p, grad in hidden:
                p.grad = grad
