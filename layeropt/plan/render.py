"""A plan's answer: which configurations fit, the smallest change that does, and why.

:class:`Plan` holds one :class:`~layeropt.plan.execute.Measurement` per
configuration, sorted by peak, and renders them as a text table
(:meth:`Plan.table`), one JSON object (:meth:`Plan.to_dict`) or stacked bars
(:meth:`Plan.plot`). A configuration *fits* when its need - what PyTorch's
caching allocator reserves over its steps (simulated) plus the
:class:`Margin` - is at most the GPU's memory.

Example:
    >>> round(Margin().budget(24 * 2**30) / 2**30, 2)
    23.19
"""

from __future__ import annotations

import dataclasses
import math
import os
import re
import textwrap
from typing import Any

from ..memory import format_bytes
from .execute import Measurement
from .link import H200, Link
from .tracker import ACTIVATIONS, CATEGORIES, GRADIENTS, OTHER, STATE
from .variants import LOW_BIT, Variant
from .workloads import PlanError

__all__ = ["Margin", "Plan", "parse_size", "parse_gpu_memory", "GPU_MEMORY_RANGE",
           "CUDA_CONTEXT", "REPLAY_SAFETY"]

#: The GPU memory a plan accepts, in bytes: no GPU has less than 1 GiB or more than 1 TiB.
GPU_MEMORY_RANGE = (2**30, 2**40)

_UNITS = {"": 2**30, "b": 1, "k": 2**10, "kib": 2**10, "kb": 10**3, "m": 2**20, "mib": 2**20,
          "mb": 10**6, "g": 2**30, "gib": 2**30, "gb": 10**9, "t": 2**40, "tib": 2**40,
          "tb": 10**12}  # fmt: skip
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*")


def parse_size(text: str | int) -> int:
    """``"24GiB"`` -> bytes. A bare number in a string is GiB; ``GB``/``MB`` are powers of ten.

    Args:
        text: an ``int`` (bytes), or a string: a number with an optional unit
            (``B``, ``KiB``, ``MiB``, ``GiB``, ``TiB``, ``KB``, ``MB``, ``GB``,
            ``TB``; ``K``/``M``/``G`` mean the binary units, none means GiB).

    Returns:
        The size in bytes.

    Raises:
        PlanError: not a size.

    Example:
        >>> parse_size("24GiB"), parse_size("80"), parse_size("512 MiB")
        (25769803776, 85899345920, 536870912)
    """
    if isinstance(text, int):
        return text
    m = _SIZE.fullmatch(text)
    if m is None or m.group(2).lower() not in _UNITS:
        raise PlanError(
            f"cannot read {text!r} as a memory size; write it like 24GiB, 80GB or 16 (GiB)"
        )
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def parse_gpu_memory(text: str | int) -> tuple[int, str]:
    """A GPU's memory -> ``(bytes, note)``: ``GB``, ``MB``, ``TB`` mean GiB, MiB, TiB here.

    GPU makers say "24 GB" for 24 GiB; the note says so when it applies
    (``""`` otherwise).

    Raises:
        PlanError: not a size, or a size no GPU has (outside
            :data:`GPU_MEMORY_RANGE`: 1 GiB to 1 TiB).

    Example:
        >>> parse_gpu_memory("24GB")
        (25769803776, '24GB read as 24 GiB, as GPU makers mean it')
    """
    m = None if isinstance(text, int) else _SIZE.fullmatch(text)
    unit = m.group(2).lower() if m else ""
    if m is None or unit not in ("kb", "mb", "gb", "tb"):
        size, note = parse_size(text), ""
    else:
        binary = f"{m.group(1)} {unit[0].upper()}iB"
        size, note = parse_size(binary), f"{text.strip()} read as {binary}, as GPU makers mean it"
    low, high = GPU_MEMORY_RANGE
    if not low <= size <= high:
        read = f"{size:,} bytes" if size < 2**20 else format_bytes(size)
        raise PlanError(
            f"GPU memory {text!r} is {read}, which no GPU has: give one GPU's memory, "
            "from 1 GiB to 1 TiB (24GiB, 80GB, or 16 for 16 GiB)"
        )
    return size, note


#: Device memory a process holds outside PyTorch's caching allocator - the CUDA context,
#: kernels, cuBLAS/cuDNN handles: the device's used memory less
#: ``torch.cuda.max_memory_reserved``, 767-769 MiB in each of the 10 steps measured on an
#: H200 (torch 2.11, CUDA 13, 2026-12-04, ``docs/plan.md``).
CUDA_CONTEXT = 768 * 2**20
#: What the need adds for the allocator replay's error: its reserved bytes were 6 MiB
#: under to 40 MiB over the real ones on the same H200 (``docs/plan.md``).
REPLAY_SAFETY = 64 * 2**20


