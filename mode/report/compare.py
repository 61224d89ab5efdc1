"""The comparison table of run folders (`python -m mode.report RUN...`; see mode.report).

For each run: the config fields in which the runs differ (the ablation's variables), its
parameters and forward FLOPs per token, tokens per optimizer step (over every process, so runs
of equal global batch read equal whatever their process count), training FLOPs so far, the
last train loss, the last and best validation losses, the validation loss `mode.evaluate` saved in
the run folder for its last step ("evaluated", over many batches), the validation loss at the largest
FLOP budget every run reached (isoFLOP, interpolated between evaluations), the median
tokens/s, and its routed layers' averages at the last evaluation, each a share of all tokens
(routing_means): through the depth-routed blocks, to real experts, to no-op experts, dropped.
Runs are compared at equal training compute, as the Mixture-of-Depths paper does.

Runs that differ in `train.seed` and agree in every other differing field and in their process
count (which sets the global batch) are one setting trained from several seeds: a second table gives each setting's mean and sample standard
deviation over its seeds (the last, evaluated, best and isoFLOP validation losses, the last train loss).

A run still in progress can be read: a last metrics line cut short by a crash or a concurrent
write is left out with a note; a bad line anywhere else is an error naming the file and line.
"""
from __future__ import annotations

import io
import json
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from mode.checkpoint import describes_execution
from mode.config import Config, ConfigError, config_from_dict, flat_fields, load_yaml
from mode.flops import model_flops
from mode.model import LanguageModel
from mode.run_folder import METRICS
from mode.training.router_stats import is_expert_router, share_reaching
from mode.utils import MetricsError, read_metrics

CONFIG_FILE = "config.yaml"
# Fields that name or decorate a run rather than define the experiment.
IGNORED_FIELDS = ("train.out_dir", "train.progress", "train.tensorboard")
SEED_FIELD = "train.seed"
# The columns averaged over seeds: a run row's key, and its header.
SEED_COLUMNS = (("val_loss", "val loss"), ("evaluated_loss", "evaluated"), ("best_val_loss", "best val"),
                ("val_loss_at_budget", "val @ budget"), ("train_loss", "train loss"))


EVALUATION_KEYS = ("checkpoint", "step", "batches", "val_loss")


class ReportError(ValueError):
    """A run folder that cannot be read: the message names the file (and line)."""


@dataclass
class Run:
    name: str
    path: Path
    config: Config
    train: list[dict[str, Any]]  # metrics lines with a train loss
    evals: list[dict[str, Any]]  # metrics lines with a val_loss
    notes: list[str] = field(default_factory=list)


# ----------------------------------------------------------------------------- reading run folders
def load_run(path: Path) -> Run:
    """A run folder's resolved config and metrics; a missing or malformed file is a ReportError."""
    if not path.is_dir():
        raise ReportError(f"{path}: not a folder")
    config = _read_config(path / CONFIG_FILE)
    records, notes = _read_metrics(path / METRICS)
    train = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    return Run(path.name, path, config, train, evals, notes)


def _read_config(path: Path) -> Config:
    if not path.is_file():
        raise ReportError(f"{path}: not found (is {path.parent} a run folder?)")
    try:
        raw = load_yaml(path.read_text())
        return config_from_dict(raw, str(path))
    except (yaml.YAMLError, ConfigError) as e:
        raise ReportError(f"{path}: {e}") from None


def _read_metrics(path: Path) -> tuple[list[dict[str, Any]], list[str]]:
    """The records of metrics.jsonl (mode.utils.read_metrics: a last line cut short is left out with a note)."""
    if not path.is_file():
        raise ReportError(f"{path}: not found (is {path.parent} a run folder?)")
    try:
        return read_metrics(path)
    except MetricsError as e:
        raise ReportError(str(e)) from None


# ----------------------------------------------------------------------------- comparing runs
def differing_fields(configs: list[Config]) -> list[str]:
    """The dotted config fields whose values are not the same in every run, in config order."""
    flats = [flat_fields(c.to_dict()) for c in configs]
    names = list(dict.fromkeys(name for flat in flats for name in flat))
    return [n for n in names if n not in IGNORED_FIELDS and len({json.dumps(f.get(n)) for f in flats}) > 1]


def common_budget(runs: list[Run]) -> float | None:
    """The largest training FLOPs at which every run has been evaluated: the smallest of their last
    evaluations' (None when a run has no evaluation yet)."""
    if not runs or any(not run.evals for run in runs):
        return None
    return min(run.evals[-1]["flops"] for run in runs)


