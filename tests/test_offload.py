"""layeropt.offload: optimizer state in host memory, exact against the same loop without it.

Every test trains the same model three ways from one seed - torch.optim,
layeropt, layeropt with ``offload_state`` - and compares parameters and
optimizer state bit for bit, under both bucket schedules (``bucket_cap_mb=0``:
a step per layer; ``1.0``, the library default: the tiny models in one bucket).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import layeropt
from harness import (
    MODEL_NAMES,
    OPTIMIZER_CONFIGS,
    Boom,
    assert_models_equal,
    assert_same,
    clone_kwargs,
    config_id,
    fully_shard,
    needs_fsdp2,
)
from layeropt.engine.fastpath import supported
from layeropt.engine.subset import _MISSING
from layeropt.errors import LayeroptError
from layeropt.models import make_model
from layeropt.engine.stepper import PLAIN
from layeropt.offload import StateOffload, offload_state
from layeropt.offload.state import OffloadStepper, mode_refusal

CAPS = pytest.mark.parametrize("cap", [0.0, 1.0], ids=["cap0", "default-cap"])
NAdam = layeropt.in_backward(torch.optim.NAdam)


def _three(model_name: str, opt_name: str, kw: dict[str, Any], cap: float, **offload_kw: Any):
    """(torch model, torch opt), (layeropt ...), (offloaded ..., handle): one seed."""
    model, batch_fn, loss_fn = make_model(model_name)
    cls = getattr(torch.optim, opt_name)
    ref = copy.deepcopy(model)
    ref_opt = cls(ref.parameters(), **clone_kwargs(kw))
    runs = []
    for _ in range(2):
        m = copy.deepcopy(model)
        o = layeropt.in_backward(cls)(m.parameters(), **clone_kwargs(kw))
        layeropt.attach(m, o, bucket_cap_mb=cap)
        runs.append((m, o))
    handle = offload_state(runs[1][1], **offload_kw)
    return (ref, ref_opt), runs[0], runs[1], handle, batch_fn, loss_fn


def _assert_all_same(*pairs: tuple[torch.nn.Module, torch.optim.Optimizer]) -> None:
    (m0, o0), *rest = pairs
    for m, o in rest:
        assert_models_equal(m0, m)
        assert_same(o0.state_dict(), o.state_dict())


def _assert_on_host(handle: StateOffload) -> None:
    """Between steps every offloadable state tensor is the handle's host tensor."""
    opt = handle.optimizer
    for g in opt.param_groups:
        for p in g["params"]:
            for k, v in opt.state.get(p, {}).items():
                if isinstance(v, torch.Tensor) and v.dim() > 0:
                    assert handle._host(p, k, v), f"state[{k!r}] is not offloaded"
    assert handle.device_bytes == 0


def _train(pairs, batch_fn, loss_fn, steps=3, seed=1):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        data = batch_fn(gen)
        for m, o in pairs:
            loss_fn(m, data).backward()
            o.step()
            o.zero_grad()


@CAPS
@pytest.mark.parametrize("model_name", ["mlp", "gpt"])
@pytest.mark.parametrize("cfg", OPTIMIZER_CONFIGS, ids=config_id)
def test_matches_torch_and_no_offload(cfg, model_name, cap):
    opt_name, kw = cfg
    ref, plain, off, handle, batch_fn, loss_fn = _three(model_name, opt_name, kw, cap)
    _train([ref, plain, off], batch_fn, loss_fn)
    _assert_all_same(ref, plain, off)
    _assert_on_host(handle)
    # every state tensor copied: created on the device and moved (Adagrad's exists at
    # construction, moved by offload_state), then in and out twice (three times)
    assert handle.copied_bytes == (6 if opt_name == "Adagrad" else 5) * handle.host_bytes


@CAPS
@pytest.mark.parametrize("model_name", MODEL_NAMES)
def test_every_model(model_name, cap):
    ref, plain, off, handle, batch_fn, loss_fn = _three(model_name, "AdamW", dict(lr=0.01), cap)
    _train([ref, plain, off], batch_fn, loss_fn)
    _assert_all_same(ref, plain, off)
    _assert_on_host(handle)


