"""Fused Triton kernels for the parts of a block that eager PyTorch runs as chains of small ops.

In eager PyTorch, rotary embeddings and the SwiGLU activation are chains of separate
elementwise kernels, each a full pass over a (tokens, width) tensor, with float32
intermediates and a `cat` in the backward. Each kernel here does its forward in one pass
and its backward in one pass, in float32 arithmetic. torch.compile fuses the same ops by
itself, so under compilation (and on CPU, or without Triton) the plain PyTorch versions
run; both give the same results up to float32 rounding (tests/test_kernels.py).

Where each kernel runs is decided by one policy (mode/kernels/policy.py): MODE_KERNELS=torch
in the environment switches them all off; `use_kernels(...)` changes the policy per op.
"""
from mode.kernels.policy import (
    KERNEL_CHOICES,
    OPS,
    KernelPolicy,
    kernel_policy,
    on_kernel_device,
    policy_from_env,
    set_kernel_policy,
    triton_importable,
    use_kernels,
    use_triton,
)

__all__ = [
    "KERNEL_CHOICES",
    "OPS",
    "KernelPolicy",
    "kernel_policy",
    "on_kernel_device",
    "policy_from_env",
    "set_kernel_policy",
    "triton_importable",
    "use_kernels",
    "use_triton",
]
