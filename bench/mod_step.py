"""MoD vs dense: training-step time, peak memory and the analytic FLOP ratio, on one GPU.

    python bench/mod_step.py                 # seq 2048, width 1024, 12 layers, bf16, B=8
    python bench/mod_step.py --tiny          # a CPU-sized smoke run of the same script

Both models have the same shape; the MoD model routes 12.5% of each sequence through every
other block. Measured in the same process, same card: forward+backward, and the whole step
with fused AdamW, eager and torch.compile. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/common.py, however this is started
from common import add_model_args, timed  # noqa: E402

from mode.config import Config, config_from_dict
from mode.flops import model_flops
from mode.model import LanguageModel
from mode.routing import primitives


def make_config(pattern: list[str], args: argparse.Namespace) -> Config:
    return config_from_dict(
        {
            "model": {
                "vocab_size": args.vocab,
                "d_model": args.width,
                "n_heads": args.heads,
                "n_layers": args.layers,
                "d_ff": args.ffn,
                "max_seq_len": args.seq,
                "block_pattern": pattern,
            },
            "routing": {"capacity": args.capacity, "gate": "sigmoid"},
            "data": {"seq_len": args.seq},
        },
        "bench/mod_step.py",
    )


def measure(config: Config, compiled: bool, args: argparse.Namespace, device: torch.device) -> dict[str, float]:
    torch.manual_seed(0)
    model = LanguageModel(config).to(device)
    forward = torch.compile(model) if compiled else model
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda")
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    x, y = tokens[:, :-1], tokens[:, 1:]
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")

    def fwd_bwd() -> None:
        with autocast:
            loss = forward(x, y).loss
        loss.backward()

    def step() -> None:
        fwd_bwd()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    result = {
        "fwd_bwd_ms": timed(fwd_bwd, args.warmup, args.iters, device),
        "step_ms": timed(step, args.warmup, args.iters, device),
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan"),
    }
    del model, optimizer, forward
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    add_model_args(parser)
    parser.add_argument("--capacity", type=float, default=0.125)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at a small shape")
    parser.add_argument("--profile", action="store_true", help="also print the top kernels of eager fwd+bwd")
    parser.add_argument("--row-add", choices=["scatter_add", "index_add"], default="scatter_add",
                        help="the kernel routed blocks add rows back with (mode.routing.primitives.ROW_ADD)")
    args = parser.parse_args()
    primitives.ROW_ADD = args.row_add
    if args.tiny:
        args.batch, args.seq, args.width, args.heads, args.layers, args.ffn, args.vocab = 2, 128, 64, 4, 4, 128, 256
        args.warmup, args.iters, args.no_compile = 1, 3, True
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    torch.backends.cuda.matmul.allow_tf32 = True

    dense_cfg, mod_cfg = make_config(["dense"], args), make_config(["dense", "mod"], args)
    flop_ratio = model_flops(mod_cfg).forward_per_token / model_flops(dense_cfg).forward_per_token
    modes = [False] if args.no_compile else [False, True]
    print(f"card: {card}; torch {torch.__version__}; B={args.batch} S={args.seq} D={args.width} "
          f"layers={args.layers} ffn={args.ffn} vocab={args.vocab} capacity={args.capacity} on every other block, bf16, rows added back with {args.row_add}")
    print(f"analytic forward FLOPs/token: dense {model_flops(dense_cfg).forward_per_token / 1e6:.1f}M, "
          f"MoD {model_flops(mod_cfg).forward_per_token / 1e6:.1f}M, ratio {flop_ratio:.3f}\n")
    print("| mode | model | fwd+bwd ms | step ms (AdamW) | peak GiB | fwd+bwd ratio | step ratio | ratio / FLOP ratio (fwd+bwd, step) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for compiled in modes:
        mode = "compiled" if compiled else "eager"
        dense = measure(dense_cfg, compiled, args, device)
        mod = measure(mod_cfg, compiled, args, device)
        fb, st = mod["fwd_bwd_ms"] / dense["fwd_bwd_ms"], mod["step_ms"] / dense["step_ms"]
        print(f"| {mode} | dense | {dense['fwd_bwd_ms']:.2f} | {dense['step_ms']:.2f} | {dense['peak_gib']:.2f} | | | |")
        print(f"| {mode} | MoD | {mod['fwd_bwd_ms']:.2f} | {mod['step_ms']:.2f} | {mod['peak_gib']:.2f} "
              f"| {fb:.3f} | {st:.3f} | {fb / flop_ratio:.3f} x, {st / flop_ratio:.3f} x |")
    if args.profile:
        for name, cfg in (("dense", dense_cfg), ("MoD", mod_cfg)):
            profile(name, cfg, args, device)


def profile(name: str, config: Config, args: argparse.Namespace, device: torch.device) -> None:
    """Top kernels of three eager forward+backward passes, to see where the time goes."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    model = LanguageModel(config).to(device)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    for i in range(5):
        with torch_profile(activities=activities) if i == 4 else torch.autocast(device.type, enabled=False) as prof:
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
                loss = model(tokens[:, :-1], tokens[:, 1:]).loss
            loss.backward()
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"\n### {name}: top operators by self time, one eager forward+backward")
    print(prof.key_averages().table(sort_by=sort, row_limit=40, max_name_column_width=70))


if __name__ == "__main__":
    main()
