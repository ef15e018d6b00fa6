"""What ``attach(clip_value=...)`` costs a backward of many small layers.

A model of ``--layers`` ``Linear(8, 8)`` layers, each its own bucket; one
attached backward timed with and without ``clip_value=1.0`` (every bucket's
gradients clipped with torch's ``clip_grad_value_`` before its step), for SGD
and Adam, at ``bucket_cap_mb=0`` (a step call per layer) and the default
(1 MiB). The two contenders of a row alternate within each round; the ratio
is the median over rounds of (with / without) in the same round. Issue 37's
target: at most 1.3x.

Usage:
    python benchmarks/bench_clip.py [--layers 800] [--rounds 15] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import layeropt


def _setup(layers: int, opt_name: str, cap: float, clip: float | None):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(layers)])
    kw = dict(lr=1e-3) if opt_name == "Adam" else dict(lr=1e-3, momentum=0.9)
    opt = getattr(layeropt, opt_name)(model.parameters(), **kw)
    layeropt.attach(model, opt, bucket_cap_mb=cap, clip_value=clip)
    return model, opt, torch.randn(4, 8)


def _backward_seconds(model, opt, x) -> float:
    loss = model(x).sum()
    start = time.perf_counter()
    loss.backward()
    took = time.perf_counter() - start
    opt.zero_grad()
    return took


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=800)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--threads", type=int, default=1)
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    print(f"{args.layers} x Linear(8, 8), one backward, {args.rounds} rounds (3 warm-up), "
          f"torch {torch.__version__}, {args.threads} thread(s)")
    print("| optimizer | bucket_cap_mb | backward ms, no clip | with clip_value=1.0 | ratio |")
    print("| --- | --- | --- | --- | --- |")
    for opt_name in ("SGD", "Adam"):
        for cap in (0.0, 1.0):
            plain = _setup(args.layers, opt_name, cap, None)
            clipped = _setup(args.layers, opt_name, cap, 1.0)
            times: dict[str, list[float]] = {"plain": [], "clip": []}
            ratios = []
            for r in range(args.rounds + 3):
                order = [("plain", plain), ("clip", clipped)][:: 1 if r % 2 else -1]
                got = {name: _backward_seconds(*run) for name, run in order}
                if r >= 3:
                    for name, t in got.items():
                        times[name].append(t)
                    ratios.append(got["clip"] / got["plain"])
            print(f"| {opt_name} | {cap:g} | {statistics.median(times['plain']) * 1e3:.1f} | "
                  f"{statistics.median(times['clip']) * 1e3:.1f} | "
                  f"{statistics.median(ratios):.2f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
