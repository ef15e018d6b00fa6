"""layeropt.offload on CUDA: pinned host state, synchronous and overlapped copies.

Bit for bit against the same loop without offload and against torch.optim, on
the GPU (skipped without CUDA; ``benchmarks/device_check.sh`` runs it).
"""

from __future__ import annotations

import copy

import pytest
import torch

import layeropt
from harness import assert_models_equal, assert_same
from layeropt.models import make_model
from layeropt.offload import offload_state

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONFIGS = [("AdamW", dict(lr=0.01)), ("AdamW", dict(lr=0.01, fused=True)),
           ("Adam", dict(lr=0.01, capturable=True)), ("Adam", dict(lr=0.01, amsgrad=True, foreach=True)),
           ("SGD", dict(lr=0.1, momentum=0.9))]


def _runs(opt_name, kw, cap, offloads):
    model, batch_fn, loss_fn = make_model("gpt")
    model = model.cuda()
    ref = copy.deepcopy(model)
    runs = [(ref, getattr(torch.optim, opt_name)(ref.parameters(), **kw), None)]
    for off in offloads:
        m = copy.deepcopy(model)
        o = getattr(layeropt, opt_name)(m.parameters(), **kw)
        layeropt.attach(m, o, bucket_cap_mb=cap)
        runs.append((m, o, None if off is None else offload_state(o, **off)))
    return runs, batch_fn, loss_fn


def _train(runs, batch_fn, loss_fn, steps=3):
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        data = batch_fn(gen)
        data = tuple(t.cuda() for t in data) if isinstance(data, tuple) else data.cuda()
        for m, o, _ in runs:
            loss_fn(m, data).backward()
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("cap", [0.0, 1.0], ids=["cap0", "default-cap"])
@pytest.mark.parametrize("opt_name,kw", CONFIGS, ids=[f"{n}{kw}" for n, kw in CONFIGS])
def test_sync_and_overlap_match_no_offload_and_torch(opt_name, kw, cap):
    offloads = [None, dict(), dict(overlap=True), dict(overlap=True, max_buckets=1)]
    runs, batch_fn, loss_fn = _runs(opt_name, kw, cap, offloads)
    _train(runs, batch_fn, loss_fn)
    (m0, o0, _), *rest = runs
    for m, o, handle in rest:
        assert_models_equal(m0, m)
        assert_same(o0.state_dict(), o.state_dict())  # (synchronizes an overlapped handle)
        if handle is None:
            continue
        for s in o.state.values():
            for k, v in s.items():
                if v.dim() > 0:
                    assert v.device.type == "cpu" and v.is_pinned(), k
        assert handle.device_bytes <= (handle.max_buckets - 1) * handle.peak_device_bytes


def test_device_memory_holds_one_bucket_of_state():
    model, batch_fn, loss_fn = make_model("gpt")
    model = model.cuda()
    opt = layeropt.AdamW(model.parameters(), lr=0.01)
    layeropt.attach(model, opt, bucket_cap_mb=0.0)
    handle = offload_state(opt)
    runs = [(model, opt, handle)]
    _train(runs, batch_fn, loss_fn, steps=1)
    torch.cuda.synchronize()
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert torch.cuda.memory_allocated() < params + handle.host_bytes // 4
    assert handle.peak_device_bytes < handle.host_bytes


def test_overlap_state_dict_round_trip_resumes_exactly():
    runs, batch_fn, loss_fn = _runs("AdamW", dict(lr=0.01, fused=True), 0.0,
                                    [None, dict(overlap=True)])
    _train(runs, batch_fn, loss_fn, steps=2)
    (_, _, _), (_, plain, _), (m, off, handle) = runs
    saved = copy.deepcopy(off.state_dict())
    assert_same(plain.state_dict(), saved)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    off.load_state_dict(saved)  # straight into host memory
    state_bytes = sum(v.nbytes for s in off.state.values() for v in s.values() if v.dim() > 0)
    assert torch.cuda.max_memory_allocated() - before < state_bytes // 4  # never on the GPU
    for s in off.state.values():
        assert s["exp_avg"].device.type == "cpu" and s["exp_avg"].is_pinned()
        assert s["step"].is_cuda  # fused: where torch keeps it
    _train(runs, batch_fn, loss_fn, steps=2)
    assert_same(plain.state_dict(), off.state_dict())
    handle.remove()
    assert all(s["exp_avg"].is_cuda for s in off.state.values())
