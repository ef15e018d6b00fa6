"""The offloaded state's host memory, allocated once (``layeropt/offload/pool.py``).

``offload_state`` learns the state's layout from a meta step, allocates one
block of exactly its bytes, and every host state tensor is carved from it: no
host allocation in the first step, nothing rounded up. Exactness with the
pool is what ``tests/test_offload.py`` checks (it is on by default); here: the
layout against the state torch creates, the allocations, and the fallbacks.
"""

from __future__ import annotations

import copy

import pytest
import torch

import layeropt
from harness import OPTIMIZER_CONFIGS, assert_models_equal, assert_same, clone_kwargs, config_id
from layeropt.models import make_model
from layeropt.offload import offload_state
from layeropt.offload import state as offload_module
from layeropt.offload.pool import HELD_SUM, HostPool, state_layout


def _dense(state: dict) -> dict:
    """(param index, key) -> (size, stride, dtype) of a state dict's state tensors of one
    or more dimensions."""
    return {(i, k): (v.size(), v.stride(), v.dtype) for i, s in state.items()
            for k, v in s.items() if isinstance(v, torch.Tensor) and v.dim() > 0}


def _train_both(ref, ref_opt, model, opt, batch_fn, loss_fn, steps: int = 2) -> None:
    """``steps`` steps of torch (``ref``) and layeropt (``model``) on the same batches."""
    gen = torch.Generator().manual_seed(0)
    for _ in range(steps):
        data = batch_fn(gen)
        for m, o in ((ref, ref_opt), (model, opt)):
            loss_fn(m, data).backward()
            o.step()
            o.zero_grad()


@pytest.mark.parametrize("cfg", OPTIMIZER_CONFIGS, ids=config_id)
def test_layout_is_the_state_torch_creates(cfg):
    """The meta step's layout equals the state torch.optim creates in its first step, for
    every optimizer and option of the exactness table."""
    name, kw = cfg
    model, batch_fn, loss_fn = make_model("gpt")
    ref = copy.deepcopy(model)
    ref_opt = getattr(torch.optim, name)(ref.parameters(), **clone_kwargs(kw))
    loss_fn(ref, batch_fn(torch.Generator().manual_seed(0))).backward()
    ref_opt.step()
    opt = layeropt.in_backward(getattr(torch.optim, name))(model.parameters(),
                                                           **clone_kwargs(kw))
    layout = state_layout(opt)
    index = {id(p): i for i, p in enumerate(model.parameters())}
    assert {(index[pid], k): v for (pid, k), v in layout.items()} == \
        _dense(ref_opt.state_dict()["state"])


def test_the_first_step_allocates_no_host_memory(monkeypatch):
    """Every host state tensor comes from the block allocated by offload_state(), each a
    storage of its own (``torch.save`` of one saves it alone); none is allocated in a
    step; the block is exactly the state's bytes (each tensor aligned)."""
    made = []
    real = offload_module.empty_like
    monkeypatch.setattr(offload_module, "empty_like",
                        lambda t, device: made.append(device) or real(t, device))
    model, batch_fn, loss_fn = make_model("gpt")
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01)
    opt = layeropt.AdamW(model.parameters(), lr=0.01)
    layeropt.attach(model, opt, bucket_cap_mb=0.0)
    handle = offload_state(opt)
    block = handle.pool.nbytes
    _train_both(ref, ref_opt, model, opt, batch_fn, loss_fn)
    assert "cpu" not in made  # (working tensors on the "device" only)
    for p, s in opt.state.items():  # each the pool's tensor for its entry
        for k, v in s.items():
            if v.dim() > 0:
                assert handle.pool.take((id(p), k), v) is v
                assert v.untyped_storage().nbytes() == v.nbytes  # (a storage of its own)
    state = handle.host_bytes
    assert state <= block < state + 512 * sum(len(s) for s in opt.state.values())
    assert handle.held.pool is None  # (nothing held: no block for held sums)
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


