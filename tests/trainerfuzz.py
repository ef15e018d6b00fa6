"""Random trainer set-ups - Lightning, accelerate, Hugging Face's ``Trainer`` - run with
torch.optim and with layeropt's integration, compared bit for bit.

The companion of tests/loopfuzz.py (whose optimizer draw, comparison, delta debugging,
statuses and command line it reuses) for the integrations of layeropt/integrations/:
each program, drawn from ``random.Random(seed)``, is an optimizer with random options
and a list of settings the tool offers, trained twice on a tiny MLP
(Linear-Tanh-LayerNorm-Linear) from the same seed and data: the tool with
``torch.optim``, and the tool with layeropt's integration and the layeropt class. The
settings (a mix names the tool):

* all: two param groups (decay / no decay on biases: not the module's order), a frozen
  first layer the optimizer owns or not, 5-11 batches per epoch (a trailing partial
  accumulation window), steps or epochs, LR schedulers, bf16;
* ``lightning``: ``LayeroptCallback`` - ``accumulate_grad_batches``,
  ``gradient_clip_val`` by norm or value, schedulers per step or epoch with a
  ``frequency``, ``log_grad_norm``, a ``training_step`` returning ``None``, manual
  optimization, a run stopped, saved and resumed by ``fit(ckpt_path=)`` (``resume``);
* ``accelerate``: ``LayeroptAccelerator`` - DDP's fp16 comm hook (``DistributedDataParallelKwargs``, under ``--ranks``), ``accumulate()`` or accumulation by hand (all
  but a window's last backward in layeropt's ``no_step()``, or not: refused),
  ``clip_grad_norm_`` / ``clip_grad_value_`` (learned, or given as ``max_grad_norm=`` /
  ``clip_value=``) over ``model.parameters()`` or the param groups' order, on the syncing
  micro-batch or every one, a prepared data loader or not;
* ``hf``: ``LayeroptTrainer`` or a plain ``Trainer`` with ``LayeroptCallback`` -
  ``optimizers=`` or an ``optim=`` the Trainer builds, ``max_grad_norm``, warmup and
  schedule types, evaluation during training, a model whose loss takes the window's
  ``num_items_in_batch`` (``loss_kwargs``, as transformers' language models), a tiny
  ``LlamaForCausalLM`` itself, with gradient checkpointing or not (``lm``), a new Trainer (model, optimizer) resumed
  by ``train(resume_from_checkpoint=)`` from the first one's checkpoint (``resume``).

Compared: parameters, the optimizer's ``state_dict()``, the global step, and what the
tool reports - the norms ``clip_grad_norm_`` returned (accelerate), the logged
``grad_norm`` when clipping and eval losses (Hugging Face). Statuses:

* ``exact``; ``refused``: layeropt's run raised a ``LayeroptError``
  (``LightningSetupError``, ``AccelerateSetupError``, ``TrainerSetupError`` ...), also
  where the tool refuses the set-up with torch.optim too (a fused optimizer clipped
  under Lightning's mixed precision); ``tool-error``: both runs raised the same
  exception type (the tool's or torch's own limit);
* ``loopfuzz.FAILURES``: ``diff``, ``crash`` (layeropt's run raised something else),
  ``torch-error-only`` (the torch.optim run raised, layeropt's trained).

On two processes (``--ranks 2``: the block under torchrun, gloo on the CPU), each tool
trains the DistributedDataParallel model it builds, with DDP's options drawn
(``find_unused_parameters``, ``gradient_as_bucket_view``, ``static_graph``, a bucket per
parameter), each rank its own batches, and each rank compares its own two runs
(:func:`programs_on_ranks`).

``tests/test_trainerfuzz.py`` runs a few dozen in CI, in one process and on two. By hand
(from the tests/ folder), to run more, replay or shrink a failing one (its settings, then
its optimizer options; ``--ranks 2`` runs each of them on two processes too)::

    python trainerfuzz.py --mix lightning --start 0 --n 150
    python trainerfuzz.py --mix hf --start 0 --n 50 --ranks 2
    python trainerfuzz.py --mix accelerate --replay 36
    python trainerfuzz.py --mix hf --minimize 36
    python trainerfuzz.py --mix accelerate --minimize 253 --ranks 2
"""

from __future__ import annotations

import contextlib
import copy
import functools
import itertools
import logging
import os
import random
import subprocess
import sys
import tempfile
import traceback
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
from harness import leave_rank
from loopfuzz import (
    _diff,
    cli,
    draw_optimizer,
    draw_third_party,
    drop_chunks,
    ends_in,
    installed_third_party,
    merged,
    optimizer_class,
)
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import layeropt

