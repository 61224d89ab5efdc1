"""Moving rows between tokens and an expert-major layout, token-major, without atomics.

An MoE layer gathers each token's row into every expert that takes it, and sums the experts'
gated outputs back into the tokens. The PyTorch ops do the sums expert-major: a zero-filled
(T, D) buffer, then a scatter_add of the rows into it (the gather's backward, and the combine),
with a separate multiply by the gates before. Here each token reads the (at most J) rows it
owns through an inverse map instead and writes its sum once:

- sum_rows:    out[t] = sum_j gates[inv[t, j]] * rows[inv[t, j]] over inv[t, j] >= 0 (gates
               optional): the combine, and the gather's backward; one read of the rows, one
               write of (T, D), no zero fill, sums in float32 in a fixed order (deterministic);
               optionally plus a router's input gradient scores_grad (T, S) @ weight (S, D) in the
               same sum (expert choice's fused dispatch, mode/kernels/expert_choice.py);
- combine_backward: per row r of token ids[r], grad_rows[r] = gates[r] * grad[ids[r]] and
               grad_gates[r] = <rows[r], grad[ids[r]]> (float32) in one pass;
- add_gated_rows_: x[ids[r]] += gates[r] * rows[r] in place, for distinct ids (a depth router's
               gated update of the residual; its backward is combine_backward);
- put_gated_rows_: x[ids[r]] += round(gates[r] * round(a[r] + b[r])) in place for the kept rows,
               rounding as the PyTorch ops do, the gate optionally a depth router's g(score) of
               the row's token (a decode step's routed update, compacted or masked, and a
               prefill's routed update of its packed tokens);
- put_sum:     out[r] = h[r] + b[r] where keep[r], else x[r] (a decode step's layer that computes
               every row: its output, h + FFN(norm(h)), for the kept rows, one pass);
- gather_rows_as: out[r] = x[ids[r]] in another dtype (the float32 stream's rows gathered straight
               into the experts' bf16, the rounding their matmuls' autocast would make).

Eager mode on CUDA: three autograd functions (GatherRows; CombineRows; SumRows, the combine when
the experts' activation applied the gates already, mode/kernels/swiglu.py and gelu.py, whose
backward is a gather).
Under torch.compile the routed layers keep plain gather / scatter_add, which Inductor fuses with
its neighbours: these kernels as torch.library operators were no faster there.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, rounded_as, store_rounded

# Tiles: the fastest tried for each kernel with 16k bf16 rows of 1024 from 8 experts (expert choice's
# layout); add_gated_rows_ moves a depth router's few rows.
BLOCK_T, BLOCK_D, SUM_WARPS = 2, 1024, 4  # sum_rows: a (tokens, columns) tile per program
SCORES_BLOCK_T, SCORES_BLOCK_D, SCORES_WARPS = 2, 512, 2  # sum_rows with a router's input gradient
ADD_BLOCK_R, ADD_BLOCK_D, ADD_WARPS = 4, 256, 4  # add_gated_rows_, put_gated_rows_, put_sum
BLOCK_R, BLOCK_RD, COMBINE_BACKWARD_WARPS = 4, 512, 2  # combine_backward: rows per program; columns per step
GATHER_BLOCK_R, GATHER_BLOCK_D, GATHER_WARPS = 4, 512, 4  # gather_rows_as


@triton.jit
def _sum_rows(rows_ptr, gates_ptr, inverse_ptr, scores_grad_ptr, weight_ptr, out_ptr, tokens, width,
              J: tl.constexpr, J_PAD: tl.constexpr, HAS_GATES: tl.constexpr, S: tl.constexpr,
              BLOCK_T: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    t_ok, d_ok = t < tokens, d < width
    # Every slot's row index in one load, and no branch on them: the J row loads below do not wait
    # on each other. A token without a row at j loads nothing there (masked) and adds 0.
    slots = tl.arange(0, J_PAD)
    inverse = tl.load(inverse_ptr + t[:, None] * J + slots[None, :], mask=t_ok[:, None] & (slots[None, :] < J),
                      other=-1)  # (BLOCK_T, J_PAD)
    acc = tl.zeros((BLOCK_T, BLOCK_D), dtype=tl.float32)
    for j in tl.static_range(J):
        r = tl.sum(tl.where(slots[None, :] == j, inverse, 0), axis=1).to(tl.int64)  # (BLOCK_T,): column j
        hit = r >= 0
        v = tl.load(rows_ptr + r[:, None] * width + d[None, :], mask=hit[:, None] & d_ok[None, :], other=0.0)
        v = v.to(tl.float32)
        if HAS_GATES:
            v = v * tl.load(gates_ptr + r, mask=hit, other=0.0).to(tl.float32)[:, None]
        acc += v
    # S > 0: plus the router's input gradient, scores_grad (T, S) @ weight (S, D), in the same sum
    for s in tl.static_range(S):
        g = tl.load(scores_grad_ptr + t * S + s, mask=t_ok, other=0.0).to(tl.float32)  # (BLOCK_T,)
        w = tl.load(weight_ptr + s * width + d, mask=d_ok, other=0.0).to(tl.float32)  # (BLOCK_D,)
        acc += g[:, None] * w[None, :]
    store_rounded(out_ptr + t[:, None] * width + d[None, :], acc, t_ok[:, None] & d_ok[None, :])


@triton.jit
def _combine_backward(grad_ptr, ids_ptr, rows_ptr, gates_ptr, grad_rows_ptr, grad_gates_ptr, n_rows, width,
                      BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < n_rows
    token = tl.load(ids_ptr + r, mask=r_ok, other=0).to(tl.int64)  # (BLOCK_R,)
    gate = tl.load(gates_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    dot = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, width, BLOCK_D):
        d = start + tl.arange(0, BLOCK_D)
        mask = r_ok[:, None] & (d < width)[None, :]
        g = tl.load(grad_ptr + token[:, None] * width + d[None, :], mask=mask, other=0.0).to(tl.float32)
        y = tl.load(rows_ptr + r[:, None] * width + d[None, :], mask=mask, other=0.0).to(tl.float32)
        dot += tl.sum(g * y, axis=1)
        store_rounded(grad_rows_ptr + r[:, None] * width + d[None, :], g * gate[:, None], mask)
    tl.store(grad_gates_ptr + r, dot, mask=r_ok)


@triton.jit
def _gather_rows(x_ptr, ids_ptr, out_ptr, n_rows, width, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (r < n_rows)[:, None] & (d < width)[None, :]
    src = tl.load(ids_ptr + r, mask=r < n_rows, other=0).to(tl.int64)
    v = tl.load(x_ptr + src[:, None] * width + d[None, :], mask=mask, other=0.0).to(tl.float32)
    store_rounded(out_ptr + r[:, None] * width + d[None, :], v, mask)


@triton.jit
def _add_gated_rows(x_ptr, ids_ptr, gates_ptr, rows_ptr, n_rows, width, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (r < n_rows)[:, None] & (d < width)[None, :]
    token = tl.load(ids_ptr + r, mask=r < n_rows, other=0).to(tl.int64)
    gate = tl.load(gates_ptr + r, mask=r < n_rows, other=0.0).to(tl.float32)
    update = tl.load(rows_ptr + r[:, None] * width + d[None, :], mask=mask, other=0.0).to(tl.float32)
    target = x_ptr + token[:, None] * width + d[None, :]
    total = tl.load(target, mask=mask, other=0.0).to(tl.float32) + gate[:, None] * update
    store_rounded(target, total, mask)


# put_gated_rows_'s gates: each row's own (GIVEN), or a router score per row of x, taken as it is
# (SCORE) or through a sigmoid (SIGMOID)
_GIVEN, _SCORE, _SIGMOID = (tl.constexpr(i) for i in range(3))
GATE_KINDS = {None: 0, "identity": 1, "sigmoid": 2}


@triton.jit
def _put_gated_rows(x_ptr, ids_ptr, keep_ptr, a_ptr, b_ptr, gates_ptr, n_rows, width, HAS_IDS: tl.constexpr,
                    HAS_KEEP: tl.constexpr, GATE: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    r_ok = r < n_rows
    if HAS_KEEP:
        keep = tl.load(keep_ptr + r, mask=r_ok, other=0) != 0
    else:
        keep = r_ok
    mask = keep[:, None] & (d < width)[None, :]
    if HAS_IDS:
        token = tl.load(ids_ptr + r, mask=r_ok, other=0).to(tl.int64)
    else:
        token = r
    if GATE == _GIVEN:
        gate = tl.load(gates_ptr + r, mask=r_ok, other=0.0).to(tl.float32)
    else:
        gate = tl.load(gates_ptr + token, mask=r_ok, other=0.0).to(tl.float32)
        if GATE == _SIGMOID:  # in the scores' dtype, as torch.sigmoid on them
            gate = rounded_as(tl.sigmoid(gate), gates_ptr)
    at = r[:, None] * width + d[None, :]
    update = rounded_as(tl.load(a_ptr + at, mask=mask, other=0.0).to(tl.float32)
                        + tl.load(b_ptr + at, mask=mask, other=0.0).to(tl.float32), a_ptr)
    update = rounded_as(rounded_as(update * gate[:, None], a_ptr), x_ptr)
    target = x_ptr + token[:, None] * width + d[None, :]
    store_rounded(target, tl.load(target, mask=mask, other=0.0).to(tl.float32) + update, mask)


@triton.jit
def _put_sum(x_ptr, h_ptr, b_ptr, keep_ptr, out_ptr, n_rows, width, BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    r_ok = r < n_rows
    mask = r_ok[:, None] & (d < width)[None, :]
    keep = tl.load(keep_ptr + r, mask=r_ok, other=0) != 0
    at = r[:, None] * width + d[None, :]
    total = tl.load(h_ptr + at, mask=mask, other=0.0).to(tl.float32) + tl.load(b_ptr + at, mask=mask, other=0.0).to(tl.float32)
    total = rounded_as(total, out_ptr)
    x = tl.load(x_ptr + at, mask=mask, other=0.0).to(tl.float32)
    store_rounded(out_ptr + at, tl.where(keep[:, None], total, x), mask)


# ----------------------------------------------------------------------------- launches
def sum_rows(rows: Tensor, gates: Tensor | None, inverse: Tensor, scores_grad: Tensor | None = None,
             weight: Tensor | None = None, out_dtype: torch.dtype | None = None) -> Tensor:
    """out (T, D) in out_dtype (None: rows' dtype): out[t] = sum over t's rows r (inverse[t] >= 0) of
    gates[r] * rows[r] (gates None: 1), plus scores_grad[t] @ weight when given (scores_grad (T, S),
    weight (S, D)). Float32 sums, rounded once; call on rows' device (on_device_of)."""
    rows, inverse = rows.contiguous(), inverse.contiguous()
    tokens, width = inverse.shape[0], rows.shape[1]
    out = torch.empty(tokens, width, dtype=out_dtype or rows.dtype, device=rows.device)
    if out.numel() == 0:
        return out
    gates_arg = rows if gates is None else gates.contiguous()  # any pointer when there are no gates
    n_scores = 0 if scores_grad is None else scores_grad.shape[1]
    scores_grad = rows if scores_grad is None else scores_grad.contiguous()
    weight = rows if weight is None else weight.contiguous()
    tile = (BLOCK_T, BLOCK_D, SUM_WARPS) if n_scores == 0 else (SCORES_BLOCK_T, SCORES_BLOCK_D, SCORES_WARPS)
    block_t, block_d, warps = tile
    _sum_rows[(triton.cdiv(tokens, block_t), triton.cdiv(width, block_d))](
        rows, gates_arg, inverse, scores_grad, weight, out, tokens, width, J=inverse.shape[1],
        J_PAD=triton.next_power_of_2(inverse.shape[1]), HAS_GATES=gates is not None, S=n_scores,
        BLOCK_T=block_t, BLOCK_D=block_d, num_warps=warps,
    )
    return out


def combine_backward(grad: Tensor, ids: Tensor, rows: Tensor, gates: Tensor) -> tuple[Tensor, Tensor]:
    """grad (T, D), ids (R,), rows (R, D), gates (R,) -> (gates[r] * grad[ids[r]] in rows' dtype (R, D),
    <rows[r], grad[ids[r]]> float32 (R,)): the backward of summing gated rows into their tokens.
    Call on rows' device (on_device_of)."""
    grad, ids, rows, gates = grad.contiguous(), ids.contiguous(), rows.contiguous(), gates.contiguous()
    grad_rows = torch.empty_like(rows)
    grad_gates = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)  # every row written
    if rows.numel() == 0:
        return grad_rows, grad_gates.zero_()
    _combine_backward[(triton.cdiv(rows.shape[0], BLOCK_R),)](
        grad, ids, rows, gates, grad_rows, grad_gates, rows.shape[0], rows.shape[1], BLOCK_R=BLOCK_R, BLOCK_D=BLOCK_RD,
        num_warps=COMBINE_BACKWARD_WARPS,
    )
    return grad_rows, grad_gates


