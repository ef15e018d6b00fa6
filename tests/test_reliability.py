"""Faults, resume, lifecycle, long runs and other autograd features."""

from __future__ import annotations

import contextlib
import copy
import gc
import pickle
import runpy
import subprocess
import sys
import textwrap
import warnings
import weakref
from typing import Any

import pytest
import torch

import layeropt
from torch.nn.parallel import DistributedDataParallel as DDP

from harness import Boom, assert_models_equal, assert_same, fully_shard, needs_fsdp2
from layeropt.memory import PeakMemory
from layeropt.models import make_model


def _chain(n=4):
    torch.manual_seed(0)
    return torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(n))


class _Interrupt(torch.autograd.Function):
    """Ctrl-C in the middle of backward."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        raise KeyboardInterrupt


def _raising_hook(grad):
    raise ValueError("boom from a tensor hook")


def _fault(h, kind):
    if kind == "function":
        return Boom.apply(h)
    if kind == "interrupt":
        return _Interrupt.apply(h)
    h = h.view_as(h)  # a non-leaf whose gradient hook raises
    h.register_hook(_raising_hook)
    return h


def _run(layers, x, boom_at=None, kind="function"):
    h = x
    for i, layer in enumerate(layers):
        h = layer(_fault(h, kind) if i == boom_at else h)
    return h.square().mean()


FAULTS = {"function": (ValueError, "boom"), "hook": (ValueError, "tensor hook"),
          "interrupt": (KeyboardInterrupt, None)}


@pytest.mark.parametrize("kind", list(FAULTS))
@pytest.mark.parametrize("opt_name", ["SGD", "Adam"])
def test_exception_mid_backward_each_param_fully_stepped_or_untouched(opt_name, kind):
    kw = dict(lr=0.1, momentum=0.9) if opt_name == "SGD" else dict(lr=0.1)
    layers = _chain()
    ref = copy.deepcopy(layers)
    opt = getattr(layeropt, opt_name)(layers.parameters(), **kw)
    ref_opt = getattr(torch.optim, opt_name)(ref.parameters(), **kw)
    layeropt.attach(layers, opt, bucket_cap_mb=0)  # each layer stepped at once
    x = torch.randn(2, 4)
    _run(layers, x).backward()  # one good step: state exists
    _run(ref, x).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    before = copy.deepcopy(layers.state_dict())
    error, match = FAULTS[kind]
    with pytest.raises(error, match=match), pytest.warns(UserWarning, match=(
            r"a backward raised after layeropt had already updated 4 parameter\(s\) in it")):
        _run(layers, x, boom_at=2, kind=kind).backward()
    # layers 3 and 2 were complete before the fault: stepped; 0 and 1 never got a gradient.
    stepped = {id(p) for p in opt.stepped_params}
    for i, layer in enumerate(layers):
        for n, p in layer.named_parameters():
            changed = not torch.equal(before[f"{i}.{n}"], p)
            assert changed == (id(p) in stepped) == (i >= 2)
            if "step" in opt.state[p]:
                assert opt.state[p]["step"].item() == (2 if i >= 2 else 1)
    # The reference takes the same partial step: update layers 2-3 only.
    ref_out = _run(ref, x)
    ref_out.backward()
    for i in (0, 1):
        for p in ref[i].parameters():
            p.grad = None
    ref_opt.step()
    ref_opt.zero_grad()
    assert_models_equal(ref, layers)
    # torch.optim would have applied none of that backward: the step's end says so, once.
    with pytest.raises(layeropt.BackwardStateError, match=r"zero_grad\(\) follows a backward "
                       r"that raised .* updated 4 parameter"):
        opt.zero_grad()
    # No stale "inside backward" state: the next step matches torch.
    opt.zero_grad()
    _run(layers, x).backward()
    _run(ref, x).backward()
    ref_opt.step()
    ref_opt.zero_grad()
    assert all(p.grad is None for p in layers.parameters())
    assert_models_equal(ref, layers)
    assert_same(ref_opt.state_dict(), opt.state_dict())


def _oom_skip_loop(m, o, xs, zero):
    """fairseq's recovery: a backward that runs out of memory is skipped, its gradients
    dropped by ``zero_grad()`` (``zero``) or left to the next step."""
    for k, x in enumerate(xs):
        h = m[0](x)
        if k == 0:  # out of memory after the last layer's gradient landed
            h = h.view_as(h)
            h.register_hook(lambda g: (_ for _ in ()).throw(RuntimeError("out of memory")))
        try:
            m[1:](h).square().mean().backward()
        except RuntimeError:
            if zero:
                o.zero_grad()
            continue
        o.step()
        o.zero_grad()


@pytest.mark.parametrize("zero", [True, False], ids=["zero_grad", "no zero_grad"])
def test_a_backward_that_raised_before_any_update_leaves_torchs_gradients(zero):
    """Nothing was stepped yet (the model is one bucket): what landed stays in .grad, as
    torch leaves it, so skipping the batch or carrying it on are both exact (carrying it
    on differed before: the partial gradients were freed)."""
    layers = torch.nn.Sequential(*_chain())
    ref = copy.deepcopy(layers)
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    opt = layeropt.Adam(layers.parameters(), lr=0.1)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.1)
    layeropt.attach(layers, opt, bucket_cap_mb=1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing was applied: nothing to say
        _oom_skip_loop(layers, opt, xs, zero)
    _oom_skip_loop(ref, ref_opt, xs, zero)
    assert_models_equal(ref, layers)
    assert_same(ref_opt.state_dict(), opt.state_dict())


def test_a_backward_that_raised_after_updates_is_said_and_refused():
    """Layers stepped before the fault cannot be unstepped: a warning at the fault, and the
    recovery's zero_grad() is refused once, naming the way to stay exact."""
    layers = torch.nn.Sequential(*_chain())
    opt = layeropt.Adam(layers.parameters(), lr=0.1)
    layeropt.attach(layers, opt, bucket_cap_mb=0)
    xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(k)) for k in range(3)]
    with pytest.warns(UserWarning, match=r"torch.optim would have applied none"), \
            pytest.raises(layeropt.BackwardStateError,
                          match=r"zero_grad\(\) follows a backward that raised.*checkpoint"):
        _oom_skip_loop(layers, opt, xs, True)
    opt.zero_grad()  # said once: the loop may go on
    layers(xs[1]).square().mean().backward()
    opt.step()


