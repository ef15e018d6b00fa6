"""Gradients torch keeps after a training step, at one engine: ``zero_grad()``.

A mixin of ``boundaries.StepRules`` (and so of ``landing.Engine``). torch keeps a
``.grad`` until a ``zero_grad`` for every parameter a ``step()`` updated, as zeros
after ``zero_grad(set_to_none=False)``; an attached backward has freed those
gradients. What torch would hold is followed here: ``kept_grads`` (zeros torch
keeps, shown to ``step()`` so that it updates on them, and given back to
``.grad`` once no attachment is left), what the latest step updated, and the
optimizer's and a module's ``zero_grad``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from . import between as _between
from ..errors import warn

__all__ = ["Zeroing", "DETACHED", "ZEROS_IN_GRAD"]

DETACHED = "detached"  # its last attachment left: its step()/zero_grad() are still the loop's
# in ``calls``: the latest zero_grad(set_to_none=False) zeroed gradients in .grad (torch's,
# left there by a step() that applied them itself): backward's step calls look for them
ZEROS_IN_GRAD = "kept zeros in .grad"
_KEPT_WARNED = "remove() before zero_grad() warned"  # (said once per optimizer)

KEPT_REMOVE_WARNING = (
    "remove() between step() and zero_grad() in a loop that zeroes with "
    "set_to_none=False: torch still holds this step's gradients, which layeropt applied "
    "and freed, until a zero_grad() keeps them as zeros. The optimizer's own zero_grad() "
    "is followed after remove(), but a module's zero_grad() is no longer watched, so a "
    "model.zero_grad() there is not seen (docs/rules.md, what cannot be detected). Call "
    "remove() after zero_grad(). (Said once per optimizer.)"
)


class Zeroing:
    """The engine's ``zero_grad`` side (see the module docstring)."""

    # What it uses of the rest of the engine (boundaries.StepRules, rules.Rules,
    # landing.Engine): their state and methods.
    train_step: Any
    last: Any
    kept_grads: dict[int, Tensor] | None
    attachments: dict[Any, None]
    stepper: Any
    calls: set[str]
    _optimizer: Callable[[], Any]
    stepped_since_boundary: bool
    check_boundary: Callable[[str], None]
    check_discard: Callable[..., None]
    refuse_regrown: Callable[..., None]
    boundary: Callable[[str], None]
    forget_stepped: Callable[[set[int]], None]

    def zero_grad(self, set_to_none: bool, torch_zero_grad: Callable[[bool], None]) -> None:
        """``optimizer.zero_grad()``: torch's, after the boundary checks; held gradients go."""
        attached = bool(self.attachments)
        checked = attached or DETACHED in self.calls  # (the loop's, as detached_step)
        if checked:
            self.check_boundary("zero_grad()")
            self.refuse_regrown("optimizer.zero_grad()")
            self.check_discard(None, "optimizer.zero_grad()")
        # what torch holds a .grad for now, and keeps as zeros with set_to_none=False:
        # the latest backward's, the held ones, any set by hand
        optimizer = self._optimizer()
        groups = optimizer.param_groups if optimizer is not None else []
        had = [] if set_to_none else self._held_now([p for g in groups for p in g["params"]])
        real = not set_to_none and any(p.grad is not None for g in groups for p in g["params"])
        (self.calls.add if real else self.calls.discard)(ZEROS_IN_GRAD)
        self.stepper.held.drop(set_to_none)  # (torch would zero or drop those in .grad)
        torch_zero_grad(set_to_none)
        self.train_step.held.clear()
        self.kept_grads = _between.kept_after_zero_grad(self.kept_grads, had, set_to_none)
        self.last.zeroed = True
        if checked:
            self.boundary("zero_grad()")
        if not attached:  # no hook steps these any more: torch's step() must find the kept zeros
            self.give_back_kept()
            if self.kept_grads:  # (in .grad now: torch's own, which a module's zero_grad,
                self.kept_grads = {i: p for i, p in self.kept_grads.items()  # unwatched
                                   if p.grad is None}  # while detached, may drop)

    def clip_kept(self, optimizer: Any, coef: Tensor, clipped: set[int] | None) -> None:
        """``layeropt.backward``'s clip of the kept zeros ``step()`` updates on (those of
        ``clipped``, by ``id``; ``None``: all): scaled as torch's clip scales them (0 * a
        NaN coefficient: NaN), in ``.grad`` for ``step()``. Zeros an earlier clip of this
        step wrote are scaled again, as torch's clips compound, and stay ``step()``'s
        (``StepRecord.clipped_zeros``: not a gradient a later clipped backward holds)."""
        written = self.train_step.clipped_zeros
        for p in self.unused_kept(optimizer):
            if clipped is None or id(p) in clipped:
                zeros = p.grad
                if zeros is None or written.get(id(p)) is not zeros:
                    zeros = torch.zeros_like(p)
                p.grad = written[id(p)] = zeros.mul_(coef.to(p.device, p.dtype))

    def kept_zeros(self, p: Tensor) -> bool:
        """Whether ``p.grad`` is the zeros torch keeps, nothing added onto them: a compiled
        region's backward fires the hooks of parameters it gives no gradient. (Asked in
        backward after a ``zero_grad(set_to_none=False)`` that zeroed gradients in
        ``.grad``: ``ZEROS_IN_GRAD``.) ``step()`` updates on them, as torch's."""
        grad, kept = p.grad, self.kept_grads
        return (kept is not None and id(p) in kept and type(grad) is Tensor
                and not grad.any())

    def give_back_kept(self, owned: set[int] | None = None, wait: bool = True) -> None:
        """Torch's ``.grad`` carries the kept zero gradients from here (``owned``'s: an
        attachment is removed; all: a ``zero_grad`` with none left): a zero ``.grad`` for
        each kept parameter that has none. Not yet for those the latest backward stepped
        when no ``step()`` came after it (``wait``): torch still holds their gradient,
        for that ``step()`` (this optimizer's ``zero_grad`` gives them back). Once a
        ``step()`` came, the next ``zero_grad`` - any optimizer's, or the model's - finds
        zeros, as it finds torch's gradients."""
        kept = self.kept_grads
        if not kept:
            return
        waiting = ({id(p) for p in self._this_step()} if wait and self.stepped_since_boundary
                   else ())
        held = self.stepper.held
        given = [p for i, p in kept.items() if i not in waiting
                 and (owned is None or i in owned) and p not in held]
        for p in given:  # (one with a .grad already: torch's own step() left it there)
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            del kept[id(p)]

    def let_go(self) -> None:
        """The optimizer was deleted (its finalizer): no ``zero_grad`` of its own comes
        any more, so ``.grad`` carries from here what torch's would hold at one. In a loop
        that zeroes with ``set_to_none=False``, that is a zero for every kept parameter
        and for each whose gradient torch still holds - the latest training step's,
        applied and freed in backward: a new optimizer's ``zero_grad(set_to_none=False)``
        (or a module's) leaves torch zeros there that its ``step()`` updates on
        (multifuzz handover seed 541,156). A loop that has not zeroed that way is left
        as it is: torch's next plain ``zero_grad()`` drops those gradients (docs/rules.md,
        what cannot be detected)."""
        if self.kept_grads is not None:
            self.kept_grads = _between.kept_after_zero_grad(self.kept_grads,
                                                            self._held_now([]), False)
        self.give_back_kept(wait=False)

    def take_kept(self, params: list[Tensor]) -> None:
        """An attachment begins: the zero ``.grad`` of this optimizer's ``params`` (the
        kept zeros an attachment's ``remove()`` gave back, or a ``zero_grad(
        set_to_none=False)`` while none was attached) are kept zeros again, as after an
        attached ``zero_grad(set_to_none=False)``: ``step()`` updates on them, a backward
        that misses them leaves them to it (not a gradient set by hand, which
        ``layeropt.backward`` clips and steps with the gradients it holds)."""
        optimizer = self._optimizer()
        if optimizer is None:
            return
        held, store = self.train_step.held, self.stepper.held  # (a held sum is no kept zero)
        zeros = [p for p in params if type(p.grad) is Tensor and optimizer.owns(p)
                 and p not in held and p not in store and not p.grad.any()]
        if zeros:
            self.kept_grads = _between.kept_after_zero_grad(self.kept_grads, zeros, False)
            for p in zeros:
                p.grad = None

    def warn_unwatched(self) -> None:
        """The last attachment left between ``step()`` and ``zero_grad()`` in a loop whose
        latest ``zero_grad`` kept zeros: what torch then keeps depends on the module
        ``zero_grad()`` calls no watcher sees any more - said once."""
        if (self.kept_grads is not None and not self.stepped_since_boundary
                and self._this_step() and _KEPT_WARNED not in self.calls):
            self.calls.add(_KEPT_WARNED)
            warn(KEPT_REMOVE_WARNING)

    def module_zero_grad(self, params: list[Tensor], set_to_none: bool) -> None:
        """``module.zero_grad(set_to_none)`` over ``params``, before torch's: held
        gradients in a store go as torch's in ``.grad`` would, and the parameters torch
        then keeps a zero ``.grad`` for (or no longer does) are followed as for the
        optimizer's ``zero_grad``. Only this optimizer's: another model's parameters (a
        plain optimizer's, an abandoned one's) were kept as its own, and given zeros when
        it was deleted - a plain torch model's next step() then moved on them."""
        optimizer = self._optimizer()
        params = [p for p in params if optimizer is not None and optimizer.owns(p)]
        if not params:
            return
        ids = {id(p) for p in params}
        had = [] if set_to_none else [p for p in self._held_now(params) if id(p) in ids]
        self.stepper.held.drop(set_to_none, params)
        self.forget_stepped(ids)  # (torch's gradients of them are gone or zero now)
        step = self.train_step
        if step.skipped:
            step.skipped = [p for p in step.skipped if id(p) not in ids]
        if set_to_none:
            for i in ids if self.kept_grads else ():
                self.kept_grads.pop(i, None)
            return
        self.kept_grads = _between.kept_after_zero_grad(self.kept_grads, had, False)
        if any(p.grad is not None for p in params):  # (torch zeroes these in .grad next)
            self.calls.add(ZEROS_IN_GRAD)

    def _held_now(self, params: list[Tensor]) -> list[Tensor]:
        """Of ``params``, those torch holds a gradient for now: the latest backward's (and
        a skipped step's), and any with a ``.grad`` or held in a store."""
        store, rec = self.stepper.held, self.last  # (step()'s updates too: torch keeps
        return ([] if rec.zeroed else rec.stepped) + self.train_step.skipped + [  # their
            p for p in params if p.grad is not None or p in store]  # .grad after step())

    def freed_kept(self, params: list[Tensor]) -> list[Tensor]:
        """Of ``params``, those whose gradient torch still holds after applying it (no
        ``zero_grad`` since the ``step()`` or the backward that applied it), where
        in-backward updating freed it once applied (not a skipped step's: kept)."""
        rec, step = self.last, self.train_step
        ids = {id(p) for p in params} - {id(p) for p in step.scaler_skipped}
        applied = ([] if rec.zeroed else rec.stepped) + step.skipped
        return list({id(p): p for p in applied if id(p) in ids}.values())

    def unused_kept(self, optimizer: Any) -> list[Tensor]:
        """Parameters torch would update on a kept zero gradient at this ``step()`` (not
        those whose held gradient waits in a store: that one is their gradient)."""
        held = self.stepper.held
        return [p for p in _between.unused_kept(self.kept_grads, self._this_step(),
                                                optimizer.param_groups) if p not in held]

    def show_kept(self) -> None:
        """The zeros torch keeps (``zero_grad(set_to_none=False)``) for the layers this
        step did not reach, in ``.grad``: for ``step()`` to update them, and where a
        backward held its gradients for ``step()``, for what the loop runs before it
        (``clip_grad_norm_`` after ``scaler.unscale_``: a norm over them sums the same
        terms as torch's)."""
        optimizer = self._optimizer()
        for p in self.unused_kept(optimizer) if optimizer is not None and self.kept_grads else ():
            p.grad = torch.zeros_like(p)

    def _this_step(self) -> list[Tensor]:
        """What the latest backward stepped, unless a ``zero_grad()`` came after it."""
        rec = self.last
        if rec.zeroed:
            return []
        return rec.stepped if rec.by_backward is None else rec.stepped[:rec.by_backward]