def test_the_step_sees_device_copies_never_the_host_tensors():
    _, _, (model, opt), handle, batch_fn, loss_fn = _three("mlp", "Adam", dict(lr=0.01), 0.0)
    stepper, seen = opt._lo_stepper, []
    original = stepper.step

    def spy(o):
        for p in (p for g in o.param_groups for p in g["params"] if p.grad is not None):
            for k, v in o.state.get(p, {}).items():
                if v.dim() > 0:
                    assert not handle._host(p, k, v)
                    seen.append(v.data_ptr())
        original(o)

    stepper.step = spy
    _train([(model, opt)], batch_fn, loss_fn, steps=2)
    hosts = {v.data_ptr() for s in opt.state.values() for v in s.values() if v.dim() > 0}
    assert seen and not hosts & set(seen)


@CAPS
@pytest.mark.parametrize("opt_name,kw", [("AdamW", dict(lr=0.01)), ("SGD", dict(lr=0.1, momentum=0.9)),
                                         ("Adam", dict(lr=0.01, fused=True))])
def test_no_step_accumulation(opt_name, kw, cap):
    ref, plain, off, handle, batch_fn, loss_fn = _three("gpt", opt_name, kw, cap)
    gen = torch.Generator().manual_seed(3)
    for _ in range(3):
        batch = batch_fn(gen)
        micro = list(zip(*(t.chunk(2) for t in batch))) if isinstance(batch, tuple) \
            else list(batch.chunk(2))
        for mb in micro:
            (loss_fn(ref[0], mb) / 2).backward()
        ref[1].step()
        ref[1].zero_grad()
        for m, o in (plain, off):
            with o.no_step():
                (loss_fn(m, micro[0]) / 2).backward()
            (loss_fn(m, micro[1]) / 2).backward()
    _assert_all_same(ref, plain, off)
    _assert_on_host(handle)


@CAPS
@pytest.mark.parametrize("max_norm", [0.05, 1e6], ids=["active", "inactive"])
def test_global_clipping(max_norm, cap):
    ref, plain, off, handle, batch_fn, loss_fn = _three("gpt", "AdamW", dict(lr=0.01), cap)
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        data = batch_fn(gen)
        loss_fn(ref[0], data).backward()
        torch.nn.utils.clip_grad_norm_(ref[0].parameters(), max_norm)
        ref[1].step()
        ref[1].zero_grad()
        norms = [layeropt.backward(loss_fn(m, data), max_norm=max_norm) for m, _ in (plain, off)]
        assert torch.equal(*norms)
    _assert_all_same(ref, plain, off)
    _assert_on_host(handle)


@CAPS
@pytest.mark.parametrize("kw", [dict(lr=0.01), dict(lr=0.01, fused=True)], ids=["adam", "fused"])
def test_grad_scaler_with_an_overflow(kw, cap):
    ref, plain, off, handle, batch_fn, loss_fn = _three("mlp", "Adam", kw, cap)
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2) for _ in range(3)]
    gen = torch.Generator().manual_seed(0)
    for step in range(4):
        data = batch_fn(gen)
        boost = 1e38 if step == 1 else 1.0  # an overflow: every update skipped
        rs = scalers[0]
        rs.scale(loss_fn(ref[0], data) * boost).backward()
        rs.unscale_(ref[1])
        rs.step(ref[1])
        rs.update()
        ref[1].zero_grad()
        for (m, o), s in zip((plain, off), scalers[1:]):
            layeropt.backward(s.scale(loss_fn(m, data) * boost), scaler=s)
            s.step(o)
            s.update()
        assert scalers[0].get_scale() == scalers[1].get_scale() == scalers[2].get_scale()
    _assert_all_same(ref, plain, off)
    _assert_on_host(handle)


@CAPS
@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointing(use_reentrant, cap):
    ref, plain, off, handle, batch_fn, loss_fn = _three("gpt", "AdamW", dict(lr=0.01), cap)
    for m, _ in (plain, off):
        layeropt.checkpoint_modules(m, names="blocks.*", use_reentrant=use_reentrant)
    _train([ref, plain, off], batch_fn, loss_fn)
    _assert_all_same(ref, plain, off)
    _assert_on_host(handle)


