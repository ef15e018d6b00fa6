"""One torch training step is one layeropt step: the recipes users already have.

Each test runs a loop written for ``torch.optim`` with an attached layeropt
optimizer and compares it with the same loop on plain torch, bit for bit -
or checks that layeropt refuses it loudly with nothing of the step applied.
"""

from __future__ import annotations

import contextlib
import copy
import re
import warnings
from typing import Any

import pytest
import torch
from harness import (
    REPRESENTATIVE,
    InfGrad,
    assert_models_equal,
    assert_same,
    config_id,
    make_pair,
)

import layeropt
from layeropt.models import make_model


def _snapshot(model):
    return {k: v.clone() for k, v in model.state_dict().items()}


# -- accumulation the torch way ---------------------------------------------


def test_torch_style_accumulation_is_refused_before_the_second_backward_applies():
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair(
        "mlp", "Adam", dict(lr=1e-2), attach={}
    )
    gen = torch.Generator().manual_seed(1)
    opt.zero_grad()  # the loop's first call: from here on it is a torch loop
    (loss_fn(model, batch_fn(gen)) / 2).backward()
    after_first = _snapshot(model)
    with pytest.raises(layeropt.BackwardStateError, match="no_step"):
        (loss_fn(model, batch_fn(gen)) / 2).backward()
    assert_same(after_first, model.state_dict())  # nothing of the second applied
    assert all(p.grad is None for p in model.parameters())


def test_step_after_several_stepping_backwards_is_refused():
    """The (i + 1) % n loop: its first step() comes after n attached backwards."""
    model, _, opt, _, batch_fn, loss_fn, _ = make_pair("mlp", "Adam", dict(lr=1e-2), attach={})
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        (loss_fn(model, batch_fn(gen)) / 2).backward()
    with pytest.raises(layeropt.BackwardStateError, match="ends 2 backwards"):
        opt.step()
    opt.zero_grad()  # the counts were reset by the error: the loop can go on


def test_retain_graph_double_backward_sums_as_torch():
    """A backward that keeps its graph is held (warned once: nothing saved); the next
    backward over that graph applies the sum, as torch's step() after both would."""
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair(
        "mlp", "SGD", dict(lr=0.1, momentum=0.9), attach={})
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        data = batch_fn(gen)
        loss, ref_loss = loss_fn(model, data), loss_fn(ref, data)
        with pytest.warns(UserWarning, match="retain_graph=True"):
            loss.backward(retain_graph=True)
        assert opt.stepped_in_backward == 0 and all(
            p.grad is not None for p in model.parameters())
        loss.backward()
        ref_loss.backward(retain_graph=True)
        ref_loss.backward()
        opt.step()
        ref_opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


