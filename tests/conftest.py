"""Pytest configuration: every test starts from the same global seed.

Tests use tiny tensors, for which one intra-op thread is fastest and keeps the
2-core CI machine from oversubscribing.
"""

import pytest
import torch

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
