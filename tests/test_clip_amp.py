"""Global/bucket clipping and GradScaler with in-backward updates, vs plain torch."""

from __future__ import annotations

import contextlib
import copy

from typing import Any

import pytest
import torch
import torch.nn.functional as F

import layeropt
from harness import (
    REPRESENTATIVE,
    Boom,
    InfGrad,
    assert_models_equal,
    assert_same,
    config_id,
    make_pair,
    scaled_step,
)


@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["active", "inactive"])
@pytest.mark.parametrize("cfg", REPRESENTATIVE, ids=config_id)
def test_global_clipping_equals_clip_grad_norm(cfg, max_norm):
    opt_name, kw = cfg
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair("gpt", opt_name, kw, attach={})
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        data = batch_fn(gen)
        loss_fn(ref, data).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), max_norm)
        ref_opt.step()
        ref_opt.zero_grad()
        norm = layeropt.backward(loss_fn(model, data), max_norm=max_norm)
        assert torch.equal(norm, ref_norm) and opt.last_grad_norm is norm
        assert all(p.grad is None for p in model.parameters())
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


@pytest.mark.parametrize("norm_type", [2.0, 1.0, float("inf")])
@pytest.mark.parametrize("present", [True, False], ids=["get_total_norm", "torch<2.6"])
def test_grads_total_norm_is_clip_grad_norms(monkeypatch, present, norm_type):
    """The total norm the Lightning callback logs for held gradients: what
    ``clip_grad_norm_`` returns for them, to the last bit - through
    ``torch.nn.utils.get_total_norm``, or without it (torch before 2.6) from the same
    per-tensor norms, grouped by dtype in torch's order (bf16 and float32 interleaved,
    a gradient twice)."""
    from layeropt.engine.transforms import grads_total_norm

    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(shape, generator=gen).to(dtype) for shape, dtype in [
        ((7, 5), torch.bfloat16), ((300,), torch.float32), ((3, 3), torch.bfloat16),
        ((1000,), torch.float32), ((2,), torch.float64)]]
    grads.append(grads[1])
    params = []
    for g in grads:
        p = torch.nn.Parameter(torch.zeros_like(g))
        p.grad = g.clone()
        params.append(p)
    want = torch.nn.utils.clip_grad_norm_(params, float("inf"), norm_type=norm_type)
    if not present:
        monkeypatch.delattr(torch.nn.utils, "get_total_norm", raising=False)
    got = grads_total_norm(grads, norm_type)
    assert got.dtype == want.dtype and torch.equal(got, want), (got, want)


def test_global_clipping_with_accumulation():
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair(
        "mlp", "SGD", dict(lr=0.1, momentum=0.9), attach={}
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        a, b = batch_fn(gen), batch_fn(gen)
        (loss_fn(ref, a) / 2).backward()
        (loss_fn(ref, b) / 2).backward()
        ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_opt.step()
        ref_opt.zero_grad()
        with opt.no_step():
            (loss_fn(model, a) / 2).backward()
        norm = layeropt.backward(loss_fn(model, b) / 2, max_norm=0.1)
        assert torch.equal(norm, ref_norm)
    assert_models_equal(ref, model)


def _two_micro_batches_clipped_by_torch() -> tuple[Any, ...]:
    """An MLP pair (SGD with momentum) and two micro-batches, the torch side trained on them
    (accumulated, clipped at 0.1, stepped); the layeropt side, its optimizer, the loss, the
    batches, the torch side and its norm."""
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair(
        "mlp", "SGD", dict(lr=0.1, momentum=0.9), attach={})
    gen = torch.Generator().manual_seed(0)
    a, b = batch_fn(gen), batch_fn(gen)
    (loss_fn(ref, a) / 2).backward()
    (loss_fn(ref, b) / 2).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
    ref_opt.step()
    return model, opt, loss_fn, (a, b), ref, ref_norm


@pytest.mark.parametrize("how", ["max_norm", "scaler", "optimizer=opt"])
def test_clipping_or_unscaling_inside_the_optimizers_no_step_is_refused(how):
    """``layeropt.backward(max_norm= / scaler=)`` inside the ``no_step()`` of an optimizer it
    clips or unscales ran and differed from torch's clip (or ``scaler.step``) there
    (multifuzz heldclip seed 702,007): refused before anything runs, the held gradients
    kept; the recipe (the held micro-batches plain, the last through layeropt.backward
    outside) then equals torch."""
    model, opt, loss_fn, (a, b), ref, ref_norm = _two_micro_batches_clipped_by_torch()
    scaler = torch.amp.GradScaler("cpu", enabled=how == "scaler")
    kw = {"scaler": scaler} if how == "scaler" else {"max_norm": 0.1}
    with opt.no_step():
        (loss_fn(model, a) / 2).backward()
        held = {n: p.grad.clone() for n, p in model.named_parameters()}
        with pytest.raises(layeropt.LayeroptError, match="inside SGD.no_step"):
            layeropt.backward(loss_fn(model, b) / 2, opt if how == "optimizer=opt" else None,
                              **kw)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, held[n]), n
    norm = layeropt.backward(loss_fn(model, b) / 2, max_norm=0.1)
    assert torch.equal(norm, ref_norm)
    assert_models_equal(ref, model)


def test_measure_pass_that_raises_keeps_the_accumulated_gradients():
    """no_step() gradients are set aside for layeropt.backward's measure pass; a pass that
    raises puts them back (they were lost), as a plain backward that raises keeps them."""
    model, opt, loss_fn, (a, b), ref, ref_norm = _two_micro_batches_clipped_by_torch()
    with opt.no_step():
        (loss_fn(model, a) / 2).backward()
    held = {n: p.grad.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="boom"):
        layeropt.backward(Boom.apply(loss_fn(model, b)), max_norm=0.1)
    for n, p in model.named_parameters():
        assert torch.equal(p.grad, held[n]), n
    norm = layeropt.backward(loss_fn(model, b) / 2, max_norm=0.1)
    assert torch.equal(norm, ref_norm)
    assert_models_equal(ref, model)


