"""Rows summed with a few weights each: weighted_row_sums(w (T, C), rows (T, D)) -> w^T @ rows (C, D)
in float32, C small (a router's slots, the constant null slots).

These are the weight gradients of a float32 product with a short side: a router's scores
(grad_W = grad_scores^T @ x) and the constant slots' vectors (grad_v = g^T @ grad), which cuBLAS runs
on SIMT kernels in float32. Here each program takes a group of rows and a block of columns and
accumulates its share down the rows as a float32 matmul ("ieee": no TF32 rounding), reading rows
once; the groups' shares are then added in a fixed order, so the result does not vary run to run.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of

# At most GROUPS groups of rows, each walked BLOCK_T rows at a time over BLOCK_D columns.
GROUPS, BLOCK_T, BLOCK_D, WARPS = 64, 32, 64, 4
MAX_WEIGHTS = 64  # C: the (C, BLOCK_D) share stays in registers


@triton.jit
def _weighted_row_sums(weights_ptr, rows_ptr, group_sums_ptr, tokens, width, rows_per_group, C: tl.constexpr,
                       C_DOT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    group = tl.program_id(0).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d_ok = d < width
    slots = tl.arange(0, C_DOT)  # padded to a matmul's smallest side
    share = tl.zeros((C_DOT, BLOCK_D), dtype=tl.float32)
    for start in range(0, rows_per_group, BLOCK_T):
        t = group * rows_per_group + start + tl.arange(0, BLOCK_T)
        t_ok = t < tokens
        rows = tl.load(rows_ptr + t[:, None] * width + d[None, :], mask=t_ok[:, None] & d_ok[None, :], other=0.0)
        weights_t = tl.load(weights_ptr + t[None, :] * C + slots[:, None], mask=t_ok[None, :] & (slots[:, None] < C),
                            other=0.0)  # (C_DOT, BLOCK_T); rows past the end and padded slots read 0
        share = tl.dot(weights_t.to(tl.float32), rows.to(tl.float32), share, input_precision="ieee")
    tl.store(group_sums_ptr + (group * C + slots[:, None]) * width + d[None, :], share,
             mask=(slots[:, None] < C) & d_ok[None, :])


def weighted_row_sums_applies(weights: Tensor, rows: Tensor) -> bool:
    """Whether weighted_row_sums takes these operands (else weights.t() @ rows)."""
    return weights.dim() == rows.dim() == 2 and weights.shape[0] == rows.shape[0] and 0 < weights.shape[1] <= MAX_WEIGHTS


def weighted_row_sums(weights: Tensor, rows: Tensor) -> Tensor:
    """weights (T, C), rows (T, D) -> sum_t weights[t, c] * rows[t] (C, D), float32 products and sums."""
    if not weighted_row_sums_applies(weights, rows):
        raise ValueError(f"weighted_row_sums: weights {tuple(weights.shape)} and rows {tuple(rows.shape)} need "
                         f"(T, C) and (T, D) with 0 < C <= {MAX_WEIGHTS}")
    weights, rows = weights.contiguous(), rows.contiguous()
    tokens, width = rows.shape
    n_weights = weights.shape[1]
    if tokens == 0:
        return torch.zeros(n_weights, width, dtype=torch.float32, device=rows.device)
    rows_per_group = triton.cdiv(triton.cdiv(tokens, GROUPS), BLOCK_T) * BLOCK_T
    groups = triton.cdiv(tokens, rows_per_group)
    group_sums = torch.empty(groups, n_weights, width, dtype=torch.float32, device=rows.device)
    with on_device_of(rows):
        _weighted_row_sums[(groups, triton.cdiv(width, BLOCK_D))](
            weights, rows, group_sums, tokens, width, rows_per_group, C=n_weights,
            C_DOT=max(16, triton.next_power_of_2(n_weights)), BLOCK_T=BLOCK_T, BLOCK_D=BLOCK_D, num_warps=WARPS)
    return group_sums.sum(0)


def float32_weighted_row_sums(weights: Tensor, rows: Tensor) -> Tensor:
    """weights (T, C)^T @ rows (T, D) in float32: weighted_row_sums where it applies, else the
    float32 product (more than MAX_WEIGHTS weights a row), with autocast off: a backward may run
    inside the forward's autocast (the CUDA-graphed training pass), which would make it bf16."""
    if weighted_row_sums_applies(weights, rows):
        return weighted_row_sums(weights, rows)
    with torch.autocast(rows.device.type, enabled=False):
        return weights.float().t() @ rows.float()
