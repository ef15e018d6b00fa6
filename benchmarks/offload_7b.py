"""Llama-2-7B-shaped state offload on one GPU: step times, peak memory, exact vs torch.optim.

What it runs (the 2026-12-04 H200 run, docs/offload.md, as one script): Hugging Face
``LlamaForCausalLM`` built from a Llama-2-7B-shaped ``LlamaConfig`` (hidden 4096,
MLP 11008, 32 layers, 32 heads, vocab 32000; ``--layers`` for fewer), bf16,
non-reentrant gradient checkpointing, eager attention, deterministic kernels
(``CUBLAS_WORKSPACE_CONFIG=:4096:8``), batch 1 x ``--seq`` tokens, ``--micro``
micro-batches a step (each loss scaled by 1/micro), ``--steps`` steps, seeded
token ids, all runs from one set of initial weights (kept on the CPU).

Modes (``--modes``), in the order given, torch first if asked for:

* ``torch``: ``torch.optim.AdamW(fused=True)``, ``.backward()`` on each micro-batch,
  ``clip_grad_norm_(params, 1.0)``, ``step()``, ``zero_grad()``; uncapped. The
  reference: its final parameters and optimizer state are kept on the CPU.
* the layeropt modes: ``layeropt.AdamW(fused=True)`` + ``attach`` +
  ``offload_state(opt, ...)``, the micro-batches but the last under ``no_step()``,
  the last through ``layeropt.backward(loss, max_norm=1.0)``, then ``step()`` and
  ``zero_grad()``; GPU memory capped at ``--cap-gib`` with
  ``torch.cuda.set_per_process_memory_fraction``:
  ``sync`` (defaults), ``held-on-gpu`` (``held_grads=False``), ``budget``
  (``held_device_bytes=--budget-gib``), ``prefetch`` (``prefetch=True``),
  ``overlap-prefetch`` (``overlap=True, prefetch=True``), and three modes
  ``offload_state`` does not offer on CUDA until a GPU run shows them, each with
  the host pools allocated once (``StateOffload(pooled=True)``):
  ``overlap-prefetch-pools``, ``two-streams`` (copies in and out on streams of
  their own, ``copy_streams=2``) and ``two-streams-device-sums`` (also a later
  micro-batch's held sum added on the device, ``add_on_device=True``); the last
  five CUDA only, skipped with a note on CPU.

One table row per mode: step times, peak allocated / reserved GiB, state and held
gradient bytes copied in the last step, and how many tensors (parameters, then
``exp_avg``/``exp_avg_sq``/``step`` from ``state_dict``) are bit-identical
(``torch.equal``, on the CPU) to the torch run. Exit status 1 if a mode failed
or was not bit-identical.

Expected time on one H200 with the defaults (torch sync overlap-prefetch, 2
micro-batches, 3 steps; from the 2026-12-04 numbers): torch 1.7 + 0.85 + 0.85 s,
offload sync 25.8 + 15.7 + 3.8 s, overlap + prefetch 22.1 + 12.1 + 3.1 s (the
first steps allocate the pinned host state; a later mode may reuse it), plus
start-up, building the model and copying weights and state to and from the CPU
(about 13 GiB of parameters and 25 GiB of state, pageable, ~6-11 GB/s): about
140 s in all (``benchmarks/device_check.sh`` gives it 240 s). Host memory: ~50 GiB
pageable (initial weights, the reference) and ~50 GiB pinned (state and held
gradients, rounded up to powers of two); torch's state is kept for the comparison
only if that fits ``--host-gib`` (default 128, the H200 machine's), else parameters
only are compared (the torch row says so).

    python benchmarks/offload_7b.py                                  # H200: ~140 s
    python benchmarks/offload_7b.py --modes torch sync --layers 4    # quicker
    python benchmarks/offload_7b.py --tiny --device cpu --modes torch sync held-on-gpu budget
"""

from __future__ import annotations

import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # before CUDA starts

import argparse
import contextlib
import datetime
import gc
import sys
import time

import torch
import transformers
from transformers import LlamaConfig, LlamaForCausalLM

import layeropt
from layeropt.offload import StateOffload, offload_state
from layeropt.offload.state import _install

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # (memory_peak beside it)
import memory_peak  # noqa: E402