@dataclasses.dataclass(frozen=True)
class Margin:
    """What a GPU needs beyond the memory PyTorch's caching allocator reserves.

    A configuration's *need* is ``reserved * (1 + fraction) + fixed``; it fits
    when its need is at most the GPU's memory. ``reserved`` is the row's
    :attr:`~layeropt.plan.execute.Measurement.reserved_bytes`: the segments the
    caching allocator takes over a run of the step (the model built, then
    steps until its blocks repeat), its allocations and frees replayed through
    the allocator's rules (:mod:`layeropt.plan.allocator`: 512-byte rounding,
    2 and 20 MiB segments, best-fit reuse, and the fragmentation that
    interleaved lifetimes leave, as checkpointing's recomputation among the
    gradients does), with cuBLAS's workspaces. Without a replay (the ``"cpu"``
    target, rows made by hand) it is the peak.

    Attributes:
        fixed: bytes outside the allocator: :data:`CUDA_CONTEXT` (768 MiB) and
            :data:`REPLAY_SAFETY` (64 MiB) by default.
        fraction: a share of ``reserved`` on top (default 0).

    Calibrated on one H200 (torch 2.11, CUDA 13, bf16, 2026-12-04): on each of
    the 10 steps of ``benchmarks/plan_calibrate.py`` (gpt2 and llama-3.2-1b)
    the default need was 57 to 105 MiB above the device's used memory
    (``docs/plan.md``). Another GPU, driver or CUDA version holds another
    context: that script prints it (``used-res``); pass it as ``fixed``.
    """

    fixed: int = CUDA_CONTEXT + REPLAY_SAFETY
    fraction: float = 0.0

    def need(self, row: Measurement) -> int:
        """The GPU memory ``row`` needs: its reserved bytes (else its peak) plus the margin."""
        return self.gpu_memory_for(row.reserved_bytes or row.peak_bytes)

    def budget(self, gpu_memory: int) -> int:
        """The most reserved bytes that fit in ``gpu_memory`` bytes."""
        return int((gpu_memory - self.fixed) / (1 + self.fraction))

    def gpu_memory_for(self, reserved: int) -> int:
        """The least GPU memory in which ``reserved`` bytes fit (the inverse of :meth:`budget`)."""
        return math.ceil(reserved * (1 + self.fraction) + self.fixed)

    def describe(self) -> str:
        """``"832.0 MiB"``; ``"1.0 GiB + 5%"`` with a fraction."""
        return format_bytes(self.fixed) + (f" + {self.fraction:.0%}" if self.fraction else "")

    @classmethod
    def parse(cls, text: str) -> Margin:
        """``"1GiB+5%"`` -> ``Margin(2**30, 0.05)``; ``"0"`` -> no margin (the bare replay)."""
        fixed, fraction = 0, 0.0
        for part in (p.strip() for p in text.split("+") if p.strip()):
            if part.endswith("%"):
                try:
                    fraction += float(part[:-1]) / 100
                except ValueError:
                    raise PlanError(f"cannot read {part!r} in --margin {text!r}") from None
            else:
                fixed += parse_size(part)
        return cls(fixed, fraction)


_CHANGE_TEXT = {  # change -> (what it shrinks, its category, what it does)
    "fused": ("optimizer temporaries", OTHER, "fused AdamW updates in place"),
    "layeropt": ("gradients", GRADIENTS, "layeropt frees each gradient as its layer is updated"),
    "checkpointing": ("activations", ACTIVATIONS, "checkpointing keeps one input per block"),
    "chunked loss": ("activations", ACTIVATIONS, "the chunked loss never holds full logits"),
    "low-bit": ("optimizer state", STATE, "{base} keeps {bits}-bit states, updated in one kernel"),
    "state offload": ("optimizer state", STATE, "state offload keeps the optimizer state in "
                      "host memory ({host}), one bucket's on the GPU at a time (exact; "
                      "each step copies the state over PCIe and back)"),
    "held grads offload": ("gradients", GRADIENTS, "held gradients wait in host memory "
                           "({held}) between micro-batches, each bucket's copied down as it lands and "
                           "its sum brought back once for its step (exact; {link} over the "
                           "host link per step){kept}"),
}