@pytest.mark.parametrize("mode", ["clip_value", "bucket_max_norm"])
def test_per_bucket_clipping_equals_torch_per_bucket(mode):
    model, ref, opt, ref_opt, batch_fn, loss_fn, handle = make_pair(
        "unet", "Adam", dict(lr=0.01), attach={mode: 0.01}
    )
    names = {id(p): n for n, p in model.named_parameters()}
    ref_params = dict(ref.named_parameters())
    groups = [[ref_params[names[id(p)]] for p in b.params] for b in handle.buckets]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        data = batch_fn(gen)
        loss_fn(ref, data).backward()
        for g in groups:
            if mode == "clip_value":
                torch.nn.utils.clip_grad_value_(g, 0.01)
            else:
                torch.nn.utils.clip_grad_norm_(g, 0.01)
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn(model, data).backward()  # no extra pass needed
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


class _Branched(torch.nn.Module):
    """``branch`` is used in the first micro-batch only (its gradient is held to the end)."""

    def __init__(self) -> None:
        super().__init__()
        self.body, self.branch = torch.nn.Linear(8, 3), torch.nn.Linear(8, 3)

    def forward(self, x: torch.Tensor, use_branch: bool) -> torch.Tensor:
        return self.body(x) + (self.branch(x) if use_branch else 0)


@pytest.mark.parametrize("seed", [54, 130, 173])  # (where arrival order changed the norm)
def test_held_gradients_are_clipped_per_bucket_in_the_buckets_order(seed):
    """A held bucket stepped at a backward's end: its norm was summed in arrival order
    (bias, weight), clip_grad_norm_ over the module sums (weight, bias); last bits."""
    torch.manual_seed(seed)
    model = _Branched()
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    layeropt.attach(model, opt, bucket_max_norm=0.1)
    x1, x2 = torch.randn(5, 8), torch.randn(5, 8)
    ref(x1, True).pow(2).mean().backward()
    ref(x2, False).pow(2).mean().backward()
    for m in (ref.body, ref.branch):  # bucket_max_norm: each module's own clip_grad_norm_
        torch.nn.utils.clip_grad_norm_(list(m.parameters()), 0.1)
    ref_opt.step()
    with opt.no_step():
        model(x1, True).pow(2).mean().backward()
    model(x2, False).pow(2).mean().backward()
    opt.step()
    assert_models_equal(model, ref)


@pytest.mark.parametrize("cap", [0.0, 25.0], ids=["bucket-per-call", "one-call"])
@pytest.mark.parametrize("second", [None, dict(clip_value=0.5), dict(bucket_max_norm=0.02)],
                         ids=["unclipped", "other-value", "per-bucket-norm"])
def test_one_step_call_mixing_two_attachments_clips_each_by_its_own(second, cap):
    """Two models attached to one optimizer with different clipping, their buckets in one
    step call (``bucket_cap_mb=25``: all of them at the end of backward) or one call
    each: each bucket is clipped by its attachment's settings, as torch's loop clips each
    model's gradients before one ``step()``."""
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6)) for _ in range(2)]
    refs = copy.deepcopy(models)
    params = [p for m in models for p in m.parameters()]
    opt = layeropt.Adam(params, lr=0.01)
    ref_opt = torch.optim.Adam([p for m in refs for p in m.parameters()], lr=0.01)
    layeropt.attach(models[0], opt, bucket_cap_mb=cap, clip_value=0.01)
    layeropt.attach(models[1], opt, bucket_cap_mb=cap, **(second or {}))
    gen = torch.Generator().manual_seed(1)
    for _ in range(3):
        x = torch.randn(5, 6, generator=gen)
        (refs[1](refs[0](x)) ** 2).sum().backward()
        for layer in refs[0]:
            torch.nn.utils.clip_grad_value_(layer.parameters(), 0.01)
        for layer in refs[1]:
            if second and "clip_value" in second:
                torch.nn.utils.clip_grad_value_(layer.parameters(), 0.5)
            elif second:
                torch.nn.utils.clip_grad_norm_(layer.parameters(), 0.02)
        ref_opt.step()
        ref_opt.zero_grad()
        (models[1](models[0](x)) ** 2).sum().backward()
        opt.step()
        opt.zero_grad()
    for m, r in zip(models, refs):
        assert_models_equal(r, m)
    assert_same(ref_opt.state_dict(), opt.state_dict())


def _scaler(**kw):
    return torch.amp.GradScaler("cpu", **{"init_scale": 2.0**10, "growth_interval": 2, **kw})


@pytest.mark.parametrize("init_scale", [2.0**10, 1000.0], ids=["scale-2^10", "scale-1000"])
@pytest.mark.parametrize("clip", [None, 0.5])
@pytest.mark.parametrize("cfg", REPRESENTATIVE, ids=config_id)
def test_grad_scaler_finite_run_equals_torch(cfg, clip, init_scale):
    """torch's recipe: unscale_ only to clip. Without it a fused optimizer divides by the
    scale in its kernel (unscale_ multiplies by the inverse; equal for powers of two)."""
    opt_name, kw = cfg
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair("mlp", opt_name, kw, attach={})
    ref_scaler, scaler = _scaler(init_scale=init_scale), _scaler(init_scale=init_scale)
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):
        data = batch_fn(gen)
        ref_scaler.scale(loss_fn(ref, data)).backward()
        if clip:
            ref_scaler.unscale_(ref_opt)
            torch.nn.utils.clip_grad_norm_(ref.parameters(), clip)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        layeropt.backward(scaler.scale(loss_fn(model, data)), max_norm=clip, scaler=scaler)
        scaler.step(opt)
        scaler.update()
        assert scaler.get_scale() == ref_scaler.get_scale()
    assert scaler.get_scale() > init_scale  # the scale grew on schedule
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


