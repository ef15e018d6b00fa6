"""Tensor parallelism (``parallelize_module``), alone and under FSDP2 (2-D), and FSDP2 on
a 2-D mesh (HSDP): layeropt steps each DTensor parameter as its gradient lands and ends bit
for bit where the same loop with torch.optim ends (parameters and optimizer state), on two
and four gloo ranks on CPU.

Every tensor-parallel rank sees the same batch; the data-parallel ranks of the 2-D mesh
each their own. Parameters tensor parallelism leaves as plain tensors (norms outside
``SequenceParallel``) are refused before anything steps, unless allowed
(``layeropt.distributed.allow_local_updates``), as anywhere several processes run.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import layeropt
from harness import FSDP2_ON_CPU, RUNS, TORCH, assert_same
from loopfuzz import full, on_ranks
from layeropt.errors import AttachError

pytestmark = [
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                       reason="needs torch.distributed with gloo"),
    pytest.mark.skipif(TORCH < (2, 5), reason="tensor parallelism on CPU from torch 2.5"),
]

# name: (world, 2-D, norms sharded by SequenceParallel, optimizer, options, micro-batches,
# max_norm). 2-D: a (data 2, tensor 2) mesh, FSDP2 over the data dimension.
CASES: dict[str, tuple[int, bool, bool, str, dict[str, Any], int, float | None]] = {
    "tp-seqpar-adam": (2, False, True, "Adam", dict(lr=0.01), 1, None),
    "tp-seqpar-adamw-accum-clip": (
        2, False, True, "AdamW", dict(lr=0.01, weight_decay=0.1), 2, 0.05),
    "tp-seqpar-sgd-clip": (2, False, True, "SGD", dict(lr=0.1, momentum=0.9), 1, 0.05),
    "tp-plain_norms_allowed-adam-accum": (2, False, False, "Adam", dict(lr=0.01), 2, None),
    "2d-seqpar-adam-accum-clip": (4, True, True, "Adam", dict(lr=0.01), 2, 0.05),
    "2d-plain_norms-sgd": (4, True, False, "SGD", dict(lr=0.1, momentum=0.9), 1, None),
}
STEPS = 3


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm, self.up, self.down = nn.LayerNorm(8), nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(self.norm(x))))


def _model(mesh: Any, seqpar: bool, final_norm: bool = True) -> nn.Module:
    """Two blocks (and a norm): ``up`` column-, ``down`` row-parallel; the norms sharded
    along the sequence (``seqpar``) or left plain."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    torch.manual_seed(0)
    model = nn.Sequential(_Block(), _Block(), *([nn.LayerNorm(8)] if final_norm else []))
    plan: dict[str, Any] = {}
    for i in (0, 1):
        if seqpar:
            plan[f"{i}.norm"] = SequenceParallel()
            plan[f"{i}.up"] = ColwiseParallel(input_layouts=Shard(1))
            plan[f"{i}.down"] = RowwiseParallel(output_layouts=Shard(1))
        else:
            plan[f"{i}.up"], plan[f"{i}.down"] = ColwiseParallel(), RowwiseParallel()
    if seqpar and final_norm:
        plan["2"] = SequenceParallel()
    return parallelize_module(model, mesh, plan)


def _mesh(two_d: bool) -> tuple[Any, Any, int]:
    """The tensor-parallel mesh, the data-parallel one (or None), and this rank's place
    along the data dimension."""
    from torch.distributed.device_mesh import init_device_mesh

    if not two_d:
        return init_device_mesh("cpu", (dist.get_world_size(),)), None, 0
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    return mesh["tp"], mesh["dp"], mesh["dp"].get_local_rank()


def _loss(model: nn.Module, step: int, micro: int, dp_rank: int, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + 10 * micro + 1000 * dp_rank)
    y = model(torch.randn(2, 4, 8, generator=g))
    y = y.full_tensor() if hasattr(y, "full_tensor") else y
    return y.square().mean() / n