def val_loss_at(evals: list[dict[str, Any]], flops: float) -> float | None:
    """The validation loss at `flops` training FLOPs, linear in FLOPs between the evaluations around
    it; None before the first evaluation or past the last."""
    points = [(r["flops"], r["val_loss"]) for r in evals]
    for (f0, v0), (f1, v1) in zip(points, points[1:]):
        if f0 <= flops <= f1:
            return v0 if f1 == f0 else v0 + (v1 - v0) * (flops - f0) / (f1 - f0)
    return points[0][1] if points and points[0][0] == flops else None


def parameter_count(config: Config) -> int:
    """The model's parameters, counted on the meta device (no memory, no initialisation cost)."""
    with torch.device("meta"):
        return LanguageModel(config).num_parameters()


def routing_means(record: dict[str, Any] | None) -> dict[str, float]:
    """One metrics line's routed layers, averaged, every share over all tokens (where some layer
    reports it): depth_processed, the depth routers' share through their blocks; expert_processed,
    noop_fraction and dropped_fraction, the expert routers'. A Staged MoDE FFN reports its shares
    over the tokens its depth router chose (layerN.ffn under layerN): here they are scaled by that
    router's share, so Staged and Integrated MoDE read alike (Staged's 0.43 of a quarter of the
    tokens is 0.11 of them, as Integrated's would be)."""
    layers = (record or {}).get("routing") or {}
    processed = {name: stats["processed"] for name, stats in layers.items() if "processed" in stats}
    columns: dict[str, list[float]] = {"depth_processed": [v for name, v in processed.items() if not is_expert_router(name)]}
    for name, stats in layers.items():
        if not is_expert_router(name):
            continue
        share = share_reaching(name, processed)
        for key, column in (("processed", "expert_processed"), ("noop_fraction", "noop_fraction"),
                            ("dropped_fraction", "dropped_fraction")):
            if key in stats:
                columns.setdefault(column, []).append(share * stats[key])
    return {column: statistics.fmean(values) for column, values in columns.items() if values}


def last_step(run: Run) -> int:
    return max((r["step"] for r in run.train + run.evals), default=0)


def evaluation_result(run: Run) -> dict[str, Any] | None:
    """The mode.evaluate result kept in the run folder (`mode.evaluate RUN --out RUN/eval.json`) for the
    run's last step: of several, the one over the most batches, with its file name. None without one."""
    best = None
    for path in sorted(run.path.glob("*.json")):
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, ValueError):
            continue
        if not isinstance(data, dict) or any(key not in data for key in EVALUATION_KEYS):
            continue
        if data["step"] == last_step(run) and (best is None or data["batches"] > best["batches"]):
            best = {**data, "file": path.name}
    return best


def final_loss(run: Run) -> tuple[float, str] | None:
    """The run's final validation loss and where it comes from: its mode.evaluate result where the
    folder holds one for the last step (many batches), else its last evaluation; None without either."""
    result = evaluation_result(run)
    if result is not None:
        return float(result["val_loss"]), f"{result['file']} ({result['batches']} batches)"
    if run.evals:
        return float(run.evals[-1]["val_loss"]), f"last evaluation (step {run.evals[-1]['step']})"
    return None


def summarize(run: Run, budget: float | None) -> dict[str, Any]:
    """One run's row: numbers, or None where the run has none yet."""
    last_eval = run.evals[-1] if run.evals else None
    speeds = [r["tokens_per_s"] for r in run.train if "tokens_per_s" in r]
    flops_so_far = max((r["flops"] for r in run.train + run.evals), default=0.0)
    return {
        "run": run.name,
        "path": str(run.path),
        "parameters": parameter_count(run.config),
        "forward_flops_per_token": model_flops(run.config).forward_per_token,
        "steps": max((r["step"] for r in run.train + run.evals), default=0),
        # every process's micro-batches: equal global batches show equal, whatever the process count
        "tokens_per_step": run.train[-1]["tokens"] // run.train[-1]["step"] if run.train and "tokens" in run.train[-1] else None,
        "processes": run.train[-1].get("processes") if run.train else None,  # None: a run logged before it was recorded
        "train_flops": flops_so_far,
        "train_loss": run.train[-1]["loss"] if run.train else None,
        "val_loss": last_eval["val_loss"] if last_eval else None,
        "evaluated_loss": result["val_loss"] if (result := evaluation_result(run)) else None,
        "best_val_loss": min((r["val_loss"] for r in run.evals), default=None),
        "val_loss_at_budget": None if budget is None else val_loss_at(run.evals, budget),
        "tokens_per_s": statistics.median(speeds) if speeds else None,
        "routing": routing_means(last_eval),
    }


