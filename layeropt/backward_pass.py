"""``layeropt.backward``: exact global-norm clipping and GradScaler in backward.

Both need a fact about the *whole* gradient before the first layer may be
updated: its global norm (clipping) or whether any element is inf/NaN
(``GradScaler``'s skip). layeropt gets it with two passes over the same graph:

1. a **measure pass** (``retain_graph=True``): each hook reduces its
   parameter's gradient to what is needed - the per-tensor norm, the
   non-finite flag - and frees it at once (gradient memory stays one layer);
2. the global norm / skip decision is computed exactly as
   ``torch.nn.utils.clip_grad_norm_`` / ``GradScaler.unscale_`` would;
3. a **step pass**: the ordinary attached backward, whose hooks unscale and
   clip each bucket's gradient with the same torch ops before stepping it.
   On an inf/NaN the step pass is skipped: no parameter and no state changes.

Cost: one extra backward (about 2x backward time; forward and activation
memory unchanged). Per-bucket clipping (``attach(..., clip_value=...,
bucket_max_norm=...)``) needs no extra pass.
"""

from __future__ import annotations

import contextlib
import gc
import weakref
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor

from .checking.verify import Verifier
from .distributed import TwoPasses
from .distributed.fsdp2 import sharded_of
from .errors import DONATED_BUFFERS_ERROR, TWO_PASSES_ERROR, LayeroptError
from .engine.transforms import (
    Transform,
    grad_order,
    prepare_grads,
    reduce_grad,
    total_norm,
    unscaled_in_kernel,
)
from .optim import InBackwardOptimizer, live_optimizers, no_step_all, optimizer_list

__all__ = ["backward", "two_pass_compile"]


def default_parameters(optimizers: list[InBackwardOptimizer]) -> list[Tensor]:
    """What ``clip_grad_norm_`` would be given by default: the attached models'
    ``parameters()``, in order, then the optimizers' other parameters - not those of
    other attached layeropt optimizers (they step unclipped: ``clip_grad_norm_`` over
    these optimizers' models leaves another optimizer's layers alone)."""
    out: dict[int, Tensor] = {}
    others = {id(p) for p in _owned(_owners(None, optimizers))}
    for opt in optimizers:
        for attachment in list(opt._lo_engine.attachments):
            model = attachment.model
            shards = {} if model is None else sharded_of(model)  # (FSDP2, after a forward)
            for p in model.parameters() if model is not None else ():
                p = shards.get(id(p), p)
                if id(p) not in others:
                    out.setdefault(id(p), p)
    for opt in optimizers:
        for g in opt.param_groups:
            for p in g["params"]:
                out.setdefault(id(p), p)
    return list(out.values())