def test_grad_scaler_with_float16_parameters_raises_as_torch():
    """torch's scaler.unscale_ (in scaler.step) refuses float16 gradients; layeropt trained."""
    model = torch.nn.Linear(8, 4).half()
    ref = copy.deepcopy(model)
    x = torch.randn(4, 8).half()
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(ValueError, match="Attempting to unscale FP16 gradients") as torch_err:
        scaler.scale(ref(x).float().square().mean()).backward()
        scaler.step(torch.optim.SGD(ref.parameters(), lr=0.1))
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    # (removed at the end: the error's traceback keeps the optimizer alive, and a later
    # test's layeropt.backward(scaler=) takes every attached optimizer by default)
    with layeropt.attach(model, opt), pytest.raises(ValueError, match=str(torch_err.value)):
        layeropt.backward(scaler.scale(model(x).float().square().mean()), scaler=scaler)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("kw", [dict(lr=0.1, weight_decay=0.01, fused=True),
                                dict(lr=0.1, weight_decay=0.01, foreach=False)],
                         ids=["fused", "forloop"])
@pytest.mark.parametrize("kind", ["SGD", "Adam"])
def test_a_skipped_step_then_zero_grad_keeping_zeros(kind, kw):
    """A step GradScaler skips (inf), then ``zero_grad(set_to_none=False)``: torch keeps a
    zero ``.grad`` for every parameter that had one, and its next step() updates a layer
    that step does not reach on it. A fused optimizer's ``scaler.step`` calls step(),
    which forgot the skipped step's parameters (a fuzzer over AMP loops found it)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 2), "b": torch.nn.Linear(4, 2)})
    ref = copy.deepcopy(model)
    ref_opt, opt = getattr(torch.optim, kind)(ref.parameters(), **kw), \
        getattr(layeropt, kind)(model.parameters(), **kw)
    ref_scaler, scaler = torch.amp.GradScaler("cpu"), torch.amp.GradScaler("cpu")
    x = torch.randn(3, 4)
    with layeropt.attach(model, opt):
        for both in (True, False):  # an inf first step over both layers, then "a" alone
            for m, o, s in ((ref, ref_opt, ref_scaler), (model, opt, scaler)):
                loss = m["a"](x).sum() + (m["b"](x).sum() * float("inf") if both else 0)
                scaled_step(m is model, loss, o, s)
                o.zero_grad(set_to_none=not both)
    assert_models_equal(model, ref)
    assert_same(opt.state_dict()["state"], ref_opt.state_dict()["state"])


@pytest.mark.parametrize("subset", [False, True], ids=["all", "parameters=a"])
@pytest.mark.parametrize("loss_scale", [1.0, float("nan"), float("inf")])
def test_kept_zero_gradients_are_clipped_with_the_others(loss_scale, subset):
    """``zero_grad(set_to_none=False)`` keeps a zero ``.grad`` for a layer the next backward
    does not reach; torch's clip_grad_norm_ scales it with the rest: zeros stay zeros,
    unless the total norm is NaN or inf - 0 * NaN is NaN, and torch's step() makes that
    layer NaN. layeropt stepped its zeros unclipped (found by the AMP fuzzer). A clip
    over ``a`` alone leaves ``b``'s zeros as they are (a review found them scaled)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 2), "b": torch.nn.Linear(4, 2)})
    ref = copy.deepcopy(model)
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9), \
        layeropt.SGD(model.parameters(), lr=0.1, momentum=0.9)
    x = torch.randn(3, 4)
    with layeropt.attach(model, opt):
        for m, o in ((ref, ref_opt), (model, opt)):
            (m["a"](x) + m["b"](x)).sum().backward()
            o.step()
            o.zero_grad(set_to_none=False)
            loss = m["a"](x).sum() * loss_scale  # "b" not reached: its kept zeros
            clip = list(m["a"].parameters() if subset else m.parameters())
            if m is ref:
                loss.backward()
                norm = torch.nn.utils.clip_grad_norm_(clip, 1.0)
            else:
                got = layeropt.backward(loss, max_norm=1.0,
                                        **({"parameters": clip} if subset else {}))
            o.step()
            o.zero_grad()
    same = dict(rtol=0, atol=0, equal_nan=True)  # (bit for bit, NaN where torch has NaN)
    torch.testing.assert_close(got, norm, **same)
    torch.testing.assert_close(list(model.parameters()), list(ref.parameters()), **same)
    torch.testing.assert_close(opt.state_dict()["state"], ref_opt.state_dict()["state"], **same)


@pytest.mark.parametrize("micro", [2, 3])
@pytest.mark.parametrize("kind, kw", [("SGD", dict(lr=0.1, momentum=0.9)),
                                      ("RMSprop", dict(lr=0.01, centered=True))],
                         ids=["SGD", "RMSprop"])
