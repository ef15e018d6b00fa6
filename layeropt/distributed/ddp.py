"""``attach`` for a ``DistributedDataParallel`` model: DDP's communication hook steps each
averaged bucket (``ddp_hook.py`` holds the hook; this module registers it and keeps the
attachment). ``layeropt.attach`` hands a DDP model here.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from ..attaching import (Attachment, _start_verifying, hand_over, layer_buckets,
                         refuse_open_updates, resolve_owners)
from ..engine.landing import Settings
from ..checking.watch import refuse_plain_hooks
from ..errors import AttachError
from .ddp_hook import _allreduce_then_step, _Copied, _HookState, hook_name

__all__ = ["DDPAttachment", "attach_ddp"]

COMM_HOOK_ERROR = (
    "this DDP model already has a communication hook, and DDP accepts only one. layeropt "
    "needs its own (it reduces, then steps each bucket): build the DDP model without "
    "register_comm_hook, and give the hook to layeropt.attach(ddp_model, opt, "
    "comm_hook=hook, comm_state=state) instead; layeropt reduces each bucket with it."
)
OTHER_HOOK_ERROR = (
    "this DDP model reduces its buckets through {before} since it was first attached, and "
    "DDP keeps that for good; it was attached again with {now}. Pass the same comm_hook "
    "and comm_state (the same objects) as the first attach."
)

# DDP instance -> its comm-hook state (DDP accepts one comm hook, for good).
_DDP_STATES: "weakref.WeakKeyDictionary[nn.Module, _HookState]" = weakref.WeakKeyDictionary()


class DDPAttachment(Attachment):
    """Handle returned by :func:`attach_ddp`; ``remove()`` restores plain DDP.

    An :class:`~layeropt.Attachment` whose gradients come from DDP's
    communication hook (each bucket averaged) instead of per-parameter hooks.
    DDP cannot unregister a communication hook, so after ``remove()`` the
    hook stays and does exactly DDP's own job (average, leave the result in
    ``.grad``); attaching the same DDP model again re-activates it. DDP fixes
    the parameters it synchronises when it wraps, so there is nothing to
    follow (:meth:`sync`).

    Attributes:
        params: the DDP-managed parameters stepped in backward.
    """

    def __init__(self, ddp: nn.Module, optimizers: list[Any], state: _HookState,
                 settings: Settings) -> None:
        self._state = state
        self.params: list[Tensor] = []
        self._covered: list[Tensor] = []  # (set with the hooks: covered)
        super().__init__(ddp, optimizers, settings)

    def _hook_all(self) -> None:
        ddp = self.model
        if ddp is None:
            return
        managed = {id(p) for p in ddp.parameters() if not hasattr(p, "_ddp_ignored")}
        owner = {}
        for opt, b in layer_buckets(ddp.module, self.optimizers):
            for p in b.params:
                if id(p) in managed:
                    owner[p] = opt
        if not owner:
            raise AttachError(
                "the optimizer owns none of the parameters DDP synchronises. Build it "
                "from ddp_model.parameters() before attaching."
            )
        self.params = self._owned = list(owner)  # (owned: kept by _release, for remove())
        # (and those frozen now, whose kept zeros remove() gives back all the same)
        self._covered = [p for p in ddp.parameters() if id(p) in managed
                         and any(o.owns(p) for o in self.optimizers)]
        self.named = [(n, p) for n, p in ddp.named_parameters() if p in owner]
        for opt in self.optimizers:
            opt._lo_engine.add_attachment(self)  # opt.attached; add_param_group -> _rebuild
        with self._state.lock:
            self._state.owner = {p: weakref.ref(o) for p, o in owner.items()}
            self._state.settings = self.settings
            self._state.active = True
            self._state.attachment = weakref.ref(self)
            self._state.fresh = True  # (attached between a forward and its backward)

    def hooks(self, param: Tensor) -> bool:
        """Whether ``param`` is stepped through this DDP model's communication hook."""
        return any(p is param for p in self.params)

    def _taken(self) -> list[Tensor]:
        return self._owned

    owned = property(_taken, doc="The parameters DDP synchronises that the optimizers own.")
    covered = property(lambda self: self._covered, doc="Those and the ones frozen since: "
                       "DDP synchronises them still, and remove() gives back their kept zeros.")
    averaged = True  # (its gradients come averaged through DDP's comm hook)

    def _release(self) -> None:
        with self._state.lock:
            if self._state.attachment is None or self._state.attachment() is self:
                self._state.owner = {}  # (not a later attachment's, made once this
                self._state.active = False  # one's optimizers were deleted)
        self.params = []

    def sync(self, in_backward: bool = False) -> bool:
        """DDP fixes the set of synchronised parameters when wrapping: nothing to follow."""
        return False

    def __repr__(self) -> str:
        state = "removed" if self._removed else f"{len(self.params)} params"
        return f"<layeropt.DDPAttachment {state}>"


