"""Router scores: float32 scores from the router's projection, the gate g(r), and the random
scores of the random-routing ablation."""
from __future__ import annotations

import torch
from torch import Tensor

from mode.kernels import on_kernel_device


def half_router_applies(x: Tensor, weight: Tensor) -> bool:
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
        elif half and half_router_applies(x, weight):
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
