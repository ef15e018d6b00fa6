"""Looped forwards (one extractor run per transmit id): exactness vs the full graph, bytes.

The reference for every shape is the plain loop a user would write, with the
whole graph kept until one ``backward`` and a plain ``torch.optim`` step.
Dropout runs inside the loop body; both sides draw the same masks because
each training step reseeds the global RNG before its forward.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from harness import OPTIMIZER_CONFIGS, InfGrad, assert_same, clone_kwargs, config_id
from torch import Tensor, nn

import layeropt
from layeropt.loop import LoopAccumulator, LoopStateError, loop_recurrent, loop_stack
from layeropt.memory import PeakMemory


@pytest.fixture(autouse=True)
def _no_attached_optimizer_left_over() -> None:
    """A LoopAccumulator given no optimizer takes every live attached one (docs/loops.md):
    an earlier test's, kept alive by a reference cycle until the collector runs (a
    ``pytest.raises`` traceback holding its frame), would be taken too."""
    if any(o.attached for o in layeropt.optim.live_optimizers()):
        gc.collect()

B, SAMPLES, C = 3, 16, 4  # batch, samples per transmit, extractor channels

# One config per optimizer class (OPTIMIZER_CONFIGS has every option of each).
ONE_PER_CLASS = list({name: (name, kw) for name, kw in reversed(OPTIMIZER_CONFIGS)}.values())


class Sino(nn.Module):
    """The looped setting: one extractor run for each transmit id, a per-iteration head
    (shape 1), a head on the stack (shape 2), a recurrent cell (shape 3).
    ``gain`` is shared by the loop body and the stack's head. (The per-iteration
    head does not use it: a parameter used twice per iteration gets 2n terms,
    which the full graph groups differently, so n=2 would not be bitwise.)"""

    def __init__(self) -> None:
        super().__init__()
        self.ext = nn.Sequential(
            nn.Conv1d(1, 8, 3, padding=1), nn.GELU(), nn.Dropout(0.2), nn.Conv1d(8, C, 3, padding=1)
        )
        self.gain = nn.Parameter(torch.ones(1) * 1.1)
        self.head_i = nn.Linear(C * SAMPLES, 1)
        self.head_s = nn.Linear(C * SAMPLES, 1)
        self.cell = nn.Linear(SAMPLES, SAMPLES)
        self.inp = nn.Linear(SAMPLES, SAMPLES)
        self.drop = nn.Dropout(0.2)

    def feat(self, x: Tensor, tx: int) -> Tensor:
        return self.ext(x[:, tx : tx + 1] * self.gain)

    def loss_i(self, x: Tensor, t: Tensor, tx: int) -> Tensor:
        out = self.head_i(self.feat(x, tx).flatten(1)).squeeze(1)
        return F.mse_loss(out, t[:, tx])

    def stack_loss(self, stack: Tensor, t: Tensor) -> Tensor:  # not separable over iterations
        z = self.head_s(stack.flatten(2) * self.gain).squeeze(-1)
        return F.mse_loss(torch.logsumexp(z, 1), t[:, 0])

    def step(self, h: Tensor, x: Tensor) -> Tensor:
        return torch.tanh(self.drop(self.cell(h)) + self.inp(x) * self.gain)


def make(seed: int = 0) -> Sino:
    torch.manual_seed(seed)
    return Sino()


def batch(step: int, n: int) -> tuple[Tensor, Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(B, n, SAMPLES, generator=g), torch.randn(B, n, generator=g)


# --- the three shapes: full-graph reference and layeropt version ----------------
def full_independent(m: Sino, x: Tensor, t: Tensor, n: int) -> None:
    (sum(m.loss_i(x, t, i) for i in range(n)) / n).backward()


def full_stack(m: Sino, x: Tensor, t: Tensor, n: int) -> None:
    m.stack_loss(torch.stack([m.feat(x, i) for i in range(n)], 1), t).backward()


def full_recurrent(m: Sino, x: Tensor, t: Tensor, n: int) -> None:
    h = torch.zeros(B, SAMPLES, device=x.device)
    for i in range(n):
        h = m.step(h, x[:, i])
    F.mse_loss(h.sum(1), t[:, 0]).backward()


def lo_stack(m: Sino, x: Tensor, t: Tensor, n: int) -> None:
    m.stack_loss(loop_stack(lambda i: m.feat(x, i), n, dim=1), t).backward()


def lo_recurrent(every: int) -> Callable[..., None]:
    def run(m: Sino, x: Tensor, t: Tensor, n: int) -> None:
        h0 = torch.zeros(B, SAMPLES, device=x.device)
        h = loop_recurrent(m.step, h0, x.unbind(1), every=every)
        F.mse_loss(h.sum(1), t[:, 0]).backward()

    return run


def train(
    step_fn: Callable[[Sino, Any, int, int], None], opt_name: str, kw: dict, n: int,
    *, attached: bool, steps: int = 3,
) -> tuple[Sino, torch.optim.Optimizer]:
    """Train a fresh model ``steps`` steps; ``step_fn(model, opt, step, n)`` runs one."""
    m = make()
    cls = getattr(layeropt if attached else torch.optim, opt_name)
    opt = cls(m.parameters(), **clone_kwargs(kw))
    handle = layeropt.attach(m, opt) if attached else None
    for s in range(steps):
        torch.manual_seed(100 + s)  # same dropout masks on every side
        step_fn(m, opt, s, n)
        assert all(p.grad is None for p in m.parameters()), "a .grad survived the step"
    if handle is not None:
        handle.remove()
    return m, opt


def reference(full: Callable[..., None]) -> Callable[..., None]:
    def step(m: Sino, opt: torch.optim.Optimizer, s: int, n: int) -> None:
        full(m, *batch(s, n), n)
        opt.step()
        opt.zero_grad()

    return step


def with_acc(m: Sino, opt: torch.optim.Optimizer, s: int, n: int) -> None:
    """Per-iteration backward through LoopAccumulator (acc.step() steps either kind)."""
    x, t = batch(s, n)
    acc = LoopAccumulator(n, opt)
    for i in range(n):
        acc.backward(m.loss_i(x, t, i))
    acc.step()


def with_acc_block(m: Sino, opt: torch.optim.Optimizer, s: int, n: int) -> None:
    """Context-manager form, optimizer not passed: attached ones are found."""
    x, t = batch(s, n)
    with LoopAccumulator(n) as acc:
        for i in range(n):
            acc.backward(m.loss_i(x, t, i))
    opt.step()  # a no-op when attached; the plain torch.optim step otherwise
    opt.zero_grad()


def hand_written_loop(m: Sino, opt: torch.optim.Optimizer, s: int, n: int) -> None:
    """The hand-written loop: plain per-iteration backward, one step."""
    x, t = batch(s, n)
    opt.zero_grad()
    for i in range(n):
        (m.loss_i(x, t, i) / n).backward()
    opt.step()
    opt.zero_grad()


def assert_models_equal(a: nn.Module, b: nn.Module) -> None:
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        assert_same(p.detach(), q.detach(), name)


def assert_models_close(a: nn.Module, b: nn.Module, rtol: float = 1e-6) -> None:
    """Relative error of all parameters together (one tensor may sit near 0)."""
    pa = torch.cat([p.detach().flatten() for p in a.parameters()])
    pb = torch.cat([p.detach().flatten() for p in b.parameters()])
    err = ((pa - pb).norm() / pa.norm()).item()
    assert err <= rtol, f"relative error {err:.2e}"


# --- shape 1: independent iterations ----------------------------------------
DRIVERS = [  # (optimizer config, attached, driver): every config once, both forms per class
    *[(cfg, attached, with_acc) for cfg in OPTIMIZER_CONFIGS for attached in (True, False)],
    *[(cfg, attached, with_acc_block) for cfg in ONE_PER_CLASS for attached in (True, False)],
]


@pytest.mark.parametrize(
    "cfg, attached, driver", DRIVERS,
    ids=[f"{config_id(c)}-{'layeropt' if a else 'torch'}-{d.__name__}" for c, a, d in DRIVERS],
)
def test_independent_n2_equals_full_graph_bitwise(cfg, attached, driver):
    """n=2: a+b == b+a, so the accumulated gradient is the full graph's bit for bit."""
    name, kw = cfg
    ref, ref_opt = train(reference(full_independent), name, kw, 2, attached=False)
    m, opt = train(driver, name, kw, 2, attached=attached)
    assert_models_equal(ref, m)
    assert_same(ref_opt.state_dict(), opt.state_dict())


