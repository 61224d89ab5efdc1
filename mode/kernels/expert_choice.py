"""Expert choice's dispatch as one autograd function: the router head, the selection and the
gather forward; the head's backward, and the router's input gradient summed with the gather's.

PyTorch runs expert choice's routing as about 35 small kernels a pass on (tokens, slots)
tensors (the softmax's transpose copied for the top-k, the gates' gather, a logsumexp for the
z-loss that is itself eight kernels, a token mask for the statistics, the expert-major ids and
the rows' inverse map), their backward as a dozen more, and the router's input gradient as its
own GEMM whose (tokens, D) result autograd then adds to the gather's gradient in another pass
over (tokens, D). Here, from the router's float32 scores and PyTorch's softmax of them (so the
selection is the PyTorch path's bit for bit):

- _select, one program per (group, expert): the top-C tokens of that expert's probabilities
  (mode/kernels/topk.row_top_k: positions in increasing order), written as the routing's indices
  (G, E, C), the expert-major ids (E*G*C,) of the rows, their gates, and the expert's column of
  the inverse map (tokens, E) (-1 where it did not choose the token); a 1 in a per-token byte for
  each token it takes (every expert that takes a token writes the same 1: no atomics); and the
  logsumexp^2 summed over its share of the group's tokens, for the z-loss;
- _finalize, one program: the z-loss, the weighted auxiliary loss and the statistics (the
  partial sums and the bytes added in a fixed order: deterministic);
- _backward: the scores' gradient from the gates' and the auxiliary loss's gradients (and, with
  copy or constant null experts, those of every token's no-op slot probabilities), the softmax
  recomputed from the scores in registers; then the gather's backward
  (mode/kernels/rows.sum_rows) adds the router's input gradient (scores' gradient @ weight) to
  each token's sum of its rows' gradients in the same pass, and the weight's gradient is one GEMM
  (float32 scores: mode/kernels/weighted_sums.py).

Eager mode on CUDA only (mode.kernels.use_triton); torch.compile fuses the PyTorch ops itself.
"""
from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, softmax_rows, store_rounded
from mode.kernels.rows import gather_rows_as, sum_rows
from mode.kernels.topk import MAX_TOKENS, row_top_k
from mode.kernels.weighted_sums import float32_weighted_row_sums

# Slots of a router held in one program's registers (the z-loss's and the backward's tiles).
MAX_SLOTS = 256
BLOCK_Z = 128  # tokens per step of a program's z-loss share


