"""state_dict both ways, resume, LR schedulers, add_param_group, remove, in_backward."""

from __future__ import annotations

import contextlib
import copy
import inspect
import io
import pickle
import warnings
from typing import Any

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim import swa_utils

import layeropt
from harness import assert_models_equal, assert_same, fully_shard, needs_fsdp2
from test_properties import _plain
from layeropt.models import make_model

FAMILY = ["SGD", "Adam", "AdamW", "Adagrad", "RMSprop"] + (
    ["Adafactor"] if hasattr(torch.optim, "Adafactor") else []
)
KW = {"SGD": dict(lr=0.1, momentum=0.9), "Adagrad": dict(lr=0.1)}


def _kw(name):
    return KW.get(name, dict(lr=0.01))


def _steps(model, opt, batch_fn, loss_fn, gen, n):
    for _ in range(n):
        loss_fn(model, batch_fn(gen)).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", FAMILY)
def test_same_class_hierarchy_and_signature(name):
    lo, th = getattr(layeropt, name), getattr(torch.optim, name)
    assert issubclass(lo, th) and issubclass(lo, layeropt.InBackwardOptimizer)
    assert inspect.signature(lo) == inspect.signature(th)
    assert layeropt.in_backward(th) is lo


@pytest.mark.parametrize("direction", ["torch->layeropt", "layeropt->torch"])
@pytest.mark.parametrize("name", FAMILY)
def test_state_dict_moves_both_ways_and_resumes_bitwise(name, direction):
    model, batch_fn, loss_fn = make_model("gpt")
    uninterrupted = copy.deepcopy(model)
    ref_opt = getattr(torch.optim, name)(uninterrupted.parameters(), **_kw(name))
    gen_ref = torch.Generator().manual_seed(5)
    _steps(uninterrupted, ref_opt, batch_fn, loss_fn, gen_ref, 4)

    src_cls, dst_cls = getattr(torch.optim, name), getattr(layeropt, name)
    if direction == "layeropt->torch":
        src_cls, dst_cls = dst_cls, src_cls
    gen = torch.Generator().manual_seed(5)
    first = copy.deepcopy(model)
    src = src_cls(first.parameters(), **_kw(name))
    if layeropt.is_in_backward(src):
        layeropt.attach(first, src)
    _steps(first, src, batch_fn, loss_fn, gen, 2)
    buf = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": src.state_dict()}, buf)
    buf.seek(0)
    ckpt = torch.load(buf)

    second = copy.deepcopy(model)
    second.load_state_dict(ckpt["model"])
    dst = dst_cls(second.parameters(), **_kw(name))
    dst.load_state_dict(ckpt["opt"])
    if layeropt.is_in_backward(dst):
        layeropt.attach(second, dst)
    _steps(second, dst, batch_fn, loss_fn, gen, 2)
    assert_models_equal(uninterrupted, second)
    assert_same(ref_opt.state_dict(), dst.state_dict())


