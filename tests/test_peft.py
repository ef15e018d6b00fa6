"""PEFT's LoRA adapters trained with layeropt: the parameters and optimizer state of the
same loop or Trainer with torch.optim, bit for bit.

A tiny ``LlamaForCausalLM`` (built from a config, no download) with LoRA on its
attention's ``q_proj`` and ``v_proj`` (``peft.get_peft_model``): the base model frozen,
only the adapters train. Each case trains it twice from the same seed and data, with
torch.optim and with layeropt. Skipped when peft or transformers is not installed.
"""

from __future__ import annotations

import tempfile
import warnings
from typing import Any

import pytest
import torch
from harness import assert_same

import layeropt

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging  # noqa: E402

from layeropt.integrations.hf import (  # noqa: E402
    LayeroptCallback,
    LayeroptTrainer,
    unwrap_optimizer,
)

hf_logging.set_verbosity_error()
VOCAB = 64


def lora_model() -> Any:
    """The tiny Llama with LoRA adapters (rank 4) on q_proj and v_proj."""
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=True)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.0)
    return peft.get_peft_model(LlamaForCausalLM(cfg), config)


def rows(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    ids = [torch.randint(0, VOCAB, (16,), generator=gen) for _ in range(n)]
    return [{"input_ids": x, "labels": x} for x in ids]


def trained(model: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


class _Grads(TrainerCallback):
    """How many gradients backward left alive before each optimizer step."""

    def __init__(self) -> None:
        self.alive: list[int] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.alive.append(sum(p.grad is not None for p in model.parameters()))


# (how layeropt joins the Trainer, TrainingArguments beyond the common ones)
CASES = [
    ("trainer", dict(gradient_accumulation_steps=1)),
    ("trainer", dict(gradient_accumulation_steps=2, max_grad_norm=0.5)),
    ("trainer", dict(gradient_accumulation_steps=2, max_grad_norm=0.5, optim="sgd")),
    # checkpointing: peft makes the embeddings' output require grad for the reentrant kind
    ("trainer", dict(gradient_accumulation_steps=2, max_grad_norm=0.5, gradient_checkpointing=True,
                     gradient_checkpointing_kwargs={"use_reentrant": True})),
    ("trainer", dict(gradient_accumulation_steps=3, gradient_checkpointing=True,
                     gradient_checkpointing_kwargs={"use_reentrant": False})),
    ("callback", dict(gradient_accumulation_steps=2)),
]


@pytest.mark.parametrize("kind,targs", CASES, ids=[
    f"{k}-{'-'.join(f'{a}={b}' for a, b in t.items() if a != 'gradient_checkpointing_kwargs')}"
    for k, t in CASES])
def test_lora_in_the_trainer_matches_torch_optim(kind, targs):
    reentrant = targs.get("gradient_checkpointing_kwargs", {}).get("use_reentrant")
    if reentrant and int(transformers.__version__.split(".")[0]) < 5:
        pytest.skip("transformers 4's Trainer checkpoints a PEFT model's frozen inputs "
                    "reentrantly without enable_input_require_grads: torch.optim's run fails")
    runs = {}
    for side in ("torch", "layeropt"):
        model, probe = lora_model(), _Grads()
        args = TrainingArguments(
            output_dir=tempfile.mkdtemp(), max_steps=3, per_device_train_batch_size=2,
            learning_rate=1e-2, lr_scheduler_type="linear", logging_steps=1, seed=0,
            report_to=[], use_cpu=True, disable_tqdm=True, save_strategy="no",
            **{"max_grad_norm": 0.0, **targs})
        common = dict(model=model, args=args, train_dataset=rows(12), callbacks=[probe])
        if kind == "callback":  # (it needs the optimizer handed to the Trainer: both sides)
            cls = torch.optim.AdamW if side == "torch" else layeropt.AdamW
            common["optimizers"] = (cls([p for p in model.parameters() if p.requires_grad],
                                        lr=1e-2), None)
        if side == "torch":
            trainer = Trainer(**common)
        elif kind == "trainer":
            trainer = LayeroptTrainer(**common)
        else:
            common["callbacks"].append(LayeroptCallback())
            trainer = Trainer(**common)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the callback: no norm measured, said)
            trainer.train()
        runs[side] = trainer, model, probe
    (ref_trainer, ref, ref_probe), (trainer, model, probe) = runs["torch"], runs["layeropt"]
    assert trainer.state.global_step == ref_trainer.state.global_step == 3
    assert probe.alive == [0, 0, 0] and min(ref_probe.alive) > 0  # stepped in backward
    ours, theirs = trained(model), trained(ref)
    assert len(ours) == 8  # A and B of q_proj and v_proj in two layers
    assert any(n.endswith("lora_B.default.weight") and v.abs().sum() > 0 for n, v in ours.items())
    assert_same(ours, theirs)
    assert_same(unwrap_optimizer(trainer.optimizer).state_dict(),
                unwrap_optimizer(ref_trainer.optimizer).state_dict())
    if targs.get("max_grad_norm"):
        norms = [[h["grad_norm"] for h in t.state.log_history if "grad_norm" in h]
                 for t in (ref_trainer, trainer)]
        assert len(norms[0]) == 3 and norms[0] == norms[1]


@pytest.mark.parametrize("bucket_cap_mb", [0.0, 1.0], ids=["strict", "library-default"])
def test_lora_in_a_plain_loop_matches_torch_optim(bucket_cap_mb):
    """An optimizer over the adapters alone, the whole PEFT model attached; the frozen base
    gets no gradient, the adapters' are freed in backward."""
    results = []
    for layer in (False, True):
        model = lora_model()
        params = [p for p in model.parameters() if p.requires_grad]
        opt = (layeropt.AdamW if layer else torch.optim.AdamW)(params, lr=1e-2, weight_decay=0.1)
        handle = layeropt.attach(model, opt, bucket_cap_mb=bucket_cap_mb) if layer else None
        for batch in rows(8)[::2]:
            ids = batch["input_ids"][None]
            model(input_ids=ids, labels=ids).loss.backward()
            if layer:
                assert all(p.grad is None for p in model.parameters())
            opt.step()
            opt.zero_grad()
        if handle is not None:
            handle.remove()
        results.append((trained(model), opt.state_dict()))
    assert_same(results[1], results[0])
