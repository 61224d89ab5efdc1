"""Token choice's router head in two Triton launches forward and one backward: softmax over the
slots, top-k slots per token, the weighted auxiliary loss and the per-slot statistics.

PyTorch runs the same as a chain of small kernels over the (tokens, slots) logits: softmax,
top-k (or max), a logsumexp for the z-loss (itself several kernels), the mean probability of
every slot and a count of every slot's choices for the load-balancing loss, the weighted sum
of the two losses, and the shares the statistics report; the backward runs the softmax's and
logsumexp's backward and sums them. In eager mode each of those is a kernel launch from the
host, and token choice without a capacity (dropless) waits for the host once per layer (its
grouped GEMMs take their group sizes there), so the launches add up to the layer's time:

- _forward, one program per BLOCK_T tokens with all their slots in registers: gates (T, k)
  and slots (T, k) (the top-k of the softmax, ties to the lower slot), and per program its
  tokens' share of each slot's mean probability, its count of each slot's choices and its
  share of the mean logsumexp^2;
- _finalize, one program: those partial sums added in a fixed order (deterministic, no
  atomics), then the load-balancing loss, the z-loss, the weighted auxiliary loss, the
  no-op, dropped and computed shares and each expert's computed rows (its first `capacity`
  choices);
- _backward: the logits' gradient from the gates' and the auxiliary loss's gradients, the
  softmax recomputed from the logits in registers (the choice counts are constants).

Eager mode on CUDA only (mode.kernels.use_triton); torch.compile fuses the PyTorch ops itself.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, softmax_rows

# Slots held in one program's registers; more (an unusually wide router) take the PyTorch path.
MAX_SLOTS = 256
MAX_K = 8


@triton.jit
def _forward(logits_ptr, gates_ptr, slots_ptr, partial_ptr, tokens, n_slots, inv_tokens,
             K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_S)
    probs, lse, row_ok, mask = softmax_rows(logits_ptr, rows, cols, tokens, n_slots)
    remaining = tl.where(mask, probs, -1.0)  # probabilities are >= 0: -1 is never chosen
    # A NaN probability (a NaN logit) ranks above every other, as PyTorch ranks NaN: 2.0 here, a
    # gate of NaN when chosen. (Compared as NaN, it matched no maximum: one slot chosen K times.)
    remaining = tl.where(remaining != remaining, 2.0, remaining)
    choices = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(remaining, axis=1)
        # the lowest slot holding the maximum (the PyTorch path's choice on ties: top_k_slots)
        slot = tl.min(tl.where(remaining == best[:, None], cols[None, :], BLOCK_S), axis=1)
        slot = tl.minimum(slot, n_slots - 1)  # a row past the end matches nothing: keep the slot in range
        tl.store(gates_ptr + rows * K + j, tl.where(best > 1.5, float("nan"), best), mask=row_ok)
        tl.store(slots_ptr + rows * K + j, slot.to(tl.int64), mask=row_ok)
        hit = (cols[None, :] == slot[:, None]) & row_ok[:, None]
        choices += tl.sum(hit.to(tl.float32), axis=0)
        remaining = tl.where(hit, -2.0, remaining)
    out = partial_ptr + pid.to(tl.int64) * (2 * n_slots + 1)
    col_ok = cols < n_slots
    tl.store(out + cols, tl.sum(probs, axis=0) * inv_tokens, mask=col_ok)  # means once summed
    tl.store(out + n_slots + cols, choices, mask=col_ok)
    tl.store(out + 2 * n_slots, tl.sum(tl.where(row_ok, lse * lse, 0.0), axis=0) * inv_tokens)


# The summary _finalize writes, after the (2 S) per-slot sums: scalars, then the E experts' rows.
# Python ints for the callers, and the same as constexprs for the kernel (Triton reads no other globals).
Z, LB, NOOP, DROPPED, PROCESSED_TOP1, SCALARS = 0, 1, 2, 3, 4, 5
_Z, _LB, _NOOP, _DROPPED, _PROCESSED_TOP1, _SCALARS = (tl.constexpr(i) for i in range(6))


@triton.jit
def _finalize(partial_ptr, summary_ptr, aux_ptr, programs, n_slots, n_experts, capacity, inv_assignments,
              lb_weight, z_weight, BLOCK_P: tl.constexpr, BLOCK_S: tl.constexpr):
    """One program: the programs' partial sums added in a fixed order, then the losses and statistics."""
    cols = tl.arange(0, BLOCK_S)
    col_ok = cols < n_slots
    width = 2 * n_slots + 1
    prob_mean = tl.zeros((BLOCK_S,), dtype=tl.float32)
    choices = tl.zeros((BLOCK_S,), dtype=tl.float32)
    z_parts = tl.zeros((BLOCK_P,), dtype=tl.float32)
    for start in range(0, programs, BLOCK_P):
        rows = start + tl.arange(0, BLOCK_P)
        row_ok = rows < programs
        tile = partial_ptr + rows[:, None].to(tl.int64) * width + cols[None, :]
        mask = row_ok[:, None] & col_ok[None, :]
        prob_mean += tl.sum(tl.load(tile, mask=mask, other=0.0), axis=0)
        choices += tl.sum(tl.load(tile + n_slots, mask=mask, other=0.0), axis=0)
        z_parts += tl.load(partial_ptr + rows.to(tl.int64) * width + 2 * n_slots, mask=row_ok, other=0.0)
    z = tl.sum(z_parts, axis=0)
    lb = tl.sum(prob_mean * choices, axis=0) * (n_slots * inv_assignments)  # Switch: n_slots * sum f_s P_s
    real = cols < n_experts
    computed = tl.where(capacity >= 0, tl.minimum(choices, capacity * 1.0), choices)  # an expert's first C
    tl.store(summary_ptr + cols, prob_mean, mask=col_ok)
    tl.store(summary_ptr + n_slots + cols, choices, mask=col_ok)
    scalars = summary_ptr + 2 * n_slots
    tl.store(scalars + _Z, z)
    tl.store(scalars + _LB, lb)
    tl.store(scalars + _NOOP, tl.sum(tl.where(col_ok & ~real, choices, 0.0), axis=0) * inv_assignments)
    tl.store(scalars + _DROPPED, tl.sum(tl.where(real, choices - computed, 0.0), axis=0) * inv_assignments)
    tl.store(scalars + _PROCESSED_TOP1, tl.sum(tl.where(real, computed, 0.0), axis=0) * inv_assignments)
    tl.store(scalars + _SCALARS + cols, computed, mask=real)
    tl.store(aux_ptr, lb_weight * lb + z_weight * z)


