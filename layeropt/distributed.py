"""Distributed training: in-backward updates on DDP and FSDP2, never on local gradients.

A data-parallel replica may only be updated with the gradient averaged over
all processes, so layeropt steps where torch's engines finish averaging:

* **DDP** (:func:`attach_ddp`): a communication hook (``layeropt/_ddp_hook.py``)
  all-reduces each bucket and frees its parameters' local ``.grad``; once the
  average has landed (at the end of backward on CPU, in the future's
  ``.then()`` on CUDA) the bucket's parameters are stepped on it; the reducer
  is told an optimizer ran in backward, so it leaves ``.grad`` alone
  afterwards.
* **FSDP2**: ``fully_shard`` calls the sharded parameters' post-accumulate-grad
  hooks itself right after each reduce-scatter, so ``layeropt.attach`` works.
* :func:`check_local_hooks_allowed`: the plain hooks' guard against stepping
  a replica on its local gradient.

See ``docs/distributed.md`` for accumulation, checkpointing and memory.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from ._ddp_hook import _allreduce_then_step, _Copied, _HookState
from ._registry import allow_local_updates, check_local_hooks_allowed, hooked_by
from .attaching import Attachment, layer_buckets, register_wrapper, resolve_owners
from .errors import AttachError
from .landing import Settings

__all__ = [
    "DDPAttachment",
    "attach_ddp",
    "check_local_hooks_allowed",
    "allow_local_updates",
]

# DDP instance -> its comm-hook state (DDP accepts one comm hook, for good).
_DDP_STATES: "weakref.WeakKeyDictionary[nn.Module, _HookState]" = weakref.WeakKeyDictionary()


class _TwoPasses:
    """``layeropt.backward``'s two passes on DDP models (clipping, GradScaler).

    Pass 1 (measure): the comm hook averages each bucket as usual and the
    engines reduce the averaged gradients to norms / inf flags. Then each
    parameter's ``.grad`` and the record of which parameters got a gradient
    (``find_unused_parameters``) are put back as they were before the pass
    (only what ``no_step()`` / ``no_sync()`` accumulated), since the reducer
    left the pass's local gradient in ``.grad``. Pass 2 (step): DDP's reducer
    runs once per forward, so :meth:`arm` arms it again as DDP's forward does;
    its buckets then go through the comm hook as any backward's do.
    """

    def __init__(self, engines: list[Any]) -> None:
        self.states = []
        for e in engines:
            for a in list(e.attachments):
                if isinstance(a, DDPAttachment) and a._state not in self.states:
                    self.states.append(a._state)

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        grads = {p: None if p.grad is None else p.grad.detach().clone()
                 for state in self.states for p in state.owner}
        fired = [set(state.fired) for state in self.states]
        try:
            yield
        finally:
            for state, before in zip(self.states, fired):
                state.fired = before
            for p, grad in grads.items():
                p.grad = grad

    def arm(self, loss: Tensor) -> None:
        """Before pass 2: DDP's reducer expects this backward (what DDP's forward does)."""
        for state in self.states:
            ddp = state.ddp()
            if ddp is None or not ddp.require_forward_param_sync:  # (a no_sync() forward)
                continue
            ddp.reducer._rebuild_buckets()  # the first step's, as the next forward would
            state.fresh = True
            find = ddp.find_unused_parameters and not ddp.static_graph
            ddp.reducer.prepare_for_backward([loss] if find else [])


def two_passes(engines: list[Any]) -> _TwoPasses:
    """The DDP side of ``layeropt.backward``'s passes for these engines (no-op without DDP)."""
    return _TwoPasses(engines)


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
        self.params = list(owner)
        self.named = [(n, p) for n, p in ddp.named_parameters() if p in owner]
        for opt in self.optimizers:
            opt._lo_engine.add_attachment(self)  # opt.attached; add_param_group -> _rebuild
        with self._state.lock:
            self._state.owner = {p: weakref.ref(o) for p, o in owner.items()}
            self._state.settings = self.settings
            self._state.active = True
            self._state.fresh = True  # (attached between a forward and its backward)

    def hooks(self, param: Tensor) -> bool:
        """Whether ``param`` is stepped through this DDP model's communication hook."""
        return any(p is param for p in self.params)

    def _release(self) -> None:
        with self._state.lock:
            self._state.owner = {}
            self._state.active = False
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
        "delayed all-reduce of every parameter": getattr(
            ddp, "_delay_all_reduce_all_params", False
        ),
    }
    for what, bad in problems.items():
        if bad:
            raise AttachError(
                f"layeropt cannot step in backward under DDP with {what}: a bucket's "
                "parameters would be stepped without knowing their global gradient. "
                "Construct DistributedDataParallel without it, or keep a plain "
                "torch.optim optimizer for this model."
            )
    if any(hooked_by(p) is not None for p in ddp.parameters()):
        raise AttachError(
            "some parameters of this DDP model carry plain layeropt hooks (attached "
            "before wrapping, or on ddp_model.module), which would step on local "
            "gradients. Call .remove() on that attachment, then attach the DDP model."
        )


def attach_ddp(
    ddp_model: nn.Module,
    optimizer: Optimizer | Iterable[Optimizer] | None = None,
    *,
    bucket_cap_mb: float = 1.0,
    overlap: bool = True,
    clip_value: float | None = None,
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
    state = _DDP_STATES.get(ddp_model)
    if state is not None and state.active:
        raise AttachError(
            "this DDP model is already attached; call .remove() on that handle first."
        )
    if state is None:
        hooks = getattr(ddp_model, "_comm_hooks", None)
        if hooks and all(type(st) is _Copied for _, st in hooks):
            hooks.clear()  # a copy of an attached model: its reducer was built without them
        if hooks:
            raise AttachError(
                "this DDP model already has a communication hook, and DDP accepts only "
                "one. layeropt needs its own (it averages, then steps each bucket): "
                "build the DDP model without register_comm_hook."
            )
        state = _HookState(ddp_model, overlap)
        ddp_model.register_forward_pre_hook(state.forward)
        ddp_model.register_comm_hook(state, _allreduce_then_step)
        # The reducer must not copy buckets back into .grad after the hook.
        ddp_model.reducer._set_optimizer_in_backward()
        _DDP_STATES[ddp_model] = state
    state.overlap = overlap
    return DDPAttachment(ddp_model, optimizers, state, settings)


register_wrapper(torch.nn.parallel.DistributedDataParallel, attach_ddp)  # layeropt.attach(ddp)
