"""Random programs with several optimizers or activation checkpointing
(tests/multifuzz.py): each equals torch.optim bit for bit, or is refused by a layeropt
error, or reaches a documented undetectable case (docs/rules.md, named in
``multifuzz.WHY``).

A failure prints the program's seed; ``python tests/multifuzz.py --mix MIX --minimize SEED``
shrinks it to the few operations that still fail. ``LAYEROPT_SOAK=k`` runs k times as
many programs.
"""

from __future__ import annotations


import warnings

import pytest
import torch

from harness import FSDP2_ON_CPU, SOAK
from loopfuzz import assert_block
from multifuzz import run_block, run_program

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


# The same on an FSDP2 model (one process; torch's fused kernels dropped: no DTensor rule)
FSDP2_BLOCKS = [("multi", 100), ("handover", 100), ("verify", 100), ("vgan", 100)]


@pytest.mark.skipif(not FSDP2_ON_CPU, reason="FSDP2 runs on CPU from torch 2.8")
@pytest.mark.parametrize("mix,n", FSDP2_BLOCKS, ids=[b[0] for b in FSDP2_BLOCKS])
def test_random_programs_on_fsdp2(mix, n):
    torch.set_num_threads(1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        outcomes = run_block(mix, 0, n * SOAK, "fsdp2")
    assert_block(outcomes, "multifuzz.py (LAYEROPT_FUZZ_WRAP=fsdp2)", mix, 1 / 4)


# Found with the programs on an FSDP2 model (LAYEROPT_FUZZ_WRAP=fsdp2), minimized: each
# differed from torch without an error before its fix.
_TWO = {"o1": ["RAdam", {"lr": 0.05}], "o2": ["Adamax", {"lr": 0.05}],
        "o3": ["RMSprop", {"lr": 0.05, "centered": True, "weight_decay": 0.01}]}
_FSDP2_FOUND = {
    # optimizers attached to submodules of a fully_shard module: FSDP2's state is on the
    # root, so the unsharded parameters of a module no optimizer of layeropt's trains
    # (its gradient added twice) were not mapped to their shards
    "attached to submodules, a plainly trained head": (
        {"opts": _TWO, "layer": {"o1": True, "o2": True, "o3": False},
         "owned": {"o1": ["trunk"], "o2": ["head"], "o3": ["aux"]}, "style": "sub"},
        [("clip", {"seed": 92067, "kind": "full", "aux": True, "max_norm": 0.01, "sub": None,
                   "opt": None})], "exact"),
    # layeropt.backward(parameters=) over a module no attachment holds: its unsharded
    # parameters (after the forward) were left unclipped
    "parameters= over a module no attachment holds": (
        {"opts": {"o1": ["Adam", {"lr": 0.01}], "o2": ["RMSprop", {"lr": 0.01}]},
         "layer": {"o1": True, "o2": False}, "owned": {"o1": ["trunk"], "o2": ["head", "aux"]},
         "style": "sub"},
        [("clip", {"seed": 304797, "kind": "full", "aux": False, "max_norm": 0.01,
                   "sub": ["trunk", "head"], "opt": None})], "exact"),
    # two attachments of one model, then layeropt.backward for one of them: the default
    # parameters left out the other's by the ids of its unsharded parameters, so that
    # optimizer's were clipped as well (layeropt alone, and a verified run's torch side)
    "two attachments of one model, layeropt.backward for one": (
        {"opts": {"o1": ["AdamW", {"lr": 0.1}], "o2": ["SGD", {"lr": 0.01, "momentum": 0.9}]},
         "layer": {"o1": True, "o2": True}, "owned": {"o1": ["trunk"], "o2": ["head", "aux"]},
         "style": "model"},
        [("fb", {"seed": 851006, "kind": "full", "aux": False, "ns": ["o1", "o2"],
                 "freeze": None}),
         ("clip", {"seed": 824255, "kind": "full", "aux": False, "max_norm": 0.01, "sub": None,
                   "opt": "o2"})], "exact"),
}


@pytest.mark.skipif(not FSDP2_ON_CPU, reason="FSDP2 runs on CPU from torch 2.8")
@pytest.mark.parametrize("case", list(_FSDP2_FOUND))
def test_programs_found_on_fsdp2(case):
    setup, ops, status = _FSDP2_FOUND[case]
    prog = {"seed": 0, "mix": "multi", "akw": {}, "mode": None, "verify": False,
            "wrap": "fsdp2", **setup, "ops": ops}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        out = run_program(prog)
    assert out["status"] == status, out