@dataclasses.dataclass
class Plan:
    """The memory of one training step under each configuration.

    Attributes:
        model: the model's name.
        parameters: number of parameters.
        rows: one measurement per configuration, smallest peak first.
        dtype: the parameters' dtype (``"bf16"``, ``"fp32"``, or as built).
        seq: tokens per sequence (``None`` for a custom model).
        batch: sequences per batch (``None`` for a custom model).
        device: the device whose kernels were modelled.
        gpu_memory: the GPU's memory in bytes, or ``None``.
        margin: what fitting leaves free (:class:`Margin`).
        notes: lines for the header (how the GPU's memory was read).
        accumulate: micro-batches per training step (gradient accumulation).
        link: the host link's rates (:class:`~layeropt.plan.link.Link`), for the
            step-time floor of the rows that copy over it (default: the link an
            H200 measured, :data:`~layeropt.plan.link.H200`).
        attention: a Hugging Face model's attention implementation (``"sdpa"``,
            ``"eager"``), ``None`` for other models.
        max_norm: the clipping each row's step does (``None``: none).
    """

    model: str
    parameters: int
    rows: list[Measurement]
    dtype: str = ""
    seq: int | None = None
    batch: int | None = None
    device: str = "cuda"
    gpu_memory: int | None = None
    margin: Margin = dataclasses.field(default_factory=Margin)
    notes: list[str] = dataclasses.field(default_factory=list)
    accumulate: int = 1
    link: Link = H200
    attention: str | None = None
    max_norm: float | None = None

    def __post_init__(self) -> None:
        self.rows = sorted(self.rows, key=lambda r: (r.peak_bytes, len(r.variant.changes())))

    # -- answers ------------------------------------------------------------
    @property
    def budget(self) -> int | None:
        """The most reserved bytes that fit (``None`` without ``gpu_memory``)."""
        return None if self.gpu_memory is None else self.margin.budget(self.gpu_memory)

    def need(self, row: Measurement) -> int:
        """The GPU memory ``row`` needs (:meth:`Margin.need`)."""
        return self.margin.need(row)

    def fits(self, row: Measurement) -> bool | None:
        """Whether ``row``'s need is at most the GPU's memory (``None`` without
        ``gpu_memory``)."""
        return None if self.gpu_memory is None else self.need(row) <= self.gpu_memory

    @property
    def smallest(self) -> Measurement:
        """The row to show when nothing fits: the smallest need with ``gpu_memory``,
        else the smallest peak."""
        if self.gpu_memory is None:
            return self.rows[0]
        return min(self.rows, key=lambda r: (self.need(r), r.peak_bytes))

    def row(self, variant: Variant) -> Measurement | None:
        """The measurement of ``variant``, if it was planned."""
        return next((r for r in self.rows if r.variant == variant), None)

    @property
    def baseline(self) -> Measurement:
        """Plain ``torch.optim.AdamW`` (foreach, torch's GPU default), or the simplest row."""
        return min(self.rows, key=lambda r: (len(r.variant.changes()), r.peak_bytes))

    @property
    def choice(self) -> Measurement | None:
        """The recommended configuration: the least invasive one that fits.

        Exact AdamW (the update math unchanged: fused, layeropt,
        checkpointing, chunked loss) comes first, then exact AdamW with its
        state offloaded to host memory (exact, but every step copies the
        state over PCIe and back), then 8-bit optimizer states, and 8-bit
        before 4-bit; then the fewest changes from plain
        ``torch.optim.AdamW``; then the smallest peak.
        """
        fitting = [r for r in self.rows if self.fits(r)]
        if not fitting:
            return None
        return min(fitting, key=_invasiveness)

    def why(self, row: Measurement | None = None) -> str:
        """One line: how ``row`` differs from the baseline, and what each difference saves.

        :meth:`why_steps` joined by ``"; "`` (the ``--json`` ``"why"``).

        Args:
            row: the configuration to explain (default: :attr:`choice`, or
                the smallest peak when nothing fits).
        """
        return "; ".join(self.why_steps(row))

    def why_steps(self, row: Measurement | None = None) -> list[str]:
        """How ``row`` differs from the baseline, one change at a time.

        From :attr:`baseline` (plain ``torch.optim.AdamW``), one change of
        ``row`` at a time, through the planned rows in between: where the
        peak is, what it holds that the change removes, and the saving.

        Args:
            row: the configuration to explain (default: :attr:`choice`, or
                the smallest peak when nothing fits).

        Returns:
            One sentence per step (the table prints each on its own lines).
        """
        row = row or self.choice or self.rows[0]
        steps, quiet, current = self._walk(row)
        if not steps:
            return [self._largest_part(current)]
        out = []
        for before, changes, done, category, saved in steps:
            what = _CHANGE_TEXT[done[0]][0]
            fixes = " and ".join(_fix(c, row) for c in changes)
            out.append(
                f"{'then ' if out else ''}{before.variant.label} peaks {_where(before)} "
                f"with {format_bytes(before.at_peak[category])} of {what}: {fixes} "
                f"({'-' if saved >= 0 else '+'}{format_bytes(abs(saved))})"
            )
        if quiet:
            out.append(" and ".join(_fix(c, row) for c in quiet) + " (no effect here)")
        return out

    def _walk(
        self, row: Measurement
    ) -> tuple[list[tuple[Measurement, list[str], list[str], str, int]], list[str], Measurement]:
        """:meth:`why_steps`' walk from the baseline to ``row``: ``(steps, quiet, last)``.

        Each step is ``(row before it, its changes (quiet ones first), the changes
        that saved, the category they shrink, the saving)``; ``quiet``: changes
        left without effect at the end; ``last``: the row the walk ended on.
        """
        current = self.baseline
        steps: list[tuple[Measurement, list[str], list[str], str, int]] = []
        quiet: list[str] = []  # changes without effect on their own: told with the next
        remaining = row.variant.changes() - current.variant.changes()
        while remaining:
            options = []
            for change in sorted(remaining):
                wanted = current.variant.changes() | {change}
                nxt = self.row(_with_changes(row.variant, wanted))
                if nxt is not None and nxt.variant.changes() == wanted:
                    options.append((nxt.peak_bytes, change, nxt))
            if options:
                _, change, nxt = min(options, key=lambda o: o[0])
                done = [change]
            else:  # no planned row in between: the rest at once
                done, nxt = sorted(remaining), row
            remaining -= set(done)
            saved = current.peak_bytes - nxt.peak_bytes
            if abs(saved) < 0.005 * current.peak_bytes:
                quiet += done
            else:
                steps.append((current, quiet + done, done, _CHANGE_TEXT[done[0]][1], saved))
                quiet = []
            current = nxt
        return steps, quiet, current

    def _largest_part(self, row: Measurement) -> str:
        """Where ``row`` peaks and its largest part after parameters and optimizer state."""
        top = max(CATEGORIES[2:], key=lambda c: row.at_peak[c])
        return (
            f"{row.variant.label} peaks {_where(row)}, where the largest part "
            f"after parameters and optimizer state is {_name(top, row)} "
            f"({format_bytes(row.at_peak[top])})"
        )

    def link_floor(self, row: Measurement) -> float:
        """The least seconds per step ``row``'s copies take over :attr:`link`
        (:meth:`Link.seconds <layeropt.plan.link.Link.seconds>`)."""
        return self.link.seconds(row.to_device_bytes, row.to_host_bytes)

    # -- rendering ----------------------------------------------------------
    def header(self) -> str:
        """The model and step, how it was planned, and the fitting rule."""
        shape = ""
        if self.seq is not None:
            shape = f", batch {self.batch} x {self.seq} tokens"
        attention = ("eager attention" if self.attention == "eager"
                     else "flash attention")  # (sdpa, or a model of its own: its own calls)
        kernels = {"cuda": f"a CUDA GPU's kernels modelled ({attention}); no GPU used",
                   "cpu": "torch's CPU kernels"}.get(self.device, f"{self.device}'s kernels")
        step = "one steady-state training step"
        if self.accumulate > 1:
            step += f" of {self.accumulate} micro-batches (gradient accumulation)"
        if self.max_norm is not None:
            step += f", gradients clipped to norm {self.max_norm:g}"
        lines = [
            f"layeropt plan: {self.model} ({_count(self.parameters)} parameters"
            f"{', ' + self.dtype if self.dtype else ''}{shape}), {step}",
            f"run on fake tensors, with {kernels}",
        ]
        if self.gpu_memory is not None:
            replayed = any(r.reserved_bytes for r in self.rows)
            base = ("reserved" if replayed else "peak")
            lines.append(
                f"fits in {format_bytes(self.gpu_memory)}: need = {base} + "
                f"{self.margin.describe()} <= {format_bytes(self.gpu_memory)}"
                + (" (reserved: the CUDA caching allocator's segments, replayed)"
                   if replayed else "")
            )
            if self.margin == Margin():
                lines.append(f"({self.margin.describe()} = {format_bytes(CUDA_CONTEXT)} the CUDA "
                             f"context took on an H200 + {format_bytes(REPLAY_SAFETY)} for the "
                             "replay's error; there the need covered the device's use in 10 "
                             "of 10 steps measured, docs/plan.md)")
        return "\n".join(lines + self.notes)

    def table(self) -> str:
        """The whole report as text: header, one row per configuration, the answer."""
        names = {"parameters": "params", "optimizer state": "opt state",
                 "gradients": "grads", "activations": "activations", "other": "other"}  # fmt: skip
        host = any(r.host_bytes for r in self.rows)
        link = any(r.to_device_bytes or r.to_host_bytes for r in self.rows)
        peak_col = _Column("peak", [r.peak_bytes for r in self.rows])
        need_col = _Column("need", [self.need(r) for r in self.rows])
        host_col = _Column("host", [r.host_bytes for r in self.rows if r.host_bytes])
        link_col = _Column("link/step", [r.to_device_bytes + r.to_host_bytes for r in self.rows
                                         if r.to_device_bytes or r.to_host_bytes])  # fmt: skip
        head = f"{peak_col.title:>10}  {need_col.title:>10}  "
        head += "".join(f"{names[c]:>12}" for c in CATEGORIES)
        head += f"  {'peak falls in':<22}" + ("fits  " if self.gpu_memory else "")
        head += f"{host_col.title:>10}  " if host else ""
        head += f"{link_col.title:>15}{'floor':>8}  " if link else ""
        head += "configuration"
        lines = [self.header(), "", head]
        unit, scale = _unit(max(r.peak_bytes for r in self.rows))
        choice = self.choice
        for r in self.rows:
            cells = "".join(f"{r.at_peak[c] / scale:>12.2f}" for c in CATEGORIES)
            fit = {True: "yes   ", False: "no    ", None: ""}[self.fits(r)]
            kept = (f"{host_col.cell(r.host_bytes) if r.host_bytes else '':>10}  " if host
                    else "")
            if link:
                moved = r.to_device_bytes + r.to_host_bytes
                kept += (f"{link_col.cell(moved):>15}{_seconds(self.link_floor(r)):>8}  "
                         if moved else f"{'-':>15}{'-':>8}  ")
            mark = "  <- recommended" if r is choice else ""
            lines.append(
                f"{peak_col.cell(r.peak_bytes):>10}  {need_col.cell(self.need(r)):>10}  {cells}  "
                f"{_where(r, short=True):<22}{fit}{kept}{self._named(r)}{mark}"
            )
        lines.append(f"(categories in {unit}, at the peak; need: the GPU memory the row needs, "
                     f"{self._need_told()}"
                     + ("; host: host memory the offloaded optimizer state takes"
                        + (" and the held gradients' sums" if self.accumulate > 1 else "")
                        if host else "") + ")")
        if link:
            lines.append(
                f"(link/step: bytes copied between host and GPU per training step, both "
                f"directions; floor: {self._floor_told()}; '-': nothing crosses the link)")
        lines += ["", *self.answer()]
        return "\n".join(lines)

    def _shown(self) -> list[Measurement]:
        """The rows of the short table (:meth:`_summary`), the marked one first.

        The recommendation (or, without one, the smallest peak); the baseline
        (plain ``torch.optim.AdamW``, as torch runs it); and for each kind of
        change (:func:`_kind`: exact AdamW with its state on the GPU, with its
        state in host memory, with its held gradients there too, 8-bit states,
        4-bit states) the row the recommendation's rule picks among that kind
        alone (the least invasive that fits), or its smallest peak where none
        fits; for the first row's kind, its smallest peak too (the headroom
        that kind gives). The rest cheapest first, in the rule's order; at most
        8 rows.
        """
        first = self.choice or self.smallest

        def smallest(rows: list[Measurement]) -> Measurement:
            return min(rows, key=lambda r: (r.peak_bytes, len(r.variant.changes())))

        kinds: dict[tuple[int, bool, bool], list[Measurement]] = {}
        for r in self.rows:
            kinds.setdefault(_kind(r), []).append(r)
        picked = [self.baseline]
        for rows in kinds.values():
            fitting = [r for r in rows if self.fits(r)]
            picked.append(min(fitting, key=_invasiveness) if fitting else smallest(rows))
            if first in rows:
                picked.append(smallest(rows))
        rest = sorted({id(r): r for r in picked if r is not first}.values(), key=_invasiveness)
        return [first, *rest]

    def _summary(self) -> str:
        """The command line's default report, at most 120 columns: the header, the rows
        of :meth:`_shown` (the marked one first), the answer and a one-line why.

        One unit per column, chosen from the column's largest value.
        """
        shown = self._shown()
        choice = self.choice
        host = any(r.host_bytes for r in shown)
        link = any(r.to_device_bytes or r.to_host_bytes for r in shown)
        peak_col = _Column("peak", [r.peak_bytes for r in shown])
        need_col = _Column("need", [self.need(r) for r in shown])
        host_col = _Column("host", [r.host_bytes for r in shown if r.host_bytes])
        cols = [(peak_col.title, lambda r: peak_col.cell(r.peak_bytes)),
                (need_col.title, lambda r: need_col.cell(self.need(r)))]
        if self.gpu_memory is not None:
            cols.append(("fits", lambda r: {True: "yes*" if not r.variant.run_on_a_gpu else
                                            "yes", False: "no"}[bool(self.fits(r))]))  # fmt: skip
        if host:
            cols.append((host_col.title,
                         lambda r: host_col.cell(r.host_bytes) if r.host_bytes else "-"))
        if link:
            cols.append(("floor", lambda r: _seconds(self.link_floor(r))
                         if r.to_device_bytes or r.to_host_bytes else "-"))  # fmt: skip
        texts = [[cell(r) for _, cell in cols] for r in shown]
        widths = [max(len(t), *(len(row[i]) for row in texts)) for i, (t, _) in enumerate(cols)]
        align = ["<" if t == "fits" else ">" for t, _ in cols]

        def line(cells: list[str]) -> str:
            return "  ".join(f"{c:{a}{w}}" for c, a, w in zip(cells, align, widths)) + "  "

        lines = [x for h in self.header().splitlines() for x in _wrap(h, "", _WIDTH)]
        lines += ["", line([t for t, _ in cols]) + "configuration"]
        mark = ("  <- recommended" if choice is not None else "  <- smallest peak"
                if self.gpu_memory is None else "  <- smallest need")
        for r, cells in zip(shown, texts):
            lines += _fill(line(cells), r.variant.label + (mark if r is shown[0] else ""))
        kinds = ", ".join(_KINDS[k] for k in sorted({_kind(r) for r in self.rows}))
        notes = [
            f"{len(shown)} of {len(self.rows)} rows: "
            f"{'the recommendation' if choice else 'the smallest peak'}, "
            f"{self.baseline.variant.label} and, for each kind of change ({kinds}), "
            + ("the least invasive row that fits, else " if self.gpu_memory else "")
            + "the smallest peak"
            + ("; for the recommendation's own kind, its smallest peak"
               if self.choice is not None else "")
            + "; --all: every row, with what is alive at each peak"
        ]
        if self.gpu_memory is None:  # (else the header says it)
            notes.append(f"need: the GPU memory the row needs, {self._need_told()}")
        if any(self.fits(r) and not r.variant.run_on_a_gpu for r in shown):
            notes.append("yes*: fits on paper; layeropt has not run this configuration on a "
                         "GPU yet")
        legend = []
        if host:
            legend.append("host: host memory the offloaded optimizer state takes"
                          + (" and the held gradients' sums" if self.accumulate > 1 else ""))
        if link:
            legend.append(f"floor: {self._floor_told()}")
        if legend:
            notes.append("; ".join(legend))
        lines += [x for n in notes for x in _wrap(f"({n})", "", _WIDTH)]
        first, row = self._first_answer()
        lines += ["", *_wrap(first, "", _WIDTH), *_wrap(self._short_why(row), "", _WIDTH)]
        return "\n".join(lines)

    def _floor_told(self) -> str:
        """What the floor column is, in words (the tables' notes)."""
        return (f"the least time a step's copies take over the host link "
                f"({self.link.describe()}; --link-gbps) - arithmetic, not a step measured "
                "on a GPU")

    def _need_told(self) -> str:
        """What a row's need is, in words (the tables' notes)."""
        if any(r.reserved_bytes for r in self.rows):
            return (f"what the CUDA caching allocator reserves over its steps (replayed) + "
                    f"{self.margin.describe()}")
        return f"its peak + {self.margin.describe()}"

    def _short_why(self, row: Measurement) -> str:
        """``why:`` in one sentence: each change from the baseline and what it saves."""
        steps, quiet, current = self._walk(row)
        if not steps:
            return f"why: {self._largest_part(current)}"
        base = self.baseline
        parts = [
            " + ".join(_short(c, row) for c in changes)
            + f" {'-' if saved >= 0 else '+'}{format_bytes(abs(saved))}"
            + f" ({_CHANGE_TEXT[done[0]][0]})"
            for _, changes, done, _, saved in steps
        ]
        if quiet:
            parts.append(" + ".join(_short(c, row) for c in quiet) + " (no effect here)")
        return (f"why: from {base.variant.label} at {format_bytes(base.peak_bytes)}: "
                f"{', '.join(parts)} = {format_bytes(row.peak_bytes)}")  # fmt: skip

    def _named(self, row: Measurement) -> str:
        """The row's label, and - where it says the row fits - that no GPU has run it."""
        if self.fits(row) and not row.variant.run_on_a_gpu:
            return f"{row.variant.label} (not yet run on a GPU)"
        return row.variant.label

    def answer(self) -> list[str]:
        """The last lines: what to use, and why (wrapped to short lines)."""
        first, row = self._first_answer()
        return _wrap(first, "") + self._why_lines(row)

    def _first_answer(self) -> tuple[str, Measurement]:
        """The answer's first sentence, and the row it is about."""
        if self.gpu_memory is None:
            best = self.rows[0]
            first = (f"smallest peak: {best.variant.label} ({format_bytes(best.peak_bytes)}, "
                     f"needs {format_bytes(self.need(best))}); pass --gpu-memory to see what "
                     "fits")  # fmt: skip
            return first, best
        choice = self.choice
        if choice is None:
            best = self.smallest
            need = self.need(best)
            over = need - self.gpu_memory
            first = (
                f"nothing fits in {format_bytes(self.gpu_memory)}: the smallest need, "
                f"{best.variant.label}'s ({format_bytes(need)}; peak "
                f"{format_bytes(best.peak_bytes)}), is {format_bytes(over)} over. "
                f"Its need must drop by {format_bytes(over)}, or it needs a GPU of "
                f"{format_bytes(need)}: try a shorter --seq or a smaller --batch (with "
                "gradient accumulation), or shard the model across GPUs (FSDP)."
            )
            return first, best
        rule = "with the fewest changes"
        if choice.variant.held_device_bytes:
            rule += (" once the optimizer state and part of the held gradients are in host "
                     "memory (exact AdamW; no row with all of either on the GPU fits)")
        elif "held grads offload" in choice.variant.changes():
            rule += (" once the optimizer state and the held gradients are in host memory "
                     "(exact AdamW; no row with either on the GPU fits)")
        elif "state offload" in choice.variant.changes():
            rule += (" once the optimizer state is in host memory (exact AdamW; no row with "
                     "the state on the GPU fits)")
        elif "low-bit" in choice.variant.changes() and _bits(choice.variant) == 8:
            rule += " once optimizer states are 8-bit (no exact AdamW fits)"
        elif "low-bit" in choice.variant.changes():
            rule += " once optimizer states are 4-bit (neither exact AdamW nor 8-bit states fit)"
        first = (f"fits in {format_bytes(self.gpu_memory)} {rule}: {self._named(choice)} "
                 f"(peak {format_bytes(choice.peak_bytes)}, needs "
                 f"{format_bytes(self.need(choice))})")  # fmt: skip
        if choice.variant.held_device_bytes:
            first += (f"; the held gradients that fit stay on the GPU: "
                      f"offload_state(opt, held_device_bytes={choice.variant.held_device_bytes})")
        return first, choice

    def _why_lines(self, row: Measurement) -> list[str]:
        lines = ["why:"]
        for step in self.why_steps(row):
            lines += _wrap(step, "  ")
        return lines

    def to_dict(self) -> dict[str, Any]:
        """One JSON-ready object (the ``--json`` output).

        Returns:
            ``{"model", "parameters", "dtype", "seq", "batch", "device",
            "gpu_memory_bytes", "budget_bytes", "margin", "variants": [...],
            "recommendation", "notes"}``; each variant has ``optimizer``,
            ``implementation``, ``checkpointing``, ``chunked_loss``,
            ``offload``, ``in_backward``, ``label``, ``peak_bytes``,
            ``reserved_bytes`` (the caching allocator's, replayed; 0 without a
            replay), ``need_bytes`` (:meth:`need`), ``start_bytes``,
            ``at_peak`` (bytes per category), ``phase``,
            ``phase_progress``, ``fits`` (``None`` without ``gpu_memory``),
            ``run_on_a_gpu`` (whether layeropt has run the configuration on a
            GPU: :attr:`Variant.run_on_a_gpu`), ``host_bytes`` (host memory
            of offloaded state and held gradients), ``held_on_host``,
            ``held_device_bytes`` (held gradients kept on the GPU),
            ``held_host_bytes`` (the held gradients' part of ``host_bytes``),
            ``to_device_bytes`` / ``to_host_bytes`` (per step over the host link)
            and ``link_floor_seconds`` (:meth:`link_floor`); the plan has
            ``accumulate``, ``attention`` (``"sdpa"``, ``"eager"`` or ``None``),
            ``max_norm`` (``None``: no clipping) and ``link``
            (``{"to_device_gbps", "to_host_gbps", "both_gbps", "measured"}``).
        """
        choice = self.choice
        return {
            "model": self.model,
            "parameters": self.parameters,
            "dtype": self.dtype,
            "seq": self.seq,
            "batch": self.batch,
            "device": self.device,
            "gpu_memory_bytes": self.gpu_memory,
            "accumulate": self.accumulate,
            "attention": self.attention,
            "max_norm": self.max_norm,
            "link": {"to_device_gbps": self.link.to_device, "to_host_gbps": self.link.to_host,
                     "both_gbps": self.link.both, "measured": self.link.measured},
            "budget_bytes": self.budget,
            "margin": {"fixed_bytes": self.margin.fixed, "fraction": self.margin.fraction},
            "variants": [
                {
                    "optimizer": r.variant.optimizer,
                    "implementation": r.variant.implementation,
                    "checkpointing": r.variant.checkpointing,
                    "chunked_loss": r.variant.chunked_loss,
                    "offload": r.variant.offload,
                    "in_backward": r.variant.in_backward,
                    "label": r.variant.label,
                    "peak_bytes": r.peak_bytes,
                    "reserved_bytes": r.reserved_bytes,
                    "need_bytes": self.need(r),
                    "start_bytes": r.start_bytes,
                    "at_peak": dict(r.at_peak),
                    "phase": r.phase,
                    "phase_progress": round(r.phase_progress, 4),
                    "fits": self.fits(r),
                    "run_on_a_gpu": r.variant.run_on_a_gpu,
                    "host_bytes": r.host_bytes,
                    "held_on_host": r.variant.held_on_host,
                    "held_device_bytes": r.variant.held_device_bytes,
                    "held_host_bytes": r.held_host_bytes,
                    "to_device_bytes": r.to_device_bytes,
                    "to_host_bytes": r.to_host_bytes,
                    "link_floor_seconds": round(self.link_floor(r), 4),
                }
                for r in self.rows
            ],
            "recommendation": None if choice is None else {
                "label": choice.variant.label, "peak_bytes": choice.peak_bytes,
                "held_device_bytes": choice.variant.held_device_bytes,
                "why": self.why(choice),
            },
            "notes": self.notes,
        }  # fmt: skip

    def plot(self, path: str | os.PathLike[str]) -> str:
        """Save a PNG: one stacked bar per configuration (the recommended one outlined,
        its name in bold), each row's need as a tick, the GPU's memory as a line.

        Args:
            path: where to write the image.

        Returns:
            ``path`` as a string.

        Raises:
            PlotDependencyError: matplotlib is not installed.
        """
        from ..report import _COLORS, PlotDependencyError

        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as e:
            raise PlotDependencyError(
                "--plot needs matplotlib: pip install 'layeropt[plot]' (or pip install "
                "matplotlib), or leave out --plot."
            ) from e
        colors = dict(_COLORS, activations=_COLORS["activations/other"], other="#8e8e8e")
        rows = self.rows[::-1]
        choice = self.choice
        fig = Figure(figsize=(11, 2.2 + 0.32 * len(rows)), layout="constrained")
        FigureCanvasAgg(fig)
        ax = fig.subplots()
        left = [0.0] * len(rows)
        for c in CATEGORIES:
            widths = [r.at_peak[c] / 2**30 for r in rows]
            ax.barh(range(len(rows)), widths, left=left, color=colors[c], label=c)
            left = [a + b for a, b in zip(left, widths)]
        ax.set_yticks(range(len(rows)), [r.variant.label for r in rows], fontsize="small")
        if choice is not None:
            i = rows.index(choice)
            ax.barh(i, choice.peak_bytes / 2**30, fill=False, edgecolor="black", lw=1.5,
                    label="recommended")  # fmt: skip
            ax.get_yticklabels()[i].set_fontweight("bold")
        ax.scatter([self.need(r) / 2**30 for r in rows], range(len(rows)), marker="|", s=200,
                   color="black", label="need")  # fmt: skip
        if self.gpu_memory is not None:
            ax.axvline(self.gpu_memory / 2**30, color="black", lw=1.2,
                       label=f"GPU memory ({format_bytes(self.gpu_memory)})")  # fmt: skip
        ax.set_xlabel(textwrap.fill(f"GiB at the peak of the step; need: {self._need_told()}",
                                    110), fontsize="small")
        ax.set_ylim(-0.7, len(rows) - 0.3)
        title = self.header().splitlines()[0].removeprefix("layeropt plan: ")
        fig.suptitle(textwrap.fill(title, 110), fontsize="medium")
        ax.grid(axis="x", alpha=0.3)
        fig.legend(*ax.get_legend_handles_labels(), loc="outside lower center", ncols=4,
                   fontsize="small")  # fmt: skip
        fig.savefig(os.fspath(path), dpi=110, bbox_inches="tight")
        return os.fspath(path)


