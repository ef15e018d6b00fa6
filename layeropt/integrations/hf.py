"""Hugging Face ``Trainer`` with in-backward updates, exact.

Per optimizer step, ``transformers.Trainer`` runs ``gradient_accumulation_steps``
micro-batches of forward + ``accelerator.backward(loss)``, then
``clip_grad_norm_(model.parameters(), max_grad_norm)`` (when > 0),
``optimizer.step()``, ``lr_scheduler.step()`` and ``model.zero_grad()``. With
an attached layeropt optimizer, three of these would go silently wrong: every
micro-batch's backward would step (N small updates instead of one), clipping
after backward would find no gradient left (and do nothing), and an fp16
``GradScaler`` would find no inf check.

:class:`LayeroptTrainer` (a ``Trainer`` subclass) makes each of them exact:

* the micro-batches before the last run inside ``optimizer.no_step()``: their
  gradients accumulate and the last backward steps each layer with the sum
  (the accelerator's ``sync_gradients`` flag says which micro-batch is last);
* the last backward goes through :func:`layeropt.backward` with
  ``max_norm=args.max_grad_norm`` and the accelerator's ``GradScaler``: exact
  global-norm clipping (one more backward pass) and skip-on-inf;
* ``_clip_grad_norm`` returns the norm measured there (logged as
  ``grad_norm``) instead of clipping gradients that no longer exist;
* without ``optimizers=``, it builds the layeropt version of the optimizer
  ``args.optim`` names (``adamw_torch`` -> ``layeropt.AdamW`` ...);
* it attaches the model at the first training step and detaches it when
  ``train()`` returns or raises: a second Trainer on the same model (resuming
  from the first one's checkpoint, say) trains it as if the first had never
  been (docs/rules.md, "A model another optimizer trained");
* ``offload_state=True`` keeps the optimizer state in host memory
  (:func:`layeropt.offload.offload_state`), from when the optimizer is
  created, so a resumed ``optimizer.pt`` loads straight into host memory.

:class:`LayeroptCallback` is for a plain ``Trainer``: it attaches the model
and maps accumulation to ``no_step()``; a callback cannot change how the
Trainer calls backward, so it refuses ``max_grad_norm > 0`` and ``fp16`` with a
message naming the fix, before the first step.

Checkpoints need nothing: ``optimizer.pt`` is torch's state dict (layeropt
optimizers are the torch classes), so ``save_steps`` and
``resume_from_checkpoint`` work unchanged, also across torch.optim and
layeropt runs.

Under several processes (``torchrun`` / ``accelerate launch``) the Trainer
wraps the model in ``DistributedDataParallel``; ``LayeroptTrainer`` attaches
that wrapper, so each bucket is stepped on its averaged gradient (with the
Trainer's default ``find_unused_parameters=True`` for a ``PreTrainedModel``,
too) and clipping measures the averaged gradients: the same parameters as
``Trainer`` + ``torch.optim`` on every process, bit for bit. FSDP, DeepSpeed
and ``DataParallel`` are refused, and so is ``LayeroptCallback`` under DDP
(a callback never sees the wrapper). Tested with transformers 5.24 and
accelerate 1.15; needs transformers >= 4.46.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import weakref
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..attaching import Attachment, attach, take_over
from ..backward_pass import backward as layeropt_backward
from ..errors import LayeroptError
from ..optim import (
    InBackwardOptimizer,
    in_backward,
    in_backward_spelling,
    owners_of,
    unwrap_optimizer,
)
from . import attach_kwargs, offload_state_once, two_pass_compile

try:
    from transformers import Trainer, TrainerCallback
except ImportError as exc:  # pragma: no cover - exercised without transformers
    raise ImportError(
        "layeropt.integrations.hf needs Hugging Face transformers and accelerate: "
        "pip install 'layeropt[hf]' (or pip install 'transformers>=4.46' accelerate)."
    ) from exc

__all__ = ["LayeroptTrainer", "LayeroptCallback", "TrainerSetupError", "unwrap_optimizer"]

# transformers 5 passes the model to create_optimizer; 4.x takes none.
_CREATE_OPTIMIZER_TAKES_MODEL = "model" in inspect.signature(Trainer.create_optimizer).parameters


class TrainerSetupError(LayeroptError):
    """The Trainer is set up in a way in-backward updates cannot make exact."""


def _check_args(args: Any, *, plain: bool) -> None:
    """Refuse settings the integration cannot make exact (see the messages)."""
    if getattr(args, "n_gpu", 0) > 1:
        raise TrainerSetupError(
            f"this Trainer runs torch.nn.DataParallel over {args.n_gpu} GPUs in one "
            "process, whose replicas layeropt cannot step in backward. Launch one process "
            "per GPU (torchrun / accelerate launch: DistributedDataParallel), or make one "
            "GPU visible (CUDA_VISIBLE_DEVICES)."
        )
    if getattr(args, "fsdp", None) or getattr(args, "deepspeed", None):
        raise TrainerSetupError(
            "layeropt's Trainer integration supports one process or "
            "DistributedDataParallel (torchrun / accelerate launch), not FSDP or "
            "DeepSpeed under the Trainer: use torch.optim there, or a custom loop with "
            "FSDP2's fully_shard and layeropt.attach (docs/distributed.md)."
        )
    if plain and getattr(args, "world_size", 1) > 1:
        raise TrainerSetupError(
            f"LayeroptCallback cannot reach the DistributedDataParallel model this "
            f"Trainer builds ({args.world_size} processes), and the model it is given "
            "would step on each process's local gradient. Use LayeroptTrainer, which "
            "attaches the DDP model."
        )
    if "lomo" in str(getattr(args, "optim", "")).lower():
        raise TrainerSetupError(
            f"optim={args.optim!r} is itself a fused-backward optimizer; use "
            "optim='adamw_torch' (or 'sgd', 'adagrad', 'rmsprop') with layeropt."
        )
    if not plain:
        return
    if (args.max_grad_norm or 0) > 0:
        raise TrainerSetupError(
            f"the Trainer would clip with clip_grad_norm_(max_norm={args.max_grad_norm}) "
            "after backward, when layeropt has already stepped every layer and freed its "
            "gradient, so clipping would silently do nothing. Use LayeroptTrainer (exact "
            "global clipping), set TrainingArguments(max_grad_norm=0), or clip per layer "
            "with layeropt.attach(model, opt, bucket_max_norm=...)."
        )
    if getattr(args, "fp16", False):
        raise TrainerSetupError(
            "fp16 needs a GradScaler that sees every gradient before the first update; "
            "a plain Trainer cannot route backward through layeropt.backward. Use "
            "LayeroptTrainer, or bf16=True (no scaler needed)."
        )


def _in_backward_class(optimizer_cls: Any, optim_name: Any) -> type:
    if not (isinstance(optimizer_cls, type) and issubclass(optimizer_cls, torch.optim.Optimizer)):
        raise TrainerSetupError(
            f"optim={optim_name!r} builds {optimizer_cls!r}, not a torch.optim.Optimizer "
            "subclass, so layeropt cannot step it in backward. Choose optim='adamw_torch' "
            "(or 'adamw_torch_fused', 'sgd', 'adagrad', 'rmsprop'), or pass "
            "optimizers=(layeropt.AdamW(model.parameters(), ...), None)."
        )
    return in_backward(optimizer_cls)


class LayeroptTrainer(Trainer):
    """``transformers.Trainer`` that updates each layer during backward, exactly.

    Same arguments as ``Trainer``. Gradient accumulation, ``max_grad_norm``
    (exact global clipping through :func:`layeropt.backward`, one extra
    backward pass), fp16's ``GradScaler``, bf16, LR schedulers and checkpoint
    save/resume give the parameters ``Trainer`` + ``torch.optim`` gives.

    Args:
        *args: ``Trainer``'s positional arguments.
        bucket_cap_mb: passed to :func:`layeropt.attach` (``None``: its default).
        offload_state: ``True`` keeps the optimizer state in host memory, each
            bucket's brought to the device for its step
            (:func:`layeropt.offload.offload_state`; a dict passes its keyword
            arguments, e.g. ``{"overlap": True, "prefetch": True}``). Applied when the optimizer
            is created and kept after ``train()``; ``trainer.layeropt_offload``
            is its handle (``.host_bytes``, ``.remove()``).
        verify: run the first ``verify`` training steps both ways and raise
            :class:`~layeropt.errors.VerifyError` at the first difference
            (:func:`layeropt.attach`'s ``verify``; ``None``: the ``LAYEROPT_VERIFY``
            environment variable).
        **kwargs: ``Trainer``'s keyword arguments; ``optimizers=(opt, sched)``
            may hold a layeropt optimizer (attached or not), otherwise the
            layeropt version of ``args.optim``'s optimizer is built.

    Raises:
        TrainerSetupError: (at the first training step) FSDP, DeepSpeed or
            DataParallel, a LOMO optimizer, or an optimizer that is not a
            layeropt one.

    Example:
        >>> trainer = LayeroptTrainer(model=model, args=args, train_dataset=data)  # doctest: +SKIP
        >>> trainer.train()  # doctest: +SKIP
    """

    def __init__(self, *args: Any, bucket_cap_mb: float | None = None,
                 offload_state: bool | dict[str, Any] = False, verify: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.bucket_cap_mb = bucket_cap_mb
        self.offload_state = offload_state
        self.verify = verify
        self._layeropt_handle: Attachment | None = None
        self._layeropt_resumed = False  # train(resume_from_checkpoint=...) running
        self._layeropt_offloads: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()

    @property
    def layeropt_offload(self) -> Any:
        """The :class:`layeropt.offload.StateOffload` of ``offload_state=`` (``None`` before)."""
        return next(iter(self._layeropt_offloads.values()), None)

    def create_optimizer(self, model: nn.Module | None = None) -> torch.optim.Optimizer:
        """``Trainer.create_optimizer``, building the layeropt class of ``args.optim``
        (its state offloaded with ``offload_state=``)."""
        optimizer = self._create_layeropt_optimizer(model)
        if self.offload_state:
            offload_state_once(self.layeropt_optimizer(), self.offload_state,
                               self._layeropt_offloads)
        return optimizer

    def _create_layeropt_optimizer(self, model: nn.Module | None) -> torch.optim.Optimizer:
        if self.optimizer is not None:
            return self._base_create_optimizer(model)
        _check_args(self.args, plain=False)
        saved = getattr(self, "optimizer_cls_and_kwargs", None)
        if saved is not None:
            cls, kwargs = saved
        else:
            cls, kwargs = self.get_optimizer_cls_and_kwargs(self.args, model or self.model)
        self.optimizer_cls_and_kwargs = (_in_backward_class(cls, self.args.optim), kwargs)
        try:
            return self._base_create_optimizer(model)
        finally:
            self.optimizer_cls_and_kwargs = saved

    def _base_create_optimizer(self, model: nn.Module | None) -> torch.optim.Optimizer:
        if _CREATE_OPTIMIZER_TAKES_MODEL:
            return super().create_optimizer(model)
        return super().create_optimizer()  # transformers 4.x: no model argument

    def layeropt_optimizer(self) -> InBackwardOptimizer:
        """The layeropt optimizer this Trainer steps (unwrapped from accelerate)."""
        opt = unwrap_optimizer(self.optimizer)
        if not isinstance(opt, InBackwardOptimizer):
            spelling = in_backward_spelling(type(opt)) if isinstance(opt, torch.optim.Optimizer) \
                else "layeropt.AdamW"
            raise TrainerSetupError(
                f"LayeroptTrainer needs a layeropt optimizer, got {type(opt).__name__}. Pass "
                f"optimizers=({spelling}(model.parameters(), ...same arguments), scheduler): "
                "the same optimizer, stepped in backward, gives Trainer's numbers. Or pass no "
                "optimizers to build the layeropt version of args.optim."
            )
        return opt

    def _layeropt_attach(self, model: nn.Module) -> InBackwardOptimizer:
        """Attach ``model``, the model as the Trainer wrapped it (DDP under several processes)."""
        opt = self.layeropt_optimizer()
        if not opt.attached:
            _check_args(self.args, plain=False)
            model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: what it compiled
            if self.args.world_size > 1 and not isinstance(model, DDP):
                raise TrainerSetupError(
                    f"LayeroptTrainer supports one process or DistributedDataParallel; this "
                    f"Trainer runs {self.args.world_size} processes with the model wrapped as "
                    f"{type(model).__name__}, whose gradients layeropt cannot average. Use "
                    "torch.optim with it."
                )
            # train() zeroed the model's gradients before this first step (and, resuming,
            # loaded the checkpoint's parameters): what another optimizer's backward
            # updated before stops counting (docs/rules.md, "A model another optimizer
            # trained")
            if self._layeropt_resumed:
                take_over(list(model.parameters()), [opt], "reload")
            self._layeropt_handle = attach(model, opt, **attach_kwargs(
                bucket_cap_mb=self.bucket_cap_mb, verify=self.verify))
            self._layeropt_handle.release = (
                "Let that LayeroptTrainer's train() end (it removes its attachment when "
                "train() returns or raises)")
            self._layeropt_handle._take_over("run")
            offload_state_once(opt, self.offload_state, self._layeropt_offloads)  # (if not yet)
        return opt

    def training_step(self, model: nn.Module, inputs: Any, *args: Any, **kwargs: Any) -> Tensor:
        """``Trainer.training_step`` with layeropt's backward (see the module docstring)."""
        opt = self._layeropt_attach(model)
        acc = self.accelerator
        sync = bool(acc.sync_gradients)
        had = acc.__dict__.get("backward")
        acc.backward = functools.partial(self._layeropt_backward, opt, sync)
        self._layeropt_measured = False  # (a backward through accelerator.backward, syncing)
        acc.clip_grad_norm_ = self._layeropt_grad_norm  # the Trainer clips after training_step
        try:
            with contextlib.nullcontext() if sync else opt.no_step():
                return super().training_step(model, inputs, *args, **kwargs)
        finally:
            if had is None:
                del acc.backward
            else:
                acc.backward = had

    def _layeropt_backward(
        self, opt: InBackwardOptimizer, sync: bool, loss: Tensor, **kwargs: Any
    ) -> None:
        """``Accelerator.backward`` (loss division, scaler) through ``layeropt.backward``."""
        unknown = set(kwargs) - {"retain_graph"}
        if unknown:
            raise TrainerSetupError(
                f"accelerator.backward got {sorted(unknown)}, which LayeroptTrainer does "
                "not support (DeepSpeed / LOMO settings?)."
            )
        acc = self.accelerator
        loss = loss / acc.gradient_accumulation_steps  # as Accelerator.backward does
        scaler = acc.scaler
        if scaler is not None:
            loss = scaler.scale(loss)
        if not sync:  # inside opt.no_step(): gradients only accumulate
            layeropt_backward(loss, opt, **kwargs)
            return
        max_norm = self.args.max_grad_norm if (self.args.max_grad_norm or 0) > 0 else None
        self._layeropt_measured = True
        layeropt_backward(
            loss,
            opt,
            max_norm=max_norm,
            scaler=scaler,
            parameters=self.model.parameters(),  # clip_grad_norm_'s order: exact norm
            **kwargs,
        )

    def _layeropt_grad_norm(self, parameters: Any, max_norm: float, *args: Any, **kw: Any) -> Any:
        """``Accelerator.clip_grad_norm_`` as the Trainer calls it after ``training_step``.

        ``layeropt.backward`` already clipped with ``args.max_grad_norm``: the
        norm it measured. The Trainer's norm-only call (``max_norm=inf``, for
        logging without clipping) gets ``None``: no gradient is left to measure.
        """
        if math.isinf(max_norm):
            return None
        if not getattr(self, "_layeropt_measured", True):
            raise TrainerSetupError(
                "the Trainer clips (max_grad_norm > 0) after a training_step whose backward "
                "did not go through self.accelerator.backward(loss) (loss.backward()?): "
                "that backward updated the parameters unclipped. Call "
                "self.accelerator.backward(loss) in training_step, as the Trainer's does.")
        return self.layeropt_optimizer().last_grad_norm

    def train(self, *args: Any, **kwargs: Any) -> Any:
        """``Trainer.train``; the model is detached again when it returns or raises.

        With ``torch_compile``, AOTAutograd's donated buffers are off while it
        trains (:func:`layeropt.integrations.two_pass_compile`).
        """
        resume = kwargs.get("resume_from_checkpoint", args[0] if args else None)
        self._layeropt_resumed = bool(resume)  # (the parameters are the checkpoint's)
        try:
            with two_pass_compile() if self.args.torch_compile else contextlib.nullcontext():
                return super().train(*args, **kwargs)
        finally:
            self.accelerator.__dict__.pop("clip_grad_norm_", None)
            if self._layeropt_handle is not None:
                self._layeropt_handle.remove()
                self._layeropt_handle = None


