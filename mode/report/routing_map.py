"""The routing map of a text: which tokens each routed layer of a trained model processed (the
Mixture-of-Depths paper's figure 5).

    python -m mode.report routing-map runs/mod_tiny --text "def f(x):\n    return x" [--causal] [--out map.png]

Tokens along x (the text printed under them), routed layers along y; a cell is filled where the
layer processed the token under training's top-k routing, and with --causal coloured by whether
the causal decision (sampling's routing) processed it too. Depth routers (MoD, Staged MoDE) and
expert-choice routers (a token sent to any real expert); token choice routes every token.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

from mode.checkpoint import load_model
from mode.config import Config, ConfigError
from mode.model import LanguageModel
from mode.report.compare import ReportError
from mode.report.plots import png_bytes, pyplot
from mode.run_folder import CHECKPOINT
from mode.training.router_stats import chosen_positions
from mode.utils import atomic_write_bytes

TOKENIZER_FILE = "tokenizer.json"
# Cell values of the map: processed by neither routing, top-k only, causal only, both.
NEITHER, TOPK, CAUSAL, BOTH = 0, 1, 2, 3
# How a byte prints under the map: whitespace made visible.
SHOWN = {" ": "␣", "\n": "⏎", "\t": "⇥"}


# ----------------------------------------------------------------------------- tokens
def tokenizer_path(config: Config, run_dir: Path) -> Path | None:
    """The tokenizer.json of a run on token ids (data.source: tokens): in the run folder, or beside
    (or in) its data.path. None where there is none."""
    candidates = [run_dir / TOKENIZER_FILE]
    if config.data.path:
        data = Path(config.data.path)
        candidates += [data / TOKENIZER_FILE, data.parent / TOKENIZER_FILE]
    return next((c for c in candidates if c.is_file()), None)


def encode(config: Config, run_dir: Path, text: str) -> tuple[list[int], list[str]]:
    """The text as the run's token ids and each token as printed under the map: UTF-8 bytes for a
    byte-level run (a character's first byte carries it, the rest print empty); for a run on token
    ids, its tokenizer.json (tokenizer_path), read with the tokenizers package."""
    if config.data.source != "tokens":
        ids, labels = [], []
        for char in text:
            data = char.encode("utf-8")
            ids += list(data)
            labels += [SHOWN.get(char, char)] + [""] * (len(data) - 1)
        return ids, labels
    path = tokenizer_path(config, run_dir)
    if path is None:
        raise ReportError(f"{run_dir}: the run reads token ids (data.source: tokens) and no {TOKENIZER_FILE} is in the "
                          f"run folder or beside data.path ({config.data.path}): put the tokenizer there")
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ReportError(f"{path}: reading it needs the tokenizers package: pip install -e .[hf]") from None
    encoding = Tokenizer.from_file(str(path)).encode(text)
    labels = [text[start:end] for start, end in encoding.offsets]
    return list(encoding.ids), ["".join(SHOWN.get(c, c) for c in label) for label in labels]


# ----------------------------------------------------------------------------- the map
@torch.no_grad()
def routing_map(model: LanguageModel, ids: list[int], causal: bool = False) -> dict[str, Any]:
    """Per routed layer (in depth order), which of the tokens it processed: {"layers": names,
    "cells": one row a layer of NEITHER/TOPK/CAUSAL/BOTH a token, "causal": whether it was routed causally too}. Top-k routing as in training
    (over these tokens: capacity x their number); with causal, the causal decision's too (depth
    routers only: an expert-choice router under causal routing is left out of the map)."""
    tokens = torch.tensor([ids], device=next(model.parameters()).device)  # (1, S)
    seq = tokens.shape[1]
    rows: dict[str, list[int]] = {}
    for name, positions in chosen_positions(model(tokens, routing_mode="topk"), seq):
        row = rows.setdefault(name, [NEITHER] * seq)
        for p in positions.tolist():
            row[p] = TOPK
    if causal:
        out = model(tokens, routing_mode="causal")
        depth = {f"layer{i}": r for i, r in enumerate(out.routings) if r is not None}
        rows = {name: row for name, row in rows.items() if name in depth}
        for name, routing in depth.items():
            positions = routing.positions[0] if routing.valid is None else routing.positions[0][routing.valid[0]]
            for p in positions.tolist():
                rows[name][p] |= CAUSAL
    return {"layers": list(rows), "cells": list(rows.values()), "causal": causal}


def load_run_model(run: Path, device: str) -> LanguageModel:
    """The model of a run folder's checkpoint; a missing folder or checkpoint is one ReportError line."""
    if not run.exists():
        raise ReportError(f"{run}: not found")
    if run.is_dir() and not (run / CHECKPOINT).is_file():
        raise ReportError(f"{run}: no {CHECKPOINT} (is it a run folder, and has the run saved a checkpoint?)")
    try:
        return load_model(run, device)
    except (FileNotFoundError, ValueError, ConfigError) as e:
        raise ReportError(str(e)) from None


