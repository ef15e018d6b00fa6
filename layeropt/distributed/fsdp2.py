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

FSDP1 (``FullyShardedDataParallel``) is refused at ``attach`` (:func:`refuse_fsdp1`).
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

from torch import Tensor, nn

from ..errors import AttachError

__all__ = ["fsdp_params", "sharded_of", "refuse_fsdp1"]

FSDP1_ERROR = (
    "attach(): {where} is a FullyShardedDataParallel (FSDP1) wrapper, which "
    "reduces and shards each flat parameter's gradient in a hook of its own after autograd "
    "has accumulated it, where no hook of layeropt's sees the reduced shard: with "
    "use_orig_params=False layeropt would step the local, unreduced gradient, with "
    "use_orig_params=True nothing would be stepped in backward (and nothing saved). Shard "
    "with FSDP2 (torch.distributed.fsdp.fully_shard), whose hooks layeropt steps in, or "
    "keep torch.optim under FSDP1. Nothing was attached."
)


def refuse_fsdp1(model: nn.Module) -> None:
    """Raise :class:`AttachError` if ``model`` is or holds an FSDP1 wrapper (looked for
    only where torch's FSDP1 module is imported)."""
    module = sys.modules.get("torch.distributed.fsdp.fully_sharded_data_parallel")
    cls = getattr(module, "FullyShardedDataParallel", None)
    if cls is not None:
        for name, m in model.named_modules():
            if isinstance(m, cls):
                where = f"module {name!r}" if name else "the model"
                raise AttachError(FSDP1_ERROR.format(where=where))


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