def _lr_run(opt_cls, model, batch_fn, loss_fn, attach, resume_at=None):
    opt = opt_cls(model.parameters(), lr=0.05, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    if attach:
        layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(2)
    lrs = []
    for i in range(4):
        if resume_at is not None and i == resume_at:
            state = (copy.deepcopy(opt.state_dict()), copy.deepcopy(sched.state_dict()))
            opt2 = opt_cls(model.parameters(), lr=123.0, momentum=0.9)  # lr overwritten by load
            for h in list(opt._lo_engine.attachments):
                h.remove()
            opt2.load_state_dict(state[0])
            sched = torch.optim.lr_scheduler.StepLR(opt2, step_size=1, gamma=0.5)
            sched.load_state_dict(state[1])
            opt = opt2
            layeropt.attach(model, opt)
        loss_fn(model, batch_fn(gen)).backward()
        opt.step()
        opt.zero_grad()
        sched.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


@pytest.mark.parametrize("resume_at", [None, 2])
def test_lr_scheduler_takes_effect_next_backward_without_warnings(resume_at):
    model, batch_fn, loss_fn = make_model("mlp")
    ref = copy.deepcopy(model)
    ref_lrs = _lr_run(torch.optim.SGD, ref, batch_fn, loss_fn, attach=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        lrs = _lr_run(layeropt.SGD, model, batch_fn, loss_fn, attach=True, resume_at=resume_at)
    assert lrs == ref_lrs
    assert_models_equal(ref, model)


def test_scheduler_without_explicit_step_call_does_not_warn():
    model, batch_fn, loss_fn = make_model("mlp")
    opt = layeropt.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 0.9**i)
    layeropt.attach(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            loss_fn(model, batch_fn(torch.Generator().manual_seed(0))).backward()
            sched.step()  # no opt.step(): the hooks stepped


def test_add_param_group_after_attach_hooks_new_params():
    model, batch_fn, loss_fn = make_model("mlp")
    ref = copy.deepcopy(model)
    head = list(model.head.parameters())
    body = [p for p in model.parameters() if all(p is not h for h in head)]
    opt = layeropt.Adam(body, lr=0.01)
    handle = layeropt.attach(model, opt)
    opt.add_param_group({"params": head, "lr": 0.001})
    ref_head = list(ref.head.parameters())
    ref_opt = torch.optim.Adam([p for p in ref.parameters() if all(p is not h for h in ref_head)], lr=0.01)
    ref_opt.add_param_group({"params": ref_head, "lr": 0.001})
    gen, gen2 = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)
    for _ in range(2):
        loss_fn(model, batch_fn(gen)).backward()
        assert all(p.grad is None for p in model.parameters())
        loss_fn(ref, batch_fn(gen2)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert sum(len(b.params) for b in handle.buckets) == len(list(model.parameters()))
    assert_models_equal(ref, model)


def test_remove_restores_plain_torch_behaviour():
    model, batch_fn, loss_fn = make_model("mlp")
    ref = copy.deepcopy(model)
    opt = layeropt.Adam(model.parameters(), lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    with layeropt.attach(model, opt) as handle:
        assert opt.attached and len(handle.buckets) == 4
    assert not opt.attached and handle.buckets == []
    data = batch_fn(torch.Generator().manual_seed(0))
    loss_fn(model, data).backward()
    assert all(p.grad is not None for p in model.parameters())  # hooks gone
    loss_fn(ref, data).backward()
    for o in (opt, ref_opt):
        o.step()
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())
    layeropt.attach(model, opt).remove()  # re-attaching after remove is allowed


def test_unattached_layeropt_optimizer_is_torch():
    model, batch_fn, loss_fn = make_model("unet")
    ref = copy.deepcopy(model)
    opt = layeropt.AdamW(model.parameters(), lr=0.01)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        data = batch_fn(gen)
        for m, o in ((model, opt), (ref, ref_opt)):
            loss_fn(m, data).backward()
            o.step()
            o.zero_grad()
    assert_models_equal(ref, model)


def test_step_after_attach_updates_hand_assigned_gradients():
    model = torch.nn.Linear(3, 2)
    ref = copy.deepcopy(model)
    opt = layeropt.SGD(model.parameters(), lr=0.5)
    layeropt.attach(model, opt)
    g = torch.randn(2, 3)
    model.weight.grad = g.clone()
    ref.weight.grad = g.clone()
    opt.step()
    torch.optim.SGD(ref.parameters(), lr=0.5).step()
    assert model.weight.grad is None
    assert_models_equal(ref, model)


@pytest.mark.parametrize("hook", ["register_step_pre_hook", "register_step_post_hook"])
def test_step_hooks_fire_once_per_step_call_not_per_bucket(hook):
    """docs/how-it-works.md: ``register_step_pre_hook`` / ``register_step_post_hook`` run
    on ``step()`` calls, not once per bucket: none during backward, one per ``step()``,
    with the arguments torch.optim's get, while training stays torch.optim's."""
    model, batch_fn, loss_fn = make_model("mlp")
    ref = copy.deepcopy(model)
    opt, ref_opt = layeropt.Adam(model.parameters()), torch.optim.Adam(ref.parameters())
    calls: dict[str, list] = {"torch": [], "layeropt": []}
    for side, o in (("torch", ref_opt), ("layeropt", opt)):
        getattr(o, hook)(lambda o, args, kwargs, side=side: calls[side].append((o, args, kwargs)))
    handle = layeropt.attach(model, opt)
    assert len(handle.buckets) == 4  # (stepped one by one under bucket_cap_mb=0)
    gen = torch.Generator().manual_seed(0)
    for step in range(3):
        data = batch_fn(gen)
        loss_fn(ref, data).backward()
        loss_fn(model, data).backward()
        assert opt.stepped_in_backward == len(list(model.parameters()))
        assert len(calls["layeropt"]) == step  # no call for any bucket in backward
        ref_opt.step()
        opt.step()
        assert len(calls["layeropt"]) == len(calls["torch"]) == step + 1
        ref_opt.zero_grad()
        opt.zero_grad()
    for side, o in (("torch", ref_opt), ("layeropt", opt)):  # (the optimizer, (self,), {})
        assert all(c == (o, (o,), {}) and c[0] is o for c in calls[side]), side
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


AVERAGES = {  # AveragedModel's keyword arguments
    "swa": lambda: dict(),
    "ema-multi_avg_fn": lambda: dict(multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9)),
    "ema-avg_fn": lambda: dict(avg_fn=swa_utils.get_ema_avg_fn(0.9)),
    "ema-use_buffers": lambda: dict(multi_avg_fn=swa_utils.get_ema_multi_avg_fn(0.9),
                                    use_buffers=True),
}


@pytest.mark.parametrize("opt_name,kw", [("SGD", dict(lr=0.1, momentum=0.9)),
                                         ("AdamW", dict(lr=0.01, weight_decay=0.1))],
                         ids=["SGD", "AdamW"])
@pytest.mark.parametrize("average", list(AVERAGES))
@pytest.mark.parametrize("arch", ["gpt", "unet"])  # tied embedding; batch norm buffers
def test_averaged_model_after_step_is_exact(arch, average, opt_name, kw):
    """docs/rules.md: "``AveragedModel`` after ``step()`` is exact": an SWA / EMA average
    (``torch.optim.swa_utils``) updated after each ``step()`` equals the same loop with
    torch.optim bit for bit - the averaged model and the model."""
    model, batch_fn, loss_fn = make_model(arch)
    ref = copy.deepcopy(model)
    ref_opt = getattr(torch.optim, opt_name)(ref.parameters(), **kw)
    opt = getattr(layeropt, opt_name)(model.parameters(), **kw)
    handle = layeropt.attach(model, opt)
    ref_avg = swa_utils.AveragedModel(ref, **AVERAGES[average]())
    avg = swa_utils.AveragedModel(model, **AVERAGES[average]())  # (of the attached model)
    gen = torch.Generator().manual_seed(0)
    for _ in range(4):
        data = batch_fn(gen)
        loss_fn(ref, data).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        ref_avg.update_parameters(ref)
        loss_fn(model, data).backward()
        opt.step()
        opt.zero_grad()
        avg.update_parameters(model)
    handle.remove()
    assert int(avg.n_averaged) == int(ref_avg.n_averaged) == 4
    assert_same(ref_avg.state_dict(), avg.state_dict())  # parameters, buffers, n_averaged
    assert_models_equal(ref_avg.module, avg.module)
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())
    assert not any(torch.equal(p, q) for p, q in zip(avg.parameters(), model.parameters()))


