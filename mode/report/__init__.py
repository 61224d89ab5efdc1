"""Reports on run folders: the comparison table and the plots of an ablation, and the routing map
of a text.

    python -m mode.report runs/mod-c0.125 runs/mod-c0.25 runs/dense [--out reports/capacity]
    python -m mode.report routing-map runs/mod-c0.125 --text "some text" [--causal] [--out map.png]

The first prints the comparison table (mode.report.compare). With --out it also writes there
report.md, report.json (the table's numbers and every plot's), val_loss_vs_flops.png and the
plots that apply (mode.report.plots): isoflop.png, loss_vs_time.png, causal_accuracy.png,
position_share.png. The second draws which tokens each routed layer processed
(mode.report.routing_map). Every file is written whole (temporary file, then rename); a folder
that is no run folder is one error line. docs/reports.md describes every plot.

Names load on first use: `python -m mode.report` imports this package before its own start-up,
which must come before torch (mode.cli.quiet_start).
"""
from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "mode.report.compare": ("ReportError", "Run", "load_run", "differing_fields", "common_budget", "val_loss_at",
                            "parameter_count", "routing_means", "summarize", "markdown_table", "seed_groups"),
    "mode.report.command": ("report", "build_report", "main"),
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = sorted(_MODULE_OF)


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'mode.report' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)
