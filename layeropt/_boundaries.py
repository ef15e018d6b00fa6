"""Training steps at one engine: what a step holds for later, and its boundaries.

The base of ``_rules.Rules`` (and so of ``landing.Engine``). A
:class:`StepRecord` is made at each training-step boundary - ``step()``,
``zero_grad()`` - and holds what belongs to one training step: how many of
its backwards updated parameters or held every gradient (the accumulation
rule), the gradients held for a later step, the param groups as its first
update read them. Here also:

* held gradients: kept in ``.grad`` (or, with the state offloaded, in host
  memory: ``layeropt/_held.py``) by ``no_step()`` and the other holds, stepped
  with their bucket when it completes, at the end of the next stepping
  backward, by ``layeropt.backward``'s step pass or by ``step()``;
* the boundaries (rule 6 of ``layeropt/_rules.py``): ``step()`` steps what the
  hooks left (held, assigned by hand; a zero gradient for what
  ``zero_grad(set_to_none=False)`` keeps) and refuses a gradient set on a
  parameter backward already updated; ``step()``/``zero_grad()`` refuse what
  torch would take as one step of several, hyperparameters changed after
  backward, and a ``zero_grad()`` that discards what a backward applied.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any, NamedTuple

import torch
from torch import Tensor

from . import _between
from .errors import (
    ACCUMULATION_ERROR,
    DISCARD_ERROR,
    SCALED_CLIP_ERROR,
    BackwardStateError,
)

__all__ = ["StepRecord", "StepRules", "Group"]


class Group(NamedTuple):
    """Parameters stepped in one call, with the ``Settings`` that clip them: the part of
    a bucket that landed, an averaged DDP bucket, one module's held gradients."""

    params: list[Tensor]
    settings: Any


class StepRecord:
    """One training step at one engine, from a ``step()``/``zero_grad()`` to the next.

    Attributes:
        stepped_backwards / held_backwards: its backwards that updated parameters,
            or held every gradient for ``step()`` (the accumulation rule).
        held: gradients kept for a later step (``no_step()`` and the other holds),
            with their bucket (``None``: not hooked yet); in ``.grad``, or in host
            memory with ``offload_state`` (``layeropt/_held.py``).
        hyper / hyper_txn: the param groups as its first update read them, and
            the transaction that update belonged to (``layeropt/_between.py``).
        skipped: parameters with a gradient in a step ``GradScaler`` skipped (inf/NaN):
            torch keeps their ``.grad`` as zeros at ``zero_grad(set_to_none=False)``.
    """

    __slots__ = ("stepped_backwards", "held_backwards", "held", "hyper", "hyper_txn",
                 "skipped")

    def __init__(self) -> None:
        self.stepped_backwards = self.held_backwards = 0
        self.held: dict[Tensor, Any] = {}
        self.skipped: list[Tensor] = []
        self.hyper: list[dict[str, Any]] | None = None
        self.hyper_txn = -1


