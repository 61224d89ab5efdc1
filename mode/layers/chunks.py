"""How a chunk of new tokens meets a layer's KV cache: the three ways a block's forward_cached runs.

A block's `forward_cached(x, cache, chunk)` (mode/layers/block.py, mod.py) computes its causal
decision, asks the chunk for the rows it processes (`chunk.select`) and does its arithmetic on
them; the row plan it gets back does what differs between the ways: which rows and tokens are
computed, where their keys and values go in the cache, the attention over the cache, and how the
new hidden states go back. A token a layer does not process comes out unchanged and never
enters the layer's cache.

- Prefill: a chunk of any length per row. The chosen tokens of every row are packed into one
  sequence for the token-wise parts (norms, projections, FFN), so a layer computes exactly the
  tokens it took; only the attention lays them out per row (on a fresh cache where flash
  attention's variable-length kernel runs, not even that: each row's packed tokens are a
  sequence of their own). Rows with none are not computed. On a fresh cache, plain causal
  attention. Host counts, so one sync per routed layer; what the counts do not decide is queued
  on the device before it.
- GatherStep: one token per row; only the rows the layer processes are computed (index_select)
  and updated in place in the step's own hidden states. Lengths on the host; a routed layer's
  decision goes to the host (its one sync).
- StaticStep: one token per row; lengths and positions stay on the device. Every row is
  computed and only the chosen rows keep their result and cache a slot (MaskedRows), or a
  routed layer computes just its chosen rows, compacted on the device (CompactRows). Captured
  as a CUDA graph, whose conditional nodes pick the way: nothing is read on the host.
"""
from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode.kernels import graph_if, use_triton
from mode.layers.attention import expand_kv
from mode.layers.kv_cache import LayerCache, PackedRows, attend_used, to_device
from mode.layers.rotary import RotaryAngles, rotate_
from mode.routing import apply_gate
from mode.routing.expert_rows import rows_kernel_applies

# Gather-step windows are rounded up to a multiple of this many slots: aligned mask rows for
# the memory-efficient kernel (no padding copy) and one shape per 16 steps instead of one per step.
WINDOW_ALIGN = 16
# A captured routed layer tests for "no row chose it" (an IF node around its compacted pass) only
# where its expected chosen rows, batch x capacity, are at most this: there no chosen row is a
# common step ((1 - capacity)^batch). Above it the pass runs every step: entering a taken IF node's
# body costs the graph more than the rare empty layer saves.
SKIP_TEST_MAX_EXPECTED = 4.0


class RowPlan:
    """What every row plan shares: its tokens' attention input (attend_projected), a layer's output
    put back (put_sum), and add_scored: a routed layer's x_i + g_i * (a_i + out_i). Where the row
    kernels run (eager CUDA) a plan naming kernel_rows does that in one kernel (put_gated)."""

    def kernel_rows(self, x: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None] | None:
        """Where put_gated writes this plan's update of x: (the tensor, the flat row of it each
        computed row goes to (None: the same row), which computed rows keep it (None: all)); None:
        the PyTorch ops (take and add)."""
        return None

    def attend_projected(self, qkv: Tensor, heads: int) -> Tensor:
        """qkv (n, K, H + 2Hkv, hd), the plan's tokens projected: q and k rotated by the plan's angles,
        the keys and values joined to the cache (attend) -> the attention output (n, K, H, hd)."""
        kv_heads = (qkv.shape[2] - heads) // 2
        rotate_(qkv[:, :, : heads + kv_heads], self.angles)
        kv = qkv[:, :, heads:].unflatten(2, (2, kv_heads))  # (n, K, 2, Hkv, hd) view
        return self.attend(qkv[:, :, :heads], kv)

    def put_sum(self, x: Tensor, h: Tensor, out: Tensor) -> Tensor:
        """put(x, h + out): a layer's output h + FFN(norm(h)) for its computed rows."""
        return self.put(x, h + out)

    def add_gated(self, x: Tensor, a: Tensor, out: Tensor, gates: Tensor) -> Tensor:
        """x with the computed rows' a + out (each (n, ..., D)) times their float32 gates (n, ...)
        added: the product rounded once to the update's dtype, as forward (PyTorch ops)."""
        update = a + out
        torch.mul(update, gates.unsqueeze(-1), out=update)
        return self.add(x, update)

    def add_scored(self, x: Tensor, a: Tensor, out: Tensor, scores: Tensor, gate: str) -> Tensor:
        """add_gated with each computed row's gate g(score) of its depth router's scores (B, n), one
        per token of x, g the router's gate function (apply_gate): where the row kernels run and
        the plan names kernel_rows, the gather, g and the update are put_gated's one kernel."""
        target = self.kernel_rows(x) if rows_kernel_applies(x) and rows_kernel_applies(a) else None
        if target is None:
            return self.add_gated(x, a, out, apply_gate(self.take(scores), gate))
        return self.put_gated(*target, a, out, scores, gate)

    @staticmethod
    def put_gated(target: Tensor, ids: Tensor | None, keep: Tensor | None, a: Tensor, out: Tensor, scores: Tensor,
                  gate: str) -> Tensor:
        """add_gated's rounding in one kernel (rows.put_gated_rows_), in place: target (..., D) at flat
        rows ids (n,) (None: row r) += g(score) * (a + out) where keep (n,) (None: every row); a, out
        (n, ..., D); scores one per row of target, g the router's gate function (apply_gate)."""
        from mode.kernels.common import on_device_of
        from mode.kernels.rows import put_gated_rows_

        width = target.shape[-1]
        with on_device_of(target):
            put_gated_rows_(target.view(-1, width), ids, keep, a.reshape(-1, width), out.reshape(-1, width),
                            scores.reshape(-1), gate)
        return target


