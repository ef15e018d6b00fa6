"""Peak bytes of plain vs memory-lean losses (CPU): the table in docs/losses.md.

Each row measures one loss twice with ``layeropt.memory.PeakMemory`` (exact
byte counts from the profiler's allocation events): the plain form and the
``layeropt.losses`` form (``sum_product``, ``recompute``,
``linear_cross_entropy``): :func:`memory_table`.

Usage:
    python benchmarks/bench_losses.py          # the table in docs/losses.md
    python benchmarks/bench_losses.py --tiny   # smoke run, seconds
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from layeropt.losses import (
    default_chunk_size,
    has_native_linear_cross_entropy,
    linear_cross_entropy,
    recompute,
    sum_product,
)
from layeropt.memory import PeakMemory, format_bytes


def memory_table(tiny: bool = False) -> list[tuple[str, int, int]]:
    """Measure peak bytes (CPU) of each plain loss and of its lean form.

    Every row is forward + backward except the first (forward under no_grad).

    Args:
        tiny: small sizes for a smoke run (about a second).

    Returns:
        Rows ``(case, plain_bytes, lean_bytes)``.

    Example:
        >>> rows = memory_table(tiny=True)
    """
    g = torch.Generator().manual_seed(0)
    k = 4 if tiny else 16  # size multiplier

    def randn(*shape: int, grad: bool = False) -> Tensor:
        return torch.randn(*shape, generator=g).requires_grad_(grad)

    x, y = randn(k * 65536, grad=True), randn(k * 65536)
    a, b = randn(k * 16, 1, 64, grad=True), randn(1, 256, 64)
    p, q = randn(k * 32, 16, grad=True), randn(512, 16)
    n, d, v = k * 64, 64, (4096 if tiny else 32768)
    hid, w = randn(n, d, grad=True), (randn(v, d) / 8).requires_grad_()
    tgt = torch.randint(0, v, (n,), generator=g)

    def pair(u: Tensor, t: Tensor) -> Tensor:  # contrastive-style: saves (rows, 512)
        return torch.logsumexp(u @ t.T, dim=1).sum()

    lean_pair = recompute(pair)
    cases: list[tuple[str, Callable[[], Tensor], Callable[[], Tensor]]] = [
        ("sum(x*y) vs dot, no_grad forward",
         lambda: torch.sum(x.detach() * y), lambda: sum_product(x.detach(), y)),
        ("sum(x*y) vs dot", lambda: torch.sum(x * y), lambda: sum_product(x, y)),
        ("sum(x*y) broadcast vs sum_product", lambda: torch.sum(a * b), lambda: sum_product(a, b)),
        ("checkpoint(sum(x*y)) vs sum(x*y)",
         lambda: torch.sum(x * y), lambda: recompute(lambda u, t: torch.sum(u * t))(x, y)),
        ("1 pairwise loss term vs recompute", lambda: pair(p, q), lambda: lean_pair(p, q)),
        ("4 pairwise loss terms vs recompute",
         lambda: sum(pair(p * (i + 1), q) for i in range(4)),
         lambda: sum(lean_pair(p * (i + 1), q) for i in range(4))),
    ]  # fmt: skip

    def plain_lm() -> Tensor:
        return F.cross_entropy(hid @ w.T, tgt)

    impls = ["chunked"] + (["torch"] if has_native_linear_cross_entropy() else [])
    for impl in impls:
        for chunk in (default_chunk_size(n, d, v), n // 16, n // 64):

            def lean(c: int = chunk, i: str = impl) -> Tensor:
                return linear_cross_entropy(hid, w, tgt, chunk_size=c, impl=i)

            cases.append((f"LM loss V={v} vs {impl}, {chunk} rows/chunk", plain_lm, lean))
    rows = []
    for i, (case, plain, lean) in enumerate(cases):
        peaks = []
        for fn in (plain, lean):
            for t in (x, a, p, hid, w):
                t.grad = None
            with torch.set_grad_enabled(i > 0), PeakMemory() as mem:
                out = fn()
                if i > 0:
                    out.backward()
            peaks.append(mem.peak)
        rows.append((case, peaks[0], peaks[1]))
    return rows


def format_table(rows: list[tuple[str, int, int]]) -> str:
    """Markdown table of :func:`memory_table` rows (bytes and KiB/MiB)."""
    lines = ["| case | plain peak | lean peak | saved |", "|---|---:|---:|---:|"]
    for case, plain, lean in rows:
        cells = [f"{format_bytes(v)} ({v:,} B)" for v in (plain, lean, plain - lean)]
        lines.append(f"| {case} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="small sizes, a few seconds")
    args = parser.parse_args(argv)
    print(format_table(memory_table(tiny=args.tiny)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
