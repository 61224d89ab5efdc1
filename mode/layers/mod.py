"""Mixture-of-Depths block (Raposo et al. 2024, section 3).

x_i <- x_i + g(r_i) * f_i(X~) for the k chosen tokens of each sequence, x_i unchanged otherwise.
"""
from __future__ import annotations

from torch import Tensor, nn

from mode.config import ModelConfig, RoutingConfig
from mode.layers.block import BlockInfo, TransformerBlock
from mode.layers.rotary import RotaryAngles
from mode.routing import DepthRouter, add_gated_tokens


class MoDBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, routing: RoutingConfig, block: TransformerBlock | None = None) -> None:
        super().__init__()
        self.router = DepthRouter(
            cfg.d_model, routing.capacity, routing.gate, routing.random, routing.router_bias,
            routing.causal, routing.causal_loss_weight, routing.predictor_hidden,
        )
        self.block = block if block is not None else TransformerBlock(cfg)

    def forward(
        self, x: Tensor, angles: RotaryAngles, causal: bool | None = None, residual_owned: bool = False,
    ) -> tuple[Tensor, BlockInfo]:
        """x (B, S, D) -> (out (B, S, D), BlockInfo). causal: route by the causal decision (None:
        the router's own setting). residual_owned: the caller owns x and never reads it again, and
        owns the gradient that reaches the output (LanguageModel's residual stream): the updates
        then go into x's memory when the router allows (no copy of x), and in the backward the
        chosen tokens' gradient into that incoming gradient. False: x is left untouched."""
        # indices (B, k), sorted: causal order kept; chosen (B, k, D); residual: x, for the updates
        routed = self.router.route(x, owns_gradient=residual_owned, causal=causal)
        routing = routed.routing
        # (B, k, D) at the original positions; ffn_routing is the MoE's in Staged MoDE, else None.
        update, ffn_routing = self.block.routed_update(
            routed.chosen, angles.select(routing.indices), routing.valid, causal,
        )
        # The gate scales only the update; the residual of every token passes untouched.
        # (float32 gates times the update promote to the residual stream's precision.)
        in_place = residual_owned and routed.residual_writable
        out = add_gated_tokens(routed.residual, routing.indices, routing.gates, update, in_place, routed.flat)
        return out, BlockInfo(routing=routing, ffn_routing=ffn_routing)
