"""Small helpers shared by training, generation and benchmarks."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import tempfile
import threading
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

import torch

from mode.cli import STOP_SIGNALS, handle_stop_signals, ignore_stop_signals, restore_handlers


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


def _atomic_write(path: Path, write: Callable[[BinaryIO], object]) -> None:
    """write(file) into a temporary file beside `path`, flushed to disk, then renamed over it and the
    rename flushed: a crash, Ctrl-C or power loss leaves the previous file whole, never half a file."""
    fd, tmp = _temporary_beside(path)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    """fsync a folder, so a rename into it survives a power loss (POSIX; a no-op where folders
    cannot be opened, as on Windows)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    _atomic_write(path, lambda f: f.write(data))


def atomic_write_text(path: Path, text: str) -> None:
    atomic_write_bytes(path, text.encode())


def atomic_torch_save(obj: Any, path: Path) -> None:
    _atomic_write(path, lambda f: torch.save(obj, f))


def remove_stale_temporaries(path: Path) -> list[Path]:
    """Delete the temporary files an atomic write of `path` left beside it when its process was killed
    outright (SIGKILL, out of memory: no chance to clean up); returns them. Call it only where no
    other process is writing `path`."""
    stale = sorted(path.parent.glob(f".{path.name}.*.tmp"))
    for leftover in stale:
        leftover.unlink(missing_ok=True)
    return stale


def folder_problem(path: Path) -> str | None:
    """Why `path` cannot be a folder or be made one: it is a file, or it lies under one (mkdir would
    fail with a bare errno line, FileExistsError or NotADirectoryError); None when nothing stands in the way."""
    if path.exists() and not path.is_dir():
        return "is a file, not a folder"
    for parent in path.parents:  # the nearest one that exists decides
        if parent.exists():
            return None if parent.is_dir() else f"lies under {parent}, which is a file, not a folder"
    return None


class MetricsError(ValueError):
    """A metrics.jsonl line that is not a record; the message names the file and line."""


def read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of a metrics.jsonl file, and notes. Only its last line may be cut short (a run
    writing it, or killed while it did): that line is left out with a note. A bad line anywhere
    else is a MetricsError naming the file and line. Every record is a JSON object with a numeric
    step and flops."""
    lines = path.read_text().splitlines()
    records: list[dict[str, Any]] = []
    notes: list[str] = []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
            problem = _record_problem(record)
        except json.JSONDecodeError as e:
            problem = str(e)
        if problem is None:
            records.append(record)
        elif number == len(lines):
            notes.append(f"{path}: line {number} is incomplete ({problem}) and was left out")
        else:
            raise MetricsError(f"{path}: line {number}: {problem}")
    return records, notes


def _record_problem(record: Any) -> str | None:
    if not isinstance(record, dict):
        return "not a JSON object"
    for key in ("step", "flops"):
        if isinstance(record.get(key), bool) or not isinstance(record.get(key), (int, float)):
            return f"no numeric {key!r}"
    return None


def pick_device(name: str, field: str = "train.device") -> torch.device:
    """'auto', 'cpu' or 'cuda' -> a device; asking for CUDA where there is none is a ValueError
    naming the field (or flag) that asked."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{field} is 'cuda' but no CUDA device is available")
    return torch.device(name)


class StopSignal(KeyboardInterrupt):
    """SIGINT or SIGTERM, raised where it arrived (stops_on_signals): a clean stop, as Ctrl-C's."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def stop_how(stop: KeyboardInterrupt) -> str:
    """'interrupted' (Ctrl-C) or 'stopped by SIGTERM', for the line that says where the run stands."""
    if isinstance(stop, StopSignal) and stop.signum != signal.SIGINT:
        return f"stopped by {signal.Signals(stop.signum).name}"
    return "interrupted"


def stop_status(stop: KeyboardInterrupt) -> int:
    """The exit status of a process stopped by this signal: 128 + its number (Ctrl-C's is 130)."""
    return 128 + (stop.signum if isinstance(stop, StopSignal) else signal.SIGINT)


def _in_main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextlib.contextmanager
def stops_on_signals() -> Iterator[None]:
    """SIGINT and SIGTERM raise StopSignal (a KeyboardInterrupt) where they arrive; once one has, the
    stop's clean-up runs to its end and says where the run stands: signals after it are ignored.
    A SIGINT ignored on entry (a job started in the background by a script) stays ignored, as
    Python leaves it; SIGTERM always stops. Main thread only (signals go there)."""
    if not _in_main_thread():
        yield
        return

    def stop(signum: int, frame: Any) -> None:
        ignore_stop_signals()
        raise StopSignal(signum)

    previous = handle_stop_signals(stop)
    try:
        yield
    finally:
        restore_handlers(previous)


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """SIGINT and SIGTERM held back until the block ends, then handed to the handler that was there
    (stops_on_signals' raises StopSignal; launch/train.py's marks a stop for every process; Python's
    default raises KeyboardInterrupt): a checkpoint being written is finished (seconds) instead of
    abandoned half-way, where torch.save's zip writer would turn the interrupt into a RuntimeError.
    A signal ignored on entry stays ignored. Main thread only (signals go there)."""
    if not _in_main_thread():
        yield
        return
    caught: list[int] = []
    previous = {number: signal.getsignal(number) for number in STOP_SIGNALS}
    for number in STOP_SIGNALS:
        if previous[number] != signal.SIG_IGN:
            signal.signal(number, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        restore_handlers(previous)
    if caught:  # delivered now, to the handler that was there
        signum = caught[0]
        handler = previous[signum]
        if callable(handler):
            handler(signum, None)
        elif handler == signal.SIG_DFL:
            signal.raise_signal(signum)  # the default action, now that the file is whole
        else:
            raise KeyboardInterrupt
