"""The README's CPU commands run as written. Each is checked to appear in README.md word for word,
then run from a scratch folder (its `configs/` a link to the repository's, so `runs/` and
`reports/` land there), with overrides appended that shorten training to a few steps; the two
launch scripts, which run from the repository's root, get a scratch --train.out_dir as well."""
from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
SHORT = ["--train.max_steps=2", "--train.warmup_steps=1", "--train.eval_interval=2", "--train.eval_batches=1",
         "--train.checkpoint_interval=2", "--train.progress=false"]
TIMEOUT = 600


def _run(command: str, cwd: Path, extra: list[str], replace: tuple[str, str] = ("", "")) -> subprocess.CompletedProcess:
    """Run `command` (as README.md writes it; `replace` then fills a placeholder) with `extra` appended."""
    assert command in README, f"not in README.md: {command}"
    argv = shlex.split(command.replace(*replace) if replace[0] else command)
    if argv[0] == "python":
        argv[0] = sys.executable
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    result = subprocess.run([*argv, *extra], cwd=cwd, env=env, capture_output=True, text=True, timeout=TIMEOUT)
    assert result.returncode == 0, (command, result.stdout[-3000:], result.stderr[-3000:])
    return result


@pytest.fixture
def scratch(tmp_path: Path) -> Path:
    (tmp_path / "configs").symlink_to(ROOT / "configs")
    return tmp_path


def test_training_sampling_and_the_launch_scripts(scratch: Path) -> None:
    _run("python -m mode.train --config configs/mode_integrated_tiny.yaml --moe.n_noop=2 --train.lr=1e-3 "
         "--train.out_dir=runs/noop2", scratch, SHORT)
    assert (scratch / "runs" / "noop2" / "checkpoint.pt").is_file()
    main_job = scratch / "main"
    _run("bash launch/main.sh --train.max_steps=50", ROOT, [*SHORT, f"--train.out_dir={main_job}"])
    _run("bash launch/train.sh configs/dense_tiny.yaml --train.max_steps=100", ROOT,
         [*SHORT, f"--train.out_dir={scratch / 'dense'}"])
    sampled = _run('python -m mode.generate --checkpoint runs/mod_tiny-YYYYMMDD-HHMMSS --prompt "def " '
                   "--max-new-tokens 200 --top-p 0.9", scratch, [], ("runs/mod_tiny-YYYYMMDD-HHMMSS", str(main_job)))
    assert sampled.stdout.strip()


def test_sweep_report_and_evaluate(scratch: Path) -> None:
    sweep = ("python -m mode.sweep --config configs/mod_tiny.yaml --out runs/capacity \\\n"
             "    --vary routing.capacity=0.125,0.25 --vary routing.random=false,true --routing.causal=none "
             "--train.max_steps=200")
    _run(sweep, scratch, ["--jobs", "2", *SHORT], ("\\\n    ", ""))
    points = sorted(p.name for p in (scratch / "runs" / "capacity").iterdir() if p.is_dir())
    assert len(points) == 4, points
    _run("python -m mode.report runs/capacity/*/ --out reports/capacity", scratch,  # the shell's glob, expanded
         [f"runs/capacity/{p}/" for p in points], ("runs/capacity/*/ ", ""))
    assert (scratch / "reports" / "capacity" / "report.md").is_file()
    _run("python -m mode.evaluate runs/capacity/capacity=0.125+random=false --batches 256", scratch, [])
