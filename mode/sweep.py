"""Run an ablation: one config, a grid of overrides, one run folder a point, then the report.

    python -m mode.sweep --config configs/mod_tiny.yaml --out runs/capacity \
        --vary routing.capacity=0.125,0.25,0.5 --vary routing.random=false,true --routing.causal=none [--train.max_steps=200 ...]

Every point of the grid (the product of the --vary lists) is one training run, `python -m
mode.train` in a process of its own, in `<out>/<field=value+...>`; overrides given without
--vary apply to every run. Values are YAML, separated by commas outside brackets
(`--vary model.block_pattern=[dense],[dense,mod]`). Fields that must change together go in `--zip`
lists of equal length, the i-th values of all of them making one value of the grid
(`--zip model.block_pattern=[dense,mode_staged],[dense,mode_integrated] --zip moe.n_noop=0,4`).
Every point's config is checked before the first run starts, so a bad value fails at once, naming
the field.

Runs go one after another, their output inline; `--gpus 0,1,2,3` runs one on each listed GPU at
once (CUDA_VISIBLE_DEVICES), `--jobs N` N at once on CPU (sharing the cores: OMP_NUM_THREADS =
cores / N unless set); parallel runs write their output to
`<run folder>/train.log` (appended to on resume) with the progress bar off.

Started again with the same arguments, a sweep skips its finished runs and resumes the others
from their checkpoints, so a stopped sweep continues where it stopped. A run that fails is
reported and the sweep goes on with the next; a point whose folder another process is training
(its lock is held) is skipped and reported. Ctrl-C or SIGTERM stops the sweep and sends its
running trainings SIGTERM, which they honour whatever signals they inherited: each stops at a
whole checkpoint. At the end `mode.report` compares every run
(`<out>/report.md`, `report.json`, `val_loss_vs_flops.png`).
"""
from __future__ import annotations

from mode.cli import INTERRUPTED, TERMINATED, finish, handle_stop_signals, quiet_start, started

quiet_start(__name__)  # before torch: Ctrl-C while it imports ends with one line

import argparse
import itertools
import json
import math
import os
import queue
import re
import shlex
import signal
import subprocess
import sys
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from mode.checkpoint import curve_differences, load_checkpoint_file
from mode.config import (
    Config,
    ConfigError,
    load_config,
    load_yaml,
    override_field,
    read_yaml_file,
)
from mode.report import ReportError, report
from mode.run_folder import CHECKPOINT, CONFIG, METRICS, PLOT, holder
from mode.training.optim import steps_within_budget
from mode.training.tracking import remove_event_files


class SweepError(ValueError):
    """Arguments that cannot make a sweep: the message names the flag or the point."""


@dataclass
class Point:
    name: str  # its run folder's name
    overrides: list[str]  # --field=value for each varied field


# ----------------------------------------------------------------------------- the grid
def split_values(text: str, flag: str = "--vary") -> list[str]:
    """'0.1,0.2' -> ['0.1', '0.2']; commas inside [] or {} or quotes belong to one value
    ('[a,b],[c]', '"a,b",c'). Each value must be YAML."""
    values, depth, quote, current = [], 0, "", ""
    for char in text:
        if quote:
            quote = "" if char == quote else quote
        elif char in "\"'":
            quote = char
        else:
            depth += char in "[{"
            depth -= char in "]}"
        if char == "," and depth == 0 and not quote:
            values.append(current)
            current = ""
        else:
            current += char
    values.append(current)
    if depth != 0 or quote or any(not v.strip() for v in values):
        raise SweepError(f"{flag}: cannot read the values {text!r} (an empty value, or unbalanced brackets or quotes)")
    for value in values:
        try:
            load_yaml(value)
        except yaml.YAMLError as e:
            raise SweepError(f"{flag}: the value {value.strip()!r} is not YAML ({str(e).splitlines()[0]})") from None
    return [v.strip() for v in values]


def parse_vary(text: str, flag: str = "--vary") -> tuple[str, list[str]]:
    """'routing.capacity=0.125,0.25' -> ('routing.capacity', ['0.125', '0.25']); errors name `flag`."""
    field, sep, values = text.partition("=")
    if not sep or "." not in field or field.startswith("-"):
        raise SweepError(f"{flag} {text!r}: expected section.field=value1,value2,...")
    return field, split_values(values, flag)


