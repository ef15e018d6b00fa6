"""One rank of ``test_integrations_ddp.py``: each tool under DDP, torch.optim vs layeropt.

Launched by the test with ``python -m torch.distributed.run --nproc_per_node=2
tests/ddp_tools_worker.py TOOL OUT_DIR`` (the way users launch these tools), on
CPU with gloo. For every case of TOOL it trains the same model twice in this
process - the tool with the ``torch.optim`` optimizer, then the tool with the
layeropt one - and saves both results to ``OUT_DIR/TOOL-rank{R}.pt`` for the
test to compare. A case that raises records the error text instead.
"""

from __future__ import annotations

import os
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable
from typing import Any

import torch
from harness import leave_rank

import layeropt

VOCAB = 64
STEPS = 3


def _result(model: torch.nn.Module, opt: Any = None, **extra: Any) -> dict[str, Any]:
    out = dict(params=[p.detach().clone() for p in model.parameters()], **extra)
    if opt is not None:
        opt = layeropt.optim.unwrap_optimizer(opt)
        out["state"] = {i: {k: v.clone() if isinstance(v, torch.Tensor) else v
                            for k, v in sorted(s.items())}
                        for i, s in sorted(opt.state_dict()["state"].items())}
    return out


# ----------------------------------------------------------------------------
# accelerate
# ----------------------------------------------------------------------------
ACCELERATE = {
    "plain": dict(),
    "ga2": dict(ga=2),
    "ga2-clip-norm": dict(ga=2, clip="norm"),
    "clip-value": dict(clip="value"),
    "given-max-norm": dict(clip="norm", given=True),
    "find_unused-ga2-clip-norm": dict(ga=2, clip="norm", find_unused=True),
    "default-cap-ga2-clip-norm": dict(ga=2, clip="norm", cap=None),  # the library's defaults
    # DistributedDataParallelKwargs(comm_hook=FP16): each bucket reduced in fp16
    "fp16-comm-hook-ga2": dict(ga=2, comm="FP16"),
    "fp16-comm-hook-ga2-clip-norm": dict(ga=2, clip="norm", comm="FP16"),
}


