"""mode.report: comparing run folders. Two real tiny runs end to end, then the pieces on written
folders: the isoFLOP interpolation, the differing fields, cut-short and malformed metrics, errors."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from mode.config import config_from_dict, load_config, save_config
from mode.model import LanguageModel
from mode.report import (
    ReportError,
    differing_fields,
    load_run,
    main,
    report,
    routing_means,
    val_loss_at,
)
from mode.run_folder import METRICS
from mode.training.trainer import Trainer


def _train(out_dir: Path, corpus: Path, capacity: float) -> None:
    raw = {
        "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 32,
                  "block_pattern": ["dense", "mod"]},
        "routing": {"capacity": capacity},
        "data": {"source": "text", "path": str(corpus), "seq_len": 32},
        "train": {"batch_size": 2, "max_steps": 4, "warmup_steps": 1, "log_interval": 1, "eval_interval": 2,
                  "eval_batches": 1, "checkpoint_interval": 100, "out_dir": str(out_dir), "progress": False,
                  "device": "cpu"},
    }
    Trainer(config_from_dict(raw)).run()


def _metrics(path: Path) -> list[dict]:
    return [json.loads(line) for line in (path / METRICS).read_text().splitlines()]


def test_report_of_two_runs(tmp_path: Path, corpus: Path) -> None:
    a, b = tmp_path / "cap25", tmp_path / "cap50"
    _train(a, corpus, 0.25)
    _train(b, corpus, 0.5)
    out = tmp_path / "report"
    table = report([a, b], out)

    summary = json.loads((out / "report.json").read_text())
    assert summary["differing_fields"] == ["routing.capacity"]  # out_dir differs too, but names the run
    evals = {p.name: [r for r in _metrics(p) if "val_loss" in r] for p in (a, b)}
    budget = min(e[-1]["flops"] for e in evals.values())
    assert summary["common_flops_budget"] == budget
    assert evals["cap25"][-1]["flops"] < evals["cap50"][-1]["flops"]  # fewer tokens routed: fewer FLOPs
    for row in summary["runs"]:
        run_evals = evals[row["run"]]
        assert row["val_loss"] == run_evals[-1]["val_loss"]
        assert row["best_val_loss"] == min(r["val_loss"] for r in run_evals)
        assert row["steps"] == 4
        assert row["tokens_per_step"] == 2 * 32  # batch 2 x seq 32, one process
        assert row["processes"] == 1
        assert row["parameters"] == LanguageModel(load_run(Path(row["path"])).config).num_parameters()
        assert row["routing"]["depth_processed"] == pytest.approx(float(row["run"][3:]) / 100, abs=0.02)  # cap25, cap50
    at_budget = {row["run"]: row["val_loss_at_budget"] for row in summary["runs"]}
    assert at_budget["cap25"] == evals["cap25"][-1]["val_loss"]  # its last evaluation is the budget
    e0, e1 = evals["cap50"]  # the other run's two evaluations bracket the budget
    assert e0["flops"] <= budget <= e1["flops"]
    assert min(e0["val_loss"], e1["val_loss"]) <= at_budget["cap50"] <= max(e0["val_loss"], e1["val_loss"])
    assert (out / "val_loss_vs_flops.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert (out / "report.md").read_text().strip() == table
    lines = table.splitlines()
    assert lines[0].startswith("| run | routing.capacity |")
    assert lines[2].startswith("| cap25 | 0.25 |") and lines[3].startswith("| cap50 | 0.5 |")


def _run_folder(path: Path, lines: list[str], **overrides: str) -> Path:
    """A run folder written by hand: the default config (with overrides) and these metrics lines."""
    path.mkdir(parents=True)
    config = load_config(None, [f"--{k.replace('__', '.')}={v}" for k, v in overrides.items()])
    save_config(config, path / "config.yaml")
    (path / METRICS).write_text("".join(line + "\n" for line in lines))
    return path


def _eval(step: int, flops: float, val_loss: float) -> str:
    return json.dumps({"step": step, "flops": flops, "val_loss": val_loss, "routing": {}})


def test_val_loss_at_interpolates_in_flops() -> None:
    evals = [{"flops": 10.0, "val_loss": 3.0}, {"flops": 20.0, "val_loss": 2.0}, {"flops": 40.0, "val_loss": 1.0}]
    assert val_loss_at(evals, 15.0) == pytest.approx(2.5, abs=1e-12)
    assert val_loss_at(evals, 30.0) == pytest.approx(1.5, abs=1e-12)
    assert val_loss_at(evals, 10.0) == 3.0 and val_loss_at(evals, 40.0) == 1.0
    assert val_loss_at(evals, 5.0) is None and val_loss_at(evals, 41.0) is None
    assert val_loss_at(evals[:1], 10.0) == 3.0


def test_differing_fields_names_nested_and_list_fields() -> None:
    base = load_config(None)
    other = load_config(None, ["--model.block_pattern=[dense, moe]", "--moe.n_experts=4", "--train.out_dir=x"])
    assert differing_fields([base, other]) == ["model.block_pattern", "moe.n_experts"]
    assert differing_fields([base, load_config(None)]) == []


def test_cut_short_last_line_is_left_out_with_a_note(tmp_path: Path) -> None:
    run = _run_folder(tmp_path / "r", [_eval(1, 1.0, 3.0), _eval(2, 2.0, 2.5), '{"step": 3, "flo'])
    loaded = load_run(run)
    assert [r["step"] for r in loaded.evals] == [1, 2]
    assert "line 3 is incomplete" in loaded.notes[0]
    assert "note:" in report([run])


def test_malformed_line_before_the_last_names_file_and_line(tmp_path: Path) -> None:
    run = _run_folder(tmp_path / "r", [_eval(1, 1.0, 3.0), '{"step": 2}', _eval(3, 3.0, 2.0)])
    with pytest.raises(ReportError, match=rf"{METRICS}: line 2: no numeric 'flops'"):
        load_run(run)
    run = _run_folder(tmp_path / "s", ["not json", _eval(2, 2.0, 2.0)])
    with pytest.raises(ReportError, match="line 1"):
        load_run(run)


def test_bad_folders_and_out_are_clear_errors(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(tmp_path / "missing")]) == 2
    assert "missing: not a folder" in capsys.readouterr().err
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main([str(empty)]) == 2
    assert "config.yaml: not found" in capsys.readouterr().err
    bad = _run_folder(tmp_path / "bad", [_eval(1, 1.0, 3.0)])
    (bad / "config.yaml").write_text("model:\n  d_model: 64\n  colour: red\n")
    assert main([str(bad)]) == 2
    assert "model.colour: unknown key" in capsys.readouterr().err
    good = _run_folder(tmp_path / "good", [_eval(1, 1.0, 3.0)])
    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("keep me")
    assert main([str(good), "--out", str(not_a_folder)]) == 2
    assert "exists and is not a folder" in capsys.readouterr().err
    assert not_a_folder.read_text() == "keep me"


def test_runs_of_one_name_are_named_by_path(tmp_path: Path) -> None:
    a = _run_folder(tmp_path / "a" / "run", [_eval(1, 1.0, 3.0)])
    b = _run_folder(tmp_path / "b" / "run", [_eval(1, 1.0, 2.0)], train__lr=0.01)
    table = report([a, b])
    assert f"| {a} |" in table and f"| {b} |" in table


def test_runs_from_several_seeds_are_averaged_per_setting(tmp_path: Path) -> None:
    """Runs differing in train.seed and agreeing in every other differing field are one setting: its
    mean and sample standard deviation over the seeds, in a second table and in report.json."""
    runs = [
        _run_folder(tmp_path / "c25-s0", [_eval(2, 2.0, 3.0), _eval(4, 4.0, 2.0)], routing__capacity=0.25, train__seed=0),
        _run_folder(tmp_path / "c25-s1", [_eval(2, 2.0, 3.4), _eval(4, 4.0, 2.4)], routing__capacity=0.25, train__seed=1),
        _run_folder(tmp_path / "c50-s0", [_eval(2, 2.0, 2.8), _eval(4, 4.0, 1.5)], routing__capacity=0.5, train__seed=0),
    ]
    out = tmp_path / "report"
    table = report(runs, out)
    summary = json.loads((out / "report.json").read_text())
    assert summary["differing_fields"] == ["routing.capacity", "train.seed"]
    c25, c50 = summary["seed_groups"]
    assert c25["setting"] == {"routing.capacity": 0.25} and c25["seeds"] == [0, 1]
    assert c25["runs"] == ["c25-s0", "c25-s1"]
    assert c25["val_loss"]["n"] == 2 and c25["val_loss"]["mean"] == pytest.approx(2.2)
    assert c25["val_loss"]["std"] == pytest.approx(0.4 / 2**0.5)  # sample std of 2.0 and 2.4
    assert c25["best_val_loss"]["mean"] == pytest.approx(2.2)
    assert c50["seeds"] == [0] and c50["val_loss"] == {"n": 1, "mean": 1.5, "std": None}
    seed_lines = table.split("Over seeds")[1].strip().splitlines()
    assert seed_lines[2].startswith("| setting | routing.capacity | seeds | val loss |"), seed_lines
    assert seed_lines[4].startswith("| 1 | 0.25 | 0, 1 | 2.2000 ± 0.2828 |"), seed_lines
    assert seed_lines[5].startswith("| 2 | 0.5 | 0 | 1.5000 |"), seed_lines
    # one run per setting: no second table
    assert "Over seeds" not in report([runs[0], runs[2]])


def test_seed_groups_ignore_how_runs_ran_and_count_missing_values(tmp_path: Path) -> None:
    """Seeds of one setting stay one setting when a resume changed how a run ran (eval_interval);
    a seed with no evaluation yet is counted out, and the cell says how many seeds it averages."""
    a = _run_folder(tmp_path / "s0", [_eval(2, 2.0, 3.0)], train__seed=0)
    b = _run_folder(tmp_path / "s1", [_eval(2, 2.0, 3.2)], train__seed=1, train__eval_interval=7)
    c = _run_folder(tmp_path / "s2", [json.dumps({"step": 1, "flops": 1.0, "loss": 4.0, "routing": {}})], train__seed=2)
    table = report([a, b, c])
    lines = table.split("Over seeds")[1].strip().splitlines()
    assert lines[2].startswith("| setting | seeds | val loss |"), lines  # eval_interval is no setting field
    assert lines[4].startswith("| 1 | 0, 1, 2 | 3.1000 ± 0.1414 (2 of 3) |"), lines
    other = _run_folder(tmp_path / "lr", [_eval(2, 2.0, 3.0)], train__seed=5, train__lr=0.01)
    assert "note: no seed table: train.seed differs, but no two runs agree" in report([a, other])


def test_a_seed_run_twice_counts_once_in_the_seed_table(tmp_path: Path) -> None:
    """Seed 0 plain and seed 0 compiled are one sample of the setting, not two: the second is left out of
    the mean and spread, with a note naming it."""
    a = _run_folder(tmp_path / "s0", [_eval(2, 2.0, 3.0)], train__seed=0)
    again = _run_folder(tmp_path / "s0-compiled", [_eval(2, 2.0, 3.1)], train__seed=0, train__compile=True)
    b = _run_folder(tmp_path / "s1", [_eval(2, 2.0, 3.4)], train__seed=1)
    table = report([a, again, b])
    lines = table.split("Over seeds")[1].strip().splitlines()
    assert lines[4].startswith("| 1 | 0, 1 | 3.2000 ± 0.2828 |"), lines
    assert "note: left out of the seed table, each a seed its setting already has" in table and "s0-compiled" in table


def test_seeds_run_on_other_process_counts_are_other_settings(tmp_path: Path) -> None:
    """The process count multiplies the global batch but is no config field: seeds of one config on
    1 and on 2 processes are two settings, with a processes column, never averaged together."""
    def train_line(processes: int) -> str:
        return json.dumps({"step": 2, "flops": 2.0, "loss": 4.0, "tokens": 128 * processes, "processes": processes})

    runs = [_run_folder(tmp_path / f"p{p}-s{seed}", [train_line(p), _eval(2, 2.0, 3.0 + seed + p)], train__seed=seed)
            for p in (1, 2) for seed in (0, 1)]
    lines = report(runs).split("Over seeds")[1].strip().splitlines()
    assert lines[2].startswith("| setting | processes | seeds | val loss |"), lines
    assert lines[4].startswith("| 1 | 1 | 0, 1 | 4.5000 ± 0.7071 |"), lines
    assert lines[5].startswith("| 2 | 2 | 0, 1 | 5.5000 ± 0.7071 |"), lines


def test_routing_columns_are_shares_of_all_tokens_for_every_kind() -> None:
    """Depth routers and expert routers report apart; a Staged MoDE FFN's shares (over the tokens its
    depth router chose) are scaled to all tokens, so it reads like Integrated MoDE's."""
    staged = {"routing": {"layer1": {"processed": 0.25}, "layer1.ffn": {"processed": 0.4, "noop_fraction": 0.6},
                          "layer3": {"processed": 0.25}, "layer3.ffn": {"processed": 0.5, "noop_fraction": 0.5}}}
    assert routing_means(staged) == pytest.approx(
        {"depth_processed": 0.25, "expert_processed": 0.1125, "noop_fraction": 0.1375})
    integrated = {"routing": {"layer1.ffn": {"processed": 0.4, "noop_fraction": 0.6, "dropped_fraction": 0.0}}}
    assert routing_means(integrated) == {"expert_processed": 0.4, "noop_fraction": 0.6, "dropped_fraction": 0.0}
    assert routing_means({"routing": {"layer1": {"processed": 0.125}}}) == {"depth_processed": 0.125}
    assert routing_means(None) == {}


def test_out_under_a_file_is_one_error_line(tmp_path: Path, capsys) -> None:
    run = _run_folder(tmp_path / "a", [_eval(2, 2.0, 3.0)])
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    assert main([str(run), "--out", str(blocker / "report")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {blocker / 'report'}: cannot write there") and len(err.splitlines()) == 1
    assert blocker.read_text() == "x"
