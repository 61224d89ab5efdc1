"""Token choice: the router head (softmax, top-k slots, auxiliary losses, statistics), the
capacity, each assignment's place in its expert, and the sorted layouts of uneven loads."""
from __future__ import annotations

import math
from typing import NamedTuple

import torch
from torch import Tensor

from mode.kernels import use_triton
from mode.routing.expert_rows import ExpertRows, rows_by_slot, rows_kernel_applies
from mode.routing.selection import CAPACITY_DECIMALS, count_ids, top_k_slots


class TokenChoiceHead(NamedTuple):
    """Token choice's router head over T tokens and S = E + N slots: the routing, its auxiliary
    loss, and the statistics that need no more than per-slot counts."""

    gates: Tensor  # (T, k) float32: the softmax probabilities of the chosen slots, largest first
    slots: Tensor  # (T, k) int64
    aux_loss: Tensor  # () lb_weight * load-balancing loss + z_weight * z-loss, differentiable
    lb_loss: Tensor  # () the Switch load-balancing loss (detached)
    z_loss: Tensor  # () the router z-loss (detached)
    tokens_per_expert: Tensor  # (E,) float32: rows each real expert computes (its first `capacity` choices)
    noop_fraction: Tensor  # () share of the T*k assignments that chose a no-op slot
    dropped_fraction: Tensor  # () share of the T*k assignments dropped over capacity
    computed_fraction: Tensor  # () share of the T*k assignments computed: with k = 1, of the tokens


def softmax_topk_kernel_applies(logits: Tensor, k: int) -> bool:
    if not use_triton(logits, "softmax_topk"):
        return False
    from mode.kernels.softmax_topk import fits

    return fits(logits, k)


def token_choice_head(logits: Tensor, k: int, n_experts: int, capacity: int | None, lb_weight: float,
                      z_weight: float, score: str = "softmax", bias: Tensor | None = None) -> TokenChoiceHead:
    """Token choice: logits (T, S) float32 -> each token's top-k slots of the softmax, the
    weighted auxiliary loss, and the per-slot statistics (an expert computes its first
    `capacity` choices; None: all of them).

    score "sigmoid": each slot's probability is sigmoid(logit) instead (DeepSeek-V3). bias (E,):
    added to the real experts' probabilities for choosing the slots only; the gates stay the
    unbiased probabilities (auxiliary-loss-free balancing).

    The same values either way: PyTorch's softmax, top_k_slots, count_ids,
    load_balancing_loss and router_z_loss (about 40 launches a pass), or (eager, CUDA, softmax
    without a bias) two Triton launches forward and one backward for all of them.
    """
    if score == "softmax" and bias is None and softmax_topk_kernel_applies(logits, k):
        from mode.kernels import softmax_topk as kernel

        gates, slots, aux, summary = kernel.token_choice_head(logits, k, n_experts, capacity, lb_weight, z_weight)
        scalars = summary[2 * logits.shape[1] :]
        return TokenChoiceHead(
            gates, slots, aux, scalars[kernel.LB], scalars[kernel.Z], scalars[kernel.SCALARS :], scalars[kernel.NOOP],
            scalars[kernel.DROPPED], scalars[kernel.PROCESSED_TOP1],
        )
    probs = slot_probabilities(logits, score)  # (T, S)
    if bias is None:
        gates, slots = top_k_slots(probs, k)
    else:
        _, slots = top_k_slots(probs.detach() + bias_over_slots(bias, logits.shape[1]), k)
        gates = probs.gather(1, slots)  # (T, k): the bias chooses, it never scales
    assignments = slots.numel()
    choices = count_ids(slots, logits.shape[1]).float()  # (S,)
    lb, z = load_balancing_loss(probs.mean(0), choices, assignments), router_z_loss(logits)
    chosen = choices[:n_experts]
    computed = chosen if capacity is None else chosen.clamp(max=capacity)
    return TokenChoiceHead(
        gates, slots, lb_weight * lb + z_weight * z, lb.detach(), z.detach(), computed,
        choices[n_experts:].sum() / assignments, (chosen - computed).sum() / assignments, computed.sum() / assignments,
    )


def slot_probabilities(logits: Tensor, score: str) -> Tensor:
    """logits (T, S) -> the router's probabilities (T, S): a softmax over the slots, or each slot's sigmoid."""
    if score == "softmax":
        return logits.softmax(-1)
    if score == "sigmoid":
        return torch.sigmoid(logits)
    raise ValueError(f"moe.score: unknown score {score!r} (expected 'softmax' or 'sigmoid')")


def bias_over_slots(bias: Tensor, n_slots: int) -> Tensor:
    """The real experts' selection bias (E,) padded with zeros for the no-op slots -> (S,)."""
    return torch.cat([bias.float(), bias.new_zeros(n_slots - bias.shape[0], dtype=torch.float32)])


def balanced_bias_step(bias: Tensor, loads: Tensor, rate: float) -> None:
    """Auxiliary-loss-free balancing (DeepSeek-V3), in place: bias (E,) += rate * sign(mean load - load).
    loads (E,): the assignments each real expert was chosen for, summed over every process."""
    bias.add_(torch.sign(loads.float().mean() - loads.float()), alpha=rate)


