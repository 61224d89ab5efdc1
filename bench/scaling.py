"""Multi-GPU training throughput: tokens/s on 1, 2, 4 ... processes, expert parallelism = world size.

    python3 -m torch.distributed.run --standalone --nproc_per_node N -m bench.scaling [--impl mode|deepspeed] [...]
    .venv/bin/python -m torch.distributed.run --standalone --nproc_per_node 2 -m bench.scaling --tiny   # CPU, gloo
    bash bench/scaling.sh            # N = 1, 2, 4 (as many GPUs as there are), both impls, one table

Each process trains the GPU-sized Integrated MoDE model of configs/mode_integrated_gpu.yaml
(D=1024, 16 heads, 12 layers, sequence 2048, blocks [dense, mode_integrated]: 8 real + 8
no-op experts, expert choice, capacity factor 1, SwiGLU experts of width 4096) on a fixed
micro-batch (train.batch_size sequences: fixed tokens per GPU), with
parallel.expert_parallel = world size. A step is the project's own training step:
`Trainer.train_step()` of the Trainer that launch/train.py builds (data sampling, bf16
autocast on GPU, forward, backward and optimizer step through mode.parallel's DeepSpeed
engine, losses averaged over ranks); the engine's JSON is generated from the config as in
training (ZeRO stage from the config's `parallel.zero_stage`, 0 unless --zero-stage).

--impl mode       the model as launch/train.py trains it (mode.parallel.launch.build_trainer):
                  experts sharded by mode.parallel.apply_expert_parallel, tokens by all-to-all.
--impl deepspeed  the same model with every MoE FFN replaced by DeepSpeed's own
                  `deepspeed.moe.layer.MoE` (top-1 gate, capacity factor 1.0, tokens dropped
                  beyond capacity, no random token selection, ep_size = world size, expert =
                  the same SwiGLU (or GELU) MLP of width moe.d_expert or model.d_ff), its
                  load-balancing loss added with weight moe.lb_loss_weight; the same Trainer
                  and engine, plain eager (its gate reads expert counts on the host, so no
                  CUDA graph holds it; --impl mode on one GPU, ep 1 and ZeRO 0, is graphed)
                  and with float32 weights (--impl mode there holds bf16 weights with float32
                  masters, as launch/train.py does; the context line says which).
                  Note the FLOPs: top-1 at capacity 1 sends every token through one expert,
                  while Integrated MoDE with 8 real + 8 no-op experts computes half of them
                  (--config configs/moe_gpu.yaml gives the mode model at equal expert FLOPs).

Timing: --warmup steps, then --steps timed steps (CUDA synchronised around each); each
step's time is the slowest rank's; the row reports the median. tokens/s counts every
process's tokens (world x batch x seq / median step time). Peak GiB is the largest
torch.cuda.max_memory_allocated over ranks. Rank 0 prints one context line (`# ...`) and
one markdown row: | impl | GPUs | tokens/s | ms/step | peak GiB |.

--profile N: after the row, N more steps under torch.profiler; rank 0 prints the wall time
per step against the time a kernel was running (GPU busy) and the top kernels.

Options: --config, --batch, --ep, --zero-stage, --warmup, --steps, --profile, --label (the row's first
cell, e.g. `--config configs/moe_gpu.yaml --label mode-moe`), --tiny. Extra
`--section.field=value` arguments override the config, as for launch/train.py.
"""
from __future__ import annotations

import argparse
import dataclasses
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from bench.common import GeluMLP, profile_report, sync
from mode.config import Config, ConfigError, load_config
from mode.kernels import kernel_policy
from mode.layers.mlp import SwiGLU
from mode.layers.moe import MoEFFN
from mode.model import LanguageModel, ModelOutput
from mode.parallel.engine import DeepSpeedOptimization, Processes, init_distributed, quiet_deepspeed
from mode.parallel.launch import build_trainer, exit_without_teardown
from mode.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
GPU_CONFIG = ROOT / "configs" / "mode_integrated_gpu.yaml"
TINY_CONFIG = ROOT / "configs" / "mode_integrated_tiny.yaml"
# --tiny: a CPU smoke shape (4 real + 4 no-op experts of the tiny config, so ep 2 divides them)
TINY_OVERRIDES = ["--model.d_model=64", "--model.n_heads=4", "--model.n_layers=2", "--model.d_ff=128",
                  "--data.seq_len=64", "--train.batch_size=2", "--train.device=auto"]