@CAPS
def test_lr_scheduler(cap):
    ref, plain, off, handle, batch_fn, loss_fn = _three("mlp", "AdamW", dict(lr=0.01), cap)
    scheds = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5) for _, o in (ref, plain, off)]
    gen = torch.Generator().manual_seed(0)
    for _ in range(3):
        data = batch_fn(gen)
        for (m, o), s in zip((ref, plain, off), scheds):
            loss_fn(m, data).backward()
            o.step()
            o.zero_grad()
            s.step()
    _assert_all_same(ref, plain, off)
    assert off[1].param_groups[0]["lr"] == ref[1].param_groups[0]["lr"] == 0.01 * 0.5**3


@CAPS
@pytest.mark.parametrize("opt_name,kw", [("AdamW", dict(lr=0.01)), ("Adam", dict(lr=0.01, fused=True)),
                                         ("Adagrad", dict(lr=0.1))])
def test_state_dict_through_plain_torch_and_back(opt_name, kw, cap):
    ref, plain, off, handle, batch_fn, loss_fn = _three("gpt", opt_name, kw, cap)
    _train([ref, plain, off], batch_fn, loss_fn, steps=2)
    # save -> a plain torch optimizer on a fresh copy steps once -> back into the offloaded one
    saved = copy.deepcopy(off[1].state_dict())
    assert_same(saved, ref[1].state_dict())
    torch_model = copy.deepcopy(off[0])
    torch_opt = getattr(torch.optim, opt_name)(torch_model.parameters(), **clone_kwargs(kw))
    torch_opt.load_state_dict(saved)
    _train([ref, plain, (torch_model, torch_opt)], batch_fn, loss_fn, steps=1, seed=5)
    off[0].load_state_dict(torch_model.state_dict())
    placed = []  # where torch's casting rule was told each loaded value's parameter lives
    policy = torch.optim.Optimizer._process_value_according_to_param_policy

    def spy(param, value, *args):
        placed.append((param, value.dim()))
        return policy(param, value, *args)

    torch.optim.Optimizer._process_value_according_to_param_policy = staticmethod(spy)
    try:
        off[1].load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    finally:
        torch.optim.Optimizer._process_value_according_to_param_policy = staticmethod(policy)
    params = {id(p) for p in off[0].parameters()}
    loaded = [param for param, dim in placed if dim > 0]
    assert loaded and not any(id(q) in params for q in loaded)  # host stand-ins, not params
    assert all(q.device.type == "cpu" and q.untyped_storage().nbytes() <= 8 for q in loaded)
    _assert_on_host(handle)  # loaded straight into host memory
    _train([ref, plain, off], batch_fn, loss_fn, steps=2, seed=6)
    _assert_all_same(ref, plain, off)
    _assert_on_host(handle)


@CAPS
def test_nadam_through_in_backward(cap):
    ref, plain, off, handle, batch_fn, loss_fn = _three("gpt", "NAdam", dict(lr=0.01), cap)
    assert type(off[1]) is NAdam
    _train([ref, plain, off], batch_fn, loss_fn)
    _assert_all_same(ref, plain, off)
    _assert_on_host(handle)


class ReplacingMomentum(torch.optim.Optimizer):
    """A third-party-style optimizer (stepped by whole groups) whose step
    *replaces* its state tensors instead of updating them in place."""

    def __init__(self, params: Any, lr: float = 0.1) -> None:
        super().__init__(params, dict(lr=lr))

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is None:
                    continue
                s = self.state[p]
                s["m"] = s["m"] * 0.9 + p.grad if "m" in s else p.grad.clone()
                s["n"] = s.get("n", 0) + 1
                p.add_(s["m"], alpha=-g["lr"])


@CAPS
def test_whole_group_optimizer_that_replaces_its_state(cap):
    model, batch_fn, loss_fn = make_model("mlp")
    runs = []
    for offload in (False, True):
        m = copy.deepcopy(model)
        o = layeropt.in_backward(ReplacingMomentum)(m.parameters())
        layeropt.attach(m, o, bucket_cap_mb=cap)
        runs.append((m, o, offload_state(o) if offload else None))
    _train([(m, o) for m, o, _ in runs], batch_fn, loss_fn)
    _assert_all_same(*[(m, o) for m, o, _ in runs])
    _assert_on_host(runs[1][2])


