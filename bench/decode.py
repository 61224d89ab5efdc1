"""MoD vs dense: decode tokens/s with causal routing and per-layer sparse KV caches.

    python -m bench.decode            # D=1024, 16 heads, 12 layers, vocab 32768, bf16, CUDA
    python -m bench.decode --tiny     # a CPU-sized smoke run of the same script

Both models have the same shape. The MoD model routes every other block (capacity 12.5%)
with causal method (a) (routing.causal=aux_loss: a token goes through a routed block when
its router logit is > 0). The weights are random, so the router's bias is calibrated on the
prompts so that its decision sends about 12.5% of the tokens through (the measured share is
printed). Prefill (--prompt, default 128) is timed apart; decode is 256 greedy steps with
the cache, for batch 1 and batch 64, in the same process on the same card, the settings
interleaved over --repeats runs (best kept). Prints a markdown table.

    python -m bench.decode --prompt 2048 --routed-rows gather masked   # both routed-layer policies

--routed-rows: the Decoder's decode step (auto: on a GPU the static "masked" step captured as a
CUDA graph, else "gather"); a dense and a MoD row for each one named, the ratio taken between
the two models decoded the same way.

    python -m bench.decode --profile [--tiny | --width 128 --heads 4 ...]   # a GPU, or --device cpu

--profile: instead of timing, runs a few decode steps per model and batch under
torch.profiler and prints, per decode step and per layer call (dense / routed), the aten
operations called from Python (views excluded: about one kernel each), and on CUDA the
kernel launches, stream / device synchronisations and memcpy calls the host issued.
--sdpa torch lets torch pick the attention backend (cuDNN included where it prefers it)
instead of the decoder's default (flash, memory-efficient, math).
"""
from __future__ import annotations

import argparse
import collections
import time

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.common import add_model_args, require_cuda_unless_tiny, sync
from mode.config import Config, config_from_dict
from mode.generate import DECODE_SDPA_BACKENDS, Decoder
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
            x, _ = block(x, angles, causal=True)
        else:
            x, _ = block(x, angles)


def step_kind(policy: str) -> tuple[str, bool]:
    """"masked+compile" -> ("masked", True); a routed_rows value -> (it, False)."""
    return (policy.removesuffix("+compile"), policy.endswith("+compile"))


@torch.no_grad()
def decode_run(
    model: LanguageModel, prompts: torch.Tensor, new_tokens: int, device: torch.device, sdpa=DECODE_SDPA_BACKENDS,
    routed_rows: str = "auto", compile: bool = False,
) -> tuple[float, float, float, str]:
    """(prefill seconds, decode tokens/s, share of decode tokens the routed layers processed, the step used).

    The first decode step (where a CUDA graph is captured) is run before the clock starts;
    new_tokens - 1 steps are timed."""
    batch = prompts.shape[0]
    decoder = Decoder(model, batch, prompts.shape[1] + new_tokens, sdpa_backends=sdpa, routed_rows=routed_rows,
                      compile=compile and routed_rows != "gather")
    sync(device)
    t0 = time.perf_counter()
    logits = decoder.prefill(prompts.tolist())
    sync(device)
    t1 = time.perf_counter()
    routed = [c for b, c in zip(model.blocks, decoder.caches) if isinstance(b, MoDBlock)]
    before = sum(int(c.lengths.sum()) for c in routed)
    logits = decoder.step(logits.argmax(-1))  # untimed: captures the CUDA graph (and compiles)
    sync(device)
    t2 = time.perf_counter()
    for _ in range(new_tokens - 1):
        logits = decoder.step(logits.argmax(-1))
    sync(device)
    t3 = time.perf_counter()
    after = sum(int(c.lengths.sum()) for c in routed)  # exact (device) lengths, read after the timing
    share = (after - before) / (batch * new_tokens * len(routed)) if routed else 1.0
    used = decoder.routed_rows + (" + CUDA graph" if decoder.cuda_graph else "") + (" + compile" if decoder.compile else "")
    return t1 - t0, batch * (new_tokens - 1) / (t3 - t2), share, used


