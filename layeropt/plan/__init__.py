"""Will a training step fit, and with which settings: answered on the CPU, for any size.

``layeropt.plan`` *executes* one steady-state training step on fake tensors
(``FakeTensorMode``: shapes and dtypes, no memory) under a dispatcher-level
count of live tensor bytes, once per configuration: ``torch.optim.AdamW``
(fused, foreach), ``layeropt.AdamW`` updating each layer in backward,
activation checkpointing, a chunked LM loss, low-bit optimizer states. Each
row gives the step's peak, what is alive at the peak (parameters, optimizer
state, gradients, activations, other), where in the step it falls, and
whether it fits a GPU's memory with a stated margin, and which one to use
(:attr:`Plan.choice`). A 7B model took 28 s to 163 s of CPU time and about
420 MiB of RAM per process on the 2-core Linux machines of ``docs/plan.md``
(torch 2.13 CPU, 2026-12-01 and 2026-12-02). A configuration that layeropt has not run on a GPU
(:attr:`Variant.run_on_a_gpu`) says so where the plan says it fits.

On CPU the planned peak equals the live tensor bytes of the real run to the
byte (``tests/test_plan.py``). A GPU holds more than the live bytes: the step's
allocations and frees are replayed through PyTorch's CUDA caching allocator
(:mod:`layeropt.plan.allocator`: its segments, rounding and fragmentation, and
cuBLAS's workspaces), and what it reserves plus the CUDA context
(:class:`Margin`) is the row's *need*, which decides whether it fits; on an
H200 the need covered the device's use in each of the 10 steps measured
(``docs/plan.md``).

Command line: ``python -m layeropt plan llama-2-7b --gpu-memory 24GiB``.

Example:
    >>> import layeropt.plan
    >>> p = layeropt.plan.plan("llama-3.2-1b", seq=2048, gpu_memory="24GiB")  # doctest: +SKIP
    >>> print(p.table())  # doctest: +SKIP
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import Tensor, nn

from ..memory import format_bytes
from .devices import TARGETS
from .execute import Measurement, simulate
from .link import H200, Link
from .render import GPU_MEMORY_RANGE, Margin, Plan, parse_gpu_memory, parse_size
from .tracker import CATEGORIES, LiveBytes
from .variants import OPTIMIZERS, Variant, default_variants
from .workloads import BUILTIN_SHAPES, PlanError, Workload, hf_workload

__all__ = [
    "plan",
    "Plan",
    "Variant",
    "Measurement",
    "Margin",
    "Workload",
    "PlanError",
    "LiveBytes",
    "CATEGORIES",
    "OPTIMIZERS",
    "BUILTIN_SHAPES",
    "parse_size",
    "parse_gpu_memory",
    "GPU_MEMORY_RANGE",
    "Link",
    "H200",
]

_DTYPES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp32": torch.float32,
           "float32": torch.float32, "fp16": torch.float16, "float16": torch.float16}  # fmt: skip
_NAMES = {torch.bfloat16: "bf16", torch.float32: "fp32", torch.float16: "fp16"}

#: Loggers that talk while a plan imports and runs their libraries, about
#: nothing a plan uses: torchao's and bitsandbytes' optional GPU/CPU kernels
#: that fail to load (and ``kernels``, which bitsandbytes asks for them: offline it
#: says it skips a publisher check), torch's deprecation of Enum pytree constants
#: (torchao registers some), transformers' ``loss_type=None`` in every config.
_NOISY_LOGGERS = ("torchao", "bitsandbytes", "kernels", "torch.utils._pytree",
                  "transformers.modeling_utils")


def plan(
    model: str | os.PathLike[str] | Callable[[], nn.Module] | Workload | Any,
    *,
    inputs: Callable[[], Any] | None = None,
    loss: Callable[[nn.Module, Any], Tensor] | None = None,
    checkpoint: Callable[[nn.Module], Any] | None = None,
    chunked_loss: Callable[[nn.Module, Any], Tensor] | None = None,
    seq: int | None = None,
    batch: int = 1,
    max_positions: int | None = None,
    dtype: str | torch.dtype | None = None,
    gpu_memory: int | str | None = None,
    margin: Margin | str | None = None,
    variants: Iterable[Variant] | str | None = None,
    optimizers: Iterable[str] | None = None,
    device: str = "cuda",
    bucket_cap_mb: float | None = None,
    progress: Callable[[int, int, Variant], None] | None = None,
    jobs: int = 1,
    accumulate: int = 1,
    link_gbps: float | str | Link = H200,
    attention: str | None = None,
    max_norm: float | None = None,
) -> Plan:
    """Plan one training step's memory under several configurations.

    Args:
        model: a Hugging Face causal LM - a ``config.json`` path, a directory
            holding one, a model name whose config is in the local HF cache,
            a built-in shape (:data:`BUILTIN_SHAPES`: ``"llama-2-7b"``,
            ``"llama-3.2-1b"``, ``"gpt2"`` ...) or a ``transformers`` config -
            or, for any other model, a factory ``() -> nn.Module`` (with
            ``inputs`` and ``loss``), or a :class:`Workload`.
        inputs: for a model factory: ``() -> batch``.
        loss: for a model factory: ``(model, batch) -> scalar loss``.
        checkpoint: for a model factory: ``(model) -> handle`` turning
            activation checkpointing on (e.g. ``lambda m:
            layeropt.checkpoint_modules(m, names="blocks.*")``); the handle's
            ``remove()`` (or the handle itself, if callable) turns it off.
            Without it there are no checkpointing rows.
        chunked_loss: for a model factory: the same loss without full logits.
        seq: tokens per sequence (Hugging Face models; default 2048, or the
            model's positions if fewer).
        batch: sequences per batch (Hugging Face models).
        max_positions: a Hugging Face model's positions, set in its config
            before it is built, for a ``seq`` longer than the config's.
        dtype: ``"bf16"`` (default for Hugging Face models) or ``"fp32"``:
            the parameters' dtype. For a factory: torch's default dtype while
            ``model`` and ``inputs`` run (build the model in its dtype there:
            ``.to(dtype)`` fails on fake parameters).
        gpu_memory: the GPU's memory (``"24GiB"``, bytes as an int), to say
            what fits; ``"24GB"`` is read as 24 GiB, as GPU makers mean it
            (:func:`parse_gpu_memory`, noted in the header). From 1 GiB to
            1 TiB (:data:`GPU_MEMORY_RANGE`), and more
            than the margin's fixed part: anything else is refused before
            planning.
        margin: what a row needs beyond the memory the caching allocator
            reserves (:class:`Margin`, or ``"832MiB"``, ``"1GiB+5%"``; default:
            the CUDA context measured on an H200 and a safety, 832 MiB).
        variants: the configurations (default: :func:`default_variants`);
            ``"all"`` for every combination.
        optimizers: keep only these optimizer names (:data:`OPTIMIZERS`).
        device: ``"cuda"`` (default) models a GPU's kernels; ``"cpu"`` models
            torch's reference CPU kernels (what the tests compare against).
        bucket_cap_mb: ``layeropt.attach``'s ``bucket_cap_mb`` (default: the
            library's).
        progress: called as ``progress(i, n, variant)`` before each row.
        jobs: processes sharing the rows (forked workers, Linux only, from a
            process with no other Python thread and no CUDA context; elsewhere
            the rows run in this one; the numbers do not depend on it). The
            command line uses one per core, up to 4.
        accumulate: micro-batches per training step (gradient accumulation:
            torch.optim sums them, layeropt holds all but the last with
            ``no_step()``); above 1, state offload rows come twice, with the held
            gradients on the GPU and in host memory.
        link_gbps: the host link's rates, for the step-time floor of rows that
            copy state or gradients over it: a :class:`~layeropt.plan.link.Link`,
            one rate in GB/s (each way, the two directions at once adding up) or
            ``"TO_GPU,TO_HOST,BOTH"`` (default: :data:`~layeropt.plan.link.H200`,
            the link an H200 measured: 54.9, 54.7 and 88.0 GB/s, 2026-12-04).
        attention: a Hugging Face model's attention implementation, ``"sdpa"``
            (default: flash attention on the ``"cuda"`` target) or ``"eager"``
            (its matmuls and softmax, as ``attn_implementation="eager"`` runs them).
        max_norm: clip the gradients' total norm to it in every row, as a loop
            calling ``clip_grad_norm_(params, max_norm)`` before ``step()`` does
            (torch's rows) and ``layeropt.backward(loss, max_norm=max_norm)`` on
            the last micro-batch (layeropt's: a measure pass, then the step pass;
            a Hugging Face model's chunked loss then with ``impl="chunked"``, whose
            backward runs twice); default ``None``, no clipping.

    Returns:
        The :class:`Plan`: ``.table()``, ``.to_dict()``, ``.plot(path)``,
        ``.choice``, ``.rows``.

    Raises:
        PlanError: the model or an argument cannot be planned (the message
            says how to fix it); a ``gpu_memory`` no GPU has.

    Example:
        >>> from layeropt.models import MLP
        >>> p = plan(lambda: MLP(1024, 4096, depth=4), inputs=lambda: torch.randn(8, 1024),
        ...          loss=lambda m, x: m(x).square().mean(), dtype="fp32",
        ...          optimizers=["torch.optim.AdamW", "layeropt.AdamW"])
        >>> for r in p.rows:
        ...     print(r.variant.label, r.peak_bytes // 2**20, "MiB,", r.phase)
        layeropt.AdamW (fused) + state offload 401 MiB, backward
        layeropt.AdamW (fused) 689 MiB, backward
        torch.optim.AdamW (fused) 832 MiB, backward
        torch.optim.AdamW (foreach) 1040 MiB, optimizer step
    """
    torch_dtype = _dtype(dtype)
    if device not in TARGETS:
        raise PlanError(f"device must be one of {TARGETS}, got {device!r}")
    gpu, note = (None, "") if gpu_memory is None else parse_gpu_memory(gpu_memory)
    margin = Margin.parse(margin) if isinstance(margin, str) else (margin or Margin())
    link = Link.parse(link_gbps)
    if gpu is not None and margin.budget(gpu) <= 0:
        raise PlanError(
            f"the margin ({margin.describe()}) leaves nothing of {format_bytes(gpu)} for the "
            "step: give the GPU's whole memory, or a smaller margin (--margin)"
        )
    with _quiet_libraries():
        if isinstance(model, Workload):
            workload = model
        elif callable(model) and not isinstance(model, (str, os.PathLike)):
            workload = _custom(model, inputs, loss, checkpoint, chunked_loss, torch_dtype)
        else:
            torch_dtype = torch_dtype or torch.bfloat16
            workload = hf_workload(
                model, seq=seq, batch=batch, dtype=torch_dtype, max_positions=max_positions,
                attention=attention or "sdpa",
                chunked_impl="auto" if max_norm is None else "chunked",  # (two passes)
            )
        if attention is not None and workload.attention is None:
            raise PlanError("attention= sets a Hugging Face model's attn_implementation; "
                            "a model factory or a Workload builds its own attention: leave "
                            "it out")
        rows = _variants(workload, variants, optimizers, accumulate)
        n_params, measured = simulate(
            workload, rows, device=device, bucket_cap_mb=bucket_cap_mb, progress=progress,
            jobs=jobs, accumulate=accumulate, max_norm=max_norm,
        )  # fmt: skip
        result = Plan(
            model=workload.name,
            parameters=n_params,
            rows=measured,
            dtype=_NAMES.get(torch_dtype, "") if torch_dtype else "",
            seq=workload.seq,
            batch=workload.batch,
            device=device,
            gpu_memory=gpu,
            margin=margin,
            notes=[note] if note else [],
            accumulate=accumulate,
            link=link,
            attention=workload.attention,
            max_norm=max_norm,
        )

        if not isinstance(variants, str) and variants is not None:
            return result  # (the rows asked for, no more)

        def measure(variant: Variant) -> Measurement:
            return simulate(workload, [variant], device=device, bucket_cap_mb=bucket_cap_mb,
                            accumulate=accumulate, max_norm=max_norm)[1][0]

        return _keep_held_on_the_gpu(result, measure)


def _keep_held_on_the_gpu(result: Plan, measure: Callable[[Variant], Measurement],
                          tries: int = 3) -> Plan:
    """``result`` with one more row where its recommendation moves every held gradient
    to host memory and leaves room on the GPU: the same configuration keeping the held
    gradients of whole buckets on the GPU up to ``N`` bytes
    (``offload_state(opt, held_device_bytes=N)``: fewer bytes over the link, the same
    results) - of at most ``tries`` planned, the one keeping the most whose need fits.

    The first ``N`` is 95% of the room over what each kept byte adds to the need, by
    the row with every held gradient on the GPU (which does not fit, or it would be
    the recommendation); while none has fitted, the next scales ``N`` by what the last
    one added (toward 95% of the room); once one fits, the next halves the interval
    between the most that fitted and the least that did not. ``N`` is whole MiB; a row
    that keeps no bucket on the GPU (``N`` under the smallest) is not added.
    """
    choice = result.choice
    if (choice is None or not choice.variant.held_on_host or choice.variant.held_device_bytes
            or result.gpu_memory is None):
        return result
    on_gpu = dataclasses.replace(choice.variant, held_on_host=False)
    pair = next((r for r in result.rows if r.variant == on_gpu), None)
    room = result.gpu_memory - result.need(choice)
    held = choice.held_host_bytes
    if pair is None or room <= 0 or held <= 2**20:
        return result
    per_byte = max(1.0, (result.need(pair) - result.need(choice)) / held)
    keep, best, over = 0.95 * room / per_byte, None, held  # over: the least N that did not fit
    for _ in range(tries):
        keep = min(int(keep), over - 2**20) // 2**20 * 2**20  # whole MiB: a number to copy
        fitted = 0 if best is None else best.variant.held_device_bytes
        if keep < 2**20 or keep <= fitted:
            break
        row = measure(dataclasses.replace(choice.variant, held_device_bytes=keep))
        kept = held - row.held_host_bytes  # (whole buckets: what N really keeps)
        if result.fits(row) and kept >= 2**20:
            best = row
        elif not result.fits(row):
            over = keep
        added = result.need(row) - result.need(choice)
        if best is not None and over < held:  # between the most that fitted and the least not
            keep = (best.variant.held_device_bytes + over) / 2
        elif added > 0:
            keep = keep * 0.95 * room / added
        else:  # (nothing more needed: a larger N)
            keep = (keep + over) / 2
    return result if best is None else dataclasses.replace(result, rows=[*result.rows, best])


@contextlib.contextmanager
def _quiet_libraries() -> Iterator[None]:
    """:data:`_NOISY_LOGGERS` at ``ERROR`` while planning (their levels restored after)."""
    loggers = [logging.getLogger(name) for name in _NOISY_LOGGERS]
    saved = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(max(lg.getEffectiveLevel(), logging.ERROR))
    try:
        yield
    finally:
        for lg, level in zip(loggers, saved):
            lg.setLevel(level)


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype | None) -> Iterator[None]:
    """The factories run with ``dtype`` as torch's default dtype.

    (Not ``model.to(dtype)``: converting a module of fake parameters fails in
    ``FakeTensorMode``, which holds weak references to them.)
    """
    if dtype is None:
        yield
        return
    saved = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(saved)


def _dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype.lower() not in _DTYPES:
        raise PlanError(f"dtype must be bf16 or fp32 (or fp16), got {dtype!r}")
    return _DTYPES[dtype.lower()]


def _variants(
    workload: Workload, variants: Iterable[Variant] | str | None, optimizers: Iterable[str] | None,
    accumulate: int = 1,
) -> list[Variant]:
    if variants is None or variants == "default":
        rows = default_variants(workload, optimizers, accumulate=accumulate)
    elif variants == "all":
        rows = default_variants(workload, optimizers, every=True, accumulate=accumulate)
    elif isinstance(variants, str):
        raise PlanError(f"variants must be 'default', 'all' or a list of Variant, got {variants!r}")
    else:
        rows = list(variants)
        if optimizers is not None:
            wanted = set(optimizers)
            rows = [v for v in rows if v.optimizer in wanted]
    if not rows:
        raise PlanError(
            "no configuration to plan: the optimizers asked for are not installed or "
            f"not known (known: {', '.join(OPTIMIZERS)})"
        )
    return rows


def _custom(
    factory: Callable[[], nn.Module],
    inputs: Callable[[], Any] | None,
    loss: Callable[[nn.Module, Any], Tensor] | None,
    checkpoint: Callable[[nn.Module], Any] | None,
    chunked_loss: Callable[[nn.Module, Any], Tensor] | None,
    dtype: torch.dtype | None,
) -> Workload:
    if inputs is None or loss is None:
        raise PlanError(
            "a model factory needs inputs= (() -> batch) and loss= ((model, batch) -> "
            "scalar); or pass a Hugging Face config / built-in shape name instead"
        )

    def build() -> nn.Module:
        with _default_dtype(dtype):
            m = factory()
        if not isinstance(m, nn.Module):
            raise PlanError(f"the model factory returned {type(m).__name__}, not an nn.Module")
        return m.train()

    def make_inputs(m: nn.Module) -> Any:
        with _default_dtype(dtype):
            return inputs()

    def on(m: nn.Module) -> Callable[[], None]:
        assert checkpoint is not None
        handle = checkpoint(m)
        return handle if callable(handle) else getattr(handle, "remove", lambda: None)

    name = getattr(factory, "__name__", type(factory).__name__)
    return Workload(
        name="model" if name == "<lambda>" else name,
        build=build,
        inputs=make_inputs,
        loss=loss,
        checkpoint=None if checkpoint is None else on,
        chunked_loss=chunked_loss,
    )
