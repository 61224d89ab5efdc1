"""Sampling with causal routing and per-layer sparse KV caches (DESIGN.md, "Causal sampling").

    python -m mode.generate --checkpoint RUN_DIR_or_checkpoint.pt --prompt "def " \
        [--max-new-tokens N --temperature T --top-k K --top-p P --greedy --seed S]
    python -m mode.generate --checkpoint RUN_DIR --prompt-ids "12 7 99"   # token ids in, ids out

Python API: `generate(model, prompts, ...)` for a batch of prompts (token lists or byte-level
text), and `Decoder` for prefill / decode steps with logits.

How a routed layer runs at inference:
- Every MoD / Staged MoDE layer decides per token, causally, whether the token goes through
  it (routing.causal: the router's sigmoid > 0.5, or the predictor's logit > 0).
- Each layer has its own KV cache (keys and values, B x H x max_len x hd each) with a
  per-sequence length: a layer writes keys and values only for the tokens it processed, so a
  token routed around a layer is absent from that layer's cache and later tokens cannot
  attend to it there.
- A decode token routed around a layer skips it: its hidden state comes out unchanged and the
  layer's cache never sees it. With routed_rows="gather" the layer is computed only for the
  rows whose token it chose; the static step ("masked") computes every row and keeps only the
  chosen rows' results (at a large batch the layer's matmuls cost the same either way).
- Prompts of different lengths are right-padded in one prefill; padding never enters a cache
  (it is masked out of every layer) and every token is rotated at its absolute position, so
  a padded batch gives what the prompts give one by one.
Dense layers (and MoE / Integrated MoDE layers, whose attention sees every token) process
every valid token; their FFN routes causally (expert choice by its causal decision, token
choice without capacity).

A decode step runs one of two ways (Decoder's routed_rows, see ROUTED_ROWS): the static step
("masked", the default on a GPU), one fixed sequence of kernels with no host sync, captured as
a CUDA graph; or "gather" (the default on CPU), described here, built so that its cost follows
the rows computed, not the batch, and the host waits for the device once per routed layer:
- the per-row lengths of every cache live on the host (LayerCache.lengths_cpu) and are exact,
  so attention windows, write slots and "do the rows line up?" are host decisions, not syncs;
- a routed layer computes its causal decision for all B rows (one small matmul) and copies
  the (B,) decision logits to the host, the layer's one sync. The chosen rows are gathered
  (one index_select), their keys and values written together with one indexed write at
  (row, length), attention reads only those rows' windows (a (n, 1, 1, L) length mask, none
  when their lengths are equal) and the gated update goes back with one index_add. A layer
  that no row chose costs its decision alone;
- a dense layer whose rows are all active and at one position (the usual case) writes at one
  shared slot (a slice copy) and attends over an unmasked view of its cache;
- q and k are rotated in place, the cast back to the model's dtype folded into the write;
- small index tensors go host -> device without a stream synchronisation (non_blocking).
Attention runs on the SDPA backends without per-shape state (flash, memory-efficient, math):
decode shapes change every step and cuDNN attention, which torch prefers on H100/H200, builds
and caches an execution plan per shape (see `Decoder`).
"""
from __future__ import annotations

import argparse
import contextlib
import math
import re
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mode.config import Config, ConfigError, config_from_dict, seed_problem
from mode.layers.block import TransformerBlock
from mode.layers.experts import check_backend
from mode.layers.mlp import SwiGLU
from mode.layers.mod import MoDBlock
from mode.layers.rotary import RotaryAngles, apply_rotary
from mode.model import LanguageModel
from mode.routing import DepthRouter, ExpertChoiceRouter, TokenChoiceRouter, apply_gate
from mode.utils import pick_device

# The SDPA backends the decoder allows by default: the ones with no per-shape state. Decode
# shapes change every step (the key window grows; a routed layer computes a varying number of
# rows), and cuDNN attention builds an execution plan for every new shape (tens of ms each).
DECODE_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
# Masked decode windows are rounded up to a multiple of this many slots: aligned mask rows for
# the memory-efficient kernel (no padding copy) and one shape per 16 steps instead of one per step.
WINDOW_ALIGN = 16
# How a decode step runs a routed (MoD / Staged MoDE) layer (Decoder's routed_rows):
# - "gather": only the rows whose token chose the layer are computed (index_select), the rest
#   skip it entirely; the decisions go to the host first (one sync per routed layer). Eager.
# - "masked": the static step. Every active row is computed and only the chosen rows keep the
#   update and write a cache slot that counts; decisions, lengths and positions never leave
#   the device, attention reads each row's used slots through flash attention's variable-length
#   kernel, and the whole step is one fixed sequence of kernels: on a GPU it is captured once as
#   a CUDA graph (cuda_graph) and replayed, so the host no longer paces the step.
# Either way a skipped token leaves the layer's cache and its own hidden state untouched, and
# attention reads only the layer's sparse cache. "auto": "masked" on a GPU where the step can
# be captured (every FFN dense) or from batch MASKED_MIN_BATCH (where almost every routed layer
# has some chosen row and its matmuls read the same weights for 8 rows as for 64), else "gather".
ROUTED_ROWS = ("auto", "gather", "masked")
MASKED_MIN_BATCH = 16


