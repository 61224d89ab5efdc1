"""A run folder: the files a training run writes there, and the lock that makes it one run's.

A run folder holds what `python -m mode.train` (or launch/train.py) wrote: config.yaml,
metrics.jsonl, checkpoint.pt, loss_vs_flops.png, with train.tensorboard tensorboard/ and, for a
multi-process run, deepspeed/.
A new run refuses a folder that holds any of them; only the run's own --resume continues it.

While a run trains it holds an exclusive OS lock (flock) on `<folder>/.lock`, which holds its
pid. The lock dies with the process (a crash or kill -9 never leaves a stale one), so a second
writer is refused only while the first is alive.
"""
from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

CHECKPOINT = "checkpoint.pt"
METRICS = "metrics.jsonl"
CONFIG = "config.yaml"
PLOT = "loss_vs_flops.png"
DEEPSPEED_DIR = "deepspeed"
TENSORBOARD_DIR = "tensorboard"  # train.tensorboard's event files
LOCK = ".lock"
# Everything a run writes into its folder (a sweep's train.log is the sweep's).
RUN_FILES = (CHECKPOINT, METRICS, CONFIG, PLOT, DEEPSPEED_DIR, TENSORBOARD_DIR)


class FolderInUse(RuntimeError):
    """Another live process holds the run folder's lock; the message names the folder and its pid."""

    def __init__(self, folder: Path, pid: str) -> None:
        super().__init__(f"{folder} is in use by another training (pid {pid}); wait for it to end, or stop it, "
                         "before writing to this folder")
        self.folder, self.pid = folder, pid


def run_files_in(folder: Path) -> list[str]:
    """The names of RUN_FILES present in `folder` (existing in any form: file, folder or link)."""
    return [name for name in RUN_FILES if os.path.lexists(folder / name)]


class RunFolderLock:
    """An exclusive lock on a run folder for as long as this object is held (or until release())."""

    def __init__(self, folder: Path) -> None:
        self.folder = Path(folder)
        self._file: IO[str] | None = None

    def acquire(self, record_pid: bool = True) -> None:
        """Take the lock (the folder must exist) and write this process's pid into the lock file;
        FolderInUse when a live process holds it."""
        handle = open(self.folder / LOCK, "a+")
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            pid = handle.read().strip() or "unknown"
            handle.close()
            raise FolderInUse(self.folder, pid) from None
        if record_pid:
            handle.seek(0)
            handle.truncate()
            handle.write(f"{os.getpid()}\n")
            handle.flush()
        self._file = handle

    def release(self) -> None:
        if self._file is not None:
            self._file.close()  # closing the descriptor drops the flock
            self._file = None

    @property
    def held(self) -> bool:
        return self._file is not None


def holder(folder: Path) -> str | None:
    """The pid (as text) of the live process holding `folder`'s lock; None when it is free."""
    if not (Path(folder) / LOCK).exists():
        return None
    probe = RunFolderLock(folder)
    try:
        probe.acquire(record_pid=False)
    except FolderInUse as e:
        return e.pid
    except OSError:  # unreadable: not ours to judge, the training will say
        return None
    probe.release()
    return None