def check_device(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """--device cuda needs a GPU; on a machine without one only --tiny (or an explicit --device cpu,
    for a shape of one's own) runs, as the default shape is a GPU's and takes minutes on CPU."""
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA GPU available")
    if args.device == "auto":
        require_cuda_unless_tiny(parser, args, " (--device cpu runs the given shape on CPU anyway)")


# ----------------------------------------------------------------------------- --profile
class LabelledDecoder(Decoder):
    """A Decoder whose decode-step layer calls are labelled for the profiler (the gather step's;
    the static step runs eagerly, the same kernels as its CUDA graph, and is profiled whole)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.cuda_graph = False

    def _decode_layer(self, block, *args, **kwargs):
        with record_function("routed layer" if isinstance(block, MoDBlock) else "dense layer"):
            return super()._decode_layer(block, *args, **kwargs)


VIEW_OPS = {
    "aten::view", "aten::reshape", "aten::_reshape_alias", "aten::_unsafe_view", "aten::unsqueeze", "aten::squeeze",
    "aten::transpose", "aten::t", "aten::permute", "aten::slice", "aten::select", "aten::narrow", "aten::expand",
    "aten::expand_as", "aten::view_as", "aten::as_strided", "aten::unbind", "aten::split", "aten::chunk", "aten::alias",
    "aten::detach", "aten::lift_fresh", "aten::empty", "aten::empty_strided", "aten::to", "aten::contiguous",
    "aten::result_type", "aten::size", "aten::dim", "aten::numel", "aten::is_nonzero",
}
LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")
COPIES = ("cudaMemcpyAsync", "cudaMemcpy")
LABELS = ("decode step", "dense layer", "routed layer")


@torch.no_grad()
def profile_decode(model: LanguageModel, prompts: torch.Tensor, steps: int, device: torch.device, sdpa, routed_rows: str) -> dict:
    """Counts per decode step, split into the layers' calls and the rest of the step ("glue")."""
    batch = prompts.shape[0]
    decoder = LabelledDecoder(model, batch, prompts.shape[1] + steps + 3, sdpa_backends=sdpa, routed_rows=routed_rows)
    logits = decoder.prefill(prompts.tolist())
    for _ in range(2):  # warm up
        logits = decoder.step(logits.argmax(-1))
    sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            with record_function("decode step"):
                logits = decoder.step(logits.argmax(-1))
        sync(device)
    events = list(prof.events())  # host-side events: ops, ranges and CUDA runtime calls (the decoder is one thread)
    ranges = {label: [(e.time_range.start, e.time_range.end) for e in events if e.name == label] for label in LABELS}

    def label_of(e) -> str | None:
        """The innermost labelled range holding e's start."""
        found, start = None, None
        for label in LABELS:
            for lo, hi in ranges[label]:
                if lo <= e.time_range.start < hi and (start is None or lo >= start):
                    found, start = label, lo
        return found

    counts = collections.defaultdict(collections.Counter)
    for e in events:
        if e.name in LABELS:
            continue
        if e.name.startswith("aten::"):
            parent, nested = e.cpu_parent, False
            while parent is not None:
                nested = nested or parent.name.startswith("aten::")
                parent = parent.cpu_parent
            kind = None if nested or e.name in VIEW_OPS else "aten ops"
        elif e.name in LAUNCHES:
            kind = "kernel launches"
        elif e.name in SYNCS:
            kind = "syncs"
        elif e.name in COPIES:
            kind = "memcpys"
        else:
            kind = None
        if kind is not None:
            label = label_of(e)
            if label is not None:
                counts[label][kind] += 1
    calls = {label: len(ranges[label]) for label in LABELS}
    host_us = {label: sum(hi - lo for lo, hi in ranges[label]) for label in LABELS}
    gpu_us = sum(e.time_range.elapsed_us() for e in events if e.device_type == torch.autograd.DeviceType.CUDA)
    kernels = prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12) if device.type == "cuda" else ""
    return {"calls": calls, "counts": counts, "steps": steps, "host_us": host_us, "gpu_us": gpu_us, "kernels": kernels}


