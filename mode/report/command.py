"""`python -m mode.report`: the comparison of run folders with its plots, and the routing map
(mode.report's docstring says what each writes)."""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mode.cli import started
from mode.report.compare import (
    SEED_FIELD,
    ReportError,
    _setting_fields,
    common_budget,
    differing_fields,
    load_run,
    markdown_table,
    plot_png,
    seed_groups,
    seed_table,
    summarize,
)
from mode.report.plots import plots
from mode.utils import atomic_write_bytes, atomic_write_text

ROUTING_MAP = "routing-map"  # the subcommand; any other first argument is a run folder


def write_report(out: Path, table: str, summary: dict[str, Any], pngs: dict[str, bytes]) -> None:
    """report.md, report.json and every PNG in out, each written whole (temporary file, then rename)."""
    if out.exists() and not out.is_dir():
        raise ReportError(f"--out {out}: exists and is not a folder")
    try:
        atomic_write_text(out / "report.md", table + "\n")
        atomic_write_text(out / "report.json", json.dumps(summary, indent=2) + "\n")
        for name, png in pngs.items():
            atomic_write_bytes(out / name, png)
    except OSError as e:  # a folder under a file, or one not writable
        raise ReportError(f"--out {out}: cannot write there: {e.strerror or e}") from e


def report(paths: list[Path], out: Path | None = None) -> str:
    """Read the runs, return the table; with out, write report.md, report.json and the plots there."""
    return build_report(paths, out)[0]


def build_report(paths: list[Path], out: Path | None = None) -> tuple[str, list[str]]:
    """report's table, and the names of the files written in out."""
    runs = [load_run(p) for p in paths]
    names = [r.name for r in runs]
    for run in runs:  # two folders of one name (runs/a/x, runs/b/x): name them by path
        if names.count(run.name) > 1:
            run.name = str(run.path)
    fields = differing_fields([r.config for r in runs])
    budget = common_budget(runs)
    rows = [summarize(r, budget) for r in runs]
    table = markdown_table(runs, rows, fields, budget)
    groups = seed_groups(runs, rows, fields)
    if groups:
        table += "\n\nOver seeds (mean ± sample standard deviation):\n\n" + seed_table(groups, fields)
        repeats = [name for group in groups for name in group["repeats"]]
        if repeats:
            table += (f"\n\nnote: left out of the seed table, each a seed its setting already has (a run that "
                      f"differs only in how it executed): {', '.join(repeats)}")
    elif SEED_FIELD in fields:
        table += (f"\n\nnote: no seed table: {SEED_FIELD} differs, but no two runs agree in every other field "
                  f"that defines a setting ({', '.join(_setting_fields(fields))})")
    notes = [n for r in runs for n in r.notes]
    if out is not None:
        pngs, tables, plot_notes = plots(runs)
        notes += plot_notes
        summary = {"differing_fields": fields, "common_flops_budget": budget, "runs": rows, "seed_groups": groups,
                   "plots": tables}
    if notes:
        table += "\n\n" + "\n".join(f"note: {n}" for n in notes)
    if out is None:
        return table, []
    pngs = {"val_loss_vs_flops.png": plot_png(runs, budget), **pngs}
    write_report(out, table, summary, pngs)
    return table, ["report.md", "report.json", *pngs]


def main(argv: list[str] | None = None) -> int:
    started()
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [ROUTING_MAP]:
        from mode.report.routing_map import main as routing_map_main

        return routing_map_main(argv[1:])
    parser = argparse.ArgumentParser(
        prog="python -m mode.report",
        description="Compare run folders: a table, and with --out the plots (loss vs FLOPs, isoFLOP curves, loss vs "
                    f"time, causal accuracy, position shares). `python -m mode.report {ROUTING_MAP} RUN --text ...` "
                    "draws which tokens each routed layer processed.")
    parser.add_argument("runs", nargs="+", type=Path, help="run folders (each holds config.yaml and metrics.jsonl)")
    parser.add_argument("--out", type=Path, default=None, help="also write report.md, report.json and the PNGs here")
    args = parser.parse_args(argv)
    try:
        table, written = build_report(args.runs, args.out)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(table)
    if written:
        print(f"written: {args.out}/{', '.join(written)}")
    return 0
