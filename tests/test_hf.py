"""Hugging Face models and ``Trainer`` with layeropt: same parameters as torch.optim.

Tiny models built from a config (no download). Every comparison trains two
copies from the same seed and data, one with ``torch.optim``, one with the
layeropt class attached, and compares parameters bit for bit unless a case
says why not. Skipped when transformers / accelerate are not installed.
"""

from __future__ import annotations

import copy
import functools
import importlib.util
import warnings
from typing import Any

import pytest
import torch
from harness import REPRESENTATIVE, TORCH, assert_same, config_id

import layeropt
from layeropt.memory import PeakMemory

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")
from transformers import (  # noqa: E402
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
    T5Config,
    T5ForConditionalGeneration,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)
from transformers.utils import logging as hf_logging  # noqa: E402

from layeropt.integrations.hf import (  # noqa: E402
    LayeroptCallback,
    LayeroptTrainer,
    TrainerSetupError,
    unwrap_optimizer,
)

# transformers 5 measures the norm after backward when not clipping (4.x logs none)
_MEASURES_NORM = hasattr(Trainer, "_get_grad_norm")

hf_logging.set_verbosity_error()
VOCAB = 64


def _llama(layers: int = 2, width: int = 32) -> torch.nn.Module:
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=width, intermediate_size=2 * width,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=64, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg)


def _gpt2() -> torch.nn.Module:
    cfg = GPT2Config(vocab_size=VOCAB, n_positions=32, n_embd=32, n_layer=2, n_head=4,
                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return GPT2LMHeadModel(cfg)


ARCHS = {"llama": _llama, "gpt2": _gpt2}


def _batches(n: int, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, VOCAB, (2, 16), generator=gen) for _ in range(n)]


