"""The static decode step with MoE FFN layers (Staged MoDE, MoE, Integrated MoDE): the experts run
with no host sync and no shape that depends on the routing (MoEFFN's static pass), so the step
can be captured as a CUDA graph.

- the static pass equals the causal experts it replaces, on random inputs: every expert on
  every row (float64) and the grouped GEMMs over device-side ends (float32, forced on CPU);
- decoding with the static step equals the full causal forward (F64_TOL as in test_generate.py);
- the whole static step reads nothing on the host and makes no data-dependent shape: it runs on
  fake tensors with every host read refused (the causal experts it replaces fail that check);
- on a GPU, the captured step equals the full forward and the eager step.
"""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode

from mode.config import MoEConfig, RoutingConfig, config_from_dict
from mode.generate import Decoder
from mode.layers.chunks import if_nodes_available
from mode.layers.moe import MoEFFN
from mode.model import LanguageModel
from tests.test_decode_rows import decode
from tests.test_generate import F64_TOL, PATTERNS, S, decoded_logits, make_model, spread_weights_

MOE_PATTERNS = [p for p, (_, extra) in PATTERNS.items() if "moe" in extra]
PROMPT = 5  # as test_decode_rows.decode

# MoE FFN variants the static pass covers: both schemes, no-op slots of every kind, a shared
# expert, renormalized and sigmoid gates.
FFN_CASES = {
    "expert_choice": dict(n_noop=2),
    "expert_choice_copy_constant": dict(n_noop=2, noop_kind=["copy", "constant"]),
    "top1": dict(scheme="token_choice", top_k=1, dropless=True),
    "top2_noop": dict(scheme="token_choice", top_k=2, n_noop=2),
    "top2_shared_renormalized": dict(scheme="token_choice", top_k=2, renormalize=True, shared_expert_d=24,
                                     shared_expert_gate=True),
    "top2_sigmoid_copy": dict(scheme="token_choice", top_k=2, n_noop=1, noop_kind="copy", score="sigmoid"),
}


def moe_ffn(case: str, dtype: torch.dtype) -> MoEFFN:
    torch.manual_seed(0)
    ffn = MoEFFN(16, 24, MoEConfig(n_experts=4, **FFN_CASES[case]), RoutingConfig(causal="aux_loss"))
    with torch.no_grad():  # weights of size ~1/sqrt(fan_in), so every expert's output is visible
        for p in ffn.parameters():
            p.normal_(0, 0.5 if p.dim() < 3 else p.shape[-2] ** -0.5)
    return ffn.to(dtype).eval()


# ----------------------------------------------------------------------------- the static pass
@pytest.mark.parametrize("grouped", [False, True])
@pytest.mark.parametrize("case", list(FFN_CASES))
@torch.no_grad()
def test_static_experts_equal_the_causal_experts(case: str, grouped: bool, monkeypatch) -> None:
    """MoEFFN(static=True) == MoEFFN(causal=True) with padding rows (valid False); grouped: the
    grouped GEMMs over device-side ends (torch._grouped_mm, float32 on CPU), else every expert on
    every row (float64)."""
    dtype = torch.float32 if grouped else torch.float64
    ffn = moe_ffn(case, dtype)
    ffn.experts.use_by_ends = grouped  # which static layout runs (the causal path stays host-planned on CPU)
    calls = []
    every_row = ffn.experts.every_row
    monkeypatch.setattr(ffn.experts, "every_row", lambda x: calls.append("every_row") or every_row(x))
    by_ends = ffn.experts.by_ends
    monkeypatch.setattr(ffn.experts, "by_ends", lambda *a, **k: calls.append("by_ends") or by_ends(*a, **k))
    x = torch.randn(3, 7, 16, dtype=dtype, generator=torch.Generator().manual_seed(1))
    valid = torch.rand(3, 7, generator=torch.Generator().manual_seed(2)) < 0.7
    for mask in (None, valid):
        ffn.experts.use_by_ends = False  # the reference: the causal path's computed rows only
        calls.clear()
        want, want_routing = ffn(x, mask, causal=True)
        assert "every_row" not in calls
        ffn.experts.use_by_ends = grouped
        calls.clear()
        got, routing = ffn(x, mask, static=True)
        assert calls == ["by_ends" if grouped else "every_row"]
        tol = dict(rtol=1e-5, atol=1e-5) if grouped else dict(rtol=1e-9, atol=1e-10)
        torch.testing.assert_close(got, want, **tol)
        assert got.abs().max() > 0.1  # the experts did something
        for name, value in want_routing.stats.items():
            torch.testing.assert_close(routing.stats[name], value, rtol=0, atol=0)