# ----------------------------------------------------------------------------- the cache
@dataclass
class LayerCache:
    """Keys and values of the tokens one layer processed, kv (2, B, max_len + 1, H, hd), and lengths (B,).

    kv[0] / kv[1] hold keys / values token-major: viewed as (B * (max_len + 1), H, hd) they are
    the packed layout of flash attention's variable-length kernel (the static decode step);
    k and v are their (B, H, max_len + 1, hd) views, the layout SDPA reads, so a layer attends
    over views of its cache with no copy, and keys and values are written (and gathered)
    together in one operation. Row b holds its first lengths[b] slots.
    The extra last slot is scratch: a prefill chunk's padding (tokens a row did not choose,
    computed only to keep shapes rectangular) is written there or past the row's length,
    never over a cached token. The lengths live on the host (exact, updated as tokens are
    written) so that no decision about them needs a sync.
    """

    kv: Tensor
    lengths_cpu: Tensor  # (B,) long, on the host: exact unless lengths_dev is set
    # While the decoder runs its static step (routed_rows="masked") the exact lengths live on the
    # device, updated there; lengths_cpu is then stale until sync_lengths().
    lengths_dev: Tensor | None = None

    @classmethod
    def empty(cls, batch: int, max_len: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> "LayerCache":
        # zeros, not empty: masked slots are read (weight 0) and must hold finite values.
        kv = torch.zeros(2, batch, max_len + 1, heads, head_dim, dtype=dtype, device=device)
        return cls(kv, torch.zeros(batch, dtype=torch.long))

    @property
    def k(self) -> Tensor:
        """(B, H, max_len + 1, hd) view"""
        return self.kv[0].transpose(1, 2)

    @property
    def v(self) -> Tensor:
        """(B, H, max_len + 1, hd) view"""
        return self.kv[1].transpose(1, 2)

    @property
    def max_len(self) -> int:
        return self.kv.shape[2] - 1

    @property
    def lengths(self) -> Tensor:
        """(B,) long on the cache's device: the exact lengths."""
        return self.lengths_cpu.to(self.kv.device) if self.lengths_dev is None else self.lengths_dev

    def sync_lengths(self) -> None:
        """Make lengths_cpu exact again after masked decode steps (one device -> host copy)."""
        if self.lengths_dev is not None:
            self.lengths_cpu = self.lengths_dev.to("cpu", copy=True)
            self.lengths_dev = None


def _inner_block(block: nn.Module) -> TransformerBlock:
    return block.block if isinstance(block, MoDBlock) else block


def _rotate_qk_(qkv: Tensor, angles: RotaryAngles) -> None:
    """qkv (N, S, 3, H, hd): rotate q and k in place with apply_rotary's arithmetic (x * cos +
    rotate_half(x) * sin, in float32 or wider), cast once into qkv's dtype as it is written."""
    x = qkv[:, :, :2]
    half = x.shape[-1] // 2
    shape = (angles.cos_full.shape[0], x.shape[1], 1, 1, x.shape[-1])
    rotate_half = torch.cat((x[..., half:], x[..., :half]), dim=-1)  # (x2, x1)
    torch.add(x * angles.cos_full.view(shape), rotate_half * angles.sin_signed.view(shape), out=x)


def _flash_varlen_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether flash attention's variable-length kernel with seqused_k runs here (tried once, tiny)."""
    if device.type != "cuda" or dtype not in (torch.float16, torch.bfloat16):
        return False
    try:
        q = torch.zeros(2, 1, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(4, 1, head_dim, dtype=dtype, device=device)
        cu = torch.tensor([0, 1, 2], dtype=torch.int32, device=device)
        used = torch.ones(2, dtype=torch.int32, device=device)
        torch.ops.aten._flash_attention_forward(q, kv, kv, cu, cu * 2, 1, 2, 0.0, False, False, seqused_k=used)
        return True
    except (RuntimeError, TypeError):
        return False


def _to_device(t: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on the device without waiting for the device (no stream sync)."""
    return t.to(device, non_blocking=True)


def layer_step(
    block: nn.Module, cache: LayerCache, rotary: nn.Module, x: Tensor, positions: Tensor, select: Tensor,
    counts: Tensor | None = None,
) -> Tensor:
    """Run one block on a chunk of new tokens with its cache; return the chunk's new hidden states.

    The prefill path (any chunk length; `Decoder.step` has a leaner one for single tokens).
    x (B, n, D); positions (B, n) absolute positions, on x's device; select (B, n) bool: the
    tokens this layer processes (valid tokens, and for a routed layer those its causal
    decision chose). counts: select.sum(1) on the host when the caller knows it (else one
    sync). Unselected tokens come out bit-identical and leave no trace in the cache. Rows with
    nothing selected are not computed at all.
    """
    batch, n, width = x.shape
    device = x.device
    counts = select.sum(1).cpu() if counts is None else counts
    rows_cpu = counts.nonzero().squeeze(1)
    m = rows_cpu.numel()
    if m == 0:
        return x
    every_row = m == batch
    rows = None if every_row else _to_device(rows_cpu, device)
    take = (lambda t: t) if every_row else (lambda t: t.index_select(0, rows))
    count = counts if every_row else counts.index_select(0, rows_cpu)  # (m,) host
    old_cpu = cache.lengths_cpu if every_row else cache.lengths_cpu.index_select(0, rows_cpu)  # (m,) host
    count_list, old_list = count.tolist(), old_cpu.tolist()
    width_k = max(count_list)
    full = min(count_list) == n  # every computed row processes its whole chunk: nothing to compact
    xr, pr = take(x), take(positions)
    if full:
        idx = valid = None
        xs, pos = xr, pr
    else:  # chosen tokens first, in order; then padding (unchosen tokens, never cached)
        sr = take(select)
        ar = torch.arange(n, device=device)
        idx = torch.where(sr, ar, ar + n).argsort(dim=1)[:, :width_k]  # (m, K)
        valid = sr.gather(1, idx)  # (m, K)
        xs = xr.gather(1, idx.unsqueeze(-1).expand(-1, -1, width))  # (m, K, D)
        pos = pr.gather(1, idx)
    angles = rotary.angles(pos)

    inner = _inner_block(block)
    attn = inner.attn
    qkv = attn.qkv(inner.attn_norm(xs)).view(m, width_k, 3, attn.n_heads, attn.head_dim)
    q, k = apply_rotary(qkv[:, :, :2], angles).unbind(2)  # (m, K, H, hd)
    k, v = k.to(cache.k.dtype), qkv[:, :, 2].to(cache.v.dtype)
    q = q.transpose(1, 2)  # (m, H, K, hd)
    if full and max(old_list) == 0:  # a fresh cache and a whole chunk: plain causal attention
        kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # (m, H, K, hd)
        if every_row:
            cache.k[:, :, :n] = kt
            cache.v[:, :, :n] = vt
        else:
            cache.k[rows, :, :n] = kt
            cache.v[rows, :, :n] = vt
        y = F.scaled_dot_product_attention(q, kt.to(q.dtype), vt.to(q.dtype), is_causal=True)  # (m, H, K, hd)
    else:
        old = _to_device(old_cpu, device)
        slots = old.unsqueeze(1) + torch.arange(width_k, device=device)  # (m, K)
        if not full:  # padding past the end of the cache goes to the scratch slot
            slots = slots.clamp(max=cache.max_len)
        row_ids = (torch.arange(batch, device=device) if every_row else rows).unsqueeze(1)
        cache.k[row_ids, :, slots] = k  # indexed (m, K, H, hd)
        cache.v[row_ids, :, slots] = v
        window = max(o + c for o, c in zip(old_list, count_list))
        keys, values = cache.k[:, :, :window], cache.v[:, :, :window]  # (B, H, L, hd) views
        if not every_row:
            keys, values = keys.index_select(0, rows), values.index_select(0, rows)  # (m, H, L, hd)
        # Query j (the j-th chosen token) sees the cached tokens and the chosen tokens 0..j.
        visible = torch.arange(window, device=device) <= slots.unsqueeze(-1)  # (m, K, L)
        y = F.scaled_dot_product_attention(q, keys.to(q.dtype), values.to(q.dtype), attn_mask=visible.unsqueeze(1))
    a = attn.out(y.transpose(1, 2).reshape(m, width_k, width))
    h = xs + a
    out, _ = inner._ffn(inner.ffn_norm(h), valid)  # an MoE FFN skips the padding rows
    if isinstance(block, MoDBlock):
        gates = apply_gate(block.router.router(xs).squeeze(-1), block.router.gate)  # (m, K): g(r) of the chosen tokens
        new = xs + (gates.unsqueeze(-1) * (a + out)).to(xs.dtype)  # as MoDBlock: x + (g * f(x)) in x's dtype
    else:
        new = h + out
    new = new.to(x.dtype)
    if every_row:
        cache.lengths_cpu += count
    else:
        cache.lengths_cpu.index_add_(0, rows_cpu, count)
    if full:
        return new if every_row else x.index_copy(0, rows, new)
    new = torch.where(valid.unsqueeze(-1), new, xs)  # padding (unchosen tokens) unchanged
    result = x.clone()
    result[(torch.arange(batch, device=device) if every_row else rows).unsqueeze(1), idx] = new
    return result


# ----------------------------------------------------------------------------- the decoder
class Decoder:
    """Prefill and decode for a batch of B sequences, with one sparse KV cache per layer.

    sdpa_backends: the attention backends the decoder allows (torch.nn.attention.SDPBackend),
    in torch's order of preference; None leaves torch's own choice. The default leaves out
    cuDNN attention, whose per-shape plan building dominates a decode step (see the module
    docstring). Ignored on CPU, and where the static step calls flash attention directly.
    routed_rows: "gather", "masked" (the static step) or "auto" (see ROUTED_ROWS).
    cuda_graph: capture the static step as a CUDA graph (None: wherever it can be, that is on
    a GPU with every FFN dense); compile: torch.compile the static step's pieces.
    The decoder snapshots each routed layer's router weights in float32 at construction (the
    decision is computed in float32, as the router does); build a new one after changing them.
    """

    def __init__(
        self, model: LanguageModel, batch: int, max_len: int,
        sdpa_backends: Sequence[SDPBackend] | None = DECODE_SDPA_BACKENDS,
        routed_rows: str = "auto",
        cuda_graph: bool | None = None,
        compile: bool = False,
    ) -> None:
        cfg = model.config.model
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len ({max_len}) exceeds the model's context window model.max_seq_len ({cfg.max_seq_len})")
        if routed_rows not in ROUTED_ROWS:
            raise ValueError(f"routed_rows must be one of {', '.join(ROUTED_ROWS)}, got {routed_rows!r}")
        model.check_causal()
        self.model = model
        param = model.embed.weight
        self.caches = [
            LayerCache.empty(batch, max_len, cfg.n_heads, cfg.d_model // cfg.n_heads, param.dtype, param.device)
            for _ in model.blocks
        ]
        self.positions = torch.zeros(batch, dtype=torch.long)  # next absolute position per row (host)
        self.batch = batch
        self.max_len = max_len
        self.device = param.device
        # A CUDA graph needs a step without host syncs: the static step, with dense FFNs only (an
        # MoE FFN routes causally through data-dependent row counts).
        dense_ffns = all(isinstance(_inner_block(b).ffn, SwiGLU) for b in model.blocks)
        graphable = self.device.type == "cuda" and dense_ffns
        if routed_rows == "auto":
            big = self.device.type == "cuda" and batch >= MASKED_MIN_BATCH
            routed_rows = "masked" if graphable or big else "gather"
        if cuda_graph is None:
            cuda_graph = graphable and routed_rows == "masked"
        elif cuda_graph and not (graphable and routed_rows == "masked"):
            raise ValueError(
                "cuda_graph=True needs a CUDA model whose FFNs are all dense (no MoE FFN layers) and routed_rows='masked'"
            )
        if compile and routed_rows != "masked":
            raise ValueError("compile=True compiles the static step: it needs routed_rows='masked'")
        self.routed_rows, self.cuda_graph, self.compile = routed_rows, cuda_graph, compile
        self._positions_dev: Tensor | None = None  # (B,) next positions on the device, in the static step
        self._static_buffers: tuple[list[Tensor], Tensor] | None = None  # the device lengths and positions
        self._graph: torch.cuda.CUDAGraph | None = None
        slots = max_len + 1
        self._row_base = torch.arange(batch, device=self.device) * slots  # row b's first slot in the packed cache
        self._cu_q = torch.arange(batch + 1, device=self.device, dtype=torch.int32)  # one query per row
        self._cu_k = self._cu_q * slots  # each row's cache region in the packed cache
        self._flash_varlen = _flash_varlen_available(self.device, param.dtype, cfg.d_model // cfg.n_heads)
        self.sdpa_backends = None if sdpa_backends is None or self.device.type == "cpu" else list(sdpa_backends)
        self._routers = [m for m in model.modules() if isinstance(m, (DepthRouter, ExpertChoiceRouter, TokenChoiceRouter))]
        self._slot_ids = torch.arange(max_len + 1, device=self.device)
        self._all_rows = torch.arange(batch, device=self.device)
        # Per routed layer, the float32 router weights of method (a) (decision = router logit > 0),
        # or None (method (b): the predictor decides, through the router module).
        self._decision_weights: list[tuple[Tensor, Tensor | None] | None] = []
        for block in model.blocks:
            router = block.router if isinstance(block, MoDBlock) else None
            if router is None or router.causal.predictor is not None:
                self._decision_weights.append(None)
                continue
            proj = router.router.proj
            self._decision_weights.append(
                (proj.weight.detach().float(), None if proj.bias is None else proj.bias.detach().float())
            )

    @contextlib.contextmanager
    def _inference(self) -> Iterator[None]:
        """Causal routing for every router (what model.routing_mode("causal") does, without the
        per-call walk over the model) and the decoder's attention backends."""
        previous = [m.causal_mode for m in self._routers]
        backends = sdpa_kernel(self.sdpa_backends) if self.sdpa_backends is not None else contextlib.nullcontext()
        try:
            for m in self._routers:
                m.causal_mode = True
            with backends:
                yield
        finally:
            for m, old in zip(self._routers, previous):
                m.causal_mode = old

    @torch.no_grad()
    def forward(self, tokens: Tensor, valid: Tensor) -> Tensor:
        """tokens (B, n), valid (B, n) bool, valid tokens a prefix of each row -> hidden (B, n, D)."""
        model = self.model
        batch, n = tokens.shape
        valid_cpu = valid.cpu()
        if n == 1:
            return self._decode(tokens.view(-1), valid_cpu.view(-1))
        counts = valid_cpu.sum(1)
        self._leave_static()  # the prefill path decides on exact host lengths
        if int((self.positions + counts).max()) > self.max_len:
            raise ValueError(f"a sequence would exceed the decoder's max_len ({self.max_len})")
        positions = (self.positions.unsqueeze(1) + torch.arange(n)).clamp(max=model.config.model.max_seq_len - 1)
        positions = _to_device(positions, self.device)
        valid = _to_device(valid_cpu, self.device)
        x = model.embed(_to_device(tokens, self.device))
        with self._inference():
            for block, cache in zip(model.blocks, self.caches):
                if isinstance(block, MoDBlock):
                    chosen, _ = block.router.decide(x)
                    x = layer_step(block, cache, model.rotary, x, positions, chosen & valid)
                else:
                    x = layer_step(block, cache, model.rotary, x, positions, valid, counts)
        self.positions += counts
        return x

    def _decode(self, tokens: Tensor, active: Tensor) -> Tensor:
        """One token per row: tokens (B,) on any device, active (B,) bool on the host -> hidden (B, 1, D)."""
        if self.routed_rows == "masked":
            return self._static_decode(tokens, active, logits=False)
        model = self.model
        batch = tokens.shape[0]
        all_active = bool(active.all())
        act_rows = None if all_active else active.nonzero().squeeze(1)  # host
        x = model.embed(_to_device(tokens, self.device)).view(batch, 1, -1)
        if act_rows is not None and act_rows.numel() == 0:
            return x
        now = (self.positions if all_active else self.positions.index_select(0, act_rows)).tolist()
        first, last = min(now), max(now)
        if last + 1 > self.max_len:
            raise ValueError(f"a sequence would exceed the decoder's max_len ({self.max_len})")
        rotary = model.rotary
        if first == last:  # every computed row is at one absolute position: one angle for all, as views
            angles = RotaryAngles(rotary.cos_full[first].view(1, 1, 1, -1), rotary.sin_signed[first].view(1, 1, 1, -1))
        else:  # a finished row may stand at the end of the window: its (unused) angle is clamped to the table
            pos = _to_device(self.positions.clamp(max=model.config.model.max_seq_len - 1), self.device)
            angles = RotaryAngles(
                rotary.cos_full.index_select(0, pos).view(batch, 1, 1, -1),
                rotary.sin_signed.index_select(0, pos).view(batch, 1, 1, -1),
            )
        with self._inference():
            for index, (block, cache) in enumerate(zip(model.blocks, self.caches)):
                if isinstance(block, MoDBlock):
                    decision, scores = _decide(block, x, self._decision_weights[index])
                    chosen = decision.cpu() > 0  # the layer's one sync: (B,) decisions to the host
                    if not all_active:
                        chosen &= active
                    rows = chosen.nonzero().squeeze(1)
                    if rows.numel() == 0:
                        continue  # no row chose this layer: nothing computed, nothing cached
                    x = self._decode_layer(block, cache, x, None if rows.numel() == batch else rows, angles, scores)
                else:
                    x = self._decode_layer(block, cache, x, act_rows, angles, None)
        self.positions += 1 if all_active else active.long()
        return x

    def _decode_layer(
        self, block: nn.Module, cache: LayerCache, x: Tensor, rows_cpu: Tensor | None, angles: RotaryAngles,
        scores: Tensor | None,
    ) -> Tensor:
        """One token per row through one layer, for the rows rows_cpu (host, sorted; None: every row).

        x (B, 1, D); angles for every row (B, ...) or shared (1, ...); scores (B,) the router
        scores of a routed layer (its gate), None for a dense one. Returns x with those rows updated.
        """
        batch, _, width = x.shape
        inner = _inner_block(block)
        attn = inner.attn
        lengths = cache.lengths_cpu if rows_cpu is None else cache.lengths_cpu.index_select(0, rows_cpu)  # host
        lengths_list = lengths.tolist()
        shortest, longest = min(lengths_list), max(lengths_list)
        aligned = shortest == longest  # every computed row appends at one slot
        if rows_cpu is None:
            rows, slots, xs, n = None, None, x, batch
            if not aligned:
                slots = _to_device(lengths, self.device)
        else:
            if aligned:
                rows, slots = _to_device(rows_cpu, self.device), None
            else:  # rows and write slots in one host -> device copy
                rows, slots = _to_device(torch.stack((rows_cpu, lengths)), self.device).unbind(0)
            xs = x.index_select(0, rows)  # (n, 1, D)
            n = rows_cpu.numel()
            if angles.cos_full.shape[0] > 1:
                angles = RotaryAngles(angles.cos_full.index_select(0, rows), angles.sin_signed.index_select(0, rows))
        qkv = attn.qkv(inner.attn_norm(xs)).view(n, 1, 3, attn.n_heads, attn.head_dim)
        _rotate_qk_(qkv, angles)
        q, kv = qkv[:, :, 0], qkv[:, 0, 1:].transpose(0, 1).to(cache.kv.dtype)  # (n, 1, H, hd), (2, n, H, hd)
        if aligned:  # a slice write, no mask
            slot, mask = shortest, None
            if rows is None:
                cache.kv[:, :, slot] = kv
                window_kv = cache.kv[:, :, : slot + 1]  # (2, B, L, H, hd) view
            else:
                cache.kv[:, :, slot].index_copy_(1, rows, kv)
                window_kv = cache.kv[:, :, : slot + 1].index_select(1, rows)  # (2, n, L, H, hd)
        else:  # rows at different lengths: one indexed write at (row, length) and a length mask
            cache.kv[:, self._all_rows if rows is None else rows, slots] = kv
            window = min(-(-(longest + 1) // WINDOW_ALIGN) * WINDOW_ALIGN, cache.kv.shape[2])
            window_kv = cache.kv[:, :, :window]
            if rows is not None:
                window_kv = window_kv.index_select(1, rows)
            mask = (self._slot_ids[:window] <= slots.view(n, 1, 1, 1))  # (n, 1, 1, L): the row's cache and itself
        keys, values = window_kv.to(q.dtype).transpose(2, 3).unbind(0)  # (n, H, L, hd) each
        y = F.scaled_dot_product_attention(q.transpose(1, 2), keys, values, attn_mask=mask)
        a = attn.out(y.transpose(1, 2).reshape(n, 1, width))
        h = xs + a
        out, _ = inner._ffn(inner.ffn_norm(h))
        if rows_cpu is None:
            cache.lengths_cpu += 1
        else:
            cache.lengths_cpu[rows_cpu] = lengths + 1
        if scores is None:  # dense: h + FFN(norm(h))
            new = h + out
            return new if rows is None else x.index_copy_(0, rows, new.to(x.dtype))
        # routed: x + g(r) * f(x), as MoDBlock: f = a + out, times the float32 gate, rounded once
        # to x's dtype (written over f), then added to the rows' residual.
        update = a + out
        gate = apply_gate(scores if rows is None else scores.index_select(0, rows), block.router.gate)
        torch.mul(update, gate.view(n, 1, 1), out=update)
        return xs + update if rows is None else x.index_add_(0, rows, update.to(x.dtype))

    # ------------------------------------------------------------------ the static decode step
    # routed_rows="masked": one decode step is a fixed sequence of kernels on device tensors,
    # with no host sync and no host value (lengths and positions live on the device), so it
    # can be captured once as a CUDA graph and replayed every step.

    def _enter_static(self) -> None:
        """Hand the lengths and positions to the device (after a prefill, which keeps them on the host).

        Always into the same device buffers: a captured CUDA graph reads and updates them in place."""
        if self._positions_dev is not None:
            return
        if self._static_buffers is None:  # copies, never aliases (on CPU .to would return the host tensor)
            lengths = [cache.lengths_cpu.to(self.device, copy=True) for cache in self.caches]
            self._static_buffers = (lengths, self.positions.to(self.device, copy=True))
        else:
            for buffer, cache in zip(self._static_buffers[0], self.caches):
                buffer.copy_(cache.lengths_cpu)
            self._static_buffers[1].copy_(self.positions)
        for buffer, cache in zip(self._static_buffers[0], self.caches):
            cache.lengths_dev = buffer
        self._positions_dev = self._static_buffers[1]

    def _leave_static(self) -> None:
        """Bring the exact lengths back to the host (one copy); host positions are always exact."""
        for cache in self.caches:
            cache.sync_lengths()
        self._positions_dev = None

    def _static_decode(self, tokens: Tensor, active: Tensor, logits: bool) -> Tensor:
        """tokens (B,) on any device, active (B,) bool on the host -> logits (B, V), or hidden (B, 1, D).

        Checks on the host, then the static step on the device; positions advance by active."""
        if not bool(active.any()):  # nothing to compute: the inputs' embeddings, as the gather step
            x = self.model.embed(_to_device(tokens, self.device)).view(tokens.shape[0], 1, -1)
            return self.logits(x[:, 0]) if logits else x
        if int(self.positions[active].max()) + 1 > self.max_len:
            raise ValueError(f"a sequence would exceed the decoder's max_len ({self.max_len})")
        self._enter_static()
        tokens_dev, active_dev = _to_device(tokens, self.device), _to_device(active, self.device)
        out = self._static_logits(tokens_dev, active_dev) if logits else self._static_step(tokens_dev, active_dev)
        self.positions += active.long()
        return out

    def _static_logits(self, tokens: Tensor, active: Tensor) -> Tensor:
        """tokens (B,), active (B,) on the device -> logits (B, V): replays the CUDA graph if there is one."""
        if self.cuda_graph and self._graph is None:
            try:
                self._capture()
            except RuntimeError as e:  # an op that cannot be captured: the same step, launched eagerly
                warnings.warn(f"mode.generate: CUDA graph capture failed ({str(e).splitlines()[0]}); decoding without it")
                self.cuda_graph = False
        if not self.cuda_graph:
            return self.logits(self._static_step(tokens, active)[:, 0])
        self._graph_inputs[0].copy_(tokens)
        self._graph_inputs[1].copy_(active)
        self._graph.replay()
        return self._graph_logits.clone()  # the next replay overwrites the graph's output

    def _capture(self) -> None:
        """Record one static step as a CUDA graph. The warm-up runs have no active row, so they
        write only scratch slots and leave every length and position as it was."""
        batch = self.positions.shape[0]
        tokens = torch.zeros(batch, dtype=torch.long, device=self.device)
        active = torch.zeros(batch, dtype=torch.bool, device=self.device)
        run = lambda: self.logits(self._static_step(tokens, active)[:, 0])  # noqa: E731
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run()
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._graph_logits = run()
        self._graph, self._graph_inputs = graph, (tokens, active)

    def _static_step(self, tokens: Tensor, active: Tensor) -> Tensor:
        """tokens (B,), active (B,) bool, on the device -> hidden (B, 1, D). Every row is computed;
        a layer keeps the update (and caches the token) of the rows it chose, routed or active."""
        model = self.model
        batch = tokens.shape[0]
        positions = self._positions_dev
        x = model.embed(tokens).view(batch, 1, -1)
        # A finished row may stand at the end of the context window: its (discarded) rotation is
        # clamped to the table, as the prefill clamps its padding.
        angle_ids = positions.clamp(max=model.config.model.max_seq_len - 1)
        cos = model.rotary.cos_full.index_select(0, angle_ids).view(batch, 1, 1, -1)
        sin = model.rotary.sin_signed.index_select(0, angle_ids).view(batch, 1, 1, -1)
        pre, post = _static_pieces(self.compile)
        with self._inference():
            for index, (block, cache) in enumerate(zip(model.blocks, self.caches)):
                q, kv, chosen, gate = pre(block, x, cos, sin, active, self._decision_weights[index])
                y = self._static_attention(cache, q, kv, chosen)
                x = post(_inner_block(block), x, y, chosen, gate)
        positions.add_(active)  # in place: the graph's own buffer
        return x

    def _static_attention(self, cache: LayerCache, q: Tensor, kv: Tensor, chosen: Tensor) -> Tensor:
        """q (B, H, hd), kv (2, B, H, hd), chosen (B,) bool -> attention output (B, H, hd).

        A chosen row writes its key and value at its length and attends over its cache and
        itself; every other row writes to its scratch slot (max_len), so the cache holds exactly
        the chosen tokens, and its output is discarded by the caller.
        """
        lengths = cache.lengths_dev  # (B,) exact
        slot = torch.where(chosen, lengths, cache.max_len)
        packed = cache.kv.view(2, -1, *kv.shape[2:])  # (2, B * (max_len + 1), H, hd)
        packed.index_copy_(1, self._row_base + slot, kv.to(cache.kv.dtype))
        # An unchosen row's output is discarded; reading at least one (finite) slot keeps it finite.
        used = torch.where(chosen, lengths + 1, lengths.clamp(min=1))
        lengths.add_(chosen)
        return self._attend(q, cache, used)

    def _attend(self, q: Tensor, cache: LayerCache, used: Tensor) -> Tensor:
        """Single-query attention of row b over its first used[b] cache slots: q (B, H, hd) -> (B, H, hd).

        With flash attention (CUDA, fp16 / bf16): its variable-length kernel on the packed cache,
        which reads only the used slots (seqused_k) and takes no host value. Elsewhere: SDPA over
        the whole cache with a length mask (the same result at full-length cost).
        """
        batch, heads, head_dim = q.shape
        if self._flash_varlen:
            slots = cache.kv.shape[2]
            keys, values = cache.kv.view(2, -1, heads, head_dim).to(q.dtype).unbind(0)  # (B * slots, H, hd)
            return torch.ops.aten._flash_attention_forward(
                q.contiguous(), keys, values, self._cu_q, self._cu_k, 1, slots, 0.0, False, False, seqused_k=used.int(),
            )[0]
        mask = self._slot_ids < used.view(batch, 1, 1, 1)  # (B, 1, 1, max_len + 1)
        y = F.scaled_dot_product_attention(q.unsqueeze(2), cache.k.to(q.dtype), cache.v.to(q.dtype), attn_mask=mask)
        return y.squeeze(2)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(self.model.norm(hidden)).float()

    def _check_batch(self, what: str, rows: int) -> None:
        if rows != self.batch:
            raise ValueError(f"Decoder.{what}: {rows} rows, but the decoder was built for batch {self.batch}")

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> Tensor:
        """Right-padded prefill of B prompts -> logits at each prompt's last token (B, V)."""
        self._check_batch("prefill", len(prompts))
        lengths = torch.tensor([len(p) for p in prompts])
        tokens = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
        valid = torch.arange(tokens.shape[1]) < lengths.unsqueeze(1)
        hidden = self.forward(tokens, valid)
        last = _to_device(lengths - 1, self.device)
        return self.logits(hidden[torch.arange(len(prompts), device=self.device), last])

    @torch.no_grad()
    def step(self, tokens: Tensor, active: Tensor | None = None) -> Tensor:
        """One decode step: tokens (B,) (on any device) -> logits (B, V). Inactive rows (finished) compute nothing."""
        self._check_batch("step", tokens.numel())
        if active is not None and active.numel() != self.batch:
            raise ValueError(f"Decoder.step: active has {active.numel()} rows, the decoder {self.batch}")
        active = torch.ones(tokens.shape[0], dtype=torch.bool) if active is None else active.cpu()
        if self.routed_rows == "masked":
            return self._static_decode(tokens.reshape(-1), active.view(-1), logits=True)
        hidden = self._decode(tokens.reshape(-1), active.view(-1))
        return self.logits(hidden[:, 0])


# ----------------------------------------------------------------------------- static step pieces
def _decide(block: MoDBlock, x: Tensor, weights: tuple[Tensor, Tensor | None] | None) -> tuple[Tensor, Tensor]:
    """A routed layer's causal decision for one token per row: x (B, 1, D) -> (decision logits (B,),
    router scores (B,)), float32. A token goes through the layer when its decision logit is > 0
    (DepthRouter.decide). weights: the router's float32 weights (method a), used directly
    outside autocast; None: the router and its predictor (method b) decide."""
    if weights is None or torch.is_autocast_enabled(x.device.type):
        scores = block.router.router(x).view(-1)
        return block.router.causal.logits(x, scores.view(-1, 1, 1)).view(-1), scores
    scores = F.linear(x.view(x.shape[0], -1).float(), *weights).view(-1)  # Router.forward, weights kept in float32
    return scores, scores


# The static decode step around each layer's cache write and attention: plain functions of
# the layer's modules, so that with Decoder(compile=True) one torch.compile of each serves
# every layer (regional compilation: the modules' parameters are inputs, not constants).
def _static_pre(
    block: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, active: Tensor, weights: tuple[Tensor, Tensor | None] | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
    """x (B, 1, D) -> q (B, H, hd), kv (2, B, H, hd), chosen (B,) bool, gate (B,) float32 or None.

    chosen: the active rows, and for a routed layer those whose causal decision took the token
    (decision logit > 0: the float32 router weights when given, else the router / predictor);
    gate: a routed layer's g(r)."""
    batch = x.shape[0]
    gate = None
    chosen = active
    if isinstance(block, MoDBlock):
        decision, scores = _decide(block, x, weights)
        chosen = (decision > 0) & active
        gate = apply_gate(scores, block.router.gate)
    inner = _inner_block(block)
    attn = inner.attn
    qkv = attn.qkv(inner.attn_norm(x)).view(batch, 1, 3, attn.n_heads, attn.head_dim)
    qk = apply_rotary(qkv[:, :, :2], RotaryAngles(cos, sin))  # (B, 1, 2, H, hd)
    kv = torch.stack((qk[:, 0, 1], qkv[:, 0, 2]))  # (2, B, H, hd)
    return qk[:, 0, 0], kv, chosen, gate


def _static_post(inner: TransformerBlock, x: Tensor, y: Tensor, chosen: Tensor, gate: Tensor | None) -> Tensor:
    """The rest of the layer: the chosen rows' new hidden states, the others' unchanged. y (B, H, hd)."""
    batch, _, width = x.shape
    a = inner.attn.out(y.reshape(batch, 1, width))
    h = x + a
    out, _ = inner._ffn(inner.ffn_norm(h))
    keep = chosen.view(batch, 1, 1)
    if gate is None:  # dense: h + FFN(norm(h))
        return torch.where(keep, h + out, x)
    # routed: x + g(r) * f(x), as MoDBlock: f = a + out times the float32 gate, rounded once to x's dtype
    update = (a + out) * gate.view(batch, 1, 1)
    return torch.where(keep, x + update.to(x.dtype), x)


_COMPILED_PIECES: tuple | None = None


def _static_pieces(compiled: bool) -> tuple:
    """(pre, post), compiled once per process when asked (every decoder and layer shares them)."""
    global _COMPILED_PIECES
    if not compiled:
        return _static_pre, _static_post
    if _COMPILED_PIECES is None:
        _COMPILED_PIECES = (torch.compile(_static_pre, dynamic=False), torch.compile(_static_post, dynamic=False))
    return _COMPILED_PIECES


# ----------------------------------------------------------------------------- sampling
def check_sampling(temperature: float, top_k: int, top_p: float, max_new_tokens: int) -> None:
    if not (math.isfinite(temperature) and temperature >= 0):  # NaN fails every comparison
        raise ValueError(f"temperature must be a finite number >= 0 (0 is greedy), got {temperature}")
    if top_k < 0:
        raise ValueError(f"top_k must be >= 0 (0 disables it), got {top_k}")
    if not 0.0 < top_p <= 1.0:
        raise ValueError(f"top_p must be in (0, 1], got {top_p}")
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be >= 0, got {max_new_tokens}")


def sample(logits: Tensor, temperature: float, top_k: int, top_p: float, generator: torch.Generator | None) -> Tensor:
    """logits (B, V) -> tokens (B,): greedy at temperature 0, else top-k then nucleus (top-p) sampling."""
    if temperature == 0:
        return logits.argmax(-1)
    # Shifted so the largest is 0 before dividing: a tiny temperature then sends the others to -inf
    # (greedy in the limit) instead of every logit to +-inf and the softmax to NaN.
    logits = logits.float()
    logits = (logits - logits.amax(-1, keepdim=True)) / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = logits.topk(top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # keep the smallest prefix with mass >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    probs = logits.softmax(-1)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def encode_text(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def decode_bytes(tokens: Sequence[int]) -> str:
    return bytes(t for t in tokens if 0 <= t < 256).decode("utf-8", errors="replace")


def is_byte_level(model: LanguageModel) -> bool:
    """Whether the model's token ids are UTF-8 bytes (text in, text out).

    A model trained on a pre-tokenized .bin (data.source: tokens) reads ids of some other
    tokenizer even at vocab_size 256, and a vocabulary other than 256 cannot be bytes.
    """
    config = model.config
    return config.data.source != "tokens" and config.model.vocab_size == 256


def _token_model(model: LanguageModel) -> str:
    """Why a model is not byte-level, for error messages."""
    config = model.config
    return (f"this model reads token ids (data.source {config.data.source!r}, "
            f"model.vocab_size {config.model.vocab_size}), not text")


def generate(
    model: LanguageModel,
    prompts: Sequence[Sequence[int]] | Sequence[str],
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_tokens: Sequence[int] = (),
    seed: int | None = None,
    compile: bool = False,
) -> list[list[int]] | list[str]:
    """Sample continuations of a batch of prompts; returns the new tokens (or text for text prompts).

    Prompts are token lists or strings (byte-level tokens). Temperature 0 is greedy. A row
    stops at a stop token (not included in its output), after max_new_tokens, or when it
    reaches the context window (model.max_seq_len). compile: torch.compile the static decode
    step (Decoder(compile=True); worth its compile time for long generations).
    """
    check_sampling(temperature, top_k, top_p, max_new_tokens)
    if isinstance(prompts, str) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of prompts (token lists or strings)")
    as_text = all(isinstance(p, str) for p in prompts)
    if any(isinstance(p, str) for p in prompts) and not is_byte_level(model):
        # Byte-encoding the text would feed ids of the wrong tokenizer, and decode_bytes would
        # drop every generated id >= 256: the caller would see the prompt and nothing else.
        raise ValueError(f"text prompts need a byte-level model; {_token_model(model)}: give token lists")
    token_prompts = [encode_text(p) if isinstance(p, str) else list(p) for p in prompts]
    cfg = model.config.model
    for i, p in enumerate(token_prompts):
        if len(p) == 0:
            raise ValueError(f"prompts[{i}] is empty: a prompt needs at least one token")
        if len(p) > cfg.max_seq_len:
            raise ValueError(
                f"prompts[{i}] has {len(p)} tokens, longer than the context window model.max_seq_len ({cfg.max_seq_len})"
            )
        bad = [t for t in p if not 0 <= int(t) < cfg.vocab_size]
        if bad:
            raise ValueError(f"prompts[{i}] holds token ids outside the vocabulary [0, {cfg.vocab_size}): {bad[:5]}")
    model.check_causal()
    stops = set(int(t) for t in stop_tokens)
    longest = max(len(p) for p in token_prompts)
    max_len = min(cfg.max_seq_len, longest + max_new_tokens)
    was_training = model.training
    model.eval()
    device = model.embed.weight.device
    generator = None
    if seed is not None:
        generator = torch.Generator(device=device).manual_seed(seed)
    try:
        decoder = Decoder(model, len(token_prompts), max_len, routed_rows="masked" if compile else "auto", compile=compile)
        outputs: list[list[int]] = [[] for _ in token_prompts]
        room = [min(max_new_tokens, cfg.max_seq_len - len(p)) for p in token_prompts]
        active = [r > 0 for r in room]  # host bookkeeping in Python: no per-row tensor indexing
        logits = decoder.prefill(token_prompts) if max_new_tokens > 0 else None
        while logits is not None and any(active):
            sampled = sample(logits, temperature, top_k, top_p, generator)  # (B,) on the device
            chosen = sampled.tolist()  # the step's host sync: stop tokens and outputs are host decisions
            for i, token in enumerate(chosen):
                if not active[i]:
                    continue
                if token in stops:
                    active[i] = False
                    continue
                outputs[i].append(token)
                if len(outputs[i]) >= room[i]:
                    active[i] = False
            if not any(active):
                break
            logits = decoder.step(sampled, torch.tensor(active))
    finally:
        model.train(was_training)
    return [decode_bytes(o) for o in outputs] if as_text else outputs


# ----------------------------------------------------------------------------- loading
def load_model(checkpoint: str | Path, device: str | torch.device = "cpu") -> LanguageModel:
    """A LanguageModel from a run folder or checkpoint.pt written by mode.train (errors are clear)."""
    from mode.checkpoint import load_checkpoint_file

    return model_from_payload(load_checkpoint_file(Path(checkpoint), device), str(checkpoint), device)


def model_from_payload(payload: dict[str, Any], source: str, device: str | torch.device) -> LanguageModel:
    """The model a loaded checkpoint holds, with its own config (model.config), in eval mode."""
    if not isinstance(payload.get("config"), dict):
        raise ValueError(f"{source} holds no config: not a checkpoint written by mode.train")
    config = config_from_dict(payload["config"], source)
    if "model" not in payload:
        raise ValueError(f"{source} holds no model weights")
    _backend_that_runs_here(config, source)
    model = LanguageModel(config).to(device)
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as e:  # missing, unexpected or reshaped weights
        raise ValueError(f"{source}: its weights do not fit the model its config describes ({e})") from None
    model.eval()
    return model


def _backend_that_runs_here(config: Config, source: str) -> None:
    """A model trained on moe.backend grouped_gemm or megablocks (GPU extensions) loaded where that
    backend cannot run: the torch backend computes the same experts from the same weights (the
    backends differ only in how they compute), so it takes over, with a note on stderr."""
    if not config.model.has_experts() or config.moe.backend == "torch":
        return
    try:
        check_backend(config.moe.backend)
    except ConfigError as e:
        print(f"note: {source}: moe.backend={config.moe.backend!r} cannot run here ({e}); its experts run on "
              "moe.backend='torch' (the same weights and results)", file=sys.stderr)
        config.moe.backend = "torch"


# ----------------------------------------------------------------------------- command line
# The sampling flags' defaults: --greedy (the argmax) makes any other value meaningless.
SAMPLING_DEFAULTS = {"--temperature": 1.0, "--top-k": 0, "--top-p": 1.0}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description="Sample text from a trained MoD / MoDE model (causal routing).")
    parser.add_argument("--checkpoint", required=True, help="run folder or checkpoint.pt")
    parser.add_argument("--prompt", action="append", help="prompt text, byte-level models only (repeat for a batch)")
    parser.add_argument(
        "--prompt-ids", action="append",
        help='prompt as token ids, e.g. "12 7 99" or "12,7,99"; the output is ids too (repeat for a batch). '
        "Give --prompt or --prompt-ids, not both",
    )
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=SAMPLING_DEFAULTS["--temperature"])
    parser.add_argument("--top-k", type=int, default=SAMPLING_DEFAULTS["--top-k"])
    parser.add_argument("--top-p", type=float, default=SAMPLING_DEFAULTS["--top-p"])
    parser.add_argument("--greedy", action="store_true", help="argmax decoding (temperature 0)")
    parser.add_argument("--seed", type=seed_value, default=None, help="seeds the sampling: 0 to 2**63 - 1")
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--compile", action="store_true", help="torch.compile the decode step (pays off on long generations)")
    parser.add_argument(
        "--dtype", default="auto", choices=list(DTYPES),
        help="the weights' dtype while sampling; auto: bfloat16 on a GPU (as training's autocast computes, and what "
        "flash attention's variable-length decode kernel needs), float32 on CPU",
    )
    return parser


def seed_value(text: str) -> int:
    """--seed: an integer in train.seed's range (torch.manual_seed fails past 64 bits with a line naming no flag)."""
    try:
        seed = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    problem = seed_problem(seed)
    if problem is not None:
        raise argparse.ArgumentTypeError(f"{seed} is out of range: a seed {problem}")
    return seed


DTYPES = {"auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16}


def sampling_dtype(name: str, device: torch.device) -> torch.dtype:
    """--dtype -> the dtype the model samples in (auto: bfloat16 on CUDA, float32 elsewhere)."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def _check_flags(args: argparse.Namespace) -> None:
    """Flag combinations that would otherwise be ignored silently."""
    if (args.prompt is None) == (args.prompt_ids is None):
        raise ValueError("give exactly one of --prompt (text) and --prompt-ids (token ids)")
    if args.greedy:
        given = {"--temperature": args.temperature, "--top-k": args.top_k, "--top-p": args.top_p}
        # --temperature 0 is greedy already, so it agrees with --greedy
        clash = [f for f, v in given.items() if v != SAMPLING_DEFAULTS[f] and not (f == "--temperature" and v == 0)]
        if clash:
            raise ValueError(f"--greedy takes the argmax and would ignore {', '.join(clash)}: drop one or the other")
    check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens)


def parse_prompt_ids(value: str, vocab_size: int) -> list[int]:
    """'12 7 99' or '12,7,99' -> [12, 7, 99], each id checked to be in [0, vocab_size)."""
    ids = []
    for part in re.split(r"[\s,]+", value.strip()):
        if not part:  # an empty value: _check_prompt reports it
            continue
        try:
            token = int(part)
        except ValueError:
            raise ValueError(f"--prompt-ids {value!r}: {part!r} is not an integer token id "
                             "(give ids separated by spaces or commas)") from None
        if not 0 <= token < vocab_size:
            raise ValueError(f"--prompt-ids {value!r}: token id {token} is outside the vocabulary "
                             f"[0, {vocab_size}) of this model (model.vocab_size)")
        ids.append(token)
    return ids


def _label(flag: str, index: int, count: int) -> str:
    return flag if count == 1 else f"{flag} #{index + 1}"


def _cli_prompts(args: argparse.Namespace, model: LanguageModel) -> tuple[str, list[list[int]]]:
    """(the flag the prompts came from, the prompts as token lists)."""
    if args.prompt is None:
        return "--prompt-ids", [parse_prompt_ids(v, model.config.model.vocab_size) for v in args.prompt_ids]
    if not is_byte_level(model):
        raise ValueError(f'--prompt: {_token_model(model)}; give the prompt as --prompt-ids "12 7 99"')
    prompts = []
    for i, text in enumerate(args.prompt):
        try:
            prompts.append(encode_text(text))
        except UnicodeEncodeError:  # bytes the shell passed that are not UTF-8 (kept as surrogates)
            raise ValueError(f"{_label('--prompt', i, len(args.prompt))} is not valid UTF-8 text: give its bytes "
                             'as --prompt-ids "104 105"') from None
    return "--prompt", prompts


def _check_prompt(label: str, tokens: list[int], unit: str, max_seq_len: int, max_new_tokens: int) -> None:
    """Checked here, not only in generate(), so that errors name the flag; and a prompt that fills
    the context window is an error, not an empty sample. unit: what a token is, for the message."""
    if not tokens:
        raise ValueError(f"{label} is empty: a prompt needs at least one token")
    if len(tokens) > max_seq_len:
        raise ValueError(f"{label} has {len(tokens)} {unit}, longer than the context window model.max_seq_len ({max_seq_len})")
    if len(tokens) == max_seq_len and max_new_tokens > 0:
        raise ValueError(f"{label} has {len(tokens)} {unit}, the whole context window model.max_seq_len "
                         f"({max_seq_len}): no room to generate")


def _cut_notice(name: str, prompt_len: int, new: int, max_new_tokens: int, max_seq_len: int) -> str | None:
    """A note when the context window, not --max-new-tokens, ended a sample (None otherwise)."""
    if max_new_tokens <= max_seq_len - prompt_len or new < max_seq_len - prompt_len:
        return None
    return (f"note: {name}generated {new} new tokens, not --max-new-tokens {max_new_tokens}: the prompt "
            f"({prompt_len} tokens) and the output fill the context window model.max_seq_len ({max_seq_len})")


def _print_samples(args: argparse.Namespace, prompts: list[list[int]], outputs: list[list[int]], max_seq_len: int) -> None:
    """Each prompt and its continuation (text, or ids for --prompt-ids); a header line before each
    sample when there are several, since a text sample can span lines."""
    many = len(prompts) > 1
    for i, (prompt, new) in enumerate(zip(prompts, outputs)):
        if many:
            print(f"--- sample {i + 1} ---")
        if args.prompt is not None:
            print(args.prompt[i] + decode_bytes(new))
        else:
            print(" ".join(str(t) for t in prompt + new))
        notice = _cut_notice(f"sample {i + 1}: " if many else "", len(prompt), len(new), args.max_new_tokens, max_seq_len)
        if notice:
            print(notice, file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        _check_flags(args)
        device = pick_device(args.device, field="--device")
        model = load_model(args.checkpoint, device).to(sampling_dtype(args.dtype, device))
        flag, prompts = _cli_prompts(args, model)
        max_seq_len = model.config.model.max_seq_len
        unit = "UTF-8 bytes" if flag == "--prompt" else "tokens"
        for i, p in enumerate(prompts):
            _check_prompt(_label(flag, i, len(prompts)), p, unit, max_seq_len, args.max_new_tokens)
        outputs = generate(
            model, prompts, max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed, compile=args.compile,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _print_samples(args, prompts, outputs, max_seq_len)
    return 0


if __name__ == "__main__":
    sys.exit(main())
