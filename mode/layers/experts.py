"""Expert weights and the compute backends that run them.

`Experts` holds E expert MLPs as stacked weights, written as if every expert were local
(parallelism is applied from outside, in mode/parallel/). It runs them on two layouts:

- padded: xs (E, R, D), every expert R rows (expert choice, token choice with a capacity);
- grouped: xs (M, D) sorted by expert with counts (E,) (token choice, uneven loads).

Both take optional row gates (one per row, the router's): each row's output times its gate.
Where the activation runs as its Triton kernel (gates_in_activation: eager CUDA, SwiGLU or GELU)
the FFN hands its gates here and they multiply the activation (the down projection is linear),
which leaves the combine a plain sum; elsewhere the FFN's combine multiplies them, a pass over
(rows, D) instead of (rows, F).

Token choice without a capacity (dropless) has a third layout on a GPU (Experts.by_ends_applies):
- by ends: xs (R, D) every assignment sorted by expert, each expert's row end on the device; the
  rows past the last end (no-op slots) are never computed. On the torch backend nothing is read
  on the host: no sync, static shapes, so the pass can be one CUDA graph, eager or compiled.
A decode step (MoEFFN's static path, on any backend) runs by ends through torch._grouped_mm where
that is one kernel (grouped_mm_applies), else every_row: every expert on every row, gated. Its few
rows (at most FEW_ROWS, with no gradient) go through mode's grouped kernel instead, which streams
each chosen expert's weights once (mode/kernels/grouped_mm.py).

Backends (config `moe.backend`), identical in results up to rounding:
- torch:        padded -> two batched matmuls; by ends -> two torch._grouped_mm (the ends are its
                offsets; on a GPU with its grouped kernels); grouped -> a loop over experts. CPU and GPU.
- grouped_gemm: every layout through grouped_gemm's `gmm`, bf16, CUDA (as the README builds it, one
                cuBLAS GEMM per expert, the group sizes read on the host: by ends, one copy of them).
- megablocks:   token choice dispatched with megablocks' sort / histogram / gather / scatter
                kernels and computed with its grouped GEMM (the dMoE "grouped" path), CUDA.
"""
from __future__ import annotations

import importlib

import torch
from torch import Tensor, nn

from mode.config import ConfigError
from mode.kernels import use_triton
from mode.layers.mlp import gelu, swiglu
from mode.routing import TokenChoiceRouting

BACKENDS = ("torch", "grouped_gemm", "megablocks")
# Compute capabilities whose torch._grouped_mm is one grouped kernel reading its offsets on the
# device: 9.0 (H100 / H200), where it was tested and measured. Elsewhere it may fall back to a loop
# that reads them on the host, so the host-count paths run there.
_GROUPED_MM_CAPABILITIES = ((9, 0),)
_MODULES = {"grouped_gemm": "grouped_gemm.ops", "megablocks": "megablocks.ops"}
# Up to this many rows (a decode step's assignments) by_ends runs mode's grouped kernel, which
# streams each expert's weights once (mode/kernels/grouped_mm.py): faster than torch._grouped_mm
# up to 256 rows, slower at 1024 (bench.row_ops).
FEW_ROWS = 256


def check_backend(name: str) -> None:
    """Fail at model build, naming moe.backend, when a backend cannot run on this machine."""
    if name not in BACKENDS:
        raise ConfigError(f"moe.backend: unknown backend {name!r} (expected one of {', '.join(BACKENDS)})")
    if name == "torch":
        return
    if not torch.cuda.is_available():
        raise ConfigError(f"moe.backend={name!r} needs a CUDA GPU and this machine has none; use moe.backend=torch")
    try:
        importlib.import_module(_MODULES[name])
        importlib.import_module("grouped_gemm.ops")  # megablocks' grouped path runs on it too
    except ImportError as e:
        raise ConfigError(
            f"moe.backend={name!r}: cannot import {_MODULES[name]} ({e}); install the GPU extras "
            "(see the README's GPU install) or use moe.backend=torch"
        ) from e


