"""Mixture-of-Depths block (Raposo et al. 2024, section 3).

x_i <- x_i + g(r_i) * f_i(X~) for the k chosen tokens of each sequence, x_i unchanged otherwise.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode.config import ModelConfig, RoutingConfig
from mode.kernels import use_triton
from mode.layers.block import BlockInfo, TransformerBlock
from mode.layers.kv_cache import LayerCache
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
        self, x: Tensor, angles: RotaryAngles, causal: bool = False, residual_owned: bool = False,
    ) -> tuple[Tensor, BlockInfo]:
        """x (B, S, D) -> (out (B, S, D), BlockInfo). causal: route by the causal decision.
        residual_owned: the caller owns x and never reads it again, and owns the gradient that
        reaches the output (LanguageModel's residual stream): the updates then go into x's memory
        when the router allows (no copy of x), and in the backward the chosen tokens' gradient
        into that incoming gradient. False: x is left untouched."""
        # positions (B, k), sorted: causal order kept; chosen (B, k, D); residual: x, for the updates
        routed = self.router.route(x, owns_gradient=residual_owned, causal=causal)
        routing = routed.routing
        # (B, k, D) at the original positions; ffn_routing is the MoE's in Staged MoDE, else None.
        update, ffn_routing = self.block.routed_update(
            routed.chosen, angles.select(routing.positions), routing.valid, causal,
        )
        # The gate scales only the update; the residual of every token passes untouched.
        # (float32 gates times the update promote to the residual stream's precision.)
        in_place = residual_owned and routed.residual_writable
        out = add_gated_tokens(routed.residual, routing.positions, routing.gates, update, in_place, routed.flat)
        return out, BlockInfo(routing=routing, ffn_routing=ffn_routing)

    def forward_cached(self, x: Tensor, cache: LayerCache, chunk, chosen: Tensor | None = None) -> Tensor:
        """Incremental decoding (see TransformerBlock.forward_cached): the valid tokens of the chunk
        x (B, n, D) that the causal decision takes (or chosen (B, n), given) go through the block
        and join its cache, x_i + g(r_i) * f_i; every other token comes out unchanged and never
        enters the cache."""
        weights = cache.router_weights if chunk.fp32_router else None
        decision = chunk.decision_in_if(x, weights, self.router.capacity) if chosen is None else None
        if decision is None:
            decided, scores = self.decide(x, weights, chunk.decision_mask)
        else:  # the step's IF-node kernel (captured: in the layer's IF node)
            decided, scores = decision.chosen.view(x.shape[:-1]), decision.scores.view(x.shape[:-1])
        taken = decided if chosen is None else chosen
        return chunk.routed(x, cache, taken, self.router.capacity, lambda rows: self._update(x, rows, scores),
                            decision)

    def _update(self, x: Tensor, rows, scores: Tensor) -> Tensor:
        """x_i + g(r_i) * f_i for the tokens of a row plan (scores: the router's (B, n))."""
        a, _, out = self.block.cached_parts(rows)
        return rows.add_scored(x, a, out, scores, self.router.gate)

    def decide(self, x: Tensor, weights: tuple[Tensor, Tensor | None] | None = None,
               mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The causal decision of this block's router on tokens x (B, n, D): see decide."""
        return decide(self.router, x, weights, mask)

    def router_weights(self) -> tuple[Tensor, Tensor | None] | None:
        """The router's float32 snapshot for decode steps (router_snapshot)."""
        return router_snapshot(self.router)


def decide(router: DepthRouter, x: Tensor, weights: tuple[Tensor, Tensor | None] | None = None,
           mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """A depth router's causal decision on tokens x (B, n, D): (taken (B, n) bool, router scores
    (B, n) float32). weights: the router's float32 snapshot (router_snapshot), used directly outside
    autocast (no cast per call); None: the router and its predictor decide (DepthRouter.decide).
    mask (B * n,) bool: the tokens that may be taken (a decode step's active rows), or None."""
    if weights is None or torch.is_autocast_enabled(x.device.type):
        taken, scores = router.decide(x)
    elif use_triton(x, "decision"):
        from mode.kernels.decision import decide_rows

        return decide_rows(x, *weights, mask)  # one kernel: GEMV, threshold and mask
    else:
        scores = F.linear(x.float(), *weights).squeeze(-1)  # Router.forward with float32 weights
        taken = scores > 0
    return (taken if mask is None else taken & mask.view(taken.shape)), scores


def router_snapshot(router: DepthRouter) -> tuple[Tensor, Tensor | None] | None:
    """A float32 snapshot of a depth router's weights where its own logit decides (causal=aux_loss),
    for decode steps; None where a predictor decides."""
    causal = router.causal
    if causal is None or causal.predictor is not None:
        return None
    proj = router.router.proj
    return proj.weight.detach().float(), None if proj.bias is None else proj.bias.detach().float()