def _enable_checkpointing(model: Any, kwargs: dict[str, Any] | None) -> bool:
    """Turn on HF activation checkpointing; return whether it is reentrant."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    funcs = [m._gradient_checkpointing_func for m in model.modules()
             if isinstance(getattr(m, "_gradient_checkpointing_func", None), functools.partial)]
    assert funcs, "no module got a checkpointing function"
    return bool(funcs[0].keywords.get("use_reentrant", True))


def _train_plain(model: Any, opt: torch.optim.Optimizer, steps: int = 3) -> None:
    model.train()
    for ids in _batches(steps):
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()


# -- a Hugging Face model in a plain loop --------------------------------------
# The shared table's first two (SGD with momentum, AdamW): each case trains two HF models.
@pytest.mark.parametrize("arch", sorted(ARCHS))
@pytest.mark.parametrize("cfg", REPRESENTATIVE[:2], ids=config_id)
def test_hf_model_matches_torch_optim(arch, cfg):
    opt_name, kw = cfg
    model = ARCHS[arch]()
    ref = copy.deepcopy(model)
    ref_opt = getattr(torch.optim, opt_name)(ref.parameters(), **kw)
    _train_plain(ref, ref_opt)
    opt = getattr(layeropt, opt_name)(model.parameters(), **kw)
    with layeropt.attach(model, opt):
        _train_plain(model, opt)
        assert opt.stepped_in_backward == len(list(model.parameters()))
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), name)
    assert_same(opt.state_dict(), ref_opt.state_dict())


def test_hf_t5_with_layeropt_reentrant_checkpoint_is_exact():
    """T5 makes its position bias a requires_grad leaf inside each checkpointed block."""
    cfg = T5Config(vocab_size=VOCAB, d_model=16, d_kv=4, d_ff=32, num_layers=2,
                   num_decoder_layers=2, num_heads=4, dropout_rate=0.0,
                   decoder_start_token_id=0, pad_token_id=0)
    torch.manual_seed(0)
    model = T5ForConditionalGeneration(cfg)
    ref = copy.deepcopy(model)
    for m in (model, ref):  # route HF's checkpointing through layeropt.checkpoint
        _enable_checkpointing(m, {"use_reentrant": True})
        for module in m.modules():
            if isinstance(getattr(module, "_gradient_checkpointing_func", None),
                          functools.partial):
                module._gradient_checkpointing_func = functools.partial(
                    layeropt.checkpoint, use_reentrant=True)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    opt = layeropt.AdamW(model.parameters(), lr=1e-2)
    _train_plain(ref, ref_opt)
    with layeropt.attach(model, opt):
        _train_plain(model, opt)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), name)


LAYEROPT_DEFERS = "nested backward"  # layeropt's warning under torch's reentrant checkpoint


@pytest.mark.parametrize("ckpt_kwargs", [{"use_reentrant": True}, {"use_reentrant": False}, None],
                         ids=["reentrant", "non_reentrant", "hf_default"])
def test_hf_gradient_checkpointing_is_exact(ckpt_kwargs):
    """``gradient_checkpointing_enable``: exact; reentrant warns that it saves nothing."""
    model = _llama()
    ref = copy.deepcopy(model)
    reentrant = _enable_checkpointing(model, ckpt_kwargs)
    _enable_checkpointing(ref, ckpt_kwargs)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train_plain(ref, ref_opt)
    opt = layeropt.AdamW(model.parameters(), lr=1e-2)
    with layeropt.attach(model, opt), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        _train_plain(model, opt)
        assert opt.stepped_in_backward == len(list(model.parameters()))
    deferred = [w for w in caught if LAYEROPT_DEFERS in str(w.message)]
    assert bool(deferred) == reentrant
    assert all(w.category is UserWarning for w in deferred)
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach())


def _step_peak(model: Any, opt: torch.optim.Optimizer) -> int:
    ids = _batches(1)[0]

    def step() -> None:
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
        opt.zero_grad()

    step()  # optimizer state exists from here on
    with PeakMemory() as mem:
        step()
    return mem.peak


def test_hf_checkpointing_memory():
    """Bytes of one step: non-reentrant checkpointing keeps the in-backward saving."""
    peaks: dict[tuple[str, bool], int] = {}
    for kind in ("torch", "layeropt"):
        for reentrant in (False, True):
            torch.manual_seed(0)
            model = _llama(layers=4, width=64)
            model.train()
            _enable_checkpointing(model, {"use_reentrant": reentrant})
            cls = torch.optim.AdamW if kind == "torch" else layeropt.AdamW
            opt = cls(model.parameters(), lr=1e-3)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                if kind == "layeropt":
                    with layeropt.attach(model, opt):
                        peaks[kind, reentrant] = _step_peak(model, opt)
                else:
                    peaks[kind, reentrant] = _step_peak(model, opt)
    grad_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # measured: torch 913,864 B, layeropt 534,036 B (gradients: 657,664 B)
    assert peaks["layeropt", False] + grad_bytes // 2 < peaks["torch", False]
    # torch's reentrant checkpoint: exact by deferring every step, so no saving
    assert peaks["layeropt", True] >= peaks["torch", True]
    assert peaks["layeropt", True] > peaks["layeropt", False]


# -- Trainer --------------------------------------------------------------------
def _dataset(n: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(0, VOCAB, (16,), generator=gen) for _ in range(n)]
    return [{"input_ids": r, "labels": r} for r in rows]


class _Probe(TrainerCallback):
    """Records, before each optimizer step, what backward left behind."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.grads_alive: list[int] = []
        self.stepped: list[int] = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads_alive.append(sum(p.grad is not None for p in model.parameters()))
        opt = unwrap_optimizer(self.trainer.optimizer)
        self.stepped.append(getattr(opt, "stepped_in_backward", -1))


class _TorchTrainer(Trainer):
    """The reference when a GradScaler is forced onto the CPU accelerator (see the test)."""

    def _get_grad_norm(self, model, grad_norm=None):
        return grad_norm


