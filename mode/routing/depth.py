"""A depth router's routing and gated update (MoD, Staged MoDE), each one autograd node.

Outside torch.compile a depth router's scores, top-k, gather and gates are one autograd node
(_RouteTokens) and the gated update of the residual another (_AddGatedRows): eager MoD is bound
by the host, and two nodes queue faster than the separate ops autograd would record. The separate
ops (fused=False) remain for torch.compile and as the tests' reference.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from mode.routing.expert_rows import rows_kernel_applies
from mode.routing.moves import add_rows, add_rows_to_gradient, scatter_add_tokens, split_tokens
from mode.routing.scores import apply_gate, random_scores, router_scores
from mode.routing.selection import flat_indices, top_k_flat, top_k_positions


class _RouteTokens(torch.autograd.Function):
    """A depth router in one node: x (G, T, D) -> the k chosen tokens of each group (G, k, D), x
    itself (a detached alias, as _SplitRows returns it), their gates g(score) (G, k) float32 and,
    without gradient, the chosen positions (G, k), the same in the flattened (G*T) axis (G*k,) and
    every token's score (G, T).

    The gates are read from the scores of every token (the chosen rows' own dot products). The
    backward adds the gates' path by hand: the router weight's gradient (score gradient @ rows),
    and the score gradient times the weight into the chosen rows' gradient, which is then added
    into x's (in place with grad_in_place, as _SplitRows).
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Tensor | None, k: int, gate: str,
                random_rows: tuple[int, int] | None, grad_in_place: bool) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
        groups, tokens, width = x.shape
        scores = router_scores(x, weight, bias).squeeze(-1)  # (G, T) float32
        # The random-routing ablation changes only which tokens are chosen; gates stay learned.
        selection = scores if random_rows is None else random_scores(scores, random_rows)
        indices, flat = top_k_flat(selection, k)  # (G, k) sorted, (G*k,)
        rows = x.reshape(-1, width).index_select(0, flat)  # (G*k, D)
        gates = apply_gate(scores.gather(1, indices), gate)  # (G, k)
        ctx.save_for_backward(flat, rows, weight, gates)
        ctx.gate, ctx.grad_in_place, ctx.has_bias, ctx.x_shape = gate, grad_in_place, bias is not None, x.shape
        ctx.mark_non_differentiable(indices, flat, scores)
        # Gradients the loss does not produce (the three outputs above, an unused residual) stay
        # None: no zero tensors made and filled for them in every backward.
        ctx.set_materialize_grads(False)
        return rows.view(groups, k, width), x.detach(), gates, indices, flat, scores

    @staticmethod
    def backward(ctx, grad_rows: Tensor | None, grad_x: Tensor | None, grad_gates: Tensor | None, *_: Tensor
                 ) -> tuple[Tensor | None, ...]:
        flat, rows, weight, gates = ctx.saved_tensors
        width = rows.shape[1]
        grad_rows = rows.new_zeros(rows.shape) if grad_rows is None else grad_rows.reshape(-1, width)  # (G*k, D)
        grad_weight = grad_bias = None
        if grad_gates is not None:
            grad_score = grad_gates.reshape(-1).float()  # (G*k,)
            if ctx.gate == "sigmoid":
                g = gates.reshape(-1)
                grad_score = grad_score * g * (1 - g)
            grad_weight = (grad_score.unsqueeze(0) @ rows.float()).to(weight.dtype)  # (1, D)
            grad_bias = grad_score.sum().reshape(1).to(weight.dtype) if ctx.has_bias else None
            grad_rows = grad_rows + (grad_score.unsqueeze(1) * weight.float()).to(grad_rows.dtype)  # the score's input gradient
        grad_x = rows.new_zeros(ctx.x_shape) if grad_x is None else grad_x  # None: the residual unused
        return add_rows_to_gradient(grad_x, flat, grad_rows, ctx.grad_in_place), grad_weight, grad_bias, None, None, None, None


class DepthRoute(NamedTuple):
    """route_tokens' result for x (G, T, D) and k tokens a group."""

    positions: Tensor  # (G, k) chosen positions, sorted
    gates: Tensor  # (G, k) g(score), float32
    chosen: Tensor  # (G, k, D) the chosen tokens
    residual: Tensor  # (G, T, D) x itself, for add_gated_tokens
    scores: Tensor  # (G, T) every token's score, float32, without gradient
    flat: Tensor | None  # (G*k,) indices in the flattened (G*T) axis; None where not at hand