def test_kept_zeros_no_clipped_backward_reaches_are_stepped_once(kind, kw, micro):
    """``a``'s kept zeros (``zero_grad(set_to_none=False)``) and backwards that reach only
    ``b``, another optimizer's, each clipped (``layeropt.backward(max_norm=)``, torch's
    clip_grad_norm_ after each backward): torch steps ``a`` once, at ``step()``, on
    clipped zeros. The second backward took the first one's clipped zeros for gradients
    held in ``.grad`` and stepped them, and ``step()`` stepped them again (multifuzz
    multi / handover seed 571,312: RMSprop's ``step`` one ahead, silently)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"a": torch.nn.Linear(4, 3), "b": torch.nn.Linear(4, 2)})
    ref = copy.deepcopy(model)
    opts = {}
    for m, lib in ((ref, torch.optim), (model, layeropt)):
        opts[id(m)] = (getattr(lib, kind)(m["a"].parameters(), **kw),
                       torch.optim.SGD(m["b"].parameters(), lr=0.1))
    gen = torch.Generator().manual_seed(1)
    xs = [torch.randn(5, 4, generator=gen) for _ in range(micro + 1)]
    with layeropt.attach(model, opts[id(model)][0]):
        for m in (ref, model):
            opt_a, opt_b = opts[id(m)]
            (m["a"](xs[0]).sum() + m["b"](xs[0]).square().sum()).backward()
            opt_a.step()
            opt_b.step()
            opt_a.zero_grad(set_to_none=False)
            opt_b.zero_grad()
            for x in xs[1:]:  # ("a" not reached: its kept zeros)
                loss = m["b"](x).square().sum()
                if m is ref:
                    loss.backward()
                    torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01)
                else:
                    layeropt.backward(loss, max_norm=0.01)
            opt_a.step()
            opt_b.step()
    assert_models_equal(model, ref)
    for ours, torchs in zip(opts[id(model)], opts[id(ref)]):
        assert_same(ours.state_dict()["state"], torchs.state_dict()["state"])


@pytest.mark.parametrize("seed", [12, 25, 32])
def test_held_scaled_backward_shows_the_kept_zeros_to_the_loops_clip(seed):
    """torch's own recipe on an attached optimizer (``scaler.scale(loss).backward();
    unscale_; clip_grad_norm_; scaler.step``: held for step()) after
    ``zero_grad(set_to_none=False)``: the clip's norm stacks the kept zeros of a layer
    the backward did not reach, as torch's does - their ``.grad`` read None, and the
    total norm differed in the last bit for these seeds (found by the AMP fuzzer)."""
    torch.manual_seed(seed)
    ref = torch.nn.ModuleDict({k: torch.nn.Linear(8, 8) for k in "abcdef"})
    model = copy.deepcopy(ref)
    ref_opt, opt = torch.optim.SGD(ref.parameters(), lr=0.1), layeropt.SGD(model.parameters(), lr=0.1)
    scalers = [torch.amp.GradScaler("cpu") for _ in range(2)]
    x, norms = torch.randn(5, 8), []

    def forward(m: torch.nn.ModuleDict, use_c: bool) -> torch.Tensor:
        h = x
        for k in "abdef":
            h = torch.tanh(m[k](h))
        return h + m["c"](h) if use_c else h

    with layeropt.attach(model, opt), pytest.warns(UserWarning, match="GradScaler"):
        for m, o, s in ((ref, ref_opt, scalers[0]), (model, opt, scalers[1])):
            s.scale(forward(m, True).sum()).backward()
            s.step(o)
            s.update()
            o.zero_grad(set_to_none=False)
            s.scale(forward(m, False).pow(2).sum()).backward()  # "c" not reached
            s.unscale_(o)
            norms.append(torch.nn.utils.clip_grad_norm_(m.parameters(), 0.01))
            s.step(o)
            s.update()
    assert_same(norms[1], norms[0])
    assert_models_equal(model, ref)


@pytest.mark.parametrize("kind", ["Adam", "AdamW"])
def test_a_skipped_first_step_of_a_fused_adam_creates_torchs_state(kind):
    """``scaler.step`` on a fused Adam(W) runs its step even when the scaler skips it
    (``found_inf`` set): the state of each parameter that had a gradient is made then,
    zeros with ``step`` 0. layeropt made none until the first real step - a
    ``state_dict()`` saved between had fewer entries (found by the AMP fuzzer)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = copy.deepcopy(ref)
    kw = dict(lr=0.1, fused=True, amsgrad=True)
    ref_opt, opt = getattr(torch.optim, kind)(ref.parameters(), **kw), \
        getattr(layeropt, kind)(model.parameters(), **kw)
    scalers = [torch.amp.GradScaler("cpu") for _ in range(2)]
    x = torch.randn(3, 4)
    with layeropt.attach(model, opt):
        for inject in (float("inf"), 1.0):  # a skipped step, then a real one
            for m, o, s in ((ref, ref_opt, scalers[0]), (model, opt, scalers[1])):
                scaled_step(m is model, m(x).sum() * inject, o, s)
                o.zero_grad()
            assert_same(opt.state_dict(), ref_opt.state_dict())
    assert_models_equal(model, ref)


@pytest.mark.parametrize("cfg", REPRESENTATIVE, ids=config_id)
def test_inf_in_one_layer_skips_every_update_and_halves_scale(cfg):
    opt_name, kw = cfg
    torch.manual_seed(0)
    layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))
    opt = getattr(layeropt, opt_name)(layers.parameters(), **kw)
    layeropt.attach(layers, opt)
    scaler = _scaler()
    x = torch.randn(2, 4)
    for _ in range(1):  # one clean step so the state exists
        h = x
        for layer in layers:
            h = layer(h)
        layeropt.backward(scaler.scale(h.sum()), scaler=scaler)
        scaler.update()
    params = copy.deepcopy(layers.state_dict())
    state = copy.deepcopy(opt.state_dict())
    scale = scaler.get_scale()
    h = x
    for i, layer in enumerate(layers):
        h = layer(InfGrad.apply(h) if i == 1 else h)  # inf reaches layer 0 only
    layeropt.backward(scaler.scale(h.sum()), scaler=scaler)
    scaler.step(opt)
    scaler.update()
    assert_same(params, layers.state_dict())
    assert_same(state, opt.state_dict())
    assert scaler.get_scale() == scale * 0.5
    assert all(p.grad is None for p in layers.parameters())


def test_bf16_autocast_matches_torch():
    model, ref, opt, ref_opt, batch_fn, loss_fn, _ = make_pair(
        "gpt", "AdamW", dict(lr=0.01), attach={}
    )
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        data = batch_fn(gen)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_loss = loss_fn(ref, data)
        ref_loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = loss_fn(model, data)
        loss.backward()
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


