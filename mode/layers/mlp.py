"""The feed-forward network: SwiGLU (or GELU) MLP."""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn


class SwiGLU(nn.Module):
    """down(silu(x W_gate) * (x W_up)); gate and up projections fused into one matmul."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.gate_up = nn.Linear(d_model, 2 * d_ff, bias=False)
        self.down = nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        gate, up = self.gate_up(x).chunk(2, dim=-1)  # 2 x (..., F)
        return self.down(F.silu(gate) * up)