def test_non_finite_gradients_behave_like_torch_by_default():
    layers = _chain(2)
    ref = copy.deepcopy(layers)
    opt = layeropt.SGD(layers.parameters(), lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    layeropt.attach(layers, opt)
    x = torch.tensor([[float("nan"), 1.0, 2.0, 3.0]])
    _run(layers, x).backward()
    _run(ref, x).backward()
    ref_opt.step()
    for p, q in zip(ref.parameters(), layers.parameters()):
        assert torch.equal(p.isnan(), q.isnan())
        assert torch.equal(p.nan_to_num(), q.nan_to_num())


def test_autograd_grad_and_backward_inputs_step_nothing_unexpected():
    model, batch_fn, loss_fn = make_model("mlp")
    opt = layeropt.Adam(model.parameters(), lr=0.1)
    layeropt.attach(model, opt)
    data = batch_fn(torch.Generator().manual_seed(0))
    before = copy.deepcopy(model.state_dict())
    x = data[0].clone().requires_grad_(True)
    (gx,) = torch.autograd.grad(loss_fn(model, (x, data[1])), x, create_graph=True)
    assert_same(before, model.state_dict())  # a gradient penalty computes, steps nothing
    # backward(inputs=...) steps only the parameters it accumulates into
    head = list(model.head.parameters())
    loss_fn(model, data).backward(inputs=head)
    for n, p in model.named_parameters():
        assert torch.equal(before[n], p) == (not n.startswith("head"))
    assert len(opt.state) == 2


@pytest.mark.parametrize("accumulate", [False, True])
@pytest.mark.parametrize("deep", [False, True])
def test_retain_graph_double_backward_is_torchs_sum(accumulate, deep):
    """Two backwards over one graph, then step(): held as torch sums them (also when
    the graph saved a weight the first backward would otherwise have updated)."""
    torch.manual_seed(0)
    model = (torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 1)) if deep
             else torch.nn.Linear(3, 1))
    ref = copy.deepcopy(model)
    opt = layeropt.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    layeropt.attach(model, opt)
    x = torch.randn(2, 3)
    loss, ref_loss = (model(x) ** 2).sum(), (ref(x) ** 2).sum()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (held: nothing saved in this step)
        with opt.no_step() if accumulate else contextlib.nullcontext():
            loss.backward(retain_graph=True)
    ref_loss.backward(retain_graph=True)
    loss.backward()
    ref_loss.backward()
    opt.step()
    ref_opt.step()
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


