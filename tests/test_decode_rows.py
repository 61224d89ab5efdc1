"""The static decode step's compacted rows (Decoder's compact_rows): a routed layer computes only
the rows its tokens chose, moved into the first W rows on the device, nothing where no row chose
it, and where more than W did, the first W so and the rest in a second, masked pass. Each way
gives what the masked step (every row computed) and the full causal forward give. Tiny float64
models on CPU (F64_TOL as in test_generate.py), where the host picks the way; on a GPU the
captured graph's IF nodes pick.
"""
from __future__ import annotations

from types import ModuleType

import pytest
import torch

from mode.generate import Decoder
from mode.inference.decoder import COMPACT_MAX_SMALL_BATCH, COMPACT_MIN_LARGE_BATCH, compaction_pays
from mode.kernels import graph_if
from mode.layers.chunks import SKIP_TEST_MAX_EXPECTED, CompactRows, MaskedRows, StaticStep, if_nodes_available
from mode.layers.kv_cache import attend_used
from mode.layers.mod import MoDBlock
from mode.model import LanguageModel
from tests.test_generate import F64_TOL, make_config, make_model, spread_weights_

S, B, PROMPT = 16, 6, 5


def forced_model(pattern: str, bias: float | None):
    """A 3-layer model; bias: every routed layer's router bias (None: the drawn one, which splits
    the rows; -1e3: no row chooses the layer; +1e3: every row does)."""
    model = make_model(pattern, "aux_loss", n_layers=3, router_bias=True)
    if bias is not None:
        with torch.no_grad():
            for block in model.blocks:
                if isinstance(block, MoDBlock):
                    block.router.router.proj.bias.fill_(bias)
    return model


@pytest.fixture
def ways(monkeypatch) -> list:
    """The passes each routed layer's static step ran, as a tuple of plan types: (CompactRows,),
    (CompactRows, MaskedRows) where more rows chose it than W holds, (MaskedRows,), or () (no row)."""
    seen, routed = [], StaticStep.routed

    def spy(self, x, cache, chosen, capacity, body, decision=None):
        kinds = []
        out = routed(self, x, cache, chosen, capacity, lambda rows: kinds.append(type(rows)) or body(rows), decision)
        seen.append(tuple(kinds))
        return out

    monkeypatch.setattr(StaticStep, "routed", spy)
    return seen


def decode(model, tokens: torch.Tensor, active: torch.Tensor | None = None, **kwargs) -> tuple[torch.Tensor, Decoder]:
    """Logits for positions PROMPT-1 .. S-1 of tokens (B, S): a prefill, then one static step a
    token (active: the rows still decoding from the third step on)."""
    decoder = Decoder(model, tokens.shape[0], tokens.shape[1], routed_rows="masked", **kwargs)
    logits = [decoder.prefill(tokens[:, :PROMPT].tolist())]
    for t in range(PROMPT, tokens.shape[1]):
        logits.append(decoder.step(tokens[:, t], active if t >= PROMPT + 2 else None))
    return torch.stack(logits, 1), decoder  # (B, S - PROMPT + 1, V)


COMPACT, BOTH = (CompactRows,), (CompactRows, MaskedRows)


@pytest.mark.parametrize("bias, expect", [
    (None, {COMPACT, BOTH}), (-1e3, {()}), (1e3, {BOTH}),  # (): some layers may skip
])
@pytest.mark.parametrize("pattern", ["mod", "mode_staged"])
def test_compact_rows_equal_the_masked_step_and_the_full_forward(pattern: str, bias, expect, ways) -> None:
    model = forced_model(pattern, bias)
    torch.manual_seed(3)
    tokens = torch.randint(0, 256, (B, S))
    full = model(tokens, routing_mode="causal").logits.float()[:, PROMPT - 1:]
    # W = ceil(6 * 0.25 * 2) = 3 of 6 rows (the default slack): some steps fit, some overflow
    compact, compacted = decode(model, tokens, compact_rows=True)
    assert expect <= set(ways) <= expect | {()}
    ways.clear()
    masked, reference = decode(model, tokens, compact_rows=False)
    assert set(ways) == {(MaskedRows,)}
    assert (compact - full).abs().max() <= F64_TOL and (compact - masked).abs().max() <= F64_TOL
    for a, b in zip(compacted.caches, reference.caches):
        assert torch.equal(a.lengths, b.lengths)
        for row, n in enumerate(a.lengths.tolist()):
            torch.testing.assert_close(a.kv[:, row, :n], b.kv[:, row, :n], rtol=0, atol=F64_TOL)


