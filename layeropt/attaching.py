"""``layeropt.attach``: hook a model's parameters to their layeropt optimizers.

Attaching groups the model's trainable parameters into layer buckets (each
module's own parameters, optionally merged up to a size cap) and registers one
post-accumulate-grad hook per parameter. What the hook does is in
``layeropt/engine/landing.py``.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from typing import Any

from torch import Tensor, nn
from torch.optim import Optimizer

from .distributed.fsdp2 import refuse_fsdp1, sharded_of
from .distributed.fsdp_offload import check_fsdp2_offload
from .engine.boundaries import refuse_open_updates, take_over
from .engine.registry import hooked_by, mark_hooked, unmark_hooked
from .checking.watch import WATCHERS
from .errors import (ATTACHED_TWICE, BASE_OPTIMIZER_ERROR, NO_OWNER_ERROR, NOT_LEAF_ERROR,
                     OWNED_TWICE_ERROR, SPARSE_MODULE_ERROR, AttachError, user_frame, warn)
from .engine.landing import Bucket, Settings, drop_dead_hooks
from .optim import (InBackwardOptimizer, check_groups, in_backward_spelling, owners_of,
                    optimizer_list)
from .checking.forwards import ReadWatch
from .checking.verify import Verifier, verify_steps
from .checking.verify import verify as start_verifying

__all__ = ["attach", "Attachment"]

_SPARSE_MODULES = (nn.Embedding, nn.EmbeddingBag)

#: Wrapper model types that another module attaches, and its function for them:
#: ``DistributedDataParallel`` -> ``layeropt.distributed.attach_ddp`` (registered by
#: ``layeropt/distributed/ddp.py`` through :func:`hand_over` when layeropt is imported).
WRAPPERS: dict[type, Callable[..., Any]] = {}


def hand_over(kind: type, attach_wrapper: Callable[..., Any]) -> None:
    """``attach`` hands a model of type ``kind`` to ``attach_wrapper`` (the one writer of
    :data:`WRAPPERS`)."""
    WRAPPERS[kind] = attach_wrapper


def resolve_owners(model: nn.Module, optimizer: Any) -> list[InBackwardOptimizer]:
    """The layeropt optimizers to attach ``model`` to (checked; see ``attach``)."""
    if optimizer is None:
        optimizers = owners_of(list(model.parameters()))
        if not optimizers:
            raise AttachError(NO_OWNER_ERROR)
    else:
        optimizers = optimizer_list(optimizer)
    for o in optimizers:
        if not isinstance(o, InBackwardOptimizer):
            cls = type(o)
            if isinstance(getattr(o, "base_optimizer", None), InBackwardOptimizer):
                raise AttachError(BASE_OPTIMIZER_ERROR.format(name=cls.__qualname__))
            raise AttachError(
                f"{cls.__module__}.{cls.__qualname__} is not a layeropt optimizer, so it "
                f"cannot step in backward. Build it as {in_backward_spelling(cls)}(...) "
                "(same arguments) and attach that."
            )
        check_groups(o)
    return optimizers


def _check_param(name: str, p: Tensor, module: nn.Module) -> None:
    if not p.is_leaf:
        raise AttachError(NOT_LEAF_ERROR.format(name=name))
    if isinstance(module, _SPARSE_MODULES) and getattr(module, "sparse", False):
        raise AttachError(SPARSE_MODULE_ERROR.format(name=name, module=type(module).__name__))


def layer_buckets(
    model: nn.Module, optimizers: list[InBackwardOptimizer], settings: Settings | None = None,
    sharded: dict[int, Tensor] | None = None,
) -> list[tuple[InBackwardOptimizer, Bucket]]:
    """One bucket per (module, optimizer) of the module's own trainable params.

    A parameter shared by several modules (tied weights) goes to the first
    module that registers it. Buckets are listed in reverse registration
    order, the usual order in which gradients land.
    """
    seen: set[int] = set()
    buckets: list[tuple[InBackwardOptimizer, Bucket]] = []
    if sharded is None:  # (FSDP2 between forward and backward: the shards are hooked)
        sharded = sharded_of(model)
    for mod_name, module in model.named_modules(remove_duplicate=False):
        own: dict[int, tuple[InBackwardOptimizer, list[Tensor]]] = {}
        for p_name, p in module.named_parameters(recurse=False):
            p = sharded.get(id(p), p)
            if id(p) in seen or not p.requires_grad:
                continue
            owners = [o for o in optimizers if o.owns(p)]
            if not owners:
                continue
            full = f"{mod_name}.{p_name}" if mod_name else p_name
            if len(owners) > 1:
                raise AttachError(OWNED_TWICE_ERROR.format(name=full, n=len(owners)))
            _check_param(full, p, module)
            seen.add(id(p))
            own.setdefault(id(owners[0]), (owners[0], []))[1].append(p)
        for opt, params in own.values():
            buckets.append((opt, Bucket(mod_name or type(model).__name__, params,
                                        *(() if settings is None else (settings,)))))
    buckets.reverse()
    return buckets


class Attachment:
    """Handle returned by :func:`attach`; ``remove()`` restores plain behaviour.

    Where gradients come from is the one thing attachment kinds differ in:
    here, a post-accumulate-grad hook per parameter (:meth:`_hook_all`); a
    DDP model's buckets come through DDP's communication hook instead
    (:class:`layeropt.distributed.DDPAttachment`). Both hand them to the same
    engine.

    Also a context manager: hooks are removed when the ``with`` block exits.
    The handle refers to the optimizers weakly: deleting an optimizer removes
    its hooks, so nothing keeps it (or its state) alive.

    Attaching takes the parameters over from other layeropt optimizers: what
    an earlier backward of theirs updated stops counting as those parameters'
    latest attached update once torch's gradients from it would be gone
    (docs/rules.md, "A model another optimizer trained").

    Attributes:
        buckets: the layer buckets, in the order gradients usually land.
        settings: what ``attach`` was given for this model (bucket cap, per-bucket
            clipping); another model attached to the same optimizer has its own.
        release: how to end this attachment, as a refused ``attach`` of its
            parameters to another optimizer says it ("Call .remove() on that
            attachment ..."; an integration that attached the model says its own).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizers: list[InBackwardOptimizer],
        settings: Settings | None = None,
    ) -> None:
        self.settings = Settings() if settings is None else settings
        self._model = weakref.ref(model)
        self._optimizers = [weakref.ref(o) for o in optimizers]
        self._handles: list[Any] = []
        self._hooked_ids: set[int] = set()
        self._impls: list[int] = []
        self.buckets: list[Bucket] = []
        self._owned: list[Tensor] = []  # the model's parameters the optimizers own
        self.named: list[tuple[str, Tensor]] = []
        self._trainable: tuple[bool, ...] = ()  # their requires_grad when hooked
        self.stale = False  # requires_grad changed during a backward: rebuild at its end
        self._removed = False
        self.where = _caller()  # the user's line that attached, for messages
        self.release = "Call .remove() on that attachment (the handle attach() returned)"
        self._first_backward = True  # (its first backward takes its parameters over)
        # torch's functions watched while any attachment lives (layeropt/checking/watch.py): undone
        # by the last one's remove() or garbage collection
        WATCHERS.acquire()
        self._watching = weakref.finalize(self, WATCHERS.release)
        try:
            self._hook_all()
            self._take_over("attach")
        except BaseException:
            self._watching()
            raise
        # a forward between a backward and step() reading what it updated: refused
        # (layeropt/checking/forwards.py); off with remove() or garbage collection
        reads = ReadWatch(self)
        self._reads = weakref.finalize(self, _remove, [
            model.register_forward_pre_hook(reads.pre),
            model.register_forward_hook(reads.post, always_call=True)])

    @property
    def optimizers(self) -> list[InBackwardOptimizer]:
        """The (still alive) layeropt optimizers whose parameters are hooked."""
        return [o for o in (r() for r in self._optimizers) if o is not None]

    def describe(self) -> str:
        """The optimizers and where ``attach`` was called, for messages."""
        opts = ", ".join(type(o).__name__ for o in self.optimizers) or "a deleted optimizer"
        return f"{opts} (attached at {self.where})"

    def _hook_all(self) -> None:
        model = self._model()
        if model is None:
            return
        optimizers = self.optimizers
        sharded = sharded_of(model)  # (FSDP2 between forward and backward: the shards)
        self.named = [(n, sharded.get(id(p), p)) for n, p in model.named_parameters()]
        self._owned = [p for _, p in self.named if any(o.owns(p) for o in optimizers)]
        self._trainable = tuple(p.requires_grad for p in self._owned)
        self.stale = False
        pairs = layer_buckets(model, optimizers, self.settings, sharded)
        names = {id(p): n for n, p in self.named}
        for owner, b in reversed(pairs):  # (model order: the first parameter is named)
            for p in b.params:
                other = hooked_by(p)
                if other is not None and other is not self:
                    if not other.optimizers:  # its optimizers are gone: nothing to keep
                        other.remove()
                        continue
                    if not any(o.owns(p) for o in other.optimizers):  # (the one of them
                        continue  # that owned it is gone: its hook too, below)
                    name = names.get(id(p), b.name)
                    if any(o is owner for o in other.optimizers):  # (the same optimizer)
                        raise AttachError(ATTACHED_TWICE.format(name=name,
                                                                other=other.describe()))
                    raise AttachError(
                        f"parameter {name!r} is already attached, to "
                        f"{other.describe()}. {other.release} before attaching it to another "
                        "optimizer."
                    )
        for opt in optimizers:  # (also one none of whose parameters trains yet: rule 7)
            opt._lo_engine.add_attachment(self)  # the engine keeps its attachments
        for opt, b in pairs:
            engine = opt._lo_engine
            for i, p in enumerate(b.params):
                drop_dead_hooks(p)  # of an optimizer deleted while attached
                hook = engine.hook(b, i, self)
                self._handles.append((p, p.register_post_accumulate_grad_hook(hook)))
                mark_hooked(p, self)
            self.buckets.append(b)
        self._hooked_ids = {id(p) for p, _ in self._handles}
        self._impls = [p._cdata for p, _ in self._handles]  # the C++ tensor behind each

    def hooks(self, param: Tensor) -> bool:
        """Whether ``param`` carries one of this attachment's hooks."""
        return id(param) in self._hooked_ids and any(p is param for p, _ in self._handles)

    def _rebuild(self) -> None:
        """Re-hook after the optimizers' param groups changed (add_param_group)."""
        if not self._removed:
            self._release()
            self._hook_all()

    @property
    def model(self) -> nn.Module | None:
        """The attached model (``None`` once it was deleted)."""
        return self._model()

    @property
    def owned(self) -> list[Tensor]:
        """The model's parameters owned by the attached optimizers (trainable or not)."""
        return self._owned

    @property
    def covered(self) -> list[Tensor]:
        """The parameters whose kept zeros ``remove()`` gives back: :attr:`owned`."""
        return self.owned

    def sync(self, in_backward: bool = False) -> bool:
        """Follow what changed since the hooks were registered.

        A layer unfrozen after ``attach`` (gradual unfreezing) gets hooks, a
        frozen one leaves its bucket, and hooks that module conversion took
        away (``model.double()`` with ``torch.__future__.
        set_swap_module_params_on_conversion(True)`` swaps each parameter's
        C++ tensor, whose hook registration goes with it) are registered again. Outside backward the
        hooks are rebuilt at once; inside one (``in_backward``) hooks cannot be
        removed, so the attachment is marked :attr:`stale`: the engine steps
        every gradient this backward left at its end and rebuilds then.

        Returns:
            Whether anything changed.
        """
        if self._removed:
            return False
        if self._first_backward and in_backward:
            self._first_backward = False
            self._take_over("backward")
        changed = False  # (loops, not comprehensions: this runs at every backward's start)
        for (p, _), impl in zip(self._handles, self._impls):
            if p._cdata != impl:
                # swap_tensors moved the C++ side of p's hooks to the old tensor: putting the
                # hook dict back registers it on the tensor p holds now (torch's own setter)
                p._post_accumulate_grad_hooks = p._post_accumulate_grad_hooks
                changed = True
        if not changed:
            for p, trainable in zip(self._owned, self._trainable):
                if p.requires_grad is not trainable:
                    changed = True
                    break
        if not changed:
            return False
        if in_backward:
            self.stale = True
        else:
            self._rebuild()
        return True

    def _taken(self) -> list[Tensor]:
        """The parameters this attachment steps (what :meth:`_take_over` takes)."""
        return self._owned

    def _take_over(self, when: str) -> None:
        """:func:`take_over` of this attachment's parameters (``when``: see there)."""
        take_over(self._taken(), self.optimizers, when)

    def _release(self) -> None:
        for p, h in self._handles:
            h.remove()
            unmark_hooked(p, self)
        self._handles.clear()
        self._hooked_ids = set()
        self.buckets.clear()

    def remove(self) -> None:
        """Remove every hook; the optimizers behave like torch.optim again."""
        if not self._removed:
            self._release()
            for opt in self.optimizers:
                opt._lo_engine.remove_attachment(self)
            self._removed = True
            self._reads()
            self._watching()  # (the last attachment undoes the watchers)

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.remove()

    def __repr__(self) -> str:
        state = "removed" if self._removed else f"{len(self.buckets)} buckets"
        return f"<layeropt.Attachment {state}>"