def test_long_run_has_no_growth():
    model, batch_fn, loss_fn = make_model("mlp")
    opt = layeropt.Adam(model.parameters(), lr=1e-3, fused=True)
    handle = layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(0)
    data = batch_fn(gen)
    engine = opt._lo_engine

    def live_bytes():
        with PeakMemory() as mem:
            loss_fn(model, data).backward()
        return mem.end

    for step in range(1000):
        loss_fn(model, data).backward()
        if step == 9:
            at_10 = (live_bytes(), len(engine.train_step.held), engine.backward, len(handle.buckets))
    at_1000 = (live_bytes(), len(engine.train_step.held), engine.backward, len(handle.buckets))
    assert at_10 == at_1000
    assert at_1000[0] == 0  # a step leaves no new live tensors behind


def test_deepcopy_and_pickle_of_attached_model_are_plain_copies():
    model, batch_fn, loss_fn = make_model("mlp")
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    layeropt.attach(model, opt)
    for clone in (copy.deepcopy(model), pickle.loads(pickle.dumps(model))):
        before = copy.deepcopy(model.state_dict())
        loss_fn(clone, batch_fn(torch.Generator().manual_seed(0))).backward()
        assert all(p.grad is not None for p in clone.parameters())  # no hooks copied
        assert_same(before, model.state_dict())  # the original is untouched


def test_deleting_the_optimizer_warns_at_the_next_backward_of_its_model():
    """Only parameters that still train are worth a warning: at their next backward,
    pointing at the user's line; their gradients then stay, as without layeropt."""
    model, batch_fn, loss_fn = make_model("mlp")
    opt = layeropt.Adam(model.parameters())
    handle = layeropt.attach(model, opt)
    opt_ref = weakref.ref(opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # deleting alone says nothing
        del opt
        gc.collect()
    assert opt_ref() is None
    with pytest.warns(RuntimeWarning, match="Keep a reference") as caught:
        loss_fn(model, batch_fn(torch.Generator().manual_seed(0))).backward()
    assert caught[0].filename == __file__
    assert all(p.grad is not None for p in model.parameters())
    assert all(not p._post_accumulate_grad_hooks for p in model.parameters())
    assert repr(handle) == "<layeropt.Attachment removed>"


def test_a_new_optimizer_attaches_where_a_deleted_one_was():
    model, batch_fn, loss_fn = make_model("mlp")
    layeropt.attach(model, layeropt.SGD(model.parameters(), lr=0.1))  # dropped at once
    gc.collect()
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    layeropt.attach(model, opt)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss_fn(model, batch_fn(torch.Generator().manual_seed(0))).backward()
    assert opt.stepped_in_backward == len(list(model.parameters()))


@pytest.mark.parametrize("kind", ["plain", "ddp", "ddp-find-unused",
                                  pytest.param("fsdp2", marks=needs_fsdp2)])
def test_discarding_model_and_optimizer_together_is_silent_and_frees_them(process_group, kind):
    """Their parameters too, on every attachment kind, and as soon as torch.optim's are:
    by reference counting alone where torch's are (GPU memory comes back at ``del``, not
    at some later garbage collection). A hook that reaches its own tensor (through its
    bucket, engine, attachment or DDP state) is a cycle through torch's C++ hook
    registry, which no garbage collection frees (it leaked every attached model that was
    not removed); the DDP state and its attachment referring to each other was a cycle
    only a collection freed."""
    def train(lib: Any) -> list[weakref.ref]:
        model, batch_fn, loss_fn = make_model("mlp")
        if kind.startswith("ddp"):
            model = DDP(model, find_unused_parameters=kind == "ddp-find-unused")
        elif kind == "fsdp2":
            model = fully_shard(model)
        opt = lib.Adam(model.parameters())
        if lib is layeropt:
            layeropt.attach(model, opt)
        loss_fn(model, batch_fn(torch.Generator().manual_seed(0))).backward()
        opt.step()
        opt.zero_grad()
        return [weakref.ref(model), weakref.ref(opt), *map(weakref.ref, model.parameters())]

    def freed(lib: Any) -> tuple[bool, bool]:
        """(freed by reference counting alone, freed after gc.collect())"""
        gc.collect()
        gc.disable()
        try:
            refs = train(lib)
            at_once = all(r() is None for r in refs)
        finally:
            gc.enable()
        gc.collect()
        return at_once, all(r() is None for r in refs)

    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])  # (torch's first optimizer in a
    # process keeps its frames alive through a one-time lazy import: not this test's subject)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", message=".*find_unused_parameters=True")  # (DDP's)
        got = freed(layeropt)
    assert got == freed(torch.optim) and got[1], got


