"""Gradient accumulation with ``no_step()``: k micro-batches == one torch step."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch

import layeropt
from harness import OPTIMIZER_CONFIGS, assert_models_equal, assert_same, config_id, torch_class
from layeropt.models import make_model

CONFIGS = [c for c in OPTIMIZER_CONFIGS if "fused" not in c[1]][::2]


def _micro(batch, k):
    if isinstance(batch, tuple):
        return list(zip(*(t.chunk(k) for t in batch)))
    return list(batch.chunk(k))


@pytest.mark.parametrize("model_name", ["mlp", "gpt", "frozen"])
@pytest.mark.parametrize("cfg", CONFIGS, ids=config_id)
def test_no_step_equals_torch_accumulation(cfg, model_name):
    opt_name, kw = cfg
    model, batch_fn, loss_fn = make_model(model_name)
    ref = copy.deepcopy(model)
    ref_opt = torch_class(opt_name)(ref.parameters(), **kw)
    opt = getattr(layeropt, opt_name)(model.parameters(), **kw)
    layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(3)
    k = 2
    for _ in range(3):
        micro = _micro(batch_fn(gen), k)
        for mb in micro:
            (loss_fn(ref, mb) / k).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for i, mb in enumerate(micro):
            if i < k - 1:
                with opt.no_step():
                    (loss_fn(model, mb) / k).backward()
                assert any(p.grad is not None for p in model.parameters())
            else:
                (loss_fn(model, mb) / k).backward()
        assert all(p.grad is None for p in model.parameters())
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


def test_accumulation_close_to_big_batch():
    """k micro-batches of size b approximate one step on k*b (reassociated sums)."""
    model, batch_fn, loss_fn = make_model("mlp")
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    layeropt.attach(model, opt)
    x, y = batch_fn(torch.Generator().manual_seed(0))
    loss_fn(ref, (x, y)).backward()
    ref_opt.step()
    with opt.no_step():
        (loss_fn(model, (x[:2], y[:2])) / 2).backward()
    (loss_fn(model, (x[2:], y[2:])) / 2).backward()
    for p, q in zip(ref.parameters(), model.parameters()):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)


def test_step_after_no_step_backwards_steps_held_gradients():
    """Ending accumulation with opt.step() (no final attached backward) works too."""
    model, batch_fn, loss_fn = make_model("mlp")
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    opt = layeropt.Adam(model.parameters(), lr=0.01)
    layeropt.attach(model, opt)
    data = batch_fn(torch.Generator().manual_seed(0))
    for _ in range(2):
        loss_fn(ref, data).backward()
        with opt.no_step():
            loss_fn(model, data).backward()
    ref_opt.step()
    opt.step()
    assert all(p.grad is None for p in model.parameters())
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


@pytest.mark.parametrize("held", ["no_step", "retain_graph"])
def test_held_backward_after_a_stepping_one_is_refused(held):
    """Stepping first, holding second (the wrong way round): torch sums both into one step,
    layeropt had applied the first as a step of its own and held the second for step()
    (3 Adam steps where torch has 2). Refused before anything of the second applies: at
    its forward, which would read the weights the first updated (checking/forwards.py;
    the refusal at its backward, "held for step", where no forward is watched: several
    processes, tests/test_distributed.py)."""
    model, batch_fn, loss_fn = make_model("mlp")
    opt = layeropt.Adam(model.parameters(), lr=0.01)
    layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(0)
    loss_fn(model, batch_fn(gen)).backward()
    opt.step()  # (a loop that calls step(): its steps are known)
    opt.zero_grad()
    loss_fn(model, batch_fn(gen)).backward()  # applied at once
    after_first = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(layeropt.BackwardStateError, match="Nothing of this forward ran.*"
                       "every micro-batch but the last"):
        if held == "no_step":
            with opt.no_step():
                loss_fn(model, batch_fn(gen)).backward()
        else:
            loss_fn(model, batch_fn(gen)).backward(retain_graph=True)
    assert all(torch.equal(a, p) for a, p in zip(after_first, model.parameters()))


class _Functional(torch.nn.Module):
    """Its layer's weight read through ``F.linear``: no module's forward holds it, so the
    forward watch (checking/forwards.py) does not see the read."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(4, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.layer.weight, self.layer.bias)


def test_held_backward_after_a_stepping_one_is_refused_at_it_where_no_forward_is_seen():
    """The same wrong order where the forward reads the weights functionally: refused at
    the held backward, before anything of it applies."""
    torch.manual_seed(0)
    model = _Functional()
    opt = layeropt.Adam(model.parameters(), lr=0.01)
    layeropt.attach(model, opt)
    x = torch.randn(3, 4)
    model(x).sum().backward()
    opt.step()
    opt.zero_grad()
    model(x).sum().backward()  # applied at once
    after_first = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(layeropt.BackwardStateError, match="held for step"):
        with opt.no_step():
            model(x).sum().backward()
    assert all(torch.equal(a, p) for a, p in zip(after_first, model.parameters()))