@pytest.mark.parametrize("cap", [0.0, None])
def test_accumulation_with_no_step_matches_torch(cap):
    """The fix the errors name: all but the last micro-batch inside no_step()."""
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair(
        "gpt", "Adam", dict(lr=1e-2), attach={} if cap is None else {"bucket_cap_mb": cap}
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(2):
        batches = [batch_fn(gen) for _ in range(3)]
        for b in batches:
            (loss_fn(ref, b) / 3).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        opt.zero_grad()
        for i, b in enumerate(batches):
            if i < 2:
                with opt.no_step():
                    (loss_fn(model, b) / 3).backward()
            else:
                (loss_fn(model, b) / 3).backward()
        opt.step()
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


def test_a_loop_without_step_calls_steps_every_backward():
    """A layeropt-native loop (never calls step/zero_grad): each backward is a step."""
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair(
        "mlp", "Adam", dict(lr=1e-2), attach={}
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        data = batch_fn(gen)
        loss_fn(ref, data).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn(model, data).backward()
    assert_models_equal(ref, model)


# -- torch's AMP recipe -------------------------------------------------------


def _scaler_loop(model, opt, batch_fn, loss_fn, *, inf_at=None, clip=None, steps=3):
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    gen = torch.Generator().manual_seed(1)
    for i in range(steps):
        loss = loss_fn(model, batch_fn(gen))
        if i == inf_at:
            loss = InfGrad.apply(loss)
        scaler.scale(loss).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
    return scaler


# The fused ones unscale inside their step (grad_scale / found_inf).
@pytest.mark.parametrize("cfg", REPRESENTATIVE, ids=config_id)
@pytest.mark.parametrize("inf_at, clip", [(None, None), (1, None), (None, 0.05)])
def test_grad_scaler_recipe_is_exact(cfg, inf_at, clip):
    """scale(loss).backward(); [unscale_; clip]; scaler.step(opt); update(): held, exact."""
    opt_name, kw = cfg
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair("gpt", opt_name, kw, attach={})
    ref_scaler = _scaler_loop(ref, ref_opt, batch_fn, loss_fn, inf_at=inf_at, clip=clip)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        scaler = _scaler_loop(model, opt, batch_fn, loss_fn, inf_at=inf_at, clip=clip)
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())
    assert scaler.get_scale() == ref_scaler.get_scale()
    held = [w for w in caught if "GradScaler-scaled loss" in str(w.message)]
    assert held and all(w.filename == __file__ for w in held)  # points at the user's line


def test_grad_scaler_recipe_never_changes_weights_during_backward():
    model, _, opt, _, batch_fn, loss_fn, _ = make_pair("mlp", "SGD", dict(lr=0.1), attach={})
    before = _snapshot(model)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16)
    with pytest.warns(UserWarning, match="GradScaler"):
        scaler.scale(loss_fn(model, batch_fn(torch.Generator().manual_seed(1)))).backward()
    assert_same(before, model.state_dict())
    assert all(p.grad is not None for p in model.parameters())  # held for scaler.step


# -- step(closure): what Lightning does -----------------------------------------


def test_step_with_closure_holds_gradients_so_the_caller_may_clip():
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair(
        "gpt", "Adam", dict(lr=1e-2), attach={}
    )
    gen = torch.Generator().manual_seed(1)

    def closure_for(m, o, data):
        def closure():
            o.zero_grad()
            loss = loss_fn(m, data)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(m.parameters(), 0.05)  # inside the closure
            return loss
        return closure

    for _ in range(3):
        data = batch_fn(gen)
        ref_opt.step(closure_for(ref, ref_opt, data))
        with pytest.warns(UserWarning, match="step\\(closure\\)"):
            opt.step(closure_for(model, opt, data))
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


# -- clipping after an attached backward -----------------------------------------


def test_clipping_after_an_attached_backward_is_refused():
    model, _, opt, _, batch_fn, loss_fn, handle = make_pair("mlp", "Adam", dict(lr=1e-2), attach={})
    loss_fn(model, batch_fn(torch.Generator().manual_seed(1))).backward()
    with pytest.raises(layeropt.LayeroptError, match="layeropt.backward"):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(layeropt.LayeroptError, match="clip_grad_value_"):
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)
    if hasattr(torch.nn.utils, "clip_grads_with_norm_"):  # torch >= 2.6
        with pytest.raises(layeropt.LayeroptError, match="clip_grads_with_norm_"):
            torch.nn.utils.clip_grads_with_norm_(model.parameters(), 1.0, torch.tensor(2.0))
    with pytest.warns(UserWarning, match="not measured"):  # max_norm=inf: a measurement
        torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf"))
    opt.step()
    opt.zero_grad()  # a new training step: nothing stepped since, nothing to say
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0) == 0
    handle.remove()


def test_clipping_unrelated_parameters_is_untouched():
    model, _, opt, _, batch_fn, loss_fn, _ = make_pair("mlp", "Adam", dict(lr=1e-2), attach={})
    loss_fn(model, batch_fn(torch.Generator().manual_seed(1))).backward()
    other = torch.nn.Linear(3, 3)
    other(torch.ones(3)).sum().backward()
    norm = torch.nn.utils.clip_grad_norm_(other.parameters(), 1e-3)
    assert norm > 1e-3 and torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in other.parameters()])) <= 1e-3 + 1e-9


# -- layers unfrozen or frozen after attach ------------------------------------


def _unfreeze_schedule(model, step):
    """Gradual unfreezing: the head trains first, one more layer every step."""
    layers = [*model.layers, model.head]
    for i, layer in enumerate(layers):
        layer.requires_grad_(i >= len(layers) - 1 - step)


