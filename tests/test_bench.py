"""The benchmark scripts' CPU smoke modes (--tiny) run and print their tables.

Timings are never asserted (a test is not a benchmark); what is checked is that each script
still runs against the library as it is now and prints every row it promises, with positive
numbers. bench/moe_layer.py, bench/row_ops.py and bench/kernels.py measure GPU kernels only
and have no CPU mode. Also checked: what each script refuses without a GPU (a one-line error,
exit 2, not a traceback nor a GPU-sized run on CPU), and that the CPU headers say what runs there.
"""
from __future__ import annotations

import argparse
import importlib
import os
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT = 180  # seconds per script (each takes a few seconds on 2 cores)
CUDA = torch.cuda.is_available()


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


def header(text: str) -> str:
    """The line that says what ran: the card, the shape, the precision and the kernels."""
    return next(line for line in text.splitlines() if line.startswith("card: "))


def check_cpu_header(text: str) -> None:
    """Without CUDA the scripts run float32 PyTorch ops: the header must not claim bf16 or Triton."""
    line = header(text)
    if CUDA:
        assert "bf16 autocast" in line, line
    else:
        assert "float32" in line and "PyTorch ops (Triton kernels need CUDA)" in line, line
        assert "bf16" not in line and "triton" not in line, line


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py imported in this process as bench.<name> (its main then takes argv): the
    benchmarks are a package, importable from the repository root without installing anything."""
    return importlib.import_module(f"bench.{name}")


def refusal(name: str, argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    """The one-line error bench/<name>.py stops with, before any work (exit 2, as argparse's)."""
    with pytest.raises(SystemExit) as stop:
        bench_module(name).main(argv)
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert ": error: " in last, last  # argparse's prog: here pytest's, not the script's name
    return last


@pytest.mark.parametrize("name", ["moe_layer", "kernels", "row_ops", "optimizer"])
def test_gpu_only_scripts_need_cuda(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The GPU-kernel benchmarks stop at once without CUDA (not at their first CUDA call)."""
    if CUDA:  # the check lets a GPU run through (the benchmark itself is not run here)
        bench_module("common").require_cuda(argparse.ArgumentParser())
        return
    assert "needs a CUDA GPU" in refusal(name, [], capsys)


@pytest.mark.parametrize("name", ["mod_step", "block_kinds", "block_profile", "decode", "prefill", "conversion",
                                  "generate"])
def test_full_shape_needs_cuda_or_tiny(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """Without CUDA the GPU-sized default shape is refused (minutes on CPU); --tiny is named instead."""
    if CUDA:
        bench_module("common").require_cuda_unless_tiny(argparse.ArgumentParser(), argparse.Namespace(tiny=False))
        return
    message = refusal(name, [], capsys)
    assert "sized for a GPU" in message and "--tiny is the CPU smoke run" in message, message


def test_decode_device_flag(capsys: pytest.CaptureFixture[str]) -> None:
    """decode.py --device cpu runs a shape of one's own on CPU; --device cuda needs a GPU."""
    decode = bench_module("decode")
    decode.check_device(argparse.ArgumentParser(), argparse.Namespace(device="cpu", tiny=False))
    if not CUDA:
        assert "--device cuda: no CUDA GPU" in refusal("decode", ["--device", "cuda"], capsys)


def test_decode_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    """decode.py --kernels: on a GPU, each model's replayed step with its kernels per step and their
    time, dense first at 1.00 x, then each model's top kernels; without one, a one-line error."""
    if not CUDA:
        assert "--kernels profiles the CUDA-graphed step: it needs a GPU" in refusal("decode", ["--kernels", "--tiny"], capsys)
        return
    out = run("-m", "bench.decode", "--kernels", "--tiny", "--device", "cuda", "--prompts", "16", "--batches", "4")
    rows = table_rows(out)
    steps = [r for r in rows if len(r) == 5]
    assert [r[0] for r in steps] == ["dense", "MoD", "Staged MoDE"] and steps[0][4] == "1.00", out
    assert all(number(r[1]) > 0 and number(r[2]) > 0 and number(r[3]) > 0 for r in steps), out
    kernels = [r for r in rows if len(r) == 3]
    assert len(kernels) >= 3 and all(number(r[1]) > 0 and number(r[2]) >= 0 for r in kernels), out
    assert out.count("top kernels by GPU time a step") == 3, out


@pytest.mark.parametrize("name", ["mod_step", "block_kinds"])
def test_cuda_graph_modes_need_cuda(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    """--modes 'eager + CUDA graphs' without a GPU is an error, not an empty table."""
    if CUDA:
        bench_module("mod_step").check_modes(argparse.ArgumentParser(), ["eager + CUDA graphs"])
        return
    message = refusal(name, ["--tiny", "--modes", "eager", "eager + CUDA graphs"], capsys)
    assert "--modes 'eager + CUDA graphs' needs a CUDA GPU" in message, message


PROFILE_LINE = re.compile(r"### (.+): (\d+) passes under the profiler, ([\d.]+) ms wall per pass, GPU busy")
HOST_LINE = re.compile(r"### (.+): the host's time queuing a pass .*: forward ([\d.]+) ms, backward ([\d.]+) ms, ([\d.]+) ms in all")


def test_mod_step_tiny() -> None:
    out = run("-m", "bench.mod_step", "--tiny", "--profile")
    rows = table_rows(out)
    # --tiny turns compile off; on CUDA the eager model is also timed as CUDA graphs
    modes = ["eager", "eager + CUDA graphs"] if CUDA else ["eager"]
    assert [r[:2] for r in rows] == [[mode, model] for mode in modes for model in ("dense", "MoD")]
    # --profile: one report per model, with its wall time per pass
    reports = PROFILE_LINE.findall(out)
    assert [r[0] for r in reports] == ["dense, eager forward+backward", "MoD, eager forward+backward"]
    assert all(float(r[2]) > 0 for r in reports)
    # and the host's time queuing a pass, forward and backward adding up to the whole
    hosts = HOST_LINE.findall(out)
    assert [h[0] for h in hosts] == ["dense, eager forward+backward", "MoD, eager forward+backward"]
    assert all(float(f) > 0 and float(b) > 0 and abs(float(f) + float(b) - float(t)) <= 0.011 for _, f, b, t in hosts)
    assert all(number(r[2]) > 0 and number(r[3]) > 0 and number(r[4]) > 0 for r in rows)  # fwd+bwd, step, back to back ms
    assert all(number(v) > 0 for v in rows[1][6:9])  # the MoD / dense ratios
    check_cpu_header(out)
    assert all((number(r[5]) >= 0) if CUDA else r[5] == "-" for r in rows)  # peak GiB (a tiny model's may read 0.00); none on CPU


def test_block_kinds_tiny() -> None:
    out = run("-m", "bench.block_kinds", "--tiny")
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["dense", "mod", "moe", "mode_staged", "mode_integrated", "mor",
                                    "mode_integrated, copy null experts", "mode_integrated, constant null experts",
                                    "moe token choice top-1", "moe token choice top-1, bias balancing"]
    assert all(number(r[1]) > 0 and number(r[2]) > 0 for r in rows)
    check_cpu_header(out)
    assert all((number(r[3]) >= 0) if CUDA else r[3] == "-" for r in rows)  # peak GiB (0.00 for tiny models on a GPU)
    assert number(rows[0][5]) == 1.0  # step time against dense: dense itself
    assert number(rows[0][7]) == 1.0 and all(number(r[7]) > 0 for r in rows)  # steps back to back, per FLOP


def test_block_kinds_busy_columns() -> None:
    """--busy: a step's busy time and its forward+backward's, each per FLOP against dense's (dense 1)."""
    rows = table_rows(run("-m", "bench.block_kinds", "--tiny", "--busy", "--only", "mode_staged"))
    assert [r[0] for r in rows] == ["dense", "mode_staged"] and all(len(r) == 10 for r in rows)
    busy = [[number(x) for x in r[8].replace("(", " ").replace(")", " ").split()] for r in rows]  # step, fwd+bwd
    assert all(ms > 0 for pair in busy for ms in pair)
    assert rows[0][9] == "1.000 (1.000)"
    # per FLOP: busy over dense's busy, over the FLOP ratio (the step time's ratio over its per-FLOP one)
    flop_ratio = number(rows[1][5]) / number(rows[1][6].split(":")[0])
    per_flop = [number(x) for x in rows[1][9].replace("(", " ").replace(")", " ").split()]
    for i in range(2):
        assert per_flop[i] == pytest.approx(busy[1][i] / busy[0][i] / flop_ratio, rel=0.01)


def test_block_kinds_rounds_interleave_with_dense(capsys: pytest.CaptureFixture[str]) -> None:
    """--rounds 2: every row still printed with its ratios; at least 1."""
    rows = table_rows(run("-m", "bench.block_kinds", "--tiny", "--rounds", "2", "--only", "mod"))
    assert [r[0] for r in rows] == ["dense", "mod"]
    assert number(rows[0][5]) == 1.0 and number(rows[1][5]) > 0 and number(rows[1][6].split(":")[0]) > 0
    # the lowest and highest round's per FLOP beside the median: the median lies between them
    spread = re.search(r"\(rounds ([\d.]+) to ([\d.]+)\)$", rows[1][6])
    assert spread and float(spread[1]) <= number(rows[1][6].split(":")[0]) <= float(spread[2]), rows[1][6]
    assert "rounds" not in rows[0][6]  # dense: its own baseline
    assert number(rows[0][7]) == 1.0 and number(rows[1][7]) > 0  # steps back to back, round by round
    assert "--rounds must be at least 1, got 0" in refusal("block_kinds", ["--tiny", "--rounds", "0"], capsys)


def test_block_kinds_rounds_compiled_recompile_dense_after_each_reset() -> None:
    """--rounds 2 compiled: the dense model kept beside each row recompiles after the row's dynamo
    reset and is timed again; every row has its ratios."""
    rows = table_rows(run("-m", "bench.block_kinds", "--tiny", "--modes", "compiled", "--rounds", "2",
                          "--only", "mod", "moe"))
    assert [r[0] for r in rows] == ["dense", "mod", "moe"]
    assert number(rows[0][5]) == 1.0 and all(number(r[5]) > 0 and number(r[6].split(":")[0]) > 0 for r in rows[1:])


def test_train_configs_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    """python -m mode.train on two tiny configs with a setting changed: tokens/s and FLOPs a token
    positive, the ratio against dense from them (dense the unit); dense must come first, a missing
    config and a malformed setting are refused."""
    out = run("-m", "bench.train_configs", "--tiny", "--configs", "dense", "mod", "--set", "train.batch_size=4")
    assert "with train.batch_size=4" in out
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["dense", "mod"]
    (dense_rate, dense_flops), (rate, flops) = [(number(r[1]), number(r[2])) for r in rows]
    assert min(dense_rate, dense_flops, rate, flops) > 0 and flops < dense_flops
    assert number(rows[0][4].split(":")[0]) == 1.0
    ratio = number(rows[1][4].split(":")[0])
    assert ratio == pytest.approx(dense_rate * dense_flops / (rate * flops), rel=2e-2)  # table rounding
    assert "the first must be dense" in refusal("train_configs", ["--tiny", "--configs", "mod", "dense"], capsys)
    assert "no such file" in refusal("train_configs", ["--tiny", "--configs", "dense", "nonsense"], capsys)
    assert "is not SECTION.FIELD=VALUE" in refusal("train_configs", ["--tiny", "--set", "train.lr"], capsys)
    assert "at least 1" in refusal("train_configs", ["--tiny", "--nproc", "0"], capsys)


def test_train_configs_against_a_setting(capsys: pytest.CaptureFixture[str]) -> None:
    """--against: each config runs again with the setting; its columns hold that run's tokens/s,
    FLOPs a token (here changed by the capacity) and time per FLOP against dense run the same way,
    and the tokens/s over the first run's. A malformed setting is refused."""
    out = run("-m", "bench.train_configs", "--tiny", "--configs", "dense", "mod", "--against", "routing.capacity=0.5")
    header = next(line for line in out.splitlines() if line.startswith("| config"))
    assert "tokens/s, with routing.capacity=0.5" in header
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["dense", "mod"] and all(len(r) == 9 for r in rows)
    (dense, mod) = rows
    assert number(dense[2]) == number(dense[6])  # no depth router in dense: its FLOPs stay
    assert number(mod[6]) > number(mod[2])  # half the tokens through the routed blocks, not 12.5 %
    assert number(dense[7].split(":")[0]) == 1.0
    ratio = number(mod[7].split(":")[0])
    assert ratio == pytest.approx(number(dense[5]) * number(dense[6]) / (number(mod[5]) * number(mod[6])), rel=2e-2)
    assert number(mod[8]) == pytest.approx(number(mod[5]) / number(mod[1]), rel=2e-2)
    assert "is not SECTION.FIELD=VALUE" in refusal("train_configs", ["--tiny", "--against", "routing"], capsys)


def test_train_configs_routed_set_leaves_dense_alone(capsys: pytest.CaptureFixture[str]) -> None:
    """--routed-set: every config but dense (the baseline) runs with the setting, here a capacity
    that changes MoD's FLOPs a token and would be refused by nothing in dense either way."""
    from mode.config import load_config
    from mode.flops import model_flops

    out = run("-m", "bench.train_configs", "--tiny", "--configs", "dense", "mod", "--routed-set", "routing.capacity=0.5")
    assert "every config but dense with routing.capacity=0.5" in out
    dense, mod = table_rows(out)
    tiny = ROOT / "configs"
    assert number(dense[2]) == pytest.approx(model_flops(load_config(tiny / "dense_tiny.yaml", [])).train_per_token / 1e6,
                                             abs=0.06)
    assert number(mod[2]) == pytest.approx(model_flops(load_config(
        tiny / "mod_tiny.yaml", ["--routing.capacity=0.5"])).train_per_token / 1e6, abs=0.06)
    assert "is not SECTION.FIELD=VALUE" in refusal("train_configs", ["--tiny", "--routed-set", "x"], capsys)


def test_train_configs_tiny_on_two_processes() -> None:
    """--nproc 2: launch/train.py on two CPU processes over gloo; the table says it counts every
    process's tokens, dense the unit."""
    out = run("-m", "bench.train_configs", "--tiny", "--nproc", "2", "--configs", "dense", "mod")
    assert out.startswith("launch/train.py on 2 processes") and "tokens/s (all processes)" in out
    rows = table_rows(out)
    assert [r[0] for r in rows] == ["dense", "mod"]
    assert min(number(r[1]) for r in rows) > 0 and number(rows[0][4].split(":")[0]) == 1.0


def test_ep_layer_tiny_on_two_gloo_processes() -> None:
    """--tiny: two CPU processes over gloo, the experts sharded between them: every eager row of this
    project's and DeepSpeed's prints positive times, the dense MLP the unit; the CUDA graph rows
    (and megablocks, where it is not installed) say why they did not run instead of a time."""
    out = run("-m", "bench.ep_layer", "--tiny", "--nproc", "2", "--rounds", "1")  # flags reach every process
    assert "2 x CPU (gloo)" in out and "2 a process where sharded" in out, out
    rows = {r[0]: r for r in table_rows(out)}
    eager = ["dense GELU MLP, same FLOPs (the limit)", "mode expert choice, every expert on every GPU",
             "mode expert choice, experts sharded", "mode token choice top-1 cf 1.0, experts sharded",
             "mode token choice top-1 dropless, experts sharded",
             "DeepSpeed 0.19.8 MoE top-1, capacity factor 1.0, ep_size 2"]
    for name in eager:
        assert all(number(cell) > 0 for cell in rows[name][1:]), rows[name]
    assert number(rows[eager[0]][2]) == number(rows[eager[0]][4]) == 1.0
    graphs = [name for name in rows if name.endswith("one CUDA graph")]
    assert len(graphs) == 4 and all(rows[name][1] == "not run: RuntimeError: CUDA graphs need a GPU" for name in graphs)
    megablocks = next(name for name in rows if name.startswith("megablocks"))
    assert rows[megablocks][1].startswith("not run: ") or number(rows[megablocks][1]) > 0


def test_prefill_tiny() -> None:
    """Both models at every batch, median and best wall times positive, the dense row the unit."""
    rows = table_rows(run("-m", "bench.prefill", "--tiny"))
    assert [(r[1], r[2]) for r in rows] == [("1", "dense"), ("1", "MoD"), ("4", "dense"), ("4", "MoD")]
    assert all(number(r[3]) > 0 and number(r[4]) > 0 and number(r[4]) <= number(r[3]) for r in rows)
    assert all(number(r[8]) == 1.0 for r in rows if r[2] == "dense")
    # the target, the FLOP ratio (0.565 at 16 tokens) x 1.15, at batch 1 only of the tiny batches
    assert [r[9] for r in rows] == ["-", f"<= 0.65 x: {'met' if number(rows[1][8]) <= 0.65 else 'missed'}", "-", "-"]


def test_generate_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    """Every model at every batch in the three loops and the whole calls, tokens/s positive, dense the unit of each
    column, and the read-ahead loop's gain over the read-first one; bad flags refused by name."""
    rows = table_rows(run("-m", "bench.generate", "--tiny", "--temperature", "0.8", "--top-k", "20"))
    assert [(r[1], r[2]) for r in rows] == [(b, m) for b in ("1", "4") for m in ("dense", "MoD", "Staged MoDE")]
    for r in rows:
        assert (r[3] == "-") if r[2] == "dense" else 0 <= number(r[3]) <= 1, r  # the routed share
        rates = [number(cell.split(" (")[0]) for cell in r[4:9]]
        ratios = [number(cell.split(" (")[1].rstrip(")")) for cell in r[4:9]]
        assert all(rate > 0 for rate in rates) and all(ratio > 0 for ratio in ratios), r
        assert r[2] != "dense" or ratios == [1.0] * 5, r
        # the gain from the unrounded rates: within the printed rates' rounding (0.5) and its own
        ahead, first = rates[2], rates[1]
        assert (ahead - 0.5) / (first + 0.5) - 0.005 <= number(r[9]) <= (ahead + 0.5) / (first - 0.5) + 0.005, r
    assert "--new-tokens must be at least 2" in refusal("generate", ["--tiny", "--new-tokens", "1"], capsys)
    assert "--top-k: top_k must be >= 0" in refusal("generate", ["--tiny", "--top-k", "-1"], capsys)


def test_conversion_tiny() -> None:
    """prepare -> a random Llama saved -> mode.hf import -> three runs from it -> evaluate: every row."""
    rows = table_rows(run("-m", "bench.conversion", "--tiny"))
    assert [(r[0], r[1]) for r in rows] == [("dense (unconverted)", "all"), ("MoD, all weights", "all"),
                                           ("MoD, routers only", "routers")]
    assert all(number(r[2]) > 0 and number(r[3]) > 0 and number(r[5]) > 0 and number(r[6]) > 0 for r in rows)
    assert len({r[5] for r in rows}) == 1  # one loss before: the imported model's


def test_scaling_tiny_on_two_gloo_processes() -> None:
    out = run("-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", "-m", "bench.scaling", "--tiny",
              "--profile", "1", "--train.device=cpu")  # CPU even where a GPU is (a one-GPU machine has no rank 1)
    rows = table_rows(out)
    assert len(rows) == 1 and rows[0][:2] == ["mode", "2"], out
    assert PROFILE_LINE.findall(out)[0][:2] == ("training steps on rank 0 of 2", "1")  # --profile 1: rank 0 only
    assert number(rows[0][2]) > 0 and number(rows[0][3]) > 0  # tokens/s, ms/step


def test_block_profile_tiny_compiled() -> None:
    """--compile: every block compiled, Integrated MoDE once per --noop-kinds kind; table 1 and the
    categories have the blocks' rows only, and --top lists each block's kernels."""
    out = run("-m", "bench.block_profile", "--tiny", "--compile", "--top", "2", "--kinds", "mode_integrated",
              "--noop-kinds", "zero", "copy")
    rows = table_rows(out)
    blocks = ["dense block", "MoD block", "mode_integrated block", "mode_integrated block, copy null experts"]
    assert [r[0] for r in rows[:8]] == blocks * 2 and rows[8][0].startswith("top-k"), out
    assert ("; compiled, bf16 autocast, bf16 matrices" if CUDA else "; compiled, float32, float32 matrices") in out
    assert all(len(r) == 5 and all(number(cell) > 0 for cell in r[1:]) for r in rows[:4])
    assert [number(r[-2]) for r in rows[6:8]] == [number(rows[6][-2])] * 2  # copy slots add no FLOPs
    assert "a [dense, MoD] pair: the host queues it in " in out, out
    assert re.findall(r"### (.*): the 2 costliest kernels", out) == blocks


def test_block_profile_noop_kinds_need_integrated_mode(capsys: pytest.CaptureFixture[str]) -> None:
    message = refusal("block_profile", ["--tiny", "--kinds", "moe", "--noop-kinds", "copy"], capsys)
    assert "--noop-kinds sets Integrated MoDE's no-op experts: name mode_integrated in --kinds" in message, message


def test_mod_step_modes_selects_modes(capsys: pytest.CaptureFixture[str]) -> None:
    """--modes keeps the named modes of those the run allows (--tiny: no torch.compile); naming
    none of them is an error, not an empty table."""
    rows = table_rows(run("-m", "bench.mod_step", "--tiny", "--modes", "eager", "compiled"))
    modes = ["eager"] + (["eager + CUDA graphs"] if CUDA else [])
    assert [r[:2] for r in rows] == [["eager", "dense"], ["eager", "MoD"]]
    message = refusal("mod_step", ["--tiny", "--modes", "compiled"], capsys)
    assert f"--modes compiled: not run here (this run times {', '.join(modes)};" in message, message


def test_block_profile_tiny() -> None:
    out = run("-m", "bench.block_profile", "--tiny", "--top", "3")
    rows = table_rows(out)
    assert [r[0] for r in rows[:4]] == ["dense block", "MoD block", "the block alone on k=8 tokens",
                                        "routing alone (route, gate, add back)"]
    assert all(len(r) == 5 and all(number(cell) > 0 for cell in r[1:]) for r in rows[:4])  # host ms too
    pair = re.search(r"the host queues it in ([\d.]+) ms for ([\d.]+) ms of kernels", out)
    assert pair and float(pair[1]) > 0 and float(pair[2]) > 0, out
    assert [r[0] for r in rows[4:6]] == ["dense block", "MoD block"]  # where their kernel time goes
    assert [r[0].split(",")[0] for r in rows[6:]] == [
        "top-k of 8 in (2", "sort the chosen positions", "sort the chosen positions", "top_k_positions",
        "top_k_positions as routers run it (CUDA: one Triton kernel)", "expert choice (2", "expert choice (2",
        "copy the float32 residual (128 x 32)"]
    assert all(number(r[1]) > 0 for r in rows[6:])


def test_block_profile_tiny_kinds() -> None:
    """--kinds: a row for each routed kind's block, and each block's kernel time split into
    categories that add up to its total, with its forward FLOPs over the dense block's."""
    kinds = ["moe", "mode_staged", "mode_integrated"]
    rows = table_rows(run("-m", "bench.block_profile", "--tiny", "--kinds", *kinds))
    names = ["dense block", "MoD block", *(f"{k} block" for k in kinds)]
    assert [r[0] for r in rows[4:7]] == names[2:]  # after table 1's own four rows
    split = {r[0]: [number(c) for c in r[1:]] for r in rows[7:12]}
    assert list(split) == names
    for name, (*categories, total, flop_ratio, per_flop) in split.items():
        assert sum(categories) == pytest.approx(total, abs=0.01) and total > 0 and per_flop > 0, name
    assert split["dense block"][-2:] == [1.0, 1.0]
    assert split["moe block"][-2] == pytest.approx(1.0, abs=0.05)  # expert choice at capacity 1: a dense FFN's FLOPs
    assert split["mode_staged block"][-2] < 0.5 and split["MoD block"][-2] < 0.5


def test_speed_targets_script_runs_every_part_tiny(tmp_path: Path) -> None:
    """bench/speed_targets.sh with TINY=1: each part runs its benchmark (--tiny; the compiled rows
    and the GPU tests say they need a GPU), writes its table into LOG_DIR/PART.md and ends with
    exit 0; PARTS picks parts, an unknown one is refused; DEADLINE starts none past it. The step
    parts time mode.train's own step unless OPTIMIZER says otherwise."""
    env = {**os.environ, "TINY": "1", "PYTHON": sys.executable, "LOG_DIR": str(tmp_path)}
    out = subprocess.run(["bash", "bench/speed_targets.sh"], cwd=ROOT, env=env, capture_output=True, text=True,
                         timeout=900)
    assert out.returncode == 0, out.stderr[-2000:]
    for part, header in (("decode", "| prompt | batch | model |"), ("decode_rows", "| 16 | 4 | MoD | gather"),
                         ("kinds", "| block kind |"), ("compiled", "on a GPU only"), ("step", "| mode | model |"),
                         ("train_configs", "| mode_integrated |"),
                         ("profile", "| block (forward+backward) |"), ("optimizer", "on a GPU only"),
                         ("prefill", "| prompt | batch | model | median ms |"),
                         ("row_ops", "on a GPU only"), ("decode_tests", "on a GPU only"), ("train_tests", "on a GPU only")):
        text = (tmp_path / f"{part}.md").read_text()
        assert text.rstrip().endswith(f"part {part}: exit 0") and header in text, (part, text[-1500:])
        if part in ("kinds", "step"):
            assert "the step's update: mode.train's" in text, (part, text[:1500])
        if part == "kinds":  # each kind's GPU busy time beside its step time
            assert "GPU busy per FLOP / dense" in text, text[:1500]
    unknown = subprocess.run(["bash", "bench/speed_targets.sh"], cwd=ROOT, env={**env, "PARTS": "kinds nonsense"},
                             capture_output=True, text=True, timeout=60)
    assert unknown.returncode == 2 and "unknown part nonsense" in unknown.stderr
    late = subprocess.run(["bash", "bench/speed_targets.sh"], cwd=ROOT, timeout=120, capture_output=True, text=True,
                          env={**env, "PARTS": "kinds", "DEADLINE": "0", "LOG_DIR": str(tmp_path / "late")})
    assert late.returncode == 0 and "not started (past DEADLINE)" in (tmp_path / "late" / "kinds.md").read_text()
