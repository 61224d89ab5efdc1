"""Routing primitives: pure tensor functions, written once and used by every routed block.

Conventions: tokens are routed within *groups* (a group is one sequence for MoD, one
sequence or a few sequences for expert-choice MoE). `x` is (G, T, D): G groups of T tokens.
Chosen positions are indices into T, kept sorted so a chosen subsequence stays causal.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING, NamedTuple

import torch
from torch import Tensor

from mode.kernels import on_kernel_device, use_triton

if TYPE_CHECKING:
    from mode.kernels.expert_choice import Dispatch


# Decimals kept of a product like cf / slots * T before it is rounded to a whole number of tokens:
# enough for any real capacity, and it removes float error (1.5 / 11 * 55 = 7.4999999999999991).
_CAPACITY_DECIMALS = 9

def random_scores(scores: Tensor, rows: tuple[int, int] = (0, 1)) -> Tensor:
    """The random-routing ablation's scores: uniform, shaped as scores (G, T) (G sequences or
    groups of this process). rows = (rank, world): under data parallelism every process draws the
    scores of the whole global batch and keeps its own rows, so N processes (generators seeded
    alike) route as one process does with the N-fold batch."""
    rank, world = rows
    if world == 1:
        return torch.rand_like(scores)
    rows = scores.shape[0]
    every = torch.rand((world * rows, *scores.shape[1:]), dtype=scores.dtype, device=scores.device)  # (W*G, T)
    return every[rank * rows : (rank + 1) * rows]


def capacity_to_k(num_tokens: int, capacity: float) -> int:
    """Tokens a block (or expert) takes from a group of num_tokens: capacity * T rounded to the
    nearest whole token, halves up (0.125 * 20 = 2.5 takes 3), between 1 and T."""
    if not 0.0 < capacity:
        raise ValueError(f"capacity must be positive, got {capacity}")
    return max(1, min(num_tokens, math.floor(round(capacity * num_tokens, _CAPACITY_DECIMALS) + 0.5)))


def _topk_kernel_applies(scores: Tensor) -> bool:
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
    if _topk_kernel_applies(scores):
        from mode.kernels.topk import top_k_positions as one_kernel

        return one_kernel(scores, k)
    if _compiled_on_cuda(scores):
        chosen = scores.topk(k, dim=-1, sorted=False).indices
    else:
        # Equal scores go to the earliest positions, as the kernel breaks ties: a stable sort, not
        # topk, whose choice among equal scores is unspecified (on CPU it took the last ones; equal
        # tokens score alike before any attention, so a routed first block meets ties).
        chosen = scores.sort(dim=-1, descending=True, stable=True).indices[..., :k]
    # Sorted as int32 (positions < 2^31): on an H100, 21 against 30 us for (8, 256) int64 keys
    # (bench/block_profile.py).
    return chosen.int().sort(dim=-1).values.long()


def _compiled_on_cuda(scores: Tensor) -> bool:
    """torch.compile on CUDA keeps torch.topk, whose choice among exactly equal scores is its own:
    the stable sort that breaks ties as the kernels do cost the bench's compiled MoD model 0.2 ms
    of its 34 ms forward+backward (H100). Compiled and eager runs round differently anyway."""
    return scores.is_cuda and torch.compiler.is_compiling()


def top_k_flat(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """scores (G, T) -> (top_k_positions(scores, k) (G, k), the same positions in the flattened
    (G*T) axis (G*k,)): the Triton kernel writes both at once (no arange and add on the host)."""
    if _topk_kernel_applies(scores):
        from mode.kernels.topk import top_k_positions as one_kernel

        return one_kernel(scores, k, flat=True)
    indices = top_k_positions(scores, k)
    return indices, _flat_indices(indices, scores.shape[-1])


def _flat_indices(indices: Tensor, tokens_per_group: int) -> Tensor:
    """(G, ..., k) positions within each group -> positions in the flattened (G*T) token axis."""
    groups = indices.shape[0]
    if groups == 1:  # one group (MoE layers route the flattened batch): positions already flat
        return indices.reshape(-1)
    offsets = torch.arange(0, groups * tokens_per_group, tokens_per_group, device=indices.device)  # (G,)
    return (indices + offsets.view(groups, *([1] * (indices.dim() - 1)))).reshape(-1)


# Rows are moved with index_select one way and scatter_add the other, in both directions of
# autograd: index_select's own backward (and index_add) accumulate through a slower atomic
# kernel (on an H200, 16k rows of 1024 bf16: index_add 169 us, scatter_add 105 us;
# bench/row_ops.py). In eager mode small autograd functions do it, some in place. Under
# torch.compile, torch 2.11 compiles the backward of those in-place functions wrongly, on CPU
# and CUDA (gradients off by up to 8e-2 against eager; torch 2.13 is right; caught by
# tests/test_model.py on the GPU machine), so there the rows move by plain ops: gather with the
# ids broadcast along the row (its derivative scatter_add) and scatter_add (its derivative
# gather); a depth router's split and update by the functional _SplitRowsTraced and index_put,
# which Inductor turns into in-place adds. index_select / index_add traced under torch.compile
# fall back to the slow atomic kernel.


def _add_rows(out: Tensor, flat: Tensor, rows: Tensor) -> Tensor:
    """out[flat[i]] += rows[i], in place."""
    return out.scatter_add_(0, flat.unsqueeze(1).expand_as(rows), rows)  # ids broadcast along the row: a view


class _GatherRows(torch.autograd.Function):
    """rows = x[flat]; the backward sums each row's gradient into its token (scatter_add)."""

    @staticmethod
    def forward(ctx, x: Tensor, flat: Tensor) -> Tensor:
        ctx.save_for_backward(flat)
        ctx.num_rows = x.shape[0]
        return x.index_select(0, flat)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:
        (flat,) = ctx.saved_tensors
        return _add_rows(grad.new_zeros(ctx.num_rows, grad.shape[1]), flat, grad), None


