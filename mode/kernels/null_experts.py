"""The no-op slots that output something (copy and constant experts, moe.noop_kind) added to an MoE
FFN's output in one pass, and their backward in one more (two with constant slots).

NullExperts (mode/layers/moe.py) adds to each token t's FFN output sum_j g_tj * (x_t | v_j | 0).
With PyTorch ops that is a chain of (T, D) passes in float32: the copy slots' product, the constant
slots' matmul, their sum, its cast and the add, and as many again in the backward. Here:

- forward: out'[t] = out[t] + s[t] * x[t] + sum_c g[t, c] * v[c], summed in float32 and rounded
  once to out's dtype; s (T,): each token's gates of its copy slots summed; g (T, C): its gates of
  the constant slots; v (C, D): the constants;
- backward, from grad (T, D) (which is also out's gradient): grad_x = s * grad in x's dtype, and
  grad_s = <grad, x>, grad_g = grad @ v^T in float32 in one pass over the rows; grad_v = g^T @ grad
  in another (mode/kernels/weighted_sums.py: summing each row tile across its threads in the row
  pass took longer than the rest of that pass).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, store_rounded
from mode.kernels.weighted_sums import float32_weighted_row_sums

# (tokens, columns) tiles; the backward walks a row tile's columns BACKWARD_BLOCK_D at a time.
BLOCK_T, BLOCK_D, WARPS = 2, 1024, 4
BACKWARD_BLOCK_T, BACKWARD_BLOCK_D, BACKWARD_WARPS = 64, 64, 4


@triton.jit
def _null_add(out_ptr, x_ptr, scale_ptr, gates_ptr, v_ptr, res_ptr, tokens, width, C: tl.constexpr,
              HAS_COPY: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok, d_ok = t < tokens, d < width
    mask = t_ok[:, None] & d_ok[None, :]
    at = t[:, None] * width + d[None, :]
    null = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    if HAS_COPY:
        s = tl.load(scale_ptr + t, mask=t_ok, other=0.0)
        null += s[:, None] * tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    for c in tl.static_range(C):
        g = tl.load(gates_ptr + t * C + c, mask=t_ok, other=0.0)
        v = tl.load(v_ptr + c * width + d, mask=d_ok, other=0.0).to(tl.float32)
        null += g[:, None] * v[None, :]
    out = tl.load(out_ptr + at, mask=mask, other=0.0).to(tl.float32)
    store_rounded(res_ptr + at, out + null, mask)


@triton.jit
def _null_add_backward(grad_ptr, x_ptr, scale_ptr, v_ptr, grad_x_ptr, grad_scale_ptr, grad_gates_ptr, tokens,
                       width, C: tl.constexpr, C_PAD: tl.constexpr, HAS_COPY: tl.constexpr, BLOCK_T: tl.constexpr,
                       BLOCK_D: tl.constexpr):
    """The row pass: grad_x, grad_s and grad_g, each a tile of rows' own."""
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    t_ok = t < tokens
    slots = tl.arange(0, C_PAD)  # the constant slots, padded to a power of two
    scale = tl.load(scale_ptr + t, mask=t_ok, other=0.0) if HAS_COPY else tl.zeros((BLOCK_T,), dtype=tl.float32)
    dot = tl.zeros((BLOCK_T,), dtype=tl.float32)
    grad_gates = tl.zeros((BLOCK_T, C_PAD), dtype=tl.float32)
    for start in range(0, width, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        d_ok = d < width
        mask = t_ok[:, None] & d_ok[None, :]
        at = t[:, None] * width + d[None, :]
        g = tl.load(grad_ptr + at, mask=mask, other=0.0).to(tl.float32)  # (BLOCK_T, BLOCK_D)
        if HAS_COPY:
            x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
            dot += tl.sum(g * x, axis=1)
            store_rounded(grad_x_ptr + at, g * scale[:, None], mask)
        for c in tl.static_range(C):  # float32 products, one slot at a time
            v = tl.load(v_ptr + c * width + d, mask=d_ok, other=0.0).to(tl.float32)  # (BLOCK_D,)
            grad_gates += tl.where(slots[None, :] == c, tl.sum(g * v[None, :], axis=1)[:, None], 0.0)
    if HAS_COPY:
        tl.store(grad_scale_ptr + t, dot, mask=t_ok)
    if C > 0:
        tl.store(grad_gates_ptr + t[:, None] * C + slots[None, :], grad_gates,
                 mask=t_ok[:, None] & (slots[None, :] < C))


class NullAdd(torch.autograd.Function):
    """(out (T, D), x (T, D), scale (T,) or None, gates (T, C) or None, constants (C, D) or None) ->
    out + scale * x + gates @ constants, in out's dtype (see the module docstring)."""

    @staticmethod
    def forward(ctx, out: Tensor, x: Tensor, scale: Tensor | None, gates: Tensor | None,
                constants: Tensor | None) -> Tensor:
        out, x = out.contiguous(), x.contiguous()
        scale = None if scale is None else scale.float().contiguous()
        gates = None if gates is None else gates.float().contiguous()
        constants = None if constants is None else constants.contiguous()
        ctx.save_for_backward(x, scale, gates, constants)
        ctx.x_dtype = x.dtype
        tokens, width = out.shape
        res = torch.empty_like(out)
        n_constants = 0 if gates is None else gates.shape[1]
        with on_device_of(out):
            _null_add[(triton.cdiv(tokens, BLOCK_T), triton.cdiv(width, BLOCK_D))](
                out, x, out if scale is None else scale, out if gates is None else gates,
                out if constants is None else constants, res, tokens, width, C=n_constants,
                HAS_COPY=scale is not None, BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=WARPS)
        return res

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor | None, ...]:
        x, scale, gates, constants = ctx.saved_tensors
        grad = grad.contiguous()
        tokens, width = grad.shape
        n_constants = 0 if gates is None else gates.shape[1]
        grad_x = None if scale is None else torch.empty(tokens, width, dtype=ctx.x_dtype, device=grad.device)
        grad_scale = None if scale is None else torch.empty(tokens, dtype=torch.float32, device=grad.device)
        grad_gates = None if gates is None else torch.empty(tokens, n_constants, dtype=torch.float32,
                                                            device=grad.device)
        with on_device_of(grad):
            _null_add_backward[(triton.cdiv(tokens, BACKWARD_BLOCK_T),)](
                grad, x, grad if scale is None else scale, grad if constants is None else constants,
                grad if grad_x is None else grad_x, grad if grad_scale is None else grad_scale,
                grad if grad_gates is None else grad_gates, tokens, width, C=n_constants,
                C_PAD=triton.next_power_of_2(max(n_constants, 1)), HAS_COPY=scale is not None,
                BLOCK_T=BACKWARD_BLOCK_T, BLOCK_D=BACKWARD_BLOCK_D, num_warps=BACKWARD_WARPS)
        grad_constants = None
        if constants is not None and ctx.needs_input_grad[4]:
            grad_constants = float32_weighted_row_sums(gates, grad).to(constants.dtype)  # (C, D)
        return grad, grad_x, grad_scale, grad_gates, grad_constants


def null_add(out: Tensor, x: Tensor, scale: Tensor | None, gates: Tensor | None, constants: Tensor | None) -> Tensor:
    """out (T, D) + scale (T,) * x (T, D) + gates (T, C) @ constants (C, D), summed in float32 and
    rounded once to out's dtype; scale or gates (with constants) None: no such term."""
    return NullAdd.apply(out, x, scale, gates, constants)
