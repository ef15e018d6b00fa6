"""Bit-for-bit equality with torch.optim: every optimizer option x every model."""

from __future__ import annotations

import copy

import pytest
import torch

from harness import (
    MODEL_NAMES,
    OPTIMIZER_CONFIGS,
    assert_models_equal,
    assert_same,
    config_id,
    needs_fsdp2,
    train_pair,
)


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@pytest.mark.parametrize("cfg", OPTIMIZER_CONFIGS, ids=config_id)
def test_matches_torch_bitwise(cfg, model_name):
    opt_name, kw = cfg
    ref, ref_opt, model, lo_opt = train_pair(model_name, opt_name, kw)
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), lo_opt.state_dict())
    # in torch's order too (torch.save's bytes): in-backward state is made in landing order
    assert list(lo_opt.state_dict()["state"]) == list(ref_opt.state_dict()["state"])


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch >= 2.5")
@pytest.mark.parametrize("foreach", [False, True])
def test_adafactor_mixed_dtypes_with_an_epsilon_given(foreach: bool):
    """eps[0]=None is refused with mixed dtypes (tests/test_errors.py); a number is exact."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 8).to(torch.bfloat16), torch.nn.Linear(8, 3))

    def loss_fn(m: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        return m[1](m[0](x.bfloat16()).float()).pow(2).mean()

    kw = dict(lr=1e-2, eps=(1e-30, 1e-3), foreach=foreach)
    ref, ref_opt, model, lo_opt = train_pair(
        "mlp", "Adafactor", kw, model=model, loss_fn=loss_fn,
        batch_fn=lambda gen: torch.randn(4, 6, generator=gen))
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), lo_opt.state_dict())


@pytest.mark.parametrize("cfg", OPTIMIZER_CONFIGS, ids=config_id)
def test_param_groups_with_different_lr(cfg):
    opt_name, kw = cfg
    ref, ref_opt, model, lo_opt = train_pair("gpt", opt_name, kw, split_groups=True)
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), lo_opt.state_dict())


@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_each_parameter_stepped_once_per_backward(model_name):
    """Counts updates: every parameter with a gradient exactly once, others never."""
    from layeropt.models import make_model

    import layeropt

    model, batch_fn, loss_fn = make_model(model_name)
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    calls: list[int] = []
    original = opt._lo_stepper  # every update's one call of torch's step (engine/subset.py)

    def counting(optimizer, params, key):
        calls.extend(id(p) for p in params)
        return original(optimizer, params, key)

    opt._lo_stepper = counting
    layeropt.attach(model, opt)
    loss_fn(model, batch_fn(torch.Generator().manual_seed(0))).backward()
    # The reference: which parameters get a gradient in plain torch.
    ref, _, _ = make_model(model_name)
    loss_fn(ref, batch_fn(torch.Generator().manual_seed(0))).backward()
    expected = sorted(id(p) for p, q in zip(model.parameters(), ref.parameters()) if q.grad is not None)
    assert sorted(calls) == expected
    assert opt.stepped_in_backward == len(expected)


def test_unused_parameters_keep_untouched_state():
    from layeropt.models import make_model

    import layeropt

    model, batch_fn, loss_fn = make_model("frozen")
    opt = layeropt.Adam(model.parameters(), lr=0.1)
    layeropt.attach(model, opt)
    before = model.unused.weight.detach().clone()
    for _ in range(2):
        loss_fn(model, batch_fn(torch.Generator().manual_seed(0))).backward()
    assert torch.equal(model.unused.weight, before)
    assert model.unused.weight not in opt.state
    assert model.frozen.weight not in opt.state


class _Late(torch.nn.Module):
    """A trunk, a head and a branch the first step does not reach (its first gradient,
    and its momentum buffer, come a step later)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head = torch.nn.Linear(8, 8), torch.nn.Linear(8, 3)
        self.branch = torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, branch: bool) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head(h) + self.branch(h) if branch else self.head(h)