def _remove(handles: list[Any]) -> None:
    for handle in handles:
        handle.remove()


def _start_verifying(optimizers: list[InBackwardOptimizer], verify: int | None) -> None:
    """``attach(..., verify=n)`` / ``LAYEROPT_VERIFY=n`` (optimizers not stepped yet)."""
    steps = verify_steps(verify)
    for opt in optimizers:
        engine = opt._lo_engine
        if verify is not None or (steps and engine.find(Verifier) is None
                                  and not engine.bounded):
            start_verifying(engine, steps)


def _caller() -> str:
    """``file:line`` of the first frame outside layeropt (and torch)."""
    frame, _ = user_frame()
    if frame is None:
        return "an unknown place"
    return f"{os.path.basename(frame.f_code.co_filename)}:{frame.f_lineno}"


def _attached_before(model: nn.Module, optimizers: list[InBackwardOptimizer]) -> Any:
    """The live attachment of exactly this model and these optimizers, if any."""
    for p in model.parameters():
        other = hooked_by(p)
        if other is not None and other.model is model and other.optimizers == optimizers:
            return other
    return None


def attach(
    model: nn.Module,
    optimizer: Optimizer | Iterable[Optimizer] | None = None,
    *,
    bucket_cap_mb: float = 1.0,
    clip_value: float | None = None,
    bucket_max_norm: float | None = None,
    norm_type: float = 2.0,
    verify: int | None = None,
    comm_hook: Callable[[Any, Any], Any] | None = None,
    comm_state: Any = None,
) -> Attachment:
    """Update ``model``'s parameters during backward, as their gradients complete.

    Each trainable parameter of ``model`` owned by a layeropt optimizer gets a
    post-accumulate-grad hook. A ``DistributedDataParallel`` model is handed to
    :func:`layeropt.distributed.attach_ddp` instead (each bucket is stepped
    on its all-reduced gradient, ``bucket_cap_mb`` applies to DDP's buckets;
    no ``bucket_max_norm``); under FSDP2,
    attach after ``fully_shard``. Parameters are grouped into layer buckets (a
    module's own parameters); a bucket is stepped with torch's own ``step``
    the moment all its gradients have accumulated, and its ``.grad`` is freed.

    Args:
        model: the module whose parameters to hook.
        optimizer: a layeropt optimizer, several, or ``None`` to use every live
            layeropt optimizer that owns some of the model's parameters.
        bucket_cap_mb: buckets whose gradients are complete wait, in arrival
            order, until together they hold this many MiB, and are then stepped
            with one call (fewer, larger steps; at most this much more
            gradient memory held). ``0`` steps each layer bucket at once; the
            default 1 MiB lets small layers (norms, biases) share a step -
            each step call costs tens of microseconds of host time - while
            every large layer is stepped the moment it completes, and holds
            well under 1% of the memory of any model large enough to need
            layeropt.
        clip_value: clip each gradient element to ``[-clip_value, clip_value]``
            (``clip_grad_value_``) before its bucket is stepped. No extra cost.
        bucket_max_norm: clip each bucket's gradient norm
            (``clip_grad_norm_(bucket.params, bucket_max_norm)``). No extra cost.
        norm_type: the p-norm for ``bucket_max_norm``.
        verify: run the optimizers' first ``verify`` training steps both ways - with
            torch's semantics for real, and in-backward updating on a shadow - and
            raise :class:`~layeropt.errors.VerifyError` at the first difference
            (``layeropt/checking/verify.py``; memory is torch's meanwhile). Default: the
            ``LAYEROPT_VERIFY`` environment variable, for optimizers that have not
            stepped yet (0 or unset: none).
        comm_hook: a ``DistributedDataParallel`` model's communication hook (as
            ``ddp_model.register_comm_hook(comm_state, comm_hook)`` takes it: torch's
            ``fp16_compress_hook``, ``bf16_compress_hook``, PowerSGD's - not run here - or
            your own), which
            reduces each bucket before it is stepped - DDP takes one hook, so give it
            here instead of registering it. ``comm_state``: its state.

        Global-norm clipping needs the norm before the first update:
        :func:`layeropt.backward` (``max_norm=``) takes it in two passes.

    Returns:
        An :class:`Attachment`; call ``.remove()`` (or use it as a context
        manager) to go back to plain ``backward(); step()`` behaviour.

    The settings (``bucket_cap_mb``, ``clip_value``, ``bucket_max_norm``,
    ``norm_type``) belong to this attachment: a second model attached to the
    same optimizer has its own. Attaching the same model to the same
    optimizers again returns the same handle, re-hooked, with the new call's
    settings (so removing either detaches both).

    Raises:
        AttachError: the optimizer is not a layeropt optimizer, owns none of
            the model's parameters, a parameter is owned twice, attached to
            another optimizer already, not a leaf, or has sparse gradients.
        ValueError: a negative ``bucket_cap_mb``, ``clip_value`` or
            ``bucket_max_norm``.

    Example:
        >>> import torch, layeropt
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
        >>> opt = layeropt.Adam(model.parameters(), lr=1e-3)
        >>> handle = layeropt.attach(model, opt)
        >>> model(torch.randn(2, 4)).sum().backward()   # steps both layers
        >>> all(p.grad is None for p in model.parameters())
        True
        >>> handle.remove()
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"attach() needs an nn.Module, got {type(model).__name__}")
    wrapper = next((f for kind, f in WRAPPERS.items() if isinstance(model, kind)), None)
    if wrapper is not None:  # (DDP: its comm hook steps buckets, distributed/ddp.py)
        if bucket_max_norm is not None:
            raise AttachError(
                "attach(DistributedDataParallel, ...) takes no bucket_max_norm: clip the "
                "global norm (and use a GradScaler) with layeropt.backward(loss, "
                "max_norm=..., scaler=...), which averages each bucket before measuring it."
            )
        return wrapper(model, optimizer, bucket_cap_mb=bucket_cap_mb, clip_value=clip_value,
                       verify=verify, comm_hook=comm_hook, comm_state=comm_state)
    if comm_hook is not None:
        raise AttachError(f"comm_hook is for a DistributedDataParallel model; this model is "
                          f"a {type(model).__name__}. Leave it out.")
    refuse_fsdp1(model)  # (its own hook reduces after autograd accumulates)
    check_fsdp2_offload(model)  # FSDP2 + CPUOffloadPolicy: refused where torch races
    settings = Settings(bucket_cap_mb, clip_value, bucket_max_norm, norm_type)  # (checked)
    optimizers = resolve_owners(model, optimizer)
    if len({id(o) for o in optimizers}) != len(optimizers):
        raise AttachError("the same optimizer was given twice; pass it once.")
    owned = [p for p in model.parameters() if any(o.owns(p) for o in optimizers)]
    if not owned:
        raise AttachError(
            "the optimizer owns none of this model's parameters. Build it from "
            "model.parameters() (or add them with add_param_group) before attaching."
        )
    refuse_open_updates(model, owned, optimizers)
    _start_verifying(optimizers, verify)  # (before hooks: a refusal leaves nothing behind)
    handle = _attached_before(model, optimizers)
    if handle is None:
        handle = Attachment(model, optimizers, settings)
    else:  # attaching again to the same optimizers: that handle, following the model now,
        # with this call's settings
        handle.settings.configure(bucket_cap_mb=bucket_cap_mb, clip_value=clip_value,
                                  bucket_max_norm=bucket_max_norm, norm_type=norm_type)
        handle.sync()
    if not handle.buckets:
        warn(
            f"attach(): none of this model's parameters that {handle.describe()} owns "
            "requires grad, so nothing is updated in backward yet (layers unfrozen later "
            "are picked up at the next backward). Check requires_grad, or that the "
            "optimizer was built from this model's parameters."
        )
    return handle