def select_warps(block: int) -> int:
    """_select's warps for rows of `block` tokens: many for long rows (the stores after the top-k
    want them, though the top-k alone would not); short rows: fewer."""
    return max(4, min(16, block // 128))


# The summary _finalize writes: scalars, then each expert's rows. Python ints for the callers and
# the same as constexprs for the kernel (Triton reads no other globals).
Z, PROCESSED, NOOP, ZERO, SCALARS = 0, 1, 2, 3, 4
_Z, _PROCESSED, _NOOP, _ZERO, _SCALARS = (tl.constexpr(i) for i in range(5))


@triton.jit
def _select(probs_ptr, logits_ptr, indices_ptr, ids_ptr, gates_ptr, inverse_ptr, taken_ptr, partial_ptr,
            groups, tokens, n_slots, n_experts, capacity, z_share,
            BLOCK: tl.constexpr, BLOCK_Z: tl.constexpr, BLOCK_S: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    e = tl.program_id(1).to(tl.int64)
    pos = tl.arange(0, BLOCK)
    valid = pos < tokens
    token = g * tokens + pos  # in the flattened batch
    score = tl.load(probs_ptr + token * n_slots + e, mask=valid, other=0.0)
    chosen, rank = row_top_k(score, pos, valid, capacity, BLOCK)
    row = (e * groups + g) * capacity + rank  # expert-major: expert e's rows, group by group
    tl.store(indices_ptr + (g * n_experts + e) * capacity + rank, pos.to(tl.int64), mask=chosen)
    tl.store(ids_ptr + row, token, mask=chosen)
    tl.store(gates_ptr + row, score, mask=chosen)
    tl.store(inverse_ptr + token * n_experts + e, tl.where(chosen, row, -1).to(tl.int32), mask=valid)
    tl.store(taken_ptr + token, 1, mask=chosen)  # every expert that takes the token writes the same 1
    # The z-loss: logsumexp^2 summed over this program's share of the group's tokens.
    cols = tl.arange(0, BLOCK_S)
    first = e * z_share
    end = g * tokens + tl.minimum(first + z_share, tokens)  # rows below it are this program's
    acc = tl.zeros((BLOCK_Z,), dtype=tl.float32)
    for start in range(0, z_share, BLOCK_Z):
        rows = g * tokens + first + start + tl.arange(0, BLOCK_Z)
        _, lse, row_ok, _ = softmax_rows(logits_ptr, rows, cols, end, n_slots)
        acc += tl.where(row_ok, lse * lse, 0.0)
    tl.store(partial_ptr + g * n_experts + e, tl.sum(acc, axis=0))


@triton.jit
def _finalize(partial_ptr, taken_ptr, summary_ptr, aux_ptr, programs, n_tokens, n_experts, rows_per_expert, inv_tokens,
              z_weight, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr):
    """One program: the z-loss (partial sums added in a fixed order), the auxiliary loss, the statistics."""
    parts = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):
        p = start + tl.arange(0, BLOCK_P)
        parts += tl.load(partial_ptr + p, mask=p < programs, other=0.0)
    z = tl.sum(parts, axis=0) * inv_tokens
    taken = tl.zeros((BLOCK_N,), dtype=tl.int32)
    for start in range(0, n_tokens, BLOCK_N):
        t = start + tl.arange(0, BLOCK_N)
        taken += tl.load(taken_ptr + t, mask=t < n_tokens, other=0).to(tl.int32)
    processed = tl.sum(taken, axis=0).to(tl.float32) * inv_tokens
    tl.store(summary_ptr + _Z, z)
    tl.store(summary_ptr + _PROCESSED, processed)
    tl.store(summary_ptr + _NOOP, 1.0 - processed)
    tl.store(summary_ptr + _ZERO, 0.0)
    for start in range(0, n_experts, BLOCK_E):
        e = start + tl.arange(0, BLOCK_E)
        tl.store(summary_ptr + _SCALARS + e, tl.zeros((BLOCK_E,), dtype=tl.float32) + rows_per_expert,
                 mask=e < n_experts)
    tl.store(aux_ptr, z_weight * z)


@triton.jit
def _backward(logits_ptr, inverse_ptr, grad_gates_ptr, grad_aux_ptr, grad_null_ptr, grad_logits_ptr, tokens, n_slots,
              n_experts, z_scale, HAS_AUX: tl.constexpr, HAS_NULL: tl.constexpr, BLOCK_T: tl.constexpr,
              BLOCK_S: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_S)
    probs, lse, row_ok, mask = softmax_rows(logits_ptr, rows, cols, tokens, n_slots)
    # A chosen (token, expert) pair's probability is its row's gate.
    row = tl.load(inverse_ptr + rows[:, None] * n_experts + cols[None, :],
                  mask=row_ok[:, None] & (cols < n_experts)[None, :], other=-1)
    grad_probs = tl.load(grad_gates_ptr + row, mask=row >= 0, other=0.0)
    if HAS_NULL:  # every token's no-op slot probabilities were outputs too (copy / constant null experts)
        n_null = n_slots - n_experts
        null = mask & (cols >= n_experts)[None, :]
        grad_probs += tl.load(grad_null_ptr + rows[:, None] * n_null + (cols - n_experts)[None, :], mask=null,
                              other=0.0)
    # softmax backward, plus the z-loss's: aux = z_weight * mean lse^2, d(lse^2)/dlogits = 2 lse p
    inner = tl.sum(probs * grad_probs, axis=1)
    grad = probs * (grad_probs - inner[:, None])
    if HAS_AUX:  # the auxiliary loss was used (otherwise its gradient is None: no zero made for it)
        grad += (tl.load(grad_aux_ptr) * z_scale) * lse[:, None] * probs
    store_rounded(grad_logits_ptr + rows[:, None] * n_slots + cols[None, :], grad, mask)


def _backward_launch(tokens: int, n_slots: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_S, programs): about 256 scores a program, 2 warps (the fastest tile tried)."""
    block_s = triton.next_power_of_2(n_slots)
    block_t = max(16, min(256, 256 // block_s))
    return block_t, block_s, triton.cdiv(tokens, block_t)


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, logits: Tensor, groups: int, n_experts: int, capacity: int,
                z_weight: float, half: bool, rows_dtype: torch.dtype, null: bool) -> tuple[Tensor, ...]:
        n_tokens, n_slots = logits.shape
        tokens = n_tokens // groups
        device = logits.device
        # PyTorch's softmax: the selection is the PyTorch path's, bit for bit.
        probs = logits.softmax(-1)  # (N, S)
        n_rows = n_experts * groups * capacity
        indices = torch.empty(groups, n_experts, capacity, dtype=torch.long, device=device)
        ids = torch.empty(n_rows, dtype=torch.long, device=device)
        gates = torch.empty(n_experts, groups, capacity, dtype=torch.float32, device=device)  # expert-major
        inverse = torch.empty(n_tokens, n_experts, dtype=torch.int32, device=device)
        taken = torch.zeros(n_tokens, dtype=torch.int8, device=device)  # 1: some expert took the token
        partial = torch.empty(groups * n_experts, dtype=torch.float32, device=device)
        summary = torch.empty(SCALARS + n_experts, dtype=torch.float32, device=device)
        aux = torch.empty((), dtype=torch.float32, device=device)
        block = triton.next_power_of_2(tokens)
        with on_device_of(logits):
            _select[(groups, n_experts)](
                probs, logits, indices, ids, gates, inverse, taken, partial, groups, tokens, n_slots, n_experts,
                capacity, triton.cdiv(tokens, n_experts), BLOCK=block, BLOCK_Z=BLOCK_Z,
                BLOCK_S=triton.next_power_of_2(n_slots), num_warps=select_warps(block),
            )
            _finalize[(1,)](partial, taken, summary, aux, groups * n_experts, n_tokens, n_experts,
                            float(groups * capacity), 1.0 / n_tokens, z_weight, BLOCK_P=64, BLOCK_N=2048, BLOCK_E=64,
                            num_warps=8)
            rows = x.index_select(0, ids) if rows_dtype == x.dtype else gather_rows_as(x, ids, rows_dtype)  # (R, D)
        # null: every token's no-op slot probabilities (N, S - E), an output with a gradient path
        null_probs = probs[:, n_experts:].contiguous() if null else probs.new_empty(0)
        ctx.save_for_backward(x, weight, logits, inverse)
        ctx.z_scale, ctx.half, ctx.n_rows = 2.0 * z_weight / n_tokens, half, n_rows
        ctx.mark_non_differentiable(indices, ids, inverse, summary)
        ctx.set_materialize_grads(False)  # unused outputs' gradients stay None: no zero tensors launched
        return rows, gates, aux, null_probs, indices, ids, inverse, summary

    @staticmethod
    def backward(ctx, grad_rows: Tensor | None, grad_gates: Tensor | None, grad_aux: Tensor | None,
                 grad_null: Tensor | None, *_: None) -> tuple[Tensor | None, ...]:
        x, weight, logits, inverse = ctx.saved_tensors
        n_tokens, n_slots = logits.shape
        # bf16 router (routing.router_scores): the scores' gradient rounded to bf16 for bf16 GEMMs;
        # otherwise float32 GEMMs, as F.linear on float32 copies computes them.
        grad_logits = torch.empty(n_tokens, n_slots, dtype=x.dtype if ctx.half else torch.float32, device=x.device)
        # Outputs the loss did not use get no gradient (None): zeros in their place.
        grad_gates = logits.new_zeros(ctx.n_rows) if grad_gates is None else grad_gates.float().contiguous()
        grad_rows = x.new_zeros(ctx.n_rows, x.shape[1]) if grad_rows is None else grad_rows
        block_t, block_s, programs = _backward_launch(n_tokens, n_slots)
        with on_device_of(x), torch.autocast(x.device.type, enabled=False):
            _backward[(programs,)](logits, inverse, grad_gates, logits if grad_aux is None else grad_aux.float(),
                                   logits if grad_null is None else grad_null.float().contiguous(), grad_logits,
                                   n_tokens, n_slots, inverse.shape[1], ctx.z_scale, HAS_AUX=grad_aux is not None,
                                   HAS_NULL=grad_null is not None, BLOCK_T=block_t, BLOCK_S=block_s, num_warps=2)
            grad_x = sum_rows(grad_rows, None, inverse, grad_logits, weight if ctx.half else weight.float(),
                              out_dtype=x.dtype)
            if ctx.half:
                grad_weight = grad_logits.t() @ x  # (S, D)
            else:
                grad_weight = float32_weighted_row_sums(grad_logits, x)  # (S, D)
        return grad_x, grad_weight.to(weight.dtype), None, None, None, None, None, None, None, None


class Dispatch(NamedTuple):
    """expert_choice_dispatch's result. rows (R, D) = x[ids], R = E*G*C, expert-major; gates
    (G, E, C) float32, a view of expert-major (E, G, C) memory; aux () = z_weight * z-loss; null_probs
    (N, S - E) float32, every token's no-op slot probabilities, or None where not asked for (these
    three differentiable); logits (N, S) the router's scores (no gradient path); indices (G, E, C)
    int64 positions in each group, increasing; ids (R,) int64; inverse (N, E) int32: token t's row
    for expert e, -1 for none; summary: the statistics, read through the properties below."""

    rows: Tensor
    gates: Tensor
    aux: Tensor
    null_probs: Tensor | None
    logits: Tensor
    indices: Tensor
    ids: Tensor
    inverse: Tensor
    summary: Tensor

    @property
    def z_loss(self) -> Tensor:
        return self.summary[Z]

    @property
    def processed(self) -> Tensor:
        """The share of tokens some expert took."""
        return self.summary[PROCESSED]

    @property
    def noop_fraction(self) -> Tensor:
        """The share of tokens no expert took (they ride the residual)."""
        return self.summary[NOOP]

    @property
    def zero(self) -> Tensor:
        """A 0 for the statistics expert choice has by construction (dropped tokens, load-balancing loss)."""
        return self.summary[ZERO]

    @property
    def tokens_per_expert(self) -> Tensor:
        """(E,) float32: G * C each."""
        return self.summary[SCALARS:]


def fits(n_tokens: int, groups: int, n_slots: int) -> bool:
    """Whether the kernels take this routing: a group's tokens sort in one program, slots fit a tile."""
    return n_tokens % groups == 0 and 0 < n_tokens // groups <= MAX_TOKENS and 0 < n_slots <= MAX_SLOTS


def expert_choice_dispatch(x: Tensor, weight: Tensor, logits: Tensor, groups: int, n_experts: int, capacity: int,
                           z_weight: float, half: bool, rows_dtype: torch.dtype | None = None,
                           null_gates: bool = False) -> Dispatch:
    """Expert choice over `groups` equal runs of the N tokens of x (N, D): each of the first n_experts
    of the S slots of logits (N, S) (float32 router scores, x @ weight.T: the gradient's path goes
    through x and weight (S, D), not through logits) takes the `capacity` tokens of each group with
    the largest softmax probability. half: the scores came from a bf16 GEMM (the backward's GEMMs
    in bf16 too); otherwise from float32 copies. rows_dtype: the rows' dtype (None: x's), rounded to
    nearest even; their gradient is summed into x's dtype. null_gates: also every token's no-op slot
    probabilities (copy / constant null experts), their gradient added to the scores'."""
    n_tokens, n_slots = logits.shape
    if not fits(n_tokens, groups, n_slots) or not 0 < n_experts <= n_slots or not 0 < capacity <= n_tokens // groups:
        raise ValueError(f"expert_choice_dispatch: {n_tokens} tokens in {groups} groups (at most {MAX_TOKENS} a group), "
                         f"{n_slots} slots (at most {MAX_SLOTS}), {n_experts} experts, capacity {capacity}")
    out = _Dispatch.apply(x.contiguous(), weight, logits.detach().contiguous(), groups, n_experts, capacity,
                          float(z_weight), half, rows_dtype or x.dtype, null_gates)
    rows, gates, aux, null_probs, indices, ids, inverse, summary = out
    return Dispatch(rows, gates.transpose(0, 1), aux, null_probs if null_gates else None, logits, indices, ids,
                    inverse, summary)
