"""One MoE FFN layer, forward+backward, bf16, on one GPU: this project against megablocks and DeepSpeed.

    python -m bench.moe_layer            # D=1024, expert hidden 4096, 8 experts, 8 x 2048 tokens, top-1 / capacity 1

Rows, all measured in the same process on the same card, two ways: each pass on its own (the
median of --iters passes after --warmup, the GPU idle at the start of each, so a pass also pays
the host's launch latency), and back to back (the mean of --iters passes queued without a
synchronisation between them, as the layers of a training step run). Rows:
- the dense MLP of the same FLOPs (every token through one MLP of the expert's size): the limit;
- this project's expert choice (per sequence and per batch group), `torch` backend;
- the dense MLP, expert choice and token choice (cf 1, dropless on torch) with the whole eager
  pass captured as one CUDA graph (as train.cuda_graphs runs a model: the GPU's time alone), expert
  choice also with its router head as PyTorch ops instead of its one-function dispatch
  (--expert-choice), the routed ones also with their rows moved by gather / scatter_add instead of
  the token-major kernels (--rows; expert choice then wholly PyTorch ops; dropless then masks the
  rows past its grouped GEMMs' end); not with --compile;
- with --compile: the dense MLP, expert choice and token choice (cf 1, and dropless on torch)
  compiled, and compiled with torch.compile's CUDA graphs (mode="reduce-overhead");
- this project's token choice, top-1, capacity factor 1 (torch) and dropless (torch: torch._grouped_mm
  with no host sync, eager and as one CUDA graph; grouped_gemm; megablocks);
- megablocks 0.10.0 dMoE (mlp_impl="grouped", top-1, dropless);
- DeepSpeed 0.19.8 MoE (top-1, capacity factor 1.0, the same MLP as expert).
--activation gelu (default, the layer benchmark's reference) or swiglu (the library's default experts: the
dense MLP and DeepSpeed's expert are mode.layers.mlp.SwiGLU, megablocks runs its GLU with SiLU).
--busy adds each row's GPU busy time (the union of its kernels' intervals under the profiler, per
pass): what the GPU spent, without the host's launch gaps that bind the eager rows' wall time; and
the host's time queuing a pass (the median of --iters, from an idle GPU, not waiting for it): where
it exceeds the GPU busy time, the host, not the GPU, sets the row's pace.
A row whose library is missing is printed as such, never as a time. --rounds N times every row N
times, interleaved (row 1, row 2, ..., row 1, ...), and prints the median of each cell: rows bound by
the host's kernel launches vary from pass to pass with the machine's load.

--params bf16 (default) stores every layer's weights in bfloat16, as bf16 training with
DeepSpeed or megablocks does; --params fp32 keeps float32 weights under bf16 autocast (each
step then also casts every weight and its gradient: 8x the dense layer's parameters).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import traceback
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.common import (
    GeluMLP,
    add_routing_switches,
    apply_routing_switches,
    gpu_busy_ms,
    host_queue_ms,
    profile_report,
    require_cuda,
    timed,
    timed_back_to_back,
)
from mode.config import MoEConfig
from mode.kernels import use_kernels
from mode.layers.mlp import SwiGLU
from mode.layers.moe import MoEFFN

PARAM_DTYPE = {"bf16": torch.bfloat16, "fp32": torch.float32}


def parameters_of(layer: Callable[[Tensor], Tensor]) -> list[nn.Parameter]:
    """A row's parameters: an nn.Module's, or those a wrapping lambda carries in .params."""
    return list(layer.parameters()) if isinstance(layer, nn.Module) else list(getattr(layer, "params", []))


Layer = Callable[[Tensor], Tensor]
Step = Callable[[], None]


# How a pass's backward starts: "grad", y.backward(a fixed bf16 gradient), the layer alone; "sum",
# y.float().sum().backward(), as the tables before this option were measured: a float32 copy of y,
# its sum, and the gradient's cast back to bf16 add about 110 us of kernels to every row (an H100
# profile at the default shape).
UPSTREAM = "grad"


def fwd_bwd(layer: Callable[[Tensor], Tensor], x: Tensor) -> Callable[[], None]:
    params = parameters_of(layer)
    grad = torch.randn(x.shape, device=x.device, generator=torch.Generator(x.device).manual_seed(1)).to(torch.bfloat16)

    def run() -> None:
        # Fresh gradients each pass, as training with zero_grad(set_to_none=True) (a CUDA-graphed
        # backward also owns the tensors it returns), and a new step for torch.compile's CUDA
        # graphs (mode="reduce-overhead").
        x.grad = None
        for p in params:
            p.grad = None
        torch.compiler.cudagraph_mark_step_begin()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x)
            y = y[0] if isinstance(y, tuple) else y
        if UPSTREAM == "sum":
            y.float().sum().backward()
        else:
            y.backward(grad.to(y.dtype))  # a no-op cast for bf16 outputs

    return run


def ours(args: argparse.Namespace, device: torch.device | str = "cuda", **moe: object) -> MoEFFN:
    cfg = MoEConfig(n_experts=args.experts, activation=args.activation, d_expert=args.ffn, **moe)
    return MoEFFN(args.width, args.ffn, cfg).to(device=device, dtype=PARAM_DTYPE[args.params])


def with_switch(op: str, enabled: bool, layer: Layer) -> Layer:
    """layer run with the kernel policy's `op` (rows, expert_choice) set as given, and restored: an
    eager MoE layer with and without some kernels in one process."""

    def run(x: Tensor) -> Tensor:
        with use_kernels(**{op: enabled}):
            return layer(x)

    run.params = parameters_of(layer)
    return run


def cuda_graphed(layer: Layer, x: Tensor, capture_error_mode: str = "global") -> Step:
    """The whole forward+backward pass of fwd_bwd(layer, x) captured once as one CUDA graph (the
    eager kernels, or a compiled layer's without its own graphs); each call replays it. As
    train.cuda_graphs does for a model: no host work per kernel, and no copies in or out.
    capture_error_mode: torch.cuda.graph's ("thread_local" where other threads use CUDA meanwhile)."""
    run = fwd_bwd(layer, x)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up on a side stream, as capture requires
        for _ in range(3):
            run()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=capture_error_mode):
        run()

    def replay() -> None:
        graph.replay()

    # The graph reads memory it does not own: the layer's weights and the upstream gradient, which
    # run's closure holds. Kept alive with the graph (freed, their blocks could be handed out again).
    replay.captured = run
    return replay


