"""What the training loop reports: metrics.jsonl (written by rank 0, with TensorBoard event files
beside it under train.tensorboard), the progress bar, and tokens/s over each log window, timed as
the device computed the window's steps."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch
from tqdm import tqdm

from mode.config import TrainConfig
from mode.run_folder import METRICS
from mode.training.tracking import TensorBoardLog
from mode.utils import read_metrics


class StepTimer:
    """How long one step computed: between two CUDA events the step's stream passes (the GPU's
    view: the time it waited for the host's launches counts, evaluation and the host's pauses
    between steps do not), or two host clock readings on CPU, which computes as it launches."""

    def __init__(self, device: torch.device) -> None:
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else None
        self.start()

    def start(self) -> None:
        if self.events is None:
            self.began = time.perf_counter()
        else:
            self.events[0].record()

    def stop(self) -> None:
        if self.events is None:
            self.ended = time.perf_counter()
        else:
            self.events[1].record()

    def seconds(self) -> float:
        if self.events is None:
            return self.ended - self.began
        self.events[1].synchronize()  # just after the step's values: no wait to speak of
        return self.events[0].elapsed_time(self.events[1]) / 1e3


def append_record(path: Path, record: dict[str, Any]) -> None:
    """One line of metrics.jsonl."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


class RunLog:
    """Rank 0's writer of a run's records: each stamped with elapsed_s, the wall-clock seconds the run
    has trained (from when its Trainer was ready: evaluations, checkpoints and compiling count; a
    resumed run continues from the last record it kept), appended to metrics.jsonl and, given a
    SummaryWriter class (train.tensorboard), written as TensorBoard scalars too."""

    def __init__(self, run_dir: Path, writer_class: type | None, resume_step: int | None) -> None:
        self.path = run_dir / METRICS
        earlier = read_metrics(self.path)[0] if resume_step is not None and self.path.exists() else []
        self.elapsed_before = max((r["elapsed_s"] for r in earlier if "elapsed_s" in r), default=0.0)
        self.began = time.perf_counter()
        self.tensorboard = None if writer_class is None else TensorBoardLog(writer_class, run_dir, resume_step, earlier)

    def write(self, record: dict[str, Any]) -> None:
        record["elapsed_s"] = round(self.elapsed_before + time.perf_counter() - self.began, 3)
        append_record(self.path, record)
        if self.tensorboard is not None:
            self.tensorboard.write(record)

    def close(self) -> None:
        if self.tensorboard is not None:
            self.tensorboard.close()
            self.tensorboard = None


class Progress:
    """One run() of the loop: its records (kept, and written by `log`), the progress bar and the
    tokens/s of the steps since the last kept training record."""

    def __init__(self, t: TrainConfig, step: int, processes: int, show: bool,
                 log: Callable[[dict[str, Any]], None]) -> None:
        self.t, self.processes, self.log = t, processes, log
        self.records: list[dict[str, Any]] = []
        self.bar = tqdm(total=t.max_steps, initial=step, disable=not show, dynamic_ncols=True, file=sys.stdout)
        self.window_seconds, self.window_tokens = 0.0, 0

    def keep(self, record: dict[str, Any]) -> None:
        self.records.append(record)
        self.log(record)

    def step(self, record: dict[str, Any], tokens: int, seconds: float) -> None:
        """A finished step's record, given the tokens it consumed and the seconds it computed:
        completed with tokens/s and kept at log intervals (the window then starts again)."""
        self.window_tokens += tokens
        self.window_seconds += seconds
        record["tokens_per_s"] = self.window_tokens / max(self.window_seconds, 1e-9)
        record["processes"] = self.processes  # tokens and tokens_per_s count every process's
        self.bar.update(1)
        self.bar.set_postfix_str(progress_text(record))
        if record["step"] % self.t.log_interval == 0 or record["step"] == self.t.max_steps:
            self.keep(record)
            self.window_seconds, self.window_tokens = 0.0, 0


def progress_text(record: dict[str, Any]) -> str:
    """The progress bar's postfix: the loss, tokens/s and each routed layer's processed share."""
    fractions = " ".join(
        f"{name.removeprefix('layer')}:{stats['processed']:.2f}" for name, stats in record["routing"].items()
    )
    text = f"loss {record['loss']:.3f} | {record['tokens_per_s']:.0f} tok/s"
    return f"{text} | routed {fractions}" if fractions else text
