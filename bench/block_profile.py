"""One dense block against one MoD block, and the routing ops a MoD block adds, on one GPU.

    python -m bench.block_profile          # B=8, S=2048, D=1024, 16 heads, SwiGLU 2816, capacity 12.5%
    python -m bench.block_profile --tiny   # CPU smoke run (host times; "kernels" are CPU ops there)

Where a routed block's time goes in eager mode (--compile: compiled), under bf16 autocast with the
matrices held in bf16 as `python -m mode.train` holds them on a GPU (train.bf16_weights;
--weights float32: float32 weights that autocast casts each pass). Table 1, forward+backward of
each piece with an incoming gradient:
- wall ms: median over --iters passes, each synchronised (CUDA events);
- kernel ms and kernels: the sum of the kernels' own times per pass under torch.profiler
  (on CPU: every op's own time, and every op event, nested ones included);
- host ms: the median time the host spends queuing a pass from an idle GPU, not waiting for it
  (bench.common.host_queue_ms; on CPU the pass's own time).
A piece whose host time exceeds its kernel time is bound by the host launching kernels. Below the
table, the same for a [dense, MoD] pair of blocks, the period of bench/mod_step.py's model: where
the pair's host time exceeds its kernel time, that model's eager pass runs at the host's pace.
Pieces: the dense block on every token; the MoD block (route, block on the chosen tokens,
gate, add back); the block alone on k tokens; routing alone (route, gate, add back, no block).
Table 2, the kernel time of single routing ops per call: top-k, sorting the chosen positions
(int64, and int32 as mode.routing.top_k_positions's PyTorch path does), top_k_positions with
and without its Triton kernel (mode/kernels/topk.py) at the MoD shape and at expert choice's
(8 experts, each its top S/8), and a copy of the residual.
--top N also prints the N costliest kernels of each block.
--kinds moe mode_staged mode_integrated adds a row for each of those blocks (block_kinds' expert
settings: 8 experts, expert choice), and a table of where each block's kernel time goes (matrix
products, attention, sorting and top-k, the rest) against the dense block's, scaled by the
block's forward FLOPs (mode.flops): a kind whose time per FLOP exceeds dense's shows which
category costs it. --noop-kinds zero copy constant gives Integrated MoDE a row for each kind of
no-op expert (moe.noop_kind; default zero), in the same run.
--compile compiles every block of table 1 (the dense, the MoD and the --kinds blocks), each its
own graph, and leaves out the two pieces that are not a block.
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

from bench.common import host_queue_ms, precision, require_cuda_unless_tiny, timed
from mode.config import BLOCK_KINDS, config_from_dict
from mode.flops import model_flops
from mode.kernels import use_kernels
from mode.model import LanguageModel
from mode.routing import add_gated_tokens, capacity_to_k, top_k_positions
from mode.training.bf16_weights import hold_in_bf16_, matrix_weights

PROFILED_PASSES = 5
ROUTED_KINDS = tuple(k for k in BLOCK_KINDS if k not in ("dense", "mod"))
NOOP_KINDS = ("zero", "copy", "constant")
# Kernel-name fragments of each category of table 3, checked in this order; the rest is "other".
CATEGORIES = (("matrix products", ("gemm", "cutlass", "nvjet", "matmul", "sm90_x", "sm80_x", "bmm", "grouped", "::mm", "addmm")),
              ("attention", ("flash", "fmha", "attention", "cudnn", "sdpa")),
              ("sort, top-k, scan", ("sort", "topk", "radix", "scan", "cub", "top_k", "select")))


def build(args: argparse.Namespace, device: torch.device) -> LanguageModel:
    """A two-block model [dense, mod] of the benchmark's shape: its blocks are what is timed."""
    cfg = config_from_dict({
        "model": {"vocab_size": 256, "d_model": args.width, "n_heads": args.heads, "n_layers": 2,
                  "d_ff": args.ffn, "max_seq_len": args.seq, "block_pattern": ["dense", "mod"]},
        "routing": {"capacity": args.capacity, "gate": "sigmoid"},
        "data": {"seq_len": args.seq},
    }, "bench/block_profile.py")
    return LanguageModel(cfg).to(device)


