"""When torch's ``step`` picks its update by the whole list of a training step's gradients.

A bucket stepped during backward is exact only where torch's update of a parameter does
not depend on which other parameters the same ``step()`` call gets. Two of torch's
choices do, and both are made once per call from the whole list:

* **foreach SGD with momentum** updates the momentum buffers one tensor at a time in a
  step where a parameter of the list (same param group, device and dtype) has no buffer
  yet, and with ``_foreach_mul_`` / ``_foreach_add_`` otherwise; the two round
  differently where the foreach kernels round the momentum to the dtype first (the
  CPU's, for bf16 / fp16; probed at run time, ``_TWO_WAYS``).
* **the default implementation** (``foreach`` and ``fused`` left to torch): the for-loop
  and foreach implementations round differently (bf16 NAdam, RMSprop, SGD with
  momentum, ...), and torch takes foreach only if *every* parameter with a gradient is a
  plain tensor on a device with foreach kernels (``_default_to_fused_or_foreach``). A
  param group that mixes such parameters with others (a CPU parameter beside CUDA ones,
  a parameter of a tensor subclass) takes one or the other by which of them have a
  gradient this step; a bucket of the plain ones alone would take foreach.

:func:`whole_step` says which (or ``None``); the engine (``Rules``) then holds that
backward's gradients to its end and steps them in one call, as torch does, with a
warning - or refuses the backward under DDP, whose buckets step as they arrive.
"""

from __future__ import annotations

from operator import attrgetter
from typing import Any

import torch
from torch._subclasses.fake_tensor import is_fake

__all__ = ["whole_step"]

_MOMENTUM_WHY = (
    "torch's foreach SGD with momentum updates the momentum buffers one tensor at a time "
    "in a step where a parameter of theirs (same param group, device and dtype) gets its "
    "first gradient, and over the whole list otherwise - two ways that round differently "
    "for this device and dtype - and some parameters have no momentum buffer yet, so "
    "which way this step takes is known only when its backward ends. "
)
_MOMENTUM_FIX = (
    " SGD(foreach=False) has one way (exact layer by layer), and so do float32 "
    "parameters; or freeze the parameters that never get a gradient."
)
_DEFAULT_WHY = (
    "{name}'s param group {index} leaves foreach and fused to torch, and its parameters "
    "are not all plain tensors on a device with foreach kernels ({odd}): torch takes its "
    "foreach implementation only where every parameter with a gradient is, and its "
    "for-loop otherwise - two ways that round differently - so which way this step takes "
    "is known only when its backward ends. "
)
_DEFAULT_FIX = (
    " Pass foreach=False (or foreach=True) to the optimizer: either is one way, exact "
    "layer by layer."
)
_HOLD = ("layeropt holds this backward's gradients and steps them together at its end (no "
         "memory saved in this step).")
_DDP = ("On a DistributedDataParallel model layeropt steps each averaged bucket as it "
        "arrives and cannot hold them: this backward is refused, nothing of it applied.")

_TWO_WAYS: dict[tuple[Any, ...], bool] = {}  # (device, dtype, momentum, dampening) -> differ

#: torch's classes whose functional picks for-loop or foreach from the parameters when
#: both are left to it (Adafactor and Muon take their for-loop).
_DEFAULTING = tuple(getattr(torch.optim, n) for n in (
    "SGD", "Adam", "AdamW", "Adadelta", "Adagrad", "Adamax", "ASGD", "NAdam", "RAdam",
    "RMSprop", "Rprop") if hasattr(torch.optim, n))

# C getters for map(): no Python frame per parameter
_IS_CPU, _IS_CUDA = attrgetter("is_cpu"), attrgetter("is_cuda")
_REQUIRES_GRAD = attrgetter("requires_grad")


def _momentum_ways_differ(device: torch.device, dtype: torch.dtype, momentum: float,
                          dampening: float) -> bool:
    """Whether torch's two momentum updates in ``_multi_tensor_sgd`` - ``buf.mul_(m).add_(g,
    alpha=1 - d)`` per tensor, ``_foreach_mul_``/``_foreach_add_`` over the list - round
    differently on ``device`` for ``dtype`` (the CPU's foreach kernels round the scalar to
    bf16 / fp16 first; float32 agrees), probed once on 256 values."""
    key = (device, dtype, momentum, dampening)
    if key not in _TWO_WAYS:
        gen = torch.Generator().manual_seed(0)
        buf, grad = (torch.randn(256, generator=gen).to(device, dtype) for _ in range(2))
        one = buf.clone().mul_(momentum).add_(grad, alpha=1 - dampening)
        listed = [buf.clone()]
        torch._foreach_mul_(listed, momentum)
        torch._foreach_add_(listed, [grad], alpha=1 - dampening)
        _TWO_WAYS[key] = not torch.equal(one, listed[0])
    return _TWO_WAYS[key]


def _foreach_default(params: list[Any]) -> tuple[bool, str]:
    """torch's default over ``params`` (``_default_to_fused_or_foreach``: foreach or
    not), and where it is not foreach but would be for some of them, what the others
    are (``""`` otherwise)."""
    from torch.optim import optimizer as torch_optimizer

    devices = torch_optimizer._get_foreach_kernels_supported_devices()
    types = torch_optimizer._foreach_supported_types
    if all(map(_IS_CPU, params)) or all(map(_IS_CUDA, params)):  # one device type
        if params[0].device.type not in devices:
            return False, ""
        if all(map(types.__contains__, map(type, params))):
            return True, ""
    odd = [p for p in params if type(p) not in types or p.device.type not in devices]
    if len(odd) == len(params):
        return False, ""
    return False, ", ".join(sorted({f"{type(p).__name__} on {p.device.type}" for p in odd}))


def _momentum_split(optimizer: Any, group: dict[str, Any], params: list[Any]) -> bool:
    """Foreach SGD with momentum, some parameters with buffers and some without, on a
    device and dtype where the two momentum updates round differently."""
    have, lack = set(), set()
    for p in params:
        state = optimizer.state.get(p)
        has = state is not None and state.get("momentum_buffer") is not None
        (have if has else lack).add((p.device, p.dtype))
    return any(device.type != "meta" and _momentum_ways_differ(
        device, dtype, float(group["momentum"]), float(group.get("dampening", 0)))
        for device, dtype in have & lack)


def whole_step(optimizer: Any) -> tuple[str, str] | None:
    """Whether this training step's update must be one call over all of its gradients:
    the warning that holding its backward gives and the error that refusing it under DDP
    raises, each saying why; ``None`` where buckets are exact."""
    if not isinstance(optimizer, _DEFAULTING):
        return None
    for index, group in enumerate(optimizer.param_groups):
        foreach = group.get("foreach")
        momentum = isinstance(optimizer, torch.optim.SGD) and group.get("momentum")
        if (group.get("fused") or group.get("differentiable") or foreach is False
                or (foreach and not momentum) or "foreach" not in group):
            continue  # (torch's way is the group's own: the same for every bucket)
        params = list(filter(_REQUIRES_GRAD, group["params"]))
        if not params or is_fake(params[0]):
            continue
        if foreach is None:
            foreach, odd = _foreach_default(params)
            if odd:
                why = _DEFAULT_WHY.format(name=type(optimizer).__name__, index=index,
                                          odd=odd)
                return why + _HOLD + _DEFAULT_FIX, why + _DDP + _DEFAULT_FIX
        if foreach and momentum and _momentum_split(optimizer, group, params):
            return _MOMENTUM_WHY + _HOLD + _MOMENTUM_FIX, _MOMENTUM_WHY + _DDP + _MOMENTUM_FIX
    return None