def _name_value(value: str) -> str:
    """A value as it reads in a folder name: YAML's compact form, brackets and spaces dropped; a
    float in its shortest form with the exponent's sign only when negative (1e16, not 1.0e-16)."""
    loaded = load_yaml(value)
    if isinstance(loaded, float) and math.isfinite(loaded):
        text = format(loaded, "g").replace("e+", "e")
        return text if any(c in text for c in ".e") else text + ".0"  # 10.0 stays apart from the int 10
    compact = yaml.safe_dump(loaded, default_flow_style=True, width=1 << 16).strip()
    compact = compact.removesuffix("...").strip()
    return re.sub(r"[^A-Za-z0-9._-]+", "-", compact).strip("-") or "empty"


def linked_axis(linked: list[tuple[str, list[str]]]) -> list[list[tuple[str, ...]]]:
    """--zip fields: one axis of the grid whose i-th value is every field's i-th value (fields that
    must change together, as block_pattern and moe.n_noop from staged to integrated MoDE)."""
    if not linked:
        return []
    counts = {len(values) for _, values in linked}
    if len(counts) > 1:
        given = ", ".join(f"{field} {len(values)}" for field, values in linked)
        raise SweepError(f"--zip: every field needs as many values, the i-th of each going together ({given})")
    return [list(zip(*(values for _, values in linked)))]


def grid(varied: list[tuple[str, list[str]]], linked: list[tuple[str, list[str]]] | None = None) -> list[Point]:
    """Every combination of the varied fields' values, the first field's slowest, the linked (--zip)
    fields' values taken together as one field before them; each point named by its values (a field
    by its last name where that is unique: capacity=0.25+random=true)."""
    linked = linked or []
    fields = [field for field, _ in [*linked, *varied]]
    if len(set(fields)) != len(fields):
        raise SweepError(f"--vary/--zip: a field is given twice ({', '.join(fields)})")
    last = [f.rsplit(".", 1)[-1] for f in fields]
    labels = [short if last.count(short) == 1 else full for short, full in zip(last, fields)]
    axes = linked_axis(linked) + [[(v,) for v in values] for _, values in varied]
    points = []
    for combination in itertools.product(*axes):
        values = [value for together in combination for value in together]
        name = "+".join(f"{label}={_name_value(v)}" for label, v in zip(labels, values))
        points.append(Point(name, [f"--{field}={v}" for field, v in zip(fields, values)]))
    names = [p.name for p in points]
    if len(set(names)) != len(names):
        raise SweepError(f"--vary/--zip: two points would share a run folder ({', '.join(names)}): give distinct values")
    return points


# Fields the sweep sets for every point itself, after the point's overrides: varied, every point
# would get the sweep's value, and the points would train alike under other names.
SET_BY_SWEEP = {
    "train.out_dir": "each run's folder is <--out>/<point>; give --out instead",
    "train.progress": "the sweep turns the progress bar off for parallel runs; give it as --train.progress=...",
}


def check_fields(varied: list[tuple[str, list[str]]], common: list[str]) -> None:
    """A varied field must be one the sweep does not set itself, and not given as an override too
    (the point's value comes last and would drop the override without a word). SweepError naming it."""
    given = {override_field(o) for o in common}
    for field, _ in varied:
        name = override_field(field)
        if name in SET_BY_SWEEP:
            raise SweepError(f"--vary {name}: {SET_BY_SWEEP[name]}")
        if name in given:
            raise SweepError(f"{name} is given by --vary and as an override --{name}=...: give it once")


# ----------------------------------------------------------------------------- running
def existing_run(run_dir: Path) -> tuple[int, dict[str, Any]] | None:
    """(the step, the config) a run folder's checkpoint holds; None without one. mmap: the weights
    are not read. An unreadable checkpoint is a SweepError naming it."""
    path = run_dir / CHECKPOINT
    if not path.is_file():
        return None
    try:
        payload = load_checkpoint_file(path, mmap=True)
        return int(payload["state"]["step"]), payload["config"]
    except (ValueError, KeyError, TypeError) as e:  # truncated, not a zip, not a mode checkpoint
        raise SweepError(f"{e}: remove it (or its run folder) to train that point again") from None


def finished_steps(run_dir: Path) -> int | None:
    """The step a run folder's checkpoint holds (None without one)."""
    run = existing_run(run_dir)
    return None if run is None else run[0]