def routing_map_png(data: dict[str, Any], tokens: list[str], title: str) -> bytes:
    """Tokens along x (printed under the map), routed layers along y (the first at the top)."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    plt = pyplot()
    layers, cells, causal = data["layers"], data["cells"], data["causal"]
    colors = ["#f4f4f4", "#3b6fb6", "#e8a33d", "#2c8c4a"]
    # One column a token, its text upright under it: horizontal labels of 96 tokens overlap.
    label_height = 0.07 * max((len(t) for t in tokens), default=1)
    fig, ax = plt.subplots(figsize=(max(6.0, 0.18 * len(tokens) + 1.5), 1.2 + 0.35 * len(layers) + label_height))
    ax.imshow(cells, cmap=ListedColormap(colors), vmin=0, vmax=3, aspect="auto", interpolation="nearest")
    ax.set_yticks(range(len(layers)), layers, fontsize="small")
    ax.set_xticks(range(len(tokens)), tokens, fontsize=7, family="monospace", rotation=90)
    ax.tick_params(axis="x", length=0)
    ax.set_title(title, fontsize="medium")
    handles = [Patch(color=colors[TOPK], label="top-k only" if causal else "processed (top-k)")]
    if causal:
        handles += [Patch(color=colors[CAUSAL], label="causal only"), Patch(color=colors[BOTH], label="both")]
    ax.legend(handles=handles, fontsize="x-small", loc="upper left", bbox_to_anchor=(1.0, 1.0))
    return png_bytes(fig)


def text_rows(data: dict[str, Any]) -> list[str]:
    """The map as text: a line a layer, '#' where top-k processed a token (with causal: '#' both,
    't' top-k only, 'c' causal only), '.' elsewhere."""
    marks = {NEITHER: ".", TOPK: "t" if data["causal"] else "#", CAUSAL: "c", BOTH: "#"}
    width = max((len(n) for n in data["layers"]), default=0)
    return [f"{name:>{width}} {''.join(marks[v] for v in row)}" for name, row in zip(data["layers"], data["cells"])]


def make_map(run: Path, text: str, causal: bool, device: str = "cpu", max_tokens: int | None = None
             ) -> tuple[dict[str, Any], list[str], list[str]]:
    """The map of `text` for a run folder (or checkpoint.pt): (routing_map's table, the tokens'
    labels, notes). The text is cut to max_tokens (default: the run's data.seq_len)."""
    model = load_run_model(run, device)
    config = model.config
    if causal and config.routing.causal == "none":
        raise ReportError(f"--causal: {run} was trained with routing.causal=none: it has no causal decision")
    run_dir = run if run.is_dir() else run.parent
    ids, labels = encode(config, run_dir, text)
    if not ids:
        raise ReportError("--text: empty")
    limit = min(max_tokens or config.data.seq_len, config.model.max_seq_len)
    notes = [f"the text is {len(ids)} tokens: the map shows its first {limit}"] if len(ids) > limit else []
    ids, labels = ids[:limit], labels[:limit]
    data = routing_map(model, ids, causal)
    if not data["layers"]:
        raise ReportError(f"{run}: the model has no router whose choices are tokens (block_pattern "
                          f"{config.model.block_pattern}): no routing map")
    return data, labels, notes


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m mode.report routing-map",
                                     description="Draw which tokens of a text each routed layer of a trained run processed.")
    parser.add_argument("run", type=Path, help="run folder (or its checkpoint.pt)")
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--text", help="the text to route")
    source.add_argument("--text-file", type=Path, help="a file holding the text")
    parser.add_argument("--causal", action="store_true", help="also route by the causal decision (routing.causal runs)")
    parser.add_argument("--out", type=Path, default=Path("routing_map.png"), help="the PNG (default: routing_map.png)")
    parser.add_argument("--max-tokens", type=int, default=None, help="cut the text to this many tokens (default: data.seq_len)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args(argv)
    try:
        text = args.text if args.text is not None else _read_text(args.text_file)
        data, labels, notes = make_map(args.run, text, args.causal, args.device, args.max_tokens)
        title = f"{args.run.name}: tokens each routed layer processed"
        png = routing_map_png(data, labels, title)
        _write(args.out, png)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for note in notes:
        print(f"note: {note}", file=sys.stderr)
    print("\n".join(text_rows(data)))
    print(f"written: {args.out}")
    return 0


def _read_text(path: Path) -> str:
    try:
        return path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise ReportError(f"--text-file {path}: {getattr(e, 'strerror', None) or e}") from None


def _write(out: Path, png: bytes) -> None:
    if out.is_dir():
        raise ReportError(f"--out {out}: is a folder; give a file name")
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_bytes(out, png)
    except OSError as e:
        raise ReportError(f"--out {out}: cannot write there: {e.strerror or e}") from None
