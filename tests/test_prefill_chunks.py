"""A prefill chunk on a fresh cache: a layer that takes some tokens of each row (a different
number per row, none in one) attends with plain causal attention over the compacted tokens,
and gives what the block gives on each row's chosen tokens alone; later decode steps see each
row's chosen tokens and nothing else. A second chunk over ragged caches gives the full forward.
What a routed layer's prefill costs: only its chosen tokens computed, a fixed sequence of ops.
Tiny float64 blocks on CPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

from mode.generate import Decoder, layer_step
from mode.layers import chunks
from mode.layers.chunks import FreshTokens, GatherStep, Prefill, StaticStep
from mode.layers.kv_cache import LayerCache, PackedRows
from tests.test_generate import F64_TOL, make_model

S, B, D = 12, 4, 32
STEPS = 3  # decode steps after the prefill


def chosen_tokens() -> torch.Tensor:
    """(B, S) bool: every row a different count, row 2 none, row 3 all."""
    chosen = torch.zeros(B, S, dtype=torch.bool)
    chosen[0, [1, 4, 5, 9]] = True
    chosen[1, [0, 2, 3, 6, 7, 8, 11]] = True
    chosen[3] = True
    return chosen


def reference(block: torch.nn.Module, rotary: torch.nn.Module, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The block's causal forward on one row's tokens x (n, D) at positions (n,) -> (n, D)."""
    return block(x.unsqueeze(0), rotary.angles(positions))[0][0]


@torch.no_grad()
def test_fresh_prefill_of_compacted_rows_is_causal_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    model = make_model("dense")
    block, rotary = model.blocks[0], model.rotary
    torch.manual_seed(3)
    x = torch.randn(B, S + STEPS, D, dtype=torch.float64)
    chosen = chosen_tokens()
    calls = []
    sdpa = F.scaled_dot_product_attention

    def recording(*args, **kwargs):
        calls.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal", False)))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(chunks.F, "scaled_dot_product_attention", recording)
    cache = LayerCache.empty(B, S + STEPS, 4, 8, torch.float64, torch.device("cpu"))
    positions = torch.arange(S).expand(B, S)
    got = layer_step(block, cache, rotary, x[:, :S], positions, chosen)
    assert calls == [(True, True)]  # one attention call, causal, no mask
    assert cache.lengths.tolist() == chosen.sum(1).tolist()
    for b in range(B):
        picked = chosen[b].nonzero().squeeze(1)
        want = x[b, :S].clone()
        if picked.numel():
            want[picked] = reference(block, rotary, x[b, picked], picked)
        assert (got[b] - want).abs().max() <= F64_TOL, b
        assert torch.equal(got[b, ~chosen[b]], x[b, :S][~chosen[b]])  # unchosen tokens untouched

    # Decode steps after it (both steps) see each row's chosen tokens and nothing of the padding.
    monkeypatch.setattr(chunks.F, "scaled_dot_product_attention", sdpa)
    static_cache = LayerCache(cache.kv.clone(), cache.lengths_cpu.clone())
    static_cache.lengths_dev = static_cache.lengths_cpu.clone()
    packed = PackedRows.build(B, S + STEPS, x.device, x.dtype, 8)
    all_rows, active = torch.arange(B), torch.ones(B, dtype=torch.bool)
    for t in range(S, S + STEPS):
        pos = torch.full((B,), t)
        gather = GatherStep.at(rotary, pos, active, S + STEPS, x.device, packed.slot_ids, all_rows)
        static = StaticStep(rotary, pos, active, S + STEPS, all_rows * (S + STEPS + 1), packed)
        for step, step_cache in ((gather, cache), (static, static_cache)):
            out = block.forward_cached(x[:, t : t + 1].clone(), step_cache, step)
            for b in range(B):
                seen = torch.cat((chosen[b].nonzero().squeeze(1), torch.arange(S, t + 1)))
                want = reference(block, rotary, x[b, seen], seen)[-1]
                assert (out[b, 0] - want).abs().max() <= F64_TOL, (t, b)


