"""layeropt.offload on CUDA: pinned host state, synchronous and overlapped copies, held
gradients in pinned host memory, prefetch in landing order.

Bit for bit against the same loop without offload and against torch.optim, on
the GPU (skipped without CUDA; ``benchmarks/device_check.sh`` runs it). Also
FSDP2's own ``CPUOffloadPolicy`` (gradients copied into host memory before
the hooks run; refused at attach on the torch releases where the hooks run
first, pytorch#180666).

An offloaded optimizer's ``state_dict()`` holds its state in host memory
(pinned) while torch.optim's is on the GPU, so state dicts are compared by
value, every tensor copied to the CPU first (:func:`_assert_same_values`),
and where each tensor is is asserted on its own (:func:`_assert_state_devices`).
Memory is measured as the change from a baseline the test takes itself
(:func:`_settled`), never as an absolute that counts what earlier tests left.
"""

from __future__ import annotations

import copy
import gc
from typing import Any

import pytest
import torch
from torch import nn

import layeropt
from harness import assert_models_equal, assert_same, fully_shard, one_process_group
from layeropt.distributed.fsdp_offload import has_offload_race, offloaded_shards
from layeropt.errors import LayeroptError
from layeropt.models import make_model
from layeropt.engine.stepper import PLAIN
from layeropt.offload import StateOffload, offload_state
from layeropt.offload.state import _install

try:
    from torch.distributed.fsdp import CPUOffloadPolicy
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import CPUOffloadPolicy

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

CONFIGS = [("AdamW", dict(lr=0.01)), ("AdamW", dict(lr=0.01, fused=True)),
           ("Adam", dict(lr=0.01, capturable=True)), ("Adam", dict(lr=0.01, amsgrad=True, foreach=True)),
           ("SGD", dict(lr=0.1, momentum=0.9))]


