"""Router primitives shared by every routed block (MoD, MoE, Staged and Integrated MoDE)."""
from mode.routing.primitives import (
    apply_gate,
    capacity_to_k,
    gather_tokens,
    scatter_add_tokens,
    token_mask,
    top_k_positions,
)
from mode.routing.router import DepthRouter, Router, Routing

__all__ = [
    "DepthRouter",
    "Router",
    "Routing",
    "apply_gate",
    "capacity_to_k",
    "gather_tokens",
    "scatter_add_tokens",
    "token_mask",
    "top_k_positions",
]
