"""DDP + layeropt (``attach_ddp``) vs DDP + torch.optim: time per step, interleaved.

(``--fsdp``: FSDP2 + layeropt (``attach`` after ``fully_shard``, each block its
own group) vs FSDP2 + torch.optim, the same way.)

Two gloo ranks on CPU (``torch.multiprocessing.spawn``), one process group.
For each DDP bucket size, each rank builds three DDP replicas of the same
model (same initial weights):

* ``torch.optim.AdamW`` (``backward(); step(); zero_grad()``), the reference;
* the same with torch's own Python all-reduce comm hook
  (``ddp_comm_hooks.default_hooks.allreduce_hook``), and with the least a
  Python comm hook can do (scale the bucket, start its all-reduce, return a
  completed future; wait for the all-reduces at the end of backward): what
  any Python comm hook costs per bucket, before it does anything;
* ``layeropt.AdamW`` attached to the DDP model (each gradient bucket stepped
  in the communication hook right after its all-reduce).

The setting is ``examples/ddp_train.py``'s: a TinyGPT, two micro-batches per
step (the first under ``no_sync()``, and ``no_step()`` for layeropt), with
DDP's default ``bucket_cap_mb=25`` and the example's ``0.25`` (many buckets).

Rounds are interleaved: one training step of each contender per round, the
first contender alternating, both on the same batches. Time is this process's
CPU time (``time.process_time``: every thread, so the comm thread that runs
the hook's ``.then()`` too) and the wall clock, per step and rank. Reported:
the median over rounds of (layeropt / torch) in the same round, per rank and
for the mean of the ranks. At the end the parameters of the two contenders
are compared bit for bit on every rank, and across ranks.

Usage:
    python benchmarks/bench_ddp.py                      # width 256, 60 rounds (~4 min)
    python benchmarks/bench_ddp.py --tiny               # smoke run, seconds
    python benchmarks/bench_ddp.py --width 64 --fused --lo-cap 0
    python benchmarks/bench_ddp.py --fsdp                   # FSDP2 (~2 min)
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import layeropt
from layeropt.models import make_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--rounds", type=int, default=60)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--bucket-cap-mb", type=float, nargs="+", default=[25.0, 0.25],
                   help="DDP bucket_cap_mb values, one table each")
    p.add_argument("--fused", action="store_true", help="AdamW(fused=True) on both sides")
    p.add_argument("--lo-cap", type=float, default=1.0,
                   help="attach_ddp(bucket_cap_mb=...): landed buckets stepped together up "
                        "to this many MiB (layeropt's default 1; 0: one call per DDP bucket)")
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--fsdp", action="store_true", help="FSDP2 instead of DDP (one table)")
    p.add_argument("--tiny", action="store_true", help="smoke run: tiny model, 3 rounds")
    args = p.parse_args(argv)
    if args.fsdp:
        args.bucket_cap_mb = [0.0]  # (one table; FSDP2 groups are the blocks)
    if args.tiny:
        args.width, args.layers, args.rounds, args.warmup = 32, 2, 3, 1
    return args


def _minimal_hook(ddp: nn.Module) -> None:
    """The least work a Python comm hook can do: average, never touch a parameter."""
    from torch.autograd import Variable

    group, pending = ddp.process_group, []

    def wait_all() -> None:
        for fut in pending:
            fut.wait()
        pending.clear()

    def hook(state, bucket):  # type: ignore[no-untyped-def]  # (DDP inspects annotations)
        if not pending:  # the first bucket of this backward
            Variable._execution_engine.queue_callback(wait_all)  # before DDP's own
        buffer = bucket.buffer()
        buffer.mul_(1.0 / group.size())
        pending.append(group.allreduce([buffer]).get_future())
        done = torch.futures.Future()
        done.set_result(buffer)
        return done

    ddp.register_comm_hook(None, hook)


def _fully_shard(model: nn.Module) -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    return fully_shard(model, mesh=mesh)


@contextlib.contextmanager
def _no_sync(model: nn.Module) -> Any:
    if hasattr(model, "no_sync"):  # DDP
        with model.no_sync():
            yield
        return
    model.set_requires_gradient_sync(False)  # FSDP2
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


class _Contender:
    """One DDP replica and how it takes a training step."""

    def __init__(self, name: str, base: nn.Module, args: argparse.Namespace, cap: float,
                 lo: bool, hook: str | None = None) -> None:  # fmt: skip
        self.name = name
        self.model = copy.deepcopy(base)
        if args.fsdp:
            self.ddp = _fully_shard(self.model)
        else:
            self.ddp = nn.parallel.DistributedDataParallel(self.model, bucket_cap_mb=cap)
        if hook == "torch":
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            self.ddp.register_comm_hook(None, default_hooks.allreduce_hook)
        elif hook == "minimal":
            _minimal_hook(self.ddp)
        kw: dict[str, Any] = dict(lr=3e-3, weight_decay=0.01)
        if args.fused:
            kw["fused"] = True
        cls = layeropt.AdamW if lo else torch.optim.AdamW
        self.opt = cls(self.ddp.parameters(), **kw)
        # layeropt.attach hands a DDP model to attach_ddp
        self.handle = layeropt.attach(self.ddp, self.opt, bucket_cap_mb=args.lo_cap) if lo else None
        self.cpu: list[float] = []
        self.wall: list[float] = []

    def step(self, batches: list[Any], loss_fn: Any) -> None:
        n = len(batches)
        for i, batch in enumerate(batches):
            with contextlib.ExitStack() as ctx:
                if i < n - 1:  # accumulate locally: no all-reduce, no step
                    ctx.enter_context(_no_sync(self.ddp))
                    if self.handle is not None:
                        ctx.enter_context(self.opt.no_step())
                (loss_fn(self.ddp, batch) / n).backward()
        self.opt.step()  # layeropt: nothing left to do after the attached backward
        self.opt.zero_grad()


def _run(rank: int, world: int, store: str, args: argparse.Namespace, out: Any) -> None:
    torch.set_num_threads(args.threads)
    # (a file store: a port picked free and let go can be taken by another job first)
    dist.init_process_group("gloo", init_method=store, rank=rank, world_size=world)
    try:
        base, batch_fn, loss_fn = make_model("gpt", d=args.width, layers=args.layers)
        for cap in args.bucket_cap_mb:
            out.put((rank, cap, _measure(args, base, batch_fn, loss_fn, cap, rank, world)))
            gc.collect()
            dist.barrier()
    finally:
        dist.destroy_process_group()


def _measure(args: argparse.Namespace, base: nn.Module, batch_fn: Any, loss_fn: Any,
             cap: float, rank: int, world: int) -> dict[str, Any]:  # fmt: skip
    if args.fsdp:
        runs = [_Contender("FSDP2 + torch.optim.AdamW", base, args, cap, lo=False),
                _Contender("FSDP2 + layeropt.AdamW (attach)", base, args, cap, lo=True)]
        return _timed(args, runs, batch_fn, loss_fn, base, rank, world)
    runs = [_Contender("DDP + torch.optim.AdamW", base, args, cap, lo=False),
            _Contender("DDP + torch.optim.AdamW + torch's Python all-reduce comm hook", base,
                       args, cap, lo=False, hook="torch"),
            _Contender("DDP + torch.optim.AdamW + a minimal Python comm hook", base, args, cap,
                       lo=False, hook="minimal"),
            _Contender("DDP + layeropt.AdamW (attach_ddp)", base, args, cap, lo=True)]  # fmt: skip
    return _timed(args, runs, batch_fn, loss_fn, base, rank, world)


def _timed(args: argparse.Namespace, runs: list[_Contender], batch_fn: Any, loss_fn: Any,
           base: nn.Module, rank: int, world: int) -> dict[str, Any]:  # fmt: skip
    gen = torch.Generator().manual_seed(1234 + rank)  # each rank its own data
    total = args.warmup + args.rounds
    data = [[batch_fn(gen) for _ in range(args.accum)] for _ in range(total)]
    for k in range(total):
        order = runs[k % len(runs):] + runs[: k % len(runs)]  # the first one rotates
        for r in order:
            dist.barrier()  # both ranks start each contender's step together
            c0, w0 = time.process_time(), time.perf_counter()
            r.step(data[k], loss_fn)
            c1, w1 = time.process_time(), time.perf_counter()
            if k >= args.warmup:
                r.cpu.append(c1 - c0)
                r.wall.append(w1 - w0)
    ref, lo = runs[0], runs[-1]
    full = [_full(p) for p in lo.model.parameters()]
    same = all(torch.equal(a, _full(b)) for a, b in zip(full, ref.model.parameters()))
    flat = torch.cat([p.flatten() for p in full])
    gathered = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(gathered, flat)
    fast = lo.opt._lo_stepper.fast
    result = {
        "names": [r.name for r in runs], "cpu": [r.cpu for r in runs],
        "wall": [r.wall for r in runs], "same": same,
        "replicas": all(torch.equal(g, gathered[0]) for g in gathered),
        "params": sum(p.numel() for p in base.parameters()),
        "tensors": len(list(base.parameters())),
        "buckets": (len(list(base.blocks)) + 1 if args.fsdp
                    else len(ref.ddp.reducer._get_zeros_like_grad_buckets())),
        "fast": None if fast is None else (fast.taken, fast.built, fast.dropped),
    }  # fmt: skip
    if lo.handle is not None:
        lo.handle.remove()
    return result


def _full(p: torch.Tensor) -> torch.Tensor:
    """A parameter whole (FSDP2's are DTensor shards)."""
    return p.full_tensor() if hasattr(p, "full_tensor") else p.detach()


def _median_ratio(a: list[float], b: list[float]) -> float:
    return statistics.median(x / y for x, y in zip(a, b))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    world = 2
    ctx = mp.get_context("spawn")
    out = ctx.SimpleQueue()
    with tempfile.TemporaryDirectory() as tmp:
        mp.spawn(_run, args=(world, f"file://{tmp}/store", args, out), nprocs=world)
    results: dict[float, dict[int, dict[str, Any]]] = {}
    for _ in range(world * len(args.bucket_cap_mb)):
        rank, cap, result = out.get()
        results.setdefault(cap, {})[rank] = result
    ok = True
    print(f"torch {torch.__version__}, Python {platform.python_version()}, {os.cpu_count()} CPUs; "
          f"{world} gloo ranks, {args.threads} torch thread(s) each")  # fmt: skip
    for cap in args.bucket_cap_mb:
        ok &= _report(args, cap, results[cap], world)
    return 0 if ok else 1


def _report(args: argparse.Namespace, cap: float, results: dict[int, Any], world: int) -> bool:
    r0 = results[0]
    engine = "FSDP2" if args.fsdp else "DDP"
    if args.fsdp:
        print(f"\n### FSDP2: {r0['buckets']} groups (each block, and the root)\n")
    else:
        print(f"\n### DDP bucket_cap_mb={cap:g}: {r0['buckets']} buckets\n")
    print(f"TinyGPT(d={args.width}, layers={args.layers}): {r0['params'] / 1e6:.2f}M parameters "
          f"in {r0['tensors']} tensors; {args.accum} micro-batches per step; "
          f"AdamW{'(fused=True)' if args.fused else ''}; "
          f"{'attach' if args.fsdp else 'attach_ddp'}(bucket_cap_mb={args.lo_cap:g}); "
          f"{args.rounds} interleaved rounds\n")  # fmt: skip
    print("| contender | CPU ms/step (rank 0, 1) | wall ms/step (rank 0) | "
          "CPU time / torch (mean of ranks) | wall / torch (rank 0) |")
    print("|---|---:|---:|---:|---:|")
    n = len(r0["names"])
    mean_cpu = [[(a + b) / 2 for a, b in zip(results[0]["cpu"][i], results[1]["cpu"][i])]
                for i in range(n)]  # fmt: skip
    for i, name in enumerate(r0["names"]):
        cpu = ", ".join(f"{statistics.median(results[r]['cpu'][i]) * 1e3:.1f}" for r in range(world))
        wall = statistics.median(r0["wall"][i]) * 1e3
        ratio = _median_ratio(mean_cpu[i], mean_cpu[0])
        wratio = _median_ratio(r0["wall"][i], r0["wall"][0])
        print(f"| {name} | {cpu} | {wall:.1f} | {ratio:.3f}x | {wratio:.3f}x |")
    per_rank = ", ".join(f"{_median_ratio(results[r]['cpu'][-1], results[r]['cpu'][0]):.3f}x"
                         for r in range(world))  # fmt: skip
    print(f"\nlayeropt / torch, CPU time per rank: {per_rank}")
    same = all(results[r]["same"] for r in range(world))
    replicas = all(results[r]["replicas"] for r in range(world))
    agree = "agree bit for bit" if replicas else "DIFFER"
    print(f"parameters: layeropt {'bit-identical to' if same else 'DIFFER from'} {engine} + "
          f"torch.optim on every rank; replicas {agree}")
    if r0["fast"] is not None:
        taken, built, dropped = r0["fast"]
        print(f"fast path (rank 0): {taken} bucket calls, {built} lists built, {dropped} dropped")
    return same and replicas


if __name__ == "__main__":
    sys.exit(main())