# (optimizer, where step() is called) -> expected: torch's result, or refused
AUTOCAST_STEPS = {
    ("Adafactor", "after the autocast block"): "exact",  # (differed: stepped under autocast)
    ("Adafactor", "inside the autocast block"): "refused",  # its matrix product in bf16
    ("AdamW", "after the autocast block"): "exact",
    ("AdamW", "inside the autocast block"): "exact",  # elementwise: autocast leaves it alone
    ("SGD", "inside the autocast block"): "exact",
}


@pytest.mark.skipif(not hasattr(torch.optim, "Adafactor"), reason="torch.optim.Adafactor: 2.5+")
@pytest.mark.parametrize("opt_name,where", list(AUTOCAST_STEPS))
def test_backward_inside_autocast(opt_name, where):
    """Backward inside the autocast block: the updates in backward run with autocast off,
    as torch's step() after the block; a step() inside the block of an optimizer autocast
    may change is refused."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))
    model = copy.deepcopy(ref)
    ref_opt = getattr(torch.optim, opt_name)(ref.parameters(), lr=1e-2)
    opt = getattr(layeropt, opt_name)(model.parameters(), lr=1e-2)
    layeropt.attach(model, opt)
    inside = where == "inside the autocast block"
    for step in range(3):
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, ref_opt), (model, opt)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                m(x).float().square().mean().backward()
                if inside:
                    if o is opt and AUTOCAST_STEPS[opt_name, where] == "refused":
                        with pytest.raises(layeropt.BackwardStateError,
                                           match=r"Adafactor.step\(\) runs inside torch.autocast"):
                            o.step()
                        return
                    o.step()
            if not inside:
                o.step()
            o.zero_grad()
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


def test_bf16_parameters_match_torch():
    """bf16 params: torch keeps optimizer state in the param dtype, and so does layeropt."""
    model, ref, opt, ref_opt, batch_fn, _, _ = make_pair("mlp", "AdamW", dict(lr=0.01), attach={})
    model.to(torch.bfloat16)
    ref.to(torch.bfloat16)
    gen = torch.Generator().manual_seed(0)

    def loss_fn(m: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return ((m(x.bfloat16()).float() - y) ** 2).mean()  # torch 2.4 has no bf16 mse on CPU

    for _ in range(3):
        x, y = batch_fn(gen)
        loss_fn(ref, x, y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn(model, x, y).backward()
    assert_models_equal(ref, model)


@pytest.mark.parametrize("first", [torch.bfloat16, torch.float32], ids=["bf16-first", "fp32-first"])
def test_clipping_a_model_mixing_dtypes_sums_norms_in_torchs_order(first):
    """clip_grad_norm_ groups the per-tensor norms by (device, dtype) in the order of
    torch's grouping, not of first appearance; the total's last bits follow that order
    (11 of 30 norms differed with bf16 layers first)."""
    other = torch.float32 if first == torch.bfloat16 else torch.bfloat16
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8).to(d) for d in [first, other] * 6])
    ref = copy.deepcopy(model)

    def loss_fn(net: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
        for layer in net:
            x = torch.tanh(layer(x.to(layer.weight.dtype)))
        return x.float().pow(2).sum()

    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    layeropt.attach(model, opt)
    norms, ref_norms = [], []
    for i in range(12):
        x = torch.randn(4, 8) * (1 + i % 5)
        loss_fn(ref, x).backward()
        ref_norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05))
        ref_opt.step()
        ref_opt.zero_grad()
        norms.append(layeropt.backward(loss_fn(model, x), max_norm=0.05))
    assert_same(norms, ref_norms, "total norms")
    assert_models_equal(model, ref)


class _CheckpointedBN(torch.nn.Module):
    """A checkpointed segment with a BatchNorm: its recompute updates running stats."""

    def __init__(self, checkpoint):
        super().__init__()
        self.a = torch.nn.Linear(6, 8)
        self.bn = torch.nn.BatchNorm1d(8)
        self.b = torch.nn.Linear(8, 2)
        self.checkpoint = checkpoint

    def forward(self, x):
        return self.b(self.checkpoint(lambda t: torch.relu(self.bn(t)), self.a(x)))


_CHECKPOINTS = {
    "torch-nonreentrant": lambda f, t: torch.utils.checkpoint.checkpoint(f, t, use_reentrant=False),
    "layeropt-nonreentrant": lambda f, t: layeropt.checkpoint(f, t, use_reentrant=False),
    "layeropt-reentrant": lambda f, t: layeropt.checkpoint(f, t, use_reentrant=True),
}


@pytest.mark.parametrize("kind", list(_CHECKPOINTS))
@pytest.mark.parametrize("scaler", [False, True, "overflow"])
def test_measure_pass_leaves_no_trace_in_buffers(kind, scaler):
    """The extra backward of layeropt.backward recomputes checkpointed segments once
    more; their buffer updates (BatchNorm's running stats) must not count twice - nor
    be lost when an inf/NaN skips the step pass ("overflow": at the second step)."""
    torch.manual_seed(0)
    model = _CheckpointedBN(_CHECKPOINTS[kind])
    ref = copy.deepcopy(model)
    ref.checkpoint = _CHECKPOINTS["torch-nonreentrant"]
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    layeropt.attach(model, opt)
    ref_scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=scaler)
    lo_scaler = torch.amp.GradScaler("cpu", init_scale=256.0, enabled=scaler)
    gen = torch.Generator().manual_seed(1)
    for step in range(3):
        x = torch.randn(5, 6, generator=gen)
        overflow = [m.b.weight.register_hook(lambda g: g * float("inf"))
                    for m in (ref, model) if scaler == "overflow" and step == 1]
        ref_scaler.scale(ref(x).sum()).backward()
        ref_scaler.unscale_(ref_opt)
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.1)
        ref_scaler.step(ref_opt)
        ref_scaler.update()
        ref_opt.zero_grad()
        layeropt.backward(lo_scaler.scale(model(x).sum()), max_norm=0.1, scaler=lo_scaler)
        lo_scaler.step(opt)
        lo_scaler.update()
        opt.zero_grad()
        for handle in overflow:
            handle.remove()
    if scaler == "overflow":
        assert lo_scaler.get_scale() == ref_scaler.get_scale() < 256.0  # a step was skipped
    assert_same(ref.state_dict(), model.state_dict())  # parameters and buffers
    assert int(model.bn.num_batches_tracked) == 6  # forward + one recompute per step


@pytest.mark.parametrize("how", ["max_norm", "scaler"])
def test_backward_reaching_an_unattached_layeropt_optimizer_is_refused(how):
    """Another model attached in the process (an earlier notebook cell) must not turn
    layeropt.backward(max_norm=) on an unattached one into a clip of nothing: refused
    before anything changes, as in a fresh process; once attached, torch's recipe."""
    torch.manual_seed(0)
    other = torch.nn.Linear(4, 4)
    other_opt = layeropt.SGD(other.parameters(), lr=0.1)
    handle = layeropt.attach(other, other_opt)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(5, 4)
    kw = dict(max_norm=0.01) if how == "max_norm" else dict(
        scaler=torch.amp.GradScaler("cpu", init_scale=2.0**4))
    loss = model(x).square().sum()
    with pytest.raises(layeropt.LayeroptError, match="not attached"):
        layeropt.backward(kw["scaler"].scale(loss) if how == "scaler" else loss, **kw)
    assert all(p.grad is None for p in model.parameters())  # nothing was applied or kept
    with layeropt.attach(model, opt):  # attached: torch's recipe, bit for bit
        loss = model(x).square().sum()
        if how == "max_norm":
            layeropt.backward(loss, max_norm=0.01)
        else:
            layeropt.backward(kw["scaler"].scale(loss), scaler=kw["scaler"])
            kw["scaler"].step(opt)
            kw["scaler"].update()
    ref_loss = ref(x).square().sum()
    if how == "max_norm":
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.01)
        ref_opt.step()
    else:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
        scaler.scale(ref_loss).backward()
        scaler.step(ref_opt)
        scaler.update()
    assert_models_equal(model, ref)
    handle.remove()


