"""A static decode step's attention input, in one kernel per layer: q and k rotated, the keys and
values written into the cache.

A layer of a static step (mode.layers.chunks: MaskedRows, every row; CompactRows, the rows a
routed layer chose) projects each row's token to qkv (n, 1, H + 2Hkv, hd), rotates q and k, writes
k and v into the row's packed cache region and attends. As PyTorch ops and separate kernels that
took a rotation, the slots' integer ops (two wheres, three adds where every row is computed; the
angles' two gathers for chosen rows), an index_copy and a copy of q for the attention: each a
launch that costs a CUDA-graphed step more than its arithmetic. Here one program per row does all
of it, with the rotation's arithmetic (mode.kernels.rotary.rotate_in_place: float32, no fused
multiply-add, one rounding to qkv's dtype): the same values.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, rounded_as, store_rounded


@triton.jit
def _rotate_write(qkv_ptr, row_stride, cos_ptr, sin_ptr, rows_ptr, q_ptr, cache_ptr, half, keep_ptr, lengths_ptr,
                  base_ptr, write_ptr, used_ptr, max_len, H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr,
                  BLOCK_H: tl.constexpr, BLOCK_HKV: tl.constexpr, BLOCK_D: tl.constexpr, HAS_ROWS: tl.constexpr,
                  GIVEN_SLOTS: tl.constexpr):
    i = tl.program_id(0).to(tl.int64)
    row = tl.load(rows_ptr + i).to(tl.int64) if HAS_ROWS else i  # its batch row: its angles
    if GIVEN_SLOTS:
        slot = tl.load(write_ptr + i)
    else:  # kept: at its length, which grows; else its scratch slot
        kept = tl.load(keep_ptr + i) != 0
        length = tl.load(lengths_ptr + i)
        slot = tl.load(base_ptr + i) + tl.where(kept, length, max_len)
        tl.store(used_ptr + i, tl.where(kept, length + 1, 1).to(tl.int64))
        tl.store(lengths_ptr + i, length + 1, mask=kept)
    d = tl.arange(0, BLOCK_D)[None, :]
    d_ok = d < HALF
    angle = row * (2 * HALF) + d
    cos1 = tl.load(cos_ptr + angle, mask=d_ok, other=0.0)  # cos_full = (cos, cos)
    cos2 = tl.load(cos_ptr + angle + HALF, mask=d_ok, other=0.0)
    sin1 = tl.load(sin_ptr + angle, mask=d_ok, other=0.0)  # sin_signed = (-sin, sin)
    sin2 = tl.load(sin_ptr + angle + HALF, mask=d_ok, other=0.0)
    source = qkv_ptr + i * row_stride
    # q: rotated into its own contiguous (n, H, hd), which the attention reads
    heads = tl.arange(0, BLOCK_H)[:, None]
    mask = (heads < H) & d_ok
    first = source + heads * (2 * HALF) + d
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    out = q_ptr + (i * H + heads) * (2 * HALF) + d
    store_rounded(out, x1 * cos1 + x2 * sin1, mask)  # x * cos_full + rotate_half(x) * sin_signed
    store_rounded(out + HALF, x2 * cos2 + x1 * sin2, mask)
    # k: rotated and rounded to qkv's dtype, as in place, then into the cache; v copied
    kv_heads = tl.arange(0, BLOCK_HKV)[:, None]
    mask = (kv_heads < HKV) & d_ok
    first = source + (H + kv_heads) * (2 * HALF) + d
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    target = cache_ptr + slot * (HKV * 2 * HALF) + kv_heads * (2 * HALF) + d
    store_rounded(target, rounded_as(x1 * cos1 + x2 * sin1, qkv_ptr), mask)
    store_rounded(target + HALF, rounded_as(x2 * cos2 + x1 * sin2, qkv_ptr), mask)
    first += HKV * 2 * HALF
    store_rounded(target + half, tl.load(first, mask=mask, other=0.0).to(tl.float32), mask)
    store_rounded(target + half + HALF, tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32), mask)


def rotate_write_applies(qkv: Tensor, heads: int, cos_full: Tensor, cache_kv: Tensor) -> bool:
    """Whether the kernels below take these: qkv (n, 1, H + 2Hkv, hd), each row's heads contiguous;
    float32 angle tables with a row of hd per batch row; a contiguous cache of Hkv heads."""
    if qkv.dim() != 4 or qkv.shape[1] != 1 or cache_kv.dim() != 5:
        return False
    n, _, width, head_dim = qkv.shape
    kv_heads = cache_kv.shape[3]
    return (width == heads + 2 * kv_heads and head_dim % 2 == 0 and qkv.stride(3) == 1 and qkv.stride(2) == head_dim
            and cache_kv.is_contiguous() and cache_kv.shape[0] == 2 and cache_kv.shape[4] == head_dim
            and cos_full.dtype == torch.float32 and cos_full.is_contiguous() and cos_full.shape[-1] == head_dim
            and cos_full.numel() == cos_full.shape[0] * head_dim and qkv.dtype in (torch.bfloat16, torch.float16, torch.float32))


def rotate_write_every_row(qkv: Tensor, heads: int, cos_full: Tensor, sin_signed: Tensor, cache_kv: Tensor,
                           keep: Tensor, lengths: Tensor, base: Tensor) -> tuple[Tensor, Tensor]:
    """A layer computing every row of a static step. qkv (B, 1, H + 2Hkv, hd); cos_full, sin_signed
    (B, ..., hd) float32, row b's angles; cache_kv (2, B, max_len + 1, Hkv, hd), whose packed
    (2, B * (max_len + 1), Hkv, hd) view puts row b's region at base[b] (B,) int64; keep (B,) bool;
    lengths (B,) int64, grown in place for the kept rows. Row b's rotated key and its value go to
    slot base[b] + lengths[b] where kept, else base[b] + max_len (its scratch slot) -> (q (B, H, hd)
    rotated, used (B,) int64: the slots row b attends over, lengths[b] + 1 where kept, else 1).
    What rotate_, written_slots, lengths.add_ and write_packed do (mode/layers/chunks.py)."""
    batch = qkv.shape[0]
    if not (keep.shape == (batch,) and keep.dtype == torch.bool and lengths.shape == (batch,)
            and lengths.dtype == torch.int64 and lengths.is_contiguous() and base.shape == (batch,)
            and base.dtype == torch.int64 and cos_full.shape[0] == batch):
        raise ValueError(f"rotate_write_every_row: {batch} rows; keep {tuple(keep.shape)} {keep.dtype}, lengths "
                         f"{tuple(lengths.shape)} {lengths.dtype}, base {tuple(base.shape)} {base.dtype}, "
                         f"angles {tuple(cos_full.shape)}")
    used = torch.empty(batch, device=qkv.device, dtype=torch.int64)
    q = _launch(qkv, heads, cos_full, sin_signed, cache_kv, None, keep.contiguous().view(torch.uint8), lengths,
                base.contiguous(), None, used)
    return q, used


def rotate_write_rows(qkv: Tensor, heads: int, cos_full: Tensor, sin_signed: Tensor, cache_kv: Tensor,
                      rows: Tensor, write_at: Tensor) -> Tensor:
    """The W rows a routed layer computes (mode.layers.chunks.CompactRows): qkv (W, 1, H + 2Hkv, hd) of
    batch rows rows (W,), whose angles are rows rows[i] of cos_full, sin_signed (B, ..., hd) float32;
    row i's rotated key and its value go to packed slot write_at[i] (W,) int64 -> q (W, H, hd)
    rotated. What the angles' gathers, rotate_ and write_packed do."""
    width = qkv.shape[0]
    if rows.shape != (width,) or write_at.shape != (width,) or write_at.dtype != torch.int64:
        raise ValueError(f"rotate_write_rows: {width} rows; rows {tuple(rows.shape)}, write_at "
                         f"{tuple(write_at.shape)} {write_at.dtype}")
    return _launch(qkv, heads, cos_full, sin_signed, cache_kv, rows.contiguous(), None, None, None,
                   write_at.contiguous(), None)


