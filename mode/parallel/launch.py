"""Multi-process training through DeepSpeed: the body of launch/train.py.

    deepspeed --num_gpus N launch/train.py --config configs/X.yaml [--resume] [--section.field=value ...]
    torchrun --nproc_per_node N launch/train.py --config configs/X.yaml ...
    python -m torch.distributed.run --nproc_per_node 2 launch/train.py --config ... --train.device=cpu

Same config files and overrides as `python -m mode.train`; the `parallel:` section picks
ZeRO stage, expert-parallel size and backend. Each process builds the whole model from the
same seed, keeps its expert slice (parallel.expert_parallel), and hands the DeepSpeed
engine to mode.training's Trainer as its Optimization: one loop, one set of logs (rank 0),
one checkpoint.pt (rank 0, weights gathered: it loads on one device) next to DeepSpeed's
sharded checkpoint in the run folder's deepspeed/.
"""
from __future__ import annotations

import os
import signal
import sys
import time
from typing import Any, NoReturn

import torch
import torch.distributed as dist

from mode.checkpoint import build_model
from mode.cli import handle_stop_signals, ignore_stop_signals, restore_handlers, started
from mode.config import Config, ConfigError, load_config
from mode.data import DataError
from mode.flops import model_flops
from mode.parallel.engine import (
    DeepSpeedOptimization,
    Processes,
    capture_refusal,
    init_distributed,
    quiet_deepspeed,
)
from mode.parallel.expert_parallel import apply_expert_parallel
from mode.routing import set_random_score_rows
from mode.run_folder import FolderInUse
from mode.train import interrupted_message, parse_args
from mode.training.graphs import refuse_required_graphs
from mode.training.trainer import LaunchedStep, Trainer
from mode.utils import StopSignal, stop_how, stop_status, stops_on_signals

# Errors every process would report alike (the config, the data, the run folder, an unreadable
# checkpoint or metrics file): printed once, without a traceback, as mode.train prints them.
ERRORS = (ConfigError, DataError, FileExistsError, FileNotFoundError, ValueError, FolderInUse)
# Variables a launcher (torchrun, deepspeed, mpirun) sets in each process it starts.
LAUNCHER_VARIABLES = ("RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK")
# The key under which each rank's stop request rides in the losses' all-reduce (LaunchTrainer).
STOP_KEY = "_stop_requested"
# How long a rank other than 0 waits before leaving on an error rank 0 reports (_fail).
ERROR_GRACE_S = 5.0


class LaunchError(ValueError):
    """launch/train.py's own arguments or environment: the message names the flag."""


class Preempted(Exception):
    """Raised by --stop-at-step: the run leaves its loop as a preempted job would."""


class LaunchTrainer(Trainer):
    """The Trainer, plus a way to stop mid-run (tests of resume; drills for preemption), and
    Ctrl-C and SIGTERM made collective.

    A signal reaches each process wherever it is: raised there as KeyboardInterrupt, one rank
    would go on to report its last step (an all-reduce) while another still waits inside the
    step's all-to-all, and both would wait forever. So during run() a first SIGINT or SIGTERM
    only marks a request; every rank's mark travels in the losses' all-reduce (mean_over_ranks),
    which every rank runs at the same point, and every rank raises StopSignal at its next step's
    launch: all stop at the same step, as --stop-at-step stops them. A second signal raises at
    once (the way out of a run that no longer reaches an all-reduce).
    """

    stop_at_step: int | None = None
    clean_stops = (KeyboardInterrupt, Preempted)  # every rank stops at the same step: reporting it stays collective
    stop_requested: int | None = None  # the signal this rank got during run()
    stop_everywhere = False  # some rank did, as the last all-reduce told every rank

    def run(self) -> list[dict[str, Any]]:
        previous = handle_stop_signals(self._request_stop)
        try:
            return super().run()
        finally:
            restore_handlers(previous)

    def _request_stop(self, signum: int, frame: Any) -> None:
        if self.stop_requested is not None:
            raise StopSignal(signum)
        self.stop_requested = signum
        name = "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name
        print(f"[rank {self.rank}] {name}: every process stops after the step in progress (a second signal stops "
              "at once)", file=sys.stderr, flush=True)

    def mean_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        pooled = super().mean_over_ranks({**values, STOP_KEY: float(self.stop_requested is not None)})
        self.stop_everywhere = self.stop_everywhere or pooled.pop(STOP_KEY) > 0
        return pooled

    def sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        values = values.clone()
        dist.all_reduce(values)  # every process then updates the routers' biases alike
        return values

    def launch_step(self) -> LaunchedStep:
        if self.stop_everywhere:
            raise StopSignal(self.stop_requested or signal.SIGINT)  # a rank that got none stops as Ctrl-C's
        if self.stop_at_step is not None and self.state.step >= self.stop_at_step:
            raise Preempted(f"stopped after step {self.state.step} (--stop-at-step)")
        return super().launch_step()


