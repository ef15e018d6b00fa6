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


def test_memory_peak_finds_the_peak_and_what_is_alive_there():
    """benchmarks/memory_peak.py on an allocator trace of known shape (the format of
    torch.cuda.memory._snapshot(): entries innermost frame first): the peak, the blocks
    alive at it grouped by the innermost frame outside torch, a block from before
    recording freed on the way."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import memory_peak

    mib = 2**20
    model = [{"filename": "/env/torch/functional.py", "line": 1, "name": "matmul"},
             {"filename": "/env/transformers/models/llama/modeling_llama.py", "line": 300,
              "name": "forward"}]
    step = [{"filename": "/env/layeropt/engine/landing.py", "line": 10, "name": "_step"}]

    def alloc(addr, size, frames):
        return {"action": "alloc", "addr": addr, "size": size * mib, "frames": frames}

    def free(addr, size):
        return {"action": "free_requested", "addr": addr, "size": size * mib, "frames": []}

    entries = [alloc(1, 100, model), alloc(2, 50, step), free(1, 100),
               free(999, 5),  # allocated before recording
               {"action": "segment_alloc", "addr": 0, "size": 512 * mib, "frames": []},
               alloc(3, 200, model), alloc(4, 10, step), free(3, 200), alloc(5, 30, model)]
    snapshot = {"segments": [], "device_traces": [entries]}
    most, at, alive = memory_peak.peak(snapshot, baseline=1000 * mib)
    assert (most, at) == (1255 * mib, 6)
    assert sorted(alive) == [2, 3, 4]
    text = memory_peak.summarize(snapshot, baseline=1000 * mib)
    lines = text.splitlines()
    assert lines[0] == ("peak allocated 1,255.0 MiB (trace entry 6): 1,000.0 MiB before "
                        "recording, 260.0 MiB in 3 blocks allocated while recording (and 5.0 "
                        "MiB of the earlier blocks freed since)")
    assert lines[2].split() == ["200.0", "1", "forward", "(llama/modeling_llama.py:300)",
                                "<-", "matmul"]
    assert lines[3].split() == ["60.0", "2", "_step", "(engine/landing.py:10)"]
    assert memory_peak.summarize(snapshot, 1000 * mib, top=1).splitlines()[-1].split() == [
        "60.0", "2", "(1", "more", "places)"]
    assert memory_peak.peak({"device_traces": [[]]}, 7) == (7, -1, {})