RESUME = textwrap.dedent(
    """
    import sys, torch, layeropt
    from layeropt.models import make_model
    torch.set_num_threads(1)
    mode, path = sys.argv[1], sys.argv[2]
    model, batch_fn, loss_fn = make_model("gpt")
    opt = layeropt.AdamW(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7)
    layeropt.attach(model, opt)
    gen = torch.Generator().manual_seed(0)
    batches = [batch_fn(gen) for _ in range(8)]

    def train(i):
        if i % 2 == 0:
            with opt.no_step():
                (loss_fn(model, batches[i]) / 2).backward()
        else:
            (loss_fn(model, batches[i]) / 2).backward()
            sched.step()

    if mode == "resume":
        ck = torch.load(path, weights_only=False)
        model.load_state_dict(ck["model"]); opt.load_state_dict(ck["opt"])
        sched.load_state_dict(ck["sched"])
        for p, g in zip(model.parameters(), ck["grads"]):
            p.grad = g
        opt._lo_engine.train_step.held.update(dict.fromkeys(p for p in model.parameters() if p.grad is not None))
        start = ck["i"]
    else:
        start = 0
    for i in range(start, 8):
        if mode == "save" and i == 5:
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(),
                        "sched": sched.state_dict(), "i": i,
                        "grads": [p.grad for p in model.parameters()]}, path)
            break
        train(i)
    if mode != "save":
        torch.save([p.detach() for p in model.parameters()], path + "." + mode)
    """
)


def test_resume_in_a_fresh_process_is_bit_identical(tmp_path):
    script = tmp_path / "resume.py"
    script.write_text(RESUME)
    ck = str(tmp_path / "ck.pt")
    for mode in ("save", "resume"):
        subprocess.run([sys.executable, str(script), mode, ck], check=True, timeout=120)
    argv = sys.argv
    try:  # the uninterrupted reference runs in this process
        sys.argv = [str(script), "full", ck]
        runpy.run_path(str(script), run_name="__main__")
    finally:
        sys.argv = argv
    full = torch.load(ck + ".full")
    resumed = torch.load(ck + ".resume")
    for a, b in zip(full, resumed):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.complex64])
def test_complex_parameters_match_torch(dtype):
    torch.manual_seed(0)
    w = torch.randn(3, 3, dtype=dtype, requires_grad=True)
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(w.detach().clone())
    ref_w = torch.nn.Parameter(w.detach().clone())
    opt = layeropt.Adam([model.w], lr=0.1)
    ref_opt = torch.optim.Adam([ref_w], lr=0.1)
    layeropt.attach(model, opt)
    x = torch.randn(3, dtype=dtype)
    for _ in range(3):
        (model.w @ x).abs().sum().backward()
        (ref_w @ x).abs().sum().backward()
        ref_opt.step()
        ref_opt.zero_grad()
    assert torch.equal(model.w, ref_w)


def test_mixed_dtypes_in_one_optimizer_match_torch():
    model, batch_fn, loss_fn = make_model("mlp")
    model.head.double()
    ref = copy.deepcopy(model)
    opt = layeropt.Adam(model.parameters(), lr=0.01, foreach=True)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01, foreach=True)
    layeropt.attach(model, opt)

    def loss(m, data):
        x, y = data
        h = x
        for layer in m.layers:
            h = torch.nn.functional.gelu(layer(h))
        return torch.nn.functional.mse_loss(m.head(h.double()), y.double())

    gen = torch.Generator().manual_seed(0)
    for _ in range(2):
        data = batch_fn(gen)
        loss(ref, data).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss(model, data).backward()
    assert_models_equal(ref, model)


@pytest.mark.parametrize(
    "params,match",
    [([], "empty parameter list"), ("dup", "more than one parameter group")],
)
def test_bad_parameter_lists_raise_like_torch(params, match):
    lin = torch.nn.Linear(2, 2)
    if params == "dup":
        params = [{"params": [lin.weight]}, {"params": [lin.weight]}]
    with pytest.raises(ValueError, match=match):
        torch.optim.Adam(params)
    with pytest.raises(ValueError, match=match):
        layeropt.Adam(params)


def test_parameters_that_do_not_require_grad_are_not_hooked():
    model, _, _ = make_model("frozen")
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    handle = layeropt.attach(model, opt)
    hooked = {id(p) for b in handle.buckets for p in b.params}
    assert id(model.frozen.weight) not in hooked and id(model.body.weight) in hooked
