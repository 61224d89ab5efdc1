"""Expert-choice selection as one Triton kernel: the k largest scores of each row, as positions
in increasing order.

PyTorch runs it as a top-k and then a sort of the chosen positions (so the chosen tokens stay in
causal order). Here one program per row loads the row, sorts unique 64-bit keys (the score's
bits in the high word, the position in the low word), reads the k-th key as a threshold, and
writes the positions whose key reaches it, in order, through a running count. Ties between
equal scores go to the earlier position; NaN counts as the largest score, as in torch.topk.

On an H100 (bench/block_profile.py): (8, 2048) scores, k = 256, 41.5 us of kernels in 8
launches for PyTorch against 29.3 us in one; expert choice's (8, 8, 2048), top 256, 44.7
against 29.4 us. Eager mode only: wrapped as a custom op for torch.compile, it split the
compiled graphs and broke a compiled expert-choice layer's view tracking (torch 2.11), so
compiled code keeps the PyTorch ops.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of

# One program holds a whole row: past this many tokens the sort no longer fits in registers,
# and the PyTorch path runs instead.
MAX_TOKENS = 4096


@triton.jit
def _top_k_positions(scores_ptr, out_ptr, tokens, k, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    pos = tl.arange(0, BLOCK)
    valid = pos < tokens
    score = tl.load(scores_ptr + row * tokens + pos, mask=valid, other=0.0)
    bits = score.to(tl.int32, bitcast=True)
    bits = tl.where(score != score, 0x7FC00000, bits)  # every NaN as +NaN: above +inf
    ordered = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)  # floats ordered as signed integers
    # Unique keys: the score in the high word; in the low word, earlier positions rank higher.
    key = (ordered.to(tl.int64) << 32) | (BLOCK - 1 - pos).to(tl.int64)
    key = tl.where(valid, key, -(2**63))
    ranked = tl.sort(key, descending=True)
    threshold = tl.min(tl.where(pos < k, ranked, 2**63 - 1), axis=0)  # the k-th largest key
    chosen = valid & (key >= threshold)  # exactly k: the keys are unique
    slot = tl.cumsum(chosen.to(tl.int32), axis=0) - 1  # increasing positions -> increasing slots
    tl.store(out_ptr + row * k + slot, pos.to(tl.int64), mask=chosen)


def fits(scores: Tensor) -> bool:
    """Whether the kernel takes these scores: float32 rows of at most MAX_TOKENS."""
    return scores.dtype == torch.float32 and 0 < scores.shape[-1] <= MAX_TOKENS


def top_k_positions(scores: Tensor, k: int) -> Tensor:
    """scores (..., T) float32 -> (..., k) int64: each row's top-k positions, increasing."""
    tokens = scores.shape[-1]
    if not 0 < k <= tokens:
        raise ValueError(f"top_k_positions: k must be in [1, {tokens}], got {k}")
    rows = scores.reshape(-1, tokens).contiguous()  # (R, T)
    out = torch.empty(*scores.shape[:-1], k, dtype=torch.long, device=scores.device)  # (..., k)
    if rows.shape[0]:
        block = triton.next_power_of_2(tokens)
        with on_device_of(scores):
            _top_k_positions[(rows.shape[0],)](rows, out, tokens, k, BLOCK=block, num_warps=max(4, min(16, block // 256)))
    return out
