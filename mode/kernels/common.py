"""Pieces the Triton kernels share."""
from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl
from torch import Tensor


def on_device_of(t: Tensor) -> contextlib.AbstractContextManager:
    """Launch on t's GPU: Triton launches on the current CUDA device, which need not be t's (a
    process driving several GPUs). CPU tensors (Triton's interpreter, in the tests) need nothing."""
    return torch.cuda.device(t.device) if t.is_cuda else contextlib.nullcontext()


# Triton's interpreter (TRITON_INTERPRET=1, read when the kernels are defined, as Triton reads it)
# runs the kernels on CPU tensors in the tests; a kernel that must work around it reads this.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET", "0") == "1")


@triton.jit
def store_rounded(ptr, x, mask):
    """Store float32 x at ptr in ptr's dtype, rounding to nearest even.

    On the GPU `.to(bfloat16)` rounds to nearest even. Triton's interpreter truncates: there
    the rounding is done on the bits first (then exact). Only there: on the GPU the bit
    arithmetic would slow every elementwise kernel.
    """
    if INTERPRETED:
        if ptr.dtype.element_ty == tl.bfloat16:
            x = _bf16_nearest_even(x)
    tl.store(ptr, x.to(ptr.dtype.element_ty), mask=mask)


@triton.jit
def _bf16_nearest_even(x):
    """Float32 x rounded to nearest even in bf16, as float32, by its bits (the interpreter truncates)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def rounded_as(x, ptr):
    """Float32 x rounded to nearest even in ptr's dtype, as float32 again (what a PyTorch op in
    that dtype would have stored); the interpreter's truncation corrected as in store_rounded."""
    if INTERPRETED:
        if ptr.dtype.element_ty == tl.bfloat16:
            return _bf16_nearest_even(x)
    return x.to(ptr.dtype.element_ty).to(tl.float32)


@triton.jit
def softmax_rows(logits_ptr, rows, cols, tokens, n_slots):
    """Load a (BLOCK_T, BLOCK_S) tile of float32 logits (rows of n_slots; rows >= tokens are padding):
    probabilities (0 outside), logsumexp per row, masks. The routers' heads share it (softmax_topk,
    expert_choice)."""
    row_ok = rows < tokens
    mask = row_ok[:, None] & (cols < n_slots)[None, :]
    logits = tl.load(logits_ptr + rows[:, None] * n_slots + cols[None, :], mask=mask, other=float("-inf"))
    top = tl.where(row_ok, tl.max(logits, axis=1), 0.0)  # rows past the end: no -inf - -inf
    e = tl.where(mask, tl.exp(logits - top[:, None]), 0.0)
    total = tl.where(row_ok, tl.sum(e, axis=1), 1.0)
    probs = e / total[:, None]
    lse = top + tl.log(total)
    return probs, lse, row_ok, mask