def saved_config(run_dir: Path) -> dict[str, Any] | None:
    """The config a run folder without a checkpoint saved (config.yaml, written as its run starts);
    None when it has neither config.yaml nor metrics.jsonl. A folder whose files cannot be told to be
    a run's (metrics without a config, a config that is no mapping) is a SweepError naming it."""
    path = run_dir / CONFIG
    if not path.is_file():
        if (run_dir / METRICS).exists():  # mode.train writes config.yaml first: not a mode run's curve
            raise SweepError(f"{run_dir} holds {METRICS} but no config.yaml, so it cannot be told to be this "
                             "point's run: give the sweep another --out, or remove that folder")
        return None
    try:
        saved = read_yaml_file(path)
    except ConfigError as e:
        raise SweepError(f"{run_dir}: {e}") from None
    if not isinstance(saved, dict) or not saved:
        raise SweepError(f"{path} is not a run's config: give the sweep another --out, or remove that folder")
    return saved


def check_existing_run(run_dir: Path, config: Config) -> None:
    """A point's folder may hold a run from an earlier sweep: it must be this point's, up to the
    fields a resume may change (max_steps, budget, how it executes), or it would be skipped as
    finished, or resumed, as this sweep's; without a checkpoint, started again over its files
    (run_point drops its metrics). Its checkpoint's config is compared, else its config.yaml.
    SweepError naming the folder and the fields that differ."""
    run = existing_run(run_dir)
    saved = saved_config(run_dir) if run is None else run[1]
    if saved is None:
        return
    differ = curve_differences(saved, config)
    if differ:
        raise SweepError(f"{run_dir} holds a run with other settings: {', '.join(differ)}. Give the sweep another "
                         "--out, or remove that folder to train the point again")


def train_command(config: str, overrides: list[str], run_dir: Path, resume: bool, parallel: bool = False) -> list[str]:
    # progress is a field a resume may change: a parallel run's log gets no progress bar
    quiet = ["--train.progress=false"] if parallel else []
    command = [sys.executable, "-m", "mode.train", "--config", config, *overrides, *quiet, f"--train.out_dir={run_dir}"]
    return command + (["--resume"] if resume else [])


_PRINT = threading.Lock()


def say(line: str) -> None:
    """One status line, whole: the parallel runs' threads print beside each other."""
    with _PRINT:
        sys.stdout.write(line + "\n")
        sys.stdout.flush()


def outcome_of(code: int, where_output: str) -> str:
    if code == 0:
        return "done"
    if code in (INTERRUPTED, TERMINATED):
        return f"stopped ({'Ctrl-C' if code == INTERRUPTED else 'SIGTERM'}; {where_output})"
    return f"failed (exit status {code}; {where_output})"


def plan(args: argparse.Namespace, common: list[str]) -> list[tuple[Point, list[str], int]]:
    """(point, its overrides, its max_steps) for every point, each config checked first."""
    if args.out.exists() and not args.out.is_dir():
        raise SweepError(f"--out {args.out}: is a file; the sweep's folder holds one run folder a point")
    varied = [parse_vary(v) for v in args.vary or []]
    linked = [parse_vary(z, "--zip") for z in args.zip or []]
    check_fields([*linked, *varied], common)
    points = grid(varied, linked)
    planned = []
    settings: dict[str, str] = {}  # each point's config -> its name
    for point in points:
        overrides = [*common, *point.overrides]
        try:
            config = load_config(args.config, overrides)
            budgeted = config.train.flops_budget is not None  # one process: a sweep runs mode.train
            max_steps = steps_within_budget(config) if budgeted else config.train.max_steps
        except ConfigError as e:
            raise SweepError(f"point {point.name}: {e}") from None
        check_existing_run(args.out / point.name, config)
        planned.append((point, overrides, max_steps))
        # Two spellings of one value (3e-3, 0.003) are two points that train alike.
        setting = json.dumps(config.to_dict(), sort_keys=True)
        if setting in settings:
            raise SweepError(f"points {settings[setting]} and {point.name} give the same config: a value is given twice")
        settings[setting] = point.name
    return planned


@dataclass
class Slots:
    """How runs share the machine: `jobs` at once; with GPUs, each run holds one of them."""
    jobs: int = 1
    gpus: queue.Queue[str] | None = None

    @property
    def parallel(self) -> bool:
        return self.jobs > 1


def parse_slots(jobs: int | None, gpus: str | None) -> Slots:
    """--jobs and --gpus -> Slots; a bad combination is a SweepError naming the flag."""
    if jobs is not None and jobs < 1:
        raise SweepError(f"--jobs {jobs}: must be at least 1")
    if gpus is None:
        return Slots(jobs or 1)
    ids = [g.strip() for g in gpus.split(",")]
    if not all(re.fullmatch(r"\d+", g) for g in ids) or len(set(ids)) != len(ids):
        raise SweepError(f"--gpus {gpus!r}: expected distinct GPU indices separated by commas, e.g. 0,1,2,3")
    if jobs is not None and jobs > len(ids):
        raise SweepError(f"--jobs {jobs} with --gpus {gpus}: at most one run a GPU ({len(ids)} listed)")
    free: queue.Queue[str] = queue.Queue()
    for gpu in ids:
        free.put(gpu)
    return Slots(jobs or len(ids), free)