def _on_cpu(x: Any) -> Any:
    """``x`` (a state dict, nested dicts/lists/tuples) with every tensor on the CPU:
    a device tensor copied there (a blocking copy, after the work that wrote it),
    a host one as it is."""
    if isinstance(x, torch.Tensor):
        return x.detach().cpu()
    if isinstance(x, dict):
        return {k: _on_cpu(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_on_cpu(v) for v in x]
    if isinstance(x, tuple):
        return tuple(_on_cpu(v) for v in x)
    return x


def _assert_same_values(a: Any, b: Any) -> None:
    """Bit for bit, wherever each side's tensors live (``torch.equal`` on the CPU)."""
    assert_same(_on_cpu(a), _on_cpu(b))


def _assert_state_devices(ref: dict, sd: dict, offloaded: bool) -> None:
    """Where ``sd``'s state tensors are: offloaded (``offload_state``), every state
    tensor of one or more dimensions in pinned host memory; 0-dim ones (Adam's
    ``step``) where torch keeps them - on the device of ``ref``'s (torch.optim's)
    tensor: the CPU, or the GPU with ``fused``/``capturable``. Not offloaded,
    every tensor on ``ref``'s device."""
    for i, state in sd["state"].items():
        for k, v in state.items():
            if not isinstance(v, torch.Tensor):
                continue
            where = ref["state"][i][k].device
            if offloaded and v.dim() > 0:
                assert v.device.type == "cpu" and v.is_pinned(), (i, k, v.device)
            else:
                assert v.device == where, (i, k, v.device, where)


def _settled() -> int:
    """Bytes torch's allocator has handed out now: the GPU idle, garbage collected,
    the cache emptied (a baseline or an end point of a memory delta)."""
    torch.cuda.synchronize()
    gc.collect()
    torch.cuda.empty_cache()
    return torch.cuda.memory_allocated()


def _cuda(data: Any) -> Any:
    return tuple(t.cuda() for t in data) if isinstance(data, tuple) else data.cuda()


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
        data = _cuda(batch_fn(gen))
        for m, o, _ in runs:
            loss_fn(m, data).backward()
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("cap", [0.0, 1.0], ids=["cap0", "default-cap"])
@pytest.mark.parametrize("opt_name,kw", CONFIGS, ids=[f"{n}{kw}" for n, kw in CONFIGS])
def test_sync_and_overlap_match_no_offload_and_torch(opt_name, kw, cap):
    # (no accumulation here: overlap without prefetch needs held_grads=False, else refused)
    offloads = [None, dict(), dict(overlap=True, held_grads=False),
                dict(overlap=True, held_grads=False, max_buckets=1)]
    runs, batch_fn, loss_fn = _runs(opt_name, kw, cap, offloads)
    _train(runs, batch_fn, loss_fn)
    (m0, o0, _), *rest = runs
    ref = o0.state_dict()
    for m, o, handle in rest:
        assert_models_equal(m0, m)
        sd = o.state_dict()  # (synchronizes an overlapped handle)
        _assert_same_values(ref, sd)
        _assert_state_devices(ref, sd, offloaded=handle is not None)
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
        batches = [_cuda(batch_fn(gen)) for _ in range(micro)]
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
    ref = o0.state_dict()
    for m, o, handle in rest:
        assert_models_equal(m0, m)
        sd = o.state_dict()
        _assert_same_values(ref, sd)
        _assert_state_devices(ref, sd, offloaded=handle is not None)
        if handle is not None and handle.order is not None and cap == 0.0:
            assert handle.prefetched_bytes > 0  # (the default cap: one step call, nothing next)


def test_clipped_window_with_held_grads_on_host():
    """layeropt.backward(max_norm=) ending a window whose held part is in host memory."""
    runs, batch_fn, loss_fn = _runs("AdamW", dict(lr=0.01, fused=True), 0.0,
                                    [None, dict(), dict(overlap=True, prefetch=True)])
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        batches = [_cuda(batch_fn(gen)) for _ in range(2)]
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
    ref = o0.state_dict()
    for m, o, handle in rest:
        assert_models_equal(m0, m)
        sd = o.state_dict()
        _assert_same_values(ref, sd)
        _assert_state_devices(ref, sd, offloaded=handle is not None)


def test_device_memory_holds_one_bucket_of_state():
    """After a step no state is left on the GPU: the allocator's bytes return to the
    baseline taken here (parameters, and whatever earlier tests left) within a
    quarter of the state, and the handle counts one bucket's state at most."""
    model, batch_fn, loss_fn = make_model("gpt")
    model = model.cuda()
    # A forward and backward first, on a throwaway copy: cuBLAS's workspaces (kept for
    # the process, per thread and stream: the backward runs on autograd's thread) then
    # exist before the baseline instead of counting as this step's.
    warm = copy.deepcopy(model)
    loss_fn(warm, _cuda(batch_fn(torch.Generator().manual_seed(0)))).backward()
    del warm
    opt = layeropt.AdamW(model.parameters(), lr=0.01)
    layeropt.attach(model, opt, bucket_cap_mb=0.0)
    handle = offload_state(opt)
    base = _settled()
    _train([(model, opt, handle)], batch_fn, loss_fn, steps=1)
    left = _settled() - base
    state = handle.host_bytes
    assert state > 0 and handle.device_bytes == 0
    assert left < state // 4, (left, state)  # kept on the device, it would be `state` more
    assert handle.peak_device_bytes < state


def test_overlap_state_dict_round_trip_resumes_exactly():
    # (no accumulation here: overlap without prefetch needs held_grads=False, else refused)
    runs, batch_fn, loss_fn = _runs("AdamW", dict(lr=0.01, fused=True), 0.0,
                                    [None, dict(overlap=True, held_grads=False)])
    _train(runs, batch_fn, loss_fn, steps=2)
    (_, _, _), (_, plain, _), (m, off, handle) = runs
    live = off.state_dict()  # (synchronizes the overlapped copies back)
    _assert_state_devices(plain.state_dict(), live, offloaded=True)
    saved = copy.deepcopy(live)
    del live
    _assert_same_values(plain.state_dict(), saved)
    before = _settled()
    torch.cuda.reset_peak_memory_stats()
    off.load_state_dict(saved)  # straight into host memory
    state_bytes = sum(v.nbytes for s in off.state.values() for v in s.values() if v.dim() > 0)
    assert torch.cuda.max_memory_allocated() - before < state_bytes // 4  # never on the GPU
    for s in off.state.values():
        assert s["exp_avg"].device.type == "cpu" and s["exp_avg"].is_pinned()
        assert s["step"].is_cuda  # fused: where torch keeps it
    _train(runs, batch_fn, loss_fn, steps=2)
    sd = off.state_dict()
    _assert_same_values(plain.state_dict(), sd)
    _assert_state_devices(plain.state_dict(), sd, offloaded=True)
    del sd
    handle.remove()
    assert all(s["exp_avg"].is_cuda for s in off.state.values())


def test_overlap_without_prefetch_with_held_grads_is_refused():
    """overlap=True alone, held gradients in host memory (the default): refused until a
    GPU run has shown it exact (the next test is that run); the message names
    prefetch=True. The modes it names are accepted."""
    model, _, _ = make_model("gpt")
    model = model.cuda()
    opt = layeropt.AdamW(model.parameters(), lr=0.01)
    layeropt.attach(model, opt)
    with pytest.raises(LayeroptError, match="prefetch=True"):
        offload_state(opt, overlap=True)
    assert opt._lo_engine.stepper is PLAIN  # nothing installed
    handle = offload_state(opt, overlap=True, prefetch=True)
    assert handle.overlap and handle.order is not None and handle.held is not None


def test_offload_state_does_not_pool_on_cuda_yet():
    """The host pools are built on CUDA only through StateOffload(pooled=True) until a
    GPU run has shown them (the tests below): offload_state allocates as before."""
    model, _, _ = make_model("gpt")
    opt = layeropt.AdamW(model.cuda().parameters(), lr=0.01)
    layeropt.attach(model, opt)
    handle = offload_state(opt)
    assert handle.pool is None and handle.held.pool_factory is None


def _built_anyway(cap: float, add_on_device: bool = False, max_buckets: int = 2,
                  **kw: Any) -> StateOffload:
    """A StateOffload offload_state would refuse or does not offer (``kw``), built
    directly with its pools, trained over accumulation windows beside torch.optim:
    parameters and state bit for bit, the state in pinned host memory."""
    runs, batch_fn, loss_fn = _runs("AdamW", dict(lr=0.01, fused=True), cap, [None])
    m, o, _ = runs[1]
    handle = _install(o, StateOffload(o, max_buckets, pooled=True,
                                      add_on_device=add_on_device, **kw))
    runs[1] = (m, o, handle)
    _window(runs, batch_fn, loss_fn, steps=3)
    (m0, o0, _), (m, o, handle) = runs
    assert_models_equal(m0, m)
    ref, sd = o0.state_dict(), o.state_dict()
    _assert_same_values(ref, sd)
    _assert_state_devices(ref, sd, offloaded=True)
    return handle


@pytest.mark.parametrize("max_buckets", [1, 2])
@pytest.mark.parametrize("cap", [0.0, 1.0], ids=["cap0", "default-cap"])
def test_refused_overlap_with_held_grads_built_anyway(cap, max_buckets):
    """The refused mode, built past offload_state's refusal, over accumulation windows:
    bit for bit with torch.optim, or the refusal stays. (2026-12-04's "not equal" for
    it was the benchmark's traced backward stepping that model once more: see
    docs/results/gpu-h200.md.)"""
    handle = _built_anyway(cap, max_buckets=max_buckets, overlap=True)
    assert handle.held.down_bytes > 0 and handle.held.up_bytes > 0


@pytest.mark.parametrize("add_on_device", [False, True], ids=["host-sums", "device-sums"])
@pytest.mark.parametrize("cap", [0.0, 1.0], ids=["cap0", "default-cap"])
def test_two_copy_streams_built_anyway(cap, add_on_device):
    """Copies in and out on streams of their own (``copy_streams=2``), and held sums added
    on the device: not offered by offload_state until this shows them bit for bit with
    torch.optim on a GPU (their order is checked on the CPU, tests/test_stream_order.py).
    The host state and held sums are the pools' pinned tensors."""
    handle = _built_anyway(cap, add_on_device, overlap=True, prefetch=True, copy_streams=2)
    assert handle.pool is not None and handle.pool.pinned
    assert handle.held.pool is not None and handle.held.pool.pinned


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