class _ScatterAddRows(torch.autograd.Function):
    """out = x with updates[i] added to row flat[i]; the updates' gradient is a gather (index_select)."""

    @staticmethod
    def forward(ctx, x: Tensor, flat: Tensor, updates: Tensor) -> Tensor:
        ctx.save_for_backward(flat)
        return _add_rows(x.clone(), flat, updates)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, Tensor]:
        (flat,) = ctx.saved_tensors
        return grad, None, grad.index_select(0, flat)


class _SplitRows(torch.autograd.Function):
    """x (G, T, D) -> (the rows x[flat] (M, D), x itself); the backward sums the rows' gradient
    into x's own in one pass.

    The second output is x's memory under a new autograd node: a detached alias (same storage
    and version counter, not an autograd view), so that _AddRowsInPlace may add into it. Were
    anything that saved x for its backward to run after such an update, autograd's version
    check would raise, never compute with the updated values.

    grad_in_place: the caller guarantees that the gradient reaching the second output is held by
    nothing else (LanguageModel's residual stream), so the rows' gradient is added into it
    instead of into a copy of it.
    """

    @staticmethod
    def forward(ctx, x: Tensor, flat: Tensor, grad_in_place: bool) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(flat)
        ctx.grad_in_place = grad_in_place
        return x.reshape(-1, x.shape[-1]).index_select(0, flat), x.detach()

    @staticmethod
    def backward(ctx, grad_rows: Tensor, grad_x: Tensor) -> tuple[Tensor, None, None]:
        (flat,) = ctx.saved_tensors
        return _add_rows_to_gradient(grad_x, flat, grad_rows, ctx.grad_in_place), None, None


