"""train.tensorboard: event files beside metrics.jsonl holding every metric it holds, read back with
TensorBoard's own reader; resumes without duplicate steps; a clear error without the package."""
from __future__ import annotations

import json
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from mode.config import Config, config_from_dict
from mode.run_folder import METRICS
from mode.train import main
from mode.training.trainer import LaunchedStep, Trainer

event_accumulator = pytest.importorskip("tensorboard.backend.event_processing.event_accumulator")


def _raw(out_dir: Path, corpus: Path, max_steps: int, tensorboard: bool = True) -> dict[str, Any]:
    return {
        "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 32,
                  "block_pattern": ["dense", "mod"]},
        "routing": {"capacity": 0.25, "causal": "aux_loss"},
        "data": {"source": "text", "path": str(corpus), "seq_len": 32},
        "train": {"batch_size": 2, "max_steps": max_steps, "warmup_steps": 1, "log_interval": 1, "eval_interval": 3,
                  "eval_batches": 1, "checkpoint_interval": 3, "out_dir": str(out_dir), "progress": False,
                  "device": "cpu", "tensorboard": tensorboard},
    }


def _config(out_dir: Path, corpus: Path, max_steps: int, tensorboard: bool = True) -> Config:
    return config_from_dict(_raw(out_dir, corpus, max_steps, tensorboard))


def _records(run: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run / METRICS).read_text().splitlines()]


