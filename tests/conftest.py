"""Shared test setup: every test starts from the same random state, on CPU."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mode.data import stdlib_root


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(0)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    """A single text file (~150 kB) of real Python source, split by position into train/val."""
    root = stdlib_root()
    parts = [(root / name).read_bytes() for name in ("textwrap.py", "argparse.py", "shlex.py", "string.py")]
    path = tmp_path_factory.mktemp("corpus") / "source.txt"
    path.write_bytes(b"\n".join(parts))
    return path
