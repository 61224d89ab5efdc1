"""Routing primitives: pure tensor functions, written once and used by every routed block.

Conventions: tokens are routed within *groups* (a group is one sequence for MoD, one
sequence or a few sequences for expert-choice MoE). `x` is (G, T, D): G groups of T tokens.
Chosen positions are indices into T, kept sorted so a chosen subsequence stays causal.
"""
from __future__ import annotations

import torch
from torch import Tensor


def capacity_to_k(num_tokens: int, capacity: float) -> int:
    """Tokens a block (or expert) takes from a group of num_tokens: round(capacity * T), >= 1."""
    if not 0.0 < capacity:
        raise ValueError(f"capacity must be positive, got {capacity}")
    return max(1, min(num_tokens, int(round(capacity * num_tokens))))


def top_k_positions(scores: Tensor, k: int) -> Tensor:
    """Expert choice: indices of the k largest scores along the last (token) dim, sorted by position.

    scores (..., T) -> (..., k). Top-k runs within each row only (a sequence or a group),
    never across the batch, so one sequence cannot change another's routing.
    """
    chosen = scores.topk(k, dim=-1, sorted=False).indices
    return chosen.sort(dim=-1).values


def _flat_indices(indices: Tensor, tokens_per_group: int) -> Tensor:
    """(G, ..., k) positions within each group -> positions in the flattened (G*T) token axis."""
    groups = indices.shape[0]
    offsets = torch.arange(groups, device=indices.device) * tokens_per_group  # (G,)
    return (indices + offsets.view(groups, *([1] * (indices.dim() - 1)))).reshape(-1)


def gather_tokens(x: Tensor, indices: Tensor) -> Tensor:
    """x (G, T, D), indices (G, ..., k) -> the chosen tokens (G, ..., k, D)."""
    groups, tokens, width = x.shape
    flat = _flat_indices(indices, tokens)
    return x.reshape(groups * tokens, width).index_select(0, flat).view(*indices.shape, width)


def scatter_add_tokens(x: Tensor, indices: Tensor, updates: Tensor) -> Tensor:
    """Return x with updates (G, ..., k, D) added at indices (G, ..., k); other tokens bit-identical.

    Several updates for one token (a token chosen by several experts) are summed.
    """
    groups, tokens, width = x.shape
    flat = _flat_indices(indices, tokens)
    out = x.reshape(groups * tokens, width).index_add(0, flat, updates.reshape(-1, width).to(x.dtype))
    return out.view(groups, tokens, width)


def apply_gate(scores: Tensor, kind: str) -> Tensor:
    """g(r): the paper multiplies the update by the raw router score; sigmoid keeps it bounded."""
    if kind == "identity":
        return scores
    if kind == "sigmoid":
        return torch.sigmoid(scores)
    raise ValueError(f"unknown gate function {kind!r} (expected 'identity' or 'sigmoid')")


def token_mask(indices: Tensor, tokens_per_group: int) -> Tensor:
    """(G, k) chosen positions -> (G, T) boolean mask of chosen tokens."""
    mask = torch.zeros(indices.shape[0], tokens_per_group, dtype=torch.bool, device=indices.device)
    return mask.scatter_(1, indices, True)