@CAPS
@pytest.mark.parametrize("opt_name,kw", [("AdamW", dict(lr=0.01)), ("Adam", dict(lr=0.01, amsgrad=True)),
                                         ("SGD", dict(lr=0.1, momentum=0.9))])
def test_device_bytes_stay_within_one_bucket(opt_name, kw, cap):
    _, _, (model, opt), handle, batch_fn, loss_fn = _three("gpt", opt_name, kw, cap)
    buckets: list[int] = []
    original = opt._lo_stepper  # torch's step on each update's parameters (engine/subset.py)

    def sizes(optimizer, params, txn):
        original(optimizer, params, txn)
        buckets.append(sum(opt.state[p][k].nbytes for p in params for k in opt.state[p]
                           if opt.state[p][k].dim() > 0))

    opt._lo_stepper = sizes
    _train([(model, opt)], batch_fn, loss_fn)
    total = sum(v.nbytes for s in opt.state.values() for v in s.values() if v.dim() > 0)
    assert handle.peak_device_bytes == max(buckets) <= handle.max_buckets * max(buckets)
    assert handle.host_bytes == total
    if cap == 0.0:
        assert handle.peak_device_bytes < total  # one layer's, not the model's


@CAPS
def test_exception_mid_backward_matches_no_offload(cap):
    _, plain, off, handle, batch_fn, loss_fn = _three("mlp", "AdamW", dict(lr=0.01), cap)
    x, y = batch_fn(torch.Generator().manual_seed(0))
    for m, o in (plain, off):
        h = m.layers[0](x)
        out = m.head(torch.nn.functional.gelu(m.layers[2](m.layers[1](Boom.apply(h)))))
        with pytest.raises(ValueError, match="boom"):
            torch.nn.functional.mse_loss(out, y).backward()
    assert [p.shape for p in plain[1].stepped_params] == [p.shape for p in off[1].stepped_params]
    _assert_all_same(plain, off)
    _assert_on_host(handle)


@CAPS
def test_remove_brings_the_state_back_and_stays_exact(cap):
    ref, plain, off, handle, batch_fn, loss_fn = _three("gpt", "Adam", dict(lr=0.01, fused=True), cap)
    assert off[1]._lo_stepper.fast is None
    _train([ref, plain, off], batch_fn, loss_fn, steps=2)
    handle.remove()
    assert off[1]._lo_engine.stepper is PLAIN and off[1]._lo_stepper.fast is _MISSING  # unwrapped
    assert handle.host_bytes == 0
    _train([ref, plain, off], batch_fn, loss_fn, steps=2, seed=7)
    _assert_all_same(ref, plain, off)
    assert (off[1]._lo_stepper.fast is not None) == (torch.optim.Adam in supported())  # again


def test_state_existing_at_enable_moves_to_host():
    model, batch_fn, loss_fn = make_model("mlp")
    opt = layeropt.AdamW(model.parameters(), lr=0.01)
    layeropt.attach(model, opt)
    _train([(model, opt)], batch_fn, loss_fn, steps=1)
    before = copy.deepcopy(opt.state_dict())
    handle = offload_state(opt)
    _assert_on_host(handle)
    assert_same(before, opt.state_dict())


def test_refusals():
    model, batch_fn, loss_fn = make_model("mlp")
    with pytest.raises(TypeError, match="layeropt optimizer"):
        offload_state(torch.optim.AdamW(model.parameters()))
    opt = layeropt.AdamW(model.parameters(), lr=0.01)
    with pytest.raises(ValueError, match="max_buckets"):
        offload_state(opt, max_buckets=0)
    # parameters on the CPU: every overlap says first that it needs CUDA, not a fix that
    # fails too (the refusal of overlap alone with held gradients, for CUDA parameters:
    # test_cuda_offload.py::test_overlap_without_prefetch_with_held_grads_is_refused)
    for kw in (dict(overlap=True), dict(overlap=True, prefetch=True),
               dict(overlap=True, held_grads=False), dict(prefetch=True)):
        with pytest.raises(LayeroptError, match="CUDA side stream.*=False"):
            offload_state(opt, **kw)
    handle = offload_state(opt)
    with pytest.raises(LayeroptError, match="already offloaded"):
        offload_state(opt)
    loss_fn(model, batch_fn(torch.Generator().manual_seed(0))).backward()
    with pytest.raises(LayeroptError, match="not attached.*remove"):
        opt.step()  # not attached: every parameter at once
    handle.remove()
    opt.step()


