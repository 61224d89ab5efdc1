"""Token choice's row layouts in two Triton launches each: a stable counting sort by expert.

The torch backend's sync-free dropless layout (mode.routing.token_choice.dropless_rows) makes
every one of the N = T*k assignments a row, sorted by expert (stable: assignment order within an
expert), the ones no expert computes (no-op slots, padding) last, past the grouped GEMMs' end.
As PyTorch ops that is an argsort, a count, a cumsum, a gather, the inverse map's fill and index
put, and the gates' index: about 17 launches from the host in eager mode, each costing more of
the host's time than the GPU's. With E + 1 keys a counting sort does it in two:

- _count: one program per block of assignments: how many of them go to each key (P, E + 1);
- _place: one program per block: each key's first row (the rows of all lower keys,
  then this key's rows in earlier blocks, read from those counts in a fixed order), plus the
  assignment's rank among its block's assignments of the same key (a cumulative sum over a one-hot
  tile). It writes, per row, the token (ids) and the assignment whose gate the row takes (N, a
  zero gate the caller pads, for rows no expert computes), and where the caller needs no gradient
  to them, the gate itself; per assignment, its row or -1 (the inverse map); program 0 writes
  each expert's row end (the grouped GEMMs' offsets).

With a capacity (capacity_rows), the same sort runs in GShard's priority order (every first
choice, then every second: rank-major keys, no-op slots sharing key E): _count, then
_place_capacity, whose rank is the assignment's position in its expert's buffer. It writes the
positions (-1 past the capacity), the (E, C) table of assignments with its row ids, the inverse
map, and fills the table's empty rows (each expert's from its kept count on), a grid-stride
share per program: about 25 PyTorch ops in positions_in_expert, slot_table and token_choice_rows.

The same layouts bit for bit as primitives.sort_all_by_expert and rows_by_slot, and as
positions_in_expert, slot_table and token_choice_rows (tests/test_kernels.py). No gradient:
every output is an index.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from mode.kernels.common import on_device_of

# A program holds a (BLOCK_N, keys) one-hot tile and every program's (blocks, keys) counts, keys =
# E + 1 rounded up to a power of two: BLOCK_N = TILE // keys assignments (1024 for 8 experts), or
# the assignments rounded up to a power of two where fewer (at least MIN_BLOCK_N).
TILE = 16384
MAX_KEYS = 128
MIN_BLOCK_N = 16


@triton.jit
def _keys(slots_ptr, positions_ptr, p, p_ok, tokens, n_experts, K: tl.constexpr, RANK_MAJOR: tl.constexpr):
    """The p-th assignment in processing order -> (its key, its id a = t * K + j).

    Token-major (dropless): a = p; the key is its expert, or n_experts where no expert computes
    it (position < 0). Rank-major (a capacity's priority: every token's first choice, then every
    second one): a = (p % T) * K + p // T; the key is its slot, no-op slots all n_experts."""
    if RANK_MAJOR:
        a = (p % tokens) * K + p // tokens
        key = tl.minimum(tl.load(slots_ptr + a, mask=p_ok, other=0), n_experts)
    else:
        a = p
        slot = tl.load(slots_ptr + a, mask=p_ok, other=0)
        position = tl.load(positions_ptr + a, mask=p_ok, other=-1)
        key = tl.where(position >= 0, slot, n_experts)
    return key.to(tl.int32), a