def _launch(qkv: Tensor, heads: int, cos_full: Tensor, sin_signed: Tensor, cache_kv: Tensor, rows: Tensor | None,
            keep: Tensor | None, lengths: Tensor | None, base: Tensor | None, write_at: Tensor | None,
            used: Tensor | None) -> Tensor:
    if not rotate_write_applies(qkv, heads, cos_full, cache_kv) or sin_signed.shape != cos_full.shape \
            or not sin_signed.is_contiguous() or sin_signed.dtype != torch.float32:
        raise ValueError(f"step_cache: qkv {tuple(qkv.shape)} (strides {qkv.stride()}) {qkv.dtype}, {heads} query "
                         f"heads, angles {tuple(cos_full.shape)} {cos_full.dtype}, cache {tuple(cache_kv.shape)}: "
                         "see rotate_write_applies")
    n, head_dim, kv_heads = qkv.shape[0], qkv.shape[3], cache_kv.shape[3]
    q = torch.empty(n, heads, head_dim, device=qkv.device, dtype=qkv.dtype)
    any_ptr = q  # for the pointers a variant does not read
    if n:
        with on_device_of(qkv):
            _rotate_write[(n,)](
                qkv, qkv.stride(0), cos_full, sin_signed, any_ptr if rows is None else rows, q, cache_kv,
                cache_kv[1].numel(), any_ptr if keep is None else keep, any_ptr if lengths is None else lengths,
                any_ptr if base is None else base, any_ptr if write_at is None else write_at,
                any_ptr if used is None else used, cache_kv.shape[2] - 1, H=heads, HKV=kv_heads, HALF=head_dim // 2,
                BLOCK_H=triton.next_power_of_2(heads), BLOCK_HKV=triton.next_power_of_2(kv_heads),
                BLOCK_D=triton.next_power_of_2(head_dim // 2), HAS_ROWS=rows is not None,
                GIVEN_SLOTS=write_at is not None,
                enable_fp_fusion=False,  # the products and their sum round apart, as in PyTorch
            )
    return q
