"""One MoE FFN layer with its experts sharded over the GPUs of one host (expert parallelism),
forward+backward, bf16: this project against DeepSpeed's and megablocks' expert-parallel MoE.

    python -m bench.ep_layer                     # 2 GPUs: 8 experts, 4 on each; 8 x 2048 tokens a GPU
    python -m bench.ep_layer --nproc 4 --rounds 3
    python -m bench.ep_layer --tiny              # 2 CPU processes over gloo, a tiny shape: a smoke run

Every process holds its own tokens (--batch x --seq) and E / N of the experts (N processes, one
GPU each, NCCL); a routed row's all-to-alls send each token to the process holding its expert and
bring its output back. Rows, each timed on every process at once (the slowest process's median is
printed; the collectives keep them in step), the same two ways as bench.moe_layer: each pass
synchronised, and back to back:
- the dense MLP of the same FLOPs (every token through one MLP of an expert's size, no
  communication): the limit;
- this project's expert choice, per sequence, every expert on every process (no all-to-all: the
  data-parallel layout), and with the experts sharded;
- this project's token choice, top-1, capacity factor 1 and dropless (uneven splits, sized on the
  host), the experts sharded;
- megablocks 0.10.0 dMoE (grouped, top-1, dropless) with its expert parallelism;
- DeepSpeed 0.19.8 MoE (top-1, capacity factor 1.0, the same MLP as expert), ep_size N.
The layers with equal splits (expert choice, token choice with a capacity) and the dense MLP also
run with the whole pass captured as one CUDA graph, all-to-alls included, as train.cuda_graphs
runs a model; each "x dense" column divides by the dense MLP run the same way. --tiny runs the
eager rows on the CPU (no graphs), to check the script, not to time anything.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import traceback
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor

from bench.common import timed, timed_back_to_back
from bench.moe_layer import (
    PARAM_DTYPE,
    Layer,
    Step,
    add_layer_args,
    cuda_graphed,
    dense_mlp,
    fwd_bwd,
    megablocks_dmoe,
)
from bench.moe_layer import ours as moe_ffn
from mode.layers.moe import MoEFFN
from mode.parallel.expert_parallel import ExpertParallelExperts, create_expert_groups
from mode.parallel.launch import exit_without_teardown

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


ARGS_VARIABLE = "BENCH_EP_LAYER_ARGS"  # the flags, handed to the launched processes


def launch(argv: list[str], nproc: int) -> None:
    """This script again on nproc processes (torch.distributed.run, a free port on this host). The
    flags travel in the environment: after the script's name torch.distributed.run would still read
    a flag that abbreviates one of its own (--nproc)."""
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={nproc}",
               "-m", "bench.ep_layer"]
    env = {**os.environ, ARGS_VARIABLE: json.dumps(argv)}
    raise SystemExit(subprocess.run(command, cwd=ROOT, env=env).returncode)


def ours(args: argparse.Namespace, device: torch.device, group: object | None, **moe: object) -> MoEFFN:
    """This project's MoE FFN (bench.moe_layer's); with group, its experts sharded over the group's processes."""
    torch.manual_seed(0)  # every process the same weights: each keeps its own experts' slice
    ffn = moe_ffn(args, device, **moe)
    if group is not None:
        ffn.experts = ExpertParallelExperts(ffn.experts, group, dist.get_world_size())
    return ffn


def deepspeed_moe(args: argparse.Namespace, device: torch.device) -> Layer:
    from deepspeed.moe.layer import MoE

    layer = MoE(
        hidden_size=args.width, expert=dense_mlp(args), num_experts=args.experts, ep_size=dist.get_world_size(),
        k=1, capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=0, drop_tokens=True, use_rts=False,
    ).to(device=device, dtype=PARAM_DTYPE[args.params])
    layer.set_deepspeed_parallelism()  # its expert group: the one create_expert_groups made
    run = lambda x: layer(x.view(args.batch, args.seq, args.width))[0]  # noqa: E731
    run.params = list(layer.parameters())
    return run


# A row: (name, how it runs: "eager" or "graph", its layer's builder)
Row = tuple[str, str, Callable[[], Layer]]


def rows_of(args: argparse.Namespace, device: torch.device, group: object) -> list[Row]:
    mlp = "SwiGLU" if args.activation == "swiglu" else "GELU"
    dense = lambda: dense_mlp(args).to(device=device, dtype=PARAM_DTYPE[args.params])  # noqa: E731
    replicated = lambda: ours(args, device, None, scheme="expert_choice", group_size=1)  # noqa: E731
    expert_choice = lambda: ours(args, device, group, scheme="expert_choice", group_size=1)  # noqa: E731
    token_choice = lambda: ours(args, device, group, scheme="token_choice", capacity_factor=1.0)  # noqa: E731
    dropless = lambda: ours(args, device, group, scheme="token_choice", dropless=True)  # noqa: E731
    n = dist.get_world_size()
    rows: list[Row] = []
    for how in ("eager", "graph"):
        suffix = "" if how == "eager" else ", one CUDA graph"
        rows += [
            (f"dense {mlp} MLP, same FLOPs (the limit){suffix}", how, dense),
            (f"mode expert choice, every expert on every GPU{suffix}", how, replicated),
            (f"mode expert choice, experts sharded{suffix}", how, expert_choice),
            (f"mode token choice top-1 cf 1.0, experts sharded{suffix}", how, token_choice),
        ]
    rows += [
        ("mode token choice top-1 dropless, experts sharded", "eager", dropless),
        (f"megablocks 0.10.0 dMoE grouped, top-1 dropless, expert parallel {n}", "eager",
         lambda: megablocks_dmoe(args, moe_expert_model_parallelism=True, expert_parallel_group=group)),
        (f"DeepSpeed 0.19.8 MoE top-1, capacity factor 1.0, ep_size {n}", "eager", lambda: deepspeed_moe(args, device)),
    ]
    return rows


