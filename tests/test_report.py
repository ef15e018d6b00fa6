"""layeropt.report: known allocations give known bytes per category (CPU, exact)."""

from __future__ import annotations

import sys

import pytest
import torch
from torch import nn

import layeropt
from layeropt.memory import PeakMemory
from layeropt.report import (
    CATEGORIES,
    MemoryReport,
    PlotDependencyError,
    format_table,
    plot_timelines,
    report_step,
)

# Linear(64, 128) then Linear(128, 32): bytes of each layer's weight + bias.
L1 = (64 * 128 + 128) * 4
L2 = (128 * 32 + 32) * 4
PARAMS = L1 + L2
STEP = 4  # Adam's per-parameter "step" counter: one float32 scalar
X_BYTES = 8 * 64 * 4  # the input batch, a pre-existing tensor the step reads


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


# (name, optimizer factory, attached, optimizer-state bytes, most gradient bytes live at once)
CASES = [
    ("torch Adam", lambda ps: torch.optim.Adam(ps), False, 2 * PARAMS + 4 * STEP, PARAMS),
    ("torch Adam fused", lambda ps: torch.optim.Adam(ps, fused=True), False,
     2 * PARAMS + 4 * STEP, PARAMS),
    ("torch SGD", lambda ps: torch.optim.SGD(ps, lr=0.1), False, 0, PARAMS),
    ("torch SGD momentum", lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9), False,
     PARAMS, PARAMS),
    # attached: only one layer's gradients are alive at a time (the larger: L1)
    ("layeropt Adam", lambda ps: layeropt.Adam(ps), True, 2 * PARAMS + 4 * STEP, L1),
    ("layeropt Adam fused", lambda ps: layeropt.Adam(ps, fused=True), True,
     2 * PARAMS + 4 * STEP, L1),
    ("layeropt SGD momentum", lambda ps: layeropt.SGD(ps, lr=0.1, momentum=0.9), True,
     PARAMS, L1),
]  # fmt: skip


def _setup(make_opt, attached):
    model = _model()
    opt = make_opt(list(model.parameters()))
    handle = layeropt.attach(model, opt) if attached else None
    x = torch.randn(8, 64)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return model, opt, handle, step


