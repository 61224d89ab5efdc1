"""The row moves routed layers are built on, and decode attention, one op at a time (GPU).

    python -m bench.row_ops      # 16 x 1024 rows of width 1024 (bf16), decode at batch 64, cache 2048

Rows (median microseconds, CUDA events, same process and card):
- gathering the rows expert choice picks (8 experts x 2048 of 16384 tokens, a token taken
  0 to 8 times), and the three ways to add them back: index_add (what index_select's
  backward does), index_put with accumulate, scatter_add (what mode.routing uses);
- the router's projection in float32 and in bf16 (mode's default: a bf16 GEMM with float32
  output, mode.routing.router_scores);
- single-query attention over a (64, 16, 2049, 64) bf16 KV cache on each SDPA backend, and
  the memory-efficient backend with the (B, 1, 1, L) length mask a routed layer's decode uses,
  flash attention's variable-length kernel over the packed cache and mode's decode attention
  kernel (mode/kernels/decode_attention.py), beside the time to read the cache once at the
  card's nominal bandwidth (--bandwidth, TB/s);
- a decode step's experts (8 SwiGLU experts, 1024 x 2816) over 8 to 1024 rows sorted by expert:
  torch._grouped_mm and mode's grouped kernel (mode/kernels/grouped_mm.py), each replayed in a
  CUDA graph (the GPU's time, as a captured decode step runs them), beside reading the used
  experts' weights once.
"""
from __future__ import annotations

import argparse
from typing import Callable

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from bench.common import require_cuda, timed
from mode.kernels.decode_attention import decode_attention
from mode.kernels.grouped_mm import grouped_rows_mm


def row(name: str, fn: Callable[[], object], device: torch.device) -> None:
    try:
        print(f"| {name} | {timed(fn, 5, 30, device) * 1e3:.1f} |", flush=True)
    except (RuntimeError, TypeError) as e:  # a backend that refuses these shapes is reported, never timed
        print(f"| {name} | not run: {str(e).splitlines()[0][:90]} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bandwidth", type=float, default=4.8, help="the card's memory bandwidth in TB/s (H200 4.8, H100 3.35)")
    args = parser.parse_args(argv)
    require_cuda(parser)  # GPU kernels only: no CPU mode to fall back to
    device = torch.device("cuda")
    torch.manual_seed(0)
    tokens, width, experts, seq = 16384, 1024, 8, 2048
    take = seq // experts
    ids = torch.cat([  # expert-major: each expert takes `take` tokens of each sequence
        torch.randperm(seq, device=device)[:take].sort().values + g * seq
        for _ in range(experts) for g in range(tokens // seq)
    ])  # (N,)
    rows = torch.randn(ids.numel(), width, device=device, dtype=torch.bfloat16)
    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
    zeros = lambda: torch.zeros(tokens, width, device=device, dtype=torch.bfloat16)  # noqa: E731
    print(f"card: {torch.cuda.get_device_name()}; torch {torch.__version__}\n")
    print("| op | us |")
    print("| --- | --- |")
    row("gather rows: index_select", lambda: x.index_select(0, ids), device)
    row("add rows back: index_add", lambda: zeros().index_add_(0, ids, rows), device)
    row("add rows back: index_put accumulate", lambda: zeros().index_put_((ids,), rows, accumulate=True), device)
    row("add rows back: scatter_add", lambda: zeros().scatter_add_(0, ids.unsqueeze(1).expand(-1, width), rows), device)
    w = torch.randn(experts, width, device=device)
    row("router projection, float32", lambda: F.linear(x.float(), w), device)
    row("router projection, bf16", lambda: F.linear(x, w.bfloat16()), device)

    batch, heads, head_dim, length = 64, 16, 64, 2049
    kv = torch.randn(batch, 2, heads, length + 64, head_dim, device=device, dtype=torch.bfloat16)
    q = torch.randn(batch, heads, 1, head_dim, device=device, dtype=torch.bfloat16)
    k, v = kv[:, :, :, :length].unbind(1)  # the decoder's cache views
    for name, backend in (("flash", SDPBackend.FLASH_ATTENTION), ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION),
                          ("cuDNN", SDPBackend.CUDNN_ATTENTION), ("math", SDPBackend.MATH)):
        with sdpa_kernel([backend]):
            row(f"decode attention, {name}", lambda: F.scaled_dot_product_attention(q, k, v), device)
    mask = torch.ones(batch, 1, 1, length, device=device, dtype=torch.bool)
    with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
        row("decode attention, memory-efficient + length mask", lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask), device)
    # The static decode step's kernel: flash attention's variable-length path over the packed cache,
    # reading each row's used slots only (seqused_k); num_splits splits each row's keys over blocks.
    slots = length + 128
    packed = torch.randn(2, batch * slots, heads, head_dim, device=device, dtype=torch.bfloat16)
    cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32)
    cu_k = cu_q * slots  # outside the timed calls, as a decode step would have it ready
    q_packed = q[:, :, 0].contiguous()  # (B, H, hd)
    sparse = torch.randint(200, 400, (batch,), device=device, dtype=torch.int32)  # a routed layer's lengths
    for label, used in (("every slot of 2049", torch.full((batch,), length, device=device, dtype=torch.int32)),
                        ("200-400 used slots (a routed layer)", sparse)):
        for splits in (None, 1, 4, 16):
            kwargs = {} if splits is None else {"num_splits": splits}
            row(f"decode attention, flash varlen, {label}, num_splits {splits}", lambda: torch.ops.aten._flash_attention_forward(
                q_packed, packed[0], packed[1], cu_q, cu_k, 1, slots, 0.0, False, False, seqused_k=used, **kwargs), device)
    # mode's decode step where it has rows enough: one Triton program per row and head, no query tile
    cache = packed.view(2, batch, slots, heads, head_dim)  # the layer cache's layout
    for label, used in (("every slot of 2049", torch.full((batch,), length, device=device, dtype=torch.int32)),
                        ("200-400 used slots (a routed layer)", sparse)):
        row(f"decode attention, mode's Triton kernel, {label}", lambda: decode_attention(q_packed, cache, used), device)
    nominal = 2 * batch * heads * length * head_dim * 2 / (args.bandwidth * 1e12) * 1e6
    print(f"| reading the cache once at {args.bandwidth} TB/s | {nominal:.1f} |")
    grouped_products(args.bandwidth, device)