def _train(name: str, attach: dict[str, Any] | None) -> dict[str, Any]:
    """One case's loop with torch.optim (``attach`` None) or layeropt attached with
    ``attach``: parameters and optimizer state as whole tensors, and the gradients left."""
    layer = attach is not None
    world, two_d, seqpar, opt_name, kw, micro, max_norm = CASES[name]
    tp, dp, dp_rank = _mesh(two_d)
    model = _model(tp, seqpar)
    if dp is not None:
        from torch.distributed.fsdp import fully_shard

        for block in list(model)[:2]:
            fully_shard(block, mesh=dp)
        fully_shard(model, mesh=dp)
    opt = getattr(layeropt if layer else torch.optim, opt_name)(model.parameters(), **kw)
    if layer:
        if not seqpar and dp is None:
            layeropt.distributed.allow_local_updates(model)  # (every rank: the same batch)
        layeropt.attach(model, opt, **attach)
    return _loop(model, opt, layer, lambda step, m: _loss(model, step, m, dp_rank, micro),
                 micro, max_norm)


def _loop(model: nn.Module, opt: Any, layer: bool, loss_of: Any, micro: int = 1,
          max_norm: float | None = None) -> dict[str, Any]:
    """``STEPS`` steps of ``micro`` micro-batches (``loss_of(step, m)``): torch.optim's loop
    (each backward, ``clip_grad_norm_``, step), or layeropt's (the micro-batches before the
    last in ``no_step()``, the last through ``layeropt.backward(max_norm=)``); parameters
    and optimizer state as whole tensors, and the gradients left."""
    for step in range(STEPS):
        for m in range(micro):
            loss = loss_of(step, m)
            if not layer:
                loss.backward()
            elif m < micro - 1:
                with opt.no_step():
                    loss.backward()
            elif max_norm is None:
                loss.backward()
            else:
                layeropt.backward(loss, max_norm=max_norm)
        if max_norm is not None and not layer:
            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        opt.zero_grad()
    return {"params": full({n: p.detach() for n, p in model.named_parameters()}),
            "state": full(opt.state_dict()),
            "grads_left": [n for n, p in model.named_parameters() if p.grad is not None]}


# (bucket_cap_mb: the default, or each layer at once; layeropt.backward(max_norm=))
REFUSED = {"default": (None, None), "cap0": (0.0, None), "max_norm": (None, 0.05)}


def _refused(cap: float | None, max_norm: float | None) -> dict[str, Any]:
    """Plain norms, not allowed: the first backward raises before anything steps (the
    row-parallel layers, whose gradients land first, included: stepped before the
    refusal until 2026-12-07 with ``bucket_cap_mb=0``)."""
    tp, _, _ = _mesh(False)
    model = _model(tp, seqpar=False, final_norm=False)
    before = full({n: p.detach().clone() for n, p in model.named_parameters()})
    opt = layeropt.SGD(model.parameters(), lr=0.1)
    layeropt.attach(model, opt, **({} if cap is None else {"bucket_cap_mb": cap}))
    try:
        loss = _loss(model, 0, 0, 0, 1)
        layeropt.backward(loss, max_norm=max_norm) if max_norm else loss.backward()
    except AttachError as e:
        message = str(e)
    else:
        message = None
    return {"message": message, "before": before,
            "after": full({n: p.detach() for n, p in model.named_parameters()})}


def _hsdp(attach: dict[str, Any] | None) -> dict[str, Any]:
    """FSDP2 sharding over one mesh dimension and replicating over the other (HSDP), each
    rank its own batches, two micro-batches, clipped (``layeropt.backward(max_norm=)``)."""
    layer = attach is not None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))
    for module in (model[0], model[2], model):
        fully_shard(module, mesh=mesh)
    opt = (layeropt.Adam if layer else torch.optim.Adam)(model.parameters(), lr=0.01)
    if layer:
        layeropt.attach(model, opt, **attach)

    def loss_of(step: int, m: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(10 * step + m + 100 * dist.get_rank())
        return model(torch.randn(4, 8, generator=g)).square().mean() / 2

    return _loop(model, opt, layer, loss_of, micro=2, max_norm=0.05)


def _hf(attach: dict[str, Any] | None, path: str) -> dict[str, Any]:
    """A Hugging Face Llama loaded with transformers' own tensor parallelism
    (``tp_plan="auto"``): its sharded weights DTensors, its norms plain (allowed: every
    rank gets the same batch)."""
    from torch.distributed.device_mesh import init_device_mesh
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        path, tp_plan="auto", device_mesh=init_device_mesh("cpu", (dist.get_world_size(),)),
        dtype=torch.float32)
    opt = (layeropt.AdamW if attach is not None else torch.optim.AdamW)(model.parameters(),
                                                                         lr=1e-3)
    if attach is not None:
        layeropt.distributed.allow_local_updates(model)
        layeropt.attach(model, opt, **attach)

    def loss_of(step: int, m: int) -> torch.Tensor:
        ids = torch.randint(0, 64, (2, 8), generator=torch.Generator().manual_seed(step))
        return model(input_ids=ids, labels=ids).loss

    return {**_loop(model, opt, attach is not None, loss_of),
            "kinds": sorted({type(p).__name__ for p in model.parameters()})}


