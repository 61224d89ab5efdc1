"""Fused Triton kernels for the elementwise parts of a block, used in eager mode on CUDA.

In eager PyTorch, rotary embeddings and the SwiGLU activation are chains of separate
elementwise kernels, each a full pass over a (tokens, width) tensor, with float32
intermediates and a `cat` in the backward. Each kernel here does its forward in one pass
and its backward in one pass, in float32 arithmetic. torch.compile fuses the same ops by
itself, so under compilation (and on CPU, or without Triton) the plain PyTorch versions
run; both give the same results up to float32 rounding (tests/test_kernels.py).

MODE_KERNELS=torch in the environment switches the kernels off (for a comparison, or to
debug); MODE_KERNELS=triton (the default) uses them wherever they apply.
"""
from __future__ import annotations

import functools
import importlib.util
import os

import torch
from torch import Tensor

KERNEL_CHOICES = ("triton", "torch")


def _enabled_from_env() -> bool:
    value = os.environ.get("MODE_KERNELS", "triton")
    if value not in KERNEL_CHOICES:
        raise ValueError(f"environment variable MODE_KERNELS={value!r}: expected one of {', '.join(KERNEL_CHOICES)}")
    return value == "triton"


ENABLED = _enabled_from_env()


@functools.cache
def triton_importable() -> bool:
    return importlib.util.find_spec("triton") is not None


def use_triton(x: Tensor) -> bool:
    """Whether a block should run its Triton kernel on x: CUDA, eager, Triton present, not switched
    off, and not float64 (the kernels compute in float32: a float64 model, as a reference test
    builds one, keeps its precision in the PyTorch ops)."""
    return (ENABLED and x.is_cuda and x.dtype != torch.float64 and not torch.compiler.is_compiling()
            and triton_importable())