class _SplitRowsTraced(torch.autograd.Function):
    """_SplitRows under torch.compile: x (N, D) -> (the rows x[flat] (M, D), x). Functional ops
    only (the in-place functions here are compiled wrongly by torch 2.11, see the comment above _add_rows).

    The backward adds the rows' gradient into x's with index_put(accumulate), which Inductor does
    in place on the incoming gradient; traced as plain ops, autograd instead summed x's gradient
    with a zero-filled (N, D) one holding the rows'. On an H100 the compiled MoD step of
    bench/mod_step.py (6 routed blocks) went from 33.98 / 34.22 to 33.38 / 33.70 ms with this and
    scatter_add_tokens' index_put (alternating runs; bench/RESULTS.md).
    """

    @staticmethod
    def forward(ctx, x: Tensor, flat: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(flat)
        return x.index_select(0, flat), x.view_as(x)

    @staticmethod
    def backward(ctx, grad_rows: Tensor, grad_x: Tensor) -> tuple[Tensor, None]:
        (flat,) = ctx.saved_tensors
        return grad_x.index_put((flat,), grad_rows.to(grad_x.dtype), accumulate=True), None


def _add_rows_to_gradient(grad_x: Tensor, flat: Tensor, grad_rows: Tensor, in_place: bool) -> Tensor:
    """x's gradient (G, T, D) with the chosen rows' gradient (M, D) added at flat: into grad_x itself
    where the caller owns it (in_place, contiguous), else into a copy (an incoming gradient may be
    shared: x + y hands one tensor to both)."""
    grad = grad_x if in_place and grad_x.is_contiguous() else grad_x.clone(memory_format=torch.contiguous_format)
    _add_rows(grad.view(-1, grad.shape[-1]), flat, grad_rows.to(grad.dtype))
    return grad


class _AddRowsInPlace(torch.autograd.Function):
    """x (G, T, D), contiguous, with updates[i] added to row flat[i] in its own memory; the
    updates' gradient is a gather, x's passes through."""

    @staticmethod
    def forward(ctx, x: Tensor, flat: Tensor, updates: Tensor) -> Tensor:
        ctx.save_for_backward(flat)
        ctx.mark_dirty(x)
        _add_rows(x.view(-1, x.shape[-1]), flat, updates)
        return x

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, Tensor]:
        (flat,) = ctx.saved_tensors
        return grad, None, grad.reshape(-1, grad.shape[-1]).index_select(0, flat)


class _CombineRows(torch.autograd.Function):
    """out (num_rows, D) = zeros with updates[i] added to row flat[i]; the updates' gradient is a gather."""

    @staticmethod
    def forward(ctx, updates: Tensor, flat: Tensor, num_rows: int) -> Tensor:
        ctx.save_for_backward(flat)
        return _add_rows(updates.new_zeros(num_rows, updates.shape[1]), flat, updates)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (flat,) = ctx.saved_tensors
        return grad.index_select(0, flat), None, None


def split_tokens(x: Tensor, indices: Tensor, grad_in_place: bool = False) -> tuple[Tensor, Tensor]:
    """x (G, T, D) -> (the chosen tokens (G, ..., k, D), x itself), for routing around a block.

    The same values as (gather_tokens(x, indices), x). Add the block's updates back to the
    second with scatter_add_tokens: the chosen tokens' gradient is then added into the
    residual's gradient in one copy, instead of a zero-filled full-size gradient that
    autograd sums with it (one fewer pass over the (G, T, D) residual each way).
    grad_in_place: only for a caller that owns x's gradient (nothing else holds the gradient
    reaching the second output, as in LanguageModel's residual stream): the chosen tokens'
    gradient is added into it without the copy (on an H100, 46 us of a routed block's backward
    at B=8, S=2048, D=1024, float32). Eager mode; under torch.compile plain ops.
    """
    if torch.compiler.is_compiling():
        groups, tokens, width = x.shape
        flat = _flat_indices(indices, tokens)
        rows, residual = _SplitRowsTraced.apply(x.reshape(groups * tokens, width), flat)
        return rows.view(*indices.shape, width), residual.view(groups, tokens, width)  # (G, ..., k, D), (G, T, D)
    rows, residual = _SplitRows.apply(x, _flat_indices(indices, x.shape[1]), grad_in_place)
    return rows.view(*indices.shape, x.shape[-1]), residual  # (G, ..., k, D), (G, T, D)


