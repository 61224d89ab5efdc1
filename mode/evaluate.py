"""Evaluate a trained run on more validation batches than training did, without touching its folder.

    python -m mode.evaluate runs/mod_tiny-X --batches 64 [--device cpu] [--out eval.json] [--data-path DIR]
    python -m mode.evaluate runs/sweep/*/ --batches 64 --save eval.json   # several runs, one process

The checkpoint's weights and config, the validation batches training evaluates on (the same
seeded draws, alike for every train.seed, `--batches` of them instead of train.eval_batches), the
same routing statistics, and under causal routing the loss with the causal decision as well. A multi-process run's
checkpoint (its weights gathered) is evaluated in one process on its global batch
(train.batch_size x its processes): the sequences its processes evaluated together, each
process's rows routed apart as they were (token choice's capacity is per process), the
statistics pooled as over processes. Prints the
result as JSON; --out also writes it there (whole: temporary file, then rename). Nothing in the
run folder is read but its checkpoint, nor written but a new --out file: --out never names
one of the run's files, nor any checkpoint. Several runs are evaluated one after another in one
process (no start-up per run), each printed, and with --save NAME written into its own folder
as NAME under the same rules; a run that fails is reported and the others still run (exit
status 2 if any failed). --data-path points a text or token-file
run at its data where it has moved (the split is by file, relative to the path: the same one),
or any run at a folder written by `python -m mode.data prepare` with the model's vocabulary (its
validation split: an imported model evaluated on text tokenized with its tokenizer).
"""
from __future__ import annotations

from mode.cli import finish, quiet_start, started

quiet_start(__name__)  # before torch: Ctrl-C while it imports ends with one line

import argparse
import json
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

import torch

from mode.checkpoint import load_checkpoint_file, model_from_payload, restore_rng
from mode.config import Config, ConfigError, DataConfig
from mode.data import DataError
from mode.data.meta import apply_metadata, is_prepared
from mode.run_folder import LOCK, RUN_FILES
from mode.training.trainer import Trainer
from mode.utils import atomic_write_text, folder_problem, pick_device


def evaluate_checkpoint(path: Path, batches: int, device: str = "auto", data_path: str | None = None) -> dict[str, Any]:
    """The validation loss and routing statistics of a run folder's (or checkpoint.pt's) weights
    over `batches` validation batches; also its step and what was evaluated."""
    if batches < 1:
        raise ValueError(f"--batches {batches}: must be at least 1")
    payload = load_checkpoint_file(path)
    model = model_from_payload(payload, str(path), pick_device(device, "--device"))
    config = model.config  # changed below in train and data fields only, which the model does not read
    if data_path is not None:
        _point_at(config, data_path)
    processes = _processes(payload)
    t = config.train
    t.batch_size *= processes  # every process's rows of the global batch, in order
    t.eval_batches, t.device = batches, device
    # Evaluation runs eager, from these weights: no compiling, no graphs, no other run's weights.
    # compile_mode first: each assignment is validated, and reduce-overhead without compile is refused.
    t.compile_mode, t.compile, t.cuda_graphs, t.init_from = "default", False, False, None
    t.tensorboard = False  # its scratch folder's records are thrown away
    with tempfile.TemporaryDirectory(prefix="mode-evaluate-") as scratch:
        t.out_dir = scratch  # the Trainer's run folder: a throwaway one, never the run's own
        trainer = Trainer(config, model=model)
        trainer.eval_splits = processes  # each process's rows routed apart, as they were (token choice's capacity)
        # The generators as saved, which is how the run's own evaluation at that step found them (evaluation
        # leaves them as it found them): routing.random draws the same.
        restore_rng(payload, trainer.device)
        result = trainer.evaluate()
    step = int(payload["state"]["step"])
    return {"checkpoint": str(path), "step": step, "batches": batches, "processes": processes,
            "tokens": batches * t.batch_size * config.data.seq_len, **result}


