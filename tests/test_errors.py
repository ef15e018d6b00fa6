"""Each misuse raises a clear error that says what to do, and changes nothing."""

from __future__ import annotations

import copy
import sys
from typing import Any

import pytest
import torch

import layeropt
from layeropt.errors import AttachError


def _mlp():
    return torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.Linear(4, 2))


def _snapshot(model):
    return [p.detach().clone() for p in model.parameters()]


def test_attach_twice_to_the_same_optimizer_is_the_same_attachment():
    """What a user does after LayeroptAccelerator.prepare or LayeroptTrainer attached."""
    m = _mlp()
    opt = layeropt.SGD(m.parameters(), lr=0.1)
    ref = copy.deepcopy(m)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    handle = layeropt.attach(m, opt)
    assert layeropt.attach(m, opt) is handle
    x = torch.randn(2, 3)
    for model, o in ((ref, ref_opt), (m, opt)):
        model(x).sum().backward()
        o.step()
    assert all(torch.equal(p, q) for p, q in zip(m.parameters(), ref.parameters()))  # once


def test_attach_to_a_second_optimizer_names_the_parameter_and_the_first():
    m = _mlp()
    first = layeropt.Adam(m.parameters())
    layeropt.attach(m, first)
    line = sys._getframe().f_lineno - 1
    with pytest.raises(AttachError) as raised:
        layeropt.attach(m, layeropt.SGD(m.parameters(), lr=0.1))
    message = str(raised.value)
    assert "parameter '0.weight' is already attached, to Adam" in message
    assert f"(attached at test_errors.py:{line})" in message and ".remove()" in message


def test_attach_overlapping_a_live_attachment_of_the_same_optimizer_says_so():
    """A submodule attached, then its parent, to one optimizer: not "another optimizer"."""
    m = _mlp()
    opt = layeropt.Adam(m.parameters())
    layeropt.attach(m[1:], opt)
    with pytest.raises(AttachError, match=r"already attached to this optimizer, through "
                       r"another attachment .* Attach one module that holds both, once"):
        layeropt.attach(m, opt)


def test_attaching_a_model_with_nothing_trainable_warns():
    m = _mlp().requires_grad_(False)
    with pytest.warns(UserWarning, match="none of this model's parameters.*requires grad"):
        layeropt.attach(m, layeropt.Adam(m.parameters()))


def test_parameter_owned_by_two_layeropt_optimizers():
    m = _mlp()
    a = layeropt.Adam(m.parameters())  # noqa: F841 - kept alive on purpose
    b = layeropt.SGD(m[0].parameters(), lr=0.1)  # noqa: F841
    with pytest.raises(AttachError, match=r"owned by 2 layeropt optimizers.*one optimizer"):
        layeropt.attach(m)
    with pytest.raises(AttachError, match="owned by 2"):
        layeropt.attach(m, [a, b])


def test_plain_torch_optimizer_is_refused_with_the_fix():
    m = _mlp()
    with pytest.raises(AttachError, match=r"not a layeropt optimizer.*layeropt\.Adam\(\.\.\.\)"):
        layeropt.attach(m, torch.optim.Adam(m.parameters()))


def test_optimizer_owning_none_of_the_model():
    m, other = _mlp(), _mlp()
    opt = layeropt.Adam(other.parameters())
    with pytest.raises(AttachError, match="owns none of this model"):
        layeropt.attach(m, opt)


def test_no_optimizer_at_all():
    with pytest.raises(AttachError, match="no layeropt optimizer owns"):
        layeropt.attach(torch.nn.Linear(2, 2))


def test_sparse_embedding_is_refused():
    emb = torch.nn.Embedding(10, 3, sparse=True)
    opt = layeropt.SGD(emb.parameters(), lr=0.1)
    with pytest.raises(AttachError, match=r"sparse=False"):
        layeropt.attach(emb, opt)


def test_non_leaf_tensor_is_refused_by_torch_before_attach():
    w = torch.randn(3, requires_grad=True) * 2
    with pytest.raises(ValueError, match="non-leaf"):
        layeropt.Adam([w])


def test_not_a_module():
    with pytest.raises(TypeError, match="nn.Module"):
        layeropt.attach([torch.zeros(2, requires_grad=True)])  # type: ignore[arg-type]


@pytest.mark.parametrize("cap, error", [(-1, ValueError), (None, TypeError), ("1", TypeError)])
def test_bad_bucket_cap(cap: Any, error: type[Exception]):
    m = _mlp()
    with pytest.raises(error, match="bucket_cap_mb"):
        layeropt.attach(m, layeropt.Adam(m.parameters()), bucket_cap_mb=cap)


