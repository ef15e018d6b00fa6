"""Where the memory of a training step goes: parameters, gradients, optimizer state.

Wrap one training step in :class:`MemoryReport` to get its peak bytes broken
down into four categories (:data:`CATEGORIES`) and the timeline behind it.
Allocations come from torch's profiler (``profile_memory=True``), so on CPU the
byte counts are exact. Each tensor is classified by identity where that is
certain - the storages of the model's parameters and of the optimizer's state
tensors - and otherwise by torch's own memory-profiler analysis (which
recognises gradients by the ``AccumulateGrad`` that writes them). Everything
else (activations, inputs, temporaries, autograd buffers) is
``"activations/other"``.

Unlike :class:`layeropt.memory.PeakMemory`, which counts only what is
allocated inside the block, the report counts every tensor the step touches,
including the parameters and optimizer state that existed before it.

Example:
    >>> import torch
    >>> model = torch.nn.Linear(64, 64)
    >>> opt = torch.optim.Adam(model.parameters())
    >>> def step():
    ...     model(torch.randn(8, 64)).sum().backward()
    ...     opt.step()
    ...     opt.zero_grad()
    >>> step()  # creates the optimizer state
    >>> with MemoryReport(model, opt) as report:
    ...     step()
    >>> report.result.at_peak["parameters"]
    16640
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from torch.optim import Optimizer

from .errors import LayeroptError
from .memory import _muted, _pause_gc, _resume_gc, format_bytes
from .optim import optimizer_list

__all__ = [
    "CATEGORIES",
    "MemoryReport",
    "PlotDependencyError",
    "ReportError",
    "StepMemory",
    "format_table",
    "plot_timelines",
    "report_step",
]

PARAMETERS, GRADIENTS, STATE, OTHER = (
    "parameters",
    "gradients",
    "optimizer state",
    "activations/other",
)
#: The categories of a report, in stacking order (bottom to top of the plot).
CATEGORIES: tuple[str, ...] = (PARAMETERS, STATE, GRADIENTS, OTHER)
_COLORS = {PARAMETERS: "#2e7d32", STATE: "#f9a825", GRADIENTS: "#1565c0", OTHER: "#c62828"}


class ReportError(LayeroptError):
    """The memory report could not be computed (see the message)."""


class PlotDependencyError(ImportError):
    """Plotting needs matplotlib, which is not installed."""


@dataclasses.dataclass
class StepMemory:
    """Memory of one profiled block, by category.

    Attributes:
        device: the device whose memory was recorded.
        peak: total bytes live at the busiest moment of the block.
        at_peak: bytes per category at that moment (sums to ``peak``).
        max_by_category: the highest value each category reached in the block.
        end: bytes per category live when the block ended.
        times_ms: event times, in milliseconds from the first one.
        series: bytes per category after each event time (for plots).
    """

    device: str
    peak: int
    at_peak: dict[str, int]
    max_by_category: dict[str, int]
    end: dict[str, int]
    times_ms: list[float]
    series: dict[str, list[int]]

    def summary(self) -> str:
        """A few lines: the peak and its breakdown by category."""
        lines = [f"peak {format_bytes(self.peak)} on {self.device}:"]
        for c in CATEGORIES:
            lines.append(f"  {c:<18} {format_bytes(self.at_peak[c]):>12}")
        return "\n".join(lines)


def _tensors(obj: Any) -> Iterator[Tensor]:
    if isinstance(obj, Tensor):
        yield obj
    elif isinstance(obj, Mapping):
        for v in obj.values():
            yield from _tensors(v)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            yield from _tensors(v)


def _storage_ptr(t: Tensor) -> int:
    return t.untyped_storage().data_ptr()


class MemoryReport:
    """Context manager: profile a block and break its memory down by category.

    Args:
        model: the model being trained (its parameters are ``"parameters"``).
        optimizer: the optimizer(s); tensors in their ``state`` are
            ``"optimizer state"`` and their parameters ``"parameters"``.
        device: ``"cpu"`` or a CUDA device: whose memory to report.

    Attributes:
        result: the :class:`StepMemory`, set when the block exits.

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> with MemoryReport(model) as report:
        ...     model(torch.randn(2, 4)).sum().backward()
        >>> report.result.at_peak["gradients"] > 0
        True
    """

    def __init__(
        self,
        model: nn.Module | None = None,
        optimizer: Optimizer | Iterable[Optimizer] | None = None,
        device: str | torch.device = "cpu",
    ) -> None:
        self.model = model
        self.optimizers: list[Optimizer] = optimizer_list(optimizer)
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.result: StepMemory | None = None
        self._prof: Any = None
        self._gc_was_enabled = True

    def __enter__(self) -> MemoryReport:
        from torch.profiler import ProfilerActivity, profile

        activities = [ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(ProfilerActivity.CUDA)
            torch.cuda.synchronize(self.device)
        self._prof = profile(
            activities=activities, profile_memory=True, record_shapes=True, with_stack=True
        )
        self._gc_was_enabled = _pause_gc()  # as PeakMemory: readings independent of the GC
        with _muted():
            self._prof.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        try:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            with _muted():
                self._prof.__exit__(exc_type, *exc)
        finally:
            _resume_gc(self._gc_was_enabled)
        prof, self._prof = self._prof, None
        if exc_type is None:
            self.result = self._analyse(prof)

    # -- analysis ---------------------------------------------------------
    def _identity(self) -> dict[int, str]:
        """Storage pointer -> category for tensors whose role is certain."""
        known: dict[int, str] = {}
        for opt in self.optimizers:
            for t in _tensors(list(opt.state.values())):
                if t.device == self.device:
                    known[_storage_ptr(t)] = STATE
        params = list(self.model.parameters()) if self.model is not None else []
        params += [p for o in self.optimizers for g in o.param_groups for p in g["params"]]
        for p in params:
            if p.device == self.device:
                known[_storage_ptr(p)] = PARAMETERS
        return known

    def _analyse(self, prof: Any) -> StepMemory:
        try:
            from torch.profiler._memory_profiler import Action, Category, TensorKey

            with _muted():
                profile = prof._memory_profile()
                timeline = profile.timeline
        except Exception as e:  # private torch API: say what broke
            raise ReportError(
                f"torch's memory profiler failed ({type(e).__name__}: {e}). The memory "
                "report needs torch >= 2.4; layeropt.memory.PeakMemory still gives the "
                "total peak."
            ) from e
        from_torch = {
            Category.PARAMETER: PARAMETERS,
            Category.GRADIENT: GRADIENTS,
            Category.OPTIMIZER_STATE: STATE,
        }
        # Tensors live at the end whose storage is a parameter's or a state
        # tensor's take that category whatever torch's heuristics say.
        live: dict[Any, None] = {}
        for _, action, (key, _v), _n in timeline:
            if isinstance(key, TensorKey):
                if action in (Action.PREEXISTING, Action.CREATE):
                    live[key] = None
                elif action == Action.DESTROY:
                    live.pop(key, None)
        known = self._identity()
        fixed = {k: known[k.storage.ptr] for k in live if k.storage.ptr in known}

        def category(key: Any, version: int) -> str:
            if not isinstance(key, TensorKey):
                return OTHER
            if key in fixed:
                return fixed[key]
            return from_torch.get(profile._categories.get(key, version), OTHER)

        return _coalesce(timeline, self.device, category, Action)


def _coalesce(
    timeline: Iterable[tuple[int, Any, tuple[Any, int], int]],
    device: torch.device,
    category: Callable[[Any, int], str],
    action: Any,
) -> StepMemory:
    """Replay the profiler's (time, action, key, bytes) events per category."""
    current = dict.fromkeys(CATEGORIES, 0)
    highest = dict.fromkeys(CATEGORIES, 0)
    times: list[int] = []
    series: dict[str, list[int]] = {c: [] for c in CATEGORIES}
    peak, at_peak = 0, dict(current)
    for t, act, (key, version), nbytes in timeline:
        if key.device != device:
            continue
        if act in (action.PREEXISTING, action.CREATE):
            current[category(key, version)] += nbytes
        elif act == action.INCREMENT_VERSION:
            current[category(key, version)] -= nbytes
            current[category(key, version + 1)] += nbytes
        elif act == action.DESTROY:
            current[category(key, version)] -= nbytes
        total = sum(current.values())
        if total > peak:
            peak, at_peak = total, dict(current)
        for c in CATEGORIES:
            highest[c] = max(highest[c], current[c])
        if times and times[-1] == t:
            for c in CATEGORIES:
                series[c][-1] = current[c]
        else:
            times.append(t)
            for c in CATEGORIES:
                series[c].append(current[c])
    real = [t for t in times if t >= 0]
    t0 = real[0] if real else 0
    return StepMemory(
        device=str(device),
        peak=peak,
        at_peak=at_peak,
        max_by_category=highest,
        end=dict(current),
        times_ms=[max(t - t0, 0) / 1e6 for t in times],
        series=series,
    )


