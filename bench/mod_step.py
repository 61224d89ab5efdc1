"""MoD vs dense: training-step time, peak memory and the analytic FLOP ratio, on one GPU.

    python -m bench.mod_step                 # seq 2048, width 1024, 12 layers, bf16, B=8
    python -m bench.mod_step --tiny          # a CPU-sized smoke run of the same script
    python -m bench.mod_step --attention-backend auto cudnn   # each mode once per attention kernel

Both models have the same shape; the MoD model routes 12.5% of each sequence through every
other block. Measured in the same process, same card: forward+backward, and the whole step
with fused AdamW, each pass on an idle GPU (synchronised: the host's launch latency shows);
and whole steps queued back to back, one synchronisation after --iters of them, as
mode.train's loop runs them (it reads a step's losses after queuing the next); eager,
torch.compile, and torch.compile with CUDA graphs
(mode="reduce-overhead": the step replayed without launching kernels one by one from the
host). Both models of a mode stay built and are timed in interleaved rounds (dense, MoD,
dense, ...); each cell is the median over rounds of each round's median. Prints a markdown table,
with each model's training FLOPs a step (mode.flops: 3 x the analytic forward, every token of the
batch) over its step time, and again over its back-to-back step time, in TFLOP/s.
--attention-backend runs every mode once per SDPA kernel (train.attention_backend's choices);
--optimizer train steps as mode.train does (decay groups, global-norm clipping, and on a GPU the
matrices in bf16 with float32 masters: train.bf16_weights), train-float32 the same with float32
weights, adamw (the default) plain fused AdamW on every float32 parameter.
"eager + CUDA graphs" is the eager model as train.cuda_graphs trains it (mode.training.graphs.GraphedMicroStep:
forward and backward captured once, replayed; no torch.compile): how python -m mode.train runs
without torch.compile on a GPU by default (train.cuda_graphs=auto). "eager" is plain eager
(train.cuda_graphs=false), each kernel launched from the host.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

from bench.common import (
    add_model_args,
    add_routing_switches,
    apply_routing_switches,
    gib,
    kernels_in_use,
    precision,
    profile_report,
    require_cuda_unless_tiny,
    sync,
    timed,
    timed_back_to_back,
)
from mode.config import Config, config_from_dict
from mode.flops import model_flops
from mode.layers.attention import ATTENTION_BACKENDS, attention_backend_problem, set_attention_backend
from mode.model import LanguageModel
from mode.training.graphs import GraphedMicroStep
from mode.training.optim import TorchOptimization


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


COMPILE = {"eager": None, "eager + CUDA graphs": None, "compiled": {}, "compiled + CUDA graphs": {"mode": "reduce-overhead"}}


def check_modes(parser: argparse.ArgumentParser, modes: list[str] | None) -> None:
    """A CUDA-graph mode named without a GPU is an error, not a mode quietly left out (an empty table)."""
    for mode in modes or []:
        if "CUDA graphs" in mode and not torch.cuda.is_available():
            parser.error(f"--modes {mode!r} needs a CUDA GPU")


OPTIMIZERS = ("adamw", "train", "train-float32", "train-overlapped")


def add_optimizer_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                        help="the step's update: fused AdamW on every float32 parameter; mode.train's step (weight "
                             "decay on matrices only, global-norm clipping folded into the update, gradients zeroed "
                             "by the step; on a GPU the matrices in bf16 with float32 masters, train.bf16_weights); "
                             "mode.train's step with float32 weights; or with bf16 weights whose update runs inside "
                             "the next forward under the eager CUDA graphs (train.overlap_update=auto)")


def bf16_weights_in(optimizer: str, device: torch.device) -> bool:
    """Whether the --optimizer's step holds the matrices in bf16 (mode.train's default on a GPU)."""
    return optimizer in ("train", "train-overlapped") and device.type == "cuda"


def describe_optimizer(optimizer: str, device: torch.device) -> str:
    if optimizer == "adamw":
        return "fused AdamW on every float32 parameter"
    bf16 = bf16_weights_in(optimizer, device)
    weights = "bf16 matrices with float32 masters" if bf16 else "float32 weights"
    where = ""
    if bf16 and optimizer == "train-overlapped":
        where = ", updated inside the next forward under the eager CUDA graphs (train.overlap_update)"
    return f"mode.train's (AdamW, decay on matrices, gradients clipped at norm 1.0), {weights}{where}"


class Runner:
    """One model, its fused AdamW and a fixed batch: timed forward+backward and whole steps.
    attention: the SDPA kernel (train.attention_backend); optimizer: "adamw" (fused AdamW on every
    parameter), "train" (mode.train's TorchOptimization, bf16 weights on a GPU), "train-float32"
    (the same with float32 weights) or "train-overlapped" (bf16 weights whose update runs inside the
    next forward under the eager CUDA graphs)."""

    def __init__(self, config: Config, mode: str, args: argparse.Namespace, device: torch.device,
                 attention: str = "auto", optimizer: str = "adamw") -> None:
        base = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        torch.manual_seed(0)
        self.model = LanguageModel(config).to(device)
        self.params = list(self.model.parameters())
        set_attention_backend(self.model, attention)
        options = COMPILE[mode]
        self.forward = self.model if options is None else torch.compile(self.model, **options)
        self.graphs = mode == "compiled + CUDA graphs"
        self.optimization: TorchOptimization | None = None  # optimizer "train": mode.train's step
        graphed = mode == "eager + CUDA graphs"
        if optimizer in OPTIMIZERS[1:]:
            bf16 = bf16_weights_in(optimizer, device)
            self.optimization = TorchOptimization(self.model, config, device, keep_grads=graphed, zero_grads=not graphed,
                                                  bf16_weights=bf16,
                                                  defer_update=bf16 and graphed and optimizer == "train-overlapped")
            self.optimizer = self.optimization.optimizer
        else:
            self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=1e-4, fused=device.type == "cuda")
        self.micro_step: GraphedMicroStep | None = None
        if graphed:  # as train.cuda_graphs: the graph writes the gradients it keeps
            self.micro_step = GraphedMicroStep(self.model, lambda loss, _: loss.backward(), 1)
        tokens = torch.randint(0, args.vocab, (args.batch, args.seq + 1), device=device)
        self.x, self.y = tokens[:, :-1], tokens[:, 1:]
        self.autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda")
        self.args, self.device = args, device
        self.fwd_bwd_ms: list[float] = []
        self.step_ms: list[float] = []
        self.back_to_back_ms: list[float] = []
        # Peak memory of this model alone: the other model of the pair holds no gradients while this runs.
        if device.type == "cuda":
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        self.time_round(self.args.warmup)
        self.peak_gib = (torch.cuda.max_memory_allocated() - base) / 2**30 if device.type == "cuda" else None

    def fwd_bwd(self) -> None:
        # Fresh gradients each pass, as a training step has (a CUDA-graphed backward owns the
        # tensors it returns until its next replay; the eager model's graph writes them afresh).
        if self.micro_step is not None:
            self.micro_step(self.x, self.y)
            return
        for p in self.params:  # the model's: with bf16 weights the optimizer holds masters
            p.grad = None  # (from a list, as mode.train's step frees them, not zero_grad's walk of every module)
        if self.graphs:
            torch.compiler.cudagraph_mark_step_begin()
        with self.autocast:
            loss = self.forward(self.x, self.y).loss
        loss.backward()

    def step(self) -> None:
        if self.optimization is not None:  # as mode.train: the step clips, steps and zeroes the gradients itself
            self.fwd_bwd()
            self.optimization.step(1e-4)
            return
        self.fwd_bwd()
        self.optimizer.step()

    def time_round(self, warmup: int = 1) -> None:
        """One round: the median forward+backward and step of --iters each, appended to the lists."""
        self.fwd_bwd_ms.append(timed(self.fwd_bwd, warmup, self.args.iters, self.device))
        self.step_ms.append(timed(self.step, warmup, self.args.iters, self.device))
        self.back_to_back_ms.append(timed_back_to_back(self.step, warmup, self.args.iters, self.device))
        if self.micro_step is None:  # a captured graph's gradients stay with it
            self.model.zero_grad(set_to_none=True)


def measure_pair(dense_cfg: Config, mod_cfg: Config, mode: str, args: argparse.Namespace,
                 device: torch.device, attention: str = "auto") -> tuple[Runner, Runner]:
    """Both models, their rounds interleaved (dense, MoD, dense, ...) so clock drift hits both alike."""
    if COMPILE[mode] is not None:  # compile afresh: no graph traced under another attention kernel is reused
        torch._dynamo.reset()
    dense = Runner(dense_cfg, mode, args, device, attention, args.optimizer)
    mod = Runner(mod_cfg, mode, args, device, attention, args.optimizer)
    for _ in range(args.rounds - 1):
        dense.time_round()
        mod.time_round()
    return dense, mod


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    add_model_args(parser)
    parser.add_argument("--capacity", type=float, default=0.125)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of --iters per model; the median round is reported")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph modes (eager and compiled)")
    parser.add_argument("--modes", nargs="+", choices=list(COMPILE), default=None,
                        help="time only these modes (of those the other flags and the device allow)")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke run at a small shape")
    parser.add_argument("--profile", nargs="*", choices=["eager", "compiled"], default=None,
                        help="also print the host's time queuing fwd+bwd and its top kernels (eager if no mode is named)")
    parser.add_argument("--attention-backend", nargs="+", choices=list(ATTENTION_BACKENDS), default=["auto"],
                        help="SDPA kernels of the attention layers (train.attention_backend): each mode is timed "
                             "once per kernel named, both models each time")
    add_optimizer_arg(parser)
    parser.add_argument("--kernels", choices=["triton", "torch"], default="triton",
                        help="eager: any Triton kernels at all, or PyTorch ops only (KernelPolicy.enabled, "
                             "as MODE_KERNELS=torch)")
    add_routing_switches(parser)
    args = parser.parse_args(argv)
    require_cuda_unless_tiny(parser, args)
    check_modes(parser, args.modes)
    apply_routing_switches(args, enabled=args.kernels == "triton")
    if args.tiny:
        args.batch, args.seq, args.width, args.heads, args.layers, args.ffn, args.vocab = 2, 128, 64, 4, 4, 128, 256
        args.warmup, args.iters, args.rounds, args.no_compile = 1, 3, 2, True
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    card = torch.cuda.get_device_name() if device.type == "cuda" else "CPU"
    torch.backends.cuda.matmul.allow_tf32 = True

    dense_cfg, mod_cfg = make_config(["dense"], args), make_config(["dense", "mod"], args)
    flop_ratio = model_flops(mod_cfg).forward_per_token / model_flops(dense_cfg).forward_per_token
    modes = ["eager"] + ([] if args.no_graphs or device.type != "cuda" else ["eager + CUDA graphs"])
    modes += [] if args.no_compile else ["compiled"]
    modes += [] if args.no_compile or args.no_graphs or device.type != "cuda" else ["compiled + CUDA graphs"]
    if args.modes:
        allowed, modes = modes, [m for m in modes if m in args.modes]
        if not modes:  # an empty table would read as a run that measured nothing
            parser.error(f"--modes {', '.join(args.modes)}: not run here (this run times {', '.join(allowed)}; "
                         "--tiny and --no-compile turn torch.compile off, --no-graphs the CUDA-graph modes)")
    check_attention(parser, args, dense_cfg, device)
    triton = kernels_in_use(device, {"eager kernels": args.kernels, "top-k": args.topk})
    print(f"card: {card}; torch {torch.__version__}; B={args.batch} S={args.seq} D={args.width} "
          f"layers={args.layers} ffn={args.ffn} vocab={args.vocab} capacity={args.capacity} on every other block, "
          f"{precision(device)}, {triton}")
    print(f"analytic forward FLOPs/token: dense {model_flops(dense_cfg).forward_per_token / 1e6:.1f}M, "
          f"MoD {model_flops(mod_cfg).forward_per_token / 1e6:.1f}M, ratio {flop_ratio:.3f}")
    print(f"the step's update: {describe_optimizer(args.optimizer, device)}\n")
    step_flops = {name: model_flops(cfg).train_per_token * args.batch * args.seq
                  for name, cfg in (("dense", dense_cfg), ("MoD", mod_cfg))}
    print("| mode | model | fwd+bwd ms | step ms (AdamW) | steps back to back ms | peak GiB | fwd+bwd ratio | step ratio "
          "| back-to-back ratio | ratio / FLOP ratio (fwd+bwd, step, back to back) | attention "
          "| TFLOP/s (step, back to back) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for mode in modes:
        for attention in args.attention_backend:
            dense, mod = measure_pair(dense_cfg, mod_cfg, mode, args, device, attention)
            rows = {name: (statistics.median(r.fwd_bwd_ms), statistics.median(r.step_ms),
                           statistics.median(r.back_to_back_ms), r.peak_gib) for name, r in (("dense", dense), ("MoD", mod))}
            del dense, mod
            if device.type == "cuda":
                torch.cuda.empty_cache()
            (d_fb, d_st, d_b2b, d_peak), (m_fb, m_st, m_b2b, m_peak) = rows["dense"], rows["MoD"]
            fb, st, b2b = m_fb / d_fb, m_st / d_st, m_b2b / d_b2b
            d_tflops, m_tflops = tflops(step_flops["dense"], d_st, d_b2b), tflops(step_flops["MoD"], m_st, m_b2b)
            print(f"| {mode} | dense | {d_fb:.2f} | {d_st:.2f} | {d_b2b:.2f} | {gib(d_peak)} | | | | | {attention} "
                  f"| {d_tflops} |")
            print(f"| {mode} | MoD | {m_fb:.2f} | {m_st:.2f} | {m_b2b:.2f} | {gib(m_peak)} | {fb:.3f} | {st:.3f} | {b2b:.3f} "
                  f"| {fb / flop_ratio:.3f} x, {st / flop_ratio:.3f} x, {b2b / flop_ratio:.3f} x | {attention} "
                  f"| {m_tflops} |", flush=True)
    profile_modes = [] if args.profile is None else (args.profile or ["eager"])  # bare --profile: eager
    for mode in profile_modes:
        for attention in args.attention_backend:
            for name, cfg in (("dense", dense_cfg), ("MoD", mod_cfg)):
                profile(name, cfg, args, device, compiled=mode == "compiled", attention=attention)


def tflops(flops: float, *step_ms: float) -> str:
    """A step's FLOPs over each of its times, in TFLOP/s, as one cell ("352.0, 355.1")."""
    rates = [flops / (ms * 1e-3) / 1e12 for ms in step_ms]
    return ", ".join(f"{rate:.1f}" if rate >= 10 else f"{rate:.3g}" for rate in rates)  # a tiny CPU run's too


def check_attention(parser: argparse.ArgumentParser, args: argparse.Namespace, config: Config,
                    device: torch.device) -> None:
    """Each --attention-backend must run this shape here (in the precision the passes compute in),
    as train.attention_backend is checked at start-up: one line naming the kernel, not a traceback."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    for name in args.attention_backend:
        problem = attention_backend_problem(name, device, config.model.head_width, dtype)
        if problem is not None:
            parser.error(f"--attention-backend {name}: {problem}")


def profile(name: str, config: Config, args: argparse.Namespace, device: torch.device, compiled: bool,
            attention: str = "auto") -> None:
    """Where forward+backward's time goes, eager or compiled: the host's time launching it, GPU busy
    against wall time, top kernels."""
    mode = "compiled" if compiled else "eager"
    if compiled:
        torch._dynamo.reset()
    runner = Runner(config, mode, args, device, attention, args.optimizer)  # warmed up
    title = f"{name}, {mode} forward+backward" + ("" if attention == "auto" else f", {attention} attention")
    forward_ms, backward_ms = host_ms(runner, 10)
    print(f"\n### {title}: the host's time queuing a pass (median of 10, the GPU idle at the start of each): "
          f"forward {forward_ms:.2f} ms, backward {backward_ms:.2f} ms, {forward_ms + backward_ms:.2f} ms in all")
    print(profile_report(runner.fwd_bwd, 3, device, title, 40))


def host_ms(runner: Runner, passes: int) -> tuple[float, float]:
    """Median milliseconds the host spends in the forward call and in loss.backward(), without waiting
    for the GPU: where they add up to more than the kernels take, the host sets the pace."""
    forward, backward = [], []
    for _ in range(passes):
        runner.model.zero_grad(set_to_none=True)
        sync(runner.device)
        start = time.perf_counter()
        with runner.autocast:
            loss = runner.forward(runner.x, runner.y).loss
        middle = time.perf_counter()
        loss.backward()
        forward.append((middle - start) * 1e3)
        backward.append((time.perf_counter() - middle) * 1e3)
    sync(runner.device)
    return statistics.median(forward), statistics.median(backward)


if __name__ == "__main__":
    main()
