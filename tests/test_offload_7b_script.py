"""``benchmarks/offload_7b.py`` (the 7B offload runs of ``benchmarks/device_check.sh``)
runs on CPU: its tiny smoke mode, in a fresh process, every CPU mode bit-identical
to torch.optim (parameters and optimizer state), the CUDA-only modes skipped."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import re
import subprocess
import sys

import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODES = ["torch", "sync", "held-on-gpu", "budget"]


ARGS = ["--tiny", "--device", "cpu", "--micro", "2", "--steps", "2"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "offload_7b.py"), *ARGS, *args],
        check=False, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )


def test_tiny_cpu_modes_bit_identical_to_torch():
    # 100 KiB of held gradients stay in .grad: some of the tiny model's buckets, not all
    done = _run("--modes", *MODES, "prefetch", "overlap-prefetch", "--budget-gib", "0.0001")
    out = done.stdout
    assert done.returncode == 0, done.stderr[-3000:] + out[-3000:]
    rows = {line.split("|")[1].strip(): line for line in out.splitlines()
            if line.startswith("| ") and not line.startswith("| mode")}
    assert "reference" in rows["torch"], out
    for mode in MODES[1:]:
        found = re.search(r"exact: (\d+)/(\d+) tensors bit-identical to torch", rows[mode])
        assert found, rows[mode]
        same, total = map(int, found.groups())
        assert same == total == 21 * 4, rows[mode]  # 21 parameters, exp_avg/exp_avg_sq/step
    for mode in ("prefetch", "overlap-prefetch"):
        assert "skipped: CUDA only" in rows[mode], out


def test_a_failing_mode_is_reported_and_fails_the_run(monkeypatch, capsys):
    """In this process (the script's start, its imports, paid once above): a mode that
    raises is a row saying so and exit code 1, the other modes still run."""
    spec = importlib.util.spec_from_file_location("offload_7b", ROOT / "benchmarks" / "offload_7b.py")
    script = importlib.util.module_from_spec(spec)
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # (the script sets it)
    spec.loader.exec_module(script)
    monkeypatch.setattr(sys, "argv", ["offload_7b.py", *ARGS, "--modes", "torch", "budget", "sync",
                                      "--budget-gib", "-1", "--steps", "1"])
    deterministic = torch.are_deterministic_algorithms_enabled()
    try:
        code = script.main()
    finally:
        torch.use_deterministic_algorithms(deterministic)
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ")]
    assert code == 1, out
    assert any(r.startswith("| budget | 2 | error: ValueError") for r in rows), out
    assert any(r.startswith("| sync |") and "exact: 84/84" in r for r in rows), out