def _trainer(tmp_path: Any, kind: str, *, ga: int = 2, max_grad_norm: float = 0.0,
             steps: int = 3, n: int = 10, optim: str | None = None, save_steps: int = 0,
             torch_trainer: type = Trainer, user_scheduler: bool = False, width: int = 32,
             offload_state: Any = False, verify: int | None = None,
             **targs: Any) -> tuple[Any, Any, _Probe]:
    """Build one of the Trainer set-ups under test (not trained yet)."""
    torch.manual_seed(0)
    model = _llama(width=width)
    args = TrainingArguments(
        output_dir=str(tmp_path / kind), max_steps=steps, per_device_train_batch_size=2,
        gradient_accumulation_steps=ga, learning_rate=1e-2, max_grad_norm=max_grad_norm,
        lr_scheduler_type="cosine", warmup_steps=1, logging_steps=1, seed=0,
        report_to=[], use_cpu=True, disable_tqdm=True,
        save_strategy="steps" if save_steps else "no", save_steps=save_steps or 500,
        **({"optim": optim} if optim else {}), **targs,
    )
    probe = _Probe()
    common = dict(model=model, args=args, train_dataset=_dataset(n), callbacks=[probe])

    def optimizers(opt: torch.optim.Optimizer) -> tuple[Any, Any]:
        sched = torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5) if user_scheduler else None
        return opt, sched

    if kind == "torch":
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        trainer = torch_trainer(**common, optimizers=optimizers(opt))
    elif kind == "torch-built":
        trainer = Trainer(**common)
    elif kind == "layeropt":
        opt = layeropt.AdamW(model.parameters(), lr=1e-2)
        trainer = LayeroptTrainer(**common, optimizers=optimizers(opt), bucket_cap_mb=0,
                                  offload_state=offload_state, verify=verify)
    elif kind == "layeropt-torch-optimizer":  # refused
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        trainer = LayeroptTrainer(**common, optimizers=(opt, None))
    elif kind == "layeropt-built":
        trainer = LayeroptTrainer(**common, bucket_cap_mb=0, offload_state=offload_state)
    elif kind == "callback":
        opt = layeropt.AdamW(model.parameters(), lr=1e-2)
        common["callbacks"].append(LayeroptCallback(bucket_cap_mb=0, verify=verify))
        trainer = Trainer(**common, optimizers=optimizers(opt))
    elif kind == "attached-plain":  # what not to do: attach and hand to a plain Trainer
        opt = layeropt.AdamW(model.parameters(), lr=1e-2)
        trainer = Trainer(**common, optimizers=(opt, None))
        trainer.handle = layeropt.attach(model, opt)
    else:
        raise ValueError(kind)
    probe.trainer = trainer
    return trainer, model, probe


def _grad_norms(trainer: Any) -> list[float]:
    return [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]


_CKPT_ARG = ("activation_checkpointing"  # transformers >= 5; gradient_* before
             if "activation_checkpointing" in TrainingArguments.__dataclass_fields__
             else "gradient_checkpointing")

# (layeropt set-up, reference, options): parameters and logged norms bit for bit
TRAINER_CASES = [
    ("layeropt", "torch", dict(ga=2)),
    ("layeropt", "torch", dict(ga=2, max_grad_norm=0.5)),  # clipping active (norms ~1.1)
    ("layeropt", "torch", dict(ga=3, max_grad_norm=1.0)),  # 5 micro-batches/epoch: 3 + 2
    ("layeropt", "torch", dict(ga=1, max_grad_norm=0.1)),
    ("layeropt", "torch", dict(ga=2, bf16=True)),
    ("layeropt", "torch", dict(ga=2, max_grad_norm=0.5, user_scheduler=True)),
    ("layeropt", "torch", dict(ga=2, **{_CKPT_ARG: True,
                                        f"{_CKPT_ARG}_kwargs": {"use_reentrant": False}})),
    ("callback", "torch", dict(ga=2)),  # 5 micro-batches/epoch: 2 + 2 + 1
    ("callback", "torch", dict(ga=3)),  # 3 + 2
    ("callback", "torch", dict(ga=2, user_scheduler=True)),
    ("layeropt-built", "torch-built", dict(ga=2)),
    ("layeropt-built", "torch-built", dict(ga=2, optim="sgd")),
    ("layeropt-built", "torch-built", dict(ga=2, optim="adafactor")),  # transformers' own
    ("layeropt-built", "torch-built", dict(ga=2, optim="rmsprop", max_grad_norm=0.5)),
    *([("layeropt-built", "torch-built", dict(ga=2, optim="schedule_free_adamw",
                                             max_grad_norm=0.5))]
      if importlib.util.find_spec("schedulefree") else []),
    # bitsandbytes: the Trainer gives embeddings 32-bit state when "bitsandbytes" is in
    # str(optimizer class); in_backward's class answers as the class it wraps
    # (width 128: the embedding is large enough for bitsandbytes' 8-bit state)
    *([("layeropt-built", "torch-built", dict(ga=2, optim="adamw_bnb_8bit", width=128))]
      if importlib.util.find_spec("bitsandbytes") else []),
    # Trainer's two param groups (decay / no decay) hold the parameters in another
    # order than model.parameters(), whose order clip_grad_norm_ sums the norms in:
    # LayeroptTrainer measures in that order too (bit for bit).
    ("layeropt-built", "torch-built", dict(ga=2, max_grad_norm=0.5)),
    ("layeropt-built", "torch-built", dict(ga=1, max_grad_norm=0.1, weight_decay=0.1)),
]


