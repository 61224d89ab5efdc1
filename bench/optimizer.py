"""The update of a training step alone, on one GPU: bf16 weights' masters against AdamW on float32 weights.

    python -m bench.optimizer            # the matrices of block_kinds' Staged MoDE model (12 layers, D=1024,
                                         # 8 experts of width 2816 in every other block: 517M weights)

Rows, measured in the same process, each the median of --iters passes timed with CUDA events
(the update's GPU time: the host's launches run ahead of the device in a training step, so the
kernel's tables are built once, outside the timing):
- torch.optim.AdamW(fused=True) on float32 weights with float32 gradients (what train.bf16_weights=false
  steps, without the casts of the forward and backward it also pays);
- the masters' kernel (mode/kernels/adamw.py) on float32 masters with bf16 gradients, writing the
  bf16 copies, at each --blocks size (elements a program; 4 warps up to 2048, 8 above), one launch;
- the same kernel with one launch per weight (the launches' gaps);
- what it is read against: the same kernel on one tensor as large as all the matrices (no table to
  search), and a device-to-device copy that moves the same 28 bytes a weight;
- the model's other weights, float32 with float32 gradients (embedding, output head, norms, routers):
  fused AdamW, and the masters' kernel's launch for them (what train.bf16_weights steps them with).
TB/s: the bytes each update must move (AdamW: read weight, gradient and both moments, write
weight and moments; masters: the same with a bf16 gradient, plus the bf16 copy written) over its time.

Then the gradients' global norm that clipping reads, over the same weights' gradients (bf16 for the
matrices, float32 for the rest): torch._foreach_norm by dtype (total_norm's PyTorch ops) against
the norm kernel (mode/kernels/grad_norm.py), its tables built beforehand.

Last, mode.train's whole update (TorchOptimization.step with bf16 weights: the norm, clipping,
every weight's update and freeing the gradients, as a compiled or plain eager step does) of
block_kinds' models (--models), each step started on an idle GPU: the host's ms to queue it and the
wall ms until the GPU is done, with the step's plan kept from step to step (as training keeps it),
with every gradient moved before each step (the plan's tables rewritten, as where the next backward
allocates the freed gradients elsewhere), and built afresh at every step.
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch

from bench.block_kinds import kind_config
from bench.common import add_model_args, require_cuda, sync, timed
from mode.kernels import adamw as kernel
from mode.model import LanguageModel
from mode.training.bf16_weights import matrix_weights
from mode.training.optim import TorchOptimization, total_norm


def matrices(args: argparse.Namespace) -> tuple[list[torch.Size], list[torch.Size]]:
    """The shapes of the matrices bf16 weights hold (matrix_weights) in block_kinds' Staged MoDE model,
    and of its other (float32) weights, built on the meta device (no memory; the sequence length
    does not change them)."""
    with torch.device("meta"):
        model = LanguageModel(kind_config("mode_staged", argparse.Namespace(**vars(args), seq=2048, noop=0)))
    chosen = {id(p) for p in matrix_weights(model)}
    return [p.shape for p in matrix_weights(model)], [p.shape for p in model.parameters() if id(p) not in chosen]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--blocks", type=int, nargs="+", default=[1024, 2048, 4096, 8192])
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--models", nargs="+", default=["dense", "mode_staged", "mode_integrated"],
                        help="block_kinds' models whose whole update (mode.train's step) is timed")
    args = parser.parse_args(argv)
    require_cuda(parser)
    device = torch.device("cuda")
    shapes, float32_shapes = matrices(args)
    n = sum(s.numel() for s in shapes)
    weights = [torch.randn(s, device=device) * 0.02 for s in shapes]
    grads = [torch.randn(s, device=device) * 1e-3 for s in shapes]
    print(f"card: {torch.cuda.get_device_name()}; torch {torch.__version__}; {len(shapes)} matrices, "
          f"{n / 1e6:.0f}M weights\n")
    print("| update | GPU ms | TB/s |")
    print("| --- | --- | --- |")

    ms = fused_adamw_ms(weights, grads, args, device)
    print(f"| fused AdamW, float32 weights and gradients | {ms:.3f} | {n * 28 / ms / 1e9:.2f} |")

    masters = [w.clone() for w in weights]
    updates = [(m, torch.zeros_like(m), torch.zeros_like(m), g.to(torch.bfloat16), m.to(torch.bfloat16),
                torch.ones((), device=device)) for m, g in zip(masters, grads)]
    scale = torch.ones((), device=device)
    for block in args.blocks:
        ms = timed(runs(kernel.masters_launches(updates, block), scale), args.warmup, args.iters, device)
        print(f"| masters' kernel, one launch, {block} elements a program | {ms:.3f} | {n * 28 / ms / 1e9:.2f} |")

    per_weight = [launch for update in updates for launch in kernel.masters_launches([update])]
    ms = timed(runs(per_weight, scale), args.warmup, args.iters, device)
    print(f"| masters' kernel, one launch per weight, {kernel.BLOCK} elements a program | {ms:.3f} | "
          f"{n * 28 / ms / 1e9:.2f} |")
    ceilings(n, args, device)
    float32_weights(float32_shapes, args, device)
    norms([g.to(torch.bfloat16) for g in grads] + [torch.randn(s, device=device) * 1e-3 for s in float32_shapes],
          args, device)
    whole_steps(args, device)


def norms(grads: list[torch.Tensor], args: argparse.Namespace, device: torch.device) -> None:
    """The rows of the global norm: total_norm's PyTorch ops, then the norm kernel."""
    from mode.kernels.grad_norm import GradNorm

    size = sum(g.numel() * g.element_size() for g in grads)
    label = f"global norm of {len(grads)} gradients ({size / 1e9:.2f} GB)"
    print("\n| norm | GPU ms | TB/s |")
    print("| --- | --- | --- |")
    ms = timed(lambda: total_norm(grads), args.warmup, args.iters, device)
    print(f"| {label}, torch._foreach_norm by dtype | {ms:.3f} | {size / ms / 1e9:.2f} |")
    norm = GradNorm(grads)
    ms = timed(norm, args.warmup, args.iters, device)
    print(f"| {label}, norm kernel | {ms:.3f} | {size / ms / 1e9:.2f} |")