@pytest.mark.parametrize("attached", [True, False], ids=["layeropt", "torch.optim"])
@pytest.mark.parametrize("cfg", ONE_PER_CLASS, ids=config_id)
def test_independent_n5_equals_hand_written_loop_bitwise_and_full_graph_closely(cfg, attached):
    name, kw = cfg
    ref, _ = train(reference(full_independent), name, kw, 5, attached=False)
    hand, hand_opt = train(hand_written_loop, name, kw, 5, attached=False)
    m, opt = train(with_acc, name, kw, 5, attached=attached)
    assert_models_equal(hand, m)
    assert_same(hand_opt.state_dict(), opt.state_dict())
    assert_models_close(ref, m)


@pytest.mark.parametrize("n", [2, 3, 7])
def test_independent_gradient_is_full_graph_up_to_summation_order(n):
    """The only difference from the full graph is the order of the n-term sum:
    the full graph adds iterations last-to-first, the accumulator first-to-last."""
    x, t = batch(0, n)
    ref, m, single = make(), make(), make()
    torch.manual_seed(1)
    full_loss = sum(ref.loss_i(x, t, i) for i in range(n)) / n
    full_loss.backward()
    torch.manual_seed(1)
    acc = LoopAccumulator(n)
    for i in range(n):
        acc.backward(m.loss_i(x, t, i))
    torch.manual_seed(1)  # each iteration's gradient computed alone (same dropout masks)
    params = list(single.parameters())
    per_iter = [
        torch.autograd.grad(single.loss_i(x, t, i) / n, params, allow_unused=True) for i in range(n)
    ]
    for k, (p, q) in enumerate(zip(ref.parameters(), m.parameters())):
        gs = [g[k] for g in per_iter if g[k] is not None]
        if not gs:
            assert p.grad is None and q.grad is None
            continue
        forward_sum, reverse_sum = gs[0], gs[-1]
        for g in gs[1:]:
            forward_sum = forward_sum + g
        for g in reversed(gs[:-1]):
            reverse_sum = reverse_sum + g
        assert_same(q.grad, forward_sum)
        assert_same(p.grad, reverse_sum)
        magnitude = sum(g.abs() for g in gs).norm()
        assert (p.grad - q.grad).norm() <= 1e-6 * magnitude
    assert acc.loss == pytest.approx(full_loss.item(), rel=1e-6)


def test_attached_steps_once_in_the_last_backward():
    m = make()
    opt = layeropt.Adam(m.parameters(), lr=0.1)
    handle = layeropt.attach(m, opt)
    x, t = batch(0, 4)
    before = [p.detach().clone() for p in m.parameters()]
    acc = LoopAccumulator(4, opt)
    for i in range(3):
        acc.backward(m.loss_i(x, t, i))
        assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))
        assert all(p.grad is not None for p in m.ext.parameters())  # held, accumulating
    acc.backward(m.loss_i(x, t, 3))
    assert opt.stepped_in_backward == len(list(m.ext.parameters())) + 3  # ext, gain, head_i
    assert all(p.grad is None for p in m.parameters())
    assert all(opt.state[p]["step"] == 1 for p in opt.state)
    assert not any(torch.equal(p, b) for p, b in zip(m.ext.parameters(), before))
    handle.remove()


def test_optimizer_whose_params_only_early_iterations_reach():
    """The last loss never reaches ``side``'s parameters, so no hook fires for
    its optimizer in the n-th backward; its held gradient is still stepped."""
    ref, m = make(), make()

    def loss(model: Sino, x: Tensor, t: Tensor, i: int, n: int) -> Tensor:
        extra = model.cell(x[:, i]).square().mean() if i < n - 1 else 0.0
        return model.loss_i(x, t, i) + extra

    def main(model: Sino) -> list[Tensor]:
        return [p for name, p in model.named_parameters() if not name.startswith("cell")]

    ref_opts = [
        torch.optim.Adam(main(ref), lr=0.01),
        torch.optim.SGD(ref.cell.parameters(), lr=0.1, momentum=0.9),
    ]
    opts = [
        layeropt.Adam(main(m), lr=0.01),
        layeropt.SGD(m.cell.parameters(), lr=0.1, momentum=0.9),
    ]
    with layeropt.attach(m, opts):
        for s in range(2):
            x, t = batch(s, 2)
            torch.manual_seed(s)
            (sum(loss(ref, x, t, i, 2) for i in range(2)) / 2).backward()
            for o in ref_opts:
                o.step()
                o.zero_grad()
            torch.manual_seed(s)
            with LoopAccumulator(2) as acc:
                for i in range(2):
                    acc.backward(loss(m, x, t, i, 2))
            assert all(p.grad is None for p in m.parameters())
    assert_models_equal(ref, m)
    for o, r in zip(opts, ref_opts):
        assert_same(r.state_dict(), o.state_dict())


