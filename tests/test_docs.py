"""Every ```python block in README.md and docs/*.md runs as written.

Each block runs in a fresh process, as a reader would paste it: the library's
own defaults (not the test suite's stricter bucket schedule), no state left
by other tests or blocks. A clean parent process imports torch and layeropt
(and the optional tools, when installed) once and forks one child per block
(two at a time), so no block pays for the imports; where ``fork`` is missing
each block gets its own interpreter.

A block that imports an optional tool (Lightning, accelerate, transformers, a
third-party optimizer: :data:`EXTRAS`) is skipped where that tool is not
installed, naming the extra that installs it, as the tool's own test modules
are; so is a block that calls ``pytest.importorskip`` itself.
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import pathlib
import re
import subprocess
import sys

import pytest
from harness import TORCH

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
# A block may follow a line "<!-- needs torch >= X.Y -->" (its text says so too).
BLOCK = re.compile(r"(?:<!-- needs torch >= ([0-9.]+) -->\n)?```python\n(.*?)```", re.S)
FOUND = {
    f"{path.name}#{i}": (needs, code)
    for path in DOCS
    for i, (needs, code) in enumerate(BLOCK.findall(path.read_text()))
}
BLOCKS = {name: code for name, (_, code) in FOUND.items()}
NEEDS = {name: needs for name, (needs, _) in FOUND.items() if needs}

#: Optional tools a block may import -> the extra of pyproject.toml that installs it.
EXTRAS = {"lightning": "lightning", "accelerate": "hf", "transformers": "hf",
          "tokenizers": "hf", "trl": "hf", "datasets": "hf",
          "matplotlib": "plot", "schedulefree": "optimizers", "bitsandbytes": "optimizers",
          "torchao": "optimizers", "prodigyopt": "optimizers", "dadaptation": "optimizers"}
#: layeropt's integrations import their tool (the Trainer needs accelerate too).
INTEGRATIONS = {"layeropt.integrations.lightning": ("lightning",),
                "layeropt.integrations.accelerate": ("accelerate",),
                "layeropt.integrations.hf": ("transformers", "accelerate")}
SKIP = "SKIPPED: "  # a block's result when it called pytest.importorskip / pytest.skip


def tools(code: str) -> list[str]:
    """The optional tools (:data:`EXTRAS`) a block imports, anywhere in it."""
    found: list[str] = []
    for node in ast.walk(ast.parse(code)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        else:
            continue
        for name in names:
            found += INTEGRATIONS.get(name, ()) or [name.split(".")[0]]
    return [t for t in dict.fromkeys(found) if t in EXTRAS]


def missing_tools(code: str) -> list[str]:
    return [t for t in tools(code) if importlib.util.find_spec(t) is None]


RUNNABLE = {name: code for name, code in BLOCKS.items() if not missing_tools(code)}

# Runs in a fresh interpreter: reads {name: code}, prints {name: error or ""}.
RUNNER = r'''
import json, os, sys, tempfile, traceback
blocks = json.load(sys.stdin)
results = {}
if hasattr(os, "fork"):
    import torch, layeropt  # noqa: F401  (imported once; blocks see fresh copies)
    for heavy in ("transformers", "accelerate", "lightning.pytorch"):  # when installed
        try:
            __import__(heavy)
        except ImportError:
            pass
    running = {}
    def reap():
        pid, status = os.wait()
        name, path = running.pop(pid)
        with open(path) as f:
            results[name] = f.read() or ("" if status == 0 else f"exit status {status}")
        os.unlink(path)
    for name, code in blocks.items():
        if len(running) >= 2:
            reap()
        fd, path = tempfile.mkstemp()
        os.close(fd)
        pid = os.fork()
        if pid == 0:
            try:
                exec(compile(code, name, "exec"), {"__name__": "__main__"})
                status = 0
            except BaseException as e:
                with open(path, "w") as f:
                    if type(e).__name__ == "Skipped":  # pytest.importorskip, pytest.skip
                        f.write("SKIPPED: " + str(e))
                    else:
                        f.write(traceback.format_exc())
                status = 1
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(status)
        running[pid] = (name, path)
    while running:
        reap()
else:  # pragma: no cover - platforms without fork
    import subprocess
    for name, code in blocks.items():
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
        results[name] = "" if p.returncode == 0 else p.stderr
print("RESULTS" + json.dumps(results))
'''


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    cwd = str(tmp_path_factory.mktemp("doc-blocks"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, "-c", RUNNER], input=json.dumps(RUNNABLE), cwd=cwd,
                          env=env, capture_output=True, text=True, timeout=900)
    assert "RESULTS" in proc.stdout, proc.stderr[-3000:]
    return json.loads(proc.stdout.rsplit("RESULTS", 1)[1])


@pytest.mark.xdist_group("doc-blocks")  # (every block runs in the fixture: one worker)
@pytest.mark.parametrize("name", list(BLOCKS))
def test_doc_code_block_runs(results, name):
    if name in NEEDS and TORCH < tuple(int(v) for v in NEEDS[name].split(".")):
        pytest.skip(f"needs torch >= {NEEDS[name]}")
    missing = missing_tools(BLOCKS[name])
    if missing:
        extras = sorted({EXTRAS[t] for t in missing})
        pytest.skip(f"needs {', '.join(missing)}: pip install -e \".[{','.join(extras)}]\"")
    if results[name].startswith(SKIP):
        pytest.skip(results[name][len(SKIP) :])
    assert results[name] == "", f"{name} failed:\n{BLOCKS[name]}\n{results[name][-3000:]}"


def test_blocks_are_found():
    assert any(n.startswith("README.md") for n in BLOCKS) and len(BLOCKS) > 30


def test_blocks_of_optional_tools_are_skipped_where_the_tool_is_missing(monkeypatch):
    """The Lightning, accelerate and Trainer blocks name their tools, and a missing one
    keeps the block from running (``pip install -e ".[test]"`` alone passes)."""
    by_tool = {t: [n for n, code in BLOCKS.items() if t in tools(code)] for t in EXTRAS}
    assert any(n.startswith("integrations.md") for n in by_tool["lightning"])
    assert any(n.startswith("integrations.md") for n in by_tool["accelerate"])
    assert any(n.startswith("recipes.md") for n in by_tool["transformers"])
    assert any(n.startswith("integrations.md") for n in by_tool["trl"])
    assert tools("from layeropt.integrations.hf import LayeroptTrainer") == [
        "transformers", "accelerate"]
    assert tools("import torch\nimport layeropt\nfrom layeropt.memory import PeakMemory") == []
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "lightning" else find_spec(name, *a))
    for name in by_tool["lightning"]:
        assert missing_tools(BLOCKS[name]) == ["lightning"]
