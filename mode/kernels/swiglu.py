"""SwiGLU activation silu(gate) * up from one fused [gate | up] projection, as one Triton kernel.

Eager PyTorch runs it as silu, mul (forward) and mul, mul, silu_backward and a cat of the two
halves' gradients (backward), and keeps silu(gate) for the backward. Here: one pass each way,
float32 arithmetic, and only the projection h is kept.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, store_rounded

BLOCK = 1024


@triton.jit
def _swiglu_fwd(h_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(h_ptr + row * 2 * width + cols, mask=mask).to(tl.float32)
    up = tl.load(h_ptr + row * 2 * width + width + cols, mask=mask).to(tl.float32)
    out = gate * tl.sigmoid(gate) * up
    store_rounded(out_ptr + row * width + cols, out, mask)


@triton.jit
def _swiglu_bwd(h_ptr, grad_ptr, dh_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(h_ptr + row * 2 * width + cols, mask=mask).to(tl.float32)
    up = tl.load(h_ptr + row * 2 * width + width + cols, mask=mask).to(tl.float32)
    grad = tl.load(grad_ptr + row * width + cols, mask=mask).to(tl.float32)
    sig = tl.sigmoid(gate)
    silu = gate * sig
    d_gate = grad * up * sig * (1.0 + gate * (1.0 - sig))  # d silu(g) / dg = sig * (1 + g * (1 - sig))
    d_up = grad * silu
    store_rounded(dh_ptr + row * 2 * width + cols, d_gate, mask)
    store_rounded(dh_ptr + row * 2 * width + width + cols, d_up, mask)


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor) -> Tensor:
        h = h.contiguous()
        width = h.shape[-1] // 2
        rows = h.numel() // max(1, h.shape[-1])
        out = h.new_empty(*h.shape[:-1], width)
        if rows and width:
            with on_device_of(h):
                _swiglu_fwd[(rows, triton.cdiv(width, BLOCK))](h, out, width, BLOCK=BLOCK)
        ctx.save_for_backward(h)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> Tensor:
        (h,) = ctx.saved_tensors
        width = h.shape[-1] // 2
        rows = h.numel() // max(1, h.shape[-1])
        grad = grad.contiguous()
        dh = torch.empty_like(h)
        if rows and width:
            with on_device_of(h):
                _swiglu_bwd[(rows, triton.cdiv(width, BLOCK))](h, grad, dh, width, BLOCK=BLOCK)
        return dh


def swiglu(h: Tensor) -> Tensor:
    """h (..., 2F) = [gate | up] -> silu(gate) * up (..., F), in h's dtype (float32 arithmetic)."""
    if h.shape[-1] % 2:
        raise ValueError(f"swiglu: the last dim of h must be even ([gate | up]), got {h.shape[-1]}")
    return _SwiGLU.apply(h)
