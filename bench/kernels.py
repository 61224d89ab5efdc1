"""The Triton kernels of mode/kernels/ against the PyTorch ops they replace, forward+backward, on one GPU.

    python -m bench.kernels   # rotary on qkv (B=8, S=2048, 16 heads of 64), SwiGLU (16k rows, F=4096),
                              # GELU times row gates (an MoE layer's GELU experts, 16k rows, F=4096),
                              # the loss's softmax cross-entropy + gradient on one chunk (2048 x 32k),
                              # copy and constant null slots added to an MoE FFN's output (16k rows,
                              # width 1024, 8 constants), and the whole fused loss (16k tokens, 32k
                              # vocabulary, width 1024)

Rows, measured in the same process: the eager PyTorch ops the model runs without the kernels,
the same ops under torch.compile (what a compiled model gets), and the Triton kernel; for the
gated GELU also PyTorch's GELU without the gates (a dense MLP's, the floor to meet). Each
cell is the median of --iters synchronised passes (bf16 inputs): forward+backward for rotary,
SwiGLU and GELU; for the loss, its chunk step (loss and p - one_hot, no autograd). "GPU busy":
the time some kernel ran, per pass, under the profiler (the kernels alone: a synchronised pass
also waits for the host's launches). TB/s: the memory traffic the pass needs at minimum (read
inputs and incoming gradients once, write outputs and input gradients once) divided by the
GPU busy time. Both passes include the incoming gradient's fill (torch.ones_like).
A second table: mode.layers.loss.linear_cross_entropy on bf16 hidden states and weight (what
autocast hands it), forward+backward, with each chunk's GEMMs writing the hidden states' gradient
rows and adding into the float32 weight gradient themselves (gemms_in_place), against the
products followed by a copy and an add; plus the host's time queuing a pass (bench.common.host_queue_ms).
"""
from __future__ import annotations

import argparse
import functools
from typing import Callable

import torch
from torch import Tensor

from bench.common import gpu_busy_ms, host_queue_ms, require_cuda, timed
from mode.kernels.cross_entropy import cross_entropy_and_grad
from mode.kernels.gelu import gated_gelu
from mode.kernels.null_experts import null_add
from mode.kernels.rotary import rotary_qkv
from mode.kernels.swiglu import swiglu as swiglu_kernel
from mode.layers import loss as loss_module
from mode.layers.rotary import RotaryAngles, RotaryEmbedding, apply_rotary


