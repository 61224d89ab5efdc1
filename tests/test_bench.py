"""The benchmark scripts' CPU smoke modes (--tiny) run and print their tables.

Timings are never asserted (a test is not a benchmark); what is checked is that each script
still runs against the library as it is now and prints every row it promises, with positive
numbers. bench/moe_layer.py, bench/row_ops.py and bench/kernels.py measure GPU kernels only
and have no CPU mode.
"""
from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 180  # seconds per script (each takes a few seconds on 2 cores)


def run(*args: str) -> str:
    out = subprocess.run([sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT)
    assert out.returncode == 0, f"{' '.join(args)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out.stdout


def table_rows(text: str) -> list[list[str]]:
    """The markdown table rows of a script's output: a header (the line before a separator line)
    and the separators left out."""
    lines = [line for line in text.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines]
    separator = [set("".join(c)) <= set("- ") for c in cells]
    header = [i + 1 < len(cells) and separator[i + 1] for i in range(len(cells))]
    return [c for c, sep, head in zip(cells, separator, header) if not sep and not head]


def number(cell: str) -> float:
    return float(re.sub(r"[, x]", "", cell))


PROFILE_LINE = re.compile(r"### (.+): (\d+) passes under the profiler, ([\d.]+) ms wall per pass, GPU busy")


def test_mod_step_tiny() -> None:
    out = run("bench/mod_step.py", "--tiny", "--profile")
    rows = table_rows(out)
    assert [r[:2] for r in rows] == [["eager", "dense"], ["eager", "MoD"]]
    # --profile: one report per model, with its wall time per pass
    reports = PROFILE_LINE.findall(out)
    assert [r[0] for r in reports] == ["dense, eager forward+backward", "MoD, eager forward+backward"]
    assert all(float(r[2]) > 0 for r in reports)
    assert all(number(r[2]) > 0 and number(r[3]) > 0 and number(r[4]) > 0 for r in rows)  # fwd+bwd, step, back to back ms
    assert all(number(v) > 0 for v in rows[1][6:9])  # the MoD / dense ratios


def test_block_kinds_tiny() -> None:
    rows = table_rows(run("bench/block_kinds.py", "--tiny"))
    assert [r[0] for r in rows] == ["dense", "mod", "moe", "mode_staged", "mode_integrated"]
    assert all(number(r[1]) > 0 and number(r[2]) > 0 for r in rows)
    assert number(rows[0][5]) == 1.0  # step time against dense: dense itself


def test_decode_tiny() -> None:
    rows = table_rows(run("bench/decode.py", "--tiny"))
    assert {r[1] for r in rows} == {"dense", "MoD"}
    assert all(number(r[3]) > 0 for r in rows)  # tokens/s


def test_scaling_tiny_on_two_gloo_processes() -> None:
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "bench/scaling.py", "--tiny",
              "--profile", "1")
    rows = table_rows(out)
    assert len(rows) == 1 and rows[0][:2] == ["mode", "2"], out
    assert PROFILE_LINE.findall(out)[0][:2] == ("training steps on rank 0 of 2", "1")  # --profile 1: rank 0 only
    assert number(rows[0][2]) > 0 and number(rows[0][3]) > 0  # tokens/s, ms/step


def test_block_profile_tiny_compiled() -> None:
    """--compile: the dense and the MoD block each compiled; the table has those two rows."""
    out = run("bench/block_profile.py", "--tiny", "--compile", "--top", "2")
    rows = table_rows(out)
    assert [r[0] for r in rows[:2]] == ["dense block", "MoD block"] and rows[2][0].startswith("top-k"), out
    assert "; compiled, float32" in out
    assert all(number(r[1]) > 0 and number(r[2]) > 0 and number(r[3]) > 0 for r in rows[:2])


def test_mod_step_modes_selects_modes() -> None:
    """--modes keeps the named modes of those the run allows (--tiny: eager only, on CPU)."""
    rows = table_rows(run("bench/mod_step.py", "--tiny", "--modes", "eager", "compiled"))
    assert [r[:2] for r in rows] == [["eager", "dense"], ["eager", "MoD"]]
    assert table_rows(run("bench/mod_step.py", "--tiny", "--modes", "compiled")) == []


def test_block_profile_tiny() -> None:
    rows = table_rows(run("bench/block_profile.py", "--tiny", "--top", "3"))
    assert [r[0] for r in rows[:4]] == ["dense block", "MoD block", "the block alone on k=8 tokens",
                                        "routing alone (route, gate, add back)"]
    assert all(number(r[1]) > 0 and number(r[2]) > 0 and number(r[3]) > 0 for r in rows[:4])
    assert [r[0].split(",")[0] for r in rows[4:]] == [
        "top-k of 8 in (2", "sort the chosen positions", "sort the chosen positions", "top_k_positions",
        "top_k_positions as routers run it (CUDA: one Triton kernel)", "expert choice (2", "expert choice (2",
        "copy the float32 residual (128 x 32)"]
    assert all(number(r[1]) > 0 for r in rows[4:])