@pytest.mark.parametrize("case", list(FFN_CASES))
@torch.no_grad()
def test_a_pass_without_statistics_computes_the_same_and_reports_none(case: str) -> None:
    """with_stats=False (the cached passes': nothing reads a decode step's statistics) changes no
    output, causal or static, and leaves the routing's stats empty, the no-op slots' included."""
    ffn = moe_ffn(case, torch.float64)
    x = torch.randn(3, 7, 16, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    valid = torch.rand(3, 7, generator=torch.Generator().manual_seed(2)) < 0.7
    for kwargs in (dict(causal=True), dict(static=True)):
        want, want_routing = ffn(x, valid, **kwargs)
        got, routing = ffn(x, valid, with_stats=False, **kwargs)
        assert torch.equal(got, want) and want_routing.stats and routing.stats == {}


def test_the_cached_passes_compute_no_routing_statistics(monkeypatch) -> None:
    """Prefill and both decode steps of a Staged MoDE model never build statistics (each was a
    chain of small kernels in every routed layer of a step); a training forward still does."""
    import mode.routing.expert_router as expert_router

    built = []
    expert_stats = expert_router._expert_stats
    monkeypatch.setattr(expert_router, "_expert_stats", lambda *a: built.append(1) or expert_stats(*a))
    model = make_model("mode_staged_token_choice", "aux_loss", n_layers=2)
    tokens = torch.randint(0, 256, (3, S))
    for routed_rows in ("gather", "masked"):
        decoded_logits(model, tokens, PROMPT, routed_rows)
    assert built == []
    model(tokens)
    assert built


@torch.no_grad()
def test_padding_rows_get_no_expert() -> None:
    """A static pass's padding rows (valid False) get an exact zero update, as the causal path's."""
    ffn = moe_ffn("top2_noop", torch.float64)
    x = torch.randn(2, 6, 16, dtype=torch.float64)
    valid = torch.tensor([[True, False, True, True, False, True], [False] * 6])
    got, _ = ffn(x, valid, static=True)
    assert torch.equal(got[~valid], torch.zeros_like(got[~valid])) and got[valid].abs().sum() > 0


@pytest.mark.parametrize("case", ["expert_choice", "top2_noop"])
def test_static_experts_trace_as_one_graph(case: str) -> None:
    """The static pass reads nothing on the host: Dynamo traces it as one graph, both layouts (the
    grouped one in bf16, as torch._grouped_mm's meta function requires); the causal path it
    replaces breaks the graph. Dynamo tracing only: no kernels are generated."""
    for dtype, grouped in ((torch.float64, False), (torch.bfloat16, True)):
        ffn = moe_ffn(case, dtype)
        ffn.experts.use_by_ends = grouped
        x = torch.randn(4, 1, 16, dtype=dtype)
        torch._dynamo.reset()
        explained = torch._dynamo.explain(lambda t, ffn=ffn: ffn(t, static=True))(x)
        assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
        assert explained.graph_count == 1
    ffn = moe_ffn(case, torch.float64)  # the causal path, on CPU: its rows planned on the host
    torch._dynamo.reset()
    assert torch._dynamo.explain(lambda t: ffn(t, causal=True))(x.double()).graph_break_count > 0


# ----------------------------------------------------------------------------- decode == full forward
def staged_model(**moe) -> LanguageModel:
    """A 3-layer Staged MoDE model (the routed blocks' FFN an MoE with moe), float64."""
    torch.manual_seed(0)
    raw = {
        "model": {"d_model": 32, "n_heads": 4, "n_layers": 3, "d_ff": 64, "max_seq_len": 48,
                  "block_pattern": ["mode_staged", "dense"]},
        "routing": {"causal": "aux_loss", "capacity": 0.25, "router_bias": True},
        "data": {"seq_len": S},
        "moe": {"n_experts": 4, **moe},
    }
    return spread_weights_(LanguageModel(config_from_dict(raw)).double().eval())


def static_calls(model: LanguageModel, monkeypatch) -> list:
    """Each MoE FFN call's static flag, recorded."""
    seen, forward = [], MoEFFN.forward
    monkeypatch.setattr(MoEFFN, "forward", lambda self, x, valid=None, causal=False, static=False, with_stats=True, residual=None: (
        seen.append(static) or forward(self, x, valid, causal, static, with_stats, residual)))
    return seen


@pytest.mark.parametrize("compact_rows", [False, True])
@pytest.mark.parametrize("pattern", MOE_PATTERNS)
def test_static_decode_with_moe_ffns_equals_the_full_causal_forward(pattern: str, compact_rows: bool,
                                                                    monkeypatch) -> None:
    model = make_model(pattern, "aux_loss", n_layers=3)
    torch.manual_seed(6)
    tokens = torch.randint(0, 256, (4, S))
    full = model(tokens, routing_mode="causal").logits.float()[:, PROMPT - 1:]
    seen = static_calls(model, monkeypatch)
    active = torch.tensor([True, True, False, True])
    got, decoder = decode(model, tokens, compact_rows=compact_rows)
    assert decoder.routed_rows == "masked" and True in seen  # the static pass ran
    assert (got - full).abs().max() <= F64_TOL
    # a finished row: the others as when every row decodes (test_decode_rows.decode: from step 3 on)
    finished, _ = decode(model, tokens, active, compact_rows=compact_rows)
    assert (finished[active] - got[active]).abs().max() <= F64_TOL


@pytest.mark.parametrize("compact_rows", [False, True])
def test_a_static_step_gives_experts_only_the_kept_rows(compact_rows: bool, monkeypatch) -> None:
    """In a static step an MoE FFN's grouped experts compute the rows the step keeps and no other
    (every row, masked, or the compacted W): so they read only the experts those rows chose."""
    from mode.layers.experts import Experts

    model = make_model("mode_staged_token_choice", "aux_loss", n_layers=3).float()
    for module in model.modules():
        if isinstance(module, Experts):
            module.use_by_ends = True  # the GPU's grouped GEMMs over device-side ends, on CPU
    calls, forward, by_ends = [], MoEFFN.forward, Experts.by_ends

    def recorded_forward(self, x, valid=None, causal=False, static=False, with_stats=True, residual=None):
        if static:  # [rows kept x top-k, rows held], then by_ends' rows computed
            calls.append([int(valid.sum()) * self.router.top_k, x.shape[0]])
        return forward(self, x, valid, causal, static, with_stats, residual)

    def recorded_by_ends(self, xs, ends, *args, **kwargs):
        if calls and len(calls[-1]) == 2:  # a static pass's (the prefill's run by ends too)
            calls[-1].append(int(ends[-1]))
        return by_ends(self, xs, ends, *args, **kwargs)

    monkeypatch.setattr(MoEFFN, "forward", recorded_forward)
    monkeypatch.setattr(Experts, "by_ends", recorded_by_ends)
    torch.manual_seed(6)
    decode(model, torch.randint(0, 256, (6, S)), compact_rows=compact_rows)
    assert calls and all(computed == kept for kept, _, computed in calls)  # top-k rows of each kept row
    assert any(kept < rows * 2 for kept, rows, _ in calls)  # some step keeps fewer rows than it holds


@pytest.mark.parametrize("moe", [
    dict(scheme="token_choice", top_k=1, dropless=True),  # bench/decode.py's Staged MoDE
    dict(scheme="token_choice", top_k=2, n_noop=1, noop_kind="constant", shared_expert_d=16),
    dict(n_noop=1, noop_kind="copy"),
])
def test_staged_mode_variants_decode_as_the_full_forward(moe: dict) -> None:
    model = staged_model(**moe)
    torch.manual_seed(7)
    tokens = torch.randint(0, 256, (5, S))
    full = model(tokens, routing_mode="causal").logits.float()[:, PROMPT - 1:]
    for compact_rows in (False, True):
        got, _ = decode(model, tokens, compact_rows=compact_rows)
        assert (got - full).abs().max() <= F64_TOL


# ----------------------------------------------------------------------------- no host sync
class RefuseHostReads(TorchFunctionMode):
    """Fails any call that reads a tensor's value on the host (a device sync on a GPU)."""

    HOST_READS = frozenset({"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__", "nonzero",
                  "unique", "unique_consecutive", "masked_select", "repeat_interleave"})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        to_host = name == "to" and any(
            str(a) == "cpu" or isinstance(a, torch.device) and a.type == "cpu" for a in (*args[1:], *kwargs.values())
        )
        if name in self.HOST_READS or to_host:
            raise AssertionError(f"host read in the static step: {name}")
        return func(*args, **kwargs)


def run_static_step_checked(decoder: Decoder) -> torch.Tensor:
    """One static step of decoder (prefilled) on fake tensors (a data-dependent shape raises),
    with every host read refused."""
    decoder._enter_static()
    tokens, active = torch.tensor([1, 2, 3]), torch.tensor([True, False, True])
    with torch.no_grad(), FakeTensorMode(allow_non_fake_inputs=True), RefuseHostReads():
        return decoder._static_step(tokens, active)


@pytest.mark.parametrize("pattern", MOE_PATTERNS + ["mod"])
def test_the_static_step_reads_nothing_on_the_host(pattern: str) -> None:
    model = make_model(pattern, "aux_loss", n_layers=3)
    decoder = Decoder(model, 3, 16, routed_rows="masked", compact_rows=False)
    decoder.prefill([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    assert run_static_step_checked(decoder).shape == (3, 1, 32)


@pytest.mark.parametrize("pattern", ["mode_staged", "mode_staged_token_choice"])
def test_the_host_read_check_fails_the_causal_experts(pattern: str, monkeypatch) -> None:
    """The check above would fail if a host sync crept back: with the static pass switched off
    (the causal experts, which plan their rows on the host) it does."""
    model = make_model(pattern, "aux_loss", n_layers=3)
    decoder = Decoder(model, 3, 16, routed_rows="masked", compact_rows=False)
    decoder.prefill([[1, 2, 3], [4, 5], [6, 7, 8, 9]])
    forward = MoEFFN.forward
    monkeypatch.setattr(MoEFFN, "forward", lambda self, x, valid=None, causal=False, static=False, with_stats=True, residual=None: (
        forward(self, x, valid, causal or static, with_stats=with_stats, residual=residual)))
    with pytest.raises(Exception, match="host read|data-dependent|dynamic|DynamicOutputShape|DataDependent"):
        run_static_step_checked(decoder)


def test_decoder_policy_graphs_every_block_kind() -> None:
    """cuda_graph=True is refused only off a GPU or outside the static step (no longer for MoE FFNs);
    on CPU "auto" stays "gather" and compact rows stay off outside a graph."""
    staged = make_model("mode_staged")
    with pytest.raises(ValueError, match="cuda_graph=True needs a CUDA model and routed_rows='masked'"):
        Decoder(staged, 2, 8, routed_rows="masked", cuda_graph=True)
    assert Decoder(staged, 2, 8).routed_rows == "gather"
    assert not Decoder(staged, 2, 8, routed_rows="masked").compact_rows


# ----------------------------------------------------------------------------- GPU: the captured step
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("moe", [dict(scheme="token_choice", top_k=1, dropless=True), dict(n_noop=1)])
def test_cuda_graph_captures_the_staged_mode_step(dtype: torch.dtype, moe: dict) -> None:
    """Staged MoDE on a GPU, the static step captured as a CUDA graph (bf16: the grouped GEMMs over
    device offsets where the card has them; float32: every expert on every row), with the IF
    nodes where this torch has them: its logits equal the eager static step's exactly, and in
    float32 the full causal forward's; "auto" captures it at batch 1 where the experts read only
    the chosen weights; the eager step makes no synchronizing call."""
    model = staged_model(**moe).to("cuda", dtype)
    torch.manual_seed(8)
    batch = 6
    tokens = torch.randint(0, 256, (batch, S), device="cuda")
    graphed, graph_decoder = decode(model, tokens, cuda_graph=True)
    # a failed capture would fall back (a warning): first without the IF nodes, then without a graph
    assert graph_decoder._graph is not None and graph_decoder.compact_rows == if_nodes_available()
    eager, _ = decode(model, tokens, cuda_graph=False, compact_rows=graph_decoder.compact_rows)
    assert torch.equal(graphed, eager)
    if dtype == torch.float32:  # bf16 rounding may flip a decision near its threshold: graph == eager only
        full = model(tokens, routing_mode="causal").logits.float()[:, PROMPT - 1:]
        torch.testing.assert_close(graphed, full, rtol=0, atol=1e-3)
    ffn = next(m for m in model.modules() if isinstance(m, MoEFFN))
    if ffn.decode_reads_chosen_experts(model.embed.weight):
        assert Decoder(model, 1, S).cuda_graph  # "auto" at batch 1: the captured static step
    decoder = Decoder(model, batch, S, routed_rows="masked", cuda_graph=False, compact_rows=False)
    decoder.prefill(tokens[:, :PROMPT].tolist())
    decoder._enter_static()
    step_tokens, active = tokens[:, PROMPT], torch.ones(batch, dtype=torch.bool, device="cuda")
    decoder._static_step(step_tokens, active)  # warm: first calls may compile kernels
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        decoder._static_step(step_tokens, active)
    finally:
        torch.cuda.set_sync_debug_mode("default")