def kind_block(kind: str, args: argparse.Namespace, device: torch.device, noop_kind: str = "zero"
               ) -> tuple[torch.nn.Module, float]:
    """The second block of a [dense, kind] model at the benchmark's shape (block_kinds' expert
    settings; Integrated MoDE's no-op experts of noop_kind), and its forward FLOPs per token over
    the dense block's."""
    from bench.block_kinds import kind_config

    shape = argparse.Namespace(vocab=256, width=args.width, heads=args.heads, layers=2, ffn=args.ffn, seq=args.seq,
                               experts=args.experts, noop=args.experts)
    config = kind_config(kind, shape, {"noop_kind": noop_kind} if kind == "mode_integrated" else None)
    per_block = model_flops(config).per_block
    return LanguageModel(config).to(device).blocks[1], per_block[1] / per_block[0]


def category(kernel: str) -> str:
    name = kernel.lower()
    return next((label for label, parts in CATEGORIES if any(p in name for p in parts)), "other")


def print_categories(profiles: dict[str, list[tuple[str, float]]], flop_ratio: dict[str, float]) -> None:
    """Each block's kernel ms per category, and its total over the dense block's scaled by FLOPs."""
    labels = [label for label, _ in CATEGORIES] + ["other"]
    print("\n| block (forward+backward) | " + " | ".join(f"{label} ms" for label in labels)
          + " | total ms | FLOPs / dense | time per FLOP / dense |")
    print("|" + " --- |" * (len(labels) + 4))
    dense_total = sum(t for _, t in profiles["dense block"]) / PROFILED_PASSES / 1e3
    for name, ratio in flop_ratio.items():
        split = dict.fromkeys(labels, 0.0)
        for kernel, t in profiles[name]:
            split[category(kernel)] += t / PROFILED_PASSES / 1e3
        total = sum(split.values())
        print(f"| {name} | " + " | ".join(f"{split[label]:.3f}" for label in labels)
              + f" | {total:.3f} | {ratio:.3f} | {total / dense_total / ratio:.3f} |")


def kernels_of(fn: Callable[[], None], device: torch.device) -> list[tuple[str, float]]:
    """(name, microseconds) of every kernel (CPU: every op's own time) over PROFILED_PASSES passes."""
    fn()
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILED_PASSES):
            fn()
        if cuda:
            torch.cuda.synchronize()
    if cuda:
        return [(e.name, e.device_time) for e in prof.events() if e.device_type.name == "CUDA"]
    return [(e.name, e.self_cpu_time_total) for e in prof.events()]


def print_pair(host_ms: dict[str, float], kernel_ms: dict[str, float]) -> None:
    """A [dense, MoD] pair: the host's time queuing it against its kernels' time."""
    host = host_ms["dense block"] + host_ms["MoD block"]
    kernel = kernel_ms["dense block"] + kernel_ms["MoD block"]
    pace = "host-bound: the host sets the pace" if host > kernel else "kernel-bound"
    print(f"a [dense, MoD] pair: the host queues it in {host:.3f} ms for {kernel:.3f} ms of kernels ({pace}); "
          f"the MoD block takes {host_ms['MoD block'] / host_ms['dense block']:.2f} x the dense block's host time "
          f"and {kernel_ms['MoD block'] / kernel_ms['dense block']:.2f} x its kernel time")


