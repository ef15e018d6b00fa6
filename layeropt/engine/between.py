"""Between ``backward()`` and ``step()``: what torch's ``step()`` would still see.

torch applies the update in ``step()``, reading ``.grad`` and ``param_groups``
then; an attached backward has already applied it. Four things a loop can do
in between therefore need a word (``Engine.step_call`` and
``Engine.check_boundary`` call these):

* **hyperparameters set after backward** (a learning-rate warm-up written
  there, ``scheduler.step()`` before ``optimizer.step()``): the update used
  the old value. :func:`snapshot` records the groups once the training step's
  first update ran (``Engine._step``);
  :func:`check_unchanged` refuses at ``step()`` / ``zero_grad()``. Tensor
  values compare by identity and version counter, never by reading them.
* **a gradient set on a parameter backward already updated** (Opacus' noise,
  gradient surgery): torch would update once, with it;
  :func:`refuse_second_update` drops it and raises - at ``step()``, or where a
  loop without ``step()`` would lose it: a ``zero_grad()``, the next backward
  (``StepRules.refuse_regrown``).
* **weights written after the update** (a clamp, a hand-written weight decay,
  ``model.load_state_dict``): torch's ``step()`` would update the written
  weights. ``Engine._step`` records each updated parameter's version counter;
  :func:`refuse_written` refuses at ``step()`` where one moved.
* **``zero_grad(set_to_none=False)``**: torch keeps a zero ``.grad`` for every
  parameter that had one and updates it at each ``step()``, used or not
  (weight decay, momentum). :func:`kept_after_zero_grad` follows which;
  :func:`unused_kept` lists those a training step did not use, which
  ``step()`` then updates on a zero gradient made for the moment.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor

from ..errors import BackwardStateError

HYPERPARAMETER_ERROR = (
    "param_groups[{index}][{key!r}] changed from {old} to {new} after an attached "
    "backward had already updated the parameters with {old}; torch, which reads it "
    "in {where}, would have used {new} for this step. Set hyperparameters before "
    "backward: a learning-rate schedule at the top of the iteration, or "
    "scheduler.step() after optimizer.step() (its documented place)."
)

SECOND_UPDATE_ERROR = (
    "{where} found a gradient on {n} parameter(s) (the first of shape {shape}) that "
    "the attached backward already updated in this training step: code after that "
    "backward set or changed .grad (per-sample clipping and noise as in Opacus, "
    "gradient surgery). torch would apply one update with that gradient in "
    "its step(); layeropt applied the backward's and drops this one. Change gradients "
    "before they are applied - in a tensor hook (param.register_hook) or with "
    "layeropt.backward's clipping - or run that backward inside `with opt.no_step():` "
    "so that step() applies the final gradient once."
)

WRITTEN_ERROR = (
    "step() found {n} parameter(s) (the first: {name}) written in place after the "
    "attached backward had updated them - `with torch.no_grad(): p.clamp_(...)`, a "
    "weight decay by hand, model.load_state_dict(...) between backward and step(). "
    "torch's step() would apply the update to the written weights; the attached backward "
    "applied it before the write. Nothing more is applied at this step(). Write weights "
    "before backward, or after step(); to write them before the update, do it in a "
    "post-accumulate-grad hook (p.register_post_accumulate_grad_hook), which runs first. "
    "An optimizer that moves the weights between two backwards and steps after the "
    "second (SAM's first_step / second_step): run both backwards inside "
    "`with opt.no_step():` (opt: the layeropt optimizer it steps), which holds them."
)


# -- hyperparameters -------------------------------------------------------------
_PLAIN = frozenset({float, int, bool, str, type(None)})


def _key(value: Any) -> Any:
    """What a value is compared by: a tensor by identity and version (``fill_`` on a tensor
    ``lr``), a tuple or list by its items' keys (tensor ``betas``, a list changed in place)."""
    if isinstance(value, Tensor):
        return (id(value), value._version)
    if type(value) is tuple and all(map(_PLAIN.__contains__, map(type, value))):
        return value  # (immutable: itself, as snapshot() keeps it)
    if isinstance(value, (tuple, list)):
        return (type(value), tuple(map(_key, value)))
    return value


def snapshot(param_groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The groups' values (all but ``params``), as the next comparison needs them (taken
    in the first step call of each training step: loops, no calls per value)."""
    out = []
    for g in param_groups:
        values = {}
        for k, v in g.items():
            if k == "params":
                continue
            t = type(v)  # (no call for plain values and tuples of them: once per step)
            values[k] = v if t in _PLAIN or t is tuple and all(map(_PLAIN.__contains__,
                                                                    map(type, v))) else _key(v)
        out.append(values)
    return out


def check_unchanged(before: list[dict[str, Any]], param_groups: list[dict[str, Any]],
                    where: str) -> None:
    """Raise if a value of ``before`` differs now (new groups and keys are not compared)."""
    for index, (old, group) in enumerate(zip(before, param_groups)):
        for key, was in old.items():
            if key in group and _key(group[key]) != was:
                new = group[key]
                shown = "its old value" if isinstance(was, tuple) else was  # (a key)
                raise BackwardStateError(HYPERPARAMETER_ERROR.format(
                    index=index, key=key, old=shown, new=new, where=where))


# -- a gradient for a parameter already updated ----------------------------------
def refuse_second_update(stepped: Iterable[Tensor], params: list[Tensor],
                         where: str = "step()") -> None:
    """Raise (dropping those gradients) if any of ``params`` is among ``stepped``
    (``where``: what found them - ``step()``, a ``zero_grad()``, the next backward)."""
    done = set(map(id, stepped))
    again = [p for p in params if id(p) in done]
    if again:
        for p in again:
            p.grad = None  # not applied: nothing more changes
        raise BackwardStateError(SECOND_UPDATE_ERROR.format(
            where=where, n=len(again), shape=tuple(again[0].shape)))


# -- weights written after their update --------------------------------------------
def refuse_written(updated: dict[Tensor, int], name_of: Callable[[Tensor], str]) -> None:
    """Raise if a parameter of ``updated`` (with its version counter just after the
    update) was written in place since: torch's ``step()`` would update the written
    weights. (A write through ``.data`` moves no counter and is not seen.)"""
    written = [p for p, version in updated.items() if p._version != version]
    if written:
        raise BackwardStateError(WRITTEN_ERROR.format(n=len(written), name=name_of(written[0])))


# -- zero_grad(set_to_none=False) ------------------------------------------------
def kept_after_zero_grad(kept: dict[int, Tensor] | None, stepped: Iterable[Tensor],
                         set_to_none: bool) -> dict[int, Tensor] | None:
    """The parameters (by id) torch holds a (zeroed) ``.grad`` for after this ``zero_grad``.

    ``None``: the loop sets gradients to ``None`` (the default); nothing is kept.
    Otherwise every parameter that got a gradient since the last
    ``set_to_none=True`` (``stepped``: the latest training step's; earlier
    ones are in ``kept`` already).
    """
    if set_to_none:
        return None
    kept = {} if kept is None else kept
    kept.update((id(p), p) for p in stepped)
    return kept


def unused_kept(kept: dict[int, Tensor] | None, stepped: Iterable[Tensor],
                param_groups: list[dict[str, Any]]) -> list[Tensor]:
    """Kept parameters the latest training step did not update (no gradient now)."""
    if not kept:
        return []
    used = set(map(id, stepped))
    return [p for g in param_groups for p in g["params"]
            if p.grad is None and kept.get(id(p)) is p and id(p) not in used]  # fmt: skip