def _check_ddp(ddp: nn.Module) -> None:
    problems = {
        "mixed_precision": getattr(ddp, "mixed_precision", None) is not None,
        "the Python reducer (compiled DDP)": getattr(ddp, "_use_python_reducer", False),
        # (parameters in delay_all_reduce_named_params are reduced by a hook of another
        # parameter, outside the buckets layeropt steps: some or all of them)
        "delay_all_reduce_named_params": bool(getattr(ddp, "_delay_all_reduce_params", ())),
    }
    for what, bad in problems.items():
        if bad:
            raise AttachError(
                f"layeropt cannot step in backward under DDP with {what}: a bucket's "
                "parameters would be stepped without knowing their global gradient. "
                "Construct DistributedDataParallel without it, or keep a plain "
                "torch.optim optimizer for this model."
            )
    refuse_plain_hooks(ddp)


def attach_ddp(
    ddp_model: nn.Module,
    optimizer: Optimizer | Iterable[Optimizer] | None = None,
    *,
    bucket_cap_mb: float = 1.0,
    overlap: bool = True,
    clip_value: float | None = None,
    verify: int | None = None,
    comm_hook: Callable[[Any, Any], Any] | None = None,
    comm_state: Any = None,
) -> DDPAttachment:
    """Step a DistributedDataParallel model's buckets on their averaged gradients, in backward.

    Registers a DDP communication hook that, per bucket, frees the parameters'
    local ``.grad`` (DDP has copied them into the bucket) and averages the
    bucket over the process group, scaled by ``1/world_size`` and summed
    exactly as DDP's built-in reducer does; each parameter is then updated with
    torch's own ``step`` on its averaged slice, and ``.grad`` is ``None`` again
    when ``backward()`` returns. Results equal DDP + ``torch.optim`` bit for bit.

    Where the updates run: CPU buckets (gloo) are stepped at the end of
    backward, on the autograd thread, in bucket order (a communication thread
    would compete for the cores backward runs on; the gradients live in DDP's
    buckets either way). CUDA buckets are stepped in the all-reduce future's
    ``.then()``, on a stream that waits for the all-reduce, while backward
    computes earlier layers (``overlap=False``: at the end, as on CPU).

    Args:
        ddp_model: a ``torch.nn.parallel.DistributedDataParallel`` instance,
            without another comm hook. With ``find_unused_parameters=True``
            one small all-reduce per backward tells which parameters some
            process used (as DDP does); buckets then land at the end of
            backward (no ``.then()`` overlap).
        optimizer: a layeropt optimizer, several, or ``None`` for every live
            layeropt optimizer owning some of the model's parameters.
        bucket_cap_mb: at the end of backward, an optimizer's landed buckets
            wait, in bucket order, until together they hold this many MiB, and
            are then stepped with one call (as ``attach``'s option: fewer step
            calls; ``0`` steps each DDP bucket alone). Buckets stepped in
            ``.then()`` are stepped alone.
        overlap: ``True`` (default) steps CUDA buckets in ``.then()``;
            ``False`` steps every bucket at the end of backward.
        verify: as :func:`attach`'s (``LAYEROPT_VERIFY``).
        comm_hook, comm_state: a DDP communication hook and its state, as
            ``register_comm_hook(comm_state, comm_hook)`` takes them: each bucket is
            reduced by ``comm_hook(comm_state, bucket)`` instead of layeropt's average
            (as DDP does with that hook registered), then stepped. DDP keeps the
            first attach's for good: a later attach must pass the same.
        clip_value: clip each averaged gradient element to
            ``[-clip_value, clip_value]`` before its update (as
            ``clip_grad_value_`` after DDP's backward). Global-norm clipping is
            :func:`layeropt.backward`'s ``max_norm=``.

    Returns:
        A :class:`DDPAttachment`; ``.remove()`` returns to plain DDP behaviour.

    Raises:
        TypeError: ``ddp_model`` is not DistributedDataParallel.
        AttachError: unsupported DDP option, another comm hook, parameters with
            plain layeropt hooks, or no owned parameters (see the message).

    Example:
        >>> ddp = DistributedDataParallel(model)  # doctest: +SKIP
        >>> opt = layeropt.Adam(ddp.parameters(), lr=1e-3)  # doctest: +SKIP
        >>> handle = attach_ddp(ddp, opt)  # doctest: +SKIP
        >>> loss_fn(ddp(x), y).backward()  # doctest: +SKIP
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(ddp_model, DistributedDataParallel):
        raise TypeError(
            f"attach_ddp() needs a DistributedDataParallel model, got "
            f"{type(ddp_model).__name__}; use layeropt.attach for other models."
        )
    settings = Settings(bucket_cap_mb, clip_value)  # (checked)
    optimizers = resolve_owners(ddp_model.module, optimizer)
    _check_ddp(ddp_model)
    if comm_hook is not None:  # (what register_comm_hook checks: signature, bf16 on NCCL)
        ddp_model._check_comm_hook(comm_hook)
    state = _DDP_STATES.get(ddp_model)
    if state is not None and (state.comm_hook is not comm_hook
                              or state.comm_state is not comm_state):
        raise AttachError(OTHER_HOOK_ERROR.format(before=hook_name(state.comm_hook),
                                                  now=hook_name(comm_hook)))
    refuse_open_updates(ddp_model.module, [p for p in ddp_model.module.parameters()
                                            if any(o.owns(p) for o in optimizers)], optimizers)
    _start_verifying(optimizers, verify)
    if state is not None and state.active:
        if any(r() is not None for r in state.owner.values()):
            raise AttachError(
                "this DDP model is already attached; call .remove() on that handle first."
            )
        old = state.attachment and state.attachment()  # its optimizers were deleted:
        if old is not None:  # nothing to keep (as a plain attachment's, _hook_all)
            old.remove()
        state.active, state.owner = False, {}
    if state is None:
        hooks = getattr(ddp_model, "_comm_hooks", None)
        if hooks and all(type(st) is _Copied for _, st in hooks):
            hooks.clear()  # a copy of an attached model: its reducer was built without them
        if hooks:
            raise AttachError(COMM_HOOK_ERROR)
        state = _HookState(ddp_model, overlap, comm_hook, comm_state)
        try:  # (a built-in hook, _register_builtin_comm_hook, is in no list to look at)
            ddp_model.register_comm_hook(state, _allreduce_then_step)
        except RuntimeError as exc:
            raise AttachError(COMM_HOOK_ERROR) from exc
        ddp_model.register_forward_pre_hook(state.forward)
        # The reducer must not copy buckets back into .grad after the hook.
        ddp_model.reducer._set_optimizer_in_backward()
        _DDP_STATES[ddp_model] = state
    state.overlap = overlap
    return DDPAttachment(ddp_model, optimizers, state, settings)


hand_over(nn.parallel.DistributedDataParallel, attach_ddp)  # (layeropt.attach calls it)