def write_packed(cache: LayerCache, slots: Tensor, kv: Tensor) -> None:
    """Keys and values kv (2, n, Hkv, hd) into the cache's packed (2, B * (max_len + 1), Hkv, hd) view
    at slots (n,)."""
    cache.kv.view(2, -1, *cache.kv.shape[3:]).index_copy_(1, slots, kv.to(cache.kv.dtype))


class HostPlannedChunk:
    """A chunk whose select() plans a layer's rows on the host (None: no row to compute)."""

    decision_mask = None  # a routed layer's decision may take any token; select() drops the idle ones

    def decision_in_if(self, x: Tensor, weights: tuple[Tensor, Tensor | None] | None,
                       capacity: float) -> None:
        """No IF node here to take a routed layer's decision (see StaticStep.decision_in_if)."""
        return None

    def routed(self, x: Tensor, cache: LayerCache, chosen: Tensor, capacity: float,
               body: Callable[..., Tensor], decision: None = None) -> Tensor:
        """A routed layer's chunk: body(plan) -> the chunk's new hidden states for the row plan of the
        tokens it chose, chosen (B, n); x unchanged where it chose none. capacity: unused here (see
        StaticStep.routed)."""
        rows = self.select(x, cache, chosen)
        return x if rows is None else body(rows)


# ----------------------------------------------------------------------------- prefill
class Prefill(HostPlannedChunk):
    """A chunk of n new tokens per row. positions (B, n): absolute positions (device); valid (B, n)
    bool (device): the row's real tokens; counts (B,): valid.sum(1) on the host.

    flash_varlen: flash attention's variable-length kernel runs here (kv_cache.flash_varlen_available);
    on a fresh cache the packed tokens then attend as they are (FreshTokens). owns_hidden: the
    hidden states a block gets are the caller's own, to update in place (the decoder's; a caller
    that keeps its input passes False, and a routed layer then updates a copy)."""

    fp32_router = False  # the router module decides, as the model's forward does

    def __init__(self, rotary: nn.Module, positions: Tensor, valid: Tensor, counts: Tensor,
                 flash_varlen: bool = False, owns_hidden: bool = False) -> None:
        self.rotary, self.positions, self.valid, self.counts = rotary, positions, valid, counts
        self.flash_varlen, self.owns_hidden = flash_varlen, owns_hidden
        self.count_list = counts.tolist()
        self.every_token = min(self.count_list) == positions.shape[1]  # no padding: valid is all True
        self._angles: RotaryAngles | None = None

    @property
    def angles(self) -> RotaryAngles:
        """Every token's rotation (B, n, 1, hd): looked up once for all the layers the chunk meets."""
        if self._angles is None:
            self._angles = self.rotary.angles(self.positions)
        return self._angles

    def select(self, x: Tensor, cache: LayerCache, chosen: Tensor | None = None) -> "ChunkRows | ChunkTokens | None":
        """The plan for the valid tokens (chosen (B, n) bool: those of them a routed layer took):
        whole rows where every row computed takes its whole chunk, else the chosen tokens packed;
        None when no row has any."""
        order = None
        if chosen is None:
            chosen, counts, count_list = self.valid, self.counts, self.count_list
        else:
            if not self.every_token:
                chosen = chosen & self.valid
            # queued before the sync: the device works through them while the host waits
            order = self.token_order(chosen, cache)
            counts = chosen.sum(1).cpu()  # the layer's one sync
            count_list = counts.tolist()
        computed = [c for c in count_list if c]
        if not computed:
            return None
        if min(computed) == x.shape[1]:
            return ChunkRows(self, x, cache, counts, count_list)
        if order is None:
            order = self.token_order(chosen, cache)
        plan = ChunkTokens if order.slots is None else FreshTokens
        return plan(self, x, cache, order, counts, count_list)

    def token_order(self, chosen: Tensor, cache: LayerCache) -> "TokenOrder":
        """What a packed plan needs of chosen (B, n) that the host's counts do not decide: the chosen
        tokens first, row after row, each row's in order (a stable sort) and, for FreshTokens (a
        fresh cache of more than one row where flash_varlen), each one's cache slot and the rows'
        cumulative counts."""
        order = chosen.view(-1).argsort(descending=True, stable=True)  # (B * n,)
        batch, slots = chosen.shape[0], cache.kv.shape[2]
        # one row: ChunkTokens' (1, T) layout is already its (m, K) one, with no padding
        if batch == 1 or not self.flash_varlen or int(cache.lengths_cpu.max()) > 0:
            return TokenOrder(order)
        # token j of row b, the r-th it chose (r from 1), goes to row b's slot r - 1 of the packed cache
        before = torch.arange(-1, batch * slots - 1, slots, device=chosen.device)  # (B,): row b's slot 0, less 1
        rank = chosen.cumsum(1)  # (B, n); its last column: each row's count
        slot = (rank + before.unsqueeze(1)).view(-1).index_select(0, order)  # (B * n,)
        cu = torch.zeros(batch + 1, dtype=torch.int32, device=chosen.device)
        torch.cumsum(rank[:, -1], 0, dtype=torch.int32, out=cu[1:])  # (B + 1,): row b's tokens start at cu[b]
        return TokenOrder(order, slot, cu)