@pytest.mark.parametrize("kind,ref_kind,opts", TRAINER_CASES,
                         ids=[f"{k}-{'-'.join(f'{a}={b}' for a, b in o.items())}"
                              for k, _, o in TRAINER_CASES])
def test_trainer_matches_torch_optim(tmp_path, kind, ref_kind, opts):
    ref_trainer, ref, ref_probe = _trainer(tmp_path, ref_kind, **opts)
    ref_trainer.train()
    trainer, model, probe = _trainer(tmp_path, kind, **opts)
    if kind == "callback" and _MEASURES_NORM:  # plain Trainer logs clip_grad_norm_(inf): said
        with pytest.warns(UserWarning, match="norm is not measured"):
            trainer.train()
    else:
        trainer.train()
    assert trainer.state.global_step == ref_trainer.state.global_step == 3
    assert isinstance(unwrap_optimizer(trainer.optimizer), layeropt.InBackwardOptimizer)
    n_params = len(list(model.parameters()))
    assert probe.grads_alive == [0, 0, 0]  # all stepped and freed in backward
    assert all(s > 0 for s in ref_probe.grads_alive)  # torch still holds every gradient
    assert probe.stepped == [n_params] * 3
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), name)
    assert not unwrap_optimizer(trainer.optimizer).attached  # detached when train() ended
    if opts.get("max_grad_norm", 0) > 0:
        norms, ref_norms = _grad_norms(trainer), _grad_norms(ref_trainer)
        assert len(norms) == 3
        assert norms == ref_norms


@pytest.mark.parametrize("ga", [1, 2])
def test_trainer_without_clipping_reports_grad_norm_none(tmp_path, ga):
    """docs/integrations.md: with ``max_grad_norm=0`` LayeroptTrainer measures no norm:
    the ``grad_norm`` the Trainer hands to its logging is ``None`` and no log has one,
    where the Trainer with torch.optim measures one after backward (transformers 5;
    4.x logs none either). The parameters and logged losses are torch.optim's, bit for
    bit."""
    runs = {}
    for kind in ("torch", "layeropt"):
        trainer, model, _ = _trainer(tmp_path, kind, ga=ga, max_grad_norm=0.0)
        reported: list[Any] = []
        log = trainer._maybe_log_save_evaluate

        def recording(*args: Any, log=log, reported=reported, **kwargs: Any) -> Any:
            reported.append(args[1] if len(args) > 1 else kwargs["grad_norm"])
            return log(*args, **kwargs)

        trainer._maybe_log_save_evaluate = recording
        trainer.train()
        assert trainer.state.global_step == 3 and len(reported) >= 3  # (again at the end)
        runs[kind] = trainer, model, reported
    (ref_trainer, ref, ref_reported), (trainer, model, reported) = runs["torch"], runs["layeropt"]
    assert len(reported) == len(ref_reported) and set(reported) == {None}
    assert _grad_norms(trainer) == []
    if _MEASURES_NORM:  # the plain Trainer's norm-only clip_grad_norm_(inf) after backward
        assert None not in ref_reported and len(_grad_norms(ref_trainer)) == 3
        assert all(isinstance(n, float) and n > 0 for n in _grad_norms(ref_trainer))
    else:
        assert set(ref_reported) == {None} and _grad_norms(ref_trainer) == []
    losses = [[h["loss"] for h in t.state.log_history if "loss" in h]
              for t in (ref_trainer, trainer)]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), name)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    return sum(v.nbytes for s in opt.state.values() for v in s.values() if v.dim() > 0)


