"""torch's pipeline schedules (``torch.distributed.pipelining``) with attached optimizers:
each schedule's ``step()`` sums its micro-batches' gradients, and the loop's
``optimizer.step()`` steps once on the sum, bit for bit as with torch.optim (parameters and
optimizer state; two gloo ranks on CPU, one or two stages each).

Before 2026-12-07 every schedule failed: the first micro-batch's backward stepped the
parameters the next ones' graphs saved (torch's in-place error, the other rank then cut
off), or each micro-batch was stepped on its own and ``step()`` refused it afterwards.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

import layeropt
from harness import FSDP2_ON_CPU, RUNS, TORCH, assert_same
from loopfuzz import full, on_ranks
from layeropt.distributed.pipelining import PIPELINE_HOLD_WARNING

pytestmark = pytest.mark.skipif(
    not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")

# schedule: (optimizer, options, clip_grad_norm_ after the schedule's step, or None)
CASES: dict[str, tuple[str, dict[str, Any], float | None]] = {
    "ScheduleGPipe": ("Adam", dict(lr=0.01), None),
    "Schedule1F1B": ("SGD", dict(lr=0.1, momentum=0.9), 0.05),
    "ScheduleInterleaved1F1B": ("AdamW", dict(lr=0.01, weight_decay=0.1), None),
    "ScheduleLoopedBFS": ("Adam", dict(lr=0.01), 0.05),
    "ScheduleInterleavedZeroBubble": ("Adam", dict(lr=0.01), None),
    "ScheduleZBVZeroBubble": ("SGD", dict(lr=0.1, momentum=0.9), None),
    "ScheduleDualPipeV": ("Adam", dict(lr=0.01), None),
}
STEPS, MICRO = 3, 4
# Where torch's own schedules run on gloo on CPU (torch.optim's runs fail before: GPipe's
# first receive timed out on 2.6; 2.11 sends the V-shaped schedules' rank-local hops to
# the rank itself, which gloo refuses). Checked on 2.6, 2.11, 2.13 and 2.15, 2026-12-07.
SINCE = {"ScheduleZBVZeroBubble": (2, 13), "ScheduleDualPipeV": (2, 13)}
FIRST = (2, 11)


def _schedule_class(name: str) -> Any:
    """The schedule, where this torch has it and runs it on gloo (else None)."""
    import torch.distributed.pipelining.schedules as schedules

    return getattr(schedules, name, None) if TORCH >= SINCE.get(name, FIRST) else None


def _stages(name: str, rank: int) -> tuple[Any, list[nn.Module], bool, bool]:
    """This rank's stages: one of two, or two of four (``V``-shaped where the schedule
    wants it); the modules; whether it holds the first and the last stage."""
    from torch.distributed.pipelining import PipelineStage
    from torch.distributed.pipelining.schedules import PipelineScheduleMulti

    torch.manual_seed(0)
    chunks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]
    chunks.append(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)))
    if not issubclass(_schedule_class(name), PipelineScheduleMulti):
        module = nn.Sequential(*chunks[:2]) if rank == 0 else nn.Sequential(*chunks[2:])
        return PipelineStage(module, rank, 2, torch.device("cpu")), [module], rank == 0, rank == 1
    v = name in ("ScheduleZBVZeroBubble", "ScheduleDualPipeV")
    ids = ([0, 3] if rank == 0 else [1, 2]) if v else ([0, 2] if rank == 0 else [1, 3])
    stages = [PipelineStage(chunks[i], i, 4, torch.device("cpu")) for i in ids]
    return stages, [chunks[i] for i in ids], 0 in ids, 3 in ids


def _train(name: str, rank: int, attach: dict[str, Any] | None) -> dict[str, Any]:
    layer = attach is not None
    opt_name, kw, _ = CASES[name]
    stages, modules, first, last = _stages(name, rank)
    params = [p for m in modules for p in m.parameters()]
    opt = getattr(layeropt if layer else torch.optim, opt_name)(params, **kw)
    if layer:
        for module in modules:  # (each rank trains its own stages)
            layeropt.distributed.allow_local_updates(module)
            layeropt.attach(module, opt, **attach)
    warned = _loop(name, stages, params, opt, first, last, seed=0)
    return {"params": [p.detach().clone() for p in params], "state": opt.state_dict(),
            "warned": warned}


def _loop(name: str, stages: Any, params: list[torch.Tensor], opt: Any, first: bool,
          last: bool, seed: int) -> int:
    """``STEPS`` steps of the case's schedule (the batch where this rank holds the first
    stage, the target where the last; ``seed`` picks them), ``clip_grad_norm_`` where
    the case clips, then ``opt.step()``; how many times layeropt warned it held."""
    clip = CASES[name][2]
    schedule = _schedule_class(name)(stages, n_microbatches=MICRO,
                                     loss_fn=lambda y, t: (y - t).square().mean())
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for step in range(STEPS):
            g = torch.Generator().manual_seed(step + seed)
            x, target = torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)
            schedule.step(*[x] if first else [], **dict(target=target) if last else {})
            if clip is not None:
                torch.nn.utils.clip_grad_norm_(params, clip)
            opt.step()
            opt.zero_grad()
    return sum(str(w.message) == PIPELINE_HOLD_WARNING for w in seen)


def _job(rank: int) -> dict[str, Any]:
    return {name: {run: _train(name, rank, attach) for run, attach in RUNS.items()}
            for name in CASES if _schedule_class(name) is not None}


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    if TORCH < FIRST:
        pytest.skip(f"torch's pipeline schedules run on gloo on CPU from {FIRST}")
    return on_ranks(_job, world=2)


# Pipeline x FSDP2 on four ranks (a (pp 2, dp 2) mesh, each stage's blocks fully_shard-ed
# over dp, each dp rank its own batches): FSDP2 reduce-scatters the held sums after the
# schedule's last backward, outside any backward - held for step() as in no_step()
# (refused as "outside any autograd graph task" before 2026-12-07).
FSDP2_CASES = ("ScheduleGPipe", "Schedule1F1B")


def _train_fsdp2(name: str, rank: int, attach: dict[str, Any] | None) -> dict[str, Any]:
    layer = attach is not None
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.pipelining import PipelineStage

    opt_name, kw, _ = CASES[name]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp, dp = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3)]
    blocks.append(nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 4)))
    module = nn.Sequential(*blocks[2 * pp:2 * pp + 2])
    for block in module:
        fully_shard(block, mesh=mesh["dp"])
    fully_shard(module, mesh=mesh["dp"])
    stage = PipelineStage(module, pp, 2, torch.device("cpu"), group=mesh["pp"].get_group())
    opt = getattr(layeropt if layer else torch.optim, opt_name)(module.parameters(), **kw)
    if layer:
        layeropt.attach(module, opt, **attach)
    _loop(name, stage, list(module.parameters()), opt, pp == 0, pp == 1, seed=100 * dp)
    return {"params": [p.full_tensor().detach().clone() for p in module.parameters()],
            "state": full(opt.state_dict())}


def _job_fsdp2(rank: int) -> dict[str, Any]:
    return {name: {run: _train_fsdp2(name, rank, attach) for run, attach in RUNS.items()}
            for name in FSDP2_CASES}


@pytest.fixture(scope="module")
def four_ranks() -> list[dict[str, Any]]:
    if TORCH < FIRST or not FSDP2_ON_CPU:
        pytest.skip(f"pipeline schedules and FSDP2 on gloo: torch >= {FIRST}")
    return on_ranks(_job_fsdp2, world=4)


@pytest.mark.parametrize("name", FSDP2_CASES)
def test_pipeline_stages_under_fsdp2_equal_torch_optim(four_ranks, name):
    for rank, out in enumerate(four_ranks):
        for run in RUNS:
            assert_same(out[name][run], out[name]["torch"], f"rank {rank} {run}")


@pytest.mark.parametrize("name", list(CASES))
def test_a_pipeline_schedule_with_attached_optimizers_equals_torch_optim(ranks, name):
    if name not in ranks[0]:
        pytest.skip(f"torch {torch.__version__} has no {name}, or cannot run it on gloo")
    for rank, out in enumerate(ranks):
        for run in RUNS:
            assert_same(out[name][run]["params"], out[name]["torch"]["params"], f"{rank} {run}")
            assert_same(out[name][run]["state"], out[name]["torch"]["state"], f"{rank} {run}")
            assert out[name][run]["warned"] >= STEPS if run != "torch" else (
                out[name][run]["warned"] == 0)
