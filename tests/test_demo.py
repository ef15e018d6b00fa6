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
from layeropt.demo import DEMO_MODELS, run_demo

UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def _row(out: str, label: str) -> list[str]:
    line = next(line for line in out.splitlines() if line.startswith(label))
    return line[len(label):].split()


def _bytes(value: str, unit: str) -> float:
    return float(value) * UNITS[unit]


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
    p = _row(out, "  parameters (at peak)")
    assert p[:2] == p[2:4]
    s = _row(out, "  optimizer state (at peak)")
    assert s[:2] == s[2:4]
    g = _row(out, "  gradients (at peak)")
    assert _bytes(*g[2:4]) < _bytes(*g[:2])
    assert re.search(r"step time \(median of 2 pairs\)\s+1\.00x\s+\d+\.\d\dx", out)
    assert "\ngradients: torch.optim keeps every gradient until step()" in out
    assert "step time: median of 2 pair ratios" in out


@pytest.mark.parametrize("model", DEMO_MODELS)
def test_run_demo_result_matches_table(model):
    result = run_demo(model, tiny=True, steps=3, progress=False, stream=_Null())
    assert result.max_param_diff == 0.0
    assert result.pairs == 1 and result.time_ratio is not None and result.time_ratio > 0
    assert result.pair_ratios == [result.time_ratio]
    assert "1 pairs" not in result.table and "step time (one pair)" in result.table
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
    assert re.search(r"step time \(one pair\)\s+1\.00x\s+\d+\.\d\dx", out)
    assert "step time: one pair is too few to tell a difference from noise" in out


def test_two_steps_print_no_pair_and_no_time_note():
    result = run_demo("mlp", tiny=True, steps=2, progress=False, stream=_Null())
    assert result.pairs == 0 and result.time_ratio is None
    assert "(needs --steps >= 3)" in result.table
    assert "pair" not in result.table


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
    assert _ratio(result.table, "  activations/other (at peak)") > 1.0
    assert "activations/other: activations, inputs and autograd's buffers, read at each " \
        "run's own peak" in flat
    assert "layeropt peaks earlier, while they are still alive" in flat
    assert demo.format_bytes(torch_mem.max_by_category["activations/other"]) in flat
    # the time note gives the spread of the pairs
    assert re.search(r"step time: median of 2 pair ratios, which ranged \d+\.\d\dx-\d+\.\d\dx",
                     flat)
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
