"""Random training loops (tests/loopfuzz.py): each equals torch.optim bit for bit, or is
refused by a layeropt error, or reaches the one documented undetectable case.

A failure prints the program's seed; ``python tests/loopfuzz.py --mix MIX --minimize SEED``
shrinks it to the few operations that still fail. ``LAYEROPT_SOAK=k`` runs k times as
many programs.
"""

from __future__ import annotations


import pytest
import torch

from harness import SOAK
from loopfuzz import assert_block, run_block

# (mix, programs): what each mix draws is in loopfuzz.draw_program
BLOCKS = [
    ("all", 1000),  # every operation, settings between iterations, re-attach
    ("clip", 600),  # layeropt.backward(max_norm=) against clip_grad_norm_, with accumulation
    ("clipattach", 400),  # attach(clip_value=, bucket_max_norm=), the strict schedule
    ("chaos", 1000),  # the loops shuffled, cut and padded with random operations
    ("resume", 300),  # checkpoints saved and resumed into a new model and optimizer
]


@pytest.mark.parametrize("mix,n", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_random_loops_equal_torch_or_are_refused(mix, n):
    torch.set_num_threads(1)
    outcomes = run_block(mix, 0, n * SOAK)
    # the programs train: most end exact, not refused (a mix that only refused would pass)
    assert_block(outcomes, "loopfuzz.py", mix, 1 / 3)