MIXES = ["lightning", "accelerate", "hf"]
VERIFY = 1000  # verify=: every step of a program (the integrations' own argument)
Result = dict[str, Any]

# Each tool's settings when a program does not draw them (what --minimize goes back to).
DEFAULTS: dict[str, dict[str, Any]] = {
    "lightning": {"groups": False, "frozen": None, "batches": 5, "precision": "32-true",
                  "acc": 1, "clip": None, "sched": None, "freq": 1, "stop": ("steps", 3),
                  "log_grad_norm": False, "manual": False, "none_step": False,
                  "bucket": None, "resume": None, "verify": False, "ddp": None},
    "accelerate": {"groups": False, "frozen": None, "batches": 5, "mp": "no", "ga": 1,
                   "by_hand": False, "clip": None, "max_norm": 0.5, "clip_value": 0.1,
                   "given": False, "clip_order": "model", "clip_every": False,
                   "sched": None, "loader": True, "epochs": 1, "max_steps": None,
                   "bucket": None, "verify": False, "offload": False, "ddp": None,
                   "held": False, "comm": None},
    "hf": {"groups": False, "frozen": None, "rows": 9, "bf16": False, "ga": 1,
           "kind": "trainer", "built": None, "max_grad_norm": 0.0, "weight_decay": 0.0,
           "sched": "linear", "warmup": 0, "eval": False, "stop": ("steps", 3),
           "resume": None, "loss_kwargs": False, "verify": False, "offload": False,
           "lm": None, "ddp": None},
}


# DDP's own options, under --ranks (drawn last: the draws before are those of a program
# without them; one process ignores them): find_unused_parameters, gradient_as_bucket_view,
# static_graph, and a bucket cap so small that each parameter is a bucket of its own. The
# Trainer offers the first and the cap; its default finds unused parameters (of a
# PreTrainedModel: unless it checkpoints), so "keep" sets find_unused_parameters=False.
DDP_OPTIONS = [None, None, None, "find_unused", "view", "tiny", "find_unused+tiny",
               "view+tiny", "static"]
HF_DDP_OPTIONS = [None, None, "find_unused", "keep", "tiny", "keep+tiny"]


def ddp_options(s: dict[str, Any]) -> dict[str, Any]:
    """The DistributedDataParallel keyword arguments a program's ``ddp`` setting names."""
    parts = set((s["ddp"] or "").split("+"))
    options = {"find_unused_parameters": True if "find_unused" in parts
               else False if "keep" in parts else None,
               "gradient_as_bucket_view": True if "view" in parts else None,
               "static_graph": True if "static" in parts else None,
               "bucket_cap_mb": 1e-4 if "tiny" in parts else None}
    return {k: v for k, v in options.items() if v is not None}


def _verify(s: dict[str, Any]) -> int | None:
    """The integration's ``verify=``: every step, or the program's first 1-2."""
    return None if not s["verify"] else VERIFY if s["verify"] is True else s["verify"]


# -- drawing a program ------------------------------------------------------------------
def _draw_common(r: random.Random) -> dict[str, Any]:
    return {"groups": r.random() < 0.4, "frozen": r.choice([None] * 6 + ["owned", "left"])}


def _draw_lightning(r: random.Random) -> dict[str, Any]:
    return {"batches": r.choice([5, 7, 9, 10, 11]), "acc": r.randint(1, 4),
            "precision": r.choice(["32-true", "32-true", "bf16-mixed"]),
            "clip": r.choice([None, None, ("norm", r.choice([0.05, 0.3, 1.0])),
                              ("value", r.choice([0.01, 0.1]))]),
            "sched": r.choice([None, "step-epoch", "warmup-step", "cosine-step", "lambda-freq"]),
            "freq": r.choice([1, 2, 3]),
            "stop": r.choice([("steps", r.randint(2, 6)), ("epochs", r.randint(1, 2))]),
            "log_grad_norm": r.random() < 0.3, "manual": r.random() < 0.08,
            "none_step": r.random() < 0.1, "bucket": r.choice([None, 0]),
            "resume": r.choice([1, 2, 3]) if r.random() < 0.2 else None,
            "verify": r.random() < 0.15, "ddp": r.choice(DDP_OPTIONS)}


