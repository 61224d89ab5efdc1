"""The plots `mode.report --out` writes beside its table, each from a table of numbers a function
here computes (what the drawing shows, and what report.json holds), then drawn:

- isoflop.png: final loss against parameters at each training-FLOP budget, one line a budget and
  setting (the Mixture-of-Depths paper's figure 3);
- loss_vs_time.png: loss against wall-clock seconds of training;
- causal_accuracy.png: the causal decision's accuracy over training, and its validation loss
  against top-k routing's;
- position_share.png: the share of tokens each routed layer processes, by position.
"""
from __future__ import annotations

import io
import json
import statistics
from typing import Any

from mode.checkpoint import describes_execution
from mode.config import Config, flat_fields
from mode.report.compare import (
    IGNORED_FIELDS,
    SEED_FIELD,
    Run,
    differing_fields,
    draw_loss_lines,
    final_loss,
    parameter_count,
    setting_colors,
    setting_labels,
)
from mode.training.router_stats import share_reaching

# What a mode.evaluate result (its --out JSON) holds, which tells it from any other JSON file.
# Fields that set a point's place on an isoFLOP curve, not which curve it is on.
CURVE_POSITION_FIELDS = ("train.flops_budget", "train.max_steps", SEED_FIELD)


# ----------------------------------------------------------------------------- final losses
# ----------------------------------------------------------------------------- isoFLOP curves
def block_kind(config: Config) -> str:
    """dense, or the routed block kinds of the pattern (mod, moe, mode_staged+moe, ...)."""
    kinds = [k for k in dict.fromkeys(config.model.block_kinds()) if k != "dense"]
    return "+".join(kinds) or "dense"


def curve_label(config: Config, fields: list[str]) -> str:
    """Which isoFLOP curve a run is on: its block kind and its values of the differing fields that
    are no model size, budget, seed or execution setting (routing.* only where a depth router reads
    them, moe.* only where experts do)."""
    flat = flat_fields(config.to_dict())
    parts = [block_kind(config)]
    for name in fields:
        if name.startswith("model.") or name in CURVE_POSITION_FIELDS or name in IGNORED_FIELDS:
            continue
        if describes_execution(name):
            continue
        if name.startswith("routing.") and not config.model.has_depth_router():
            continue
        if name.startswith("moe.") and not config.model.has_experts():
            continue
        value = flat.get(name)
        parts.append(f"{name.split('.', 1)[1]}={value if isinstance(value, str) else json.dumps(value)}")
    return " ".join(parts)


def isoflop_points(runs: list[Run]) -> tuple[list[dict[str, Any]], list[str]]:
    """One row a run trained to a train.flops_budget: its budget, curve, parameters and final loss
    (final_loss); and notes naming the runs left out (no budget, no loss yet)."""
    fields = differing_fields([r.config for r in runs])
    points, notes = [], []
    for run in runs:
        budget = run.config.train.flops_budget
        loss = final_loss(run)
        if budget is None:
            notes.append(f"{run.name}: no train.flops_budget, left out of the isoFLOP curves")
        elif loss is None:
            notes.append(f"{run.name}: no evaluation yet, left out of the isoFLOP curves")
        else:
            points.append({"run": run.name, "budget": budget, "curve": curve_label(run.config, fields),
                           "parameters": parameter_count(run.config), "loss": loss[0], "loss_from": loss[1]})
    return points, notes


