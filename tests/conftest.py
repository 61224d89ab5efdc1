"""Shared test setup: every test starts from the same random state, on CPU."""
from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels (mode/kernels/) run in Triton's interpreter on CPU tensors, so
# tests/test_kernels.py checks them here too. Read when a kernel is defined: set before mode.kernels
# is imported. On a CUDA machine they compile and run on the GPU.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from mode.data import stdlib_root

# pytest-xdist workers (launch/test.sh runs one per core) share the cores: each computes on its share
# instead of every worker starting a thread per core.
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


# The Ctrl-C tests send SIGINT to this process and to the commands it starts, as a terminal's
# foreground job gets it. Started as a shell's background job (`bash launch/test.sh &`), pytest and
# those commands would ignore SIGINT, as a background job's should: the tests would wait forever.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)


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