class StepRules:
    """The engine's training-step side (see the module docstring)."""

    train_step: StepRecord
    attachments: dict[Any, None]
    _optimizer: Callable[[], Any]

    # -- held gradients ----------------------------------------------------------
    def _host_held(self) -> Any:
        """Where held gradients wait in host memory (``offload_state``'s
        :class:`layeropt._held.HostHeld`), or ``None``."""
        optimizer = self._optimizer()
        place = None if optimizer is None else optimizer.__dict__.get("_lo_state_place")
        return None if place is None else place.held

    def _take(self, param: Tensor) -> None:
        """The measure pass reduces ``param``'s gradient, plus its held one (in host
        memory: a device copy for the moment)."""
        m = self.measure
        host = self._host_held() if self.train_step.held else None
        if not host or param not in host or id(param) in m.summed:
            m.take(param)
            return
        m.stash[param] = host.fetch(param)
        try:
            m.take(param)
        finally:
            del m.stash[param]

    def unhold(self, bucket: Any) -> None:
        """``bucket`` completed: its accumulated gradients are stepped with it (those in
        host memory brought back now)."""
        held = self.train_step.held
        host = self._host_held()
        if host:
            host.up([p for p in bucket.params if p in held])
        for p in bucket.params:
            held.pop(p, None)

    def _step_host_held(self, host: Any) -> None:
        """Step the held gradients still in host memory, a bucket at a time, each
        brought back just before its step (the bucket's state comes with it)."""
        buckets: dict[int, tuple[Any, list[Tensor]]] = {}
        for p, b in self.train_step.held.items():
            if p in host:
                buckets.setdefault(id(b), (b, []))[1].append(p)
        for b, params in buckets.values():
            for g in self.placed(params) if b is None else [Group(params, b.settings)]:
                host.up(g.params)
                self._step([g])

    @property
    def holds_gradients(self) -> bool:
        """Whether gradients wait for a later step (in ``.grad`` or in host memory)."""
        held = self.train_step.held
        host = self._host_held() if held else None
        return any(p.grad is not None or (host is not None and p in host) for p in held)

    def in_host_memory(self) -> list[Tensor]:
        """Parameters whose held gradient is in host memory (``.grad`` is ``None``)."""
        host = self._host_held() if self.train_step.held else None
        return [p for p in self.train_step.held if p in host] if host else []

    def step_held(self) -> None:
        """After ``layeropt.backward``'s step pass, with its transform still set: step
        the held gradients of parameters that pass did not reach."""
        held = self.train_step.held
        if held and not self.no_step_depth:
            host = self._host_held()
            self._step(self.placed([p for p in held if p.grad is not None]))
            if host:
                self._step_host_held(host)
            held.clear()

    def skip(self, had_grad: list[Tensor]) -> None:
        """This optimizer's step was skipped (an inf/NaN under ``GradScaler``): drop its
        gradients - ``had_grad``, those it had - as torch's ``zero_grad`` later would."""
        self.train_step.skipped += had_grad
        self.discard_held()
        optimizer = self._optimizer()
        for g in optimizer.param_groups if optimizer is not None else ():
            for p in g["params"]:
                p.grad = None

    def discard_held(self) -> None:
        """Drop the held gradients (their optimizer's step was skipped)."""
        host = self._host_held() if self.train_step.held else None
        if host is not None:
            host.drop()
        for p in self.train_step.held:
            p.grad = None
        self.train_step.held.clear()

    # -- training-step boundaries (rule 6) ------------------------------------------
    def step_call(self, closure: Callable[[], Any] | None) -> Any:
        """``optimizer.step(closure)`` once attached: run the closure (its backward held),
        then step and free every gradient the hooks did not consume."""
        loss = None
        if closure is not None:
            with self.closure(), torch.enable_grad():
                loss = closure()
        optimizer = self._optimizer()
        if optimizer is None:
            return loss
        self.check_boundary("step()")
        for p in self.unused_kept(optimizer):  # torch steps them on a zero gradient
            p.grad = torch.zeros_like(p)
        params = [p for g in optimizer.param_groups for p in g["params"] if p.grad is not None]
        if params and self.train_step.stepped_backwards:  # set after backward (_between.py)
            _between.refuse_second_update(self.last.stepped, params)
        if params and getattr(optimizer, "grad_scale", None) is not None and self.clips:
            raise BackwardStateError(SCALED_CLIP_ERROR)
        rec = self.last
        steps = rec.steps  # (stepped_in_backward counts the backward's updates only)
        self._step(self.placed(params))
        host = self._host_held() if self.train_step.held else None
        if host:
            self._step_host_held(host)
        rec.steps = steps
        self.boundary("step()")
        if params:  # gradients no hook took: layers unfrozen (or hooks lost) since
            for attachment in list(self.attachments):
                attachment.sync()
        return loss

    def zero_grad(self, set_to_none: bool, torch_zero_grad: Callable[[bool], None]) -> None:
        """``optimizer.zero_grad()``: torch's, after the boundary checks; held gradients go."""
        attached = bool(self.attachments)
        if attached:
            self.check_boundary("zero_grad()")
            self.check_discard(None, "optimizer.zero_grad()")
        host = self._host_held() if self.train_step.held else None
        if host is not None:  # torch would zero (or drop) these .grad
            if not set_to_none:
                for p, acc in host.host.items():
                    p.grad = torch.zeros_like(acc, device=p.device)
            host.drop()
        torch_zero_grad(set_to_none)
        self.train_step.held.clear()
        self.kept_grads = _between.kept_after_zero_grad(
            self.kept_grads, self._this_step() + self.train_step.skipped, set_to_none)
        self.last.zeroed = True
        if attached:
            self.boundary("zero_grad()")

    def unused_kept(self, optimizer: Any) -> list[Tensor]:
        """Parameters torch would update on a kept zero gradient at this ``step()``."""
        return _between.unused_kept(self.kept_grads, self._this_step(), optimizer.param_groups)

    def _this_step(self) -> list[Tensor]:
        """What the latest backward stepped, unless a ``zero_grad()`` came after it."""
        return [] if self.last.zeroed else self.last.stepped

    @property
    def stepped_since_boundary(self) -> bool:
        """Whether an attached backward updated parameters since the last step()/zero_grad()."""
        return self.train_step.stepped_backwards > 0

    def check_boundary(self, where: str) -> None:
        """Refuse a step()/zero_grad() that ends what torch would take as one step of
        several, or after the hyperparameters the updates used were changed."""
        step = self.train_step
        if step.hyper is not None:
            before, step.hyper = step.hyper, None
            optimizer = self._optimizer()
            if optimizer is not None:
                _between.check_unchanged(before, optimizer.param_groups, where)
        stepped, held = step.stepped_backwards, step.held_backwards
        if stepped >= 2 or (stepped and held):
            step.stepped_backwards = step.held_backwards = 0
            raise BackwardStateError(ACCUMULATION_ERROR.format(
                what=f"{where} ends {stepped + held} backwards, {stepped} of which already "
                "updated the parameters,",
                outcome="Each of those was applied as its own step; nothing more is.",
            ))

    def boundary(self, where: str) -> None:
        """``step()`` or ``zero_grad()`` (``where``) ended a training step."""
        self.train_step = StepRecord()
        self.calls.add(where)
        self.txn += 1

    def check_discard(self, params: Callable[[], Iterable[Tensor]] | None, where: str) -> None:
        """Refuse a ``zero_grad`` (``where``: the optimizer's, or ``model.zero_grad()``
        over ``params()``) that discards gradients an attached backward has already
        applied: once the loop calls ``step()``, a backward whose updates no ``step()``
        followed is one whose gradients torch would drop here (a GAN's generator loss
        reaching the discriminator, an actor's loss the critic)."""
        step = self.train_step
        if (step.stepped_backwards != 1 or step.held_backwards or "step()" not in self.calls
                or not self.last.stepped):
            return
        stepped = self.last.stepped
        if params is not None:
            ids = {id(p) for p in params()}
            stepped = [p for p in stepped if id(p) in ids]
            if not stepped:
                return
        step.stepped_backwards = 0  # said once: the loop may go on
        raise BackwardStateError(DISCARD_ERROR.format(
            where=where, n=len(stepped), name=self.name_of(stepped[0])))
