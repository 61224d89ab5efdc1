"""Router modules: a learned linear score per slot, turned into a Routing by a primitive."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from mode.routing.primitives import apply_gate, capacity_to_k, top_k_positions


@dataclass
class Routing:
    """What a routed block consumes: who is processed, with which gate weight, and the losses.

    indices: positions chosen within each group, sorted: (G, k) for a depth router,
             (G, E, C) for expert choice over E experts.
    gates:   g(r) for each chosen position, same shape as indices (float32).
    logits:  the raw router scores for every token, (G, T) or (G, T, n_slots), float32;
             kept for auxiliary losses and statistics.
    aux_loss: scalar auxiliary loss this routing adds to the objective (0 when none).
    """

    indices: Tensor
    gates: Tensor
    logits: Tensor
    aux_loss: Tensor
    stats: dict[str, Tensor] = field(default_factory=dict)


class Router(nn.Module):
    """r = w^T x: one linear projection D -> n_slots, computed in float32 for stable top-k."""

    def __init__(self, d_model: int, n_slots: int = 1, bias: bool = False) -> None:
        super().__init__()
        self.proj = nn.Linear(d_model, n_slots, bias=bias)
        self.n_slots = n_slots

    def forward(self, x: Tensor) -> Tensor:
        """x (G, T, D) -> scores (G, T, n_slots), float32 whatever the autocast dtype."""
        with torch.autocast(device_type=x.device.type, enabled=False):
            bias = None if self.proj.bias is None else self.proj.bias.float()
            return nn.functional.linear(x.float(), self.proj.weight.float(), bias)


class DepthRouter(nn.Module):
    """Mixture-of-Depths router: per sequence, the top-k tokens by score go through the block."""

    def __init__(self, d_model: int, capacity: float, gate: str, random: bool, bias: bool = False) -> None:
        super().__init__()
        self.router = Router(d_model, 1, bias)
        self.capacity = capacity
        self.gate = gate
        self.random = random

    def forward(self, x: Tensor) -> Routing:
        scores = self.router(x).squeeze(-1)  # (B, S)
        k = capacity_to_k(x.shape[1], self.capacity)
        # The stochastic-routing ablation changes only *which* tokens are chosen; the gate
        # still comes from the learned score, so learned vs random differs in one thing.
        selection = torch.rand_like(scores) if self.random else scores
        indices = top_k_positions(selection.detach(), k)  # (B, k)
        gates = apply_gate(scores.gather(1, indices), self.gate)  # (B, k)
        return Routing(indices=indices, gates=gates, logits=scores, aux_loss=scores.new_zeros(()))