@triton.jit
def _count(slots_ptr, positions_ptr, counts_ptr, n, tokens, n_experts, K: tl.constexpr, RANK_MAJOR: tl.constexpr,
           BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid = tl.program_id(0)
    p = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    p_ok = p < n
    key, _ = _keys(slots_ptr, positions_ptr, p, p_ok, tokens, n_experts, K, RANK_MAJOR)
    keys = tl.arange(0, BLOCK_K)
    hit = (key[:, None] == keys[None, :]) & p_ok[:, None]  # (BLOCK_N, BLOCK_K)
    tl.store(counts_ptr + pid * BLOCK_K + keys, tl.sum(hit.to(tl.int32), axis=0))


@triton.jit
def _block_ranks(counts_ptr, key, p_ok, pid, programs, BLOCK_K: tl.constexpr, BLOCK_P: tl.constexpr):
    """Every block's key counts -> (each key's total (BLOCK_K,), each assignment's rank among the
    assignments of its key in processing order (BLOCK_N,), the one-hot tile (BLOCK_N, BLOCK_K))."""
    keys = tl.arange(0, BLOCK_K)
    blocks = tl.arange(0, BLOCK_P)
    counts = tl.load(counts_ptr + blocks[:, None] * BLOCK_K + keys[None, :], mask=(blocks < programs)[:, None], other=0)
    totals = tl.sum(counts, axis=0)  # (BLOCK_K,): each key's assignments
    before = tl.sum(tl.where((blocks < pid)[:, None], counts, 0), axis=0)  # this key's in earlier blocks
    hit = (key[:, None] == keys[None, :]) & p_ok[:, None]  # (BLOCK_N, BLOCK_K)
    in_block = tl.cumsum(hit.to(tl.int32), axis=0) - 1  # 0 for a key's first assignment in the block
    rank = tl.sum(tl.where(hit, in_block + before[None, :], 0), axis=1)  # (BLOCK_N,)
    return totals, rank, hit


@triton.jit
def _place(slots_ptr, positions_ptr, counts_ptr, gates_ptr, ids_ptr, gate_index_ptr, row_gates_ptr, inverse_ptr,
           ends_ptr, n, n_experts, programs, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
           BLOCK_P: tl.constexpr, HAS_GATES: tl.constexpr):
    pid = tl.program_id(0)
    a = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    a_ok = a < n
    key, _ = _keys(slots_ptr, positions_ptr, a, a_ok, n, n_experts, K, False)
    totals, rank, hit = _block_ranks(counts_ptr, key, a_ok, pid, programs, BLOCK_K, BLOCK_P)
    keys = tl.arange(0, BLOCK_K)
    if pid == 0:  # each expert's row end: the cumulative rows through it
        tl.store(ends_ptr + keys, tl.cumsum(totals, axis=0), mask=keys < n_experts)
    key_start = tl.cumsum(totals, axis=0) - totals  # the rows of all lower keys
    first = tl.sum(tl.where(hit, key_start[None, :], 0), axis=1)  # its key's (rows past n: stores masked)
    row = (first + rank).to(tl.int64)
    computed = key < n_experts
    tl.store(ids_ptr + row, a // K, mask=a_ok)
    tl.store(gate_index_ptr + row, tl.where(computed, a, n), mask=a_ok)
    if HAS_GATES:  # each row's gate: the assignment's, 0 where no expert computes it
        gate = tl.load(gates_ptr + a, mask=a_ok & computed, other=0.0)
        tl.store(row_gates_ptr + row, gate, mask=a_ok)
    tl.store(inverse_ptr + a, tl.where(computed, row, -1).to(tl.int32), mask=a_ok)


@triton.jit
def _place_capacity(slots_ptr, counts_ptr, positions_ptr, table_ptr, ids_ptr, inverse_ptr, n, tokens, n_experts,
                    capacity, programs, K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                    BLOCK_P: tl.constexpr):
    pid = tl.program_id(0)
    p = pid.to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    p_ok = p < n
    key, a = _keys(slots_ptr, slots_ptr, p, p_ok, tokens, n_experts, K, True)
    totals, rank, _ = _block_ranks(counts_ptr, key, p_ok, pid, programs, BLOCK_K, BLOCK_P)
    keep = p_ok & (key < n_experts) & (rank < capacity)
    row = key.to(tl.int64) * capacity + rank
    tl.store(positions_ptr + a, tl.where(keep, rank, -1).to(tl.int64), mask=p_ok)
    tl.store(inverse_ptr + a, tl.where(keep, row, -1).to(tl.int32), mask=p_ok)
    tl.store(table_ptr + row, a, mask=keep)
    tl.store(ids_ptr + row, a // K, mask=keep)
    # The table's empty rows, a grid-stride share each: expert e's rows from its kept count on.
    keys = tl.arange(0, BLOCK_K)
    kept = tl.minimum(totals, capacity)  # (BLOCK_K,)
    for start in range(pid * BLOCK_N, n_experts * capacity, programs * BLOCK_N):
        r = start + tl.arange(0, BLOCK_N).to(tl.int64)
        e = r // capacity
        kept_e = tl.sum(tl.where(e[:, None] == keys[None, :], kept[None, :], 0), axis=1)
        empty = (r < n_experts * capacity) & (r % capacity >= kept_e)
        tl.store(table_ptr + r, n, mask=empty)
        tl.store(ids_ptr + r, 0, mask=empty)


def _tiles(n_assignments: int, n_experts: int) -> tuple[int, int, int]:
    """(keys, assignments per program, programs). A program's block is no larger than the
    assignments need (a decode step's few rows): a tile of TILE elements costs its one program
    tens of microseconds however few of them are used."""
    keys = triton.next_power_of_2(n_experts + 1)
    block_n = min(TILE // keys, max(triton.next_power_of_2(n_assignments), MIN_BLOCK_N))
    return keys, block_n, triton.cdiv(n_assignments, block_n)


def fits(n_assignments: int, n_experts: int) -> bool:
    """Whether each program can hold every program's counts in registers (a tile of at most TILE):
    up to 2M assignments with 8 experts, 128k with 64."""
    keys, _, programs = _tiles(n_assignments, n_experts)
    return keys <= MAX_KEYS and triton.next_power_of_2(programs) * keys <= TILE


def dropless_rows(slots: Tensor, positions: Tensor, n_experts: int, gates: Tensor | None = None
                  ) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor | None]:
    """slots, positions (T, k) int64 (position < 0: no expert computes the assignment) ->
    ids (N,) int64 each row's token, gate_index (N,) int64 each row's assignment (N where no
    expert computes it), inverse (T, k) int32 each assignment's row (-1 where none), ends (E,)
    int32 each expert's row end; N = T*k rows sorted by expert, stable, uncomputed ones last.
    gates (T, k) given: also each row's gate (N,) in gates' dtype, 0 where no expert computes it
    (what indexing the gates padded with a 0 by gate_index gives, without its three launches);
    else None. No gradient reaches gates."""
    tokens, top_k = slots.shape
    n = tokens * top_k
    block_k, block_n, programs = _tiles(n, n_experts)
    slots, positions = slots.contiguous(), positions.contiguous()
    counts = torch.empty(programs, block_k, dtype=torch.int32, device=slots.device)
    ids = torch.empty(n, dtype=torch.int64, device=slots.device)
    gate_index = torch.empty(n, dtype=torch.int64, device=slots.device)
    inverse = torch.empty(tokens, top_k, dtype=torch.int32, device=slots.device)
    ends = torch.empty(n_experts, dtype=torch.int32, device=slots.device)
    row_gates = None
    if gates is not None:
        if gates.shape != slots.shape:
            raise ValueError(f"sort_rows.dropless_rows: gates {tuple(gates.shape)} must match slots {tuple(slots.shape)}")
        gates = gates.detach().contiguous()
        row_gates = torch.empty(n, dtype=gates.dtype, device=slots.device)
    if n == 0:
        return ids, gate_index, inverse, ends.zero_(), row_gates
    with on_device_of(slots):
        _count[(programs,)](slots, positions, counts, n, n, n_experts, K=top_k, RANK_MAJOR=False, BLOCK_N=block_n,
                            BLOCK_K=block_k)
        _place[(programs,)](slots, positions, counts, gates if gates is not None else slots, ids, gate_index,
                            row_gates if row_gates is not None else ids, inverse, ends, n, n_experts, programs,
                            K=top_k, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_P=triton.next_power_of_2(programs),
                            HAS_GATES=gates is not None)
    return ids, gate_index, inverse, ends, row_gates


def capacity_rows(slots: Tensor, n_experts: int, capacity: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Token choice with a capacity: slots (T, k) int64 -> positions (T, k) int64 (each assignment's
    row in its expert's buffer, -1 for a no-op slot or past the capacity: GShard's priority, every
    first choice before any second one, earlier tokens first), table (E, C) int64 (each row's
    assignment t * k + j, T * k where empty), ids (E * C,) int64 (each row's token, 0 where empty)
    and inverse (T, k) int32 (each assignment's row e * C + position, -1 where none): what
    primitives.positions_in_expert, slot_table and token_choice_rows compute, in two launches."""
    tokens, top_k = slots.shape
    n = tokens * top_k
    block_k, block_n, programs = _tiles(n, n_experts)
    slots = slots.contiguous()
    counts = torch.empty(programs, block_k, dtype=torch.int32, device=slots.device)
    positions = torch.empty(tokens, top_k, dtype=torch.int64, device=slots.device)
    table = torch.empty(n_experts, capacity, dtype=torch.int64, device=slots.device)
    ids = torch.empty(n_experts * capacity, dtype=torch.int64, device=slots.device)
    inverse = torch.empty(tokens, top_k, dtype=torch.int32, device=slots.device)
    if n == 0:
        return positions, table.fill_(0), ids.zero_(), inverse
    with on_device_of(slots):
        _count[(programs,)](slots, slots, counts, n, tokens, n_experts, K=top_k, RANK_MAJOR=True, BLOCK_N=block_n,
                            BLOCK_K=block_k)
        _place_capacity[(programs,)](slots, counts, positions, table, ids, inverse, n, tokens, n_experts, capacity,
                                     programs, K=top_k, BLOCK_N=block_n, BLOCK_K=block_k,
                                     BLOCK_P=triton.next_power_of_2(programs))
    return positions, table, ids, inverse