def build_trainer(config: Config, processes: Processes, resume: bool = False) -> LaunchTrainer:
    """Model (whole, same seed on every rank) -> expert slices -> DeepSpeed engine -> Trainer."""
    # Compiled CUDA graphs add into gradients the step must keep; DeepSpeed's engine drops them
    # after its step (the eager model's graphs hand theirs back: GraphedMicroStep).
    if config.train.compile_mode == "reduce-overhead":
        raise ConfigError(
            "train.compile_mode=reduce-overhead (CUDA graphs) runs with python -m mode.train (one "
            "process) only; through launch/train.py (DeepSpeed) use train.compile_mode=default"
        )
    refuse_required_graphs(config, capture_refusal(config))  # before anything is built; auto: eager_graphs' note
    torch.manual_seed(config.train.seed)
    # Whole and on the host (where LanguageModel initialises anyway), with train.init_from's
    # weights in the one-device layout; only this rank's experts then reach the device.
    notes: list[str] = []
    model = build_model(config, "cpu", resume, notes)
    # routing.random: each process draws the global micro-batch's scores and keeps its rows (every
    # rank's generator is seeded alike), so the ablation routes as one process with the whole batch.
    set_random_score_rows(model, processes.rank, processes.world_size)
    rng = torch.get_rng_state()  # where a one-process run's RNG stands when training starts
    apply_expert_parallel(model, config.parallel.expert_parallel)
    model.to(processes.device)
    optimization = DeepSpeedOptimization(model, config, processes)
    trainer = LaunchTrainer(
        config, resume=resume, optimization=optimization, model=optimization.model,
        rank=processes.rank, world_size=processes.world_size,
    )
    trainer.notes[:0] = notes
    if not resume:
        torch.set_rng_state(rng)
    return trainer


LOCAL_RANK_FLAGS = ("--local_rank", "--local-rank")  # deepspeed's and torch.distributed.launch's spellings
STOP_FLAG = "--stop-at-step"


def _flag_name(arg: str) -> str:
    """'--stop-at-step=4' -> '--stop-at-step': flags are matched by their whole name, so a typo such as
    --stop-at-steps=2 reaches parse_args, which refuses it, instead of being read as --stop-at-step."""
    return arg.split("=", 1)[0]


def _launcher_args(argv: list[str]) -> tuple[list[str], int | None]:
    """Drop the deepspeed launcher's --local_rank (LOCAL_RANK is in the environment); read --stop-at-step
    (either --stop-at-step=N or --stop-at-step N)."""
    rest, stop_at = [], None
    it = iter(argv)
    for arg in it:
        name = _flag_name(arg)
        if name in LOCAL_RANK_FLAGS:
            if "=" not in arg:
                next(it, None)
        elif name == STOP_FLAG:
            stop_at = _steps(arg.split("=", 1)[1] if "=" in arg else next(it, None))
        else:
            rest.append(arg)
    return rest, stop_at


def _steps(value: str | None) -> int:
    if value is None or not value.strip().isdigit() or int(value) < 1:
        raise LaunchError(f"--stop-at-step needs a number of optimizer steps >= 1 (got {value!r})")
    return int(value)


def _check_launched() -> None:
    if not any(name in os.environ for name in LAUNCHER_VARIABLES):
        raise LaunchError(
            "launch/train.py runs one process per GPU under a launcher: torchrun --nproc_per_node N "
            "launch/train.py ... or deepspeed --num_gpus N launch/train.py ...; one process: python -m mode.train"
        )