@dataclass
class TokenOrder:
    """Prefill.token_order: order (B * n,) the chosen tokens' flat ids first; slots (B * n,) each
    one's packed cache slot and cu (B + 1,) int32 the rows' cumulative counts (FreshTokens only)."""

    order: Tensor
    slots: Tensor | None = None
    cu: Tensor | None = None


class PrefillPlan(RowPlan):
    """What both prefill plans share: the m rows computed, those with any chosen token (rows (m,)
    on the device; None: every row), with their cached lengths and chosen counts (host lists) and
    K, the largest count; the cache write and the attention in the (m, K) layout, each row's
    chosen tokens first, in order. No padding token reaches the FFN (valid None)."""

    valid = None
    static = False  # host-planned: an MoE FFN may read its routing on the host too

    def __init__(self, x: Tensor, cache: LayerCache, counts: Tensor, count_list: list[int]) -> None:
        self.cache, self.counts, self.batch = cache, counts, x.shape[0]
        rows = [b for b, c in enumerate(count_list) if c]
        old = cache.lengths_cpu.tolist()
        self.row_list, self.old, self.count_list = rows, [old[b] for b in rows], [count_list[b] for b in rows]
        self.rows = None if len(rows) == self.batch else to_device(torch.tensor(rows), x.device)
        self.width = max(self.count_list)
        # Every computed row's cache is empty: plain causal attention over its chosen tokens is exact.
        self.fresh = max(self.old) == 0
        self._slot_table: Tensor | None = None

    def _rows(self, t: Tensor) -> Tensor:
        return t if self.rows is None else t.index_select(0, self.rows)

    def _slots(self, device: torch.device) -> Tensor:
        """(m, K): each computed row's cache slots old .. old + K - 1, copied to the device once
        (the cache write and the attention's mask both read them)."""
        if self._slot_table is None:
            old = to_device(torch.tensor(self.old), device)
            self._slot_table = old.unsqueeze(1) + torch.arange(self.width, device=device)
        return self._slot_table

    def _write_rows(self, kv: Tensor) -> None:
        """kv (m, K, 2, Hkv, hd): every computed row's K keys and values at its slots old .. old + K - 1."""
        cache = self.cache
        kv = kv.permute(2, 0, 1, 3, 4).to(cache.kv.dtype)  # (2, m, K, Hkv, hd)
        width, first = self.width, self.old[0]
        if all(o == first for o in self.old):  # the rows line up: a slice
            rows = slice(None) if self.rows is None else self.rows
            cache.kv[:, rows, first : first + width] = kv
            return
        rows = torch.arange(self.batch, device=kv.device) if self.rows is None else self.rows
        cache.kv[:, rows.unsqueeze(1), self._slots(kv.device)] = kv

    def _attention(self, q: Tensor) -> Tensor:
        """q (m, K, H, hd), rotated -> (m, K, H, hd): query j of a row sees the row's cached tokens and
        its chosen tokens 0..j, all in the cache already (a query past the row's count is padding)."""
        cache, device, width = self.cache, q.device, self.width
        groups = q.shape[2] // cache.kv.shape[3]
        window = width if self.fresh else max(o + c for o, c in zip(self.old, self.count_list))
        kv = cache.kv[:, :, :window]  # (2, B, L, Hkv, hd) view
        if self.rows is not None:
            kv = kv.index_select(1, self.rows)
        keys, values = kv.to(q.dtype).transpose(2, 3).unbind(0)  # (m, Hkv, L, hd) each
        mask = None
        if not self.fresh:
            slots = self._slots(device)  # (m, K)
            mask = (torch.arange(window, device=device) <= slots.unsqueeze(-1)).unsqueeze(1)  # (m, 1, K, L)
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), expand_kv(keys, groups), expand_kv(values, groups), attn_mask=mask, is_causal=self.fresh,
        )  # (m, H, K, hd)
        self.cache.lengths_cpu += self.counts
        return y.transpose(1, 2)


class ChunkRows(PrefillPlan):
    """The rows of a prefill chunk that take all its n tokens (the others take none): x (m, n, D)."""

    def __init__(self, chunk: Prefill, x: Tensor, cache: LayerCache, counts: Tensor, count_list: list[int]) -> None:
        super().__init__(x, cache, counts, count_list)
        self.x = self._rows(x)
        angles = chunk.angles
        self.angles = angles if self.rows is None else RotaryAngles(self._rows(angles.cos_full), self._rows(angles.sin_signed))

    def take(self, t: Tensor) -> Tensor:
        """A per-token value (B, n) -> the computed rows' (m, n)."""
        return self._rows(t)

    def attend(self, q: Tensor, kv: Tensor) -> Tensor:
        """q (m, n, H, hd) and kv (m, n, 2, Hkv, hd), q and k rotated -> attention output (m, n, H, hd);
        the keys and values join the cache."""
        self._write_rows(kv)
        return self._attention(q)

    def put(self, x: Tensor, new: Tensor) -> Tensor:
        """The chunk's hidden states (B, n, D) with the computed rows' new states new (m, n, D)."""
        new = new.to(x.dtype)
        return new if self.rows is None else x.index_copy(0, self.rows, new)

    def add(self, x: Tensor, update: Tensor) -> Tensor:
        """put() of the computed rows' states plus update (m, n, D), in their dtype."""
        return self.put(x, self.x + update.to(self.x.dtype))


