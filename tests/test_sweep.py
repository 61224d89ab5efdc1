"""mode.sweep: the grid, its folder names, checking every point first, and real tiny sweeps that
train, skip what is finished, resume what is not, and report."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Iterator

import pytest
import yaml

from mode import sweep
from mode.checkpoint import load_checkpoint_file
from mode.run_folder import CHECKPOINT, METRICS
from mode.sweep import SweepError, grid, main, parse_slots, parse_vary, split_values


def test_values_split_on_commas_outside_brackets() -> None:
    assert split_values("0.125,0.25") == ["0.125", "0.25"]
    assert split_values('"a,b",c') == ['"a,b"', "c"] and split_values("'x, y',[1,2]") == ["'x, y'", "[1,2]"]
    for bad in ("'x", '"a,b'):
        with pytest.raises(SweepError, match="unbalanced brackets or quotes"):
            split_values(bad)
    with pytest.raises(SweepError, match="is not YAML"):
        split_values("a: b: c,d")


def test_one_value_spelled_twice_is_refused(tmp_path: Path, corpus: Path, capsys) -> None:
    """10 and 10.0 (an int and a float to YAML, the same max_steps to the config) name two folders but
    train alike; 3e-3 and 0.003 (one float to YAML 1.2) would even share a folder."""
    args = ["--config", str(_config(tmp_path, corpus)), "--out", str(tmp_path / "s"), "--vary", "train.max_steps=10,10.0"]
    assert main(args) == 2
    assert "points max_steps=10 and max_steps=10.0 give the same config" in capsys.readouterr().err
    args[-1] = "train.lr=3e-3,0.003"
    assert main(args) == 2
    assert "two points would share a run folder (lr=0.003, lr=0.003)" in capsys.readouterr().err
    assert split_values("[dense,mod],[dense, mode_integrated]") == ["[dense,mod]", "[dense, mode_integrated]"]
    for bad in ("[dense,mod", "0.1,,0.2", ""):
        with pytest.raises(SweepError, match="cannot read the values"):
            split_values(bad)
    with pytest.raises(SweepError, match="expected section.field=value1,value2"):
        parse_vary("capacity=0.1")


def test_grid_is_the_product_named_by_values() -> None:
    points = grid([parse_vary("routing.capacity=0.125,0.25"), parse_vary("routing.random=false,true")])
    assert [p.name for p in points] == ["capacity=0.125+random=false", "capacity=0.125+random=true",
                                        "capacity=0.25+random=false", "capacity=0.25+random=true"]
    assert points[1].overrides == ["--routing.capacity=0.125", "--routing.random=true"]
    patterns = grid([parse_vary("model.block_pattern=[dense,mod],[dense, mode_integrated]")])
    assert [p.name for p in patterns] == ["block_pattern=dense-mod", "block_pattern=dense-mode_integrated"]
    both = grid([parse_vary("routing.capacity=0.5"), parse_vary("train.capacity=1")])  # not a real field: naming only
    assert both[0].name == "routing.capacity=0.5+train.capacity=1"  # the last names clash: full paths
    with pytest.raises(SweepError, match="share a run folder"):
        grid([parse_vary("routing.capacity=0.5,.5")])
    with pytest.raises(SweepError, match="given twice"):
        grid([parse_vary("routing.capacity=0.5"), parse_vary("routing.capacity=0.25")])


def _config(tmp_path: Path, corpus: Path) -> Path:
    path = tmp_path / "base.yaml"
    path.write_text(yaml.safe_dump({
        "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 32, "block_pattern": ["dense", "mod"]},
        "data": {"source": "text", "path": str(corpus), "seq_len": 32},
        "train": {"batch_size": 2, "max_steps": 2, "warmup_steps": 1, "log_interval": 1, "eval_interval": 2,
                  "eval_batches": 1, "checkpoint_interval": 2, "progress": False, "device": "cpu"},
    }))
    return path


def _steps(run_dir: Path) -> list[int]:
    return [r["step"] for r in map(json.loads, (run_dir / METRICS).read_text().splitlines()) if "loss" in r]


def test_a_bad_point_fails_before_any_run(tmp_path: Path, corpus: Path, capsys) -> None:
    out = tmp_path / "sweep"
    config = str(_config(tmp_path, corpus))
    assert main(["--config", config, "--out", str(out), "--vary", "routing.capacity=0.25,1.5"]) == 2
    err = capsys.readouterr().err
    assert "point capacity=1.5: invalid config" in err and "routing.capacity" in err
    assert not out.exists()  # the valid point did not run either
    with pytest.raises(SystemExit):
        main(["--config", config, "--out", str(out), "--vary", "routing.capacity=0.25", "--train.out_dir=x"])
    assert "--train.out_dir: each run's folder is" in capsys.readouterr().err


def test_sweep_trains_skips_finished_runs_resumes_the_rest_and_reports(tmp_path: Path, corpus: Path, capsys) -> None:
    out = tmp_path / "sweep"
    args = ["--config", str(_config(tmp_path, corpus)), "--out", str(out), "--vary", "routing.capacity=0.25,0.5"]
    assert main(args) == 0
    runs = [out / "capacity=0.25", out / "capacity=0.5"]
    for run, capacity in zip(runs, (0.25, 0.5)):
        assert yaml.safe_load((run / "config.yaml").read_text())["routing"]["capacity"] == capacity
        assert _steps(run) == [1, 2]
    summary = json.loads((out / "report.json").read_text())
    assert summary["differing_fields"] == ["routing.capacity"]
    assert [r["run"] for r in summary["runs"]] == ["capacity=0.25", "capacity=0.5"]

    saved = [(run / CHECKPOINT).stat().st_mtime_ns for run in runs]
    (runs[1] / CHECKPOINT).unlink()  # as if the second run had stopped before its first checkpoint
    capsys.readouterr()
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "capacity=0.25: finished before (step 2)" in printed and "capacity=0.5: done" in printed
    assert (runs[0] / CHECKPOINT).stat().st_mtime_ns == saved[0]  # not trained again
    assert _steps(runs[1]) == [1, 2]  # started again from scratch, its old lines dropped

    assert main([*args, "--train.max_steps=3"]) == 0  # longer: both resume from their checkpoints
    assert "resuming from step 2" in capsys.readouterr().out
    assert [_steps(run) for run in runs] == [[1, 2, 3], [1, 2, 3]]


def test_dry_run_prints_the_commands_and_runs_nothing(tmp_path: Path, corpus: Path, capsys) -> None:
    out = tmp_path / "sweep"
    config = _config(tmp_path, corpus)
    assert main(["--config", str(config), "--out", str(out), "--vary", "model.block_pattern=[dense,mod],[mod]",
                 "--dry-run", "--train.lr=0.001"]) == 0
    printed = capsys.readouterr().out
    assert "sweep: 2 runs" in printed
    assert f"-m mode.train --config {config} --train.lr=0.001 '--model.block_pattern=[dense,mod]'" in printed
    assert not out.exists()


def test_parallel_sweep_runs_at_once_logs_each_run_and_reports(tmp_path: Path, corpus: Path, capsys) -> None:
    out = tmp_path / "sweep"
    args = ["--config", str(_config(tmp_path, corpus)), "--out", str(out), "--vary", "train.seed=0,1", "--jobs", "2"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "sweep: 2 runs in" in printed and "2 at once" in printed
    for run in (out / "seed=0", out / "seed=1"):
        assert _steps(run) == [1, 2]
        assert f"done: run folder {run}" in (run / "train.log").read_text()  # its output went to its log
        assert yaml.safe_load((run / "config.yaml").read_text())["train"]["progress"] is False
        assert f"== {run.name}: done" in printed
    summary = json.loads((out / "report.json").read_text())
    assert [g["seeds"] for g in summary["seed_groups"]] == [[0, 1]]  # two seeds of one setting


def test_gpus_give_each_concurrent_run_its_own_device(tmp_path: Path, monkeypatch) -> None:
    """--gpus 5,7: two runs at a time, each with CUDA_VISIBLE_DEVICES one GPU no other running run
    holds; every GPU is handed back. The training call is replaced (no GPUs here): each run holds
    its GPU for a while, so runs overlap."""
    held: list[str] = []
    seen: list[tuple[str, str]] = []
    lock = threading.Lock()

    def call(command: list[str], stdout=None, stderr=None, env=None) -> int:
        gpu = env["CUDA_VISIBLE_DEVICES"]
        with lock:
            assert gpu not in held, (gpu, held)
            held.append(gpu)
            seen.append((command[command.index("--config") + 1], gpu))
        time.sleep(0.2)
        with lock:
            held.remove(gpu)
        return 0

    monkeypatch.setattr(sweep, "_call", call)
    monkeypatch.setattr(sweep, "finished_steps", lambda run_dir: None)
    slots = parse_slots(None, "5,7")
    assert slots.jobs == 2
    points = grid([parse_vary("train.seed=0,1,2,3")])
    planned = [(point, point.overrides, 2) for point in points]
    args = type("Args", (), {"out": tmp_path / "sweep", "config": "x.yaml"})()
    started = time.perf_counter()
    outcomes = sweep.run_all(args, planned, slots)
    assert list(outcomes) == ["seed=0", "seed=1", "seed=2", "seed=3"] and set(outcomes.values()) == {"done"}
    assert time.perf_counter() - started < 0.7  # 4 runs of 0.2 s, two at a time
    assert sorted({gpu for _, gpu in seen}) == ["5", "7"] and len(seen) == 4
    assert sorted(slots.gpus.get_nowait() for _ in range(2)) == ["5", "7"]  # both handed back

    seen.clear()  # one GPU: runs one after another, output inline, on that GPU
    assert set(sweep.run_all(args, planned[:2], parse_slots(None, "3")).values()) == {"done"}
    assert [gpu for _, gpu in seen] == ["3", "3"]


def test_bad_jobs_and_gpus_are_clear_errors(tmp_path: Path, corpus: Path, capsys) -> None:
    for jobs, gpus, message in ((0, None, "--jobs 0: must be at least 1"),
                                (None, "0,x", "--gpus '0,x': expected distinct GPU indices"),
                                (None, "1,1", "--gpus '1,1': expected distinct GPU indices"),
                                (3, "0,1", "--jobs 3 with --gpus 0,1: at most one run a GPU")):
        with pytest.raises(SweepError, match=message.replace("(", r"\(")):
            parse_slots(jobs, gpus)
    out = tmp_path / "sweep"
    assert main(["--config", str(_config(tmp_path, corpus)), "--out", str(out), "--vary", "train.seed=0,1",
                 "--jobs", "0"]) == 2
    assert "--jobs 0: must be at least 1" in capsys.readouterr().err and not out.exists()


def test_a_flops_budget_gives_each_point_the_steps_within_it(tmp_path: Path, corpus: Path) -> None:
    """With train.flops_budget every point trains to the same FLOPs: the MoD model, cheaper a token
    than the dense one, gets more steps, and the sweep counts a run finished at its own steps."""
    import argparse

    from mode.config import load_config
    from mode.training.optim import steps_within_budget

    config = str(_config(tmp_path, corpus))
    args = argparse.Namespace(config=config, out=tmp_path / "sweep", vary=["model.block_pattern=[dense,mod],[dense,dense]"],
                              zip=None)
    budget = ["--train.flops_budget=3e9"]
    planned = sweep.plan(args, budget)
    steps = [max_steps for _, _, max_steps in planned]
    expected = [steps_within_budget(load_config(config, [*budget, *point.overrides])) for point, _, _ in planned]
    assert steps == expected and steps[0] > steps[1] > 1


@contextlib.contextmanager
def _a_long_parallel_sweep(tmp_path: Path, corpus: Path) -> Iterator[tuple[subprocess.Popen, Path]]:
    """A sweep of 4 long points, 2 at a time, in a session of its own, given once both running
    trainings have written a checkpoint; and its folder. At the block's end, passed or failed, the
    sweep's process group is killed: a failed test leaves no training of 100,000 steps running."""
    out = tmp_path / "sweep"
    command = [sys.executable, "-m", "mode.sweep", "--config", str(_config(tmp_path, corpus)), "--out", str(out),
               "--vary", "train.seed=0,1,2,3", "--jobs", "2", "--train.max_steps=100000", "--train.checkpoint_interval=1"]
    sweep_process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                     start_new_session=True, cwd=Path(__file__).resolve().parents[1])
    try:
        deadline = time.monotonic() + 120
        started = [out / "seed=0" / CHECKPOINT, out / "seed=1" / CHECKPOINT]
        while not all(p.exists() for p in started):  # both running runs have trained a step
            assert time.monotonic() < deadline and sweep_process.poll() is None, sweep_process.communicate()
            time.sleep(0.2)
        yield sweep_process, out
    finally:
        with contextlib.suppress(ProcessLookupError):  # nothing left of the group: the sweep ended whole
            os.killpg(sweep_process.pid, signal.SIGKILL)
        sweep_process.communicate()


