"""Prefill and decode steps with causal routing and one sparse KV cache per layer.

How a routed layer runs at inference:
- Every MoD / Staged MoDE layer decides per token, causally, whether the token goes through
  it (routing.causal: the router's sigmoid > 0.5, or the predictor's logit > 0).
- Each layer has its own KV cache (mode/layers/kv_cache.py) with a per-sequence length: a
  layer writes keys and values only for the tokens it processed, so a token routed around a
  layer is absent from that layer's cache and later tokens cannot attend to it there.
- A decode token routed around a layer skips it: its hidden state comes out unchanged and the
  layer's cache never sees it.
- Prompts of different lengths are right-padded in one prefill; padding never enters a cache
  and every token is rotated at its absolute position, so a padded batch gives what the
  prompts give one by one.
Dense layers (and MoE / Integrated MoDE layers, whose attention sees every token) process
every valid token; their FFN routes causally (expert choice by its causal decision, token
choice without capacity).

Every block runs through its one incremental method, `block.forward_cached(x, cache, chunk)`;
the chunk says how (mode/layers/chunks.py): a prefill chunk, the gather decode step (the rows a
layer chose computed alone, one host sync per routed layer; its cost follows the rows computed)
or the static decode step (no host sync: captured once as a CUDA graph and replayed; a routed
layer computes its chosen rows compacted, and any past the compacted width in a second pass
over every row, the graph's conditional nodes deciding; an MoE FFN's static pass keeps its routing
on the device, so every block kind is captured). Attention runs on the SDPA backends without
per-shape state (flash, memory-efficient, math): decode shapes change every step and cuDNN
attention builds and caches an execution plan per shape.
"""
from __future__ import annotations

import contextlib
import itertools
import warnings
from typing import Callable, Sequence

import numpy as np
import torch
from torch import Tensor, nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from mode.layers.chunks import GatherStep, Prefill, StaticStep, if_nodes_available
from mode.layers.kv_cache import LayerCache, PackedRows, attend_used, to_device
from mode.layers.mod import MoDBlock
from mode.layers.moe import MoEFFN
from mode.layers.mor import MoRBlock
from mode.model import LanguageModel

# The SDPA backends the decoder allows by default: the ones with no per-shape state. Decode
# shapes change every step (the key window grows; a routed layer computes a varying number of
# rows), and cuDNN attention builds an execution plan for every new shape (tens of ms each).
DECODE_SDPA_BACKENDS = (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH)
# How a decode step runs a routed (MoD / Staged MoDE) layer (Decoder's routed_rows):
# - "gather": only the rows whose token chose the layer are computed, the rest skip it
#   entirely; the decisions go to the host first (one sync per routed layer). Eager.
# - "masked": the static step. The chosen rows are computed (compacted, see ROW_SLACK; or every
#   active row) and only they keep the update and write a cache slot that counts; decisions,
#   lengths and positions never leave the device, and the whole step is one fixed sequence of
#   kernels: on a GPU it is captured once as a CUDA graph (cuda_graph) and replayed, so the
#   host no longer paces the step.
# "auto": "masked" (captured) on a GPU where each MoE FFN's step reads only its chosen experts'
# weights (MoEFFN.decode_reads_chosen_experts; always with dense FFNs), or from batch
# MASKED_MIN_BATCH (where almost every routed layer has some chosen row and its matmuls read
# the same weights for 8 rows as for 64), else "gather".
ROUTED_ROWS = ("auto", "gather", "masked")
MASKED_MIN_BATCH = 16
# The static step's compacted rows (Decoder's compact_rows): a routed layer computes only the
# rows its tokens chose, moved on the device into the first W = ceil(B * capacity * slack) rows
# (1 <= W <= B); a step where more rows chose it runs the rest in a second pass over every row.
# The slack over the layer's trained capacity keeps that pass rare while W stays well below B.
ROW_SLACK = 2.0
# Where compact_rows=None turns them on (with the CUDA graph's conditional nodes): up to
# COMPACT_MAX_SMALL_BATCH rows, where a routed layer that no row chose is often skipped whole,
# and from COMPACT_MIN_LARGE_BATCH, where its matrix products are bound by compute and W rows
# cost a fraction of B. In between a layer's matmuls read the same weights for W rows as for
# B, almost every step has a chosen row, and the compaction's own kernels are a net loss
# (measured: bench/results/2026-11-28-h100-speed-targets-2.md).
COMPACT_MAX_SMALL_BATCH = 8
COMPACT_MIN_LARGE_BATCH = 512


