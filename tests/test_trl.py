"""TRL's trainers with ``LayeroptTrainer`` mixed in equal the same trainers + torch.optim.

``class LayeroptSFTTrainer(LayeroptTrainer, SFTTrainer)`` (docs/integrations.md),
and the same for ``DPOTrainer`` and ``GRPOTrainer``: the same run - a tiny Llama
built from a config, a word-level tokenizer built in memory, a dataset the trainer
tokenizes itself (SFT's texts, DPO's preference pairs against a reference model,
GRPO's prompts with completions generated and rewarded by a function), gradient
accumulation and ``max_grad_norm`` - trained with the trainer and
``optim="adamw_torch"``, and with the mixed class (which builds ``layeropt.AdamW``
from the same ``args.optim``). SFT with its default activation checkpointing, with
and without ``offload_state``; DPO with activation checkpointing too; GRPO with
several updates per generation (``num_iterations``) over buffered generations
(``steps_per_generation``). Parameters, optimizer state and logged gradient norms
are compared bit for bit. No network (Hugging Face's offline switches are set).
Skipped without trl (``pip install -e ".[hf]"`` installs it).
"""

from __future__ import annotations

import copy
import os

import pytest
import torch
from harness import assert_same

for _switch in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE"):
    os.environ.setdefault(_switch, "1")

trl = pytest.importorskip("trl")
pytest.importorskip("datasets")
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import (  # noqa: E402
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedTokenizerFast,
    TrainerCallback,
)
from transformers.utils import logging as hf_logging  # noqa: E402
try:  # trl imports its trainers lazily: one that needs a newer torch fails only here
    from trl import (DPOConfig, DPOTrainer, GRPOConfig, GRPOTrainer,  # noqa: E402
                     SFTConfig, SFTTrainer)
except (ImportError, RuntimeError) as e:  # (torch 2.4: trl's activation checkpointing)
    pytest.skip(f"trl's SFTTrainer does not import with torch {torch.__version__}: {e}",
                allow_module_level=True)

import layeropt  # noqa: E402
from layeropt.integrations.hf import LayeroptTrainer, unwrap_optimizer  # noqa: E402

hf_logging.set_verbosity_error()
# trl's SFTConfig sets the field transformers 5 renamed (its own notice, not layeropt's)
pytestmark = [pytest.mark.filterwarnings("ignore:`gradient_checkpointing` is deprecated"),
              pytest.mark.filterwarnings("ignore:`gradient_checkpointing_enable` is deprecated")]
WORDS = [f"w{i}" for i in range(60)]


class LayeroptSFTTrainer(LayeroptTrainer, SFTTrainer):
    """The class docs/integrations.md shows."""


class LayeroptDPOTrainer(LayeroptTrainer, DPOTrainer):
    """The same for DPO."""


class LayeroptGRPOTrainer(LayeroptTrainer, GRPOTrainer):
    """The same for GRPO."""


def _tokenizer() -> PreTrainedTokenizerFast:
    specials = ["<pad>", "<unk>", "<s>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>",
                                   bos_token="<s>", eos_token="</s>")


def _words(gen: torch.Generator, low: int, high: int) -> str:
    """A row of ``low`` to ``high - 1`` random words (uneven rows: padding too)."""
    n = int(torch.randint(low, high, (), generator=gen))
    return " ".join(WORDS[i] for i in torch.randint(0, len(WORDS), (n,), generator=gen))


def _dataset(kind: str, n: int = 10) -> Dataset:
    """SFT's texts, DPO's preference pairs or GRPO's prompts."""
    gen = torch.Generator().manual_seed(0)
    columns = {"sft": {"text": (6, 15)}, "grpo": {"prompt": (3, 7)},
               "dpo": {"prompt": (3, 7), "chosen": (2, 6), "rejected": (2, 6)}}[kind]
    return Dataset.from_list([{c: _words(gen, *r) for c, r in columns.items()}
                              for _ in range(n)])