class Lion(torch.optim.Optimizer):
    """A minimal third-party optimizer with per-parameter state."""

    def __init__(self, params, lr=1e-4, betas=(0.9, 0.99)):
        super().__init__(params, dict(lr=lr, betas=betas))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            b1, b2 = group["betas"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                m = self.state[p].setdefault("exp_avg", torch.zeros_like(p))
                p.add_(torch.sign(m * b1 + p.grad * (1 - b1)), alpha=-group["lr"])
                m.mul_(b2).add_(p.grad, alpha=1 - b2)


GENERIC = [
    (torch.optim.NAdam, dict(lr=0.01)),
    (torch.optim.RAdam, dict(lr=0.01, decoupled_weight_decay=True, weight_decay=0.1)),
    (torch.optim.Adamax, dict(lr=0.01)),
    (torch.optim.Adadelta, dict(lr=0.5)),
    (torch.optim.ASGD, dict(lr=0.01)),
    (torch.optim.Rprop, dict(lr=0.01)),
    (Lion, dict(lr=0.01)),
]


@pytest.mark.parametrize("cls,kw", GENERIC, ids=[c.__name__ for c, _ in GENERIC])
def test_in_backward_wraps_any_per_parameter_optimizer(cls, kw):
    lo_cls = layeropt.in_backward(cls)
    assert issubclass(lo_cls, cls) and layeropt.in_backward(cls) is lo_cls
    model, batch_fn, loss_fn = make_model("unet")
    ref = copy.deepcopy(model)
    ref_opt, opt = cls(ref.parameters(), **kw), lo_cls(model.parameters(), **kw)
    layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        data = batch_fn(gen)
        loss_fn(ref, data).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn(model, data).backward()
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


@pytest.mark.skipif(not hasattr(torch.optim, "Muon"), reason="torch.optim.Muon: torch >= 2.9")
@pytest.mark.parametrize("muon_kw", [
    dict(lr=0.02, weight_decay=0.1, adjust_lr_fn="match_rms_adamw"),
    dict(lr=0.02, momentum=0.9, nesterov=False, adjust_lr_fn="original", ns_steps=3),
    dict(lr=0.05, weight_decay=0.0, ns_coefficients=(3.0, -3.2, 1.2), eps=1e-5),
], ids=["rms-adamw", "original-no-nesterov", "coefficients"])
def test_muon_for_matrices_adamw_for_the_rest(muon_kw):
    """torch's Muon recipe: Muon for the hidden 2D weights, AdamW for embeddings, head,
    norms and biases - two optimizers attached to one model; micro-batches and a global
    clip over both, as ``clip_grad_norm_(model.parameters())`` before both steps."""
    assert issubclass(layeropt.Muon, torch.optim.Muon)
    assert inspect.signature(layeropt.Muon) == inspect.signature(torch.optim.Muon)

    def split(m):
        hidden = [p for n, p in m.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
        ids = {id(p) for p in hidden}
        return hidden, [p for p in m.parameters() if id(p) not in ids]

    model, batch_fn, loss_fn = make_model("gpt")
    ref = copy.deepcopy(model)
    (rh, rr), (h, r) = split(ref), split(model)
    assert rh and rr
    ref_opts = [torch.optim.Muon(rh, **muon_kw), torch.optim.AdamW(rr, lr=1e-2)]
    opts = [layeropt.Muon(h, **muon_kw), layeropt.AdamW(r, lr=1e-2)]
    layeropt.attach(model)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        batches = [batch_fn(gen), batch_fn(gen)]
        for data in batches:
            loss_fn(ref, data).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
        for o in ref_opts:
            o.step()
            o.zero_grad()
        with opts[0].no_step(), opts[1].no_step():
            loss_fn(model, batches[0]).backward()
        norm = layeropt.backward(loss_fn(model, batches[1]), max_norm=0.5)
        assert norm > 0.5  # (the clip fires)
        for o in opts:
            o.step()
            o.zero_grad()
    assert_models_equal(ref, model)
    for o, ro in zip(opts, ref_opts):
        assert_same(ro.state_dict(), o.state_dict())


@pytest.mark.parametrize("cap_mb", [0.0, 0.05, 0.25, 1.0, 100.0])
def test_bucket_cap_steps_complete_buckets_together_and_stays_exact(cap_mb):
    model, batch_fn, loss_fn = make_model("gpt")
    ref = copy.deepcopy(model)
    opt = layeropt.Adam(model.parameters(), lr=0.01)
    handle = layeropt.attach(model, opt, bucket_cap_mb=cap_mb)
    calls = []
    original = opt._lo_stepper  # every update's call of torch's step (engine/subset.py)
    opt._lo_stepper = lambda o, params, key: (calls.append(len(params)),
                                              original(o, params, key))
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        data = batch_fn(gen)
        loss_fn(ref, data).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn(model, data).backward()
    n_params = sum(1 for _ in model.parameters())
    assert sum(calls) == 2 * n_params
    if cap_mb == 0.0:  # one call per layer bucket
        assert len(calls) == 2 * len(handle.buckets)
    elif cap_mb >= 0.25:  # the whole tiny model waits for the end of backward: one call
        assert calls == [n_params, n_params]
    else:
        assert 2 < len(calls) < 2 * len(handle.buckets)
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


def _public(obj):
    return {k for k in obj.__dict__ if not k.startswith("_")}


@pytest.mark.parametrize("cls", [
    layeropt.SGD, layeropt.Adam, layeropt.AdamW, layeropt.Adagrad, layeropt.RMSprop,
    *([layeropt.Adafactor] if hasattr(layeropt, "Adafactor") else []),
    *(layeropt.in_backward(getattr(torch.optim, n))
      for n in ("NAdam", "RAdam", "Adamax", "ASGD", "Adadelta", "Rprop")),
], ids=lambda c: c.__name__)
def test_deepcopy_and_pickle_keep_every_public_attribute(cls):
    """torch's test_deepcopy_copies_all_public_attrs, and a pickle round trip."""
    model = torch.nn.Linear(3, 2)
    opt = cls(model.parameters(), lr=0.1)
    layeropt.attach(model, opt)
    layeropt.backward(model(torch.ones(3)).sum(), opt, max_norm=1.0)
    assert opt.last_grad_norm is not None
    for twin in (copy.deepcopy(opt), pickle.loads(pickle.dumps(opt))):
        assert _public(twin) == _public(opt)
        assert torch.equal(twin.last_grad_norm, opt.last_grad_norm)


@pytest.mark.parametrize("reattach", [False, True])
@pytest.mark.parametrize("swap", [False, True])
def test_module_conversion_after_attach(swap, reattach):
    """model.double() after attach, with and without swapping parameters on conversion;
    attaching again (the same handle) follows the swap before the first backward."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(swap)
    try:
        model, batch_fn, loss_fn = make_model("mlp")
        ref = copy.deepcopy(model)
        opt = layeropt.SGD(model.parameters(), lr=0.1, momentum=0.9)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        layeropt.attach(model, opt)
        model.double()
        ref.double()
        if reattach:
            layeropt.attach(model, opt)
        gen = torch.Generator().manual_seed(1)
        for step in range(3):
            x, y = (t.double() for t in batch_fn(gen))
            loss_fn(ref, (x, y)).backward()
            ref_opt.step()
            ref_opt.zero_grad()
            loss_fn(model, (x, y)).backward()
            if step > 0 or not swap or reattach:  # swapped: hooks back at the first step()
                assert all(p.grad is None for p in model.parameters())
            opt.step()
            opt.zero_grad()
        assert_models_equal(ref, model)
        assert_same(ref_opt.state_dict(), opt.state_dict())
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


@pytest.mark.parametrize("kind", ["plain", "ddp", pytest.param("fsdp2", marks=needs_fsdp2)])
@pytest.mark.parametrize("how", ["backward", "layeropt.backward(max_norm)"])
def test_a_users_post_accumulate_hook_registered_after_attach_runs_before_the_update(
        process_group, kind, how):
    """torch runs a parameter's post-accumulate-grad hooks in registration order, then
    step() reads .grad: a hook registered after attach (gradient noise, per-parameter
    scaling, logging) must see the gradient and change what is applied and measured,
    also for the parameter whose gradient completes its bucket (it used to be stepped
    before that hook ran, and the hook found .grad None; DDP's comm hook always ran
    after it)."""
    seen: list[bool] = []

    def scale(p: torch.Tensor) -> None:
        seen.append(p.grad is not None)
        if p.grad is not None:
            p.grad.mul_(0.5)

    def run(lib: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(  # (the 640x640 layer, 1.6 MB, is stepped in its hook
            # under the default bucket_cap_mb too)
            torch.nn.Linear(8, 640), torch.nn.GELU(), torch.nn.Linear(640, 640),
            torch.nn.Linear(640, 1))
        if kind == "ddp":
            model = DDP(model)
        elif kind == "fsdp2":
            for layer in (model[0], model[2], model[3]):
                fully_shard(layer)
            fully_shard(model)
        params = list(model.parameters())  # two optimizers: the rule is each engine's
        opts = [lib.AdamW(params[:4], lr=0.01), lib.SGD(params[4:], lr=0.1, momentum=0.9)]
        if lib is layeropt:
            layeropt.attach(model, opts)
        for p in params:
            p.register_post_accumulate_grad_hook(scale)
        for _ in range(2):
            loss = model(torch.randn(3, 8)).square().mean()
            if how == "backward":
                loss.backward()
            elif lib is layeropt:
                layeropt.backward(loss, max_norm=0.01)
            else:
                loss.backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.01)
            for opt in opts:
                opt.step()
                opt.zero_grad()
        return _plain(list(model.parameters())), _plain([o.state_dict() for o in opts])

    ref_params, ref_state = run(torch.optim)
    assert all(seen)
    seen.clear()
    params, state = run(layeropt)
    assert all(seen)
    assert_same(ref_params, params)
    assert_same(ref_state, state)


@pytest.mark.parametrize("kind", ["plain", "ddp", pytest.param("fsdp2", marks=needs_fsdp2)])
@pytest.mark.parametrize("loop", ["gradient penalty", "step() after it"])
def test_backward_with_create_graph_is_held_for_step_as_torch_uses_it(process_group, kind, loop):
    """backward(create_graph=True) keeps the gradients' graph for something the loop
    does before the update (a gradient penalty's second backward): its gradients are
    held, as under no_step(), and stepped by the next stepping backward or by step() -
    the same numbers, no memory saved for it. (They used to be applied and freed at
    once: the penalty found .grad None.) Where torch itself cannot run the loop (DDP
    refuses create_graph; FSDP2's reduced gradients carry no graph), layeropt raises
    too."""
    def run(lib: Any) -> tuple[list[torch.Tensor], dict[str, Any]]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                    torch.nn.Linear(8, 1))
        if kind == "ddp":
            model = DDP(model)
        elif kind == "fsdp2":
            fully_shard(model)
        opt = lib.Adam(model.parameters(), lr=0.01)
        if lib is layeropt:
            layeropt.attach(model, opt)
        for _ in range(3):
            loss = model(torch.randn(5, 4)).square().mean()
            loss.backward(create_graph=True)
            if loop == "gradient penalty":
                penalty = sum(p.grad.square().sum() for p in model.parameters())
                penalty.backward()
            opt.step()
            opt.zero_grad()
        return _plain(list(model.parameters())), _plain(opt.state_dict())

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # (torch's create_graph warning)
        try:
            ref_params, ref_state = run(torch.optim)
        except RuntimeError:  # torch cannot run this loop on this kind
            assert kind != "plain"
            with pytest.raises((RuntimeError, AttributeError)):
                run(layeropt)
            return
        params, state = run(layeropt)
    assert_same(ref_params, params)
    assert_same(ref_state, state)


# torch.nn.utils' reparametrizations: the trained tensors are the parametrization's
# originals (weight_norm's g and v, orthogonal's base), which backward reads to compute
# each other's gradients; spectral_norm's power iteration updates buffers in forward;
# ``parametrize.cached()`` computes the weight once for two uses; the old hook-based
# weight_norm keeps weight_g / weight_v
def _reparametrized(kind: str) -> torch.nn.Module:
    from torch.nn.utils import parametrizations as P

    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    {"weight_norm": lambda: P.weight_norm(m[0]), "spectral_norm": lambda: P.spectral_norm(m[2]),
     "orthogonal": lambda: P.orthogonal(m[2]), "cached": lambda: P.weight_norm(m[0]),
     "old_weight_norm": lambda: torch.nn.utils.weight_norm(m[0])}[kind]()
    return m


@pytest.mark.parametrize("opt_name", ["Adam", "SGD"])
@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "orthogonal", "cached",
                                  "old_weight_norm"])
def test_reparametrized_weights_are_exact(kind, opt_name):
    from torch.nn.utils import parametrize

    results = []
    for layer in (False, True):
        torch.manual_seed(0)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the old weight_norm is deprecated)
            model = _reparametrized(kind)
        cls = getattr(layeropt if layer else torch.optim, opt_name)
        opt = cls(model.parameters(), **_kw(opt_name))
        handle = layeropt.attach(model, opt) if layer else None
        gen = torch.Generator().manual_seed(1)
        for _ in range(3):
            x = torch.randn(5, 4, generator=gen)
            with parametrize.cached() if kind == "cached" else contextlib.nullcontext():
                out = model(x) + model(x) if kind == "cached" else model(x)
            out.square().mean().backward()
            opt.step()
            opt.zero_grad()
        if handle is not None:
            assert all(p.grad is None for p in model.parameters())
            handle.remove()
        results.append((model.state_dict(), opt.state_dict()))
    assert_same(results[1], results[0])
