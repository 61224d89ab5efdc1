"""AdamW on a float32 master weight whose bf16 copy the model computes with, one launch for many tensors.

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

t, the tensor's step count, lr and grad_scale are read on the device, so that a CUDA graph can
capture the update (mode/training/deferred_update.py); with an `active` flag the update is
conditional: where it reads 0 nothing moves. One launch updates many tensors: a table on the
device holds each tensor's addresses, size and first block, and each program finds its tensor
there (a dense model's forty-odd matrices are forty-odd launches otherwise, with a gap after each).
A table may be rewritten in place between a graph's replays (MastersLaunch.rebind).

The same kernel steps the float32 parameters that have no bf16 copy (embeddings, the output head,
norms, routers) from their float32 gradients, in a launch of their own (an update's copy None):
torch.optim.AdamW's fused step takes some 40% longer over them, in many launches (bench.optimizer).
A master's gradient is float32 where micro-batches were summed into it (train.grad_accum > 1: the
bf16 gradients added in float32), again in launches of their own.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of, store_rounded

BLOCK = 1024  # elements a program (4 warps): the fastest of 1024-8192 on an H200 (python -m bench.optimizer)
MAX_TENSORS = 256  # tensors a launch takes; more take more launches
TABLE_ROWS = 8  # master, exp_avg, exp_avg_sq, grad, copy, step addresses; size; first block
ADDRESSES = 6  # the table's rows of addresses
GRAD_ROW = 3  # the one of gradients


@triton.jit
def _adamw_masters(table_ptr, n_tensors, grad_scale_ptr, lr_ptr, active_ptr, beta1, beta2, log_beta1, log_beta2, eps,
                   decay, BLOCK: tl.constexpr, TENSORS: tl.constexpr, HAS_ACTIVE: tl.constexpr, HAS_COPY: tl.constexpr,
                   GRAD_FLOAT32: tl.constexpr):
    if HAS_ACTIVE:
        if tl.load(active_ptr) == 0:  # no update staged: nothing moves
            return
    index = tl.program_id(0)
    idx = tl.arange(0, TENSORS)
    firsts = tl.load(table_ptr + 7 * n_tensors + idx, mask=idx < n_tensors, other=1 << 62)
    t = tl.sum((firsts <= index).to(tl.int32), axis=0) - 1  # this program's tensor
    n = tl.load(table_ptr + 6 * n_tensors + t)
    w_ptr = tl.load(table_ptr + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(table_ptr + n_tensors + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(table_ptr + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
    # HAS_COPY false: the weight is its own master (float32 gradient), no copy to write
    g_ptr = tl.load(table_ptr + 3 * n_tensors + t).to(tl.pointer_type(tl.float32 if GRAD_FLOAT32 else tl.bfloat16))
    copy_ptr = tl.load(table_ptr + 4 * n_tensors + t).to(tl.pointer_type(tl.bfloat16))
    step_ptr = tl.load(table_ptr + 5 * n_tensors + t).to(tl.pointer_type(tl.float32))
    block = index - tl.load(table_ptr + 7 * n_tensors + t)  # this program's block of its tensor
    offs = block * BLOCK + tl.arange(0, BLOCK)
    # Addresses read from the table carry no alignment Triton can see: every one is 16-byte aligned
    # (kernel_takes), said here so that whole blocks' loads and stores are vectorised.
    w_ptrs = tl.max_contiguous(tl.multiple_of(w_ptr + offs, 16), BLOCK)
    m_ptrs = tl.max_contiguous(tl.multiple_of(m_ptr + offs, 16), BLOCK)
    v_ptrs = tl.max_contiguous(tl.multiple_of(v_ptr + offs, 16), BLOCK)
    g_ptrs = tl.max_contiguous(tl.multiple_of(g_ptr + offs, 16), BLOCK)
    copy_ptrs = tl.max_contiguous(tl.multiple_of(copy_ptr + offs, 16), BLOCK)
    step = tl.load(step_ptr)
    grad_scale = tl.load(grad_scale_ptr)
    lr = tl.load(lr_ptr)
    mask = offs < n
    if (block + 1) * BLOCK <= n:  # a whole block: no mask, vectorised
        _update(w_ptrs, m_ptrs, v_ptrs, g_ptrs, copy_ptrs, mask, step, grad_scale, lr, beta1, beta2, log_beta1,
                log_beta2, eps, decay, MASKED=False, HAS_COPY=HAS_COPY)
    else:
        _update(w_ptrs, m_ptrs, v_ptrs, g_ptrs, copy_ptrs, mask, step, grad_scale, lr, beta1, beta2, log_beta1,
                log_beta2, eps, decay, MASKED=True, HAS_COPY=HAS_COPY)


@triton.jit
def _update(w_ptrs, m_ptrs, v_ptrs, g_ptrs, copy_ptrs, mask, step, grad_scale, lr, beta1, beta2, log_beta1, log_beta2,
            eps, decay, MASKED: tl.constexpr, HAS_COPY: tl.constexpr):
    correction1 = 1.0 - tl.exp(step * log_beta1)  # 1 - beta1^t
    correction2 = 1.0 - tl.exp(step * log_beta2)
    if MASKED:
        g = tl.load(g_ptrs, mask=mask, other=0.0)
        w = tl.load(w_ptrs, mask=mask, other=0.0)
        m = tl.load(m_ptrs, mask=mask, other=0.0)
        v = tl.load(v_ptrs, mask=mask, other=0.0)
    else:
        g = tl.load(g_ptrs)
        w = tl.load(w_ptrs)
        m = tl.load(m_ptrs)
        v = tl.load(v_ptrs)
    g = g.to(tl.float32) / grad_scale
    w = w - lr * decay * w
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    w = w - (lr / correction1) * m / (tl.sqrt(v) / tl.sqrt(correction2) + eps)
    if not MASKED:
        mask = None
    tl.store(w_ptrs, w, mask=mask)
    tl.store(m_ptrs, m, mask=mask)
    tl.store(v_ptrs, v, mask=mask)
    if HAS_COPY:
        store_rounded(copy_ptrs, w, mask)


@triton.jit
def _count_steps(table_ptr, n_tensors, active_ptr, TENSORS: tl.constexpr):
    """Each tensor's step count + 1 where an update is staged (active), before the update reads it."""
    idx = tl.arange(0, TENSORS)
    step_ptrs = tl.load(table_ptr + 5 * n_tensors + idx, mask=idx < n_tensors, other=0).to(tl.pointer_type(tl.float32))
    active = tl.load(active_ptr)
    steps = tl.load(step_ptrs, mask=idx < n_tensors, other=0.0)
    tl.store(step_ptrs, steps + (active != 0).to(tl.float32), mask=idx < n_tensors)


