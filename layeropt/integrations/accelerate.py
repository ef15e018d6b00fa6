"""accelerate's training loop with in-backward updates, exact.

A loop written for ``accelerate`` calls ``accelerator.backward(loss)`` inside
``accelerator.accumulate(model)``, then - on the micro-batch that syncs -
``accelerator.clip_grad_norm_`` (or ``clip_grad_value_``), ``optimizer.step()``
and ``optimizer.zero_grad()``. With an attached layeropt optimizer alone,
that loop is refused (accumulation, clipping after backward) or held until
the step (fp16's ``GradScaler``): exact, but saving nothing.

:class:`LayeroptAccelerator` is an ``Accelerator`` that keeps the same loop
and updates each layer during backward, with the parameters ``Accelerator`` +
``torch.optim`` gives, bit for bit:

* ``prepare`` attaches every prepared model to the prepared layeropt
  optimizers that own its parameters;
* ``backward`` divides by ``gradient_accumulation_steps`` and scales (fp16)
  as ``Accelerator.backward`` does, runs micro-batches that do not sync inside
  ``optimizer.no_step()``, and sends the syncing one through
  :func:`layeropt.backward` with the loop's clipping and the ``GradScaler``;
* the clipping the loop asks for is learned on the first optimizer step,
  which runs exactly as plain accelerate does (its gradients are held until
  ``optimizer.step()``, so ``clip_grad_norm_`` really clips them): from the
  second step on, the same ``clip_grad_norm_(parameters, max_norm)`` call
  returns the norm measured during backward, and ``clip_grad_value_`` is
  applied to each layer before its update, after the norm's coefficient (so
  ``clip_grad_value_`` before ``clip_grad_norm_``, and by value over a part of
  the layeropt optimizers' parameters, raise). Pass ``max_grad_norm=`` (or
  ``clip_value=``) to skip the learning step; a later call with other values
  raises;
* accelerate's loops call ``optimizer.step()``: a second syncing backward before it
  (accumulation by hand) is refused at that backward, before it is applied, from the
  first step on (the engine's ``expect_step``; on the learning step, here);
* ``offload_state=True`` keeps the prepared layeropt optimizers' state in
  host memory (:func:`layeropt.offload.offload_state`), so ``load_state``
  (``map_location="cpu"``, its default in one process) loads it there. The
  clipping is then never learned (the learning step would bring the whole
  state to the device at once): pass ``max_grad_norm=`` / ``clip_value=``
  when the loop clips; a clipping call without them raises.

Under several processes (``accelerate launch`` / ``torchrun``) ``prepare``
wraps the model in ``DistributedDataParallel`` and the wrapper is attached:
each bucket is stepped on its averaged gradient, ``accumulate`` keeps DDP's
``no_sync``, and clipping measures the averaged gradients - the parameters
equal accelerate + ``torch.optim`` on every process, bit for bit
(``find_unused_parameters=True`` included). A ``comm_hook`` in
``DistributedDataParallelKwargs`` reduces each bucket through layeropt's hook
(:func:`layeropt.attach`'s ``comm_hook``: clipping then needs a stateless one,
fp16/bf16 compression, not PowerSGD). Other multi-process set-ups
(FSDP, DeepSpeed plugins) are refused in ``prepare``. Tested with
accelerate 1.15 and 1.16 (the comm hooks with 1.16).
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

from torch import Tensor, nn
from torch.nn.parallel import DistributedDataParallel as DDP

from ..attaching import Attachment, attach
from ..backward_pass import backward as layeropt_backward
from ..backward_pass import default_parameters
from ..errors import LayeroptError
from ..optim import InBackwardOptimizer, no_step_all, unwrap_optimizer
from . import attach_kwargs, offload_state_once, two_pass_compile

try:
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType, DynamoBackend
except ImportError as exc:  # pragma: no cover - exercised without accelerate
    raise ImportError(
        "layeropt.integrations.accelerate needs accelerate: pip install "
        "'layeropt[accelerate]' (or pip install accelerate)."
    ) from exc

__all__ = ["LayeroptAccelerator", "AccelerateSetupError"]


class AccelerateSetupError(LayeroptError):
    """The loop asks for something in-backward updates cannot make exact."""


_UNSET = object()


@contextlib.contextmanager
def _comm_hook_aside(handler: Any) -> Iterator[dict[str, Any]]:
    """``DistributedDataParallelKwargs(comm_hook=...)``: accelerate registers that hook on
    the DDP model it builds, and DDP takes one hook, for good - layeropt's, which reduces
    each bucket with the user's hook, then steps it. The hook accelerate would register
    (made by its own ``register_comm_hook``: the wrapper, PowerSGD's state) is taken
    here, for :func:`layeropt.attach`'s ``comm_hook=`` / ``comm_state=``; accelerate
    registers none meanwhile."""
    kind = getattr(handler, "comm_hook", DDPCommunicationHookType.NO)
    if kind == DDPCommunicationHookType.NO:
        yield {}
        return
    taken: dict[str, Any] = {}
    handler.register_comm_hook(_Taker(taken))
    handler.comm_hook = DDPCommunicationHookType.NO
    try:
        yield taken
    finally:
        handler.comm_hook = kind


class _Taker:
    """Stands in for the DDP model in accelerate's ``register_comm_hook``: keeps the hook."""

    def __init__(self, taken: dict[str, Any]) -> None:
        self.taken = taken

    def register_comm_hook(self, state: Any, hook: Any) -> None:
        self.taken.update(comm_hook=hook, comm_state=state)


class LayeroptAccelerator(Accelerator):
    """``accelerate.Accelerator`` that updates each layer during backward, exactly.

    Args:
        *args: ``Accelerator``'s positional arguments.
        max_grad_norm: the ``max_norm`` the loop passes to
            ``clip_grad_norm_`` (``None``: learned on the first step).
        norm_type: its ``norm_type``.
        clip_value: the value the loop passes to ``clip_grad_value_``
            (``None``: learned on the first step).
        bucket_cap_mb: passed to :func:`layeropt.attach` (``None``: its default).
        offload_state: ``True`` keeps each prepared layeropt optimizer's state
            in host memory, each bucket's brought to the device for its step
            (:func:`layeropt.offload.offload_state`; a dict passes its keyword
            arguments, e.g. ``{"overlap": True, "prefetch": True}``); ``accelerator.offloads``
            maps each optimizer to its handle. Clipping is not learned then:
            give ``max_grad_norm`` / ``clip_value`` if the loop clips.
        verify: run the first ``verify`` training steps both ways and raise
            :class:`~layeropt.errors.VerifyError` at the first difference
            (:func:`layeropt.attach`'s ``verify``; ``None``: the ``LAYEROPT_VERIFY``
            environment variable).
        **kwargs: ``Accelerator``'s keyword arguments.

    Raises:
        AccelerateSetupError: a clipping call that differs from the one
            learned or given.

    Example:
        >>> accelerator = LayeroptAccelerator(gradient_accumulation_steps=4)  # doctest: +SKIP
        >>> model, opt, loader = accelerator.prepare(  # doctest: +SKIP
        ...     model, layeropt.AdamW(model.parameters(), lr=1e-3), loader)
        >>> for x, y in loader:  # doctest: +SKIP
        ...     with accelerator.accumulate(model):
        ...         accelerator.backward(loss_fn(model(x), y))
        ...         if accelerator.sync_gradients:
        ...             accelerator.clip_grad_norm_(model.parameters(), 1.0)
        ...         opt.step()
        ...         opt.zero_grad()
    """

    def __init__(self, *args: Any, max_grad_norm: float | None = None, norm_type: float = 2.0,
                 clip_value: float | None = None, bucket_cap_mb: float | None = None,
                 offload_state: bool | dict[str, Any] = False, verify: int | None = None,
                 **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.layeropt_bucket_cap_mb = bucket_cap_mb
        self.layeropt_verify = verify
        self.layeropt_offload_state = offload_state
        # optimizer -> its StateOffload (weakly: one freed by free_memory() may go)
        self.offloads: weakref.WeakKeyDictionary[InBackwardOptimizer, Any] = \
            weakref.WeakKeyDictionary()
        self._lo_handles: dict[int, Attachment] = {}
        self._lo_given = (max_grad_norm, float(norm_type), clip_value)
        self._reset_clipping()
        # accelerate compiles the prepared models: graphs two backwards can run, until
        # free_memory() (layeropt.integrations.two_pass_compile)
        self._lo_compiling = contextlib.ExitStack()

    def _reset_clipping(self) -> None:
        """The clipping as given to ``__init__`` (again after ``free_memory()``)."""
        max_grad_norm, norm_type, clip_value = self._lo_given
        # (max_norm, norm_type, ids of the parameters or None: all) / value; _UNSET:
        # learned on the first step - never with offload_state: that step holds every
        # gradient until opt.step(), which steps them all at once, the whole state on the
        # device
        given = (max_grad_norm is not None or clip_value is not None
                 or bool(self.layeropt_offload_state))
        unset = None if given else _UNSET
        self._lo_norm: Any = unset if max_grad_norm is None else (
            float(max_grad_norm), norm_type, None)
        self._lo_value: Any = unset if clip_value is None else float(clip_value)
        # the engine's training step (its StepRecord) the learning step runs in, until a
        # step() or zero_grad() ends it
        self._lo_learning: Any = None
        # what the latest syncing backward clipped that the loop has not asked for since
        self._lo_unasked: set[str] = set()
        self._lo_measured = -1  # the engine transaction of the latest clipping backward
        # (engine transaction, the clipping calls of its step in order): backward clips by
        # norm first, then by value, so value-then-norm is refused (_check_order)
        self._lo_calls: tuple[int, list[str]] = (-1, [])

    # -- the layeropt optimizers and attachments -----------------------------
    @property
    def layeropt_optimizers(self) -> list[InBackwardOptimizer]:
        """The prepared layeropt optimizers (unwrapped)."""
        found = (unwrap_optimizer(o) for o in self._optimizers)
        return [o for o in found if isinstance(o, InBackwardOptimizer)]

    def prepare(self, *args: Any, **kwargs: Any) -> Any:
        """``Accelerator.prepare``; then attaches prepared models to their layeropt optimizers."""
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            self._lo_compiling.enter_context(two_pass_compile())
        with _comm_hook_aside(getattr(self, "ddp_handler", None)) as comm:
            out = super().prepare(*args, **kwargs)
        opts = self.layeropt_optimizers
        for wrapper in self._optimizers:  # (optimizer.no_step() on the prepared optimizer,
            inner = unwrap_optimizer(wrapper)  # as the loop holds a backward: the inner one's)
            if isinstance(inner, InBackwardOptimizer) and not hasattr(wrapper, "no_step"):
                wrapper.no_step = inner.no_step
        # The models as prepared (DistributedDataParallel under several processes):
        # the wrapper is what the loop calls, and what averages the gradients.
        prepared = out if isinstance(out, tuple) else (out,)
        for model in prepared:
            if not isinstance(model, nn.Module) or id(model) in self._lo_handles:
                continue
            params = list(model.parameters())
            owners = [o for o in opts if any(o.owns(p) for p in params)]
            key = id(model)
            model = getattr(model, "_orig_mod", model)  # torch.compile's wrapper: what it compiled
            if owners and self.num_processes > 1 and not isinstance(model, DDP):
                raise AccelerateSetupError(
                    f"LayeroptAccelerator supports one process or DistributedDataParallel; "
                    f"this run ({self.distributed_type}) prepared the model as "
                    f"{type(model).__name__}, whose gradients layeropt cannot average. "
                    "Use torch.optim with this plugin, or a custom loop with FSDP2's "
                    "fully_shard and layeropt.attach."
                )
            if owners:
                handle = attach(model, owners, **attach_kwargs(
                    bucket_cap_mb=self.layeropt_bucket_cap_mb, verify=self.layeropt_verify),
                    **(comm if isinstance(model, DDP) else {}))
                handle.release = ("Call free_memory() on the LayeroptAccelerator that "
                                  "prepared the model (it removes its attachments)")
                self._lo_handles[key] = handle
                for opt in owners:  # (accelerate's loops call optimizer.step())
                    opt._lo_engine.expect_step()
        for opt in opts:
            offload_state_once(opt, self.layeropt_offload_state, self.offloads)
        self._apply_clip_value()
        return out

    def free_memory(self, *objects: Any) -> Any:
        """``Accelerator.free_memory``; detaches the models first."""
        for opt in self.layeropt_optimizers:  # (its loop may be another's now)
            opt._lo_engine.expect_step(False)
        for handle in self._lo_handles.values():
            handle.remove()
        self._lo_handles.clear()
        self._lo_compiling.close()
        self._reset_clipping()  # (a model prepared again may not clip as the last did)
        return super().free_memory(*objects)

    # -- backward ---------------------------------------------------------------
    def backward(self, loss: Tensor, **kwargs: Any) -> None:
        """``Accelerator.backward`` through :func:`layeropt.backward` (see the module docstring)."""
        opts = self.layeropt_optimizers
        if not opts or not any(o.attached for o in opts):
            return super().backward(loss, **kwargs)
        unknown = set(kwargs) - {"retain_graph"}
        if unknown:
            raise AccelerateSetupError(
                f"backward got {sorted(unknown)}, which LayeroptAccelerator does not support."
            )
        self._end_learning(opts)
        held_by_loop = any(o._lo_engine.no_step_depth for o in opts)  # (its optimizer.no_step())
        if self._learning_now() and (self.sync_gradients or held_by_loop):
            raise AccelerateSetupError(
                "a second accelerator.backward before optimizer.step(), after one that "
                "syncs (accumulation by hand): accelerate + torch.optim sums these gradients "
                "into one step, but from the next step on LayeroptAccelerator would apply "
                "the first as it runs. Nothing was updated yet (the first step holds its "
                "gradients until optimizer.step()). Accumulate through "
                "accelerator.accumulate(model) and gradient_accumulation_steps=, or run "
                "every backward of a step but its last inside `with optimizer.no_step():`.")
        if self._lo_unasked:
            what, self._lo_unasked = " and ".join(sorted(self._lo_unasked)), set()
            raise AccelerateSetupError(
                f"the last optimizer step did not call {what}, but LayeroptAccelerator "
                "clipped its gradients during backward, as the steps before it asked (or "
                "max_grad_norm= / clip_value= said); that update was applied clipped. "
                "In-backward updates clip every step the same way: clip on every step "
                "that syncs, or on none.")
        loss = loss / self.gradient_accumulation_steps  # as Accelerator.backward
        if self.scaler is not None:
            loss = self.scaler.scale(loss)
        learning = self._lo_norm is _UNSET or self._lo_value is _UNSET
        if not self.sync_gradients or learning or held_by_loop:
            if self.sync_gradients and not held_by_loop:  # the learning step: plain
                self._lo_learning = opts[0]._lo_engine.train_step  # accelerate, held
            with no_step_all(opts):
                layeropt_backward(loss, opts, **kwargs)
            return
        max_norm = norm_type = params = None
        if self._lo_norm is not None:
            max_norm, norm_type, params = self._lo_norm
            self._lo_unasked.add("clip_grad_norm_")
        if self._lo_value is not None:
            self._lo_unasked.add("clip_grad_value_")
        layeropt_backward(
            loss, opts, max_norm=max_norm, norm_type=2.0 if norm_type is None else norm_type,
            scaler=self.scaler, parameters=params, **kwargs,
        )
        self._lo_measured = opts[0]._lo_engine.txn  # (the norm the next clip call returns)

    def _end_learning(self, opts: list[InBackwardOptimizer]) -> None:
        """After the learning step's optimizer.step() (or zero_grad()): what it did not
        clip, it never clips."""
        if self._lo_learning is None or opts[0]._lo_engine.train_step is self._lo_learning:
            return
        self._lo_learning = None
        if self._lo_norm is _UNSET:
            self._lo_norm = None
        if self._lo_value is _UNSET:
            self._lo_value = None

    def _apply_clip_value(self) -> None:
        value = None if self._lo_value is _UNSET else self._lo_value
        for handle in self._lo_handles.values():  # (the attachments this accelerator made)
            handle.settings.configure(clip_value=value)

    def _learning_now(self) -> bool:
        return self._lo_learning is not None

    # -- clipping and unscaling after backward ---------------------------------
    def unscale_gradients(self, optimizer: Any = None) -> None:
        """``Accelerator.unscale_gradients``, except where ``layeropt.backward`` already did."""
        if self._learning_now() or not self.layeropt_optimizers:
            return super().unscale_gradients(optimizer)
        others = [o for o in (optimizer if isinstance(optimizer, (list, tuple)) else
                              [optimizer] if optimizer is not None else self._optimizers)
                  if not isinstance(unwrap_optimizer(o), InBackwardOptimizer)]
        if others:
            super().unscale_gradients(others)

    def clip_grad_norm_(self, parameters: Any, max_norm: float, norm_type: float = 2) -> Any:
        """The global norm measured in backward (learned or given ``max_norm``)."""
        opts = self.layeropt_optimizers
        if not opts or not any(o.attached for o in opts):
            return super().clip_grad_norm_(parameters, max_norm, norm_type)
        parameters = list(parameters)
        if not self.sync_gradients or self._holding(opts):  # a micro-batch's partial sum,
            return self._clip_held(super().clip_grad_norm_, parameters, max_norm, norm_type)
        key = (float(max_norm), float(norm_type))
        self._check_order("clip_grad_norm_")
        if self._learning_now() and self._lo_norm is _UNSET:
            self._lo_norm = (*key, parameters)
            return super().clip_grad_norm_(parameters, max_norm, norm_type)  # real gradients
        if self._lo_norm is None or self._lo_norm is _UNSET or self._lo_norm[:2] != key:
            raise AccelerateSetupError(
                f"clip_grad_norm_(max_norm={max_norm}, norm_type={norm_type}) after backward, "
                f"but LayeroptAccelerator clipped {self._describe()} during backward, where "
                "the gradients were used and freed. Make every optimizer step clip the same "
                "way, or pass max_grad_norm= to LayeroptAccelerator."
            )
        if self._lo_measured != opts[0]._lo_engine.txn:
            raise AccelerateSetupError(
                "clip_grad_norm_ after a backward that did not go through "
                "accelerator.backward(loss) (loss.backward()?): that backward updated the "
                "parameters unclipped. Call accelerator.backward(loss), as accelerate's "
                "examples do.")
        self._check_clipped_parameters(parameters, opts)
        self._lo_unasked.discard("clip_grad_norm_")
        return opts[0].last_grad_norm

    def _holding(self, opts: list[Any]) -> bool:
        """Whether a backward of this step held its gradients for a later one (inside
        ``no_step()``: accumulation by hand, ``gradient_accumulation_steps=1``), outside the
        learning step: a partial sum in ``.grad``, which torch's clip clips (trainerfuzz
        accelerate seed 581,367: taken for the step's own, clipped in backward, silently)."""
        return not self._learning_now() and any(o.attached and o._lo_engine.holds_gradients
                                                for o in opts)

    def _clip_held(self, clip: Any, *args: Any) -> Any:
        """Clip on a micro-batch that does not sync: the held partial sum, for real (it is
        in ``.grad``; in host memory, torch's clipping guard refuses it)."""
        if self.scaler is not None:
            raise AccelerateSetupError(
                "clipping on a micro-batch that does not sync, with a GradScaler: "
                "LayeroptAccelerator unscales only the step's own gradients. Clip when "
                "accelerator.sync_gradients, as accelerate's examples do.")
        return clip(*args)

    def _check_clipped_parameters(self, parameters: list[Tensor],
                                  opts: list[InBackwardOptimizer]) -> None:
        """The loop clips the parameters backward measured: those learned, or (given
        ``max_grad_norm=``) every parameter of the layeropt optimizers."""
        measured = self._lo_norm[2]  # (frozen ones have no gradient to clip: not counted)
        mine = {id(p) for o in opts for g in o.param_groups for p in g["params"]
                if p.requires_grad}
        used = default_parameters(opts) if measured is None else measured
        asked = list(dict.fromkeys(i for i in map(id, parameters) if i in mine))
        expected = list(dict.fromkeys(i for i in map(id, used) if i in mine))
        if set(asked) == set(expected) and asked != expected:
            raise AccelerateSetupError(
                "clip_grad_norm_ over the parameters LayeroptAccelerator measured during "
                "backward, in another order: the total norm sums them in order, so its "
                "last bit, and the clipped update, would differ from accelerate's. Clip "
                "them in the order measured (with max_grad_norm=: model.parameters(), the "
                "attached models' order), or leave max_grad_norm unset: the first step "
                "learns the list.")
        if set(asked) != set(expected):
            raise AccelerateSetupError(
                f"clip_grad_norm_ over {len(asked)} of the layeropt optimizers' parameters, "
                f"but LayeroptAccelerator measured the norm of {len(expected)} during "
                "backward (the parameters learned on the first step, or all of them with "
                "max_grad_norm=). Clip the same parameters on every step; to clip a part "
                "of them, leave max_grad_norm unset: the first step learns which.")

    def clip_grad_value_(self, parameters: Any, clip_value: float) -> None:
        """Each layer's gradient is clipped by value before its update (learned or given)."""
        opts = self.layeropt_optimizers
        if not opts or not any(o.attached for o in opts):
            return super().clip_grad_value_(parameters, clip_value)
        parameters = list(parameters)
        if not self.sync_gradients or self._holding(opts):  # a micro-batch's partial sum,
            return self._clip_held(super().clip_grad_value_, parameters, clip_value)
        self._check_order("clip_grad_value_")
        learning = self._learning_now() and self._lo_value is _UNSET
        if not learning and self._lo_value != float(clip_value):
            raise AccelerateSetupError(
                f"clip_grad_value_({clip_value}) after backward, but LayeroptAccelerator "
                f"clipped {self._describe()} during backward. Make every optimizer step "
                "clip the same way, or pass clip_value= to LayeroptAccelerator."
            )
        self._check_value_parameters(parameters)  # (before the learning step learns it)
        if learning:
            self._lo_value = float(clip_value)
            self._apply_clip_value()
            return super().clip_grad_value_(parameters, clip_value)  # real gradients
        self._lo_unasked.discard("clip_grad_value_")
        mine = self._layeropt_parameter_ids()
        others = [p for p in parameters if id(p) not in mine and p.grad is not None]
        if others:  # (a plain optimizer's, in .grad until its step: torch's, for real;
            super().clip_grad_value_(others, clip_value)  # torch's fails on none at all)
        return None

    def _applied(self) -> str:
        """What a refusal at a clipping call says of this step's update."""
        if self._learning_now():  # (the learning step holds its gradients until step())
            return "nothing was updated"
        return "this step's update was already applied during backward"

    def _check_value_parameters(self, parameters: list[Tensor]) -> None:
        """The loop clips by value every trainable parameter the attachments hook: the
        value is the attachment's setting, applied to each whole bucket, so a part of
        them cannot be clipped alone (checked on every call, learned or given)."""
        clipped = {id(p) for h in self._lo_handles.values() for p in h.owned if p.requires_grad}
        asked = {id(p) for p in parameters if p.requires_grad} & self._layeropt_parameter_ids()
        if asked != clipped:
            raise AccelerateSetupError(
                f"clip_grad_value_ over {len(asked)} of the layeropt optimizers' trainable "
                f"parameters, but LayeroptAccelerator clips by value during backward every "
                f"parameter of the prepared models ({len(clipped)}): the value is a setting of "
                f"the whole attachment, it cannot clip a part alone ({self._applied()}). "
                "Clip all of them (accelerator.clip_grad_value_(model.parameters(), value)), "
                "or train this loop with Accelerator and torch.optim.")

    def _layeropt_parameter_ids(self) -> set[int]:
        """The prepared layeropt optimizers' parameters (hooked or not), by id."""
        return {id(p) for o in self.layeropt_optimizers for g in o.param_groups
                for p in g["params"]}

    def _check_order(self, call: str) -> None:
        """Backward clips by the norm (measured on the raw gradients) first, then by value:
        a step that clips by value before clipping by norm cannot be followed."""
        txn = self.layeropt_optimizers[0]._lo_engine.txn  # (the step the calls belong to)
        if self._lo_calls[0] != txn:
            self._lo_calls = (txn, [])
        calls = self._lo_calls[1]
        if call == "clip_grad_norm_" and call in calls:
            raise AccelerateSetupError(
                "clip_grad_norm_ twice in one step: torch's second call measures the "
                "gradients the first one clipped, but LayeroptAccelerator measured once, "
                f"during backward ({self._applied()}). Clip once per step.")
        if call == "clip_grad_norm_" and "clip_grad_value_" in calls:
            raise AccelerateSetupError(
                "clip_grad_norm_ after clip_grad_value_ in the same step: torch measures and "
                "clips the norm of the value-clipped gradients, but LayeroptAccelerator clips "
                "during backward by norm first (measured on the raw gradients), then by value "
                f"({self._applied()}). Call clip_grad_norm_ before clip_grad_value_ (exact), "
                "or clip one way only.")
        calls.append(call)

    def _describe(self) -> str:
        parts = []
        if self._lo_norm not in (None, _UNSET):
            parts.append(f"to max_norm={self._lo_norm[0]}")
        if self._lo_value not in (None, _UNSET):
            parts.append(f"by value {self._lo_value}")
        return " and ".join(parts) or "nothing"