def _reward(completions: list[str], **kwargs: object) -> list[float]:
    """GRPO's reward: longer completions are better."""
    return [len(c) / 10 for c in completions]


class _Probe(TrainerCallback):
    """Counts the gradients backward left behind at each optimizer step."""

    def __init__(self) -> None:
        self.grads_alive: list[int] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads_alive.append(sum(p.grad is not None for p in model.parameters()))


# kind: (trainer, config class, the config's own options, the trainer's own arguments)
KINDS: dict[str, tuple[type, type, dict[str, object], dict[str, object]]] = {
    "sft": (SFTTrainer, SFTConfig, dict(max_length=32), {}),
    "dpo": (DPOTrainer, DPOConfig, dict(max_length=32, gradient_checkpointing=True), {}),
    "grpo": (GRPOTrainer, GRPOConfig, dict(per_device_train_batch_size=4, num_generations=4,
                                           max_completion_length=8, num_iterations=2,
                                           steps_per_generation=4),
             dict(reward_funcs=_reward)),
}
MIXED = {SFTTrainer: LayeroptSFTTrainer, DPOTrainer: LayeroptDPOTrainer,
         GRPOTrainer: LayeroptGRPOTrainer}


def _train(tmp_path, kind: str, layer: bool, **extra) -> tuple[SFTTrainer, torch.nn.Module,
                                                                 _Probe]:
    """``kind``'s run (``KINDS``) with torch.optim, or (``layer``) with the mixed class."""
    trainer_cls, config_cls, options, own = KINDS[kind]
    cls = MIXED[trainer_cls] if layer else trainer_cls
    torch.manual_seed(0)
    tokenizer = _tokenizer()
    tokenizer.padding_side = "left" if kind == "grpo" else "right"  # (generation: left)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id))
    if kind == "dpo":  # (the reference model: the policy as it starts)
        own = {**own, "ref_model": copy.deepcopy(model)}
    args = config_cls(**{
        **dict(output_dir=str(tmp_path / cls.__name__), max_steps=3,
               per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.5,
               learning_rate=1e-2, optim="adamw_torch", lr_scheduler_type="cosine",
               warmup_steps=1, logging_steps=1, seed=0, report_to=[], use_cpu=True, bf16=False,
               disable_tqdm=True, save_strategy="no"), **options})
    probe = _Probe()
    trainer = cls(model=model, args=args, train_dataset=_dataset(kind),
                  processing_class=tokenizer, callbacks=[probe], **own, **extra)
    trainer.train()
    return trainer, model, probe


def _norms(trainer: SFTTrainer) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


@pytest.mark.parametrize("kind,offload", [("sft", False), ("sft", True), ("dpo", False),
                                          ("grpo", False)],
                         ids=["sft", "sft-offload_state", "dpo", "grpo"])
def test_trl_trainer_with_layeropt_matches_torch_optim(tmp_path, kind, offload):
    ref_trainer, ref, ref_probe = _train(tmp_path, kind, False)
    trainer, model, probe = _train(tmp_path, kind, True, bucket_cap_mb=0, offload_state=offload)
    opt = unwrap_optimizer(trainer.optimizer)
    assert isinstance(opt, layeropt.AdamW)  # built from args.optim, in backward
    assert trainer.state.global_step == ref_trainer.state.global_step == 3
    assert probe.grads_alive == [0, 0, 0]  # every layer stepped and freed in backward
    assert all(n > 0 for n in ref_probe.grads_alive)
    assert (trainer.layeropt_offload is not None) is offload
    if kind != "grpo":  # (SFT's default, DPO's by its config; transformers 5 renamed it)
        for m in (model, ref):
            assert getattr(m, "is_activation_checkpointing", None) or m.is_gradient_checkpointing
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), name)
    assert_same(opt.state_dict(), unwrap_optimizer(ref_trainer.optimizer).state_dict())
    norms = _norms(trainer)
    assert len(norms) == 3 and norms == _norms(ref_trainer)
    assert max(norms) > 0.5  # clipping was active on some step
