"""The package's shape: no import cycle, nothing of torch patched by importing it."""

from __future__ import annotations

import ast
import contextlib
import os
import pathlib
import subprocess
import sys

import pytest
import torch

import layeropt
from harness import one_process_group

ROOT = pathlib.Path(layeropt.__file__).parent


def _imports() -> dict[str, set[str]]:
    """``module -> layeropt modules it imports`` (at any depth of the file)."""
    files = {}
    for f in ROOT.rglob("*.py"):
        parts = f.relative_to(ROOT.parent).with_suffix("").parts
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph: dict[str, set[str]] = {m: set() for m in files}
    for m, f in files.items():
        package = m if f.name == "__init__.py" else m.rsplit(".", 1)[0]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rsplit(".", 1)[0]
                target = (f"{base}.{node.module}" if node.module else base) if node.level \
                    else node.module
                for alias in node.names:
                    name = next((c for c in (f"{target}.{alias.name}", target) if c in files), None)
                    if name is not None and name != m:
                        graph[m].add(name)
            elif isinstance(node, ast.Import):
                graph[m].update(a.name for a in node.names if a.name in files and a.name != m)
    return graph


def test_no_import_cycles():
    """A package imports its submodules; otherwise no module reaches itself again."""
    graph = _imports()
    for module in graph:
        seen, todo = set(), [n for n in graph[module] if not n.startswith(module + ".")]
        while todo:
            node = todo.pop()
            assert node != module, f"{module} imports itself through {sorted(seen)}"
            if node not in seen and not module.startswith(node + "."):
                seen.add(node)
                todo.extend(graph[node])


_PATCHED = (
    "import torch, torch.nn.utils as u, torch.utils.checkpoint as tc, torch.optim.optimizer as oo\n"
    "import torch.distributed.pipelining.schedules as ps\n"  # (a tool: watched once imported)
    "names = ('clip_grad_norm_', 'clip_grad_value_')\n"
    "def seen():\n"
    "    return ([getattr(u, n).__closure__[0].cell_contents for n in names],\n"
    "            tc.CheckpointFunction.forward, torch.amp.GradScaler.scale,\n"
    "            torch.autograd.backward, torch.nn.Module.zero_grad,\n"
    "            len(oo._global_optimizer_pre_hooks),\n"
    "            ps.PipelineScheduleSingle.step, ps.PipelineScheduleMulti.step)\n"
    "before = seen()\n"
)


def test_importing_layeropt_or_making_an_optimizer_patches_nothing_in_torch():
    """Only attaching installs the watchers (in a fresh process)."""
    code = _PATCHED + (
        "import layeropt, layeropt.integrations, layeropt.losses, layeropt.report\n"
        "opt = layeropt.SGD([torch.zeros(1, requires_grad=True)], lr=0.1)\n"
        "assert seen() == before, 'patched by importing or by an optimizer'\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def test_the_last_attachment_leaves_torch_as_it_found_it():
    """attach installs the watchers once; the last attachment's remove() - or its garbage
    collection - undoes every patch and the global optimizer hook (a fresh process)."""
    code = _PATCHED + (
        "import gc, layeropt\n"
        "a, b = torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)\n"
        "oa, ob = layeropt.SGD(a.parameters(), lr=0.1), layeropt.SGD(b.parameters(), lr=0.1)\n"
        "ha = layeropt.attach(a, oa)\n"
        "during = seen()\n"
        "assert all(x != y for x, y in zip(during, before)), (during, before)\n"
        "hb = layeropt.attach(b, ob)\n"
        "assert seen() == during, 'installed twice'\n"
        "ha.remove()\n"
        "assert seen() == during, 'undone while an attachment is left'\n"
        "del hb, ob, b; gc.collect()\n"  # the last one, garbage collected
        "assert seen() == before, 'left patched'\n"
        "with layeropt.attach(a, oa):\n"  # and installed again
        "    a(torch.randn(3, 2)).sum().backward()\n"
        "    assert all(x != y for x, y in zip(seen(), before))\n"
        "assert seen() == before\n"
    )
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, timeout=120)


