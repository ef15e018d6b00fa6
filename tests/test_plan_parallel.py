"""``plan``'s forked workers (``layeropt.plan.parallel``): never a wait without end.

A fork copies one thread, so workers are forked only from a process with no
other Python thread and no CUDA context, and a worker that dies without its
measurements is a ``PlanError``. Run in a fresh process: a test runner's worker has a second
thread (where ``plan`` forks none), and the code before waited for a dead
worker for good (the subprocess's timeout fails the test).
"""

from __future__ import annotations

import subprocess
import sys

SCRIPT = """
import os, signal, threading
from dataclasses import dataclass
from layeropt.plan import PlanError
from layeropt.plan.parallel import can_fork, run_sharded

@dataclass(frozen=True)
class Row:
    name: str
    in_backward: bool = False
    optimizer: str = "torch.optim.AdamW"

@dataclass(frozen=True)
class Measured:
    variant: Row

def simulate(workload, rows, jobs, progress, **options):  # workload: the row to die at
    for i, row in enumerate(rows):
        progress(i, len(rows), row)
        if row.name == workload:
            os.kill(os.getpid(), signal.SIGKILL)
    return 7, [Measured(row) for row in rows]

rows = [Row(str(i)) for i in range(4)]
units = [[row] for row in rows]
print("fresh process", can_fork())
ticks = []
measured = run_sharded(simulate, None, rows, units, 2, lambda i, n, r: ticks.append(r), {})
print("two workers", measured == (7, [Measured(row) for row in rows]), sorted(ticks, key=lambda r: r.name) == rows)
try:
    run_sharded(simulate, "2", rows, units, 2, None, {})
    print("a worker killed", "no error")
except PlanError as e:
    print("a worker killed", "exit code -9" in str(e) and "--jobs 1" in str(e))
stop = threading.Event()
thread = threading.Thread(target=stop.wait)
thread.start()
print("another thread", not can_fork())
stop.set()
thread.join()
print("it ended", can_fork())
import torch
initialized = torch.cuda.is_initialized
torch.cuda.is_initialized = lambda: True  # (no GPU here: what a process that used one says)
print("a CUDA context", not can_fork())
torch.cuda.is_initialized = initialized
"""

EXPECTED = {  # what each line says: True where plan does what it should
    "fresh process": "True",
    "two workers": "True True",
    "a worker killed": "True",  # (a PlanError naming the exit code and the way round it)
    "another thread": "True",  # (no fork: the rows run in the planning process)
    "it ended": "True",
    "a CUDA context": "True",  # (a forked child cannot use it: no fork either)
}


def test_workers_fork_only_from_one_thread_and_a_dead_one_is_an_error():
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True,
                          timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr
    said = {}
    for line in done.stdout.splitlines():
        for case in EXPECTED:
            if line.startswith(case + " "):
                said[case] = line[len(case) + 1:]
    assert said == EXPECTED
