"""Every benchmark script still runs: its smoke mode, in a fresh process.

The benchmarks measure time, so nothing here is timed; what is checked is
that each script runs to the end and prints what its readers look for (and,
where the script compares parameters, that they are bit-identical).
"""

from __future__ import annotations

import os
import re
import pathlib
import subprocess
import sys

import pytest
from harness import needs_fsdp2

ROOT = pathlib.Path(__file__).resolve().parents[1]

# script and arguments -> text its output must contain
SMOKE = {
    "bench_step.py --tiny": "| contender |",
    "bench_overhead.py --tiny": "fused Adam",
    "loop_bench.py --tiny": "KiB",
    "bench_losses.py --tiny": "LM loss",
    "bench_verify.py --tiny": "bit-identical in all three",
    "bench_ddp.py --tiny": "layeropt bit-identical to DDP + torch.optim on every rank; "
                           "replicas agree bit for bit",
    "bench_ddp.py --tiny --fsdp": "layeropt bit-identical to FSDP2 + torch.optim on every "
                                  "rank; replicas agree bit for bit",
    "gpu_profile.py --device cpu --tiny": "ops by self CPU time",
    "offload_bench.py --device cpu --tiny --layers 2 --steps 2":
        "equal to layeropt: True",
    "offload_bench.py --device cpu --tiny --layers 2 --steps 2 --accumulate 3 --unproven":
        "sums added on GPU",
    # (torch's own step, bucket by bucket against whole: nothing differs unheld)
    "subset_ways.py --device cpu": "held by layeropt, 0 SILENT",
}


@pytest.mark.parametrize(
    "command", [pytest.param(c, marks=needs_fsdp2) if "--fsdp" in c else c for c in SMOKE]
)
def test_benchmark_runs(command):
    script, *args = command.split()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=240,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert SMOKE[command] in done.stdout, done.stdout[-3000:]
    assert "equal to layeropt: False" not in done.stdout, done.stdout[-3000:]


def test_device_check_returns_what_the_device_tool_can_bring_back():
    """The device tool returns at most 8 files from $OUT: device_check.sh writes one log
    there as it runs and packs the per-part logs and traces into one archive at the end."""
    script = (ROOT / "benchmarks" / "device_check.sh").read_text()
    written = set(re.findall(r'\$OUT/([\w.-]+)', script))
    assert written == {"device-check.log", "parts.tar.gz"}, written
