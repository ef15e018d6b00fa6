"""``python -m layeropt demo``: torch.optim.Adam vs layeropt.Adam, side by side.

Two copies of one model train on the same batches: one with
``torch.optim.Adam(fused=True)`` (``backward(); step(); zero_grad()``), one with
``layeropt.Adam(fused=True)`` attached to the model (each layer updated in
backward, its gradient freed at once). The demo prints, for both:

* the peak memory of a training step, and what it was made of at that
  moment: parameters, optimizer state, gradients and activations/other
  (:mod:`layeropt.report`; the rows sum to the peak);
* the most gradient memory held at any one moment of the step - the fair
  comparison of gradients, since each run's peak of memory falls at its own
  moment (layeropt's often while fewer gradients are alive than at its most);
* the step time of layeropt relative to torch: the median, over interleaved
  pairs of steps, of the ratio of the two times. On CPU both train with one
  intra-op thread and a step is timed by this process's CPU time
  (``time.process_time``), which a busy machine barely moves, unlike the
  wall clock; on CUDA by the wall clock around a synchronised step. Each
  pair runs the two back to back, alternating which goes first, with the
  cyclic garbage collector paused, as in ``benchmarks/bench_step.py``. The
  ratio is printed only when the run pins it down: when a 95% confidence
  interval of the median (distribution-free, from the order statistics of
  the pair ratios: :func:`_median_interval`) exists - 6 pairs or more - and
  lies within :data:`TIME_TOLERANCE` (5%) of it. Otherwise one line says it is
  not shown and which run measures it (the default ``--tiny`` run has 2
  pairs);
* the largest difference between the two models' parameters afterwards
  (``0.0`` on CPU in fp32: the update math is torch's own);
* a few lines beneath the table that read it (:func:`_notes`): where the
  gradient saving comes from, why ``activations/other`` can be larger at
  layeropt's peak (each run is read at its own peak, and the two peaks fall
  at different moments of the step), why a model whose layers are reused in a
  loop saves nothing at its peak, and how precisely the step time is known.

Example:
    >>> result = run_demo("mlp", tiny=True, progress=False)  # doctest: +SKIP
    >>> result.max_param_diff  # doctest: +SKIP
    0.0
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import gc
import importlib.util
import inspect
import math
import os
import statistics
import sys
import textwrap
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any, TextIO

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

import layeropt

from .memory import format_bytes
from .models import MLP, LoopNet, TinyGPT, UNet
from .report import (
    _COLORS, CATEGORIES, GRADIENTS, OTHER, PlotDependencyError, StepMemory, report_step,
)  # fmt: skip

__all__ = [
    "DEMO_MODELS", "Checkpointed", "DemoResult", "checkpoint_blocks", "plot_demo", "run_demo",
]  # fmt: skip

TORCH, LAYEROPT = "torch.optim.Adam", "layeropt.Adam"

#: The step-time ratio is printed only when a 95% confidence interval of its
#: median lies within this fraction of it (both ends).
TIME_TOLERANCE = 0.05
_CONFIDENCE = 0.95
#: What the line that withholds the step time suggests.
_STEPS_FOR_TIME = 40


class Checkpointed(nn.Module):
    """Run ``inner`` under non-reentrant activation checkpointing.

    The inner module's activations are recomputed in backward instead of
    being kept; ``use_reentrant=False`` is the mode whose gradients land once
    per parameter, as layeropt needs.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(self, *args: Any) -> Any:
        return checkpoint(self.inner, *args, use_reentrant=False)


# Which submodules ``--checkpoint`` wraps, per built-in model.
_BLOCKS = {
    "gpt": ["blocks"],
    "mlp": ["layers"],
    "loop": ["extractor"],
    "unet": ["enc1", "enc2", "mid", "dec1"],
}


