"""Causal multi-head self-attention with rotary embeddings."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from mode.kernels import use_triton
from mode.layers.rotary import RotaryAngles, apply_rotary, rotate_qk_


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model: int, n_heads: int) -> None:
        super().__init__()
        self.n_heads = n_heads
        self.head_dim = d_model // n_heads
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=False)
        self.out = nn.Linear(d_model, d_model, bias=False)

    def forward(self, x: Tensor, angles: RotaryAngles) -> Tensor:
        """x (B, S, D) in causal order; angles hold each token's (original) position."""
        batch, seq, width = x.shape
        qkv = self.qkv(x).view(batch, seq, 3, self.n_heads, self.head_dim)  # (B, S, 3, H, hd)
        q, k, v = self._rotate(qkv, angles)  # 3 x (B, S, H, hd)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )  # (B, H, S, hd)
        return self.out(y.transpose(1, 2).reshape(batch, seq, width))  # (B, S, D)

    def forward_cached(self, x: Tensor, rows) -> Tensor:
        """x (n, K, D): the tokens a layer computes in a chunk (mode/layers/chunks.py), normed ->
        attention output (n, K, D) over the layer's cache and themselves. rows (a row plan) holds
        their angles, writes their keys and values into the cache and attends."""
        n, tokens, width = x.shape
        qkv = self.qkv(x).view(n, tokens, 3, self.n_heads, self.head_dim)  # (n, K, 3, H, hd)
        rotate_qk_(qkv, rows.angles)
        y = rows.attend(qkv)  # (n, K, H, hd)
        return self.out(y.reshape(n, tokens, width))

    @staticmethod
    def _rotate(qkv: Tensor, angles: RotaryAngles) -> tuple[Tensor, Tensor, Tensor]:
        """qkv (B, S, 3, H, hd) -> q, k rotated (together) and v. Eager on CUDA: one Triton kernel
        each way (mode/kernels/rotary.py); otherwise PyTorch ops, which torch.compile fuses."""
        if use_triton(qkv):
            from mode.kernels.rotary import rotary_qkv

            return rotary_qkv(qkv, angles.cos_full, angles.sin_signed)
        q, k = apply_rotary(qkv[:, :, :2], angles).unbind(2)  # 2 x (B, S, H, hd)
        return q, k, qkv[:, :, 2]