def run_point(args: argparse.Namespace, point: Point, overrides: list[str], max_steps: int, slots: Slots) -> str:
    """Train (or finish) one point; returns what happened: finished before, done, or failed."""
    run_dir = args.out / point.name
    pid = holder(run_dir)
    if pid is not None:  # a training from another sweep (or one that outlived a killed sweep) writes there
        return f"skipped: {run_dir} is in use by another training (pid {pid})"
    step = finished_steps(run_dir)
    if step is not None and step >= max_steps:
        return f"finished before (step {step})"
    if step is None:  # this point's run, stopped before its first checkpoint (plan's check_existing_run saw
        for name in (METRICS, CONFIG, PLOT):  # its config.yaml): it starts again, on no file of the old one
            (run_dir / name).unlink(missing_ok=True)
        remove_event_files(run_dir)  # train.tensorboard's
    command = train_command(args.config, overrides, run_dir, resume=step is not None, parallel=slots.parallel)
    what = "training" if step is None else f"resuming from step {step}"
    gpu = slots.gpus.get() if slots.gpus is not None else None  # held until the run ends
    try:
        env = run_environment(gpu, slots.jobs)
        what += "" if gpu is None else f" on GPU {gpu}"
        return (_run_logged if slots.parallel else _run_inline)(point.name, command, env, what, run_dir)
    finally:
        if gpu is not None:
            slots.gpus.put(gpu)


def run_environment(gpu: str | None, jobs: int) -> dict[str, str]:
    """A run's environment: its GPU alone visible; CPU runs side by side share the cores (each
    would start as many threads as the machine has, and N of them slow each other down),
    unless OMP_NUM_THREADS is set already."""
    env = dict(os.environ)
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    elif jobs > 1:
        env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    return env


_RUNNING: set[subprocess.Popen] = set()  # the trainings running now (a stop passes them a SIGTERM)
_RUNNING_LOCK = threading.Lock()


def _call(command: list[str], **popen: Any) -> int:
    """subprocess.call, except that on Ctrl-C it stops the training (SIGTERM) and waits for it to stop
    at its checkpoint (subprocess.call kills it after a quarter second), then raises KeyboardInterrupt."""
    process = subprocess.Popen(command, **popen)
    with _RUNNING_LOCK:
        _RUNNING.add(process)
    interrupted = False
    try:
        while True:
            try:
                code = process.wait()
                break
            except KeyboardInterrupt:
                interrupted = True
                _stop_running()
                _keep_stopping()
    finally:
        with _RUNNING_LOCK:
            _RUNNING.discard(process)
    if interrupted:
        raise KeyboardInterrupt
    return code


def _stop_running() -> None:
    """SIGTERM to every running training: each stops at a whole checkpoint. Not SIGINT: a sweep started
    in the background by a script passes its trainings an ignored SIGINT, and a terminal's Ctrl-C
    reaches only the foreground's. A training already stopping ignores it."""
    with _RUNNING_LOCK:
        running = list(_RUNNING)
    for process in running:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)


def _keep_stopping() -> None:
    """The sweep is stopping: a further Ctrl-C or SIGTERM (a second one; `timeout`, which signals the
    sweep and then its process group) is passed on to the trainings, and the sweep goes on waiting
    for them instead of leaving before they have stopped. Main thread only (signals go there)."""
    if threading.current_thread() is threading.main_thread():
        handle_stop_signals(lambda signum, frame: _stop_running())


def _stop_on_sigterm(signum: int, frame: Any) -> None:
    """SIGTERM (kill, timeout, a job scheduler) stops the sweep as Ctrl-C does, its trainings first.
    Left running, they would go on writing their folders while a restarted sweep resumed the same runs."""
    _stop_running()
    raise KeyboardInterrupt


def _run_inline(name: str, command: list[str], env: Mapping[str, str], what: str, run_dir: Path) -> str:
    say(f"\n== {name}: {what}")
    return outcome_of(_call(command, env=env), "its output is above")


