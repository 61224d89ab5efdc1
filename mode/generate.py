"""Sampling with causal routing and per-layer sparse KV caches (DESIGN.md, "Causal sampling").

    python -m mode.generate --checkpoint RUN_DIR_or_checkpoint.pt --prompt "def " \
        [--max-new-tokens N --temperature T --top-k K --top-p P --greedy --seed S]

Python API: `generate(model, prompts, ...)` for a batch of prompts (token lists or byte-level
text), and `Decoder` for prefill / decode steps with logits.

How a routed layer runs at inference:
- Every MoD / Staged MoDE layer decides per token, causally, whether the token goes through
  it (routing.causal: the router's sigmoid > 0.5, or the predictor's logit > 0).
- Each layer has its own KV cache (B, max_len, H, hd) with a per-sequence length: a layer
  writes keys and values only for the tokens it processed, so a token routed around a layer
  is absent from that layer's cache and later tokens cannot attend to it there.
- A decode token routed around a layer skips it entirely: the layer is computed only for the
  batch rows whose token it chose (index_select of those rows), nothing for the others.
- Prompts of different lengths are right-padded in one prefill; padding never enters a cache
  (it is masked out of every layer) and every token is rotated at its absolute position, so
  a padded batch gives what the prompts give one by one.
Dense layers (and MoE / Integrated MoDE layers, whose attention sees every token) process
every valid token; their FFN routes causally (expert choice by its causal decision, token
choice without capacity).
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from mode.layers.block import TransformerBlock
from mode.layers.mod import MoDBlock
from mode.layers.rotary import apply_rotary
from mode.model import LanguageModel
from mode.routing import apply_gate


# ----------------------------------------------------------------------------- the cache
@dataclass
class LayerCache:
    """Keys and values of the tokens one layer processed: (B, H, max_len, hd) and lengths (B,).

    Row b holds its first lengths[b] slots; the layout is the one attention reads, so a dense
    layer attends over a view of the cache with no copy.
    """

    k: Tensor
    v: Tensor
    lengths: Tensor  # (B,) long, on the model's device
    lengths_cpu: Tensor  # (B,) long, the same on the host (sizes the attention window without a sync)

    @classmethod
    def empty(cls, batch: int, max_len: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> "LayerCache":
        shape = (batch, heads, max_len, head_dim)
        zeros = torch.zeros(batch, dtype=torch.long)
        return cls(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device),
                   zeros.to(device), zeros.clone())


def _inner_block(block: nn.Module) -> TransformerBlock:
    return block.block if isinstance(block, MoDBlock) else block


def layer_step(
    block: nn.Module, cache: LayerCache, rotary: nn.Module, x: Tensor, positions: Tensor, select: Tensor,
    counts: Tensor | None = None,
) -> Tensor:
    """Run one block on a chunk of new tokens with its cache; return the chunk's new hidden states.

    x (B, n, D); positions (B, n) absolute positions; select (B, n) bool: the tokens this
    layer processes (valid tokens, and for a routed layer those its causal decision chose).
    counts: select.sum(1) on the host when the caller knows it (saves a sync). Unselected
    tokens come out bit-identical and leave no trace in the cache. Rows with nothing
    selected are not computed at all.
    """
    batch, n, width = x.shape
    counts = select.sum(1).cpu() if counts is None else counts
    rows_cpu = (counts > 0).nonzero().squeeze(1)
    if rows_cpu.numel() == 0:
        return x
    every_row = rows_cpu.numel() == batch
    rows = None if every_row else rows_cpu.to(x.device)
    take = (lambda t: t) if every_row else (lambda t: t.index_select(0, rows))
    count = counts[rows_cpu]  # (m,) host
    width_k = int(count.max())
    xr, pr = take(x), take(positions)
    if n == 1:  # decode: each computed row has its one token chosen; nothing to compact
        idx, valid, xs, pos = None, None, xr, pr
    else:  # chosen tokens first, in order; then padding (unchosen tokens, never written)
        sr = take(select)
        ar = torch.arange(n, device=x.device)
        idx = torch.where(sr, ar, ar + n).argsort(dim=1)[:, :width_k]  # (m, K)
        valid = sr.gather(1, idx)  # (m, K)
        xs = xr.gather(1, idx.unsqueeze(-1).expand(-1, -1, width))  # (m, K, D)
        pos = pr.gather(1, idx)
    angles = rotary.angles(pos)

    inner = _inner_block(block)
    attn = inner.attn
    m = xs.shape[0]
    qkv = attn.qkv(inner.attn_norm(xs)).view(m, width_k, 3, attn.n_heads, attn.head_dim)
    q, k = apply_rotary(qkv[:, :, :2], angles).unbind(2)  # (m, K, H, hd)
    v = qkv[:, :, 2]
    old = cache.lengths if every_row else cache.lengths.index_select(0, rows)  # (m,)
    slots = old.unsqueeze(1) + torch.arange(width_k, device=x.device)  # (m, K): padding writes past the end
    row_ids = (torch.arange(batch, device=x.device) if every_row else rows).unsqueeze(1)
    cache.k[row_ids, :, slots] = k.to(cache.k.dtype)  # indexed (m, K, H, hd)
    cache.v[row_ids, :, slots] = v.to(cache.v.dtype)
    window = int((cache.lengths_cpu[rows_cpu] + width_k).max())
    keys = cache.k[:, :, :window] if every_row else cache.k[rows, :, :window]  # (m, H, L, hd)
    values = cache.v[:, :, :window] if every_row else cache.v[rows, :, :window]
    # Query j (the j-th chosen token) sees the cached tokens and the chosen tokens 0..j.
    visible = torch.arange(window, device=x.device) < (slots + 1).unsqueeze(-1)  # (m, K, L)
    y = F.scaled_dot_product_attention(
        q.transpose(1, 2), keys.to(q.dtype), values.to(q.dtype),
        attn_mask=visible.unsqueeze(1),
    )  # (m, H, K, hd)
    a = attn.out(y.transpose(1, 2).reshape(m, width_k, width))
    out, _ = inner._ffn(inner.ffn_norm(xs + a))
    if isinstance(block, MoDBlock):
        scores = block.router.router(xs).squeeze(-1)  # (m, K): the gate g(r) of the chosen tokens
        new = xs + apply_gate(scores, block.router.gate).unsqueeze(-1).to(a.dtype) * (a + out)
    else:
        new = xs + a + out
    new = new.to(x.dtype)
    if n == 1:
        if every_row:
            cache.lengths += 1
        else:
            cache.lengths.index_add_(0, rows, torch.ones_like(rows))
        cache.lengths_cpu[rows_cpu] += 1
        return new if every_row else x.index_copy(0, rows, new)
    new = torch.where(valid.unsqueeze(-1), new, xs)  # padding (unchosen tokens) unchanged
    added = count.to(x.device)
    if every_row:
        cache.lengths += added
    else:
        cache.lengths.index_add_(0, rows, added)
    cache.lengths_cpu[rows_cpu] += count
    result = x.clone()
    result[row_ids, idx] = new
    return result


# ----------------------------------------------------------------------------- the decoder
class Decoder:
    """Prefill and decode for a batch of B sequences, with one sparse KV cache per layer."""

    def __init__(self, model: LanguageModel, batch: int, max_len: int) -> None:
        cfg = model.config.model
        if max_len > cfg.max_seq_len:
            raise ValueError(f"max_len ({max_len}) exceeds the model's context window model.max_seq_len ({cfg.max_seq_len})")
        model.check_causal()
        self.model = model
        param = model.embed.weight
        self.caches = [
            LayerCache.empty(batch, max_len, cfg.n_heads, cfg.d_model // cfg.n_heads, param.dtype, param.device)
            for _ in model.blocks
        ]
        self.positions = torch.zeros(batch, dtype=torch.long)  # next absolute position per row (host)
        self.max_len = max_len
        self.device = param.device

    @torch.no_grad()
    def forward(self, tokens: Tensor, valid: Tensor) -> Tensor:
        """tokens (B, n), valid (B, n) bool, valid tokens a prefix of each row -> hidden (B, n, D)."""
        model = self.model
        batch, n = tokens.shape
        valid_cpu = valid.cpu()
        counts = valid_cpu.sum(1)
        if int((self.positions + counts).max()) > self.max_len:
            raise ValueError(f"a sequence would exceed the decoder's max_len ({self.max_len})")
        positions = (self.positions.unsqueeze(1) + torch.arange(n)).clamp(max=model.config.model.max_seq_len - 1)
        positions = positions.to(self.device)
        valid = valid.to(self.device)
        x = model.embed(tokens.to(self.device))
        with model.routing_mode("causal"):
            for block, cache in zip(model.blocks, self.caches):
                if isinstance(block, MoDBlock):
                    chosen, _ = block.router.decide(x)
                    x = layer_step(block, cache, model.rotary, x, positions, chosen & valid)
                else:
                    x = layer_step(block, cache, model.rotary, x, positions, valid, counts)
        self.positions += counts
        return x

    def logits(self, hidden: Tensor) -> Tensor:
        return self.model.lm_head(self.model.norm(hidden)).float()

    @torch.no_grad()
    def prefill(self, prompts: Sequence[Sequence[int]]) -> Tensor:
        """Right-padded prefill of B prompts -> logits at each prompt's last token (B, V)."""
        lengths = torch.tensor([len(p) for p in prompts])
        tokens = torch.zeros(len(prompts), int(lengths.max()), dtype=torch.long)
        for i, p in enumerate(prompts):
            tokens[i, : len(p)] = torch.tensor(list(p), dtype=torch.long)
        valid = torch.arange(tokens.shape[1]) < lengths.unsqueeze(1)
        hidden = self.forward(tokens, valid)
        last = (lengths - 1).to(self.device)
        return self.logits(hidden[torch.arange(len(prompts), device=self.device), last])

    @torch.no_grad()
    def step(self, tokens: Tensor, active: Tensor | None = None) -> Tensor:
        """One decode step: tokens (B,) -> logits (B, V). Inactive rows (finished) compute nothing."""
        active = torch.ones(tokens.shape[0], dtype=torch.bool) if active is None else active.cpu()
        hidden = self.forward(tokens.view(-1, 1), active.view(-1, 1))
        return self.logits(hidden[:, 0])