def add_gated_rows_(x: Tensor, ids: Tensor, gates: Tensor, rows: Tensor) -> None:
    """x (T, D) += gates[r] * rows[r] at row ids[r], in place, for distinct ids (R,) (a depth router's
    chosen tokens: no two rows meet); float32 arithmetic, rounded once to x's dtype. Call on x's
    device (on_device_of)."""
    ids, gates, rows = ids.contiguous(), gates.contiguous(), rows.contiguous()
    if rows.numel() == 0:
        return
    n_rows, width = rows.shape
    _add_gated_rows[(triton.cdiv(n_rows, ADD_BLOCK_R), triton.cdiv(width, ADD_BLOCK_D))](
        x, ids, gates, rows, n_rows, width, BLOCK_R=ADD_BLOCK_R, BLOCK_D=ADD_BLOCK_D, num_warps=ADD_WARPS,
    )


def put_gated_rows_(x: Tensor, ids: Tensor | None, keep: Tensor | None, a: Tensor, b: Tensor, gates: Tensor,
                    gate: str | None = None) -> None:
    """x (T, D) at row ids[r] (distinct; None: row r) += gates[r] * (a[r] + b[r]) in place where
    keep[r] (None: every row); a, b (R, D) in one dtype, gates (R,) float32: a + b rounded to their
    dtype, times the gate rounded again, then to x's dtype and added, rounded once (torch's ops on
    those dtypes). gate "identity" / "sigmoid": gates (T,) float32 are router scores, one per row of
    x (in any float dtype), and row r's gate is g(gates[ids[r]]) (mode.routing.apply_gate's g, in
    the scores' dtype; the sigmoid here may differ from torch's in the last bit). Call on x's device
    (on_device_of)."""
    if a.dtype != b.dtype:
        raise ValueError(f"put_gated_rows_: a is {a.dtype}, b is {b.dtype}")
    if gate not in GATE_KINDS:
        raise ValueError(f"put_gated_rows_: unknown gate {gate!r} (expected one of {list(GATE_KINDS)})")
    a, b, gates = a.contiguous(), b.contiguous(), gates.contiguous()
    ids_arg = a if ids is None else ids.contiguous()  # any pointer without ids
    keep_arg = ids_arg if keep is None else keep.contiguous().view(torch.uint8)  # any pointer without keep
    n_rows, width = a.shape
    if n_rows:
        _put_gated_rows[(triton.cdiv(n_rows, ADD_BLOCK_R), triton.cdiv(width, ADD_BLOCK_D))](
            x, ids_arg, keep_arg, a, b, gates, n_rows, width, HAS_IDS=ids is not None, HAS_KEEP=keep is not None,
            GATE=GATE_KINDS[gate], BLOCK_R=ADD_BLOCK_R, BLOCK_D=ADD_BLOCK_D, num_warps=ADD_WARPS,
            enable_fp_fusion=False,  # no fused multiply-add: the ops round apart
        )


