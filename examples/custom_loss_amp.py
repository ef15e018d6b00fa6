"""A network with a custom loss, trained lean: in-backward Adam, AMP, exact clipping.

The problem: a ``Net`` of two large Linear layers trained with a custom loss
``torch.sum(x * y)`` runs out of memory in backward. The usual answers -
``torch.dot`` instead of the product, activation checkpointing, AMP with
``GradScaler``, ``clip_grad_norm_`` - are all kept here, plus the one they
miss: the gradients themselves. Three runs from the same seed and data:

1. the plain loop: ``torch.optim.Adam``, ``torch.sum(x * y)``, fp32;
2. torch with the usual answers: ``sum_product`` (a ``torch.dot``) loss,
   ``layer2`` checkpointed, autocast (bf16 on CPU; fp16 + ``GradScaler`` on a
   GPU), ``clip_grad_norm_(max_norm=1)``;
3. the same with ``layeropt.Adam`` attached: each layer updated in backward
   and its gradient freed, ``layeropt.checkpoint`` for ``layer2``, and
   ``layeropt.backward(loss, max_norm=1, scaler=...)`` for the clipping (and
   the scaler's skip-on-inf), exact because it measures the global norm in a
   first backward pass before any layer is updated.

Each run trains ``--steps`` steps; the last one is measured (its peak memory,
once Adam's state exists). It prints those peaks, and the largest parameter
difference between runs 2 and 3 after the steps (0: bit for bit).

Usage:
    python examples/custom_loss_amp.py             # < 1 min on a laptop CPU
    python examples/custom_loss_amp.py --tiny      # CI smoke run, seconds
    python examples/custom_loss_amp.py --device cuda
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as torch_checkpoint

import layeropt
from layeropt.losses import sum_product
from layeropt.memory import PeakMemory, format_bytes


class Net(nn.Module):
    """Two large Linear layers; the lean runs checkpoint ``layer2``."""

    def __init__(self, d_in: int = 1024, d_hidden: int = 2048) -> None:
        super().__init__()
        self.layer1 = nn.Linear(d_in, d_hidden)
        self.layer2 = nn.Linear(d_hidden, d_in)
        self.checkpoint: Callable[..., Tensor] | None = None  # e.g. torch_checkpoint

    def forward(self, x: Tensor) -> Tensor:
        x = self.layer1(x)
        if self.checkpoint is None:
            return self.layer2(x)
        return self.checkpoint(self.layer2, x, use_reentrant=False)


class CustomLoss(nn.Module):
    """The custom loss: builds the product ``x * y`` before summing it."""

    def forward(self, x: Tensor, y: Tensor) -> Tensor:
        return torch.sum(x * y)


def lean_loss(x: Tensor, y: Tensor) -> Tensor:
    """The same value without the product tensor (a ``torch.dot``, in fp32)."""
    return sum_product(x.float(), y.float())


class Run:
    """One training set-up: model, optimizer, and how a step is taken."""

    def __init__(self, name: str, model: Net, lean: bool, layerwise: bool,
                 device: torch.device, lr: float) -> None:
        self.name, self.model, self.lean, self.layerwise = name, model, lean, layerwise
        self.device = device
        amp = lean and device.type == "cuda"
        self.dtype = (torch.float16 if amp else torch.bfloat16) if lean else None
        self.scaler = torch.amp.GradScaler(device.type) if amp else None
        cls = layeropt.Adam if layerwise else torch.optim.Adam
        self.opt = cls(model.parameters(), lr=lr)
        self.handle = layeropt.attach(model, self.opt) if layerwise else None
        if lean:
            model.checkpoint = layeropt.checkpoint if layerwise else torch_checkpoint

    def step(self, x: Tensor, y: Tensor) -> float:
        with torch.autocast(self.device.type, dtype=self.dtype, enabled=self.dtype is not None):
            out = self.model(x)
            loss = lean_loss(out, y) if self.lean else CustomLoss()(out, y)
        if self.layerwise:  # every layer is updated inside this call
            scaled = self.scaler.scale(loss) if self.scaler else loss
            layeropt.backward(scaled, self.opt, max_norm=1.0, scaler=self.scaler)
        else:
            (self.scaler.scale(loss) if self.scaler else loss).backward()
            if self.lean:
                if self.scaler:
                    self.scaler.unscale_(self.opt)
                torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm=1.0)
        if self.scaler:
            self.scaler.step(self.opt)  # layeropt: nothing left to step
            self.scaler.update()
        else:
            self.opt.step()
        self.opt.zero_grad()
        return loss.item()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--d-in", type=int, default=1024, help="input and output width (1024)")
    p.add_argument("--d-hidden", type=int, default=2048, help="hidden width (2048)")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=None,
                   help="training steps per run, >= 2, the last measured for memory "
                        "(default 6; 2 with --tiny)")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--tiny", action="store_true", help="CI smoke run: a few seconds")
    args = p.parse_args(argv)
    if args.steps is None:
        args.steps = 2 if args.tiny else 6
    if args.steps < 2:
        p.error(f"--steps must be >= 2 (a first step creates Adam's state, the last is "
                f"measured), got {args.steps}")
    if args.tiny:
        args.d_in, args.d_hidden, args.batch = 128, 256, 8
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    torch.manual_seed(0)
    base = Net(args.d_in, args.d_hidden).to(device)
    runs = [
        Run("1. torch.optim.Adam, sum(x*y), fp32", copy.deepcopy(base), False, False,
            device, args.lr),
        Run("2. torch.optim.Adam + dot, checkpoint, AMP, clip", copy.deepcopy(base), True, False,
            device, args.lr),
        Run("3. layeropt.Adam attached + the same", copy.deepcopy(base), True, True,
            device, args.lr),
    ]
    amp = "fp16 + GradScaler" if device.type == "cuda" else "bf16 autocast"
    n = sum(p.numel() for p in base.parameters())
    print(f"Net({args.d_in}, {args.d_hidden}): {n:,} parameters, batch {args.batch}, "
          f"{device}, AMP = {amp}")

    gen = torch.Generator().manual_seed(1)
    data = [(torch.randn(args.batch, args.d_in, generator=gen).to(device),
             torch.randn(args.batch, args.d_in, generator=gen).to(device))
            for _ in range(args.steps)]
    peaks, losses = {}, {}
    for run in runs:
        losses[run.name] = [run.step(x, y) for x, y in data[:-1]]
        with PeakMemory(device) as mem:  # a steady-state step: Adam state exists
            losses[run.name].append(run.step(*data[-1]))
        peaks[run.name] = mem.peak

    print("\npeak memory of one training step (above parameters + Adam state), loss first -> last")
    for run in runs:
        first, last = losses[run.name][0], losses[run.name][-1]
        print(f"  {run.name:<50} {format_bytes(peaks[run.name]):>10} ({peaks[run.name]:>12,} B)"
              f"   {first:11.4f} -> {last:11.4f}")
    grads = sum(p.numel() * p.element_size() for p in base.parameters())
    print(f"  (all gradients together: {format_bytes(grads)}; run 3 holds one layer's at a time)")
    diff = max((a - b).abs().max().item()
               for a, b in zip(runs[1].model.parameters(), runs[2].model.parameters()))
    print(f"\nruns 2 and 3 after {args.steps} steps: max |difference| = {diff:.1e}"
          + (" (bit for bit)" if diff == 0 else ""))
    runs[2].handle.remove()


if __name__ == "__main__":
    main()