@torch.compiler.disable  # (eagerly: its passes and their bookkeeping, in order)
def backward(
    loss: Tensor,
    optimizer: InBackwardOptimizer | Iterable[InBackwardOptimizer] | None = None,
    *,
    max_norm: float | None = None,
    norm_type: float = 2.0,
    error_if_nonfinite: bool = False,
    scaler: torch.amp.GradScaler | None = None,
    retain_graph: bool | None = None,
    parameters: Iterable[Tensor] | None = None,
) -> Tensor | None:
    """Backward with exact global-norm clipping and/or a ``GradScaler``.

    Equal to ``loss.backward(); scaler.unscale_(opt); clip_grad_norm_(params,
    max_norm); scaler.step(opt); scaler.update()`` with plain torch (the scaler
    optional; without ``max_norm``, ``unscale_`` and the clip left out too: a fused
    optimizer's kernel then divides by the scale, as ``scaler.step`` has it), while
    every layer is still updated during backward and its gradient freed at once. Pass ``scaler.scale(loss)`` as ``loss`` when using
    a scaler, then call ``scaler.step(opt)`` (a no-op) and ``scaler.update()``
    as usual.

    Args:
        loss: the (scaled) loss to differentiate.
        optimizer: the attached layeropt optimizer(s); default: every attached one
            but those inside their ``no_step()`` while another is not (a GAN's
            discriminator held during the generator's backward: the generator's step
            is clipped, as ``clip_grad_norm_(G.parameters())``)
            (one you no longer reference counts while something keeps it alive - a
            reference cycle until Python collects it, the traceback of an exception
            raised while it trained, which a notebook keeps: remove its attachment, or
            pass ``optimizer``).
            Without a scaler, attached optimizers owning some of ``parameters`` are
            added (``clip_grad_norm_(parameters)`` clips them whoever steps them).
        max_norm: clip the global gradient norm to this value (``None``: no
            clipping).
        norm_type: the p of the p-norm, as in ``clip_grad_norm_``.
        error_if_nonfinite: raise if the total norm is inf/NaN (before any update).
        scaler: a ``torch.amp.GradScaler`` whose ``scale(loss)`` was passed.
        retain_graph: for the final pass, as in ``Tensor.backward``.
        parameters: what you would pass to ``clip_grad_norm_``; the total norm
            is summed in this order, as torch's, to the last bit. Default: the
            attached models' ``parameters()`` (less those of other attached
            layeropt optimizers: they step unclipped), then the optimizers' other
            parameters. Trainable ones no attached optimizer owns (a layer
            trained by a second, plain optimizer) are measured and clipped
            in ``.grad`` too, as ``clip_grad_norm_`` would, and get each
            backward's gradient once.

    Returns:
        The total gradient norm (of the unscaled gradient) when clipping,
        else ``None``. It is also stored as ``optimizer.last_grad_norm`` (``None``
        after a call without ``max_norm``).

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = layeropt.SGD(model.parameters(), lr=0.1)
        >>> _ = layeropt.attach(model, opt)
        >>> norm = layeropt.backward(model(torch.randn(3, 4)).sum(), max_norm=1.0)
    """
    optimizers = _resolve(optimizer)
    if scaler is not None and not scaler.is_enabled():
        scaler = None  # a disabled scaler is plain backward, as in torch
    given = parameters is not None  # clip_grad_norm_(parameters): only those are clipped
    if given:  # (FSDP2's unsharded parameters, as the shards the optimizers own)
        shards = sharded_of()
        parameters = [shards.get(id(p), p) for p in parameters]
        if scaler is None:  # (it clips them, whichever attached optimizer steps them)
            optimizers = optimizers + _owners(parameters, optimizers)
    engines = [o._lo_engine for o in optimizers]
    if max_norm is None and scaler is None:
        for o in optimizers:
            o.last_grad_norm = None  # (nothing measured: no earlier step's norm left)
        _attached_backward(loss, engines, retain_graph, None)
        return None
    held = [o for o in optimizers if o._lo_engine.no_step_depth]
    if held:  # (clip_grad_norm_ there would clip the sums held so far, in .grad: not built)
        raise LayeroptError(CLIP_HELD.format(name=type(held[0]).__name__))
    if scaler is not None:
        _refuse_unscaled_twice(scaler, optimizers)
    # Other attached optimizers the backward reaches sit pass 1 out (their gradients
    # dropped, not held: pass 2 delivers them again) and step in pass 2, unclipped.
    others = [o._lo_engine for o in live_optimizers()
              if o.attached and not any(o._lo_engine is e for e in engines)]
    # Layers unfrozen (or frozen) since attach: hooked (unhooked) now, so that the
    # measure pass sees every gradient the step will use - the others' too. (A plain
    # backward picks them up as it goes, rule 7 of landing.py; two passes cannot.)
    for e in engines + others:
        for attachment in list(e.attachments):
            attachment.sync()
    parameters = parameters if given else default_parameters(optimizers)
    clipped = frozenset(map(id, parameters)) if given else None
    # Trainable parameters no attached hook steps: torch's recipe measures, unscales and
    # clips them too. Each pass accumulates into their .grad, so pass 1's is measured
    # and set aside.
    unhooked = _Unhooked(parameters, optimizers, strays=optimizer is None)
    if unhooked.foreign and scaler is not None and max_norm is not None:
        raise LayeroptError(
            f"layeropt.backward(max_norm=..., scaler=...): {len(unhooked.foreign)} trainable "
            f"parameter(s) (the first of shape {tuple(unhooked.foreign[0].shape)}) are not "
            "owned by the layeropt optimizers this call unscales, so another optimizer "
            "unscales them and the global norm cannot be taken here. Pass their layeropt "
            "optimizer too (layeropt.backward(loss, [opt1, opt2], ...)), give them to one "
            "(or freeze them), or pass parameters= without them. Nothing was updated."
        )

    # scaler.step(opt) on a fused optimizer not unscaled before (no clipping) divides by
    # the scale inside the kernel (grad_scale), where unscale_ multiplies by its inverse:
    # the two differ unless the scale is a power of two
    fused = [o for o in optimizers if max_norm is None and scaler is not None
             and getattr(o, "_step_supports_amp_scaling", False)
             and not o._lo_engine.clips]  # (clip_value=/bucket_max_norm=: unscale_ first)
    unhooked.refuse_fused_unscale(fused)
    if scaler is not None:
        _refuse_fp16_unscale([o for o in optimizers if not any(o is f for f in fused)])

    inv_scale = None
    found: dict[Any, Tensor] = {}  # engine -> its inf/NaN flag (scaler.unscale_ per optimizer)
    if scaler is not None:
        scale = scaler._scale
        if scale is None:
            raise LayeroptError("the GradScaler has no scale yet: pass scaler.scale(loss).")
        inv_scale = scale.double().reciprocal().float()
        found = {e: torch.full((), 0.0, dtype=torch.float32, device=scale.device)
                 for e in engines}

    # Pass 1: measure. What it leaves in the modules' buffers (recomputations under
    # activation checkpointing update BatchNorm's running statistics) and in the .grad of
    # parameters no attached optimizer owns is undone before pass 2, which does it again,
    # as the single backward of plain training does; kept if pass 2 does not run.
    measured: dict[Tensor, Tensor] = {}
    buffers = _BufferSnapshot(engines + others)
    ddp = TwoPasses(engines + others)  # DDP models: average before measuring, and in pass 2
    unhooked.add_leaves(loss, sharded_of())
    unhooked.set_aside()

    def undo_pass_1() -> None:
        buffers.restore()
        unhooked.restore()

    norm = norm_type if max_norm is not None else None
    seen: set[int] = set()  # parameters with a gradient in this backward
    for e in engines:
        e.start_measure(measured, norm, inv_scale, found.get(e))
    for e in others:
        e.start_measure({}, None, None, None)
    try:
        reached: list[Any] = []
        try:
            with ddp.measure():
                loss.backward(retain_graph=True)
        finally:
            for e in engines + others:
                if e.measure is not None and e.measure.seen:
                    seen |= e.measure.seen
                    reached.append(e)
                e.finish_measure()
        unhooked.measure(measured, norm, inv_scale, found, clipped)
        unhooked.refuse_strays()
        if scaler is not None:  # (one inside its no_step() holds them scaled, as torch's
            _refuse_unscaled([e for e in reached  # .grad: unscaled by its scaler.step)
                              if any(e is o for o in others) and not e.no_step_depth])
    except BaseException as exc:
        undo_pass_1()
        if isinstance(exc, RuntimeError) and "donated buffers" in str(exc):  # torch.compile's
            raise LayeroptError(DONATED_BUFFERS_ERROR.format(error=exc)) from exc  # 1 pass
        raise

    total = None
    if max_norm is not None:
        for o in optimizers:  # zero_grad(set_to_none=False): torch measures their zeros too
            for p in o._lo_engine.unused_kept(o):
                measured.setdefault(p, torch.zeros((), dtype=p.dtype, device=p.device))
        total = total_norm(grad_order(measured, parameters), norm_type)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            undo_pass_1()
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients is non-finite, so it "
                "cannot be clipped; no parameter was updated. To clip anyway, set "
                "error_if_nonfinite=False."
            )
    # scaler.step(opt) skips exactly the optimizers whose gradients hold an inf/NaN
    skipped = [e for e, flag in found.items() if bool(flag.item())]
    if scaler is not None:
        _record_for_scaler(scaler, optimizers, found)
    if len(skipped) < len(engines):  # Pass 2: the ordinary attached backward
        undo_pass_1()
        coef = None if total is None else torch.clamp(max_norm / (total + 1e-6), max=1.0)
        ddp.arm(loss)
        transform = Transform(inv_scale, coef, clipped)
        verifiers = {e: e.find(Verifier) for e in engines}
        verifying = {e: set(v.shadows) for e, v in verifiers.items() if v is not None}
        with no_step_all(o for o in optimizers if o._lo_engine in skipped), \
                _grad_scale(fused, scaler, found):
            try:
                _attached_backward(loss, engines, retain_graph, transform,
                                   [o._lo_engine for o in fused])
            except RuntimeError as exc:  # an op whose backward runs once (see the message)
                if not any(s in str(exc) for s in ("second time", "called twice",
                                                   "retain_graph")):
                    raise
                raise LayeroptError(TWO_PASSES_ERROR.format(error=exc)) from exc
        unhooked.prepare(transform)
        for o in optimizers if coef is not None else ():  # kept zeros step() updates
            if o._lo_engine not in skipped:
                o._lo_engine.clip_kept(o, coef, clipped)
        for e, before in verifying.items():  # LAYEROPT_VERIFY: the real side, torch's recipe
            o = e._optimizer()
            if any(o is f for f in fused):  # (scaler.step's kernel divides by the scale)
                verifiers[e].unscale_in_kernel(scaler._scale)
                continue
            verifiers[e].transform_real([p for p in verifiers[e].shadows if p not in before
                                         and not unhooked.prepares(p)], transform)
            verifiers[e].transform_kept(o, transform)
    for o in optimizers:  # their step is skipped: nothing of theirs changes
        if o._lo_engine in skipped:
            o._lo_engine.skip([p for g in o.param_groups for p in g["params"]
                               if p.grad is not None or id(p) in seen])
    for o in optimizers:
        o.last_grad_norm = total
    return total