def isoflop_curves(points: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """isoflop_points as curves: per budget and curve (budgets ascending), the points by parameters,
    each the mean, sample standard deviation (None for one run) and runs of its seeds; and the
    curve's optimum, the parameters of its lowest mean loss."""
    grouped: dict[tuple[float, str], dict[int, list[dict[str, Any]]]] = {}
    for p in points:
        grouped.setdefault((p["budget"], p["curve"]), {}).setdefault(p["parameters"], []).append(p)
    curves = []
    for (budget, curve), by_size in sorted(grouped.items(), key=lambda item: item[0]):
        rows = []
        for parameters, members in sorted(by_size.items()):
            losses = [m["loss"] for m in members]
            rows.append({"parameters": parameters, "loss": statistics.fmean(losses),
                         "std": statistics.stdev(losses) if len(losses) > 1 else None,
                         "runs": [m["run"] for m in members]})
        best = min(rows, key=lambda r: r["loss"])
        curves.append({"budget": budget, "curve": curve, "points": rows, "optimum": best["parameters"]})
    return curves


# ----------------------------------------------------------------------------- over training
def time_series(run: Run) -> dict[str, list[tuple[float, float]]]:
    """Train and validation losses against elapsed_s, the wall-clock seconds the run had trained
    (records logged before it was recorded have none and are left out)."""
    return {"train": [(r["elapsed_s"], r["loss"]) for r in run.train if "elapsed_s" in r],
            "val": [(r["elapsed_s"], r["val_loss"]) for r in run.evals if "elapsed_s" in r]}


def causal_series(run: Run) -> dict[str, Any]:
    """The causal decision over training (routing.causal): per record the mean over routers of
    causal_accuracy (the share of tokens whose causal decision agrees with top-k membership) on
    training batches and on validation batches, each router's own, and at each evaluation the
    validation loss routed causally against top-k (val_loss_causal - val_loss). And `always_no`: the
    accuracy a decision that never processes a token would score (1 - the processed share at the last
    record), the floor an accuracy must clear to mean anything (0.875 at capacity 12.5%)."""
    def mean_accuracy(records: list[dict[str, Any]]) -> list[tuple[int, float]]:
        out = []
        for r in records:
            values = [s["causal_accuracy"] for s in (r.get("routing") or {}).values() if "causal_accuracy" in s]
            if values:
                out.append((r["step"], statistics.fmean(values)))
        return out

    layers: dict[str, list[tuple[int, float]]] = {}
    for r in run.train:
        for name, stats in (r.get("routing") or {}).items():
            if "causal_accuracy" in stats:
                layers.setdefault(name, []).append((r["step"], stats["causal_accuracy"]))
    gap = [(r["step"], r["val_loss_causal"] - r["val_loss"]) for r in run.evals if "val_loss_causal" in r]
    last = (run.evals or run.train or [{}])[-1].get("routing") or {}
    shares = [last[name]["processed"] for name in layers if "processed" in last.get(name, {})]
    always_no = 1.0 - statistics.fmean(shares) if shares else None
    return {"train": mean_accuracy(run.train), "val": mean_accuracy(run.evals), "layers": layers, "gap": gap,
            "always_no": always_no}


def position_shares(run: Run) -> dict[str, list[float]]:
    """At the last evaluation with position statistics: per routed layer, the share of the tokens in
    each position bucket that it processed (its processed share of all tokens x bins x the bucket's
    position_share; a layer choosing every position alike reads its processed share everywhere)."""
    record = next((r for r in reversed(run.evals) if any("position_share" in s for s in (r.get("routing") or {}).values())), None)
    if record is None:
        return {}
    layers = record["routing"]
    processed = {name: stats["processed"] for name, stats in layers.items() if "processed" in stats}
    out = {}
    for name, stats in layers.items():
        if "position_share" in stats and name in processed:
            share = processed[name] * share_reaching(name, processed)  # of all tokens
            bins = len(stats["position_share"])
            out[name] = [share * bins * density for density in stats["position_share"]]
    return out


# ----------------------------------------------------------------------------- drawing
def pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def legend(ax: Any) -> None:
    """Beside the axes, not over the curves: a study's report compares tens of runs."""
    ax.legend(fontsize="x-small", loc="upper left", bbox_to_anchor=(1.01, 1.0))


def png_bytes(fig: Any, tight: bool = True) -> bytes:
    """tight=False for one axes with its legend beside it: tight_layout would shrink the axes to
    make room, where savefig's tight box takes the legend in anyway."""
    if tight:
        fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100, bbox_inches="tight")  # legends sit outside the axes
    pyplot().close(fig)
    return buffer.getvalue()


def isoflop_png(curves: list[dict[str, Any]]) -> bytes:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    budgets = sorted({c["budget"] for c in curves})
    names = list(dict.fromkeys(c["curve"] for c in curves))
    for c in curves:
        xs = [p["parameters"] for p in c["points"]]
        ys = [p["loss"] for p in c["points"]]
        errors = [p["std"] or 0.0 for p in c["points"]]
        color = f"C{budgets.index(c['budget']) % 10}"
        style = ("-", "--", ":", "-.")[names.index(c["curve"]) % 4]
        marker = "os^Dv"[names.index(c["curve"]) % 5]
        ax.errorbar(xs, ys, yerr=errors, color=color, linestyle=style, marker=marker, capsize=2,
                    label=f"{c['budget']:.3g} FLOPs, {c['curve']}")
        best = next(p for p in c["points"] if p["parameters"] == c["optimum"])
        ax.plot([best["parameters"]], [best["loss"]], marker="*", markersize=14, color=color, linestyle="none")
    ax.set_xscale("log")
    ax.set_xlabel("parameters")
    ax.set_ylabel("final validation loss (nats/token)")
    ax.set_title("isoFLOP curves (star: each curve's optimum)")
    legend(ax)
    return png_bytes(fig, tight=False)


