"""Random loops under LAYEROPT_VERIFY (tests/verifyfuzz.py): verify never silent where
layeropt alone differs from torch (but for the cases docs/rules.md says it cannot find),
never alarmed where it is exact, and the verified run torch's bit for bit or refused.

A failure prints the program's seed; ``python tests/verifyfuzz.py --mix MIX --minimize
SEED`` shrinks it. ``LAYEROPT_SOAK=k`` runs k times as many programs.
"""

from __future__ import annotations

import collections
import warnings

import pytest
import torch

from harness import SOAK
from loopfuzz import assert_block
from verifyfuzz import run_block

# (mix, programs): loopfuzz's mixes, each program run alone, then verified
BLOCKS = [("all", 200), ("clip", 150), ("clipattach", 100), ("chaos", 200)]


@pytest.mark.parametrize("mix,n", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_verify_is_never_silent_and_never_a_false_alarm(mix, n):
    torch.set_num_threads(1)
    with warnings.catch_warnings():  # (verify's "ended after n steps" at a program's end)
        warnings.simplefilter("ignore")
        outcomes = run_block(mix, 0, n * SOAK)
    assert_block(outcomes, "verifyfuzz.py", mix, 1 / 4)
    # some differ without verify: what verify has to find
    plain = collections.Counter(o["plain"] for o in outcomes)
    assert plain["diff"] >= len(outcomes) // 20, plain