_TORCH = ("torch.optim.AdamW",)


def _name(category: str, row: Measurement) -> str:
    if category == OTHER:
        return "optimizer temporaries" if row.phase == "optimizer step" else "temporaries"
    return category


def _bits(variant: Variant) -> int:
    """Bits per optimizer-state element of a low-bit optimizer (8 or 4)."""
    return 4 if "4bit" in variant.base else 8


def _invasiveness(row: Measurement) -> tuple[int, int, int, int, int, int]:
    """Exact AdamW, then with its state offloaded, then its held gradients too, then
    8-bit states, then 4-bit; then fewest changes; then the most held gradients kept
    on the GPU (the fewest bytes over the link); then the peak."""
    changes = row.variant.changes()
    precision = 0 if "low-bit" not in changes else 1 if _bits(row.variant) == 8 else 2
    return (precision, "state offload" in changes, "held grads offload" in changes,
            len(changes), -row.variant.held_device_bytes, row.peak_bytes)


def _fix(change: str, row: Measurement) -> str:
    variant = row.variant
    text = _CHANGE_TEXT[change][2]
    state_host = row.host_bytes - row.held_host_bytes
    kept = variant.held_device_bytes
    return text.format(base=variant.base, bits=_bits(variant), host=format_bytes(state_host),
                       link=format_bytes(row.to_device_bytes + row.to_host_bytes),
                       held=format_bytes(row.held_host_bytes),
                       kept=f", but for up to {format_bytes(kept)} of them kept on the GPU "
                       f"(offload_state(opt, held_device_bytes={kept}))" if kept else "")