def checkpoint_blocks(model: nn.Module, names: list[str]) -> nn.Module:
    """Wrap the named submodules (each item of a ModuleList) in :class:`Checkpointed`.

    Args:
        model: the model to change in place.
        names: attribute names of submodules or of ``nn.ModuleList`` s.

    Returns:
        ``model``.

    Example:
        >>> m = checkpoint_blocks(MLP(), ["layers"])
        >>> type(m.layers[0]).__name__
        'Checkpointed'
    """
    for name in names:
        sub = getattr(model, name)
        if isinstance(sub, nn.ModuleList):
            for i, block in enumerate(sub):
                sub[i] = Checkpointed(block)
        else:
            setattr(model, name, Checkpointed(sub))
    return model


@dataclasses.dataclass
class _Spec:
    build: Callable[[], nn.Module]
    batch: Callable[[nn.Module, torch.Generator], Any]
    loss: Callable[[nn.Module, Any], Tensor]
    describe: str


def _lm_batch(size: int) -> Callable[[nn.Module, torch.Generator], Tensor]:
    def batch(m: nn.Module, gen: torch.Generator) -> Tensor:
        return torch.randint(0, m.vocab, (size, m.seq + 1), generator=gen)

    return batch


def _lm_loss(m: nn.Module, tokens: Tensor) -> Tensor:
    logits = m(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def _regression(x_shape: tuple[int, ...], y_shape: tuple[int, ...]) -> Any:
    def batch(m: nn.Module, gen: torch.Generator) -> tuple[Tensor, Tensor]:
        return torch.randn(x_shape, generator=gen), torch.randn(y_shape, generator=gen)

    return batch


def _mse(m: nn.Module, data: tuple[Tensor, Tensor]) -> Tensor:
    return F.mse_loss(m(data[0]), data[1])


def _spec(name: str, tiny: bool) -> _Spec:
    if name == "gpt":
        kw = (
            {"vocab": 256, "d": 128, "layers": 2, "heads": 2, "seq": 16}
            if tiny
            else {"vocab": 4096, "d": 384, "layers": 6, "heads": 6, "seq": 64}
        )
        b = 2
        return _Spec(
            lambda: TinyGPT(**kw), _lm_batch(b), _lm_loss,
            f"TinyGPT(vocab={kw['vocab']}, d={kw['d']}, layers={kw['layers']}), "
            f"batch {b}x{kw['seq']} tokens",
        )  # fmt: skip
    if name == "mlp":
        d, h, depth, b = (64, 256, 4, 8) if tiny else (512, 2048, 4, 64)
        return _Spec(
            lambda: MLP(d, h, depth, 16), _regression((b, d), (b, 16)), _mse,
            f"MLP({d}->{h}x{depth}->16), batch {b}",
        )  # fmt: skip
    if name == "unet":
        w, px, b = (32, 8, 1) if tiny else (128, 16, 2)
        return _Spec(
            lambda: UNet(3, w), _regression((b, 3, px, px), (b, 3, px, px)), _mse,
            f"UNet(width={w}), batch {b}x3x{px}x{px}",
        )  # fmt: skip
    if name == "loop":
        d, n, b = (256, 3, 4) if tiny else (1024, 8, 32)
        return _Spec(
            lambda: LoopNet(d, n), _regression((b, d), (b, 2)), _mse,
            f"LoopNet(d={d}, {n} iterations of one extractor), batch {b}",
        )  # fmt: skip
    raise ValueError(f"unknown demo model {name!r}; choose one of {DEMO_MODELS}")


DEMO_MODELS = ("gpt", "unet", "loop", "mlp")


@dataclasses.dataclass
class DemoResult:
    """What :func:`run_demo` measured.

    Attributes:
        memory: run name (``"torch.optim.Adam"``, ``"layeropt.Adam"``) -> the
            memory breakdown of one training step.
        time_ratio: layeropt step time / torch step time, median over pairs
            (``None`` when fewer than 3 steps leave no timed pair). Printed
            only when :attr:`time_shown`.
        pairs: how many interleaved pairs of steps were timed.
        max_param_diff: largest absolute difference between the two models'
            parameters after training.
        table: the printed table, with the notes that explain it beneath.
        pair_ratios: layeropt/torch time of each timed pair, in order.
        time_interval: a 95% confidence interval of ``time_ratio``
            (:func:`_median_interval`; ``None`` below 6 pairs).
    """

    memory: dict[str, StepMemory]
    time_ratio: float | None
    pairs: int
    max_param_diff: float
    table: str
    pair_ratios: list[float] = dataclasses.field(default_factory=list)
    time_interval: tuple[float, float] | None = None

    @property
    def time_shown(self) -> bool:
        """Whether the run measured the step time well enough to print it."""
        return _time_shown(self.time_ratio, self.time_interval)


def _progress(done: int, total: int, stream: TextIO) -> None:
    width = 24
    filled = width * done // total
    end = "\n" if done == total else ""
    stream.write(f"\r  training [{'#' * filled}{'.' * (width - filled)}] {done}/{total}{end}")
    stream.flush()


def run_demo(
    model: str = "gpt",
    *,
    steps: int | None = None,
    device: str = "cpu",
    use_checkpoint: bool = False,
    tiny: bool = False,
    plot: str | None = None,
    lr: float = 1e-3,
    progress: bool = True,
    stream: TextIO | None = None,
) -> DemoResult:
    """Train one model with torch.optim.Adam and with layeropt.Adam, and compare.

    Args:
        model: one of :data:`DEMO_MODELS`.
        steps: training steps for each optimizer (default 8, or 4 with ``tiny``);
            the first warms up, the second is profiled for memory, the rest
            are timed in interleaved pairs.
        device: ``"cpu"`` or ``"cuda"``.
        use_checkpoint: checkpoint each block's activations (non-reentrant).
        tiny: a model small enough for a smoke run of a few seconds.
        plot: if given, write a PNG of memory over one step there (needs matplotlib).
        lr: Adam's learning rate.
        progress: draw a progress bar on stderr.
        stream: where to print the table (default stdout).

    Returns:
        A :class:`DemoResult`.

    Raises:
        ValueError: unknown model, fewer than 2 steps, or CUDA unavailable.
        PlotDependencyError: ``plot`` was asked for without matplotlib installed.

    Example:
        >>> run_demo("mlp", tiny=True, progress=False).max_param_diff  # doctest: +SKIP
        0.0
    """
    out = stream if stream is not None else sys.stdout
    steps = steps if steps is not None else (4 if tiny else 8)
    if steps < 2:
        raise ValueError(f"the demo needs --steps >= 2 (one warm-up, one measured), got {steps}")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda was asked for but torch.cuda.is_available() is False")
    if plot is not None and importlib.util.find_spec("matplotlib") is None:
        raise PlotDependencyError(
            "--plot needs matplotlib: pip install 'layeropt[plot]' (or leave out --plot)"
        )
    spec = _spec(model, tiny)
    torch.manual_seed(0)
    base = spec.build()
    if use_checkpoint:
        checkpoint_blocks(base, _BLOCKS[model])
    ref, lo = base.to(dev), copy.deepcopy(base).to(dev)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=lr, fused=True)
    lo_opt = layeropt.Adam(lo.parameters(), lr=lr, fused=True)
    handle = layeropt.attach(lo, lo_opt)
    # attach's bucket cap (the notes say when the whole model's gradients fit under it)
    cap_mb = inspect.signature(layeropt.attach).parameters["bucket_cap_mb"].default
    gen = torch.Generator().manual_seed(1)
    batches = [_to(spec.batch(base, gen), dev) for _ in range(steps)]
    runs = {TORCH: (ref, ref_opt), LAYEROPT: (lo, lo_opt)}

    now = _clock(dev)

    def step(name: str, i: int) -> float:
        m, opt = runs[name]
        _sync(dev)
        start = now()
        spec.loss(m, batches[i]).backward()
        opt.step()
        opt.zero_grad()
        _sync(dev)
        return now() - start

    bar = progress and steps > 1
    memory: dict[str, StepMemory] = {}
    ratios: list[float] = []
    with _timing_threads(dev):
        for i in range(steps):
            if i == 1:
                for name, (m, opt) in runs.items():
                    memory[name] = report_step(lambda n=name: step(n, 1), m, opt, dev)
            else:
                order = [TORCH, LAYEROPT] if i % 2 else [LAYEROPT, TORCH]
                paused = gc.isenabled()
                gc.disable()  # a collection inside one step of a pair would skew its ratio
                try:
                    t = {name: step(name, i) for name in order}
                finally:
                    if paused:
                        gc.enable()
                if i > 1:
                    ratios.append(t[LAYEROPT] / t[TORCH])
            if bar:
                _progress(i + 1, steps, sys.stderr)
    handle.remove()
    diff = max(
        (a.detach() - b.detach()).abs().max().item()
        for a, b in zip(ref.parameters(), lo.parameters())
    )
    n_params = sum(p.numel() for p in ref.parameters())
    title = (
        f"layeropt demo: {model} - {spec.describe}\n"
        f"{n_params / 1e6:.2f}M parameters, {_where(dev)}, {steps} steps, "
        f"Adam(lr={lr:g}, fused=True)"
        + (", per-block activation checkpointing" if use_checkpoint else "")
    )
    ratio = statistics.median(ratios) if ratios else None
    interval = _median_interval(ratios)
    shown = _time_shown(ratio, interval)
    table = (
        title + "\n\n" + _table(memory, ratio if shown else None, len(ratios), diff)
        + "\n\n" + "\n".join(_notes(memory, ratios, model, cap_mb))
    )  # fmt: skip
    print(table, file=out)
    if plot is not None:
        plot_demo(memory, plot)
        print(f"\nmemory timeline written to {plot}", file=out)
    return DemoResult(memory, ratio, len(ratios), diff, table, ratios, interval)


