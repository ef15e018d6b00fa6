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

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import Tensor

from .distributed import two_passes
from .errors import LayeroptError
from .optim import InBackwardOptimizer, live_optimizers, optimizer_list

__all__ = ["backward"]


def _total_norm(norms: list[Tensor], norm_type: float) -> Tensor:
    if not norms:
        return torch.tensor(0.0)
    first = norms[0].device
    return torch.linalg.vector_norm(torch.stack([n.to(first) for n in norms]), norm_type)


def _grad_order(
    optimizers: list[InBackwardOptimizer],
    measured: dict[Tensor, Tensor],
    parameters: Iterable[Tensor] | None,
) -> list[Tensor]:
    """Norms in the order ``clip_grad_norm_(parameters)`` stacks them.

    The total norm sums the per-tensor norms; its last bit depends on their
    order, so it follows ``parameters`` (default: the optimizers' param groups).
    """
    if parameters is None:
        parameters = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
    groups: dict[tuple[torch.device, torch.dtype], list[Tensor]] = {}
    seen: set[int] = set()
    for p in parameters:
        if p in measured and id(p) not in seen:
            seen.add(id(p))
            groups.setdefault((p.device, p.dtype), []).append(measured[p])
    return [n for ns in groups.values() for n in ns]


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
    max_norm); scaler.step(opt); scaler.update()`` with plain torch (any part
    optional), while every layer is still updated during backward and its
    gradient freed at once. Pass ``scaler.scale(loss)`` as ``loss`` when using
    a scaler, then call ``scaler.step(opt)`` (a no-op) and ``scaler.update()``
    as usual.

    Args:
        loss: the (scaled) loss to differentiate.
        optimizer: the attached layeropt optimizer(s); default: every attached one.
        max_norm: clip the global gradient norm to this value (``None``: no
            clipping; falls back to ``attach(..., max_grad_norm=...)``).
        norm_type: the p of the p-norm, as in ``clip_grad_norm_``.
        error_if_nonfinite: raise if the total norm is inf/NaN (before any update).
        scaler: a ``torch.amp.GradScaler`` whose ``scale(loss)`` was passed.
        retain_graph: for the final pass, as in ``Tensor.backward``.
        parameters: the parameters in the order you would pass them to
            ``clip_grad_norm_`` (e.g. ``model.parameters()``); the total norm
            then equals torch's to the last bit. Default: the optimizers'
            param-group order.

    Returns:
        The total gradient norm (of the unscaled gradient) when clipping,
        else ``None``. It is also stored as ``optimizer.last_grad_norm``.

    Example:
        >>> model = torch.nn.Linear(4, 2)
        >>> opt = layeropt.SGD(model.parameters(), lr=0.1)
        >>> _ = layeropt.attach(model, opt)
        >>> norm = layeropt.backward(model(torch.randn(3, 4)).sum(), max_norm=1.0)
    """
    optimizers = _resolve(optimizer)
    if scaler is not None and not scaler.is_enabled():
        scaler = None  # a disabled scaler is plain backward, as in torch
    if max_norm is None:
        configured = {o._lo_engine.max_grad_norm for o in optimizers} - {None}
        if len(configured) > 1:
            raise LayeroptError(
                "the optimizers were attached with different max_grad_norm values; "
                "pass max_norm= to layeropt.backward explicitly."
            )
        if configured:
            max_norm = configured.pop()
            norm_type = optimizers[0]._lo_engine.norm_type
    engines = [o._lo_engine for o in optimizers]
    if max_norm is None and scaler is None:
        _attached_backward(loss, engines, retain_graph, None)
        return None

    # Layers unfrozen (or frozen) since attach: hooked (unhooked) now, so that the
    # measure pass sees every gradient the step will use. (A plain backward picks
    # them up as it goes, rule 7 of landing.py; two passes cannot.)
    for e in engines:
        for attachment in list(e.attachments):
            attachment.sync()

    inv_scale = found_inf = None
    if scaler is not None:
        scale = scaler._scale
        if scale is None:
            raise LayeroptError("the GradScaler has no scale yet: pass scaler.scale(loss).")
        inv_scale = scale.double().reciprocal().float()
        found_inf = torch.full((), 0.0, dtype=torch.float32, device=scale.device)

    # Pass 1: measure. Its recomputations (activation checkpointing) must leave no
    # trace in the modules' buffers (BatchNorm's running statistics): pass 2
    # recomputes again, as the single backward of plain training does.
    measured: dict[Tensor, Tensor] = {}
    buffers = _BufferSnapshot(engines)
    ddp = two_passes(engines)  # DDP models: average before measuring, and again in pass 2
    for e in engines:
        e.start_measure(measured, norm_type if max_norm is not None else None, inv_scale, found_inf)
    try:
        with ddp.measure():
            loss.backward(retain_graph=True)
        for e in engines:
            e.finish_measure()
    finally:
        for e in engines:
            e.measure = None
        buffers.restore()

    total = None
    if max_norm is not None:
        for o in optimizers:  # zero_grad(set_to_none=False): torch measures their zeros too
            for p in o._lo_engine.unused_kept(o):
                measured.setdefault(p, torch.zeros((), dtype=p.dtype, device=p.device))
        total = _total_norm(_grad_order(optimizers, measured, parameters), norm_type)
        if error_if_nonfinite and torch.logical_or(total.isnan(), total.isinf()):
            raise RuntimeError(
                f"The total norm of order {norm_type} for gradients is non-finite, so it "
                "cannot be clipped; no parameter was updated. To clip anyway, set "
                "error_if_nonfinite=False."
            )
    skip = found_inf is not None and bool(found_inf.item())

    if scaler is not None:
        _record_for_scaler(scaler, optimizers, found_inf)
    if skip:  # an inf/NaN: no step pass, nothing changes
        for e in engines:
            e.discard_held()
    else:  # Pass 2: the ordinary attached backward, unscale/clip before each step.
        coef = None if total is None else torch.clamp(max_norm / (total + 1e-6), max=1.0)
        with ddp.step() as finish:
            _attached_backward(loss, engines, retain_graph, (inv_scale, coef), finish)
    for o in optimizers:
        o.last_grad_norm = total
    return total


class _BufferSnapshot:
    """The attached models' buffers, to undo what the measure pass's recomputes wrote.

    Compared by value: kernels such as ``batch_norm`` update running statistics
    without bumping their version counter. Restored through ``.data``, which
    leaves the version counter alone: the values are the ones the graph saw.
    """

    def __init__(self, engines: list[Any]) -> None:
        seen: set[int] = set()
        self.saved: list[tuple[Tensor, int, Tensor]] = []
        for e in engines:
            for attachment in list(e.attachments):
                model = attachment.model
                for b in model.buffers() if model is not None else ():
                    if id(b) not in seen:
                        seen.add(id(b))
                        self.saved.append((b, b._version, b.detach().clone()))

    def restore(self) -> None:
        with torch.no_grad():
            for b, version, value in self.saved:
                if b._version != version or not torch.equal(b, value):
                    b.data.copy_(value)


def _attached_backward(
    loss: Tensor, engines: list[Any], retain_graph: bool | None, transform: Any,
    finish: Callable[[], None] | None = None,
) -> None:
    """``loss.backward()`` with the engines told they run inside layeropt.backward;
    then ``finish()`` (DDP's pass 2: what is left), the transform still set."""
    for e in engines:
        e.transform = transform
        e.entered = True
    try:
        loss.backward(retain_graph=retain_graph)
        if finish is not None:
            finish()
    finally:
        for e in engines:
            e.transform = None
            e.entered = False


def _resolve(optimizer: Any) -> list[InBackwardOptimizer]:
    if optimizer is None:
        found = [o for o in live_optimizers() if o.attached]
        if not found:
            raise LayeroptError(
                "layeropt.backward found no attached layeropt optimizer; call "
                "layeropt.attach(model, opt) first (or use loss.backward())."
            )
        return found
    return optimizer_list(optimizer)  # type: ignore[return-value]


def _record_for_scaler(scaler: Any, optimizers: list[Any], found_inf: Tensor | None) -> None:
    """Leave the scaler as if ``scaler.unscale_(opt)`` had run for each optimizer."""
    from torch.amp.grad_scaler import OptState

    for o in optimizers:
        state = scaler._per_optimizer_states[id(o)]
        if state["stage"] is not OptState.READY:
            raise LayeroptError(
                "scaler.unscale_/step was already called for this optimizer in this "
                "iteration; with layeropt.backward(scaler=...) call only "
                "scaler.step(opt) (optional) and scaler.update() afterwards."
            )
        state["found_inf_per_device"] = {found_inf.device: found_inf}
        state["stage"] = OptState.UNSCALED