@torch.no_grad()
def layer_step(
    block: nn.Module, cache: LayerCache, rotary: nn.Module, x: Tensor, positions: Tensor, select: Tensor,
    counts: Tensor | None = None,
) -> Tensor:
    """Run one block on a chunk of new tokens with its cache; return the chunk's new hidden states.

    x (B, n, D); positions (B, n) absolute positions, on x's device; select (B, n) bool: the
    tokens this layer processes. counts: select.sum(1) on the host when the caller knows it
    (else one sync). Unselected tokens come out bit-identical and leave no trace in the cache.
    Inference only (no autograd): the cache is written in place.
    """
    counts = select.sum(1).cpu() if counts is None else counts
    return block.forward_cached(x, cache, Prefill(rotary, positions, select, counts), chosen=select)


def padded_tokens(prompts: Sequence[Sequence[int]]) -> tuple[Tensor, Tensor, Tensor]:
    """B prompts -> right-padded token ids (B, n) long, valid (B, n) bool and lengths (B,), on the
    host: one read of every id (numpy's fromiter), not a tensor per prompt."""
    count = [len(p) for p in prompts]
    lengths, width = torch.tensor(count), max(count)
    flat = torch.from_numpy(np.fromiter(itertools.chain.from_iterable(prompts), dtype=np.int64, count=sum(count)))
    valid = torch.arange(width) < lengths.unsqueeze(1)
    if min(count) == width:
        return flat.view(len(count), width), valid, lengths
    tokens = torch.zeros(len(count), width, dtype=torch.long)
    tokens[valid] = flat  # row by row, as chained
    return tokens, valid, lengths


def _block_caches(block: nn.Module, new: Callable[[], LayerCache]) -> LayerCache | list[LayerCache]:
    """A block's KV caches from new(): one, or for a Mixture-of-Recursions block the list of one per
    recursion its forward_cached takes; a routed layer's cache holds its router's float32 weights."""
    caches = [new() for _ in range(block.recursions if isinstance(block, MoRBlock) else 1)]
    for cache, weights in zip(caches, _router_snapshots(block)):
        cache.router_weights = weights
    return caches if isinstance(block, MoRBlock) else caches[0]


def _router_snapshots(block: nn.Module) -> list[tuple[Tensor, Tensor | None] | None]:
    """A block's routers' float32 weights, one per cache of the block (_block_caches): None where
    the block has no router or a predictor decides."""
    if isinstance(block, MoRBlock):
        return list(block.router_weights())
    return [block.router_weights() if isinstance(block, MoDBlock) else None]


def _run_layer(block: nn.Module, x: Tensor, cache: LayerCache, chunk: StaticStep) -> Tensor:
    return block.forward_cached(x, cache, chunk)


_COMPILED_LAYER = None


def _static_layer(compiled: bool):
    """The static step's per-layer call, compiled once per process when asked: every decoder and
    layer shares it (regional compilation: the modules' parameters are inputs, not constants);
    the cache write and attention between its pieces stay eager (MaskedRows.attend)."""
    global _COMPILED_LAYER
    if not compiled:
        return _run_layer
    if _COMPILED_LAYER is None:
        _COMPILED_LAYER = torch.compile(_run_layer, dynamic=False)
    return _COMPILED_LAYER


def compaction_pays(batch: int) -> bool:
    """Whether compacted rows speed up a static step of this batch (COMPACT_MAX_SMALL_BATCH)."""
    return batch <= COMPACT_MAX_SMALL_BATCH or batch >= COMPACT_MIN_LARGE_BATCH


# Why a decoder over replaced weights is refused (Decoder.reset, and generate's decoder argument)
WEIGHTS_REPLACED = ("the model's weights were replaced by new tensors since the decoder was built (model.to, "
                    "load_state_dict(assign=True)); build a new Decoder")


def weight_places(model: nn.Module) -> tuple[tuple[int, torch.dtype], ...]:
    """Each parameter's address and dtype, in the model's order."""
    return tuple((p.data_ptr(), p.dtype) for p in model.parameters())