@pytest.mark.parametrize("kind,ref_kind,opts", [
    ("layeropt", "torch", dict(ga=2, max_grad_norm=0.5)),
    ("layeropt-built", "torch-built", dict(ga=3, max_grad_norm=1.0, bf16=True)),
], ids=["ga2-clip", "built-ga3-clip-bf16"])
def test_trainer_offload_state(tmp_path, kind, ref_kind, opts):
    """``LayeroptTrainer(offload_state=True)``: the parameters and optimizer state of the
    same Trainer without offload and of Trainer + torch.optim, bit for bit; the state
    lives in host tensors that every step copies to the device and back."""
    runs = {}
    for name, k, offload in (("torch", ref_kind, False), ("layeropt", kind, False),
                             ("offload", kind, True)):
        trainer, model, probe = _trainer(tmp_path / name, k, offload_state=offload, **opts)
        trainer.train()
        runs[name] = trainer, model, unwrap_optimizer(trainer.optimizer), probe
    trainer, model, opt, probe = runs["offload"]
    assert probe.grads_alive == [0, 0, 0]  # still stepped and freed in backward
    handle = trainer.layeropt_offload
    assert handle is not None and handle.optimizer is opt
    assert handle.host_bytes == _state_bytes(opt) > 0  # every state tensor is a host copy
    assert 0 < handle.peak_device_bytes < handle.host_bytes  # one layer's state at a time
    assert handle.copied_bytes >= 4 * handle.host_bytes  # steps 2 and 3: in and out
    held = handle.held  # the accumulated micro-batches waited in host memory
    assert held.down_bytes > 0 and held.up_bytes > 0 and len(held) == 0
    for name in ("layeropt", "torch"):
        _, ref, ref_opt, _ = runs[name]
        for (pname, p), q in zip(model.named_parameters(), ref.parameters()):
            assert_same(p.detach(), q.detach(), f"{name}: {pname}")
        assert_same(opt.state_dict(), ref_opt.state_dict(), name)
    assert _grad_norms(trainer) == _grad_norms(runs["torch"][0])


@pytest.mark.skipif(TORCH < (2, 6), reason="transformers' torch.load needs torch >= 2.6")
def test_trainer_offload_state_resumes_exactly(tmp_path):
    """A checkpoint's optimizer.pt loads into host memory and training continues exactly."""
    opts = dict(ga=2, max_grad_norm=0.5, steps=4, save_steps=2)
    ref_trainer, ref, _ = _trainer(tmp_path, "torch", **opts)
    ref_trainer.train()
    first, _, _ = _trainer(tmp_path, "layeropt", offload_state=True, **opts)
    first.train()
    resumed, model, _ = _trainer(tmp_path / "again", "layeropt", offload_state=True, **opts)
    resumed.train(resume_from_checkpoint=str(tmp_path / "layeropt" / "checkpoint-2"))
    assert resumed.state.global_step == 4
    opt = unwrap_optimizer(resumed.optimizer)
    assert resumed.layeropt_offload.host_bytes == _state_bytes(opt) > 0
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach())
    assert_same(opt.state_dict(), ref_trainer.optimizer.state_dict())


class _Unfreeze(TrainerCallback):
    """Gradual unfreezing: decoder layer 0 trains from optimizer step 2 on."""

    def on_step_begin(self, args, state, control, model=None, **kwargs):
        model.model.layers[0].requires_grad_(state.global_step >= 2)


@pytest.mark.parametrize("ga", [1, 2])
def test_trainer_with_layers_unfrozen_mid_training(tmp_path, ga):
    """Clipping measures the unfrozen layer's gradient too (its first step included)."""
    runs = []
    for kind in ("torch", "layeropt"):
        trainer, model, _ = _trainer(tmp_path, kind, ga=ga, max_grad_norm=0.5, steps=4)
        model.model.layers[0].requires_grad_(False)
        trainer.add_callback(_Unfreeze())
        trainer.train()
        runs.append((model, _grad_norms(trainer)))
    (ref, ref_norms), (model, norms) = runs
    assert len(norms) == 4 and norms == ref_norms
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), name)


class _Clamp(TrainerCallback):
    """Weights clamped in place (WGAN's weight clipping) before each optimizer step."""

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.05, 0.05)


@pytest.mark.parametrize("kind", ["layeropt", "callback"])
def test_weights_clamped_before_the_optimizer_step_are_refused(tmp_path, kind):
    """``on_pre_optimizer_step`` runs between backward and the step: torch's step updates
    the clamped weights, the attached backward updated them before the clamp - refused
    at the step (silent before 2026-12-07); the same callback trains under torch."""
    for name in ("torch", kind):
        trainer, _, _ = _trainer(tmp_path, name, ga=2)
        trainer.add_callback(_Clamp())
        if name == "torch":
            trainer.train()
            continue
        with pytest.raises(layeropt.BackwardStateError, match="written in place after"):
            trainer.train()


