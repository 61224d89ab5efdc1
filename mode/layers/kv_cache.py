"""A layer's KV cache for incremental decoding, and single-query attention over it."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mode.kernels import use_triton
from mode.layers.attention import expand_kv


@dataclass
class LayerCache:
    """Keys and values of the tokens one layer processed, kv (2, B, max_len + 1, Hkv, hd), and lengths (B,).

    kv[0] / kv[1] hold keys / values token-major: viewed as (B * (max_len + 1), H, hd) they are
    the packed layout of flash attention's variable-length kernel (the static decode step);
    k and v are their (B, Hkv, max_len + 1, hd) views, the layout SDPA reads, so a layer attends
    over views of its cache with no copy, and keys and values are written (and gathered)
    together in one operation. Row b holds its first lengths[b] slots.
    The extra last slot is scratch: a static decode step's row that a layer does not keep
    (computed only to keep shapes fixed) writes there, never over a cached token. The lengths
    live on the host (exact, updated as tokens are written) so that no decision about them
    needs a sync.
    router_weights: a routed layer's router weights in float32 (MoDBlock.router_weights), which
    the decode steps decide with; None where the router decides itself.
    """

    kv: Tensor
    lengths_cpu: Tensor  # (B,) long, on the host: exact unless lengths_dev is set
    # While the decoder runs its static step the exact lengths live on the device, updated
    # there; lengths_cpu is then stale until sync_lengths().
    lengths_dev: Tensor | None = None
    router_weights: tuple[Tensor, Tensor | None] | None = None

    @classmethod
    def empty(cls, batch: int, max_len: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> "LayerCache":
        """heads: the layer's key/value heads (n_kv_heads under grouped-query attention)."""
        # zeros, not empty: masked slots are read (weight 0) and must hold finite values.
        kv = torch.zeros(2, batch, max_len + 1, heads, head_dim, dtype=dtype, device=device)
        return cls(kv, torch.zeros(batch, dtype=torch.long))

    @property
    def k(self) -> Tensor:
        """(B, Hkv, max_len + 1, hd) view"""
        return self.kv[0].transpose(1, 2)

    @property
    def v(self) -> Tensor:
        """(B, Hkv, max_len + 1, hd) view"""
        return self.kv[1].transpose(1, 2)

    @property
    def max_len(self) -> int:
        return self.kv.shape[2] - 1

    @property
    def lengths(self) -> Tensor:
        """(B,) long on the cache's device: the exact lengths."""
        return self.lengths_cpu.to(self.kv.device) if self.lengths_dev is None else self.lengths_dev

    def sync_lengths(self) -> None:
        """Make lengths_cpu exact again after static decode steps (one device -> host copy)."""
        if self.lengths_dev is not None:
            self.lengths_cpu = self.lengths_dev.to("cpu", copy=True)
            self.lengths_dev = None


def to_device(t: Tensor, device: torch.device) -> Tensor:
    """A small host tensor on the device without waiting for the device (no stream sync)."""
    return t.to(device, non_blocking=True)


def flash_varlen_available(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
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


# Where a decoder runs the decode attention kernel (Decoder's decode_attention): where a step has
# rows enough, at every batch, or never (flash attention, else SDPA).
DECODE_ATTENTION = ("auto", "triton", "flash")


@dataclass
class PackedRows:
    """The packed-cache layout of a batch for single-query attention: cu_q (B + 1,) int32, one
    query per row; cu_k (B + 1,) int32, each row's region of the packed cache; slot_ids
    (max_len + 1,); flash: whether flash attention's variable-length kernel runs here; kernel:
    where the decode attention kernel runs (DECODE_ATTENTION: "auto", "triton" or "flash")."""

    cu_q: Tensor
    cu_k: Tensor
    slot_ids: Tensor
    flash: bool
    kernel: str = "auto"

    @classmethod
    def build(cls, batch: int, max_len: int, device: torch.device, dtype: torch.dtype, head_dim: int,
              kernel: str = "auto") -> "PackedRows":
        if kernel not in DECODE_ATTENTION:
            raise ValueError(f"decode_attention must be one of {', '.join(DECODE_ATTENTION)}, got {kernel!r}")
        cu_q = torch.arange(batch + 1, device=device, dtype=torch.int32)
        return cls(cu_q, cu_q * (max_len + 1), torch.arange(max_len + 1, device=device),
                   flash_varlen_available(device, dtype, head_dim), kernel)


def attend_used(q: Tensor, cache: LayerCache, used: Tensor, packed: PackedRows, rows: Tensor | None = None) -> Tensor:
    """Single-query attention of row b over its first used[b] cache slots: q (n, H, hd) -> (n, H, hd);
    rows (n,): the batch rows q holds, ascending (None: every row, n = B).

    Where it applies (packed.kernel; on a GPU with rows enough unless "triton",
    mode/kernels/decode_attention.py): one Triton program per row and head streams the used
    slots, no query tile. Else with flash attention
    (CUDA, fp16 / bf16): its variable-length kernel on the packed cache, which reads only the
    used slots (seqused_k) of the rows' regions, takes no host value and groups query heads
    itself (a cache of Hkv < H heads). Elsewhere: SDPA over the rows' whole caches with a length
    mask (the same result at full-length cost).
    """
    n, heads, head_dim = q.shape
    kv_heads = cache.kv.shape[3]
    if packed.kernel != "flash" and cache.kv.dtype == q.dtype and use_triton(q, "decode_attention"):
        from mode.kernels.decode_attention import decode_attention, decode_attention_applies

        if decode_attention_applies(q, packed.kernel == "triton"):
            return decode_attention(q, cache.kv, used, rows)
    if packed.flash:
        slots = cache.kv.shape[2]
        keys, values = cache.kv.view(2, -1, kv_heads, head_dim).to(q.dtype).unbind(0)  # (B * slots, Hkv, hd)
        cu_q, cu_k = packed.cu_q, packed.cu_k
        if rows is not None:  # the rows' regions, then the end of the last one
            cu_q, cu_k = cu_q[: n + 1], torch.cat((cu_k.index_select(0, rows), cu_k[-1:]))
        return torch.ops.aten._flash_attention_forward(
            q.contiguous(), keys, values, cu_q, cu_k, 1, slots, 0.0, False, False, seqused_k=used.int(),
        )[0]
    mask = packed.slot_ids < used.view(n, 1, 1, 1)  # (n, 1, 1, max_len + 1)
    groups = heads // kv_heads
    k, v = cache.k, cache.v  # (B, Hkv, L, hd) views
    if rows is not None:
        k, v = k.index_select(0, rows), v.index_select(0, rows)  # (n, Hkv, L, hd)
    keys, values = expand_kv(k.to(q.dtype), groups), expand_kv(v.to(q.dtype), groups)  # (n, H, L, hd)
    y = F.scaled_dot_product_attention(q.unsqueeze(2), keys, values, attn_mask=mask)
    return y.squeeze(2)