def _expected(records: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """Every number of every record, as the tag the docs give it: train/... or val/... (an evaluation's
    record), nested keys and list indices joined by '/'."""
    series: dict[str, list[tuple[int, float]]] = defaultdict(list)

    def walk(tag: str, value: Any, step: int) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                walk(f"{tag}/{key}", item, step)
        elif isinstance(value, list):
            for i, item in enumerate(value):
                walk(f"{tag}/{i}", item, step)
        else:
            series[tag].append((step, float(value)))

    for record in records:
        prefix = "val" if "val_loss" in record else "train"
        for key, value in record.items():
            if key != "step":
                walk(f"{prefix}/{key}", value, record["step"])
    return dict(series)


def _events(run: Path) -> dict[str, list[tuple[int, float]]]:
    accumulator = event_accumulator.EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    accumulator.Reload()
    return {tag: [(e.step, e.value) for e in accumulator.Scalars(tag)] for tag in accumulator.Tags()["scalars"]}


def _assert_same_series(events: dict[str, list[tuple[int, float]]], expected: dict[str, list[tuple[int, float]]]) -> None:
    assert sorted(events) == sorted(expected)
    for tag, points in expected.items():
        assert [step for step, _ in events[tag]] == [step for step, _ in points], tag
        for (_, got), (_, want) in zip(events[tag], points):
            assert got == pytest.approx(want, rel=1e-6, abs=1e-30), tag  # event files hold float32


def test_event_files_hold_every_metric_of_metrics_jsonl(tmp_path: Path, corpus: Path) -> None:
    run = tmp_path / "run"
    Trainer(_config(run, corpus, 6)).run()
    records = _records(run)
    expected = _expected(records)
    events = _events(run)
    _assert_same_series(events, expected)
    # what a researcher looks for is there, each at its step
    assert [step for step, _ in events["train/loss"]] == list(range(1, 7))
    assert [step for step, _ in events["val/val_loss"]] == [3, 6]
    assert "val/val_loss_causal" in events and "train/routing/layer1/causal_accuracy" in events
    assert "val/routing/layer1/position_share/0" in events
    assert [step for step, _ in events["train/elapsed_s"]] == list(range(1, 7))


def test_a_resume_purges_the_steps_after_the_checkpoint(tmp_path: Path, corpus: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """A run that crashes at step 5 after its step-3 checkpoint logged steps 4 and 5; the resume drops
    them from metrics.jsonl and logs them again: the event files hold each step once, as metrics.jsonl."""
    run = tmp_path / "run"
    original = Trainer.launch_step

    def crash_at_step_5(self: Trainer) -> LaunchedStep:
        if self.state.step == 5:
            raise KeyboardInterrupt("simulated crash")
        return original(self)

    monkeypatch.setattr(Trainer, "launch_step", crash_at_step_5)
    with pytest.raises(KeyboardInterrupt):
        Trainer(_config(run, corpus, 6)).run()
    assert [step for step, _ in _events(run)["train/loss"]] == [1, 2, 3, 4, 5]
    monkeypatch.setattr(Trainer, "launch_step", original)
    Trainer(_config(run, corpus, 6), resume=True).run()
    records = _records(run)
    assert [r["step"] for r in records if "loss" in r] == list(range(1, 7))
    _assert_same_series(_events(run), _expected(records))


def test_turned_on_at_a_resume_it_writes_the_earlier_records_too(tmp_path: Path, corpus: Path) -> None:
    run = tmp_path / "run"
    Trainer(_config(run, corpus, 3, tensorboard=False)).run()
    assert not (run / "tensorboard").exists()
    Trainer(_config(run, corpus, 6, tensorboard=True), resume=True).run()
    events = _events(run)
    _assert_same_series(events, _expected(_records(run)))
    assert [step for step, _ in events["train/loss"]] == list(range(1, 7))


def test_elapsed_s_is_wall_clock_and_a_resume_continues_it(tmp_path: Path, corpus: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A clock that every forward advances by 1 s: each record's elapsed_s is the forwards run before it
    was written; a resumed run counts on from its last record's."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])

    def tick(module: torch.nn.Module, args: Any) -> None:
        clock[0] += 1.0

    run = tmp_path / "run"
    first = Trainer(_config(run, corpus, 3, tensorboard=False))
    first.model.register_forward_pre_hook(tick)
    first.run()
    before = _records(run)
    assert [r["elapsed_s"] for r in before] == sorted(r["elapsed_s"] for r in before) and before[-1]["elapsed_s"] > 0
    clock[0] = 1000.0  # another process: its clock reads anything
    resumed = Trainer(_config(run, corpus, 6, tensorboard=False), resume=True)
    resumed.model.register_forward_pre_hook(tick)
    resumed.run()
    after = _records(run)[len(before):]
    last = before[-1]["elapsed_s"]
    assert after and all(r["elapsed_s"] > last for r in after)
    assert after[-1]["elapsed_s"] <= last + 20  # 3 steps, an evaluation (2 forwards each) and no more
    assert [r["elapsed_s"] for r in after] == sorted(r["elapsed_s"] for r in after)


def test_missing_package_is_one_line_naming_the_field_and_extra(tmp_path: Path, corpus: Path, capsys,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if tensorboard were not installed
    run = tmp_path / "run"
    config_file = tmp_path / "c.yaml"
    config_file.write_text(yaml.safe_dump(_raw(run, corpus, 2)))
    assert main(["--config", str(config_file)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    assert "train.tensorboard" in err and ".[track]" in err
    assert not run.exists()  # refused before anything was written
    # off, the same machine trains
    assert main(["--config", str(config_file), "--train.tensorboard=false"]) == 0


def test_a_new_run_refuses_a_folder_holding_event_files(tmp_path: Path, corpus: Path) -> None:
    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    with pytest.raises(FileExistsError, match="holds tensorboard"):
        Trainer(_config(run, corpus, 2))


def test_evaluating_a_tracked_run_needs_no_tensorboard(tmp_path: Path, corpus: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """mode.evaluate's throwaway trainer writes no event files: a run trained with train.tensorboard is
    evaluated where the package is missing, and its own event files are untouched."""
    from mode.evaluate import evaluate_checkpoint

    run = tmp_path / "run"
    Trainer(_config(run, corpus, 3)).run()
    files = {p: p.read_bytes() for p in (run / "tensorboard").iterdir()}
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    result = evaluate_checkpoint(run, batches=1, device="cpu")
    assert result["val_loss"] == pytest.approx(_records(run)[-1]["val_loss"], abs=1e-5)
    assert {p: p.read_bytes() for p in (run / "tensorboard").iterdir()} == files


def test_restarting_a_run_removes_only_its_event_files(tmp_path: Path) -> None:
    """mode.sweep restarts a point stopped before its first checkpoint on no file of the old run; a
    file of the user's in tensorboard/ stays (and keeps the folder)."""
    from mode.training.tracking import remove_event_files

    run = tmp_path / "run"
    (run / "tensorboard").mkdir(parents=True)
    (run / "tensorboard" / "events.out.tfevents.1.host.2.0").write_bytes(b"x")
    remove_event_files(run)
    assert not (run / "tensorboard").exists()
    (run / "tensorboard").mkdir()
    (run / "tensorboard" / "events.out.tfevents.1.host.2.0").write_bytes(b"x")
    (run / "tensorboard" / "notes.txt").write_text("mine")
    remove_event_files(run)
    assert [p.name for p in (run / "tensorboard").iterdir()] == ["notes.txt"]
