"""Moving rows between tokens and an expert-major layout, token-major, without atomics.

An MoE layer gathers each token's row into every expert that takes it, and sums the experts'
gated outputs back into the tokens. The PyTorch ops do the sums expert-major: a zero-filled
(T, D) buffer, then a scatter_add of the rows into it (the gather's backward, and the combine),
with a separate multiply by the gates before. Here each token reads the (at most J) rows it
owns through an inverse map instead and writes its sum once:

- sum_rows:    out[t] = sum_j gates[inv[t, j]] * rows[inv[t, j]] over inv[t, j] >= 0 (gates
               optional): the combine, and the gather's backward; one read of the rows, one
               write of (T, D), no zero fill, sums in float32 in a fixed order (deterministic);
- combine_backward: per row r of token ids[r], grad_rows[r] = gates[r] * grad[ids[r]] and
               grad_gates[r] = <rows[r], grad[ids[r]]> (float32) in one pass.

Eager mode on CUDA: two autograd functions (GatherRows, CombineRows). Under torch.compile the
routed layers keep plain gather / scatter_add, which Inductor fuses with its neighbours: these
kernels as torch.library operators were no faster there (README, "Tried and left out").
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, store_rounded

# Tiles: the fastest of the 24 tried for each kernel on an H100 with 16k bf16 rows of 1024 from 8
# experts (triton.testing.do_bench: the combine 35 us, the gather's backward 34, combine_backward 39,
# against 28 for a plain copy of the rows); most other tiles were within 10%.
BLOCK_T, BLOCK_D, SUM_WARPS = 4, 256, 4  # sum_rows: a (tokens, columns) tile per program
BLOCK_R, BLOCK_RD, COMBINE_BACKWARD_WARPS = 4, 512, 2  # combine_backward: rows per program; columns per step


@triton.jit
def _sum_rows(rows_ptr, gates_ptr, inverse_ptr, out_ptr, tokens, width,
              J: tl.constexpr, HAS_GATES: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok, d_ok = t < tokens, d < width
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(J):
        r = tl.load(inverse_ptr + t * J + j, mask=t_ok, other=-1).to(tl.int64)  # (BLOCK_T,)
        hit = r >= 0
        v = tl.load(rows_ptr + r[:, None] * width + d[None, :], mask=hit[:, None] & d_ok[None, :], other=0.0)
        v = v.to(tl.float32)
        if HAS_GATES:
            v = v * tl.load(gates_ptr + r, mask=hit, other=0.0).to(tl.float32)[:, None]
        acc += v
    store_rounded(out_ptr + t[:, None] * width + d[None, :], acc, t_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_backward(grad_ptr, ids_ptr, rows_ptr, gates_ptr, grad_rows_ptr, grad_gates_ptr, n_rows, width,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < n_rows
    token = tl.load(ids_ptr + r, mask=r_ok, other=0).to(tl.int64)  # (BLOCK_R,)
    gate = tl.load(gates_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, width, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        mask = r_ok[:, None] & (d < width)[None, :]
        g = tl.load(grad_ptr + token[:, None] * width + d[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(rows_ptr + r[:, None] * width + d[None, :], mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(g * y, axis=1)
        store_rounded(grad_rows_ptr + r[:, None] * width + d[None, :], g * gate[:, None], mask)
    tl.store(grad_gates_ptr + r, dot, mask=r_ok)


# ----------------------------------------------------------------------------- launches
def _sum_rows_launch(rows: Tensor, gates: Tensor | None, inverse: Tensor) -> Tensor:
    rows, inverse = rows.contiguous(), inverse.contiguous()
    tokens, width = inverse.shape[0], rows.shape[1]
    out = rows.new_empty(tokens, width)
    if out.numel() == 0:
        return out
    gates_arg = rows if gates is None else gates.contiguous()  # any pointer when there are no gates
    _sum_rows[(triton.cdiv(tokens, BLOCK_T), triton.cdiv(width, BLOCK_D))](
        rows, gates_arg, inverse, out, tokens, width, J=inverse.shape[1], HAS_GATES=gates is not None,
        BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=SUM_WARPS,
    )
    return out


def _combine_backward_launch(grad: Tensor, ids: Tensor, rows: Tensor, gates: Tensor) -> tuple[Tensor, Tensor]:
    grad, ids, rows, gates = grad.contiguous(), ids.contiguous(), rows.contiguous(), gates.contiguous()
    grad_rows = torch.empty_like(rows)
    grad_gates = torch.zeros(rows.shape[0], dtype=torch.float32, device=rows.device)
    if rows.numel() == 0:
        return grad_rows, grad_gates
    _combine_backward[(triton.cdiv(rows.shape[0], BLOCK_R),)](
        grad, ids, rows, gates, grad_rows, grad_gates, rows.shape[0], rows.shape[1], BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_RD,
        num_warps=COMBINE_BACKWARD_WARPS,
    )
    return grad_rows, grad_gates


# ----------------------------------------------------------------------------- autograd
class GatherRows(torch.autograd.Function):
    """x (T, D), ids (R,), inverse (T, J) -> x[ids] (R, D); the backward sums each token's rows."""

    @staticmethod
    def forward(ctx, x: Tensor, ids: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(inverse)
        return x.index_select(0, ids)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (inverse,) = ctx.saved_tensors
        with on_device_of(grad):
            return _sum_rows_launch(grad, None, inverse), None, None


class CombineRows(torch.autograd.Function):
    """rows (R, D), gates (R,), ids (R,), inverse (T, J) -> (T, D): each token's gated rows summed."""

    @staticmethod
    def forward(ctx, rows: Tensor, gates: Tensor, ids: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(rows, gates, ids)
        with on_device_of(rows):
            return _sum_rows_launch(rows, gates, inverse)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        rows, gates, ids = ctx.saved_tensors
        with on_device_of(rows):
            grad_rows, grad_gates = _combine_backward_launch(grad, ids, rows, gates)
        return grad_rows, grad_gates.to(gates.dtype), None, None
