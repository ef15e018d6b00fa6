"""Data-parallel training with in-backward updates, on CPU (gloo): DDP or FSDP2.

Every process trains a replica of a small GPT-like model (tied embedding
head) on its own data. layeropt updates each gradient bucket as soon as it has
been averaged over the processes: with DDP, a communication hook steps each
bucket right after its all-reduce; with FSDP2, each sharded layer is stepped
right after its reduce-scatter. No ``.grad`` is left after backward.

The script then checks, and prints, that

* the replicas agree bit for bit (all-gather of the parameters), and
* the result equals the same DDP / FSDP2 run with ``torch.optim`` bit for bit.

Usage:
    torchrun --nproc_per_node=2 examples/ddp_train.py          # seconds on CPU
    torchrun --nproc_per_node=2 examples/ddp_train.py --fsdp   # FSDP2 (fully_shard)
    torchrun --nproc_per_node=2 examples/ddp_train.py --accum 4
    python examples/ddp_train.py --tiny                        # spawns 2 processes itself
    torchrun --nproc_per_node=8 examples/ddp_train.py --device cuda   # NCCL, one GPU each
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import tempfile
import time
from collections.abc import Callable, Iterator

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor, nn

import layeropt
from layeropt.distributed import attach_ddp
from layeropt.models import make_model


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--fsdp", action="store_true", help="FSDP2 fully_shard instead of DDP")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--width", type=int, default=64)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--nproc", type=int, default=2, help="processes when not under torchrun")
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--overlap", action=argparse.BooleanOptionalAction, default=True,
                   help="DDP on CUDA: step each bucket in its all-reduce's .then() (default) "
                        "or at the end of backward (CPU buckets: always at the end)")
    p.add_argument("--backend", default=None, help="default: gloo on cpu, nccl on cuda")
    p.add_argument("--tiny", action="store_true", help="CI smoke run: a few seconds")
    args = p.parse_args(argv)
    if args.tiny:
        args.steps, args.width, args.layers = 3, 32, 2
    if args.backend is None:
        args.backend = "nccl" if args.device == "cuda" else "gloo"
    return args


def _device(args: argparse.Namespace) -> torch.device:
    if args.device == "cpu":
        return torch.device("cpu")
    index = int(os.environ.get("LOCAL_RANK", dist.get_rank())) % torch.cuda.device_count()
    torch.cuda.set_device(index)
    return torch.device("cuda", index)


@contextlib.contextmanager
def _fsdp_no_sync(model: nn.Module) -> Iterator[None]:
    model.set_requires_gradient_sync(False)
    try:
        yield
    finally:
        model.set_requires_gradient_sync(True)


def build(args: argparse.Namespace) -> tuple[nn.Module, Callable, Callable, Callable]:
    """The wrapped model, its batch and loss functions, and its no-sync context."""
    device = _device(args)
    model, cpu_batch_fn, loss_fn = make_model("gpt", d=args.width, layers=args.layers)
    model.to(device)

    def batch_fn(gen: torch.Generator) -> Tensor:
        return cpu_batch_fn(gen).to(device)

    if not args.fsdp:
        ids = [device.index] if device.type == "cuda" else None
        ddp = nn.parallel.DistributedDataParallel(model, device_ids=ids, bucket_cap_mb=0.25)
        return ddp, batch_fn, loss_fn, ddp.no_sync
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, batch_fn, loss_fn, lambda: _fsdp_no_sync(model)


def train_step(
    args: argparse.Namespace,
    wrapped: nn.Module,
    batch_fn: Callable,
    loss_fn: Callable,
    no_sync: Callable,
    opt: torch.optim.Optimizer,
    gen: torch.Generator,
) -> float:
    """One optimizer step over ``args.accum`` micro-batches; returns the loss."""
    use_layeropt = layeropt.is_in_backward(opt)
    total = 0.0
    for micro in range(args.accum):
        with contextlib.ExitStack() as ctx:
            if micro < args.accum - 1:  # no communication, so no step: grads add up locally
                ctx.enter_context(no_sync())
                if use_layeropt:
                    ctx.enter_context(opt.no_step())
            loss = loss_fn(wrapped, batch_fn(gen)) / args.accum
            loss.backward()  # the last micro-batch: averaged, stepped and freed here
        total += loss.item()
    if use_layeropt:
        assert all(p.grad is None for p in wrapped.parameters())
    opt.step()  # a no-op after an attached backward; torch.optim's real step
    opt.zero_grad()
    return total


def train(args: argparse.Namespace, use_layeropt: bool) -> tuple[list[float], Tensor, float]:
    """Train; return the losses, the flattened full parameters, seconds per step."""
    wrapped, batch_fn, loss_fn, no_sync = build(args)
    cls = layeropt.AdamW if use_layeropt else torch.optim.AdamW
    opt = cls(wrapped.parameters(), lr=args.lr, weight_decay=0.01)
    handle: contextlib.AbstractContextManager = contextlib.nullcontext()
    if use_layeropt and args.fsdp:
        handle = layeropt.attach(wrapped, opt)  # FSDP2 runs the hooks after reduce-scatter
    elif use_layeropt:
        handle = attach_ddp(wrapped, opt, overlap=args.overlap)  # average, then step
    gen = torch.Generator().manual_seed(1234 + dist.get_rank())  # each rank its own data
    losses = []
    start = 0.0
    with handle:  # removes the hooks at the end
        for step in range(args.steps):
            if step == min(1, args.steps - 1):  # the first step pays one-time set-up (DDP's lazy init, imports)
                start = time.perf_counter()
            losses.append(train_step(args, wrapped, batch_fn, loss_fn, no_sync, opt, gen))
    seconds = (time.perf_counter() - start) / max(args.steps - 1, 1)
    full = [p.full_tensor() if hasattr(p, "full_tensor") else p for p in wrapped.parameters()]
    flat = torch.cat([t.detach().flatten() for t in full])
    return losses, flat if args.backend == "nccl" else flat.cpu(), seconds


def main(args: argparse.Namespace) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    engine = "FSDP2" if args.fsdp else "DDP"
    losses, params, seconds = train(args, use_layeropt=True)
    ref_losses, ref_params, ref_seconds = train(args, use_layeropt=False)
    gathered = [torch.empty_like(params) for _ in range(world)]
    dist.all_gather(gathered, params)
    spread = max((g - gathered[0]).abs().max().item() for g in gathered)
    vs_torch = (params - ref_params).abs().max().item()
    if rank == 0:
        print(f"{engine}, {world} processes ({args.backend}, {args.device}), "
              f"{params.numel()} parameters, "
              f"{args.steps} steps x {args.accum} micro-batches")
        print(f"loss: {losses[0]:.4f} -> {losses[-1]:.4f}")
        print(f"time per step: layeropt {seconds * 1e3:.1f} ms, "
              f"{engine} + torch.optim {ref_seconds * 1e3:.1f} ms")
        verdict = "replicas agree bit for bit" if spread == 0 else "REPLICAS DIFFER"
        print(f"{verdict}: max |rank r - rank 0| = {spread:.3g}")
        same = "bit-identical to" if vs_torch == 0 else "DIFFERS from"
        print(f"layeropt is {same} {engine} + torch.optim: max diff {vs_torch:.3g}")
    if spread != 0 or vs_torch != 0:
        raise SystemExit(1)


def _shut_down() -> None:
    gc.collect()  # free the DDP/FSDP modules while the process group still exists
    dist.barrier()
    dist.destroy_process_group()


def _run(rank: int, world: int, store: str, args: argparse.Namespace) -> None:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # as torchrun does
    dist.init_process_group(args.backend, init_method=store, rank=rank, world_size=world)
    try:
        main(args)
    finally:
        _shut_down()


if __name__ == "__main__":
    arguments = parse_args()
    if "RANK" in os.environ:  # launched by torchrun
        dist.init_process_group(arguments.backend)
        try:
            main(arguments)
        finally:
            _shut_down()
    else:
        with tempfile.TemporaryDirectory() as tmp:  # (the processes meet in a file)
            mp.spawn(_run, args=(arguments.nproc, f"file://{tmp}/store", arguments),
                     nprocs=arguments.nproc)
