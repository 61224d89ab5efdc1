"""GELU (the exact, erf form) times a gate per row, as one Triton kernel each way: an MoE layer's
GELU experts with their router gates applied in the activation.

out_r = g_r * gelu(h_r), gelu(x) = x Phi(x), Phi(x) = erfc(-x / sqrt 2) / 2. The down projection is
linear, so the gate may scale the activation instead of the expert's output (as mode/kernels/swiglu.py
does for SwiGLU): the combine becomes a plain sum of rows, its backward a plain gather, and the
gate's gradient, <gelu(h_r), d out_r>, a row sum in this kernel's backward, which has gelu(h_r) in
registers anyway (one program per row).

Phi comes from Abramowitz and Stegun's 7.1.26, erfc(z) = t P(t) exp(-z^2), t = 1 / (1 + p z), P of
degree 4: |error| <= 1.5e-7 in erf, so gelu(x) is within 7.5e-8 |x| of exact, no further from it
than PyTorch's own float32 GELU. It costs a reciprocal, five FMAs and the exponential the
derivative needs anyway, where libdevice's erf (a warp running both of its branches) leaves the
kernels instruction-bound.

Eager mode on CUDA (mode.kernels.use_triton); elsewhere the experts run F.gelu(h) times the gates.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, store_rounded

# Tiles, the fastest of a sweep at (16384, 4096) bf16: the forward up to 4096 columns a program, the
# backward a row in steps of 1024 columns, 8 warps each.
FORWARD_BLOCK, BACKWARD_BLOCK, WARPS = 4096, 1024, 8
SQRT_HALF = tl.constexpr(0.7071067811865476)  # Triton reads no other globals
INV_SQRT_2PI = tl.constexpr(0.3989422804014327)


@triton.jit
def _cdf(x):
    """Phi(x) and exp(-x^2 / 2), float32."""
    z = tl.abs(x) * SQRT_HALF
    t = 1.0 / (1.0 + 0.3275911 * z)
    poly = t * (0.254829592 + t * (-0.284496736 + t * (1.421413741 + t * (-1.453152027 + t * 1.061405429))))
    gauss = tl.exp(-z * z)
    half_erfc = 0.5 * poly * gauss  # erfc(|x| / sqrt 2) / 2 = Phi(-|x|), to 7.5e-8
    return tl.where(x < 0, half_erfc, 1.0 - half_erfc), gauss


@triton.jit
def _gated_gelu_fwd(h_ptr, gates_ptr, out_ptr, width, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(h_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    cdf, _ = _cdf(x)
    store_rounded(out_ptr + row * width + cols, x * cdf * tl.load(gates_ptr + row).to(tl.float32), mask)


@triton.jit
def _gated_gelu_bwd(h_ptr, grad_ptr, gates_ptr, dh_ptr, grad_gates_ptr, width, BLOCK: tl.constexpr):
    """One program per row, in steps of BLOCK columns: the gate's gradient is a sum over the whole row."""
    row = tl.program_id(0).to(tl.int64)
    gate = tl.load(gates_ptr + row).to(tl.float32)
    dot = tl.zeros((BLOCK,), dtype=tl.float32)
    for start in range(0, width, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        mask = cols < width
        x = tl.load(h_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.load(grad_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
        cdf, gauss = _cdf(x)
        dot += grad * x * cdf  # masked columns: grad 0
        # gelu'(x) = Phi(x) + x phi(x), phi(x) = exp(-x^2 / 2) / sqrt(2 pi)
        store_rounded(dh_ptr + row * width + cols, grad * gate * (cdf + x * INV_SQRT_2PI * gauss), mask)
    tl.store(grad_gates_ptr + row, tl.sum(dot, axis=0))


def _block(width: int, most: int) -> int:
    return min(most, triton.next_power_of_2(max(width, 1)))


class _GatedGELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h: Tensor, gates: Tensor) -> Tensor:
        h, gates = h.contiguous(), gates.contiguous()
        width = h.shape[-1]
        rows = gates.numel()
        out = torch.empty_like(h)
        if rows and width:
            with on_device_of(h):
                block = _block(width, FORWARD_BLOCK)
                _gated_gelu_fwd[(rows, triton.cdiv(width, block))](h, gates, out, width, BLOCK=block, num_warps=WARPS)
        ctx.save_for_backward(h, gates)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        h, gates = ctx.saved_tensors
        width = h.shape[-1]
        rows = gates.numel()
        grad = grad.contiguous()
        dh = torch.empty_like(h)
        grad_gates = torch.empty(gates.shape, dtype=torch.float32, device=h.device)  # every row written
        if rows:
            with on_device_of(h):
                _gated_gelu_bwd[(rows,)](h, grad, gates, dh, grad_gates, width, BLOCK=_block(width, BACKWARD_BLOCK),
                                         num_warps=WARPS)
        return dh, grad_gates.to(gates.dtype)


def gated_gelu(h: Tensor, gates: Tensor) -> Tensor:
    """h (..., F), gates (...) one per row -> gates[..., None] * gelu(h) (..., F) in h's dtype, float32
    arithmetic, one rounding."""
    if gates.shape != h.shape[:-1]:
        raise ValueError(f"gated_gelu: gates {tuple(gates.shape)} must have h's leading shape {tuple(h.shape[:-1])}")
    return _GatedGELU.apply(h, gates)