@pytest.mark.parametrize(
    "cls,reason",
    [(torch.optim.LBFGS, "closure"), (int, "Optimizer subclass"), ("Adam", "Optimizer subclass")],
)
def test_in_backward_refuses_what_cannot_work(cls, reason):
    with pytest.raises(TypeError, match=reason):
        layeropt.in_backward(cls)


@pytest.mark.parametrize(
    "kw,match",
    [(dict(lr=-1.0), "Invalid learning rate"), (dict(betas=(1.5, 0.9)), "beta"),
     (dict(eps=-1.0), "epsilon"), (dict(weight_decay=-1.0), "weight_decay")],
)
def test_invalid_hyperparameters_raise_like_torch(kw, match):
    m = _mlp()
    with pytest.raises(ValueError, match=match):
        torch.optim.Adam(m.parameters(), **kw)
    with pytest.raises(ValueError, match=match):
        layeropt.Adam(m.parameters(), **kw)


# param groups whose in-backward updates cannot equal torch's step(): the optimizer over
# ``ps``, the parameters of a bf16 and a float32 Linear; the error's words
GROUP_REFUSALS = {
    "differentiable": (lambda ps: layeropt.Adam(ps, differentiable=True), "differentiable"),
    "parameter-listed-twice": (lambda ps: layeropt.SGD(ps + ps[:1], lr=0.1), "more than once"),
    "adafactor-mixed-dtypes-eps-none": (lambda ps: layeropt.Adafactor(ps), "mixes parameter dtypes"),
}


@pytest.mark.parametrize("case", list(GROUP_REFUSALS))
@pytest.mark.parametrize("when", ["attach", "add_param_group"])
def test_param_groups_that_cannot_be_exact_are_refused(case: str, when: str):
    """A parameter listed twice is stepped twice by torch (once by layeropt); Adafactor's
    eps[0]=None takes its epsilon from the first parameter a step() call updates."""
    if case.startswith("adafactor") and not hasattr(torch.optim, "Adafactor"):
        pytest.skip("torch.optim.Adafactor: torch >= 2.5")
    make, match = GROUP_REFUSALS[case]
    m, other = (torch.nn.Sequential(torch.nn.Linear(3, 4).to(torch.bfloat16),
                                    torch.nn.Linear(4, 2)) for _ in range(2))
    if when == "attach":
        with pytest.raises(AttachError, match=match):
            layeropt.attach(m, make(list(m.parameters())))
        return
    made = make(list(other.parameters()))
    refused = made.param_groups[0]  # (with that class's defaults)
    opt = type(made)(m[1].parameters(), lr=0.1)  # (one dtype, each parameter once)
    layeropt.attach(m, opt)
    before = [dict(g) for g in opt.param_groups]
    with pytest.raises(AttachError, match=match):
        opt.add_param_group(refused)
    assert [dict(g) for g in opt.param_groups] == before  # refused: nothing added


def test_failing_bucket_step_leaves_parameters_untouched():
    """torch raises inside a step (capturable on CPU): the error surfaces, no update."""
    m = _mlp()
    opt = layeropt.Adam(m.parameters(), capturable=True)
    ref = torch.optim.Adam(_mlp().parameters(), capturable=True)
    with pytest.raises(Exception) as torch_err:
        ref.param_groups[0]["params"][0].grad = torch.zeros(4, 3)
        ref.step()
    layeropt.attach(m, opt)
    before = _snapshot(m)
    with pytest.raises(type(torch_err.value)):
        m(torch.randn(2, 3)).sum().backward()
    for p, q in zip(before, m.parameters()):
        assert torch.equal(p, q)
    # after the failed backward, the optimizer is usable again
    opt.param_groups[0]["capturable"] = False
    opt.zero_grad()
    m(torch.randn(2, 3)).sum().backward()
    assert all(p.grad is None for p in m.parameters())
    assert any(not torch.equal(p, q) for p, q in zip(before, m.parameters()))


class _SparseGrad(torch.autograd.Function):
    """Identity on ``weight`` in forward; its gradient comes back sparse."""

    @staticmethod
    def forward(ctx, weight):
        return weight.clone()

    @staticmethod
    def backward(ctx, grad):
        return grad.to_sparse()


@pytest.mark.parametrize("cap_mb", [0.0, 1.0])
def test_a_sparse_gradient_at_runtime_is_refused_and_nothing_is_stepped(cap_mb):
    """A dense parameter can still receive a sparse gradient (a custom Function)."""
    model = torch.nn.Linear(3, 2)
    before = [p.detach().clone() for p in model.parameters()]
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    handle = layeropt.attach(model, opt, bucket_cap_mb=cap_mb)
    x = torch.randn(4, 3)
    with pytest.raises(AttachError, match="sparse gradient"):
        (x @ _SparseGrad.apply(model.weight).T + model.bias).sum().backward()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())
    assert opt.stepped_params == []
    (x @ model.weight.T + model.bias).sum().backward()  # a dense backward steps as usual
    assert opt.stepped_in_backward == 2
    handle.remove()


