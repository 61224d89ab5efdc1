"""Expert-major row layouts (ExpertRows) and the gather / combine of an MoE layer's rows.

On CUDA in eager mode (the policy's "rows" kernels) rows move through mode/kernels/rows.py: each
token sums the rows it feeds through an inverse map (the combine with its gates, and the gather's
backward) instead of a zero fill and a scatter_add. Under torch.compile the plain ops, which
Inductor fuses with their neighbours.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from mode.kernels import use_triton
from mode.routing.moves import combine_tokens, gather_tokens


class ExpertRows(NamedTuple):
    """An expert-major layout of R rows: which token each row holds, and each token's rows."""

    ids: Tensor  # (R,) int64: the token (in the flattened batch) each row holds
    tokens: int  # T: tokens in the flattened batch
    inverse: Tensor | None  # (T, J) int32: each token's rows, -1 for none; None where the kernels do not run


def rows_kernel_applies(x: Tensor) -> bool:
    """The kernels sum in float32: float64 layers (the reference tests) keep the PyTorch ops."""
    return x.dtype in (torch.float32, torch.bfloat16, torch.float16) and use_triton(x, "rows")


def rows_by_slot(ids: Tensor, slots: Tensor, n_slots: int, x: Tensor, computed: Tensor | None = None) -> ExpertRows:
    """R rows, the r-th holding token ids[r] of x (T, D) as that token's slots[r]-th row (a token
    holds each slot at most once: its expert, or its j-th choice) -> ExpertRows, inverse (T, n_slots).

    computed (R,) bool: rows no expert computes (False) are left out of the inverse, so the sums
    through it (the combine, the gather's backward) never read them. Only with the inverse map
    (eager CUDA, float dtypes): the gather and combine by ids would read every row."""
    tokens = x.shape[0]
    if not rows_kernel_applies(x):
        if computed is not None:
            raise ValueError("rows_by_slot: rows left out (computed) need the inverse map (the row kernels, eager CUDA)")
        return ExpertRows(ids, tokens, None)
    row = torch.arange(ids.numel(), device=ids.device, dtype=torch.int32)  # (R,)
    if computed is not None:
        row = torch.where(computed, row, -1)
    inverse = torch.full((tokens, n_slots), -1, device=ids.device, dtype=torch.int32)
    inverse[ids, slots] = row  # (T, n_slots)
    return ExpertRows(ids, tokens, inverse)


def expert_choice_rows(ids: Tensor, x: Tensor) -> ExpertRows:
    """Expert choice's (E, G*C) expert-major ids (expert_major_ids) into the tokens x (T, D) ->
    ExpertRows over the R = E*G*C rows. An expert takes a token at most once, so a token has at
    most E rows: inverse (T, E)."""
    n_experts, per_expert = ids.shape
    experts = torch.arange(ids.numel(), device=ids.device) // per_expert  # (R,): each row's expert
    return rows_by_slot(ids.reshape(-1), experts, n_experts, x)


def token_choice_rows(table: Tensor, slots: Tensor, positions: Tensor, x: Tensor) -> ExpertRows:
    """Token choice with a capacity: the (E, C) slot_table of assignment ids (t * k + j; T * k for
    an empty row) into the tokens x (T, D) -> ExpertRows over its R = E*C rows. An empty row holds
    token 0 (gate 0 at the callers) and no token's inverse names it; a token has at most k rows:
    inverse (T, k), its j-th choice's row slot * C + position, -1 where dropped or a no-op slot."""
    tokens, top_k = slots.shape
    ids = torch.where(table < tokens * top_k, table // top_k, 0).reshape(-1)  # (R,)
    if not rows_kernel_applies(x):
        return ExpertRows(ids, tokens, None)
    inverse = torch.where(positions >= 0, slots * table.shape[1] + positions, -1).int()  # (T, k)
    return ExpertRows(ids, tokens, inverse)


# Batch dims of size 1 are dropped with squeeze(0), never [0]: select's backward would zero-fill
# and copy a whole (rows, D) gradient in eager mode (squeeze's is a view).
def gather_rows(x: Tensor, rows: ExpertRows) -> Tensor:
    """x (T, D) -> x[rows.ids] (R, D): gather_tokens, with the backward summing token-major; through
    the row kernels, in rows_dtype(x)."""
    if rows.inverse is None:
        return gather_tokens(x.unsqueeze(0), rows.ids.unsqueeze(0)).squeeze(0)
    from mode.kernels.rows import GatherRows

    return GatherRows.apply(x, rows.ids, rows.inverse, rows_dtype(x))


def rows_dtype(x: Tensor) -> torch.dtype:
    """The dtype experts' rows of tokens x are gathered in: under autocast a float32 x would be cast to
    the autocast dtype by every expert matmul, so the rows are gathered in it directly (the same
    rounding, half the bytes moved, and the rows' gradient summed into float32 as before); else x's."""
    device = x.device.type
    if x.dtype == torch.float32 and torch.is_autocast_enabled(device):
        return torch.get_autocast_dtype(device)
    return x.dtype


def combine_rows(ys: Tensor, gates: Tensor | None, rows: ExpertRows, into: Tensor | None = None) -> Tensor:
    """ys (R, D), gates (R,) -> (T, D) in ys' dtype: out[t] = sum of gates[r] * ys[r] over t's rows;
    gates None: the rows as they are (the experts applied the gates, Experts.gates_in_activation).
    into (T, D) or None: into + out, in into's dtype; the PyTorch branch sums the rows into it.

    The kernel multiplies by the float32 gate and sums in float32, rounding once; the PyTorch
    branch rounds the gate to ys' dtype and sums in it (combine_tokens): equal up to that rounding.
    """
    if rows.inverse is None:
        weighted = ys if gates is None else gates.to(ys.dtype).unsqueeze(-1) * ys  # (R, D)
        base = None if into is None else into.unsqueeze(0)
        return combine_tokens(rows.ids.unsqueeze(0), weighted.unsqueeze(0), rows.tokens, base).squeeze(0)
    from mode.kernels.rows import CombineRows, SumRows

    out = SumRows.apply(ys, rows.ids, rows.inverse) if gates is None else CombineRows.apply(ys, gates, rows.ids, rows.inverse)
    return out if into is None else into + out