def _draw_accelerate(r: random.Random) -> dict[str, Any]:
    return {"batches": r.choice([5, 7, 9, 10, 11]), "ga": r.randint(1, 4),
            "mp": r.choice(["no", "no", "bf16"]), "by_hand": r.random() < 0.15,
            "clip": r.choice([None, "norm", "value", "norm+value"]),
            "max_norm": r.choice([0.05, 0.5, 2.0]), "clip_value": r.choice([0.01, 0.1]),
            "given": r.random() < 0.4, "clip_order": r.choice(["model", "model", "groups"]),
            "clip_every": r.random() < 0.1, "sched": r.choice([None, "warmup", "linear", "cosine"]),
            "loader": r.random() < 0.8, "epochs": r.choice([1, 1, 2]),
            "max_steps": r.choice([None, None, 3]), "bucket": r.choice([None, 0]),
            "verify": r.random() < 0.15, "offload": r.random() < 0.15,
            "ddp": r.choice(DDP_OPTIONS), "held": r.random() < 0.5}


def _draw_hf(r: random.Random) -> dict[str, Any]:
    kind = r.choice(["trainer", "trainer", "callback"])
    # the callback refuses max_grad_norm > 0 and needs the layeropt optimizer handed to it
    # (both refusals tried now and then, not in every other program)
    refusal = r.random() < 0.1
    return {"kind": kind, "rows": r.choice([9, 11, 13, 14]), "ga": r.randint(1, 4),
            "built": r.choice([None, None, "adamw_torch", "adamw_torch_fused", "sgd"])
            if kind == "trainer" or refusal else None,
            "max_grad_norm": r.choice([0.0, 0.05, 1.0]) if kind == "trainer" or refusal else 0.0,
            "weight_decay": r.choice([0.0, 0.1]),
            "sched": r.choice(["linear", "cosine", "constant_with_warmup", "constant"]),
            "warmup": r.choice([0, 1, 2]), "bf16": r.random() < 0.3, "eval": r.random() < 0.3,
            "stop": r.choice([("steps", r.randint(2, 5)), ("epochs", r.choice([1, 2]))]),
            "resume": r.choice([1, 2, 3]) if r.random() < 0.2 else None,
            "loss_kwargs": r.random() < 0.3, "verify": r.random() < 0.15,
            "offload": r.random() < 0.15,
            "lm": r.choice(["plain", "ck", "ckre"]) if r.random() < 0.25 else None,
            "ddp": r.choice(HF_DDP_OPTIONS)}


# more optimizers the Trainer builds from ``optim=``: its Adafactor (transformers' own),
# torch's, schedule-free's (the Trainer calls their train() / eval()), bitsandbytes'
HF_MORE_BUILT = ["adafactor", "rmsprop", "adagrad", "schedule_free_adamw", "schedule_free_sgd",
                 "schedule_free_radam", "adamw_bnb_8bit", "lion_8bit", "rmsprop_bnb", "ademamix"]

DRAWS: dict[str, Callable[[random.Random], dict[str, Any]]] = {
    "lightning": _draw_lightning, "accelerate": _draw_accelerate, "hf": _draw_hf}


def draw_program(seed: int, mix: str) -> dict[str, Any]:
    """An optimizer and the settings that differ from ``DEFAULTS[mix]``, as a list of
    ``[name, value]`` (what --minimize drops)."""
    if mix not in MIXES:
        raise ValueError(f"mix={mix!r}: one of {MIXES}")
    r = random.Random(seed)
    kind, okw = draw_optimizer(r)
    drawn = {**_draw_common(r), **DRAWS[mix](r)}
    # (drawn after the rest, which stay those of a program without them) now and then a
    # third-party optimizer handed to the tool, or one the Trainer builds from ``optim=``
    if r.random() < 0.15 and installed_third_party():
        kind, okw = draw_third_party(r)
    if mix == "hf" and drawn["kind"] == "trainer" and drawn["built"] and r.random() < 0.4:
        drawn["built"] = r.choice(HF_MORE_BUILT)
    if mix == "accelerate" and random.Random(seed + 3 * 10**7).random() < 0.3:
        drawn["comm"] = "fp16"  # (DDP under --ranks: DistributedDataParallelKwargs' hook)
    v = random.Random(seed + 7 * 10**6)  # (a third of the verified ones: the first 1-2
    if drawn["verify"] and v.random() < 0.35:  # steps, then in backward, as a user's run
        drawn["verify"] = v.randint(1, 2)  # after verify=N)
    settings = [[k, v] for k, v in drawn.items() if v != DEFAULTS[mix][k]]
    return {"seed": seed, "mix": mix, "opt": kind, "okw": okw, "settings": settings}


# -- the model, the data, the optimizer (shared by the tools) -------------------------------
def settings(prog: dict[str, Any]) -> dict[str, Any]:
    return {**DEFAULTS[prog["mix"]], **{k: v for k, v in prog["settings"]}}


