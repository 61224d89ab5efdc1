"""Whole-model training-step time for each block kind at one shape, on one GPU.

    python -m bench.block_kinds          # D=1024, 12 layers, S=2048, B=8, pattern [dense, KIND]
    python -m bench.block_kinds --tiny   # CPU smoke run

Every model alternates dense blocks with blocks of one kind; the MoE FFNs have 8 experts of
the dense FFN's width with expert choice at capacity factor 1 (so an MoE FFN costs what the
dense FFN costs), Integrated MoDE adds no-op experts, MoD and Staged MoDE route 12.5%.
After one row per block kind come the variants: Integrated MoDE whose null experts copy the
token's input or add a learned vector (moe.noop_kind), and top-1 token choice without and with
auxiliary-loss-free bias balancing (moe.bias_update_rate; the step's bias update itself, one
sign and add over the experts in the Trainer, is not part of the timed step).

The target's verdict is on synchronised steps, each starting on an idle GPU. The last column
times the same steps queued back to back, one synchronisation at the end, as `python -m
mode.train` runs them (one step in flight): there the host queues the next forward while the GPU
still runs the update, so a host-bound forward costs less.

--busy adds the GPU's busy time (the union of its kernels' intervals under torch.profiler, each
pass profiled on its own) of a step and of its forward+backward, and the step's per FLOP against
dense's: the time the kernels themselves take, without the gaps between them where the GPU waits
on the host or on launches.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from bench.common import (
    add_model_args,
    add_routing_switches,
    apply_routing_switches,
    gib,
    gpu_busy_ms,
    kernels_in_use,
    precision,
    require_cuda_unless_tiny,
    verdict,
)
from bench.mod_step import COMPILE, Runner, add_optimizer_arg, check_modes, describe_optimizer
from mode.config import BLOCK_KINDS, Config, config_from_dict
from mode.flops import model_flops


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    add_model_args(parser)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--noop", type=int, default=8, help="no-op experts of Integrated MoDE")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=1,
                        help="rounds of --iters per row, each row's interleaved with the dense model's (kept built "
                             "beside it) so that a machine's drift hits both alike: ms are medians over rounds, the "
                             "ratios the median of each round's ratio (1: each model timed once; compiled, dense "
                             "recompiles after each row's dynamo reset, from Inductor's cache); the per-FLOP "
                             "cell adds the lowest and highest round's")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at a small shape")
    parser.add_argument("--modes", nargs="+", choices=list(COMPILE), default=["eager"],
                        help="how the models run: a table for each (CUDA-graph modes on a GPU only)")
    parser.add_argument("--only", nargs="+", metavar="ROW",
                        help="only these rows (block kinds or variant names, as the table names them; dense is always first)")
    parser.add_argument("--busy", action="store_true",
                        help="also the GPU busy time of a step and of its forward+backward, and the step's per FLOP "
                             "against dense's (on CPU, the operators' time)")
    add_optimizer_arg(parser)
    add_routing_switches(parser)
    args = parser.parse_args(argv)
    selected = pick_rows(parser, args.only)
    require_cuda_unless_tiny(parser, args)
    check_modes(parser, args.modes)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    apply_routing_switches(args)
    if args.tiny:
        args.batch, args.seq, args.width, args.heads, args.layers, args.ffn, args.vocab = 2, 64, 64, 4, 2, 128, 256
        args.experts, args.noop, args.warmup, args.iters = 4, 4, 1, 2
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    triton = kernels_in_use(device, {"top-k": args.topk, "MoE rows": args.rows,
                                     "expert choice dispatch": args.expert_choice})
    print(f"card: {card}; B={args.batch} S={args.seq} D={args.width} layers={args.layers} ffn={args.ffn} "
          f"vocab={args.vocab}; pattern [dense, KIND]; {args.experts} experts, expert choice, capacity factor 1; "
          f"{precision(device)}; {triton}")
    print(f"the step's update: {describe_optimizer(args.optimizer, device)}")
    for mode in args.modes:
        print(f"\n{mode}\n")
        busy_columns = " GPU busy ms: step (fwd+bwd) | GPU busy per FLOP / dense: step (fwd+bwd) |" if args.busy else ""
        print("| block kind | fwd+bwd ms | step ms | peak GiB | forward MFLOPs/token | step ms / dense | "
              f"step time per FLOP / dense (target <= {PER_FLOP_TARGET}) | steps back to back: per FLOP / dense |"
              + busy_columns)
        print("| --- " * (10 if args.busy else 8) + "|")
        dense: Runner | None = None
        dense_ms = dense_back_to_back_ms = dense_flops = None
        dense_busy: tuple[float, float] | None = None
        for name, kind, moe in selected:
            if COMPILE[mode] is not None:  # each model compiles afresh: no kind counts against another's recompile limit
                torch._dynamo.reset()  # (a dense model kept for --rounds recompiles in its next round's warmup)
            runner = Runner(kind_config(kind, args, moe), mode, args, device, optimizer=args.optimizer)  # one round of --iters after --warmup
            flops = model_flops(runner.model.config).forward_per_token
            if dense_ms is None:  # the first row: the baseline (with rounds, kept for the other rows')
                for _ in range(args.rounds - 1):
                    runner.time_round()
                dense_ms, dense_flops = statistics.median(runner.step_ms), flops
                dense_back_to_back_ms = statistics.median(runner.back_to_back_ms)
                dense = runner if args.rounds > 1 else None
                ratios = back_to_back = [1.0]
            elif dense is None:
                ratios = [statistics.median(runner.step_ms) / dense_ms]
                back_to_back = [statistics.median(runner.back_to_back_ms) / dense_back_to_back_ms]
            else:  # round i of this row against dense's round just before it
                for _ in range(args.rounds - 1):
                    dense.time_round()
                    runner.time_round()
                ratios = round_ratios(runner.step_ms, dense.step_ms, args.rounds)
                back_to_back = round_ratios(runner.back_to_back_ms, dense.back_to_back_ms, args.rounds)
            fwd_bwd_ms, step_ms = statistics.median(runner.fwd_bwd_ms), statistics.median(runner.step_ms)
            step_ratio = statistics.median(ratios)
            per_flop = step_ratio / (flops / dense_flops)
            back_to_back_per_flop = statistics.median(back_to_back) / (flops / dense_flops)
            busy = ""
            if args.busy:
                step_busy, pass_busy = busy_ms(runner, device)
                dense_busy = dense_busy or (step_busy, pass_busy)
                scale = dense_flops / flops
                busy = (f" {step_busy:.2f} ({pass_busy:.2f}) | {step_busy / dense_busy[0] * scale:.3f} "
                        f"({pass_busy / dense_busy[1] * scale:.3f}) |")
            spread = round_spread(ratios, flops / dense_flops)
            print(f"| {name} | {fwd_bwd_ms:.2f} | {step_ms:.2f} | {gib(runner.peak_gib)} | {flops / 1e6:.1f} | "
                  f"{step_ratio:.3f} | {per_flop:.3f}: {verdict(per_flop <= PER_FLOP_TARGET)}{spread} | "
                  f"{back_to_back_per_flop:.3f} |" + busy, flush=True)
            if runner is not dense:
                del runner
            if device.type == "cuda":
                torch.cuda.empty_cache()


# A block kind's step time per forward FLOP over the dense model's at most this
PER_FLOP_TARGET = 1.15


# Steps (and passes) under the profiler for --busy's GPU busy times, each under a profiler of its own
BUSY_ITERS = 3


def busy_ms(runner: Runner, device: torch.device) -> tuple[float, float]:
    """GPU busy ms of one step and of one forward+backward, each the median of BUSY_ITERS."""
    return (gpu_busy_ms(runner.step, BUSY_ITERS, device, per_pass=True),
            gpu_busy_ms(runner.fwd_bwd, BUSY_ITERS, device, per_pass=True))


def round_ratios(row_ms: list[float], dense_ms: list[float], rounds: int) -> list[float]:
    """Each of a row's last `rounds` rounds over the dense round timed just before it."""
    return [ms / base for ms, base in zip(row_ms, dense_ms[-rounds:], strict=True)]


