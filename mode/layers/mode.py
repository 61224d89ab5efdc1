"""Mixture-of-Depths-and-Experts (Raposo et al. 2024, section 3.6, figure 7).

Both variants are compositions of existing pieces:
- Staged MoDE: an MoD block whose inner transformer block has an MoE FFN. The depth router
  chooses X~; X~ goes through attention, then the MoE; x_i <- x_i + g(r_i) * f_i(X~).
- Integrated MoDE: a transformer block (attention over all tokens) whose MoE FFN routes
  among E real and N no-op experts; a token sent to a no-op expert rides the residual.
"""
from __future__ import annotations

from mode.config import ModelConfig, MoEConfig, RoutingConfig
from mode.layers.block import TransformerBlock
from mode.layers.mod import MoDBlock
from mode.layers.moe import MoEFFN


class StagedMoDEBlock(MoDBlock):
    """MoD routing around a block with an MoE FFN; reports both routings."""

    def __init__(self, cfg: ModelConfig, routing: RoutingConfig, moe: MoEConfig) -> None:
        super().__init__(cfg, routing, block=TransformerBlock(cfg, ffn=MoEFFN(cfg.d_model, cfg.d_ff, moe, routing)))


class IntegratedMoDEBlock(TransformerBlock):
    """Attention over all tokens; the FFN an MoE over E real + moe.n_noop no-op experts.

    With n_noop = 0 it is exactly the MoE block (an ablation identity the tests check);
    the config requires n_noop > 0 for block kind mode_integrated.
    """

    def __init__(self, cfg: ModelConfig, moe: MoEConfig, routing: RoutingConfig | None = None) -> None:
        super().__init__(cfg, ffn=MoEFFN(cfg.d_model, cfg.d_ff, moe, routing))