@pytest.mark.filterwarnings("ignore:.*the norm is not measured")  # its grad_norm logging
@pytest.mark.parametrize("ga, max_grad_norm, error", [
    (2, 0.0, layeropt.BackwardStateError),  # every micro-batch would step
    (1, 1.0, layeropt.LayeroptError),  # the Trainer's default clipping would clip nothing
])
def test_plain_trainer_with_attached_optimizer_refuses(tmp_path, ga, max_grad_norm, error):
    """Attached + plain Trainer with accumulation or clipping: an error at the first step."""
    trainer, model, _ = _trainer(tmp_path, "attached-plain", ga=ga, max_grad_norm=max_grad_norm)
    with pytest.raises(error, match="LayeroptTrainer"):
        trainer.train()
    trainer.handle.remove()
    assert trainer.state.global_step == 0


@pytest.mark.skipif(TORCH < (2, 6), reason="transformers' torch.load needs torch >= 2.6")
def test_trainer_checkpoint_resume(tmp_path):
    """optimizer.pt is torch's state dict: resume is exact, across torch and layeropt too."""
    opts = dict(ga=2, max_grad_norm=0.5, steps=4, save_steps=2)
    ref_trainer, ref, _ = _trainer(tmp_path, "torch", **opts)
    ref_trainer.train()
    first, _, _ = _trainer(tmp_path, "layeropt", **opts)
    first.train()
    ckpt = tmp_path / "layeropt" / "checkpoint-2"
    state = torch.load(ckpt / "optimizer.pt", weights_only=True)
    assert len(state["state"]) == len(list(ref.parameters()))  # Adam moments were saved
    for kind in ("layeropt", "torch"):  # resume layeropt's checkpoint with either
        resumed, model, _ = _trainer(tmp_path / "again", kind, **opts)
        resumed.train(resume_from_checkpoint=str(ckpt))
        assert resumed.state.global_step == 4
        for p, q in zip(model.parameters(), ref.parameters()):
            assert_same(p.detach(), q.detach())


@pytest.mark.parametrize("ga", [1, 2])
def test_trainer_grad_scaler(tmp_path, ga):
    """fp16's GradScaler path (inf -> skipped step, scale halved) gives torch's result.

    accelerate creates a GradScaler only for fp16 on a GPU; here one is put on
    the CPU accelerator by hand, with a scale so large that the first steps
    overflow. The reference skips Trainer's unclipped norm for logging, which on
    CPU would be taken of the still-scaled gradients (on a GPU they are unscaled
    first) and overflow into NaN.
    """
    results = {}
    for kind in ("torch", "layeropt"):
        trainer, model, _ = _trainer(tmp_path, kind, ga=ga, steps=6, torch_trainer=_TorchTrainer)
        trainer.accelerator.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**126,
                                                          growth_interval=2)
        init = copy.deepcopy(model)
        trainer.train()
        results[kind] = model, trainer.accelerator.scaler.get_scale()
        changed = any(not torch.equal(p, q) for p, q in zip(model.parameters(), init.parameters()))
        assert changed  # some steps were taken
    (ref, ref_scale), (model, scale) = results["torch"], results["layeropt"]
    assert scale == ref_scale < 2.0**126  # and some were skipped
    for p, q in zip(model.parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach())


def test_layeropt_trainer_builds_layeropt_optimizer(tmp_path):
    trainer, _, _ = _trainer(tmp_path, "layeropt-built", optim="adamw_torch_fused")
    trainer.create_optimizer()
    opt = trainer.optimizer
    assert isinstance(opt, layeropt.AdamW) and isinstance(opt, torch.optim.AdamW)
    assert opt.defaults["fused"] is True
    assert [g["weight_decay"] for g in opt.param_groups] == [0.0, 0.0]