def graphed_us(fn: Callable[[], object], device: torch.device, calls: int = 20) -> float:
    """Microseconds of one call of fn, replayed as a CUDA graph of `calls` calls back to back: the
    GPU's time, as a captured decode step runs it, without the host's launch."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return timed(graph.replay, 3, 10, device) * 1e3 / calls


def grouped_products(bandwidth: float, device: torch.device) -> None:
    """A decode step's experts: 8 SwiGLU experts of width 2816 on D=1024 (Staged MoDE's in
    bench.decode), both products over R rows sorted by expert, torch._grouped_mm against mode's
    grouped kernel, each in a CUDA graph as a decode step runs them, beside reading the weights of
    the experts the rows use once."""
    experts, width, hidden = 8, 1024, 2816
    w_in = torch.randn(experts, width, 2 * hidden, device=device, dtype=torch.bfloat16) / width ** 0.5
    w_out = torch.randn(experts, hidden, width, device=device, dtype=torch.bfloat16) / hidden ** 0.5
    for rows in (8, 64, 256, 1024):
        generator = torch.Generator(device=device).manual_seed(rows)
        counts = torch.bincount(torch.randint(0, experts, (rows,), device=device, generator=generator), minlength=experts)
        ends = counts.cumsum(0).to(torch.int32)
        x = torch.randn(rows, width, device=device, dtype=torch.bfloat16)
        h = torch.randn(rows, hidden, device=device, dtype=torch.bfloat16)
        for label, w, inputs in (("gate and up", w_in, x), ("down", w_out, h)):
            for name, fn in (("torch._grouped_mm", lambda: torch._grouped_mm(inputs, w, offs=ends)),
                             ("mode's grouped kernel", lambda: grouped_rows_mm(inputs, w, ends))):
                print(f"| experts' {label}, {rows} rows, {name}, in a CUDA graph | {graphed_us(fn, device):.1f} |", flush=True)
            nominal = int((counts > 0).sum()) * w[0].numel() * 2 / (bandwidth * 1e12) * 1e6
            print(f"| experts' {label}, {rows} rows: reading their weights once at {bandwidth} TB/s | {nominal:.1f} |")


if __name__ == "__main__":
    main()