def put_sum_applies(x: Tensor, h: Tensor, b: Tensor, keep: Tensor) -> bool:
    """Whether put_sum takes these: one shape, x and h in the dtype of h + b, a flag per row."""
    return (x.shape == h.shape == b.shape and x.dtype == h.dtype == torch.result_type(h, b)
            and keep.dtype == torch.bool and keep.numel() * x.shape[-1] == x.numel())


def put_sum(x: Tensor, h: Tensor, b: Tensor, keep: Tensor) -> Tensor:
    """torch.where(keep, h + b, x) for x, h, b (..., D) and keep one flag per row of D: a new tensor,
    h + b rounded once to x's dtype, as torch's ops (put_sum_applies). Call on x's device (on_device_of)."""
    if not put_sum_applies(x, h, b, keep):
        raise ValueError(f"put_sum: x {tuple(x.shape)} {x.dtype}, h {tuple(h.shape)} {h.dtype}, b {tuple(b.shape)} "
                         f"{b.dtype}, keep {tuple(keep.shape)} {keep.dtype}: see put_sum_applies")
    shape, width = x.shape, x.shape[-1]
    x, h, b = (t.reshape(-1, width).contiguous() for t in (x, h, b))  # (N, D) each
    out = torch.empty_like(x)
    n_rows = x.shape[0]
    if n_rows:
        _put_sum[(triton.cdiv(n_rows, ADD_BLOCK_R), triton.cdiv(width, ADD_BLOCK_D))](
            x, h, b, keep.contiguous().view(torch.uint8), out, n_rows, width, BLOCK_R=ADD_BLOCK_R, BLOCK_D=ADD_BLOCK_D,
            num_warps=ADD_WARPS,
        )
    return out.view(shape)


