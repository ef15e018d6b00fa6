"""Every ```python block in README.md and docs/*.md runs (each in a fresh namespace)."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
BLOCK = re.compile(r"```python\n(.*?)```", re.S)


def _blocks():
    for path in DOCS:
        for i, code in enumerate(BLOCK.findall(path.read_text())):
            yield pytest.param(code, id=f"{path.name}#{i}")


@pytest.mark.parametrize("code", list(_blocks()))
def test_doc_code_block_runs(code):
    exec(compile(code, "<doc>", "exec"), {"__name__": "__doc_block__"})
