"""python -m mode.train's own throughput on the GPU configs, per FLOP against the dense one.

    python -m bench.train_configs                  # configs/{dense,mod,moe,mode_staged,mode_integrated}_gpu.yaml
    python -m bench.train_configs --tiny           # the *_tiny.yaml configs on the CPU: a smoke run
    python -m bench.train_configs --set train.overlap_update=true   # every config with a setting changed
    python -m bench.train_configs --nproc 2 --set train.compile=true # launch/train.py on 2 GPUs (DeepSpeed)
    python -m bench.train_configs --against train.cuda_graphs=false   # each config also with a setting changed
    python -m bench.train_configs --nproc 2 --configs dense moe --routed-set parallel.expert_parallel=2

Each config trains --steps steps as a user runs it (`python -m mode.train --config ...`, every
setting of the file kept, the run folder a temporary one; evaluation and checkpoints only at the
end, outside the timed windows). tokens/s: the median of the run's log windows (metrics.jsonl,
train.log_interval steps each) after the first --skip of them (CUDA graph capture and warm-up).
Time per FLOP against dense: (dense's tokens/s x its training FLOPs a token) over (this one's x its
own), the FLOPs from mode.flops (3 x the analytic forward). The configs differ in more than their
block kind (an expert's width, the capacity factor): the FLOPs count what each one computes.
--nproc N runs launch/train.py on N processes instead (torch.distributed.run, one GPU each; the
CPU over gloo with --tiny): tokens/s and TFLOP/s are then the whole run's, every process's tokens.
--against SECTION.FIELD=VALUE ... runs each config a second time with those settings (over --set's),
right after its first run, on the same machine: the table gains that run's tokens/s, FLOPs a token
and time per FLOP against dense run the same way, and its tokens/s over the first run's. --routed-set SECTION.FIELD=VALUE ... applies to every config
but dense, the baseline: settings a model without routing or experts refuses
(parallel.expert_parallel).
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from mode.config import load_config
from mode.flops import model_flops

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ["dense", "mod", "moe", "mode_staged", "mode_integrated"]


def window_rates(metrics: Path, skip: int) -> list[float]:
    """The tokens/s of each training log window in metrics.jsonl after the first `skip`."""
    records = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    rates = [r["tokens_per_s"] for r in records if "tokens_per_s" in r]
    if len(rates) <= skip:
        raise SystemExit(f"{metrics}: {len(rates)} log windows, none after the first {skip} (--steps too few)")
    return rates[skip:]


def trainer_command(nproc: int) -> list[str]:
    """python -m mode.train, or launch/train.py on nproc processes (a free port on this host)."""
    if nproc == 1:
        return [sys.executable, "-m", "mode.train"]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
            str(ROOT / "launch" / "train.py")]


def train(path: Path, steps: int, run_dir: Path, tiny: bool, settings: list[str], nproc: int = 1) -> Path:
    """Run python -m mode.train (or launch/train.py on nproc processes) on path for `steps` steps in
    run_dir, with settings (section.field=value) over the file's; its metrics.jsonl."""
    overrides = [f"--train.max_steps={steps}", f"--train.eval_interval={steps}",
                 f"--train.checkpoint_interval={steps}", f"--train.out_dir={run_dir}", *(f"--{s}" for s in settings)]
    if tiny:
        overrides += ["--train.device=cpu", "--train.log_interval=2", "--train.eval_batches=1"]
    command = [*trainer_command(nproc), "--config", str(path), *overrides]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{' '.join(command[1:])} failed:\n{(out.stderr or out.stdout)[-3000:]}")
    return run_dir / "metrics.jsonl"


