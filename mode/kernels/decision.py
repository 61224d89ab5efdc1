"""A routed layer's decode-step routing, one kernel per part.

- decide_rows: whether each row takes the layer, the router's float32 logit x @ w + b > 0 and the
  row still sampling. As PyTorch ops that is four kernels (a cast of x, the GEMV, the threshold,
  the and with the active rows); a skipped layer of a CUDA-graphed step costs little more than
  its decision, so here it is one pass over x in float32.
- compact_rows: the W rows a layer computes where its chosen rows fit in W (the chosen ones and,
  as padding, the first others, in row order), the cache slot each writes and attends over, and
  the kept rows' lengths grown. As PyTorch ops (mode.layers.chunks' compact_rows_reference), two
  sorts and about ten small kernels; here one program's prefix sums.
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


COMPACT_MAX_BATCH = 16384  # one program holds the batch's flags


@triton.jit
def _compact(chosen_ptr, lengths_ptr, base_ptr, rows_ptr, keep_ptr, write_ptr, used_ptr, batch, width, max_len,
             BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    ok = i < batch
    chosen = tl.load(chosen_ptr + i, mask=ok, other=0).to(tl.int32)
    count = tl.sum(chosen, axis=0)
    other = tl.where(ok, 1 - chosen, 0)
    # every chosen row, then the first unchosen ones until W rows (none where more than W chose)
    take = (chosen == 1) | ((other == 1) & (tl.cumsum(other, axis=0) <= width - count))
    slot = tl.cumsum(take.to(tl.int32), axis=0) - 1  # its place among the taken, in row order
    put = take & (slot < width)
    kept = put & (chosen == 1)
    length = tl.load(lengths_ptr + i, mask=put, other=0)
    base = tl.load(base_ptr + i, mask=put, other=0)
    tl.store(rows_ptr + slot, i.to(tl.int64), mask=put)
    tl.store(keep_ptr + slot, chosen.to(tl.uint8), mask=put)
    tl.store(write_ptr + slot, base + tl.where(kept, length, max_len), mask=put)
    tl.store(used_ptr + slot, tl.where(kept, length + 1, 1).to(tl.int64), mask=put)
    tl.store(lengths_ptr + i, length + 1, mask=kept)


def compact_rows(chosen: Tensor, width: int, lengths: Tensor, base: Tensor,
                 max_len: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """A compacted routed layer's rows and cache slots. chosen (B,) bool, W <= B; lengths (B,) int64
    each row's cache length (grown in place for the kept rows), base (B,) int64 each row's first
    packed slot, max_len its scratch slot -> rows (W,) int64 ascending, keep (W,) bool
    (chosen[rows]), write_at (W,) int64 the packed slot each row writes (its length, or scratch
    where not kept), used (W,) int64 the slots it attends over (its length + 1, or 1). The rows: the
    chosen ones and, as padding, the first unchosen ones, in row order; where more than W chose,
    the first W chosen."""
    batch = chosen.shape[0]
    if not 0 < width <= batch or batch > COMPACT_MAX_BATCH:
        raise ValueError(f"compact_rows: width {width} for {batch} rows (at most {COMPACT_MAX_BATCH})")
    if lengths.dtype != torch.int64 or base.dtype != torch.int64 or not lengths.is_contiguous():
        raise ValueError("compact_rows: lengths (contiguous) and base must be int64")
    rows, write_at, used = (torch.empty(width, device=chosen.device, dtype=torch.int64) for _ in range(3))
    keep = torch.empty(width, device=chosen.device, dtype=torch.bool)
    with on_device_of(chosen):
        _compact[(1,)](chosen.contiguous().view(torch.uint8), lengths, base.contiguous(), rows, keep.view(torch.uint8),
                       write_at, used, batch, width, max_len, BLOCK=triton.next_power_of_2(batch),
                       num_warps=4 if batch <= 2048 else 8)
    return rows, keep, write_at, used
