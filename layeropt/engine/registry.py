"""What every layer of layeropt needs to know about a parameter and its process.

The bottom of the package (imported by the engine, the attachments and the
distributed code, importing none of them):

* :func:`world_size`, :func:`is_dtensor`, and the guard the plain hooks run
  before touching a gradient under ``torch.distributed``
  (:func:`check_local_hooks_allowed`, :func:`allow_local_updates`);
* :data:`ENGINES`, every live engine;
* which :class:`~layeropt.attaching.Attachment` hooks a parameter
  (:func:`hooked_by`). Kept by ``id`` with an identity check, not in a weak
  dictionary: ``torch.utils.swap_tensors`` (module conversion under
  ``torch.__future__.set_swap_module_params_on_conversion(True)``) refuses
  tensors that have weak references.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from ..errors import AttachError

__all__ = [
    "world_size",
    "is_dtensor",
    "check_local_hooks_allowed",
    "refuse_local_gradients",
    "allow_local_updates",
    "hooked_by",
    "mark_hooked",
    "unmark_hooked",
    "WeakOrderedSet",
    "ENGINES",
]

# Attribute set on parameters declared for local updates (a plain value: picklable).
_LOCAL_OK = "_layeropt_local_updates"
# id(parameter) -> the plain attachment whose hook it carries (weakly)
HOOKED: dict[int, weakref.ref] = {}


class WeakOrderedSet(weakref.WeakKeyDictionary):
    """A set of weak references iterated in insertion order (``weakref.WeakSet``
    iterates in memory order, which would make results depend on addresses)."""

    def add(self, item: Any) -> None:
        self[item] = None


# The engine of every live layeropt optimizer, in the order they were made: what
# attach(model) looks owners up in, and what the watchers of torch's checkpoint and
# clipping functions ask (``engine/nesting.py``, ``checking/watch.py``).
ENGINES = WeakOrderedSet()


def hooked_by(param: Tensor) -> Any:
    """The live attachment whose hook ``param`` carries, or ``None``."""
    ref = HOOKED.get(id(param))
    attachment = None if ref is None else ref()
    if attachment is None or not attachment.hooks(param):
        return None  # a stale entry: that parameter (or attachment) is gone
    return attachment


def mark_hooked(param: Tensor, attachment: Any) -> None:
    HOOKED[id(param)] = weakref.ref(attachment)


def unmark_hooked(param: Tensor, attachment: Any) -> None:
    ref = HOOKED.get(id(param))
    if ref is not None and ref() in (attachment, None):
        del HOOKED[id(param)]


def world_size() -> int:
    """Processes in the default ``torch.distributed`` group (1 without one)."""
    if not (dist.is_available() and dist.is_initialized()):
        return 1
    return dist.get_world_size()


def is_dtensor(t: Tensor) -> bool:
    """Whether ``t`` is a DTensor (FSDP2's sharded parameters are)."""
    if not dist.is_available():
        return False
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch 2.4
        from torch.distributed._tensor import DTensor

    return isinstance(t, DTensor)


def local_gradient_allowed(param: Tensor, world: int) -> bool:
    """Whether a plain hook may step ``param`` on its gradient as it lands, in a
    ``world`` of processes (see :func:`check_local_hooks_allowed`)."""
    return world <= 1 or is_dtensor(param) or param.__dict__.get(_LOCAL_OK, False)


def check_local_hooks_allowed(param: Tensor, name: str | None = None) -> None:
    """Refuse to step ``param`` from a plain hook when that would use a local gradient.

    Called by layeropt's post-accumulate-grad hook before it touches the
    gradient. Allowed: no process group or a world size of 1; DTensor
    parameters (FSDP2 calls their hooks with the reduced, sharded gradient);
    parameters passed to :func:`allow_local_updates`.

    Args:
        param: the parameter whose hook fired (or is about to).
        name: its name in the model, for the message (default: its shape).

    Returns:
        None.

    Raises:
        AttachError: ``torch.distributed`` runs with more than one process and
            ``param`` is a plain tensor, so its gradient is this process's
            local, un-averaged one.

    Example:
        >>> p = torch.nn.Parameter(torch.zeros(2))
        >>> check_local_hooks_allowed(p)  # no process group: nothing to check
    """
    world = world_size()
    if local_gradient_allowed(param, world):
        return
    what = repr(name) if name is not None else f"of shape {tuple(param.shape)}"
    raise AttachError(
        f"a layeropt hook was about to step parameter {what} with this process's local "
        f"gradient, but torch.distributed runs {world} processes: the replicas would "
        "drift apart. Under DistributedDataParallel, attach to the wrapper after "
        "wrapping (handle.remove(); layeropt.attach(ddp_model, opt), i.e. "
        "layeropt.distributed.attach_ddp), so each bucket is stepped after its "
        "all-reduce. Under FSDP2, call fully_shard first, then build the optimizer and "
        "attach. Under tensor parallelism alone (parallelize_module), a parameter it "
        "leaves a plain tensor (a norm outside SequenceParallel) has the same gradient "
        "on every rank only if every rank gets the same batch: shard it too, or where "
        "that holds call layeropt.distributed.allow_local_updates on its module. If every "
        "process deliberately trains its own model (or its own pipeline stages), call "
        "layeropt.distributed.allow_local_updates(model)."
    )


def refuse_local_gradients(attachments: Iterable[Any]) -> None:
    """:func:`check_local_hooks_allowed` on every trainable parameter these attachments
    hook with plain hooks (a DDP attachment's come averaged), before a backward steps any
    of them: one hook checks only its own, and tensor parallelism's plain norms land
    after its DTensor layers, which would have been stepped."""
    world = world_size()
    for attachment in list(attachments):
        if not getattr(attachment, "averaged", False):
            for p in attachment.owned:  # (in the model's order)
                if p.requires_grad and not local_gradient_allowed(p, world):
                    check_local_hooks_allowed(p, next(n for n, q in attachment.named if q is p))


def allow_local_updates(params: nn.Module | Iterable[Tensor]) -> None:
    """Declare that these parameters are meant to be updated from local gradients.

    For models that are not data parallel although ``torch.distributed`` is
    running (each process trains its own model, pipeline stages, ...).

    Args:
        params: a module (all its parameters) or an iterable of parameters.

    Returns:
        None.

    Example:
        >>> model = torch.nn.Linear(2, 2)
        >>> allow_local_updates(model)
    """
    for p in params.parameters() if isinstance(params, nn.Module) else params:
        p.__dict__[_LOCAL_OK] = True