class Experts(nn.Module):
    """E MLPs. swiglu: w_in (E, D, 2F) = [gate | up], w_out (E, F, D); gelu: w_in (E, D, F)."""

    def __init__(self, n_experts: int, d_model: int, d_expert: int, activation: str, backend: str = "torch",
                 use_by_ends: bool | None = None) -> None:
        super().__init__()
        if activation not in ("swiglu", "gelu"):
            raise ValueError(f"moe.activation: unknown activation {activation!r}")
        width_in = 2 * d_expert if activation == "swiglu" else d_expert
        self.w_in = nn.Parameter(torch.empty(n_experts, d_model, width_in))
        self.w_out = nn.Parameter(torch.empty(n_experts, d_expert, d_model))
        self.n_experts = n_experts
        self.activation = activation
        self.backend = backend
        # Dropless token choice takes every assignment as a row (by_ends) where by_ends_applies
        # (None); True / False: always / never (the tests compare it with the computed rows only).
        self.use_by_ends = use_by_ends
        self.reset_parameters()

    def reset_parameters(self, std: float = 0.02, out_std: float | None = None) -> None:
        nn.init.normal_(self.w_in, std=std)
        nn.init.normal_(self.w_out, std=std if out_std is None else out_std)

    def gates_in_activation(self, x: Tensor) -> bool:
        """Whether the FFN should hand its gates to padded / grouped: where the activation runs as its
        Triton kernel (eager CUDA), which applies them at no cost (mode/kernels/swiglu.py, gelu.py)."""
        return use_triton(x, "elementwise")

    def act(self, h: Tensor, gates: Tensor | None = None) -> Tensor:
        """The activation of h (..., W), times gates (h's leading shape) when given."""
        return (swiglu if self.activation == "swiglu" else gelu)(h, gates)

    def padded(self, xs: Tensor, gates: Tensor | None = None) -> Tensor:
        """xs (E, R, D) -> (E, R, D): expert e on its R rows; gates (E*R,) each row's, or None."""
        experts, rows, width = xs.shape
        if self.backend == "torch":
            row_gates = None if gates is None else gates.view(experts, rows)
            return torch.bmm(self.act(torch.bmm(xs, self.w_in), row_gates), self.w_out)
        counts = torch.full((experts,), rows, dtype=torch.long)
        return self.grouped(xs.reshape(experts * rows, width), counts, gates).view(experts, rows, width)

    def by_ends_applies(self, x: Tensor) -> bool:
        """Whether by_ends runs for tokens x: as use_by_ends says, or where it is None, on a GPU; on
        torch (eager or compiled), one whose torch._grouped_mm is one kernel, bf16 compute, widths
        aligned to its 16-byte rows; on grouped_gemm, eager (its host copy would split a compiled
        graph anyway)."""
        if self.use_by_ends is not None:
            return self.use_by_ends
        if self.backend == "grouped_gemm":
            return x.is_cuda and not torch.compiler.is_compiling()
        return self.backend == "torch" and self.grouped_mm_applies(x)

    def grouped_mm_applies(self, x: Tensor) -> bool:
        """Whether torch._grouped_mm runs these experts for tokens x as one grouped kernel reading
        its offsets on the device: a GPU of _GROUPED_MM_CAPABILITIES, bf16 compute, widths aligned
        to its 16-byte rows (whatever the backend: the weights are the same)."""
        if not x.is_cuda or not hasattr(torch, "_grouped_mm") or _compute_dtype(x) != torch.bfloat16:
            return False
        card = torch.cuda.get_device_properties(x.device)  # constant-folded under torch.compile
        return (card.major, card.minor) in _GROUPED_MM_CAPABILITIES and all(size % 8 == 0 for size in self.w_in.shape[1:])

    def static_grouped_applies(self, x: Tensor) -> bool:
        """Whether a decode step's experts (MoEFFN's static path) run by_ends on the device for tokens
        x (else every_row): as use_by_ends says, or where it is None, where grouped_mm_applies."""
        return self.grouped_mm_applies(x) if self.use_by_ends is None else self.use_by_ends

    def by_ends(self, xs: Tensor, ends: Tensor, gates: Tensor | None = None, computed: Tensor | None = None,
                on_device: bool = False) -> Tensor:
        """xs (R, D) sorted by expert, ends (E,) int32 on the device: expert e's rows end at ends[e]
        -> (R, D); gates (R,) each row's, or None. Rows from ends[-1] on are not computed: their
        outputs (and their gradients in the backward) are undefined and the caller's inverse map
        never reads them; or, with computed (R,) bool (False past the end) for a caller that reads
        every row, they are zeros out and their gradient zeros in. on_device: torch._grouped_mm
        whatever the backend (grouped_gemm's gmm would read the ends on the host)."""
        if computed is not None:  # where, not a product: the undefined rows may hold NaN
            xs = torch.where(computed.unsqueeze(-1), xs, 0)
        if self.backend == "grouped_gemm" and not on_device:  # gmm takes the group sizes on the host: a sync
            ends = ends.cpu()
            ys = _gmm_mlp(self, xs, torch.diff(ends, prepend=ends.new_zeros(1)), gates)
        else:
            dtype = _compute_dtype(xs)  # bf16 where it applies; the CPU tests run it in float32
            mm = _few_rows_mm if self.few_rows_kernel_applies(xs, dtype) else _grouped_mm
            with torch.autocast("cuda", enabled=False):
                h = mm(xs.to(dtype), self.w_in.to(dtype), ends)  # (R, 2F or F)
                ys = mm(self.act(h, gates), self.w_out.to(dtype), ends)  # (R, D)
        return ys if computed is None else torch.where(computed.unsqueeze(-1), ys, 0)

    def few_rows_kernel_applies(self, xs: Tensor, dtype: torch.dtype) -> bool:
        """Whether by_ends' GEMMs over rows xs (R, D) in dtype run as mode's grouped kernel
        (mode/kernels/grouped_mm.py): a decode step's few rows (at most FEW_ROWS), 16-bit, with no
        gradient to compute, where the kernel policy allows it."""
        return (xs.shape[0] <= FEW_ROWS and dtype in (torch.bfloat16, torch.float16) and not torch.is_grad_enabled()
                and use_triton(xs, "grouped_mm"))

    def every_row(self, x: Tensor) -> Tensor:
        """x (T, D) -> (E, T, D): every expert on every row, two batched matmuls (static shapes, any
        device and dtype; E times the FLOPs of the rows' own experts)."""
        return torch.matmul(self.act(torch.matmul(x, self.w_in)), self.w_out)  # (T, D) @ (E, D, W): (E, T, W)

    def grouped(self, xs: Tensor, counts: Tensor, gates: Tensor | None = None) -> Tensor:
        """xs (M, D) sorted by expert, counts (E,) rows of each -> (M, D); gates (M,) each row's, or None."""
        if self.backend == "torch":
            chunks = xs.split(counts.tolist())
            row_gates = [None] * len(chunks) if gates is None else gates.split(counts.tolist())
            return torch.cat([self.act(c @ self.w_in[e], g) @ self.w_out[e]
                              for e, (c, g) in enumerate(zip(chunks, row_gates))])
        return _gmm_mlp(self, xs, counts, gates)


