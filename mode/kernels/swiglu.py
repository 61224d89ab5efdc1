"""SwiGLU, silu(gate) * up from one fused [gate | up] projection, as one Triton kernel each way,
optionally times a gate per row.

Eager PyTorch runs it as silu, mul (forward) and mul, mul, silu_backward and a cat of the two
halves' gradients (backward), and keeps silu(gate) for the backward. Here: one pass each way,
float32 arithmetic, one rounding to h's dtype, and only the projection h is kept.

Row gates (an MoE layer's router gates, one per expert row r): out_r = g_r * swiglu(h_r). The
down projection is linear, W (g a) = g (W a), so the gate can be applied here instead of in the
combine, where it cost a pass: the combine becomes a plain sum of rows, its backward a plain
gather of the output's gradient (no read of the rows), and the gate's gradient,
<swiglu(h_r), d out_r>, a row sum in this kernel's backward, where swiglu(h_r) is in registers
anyway (one program per row). GELU experts do the same in mode/kernels/gelu.py.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, store_rounded

# Tiles, the fastest of a sweep at (16384, 2 x 4096) bf16: the forward 4096 columns a program; the
# gated backward one row a program in steps of 2048 columns; the plain backward 1024 columns.
FORWARD_BLOCK, FORWARD_WARPS = 4096, 8
BACKWARD_BLOCK = 1024
GATED_BACKWARD_BLOCK, GATED_BACKWARD_WARPS = 2048, 8


@triton.jit
def _swiglu_fwd(h_ptr, gates_ptr, out_ptr, width, GATED: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(h_ptr + row * 2 * width + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_ptr + row * 2 * width + width + cols, mask=mask, other=0.0).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    if GATED:
        out = out * tl.load(gates_ptr + row).to(tl.float32)
    store_rounded(out_ptr + row * width + cols, out, mask)


@triton.jit
def _swiglu_grad(h_row, dh_row, grad, cols, mask, width):
    """Store grad * d swiglu / dh at dh_row's columns ([gate | up]); return swiglu(h) there (float32)."""
    gate = tl.load(h_row + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(h_row + width + cols, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    store_rounded(dh_row + cols, grad * up * sig * (1.0 + gate * (1.0 - sig)), mask)  # silu' = sig (1 + g (1 - sig))
    store_rounded(dh_row + width + cols, grad * silu, mask)
    return silu * up


@triton.jit
def _swiglu_bwd(h_ptr, grad_ptr, dh_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    grad = tl.load(grad_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    _swiglu_grad(h_ptr + row * 2 * width, dh_ptr + row * 2 * width, grad, cols, mask, width)


@triton.jit
def _gated_swiglu_bwd(h_ptr, grad_ptr, gates_ptr, dh_ptr, grad_gates_ptr, width, BLOCK: tl.constexpr):
    """One program per row: the gate's gradient is a sum over the whole row."""
    row = tl.program_id(0).to(tl.int64)
    gate = tl.load(gates_ptr + row).to(tl.float32)
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < width
        grad = tl.load(grad_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
        act = _swiglu_grad(h_ptr + row * 2 * width, dh_ptr + row * 2 * width, grad * gate, cols, mask, width)
        dot += tl.where(mask, act * grad, 0.0)
    tl.store(grad_gates_ptr + row, tl.sum(dot, axis=0))


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, gates: Tensor | None) -> Tensor:
        h = h.contiguous()
        gates = None if gates is None else gates.contiguous()
        width = h.shape[-1] // 2
        rows = h.numel() // max(1, h.shape[-1])
        out = h.new_empty(*h.shape[:-1], width)
        if rows and width:
            with on_device_of(h):
                _swiglu_fwd[(rows, triton.cdiv(width, FORWARD_BLOCK))](
                    h, h if gates is None else gates, out, width, GATED=gates is not None, BLOCK=FORWARD_BLOCK,
                    num_warps=FORWARD_WARPS,
                )
        ctx.save_for_backward(h, gates)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor | None]:
        h, gates = ctx.saved_tensors
        width = h.shape[-1] // 2
        rows = h.numel() // max(1, h.shape[-1])
        grad = grad.contiguous()
        dh = torch.empty_like(h)
        if gates is None:
            if rows and width:
                with on_device_of(h):
                    _swiglu_bwd[(rows, triton.cdiv(width, BACKWARD_BLOCK))](h, grad, dh, width, BLOCK=BACKWARD_BLOCK)
            return dh, None
        grad_gates = torch.empty(gates.shape, dtype=torch.float32, device=h.device)  # every row written
        if rows:
            with on_device_of(h):
                _gated_swiglu_bwd[(rows,)](h, grad, gates, dh, grad_gates, width, BLOCK=GATED_BACKWARD_BLOCK,
                                           num_warps=GATED_BACKWARD_WARPS)
        return dh, grad_gates.to(gates.dtype)


def swiglu(h: Tensor, gates: Tensor | None = None) -> Tensor:
    """h (..., 2F) = [gate | up] -> silu(gate) * up (..., F), in h's dtype (float32 arithmetic); times
    gates (...,), one per row, when given."""
    if h.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dim of h must be even ([gate | up]), got {h.shape[-1]}")
    if gates is not None and gates.shape != h.shape[:-1]:
        raise ValueError(f"swiglu: gates {tuple(gates.shape)} must have h's leading shape {tuple(h.shape[:-1])}")
    return _SwiGLU.apply(h, gates)