# ----------------------------------------------------------------------------- --impl deepspeed
class DeepSpeedFFN(nn.Module):
    """DeepSpeed's MoE in the place of an MoEFFN: returns the output alone, keeps the gate's loss."""

    def __init__(self, config: Config, ep_size: int) -> None:
        super().__init__()
        from deepspeed.moe.layer import MoE

        d_model, moe = config.model.d_model, config.moe
        width = moe.d_expert or config.model.d_ff
        expert = SwiGLU(d_model, width) if moe.activation == "swiglu" else GeluMLP(d_model, width)
        self.moe = MoE(
            hidden_size=d_model, expert=expert, num_experts=moe.n_experts, ep_size=ep_size, k=1,
            capacity_factor=1.0, eval_capacity_factor=1.0, min_capacity=0, drop_tokens=True, use_rts=False,
        )
        self.l_aux: Tensor | None = None

    @torch.no_grad()
    def reset_experts(self, std: float, generator: torch.Generator) -> None:
        """DeepSpeed deep-copies one expert num_local_experts times: give each its own weights."""
        for p in self.moe.deepspeed_moe.experts.parameters():
            p.normal_(0.0, std, generator=generator)

    def forward(self, x: Tensor) -> Tensor:
        out, self.l_aux, _ = self.moe(x)
        return out


class DeepSpeedMoEModel(nn.Module):
    """A LanguageModel whose MoE FFNs are DeepSpeed MoEs; their load-balancing loss joins the aux loss."""

    def __init__(self, model: LanguageModel, ffns: list[DeepSpeedFFN], weight: float) -> None:
        super().__init__()
        self.lm = model
        self.ffns = ffns  # a plain list: the modules are registered inside self.lm
        self.weight = weight

    def forward(self, tokens: Tensor, targets: Tensor | None = None, routing_mode: str | None = None) -> ModelOutput:
        out = self.lm(tokens, targets, routing_mode=routing_mode)
        extra = self.weight * sum(ffn.l_aux.float() for ffn in self.ffns)
        if out.loss is None:
            return dataclasses.replace(out, aux_loss=out.aux_loss + extra)
        return dataclasses.replace(out, loss=out.loss + extra, aux_loss=out.aux_loss + extra)

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())


def replace_moe_ffns(model: LanguageModel, config: Config, ep_size: int) -> list[DeepSpeedFFN]:
    """Swap every MoEFFN (MoE, Staged and Integrated MoDE blocks) for a DeepSpeedFFN."""
    targets = [(parent, name) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, MoEFFN)]
    ffns = []
    for parent, name in targets:
        ffn = DeepSpeedFFN(config, ep_size)
        setattr(parent, name, ffn)
        ffns.append(ffn)
    return ffns


def build_deepspeed_trainer(config: Config, processes: Processes) -> Trainer:
    """build_trainer's steps with DeepSpeed's MoE layers: model -> DeepSpeed engine -> Trainer."""
    from deepspeed.utils import groups

    ep = config.parallel.expert_parallel
    # DeepSpeed's gate copies its expert counts to the host in every forward: no CUDA graph holds it.
    config.train.cuda_graphs = False
    # Its experts are DeepSpeed's modules, which train.bf16_weights does not hold: float32 weights throughout.
    config.train.bf16_weights = False
    torch.manual_seed(config.train.seed)
    with torch.device(processes.device):  # built in place (start-up only; the weights are not compared)
        model = LanguageModel(config)
        ffns = replace_moe_ffns(model, config, ep)
    if not ffns:
        raise ValueError(f"--impl deepspeed: the model of this config has no MoE FFN ({config.model.block_kinds()})")
    experts_rng = torch.Generator(processes.device).manual_seed(config.train.seed + 1 + processes.rank)
    for ffn in ffns:  # this rank's experts differ from each other and from other ranks'
        ffn.reset_experts(config.model.init_std, experts_rng)
    model = DeepSpeedMoEModel(model, ffns, config.moe.lb_loss_weight).to(processes.device)
    rng = torch.get_rng_state()
    optimization = DeepSpeedOptimization(model, config, processes)  # the engine creates DeepSpeed's expert groups
    if ep > 1:  # ZeRO 0 clips by the exact global norm: expert norms summed over the expert-parallel group
        optimization.ep_group = groups._get_expert_parallel_group(f"ep_size_{ep}")
    trainer = Trainer(config, optimization=optimization, model=optimization.model,
                      rank=processes.rank, world_size=processes.world_size)
    torch.set_rng_state(rng)
    return trainer


