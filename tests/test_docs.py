"""Every ```python block in README.md and docs/*.md runs as written.

Each block runs in a fresh Python process, as a reader would paste it: the
library's own defaults (not the test suite's stricter bucket schedule), no
state left by other tests or blocks. The processes run two at a time.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)
BLOCKS = {
    f"{path.name}#{i}": code
    for path in DOCS
    for i, code in enumerate(BLOCK.findall(path.read_text()))
}


def _run(code: str, cwd: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, subprocess.CompletedProcess]:
    cwd = str(tmp_path_factory.mktemp("doc-blocks"))
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(_run, code, cwd) for name, code in BLOCKS.items()}
        return {name: f.result() for name, f in futures.items()}


@pytest.mark.parametrize("name", list(BLOCKS))
def test_doc_code_block_runs(results, name):
    proc = results[name]
    assert proc.returncode == 0, f"{name} failed:\n{BLOCKS[name]}\n{proc.stderr[-3000:]}"


def test_blocks_are_found():
    assert any(n.startswith("README.md") for n in BLOCKS) and len(BLOCKS) > 30
