"""The global 2-norm of many gradients that clipping reads, in one launch per dtype.

torch._foreach_norm takes a launch per group of tensors and per dtype, its per-tensor norms then
stacked and normed again: for a model with experts, some 30 launches reading the bf16 gradients
at about half the card's bandwidth. Here a table on the device holds each gradient's address,
size and first block (as the masters' update's table does, mode/kernels/adamw.py), and a map from
each program to its gradient (finding it from the table, as the update's kernel does, costs each
program a reduction over the table before its one load); each program sums the squares of one
block in float32 and writes that one partial sum, and the partials are summed after it. Every sum
is float32, as total_norm's per-tensor sums are (mode/training/optim.py); only the grouping of the
additions differs. The blocks are fixed by the table, so the norm is the same bit for bit from
step to step for the same gradients.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of

BLOCK = 4096  # elements a program (4 warps): the fastest tried on an H200 (bench/results/, 2026-11-29)
ADDRESS_ROW = 0  # the table's row of gradient addresses


@triton.jit
def _block_squares(table_ptr, owner_ptr, n_tensors, out_ptr, BLOCK: tl.constexpr, FLOAT32: tl.constexpr):
    """Program i: the sum of squares of block i (in the table's order of gradients and their blocks)."""
    index = tl.program_id(0)
    t = tl.load(owner_ptr + index)  # this program's gradient
    n = tl.load(table_ptr + n_tensors + t)
    g_ptr = tl.load(table_ptr + t).to(tl.pointer_type(tl.float32 if FLOAT32 else tl.bfloat16))
    block = index - tl.load(table_ptr + 2 * n_tensors + t)
    offs = block * BLOCK + tl.arange(0, BLOCK)
    # Addresses from the table carry no alignment Triton can see: each is 16-byte aligned
    # (GradNorm.takes), said here so that a whole block's loads are vectorised.
    g_ptrs = tl.max_contiguous(tl.multiple_of(g_ptr + offs, 16), BLOCK)
    if (block + 1) * BLOCK <= n:
        g = tl.load(g_ptrs).to(tl.float32)
    else:
        g = tl.load(g_ptrs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(out_ptr + index, tl.sum(g * g, axis=0))


class GradNorm:
    """The 2-norm of a fixed list of gradients (their addresses, sizes and dtypes, bf16 or float32),
    its tables built once: each call reads the tensors at those addresses now (the caller keeps them
    there, or rewrites a table's ADDRESS_ROW where one moved: TorchOptimization's step plan)."""

    def __init__(self, grads: list[Tensor]) -> None:
        if not self.takes(grads):
            raise ValueError("GradNorm: bf16 or float32 gradients, contiguous, 16-byte aligned, on one device "
                             "(GradNorm.takes)")
        device = grads[0].device
        # (table, each program's gradient, gradients, first partial, blocks, float32), one a dtype
        self.launches: list[tuple[Tensor, Tensor, int, int, int, bool]] = []
        self.addresses: list[list[int]] = []  # each launch's gradients' addresses, in its table's order
        programs = 0
        for dtype in (torch.bfloat16, torch.float32):
            kind = [g for g in grads if g.dtype == dtype]
            if kind:
                table, owner = _table(kind, device)
                self.launches.append((table, owner, len(kind), programs, len(owner), dtype == torch.float32))
                self.addresses.append([g.data_ptr() for g in kind])
                programs += len(owner)
        self.partials = torch.empty(programs, dtype=torch.float32, device=device)  # one sum a block

    @staticmethod
    def takes(grads: list[Tensor]) -> bool:
        """Whether one GradNorm can norm grads: some, each bf16 or float32, contiguous, not empty and
        16-byte aligned (its whole blocks are read 16 bytes at a time), all on one device."""
        return bool(grads) and len({g.device for g in grads}) == 1 and all(
            g.dtype in (torch.bfloat16, torch.float32) and g.is_contiguous() and g.numel() > 0
            and g.data_ptr() % 16 == 0 for g in grads)

    def __call__(self) -> Tensor:
        """The norm, 0-d float32 on the gradients' device."""
        with on_device_of(self.partials):
            for table, owner, tensors, first, blocks, float32 in self.launches:
                _block_squares[(blocks,)](table, owner, tensors, self.partials[first:], BLOCK=BLOCK, FLOAT32=float32,
                                          num_warps=4)
        return self.partials.sum().sqrt()


def _table(grads: list[Tensor], device: torch.device) -> tuple[Tensor, Tensor]:
    """The (3, T) int64 table (address, size, first block) of grads and the (blocks,) int32 index of
    each block's gradient, on the device."""
    columns, first = [], 0
    blocks = [triton.cdiv(g.numel(), BLOCK) for g in grads]
    for g, n in zip(grads, blocks):
        columns.append([g.data_ptr(), g.numel(), first])
        first += n
    table = torch.tensor(columns, dtype=torch.int64).t().contiguous()  # (3, T)
    owner = torch.repeat_interleave(torch.arange(len(grads), dtype=torch.int32), torch.tensor(blocks))  # (blocks,)
    if device.type == "cuda":
        table, owner = (t.pin_memory().to(device, non_blocking=True) for t in (table, owner))
    return table, owner
