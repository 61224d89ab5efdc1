"""MoD vs dense: prefill time with causal routing and per-layer sparse KV caches.

    python -m bench.prefill            # D=1024, 16 heads, 12 layers, vocab 32768, bf16, CUDA
    python -m bench.prefill --tiny     # a CPU-sized smoke run of the same script

The models (also bench/decode.py's): dense, MoD (every other block routed at capacity 12.5%
with causal method (a); its random routers are calibrated so that about 12.5% of the prompt
tokens go through) and, with --models, Staged MoDE (the MoD model's routed blocks with an
8-expert token-choice MoE FFN, top-1 and dropless, each expert as wide as the dense FFN, so a
token costs what it costs in a dense block; its depth routers calibrated the same way). Each
setting is prefilled --repeats times on a fresh Decoder after --warmup untimed prefills (kernel
compilation, allocator growth), settings interleaved; the table gives the median and the best
wall time, and from one more prefill under torch.profiler the GPU-busy time, the kernels
launched and the host synchronisations and copies (a device-to-host copy of a routed layer's
counts is its one sync). Prefill at batch 1 is bound by the host: compare wall time with
GPU-busy time.
"""
from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import torch
from torch.profiler import ProfilerActivity, profile

from bench.common import add_model_args, require_cuda_unless_tiny, sync, verdict
from mode.config import Config, config_from_dict
from mode.flops import model_flops
from mode.inference.decoder import DECODE_SDPA_BACKENDS, Decoder
from mode.layers.mod import MoDBlock
from mode.model import LanguageModel

LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpyAsync", "cudaMemcpy")


# The target: a routed model's prefill time over dense's at most its FLOP ratio times PREFILL_SLACK,
# at these batches (bench.decode's prefill column has the same).
PREFILL_TARGET_BATCHES = (1, 64)
PREFILL_SLACK = 1.15

# The models compared, by their table name: block_pattern, and whether the routed blocks' FFN is an MoE.
MODELS = {"dense": (["dense"], False), "MoD": (["dense", "mod"], False), "Staged MoDE": (["dense", "mode_staged"], True)}


def use_smoke_shape(args: argparse.Namespace) -> None:
    """--tiny: the CPU-sized model the decoding benchmarks share (prefill, decode, generate)."""
    args.width, args.heads, args.layers, args.ffn, args.vocab = 64, 4, 4, 128, 256


def run_on(args: argparse.Namespace) -> tuple[torch.device, torch.dtype, str]:
    """(device, dtype, card name): a visible GPU in bf16 unless --tiny, else the CPU in float32."""
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    if device.type == "cuda":
        return device, torch.bfloat16, torch.cuda.get_device_name(device)
    return device, torch.float32, "CPU"


def make_config(name: str, args: argparse.Namespace, max_seq_len: int, seq_len: int | None = None) -> Config:
    """The config of model `name` (MODELS) at the shape of args (add_model_args, --capacity)."""
    pattern, moe = MODELS[name]
    sections = {
        "model": {
            "vocab_size": args.vocab, "d_model": args.width, "n_heads": args.heads, "n_layers": args.layers,
            "d_ff": args.ffn, "max_seq_len": max_seq_len, "block_pattern": pattern,
        },
        "routing": {"capacity": args.capacity, "gate": "sigmoid", "causal": "aux_loss", "router_bias": True},
        "data": {"seq_len": seq_len or max_seq_len},
    }
    if moe:  # top-1 of E, dropless: every chosen token through one expert of the dense FFN's width
        sections["moe"] = {"n_experts": 4 if args.tiny else 8, "scheme": "token_choice", "top_k": 1,
                           "dropless": True, "activation": "swiglu", "backend": "torch"}
    return config_from_dict(sections, "bench")


def prefill_flop_ratio(args: argparse.Namespace, name: str, prompt: int) -> float:
    """A prefill's forward FLOPs over the dense model's: every block on the prompt's tokens (mode.flops,
    routed blocks at --capacity) plus the LM head on one token per row."""
    def flops(model: str) -> float:
        report = model_flops(make_config(model, args, prompt + 1, prompt), seq_len=prompt)
        return prompt * sum(report.per_block) + report.lm_head
    return flops(name) / flops("dense")


def prefill_target(args: argparse.Namespace, name: str, prompt: int, batch: int, ratio: float) -> str:
    """The table's target cell for a model's prefill time over dense's, ratio."""
    if name == "dense" or batch not in PREFILL_TARGET_BATCHES:
        return "-"
    limit = prefill_flop_ratio(args, name, prompt) * PREFILL_SLACK
    return f"<= {limit:.2f} x: {verdict(ratio <= limit)}"


def build_models(names: list[str], args: argparse.Namespace, max_seq_len: int, device: torch.device,
                 dtype: torch.dtype) -> dict[str, LanguageModel]:
    """The named models, each from the same seed, in eval mode on device."""
    models = {}
    for name in names:
        torch.manual_seed(0)
        models[name] = LanguageModel(make_config(name, args, max_seq_len)).to(device=device, dtype=dtype).eval()
    return models


