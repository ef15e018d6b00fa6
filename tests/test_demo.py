"""The ``python -m layeropt demo`` command, run in-process on tiny models."""

from __future__ import annotations

import dataclasses
import re
import sys

import pytest
import torch

import layeropt
from layeropt import demo
from layeropt.__main__ import main
from layeropt.demo import DEMO_MODELS, MOST_GRADIENTS, run_demo

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _row(out: str, label: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return line[len(label):].split()


def _bytes(value: str, unit: str) -> float:
    return float(value) * UNITS[unit]


def _flat(text: str) -> str:
    return " ".join(text.split())


def _no_step_time_number(out: str) -> None:
    """No step-time row in the table, and no ratio anywhere in what is said of step time."""
    assert not any(line.startswith("step time (") for line in out.splitlines())
    assert _flat(out).count("step time:") == 1  # the one line that withholds it
    said = _flat(out).split("step time: ", 1)[1]
    assert said.startswith("not shown for a run this short (")
    assert not re.search(r"\d\.\d\dx", said), said
    assert "noise" not in out
    assert "--steps 40" in said and "benchmarks/bench_step.py" in said


@pytest.mark.parametrize(
    "args",
    [
        ["--model", "gpt"],
        ["--model", "gpt", "--checkpoint"],
        ["--model", "mlp"],
        ["--model", "unet"],
    ],
    ids=lambda a: "-".join(x.lstrip("-") for x in a),
)
def test_cli_tiny_prints_exact_and_smaller(args, capsys):
    assert main(["demo", "--tiny", "--no-progress", *args]) == 0
    out = capsys.readouterr().out
    assert _row(out, "max |parameter difference|") == ["0.0"]
    t_val, t_unit, l_val, l_unit, ratio = _row(out, "peak memory of a step")
    assert _bytes(l_val, l_unit) < _bytes(t_val, t_unit)
    assert float(ratio.rstrip("x")) < 1.0
    # the saving is the gradients: same parameters and optimizer state
    assert "\n  of which, at that moment:\n    parameters " in out
    p = _row(out, "    parameters")
    assert p[:2] == p[2:4]
    s = _row(out, "    optimizer state")
    assert s[:2] == s[2:4]
    g = _row(out, "    gradients")
    assert _bytes(*g[2:4]) < _bytes(*g[:2])
    most = _row(out, MOST_GRADIENTS)
    assert _bytes(*most[2:4]) < _bytes(*most[:2])
    assert "\ngradients: torch.optim keeps every gradient until step()" in out
    # --tiny times 2 pairs of steps: too few for a step time worth printing
    _no_step_time_number(out)
    assert "(2 timed pairs of steps are too few to measure it to within 5%)" in _flat(out)


@pytest.mark.parametrize("model", DEMO_MODELS)
def test_run_demo_result_matches_table(model):
    result = run_demo(model, tiny=True, steps=3, progress=False, stream=_Null())
    assert result.max_param_diff == 0.0
    assert result.pairs == 1 and result.time_ratio is not None and result.time_ratio > 0
    assert result.pair_ratios == [result.time_ratio]
    assert result.time_interval is None and not result.time_shown
    _no_step_time_number(result.table)
    torch_mem, lo_mem = result.memory["torch.optim.Adam"], result.memory["layeropt.Adam"]
    assert lo_mem.peak <= torch_mem.peak
    assert lo_mem.at_peak["parameters"] == torch_mem.at_peak["parameters"] > 0
    assert lo_mem.end["optimizer state"] == torch_mem.end["optimizer state"] > 0
    assert lo_mem.max_by_category["gradients"] < torch_mem.max_by_category["gradients"]
    assert "max |parameter difference|" in result.table


def test_one_pair_is_said_so_never_1_pairs(capsys):
    assert main(["demo", "--tiny", "--no-progress", "--model", "mlp", "--steps", "3"]) == 0
    out = capsys.readouterr().out
    assert "1 pairs" not in out and "1 pair ratios" not in out
    _no_step_time_number(out)
    assert "(1 timed pair of steps is too few to measure it to within 5%)" in _flat(out)


def test_two_steps_print_no_pair_and_no_time_number():
    result = run_demo("mlp", tiny=True, steps=2, progress=False, stream=_Null())
    assert result.pairs == 0 and result.time_ratio is None and not result.time_shown
    _no_step_time_number(result.table)
    assert "(no pair of steps was timed)" in _flat(result.table)


def _fake_clock(durations):
    """A step clock whose n-th timed step takes ``durations(n)`` (torch's and layeropt's)."""

    def clock(dev):
        calls = {"n": 0, "t": 0.0}

        def now():
            if calls["n"] % 2:  # the end of a step
                calls["t"] += durations(calls["n"] // 2)
            calls["n"] += 1
            return calls["t"]

        return now

    return clock


def test_step_time_shown_when_the_run_pins_it_down(monkeypatch):
    """Six pairs whose ratios agree: the row and its 95% interval are printed."""
    monkeypatch.setattr(demo, "_clock", _fake_clock(lambda n: 0.25))
    result = run_demo("mlp", tiny=True, steps=8, progress=False, stream=_Null())
    assert result.pairs == 6 and result.pair_ratios == [1.0] * 6
    assert result.time_interval == (1.0, 1.0) and result.time_shown
    assert re.search(r"\nstep time \(median of 6 pairs\)\s+1\.00x\s+1\.00x\s+1\.00x\n",
                     result.table)
    flat = _flat(_notes(result.table))
    assert "step time: median of 6 pair ratios; with 95% confidence between 1.00x and " \
        "1.00x." in flat
    assert "not shown" not in flat and "noise" not in flat


def test_step_time_withheld_when_the_pairs_spread(monkeypatch):
    """Six pairs whose ratios spread by more than 5%: no ratio is printed at all."""
    # steps of 1.0, 1.1, 1.2, 1.0, ... time units: the pair ratios spread 0.83x-1.2x
    monkeypatch.setattr(demo, "_clock", _fake_clock(lambda n: 1.0 + 0.1 * (n % 3)))
    result = run_demo("mlp", tiny=True, steps=8, progress=False, stream=_Null())
    assert result.pairs == 6 and result.time_interval is not None
    assert max(result.pair_ratios) / min(result.pair_ratios) > 1.2
    assert not result.time_shown
    _no_step_time_number(result.table)
    assert "(its 6 timed pairs of steps varied too much to measure it to within 5%)" \
        in _flat(result.table)


def test_median_interval_is_the_sign_test_interval():
    """95% (at least) of the time the median lies between the returned order statistics."""
    from math import comb

    assert demo._median_interval([]) is None
    assert demo._median_interval([1.0] * 5) is None  # min..max of 5: 93.75%
    data = [1.0 + i / 100 for i in (5, 3, 9, 1, 7, 2, 8, 4, 6, 0, 11, 10, 15, 12, 14, 13,
                                    19, 16, 18, 17)]  # fmt: skip
    for n, k in ((6, 1), (8, 1), (9, 2), (20, 6)):  # k: values left out at each end + 1
        s = sorted(data[:n])
        assert demo._median_interval(data[:n]) == (s[k - 1], s[n - k])
        miss = 2 * sum(comb(n, j) for j in range(k)) / 2**n
        assert miss <= 0.05 < 2 * sum(comb(n, j) for j in range(k + 1)) / 2**n


def test_gradient_figures_agree():
    """The table's gradient rows, its breakdown and the note beneath say one thing.

    ``most gradient memory at once`` is the figure the note quotes for both runs;
    the breakdown under the peak is what was alive at that moment (it sums to the
    peak), never more than the most, and the note says so where it is less.
    """
    for model in ("gpt", "loop"):
        result = run_demo(model, tiny=True, steps=2, progress=False, stream=_Null())
        table, fmt = result.table, demo.format_bytes
        t, lo = result.memory["torch.optim.Adam"], result.memory["layeropt.Adam"]
        most = _row(table, MOST_GRADIENTS)
        assert most[:4] == [*fmt(t.max_by_category["gradients"]).split(),
                            *fmt(lo.max_by_category["gradients"]).split()]  # fmt: skip
        flat = _flat(_notes(table))
        assert f"until step() ({' '.join(most[:2])} at once)" in flat
        assert f"(at most {' '.join(most[2:4])} at once)" in flat
        at_peak = _row(table, "    gradients")
        assert at_peak[:4] == [*fmt(t.at_peak["gradients"]).split(),
                               *fmt(lo.at_peak["gradients"]).split()]  # fmt: skip
        for run in (t, lo):
            assert sum(run.at_peak.values()) == run.peak
            assert run.at_peak["gradients"] <= run.max_by_category["gradients"]
        if model == "gpt":  # layeropt peaks holding fewer than its most; torch its most
            assert lo.at_peak["gradients"] < lo.max_by_category["gradients"]
            assert t.at_peak["gradients"] == t.max_by_category["gradients"]
            assert f"At its peak of memory, another moment, layeropt held " \
                f"{' '.join(at_peak[2:4])} of them." in flat
        else:  # both peak before their gradients are complete
            assert f"At their peaks of memory, other moments, torch.optim held " \
                f"{' '.join(at_peak[:2])} of them and layeropt {' '.join(at_peak[2:4])}." \
                in flat
        # the printed breakdown adds up to the printed peak, to the figures' rounding
        rows = ["peak memory of a step", "    parameters", "    optimizer state",
                "    gradients", "    activations/other"]  # fmt: skip
        for col in (0, 2):
            (peak, *parts) = [_row(table, r)[col:col + 2] for r in rows]
            rounding = sum(UNITS[unit] * 0.05 for _, unit in (peak, *parts))
            assert abs(sum(_bytes(*x) for x in parts) - _bytes(*peak)) <= rounding


def _notes(table: str) -> str:
    """The explanation printed beneath the table (after its last row)."""
    head, sep, notes = table.partition("max |parameter difference|")
    assert sep, table
    return notes.split("\n\n", 1)[1]


def _ratio(out: str, label: str) -> float:
    return float(_row(out, label)[-1].rstrip("x"))


def test_table_is_explained_beneath_it():
    """Each row that can puzzle has its line: gradients, activations/other, step time."""
    result = run_demo("gpt", tiny=True, steps=4, progress=False, stream=_Null())
    notes = _notes(result.table)
    flat = " ".join(notes.split())
    assert notes.startswith("gradients: torch.optim keeps every gradient until step()")
    assert "layeropt frees each layer's once backward has updated it" in flat
    torch_mem, lo_mem = result.memory["torch.optim.Adam"], result.memory["layeropt.Adam"]
    # activations/other is larger at layeropt's peak (tiny GPT, every-layer schedule):
    # the note says each run is read at its own peak, and the runs' highest values
    assert lo_mem.at_peak["activations/other"] > torch_mem.at_peak["activations/other"]
    assert _ratio(result.table, "    activations/other") > 1.0
    assert "activations/other: activations, inputs and autograd's buffers, read at each " \
        "run's own peak" in flat
    assert "layeropt peaks earlier, while they are still alive" in flat
    assert demo.format_bytes(torch_mem.max_by_category["activations/other"]) in flat
    # 2 timed pairs: the time note withholds the ratio and says what measures it
    assert "step time: not shown for a run this short" in flat
    assert not re.search(r"\d\.\d\dx", flat.split("step time:", 1)[1])
    assert all(len(line) <= 84 for line in notes.splitlines())


def test_loop_model_says_why_it_saves_nothing_at_its_peak():
    result = run_demo("loop", tiny=True, steps=3, progress=False, stream=_Null())
    flat = " ".join(_notes(result.table).split())
    assert "no saving at this peak: both runs peak in backward before most gradients are " \
        "complete" in flat
    assert "LoopNet's extractor and mix are used in every iteration" in flat


def test_gradients_under_the_bucket_cap_are_named(monkeypatch):
    """With the library's default cap a tiny model's gradients are stepped together."""
    defaults = dict(layeropt.attach.__kwdefaults__)
    defaults["bucket_cap_mb"] = 1.0
    monkeypatch.setattr(layeropt.attach, "__kwdefaults__", defaults)
    result = run_demo("mlp", tiny=True, steps=3, progress=False, stream=_Null())
    flat = " ".join(_notes(result.table).split())
    assert "no saving at this peak: all the model's gradients" in flat
    assert "fit under attach's bucket_cap_mb=1 (MiB)" in flat


def test_cpu_timing_uses_one_thread_and_restores_the_count(capsys):
    """Steps are timed single-threaded by CPU time; the user's thread count comes back."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)  # a user's setting other than the demo's one thread
    seen: list[int] = []
    spec_loss = demo._spec("mlp", True).loss

    def loss(m, batch):
        seen.append(torch.get_num_threads())
        return spec_loss(m, batch)

    real_spec = demo._spec
    try:
        demo._spec = lambda name, tiny: dataclasses.replace(real_spec(name, tiny), loss=loss)
        result = run_demo("mlp", tiny=True, progress=False, stream=_Null())
    finally:
        demo._spec = real_spec
        after = torch.get_num_threads()
        torch.set_num_threads(before)
    assert seen and set(seen) == {1}
    assert after == 2
    assert "cpu (1 thread; step time by CPU time)" in result.table


def test_progress_bar_on_stderr(capsys):
    assert main(["demo", "--tiny", "--model", "mlp"]) == 0
    captured = capsys.readouterr()
    assert "training [" in captured.err and "4/4" in captured.err
    assert "training [" not in captured.out


def test_plot_written(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    path = tmp_path / "demo.png"
    assert main(["demo", "--tiny", "--no-progress", "--model", "mlp", "--plot", str(path)]) == 0
    assert path.read_bytes()[:4] == b"\x89PNG"
    assert str(path) in capsys.readouterr().out


def test_plot_without_matplotlib_fails_fast(tmp_path, capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    path = tmp_path / "demo.png"
    assert main(["demo", "--tiny", "--model", "mlp", "--plot", str(path)]) == 2
    captured = capsys.readouterr()
    assert "pip install 'layeropt[plot]'" in captured.err
    assert captured.out == "" and not path.exists()  # nothing trained


def test_too_few_steps_exit_2(capsys):
    assert main(["demo", "--steps", "1"]) == 2
    assert "--steps >= 2" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA present: --device cuda is valid")
def test_cuda_without_cuda_exit_2(capsys):
    assert main(["demo", "--tiny", "--device", "cuda"]) == 2
    assert "torch.cuda.is_available() is False" in capsys.readouterr().err


def test_unknown_model_is_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["demo", "--model", "resnet"])
    assert exc.value.code == 2
    assert "invalid choice" in capsys.readouterr().err


def test_no_command_prints_help(capsys):
    assert main([]) == 2
    assert "demo" in capsys.readouterr().err


class _Null:
    def write(self, text: str) -> int:
        return len(text)

    def flush(self) -> None:
        pass
