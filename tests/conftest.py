"""Shared test setup: every test starts from the same random state, on CPU."""
from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)