@pytest.mark.parametrize("chunk_lengths", [(5, 2, 4), (5, 5, 5)])
@pytest.mark.parametrize("pattern", ["mod", "mode_staged", "dense"])
@torch.no_grad()
def test_a_second_prefill_chunk_over_ragged_caches_equals_the_full_forward(pattern: str, chunk_lengths) -> None:
    """A prefill chunk after ragged prompts (every layer's cache holds a different number of
    tokens per row; the chunk right-padded, or whole): each row's logits are its full causal
    forward's over prompt and chunk."""
    model = make_model(pattern, "aux_loss", n_layers=3)
    torch.manual_seed(4)
    prompt_lengths = (3, 9, 6)
    tokens = torch.randint(0, 256, (3, 9 + 5))
    decoder = Decoder(model, 3, 9 + 5)
    decoder.prefill([tokens[b, :n].tolist() for b, n in enumerate(prompt_lengths)])
    chunk = torch.stack([tokens[b, n : n + 5] for b, n in enumerate(prompt_lengths)])  # (3, 5)
    valid = torch.arange(5) < torch.tensor(chunk_lengths).unsqueeze(1)
    got = decoder.logits(decoder.forward(chunk, valid))  # (3, 5, V)
    for b, (n, c) in enumerate(zip(prompt_lengths, chunk_lengths)):
        full = model(tokens[b : b + 1, : n + c], routing_mode="causal").logits.float()[0, n:]
        assert (got[b, :c] - full).abs().max() <= F64_TOL, b
    assert decoder.positions.tolist() == [n + c for n, c in zip(prompt_lengths, chunk_lengths)]


def top_level_ops(run) -> int:
    """How many aten ops run() calls itself (not those inside other aten ops), on CPU."""
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    return sum(e.name.startswith("aten::") and not (e.cpu_parent and e.cpu_parent.name.startswith("aten::"))
               for e in prof.events())


def uneven_prefill(block: torch.nn.Module, rotary: torch.nn.Module, batch: int, n: int, share: float):
    """A layer_step call over a fresh cache, every row choosing a different share of its n tokens
    (share > 1: all of them)."""
    generator = torch.Generator().manual_seed(batch * 100 + n)
    x = torch.randn(batch, n, D, dtype=torch.float64, generator=generator)
    chosen = (torch.rand(batch, n, generator=generator) < share) | (share > 1)
    chosen[:, 0] = True
    if share <= 1:  # row 0 takes one token, row 1 at least two
        chosen[0, 1:] = False
        chosen[1, 1] = True
    cache = LayerCache.empty(batch, n, 4, 8, torch.float64, torch.device("cpu"))
    return lambda: layer_step(block, cache, rotary, x, torch.arange(n).expand(batch, n), chosen)


@torch.no_grad()
def test_a_routed_prefill_layer_computes_only_its_chosen_tokens() -> None:
    """The projections and the FFN see exactly the tokens the layer took, however unevenly the rows
    took them (no row padded to the longest)."""
    model = make_model("mod")
    block, rotary = model.blocks[1], model.rotary
    seen = {}
    hooks = [module.register_forward_hook(lambda m, args, out, name=name: seen.__setitem__(name, args[0].shape[:-1].numel()))
             for name, module in (("qkv", block.block.attn.qkv), ("ffn", block.block.ffn))]
    torch.manual_seed(5)
    x = torch.randn(B, S, D, dtype=torch.float64)
    chosen = chosen_tokens()
    layer_step(block, LayerCache.empty(B, S, 4, 8, torch.float64, torch.device("cpu")), rotary, x,
               torch.arange(S).expand(B, S), chosen)
    for hook in hooks:
        hook.remove()
    assert seen == {"qkv": int(chosen.sum()), "ffn": int(chosen.sum())}