@pytest.mark.parametrize("cap", [0.0, None])
def test_gradual_unfreezing_matches_torch(cap):
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair("mlp", "AdamW", dict(lr=1e-2))
    _unfreeze_schedule(ref, 0)
    _unfreeze_schedule(model, 0)
    handle = layeropt.attach(model, opt, **({} if cap is None else {"bucket_cap_mb": cap}))
    gen = torch.Generator().manual_seed(1)
    for step in range(5):
        _unfreeze_schedule(ref, step)
        _unfreeze_schedule(model, step)
        data = batch_fn(gen)
        loss_fn(ref, data).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn(model, data).backward()
        assert all(p.grad is None for p in model.parameters())  # all stepped in backward
        opt.step()
        opt.zero_grad()
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())
    hooked = {id(p) for b in handle.buckets for p in b.params}
    assert hooked == {id(p) for p in model.parameters()}  # every layer hooked by now


# How each step's backward runs: (clip, GradScaler, micro-batches, the micro-batch
# before which the schedule unfreezes the next layer).
UNFREEZE_BACKWARDS = {
    "clip": (0.05, False, 1, 0),
    "clip-scaler": (0.05, True, 1, 0),
    "scaler": (None, True, 1, 0),
    "no_step-unfrozen-first-micro-clip": (0.05, False, 2, 0),
    "no_step-unfrozen-last-micro-clip": (0.05, False, 2, 1),
    "no_step-unfrozen-first-micro": (None, False, 2, 0),
}


@pytest.mark.parametrize("cap", [0.0, None])
@pytest.mark.parametrize("case", list(UNFREEZE_BACKWARDS))
def test_gradual_unfreezing_through_layeropt_backward_matches_torch(case, cap):
    """Layers unfrozen since attach are measured (clip norm, inf check) and stepped
    with the clipped gradient, also when they accumulate under no_step() first."""
    clip, scaled, micro_batches, unfreeze_at = UNFREEZE_BACKWARDS[case]
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair("mlp", "AdamW", dict(lr=1e-2))
    _unfreeze_schedule(ref, 0)
    _unfreeze_schedule(model, 0)
    layeropt.attach(model, opt, **({} if cap is None else {"bucket_cap_mb": cap}))
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**4) if scaled else None
               for _ in range(2)]  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    norms, ref_norms = [], []
    for step in range(4):
        for micro in range(micro_batches):
            if micro == unfreeze_at:
                _unfreeze_schedule(ref, step)
                _unfreeze_schedule(model, step)
            data = batch_fn(gen)
            ref_loss, loss = (loss_fn(m, data) / micro_batches for m in (ref, model))
            if scaled:
                ref_loss, loss = scalers[0].scale(ref_loss), scalers[1].scale(loss)
            ref_loss.backward()
            if micro < micro_batches - 1:
                with opt.no_step():
                    loss.backward()
            else:
                norms.append(layeropt.backward(loss, opt, max_norm=clip, scaler=scalers[1]))
        if scaled:
            scalers[0].unscale_(ref_opt)
        if clip is not None:
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), clip))
        for sc, o in ((scalers[0], ref_opt), (scalers[1], opt)):
            if sc is None:
                o.step()
            else:
                sc.step(o)
                sc.update()
            o.zero_grad()
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())
    if clip is not None:
        assert_same(norms, ref_norms, "the clipping norms")


def test_unfreezing_with_no_hooked_layer_left_is_stepped_by_step():
    """Everything trainable so far frozen, new layers unfrozen: no hook fires at all;
    step() updates them (as torch) and hooks them for the next backward."""
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair("mlp", "SGD", dict(lr=0.1))
    for m in (ref, model):
        m.requires_grad_(False)
        m.head.requires_grad_(True)
    handle = layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        if step == 1:
            for m in (ref, model):
                m.requires_grad_(True)
                m.head.requires_grad_(False)
        data = batch_fn(gen)
        loss_fn(ref, data).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn(model, data).backward()
        held = [p for p in model.parameters() if p.grad is not None]
        trainable = sum(p.requires_grad for p in model.parameters())
        assert len(held) == (trainable if step == 1 else 0)  # step 1: no hook fired
        opt.step()
        opt.zero_grad()
    assert_models_equal(ref, model)
    assert model.head.weight not in {p for b in handle.buckets for p in b.params}