@pytest.mark.parametrize("cap_mb", [0.0, 1.0])
def test_a_gradient_freed_by_an_earlier_hook_is_not_stepped(cap_mb):
    """A user's own post-accumulate-grad hook that drops ``.grad`` runs before layeropt's."""
    model = torch.nn.Linear(3, 2)
    model.bias.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    ref = torch.nn.Linear(3, 2)
    ref.load_state_dict(model.state_dict())
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    handle = layeropt.attach(model, opt, bucket_cap_mb=cap_mb)
    x = torch.randn(4, 3)
    (x @ model.weight.T + model.bias).sum().backward()
    (x @ ref.weight.T + ref.bias).sum().backward()
    ref.bias.grad = None  # as the user's hook did
    torch.optim.SGD(ref.parameters(), lr=0.1).step()
    assert torch.equal(model.weight, ref.weight) and torch.equal(model.bias, ref.bias)
    assert opt.stepped_params == [model.weight] and opt.stepped_in_backward == 1
    handle.remove()


@pytest.mark.parametrize("backwards", [1, 4])
def test_first_refusal_of_a_swapped_loop_names_what_was_already_applied(backwards):
    """An unchanged torch accumulation loop (n backwards, then clip_grad_norm_) meets the
    clip's refusal first: it also says the n backwards were each applied, and the fix."""
    model = torch.nn.Linear(4, 2)
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    with layeropt.attach(model, opt):
        for _ in range(backwards):
            model(torch.randn(3, 4)).sum().backward()
        with pytest.raises(layeropt.LayeroptError) as caught:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    message = str(caught.value)
    assert "nothing would be clipped" in message
    said = f"{backwards} attached backwards since the last step() were each applied"
    assert (said in message) == (backwards > 1), message
    assert ("no_step()" in message) == (backwards > 1)


def _ddp_delayed(m: torch.nn.Module) -> dict[str, Any]:
    return {"delay_all_reduce_named_params": [("0.weight", m[0].weight)],
            "param_to_hook_all_reduce": m[1].bias}


def _ddp_mixed_precision(m: torch.nn.Module) -> dict[str, Any]:
    from torch.nn.parallel.distributed import _MixedPrecision

    return {"mixed_precision": _MixedPrecision(param_dtype=torch.bfloat16)}


# DDP options under which a bucket's global gradient is not what layeropt is handed:
# (DDP's keyword arguments, a setting in force while DDP is built, what the error names)
DDP_REFUSALS = {
    "mixed_precision": (_ddp_mixed_precision, None, "mixed_precision"),
    "the Python reducer": (lambda m: {}, "python_reducer", "the Python reducer"),
    # (some parameters delayed: their reduction is another parameter's hook, outside the
    # buckets - before, they trained silently off torch's on two processes)
    # (every parameter delayed: DDP itself refuses a model on the CPU so left)
    "delay_all_reduce_named_params": (_ddp_delayed, None, "delay_all_reduce_named_params"),
}


@pytest.mark.parametrize("case", list(DDP_REFUSALS))
def test_ddp_options_that_cannot_be_exact_are_refused_at_attach(case, process_group):
    """docs/distributed.md, "Not supported (yet)": refused by attach, nothing changed."""
    kwargs, reducer, named = DDP_REFUSALS[case]
    m = _mlp()
    previous = torch._dynamo.config.optimize_ddp
    try:
        if reducer is not None:
            torch._dynamo.config.optimize_ddp = reducer
        ddp = torch.nn.parallel.DistributedDataParallel(m, **kwargs(m))
    except (AssertionError, RuntimeError) as e:  # (torch 2.4 makes a CUDA stream for it)
        if case != "mixed_precision" or torch.cuda.is_available():
            raise
        pytest.skip(f"DDP's mixed_precision needs CUDA on torch {torch.__version__}: {e}")
    finally:
        torch._dynamo.config.optimize_ddp = previous
    opt = layeropt.Adam(ddp.parameters(), lr=0.1)
    hooks = list(ddp._comm_hooks)
    with pytest.raises(AttachError, match=f"under DDP with {named}.*Construct"):
        layeropt.attach(ddp, opt)
    assert not opt.attached and ddp._comm_hooks == hooks  # (no comm hook of layeropt's)