# ----------------------------------------------------------------------------- measurement
def time_steps(trainer: Trainer, warmup: int, steps: int, device: torch.device) -> tuple[list[float], list[float]]:
    """Seconds of each timed train_step (the slowest rank's), and every step's loss (mean over ranks)."""
    losses = [trainer.train_step()["loss"] for _ in range(warmup)]
    sync(device)
    dist.barrier()
    times = []
    for _ in range(steps):
        sync(device)
        start = time.perf_counter()
        losses.append(trainer.train_step()["loss"])
        sync(device)
        times.append(time.perf_counter() - start)
    t = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.tolist(), losses


def profile_steps(trainer: Trainer, steps: int, device: torch.device, rank: int) -> None:
    """Every rank runs `steps` more training steps under torch.profiler; rank 0 prints where they went."""
    report = profile_report(trainer.train_step, steps, device, f"training steps on rank 0 of {dist.get_world_size()}")
    if rank == 0:
        print(report, flush=True)


def peak_gib(device: torch.device) -> float | None:
    if device.type != "cuda":
        return None
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30], dtype=torch.float64, device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    return float(peak)


def describe(config: Config, processes: Processes, impl: str, args: argparse.Namespace, graphed: bool,
             bf16_weights: bool) -> str:
    m, moe, t = config.model, config.moe, config.train
    card = torch.cuda.get_device_name(processes.device) if processes.device.type == "cuda" else "CPU"
    if impl == "mode":
        ffn = (f"{moe.n_experts} experts + {moe.n_noop} no-op, {moe.scheme}, capacity factor {moe.capacity_factor}, "
               f"backend {moe.backend}")
    else:
        ffn = f"DeepSpeed MoE: {moe.n_experts} experts, top-1, capacity factor 1.0"
    precision = "bf16 autocast" if processes.device.type == "cuda" else "fp32"
    # Eager runs on CUDA use mode/kernels/ (rotary, SwiGLU, loss) unless MODE_KERNELS=torch.
    eager_kernels = "" if t.compile or processes.device.type != "cuda" else (
        " (Triton kernels)" if kernel_policy().enabled else " (MODE_KERNELS=torch: no Triton kernels)")
    if processes.device.type == "cuda" and config.parallel.zero_stage > 0:
        precision += " + DeepSpeed bf16 weights"
    elif bf16_weights:
        precision += " + bf16 weights, float32 masters"
    return (f"# {args.label or impl}: {card} x {processes.world_size} ({processes.backend}); --impl {impl}, "
            f"{args.config}: blocks "
            f"{m.block_pattern} x {m.n_layers}, D={m.d_model}, heads {m.n_heads}, d_ff {m.d_ff}, vocab {m.vocab_size}; "
            f"MoE FFN: {ffn}, {moe.activation}; per GPU {t.batch_size} x {config.data.seq_len} tokens "
            f"(grad_accum {t.grad_accum}); ep {config.parallel.expert_parallel}, ZeRO {config.parallel.zero_stage}, "
            f"{precision}{', torch.compile' if t.compile else ', eager'}{eager_kernels}"
            f"{', each micro-batch a CUDA graph' if graphed else ''}; "
            f"median of {args.steps} steps after {args.warmup}")


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--impl", choices=("mode", "deepspeed"), default="mode")
    parser.add_argument("--config", default=None,
                        help=f"default {GPU_CONFIG.relative_to(ROOT)} ({TINY_CONFIG.relative_to(ROOT)} with --tiny)")
    parser.add_argument("--batch", type=int, default=None,
                        help="sequences per GPU (default: the config's train.batch_size)")
    parser.add_argument("--ep", type=int, default=None, help="expert-parallel size (default: the world size)")
    parser.add_argument("--zero-stage", type=int, choices=(0, 1, 2), default=None, help="default: the config's")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 3; 1 with --tiny)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default 8; 3 with --tiny)")
    parser.add_argument("--profile", type=int, default=0, metavar="STEPS",
                        help="after timing, profile STEPS more steps: GPU busy vs wall, top kernels (rank 0)")
    parser.add_argument("--label", default=None, help="the row's first cell (default: the impl)")
    parser.add_argument("--tiny", action="store_true",
                        help="CPU smoke shape: 2 layers, D=64, 2 x 64 tokens per process")
    # the deepspeed launcher's --local_rank (LOCAL_RANK is in the environment)
    parser.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "." in a.split("=", 1)[0] and "=" in a)]
    if bad:
        parser.error(f"unrecognised arguments {bad}: config overrides look like --section.field=value")
    if args.config is None:
        args.config = str((TINY_CONFIG if args.tiny else GPU_CONFIG).relative_to(ROOT))
    if args.tiny:
        rest = TINY_OVERRIDES + rest
    args.warmup = args.warmup if args.warmup is not None else 1 if args.tiny else 3
    args.steps = args.steps if args.steps is not None else 3 if args.tiny else 8
    if args.warmup < 0 or args.steps < 1:
        parser.error("--warmup must be >= 0 and --steps >= 1")
    return args, rest


