"""Dense, MoD and Staged MoDE: decode tokens/s and prefill time with causal routing and
per-layer sparse KV caches, against the targets for routed decoding.

    python -m bench.decode            # D=1024, 16 heads, 12 layers, vocab 32768, bf16, CUDA
    python -m bench.decode --tiny     # a CPU-sized smoke run of the same script
    python -m bench.decode --prompts 128 --batches 1 64   # a subset of the table

The models are bench/prefill.py's (the same shape; MoD routes every other block at capacity
12.5% with causal method (a); Staged MoDE adds a top-1 token-choice MoE of 8 experts to the
routed blocks; the random routers' biases are calibrated on the setting's prompts so that about
12.5% of the tokens go through, and the measured share is printed). One markdown table: a row
per prompt length x batch x model, with
- decode tokens/s: --new-tokens greedy steps with the cache after the prompt, the first step
  (CUDA graph capture) untimed; the best of --repeats runs, models interleaved;
- prefill ms: the median of --prefill-repeats prefills on fresh decoders (bench/prefill.py);
- x dense: decode speed over dense's (decoded the same way: the same --routed-rows value), and
  prefill time over dense's;
- FLOP ratio: the prefill's forward FLOPs over dense's, from mode.flops at the prompt length
  (routed blocks at --capacity; the logits of one token per row);
- the targets: routed decode >= 1.4 x dense at batch 1 with a 128-token prompt, >= 1.6 x at
  batch 64 with 2048 tokens, >= 1.4 x at batch 1024 with 128, never below 0.97 x (batch 64
  with 128 tokens, bound by reading weights, is reported without a target); routed
  prefill at batch 1 and 64 within its FLOP ratio x 1.15 of dense's time.
A setting whose KV caches (and the prefill's activations) would not fit the device's free
memory is not run: its rows say so, with the estimate.

    python -m bench.decode --prompts 2048 --routed-rows gather masked   # both routed-layer policies
    python -m bench.decode --decoder-arg cuda_graph=False               # any Decoder keyword

--routed-rows: the Decoder's decode step (auto: on a GPU the static "masked" step captured as a
CUDA graph, for Staged MoDE too where its experts run as grouped GEMMs over device-side offsets,
else "gather" below batch 16); rows for each one named.
--decoder-arg key=value (repeatable): a keyword for every decode run's Decoder (a Python
literal, else a string); a row whose Decoder refuses it says why.

    python -m bench.decode --profile [--tiny | --width 128 --heads 4 ...]   # a GPU, or --device cpu

--profile: instead of timing, runs a few decode steps per model and batch under
torch.profiler and prints, per decode step and per layer call (dense / routed), the aten
operations called from Python (views excluded: about one kernel each), and on CUDA the
kernel launches, stream / device synchronisations and memcpy calls the host issued.
    python -m bench.decode --kernels --prompts 128 --batches 1     # a GPU

--kernels: instead of timing, replays --profile-steps decode steps per model and setting as the
table decodes them (the CUDA-graphed static step, the greedy pick included) under torch.profiler
and prints each model's unprofiled step time, its kernels per step, their GPU time per step and
the top kernels by time: where a step's time goes. In a replayed graph every kernel adds a gap
of its own to the step (wall over busy time).
--sdpa torch lets torch pick the attention backend (cuDNN included where it prefers it)
instead of the decoder's default (flash, memory-efficient, math).
"""
from __future__ import annotations

import argparse
import ast
import collections
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from bench.common import add_model_args, require_cuda_unless_tiny, sync, verdict
from bench.prefill import (
    MODELS,
    PREFILL_SLACK,
    PREFILL_TARGET_BATCHES,
    build_models,
    calibrate_routers,
    prefill_flop_ratio,
    time_settings,
    use_smoke_shape,
)
from mode.generate import DECODE_SDPA_BACKENDS, ROUTED_ROWS, Decoder
from mode.layers.mod import MoDBlock
from mode.model import LanguageModel

# (batch, prompt) -> the routed models' decode target against dense; elsewhere DECODE_FLOOR,
# except where a step is bound by reading weights (DECODE_REPORTED: measured, no target).
DECODE_TARGETS = {(1, 128): 1.4, (64, 2048): 1.6, (1024, 128): 1.4}
DECODE_FLOOR = 0.97
DECODE_REPORTED = {(64, 128)}
CALIBRATION_ROWS = 64  # the routers are calibrated on at most this many of a setting's prompts
KERNEL_ROWS = 14  # --kernels: the top kernels listed per model