def graphed(layer: Layer, x: Tensor) -> Step:
    # The process group's watchdog thread queries CUDA during the capture: only this thread's
    # calls must be capturable.
    return cuda_graphed(layer, x, capture_error_mode="thread_local")


def build(rows: list[Row], x: Tensor) -> list[tuple[str, str, Step | None, str]]:
    """(name, how, one forward+backward pass, failure) per row, each built and run once on every
    process; a row that fails anywhere is reported, never timed (the processes agree on it)."""
    built = []
    for name, how, make in rows:
        step, failure = None, ""
        try:
            if how == "graph" and x.device.type != "cuda":
                raise RuntimeError("CUDA graphs need a GPU")
            layer = make()
            step = graphed(layer, x) if how == "graph" else fwd_bwd(layer, x)
            step()
        except Exception as e:  # a library missing, or the row fails: said in its cell
            if how != "graph" or x.device.type == "cuda":
                traceback.print_exc(limit=2)
            step, failure = None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"
        ok = torch.tensor([step is not None], dtype=torch.int32, device=x.device)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        if step is not None and not ok.item():
            step, failure = None, "failed on another process"
        built.append((name, how, step, failure))
        x.grad = None
    return built


def slowest(value: float, device: torch.device) -> float:
    """The largest of every process's value."""
    t = torch.tensor([value], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2, help="processes, one GPU each")
    add_layer_args(parser)
    parser.add_argument("--tiny", action="store_true", help="the CPU over gloo at a tiny shape: a smoke run")
    if argv is None:  # a launched process takes the launcher's flags; run by hand (torchrun), its own
        argv = json.loads(os.environ[ARGS_VARIABLE]) if ARGS_VARIABLE in os.environ else sys.argv[1:]
    args = parser.parse_args(argv)
    if args.tiny:
        args.batch, args.seq, args.width, args.ffn, args.experts, args.warmup, args.iters = 2, 32, 32, 64, 4, 1, 2
        args.params = "fp32"
    elif not torch.cuda.is_available() or torch.cuda.device_count() < args.nproc:
        parser.error(f"--nproc {args.nproc} needs that many GPUs (--tiny runs on the CPU)")
    if "LOCAL_RANK" not in os.environ:
        launch(argv, args.nproc)
    run(args)
    exit_without_teardown(0)  # as launch/train.py leaves: gloo's teardown once aborted a finished run


def run(args: argparse.Namespace) -> None:
    import deepspeed

    rank = int(os.environ["LOCAL_RANK"])
    device = torch.device("cpu") if args.tiny else torch.device("cuda", rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    deepspeed.init_distributed(dist_backend="gloo" if args.tiny else "nccl", verbose=False)
    group = create_expert_groups(dist.get_world_size())
    torch.manual_seed(100 + dist.get_rank())  # each process its own tokens
    x = torch.randn(args.batch, args.seq, args.width, device=device, dtype=PARAM_DTYPE[args.params],
                    requires_grad=True)
    layers = build(rows_of(args, device, group), x)
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, _, step, _ in layers if step}
    for _ in range(args.rounds):
        for name, _, step, _ in layers:
            if step is not None:
                dist.barrier()
                times[name][0].append(slowest(timed(step, args.warmup, args.iters, device), device))
                times[name][1].append(slowest(timed_back_to_back(step, 2, args.iters, device), device))
    if dist.get_rank() == 0:
        print_table(args, device, layers, times)
    dist.barrier()
    dist.destroy_process_group()


def print_table(args: argparse.Namespace, device: torch.device, layers: list[tuple[str, str, Step | None, str]],
                times: dict[str, tuple[list[float], list[float]]]) -> None:
    n = dist.get_world_size()
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
    compute = "bf16 autocast" if device.type == "cuda" else "float32"
    print(f"\n{n} x {card}; torch {torch.__version__}; a process's tokens {args.batch} x {args.seq}, D={args.width}, "
          f"expert hidden {args.ffn}, {args.experts} {args.activation} experts ({args.experts // n} a process where "
          f"sharded), {args.params} weights, {compute}, fwd+bwd; {args.rounds} interleaved round(s), each cell "
          "the median over them of the slowest process's median; \"x dense\" divides by the dense MLP run the same "
          "way (eager or one CUDA graph)\n")
    print("| implementation | ms, each pass synchronised | x dense | ms, back to back | x dense |")
    print("| --- | --- | --- | --- | --- |")
    medians = {name: [statistics.median(t) for t in pair] for name, pair in times.items()}
    dense = {how: medians.get(name) for name, how, _, _ in layers if name.startswith("dense ")}
    for name, how, step, failure in layers:
        if step is None:
            print(f"| {name} | not run: {failure} | | | |")
            continue
        base = dense.get(how)
        cells = [f"{value:.2f} | {value / base[i]:.2f}" if base else f"{value:.2f} | -"
                 for i, value in enumerate(medians[name])]
        print(f"| {name} | {' | '.join(cells)} |", flush=True)


if __name__ == "__main__":
    main()
