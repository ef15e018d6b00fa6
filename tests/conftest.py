"""Pytest configuration: every test starts from the same global seed."""

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
