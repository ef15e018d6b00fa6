"""Random AMP loops (tests/ampfuzz.py): GradScaler, clipping and LoopAccumulator, each
equal to torch.optim bit for bit, or refused by a layeropt error, or exact but for
docs/clipping-and-amp.md's skipped-step state entries.

A failure prints the program's seed; ``python tests/ampfuzz.py --mix MIX --minimize SEED``
shrinks it to the few iterations that still fail. ``LAYEROPT_SOAK=k`` runs k times as
many programs.
"""

from __future__ import annotations


import pytest
import torch

from ampfuzz import run_block
from loopfuzz import assert_block
from harness import SOAK

# (mix, programs): what each mix draws is in ampfuzz.BODIES; about 20 s on one core
BLOCKS = [
    ("all", 400),  # every body below, one after another in a program
    ("amp", 240),  # layeropt.backward(scaler=) against torch's recipe, after no_step() or not
    ("loop", 240),  # LoopAccumulator(max_norm=, scaler=) against docs/loops.md's torch loop
    ("hold", 120),  # torch's own recipe, scaler.scale(loss).backward(), held by layeropt
    ("clip", 150),  # layeropt.backward(max_norm=, norm_type=, error_if_nonfinite=), no scaler
    ("offload", 150),  # all's, the state offloaded in any mode on simulated streams
    ("verify", 150),  # all's, verified over every step: a VerifyError is a false alarm
]


@pytest.mark.parametrize("mix,n", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_random_amp_loops_equal_torch_or_are_refused(mix, n):
    torch.set_num_threads(1)
    outcomes = run_block(mix, 0, n * SOAK)
    # the programs train: most end exact, not refused (a mix that only refused would pass)
    assert_block(outcomes, "ampfuzz.py", mix, 1 / 2)
