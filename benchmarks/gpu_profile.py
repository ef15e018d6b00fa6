"""Where a bf16 step's time goes: fused Adam vs layeropt, host vs kernels.

The model of ``gpu_quick.py`` (TinyGPT, 135M parameters, batch 8x512), bf16
autocast. Contenders: ``torch.optim.Adam(fused=True)`` and
``layeropt.Adam(fused=True)`` attached with the default ``bucket_cap_mb`` and
with ``bucket_cap_mb=0``. Each runs warm-up steps, then ``--steps`` steps under
``torch.profiler``; printed per contender, per step:

* ``wall``: the step's wall time (synchronised before and after);
* ``kernels``: the summed time of its device kernels, and ``idle`` = wall -
  kernels: time the device waited for the host (launch overhead, Python);
* ``update launches``: kernels of the update itself (``fused_adam``,
  ``multi_tensor_apply``), and all kernel launches;
* ``host``: CPU time of the step on the calling thread.

Then the ten ops with the most self CPU time and the ten kernels with the most
device time, per contender: the profile that says whether a slower step is
host overhead (more idle, more launches) or kernels.

Usage:
    python benchmarks/gpu_profile.py                       # one CUDA GPU, ~1 min
    python benchmarks/gpu_profile.py --device cpu --tiny   # smoke run on CPU, seconds
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import layeropt
from layeropt.models import TinyGPT

_UPDATE_KERNELS = ("fused_adam", "multi_tensor_apply")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--steps", type=int, default=5, help="profiled steps per contender")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--tiny", action="store_true", help="a tiny model (smoke run)")
    return p.parse_args(argv)


def _device_time(event: Any) -> float:
    """An op's self time on the device, in microseconds (the name moved in torch 2.x)."""
    for name in ("self_device_time_total", "self_cuda_time_total"):
        if hasattr(event, name):
            return float(getattr(event, name))
    return 0.0


def _contenders(base: torch.nn.Module) -> dict[str, tuple[torch.nn.Module, Any]]:
    out: dict[str, tuple[torch.nn.Module, Any]] = {}
    ref = copy.deepcopy(base)
    out["torch.optim.Adam(fused=True)"] = (ref, torch.optim.Adam(ref.parameters(), lr=1e-4,
                                                                 fused=True))  # fmt: skip
    for cap in (1.0, 0.0):
        model = copy.deepcopy(base)
        opt = layeropt.Adam(model.parameters(), lr=1e-4, fused=True)
        layeropt.attach(model, opt, bucket_cap_mb=cap)
        out[f"layeropt.Adam(fused=True), bucket_cap_mb={cap:g}"] = (model, opt)
    return out


def _stepper(device: str, tokens: torch.Tensor) -> Callable[[torch.nn.Module, Any], None]:
    def step(model: torch.nn.Module, opt: Any) -> None:
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = model(tokens[:, :-1])
            loss = F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()

    return step


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _profile(name: str, model: torch.nn.Module, opt: Any, step: Callable[..., None],
             args: argparse.Namespace) -> dict[str, Any]:  # fmt: skip
    cuda = args.device.startswith("cuda")
    for _ in range(args.warmup):
        step(model, opt)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls, hosts = [], []
    with profile(activities=activities) as prof:
        for _ in range(args.steps):
            _sync(args.device)
            w0, c0 = time.perf_counter(), time.thread_time()
            step(model, opt)
            _sync(args.device)
            walls.append(time.perf_counter() - w0)
            hosts.append(time.thread_time() - c0)
    events = prof.key_averages()
    kernels = [e for e in events if _device_time(e) > 0 and e.device_type.name == "CUDA"] if cuda else []
    kernel_us = sum(_device_time(e) for e in kernels) / args.steps
    return {
        "name": name,
        "wall": statistics.median(walls) * 1e3,
        "host": statistics.median(hosts) * 1e3,
        "kernels": kernel_us / 1e3 if cuda else None,
        "update_launches": sum(e.count for e in kernels
                               if any(k in e.key for k in _UPDATE_KERNELS)) / args.steps,
        "launches": sum(e.count for e in kernels) / args.steps,
        "top_cpu": sorted(events, key=lambda e: e.self_cpu_time_total, reverse=True)[:10],
        "top_device": sorted(kernels, key=_device_time, reverse=True)[:10],
    }  # fmt: skip


def _report(results: list[dict[str, Any]], steps: int) -> None:
    ref = results[0]
    print("| contender | wall ms | / fused Adam | kernels ms | idle ms | update launches "
          "| kernel launches | host CPU ms |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    for r in results:
        kernels = "n/a" if r["kernels"] is None else f"{r['kernels']:.2f}"
        idle = "n/a" if r["kernels"] is None else f"{r['wall'] - r['kernels']:.2f}"
        print(f"| {r['name']} | {r['wall']:.2f} | {r['wall'] / ref['wall']:.3f}x | {kernels} | "
              f"{idle} | {r['update_launches']:.0f} | {r['launches']:.0f} | {r['host']:.2f} |")
    for r in results:
        print(f"\n{r['name']}: ops by self CPU time (ms per step)")
        for e in r["top_cpu"]:
            print(f"  {e.self_cpu_time_total / 1e3 / steps:8.3f}  x{e.count // steps:<5d} {e.key}")
        if r["top_device"]:
            print(f"{r['name']}: kernels by device time (ms per step)")
            for e in r["top_device"]:
                print(f"  {_device_time(e) / 1e3 / steps:8.3f}  x{e.count // steps:<5d} "
                      f"{e.key[:90]}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_profile.py: no CUDA device (use --device cpu for a smoke run)", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    if args.tiny:
        base = TinyGPT(vocab=256, d=32, layers=2, heads=2, seq=16)
        tokens = torch.randint(0, 256, (2, 17))
    else:
        base = TinyGPT(vocab=32768, d=1024, layers=8, heads=16, seq=512)
        tokens = torch.randint(0, 32768, (8, 513))
    base, tokens = base.to(args.device), tokens.to(args.device)
    n = sum(p.numel() for p in base.parameters())
    where = torch.cuda.get_device_name() if args.device.startswith("cuda") else "CPU"
    print(f"TinyGPT {n / 1e6:.1f}M parameters in {len(list(base.parameters()))} tensors, "
          f"batch {tokens.shape[0]}x{tokens.shape[1] - 1}, bf16 autocast, {where}, "
          f"torch {torch.__version__}; {args.steps} profiled steps each\n")  # fmt: skip
    step = _stepper(args.device, tokens)
    results = [_profile(name, model, opt, step, args)
               for name, (model, opt) in _contenders(base).items()]  # fmt: skip
    _report(results, args.steps)
    return 0


if __name__ == "__main__":
    sys.exit(main())
