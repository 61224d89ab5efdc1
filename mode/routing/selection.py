"""Which tokens a router chooses: capacity -> k, top-k positions per group (expert choice),
top-k slots per token (token choice), and the small index helpers they share.

Tokens are routed within *groups* (a sequence for MoD, one or a few sequences for expert-choice
MoE); scores are (G, T). Chosen positions are indices into T, kept sorted so a chosen
subsequence stays causal.
"""
from __future__ import annotations

import math

import torch
from torch import Tensor

from mode.kernels import use_triton

# Decimals kept of a product like cf / slots * T before it is rounded to a whole number of tokens:
# enough for any real capacity, and it removes float error (1.5 / 11 * 55 = 7.4999999999999991).
CAPACITY_DECIMALS = 9


def capacity_to_k(num_tokens: int, capacity: float) -> int:
    """Tokens a block (or expert) takes from a group of num_tokens: capacity * T rounded to the
    nearest whole token, halves up (0.125 * 20 = 2.5 takes 3), between 1 and T."""
    if not 0.0 < capacity:
        raise ValueError(f"capacity must be positive, got {capacity}")
    return max(1, min(num_tokens, math.floor(round(capacity * num_tokens, CAPACITY_DECIMALS) + 0.5)))


def compiled_on_cuda(scores: Tensor) -> bool:
    """torch.compile on CUDA keeps torch.topk, whose choice among exactly equal scores is its own:
    the stable sort that breaks ties as the kernels do costs time there, and compiled and eager
    runs round differently anyway."""
    return scores.is_cuda and torch.compiler.is_compiling()


def topk_kernel_applies(scores: Tensor) -> bool:
    """Eager on CUDA, float32 rows that fit one Triton program: mode/kernels/topk.py."""
    if not use_triton(scores, "topk"):
        return False
    from mode.kernels.topk import fits

    return fits(scores)


def top_k_positions(scores: Tensor, k: int) -> Tensor:
    """Expert choice: indices of the k largest scores along the last (token) dim, sorted by position.

    scores (..., T) -> (..., k). Top-k runs within each row only (a sequence or a group),
    never across the batch, so one sequence cannot change another's routing.
    """
    if topk_kernel_applies(scores):
        from mode.kernels.topk import top_k_positions as one_kernel

        return one_kernel(scores, k)
    if compiled_on_cuda(scores):
        chosen = scores.topk(k, dim=-1, sorted=False).indices
    else:
        # Equal scores go to the earliest positions, as the kernel breaks ties: a stable sort, not
        # topk, whose choice among equal scores is unspecified (on CPU it took the last ones; equal
        # tokens score alike before any attention, so a routed first block meets ties).
        chosen = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    # Sorted as int32 (positions < 2^31): faster than int64 keys.
    return chosen.int().sort(dim=-1).values.long()


def top_k_flat(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """scores (G, T) -> (top_k_positions(scores, k) (G, k), the same positions in the flattened
    (G*T) axis (G*k,)): the Triton kernel writes both at once (no arange and add on the host)."""
    if topk_kernel_applies(scores):
        from mode.kernels.topk import top_k_positions as one_kernel

        return one_kernel(scores, k, flat=True)
    indices = top_k_positions(scores, k)
    return indices, flat_indices(indices, scores.shape[-1])


def flat_indices(indices: Tensor, tokens_per_group: int) -> Tensor:
    """(G, ..., k) positions within each group -> positions in the flattened (G*T) token axis."""
    groups = indices.shape[0]
    if groups == 1:  # one group (MoE layers route the flattened batch): positions already flat
        return indices.reshape(-1)
    offsets = torch.arange(0, groups * tokens_per_group, tokens_per_group, device=indices.device)  # (G,)
    return (indices + offsets.view(groups, *([1] * (indices.dim() - 1)))).reshape(-1)


def token_mask(indices: Tensor, tokens_per_group: int) -> Tensor:
    """(G, k) chosen positions -> (G, T) boolean mask of chosen tokens."""
    mask = torch.zeros(indices.shape[0], tokens_per_group, dtype=torch.bool, device=indices.device)
    return mask.scatter_(1, indices, True)


def top_k_slots(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Token choice: the k largest scores over the last (slot) dim, and their slots: 2 x (..., k)."""
    if k == 1:  # a max reduction: several times faster than top-k
        values, slots = scores.max(dim=-1, keepdim=True)  # the first maximum: the lowest slot
        return values, slots
    if compiled_on_cuda(scores):
        return scores.topk(k, dim=-1)
    # Equal scores go to the lowest slots, as torch.max and the kernel break ties (topk's choice
    # among them is unspecified): a stable sort of the few slots.
    values, slots = scores.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], slots[..., :k]


def count_ids(ids: Tensor, n: int) -> Tensor:
    """How often each of 0..n-1 occurs in ids: (n,) int64. bincount with a static shape (ids < n).

    torch.bincount's output size depends on the data, which splits a torch.compile graph (and
    its CUDA graphs) in two; here the size is n whatever the ids.
    """
    flat = ids.reshape(-1)
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))