def _median_interval(
    ratios: list[float], confidence: float = _CONFIDENCE
) -> tuple[float, float] | None:
    """A confidence interval of the median of ``ratios``, free of any noise model.

    The sign test's interval: the k-th smallest and k-th largest value, with
    the largest k for which the median lies between them with probability at
    least ``confidence`` (``1 - 2 P(Binomial(n, 1/2) < k)``), whatever the
    distribution of the ratios, so long as the pairs are independent.

    Returns:
        ``(low, high)``, or ``None`` when there are too few ratios (under 6
        for 95%: even the smallest and the largest of 5 miss the median with
        probability 2/32).

    Example:
        >>> _median_interval([1.0, 1.1, 0.9, 1.2, 0.8])  # 5: no 95% interval
        >>> _median_interval([1.0, 1.1, 0.9, 1.2, 0.8, 1.05])  # 6: the range
        (0.8, 1.2)
    """
    n, s = len(ratios), sorted(ratios)
    k, tail = 0, 0.0  # tail = P(Binomial(n, 1/2) <= k - 1)
    while k < n:
        p = math.comb(n, k) / 2**n
        if 2 * (tail + p) > 1 - confidence:
            break
        tail, k = tail + p, k + 1
    return (s[k - 1], s[n - k]) if k else None


