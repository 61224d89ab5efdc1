"""Small helpers shared by training, generation and benchmarks."""
from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

import torch


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _temporary_beside(path: Path) -> tuple[int, str]:
    """A temporary file in path's folder with the permissions open() would give path (mkstemp's are
    0600: the renamed file would be readable by its owner alone)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.chmod(tmp, 0o666 & ~_umask())
    return fd, tmp


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write to a temporary file beside `path`, then rename: a crash never leaves half a file."""
    fd, tmp = _temporary_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_torch_save(obj: Any, path: Path) -> None:
    fd, tmp = _temporary_beside(path)
    os.close(fd)
    try:
        torch.save(obj, tmp)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def pick_device(name: str, field: str = "train.device") -> torch.device:
    """'auto', 'cpu' or 'cuda' -> a device; asking for CUDA where there is none is a ValueError
    naming the field (or flag) that asked."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{field} is 'cuda' but no CUDA device is available")
    return torch.device(name)
