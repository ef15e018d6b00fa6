"""What layeropt reads of FSDP2's private per-parameter state (``FSDPParam``).

FSDP2 (``fully_shard``) registers each parameter twice over a step: the sharded
``DTensor`` (the one the optimizer owns and layeropt hooks) between steps, and an
unsharded plain tensor while its group is unsharded - from its forward to the end
of its backward, and for a root group (``reshard_after_forward`` off) from the
forward on. ``model.parameters()`` between a forward and its backward can
therefore be the unsharded ones. The names read here (``_get_fsdp_state``,
``_fsdp_param_group.fsdp_params``, ``sharded_param``, ``_unsharded_param``) are
the same in torch 2.8-2.15; no public API maps one to the other.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor, nn

__all__ = ["fsdp_params", "sharded_of"]


def fsdp_params(model: nn.Module) -> list[Any]:
    """FSDP2's per-parameter states (``FSDPParam``) of ``model``'s ``fully_shard`` modules."""
    found = []
    for module in model.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        group = None if get_state is None else getattr(get_state(), "_fsdp_param_group", None)
        found += getattr(group, "fsdp_params", None) or ()
    return found


def sharded_of(model: nn.Module) -> dict[int, Tensor]:
    """``id`` of each unsharded parameter ``model`` registers now -> its sharded parameter
    (empty where none is registered: no FSDP2, or every group sharded)."""
    out: dict[int, Tensor] = {}
    registered = {id(p) for p in model.parameters()}
    for fsdp_param in fsdp_params(model):
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None and id(unsharded) in registered:
            out[id(unsharded)] = fsdp_param.sharded_param
    return out
