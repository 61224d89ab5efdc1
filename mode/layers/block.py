"""The dense pre-norm transformer block, and the update f(x) that routed blocks reuse."""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from mode.config import ModelConfig
from mode.layers.attention import CausalSelfAttention
from mode.layers.mlp import SwiGLU
from mode.layers.rotary import RotaryAngles
from mode.routing import Routing


@dataclass
class BlockInfo:
    """What a block reports besides its output: its routing (None for dense) and aux loss."""

    routing: Routing | None = None


class TransformerBlock(nn.Module):
    """h = x + Attn(norm(x)); out = h + FFN(norm(h))."""

    def __init__(self, cfg: ModelConfig, ffn: nn.Module | None = None) -> None:
        super().__init__()
        self.attn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads)
        self.ffn_norm = nn.RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.ffn = ffn if ffn is not None else SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(self, x: Tensor, angles: RotaryAngles) -> tuple[Tensor, BlockInfo]:
        h = x + self.attn(self.attn_norm(x), angles)
        return h + self.ffn(self.ffn_norm(h)), BlockInfo()

    def update(self, x: Tensor, angles: RotaryAngles) -> Tensor:
        """f(x) = out - x, computed without the subtraction: Attn(...) + FFN(...)."""
        a = self.attn(self.attn_norm(x), angles)
        return a + self.ffn(self.ffn_norm(x + a))