def test_the_block_is_freed_with_the_optimizer():
    """Deleting the optimizer frees the blocks (state, held sums), though the handle lives
    on (as deleting a torch.optim optimizer frees its state); ``remove()`` lets go of
    them too."""
    import gc

    model, batch_fn, loss_fn = make_model("mlp")
    gc.collect()
    gc.disable()
    try:
        opt = layeropt.AdamW(model.parameters())
        handle = layeropt.attach(model, opt)
        offloaded = offload_state(opt)
        gen = torch.Generator().manual_seed(0)
        loss_fn(model, batch_fn(gen)).backward()
        with opt.no_step():  # a held gradient: the sums' block
            loss_fn(model, batch_fn(gen)).backward()
        opt.zero_grad()
        pools = [offloaded.pool, offloaded.held.pool]
        assert all(p.allocated for p in pools)
        handle.remove()
        del opt, handle
        assert not any(p.allocated or p._entries for p in pools)
    finally:
        gc.enable()
    opt = layeropt.AdamW(model.parameters())
    layeropt.attach(model, opt)
    offloaded = offload_state(opt)
    pool = offloaded.pool
    offloaded.remove()
    assert offloaded.pool is None and pool._entries == {}


class _Inspecting(torch.optim.SGD):
    """A third-party-style optimizer whose step copies a gradient to the CPU: its meta
    step fails (a meta tensor has no data to copy), so there is no pool for its state."""

    def step(self, closure=None):
        for g in self.param_groups:
            for p in g["params"]:
                if p.grad is not None and bool(p.grad.cpu().abs().sum() < 0):
                    raise AssertionError
        return super().step(closure)


def test_an_optimizer_the_meta_step_cannot_run_has_no_pool():
    model, batch_fn, loss_fn = make_model("mlp")
    ref = copy.deepcopy(model)
    ref_opt = _Inspecting(ref.parameters(), lr=0.1, momentum=0.9)
    opt = layeropt.in_backward(_Inspecting)(model.parameters(), lr=0.1, momentum=0.9)
    layeropt.attach(model, opt)
    handle = offload_state(opt)
    assert handle.pool is None
    _train_both(ref, ref_opt, model, opt, batch_fn, loss_fn)
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())


def test_a_block_that_cannot_be_allocated_warns_and_goes_on(monkeypatch):
    def refuse(*args, **kwargs):
        raise RuntimeError("no pinned memory")

    monkeypatch.setattr(HostPool, "__init__", refuse)
    model, _, _ = make_model("mlp")
    opt = layeropt.AdamW(model.parameters())
    layeropt.attach(model, opt)
    with pytest.warns(RuntimeWarning, match="one block.*tensor by tensor"):
        handle = offload_state(opt)
    assert handle.pool is None


@pytest.mark.parametrize("cap", [0.0, 1.0], ids=["cap0", "default-cap"])
def test_held_sums_live_in_the_pool(cap):
    """Over accumulation windows each held gradient's host sum is the held sums' pool's
    tensor for its parameter (a block made at the first holding backward), the same
    every window; the sums equal torch's bit for bit."""
    model, batch_fn, loss_fn = make_model("gpt")
    ref = copy.deepcopy(model)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, fused=True)
    opt = layeropt.AdamW(model.parameters(), lr=0.01, fused=True)
    layeropt.attach(model, opt, bucket_cap_mb=cap)
    handle = offload_state(opt)
    gen = torch.Generator().manual_seed(0)
    sums = {}
    for _ in range(3):
        batches = [batch_fn(gen) for _ in range(3)]
        for data in batches:
            (loss_fn(ref, data) / 3).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        for k, data in enumerate(batches):
            if k < 2:
                with opt.no_step():
                    (loss_fn(model, data) / 3).backward()
            else:
                held = dict(handle.held.host)
                assert held and all(
                    t is handle.held.pool.take((id(p), HELD_SUM), t) for p, t in held.items())
                assert all(sums.setdefault(p, t) is t for p, t in held.items())
                (loss_fn(model, data) / 3).backward()
        opt.step()
        opt.zero_grad()
    assert_models_equal(ref, model)
    assert_same(ref_opt.state_dict(), opt.state_dict())
