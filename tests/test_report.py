"""mode.report: comparing run folders. Two real tiny runs end to end, then the pieces on written
folders: the isoFLOP interpolation, the differing fields, cut-short and malformed metrics, errors.
Then the plots (isoFLOP curves, loss vs time, causal accuracy, position shares) and the routing map
on tiny dense and MoD runs, each plot's numbers asserted, and their errors."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from mode.checkpoint import load_model
from mode.config import config_from_dict, load_config, save_config
from mode.evaluate import evaluate_checkpoint
from mode.flops import train_step_flops
from mode.model import LanguageModel
from mode.report import (
    ReportError,
    Run,
    differing_fields,
    load_run,
    main,
    report,
    routing_means,
    val_loss_at,
)
from mode.report.compare import setting_colors, setting_labels, summarize
from mode.report.plots import (
    causal_series,
    final_loss,
    isoflop_curves,
    isoflop_points,
    position_shares,
    time_series,
)
from mode.report.routing_map import CAUSAL, TOPK, encode, make_map
from mode.routing.selection import capacity_to_k
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


# ----------------------------------------------------------------------------- the plots
PNG = b"\x89PNG\r\n\x1a\n"


def _tiny(config_file: str, out_dir: Path, corpus: Path, d_model: int, budget: float | None, seed: int = 0) -> Path:
    """configs/<config_file> shrunk to seconds on CPU: 2 layers of width d_model, sequences of 32 bytes
    of the corpus, trained to `budget` training FLOPs (evaluated every 2 steps and at the end)."""
    overrides = [f"--model.d_model={d_model}", f"--model.d_ff={2 * d_model}", "--model.n_layers=2",
                 "--model.n_heads=2", "--model.max_seq_len=32", "--data.source=text", f"--data.path={corpus}",
                 "--data.seq_len=32", "--train.batch_size=2", "--train.warmup_steps=1", "--train.log_interval=1",
                 "--train.eval_interval=2", "--train.eval_batches=1", "--train.checkpoint_interval=100",
                 "--train.progress=false", "--train.device=cpu", f"--train.seed={seed}", f"--train.out_dir={out_dir}"]
    if budget is not None:
        overrides.append(f"--train.flops_budget={budget}")
    Trainer(load_config(Path(__file__).parents[1] / "configs" / config_file, overrides)).run()
    return out_dir


@pytest.fixture(scope="module")
def isoflop_runs(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> dict[str, Path]:
    """dense and MoD (configs/dense_tiny.yaml, mod_tiny.yaml) at two widths, all to one FLOP budget:
    five steps of the smaller dense model."""
    root = tmp_path_factory.mktemp("isoflop")
    small = load_config(Path(__file__).parents[1] / "configs" / "dense_tiny.yaml",
                        ["--model.d_model=32", "--model.d_ff=64", "--model.n_layers=2", "--data.seq_len=32",
                         "--train.batch_size=2"])
    budget = 5 * train_step_flops(small)
    return {f"{kind}{width}": _tiny(f"{kind}_tiny.yaml", root / f"{kind}{width}", corpus, width, budget)
            for kind in ("dense", "mod") for width in (32, 48)}


def test_isoflop_points_are_each_runs_final_loss_and_size(isoflop_runs: dict[str, Path]) -> None:
    runs = [load_run(p) for p in isoflop_runs.values()]
    points, notes = isoflop_points(runs)
    assert notes == []
    by_run = {p["run"]: p for p in points}
    assert set(by_run) == set(isoflop_runs)
    for name, path in isoflop_runs.items():
        run = load_run(path)
        assert by_run[name]["loss"] == run.evals[-1]["val_loss"]  # no mode.evaluate result: the last evaluation
        assert by_run[name]["parameters"] == LanguageModel(run.config).num_parameters()
        assert by_run[name]["budget"] == run.config.train.flops_budget
    # routing fields name MoD's curve, not the dense model's, which no router reads
    assert {p["curve"] for p in points} == {"dense", "mod causal=aux_loss"}
    curves = isoflop_curves(points)
    assert [(c["curve"], [q["runs"] for q in c["points"]]) for c in curves] == [
        ("dense", [["dense32"], ["dense48"]]), ("mod causal=aux_loss", [["mod32"], ["mod48"]])]
    for c in curves:
        assert c["optimum"] == min(c["points"], key=lambda q: q["loss"])["parameters"]


def test_report_out_writes_every_plot_with_its_numbers(isoflop_runs: dict[str, Path], tmp_path: Path) -> None:
    out = tmp_path / "report"
    assert main([*map(str, isoflop_runs.values()), "--out", str(out)]) == 0
    for name in ("val_loss_vs_flops.png", "isoflop.png", "loss_vs_time.png", "causal_accuracy.png",
                 "position_share.png"):
        assert (out / name).read_bytes()[:8] == PNG, name
    tables = json.loads((out / "report.json").read_text())["plots"]
    assert len(tables["isoflop"]["points"]) == 4
    assert set(tables["causal"]) == {"mod32", "mod48"}  # dense runs have no causal decision
    assert set(tables["loss_vs_time"]) == set(isoflop_runs)
    assert set(tables["position_share"]) == {"mod32", "mod48"}
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))


def test_the_evaluate_result_in_a_run_folder_is_its_final_loss(isoflop_runs: dict[str, Path], tmp_path: Path) -> None:
    """mode.evaluate's --out file in the run folder, for the run's last step, is preferred to its last
    evaluation; one for another step, or any other JSON, is not."""
    run = tmp_path / "mod32"
    shutil.copytree(isoflop_runs["mod32"], run)
    loaded = load_run(run)
    last = loaded.evals[-1]["step"]
    (run / "notes.json").write_text(json.dumps({"val_loss": 0.1}))
    (run / "old.json").write_text(json.dumps({"checkpoint": str(run), "step": last - 1, "batches": 500, "val_loss": 0.2}))
    assert final_loss(loaded) == (loaded.evals[-1]["val_loss"], f"last evaluation (step {last})")
    assert summarize(loaded, None)["evaluated_loss"] is None
    result = evaluate_checkpoint(run, batches=3, device="cpu")
    (run / "eval.json").write_text(json.dumps(result))
    (run / "eval-few.json").write_text(json.dumps({**result, "batches": 1, "val_loss": 9.0}))
    assert final_loss(loaded) == (result["val_loss"], "eval.json (3 batches)")
    assert isoflop_points([loaded])[0][0]["loss"] == result["val_loss"]
    assert summarize(loaded, None)["evaluated_loss"] == result["val_loss"]  # the report table's "evaluated" column


def test_plot_labels_name_settings_by_the_fields_that_tell_them_apart(tmp_path: Path) -> None:
    """Legend labels: seeds share their setting's label; sizes varied together (d_model with n_heads)
    show as one field; max_steps, set by the budget, and execution fields are left out."""
    def run(name: str, width: int, heads: int, pattern: str, budget: str, steps: int, seed: int) -> Run:
        return load_run(_run_folder(tmp_path / name, [_eval(1, 1.0, 3.0)], model__d_model=width, model__n_heads=heads,
                                    model__block_pattern=pattern, train__flops_budget=budget, train__max_steps=steps,
                                    train__seed=seed, train__cuda_graphs="true" if seed else "false"))

    runs = [run("a0", 64, 2, "[dense]", "1e9", 10, 0), run("a1", 64, 2, "[dense]", "1e9", 10, 1),
            run("b0", 128, 4, "[dense,mod]", "1e9", 12, 0), run("c0", 128, 4, "[dense]", "3e9", 30, 0)]
    labels = setting_labels(runs)
    assert labels == {"a0": "d_model=64 block_pattern=dense flops_budget=1e+09",
                      "a1": "d_model=64 block_pattern=dense flops_budget=1e+09",
                      "b0": "d_model=128 block_pattern=dense-mod flops_budget=1e+09",
                      "c0": "d_model=128 block_pattern=dense flops_budget=3e+09"}
    assert len(set(setting_colors(labels).values())) == 3
    # runs differing in nothing but their seed keep their folder names
    assert setting_labels(runs[:2]) == {"a0": "a0", "a1": "a1"}


def test_isoflop_curves_average_seeds_and_split_budgets(tmp_path: Path) -> None:
    def point(run: str, budget: float, curve: str, parameters: int, loss: float) -> dict:
        return {"run": run, "budget": budget, "curve": curve, "parameters": parameters, "loss": loss}

    points = [point("a0", 2e9, "dense", 10, 3.0), point("a1", 2e9, "dense", 10, 3.4), point("b", 2e9, "dense", 20, 2.5),
              point("c", 1e9, "dense", 10, 3.5), point("d", 1e9, "mod", 10, 3.3)]
    curves = isoflop_curves(points)
    assert [(c["budget"], c["curve"]) for c in curves] == [(1e9, "dense"), (1e9, "mod"), (2e9, "dense")]
    seeds = curves[2]["points"][0]
    assert seeds["runs"] == ["a0", "a1"] and seeds["loss"] == pytest.approx(3.2)
    assert seeds["std"] == pytest.approx(0.4 / 2**0.5)
    assert curves[2]["optimum"] == 20 and curves[0]["points"][0]["std"] is None
    # runs without a budget are left out with a note; the table still reports them
    plain = _run_folder(tmp_path / "plain", [_eval(2, 2.0, 3.0)])
    assert isoflop_points([load_run(plain)]) == ([], ["plain: no train.flops_budget, left out of the isoFLOP curves"])


def test_series_over_training_are_the_metrics(isoflop_runs: dict[str, Path]) -> None:
    run = load_run(isoflop_runs["mod32"])
    times = time_series(run)
    assert [loss for _, loss in times["train"]] == [r["loss"] for r in run.train]
    assert [t for t, _ in times["val"]] == [r["elapsed_s"] for r in run.evals]
    assert all(a <= b for (a, _), (b, _) in zip(times["train"], times["train"][1:]))
    causal = causal_series(run)
    assert [s for s, _ in causal["train"]] == [r["step"] for r in run.train]
    assert causal["layers"]["layer1"] == [(r["step"], r["routing"]["layer1"]["causal_accuracy"]) for r in run.train]
    assert causal["train"] == causal["layers"]["layer1"]  # one router: its mean is its own
    assert causal["gap"] == [(r["step"], r["val_loss_causal"] - r["val_loss"]) for r in run.evals]
    assert all(0.0 <= acc <= 1.0 for _, acc in causal["val"])
    shares = position_shares(run)
    stats = run.evals[-1]["routing"]["layer1"]
    assert list(shares) == ["layer1"] and len(shares["layer1"]) == len(stats["position_share"])
    # bucket shares average to the layer's processed share (equal buckets)
    assert sum(shares["layer1"]) / len(shares["layer1"]) == pytest.approx(stats["processed"], rel=1e-3)
    assert causal["always_no"] == pytest.approx(1 - run.evals[-1]["routing"]["layer1"]["processed"])
    assert causal_series(load_run(isoflop_runs["dense32"])) == {"train": [], "val": [], "layers": {}, "gap": [],
                                                                "always_no": None}
    assert position_shares(load_run(isoflop_runs["dense32"])) == {}


def test_position_shares_of_a_staged_ffn_are_of_all_tokens() -> None:
    record = {"step": 2, "flops": 2.0, "val_loss": 3.0,
              "routing": {"layer1": {"processed": 0.25, "position_share": [0.5, 0.5]},
                          "layer1.ffn": {"processed": 0.5, "position_share": [0.75, 0.25]}}}
    run = Run("r", Path("r"), load_config(None), [], [record])
    assert position_shares(run) == {"layer1": pytest.approx([0.25, 0.25]),
                                    "layer1.ffn": pytest.approx([0.1875, 0.0625])}


# ----------------------------------------------------------------------------- the routing map
def test_routing_map_marks_the_tokens_each_layer_processed(isoflop_runs: dict[str, Path], tmp_path: Path,
                                                           capsys: pytest.CaptureFixture) -> None:
    run = isoflop_runs["mod32"]
    text = "def f(x):\n    return x + 1  # é"
    data, labels, notes = make_map(run, text, causal=True)
    ids = list(text.encode())
    assert notes == [] and len(labels) == len(ids) and labels[:4] == ["d", "e", "f", "␣"] and labels[-1] == ""
    assert "⏎" in labels and "é" in labels
    assert data["layers"] == ["layer1"]  # [dense, mod]: the second block routes
    model = load_model(run)
    with torch.no_grad():
        topk = model(torch.tensor([ids])).routings[1]
        causal = model(torch.tensor([ids]), routing_mode="causal").routings[1]
    row = data["cells"][0]
    assert {i for i, v in enumerate(row) if v & TOPK} == set(topk.positions[0].tolist())
    assert sum(1 for v in row if v & TOPK) == capacity_to_k(len(ids), 0.125)
    chosen = causal.positions[0][causal.valid[0]] if causal.valid is not None else causal.positions[0]
    assert {i for i, v in enumerate(row) if v & CAUSAL} == set(chosen.tolist())

    out = tmp_path / "maps" / "map.png"
    assert main(["routing-map", str(run), "--text", text, "--causal", "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == PNG
    printed = capsys.readouterr().out.splitlines()
    assert printed[0].startswith("layer1 ") and len(printed[0].split(" ", 1)[1]) == len(ids)
    # cut to --max-tokens, with a note
    data, labels, notes = make_map(run, text, causal=False, max_tokens=8)
    assert len(data["cells"][0]) == 8 and labels == ["d", "e", "f", "␣", "f", "(", "x", ")"]
    assert notes == [f"the text is {len(ids)} tokens: the map shows its first 8"]


def test_routing_map_errors_are_one_line(isoflop_runs: dict[str, Path], tmp_path: Path,
                                         capsys: pytest.CaptureFixture) -> None:
    def error(*args: str) -> str:
        assert main(["routing-map", *args]) == 2
        err = capsys.readouterr().err
        assert len(err.strip().splitlines()) == 1 and err.startswith("error: "), err
        return err

    assert "not found" in error(str(tmp_path / "missing"), "--text", "x", "--out", str(tmp_path / "m.png"))
    no_checkpoint = _run_folder(tmp_path / "fresh", [_eval(1, 1.0, 3.0)])
    assert "no checkpoint.pt" in error(str(no_checkpoint), "--text", "x", "--out", str(tmp_path / "m.png"))
    assert "no router whose choices are tokens" in error(str(isoflop_runs["dense32"]), "--text", "x",
                                                         "--out", str(tmp_path / "m.png"))
    assert "--text: empty" in error(str(isoflop_runs["mod32"]), "--text", "", "--out", str(tmp_path / "m.png"))
    assert "is a folder" in error(str(isoflop_runs["mod32"]), "--text", "x", "--out", str(tmp_path))
    assert not (tmp_path / "m.png").exists()


def test_report_of_a_folder_without_metrics_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    run = _run_folder(tmp_path / "r", [])
    (run / METRICS).unlink()
    assert main([str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "metrics.jsonl: not found" in err
    assert not (tmp_path / "out").exists()


def test_tokens_of_a_run_on_token_ids_come_from_its_tokenizer(tmp_path: Path) -> None:
    """The hook for tokenized runs: a tokenizer.json beside data.path (or in the run folder) encodes the
    text, each token printed as the text it covers; without one, one error line saying where to put it."""
    data = tmp_path / "data" / "train.bin"
    data.parent.mkdir()
    config = load_config(None, ["--data.source=tokens", f"--data.path={data}"])
    with pytest.raises(ReportError, match="no tokenizer.json"):
        encode(config, tmp_path, "hello world")
    tokenizers = pytest.importorskip("tokenizers")
    tokenizer = tokenizers.Tokenizer(tokenizers.models.WordLevel({"hello": 0, "world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    tokenizer.save(str(data.parent / "tokenizer.json"))
    assert encode(config, tmp_path, "hello world there") == ([0, 1, 2], ["hello", "world", "there"])
