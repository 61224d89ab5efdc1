"""Single-query attention over a decode step's KV cache, one program per (row, head).

Flash attention's variable-length kernel computes a decode step's one query per row in a tile of
128 query rows: 127 of them padding, so a step's attention costs about 128 times its arithmetic
and, from batch 64 on, most of the step. Here each program streams its row's used cache slots of
one key/value head once, in float32 with an online softmax, and no query tile: the step reads its
cache at close to the memory's speed. Below DECODE_MIN_PROGRAMS per streaming multiprocessor the
programs are too few to keep the memory busy, and flash attention stays.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, store_rounded
from mode.kernels.policy import use_triton

BLOCK_N, WARPS = 128, 2  # cache slots per step of a program: the fastest tried on an H200 at batch 64-1024
DECODE_MIN_PROGRAMS = 4  # (rows x heads) per streaming multiprocessor where this kernel runs


@triton.jit
def _decode_attention(q_ptr, kv_ptr, rows_ptr, used_ptr, out_ptr, slots, half, scale, H: tl.constexpr,
                      GROUPS: tl.constexpr, HD: tl.constexpr, HAS_ROWS: tl.constexpr, BLOCK_N: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)  # the query row
    h = tl.program_id(1)
    row = tl.load(rows_ptr + i).to(tl.int64) if HAS_ROWS else i  # its batch row: its cache region
    n_keys = tl.load(used_ptr + i).to(tl.int32)
    d = tl.arange(0, HD)
    q = tl.load(q_ptr + (i * H + h) * HD + d).to(tl.float32) * (scale * 1.4426950408889634)  # log2 e: exp2 below
    kv_heads: tl.constexpr = H // GROUPS
    base = kv_ptr + (row * slots * kv_heads + h // GROUPS) * HD  # slot 0 of its key/value head
    top = tl.full([], float("-inf"), tl.float32)
    total = tl.full([], 0.0, tl.float32)
    acc = tl.zeros((HD,), tl.float32)
    for start in range(0, n_keys, BLOCK_N):
        j = start + tl.arange(0, BLOCK_N)
        ok = j < n_keys
        at = base + j[:, None].to(tl.int64) * (kv_heads * HD) + d[None, :]  # (BLOCK_N, HD)
        k = tl.load(at, mask=ok[:, None], other=0.0).to(tl.float32)
        s = tl.where(ok, tl.sum(k * q[None, :], axis=1), float("-inf"))  # (BLOCK_N,) log2-scaled
        new_top = tl.maximum(top, tl.max(s, axis=0))
        p = tl.exp2(s - new_top)
        shrink = tl.exp2(top - new_top)
        v = tl.load(at + half, mask=ok[:, None], other=0.0).to(tl.float32)
        acc = acc * shrink + tl.sum(p[:, None] * v, axis=0)
        total = total * shrink + tl.sum(p, axis=0)
        top = new_top
    store_rounded(out_ptr + (i * H + h) * HD + d, acc / total, d < HD)


def decode_attention_applies(q: Tensor, any_batch: bool = False) -> bool:
    """Whether decode_attention runs for queries q (n, H, hd): the policy's "decode_attention" op, a
    power-of-two head width, and on a GPU at least DECODE_MIN_PROGRAMS (row, head) pairs per
    streaming multiprocessor (fewer leave the memory idle: flash attention then) unless any_batch."""
    n, heads, head_dim = q.shape
    if not use_triton(q, "decode_attention") or head_dim & (head_dim - 1) or not 4 <= head_dim <= 256:
        return False
    if any_batch or not q.is_cuda:
        return True
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    return n * heads >= DECODE_MIN_PROGRAMS * sms


def decode_attention(q: Tensor, kv: Tensor, used: Tensor, rows: Tensor | None = None) -> Tensor:
    """q (n, H, hd); kv (2, B, S, Hkv, hd) the layer's cache, contiguous; used (n,): row i attends
    over its first used[i] >= 1 slots; rows (n,): the batch row of each query (None: row i) ->
    (n, H, hd) in q's dtype, softmax(q k^T / sqrt(hd)) v."""
    n, heads, head_dim = q.shape
    _, _, slots, kv_heads, _ = kv.shape
    if heads % kv_heads or not kv.is_contiguous():
        raise ValueError(f"decode_attention: {heads} query heads over {kv_heads} cache heads, contiguous cache")
    q = q.contiguous()
    out = torch.empty_like(q)
    with on_device_of(q):
        _decode_attention[(n, heads)](
            q, kv, rows if rows is not None else used, used, out, slots, kv[0].numel(), head_dim**-0.5,
            H=heads, GROUPS=heads // kv_heads, HD=head_dim, HAS_ROWS=rows is not None, BLOCK_N=BLOCK_N,
            num_warps=WARPS,
        )
    return out