@pytest.mark.parametrize("end", ["step", "zero_grad"])
@pytest.mark.parametrize("held", ["no_step", "retain_graph"])
def test_held_backward_after_a_stepping_one_before_the_first_step_is_refused(held, end):
    """The same order in a loop that has not called step() or zero_grad() yet: its held
    backward may still be a step-less loop's accumulation (the next stepping backward
    applies it), so the step() ending both is refused, before it applies anything (the
    fuzzer's seed 36: the held gradients were applied as a second step). A zero_grad()
    there may be a step-less loop's discard of the held ones (LoopAccumulator's block
    form): said at the loop's first step(), if one comes (torch dropped both)."""
    model, batch_fn, loss_fn = make_model("mlp")
    opt = layeropt.Adam(model.parameters(), lr=0.01)
    layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(0)
    loss_fn(model, batch_fn(gen)).backward()  # applied at once
    if held == "no_step":
        with opt.no_step():
            loss_fn(model, batch_fn(gen)).backward()
    else:
        loss_fn(model, batch_fn(gen)).backward(retain_graph=True)
    after_first = [p.detach().clone() for p in model.parameters()]
    state = copy.deepcopy(opt.state_dict())
    if end == "zero_grad":
        opt.zero_grad()
    with pytest.raises(layeropt.BackwardStateError,
                       match="ends 2 backwards, 1 of which" if end == "step" else "first step"):
        opt.step()
    assert all(torch.equal(a, p) for a, p in zip(after_first, model.parameters()))
    assert_same(state, opt.state_dict())


@pytest.mark.parametrize("attached, trips", [(True, "step"), (False, "step"), (True, "backward")],
                         ids=["attached", "removed", "in-a-backward"])
def test_a_first_step_refused_for_a_discard_says_so_where_torchs_step_trips(attached, trips):
    """A discard before the loop's first step() is said at that step(). If that step
    raises on the way - RMSprop's momentum set above 0 since the discarded backward's
    update made momentum-less state, which torch's never made - the refusal is raised
    (from torch's KeyError), not the KeyError alone (loopfuzz with per-group options:
    a crash before). The same where a stepping backward trips first, before any step():
    said there, from the KeyError (loopfuzz ``all`` seeds 562,890 and 564,886: a
    crash before)."""
    model, batch_fn, loss_fn = make_model("mlp")
    opt = layeropt.RMSprop(model.parameters(), lr=0.01, momentum=0.0)
    handle = layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(0)
    loss_fn(model, batch_fn(gen)).backward()  # applied at once, then discarded
    opt.zero_grad()
    opt.param_groups[0]["momentum"] = 0.9
    try:
        with pytest.raises(layeropt.BackwardStateError,
                           match="first step.*raised KeyError" if trips == "step" else
                           "backward's update raised KeyError") as info:
            with opt.no_step() if trips == "step" else contextlib.nullcontext():
                loss_fn(model, batch_fn(gen)).backward()
            if not attached:
                handle.remove()
            opt.step()
        assert isinstance(info.value.__cause__, KeyError)
    finally:  # (its held gradients must not reach a later test's layeropt.backward)
        handle.remove()
        opt.zero_grad()


def test_param_with_grad_only_in_early_micro_batch_is_stepped():
    """A held gradient whose parameter gets no gradient in the last backward."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)
    model = torch.nn.ModuleDict({"a": a, "b": b})
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    opt = layeropt.SGD(model.parameters(), lr=0.1, momentum=0.9)
    layeropt.attach(model, opt)
    ref["a"](x).sum().backward()
    ref["b"](x).sum().backward()
    ref_opt.step()
    with opt.no_step():
        model["a"](x).sum().backward()
    model["b"](x).sum().backward()
    assert all(p.grad is None for p in model.parameters())
    assert_models_equal(ref, model)


def test_zero_grad_drops_held_gradients():
    model, batch_fn, loss_fn = make_model("mlp")
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    layeropt.attach(model, opt)
    before = [p.detach().clone() for p in model.parameters()]
    with opt.no_step():
        loss_fn(model, batch_fn(torch.Generator().manual_seed(0))).backward()
    opt.zero_grad()
    opt.step()
    for p, q in zip(before, model.parameters()):
        assert torch.equal(p, q)


@pytest.mark.parametrize("zero", ["optimizer", "model"])
def test_held_backward_onto_gradients_not_zeroed_then_kept_as_zeros(zero):
    """``step()`` with no ``zero_grad()`` after it, a ``no_step()`` backward that does not
    reach layer ``a`` (it adds onto the others' gradients, not zeroed), then
    ``zero_grad(set_to_none=False)`` and ``step()``: torch updates ``a`` on the zeros its
    kept gradient became, and so does layeropt (tests/verifyfuzz.py found it skipped)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(3, 3), "b": torch.nn.Linear(3, 3)})
    ref = copy.deepcopy(model)
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(1))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    opt = layeropt.Adam(model.parameters(), lr=0.1)
    layeropt.attach(model, opt)
    for m, o, held in ((ref, ref_opt, False), (model, opt, True)):
        for _ in range(2):
            m["b"](m["a"](x)).sum().backward()
            o.step()
            with o.no_step() if held else contextlib.nullcontext():
                m["b"](x).square().sum().backward()
            (o if zero == "optimizer" else m).zero_grad(set_to_none=False)
            o.step()
    assert_models_equal(ref, model)
    assert_same(opt.state_dict(), ref_opt.state_dict())