GiB = 2**30
MODES = {  # mode -> offload_state keywords (None: the torch.optim reference)
    "torch": None,
    "sync": {},
    "held-on-gpu": {"held_grads": False},
    "budget": {},  # held_device_bytes from --budget-gib
    "prefetch": {"prefetch": True},
    "overlap-prefetch": {"overlap": True, "prefetch": True},
    # not offered by offload_state on CUDA until a GPU run shows them (StateOffload built
    # directly, with the host pools):
    "overlap-prefetch-pools": {"overlap": True, "prefetch": True, "pooled": True},
    "two-streams": {"overlap": True, "prefetch": True, "copy_streams": 2, "pooled": True},
    "two-streams-device-sums": {"overlap": True, "prefetch": True, "copy_streams": 2,
                                "add_on_device": True, "pooled": True},
}
CUDA_ONLY = {"prefetch", "overlap-prefetch", "overlap-prefetch-pools", "two-streams",
             "two-streams-device-sums"}


def config_of(args: argparse.Namespace) -> LlamaConfig:
    if args.tiny:
        size = {"hidden_size": 64, "intermediate_size": 172, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 128}
    else:
        size = {"hidden_size": 4096, "intermediate_size": 11008,
                "num_hidden_layers": args.layers, "num_attention_heads": 32,
                "num_key_value_heads": 32, "vocab_size": 32000}
    config = LlamaConfig(**size, max_position_embeddings=max(args.seq, 2048),
                         tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "eager"
    return config


def build(config: LlamaConfig, device: torch.device, dtype: torch.dtype,
          initial: dict | None) -> torch.nn.Module:
    """The model on ``device`` in ``dtype`` (created there, not copied), with ``initial``'s
    weights if given; training mode, non-reentrant checkpointing."""
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default)
    if initial is not None:
        model.load_state_dict(initial)
    kwargs = {"use_reentrant": False}
    if hasattr(model, "activation_checkpointing_enable"):  # (the older name is deprecated there)
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.train()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def host_free_bytes(host_gib: float) -> float:
    """Host memory still free for this process: ``host_gib`` (the machine's memory: on the
    H200 machines MemTotal starts low and grows as memory is used) less this process's
    resident bytes, or the cgroup's limit less its use if that is lower."""
    try:
        with open("/proc/self/statm") as f:
            resident = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        resident = 0
    free_bytes = host_gib * GiB - resident
    try:
        with open("/sys/fs/cgroup/memory.max") as f, open("/sys/fs/cgroup/memory.current") as g:
            limit = f.read().strip()
            if limit != "max":
                free_bytes = min(free_bytes, int(limit) - int(g.read()))
    except (OSError, ValueError):
        pass
    return free_bytes


def copied(handle) -> int:
    """Bytes the offload handle has copied so far: state both ways, held gradients."""
    if handle is None:
        return 0
    held = handle.held
    return handle.copied_bytes + (held.down_bytes + held.up_bytes if held is not None else 0)


def run(mode: str, args: argparse.Namespace, config: LlamaConfig, initial: dict,
        data: torch.Tensor, device: torch.device, dtype: torch.dtype) -> dict:
    """Train ``args.steps`` steps in ``mode``; return the times, memory and the model's
    final parameters and optimizer state dict (still on the device; the caller compares)."""
    free(device)
    model = build(config, device, dtype, initial)
    params = list(model.parameters())
    if mode == "torch":
        opt = torch.optim.AdamW(params, lr=args.lr, fused=True)
        handle = None
    else:
        opt = layeropt.AdamW(params, lr=args.lr, fused=True)
        layeropt.attach(model, opt, bucket_cap_mb=args.bucket_cap_mb)
        options = dict(MODES[mode])
        if mode == "budget":
            options["held_device_bytes"] = int(args.budget_gib * GiB)
        if options.get("pooled"):  # (a mode offload_state does not offer on CUDA yet)
            handle = _install(opt, StateOffload(opt, 2, **options))
        else:
            handle = offload_state(opt, **options)
    times, steady_copied, losses = [], 0, []
    traced = args.memory_trace and mode == args.memory_trace_mode and device.type == "cuda"

    def train_step(step: int) -> None:
        for k in range(args.micro):
            ids = data[step, k].to(device)
            loss = model(input_ids=ids, labels=ids, use_cache=False).loss / args.micro
            if mode == "torch":
                loss.backward()
            elif k < args.micro - 1:
                with opt.no_step():
                    loss.backward()
            else:
                layeropt.backward(loss, max_norm=1.0)
            losses.append(loss.detach() * args.micro)  # (read after the timing: no sync)
        if mode == "torch":
            torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        opt.zero_grad()

    for step in range(args.steps):
        before = copied(handle)
        sync(device)
        trace = None
        with contextlib.ExitStack() as stack:
            if traced and step == min(1, args.steps - 1):  # (the second step: the state
                # made, the last one's time left unrecorded)
                try:
                    trace = stack.enter_context(memory_peak.record(device))
                except Exception as exc:  # noqa: BLE001 - a note, not the mode's failure
                    print(f"  memory trace not taken: {exc!r}", file=sys.stderr, flush=True)
            start = time.perf_counter()
            train_step(step)
            sync(device)
            times.append(time.perf_counter() - start)
        if trace is not None:  # (after the timing: the summary is not in the step's time)
            try:
                summary = memory_peak.summarize(trace.snapshot, trace.baseline,
                                                device.index or 0)
            except Exception as exc:  # noqa: BLE001 - a note, not the mode's failure
                summary = f"not summarized: {exc!r}"
            with open(args.memory_trace, "w") as f:
                f.write(f"{mode}, step {step + 1} of {args.steps}\n{summary}\n")
            print(f"  {mode} step {step + 1}, what the allocator held at its peak:\n{summary}",
                  file=sys.stderr, flush=True)
        steady_copied = copied(handle) - before
        print(f"  {mode} step {step + 1}: {times[-1]:.2f} s, losses "
              f"{', '.join(f'{x.item():.4f}' for x in losses[-args.micro:])}", file=sys.stderr,
              flush=True)
    if handle is not None:
        handle.synchronize()
    peak = None
    if device.type == "cuda":
        peak = (torch.cuda.max_memory_allocated(device) / GiB,
                torch.cuda.max_memory_reserved(device) / GiB)
    return {"times": times, "copied": steady_copied, "peak": peak,
            "params": dict(model.named_parameters()), "state": opt.state_dict()["state"],
            "model": model, "opt": opt, "handle": handle}


