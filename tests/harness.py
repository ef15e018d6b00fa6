"""Shared tables and the reference harness (imported by the tests).

Every exactness test trains two copies of a model from the same seed: one with
plain torch (``loss.backward(); torch_opt.step(); torch_opt.zero_grad()``), one
with a layeropt optimizer attached, and compares parameters and optimizer state
bit for bit.
"""

from __future__ import annotations

import copy
import gc
import os
import sys
from collections.abc import Callable
from typing import Any, NamedTuple, NoReturn

import pytest
import torch
import torch.distributed as dist

import layeropt
from layeropt.models import make_model

# LAYEROPT_SOAK=k multiplies the examples of the random-architecture and random-program
# tests (tests/test_properties.py, the two-process programs of tests/test_distributed.py).
SOAK = max(1, int(os.environ.get("LAYEROPT_SOAK", "1")))

# The installed torch, for what depends on it (compared as a tuple: TORCH >= (2, 8)).
TORCH = torch.torch_version.TorchVersion(torch.__version__)
# FSDP2 runs on CPU (gloo) from torch 2.8 (tested; 2.4-2.6 need CUDA streams).
FSDP2_ON_CPU = TORCH >= (2, 8)
needs_fsdp2 = pytest.mark.skipif(not FSDP2_ON_CPU, reason="FSDP2 runs on CPU from torch 2.8")
# a case's runs, by name: torch.optim (None), and layeropt attached with these options (the
# library's default buckets, and the strict schedule: each parameter at once)
RUNS: dict[str, dict[str, Any] | None] = {
    "torch": None, "layeropt": {}, "layeropt-cap0": {"bucket_cap_mb": 0.0}}
try:
    from torch.distributed.fsdp import fully_shard
except ImportError:  # torch < 2.6
    from torch.distributed._composable.fsdp import fully_shard  # noqa: F401 - for the tests

