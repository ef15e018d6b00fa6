"""FSDP2 with ``CPUOffloadPolicy``: refused at attach on the torch releases with the race.

With ``fully_shard(..., offload_policy=CPUOffloadPolicy())`` each reduced
gradient shard is copied from the GPU into host memory, and FSDP2 then runs
the sharded parameter's post-accumulate-grad hooks itself - layeropt's
in-backward step among them (``foreach_reduce`` in torch's
``distributed/fsdp/_fully_shard/_fsdp_collectives.py``,
``_composable/fsdp/`` before 2.6):

1. torch 2.5 to 2.12 issue that copy with ``non_blocking=True`` when
   ``pin_memory`` is on (the policy's default) and the shard holds no
   gradient yet, and wait for it only at the end of backward
   (``finalize_backward``: ``grad_offload_event.synchronize()``). A hook can
   read the pinned buffer before the copy has landed: stale numbers, no error
   (pytorch#180666, fixed in 2.13: the copy is synchronous when the parameter
   has such a hook).
2. torch 2.4's FSDP2 runs no post-accumulate-grad hooks; what is stepped is
   stepped after backward, when the copies have landed: no race.
3. ``pin_memory=False``: the copy is synchronous on every release: no race.
   A CPU device mesh copies nothing: no race.

layeropt cannot wait for the copy from its hook on the releases with the race
without reaching into FSDP2's per-parameter events (and 2.5 records that
event on another stream than the copy's), so :func:`check_fsdp2_offload`
refuses the attachment there, naming the fixes.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import nn

from ..errors import AttachError

__all__ = ["OffloadedShard", "has_offload_race", "offloaded_shards", "check_fsdp2_offload",
           "refusal"]

# torch releases whose FSDP2 runs the hooks before the pinned gradient copy lands
RACE_FROM, FIXED_IN = (2, 5), (2, 13)


class OffloadedShard(NamedTuple):
    """A parameter FSDP2 keeps in host memory (``CPUOffloadPolicy``)."""

    name: str
    pin_memory: bool
    device_type: str  # where FSDP2 computes: "cuda", or "cpu" on a CPU mesh


def has_offload_race(version: str) -> bool:
    """Whether torch ``version`` runs FSDP2's hooks before the pinned copy lands.

    Args:
        version: a torch version string (``torch.__version__``).

    Returns:
        True for 2.5 up to (not including) 2.13; a pre-release of 2.13
        counts as before the fix.

    Example:
        >>> has_offload_race("2.12.1"), has_offload_race("2.13.0+cpu"), has_offload_race("2.4.1")
        (True, False, False)
    """
    v = torch.torch_version.TorchVersion(version)
    return RACE_FROM <= v < FIXED_IN


def offloaded_shards(model: nn.Module) -> list[OffloadedShard]:
    """The parameters of ``model`` that an FSDP2 ``CPUOffloadPolicy`` keeps in host memory.

    Args:
        model: any module; only those ``fully_shard`` was applied to count.

    Returns:
        One :class:`OffloadedShard` per offloaded parameter (empty without FSDP2).

    Example:
        >>> offloaded_shards(torch.nn.Linear(2, 2))
        []
    """
    found = []
    names = {id(p): n for n, p in model.named_parameters()}
    for prefix, module in model.named_modules():
        # FSDP2 keeps the policy only in its private per-parameter state
        # (FSDPParam.offload_to_cpu / .pin_memory / .device, the same names in
        # 2.4-2.15); no public API says whether a module offloads.
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        group = getattr(get_state(), "_fsdp_param_group", None)
        for fsdp_param in getattr(group, "fsdp_params", None) or ():
            if getattr(fsdp_param, "offload_to_cpu", False):
                name = names.get(id(getattr(fsdp_param, "sharded_param", None)), prefix)
                found.append(OffloadedShard(name, bool(fsdp_param.pin_memory),
                                            torch.device(fsdp_param.device).type))
    return found


def check_fsdp2_offload(model: nn.Module, version: str | None = None) -> None:
    """Refuse to attach an FSDP2 model whose in-backward steps could read stale gradients.

    Args:
        model: the module being attached.
        version: the torch version to judge (default: the installed one).

    Raises:
        AttachError: torch ``version`` has the race of pytorch#180666 and a
            parameter is offloaded to the host of a GPU with pinned memory.

    Example:
        >>> check_fsdp2_offload(torch.nn.Linear(2, 2), "2.12.1")  # no FSDP2: nothing to check
    """
    version = torch.__version__ if version is None else version
    if has_offload_race(version):  # (only then are the modules looked at)
        message = refusal(offloaded_shards(model), version)
        if message is not None:
            raise AttachError(message)


def refusal(shards: list[OffloadedShard], version: str) -> str | None:
    """What :func:`check_fsdp2_offload` says for ``shards`` under torch ``version``.

    Args:
        shards: what :func:`offloaded_shards` found.
        version: a torch version string.

    Returns:
        The error message (what goes wrong, the fixes), or ``None``: no race.

    Example:
        >>> refusal([OffloadedShard("0.weight", True, "cuda")], "2.13.0") is None
        True
    """
    racing = [s for s in shards if s.pin_memory and s.device_type != "cpu"]
    if not racing or not has_offload_race(version):
        return None
    names = ", ".join(s.name for s in racing[:3]) + (", ..." if len(racing) > 3 else "")
    fixed = f"{FIXED_IN[0]}.{FIXED_IN[1]}"
    return (
        f"this FSDP2 model offloads gradients with CPUOffloadPolicy(pin_memory=True) "
        f"({names}), and torch {version} runs post-accumulate-grad hooks - layeropt's "
        "in-backward step - before a gradient's copy from the GPU into pinned memory has "
        f"landed, so the step would read stale numbers (pytorch#180666, fixed in torch "
        f"{fixed}). Upgrade torch to >= {fixed}; or pass fully_shard(..., "
        "offload_policy=CPUOffloadPolicy(pin_memory=False)), with which torch copies each "
        "gradient before the hooks run; or drop offload_policy; or use torch.optim with "
        "this model."
    )
