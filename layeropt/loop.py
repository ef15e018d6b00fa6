"""Looped forwards with the memory of one iteration.

A forward that runs the same sub-network ``n`` times in a Python loop keeps
every iteration's activations until ``backward``, so memory grows with ``n``
(e.g. a forward that loops over transmit ids with one shared feature
extractor). Gradients add up, so the loop can be trained with the memory
of one iteration. This module covers the three shapes such a loop takes:

1. **independent iterations, one loss each** - :class:`LoopAccumulator`:
   backward each iteration's ``loss_i / n`` at once (freeing its graph) and
   step the optimizer once, after the n-th backward;
2. **a head on the stack of all outputs** - :func:`loop_stack`: each
   iteration is checkpointed (non-reentrant) and written into one
   preallocated stack, so forward holds the stack and one iteration; backward
   recomputes one iteration at a time;
3. **recurrent loops** (iteration ``i`` reads iteration ``i-1``'s output) -
   :func:`loop_recurrent`: checkpoint every ``k`` iterations, so memory grows
   with the small carried state, not with the iterations' activations.

All three give the gradient of the plain full-graph loop and work with
``torch.optim`` optimizers and with attached layeropt optimizers (each
parameter, shared by all iterations, is stepped once per training step).
See ``docs/loops.md`` for measurements.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable
from typing import Any, Literal, TypeVar

import torch
from torch import Tensor
from torch.optim import Optimizer
from torch.utils.checkpoint import checkpoint

from .backward_pass import backward, default_parameters, stepping
from .errors import LayeroptError
from .optim import InBackwardOptimizer, live_optimizers, optimizer_list

__all__ = ["LoopAccumulator", "LoopStateError", "loop_recurrent", "loop_stack"]

S = TypeVar("S", Tensor, tuple[Tensor, ...])


class LoopStateError(LayeroptError):
    """A :class:`LoopAccumulator` was used out of order (see the message)."""


SHARED_GRAPH_ERROR = (
    "acc.backward() of iteration {i} reaches a part of the graph an earlier iteration's "
    "backward already freed: a tensor computed before the loop (an encoder's output) that "
    "every iteration reads. Each backward frees the graph it runs through, so the memory "
    "stays at one iteration's. Compute that part inside each iteration, or detach it "
    "before the loop if it does not train."
)


class LoopAccumulator:
    """Backward each loop iteration at once; step the optimizer once per n.

    ``backward(loss_i)`` runs ``(loss_i / n).backward()`` immediately, so the
    iteration's graph is freed before the next one is built; the gradients
    add up in ``.grad`` to the gradient of the full-graph
    ``(loss_0 + ... + loss_{n-1}) / n``. The optimizer steps once:

    * attached layeropt optimizers: backwards 1..n-1 run inside
      ``optimizer.no_step()`` (gradients accumulate), the n-th backward steps
      each layer in backward and frees its gradient. Every attached layeropt
      optimizer is deferred, so ``optimizer`` may be left ``None``;
    * ``torch.optim`` optimizers (or layeropt ones not attached): call
      ``acc.step()`` (or ``optimizer.step()``) after the loop.

    Clipping and ``GradScaler`` (``max_norm=``, ``scaler=``): the result is
    the hand-written torch loop's, bit for bit: each loss through
    ``scaler.scale`` before its backward; after the last backward, only when
    clipping, ``scaler.unscale_(opt); clip_grad_norm_(parameters,
    max_norm)``; then ``scaler.step(opt)`` for each optimizer and
    ``scaler.update()``. Without clipping there is no ``unscale_``:
    ``scaler.step`` unscales (a fused optimizer's kernel divides by the
    scale, which differs from ``unscale_``'s multiply in the last bits unless
    the scale is a power of two). Attached layeropt optimizers get it through
    :func:`layeropt.backward` in the n-th backward (one extra backward pass
    of the last iteration only); plain optimizers through torch's own
    ``unscale_``, ``clip_grad_norm_`` and ``scaler.step`` in ``acc.step()``.

    One accumulator counts one training step at a time. ``acc.step()`` or
    ``acc.reset()`` starts the next one; as a context manager, leaving the
    ``with`` block checks that exactly ``n`` backwards ran and starts the next.
    :attr:`loss` survives the end of a step (``acc.step()`` or leaving the
    ``with`` block): it keeps the finished step's loss until the next step's
    first ``backward()``.

    Args:
        n: number of backward calls (loop iterations) per training step.
        optimizer: optimizer(s) that ``step()`` steps and zeroes; ``None``
            when the only optimizers are attached layeropt ones.
        reduction: ``"mean"`` scales each loss by ``1/n`` (the full-graph loss
            is the mean of the iteration losses); ``"sum"`` does not scale.
        max_norm: clip the global norm of the accumulated gradient to this
            value after the n-th backward (``None``: no clipping); the norm is
            kept in :attr:`grad_norm`.
        norm_type: the p of the p-norm, as in ``clip_grad_norm_``.
        scaler: a ``torch.amp.GradScaler``: every loss is scaled by it, the
            gradient unscaled (with ``unscale_`` only when clipping) and an
            inf/NaN skips the step, as ``scaler.step`` does; ``acc.step()``
            calls ``scaler.step(opt)`` and ``scaler.update()``.
        parameters: what you would pass to ``clip_grad_norm_`` (the total norm
            is summed in this order). Default: the attached models'
            ``parameters()`` (as :func:`layeropt.backward`: less other attached
            layeropt optimizers'), then the given optimizers' parameters.

    Example:
        >>> model = torch.nn.Linear(4, 1)
        >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> acc = LoopAccumulator(3, opt)
        >>> for i in range(3):
        ...     acc.backward(model(torch.randn(2, 4)).square().mean())
        >>> acc.step()  # opt.step(); opt.zero_grad(); ready for the next step
    """

    def __init__(
        self,
        n: int,
        optimizer: Optimizer | Iterable[Optimizer] | None = None,
        *,
        reduction: Literal["mean", "sum"] = "mean",
        max_norm: float | None = None,
        norm_type: float = 2.0,
        scaler: torch.amp.GradScaler | None = None,
        parameters: Iterable[Tensor] | None = None,
    ) -> None:
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"n must be a positive int (backwards per step), got {n!r}")
        if reduction not in ("mean", "sum"):
            raise ValueError(f"reduction must be 'mean' or 'sum', got {reduction!r}")
        self.optimizers: list[Optimizer] = optimizer_list(optimizer)
        for o in self.optimizers:
            if not isinstance(o, Optimizer):
                raise TypeError(
                    f"optimizer must be a torch.optim.Optimizer, got {type(o).__name__}"
                )
        if max_norm is not None and (isinstance(max_norm, bool) or max_norm < 0):
            raise ValueError(f"max_norm must be a non-negative number or None, got {max_norm!r}")
        self.n = n
        self.reduction = reduction
        self.max_norm = max_norm
        self.norm_type = norm_type
        self.scaler = scaler
        self.parameters: list[Tensor] | None = None if parameters is None else list(parameters)
        #: The total gradient norm of the last clipped step (before clipping), else None.
        self.grad_norm: Tensor | None = None
        self.count = 0
        self._total: Tensor | None = None
        self._finished = False  # _total is a finished step's loss, kept for reading
        self._deferred: dict[InBackwardOptimizer, None] = {}

    @property
    def done(self) -> bool:
        """Whether all ``n`` backwards of the current step have run."""
        return self.count == self.n

    @property
    def loss(self) -> float:
        """The step's loss: the sum of the scaled losses so far.

        After the n-th ``backward()`` it is the full-graph loss, and it stays
        readable after the step ends (``acc.step()``, leaving the ``with``
        block) until the next ``backward()`` starts a new step. ``0.0`` before
        any backward and after :meth:`reset`.
        """
        return 0.0 if self._total is None else float(self._total)

    def backward(self, loss: Tensor) -> None:
        """Scale ``loss`` and backpropagate it now; step only on the n-th call.

        Args:
            loss: the scalar loss of one iteration.

        Raises:
            LoopStateError: ``n`` backwards already ran in this step.
        """
        if self.count >= self.n:
            raise LoopStateError(
                f"backward() called {self.count + 1} times but n={self.n}. Call "
                "acc.step() or acc.reset() to start the next training step (or "
                "create the accumulator with the right n)."
            )
        if self.count == 0:
            self._check_clipping()
        if self._finished:  # the first backward of a new step: drop the last step's loss
            self._total, self._finished = None, False
        scaled = loss / self.n if self.reduction == "mean" else loss
        to_backward = scaled if self.scaler is None else self.scaler.scale(scaled)
        last = self.count == self.n - 1
        try:
            if last:
                self._last_backward(to_backward)
            else:
                with contextlib.ExitStack() as stack:
                    for opt in self._attached():
                        stack.enter_context(opt.no_step())
                        self._deferred[opt] = None
                    to_backward.backward()
        except RuntimeError as exc:
            if self.count and "second time" in str(exc):  # (torch's freed-graph error)
                raise LoopStateError(SHARED_GRAPH_ERROR.format(i=self.count + 1)) from exc
            raise
        self.count += 1
        value = scaled.detach()
        self._total = value if self._total is None else self._total + value
        if last:
            self._flush_deferred()

    def _clips(self) -> bool:
        return self.max_norm is not None or (self.scaler is not None and self.scaler.is_enabled())

    def _check_clipping(self) -> None:
        """Before a step's first backward: clipping or a scaler needs to know what to clip."""
        self.grad_norm = None
        if not self._clips() or self.optimizers or self._attached():
            return
        if self.scaler is not None and self.scaler.is_enabled():
            raise LoopStateError(
                "LoopAccumulator(scaler=...) found no optimizer: GradScaler unscales per "
                "optimizer. Pass the optimizer (LoopAccumulator(n, opt, scaler=scaler)) or "
                "attach a layeropt optimizer first."
            )
        if self.parameters is None:
            raise LoopStateError(
                "LoopAccumulator(max_norm=...) found no optimizer and no parameters to "
                "clip. Pass the optimizer (LoopAccumulator(n, opt, max_norm=...)), "
                "parameters=model.parameters(), or attach a layeropt optimizer first."
            )

    def _last_backward(self, loss: Tensor) -> None:
        """The n-th backward; with clipping or a scaler, then unscale and clip.

        Attached optimizers: :func:`layeropt.backward` measures the accumulated
        gradient and steps each layer unscaled and clipped. Plain optimizers:
        ``scaler.unscale_`` and ``clip_grad_norm_`` on ``.grad``, torch's own;
        ``unscale_`` only with ``max_norm`` (else ``scaler.step`` unscales).
        Inside an outer ``no_step()`` the gradient keeps accumulating (scaled,
        unclipped): the outer accumulation's last backward clips the whole sum.
        """
        # (an outer accumulation - its own optimizers inside no_step(), or all - defers the
        # clip to its last backward; another held - a GAN's D in G's backward - is left
        # out, as layeropt.backward leaves it out of its default)
        attached = stepping(self._attached())
        own = [o for o in self.optimizers if isinstance(o, InBackwardOptimizer)]
        if not self._clips() or any(o._lo_engine.no_step_depth for o in [*attached, *own]):
            loss.backward()
            return
        plain = [o for o in self.optimizers if not any(o is a for a in attached)]
        scaler = self.scaler if self.scaler is not None and self.scaler.is_enabled() else None
        # Plain optimizers: scaler.unscale_(opt) only to clip, as torch's clipping recipe
        # and layeropt.backward do. Without clipping scaler.step(opt) unscales itself: the
        # same multiply for a non-fused optimizer, a division inside the kernel for a fused
        # one (unscale_ first would multiply by 1/scale: another last bit).
        unscale = plain if scaler is not None and self.max_norm is not None else []
        if attached:
            params = self.parameters
            if params is None and plain:  # the plain optimizers' parameters clipped too
                params = list({id(p): p for p in default_parameters(attached)
                               + _optimizer_params(plain)}.values())
            self.grad_norm = backward(loss, attached, max_norm=self.max_norm,
                                      norm_type=self.norm_type, scaler=scaler,
                                      parameters=params)
            # plain optimizers: unscaled here to clip (layeropt.backward unscales its own only)
            for o in unscale:
                scaler.unscale_(o)
            return
        loss.backward()
        for o in unscale:
            scaler.unscale_(o)
        if self.max_norm is not None:
            params = self.parameters if self.parameters is not None else _optimizer_params(plain)
            self.grad_norm = torch.nn.utils.clip_grad_norm_(params, self.max_norm,
                                                            norm_type=self.norm_type)

    def _flush_deferred(self) -> None:
        """Step gradients held in calls 1..n-1 that the n-th backward did not reach.

        The hooks step held gradients at the end of the next attached backward
        that reaches the optimizer's parameters; if the last iteration's loss
        reaches none of them, step them here (unless an outer ``no_step()``
        is still accumulating).
        """
        for opt in self._deferred:
            engine = opt._lo_engine
            if not engine.no_step_depth and engine.holds_gradients:
                opt.step()  # attached: steps and frees exactly the leftover gradients
        self._deferred.clear()

    def _attached(self) -> list[InBackwardOptimizer]:
        given = [o for o in self.optimizers if isinstance(o, InBackwardOptimizer)]
        return list(dict.fromkeys(given + [o for o in live_optimizers() if o.attached]))

    def step(self) -> None:
        """After the n-th backward: step and zero the optimizers, then reset.

        For attached layeropt optimizers the update already happened in the
        n-th backward and their ``step()`` is a no-op, so calling ``acc.step()``
        is right for both optimizer kinds. With a ``scaler``: ``scaler.step(opt)``
        for each optimizer, then ``scaler.update()``.

        Raises:
            LoopStateError: fewer than ``n`` backwards ran in this step.
        """
        if self.count != self.n:
            raise LoopStateError(
                f"step() after {self.count} of n={self.n} backward() calls would use "
                "a partial gradient. Run all n iterations first, or call acc.reset() "
                "to drop this step (then optimizer.zero_grad())."
            )
        scaler = self.scaler
        for opt in self.optimizers:
            if scaler is not None:
                scaler.step(opt)
            else:
                opt.step()
            opt.zero_grad()
        if scaler is not None:
            scaler.update()
        self._end_step()

    def _end_step(self) -> None:
        """The step is complete: count back to zero, :attr:`loss` kept for reading."""
        self.count = 0
        self._finished = True
        self._deferred.clear()

    def reset(self) -> None:
        """Drop the current training step: count and logged loss back to zero.

        Gradients already accumulated stay in ``.grad``; call
        ``optimizer.zero_grad()`` to drop them too.
        """
        self.count = 0
        self._total = None
        self._finished = False
        self.grad_norm = None
        self._deferred.clear()

    def __enter__(self) -> LoopAccumulator:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None and 0 < self.count < self.n:
            count = self.count
            self.reset()
            raise LoopStateError(
                f"the loop ended after {count} of n={self.n} backward() calls, so the "
                "optimizer never stepped. Give LoopAccumulator the loop's real length, "
                "e.g. n=len(range(0, nb_elements, decimation_factor))."
            )
        if exc_type is None and self.count == self.n:
            self._end_step()  # a complete step: keep its loss readable after the block
        else:
            self.reset()

    def __repr__(self) -> str:
        return f"LoopAccumulator(n={self.n}, count={self.count}, reduction={self.reduction!r})"


def _optimizer_params(optimizers: list[Optimizer]) -> list[Tensor]:
    """The optimizers' parameters, in param-group order, each once."""
    out: dict[int, Tensor] = {}
    for o in optimizers:
        for g in o.param_groups:
            for p in g["params"]:
                out.setdefault(id(p), p)
    return list(out.values())


class _Place(torch.autograd.Function):
    """``buf.select(dim, i).copy_(y)`` in place, with a copy-free backward.

    ``torch.stack`` needs every output alive at once (two stacks of memory);
    writing each output into one buffer as it is made holds one. The
    gradient of ``y`` is a view of the buffer's gradient, and the buffer's
    gradient passes through unchanged: slot ``i`` of the incoming buffer was
    never written by anything differentiable before, so nothing reads it.
    """

    @staticmethod
    def forward(ctx: Any, buf: Tensor, y: Tensor, i: int, dim: int) -> Tensor:
        buf.select(dim, i).copy_(y)
        ctx.mark_dirty(buf)
        ctx.i, ctx.dim = i, dim
        return buf

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        return grad, grad.select(ctx.dim, ctx.i), None, None


def _rng_anchors() -> tuple[Tensor, ...]:
    """Zero-size tensors on every initialised CUDA device, for ``checkpoint``'s args.

    ``checkpoint`` saves and restores the RNG state of the devices of its
    *tensor arguments* only. An iteration called with an int (``tx_id``) and
    closing over CUDA tensors would recompute with fresh dropout masks: a
    wrong gradient (measured on an H200: parameters off by 4e-3 after two
    Adam steps). Passing these anchors makes it replay every CUDA device's RNG.
    """
    if not torch.cuda.is_initialized():
        return ()
    return tuple(torch.empty(0, device=f"cuda:{i}") for i in range(torch.cuda.device_count()))


def _call(fn: Callable[[Any], Tensor], x: Any, anchors: tuple[Tensor, ...]) -> Tensor:
    return fn(x)


def _items(inputs: int | Iterable[Any], name: str) -> list[Any]:
    if isinstance(inputs, bool):
        raise TypeError(f"{name}: inputs must be an int or an iterable, got a bool")
    if isinstance(inputs, int):
        if inputs < 0:
            raise ValueError(f"{name}: the number of iterations must be >= 0, got {inputs}")
        return list(range(inputs))
    return list(inputs)


def loop_stack(
    fn: Callable[[Any], Tensor],
    inputs: int | Iterable[Any],
    dim: int = 0,
    *,
    recompute: bool = True,
    preserve_rng_state: bool = True,
) -> Tensor:
    """``torch.stack([fn(x) for x in inputs], dim)`` with one iteration's activations.

    Each ``fn(x)`` runs under non-reentrant ``torch.utils.checkpoint`` (its
    activations are dropped and recomputed in backward, one iteration at a
    time, with the RNG state of the forward, so dropout is replayed) and its
    output is written straight into a preallocated stack. Memory: the stack,
    one iteration, and the CPU RNG state (5 KiB) per iteration; backward adds
    the stack's gradient. The gradient is the full-graph loop's, bit for bit.

    Args:
        fn: one iteration; takes one item of ``inputs`` and returns a tensor
            of the same shape every time. Parameters it uses (closures
            included) receive gradients.
        inputs: the items to loop over, or an int ``n`` for ``range(n)``.
        dim: where the new axis goes, as in ``torch.stack``.
        recompute: ``False`` keeps activations (the plain loop, no recompute)
            but still builds the stack in place.
        preserve_rng_state: passed to ``checkpoint``; ``False`` saves the 5 KiB
            RNG state per iteration when ``fn`` draws no random numbers.

    Returns:
        The stacked outputs, shape ``fn(x).shape`` with ``len(inputs)`` at ``dim``.

    Example:
        >>> conv = torch.nn.Conv1d(1, 4, 3, padding=1)
        >>> sino = torch.randn(2, 8, 32)  # (batch, elements, samples)
        >>> stack = loop_stack(lambda tx: conv(sino[:, tx : tx + 1]), range(0, 8, 2), dim=1)
        >>> stack.shape
        torch.Size([2, 4, 4, 32])
    """
    items = _items(inputs, "loop_stack")
    if not items:
        raise ValueError("loop_stack: inputs is empty; there is nothing to stack")
    buf: Tensor | None = None
    anchors = _rng_anchors() if recompute and preserve_rng_state else ()
    for i, x in enumerate(items):
        if recompute:
            y = checkpoint(
                _call, fn, x, anchors, use_reentrant=False, preserve_rng_state=preserve_rng_state
            )
        else:
            y = fn(x)
        if not isinstance(y, Tensor):
            raise TypeError(f"loop_stack: fn must return a Tensor, got {type(y).__name__}")
        if buf is None:
            if not -y.dim() - 1 <= dim <= y.dim():
                raise ValueError(
                    f"loop_stack: dim={dim} is out of range for a {y.dim() + 1}-d stack"
                )
            dim = dim % (y.dim() + 1)
            shape = y.shape[:dim] + (len(items),) + y.shape[dim:]
            buf = y.new_empty(shape)
            first_shape = y.shape
        elif y.shape != first_shape:
            raise ValueError(
                f"loop_stack: iteration {i} returned shape {tuple(y.shape)} but iteration 0 "
                f"returned {tuple(first_shape)}; every iteration must return the same shape."
            )
        buf = _Place.apply(buf, y, i, dim)
        del y  # the stack holds the values; free the output now
    assert buf is not None
    return buf


def _segment(
    fn: Callable[[Any, Any], Any], items: list[Any], single: bool, anchors: tuple[Tensor, ...],
    *state: Tensor,
) -> Any:
    s: Any = state[0] if single else tuple(state)
    for x in items:
        s = fn(s, x)
        if single and not isinstance(s, Tensor):
            raise TypeError(
                f"loop_recurrent: the state is a Tensor, but fn returned {type(s).__name__}"
            )
        if not single and not (isinstance(s, (tuple, list)) and len(s) == len(state)):
            raise TypeError(
                f"loop_recurrent: the state is a tuple of {len(state)} tensors; fn must "
                "return a tuple of the same length"
            )
    return s


def loop_recurrent(
    fn: Callable[[S, Any], S],
    state: S,
    inputs: int | Iterable[Any],
    *,
    every: int = 1,
    preserve_rng_state: bool = True,
) -> S:
    """``for x in inputs: state = fn(state, x)``, checkpointed every ``every`` steps.

    Only the carried state at each segment boundary is kept (plus 5 KiB of RNG
    state per segment); backward recomputes one segment of ``every``
    iterations at a time. Memory: ``len(inputs)/every`` states plus the
    activations of ``every`` iterations. ``every=1`` is the least memory when
    the state is small next to one iteration's activations; a larger
    ``every`` keeps fewer states. The gradient is the full-graph loop's, bit
    for bit.

    Args:
        fn: one step; ``fn(state, x)`` returns the next state (same structure).
        state: the initial state: a Tensor or a tuple of Tensors.
        inputs: the items to loop over, or an int ``n`` for ``range(n)``.
        every: iterations per checkpointed segment (>= 1).
        preserve_rng_state: passed to ``checkpoint`` (dropout replay).

    Returns:
        The final state.

    Example:
        >>> cell = torch.nn.Linear(8, 8)
        >>> xs = torch.randn(16, 2, 8)
        >>> h = loop_recurrent(lambda h, x: torch.tanh(cell(h) + x), torch.zeros(2, 8), xs)
        >>> h.shape
        torch.Size([2, 8])
    """
    if isinstance(every, bool) or not isinstance(every, int) or every < 1:
        raise ValueError(f"loop_recurrent: every must be a positive int, got {every!r}")
    single = isinstance(state, Tensor)
    if not single and not (
        isinstance(state, (tuple, list)) and all(isinstance(t, Tensor) for t in state)
    ):
        raise TypeError("loop_recurrent: state must be a Tensor or a tuple of Tensors")
    items = _items(inputs, "loop_recurrent")
    anchors = _rng_anchors() if preserve_rng_state else ()
    s: Any = state
    for start in range(0, len(items), every):
        args = (s,) if single else tuple(s)
        s = checkpoint(
            _segment, fn, items[start : start + every], single, anchors, *args,
            use_reentrant=False, preserve_rng_state=preserve_rng_state,
        )
    return s