# ----------------------------------------------------------------------------- output
def _number(value: float | int | None, digits: int = 4) -> str:
    """A table cell: '-' for none, 3 significant digits from 1e5 on, else `digits` decimals (ints whole)."""
    if value is None:
        return "-"
    if abs(value) >= 1e5:
        return f"{value:.3g}"
    return str(value) if isinstance(value, int) else f"{value:.{digits}f}"


def _value(value: Any) -> str:
    return json.dumps(value) if isinstance(value, (list, dict)) else str(value)


def markdown_table(runs: list[Run], rows: list[dict[str, Any]], fields: list[str], budget: float | None) -> str:
    """The report: the differing fields, then one line a run."""
    header = ["run", *fields, "params", "fwd FLOPs/token", "steps", "tokens/step", "processes", "train FLOPs", "train loss",
              "val loss", "evaluated", "best val", "val @ common FLOPs" if budget is None else f"val @ {_number(budget)} FLOPs",
              "tokens/s", "through blocks", "to experts", "no-op", "dropped"]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for run, row in zip(runs, rows):
        flat = flat_fields(run.config.to_dict())
        routing = row["routing"]
        cells = [row["run"], *(_value(flat.get(f)) for f in fields), _number(row["parameters"]),
                 _number(row["forward_flops_per_token"]), str(row["steps"]), _number(row["tokens_per_step"]),
                 _number(row["processes"]), _number(row["train_flops"]),
                 _number(row["train_loss"]), _number(row["val_loss"]),
                 _number(row["evaluated_loss"]), _number(row["best_val_loss"]),
                 _number(row["val_loss_at_budget"]), _number(row["tokens_per_s"], 0),
                 _number(routing.get("depth_processed"), 3), _number(routing.get("expert_processed"), 3),
                 _number(routing.get("noop_fraction"), 3),
                 _number(routing.get("dropped_fraction"), 3)]
        lines.append("| " + " | ".join(cells) + " |")
    if not fields and len(runs) > 1:
        lines.append("\nThe runs' configs are the same in every field.")
    return "\n".join(lines)


def seed_groups(runs: list[Run], rows: list[dict[str, Any]], fields: list[str]) -> list[dict[str, Any]]:
    """Runs of one setting from several seeds: runs grouped by their values of every differing field
    but train.seed, and by their process count, in first-seen order; each group's setting, seeds and runs, and per SEED_COLUMNS
    key the mean and sample standard deviation over the runs that have a value. Empty when the seed
    does not differ or no setting has more than one run."""
    if SEED_FIELD not in fields:
        return []
    setting_fields = _setting_fields(fields)
    groups: dict[str, dict[str, Any]] = {}
    members: dict[str, list[dict[str, Any]]] = {}
    for run, row in zip(runs, rows):
        flat = flat_fields(run.config.to_dict())
        setting = {f: flat.get(f) for f in setting_fields}
        # The process count is no config field, yet it multiplies the global batch: another setting.
        key = json.dumps([setting, row["processes"]])
        group = groups.setdefault(key, {"setting": setting, "processes": row["processes"], "seeds": [], "runs": [],
                                        "repeats": []})
        seed = flat.get(SEED_FIELD)
        if seed in group["seeds"]:  # the same seed run another way (compiled, graphed): one sample, not two
            group["repeats"].append(row["run"])
            continue
        group["seeds"].append(seed)
        group["runs"].append(row["run"])
        members.setdefault(key, []).append(row)
    if all(len(group["runs"]) == 1 for group in groups.values()):
        return []
    for key, group in groups.items():
        for column, _ in SEED_COLUMNS:
            group[column] = _mean_and_spread([r[column] for r in members[key] if r[column] is not None])
    return list(groups.values())


def _setting_fields(fields: list[str]) -> list[str]:
    """The differing fields that define a setting: not the seed, nor how a run executed (runs of one
    setting from several seeds may differ in that and are still averaged together)."""
    return [f for f in fields if f != SEED_FIELD and not describes_execution(f)]


def _mean_and_spread(values: list[float]) -> dict[str, Any]:
    """n, mean and sample standard deviation (None where there are too few values for it)."""
    return {"n": len(values), "mean": statistics.fmean(values) if values else None,
            "std": statistics.stdev(values) if len(values) > 1 else None}


