"""Expert-choice selection as one Triton kernel: the k largest scores of each row, as positions
in increasing order.

PyTorch runs it as a top-k and then a sort of the chosen positions (so the chosen tokens stay in
causal order). Here one program per row loads the row, maps each score to an integer key that
orders as the floats do, finds the k-th largest key by bisection (a block-wide count per step,
about 30 steps), and writes the positions above it and the earliest of those equal to it, in
order, through a running count. Ties between equal scores go to the earlier position; NaN counts
as the largest score, as in torch.topk. The bisection's counts cost less than sorting the row's
64-bit (score, position) keys.

Eager mode only: wrapped as a custom op for torch.compile, it split the compiled graphs and broke
a compiled expert-choice layer's view tracking, so compiled code keeps the PyTorch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of

# One program holds a whole row in registers: past this many tokens the PyTorch path runs instead.
MAX_TOKENS = 4096


@triton.jit
def row_top_k(score, pos, valid, k, BLOCK: tl.constexpr):
    """One row's float32 scores at positions pos (BLOCK,), valid where < the row's length ->
    (chosen (BLOCK,) bool, exactly k True; slot: the rank among the chosen, increasing with pos)."""
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(score != score, 0x7FC00000, bits)  # every NaN as +NaN: above +inf
    bits = tl.where(score == 0.0, 0, bits)  # -0.0 as +0.0: equal scores, a tie as in PyTorch
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # floats ordered as signed integers
    ordered = tl.where(valid, ordered, -(2**31)).to(tl.int64)  # past the row: below every score
    # The k-th largest key by bisection: the largest v with at least k keys >= v.
    low, high = tl.min(ordered, axis=0), tl.max(ordered, axis=0)
    while low < high:
        mid = (low + high + 1) // 2
        enough = tl.sum((ordered >= mid).to(tl.int32), axis=0) >= k
        low, high = tl.where(enough, mid, low), tl.where(enough, high, mid - 1)
    above = valid & (ordered > low)
    # Ties at the threshold go to the earlier positions, as many as are still needed.
    tie = valid & (ordered == low)
    needed = k - tl.sum(above.to(tl.int32), axis=0)
    chosen = above | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= needed))
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # increasing positions -> increasing slots
    return chosen, slot


@triton.jit
def _top_k_positions(scores_ptr, out_ptr, flat_ptr, tokens, k, FLAT: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, BLOCK)
    valid = pos < tokens
    score = tl.load(scores_ptr + row * tokens + pos, mask=valid, other=0.0)
    chosen, slot = row_top_k(score, pos, valid, k, BLOCK)
    tl.store(out_ptr + row * k + slot, pos.to(tl.int64), mask=chosen)
    if FLAT:  # the positions in the flattened (rows * tokens) axis too
        tl.store(flat_ptr + row * k + slot, row * tokens + pos, mask=chosen)


def num_warps(block: int) -> int:
    """Warps for a program holding a row of `block` keys (the fastest tried at 2048 and 4096)."""
    return max(4, min(8, block // 512))


def fits(scores: Tensor) -> bool:
    """Whether the kernel takes these scores: float32 rows of at most MAX_TOKENS."""
    return scores.dtype == torch.float32 and 0 < scores.shape[-1] <= MAX_TOKENS


def top_k_positions(scores: Tensor, k: int, flat: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """scores (..., T) float32 -> (..., k) int64: each row's top-k positions, increasing; with flat,
    also the same positions in the flattened (rows * T) axis, (rows * k,) int64."""
    tokens = scores.shape[-1]
    if not 0 < k <= tokens:
        raise ValueError(f"top_k_positions: k must be in [1, {tokens}], got {k}")
    rows = scores.reshape(-1, tokens).contiguous()  # (R, T)
    out = torch.empty(*scores.shape[:-1], k, dtype=torch.long, device=scores.device)  # (..., k)
    flat_out = torch.empty(rows.shape[0] * k, dtype=torch.long, device=scores.device) if flat else out
    if rows.shape[0]:
        block = triton.next_power_of_2(tokens)
        with on_device_of(scores):
            _top_k_positions[(rows.shape[0],)](rows, out, flat_out, tokens, k, FLAT=flat, BLOCK=block,
                                               num_warps=num_warps(block))
    return (out, flat_out) if flat else out