def _point_at(config: Config, data_path: str) -> None:
    """--data-path: the run's own data where it has moved, or any prepared token folder (its
    validation split; e.g. an imported model's tokenizer's data), whose vocabulary must be the model's."""
    if not data_path:
        raise ValueError("--data-path: empty; give the path of the run's text or token file")
    if is_prepared(Path(data_path)):
        try:
            config.data = DataConfig(source="tokens", path=data_path, seq_len=config.data.seq_len)
            apply_metadata(config)
        except ConfigError as e:
            raise ValueError(f"--data-path: {e}") from None
        return
    if config.data.source == "stdlib":
        raise ValueError("--data-path: this run read the standard library's sources (data.source: stdlib), no path; "
                         "give a folder written by python -m mode.data prepare to evaluate on its tokens")
    config.data.path = data_path


def _processes(payload: dict[str, Any]) -> int:
    """How many processes trained the checkpoint (launch/train.py records its layout; mode.train's: 1)."""
    optimizer = payload.get("optimizer")
    layout = optimizer.get("layout") if isinstance(optimizer, dict) else None
    return int(layout["world_size"]) if isinstance(layout, dict) and "world_size" in layout else 1


def main(argv: list[str] | None = None) -> int:
    started()
    parser = argparse.ArgumentParser(description="Evaluate trained runs' checkpoints on validation batches.")
    parser.add_argument("runs", type=Path, nargs="+", metavar="run", help="run folder or checkpoint.pt (several: "
                        "each evaluated in turn, in this one process)")
    parser.add_argument("--batches", type=int, default=64, help="validation batches (of train.batch_size sequences)")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON here (one run)")
    parser.add_argument("--save", default=None, metavar="NAME",
                        help="also write each run's JSON into its folder as NAME (a new file, e.g. eval.json)")
    parser.add_argument("--data-path", default=None, help="the run's data.path, where its text or token file now is; "
                             "or a folder written by python -m mode.data prepare (the model's vocabulary)")
    args = parser.parse_args(argv)
    if args.out is not None and args.out.is_dir():
        parser.error(f"--out {args.out}: is a folder; give a file name")
    if args.out is not None and (len(args.runs) > 1 or args.save is not None):
        parser.error("--out names one file: with several runs (or with --save) use --save NAME")
    if args.save is not None and (not args.save or Path(args.save).name != args.save):
        parser.error(f"--save {args.save!r}: a file name, written into each run's folder")
    failed = 0
    for run in args.runs:
        out = args.out if args.save is None else (run if run.is_dir() else run.parent) / args.save
        failed += _evaluate_one(run, out, args)
    return 2 if failed else 0


def _evaluate_one(run: Path, out: Path | None, args: argparse.Namespace) -> int:
    """Evaluate one run and print (and write) its JSON; 1 after printing the error, else 0."""
    flag = "--out" if args.save is None else "--save"
    try:
        if out is not None:  # checked before the evaluation, made after it (nothing left by a failed one)
            _check_out(out, run, flag)
        result = evaluate_checkpoint(run, args.batches, args.device, args.data_path)
        text = json.dumps(result, indent=2)
        print(text)
        if out is not None:
            out.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out, text + "\n")
    except (ConfigError, DataError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except OSError as e:
        print(f"error: {flag} {out}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0


def _check_out(out: Path, run: Path, flag: str = "--out") -> None:
    """A ValueError naming --out where writing it would replace a run's file (the evaluated run's, or
    any checkpoint) or its folder cannot be made (it is a file, or lies under one)."""
    run_dir = run if run.is_dir() else run.parent
    if out.resolve().parent == run_dir.resolve() and out.name in (*RUN_FILES, LOCK):
        raise ValueError(f"{flag} {out}: is the run's own {out.name}; give another file name")
    if out.exists() and (out.resolve() == run.resolve() or zipfile.is_zipfile(out)):
        raise ValueError(f"{flag} {out}: is a checkpoint, which the JSON would replace; give another file name")
    problem = folder_problem(out.parent)
    if problem is not None:
        raise ValueError(f"{flag} {out}: cannot make its folder {out.parent}: it {problem}")


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    finish(main())
