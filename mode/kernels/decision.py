"""A depth router's causal decision for decode, in one kernel.

A decode step asks every routed layer whether each row takes it: the router's float32 logit
x @ w + b, taken where it is positive and the row is still sampling. As PyTorch ops that is four
kernels (a cast of x, the GEMV, the threshold, the and with the active rows); a skipped layer of a
CUDA-graphed step costs little more than its decision, so here it is one pass over x in float32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of

BLOCK_R, BLOCK_D, WARPS = 4, 512, 4  # rows per program; columns per step


@triton.jit
def _decide(x_ptr, w_ptr, b_ptr, active_ptr, scores_ptr, chosen_ptr, n_rows, width,
            HAS_BIAS: tl.constexpr, HAS_ACTIVE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < n_rows
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for start in range(0, width, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        d_ok = d < width
        x = tl.load(x_ptr + r[:, None] * width + d[None, :], mask=r_ok[:, None] & d_ok[None, :], other=0.0)
        w = tl.load(w_ptr + d, mask=d_ok, other=0.0)
        acc += x.to(tl.float32) * w[None, :]
    score = tl.sum(acc, axis=1)  # (BLOCK_R,)
    if HAS_BIAS:
        score += tl.load(b_ptr)
    taken = score > 0
    if HAS_ACTIVE:
        taken = taken & (tl.load(active_ptr + r, mask=r_ok, other=0) != 0)
    tl.store(scores_ptr + r, score, mask=r_ok)
    tl.store(chosen_ptr + r, taken.to(tl.uint8), mask=r_ok)


def decide_rows(x: Tensor, weight: Tensor, bias: Tensor | None, active: Tensor | None) -> tuple[Tensor, Tensor]:
    """x (..., D), weight (1, D) and bias (1,) float32, active (x's rows,) bool or None ->
    (chosen (...) bool: score > 0 and active, scores (...) float32)."""
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width).contiguous()  # (M, D)
    n_rows = rows.shape[0]
    if active is not None and active.numel() != n_rows:
        raise ValueError(f"decide_rows: active has {active.numel()} rows, x has {n_rows}")
    scores = torch.empty(n_rows, device=x.device, dtype=torch.float32)
    chosen = torch.empty(n_rows, device=x.device, dtype=torch.bool)
    flags = active.reshape(-1).contiguous().view(torch.uint8) if active is not None else chosen.view(torch.uint8)
    with on_device_of(x):
        _decide[(triton.cdiv(n_rows, BLOCK_R),)](
            rows, weight.reshape(-1).contiguous(), bias if bias is not None else scores, flags, scores,
            chosen.view(torch.uint8), n_rows, width, HAS_BIAS=bias is not None, HAS_ACTIVE=active is not None,
            BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_D, num_warps=WARPS,
        )
    return chosen.view(lead), scores.view(lead)
