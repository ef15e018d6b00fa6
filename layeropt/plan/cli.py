"""``python -m layeropt plan MODEL``: the plan as a table, JSON or a plot.

Example:
    >>> from layeropt.__main__ import main
    >>> main(["plan", "llama-3.2-3b", "--gpu-memory", "24GiB"])  # doctest: +SKIP
    0
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Any

from .variants import OPTIMIZERS, Variant
from .workloads import ATTENTION, BUILTIN_SHAPES, PlanError

__all__ = ["add_parser", "run", "join_size_units"]

_UNIT = re.compile(r"[KMGT]i?B|[KMGT]|B", re.IGNORECASE)


def join_size_units(argv: list[str]) -> list[str]:
    """``[..., "--gpu-memory", "24", "GiB", ...]`` -> ``[..., "--gpu-memory", "24 GiB", ...]``.

    So that ``--gpu-memory 24 GiB`` works unquoted, as ``--gpu-memory "24 GiB"`` does.
    """
    out = list(argv)
    for i in range(len(out) - 2, 0, -1):
        if out[i - 1] in ("--gpu-memory", "--margin") and _UNIT.fullmatch(out[i + 1]):
            out[i : i + 2] = [f"{out[i]} {out[i + 1]}"]
    return out


def add_parser(sub: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to the ``layeropt`` parser's subparsers."""
    p = sub.add_parser(
        "plan",
        help="will a training step fit on my GPU, and with which settings (no GPU needed)",
        description=(
            "Run one steady-state training step of MODEL on fake tensors (no memory, any "
            "size, no GPU; a GPU's kernels modelled) under torch.optim.AdamW, "
            "layeropt.AdamW, checkpointing, a chunked loss, optimizer state in host memory "
            "and low-bit optimizer states; print each configuration's peak memory, what is "
            "alive at the peak, and what fits in --gpu-memory. Needs transformers for a "
            "Hugging Face model (pip install 'layeropt[hf]')."
        ),
        epilog=f"built-in shapes: {', '.join(sorted(BUILTIN_SHAPES))}",
    )
    p.add_argument(
        "model",
        metavar="MODEL",
        help="a Hugging Face config.json, a directory holding one, a model name whose "
        "config is in the local HF cache, or a built-in shape (llama-2-7b, gpt2, ...)",
    )
    p.add_argument(
        "--seq", type=int, default=None,
        help="tokens per sequence (2048, or the model's positions if fewer)",
    )  # fmt: skip
    p.add_argument("--batch", type=int, default=1, help="sequences per batch (1)")
    p.add_argument(
        "--max-positions", type=int, metavar="N",
        help="set the config's positions to N first, to plan a --seq longer than it allows",
    )  # fmt: skip
    p.add_argument(
        "--dtype", choices=("bf16", "fp32"), default="bf16",
        help="parameter dtype: pure bf16 (default) or fp32 training",
    )  # fmt: skip
    p.add_argument(
        "--gpu-memory", metavar="SIZE",
        help="the GPU's memory, 1 GiB to 1 TiB, e.g. 24GiB, 80GB or 16 (GiB; GB means GiB "
        "here, as GPU makers mean it): say what fits",
    )  # fmt: skip
    p.add_argument(
        "--margin", metavar="SPEC", default=None,
        help="what a row needs beyond the CUDA caching allocator's reserved memory (replayed): "
        "fixed [+ %% of it] (default 832MiB: the CUDA context an H200 held, 768 MiB, + 64 MiB "
        "for the replay's error)",
    )  # fmt: skip
    p.add_argument(
        "--optimizer", action="append", metavar="NAME", choices=OPTIMIZERS,
        help="only this optimizer (repeatable): " + ", ".join(OPTIMIZERS),
    )  # fmt: skip
    p.add_argument(
        "--all", action="store_true",
        help="every combination (low-bit ones with the chunked loss, in-backward ones "
        "without checkpointing), and every row of the table, with what is alive at each peak "
        "(by default the table shows the recommendation, torch's default and the best of each "
        "kind of change, in 120 columns)",
    )  # fmt: skip
    p.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda",
        help="whose kernels to model: cuda (default) or torch's CPU kernels",
    )  # fmt: skip
    p.add_argument(
        "--bucket-cap-mb", type=float, default=None,
        help="layeropt.attach's bucket_cap_mb (default: the library's)",
    )  # fmt: skip
    p.add_argument(
        "--accumulate", type=int, default=1, metavar="N",
        help="micro-batches per training step (gradient accumulation; default 1): held "
        "gradients planned on the GPU and in host memory as separate rows",
    )  # fmt: skip
    p.add_argument(
        "--attention", choices=ATTENTION, default="sdpa",
        help="a Hugging Face model's attn_implementation: sdpa (default; flash attention "
        "on a GPU) or eager (its matmuls and softmax: a whole sequence's scores alive)",
    )  # fmt: skip
    p.add_argument(
        "--max-norm", type=float, default=None, metavar="X",
        help="clip gradients to total norm X in every row, as clip_grad_norm_ before step() "
        "(torch) and layeropt.backward(loss, max_norm=X) (layeropt: a measure pass, then "
        "the step pass) do; default: no clipping",
    )  # fmt: skip
    p.add_argument(
        "--link-gbps", default=None, metavar="GB/S",
        help="the host link's rates, for the step-time floor of rows that copy over it: "
        "one (GB/s each way, e.g. 25 for PCIe 4.0 x16 in practice) or TO_GPU,TO_HOST,BOTH "
        "(default: an H200's, measured 2026-12-04: 54.9,54.7,88)",
    )  # fmt: skip
    p.add_argument(
        "--jobs", type=int, default=None,
        help="worker processes (default: one per core, up to 4; Linux)",
    )  # fmt: skip
    p.add_argument("--json", action="store_true", help="print one JSON object instead")
    p.add_argument("--plot", metavar="OUT.png", help="draw the categories as stacked bars")
    p.add_argument(
        "--no-progress", action="store_true",
        help="no progress line on stderr (there is none when stderr is not a terminal)",
    )  # fmt: skip
    return p


