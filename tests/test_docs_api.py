"""``docs/api.md`` is generated from the docstrings and kept up to date."""

from __future__ import annotations

import importlib.util
import pathlib
import re

import layeropt

ROOT = pathlib.Path(__file__).resolve().parent.parent


def _generator():
    spec = importlib.util.spec_from_file_location("gen_api", ROOT / "docs" / "gen_api.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_up_to_date():
    expected = _generator().render()
    actual = (ROOT / "docs" / "api.md").read_text()
    assert actual == expected, "docs/api.md is out of date: run python docs/gen_api.py"


def test_api_reference_covers_the_top_level():
    """Every name ``import layeropt`` exports has an entry (or is a documented module)."""
    text = _generator().render()
    headings = set(re.findall(r"^#+ (?:class |property )?`([\w.]+)`", text, re.M))
    modules = set(re.findall(r"^## (layeropt[\w.]*)$", text, re.M))
    missing = [n for n in layeropt.__all__
               if n not in headings and f"layeropt.{n}" not in modules]
    assert not missing, f"not in docs/api.md: {missing} (add its module to gen_api.MODULES)"


def test_generator_does_not_import_the_package():
    """Parsing, not importing: the output cannot depend on what is installed."""
    source = (ROOT / "docs" / "gen_api.py").read_text()
    assert not re.search(r"^\s*(import|from) (layeropt|torch|transformers)\b", source, re.M)