# -- zero_grad(set_to_none=False) ----------------------------------------------


class _Branches(torch.nn.Module):
    """``b`` used every other step; ``c`` in the first two steps only (frozen at 3)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        out = self.a(x)
        if step % 2 == 0:
            out = out + self.b(x)
        if step < 2:
            out = out + self.c(x)
        return out


@pytest.mark.parametrize("opt_name, kw", [
    ("AdamW", dict(lr=0.1, weight_decay=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9, weight_decay=0.1)),
])
@pytest.mark.parametrize("where", ["before-backward", "after-step"])
@pytest.mark.parametrize("how", ["plain", "clip", "no_step"])
def test_zero_grad_keeping_zeros_steps_unused_parameters_as_torch(opt_name, kw, where, how):
    """torch keeps a zero .grad for every parameter that had one and steps it at each
    step(), used or not (weight decay, momentum); layeropt does the same."""
    ref, model = _Branches(), _Branches()
    ref_opt = getattr(torch.optim, opt_name)(ref.parameters(), **kw)
    opt = getattr(layeropt, opt_name)(model.parameters(), **kw)
    layeropt.attach(model, opt)
    norms, ref_norms = [], []
    for step in range(5):
        if step == 3:
            for m in (ref, model):
                m.c.requires_grad_(False)  # a zero .grad still: torch still steps it
        if where == "before-backward":
            ref_opt.zero_grad(set_to_none=False)
            opt.zero_grad(set_to_none=False)
        xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + i))
              for i in range(2 if how == "no_step" else 1)]  # fmt: skip
        for i, x in enumerate(xs):
            ref(x, step).sum().backward()
            if i < len(xs) - 1:
                with opt.no_step():
                    model(x, step).sum().backward()
            elif how == "clip":
                norms.append(layeropt.backward(model(x, step).sum(), opt, max_norm=0.5))
            else:
                model(x, step).sum().backward()
        if how == "clip":
            ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5))
        ref_opt.step()
        opt.step()
        if where == "after-step":
            ref_opt.zero_grad(set_to_none=False)
            opt.zero_grad(set_to_none=False)
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())
    assert_same(norms, ref_norms, "clipping norms")
    assert all(p.grad is None for p in model.parameters())  # no gradient memory kept


def test_zero_grad_to_none_again_forgets_kept_gradients():
    ref, model = _Branches(), _Branches()
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    opt = layeropt.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    layeropt.attach(model, opt)
    for step in range(5):
        set_to_none = step >= 2  # zeros kept for two steps, then the default again
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad(set_to_none=set_to_none)
            m(torch.randn(2, 4, generator=torch.Generator().manual_seed(step)), step).sum().backward()
            o.step()
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


# set_to_none=False: torch keeps a zero .grad, and every later step() moves the parameter
KEPT_AFTER = {
    "model.zero_grad after a step": lambda m, o, x, lo: (
        m(x).pow(2).mean().backward(), o.step(), m.zero_grad(set_to_none=False)),
    "zero_grad of held gradients": lambda m, o, x, lo: (
        _held_backward(m, o, x, lo), o.zero_grad(set_to_none=False)),
    "model.zero_grad of held gradients": lambda m, o, x, lo: (
        _held_backward(m, o, x, lo), m.zero_grad(set_to_none=False)),
    "zero_grad after step() applied held gradients": lambda m, o, x, lo: (  # (fuzzer)
        _held_backward(m, o, x, lo), o.step(), o.zero_grad(set_to_none=False)),
    "zero_grad after a zero_grad, a backward held and its step()": lambda m, o, x, lo: (
        o.zero_grad(), _held_backward(m, o, x, lo), o.step(), o.zero_grad(set_to_none=False)),
    "nothing kept: model.zero_grad() to None first": lambda m, o, x, lo: (  # (fuzzer)
        _held_backward(m, o, x, lo), o.step(), m.zero_grad(), m.zero_grad(set_to_none=False)),
}


def _held_backward(m: torch.nn.Module, o: Any, x: torch.Tensor, lo: bool) -> None:
    with o.no_step() if lo else contextlib.nullcontext():
        m(x).pow(2).mean().backward()


@pytest.mark.parametrize("loop", list(KEPT_AFTER))
def test_kept_zero_gradients_are_stepped_at_every_later_step(loop):
    """Two step() calls without a backward (skipped batches) after the zeros were kept:
    torch steps every parameter twice (weight decay, Adam's count); layeropt forgot the
    zeros after one step() (they counted as that step's), or never kept held ones."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.1, weight_decay=0.1)
    opt = layeropt.AdamW(model.parameters(), lr=0.1, weight_decay=0.1)
    layeropt.attach(model, opt)
    x = torch.randn(3, 4)
    for m, o, lo in ((ref, ref_opt, False), (model, opt, True)):
        KEPT_AFTER[loop](m, o, x, lo)
        o.step()
        o.step()
    assert_models_equal(model, ref)
    assert_same(opt.state_dict(), ref_opt.state_dict())


@pytest.mark.parametrize("zero", ["opt.zero_grad", "model.zero_grad"])
def test_a_batch_discarded_before_the_first_step_is_refused_there(zero):
    """``backward(); zero_grad(); continue`` on the first batch: torch drops it, layeropt
    applied it; before any step() the loop might take backwards as steps, so the first
    step() says so (after stepping as torch's), and the loop goes on."""
    model, batch_fn, loss_fn = make_model("mlp")
    opt = layeropt.Adam(model.parameters(), lr=0.01)
    layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(1)
    loss_fn(model, batch_fn(gen)).backward()
    (opt if zero == "opt.zero_grad" else model).zero_grad()  # "a bad batch: skip it"
    loss_fn(model, batch_fn(gen)).backward()
    # (model.zero_grad ends no training step: the two backwards are refused as one)
    with pytest.raises(layeropt.BackwardStateError, match="first step|ends 2 backwards"):
        opt.step()
    opt.zero_grad()
    loss_fn(model, batch_fn(gen)).backward()  # said once: the loop goes on
    opt.step()


@pytest.mark.parametrize("zero", ["opt.zero_grad", "model.zero_grad"])
def test_a_batch_discarded_before_the_first_step_is_said_after_remove(zero):
    """The same discard, then ``remove()`` before that first ``step()``: the step() of
    the detached optimizer says it (after stepping as torch's); it was lost with the
    attachment (a loop fuzzer program: ``backward(); zero_grad(); remove(); step()``)."""
    model, batch_fn, loss_fn = make_model("mlp")
    ref = copy.deepcopy(model)
    opt = layeropt.Adam(model.parameters(), lr=0.01)
    handle = layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(1)
    loss_fn(model, batch_fn(gen)).backward()
    (opt if zero == "opt.zero_grad" else model).zero_grad()
    handle.remove()
    assert not all(torch.equal(a, b) for a, b in zip(ref.parameters(), model.parameters()))
    with pytest.raises(layeropt.BackwardStateError, match="first step"):
        opt.step()
    opt.step()  # said once


def test_gradients_dropped_by_hand_are_not_kept_at_a_later_zero_grad():
    """A held micro-batch reaching ``b``, ``step()``, ``p.grad = None`` by hand; later
    steps reach ``a`` only, with ``zero_grad(set_to_none=False)``: torch holds no
    ``.grad`` for ``b`` and leaves it alone. The parameters a step() left were carried
    through every later step() (a review found ``b`` moved on a kept zero, and the list
    growing without end)."""
    torch.manual_seed(0)
    ref = torch.nn.ModuleDict(dict(a=torch.nn.Linear(3, 3), b=torch.nn.Linear(3, 3)))
    model = copy.deepcopy(ref)
    ref_opt, opt = torch.optim.Adam(ref.parameters(), lr=0.1), layeropt.Adam(model.parameters(), lr=0.1)
    layeropt.attach(model, opt)
    x = torch.randn(2, 3)
    for m, o in ((ref, ref_opt), (model, opt)):
        for i in range(4):
            with o.no_step() if m is model else contextlib.nullcontext():
                h = m["a"](x)
                (m["b"](h) if i == 0 else h).sum().backward()
            o.step()
            if i == 0:
                for p in m.parameters():
                    p.grad = None  # dropped by hand
            else:
                o.zero_grad(set_to_none=False)
    assert_models_equal(model, ref)
    assert_same(opt.state_dict(), ref_opt.state_dict())


# -- hyperparameters changed between backward and step() -----------------------

# how the loop changes a hyperparameter after backward: (key, change)
LATE_CHANGES = {
    "lr-set": ("lr", lambda g: g.__setitem__("lr", g["lr"] * 0.5)),
    "weight_decay-set": ("weight_decay", lambda g: g.__setitem__("weight_decay", 0.3)),
    "lr-tensor-in-place": ("lr", lambda g: g["lr"].fill_(0.002)),
    "betas-tensor-in-place": ("betas", lambda g: g["betas"][0].fill_(0.8)),  # (was missed)
}


@pytest.mark.parametrize("case", list(LATE_CHANGES))
def test_hyperparameter_changed_after_backward_is_refused_at_step(case):
    """torch reads param_groups in step(); the attached backward already used them."""
    key, change = LATE_CHANGES[case]
    tensors = "tensor" in case
    lr = torch.tensor(0.01) if tensors else 0.01
    betas = (torch.tensor(0.9), torch.tensor(0.999)) if tensors else (0.9, 0.999)
    model, batch_fn, loss_fn = make_model("mlp")
    opt = layeropt.AdamW(model.parameters(), lr=lr, betas=betas, weight_decay=0.1)
    layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(1)
    loss_fn(model, batch_fn(gen)).backward()
    change(opt.param_groups[0])
    with pytest.raises(layeropt.BackwardStateError, match=rf"param_groups\[0\]\['{key}'\] changed"):
        opt.step()
    opt.zero_grad()  # the loop can go on (nothing is left to compare)
    loss_fn(model, batch_fn(gen)).backward()
    opt.step()


# param_groups edited in place at the top of a step (not through add_param_group)
REGROUPINGS = {
    "reverse": lambda groups: groups.reverse(),
    "delete-first-group": lambda groups: groups.pop(0),
    "move-a-parameter": lambda groups: groups[1]["params"].append(groups[0]["params"].pop()),
    "remove-a-parameter": lambda groups: groups[0]["params"].pop(),
    "replace-a-params-list": lambda groups: groups[2].__setitem__("params", groups[2]["params"][:1]),
}


@pytest.mark.parametrize("edit", list(REGROUPINGS))
@pytest.mark.parametrize("opt_name", ["AdamW", "SGD"])
def test_param_groups_edited_in_place_are_followed(edit, opt_name):
    """A parameter stepped with another group's lr after the groups moved, and one the
    optimizer no longer owns still stepped by its hook (every one of these differed)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 16),
                                torch.nn.Tanh(), torch.nn.Linear(16, 4))
    ref = copy.deepcopy(model)

    def groups(m: torch.nn.Module) -> list[dict[str, Any]]:
        return [{"params": list(m[0].parameters()), "lr": 1e-2},
                {"params": list(m[2].parameters()), "lr": 1e-3, "weight_decay": 0.5},
                {"params": list(m[4].parameters()), "lr": 3e-2}]

    ref_opt = getattr(torch.optim, opt_name)(groups(ref))
    opt = getattr(layeropt, opt_name)(groups(model))
    layeropt.attach(model, opt)
    xs = [torch.randn(4, 8) for _ in range(5)]
    for m, o in ((ref, ref_opt), (model, opt)):
        for i, x in enumerate(xs):
            if i == 2:
                REGROUPINGS[edit](o.param_groups)
            m(x).pow(2).mean().backward()
            o.step()
            o.zero_grad()
    assert_models_equal(model, ref)  # (torch's state_dict() fails on a removed parameter)
    assert_same([opt.state.get(p, {}) for p in model.parameters()],
                [ref_opt.state.get(q, {}) for q in ref.parameters()], "state")


def test_optimizer_state_loaded_between_backward_and_step_is_refused():
    """torch's step() applies the gradient to the loaded state; the attached backward
    already applied it, and the load would have dropped that update (a rollback)."""
    model, batch_fn, loss_fn = make_model("mlp")
    opt = layeropt.Adam(model.parameters(), lr=0.01)
    layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(1)
    saved = copy.deepcopy(opt.state_dict())
    loss_fn(model, batch_fn(gen)).backward()
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(layeropt.BackwardStateError, match="load_state_dict"):
        opt.load_state_dict(saved)
    assert_same(opt.state_dict(), before)  # nothing was loaded
    opt.step()
    opt.zero_grad()
    opt.load_state_dict(saved)  # after step(): torch's semantics, allowed
    assert_same(opt.state_dict(), saved)


def test_scheduler_before_step_is_refused_and_after_step_is_exact():
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair("mlp", "AdamW", dict(lr=1e-2))
    scheds = [torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5) for o in (ref_opt, opt)]
    layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        data = batch_fn(gen)
        for m, o, s in ((ref, ref_opt, scheds[0]), (model, opt, scheds[1])):
            loss_fn(m, data).backward()
            o.step()
            s.step()  # after optimizer.step(): the next step's value
            o.zero_grad()
    assert_models_equal(ref, model)
    loss_fn(model, batch_fn(gen)).backward()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch's own "lr_scheduler.step() before optimizer.step()"
        scheds[1].step()
    with pytest.raises(layeropt.BackwardStateError, match="scheduler.step\\(\\) after optimizer.step"):
        opt.step()


# -- a gradient set after backward already applied one -------------------------


# Where a loop meets a gradient set on a parameter an attached backward already updated:
# step(), or - a loop without step() - a zero_grad() or the next backward.
MEETS_SET_GRADIENT = {
    "step()": lambda model, opt, again: opt.step(),
    "optimizer.zero_grad()": lambda model, opt, again: opt.zero_grad(),
    "model.zero_grad()": lambda model, opt, again: model.zero_grad(),
    "the next backward": lambda model, opt, again: again().backward(),
}


@pytest.mark.parametrize("meets", list(MEETS_SET_GRADIENT))
def test_gradient_set_after_backward_on_an_updated_parameter_is_refused(meets):
    """Opacus-style: torch applies one update with the new gradient; layeropt has applied
    the backward's already, so what meets it next refuses the second one (and applies
    nothing): step(), or in a loop without step() - where a backward is a step - the
    zero_grad() that would drop it or the backward that would add it to its own."""
    model, batch_fn, loss_fn = make_model("mlp")
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(1)
    loss_fn(model, batch_fn(gen)).backward()
    after_backward = _snapshot(model)
    first = next(model.parameters())
    first.grad = torch.ones_like(first)
    where = type(model).__name__ + ".zero_grad()" if meets == "model.zero_grad()" else meets
    with pytest.raises(layeropt.BackwardStateError,
                       match=re.escape(where) + " found a gradient.*already updated in this"):
        MEETS_SET_GRADIENT[meets](model, opt, lambda: loss_fn(model, batch_fn(gen)))
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, after_backward[k]), k


def test_gradient_set_by_hand_where_backward_left_none_is_stepped_as_torch():
    """Parameters no backward reached, and a step() of a gradient alone: torch's updates."""
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair(
        "mlp", "SGD", dict(lr=0.1, momentum=0.9), attach={}
    )
    gen = torch.Generator().manual_seed(1)
    for m, o in ((ref, ref_opt), (model, opt)):
        m.requires_grad_(False)
        m.head.requires_grad_(True)
    data = batch_fn(gen)
    for m, o in ((ref, ref_opt), (model, opt)):
        loss_fn(m, data).backward()
        first = next(m.parameters())  # frozen: no gradient from backward
        first.grad = torch.full_like(first, 0.5)
        o.step()
        o.zero_grad()
        first.grad = torch.full_like(first, 0.25)  # a step() of its own: another update
        o.step()
        o.zero_grad()
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())