def _say(rank: int, text: str, stream=sys.stdout) -> None:
    """Rank 0 speaks for all (every rank reads the same config and files, so an error is the same
    everywhere), in one write: lines of several processes do not interleave mid-line."""
    if rank == 0:
        stream.write(text + "\n")
        stream.flush()


def _fail(rank: int, error: Exception) -> int:
    """An error every rank meets: rank 0 prints it. The others wait before they exit, since the
    launcher stops every process once one has failed, and rank 0 must have printed by then."""
    _say(rank, f"error: {error}", sys.stderr)
    if rank != 0:
        time.sleep(ERROR_GRACE_S)
    return 2


def main(argv: list[str] | None = None) -> int:
    """SIGINT and SIGTERM stop cleanly: before training, at once; during it, every rank at the same step."""
    started()
    with stops_on_signals():
        try:
            return _launch(argv)
        except KeyboardInterrupt as stop:  # before training started (run() handles its own)
            _say(int(os.environ.get("RANK", "0")),
                 f"\n{stop_how(stop)} before training started: nothing to resume; run the command again", sys.stderr)
            return stop_status(stop)


def _launch(argv: list[str] | None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if {"-h", "--help"} & set(argv):
        print(__doc__.split("\n\n")[0] + "\n    --stop-at-step N: leave the loop after N optimizer steps (a preemption drill)\n")
    rank = int(os.environ.get("RANK", "0"))
    try:
        argv, stop_at = _launcher_args(argv)
        args, overrides = parse_args(argv)
        config = load_config(args.config, overrides)
        _check_launched()
        quiet_deepspeed()
        processes = init_distributed(config)
    except (ConfigError, LaunchError) as e:
        return _fail(rank, e)
    trainer = None
    try:
        try:
            trainer = build_trainer(config, processes, resume=args.resume)
        except ERRORS as e:
            return _fail(processes.rank, e)
        trainer.stop_at_step = stop_at
        for note in trainer.notes:
            _say(processes.rank, f"note: {note}", sys.stderr)
        _say(processes.rank,
             f"model: {trainer.model.num_parameters() / 1e6:.2f}M parameters on this rank, blocks "
             f"{config.model.block_kinds()}, {model_flops(config).forward_per_token / 1e6:.2f} MFLOPs/token forward; "
             f"{processes.world_size} processes ({processes.backend}, {processes.device.type}), "
             f"ZeRO {config.parallel.zero_stage}, expert_parallel {config.parallel.expert_parallel}; "
             f"run folder {trainer.out_dir}")
        try:
            trainer.run()
        except Preempted:
            _say(processes.rank, interrupted_message(trainer, "stopped by --stop-at-step"))
            return 0
        except KeyboardInterrupt as stop:  # files are whole; a first signal stops every rank at the same step
            ignore_stop_signals()
            _say(processes.rank, f"\n{interrupted_message(trainer, stop_how(stop))}", sys.stderr)
            if trainer.stop_everywhere:
                # Every rank is here: none leaves before rank 0 has spoken, since a launcher stops
                # the others (SIGTERM) once one has exited with a failure's status.
                dist.barrier()
            return stop_status(stop)
        _say(processes.rank, f"done: run folder {trainer.out_dir}")
        return 0
    finally:
        if trainer is not None:
            trainer.release_graphs()
        if dist.is_initialized():
            dist.destroy_process_group()


def run_and_exit(argv: list[str] | None = None) -> NoReturn:
    """main(), then leave the process without the interpreter's teardown.

    Everything is written and the process group destroyed when main() returns. Left to the
    interpreter's teardown, a process that ran DeepSpeed over gloo on CPU once aborted in C++
    after its work ("terminate called without an active exception", SIGABRT: a thread of the
    communication stack destroyed while running), and the launcher reported a finished run as
    failed. os._exit skips that teardown; the output streams are flushed first.
    """
    exit_without_teardown(main(argv))


def exit_without_teardown(code: int) -> NoReturn:
    """Flush the output streams and leave the process with `code`, skipping the interpreter's
    teardown (run_and_exit says why); for any script that ran DeepSpeed or gloo."""
    ignore_stop_signals()  # the last line is printed: nothing may cut the flush short
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    run_and_exit()
