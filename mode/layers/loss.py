"""The language-model loss, fused with the unembedding and computed in chunks of tokens.

The full (tokens x vocabulary) logits in float32 are the largest tensor of a training step
(8 x 2048 tokens x 32k vocabulary = 2 GiB) and several memory-bound passes over them. Here
each chunk's logits live only briefly: the forward computes the mean cross-entropy *and*
its gradients with respect to the hidden states and the unembedding weight, chunk by chunk,
so the backward only scales them. Same matmul count as the unfused version, and about a
third of its memory traffic on the (tokens x vocabulary) tensors.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from mode.kernels import use_triton

CHUNK_ELEMENTS = 2**26  # logits per chunk: 256 MiB in float32


def _chunk_size(num_tokens: int, vocab: int, chunk_elements: int = CHUNK_ELEMENTS) -> int:
    return max(1, min(num_tokens, chunk_elements // vocab))


def _minus_one_hot(probs: Tensor, targets: Tensor) -> Tensor:
    """probs (n, V) - one_hot(targets (n, 1)): the summed cross-entropy's gradient of the logits.

    Eager, a scatter_add of -1 into probs' own memory. Under torch.compile a select instead (the
    same p - 1, bit for bit): Inductor fuses it into the cast that follows, where the scatter_add
    became an atomic add fused into a reduction over the tokens, which failed to compile once
    causal routing's BCE terms joined that reduction.
    """
    if torch.compiler.is_compiling():
        hit = torch.arange(probs.shape[1], device=probs.device) == targets  # (n, V) by broadcasting
        return torch.where(hit, probs - 1.0, probs)
    return probs.scatter_add_(1, targets, probs.new_full(targets.shape, -1.0))


def _matmul_into(out: Tensor, start: int, end: int, a: Tensor, b: Tensor, in_place: bool) -> None:
    """out[start:end] = a @ b; in_place: the GEMM writes the rows itself (no (n_chunk, D) result copied)."""
    if in_place:
        torch.mm(a, b, out=out[start:end])  # a slice of rows of a contiguous tensor: contiguous
    else:
        out[start:end] = a @ b


def _add_matmul(acc: Tensor, a: Tensor, b: Tensor, in_place: bool) -> None:
    """acc += a @ b; in_place: one GEMM adding into acc (no (V, D) product written, read and added).
    For bf16 a, b and a float32 acc on CUDA, cuBLAS accumulates in acc's float32: each chunk's product
    is not rounded to bf16 before it is added."""
    if in_place and a.dtype == acc.dtype:
        acc.addmm_(a, b)
    elif in_place and acc.is_cuda:
        torch.addmm(acc, a, b, out_dtype=acc.dtype, out=acc)
    else:
        acc += a @ b


class _FusedLinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, targets: Tensor, chunk_elements: int,  # type: ignore[override]
                gemms_in_place: bool) -> Tensor:
        """hidden (N, D), weight (V, D), targets (N,) -> mean cross-entropy, a scalar.

        Per chunk: one matmul for the logits, one log-softmax pass (reading the logits in their
        compute dtype, writing float32 log-probabilities), each row's loss from its target's, and
        p - one_hot (the summed loss's gradient) cast back for two matmuls.
        Eager on CUDA, the softmax, loss and p - one_hot are one Triton kernel instead
        (mode/kernels/cross_entropy.py: float32 arithmetic, the gradient written once). The rows'
        losses go into one buffer, summed once at the end; eager, the hidden states' gradient is
        written in place by its GEMM and the weight's accumulated by one GEMM a chunk.
        The 1/N of the mean is applied to the (N, D) and (V, D) results, not to the logits.
        """
        n = hidden.shape[0]
        acc = torch.promote_types(hidden.dtype, torch.float32)  # float32, or float64 in tests
        grad_hidden = torch.empty_like(hidden)
        grad_weight = torch.zeros_like(weight, dtype=acc)
        step = _chunk_size(n, weight.shape[0], chunk_elements)
        fused = use_triton(hidden, "elementwise")
        in_place = gemms_in_place and not torch.compiler.is_compiling()  # compiled: Inductor plans its buffers
        if fused:  # eager on CUDA: one Triton kernel for the loss and p - one_hot (mode/kernels)
            from mode.kernels.cross_entropy import cross_entropy_and_grad
        row_loss = torch.empty(n, dtype=acc, device=hidden.device)  # every chunk's, summed once
        for start in range(0, n, step):
            end = min(start + step, n)
            h = hidden[start:end]
            logits = h @ weight.t()  # (n_chunk, V)
            if fused:
                _, grad_logits = cross_entropy_and_grad(logits, targets[start:end], loss_out=row_loss[start:end])
            else:
                t = targets[start:end].unsqueeze(1)  # (n_chunk, 1)
                # The loss from log-probabilities, never log(p): a target probability that underflows
                # float32 (a logit ~104 below the row's largest) would make log(p) -inf.
                log_probs = torch.log_softmax(logits, dim=-1, dtype=acc)  # (n_chunk, V)
                row_loss[start:end] = -log_probs.gather(1, t).squeeze(1)
                grad_logits = _minus_one_hot(log_probs.exp_(), t).to(hidden.dtype)  # p - one_hot
            _matmul_into(grad_hidden, start, end, grad_logits, weight, in_place)
            _add_matmul(grad_weight, grad_logits.t(), h, in_place)
        total = row_loss.sum()
        grad_hidden.div_(n)
        ctx.save_for_backward(grad_hidden, grad_weight.div_(n).to(weight.dtype))
        return total / n

    @staticmethod
    def backward(ctx, grad_loss: Tensor) -> tuple[Tensor, Tensor, None, None, None]:  # type: ignore[override]
        grad_hidden, grad_weight = ctx.saved_tensors
        return (grad_hidden * grad_loss.to(grad_hidden.dtype), grad_weight * grad_loss.to(grad_weight.dtype),
                None, None, None)


def _chunked_loss_no_grad(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_elements: int) -> Tensor:
    acc = torch.promote_types(hidden.dtype, torch.float32)
    total = hidden.new_zeros((), dtype=acc)
    step = _chunk_size(hidden.shape[0], weight.shape[0], chunk_elements)
    for start in range(0, hidden.shape[0], step):
        logits = (hidden[start : start + step] @ weight.t()).to(acc)
        total += F.cross_entropy(logits, targets[start : start + step], reduction="sum")
    return total / hidden.shape[0]


def linear_cross_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, chunk_elements: int = CHUNK_ELEMENTS,
                         gemms_in_place: bool = True) -> Tensor:
    """Mean cross-entropy of softmax(hidden @ weight^T) against targets, never holding all logits.

    hidden (..., D), weight (V, D), targets (...). Under autocast the matmuls run in the
    autocast dtype (the casts happen here, outside the fused function, so their gradients
    flow as usual); the softmax and the loss are always float32. chunk_elements: logits per
    chunk. gemms_in_place (eager): each chunk's GEMMs write the hidden states' gradient rows
    and add into the weight's float32 gradient themselves; False: the products, then a copy and
    an add (the tests' reference).
    """
    hidden, targets = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
    device = hidden.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    else:
        weight = weight.to(hidden.dtype)
    with torch.autocast(device, enabled=False):
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            return _FusedLinearCrossEntropy.apply(hidden, weight, targets, chunk_elements, gemms_in_place)
        return _chunked_loss_no_grad(hidden, weight, targets, chunk_elements)