class Decoder:
    """Prefill and decode for a batch of B sequences, with one sparse KV cache per layer.

    sdpa_backends: the attention backends the decoder allows (torch.nn.attention.SDPBackend),
    in torch's order of preference; None leaves torch's own choice. The default leaves out
    cuDNN attention, whose per-shape plan building dominates a decode step. Ignored on CPU,
    and where the static step calls flash attention directly.
    routed_rows: "gather", "masked" (the static step) or "auto" (see ROUTED_ROWS).
    cuda_graph: capture the static step as a CUDA graph (None: wherever it can be, that is on
    a GPU, for every block kind: an MoE FFN runs its static pass, MoEFFN.forward); compile:
    torch.compile the static step's per-layer call.
    compact_rows: the static step computes a routed (MoD / Staged MoDE) layer's chosen rows only,
    compacted into W = ceil(batch * capacity * row_slack) rows (see ROW_SLACK), and, at small
    batches (mode.layers.chunks.SKIP_TEST_MAX_EXPECTED), nothing where no row chose it. Under the
    CUDA graph its conditional nodes pick on the device; without one
    the host reads each routed layer's count (one sync). None: wherever that adds no sync, that
    is in the CUDA graph where this torch has conditional nodes, and pays (batch at most
    COMPACT_MAX_SMALL_BATCH or at least COMPACT_MIN_LARGE_BATCH); not with compile.
    decode_attention: a step's single-query attention, "auto" (the Triton kernel of
    mode/kernels/decode_attention.py where a step has rows enough, DECODE_MIN_PROGRAMS; flash
    attention's variable-length kernel below that), "triton" (the kernel at every batch) or
    "flash" (never the kernel). Where the kernel cannot run (the kernel policy, the head width)
    flash attention runs, and where flash cannot (CPU, float32) SDPA with a length mask.
    The decoder snapshots each routed layer's router weights in float32 at construction (the
    decision is computed in float32, as the router does); build a new one after changing them.
    """

    def __init__(
        self, model: LanguageModel, batch: int, max_len: int,
        sdpa_backends: Sequence[SDPBackend] | None = DECODE_SDPA_BACKENDS,
        routed_rows: str = "auto",
        cuda_graph: bool | None = None,
        compile: bool = False,
        compact_rows: bool | None = None,
        row_slack: float = ROW_SLACK,
        decode_attention: str = "auto",
    ) -> None:
        cfg = model.config.model
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len ({max_len}) exceeds the model's context window model.max_seq_len ({cfg.max_seq_len})")
        if routed_rows not in ROUTED_ROWS:
            raise ValueError(f"routed_rows must be one of {', '.join(ROUTED_ROWS)}, got {routed_rows!r}")
        model.check_causal()
        self.model = model
        param = model.embed.weight
        head_dim = cfg.head_width
        # A cache holds the key/value heads (n_kv_heads): grouped query heads share them.
        new = lambda: LayerCache.empty(batch, max_len, cfg.kv_heads, head_dim, param.dtype, param.device)  # noqa: E731
        # What each block's forward_cached takes: its cache, or a Mixture-of-Recursions block's list of them.
        self.block_caches = [_block_caches(block, new) for block in model.blocks]
        # Every cache, in layer order (one per block but R per mor block): lengths move to and from the device.
        self.caches = [c for caches in self.block_caches for c in (caches if isinstance(caches, list) else [caches])]
        self.positions = torch.zeros(batch, dtype=torch.long)  # next absolute position per row (host)
        self.batch = batch
        self.max_len = max_len
        self.device = param.device
        # A CUDA graph needs a step without host syncs: the static step, on a GPU (every block
        # kind: an MoE FFN's static pass keeps its routing on the device).
        graphable = self.device.type == "cuda"
        if routed_rows == "auto":
            moe_ffns = [m for m in model.modules() if isinstance(m, MoEFFN)]
            chosen_only = all(ffn.decode_reads_chosen_experts(param) for ffn in moe_ffns)
            routed_rows = "masked" if graphable and (chosen_only or batch >= MASKED_MIN_BATCH) else "gather"
        if cuda_graph is None:
            cuda_graph = graphable and routed_rows == "masked"
        elif cuda_graph and not (graphable and routed_rows == "masked"):
            raise ValueError("cuda_graph=True needs a CUDA model and routed_rows='masked'")
        if compile and routed_rows != "masked":
            raise ValueError("compile=True compiles the static step: it needs routed_rows='masked'")
        if compact_rows is None:
            compact_rows = (routed_rows == "masked" and not compile and cuda_graph and compaction_pays(batch)
                            and if_nodes_available())
        elif compact_rows and (routed_rows != "masked" or compile or (cuda_graph and not if_nodes_available())):
            raise ValueError(
                "compact_rows=True needs routed_rows='masked', no compile, and under cuda_graph a torch with "
                "CUDA graph conditional nodes (native, or mode.kernels.graph_if built with CUDA 12.4+ and nvcc)"
            )
        if not row_slack > 0:
            raise ValueError(f"row_slack must be positive, got {row_slack}")
        self.routed_rows, self.cuda_graph, self.compile = routed_rows, cuda_graph, compile
        self.compact_rows, self.row_slack = compact_rows, row_slack
        self._positions_dev: Tensor | None = None  # (B,) next positions on the device, in the static step
        self._static_buffers: tuple[list[Tensor], Tensor] | None = None  # the device lengths and positions
        self._graph: torch.cuda.CUDAGraph | None = None
        self._row_base = torch.arange(batch, device=self.device) * (max_len + 1)  # row b's first slot, packed
        self._packed = PackedRows.build(batch, max_len, self.device, param.dtype, head_dim, decode_attention)
        self.sdpa_backends = None if sdpa_backends is None or self.device.type == "cpu" else list(sdpa_backends)
        self._all_rows = torch.arange(batch, device=self.device)
        self._weights = weight_places(model)  # where the step (and a captured graph) reads the weights

    def weights_replaced(self) -> bool:
        """Whether a model weight is no longer the tensor the decoder was built over (model.to,
        load_state_dict(assign=True)): a captured graph would read the old memory, and the caches
        were sized for the old dtype. Weights changed in place (an optimizer step) are not replaced."""
        return weight_places(self.model) != self._weights

    @property
    def _flash_varlen(self) -> bool:
        """Whether the static step attends with flash attention's variable-length kernel."""
        return self._packed.flash

    @_flash_varlen.setter
    def _flash_varlen(self, value: bool) -> None:
        self._packed.flash = value

    def _inference(self) -> contextlib.AbstractContextManager:
        """The decoder's attention backends."""
        return sdpa_kernel(self.sdpa_backends) if self.sdpa_backends is not None else contextlib.nullcontext()

    @torch.no_grad()
    def reset(self) -> None:
        """Empty every cache and take every row back to position 0, for new prompts of the same batch:
        the caches' memory and a captured CUDA graph are kept (the graph reads the same buffers).
        The routers' float32 snapshots are taken again, in place, so weights trained in place since
        (an optimizer's step) decide; weights replaced by new tensors (model.to) need a new decoder:
        a ValueError here."""
        if self.weights_replaced():
            raise ValueError(f"Decoder.reset: {WEIGHTS_REPLACED}")
        snapshots = [weights for block in self.model.blocks for weights in _router_snapshots(block)]
        for cache, weights in zip(self.caches, snapshots, strict=True):  # self.caches: in the blocks' order
            cache.lengths_cpu, cache.lengths_dev = torch.zeros_like(cache.lengths_cpu), None
            for kept, now in zip(cache.router_weights or (), weights or ()):
                if kept is not None:
                    kept.copy_(now)
        self.positions = torch.zeros_like(self.positions)
        self._positions_dev = None

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
        chunk = Prefill(model.rotary, to_device(positions, self.device), to_device(valid_cpu, self.device), counts,
                        flash_varlen=self._packed.flash, owns_hidden=True)
        x = model.embed(to_device(tokens, self.device))
        with self._inference():
            for block, cache in zip(model.blocks, self.block_caches):
                x = block.forward_cached(x, cache, chunk)
        self.positions += counts
        return x

    def _decode(self, tokens: Tensor, active: Tensor) -> Tensor:
        """One token per row: tokens (B,) on any device, active (B,) bool on the host -> hidden (B, 1, D)."""
        if self.routed_rows == "masked":
            return self._static_decode(tokens, active, logits=False)
        model = self.model
        batch = tokens.shape[0]
        x = model.embed(to_device(tokens, self.device)).view(batch, 1, -1)
        if not bool(active.any()):
            return x
        if int(self.positions[active].max()) + 1 > self.max_len:
            raise ValueError(f"a sequence would exceed the decoder's max_len ({self.max_len})")
        step = GatherStep.at(model.rotary, self.positions, active, model.config.model.max_seq_len, self.device,
                             self._packed.slot_ids, self._all_rows)
        with self._inference():
            for block, cache in zip(model.blocks, self.block_caches):
                x = self._decode_layer(block, cache, x, step)
        self.positions += active.long()
        return x

    def _decode_layer(self, block: nn.Module, cache: LayerCache, x: Tensor, step: GatherStep) -> Tensor:
        """One gather decode step through one layer (a method of its own, for profilers to label)."""
        return block.forward_cached(x, cache, step)

    # ------------------------------------------------------------------ the static decode step
    # One decode step is a fixed sequence of kernels on device tensors, with no host sync and no
    # host value (lengths and positions live on the device), so it can be captured once as a CUDA
    # graph and replayed every step.

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
            x = self.model.embed(to_device(tokens, self.device)).view(tokens.shape[0], 1, -1)
            return self.logits(x[:, 0]) if logits else x
        if int(self.positions[active].max()) + 1 > self.max_len:
            raise ValueError(f"a sequence would exceed the decoder's max_len ({self.max_len})")
        self._enter_static()
        tokens_dev, active_dev = to_device(tokens, self.device), to_device(active, self.device)
        out = self._static_logits(tokens_dev, active_dev) if logits else self._static_step(tokens_dev, active_dev)
        self.positions += active.long()
        return out

    def _static_logits(self, tokens: Tensor, active: Tensor) -> Tensor:
        """tokens (B,), active (B,) on the device -> logits (B, V): replays the CUDA graph if there is one."""
        if self.cuda_graph and self._graph is None:
            try:
                self._capture()
            except RuntimeError as e:  # an op that cannot be captured: the same step, launched eagerly
                reason = str(e).splitlines()[0]
                if self.compact_rows:  # first without the conditional nodes
                    warnings.warn(f"mode.generate: CUDA graph capture with compacted rows failed ({reason}); every row then")
                    self.compact_rows = False
                    return self._static_logits(tokens, active)
                warnings.warn(f"mode.generate: CUDA graph capture failed ({reason}); decoding without it")
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
        graph = torch.cuda.CUDAGraph()
        run = lambda **how: self.logits(self._static_step(tokens, active, **how)[:, 0])  # noqa: E731
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                run(warm=True)
        torch.cuda.current_stream(self.device).wait_stream(side)
        with torch.cuda.graph(graph):
            self._graph_logits = run(graph=graph)
        self._graph, self._graph_inputs = graph, (tokens, active)

    @torch.no_grad()
    def _static_step(self, tokens: Tensor, active: Tensor, graph: torch.cuda.CUDAGraph | None = None,
                     warm: bool = False) -> Tensor:
        """tokens (B,), active (B,) bool, on the device -> hidden (B, 1, D). A layer keeps the update
        (and caches the token) of the rows it chose, routed or active. graph: the CUDA graph being
        captured; warm: a warm-up before capture (see StaticStep)."""
        model = self.model
        positions = self._positions_dev
        x = model.embed(tokens).view(tokens.shape[0], 1, -1)
        step = StaticStep(model.rotary, positions, active, model.config.model.max_seq_len, self._row_base, self._packed,
                          slack=self.row_slack if self.compact_rows else None, graph=graph, warm=warm)
        layer = _static_layer(self.compile)
        with self._inference():
            for block, cache in zip(model.blocks, self.block_caches):
                x = layer(block, x, cache, step)
        positions.add_(active)  # in place: the graph's own buffer
        return x

    def _attend(self, q: Tensor, cache: LayerCache, used: Tensor) -> Tensor:
        """Single-query attention of row b over its first used[b] cache slots: q (B, H, hd) -> (B, H, hd)."""
        return attend_used(q, cache, used, self._packed)

    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(self.model.norm(hidden)).float()

    def _check_batch(self, what: str, rows: int) -> None:
        if rows != self.batch:
            raise ValueError(f"Decoder.{what}: {rows} rows, but the decoder was built for batch {self.batch}")

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> Tensor:
        """Right-padded prefill of B prompts -> logits at each prompt's last token (B, V)."""
        self._check_batch("prefill", len(prompts))
        tokens, valid, lengths = padded_tokens(prompts)
        hidden = self.forward(tokens, valid)
        last = to_device(lengths - 1, self.device)
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