@torch.no_grad()
def calibrate_routers(model: LanguageModel, prompts: torch.Tensor, share: float) -> None:
    """Set each routed block's router bias so that share of the prompts' tokens have logit > 0."""
    if not any(isinstance(block, MoDBlock) for block in model.blocks):
        return
    for block in model.blocks:
        if isinstance(block, MoDBlock):
            block.router.router.proj.bias.fill_(-1e4)  # skip while calibrating earlier layers
    x = model.embed(prompts)
    angles = model.rotary.prefix(prompts.shape[1])
    for block in model.blocks:
        if isinstance(block, MoDBlock):
            proj = block.router.router.proj
            proj.bias.zero_()
            scores = block.router.router(x).flatten()
            proj.bias.fill_(-float(torch.quantile(scores.float(), 1.0 - share)))
            x, _ = block(x, angles, causal=True)
        else:
            x, _ = block(x, angles)


@dataclass
class PrefillTime:
    median_ms: float
    best_ms: float
    gpu_busy_ms: float = 0.0
    launches: int = 0
    host_waits: int = 0


def prefill_once(model: LanguageModel, prompts: list[list[int]], device: torch.device) -> float:
    """Seconds of one prefill of prompts on a fresh decoder (its construction untimed)."""
    decoder = Decoder(model, len(prompts), len(prompts[0]) + 1, sdpa_backends=DECODE_SDPA_BACKENDS, routed_rows="gather")
    sync(device)
    start = time.perf_counter()
    decoder.prefill(prompts)
    sync(device)
    return time.perf_counter() - start


def profile_prefill(model: LanguageModel, prompts: list[list[int]], device: torch.device) -> tuple[float, int, int]:
    """(GPU-busy ms, kernel launches, host syncs and copies) of one prefill."""
    decoder = Decoder(model, len(prompts), len(prompts[0]) + 1, sdpa_backends=DECODE_SDPA_BACKENDS, routed_rows="gather")
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        decoder.prefill(prompts)
        sync(device)
    events = list(prof.events())
    busy_us = sum(e.device_time for e in events if e.device_type.name == "CUDA")
    launches = sum(e.name in LAUNCHES for e in events)
    waits = sum(e.name in HOST_WAITS for e in events)
    return busy_us / 1e3, launches, waits


@torch.no_grad()
def time_settings(models: dict[str, LanguageModel], prompts: list[list[int]], device: torch.device,
                  repeats: int, warmup: int, profiled: bool = True) -> dict[str, PrefillTime]:
    """Every model's prefill of the same prompts, runs interleaved between the models; profiled:
    also one prefill each under the profiler (else GPU busy time and counts stay 0)."""
    for _ in range(warmup):
        for model in models.values():
            prefill_once(model, prompts, device)
    runs: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(repeats):
        for name, model in models.items():
            runs[name].append(prefill_once(model, prompts, device))
    result = {}
    for name, model in models.items():
        busy, launches, waits = profile_prefill(model, prompts, device) if profiled else (0.0, 0, 0)
        result[name] = PrefillTime(statistics.median(runs[name]) * 1e3, min(runs[name]) * 1e3, busy, launches, waits)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--capacity", type=float, default=0.125)
    parser.add_argument("--prompts", type=int, nargs="+", default=[128, 2048], help="prompt lengths")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=["dense", "MoD"])
    parser.add_argument("--repeats", type=int, default=10, help="timed prefills per setting; the median is reported")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at a small shape")
    args = parser.parse_args(argv)
    require_cuda_unless_tiny(parser, args)
    if args.tiny:
        use_smoke_shape(args)
        args.prompts, args.batches, args.repeats, args.warmup = [16], [1, 4], 3, 1
    device, dtype, card = run_on(args)
    rows = []
    for prompt in args.prompts:
        models = build_models(args.models, args, prompt + 1, device, dtype)
        for batch in args.batches:
            prompts = torch.randint(0, args.vocab, (batch, prompt), device=device)
            for model in models.values():
                calibrate_routers(model, prompts, args.capacity)
            times = time_settings(models, prompts.tolist(), device, args.repeats, args.warmup)
            for name, t in times.items():
                ratio = t.median_ms / times["dense"].median_ms
                rows.append(f"| {prompt} | {batch} | {name} | {t.median_ms:.2f} | {t.best_ms:.2f} | {t.gpu_busy_ms:.2f} | "
                            f"{t.launches} | {t.host_waits} | {ratio:.2f} | {prefill_target(args, name, prompt, batch, ratio)} |")
    print(f"\nPrefill, {card}, {str(dtype).removeprefix('torch.')}: D={args.width}, {args.heads} heads, "
          f"{args.layers} layers, vocab {args.vocab}, ffn {args.ffn}; MoD: every other block routed, causal method (a), "
          f"target share {args.capacity}; Staged MoDE: MoD with a top-1 MoE in the routed blocks; median of {args.repeats} prefills after {args.warmup} warm-up\n")
    print("| prompt | batch | model | median ms | best ms | GPU busy ms | kernel launches | host syncs + copies | x dense | "
          "target (FLOP ratio x 1.15) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
