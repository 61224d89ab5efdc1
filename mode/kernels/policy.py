"""Which ops run as Triton kernels: one process-wide policy, read by every layer and routing op.

Each Triton kernel replaces a chain of PyTorch ops in eager mode; both give the same results up to
float32 rounding. Whether a kernel runs is decided here and nowhere else:

- never under torch.compile (Inductor fuses the PyTorch ops itself), never without Triton, never
  for float64 tensors (the kernels compute in float32; float64 reference models keep their
  precision);
- on CUDA tensors, or also on CPU tensors with `cpu=True` (Triton's interpreter,
  TRITON_INTERPRET=1: the tests run the kernel code on CPU that way);
- only where the policy allows it: `enabled` for all of them (MODE_KERNELS=torch in the environment
  switches them off), and one flag per op for comparisons.

Benchmarks and tests change the policy with `use_kernels(...)` (a context manager) or, for a whole
process, `set_kernel_policy(...)`; code reads it with `kernel_policy()` or asks `use_triton(x, op)`.
"""
from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

KERNEL_CHOICES = ("triton", "torch")

Op = Literal["elementwise", "norm", "topk", "softmax_topk", "rows", "expert_choice", "decision", "step_cache",
             "decode_attention", "grouped_mm", "optimizer"]
OPS: tuple[str, ...] = ("elementwise", "norm", "topk", "softmax_topk", "rows", "expert_choice", "decision",
                        "step_cache", "decode_attention", "grouped_mm", "optimizer")


@dataclass(frozen=True)
class KernelPolicy:
    """Where the Triton kernels may run (see the module docstring for where they can).

    enabled: any kernel at all (False: every op on PyTorch, as MODE_KERNELS=torch).
    elementwise: rotary on q/k, SwiGLU and GELU (with the experts' gates), the fused loss's
        softmax and gradient.
    norm: RMSNorm of the float32 residual stream written in the autocast dtype (its matmul's
        cast fused in), where its output only feeds matmuls.
    topk: a depth router's (and expert choice's) top-k positions in one kernel.
    softmax_topk: token choice's router head (softmax, top-k slots, aux losses, statistics).
    rows: the MoE layers' gather/combine through an inverse map, the copy and constant no-op
        slots' outputs added in one pass, the depth router's gated update of the residual, token
        choice's counting-sort layouts.
    expert_choice: expert choice's router head, layout and gather in one autograd function.
    decision: a routed layer's decode-step routing: its causal decision (float32 GEMV, threshold
        and the active rows) and the compaction of its chosen rows, one kernel each.
    step_cache: a static decode step's attention input, one kernel per layer: q and k rotated, each
        row's key and value written into its cache slot (and, where a layer computes every row, the
        slots, the attended lengths and the grown lengths computed there too).
    decode_attention: a decode step's single-query attention over its KV cache, one program per
        row and head (no padded query tile), where the step has rows enough.
    grouped_mm: the experts' grouped GEMMs over a decode step's few rows (inference), each
        expert's weights streamed once.
    optimizer: AdamW on a float32 master weight writing its bf16 copy in the same pass
        (train.bf16_weights), and the gradients' global norm that clipping reads.
    cpu: also CPU tensors, through Triton's interpreter (tests); CUDA-only PyTorch paths (the
        bf16 router GEMM) take their CPU fallbacks then.
    """

    enabled: bool = True
    elementwise: bool = True
    norm: bool = True
    topk: bool = True
    softmax_topk: bool = True
    rows: bool = True
    expert_choice: bool = True
    decision: bool = True
    step_cache: bool = True
    decode_attention: bool = True
    grouped_mm: bool = True
    optimizer: bool = True
    cpu: bool = False

    def allows(self, op: Op) -> bool:
        if op not in OPS:
            raise ValueError(f"unknown kernel op {op!r} (expected one of {', '.join(OPS)})")
        return self.enabled and getattr(self, op)

    @classmethod
    def only(cls, *ops: Op, cpu: bool = False) -> KernelPolicy:
        """The kernels of the named ops and no others."""
        unknown = set(ops) - set(OPS)
        if unknown:
            raise ValueError(f"unknown kernel ops {sorted(unknown)} (expected some of {', '.join(OPS)})")
        return cls(cpu=cpu, **{op: op in ops for op in OPS})


def policy_from_env() -> KernelPolicy:
    """The default policy: every kernel, unless MODE_KERNELS=torch."""
    value = os.environ.get("MODE_KERNELS", "triton")
    if value not in KERNEL_CHOICES:
        raise ValueError(f"environment variable MODE_KERNELS={value!r}: expected one of {', '.join(KERNEL_CHOICES)}")
    return KernelPolicy(enabled=value == "triton")


# Process-wide, not per thread: autograd runs CUDA backwards on its own threads, which must see
# the policy the forward saw. Written only by set_kernel_policy.
_policy = policy_from_env()


def kernel_policy() -> KernelPolicy:
    return _policy


def set_kernel_policy(policy: KernelPolicy) -> KernelPolicy:
    """Make `policy` the process's policy; returns the one it replaces."""
    global _policy
    if not isinstance(policy, KernelPolicy):
        raise TypeError(f"expected a KernelPolicy, got {type(policy).__name__}")
    before, _policy = _policy, policy
    return before


@contextmanager
def use_kernels(policy: KernelPolicy | None = None, **changes: bool) -> Iterator[KernelPolicy]:
    """Run a block under `policy` (default: the current one) with `changes` applied, e.g.
    `with use_kernels(topk=False):`; the previous policy is restored on exit."""
    new = dataclasses.replace(kernel_policy() if policy is None else policy, **changes)
    before = set_kernel_policy(new)
    try:
        yield new
    finally:
        set_kernel_policy(before)


@functools.cache
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def on_kernel_device(x: Tensor) -> bool:
    """x lives where the kernels (and CUDA-only paths) run: a CUDA tensor, or any with `cpu`, eager."""
    return x.is_cuda or (not torch.compiler.is_compiling() and kernel_policy().cpu)


def use_triton(x: Tensor, op: Op = "elementwise") -> bool:
    """Whether `op` should run as its Triton kernel on x: eager, Triton present, not float64, on
    a kernel device, and allowed by the policy."""
    if torch.compiler.is_compiling() or x.dtype == torch.float64 or not triton_importable():
        return False
    return on_kernel_device(x) and kernel_policy().allows(op)