def _top_k_positions_with(kernel: bool, scores: Tensor, k: int) -> Tensor:
    """mode.routing.top_k_positions with its Triton kernel allowed (where it applies) or not."""
    with use_kernels(topk=kernel):
        return top_k_positions(scores, k)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--ffn", type=int, default=2816, help="SwiGLU hidden width")
    parser.add_argument("--capacity", type=float, default=0.125)
    parser.add_argument("--iters", type=int, default=40)
    parser.add_argument("--top", type=int, default=0, help="also print each block's N costliest kernels")
    parser.add_argument("--compile", action="store_true",
                        help="torch.compile each block (table 1 then has the blocks' rows only)")
    parser.add_argument("--kinds", nargs="*", choices=ROUTED_KINDS, default=[],
                        help="also profile these block kinds, with a table of where their kernel time goes")
    parser.add_argument("--noop-kinds", nargs="+", choices=NOOP_KINDS, default=["zero"],
                        help="Integrated MoDE (--kinds mode_integrated): a row for each of these kinds of no-op expert")
    parser.add_argument("--experts", type=int, default=8, help="experts of the --kinds blocks (and no-op experts of Integrated MoDE)")
    parser.add_argument("--weights", choices=["bf16", "float32"], default="bf16",
                        help="the matrices (attention, FFNs, experts) on a GPU: bf16 as mode.train holds them "
                             "(train.bf16_weights), or float32 cast by autocast each pass (CPU: float32 always)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at a small shape")
    args = parser.parse_args(argv)
    require_cuda_unless_tiny(parser, args)
    if args.noop_kinds != ["zero"] and "mode_integrated" not in args.kinds:
        parser.error("--noop-kinds sets Integrated MoDE's no-op experts: name mode_integrated in --kinds")
    if args.tiny:
        args.batch, args.seq, args.width, args.heads, args.ffn, args.iters, args.experts = 2, 64, 32, 2, 64, 3, 4
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    torch.manual_seed(0)
    model = build(args, device)
    bf16 = device.type == "cuda" and args.weights == "bf16"  # autocast runs on CUDA only
    if bf16:
        hold_in_bf16_(matrix_weights(model))  # as mode.train holds them (train.bf16_weights)
    dense, mod = model.blocks[0], model.blocks[1]
    # The MoD block adds its updates into x in place, as inside the model: x drifts by the
    # updates from pass to pass, which changes which tokens are chosen, not what a pass costs.
    # Likewise its backward adds the chosen tokens' gradient into the incoming gradient `grad`
    # in place (residual_owned=True), as into the model's residual gradient: `grad` drifts too.
    angles = model.rotary.prefix(args.seq)
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
    x = torch.randn(args.batch, args.seq, args.width, device=device, requires_grad=True)
    grad = torch.randn_like(x)
    k = capacity_to_k(args.seq, args.capacity)
    x_k = torch.randn(args.batch, k, args.width, device=device, requires_grad=True)
    grad_k = torch.randn_like(x_k)

    def fresh_gradients(module: torch.nn.Module = model) -> None:  # each pass writes its gradients anew
        x.grad = x_k.grad = None
        for p in module.parameters():
            p.grad = None

    def fwd_bwd(block: torch.nn.Module) -> Callable[[], None]:
        def run() -> None:
            with autocast:
                out, _ = block(x, angles, residual_owned=True)  # as the model calls it
            out.backward(grad)
            fresh_gradients(block)  # a --kinds block is not the model's: no accumulation kernels either
        return run

    with torch.no_grad(), autocast:
        chosen_angles = angles.select(mod.router(x).positions)  # (B, k, 1, hd)

    def block_on_k_tokens() -> None:
        with autocast:
            update, _ = mod.block.routed_update(x_k, chosen_angles)
        update.backward(grad_k)
        fresh_gradients()

    def routing_alone() -> None:
        with autocast:  # as MoDBlock.forward routes and adds back, in place where the block would
            routed = mod.router.route(x, owns_gradient=True)
            routing = routed.routing
            out = add_gated_tokens(routed.residual, routing.positions, routing.gates, routed.chosen,
                                   routed.residual_writable, routed.flat)
        out.backward(grad)
        fresh_gradients()

    pieces = {"dense block": fwd_bwd(dense), "MoD block": fwd_bwd(mod),
              f"the block alone on k={k} tokens": block_on_k_tokens, "routing alone (route, gate, add back)": routing_alone}
    per_block = model_flops(model.config).per_block  # the [dense, mod] model's own blocks
    flop_ratio = {"dense block": 1.0, "MoD block": per_block[1] / per_block[0]}
    blocks = {"dense block": dense, "MoD block": mod}
    for kind in args.kinds:
        for noop_kind in args.noop_kinds if kind == "mode_integrated" else ["zero"]:
            name = f"{kind} block" + ("" if noop_kind == "zero" else f", {noop_kind} null experts")
            blocks[name], flop_ratio[name] = kind_block(kind, args, device, noop_kind)
            if bf16:
                hold_in_bf16_(matrix_weights(blocks[name]))
            pieces[name] = fwd_bwd(blocks[name])
    if args.compile:  # each block one compiled graph (the MoD block then routes with plain ops)
        pieces = {name: fwd_bwd(torch.compile(block)) for name, block in blocks.items()}
    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    print(f"card: {card}; torch {torch.__version__}; B={args.batch} S={args.seq} D={args.width} heads={args.heads} "
          f"ffn={args.ffn} capacity={args.capacity} (k={k}); {'compiled' if args.compile else 'eager'}, "
          f"{precision(device)}, {'bf16' if bf16 else 'float32'} matrices\n")
    print("| forward+backward | wall ms | kernel ms | kernels | host ms |")
    print("| --- | --- | --- | --- | --- |")
    profiles, kernel_ms, host_ms = {}, {}, {}
    for name, run in pieces.items():
        kernels = kernels_of(run, device)
        profiles[name] = kernels
        kernel_ms[name] = sum(t for _, t in kernels) / PROFILED_PASSES / 1e3
        wall = timed(run, 3, args.iters, device)
        host_ms[name] = host_queue_ms(run, args.iters, device)
        print(f"| {name} | {wall:.3f} | {kernel_ms[name]:.3f} | {len(kernels) / PROFILED_PASSES:.0f} | "
              f"{host_ms[name]:.3f} |", flush=True)
    print(f"\n(the dense block's kernel time x capacity: {kernel_ms['dense block'] * args.capacity:.3f} ms)")
    print_pair(host_ms, kernel_ms)
    print_categories(profiles, flop_ratio)

    scores = torch.randn(args.batch, args.seq, device=device)
    chosen = scores.topk(k, dim=-1, sorted=False).indices
    residual = torch.randn(args.batch * args.seq, args.width, device=device)
    # Expert choice's shape: 8 experts each take its top S/8 of every sequence.
    expert_scores = torch.rand(args.batch, 8, args.seq, device=device)
    ops: dict[str, Callable[[], object]] = {
        f"top-k of {k} in ({args.batch}, {args.seq}) scores, unsorted": lambda: scores.topk(k, dim=-1, sorted=False),
        "sort the chosen positions, int64": lambda: chosen.sort(dim=-1),
        "sort the chosen positions, int32 (and back)": lambda: chosen.int().sort(dim=-1).values.long(),
        "top_k_positions, torch: top-k and int32 sort": lambda: _top_k_positions_with(False, scores, k),
        "top_k_positions as routers run it (CUDA: one Triton kernel)": lambda: _top_k_positions_with(True, scores, k),
        f"expert choice ({args.batch}, 8, {args.seq}), top {args.seq // 8}, torch": lambda: _top_k_positions_with(False, expert_scores, args.seq // 8),
        f"expert choice ({args.batch}, 8, {args.seq}), as routers run it": lambda: _top_k_positions_with(True, expert_scores, args.seq // 8),
        f"copy the float32 residual ({args.batch * args.seq} x {args.width})": lambda: residual.clone(),
    }
    print("\n| op | kernel us per call | kernels |")
    print("| --- | --- | --- |")
    for name, op in ops.items():
        kernels = kernels_of(op, device)
        print(f"| {name} | {sum(t for _, t in kernels) / PROFILED_PASSES:.1f} | {len(kernels) / PROFILED_PASSES:.0f} |")

    for name in [n for n in profiles if n in flop_ratio] if args.top else []:  # the blocks
        print(f"\n### {name}: the {args.top} costliest kernels (us per pass, launches per pass)")
        totals: dict[str, list[float]] = {}
        for kernel, t in profiles[name]:
            entry = totals.setdefault(kernel[:90], [0.0, 0.0])
            entry[0] += t / PROFILED_PASSES
            entry[1] += 1 / PROFILED_PASSES
        for kernel, (t, n) in sorted(totals.items(), key=lambda kv: -kv[1][0])[: args.top]:
            print(f"{t:9.1f} us {n:4.0f}x  {kernel}")


if __name__ == "__main__":
    main()
