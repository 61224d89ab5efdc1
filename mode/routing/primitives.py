"""The routing primitives under one name, for code that imports them from here.

They live by concern in mode/routing/: selection (capacity -> k, top-k), scores (router scores,
gates, random scores), moves (gather / scatter-add of token rows), expert_rows (expert-major
layouts), depth (a depth router's two autograd nodes), expert_choice and token_choice.
"""
from mode.routing.depth import DepthRoute, _AddGatedRows, _RouteTokens, add_gated_tokens, route_tokens
from mode.routing.expert_choice import expert_choice_dispatch, expert_choice_kernel_applies, expert_major_ids
from mode.routing.expert_rows import (
    ExpertRows,
    combine_rows,
    expert_choice_rows,
    gather_rows,
    rows_by_slot,
    rows_kernel_applies,
    token_choice_rows,
)
from mode.routing.moves import combine_tokens, gather_tokens, scatter_add_tokens, split_tokens
from mode.routing.scores import _HalfRouterScores, apply_gate, half_router_applies, random_scores, router_scores
from mode.routing.selection import (
    capacity_to_k,
    count_ids,
    flat_indices,
    token_mask,
    top_k_flat,
    top_k_positions,
    top_k_slots,
    topk_kernel_applies,
)
from mode.routing.token_choice import (
    CapacityRows,
    DroplessRows,
    TokenChoiceHead,
    capacity_positions,
    dropless_positions,
    dropless_rows,
    load_balancing_loss,
    padded_gates,
    positions_in_expert,
    router_z_loss,
    slot_table,
    softmax_topk_kernel_applies,
    sort_all_by_expert,
    sort_by_expert,
    token_choice_capacity,
    token_choice_head,
)

__all__ = [
    "CapacityRows", "DepthRoute", "DroplessRows", "ExpertRows", "TokenChoiceHead", "_AddGatedRows", "_HalfRouterScores",
    "_RouteTokens", "add_gated_tokens", "apply_gate", "capacity_positions", "capacity_to_k", "combine_rows",
    "combine_tokens", "count_ids", "dropless_positions", "dropless_rows", "expert_choice_dispatch", "expert_choice_kernel_applies",
    "expert_choice_rows", "expert_major_ids", "flat_indices", "gather_rows", "gather_tokens", "half_router_applies",
    "load_balancing_loss", "padded_gates", "positions_in_expert", "random_scores", "route_tokens", "router_scores", "router_z_loss",
    "rows_by_slot", "rows_kernel_applies", "scatter_add_tokens", "slot_table", "softmax_topk_kernel_applies",
    "sort_all_by_expert", "sort_by_expert", "split_tokens", "token_choice_capacity", "token_choice_head",
    "token_choice_rows", "token_mask", "top_k_flat", "top_k_positions", "top_k_slots", "topk_kernel_applies",
]