# ----------------------------------------------------------------------------- sampling
def check_sampling(temperature: float, top_k: int, top_p: float, max_new_tokens: int) -> None:
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0 (0 is greedy), got {temperature}")
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
    logits = logits.float() / temperature
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


def generate(
    model: LanguageModel,
    prompts: Sequence[Sequence[int]] | Sequence[str],
    max_new_tokens: int = 64,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    stop_tokens: Sequence[int] = (),
    seed: int | None = None,
) -> list[list[int]] | list[str]:
    """Sample continuations of a batch of prompts; returns the new tokens (or text for text prompts).

    Prompts are token lists or strings (byte-level tokens). Temperature 0 is greedy. A row
    stops at a stop token (not included in its output), after max_new_tokens, or when it
    reaches the context window (model.max_seq_len).
    """
    check_sampling(temperature, top_k, top_p, max_new_tokens)
    if isinstance(prompts, str) or len(prompts) == 0:
        raise ValueError("prompts must be a non-empty list of prompts (token lists or strings)")
    as_text = all(isinstance(p, str) for p in prompts)
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
        decoder = Decoder(model, len(token_prompts), max_len)
        outputs: list[list[int]] = [[] for _ in token_prompts]
        room = [min(max_new_tokens, cfg.max_seq_len - len(p)) for p in token_prompts]
        active = torch.tensor([r > 0 for r in room])
        logits = decoder.prefill(token_prompts) if max_new_tokens > 0 else None
        while logits is not None and bool(active.any()):
            chosen = sample(logits, temperature, top_k, top_p, generator).tolist()
            for i, token in enumerate(chosen):
                if not active[i]:
                    continue
                if token in stops:
                    active[i] = False
                    continue
                outputs[i].append(token)
                if len(outputs[i]) >= room[i]:
                    active[i] = False
            if not bool(active.any()):
                break
            logits = decoder.step(torch.tensor(chosen, dtype=torch.long), active)
    finally:
        model.train(was_training)
    return [decode_bytes(o) for o in outputs] if as_text else outputs


