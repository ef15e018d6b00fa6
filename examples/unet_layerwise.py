"""Layer-by-layer updates in backward for a U-Net, and the memory they save.

The question: can backward run layer by layer, updating each layer
and freeing its gradient as soon as it is ready - also in a U-Net, where an
encoder's output is reused by the decoder? Yes. Backward runs from the output
to the input; autograd fires a parameter's post-accumulate-grad hook only
once *every* path has delivered its contribution, so an encoder layer whose
output feeds a skip connection is updated after both the skip path and the
main path reached it. ``layeropt.attach`` steps each layer at that moment.

The script trains one U-Net twice from the same seed, with
``torch.optim.Adam`` (step after backward) and with ``layeropt.Adam``
attached, and prints:

1. the order in which layers are updated during the first backward, with
   which of their outputs the decoder reuses;
2. the largest parameter difference after the steps (0: bit for bit);
3. the peak memory of one training step, in bytes, for both.

Usage:
    python examples/unet_layerwise.py            # < 1 min on a laptop CPU
    python examples/unet_layerwise.py --tiny     # CI smoke run, seconds
    python examples/unet_layerwise.py --width 96 --batch 4 --steps 6
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F
from einops import rearrange
from torch import Tensor, nn

import layeropt
from layeropt.memory import PeakMemory, format_bytes


class Down(nn.Module):
    """Space-to-depth (einops) then two 3x3 convolutions: halves the resolution."""

    def __init__(self, c_in: int, c_out: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(4 * c_in, c_out, 3, padding=1)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)

    def forward(self, x: Tensor) -> Tensor:
        x = rearrange(x, "b c (h h2) (w w2) -> b (c h2 w2) h w", h2=2, w2=2)
        return F.silu(self.conv2(F.silu(self.conv1(x))))


class Up(nn.Module):
    """1x1 conv + depth-to-space (einops), concatenate the encoder's skip, two convs."""

    def __init__(self, c_in: int, c_skip: int, c_out: int) -> None:
        super().__init__()
        self.expand = nn.Conv2d(c_in, 4 * c_out, 1)
        self.conv1 = nn.Conv2d(c_out + c_skip, c_out, 3, padding=1)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)

    def forward(self, x: Tensor, skip: Tensor) -> Tensor:
        x = rearrange(self.expand(x), "b (c h2 w2) h w -> b c (h h2) (w w2)", h2=2, w2=2)
        x = torch.cat([x, skip], dim=1)  # the encoder's output, reused here
        return F.silu(self.conv2(F.silu(self.conv1(x))))


class UNet(nn.Module):
    """Three resolution levels; every encoder output is reused by the decoder."""

    def __init__(self, channels: int = 3, width: int = 32) -> None:
        super().__init__()
        w = width
        self.stem = nn.Conv2d(channels, w, 3, padding=1)
        self.down1 = Down(w, 2 * w)
        self.down2 = Down(2 * w, 4 * w)
        self.mid = nn.Conv2d(4 * w, 4 * w, 3, padding=1)
        self.up2 = Up(4 * w, 2 * w, 2 * w)
        self.up1 = Up(2 * w, w, w)
        self.head = nn.Conv2d(w, channels, 1)

    def forward(self, x: Tensor) -> Tensor:
        s0 = F.silu(self.stem(x))  # reused by up1
        s1 = self.down1(s0)  # reused by up2
        s2 = self.down2(s1)
        m = F.silu(self.mid(s2)) + s2
        return self.head(self.up1(self.up2(m, s1), s0))


SKIPS = {"stem": "up1", "down1.conv2": "up2"}  # whose output the decoder reuses


def make_batch(gen: torch.Generator, batch: int, size: int) -> tuple[Tensor, Tensor]:
    """A denoising task: recover a smooth image from a noisy copy."""
    clean = torch.randn(batch, 3, size // 8, size // 8, generator=gen)
    clean = F.interpolate(clean, size=(size, size), mode="bilinear", align_corners=False)
    return clean + 0.3 * torch.randn(clean.shape, generator=gen), clean


def update_order(model: nn.Module, opt: layeropt.Adam) -> list[str]:
    """The layers the latest attached backward updated, in the order it updated them."""
    owner = {p: name for name, mod in model.named_modules() for p in mod.parameters(recurse=False)}
    return list(dict.fromkeys(owner[p] for p in opt.stepped_params))


def train_step(model: nn.Module, opt: torch.optim.Optimizer, data: tuple[Tensor, Tensor]) -> float:
    noisy, clean = data
    loss = F.mse_loss(model(noisy), clean)
    loss.backward()  # attached: every layer is updated here, its .grad freed
    opt.step()  # torch: the update; attached layeropt: nothing left to do
    opt.zero_grad()
    return loss.item()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--width", type=int, default=64, help="channels of the first level")
    p.add_argument("--size", type=int, default=16, help="image height and width")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--tiny", action="store_true", help="CI smoke run: a few seconds")
    args = p.parse_args(argv)
    if args.tiny:
        args.width, args.size, args.steps = 8, 16, 2
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    model = UNet(width=args.width)
    ref = copy.deepcopy(model)
    n = sum(p.numel() for p in model.parameters())
    print(f"U-Net, width {args.width}, {n:,} parameters, "
          f"images {args.batch}x3x{args.size}x{args.size}")
    ref_opt = torch.optim.Adam(ref.parameters(), lr=args.lr)
    opt = layeropt.Adam(model.parameters(), lr=args.lr)
    handle = layeropt.attach(model, opt, bucket_cap_mb=0)  # 0: step every layer on its own

    gen_ref, gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    losses = []
    for step in range(args.steps):
        train_step(ref, ref_opt, make_batch(gen_ref, args.batch, args.size))
        losses.append(train_step(model, opt, make_batch(gen, args.batch, args.size)))
        if step == 0:
            order = update_order(model, opt)
            print("\n1. layers updated during the first backward, in this order:")
            for i, name in enumerate(order, 1):
                note = f"  <- its output is reused by {SKIPS[name]}: waited for both paths" \
                    if name in SKIPS else ""
                print(f"   {i:2d}. {name}{note}")
    assert len(order) == sum(1 for m in model.modules() if list(m.parameters(recurse=False)))
    diff = max((a - b).abs().max().item() for a, b in zip(model.parameters(), ref.parameters()))
    print(f"\n2. after {args.steps} steps (loss {losses[0]:.4f} -> {losses[-1]:.4f}): "
          f"max |layeropt - torch.optim| = {diff:.1e}"
          + (" (bit for bit)" if diff == 0 else ""))

    peaks = {}
    for name, m, o in (("torch.optim.Adam", ref, ref_opt), ("layeropt.Adam", model, opt)):
        data = make_batch(torch.Generator().manual_seed(2), args.batch, args.size)
        with PeakMemory() as mem:
            train_step(m, o, data)
        peaks[name] = mem.peak
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    print("\n3. peak memory of one training step (above parameters + Adam state):")
    for name, peak in peaks.items():
        print(f"   {name:<17} {format_bytes(peak):>10} ({peak:,} B)")
    saved = peaks["torch.optim.Adam"] - peaks["layeropt.Adam"]
    print(f"   saved {format_bytes(saved)} ({saved / peaks['torch.optim.Adam']:.0%}); all "
          f"gradients together are {format_bytes(grads)}, layeropt holds about one layer's")
    handle.remove()


if __name__ == "__main__":
    main()