@pytest.mark.parametrize("name,make_opt,attached,state_bytes,grad_bytes", CASES,
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_known_bytes_per_category(name, make_opt, attached, state_bytes, grad_bytes):
    model, opt, handle, step = _setup(make_opt, attached)
    step()  # optimizer state now exists
    mem = report_step(step, model, opt)
    assert mem.at_peak["parameters"] == PARAMS
    assert mem.end["parameters"] == PARAMS
    assert mem.end["optimizer state"] == state_bytes
    assert mem.max_by_category["optimizer state"] == state_bytes
    assert mem.max_by_category["gradients"] == grad_bytes
    assert mem.end["gradients"] == 0  # zero_grad / the hooks freed them all
    assert sum(mem.at_peak.values()) == mem.peak
    # The total agrees with the independent meter: its peak of what the step
    # allocates, plus what the step found already there (params, state, input).
    with PeakMemory() as meter:
        step()
    assert mem.peak == meter.peak + PARAMS + state_bytes + X_BYTES
    if handle is not None:
        handle.remove()


def test_state_created_inside_the_block_is_optimizer_state():
    model, opt, _, step = _setup(lambda ps: torch.optim.Adam(ps), False)
    mem = report_step(step, model, opt)  # first step: Adam allocates its state here
    assert mem.end["optimizer state"] == 2 * PARAMS + 4 * STEP
    assert mem.max_by_category["gradients"] == PARAMS


def test_identity_classifies_state_without_an_optimizer_step_call():
    """An attached backward alone updates the model; its state is still found."""
    model, opt, handle, _ = _setup(lambda ps: layeropt.Adam(ps), True)
    x = torch.randn(8, 64)
    model(x).sum().backward()
    mem = report_step(lambda: model(x).sum().backward(), model, opt)
    assert mem.end["optimizer state"] == 2 * PARAMS + 4 * STEP
    assert mem.end["parameters"] == PARAMS
    assert mem.max_by_category["gradients"] == L1
    handle.remove()


def test_without_model_or_optimizer_nothing_is_lost():
    """Every byte is in some category even when no tensor is identified."""
    _, _, _, step = _setup(lambda ps: torch.optim.Adam(ps), False)
    step()
    mem = report_step(step)
    with PeakMemory() as meter:
        step()
    assert mem.peak == meter.peak + PARAMS + 2 * PARAMS + 4 * STEP + X_BYTES
    assert set(mem.at_peak) == set(CATEGORIES)


def test_timeline_series_are_consistent():
    model, opt, _, step = _setup(lambda ps: torch.optim.Adam(ps), False)
    step()
    with MemoryReport(model, opt) as report:
        step()
    mem = report.result
    assert mem is not None
    n = len(mem.times_ms)
    assert n > 10 and all(len(mem.series[c]) == n for c in CATEGORIES)
    assert mem.times_ms == sorted(mem.times_ms) and mem.times_ms[0] == 0
    totals = [sum(mem.series[c][i] for c in CATEGORIES) for i in range(n)]
    assert max(totals) == mem.peak
    assert {c: mem.series[c][-1] for c in CATEGORIES} == mem.end


def test_no_result_when_the_block_raises():
    with pytest.raises(KeyError), MemoryReport() as report:
        raise KeyError("boom")
    assert report.result is None


def test_format_table_lists_every_category_per_run():
    model, opt, _, step = _setup(lambda ps: torch.optim.Adam(ps), False)
    step()
    mem = report_step(step, model, opt)
    text = format_table({"first": mem, "second": mem})
    lines = text.splitlines()
    assert "first" in lines[0] and "second" in lines[0]
    assert len(lines) == 2 + len(CATEGORIES)
    assert lines[2].split()[:1] == ["parameters"] and lines[2].count("KiB") == 2


def _two_results():
    out = {}
    for name, make_opt, attached in [("torch", torch.optim.Adam, False),
                                     ("layeropt", layeropt.Adam, True)]:  # fmt: skip
        model, opt, handle, step = _setup(lambda ps, c=make_opt: c(ps), attached)
        step()
        out[name] = report_step(step, model, opt)
        if handle is not None:
            handle.remove()
    return out


def test_plot_writes_a_png(tmp_path):
    pytest.importorskip("matplotlib")
    path = tmp_path / "memory.png"
    assert plot_timelines(_two_results(), path) == str(path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib_says_how_to_install(tmp_path, monkeypatch):
    for mod in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, mod, None)  # import raises ImportError
    with pytest.raises(PlotDependencyError, match=r"pip install 'layeropt\[plot\]'"):
        plot_timelines(_two_results(), tmp_path / "memory.png")
    assert not (tmp_path / "memory.png").exists()
    assert issubclass(PlotDependencyError, ImportError)


def test_plot_needs_a_result(tmp_path):
    pytest.importorskip("matplotlib")
    with pytest.raises(ValueError, match="at least one"):
        plot_timelines({}, tmp_path / "x.png")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_parameters_and_state_exact():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32)).cuda()
    opt = torch.optim.Adam(model.parameters(), fused=True)
    x = torch.randn(8, 64, device="cuda")

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    mem = report_step(step, model, opt, device="cuda")
    assert mem.end["parameters"] == PARAMS
    # the CUDA caching allocator rounds each block up to 512 bytes
    assert mem.end["optimizer state"] >= 2 * PARAMS


def test_peak_memory_reading_does_not_depend_on_when_the_collector_runs():
    """A tensor kept by a reference cycle made in the block stays counted to its end.

    Whether Python's collector happens to run inside the block (here forced by
    allocating many containers) must not change the reading.
    """
    import gc

    class Cycle:
        pass

    with PeakMemory() as mem:
        junk = Cycle()
        junk.me, junk.tensor = junk, torch.zeros(2**18)  # 1 MiB held by a cycle
        del junk
        churn = [[] for _ in range(5 * gc.get_threshold()[0])]  # enough to trigger it
        del churn
        small = torch.zeros(256)  # 1 KiB
    assert gc.isenabled()
    assert (mem.peak, mem.end) == (2**20 + 1024, 2**20 + 1024)
    del small
    gc.collect()
