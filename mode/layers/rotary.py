"""Rotary position embeddings, looked up at arbitrary (original) positions."""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from mode.config import RopeScaling
from mode.kernels import use_triton


@dataclass
class RotaryAngles:
    """Full-width rotation tables for a set of tokens, shaped (B or 1, S, 1, head_dim).

    Rotation is x * cos_full + rotate_half(x) * sin_signed, with cos_full = (cos, cos) and
    sin_signed = (-sin, sin) over the two halves of a head: no per-layer table building.
    """

    cos_full: Tensor
    sin_signed: Tensor

    @property
    def cos(self) -> Tensor:
        """(B|1, S, 1, head_dim/2)"""
        return self.cos_full[..., : self.cos_full.shape[-1] // 2]

    @property
    def sin(self) -> Tensor:
        """(B|1, S, 1, head_dim/2)"""
        return self.sin_signed[..., self.sin_signed.shape[-1] // 2 :]

    def select(self, indices: Tensor) -> "RotaryAngles":
        """Angles of the chosen tokens (B, k): routed tokens keep their original positions."""
        batch = indices.shape[0]
        width = self.cos_full.shape[-1]
        idx = indices.view(batch, -1, 1, 1).expand(-1, -1, 1, width)  # (B, k, 1, hd)
        cos = self.cos_full.expand(batch, -1, -1, -1).gather(1, idx)
        sin = self.sin_signed.expand(batch, -1, -1, -1).gather(1, idx)
        return RotaryAngles(cos, sin)


def inverse_frequencies(head_dim: int, base: float, scaling: RopeScaling | None = None) -> Tensor:
    """The rotation speed of each pair of a head (head_dim/2,), float64: base^(-2i/head_dim),
    with Llama-3 scaling (RopeScaling) where given."""
    inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if scaling is None:
        return inv_freq
    original, low, high = scaling.original_max_seq_len, scaling.low_freq_factor, scaling.high_freq_factor
    wavelength = 2 * math.pi / inv_freq
    # Wavelengths beyond original / low never completed a turn within the pretraining context:
    # stretched by the factor. Those below original / high kept. Between, a linear blend of the
    # two in original / wavelength, from 0 at the long end to 1 at the short end.
    blend = (original / wavelength - low) / (high - low)
    blended = (1 - blend) * inv_freq / scaling.factor + blend * inv_freq
    stretched = torch.where(wavelength > original / low, inv_freq / scaling.factor, blended)
    return torch.where(wavelength < original / high, inv_freq, stretched)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_seq_len: int, base: float, scaling: RopeScaling | None = None) -> None:
        super().__init__()
        inv_freq = inverse_frequencies(head_dim, base, scaling)
        angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64), inv_freq)  # (S_max, half)
        cos, sin = angles.cos().float(), angles.sin().float()
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)
        self.register_buffer("cos_full", torch.cat((cos, cos), dim=-1), persistent=False)  # (S_max, hd)
        self.register_buffer("sin_signed", torch.cat((-sin, sin), dim=-1), persistent=False)  # (S_max, hd)

    def _apply(self, fn, recurse: bool = True) -> "RotaryEmbedding":
        """Casts keep the tables float32 where they would narrow them (model.to(torch.bfloat16),
        as sampling runs it): training under autocast rotates with float32 tables, and so must
        sampling (bf16 tables move the angles by up to 2e-3). Devices change as usual."""
        tables = dict(self.named_buffers(recurse=False))
        super()._apply(fn, recurse)
        for name, table in tables.items():
            cast = getattr(self, name)
            if cast.is_floating_point() and torch.finfo(cast.dtype).bits < torch.finfo(table.dtype).bits:
                setattr(self, name, table.to(cast.device))
        return self

    def angles(self, positions: Tensor) -> RotaryAngles:
        """positions (S,) or (B, S) -> RotaryAngles for those positions."""
        if positions.dim() == 1:
            positions = positions.unsqueeze(0)
        return RotaryAngles(self.cos_full[positions].unsqueeze(2), self.sin_signed[positions].unsqueeze(2))

    def prefix(self, seq_len: int) -> RotaryAngles:
        """Angles of positions 0..seq_len-1, shaped (1, S, 1, head_dim)."""
        if seq_len > self.cos.shape[0]:
            raise ValueError(f"sequence length {seq_len} is beyond max_seq_len {self.cos.shape[0]}")
        return RotaryAngles(self.cos_full[:seq_len].view(1, seq_len, 1, -1), self.sin_signed[:seq_len].view(1, seq_len, 1, -1))


def apply_rotary(x: Tensor, angles: RotaryAngles) -> Tensor:
    """x (B, S, ..., hd) rotated pairwise (first half, second half) by the angles of its tokens.

    Any dims between S and hd (heads; or q/k and heads) share a token's angles, so q and k
    are rotated together in one pass. Computed in float32 or wider (bf16 inputs are
    promoted by the multiply itself), returned in x's dtype.
    """
    half = x.shape[-1] // 2
    shape = (angles.cos_full.shape[0], x.shape[1]) + (1,) * (x.dim() - 3) + (x.shape[-1],)
    cos, sin = angles.cos_full.view(shape), angles.sin_signed.view(shape)
    rotate_half = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # (x2, x1)
    return (x * cos + rotate_half * sin).to(x.dtype)


def rotate_(x: Tensor, angles: RotaryAngles) -> None:
    """x (N, S, heads, hd), the query and key heads of a fused projection: rotated in place with
    apply_rotary's arithmetic (x * cos + rotate_half(x) * sin, in float32 or wider), cast once
    into x's dtype as it is written."""
    half = x.shape[-1] // 2
    shape = (angles.cos_full.shape[0], x.shape[1], 1, x.shape[-1])
    cos, sin = angles.cos_full.view(shape), angles.sin_signed.view(shape)
    if cos.dtype == torch.float32 and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and use_triton(x):
        from mode.kernels.rotary import rotate_in_place

        rotate_in_place(x, cos, sin)  # one kernel for the four below
        return
    rotate_half = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # (x2, x1)
    torch.add(x * cos, rotate_half * sin, out=x)
