"""launch/study.sh: every part's grid as planned (a dry run: nothing trains)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("part, points", [("isoflop", 36), ("routing", 4 + 12), ("experts", 8), ("causal", 4),
                                          ("controls", 12), ("all", 36 + 16 + 8 + 4)])
def test_each_part_plans_its_points(part: str, points: int) -> None:
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    out = subprocess.run(["bash", "launch/study.sh", part, "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    planned = [line for line in out.stdout.splitlines() if "python -m mode.train" in line]
    assert len(planned) == points, out.stdout[-3000:]
    assert all("--config configs/study_gpu.yaml" in line for line in planned)


def test_an_unknown_part_is_refused() -> None:
    out = subprocess.run(["bash", "launch/study.sh", "everything"], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "unknown part: everything" in out.stderr


def test_a_tiny_study_runs_end_to_end(tmp_path: Path) -> None:
    """data -> the causal part (4 tiny CPU points) -> evaluate -> report, through the script itself:
    every run folder holds an eval.json and the part's report writes its plots. The evaluation
    runs as it does on a 4-GPU machine, one worker a listed GPU (here two, each on the CPU)."""
    env = {**os.environ, "PYTHON": sys.executable, "GPUS": "", "STUDY_DATA": str(tmp_path / "data"),
           "STUDY_RUNS": str(tmp_path / "runs"), "STUDY_REPORTS": str(tmp_path / "reports"),
           "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    tiny = ["--model.d_model=64", "--model.n_heads=2", "--model.n_layers=2", "--model.d_ff=128",
            "--model.max_seq_len=64", "--data.seq_len=64", "--train.batch_size=4", "--train.flops_budget=2e10",
            "--train.eval_interval=5", "--train.warmup_steps=2", "--train.device=cpu", "--train.eval_batches=2"]
    steps = [["data", "--max-bytes", "1500000", "--val-fraction", "0.2"], ["causal", *tiny],
             ["evaluate", "--batches", "2", "--device", "cpu"], ["report"]]
    for step in steps:
        out = subprocess.run(["bash", "launch/study.sh", *step], cwd=ROOT, capture_output=True, text=True,
                             env={**env, "GPUS": "0,1"} if step[0] == "evaluate" else env, timeout=600)
        assert out.returncode == 0, (step[0], out.stdout[-2000:], out.stderr[-2000:])
    runs = sorted(p for p in (tmp_path / "runs" / "causal").iterdir() if p.is_dir())
    assert len(runs) == 4 and all((run / "eval.json").is_file() for run in runs)
    written = {p.name for p in (tmp_path / "reports" / "causal").iterdir()}
    assert {"report.md", "val_loss_vs_flops.png", "causal_accuracy.png", "position_share.png"} <= written