def gather_tokens(x: Tensor, indices: Tensor) -> Tensor:
    """x (G, T, D), indices (G, ..., k) -> the chosen tokens (G, ..., k, D)."""
    groups, tokens, width = x.shape
    flat = _flat_indices(indices, tokens)
    rows = x.reshape(groups * tokens, width)
    if torch.compiler.is_compiling():  # plain ops (see the comment above _add_rows)
        return rows.gather(0, flat.unsqueeze(1).expand(-1, width)).view(*indices.shape, width)
    return _GatherRows.apply(rows, flat).view(*indices.shape, width)


def scatter_add_tokens(x: Tensor, indices: Tensor, updates: Tensor, in_place: bool = False) -> Tensor:
    """Return x with updates (G, ..., k, D) added at indices (G, ..., k); other tokens bit-identical.

    Several updates for one token (a token chosen by several experts) are summed.
    in_place: add into x's own memory, where the caller owns x and nothing saved it for the
    backward (MoDBlock inside LanguageModel): no copy of the (G, T, D) residual (on an H100,
    46 of a routed block's 790 us of kernels at B=8, S=2048, D=1024, float32; bench/block_profile.py). Eager mode and a
    contiguous x only; otherwise, and under torch.compile (which plans its own buffers), a copy.
    """
    groups, tokens, width = x.shape
    flat = _flat_indices(indices, tokens)
    updates = updates.reshape(-1, width).to(x.dtype)  # (M, D)
    if torch.compiler.is_compiling():
        # index_put, not scatter_add: Inductor reinplaces it into x where nothing reads x later
        # (LanguageModel's residual stream), so no copy of the (G, T, D) residual is made.
        rows = x.reshape(groups * tokens, width)
        return rows.index_put((flat,), updates, accumulate=True).view(groups, tokens, width)
    if in_place and x.is_contiguous():
        return _AddRowsInPlace.apply(x, flat, updates)
    return _ScatterAddRows.apply(x.reshape(groups * tokens, width), flat, updates).view(groups, tokens, width)


def combine_tokens(indices: Tensor, updates: Tensor, tokens_per_group: int) -> Tensor:
    """The updates (G, ..., k, D) summed into a zero (G, T, D) at indices (G, ..., k): an MoE's output.

    scatter_add_tokens on a zero tensor, without the copy of that zero tensor which keeps
    scatter_add_tokens' input unmodified (one pass over (G, T, D) fewer). Output in updates' dtype.
    """
    groups, width = indices.shape[0], updates.shape[-1]
    flat = _flat_indices(indices, tokens_per_group)
    rows = updates.reshape(-1, width)
    if torch.compiler.is_compiling():  # plain ops (see the comment above _add_rows)
        zeros = rows.new_zeros(groups * tokens_per_group, width)
        return zeros.scatter_add(0, flat.unsqueeze(1).expand_as(rows), rows).view(groups, tokens_per_group, width)
    return _CombineRows.apply(rows, flat, groups * tokens_per_group).view(groups, tokens_per_group, width)


# ----------------------------------------------------------------------------- a depth router's two nodes
# Outside torch.compile a depth router's scores, top-k, gather and gates are one autograd node
# (_RouteTokens) and the gated update of the residual another (_AddGatedRows): eager MoD is bound
# by the host, and two nodes queue faster than the separate ops autograd would record. The
# separate ops (fused=False) remain for torch.compile and as the tests' reference.


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
        return _add_rows_to_gradient(grad_x, flat, grad_rows, ctx.grad_in_place), grad_weight, grad_bias, None, None, None, None