# (dtype, SGD options, whether layeropt holds the step where the branch first lands)
LATE_FIRST_GRADIENT = [
    (torch.bfloat16, dict(momentum=0.9, foreach=True), True),
    (torch.float16, dict(momentum=0.9, nesterov=True, foreach=True), True),
    (torch.bfloat16, dict(momentum=0.9, dampening=0.1, weight_decay=0.01, foreach=True), True),
    (torch.bfloat16, dict(momentum=0.9, foreach=False), False),  # one way: no need
    (torch.float32, dict(momentum=0.9, foreach=True), False),  # the two ways agree
    (torch.bfloat16, dict(momentum=0.5, foreach=True), False),  # 0.5: exact in bf16
]


@pytest.mark.parametrize("dtype,kw,holds", LATE_FIRST_GRADIENT,
                         ids=["bf16", "fp16-nesterov", "bf16-dampening", "bf16-for-loop", "fp32",
                              "bf16-momentum-0.5"])
def test_foreach_sgd_momentum_when_a_layer_gets_its_first_gradient_later(dtype, kw, holds):
    """torch's foreach SGD updates every momentum buffer of a (group, device, dtype) one
    tensor at a time in a step where one of its parameters has none yet, else with
    ``_foreach_mul_`` - which on the CPU rounds the momentum to bf16 / fp16 first. A
    layer stepped alone cannot know which way the step takes: layeropt holds that step's
    gradients and steps them in one call at the end of backward, with a warning, where
    the two ways differ (ampfuzz verify, seed 270,351: the momentum buffers differed,
    silently; this test fails before)."""
    import warnings

    import layeropt

    torch.manual_seed(0)
    model = _Late().to(dtype)
    runs = []
    for cls in (torch.optim.SGD, layeropt.SGD):
        m = copy.deepcopy(model)
        opt = cls(m.parameters(), lr=0.01, **kw)
        if cls is layeropt.SGD:
            layeropt.attach(m, opt)  # (both schedules: conftest)
        runs.append((m, opt))
    gen = torch.Generator().manual_seed(1)
    for k, branch in enumerate((False, True, True)):  # (the branch's first gradient: k=1)
        x = torch.randn(5, 8, generator=gen).to(dtype)
        for i, (m, opt) in enumerate(runs):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                m(x, branch).float().pow(2).mean().backward()
            held = any("holds this backward's gradients" in str(w.message) for w in seen)
            assert held == (i == 1 and holds and k == 1), [str(w.message) for w in seen]
            opt.step()
            opt.zero_grad()
    (ref, ref_opt), (ours, lo_opt) = runs
    assert_models_equal(ref, ours)
    assert_same(ref_opt.state_dict(), lo_opt.state_dict())


def test_foreach_sgd_momentum_on_ddp_refuses_the_step_it_cannot_hold(process_group):
    """Under DDP layeropt steps each averaged bucket as it comes: the step the test above
    holds is refused there, before anything of it is applied."""
    import layeropt

    model = _Late().to(torch.bfloat16)
    ddp = torch.nn.parallel.DistributedDataParallel(model, find_unused_parameters=True)
    opt = layeropt.SGD(model.parameters(), lr=0.01, momentum=0.9, foreach=True)
    with layeropt.attach(ddp, opt):
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(5, 8, generator=gen).to(torch.bfloat16)
        ddp(x, False).float().pow(2).mean().backward()  # the branch: no gradient, no buffer
        opt.step()
        opt.zero_grad()
        before = copy.deepcopy(opt.state_dict()), [p.detach().clone() for p in model.parameters()]
        with pytest.raises(layeropt.BackwardStateError, match="cannot hold them"):
            ddp(x, True).float().pow(2).mean().backward()
        assert_same(before[0], opt.state_dict())
        assert all(torch.equal(a, p) for a, p in zip(before[1], model.parameters()))