def run(args: argparse.Namespace) -> int:
    """Run ``layeropt plan`` with parsed arguments; returns the exit status."""
    from ..report import PlotDependencyError
    from . import H200, plan

    progress = None
    if not (args.no_progress or args.json) and sys.stderr.isatty():
        progress = _progress
    try:
        result = plan(
            args.model,
            seq=args.seq,
            batch=args.batch,
            max_positions=args.max_positions,
            dtype=args.dtype,
            gpu_memory=args.gpu_memory,
            margin=args.margin,
            variants="all" if args.all else None,
            optimizers=args.optimizer,
            device=args.device,
            bucket_cap_mb=args.bucket_cap_mb,
            progress=progress,
            jobs=args.jobs if args.jobs is not None else _cores(),
            accumulate=args.accumulate,
            link_gbps=H200 if args.link_gbps is None else args.link_gbps,
            attention=args.attention,
            max_norm=args.max_norm,
        )
        if progress is not None:
            print(file=sys.stderr)
        if args.plot:
            result.plot(args.plot)
    except (PlanError, PlotDependencyError) as e:
        if progress is not None:
            print(file=sys.stderr)
        print(f"layeropt plan: error: {e}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result.to_dict(), indent=1))
    else:
        print(result.table() if args.all else result._summary())
        if args.plot:
            print(f"wrote {args.plot}")
    return 0


def _cores() -> int:
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        cores = os.cpu_count() or 1
    return max(1, min(4, cores))


def _progress(i: int, n: int, variant: Variant) -> None:
    print(f"\r\033[K[{i + 1}/{n}] {variant.label}", end="", file=sys.stderr, flush=True)
