"""Bit-for-bit equality with torch.optim: every optimizer option x every model."""

from __future__ import annotations

import pytest
import torch

from harness import (
    MODEL_NAMES,
    OPTIMIZER_CONFIGS,
    assert_models_equal,
    assert_same,
    config_id,
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
