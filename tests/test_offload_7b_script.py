"""``benchmarks/offload_7b.py`` (the 7B offload runs of ``benchmarks/device_check.sh``)
runs on CPU: its tiny smoke mode, in a fresh process, every CPU mode bit-identical
to torch.optim (parameters and optimizer state), the CUDA-only modes skipped."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
MODES = ["torch", "sync", "held-on-gpu", "budget"]


def _run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "offload_7b.py"), "--tiny", "--device", "cpu",
         "--micro", "2", "--steps", "2", *args],
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


def test_a_failing_mode_is_reported_and_fails_the_run():
    done = _run("--modes", "torch", "budget", "sync", "--budget-gib", "-1", "--steps", "1")
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ")]
    assert done.returncode == 1, done.stdout
    assert any(r.startswith("| budget | 2 | error: ValueError") for r in rows), done.stdout
    assert any(r.startswith("| sync |") and "exact: 84/84" in r for r in rows), done.stdout
