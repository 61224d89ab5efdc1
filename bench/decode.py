"""MoD vs dense: decode tokens/s with causal routing and per-layer sparse KV caches.

    python bench/decode.py            # D=1024, 16 heads, 12 layers, vocab 32768, bf16, CUDA
    python bench/decode.py --tiny     # a CPU-sized smoke run of the same script

Both models have the same shape. The MoD model routes every other block (capacity 12.5%)
with causal method (a) (routing.causal=aux_loss: a token goes through a routed block when
its router logit is > 0). The weights are random, so the router's bias is calibrated on the
prompts so that its decision sends about 12.5% of the tokens through (the measured share is
printed). Prefill (prompt 128) is timed apart; decode is 256 greedy steps with the cache,
for batch 1 and batch 64, in the same process on the same card. Prints a markdown table.
"""
from __future__ import annotations

import argparse
import time

import torch

from mode.config import Config, config_from_dict
from mode.generate import Decoder
from mode.layers.mod import MoDBlock
from mode.model import LanguageModel


def make_config(pattern: list[str], args: argparse.Namespace) -> Config:
    return config_from_dict(
        {
            "model": {
                "vocab_size": args.vocab, "d_model": args.width, "n_heads": args.heads, "n_layers": args.layers,
                "d_ff": args.ffn, "max_seq_len": args.prompt + args.new_tokens, "block_pattern": pattern,
            },
            "routing": {"capacity": args.capacity, "gate": "sigmoid", "causal": "aux_loss", "router_bias": True},
            "data": {"seq_len": args.prompt},
        },
        "bench/decode.py",
    )


@torch.no_grad()
def calibrate_routers(model: LanguageModel, prompts: torch.Tensor, share: float) -> None:
    """Set each routed block's router bias so that share of the prompts' tokens have logit > 0."""
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
            with model.routing_mode("causal"):
                x, _ = block(x, angles)
        else:
            x, _ = block(x, angles)


@torch.no_grad()
def decode_run(model: LanguageModel, prompts: torch.Tensor, new_tokens: int, device: torch.device) -> tuple[float, float, float]:
    """(prefill seconds, decode tokens/s, share of decode tokens the routed layers processed)."""
    batch = prompts.shape[0]
    decoder = Decoder(model, batch, prompts.shape[1] + new_tokens)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    logits = decoder.prefill(prompts.tolist())
    sync()
    t1 = time.perf_counter()
    routed = [c for b, c in zip(model.blocks, decoder.caches) if isinstance(b, MoDBlock)]
    before = sum(int(c.lengths_cpu.sum()) for c in routed)
    for _ in range(new_tokens):
        logits = decoder.step(logits.argmax(-1))
    sync()
    t2 = time.perf_counter()
    after = sum(int(c.lengths_cpu.sum()) for c in routed)
    share = (after - before) / (batch * new_tokens * len(routed)) if routed else 1.0
    return t1 - t0, batch * new_tokens / (t2 - t1), share


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=2816)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--capacity", type=float, default=0.125)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=2, help="runs per setting; the best is reported")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at a small shape")
    args = parser.parse_args()
    if args.tiny:
        args.width, args.heads, args.layers, args.ffn, args.vocab = 64, 4, 4, 128, 256
        args.prompt, args.new_tokens, args.batches, args.repeats = 16, 16, [1, 4], 1
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    torch.manual_seed(0)
    models = {}
    for name, pattern in (("dense", ["dense"]), ("MoD", ["dense", "mod"])):
        models[name] = LanguageModel(make_config(pattern, args)).to(device=device, dtype=dtype).eval()
    prompts = {b: torch.randint(0, args.vocab, (b, args.prompt), device=device) for b in args.batches}
    calibrate_routers(models["MoD"], prompts[max(args.batches)], args.capacity)

    rows = []
    for batch in args.batches:
        results = {}
        for name, model in models.items():
            decode_run(model, prompts[batch][:, :8], 4, device)  # warm up kernels and allocator
            runs = [decode_run(model, prompts[batch], args.new_tokens, device) for _ in range(args.repeats)]
            results[name] = max(runs, key=lambda r: r[1])
        speedup = results["MoD"][1] / results["dense"][1]
        for name, (prefill, tps, share) in results.items():
            rows.append(
                f"| {batch} | {name} | {tps:,.0f} | {prefill * 1e3:.1f} | "
                f"{'-' if name == 'dense' else f'{share:.3f}'} | {'1.00' if name == 'dense' else f'{speedup:.2f}'} |"
            )
    print(
        f"\nDecode, {card}, {str(dtype).removeprefix('torch.')}: D={args.width}, {args.heads} heads, {args.layers} layers, "
        f"vocab {args.vocab}, ffn {args.ffn}, prompt {args.prompt}, {args.new_tokens} new tokens (greedy); "
        f"MoD: every other block routed, causal method (a), target share {args.capacity}\n"
    )
    print("| batch | model | decode tokens/s | prefill ms | routed share (decode) | x dense |")
    print("| --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