@triton.jit
def _backward(logits_ptr, slots_ptr, grad_gates_ptr, summary_ptr, grad_aux_ptr, grad_logits_ptr, tokens, n_slots,
              inv_tokens, lb_scale, z_weight, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_S)
    probs, lse, row_ok, mask = softmax_rows(logits_ptr, rows, cols, tokens, n_slots)
    grad_aux = tl.load(grad_aux_ptr)
    # aux = lb_weight * lb + z_weight * z, lb = lb_scale * sum_s choices_s * prob_mean_s (choices
    # are counts: constant), prob_mean_s = mean over tokens of p[t, s], z = mean over tokens of lse^2.
    choices = tl.load(summary_ptr + n_slots + cols, mask=cols < n_slots, other=0.0)
    grad_probs = (grad_aux * lb_scale * inv_tokens) * choices[None, :] + tl.zeros_like(probs)
    for j in tl.static_range(K):  # a chosen probability is also that token's gate
        slot = tl.load(slots_ptr + rows * K + j, mask=row_ok, other=-1)
        grad_gate = tl.load(grad_gates_ptr + rows * K + j, mask=row_ok, other=0.0)
        grad_probs += tl.where(cols[None, :] == slot[:, None], grad_gate[:, None], 0.0)
    # softmax backward, plus d(lse^2)/dlogits = 2 lse p
    inner = tl.sum(probs * grad_probs, axis=1)
    grad_lse_sq = grad_aux * z_weight * inv_tokens
    grad = probs * (grad_probs - inner[:, None]) + (2.0 * grad_lse_sq) * lse[:, None] * probs
    tl.store(grad_logits_ptr + rows[:, None] * n_slots + cols[None, :], grad, mask=mask)


