"""Random trainer set-ups (tests/trainerfuzz.py): Lightning, accelerate and the Hugging
Face ``Trainer`` with layeropt's integration each equal the same tool with torch.optim bit
for bit, or are refused by a layeropt error.

A failure prints the program's seed; ``python tests/trainerfuzz.py --mix MIX --minimize
SEED`` shrinks it to the few settings that still fail. ``LAYEROPT_SOAK=k`` runs k times as
many programs. A tool that is not installed skips its block.
"""

from __future__ import annotations


import pytest
import torch
from harness import SOAK
from loopfuzz import assert_block
from trainerfuzz import run_block

# (mix, programs, packages): what each mix draws is in trainerfuzz.DRAWS; about 25 s on one
# core (a program: Lightning ~0.04 s, accelerate ~0.35 s, Hugging Face ~0.5 s)
BLOCKS = [
    ("lightning", 150, ["lightning"]),  # LayeroptCallback
    ("accelerate", 18, ["accelerate"]),  # LayeroptAccelerator
    ("hf", 11, ["transformers", "accelerate"]),  # LayeroptTrainer, LayeroptCallback
]


@pytest.mark.parametrize("mix,n,packages", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_random_trainer_setups_equal_torch_or_are_refused(mix, n, packages):
    for package in packages:
        pytest.importorskip(package)
    torch.set_num_threads(1)
    outcomes = run_block(mix, 0, n * SOAK)
    # the set-ups train: most end exact, not refused (a mix that only refused would pass)
    assert_block(outcomes, "trainerfuzz.py", mix, 1 / 2)