def test_nested_in_outer_no_step_accumulation():
    """Two micro-batches of a 3-iteration loop, the first under opt.no_step():
    one update from all six backwards, as plain torch accumulation gives."""
    ref, m = make(), make()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = layeropt.SGD(m.parameters(), lr=0.1, momentum=0.9)
    handle = layeropt.attach(m, opt)
    for mb in range(2):
        x, t = batch(mb, 3)
        torch.manual_seed(mb)
        for i in range(3):
            (ref.loss_i(x, t, i) / 3).backward()
        torch.manual_seed(mb)
        outer = opt.no_step() if mb == 0 else contextlib.nullcontext()
        with outer, LoopAccumulator(3) as acc:
            for i in range(3):
                acc.backward(m.loss_i(x, t, i))
    ref_opt.step()
    assert_models_equal(ref, m)
    handle.remove()


def test_reduction_sum_and_reuse_across_steps():
    ref, m = make(), make()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01)
    opt = torch.optim.SGD(m.parameters(), lr=0.01)
    acc = LoopAccumulator(3, opt, reduction="sum")
    for s in range(2):
        x, t = batch(s, 3)
        torch.manual_seed(s)
        for i in range(3):
            ref.loss_i(x, t, i).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        torch.manual_seed(s)
        for i in range(3):
            acc.backward(m.loss_i(x, t, i))
        assert acc.done
        acc.step()
        assert acc.count == 0 and not acc.done
    acc.reset()
    assert acc.loss == 0.0
    assert_models_equal(ref, m)


@pytest.mark.parametrize("form", ["with-block", "acc.step"])
@pytest.mark.parametrize("attached", [True, False], ids=["layeropt", "torch.optim"])
def test_loss_readable_after_the_step_equals_the_full_graph_loss(attached, form):
    """``acc.loss`` read after the loop is the step's full-graph loss (the value
    it had at the end of the loop), and the next step's first backward restarts it."""
    n = 4
    ref, m = make(), make()
    opt = (layeropt.Adam if attached else torch.optim.Adam)(m.parameters(), lr=0.1)
    handle = layeropt.attach(m, opt) if attached else None
    acc = LoopAccumulator(n, opt)
    for s in range(2):
        x, t = batch(s, n)
        torch.manual_seed(s)  # same dropout masks, drawn in the same order
        with torch.no_grad():
            expected = (sum(ref.loss_i(x, t, i) for i in range(n)) / n).item()
        torch.manual_seed(s)
        if form == "with-block":
            with acc:
                for i in range(n):
                    acc.backward(m.loss_i(x, t, i))
                inside = acc.loss
        else:
            for i in range(n):
                acc.backward(m.loss_i(x, t, i))
            inside = acc.loss
            acc.step()
        assert acc.loss == inside  # the block's end / step() keeps it exactly
        assert acc.loss == pytest.approx(expected, rel=1e-6)
        assert acc.count == 0
        if s == 0:  # step 1 ran on the same parameters: copy the update for step 2
            ref.load_state_dict(m.state_dict())
            torch.manual_seed(99)
            acc.backward(m.loss_i(x, t, 0))  # a new step's first backward restarts the sum
            with torch.no_grad():
                torch.manual_seed(99)
                first = (ref.loss_i(x, t, 0) / n).item()
            assert acc.loss == pytest.approx(first, rel=1e-6)
            acc.reset()
            opt.zero_grad()
    if handle is not None:
        handle.remove()


def test_misuse_is_a_clear_error():
    m = make()
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    x, t = batch(0, 3)
    acc = LoopAccumulator(2, opt)
    acc.backward(m.loss_i(x, t, 0))
    with pytest.raises(LoopStateError, match="partial gradient"):
        acc.step()
    acc.backward(m.loss_i(x, t, 1))
    with pytest.raises(LoopStateError, match="called 3 times but n=2"):
        acc.backward(m.loss_i(x, t, 2))
    acc.step()
    acc2 = LoopAccumulator(2, opt)
    with pytest.raises(LoopStateError, match="ended after 1 of n=2"), acc2:
        acc2.backward(m.loss_i(x, t, 0))
    assert acc2.count == 0  # reset, reusable
    acc3 = LoopAccumulator(2, opt)
    with pytest.raises(KeyError), acc3:  # the user's exception is not masked
        acc3.backward(m.loss_i(x, t, 0))
        raise KeyError("boom")
    assert acc3.count == 0
    for bad in (0, -1, 2.0, True):
        with pytest.raises(ValueError, match="positive int"):
            LoopAccumulator(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="reduction"):
        LoopAccumulator(2, reduction="avg")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="Optimizer"):
        LoopAccumulator(2, [object()])  # type: ignore[list-item]


# --- shape 1 with global clipping and GradScaler -------------------------------
CLIP_CONFIGS = [("SGD", dict(lr=0.1, momentum=0.9)), ("AdamW", dict(lr=0.01))]
CLIP = 0.05  # below every step's norm here: the clipping is active


def _scaler() -> torch.amp.GradScaler:
    return torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=2)


def _torch_clip_step(ref: Sino, ref_opts: list, losses: Callable[[Sino], list[Tensor]],
                     n: int, clip: float | None, scaler: Any) -> Tensor | None:
    """The hand-written torch loop of docs/loops.md: n backwards of loss_i/n; only when
    clipping, unscale_ and clip_grad_norm_ over model.parameters(); step, zero_grad."""
    for loss in losses(ref):
        loss = loss / n
        (scaler.scale(loss) if scaler else loss).backward()
    for o in ref_opts if scaler and clip else ():  # unscale_ only to clip
        scaler.unscale_(o)
    norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), clip) if clip else None
    for o in ref_opts:
        if scaler:
            scaler.step(o)
        else:
            o.step()
        o.zero_grad()
    if scaler:
        scaler.update()
    return norm


def _iteration_losses(x: Tensor, t: Tensor, n: int) -> Callable[[Sino], list[Tensor]]:
    return lambda model: [model.loss_i(x, t, i) for i in range(n)]


CLIP_CASES = [(cfg, attached, clip, use_scaler, "acc.step")
              for cfg in CLIP_CONFIGS for attached in (True, False)
              for clip in (None, CLIP) for use_scaler in (False, True)]
