"""The learned router score (Router) and the Mixture-of-Depths router built on it (DepthRouter)."""
from __future__ import annotations

import re
from typing import Sequence

import torch
from torch import Tensor, nn

from mode.routing.causal import CausalDecision, untrained_for_sampling
from mode.routing.depth import route_tokens
from mode.routing.moves import split_tokens
from mode.routing.results import DepthRouting, RoutedTokens
from mode.routing.scores import apply_gate, random_scores, router_scores
from mode.routing.selection import capacity_to_k, token_mask, top_k_positions


class Router(nn.Module):
    """r = w^T x: one linear projection D -> n_slots, computed in float32 for stable top-k."""

    def __init__(self, d_model: int, n_slots: int = 1, bias: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, n_slots, bias=bias)
        self.n_slots = n_slots

    def forward(self, x: Tensor) -> Tensor:
        """x (G, T, D) -> scores (G, T, n_slots), float32 whatever the autocast dtype."""
        return router_scores(x, self.proj.weight, self.proj.bias)


class DepthRouter(nn.Module):
    """Mixture-of-Depths router: per sequence, the top-k tokens by score go through the block.

    With a causal decision (routing.causal != none) it also trains that decision (its BCE in
    aux_loss, its accuracy in stats). Called with causal=True (LanguageModel's
    routing_mode="causal"), it routes by the causal decision instead of top-k: a variable
    number of tokens per sequence, padded to the batch maximum (see `causal_routing`).
    """

    def __init__(
        self,
        d_model: int,
        capacity: float,
        gate: str,
        random: bool,
        bias: bool = False,
        causal: str = "none",
        causal_loss_weight: float = 0.01,
        predictor_hidden: int = 128,
        random_rows: tuple[int, int] = (0, 1),
    ) -> None:
        super().__init__()
        self.router = Router(d_model, 1, bias)
        # Kept as text: torch.compile holds a str attribute constant (a guard, a recompile for another
        # value), where a float becomes a symbol once a second value is compiled in the process
        # (automatic dynamic), and a size derived from a float symbol cannot enter the depth router's
        # split, an autograd function (torch 2.11 and 2.13 fail compiling it).
        self._capacity = repr(float(capacity))
        self.gate = gate
        self.random = random
        self.set_random_rows(*random_rows)
        self.causal = None if causal == "none" else CausalDecision(causal, d_model, 1, causal_loss_weight, predictor_hidden)

    @property
    def capacity(self) -> float:
        """Share of each sequence's tokens through the block."""
        return float(self._capacity)

    def set_capacity(self, capacity: float) -> None:
        """Route another share from the next forward on (routing.capacity_schedule)."""
        if not 0.0 < capacity <= 1.0:
            raise ValueError(f"capacity {capacity} is outside (0, 1]")
        self._capacity = repr(float(capacity))

    def set_random_rows(self, rank: int, world: int) -> None:
        """The data-parallel split the random-routing ablation draws for: this process's rank of
        `world` (random_scores); (0, 1) for one process."""
        if not 0 <= rank < world:
            raise ValueError(f"random routing rows: rank {rank} of {world} processes")
        self.random_rows = (rank, world)

    def decide(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Causal decision: x (B, S, D) -> (chosen (B, S) bool, router scores (B, S) float32)."""
        if self.causal is None:
            raise untrained_for_sampling("top-k over the whole sequence")
        scores = self.router(x).squeeze(-1)
        return self.causal.logits(x, scores.unsqueeze(-1)).squeeze(-1) > 0, scores

    def forward(self, x: Tensor, causal: bool = False) -> DepthRouting:
        if causal:
            return self.causal_routing(x)
        scores = self.router(x).squeeze(-1)  # (B, S)
        positions = self._select(scores)
        gates = apply_gate(scores.gather(1, positions), self.gate)  # (B, k)
        aux, stats = self._causal_terms(x, scores, positions)
        return DepthRouting(positions=positions, gates=gates, logits=scores, aux_loss=aux, stats=stats)

    def route(self, x: Tensor, owns_gradient: bool = False, causal: bool = False) -> RoutedTokens:
        """forward(), the chosen tokens (B, k, D) of x and x itself, from split_tokens: what MoDBlock
        consumes (the updates go back into the residual with scatter_add_tokens).

        The loss sees a token's score only through its gate, unless the causal decision is the
        router's own logit (causal=aux_loss: a BCE over every token). Otherwise, with autograd
        on, the scores' gradient flows through the chosen tokens' gates alone (route_tokens):
        the router's backward reads and writes k rows instead of the whole (B, S, D) residual
        (per routed block a weight-gradient GEMV, an outer product and a sum into x's gradient).
        owns_gradient: nothing but the caller holds the gradient that will reach the residual
        (LanguageModel's stream); the chosen tokens' gradient is then added into it in place.
        """
        dense_grad = self.causal is not None and self.causal.method == "aux_loss"
        if causal or dense_grad or not torch.is_grad_enabled():
            routing = self(x, causal)  # its scores' backward needs x: the residual is not writable
            return RoutedTokens(routing, *split_tokens(x, routing.positions), residual_writable=False)
        k = capacity_to_k(x.shape[1], self.capacity)
        proj = self.router.proj
        # owns_gradient: the caller's residual gradient is its own (split_tokens' grad_in_place)
        route = route_tokens(x, proj.weight, proj.bias, k, self.gate, self.random, owns_gradient, self.random_rows)
        aux, stats = self._causal_terms(x, route.scores, route.positions)  # a causal predictor saves x for its backward
        routing = DepthRouting(positions=route.positions, gates=route.gates, logits=route.scores, aux_loss=aux, stats=stats)
        return RoutedTokens(routing, route.chosen, route.residual, self.causal is None, route.flat)

    def _select(self, scores: Tensor) -> Tensor:
        """(B, S) scores -> (B, k) chosen positions, sorted."""
        k = capacity_to_k(scores.shape[1], self.capacity)
        # The stochastic-routing ablation changes only *which* tokens are chosen; the gate
        # still comes from the learned score, so learned vs random differs in one thing.
        selection = random_scores(scores, self.random_rows) if self.random else scores
        return top_k_positions(selection.detach(), k)

    def _causal_terms(self, x: Tensor, scores: Tensor, positions: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """The causal decision's BCE towards top-k membership and its stats (zero and {} without one)."""
        if self.causal is None:
            return scores.new_zeros(()), {}
        member = token_mask(positions, x.shape[1])  # (B, S): the top-k targets
        return self.causal.loss_and_stats(self.causal.logits(x, scores.unsqueeze(-1)).squeeze(-1), member)

    def causal_routing(self, x: Tensor, eligible: Tensor | None = None) -> DepthRouting:
        """Route by the causal decision: positions (B, K), K = the most tokens any sequence chose (>= 1).

        Each row holds its chosen positions in order, then padding: the row's first unchosen
        positions, with gate 0. Padding sits after every chosen token, so under causal
        attention no chosen token sees it, and its zero-gated update leaves it unchanged.
        eligible (B, S) bool: the tokens that may be chosen (a nested router's: those the previous
        one really chose); None: all.
        """
        chosen, scores = self.decide(x)  # (B, S) each
        if eligible is not None:
            chosen = chosen & eligible
        seq = x.shape[1]
        positions = torch.arange(seq, device=x.device)
        order = torch.where(chosen, positions, positions + seq).argsort(dim=1)  # chosen first, in order
        width = max(1, int(chosen.sum(1).max()))  # data-dependent: one host sync
        positions = order[:, :width]  # (B, K)
        valid = chosen.gather(1, positions)
        gates = torch.where(valid, apply_gate(scores.gather(1, positions), self.gate), 0.0)
        stats = {"processed": chosen.float().mean()}
        return DepthRouting(positions=positions, gates=gates, logits=scores, aux_loss=scores.new_zeros(()), stats=stats,
                            valid=valid)


def set_random_score_rows(model: nn.Module, rank: int, world: int) -> int:
    """Give every depth router of `model` this process's rank of `world` data-parallel processes,
    for the random-routing ablation (DepthRouter.set_random_rows); returns how many it set."""
    routers = [m for m in model.modules() if isinstance(m, DepthRouter)]
    for router in routers:
        router.set_random_rows(rank, world)
    return len(routers)


_BLOCK = re.compile(r"(?:^|\.)blocks\.(\d+)\.")


def set_depth_capacities(model: nn.Module, capacities: Sequence[float]) -> int:
    """Set every depth router of `model` to its block's capacity, capacities[i] for the routers
    under blocks.i (routing.capacity_schedule; RoutingConfig.layer_capacities gives one per layer);
    returns how many it set."""
    count = 0
    for name, module in model.named_modules():
        if isinstance(module, DepthRouter):
            match = _BLOCK.search(name)
            if match is None:
                raise ValueError(f"depth router {name!r} is not under a model's blocks.<i>")
            module.set_capacity(capacities[int(match.group(1))])
            count += 1
    return count