# offload_state's modes for parameters on a GPU (mode_refusal, the decision offload_state
# takes; a GPU runs it whole: test_cuda_offload.py): (overlap, prefetch, held_grads) ->
# refused or not. Overlap alone with held gradients in host memory: not shown exact on a GPU
CUDA_MODES = {
    (False, False, True): None, (False, False, False): None,
    (True, True, True): None, (True, True, False): None, (True, False, False): None,
    (False, True, True): None, (False, True, False): None,
    (True, False, True): "has not been shown bit-identical",
}


@pytest.mark.parametrize("mode", list(CUDA_MODES), ids=str)
def test_the_modes_offload_state_refuses_on_a_gpu(mode):
    overlap, prefetch, held = mode
    said = mode_refusal(overlap, prefetch, held, [torch.device("cuda", 0)], cuda=True)
    expected = CUDA_MODES[mode]
    assert said is None if expected is None else expected in said
    # on the CPU, every side-stream mode says first that it needs CUDA parameters
    said = mode_refusal(overlap, prefetch, held, [torch.device("cpu")], cuda=True)
    assert (said is None) == (not overlap and not prefetch)
    assert said is None or "CUDA side stream" in said


@needs_fsdp2
def test_fsdp2_shards_are_refused_nothing_changed(process_group):
    """docs/offload.md: offload moves plain tensors; FSDP2's DTensor shards are refused."""
    model, _, _ = make_model("mlp")
    fully_shard(model)
    opt = layeropt.AdamW(model.parameters(), lr=0.01)
    with pytest.raises(LayeroptError, match="moves plain tensors.*DTensor"):
        offload_state(opt)
    assert opt._lo_engine.find(OffloadStepper) is None and not opt.state


@settings(max_examples=8, deadline=None)
@given(
    widths=st.lists(st.integers(1, 9), min_size=1, max_size=4),
    cfg=st.sampled_from([c for c in OPTIMIZER_CONFIGS if c[0] in ("Adam", "AdamW", "SGD", "RMSprop")]),
    cap=st.sampled_from([0.0, 1.0]),
    steps=st.integers(1, 3),
)
def test_property_random_mlps(widths, cfg, cap, steps):
    opt_name, kw = cfg
    torch.manual_seed(0)
    dims = [3, *widths]
    model = torch.nn.Sequential(*(torch.nn.Linear(a, b) for a, b in zip(dims, dims[1:])))
    runs = []
    for offload in (False, True):
        m = copy.deepcopy(model)
        o = getattr(layeropt, opt_name)(m.parameters(), **clone_kwargs(kw))
        layeropt.attach(m, o, bucket_cap_mb=cap)
        if offload:
            handle = offload_state(o)
        runs.append((m, o))
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        x = torch.randn(2, 3, generator=gen)
        for m, o in runs:
            m(x).square().sum().backward()
    _assert_all_same(*runs)
    _assert_on_host(handle)


@CAPS
def test_a_failed_load_loses_nothing(cap):
    """torch refuses a state dict of another shape: the offloaded optimizer keeps its
    parameters and state, and training goes on exactly."""
    ref, plain, off, handle, batch_fn, loss_fn = _three("mlp", "AdamW", dict(lr=0.01), cap)
    _train([ref, plain, off], batch_fn, loss_fn, steps=1)
    wrong = torch.optim.AdamW(torch.nn.Linear(3, 3).parameters()).state_dict()
    with pytest.raises(ValueError, match="doesn't match the size"):
        off[1].load_state_dict(wrong)
    _assert_on_host(handle)
    _train([ref, plain, off], batch_fn, loss_fn, steps=2, seed=2)
    _assert_all_same(ref, plain, off)