def measure(path: Path, args: argparse.Namespace, run_dir: Path, settings: list[str]) -> tuple[float, float]:
    """The config at path trained with settings: its median tokens/s and its training FLOPs a token."""
    metrics = train(path, args.steps, run_dir, args.tiny, settings, args.nproc)
    rate = statistics.median(window_rates(metrics, args.skip))
    return rate, model_flops(load_config(path, [f"--{s}" for s in settings])).train_per_token


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", nargs="+", default=CONFIGS, metavar="NAME",
                        help="configs/NAME_gpu.yaml (NAME_tiny.yaml with --tiny); dense first is the baseline")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--skip", type=int, default=3, help="log windows left out at the start")
    parser.add_argument("--tiny", action="store_true", help="the tiny configs on the CPU")
    parser.add_argument("--nproc", type=int, default=1,
                        help="processes: 1 runs python -m mode.train, more run launch/train.py through DeepSpeed")
    parser.add_argument("--set", nargs="+", default=[], metavar="SECTION.FIELD=VALUE",
                        help="settings over every config's (mode.train's --section.field=value, without the dashes)")
    parser.add_argument("--against", nargs="+", default=[], metavar="SECTION.FIELD=VALUE",
                        help="run each config a second time with these settings too, and compare")
    parser.add_argument("--routed-set", nargs="+", default=[], metavar="SECTION.FIELD=VALUE",
                        help="settings over every config's but dense's (the baseline), e.g. parallel.expert_parallel=2")
    args = parser.parse_args(argv)
    for flag, values in (("--set", args.set), ("--against", args.against), ("--routed-set", args.routed_set)):
        bad = [s for s in values if s.startswith("-") or "=" not in s]
        if bad:
            parser.error(f"{flag}: {bad[0]!r} is not SECTION.FIELD=VALUE")
    suffix = "tiny" if args.tiny else "gpu"
    paths = [ROOT / "configs" / f"{name}_{suffix}.yaml" for name in args.configs]
    missing = [str(p) for p in paths if not p.exists()]
    if missing:
        parser.error(f"--configs: no such file {missing[0]}")
    if args.nproc < 1:
        parser.error(f"--nproc: {args.nproc} processes (at least 1)")
    if args.configs[0] != "dense":
        parser.error("--configs: the first must be dense (the baseline)")
    if args.tiny:
        args.steps, args.skip = min(args.steps, 8), min(args.skip, 1)
    settings = f", with {' '.join(args.set)}" if args.set else ""
    settings += f", every config but dense with {' '.join(args.routed_set)}" if args.routed_set else ""
    trainer = "python -m mode.train" if args.nproc == 1 else f"launch/train.py on {args.nproc} processes"
    print(f"{trainer}, {args.steps} steps a config{settings}, tokens/s the median of the log windows "
          f"after the first {args.skip}\n")
    every = "" if args.nproc == 1 else " (all processes)"
    header = f"| config | tokens/s{every} | training MFLOPs/token | TFLOP/s{every} | time per FLOP / dense (target <= 1.15) |"
    if args.against:
        b = f"with {' '.join(args.against)}"
        header += f" tokens/s, {b} | MFLOPs/token, {b} | time per FLOP / dense, {b} | tokens/s {b} / without |"
    print(header)
    print("|" + " --- |" * header.count(" |"))
    dense_flop_rates: list[float] = []  # dense's training FLOP/s, without and with --against: the baselines
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in zip(args.configs, paths):
            own = [*args.set, *([] if name == "dense" else args.routed_set)]
            runs = [measure(path, args, Path(tmp) / name, own)]
            if args.against:
                runs.append(measure(path, args, Path(tmp) / f"{name}-against", [*own, *args.against]))
            dense_flop_rates = dense_flop_rates or [rate * flops for rate, flops in runs]
            ratios = [dense / (rate * flops) for dense, (rate, flops) in zip(dense_flop_rates, runs)]
            verdicts = [f"{ratio:.3f}: {'met' if ratio <= 1.15 else 'missed'}" for ratio in ratios]
            rate, flops = runs[0]
            row = f"| {name} | {rate:,.0f} | {flops / 1e6:.1f} | {rate * flops / 1e12:.1f} | {verdicts[0]} |"
            if args.against:
                other, other_flops = runs[1]
                row += f" {other:,.0f} | {other_flops / 1e6:.1f} | {verdicts[1]} | {other / rate:.3f} |"
            print(row, flush=True)


if __name__ == "__main__":
    main()
