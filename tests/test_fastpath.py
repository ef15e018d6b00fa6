"""The fast path (layeropt/engine/fastpath.py): taken where supported, bit-identical, and dropped
whenever torch's ``_init_group`` would return other lists.

Every case trains a torch.optim reference and an attached layeropt copy and compares
parameters and optimizer state bit for bit; the cache-invalidation cases change the same
thing on both sides between steps.
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import layeropt
from harness import (
    MODEL_NAMES,
    OPTIMIZER_CONFIGS,
    TORCH,
    InfGrad,
    assert_models_equal,
    assert_same,
    clone_kwargs,
    config_id,
    layeropt_class,
    torch_class,
    train_pair,
)
from layeropt.engine.fastpath import FastPath, supported

# The classes the fast path serves (the others take torch's step: tests/test_exact.py).
FAST_CONFIGS = [c for c in OPTIMIZER_CONFIGS if c[0] in ("Adam", "AdamW", "SGD")]

pytestmark = pytest.mark.skipif(
    not supported(), reason="torch < 2.6: every call takes torch's step (the general path)"
)


def _fast(opt: Any) -> FastPath:
    base = type(opt)._lo_base  # the torch class in_backward() was given
    if base not in supported():  # not served, or its signatures are older on this torch
        served = base in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)
        assert not served or TORCH < (2, 13), f"{base.__name__} should take the fast path"
        pytest.skip(f"{base.__name__} takes torch's step")
    fast = opt._lo_stepper.fast
    assert isinstance(fast, FastPath), "the fast path was never set up"
    return fast


# -- the exactness table, through the fast path --------------------------------------


@pytest.mark.parametrize("model_name", MODEL_NAMES)
@pytest.mark.parametrize("cfg", FAST_CONFIGS, ids=config_id)
def test_exact_table_takes_the_fast_path(cfg, model_name):
    """Step 1 goes through torch's step (state created there); steps 2-3 all fast."""
    opt_name, kw = cfg
    ref, ref_opt, model, lo_opt = train_pair(model_name, opt_name, kw, steps=3)
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), lo_opt.state_dict())
    fast = _fast(lo_opt)
    assert fast.built > 0 and fast.dropped == 0
    assert fast.taken == 2 * fast.built  # every call of steps 2 and 3


@pytest.mark.parametrize("cfg", FAST_CONFIGS, ids=config_id)
def test_buckets_across_param_groups(cfg):
    """Two groups with different lr: a bucket's call spans both (one chunk per group)."""
    opt_name, kw = cfg
    ref, ref_opt, model, lo_opt = train_pair("gpt", opt_name, kw, steps=3, split_groups=True)
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), lo_opt.state_dict())
    fast = _fast(lo_opt)
    assert fast.taken == 2 * fast.built > 0
    assert any(len(e.chunks) == 2 for e in fast._entries.values())


def test_fused_adam_calls_torch_kernel_directly_for_one_device_and_dtype():
    _, _, _, lo_opt = train_pair("mlp", "Adam", dict(lr=0.01, fused=True), steps=3)
    entries = list(_fast(lo_opt)._entries.values())
    assert entries and all(c.device is not None for e in entries for c in e.chunks)


def test_the_classes_served_do_not_depend_on_what_was_built_before():
    """torch's ``Optimizer.__init__`` sets ``AdamW.step`` to its profiling wrapper of Adam's
    step when an AdamW is built before any Adam: the classes served are the same after it
    (the check for torch < 2.6's own AdamW step took that wrapper for one, and a process
    that built a torch.optim.AdamW first never took the fast path). A fresh process: this
    one's classes were wrapped long ago."""
    code = ("import torch\n"
            "torch.optim.AdamW(torch.nn.Linear(2, 2).parameters())\n"
            "assert 'step' in vars(torch.optim.AdamW)\n"
            "from layeropt.engine.fastpath import supported\n"
            "print(sorted(c.__name__ for c in supported()))\n")  # fmt: skip
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.split("\n")[-2] == str(sorted(c.__name__ for c in supported()))