def step_kind(policy: str) -> tuple[str, bool]:
    """"masked+compile" -> ("masked", True); a routed_rows value -> (it, False)."""
    return (policy.removesuffix("+compile"), policy.endswith("+compile"))


def routed_cached(model: LanguageModel, decoder: Decoder) -> tuple[int, int]:
    """(tokens the routed layers' caches hold, all layers together; how many routed layers there
    are): two readings around a decode run give the share of its tokens the routed layers took."""
    routed = [cache for block, cache in zip(model.blocks, decoder.block_caches) if isinstance(block, MoDBlock)]
    return sum(int(cache.lengths.sum()) for cache in routed), len(routed)


@torch.no_grad()
def decode_run(
    model: LanguageModel, prompts: torch.Tensor, new_tokens: int, device: torch.device, sdpa=DECODE_SDPA_BACKENDS,
    routed_rows: str = "auto", compile: bool = False, decoder_args: dict[str, Any] | None = None,
) -> tuple[float, float, float, str]:
    """(prefill seconds, decode tokens/s, share of decode tokens the routed layers processed, the step used).

    The first decode step (where a CUDA graph is captured) is run before the clock starts;
    new_tokens - 1 steps are timed. decoder_args: more Decoder keywords (they win over the others)."""
    batch = prompts.shape[0]
    keywords = {"sdpa_backends": sdpa, "routed_rows": routed_rows, "compile": compile and routed_rows != "gather",
                **(decoder_args or {})}
    decoder = Decoder(model, batch, prompts.shape[1] + new_tokens, **keywords)
    sync(device)
    t0 = time.perf_counter()
    logits = decoder.prefill(prompts.tolist())
    sync(device)
    t1 = time.perf_counter()
    before, routed = routed_cached(model, decoder)
    logits = decoder.step(logits.argmax(-1))  # untimed: captures the CUDA graph (and compiles)
    sync(device)
    t2 = time.perf_counter()
    for _ in range(new_tokens - 1):
        logits = decoder.step(logits.argmax(-1))
    sync(device)
    t3 = time.perf_counter()
    after, _ = routed_cached(model, decoder)  # exact (device) lengths, read after the timing
    share = (after - before) / (batch * new_tokens * routed) if routed else 1.0
    used = (decoder.routed_rows + (" compacted" if decoder.compact_rows and routed else "")
            + (" + CUDA graph" if decoder.cuda_graph else "")) + (" + compile" if decoder.compile else "")
    return t1 - t0, batch * (new_tokens - 1) / (t3 - t2), share, used


def parse_decoder_args(items: list[str]) -> dict[str, Any]:
    """["cuda_graph=False", "routed_rows=compact"] -> {"cuda_graph": False, "routed_rows": "compact"}:
    each value a Python literal where it reads as one, else the string."""
    parsed = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.isidentifier():
            raise ValueError(f"--decoder-arg takes key=value, got {item!r}")
        try:
            parsed[key] = ast.literal_eval(value)
        except (ValueError, SyntaxError):
            parsed[key] = value
    return parsed


def setting_bytes(args: argparse.Namespace, batch: int, prompt: int, element: int) -> int:
    """Device bytes a setting allocates beyond the weights: every layer's KV cache (each holds
    max_len + 1 slots per row, routed or not) and the prefill's working set (the hidden states, a
    layer's q, k, v and attention output and its FFN's three hidden-width activations)."""
    head_dim = args.width // args.heads
    slots = prompt + args.new_tokens + 1
    caches = args.layers * 2 * batch * slots * args.heads * head_dim * element
    working = batch * prompt * (6 * args.width + 3 * args.ffn) * element
    return caches + working


def free_bytes(device: torch.device) -> int | None:
    """What the device can still allocate (free memory plus the allocator's unused reserve); None on CPU."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)


def does_not_fit(need: int, budget: int | None) -> str | None:
    """The row's text where a setting needing need bytes does not fit budget (None: no limit known)."""
    if budget is None or need <= budget:
        return None
    return f"does not fit ({need / 2**30:.0f} GiB; {budget / 2**30:.0f} GiB free)"


