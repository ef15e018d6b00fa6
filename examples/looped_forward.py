"""A forward that loops over transmit ids, trained with one iteration's memory.

The setting: a synthetic sinogram ``(batch, nb_elements, samples)``; the
forward loops ``for tx_id in range(0, nb_elements,
decimation_factor)`` and runs the same small CNN feature extractor on every
transmit. Three ways the loop's outputs are used, each trained naively (the
whole graph kept until backward) and with the layeropt mode that fits it:

* independent: each transmit has its own loss       -> ``LoopAccumulator``
* stacked:     a head reads the stack of all outputs -> ``loop_stack``
* recurrent:   transmit i refines transmit i-1's map -> ``loop_recurrent``

For each loop count (``nb_elements / decimation_factor``) it prints the peak
memory of one training step (exact bytes on CPU from the profiler's
allocation events), the median step time, and how far the parameters end up
from the naive run's after the same steps (0 = bit for bit). With
``--plot FILE`` it also saves a plot of peak memory vs loop count (needs
matplotlib); without it, it writes no file.

Usage:
    python examples/looped_forward.py                 # < 1 min on 2 CPU cores
    python examples/looped_forward.py --tiny          # CI smoke run, seconds
    python examples/looped_forward.py --plot mem.png  # and save the plot
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import layeropt
from layeropt.loop import LoopAccumulator, loop_recurrent, loop_stack
from layeropt.memory import PeakMemory, format_bytes


class SinoNet(nn.Module):
    """A per-transmit CNN feature extractor and one head per loop shape."""

    def __init__(self, width: int = 32, feat: int = 8) -> None:
        super().__init__()
        self.extractor = nn.Sequential(  # (B, 1, S) -> (B, feat, S)
            nn.Conv1d(1, width, 7, padding=3), nn.GELU(),
            nn.Conv1d(width, width, 7, padding=3), nn.GELU(), nn.Dropout(0.1),
            nn.Conv1d(width, feat, 7, padding=3),
        )
        self.step_head = nn.Conv1d(feat, 1, 5, padding=2)  # one transmit -> image
        self.score = nn.Conv1d(feat, 1, 1)  # stack head: attention over transmits
        self.stack_head = nn.Conv1d(feat, 1, 5, padding=2)
        self.refine = nn.Sequential(  # recurrent: (map, transmit) -> map update
            nn.Conv1d(feat + 1, width, 7, padding=3), nn.GELU(),
            nn.Conv1d(width, width, 7, padding=3), nn.GELU(),
            nn.Conv1d(width, feat, 7, padding=3),
        )
        self.feat = feat

    def features(self, sino: Tensor, tx_id: int) -> Tensor:
        return self.extractor(sino[:, tx_id : tx_id + 1])

    def step_loss(self, sino: Tensor, target: Tensor, tx_id: int) -> Tensor:
        return F.mse_loss(self.step_head(self.features(sino, tx_id)).squeeze(1), target)

    def head(self, stack: Tensor) -> Tensor:  # stack: (B, n, feat, S)
        weights = torch.softmax(self.score(stack.flatten(0, 1)).view(*stack.shape[:2], 1, -1), 1)
        return self.stack_head((weights * stack).sum(1)).squeeze(1)

    def refine_step(self, image: Tensor, sino_tx: Tensor) -> Tensor:
        return image + torch.tanh(self.refine(torch.cat([image, sino_tx], 1)))


# --- one training step of each (shape, mode): the loss's backward; the caller steps --
Step = Callable[[SinoNet, Tensor, Tensor, range], None]


def independent_naive(m: SinoNet, sino: Tensor, target: Tensor, tx: range) -> None:
    (sum(m.step_loss(sino, target, t) for t in tx) / len(tx)).backward()


def independent_checkpoint(m: SinoNet, sino: Tensor, target: Tensor, tx: range) -> None:
    losses = [checkpoint(m.step_loss, sino, target, t, use_reentrant=False) for t in tx]
    (sum(losses) / len(tx)).backward()


def independent_accumulator(m: SinoNet, sino: Tensor, target: Tensor, tx: range) -> None:
    with LoopAccumulator(len(tx)) as acc:  # the attached optimizer steps in the last backward
        for t in tx:
            acc.backward(m.step_loss(sino, target, t))


def stacked_naive(m: SinoNet, sino: Tensor, target: Tensor, tx: range) -> None:
    stack = torch.stack([m.features(sino, t) for t in tx], 1)
    F.mse_loss(m.head(stack), target).backward()


def stacked_checkpoint(m: SinoNet, sino: Tensor, target: Tensor, tx: range) -> None:
    """The usual hand-written alternative: checkpoint the extractor, then torch.stack."""
    stack = torch.stack([checkpoint(m.features, sino, t, use_reentrant=False) for t in tx], 1)
    F.mse_loss(m.head(stack), target).backward()


def stacked_loop_stack(m: SinoNet, sino: Tensor, target: Tensor, tx: range) -> None:
    stack = loop_stack(lambda t: m.features(sino, t), tx, dim=1)
    F.mse_loss(m.head(stack), target).backward()


def _image0(m: SinoNet, sino: Tensor) -> Tensor:
    return sino.new_zeros(sino.shape[0], m.feat, sino.shape[2])


def recurrent_naive(m: SinoNet, sino: Tensor, target: Tensor, tx: range) -> None:
    image = _image0(m, sino)
    for t in tx:
        image = m.refine_step(image, sino[:, t : t + 1])
    F.mse_loss(image.mean(1), target).backward()


def recurrent_loop_recurrent(m: SinoNet, sino: Tensor, target: Tensor, tx: range) -> None:
    def step(image: Tensor, t: int) -> Tensor:
        return m.refine_step(image, sino[:, t : t + 1])

    image = loop_recurrent(step, _image0(m, sino), tx)
    F.mse_loss(image.mean(1), target).backward()


# shape -> [(mode, step, in-backward optimizer?)]; the first mode is the reference
MODES: dict[str, list[tuple[str, Step, bool]]] = {
    "independent": [
        ("naive", independent_naive, False),
        ("checkpoint", independent_checkpoint, False),
        ("LoopAccumulator", independent_accumulator, True),
    ],
    "stacked": [
        ("naive", stacked_naive, False),
        ("checkpoint", stacked_checkpoint, False),
        ("loop_stack", stacked_loop_stack, True),
    ],
    "recurrent": [
        ("naive", recurrent_naive, False),
        ("loop_recurrent", recurrent_loop_recurrent, True),
    ],
}


def make_data(batch: int, elements: int, samples: int, seed: int) -> tuple[Tensor, Tensor]:
    """A synthetic sinogram and the image it should reconstruct."""
    g = torch.Generator().manual_seed(seed)
    sino = torch.randn(batch, elements, samples, generator=g)
    kernel = torch.ones(1, 1, 9) / 9
    target = F.conv1d(sino.mean(1, keepdim=True), kernel, padding=4).squeeze(1)
    return sino, target


def train(step: Step, in_backward: bool, args: argparse.Namespace, tx: range,
          device: torch.device) -> tuple[int, float, SinoNet]:
    """``args.steps`` training steps; returns (peak bytes, median seconds, model)."""
    torch.manual_seed(0)
    model = SinoNet().to(device)
    if in_backward:
        opt: torch.optim.Optimizer = layeropt.Adam(model.parameters(), lr=1e-3)
        handle = layeropt.attach(model, opt)
    else:
        opt, handle = torch.optim.Adam(model.parameters(), lr=1e-3), None
    peak, times = 0, []
    for s in range(args.steps + 1):
        sino, target = (t.to(device) for t in make_data(args.batch, args.elements, args.samples, s))
        torch.manual_seed(100 + s)  # the same dropout masks in every mode
        if s == 1:  # a steady-state step (optimizer state exists): measure memory
            with PeakMemory(device) as mem:
                step(model, sino, target, tx)
                opt.step()
                opt.zero_grad()
            peak = mem.peak
            continue
        t0 = time.perf_counter()
        step(model, sino, target, tx)
        opt.step()
        opt.zero_grad()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        if s > 1:  # step 0 is a warm-up
            times.append(time.perf_counter() - t0)
    if handle is not None:
        handle.remove()
    return peak, statistics.median(times), model


def max_diff(a: nn.Module, b: nn.Module) -> float:
    return max((p - q).abs().max().item() for p, q in zip(a.parameters(), b.parameters()))


def plot(results: dict[str, dict[str, list[tuple[int, int]]]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(results), figsize=(4.5 * len(results), 3.6))
    for ax, (shape, modes) in zip(axes, results.items()):
        for mode, points in modes.items():
            ax.plot([n for n, _ in points], [b / 2**20 for _, b in points], marker="o", label=mode)
        counts = [n for n, _ in next(iter(modes.values()))]
        ax.set_xscale("log", base=2)
        ax.set_xticks(counts, [str(n) for n in counts])
        ax.set_ylim(bottom=0)
        ax.set(title=shape, xlabel="loop count", ylabel="peak memory of a step (MiB)")
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    print(f"saved {path}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="CI smoke run: small sizes, 2 loop counts")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--elements", type=int, default=64, help="nb_elements (transmits)")
    p.add_argument("--samples", type=int, default=256)
    p.add_argument("--decimation", type=int, nargs="+", default=[16, 8, 4, 2],
                   help="decimation factors; loop count = elements / decimation")
    p.add_argument("--steps", type=int, default=3, help="timed training steps per run")
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads (tiny tensors: 1 is fastest; 0 = torch's default)")
    p.add_argument("--plot", metavar="FILE", default=None,
                   help="also save a plot of peak memory vs loop count there (needs matplotlib)")
    args = p.parse_args()
    if args.plot is not None and importlib.util.find_spec("matplotlib") is None:
        p.error("--plot needs matplotlib: pip install matplotlib (or leave out --plot)")
    if args.tiny:
        args.batch, args.elements, args.samples, args.decimation, args.steps = 2, 8, 64, [4, 2], 2
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    results: dict[str, dict[str, list[tuple[int, int]]]] = {}
    for shape, modes in MODES.items():
        print(f"\n{shape}: peak memory of one training step / median step time / "
              "max |param - naive's| after the steps (LoopAccumulator: ~1e-8, the\n"
              "full graph adds the n iterations' gradients in the opposite order)"
              if shape == "independent" else
              f"\n{shape}: peak memory of one training step / median step time / "
              "max |param - naive's| after the steps (0: bit for bit)")
        print(f"{'loop count':>10} " + " ".join(f"{m:>30}" for m, _, _ in modes))
        results[shape] = {m: [] for m, _, _ in modes}
        for dec in args.decimation:
            tx = range(0, args.elements, dec)
            cells, reference = [], None
            for mode, step, in_backward in modes:
                peak, seconds, model = train(step, in_backward, args, tx, device)
                diff = 0.0 if reference is None else max_diff(reference, model)
                reference = reference or model
                results[shape][mode].append((len(tx), peak))
                cells.append(f"{format_bytes(peak)} {seconds * 1e3:6.1f} ms {diff:7.1e}")
            print(f"{len(tx):>10} " + " ".join(f"{c:>30}" for c in cells))
    if args.plot is not None:
        plot(results, args.plot)


if __name__ == "__main__":
    main()