CLIP_CASES += [(CLIP_CONFIGS[1], attached, CLIP, True, "with-block") for attached in (True, False)]


@pytest.mark.parametrize(
    "cfg, attached, clip, use_scaler, form", CLIP_CASES,
    ids=[f"{c[0]}-{'layeropt' if a else 'torch'}-clip{cl}-{'scaler' if s else 'noscaler'}-{f}"
         for c, a, cl, s, f in CLIP_CASES],
)
def test_clipping_and_scaler_equal_the_hand_written_torch_loop_bitwise(
        cfg, attached, clip, use_scaler, form):
    """``LoopAccumulator(n, max_norm=, scaler=)`` == per-iteration ``scaler.scale(loss_i /
    n).backward()``, ``scaler.unscale_``, ``clip_grad_norm_``, ``scaler.step``,
    ``scaler.update``: parameters, optimizer state, scale and total norm, bit for bit."""
    name, kw = cfg
    n = 3
    ref, m = make(), make()
    ref_opt = getattr(torch.optim, name)(ref.parameters(), **clone_kwargs(kw))
    opt = getattr(layeropt if attached else torch.optim, name)(m.parameters(), **clone_kwargs(kw))
    ref_scaler, scaler = (_scaler(), _scaler()) if use_scaler else (None, None)
    # the with-block form finds attached optimizers itself; plain ones are given
    given = None if form == "with-block" and attached else opt
    acc = LoopAccumulator(n, given, max_norm=clip, scaler=scaler)
    with layeropt.attach(m, opt) if attached else contextlib.nullcontext():
        for s in range(3):
            _clip_step(m, opt, ref, ref_opt, acc, s, n, clip, scaler, ref_scaler, form)
    if scaler:
        assert scaler.get_scale() > 2.0**10  # grew on schedule: no step was skipped
    assert_models_equal(ref, m)
    assert_same(ref_opt.state_dict(), opt.state_dict())


def _clip_step(m: Sino, opt: Any, ref: Sino, ref_opt: Any, acc: LoopAccumulator, s: int,
           n: int, clip: float | None, scaler: Any, ref_scaler: Any, form: str) -> None:
    """One training step of both sides; the same dropout masks for each."""
    x, t = batch(s, n)
    torch.manual_seed(100 + s)
    ref_norm = _torch_clip_step(ref, [ref_opt], _iteration_losses(x, t, n), n, clip,
                                ref_scaler)
    torch.manual_seed(100 + s)
    if form == "acc.step":
        for i in range(n):
            acc.backward(m.loss_i(x, t, i))
        acc.step()
    else:
        with acc:
            for i in range(n):
                acc.backward(m.loss_i(x, t, i))
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    assert all(p.grad is None for p in m.parameters())
    if clip:
        assert torch.equal(acc.grad_norm, ref_norm) and ref_norm > clip
    else:
        assert acc.grad_norm is None
    if scaler:
        assert scaler.get_scale() == ref_scaler.get_scale()


@pytest.mark.parametrize("attached", [True, False], ids=["layeropt", "torch.optim"])
def test_scaler_inf_in_one_iteration_skips_the_step_as_torch(attached):
    """An inf in the first iteration's gradient (held, accumulating): no parameter and
    no optimizer state changes, the scale halves, as torch's recipe."""
    n = 3
    ref, m = make(), make()
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    opt = (layeropt.Adam if attached else torch.optim.Adam)(m.parameters(), lr=0.01)
    ref_scaler, scaler = _scaler(), _scaler()
    acc = LoopAccumulator(n, opt, max_norm=CLIP, scaler=scaler)

    def losses(model: Sino, x: Tensor, t: Tensor, s: int) -> list[Tensor]:
        out = [model.loss_i(x, t, i) for i in range(n)]
        if s == 1:
            out[0] = InfGrad.apply(out[0])
        return out

    with layeropt.attach(m, opt) if attached else contextlib.nullcontext():
        for s in range(3):
            x, t = batch(s, n)
            torch.manual_seed(100 + s)
            _torch_clip_step(ref, [ref_opt], lambda model: losses(model, x, t, s), n, CLIP,
                             ref_scaler)
            torch.manual_seed(100 + s)
            for loss in losses(m, x, t, s):
                acc.backward(loss)
            acc.step()
            assert scaler.get_scale() == ref_scaler.get_scale()
            if s == 1:
                assert scaler.get_scale() == 2.0**9
    assert_models_equal(ref, m)
    assert_same(ref_opt.state_dict(), opt.state_dict())


@pytest.mark.parametrize("use_scaler", [False, True], ids=["noscaler", "scaler"])
def test_clipping_nested_in_outer_no_step_clips_the_whole_sum(use_scaler):
    """Two micro-batches of a 3-iteration loop, the first under opt.no_step(): the first
    accumulator keeps accumulating (scaled, unclipped); the second clips all six."""
    ref, m = make(), make()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = layeropt.SGD(m.parameters(), lr=0.1, momentum=0.9)
    ref_scaler, scaler = (_scaler(), _scaler()) if use_scaler else (None, None)
    with layeropt.attach(m, opt):
        for step in range(2):
            for mb in range(2):
                x, t = batch(10 * step + mb, 3)
                torch.manual_seed(mb)
                for i in range(3):
                    loss = ref.loss_i(x, t, i) / 2 / 3  # as the accumulator: (loss / 2) / n
                    (ref_scaler.scale(loss) if use_scaler else loss).backward()
                torch.manual_seed(mb)
                outer = opt.no_step() if mb == 0 else contextlib.nullcontext()
                with outer, LoopAccumulator(3, max_norm=CLIP, scaler=scaler) as acc:
                    for i in range(3):
                        acc.backward(m.loss_i(x, t, i) / 2)
                assert (acc.grad_norm is None) == (mb == 0)
            if use_scaler:
                ref_scaler.unscale_(ref_opt)
            ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
            assert torch.equal(acc.grad_norm, ref_norm)
            for o, sc in ((ref_opt, ref_scaler), (opt, scaler)):
                if use_scaler:
                    sc.step(o)
                    sc.update()
                else:
                    o.step()
                o.zero_grad()
    assert_models_equal(ref, m)
    assert_same(ref_opt.state_dict(), opt.state_dict())


def _early_extra_loss(model: Sino, x: Tensor, t: Tensor, i: int, n: int) -> Tensor:
    """``cell`` is reached by every iteration but the last."""
    extra = model.cell(x[:, i]).square().mean() if i < n - 1 else 0.0
    return model.loss_i(x, t, i) + extra


