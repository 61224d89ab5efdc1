"""mode.evaluate: a trained run's checkpoint on validation batches, its folder left as it was."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mode.config import config_from_dict
from mode.data.meta import apply_metadata
from mode.evaluate import _point_at, evaluate_checkpoint, main
from mode.run_folder import METRICS
from mode.training.evaluation import validation_blocks
from mode.training.trainer import Trainer


def _train(out_dir: Path, corpus: Path | str, moe: dict | None = None, **routing: object) -> None:
    raw = {
        "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 32,
                  "block_pattern": ["dense", "mod"] if moe is None else ["dense", "moe"]},
        "routing": {"capacity": 0.25, **routing},
        "moe": moe or {},
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


def test_a_multi_process_token_choice_run_routes_each_process_rows_apart(tmp_path: Path, corpus: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Token choice's capacity and dropping are per process's micro-batch: evaluated in one process, a
    2-process run's global batch is routed as two blocks of rows, and the statistics pool as over
    processes (counts summed, shares averaged). Reference: each rank's evaluation on its own rows."""
    import mode.evaluate as evaluate

    run = tmp_path / "run"
    _train(run, corpus, moe={"n_experts": 4, "scheme": "token_choice", "top_k": 2, "capacity_factor": 1.0})
    monkeypatch.setattr(evaluate, "_processes", lambda payload: 2)
    result = evaluate_checkpoint(run, 3, "cpu")
    assert result["processes"] == 2 and result["tokens"] == 3 * 4 * 32
    from mode.checkpoint import load_checkpoint_file, model_from_payload

    payload = load_checkpoint_file(run)
    ranks = []
    for rank in range(2):
        model = model_from_payload(payload, str(run), torch.device("cpu"))
        model.config.train.out_dir, model.config.train.eval_batches = str(tmp_path / f"rank{rank}"), 3
        ranks.append(Trainer(model.config, model=model, rank=rank, world_size=2).evaluate())
    assert result["val_loss"] == pytest.approx(sum(r["val_loss"] for r in ranks) / 2, abs=1e-6)
    stats, rank_stats = result["routing"]["layer1.ffn"], [r["routing"]["layer1.ffn"] for r in ranks]
    assert stats["dropped_fraction"] == pytest.approx(sum(r["dropped_fraction"] for r in rank_stats) / 2, abs=1e-5)
    assert stats["tokens_per_expert"] == pytest.approx([a + b for a, b in zip(*(r["tokens_per_expert"] for r in rank_stats))],
                                                       abs=1e-4)
    assert stats["dropped_fraction"] > 0  # a capacity of exactly the balanced load: some rows dropped