def state_tensors(state: dict):
    """(index, key, tensor) for each tensor of an optimizer's ``state_dict()['state']``."""
    for i in sorted(state):
        for k in sorted(state[i]):
            if isinstance(state[i][k], torch.Tensor):
                yield i, k, state[i][k]


def reference(r: dict, args: argparse.Namespace, cuda: bool) -> dict:
    """The torch run's final parameters (by name) and state tensors, on the CPU."""
    params = {k: v.detach().cpu() for k, v in r["params"].items()}
    state = None
    if not args.no_state:
        # still to come: torch's state (2x the parameters' bytes), then the offloaded
        # state (2x, in offload's pool) and held gradients (1x, in powers of two: up to
        # 2x), and a margin
        need = 6 * sum(v.nbytes for v in params.values()) + 4 * GiB
        if not cuda or host_free_bytes(args.host_gib) >= need:
            state = {(i, k): v.cpu() for i, k, v in state_tensors(r["state"])}
    return {"params": params, "state": state}


def compare(ref: dict, r: dict) -> tuple[int, int, str]:
    """How many of a run's parameters and state tensors equal the reference's bit for bit
    (one tensor at a time on the CPU): (equal, compared, details)."""
    same = sum(torch.equal(v.detach().cpu(), ref["params"][k]) for k, v in r["params"].items())
    total, detail = len(ref["params"]), f"{same}/{len(ref['params'])} parameters"
    if ref["state"] is not None:
        ours = {(i, k): v for i, k, v in state_tensors(r["state"])}
        same_s = sum(key in ours and torch.equal(ours[key].cpu(), v)
                     for key, v in ref["state"].items())
        same, total = same + same_s, total + len(ref["state"])
        detail += f", {same_s}/{len(ref['state'])} state"
    return same, total, detail


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", nargs="+", choices=list(MODES),
                    default=["torch", "sync", "overlap-prefetch"])
    ap.add_argument("--micro", type=int, default=2, help="micro-batches per step")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (7B: 32)")
    ap.add_argument("--seq", type=int, default=2048, help="tokens per micro-batch")
    ap.add_argument("--cap-gib", type=float, default=24.0,
                    help="GPU memory cap of the layeropt modes (the torch run is uncapped)")
    ap.add_argument("--budget-gib", type=float, default=4.0,
                    help="held_device_bytes of the budget mode, GiB")
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--bucket-cap-mb", type=float, default=None,
                    help="attach()'s bucket cap (default 1; 0.01 with --tiny)")
    ap.add_argument("--no-state", action="store_true",
                    help="compare parameters only (keeps 2x the parameters' bytes less "
                         "host memory)")
    ap.add_argument("--host-gib", type=float, default=128.0,
                    help="the machine's host memory: torch's state is kept for the comparison "
                         "only if the offloaded runs will still fit (default: the H200 machine)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--memory-trace", metavar="PATH", default=None,
                    help="record the caching allocator's actions in the second step of "
                    "--memory-trace-mode (CUDA; the last step's time stays unrecorded) and "
                    "write what is alive at its peak, by where it was allocated "
                    "(benchmarks/memory_peak.py), to PATH")
    ap.add_argument("--memory-trace-mode", default="sync", choices=list(MODES))
    ap.add_argument("--tiny", action="store_true",
                    help="hidden 64, 2 layers, vocab 128, seq 32, fp32: a CPU smoke run")
    args = ap.parse_args()
    if args.tiny:
        args.seq = min(args.seq, 32)
    if args.bucket_cap_mb is None:
        args.bucket_cap_mb = 0.01 if args.tiny else 1.0
    device = torch.device(args.device)
    cuda = device.type == "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    torch.use_deterministic_algorithms(True)
    modes = list(dict.fromkeys(args.modes))
    if "torch" in modes:
        modes.remove("torch")
        modes.insert(0, "torch")

    config = config_of(args)
    initial = {k: v.detach().cpu().clone()
               for k, v in build(config, device, dtype, None).state_dict().items()}
    free(device)
    n = sum(v.numel() for v in initial.values())
    data = torch.randint(config.vocab_size, (args.steps, args.micro, 1, args.seq),
                         generator=torch.Generator().manual_seed(1))
    where = str(device)
    if cuda:
        total = torch.cuda.get_device_properties(device).total_memory
        where = f"{torch.cuda.get_device_name(device)} ({total / GiB:.1f} GiB)"
    print(f"{where}, torch {torch.__version__}, transformers {transformers.__version__}, "
          f"{datetime.datetime.now().isoformat(timespec='seconds')}")
    print(f"{'tiny' if args.tiny else 'Llama-2-7B-shaped'} LlamaForCausalLM: {n:,} "
          f"parameters ({config.num_hidden_layers} layers, hidden {config.hidden_size}, MLP "
          f"{config.intermediate_size}, vocab {config.vocab_size}), {str(dtype)[6:]}, eager "
          f"attention, non-reentrant checkpointing, deterministic; batch 1 x {args.seq}, "
          f"{args.micro} micro-batches a step, {args.steps} steps, AdamW(fused) lr {args.lr}, "
          f"clip 1.0, bucket cap {args.bucket_cap_mb} MB; layeropt modes capped at "
          f"{args.cap_gib:g} GiB" + ("" if cuda else " (CUDA only: not applied)"), flush=True)
    print("| mode | micro | step times (s) | peak alloc / reserved GiB | copied in the last step | "
          "exact |")
    print("|---|---|---|---|---|---|", flush=True)

    ref = None
    failed = False
    for mode in modes:
        if mode in CUDA_ONLY and not cuda:
            print(f"| {mode} | {args.micro} | skipped: CUDA only (a side stream) | | | |",
                  flush=True)
            continue
        if cuda:  # the torch reference runs uncapped; layeropt under the cap
            fraction = 1.0 if mode == "torch" else min(1.0, args.cap_gib * GiB / total)
            torch.cuda.set_per_process_memory_fraction(fraction, device)
        try:
            r = run(mode, args, config, initial, data, device, dtype)
        except Exception as exc:  # noqa: BLE001 - report it, go on to the next mode
            text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
            print(f"| {mode} | {args.micro} | error: {text} | | | |", flush=True)
            failed = True
            continue
        finally:
            free(device)
        times = ", ".join(f"{t:.2f}" for t in r["times"])
        peak = "{:.2f} / {:.2f}".format(*r["peak"]) if r["peak"] else "-"
        moved = "-" if mode == "torch" else f"{r['copied'] / GiB:.2f} GiB" \
            if r["copied"] >= GiB / 100 else f"{r['copied'] / 2**20:.2f} MiB"
        if mode == "torch":
            ref = reference(r, args, cuda)
            changed = sum(not torch.equal(v, initial[k]) for k, v in ref["params"].items())
            exact = (f"reference ({changed}/{len(ref['params'])} parameters changed from the "
                     f"initial{'' if ref['state'] is not None else '; state not kept'})")
        elif ref is None:
            exact = "no torch reference"
        else:
            same, total, detail = compare(ref, r)
            exact = f"exact: {same}/{total} tensors bit-identical to torch ({detail})"
            failed |= same != total
        del r
        free(device)
        print(f"| {mode} | {args.micro} | {times} | {peak} | {moved} | {exact} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