class DepthRoute(NamedTuple):
    """route_tokens' result for x (G, T, D) and k tokens a group."""

    indices: Tensor  # (G, k) chosen positions, sorted
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
        chosen, residual, gates, indices, flat, scores = _RouteTokens.apply(
            x, weight, bias, k, gate, random_rows if random else None, grad_in_place)
        return DepthRoute(indices, gates, chosen, residual, scores, flat)
    with torch.no_grad():
        scores = router_scores(x, weight, bias).squeeze(-1)  # (G, T)
    indices = top_k_positions(random_scores(scores, random_rows) if random else scores, k)
    chosen, residual = split_tokens(x, indices, grad_in_place=grad_in_place)  # (G, k, D), (G, T, D)
    gates = apply_gate(router_scores(chosen, weight, bias).squeeze(-1), gate)  # (G, k), the gradient's path
    return DepthRoute(indices, gates, chosen, residual, scores, None)


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
        if _rows_kernel_applies(x):  # one kernel (mode/kernels/rows.py)
            from mode.kernels.common import on_device_of
            from mode.kernels.rows import add_gated_rows_

            with on_device_of(x):
                add_gated_rows_(rows, flat, gates, updates)
        else:
            _add_rows(rows, flat, (gates.unsqueeze(1) * updates).to(x.dtype))  # the product as PyTorch promotes it
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, Tensor, Tensor, None]:
        flat, gates, updates = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])  # (G*T, D)
        if _rows_kernel_applies(grad):  # one kernel: the rows' gradient and the gates' at once
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
    flat = _flat_indices(indices, x.shape[1]) if flat is None else flat
    return _AddGatedRows.apply(x, flat, gates.reshape(-1), updates.reshape(-1, width), in_place and x.is_contiguous())


# ----------------------------------------------------------------------------- expert-major rows
# On CUDA in eager mode (the "rows" kernels), the MoE layers' rows (every layout but megablocks')
# move through mode/kernels/rows.py: each token sums the rows it feeds through an inverse map (the
# combine with its gates, and the gather's backward) instead of a zero fill and a scatter_add.
# Under torch.compile the plain ops (Inductor fuses them with their neighbours).


class ExpertRows(NamedTuple):
    """An expert-major layout of R rows: which token each row holds, and each token's rows."""

    ids: Tensor  # (R,) int64: the token (in the flattened batch) each row holds
    tokens: int  # T: tokens in the flattened batch
    inverse: Tensor | None  # (T, J) int32: each token's rows, -1 for none; None where the kernels do not run


def _rows_kernel_applies(x: Tensor) -> bool:
    """The kernels sum in float32: float64 layers (the reference tests) keep the PyTorch ops."""
    return x.dtype in (torch.float32, torch.bfloat16, torch.float16) and use_triton(x, "rows")


def rows_by_slot(ids: Tensor, slots: Tensor, n_slots: int, x: Tensor, computed: Tensor | None = None) -> ExpertRows:
    """R rows, the r-th holding token ids[r] of x (T, D) as that token's slots[r]-th row (a token
    holds each slot at most once: its expert, or its j-th choice) -> ExpertRows, inverse (T, n_slots).

    computed (R,) bool: rows no expert computes (False) are left out of the inverse, so the sums
    through it (the combine, the gather's backward) never read them. Only with the inverse map
    (eager CUDA, float dtypes): the gather and combine by ids would read every row."""
    tokens = x.shape[0]
    if not _rows_kernel_applies(x):
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
    if not _rows_kernel_applies(x):
        return ExpertRows(ids, tokens, None)
    inverse = torch.where(positions >= 0, slots * table.shape[1] + positions, -1).int()  # (T, k)
    return ExpertRows(ids, tokens, inverse)


# Batch dims of size 1 are dropped with squeeze(0), never [0]: select's backward would zero-fill
# and copy a whole (rows, D) gradient in eager mode (squeeze's is a view).
def gather_rows(x: Tensor, rows: ExpertRows) -> Tensor:
    """x (T, D) -> x[rows.ids] (R, D): gather_tokens, with the backward summing token-major."""
    if rows.inverse is None:
        return gather_tokens(x.unsqueeze(0), rows.ids.unsqueeze(0)).squeeze(0)
    from mode.kernels.rows import GatherRows

    return GatherRows.apply(x, rows.ids, rows.inverse)


