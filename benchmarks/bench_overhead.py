"""Where layeropt's extra step time goes: the fixed cost of stepping one bucket.

For buckets of ``k`` small parameters this times, per bucket (median of many
calls, interleaved):

* ``kernel``: what torch's fused Adam runs on the bucket's tensors, nothing
  else: the step counters ``+ 1`` (``torch._foreach_add_(steps, 1)``), then
  ``torch._fused_adam_``;
* ``torch step``: ``torch.optim.Adam(fused=True).step()`` of an optimizer
  owning exactly the bucket (torch's Python around the kernel);
* ``layeropt step``: ``layeropt.Adam._step_params(bucket)`` on an optimizer
  owning *all* buckets: the fast path (``layeropt/engine/fastpath.py``: the
  bucket's argument lists prepared once, checked, then the same kernel; its
  CPU step counters ``+ 1`` as torch's foreach Adam does them, which is
  cheaper than the ``kernel`` column's form, so ``layeropt - kernel`` is
  what is left of layeropt's Python net of that saving);
* ``hook path``: a whole attached backward through ``Engine.hook`` minus the
  same backward with gradients only dropped, divided by the bucket count; and
  the same with the optimizer's stepper (``_lo_stepper``) replaced by a no-op (the engine's own
  bookkeeping), next to a plain ``backward(); fused Adam step(); zero_grad()``.

Usage:
    python benchmarks/bench_overhead.py [--tiny] [--threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch
from torch import nn

import layeropt

CLOCK = time.perf_counter


def _median_us(fns: dict[str, Callable[[], None]], repeat: int) -> dict[str, float]:
    times: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(repeat):
        for k, fn in fns.items():
            t = CLOCK()
            fn()
            times[k].append(CLOCK() - t)
    return {k: statistics.median(v) * 1e6 for k, v in times.items()}


def per_bucket(k: int, n: int, buckets: int, repeat: int) -> dict[str, float]:
    """Microseconds per bucket of ``k`` params of ``n`` floats each."""
    torch.manual_seed(0)
    ps = [[nn.Parameter(torch.randn(n)) for _ in range(k)] for _ in range(buckets)]
    flat = [p for b in ps for p in b]
    for p in flat:
        p.grad = torch.randn(n)
    own = torch.optim.Adam(ps[0], lr=1e-3, fused=True)
    lo = layeropt.Adam(flat, lr=1e-3, fused=True)
    own.step()
    lo._step_params(flat)  # state created
    st = [own.state[p] for p in ps[0]]
    grads = [p.grad for p in ps[0]]
    kernel_args = ([p.detach() for p in ps[0]], grads, [s["exp_avg"] for s in st],
                   [s["exp_avg_sq"] for s in st], [], [s["step"] for s in st])  # fmt: skip

    def kernel() -> None:
        torch._foreach_add_(kernel_args[5], 1)
        torch._fused_adam_(*kernel_args, amsgrad=False, lr=1e-3, beta1=0.9, beta2=0.999,
                           weight_decay=0.0, eps=1e-8, maximize=False)  # fmt: skip

    return _median_us(
        {
            "kernel": kernel,
            "torch step": own.step,
            "layeropt step": lambda: lo._step_params(ps[1]),
        },
        repeat,
    )


class _Stack(nn.Module):
    def __init__(self, depth: int, d: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.LayerNorm(d) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def hook_path(depth: int, d: int, repeat: int) -> dict[str, float]:
    """Per-bucket cost of the whole hook path in a real backward, split in two."""
    torch.manual_seed(0)
    models = [_Stack(depth, d) for _ in range(6)]
    for m in models[1:]:
        m.load_state_dict(models[0].state_dict())
    full, book, dropped, plain, merged, counted = models
    opt = layeropt.Adam(full.parameters(), lr=1e-3, fused=True)
    handle = layeropt.attach(full, opt, bucket_cap_mb=0)  # one step per bucket
    opt_book = layeropt.Adam(book.parameters(), lr=1e-3, fused=True)
    handle_book = layeropt.attach(book, opt_book, bucket_cap_mb=0)
    opt_merged = layeropt.Adam(merged.parameters(), lr=1e-3, fused=True)
    handle_merged = layeropt.attach(merged, opt_merged)  # the default cap
    opt_book._lo_stepper = lambda o, params, key: None  # bookkeeping only: no update
    for p in dropped.parameters():
        p.register_post_accumulate_grad_hook(lambda p: setattr(p, "grad", None))
    for module in counted.layers:  # the least a per-bucket hook can do: count, drop
        params = list(module.parameters())
        arrived = [0]

        def count(p: torch.Tensor, params: list = params, arrived: list = arrived) -> None:
            arrived[0] += 1
            if arrived[0] == len(params):
                arrived[0] = 0
                for q in params:
                    q.grad = None

        for p in params:
            p.register_post_accumulate_grad_hook(count)
    fused = torch.optim.Adam(plain.parameters(), lr=1e-3, fused=True)
    x = torch.randn(4, d)

    def torch_step() -> None:
        plain(x).sum().backward()
        fused.step()
        fused.zero_grad()

    fns = {
        "attached, bucket_cap_mb=0": lambda: full(x).sum().backward(),
        "attached, bucket_cap_mb=0, no update": lambda: book(x).sum().backward(),
        "attached, default bucket_cap_mb": lambda: merged(x).sum().backward(),
        "minimal counting hook, no update": lambda: counted(x).sum().backward(),
        "grads dropped": lambda: dropped(x).sum().backward(),
        "fused Adam": torch_step,
    }
    for _ in range(3):
        for fn in fns.values():
            fn()
    t = _median_us(fns, repeat)
    n = len(handle.buckets)
    for h in (handle, handle_book, handle_merged):
        h.remove()
    return {"buckets": n, **t}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tiny", action="store_true")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="wall clock, or this process's CPU time (steadier when shared)")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    global CLOCK
    CLOCK = time.process_time if args.clock == "cpu" else time.perf_counter
    repeat = 20 if args.tiny else 300
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; microseconds per bucket\n")
    print("| params per bucket | floats each | kernel | torch step | layeropt step |"
          " layeropt - kernel |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|")
    for k, n in [(1, 64), (2, 64), (4, 64), (2, 4096), (8, 4096)]:
        r = per_bucket(k, n, buckets=4, repeat=repeat)
        print(f"| {k} | {n} | {r['kernel']:.0f} | {r['torch step']:.0f} | "
              f"{r['layeropt step']:.0f} | {r['layeropt step'] - r['kernel']:.0f} |")  # fmt: skip
    depth = 8 if args.tiny else 96
    h = hook_path(depth, 64, repeat=max(repeat // 10, 5))
    n = h["buckets"]
    print(f"\nhook path: {depth} LayerNorm(64) modules = {n} buckets of 2 params, one "
          "backward (forward included), microseconds:\n")  # fmt: skip
    print("| backward | total | minus grads-dropped | per bucket |\n|---|---:|---:|---:|")
    for k in list(h)[1:]:
        extra = h[k] - h["grads dropped"]
        print(f"| {k} | {h[k]:.0f} | {extra:.0f} | {extra / n:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
