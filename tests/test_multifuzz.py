"""Random programs with several optimizers or activation checkpointing
(tests/multifuzz.py): each equals torch.optim bit for bit, or is refused by a layeropt
error, or reaches a documented undetectable case (docs/rules.md, named in
``multifuzz.WHY``).

A failure prints the program's seed; ``python tests/multifuzz.py --mix MIX --minimize SEED``
shrinks it to the few operations that still fail. ``LAYEROPT_SOAK=k`` runs k times as
many programs.
"""

from __future__ import annotations


import pytest
import torch

from harness import SOAK
from loopfuzz import assert_block
from multifuzz import run_block

# (mix, programs): what each mix draws is in multifuzz.draw_program
BLOCKS = [
    ("multi", 500),  # two layeropt optimizers, one beside a plain one, four attach styles
    ("gan", 350),  # a discriminator's step, then the generator's loss through it
    ("handover", 350),  # an optimizer replaced by a new one (removed, or deleted)
    ("checkpoint", 150),  # torch's and layeropt's checkpoints, a block reused, a weight read twice
    ("offload", 150),  # multi's, every layeropt optimizer's state offloaded (simulated streams)
    ("ckoffload", 100),  # checkpoint's, offloaded: gradients in pieces moved as they land
    ("verify", 150),  # multi's alone, then verified: verifyfuzz's outcomes
    ("vgan", 100),  # gan's alone, then verified
    ("vck", 100),  # checkpoint's alone, then verified
]


@pytest.mark.parametrize("mix,n", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_random_programs_equal_torch_or_are_refused(mix, n):
    torch.set_num_threads(1)
    outcomes = run_block(mix, 0, n * SOAK)
    # the programs train: many end exact, not refused (a mix that only refused would pass)
    assert_block(outcomes, "multifuzz.py", mix, 1 / 4)