# ----------------------------------------------------------------------------- loading
def load_model(checkpoint: str | Path, device: str | torch.device = "cpu") -> LanguageModel:
    """A LanguageModel from a run folder or checkpoint.pt written by mode.train (errors are clear)."""
    from mode.config import config_from_dict
    from mode.train import load_checkpoint_file

    payload = load_checkpoint_file(Path(checkpoint), device)
    config = config_from_dict(payload["config"], str(checkpoint))
    if "model" not in payload:
        raise ValueError(f"{checkpoint} holds no model weights")
    model = LanguageModel(config).to(device)
    model.load_state_dict(payload["model"])
    model.eval()
    return model


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Sample text from a trained MoD / MoDE model (causal routing).")
    parser.add_argument("--checkpoint", required=True, help="run folder or checkpoint.pt")
    parser.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for a batch)")
    parser.add_argument("--max-new-tokens", type=int, default=200)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--greedy", action="store_true", help="argmax decoding (temperature 0)")
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    args = parser.parse_args(argv)
    from mode.utils import pick_device

    try:
        check_sampling(args.temperature, args.top_k, args.top_p, args.max_new_tokens)
        try:
            device = pick_device(args.device)
        except RuntimeError as e:
            raise ValueError(f"--device: {e}") from None
        model = load_model(args.checkpoint, device)
        texts = generate(
            model, args.prompt, max_new_tokens=args.max_new_tokens, temperature=0.0 if args.greedy else args.temperature,
            top_k=args.top_k, top_p=args.top_p, seed=args.seed,
        )
    except (ValueError, FileNotFoundError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for prompt, text in zip(args.prompt, texts):
        print(prompt + text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
