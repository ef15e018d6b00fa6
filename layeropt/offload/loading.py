"""``load_state_dict`` into an offloaded optimizer: straight into host memory.

torch's ``Optimizer.load_state_dict`` casts each loaded state tensor to its
parameter's device, which would put the whole state on the GPU at once. For
the load (``StateOffload.loading``, around ``InBackwardOptimizer.load_state_dict``)
the param groups hold host stand-ins of the parameters (same dtype and shape,
on the CPU, no storage); afterwards the real parameters are back, the loaded
tensors are copied into the handle's host tensors, and 0-dim ones (Adam's
``step``) go where torch's own policy puts them for the real parameter.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

__all__ = ["loading_into_host"]

# torch's rule for where a loaded state value goes (Optimizer.load_state_dict uses it)
_POLICY = getattr(torch.optim.Optimizer, "_process_value_according_to_param_policy", None)


@contextlib.contextmanager
def loading_into_host(handle: Any, optimizer: Any) -> Iterator[None]:
    """Around ``optimizer.load_state_dict``: the state loads into ``handle``'s host
    memory; the real parameters are back however the load ends."""
    handle.synchronize()
    real = _stand_ins(optimizer) if _POLICY is not None else {}  # (else: as torch loads)
    try:
        yield
    finally:
        _back(handle, optimizer, real)


def _stand_ins(optimizer: Any) -> dict[int, Tensor]:
    """Each parameter in the param groups replaced by a host stand-in; returns
    ``{id(stand-in): parameter}``."""
    real = {}
    for g in optimizer.param_groups:
        stand_ins = []
        for p in g["params"]:
            stand_in = torch.zeros((), dtype=p.dtype).expand(p.shape)
            real[id(stand_in)] = p
            stand_ins.append(stand_in)
        g["params"] = stand_ins
    return real


def _back(handle: Any, optimizer: Any, real: dict[int, Tensor]) -> None:
    """The real parameters back, the loaded state keyed by them, in host tensors."""
    for g in optimizer.param_groups:
        g["params"] = [real.get(id(q), q) for q in g["params"]]
    state = optimizer.state
    for stand_in in [k for k in state if id(k) in real]:
        p, values = real[id(stand_in)], state.pop(stand_in)
        group = next(g for g in optimizer.param_groups if any(q is p for q in g["params"]))
        policy = [{"params": [0], "fused": group.get("fused", False),
                   "capturable": group.get("capturable", False)}]
        for k, v in values.items():
            if not isinstance(v, Tensor) or is_traceable_wrapper_subclass(v):
                continue
            if v.dim() == 0:  # (Adam's step: on the CPU, or the device when fused)
                values[k] = _POLICY(p, v, 0, policy, k)
            else:
                values[k] = handle._new_host(p, k, v)
                values[k].copy_(v)
        state[p] = values
    optimizer._lo_group_index = None
    handle._to_host_all()
