"""mode.generate's decode loop: the host reading a step's tokens while the device computes the next,
against the same decoder with the host reading each step's tokens first, for dense, MoD and Staged MoDE.

    python -m bench.generate                      # D=1024, 16 heads, 12 layers, vocab 32768, bf16, CUDA
    python -m bench.generate --batches 1 --temperature 1 --top-k 50
    python -m bench.generate --tiny               # a CPU-sized smoke run

The models and their calibrated routers are bench/decode.py's. Per prompt length x batch x model,
tokens/s over --new-tokens tokens a row (no stop token, so every loop runs the same steps). The
first three loops start the clock on a decoder already built, prefilled and past its first step
(the CUDA graph's capture):
- step pace: decoder.step on the last step's pick, no token read by the host (bench.decode's
  loop: what the device alone sustains);
- read first: mode.generate.decode_tokens(read_ahead=False), the host reading every step's tokens
  (stop tokens, outputs) before it queues the next step, as mode.generate did before read-ahead;
- read ahead: decode_tokens as mode.generate runs it;
- whole call: mode.generate itself, from the call to its return, with its decoder, prefill and
  CUDA graph capture, as every call without a decoder pays them;
- reused decoder: mode.generate(decoder=...), from the call to its return: the prefill, and the
  decoder's caches and CUDA graph from an earlier call (untimed) reused.
Each is the best of --repeats runs, the loops and the models interleaved; x dense divides by
dense's figure in the same column. The routed share is the part of the timed steps' tokens the
routed layers took (the last run's): at batch 1 one prompt's calibration sets it, and the ratios
follow it. Sampling: greedy, or --temperature / --top-k / --top-p with a seeded generator (the
same draws in every loop).
"""
from __future__ import annotations

import argparse
import time
from typing import Callable

import torch

from bench.common import add_model_args, require_cuda_unless_tiny, sync
from bench.decode import CALIBRATION_ROWS, routed_cached
from bench.prefill import MODELS, build_models, calibrate_routers, run_on, use_smoke_shape
from mode.generate import Decoder, check_sampling, decode_tokens, generate, sample
from mode.model import LanguageModel

LOOPS = ("step pace", "read first", "read ahead", "whole call", "reused decoder")


def sampler(args: argparse.Namespace, device: torch.device) -> Callable[[torch.Tensor], torch.Tensor]:
    """logits (B, V) -> tokens (B,) on the device, as mode.generate samples with these flags."""
    generator = torch.Generator(device=device).manual_seed(0)
    return lambda logits: sample(logits, args.temperature, args.top_k, args.top_p, generator)


def call_run(model: LanguageModel, prompts: torch.Tensor, args: argparse.Namespace, device: torch.device,
             decoder: Decoder | None = None) -> float:
    """Tokens/s of one whole mode.generate call for args.new_tokens tokens a row, the prefill included:
    with a decoder of its own (built, and its CUDA graph captured) or reusing `decoder`."""
    sync(device)
    start = time.perf_counter()
    generate(model, prompts.tolist(), args.new_tokens, args.temperature, args.top_k, args.top_p, seed=0,
             decoder=decoder)
    sync(device)
    return prompts.shape[0] * args.new_tokens / (time.perf_counter() - start)


