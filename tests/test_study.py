"""launch/study.sh: every part's grid as planned (a dry run: nothing trains)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("part, points", [("isoflop", 36), ("routing", 4 + 12), ("experts", 8), ("causal", 4)])
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