@pytest.mark.parametrize("held", [False, True], ids=["one-backward", "second-held-window"])
def test_backward_given_one_optimizer_steps_the_others_it_reaches_once(held):
    """layeropt.backward(loss, opt1, max_norm=) clips opt1's layers only, as
    clip_grad_norm_(opt1's parameters) would; the other attached optimizer's layers are
    stepped on their own gradient, unclipped (they got it twice: both passes held it)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    ref = copy.deepcopy(model)
    refs = [torch.optim.Adam(ref[i].parameters(), lr=0.1) for i in (0, 2)]
    opts = [layeropt.Adam(model[i].parameters(), lr=0.1) for i in (0, 2)]
    layeropt.attach(model, opts)
    batches = [torch.randn(4, 8) for _ in range(4)]
    for step in range(2):
        xs = batches[2 * step:2 * step + 2] if held else batches[step:step + 1]
        for i, x in enumerate(xs):
            (ref(x).square().mean() / len(xs)).backward()
            last = i == len(xs) - 1
            with contextlib.nullcontext() if last else opts[1].no_step(), (
                    contextlib.nullcontext() if last else opts[0].no_step()):
                loss = model(x).square().mean() / len(xs)
                if last:
                    layeropt.backward(loss, opts[0], max_norm=0.05)
                else:
                    loss.backward()
        torch.nn.utils.clip_grad_norm_(ref[0].parameters(), 0.05)
        for o in refs + opts:
            o.step()
            o.zero_grad()
    assert_models_equal(model, ref)
    for o, r in zip(opts, refs):
        assert_same(o.state_dict(), r.state_dict())


class _TrunkHeads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.trunk, self.head, self.aux = (torch.nn.Linear(4, 8), torch.nn.Linear(8, 3),
                                           torch.nn.Linear(8, 3))

    def forward(self, x: torch.Tensor, aux: bool = False) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        return self.head(h) + (self.aux(h) if aux else 0)


# two optimizers, each attached to its own layers (opt1: the trunk; opt2: head and aux),
# and layeropt.backward(loss, opt1 or opt2, max_norm=): what the loop does
TWO_OPTIMIZERS = {
    # parameters= names the trunk too: clip_grad_norm_ clips it, whoever steps it
    "parameters= over both": dict(given=1, parameters=True, freeze=False),
    # opt2's head frozen for one backward, then unfrozen: its hooks come back before
    # the measure pass (it got both passes' gradients)
    "the other's layer unfrozen": dict(given=0, parameters=False, freeze=True),
}


@pytest.mark.parametrize("case", list(TWO_OPTIMIZERS))
def test_backward_given_one_optimizer_and_the_other_attached_one(case):
    """Found by a fuzzer over loops with several optimizers: both stepped a layer of the
    optimizer not given on another gradient than torch's (unclipped; twice the
    gradient), without an error."""
    kw = TWO_OPTIMIZERS[case]
    torch.manual_seed(0)
    model = _TrunkHeads()
    ref = copy.deepcopy(model)
    x0, x = torch.randn(5, 4), torch.randn(5, 4)

    def make(m: _TrunkHeads, ns: Any) -> list[torch.optim.Optimizer]:
        return [ns.SGD(m.trunk.parameters(), lr=0.1),
                ns.SGD([*m.head.parameters(), *m.aux.parameters()], lr=0.1)]

    refs, opts = make(ref, torch.optim), make(model, layeropt)
    layeropt.attach(model.trunk, opts[0])
    layeropt.attach(model.head, opts[1])
    layeropt.attach(model.aux, opts[1])
    for m, os_ in ((ref, refs), (model, opts)):
        if kw["freeze"]:  # (a GAN's freeze for one backward)
            m.head.requires_grad_(False)
            m(x0, aux=True).pow(2).mean().backward()
            m.head.requires_grad_(True)
            for o in os_:
                o.step()
                o.zero_grad()
        loss = m(x).pow(2).mean()
        clip = (list(m.parameters()) if kw["parameters"]
                else [p for g in os_[kw["given"]].param_groups for p in g["params"]])
        if m is ref:
            loss.backward()
            norm = torch.nn.utils.clip_grad_norm_(clip, 0.1)
        else:
            got = layeropt.backward(loss, opts[kw["given"]], max_norm=0.1,
                                    **({"parameters": clip} if kw["parameters"] else {}))
        for o in os_:
            o.step()
    assert_same(got, norm)
    assert_models_equal(model, ref)


def test_backward_given_one_optimizer_leaves_the_others_held_gradients_unmeasured():
    """Both optimizers attached to the whole model hold a window, then
    ``layeropt.backward(loss, opt2, max_norm=)``: torch's ``clip_grad_norm_(opt2's
    parameters)``. The norm took in opt1's held gradient (its layers were in the
    attached model's parameters()) but not its new one, matching no torch recipe (a
    fuzzer over loops with several optimizers found it)."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"trunk": torch.nn.Linear(4, 8), "head": torch.nn.Linear(8, 3)})
    ref = copy.deepcopy(model)
    batches = [(torch.randn(5, 4), torch.randn(5, 3)) for _ in range(2)]

    def loss(m: torch.nn.ModuleDict, i: int) -> torch.Tensor:
        x, y = batches[i]
        return ((m["head"](torch.tanh(m["trunk"](x))) - y) ** 2).mean()

    make = lambda m, ns: [ns.SGD(m[k].parameters(), lr=0.1, momentum=0.9)  # noqa: E731
                          for k in ("trunk", "head")]
    refs, opts = make(ref, torch.optim), make(model, layeropt)
    for o in opts:
        layeropt.attach(model, o)
    loss(ref, 0).backward()
    loss(ref, 1).backward()
    norm = torch.nn.utils.clip_grad_norm_(ref["head"].parameters(), 0.01)
    with opts[0].no_step(), opts[1].no_step():
        loss(model, 0).backward()
    got = layeropt.backward(loss(model, 1), opts[1], max_norm=0.01)
    for o in refs + opts:
        o.step()
    assert_same(got, norm)
    assert_models_equal(model, ref)


