"""Looped forwards: peak memory and step time vs loop count, per mode.

The setting is ``examples/looped_forward.py``: a sinogram
``(batch, nb_elements, samples)``, a small CNN extractor run once per transmit
id, and three ways of using the loop's outputs (independent losses, a head on
the stack, a recurrent refinement). For every loop count ``n`` and every mode
it reports one training step's peak memory (``layeropt.memory.PeakMemory``:
exact bytes on CPU, allocator peak on CUDA; the optimizer state already
exists, the model and data are not counted) and the step time relative to
the naive loop at the same ``n`` (median over ``--repeats`` interleaved rounds).

Modes: ``naive`` (whole graph until backward, ``torch.optim.Adam``),
``ckpt/iter`` (the usual advice: ``torch.utils.checkpoint`` around each
iteration, ``torch.optim.Adam``), and layeropt's mode for the shape
(``layeropt.Adam`` attached): ``LoopAccumulator``, ``loop_stack``,
``loop_recurrent`` (``every=1`` and ``every=4``).

Usage:
    python benchmarks/loop_bench.py                  # n = 4 8 16 32 64
    python benchmarks/loop_bench.py --tiny           # smoke run, seconds
    python benchmarks/loop_bench.py --device cuda --batch 16 --samples 2048
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

import layeropt
from layeropt.loop import loop_recurrent
from layeropt.memory import PeakMemory, format_bytes

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
import looped_forward as ex  # the setting: model, data, step functions

Step = Callable[[ex.SinoNet, Tensor, Tensor, range], None]


def recurrent_ckpt(m: ex.SinoNet, sino: Tensor, target: Tensor, tx: range) -> None:
    """Hand-written checkpoint per iteration of the recurrent loop."""
    image = ex._image0(m, sino)
    for t in tx:
        image = checkpoint(m.refine_step, image, sino[:, t : t + 1], use_reentrant=False)
    F.mse_loss(image.mean(1), target).backward()


def recurrent_every4(m: ex.SinoNet, sino: Tensor, target: Tensor, tx: range) -> None:
    def step(image: Tensor, t: int) -> Tensor:
        return m.refine_step(image, sino[:, t : t + 1])

    image = loop_recurrent(step, ex._image0(m, sino), tx, every=4)
    F.mse_loss(image.mean(1), target).backward()


# shape -> [(column, step, in-backward optimizer?)]; the first column is the baseline
MODES: dict[str, list[tuple[str, Step, bool]]] = {
    "independent": [
        ("naive", ex.independent_naive, False),
        ("ckpt/iter", ex.independent_checkpoint, False),
        ("LoopAccumulator", ex.independent_accumulator, True),
    ],
    "stacked": [
        ("naive", ex.stacked_naive, False),
        ("ckpt/iter", ex.stacked_checkpoint, False),
        ("loop_stack", ex.stacked_loop_stack, True),
    ],
    "recurrent": [
        ("naive", ex.recurrent_naive, False),
        ("ckpt/iter", recurrent_ckpt, False),
        ("loop_recurrent", ex.recurrent_loop_recurrent, True),
        ("loop_recurrent every=4", recurrent_every4, True),
    ],
}


def setup(step: Step, in_backward: bool, args: argparse.Namespace, n: int,
          device: torch.device) -> tuple[Callable[[], None], Callable[[], None]]:
    """A fresh model and optimizer; returns (one training step, cleanup)."""
    torch.manual_seed(0)
    model = ex.SinoNet().to(device)
    if in_backward:
        opt: torch.optim.Optimizer = layeropt.Adam(model.parameters(), lr=1e-3)
        handle = layeropt.attach(model, opt)
    else:
        opt, handle = torch.optim.Adam(model.parameters(), lr=1e-3), None
    sino, target = (t.to(device) for t in ex.make_data(args.batch, n, args.samples, 0))
    tx = range(n)  # elements = n, decimation 1: the loop count is n

    def one_step() -> None:
        step(model, sino, target, tx)
        opt.step()
        opt.zero_grad()

    return one_step, (handle.remove if handle is not None else lambda: None)


def measure(modes: list[tuple[str, Step, bool]], args: argparse.Namespace, n: int,
            device: torch.device) -> list[tuple[int, float]]:
    """Per mode: (peak bytes of one steady-state step, median time / naive's).

    Steps are interleaved - one step of every mode per round - and each
    mode's time is divided by the naive step's time of the same round, which
    cancels most of a shared machine's drift.
    """
    runs = [setup(step, ib, args, n, device) for _, step, ib in modes]
    peaks = []
    for one_step, _ in runs:
        one_step()  # warm-up; creates the optimizer state
        with PeakMemory(device) as mem:
            one_step()
        peaks.append(mem.peak)
    ratios: list[list[float]] = [[] for _ in runs]
    for _ in range(args.repeats):
        times = []
        for one_step, _ in runs:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            one_step()
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            times.append(time.perf_counter() - t0)
        for r, t in zip(ratios, times):
            r.append(t / times[0])
    for _, cleanup in runs:
        cleanup()
    return [(peak, statistics.median(r)) for peak, r in zip(peaks, ratios)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ns", type=int, nargs="+", default=[4, 8, 16, 32, 64])
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--repeats", type=int, default=5, help="timed rounds")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--shapes", nargs="+", default=list(MODES), choices=list(MODES))
    p.add_argument("--tiny", action="store_true")
    args = p.parse_args()
    if args.tiny:
        args.ns, args.batch, args.samples, args.repeats = [2, 4], 2, 64, 1
        args.threads = args.threads or 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    print(f"torch {torch.__version__}, {platform.processor() or platform.machine()}, "
          f"{torch.get_num_threads()} threads, device {device}; batch {args.batch}, "
          f"samples {args.samples}; peak memory of one step / time relative to naive")
    for shape in args.shapes:
        modes = MODES[shape]
        header = f"| {shape} n | " + " | ".join(m for m, _, _ in modes) + " |"
        print("\n" + header)
        print("|" + "---:|" * (len(modes) + 1))
        for n in args.ns:
            results = measure(modes, args, n, device)
            cells = [f"{format_bytes(peak)}, {ratio:.2f}x" for peak, ratio in results]
            print(f"| {n} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