# (name, torch class, kwargs): every option torch offers for each optimizer.
OPTIMIZER_CONFIGS: list[tuple[str, dict[str, Any]]] = [
    ("SGD", dict(lr=0.1)),
    ("SGD", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("SGD", dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
    ("SGD", dict(lr=0.1, momentum=0.9, foreach=True)),
    ("SGD", dict(lr=0.1, momentum=0.9, fused=True)),
    ("Adam", dict(lr=0.01)),
    ("Adam", dict(lr=0.01, betas=(0.8, 0.99), eps=1e-6, weight_decay=0.1, amsgrad=True)),
    ("Adam", dict(lr=0.01, maximize=True, foreach=True)),
    ("Adam", dict(lr=0.01, fused=True, amsgrad=True, weight_decay=0.1)),
    ("Adam", dict(lr=torch.tensor(0.01), fused=True)),
    ("AdamW", dict(lr=0.01)),
    ("AdamW", dict(lr=0.01, weight_decay=0.3, amsgrad=True, foreach=True)),
    ("AdamW", dict(lr=0.01, fused=True, maximize=True)),
    ("Adagrad", dict(lr=0.1)),
    ("Adagrad", dict(lr=0.1, lr_decay=0.01, weight_decay=0.1, initial_accumulator_value=0.1)),
    ("Adagrad", dict(lr=0.1, foreach=True, maximize=True)),
    ("Adagrad", dict(lr=0.1, fused=True)),
    ("RMSprop", dict(lr=0.01)),
    ("RMSprop", dict(lr=0.01, alpha=0.9, momentum=0.5, centered=True, weight_decay=0.1)),
    ("RMSprop", dict(lr=0.01, foreach=True, maximize=True, centered=True)),
]
if hasattr(torch.optim, "Adafactor"):
    OPTIMIZER_CONFIGS += [
        ("Adafactor", dict(lr=0.01)),
        ("Adafactor", dict(lr=0.01, beta2_decay=-0.5, d=2.0, weight_decay=0.1, foreach=True)),
        ("Adafactor", dict(lr=0.01, maximize=True, eps=(1e-30, 1e-2))),
    ]
if "decoupled_weight_decay" in torch.optim.Adam.__init__.__code__.co_varnames:
    OPTIMIZER_CONFIGS.append(("Adam", dict(lr=0.01, weight_decay=0.1, decoupled_weight_decay=True)))

# (name, kwargs): a few representative optimizers, for the tests of a feature
# (clipping, AMP, checkpointing, compile, lean losses, Hugging Face models) that
# need not run every option above. The union of what those tests had each
# picked: SGD with momentum, Adam, AdamW with torch's default and a larger
# weight decay, and the fused kernels (which unscale GradScaler's gradients
# inside their step). A file may take a part of it where a case is slow
# (tests/test_hf.py: the first two) or pairs each model with one optimizer
# (tests/test_compile.py: three, looked up by config_id).
REPRESENTATIVE: list[tuple[str, dict[str, Any]]] = [
    ("SGD", dict(lr=0.1, momentum=0.9)),
    ("AdamW", dict(lr=0.01)),
    ("Adam", dict(lr=0.01)),
    ("AdamW", dict(lr=0.01, weight_decay=0.1)),
    ("Adam", dict(lr=0.01, fused=True)),
    ("AdamW", dict(lr=0.01, fused=True)),
    ("AdamW", dict(lr=0.01, weight_decay=0.1, fused=True)),
]

MODEL_NAMES = ("mlp", "unet", "gpt", "loop", "frozen")


def config_id(cfg: tuple[str, dict[str, Any]]) -> str:
    name, kw = cfg
    parts = [f"{k}={v.item() if isinstance(v, torch.Tensor) else v}" for k, v in kw.items()]
    return f"{name}({','.join(parts)})"


def torch_class(name: str) -> type[torch.optim.Optimizer]:
    return getattr(torch.optim, name)


def layeropt_class(name: str) -> type[torch.optim.Optimizer]:
    return getattr(layeropt, name)


def clone_kwargs(kw: dict[str, Any]) -> dict[str, Any]:
    return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in kw.items()}


def param_groups(model: torch.nn.Module, kw: dict[str, Any], split: bool) -> Any:
    """All params in one group, or two groups with different lr."""
    params = [p for p in model.parameters()]
    if not split:
        return params
    lr = kw.get("lr", 0.01)
    lr = float(lr) if isinstance(lr, torch.Tensor) else lr
    return [{"params": params[::2]}, {"params": params[1::2], "lr": lr * 0.5}]


def assert_same(a: Any, b: Any, path: str = "") -> None:
    """Bitwise equality of nested tensors/containers (state_dicts, params)."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.dtype == b.dtype and a.shape == b.shape, path
        assert torch.equal(a, b), f"{path}: max diff {(a.double() - b.double()).abs().max()}"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {set(a) ^ set(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def assert_models_equal(m1: torch.nn.Module, m2: torch.nn.Module) -> None:
    for (n, p), (_, q) in zip(m1.named_parameters(), m2.named_parameters()):
        assert_same(p.detach(), q.detach(), n)


class Pair(NamedTuple):
    """A model with a layeropt optimizer and its plain-torch reference (see :func:`make_pair`)."""

    model: torch.nn.Module  # the layeropt side
    ref: torch.nn.Module  # a deepcopy of ``model``, for torch.optim
    opt: torch.optim.Optimizer  # the layeropt optimizer, over ``model``
    ref_opt: torch.optim.Optimizer  # the torch.optim optimizer, over ``ref``
    batch_fn: Callable[..., Any]
    loss_fn: Callable[..., Any]
    handle: Any  # layeropt.attach's handle; None when not attached


def make_pair(
    model_name: str,
    opt_name: str,
    kw: dict[str, Any],
    *,
    attach: dict[str, Any] | None = None,
    split_groups: bool = False,
    model: torch.nn.Module | None = None,
    batch_fn: Callable[..., Any] | None = None,
    loss_fn: Callable[..., Any] | None = None,
) -> Pair:
    """``make_model(model_name)`` and a deepcopy of it (``ref``); ``torch.optim.<opt_name>``
    over the copy and ``layeropt.<opt_name>`` over the model, both with ``kw`` (tensors
    cloned for each).

    ``attach``: None leaves the layeropt optimizer unattached (the test attaches it,
    say after changing the model); a dict attaches it at once with those options
    (``{}``: attach's defaults). ``split_groups``: two param groups with different lr
    (:func:`param_groups`). ``model``, ``batch_fn``, ``loss_fn``: the caller's model
    instead of ``make_model``'s.
    """
    if model is None:
        model, batch_fn, loss_fn = make_model(model_name)
    ref = copy.deepcopy(model)
    ref_opt = torch_class(opt_name)(param_groups(ref, kw, split_groups), **clone_kwargs(kw))
    opt = layeropt_class(opt_name)(param_groups(model, kw, split_groups), **clone_kwargs(kw))
    handle = None if attach is None else layeropt.attach(model, opt, **attach)
    return Pair(model, ref, opt, ref_opt, batch_fn, loss_fn, handle)


def train_pair(
    model_name: str,
    opt_name: str,
    kw: dict[str, Any],
    *,
    steps: int = 3,
    split_groups: bool = False,
    model: torch.nn.Module | None = None,
    batch_fn: Callable[..., Any] | None = None,
    loss_fn: Callable[..., Any] | None = None,
) -> tuple[Any, Any, Any, Any]:
    """Train torch reference and attached layeropt copies; return both."""
    model, ref, lo_opt, ref_opt, batch_fn, loss_fn, handle = make_pair(
        model_name, opt_name, kw, attach={}, split_groups=split_groups,
        model=model, batch_fn=batch_fn, loss_fn=loss_fn,
    )
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        data = batch_fn(gen)
        loss_fn(ref, data).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        loss_fn(model, data).backward()
        assert all(p.grad is None for p in model.parameters()), "a .grad survived backward"
        lo_opt.step()  # harmless after an attached backward
        lo_opt.zero_grad()
    handle.remove()
    return ref, ref_opt, model, lo_opt


class Boom(torch.autograd.Function):
    """Identity in forward; raises ``ValueError("boom")`` in the middle of backward."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        raise ValueError("boom")


class InfGrad(torch.autograd.Function):
    """Identity in forward; sends an all-inf gradient to everything upstream."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> torch.Tensor:
        return torch.full_like(g, float("inf"))


class OtherReentrant(torch.autograd.Function):
    """A reentrant checkpoint that is not torch's (as DeepSpeed's or fairscale's):
    ``fn(x)`` without a graph in forward, recomputed in a nested backward."""

    @staticmethod
    def forward(ctx: Any, fn: Callable[[torch.Tensor], torch.Tensor],
                x: torch.Tensor) -> torch.Tensor:
        ctx.fn = fn
        ctx.save_for_backward(x)
        with torch.no_grad():
            return fn(x)

    @staticmethod
    def backward(ctx: Any, g: torch.Tensor) -> tuple[None, torch.Tensor]:
        (x,) = ctx.saved_tensors
        x = x.detach().requires_grad_()
        with torch.enable_grad():
            y = ctx.fn(x)
        torch.autograd.backward(y, g)
        return None, x.grad


class Feedback:
    """A DDP comm hook's state that changes with every call (:func:`feedback_hook`):
    what each bucket's fp16 rounding lost, added to its next gradient - error feedback,
    as PowerSGD keeps. (PowerSGD itself is not run on CPU: on gloo its hook starts an
    all-reduce inside another's callback and hangs now and then, with torch.optim too.)"""

    def __init__(self) -> None:
        self.residual: dict[int, torch.Tensor] = {}
        self.calls = 0


def feedback_hook(state: Feedback, bucket):  # (no annotations: DDP checks them)
    """fp16 compression with error feedback: a deterministic comm hook with state."""
    import torch.distributed as dist

    state.calls += 1
    buffer = bucket.buffer()
    residual = state.residual.get(bucket.index())  # (none, or DDP rebuilt its buckets)
    same = residual is not None and residual.shape == buffer.shape
    total = buffer + residual if same else buffer.clone()
    compressed = total.to(torch.float16)
    state.residual[bucket.index()] = total - compressed.to(total.dtype)
    compressed.div_(dist.get_world_size())

    def decompress(fut):
        buffer.copy_(fut.value()[0])
        return buffer

    return dist.all_reduce(compressed, async_op=True).get_future().then(decompress)


def comm_hook(name: str) -> tuple[Any, Any]:
    """A DDP communication hook by name and a fresh state for it: torch's ``fp16``,
    ``bf16`` (NCCL only: DDP refuses it on gloo) and ``allreduce`` default hooks, and
    ``feedback`` (:func:`feedback_hook`)."""
    if name == "feedback":
        return feedback_hook, Feedback()
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

    hook = {"fp16": "fp16_compress_hook", "bf16": "bf16_compress_hook",
            "allreduce": "allreduce_hook"}[name]
    return getattr(default_hooks, hook), None  # (the state: the default process group)


def leave_rank() -> NoReturn:
    """End a torchrun-launched test rank whose results are saved: wait for the other
    ranks, close the group, and exit without the interpreter's teardown. There gloo's
    and the store's threads, still held by the tools' reference cycles, once aborted a
    CI run's rank 0 ("terminate called without an active exception", 2026-12-05)."""
    gc.collect()  # (the tools' models and groups die while the interpreter still runs)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def one_process_group(backend: str = "gloo") -> Any:
    """A process group of this process alone (a generator for a module fixture)."""
    if dist.is_initialized():
        yield
        return
    # (an in-memory store: no port, which another test's processes could take first)
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def scaled_step(lo: bool, loss: torch.Tensor, opt: Any, scaler: Any) -> None:
    """One GradScaler step: torch's recipe, or layeropt.backward(scaler=) (``lo``)."""
    if lo:
        layeropt.backward(scaler.scale(loss), scaler=scaler)
    else:
        scaler.scale(loss).backward()
    scaler.step(opt)
    scaler.update()