def token_choice_capacity(num_tokens: int, n_slots: int, top_k: int, capacity_factor: float) -> int:
    """Rows per expert under token choice: ceil(cf * T * top_k / n_slots), between 1 and T."""
    if not 0.0 < capacity_factor:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    exact = round(capacity_factor * num_tokens * top_k / n_slots, CAPACITY_DECIMALS)  # 1.1 * 100 / 10: 11, not 12
    return max(1, min(num_tokens, math.ceil(exact)))


def positions_in_expert(slots: Tensor, n_experts: int, capacity: int | None) -> Tensor:
    """Token choice: each assignment's row in its expert's buffer; -1 where it is not computed.

    slots (T, k) in [0, n_slots); slots >= n_experts are no-op (-1). With a capacity, priority
    follows GShard: every token's first choice before any second choice, and within one rank
    earlier tokens (by position) first; assignments past the capacity are dropped (-1).
    Dropless (capacity None) there is no buffer to place rows in: every real assignment is
    computed (0) and the grouped layout orders the rows by sorting on the expert (sort_by_expert).
    """
    if capacity is None:
        return dropless_positions(slots, n_experts)
    tokens, k = slots.shape
    ranked = slots.t().reshape(-1)  # (k*T,) rank-major: priority order
    # One row per expert, every no-op slot sharing one extra row (their positions are discarded);
    # the running count along each row (a contiguous scan: fast on GPU) is the queue position.
    bins = ranked.clamp(max=n_experts).unsqueeze(0)  # (1, k*T)
    one_hot = bins == torch.arange(n_experts + 1, device=slots.device).unsqueeze(1)  # (E+1, k*T)
    position = one_hot.cumsum(-1, dtype=torch.int32).gather(0, bins).squeeze(0).long() - 1  # (k*T,)
    keep = (ranked < n_experts) & (position < capacity)
    position = torch.where(keep, position, -1)
    return position.view(k, tokens).t()  # (T, k)


def dropless_positions(slots: Tensor, n_experts: int, rows: Tensor | None = None) -> Tensor:
    """Dropless token choice's positions_in_expert: slots (T, k) -> 0 where a real expert computes
    the assignment, -1 for a no-op slot and, rows (T, 1) bool given, for a row that is False
    (padding). Two or three launches, not where's four or six (it fills each scalar first): a decode
    step routes every routed layer's tokens through here."""
    computed = slots < n_experts
    if rows is not None:
        computed = computed & rows
    return computed.add(-1)  # bool + int: int64


class CapacityRows(NamedTuple):
    """Token choice's (E, C) layout, built with the positions (capacity_positions)."""

    table: Tensor  # (E, C) int64: slot_table's
    rows: ExpertRows  # token_choice_rows' over the E*C rows


def capacity_positions(slots: Tensor, n_experts: int, capacity: int | None, x: Tensor
                       ) -> tuple[Tensor, CapacityRows | None]:
    """positions_in_expert(slots, n_experts, capacity) for the tokens x (T, D), and where the row
    kernels apply (eager CUDA) with a capacity, the (E, C) layout too, from one counting sort
    (mode/kernels/sort_rows.capacity_rows: two launches for what takes about 25 PyTorch ops in
    positions_in_expert, slot_table and token_choice_rows); else None (the FFN builds it)."""
    if capacity is not None and rows_kernel_applies(x):
        from mode.kernels import sort_rows

        if sort_rows.fits(slots.numel(), n_experts):
            positions, table, ids, inverse = sort_rows.capacity_rows(slots, n_experts, capacity)
            return positions, CapacityRows(table, ExpertRows(ids, slots.shape[0], inverse))
    return positions_in_expert(slots, n_experts, capacity), None


def slot_table(slots: Tensor, positions: Tensor, n_experts: int, capacity: int) -> Tensor:
    """Token choice with a capacity: (E, C) table of assignment ids (t * k + j) per expert row.

    Empty rows hold T * k (one past the last assignment), so `table // k` is the token id T
    there and callers can pad one row. Static shape: the batched-matmul layout.
    """
    num = slots.numel()
    flat_pos = positions.reshape(-1)
    dest = torch.where(flat_pos >= 0, slots.reshape(-1) * capacity + flat_pos, n_experts * capacity)
    table = torch.full((n_experts * capacity + 1,), num, dtype=torch.long, device=slots.device)
    table.scatter_(0, dest, torch.arange(num, device=slots.device))  # the dump row is discarded
    return table[:-1].view(n_experts, capacity)


def _expert_keys(slots: Tensor, positions: Tensor, n_experts: int) -> Tensor:
    """(T, k) assignments -> (T*k,) sort keys: the expert, or n_experts where none computes it."""
    return torch.where(positions >= 0, slots, n_experts).reshape(-1)