def _grouped_mm(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    return torch._grouped_mm(x, w, offs=ends)


def _few_rows_mm(x: Tensor, w: Tensor, ends: Tensor) -> Tensor:
    from mode.kernels.grouped_mm import grouped_rows_mm  # Triton: imported where it runs

    return grouped_rows_mm(x, w, ends)


def _compute_dtype(x: Tensor) -> torch.dtype:
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else x.dtype


def _gmm_dtype(x: Tensor) -> torch.dtype:
    dtype = _compute_dtype(x)
    if dtype != torch.bfloat16:
        raise RuntimeError(
            "moe.backend grouped_gemm / megablocks compute in bfloat16: run under bf16 autocast "
            f"or with bf16 weights (got {dtype})"
        )
    return dtype


def _gmm_mlp(experts: Experts, xs: Tensor, counts: Tensor, gates: Tensor | None = None) -> Tensor:
    """Both expert matmuls as grouped GEMMs (grouped_gemm's gmm, which megablocks also uses)."""
    from grouped_gemm.ops import gmm

    dtype = _gmm_dtype(xs)
    if xs.shape[0] == 0:  # every assignment went to a no-op expert or was dropped
        return xs.new_zeros(0, xs.shape[1], dtype=dtype)
    # gmm reads the group sizes on the host; rows past their sum (by_ends' no-op rows) it leaves alone
    counts = counts.to("cpu", torch.long)
    with torch.autocast("cuda", enabled=False):
        h = gmm(xs.to(dtype).contiguous(), experts.w_in.to(dtype), counts)  # (M, 2F or F)
        return gmm(experts.act(h, gates).contiguous(), experts.w_out.to(dtype), counts)  # (M, D)


def megablocks_token_choice(experts: Experts, x: Tensor, routing: TokenChoiceRouting) -> Tensor:
    """Token choice through megablocks' machinery: x (T, D) -> (T, D).

    megablocks sorts the T*k assignments into bins, gathers rows in bin order, runs the
    experts as grouped GEMMs, and scatters back weighted by the gates. No-op and dropped
    assignments go to one extra bin E that is never computed (its rows are zeros).
    """
    import megablocks.ops as mops

    n_experts, top_k = experts.n_experts, routing.slots.shape[1]
    if routing.capacity is None:  # dropless: every real assignment is computed, the no-op slots go to bin E
        bin_of = routing.slots.clamp(max=n_experts).reshape(-1).int()  # (T*k,)
    else:
        bin_of = torch.where(routing.positions >= 0, routing.slots, n_experts).reshape(-1).int()
    bin_ids, order = mops.sort(bin_of, max(1, n_experts.bit_length()))
    per_bin = mops.histogram(bin_of, n_experts + 1)  # (E+1,)
    bins = mops.inclusive_cumsum(per_bin, 0)
    dtype = _gmm_dtype(x)
    with torch.autocast("cuda", enabled=False):
        rows = mops.gather(x.to(dtype).contiguous(), order, bin_ids, bins, top_k)  # (T*k, D), by bin
    counts = per_bin[:n_experts].to("cpu", torch.long)
    computed = int(counts.sum())
    if computed == rows.shape[0]:  # every assignment computed: no slice (its backward is a zero-filled copy)
        ys = _gmm_mlp(experts, rows, counts)
    else:  # the no-op bin's rows: a zero update
        ys = _gmm_mlp(experts, rows[:computed], counts)
        ys = torch.cat([ys, ys.new_zeros(rows.shape[0] - computed, ys.shape[1])])
    with torch.autocast("cuda", enabled=False):
        return mops.scatter(ys, order, bin_ids, routing.gates.reshape(-1).to(dtype), bins, top_k)  # (T, D)