def combine_rows(ys: Tensor, gates: Tensor | None, rows: ExpertRows) -> Tensor:
    """ys (R, D), gates (R,) -> (T, D) in ys' dtype: out[t] = sum of gates[r] * ys[r] over t's rows;
    gates None: the rows as they are (the experts applied the gates, Experts.gates_in_activation).

    The kernel multiplies by the float32 gate and sums in float32, rounding once; the PyTorch
    branch rounds the gate to ys' dtype and sums in it (combine_tokens): equal up to that rounding.
    """
    if rows.inverse is None:
        weighted = ys if gates is None else gates.to(ys.dtype).unsqueeze(-1) * ys  # (R, D)
        return combine_tokens(rows.ids.unsqueeze(0), weighted.unsqueeze(0), rows.tokens).squeeze(0)
    from mode.kernels.rows import CombineRows, SumRows

    if gates is None:
        return SumRows.apply(ys, rows.ids, rows.inverse)
    return CombineRows.apply(ys, gates, rows.ids, rows.inverse)


def expert_choice_kernel_applies(x: Tensor, weight: Tensor, bias: Tensor | None, groups: int) -> bool:
    """x (N, D) routed in `groups` equal runs by a router of weight (S, D): where expert choice's
    router head, layout and gather run as one autograd function (mode/kernels/expert_choice.py,
    its backward adding the router's input gradient into the gather's): the row kernels apply and
    the policy allows the "expert_choice" kernels."""
    if not (bias is None and _rows_kernel_applies(x) and use_triton(x, "expert_choice")):
        return False
    from mode.kernels.expert_choice import fits

    return fits(x.shape[0], groups, weight.shape[0])


def expert_choice_dispatch(x: Tensor, weight: Tensor, groups: int, n_experts: int, capacity: int,
                           z_weight: float) -> "Dispatch":
    """Expert choice in one autograd function (where expert_choice_kernel_applies): x (N, D) in `groups`
    equal runs, router weight (S, D), the first n_experts slots real -> mode.kernels.expert_choice.Dispatch:
    the rows x[ids] (E*G*C, D) expert-major, gates (G, E, C), aux = z_weight * z-loss, indices (G, E, C),
    ids, the inverse map (N, E) and the statistics. The same routing as ExpertChoiceRouter.forward,
    expert_major_ids, expert_choice_rows and gather_rows (the selection bit for bit)."""
    from mode.kernels.expert_choice import expert_choice_dispatch as dispatch

    with torch.autocast(device_type=x.device.type, enabled=False):
        with torch.no_grad():  # the function's backward owns the scores' gradient path
            logits = router_scores(x, weight)  # (N, S) float32
        return dispatch(x, weight, logits, groups, n_experts, capacity, z_weight, _half_router_applies(x, weight))


# ----------------------------------------------------------------------------- router scores
# Routers score in float32 so that top-k and the gates see unrounded scores. When the input and
# the weight are already bfloat16 (bf16 parameters, as DeepSpeed's bf16 training keeps them), the
# float32 product of the two equals a bf16 GEMM that accumulates and writes float32: the same
# exact products, summed in float32. On CUDA that GEMM (torch.mm with out_dtype) reads x once,
# instead of writing a float32 copy of the whole (tokens, D) activation and reading it back,
# which in the backward also meant a float32 (tokens, D) input gradient cast down to bf16.


def _half_router_applies(x: Tensor, weight: Tensor) -> bool:
    return x.dtype == weight.dtype == torch.bfloat16 and on_kernel_device(x)