def _accelerate(kind: str, ga: int = 1, clip: str | None = None, given: bool = False,
                find_unused: bool = False, cap: float | None = 0.0,
                comm: str | None = None) -> dict[str, Any]:
    import accelerate
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from layeropt.integrations.accelerate import LayeroptAccelerator
    from layeropt.models import make_model

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    model, batch_fn, loss_fn = make_model("gpt")
    kw: dict[str, Any] = dict(cpu=True, gradient_accumulation_steps=ga)
    if find_unused or comm:
        kw["kwargs_handlers"] = [DistributedDataParallelKwargs(
            find_unused_parameters=find_unused,
            comm_hook=DDPCommunicationHookType[comm or "NO"])]
    if kind == "torch":
        acc = accelerate.Accelerator(**kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    else:
        if given:
            kw["max_grad_norm"] = 0.05
        acc = LayeroptAccelerator(bucket_cap_mb=cap, **kw)
        opt = layeropt.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    ddp, opt = acc.prepare(model, opt)
    gen = torch.Generator().manual_seed(1 + acc.process_index)
    norms, grads_left = [], 0
    for _ in range(STEPS * ga):
        with acc.accumulate(ddp):
            acc.backward(loss_fn(ddp, batch_fn(gen)))
            if acc.sync_gradients:
                if clip == "norm":
                    norms.append(acc.clip_grad_norm_(ddp.parameters(), 0.05))
                elif clip == "value":
                    acc.clip_grad_value_(ddp.parameters(), 0.002)
                grads_left = sum(p.grad is not None for p in ddp.parameters())
            opt.step()
            opt.zero_grad()
    return _result(model, opt, norms=norms, grads_left=grads_left,
                   wrapper=type(ddp).__name__)


# ----------------------------------------------------------------------------
# Hugging Face Trainer
# ----------------------------------------------------------------------------
HF = {
    "ga2": dict(ga=2),  # the Trainer's DDP default for a PreTrainedModel: find_unused=True
    "ga2-max_grad_norm": dict(ga=2, max_grad_norm=0.5),
    "ga1-max_grad_norm-find_unused_false": dict(
        ga=1, max_grad_norm=0.1, ddp_find_unused_parameters=False),
    "ga2-bf16": dict(ga=2, bf16=True),
    "built-ga2": dict(ga=2, built=True),  # no optimizers=: args.optim's class (layeropt's)
    # activation checkpointing (the Trainer then builds DDP with find_unused=False)
    "ga2-checkpointing-reentrant": dict(ga=2, max_grad_norm=0.5, ckpt={"use_reentrant": True}),
    "ga2-checkpointing": dict(ga=2, ckpt={"use_reentrant": False}),
    "callback-refused": dict(ga=2, callback=True),
    # (README, integrations.md: FSDP under the Trainer is refused - reachable only here:
    # the Trainer itself refuses fsdp= in one process)
    "fsdp-refused": dict(ga=1, fsdp=True, refused=True),
}


def _hf(kind: str, ga: int = 2, max_grad_norm: float = 0.0, callback: bool = False,
        built: bool = False, ckpt: dict | None = None, refused: bool = False,
        **targs: Any) -> dict[str, Any]:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )
    from transformers.utils import logging as hf_logging

    from layeropt.integrations.hf import LayeroptCallback, LayeroptTrainer

    hf_logging.set_verbosity_error()
    grads_alive: list[int] = []  # gradients left for optimizer.step(), per step

    class Probe(TrainerCallback):
        def on_pre_optimizer_step(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            grads_alive.append(sum(p.grad is not None for p in kw["model"].parameters()))

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32))
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, VOCAB, (16,), generator=gen) for _ in range(24)]
    data = [{"input_ids": r, "labels": r} for r in rows]
    if ckpt is not None:  # transformers >= 5: activation_*; before: gradient_*
        name = ("activation_checkpointing"
                if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
                else "gradient_checkpointing")
        targs.update({name: True, f"{name}_kwargs": ckpt})
    with tempfile.TemporaryDirectory() as tmp:
        args = TrainingArguments(
            output_dir=tmp, max_steps=STEPS, per_device_train_batch_size=2,
            gradient_accumulation_steps=ga, learning_rate=1e-2, max_grad_norm=max_grad_norm,
            lr_scheduler_type="cosine", warmup_steps=1, logging_steps=1, seed=0,
            report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no", **targs)
        common = dict(model=model, args=args, train_dataset=data)
        if built:  # the Trainer builds args.optim's optimizer (LayeroptTrainer: layeropt's)
            cls = Trainer if kind == "torch" else LayeroptTrainer
            trainer = cls(**common, callbacks=[Probe()])
        elif kind == "torch":
            opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
            trainer = Trainer(**common, optimizers=(opt, None), callbacks=[Probe()])
        elif callback:
            opt = layeropt.AdamW(model.parameters(), lr=1e-2)
            trainer = Trainer(**common, optimizers=(opt, None), callbacks=[LayeroptCallback()])
        else:
            opt = layeropt.AdamW(model.parameters(), lr=1e-2)
            trainer = LayeroptTrainer(**common, optimizers=(opt, None), bucket_cap_mb=0,
                                      callbacks=[Probe()])
        trainer.train()
    opt = trainer.optimizer
    norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
    return _result(model, opt, norms=norms if max_grad_norm > 0 else [],
                   wrapper=type(trainer.model_wrapped).__name__,
                   world=args.world_size, grads_alive=grads_alive,
                   checkpointing=model.is_gradient_checkpointing)


# ----------------------------------------------------------------------------
# Lightning
# ----------------------------------------------------------------------------
LIGHTNING = {
    "plain": dict(),
    "accumulate2": dict(accumulate_grad_batches=2),
    "clip-norm": dict(gradient_clip_val=0.05),
    "accumulate2-clip-value": dict(accumulate_grad_batches=2, gradient_clip_val=0.05,
                                   gradient_clip_algorithm="value"),
    "find_unused-clip-norm": dict(strategy="ddp_find_unused_parameters_true",
                                  gradient_clip_val=0.05),
    "bf16-mixed-accumulate2-clip-norm": dict(precision="bf16-mixed", accumulate_grad_batches=2,
                                             gradient_clip_val=0.05),
}


def _lightning(kind: str, **trainer_kw: Any) -> dict[str, Any]:
    import lightning as L
    from torch.utils.data import DataLoader, TensorDataset

    from layeropt.integrations.lightning import LayeroptCallback

    class Net(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.GELU(),
                                           torch.nn.LayerNorm(32), torch.nn.Linear(32, 4))
            self.seen: list[str] = []
            self.grads_alive: list[int] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.seen.append(type(self.trainer.strategy.model).__name__)
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def on_before_optimizer_step(self, optimizer: Any) -> None:
            self.grads_alive.append(sum(p.grad is not None for p in self.parameters()))

        def configure_optimizers(self) -> Any:
            cls = torch.optim.AdamW if kind == "torch" else layeropt.AdamW
            opt = cls(self.parameters(), lr=1e-2)
            return [opt], [torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.7)]

    g = torch.Generator().manual_seed(1)
    loader = DataLoader(TensorDataset(torch.randn(64, 8, generator=g) * 3,
                                      torch.randn(64, 4, generator=g)), batch_size=4)
    module = Net()
    trainer_kw.setdefault("strategy", "ddp")
    callbacks = [] if kind == "torch" else [LayeroptCallback(bucket_cap_mb=0)]
    trainer = L.Trainer(max_steps=STEPS, accelerator="cpu", devices=2, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, callbacks=callbacks, **trainer_kw)
    trainer.fit(module, loader)
    return _result(module, trainer.optimizers[0], wrapper=module.seen[0],
                   grads_alive=module.grads_alive)


TOOLS: dict[str, tuple[dict[str, dict[str, Any]], Callable[..., dict[str, Any]]]] = {
    "accelerate": (ACCELERATE, _accelerate),
    "hf": (HF, _hf),
    "lightning": (LIGHTNING, _lightning),
}


def main() -> None:
    tool, out_dir = sys.argv[1], sys.argv[2]
    warnings.filterwarnings("ignore")
    cases, run = TOOLS[tool]
    results: dict[str, Any] = {}
    for name, kw in cases.items():
        for kind in ("layeropt",) if kw.get("callback") or kw.get("refused") else ("torch",
                                                                                   "layeropt"):
            try:
                results[f"{name}/{kind}"] = run(kind, **kw)
            except Exception as e:  # noqa: BLE001 - the test reports it
                results[f"{name}/{kind}"] = {"error": f"{type(e).__name__}: {e}",
                                             "trace": traceback.format_exc()}
    rank = int(os.environ["RANK"])
    torch.save(results, os.path.join(out_dir, f"{tool}-rank{rank}.pt"))
    leave_rank()


if __name__ == "__main__":
    main()