class ChunkTokens(PrefillPlan):
    """The chosen tokens of a prefill chunk where some computed row skips some: x (1, T, D), the T
    chosen tokens of every row packed row after row, each row's in order. Every token-wise part of
    a layer (norms, projections, FFN) computes them alone; only the attention lays them out per
    row, (m, K), padding each row to K tokens (none where every row chose K)."""

    def __init__(self, chunk: Prefill, x: Tensor, cache: LayerCache, order: TokenOrder, counts: Tensor,
                 count_list: list[int]) -> None:
        super().__init__(x, cache, counts, count_list)
        self.n, self.total, self.owns_hidden = x.shape[1], sum(self.count_list), chunk.owns_hidden
        self.src = order.order[: self.total]  # (T,): flat ids of the chosen tokens, in order
        self.x = self.take(x)  # (1, T, D)
        angles = chunk.angles  # (B, n, 1, hd) each -> (1, T, 1, hd)
        self.angles = RotaryAngles(self.take(angles.cos_full), self.take(angles.sin_signed))
        self.even = min(self.count_list) == self.width  # (1, T) is the (m, K) layout itself

    def take(self, t: Tensor) -> Tensor:
        """A per-token value (B, n, ...) -> the chosen tokens' (1, T, ...)."""
        return t.reshape(1, -1, *t.shape[2:]).index_select(1, self.src)

    def _layout(self) -> tuple[Tensor, Tensor]:
        """Each chosen token's row in the (m * K) layout of the attention and its slot in the
        cache's packed (2, B * (max_len + 1), Hkv, hd) view, each (T,): token t of a row that
        starts at t0 in the packed tokens goes to (row, t - t0) and to its slot old + t - t0, so
        one per-row shift each (host tables, one copy to the device) plus t."""
        padded, cached = [0] * self.batch, [0] * self.batch
        slots, start = self.cache.kv.shape[2], 0
        for rank, (b, c, o) in enumerate(zip(self.row_list, self.count_list, self.old)):
            padded[b], cached[b] = rank * self.width - start, b * slots + o - start
            start += c
        device = self.src.device
        row = self.src.div(self.n, rounding_mode="floor")  # (T,)
        shifts = to_device(torch.tensor([padded, cached]), device).index_select(1, row)  # (2, T)
        return (shifts + torch.arange(self.total, device=device)).unbind(0)

    def attend(self, q: Tensor, kv: Tensor) -> Tensor:
        """q (1, T, H, hd) and kv (1, T, 2, Hkv, hd), q and k rotated -> attention output (1, T, H, hd);
        the keys and values join the cache."""
        m, width = len(self.row_list), self.width
        if self.even:
            self._write_rows(kv.view(m, width, *kv.shape[2:]))
            return self._attention(q.view(m, width, *q.shape[2:])).reshape(q.shape)
        padded_at, slot_at = self._layout()
        heads = q.shape[2:]
        write_packed(self.cache, slot_at, kv[0].transpose(0, 1))  # (2, T, Hkv, hd)
        padded = q.new_zeros(m * width, *heads).index_copy_(0, padded_at, q[0])  # (m * K, H, hd)
        y = self._attention(padded.view(m, width, *heads))  # (m, K, H, hd)
        return y.reshape(m * width, *heads).index_select(0, padded_at).unsqueeze(0)  # (1, T, H, hd)

    def put(self, x: Tensor, new: Tensor) -> Tensor:
        """The chunk's hidden states (B, n, D) with the chosen tokens' new states new (1, T, D)."""
        return x.reshape(1, -1, x.shape[-1]).index_copy(1, self.src, new.to(x.dtype)).view_as(x)

    def add(self, x: Tensor, update: Tensor) -> Tensor:
        """put() of the chosen tokens' states plus update (1, T, D), in their dtype."""
        return self.put(x, self.x + update.to(self.x.dtype))

    def kernel_rows(self, x: Tensor) -> tuple[Tensor, Tensor, None]:
        """The packed tokens' rows of x (B, n, D) itself where the chunk owns it, else of a copy."""
        return x if self.owns_hidden else x.clone(), self.src, None


class FreshTokens(ChunkTokens):
    """ChunkTokens on a fresh cache where flash attention's variable-length kernel runs: the packed
    tokens attend as they are, each row a sequence of its own, with no (m, K) layout and no padding
    computed; their cache slots come from the device (TokenOrder)."""

    def __init__(self, chunk: Prefill, x: Tensor, cache: LayerCache, order: TokenOrder, counts: Tensor,
                 count_list: list[int]) -> None:
        super().__init__(chunk, x, cache, order, counts, count_list)
        self.slot_at, self.cu = order.slots[: self.total], order.cu  # (T,), (B + 1,)

    def attend(self, q: Tensor, kv: Tensor) -> Tensor:
        """q (1, T, H, hd) and kv (1, T, 2, Hkv, hd), q and k rotated -> (1, T, H, hd): each row's
        tokens attend causally over themselves (flash groups the query heads itself); the keys and
        values join the cache."""
        kv = kv[0].transpose(0, 1)  # (2, T, Hkv, hd)
        write_packed(self.cache, self.slot_at, kv)
        keys, values = kv.unbind(0)  # (T, Hkv, hd) each
        y = torch.ops.aten._flash_attention_forward(
            q[0], keys, values, self.cu, self.cu, self.width, self.width, 0.0, True, False,
        )[0]  # (T, H, hd)
        self.cache.lengths_cpu += self.counts
        return y.unsqueeze(0)