def test_ctrl_c_stops_a_parallel_sweep_at_once(tmp_path: Path, corpus: Path) -> None:
    """Ctrl-C (SIGINT to the sweep's process group, as a terminal sends it): the running trainings
    stop at their checkpoints, no queued point starts, and the sweep exits 130 with one line."""
    with _a_long_parallel_sweep(tmp_path, corpus) as (sweep_process, out):
        os.killpg(sweep_process.pid, signal.SIGINT)
        stdout, stderr = sweep_process.communicate(timeout=120)
    assert sweep_process.returncode == 130, (stdout, stderr)
    assert "sweep stopped (Ctrl-C or SIGTERM)" in stdout and "Traceback" not in stdout + stderr, (stdout, stderr)
    # Each training got the terminal's SIGINT and then the sweep's SIGTERM: whichever it handled first
    # stopped it (the other is ignored while it stops).
    for seed in (0, 1):
        assert f"== seed={seed}: stopped (Ctrl-C" in stdout or f"== seed={seed}: stopped (SIGTERM" in stdout, stdout
    assert not (out / "seed=2").exists() and not (out / "seed=3").exists()  # the queued points never started


def test_cpu_jobs_share_the_cores(monkeypatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(sweep.os, "cpu_count", lambda: 8)
    assert sweep.run_environment(None, 4)["OMP_NUM_THREADS"] == "2"
    assert sweep.run_environment(None, 16)["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in sweep.run_environment(None, 1)  # one run: all the cores
    gpu = sweep.run_environment("3", 4)
    assert gpu["CUDA_VISIBLE_DEVICES"] == "3" and "OMP_NUM_THREADS" not in gpu
    monkeypatch.setenv("OMP_NUM_THREADS", "5")
    assert sweep.run_environment(None, 4)["OMP_NUM_THREADS"] == "5"  # the user's choice stands


# ----------------------------------------------------------------------------- audit
def test_a_restarted_sweep_refuses_runs_made_with_other_settings(tmp_path: Path, corpus: Path, capsys) -> None:
    """A finished point's folder is skipped only when its run is this point's: a restart with another
    setting (or an edited config file) names the folder and the field, and runs nothing; a longer
    max_steps is an extension, not another setting."""
    out = tmp_path / "sweep"
    args = ["--config", str(_config(tmp_path, corpus)), "--out", str(out), "--vary", "routing.capacity=0.25,0.5"]
    assert main(args) == 0
    before = {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}
    capsys.readouterr()
    assert main([*args, "--train.lr=0.001"]) == 2
    err = capsys.readouterr().err
    assert f"{out / 'capacity=0.25'} holds a run with other settings: train.lr" in err, err
    assert {p: p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()} == before
    assert main([*args, "--train.max_steps=3", "--dry-run"]) == 0
    assert "(3 steps, resumes from step 2)" in capsys.readouterr().out


def test_an_unreadable_checkpoint_or_a_file_as_out_is_a_clear_error(tmp_path: Path, corpus: Path, capsys) -> None:
    out = tmp_path / "sweep"
    args = ["--config", str(_config(tmp_path, corpus)), "--out", str(out), "--vary", "routing.capacity=0.25,0.5"]
    (out / "capacity=0.5").mkdir(parents=True)
    (out / "capacity=0.5" / CHECKPOINT).write_text("garbage")
    assert main(args) == 2
    assert f"{out / 'capacity=0.5' / CHECKPOINT} is not a readable checkpoint" in capsys.readouterr().err
    assert not (out / "capacity=0.25").exists()  # nothing ran
    a_file = tmp_path / "file"
    a_file.write_text("x")
    assert main(["--config", str(_config(tmp_path, corpus)), "--out", str(a_file), "--vary", "train.seed=0,1"]) == 2
    assert f"--out {a_file}: is a file" in capsys.readouterr().err


def test_sigterm_stops_the_sweep_and_its_trainings(tmp_path: Path, corpus: Path) -> None:
    """SIGTERM to the sweep's process alone (kill, timeout, a scheduler): its trainings get a SIGTERM and
    stop at their checkpoints, none is left running to write beside a restarted sweep, and it exits 130."""
    with _a_long_parallel_sweep(tmp_path, corpus) as (sweep_process, out):
        os.kill(sweep_process.pid, signal.SIGTERM)  # the sweep alone, not its process group
        stdout, stderr = sweep_process.communicate(timeout=120)
        assert sweep_process.returncode == 130, (stdout, stderr)
        assert "== seed=0: stopped (SIGTERM" in stdout and "== seed=1: stopped (SIGTERM" in stdout, stdout
        sizes = [(out / f"seed={i}" / METRICS).stat().st_size for i in (0, 1)]
        time.sleep(2)
        assert [(out / f"seed={i}" / METRICS).stat().st_size for i in (0, 1)] == sizes  # nobody writes any more
        assert not (out / "seed=2").exists()


def test_the_sweep_gives_back_the_callers_sigterm_handler(tmp_path: Path, corpus: Path) -> None:
    before = signal.getsignal(signal.SIGTERM)
    args = ["--config", str(_config(tmp_path, corpus)), "--out", str(tmp_path / "s"), "--vary", "train.seed=0"]
    assert main(args) == 0
    assert signal.getsignal(signal.SIGTERM) is before


# ----------------------------------------------------------------------------- folders of other experiments, fields given twice, --zip
def _files(folder: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_folder_of_another_experiment_without_a_checkpoint_is_refused_untouched(
        tmp_path: Path, corpus: Path, capsys) -> None:
    """A point's folder holding another experiment's run that has no checkpoint yet (its config.yaml and
    metrics.jsonl only) is refused like one with a checkpoint, naming the folder and the field, and
    nothing on disk is touched; so is a metrics.jsonl without a config. The same experiment's folder
    passes (the run starts again)."""
    from mode.config import load_config, save_config

    config = _config(tmp_path, corpus)
    out = tmp_path / "sweep"
    args = ["--config", str(config), "--out", str(out), "--vary", "routing.capacity=0.25,0.5"]
    other = out / "capacity=0.5"
    other.mkdir(parents=True)
    save_config(load_config(config, ["--routing.capacity=0.5", "--model.d_ff=96"]), other / "config.yaml")
    (other / METRICS).write_text('{"step": 1, "loss": 4.0}\n')
    before = _files(out)
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"{other} holds a run with other settings: model.d_ff (96 there, 64 here)" in err, err
    assert _files(out) == before and not (out / "capacity=0.25").exists()  # nothing ran, nothing removed

    (other / "config.yaml").unlink()  # metrics of unknown origin
    assert main(args) == 2
    assert f"{other} holds {METRICS} but no config.yaml" in capsys.readouterr().err
    assert (other / METRICS).read_text() == '{"step": 1, "loss": 4.0}\n'

    # The same experiment (up to a field a resume may change) is this point's run: planned to start again.
    save_config(load_config(config, ["--routing.capacity=0.5", "--train.max_steps=7"]), other / "config.yaml")
    assert main([*args, "--dry-run"]) == 0


def test_a_varied_field_given_again_or_set_by_the_sweep_is_refused(tmp_path: Path, corpus: Path, capsys) -> None:
    """--vary train.lr=... with --train.lr=... would drop the override; --vary train.out_dir would be
    replaced by the sweep's own folder, every point training alike: both name the field."""
    base = ["--config", str(_config(tmp_path, corpus)), "--out", str(tmp_path / "s"), "--dry-run"]
    assert main([*base, "--vary", "train.lr=0.001,0.002", "--train.lr=0.003"]) == 2
    assert "train.lr is given by --vary and as an override" in capsys.readouterr().err
    assert main([*base, "--vary", "train.out_dir=a,b"]) == 2
    assert "--vary train.out_dir: each run's folder is <--out>/<point>" in capsys.readouterr().err
    assert main([*base, "--vary", "train.progress=true,false"]) == 2
    assert "--vary train.progress:" in capsys.readouterr().err
    assert not (tmp_path / "s").exists()


def test_zip_fields_change_together(tmp_path: Path, corpus: Path, capsys) -> None:
    """Staged against integrated MoDE needs moe.n_noop 0 with one pattern and > 0 with the other: the
    product of two --vary lists holds the invalid (integrated, 0) point; --zip takes the i-th values
    together, one axis of the grid (the slowest), named by every field."""
    points = grid([parse_vary("train.seed=0,1")],
                  [parse_vary("model.block_pattern=[dense,mode_staged],[dense,mode_integrated]"),
                   parse_vary("moe.n_noop=0,4")])
    assert [p.name for p in points] == [
        "block_pattern=dense-mode_staged+n_noop=0+seed=0", "block_pattern=dense-mode_staged+n_noop=0+seed=1",
        "block_pattern=dense-mode_integrated+n_noop=4+seed=0", "block_pattern=dense-mode_integrated+n_noop=4+seed=1"]
    assert points[2].overrides == ["--model.block_pattern=[dense,mode_integrated]", "--moe.n_noop=4", "--train.seed=0"]
    with pytest.raises(SweepError, match=r"--zip: every field needs as many values.*moe.n_noop 3"):
        grid([], [parse_vary("model.block_pattern=[dense],[mod]"), parse_vary("moe.n_noop=0,4,8")])

    out = tmp_path / "sweep"
    args = ["--config", str(_config(tmp_path, corpus)), "--out", str(out), "--dry-run",
            "--zip", "model.block_pattern=[dense,mode_staged],[dense,mode_integrated]", "--zip", "moe.n_noop=0,4"]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "sweep: 2 runs" in printed and "block_pattern=dense-mode_integrated+n_noop=4 (2 steps)" in printed
    assert main([*args[:-1], "moe.n_noop=0,4", "--moe.n_noop=2"]) == 2  # a zip field is varied too
    assert "moe.n_noop is given by --vary and as an override" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(args[:4])
    assert "give the grid: --vary" in capsys.readouterr().err


# ----------------------------------------------------------------------------- locked folders; stopped from a script or a scheduler
def test_a_point_whose_folder_another_training_holds_is_skipped_and_reported(tmp_path: Path, corpus: Path,
                                                                             capsys) -> None:
    """A restarted sweep (or a second one) meets a point another live process trains: it neither starts a
    second writer nor deletes the point's files; the point is reported skipped, naming the holder's pid,
    and left out of the report; the others run."""
    from mode.run_folder import RunFolderLock

    out = tmp_path / "sweep"
    args = ["--config", str(_config(tmp_path, corpus)), "--out", str(out), "--vary", "train.seed=0,1"]
    held = out / "seed=1"
    held.mkdir(parents=True)
    from mode.config import load_config, save_config

    save_config(load_config(args[1], ["--train.seed=1", f"--train.out_dir={held}"]), held / "config.yaml")
    (held / METRICS).write_text('{"step": 1, "flops": 1.0, "loss": 5.0}\n')  # its run, writing before a checkpoint
    lock = RunFolderLock(held)
    lock.acquire()
    try:
        assert main(args) == 1
    finally:
        lock.release()
    printed = capsys.readouterr().out
    assert f"seed=1: skipped: {held} is in use by another training (pid {os.getpid()})" in printed, printed
    assert "seed=0: done" in printed
    assert (held / METRICS).read_text() == '{"step": 1, "flops": 1.0, "loss": 5.0}\n'
    assert "seed=1" not in (out / "report.md").read_text()


def test_a_checkpoint_holding_code_is_refused_without_torchs_advice(tmp_path: Path, corpus: Path, capsys) -> None:
    """A point's checkpoint.pt that would run code on loading: one line, without torch's advice to load it
    with weights_only=False."""
    import torch

    point = tmp_path / "sweep" / "seed=0"
    point.mkdir(parents=True)
    torch.save({"format": "mode-checkpoint-v1", "hook": SweepError}, point / CHECKPOINT)
    assert main(["--config", str(_config(tmp_path, corpus)), "--out", str(tmp_path / "sweep"),
                 "--vary", "train.seed=0"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {point / CHECKPOINT} is not a readable checkpoint") and err.count("\n") == 1, err
    assert "weights_only" not in err and "could run code" in err, err


def _trainings_of(folder: Path) -> list[int]:
    """The pids of live processes whose command line names `folder`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                command = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(folder) in command and "mode.train" in command:
                found.append(int(entry.name))
    return found


@pytest.mark.parametrize("started", ["under timeout", "as a background job"])
def test_a_sweep_stopped_by_sigterm_leaves_no_training_running(tmp_path: Path, corpus: Path, started: str) -> None:
    """`timeout` passes its SIGTERM to the sweep; a script's background job (`sweep &`) passes its trainings
    an ignored SIGINT. Either way the trainings stop at a checkpoint (the sweep sends them SIGTERM, which
    they honour whatever they inherited), none is left running, and each point resumes."""
    import shlex

    out = tmp_path / "sweep"
    sweep_command = [sys.executable, "-m", "mode.sweep", "--config", str(_config(tmp_path, corpus)), "--out", str(out),
                     "--vary", "train.seed=0,1,2", "--jobs", "2", "--train.max_steps=100000",
                     "--train.checkpoint_interval=1"]
    pid_file = tmp_path / "pid"
    if started == "under timeout":
        command = ["timeout", "600", *sweep_command]
    else:  # bash without job control: a background job's SIGINT is ignored, and inherited by its children
        command = ["bash", "-c", f"{shlex.join(sweep_command)} > {tmp_path / 'sweep.out'} 2>&1 & "
                                 f"echo $! > {pid_file}; wait"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, cwd=Path(__file__).resolve().parents[1])
    try:
        deadline = time.monotonic() + 120
        while not all((out / f"seed={i}" / CHECKPOINT).exists() for i in (0, 1)):
            assert time.monotonic() < deadline and process.poll() is None, process.communicate()
            time.sleep(0.2)
        target = process.pid if started == "under timeout" else int(pid_file.read_text())
        os.kill(target, signal.SIGTERM)
        stdout, _ = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    printed = stdout if started == "under timeout" else (tmp_path / "sweep.out").read_text()
    # the trainings' own logs too: a run that ended otherwise than stopped says why only there
    logs = "".join(f"\n--- {log}\n{log.read_text()[-3000:]}" for log in sorted(out.glob("*/train.log")))
    assert "sweep stopped (Ctrl-C or SIGTERM)" in printed and "Traceback" not in printed, printed + logs
    assert "== seed=0: stopped (SIGTERM" in printed and "== seed=1: stopped (SIGTERM" in printed, printed + logs
    assert _trainings_of(out) == []
    dry = subprocess.run([*sweep_command, "--dry-run"], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).resolve().parents[1])
    for i in (0, 1):
        step = load_checkpoint_file(out / f"seed={i}")["state"]["step"]
        assert f"seed={i} (100000 steps, resumes from step {step})" in dry.stdout, dry.stdout
        assert max(_steps(out / f"seed={i}")) >= step


def test_point_names_write_floats_without_a_misleading_exponent_sign() -> None:
    """1e16 names a folder flops_budget=1e16 (YAML's 1.0e+16, with + a separator, read 1.0e-16)."""
    from mode.sweep import _name_value

    assert [_name_value(v) for v in ("1e16", "3e15", "1.0e-4", "0.125", "10.0", "[dense,mod]", "true")] == [
        "1e16", "3e15", "0.0001", "0.125", "10.0", "dense-mod", "true"]