class _HalfRouterScores(torch.autograd.Function):
    """scores = x @ w.T in float32 from bf16 x (M, D) and w (n, D), without a float32 copy of x.

    Backward: the float32 score gradient (M, n) is rounded to bf16 (a relative 2^-9 per entry, the
    rounding bf16 autocast gives any linear layer's backward) and both gradients come out of bf16
    GEMMs in the inputs' dtype: dx (M, D) = dscores @ w, dw (n, D) = dscores.T @ x.
    """

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor) -> Tensor:
        ctx.save_for_backward(x, weight)
        if x.is_cuda:
            return torch.mm(x, weight.t(), out_dtype=torch.float32)
        return x.float() @ weight.float().t()  # the same sums: CPU has no mm out_dtype kernel (tests run this)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor]:
        x, weight = ctx.saved_tensors
        grad = grad.to(x.dtype)
        return grad @ weight, grad.t() @ x


def router_scores(x: Tensor, weight: Tensor, bias: Tensor | None = None, half: bool = True) -> Tensor:
    """x (..., D), weight (n, D), bias (n,) or None -> float32 scores (..., n), whatever the autocast.

    half=False: never the bf16 GEMM, always a float32 copy of x (the tests' reference). Compiled,
    one score (a depth router) is a float32 product summed over D, which Inductor fuses into the
    kernel that wrote x instead of a GEMV reading x again; for several scores the GEMM is faster.
    """
    with torch.autocast(device_type=x.device.type, enabled=False):
        if weight.shape[0] == 1 and torch.compiler.is_compiling():
            scores = (x.float() * weight.float()).sum(-1, keepdim=True)  # (..., 1)
        elif half and _half_router_applies(x, weight):
            scores = _HalfRouterScores.apply(x.reshape(-1, x.shape[-1]), weight).view(*x.shape[:-1], -1)
        else:
            return torch.nn.functional.linear(x.float(), weight.float(), None if bias is None else bias.float())
        return scores if bias is None else scores + bias.float()


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


# ----------------------------------------------------------------------------- expert routing
def expert_major_ids(indices: Tensor, tokens_per_group: int) -> Tensor:
    """Expert choice (G, E, C) positions within groups -> (E, G*C) ids in the flattened (G*T) axis.

    Expert-major, so gather_tokens on x viewed as (1, G*T, D) yields (1, E, G*C, D) directly:
    every expert's rows are contiguous, ready for one batched matmul.
    """
    groups = indices.shape[0]
    offsets = torch.arange(0, groups * tokens_per_group, tokens_per_group, device=indices.device)  # (G,)
    return (indices + offsets.view(groups, 1, 1)).transpose(0, 1).reshape(indices.shape[1], -1)