def sort_by_expert(slots: Tensor, positions: Tensor, n_experts: int) -> tuple[Tensor, Tensor]:
    """Token choice, uneven loads: computed assignment ids (t * k + j) sorted by expert, and counts.

    Returns (M,) assignment ids (stable: token order within an expert) and (E,) counts
    (int64) on the host. M is data-dependent: this syncs with the device once, and the
    grouped GEMMs, which read the group sizes on the host, need no second sync.
    """
    key = _expert_keys(slots, positions, n_experts)
    order = key.argsort(stable=True)  # queued before the sync
    counts = count_ids(key, n_experts + 1)[:n_experts].cpu()
    return order[: int(counts.sum())], counts


def sort_all_by_expert(slots: Tensor, positions: Tensor, n_experts: int) -> tuple[Tensor, Tensor, Tensor]:
    """Token choice, uneven loads, without a host sync: every assignment id (t * k + j) sorted by
    expert, and where each expert's rows end, all on the device.

    Returns order (T*k,) (stable: token order within an expert; the assignments no expert computes,
    no-op slots, last), computed (T*k,) bool in that order, and ends (E,) int32: the cumulative row
    counts (torch._grouped_mm's offsets). Static shapes, unlike sort_by_expert: CUDA-graphable.
    """
    key = _expert_keys(slots, positions, n_experts)
    order = key.argsort(stable=True)
    ends = count_ids(key, n_experts + 1)[:n_experts].cumsum(0, dtype=torch.int32)  # (E,)
    return order, key.index_select(0, order) < n_experts, ends


class DroplessRows(NamedTuple):
    """Token choice's sync-free dropless layout: every one of the N = T*k assignments a row, sorted
    by expert, the ones no expert computes last (dropless_rows)."""

    rows: ExpertRows  # over the N rows
    gate_index: Tensor  # (N,) int64: each row's assignment, N where no expert computes it
    ends: Tensor  # (E,) int32: each expert's row end
    computed: Tensor | None  # (N,) bool, only where there is no inverse map (see dropless_rows)
    gates: Tensor | None  # (N,): each row's gate, 0 where no expert computes it; None unless asked for


def dropless_rows(slots: Tensor, positions: Tensor, n_experts: int, x: Tensor, gates: Tensor | None = None
                  ) -> DroplessRows:
    """Token choice's sync-free dropless layout of the tokens x (T, D): every assignment a row,
    sorted by expert (sort_all_by_expert), the uncomputed ones last. gates (T, k) given: each row's
    gate too, a 0 where no expert computes the row (differentiable where gates need a gradient).

    With the inverse map (the row kernels: eager CUDA) the uncomputed rows are left out of it and
    computed is None; on eager CUDA the layout is two Triton launches (mode/kernels/sort_rows.py, a
    counting sort) instead of about 17 PyTorch ops, which also write the rows' gates where no
    gradient is needed. Without it (torch.compile) the gather's backward and the combine read every
    row: computed (N,) bool is returned for the experts to mask with."""
    tokens, top_k = slots.shape
    inverse_map = rows_kernel_applies(x)
    if inverse_map:
        from mode.kernels import sort_rows

        if sort_rows.fits(slots.numel(), n_experts):
            in_kernel = gates is not None and not (gates.requires_grad and torch.is_grad_enabled())
            ids, gate_index, inverse, ends, row_gates = sort_rows.dropless_rows(
                slots, positions, n_experts, gates if in_kernel else None)
            if gates is not None and not in_kernel:
                row_gates = padded_gates(gates).index_select(0, gate_index)
            return DroplessRows(ExpertRows(ids, tokens, inverse), gate_index, ends, None, row_gates)
    order, computed, ends = sort_all_by_expert(slots, positions, n_experts)
    gate_index = torch.where(computed, order, slots.numel())
    row_gates = None if gates is None else padded_gates(gates).index_select(0, gate_index)
    if inverse_map:
        return DroplessRows(rows_by_slot(order // top_k, order % top_k, top_k, x, computed), gate_index, ends, None,
                            row_gates)
    return DroplessRows(ExpertRows(order // top_k, tokens, None), gate_index, ends, computed, row_gates)


def padded_gates(gates: Tensor) -> Tensor:
    """gates (T, k) -> (T*k + 1,): a 0 gate at index T*k for the rows no expert computes (a cat:
    F.pad showed a host-device copy each way in an eager trace)."""
    return torch.cat([gates.reshape(-1), gates.new_zeros(1)])


def router_z_loss(logits: Tensor) -> Tensor:
    """ST-MoE router z-loss: mean over tokens of logsumexp(logits)^2; logits (..., n_slots)."""
    return logits.float().logsumexp(-1).square().mean()


def load_balancing_loss(prob_mean: Tensor, choices: Tensor, assignments: int) -> Tensor:
    """Switch load-balancing loss over all n_slots slots: n_slots * sum_s f_s * P_s.

    prob_mean (n_slots,) each slot's mean router probability P_s; choices (n_slots,) how many of
    the `assignments` (T * k) chose each slot, before any dropping: f_s = choices_s / assignments.
    Equals 1 under a perfectly uniform router.
    """
    return (choices * prob_mean).sum() * (prob_mean.shape[-1] / assignments)