@torch.no_grad()
def test_a_routed_prefill_layer_runs_a_fixed_number_of_ops() -> None:
    """A routed layer's prefill is a fixed sequence of ops whatever the batch, the chunk length and
    the rows' counts (no loop over rows or tokens), within twice a dense layer's."""
    model = make_model("mod")
    dense, routed = model.blocks
    rotary = model.rotary
    counts = {(batch, n): top_level_ops(uneven_prefill(routed, rotary, batch, n, 0.3)) for batch, n in ((2, 12), (16, 12), (16, 40))}
    assert len(set(counts.values())) == 1, counts
    assert counts[2, 12] <= 2 * top_level_ops(uneven_prefill(dense, rotary, 2, 12, 2.0))


def test_token_order_puts_each_row_first_in_its_cache() -> None:
    """Prefill.token_order: the chosen tokens' flat ids first, row after row, each row's in order;
    on a fresh cache where flash attention's variable-length kernel runs, row b's r-th chosen
    token's packed cache slot b * (max_len + 1) + r and the rows' cumulative counts; neither where
    a row's cache holds tokens already, with one row, or without that kernel."""
    chosen = chosen_tokens()
    positions, valid, counts = torch.arange(S).expand(B, S), torch.ones(B, S, dtype=torch.bool), torch.full((B,), S)
    chunk = Prefill(None, positions, valid, counts, flash_varlen=True)
    cache = LayerCache.empty(B, S, 4, 8, torch.float64, torch.device("cpu"))
    order = chunk.token_order(chosen, cache)
    total = int(chosen.sum())
    assert order.order[:total].tolist() == [b * S + j for b in range(B) for j in chosen[b].nonzero().flatten().tolist()]
    assert order.slots[:total].tolist() == [b * (S + 1) + r for b in range(B) for r in range(int(chosen[b].sum()))]
    assert order.cu.tolist() == [0, 4, 11, 11, 23] and order.cu.dtype == torch.int32
    assert Prefill(None, positions, valid, counts).token_order(chosen, cache).slots is None
    one_row = LayerCache.empty(1, S, 4, 8, torch.float64, torch.device("cpu"))
    assert chunk.token_order(chosen[:1], one_row).slots is None
    cache.lengths_cpu[2] = 1
    assert chunk.token_order(chosen, cache).slots is None


@pytest.mark.parametrize("owns_hidden", [False, True])
@torch.no_grad()
def test_a_routed_prefill_update_through_its_kernel_equals_the_pytorch_ops(owns_hidden: bool,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The gated update of a routed layer's packed tokens in one kernel (rows.put_gated_rows_;
    Triton's interpreter on CPU, float32 on a GPU) gives the PyTorch ops' hidden states, into the chunk's own tensor
    where it owns it and into a copy, leaving the caller's untouched, where it does not."""
    from mode.kernels import KernelPolicy, use_kernels
    from mode.kernels import rows as row_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"  # Triton's interpreter only without a GPU
    model = make_model("mod").float().to(device)
    for name in ("cos", "sin", "cos_full", "sin_signed"):  # float32 tables, as a model built in float32 keeps
        setattr(model.rotary, name, getattr(model.rotary, name).float())
    block, rotary = model.blocks[1], model.rotary
    x = torch.randn(B, S, D, generator=torch.Generator().manual_seed(6)).to(device)
    chosen = chosen_tokens().to(device)
    positions = torch.arange(S, device=device).expand(B, S)
    valid, counts = torch.ones(B, S, dtype=torch.bool, device=device), torch.full((B,), S)
    calls, put = [], row_kernels.put_gated_rows_
    monkeypatch.setattr(row_kernels, "put_gated_rows_", lambda *args: calls.append(1) or put(*args))

    def run(policy: KernelPolicy) -> tuple[torch.Tensor, torch.Tensor]:
        given = x.clone()
        chunk = Prefill(rotary, positions, valid, counts, owns_hidden=owns_hidden)
        cache = LayerCache.empty(B, S, 4, 8, torch.float32, torch.device(device))
        with use_kernels(policy):
            return given, block.forward_cached(given, cache, chunk, chosen=chosen)

    given, fast = run(KernelPolicy(cpu=True))
    assert calls == [1]
    _, plain = run(KernelPolicy(enabled=False))
    assert calls == [1]
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-5)
    assert torch.equal(fast[~chosen], x[~chosen])
    if owns_hidden:
        assert fast.data_ptr() == given.data_ptr()
    else:
        assert torch.equal(given, x)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention's variable-length kernel needs a GPU")
