"""Hyperparameters changed after backward already used them: refused at ``step()``.

torch reads ``param_groups`` (``lr``, ``weight_decay``, ...) when ``step()``
runs; an attached backward has already updated the parameters with the
values it found. A loop that sets them between ``backward()`` and ``step()``
(a learning-rate warm-up written there, ``scheduler.step()`` called before
``optimizer.step()``) would silently train with each value one step late.
:func:`snapshot` records the groups once the training step's first update ran
(``layeropt.optim``), :func:`check_unchanged` compares at ``step()`` /
``zero_grad()`` (``Engine.check_boundary``). Tensor values compare by identity
and version counter (an in-place ``fill_`` counts), never by reading them.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from .errors import BackwardStateError

HYPERPARAMETER_ERROR = (
    "param_groups[{index}][{key!r}] changed from {old} to {new} after an attached "
    "backward had already updated the parameters with {old}; torch, which reads it "
    "in {where}, would have used {new} for this step. Set hyperparameters before "
    "backward: a learning-rate schedule at the top of the iteration, or "
    "scheduler.step() after optimizer.step() (its documented place)."
)


def _key(value: Any) -> Any:
    return (id(value), value._version) if isinstance(value, Tensor) else value


def snapshot(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups' values (all but ``params``), as the next comparison needs them."""
    return [{k: _key(v) for k, v in g.items() if k != "params"} for g in param_groups]


def check_unchanged(before: list[dict[str, Any]], param_groups: list[dict[str, Any]],
                    where: str) -> None:
    """Raise if a value of ``before`` differs now (new groups and keys are not compared)."""
    for index, (old, group) in enumerate(zip(before, param_groups)):
        for key, was in old.items():
            if key in group and _key(group[key]) != was:
                new = group[key]
                shown = "its old value" if isinstance(new, Tensor) else was
                raise BackwardStateError(HYPERPARAMETER_ERROR.format(
                    index=index, key=key, old=shown, new=new, where=where))
