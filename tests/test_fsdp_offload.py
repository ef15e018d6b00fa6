"""FSDP2 with ``CPUOffloadPolicy``: seen at attach, refused where torch has the race.

torch 2.5-2.12 run post-accumulate-grad hooks before a pinned gradient's copy
from the GPU has landed (pytorch#180666; ``layeropt/distributed/fsdp_offload.py``). On
CPU nothing is copied, so here: the version rule on a table of releases, the
policy seen on a real FSDP2 model (CPU mesh, gloo), attach exact against
torch.optim on that model, and attach refusing - before any hook is
registered - when what it sees would race. The CUDA case is in
``tests/test_cuda_offload.py``.
"""

from __future__ import annotations

import pytest
import torch
from harness import assert_same, fully_shard, needs_fsdp2
from torch import nn

import layeropt
from layeropt.distributed import fsdp_offload
from layeropt.distributed.fsdp_offload import OffloadedShard, has_offload_race, offloaded_shards, refusal

try:
    from torch.distributed.fsdp import CPUOffloadPolicy
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import CPUOffloadPolicy


@pytest.mark.parametrize("version,race", [
    ("2.4.1", False),  # FSDP2 runs no post-accumulate-grad hooks yet
    ("2.5.0", True), ("2.5.1", True), ("2.8.0", True), ("2.12.1", True),
    ("2.13.0a0+git1234", True),  # a 2.13 pre-release may predate the fix
    ("2.13.0", False), ("2.13.0+cpu", False), ("2.14.1+cu130", False), ("2.15.0", False),
])
def test_race_by_torch_version(version, race):
    assert has_offload_race(version) is race


def test_refusal_names_the_problem_and_the_fixes():
    pinned_gpu = OffloadedShard("0.weight", True, "cuda")
    message = refusal([pinned_gpu], "2.12.1")
    for text in ("pytorch#180666", "torch 2.12.1", "0.weight", ">= 2.13",
                 "CPUOffloadPolicy(pin_memory=False)", "drop offload_policy"):
        assert text in message, text
    assert refusal([pinned_gpu], "2.13.0") is None  # fixed
    assert refusal([pinned_gpu._replace(pin_memory=False)], "2.12.1") is None  # copied at once
    assert refusal([pinned_gpu._replace(device_type="cpu")], "2.12.1") is None  # nothing copied
    assert refusal([], "2.12.1") is None


def _model(policy: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)])
    # CPU has no pinned memory: pin_memory=False (on a GPU the default True is the race)
    kw = dict(offload_policy=CPUOffloadPolicy(pin_memory=False)) if policy else {}
    mesh = torch.distributed.device_mesh.init_device_mesh("cpu", (1,))
    for block in model:
        fully_shard(block, mesh=mesh, **kw)
    return fully_shard(model, mesh=mesh, **kw)


def _train(runs: list[tuple[nn.Module, torch.optim.Optimizer]], steps: int = 3) -> None:
    for i in range(steps):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        for model, opt in runs:
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()


@needs_fsdp2
def test_offload_policy_is_seen_and_attach_is_exact(process_group):
    """On this torch (and a CPU mesh: no race), FSDP2 + CPUOffloadPolicy attaches and
    equals torch.optim on the same model, bit for bit."""
    ref, model = _model(policy=True), _model(policy=True)
    assert offloaded_shards(_model(policy=False)) == []
    seen = offloaded_shards(model)
    assert [s.name for s in seen] == [n for n, _ in model.named_parameters()]
    assert all(not s.pin_memory and s.device_type == "cpu" for s in seen)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = layeropt.AdamW(model.parameters(), lr=1e-2)
    with layeropt.attach(model, opt, bucket_cap_mb=0):
        _train([(ref, ref_opt), (model, opt)])
        assert opt.stepped_in_backward == len(seen)  # (in the last backward)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.to_local(), q.to_local())
    assert_same(opt.state_dict(), ref_opt.state_dict())


@needs_fsdp2
def test_attach_refuses_what_would_race(process_group, monkeypatch):
    """What attach sees is checked before any hook: a pinned GPU offload under a torch
    with the race is refused, and the model stays unattached."""
    model = _model(policy=True)
    seen = offloaded_shards(model)
    monkeypatch.setattr(fsdp_offload, "offloaded_shards",
                        lambda m: [s._replace(pin_memory=True, device_type="cuda") for s in seen])
    monkeypatch.setattr(torch, "__version__", "2.12.1")
    opt = layeropt.AdamW(model.parameters(), lr=1e-2)
    with pytest.raises(layeropt.AttachError, match="pytorch#180666"):
        layeropt.attach(model, opt)
    assert not opt.attached
    assert not any(p._post_accumulate_grad_hooks for p in model.parameters())
    monkeypatch.setattr(torch, "__version__", "2.13.0")
    layeropt.attach(model, opt).remove()  # the fixed torch: attached
