"""Pytest configuration.

* Every test starts from the same global seed.
* Tests use tiny tensors, for which one intra-op thread is fastest and keeps
  the 2-core CI machine from oversubscribing.
* ``layeropt.attach`` defaults to ``bucket_cap_mb=0`` in tests: every layer is
  stepped the moment its gradient completes, the strictest schedule (with the
  library default of 1 MiB, the tiny test models would be stepped in one
  call at the end of backward). ``test_interop.py::test_bucket_cap_*`` covers
  the batching itself, including the default.
"""

import pytest
import torch

import layeropt

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def _strictest_bucket_schedule(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = dict(layeropt.attach.__kwdefaults__)
    defaults["bucket_cap_mb"] = 0.0
    monkeypatch.setattr(layeropt.attach, "__kwdefaults__", defaults)
