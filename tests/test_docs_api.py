"""``docs/api.md`` is generated from the public API's docstrings and kept up to date."""

from __future__ import annotations

import importlib
import importlib.util
import pathlib
import re
import types

import pytest

import layeropt

ROOT = pathlib.Path(__file__).resolve().parent.parent
# Implementation details that an earlier api.md published; none may come back.
INTERNAL = {"Engine", "Pin", "watch_torch_checkpoint", "memory_table", "Checkpointed",
            "optimizer_list", "no_step_all", "live_optimizers", "warn"}


def _generator():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


GEN = _generator()
TEXT = GEN.render()
ENTRIES = re.findall(r"^### (?:class )?`([\w.]+)`", TEXT, re.M)
SECTIONS = re.findall(r"^## (layeropt[\w.]*)$", TEXT, re.M)


def test_api_reference_is_up_to_date():
    actual = (ROOT / "docs" / "api.md").read_text()
    assert actual == TEXT, "docs/api.md is out of date: run python docs/gen_api.py"


def test_no_entry_is_a_placeholder(monkeypatch, capsys):
    """A name in an ``__all__`` that the generator cannot find in the source (a
    submodule left out of ``PUBLIC``) fails here, and the generator refuses to write."""
    actual = (ROOT / "docs" / "api.md").read_text()
    assert GEN.not_found() == []
    assert GEN.NOT_FOUND not in TEXT and GEN.NOT_FOUND not in actual
    monkeypatch.setattr(GEN, "PUBLIC", [m for m in GEN.PUBLIC if m != "layeropt.offload"])
    assert GEN.not_found() == ["layeropt.offload"]
    assert GEN.main(["--check"]) == 1
    assert "layeropt.offload" in capsys.readouterr().err


def _reachable() -> dict[str, object]:
    """``module.name`` -> object for every public name reachable from ``import layeropt``:
    each module's ``__all__``, following submodules (lazily imported ones too)."""
    found: dict[str, object] = {}
    todo = ["layeropt"]
    while todo:
        name = todo.pop()
        try:
            module = importlib.import_module(name)
        except ImportError:  # an integration whose library is not installed
            continue
        for attr in module.__all__:
            try:
                obj = getattr(module, attr)
            except ImportError:
                continue
            found[f"{name}.{attr}"] = obj
            if isinstance(obj, types.ModuleType) and obj.__name__ not in todo + [name]:
                todo.append(obj.__name__)
    return found


def test_every_public_name_reachable_from_layeropt_is_documented():
    """``layeropt.offload`` (imported on first use) and its ``offload_state``,
    ``StateOffload``: every module in an ``__all__`` has a section, every other
    name an entry (or is the same object as one)."""
    also = GEN.aliases()
    modules, missing = [], []
    for full, obj in _reachable().items():
        module, name = full.rsplit(".", 1)
        if isinstance(obj, types.ModuleType):
            if obj.__name__ not in SECTIONS:
                modules.append(obj.__name__)
        elif name not in GEN.NOT_API.get(module, {}) and full not in ENTRIES \
                and also.get(full) not in ENTRIES:
            missing.append(full)
    assert not modules, f"public modules without a section in docs/api.md: {modules}"
    assert not missing, f"public names missing from docs/api.md: {missing}"
    for name in ("layeropt.offload.offload_state", "layeropt.offload.StateOffload"):
        assert name in ENTRIES


def test_api_reference_covers_the_top_level():
    """Every name ``import layeropt`` exports has an entry (or is a documented module)."""
    missing = [n for n in layeropt.__all__
               if f"layeropt.{n}" not in ENTRIES and f"layeropt.{n}" not in SECTIONS]
    assert not missing, f"not in docs/api.md: {missing}"


def test_every_public_name_is_listed_once():
    """Each public module's ``__all__`` is covered; no object has two entries."""
    also = GEN.aliases()
    missing = []
    for module in GEN.PUBLIC:
        hidden = GEN.NOT_API.get(module, {})
        try:
            exported = importlib.import_module(module).__all__
        except ImportError:  # an integration whose library is not installed
            continue
        for name in exported:
            full = f"{module}.{name}"
            if name in hidden or full in GEN.PUBLIC:
                continue
            if full not in ENTRIES and also.get(full) not in ENTRIES:
                missing.append(full)
    assert not missing, f"public names missing from docs/api.md: {missing}"
    twice = sorted({e for e in ENTRIES if ENTRIES.count(e) > 1})
    assert not twice, f"listed more than once: {twice}"
    assert not set(also) & set(ENTRIES), "a re-export has its own entry"


def test_only_public_modules_and_names():
    """No implementation module, private name or known internal is published."""
    assert SECTIONS == GEN.PUBLIC
    for module in GEN.PUBLIC:
        assert not any(part.startswith("_") for part in module.split("."))
    bad = [e for e in ENTRIES
           if e.rsplit(".", 1)[0] not in GEN.PUBLIC
           or e.rsplit(".", 1)[1].startswith("_")
           or e.rsplit(".", 1)[1] in INTERNAL]
    assert not bad, f"internal names in docs/api.md: {bad}"
    methods = re.findall(r"^#### (?:property )?`(\w+)\.(\w+)`", TEXT, re.M)
    assert methods and not [m for m in methods if m[1].startswith("_") or m[0] in INTERNAL]


@pytest.mark.parametrize("module", sorted(GEN.NOT_API))
def test_names_kept_out_are_still_exported(module):
    """``NOT_API`` names a real export each (else it is stale and should go)."""
    exported = importlib.import_module(module).__all__
    assert set(GEN.NOT_API[module]) <= set(exported)


def test_every_entry_has_a_docstring():
    """Every public class, function, method and constant says what it is.

    A constant's docstring is a ``#:`` comment above it. Fails, naming them,
    while any lacks one: add the docstring in the source, then run
    ``python docs/gen_api.py``.
    """
    missing = GEN.missing_docstrings()
    assert not missing, f"public API without a docstring: {missing}"


def test_generator_does_not_import_the_package():
    """Parsing, not importing: the output cannot depend on what is installed."""
    source = (ROOT / "docs" / "gen_api.py").read_text()
    assert not re.search(r"^\s*(import|from) (layeropt|torch|transformers)\b", source, re.M)