def _engine_report():
    """``benchmarks/engine_report.py`` (the measurements of the engine's shape)."""
    import importlib.util

    path = ROOT.parent / "benchmarks" / "engine_report.py"
    spec = importlib.util.spec_from_file_location("engine_report", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_how_it_works_names_every_concept_of_the_core():
    """Every core class and module-level state that changes has its line in
    docs/how-it-works.md: a new one fails here until it is explained there."""
    report = _engine_report()
    missing = report.undocumented(ROOT, ROOT.parent / "docs" / "how-it-works.md")
    assert not missing, f"not named in docs/how-it-works.md: {missing}"


def test_only_the_engine_writes_its_state():
    """No other core module assigns an engine's attributes or changes its containers."""
    report = _engine_report()
    assert report.outside_writes(ROOT, "engine/landing.py") == []


def test_the_plain_path_stays_short(monkeypatch):
    """The engine's budget (``benchmarks/engine_report.py`` prints it): a warmed plain
    backward of two Linear layers (``bucket_cap_mb=0``, Adam foreach) makes at most 40
    layeropt Python calls, at most 6 frames deep - in a process without
    ``torch.distributed`` and in one with a process group (where each backward's end
    looks for a DDP reducer's write-back); the engine has at most 15 attributes; no
    core module has over 400 code lines."""
    monkeypatch.delenv("LAYEROPT_VERIFY", raising=False)
    report = _engine_report()
    from layeropt.engine.fastpath import supported

    if torch.optim.Adam in supported():  # (else torch's own step serves the report's
        # Adam, with its hooks: before torch 2.6, and on 2.6, whose Adam signatures are older)
        calls, depth, counts = report.calls_per_backward()  # (a group of another test's: both)
        assert calls <= 40 and depth <= 6, (calls, depth, counts)
        with contextlib.contextmanager(one_process_group)():
            calls, depth, counts = report.calls_per_backward()
        assert calls <= 40 and depth <= 6, (calls, depth, counts)
    assert len(report.engine_attributes()) <= 15, report.engine_attributes()
    sizes = {p.name: report.code_lines(p) for p in report.core_modules(ROOT)}
    assert max(sizes.values()) <= 400, sizes


def test_the_engine_names_no_feature_and_the_top_stays_small():
    """Issue 37's seams: the engine's own modules (its class's and those of the classes
    it inherits) name no offload, host memory, prefetch or verify - those install
    beside it as stepper wrappers - and ``layeropt/`` keeps at most 14 modules at its
    top, the rest in subpackages."""
    report = _engine_report()
    engine_cls = type(layeropt.Adam([torch.zeros(1, requires_grad=True)])._lo_engine)
    own = report.engine_modules(engine_cls)
    assert {p.name for p in own} == {"landing.py", "rules.py", "boundaries.py", "zeroing.py"}, own
    assert report.feature_lines(own) == []
    assert len(report.top_level_modules(ROOT)) <= 14, report.top_level_modules(ROOT)


def test_a_feature_wraps_the_stepper_and_unwraps_it():
    """offload_state and LAYEROPT_VERIFY install as wrappers around the plain stepper and
    leave it as they found it: after removal the engine steps through ``PLAIN`` again."""
    from layeropt.engine.stepper import IN_GRAD, PLAIN
    from layeropt.offload import offload_state

    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = layeropt.Adam(model.parameters(), lr=0.1)
    engine = opt._lo_engine
    assert engine.stepper is PLAIN and engine.stepper.held is IN_GRAD
    handle = offload_state(opt)
    assert engine.stepper.inner is PLAIN and engine.stepper.held is handle.held
    handle.remove()
    assert engine.stepper is PLAIN
    with layeropt.attach(model, opt, verify=1):
        assert engine.stepper.inner is PLAIN
        model(torch.randn(3, 4)).sum().backward()
        with pytest.warns(UserWarning, match="1 training step"):
            opt.step()
        assert engine.stepper is PLAIN  # verified its one step: unwrapped