def report_step(
    fn: Callable[[], Any],
    model: nn.Module | None = None,
    optimizer: Optimizer | Iterable[Optimizer] | None = None,
    device: str | torch.device = "cpu",
) -> StepMemory:
    """Run ``fn()`` once under :class:`MemoryReport` and return its breakdown.

    Args:
        fn: one training step (forward, backward, optimizer step, zero_grad).
        model: the model, to recognise its parameters.
        optimizer: the optimizer(s), to recognise their state.
        device: whose memory to report.

    Returns:
        The :class:`StepMemory` of the call.

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> mem = report_step(lambda: model(torch.randn(2, 4)).sum().backward(), model)
        >>> mem.at_peak["parameters"]
        80
    """
    with MemoryReport(model, optimizer, device) as report:
        fn()
    assert report.result is not None
    return report.result


def format_table(results: Mapping[str, StepMemory]) -> str:
    """Side-by-side text table of several reports (e.g. torch vs layeropt).

    Args:
        results: run name -> its :class:`StepMemory`.

    Returns:
        The peak and its breakdown by category, one column per run.

    Example:
        >>> model = torch.nn.Linear(4, 4)
        >>> mem = report_step(lambda: model(torch.randn(2, 4)).sum().backward(), model)
        >>> format_table({"plain": mem}).splitlines()[2].split()
        ['parameters', '80', 'B']
    """
    names = list(results)
    width = max([14] + [len(n) + 2 for n in names])
    head = f"{'':<22}" + "".join(f"{n:>{width}}" for n in names)
    rows = [head, f"{'peak memory':<22}" + _cells([r.peak for r in results.values()], width)]
    for c in CATEGORIES:
        rows.append(f"{'  ' + c:<22}" + _cells([r.at_peak[c] for r in results.values()], width))
    return "\n".join(rows)