def test_default_bucket_cap_takes_the_fast_path(monkeypatch):
    monkeypatch.setitem(layeropt.attach.__kwdefaults__, "bucket_cap_mb", 1.0)  # tests use 0
    ref, ref_opt, model, lo_opt = train_pair("gpt", "Adam", dict(lr=0.01, fused=True), steps=3)
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), lo_opt.state_dict())
    assert _fast(lo_opt).taken == 2 * _fast(lo_opt).built > 0


# -- a paired run with the same change on both sides between steps ---------------------


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))


def _loss(m: nn.Module, i: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(i)
    p = next(m.parameters())
    x = torch.randn(5, 4, generator=g).to(p.dtype)
    y = torch.randn(5, 2, generator=g).to(p.dtype)
    return torch.nn.functional.mse_loss(m(x), y)


Change = Callable[[int, nn.Module, torch.optim.Optimizer, dict[str, Any]], None]


def _train_with_change(
    opt_name: str,
    kw: dict[str, Any],
    change: Change,
    steps: int = 4,
    params: Callable[[nn.Module], Any] = lambda m: m.parameters(),
) -> Any:
    """Train reference and layeropt; ``change(i, model, opt, scratch)`` before step i."""
    model = _net()
    ref = copy.deepcopy(model)
    ref_opt = torch_class(opt_name)(params(ref), **clone_kwargs(kw))
    lo_opt = layeropt_class(opt_name)(params(model), **clone_kwargs(kw))
    handle = layeropt.attach(model, lo_opt)
    scratch: tuple[dict[str, Any], dict[str, Any]] = ({}, {})
    for i in range(steps):
        change(i, ref, ref_opt, scratch[0])
        change(i, model, lo_opt, scratch[1])
        _loss(ref, i).backward()
        ref_opt.step()
        ref.zero_grad()
        _loss(model, i).backward()
        lo_opt.step()
        model.zero_grad()
        assert_models_equal(ref, model)
        assert_same(ref_opt.state_dict(), lo_opt.state_dict())
    handle.remove()
    return lo_opt


def test_add_param_group_mid_training():
    def change(i, m, opt, scratch):
        if i == 2:
            opt.add_param_group({"params": list(m[4].parameters()), "lr": 0.003})

    lo_opt = _train_with_change(
        "Adam",
        dict(lr=0.01, fused=True),
        change,
        params=lambda m: [p for k in (0, 2) for p in m[k].parameters()],
    )
    fast = _fast(lo_opt)
    assert fast.dropped > 0 and fast.taken > 0


def test_group_params_list_replaced():
    def change(i, m, opt, scratch):
        if i == 2:
            opt.param_groups[0]["params"] = list(opt.param_groups[0]["params"])

    fast = _fast(_train_with_change("SGD", dict(lr=0.1, momentum=0.9), change))
    assert fast.dropped > 0 and fast.taken > 0


@pytest.mark.parametrize("fused", [False, True])
def test_load_state_dict_mid_training(fused):
    def change(i, m, opt, scratch):
        if i == 1:
            scratch["sd"] = copy.deepcopy(opt.state_dict())
        if i == 3:
            opt.load_state_dict(scratch["sd"])  # back to the state after step 1

    fast = _fast(_train_with_change("Adam", dict(lr=0.01, fused=fused), change, steps=5))
    assert fast.dropped > 0 and fast.taken > 0


def test_load_state_dict_forgets_the_lists_at_once():
    """No replaced state tensor stays alive in the cache (a load-state-dict post hook)."""
    _, _, _, lo_opt = train_pair("mlp", "Adam", dict(lr=0.01, fused=True), steps=2)
    assert _fast(lo_opt)._entries
    lo_opt.load_state_dict(copy.deepcopy(lo_opt.state_dict()))
    assert not _fast(lo_opt)._entries


@pytest.mark.parametrize("kw", [
    dict(lr=0.01, fused=True),
    dict(lr=0.01, foreach=True),
    dict(lr=torch.tensor(0.01), fused=True),
], ids=["float-fused", "float-foreach", "tensor-fused"])  # fmt: skip
def test_lr_scheduler_changes_lr_between_steps(kw):
    def change(i, m, opt, scratch):
        if i == 0:
            scratch["sched"] = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
        else:
            scratch["sched"].step()

    lo_opt = _train_with_change("Adam", kw, change, steps=5)
    fast = _fast(lo_opt)
    assert fast.dropped == 0 and fast.taken == 4 * fast.built  # lr is read per call
    assert isinstance(lo_opt.param_groups[0]["lr"], type(kw["lr"]))


def test_hyperparameters_changed_by_hand_are_read_per_call():
    def change(i, m, opt, scratch):
        for g in opt.param_groups:
            g["betas"] = (0.9 - 0.1 * i, 0.99)
            g["weight_decay"] = 0.1 * i
            g["eps"] = 1e-8 * (i + 1)
            g["maximize"] = bool(i % 2)
            g["decoupled_weight_decay"] = i == 3

    fast = _fast(_train_with_change("Adam", dict(lr=0.01, fused=True), change))
    assert fast.dropped == 0 and fast.taken > 0


def test_model_double_after_attach_before_the_first_step():
    def change(i, m, opt, scratch):
        if i == 0:
            m.double()

    fast = _fast(_train_with_change("Adam", dict(lr=0.01, fused=True), change))
    assert fast.taken > 0


@pytest.mark.parametrize("kw", [dict(lr=0.01, fused=True), dict(lr=0.01, foreach=True),
                                dict(lr=0.01)], ids=["fused", "foreach", "for-loop"])  # fmt: skip
def test_model_double_after_state_exists_fails_as_in_torch(kw):
    """fp32 state, fp64 parameters: torch's step raises; so does the fast path, same message."""
    errors = []
    for cls in (torch_class("Adam"), layeropt_class("Adam")):
        m = _net()
        opt = cls(m.parameters(), **kw)
        handle = layeropt.attach(m, opt) if cls is not torch.optim.Adam else None
        for i in range(2):
            _loss(m, i).backward()
            opt.step()
            opt.zero_grad()
        m.double()
        with pytest.raises(RuntimeError) as e:
            _loss(m, 2).backward()
            opt.step()
        errors.append(str(e.value))
        if handle is not None:
            assert _fast(opt).taken > 0  # step 2 was fast; step 3 failed in it
            handle.remove()
    assert errors[0] == errors[1]


@pytest.mark.parametrize("kw", [dict(lr=0.01, fused=True), dict(lr=0.01, foreach=True)],
                         ids=["fused", "foreach"])  # fmt: skip
def test_model_double_then_load_state_dict(kw):
    """load_state_dict casts the state to the parameters' new dtype: lists rebuilt."""
    def change(i, m, opt, scratch):
        if i == 2:
            m.double()
            opt.load_state_dict(opt.state_dict())

    fast = _fast(_train_with_change("Adam", kw, change, steps=5))
    assert fast.dropped > 0 and fast.taken > 0
    assert all(c.lists[0][0].dtype == torch.float64 for e in fast._entries.values() for c in e.chunks)


@pytest.mark.parametrize("kw", [dict(lr=0.01, amsgrad=True), dict(lr=0.01, amsgrad=True, fused=True)],
                         ids=["for-loop", "fused"])  # fmt: skip
def test_amsgrad_switched_off(kw):
    def change(i, m, opt, scratch):
        if i == 2:
            for g in opt.param_groups:
                g["amsgrad"] = False

    fast = _fast(_train_with_change("Adam", kw, change))
    assert fast.dropped > 0 and fast.taken > 0


def test_amsgrad_switched_on_fails_as_in_torch():
    """State made without max_exp_avg_sq: torch's _init_group raises KeyError; so does layeropt."""
    errors = []
    for cls in (torch_class("Adam"), layeropt_class("Adam")):
        m = _net()
        opt = cls(m.parameters(), lr=0.01)
        handle = layeropt.attach(m, opt) if cls is not torch.optim.Adam else None
        for i in range(2):
            _loss(m, i).backward()
            opt.step()
            opt.zero_grad()
        for g in opt.param_groups:
            g["amsgrad"] = True
        with pytest.raises(KeyError) as e:
            _loss(m, 2).backward()
            opt.step()
        errors.append(str(e.value))
        if handle is not None:
            handle.remove()
    assert errors[0] == errors[1]


@pytest.mark.parametrize("opt_name, kw, key, value", [
    ("Adam", dict(lr=0.01), "foreach", False),
    ("Adam", dict(lr=0.01, foreach=True), "fused", True),
    ("SGD", dict(lr=0.1), "momentum", 0.9),
    ("SGD", dict(lr=0.1, momentum=0.9), "momentum", 0.0),
])  # fmt: skip
def test_group_option_toggled(opt_name, kw, key, value):
    def change(i, m, opt, scratch):
        if i == 2:
            for g in opt.param_groups:
                g[key] = value
                if key == "fused":
                    g["foreach"] = False

    fast = _fast(_train_with_change(opt_name, kw, change))
    assert fast.taken > 0


@pytest.mark.parametrize("how", ["tensor", "dict", "deleted", "cleared"])
def test_state_replaced_between_steps(how):
    def change(i, m, opt, scratch):
        if i != 2:
            return
        params = [p for g in opt.param_groups for p in g["params"]]
        if how == "tensor":  # a new exp_avg object with the same values, and a reset step
            for p in params:
                opt.state[p]["exp_avg"] = opt.state[p]["exp_avg"].clone()
            opt.state[params[0]]["step"] = torch.tensor(0.0)
        elif how == "dict":
            opt.state[params[1]] = {k: v.clone() for k, v in opt.state[params[1]].items()}
        elif how == "deleted":  # torch creates it again lazily
            del opt.state[params[2]]
        else:
            opt.state.clear()

    fast = _fast(_train_with_change("Adam", dict(lr=0.01), change))
    assert fast.dropped > 0 and fast.taken > 0


@pytest.mark.parametrize("inf_at", [None, 2])
def test_grad_scaler_with_fused_adam(inf_at):
    """GradScaler.step sets grad_scale / found_inf on a fused optimizer: honoured as torch does."""
    runs = []
    for cls in (torch_class("Adam"), layeropt_class("Adam")):
        m = _net()
        opt = cls(m.parameters(), lr=0.01, fused=True)
        handle = layeropt.attach(m, opt) if cls is not torch.optim.Adam else None
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # layeropt holds a scaled backward for step()
            for i in range(5):
                loss = _loss(m, i)
                if i == inf_at:
                    loss = InfGrad.apply(loss)
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        runs.append((m, opt, scaler.get_scale()))
        if handle is not None:
            handle.remove()
    (ref, ref_opt, ref_scale), (model, lo_opt, scale) = runs
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), lo_opt.state_dict())
    assert scale == ref_scale
    assert _fast(lo_opt).taken >= 3


# -- what takes the general path ----------------------------------------------------


def test_unsupported_classes_take_torch_step():
    class MyAdam(torch.optim.Adam):
        pass

    for cls in (layeropt.in_backward(torch.optim.NAdam), layeropt.in_backward(MyAdam),
                layeropt.RMSprop):
        m = _net()
        opt = cls(m.parameters(), lr=0.01)
        with layeropt.attach(m, opt):
            for i in range(2):
                _loss(m, i).backward()
        assert opt._lo_stepper.fast is None