def whole_steps(args: argparse.Namespace, device: torch.device) -> None:
    """The rows of mode.train's whole update, each of --models with its gradients from one short batch,
    freed by each step as in a compiled or plain eager step (handed back before the next)."""
    print("\n| model | weights | the step's plan | host ms | wall ms |")
    print("| --- | --- | --- | --- | --- |")
    for kind in args.models:
        config = kind_config(kind, argparse.Namespace(**vars(args), seq=2048, noop=8))
        torch.manual_seed(0)
        model = LanguageModel(config).to(device)
        optimization = TorchOptimization(model, config, device, bf16_weights=True)
        tokens = torch.randint(0, args.vocab, (1, 257), device=device)
        with torch.autocast(device.type, dtype=torch.bfloat16):
            output = model(tokens[:, :-1], tokens[:, 1:])
        (output.loss + output.aux_loss).backward()
        params = list(model.parameters())
        grads = [p.grad for p in params]
        weights = sum(p.numel() for p in params)
        for plan in ("kept", "gradients moved", "built each step"):
            host, wall, previous = [], [], []
            for i in range(args.warmup + args.iters):
                if plan == "built each step":
                    optimization.plan = None
                # the same gradients again; "moved": copies, as the next backward may leave them elsewhere
                # (the last step's copies still held, so that these land elsewhere)
                current = [g.clone() for g in grads] if plan == "gradients moved" else grads
                for p, g in zip(params, current):
                    p.grad = g
                previous = current
                sync(device)
                start = time.perf_counter()
                optimization.step(1e-4)
                queued = time.perf_counter()
                sync(device)
                if i >= args.warmup:
                    host.append((queued - start) * 1e3)
                    wall.append((time.perf_counter() - start) * 1e3)
            print(f"| {kind} | {weights / 1e6:.0f}M | {plan} | {statistics.median(host):.2f} | "
                  f"{statistics.median(wall):.2f} |", flush=True)
        del model, optimization, output, grads, params, previous, current
        if device.type == "cuda":
            torch.cuda.empty_cache()