def dense_mlp(args: argparse.Namespace) -> nn.Module:
    """The MLP of one expert's size (--activation): the dense baseline, and DeepSpeed's expert."""
    return SwiGLU(args.width, args.ffn) if args.activation == "swiglu" else GeluMLP(args.width, args.ffn)


def megablocks_dmoe(args: argparse.Namespace, **parallelism: object) -> Callable[[Tensor], Tensor]:
    """megablocks' dMoE on this GPU; parallelism: its Arguments' expert-parallel fields (bench.ep_layer)."""
    from megablocks.layers.arguments import Arguments
    from megablocks.layers.dmoe import dMoE
    from megablocks.layers.moe import clear_load_balancing_loss

    margs = Arguments(
        hidden_size=args.width, ffn_hidden_size=args.ffn, moe_num_experts=args.experts, moe_top_k=1,
        mlp_impl="grouped", bf16=True, fp16=False, device=torch.cuda.current_device(),
        # the activation of every other row: megablocks' default GELU is the tanh approximation
        **(dict(mlp_type="glu", activation_fn=F.silu) if args.activation == "swiglu" else dict(mlp_type="mlp", activation_fn=F.gelu)),
        **parallelism,
    )
    layer = dMoE(margs).cuda().to(PARAM_DTYPE[args.params])

    def run(x: Tensor) -> Tensor:
        y = layer(x.view(args.batch, args.seq, args.width))[0]
        clear_load_balancing_loss()  # dMoE saves its loss's inputs for the training loop in a global list
        return y

    run.params = list(layer.parameters())
    return run


def deepspeed_moe(args: argparse.Namespace) -> Callable[[Tensor], Tensor]:
    import deepspeed
    from deepspeed.moe.layer import MoE

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0")
    deepspeed.init_distributed(dist_backend="nccl", verbose=False)
    layer = MoE(
        hidden_size=args.width, expert=dense_mlp(args), num_experts=args.experts, ep_size=1, k=1,
        capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=0, drop_tokens=True, use_rts=False,
    ).cuda().to(PARAM_DTYPE[args.params])
    run = lambda x: layer(x.view(args.batch, args.seq, args.width))[0]  # noqa: E731
    run.params = list(layer.parameters())
    return run