def _cells(values: list[int], width: int) -> str:
    return "".join(f"{format_bytes(v):>{width}}" for v in values)


def plot_timelines(results: Mapping[str, StepMemory], path: str | os.PathLike[str]) -> str:
    """Save a PNG of memory over the step, stacked by category, one panel per run.

    Args:
        results: run name -> its :class:`StepMemory` (e.g. torch and layeropt).
        path: where to write the image.

    Returns:
        ``path`` as a string.

    Raises:
        PlotDependencyError: matplotlib is not installed
            (``pip install 'layeropt[plot]'``).

    Example:
        >>> plot_timelines({"torch": a, "layeropt": b}, "memory.png")  # doctest: +SKIP
        'memory.png'
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as e:
        raise PlotDependencyError(
            "plotting the memory timeline needs matplotlib: run "
            "pip install 'layeropt[plot]' (or pip install matplotlib), or leave out the plot."
        ) from e
    if not results:
        raise ValueError("plot_timelines() needs at least one result to plot")
    fig = Figure(figsize=(5.5 * len(results), 4.2), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, len(results), sharey=True, squeeze=False)[0]
    top = max(r.peak for r in results.values()) / 2**20
    for ax, (name, r) in zip(axes, results.items()):
        ax.stackplot(
            r.times_ms,
            *[[b / 2**20 for b in r.series[c]] for c in CATEGORIES],
            labels=CATEGORIES,
            colors=[_COLORS[c] for c in CATEGORIES],
            step="post",
        )
        ax.set_title(f"{name}: peak {format_bytes(r.peak)}")
        ax.set_xlabel("time in step (ms)")
        ax.set_ylim(0, top * 1.08)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(f"memory on {next(iter(results.values())).device} (MiB)")
    handles, labels = axes[-1].get_legend_handles_labels()
    axes[-1].legend(handles[::-1], labels[::-1], loc="upper right", fontsize="small")
    fig.savefig(os.fspath(path), dpi=110)
    return os.fspath(path)