@needs_fsdp2
def test_foreach_sgd_momentum_on_fsdp2_holds_that_step_too(process_group):
    """FSDP2's sharded parameters go through the same hooks: the step where the branch
    gets its first gradient is held, and the shards equal torch's on FSDP2."""
    import warnings

    import layeropt
    from torch.distributed.fsdp import fully_shard

    model = _Late().to(torch.bfloat16)
    runs = []
    for cls in (torch.optim.SGD, layeropt.SGD):
        m = copy.deepcopy(model)
        fully_shard(m)
        opt = cls(m.parameters(), lr=0.01, momentum=0.9, foreach=True)
        handle = layeropt.attach(m, opt) if cls is layeropt.SGD else None
        gen = torch.Generator().manual_seed(1)
        for k, branch in enumerate((False, True, True)):
            x = torch.randn(5, 8, generator=gen).to(torch.bfloat16)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                m(x, branch).float().pow(2).mean().backward()
            held = any("holds this backward's gradients" in str(w.message) for w in seen)
            assert held == (handle is not None and k == 1)
            opt.step()
            opt.zero_grad()
        runs.append((m, opt, handle))
    (ref, ref_opt, _), (ours, lo_opt, handle) = runs
    handle.remove()
    assert all(torch.equal(a.full_tensor(), b.full_tensor())
               for a, b in zip(ref.parameters(), ours.parameters()))
    ref_state, lo_state = ref_opt.state_dict()["state"], lo_opt.state_dict()["state"]
    assert ref_state.keys() == lo_state.keys()
    for key, value in ref_state.items():
        assert torch.equal(value["momentum_buffer"].full_tensor(),
                           lo_state[key]["momentum_buffer"].full_tensor())


class _Tagged(torch.nn.Parameter):
    """A parameter of a tensor subclass: not a type torch's foreach kernels take."""


# (optimizer, options, whether layeropt holds every step: torch's default splits the group)
SPLIT_DEFAULT = [
    ("NAdam", {}, True),
    ("RMSprop", dict(momentum=0.9, centered=True), True),
    ("SGD", dict(momentum=0.9), True),
    ("SGD", {}, True),
    ("Adagrad", {}, True),
    ("NAdam", dict(foreach=False), False),  # one way, set by the user: exact per layer
    ("RMSprop", dict(foreach=True), False),
]


@pytest.mark.parametrize("name,kw,holds", SPLIT_DEFAULT,
                         ids=["nadam", "rmsprop", "sgd-momentum", "sgd", "adagrad",
                              "nadam-for-loop", "rmsprop-foreach"])
def test_a_param_group_torch_splits_between_foreach_and_for_loop(monkeypatch, name, kw,
                                                                  holds):
    """torch takes its foreach implementation (``foreach`` left to it) only where every
    parameter with a gradient is a plain tensor on a device with foreach kernels, and
    its for-loop otherwise; the two round bf16 differently. A group that mixes such
    parameters with others (a CPU parameter beside CUDA ones, a tensor subclass) - a
    bucket of the plain ones alone would take foreach: layeropt holds each such step's
    gradients to the end of backward and steps them in one call, with a warning that
    names the fix. The CPU has no foreach kernels in torch's list: the test adds it, as
    a CUDA device is (both runs under it; fails before the fix)."""
    import warnings

    import layeropt
    from torch.optim import optimizer as torch_optimizer

    devices = torch_optimizer._get_foreach_kernels_supported_devices() + ["cpu"]
    monkeypatch.setattr(torch_optimizer, "_get_foreach_kernels_supported_devices",
                        lambda: list(devices))
    torch.manual_seed(0)
    model = _Late().to(torch.bfloat16)
    model.head.bias = _Tagged(model.head.bias.detach())
    runs = []
    ours = getattr(layeropt, name, None) or layeropt.in_backward(getattr(torch.optim, name))
    for cls in (getattr(torch.optim, name), ours):
        m = copy.deepcopy(model)
        opt = cls(m.parameters(), lr=0.01, **kw)
        if cls is ours:
            layeropt.attach(m, opt)  # (both schedules: conftest)
        runs.append((m, opt))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 8, generator=gen).to(torch.bfloat16)
        for i, (m, opt) in enumerate(runs):
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                m(x, True).float().pow(2).mean().backward()
            held = [str(w.message) for w in seen if "holds this backward" in str(w.message)]
            assert bool(held) == (i == 1 and holds), [str(w.message) for w in seen]
            assert all("_Tagged on cpu" in h and "Pass foreach=False" in h for h in held)
            opt.step()
            opt.zero_grad()
    (ref, ref_opt), (ours, lo_opt) = runs
    assert_models_equal(ref, ours)
    assert_same(ref_opt.state_dict(), lo_opt.state_dict())