@pytest.mark.parametrize("pattern", ["mod", "mode_staged", "dense"])
@torch.no_grad()
def test_a_fresh_prefill_through_flash_varlen_equals_the_padded_layout_and_the_full_forward(
        pattern: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ragged prompts (one empty) on fresh caches, bf16 on a GPU: the packed tokens attending through
    flash attention's variable-length kernel (FreshTokens) give the (m, K) layout's logits and
    caches, and each prompt's full causal forward; decode steps after either agree too."""
    model = make_model(pattern, "aux_loss", n_layers=3).to("cuda", torch.bfloat16)
    torch.manual_seed(8)
    lengths = (3, 12, 0, 7)
    tokens = torch.randint(0, 256, (len(lengths), 12))
    prompts = [tokens[b, :n].tolist() for b, n in enumerate(lengths)]
    made = []
    original = FreshTokens.__init__

    def spy(self, *args, **kwargs):
        made.append(1)
        original(self, *args, **kwargs)

    monkeypatch.setattr(FreshTokens, "__init__", spy)
    results = {}
    for flash in (True, False):
        decoder = Decoder(model, len(lengths), 16)
        assert decoder._flash_varlen
        decoder._flash_varlen = flash  # the prefill's packed tokens then take the (m, K) layout
        before = len(made)
        logits = [decoder.prefill(prompts)]
        assert (len(made) > before) == flash
        decoder._flash_varlen = True
        follow = torch.randint(0, 256, (len(lengths),), generator=torch.Generator().manual_seed(2))
        logits.append(decoder.step(follow))
        results[flash] = torch.stack(logits), decoder
    (fresh, fresh_decoder), (padded, padded_decoder) = results[True], results[False]
    torch.testing.assert_close(fresh, padded, rtol=2e-2, atol=2e-2)
    for a, b in zip(fresh_decoder.caches, padded_decoder.caches):
        assert torch.equal(a.lengths_cpu, b.lengths_cpu) if a.lengths_dev is None else torch.equal(a.lengths, b.lengths)
        for row, n in enumerate(a.lengths.tolist()):
            torch.testing.assert_close(a.kv[:, row, :n], b.kv[:, row, :n], rtol=2e-2, atol=2e-2)
    for b, n in enumerate(lengths):
        if n:
            full = model(tokens[b : b + 1, :n].cuda(), routing_mode="causal").logits.float()[0, -1]
            torch.testing.assert_close(fresh[0, b], full, rtol=5e-2, atol=5e-2)


def test_prompts_become_one_right_padded_batch() -> None:
    from mode.inference.decoder import padded_tokens

    tokens, valid, lengths = padded_tokens([[5, 6, 7], [], [8], (9, 10)])
    assert tokens.tolist() == [[5, 6, 7], [0, 0, 0], [8, 0, 0], [9, 10, 0]]
    assert valid.tolist() == [[True] * 3, [False] * 3, [True, False, False], [True, True, False]]
    assert lengths.tolist() == [3, 0, 1, 2] and tokens.dtype == torch.long
    tokens, valid, _ = padded_tokens([[1, 2], [3, 4]])
    assert tokens.tolist() == [[1, 2], [3, 4]] and bool(valid.all())