def _launch(tokens: int, n_slots: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_S, programs): about 2048 logits a program."""
    block_s = triton.next_power_of_2(n_slots)
    block_t = max(16, min(256, 2048 // block_s))
    return block_t, block_s, triton.cdiv(tokens, block_t)


class _TokenChoiceHead(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, k: int, n_experts: int, capacity: int | None, lb_weight: float,
                z_weight: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        tokens, n_slots = logits.shape
        block_t, block_s, programs = _launch(tokens, n_slots)
        gates = torch.empty(tokens, k, dtype=torch.float32, device=logits.device)
        slots = torch.empty(tokens, k, dtype=torch.long, device=logits.device)
        partial = torch.empty(programs, 2 * n_slots + 1, dtype=torch.float32, device=logits.device)
        summary = torch.empty(2 * n_slots + SCALARS + n_experts, dtype=torch.float32, device=logits.device)
        aux = torch.empty((), dtype=torch.float32, device=logits.device)
        inv_assignments = 1.0 / (tokens * k)
        with on_device_of(logits):
            _forward[(programs,)](logits, gates, slots, partial, tokens, n_slots, 1.0 / tokens,
                                  K=k, BLOCK_T=block_t, BLOCK_S=block_s)
            _finalize[(1,)](partial, summary, aux, programs, n_slots, n_experts, -1 if capacity is None else capacity,
                            inv_assignments, lb_weight, z_weight, BLOCK_P=32, BLOCK_S=block_s)
        ctx.save_for_backward(logits, slots, summary)
        ctx.lb_scale, ctx.z_weight = lb_weight * n_slots * inv_assignments, z_weight
        ctx.mark_non_differentiable(slots, summary)
        ctx.set_materialize_grads(False)  # unused outputs' gradients stay None: no zero tensors launched
        return gates, slots, aux, summary

    @staticmethod
    def backward(ctx, grad_gates: Tensor | None, _slots: None, grad_aux: Tensor | None,
                 _summary: None) -> tuple[Tensor, None, None, None, None, None]:
        logits, slots, summary = ctx.saved_tensors
        tokens, n_slots = logits.shape
        block_t, block_s, programs = _launch(tokens, n_slots)
        grad_gates = torch.zeros_like(slots, dtype=torch.float32) if grad_gates is None else grad_gates.float().contiguous()
        grad_aux = logits.new_zeros(()) if grad_aux is None else grad_aux.float()
        grad_logits = torch.empty_like(logits)
        with on_device_of(logits):
            _backward[(programs,)](logits, slots, grad_gates, summary, grad_aux, grad_logits, tokens, n_slots,
                                   1.0 / tokens, ctx.lb_scale, ctx.z_weight, K=slots.shape[1], BLOCK_T=block_t,
                                   BLOCK_S=block_s)
        return grad_logits, None, None, None, None, None


def fits(logits: Tensor, k: int) -> bool:
    """Whether the kernel takes these logits: float32 (tokens, slots), slots <= MAX_SLOTS, k <= MAX_K."""
    return logits.dtype == torch.float32 and logits.dim() == 2 and 0 < logits.shape[1] <= MAX_SLOTS and 0 < k <= min(MAX_K, logits.shape[1])


def token_choice_head(logits: Tensor, k: int, n_experts: int, capacity: int | None, lb_weight: float,
                      z_weight: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """logits (T, S) float32 -> gates (T, k), slots (T, k) int64, aux (), summary.

    gates, slots: the k largest softmax probabilities of each token, largest first, and their
    slots. aux = lb_weight * (Switch load-balancing loss) + z_weight * (z-loss), differentiable
    (with gates). summary (2 S + SCALARS + E,), not differentiable: each slot's mean probability
    and number of choices, then the scalars at Z, LB, NOOP, DROPPED, PROCESSED_TOP1 (shares of the
    T * k assignments; an expert computes its first `capacity` choices, all when None), then
    each real expert's computed rows.
    """
    if not fits(logits, k):
        raise ValueError(f"token_choice_head: needs float32 (tokens, slots <= {MAX_SLOTS}) logits and 0 < k <= "
                         f"min({MAX_K}, slots); got {tuple(logits.shape)} {logits.dtype}, k={k}")
    if not 0 < n_experts <= logits.shape[1]:
        raise ValueError(f"token_choice_head: n_experts must be in [1, {logits.shape[1]}], got {n_experts}")
    return _TokenChoiceHead.apply(logits.contiguous(), k, n_experts, capacity, float(lb_weight), float(z_weight))