def test_a_split_param_group_on_ddp_refuses_the_step_it_cannot_hold(monkeypatch,
                                                                    process_group):
    """Under DDP the step the test above holds is refused, before anything of it is
    applied, with the fix named."""
    import layeropt
    from torch.optim import optimizer as torch_optimizer

    devices = torch_optimizer._get_foreach_kernels_supported_devices() + ["cpu"]
    monkeypatch.setattr(torch_optimizer, "_get_foreach_kernels_supported_devices",
                        lambda: list(devices))
    model = _Late().to(torch.bfloat16)
    model.head.bias = _Tagged(model.head.bias.detach())
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    opt = layeropt.RMSprop(model.parameters(), lr=0.01)
    before = [p.detach().clone() for p in model.parameters()]
    with layeropt.attach(ddp, opt):
        x = torch.randn(5, 8).to(torch.bfloat16)
        with pytest.raises(layeropt.BackwardStateError, match="Pass foreach=False"):
            ddp(x, True).float().pow(2).mean().backward()
    assert not opt.state
    assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))


class _TwoParts(torch.nn.Module):
    """A trunk and a head, each its optimizer's, a loss on either alone (a GAN's two
    players in one model, an actor and a critic)."""

    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head, self.aux = (torch.nn.Linear(6, 6), torch.nn.Linear(6, 3),
                                           torch.nn.Linear(6, 3))

    def forward(self, x, part):
        if part == "trunk":
            return self.trunk(x).pow(2).mean()
        out = self.head(x).pow(2).mean()
        return out + self.aux(x).pow(2).mean() if part == "head+aux" else out


# Loops over a DDP model (find_unused_parameters=True, one process) whose backwards reach
# one optimizer each: a plain backward leaves the optimizer it gives nothing alone.
# Until 2026-12-06 each DDP backward began every attached optimizer's step: the first
# loop was refused as a second backward, the second stepped aux's kept zeros once less.
TWO_PART_LOOPS = {
    "a loss for each, then both steps": [("head", "trunk", "step 2", "step 1", "zg 1",
                                          "zg 2 keep")] * 3,
    "zeros kept for a part the last backward missed": [
        ("head+aux", "trunk", "step 2", "step 1", "zg 2 keep", "head", "step 2")],
}


@pytest.mark.parametrize("loop", list(TWO_PART_LOOPS))
@pytest.mark.parametrize("cap", [0.0, 1.0])
def test_ddp_backwards_that_reach_one_of_two_optimizers_are_exact(process_group, loop, cap):
    import layeropt
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    base = _TwoParts()
    runs = []
    for lo in (False, True):
        model = copy.deepcopy(base)
        ddp = DDP(model, find_unused_parameters=True)
        cls = layeropt.Adagrad if lo else torch.optim.Adagrad
        opts = {"1": cls(model.trunk.parameters(), lr=0.05, lr_decay=0.01),
                "2": cls([*model.head.parameters(), *model.aux.parameters()], lr=0.1,
                         lr_decay=0.01)}
        if lo:
            layeropt.attach(ddp, list(opts.values()), bucket_cap_mb=cap)
        gen = torch.Generator().manual_seed(1)
        for iteration in TWO_PART_LOOPS[loop]:
            for op in iteration:
                if op.startswith("step"):
                    opts[op[-1]].step()
                elif op.startswith("zg"):
                    opts[op.split()[1]].zero_grad(set_to_none=not op.endswith("keep"))
                else:
                    ddp(torch.randn(4, 6, generator=gen), op).backward()
        runs.append((model, opts))
    (ref, ref_opts), (ours, lo_opts) = runs
    assert_models_equal(ref, ours)
    for n in ref_opts:
        assert_same(ref_opts[n].state_dict(), lo_opts[n].state_dict())