def print_profile(name: str, batch: int, result: dict, cuda: bool) -> None:
    kinds = ["aten ops"] + (["kernel launches", "syncs", "memcpys"] if cuda else [])
    steps, calls, counts = result["steps"], result["calls"], result["counts"]
    print(f"\n{name}, batch {batch}: per decode step ({steps} steps profiled)")
    print("| part | calls per step | " + " | ".join(f"{k} per call" for k in kinds) + " |")
    print("| --- | --- | " + " | ".join("---" for _ in kinds) + " |")
    totals = collections.Counter()
    for label in LABELS:
        n = calls[label]
        if n == 0:
            continue
        totals.update(counts[label])
        part = "glue (embedding, routing decisions, head)" if label == "decode step" else label
        per = [f"{counts[label][k] / n:.1f}" for k in kinds]
        print(f"| {part} | {n / steps:.3g} | " + " | ".join(per) + " |")
    print("| whole step | 1 | " + " | ".join(f"{totals[k] / steps:.1f}" for k in kinds) + " |")
    host = result["host_us"]
    layers = ", ".join(
        f"{label} {host[label] / calls[label]:.0f} us" for label in LABELS[1:] if calls[label]
    )
    line = f"host wall per decode step {host['decode step'] / steps / 1e3:.2f} ms (per layer call: {layers})"
    if cuda:
        line += f"; GPU kernel time per step {result['gpu_us'] / steps / 1e3:.2f} ms"
    print(line + " (under the profiler)")
    if result["kernels"]:
        print(f"top operators by GPU time over the {steps} steps:\n{result['kernels']}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--capacity", type=float, default=0.125)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 64])
    parser.add_argument("--repeats", type=int, default=3, help="interleaved runs per setting; the best is reported")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at a small shape")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: CUDA if there is a GPU (CPU with --tiny); without a GPU, anything but --tiny "
                             "needs --device cpu")
    parser.add_argument("--profile", action="store_true", help="count ops, launches and syncs per decode step instead of timing")
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument(
        "--sdpa", default="decoder", choices=["decoder", "torch"],
        help="attention backends: the decoder's default (no cuDNN) or torch's own choice",
    )
    parser.add_argument("--compile", action="store_true", help="also the static step with torch.compile (Decoder(compile=True))")
    parser.add_argument(
        "--routed-rows", nargs="+", default=["auto"], choices=["auto", "gather", "masked"],
        help="how a decode step runs a routed layer (mode.generate.Decoder's routed_rows); one MoD row each",
    )
    args = parser.parse_args(argv)
    check_device(parser, args)
    if args.tiny:
        args.width, args.heads, args.layers, args.ffn, args.vocab = 64, 4, 4, 128, 256
        args.prompt, args.new_tokens, args.batches, args.repeats = 16, 16, [1, 4], 1
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    else:
        device = torch.device(args.device)
    sdpa = DECODE_SDPA_BACKENDS if args.sdpa == "decoder" else None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    torch.manual_seed(0)
    models = {}
    for name, pattern in (("dense", ["dense"]), ("MoD", ["dense", "mod"])):
        models[name] = LanguageModel(make_config(pattern, args)).to(device=device, dtype=dtype).eval()
    prompts = {b: torch.randint(0, args.vocab, (b, args.prompt), device=device) for b in args.batches}
    calibrate_routers(models["MoD"], prompts[max(args.batches)], args.capacity)
    if args.profile:
        print(f"Decode profile, {card}, {str(dtype).removeprefix('torch.')}: D={args.width}, {args.heads} heads, "
              f"{args.layers} layers; aten ops are those called from Python, views excluded")
        for batch in args.batches:
            for name, model in models.items():
                result = profile_decode(model, prompts[batch], args.profile_steps, device, sdpa, args.routed_rows[0])
                print_profile(name, batch, result, device.type == "cuda")
        return

    rows = []
    setups = [(name, policy) for policy in args.routed_rows for name in ("dense", "MoD")]
    if args.compile:
        setups += [(name, "masked+compile") for name in ("dense", "MoD")]
    for batch in args.batches:
        best: dict[tuple[str, str], tuple[float, float, float, str]] = {}
        for name, policy in setups:  # warm up kernels and allocator
            decode_run(models[name], prompts[batch][:, :8], 4, device, sdpa, *step_kind(policy))
        for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every row alike
            for name, policy in setups:
                run = decode_run(models[name], prompts[batch], args.new_tokens, device, sdpa, *step_kind(policy))
                if (name, policy) not in best or run[1] > best[name, policy][1]:
                    best[name, policy] = run
        for (name, policy), (prefill, tps, share, used) in best.items():
            dense_tps = best["dense", policy][1]  # the dense model decoded the same way
            rows.append(
                f"| {batch} | {name} | {used} | {tps:,.0f} | {prefill * 1e3:.1f} | "
                f"{'-' if name == 'dense' else f'{share:.3f}'} | {tps / dense_tps:.2f} |"
            )
    print(
        f"\nDecode, {card}, {str(dtype).removeprefix('torch.')}: D={args.width}, {args.heads} heads, {args.layers} layers, "
        f"vocab {args.vocab}, ffn {args.ffn}, prompt {args.prompt}, {args.new_tokens} new tokens (greedy); "
        f"MoD: every other block routed, causal method (a), target share {args.capacity}; "
        f"attention backends: {'decoder default (flash, efficient, math)' if sdpa is not None else 'torch default'}\n"
    )
    print("| batch | model | decode step | decode tokens/s | prefill ms (one run) | routed share (decode) | x dense (same step) |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


if __name__ == "__main__":
    main()
