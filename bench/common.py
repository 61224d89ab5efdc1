"""What the benchmarks share: the model-shape flags, the GELU MLP and a median timer (CUDA events on GPU)."""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The transformer shape every whole-model benchmark measures (defaults: the issues' shape)."""
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--ffn", type=int, default=2816, help="SwiGLU hidden width")
    parser.add_argument("--vocab", type=int, default=32768)


class GeluMLP(nn.Module):
    """The GELU expert (moe.activation: gelu) and dense baseline: fc2(gelu(fc1 x))."""

    def __init__(self, d_model: int, d_ff: int) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d_model, d_ff, bias=False), nn.Linear(d_ff, d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(F.gelu(self.fc1(x)))


def timed(fn: Callable[[], None], warmup: int, iters: int, device: torch.device) -> float:
    """Median milliseconds of fn over iters runs after warmup runs."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)