class _Unhooked:
    """Trainable parameters that no attached hook steps, which torch's recipe still
    measures, unscales or clips (see :func:`backward`):

    * ``owned``: parameters of these optimizers outside every attached model (a
      learnable loss weight, a head kept as its own module). ``scaler.unscale_(opt)``
      unscales and checks them with the rest of ``opt``'s gradients, and
      ``opt.step()`` updates them;
    * ``foreign``: parameters in ``parameters`` that another optimizer trains (or
      none): measured and clipped only.

    Each pass accumulates into their ``.grad``; pass 1's is measured, then set aside.
    """

    def __init__(self, parameters: list[Tensor], optimizers: list[Any],
                 strays: bool = False) -> None:
        attachments = [a for o in optimizers for a in list(o._lo_engine.attachments)]
        # strays: trainable parameters of the layeropt optimizers left out (not attached,
        # with the default optimizer=None): a gradient of theirs would go unclipped
        ids = {id(o) for o in optimizers}
        left_out = [o for o in (live_optimizers() if strays else ()) if id(o) not in ids]
        self.strays = [p for o in left_out for g in o.param_groups for p in g["params"]
                       if p.requires_grad]
        self._stray_owners = [weakref.ref(o) for o in left_out]  # (weakly: see refuse_strays)
        candidates = {id(p): p for p in parameters}
        for o in optimizers:
            for g in o.param_groups:
                for p in g["params"]:
                    candidates.setdefault(id(p), p)
        self.owner: dict[int, Any] = {}  # id(param) -> the engine of its optimizer
        self.owned: list[Tensor] = []
        self.foreign: list[Tensor] = []
        for p in candidates.values():  # (a frozen one's .grad, left from before: torch's
            if ((not p.requires_grad and p.grad is None)  # clip measures and scales it too)
                    or any(a.hooks(p) for a in attachments)):
                continue
            opt = next((o for o in optimizers if o.owns(p)), None)
            if opt is None:
                self.foreign.append(p)
            else:
                self.owner[id(p)] = opt._lo_engine
                self.owned.append(p)
        self.before: dict[Tensor, Tensor | None] = {}
        self.leaves: list[Tensor] = []  # other leaves the loss reaches (add_leaves)

    def measure(self, measured: dict[Tensor, Tensor], norm_type: float | None,
                inv_scale: Tensor | None, found: dict[Any, Tensor],
                clipped: frozenset[int] | None) -> None:
        """After pass 1: their norms and inf/NaN flags (their .grad holds what torch
        would unscale and clip)."""
        for p in self.owned + self.foreign:
            if p.grad is None:
                continue
            engine = self.owner.get(id(p))
            unscale = inv_scale is not None and engine is not None
            norm = reduce_grad(p.grad.clone() if unscale else p.grad, norm_type,
                               inv_scale if unscale else None, found.get(engine))
            if norm is not None and (clipped is None or id(p) in clipped):
                measured[p] = norm

    def add_leaves(self, loss: Tensor, sharded: dict[int, Tensor]) -> None:
        """Every other leaf the loss reaches (a module a plain optimizer trains, a tensor
        no optimizer owns): pass 1 would leave its gradient in ``.grad`` for pass 2 to
        add to, so it is set aside too (not measured: it is not clipped). An FSDP2
        unsharded parameter's gradient lands in its shard's (``sharded``)."""
        known = {id(p) for p in self.owned + self.foreign + self.strays}
        known.update(id(p) for o in live_optimizers() if o.attached  # (hooked: attach
                     for a in list(o._lo_engine.attachments) for p in a.owned)  # synced them)
        seen: set[Any] = set()
        stack = [loss.grad_fn]
        while stack:
            fn = stack.pop()
            if fn is None or fn in seen:
                continue
            seen.add(fn)
            leaf = getattr(fn, "variable", None)  # (an AccumulateGrad node's tensor)
            leaf = sharded.get(id(leaf), leaf)
            if leaf is not None and id(leaf) not in known:
                known.add(id(leaf))
                self.leaves.append(leaf)
            stack.extend(f for f, _ in fn.next_functions)

    def set_aside(self) -> None:
        self.before = {p: None if p.grad is None else p.grad.clone()
                       for p in self.owned + self.foreign + self.strays + self.leaves}

    def refuse_strays(self) -> None:
        """After pass 1: refuse a backward that reached a left-out optimizer's parameters
        (its step() would apply their gradient unclipped and unscaled)."""
        reached = [p for p in self.strays if p.grad is not None and (
            self.before.get(p) is None or not torch.equal(self.before[p], p.grad))]
        if reached:  # (an optimizer nothing references but a reference cycle - one
            gc.collect()  # bitsandbytes' load_state_dict makes - is no left-out one:
            alive = {id(p) for o in (r() for r in self._stray_owners) if o is not None
                     for g in o.param_groups for p in g["params"]}  # collected, its
            reached = [p for p in reached if id(p) in alive]  # parameters are leaves)
        if reached:
            raise LayeroptError(
                f"layeropt.backward(max_norm=/scaler=) reached {len(reached)} parameter(s) "
                f"(the first of shape {tuple(reached[0].shape)}) of a layeropt optimizer "
                "that is not attached: it clips and unscales the gradients of attached "
                "optimizers only, so that optimizer's step() would apply these unclipped. "
                "Attach its model first (layeropt.attach(model, opt)), or pass the "
                "optimizers to clip with optimizer=. Nothing was updated."
            )

    def refuse_fused_unscale(self, fused: list[Any]) -> None:
        """Their gradients are unscaled here, by multiplying; a fused optimizer's
        ``scaler.step`` would divide in its kernel (another last bit)."""
        engines = {id(o._lo_engine) for o in fused}
        outside = [p for p in self.owned if id(self.owner[id(p)]) in engines]
        if outside:
            raise LayeroptError(
                f"layeropt.backward(scaler=...) without max_norm: {len(outside)} parameter(s) "
                f"(the first of shape {tuple(outside[0].shape)}) of a fused optimizer are "
                "outside the attached model, so their gradients would be unscaled here, "
                "where scaler.step(opt) divides by the scale inside the fused kernel. "
                "Attach the module that holds them, or build the optimizer with "
                "fused=False. Nothing was updated.")

    def restore(self) -> None:
        """Before pass 2: their .grad as before pass 1 (pass 2 accumulates it again)."""
        for p, grad in self.before.items():
            p.grad = grad
        self.before = {}

    def prepares(self, p: Tensor) -> bool:
        """Whether :meth:`prepare` unscales and clips ``p``'s ``.grad``."""
        return id(p) in self.owner or any(p is q for q in self.foreign)

    def prepare(self, transform: Transform) -> None:
        """After pass 2: unscaled (their optimizer's) and clipped as torch's recipe does
        (their optimizer steps them later)."""
        owned = [p for p in self.owned if p.grad is not None]
        foreign = [p for p in self.foreign if p.grad is not None]
        if owned:
            prepare_grads(owned, transform, None)
        if foreign:
            prepare_grads(foreign, transform._replace(inv_scale=None), None)