def seed_table(groups: list[dict[str, Any]], fields: list[str]) -> str:
    """The settings' means and sample standard deviations over their seeds."""
    setting_fields = _setting_fields(fields)
    by_processes = len({group["processes"] for group in groups}) > 1  # a column only where it tells settings apart
    header = ["setting", *setting_fields, *(["processes"] if by_processes else []), "seeds",
              *(name for _, name in SEED_COLUMNS)]
    lines = ["| " + " | ".join(header) + " |", "|" + " --- |" * len(header)]
    for i, group in enumerate(groups, start=1):
        cells = [str(i), *(_value(group["setting"][f]) for f in setting_fields),
                 *([_number(group["processes"])] if by_processes else []), ", ".join(map(str, group["seeds"]))]
        for column, _ in SEED_COLUMNS:
            cells.append(_mean_cell(group[column], len(group["seeds"])))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _mean_cell(stat: dict[str, Any], seeds: int) -> str:
    """mean ± std; '(n of N)' when some seeds have no value yet (a run without an evaluation)."""
    if stat["n"] == 0:
        return "-"
    cell = _number(stat["mean"]) + ("" if stat["std"] is None else f" ± {_number(stat['std'])}")
    return cell if stat["n"] == seeds else f"{cell} ({stat['n']} of {seeds})"


# ----------------------------------------------------------------------------- plot labels
def setting_labels(runs: list[Run]) -> dict[str, str]:
    """Each run's legend label: its values of the fields that tell the runs apart, but the seed and
    how it executed, as leaf=value (`d_model=384 block_pattern=dense-mod flops_budget=5e14`). A
    field in one-to-one step with an earlier one (model sizes varied together) is left out, as is
    train.max_steps where train.flops_budget set it. Runs of one setting share a label, seeds being
    its samples; where no field is left, a run's label is its folder name."""
    fields = _setting_fields(differing_fields([r.config for r in runs]))
    if "train.max_steps" in fields and all(r.config.train.flops_budget is not None for r in runs):
        fields.remove("train.max_steps")  # the budget's consequence, not a choice
    flats = [flat_fields(r.config.to_dict()) for r in runs]
    kept: list[str] = []
    for name in fields:
        values = [json.dumps(flat.get(name)) for flat in flats]
        if not any(_one_to_one([json.dumps(flat.get(k)) for flat in flats], values) for k in kept):
            kept.append(name)
    if not kept:
        return {run.name: run.name for run in runs}
    return {run.name: " ".join(f"{name.rsplit('.', 1)[-1]}={_label_value(flat.get(name))}" for name in kept)
            for run, flat in zip(runs, flats)}


def _one_to_one(a: list[str], b: list[str]) -> bool:
    return len(set(a)) == len(set(b)) == len(set(zip(a, b)))


def _label_value(value: Any) -> str:
    if isinstance(value, list):
        return "-".join(map(_label_value, value))
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


def setting_colors(labels: dict[str, str]) -> dict[str, Any]:
    """One colour a setting (label), in first-seen order: tab10, or tab20 past ten settings."""
    import matplotlib

    settings = list(dict.fromkeys(labels.values()))
    cmap = matplotlib.colormaps["tab10" if len(settings) <= 10 else "tab20"]
    return {setting: cmap(i % cmap.N) for i, setting in enumerate(settings)}


def draw_loss_lines(ax: Any, lines: dict[str, dict[str, list[tuple[float, float]]]], labels: dict[str, str]) -> None:
    """Each run's train loss (faint) and validation loss (markers) against x, lines[run] = {"train":
    [(x, loss)], "val": [(x, loss)]}: one colour and one legend entry a setting (labels[run])."""
    colors = setting_colors(labels)
    named: set[str] = set()
    for name, line in lines.items():
        label = labels[name]
        if line["train"]:
            ax.plot(*zip(*line["train"]), color=colors[label], alpha=0.3)
        if line["val"]:
            ax.plot(*zip(*line["val"]), "o-", color=colors[label], markersize=3, label=None if label in named else label)
            named.add(label)


def plot_png(runs: list[Run], budget: float | None) -> bytes:
    """Validation loss (markers) and train loss (faint) of every run against training FLOPs; one
    colour and legend entry a setting (its seeds drawn alike)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    lines = {run.name: {"train": [(r["flops"], r["loss"]) for r in run.train],
                        "val": [(r["flops"], r["val_loss"]) for r in run.evals]} for run in runs}
    draw_loss_lines(ax, lines, setting_labels(runs))
    if budget is not None:
        ax.axvline(budget, color="grey", linestyle="--", linewidth=1, label="common FLOP budget")
    ax.set_xlabel("cumulative training FLOPs")
    ax.set_ylabel("loss (nats/token); faint: train")
    # Beside the axes (tens of settings); no tight_layout, which would shrink the axes to make room.
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()
