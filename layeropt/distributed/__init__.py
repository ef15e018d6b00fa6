"""Distributed training: in-backward updates on DDP, FSDP2 and tensor-parallel DTensors,
never on local gradients.

A data-parallel replica may only be updated with the gradient averaged over
all processes, so layeropt steps where torch's engines finish averaging:

* **DDP** (:func:`attach_ddp`, ``ddp.py``): a communication hook (``ddp_hook.py``)
  all-reduces each bucket - or reduces it with the user's ``comm_hook`` - and frees
  its parameters' local ``.grad``; once the
  average has landed (at the end of backward on CPU, in the future's
  ``.then()`` on CUDA) the bucket's parameters are stepped on it; the reducer
  is told an optimizer ran in backward, so it leaves ``.grad`` alone
  afterwards.
* **FSDP2**: ``fully_shard`` calls the sharded parameters' post-accumulate-grad
  hooks itself right after each reduce-scatter, so ``layeropt.attach`` works.
* **Tensor parallelism** (``parallelize_module``): a DTensor parameter's gradient is
  complete when autograd accumulates it (the collectives run on activations), so
  ``layeropt.attach`` steps it in its own hook.
* **Pipeline schedules** (``pipelining.py``): a schedule's ``step()`` sums its
  micro-batches' gradients, so the attached optimizers hold theirs inside it.
* :func:`check_local_hooks_allowed`: the plain hooks' guard against stepping
  a replica on its local gradient.

See ``docs/distributed.md`` for accumulation, checkpointing and memory.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ..engine.registry import (allow_local_updates, check_local_hooks_allowed,
                               local_gradient_allowed, world_size)
from ..errors import AttachError
from .ddp import DDPAttachment, attach_ddp
from .ddp_hook import hook_name, stateless
from .fsdp2 import fsdp_params as _fsdp_params

__all__ = [
    "DDPAttachment",
    "attach_ddp",
    "check_local_hooks_allowed",
    "allow_local_updates",
]

def _fsdp_held(fsdp_params: list[Any]) -> list[tuple[Any, Tensor | None, Tensor | None]]:
    """Copies of the unsharded gradients FSDP2 holds from backwards that did not reduce
    (``set_requires_gradient_sync(False)``): pass 1 reduces them with its own and drops
    them, and pass 2 must find them again, as the one backward of torch's recipe does."""
    held = []
    for fsdp_param in fsdp_params:
        # (its own buffer before torch 2.15; there, a read-only property of the .grad below)
        accumulated = vars(fsdp_param).get("unsharded_accumulated_grad")
        param = getattr(fsdp_param, "_unsharded_param", None)
        grad = None if param is None else param.grad
        if accumulated is not None or grad is not None:
            held.append((fsdp_param, None if accumulated is None else accumulated.clone(),
                         None if grad is None else grad.detach().clone()))
    return held


class _Kept:
    """A ``.grad`` before the measure pass, to be put back as the same tensor: the loop
    (and ``LAYEROPT_VERIFY``, which finds a gradient not zeroed since ``step()`` by its
    identity) holds that one. The reducer adds the pass's local gradient into it."""

    def __init__(self, grad: Tensor | None) -> None:
        self.grad = grad
        self.values = None if grad is None else grad.detach().clone()
        self.version = None if grad is None else grad._version

    def restored(self) -> Tensor | None:
        if self.grad is not None and self.grad._version != self.version:
            with torch.no_grad():
                self.grad.copy_(self.values)
        return self.grad


TWO_PASSES_PLAIN_ERROR = (
    "layeropt.backward(max_norm=/clip_value=/scaler=) on {world} processes with "
    "parameter {name} attached by a plain hook, neither a DTensor nor allowed local "
    "updates: it would be stepped on this process's local gradient. Under "
    "DistributedDataParallel the two backward passes go through DDP's reducer, which "
    "averages only the first, so the parameters DDP wraps outside layeropt's attachments "
    "(another optimizer's) would keep their local gradients too: attach the wrapper after "
    "wrapping (layeropt.attach(ddp_model, opt)). Under tensor parallelism "
    "(parallelize_module), shard it (SequenceParallel) or, where every rank gets the same "
    "batch, call layeropt.distributed.allow_local_updates on its module; where every "
    "process trains its own model, on the model. Nothing was updated."
)

TWO_PASSES_HOOK_ERROR = (
    "layeropt.backward(max_norm=/scaler=) on a DDP model reducing its buckets through "
    "{hook}: its two backward passes (one to measure, one to step) run the hook "
    "twice on every bucket, and a hook that keeps state between calls (PowerSGD's error "
    "feedback and iteration count) would see each bucket twice where torch's one backward "
    "runs it once. torch's stateless hooks (allreduce_hook, fp16_compress_hook, "
    "bf16_compress_hook) are exact; for another, hold the backward (with opt.no_step(): "
    "loss.backward()), then clip_grad_norm_ and opt.step() as with torch.optim. Nothing "
    "was updated."
)


class TwoPasses:
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
        self.fsdp_params: list[Any] = []  # FSDP2's, of the attached models
        world = world_size()
        for e in engines:
            for a in list(e.attachments):
                if isinstance(a, DDPAttachment):
                    if not stateless(a._state.comm_hook):
                        raise AttachError(TWO_PASSES_HOOK_ERROR.format(
                            hook=hook_name(a._state.comm_hook)))
                    if a._state not in self.states:
                        self.states.append(a._state)
                    continue
                if a.model is not None:
                    self.fsdp_params += _fsdp_params(a.model)
                for name, p in a.named:  # (as its hooks would, if the backward reached them)
                    if not local_gradient_allowed(p, world):
                        raise AttachError(TWO_PASSES_PLAIN_ERROR.format(world=world,
                                                                        name=repr(name)))

    @contextlib.contextmanager
    def measure(self) -> Iterator[None]:
        grads = {p: _Kept(p.grad) for state in self.states for p in state.owner}
        fired = [set(state.fired) for state in self.states]
        held = _fsdp_held(self.fsdp_params)
        try:
            yield
        finally:
            for state, before in zip(self.states, fired):
                state.fired = before
            for p, kept in grads.items():
                p.grad = kept.restored()
            for fsdp_param, accumulated, grad in held:  # (pass 1 reduced and dropped them)
                if "unsharded_accumulated_grad" in vars(fsdp_param):
                    fsdp_param.unsharded_accumulated_grad = accumulated
                fsdp_param._unsharded_param.grad = grad

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