class _BufferSnapshot:
    """The attached models' buffers, to undo what the measure pass's recomputes wrote.

    Every buffer is copied back, unread: kernels such as ``batch_norm`` update running
    statistics without bumping their version counter, and comparing would read them
    (a copy costs what comparing would; fake tensors - ``layeropt plan`` - cannot
    compare). Restored through ``.data``, which leaves the version counter alone: the
    values are the ones the graph saw.
    """

    def __init__(self, engines: list[Any]) -> None:
        seen: set[int] = set()
        self.saved: list[tuple[Tensor, Tensor]] = []
        for e in engines:
            for attachment in list(e.attachments):
                model = attachment.model
                for b in model.buffers() if model is not None else ():
                    if id(b) not in seen:
                        seen.add(id(b))
                        self.saved.append((b, b.detach().clone()))

    def restore(self) -> None:
        with torch.no_grad():
            for b, value in self.saved:
                b.data.copy_(value)


def _refuse_fp16_unscale(optimizers: list[Any]) -> None:
    """torch's ``scaler.unscale_`` refuses float16 gradients (``allow_fp16=False``)."""
    for o in optimizers:
        if any(p.dtype == torch.float16 and p.requires_grad
               for g in o.param_groups for p in g["params"]):
            raise ValueError(  # (torch's words first, as scaler.unscale_ raises them)
                "Attempting to unscale FP16 gradients. GradScaler needs float32 parameters "
                "(float16 activations come from torch.autocast); keep the parameters in "
                "float32, or train bf16 without a scaler. Nothing was updated.")


