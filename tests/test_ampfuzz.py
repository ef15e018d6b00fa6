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

from ampfuzz import draw_program, run_block, run_program
from loopfuzz import assert_block, assert_wrapped_block, programs_on_ranks
from harness import FSDP2_ON_CPU, SOAK

# (mix, programs): what each mix draws is in ampfuzz.BODIES; about 20 s on one core
BLOCKS = [
    ("all", 75),  # every body below, one after another in a program
    ("amp", 55),  # layeropt.backward(scaler=) against torch's recipe, after no_step() or not
    ("loop", 55),  # LoopAccumulator(max_norm=, scaler=) against docs/loops.md's torch loop
    ("hold", 35),  # torch's own recipe, scaler.scale(loss).backward(), held by layeropt
    ("clip", 45),  # layeropt.backward(max_norm=, norm_type=, error_if_nonfinite=), no scaler
    ("offload", 14),  # all's, the state offloaded in any mode on simulated streams
    ("verify", 30),  # all's, verified over every step: a VerifyError is a false alarm
    ("resume", 45),  # model, optimizer and GradScaler saved and resumed between the others
]


@pytest.mark.parametrize("mix,n", BLOCKS, ids=[b[0] for b in BLOCKS])
def test_random_amp_loops_equal_torch_or_are_refused(mix, n):
    torch.set_num_threads(1)
    outcomes = run_block(mix, 0, n * SOAK)
    # the programs train: most end exact, not refused (a mix that only refused would pass)
    assert_block(outcomes, "ampfuzz.py", mix, 1 / 2)


# The same on a DistributedDataParallel model and an FSDP2 one (one process; FSDP2: no
# fused kernels - torch's have no DTensor rule - and mixed dtypes are FSDP2's error on both
# sides; offloaded shards are refused)
WRAPPED = [("ddp", "all", 28), ("ddp", "verify", 20), ("ddp", "offload", 12),
           ("fsdp2", "all", 28), ("fsdp2", "verify", 20)]


@pytest.mark.parametrize("wrap,mix,n", WRAPPED, ids=[f"{w}-{m}" for w, m, _ in WRAPPED])
def test_random_amp_loops_on_ddp_and_fsdp2(wrap, mix, n):
    if wrap == "fsdp2" and not FSDP2_ON_CPU:
        pytest.skip("FSDP2 runs on CPU from torch 2.8")
    assert_wrapped_block(run_block, "ampfuzz.py", mix, n * SOAK, wrap, 1 / 2)


# ... and on two processes, each rank its own batches (loopfuzz.programs_on_ranks)
@pytest.mark.parametrize("wrap,mix,n", [("ddp", "all", 30)])
def test_random_amp_loops_on_two_processes(wrap, mix, n):
    outcomes = programs_on_ranks(run_program, draw_program, mix, 0, n * SOAK, wrap)
    assert_block(outcomes, f"ampfuzz.py --ranks 2 (LAYEROPT_FUZZ_WRAP={wrap})", mix, 1 / 2)


# found there (--ranks 2; a seed, not shrunk: --minimize runs one process): torch's recipe
# held by layeropt, zero_grad(set_to_none=False) after a skipped step, then a backward not
# reaching the branch - torch's clip_grad_norm_ summed its kept zeros, layeropt's found
# no .grad there (a DDP held backward did not give the kept zeros back at its end)
def test_found_on_two_processes():
    outcomes = programs_on_ranks(run_program, draw_program, "hold", 67, 1, "ddp")
    assert outcomes[0]["status"] == "exact", outcomes[0]


# programs the fuzzer found differing, shrunk (python tests/ampfuzz.py --minimize SEED):
# each must end exact now
FOUND = {
    # attach(bucket_max_norm=) with held gradients in host memory: a layer only the first
    # of a LoopAccumulator's iterations reaches came back bias first, and clip_grad_norm_
    # summed the two norms in that order (a last bit off): now in the module's order
    "per-module clip of a held sum from host memory": (379, "offload", {
        "opt": "SGD", "okw": {"lr": 0.1, "momentum": 0.9, "weight_decay": 0.01},
        "akw": {"bucket_max_norm": 0.1, "bucket_cap_mb": 0},
        "iters": [
            {"body": "loop", "seed": 162926, "branch": False, "max_norm": None,
             "norm_type": 2.0, "inject": None, "autocast": "bf16", "stn": True, "n": 5,
             "m": 1, "reduction": "sum", "scaler": False, "form": "with",
             "early_branch": False, "inj_at": 0},
            {"body": "loop", "seed": 387560, "branch": False, "max_norm": None,
             "norm_type": 2.0, "inject": None, "autocast": None, "stn": True, "n": 3,
             "m": 1, "reduction": "mean", "scaler": False, "form": "with",
             "early_branch": True, "inj_at": 0}]}),
    # a GradScaler step (its gradients in .grad), zero_grad(set_to_none=False), then a
    # LoopAccumulator clipping an inf's NaN norm: the kept zeros of the branch it does not
    # reach are NaN in torch's step. A first fix of multifuzz seed 571,312 (kept zeros
    # stepped twice) left these to step() unclipped (caught by this fuzzer, seed 581,528)
    "kept zeros in .grad clipped by a loop's non-finite norm": (581528, "all", {
        "opt": "AdamW", "okw": {"lr": 0.1, "amsgrad": False, "weight_decay": 0.1},
        "akw": {}, "dtype": "fp32", "init_scale": 65536.0, "growth_interval": 1,
        "iters": [
            {"body": "amp", "seed": 929392, "branch": True, "max_norm": None,
             "norm_type": 2.0, "inject": None, "autocast": None, "stn": False},
            {"body": "loop", "seed": 583833, "branch": False, "max_norm": 0.01,
             "norm_type": 2.0, "inject": "xinf", "autocast": None, "stn": True, "n": 1,
             "m": 2, "reduction": "mean", "scaler": False, "form": "step",
             "early_branch": False, "inj_at": 0}]}),
}


@pytest.mark.parametrize("case", list(FOUND))
def test_programs_found_differing_are_exact(case):
    seed, mix, changes = FOUND[case]
    prog = {**draw_program(seed, mix), **changes}
    assert run_program(prog)["status"] == "exact"