def mlp(frozen: str | None) -> nn.Sequential:
    """The tiny model, from seed 0 (the same on both sides); ``frozen``: its first layer."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.LayerNorm(12), nn.Linear(12, 3))
    if frozen:
        net[0].requires_grad_(False)
    return net


def data(rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(rows, 6, generator=g) * 2, torch.randn(rows, 3, generator=g)


def loader(batches: int, seed: int = 1) -> DataLoader:
    return DataLoader(TensorDataset(*data(4 * batches, seed)), batch_size=4)


# -- on several processes (``--ranks N``: the block under torchrun) ---------------------------
def world() -> int:
    """The number of processes training together (torchrun's ``WORLD_SIZE``; 1 alone)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def rank() -> int:
    return int(os.environ.get("RANK", "0"))


_SHARED = itertools.count()


@contextlib.contextmanager
def workdir() -> Iterator[str]:
    """A temporary folder for checkpoints. Under ``--ranks``, one the ranks share (where
    one rank saves and every rank loads): the n-th of each rank is the same folder, as the
    ranks run the same programs in the same order; the launcher removes them all."""
    shared = os.environ.get("TRAINERFUZZ_SHARED")
    if shared is None:
        with tempfile.TemporaryDirectory() as tmp:
            yield tmp
        return
    path = os.path.join(shared, f"work{next(_SHARED)}")
    os.makedirs(path, exist_ok=True)
    yield path


def optimizer(prog: dict[str, Any], model: nn.Module, layer: bool) -> torch.optim.Optimizer:
    """``torch.optim.<opt>`` or its layeropt class over ``model``: one group, or decay and
    no decay (biases) - another order than ``model.parameters()``; a frozen layer's
    parameters held or left out."""
    s, cls = settings(prog), optimizer_class(prog["opt"], layer)
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad or s["frozen"] == "owned"]
    params: Any = [p for _, p in named]
    if s["groups"]:
        decay = prog["okw"].get("weight_decay") or 0.05
        no = [n.endswith("bias") or "norm" in n for n, _ in named]  # (biases, norms: no decay)
        params = [{"params": [p for (_, p), x in zip(named, no) if not x], "weight_decay": decay},
                  {"params": [p for (_, p), x in zip(named, no) if x], "weight_decay": 0.0}]
    opt = cls(params, **prog["okw"])
    if hasattr(opt, "train"):
        opt.train()  # (schedule-free: its training mode, as the tools leave it to the user)
    return opt


def result(model: nn.Module, opt: Any, **extra: Any) -> Result:
    """What both runs must agree on: parameters, optimizer state, and ``extra``."""
    return {"params": {n: p.detach().clone() for n, p in model.named_parameters()},
            "state": copy.deepcopy(layeropt.optim.unwrap_optimizer(opt).state_dict()), **extra}


def scheduler(kind: str | None, opt: torch.optim.Optimizer) -> Any:
    S = torch.optim.lr_scheduler
    return {None: lambda: None,
            "warmup": lambda: S.LambdaLR(opt, lambda k: min(1.0, (k + 1) / 3)),
            "linear": lambda: S.LinearLR(opt, 1.0, 0.1, total_iters=5),
            "cosine": lambda: S.CosineAnnealingLR(opt, T_max=5),
            "decay": lambda: S.LambdaLR(opt, lambda k: 0.8**k),
            "step": lambda: S.StepLR(opt, 1, gamma=0.7)}[kind]()


# -- Lightning ------------------------------------------------------------------------------
LIGHTNING_SCHEDULERS = {"step-epoch": ("step", "epoch"), "warmup-step": ("warmup", "step"),
                        "cosine-step": ("cosine", "step"), "lambda-freq": ("decay", "step")}


@functools.cache
def _lightning_module() -> type:
    """The LightningModule (a class made on first use: Lightning may be missing)."""
    import lightning.pytorch as L

    class Lit(L.LightningModule):
        """The MLP; ``training_step`` returns ``None`` at batch 2 (``none_step``), or
        steps by hand (``manual``)."""

        def __init__(self, prog: dict[str, Any], layer: bool) -> None:
            super().__init__()
            self.prog, self.s, self.layer = prog, settings(prog), layer
            self.net = mlp(self.s["frozen"])
            self.automatic_optimization = not self.s["manual"]

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor | None:
            self.wrapper = type(self.trainer.strategy.model).__name__  # (DDP: unwrapped at the end)
            x, y = batch
            loss = nn.functional.mse_loss(self.net(x).float(), y)
            if self.s["none_step"] and batch_idx == 2:
                return None
            if self.s["manual"]:
                opt = self.optimizers()
                opt.zero_grad()
                self.manual_backward(loss)
                opt.step()
                return None
            return loss

        def configure_optimizers(self) -> Any:
            opt = optimizer(self.prog, self, self.layer)
            if self.s["sched"] is None:
                return opt
            kind, interval = LIGHTNING_SCHEDULERS[self.s["sched"]]
            return {"optimizer": opt, "lr_scheduler": {
                "scheduler": scheduler(kind, opt), "interval": interval,
                "frequency": self.s["freq"] if kind == "decay" else 1}}

    return Lit