def _refuse_unscaled(engines: list[Any]) -> None:
    """A scaled backward reached attached optimizers not given to ``layeropt.backward``:
    they would step on gradients nobody unscales (``scaler.step(opt)`` would)."""
    if engines:
        names = ", ".join(type(e._optimizer()).__name__ for e in engines)
        raise LayeroptError(
            f"layeropt.backward(scaler=...) reached the parameters of attached optimizer(s) "
            f"not given to it ({names}): they step in this backward on gradients still "
            "scaled, where scaler.step(opt) would unscale them. Pass every attached optimizer "
            "the loss reaches (optimizer=[opt1, opt2]; the default is all of them but those "
            "inside their no_step()), or hold them there, and clip a subset with "
            "parameters=. Nothing was updated."
        )


def _attached_backward(
    loss: Tensor, engines: list[Any], retain_graph: bool | None, transform: Transform | None,
    in_kernel: list[Any] = (),  # type: ignore[assignment]
) -> None:
    """``loss.backward()`` with the engines told they run inside layeropt.backward (and
    the held gradients that pass did not reach stepped with ``transform``); the engines
    ``in_kernel`` leave unscaling to their fused kernel (:func:`_grad_scale`)."""
    with contextlib.ExitStack() as stack:
        for e in engines:
            t = transform
            if t is not None and any(e is k for k in in_kernel):
                t = t._replace(inv_scale=None)
            stack.enter_context(e.backward_call(t))
        loss.backward(retain_graph=retain_graph)