@pytest.mark.parametrize("kind,opts,match", [
    ("callback", dict(max_grad_norm=1.0), "max_grad_norm"),  # Trainer's default is 1.0
    ("callback", dict(fp16=True), "fp16"),
    ("layeropt-built", dict(optim="lomo"), "lomo"),
], ids=["callback-clipping", "callback-fp16", "lomo"])
def test_refused_settings(tmp_path, kind, opts, match):
    trainer, model, _ = _trainer(tmp_path, kind, **opts)
    before = copy.deepcopy(model)
    with pytest.raises(TrainerSetupError, match=match):
        trainer.train()
    for p, q in zip(model.parameters(), before.parameters()):
        assert_same(p.detach(), q.detach())  # nothing was updated


@pytest.mark.skipif(not importlib.util.find_spec("bitsandbytes"), reason="needs bitsandbytes")
def test_bitsandbytes_embeddings_keep_32_bit_state(tmp_path):
    """The Trainer special-cases bitsandbytes by str(optimizer class): embeddings get
    32-bit state. The in-backward class answers as bitsandbytes' own."""
    import bitsandbytes

    bitsandbytes.optim.GlobalOptimManager._instance = None  # no override left by other tests
    trainer, model, _ = _trainer(tmp_path, "layeropt-built", optim="adamw_bnb_8bit", width=128)
    trainer.train()
    opt = unwrap_optimizer(trainer.optimizer)
    state = opt.state[model.get_input_embeddings().weight]
    assert state["state1"].dtype == torch.float32  # (8-bit state would be uint8)
    assert opt.state[model.model.layers[0].mlp.up_proj.weight]["state1"].dtype == torch.uint8


def test_layeropt_trainer_refuses_torch_optimizer(tmp_path):
    trainer, _, _ = _trainer(tmp_path, "layeropt-torch-optimizer")
    with pytest.raises(TrainerSetupError, match="needs a layeropt optimizer") as raised:
        trainer.train()
    opt = trainer.optimizer  # the fix names the same optimizer, in backward
    name = type(getattr(opt, "optimizer", opt)).__name__
    assert f"optimizers=(layeropt.{name}(model.parameters()" in str(raised.value)


def test_callback_needs_layeropt_optimizer(tmp_path):
    trainer, _, _ = _trainer(tmp_path, "torch-built")
    trainer.add_callback(LayeroptCallback())
    with pytest.raises(TrainerSetupError, match="layeropt optimizer"):
        trainer.train()


@pytest.mark.skipif(TORCH < (2, 6), reason="transformers' masks do not compile on torch < 2.6")
def test_trainer_torch_compile_with_clipping(tmp_path):
    """``torch_compile=True`` + ``max_grad_norm``: layeropt.backward's two passes run the
    compiled graph twice (donated buffers off while training), bit for bit."""
    from torch._functorch import config as functorch_config

    runs = []
    for kind in ("torch", "layeropt"):
        torch._dynamo.reset()  # each run compiles its own graphs
        trainer, model, probe = _trainer(tmp_path, kind, ga=2, max_grad_norm=0.5,
                                         torch_compile=True, torch_compile_backend="aot_eager")
        trainer.train()
        runs.append((model, _grad_norms(trainer), probe))
    (ref, ref_norms, _), (model, norms, probe) = runs
    assert type(trainer.model_wrapped).__name__ == "OptimizedModule"
    assert probe.grads_alive == [0, 0, 0] and len(norms) == 3 and norms == ref_norms
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        assert_same(p.detach(), q.detach(), name)
    assert getattr(functorch_config, "donated_buffer", True)  # restored when train() ended


@pytest.mark.parametrize("ga", [1, 2])
def test_clipping_after_a_training_step_that_skipped_accelerator_backward_is_refused(
        tmp_path, ga):
    """max_grad_norm > 0 with a training_step calling loss.backward(): that backward
    stepped unclipped and the Trainer's clip returned the stale norm (silently); now the
    Trainer's clip call is refused."""
    class Mine(Trainer):  # the user's Trainer, then LayeroptTrainer mixed in before it
        def training_step(self, model: Any, inputs: Any, num_items_in_batch: Any = None) -> Any:
            model.train()
            loss = self.compute_loss(model, self._prepare_inputs(inputs))
            loss.backward()
            return loss.detach()

    trainer, _, _ = _trainer(tmp_path, "layeropt", ga=ga, max_grad_norm=0.3)
    trainer.__class__ = type("LayeroptMine", (LayeroptTrainer, Mine), {})
    with pytest.raises(TrainerSetupError, match="did not go through self.accelerator.backward"):
        trainer.train()