def _main_params(model: Sino) -> list[Tensor]:
    return [p for name, p in model.named_parameters() if not name.startswith("cell")]


def _early_extra_windows(ref: Sino, ref_opts: list, m: Sino, acc: LoopAccumulator, n: int,
                         clip: float | None, ref_scaler: Any) -> list[Tensor | None]:
    """Two windows of ``_early_extra_loss``: torch's clipped step on ``ref``, the
    accumulator's on ``m``; returns torch's norms."""
    norms = []
    for s in range(2):
        x, t = batch(s, n)
        torch.manual_seed(s)
        norms.append(_torch_clip_step(
            ref, ref_opts, lambda model: [_early_extra_loss(model, x, t, i, n)
                                          for i in range(n)], n, clip, ref_scaler))
        torch.manual_seed(s)
        for i in range(n):
            acc.backward(_early_extra_loss(m, x, t, i, n))
        acc.step()
        if clip is not None:
            assert torch.equal(acc.grad_norm, norms[-1])
        else:
            assert acc.grad_norm is None
        assert all(p.grad is None for p in m.parameters())  # stepped and freed
    return norms


@pytest.mark.parametrize("use_scaler", [False, True], ids=["noscaler", "scaler"])
def test_clipping_with_parameters_only_early_iterations_reach(use_scaler):
    """Two attached optimizers, ``cell``'s reached only before the last iteration: its
    held gradient is measured, unscaled and clipped with the rest, then stepped."""
    n = 3
    ref, m = make(), make()
    ref_opts = [torch.optim.Adam(_main_params(ref), lr=0.01),
                torch.optim.SGD(ref.cell.parameters(), lr=0.1, momentum=0.9)]
    opts = [layeropt.Adam(_main_params(m), lr=0.01),
            layeropt.SGD(m.cell.parameters(), lr=0.1, momentum=0.9)]
    ref_scaler, scaler = (_scaler(), _scaler()) if use_scaler else (None, None)
    acc = LoopAccumulator(n, opts, max_norm=CLIP, scaler=scaler)
    with layeropt.attach(m, opts):
        _early_extra_windows(ref, ref_opts, m, acc, n, CLIP, ref_scaler)
    assert_models_equal(ref, m)
    for o, r in zip(opts, ref_opts):
        assert_same(r.state_dict(), o.state_dict())


def _gan_generator_loop(lo: bool, given: bool) -> list[Tensor]:
    """A GAN whose generator's two-sample loss runs through a clipping accumulator while
    the discriminator is held (``optD.no_step()``); torch's loop clips G's gradients."""
    torch.manual_seed(0)
    G, D = nn.Linear(2, 3), nn.Linear(3, 1)
    lib = layeropt if lo else torch.optim
    optG, optD = lib.Adam(G.parameters(), lr=1e-2), lib.Adam(D.parameters(), lr=1e-2)
    handles = [layeropt.attach(G, optG), layeropt.attach(D, optD)] if lo else []
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        real, z = torch.randn(4, 3, generator=gen), torch.randn(2, 4, 2, generator=gen)
        optD.zero_grad()
        (F.softplus(-D(real)) + F.softplus(D(G(z[0]).detach()))).mean().backward()
        optD.step()
        optG.zero_grad()
        if lo:
            with optD.no_step(), LoopAccumulator(2, optG if given else None,
                                                 max_norm=0.01) as acc:
                for i in range(2):
                    acc.backward(F.softplus(-D(G(z[i]))).mean() * 50)
        else:
            for i in range(2):
                (F.softplus(-D(G(z[i]))).mean() * 50 / 2).backward()
            torch.nn.utils.clip_grad_norm_(G.parameters(), 0.01)
        optG.step()
    for h in handles:
        h.remove()
    return [*G.parameters(), *D.parameters()]


@pytest.mark.parametrize("given", [True, False], ids=["optG given", "default"])
def test_a_gan_generators_accumulator_clips_it_while_the_discriminator_is_held(given):
    """Another attached optimizer inside its ``no_step()`` (a GAN's D during G's loss) is
    left out of the accumulator's clip: before 2026-12-07 the accumulator took it for an
    outer accumulation of its own and stepped G unclipped."""
    for p, q in zip(_gan_generator_loop(True, given), _gan_generator_loop(False, given)):
        assert_same(p.detach(), q.detach())


@pytest.mark.parametrize("clip, use_scaler", [(CLIP, False), (None, True)],
                         ids=["clip", "scaler"])
def test_clipping_with_an_attached_and_a_plain_optimizer(clip, use_scaler):
    """An attached layeropt optimizer for most of the model and a plain torch.optim one
    for ``cell`` (given to the accumulator): one global norm over model.parameters(),
    each optimizer's gradient unscaled, as torch's recipe."""
    n = 3
    ref, m = make(), make()
    ref_opts = [torch.optim.Adam(_main_params(ref), lr=0.01),
                torch.optim.SGD(ref.cell.parameters(), lr=0.1, momentum=0.9)]
    lo = layeropt.Adam(_main_params(m), lr=0.01)
    plain = torch.optim.SGD(m.cell.parameters(), lr=0.1, momentum=0.9)
    ref_scaler, scaler = (_scaler(), _scaler()) if use_scaler else (None, None)
    acc = LoopAccumulator(n, [lo, plain], max_norm=clip, scaler=scaler)
    with layeropt.attach(m, lo):
        _early_extra_windows(ref, ref_opts, m, acc, n, clip, ref_scaler)
        # both: the plain optimizer's gradient would have to be unscaled before the norm
        both = LoopAccumulator(n, [lo, plain], max_norm=CLIP, scaler=_scaler())
        x, t = batch(5, n)
        before = [p.detach().clone() for p in m.parameters()]
        for i in range(n - 1):
            both.backward(_early_extra_loss(m, x, t, i, n))
        with pytest.raises(layeropt.LayeroptError, match="not owned by the layeropt optimizers"):
            both.backward(_early_extra_loss(m, x, t, n - 1, n))
        assert all(torch.equal(p, b) for p, b in zip(m.parameters(), before))
    assert_models_equal(ref, m)
    for o, r in zip([lo, plain], ref_opts):
        assert_same(r.state_dict(), o.state_dict())


FUSED_CASES = [(fused, clip) for fused in (True, False) for clip in (None, CLIP)]


@pytest.mark.parametrize("fused, clip", FUSED_CASES,
                         ids=[f"{'fused' if f else 'foreach'}-clip{c}" for f, c in FUSED_CASES])
