"""bench/decode.py: its CPU smoke run prints every row kind, and its checks (what fits the device,
the Decoder keywords it passes through) say what they promise. Timings are never asserted."""
from __future__ import annotations

import argparse

import pytest

from tests.test_bench import bench_module, number, run, table_rows

MODELS = ["dense", "MoD", "Staged MoDE"]


def main_rows(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[list[str]]:
    """bench.decode's table, run in this process (no interpreter start-up)."""
    bench_module("decode").main(argv)
    return table_rows(capsys.readouterr().out)


def test_decode_tiny() -> None:
    """Every model at every (prompt, batch) of the smoke run, with positive decode and prefill
    numbers, dense the unit of both ratios and a verdict on each routed row's targets."""
    out = run("-m", "bench.decode", "--tiny")
    assert "torch " in out and "CPU" in out  # the card and torch version
    rows = table_rows(out)
    assert [(r[0], r[1], r[2]) for r in rows] == [("16", b, m) for b in ("1", "4") for m in MODELS]
    for r in rows:
        assert number(r[4]) > 0 and number(r[7]) > 0  # decode tokens/s, prefill ms
        if r[2] == "dense":
            assert number(r[5]) == 1.0 and number(r[8]) == 1.0 and number(r[9]) == 1.0
            assert r[10] == r[11] == "-"
        else:
            assert 0 < number(r[6]) <= 1  # routed share
            assert 0 < number(r[9]) < 1  # fewer FLOPs than dense
            assert r[10].startswith(">= 0.97 x: ") and r[10].endswith(("met", "missed"))
    assert [r[11] == "-" for r in rows if r[2] != "dense"] == [False, False, True, True]  # targets at batch 1 and 64 only


def test_setting_that_does_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    """A memory budget smaller than a setting's estimate: its rows say so and nothing runs."""
    rows = main_rows(["--tiny", "--batches", "1", "--memory-gib", "1e-6"], capsys)
    assert [r[2] for r in rows] == MODELS
    assert all(r[3].startswith("does not fit (") and r[4] == "-" for r in rows)


def test_fits_check() -> None:
    decode = bench_module("decode")
    args = argparse.Namespace(width=1024, heads=16, layers=12, ffn=2816, new_tokens=64)
    gib = 2**30
    big = decode.setting_bytes(args, 1024, 2048, 2)
    assert big > 100 * gib  # 12 layers' caches of 1024 rows x 2113 slots x 2 x 1024 bf16
    assert decode.does_not_fit(big, 80 * gib).startswith(f"does not fit ({big / gib:.0f} GiB")
    assert decode.does_not_fit(decode.setting_bytes(args, 64, 128, 2), 80 * gib) is None
    assert decode.does_not_fit(big, None) is None  # CPU: no limit known


def test_decoder_args_pass_through(capsys: pytest.CaptureFixture[str]) -> None:
    """--decoder-arg reaches every decode run's Decoder; a keyword it refuses (a CUDA graph on CPU)
    makes the rows say why instead of stopping the run."""
    decode = bench_module("decode")
    assert decode.parse_decoder_args(["cuda_graph=False", "routed_rows=masked", "compile=True"]) == {
        "cuda_graph": False, "routed_rows": "masked", "compile": True}
    with pytest.raises(ValueError, match="key=value"):
        decode.parse_decoder_args(["cuda_graph"])
    rows = main_rows(["--tiny", "--batches", "1", "--decoder-arg", "cuda_graph=True"], capsys)
    assert [r[2] for r in rows] == MODELS
    assert all(r[3].startswith("not run: cuda_graph=True needs") for r in rows)


def test_decoder_arg_overrides_a_named_option(capsys: pytest.CaptureFixture[str]) -> None:
    """A --decoder-arg naming one of the script's own Decoder keywords wins over it."""
    rows = main_rows(["--tiny", "--batches", "1", "--routed-rows", "gather", "--decoder-arg", "routed_rows=masked"],
                     capsys)
    assert [(r[2], r[3]) for r in rows] == [(m, "masked") for m in MODELS]


def test_decode_profile_tiny(capsys: pytest.CaptureFixture[str]) -> None:
    """--profile: per model, the aten ops of each layer kind's call per decode step; its decoders
    take more steps than --new-tokens, and the models are built long enough for them."""
    bench_module("decode").main(["--tiny", "--profile", "--batches", "1", "--models", "MoD", "--profile-steps", "12"])
    out = capsys.readouterr().out
    assert "dense, prompt 16, batch 1: per decode step (12 steps profiled)" in out
    routed = [r for r in table_rows(out) if r[0] == "routed layer"]
    assert len(routed) == 1 and number(routed[0][1]) > 0 and number(routed[0][2]) > 0, out


def test_decode_targets_per_setting() -> None:
    """The decode targets: 1.4 x at batch 1 and 1024 with 128 tokens, 1.6 x at batch 64 with 2048,
    0.97 x elsewhere, none at batch 64 with 128 tokens (bound by reading weights: reported)."""
    decode = bench_module("decode")
    targets = {(b, p): decode.decode_target(b, p) for b in (1, 64, 1024) for p in (128, 2048)}
    assert targets == {(1, 128): 1.4, (1, 2048): 0.97, (64, 128): None, (64, 2048): 1.6,
                       (1024, 128): 1.4, (1024, 2048): 0.97}