def test_last_grad_norm_is_reset_by_a_backward_that_measures_nothing():
    """``opt.last_grad_norm`` is the norm the latest layeropt.backward measured: one
    without max_norm leaves None, not an earlier step's norm (a logger read it)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    with layeropt.attach(model, opt):
        x = torch.randn(5, 4)
        norm = layeropt.backward(model(x).square().mean(), max_norm=1.0)
        opt.step()
        assert opt.last_grad_norm is norm
        layeropt.backward(model(x).square().mean())
        opt.step()
        assert opt.last_grad_norm is None


def test_a_second_scaled_backward_before_update_is_refused_before_anything_runs():
    """layeropt.backward(scaler=) twice before scaler.update() (micro-batches without
    no_step()): refused before the measure pass, naming no_step(); nothing changes."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    opt = layeropt.Adam(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=8.0)
    with layeropt.attach(model, opt):
        x = torch.randn(5, 4)
        layeropt.backward(scaler.scale(model(x).square().mean()), scaler=scaler)
        before = [p.detach().clone() for p in model.parameters()]
        state = copy.deepcopy(opt.state_dict())
        with pytest.raises(layeropt.LayeroptError, match="no_step"):
            layeropt.backward(scaler.scale(model(x).square().mean()), scaler=scaler)
        assert all(torch.equal(a, p) for a, p in zip(before, model.parameters()))
        assert_same(state, opt.state_dict())
        assert all(p.grad is None for p in model.parameters())


# gradients layeropt.backward(max_norm=)'s two passes must count once: where they are
LEAVES = {
    "a module a plain optimizer trains": lambda m, extra: extra.weight,
    "a parameter no optimizer owns": lambda m, extra: m.aux.weight,
    "a gradient already in .grad": lambda m, extra: m[2].weight,
}


@pytest.mark.parametrize("where", list(LEAVES))
def test_two_passes_count_every_gradient_once(where):
    """torch's recipe (backward; clip_grad_norm_(owned); step): a leaf neither hooked
    nor clipped got both passes' gradients (2x); a gradient already in .grad when the
    call began was measured, freed, and the step used the new one alone."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    model.add_module("aux", torch.nn.Linear(8, 1))  # in the model, owned by no optimizer
    extra = torch.nn.Linear(4, 1)  # trained by a plain optimizer
    ref, ref_extra = copy.deepcopy(model), copy.deepcopy(extra)
    x, g0 = torch.randn(3, 4), torch.randn(1, 8)

    def loss(m: torch.nn.Module, e: torch.nn.Module) -> torch.Tensor:
        h = m[1](m[0](x))
        return (m[2](h) + m.aux(h) + e(x)).pow(2).mean()

    owned = lambda m: list(m[0].parameters()) + list(m[2].parameters())  # noqa: E731
    opt = layeropt.SGD(owned(model), lr=0.1)
    layeropt.attach(model, opt)
    ref_opt = torch.optim.SGD(owned(ref), lr=0.1)
    if where == "a gradient already in .grad":
        ref[2].weight.grad, model[2].weight.grad = g0.clone(), g0.clone()
    loss(ref, ref_extra).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(owned(ref), 0.05)
    ref_opt.step()
    norm = layeropt.backward(loss(model, extra), max_norm=0.05, parameters=owned(model))
    opt.step()
    assert_same(norm, ref_norm)
    assert_same(LEAVES[where](model, extra).grad if where != "a gradient already in .grad"
                else model[2].weight.detach(),
                LEAVES[where](ref, ref_extra).grad if where != "a gradient already in .grad"
                else ref[2].weight.detach())
    assert_models_equal(ref, model)


@pytest.mark.parametrize("owner", ["no optimizer", "the layeropt optimizer"])
def test_a_frozen_layers_leftover_gradient_is_measured_and_clipped(owner):
    """A layer frozen with a gradient still in ``.grad`` (no optimizer owns it, so no
    zero_grad dropped it; or set by hand): torch's clip_grad_norm_ measures and scales
    every ``.grad`` it is given, frozen or not, and step() applies an owned one. It was
    left out of the norm (the last bits of the clip coefficient: the loop fuzzer's
    chaos seed 1215)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model.add_module("aux", torch.nn.Linear(8, 2))
    ref = copy.deepcopy(model)
    x = torch.randn(3, 4)
    own = lambda m: [*m[0].parameters(), *m[2].parameters()] + (  # noqa: E731
        [*m.aux.parameters()] if owner != "no optimizer" else [])
    opt, ref_opt = layeropt.Adam(own(model), lr=0.01), torch.optim.Adam(own(ref), lr=0.01)
    layeropt.attach(model, opt)
    for m in (ref, model):
        m.aux.weight.grad = torch.full_like(m.aux.weight, 0.5)  # left from before
        m.aux.requires_grad_(False)

    def loss(m: torch.nn.Module) -> torch.Tensor:
        return m[2](m[1](m[0](x))).pow(2).mean()

    loss(ref).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
    ref_opt.step()
    norm = layeropt.backward(loss(model), max_norm=0.05)
    opt.step()
    assert_same(norm, ref_norm)
    assert_models_equal(ref, model)
    assert_same(opt.state_dict(), ref_opt.state_dict())
    if owner == "no optimizer":  # (scaled in place, as torch's clip leaves it)
        assert_same(model.aux.weight.grad, ref.aux.weight.grad)


