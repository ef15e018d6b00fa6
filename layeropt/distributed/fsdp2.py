"""What layeropt reads of FSDP2's private per-parameter state (``FSDPParam``).

FSDP2 (``fully_shard``) registers each parameter twice over a step: the sharded
``DTensor`` (the one the optimizer owns and layeropt hooks) between steps, and an
unsharded plain tensor while its group is unsharded - from its forward to the end
of its backward, and for a root group (``reshard_after_forward`` off) from the
forward on. ``model.parameters()`` between a forward and its backward can
therefore be the unsharded ones. The states are found through
``torch.distributed._composable_state._module_state_mapping`` (every module's
composable state, so a submodule of a ``fully_shard`` module finds its group too);
the names read (``_fsdp_param_group.fsdp_params``, ``sharded_param``,
``_unsharded_param``) are the same in torch 2.8-2.15; no public API maps one
parameter to the other.
"""

from __future__ import annotations

import weakref
from typing import Any

from torch import Tensor, nn

__all__ = ["fsdp_params", "sharded_of"]


def _all_fsdp_params() -> list[Any]:
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:  # (a build without torch.distributed)
        return []
    found = []
    for state in list(_module_state_mapping.values()):
        if isinstance(state, weakref.ref):  # (a weak reference in torch 2.13)
            state = state()
        group = getattr(state, "_fsdp_param_group", None)
        found += getattr(group, "fsdp_params", None) or ()
    return found


def fsdp_params(model: nn.Module) -> list[Any]:
    """FSDP2's per-parameter states (``FSDPParam``) of ``model``'s parameters, sharded or
    unsharded (``model`` may be a submodule of a ``fully_shard`` module)."""
    ids = {id(p) for p in model.parameters()}
    return [fp for fp in _all_fsdp_params()
            if id(getattr(fp, "sharded_param", None)) in ids
            or id(getattr(fp, "_unsharded_param", None)) in ids]


def sharded_of(model: nn.Module | None = None) -> dict[int, Tensor]:
    """``id`` of each unsharded parameter ``model`` registers now -> its sharded parameter
    (empty where none is registered: no FSDP2, or every group sharded). Without
    ``model``: every ``fully_shard`` module's (a leaf a loss reaches may be a module's no
    attachment holds; its ``.grad`` is the shard's)."""
    out: dict[int, Tensor] = {}
    registered = None if model is None else {id(p) for p in model.parameters()}
    for fsdp_param in _all_fsdp_params():
        unsharded = getattr(fsdp_param, "_unsharded_param", None)
        if unsharded is not None and (registered is None or id(unsharded) in registered):
            out[id(unsharded)] = fsdp_param.sharded_param
    return out
