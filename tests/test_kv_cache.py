"""Each block kind's one incremental method, forward_cached, against its own causal forward.

A block run over a chunk with a fresh cache (a prefill chunk), or one token at a time through
either decode step, gives what the block's forward with causal routing gives on the whole
sequence. Tiny float64 blocks on CPU (the router computes in float32: F64_TOL as in
test_generate.py).
"""
from __future__ import annotations

import pytest
import torch

from mode.layers.chunks import GatherStep, Prefill, StaticStep
from mode.layers.kv_cache import LayerCache, PackedRows
from mode.layers.mod import MoDBlock
from tests.test_generate import F64_TOL, PATTERNS, make_model

S, B = 12, 3


def fresh_cache(block: torch.nn.Module) -> LayerCache:
    cache = LayerCache.empty(B, S, 4, 8, torch.float64, torch.device("cpu"))
    if isinstance(block, MoDBlock):
        cache.router_weights = block.router_weights()
    return cache


@pytest.mark.parametrize("pattern", list(PATTERNS))
@torch.no_grad()
def test_forward_cached_equals_the_causal_forward_for_every_block_kind(pattern: str) -> None:
    model = make_model(pattern, "aux_loss")
    torch.manual_seed(2)
    x = torch.randn(B, S, 32, dtype=torch.float64)
    positions = torch.arange(S).expand(B, S)
    valid = torch.ones(B, S, dtype=torch.bool)
    rotary = model.rotary
    for block in model.blocks:
        want = block(x, rotary.prefix(S), causal=True)[0]
        cache = fresh_cache(block)
        got = block.forward_cached(x, cache, Prefill(rotary, positions, valid, valid.sum(1)))
        assert (got - want).abs().max() <= F64_TOL
        if isinstance(block, MoDBlock):
            assert (cache.lengths < S).any() and not torch.equal(got, x)  # some tokens skipped, some not
        # one token at a time: the gather step, and the static step (lengths on the device)
        gather_cache, static_cache = fresh_cache(block), fresh_cache(block)
        static_cache.lengths_dev = static_cache.lengths_cpu.clone()
        packed = PackedRows.build(B, S, x.device, x.dtype, 8)
        all_rows, active = torch.arange(B), torch.ones(B, dtype=torch.bool)
        for t in range(S):
            pos = torch.full((B,), t)
            gather = GatherStep.at(rotary, pos, active, S, x.device, packed.slot_ids, all_rows)
            static = StaticStep(rotary, pos, active, S, all_rows * (S + 1), packed)
            step_x = x[:, t : t + 1]
            for step, cache in ((gather, gather_cache), (static, static_cache)):
                out = block.forward_cached(step_x.clone(), cache, step)
                assert (out - want[:, t : t + 1]).abs().max() <= F64_TOL
        assert torch.equal(gather_cache.lengths, cache.lengths) and torch.equal(static_cache.lengths, cache.lengths)