def test_scaled_backward_reaching_an_optimizer_not_given_is_refused():
    """Its gradients would step still scaled (scaler.step(opt) unscales them)."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opts = [layeropt.SGD(model[i].parameters(), lr=0.1) for i in (0, 1)]
    layeropt.attach(model, opts)
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu")
    with pytest.raises(layeropt.LayeroptError, match="not given to it"):
        layeropt.backward(scaler.scale(model(torch.randn(3, 4)).sum()), opts[0], scaler=scaler)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("opt_name", ["Adagrad", "Adam"])
def test_skipped_step_keeps_zeroed_gradients_as_torch(opt_name):
    """GradScaler's first step overflows and is skipped; zero_grad(set_to_none=False) keeps a
    zero .grad for every parameter that had one; a LayerNorm used on even steps only is
    then stepped by torch on its zero gradient (Adagrad's step count moves) - by layeropt too."""
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"lin": torch.nn.Linear(4, 4), "norm": torch.nn.LayerNorm(4)})
    ref = copy.deepcopy(model)
    cls = getattr(torch.optim, opt_name)
    opt = layeropt.in_backward(cls)(model.parameters(), lr=0.1)
    ref_opt = cls(ref.parameters(), lr=0.1)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**4) for _ in range(2)]
    with layeropt.attach(model, opt):
        for step in range(4):
            x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
            for m, o, scaler, lo in ((ref, ref_opt, scalers[0], False),
                                     (model, opt, scalers[1], True)):
                h = m["lin"](x)
                h = m["norm"](h) if step % 2 == 0 else h
                scaled_step(lo, h.square().sum() * (float("inf") if step == 0 else 1.0), o,
                            scaler)
                o.zero_grad(set_to_none=False)
    assert_models_equal(model, ref)
    assert_same(opt.state_dict(), ref_opt.state_dict())


def _gan_with_a_scaler(lo: bool, given: bool) -> list[torch.Tensor]:
    """A GAN with one GradScaler for both losses (torch's AMP recipe for several
    optimizers); the generator's loss overflows at step 2 (its step skipped, the scale
    halved). layeropt's: D through ``layeropt.backward(..., optD, scaler=)``, G's loss
    inside ``optD.no_step()``, D's scaled gradients held there as torch's ``.grad``."""
    torch.manual_seed(0)
    G, D = torch.nn.Linear(2, 3), torch.nn.Linear(3, 1)
    lib = layeropt if lo else torch.optim
    optG, optD = lib.Adam(G.parameters(), lr=1e-2), lib.Adam(D.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=1000.0, growth_interval=1)
    handles = [layeropt.attach(G, optG), layeropt.attach(D, optD)] if lo else []
    gen = torch.Generator().manual_seed(1)
    for step in range(4):
        real, z = torch.randn(4, 3, generator=gen), torch.randn(4, 2, generator=gen)
        optD.zero_grad()
        fake = G(z)
        loss_d = (F.softplus(-D(real)) + F.softplus(D(fake.detach()))).mean()
        if lo:
            layeropt.backward(scaler.scale(loss_d), optD, scaler=scaler)
        else:
            scaler.scale(loss_d).backward()
        scaler.step(optD)
        optG.zero_grad()
        loss_g = F.softplus(-D(fake)).mean() * (1e30 if step == 2 else 1.0)
        with optD.no_step() if lo else contextlib.nullcontext():
            if lo:
                layeropt.backward(scaler.scale(loss_g), optG if given else None, scaler=scaler)
            else:
                scaler.scale(loss_g).backward()
        scaler.step(optG)
        scaler.update()
    for h in handles:
        h.remove()
    return [*G.parameters(), *D.parameters(), torch.tensor(scaler.get_scale())]


@pytest.mark.parametrize("given", [True, False], ids=["optG given", "default"])
def test_a_gan_with_one_scaler_holds_the_discriminators_scaled_gradients(given):
    """Another attached optimizer inside its ``no_step()`` is not refused as one stepping
    on scaled gradients (before 2026-12-07 it was, with either form): it holds them, and
    its ``scaler.step`` unscales them as torch's does."""
    for p, q in zip(_gan_with_a_scaler(True, given), _gan_with_a_scaler(False, given)):
        assert_same(p.detach(), q.detach())