@pytest.mark.parametrize("pattern", ["mod", "mode_staged"])
def test_finished_rows_leave_no_trace_in_compacted_rows(pattern: str, ways) -> None:
    model = forced_model(pattern, None)
    torch.manual_seed(4)
    tokens = torch.randint(0, 256, (B, S))
    active = torch.tensor([True, False, True, True, False, True])
    compact, compacted = decode(model, tokens, active, compact_rows=True)
    assert COMPACT in ways
    masked, reference = decode(model, tokens, active, compact_rows=False)
    assert (compact - masked).abs().max() <= F64_TOL
    for a, b in zip(compacted.caches, reference.caches):
        assert torch.equal(a.lengths, b.lengths)
        # every slot but scratch: what the static steps wrote (the chosen rows' at their lengths)
        # and what the prefill left past them
        torch.testing.assert_close(a.kv[:, :, :-1], b.kv[:, :, :-1], rtol=0, atol=F64_TOL)
    assert compacted.positions.tolist() == [S, PROMPT + 2, S, S, PROMPT + 2, S]


def counted_calls(monkeypatch, *targets: tuple[ModuleType, str]) -> dict[str, int]:
    """Each (module, function name) wrapped for the test to count its calls: name -> calls so far."""
    calls = {name: 0 for _, name in targets}
    for module, name in targets:
        original = getattr(module, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("pattern", ["mod", "mode_staged"])
def test_compacted_decode_through_the_kernels_equals_the_pytorch_ops(pattern: str, monkeypatch, ways) -> None:
    """The compacted step through its kernels (Triton's interpreter on CPU; compiled on a GPU, in
    the eager static step, whose host picks the passes as here): the compaction with its slots
    and lengths, the gated update into the kept rows and the rotation of q and k with the cache
    write each run, and the logits and caches are the PyTorch ops' (float32)."""
    from mode.kernels import KernelPolicy, decision, rows, step_cache, use_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = forced_model(pattern, None).float().to(device)
    for name in ("cos", "sin", "cos_full", "sin_signed"):  # float32 tables, as a model built in float32 keeps
        setattr(model.rotary, name, getattr(model.rotary, name).float())
    torch.manual_seed(3)
    tokens = torch.randint(0, 256, (B, S))
    calls = counted_calls(monkeypatch, (decision, "compact_rows"), (rows, "put_gated_rows_"),
                          (step_cache, "rotate_write_rows"))
    with use_kernels(KernelPolicy(cpu=True)):
        fast, fast_decoder = decode(model, tokens, compact_rows=True, cuda_graph=False)
    assert all(calls.values()), calls
    assert {COMPACT, BOTH} <= set(ways)
    with use_kernels(KernelPolicy(enabled=False)):
        plain, plain_decoder = decode(model, tokens, compact_rows=True, cuda_graph=False)
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)
    for a, b in zip(fast_decoder.caches, plain_decoder.caches):
        assert torch.equal(a.lengths, b.lengths)
        for row, n in enumerate(a.lengths.tolist()):
            torch.testing.assert_close(a.kv[:, row, :n], b.kv[:, row, :n], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("gate", ["sigmoid", "identity"])
@pytest.mark.parametrize("pattern", ["mod", "mode_staged"])
def test_a_masked_step_through_the_gated_kernel_equals_the_pytorch_ops(pattern: str, gate: str, monkeypatch) -> None:
    """The masked static step (every row computed) through the kernels: each routed layer's update
    of the chosen rows is one kernel that also gathers and gates the router's scores (Triton's
    interpreter on CPU; compiled on a GPU), in the step's own hidden states; every layer writes its
    attention input (q and k rotated; slots, lengths, keys and values written) in one kernel and a
    dense layer puts its output in one;
    the logits and caches are the PyTorch ops' (float32), for either gate function."""
    from mode.kernels import KernelPolicy, rows, step_cache, use_kernels

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    model = spread_weights_(LanguageModel(make_config(pattern, "aux_loss", 3, gate=gate))).float().to(device)
    for name in ("cos", "sin", "cos_full", "sin_signed"):  # float32 tables, as a model built in float32 keeps
        setattr(model.rotary, name, getattr(model.rotary, name).float())
    tokens = torch.randint(0, 256, (B, S), generator=torch.Generator().manual_seed(3))
    gates, put = [], rows.put_gated_rows_
    monkeypatch.setattr(rows, "put_gated_rows_", lambda *args: gates.append(args[-1]) or put(*args))
    calls = counted_calls(monkeypatch, (step_cache, "rotate_write_every_row"), (rows, "put_sum"))
    with use_kernels(KernelPolicy(cpu=True)):
        fast, fast_decoder = decode(model, tokens, compact_rows=False, cuda_graph=False)
    assert gates and set(gates) == {gate}  # every routed layer's update, its gate applied in the kernel
    assert calls["rotate_write_every_row"] > calls["put_sum"] > 0, calls  # every layer; the dense layers' outputs
    with use_kernels(KernelPolicy(enabled=False)):
        plain, plain_decoder = decode(model, tokens, compact_rows=False, cuda_graph=False)
    torch.testing.assert_close(fast, plain, rtol=1e-4, atol=1e-4)
    for a, b in zip(fast_decoder.caches, plain_decoder.caches):
        assert torch.equal(a.lengths, b.lengths)
        torch.testing.assert_close(a.kv, b.kv, rtol=1e-4, atol=1e-4)


def test_compact_rows_are_checked_and_default_where_they_add_no_sync() -> None:
    mod, staged = make_model("mod"), make_model("mode_staged")
    assert not Decoder(mod, 2, 8, routed_rows="masked").compact_rows  # CPU, no graph: no sync added
    assert not Decoder(staged, 2, 8, routed_rows="masked").compact_rows  # nor the MoE FFN's static pass
    assert not Decoder(staged, 2, 8, routed_rows="gather").compact_rows
    with pytest.raises(ValueError, match="compact_rows"):
        Decoder(mod, 2, 8, routed_rows="gather", compact_rows=True)
    with pytest.raises(ValueError, match="compact_rows"):
        Decoder(mod, 2, 8, routed_rows="masked", compile=True, compact_rows=True)
    with pytest.raises(ValueError, match="row_slack"):
        Decoder(mod, 2, 8, routed_rows="masked", row_slack=0)


def test_compaction_pays_at_small_and_large_batches_only() -> None:
    """compact_rows=None turns compaction on up to COMPACT_MAX_SMALL_BATCH rows and from
    COMPACT_MIN_LARGE_BATCH, not in between (where the batch reads weights, not computes)."""
    assert 1 <= COMPACT_MAX_SMALL_BATCH < 64 < COMPACT_MIN_LARGE_BATCH <= 1024
    pays = [b for b in (1, 2, COMPACT_MAX_SMALL_BATCH, COMPACT_MAX_SMALL_BATCH + 1, 64, COMPACT_MIN_LARGE_BATCH - 1,
                        COMPACT_MIN_LARGE_BATCH, 1024) if compaction_pays(b)]
    assert pays == [1, 2, COMPACT_MAX_SMALL_BATCH, COMPACT_MIN_LARGE_BATCH, 1024]


# ----------------------------------------------------------------------------- GPU: IF nodes
needs_if_nodes = pytest.mark.skipif(
    not torch.cuda.is_available() or not if_nodes_available(), reason="CUDA graph conditional nodes need a GPU",
)


@needs_if_nodes
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("batch, bias", [(8, None), (8, -1e3), (8, 1e3), (1, None), (32, None), (32, -1e3), (32, 1e3)])
def test_if_nodes_replay_the_compacted_step(dtype: torch.dtype, batch: int, bias) -> None:
    """The captured step with IF nodes runs the kernels the eager compacted step runs (the host
    picking): identical logits and caches; float32 (SDPA, no flash): the masked step's logits.
    Batch 32 (8 rows expected to choose a layer, above SKIP_TEST_MAX_EXPECTED): its compacted pass
    runs every step, with no row chosen (-1e3) as padding only. Where the IF nodes take the
    decisions (graph_if.decides_in_condition, batches 1 and 8), the eager step runs their kernel."""
    model = forced_model("mod", bias).to("cuda", dtype)
    torch.manual_seed(5)
    tokens = torch.randint(0, 256, (batch, S), device="cuda")
    active = torch.ones(batch, dtype=torch.bool)
    active[0] = False
    runs = {}
    for name, kwargs in {"graph": {"cuda_graph": True, "compact_rows": True},
                         "eager": {"cuda_graph": False, "compact_rows": True},
                         "masked": {"cuda_graph": True, "compact_rows": False}}.items():
        runs[name] = decode(model, tokens, active if batch > 1 else None, row_slack=1.0, **kwargs)
    (graph, graphed), (eager, eager_decoder), (masked, _) = runs.values()
    assert graphed._graph is not None and graphed.compact_rows and eager_decoder._graph is None
    assert Decoder(model, 64, S).compact_rows is False  # the default between the batches where it pays
    assert Decoder(model, batch, S).compact_rows is compaction_pays(batch)
    assert (batch * 0.25 > SKIP_TEST_MAX_EXPECTED) == (batch == 32)
    assert torch.equal(graph, eager)
    for a, b in zip(graphed.caches, eager_decoder.caches):
        assert torch.equal(a.lengths, b.lengths) and torch.equal(a.kv[:, :, :-1], b.kv[:, :, :-1])
    if dtype == torch.float32:
        torch.testing.assert_close(graph, masked, rtol=0, atol=1e-4)


@pytest.mark.skipif(not torch.cuda.is_available() or not graph_if.decides_in_condition(),
                    reason="an IF node that takes the decision needs the built extension on a GPU")
@pytest.mark.parametrize("batch", [1, 8])
def test_a_captured_small_batch_leaves_each_routed_decision_to_its_if_node(batch: int, monkeypatch) -> None:
    """Captured with IF nodes at a small batch, a routed layer's decision is its IF node's condition
    kernel (one kernel, not two): decide_rows runs in the warm-up only, the logits and caches are
    the step's whose decisions run as kernels of their own (float32, within rounding), and the
    uncaptured step, which runs the same kernel without a node, decodes exactly as the graph."""
    from mode.kernels import decision

    model = forced_model("mod", None).to("cuda", torch.float32)
    routed = sum(isinstance(block, MoDBlock) for block in model.blocks)
    tokens = torch.randint(0, 256, (batch, S), generator=torch.Generator().manual_seed(7)).cuda()
    calls = counted_calls(monkeypatch, (graph_if, "captured_if_decided"), (decision, "decide_rows"),
                          (graph_if, "decide"))
    fused, fused_decoder = decode(model, tokens, cuda_graph=True, compact_rows=True)
    assert fused_decoder._graph is not None and fused_decoder.compact_rows
    warm = calls["decide_rows"]  # the warm-up passes before the capture
    assert calls["captured_if_decided"] == routed and warm % routed == 0 and calls["decide"] == 0, calls
    eager, _ = decode(model, tokens, cuda_graph=False, compact_rows=True)
    assert calls["decide"] == (S - PROMPT) * routed and calls["decide_rows"] == warm, calls  # a step each
    assert torch.equal(eager, fused)
    monkeypatch.setattr(StaticStep, "decision_in_if", lambda *args: None)
    apart, apart_decoder = decode(model, tokens, cuda_graph=True, compact_rows=True)
    assert calls["captured_if_decided"] == routed and calls["decide_rows"] == 2 * warm + routed, calls
    torch.testing.assert_close(fused, apart, rtol=0, atol=1e-5)
    for a, b in zip(fused_decoder.caches, apart_decoder.caches):
        assert torch.equal(a.lengths, b.lengths)
        torch.testing.assert_close(a.kv, b.kv, rtol=0, atol=1e-5)


def attend_rows(device: str, dtype: torch.dtype) -> tuple[Decoder, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A decoder's first cache filled at random, queries and used lengths for its 5 rows, rows 1, 3, 4."""
    model = make_model("mod", "aux_loss").to(device, dtype)
    decoder = Decoder(model, 5, 40, routed_rows="masked")
    decoder.caches[0].kv.normal_()
    q = torch.randn(5, 4, 8, device=device, dtype=dtype)
    used = torch.tensor([1, 7, 40, 16, 33], device=device)
    return decoder, q, used, torch.tensor([1, 3, 4], device=device)


def test_attention_over_some_rows_equals_those_rows_of_every_row() -> None:
    decoder, q, used, rows = attend_rows("cpu", torch.float64)
    cache, packed = decoder.caches[0], decoder._packed
    every = attend_used(q, cache, used, packed)
    some = attend_used(q.index_select(0, rows), cache, used.index_select(0, rows), packed, rows)
    torch.testing.assert_close(some, every.index_select(0, rows), rtol=0, atol=F64_TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="flash attention needs a GPU")
def test_flash_varlen_over_some_rows_equals_masked_sdpa() -> None:
    """The compacted rows' attention: flash over their regions of the packed cache (cu_k from the
    rows) == SDPA over their caches with a length mask."""
    decoder, q, used, rows = attend_rows("cuda", torch.bfloat16)
    cache, packed = decoder.caches[0], decoder._packed
    q, used = q.index_select(0, rows), used.index_select(0, rows)
    assert packed.flash
    flash = attend_used(q, cache, used, packed, rows)
    decoder._flash_varlen = False
    masked = attend_used(q, cache, used, packed, rows)
    # bf16 inputs, float32 accumulation in both (as test_generate's full-batch check)
    torch.testing.assert_close(flash, masked, rtol=0, atol=2e-2)


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["every head its cache", "grouped query heads"])
@pytest.mark.parametrize("some_rows", [False, True], ids=["every row", "some rows"])
def test_decode_attention_kernel_equals_masked_sdpa(some_rows: bool, kv_heads: int) -> None:
    """mode/kernels/decode_attention.py (Triton's interpreter on CPU) == SDPA over the rows' caches
    with a length mask; on a GPU with rows enough for it to run (else flash would)."""
    from mode.kernels import KernelPolicy, use_kernels
    from mode.kernels.decode_attention import decode_attention_applies
    from mode.layers.kv_cache import LayerCache, PackedRows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    batch, max_len, head_dim = (300 if device == "cuda" else 5), 150, 16
    gen = torch.Generator().manual_seed(kv_heads)
    cache = LayerCache.empty(batch, max_len, kv_heads, head_dim, dtype, torch.device(device))
    cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen))
    packed = PackedRows.build(batch, max_len, torch.device(device), dtype, head_dim)
    rows = torch.arange(1, batch, 2, device=device) if some_rows else None
    n = batch if rows is None else rows.numel()
    q = torch.randn(n, 4, head_dim, generator=gen).to(device, dtype)
    used = torch.randint(1, max_len + 2, (n,), generator=gen).to(device)
    used[0] = 1  # a row that reads only itself (its scratch slot, in a step)
    with use_kernels(KernelPolicy(cpu=True)):
        assert decode_attention_applies(q) or device == "cuda" and n * 4 < 4 * torch.cuda.get_device_properties(0).multi_processor_count
        fast = attend_used(q, cache, used, packed, rows)
    with use_kernels(KernelPolicy(decode_attention=False)):
        packed.flash = False
        masked = attend_used(q, cache, used, packed, rows)
    tol = dict(rtol=0, atol=2e-2) if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fast, masked, **tol)
