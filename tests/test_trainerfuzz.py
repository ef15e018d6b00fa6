"""Random trainer set-ups (tests/trainerfuzz.py): Lightning, accelerate and the Hugging
Face ``Trainer`` with layeropt's integration each equal the same tool with torch.optim bit
for bit, or are refused by a layeropt error - in one process, and under torchrun on two
(each tool's DistributedDataParallel, each rank its own batches).

A failure prints the program's seed; ``python tests/trainerfuzz.py --mix MIX --minimize
SEED`` shrinks it to the few settings that still fail. ``LAYEROPT_SOAK=k`` runs k times as
many programs. A tool that is not installed skips its block.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import pytest
import torch
import torch.distributed as dist
from harness import SOAK
from loopfuzz import assert_block
from trainerfuzz import draw_program, run_block, run_on_ranks

# (mix, programs, packages): what each mix draws is in trainerfuzz.DRAWS; about 25 s on one
# core (a program: Lightning ~0.04 s, accelerate ~0.35 s, Hugging Face ~0.5 s)
BLOCKS = [
    ("lightning", 100, ["lightning"]),  # LayeroptCallback
    ("accelerate", 12, ["accelerate"]),  # LayeroptAccelerator
    ("hf", 8, ["transformers", "accelerate"]),  # LayeroptTrainer, LayeroptCallback
]


@pytest.mark.parametrize("mix,n,packages", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_random_trainer_setups_equal_torch_or_are_refused(mix, n, packages):
    for package in packages:
        pytest.importorskip(package)
    torch.set_num_threads(1)
    outcomes = run_block(mix, 0, n * SOAK)
    # the set-ups train: most end exact, not refused (a mix that only refused would pass)
    assert_block(outcomes, "trainerfuzz.py", mix, 1 / 2)


# The same on two processes under torchrun (trainerfuzz.run_on_ranks), every tool's
# programs in one launch (its start, about 10 s, once): a rank steps the DDP model each
# tool builds on the gradient averaged over both ranks' batches, never its own. (Hugging
# Face: a third of its programs use the callback, which refuses DDP - it cannot reach the
# model the Trainer wraps.)
RANKED = [("lightning", 10, ["lightning"]), ("accelerate", 5, ["accelerate"]),
          ("hf", 4, ["transformers", "accelerate"])]


@pytest.fixture(scope="module")
def on_two_processes() -> dict[str, list[dict[str, Any]]]:
    """Each installed tool's programs (``RANKED``) on two processes, by mix."""
    blocks = [(mix, n * SOAK) for mix, n, packages in RANKED
              if all(importlib.util.find_spec(p) is not None for p in packages)]
    outcomes = run_on_ranks([draw_program(seed, mix) for mix, n in blocks for seed in range(n)])
    by_mix, at = {}, 0
    for mix, n in blocks:
        by_mix[mix], at = outcomes[at:at + n], at + n
    return by_mix


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()),
                    reason="needs torch.distributed with gloo")
@pytest.mark.xdist_group("trainerfuzz-two-processes")  # (one launch: one worker)
@pytest.mark.parametrize("mix,n,packages", RANKED, ids=[b[0] for b in RANKED])
def test_random_trainer_setups_on_two_processes(mix, n, packages, on_two_processes):
    for package in packages:
        pytest.importorskip(package)
    outcomes = on_two_processes[mix]
    counts = assert_block(outcomes, "trainerfuzz.py --ranks 2", mix, 1 / 3)
    # what trained, trained on the DDP model the tool built (none where a resumed run had no
    # step left to take)
    wrappers = {o.get("wrapper") for o in outcomes if o["status"] == "exact"}
    assert wrappers <= {"DistributedDataParallel", None}, wrappers
    assert sum(o.get("wrapper") == "DistributedDataParallel" for o in outcomes) >= counts["exact"] / 2
