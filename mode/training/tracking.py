"""TensorBoard event files beside metrics.jsonl (train.tensorboard): every metric a record holds,
as a scalar at the record's step, so `tensorboard --logdir runs/` shows every run of a folder."""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Iterator

from mode.config import ConfigError, TrainConfig
from mode.run_folder import TENSORBOARD_DIR

EVENT_FILE_PREFIX = "events.out.tfevents."  # what SummaryWriter names its files
# Record keys that place a record rather than measure anything: the step is TensorBoard's own axis.
NOT_SCALARS = ("step",)


def summary_writer_class(t: TrainConfig) -> type | None:
    """torch's SummaryWriter when train.tensorboard is on (None when off); a ConfigError naming the
    field and the pip extra when the tensorboard package is missing, before anything is written."""
    if not t.tensorboard:
        return None
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("train.tensorboard=true needs the tensorboard package: pip install -e .[track] "
                          "(or set train.tensorboard=false)") from None
    return SummaryWriter


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record as TensorBoard tags: 'train/...' for a training step's record, 'val/...' for
    an evaluation's (both have a `routing` of the same layers at an evaluation step); nested keys
    joined by '/', a list's items by their index (position_share/3); the step left out."""
    prefix = "val" if "val_loss" in record else "train"
    return {tag: value for tag, value in _flatten(prefix, {k: v for k, v in record.items() if k not in NOT_SCALARS})}


def _flatten(prefix: str, value: Any) -> Iterator[tuple[str, float]]:
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _flatten(f"{prefix}/{key}", item)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            yield from _flatten(f"{prefix}/{i}", item)
    elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        yield prefix, float(value)


class TensorBoardLog:
    """Event files in <run folder>/tensorboard/. A resumed run (at `resume_step`) purges the events a
    crashed leg wrote after its checkpoint, as --resume drops those metrics lines; a run that turns
    train.tensorboard on at a resume first writes the records metrics.jsonl already holds."""

    def __init__(self, writer_class: type, run_dir: Path, resume_step: int | None,
                 earlier: list[dict[str, Any]]) -> None:
        folder = run_dir / TENSORBOARD_DIR
        had_events = folder.is_dir() and any(p.name.startswith(EVENT_FILE_PREFIX) for p in folder.iterdir())
        purge = resume_step + 1 if resume_step is not None and had_events else None
        self.writer = writer_class(log_dir=str(folder), purge_step=purge)
        if not had_events:
            for record in earlier:
                self.write(record)

    def write(self, record: dict[str, Any]) -> None:
        for tag, value in scalars(record).items():
            self.writer.add_scalar(tag, value, global_step=record["step"])

    def close(self) -> None:
        self.writer.close()


def remove_event_files(run_dir: Path) -> None:
    """A run stopped before its first checkpoint starts again (mode.sweep): its event files go with its
    metrics; the folder goes too when nothing else is left in it."""
    folder = run_dir / TENSORBOARD_DIR
    if not folder.is_dir() or folder.is_symlink():
        return
    for path in folder.iterdir():
        if path.name.startswith(EVENT_FILE_PREFIX) and path.is_file() and not path.is_symlink():
            path.unlink()
    if not any(folder.iterdir()):
        folder.rmdir()
