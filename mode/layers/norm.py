"""RMSNorm whose output, under autocast, comes out in the autocast dtype from one fused kernel,
optionally with the residual add before it."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode.kernels import use_triton


class RMSNorm(nn.RMSNorm):
    """nn.RMSNorm (the same parameter and state dict), eager on CUDA under autocast as one Triton
    kernel each way (mode/kernels/rms_norm.py) on the float32 residual stream.

    to_autocast: the output only feeds matmuls, which under autocast cast it to the autocast dtype
    anyway: the kernel writes it in that dtype directly. False (a norm whose output a float32 router
    reads, the MoE FFN's): a float32 output. Same values either way: the float32 norm, rounded once
    to the autocast dtype where the matmul's cast would round it."""

    def __init__(self, width: int, eps: float | None = None, to_autocast: bool = True) -> None:
        super().__init__(width, eps=eps)
        self.to_autocast = to_autocast

    def forward(self, x: Tensor) -> Tensor:
        out_dtype = self._kernel_dtype(x)
        if out_dtype is None:
            return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)
        from mode.kernels.rms_norm import rms_norm

        return rms_norm(x, self.weight, self._eps(x), out_dtype)

    def add(self, x: Tensor, a: Tensor) -> tuple[Tensor, Tensor]:
        """(h, norm(h)) for h = x + a: the residual add and this norm, one kernel each way where the
        kernel runs (the add's float32 result is the same)."""
        out_dtype = self._kernel_dtype(x)
        if out_dtype is None or a.shape != x.shape:
            h = x + a
            return h, self(h)
        from mode.kernels.rms_norm import add_rms_norm

        return add_rms_norm(x, a, self.weight, self._eps(x), out_dtype)

    def _kernel_dtype(self, x: Tensor) -> torch.dtype | None:
        """The kernel's output dtype for x, or None where PyTorch's norm runs: outside autocast (no
        cast to fuse), for a stream that is not float32, or where the kernel cannot run."""
        device = x.device.type
        if x.dtype != torch.float32 or not torch.is_autocast_enabled(device) or not use_triton(x, "norm"):
            return None
        from mode.kernels.rms_norm import rms_norm_applies

        if not rms_norm_applies(x, self.weight):
            return None
        return torch.get_autocast_dtype(device) if self.to_autocast else torch.float32

    def _eps(self, x: Tensor) -> float:
        return torch.finfo(x.dtype).eps if self.eps is None else self.eps  # nn.RMSNorm's default
