"""Layer-wise fine-tuning of a causal language model with in-backward updates.

Everything a fine-tuning script needs, with each layer updated during backward
and its gradient freed at once:

* **layer-wise learning-rate decay** (param groups): the last block trains at
  ``--lr``, each block below at ``--lr-decay`` times the one above, the
  embeddings lowest;
* ``layeropt.AdamW`` + ``layeropt.attach``;
* **activation checkpointing** of every block (``layeropt.checkpoint_modules``);
* a **chunked LM loss** (``layeropt.losses.linear_cross_entropy``) that never
  builds the full ``(tokens, vocab)`` logits;
* **gradient accumulation** (``opt.no_step()``) and **exact global-norm
  clipping** (``layeropt.backward(loss, max_norm=...)``);
* **warmup + cosine** LR schedule (``torch.optim.lr_scheduler.LambdaLR``),
  optional bf16 autocast, a progress bar (tqdm if installed);
* optional **optimizer state in host memory** (``--offload-state``,
  ``layeropt.offload.offload_state``): each layer's AdamW state is brought to
  the device only for its update in backward, and the gradients the
  accumulation holds between micro-batches wait in host memory too - the same
  numbers;
* optional **gradual unfreezing** (``--unfreeze N``): only the last block and
  the head train at first, one more block below every N steps; the attached
  optimizer picks each newly trainable block up at the next backward;
* **save / resume** (``--save``, ``--resume``): model, optimizer, scheduler,
  step and RNG state; the batches are a function of the step, so a resumed
  run continues exactly where the saved one stopped.

The model is ``layeropt.models.TinyGPT`` by default, or a Hugging Face causal
LM from a local directory (``--model PATH``, e.g. one written by
``save_pretrained``; needs ``transformers``). The text is this script's own
source, as bytes (token id = byte % vocab size).

Usage:
    python examples/finetune_lm.py                          # < 1 min on a laptop CPU
    python examples/finetune_lm.py --tiny                   # CI smoke run, seconds
    python examples/finetune_lm.py --steps 20 --save run.pt
    python examples/finetune_lm.py --steps 40 --resume run.pt --save run.pt
    python examples/finetune_lm.py --model ./my-llama --bf16
    python examples/finetune_lm.py --tiny --check-resume    # prove resume is exact
    python examples/finetune_lm.py --unfreeze 5             # gradual unfreezing
    python examples/finetune_lm.py --offload-state          # AdamW state in host memory
"""

from __future__ import annotations

import argparse
import contextlib
import math
import pathlib
import sys
from collections.abc import Iterable
from typing import Any

import torch
from torch import Tensor, nn

import layeropt
import layeropt.offload
from layeropt.losses import linear_cross_entropy
from layeropt.memory import PeakMemory, format_bytes
from layeropt.models import TinyGPT


# -- the model: TinyGPT or a local Hugging Face checkpoint ----------------------------
def load_model(path: str | None, tiny: bool) -> nn.Module:
    if path is None:
        model = TinyGPT(vocab=256, d=64 if tiny else 192, layers=2 if tiny else 6,
                        heads=4, seq=32 if tiny else 128)
        nn.init.normal_(model.embed.weight, std=0.02)  # GPT-2's init: a sane first loss
        return model
    try:
        from transformers import AutoModelForCausalLM
    except ImportError as exc:
        raise ImportError(
            "--model needs Hugging Face transformers: pip install 'layeropt[hf]'"
        ) from exc
    return AutoModelForCausalLM.from_pretrained(path, local_files_only=True).float()


def blocks_of(model: nn.Module) -> nn.ModuleList:
    """The transformer blocks: the longest ModuleList in the model."""
    return max((m for m in model.modules() if isinstance(m, nn.ModuleList)), key=len)


def hidden_and_head(model: nn.Module, tokens: Tensor) -> tuple[Tensor, Tensor, Tensor | None]:
    """Final hidden states and the LM head's (weight, bias): the logits are never built."""
    if isinstance(model, TinyGPT):
        x = model.embed(tokens) + model.pos[: tokens.shape[1]]
        for block in model.blocks:
            x = block(x)
        return model.ln_f(x), model.embed.weight, None  # tied head
    head = model.get_output_embeddings()
    hidden = model.base_model(input_ids=tokens, use_cache=False).last_hidden_state
    return hidden, head.weight, head.bias


def vocab_and_context(model: nn.Module) -> tuple[int, int]:
    if isinstance(model, TinyGPT):
        return model.vocab, model.seq
    cfg = model.config
    ctx = getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", 128)
    return cfg.vocab_size, min(ctx, 128)