def _hf_runs(path: str, rank: int) -> dict[str, Any]:
    """:func:`_hf`'s runs on this rank, from the model saved at ``path``."""
    import os

    # (transformers reads torchrun's variables to decide to shard)
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(dist.get_world_size()))
    try:
        reference = _hf(None, path)
    except Exception as e:  # noqa: BLE001 - transformers' TP failing with torch.optim too
        return {"skip": f"transformers' tp_plan with torch.optim: {type(e).__name__}: {e}"}
    return {run: reference if attach is None else _hf(attach, path)
            for run, attach in RUNS.items()}


def _job(world: int, rank: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if world == 4 and FSDP2_ON_CPU:
        out["hsdp"] = {run: _hsdp(attach) for run, attach in RUNS.items()}
    for name, case in CASES.items():
        if case[0] == world:
            out[name] = {run: _train(name, attach) for run, attach in RUNS.items()}
    if world == 2:
        out["refused"] = {case: _refused(*how) for case, how in REFUSED.items()}
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return on_ranks(functools.partial(_job, 2), world=2)


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    return on_ranks(functools.partial(_job, 4), world=4)


@pytest.mark.parametrize("name", list(CASES))
def test_tensor_parallel_training_equals_torch_optim(name, request):
    world, two_d = CASES[name][:2]
    if two_d and not FSDP2_ON_CPU:
        pytest.skip("FSDP2 runs on CPU from torch 2.8")
    ranks = request.getfixturevalue("two_ranks" if world == 2 else "four_ranks")
    for rank, out in enumerate(ranks):
        for run in RUNS:
            assert_same(out[name][run]["params"], out[name]["torch"]["params"], f"{rank} {run}")
            assert_same(out[name][run]["state"], out[name]["torch"]["state"], f"{rank} {run}")
            assert run == "torch" or out[name][run]["grads_left"] == [], out[name][run]
    assert_same(ranks[0][name]["layeropt"]["params"], ranks[-1][name]["layeropt"]["params"],
                "replicas")


def test_transformers_tensor_parallelism_equals_torch_optim(tmp_path):
    """``from_pretrained(tp_plan="auto")`` on two ranks of their own, the model allowed
    local updates (its plain norms see the same batch on every rank)."""
    transformers = pytest.importorskip("transformers", minversion="5")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2)).save_pretrained(tmp_path)
    ranks = on_ranks(functools.partial(_hf_runs, str(tmp_path)), world=2)
    if "skip" in ranks[0]:  # (torch 2.6: transformers 5.25 passes distribute_tensor an
        pytest.skip(ranks[0]["skip"][:300])  # argument it does not take)
    for rank, out in enumerate(ranks):
        assert out["torch"]["kinds"] == ["DTensor", "Parameter"]
        for run in RUNS:
            assert_same(out[run], out["torch"], f"rank {rank} {run}")


@pytest.mark.skipif(not FSDP2_ON_CPU, reason="FSDP2 runs on CPU from torch 2.8")
def test_hsdp_equals_torch_optim(four_ranks):
    for rank, out in enumerate(four_ranks):
        for run in RUNS:
            assert_same(out["hsdp"][run], out["hsdp"]["torch"], f"rank {rank} {run}")


@pytest.mark.parametrize("case", list(REFUSED))
def test_plain_parameters_beside_tensor_parallel_ones_are_refused_before_any_step(two_ranks,
                                                                                 case):
    for out in two_ranks:
        refused = out["refused"][case]
        assert refused["message"] is not None, "trained with local gradients"
        assert "'0.norm.weight'" in refused["message"]
        assert "parallelize_module" in refused["message"]
        assert_same(refused["after"], refused["before"], "stepped before the refusal")