# ----------------------------------------------------------------------------- gather decode step
class GatherStep(HostPlannedChunk):
    """One token per row; active (B,) bool on the host (finished rows compute nothing); angles:
    every row's (B, 1, 1, hd), or one shared (1, 1, 1, hd) when every row is at one position."""

    fp32_router = True  # the router's float32 weights decide (LayerCache.router_weights)

    def __init__(self, angles: RotaryAngles, active: Tensor, slot_ids: Tensor, all_rows: Tensor) -> None:
        self.angles, self.active, self.slot_ids, self.all_rows = angles, active, slot_ids, all_rows
        self.all_active = bool(active.all())
        self.active_rows = None if self.all_active else active.nonzero().squeeze(1)  # host

    @classmethod
    def at(cls, rotary: nn.Module, positions: Tensor, active: Tensor, max_seq_len: int, device: torch.device,
           slot_ids: Tensor, all_rows: Tensor) -> "GatherStep":
        """The step for rows at host positions (B,): one angle for all where the computed rows share
        a position, as views; else one per row (a finished row at the end of the window is clamped
        to the table)."""
        now = (positions if bool(active.all()) else positions[active]).tolist()
        first, last = min(now), max(now)
        if first == last:
            angles = RotaryAngles(rotary.cos_full[first].view(1, 1, 1, -1), rotary.sin_signed[first].view(1, 1, 1, -1))
        else:
            pos = to_device(positions.clamp(max=max_seq_len - 1), device)
            batch = positions.shape[0]
            angles = RotaryAngles(rotary.cos_full.index_select(0, pos).view(batch, 1, 1, -1),
                                  rotary.sin_signed.index_select(0, pos).view(batch, 1, 1, -1))
        return cls(angles, active, slot_ids, all_rows)

    def select(self, x: Tensor, cache: LayerCache, chosen: Tensor | None = None) -> "GatherRows | None":
        """The plan for the active rows (chosen (B, 1) bool on the device: those a routed layer
        took, read on the host); None when the layer computes no row."""
        if chosen is None:
            return GatherRows(self, x, cache, self.active_rows)
        picked = chosen.view(-1).cpu()  # the layer's one sync: (B,) decisions to the host
        if not self.all_active:
            picked &= self.active
        rows = picked.nonzero().squeeze(1)
        if rows.numel() == 0:
            return None  # no row chose this layer: nothing computed, nothing cached
        return GatherRows(self, x, cache, None if rows.numel() == x.shape[0] else rows)