@contextlib.contextmanager
def _grad_scale(optimizers: list[Any], scaler: Any, found: dict[Any, Tensor]) -> Any:
    """The fused optimizers' steps in this pass unscale in their kernel, as
    ``scaler.step(opt)`` sets them to (``grad_scale``, ``found_inf``)."""
    with contextlib.ExitStack() as stack:
        for o in optimizers:
            stack.enter_context(unscaled_in_kernel(o, scaler._scale, found[o._lo_engine]))
        yield


CLIP_HELD = (
    "layeropt.backward(max_norm= or scaler=) inside {name}.no_step() of an optimizer it "
    "clips or unscales: the clip and the unscale belong to the backward that steps. Run the "
    "held micro-batches as plain loss.backward() (scaler.scale(loss).backward()) inside "
    "no_step() and the last one through layeropt.backward(...) outside it (it measures, "
    "unscales and clips the held sums with it), or pass optimizer= without it. Nothing ran."
)


def stepping(optimizers: list[Any]) -> list[Any]:
    """``optimizers`` but those inside their ``no_step()``, where another is not: they hold
    this backward's gradients for a step of their own later (a GAN's D in G's backward),
    and torch's loop clips and unscales the model it steps now. All of them where all are
    held (an outer accumulation)."""
    return [o for o in optimizers if not o._lo_engine.no_step_depth] or optimizers