def _run_logged(name: str, command: list[str], env: Mapping[str, str], what: str, run_dir: Path) -> str:
    """A run beside others: its output to <run_dir>/train.log, a line when it starts and ends."""
    log = run_dir / "train.log"
    run_dir.mkdir(parents=True, exist_ok=True)
    say(f"== {name}: {what} (output: {log})")
    with log.open("a") as out:
        code = _call(command, stdout=out, stderr=subprocess.STDOUT, env=env)
    outcome = outcome_of(code, f"see {log}")
    say(f"== {name}: {outcome}")
    return outcome


def run_all(args: argparse.Namespace, planned: list[tuple[Point, list[str], int]], slots: Slots) -> dict[str, str]:
    """Every point's outcome, by name, in grid order (runs `slots.jobs` at a time)."""
    if not slots.parallel:
        return {point.name: run_point(args, point, overrides, steps, slots) for point, overrides, steps in planned}
    pool = ThreadPoolExecutor(max_workers=slots.jobs)
    try:
        futures = {point.name: pool.submit(run_point, args, point, overrides, steps, slots)
                   for point, overrides, steps in planned}
        return {name: future.result() for name, future in futures.items()}
    except KeyboardInterrupt:
        # The running trainings stop at a checkpoint; none queued starts.
        _stop_running()
        _keep_stopping()
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    finally:
        pool.shutdown(wait=True)


def main(argv: list[str] | None = None) -> int:
    started()
    parser = argparse.ArgumentParser(
        description="Run a grid of config overrides, one training run each, then compare them.",
        epilog="Other --section.field=value arguments apply to every run.",
    )
    parser.add_argument("--config", required=True, help="the YAML config every run starts from")
    parser.add_argument("--out", required=True, type=Path, help="the sweep's folder: one run folder a point, the report")
    parser.add_argument("--vary", action="append", help="section.field=value1,value2,... (repeat)")
    parser.add_argument("--zip", action="append",
                        help="section.field=value1,value2,...: the --zip fields change together, the i-th value "
                             "of each in one point (repeat; as many values each)")
    parser.add_argument("--dry-run", action="store_true", help="print the runs and their commands, run nothing")
    parser.add_argument("--gpus", default=None, help="run one point on each of these GPUs at once, e.g. 0,1,2,3")
    parser.add_argument("--jobs", type=int, default=None,
                        help="points run at once (default 1, or one a GPU of --gpus); parallel runs log to <run>/train.log")
    args, common = parser.parse_known_args(argv)
    if not args.vary and not args.zip:
        parser.error("give the grid: --vary section.field=value1,value2,... (or --zip)")
    bad = [a for a in common if not (a.startswith("--") and "=" in a and "." in a.split("=", 1)[0])]
    if bad:
        parser.error(f"unrecognised arguments {bad}: overrides look like --section.field=value")
    if any(a.startswith("--train.out_dir=") for a in common):
        parser.error("--train.out_dir: each run's folder is <--out>/<point>; give --out instead")
    try:
        slots = parse_slots(args.jobs, args.gpus)
        planned = plan(args, common)
    except SweepError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    at_once = (f", {slots.jobs} at once" if slots.parallel else "") + ("" if slots.gpus is None else f" on GPUs {args.gpus}")
    print(f"sweep: {len(planned)} runs in {args.out}{at_once}")
    for point, overrides, steps in planned:
        done = finished_steps(args.out / point.name)
        state = "" if done is None else (", finished" if done >= steps else f", resumes from step {done}")
        command = train_command(args.config, overrides, args.out / point.name, resume=done is not None,
                                parallel=slots.parallel)
        print(f"  {point.name} ({steps} steps{state}): python {shlex.join(command[1:])}")
    if args.dry_run:
        return 0
    previous_int = signal.getsignal(signal.SIGINT)
    previous = signal.signal(signal.SIGTERM, _stop_on_sigterm)
    try:
        outcomes = run_all(args, planned, slots)
    except KeyboardInterrupt:
        say("\nsweep stopped (Ctrl-C or SIGTERM): each run keeps its last checkpoint; the same command continues it")
        return INTERRUPTED
    finally:  # main() called in a process that goes on (a test, a notebook) gets its own handlers back
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)
        signal.signal(signal.SIGINT, previous_int if previous_int is not None else signal.default_int_handler)
    print("\n" + "\n".join(f"{name}: {outcome}" for name, outcome in outcomes.items()))
    compared = [args.out / name for name, outcome in outcomes.items()
                if not outcome.startswith(("failed", "skipped"))]
    if compared:
        try:
            print("\n" + report(compared, args.out))
        except ReportError as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
    return 1 if len(compared) < len(outcomes) else 0


if __name__ == "__main__":
    finish(main())