# (master, exp_avg, exp_avg_sq, grad, copy, step) of one weight; copy None: a float32 weight, its own master
Update = tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None, Tensor]


def adamw_masters_step_(updates: list[Update], grad_scale: Tensor, lr: float | Tensor, betas: tuple[float, float],
                        eps: float, weight_decay: float, block: int = BLOCK) -> None:
    """One AdamW update of each master (float32) from its grad (bf16 or float32), in place, and its
    copy (bf16) = the master rounded, in one launch per MAX_TENSORS weights of a kind
    (mode.training.bf16_weights.master_updates_ has the same in PyTorch ops). An update whose copy
    is None is a float32 weight with a float32 grad: the same update, in launches of their own.

    step: each weight's step count after this update (0-d float32, on the device); grad_scale: 0-d
    float32, what the gradients are divided by (1 / the clipping factor, as AdamW's grad_scale); lr:
    a number or a 0-d float32 tensor on the device. Every tensor contiguous, on one device. block:
    elements a program (a power of 2; bench.optimizer compares them)."""
    if not isinstance(lr, Tensor):
        lr = torch.full((), lr, dtype=torch.float32, device=grad_scale.device)
    for launch in masters_launches(updates, block):
        launch.run(grad_scale, lr, betas, eps, weight_decay)


# A launch's kind: (the updates have bf16 copies, their gradients are float32); a launch takes one kind
Kind = tuple[bool, bool]
KINDS: tuple[Kind, ...] = ((True, False), (True, True), (False, True))  # the order launches are made in


