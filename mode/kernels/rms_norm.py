"""RMSNorm of the float32 residual stream straight into the autocast dtype, one kernel each way,
optionally with the residual add before it (h = x + a; y = norm(h)).

Under bf16 autocast the residual stream is float32 and every norm's output feeds a matmul that
casts it to bf16. Eager PyTorch runs that as a float32 norm (a float32 output written), a cast
(read again, bf16 written), and in the backward a cast of the bf16 gradient to float32, the input
gradient and the weight gradient (each reading x and the gradient again). Here the forward reads x
once and writes y in the output dtype; the backward reads x and dy once and writes dx, each
program summing its rows' share of the weight gradient in registers (one small sum at the end).
With the residual add, the forward also writes h, and the backward adds h's own gradient (from
the residual path) into dx and writes a's gradient in a's dtype: the add, the gradients' sum and
its cast are no passes of their own.
Arithmetic is float32 throughout: y = h * rsqrt(mean(h^2) + eps) * w, rounded once.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, store_rounded

MAX_WIDTH = 8192  # a row in one block of registers; wider rows take PyTorch's norm
BACKWARD_PROGRAMS_PER_SM = 4  # rows shared among this many programs per streaming multiprocessor


def _warps(block: int) -> int:
    return max(1, min(16, block // 256))


@triton.jit
def _rms_norm_fwd(x_ptr, a_ptr, w_ptr, h_ptr, y_ptr, rstd_ptr, width, eps, ADD: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(x_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
    if ADD:  # h = x + a in float32, as PyTorch adds a bf16 a to the float32 stream
        x += tl.load(a_ptr + row * width + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(h_ptr + row * width + cols, x, mask=mask)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    store_rounded(y_ptr + row * width + cols, x * rstd * w, mask)
    tl.store(rstd_ptr + row, rstd)


@triton.jit
def _rms_norm_bwd(x_ptr, w_ptr, rstd_ptr, dy_ptr, dh_ptr, dx_ptr, da_ptr, dw_part_ptr, rows, width,
                  HAS_DH: tl.constexpr, ADD: tl.constexpr, BLOCK: tl.constexpr):
    """Program p takes rows p, p + P, ...: dx of each (plus dh, h's own gradient, where given; and
    with ADD also into da, a's gradient), and the sum of dy * x_hat over them into row p of the
    (P, width) partial weight gradients."""
    p = tl.program_id(0).to(tl.int64)
    programs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), tl.float32)
    for i in range(0, tl.cdiv(rows - p, programs)):
        row = p + i * programs
        at = row * width + cols
        x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + at, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row)
        x_hat = x * rstd
        wdy = w * dy
        # d/dx of x * rstd: rstd * (w dy - x_hat * mean(x_hat * w dy))
        dx = rstd * (wdy - x_hat * (tl.sum(x_hat * wdy, axis=0) / width))
        if HAS_DH:
            dx += tl.load(dh_ptr + at, mask=mask, other=0.0).to(tl.float32)
        store_rounded(dx_ptr + at, dx, mask)
        if ADD:
            store_rounded(da_ptr + at, dx, mask)
        dw += dy * x_hat
    tl.store(dw_part_ptr + p * width + cols, dw, mask=mask)


def _forward(x: Tensor, a: Tensor | None, weight: Tensor, eps: float, out_dtype: torch.dtype
             ) -> tuple[Tensor, Tensor, Tensor]:
    """(h, y, rstd): h = x + a (x itself without a), y its norm in out_dtype, rstd (rows,) float32."""
    width = x.shape[-1]
    rows = x.numel() // max(1, width)
    h = x if a is None else torch.empty_like(x)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = triton.next_power_of_2(width)
    if rows:
        with on_device_of(x):
            _rms_norm_fwd[(rows,)](x, x if a is None else a, weight, h, y, rstd, width, eps, ADD=a is not None,
                                   BLOCK=block, num_warps=_warps(block))
    return h, y, rstd


def _backward(h: Tensor, weight: Tensor, rstd: Tensor, dy: Tensor, dh: Tensor | None, a_dtype: torch.dtype | None
              ) -> tuple[Tensor, Tensor | None, Tensor]:
    """(dx, da or None, dw): the norm's input gradient plus dh, and a's (in a_dtype) where it was added."""
    width, rows = h.shape[-1], rstd.numel()
    dy = dy.contiguous()
    dh = None if dh is None else dh.contiguous()
    dx = torch.empty_like(h)
    da = None if a_dtype is None else torch.empty(h.shape, dtype=a_dtype, device=h.device)
    sms = torch.cuda.get_device_properties(h.device).multi_processor_count if h.is_cuda else 2
    programs = max(1, min(rows, BACKWARD_PROGRAMS_PER_SM * sms))
    dw_part = torch.empty(programs, width, dtype=torch.float32, device=h.device)  # every program writes its row
    block = triton.next_power_of_2(width)
    if rows:
        with on_device_of(h):
            _rms_norm_bwd[(programs,)](h, weight, rstd, dy, dy if dh is None else dh, dx, dx if da is None else da,
                                       dw_part, rows, width, HAS_DH=dh is not None, ADD=da is not None, BLOCK=block,
                                       num_warps=_warps(block))
    else:
        dw_part.zero_()  # no rows: no gradient
    return dx, da, dw_part.sum(0).to(weight.dtype)


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:  # type: ignore[override]
        x = x.contiguous()
        _, y, rstd = _forward(x, None, weight, eps, out_dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: Tensor) -> tuple[Tensor, Tensor, None, None]:  # type: ignore[override]
        x, weight, rstd = ctx.saved_tensors
        dx, _, dw = _backward(x, weight, rstd, dy, None, None)
        return dx, dw, None, None


class _AddRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, a: Tensor, weight: Tensor, eps: float,  # type: ignore[override]
                out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        h, y, rstd = _forward(x.contiguous(), a.contiguous(), weight, eps, out_dtype)
        ctx.save_for_backward(h, weight, rstd)
        ctx.a_dtype = a.dtype
        return h, y

    @staticmethod
    def backward(ctx, dh: Tensor | None, dy: Tensor | None  # type: ignore[override]
                 ) -> tuple[Tensor, Tensor, Tensor, None, None]:
        h, weight, rstd = ctx.saved_tensors
        dy = torch.zeros_like(h) if dy is None else dy  # y unused: only h's gradient flows
        dx, da, dw = _backward(h, weight, rstd, dy, dh, ctx.a_dtype)
        return dx, da, dw, None, None


def rms_norm_applies(x: Tensor, weight: Tensor | None) -> bool:
    """Whether rms_norm takes x (..., D): a weight, and D at most MAX_WIDTH (the policy is the caller's)."""
    return weight is not None and 0 < x.shape[-1] <= MAX_WIDTH and weight.shape == x.shape[-1:]


def rms_norm(x: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> Tensor:
    """x (..., D) -> x * rsqrt(mean(x^2) + eps) * weight (..., D) in out_dtype, float32 arithmetic."""
    return _RMSNorm.apply(x, weight, eps, out_dtype)


def add_rms_norm(x: Tensor, a: Tensor, weight: Tensor, eps: float, out_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """x (..., D) float32, a (..., D) -> (h = x + a in float32, rms_norm(h, weight, eps, out_dtype))."""
    if a.shape != x.shape or x.dtype != torch.float32:
        raise ValueError(f"add_rms_norm: a {tuple(a.shape)} must have float32 x's shape {tuple(x.shape)}")
    return _AddRMSNorm.apply(x, a, weight, eps, out_dtype)