def gather_rows_as(x: Tensor, ids: Tensor, dtype: torch.dtype) -> Tensor:
    """x (T, D), ids (R,) -> x[ids] (R, D) in dtype, rounded to nearest even (one pass: no copy of
    the rows in x's dtype). Call on x's device (on_device_of)."""
    x, ids = x.contiguous(), ids.contiguous()
    out = torch.empty(ids.shape[0], x.shape[1], dtype=dtype, device=x.device)
    if out.numel():
        _gather_rows[(triton.cdiv(ids.shape[0], GATHER_BLOCK_R), triton.cdiv(x.shape[1], GATHER_BLOCK_D))](
            x, ids, out, ids.shape[0], x.shape[1], BLOCK_R=GATHER_BLOCK_R, BLOCK_D=GATHER_BLOCK_D,
            num_warps=GATHER_WARPS,
        )
    return out


# ----------------------------------------------------------------------------- autograd
class GatherRows(torch.autograd.Function):
    """x (T, D), ids (R,), inverse (T, J) -> x[ids] (R, D) in dtype; the backward sums each token's
    rows in float32 into x's dtype."""

    @staticmethod
    def forward(ctx, x: Tensor, ids: Tensor, inverse: Tensor, dtype: torch.dtype) -> Tensor:
        ctx.save_for_backward(inverse)
        ctx.x_dtype = x.dtype
        if dtype == x.dtype:
            return x.index_select(0, ids)
        with on_device_of(x):
            return gather_rows_as(x, ids, dtype)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (inverse,) = ctx.saved_tensors
        with on_device_of(grad):
            return sum_rows(grad, None, inverse, out_dtype=ctx.x_dtype), None, None, None


class CombineRows(torch.autograd.Function):
    """rows (R, D), gates (R,), ids (R,), inverse (T, J) -> (T, D): each token's gated rows summed."""

    @staticmethod
    def forward(ctx, rows: Tensor, gates: Tensor, ids: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(rows, gates, ids)
        with on_device_of(rows):
            return sum_rows(rows, gates, inverse)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, None, None]:
        rows, gates, ids = ctx.saved_tensors
        with on_device_of(rows):
            grad_rows, grad_gates = combine_backward(grad, ids, rows, gates)
        return grad_rows, grad_gates.to(gates.dtype), None, None


class SumRows(torch.autograd.Function):
    """rows (R, D), ids (R,), inverse (T, J) -> (T, D): each token's rows summed (the combine of rows
    whose gates the experts applied already); the backward gathers each row's token's gradient
    (GatherRows the other way round)."""

    @staticmethod
    def forward(ctx, rows: Tensor, ids: Tensor, inverse: Tensor) -> Tensor:
        ctx.save_for_backward(ids)
        with on_device_of(rows):
            return sum_rows(rows, None, inverse)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None, None]:
        (ids,) = ctx.saved_tensors
        return grad.index_select(0, ids), None, None
