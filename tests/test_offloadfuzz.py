"""Random offloaded loops (tests/offloadfuzz.py): loopfuzz's programs with the optimizer
state in host memory, every offload mode, copies on simulated CUDA streams - each equal to
torch.optim bit for bit with no unordered copy, or refused by a layeropt error, or in a
documented undetectable case.

A failure prints the program's seed; ``python tests/offloadfuzz.py --mix MIX --minimize
SEED`` shrinks it. ``LAYEROPT_SOAK=k`` runs k times as many programs.
"""

from __future__ import annotations


import pytest
import torch

from harness import SOAK
from loopfuzz import assert_block, assert_wrapped_block, installed_third_party
from offloadfuzz import run_block

# (mix, programs): loopfuzz's mixes, offloaded in a mode drawn per program
BLOCKS = [
    ("all", 28),  # every operation, settings between iterations, re-attach
    ("clip", 24),  # layeropt.backward(max_norm=) with accumulation: held sums brought back
    ("clipattach", 24),  # attach(clip_value=, bucket_max_norm=) of held sums brought back
    ("chaos", 28),  # the loops shuffled, cut and padded with random operations
    ("toggle", 14),  # offload stopped and started, checkpoints resumed into new optimizers
    ("thirdparty", 24),  # "all"'s loops with schedule-free and bitsandbytes optimizers
    ("write", 16),  # "all"'s loops with the weights written in place anywhere
]


@pytest.mark.parametrize("mix,n", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_random_offloaded_loops_equal_torch_or_are_refused(mix, n):
    if mix == "thirdparty" and not installed_third_party():
        pytest.skip("needs schedulefree or bitsandbytes (the optimizers extra)")
    torch.set_num_threads(1)
    outcomes = run_block(mix, 0, n * SOAK)
    # the programs train: many end exact, not refused (a mix that only refused would pass;
    # a step() after remove() is refused with offload, so fewer than loopfuzz's third)
    assert_block(outcomes, "offloadfuzz.py", mix, 1 / 4)


# The same on a DistributedDataParallel model (one process; FSDP2's DTensor shards are
# refused by offload_state)
WRAPPED = [("all", 20), ("clip", 14), ("toggle", 10)]


@pytest.mark.parametrize("mix,n", WRAPPED, ids=[b[0] for b in WRAPPED])
def test_random_offloaded_loops_on_ddp(mix, n):
    assert_wrapped_block(run_block, "offloadfuzz.py", mix, n * SOAK, "ddp", 1 / 4)
