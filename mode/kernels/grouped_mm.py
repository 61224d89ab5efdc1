"""The experts' grouped GEMM at a decode step's few rows: each expert's weights streamed once.

A decode step's MoE FFN (MoEFFN's static path) sorts its few assignments by expert and runs each
expert on its rows, the row ends on the device. With 8 to 256 rows every expert some row chose
has its whole weight matrix read for a handful of rows: the GEMM is bound by reading weights.
torch._grouped_mm tiles for large groups and reads them at well under the card's bandwidth there
(bench.row_ops); here one program per (expert, column tile) loads its expert's rows, streams the
tile's weights once along K and skips an expert with no row (its weights are never read).

grouped_rows_mm: out[r] = x[r] @ w[e] for the rows r of expert e (rows ends[e - 1] .. ends[e]);
rows from ends[-1] on are not computed (their output is undefined), as torch._grouped_mm's.
Forward only (inference): the layers call it where no gradient is needed.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import INTERPRETED, on_device_of, store_rounded

# (BLOCK_N, BLOCK_K, stages), the fastest tried on an H200 for 8 experts of 1024 x 5632 (the
# SwiGLU experts' [gate | up]) and 2816 x 1024 (down) with 8 to 256 rows: wide column tiles for the
# wide product, deep K steps for the long one; BLOCK_M 16 up to 64 rows, 64 above.
WIDE_TILE, LONG_TILE = (128, 64, 3), (64, 128, 4)
SMALL_BLOCK_M, LARGE_BLOCK_M, SMALL_ROWS = 16, 64, 64
WARPS = 4


@triton.jit
def _grouped_rows_mm(x_ptr, w_ptr, ends_ptr, out_ptr, K, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                     BLOCK_K: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    start = tl.load(ends_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    end = tl.load(ends_ptr + e).to(tl.int64)
    kk = tl.arange(0, BLOCK_K)
    w_expert = w_ptr + e * K * N
    for m0 in range(start, end, BLOCK_M):  # none for an expert without rows
        m = m0 + tl.arange(0, BLOCK_M)
        m_ok = m < end
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            k = k0 + kk
            a = tl.load(x_ptr + m[:, None] * K + k[None, :], mask=m_ok[:, None] & (k < K)[None, :], other=0.0)
            b = tl.load(w_expert + k[:, None] * N + n[None, :], mask=(k < K)[:, None] & (n < N)[None, :], other=0.0)
            if INTERPRETED:  # the interpreter's dot takes 16-bit operands as raw bits: widen them
                acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
            else:
                acc = tl.dot(a, b, acc)
        store_rounded(out_ptr + m[:, None] * N + n[None, :], acc, m_ok[:, None] & (n < N)[None, :])


def grouped_rows_mm(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    """x (R, K) sorted by expert, w (E, K, N), ends (E,) integer row ends on the device -> (R, N) in
    x's dtype: expert e's rows times w[e], float32 sums; rows from ends[-1] on undefined. x and w
    in one 16-bit dtype. Call on x's device (on_device_of)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or w.dtype != x.dtype:
        raise ValueError(f"grouped_rows_mm: x and w in one of bf16 / fp16, got {x.dtype} and {w.dtype}")
    rows, depth = x.shape
    experts, _, width = w.shape
    if w.shape[1] != depth or ends.shape != (experts,):
        raise ValueError(f"grouped_rows_mm: x {tuple(x.shape)}, w {tuple(w.shape)} and ends {tuple(ends.shape)} do not fit")
    x, w, ends = x.contiguous(), w.contiguous(), ends.contiguous()
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows == 0 or width == 0:
        return out
    block_n, block_k, stages = WIDE_TILE if width > depth else LONG_TILE
    block_m = SMALL_BLOCK_M if rows <= SMALL_ROWS else LARGE_BLOCK_M
    with on_device_of(x):
        _grouped_rows_mm[(experts, triton.cdiv(width, block_n))](
            x, w, ends, out, depth, width, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=WARPS,
            num_stages=stages,
        )
    return out
