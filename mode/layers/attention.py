"""Causal multi-head self-attention with rotary embeddings, optionally grouped-query.

The fused projection qkv holds H query heads, then Hkv key heads, then Hkv value heads, each
head_dim wide: (H + 2 * Hkv) * head_dim outputs. With Hkv = H this is the [q | k | v] layout of
plain multi-head attention, viewable as (3, H, head_dim).
"""
from __future__ import annotations

import contextlib
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mode.kernels import use_triton
from mode.layers.rotary import RotaryAngles, apply_rotary

# train.attention_backend -> the SDPA kernels allowed; None: PyTorch's own choice among all of them.
ATTENTION_BACKENDS: dict[str, SDPBackend | None] = {
    "auto": None,
    "flash": SDPBackend.FLASH_ATTENTION,
    "cudnn": SDPBackend.CUDNN_ATTENTION,
    "efficient": SDPBackend.EFFICIENT_ATTENTION,
    "math": SDPBackend.MATH,
}


def sdpa_backend(name: str) -> SDPBackend | None:
    """An attention backend's name (ATTENTION_BACKENDS) -> its SDPA kernel; None for auto."""
    if name not in ATTENTION_BACKENDS:
        raise ValueError(f"unknown attention backend {name!r} (expected one of {', '.join(ATTENTION_BACKENDS)})")
    return ATTENTION_BACKENDS[name]


def expand_kv(t: Tensor, groups: int, dim: int = 1) -> Tensor:
    """Key or value heads repeated for the query heads they serve (head j for queries j * groups
    .. (j + 1) * groups - 1); t itself without grouping. A copy, so that every SDPA backend,
    masked ones included, takes them."""
    return t if groups == 1 else t.repeat_interleave(groups, dim=dim)


class CausalSelfAttention(nn.Module):
    """backend (ATTENTION_BACKENDS): the SDPA kernel forward() runs; auto lets PyTorch choose. A
    named kernel that cannot run a call is an error there, never a silent fallback."""

    def __init__(self, d_model: int, n_heads: int, n_kv_heads: int | None = None, head_dim: int | None = None,
                 qkv_bias: bool = False, backend: str = "auto") -> None:
        super().__init__()
        self.backend = sdpa_backend(backend)
        self.n_heads = n_heads
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.head_dim = d_model // n_heads if head_dim is None else head_dim
        self.groups = n_heads // self.n_kv_heads
        self.qkv = nn.Linear(d_model, (n_heads + 2 * self.n_kv_heads) * self.head_dim, bias=qkv_bias)
        self.out = nn.Linear(n_heads * self.head_dim, d_model, bias=False)

    def forward(self, x: Tensor, angles: RotaryAngles) -> Tensor:
        """x (B, S, D) in causal order; angles hold each token's (original) position."""
        batch, seq, _ = x.shape
        qkv = self.qkv(x).view(batch, seq, -1, self.head_dim)  # (B, S, H + 2Hkv, hd)
        q, k, v = self._rotate(qkv, angles)  # (B, S, H, hd), (B, S, Hkv, hd) x 2
        with self._kernel():
            y = F.scaled_dot_product_attention(
                q.transpose(1, 2), expand_kv(k.transpose(1, 2), self.groups), expand_kv(v.transpose(1, 2), self.groups),
                is_causal=True,
            )  # (B, H, S, hd)
        return self.out(y.transpose(1, 2).reshape(batch, seq, -1))  # (B, S, D)

    def _kernel(self) -> contextlib.AbstractContextManager:
        # Entered inside forward, so that torch.compile traces the choice and CUDA graphs capture it.
        return contextlib.nullcontext() if self.backend is None else sdpa_kernel([self.backend])

    def forward_cached(self, x: Tensor, rows) -> Tensor:
        """x (n, K, D): the tokens a layer computes in a chunk (mode/layers/chunks.py), normed ->
        attention output (n, K, D) over the layer's cache and themselves. rows (a row plan) holds
        their angles, writes their keys and values into the cache and attends."""
        n, tokens, _ = x.shape
        qkv = self.qkv(x).view(n, tokens, -1, self.head_dim)  # (n, K, H + 2Hkv, hd)
        y = rows.attend_projected(qkv, self.n_heads)  # (n, K, H, hd)
        return self.out(y.reshape(n, tokens, -1))

    def _rotate(self, qkv: Tensor, angles: RotaryAngles) -> tuple[Tensor, Tensor, Tensor]:
        """qkv (B, S, H + 2Hkv, hd) -> q, k rotated (together) and v. Eager on CUDA without
        grouping: one Triton kernel each way (mode/kernels/rotary.py); otherwise PyTorch ops,
        which torch.compile fuses."""
        heads, kv_heads = self.n_heads, self.n_kv_heads
        if kv_heads == heads and use_triton(qkv):
            from mode.kernels.rotary import rotary_qkv

            batch, seq = qkv.shape[:2]
            return rotary_qkv(qkv.view(batch, seq, 3, heads, self.head_dim), angles.cos_full, angles.sin_signed)
        q, k = apply_rotary(qkv[:, :, : heads + kv_heads], angles).split((heads, kv_heads), dim=2)
        return q, k, qkv[:, :, heads + kv_heads:]


def set_attention_backend(model: nn.Module, name: str) -> int:
    """Make every CausalSelfAttention of model run the SDPA kernel `name` (ATTENTION_BACKENDS) in its
    forward; returns how many there are. Cached decoding (forward_cached) keeps its own kernels."""
    backend = sdpa_backend(name)
    layers = [m for m in model.modules() if isinstance(m, CausalSelfAttention)]
    for layer in layers:
        layer.backend = backend
    return len(layers)


def attention_backend_problem(name: str, device: torch.device, head_dim: int, dtype: torch.dtype) -> str | None:
    """Why the SDPA kernel `name` cannot run this model's causal attention (forward and backward of
    heads head_dim wide, in dtype, on device), in words; None where it can, and for auto. Probed on
    a small batch, where a kernel's limits on head width, dtype and GPU show; PyTorch's warnings
    give the reason."""
    backend = sdpa_backend(name)
    if backend is None:
        return None
    if device.type != "cuda" and backend in (SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION):
        return f"the {name} kernel needs a CUDA device (this run computes on {device})"
    # Zeros: the probe draws nothing from the run's random generators.
    q = torch.zeros(1, 2, 16, head_dim, device=device, dtype=dtype, requires_grad=True)  # (B, H, S, hd)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with sdpa_kernel([backend]):
                F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        except RuntimeError as e:
            reasons = dict.fromkeys(" ".join(str(w.message).split()) for w in caught) or [str(e).splitlines()[0]]
            return (f"the {name} kernel cannot run on {device} ({str(dtype).removeprefix('torch.')}, "
                    f"head width {head_dim}): {' '.join(reasons)}")
    return None