def _wrap(text: str, indent: str, width: int = 92) -> list[str]:
    """``text`` in lines of at most ``width`` characters, continuation lines indented two
    more (a size such as ``3.3 GiB`` is never split)."""
    glued = _SIZE_IN_TEXT.sub("\\1\xa0\\2", text)  # textwrap does not break at a no-break space
    lines = textwrap.wrap(glued, width, initial_indent=indent, subsequent_indent=indent + "  ",
                          break_on_hyphens=False)  # fmt: skip
    return [line.replace("\xa0", " ") for line in lines]


#: The short table's width (:meth:`Plan._summary`): a 120-column terminal.
_WIDTH = 120


def _fill(prefix: str, label: str) -> list[str]:
    """``prefix + label`` in lines of at most :data:`_WIDTH` characters: a label too long
    for the line goes on below, broken before a ``" + "``, under the label's column."""
    room = max(_WIDTH - len(prefix), 20)
    parts = label.split(" + ")
    lines, current = [], parts[0]
    for part in parts[1:]:
        if len(current) + 3 + len(part) > room:
            lines.append(current)
            current = "  + " + part
        else:
            current += " + " + part
    lines.append(current)
    return [prefix + lines[0], *(" " * len(prefix) + x for x in lines[1:])]


class _Column:
    """A column of byte counts in one unit, the one of its largest value (``"peak (GiB)"``)."""

    def __init__(self, name: str, values: list[int]) -> None:
        self.unit, self.scale = _unit(max(values, default=0))
        top = max(values, default=0) / self.scale
        self.digits = 0 if self.scale == 1 else 2 if top < 100 else 1
        self.title = f"{name} ({self.unit})"

    def cell(self, n: int) -> str:
        return f"{n / self.scale:.{self.digits}f}"