def round_spread(ratios: list[float], flop_ratio: float) -> str:
    """With several rounds, the lowest and highest round's step time per FLOP over dense's, which the
    median (the verdict's) sits between: how far a row's rounds move, beside how close it sits to
    the target."""
    if len(ratios) < 2:
        return ""
    return f" (rounds {min(ratios) / flop_ratio:.3f} to {max(ratios) / flop_ratio:.3f})"


# (row name, block kind, moe fields over the kind's own)
VARIANTS: tuple[tuple[str, str, dict], ...] = (
    ("mode_integrated, copy null experts", "mode_integrated", {"noop_kind": "copy"}),
    ("mode_integrated, constant null experts", "mode_integrated", {"noop_kind": "constant"}),
    ("moe token choice top-1", "moe", {"scheme": "token_choice", "top_k": 1}),
    ("moe token choice top-1, bias balancing", "moe", {"scheme": "token_choice", "top_k": 1, "bias_update_rate": 1e-3}),
)


def rows() -> list[tuple[str, str, dict]]:
    return [(kind, kind, {}) for kind in BLOCK_KINDS] + list(VARIANTS)


def pick_rows(parser: argparse.ArgumentParser, names: list[str] | None) -> list[tuple[str, str, dict]]:
    """The rows named (every row where None), dense first: the ratio column is against it."""
    table = rows()
    if names is None:
        return table
    known = {name for name, _, _ in table}
    unknown = [name for name in names if name not in known]
    if unknown:
        parser.error(f"--only: unknown row {unknown[0]!r}; the rows are {sorted(known)}")
    return [row for row in table if row[0] == "dense" or row[0] in names]


def kind_config(kind: str, args: argparse.Namespace, moe: dict | None = None) -> Config:
    """The model of pattern [dense, kind] at the script's shape; moe: fields over the kind's own."""
    config = {
        "model": {"vocab_size": args.vocab, "d_model": args.width, "n_heads": args.heads, "n_layers": args.layers,
                  "d_ff": args.ffn, "max_seq_len": args.seq, "block_pattern": ["dense", kind]},
        "routing": {"capacity": 0.125},
        "moe": {"n_experts": args.experts, "n_noop": args.noop if kind == "mode_integrated" else 0,
                "scheme": "expert_choice", "capacity_factor": 1.0 if kind != "mode_integrated"
                else (args.experts + args.noop) / args.experts * 0.5},
        "data": {"seq_len": args.seq},
    }
    if moe and "scheme" in moe:  # token choice: the capacity factor means tokens per slot
        config["moe"] = {"n_experts": args.experts, "n_noop": 0, "capacity_factor": 1.0}
    config["moe"].update(moe or {})
    return config_from_dict(config, "bench/block_kinds.py")


if __name__ == "__main__":
    main()