@torch.no_grad()
def loop_run(model: LanguageModel, prompts: torch.Tensor, loop: str, args: argparse.Namespace,
             device: torch.device) -> tuple[float, float]:
    """(tokens/s of one loop over args.new_tokens tokens a row (see the module docstring), the share
    of the timed steps' tokens the routed layers took: 1.0 without routed layers)."""
    batch, new = prompts.shape[0], args.new_tokens
    decoder = Decoder(model, batch, prompts.shape[1] + new + 1)
    draw = sampler(args, device)
    logits = decoder.step(draw(decoder.prefill(prompts.tolist())))  # untimed: captures the CUDA graph
    before, routed = routed_cached(model, decoder)
    sync(device)
    start = time.perf_counter()
    if loop == "step pace":
        for _ in range(new - 1):
            logits = decoder.step(draw(logits))
    else:
        decode_tokens(decoder, logits, [new] * batch, set(), draw, read_ahead=loop == "read ahead")
    sync(device)
    seconds = time.perf_counter() - start
    steps = new - 1  # every loop steps new - 1 times (it draws new tokens a row)
    share = (routed_cached(model, decoder)[0] - before) / (batch * steps * routed) if routed else 1.0
    return batch * new / seconds, share


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--capacity", type=float, default=0.125)
    parser.add_argument("--prompts", type=int, nargs="+", default=[128], help="prompt lengths")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens a row per timed run (at least 2)")
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per loop and model; the best is reported")
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at a small shape")
    args = parser.parse_args(argv)
    require_cuda_unless_tiny(parser, args)
    if args.new_tokens < 2:
        parser.error(f"--new-tokens must be at least 2 (one step untimed), got {args.new_tokens}")
    try:
        check_sampling(args.temperature, args.top_k, args.top_p, args.new_tokens)
    except ValueError as e:  # "top_k must be ..." -> "--top-k: top_k must be ..."
        parser.error(f"--{str(e).split()[0].replace('_', '-')}: {e}")
    if args.tiny:
        use_smoke_shape(args)
        args.prompts, args.batches, args.new_tokens, args.repeats = [16], [1, 4], 8, 1
    device, dtype, card = run_on(args)
    rows = []
    for prompt in args.prompts:
        models = build_models(args.models, args, prompt + args.new_tokens + 1, device, dtype)
        for batch in args.batches:
            prompts = torch.randint(0, args.vocab, (batch, prompt), generator=torch.Generator().manual_seed(0))
            for model in models.values():
                calibrate_routers(model, prompts[:CALIBRATION_ROWS].to(device), args.capacity)
            best = {(name, loop): 0.0 for name in models for loop in LOOPS}
            shares = {}
            reused = {name: Decoder(model, batch, prompt + args.new_tokens) for name, model in models.items()}
            for name, model in models.items():  # the reused decoders' graphs captured, untimed
                call_run(model, prompts, args, device, reused[name])
            for _ in range(args.repeats):
                for loop in LOOPS:
                    for name, model in models.items():
                        if loop == "whole call":
                            rate = call_run(model, prompts, args, device)
                        elif loop == "reused decoder":
                            rate = call_run(model, prompts, args, device, reused[name])
                        else:
                            rate, shares[name] = loop_run(model, prompts, loop, args, device)
                        best[name, loop] = max(best[name, loop], rate)
            for name in models:
                cells = []
                for loop in LOOPS:
                    rate = best[name, loop]
                    cells.append(f"{rate:,.0f}" + (f" ({rate / best['dense', loop]:.2f})" if "dense" in models else ""))
                gain = best[name, "read ahead"] / best[name, "read first"]
                share = "-" if name == "dense" else f"{shares[name]:.3f}"
                rows.append(f"| {prompt} | {batch} | {name} | {share} | {' | '.join(cells)} | {gain:.2f} |")
    how = "greedy" if args.temperature == 0 else f"temperature {args.temperature}, top-k {args.top_k}, top-p {args.top_p}"
    print(f"\nmode.generate's decode loop, {card}, {str(dtype).removeprefix('torch.')}: D={args.width}, {args.heads} heads, "
          f"{args.layers} layers, vocab {args.vocab}, ffn {args.ffn}; MoD: every other block routed, causal method (a), "
          f"target share {args.capacity}; Staged MoDE: MoD with a top-1 MoE in the routed blocks; {how}; "
          f"{args.new_tokens} tokens a row, best of {args.repeats}\n")
    print("| prompt | batch | model | routed share | step pace tokens/s (x dense) | read first tokens/s (x dense) | "
          "read ahead tokens/s (x dense) | whole call tokens/s (x dense) | reused decoder tokens/s (x dense) | "
          "read ahead / read first |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