def test_scaler_not_a_power_of_two_attached_plain_and_torch_loop_bitwise(fused, clip):
    """GradScaler(init_scale=1000.0): the fused kernel's divide by the scale differs from
    unscale_'s multiply by its inverse in the last bits. Attached, plain and the docs'
    torch loop (unscale_ only when clipping) agree bit for bit: parameters, optimizer
    state, scaler state, norm."""
    n = 3
    ref, m_lo, m_plain = make(), make(), make()
    kw = dict(lr=0.01, fused=fused, foreach=None if fused else True)
    ref_opt = torch.optim.Adam(ref.parameters(), **kw)
    lo = layeropt.Adam(m_lo.parameters(), **kw)
    plain = torch.optim.Adam(m_plain.parameters(), **kw)
    scalers = [torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=2)
               for _ in range(3)]
    accs = [LoopAccumulator(n, opt, max_norm=clip, scaler=sc)
            for opt, sc in ((lo, scalers[1]), (plain, scalers[2]))]
    for s in range(3):
        x, t = batch(s, n)
        torch.manual_seed(100 + s)
        ref_norm = _torch_clip_step(ref, [ref_opt], _iteration_losses(x, t, n), n, clip,
                                    scalers[0])
        for m, acc in zip((m_lo, m_plain), accs):
            # attached only for its own side (the plain side's accumulator would take it)
            with layeropt.attach(m, lo) if m is m_lo else contextlib.nullcontext():
                torch.manual_seed(100 + s)
                for i in range(n):
                    acc.backward(m.loss_i(x, t, i))
                acc.step()
            assert all(p.grad is None for p in m.parameters())
            if clip:
                assert torch.equal(acc.grad_norm, ref_norm) and ref_norm > clip
            else:
                assert acc.grad_norm is None
    assert scalers[0].get_scale() == 2000.0  # grew once on schedule: no step skipped
    for m, opt, sc in ((m_lo, lo, scalers[1]), (m_plain, plain, scalers[2])):
        assert_models_equal(ref, m)
        assert_same(ref_opt.state_dict(), opt.state_dict())
        assert_same(scalers[0].state_dict(), sc.state_dict())


def test_clipping_misuse_is_a_clear_error():
    m = make()
    x, t = batch(0, 2)
    with pytest.raises(LoopStateError, match="no optimizer and no parameters"):
        LoopAccumulator(2, max_norm=1.0).backward(m.loss_i(x, t, 0))
    with pytest.raises(LoopStateError, match="scaler=.*found no optimizer"):
        LoopAccumulator(2, scaler=_scaler()).backward(m.loss_i(x, t, 0))
    assert all(p.grad is None for p in m.parameters())  # refused before any backward
    for bad in (-1.0, True):
        with pytest.raises(ValueError, match="max_norm"):
            LoopAccumulator(2, max_norm=bad)
    # parameters= without an optimizer: clipped, the step is the caller's
    ref = make()
    acc = LoopAccumulator(2, max_norm=CLIP, parameters=m.parameters())
    for i in range(2):
        torch.manual_seed(i)
        (ref.loss_i(x, t, i) / 2).backward()
        torch.manual_seed(i)
        acc.backward(m.loss_i(x, t, i))
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), CLIP)
    assert torch.equal(acc.grad_norm, ref_norm)
    for p, q in zip(ref.parameters(), m.parameters()):
        assert (p.grad is None and q.grad is None) or torch.equal(p.grad, q.grad)


# --- shapes 2 and 3: stacked outputs, recurrent loops ---------------------------
SHAPES = [
    ("stack", full_stack, lo_stack),
    ("recurrent-every1", full_recurrent, lo_recurrent(1)),
    ("recurrent-every3", full_recurrent, lo_recurrent(3)),
]


@pytest.mark.parametrize("attached", [True, False], ids=["layeropt", "torch.optim"])
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
@pytest.mark.parametrize("cfg", ONE_PER_CLASS, ids=config_id)
def test_stack_and_recurrent_equal_full_graph_bitwise(cfg, shape, attached):
    """Recompute replays dropout; the backward is the full graph's node for node."""
    name, kw = cfg
    _, full, mine = shape
    ref, ref_opt = train(reference(full), name, kw, 7, attached=False)
    m, opt = train(reference(mine), name, kw, 7, attached=attached)
    assert_models_equal(ref, m)
    assert_same(ref_opt.state_dict(), opt.state_dict())
    # gain is shared by every iteration and the head: stepped once per training step
    steps = {int(st["step"]) for st in opt.state.values() if "step" in st}
    assert steps <= {0, 3}  # 0: Adagrad's eager state of params that get no gradient
    if "step" in opt.state.get(m.gain, {}):
        assert int(opt.state[m.gain]["step"]) == 3


@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_each_parameter_stepped_once_per_backward(shape):
    m = make()
    opt = layeropt.SGD(m.parameters(), lr=0.1)
    calls: list[int] = []
    original = opt._lo_stepper  # every update's call of torch's step (engine/subset.py)
    opt._lo_stepper = lambda o, params, key: (calls.extend(id(p) for p in params),
                                              original(o, params, key))[1]
    with layeropt.attach(m, opt):
        shape[2](m, *batch(0, 6), 6)
    ref = make()
    shape[1](ref, *batch(0, 6), 6)
    expected = sorted(id(p) for p, q in zip(m.parameters(), ref.parameters()) if q.grad is not None)
    assert sorted(calls) == expected and len(expected) >= 3


def test_stack_matches_torch_stack_values_and_no_grad():
    m = make().eval()
    x, _ = batch(0, 5)
    want = torch.stack([m.feat(x, i) for i in range(0, 5, 2)], -2)
    for recompute in (True, False):
        got = loop_stack(lambda i: m.feat(x, i), range(0, 5, 2), -2, recompute=recompute)
        assert_same(got, want)
    with torch.no_grad():
        got = loop_stack(lambda i: m.feat(x, i), range(0, 5, 2), -2)
    assert_same(got, want.detach())
    assert not got.requires_grad