def time_png(series: dict[str, dict[str, list[tuple[float, float]]]], labels: dict[str, str]) -> bytes:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    draw_loss_lines(ax, series, labels)
    ax.set_xlabel("wall-clock seconds of training")
    ax.set_ylabel("loss (nats/token); faint: train")
    legend(ax)
    return png_bytes(fig, tight=False)


def causal_png(series: dict[str, dict[str, Any]], labels: dict[str, str]) -> bytes:
    plt = pyplot()
    colors = setting_colors(labels)
    named: set[str] = set()
    fig, (acc, gap) = plt.subplots(1, 2, figsize=(11, 4.5))
    for name, s in series.items():
        label = labels[name]
        color = colors[label]
        if s["train"]:
            acc.plot(*zip(*s["train"]), color=color, alpha=0.4)
        if s["val"]:
            acc.plot(*zip(*s["val"]), "o-", color=color)
        if s["gap"]:
            gap.plot(*zip(*s["gap"]), "o-", color=color, label=None if label in named else label)
            named.add(label)
        if s["always_no"] is not None:
            acc.axhline(s["always_no"], color=color, linestyle=":", linewidth=1)
    acc.set_xlabel("step")
    acc.set_ylabel("causal decision accuracy (mean over routers)")
    acc.set_title("agreement with top-k; faint: training batches; dotted: never processing", fontsize="medium")
    gap.axhline(0.0, color="grey", linewidth=1)
    gap.set_xlabel("step")
    gap.set_ylabel("val loss, causal - top-k routing (nats/token)")
    legend(gap)  # one colour a run in both panels
    return png_bytes(fig)


def setting_shares(shares: dict[str, dict[str, list[float]]], labels: dict[str, str]) -> dict[str, dict[str, list[float]]]:
    """Per setting (label), each layer's share by position averaged over the setting's runs (seeds)."""
    pooled: dict[str, dict[str, list[list[float]]]] = {}
    for name, layers in shares.items():
        for layer, values in layers.items():
            pooled.setdefault(labels[name], {}).setdefault(layer, []).append(values)
    return {label: {layer: [statistics.fmean(column) for column in zip(*runs)] for layer, runs in layers.items()}
            for label, layers in pooled.items()}


def positions_png(shares: dict[str, dict[str, list[float]]]) -> bytes:
    plt = pyplot()
    cols = min(3, len(shares))
    rows = -(-len(shares) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(4.5 * cols, 2.8 * rows), squeeze=False)
    for ax in axes.flat[len(shares):]:
        ax.set_visible(False)
    for ax, (name, layers) in zip(axes.flat, shares.items()):
        for layer, values in layers.items():
            bins = len(values)
            ax.plot([(b + 0.5) / bins for b in range(bins)], values, "o-", label=layer)
        ax.set_xlim(0, 1)
        ax.set_ylim(bottom=0)
        ax.set_title(name, fontsize="small")
        ax.set_ylabel("share processed")
        ax.set_xlabel("position (fraction of the sequence)")
        ax.legend(fontsize="x-small", ncol=4)
    return png_bytes(fig)


# ----------------------------------------------------------------------------- every plot of a report
def plots(runs: list[Run]) -> tuple[dict[str, bytes], dict[str, Any], list[str]]:
    """The PNGs that apply to these runs (file name -> bytes), the tables they draw (for report.json)
    and notes on the plots left out and why."""
    pngs: dict[str, bytes] = {}
    notes: list[str] = []
    labels = setting_labels(runs)
    points, point_notes = isoflop_points(runs)
    curves = isoflop_curves(points)
    tables: dict[str, Any] = {"isoflop": {"points": points, "curves": curves}}
    if curves:
        pngs["isoflop.png"] = isoflop_png(curves)
        notes += point_notes
    elif any(r.config.train.flops_budget is not None for r in runs):
        notes.append("no isoflop.png: no run trained to a train.flops_budget has an evaluation yet")
    times = {r.name: time_series(r) for r in runs}
    times = {name: s for name, s in times.items() if s["train"] or s["val"]}
    tables["loss_vs_time"] = times
    if times:
        pngs["loss_vs_time.png"] = time_png(times, labels)
    else:
        notes.append("no loss_vs_time.png: no run recorded elapsed_s")
    causal = {r.name: causal_series(r) for r in runs}
    causal = {name: s for name, s in causal.items() if s["train"] or s["val"]}
    tables["causal"] = causal
    if causal:
        pngs["causal_accuracy.png"] = causal_png(causal, labels)
    shares = {r.name: position_shares(r) for r in runs}
    shares = {name: s for name, s in shares.items() if s}
    tables["position_share"] = shares
    if shares:
        pngs["position_share.png"] = positions_png(setting_shares(shares, labels))
    return pngs, tables, notes