def run_lightning(prog: dict[str, Any], layer: bool) -> Result:
    """``Trainer.fit`` with ``LayeroptCallback`` (``layer``) or without."""
    import lightning.pytorch as L
    from lightning.pytorch.strategies import DDPStrategy

    from layeropt.integrations.lightning import LayeroptCallback

    s = settings(prog)
    kw: dict[str, Any] = {"max_steps" if s["stop"][0] == "steps" else "max_epochs": s["stop"][1]}
    if not s["manual"]:
        kw["accumulate_grad_batches"] = s["acc"]
        if s["clip"]:
            kw["gradient_clip_algorithm"], kw["gradient_clip_val"] = s["clip"]

    def fit(ckpt: str | None = None, **stop: Any) -> Any:
        callbacks = [LayeroptCallback(bucket_cap_mb=s["bucket"], log_grad_norm=s["log_grad_norm"],
                                      verify=_verify(s))] if layer else []
        ddp = {"devices": world(), "strategy": DDPStrategy(**ddp_options(s))} if world() > 1 else {}
        trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False,
                            num_sanity_val_steps=0, precision=s["precision"],
                            callbacks=callbacks, **ddp, **{**kw, **stop})
        module = _lightning_module()(prog, layer)
        trainer.fit(module, loader(s["batches"]), ckpt_path=ckpt)
        return trainer, module

    if s["resume"] is None:
        trainer, module = fit()
    else:  # (resume: stopped after that many steps, saved, fit again from the checkpoint)
        with workdir() as tmp:
            first, _ = fit(max_steps=s["resume"], max_epochs=None)
            first.save_checkpoint(f"{tmp}/stop.ckpt")
            trainer, module = fit(f"{tmp}/stop.ckpt")
    return result(module, trainer.optimizers[0], step=trainer.global_step,
                  wrapper=getattr(module, "wrapper", None))