@dataclass
class MastersLaunch:
    """One launch's table (TABLE_ROWS, T) on the device and the programs it takes, for up to
    MAX_TENSORS weights of the same sizes in the same order each time. rebind() rewrites the table
    in place when the tensors move (a CUDA graph that captured the launch then reads the new ones)."""

    table: Tensor
    n_tensors: int
    programs: int
    block: int
    addresses: tuple[int, ...]
    kind: Kind = (True, False)  # masters with bf16 copies and bf16 gradients

    def rebind(self, updates: list[Update]) -> None:
        """Point the table at updates: the same sizes as it was built for, in the same order."""
        table, programs, addresses = _table(updates, self.block, None)
        if (len(updates), programs, kind_of(updates)) != (self.n_tensors, self.programs, self.kind):
            raise ValueError("MastersLaunch.rebind: the weights' sizes differ from the table's")
        if addresses != self.addresses:
            self.table.copy_(table.pin_memory() if self.table.is_cuda else table, non_blocking=True)
            self.addresses = addresses

    def run(self, grad_scale: Tensor, lr: Tensor, betas: tuple[float, float], eps: float, weight_decay: float,
            active: Tensor | None = None) -> None:
        """The update (lr, grad_scale: 0-d float32 on the device). active (0-d float32): only where it
        is nonzero, and then the step counts are advanced here first; None: always, the counts
        already advanced by the caller."""
        beta1, beta2 = betas
        logs = [math.log(b) if b > 0 else -math.inf for b in betas]
        tensors = triton.next_power_of_2(self.n_tensors)
        has_copy, grad_float32 = self.kind
        with on_device_of(grad_scale):
            if active is not None:
                _count_steps[(1,)](self.table, self.n_tensors, active, TENSORS=tensors)
            _adamw_masters[(self.programs,)](
                self.table, self.n_tensors, grad_scale, lr, grad_scale if active is None else active, beta1, beta2,
                *logs, eps, weight_decay, BLOCK=self.block, TENSORS=tensors, HAS_ACTIVE=active is not None,
                HAS_COPY=has_copy, GRAD_FLOAT32=grad_float32, num_warps=4 if self.block <= 2048 else 8)


def masters_launches(updates: list[Update], block: int = BLOCK) -> list[MastersLaunch]:
    """The launches that update `updates`, MAX_TENSORS weights of one kind each, their tables on the
    device: the masters with bf16 gradients first, then those with float32 (summed) gradients, then
    the float32 weights (copy None)."""
    launches = []
    for kind in KINDS:
        chosen = [update for update in updates if _kind(update) == kind]
        for start in range(0, len(chosen), MAX_TENSORS):
            chunk = chosen[start:start + MAX_TENSORS]
            table, programs, addresses = _table(chunk, block, chunk[0][0].device)
            launches.append(MastersLaunch(table, len(chunk), programs, block, addresses, kind))
    return launches


def kernel_takes(update: Update) -> bool:
    """Whether the kernel can update it: float32 master and moments, a bf16 copy with a bf16 or
    float32 gradient (or a float32 gradient and no copy), each contiguous and 16-byte aligned (its
    whole blocks are read and written 16 bytes at a time), all the same size."""
    master, exp_avg, exp_avg_sq, grad, copy, _ = update
    if copy is None:
        tensors, dtypes = (master, exp_avg, exp_avg_sq, grad), (torch.float32,) * 4
    else:
        tensors, dtypes = (master, exp_avg, exp_avg_sq, copy), (torch.float32,) * 3 + (torch.bfloat16,)
        if grad.dtype not in (torch.bfloat16, torch.float32):
            return False
        tensors, dtypes = tensors + (grad,), dtypes + (grad.dtype,)
    return all(t.dtype == d and t.is_contiguous() and t.data_ptr() % 16 == 0 and t.numel() == master.numel()
               for t, d in zip(tensors, dtypes))


def _kind(update: Update) -> Kind:
    return update[4] is not None, update[3].dtype == torch.float32


def kind_of(updates: list[Update]) -> Kind:
    """The one kind of updates; an error where they mix kinds (each kind takes launches of its own)."""
    kinds = {_kind(update) for update in updates}
    if len(kinds) > 1:
        raise ValueError("MastersLaunch: float32 weights (copy None), masters with bf16 gradients and masters with "
                         "float32 gradients take launches of their own")
    return kinds.pop()


def _table(updates: list[Update], block: int, device: torch.device | None) -> tuple[Tensor, int, tuple[int, ...]]:
    """The (TABLE_ROWS, T) int64 table of updates (on the host, or on `device`: from pinned memory,
    without waiting for the device's queue), the programs they take and the addresses it holds."""
    columns, first = [], 0
    kind_of(updates)
    for update in updates:
        if not kernel_takes(update):
            raise ValueError("adamw_masters_step_: float32 masters and moments, bf16 copies with bf16 or float32 "
                             "gradients (or float32 gradients and no copies), contiguous and 16-byte aligned "
                             "(kernel_takes)")
        n = update[0].numel()
        columns.append([0 if t is None else t.data_ptr() for t in update] + [n, first])
        first += triton.cdiv(n, block)
    table = torch.tensor(columns, dtype=torch.int64).t().contiguous()  # (TABLE_ROWS, T)
    addresses = tuple(int(a) for column in columns for a in column[:ADDRESSES])
    if device is not None and device.type == "cuda":
        table = table.pin_memory().to(device, non_blocking=True)
    return table, first, addresses