def test_deleting_the_optimizer_frees_its_host_state_at_once():
    """As deleting a torch.optim optimizer frees its state: by reference counting alone
    (a 7B model's offloaded state is tens of GB of pinned host memory)."""
    import gc
    import weakref

    model, batch_fn, loss_fn = make_model("mlp")
    torch.optim.Adam([torch.nn.Parameter(torch.zeros(1))])  # (torch's first optimizer in a
    # process keeps its frames alive through a one-time lazy import)

    def train() -> tuple[list[weakref.ref], StateOffload]:
        opt = layeropt.AdamW(model.parameters())
        handle = layeropt.attach(model, opt)
        offloaded = offload_state(opt)
        loss_fn(model, batch_fn(torch.Generator().manual_seed(0))).backward()
        handle.remove()
        refs = [weakref.ref(opt), *(weakref.ref(t) for s in opt.state.values()
                                     for t in s.values() if t.dim() > 0)]
        assert offloaded.host_bytes > 0 and len(refs) > 1
        return refs, offloaded

    gc.collect()
    gc.disable()
    try:
        refs, offloaded = train()
        assert all(r() is None for r in refs)
        assert offloaded.optimizer is None and offloaded.host_bytes == 0
        offloaded.remove()  # nothing left to bring back: a no-op
    finally:
        gc.enable()


@CAPS
@pytest.mark.parametrize("kw", [dict(lr=0.01), dict(lr=0.01, fused=True)], ids=["adamw", "fused"])
def test_offloaded_state_dict_resumes_torch_and_layeropt_without_offload(kw, cap):
    """An offloaded optimizer's state_dict(), saved after attached steps over accumulation
    windows (no_step()), loads into a plain torch.optim.AdamW and into a layeropt.AdamW
    without offload; both train on bit for bit equal to the torch.optim run that was
    never interrupted (parameters and state)."""
    ref, _, off, handle, batch_fn, loss_fn = _three("gpt", "AdamW", kw, cap)
    gen = torch.Generator().manual_seed(7)

    def windows(torch_runs, layeropt_runs, n):
        """n steps of 2 micro-batches: torch sums both, then step(); layeropt holds the
        first with no_step() and steps in the second's backward."""
        for _ in range(n):
            batch = batch_fn(gen)
            micro = list(zip(*(t.chunk(2) for t in batch))) if isinstance(batch, tuple) \
                else list(batch.chunk(2))
            for m, o in torch_runs:
                for mb in micro:
                    (loss_fn(m, mb) / 2).backward()
                o.step()
                o.zero_grad()
            for m, o in layeropt_runs:
                with o.no_step():
                    (loss_fn(m, micro[0]) / 2).backward()
                (loss_fn(m, micro[1]) / 2).backward()
                o.step()  # (nothing left: the last backward stepped every bucket)
                o.zero_grad()

    windows([ref], [off], 3)
    _assert_all_same(ref, off)
    _assert_on_host(handle)
    saved = off[1].state_dict()
    for i, s in saved["state"].items():  # on the host: the handle's tensors themselves
        for k, v in s.items():
            assert v.device.type == "cpu", (i, k)
            assert v.dim() == 0 or handle._host(list(off[0].parameters())[i], k, v), (i, k)
    saved = copy.deepcopy(saved)
    params = off[0].state_dict()

    def resumed(cls, attach):
        m = copy.deepcopy(ref[0])  # (no hooks; its values replaced by the offloaded run's)
        m.load_state_dict(params)
        o = cls(m.parameters(), **clone_kwargs(kw))
        if attach:
            layeropt.attach(m, o, bucket_cap_mb=cap)
        o.load_state_dict(copy.deepcopy(saved))
        return m, o

    into_torch = resumed(torch.optim.AdamW, attach=False)
    into_layeropt = resumed(layeropt.AdamW, attach=True)
    assert into_layeropt[1]._lo_engine.stepper is PLAIN  # not offloaded
    for _, o in (into_torch, into_layeropt):
        assert_same(o.state_dict(), ref[1].state_dict())
    windows([ref, into_torch], [into_layeropt], 3)
    assert into_layeropt[1].stepped_in_backward > 0
    _assert_all_same(ref, into_torch, into_layeropt)
