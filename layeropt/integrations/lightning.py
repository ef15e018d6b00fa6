"""Lightning's ``Trainer`` with in-backward updates, exact.

With automatic optimization, Lightning runs each training step as a closure
(``zero_grad``, ``training_step``, backward) handed to ``optimizer.step``,
then clips (``gradient_clip_val``) and unscales (``precision="16-mixed"``)
*after* backward, and runs the micro-batches of ``accumulate_grad_batches``
before the last one outside ``optimizer.step``. An attached layeropt
optimizer alone stays exact there - layeropt holds the gradients of a
backward inside ``step(closure)`` or through a ``GradScaler`` until the step,
and refuses torch-style accumulation - but it then saves no memory.

:class:`LayeroptCallback` puts the in-backward updates back, exactly:

* at ``fit`` start it attaches the module to the layeropt optimizers
  ``configure_optimizers`` returned (and detaches it when ``fit`` ends);
* the precision plugin's ``backward`` goes through :func:`layeropt.backward`:
  micro-batches that accumulate run inside ``optimizer.no_step()``, the last
  one clips the global norm with ``gradient_clip_val`` (one extra backward
  pass) and applies the fp16 ``GradScaler`` (skip on inf/NaN);
  ``gradient_clip_algorithm="value"`` clips each layer's gradient before its
  update (no extra pass);
* Lightning's own clipping and unscaling after backward become no-ops for
  the values the callback applied (anything else raises); a step whose last
  micro-batch ran no backward (``training_step`` returned ``None``) was not
  clipped in backward: Lightning's clipping runs on its held gradients, as
  with ``torch.optim``;
* ``log_grad_norm=True`` logs the measured global norm as
  ``grad_2.0_norm_total`` (the name of ``lightning.pytorch.utilities.grad_norm``;
  without clipping it costs the extra backward pass too);
* ``offload_state=True`` keeps the optimizers' state in host memory
  (:func:`layeropt.offload.offload_state`) from ``fit`` start on; a resumed
  checkpoint's optimizer state loads straight into host memory (the
  strategy's move of the loaded state to the device is skipped for it).

Parameters and optimizer state equal the same ``Trainer`` with ``torch.optim``
bit for bit. One process, or several with a DDP strategy (``strategy="ddp"``
and its variants, ``find_unused_parameters=True`` included): the strategy's
``DistributedDataParallel`` wrapper is attached, so each bucket is stepped on
its averaged gradient. Other strategies under several processes (FSDP,
DeepSpeed) are refused, and so is a ``backward`` of the module's or of the
precision plugin's own (the callback runs backward itself). Automatic
optimization only (with manual optimization layeropt's own rules apply: call
``layeropt.backward`` in ``training_step``). Tested with Lightning 2.6.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from typing import Any

import torch

from ..attaching import Attachment, attach, take_over
from ..backward_pass import backward as layeropt_backward
from ..engine.transforms import grads_total_norm
from ..errors import LayeroptError
from ..optim import InBackwardOptimizer, no_step_all, unwrap_optimizer
from . import attach_kwargs, offload_state_once, two_pass_compile

try:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.precision import MixedPrecision, Precision
except ImportError as exc:  # pragma: no cover - exercised without lightning
    raise ImportError(
        "layeropt.integrations.lightning needs Lightning: pip install 'layeropt[lightning]' "
        "(or pip install lightning)."
    ) from exc

__all__ = ["LayeroptCallback", "LightningSetupError"]


class LightningSetupError(LayeroptError):
    """The Trainer is set up in a way in-backward updates cannot make exact."""


class LayeroptCallback(Callback):
    """Update each layer during backward under Lightning's ``Trainer``, exactly.

    Args:
        bucket_cap_mb: passed to :func:`layeropt.attach` (``None``: its default).
        log_grad_norm: log the global gradient norm (before clipping) every
            optimizer step as ``grad_2.0_norm_total``.
        offload_state: ``True`` keeps each layeropt optimizer's state in host
            memory, each bucket's brought to the device for its step
            (:func:`layeropt.offload.offload_state`; a dict passes its keyword
            arguments, e.g. ``{"overlap": True, "prefetch": True}``). Kept after ``fit``;
            ``callback.offloads`` maps each optimizer to its handle.
        verify: run the first ``verify`` training steps both ways and raise
            :class:`~layeropt.errors.VerifyError` at the first difference
            (:func:`layeropt.attach`'s ``verify``; ``None``: the ``LAYEROPT_VERIFY``
            environment variable).

    Raises:
        LightningSetupError: at ``fit`` start, when no optimizer is a layeropt
            one, several processes run a strategy other than DDP, the module
            uses manual optimization, or the module or the precision plugin
            overrides ``backward``.

    Example:
        >>> class Net(L.LightningModule):  # doctest: +SKIP
        ...     def configure_optimizers(self):
        ...         return layeropt.AdamW(self.parameters(), lr=1e-3)
        >>> trainer = L.Trainer(callbacks=[LayeroptCallback()],  # doctest: +SKIP
        ...                     gradient_clip_val=1.0, accumulate_grad_batches=4)
        >>> trainer.fit(Net(), loader)  # doctest: +SKIP
    """

    def __init__(self, bucket_cap_mb: float | None = None, log_grad_norm: bool = False,
                 offload_state: bool | dict[str, Any] = False,
                 verify: int | None = None) -> None:
        self.bucket_cap_mb = bucket_cap_mb
        self.verify = verify
        self.log_grad_norm = log_grad_norm
        self.offload_state = offload_state
        # optimizer -> its StateOffload (weakly: an optimizer of an earlier fit may go)
        self.offloads: weakref.WeakKeyDictionary[InBackwardOptimizer, Any] = \
            weakref.WeakKeyDictionary()
        self._handle: Attachment | None = None
        self._optimizers: list[InBackwardOptimizer] = []
        self._patched: list[tuple[Any, str]] = []
        self._clip: tuple[float, str] | None = None
        self._unasked = False
        self._stepped = False  # this batch's backward applied the update (not just held)
        self._compiling = contextlib.ExitStack()  # (layeropt.integrations.two_pass_compile)

    # -- setup / teardown ------------------------------------------------------
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Check the set-up, attach the module, route backward through layeropt."""
        model = _model_to_attach(trainer, pl_module)
        if not pl_module.automatic_optimization:
            raise LightningSetupError(
                "LayeroptCallback is for automatic optimization. With manual optimization, "
                "attach the model yourself and call layeropt.backward(loss, ...) instead of "
                "self.manual_backward(loss)."
            )
        _refuse_own_backward(pl_module, trainer.precision_plugin)
        self._optimizers = [
            o for o in map(unwrap_optimizer, trainer.optimizers)
            if isinstance(o, InBackwardOptimizer)
        ]
        if not self._optimizers:
            raise LightningSetupError(
                "LayeroptCallback found no layeropt optimizer: return one from "
                "configure_optimizers, e.g. layeropt.AdamW(self.parameters(), lr=1e-3)."
            )
        clip_val = float(trainer.gradient_clip_val or 0.0)
        algorithm = _algorithm(trainer.gradient_clip_algorithm)
        self._clip = (clip_val, algorithm) if clip_val > 0 else None
        fused = [o for o in self._optimizers if getattr(o, "_step_supports_amp_scaling", False)]
        if self._clip is not None and fused and isinstance(trainer.precision_plugin,
                                                           MixedPrecision):
            raise LightningSetupError(  # (Lightning's own clip_gradients refuses it, later)
                f"The current optimizer, {type(fused[0]).__qualname__}, does not allow for "
                "gradient clipping because it performs unscaling of gradients internally "
                "(Lightning's MixedPrecision refuses it too): build it with fused=False, or "
                "drop gradient_clip_val.")
        self._unasked = False  # a step clipped in backward whose clip_gradients did not come
        self._stepped = False
        by_value = clip_val if self._clip is not None and algorithm == "value" else None
        # each step's closure zeroes the gradients before its backward (and fit(ckpt_path=)
        # loads the checkpoint's parameters): what another optimizer's backward updated
        # before stops counting (docs/rules.md, "A model another optimizer trained")
        if getattr(trainer, "ckpt_path", None) is not None:
            take_over(list(model.parameters()), self._optimizers, "reload")
        self._handle = attach(model, self._optimizers, **attach_kwargs(
            bucket_cap_mb=self.bucket_cap_mb, verify=self.verify, clip_value=by_value))
        self._handle.release = ("Let that Trainer's fit() end (LayeroptCallback removes its "
                                "attachment when fit returns or raises)")
        self._handle._take_over("run")
        for opt in self._optimizers:
            offload_state_once(opt, self.offload_state, self.offloads)
        if self.offloads:  # a resumed checkpoint: its state into host memory, not the device
            self._patch(trainer.strategy, "load_optimizer_state_dict",
                        self._load_optimizer_state_dict(trainer.strategy))
        # a module compiled for this fit: graphs layeropt.backward's two passes can run
        self._compiling.enter_context(two_pass_compile())
        precision = trainer.precision_plugin
        self._patch(precision, "backward", self._backward(trainer))
        self._patch(precision, "clip_gradients", self._clip_gradients(precision))
        scaler = getattr(precision, "scaler", None)
        if scaler is not None:
            self._patch(scaler, "unscale_", _unscale_once(scaler))

    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Detach the module and restore the precision plugin."""
        self._restore()

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule, e: BaseException) -> None:
        """Detach and restore also when ``fit`` fails."""
        self._restore()

    def _patch(self, obj: Any, name: str, fn: Any) -> None:
        setattr(obj, name, fn)  # an instance attribute: only this Trainer's plugin
        self._patched.append((obj, name))

    def _restore(self) -> None:
        for obj, name in reversed(self._patched):
            obj.__dict__.pop(name, None)
        self._patched.clear()
        self._compiling.close()
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _load_optimizer_state_dict(self, strategy: Any) -> Any:
        """``Strategy.load_optimizer_state_dict`` without moving offloaded state to the device
        (offload's ``load_state_dict`` puts it in host memory; the step brings each bucket's)."""
        original = type(strategy).load_optimizer_state_dict

        def load_optimizer_state_dict(checkpoint: Any) -> None:
            states = checkpoint["optimizer_states"]
            offloaded = [unwrap_optimizer(o) in self.offloads for o in strategy.optimizers]
            if not any(offloaded):
                return original(strategy, checkpoint)
            for optimizer, state, host in zip(strategy.optimizers, states, offloaded):
                optimizer.load_state_dict(state)
                if not host:  # as Lightning does for the others
                    from lightning.fabric.utilities.optimizer import _optimizer_to_device

                    _optimizer_to_device(optimizer, strategy.root_device)
            return None

        return load_optimizer_state_dict

    # -- what the precision plugin now does ------------------------------------
    def _backward(self, trainer: pl.Trainer) -> Any:
        def backward(tensor: torch.Tensor, model: Any, optimizer: Any, *args: Any,
                     **kwargs: Any) -> None:
            unknown = set(kwargs) - {"retain_graph"}
            if args or unknown:
                raise LightningSetupError(
                    f"backward got arguments LayeroptCallback does not support ({args}, "
                    f"{sorted(unknown)})."
                )
            opts = self._optimizers
            if trainer.fit_loop._should_accumulate():
                with no_step_all(opts):
                    layeropt_backward(tensor, opts, **kwargs)
                return
            max_norm = None
            if self._clip is not None and self._clip[1] == "norm":
                max_norm = self._clip[0]
            elif self.log_grad_norm:
                max_norm = math.inf  # measure only
            scaler = getattr(trainer.precision_plugin, "scaler", None)
            # (clip_gradients' norm: over Precision.main_params, the param groups' order)
            params = [p for o in opts for g in o.param_groups for p in g["params"]]
            layeropt_backward(tensor, opts, max_norm=max_norm, scaler=scaler,
                              parameters=params if max_norm is not None else None, **kwargs)
            self._stepped = True
            self._unasked = self._clip is not None  # (clip_gradients says it was asked)

        return backward

    def _clip_gradients(self, precision: Any) -> Any:
        """``Precision.clip_gradients``: a no-op for the clipping a backward applied, the
        plugin's own where no backward applied this step (its gradients are all held)."""
        original = type(precision).clip_gradients

        def clip_gradients(optimizer: Any, clip_val: float = 0.0,
                           gradient_clip_algorithm: Any = "norm") -> None:
            algorithm = _algorithm(gradient_clip_algorithm)
            if not self._stepped:
                # no backward applied this step (training_step returned None on its last
                # micro-batch): its gradients are held, as torch's, and clipped as torch's
                if clip_val > 0:
                    _held_to_grad(self._optimizers)
                original(precision, optimizer, clip_val, gradient_clip_algorithm)
                return
            if clip_val <= 0 and self._clip is None:
                return
            if self._clip != (float(clip_val), algorithm):
                raise LightningSetupError(
                    f"clip_gradients({clip_val}, {algorithm!r}) was called after backward, "
                    f"but LayeroptCallback applied {self._clip or 'no clipping'} during "
                    "backward, where the gradients were used and freed. Set the clipping with "
                    "Trainer(gradient_clip_val=..., gradient_clip_algorithm=...) only."
                )
            self._unasked = False

        return clip_gradients

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        """A new batch: no backward of it has applied an update yet."""
        self._stepped = False

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any, **kwargs: Any) -> None:
        """Refuse a step clipped in backward that the module did not ask to clip."""
        if self._unasked:
            self._unasked = False
            raise LightningSetupError(
                "this optimizer step did not call clip_gradients (an overridden "
                "configure_gradient_clipping that skipped it?), but LayeroptCallback clipped "
                f"it during backward, as Trainer(gradient_clip_val={self._clip[0]}) says; that "
                "update was applied clipped. In-backward updates clip every step the same "
                "way: clip on every step, or leave gradient_clip_val unset.")

    def on_before_optimizer_step(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                                 optimizer: Any) -> None:
        """Log the global gradient norm measured in backward (``log_grad_norm``)."""
        if not self.log_grad_norm:
            return
        norm = unwrap_optimizer(optimizer).last_grad_norm
        if not self._stepped:  # no backward measured this step: the held gradients' norm
            _held_to_grad(self._optimizers)
            grads = [p.grad for p in trainer.precision_plugin.main_params(optimizer)
                     if p.grad is not None]
            norm = grads_total_norm(grads) if grads else None
        if norm is not None:
            pl_module.log("grad_2.0_norm_total", norm, on_step=True)


