"""mode.evaluate: a trained run's checkpoint on validation batches, its folder left as it was."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mode.config import config_from_dict
from mode.evaluate import evaluate_checkpoint, main
from mode.train import METRICS, Trainer


def _train(out_dir: Path, corpus: Path | str, **routing: object) -> None:
    raw = {
        "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 32,
                  "block_pattern": ["dense", "mod"]},
        "routing": {"capacity": 0.25, **routing},
        "data": {"source": "text", "path": str(corpus), "seq_len": 32},
        "train": {"batch_size": 2, "max_steps": 4, "warmup_steps": 1, "log_interval": 1, "eval_interval": 4,
                  "eval_batches": 3, "checkpoint_interval": 4, "out_dir": str(out_dir), "progress": False,
                  "device": "cpu"},
    }
    Trainer(config_from_dict(raw)).run()


def _folder(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir())}


def test_evaluation_repeats_the_runs_own_and_leaves_its_folder_alone(tmp_path: Path, corpus: Path) -> None:
    run = tmp_path / "run"
    _train(run, corpus, causal="aux_loss")
    before = _folder(run)
    last = [json.loads(line) for line in (run / METRICS).read_text().splitlines() if "val_loss" in line][-1]
    same = evaluate_checkpoint(run, 3, "cpu")  # the run's own evaluation: its batches, its weights
    assert same["step"] == 4 and same["tokens"] == 3 * 2 * 32
    assert same["val_loss"] == last["val_loss"] and same["val_loss_causal"] == last["val_loss_causal"]
    assert same["routing"] == last["routing"]
    more = evaluate_checkpoint(run / "checkpoint.pt", 12, "cpu")  # more batches: another estimate
    assert more["batches"] == 12 and more["val_loss"] != same["val_loss"]
    assert abs(more["val_loss"] - same["val_loss"]) < 0.5
    assert _folder(run) == before


def test_command_line_prints_writes_and_refuses_bad_input(tmp_path: Path, corpus: Path, capsys) -> None:
    run = tmp_path / "run"
    _train(run, corpus)
    capsys.readouterr()  # the training run's own lines
    out = tmp_path / "eval.json"
    assert main([str(run), "--batches", "2", "--device", "cpu", "--out", str(out)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(out.read_text()) and printed["batches"] == 2
    assert main([str(run), "--batches", "0"]) == 2
    assert "--batches 0: must be at least 1" in capsys.readouterr().err
    assert main([str(tmp_path / "missing")]) == 2
    assert "checkpoint not found" in capsys.readouterr().err
    not_a_checkpoint = tmp_path / "x.pt"
    not_a_checkpoint.write_text("hello")
    assert main([str(not_a_checkpoint)]) == 2
    assert "is not a readable checkpoint" in capsys.readouterr().err


def test_data_path_finds_moved_data_and_out_must_be_a_file(tmp_path: Path, corpus: Path, capsys) -> None:
    data = tmp_path / "data.txt"
    data.write_bytes(corpus.read_bytes())
    run = tmp_path / "run"
    _train(run, data)
    last = [json.loads(line) for line in (run / METRICS).read_text().splitlines() if "val_loss" in line][-1]
    moved = data.rename(tmp_path / "moved.txt")
    capsys.readouterr()
    assert main([str(run), "--batches", "3"]) == 2
    assert "data.txt" in capsys.readouterr().err  # the path it looked for
    assert evaluate_checkpoint(run, 3, "cpu", str(moved))["val_loss"] == last["val_loss"]
    with pytest.raises(SystemExit):
        main([str(run), "--out", str(tmp_path)])
    assert "is a folder" in capsys.readouterr().err


def test_random_routing_repeats_the_runs_own_evaluation(tmp_path: Path, corpus: Path) -> None:
    """routing.random draws from the generators: evaluation starts them where the checkpoint saved them,
    which is where the run's own last evaluation found them."""
    run = tmp_path / "run"
    _train(run, corpus, random=True)
    last = [json.loads(line) for line in (run / METRICS).read_text().splitlines() if "val_loss" in line][-1]
    assert evaluate_checkpoint(run, 3, "cpu")["val_loss"] == last["val_loss"]


def test_a_run_compiled_with_cuda_graphs_evaluates_eager(tmp_path: Path, corpus: Path) -> None:
    """A checkpoint whose config says compile=true, compile_mode=reduce-overhead (the README's GPU recipe)
    evaluates eager: its train fields are switched off in an order each assignment's check accepts."""
    import torch

    run = tmp_path / "run"
    _train(run, corpus)
    payload = torch.load(run / "checkpoint.pt", weights_only=False)
    payload["config"]["train"].update(compile=True, compile_mode="reduce-overhead")
    torch.save(payload, run / "checkpoint.pt")
    result = evaluate_checkpoint(run, 3, "cpu")
    last = [json.loads(line) for line in (run / METRICS).read_text().splitlines() if "val_loss" in line][-1]
    assert result["val_loss"] == last["val_loss"]