#: The kinds of change of :func:`_kind`, named for the short table's notes.
_KINDS = {(0, False, False): "exact AdamW", (0, True, False): "state offload",
          (0, True, True): "held grads in host memory", (1, False, False): "8-bit states",
          (2, False, False): "4-bit states"}  # fmt: skip

#: Changes as the short why names them.
_SHORT = {"fused": "fused AdamW", "layeropt": "layeropt", "checkpointing": "checkpointing",
          "chunked loss": "chunked loss", "low-bit": "{bits}-bit states",
          "state offload": "state offload",
          "held grads offload": "held grads in host memory"}  # fmt: skip


def _short(change: str, row: Measurement) -> str:
    return _SHORT[change].format(bits=_bits(row.variant))


def _kind(row: Measurement) -> tuple[int, bool, bool]:
    """A row's kind of change: exact AdamW (0), 8-bit (1) or 4-bit (2) states; state
    offload; held gradients in host memory (the first three keys of :func:`_invasiveness`)."""
    precision, offload, held, *_ = _invasiveness(row)
    return precision, bool(offload), bool(held)


_SIZE_IN_TEXT = re.compile(r"(\d) (B|KiB|MiB|GiB|TiB|GB/s)(?![\w/])")


def _unit(n: int) -> tuple[str, int]:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return unit, scale
    return "B", 1


