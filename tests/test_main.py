"""The ``layeropt`` command line: ``--version`` and the subcommand dispatch."""

from __future__ import annotations

import importlib.metadata
import pathlib
import re

import pytest

import layeropt
from layeropt.__main__ import main

ROOT = pathlib.Path(__file__).resolve().parent.parent


def test_version_prints_the_package_version(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--version"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out.strip()
    # the version pyproject.toml declares (what pip installs) and the package's own
    declared = re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M)
    assert out == f"layeropt {declared.group(1)}" == f"layeropt {layeropt.__version__}"
    try:
        installed = importlib.metadata.version("layeropt")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - not pip-installed
        return
    assert out == f"layeropt {installed}"


def test_no_command_prints_help_and_exits_2(capsys):
    assert main([]) == 2
    err = capsys.readouterr().err
    assert "demo" in err and "plan" in err