# -- accelerate -----------------------------------------------------------------------------
@contextlib.contextmanager
def fresh_accelerate_state() -> Iterator[None]:
    """accelerate's process-wide state reset before and after (as tests/test_accelerate.py)."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()
    try:
        yield
    finally:
        AcceleratorState._reset_state(reset_partial_state=True)
        GradientState._reset_state()


def _accelerator(s: dict[str, Any], layer: bool) -> Any:
    import accelerate

    from layeropt.integrations.accelerate import LayeroptAccelerator

    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    hook = {"comm_hook": DDPCommunicationHookType.FP16} if s["comm"] else {}
    kw = {"cpu": True, "mixed_precision": s["mp"],
          "gradient_accumulation_steps": 1 if s["by_hand"] else s["ga"],
          "kwargs_handlers": [DistributedDataParallelKwargs(**ddp_options(s), **hook)]}
    if not layer:
        return accelerate.Accelerator(**kw)
    clip = s["clip"] or ""
    given = {"max_grad_norm": s["max_norm"] if s["given"] and "norm" in clip else None,
             "clip_value": s["clip_value"] if s["given"] and "value" in clip else None}
    return LayeroptAccelerator(bucket_cap_mb=s["bucket"], verify=_verify(s),
                               offload_state=s["offload"],
                               **{k: v for k, v in given.items() if v is not None}, **kw)


def run_accelerate(prog: dict[str, Any], layer: bool) -> Result:
    """A loop of ``accumulate`` (or accumulation by hand), ``backward``, clipping,
    ``step``, ``zero_grad`` with ``Accelerator`` or ``LayeroptAccelerator`` (``layer``)."""
    s = settings(prog)
    with fresh_accelerate_state():
        acc = _accelerator(s, layer)
        model = mlp(s["frozen"])
        opt = optimizer(prog, model, layer)
        sched = scheduler(s["sched"], opt)
        # (a prepared loader gives each rank its part of the batches; one left alone, the
        # same on every rank, gets each rank's own)
        dl = loader(s["batches"], 1 if s["loader"] else 1 + rank())
        prepared = acc.prepare(model, opt, *([dl] if s["loader"] else []),
                               *([sched] if sched else []))
        model, opt = prepared[:2]
        dl = prepared[2] if s["loader"] else dl
        sched = prepared[-1] if sched else None
        norms = _accelerate_loop(s, acc, model, opt, sched, dl)
        out = result(model, opt, norms=norms, wrapper=type(model).__name__)
        acc.free_memory()
        return out


def _accelerate_loop(s: dict[str, Any], acc: Any, model: nn.Module, opt: Any, sched: Any,
                     dl: Any) -> list[torch.Tensor | None]:
    """The training loop; the norms ``clip_grad_norm_`` returned."""
    def clipped() -> Any:
        if s["clip_order"] == "model":
            return model.parameters()
        return [p for g in layeropt.optim.unwrap_optimizer(opt).param_groups for p in g["params"]]

    norms: list[torch.Tensor | None] = []
    steps = 0
    for _ in range(s["epochs"]):
        for i, (x, y) in enumerate(dl):
            with contextlib.nullcontext() if s["by_hand"] else acc.accumulate(model):
                loss = nn.functional.mse_loss(model(x).float(), y)
                sync = (i + 1) % s["ga"] == 0 if s["by_hand"] else acc.sync_gradients
                # (by hand, "held": layeropt's loop holds all but a window's last backward
                # in no_step(), as docs/integrations.md says; torch.optim's has none)
                no_step = getattr(layeropt.optim.unwrap_optimizer(opt), "no_step", None)
                held = s["by_hand"] and s["held"] and not sync and no_step is not None
                with no_step() if held else contextlib.nullcontext():
                    acc.backward(loss / s["ga"] if s["by_hand"] else loss)
                if s["clip"] and (sync or s["clip_every"]):
                    if "norm" in s["clip"]:
                        norm = acc.clip_grad_norm_(clipped(), s["max_norm"])
                        norms.append(None if norm is None else norm.detach().clone())
                    if "value" in s["clip"]:
                        acc.clip_grad_value_(clipped(), s["clip_value"])
                if sync or not s["by_hand"]:
                    opt.step()
                    if sched:
                        sched.step()
                    opt.zero_grad()
                steps += int(sync)
            if s["max_steps"] and steps >= s["max_steps"]:
                break
    return norms


# -- Hugging Face ---------------------------------------------------------------------------
class HFNet(nn.Module):
    """The MLP as the Trainer calls a model: keyword inputs, a dict with the loss."""

    def __init__(self, frozen: str | None) -> None:
        super().__init__()
        self.net = mlp(frozen)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": nn.functional.mse_loss(out.float(), labels), "logits": out}


class HFTokenNet(HFNet):
    """The MLP as a Hugging Face language model takes the loss: a forward with ``**kwargs``,
    so the Trainer passes ``num_items_in_batch`` (the labels of the accumulation window)
    and does not divide the loss by the accumulation steps; the loss is a sum over it."""

    def forward(self, x: torch.Tensor, labels: torch.Tensor, **kwargs: Any
                ) -> dict[str, torch.Tensor]:
        out, n = self.net(x), kwargs.get("num_items_in_batch")
        err = (out.float() - labels) ** 2
        return {"loss": err.mean() if n is None else err.sum() / n, "logits": out}


def tiny_lm(frozen: str | None) -> nn.Module:
    """A two-layer ``LlamaForCausalLM`` from a tiny config, seed 0 (``lm``); ``frozen``: its
    token embedding."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))
    if frozen:
        model.model.embed_tokens.requires_grad_(False)
    return model


