"""Training: `python -m mode.train --config configs/X.yaml [--resume] [--section.field=value ...]`.

The command line of mode.training's Trainer: one loop for every setting (mode.training), the
run's checkpoints (mode.checkpoint). A run folder holds config.yaml, metrics.jsonl, checkpoint.pt and
loss_vs_flops.png (mode.run_folder); everything is written to a temporary file first and
renamed, and the run holds the folder's lock while it trains. SIGINT (Ctrl-C) and SIGTERM
(kill, timeout, a job scheduler) stop it cleanly: every file whole, the checkpoint resumable.
"""
from __future__ import annotations

from mode.cli import finish, quiet_start, started

quiet_start(__name__)  # before torch: Ctrl-C while it imports ends with one line

import argparse
import sys

from mode.config import ConfigError, load_config
from mode.data import DataError
from mode.flops import model_flops
from mode.run_folder import CHECKPOINT
from mode.training.trainer import CheckpointWriteError, Trainer
from mode.utils import stop_how, stop_status, stops_on_signals


# ----------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description="Train a MoD / MoDE language model.",
        epilog="Any config field can be overridden: --train.lr=3e-4 --model.n_layers=8",
    )
    parser.add_argument("--config", required=True, help="YAML experiment file (see configs/)")
    parser.add_argument("--resume", action="store_true", help="continue the run in train.out_dir")
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "." in a.split("=", 1)[0] and "=" in a)]
    if bad:
        parser.error(f"unrecognised arguments {bad}: overrides look like --section.field=value")
    return args, rest


SETUP_ERRORS = (ConfigError, DataError, FileExistsError, FileNotFoundError, ValueError)


def main(argv: list[str] | None = None) -> int:
    """SIGINT and SIGTERM stop the run cleanly wherever they arrive (stops_on_signals)."""
    started()
    args, overrides = parse_args(argv)
    with stops_on_signals():
        try:
            return _train_from_args(args, overrides)
        except KeyboardInterrupt as stop:  # between building the run and training it
            return stop_status(stop)


def _train_from_args(args: argparse.Namespace, overrides: list[str]) -> int:
    try:
        config = load_config(args.config, overrides)
        trainer = Trainer(config, resume=args.resume)
    except SETUP_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # while the data and model are built: no step has run
        print(f"\n{stop_how(stop)} before training started: nothing to resume; run the command again", file=sys.stderr)
        return stop_status(stop)
    for note in trainer.notes:
        print(f"note: {note}", file=sys.stderr)
    print(
        f"model: {trainer.model.num_parameters() / 1e6:.2f}M parameters, blocks {config.model.block_kinds()}, "
        f"{model_flops(config).forward_per_token / 1e6:.2f} MFLOPs/token forward; run folder {trainer.out_dir}"
    )
    try:
        trainer.run()
    except KeyboardInterrupt as stop:  # stopped between steps or inside one: every file is whole (written, then renamed)
        print(f"\n{interrupted_message(trainer, stop_how(stop))}", file=sys.stderr)
        return stop_status(stop)
    except CheckpointWriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"done: run folder {trainer.out_dir}")
    return 0


def interrupted_message(trainer: Trainer, how: str = "interrupted") -> str:
    """What a run stopped before its end left: which step its checkpoint holds, and how to go on."""
    if trainer.saved_step is None:
        return (f"{how} at step {trainer.state.step}, before the run's first checkpoint: nothing to resume; "
                f"remove {trainer.out_dir} to start the run again")
    return (f"{how} at step {trainer.state.step}; {trainer.out_dir / CHECKPOINT} holds step {trainer.saved_step}: "
            "continue with --resume (the metrics logged after it are dropped then)")


if __name__ == "__main__":
    finish(main())
