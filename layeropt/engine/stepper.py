"""The seam features wrap: how a step call updates, and where held gradients wait.

Each engine steps through one object, ``engine.stepper``. The plain
:class:`Stepper` is the whole plain path's update: unscale and clip each
bucket (``layeropt/engine/transforms.py``), one call of torch's ``step`` on
exactly the parameters (the optimizer's ``SubsetStepper``,
``layeropt/engine/subset.py``), free the gradients. Held gradients wait in
``.grad`` (:data:`IN_GRAD`).

A feature is a :class:`Wrapper` around the stepper it finds: installing it
wraps (:meth:`Engine.wrap <layeropt.engine.landing.Engine.wrap>`), removing
it unwraps, and what it does not override goes to the stepper inside it.
Two features wrap today:

* ``offload_state`` (``layeropt/offload/state.py``): the state of the
  parameters being updated is brought to the device around the update, and
  held gradients may wait in host memory instead (its ``held`` store,
  ``layeropt/offload/held.py``);
* ``LAYEROPT_VERIFY`` (``layeropt/checking/verify.py``): each step call runs
  on a shadow and ``optimizer.step()`` applies torch's own step for real.

The engine never asks which stepper or store it has: it calls them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from .nesting import _graph_task_id
from .transforms import prepare_grads

__all__ = ["IN_GRAD", "InGrad", "Stepper", "Wrapper", "outside_autocast"]


_autocast_on = getattr(torch._C, "_is_any_autocast_enabled", lambda: False)
_AUTOCAST_DEVICES = ("cpu", "cuda", "xpu", "hpu", "mps", "xla", "mtia")


def outside_autocast() -> contextlib.AbstractContextManager[None]:
    """An update in backward runs as torch's ``step()`` runs where loops call it, outside
    ``torch.autocast``: autocast off on each device the loop turned it on for (under it,
    an optimizer that multiplies matrices - torch's Adafactor - computes in bf16)."""
    stack = contextlib.ExitStack()
    if _autocast_on() and _graph_task_id() >= 0:  # (a step() of the loop's: its context)
        for device in _AUTOCAST_DEVICES:
            try:
                on = torch.is_autocast_enabled(device)
            except RuntimeError:  # (a device type this torch has no autocast for)
                continue
            if on:
                stack.enter_context(torch.autocast(device, enabled=False))
    return stack


class InGrad:
    """Held gradients in ``.grad``, where autograd sums them: nothing to move.

    The store protocol (``layeropt/offload/held.py`` has the other one): ``p in
    store`` - ``p``'s held gradient waits in the store, not in ``.grad``;
    ``len(store)`` - how many do; ``land`` - a holding backward delivered
    ``p.grad``; ``flush`` - a backward ended; ``up`` - back into ``.grad``;
    ``fetch`` - a copy, staying held; ``drop`` - forget (``zero_grad()``).
    """

    __slots__ = ()

    def __contains__(self, param: Tensor) -> bool:
        return False

    def __len__(self) -> int:
        return 0

    def land(self, param: Tensor, bucket: Any, serial: int, at_once: bool) -> None:
        pass

    def flush(self) -> None:
        pass

    def up(self, params: list[Tensor]) -> None:
        pass

    def fetch(self, param: Tensor) -> Tensor:
        raise KeyError("held gradients in .grad are not fetched")

    def drop(self, set_to_none: bool = True, params: list[Tensor] | None = None) -> None:
        pass


IN_GRAD = InGrad()


class Stepper:
    """The plain stepper (the module docstring). Stateless: one serves every engine."""

    inner: Stepper | None = None
    held: Any = IN_GRAD

    def step(self, engine: Any, optimizer: Any, groups: list[Any], params: list[Tensor],
             transform: Any) -> list[Tensor]:
        """One step call in backward: ``groups``' gradients unscaled and clipped per
        bucket, ``params`` (theirs, each with a gradient) updated and freed. Returns
        the parameters updated."""
        s = groups[0].settings
        one = s is None or s.bucket_max_norm is None  # elementwise: once for the call
        for g in groups:  # (a loop, not all(): no frame on the plain path)
            if g.settings is not s:
                one = False
                break
        if one:
            if transform is not None or (s is not None and s.clip_value is not None):
                prepare_grads(params, transform, s)
        else:
            for g in groups:  # a norm per bucket (one attachment's)
                s = g.settings
                if transform is not None or (s is not None and s.clips):
                    prepare_grads(g.params, transform, s)
        try:  # (apply()'s body, one frame less on every bucket)
            if _autocast_on() and _graph_task_id() >= 0:  # in backward, under the loop's
                with outside_autocast():
                    optimizer._lo_stepper(optimizer, params, engine.txn)
            else:
                optimizer._lo_stepper(optimizer, params, engine.txn)
            optimizer._opt_called = True  # an LR scheduler sees that a step happened
        except BaseException as e:
            held = engine.train_step.held
            for p in params:  # refused or failed: drop these gradients, as an abort would
                if p not in held:
                    p.grad = None
            engine.refuse_after_early_discard(e)
            raise
        for p in params:
            p.grad = None
        return params

    def apply(self, optimizer: Any, params: list[Tensor], txn: int) -> None:
        """Torch's step on exactly ``params`` (each holds a ``.grad``), in transaction
        ``txn``; their state wherever the stepper keeps it."""
        optimizer._lo_stepper(optimizer, params, txn)
        optimizer._opt_called = True

    def step_call(self, engine: Any, closure: Callable[[], Any] | None) -> Any:
        """``optimizer.step(closure)`` once attached."""
        return engine.step_call(closure)

    def detached_step_call(self, engine: Any, torch_step: Callable[[], Any],
                           closure: Callable[[], Any] | None) -> Any:
        """``optimizer.step(closure)`` once its last attachment left (``torch_step``:
        torch's own step)."""
        return engine.detached_step(torch_step, closure)

    def zero_grad(self, engine: Any, set_to_none: bool,
                  torch_zero_grad: Callable[[bool], None]) -> None:
        """``optimizer.zero_grad(set_to_none)`` once made."""
        engine.zero_grad(set_to_none, torch_zero_grad)

    def loading(self, optimizer: Any) -> contextlib.AbstractContextManager[None]:
        """Around ``optimizer.load_state_dict``."""
        return contextlib.nullcontext()

    def regrown(self, params: list[Tensor]) -> list[Tensor]:
        """Of ``params``, which this stepper's step calls updated in backward and freed,
        those with a ``.grad`` again: written since (``StepRules.refuse_regrown``)."""
        return [p for p in params if p.grad is not None]


PLAIN = Stepper()


class Wrapper(Stepper):
    """A feature around the stepper it found (``inner``): what it does not override
    is the inner stepper's."""

    def __init__(self) -> None:
        self.inner: Stepper = PLAIN

    @property
    def held(self) -> Any:  # type: ignore[override]
        return self.inner.held

    def step(self, engine: Any, optimizer: Any, groups: list[Any], params: list[Tensor],
             transform: Any) -> list[Tensor]:
        return self.inner.step(engine, optimizer, groups, params, transform)

    def apply(self, optimizer: Any, params: list[Tensor], txn: int) -> None:
        self.inner.apply(optimizer, params, txn)

    def step_call(self, engine: Any, closure: Callable[[], Any] | None) -> Any:
        return self.inner.step_call(engine, closure)

    def detached_step_call(self, engine: Any, torch_step: Callable[[], Any],
                           closure: Callable[[], Any] | None) -> Any:
        return self.inner.detached_step_call(engine, torch_step, closure)

    def zero_grad(self, engine: Any, set_to_none: bool,
                  torch_zero_grad: Callable[[bool], None]) -> None:
        self.inner.zero_grad(engine, set_to_none, torch_zero_grad)

    def loading(self, optimizer: Any) -> contextlib.AbstractContextManager[None]:
        return self.inner.loading(optimizer)

    def regrown(self, params: list[Tensor]) -> list[Tensor]:
        return self.inner.regrown(params)
