"""Row moves: gather the chosen tokens of x (G, T, D), add updates back, combine into zeros.

Rows are moved with index_select one way and scatter_add the other, in both directions of
autograd: index_select's own backward (and index_add) accumulate through a slower atomic kernel.
In eager mode small autograd functions do it, some in place. Under torch.compile the rows move by
plain ops (gather with the ids broadcast along the row, scatter_add, index_put), which Inductor
fuses and reinplaces; the in-place functions are not traced, because torch 2.11 compiles their
backward wrongly.
"""
from __future__ import annotations

import torch
from torch import Tensor

from mode.routing.selection import flat_indices


def add_rows(out: Tensor, flat: Tensor, rows: Tensor) -> Tensor:
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
        return add_rows(grad.new_zeros(ctx.num_rows, grad.shape[1]), flat, grad), None


class _ScatterAddRows(torch.autograd.Function):
    """out = x with updates[i] added to row flat[i]; the updates' gradient is a gather (index_select)."""

    @staticmethod
    def forward(ctx, x: Tensor, flat: Tensor, updates: Tensor) -> Tensor:
        ctx.save_for_backward(flat)
        return add_rows(x.clone(), flat, updates)

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
        return add_rows_to_gradient(grad_x, flat, grad_rows, ctx.grad_in_place), None, None


class _SplitRowsTraced(torch.autograd.Function):
    """_SplitRows under torch.compile: x (N, D) -> (the rows x[flat] (M, D), x). Functional ops
    only (see the module docstring).

    The backward adds the rows' gradient into x's with index_put(accumulate), which Inductor does
    in place on the incoming gradient; traced as plain ops, autograd would sum x's gradient with a
    zero-filled (N, D) one holding the rows'.
    """

    @staticmethod
    def forward(ctx, x: Tensor, flat: Tensor) -> tuple[Tensor, Tensor]:
        ctx.save_for_backward(flat)
        return x.index_select(0, flat), x.view_as(x)

    @staticmethod
    def backward(ctx, grad_rows: Tensor, grad_x: Tensor) -> tuple[Tensor, None]:
        (flat,) = ctx.saved_tensors
        return grad_x.index_put((flat,), grad_rows.to(grad_x.dtype), accumulate=True), None


def add_rows_to_gradient(grad_x: Tensor, flat: Tensor, grad_rows: Tensor, in_place: bool) -> Tensor:
    """x's gradient (G, T, D) with the chosen rows' gradient (M, D) added at flat: into grad_x itself
    where the caller owns it (in_place, contiguous), else into a copy (an incoming gradient may be
    shared: x + y hands one tensor to both)."""
    grad = grad_x if in_place and grad_x.is_contiguous() else grad_x.clone(memory_format=torch.contiguous_format)
    add_rows(grad.view(-1, grad.shape[-1]), flat, grad_rows.to(grad.dtype))
    return grad


class _AddRowsInPlace(torch.autograd.Function):
    """x (G, T, D), contiguous, with updates[i] added to row flat[i] in its own memory; the
    updates' gradient is a gather, x's passes through."""

    @staticmethod
    def forward(ctx, x: Tensor, flat: Tensor, updates: Tensor) -> Tensor:
        ctx.save_for_backward(flat)
        ctx.mark_dirty(x)
        add_rows(x.view(-1, x.shape[-1]), flat, updates)
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
        return add_rows(updates.new_zeros(num_rows, updates.shape[1]), flat, updates)

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
    gradient is added into it without the copy. Eager mode; under torch.compile plain ops.
    """
    if torch.compiler.is_compiling():
        groups, tokens, width = x.shape
        flat = flat_indices(indices, tokens)
        rows, residual = _SplitRowsTraced.apply(x.reshape(groups * tokens, width), flat)
        return rows.view(*indices.shape, width), residual.view(groups, tokens, width)  # (G, ..., k, D), (G, T, D)
    rows, residual = _SplitRows.apply(x, flat_indices(indices, x.shape[1]), grad_in_place)
    return rows.view(*indices.shape, x.shape[-1]), residual  # (G, ..., k, D), (G, T, D)


def gather_tokens(x: Tensor, indices: Tensor) -> Tensor:
    """x (G, T, D), indices (G, ..., k) -> the chosen tokens (G, ..., k, D)."""
    groups, tokens, width = x.shape
    flat = flat_indices(indices, tokens)
    rows = x.reshape(groups * tokens, width)
    if torch.compiler.is_compiling():  # plain ops (see the module docstring)
        return rows.gather(0, flat.unsqueeze(1).expand(-1, width)).view(*indices.shape, width)
    return _GatherRows.apply(rows, flat).view(*indices.shape, width)


def scatter_add_tokens(x: Tensor, indices: Tensor, updates: Tensor, in_place: bool = False) -> Tensor:
    """Return x with updates (G, ..., k, D) added at indices (G, ..., k); other tokens bit-identical.

    Several updates for one token (a token chosen by several experts) are summed.
    in_place: add into x's own memory, where the caller owns x and nothing saved it for the
    backward (MoDBlock inside LanguageModel): no copy of the (G, T, D) residual. Eager mode and a
    contiguous x only; otherwise, and under torch.compile (which plans its own buffers), a copy.
    """
    groups, tokens, width = x.shape
    flat = flat_indices(indices, tokens)
    updates = updates.reshape(-1, width).to(x.dtype)  # (M, D)
    if torch.compiler.is_compiling():
        # index_put, not scatter_add: Inductor reinplaces it into x where nothing reads x later
        # (LanguageModel's residual stream), so no copy of the (G, T, D) residual is made.
        rows = x.reshape(groups * tokens, width)
        return rows.index_put((flat,), updates, accumulate=True).view(groups, tokens, width)
    if in_place and x.is_contiguous():
        return _AddRowsInPlace.apply(x, flat, updates)
    return _ScatterAddRows.apply(x.reshape(groups * tokens, width), flat, updates).view(groups, tokens, width)


def combine_tokens(indices: Tensor, updates: Tensor, tokens_per_group: int, into: Tensor | None = None) -> Tensor:
    """The updates (G, ..., k, D) summed into a zero (G, T, D) at indices (G, ..., k): an MoE's output.

    scatter_add_tokens on a zero tensor, without the copy of that zero tensor which keeps
    scatter_add_tokens' input unmodified (one pass over (G, T, D) fewer). Output in updates' dtype.
    into (G, T, D): summed into it instead (scatter_add_tokens; into's dtype), so that a caller
    adding the output to it needs no zero-filled tensor (compiled, no fill kernel) and no add.
    """
    if into is not None:
        return scatter_add_tokens(into, indices, updates)
    groups, width = indices.shape[0], updates.shape[-1]
    flat = flat_indices(indices, tokens_per_group)
    rows = updates.reshape(-1, width)
    if torch.compiler.is_compiling():  # plain ops (see the module docstring)
        zeros = rows.new_zeros(groups * tokens_per_group, width)
        return zeros.scatter_add(0, flat.unsqueeze(1).expand_as(rows), rows).view(groups, tokens_per_group, width)
    return _CombineRows.apply(rows, flat, groups * tokens_per_group).view(groups, tokens_per_group, width)