def _lm_rows(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    ids = torch.randint(0, 32, (n, 6), generator=torch.Generator().manual_seed(seed))
    return [{"input_ids": row, "labels": row} for row in ids]


def _rows(n: int, seed: int = 1) -> list[dict[str, torch.Tensor]]:
    x, y = data(n, seed)
    return [{"x": a, "labels": b} for a, b in zip(x, y)]


def run_hf(prog: dict[str, Any], layer: bool) -> Result:
    """``Trainer.train`` with torch.optim, or ``LayeroptTrainer`` / a ``Trainer`` with
    ``LayeroptCallback`` (``layer``); the optimizer handed over or built from ``optim=``;
    with ``resume``, a new Trainer resumed from the first one's checkpoint at that step."""
    s = settings(prog)
    with workdir() as tmp:
        trainer, model = _hf_train(prog, layer, s, tmp)
        if s["resume"] is not None:  # (a new Trainer, model and optimizer from a checkpoint)
            trainer, model = _hf_train(prog, layer, s, tmp, f"{tmp}/checkpoint-{s['resume']}")
    logged = trainer.state.log_history
    # the norms clipping measured (docs/integrations.md: with max_grad_norm=0 LayeroptTrainer
    # logs none; the callback refuses clipping, its Trainer logs 0 measured after backward)
    clipped = s["kind"] == "trainer" and s["max_grad_norm"] > 0
    norms = [h["grad_norm"] for h in logged if "grad_norm" in h] if clipped else []
    return result(model, trainer.optimizer, step=trainer.state.global_step, norms=norms,
                  evals=[h["eval_loss"] for h in logged if "eval_loss" in h],
                  wrapper=type(trainer.model_wrapped).__name__)


def _hf_train(prog: dict[str, Any], layer: bool, s: dict[str, Any], tmp: str,
              resume: str | None = None) -> tuple[Any, nn.Module]:
    """One ``train()`` (``resume``: from that checkpoint); the Trainer and its model.
    With ``resume`` set in the settings, checkpoints are saved every that many steps."""
    from transformers import PrinterCallback, Trainer, TrainingArguments

    from layeropt.integrations.hf import LayeroptCallback, LayeroptTrainer

    lm = s["lm"]
    model = tiny_lm(s["frozen"]) if lm else (HFTokenNet if s["loss_kwargs"] else HFNet)(
        s["frozen"])
    rows = _lm_rows if lm else _rows
    saving = ({"save_strategy": "steps", "save_steps": s["resume"]} if s["resume"]
              else {"save_strategy": "no"})
    args = TrainingArguments(
        output_dir=tmp, per_device_train_batch_size=2, gradient_accumulation_steps=s["ga"],
        learning_rate=1e-2, max_grad_norm=s["max_grad_norm"], lr_scheduler_type=s["sched"],
        warmup_steps=s["warmup"], weight_decay=s["weight_decay"], bf16=s["bf16"],
        logging_steps=1, seed=0, report_to=[], use_cpu=True, disable_tqdm=True,
        **saving, **({"max_steps": s["stop"][1]} if s["stop"][0] == "steps"
                      else {"num_train_epochs": s["stop"][1]}),
        **({"eval_strategy": "steps", "eval_steps": 2} if s["eval"] else {}),
        **({"gradient_checkpointing": True, "gradient_checkpointing_kwargs": {
            "use_reentrant": lm == "ckre"}} if lm in ("ck", "ckre") else {}),
        **({"optim": s["built"]} if s["built"] else {}),
        **{{"find_unused_parameters": "ddp_find_unused_parameters",
            "bucket_cap_mb": "ddp_bucket_cap_mb"}[k]: v for k, v in ddp_options(s).items()})
    common: dict[str, Any] = {
        "model": model, "args": args, "train_dataset": rows(s["rows"]),
        "eval_dataset": rows(4, 2) if s["eval"] else None,
        "optimizers": (None if s["built"] else optimizer(prog, model, layer), None)}
    if not layer:
        trainer = Trainer(**common)
    elif s["kind"] == "trainer":
        trainer = LayeroptTrainer(**common, verify=_verify(s),
                                  offload_state=s["offload"])
    else:
        trainer = Trainer(**common, callbacks=[
            LayeroptCallback(verify=_verify(s))])
    trainer.remove_callback(PrinterCallback)  # (it prints every log with disable_tqdm)
    trainer.train(resume_from_checkpoint=resume)
    return trainer, model


RUNS: dict[str, Callable[[dict[str, Any], bool], Result]] = {
    "lightning": run_lightning, "accelerate": run_accelerate, "hf": run_hf}


# -- running it -----------------------------------------------------------------------------
@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """No warnings, no log lines below errors (the tools' banners and advice)."""
    before = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            yield
    finally:
        logging.disable(before)


def _error_status(terr: Exception | None, lerr: Exception | None) -> dict[str, Any] | None:
    """The outcome from the runs' exceptions (None: both trained)."""
    if isinstance(lerr, layeropt.VerifyError):  # (these set-ups are exact: a false alarm)
        return {"status": "verify-false-alarm", "error": f"{lerr}"[:300]}
    if isinstance(lerr, layeropt.LayeroptError):
        return {"status": "refused", "error": f"{type(lerr).__name__}: {lerr}"[:300],
                **({"torch": repr(terr)[:200]} if terr is not None else {})}
    if terr is not None and lerr is not None and type(terr) is type(lerr):
        return {"status": "tool-error", "error": repr(terr)[:200]}
    if lerr is not None:
        return {"status": "crash", "error": f"{type(lerr).__name__}: {lerr}"[:300],
                **({"torch": repr(terr)[:200]} if terr is not None else {}),
                "traceback": traceback.format_exception(lerr)[-4:]}
    if terr is not None:
        return {"status": "torch-error-only", "error": repr(terr)[:200]}
    return None


def run_program(prog: dict[str, Any]) -> dict[str, Any]:
    """The tool with torch.optim, then with layeropt; the outcome is one of the statuses
    of the module's docstring."""
    results: list[Result | None] = []
    errors: list[Exception | None] = []
    with quiet():
        for layer in (False, True):
            try:
                results.append(RUNS[prog["mix"]](prog, layer))
                errors.append(None)
            except Exception as e:  # noqa: BLE001 - classified below
                results.append(None)
                errors.append(e)
    out: dict[str, Any] = {"seed": prog["seed"], "mix": prog["mix"], "status": "exact",
                           **({"wrapper": results[1]["wrapper"]} if results[1] else {})}
    ended = _error_status(*errors)
    if ended is not None:
        return {**out, **ended}
    found = _diff(*results)
    return {**out, "status": "diff", "differences": found[:6]} if found else out


def run_block(mix: str, start: int, n: int) -> list[dict[str, Any]]:
    return [run_program(draw_program(s, mix)) for s in range(start, start + n)]


# -- by hand: more programs, one program, a smaller program -----------------------------------
def minimize(prog: dict[str, Any], status: str,
             run: Callable[[dict[str, Any]], dict[str, Any]] = run_program) -> dict[str, Any]:
    """The fewest settings still ending in ``status`` (delta debugging: a dropped setting
    takes its default), then the fewest optimizer options; each candidate run by ``run``."""
    still = ends_in(run, status)

    prog = drop_chunks(prog, "settings", still)
    for key in [k for k in prog["okw"] if k != "lr"]:
        cand = {**prog, "okw": {k: v for k, v in prog["okw"].items() if k != key}}
        if still(cand):
            prog = cand
    return prog


def programs_on_ranks(mix: str, start: int, n: int, nproc: int = 2) -> list[dict[str, Any]]:
    """Programs ``start`` to ``start + n`` of ``mix`` on ``nproc`` processes
    (:func:`run_on_ranks`)."""
    return run_on_ranks([draw_program(seed, mix) for seed in range(start, start + n)], nproc)


def run_on_ranks(progs: list[dict[str, Any]], nproc: int = 2, timeout_s: float = 600.0
                 ) -> list[dict[str, Any]]:
    """Each program on ``nproc`` processes launched by torchrun, as users launch these
    tools (gloo on the CPU): each tool trains the model in DistributedDataParallel, each
    rank its own batches. Each program's outcome is rank 0's where every rank's status is
    the same (a failure on any rank is rank 0's), else ``rank-mismatch``
    (``loopfuzz.merged``). The ranks compare their own runs, torch.optim against
    layeropt: replicas that drifted apart leave some rank off torch's."""
    with tempfile.TemporaryDirectory() as out:
        torch.save(progs, f"{out}/programs.pt")
        env = dict(os.environ, OMP_NUM_THREADS="1", TRAINERFUZZ_SHARED=out,
                   PYTHONPATH=os.pathsep.join(filter(None, [os.path.dirname(__file__),
                                                            os.environ.get("PYTHONPATH")])))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", __file__, "--worker", out]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout_s)
        if done.returncode != 0:
            raise RuntimeError(f"trainerfuzz's ranks failed ({done.returncode}):\n"
                               f"{done.stdout[-2000:]}{done.stderr[-4000:]}")
        per_rank = [torch.load(f"{out}/rank{r}.pt", weights_only=False) for r in range(nproc)]
    return [merged(outs) for outs in zip(*per_rank)]


def _worker(out: str) -> None:
    """One rank of :func:`run_on_ranks`: the programs, their outcomes saved for the
    launcher."""
    import datetime

    import torch.distributed as dist

    torch.set_num_threads(1)
    # (the tools find the group open; a rank left waiting on another raises in a minute)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    progs = torch.load(f"{out}/programs.pt", weights_only=False)
    torch.save([run_program(p) for p in progs], f"{out}/rank{rank()}.pt")
    leave_rank()


if __name__ == "__main__":
    if sys.argv[1:2] == ["--worker"]:
        _worker(sys.argv[2])
    else:
        cli(__doc__, MIXES, draw_program, run_program, minimize, "settings",
            ranked=run_on_ranks)
