"""What the benchmarks share: the model-shape flags, the GELU MLP, a median timer (CUDA events on
GPU), a profiler report (wall time against GPU busy time, top kernels), and the checks and
header words that say what a run can do on this machine."""
from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn


def require_cuda(parser: argparse.ArgumentParser) -> None:
    """For the scripts that time GPU kernels only: a one-line error, not a traceback from the
    first CUDA call, when no CUDA GPU is visible."""
    if not torch.cuda.is_available():
        parser.error("this benchmark times GPU kernels and needs a CUDA GPU; none is available (it has no CPU mode)")


def require_cuda_unless_tiny(parser: argparse.ArgumentParser, args: argparse.Namespace, also: str = "") -> None:
    """The default shape is a GPU's: on CPU it runs for many minutes, so only --tiny may run there.
    also: the error's last words (another way the script lets one run on CPU)."""
    if not args.tiny and not torch.cuda.is_available():
        parser.error("no CUDA GPU available: the full shape is sized for a GPU (minutes on CPU); "
                     f"--tiny is the CPU smoke run{also}")


def verdict(ok: bool) -> str:
    """A target's mark in a table."""
    return "met" if ok else "missed"


def precision(device: torch.device) -> str:
    """What the timed passes compute in: the scripts autocast to bf16 on CUDA only."""
    return "bf16 autocast" if device.type == "cuda" else "float32"


def kernels_in_use(device: torch.device, switches: dict[str, str]) -> str:
    """The header's kernel words: each switch as chosen on CUDA; elsewhere PyTorch ops, since
    mode's Triton kernels run on CUDA only (mode.kernels.use_triton) whatever the switches say."""
    from mode.kernels import triton_importable

    if device.type != "cuda":
        return "PyTorch ops (Triton kernels need CUDA)"
    if not triton_importable():
        return "PyTorch ops (Triton is not installed)"
    return ", ".join(f"{name} {choice}" for name, choice in switches.items())


def gib(value: float | None) -> str:
    """A peak-memory cell: GiB, or "-" where none was measured (CPU keeps no allocator peak)."""
    return "-" if value is None else f"{value:.2f}"


def add_model_args(parser: argparse.ArgumentParser) -> None:
    """The transformer shape every whole-model benchmark measures (defaults: the benchmark shape, D=1024, 12 layers)."""
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


def add_routing_switches(parser: argparse.ArgumentParser) -> None:
    """--topk, --slot-choice, --rows and --expert-choice: which routing ops run as Triton kernels
    (mode.kernels.KernelPolicy), for the benchmarks that compare them."""
    parser.add_argument("--topk", choices=["triton", "torch"], default="triton",
                        help="top-k positions as one Triton kernel on CUDA, or torch.topk then a sort "
                             "(KernelPolicy.topk)")
    parser.add_argument("--slot-choice", choices=["triton", "torch"], default="triton",
                        help="token choice's router head (softmax, top-k slots, aux loss, statistics) as Triton "
                             "kernels on CUDA, or PyTorch ops (KernelPolicy.softmax_topk)")
    parser.add_argument("--rows", choices=["triton", "torch"], default="triton",
                        help="MoE rows (every layout but megablocks'): the gated combine and the "
                             "gather's backward as token-major Triton kernels on CUDA in eager mode, or gather / "
                             "scatter_add (KernelPolicy.rows)")
    parser.add_argument("--expert-choice", choices=["triton", "torch"], default="triton",
                        help="expert choice's routing and gather as one autograd function of Triton kernels on CUDA "
                             "in eager mode (its backward adds the router's input gradient into the gather's), or "
                             "the router's PyTorch ops then the rows (KernelPolicy.expert_choice)")


def apply_routing_switches(args: argparse.Namespace, **policy: bool) -> None:
    """Set the process's kernel policy from the flags of add_routing_switches (and `policy`)."""
    from mode.kernels import kernel_policy, set_kernel_policy

    set_kernel_policy(dataclasses.replace(
        kernel_policy(), topk=args.topk == "triton", softmax_topk=args.slot_choice == "triton",
        rows=args.rows == "triton", expert_choice=args.expert_choice == "triton", **policy,
    ))


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


def timed_back_to_back(fn: Callable[[], None], warmup: int, iters: int, device: torch.device) -> float:
    """Mean milliseconds of fn over iters runs queued back to back, one synchronisation at the end.

    What a pass costs inside a training step, where the host queues the next layer's kernels
    while the GPU runs this one's; `timed` instead starts each pass on an idle GPU, so a pass
    that launches many small kernels also pays their launch latency."""
    for _ in range(warmup):
        fn()
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    sync(device)
    return (time.perf_counter() - start) * 1e3 / iters


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_report(run: Callable[[], None], iters: int, device: torch.device, title: str, rows: int = 30) -> str:
    """run() iters times under torch.profiler: wall time per pass against the time some kernel ran
    (GPU busy: the union of kernel intervals), kernels per pass, and the top operators."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    start = time.perf_counter()
    with profile(activities=activities) as prof:
        for _ in range(iters):
            run()
        sync(device)
    wall_ms = (time.perf_counter() - start) * 1e3 / iters
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    busy_ms = union_ms([(e.time_range.start, e.time_range.end) for e in kernels]) / iters
    sort = "self_cuda_time_total" if device.type == "cuda" else "self_cpu_time_total"
    return (f"\n### {title}: {iters} passes under the profiler, {wall_ms:.3f} ms wall per pass, GPU busy "
            f"{busy_ms:.3f} ms ({busy_ms / wall_ms:.0%}), {len(kernels) / iters:.0f} kernels per pass\n"
            + prof.key_averages().table(sort_by=sort, row_limit=rows, max_name_column_width=70))


def gpu_busy_ms(run: Callable[[], None], iters: int, device: torch.device = torch.device("cuda"),
                per_pass: bool = False) -> float:
    """Milliseconds per pass that some CUDA kernel ran (the union of kernel intervals), run() iters
    times under torch.profiler: the GPU's work without the host's launch latency. On CPU (smoke
    runs) the union of the operators' intervals instead. per_pass: each pass under a profiler of
    its own, and the median pass, not the mean over one profile of every pass."""
    if per_pass:
        return statistics.median(gpu_busy_ms(run, 1, device) for _ in range(iters))
    from torch.profiler import ProfilerActivity, profile

    kind = "CUDA" if device.type == "cuda" else "CPU"
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA if kind == "CUDA" else ProfilerActivity.CPU]) as prof:
        for _ in range(iters):
            run()
        sync(device)
    events = [e for e in prof.events() if e.device_type.name == kind]
    return union_ms([(e.time_range.start, e.time_range.end) for e in events]) / iters


def host_queue_ms(run: Callable[[], None], iters: int, device: torch.device = torch.device("cuda")) -> float:
    """Median milliseconds the host spends in run() from an idle GPU, without waiting for its kernels:
    the time queuing one pass. Where it exceeds the pass's GPU busy time, the host sets the pace.
    (On CPU the host computes as it goes: the pass's own time.)"""
    times = []
    for _ in range(iters):
        sync(device)
        start = time.perf_counter()
        run()
        times.append((time.perf_counter() - start) * 1e3)
    sync(device)
    return statistics.median(times)


def union_ms(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals given in microseconds, in milliseconds."""
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if a > end:
            total, end = total + (b - a), b
        elif b > end:
            total, end = total + (b - end), b
    return total / 1e3