def test_recurrent_tuple_state_and_inputs_needing_grad():
    cell = nn.Linear(4, 4)
    x0 = torch.randn(5, 2, 4, requires_grad=True)  # inputs on the graph get their gradient too
    c0 = torch.randn(2, 4, requires_grad=True)

    def step(state: tuple[Tensor, Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
        h, c = state
        c = c + torch.tanh(cell(h) + x)
        return torch.sigmoid(c), c

    def grads(run: Callable[[], tuple[Tensor, Tensor]]) -> list[Tensor]:
        h, c = run()
        (h.sum() + c.square().sum()).backward()
        out = [t.grad.clone() for t in (x0, c0, cell.weight, cell.bias)]
        for t in (x0, c0, cell.weight, cell.bias):
            t.grad = None
        return out

    def plain() -> tuple[Tensor, Tensor]:
        s = (torch.zeros(2, 4), c0)
        for x in x0.unbind(0):
            s = step(s, x)
        return s

    want = grads(plain)
    for every in (1, 2, 5, 9):
        state = (torch.zeros(2, 4), c0)
        got = grads(lambda k=every, s=state: loop_recurrent(step, s, x0.unbind(0), every=k))
        for a, b in zip(got, want):
            assert_same(a, b)
    h = torch.zeros(2, 4)
    assert loop_recurrent(step, (h, c0), 0)[0] is h  # no iterations: the state itself


def test_stack_and_recurrent_argument_errors():
    def f(i: int) -> Tensor:
        return torch.ones(2)

    with pytest.raises(ValueError, match="empty"):
        loop_stack(f, [])
    with pytest.raises(ValueError, match="out of range"):
        loop_stack(f, 3, dim=2)
    with pytest.raises(ValueError, match="iteration 1 returned shape"):
        loop_stack(lambda i: torch.ones(i + 1), 2)
    with pytest.raises(TypeError, match="must return a Tensor"):
        loop_stack(lambda i: [i], 2)
    with pytest.raises(ValueError, match=">= 0"):
        loop_stack(f, -1)
    with pytest.raises(ValueError, match="every must be a positive int"):
        loop_recurrent(lambda h, x: h, torch.ones(1), 3, every=0)
    with pytest.raises(TypeError, match="state must be"):
        loop_recurrent(lambda h, x: h, [1.0], 3)
    with pytest.raises(TypeError, match="fn returned tuple"):
        loop_recurrent(lambda h, x: (h,), torch.ones(1), 3)
    with pytest.raises(TypeError, match="same length"):
        loop_recurrent(lambda s, x: s[0], (torch.ones(1), torch.ones(1)), 3)


# --- memory, in bytes ----------------------------------------------------------
MB, ML, MC = 2, 512, 16  # big enough that activations, not bookkeeping, dominate
RNG_BYTES = torch.get_rng_state().numel()  # checkpoint keeps one CPU RNG state per call


def _mem_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({
        "ext": nn.Sequential(
            nn.Conv1d(1, MC, 5, padding=2), nn.GELU(), nn.Conv1d(MC, MC, 5, padding=2),
            nn.GELU(), nn.Conv1d(MC, 2, 5, padding=2),
        ),
        "head": nn.Linear(2 * ML, 1),
        "cell": nn.Sequential(nn.Linear(32, 4096), nn.GELU(), nn.Linear(4096, 32)),
    })


Thunk = Callable[[], None]


def _peak(case: Callable[[nn.Module, int], Thunk], n: int, attached: bool = False) -> int:
    """Peak bytes of one training step; the model and the input data exist before."""
    m = _mem_model()
    opt = (layeropt.SGD if attached else torch.optim.SGD)(m.parameters(), lr=0.01)
    handle = layeropt.attach(m, opt) if attached else None
    run = case(m, n)
    with PeakMemory() as mem:
        run()
        opt.step()
        opt.zero_grad()
    if handle is not None:
        handle.remove()
    return mem.peak


def _indep(acc: bool) -> Callable[[nn.Module, int], Thunk]:
    def case(m: nn.Module, n: int) -> Thunk:
        x, t = torch.randn(MB, n, ML), torch.randn(MB, n)
        def loss_i(i: int) -> Tensor:
            return F.mse_loss(m.head(m.ext(x[:, i : i + 1]).flatten(1)).squeeze(1), t[:, i])

        def run() -> None:
            if acc:
                a = LoopAccumulator(n)
                for i in range(n):
                    a.backward(loss_i(i))
            else:
                (sum(loss_i(i) for i in range(n)) / n).backward()

        return run

    return case


def _stacked(mine: bool) -> Callable[[nn.Module, int], Thunk]:
    def case(m: nn.Module, n: int) -> Thunk:
        x = torch.randn(MB, n, ML)
        def f(i: int) -> Tensor:
            return m.ext(x[:, i : i + 1])

        def run() -> None:
            s = loop_stack(f, n, 1) if mine else torch.stack([f(i) for i in range(n)], 1)
            loss = m.head(s.flatten(2)).square().mean()
            del s
            loss.backward()

        return run

    return case


def _recurrent(mine: bool) -> Callable[[nn.Module, int], Thunk]:
    def case(m: nn.Module, n: int) -> Thunk:
        xs = torch.randn(n, 16, 32)
        def f(h: Tensor, x: Tensor) -> Tensor:
            return torch.tanh(m.cell(h) + x)

        def run() -> None:
            h = torch.zeros(16, 32)
            if mine:
                h = loop_recurrent(f, h, xs.unbind(0))
            else:
                for x in xs.unbind(0):
                    h = f(h, x)
            h.square().sum().backward()

        return run

    return case


STACK_ITER_BYTES = MB * 2 * ML * 4  # one iteration's slice of the stack
STATE_BYTES = 16 * 32 * 4
NS = (4, 8, 16, 32)
MEMORY_CASES = [  # name, naive, layeropt mode, bytes each extra iteration may add
    ("independent", _indep(False), _indep(True), 0),
    ("stacked", _stacked(False), _stacked(True), 2 * STACK_ITER_BYTES + RNG_BYTES),
    ("recurrent", _recurrent(False), _recurrent(True), STATE_BYTES + RNG_BYTES),
]


@pytest.mark.parametrize("attached", [False, True], ids=["torch.optim", "layeropt"])
@pytest.mark.parametrize("case", MEMORY_CASES, ids=[c[0] for c in MEMORY_CASES])
def test_memory_is_one_iteration_not_n(case, attached):
    name, naive, mine, per_iter = case
    naive_peaks = [_peak(naive, n, attached) for n in NS]
    slopes = [(b - a) / (nb - na) for a, b, na, nb in zip(naive_peaks, naive_peaks[1:], NS, NS[1:])]
    # the plain loop grows linearly: (nearly) the same bytes for every extra iteration
    assert max(slopes) - min(slopes) <= 0.05 * min(slopes), naive_peaks
    p4, p32 = _peak(mine, 4, attached), _peak(mine, 32, attached)
    assert p32 - p4 <= 28 * per_iter, (name, p4, p32)  # only the stack / carried state
    assert p32 <= 1.10 * p4 or name == "stacked", (p4, p32)
    assert p32 < naive_peaks[-1] / 3
    assert min(slopes) > 4 * max(per_iter, 1)  # each naive iteration keeps far more


def test_stack_forward_holds_the_stack_and_one_iteration():
    """What stays after forward is exactly the stack plus one RNG state per
    iteration; on top of it, forward never holds more than one iteration's
    activations, at any n (``torch.stack`` of the outputs would hold two stacks)."""
    m = _mem_model()
    transient = []
    for n in (4, 32):
        x = torch.randn(MB, n, ML)
        with PeakMemory() as mem:
            s = loop_stack(lambda i, x=x: m.ext(x[:, i : i + 1]), n, 1)
        assert s.requires_grad and mem.end == n * (STACK_ITER_BYTES + RNG_BYTES)
        transient.append(mem.peak - mem.end)
        del s
    assert transient[0] == transient[1] > 0


# --- preserve_rng_state=False (docs/loops.md, loop_stack) -----------------------
def lo_stack_no_rng(m: Sino, x: Tensor, t: Tensor, n: int) -> None:
    stack = loop_stack(lambda i: m.feat(x, i), n, dim=1, preserve_rng_state=False)
    m.stack_loss(stack, t).backward()


def lo_recurrent_no_rng(every: int) -> Callable[..., None]:
    def run(m: Sino, x: Tensor, t: Tensor, n: int) -> None:
        h0 = torch.zeros(B, SAMPLES, device=x.device)
        h = loop_recurrent(m.step, h0, x.unbind(1), every=every, preserve_rng_state=False)
        F.mse_loss(h.sum(1), t[:, 0]).backward()

    return run


def in_eval(step: Callable[..., None]) -> Callable[..., None]:
    """The step with the model in eval mode: its dropout draws no random numbers."""
    def run(m: Sino, opt: torch.optim.Optimizer, s: int, n: int) -> None:
        m.eval()
        step(m, opt, s, n)

    return run


NO_RNG_SHAPES = [
    ("stack", full_stack, lo_stack_no_rng),
    ("recurrent-every1", full_recurrent, lo_recurrent_no_rng(1)),
    ("recurrent-every3", full_recurrent, lo_recurrent_no_rng(3)),
]


@pytest.mark.parametrize("attached", [True, False], ids=["layeropt", "torch.optim"])
@pytest.mark.parametrize("shape", NO_RNG_SHAPES, ids=[s[0] for s in NO_RNG_SHAPES])
@pytest.mark.parametrize("cfg", [("SGD", dict(lr=0.1, momentum=0.9)), ("Adam", dict(lr=0.01))],
                         ids=config_id)
def test_without_rng_state_equals_the_plain_loop_when_fn_draws_no_random_numbers(
        cfg, shape, attached):
    """docs/loops.md: ``preserve_rng_state=False`` is for an ``fn`` that draws no random
    numbers (the model in eval mode: its dropout is off); then the recomputation needs
    no RNG state and training equals the plain loop with torch.optim bit for bit."""
    name, kw = cfg
    _, full, mine = shape
    ref, ref_opt = train(in_eval(reference(full)), name, kw, 7, attached=False)
    m, opt = train(in_eval(reference(mine)), name, kw, 7, attached=attached)
    assert_models_equal(ref, m)
    assert_same(ref_opt.state_dict(), opt.state_dict())


@pytest.mark.parametrize("shape", NO_RNG_SHAPES, ids=[s[0] for s in NO_RNG_SHAPES])
def test_without_rng_state_dropout_is_not_replayed(shape):
    """Why the docs say "when ``fn`` draws no random numbers": with dropout on (train
    mode) the recomputation draws fresh masks, and the result leaves the plain loop's
    (with the default ``preserve_rng_state=True`` it is equal:
    test_stack_and_recurrent_equal_full_graph_bitwise)."""
    _, full, mine = shape
    ref, _ = train(reference(full), "SGD", dict(lr=0.1), 7, attached=False)
    m, _ = train(reference(mine), "SGD", dict(lr=0.1), 7, attached=True)
    assert any(not torch.equal(p, q) for p, q in zip(ref.parameters(), m.parameters()))


@pytest.mark.parametrize("preserve", [True, False])
def test_without_rng_state_the_stack_holds_no_rng_state(preserve):
    """docs/loops.md: ``preserve_rng_state=False`` saves the CPU RNG state (5 KiB) each
    iteration keeps: what stays after forward is the stack alone."""
    assert 4096 < RNG_BYTES < 6144  # "5 KiB"
    m = _mem_model()
    for n in (4, 32):
        x = torch.randn(MB, n, ML)
        with PeakMemory() as mem:
            s = loop_stack(lambda i, x=x: m.ext(x[:, i : i + 1]), n, 1,
                           preserve_rng_state=preserve)
        assert s.requires_grad
        assert mem.end == n * (STACK_ITER_BYTES + (RNG_BYTES if preserve else 0))
        del s


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("shape", SHAPES, ids=[s[0] for s in SHAPES])
def test_cuda_dropout_replay_with_int_inputs(shape):
    """On CUDA, checkpoint replays only the RNG of its tensor arguments' devices;
    the loop body here gets an int and closes over CUDA tensors, so layeropt
    passes anchors itself. Without them, dropout masks differ in recompute."""
    _, full, mine = shape
    x, t = (a.cuda() for a in batch(0, 6))
    saved = torch.backends.cudnn.deterministic
    torch.backends.cudnn.deterministic = True
    try:
        grads = []
        for run in (full, mine):
            m = make().cuda()
            torch.manual_seed(7)
            run(m, x, t, 6)
            grads.append([p.grad for p in m.parameters()])
    finally:
        torch.backends.cudnn.deterministic = saved
    for a, b in zip(*grads):
        assert (a is None) == (b is None)
        if a is not None:
            assert_same(a, b)


def test_a_tensor_every_iteration_reads_from_before_the_loop_is_a_clear_error():
    """An encoder's output computed once before the loop: the second backward finds its
    graph freed. The error says why and what to do (it was torch's "retain_graph=True",
    which acc.backward does not take)."""
    enc, head = nn.Linear(4, 4), nn.Linear(4, 1)
    opt = torch.optim.SGD([*enc.parameters(), *head.parameters()], lr=0.1)
    z = enc(torch.randn(2, 4))
    acc = LoopAccumulator(3, optimizer=opt)
    acc.backward(head(z).sum())
    with pytest.raises(LoopStateError, match="iteration 2 reaches a part of the graph"):
        acc.backward(head(2 * z).sum())
