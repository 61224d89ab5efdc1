"""A static decode step's cache write for every row, in one kernel.

A layer that computes every row of a static step (mode.layers.chunks.attend_static) writes each
row's key and value into its packed cache region: at its length where the row keeps the token,
else at its scratch slot; it attends over length + 1 slots (else 1), and the kept rows' lengths
grow. As PyTorch ops that is six small kernels (two wheres, three adds, the index_copy), each a
launch that costs a CUDA-graphed step more than its arithmetic; here one program per row does
all of it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, store_rounded

BLOCK, WARPS = 1024, 4  # key (or value) elements per step of a row's program


@triton.jit
def _write_step(kv_ptr, row_stride, cache_ptr, half, keep_ptr, lengths_ptr, base_ptr, used_ptr, max_len, width,
                BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    kept = tl.load(keep_ptr + row) != 0
    length = tl.load(lengths_ptr + row)
    slot = tl.load(base_ptr + row) + tl.where(kept, length, max_len)
    tl.store(used_ptr + row, tl.where(kept, length + 1, 1).to(tl.int64))
    tl.store(lengths_ptr + row, length + 1, mask=kept)
    source = kv_ptr + row * row_stride  # the row's key, then its value, each `width` wide
    target = cache_ptr + slot * width
    for start in range(0, width, BLOCK):
        d = start + tl.arange(0, BLOCK)
        ok = d < width
        store_rounded(target + d, tl.load(source + d, mask=ok).to(tl.float32), ok)
        store_rounded(target + half + d, tl.load(source + width + d, mask=ok).to(tl.float32), ok)


def write_step_applies(kv: Tensor, cache_kv: Tensor, keep: Tensor, lengths: Tensor, base: Tensor) -> bool:
    """Whether write_step_kv takes these: each row's key and value one contiguous block, a
    contiguous cache, int64 lengths (contiguous) and bases, a flag per row."""
    n, two, kv_heads, head_dim = kv.shape
    return (two == 2 and kv.stride(3) == 1 and kv.stride(2) == head_dim and kv.stride(1) == kv_heads * head_dim
            and cache_kv.is_contiguous() and cache_kv.shape[0] == 2 and cache_kv.shape[1] == n
            and tuple(cache_kv.shape[3:]) == (kv_heads, head_dim) and keep.shape == (n,) and keep.dtype == torch.bool
            and lengths.dtype == torch.int64 and lengths.is_contiguous() and lengths.shape == (n,)
            and base.dtype == torch.int64 and base.shape == (n,))


def write_step_kv(kv: Tensor, cache_kv: Tensor, keep: Tensor, lengths: Tensor, base: Tensor) -> Tensor:
    """kv (B, 2, Hkv, hd): every row's new key and value; cache_kv (2, B, max_len + 1, Hkv, hd), whose
    packed (2, B * (max_len + 1), Hkv, hd) view puts row b's region at base[b] (B,) int64; keep (B,)
    bool; lengths (B,) int64, grown in place for the kept rows. Row b's key and value go to slot
    base[b] + lengths[b] where kept, else base[b] + max_len (its scratch slot), in the cache's
    dtype -> used (B,) int64: the slots row b attends over, lengths[b] + 1 where kept, else 1 (the
    lengths before they grow). What written_slots, lengths.add_ and write_packed do
    (mode/layers/chunks.py)."""
    if not write_step_applies(kv, cache_kv, keep, lengths, base):
        raise ValueError(f"write_step_kv: kv {tuple(kv.shape)} (strides {kv.stride()}), cache "
                         f"{tuple(cache_kv.shape)}, keep {tuple(keep.shape)} {keep.dtype}, lengths {lengths.dtype}, "
                         f"base {base.dtype}: see write_step_applies")
    batch, max_len = kv.shape[0], cache_kv.shape[2] - 1
    width = kv.shape[2] * kv.shape[3]
    used = torch.empty(batch, device=kv.device, dtype=torch.int64)
    with on_device_of(kv):
        _write_step[(batch,)](kv, kv.stride(0), cache_kv, cache_kv[1].numel(), keep.contiguous().view(torch.uint8),
                              lengths, base.contiguous(), used, max_len, width, BLOCK=min(BLOCK, triton.next_power_of_2(width)),
                              num_warps=WARPS)
    return used