class LayeroptCallback(TrainerCallback):
    """Use a layeropt optimizer with a plain ``transformers.Trainer``.

    Attaches the model when training begins (unless the optimizer already is
    attached) and detaches it at the end (after a ``train()`` that raised, which
    calls no callback: :meth:`detach`); runs the micro-batches before the
    last of each accumulation inside ``optimizer.no_step()``. The plain
    Trainer still logs a ``grad_norm`` measured after backward, when no
    gradient is left: it is 0, and a warning says so (``LayeroptTrainer``
    logs the real one). Refuses, when
    training begins, what a callback cannot make exact: ``max_grad_norm > 0``
    (Trainer's default is 1.0) and ``fp16``; use :class:`LayeroptTrainer` for
    those.

    Args:
        bucket_cap_mb: passed to :func:`layeropt.attach` (``None``: its default).
        verify: run the first ``verify`` training steps both ways and raise
            :class:`~layeropt.errors.VerifyError` at the first difference
            (:func:`layeropt.attach`'s ``verify``; ``None``: the ``LAYEROPT_VERIFY``
            environment variable).

    Raises:
        TrainerSetupError: at ``on_train_begin``, for the settings above,
            several processes (use ``LayeroptTrainer``), or when no layeropt
            optimizer owns the model.

    Example:
        >>> opt = layeropt.AdamW(model.parameters(), lr=1e-3)  # doctest: +SKIP
        >>> args = TrainingArguments(output_dir, max_grad_norm=0)  # doctest: +SKIP
        >>> trainer = Trainer(model=model, args=args, train_dataset=data,  # doctest: +SKIP
        ...                   optimizers=(opt, None), callbacks=[LayeroptCallback()])
    """

    def __init__(self, bucket_cap_mb: float | None = None, verify: int | None = None) -> None:
        self.bucket_cap_mb = bucket_cap_mb
        self.verify = verify
        self._opt: InBackwardOptimizer | None = None
        self._handle: Attachment | None = None
        self._deferring = contextlib.ExitStack()
        self._seen = 0
        self._defer_left = 0

    def _find(self, model: nn.Module, optimizer: Any) -> InBackwardOptimizer:
        opt = unwrap_optimizer(optimizer)
        if opt is None:  # the Trainer builds its own: look for a live layeropt one
            owners = owners_of(list(model.parameters()))
            opt = owners[0] if len(owners) == 1 else None
        if not isinstance(opt, InBackwardOptimizer):
            raise TrainerSetupError(
                "LayeroptCallback needs the Trainer to step a layeropt optimizer: pass "
                "optimizers=(layeropt.AdamW(model.parameters(), ...), scheduler), or use "
                "LayeroptTrainer, which builds one from args.optim."
            )
        return opt

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Check the settings, find the layeropt optimizer, attach the model."""
        _check_args(args, plain=True)
        self.detach()  # what an earlier train() that raised left attached
        model = kwargs["model"]
        self._opt = self._find(model, kwargs.get("optimizer"))
        if not self._opt.attached:
            self._handle = attach(model, self._opt, **attach_kwargs(
                bucket_cap_mb=self.bucket_cap_mb, verify=self.verify))
            self._handle.release = (
                "Call detach() on the LayeroptCallback that attached the model (a Trainer "
                "calls no callback when train() raises, so the attachment outlives it)")
            self._handle._take_over("run")  # (train() zeroed the model's gradients before)
        self._deferring.close()

    def on_epoch_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Start counting this epoch's micro-batches."""
        self._seen = 0  # micro-batches of this epoch so far

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Enter ``no_step()`` when this accumulation has more than one micro-batch."""
        # Trainer cuts each epoch into accumulations of gradient_accumulation_steps
        # micro-batches, the last one shorter; defer all but the last micro-batch.
        count = args.gradient_accumulation_steps
        try:
            count = min(count, len(kwargs["train_dataloader"]) - self._seen)
        except (KeyError, TypeError):  # no length: an iterable dataset
            pass
        self._defer_left = count - 1
        self._deferring.close()
        if self._defer_left > 0 and self._opt is not None:
            self._deferring.enter_context(self._opt.no_step())

    def on_substep_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Leave ``no_step()`` before the accumulation's last micro-batch."""
        self._seen += 1
        self._defer_left -= 1
        if self._defer_left <= 0:
            self._deferring.close()  # the next micro-batch is the last: it steps

    def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Leave ``no_step()`` in any case before ``optimizer.step()``."""
        # Should an accumulation have been longer than counted (a resumed epoch),
        # it ended inside no_step(): optimizer.step() then steps the held
        # gradients, still exactly.
        self._deferring.close()

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Count the accumulation's last micro-batch."""
        self._seen += 1

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        """Leave ``no_step()`` and detach the model (if this callback attached it)."""
        self.detach()

    def detach(self) -> None:
        """Leave ``no_step()`` and remove the attachment this callback made, if any.

        ``on_train_end`` calls it. A ``train()`` that raised calls no callback, so the
        model stays attached until this is called, or until this callback's next
        ``train()`` begins: attaching the model to another optimizer is refused until
        then, with a message that says so.
        """
        self._deferring.close()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
