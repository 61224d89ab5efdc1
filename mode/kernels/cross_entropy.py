"""Softmax cross-entropy and its logit gradient for a chunk of rows, as one Triton kernel.

mode/layers/loss.py computes, per chunk of tokens, the loss and p - one_hot(target) (the
summed loss's gradient with respect to the logits). In PyTorch that is a float32 softmax
written out in full, a gather, a scatter and a cast of the whole (rows, V) gradient back to
the logits' dtype: about three times the logits' size in traffic beyond reading them. Here
each row is read twice (its max and sum of exponentials online, then the gradient) and the
gradient written once in the logits' dtype, with float32 arithmetic throughout.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, store_rounded

BLOCK = 2048


@triton.jit
def _cross_entropy_fwd_grad(logits_ptr, targets_ptr, grad_ptr, loss_ptr, vocab, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * vocab
    cols = tl.arange(0, BLOCK)
    # Pass 1: running max and sum of exp(x - max), one block of the row at a time.
    # The running max starts finite, below any logit, so padding lanes (-inf) add exp(-inf) = 0
    # and never compute inf - inf.
    run_max = tl.full((BLOCK,), -3.4028234663852886e38, tl.float32)  # float32's lowest finite value
    run_sum = tl.zeros((BLOCK,), tl.float32)
    for start in range(0, vocab, BLOCK):
        x = tl.load(base + start + cols, mask=start + cols < vocab, other=float("-inf")).to(tl.float32)
        new_max = tl.maximum(run_max, x)
        run_sum = run_sum * tl.exp(run_max - new_max) + tl.exp(x - new_max)
        run_max = new_max
    row_max = tl.max(run_max, 0)
    total = tl.sum(run_sum * tl.exp(run_max - row_max), 0)
    log_total = tl.log(total)
    target = tl.load(targets_ptr + row)
    # (max - target) + log(total), never (max + log(total)) - target: with logits of large
    # magnitude the sum would round log(total) away before the subtraction could recover it.
    tl.store(loss_ptr + row, (row_max - tl.load(base + target).to(tl.float32)) + log_total)
    # Pass 2: the gradient softmax(x) - one_hot(target), in the logits' dtype.
    for start in range(0, vocab, BLOCK):
        mask = start + cols < vocab
        x = tl.load(base + start + cols, mask=mask, other=0.0).to(tl.float32)
        grad = tl.exp((x - row_max) - log_total) - tl.where(start + cols == target, 1.0, 0.0)
        store_rounded(grad_ptr + row * vocab + start + cols, grad, mask)


def cross_entropy_and_grad(logits: Tensor, targets: Tensor, loss_out: Tensor | None = None) -> tuple[Tensor, Tensor]:
    """logits (N, V), targets (N,) -> (loss per row (N,) float32, softmax(logits) - one_hot (N, V)
    in logits' dtype). No autograd: the caller (the fused loss) uses the gradient itself.
    loss_out: a contiguous float32 (N,) tensor to write the losses into (and return) instead of a new one."""
    if logits.dim() != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(f"cross_entropy_and_grad: logits (N, V) and targets (N,), got {tuple(logits.shape)}, {tuple(targets.shape)}")
    if loss_out is not None and not (loss_out.shape == targets.shape and loss_out.dtype == torch.float32
                                     and loss_out.is_contiguous() and loss_out.device == logits.device):
        raise ValueError(f"cross_entropy_and_grad: loss_out must be a contiguous float32 ({targets.shape[0]},) tensor "
                         f"on {logits.device}, got {loss_out.dtype} {tuple(loss_out.shape)} on {loss_out.device}")
    logits, targets = logits.contiguous(), targets.contiguous()
    rows, vocab = logits.shape
    grad = torch.empty_like(logits)
    loss = torch.empty(rows, dtype=torch.float32, device=logits.device) if loss_out is None else loss_out
    if rows:
        with on_device_of(logits):
            _cross_entropy_fwd_grad[(rows,)](logits, targets, grad, loss, vocab, BLOCK=min(BLOCK, triton.next_power_of_2(vocab)))
    return loss, grad
