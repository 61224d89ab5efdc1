"""AdamW on a float32 master weight whose bf16 copy the model computes with, one pass per tensor.

Training under bf16 autocast over float32 weights casts every matrix to bf16 in each forward and
its bf16 gradient back to float32 in each backward, and AdamW then reads the float32 gradient.
With the matrices held in bf16 (mode/training/bf16_weights.py) the gradient arrives in bf16 and the
update must also write the new bf16 copy. This kernel does both in the update's own pass: it reads
the master, both moments and the bf16 gradient, and writes the master, the moments and the master
rounded to bf16. Arithmetic is float32, in the order of torch.optim.AdamW's fused kernel:

    g = grad / grad_scale                 (grad_scale: 1 / the global-norm clipping factor, or 1)
    w = w - lr * weight_decay * w
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g^2
    w = w - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)

t, the tensor's step count, is read on the device (the optimizer's state keeps it there).
"""
from __future__ import annotations

import math

import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, store_rounded

BLOCK = 4096


@triton.jit
def _adamw_master(w_ptr, m_ptr, v_ptr, g_ptr, copy_ptr, step_ptr, grad_scale_ptr, n, lr, beta1, beta2, log_beta1,
                  log_beta2, eps, decay, BLOCK: tl.constexpr):
    start = tl.program_id(0).to(tl.int64) * BLOCK
    offs = start + tl.arange(0, BLOCK)
    mask = offs < n
    t = tl.load(step_ptr)
    correction1 = 1.0 - tl.exp(t * log_beta1)  # 1 - beta1^t
    correction2 = 1.0 - tl.exp(t * log_beta2)
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32) / tl.load(grad_scale_ptr)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0)
    m = tl.load(m_ptr + offs, mask=mask, other=0.0)
    v = tl.load(v_ptr + offs, mask=mask, other=0.0)
    w = w - lr * decay * w
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    w = w - (lr / correction1) * m / (tl.sqrt(v) / tl.sqrt(correction2) + eps)
    tl.store(w_ptr + offs, w, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    store_rounded(copy_ptr + offs, w, mask)


def adamw_master_step_(master: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, grad: Tensor, copy: Tensor,
                       step: Tensor, grad_scale: Tensor, lr: float, betas: tuple[float, float], eps: float,
                       weight_decay: float) -> None:
    """One AdamW update of master (float32) from grad (bf16), in place, and copy (bf16) = master rounded,
    as one kernel (mode.training.bf16_weights.master_update_ has the same in PyTorch ops).

    step: the tensor's step count after this update (0-d float32, on master's device); grad_scale:
    0-d float32, what the gradient is divided by (1 / the clipping factor, as AdamW's grad_scale).
    Every tensor contiguous."""
    beta1, beta2 = betas
    n = master.numel()
    with on_device_of(master):
        _adamw_master[(triton.cdiv(n, BLOCK),)](
            master, exp_avg, exp_avg_sq, grad, copy, step, grad_scale, n, lr, beta1, beta2,
            math.log(beta1) if beta1 > 0 else -math.inf, math.log(beta2) if beta2 > 0 else -math.inf,
            eps, weight_decay, BLOCK=BLOCK, num_warps=8)