def route_tokens(x: Tensor, weight: Tensor, bias: Tensor | None, k: int, gate: str, random: bool = False,
                 grad_in_place: bool = False, random_rows: tuple[int, int] = (0, 1), fused: bool = True
                 ) -> DepthRoute:
    """A depth router's routing of x (G, T, D) by a router of weight (1, D): the top-k tokens of each
    group by score w . x_i (+ bias), or k random ones (random: the ablation; gates stay learned).

    The same as split_tokens(x, top_k_positions(scores, k)) with the gates g(w . x_i) of the chosen
    rows, in one autograd node (fused; under torch.compile, or fused=False, the separate ops).
    grad_in_place as split_tokens'; random_rows = (rank, world) as random_scores'.
    """
    if fused and not torch.compiler.is_compiling():
        chosen, residual, gates, positions, flat, scores = _RouteTokens.apply(
            x, weight, bias, k, gate, random_rows if random else None, grad_in_place)
        return DepthRoute(positions, gates, chosen, residual, scores, flat)
    with torch.no_grad():
        scores = router_scores(x, weight, bias).squeeze(-1)  # (G, T)
    positions = top_k_positions(random_scores(scores, random_rows) if random else scores, k)
    chosen, residual = split_tokens(x, positions, grad_in_place=grad_in_place)  # (G, k, D), (G, T, D)
    gates = apply_gate(router_scores(chosen, weight, bias).squeeze(-1), gate)  # (G, k), the gradient's path
    return DepthRoute(positions, gates, chosen, residual, scores, None)


class _AddGatedRows(torch.autograd.Function):
    """x (G, T, D) with gates[i] * updates[i] added to row flat[i] (distinct rows), in x's memory
    (in_place) or a copy of it; x's gradient passes through."""

    @staticmethod
    def forward(ctx, x: Tensor, flat: Tensor, gates: Tensor, updates: Tensor, in_place: bool) -> Tensor:
        ctx.save_for_backward(flat, gates, updates)
        if in_place:
            ctx.mark_dirty(x)
            out = x
        else:
            out = x.clone(memory_format=torch.contiguous_format)
        rows = out.view(-1, out.shape[-1])  # (G*T, D)
        if rows_kernel_applies(x):  # one kernel (mode/kernels/rows.py)
            from mode.kernels.common import on_device_of
            from mode.kernels.rows import add_gated_rows_

            with on_device_of(x):
                add_gated_rows_(rows, flat, gates, updates)
        else:
            add_rows(rows, flat, (gates.unsqueeze(1) * updates).to(x.dtype))  # the product as PyTorch promotes it
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, Tensor, Tensor, None]:
        flat, gates, updates = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])  # (G*T, D)
        if rows_kernel_applies(grad):  # one kernel: the rows' gradient and the gates' at once
            from mode.kernels.common import on_device_of
            from mode.kernels.rows import combine_backward

            with on_device_of(grad):
                grad_updates, grad_gates = combine_backward(grad_rows, flat, updates, gates)
            return grad, None, grad_gates.to(gates.dtype), grad_updates, None
        grad_chosen = grad_rows.index_select(0, flat)  # (M, D)
        grad_updates = (grad_chosen * gates.unsqueeze(1)).to(updates.dtype)
        grad_gates = (grad_chosen * updates).sum(-1).to(gates.dtype)
        return grad, None, grad_gates, grad_updates, None


def add_gated_tokens(x: Tensor, indices: Tensor, gates: Tensor, updates: Tensor, in_place: bool = False,
                     flat: Tensor | None = None, fused: bool = True) -> Tensor:
    """x (G, T, D) with gates (G, k) * updates (G, k, D) added at indices (G, k) (distinct within a
    group): scatter_add_tokens(x, indices, gates[..., None] * updates, in_place), the product
    formed and added in one autograd node (fused, outside torch.compile) instead of three. flat:
    indices in the flattened (G*T) axis where the caller has them (DepthRoute.flat)."""
    if not fused or torch.compiler.is_compiling():
        return scatter_add_tokens(x, indices, gates.unsqueeze(-1) * updates, in_place=in_place)
    width = x.shape[-1]
    flat = flat_indices(indices, x.shape[1]) if flat is None else flat
    return _AddGatedRows.apply(x, flat, gates.reshape(-1), updates.reshape(-1, width), in_place and x.is_contiguous())
