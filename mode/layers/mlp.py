"""The feed-forward network: SwiGLU MLP; the activations the MoE experts share (SwiGLU, GELU)."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from mode.kernels import use_triton


class SwiGLU(nn.Module):
    """down(silu(x W_gate) * (x W_up)); gate and up projections fused into one matmul."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(swiglu(self.gate_up(x)))


def swiglu(h: Tensor, gates: Tensor | None = None) -> Tensor:
    """h (..., 2F) = [gate | up] -> silu(gate) * up (..., F), times gates (...,) (one per row) when
    given. Eager on CUDA: one Triton kernel each way (mode/kernels/swiglu.py); otherwise PyTorch
    ops, which torch.compile fuses."""
    if use_triton(h):
        from mode.kernels.swiglu import swiglu as fused

        return fused(h, gates)
    gate, up = h.chunk(2, dim=-1)  # 2 x (..., F)
    out = F.silu(gate) * up
    return out if gates is None else out * gates.to(out.dtype).unsqueeze(-1)


def gelu(h: Tensor, gates: Tensor | None = None) -> Tensor:
    """GELU (exact, erf) of h (..., F), times gates (...,) (one per row) when given. Eager on CUDA
    with gates: one Triton kernel each way (mode/kernels/gelu.py); otherwise PyTorch's GELU (its
    kernels are as fast as a Triton one without gates to apply)."""
    if gates is not None and use_triton(h):
        from mode.kernels.gelu import gated_gelu

        return gated_gelu(h, gates)
    out = F.gelu(h)
    return out if gates is None else out * gates.to(out.dtype).unsqueeze(-1)