def fused_adamw_ms(weights: list[torch.Tensor], grads: list[torch.Tensor], args: argparse.Namespace,
                   device: torch.device) -> float:
    """GPU ms of one torch.optim.AdamW(fused=True) step over copies of weights with these gradients."""
    params = [torch.nn.Parameter(w.clone()) for w in weights]
    for p, g in zip(params, grads):
        p.grad = g
    adamw = torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, fused=True)
    return timed(adamw.step, args.warmup, args.iters, device)


def runs(launches: list[kernel.MastersLaunch], scale: torch.Tensor) -> Callable[[], None]:
    """One update by the masters' kernel through launches built beforehand (lr 1e-4, decay 0.1)."""
    lr = torch.full_like(scale, 1e-4)

    def run() -> None:
        for launch in launches:
            launch.run(scale, lr, (0.9, 0.95), 1e-8, 0.1)
    return run


def ceilings(n: int, args: argparse.Namespace, device: torch.device) -> None:
    """The rows the masters' kernel is read against: the same kernel on one tensor of all n weights
    (no table to search, no tensor ends: what its many weights cost it), and a device-to-device copy
    of 14 bytes a weight (the same 28 bytes moved: the card's streaming rate for them)."""
    master, exp_avg, exp_avg_sq = (torch.zeros(n, device=device) for _ in range(3))
    grad, copy = torch.randn(n, device=device).to(torch.bfloat16), torch.empty(n, device=device, dtype=torch.bfloat16)
    update = (master, exp_avg, exp_avg_sq, grad, copy, torch.ones((), device=device))
    ms = timed(runs(kernel.masters_launches([update]), torch.ones((), device=device)), args.warmup, args.iters, device)
    print(f"| masters' kernel, one tensor of all {n / 1e6:.0f}M weights, {kernel.BLOCK} elements a program | "
          f"{ms:.3f} | {n * 28 / ms / 1e9:.2f} |")
    del master, exp_avg, exp_avg_sq, grad, copy, update
    source, target = (torch.empty(n * 14, dtype=torch.uint8, device=device) for _ in range(2))
    ms = timed(lambda: target.copy_(source), args.warmup, args.iters, device)
    print(f"| device-to-device copy of {n * 14 / 1e9:.2f} GB (28 bytes a weight moved) | {ms:.3f} | "
          f"{n * 28 / ms / 1e9:.2f} |")


def float32_weights(shapes: list[torch.Size], args: argparse.Namespace, device: torch.device) -> None:
    """The rows of the float32 weights: fused AdamW, then the masters' kernel's float32 launch."""
    n = sum(s.numel() for s in shapes)
    label = f"{len(shapes)} float32 weights ({n / 1e6:.1f}M: embedding, head, norms, routers)"
    weights = [torch.randn(s, device=device) * 0.02 for s in shapes]
    grads = [torch.randn(s, device=device) * 1e-3 for s in shapes]
    ms = fused_adamw_ms(weights, grads, args, device)
    print(f"| {label}, fused AdamW | {ms:.3f} | {n * 28 / ms / 1e9:.2f} |")
    updates = [(w, torch.zeros_like(w), torch.zeros_like(w), g, None, torch.ones((), device=device))
               for w, g in zip(weights, grads)]
    scale = torch.ones((), device=device)
    ms = timed(runs(kernel.masters_launches(updates), scale), args.warmup, args.iters, device)
    print(f"| {label}, masters' kernel | {ms:.3f} | {n * 28 / ms / 1e9:.2f} |")


if __name__ == "__main__":
    main()