def _model_to_attach(trainer: pl.Trainer, pl_module: pl.LightningModule) -> torch.nn.Module:
    """The module itself, or under several processes the strategy's DDP wrapper."""
    if trainer.world_size <= 1:
        return pl_module
    from torch.nn.parallel import DistributedDataParallel

    wrapped = trainer.strategy.model
    if not isinstance(wrapped, DistributedDataParallel):
        raise LightningSetupError(
            f"LayeroptCallback supports one process or DistributedDataParallel "
            f"(strategy='ddp' and its variants); this Trainer runs "
            f"{type(trainer.strategy).__name__} over {trainer.world_size} processes. Use "
            "torch.optim with it, or a custom loop with FSDP2's fully_shard and "
            "layeropt.attach (docs/distributed.md)."
        )
    return wrapped


def _refuse_own_backward(pl_module: pl.LightningModule, precision: Any) -> None:
    """The callback replaces the precision plugin's ``backward``, which calls the module's:
    an override of either would be skipped silently."""
    owner = None
    if type(pl_module).backward is not pl.LightningModule.backward:
        owner = f"{type(pl_module).__qualname__}.backward (the LightningModule's hook)"
    elif type(precision).backward is not Precision.backward:
        owner = f"{type(precision).__qualname__}.backward (the precision plugin's)"
    if owner is not None:
        raise LightningSetupError(
            f"{owner} is overridden, but LayeroptCallback runs backward itself "
            "(layeropt.backward, to update each layer during it), so the override would be "
            "skipped. Do its work elsewhere: change the loss in training_step (return "
            "3 * loss, not (3 * loss).backward()), a gradient in a tensor hook "
            "(param.register_post_accumulate_grad_hook); or train this module with "
            "torch.optim, without LayeroptCallback."
        )


def _held_to_grad(optimizers: list[InBackwardOptimizer]) -> None:
    """Held gradients that ``offload_state`` keeps in host memory back in ``.grad``, where
    torch's are, for Lightning's own clipping to see (the sums autograd would have made)."""
    for opt in optimizers:
        engine = opt._lo_engine
        hidden = engine.held_elsewhere()
        if hidden:
            engine.stepper.held.up(hidden)


def _algorithm(value: Any) -> str:
    """``"norm"`` or ``"value"`` from a string or Lightning's ``GradClipAlgorithmType``."""
    return str(getattr(value, "value", value) or "norm").lower()


def _unscale_once(scaler: Any) -> Any:
    """``scaler.unscale_`` that is a no-op where ``layeropt.backward`` already unscaled."""
    from torch.amp.grad_scaler import OptState

    original = type(scaler).unscale_

    def unscale_(optimizer: Any) -> None:
        state = scaler._per_optimizer_states[id(optimizer)]
        if state["stage"] is OptState.UNSCALED and isinstance(optimizer, InBackwardOptimizer):
            return  # layeropt.backward(scaler=...) checked and unscaled every gradient
        original(scaler, optimizer)

    return unscale_