@pytest.mark.parametrize("orig", [False, True], ids=["flat", "use_orig_params"])
@pytest.mark.parametrize("nested", [False, True], ids=["root", "nested"])
def test_fsdp1_is_refused_at_attach_naming_fsdp2(process_group, orig, nested):
    """FSDP1 reduces each flat parameter in its own hook after autograd accumulates it:
    stepped there, layeropt would use the unreduced gradient (flat parameters) or step
    nothing in backward (``use_orig_params``). Refused at attach, nothing hooked."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP

    m = _mlp()
    fsdp = FSDP(m, use_orig_params=orig, device_id=torch.device("cpu"))
    model = torch.nn.Sequential(fsdp) if nested else fsdp
    opt = layeropt.Adam(model.parameters(), lr=0.1)
    where = "module '0'" if nested else "the model"
    with pytest.raises(AttachError, match=rf"{where} is a FullyShardedDataParallel \(FSDP1\)"
                                          r".*fully_shard.*Nothing was attached"):
        layeropt.attach(model, opt)
    assert not opt.attached


def test_bucket_max_norm_on_a_ddp_model_is_refused_naming_the_fix(process_group):
    ddp = torch.nn.parallel.DistributedDataParallel(_mlp())
    opt = layeropt.Adam(ddp.parameters(), lr=0.1)
    with pytest.raises(AttachError, match=r"takes no bucket_max_norm.*max_norm"):
        layeropt.attach(ddp, opt, bucket_max_norm=1.0)
    assert not opt.attached


# A plain attachment on the parameters of a one-process DDP model (attach(ddp.module), or
# attach before wrapping: nothing refuses it at attach, the average of one gradient is that
# gradient). Its hooks would take each gradient as it lands (to update with, or to measure:
# the first pass of layeropt.backward(max_norm=)); DDP's reducer then writes its comm hook's
# result back into .grad - rounded, here, by fp16 compression - which torch's step() and
# clip_grad_norm_ read, or (find_unused_parameters) writes nothing back and leaves
# layeropt.backward's second pass unreduced. Refused at DDP's first forward.
ROUNDED_DDP_LOOPS = {
    "backward, step, zero_grad": ("backward", "step", "zero_grad"),
    "backward, zero_grad": ("backward", "zero_grad"),
    "zero_grad, backward": ("zero_grad", "backward"),
    "backward alone": ("backward",),
    "layeropt.backward(max_norm=1e9) alone": ("clip",),  # (the coefficient: exactly 1)
}


def _run_loop(ddp, opt, loop, x):
    for call in ROUNDED_DDP_LOOPS[loop]:
        if call == "backward":
            ddp(x).pow(2).sum().backward()
        elif call == "clip":
            layeropt.backward(ddp(x).pow(2).sum(), max_norm=1e9)
        else:
            getattr(opt, call)()


@pytest.mark.parametrize("loop", list(ROUNDED_DDP_LOOPS))
@pytest.mark.parametrize("attach_first", [False, True], ids=["attach-module", "attach-then-wrap"])
@pytest.mark.parametrize("unused", [False, True], ids=["", "find-unused"])
def test_plain_hooks_under_a_ddp_model_are_refused_before_its_forward(
        process_group, loop, attach_first, unused):
    """Refused at DDP's first forward, nothing run; the fix the message names (remove,
    attach the DDP model with its comm hook) then trains as DDP + torch.optim, bit for bit
    (both bucket schedules: conftest.py)."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))
    ref, start = copy.deepcopy(model), copy.deepcopy(model)
    ref_ddp = DDP(ref, find_unused_parameters=unused)
    ref_ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = layeropt.Adam(model.parameters(), lr=1e-2)
    handle = layeropt.attach(model, opt) if attach_first else None
    ddp = DDP(model, find_unused_parameters=unused)
    if not attach_first:
        handle = layeropt.attach(ddp.module, opt)
    x = torch.randn(8, 16) * 3
    with pytest.raises(AttachError, match=r"of this DistributedDataParallel model carries "
                       r"a plain layeropt hook.*Nothing was run.*\.remove\(\).*"
                       r"layeropt\.attach\(ddp_model, opt\)"):
        _run_loop(ddp, opt, loop, x)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), start.parameters()))
    assert not opt.state and all(p.grad is None for p in model.parameters())
    handle.remove()
    layeropt.attach(ddp, opt, comm_hook=default_hooks.fp16_compress_hook)
    for _ in range(3):
        ref_ddp(x).pow(2).sum().backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 1e9)  # (a multiplication by 1)
        ref_opt.step()
        ref_opt.zero_grad()
        _run_loop(ddp, opt, loop, x)
        x = torch.randn(8, 16) * 3
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), ref.parameters()))
