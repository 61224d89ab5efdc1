"""Token choice's router head as one Triton kernel each way: softmax over the slots, top-k slots
per token, and the sums its auxiliary losses and statistics need.

PyTorch runs the same as a chain of small kernels over the (tokens, slots) logits: softmax,
top-k (or max), a logsumexp for the z-loss (itself several kernels), the mean probability of
every slot and a count of every slot's choices for the load-balancing loss; the backward runs
the softmax's and logsumexp's backward and sums them. In eager mode each of those is a kernel
launch from the host, and token choice without a capacity (dropless) waits for the host once
per layer (its grouped GEMMs take their group sizes there), so the launches add up to the
layer's time. Here one program takes BLOCK_T tokens with all their slots in registers:

- forward: gates (T, k) and slots (T, k) (the top-k of the softmax, ties to the lower slot),
  and per program its tokens' share of each slot's mean probability, its count of each slot's
  choices, and its share of the mean logsumexp^2; one `sum` over programs then adds them in a
  fixed order (deterministic, no atomics);
- backward: the logits' gradient from the gates', the mean probabilities' and the z-loss's
  gradients, the softmax recomputed from the logits in registers.

Eager mode on CUDA only (mode.kernels.use_triton); torch.compile fuses the PyTorch ops itself.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of

# Slots held in one program's registers; more (an unusually wide router) take the PyTorch path.
MAX_SLOTS = 256
MAX_K = 8


@triton.jit
def _softmax_rows(logits_ptr, rows, cols, tokens, n_slots):
    """Load a (BLOCK_T, BLOCK_S) tile: probabilities (0 outside), logsumexp per row, masks."""
    row_ok = rows < tokens
    mask = row_ok[:, None] & (cols < n_slots)[None, :]
    logits = tl.load(logits_ptr + rows[:, None] * n_slots + cols[None, :], mask=mask, other=float("-inf"))
    top = tl.where(row_ok, tl.max(logits, axis=1), 0.0)  # rows past the end: no -inf - -inf
    e = tl.where(mask, tl.exp(logits - top[:, None]), 0.0)
    total = tl.where(row_ok, tl.sum(e, axis=1), 1.0)
    probs = e / total[:, None]
    lse = top + tl.log(total)
    return probs, lse, row_ok, mask


@triton.jit
def _forward(logits_ptr, gates_ptr, slots_ptr, partial_ptr, tokens, n_slots, inv_tokens,
             K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_S)
    probs, lse, row_ok, mask = _softmax_rows(logits_ptr, rows, cols, tokens, n_slots)
    remaining = tl.where(mask, probs, -1.0)  # probabilities are >= 0: -1 is never chosen
    choices = tl.zeros((BLOCK_S,), dtype=tl.float32)
    for j in tl.static_range(K):
        best = tl.max(remaining, axis=1)
        # the lowest slot holding the maximum (torch.max's and torch.topk's choice on ties)
        slot = tl.min(tl.where(remaining == best[:, None], cols[None, :], BLOCK_S), axis=1)
        slot = tl.minimum(slot, n_slots - 1)  # NaN logits match nothing: keep the slot in range
        tl.store(gates_ptr + rows * K + j, best, mask=row_ok)
        tl.store(slots_ptr + rows * K + j, slot.to(tl.int64), mask=row_ok)
        hit = (cols[None, :] == slot[:, None]) & row_ok[:, None]
        choices += tl.sum(hit.to(tl.float32), axis=0)
        remaining = tl.where(hit, -2.0, remaining)
    out = partial_ptr + pid.to(tl.int64) * (2 * n_slots + 1)
    col_ok = cols < n_slots
    tl.store(out + cols, tl.sum(probs, axis=0) * inv_tokens, mask=col_ok)  # means once summed
    tl.store(out + n_slots + cols, choices, mask=col_ok)
    tl.store(out + 2 * n_slots, tl.sum(tl.where(row_ok, lse * lse, 0.0), axis=0) * inv_tokens)


@triton.jit
def _backward(logits_ptr, slots_ptr, grad_gates_ptr, grad_mean_ptr, grad_z, grad_logits_ptr, tokens, n_slots,
              inv_tokens, K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_S: tl.constexpr):
    pid = tl.program_id(0)
    rows = pid.to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_S)
    probs, lse, row_ok, mask = _softmax_rows(logits_ptr, rows, cols, tokens, n_slots)
    # d/dp: every token's probability of slot s feeds the mean over tokens; a chosen one also its gate.
    grad_mean = tl.load(grad_mean_ptr + cols, mask=cols < n_slots, other=0.0) * inv_tokens
    grad_probs = grad_mean[None, :] + tl.zeros_like(probs)
    for j in tl.static_range(K):
        slot = tl.load(slots_ptr + rows * K + j, mask=row_ok, other=-1)
        grad_gate = tl.load(grad_gates_ptr + rows * K + j, mask=row_ok, other=0.0)
        grad_probs += tl.where(cols[None, :] == slot[:, None], grad_gate[:, None], 0.0)
    grad_lse_sq = tl.load(grad_z) * inv_tokens  # z = mean over tokens of lse^2
    # softmax backward, plus d(lse^2)/dlogits = 2 lse p
    inner = tl.sum(probs * grad_probs, axis=1)
    grad = probs * (grad_probs - inner[:, None]) + (2.0 * grad_lse_sq) * lse[:, None] * probs
    tl.store(grad_logits_ptr + rows[:, None] * n_slots + cols[None, :], grad, mask=mask)


def _launch(tokens: int, n_slots: int) -> tuple[int, int, int]:
    """(BLOCK_T, BLOCK_S, programs): about 2048 logits a program."""
    block_s = triton.next_power_of_2(n_slots)
    block_t = max(16, min(256, 2048 // block_s))
    return block_t, block_s, triton.cdiv(tokens, block_t)


class _SoftmaxTopK(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
        tokens, n_slots = logits.shape
        block_t, block_s, programs = _launch(tokens, n_slots)
        gates = torch.empty(tokens, k, dtype=torch.float32, device=logits.device)
        slots = torch.empty(tokens, k, dtype=torch.long, device=logits.device)
        partial = torch.empty(programs, 2 * n_slots + 1, dtype=torch.float32, device=logits.device)
        with on_device_of(logits):
            _forward[(programs,)](logits, gates, slots, partial, tokens, n_slots, 1.0 / tokens,
                                  K=k, BLOCK_T=block_t, BLOCK_S=block_s)
        sums = partial.sum(0)  # (2S + 1,): [mean probabilities | choices | mean lse^2]
        ctx.save_for_backward(logits, slots)
        ctx.mark_non_differentiable(slots, sums[n_slots:-1])
        ctx.set_materialize_grads(False)  # unused outputs' gradients stay None: no zero tensors launched
        return gates, slots, sums[:n_slots], sums[n_slots:-1], sums[-1]

    @staticmethod
    def backward(ctx, grad_gates: Tensor | None, _slots: None, grad_mean: Tensor | None, _choices: None,
                 grad_z: Tensor | None) -> tuple[Tensor, None]:
        logits, slots = ctx.saved_tensors
        tokens, n_slots = logits.shape
        block_t, block_s, programs = _launch(tokens, n_slots)
        grad_gates = torch.zeros_like(slots, dtype=torch.float32) if grad_gates is None else grad_gates.float().contiguous()
        grad_mean = logits.new_zeros(n_slots) if grad_mean is None else grad_mean.float().contiguous()
        grad_z = logits.new_zeros(()) if grad_z is None else grad_z.float()
        grad_logits = torch.empty_like(logits)
        with on_device_of(logits):
            _backward[(programs,)](logits, slots, grad_gates, grad_mean, grad_z, grad_logits, tokens, n_slots,
                                   1.0 / tokens, K=slots.shape[1], BLOCK_T=block_t, BLOCK_S=block_s)
        return grad_logits, None


def fits(logits: Tensor, k: int) -> bool:
    """Whether the kernel takes these logits: float32 (tokens, slots), slots <= MAX_SLOTS, k <= MAX_K."""
    return logits.dtype == torch.float32 and logits.dim() == 2 and 0 < logits.shape[1] <= MAX_SLOTS and 0 < k <= min(MAX_K, logits.shape[1])


def softmax_top_k(logits: Tensor, k: int) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """logits (T, S) float32 -> gates (T, k), slots (T, k) int64, prob_mean (S,), choices (S,), z ().

    gates, slots: the k largest softmax probabilities of each token, largest first, and their
    slots. prob_mean: each slot's mean probability over the tokens; choices: how often each slot
    was chosen (float32); z: the mean over tokens of logsumexp^2. Differentiable in gates,
    prob_mean and z.
    """
    if not fits(logits, k):
        raise ValueError(f"softmax_top_k: needs float32 (tokens, slots <= {MAX_SLOTS}) logits and 0 < k <= "
                         f"min({MAX_K}, slots); got {tuple(logits.shape)} {logits.dtype}, k={k}")
    return _SoftmaxTopK.apply(logits.contiguous(), k)
