"""layeropt.offload on CUDA: pinned host state, synchronous and overlapped copies, held
gradients in pinned host memory, prefetch in landing order.

Bit for bit against the same loop without offload and against torch.optim, on
the GPU (skipped without CUDA; ``benchmarks/device_check.sh`` runs it). Also
FSDP2's own ``CPUOffloadPolicy`` (gradients copied into host memory before
the hooks run; refused at attach on the torch releases where the hooks run
first, pytorch#180666).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import layeropt
from harness import assert_models_equal, assert_same, fully_shard, one_process_group
from layeropt._fsdp_offload import has_offload_race, offloaded_shards
from layeropt.models import make_model
from layeropt.offload import offload_state

try:
    from torch.distributed.fsdp import CPUOffloadPolicy
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import CPUOffloadPolicy

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


def _window(runs, batch_fn, loss_fn, steps=3, micro=3):
    """Accumulation windows: torch sums ``micro`` micro-batches; layeropt holds all but
    the last with no_step() (in pinned host memory with offload's held_grads)."""
    gen = torch.Generator().manual_seed(2)
    for _ in range(steps):
        batches = []
        for _ in range(micro):
            data = batch_fn(gen)
            batches.append(tuple(t.cuda() for t in data) if isinstance(data, tuple)
                           else data.cuda())
        for i, (m, o, handle) in enumerate(runs):
            for k, data in enumerate(batches):
                if i and k < micro - 1:
                    with o.no_step():
                        (loss_fn(m, data) / micro).backward()
                    if handle is not None and handle.held is not None:
                        assert all(t.is_pinned() for t in handle.held.host.values())
                        assert all(p.grad is None for p in m.parameters())
                else:
                    (loss_fn(m, data) / micro).backward()
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("cap", [0.0, 1.0], ids=["cap0", "default-cap"])
@pytest.mark.parametrize("opt_name,kw", CONFIGS, ids=[f"{n}{kw}" for n, kw in CONFIGS])
def test_held_grads_and_prefetch_match_no_offload_and_torch(opt_name, kw, cap):
    """Held gradients in pinned host memory and prefetch in landing order, bit for bit."""
    offloads = [None, dict(), dict(held_grads=False), dict(prefetch=True),
                dict(overlap=True, prefetch=True, max_buckets=1)]
    runs, batch_fn, loss_fn = _runs(opt_name, kw, cap, offloads)
    _window(runs, batch_fn, loss_fn, steps=2)
    (m0, o0, _), *rest = runs
    for m, o, handle in rest:
        assert_models_equal(m0, m)
        assert_same(o0.state_dict(), o.state_dict())
        if handle is not None and handle.order is not None and cap == 0.0:
            assert handle.prefetched_bytes > 0  # (the default cap: one step call, nothing next)


def test_clipped_window_with_held_grads_on_host():
    """layeropt.backward(max_norm=) ending a window whose held part is in host memory."""
    runs, batch_fn, loss_fn = _runs("AdamW", dict(lr=0.01, fused=True), 0.0,
                                    [None, dict(), dict(overlap=True, prefetch=True)])
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        batches = [batch_fn(gen).cuda() for _ in range(2)]
        (ref, ref_opt, _), *ours = runs
        for data in batches:
            (loss_fn(ref, data) / 2).backward()
        torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05)
        ref_opt.step()
        ref_opt.zero_grad()
        for m, o, _ in ours:
            with o.no_step():
                (loss_fn(m, batches[0]) / 2).backward()
            layeropt.backward(loss_fn(m, batches[1]) / 2, max_norm=0.05)
            o.zero_grad()
    (m0, o0, _), *rest = runs
    for m, o, _ in rest:
        assert_models_equal(m0, m)
        assert_same(o0.state_dict(), o.state_dict())


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


# -- FSDP2 with CPUOffloadPolicy ------------------------------------------------------
@pytest.fixture(scope="module")
def nccl_group():
    """One NCCL process, for FSDP2 on the GPU in this process."""
    torch.cuda.set_device(0)
    yield from one_process_group("nccl")


def _fsdp2_offloaded(pin: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(512, 512), nn.Tanh()) for _ in range(4)])
    mesh = torch.distributed.device_mesh.init_device_mesh("cuda", (1,))
    policy = CPUOffloadPolicy(pin_memory=pin)
    for block in model:
        fully_shard(block.cuda(), mesh=mesh, offload_policy=policy)
    return fully_shard(model, mesh=mesh, offload_policy=policy)


@pytest.mark.parametrize("pin", [True, False], ids=["pinned", "pageable"])
def test_fsdp2_cpu_offload_policy(nccl_group, pin):
    """Attached and bit for bit with torch.optim where torch copies each gradient before
    the hooks run; refused (nothing attached) where it does not. The reference's own
    hook checks that guarantee: the gradient a hook reads is the one step() gets."""
    ref, model = _fsdp2_offloaded(pin), _fsdp2_offloaded(pin)
    seen = offloaded_shards(model)
    assert len(seen) == 8 and all(s.pin_memory is pin and s.device_type == "cuda" for s in seen)
    opt = layeropt.AdamW(model.parameters(), lr=1e-2)
    if pin and has_offload_race(torch.__version__):
        with pytest.raises(layeropt.AttachError, match="pytorch#180666"):
            layeropt.attach(model, opt)
        assert not opt.attached
        return
    read_in_hook = {}
    for p in ref.parameters():
        p.register_post_accumulate_grad_hook(
            lambda p: read_in_hook.__setitem__(p, p.grad.to_local().clone()))
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    with layeropt.attach(model, opt, bucket_cap_mb=0):
        for i in range(3):
            x = torch.randn(64, 512, generator=torch.Generator().manual_seed(i)).cuda()
            for m, o in ((ref, ref_opt), (model, opt)):
                m(x).square().mean().backward()
                if m is ref:
                    for p in ref.parameters():
                        assert_same(read_in_hook[p], p.grad.to_local())
                o.step()
                o.zero_grad()
        assert opt.stepped_in_backward == len(seen)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.to_local().device.type == "cpu"
        assert_same(p.to_local(), q.to_local())
    assert_same(opt.state_dict(), ref_opt.state_dict())