def test_evaluate_refuses_an_empty_data_path_and_an_out_under_a_file_before_evaluating(
        tmp_path: Path, corpus: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    run = tmp_path / "run"
    _train(run, corpus)
    capsys.readouterr()
    assert main([str(run), "--data-path", ""]) == 2
    assert capsys.readouterr().err.strip() == "error: --data-path: empty; give the path of the run's text or token file"
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    import mode.evaluate as evaluate

    monkeypatch.setattr(evaluate, "evaluate_checkpoint", lambda *a: pytest.fail("evaluated before checking --out"))
    assert main([str(run), "--out", str(blocker / "eval.json")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {blocker / 'eval.json'}: cannot make its folder") and len(err.splitlines()) == 1
    # --out's folder is made once there is a result to write: a failed evaluation leaves none behind.
    def fails(*_):  # noqa: ANN202
        raise ValueError("no validation data")

    monkeypatch.setattr(evaluate, "evaluate_checkpoint", fails)
    assert main([str(run), "--out", str(tmp_path / "new" / "eval.json")]) == 2
    assert not (tmp_path / "new").exists()
    monkeypatch.setattr(evaluate, "evaluate_checkpoint", lambda *a: {"val_loss": 1.0})
    assert main([str(run), "--out", str(tmp_path / "new" / "eval.json")]) == 0
    assert json.loads((tmp_path / "new" / "eval.json").read_text()) == {"val_loss": 1.0}


def test_causal_share_of_a_staged_ffn_pools_over_batches(tmp_path: Path, corpus: Path) -> None:
    """Under causal routing a Staged MoDE FFN's share is of the tokens its depth router chose, whose
    number varies by batch: causal_processed weighs each batch by it (a mean of the batches' shares
    weighed a batch of few chosen tokens like one of many)."""
    raw = {
        "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 32,
                  "block_pattern": ["dense", "mode_staged"]},
        "routing": {"capacity": 0.5, "causal": "aux_loss"},
        "moe": {"n_experts": 2, "n_noop": 2, "scheme": "token_choice", "top_k": 1, "dropless": True},
        "data": {"source": "text", "path": str(corpus), "seq_len": 32},
        "train": {"batch_size": 2, "max_steps": 3, "warmup_steps": 1, "eval_interval": 3, "eval_batches": 4,
                  "checkpoint_interval": 3, "out_dir": str(tmp_path / "run"), "progress": False, "device": "cpu"},
    }
    trainer = Trainer(config_from_dict(raw))
    trainer.run()
    routing = trainer.evaluate()["routing"]
    depth, ffn = [], []
    with torch.no_grad():
        for i in range(4):
            x, y = next(validation_blocks(trainer, i))
            out = trainer.model(x, y, routing_mode="causal")
            depth.append(float(out.routings[1].stats["processed"]))
            ffn.append(float(out.ffn_routings[1].stats["processed"]))
    assert len(set(depth)) > 1  # the causal decision chose other numbers of tokens in other batches
    pooled = sum(f * d for f, d in zip(ffn, depth)) / sum(depth)
    assert routing["layer1.ffn"]["causal_processed"] == pytest.approx(pooled, abs=1e-5)
    assert routing["layer1"]["causal_processed"] == pytest.approx(sum(depth) / 4, abs=1e-5)


def test_out_never_names_a_file_of_the_run_or_any_checkpoint(tmp_path: Path, corpus: Path, capsys) -> None:
    """--out RUN/checkpoint.pt replaced the checkpoint with JSON. Every file a run writes in its folder,
    the checkpoint given (wherever it lies) and any other checkpoint are refused with one line, before
    the evaluation, and nothing changes; a new file in the run folder is written."""
    run, other = tmp_path / "run", tmp_path / "other"
    _train(run, corpus)
    _train(other, corpus)
    capsys.readouterr()
    before, other_before = _folder(run), _folder(other)
    refused = [run / name for name in ("checkpoint.pt", "config.yaml", "metrics.jsonl", "loss_vs_flops.png", ".lock")]
    for out, given in [*((path, run) for path in refused), (run / "checkpoint.pt", run / "checkpoint.pt"),
                       (other / "checkpoint.pt", run)]:
        assert main([str(given), "--batches", "1", "--device", "cpu", "--out", str(out)]) == 2
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err.startswith(f"error: --out {out}: is ") and \
            captured.err.count("\n") == 1, captured
    assert _folder(run) == before and _folder(other) == other_before
    assert main([str(run), "--batches", "1", "--device", "cpu", "--out", str(run / "eval.json")]) == 0
    assert json.loads((run / "eval.json").read_text())["batches"] == 1


def test_data_path_may_name_a_prepared_folder_of_the_models_vocabulary(tmp_path: Path, corpus: Path, capsys) -> None:
    """A run evaluated on another prepared folder of its vocabulary: that folder's validation
    tokens; a folder of another vocabulary is refused naming both sizes; a byte-level run's
    --data-path that is neither says what it may be."""
    from mode.data.prepare import main as data_main

    folders = {}
    for name, start, vocab in (("own", 0, "300"), ("other_text", 60000, "300"), ("other_vocab", 0, "320")):
        text = tmp_path / f"text_{name}"
        text.mkdir()
        for i in range(4):
            (text / f"part{i}.py").write_bytes(corpus.read_bytes()[start + i * 15000:start + (i + 1) * 15000])
        folders[name] = tmp_path / name
        assert data_main(["prepare", "--out", str(folders[name]), "--path", str(text), "--train-bpe",
                          "--vocab-size", vocab, "--val-fraction", "0.5"]) == 0
    run = tmp_path / "run"
    raw = {"model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 32},
           "data": {"source": "tokens", "path": str(folders["own"]), "seq_len": 32},
           "train": {"batch_size": 2, "max_steps": 2, "warmup_steps": 1, "eval_interval": 2, "eval_batches": 2,
                     "out_dir": str(run), "progress": False, "device": "cpu"}}
    config = config_from_dict(raw)
    apply_metadata(config)
    Trainer(config).run()
    own = evaluate_checkpoint(run, 2, "cpu")
    other = evaluate_checkpoint(run, 2, "cpu", str(folders["other_text"]))
    assert other["val_loss"] > 0 and other["val_loss"] != own["val_loss"]
    capsys.readouterr()
    assert main([str(run), "--batches", "2", "--data-path", str(folders["other_vocab"])]) == 2
    err = capsys.readouterr().err
    assert "--data-path: model.vocab_size is 300" in err and "vocab_size 320" in err, err
    with pytest.raises(ValueError, match="give a folder written by python -m mode.data prepare"):
        _point_at(config_from_dict({}), str(tmp_path / "nowhere"))  # a stdlib run
    stdlib = config_from_dict({"model": {"vocab_size": 300}, "data": {"seq_len": 16}})
    _point_at(stdlib, str(folders["other_text"]))  # a byte-level (stdlib) run's config onto a prepared folder
    assert (stdlib.data.source, stdlib.data.path, stdlib.data.val_fraction) == ("tokens", str(folders["other_text"]), 0.5)


def test_validation_batches_do_not_depend_on_the_seed(tmp_path: Path, corpus: Path) -> None:
    """Runs that differ in train.seed train on other batches but are judged on the same sequences,
    so a sweep's seeds and variants are compared pairwise."""
    def trainer(seed: int) -> Trainer:
        raw = {
            "model": {"vocab_size": 256, "d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 32},
            "data": {"source": "text", "path": str(corpus), "seq_len": 32},
            "train": {"batch_size": 2, "max_steps": 2, "seed": seed, "out_dir": str(tmp_path / f"run{seed}"),
                      "progress": False, "device": "cpu"},
        }
        return Trainer(config_from_dict(raw))

    a, b = trainer(0), trainer(1)
    for i in range(3):
        (xa, ya), (xb, yb) = next(validation_blocks(a, i)), next(validation_blocks(b, i))
        assert torch.equal(xa, xb) and torch.equal(ya, yb)
    assert not torch.equal(a.micro_batch(a.data.train, 0, 0)[0], b.micro_batch(b.data.train, 0, 0)[0])


def test_several_runs_in_one_process_save_into_their_folders(tmp_path: Path, corpus: Path, capsys) -> None:
    """--save NAME writes each run's result into its folder; a run that fails is reported, the others
    still written, and the exit status says one failed. --out is one file: refused with several runs."""
    runs = [tmp_path / "run0", tmp_path / "run1"]
    _train(runs[0], corpus)
    _train(runs[1], corpus, capacity=0.5)
    capsys.readouterr()  # the training runs' own lines
    broken = tmp_path / "broken"
    broken.mkdir()
    assert main([str(runs[0]), str(broken), str(runs[1]), "--batches", "2", "--device", "cpu", "--save", "eval.json"]) == 2
    captured = capsys.readouterr()
    assert len([line for line in captured.err.splitlines() if line.startswith("error:")]) == 1
    for run in runs:
        saved = json.loads((run / "eval.json").read_text())
        alone = evaluate_checkpoint(run, 2, "cpu")
        assert saved["val_loss"] == pytest.approx(alone["val_loss"], abs=1e-6) and saved["batches"] == 2
    assert not (broken / "eval.json").exists()
    with pytest.raises(SystemExit):
        main([str(runs[0]), str(runs[1]), "--out", str(tmp_path / "one.json")])
    assert main([str(runs[0]), "--save", "metrics.jsonl", "--device", "cpu"]) == 2  # a run's own file is refused
    assert "error: --save" in capsys.readouterr().err
