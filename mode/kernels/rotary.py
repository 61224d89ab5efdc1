"""Rotary embeddings on the fused qkv projection, as one Triton kernel each way.

Eager PyTorch spends about ten elementwise passes on rotating q and k (a cat for the
half rotation, float32 products and sums, a cast back) and as many again in the backward,
where the gradients of q, k and v are also assembled into the qkv gradient by zero-filled
copies and sums. Here the forward reads qkv once and writes rotated q, k and a copy of v;
the backward reads the three gradients (any strides, as attention returns them) and writes
the qkv gradient once. Arithmetic in float32, as mode.layers.rotary.apply_rotary.

rotate_in_place: the cached forward's rotation (mode.layers.rotary.rotate_) of q and k inside
the qkv projection, where PyTorch runs four generic elementwise kernels (a cat, two broadcast
products and their sum); one pass, with rotate_'s rounding exactly (no fused multiply-add).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, store_rounded


@triton.jit
def _rotary_qkv_fwd(
    qkv_ptr, out_ptr, cos_ptr, sin_ptr, seq, cos_stride_b, cos_stride_s,
    H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)  # b * seq + s
    b, s = token // seq, token % seq
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < H) & (d < HALF)
    angle = b * cos_stride_b + s * cos_stride_s + d
    cos = tl.load(cos_ptr + angle, mask=d < HALF).to(tl.float32)  # cos_full = (cos, cos)
    sin = tl.load(sin_ptr + angle + HALF, mask=d < HALF).to(tl.float32)  # sin_signed = (-sin, sin)
    width = H * 2 * HALF  # one of q, k, v for one token
    base = token * 3 * width
    offs = heads * 2 * HALF + d  # (BLOCK_H, BLOCK_D): the first half of every head
    for j in tl.static_range(2):  # q, then k
        x1 = tl.load(qkv_ptr + base + j * width + offs, mask=mask).to(tl.float32)
        x2 = tl.load(qkv_ptr + base + j * width + offs + HALF, mask=mask).to(tl.float32)
        store_rounded(out_ptr + base + j * width + offs, x1 * cos - x2 * sin, mask)
        store_rounded(out_ptr + base + j * width + offs + HALF, x2 * cos + x1 * sin, mask)
    for half in tl.static_range(2):  # v, copied
        v = tl.load(qkv_ptr + base + 2 * width + offs + half * HALF, mask=mask)
        tl.store(out_ptr + base + 2 * width + offs + half * HALF, v, mask=mask)


@triton.jit
def _rotary_qkv_bwd(
    dq_ptr, dk_ptr, dv_ptr, dqkv_ptr, cos_ptr, sin_ptr, seq, cos_stride_b, cos_stride_s,
    dq_sb, dq_ss, dq_sh, dk_sb, dk_ss, dk_sh, dv_sb, dv_ss, dv_sh,
    H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    b, s = token // seq, token % seq
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < H) & (d < HALF)
    angle = b * cos_stride_b + s * cos_stride_s + d
    cos = tl.load(cos_ptr + angle, mask=d < HALF).to(tl.float32)
    sin = tl.load(sin_ptr + angle + HALF, mask=d < HALF).to(tl.float32)
    width = H * 2 * HALF
    base = token * 3 * width
    offs = heads * 2 * HALF + d
    # The rotation's transpose: dx1 = do1 cos + do2 sin, dx2 = do2 cos - do1 sin.
    dq = dq_ptr + b * dq_sb + s * dq_ss + heads * dq_sh + d
    do1 = tl.load(dq, mask=mask).to(tl.float32)
    do2 = tl.load(dq + HALF, mask=mask).to(tl.float32)
    store_rounded(dqkv_ptr + base + offs, do1 * cos + do2 * sin, mask)
    store_rounded(dqkv_ptr + base + offs + HALF, do2 * cos - do1 * sin, mask)
    dk = dk_ptr + b * dk_sb + s * dk_ss + heads * dk_sh + d
    do1 = tl.load(dk, mask=mask).to(tl.float32)
    do2 = tl.load(dk + HALF, mask=mask).to(tl.float32)
    store_rounded(dqkv_ptr + base + width + offs, do1 * cos + do2 * sin, mask)
    store_rounded(dqkv_ptr + base + width + offs + HALF, do2 * cos - do1 * sin, mask)
    dv = dv_ptr + b * dv_sb + s * dv_ss + heads * dv_sh + d
    for half in tl.static_range(2):
        tl.store(dqkv_ptr + base + 2 * width + offs + half * HALF, tl.load(dv + half * HALF, mask=mask), mask=mask)


@triton.jit
def _rotate_in_place(x_ptr, cos_ptr, sin_ptr, seq, stride_n, stride_s, stride_h, cos_stride_b, cos_stride_s,
                     H: tl.constexpr, HALF: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    token = tl.program_id(0).to(tl.int64)  # n * seq + s
    n, s = token // seq, token % seq
    heads = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (heads < H) & (d < HALF)
    first = x_ptr + n * stride_n + s * stride_s + heads * stride_h + d  # (BLOCK_H, BLOCK_D): first halves
    x1 = tl.load(first, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(first + HALF, mask=mask, other=0.0).to(tl.float32)
    angle = n * cos_stride_b + s * cos_stride_s + d
    cos1 = tl.load(cos_ptr + angle, mask=d < HALF, other=0.0)  # cos_full = (cos, cos)
    cos2 = tl.load(cos_ptr + angle + HALF, mask=d < HALF, other=0.0)
    sin1 = tl.load(sin_ptr + angle, mask=d < HALF, other=0.0)  # sin_signed = (-sin, sin)
    sin2 = tl.load(sin_ptr + angle + HALF, mask=d < HALF, other=0.0)
    store_rounded(first, x1 * cos1 + x2 * sin1, mask)  # x * cos_full + rotate_half(x) * sin_signed
    store_rounded(first + HALF, x2 * cos2 + x1 * sin2, mask)


def _row_strides(t: Tensor) -> tuple[int, int, int]:
    """(B, S, H, hd) with a unit last stride -> its (b, s, h) strides in elements."""
    return t.stride(0), t.stride(1), t.stride(2)


def _unit_last(t: Tensor) -> Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _angle_strides(table: Tensor) -> tuple[int, int]:
    """A (B or 1, S, 1, hd) angle table -> its (b, s) strides; 0 for b when shared by the batch."""
    return (0 if table.shape[0] == 1 else table.stride(0)), table.stride(1)


def _launch_shape(qkv: Tensor) -> tuple[int, dict[str, int]]:
    batch, seq, _, heads, head_dim = qkv.shape
    half = head_dim // 2
    meta = dict(H=heads, HALF=half, BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(half))
    return batch * seq, meta


class _RotaryQKV(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv: Tensor, cos_full: Tensor, sin_signed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        qkv = qkv.contiguous()
        cos_full, sin_signed = _unit_last(cos_full), _unit_last(sin_signed)
        out = torch.empty_like(qkv)  # (B, S, 3, H, hd)
        tokens, meta = _launch_shape(qkv)
        if tokens:
            with on_device_of(qkv):
                _rotary_qkv_fwd[(tokens,)](qkv, out, cos_full, sin_signed, qkv.shape[1], *_angle_strides(cos_full), **meta)
        ctx.save_for_backward(cos_full, sin_signed)
        ctx.shape = qkv.shape
        return out.unbind(2)  # q, k, v: (B, S, H, hd) each

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor, None, None]:
        cos_full, sin_signed = ctx.saved_tensors
        dq, dk, dv = _unit_last(dq), _unit_last(dk), _unit_last(dv)
        dqkv = dq.new_empty(ctx.shape)
        tokens, meta = _launch_shape(dqkv)
        if tokens:
            with on_device_of(dqkv):
                _rotary_qkv_bwd[(tokens,)](
                    dq, dk, dv, dqkv, cos_full, sin_signed, dqkv.shape[1], *_angle_strides(cos_full),
                    *_row_strides(dq), *_row_strides(dk), *_row_strides(dv), **meta,
                )
        return dqkv, None, None


def rotary_qkv(qkv: Tensor, cos_full: Tensor, sin_signed: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """qkv (B, S, 3, H, hd) -> (q, k, v), each (B, S, H, hd): q and k rotated by the angle tables
    (B or 1, S, 1, hd) of RotaryAngles (cos_full = (cos, cos), sin_signed = (-sin, sin)), v as is."""
    if qkv.dim() != 5 or qkv.shape[2] != 3 or qkv.shape[-1] % 2:
        raise ValueError(f"rotary_qkv: expected qkv (B, S, 3, H, even head_dim), got {tuple(qkv.shape)}")
    batch, seq = qkv.shape[:2]
    if cos_full.shape != sin_signed.shape or cos_full.shape[0] not in (1, batch) or cos_full.shape[1:] != (seq, 1, qkv.shape[-1]):
        raise ValueError(f"rotary_qkv: angle tables {tuple(cos_full.shape)} do not fit qkv {tuple(qkv.shape)}")
    return _RotaryQKV.apply(qkv, cos_full, sin_signed)


def rotate_in_place(x: Tensor, cos_full: Tensor, sin_signed: Tensor) -> None:
    """x (N, S, heads, hd) with a unit last stride (q and k heads of a qkv projection) rotated in place
    by float32 angle tables (N or 1, S, 1, hd): x * cos_full + rotate_half(x) * sin_signed in
    float32, rounded once into x's dtype."""
    n, seq, heads, head_dim = x.shape
    if head_dim % 2 or x.stride(-1) != 1 or cos_full.dtype != torch.float32 or sin_signed.dtype != torch.float32:
        raise ValueError(f"rotate_in_place: x {tuple(x.shape)} (unit last stride, even head_dim), float32 tables")
    if cos_full.shape != sin_signed.shape or cos_full.shape[0] not in (1, n) or cos_full.shape[1:] != (seq, 1, head_dim):
        raise ValueError(f"rotate_in_place: angle tables {tuple(cos_full.shape)} do not fit x {tuple(x.shape)}")
    cos_full, sin_signed = _unit_last(cos_full), _unit_last(sin_signed)
    half = head_dim // 2
    if n * seq:
        with on_device_of(x):
            _rotate_in_place[(n * seq,)](
                x, cos_full, sin_signed, seq, *_row_strides(x), *_angle_strides(cos_full), H=heads, HALF=half,
                BLOCK_H=triton.next_power_of_2(heads), BLOCK_D=triton.next_power_of_2(half),
                enable_fp_fusion=False,  # the products and their sum round apart, as in PyTorch
            )
