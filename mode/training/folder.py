"""A training run's folder as the Trainer prepares it: another run's files refused, the lock taken
by rank 0 (every rank learning whether it could), and on resume the checks that keep the folder's
config, checkpoint and metrics telling one story."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable

from mode.config import Config, ConfigError, TrainConfig, config_text
from mode.run_folder import CHECKPOINT, CONFIG, METRICS, FolderInUse, RunFolderLock, run_files_in
from mode.utils import atomic_write_text, folder_problem, read_metrics


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a lost mount); the message says which step the
    run folder's checkpoint still holds, whole."""

    def __init__(self, out_dir: Path, step: int, saved_step: int | None, error: OSError) -> None:
        path = out_dir / CHECKPOINT
        kept = (f"{path} still holds step {saved_step}, whole: continue with --resume once there is room"
                if saved_step is not None else "the run has no checkpoint yet")
        super().__init__(f"cannot write the checkpoint of step {step} to {path} ({error.strerror or error}); {kept}")


def check_run_folder(out_dir: Path, config: Config, resume: bool) -> None:
    """Before the lock: out_dir can be a run folder, holds a checkpoint to resume, or none of another run's files."""
    problem = folder_problem(out_dir)
    if problem:
        raise ConfigError(f"train.out_dir: {out_dir} {problem}")
    checkpoint = out_dir / CHECKPOINT
    if resume and not checkpoint.is_file():
        raise FileNotFoundError(f"--resume: no checkpoint at {checkpoint}")
    if not resume:
        refuse_written_folder(out_dir, config)


def refuse_written_folder(out_dir: Path, config: Config) -> None:
    """A new run writes no file over another run's (nor over a --config file kept there). A config.yaml
    holding exactly what this run writes is its own, left by the same command stopped before training."""
    written = [name for name in run_files_in(out_dir) if not (name == CONFIG and _own_config(out_dir, config))]
    if CHECKPOINT in written:
        raise FileExistsError(
            f"{out_dir} already holds a run ({out_dir / CHECKPOINT}); pass --resume to continue it "
            f"or choose another --train.out_dir"
        )
    if METRICS in written:  # a new run would append its curve to the old one's
        raise FileExistsError(
            f"{out_dir} holds {METRICS} of a run that stopped before its first checkpoint: remove "
            f"it (or the folder) or choose another --train.out_dir"
        )
    if written:
        raise FileExistsError(
            f"{out_dir} holds {', '.join(written)}, which a new run would replace: choose another "
            f"--train.out_dir (or move them away)"
        )


def _own_config(out_dir: Path, config: Config) -> bool:
    path = out_dir / CONFIG
    try:
        return path.is_file() and path.read_text() == config_text(config)
    except (OSError, UnicodeDecodeError):
        return False


def lock_run_folder(out_dir: Path, is_main: bool,
                    mean_over_ranks: Callable[[dict[str, float]], dict[str, float]]) -> RunFolderLock:
    """Rank 0 makes the folder and takes its lock, held for the run's lifetime; every rank learns
    (mean_over_ranks: collective) whether it could, so all stop together when another process holds it."""
    lock = RunFolderLock(out_dir)
    problem = None
    if is_main:
        try:
            out_dir.mkdir(parents=True, exist_ok=True)
            lock.acquire()
        except FolderInUse as e:
            problem = f"train.out_dir: {e}"
        except OSError as e:  # no permission, a read-only disk: one line naming the field, not a traceback
            problem = f"train.out_dir: cannot create {out_dir}: {e.strerror or e}"
    failed = mean_over_ranks({"lock_failed": float(problem is not None)})["lock_failed"] > 0
    if failed:
        raise ConfigError(problem or f"train.out_dir: rank 0 could not take {out_dir} (it says why)")
    return lock


def check_not_past_the_end(step: int, t: TrainConfig) -> None:
    """A resume whose max_steps (or budget) ends before the checkpoint's step would leave the run
    folder's config.yaml contradicting its checkpoint and metrics."""
    if step > t.max_steps:
        source = f" (train.flops_budget={t.flops_budget:.4g})" if t.flops_budget is not None else ""
        raise ConfigError(f"--resume: the run is at step {step}, past train.max_steps={t.max_steps}"
                          f"{source}; resume with at least its steps")


def truncate_metrics(path: Path, step: int) -> list[str]:
    """Drop records a crashed run logged after its last checkpoint (at `step`), so the curve continues;
    a last line cut short by the crash goes with them (a bad line elsewhere is an error naming it).
    Returns notes for the user."""
    if not path.exists():
        return []
    records, notes = read_metrics(path)
    kept = [record for record in records if record["step"] <= step]
    atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in kept))  # as the log wrote them
    return notes