def _seconds(t: float) -> str:
    """``2.168`` -> ``'2.17 s'``; ``0.0042`` -> ``'4.2 ms'``."""
    return f"{t:.2f} s" if t >= 0.1 else f"{t * 1e3:.1f} ms"


def _count(n: int) -> str:
    """``6738415616`` -> ``'6.74B'``."""
    for suffix, scale in (("B", 10**9), ("M", 10**6), ("K", 10**3)):
        if n >= scale:
            return f"{n / scale:.{2 if n < 10 * scale else 1 if n < 100 * scale else 0}f}{suffix}"
    return str(n)


def _where(row: Measurement, short: bool = False) -> str:
    """``"at the start of backward"`` / ``"backward (43%)"``."""
    p = row.phase_progress
    if row.phase in ("optimizer step", "zero_grad"):
        return row.phase if short else f"in the {row.phase}"
    if p <= 0.05:
        return f"start of {row.phase}" if short else f"at the start of {row.phase}"
    if p >= 0.95:
        return f"end of {row.phase}" if short else f"at the end of {row.phase}"
    return f"{row.phase} ({p:.0%})" if short else f"{p:.0%} into {row.phase}"


def _with_changes(like: Variant, changes: set[str]) -> Variant:
    """The variant with exactly ``changes`` (the low-bit optimizer of ``like`` and the
    held gradients it keeps on the GPU; low-bit updates are fused)."""
    low_bit = like.base if like.base in LOW_BIT else next(iter(LOW_BIT))
    base = low_bit if "low-bit" in changes else "torch.optim.AdamW"
    optimizer = base
    if "layeropt" in changes:
        optimizer = "layeropt.AdamW" if base in _TORCH else f"layeropt.in_backward({base})"
    fused = "fused" in changes or "low-bit" in changes
    held = ("held grads offload" in changes and "state offload" in changes
            and optimizer == "layeropt.AdamW" and fused)
    return Variant(
        optimizer,
        "fused" if fused else "foreach",
        "checkpointing" in changes,
        "chunked loss" in changes,
        "state offload" in changes and optimizer == "layeropt.AdamW" and fused,
        held,
        like.held_device_bytes if held else 0,  # (part of the held gradients kept: like's)
    )