class GatherRows(RowPlan):
    """The rows rows_cpu (host, sorted; None: every row) of a gather step: x (n, 1, D). Their new
    states go into the step's hidden states in place (the decoder's own tensor)."""

    static = False

    def __init__(self, step: GatherStep, x: Tensor, cache: LayerCache, rows_cpu: Tensor | None) -> None:
        self.step, self.cache, self.rows_cpu, self.valid = step, cache, rows_cpu, None
        lengths = cache.lengths_cpu if rows_cpu is None else cache.lengths_cpu.index_select(0, rows_cpu)  # host
        lengths_list = lengths.tolist()
        self.lengths, self.shortest, self.longest = lengths, min(lengths_list), max(lengths_list)
        self.aligned = self.shortest == self.longest  # every computed row appends at one slot
        angles, device = step.angles, x.device
        if rows_cpu is None:
            self.rows, self.slots, self.x = None, None, x
            if not self.aligned:
                self.slots = to_device(lengths, device)
        else:
            if self.aligned:
                self.rows, self.slots = to_device(rows_cpu, device), None
            else:  # rows and write slots in one host -> device copy
                self.rows, self.slots = to_device(torch.stack((rows_cpu, lengths)), device).unbind(0)
            self.x = x.index_select(0, self.rows)  # (n, 1, D)
            if angles.cos_full.shape[0] > 1:
                angles = RotaryAngles(angles.cos_full.index_select(0, self.rows), angles.sin_signed.index_select(0, self.rows))
        self.angles = angles

    def take(self, t: Tensor) -> Tensor:
        """A per-token value (B, 1) -> the computed rows' (n, 1)."""
        return t if self.rows is None else t.index_select(0, self.rows)

    def attend(self, q: Tensor, kv: Tensor) -> Tensor:
        """q (n, 1, H, hd) and kv (n, 1, 2, Hkv, hd), q and k rotated -> (n, 1, H, hd): each row's
        key and value written at its length (a slice where the rows line up, else one indexed
        write and a length mask)."""
        cache, rows, n = self.cache, self.rows, q.shape[0]
        groups = q.shape[2] // kv.shape[3]
        kv = kv[:, 0].transpose(0, 1).to(cache.kv.dtype)  # (2, n, Hkv, hd)
        mask = None
        if self.aligned:
            slot = self.shortest
            if rows is None:
                cache.kv[:, :, slot] = kv
                window_kv = cache.kv[:, :, : slot + 1]  # (2, B, L, H, hd) view
            else:
                cache.kv[:, :, slot].index_copy_(1, rows, kv)
                window_kv = cache.kv[:, :, : slot + 1].index_select(1, rows)  # (2, n, L, H, hd)
        else:
            cache.kv[:, self.step.all_rows if rows is None else rows, self.slots] = kv
            window = min(-(-(self.longest + 1) // WINDOW_ALIGN) * WINDOW_ALIGN, cache.kv.shape[2])
            window_kv = cache.kv[:, :, :window]
            if rows is not None:
                window_kv = window_kv.index_select(1, rows)
            mask = self.step.slot_ids[:window] <= self.slots.view(n, 1, 1, 1)  # (n, 1, 1, L): its cache and itself
        keys, values = window_kv.to(q.dtype).transpose(2, 3).unbind(0)  # (n, Hkv, L, hd) each
        y = F.scaled_dot_product_attention(
            q.transpose(1, 2), expand_kv(keys, groups), expand_kv(values, groups), attn_mask=mask,
        )  # (n, H, 1, hd)
        if self.rows_cpu is None:
            cache.lengths_cpu += 1
        else:
            cache.lengths_cpu[self.rows_cpu] = self.lengths + 1
        return y.transpose(1, 2)

    def put(self, x: Tensor, new: Tensor) -> Tensor:
        return new if self.rows is None else x.index_copy_(0, self.rows, new.to(x.dtype))

    def add(self, x: Tensor, update: Tensor) -> Tensor:
        return self.x + update if self.rows is None else x.index_add_(0, self.rows, update.to(x.dtype))


# ----------------------------------------------------------------------------- static decode step
def if_nodes_available() -> bool:
    """Whether CUDA graph conditional (IF) nodes can be captured here (natively or built)."""
    return graph_if.available()


class StaticStep:
    """One token per row, on device tensors only: positions (B,) and active (B,) bool. row_base
    (B,): each row's first slot in the packed cache; packed: the attention's layout.

    slack: a routed layer (routed()) computes only its chosen rows, compacted into the first
    W = ceil(B * capacity * slack) rows (CompactRows), and any chosen rows past those W in a
    second, masked pass (MaskedRows); None: every row, masked. graph: the CUDA graph being
    captured, whose IF nodes run the second pass only where more than W rows chose (and, at
    small batches, skip a layer no row chose) on the device; without one the host reads the count
    (one sync per routed layer). warm: a warm-up before capture, with no active row: every pass
    runs (writing scratch slots only), so that every kernel has run once."""

    fp32_router = True

    def __init__(self, rotary: nn.Module, positions: Tensor, active: Tensor, max_seq_len: int, row_base: Tensor,
                 packed: PackedRows, slack: float | None = None, graph: torch.cuda.CUDAGraph | None = None,
                 warm: bool = False) -> None:
        batch = positions.shape[0]
        # A finished row may stand at the end of the context window: its (discarded) rotation is
        # clamped to the table, as the prefill clamps its padding.
        angle_ids = positions.clamp(max=max_seq_len - 1)
        self.angles = RotaryAngles(rotary.cos_full.index_select(0, angle_ids).view(batch, 1, 1, -1),
                                   rotary.sin_signed.index_select(0, angle_ids).view(batch, 1, 1, -1))
        self.active, self.row_base, self.packed = active, row_base, packed
        self.decision_mask = active  # a routed layer's decision takes active rows only (routed())
        self.slack, self.graph, self.warm = slack, graph, warm

    def select(self, x: Tensor, cache: LayerCache, chosen: Tensor | None = None) -> "MaskedRows":
        """Every row, the active ones (and of them those a routed layer chose, chosen (B, 1)) kept."""
        return MaskedRows(self, x, cache, self.active if chosen is None else chosen.view(-1) & self.active)

    def decision_in_if(self, x: Tensor, weights: tuple[Tensor, Tensor | None] | None,
                       capacity: float) -> graph_if.RowDecision | None:
        """A routed layer's decision that routed()'s IF node for "some row chose it" takes in its
        condition kernel, one kernel fewer a layer: under capture its chosen (B,) and scores (B,)
        are written there; uncaptured, the same kernel writes them now, so that both steps compute
        alike. Where that node exists (compacted rows, a batch tested for an empty layer, not a
        warm-up), the router's own float32 logit decides (weights), the decision kernel's policy
        allows, and the built IF-node extension runs here (graph_if.decides_in_condition); else None."""
        batch = x.shape[0]
        if (weights is None or self.slack is None or self.warm or batch * capacity > SKIP_TEST_MAX_EXPECTED
                or torch.is_autocast_enabled(x.device.type) or not use_triton(x, "decision")
                or not graph_if.decides_in_condition()):
            return None
        weight, bias = weights
        chosen = torch.empty(batch, dtype=torch.bool, device=x.device)
        scores = torch.empty(batch, dtype=torch.float32, device=x.device)
        decision = graph_if.RowDecision(x.reshape(batch, -1), weight.reshape(-1), bias, self.decision_mask,
                                        chosen, scores)
        if self.graph is None:
            graph_if.decide(decision)
        return decision

    def routed(self, x: Tensor, cache: LayerCache, chosen: Tensor, capacity: float,
               body: Callable[["MaskedRows | CompactRows"], Tensor], decision: graph_if.RowDecision | None = None,
               ) -> Tensor:
        """A routed layer's step: body(plan) -> the step's new hidden states (B, 1, D) for a row plan;
        chosen (B, 1): the rows the layer's decision took, active ones only (decision_mask),
        capacity: the share it was trained to take. Compacted: the first W chosen rows as W rows,
        any more in a second, masked pass; no row chosen: nothing computed (tested on the device
        only at small batches). decision: from decision_in_if (under capture, the first IF node
        computes chosen). The new states go into x itself (the step's own tensor)."""
        chosen = chosen.view(-1)  # (B,)
        if self.slack is None:
            return body(MaskedRows(self, x, cache, chosen))
        batch = chosen.shape[0]
        width = min(max(math.ceil(batch * capacity * self.slack), 1), batch)
        count = int(chosen.sum()) if self.graph is None and not self.warm else None  # the host's one sync
        skip_test = batch * capacity <= SKIP_TEST_MAX_EXPECTED
        if width == batch:  # W = B would compute every row anyway, in another order
            self._run_if(lambda: x.copy_(body(MaskedRows(self, x, cache, chosen))), chosen, 0, batch, skip_test, count,
                         decision)
            return x

        def past_width() -> None:
            rest = chosen & (chosen.cumsum(0) > width)  # (B,): the chosen rows past the first W
            x.copy_(body(MaskedRows(self, x, cache, rest)))

        # in place: the first W chosen rows
        self._run_if(lambda: body(CompactRows(self, x, cache, chosen, width)), chosen, 0, batch, skip_test, count,
                     decision)
        self._run_if(past_width, chosen, width, batch, True, count)
        return x

    def _run_if(self, run: Callable[[], object], flags: Tensor, lo: int, hi: int, test: bool,
                count: int | None, decision: graph_if.RowDecision | None = None) -> None:
        """run() where lo < flags.sum() <= hi: count, where the host counted (any decision written
        before); else, under capture and where test, an IF node (whose condition kernel writes the
        flags first where decision names them); else always (so the warm-up runs every kernel once)."""
        if count is not None:
            if lo < count <= hi:
                run()
        elif decision is not None and (self.graph is None or not test or decision.chosen.data_ptr() != flags.data_ptr()):
            raise RuntimeError("a routed layer's decision left to its IF node needs that node captured over its flags")
        elif self.graph is not None and test:
            node = (graph_if.captured_if_count(self.graph, flags, lo, hi) if decision is None
                    else graph_if.captured_if_decided(self.graph, decision, lo, hi))
            with node:
                run()
        else:
            run()


class MaskedRows(RowPlan):
    """Every row of a static step computed; chosen (B,) bool: the rows that keep the result."""

    static = True  # no host sync and static shapes in every layer part, an MoE FFN's included

    def __init__(self, step: StaticStep, x: Tensor, cache: LayerCache, chosen: Tensor) -> None:
        self.step, self.x, self.cache, self.chosen, self.angles = step, x, cache, chosen, step.angles
        # (B, 1): an MoE FFN gives the other rows no expert, so it reads only the kept rows' experts
        self.valid = chosen.view(-1, 1)

    def take(self, t: Tensor) -> Tensor:
        return t

    @torch.compiler.disable
    def attend(self, q: Tensor, kv: Tensor) -> Tensor:
        """q (B, 1, H, hd) and kv (B, 1, 2, Hkv, hd), q and k rotated -> (B, 1, H, hd). A chosen row
        writes its key and value at its length and attends over its cache and itself; every other
        row writes to its scratch slot (max_len), so the cache holds exactly the chosen tokens, and
        reads one slot (its output is discarded). Eager under torch.compile: the cache is written
        in place."""
        return attend_static(self.step, self.cache, q, kv, self.chosen)

    def attend_projected(self, qkv: Tensor, heads: int) -> Tensor:
        """RowPlan.attend_projected; where the kernel runs, the rotation, every row's slot, the grown
        lengths and the cache write are one kernel (mode/kernels/step_cache.py)."""
        step, cache = self.step, self.cache
        if not rotate_write_runs(step, cache, qkv, heads):
            return super().attend_projected(qkv, heads)
        from mode.kernels.step_cache import rotate_write_every_row

        q, used = rotate_write_every_row(qkv, heads, step.angles.cos_full, step.angles.sin_signed, cache.kv,
                                         self.chosen, cache.lengths_dev, step.row_base)  # (B, H, hd), (B,)
        return attend_used(q, cache, used, step.packed).unsqueeze(1)

    def put(self, x: Tensor, new: Tensor) -> Tensor:
        return torch.where(self.chosen.view(-1, 1, 1), new, x)

    def put_sum(self, x: Tensor, h: Tensor, out: Tensor) -> Tensor:
        """put(x, h + out), in one kernel where the row kernels run."""
        if use_triton(x, "rows"):
            from mode.kernels.common import on_device_of
            from mode.kernels.rows import put_sum, put_sum_applies

            if put_sum_applies(x, h, out, self.chosen):
                with on_device_of(x):
                    return put_sum(x, h, out, self.chosen)
        return super().put_sum(x, h, out)

    def add(self, x: Tensor, update: Tensor) -> Tensor:
        return torch.where(self.chosen.view(-1, 1, 1), x + update.to(x.dtype), x)

    def kernel_rows(self, x: Tensor) -> tuple[Tensor, None, Tensor]:
        """x's (B, 1, D) chosen rows, in place: a routed layer's states are the step's own (routed())."""
        return x, None, self.chosen


class CompactRows(RowPlan):
    """The W rows of a static step a routed layer computes where its chosen rows fit in W: the
    chosen rows and, as padding, the first unchosen ones, in row order: rows (W,), keep (W,)
    bool (chosen). A padding row writes only its scratch slot and keeps its state. No host value."""

    static = True

    def __init__(self, step: StaticStep, x: Tensor, cache: LayerCache, chosen: Tensor, width: int) -> None:
        # in row order: the packed cache regions then ascend, as flash's cu_k expects; the kept
        # rows' lengths grow here, their slots (write_at, used) taken before
        compact = compact_rows_reference
        if use_triton(x, "decision"):
            from mode.kernels.decision import compact_rows as compact
        rows, self.keep, self.write_at, self.used = compact(chosen, width, cache.lengths_dev, step.row_base,
                                                            cache.max_len)  # (W,) each
        self.step, self.cache, self.rows = step, cache, rows
        self.valid = self.keep.view(-1, 1)  # (W, 1): an MoE FFN skips the padding
        self.x = x.index_select(0, rows)  # (W, 1, D)

    @functools.cached_property
    def angles(self) -> RotaryAngles:
        """The W rows' angles (the PyTorch path's rotation; the kernel reads the step's by row)."""
        angles = self.step.angles
        return RotaryAngles(angles.cos_full.index_select(0, self.rows), angles.sin_signed.index_select(0, self.rows))

    def take(self, t: Tensor) -> Tensor:
        """A per-row value (B, 1) -> the computed rows' (W, 1)."""
        return t.index_select(0, self.rows)

    def attend(self, q: Tensor, kv: Tensor) -> Tensor:
        """q (W, 1, H, hd) and kv (W, 1, 2, Hkv, hd), q and k rotated -> (W, 1, H, hd): MaskedRows.attend
        on the W rows; the attention reads their regions of the packed cache."""
        return attend_written(self.step, self.cache, q, kv, self.write_at, self.used, self.rows)

    def attend_projected(self, qkv: Tensor, heads: int) -> Tensor:
        """RowPlan.attend_projected; where the kernel runs, the rotation (the angles read by row) and
        the cache write are one kernel (mode/kernels/step_cache.py)."""
        step, cache = self.step, self.cache
        if not rotate_write_runs(step, cache, qkv, heads):
            return super().attend_projected(qkv, heads)
        from mode.kernels.step_cache import rotate_write_rows

        q = rotate_write_rows(qkv, heads, step.angles.cos_full, step.angles.sin_signed, cache.kv, self.rows,
                              self.write_at)  # (W, H, hd)
        return attend_used(q, cache, self.used, step.packed, self.rows).unsqueeze(1)

    def put(self, x: Tensor, new: Tensor) -> Tensor:
        """The step's hidden states x (B, 1, D), in place, with the kept rows' new states new (W, 1, D)
        (a padding row writes back its own state)."""
        return x.index_copy_(0, self.rows, torch.where(self.keep.view(-1, 1, 1), new.to(x.dtype), self.x))

    def add(self, x: Tensor, update: Tensor) -> Tensor:
        return self.put(x, self.x + update.to(self.x.dtype))

    def kernel_rows(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """x's (B, 1, D) kept rows, in place."""
        return x, self.rows, self.keep


def rotate_write_runs(step: StaticStep, cache: LayerCache, qkv: Tensor, heads: int) -> bool:
    """Whether a static step's layer rotates q and k and writes its cache in one kernel
    (mode/kernels/step_cache.py): the policy's step_cache op, and shapes the kernel takes."""
    if not use_triton(qkv, "step_cache"):
        return False
    from mode.kernels.step_cache import rotate_write_applies

    return rotate_write_applies(qkv, heads, step.angles.cos_full, cache.kv)


def compact_rows_reference(chosen: Tensor, width: int, lengths: Tensor, base: Tensor,
                           max_len: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """mode.kernels.decision.compact_rows in PyTorch ops: (rows, keep, write_at, used), each (W,),
    lengths grown in place for the kept rows. The rows: the chosen ones by a stable sort, the first
    W back in row order."""
    rows = (~chosen).byte().argsort(stable=True)[:width].sort().values  # (W,)
    keep = chosen.index_select(0, rows)
    length = lengths.index_select(0, rows)
    write_at, used = written_slots(keep, length, base.index_select(0, rows), max_len)
    lengths.index_copy_(0, rows, length + keep)
    return rows, keep, write_at, used


def written_slots(keep: Tensor, lengths: Tensor, base: Tensor, max_len: int) -> tuple[Tensor, Tensor]:
    """A static step's rows' cache slots, each (n,): the packed slot each writes (base + its length
    where kept, else its scratch slot max_len) and the slots it attends over (length + 1 where kept,
    else 1), from its lengths before they grow."""
    return base + torch.where(keep, lengths, max_len), torch.where(keep, lengths + 1, 1)


def attend_static(step: StaticStep, cache: LayerCache, q: Tensor, kv: Tensor, keep: Tensor) -> Tensor:
    """A static step's attention over every row: q (B, 1, H, hd) and kv (B, 1, 2, Hkv, hd), q and k
    rotated -> (B, 1, H, hd). keep (B,): the rows the layer chose, which write their key and value
    at their length, attend over their cache and themselves, and grow; any other writes its
    scratch slot (max_len) and reads one slot, its output discarded."""
    lengths = cache.lengths_dev  # (B,)
    write_at, used = written_slots(keep, lengths, step.row_base, cache.max_len)
    lengths.add_(keep)
    return attend_written(step, cache, q, kv, write_at, used)


def attend_written(step: StaticStep, cache: LayerCache, q: Tensor, kv: Tensor, write_at: Tensor, used: Tensor,
                   rows: Tensor | None = None) -> Tensor:
    """Keys and values kv (n, 1, 2, Hkv, hd) written at packed slots write_at (n,), then each query
    of q (n, 1, H, hd) over its row's first used (n,) slots -> (n, 1, H, hd). rows (n,): the batch
    rows computed, ascending (None: every row)."""
    q, kv = q[:, 0], kv[:, 0].transpose(0, 1)  # (n, H, hd), (2, n, Hkv, hd)
    write_packed(cache, write_at, kv)
    return attend_used(q, cache, used, step.packed, rows).unsqueeze(1)