def _time_shown(ratio: float | None, interval: tuple[float, float] | None) -> bool:
    """Whether ``interval`` pins ``ratio`` down to :data:`TIME_TOLERANCE`."""
    if ratio is None or interval is None:
        return False
    low, high = interval
    return low >= ratio * (1 - TIME_TOLERANCE) and high <= ratio * (1 + TIME_TOLERANCE)


def plot_demo(memory: Mapping[str, StepMemory], path: str | os.PathLike[str]) -> str:
    """Save the demo's PNG: memory over one step per run, on one time axis.

    Top row: each run's memory stacked by category (one memory scale for
    all). Bottom row: the gradients alone, each run on its own scale, so
    that a band too thin to see above (layeropt's one layer at a time) shows
    its shape; its peak is written on it. Every panel shares the time axis.

    Args:
        memory: run name -> its :class:`~layeropt.report.StepMemory`.
        path: where to write the PNG.

    Returns:
        ``path`` as a string.

    Raises:
        PlotDependencyError: matplotlib is not installed.

    Example:
        >>> plot_demo(run_demo("mlp", tiny=True).memory, "demo.png")  # doctest: +SKIP
        'demo.png'
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotDependencyError(
            "plotting needs matplotlib: pip install 'layeropt[plot]' (or leave out --plot)"
        ) from e
    mib = 2**20
    runs = list(memory.items())
    fig = Figure(figsize=(5.5 * len(runs), 5.6), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(2, len(runs), sharex=True, squeeze=False,
                        gridspec_kw={"height_ratios": [3, 1.3]})  # fmt: skip
    top = max(r.peak for _, r in runs) / mib
    end = max(r.times_ms[-1] for _, r in runs if r.times_ms)
    grad_color = _COLORS[GRADIENTS]
    for col, (name, r) in enumerate(runs):
        ax, gax = axes[0][col], axes[1][col]
        ax.stackplot(
            r.times_ms, *[[b / mib for b in r.series[c]] for c in CATEGORIES],
            labels=CATEGORIES, colors=[_COLORS[c] for c in CATEGORIES], step="post",
        )  # fmt: skip
        ax.set_title(f"{name}: peak {format_bytes(r.peak)}")
        ax.set_ylim(0, top * 1.08)
        ax.grid(alpha=0.3)
        grads = [b / mib for b in r.series[GRADIENTS]]
        gax.fill_between(r.times_ms, grads, step="post", color=grad_color, alpha=0.35, lw=0)
        gax.step(r.times_ms, grads, where="post", color=grad_color, lw=1.2)
        peak_g = r.max_by_category[GRADIENTS]
        gax.set_ylim(0, max(peak_g / mib, 1e-9) * 1.35)
        gax.text(0.01, 0.95, f"gradients alone (own scale); most held at once: "
                 f"{format_bytes(peak_g)}",
                 transform=gax.transAxes, va="top", fontsize="small")  # fmt: skip
        gax.set_xlabel("time in step (ms)")
        gax.grid(alpha=0.3)
    axes[0][0].set_xlim(0, end * 1.02)
    axes[0][0].set_ylabel(f"memory on {runs[0][1].device} (MiB)")
    axes[1][0].set_ylabel("gradients (MiB)")
    handles, labels = axes[0][-1].get_legend_handles_labels()
    axes[0][-1].legend(handles[::-1], labels[::-1], loc="upper right", fontsize="small")
    fig.savefig(os.fspath(path), dpi=110)
    return os.fspath(path)


#: The table's row of the most gradient memory held at any one moment.
MOST_GRADIENTS = "most gradient memory at once"
#: The line under the peak that heads its breakdown (the rows sum to the peak).
AT_PEAK = "  of which, at that moment:"


def _table(memory: dict[str, StepMemory], ratio: float | None, pairs: int, diff: float) -> str:
    """The table; ``ratio`` ``None`` leaves out the step-time row (see :func:`_notes`)."""
    a, b = memory[TORCH], memory[LAYEROPT]
    w = 18
    rows = [f"{'':<30}{TORCH:>{w}}{LAYEROPT:>{w}}{'layeropt/torch':>{w}}"]

    def row(label: str, x: int, y: int) -> str:
        r = f"{y / x:.2f}x" if x else "-"
        return f"{label:<30}{format_bytes(x):>{w}}{format_bytes(y):>{w}}{r:>{w}}"

    rows.append(row("peak memory of a step", a.peak, b.peak))
    rows.append(AT_PEAK)
    for c in CATEGORIES:
        rows.append(row(f"    {c}", a.at_peak[c], b.at_peak[c]))
    rows.append(row(MOST_GRADIENTS, a.max_by_category[GRADIENTS], b.max_by_category[GRADIENTS]))
    if ratio is not None:
        label = f"step time (median of {pairs} pairs)"  # shown: 6 pairs or more
        rows.append(f"{label:<30}{'1.00x':>{w}}{f'{ratio:.2f}x':>{w}}{f'{ratio:.2f}x':>{w}}")
    shown = "0.0" if diff == 0 else f"{diff:.3e}"
    rows.append(f"{'max |parameter difference|':<30}{shown:>{w * 2}}")
    return "\n".join(rows)


# Why a built-in model's gradients complete late (see _notes).
_LATE_GRADIENTS = {
    "loop": "LoopNet's extractor and mix are used in every iteration: their gradients "
    "are complete only as backward ends",
}

_NOTE_WIDTH = 84  # the table's width


def _note(head: str, text: str) -> str:
    """One note: ``head: text`` wrapped to the table's width, continuation indented."""
    return textwrap.fill(
        f"{head}: {text}", _NOTE_WIDTH, subsequent_indent="  ", break_on_hyphens=False
    )