def settings(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> Iterator[tuple[int, int, str | None]]:
    """Each (prompt, batch) of --prompts x --batches, with does_not_fit's text where its caches would
    not fit the device's free memory (or --memory-gib), else None."""
    budget = free_bytes(device) if args.memory_gib is None else int(args.memory_gib * 2**30)
    for prompt in args.prompts:
        for batch in args.batches:
            yield prompt, batch, does_not_fit(setting_bytes(args, batch, prompt, dtype.itemsize), budget)


def decode_target(batch: int, prompt: int) -> float | None:
    """The routed models' decode speed target against dense here; None: reported only."""
    if (batch, prompt) in DECODE_REPORTED:
        return None
    return DECODE_TARGETS.get((batch, prompt), DECODE_FLOOR)


@dataclass
class Row:
    """One model's measurements in one setting."""

    used: str
    tokens_per_s: float
    share: float
    prefill_ms: float


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


@torch.no_grad()
def kernel_profile(model: LanguageModel, prompts: torch.Tensor, steps: int, device: torch.device, sdpa,
                   routed_rows: str, decoder_args: dict[str, Any]) -> dict:
    """steps decode steps replayed as decode_run runs them, first unprofiled (the wall time per step),
    then under the profiler (the kernels): {"step_us", "kernels", "busy_us", "top": [(name, per step, us per step)]}."""
    batch = prompts.shape[0]
    decoder = Decoder(model, batch, prompts.shape[1] + 2 * steps + 4,
                      **{"sdpa_backends": sdpa, "routed_rows": routed_rows, **decoder_args})
    logits = decoder.prefill(prompts.tolist())
    for _ in range(3):  # capture and warm up
        logits = decoder.step(logits.argmax(-1))
    sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        logits = decoder.step(logits.argmax(-1))
    sync(device)
    step_us = (time.perf_counter() - start) / steps * 1e6
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            logits = decoder.step(logits.argmax(-1))
        sync(device)
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            by_name[e.name][0] += 1
            by_name[e.name][1] += e.time_range.elapsed_us()
    top = sorted(by_name.items(), key=lambda item: -item[1][1])
    return {"step_us": step_us, "kernels": sum(n for n, _ in by_name.values()) / steps,
            "busy_us": sum(us for _, us in by_name.values()) / steps,
            "top": [(name, n / steps, us / steps) for name, (n, us) in top]}


def run_kernel_profiles(models: dict[str, LanguageModel], args: argparse.Namespace, device: torch.device,
                        dtype: torch.dtype, card: str, sdpa, decoder_args: dict[str, Any]) -> None:
    """--kernels: per setting, a table of each model's step, then each model's top kernels."""
    print(f"Decode kernels, {card}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}: D={args.width}, "
          f"{args.heads} heads, {args.layers} layers, vocab {args.vocab}; {args.profile_steps} replayed steps a model "
          f"(the greedy pick included); --routed-rows {args.routed_rows[0]}")
    for prompt, batch, full in settings(args, device, dtype):
        if full is not None:
            print(f"\nprompt {prompt}, batch {batch}: {full}")
            continue
        prompts = torch.randint(0, args.vocab, (batch, prompt), device=device)
        results = {}
        for name, model in models.items():
            calibrate_routers(model, prompts[:CALIBRATION_ROWS], args.capacity)
            results[name] = kernel_profile(model, prompts, args.profile_steps, device, sdpa, args.routed_rows[0],
                                           decoder_args)
        print(f"\nprompt {prompt}, batch {batch}\n")
        print("| model | step us (unprofiled) | kernels per step | GPU busy us per step | x dense (step) |")
        print("| --- | --- | --- | --- | --- |")
        dense = results["dense"]["step_us"]
        for name, r in results.items():
            print(f"| {name} | {r['step_us']:.1f} | {r['kernels']:.1f} | {r['busy_us']:.1f} | {dense / r['step_us']:.2f} |")
        for name, r in results.items():
            print(f"\n{name}: top kernels by GPU time a step\n")
            print("| kernel | launches per step | us per step |")
            print("| --- | --- | --- |")
            for kernel, n, us in r["top"][:KERNEL_ROWS]:
                print(f"| `{kernel[:90]}` | {n:.1f} | {us:.1f} |")
        del prompts
        torch.cuda.empty_cache()


def measure(models: dict[str, LanguageModel], prompts: torch.Tensor, args: argparse.Namespace, device: torch.device,
            sdpa, setups: list[tuple[str, str]], decoder_args: dict[str, Any]) -> tuple[dict[str, float], dict]:
    """One setting: (each model's median prefill ms, (model, policy) -> its best Row, or the reason it did not run)."""
    for model in models.values():
        calibrate_routers(model, prompts[:CALIBRATION_ROWS], args.capacity)
    times = time_settings(models, prompts.tolist(), device, args.prefill_repeats, warmup=1, profiled=False)
    prefill = {name: t.median_ms for name, t in times.items()}
    best: dict[tuple[str, str], Row | str] = {}
    for name, policy in setups:  # warm up kernels and allocator; a Decoder refusing its keywords leaves its reason
        try:
            decode_run(models[name], prompts[:, :8], 4, device, sdpa, *step_kind(policy), decoder_args)
        except ValueError as e:
            best[name, policy] = f"not run: {str(e).splitlines()[0]}"
    for _ in range(args.repeats):  # interleaved, so a slow spell of the machine hits every row alike
        for name, policy in setups:
            if isinstance(best.get((name, policy)), str):
                continue
            _, tps, share, used = decode_run(models[name], prompts, args.new_tokens, device, sdpa, *step_kind(policy),
                                             decoder_args)
            if (name, policy) not in best or tps > best[name, policy].tokens_per_s:
                best[name, policy] = Row(used, tps, share, prefill[name])
    return prefill, best


def table_rows(args: argparse.Namespace, prompt: int, batch: int, best: dict) -> list[str]:
    """The setting's markdown rows, each model's against dense decoded with the same policy."""
    rows = []
    for (name, policy), row in best.items():
        lead = f"| {prompt} | {batch} | {name} |"
        dense = best.get(("dense", policy))
        if isinstance(row, str):
            rows.append(f"{lead} {row} | - | - | - | - | - | - | - | - |")
            continue
        speed = row.tokens_per_s / dense.tokens_per_s if isinstance(dense, Row) else float("nan")
        slower = row.prefill_ms / dense.prefill_ms if isinstance(dense, Row) else float("nan")
        flops = prefill_flop_ratio(args, name, prompt)
        if name == "dense":
            decode_goal = prefill_goal = "-"
        else:
            goal = decode_target(batch, prompt)
            decode_goal = "- (bound by reading weights)" if goal is None else f">= {goal:.2f} x: {verdict(speed >= goal)}"
            limit = flops * PREFILL_SLACK
            prefill_goal = f"<= {limit:.2f} x: {verdict(slower <= limit)}" if batch in PREFILL_TARGET_BATCHES else "-"
        share = "-" if name == "dense" else f"{row.share:.3f}"
        rows.append(f"{lead} {row.used} | {row.tokens_per_s:,.0f} | {speed:.2f} | {share} | {row.prefill_ms:.2f} | "
                    f"{slower:.2f} | {flops:.3f} | {decode_goal} | {prefill_goal} |")
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--capacity", type=float, default=0.125)
    parser.add_argument("--prompts", "--prompt", type=int, nargs="+", default=None,
                        help="prompt lengths (default 128 2048; --tiny: 16)")
    parser.add_argument("--batches", type=int, nargs="+", default=None, help="default 1 64 1024 (--tiny: 1 4)")
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--new-tokens", type=int, default=64, help="decode steps per run (the first untimed)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved decode runs per setting; the best is reported")
    parser.add_argument("--prefill-repeats", type=int, default=5, help="prefills per setting; the median is reported")
    parser.add_argument("--memory-gib", type=float, default=None,
                        help="device memory a setting may use (default: what is free after the models are built)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at a small shape")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"],
                        help="auto: CUDA if there is a GPU (CPU with --tiny); without a GPU, anything but --tiny "
                             "needs --device cpu")
    parser.add_argument("--profile", action="store_true", help="count ops, launches and syncs per decode step instead of timing")
    parser.add_argument("--profile-steps", type=int, default=8)
    parser.add_argument("--kernels", action="store_true",
                        help="profile replayed decode steps (a GPU): kernels per step and where their time goes")
    parser.add_argument(
        "--sdpa", default="decoder", choices=["decoder", "torch"],
        help="attention backends: the decoder's default (no cuDNN) or torch's own choice",
    )
    parser.add_argument("--compile", action="store_true", help="also the static step with torch.compile (Decoder(compile=True))")
    parser.add_argument(
        "--routed-rows", nargs="+", default=["auto"], choices=list(ROUTED_ROWS),
        help="how a decode step runs a routed layer (mode.generate.Decoder's routed_rows); rows for each",
    )
    parser.add_argument("--decoder-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="a keyword for every decode run's Decoder, e.g. cuda_graph=False (repeatable)")
    args = parser.parse_args(argv)
    check_device(parser, args)
    try:
        decoder_args = parse_decoder_args(args.decoder_arg)
    except ValueError as e:
        parser.error(str(e))
    if args.tiny:
        use_smoke_shape(args)
        args.new_tokens, args.repeats, args.prefill_repeats = 8, 1, 2
    args.prompts = args.prompts or ([16] if args.tiny else [128, 2048])
    args.batches = args.batches or ([1, 4] if args.tiny else [1, 64, 1024])
    if "dense" not in args.models:
        args.models = ["dense", *args.models]  # every ratio is to dense
    if args.device == "auto":
        device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    else:
        device = torch.device(args.device)
    sdpa = DECODE_SDPA_BACKENDS if args.sdpa == "decoder" else None
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    card = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    # the positions a decode takes past the prompt: profile_decode's and kernel_profile's own steps
    steps = args.profile_steps + 3 if args.profile else 2 * args.profile_steps + 4 if args.kernels else args.new_tokens
    models = build_models(args.models, args, max(args.prompts) + steps, device, dtype)
    if args.profile:
        run_profiles(models, args, device, dtype, card, sdpa)
        return
    if args.kernels:
        if device.type != "cuda":
            parser.error("--kernels profiles the CUDA-graphed step: it needs a GPU")
        run_kernel_profiles(models, args, device, dtype, card, sdpa, decoder_args)
        return

    setups = [(name, policy) for policy in args.routed_rows for name in models]
    if args.compile:
        setups += [(name, "masked+compile") for name in models]
    rows = []
    for prompt, batch, full in settings(args, device, dtype):
        if full is None:
            prompts = torch.randint(0, args.vocab, (batch, prompt), device=device)
            try:
                _, best = measure(models, prompts, args, device, sdpa, setups, decoder_args)
            except torch.OutOfMemoryError:
                full, best = "out of memory", {}
            del prompts
            torch.cuda.empty_cache() if device.type == "cuda" else None
        if full is not None:
            best = {setup: full for setup in setups}
        rows += table_rows(args, prompt, batch, best)
    extra = "".join(f", {key}={value!r}" for key, value in decoder_args.items())
    print(
        f"\nDecode and prefill, {card}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}: D={args.width}, "
        f"{args.heads} heads, {args.layers} layers, vocab {args.vocab}, ffn {args.ffn}; {args.new_tokens} new tokens "
        f"(greedy), best of {args.repeats} decode runs; prefill: median of {args.prefill_repeats}; MoD: every other "
        f"block routed, causal method (a), target share {args.capacity}; Staged MoDE: MoD's routed blocks with a top-1 "
        f"token-choice MoE; attention backends: "
        f"{'decoder default (flash, efficient, math)' if sdpa is not None else 'torch default'}{extra}\n"
    )
    print("| prompt | batch | model | decode step | decode tokens/s | x dense | routed share (decode) | prefill ms | "
          "x dense (time) | prefill FLOP ratio | decode target | prefill target |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    print("\n".join(rows))


def run_profiles(models: dict[str, LanguageModel], args: argparse.Namespace, device: torch.device, dtype: torch.dtype,
                 card: str, sdpa) -> None:
    print(f"Decode profile, {card}, torch {torch.__version__}, {str(dtype).removeprefix('torch.')}: D={args.width}, "
          f"{args.heads} heads, {args.layers} layers; aten ops are those called from Python, views excluded")
    for prompt in args.prompts:
        for batch in args.batches:
            prompts = torch.randint(0, args.vocab, (batch, prompt), device=device)
            for name, model in models.items():
                calibrate_routers(model, prompts[:CALIBRATION_ROWS], args.capacity)
                result = profile_decode(model, prompts, args.profile_steps, device, sdpa, args.routed_rows[0])
                print_profile(f"{name}, prompt {prompt}", batch, result, device.type == "cuda")


if __name__ == "__main__":
    main()