def main(argv: list[str] | None = None) -> int:
    args, overrides = parse_args(list(sys.argv[1:] if argv is None else argv))
    quiet_deepspeed()
    config_path = args.config if Path(args.config).is_file() else str(ROOT / args.config)
    try:
        config = load_config(config_path, overrides)
        processes = init_distributed(config)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    run_dir = None
    try:
        fixed = ["--train.progress=false", "--train.max_steps=1000000"]
        if config.model.has_experts():  # ep shards experts; a model without them keeps 1
            fixed.append(f"--parallel.expert_parallel={args.ep or processes.world_size}")
        if args.batch is not None:
            fixed.append(f"--train.batch_size={args.batch}")
        if args.zero_stage is not None:
            fixed.append(f"--parallel.zero_stage={args.zero_stage}")
        box = [tempfile.mkdtemp(prefix="mode_bench_scaling_") if processes.rank == 0 else None]
        dist.broadcast_object_list(box, src=0)
        run_dir = Path(box[0])
        config = load_config(config_path, [*overrides, *fixed, f"--train.out_dir={run_dir / 'run'}"])
        build = build_trainer if args.impl == "mode" else build_deepspeed_trainer
        trainer = build(config, processes)
        if processes.rank == 0:
            bf16_weights, _ = trainer.optimization.bf16_weights_applied()
            print(describe(config, processes, args.impl, args, trainer.graphed_step is not None, bf16_weights), flush=True)
        times, losses = time_steps(trainer, args.warmup, args.steps, processes.device)
        peak = peak_gib(processes.device)
        if processes.rank == 0:
            t = config.train
            tokens = t.grad_accum * t.batch_size * config.data.seq_len * processes.world_size
            step_s = statistics.median(times)
            print(f"# step ms: {' '.join(f'{1e3 * s:.1f}' for s in times)}; loss {losses[0]:.4f} -> {losses[-1]:.4f}; "
                  f"{trainer.model.num_parameters() / 1e6:.1f}M parameters on rank 0", flush=True)
            peak_text = f"{peak:.2f}" if peak is not None else "-"
            print(f"| {args.label or args.impl} | {processes.world_size} | {tokens / step_s:,.0f} | "
                  f"{1e3 * step_s:.1f} | {peak_text} |", flush=True)
        if args.profile:
            profile_steps(trainer, args.profile, processes.device, processes.rank)
        return 0
    except Exception:
        print(f"[rank {processes.rank}] bench/scaling.py failed:\n{traceback.format_exc()}",
              file=sys.stderr, flush=True)
        return 1
    finally:
        if processes.rank == 0 and run_dir is not None:
            shutil.rmtree(run_dir, ignore_errors=True)
        if dist.is_initialized():
            dist.destroy_process_group()


if __name__ == "__main__":
    exit_without_teardown(main())  # as launch/train.py: gloo's threads once aborted the interpreter's teardown
