"""Check ``layeropt plan``'s need against a GPU: planned and replayed vs the allocator's.

For a few models and configurations, plan the step (fake tensors, the
``"cuda"`` target), then run the same step for real on the GPU (a warm-up step,
then the measured one) and print, in MiB:

* ``planned``: the plan's peak (live tensor bytes);
* ``allocated``: ``torch.cuda.max_memory_allocated`` over the measured step
  (tensor bytes the caching allocator handed out, rounded up to 512 B, plus
  the kernels' workspaces: cuBLAS, cuDNN, flash attention's backward buffers);
* ``reserved``: ``torch.cuda.max_memory_reserved`` (what the allocator took
  from the driver: allocated plus rounding and fragmentation);
* ``used``: the device's used memory (``torch.cuda.mem_get_info``) at the end:
  reserved plus the CUDA context and libraries;
* ``replayed``: what the plan's replay of the caching allocator reserves
  (``Measurement.reserved_bytes``), to compare with ``reserved``;
* ``need``: the plan's need (replayed + ``layeropt.plan.Margin``'s fixed part),
  to compare with ``used``;

then ``replay-res`` (the replay's error), ``used-res`` (the CUDA context, what
``Margin.fixed`` stands for) and ``need-used`` (negative: the plan promised a fit
the device did not have). ``docs/plan.md`` keeps the 2026-12-04 H200 run.

``--attention eager`` and ``--max-norm X`` plan and run the steps with eager
attention and clipping (``clip_grad_norm_`` before torch's ``step()``,
``layeropt.backward(loss, max_norm=X)`` for layeropt's), the two settings of the
2026-12-04 Llama-2-7B run that the plan did not model until 2026-12-07.

Usage (one GPU, a few minutes):
    python benchmarks/plan_calibrate.py                  # gpt2 and llama-3.2-1b
    python benchmarks/plan_calibrate.py --models gpt2 --seq 1024
    python benchmarks/plan_calibrate.py --models llama-3.2-1b --attention eager --max-norm 1
"""

from __future__ import annotations

import argparse
import gc
import sys

import torch

import layeropt
from layeropt.plan import Margin, Variant, plan
from layeropt.plan.workloads import load_config

VARIANTS = [
    Variant("torch.optim.AdamW", "fused"),
    Variant("torch.optim.AdamW", "foreach"),
    Variant("layeropt.AdamW", "fused"),
    Variant("torch.optim.AdamW", "fused", checkpointing=True),
    Variant("layeropt.AdamW", "fused", checkpointing=True),
]
MiB = 2**20


def real_step(name: str, variant: Variant, seq: int, batch: int, dtype: torch.dtype,
              attention: str = "sdpa", max_norm: float | None = None) -> dict:
    """One real warm-up step, then the measured one; the allocator's peaks."""
    import transformers

    _, config = load_config(name)
    config.use_cache = False
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attention
        ).train()
        ids = torch.randint(0, config.vocab_size, (batch, seq))
    if variant.checkpointing:
        if hasattr(model, "activation_checkpointing_enable"):
            model.activation_checkpointing_enable({"use_reentrant": False})
        else:
            model.gradient_checkpointing_enable({"use_reentrant": False})
    params = [p for p in model.parameters() if p.requires_grad]
    impl = {"fused": True} if variant.implementation == "fused" else {"foreach": True}
    cls = layeropt.AdamW if variant.in_backward else torch.optim.AdamW
    opt = cls(params, **impl)
    handle = layeropt.attach(model, opt) if variant.in_backward else None

    def step() -> None:
        loss = model(input_ids=ids, labels=ids).loss
        if max_norm is None:
            loss.backward()
        elif variant.in_backward:
            layeropt.backward(loss, max_norm=max_norm)
        else:
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, max_norm)
        opt.step()
        opt.zero_grad()

    step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    step()
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    out = {
        "allocated": torch.cuda.max_memory_allocated(),
        "reserved": torch.cuda.max_memory_reserved(),
        "used": total - free,
    }
    if handle is not None:
        handle.remove()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt2", "llama-3.2-1b"])
    parser.add_argument("--seq", type=int, default=None, help="default: 2048 or the model's")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16")
    parser.add_argument("--attention", choices=("sdpa", "eager"), default="sdpa")
    parser.add_argument("--max-norm", type=float, default=None, help="clip (default: no)")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("plan_calibrate.py needs a CUDA GPU", file=sys.stderr)
        return 2
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    print(f"GPU: {torch.cuda.get_device_name()}, torch {torch.__version__}, {args.dtype}, "
          f"{args.attention} attention, "
          + ("no clipping" if args.max_norm is None else f"clipped to {args.max_norm:g}"))
    print(f"{'model':<14}{'configuration':<46}{'planned':>8}{'allocated':>10}{'reserved':>9}"
          f"{'used':>7}{'replayed':>9}{'need':>7}{'replay-res':>11}{'used-res':>9}"
          f"{'need-used':>10}  (MiB)")  # fmt: skip
    short = []
    for name in args.models:
        p = plan(name, seq=args.seq, batch=args.batch, dtype=args.dtype, variants=VARIANTS,
                 attention=args.attention, max_norm=args.max_norm)
        for row in p.rows:
            real = real_step(name, row.variant, p.seq, args.batch, dtype, args.attention,
                             args.max_norm)
            gc.collect()  # the model and optimizer of that step are gone
            torch.cuda.empty_cache()
            need = p.need(row)
            if need < real["used"]:
                short.append(f"{name} {row.variant.label}")
            print(
                f"{name:<14}{row.variant.label:<46}{row.peak_bytes / MiB:>8.0f}"
                f"{real['allocated'] / MiB:>10.0f}{real['reserved'] / MiB:>9.0f}"
                f"{real['used'] / MiB:>7.0f}{row.reserved_bytes / MiB:>9.0f}{need / MiB:>7.0f}"
                f"{(row.reserved_bytes - real['reserved']) / MiB:>11.0f}"
                f"{(real['used'] - real['reserved']) / MiB:>9.0f}"
                f"{(need - real['used']) / MiB:>10.0f}",
                flush=True,
            )
    print(f"need = replayed + {Margin().describe()} (layeropt.plan.Margin()); "
          + (f"short of the device's use in {len(short)} rows: {'; '.join(short)}" if short
             else "it covers the device's use in every row"))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
