"""The dense pre-norm transformer block, and the update f(x) that routed blocks reuse."""
from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn

from mode.config import ModelConfig
from mode.layers.attention import CausalSelfAttention
from mode.layers.kv_cache import LayerCache
from mode.layers.mlp import SwiGLU
from mode.layers.moe import MoEFFN
from mode.layers.norm import RMSNorm
from mode.layers.rotary import RotaryAngles
from mode.routing import Routing


@dataclass
class BlockInfo:
    """What a block reports besides its output: the depth routing (MoD, Staged MoDE) and the
    FFN's expert routing (MoE and both MoDE variants); None where a block has none."""

    routing: Routing | None = None
    ffn_routing: Routing | None = None

    def routings(self) -> list[Routing]:
        return [r for r in (self.routing, self.ffn_routing) if r is not None]


class TransformerBlock(nn.Module):
    """h = x + Attn(norm(x)); out = h + FFN(norm(h))."""

    def __init__(self, cfg: ModelConfig, ffn: nn.Module | None = None) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps)
        self.attn = CausalSelfAttention(cfg.d_model, cfg.n_heads, cfg.kv_heads, cfg.head_width, cfg.qkv_bias)
        # An MoE FFN's router reads its input in float32: that norm keeps a float32 output.
        self.ffn_norm = RMSNorm(cfg.d_model, eps=cfg.norm_eps, to_autocast=not isinstance(ffn, MoEFFN))
        self.ffn = ffn if ffn is not None else SwiGLU(cfg.d_model, cfg.d_ff)

    def forward(
        self, x: Tensor, angles: RotaryAngles, causal: bool = False, residual_owned: bool = False,
    ) -> tuple[Tensor, BlockInfo]:
        """x (B, S, D) -> (out (B, S, D), BlockInfo); x is never written (residual_owned is for the
        routed blocks' signature). causal: an MoE FFN routes as sampling does (see MoEFFN)."""
        h, normed = self.ffn_norm.add(x, self.attn(self.attn_norm(x), angles))  # h = x + Attn, norm(h)
        out, ffn_routing = self._ffn(normed, causal=causal)
        return h + out, BlockInfo(ffn_routing=ffn_routing)

    def update(self, x: Tensor, angles: RotaryAngles) -> Tensor:
        """f(x) = out - x, computed without the subtraction: Attn(...) + FFN(...)."""
        return self.routed_update(x, angles)[0]

    def routed_update(
        self, x: Tensor, angles: RotaryAngles, valid: Tensor | None = None, causal: bool = False,
    ) -> tuple[Tensor, Routing | None]:
        """f(x) and the FFN's Routing (None for a dense FFN). valid (B, k): the rows that are
        chosen tokens, where causal routing padded them (an MoE FFN then skips the padding)."""
        a = self.attn(self.attn_norm(x), angles)
        _, normed = self.ffn_norm.add(x, a)
        return self._ffn(normed, valid, causal, residual=a)  # Attn + FFN: an MoE sums its rows into a

    def forward_cached(self, x: Tensor, cache: LayerCache, chunk, chosen: Tensor | None = None) -> Tensor:
        """Incremental decoding: x (B, n, D), a chunk of new tokens (mode/layers/chunks.py: a prefill
        chunk or a decode step) -> their hidden states after the block (B, n, D). The chunk's valid
        tokens (or chosen (B, n), those given) go through the block and join its cache; the rest
        come out unchanged. The FFN routes causally."""
        rows = chunk.select(x, cache, chosen)
        if rows is None:
            return x
        _, h, out = self.cached_parts(rows)
        return rows.put_sum(x, h, out)

    def cached_parts(self, rows) -> tuple[Tensor, Tensor, Tensor]:
        """The block on a row plan's tokens rows.x (n, K, D) against the cache: (Attn(norm(x)),
        h = x + Attn, FFN(norm(h))), each (n, K, D); an MoE FFN skips the plan's padding rows, and in
        a static decode step (rows.static) computes its experts with no host sync."""
        a = self.attn.forward_cached(self.attn_norm(rows.x), rows)
        h, normed = self.ffn_norm.add(rows.x, a)  # h = x + Attn, norm(h)
        out, _ = self._ffn(normed, rows.valid, causal=True, static=rows.static, with_stats=False)
        return a, h, out

    def _ffn(self, x: Tensor, valid: Tensor | None = None, causal: bool = False, static: bool = False,
             with_stats: bool = True, residual: Tensor | None = None) -> tuple[Tensor, Routing | None]:
        """(FFN output, its Routing): a routed FFN (MoEFFN) reports one, a dense one None. static: a
        static decode step's rows (an MoE FFN then routes with no host sync, MoEFFN.forward).
        with_stats: the routing's statistics (the cached passes drop them: nothing reads them there).
        residual: returned plus the output (see MoEFFN.forward)."""
        if isinstance(self.ffn, MoEFFN):
            return self.ffn(x, valid, causal, static, with_stats, residual)
        out = self.ffn(x)
        return (out if residual is None else residual + out), None