def torch_rotary(qkv: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    q, k = apply_rotary(qkv[:, :, :2], RotaryAngles(cos, sin)).unbind(2)
    return q, k, qkv[:, :, 2]


def torch_swiglu(h: Tensor) -> Tensor:
    gate, up = h.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def torch_gated_gelu(h: Tensor, gates: Tensor) -> Tensor:
    return torch.nn.functional.gelu(h) * gates.to(h.dtype).unsqueeze(-1)


def torch_gelu_without_gates(h: Tensor, gates: Tensor) -> Tensor:
    return torch.nn.functional.gelu(h)


def torch_cross_entropy(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """The PyTorch path of mode/layers/loss.py for one chunk: float32 log-softmax, loss, p - one_hot cast back."""
    t = targets.unsqueeze(1)
    log_probs = torch.log_softmax(logits, dim=-1, dtype=torch.float32)
    loss = -log_probs.gather(1, t).squeeze(1)
    probs = log_probs.exp_()
    return loss, probs.scatter_add_(1, t, probs.new_full(t.shape, -1.0)).to(logits.dtype)


def torch_null_add(out: Tensor, x: Tensor, scale: Tensor, gates: Tensor, constants: Tensor) -> Tensor:
    """The null slots' sum in PyTorch ops, on the inputs the kernel takes (the copy slots' summed gates s,
    the constant slots' gates g), as NullExperts.add_to adds it without the kernel: out + (s * x + g @ v),
    the sum rounded to out's dtype."""
    return out + (scale.unsqueeze(-1) * x + gates @ constants).to(out.dtype)  # (T, D) + (T, 1) * (T, D) + (T, C) @ (C, D)


def fwd_bwd(fn: Callable[..., object], inputs: list[Tensor], extra: tuple[Tensor, ...] = ()) -> Callable[[], None]:
    def run() -> None:
        for t in inputs:
            t.grad = None
        outs = fn(*inputs, *extra)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if outs[0].requires_grad:
            torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])

    return run


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--ffn", type=int, default=4096, help="SwiGLU (h is 2F wide) and GELU hidden width F")
    parser.add_argument("--vocab", type=int, default=32768, help="loss chunk: 2048 rows of this many logits")
    parser.add_argument("--width", type=int, default=1024, help="the null slots and the whole loss: hidden width")
    parser.add_argument("--constants", type=int, default=8, help="the null slots: constant slots")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--iters", type=int, default=50)
    args = parser.parse_args(argv)
    require_cuda(parser)  # GPU kernels only: no CPU mode to fall back to
    device = torch.device("cuda")
    tokens = args.batch * args.seq
    qkv = torch.randn(args.batch, args.seq, 3, args.heads, args.head_dim, device=device, dtype=torch.bfloat16, requires_grad=True)
    angles = RotaryEmbedding(args.head_dim, args.seq, 10000.0).to(device).prefix(args.seq)
    h = torch.randn(tokens, 2 * args.ffn, device=device, dtype=torch.bfloat16, requires_grad=True)
    h_gelu = torch.randn(tokens, args.ffn, device=device, dtype=torch.bfloat16, requires_grad=True)
    gates = torch.rand(tokens, device=device, requires_grad=True)
    logits = torch.randn(2048, args.vocab, device=device, dtype=torch.bfloat16)
    targets = torch.randint(0, args.vocab, (2048,), device=device)
    ffn_out = torch.randn(tokens, args.width, device=device, dtype=torch.bfloat16, requires_grad=True)
    x = torch.randn(tokens, args.width, device=device, requires_grad=True)  # the float32 residual stream
    copy_gates = torch.rand(tokens, device=device, requires_grad=True)
    constant_gates = torch.rand(tokens, args.constants, device=device, requires_grad=True)
    constants = torch.randn(args.constants, args.width, device=device, requires_grad=True)
    qkv_bytes = qkv.numel() * 2 * 4  # qkv and the outputs, then their gradients
    h_bytes = (h.numel() + h.numel() // 2) * 2 * 2 + h.numel() * 2  # h, out, grads (+ h again in the backward)
    cases = [
        ("rotary q, k (+ v) on qkv", qkv_bytes, [qkv], (angles.cos_full, angles.sin_signed),
         [("PyTorch eager", torch_rotary), ("PyTorch compiled", torch.compile(torch_rotary)), ("Triton kernel", rotary_qkv)]),
        ("SwiGLU on [gate | up]", h_bytes, [h], (),
         [("PyTorch eager", torch_swiglu), ("PyTorch compiled", torch.compile(torch_swiglu)), ("Triton kernel", swiglu_kernel)]),
        ("GELU times row gates", h_gelu.numel() * 2 * 5, [h_gelu, gates], (),  # h, out; h, grad, dh
         [("PyTorch eager", torch_gated_gelu), ("PyTorch eager, GELU without the gates", torch_gelu_without_gates),
          ("PyTorch compiled", torch.compile(torch_gated_gelu)), ("Triton kernel", gated_gelu)]),
        ("loss chunk: cross-entropy and p - one_hot", logits.numel() * 2 * 2, [logits], (targets,),
         [("PyTorch eager", torch_cross_entropy), ("PyTorch compiled", torch.compile(torch_cross_entropy)),
          ("Triton kernel", cross_entropy_and_grad)]),
        # out, x, the result; the gradient, x again, x's gradient (out's is the incoming one)
        ("copy and constant null slots added", ffn_out.numel() * (2 + 4 + 2 + 2 + 4 + 4),
         [ffn_out, x, copy_gates, constant_gates, constants], (),
         [("PyTorch eager", torch_null_add), ("PyTorch compiled", torch.compile(torch_null_add)),
          ("Triton kernel", null_add)]),
    ]
    print(f"card: {torch.cuda.get_device_name()}; torch {torch.__version__}; bf16; rotary on ({args.batch}, {args.seq}, 3, "
          f"{args.heads}, {args.head_dim}); SwiGLU on ({tokens}, {2 * args.ffn}); GELU on ({tokens}, {args.ffn}); loss chunk (2048, {args.vocab}); "
          f"null slots ({tokens}, {args.width}) with {args.constants} constants; median of {args.iters}\n")
    print("| op | implementation | ms, synchronised | GPU busy ms | x Triton (busy) | TB/s (busy, minimum traffic) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for op, traffic, inputs, extra, impls in cases:
        runs = {name: fwd_bwd(fn, inputs, extra) for name, fn in impls}
        times = {name: timed(run, args.warmup, args.iters, device) for name, run in runs.items()}
        busy = {name: gpu_busy_ms(run, args.iters) for name, run in runs.items()}
        for name, ms in times.items():
            print(f"| {op} | {name} | {ms:.3f} | {busy[name]:.3f} | {busy[name] / busy['Triton kernel']:.2f} | "
                  f"{traffic / busy[name] / 1e9:.2f} |")
    whole_loss(args, device)


def whole_loss(args: argparse.Namespace, device: torch.device) -> None:
    """The fused loss over a batch, forward+backward, with and without its chunk GEMMs in place."""
    tokens = args.batch * args.seq
    hidden = torch.randn(tokens, args.width, device=device, dtype=torch.bfloat16, requires_grad=True)
    weight = (0.02 * torch.randn(args.vocab, args.width, device=device)).bfloat16().requires_grad_()
    targets = torch.randint(0, args.vocab, (tokens,), device=device)
    print(f"\nthe fused loss, forward+backward: hidden ({tokens}, {args.width}), weight ({args.vocab}, {args.width}), bf16, "
          f"{-(-tokens // loss_module._chunk_size(tokens, args.vocab))} chunks\n")
    print("| chunk GEMMs | ms, synchronised | GPU busy ms | host ms queuing a pass |")
    print("| --- | --- | --- | --- |")
    for in_place, name in ((False, "product, then a copy / an add"), (True, "writing in place, adding into the float32 gradient")):
        loss = functools.partial(loss_module.linear_cross_entropy, gemms_in_place=in_place)
        run = fwd_bwd(loss, [hidden, weight], (targets,))
        ms, busy, host = timed(run, args.warmup, args.iters, device), gpu_busy_ms(run, args.iters), host_queue_ms(run, args.iters)
        print(f"| {name} | {ms:.3f} | {busy:.3f} | {host:.3f} |", flush=True)


if __name__ == "__main__":
    main()
