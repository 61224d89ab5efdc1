"""Mixture-of-Recursions block (Bae et al. 2025, expert-choice routing).

One weight-tied TransformerBlock applied up to R times, an expert-choice depth router before each
recursion. Recursion 0's router chooses among every token of a sequence; recursion r's among the
tokens recursion r-1 chose (nested top-k). Each recursion updates its chosen tokens as a
Mixture-of-Depths layer does, x_i <- x_i + g(r_i) * f(x_i), at their original positions; a token
a recursion leaves out keeps its state through every later recursion.
"""
from __future__ import annotations

from typing import Sequence

from torch import Tensor, nn

from mode.config import ModelConfig, MoRConfig, RoutingConfig
from mode.layers.block import BlockInfo, TransformerBlock
from mode.layers.kv_cache import LayerCache
from mode.layers.mod import decide, router_snapshot
from mode.layers.rotary import RotaryAngles
from mode.routing import DepthRouter, DepthRouting, add_gated_tokens, gather_tokens


class MoRBlock(nn.Module):
    """The shared block (self.block) and one DepthRouter per recursion (self.routers); its KV
    caches for decoding are one per recursion (forward_cached takes the list)."""

    def __init__(self, cfg: ModelConfig, routing: RoutingConfig, mor: MoRConfig) -> None:
        super().__init__()
        self.block = TransformerBlock(cfg)
        self.routers = nn.ModuleList(
            DepthRouter(cfg.d_model, capacity, routing.gate, routing.random, routing.router_bias,
                        routing.causal, routing.causal_loss_weight, routing.predictor_hidden)
            for capacity in mor.router_capacities()
        )

    @property
    def recursions(self) -> int:
        """R, and the number of KV caches the block decodes with."""
        return len(self.routers)

    def forward(
        self, x: Tensor, angles: RotaryAngles, causal: bool = False, residual_owned: bool = False,
    ) -> tuple[Tensor, BlockInfo]:
        """x (B, S, D) -> (out (B, S, D), BlockInfo). causal: every recursion routes by its causal
        decision. residual_owned as MoDBlock's: recursion 0 may add into x's memory; later
        recursions add into the block's own output. BlockInfo.routing is recursion 0's routing,
        with the aux losses of every recursion and each later one's stats (recursionR.name)."""
        out, routings = self.recursion_routings(x, angles, causal, residual_owned)
        return out, BlockInfo(routing=self._report(routings, x.shape[1]))

    def recursion_routings(
        self, x: Tensor, angles: RotaryAngles, causal: bool = False, residual_owned: bool = False,
    ) -> tuple[Tensor, list[DepthRouting]]:
        """forward's output and every recursion's routing, positions (B, k_r) at the original
        positions of the sequence (causal: padded rows valid False, gate 0)."""
        positions: Tensor | None = None  # (B, k_{r-1}) the active tokens; None: every token
        valid: Tensor | None = None  # (B, k_{r-1}) False on causal routing's padding rows
        routings: list[DepthRouting] = []
        for r, router in enumerate(self.routers):
            if positions is None:  # recursion 0: a mod block's routing of the whole sequence
                routed = router.route(x, owns_gradient=residual_owned, causal=causal)
                local, residual, flat = routed.routing, routed.residual, routed.flat
                in_place = residual_owned and routed.residual_writable
                chosen, positions = routed.chosen, local.positions
            else:
                active = gather_tokens(x, positions)  # (B, k_{r-1}, D) their states now
                if causal:
                    local = router.causal_routing(active, valid)  # padding rows are never chosen
                    chosen = gather_tokens(active, local.positions)  # (B, k_r, D)
                else:
                    routed = router.route(active)
                    local, chosen = routed.routing, routed.chosen
                # x is this block's own output of the previous recursion (or the caller's, owned)
                residual, flat, in_place = x, None, True
                positions = positions.gather(1, local.positions)  # (B, k_r) original positions
            update, _ = self.block.routed_update(chosen, angles.select(positions), local.valid, causal)
            x = add_gated_tokens(residual, positions, local.gates, update, in_place, flat)
            valid = local.valid
            routings.append(DepthRouting(positions=positions, gates=local.gates, logits=local.logits,
                                         aux_loss=local.aux_loss, stats=local.stats, valid=valid))
        return x, routings

    @staticmethod
    def _report(routings: list[DepthRouting], seq_len: int) -> DepthRouting:
        """The one routing a block reports: recursion 0's, carrying every recursion's aux loss
        and the later recursions' stats, each with its share of the sequence processed."""
        first = routings[0]
        stats = dict(first.stats)
        aux = first.aux_loss
        for r, routing in enumerate(routings[1:], start=1):
            aux = aux + routing.aux_loss
            taken = routing.gates.new_ones(routing.gates.shape) if routing.valid is None else routing.valid.float()
            stats[f"recursion{r}.processed"] = taken.sum() / (taken.shape[0] * seq_len)
            for name, value in routing.stats.items():
                if name != "processed":
                    stats[f"recursion{r}.{name}"] = value
        return DepthRouting(positions=first.positions, gates=first.gates, logits=first.logits, aux_loss=aux,
                            stats=stats, valid=first.valid)

    def forward_cached(self, x: Tensor, caches: Sequence[LayerCache], chunk, chosen: Tensor | None = None) -> Tensor:
        """Incremental decoding (see MoDBlock.forward_cached), one cache per recursion: recursion r
        takes the tokens of the chunk x (B, n, D) that recursion r-1 took and its causal decision
        takes (recursion 0: the valid tokens its decision takes, or chosen (B, n), given); they go
        through the shared block against caches[r] and join it. The others keep their state."""
        taken: Tensor | None = None
        for r, (router, cache) in enumerate(zip(self.routers, caches)):
            decided, scores = decide(router, x, cache.router_weights if chunk.fp32_router else None)
            if r == 0:
                taken = decided if chosen is None else chosen
            else:
                taken = taken & decided
            rows = chunk.select(x, cache, taken)
            if rows is None:  # no token goes on: later recursions take none either
                return x
            a, _, out = self.block.cached_parts(rows)
            x = rows.add_scored(x, a, out, scores, router.gate)
        return x

    def router_weights(self) -> list[tuple[Tensor, Tensor | None] | None]:
        """Each recursion's float32 router snapshot for decode steps (router_snapshot)."""
        return [router_snapshot(router) for router in self.routers]