# -- layer-wise learning-rate decay ------------------------------------------------------
def layerwise_groups(model: nn.Module, lr: float, decay: float) -> list[dict[str, Any]]:
    """One param group per depth: block i of L gets lr * decay**(L-1-i), embeddings lowest."""
    blocks = blocks_of(model)
    depth = len(blocks)
    level = {id(p): i for i, b in enumerate(blocks) for p in b.parameters()}
    groups: dict[int, dict[str, Any]] = {}
    for name, p in model.named_parameters():  # tied parameters are listed once
        if not p.requires_grad:
            continue
        if id(p) in level:
            k = level[id(p)]
        elif any(s in name for s in ("embed", "pos", "wte", "wpe")):
            k = -1  # below the first block
        else:
            k = depth - 1  # final norm, head: with the last block
        g = groups.setdefault(k, {"params": [], "lr": lr * decay ** (depth - 1 - k), "names": []})
        g["params"].append(p)
        g["names"].append(name)
    return [groups[k] for k in sorted(groups)]


def unfreeze(model: nn.Module, step: int, every: int) -> int:
    """Gradual unfreezing: the last ``1 + step // every`` blocks train (all with ``every=0``).

    The embeddings train once every block does; the head trains from the start.
    Returns the number of trainable blocks.
    """
    blocks = blocks_of(model)
    if every <= 0:
        return len(blocks)
    n = min(len(blocks), 1 + step // every)
    in_blocks = {id(p) for b in blocks for p in b.parameters()}
    for name, p in model.named_parameters():
        if id(p) not in in_blocks and any(s in name for s in ("embed", "pos", "wte", "wpe")):
            p.requires_grad_(n == len(blocks))
    for i, block in enumerate(blocks):
        block.requires_grad_(i >= len(blocks) - n)
    return n


def warmup_cosine(warmup: int, total: int, floor: float = 0.1):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        t = (step - warmup) / max(1, total - warmup)
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))

    return factor


# -- data: this file's bytes -------------------------------------------------------------
def corpus(vocab: int) -> Tensor:
    data = pathlib.Path(__file__).read_bytes()
    return torch.tensor(list(data), dtype=torch.long) % vocab


def batch_at(text: Tensor, step: int, micro: int, args: argparse.Namespace, ctx: int) -> Tensor:
    """The micro-batch is a function of (seed, step, micro): resuming replays nothing."""
    gen = torch.Generator().manual_seed(args.seed * 100_003 + step * 101 + micro)
    starts = torch.randint(0, len(text) - ctx - 1, (args.batch,), generator=gen)
    return torch.stack([text[s : s + ctx + 1] for s in starts.tolist()])


# -- training --------------------------------------------------------------------------------
def build(args: argparse.Namespace) -> tuple[nn.Module, Any, Any, Any]:
    torch.manual_seed(args.seed)
    model = load_model(args.model, args.tiny)
    model.train()
    opt = layeropt.AdamW(layerwise_groups(model, args.lr, args.lr_decay), lr=args.lr,
                         weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(args.warmup, args.steps))
    handle = layeropt.attach(model, opt)
    ckpt = layeropt.checkpoint_modules(model, types=type(blocks_of(model)[0]))
    handles: tuple[Any, ...] = (handle, ckpt)
    if args.offload_state:  # before a resume: the saved state loads into host memory
        handles += (layeropt.offload.offload_state(opt),)
    return model, opt, sched, handles


def train_step(model: nn.Module, opt: Any, text: Tensor, step: int,
               args: argparse.Namespace, ctx: int) -> float:
    total = 0.0
    for micro in range(args.accum):
        tokens = batch_at(text, step, micro, args, ctx)
        bf16 = torch.autocast("cpu", dtype=torch.bfloat16)
        with bf16 if args.bf16 else contextlib.nullcontext():
            hidden, weight, bias = hidden_and_head(model, tokens[:, :-1])
            # impl="chunked": layeropt.backward's clipping runs two backward passes over
            # the graph, which torch's own fused op (impl="torch") does not allow.
            loss = linear_cross_entropy(hidden, weight, tokens[:, 1:], bias,
                                        impl="chunked") / args.accum
        if micro < args.accum - 1:
            with opt.no_step():  # accumulate: the last micro-batch steps with the sum
                loss.backward()
        else:  # exact global clipping, then each layer is updated in this backward
            layeropt.backward(loss, opt, max_norm=args.max_grad_norm)
        total += loss.item()
    return total


def progress(steps: range, enabled: bool) -> Iterable[int]:
    """A tqdm bar on stderr when tqdm is installed, else the plain range."""
    try:
        from tqdm import tqdm
    except ImportError:
        return steps
    return tqdm(steps, desc="fine-tuning", file=sys.stderr, dynamic_ncols=True, disable=not enabled)