def _resolve(optimizer: Any) -> list[InBackwardOptimizer]:
    """``optimizer`` as a list; ``None``: every attached optimizer that steps now
    (:func:`stepping`)."""
    if optimizer is None:
        found = [o for o in live_optimizers() if o.attached]
        if not found:
            raise LayeroptError(
                "layeropt.backward found no attached layeropt optimizer; call "
                "layeropt.attach(model, opt) first (or use loss.backward())."
            )
        return stepping(found)
    return optimizer_list(optimizer)  # type: ignore[return-value]


def _owners(parameters: list[Tensor] | None, optimizers: list[Any]) -> list[Any]:
    """Attached optimizers not in ``optimizers`` that own some of ``parameters`` (any)."""
    ids = None if parameters is None else {id(p) for p in parameters}
    return [o for o in live_optimizers() if o.attached and not any(o is q for q in optimizers)
            and (ids is None or any(id(p) in ids for p in _owned([o])))]


def _owned(optimizers: list[Any]) -> list[Tensor]:
    return [p for o in optimizers for g in o.param_groups for p in g["params"]]


def _refuse_unscaled_twice(scaler: Any, optimizers: list[Any]) -> None:
    """Before anything runs: ``scaler.unscale_(opt)`` runs once per ``update()``."""
    from torch.amp.grad_scaler import OptState

    for o in optimizers:
        if scaler._per_optimizer_states[id(o)]["stage"] is not OptState.READY:
            raise LayeroptError(
                f"layeropt.backward(scaler=...) after scaler.unscale_/step was already called "
                f"for this {type(o).__name__} since the last scaler.update(). Accumulating "
                "micro-batches? Run all but the last inside `with opt.no_step():` as plain "
                "scaler.scale(loss).backward(), and only the last through layeropt.backward"
                "(scaler=...); then scaler.step(opt) (optional) and scaler.update(). Nothing "
                "was updated.")


def _record_for_scaler(scaler: Any, optimizers: list[Any], found: dict[Any, Tensor]) -> None:
    """Leave the scaler as if ``scaler.unscale_(opt)`` had run for each optimizer."""
    from torch.amp.grad_scaler import OptState

    for o in optimizers:
        found_inf = found[o._lo_engine]
        state = scaler._per_optimizer_states[id(o)]
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = OptState.UNSCALED


def two_pass_compile() -> Any:
    """A context in which ``torch.compile`` builds graphs that two backwards can run.

    ``layeropt.backward`` with ``max_norm``/``clip_value``/``scaler`` runs a
    measuring backward and then the stepping one over the same graph;
    AOTAutograd's donated buffers refuse the second ("compiled with non-empty
    donated buffers"). Inside this context they are off (a memory
    optimisation of the compiled backward only; the numbers do not change),
    and so are the compile caches, whose keys leave donation out (a graph
    compiled earlier with it would be reused): the model compiles afresh.
    Enter it before the model is compiled and keep it while training. On a
    torch without donated buffers (2.4) it does nothing. The
    integrations enter it for you while they train.

    Returns:
        A context manager.

    Example:
        >>> import torch, layeropt
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = layeropt.AdamW(model.parameters(), lr=1e-3)
        >>> with layeropt.two_pass_compile():
        ...     compiled = torch.compile(model, backend="aot_eager")
        ...     with layeropt.attach(compiled, opt):
        ...         norm = layeropt.backward(compiled(torch.randn(2, 4)).sum(), max_norm=1.0)
    """
    try:
        from torch._functorch import config
    except ImportError:  # pragma: no cover - a torch without functorch
        return contextlib.nullcontext()
    if not hasattr(config, "donated_buffer"):  # older torch: nothing donated
        return contextlib.nullcontext()
    stack = contextlib.ExitStack()
    stack.enter_context(config.patch(donated_buffer=False))
    # The compile caches' keys leave donation out: a graph compiled earlier with it (a
    # torch.optim run of the same model, in this process or on disk) would be reused
    # and the second pass read buffers the first overwrote. No caches in here.
    from torch._inductor import config as inductor_config

    stack.enter_context(inductor_config.patch(fx_graph_cache=False))
    if hasattr(config, "enable_autograd_cache"):
        stack.enter_context(config.patch(enable_autograd_cache=False))
    return stack