def top_k_slots(scores: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Token choice: the k largest scores over the last (slot) dim, and their slots: 2 x (..., k)."""
    if k == 1:  # a max reduction: on an H100, 4 us against top-k's 24 us for (16384, 8) scores
        values, slots = scores.max(dim=-1, keepdim=True)  # the first maximum: the lowest slot
        return values, slots
    if _compiled_on_cuda(scores):
        return scores.topk(k, dim=-1)
    # Equal scores go to the lowest slots, as torch.max and the kernel break ties (topk's choice
    # among them is unspecified): a stable sort of the few slots.
    values, slots = scores.sort(dim=-1, descending=True, stable=True)
    return values[..., :k], slots[..., :k]


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


def _softmax_topk_kernel_applies(logits: Tensor, k: int) -> bool:
    if not use_triton(logits, "softmax_topk"):
        return False
    from mode.kernels.softmax_topk import fits

    return fits(logits, k)


def token_choice_head(logits: Tensor, k: int, n_experts: int, capacity: int | None, lb_weight: float,
                      z_weight: float) -> TokenChoiceHead:
    """Token choice: logits (T, S) float32 -> each token's top-k slots of the softmax, the
    weighted auxiliary loss, and the per-slot statistics (an expert computes its first
    `capacity` choices; None: all of them).

    The same values either way: PyTorch's softmax, top_k_slots, count_ids,
    load_balancing_loss and router_z_loss (about 40 launches a pass), or (eager, CUDA) two Triton
    launches forward and one backward for all of them.
    """
    if _softmax_topk_kernel_applies(logits, k):
        from mode.kernels import softmax_topk as kernel

        gates, slots, aux, summary = kernel.token_choice_head(logits, k, n_experts, capacity, lb_weight, z_weight)
        scalars = summary[2 * logits.shape[1] :]
        return TokenChoiceHead(
            gates, slots, aux, scalars[kernel.LB], scalars[kernel.Z], scalars[kernel.SCALARS :], scalars[kernel.NOOP],
            scalars[kernel.DROPPED], scalars[kernel.PROCESSED_TOP1],
        )
    probs = logits.softmax(-1)  # (T, S)
    gates, slots = top_k_slots(probs, k)
    assignments = slots.numel()
    choices = count_ids(slots, logits.shape[1]).float()  # (S,)
    lb, z = load_balancing_loss(probs.mean(0), choices, assignments), router_z_loss(logits)
    chosen = choices[:n_experts]
    computed = chosen if capacity is None else chosen.clamp(max=capacity)
    return TokenChoiceHead(
        gates, slots, lb_weight * lb + z_weight * z, lb.detach(), z.detach(), computed,
        choices[n_experts:].sum() / assignments, (chosen - computed).sum() / assignments, computed.sum() / assignments,
    )


def token_choice_capacity(num_tokens: int, n_slots: int, top_k: int, capacity_factor: float) -> int:
    """Rows per expert under token choice: ceil(cf * T * top_k / n_slots), between 1 and T."""
    if not 0.0 < capacity_factor:
        raise ValueError(f"capacity_factor must be positive, got {capacity_factor}")
    exact = round(capacity_factor * num_tokens * top_k / n_slots, _CAPACITY_DECIMALS)  # 1.1 * 100 / 10: 11, not 12
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
        return torch.where(slots < n_experts, 0, -1)
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
    if capacity is not None and _rows_kernel_applies(x):
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


def dropless_rows(slots: Tensor, positions: Tensor, n_experts: int, x: Tensor
                  ) -> tuple[ExpertRows, Tensor, Tensor, Tensor | None]:
    """Token choice's sync-free dropless layout of the tokens x (T, D): every assignment a row,
    sorted by expert (sort_all_by_expert), the uncomputed ones last -> (ExpertRows over the N = T*k
    rows, gate_index (N,) each row's assignment or N where no expert computes it (the caller's
    padded zero gate), ends (E,) int32, and computed).

    With the inverse map (the row kernels: eager CUDA) the uncomputed rows are left out of it and
    computed is None; on eager CUDA the layout is two Triton launches (mode/kernels/sort_rows.py, a
    counting sort) instead of about 17 PyTorch ops. Without it (torch.compile) the gather's backward
    and the combine read every row: computed (N,) bool is returned for the experts to mask with."""
    tokens, top_k = slots.shape
    inverse_map = _rows_kernel_applies(x)
    if inverse_map:
        from mode.kernels import sort_rows

        if sort_rows.fits(slots.numel(), n_experts):
            ids, gate_index, inverse, ends = sort_rows.dropless_rows(slots, positions, n_experts)
            return ExpertRows(ids, tokens, inverse), gate_index, ends, None
    order, computed, ends = sort_all_by_expert(slots, positions, n_experts)
    gate_index = torch.where(computed, order, slots.numel())
    if inverse_map:
        return rows_by_slot(order // top_k, order % top_k, top_k, x, computed), gate_index, ends, None
    return ExpertRows(order // top_k, tokens, None), gate_index, ends, computed


def count_ids(ids: Tensor, n: int) -> Tensor:
    """How often each of 0..n-1 occurs in ids: (n,) int64. bincount with a static shape (ids < n).

    torch.bincount's output size depends on the data, which splits a torch.compile graph (and
    its CUDA graphs) in two; here the size is n whatever the ids.
    """
    flat = ids.reshape(-1)
    return torch.zeros(n, dtype=torch.long, device=ids.device).scatter_add_(0, flat, torch.ones_like(flat))


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
