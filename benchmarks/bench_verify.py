"""What a verified step costs (LAYEROPT_VERIFY): step time and peak memory, side by side.

Three copies of one model train on the same batches, one step of each per
round, interleaved (the first contender alternating):

* ``torch.optim.AdamW``: ``backward(); step(); zero_grad()``;
* ``layeropt.AdamW`` attached: each layer updated in backward;
* ``layeropt.AdamW`` attached with ``verify`` on for every timed step: torch's
  step for real, and each in-backward update on a shadow beside it.

Reported: the median over rounds of each contender's time / torch's in the
same round (CPU time of this process with ``--clock cpu``), and the peak
memory of one steady-state step (``layeropt.memory.PeakMemory``: the bytes
allocated inside the step on top of what was alive before it, exact on CPU).
After the run the three copies' parameters are compared bit for bit.

Usage:
    python benchmarks/bench_verify.py                  # TinyGPT 12M, 10 rounds
    python benchmarks/bench_verify.py --tiny           # smoke run
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

import layeropt
from layeropt.memory import PeakMemory
from layeropt.models import TinyGPT


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--tiny", action="store_true", help="a tiny model, 2 rounds")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--clock", choices=["wall", "cpu"], default="cpu")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    rounds = 2 if args.tiny else args.rounds
    kw = dict(vocab=256, d=32, layers=2, heads=2, seq=16) if args.tiny else dict(
        vocab=4096, d=384, layers=6, heads=6, seq=64)
    torch.manual_seed(0)
    base = TinyGPT(**kw)
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, kw["vocab"], (2, kw["seq"] + 1), generator=gen)
               for _ in range(rounds + 2)]

    def loss_fn(m: torch.nn.Module, tokens: torch.Tensor) -> torch.Tensor:
        logits = m(tokens[:, :-1])
        return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())

    runs: dict[str, Any] = {}
    for name in ("torch.optim.AdamW", "layeropt.AdamW, in backward",
                 "layeropt.AdamW, verified (LAYEROPT_VERIFY)"):
        model = copy.deepcopy(base)
        lib = torch.optim if name.startswith("torch") else layeropt
        opt = lib.AdamW(model.parameters(), lr=1e-3)
        if lib is layeropt:
            layeropt.attach(model, opt, verify=(rounds + 2) if "verified" in name else 0)
        runs[name] = dict(model=model, opt=opt, times=[], peak=0)
    clock: Callable[[], float] = time.process_time if args.clock == "cpu" else time.perf_counter

    def step(run: dict[str, Any], tokens: torch.Tensor) -> float:
        start = clock()
        loss_fn(run["model"], tokens).backward()
        run["opt"].step()
        run["opt"].zero_grad()
        return clock() - start

    names = list(runs)
    for i, tokens in enumerate(batches):
        order = names if i % 2 == 0 else names[::-1]
        for name in order:
            if i == 1:  # steady state: the optimizer state exists
                with PeakMemory() as mem:
                    step(runs[name], tokens)
                runs[name]["peak"] = mem.peak
            elif i >= 2:
                runs[name]["times"].append(step(runs[name], tokens))
            else:
                step(runs[name], tokens)
    ref = runs[names[0]]
    n = sum(p.numel() for p in base.parameters())
    print(f"TinyGPT({', '.join(f'{k}={v}' for k, v in kw.items())}): {n / 1e6:.1f}M parameters, "
          f"AdamW, batch 2x{kw['seq']}; torch {torch.__version__}, {args.threads} thread(s), "
          f"{args.clock} clock, {rounds} interleaved rounds\n")
    print("| contender | peak MiB of a step | step time / torch (median of rounds) |")
    print("|---|---:|---:|")
    for name, run in runs.items():
        ratio = statistics.median(a / b for a, b in zip(run["times"], ref["times"]))
        print(f"| {name} | {run['peak'] / 2**20:.1f} | {ratio:.2f}x |")
    same = all(all(torch.equal(p, q) for p, q in zip(run["model"].parameters(),
                                                      ref["model"].parameters()))
               for run in runs.values())
    print(f"\nparameters after {len(batches)} steps: "
          + ("bit-identical in all three" if same else "DIFFERENT"))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