def run(args: argparse.Namespace, steps: int, resume: str | None = None,
        save: str | None = None, quiet: bool = False) -> tuple[nn.Module, list[float], int]:
    model, opt, sched, handles = build(args)
    vocab, ctx = vocab_and_context(model)
    text = corpus(vocab)
    start = 0
    if resume:
        state = torch.load(resume, weights_only=True)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["optimizer"])
        sched.load_state_dict(state["scheduler"])
        torch.set_rng_state(state["rng"])  # dropout masks continue where they stopped
        start = state["step"]
    losses: list[float] = []
    peak = 0
    bar = progress(range(start, steps), enabled=not (quiet or args.no_progress))
    for step in bar:
        trainable = unfreeze(model, step, args.unfreeze)
        if args.unfreeze and not quiet and (step == start or trainable > unfreeze.last):
            print(f"step {step}: {trainable} of {len(blocks_of(model))} blocks trainable")
        unfreeze.last = trainable
        with PeakMemory() as mem:
            losses.append(train_step(model, opt, text, step, args, ctx))
        sched.step()
        peak = max(peak, mem.peak)
        if hasattr(bar, "set_postfix"):
            bar.set_postfix(loss=f"{losses[-1]:.3f}", lr=f"{sched.get_last_lr()[-1]:.2e}")
    if save:
        torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(),
                    "scheduler": sched.state_dict(), "step": steps,
                    "rng": torch.get_rng_state()}, save)
    if args.offload_state and not quiet:
        off = handles[-1]
        print(f"optimizer state in host memory: {format_bytes(off.host_bytes)}, at most "
              f"{format_bytes(off.peak_device_bytes)} of it on the device at once; held "
              f"gradients copied down {format_bytes(off.held.down_bytes)}, their sums up "
              f"{format_bytes(off.held.up_bytes)}")
    for h in handles:
        h.remove()
    return model, losses, peak


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="local Hugging Face model directory")
    p.add_argument("--steps", type=int, default=None, help="total optimizer steps (default 30)")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--lr-decay", type=float, default=0.8, help="per block, top to bottom")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--max-grad-norm", type=float, default=1.0)
    p.add_argument("--unfreeze", type=int, default=0, metavar="N",
                   help="gradual unfreezing: one more block every N steps (0: all train)")
    p.add_argument("--bf16", action="store_true", help="bf16 autocast (CPU)")
    p.add_argument("--offload-state", action="store_true",
                   help="keep the optimizer state in host memory (layeropt.offload)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--save", help="write model/optimizer/scheduler/step here at the end")
    p.add_argument("--resume", help="continue from a file written by --save")
    p.add_argument("--check-resume", action="store_true",
                   help="also train half, save, resume, and compare with the full run")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--tiny", action="store_true", help="CI smoke run: a few seconds")
    args = p.parse_args(argv)
    args.steps = args.steps or (4 if args.tiny else 30)
    torch.set_num_threads(args.threads)

    model, losses, peak = run(args, args.steps, resume=args.resume, save=args.save)
    unfreeze(model, args.steps * max(args.unfreeze, 1), args.unfreeze)  # all, for the count
    groups = layerwise_groups(model, args.lr, args.lr_decay)
    n = sum(p.numel() for g in groups for p in g["params"])
    print(f"{type(model).__name__}: {n:,} parameters in {len(groups)} layer-wise LR groups "
          f"(lr {groups[0]['lr']:.2e} .. {groups[-1]['lr']:.2e})")
    if losses:
        print(f"steps {args.steps - len(losses)}..{args.steps}: loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}; peak memory of a step above parameters and optimizer "
              f"state {format_bytes(peak)} ({peak:,} B)")
    if args.save:
        print(f"saved {args.save}")
    if args.check_resume:
        half = args.steps // 2
        full, _, _ = run(args, args.steps, quiet=True)
        path = str(pathlib.Path(args.save or "finetune_check.pt").with_suffix(".half.pt"))
        run(args, half, save=path, quiet=True)
        resumed, _, _ = run(args, args.steps, resume=path, quiet=True)
        diff = max((a - b).abs().max().item()
                   for a, b in zip(full.parameters(), resumed.parameters()))
        pathlib.Path(path).unlink()
        print(f"resume check: {half} steps + save + resume to {args.steps} vs one run: "
              f"max |difference| = {diff:.1e}" + (" (bit for bit)" if diff == 0 else ""))


if __name__ == "__main__":
    main()