def add_layer_args(parser: argparse.ArgumentParser) -> None:
    """The layer's shape, its timing and its weights: the flags bench.moe_layer and bench.ep_layer share."""
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=4096)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=1, help="time every row this many times, interleaved; the median")
    parser.add_argument("--params", choices=sorted(PARAM_DTYPE), default="bf16", help="weight storage dtype")
    parser.add_argument("--activation", choices=["gelu", "swiglu"], default="gelu",
                        help="the experts' MLP, and the dense MLP's and the libraries' experts")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_layer_args(parser)
    parser.add_argument("--compile", action="store_true", help="also time this project's layers under torch.compile")
    parser.add_argument("--profile", nargs="*", default=[], metavar="ROW",
                        help="print the top GPU kernels of the rows whose name contains ROW")
    parser.add_argument("--busy", action="store_true",
                        help="add a column: each row's GPU busy time (the kernels alone, under the profiler), "
                             "which eager rows bound by the host's launches do not show in wall time")
    parser.add_argument("--upstream", choices=["grad", "sum"], default="grad",
                        help="grad: each pass's backward from a fixed bf16 gradient of the output (the layer alone); "
                             "sum: from y.float().sum(), as the tables before this option (about 110 us more a row)")
    add_routing_switches(parser)
    args = parser.parse_args(argv)
    require_cuda(parser)  # GPU kernels only: no CPU mode to fall back to
    apply_routing_switches(args)
    global UPSTREAM
    UPSTREAM = args.upstream
    torch.manual_seed(0)
    x = torch.randn(args.batch, args.seq, args.width, device="cuda", dtype=PARAM_DTYPE[args.params], requires_grad=True)

    Row = tuple[str, Callable[[], Layer], str]
    graphs = dict(mode="reduce-overhead")

    def family(eager_name: str, stem: str, tag: str, build: Callable[[], Layer], routed: bool,
               expert_choice: bool = False) -> list[Row]:
        """A layer's eager row and its variants, each (name, build, how the pass runs: "eager" from
        the host, or "graph": the whole eager pass captured as one CUDA graph, as train.cuda_graphs
        runs a model: the kernels alone, no host in between). With --compile: compiled, and compiled
        with torch.compile's CUDA graphs (mode="reduce-overhead"). Without: as one CUDA graph, expert
        choice also with its router head as PyTorch ops (its rows still through the row kernels), a
        routed layer also with its rows moved by gather / scatter_add (and, for expert choice, its
        router head as PyTorch ops: the eager PyTorch path). (Not both in one process: on
        torch 2.11 a graph captured by hand faulted with an illegal address on replay in a process
        that had also run reduce-overhead rows; each alone ran right.)"""
        name = lambda mode: f"{stem} ({tag + ', ' if tag else ''}{mode})"  # noqa: E731
        if args.compile:
            rows = [(eager_name, build, "eager"), (name("compiled"), lambda: torch.compile(build()), "eager"),
                    (name("compiled + CUDA graphs"), lambda: torch.compile(build(), **graphs), "eager")]
            modes = ["eager", "compiled", "compiled + CUDA graphs"]
        else:
            rows = [(eager_name, build, "eager"), (name("one CUDA graph"), build, "graph")]
            if expert_choice:
                rows.append((name("one CUDA graph, router head by PyTorch ops"),
                             lambda: with_switch("expert_choice", False, build()), "graph"))
            if routed:
                rows.append((name("one CUDA graph, rows by gather/scatter_add"),
                             lambda: with_switch("rows", False, build()), "graph"))
            modes = ["eager"] + ["one CUDA graph"] * (len(rows) - 1)
        run_mode.update({row[0]: mode for row, mode in zip(rows, modes)})
        return rows

    # How each row runs (eager, one CUDA graph, compiled, ...): its "x dense" columns divide by
    # the dense MLP run the same way. Rows outside a family run eager.
    run_mode: dict[str, str] = {}

    dense = lambda: dense_mlp(args).cuda().to(PARAM_DTYPE[args.params])  # noqa: E731
    mlp = "SwiGLU" if args.activation == "swiglu" else "GELU"
    expert_choice = lambda: ours(args, scheme="expert_choice", group_size=1)  # noqa: E731
    token_choice = lambda: ours(args, scheme="token_choice", capacity_factor=1.0)  # noqa: E731
    dropless = lambda: ours(args, scheme="token_choice", dropless=True)  # noqa: E731
    # Static shapes only go into CUDA graphs: expert choice, token choice with a capacity, and
    # dropless on the torch backend (torch._grouped_mm reads its group ends on the device);
    # dropless on grouped_gemm sizes its groups on the host, and megablocks' path syncs with it.
    rows: list[Row] = [
        *family(f"dense {mlp} MLP, same FLOPs (the limit)", f"dense {mlp} MLP", "", dense, routed=False),
        *family("mode expert choice, per sequence (torch)", "mode expert choice, per sequence", "torch",
                expert_choice, routed=True, expert_choice=True),
        ("mode expert choice, batch group (torch)", lambda: ours(args, scheme="expert_choice", group_size=args.batch),
         "eager"),
        *family("mode token choice top-1 cf 1.0 (torch)", "mode token choice top-1 cf 1.0", "torch", token_choice,
                routed=True),
        *family("mode token choice top-1 dropless (torch)", "mode token choice top-1 dropless", "torch", dropless,
                routed=True),
        ("mode token choice top-1 dropless (grouped_gemm)",
         lambda: ours(args, scheme="token_choice", dropless=True, backend="grouped_gemm"), "eager"),
        ("mode token choice top-1 dropless (megablocks)",
         lambda: ours(args, scheme="token_choice", dropless=True, backend="megablocks"), "eager"),
        ("megablocks 0.10.0 dMoE grouped, top-1 dropless", lambda: megablocks_dmoe(args), "eager"),
        ("DeepSpeed 0.19.8 MoE top-1, capacity factor 1.0", lambda: deepspeed_moe(args), "eager"),
    ]
    print(f"card: {torch.cuda.get_device_name()}; torch {torch.__version__}; tokens {args.batch} x {args.seq}, "
          f"D={args.width}, expert hidden {args.ffn}, {args.experts} {mlp} experts, {args.params} weights, bf16 autocast, fwd+bwd, "
          f"top-k {args.topk}, "
          f"token choice slots {args.slot_choice}, MoE rows {args.rows}, "
          f"expert choice dispatch {args.expert_choice}, backward from {'a fixed gradient' if args.upstream == 'grad' else 'y.float().sum()'}\n")
    layers = build_rows(rows, x)
    # Interleaved rounds: row 1, row 2, ..., row 1, ...; each cell is the median over the rounds.
    # Rows that launch many small kernels from the host (eager token choice, megablocks, DeepSpeed)
    # vary with the host from pass to pass; one round measures each row at one moment only.
    times: dict[str, tuple[list[float], list[float]]] = {name: ([], []) for name, step, _ in layers if step is not None}
    busy: dict[str, list[float]] = {name: [] for name in times}  # --busy: GPU busy ms, one per round
    host: dict[str, list[float]] = {name: [] for name in times}  # --busy: the host's ms queuing a pass
    for _ in range(args.rounds):
        for name, step, _ in layers:
            if step is not None:
                print(f"timing: {name}", file=sys.stderr, flush=True)
                times[name][0].append(timed(step, args.warmup, args.iters, x.device))
                times[name][1].append(timed_back_to_back(step, 2, args.iters, x.device))
                if args.busy:
                    busy[name].append(gpu_busy_ms(step, args.iters))
                    host[name].append(host_queue_ms(step, args.iters))
    print(f"\n{args.rounds} interleaved round(s), each cell the median over them; each \"x dense\" divides by "
          "the dense MLP run the same way (eager, one CUDA graph, compiled, compiled + CUDA graphs)\n")
    busy_head = (" GPU busy ms | x dense | host ms queuing a pass |", " --- | --- | --- |") if args.busy else ("", "")
    print("| implementation | ms, each pass synchronised | x dense | ms, back to back | x dense |" + busy_head[0])
    print("| --- | --- | --- | --- | --- |" + busy_head[1])
    medians = {name: [statistics.median(t) for t in (*times[name], busy[name]) if t] for name in times}
    dense_rows = {run_mode[name]: name for name, step, _ in layers if name.startswith("dense ") and name in medians}
    for name, step, failure in layers:
        if step is None:
            print(f"| {name} | not run: {failure} | | | |" + " | | |" * args.busy)
            continue
        cells = f"| {name} |"
        dense = medians.get(dense_rows.get(run_mode.get(name, "eager"), ""))  # None: that dense row did not run
        for i, value in enumerate(medians[name]):
            # a pass the profiler saw no kernel of (a CUDA graph, on some setups): said, not a 0
            shown = "no kernels seen" if i == 2 and not value else f"{value:.{3 if i == 2 else 2}f}"
            ratio = f"{value / dense[i]:.{3 if i == 2 else 2}f}" if dense and value and dense[i] else "-"
            cells += f" {shown} | {ratio} |"
        if args.busy:
            cells += f" {statistics.median(host[name]):.2f} |"
        print(cells, flush=True)
    for name, step, _ in layers:
        if step is not None and any(p in name for p in args.profile):
            print_profile(name, step)


def build_rows(rows: list[tuple[str, Callable[[], Layer], str]], x: Tensor) -> list[tuple[str, Step | None, str]]:
    """(name, one forward+backward pass, failure) per row, each built and run once (compiled rows
    compile here); the pass None where its library is missing or it fails, with why: reported, never
    timed. Each eager pass starts from fresh gradients; a graphed pass rewrites its graph's own."""
    layers: list[tuple[str, Step | None, str]] = []
    for name, build, how in rows:
        try:
            layer = build()
            step = cuda_graphed(layer, x) if how == "graph" else fwd_bwd(layer, x)
            step()
            layers.append((name, step, ""))
        except Exception as e:
            traceback.print_exc(limit=2)
            layers.append((name, None, f"{type(e).__name__}: {str(e).splitlines()[0][:80]}"))
        x.grad = None
    return layers


def print_profile(name: str, run: Step) -> None:
    run()
    print(profile_report(run, 3, torch.device("cuda"), f"{name}, forward+backward", 22))


if __name__ == "__main__":
    main()