def _notes(
    memory: Mapping[str, StepMemory], ratios: list[float], model: str, cap_mb: float = 1.0
) -> list[str]:
    """The lines printed beneath the table: what its rows mean for this run.

    Each statement is printed only when this run's numbers show it:

    * gradients: torch.optim holds every one until ``step()``; layeropt frees
      each layer's once backward has updated it - or, where layeropt's most
      equals torch.optim's, that it held as much here (pointing to the
      no-saving note below when there is one). The numbers are the table's
      "most gradient memory at once"; where a run held fewer at its peak of
      memory (the breakdown above), the note says that the peak is another
      moment.
    * activations/other (activations, inputs, autograd's buffers) is read at
      each run's own peak. torch.optim's peak comes where it holds all its
      gradients - at the end of backward or in ``step()``, once backward has
      freed most activations - and layeropt's earlier, while they are alive:
      so the row can be larger for layeropt although both runs reach the same
      highest value (measured on the demo's GPT: torch.optim peaks 2 ms before
      backward ends with 12 MiB of autograd buffers for the tied embedding's
      gradient, layeropt early in backward with 25 MiB of activations alive;
      both reach 26.6 MiB at the end of forward).
    * no saving at the peak, when the model's gradients all fit under
      attach's ``bucket_cap_mb`` (the ``--tiny`` models under the default
      1 MiB): complete layers wait to share one step until they hold that
      much, so they are all stepped together at the end of backward.
    * no saving at the peak, otherwise: both runs peak in backward before
      most gradients are complete (LoopNet's shared layers get their last
      contribution as backward ends; until then autograd holds their partial
      sums in both runs).
    * step time: shown (:func:`_time_shown`), its 95% confidence interval;
      not shown, one line that says so and which run measures it.
    """
    t, lo = memory[TORCH], memory[LAYEROPT]
    fmt = format_bytes
    t_most, lo_most = t.max_by_category[GRADIENTS], lo.max_by_category[GRADIENTS]
    fewer = {n: r.at_peak[GRADIENTS] for n, r in ((TORCH, t), (LAYEROPT, lo))
             if r.at_peak[GRADIENTS] < r.max_by_category[GRADIENTS]}  # fmt: skip
    if len(fewer) == 2:
        other = (
            "At their peaks of memory, other moments, torch.optim held "
            f"{fmt(fewer[TORCH])} of them and layeropt {fmt(fewer[LAYEROPT])}."
        )
    elif fewer:
        [(name, held)] = fewer.items()
        who = "torch.optim" if name == TORCH else "layeropt"
        other = f"At its peak of memory, another moment, {who} held {fmt(held)} of them."
    else:
        other = ""
    notes = [""]  # the gradients note, written once it is known whether a reason follows
    t_other, lo_other = t.at_peak[OTHER], lo.at_peak[OTHER]
    highest = (t.max_by_category[OTHER], lo.max_by_category[OTHER])
    reach = (
        f"both runs reach {fmt(highest[0])} at most"
        if highest[0] == highest[1]
        else f"at most {fmt(highest[0])} in torch.optim's run, {fmt(highest[1])} in layeropt's"
    )
    t_grads, lo_grads = t.at_peak[GRADIENTS], lo.at_peak[GRADIENTS]
    no_saving = t_grads > 0 and lo_grads >= 0.95 * t_grads  # under 5% of them freed
    if no_saving and t.max_by_category[GRADIENTS] <= cap_mb * 2**20:
        notes.append(
            _note(
                "no saving at this peak",
                f"all the model's gradients ({fmt(t.max_by_category[GRADIENTS])}) fit under "
                f"attach's bucket_cap_mb={cap_mb:g} (MiB): complete layers wait to share one "
                "step until they hold that much, so layeropt steps them all at the end of "
                "backward; a bigger model (no --tiny) shows the saving.",
            )
        )
    elif no_saving and t_grads < t.max_by_category[GRADIENTS]:
        why = _LATE_GRADIENTS.get(model)
        held = (
            f"both hold {fmt(t_grads)} of gradients there"
            if t_grads == lo_grads
            else f"torch.optim holds {fmt(t_grads)} of gradients there, layeropt {fmt(lo_grads)}"
        )
        notes.append(
            _note(
                "no saving at this peak",
                "both runs peak in backward before most gradients are complete, so "
                + held + (f" ({why})." if why else "."),
            )
        )
    elif lo_other > t_other:
        when = (
            "torch.optim peaks holding all its gradients, after backward has freed most "
            "activations; layeropt peaks earlier, while they are still alive"
            if t.at_peak[GRADIENTS] == t.max_by_category[GRADIENTS]
            else "the two peaks fall at different moments of the step"
        )
        notes.append(
            _note(
                "activations/other",
                "activations, inputs and autograd's buffers, read at each run's own peak: "
                f"{when} ({reach}).",
            )
        )
    if lo_most < t_most:
        freed = (
            f"layeropt frees each layer's once backward has updated it (at most {fmt(lo_most)} "
            "at once)."
        )
    else:  # nothing freed early in this run: say so, and point to the reason if one follows
        because = (
            ", for the reason below."
            if any(n.startswith("no saving at this peak") for n in notes)
            else "."
        )
        same = "as much" if lo_most == t_most else "more"
        freed = f"layeropt held {same} here (at most {fmt(lo_most)} at once){because}"
    notes[0] = _note(
        "gradients",
        f"torch.optim keeps every gradient until step() ({fmt(t_most)} at once); {freed}"
        + (" " + other if other else ""),
    )
    ratio = statistics.median(ratios) if ratios else None
    interval = _median_interval(ratios)
    if interval is not None and _time_shown(ratio, interval):
        notes.append(
            _note(
                "step time",
                f"median of {len(ratios)} pair ratios; with 95% confidence between "
                f"{interval[0]:.2f}x and {interval[1]:.2f}x. Both runs do the same Adam "
                "updates, layeropt's inside backward.",
            )
        )
    else:
        n, tol = len(ratios), f"{TIME_TOLERANCE:.0%}"
        if n == 0:
            why = "no pair of steps was timed"
        elif interval is None:
            pairs = "1 timed pair of steps is" if n == 1 else f"{n} timed pairs of steps are"
            why = f"{pairs} too few to measure it to within {tol}"
        else:
            why = f"its {n} timed pairs of steps varied too much to measure it to within {tol}"
        notes.append(
            _note(
                "step time",
                f"not shown for a run this short ({why}); rerun with "
                f"--steps {_STEPS_FOR_TIME}, or see benchmarks/bench_step.py in the "
                "repository.",
            )
        )
    return notes


def _to(batch: Any, dev: torch.device) -> Any:
    if isinstance(batch, Tensor):
        return batch.to(dev)
    return tuple(t.to(dev) for t in batch)


@contextlib.contextmanager
def _timing_threads(dev: torch.device) -> Iterator[None]:
    """On CPU, train with one intra-op thread (restored afterwards).

    Several threads spin-wait for each other, and on a busy machine that
    spinning counts as CPU time in one step and not in the next; one thread
    makes the CPU-time ratio steady (measured under two busy-loop processes
    on 2 cores, six runs each: one thread and CPU time 0.97-1.04x; the
    default threads and CPU time 0.89-1.83x; one thread and the wall clock
    0.94-1.18x).
    """
    if dev.type != "cpu":
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _clock(dev: torch.device) -> Callable[[], float]:
    """The step timer: process CPU time on CPU (steady on a busy machine), wall on CUDA."""
    return time.perf_counter if dev.type == "cuda" else time.process_time


def _where(dev: torch.device) -> str:
    if dev.type == "cpu":
        return "cpu (1 thread; step time by CPU time)"
    return f"{dev} (step time by wall clock)"


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
