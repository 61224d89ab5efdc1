"""FLOP accounting: the analytic counter against a direct count of the matmuls of one forward."""
from __future__ import annotations

import math

import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

import mode.layers.attention as attention_module
from mode.config import Config, config_from_dict
from mode.flops import block_flops, model_flops, router_flops, train_step_flops
from mode.model import LanguageModel
from mode.routing.primitives import capacity_to_k

# The analytic count and FlopCounterMode's count are sums of the same integers (k is an
# integer), so they agree to float64 rounding of the per-token average.
REL_TOL = 1e-9
# The explicit attention replaces the fused kernel: same result up to float32 rounding.
SDPA_ATOL = 1e-5


def _config(pattern: list[str], seq_len: int = 32, capacity: float = 0.125, n_layers: int = 4, **train) -> Config:
    return config_from_dict({
        "model": {"d_model": 64, "n_heads": 4, "n_layers": n_layers, "d_ff": 96, "max_seq_len": 64,
                  "vocab_size": 256, "block_pattern": pattern},
        "routing": {"capacity": capacity},
        "data": {"source": "stdlib", "seq_len": seq_len},
        "train": {"batch_size": 4, "progress": False, **train},
    })


def explicit_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """scaled_dot_product_attention the plain way: q k^T, mask, softmax, times v (full S x S)."""
    assert dropout_p == 0.0 and not enable_gqa
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    scores = (query @ key.transpose(-2, -1)) * scale  # (B, H, L, S)
    if is_causal:
        keep = torch.ones(scores.shape[-2], scores.shape[-1], dtype=torch.bool, device=scores.device).tril()
        scores = scores.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        scores = scores.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else scores + attn_mask
    return scores.softmax(-1) @ value


@pytest.mark.parametrize(
    "pattern, seq_len, capacity",
    [
        (["dense"], 32, 0.125),
        (["dense", "mod"], 32, 0.125),  # k = 4
        (["dense", "mod"], 48, 0.125),  # k = round(6.0) = 6
        (["mod"], 40, 0.3),  # k = round(12.0) = 12, every block routed
    ],
)
def test_counter_matches_direct_count(monkeypatch, pattern, seq_len, capacity) -> None:
    assert_counter_matches_direct_count(monkeypatch, _config(pattern, seq_len=seq_len, capacity=capacity), seq_len)


@pytest.mark.parametrize(
    "pattern, moe, causal",
    [
        (["dense", "moe"], {"n_experts": 4}, "none"),  # C = round(32 / 4) = 8 per expert
        (["mode_integrated"], {"n_experts": 4, "n_noop": 4}, "none"),  # no-op experts compute nothing
        (["mode_staged"], {"n_experts": 2, "n_noop": 1}, "none"),  # experts see only the k chosen tokens
        (["mod", "mode_integrated"], {"n_experts": 4, "n_noop": 2}, "predictor"),  # predictors counted
    ],
)
def test_counter_matches_direct_count_for_expert_choice(monkeypatch, pattern, moe, causal) -> None:
    """Expert choice has static shapes, so its analytic count is exact, no-op experts included."""
    raw = _config(["dense"], seq_len=32, capacity=0.25).to_dict()
    raw["model"]["block_pattern"] = pattern
    raw["moe"].update(moe, scheme="expert_choice")
    raw["routing"].update(causal=causal, predictor_hidden=16)
    assert_counter_matches_direct_count(monkeypatch, config_from_dict(raw), 32)


@pytest.mark.parametrize(
    "pattern, moe",
    [
        (["dense", "moe"], {"n_experts": 4, "top_k": 1, "capacity_factor": 1.25}),  # C = 1.25 * 128 / 4 = 40
        (["moe"], {"n_experts": 4, "top_k": 1, "capacity_factor": 0.5}),  # C = 16: half the tokens' worth
        (["moe"], {"n_experts": 4, "top_k": 2, "capacity_factor": 2.0}),  # C = 2 * 128 * 2 / 4 = T: at most T
        (["mode_integrated"], {"n_experts": 4, "n_noop": 4, "top_k": 2, "capacity_factor": 1.5}),  # C = 48
        (["mode_staged"], {"n_experts": 2, "n_noop": 2, "top_k": 1, "capacity_factor": 1.25}),  # T = 4 * 8, C = 10
        # C rounded up: a count of cf * T * top_k / slots would be short by the rounding.
        (["moe"], {"n_experts": 3, "top_k": 1, "capacity_factor": 1.0}),  # C = ceil(128 / 3) = 43
        (["mode_staged"], {"n_experts": 3, "top_k": 2, "capacity_factor": 1.25}),  # T = 32, C = ceil(26.67) = 27
        (["moe"], {"n_experts": 4, "top_k": 1, "capacity_factor": 0.01}),  # C = ceil(0.32): at least 1 row
    ],
)
def test_counter_matches_direct_count_for_token_choice_with_capacity(monkeypatch, pattern, moe) -> None:
    """Token choice with a capacity computes E * C padded rows (moe.backend torch), C rounded up
    from cf * T * top_k / slots over the micro-batch's T tokens (4 sequences of 32, or of the k
    chosen under Staged MoDE): the count scales with the capacity factor and rounds as the router."""
    raw = _config(["dense"], seq_len=32, capacity=0.25).to_dict()
    raw["model"]["block_pattern"] = pattern
    raw["moe"].update(moe, scheme="token_choice")
    assert_counter_matches_direct_count(monkeypatch, config_from_dict(raw), 32)


def assert_counter_matches_direct_count(monkeypatch, config: Config, seq_len: int,
                                       attention_calls: int | None = None) -> None:
    """mode.flops against torch's FlopCounterMode over a forward with explicit attention; the model's
    SDPA calls must number attention_calls (default: one a layer)."""
    model = LanguageModel(config).float().eval()
    tokens = torch.randint(0, 256, (4, seq_len))
    with torch.no_grad():
        reference = model(tokens).logits

    calls = []

    def counting_sdpa(*args, **kwargs):
        calls.append(1)
        return explicit_sdpa(*args, **kwargs)

    # attention.py calls F.scaled_dot_product_attention through `torch.nn.functional as F`.
    assert attention_module.F is torch.nn.functional
    monkeypatch.setattr(attention_module.F, "scaled_dot_product_attention", counting_sdpa)
    counter = FlopCounterMode(display=False)
    with torch.no_grad(), counter:
        logits = model(tokens).logits
    # every attention went through the explicit version
    assert len(calls) == (config.model.n_layers if attention_calls is None else attention_calls)
    torch.testing.assert_close(logits, reference, atol=SDPA_ATOL, rtol=0)

    counted = counter.get_total_flops()
    expected = model_flops(config, causal=False).forward_per_token * tokens.numel()
    assert counted == pytest.approx(expected, rel=REL_TOL), (counted, expected)


def test_causal_differs_by_exactly_the_attention_pairs() -> None:
    seq, capacity = 64, 0.125
    config = _config(["dense", "mod"], seq_len=seq, capacity=capacity)
    d, k = config.model.d_model, capacity_to_k(seq, capacity)
    full, causal = model_flops(config, causal=False), model_flops(config, causal=True)
    # Scores and values: 2 * 2D per (query, key) pair; causal keeps (S+1)/2 keys per query on average.
    dense_term = 4 * d * (seq - (seq + 1) / 2)
    mod_term = (k / seq) * 4 * d * (k - (k + 1) / 2)  # attention among the k chosen tokens
    for kind, f, c in zip(config.model.block_kinds(), full.per_block, causal.per_block):
        assert f - c == pytest.approx(dense_term if kind == "dense" else mod_term, rel=1e-12)
    assert full.lm_head == causal.lm_head
    assert full.forward_per_token - causal.forward_per_token == pytest.approx(2 * dense_term + 2 * mod_term, rel=1e-12)
    # model_flops defaults to the causal convention and to data.seq_len.
    assert model_flops(config).forward_per_token == causal.forward_per_token
    assert model_flops(config, seq_len=seq).forward_per_token == causal.forward_per_token


@pytest.mark.parametrize("causal", [True, False])
def test_mod_at_full_capacity_costs_dense_plus_router(causal: bool) -> None:
    config = _config(["mod"], seq_len=32, capacity=1.0)
    dense = block_flops("dense", config, 32, causal)
    assert block_flops("mod", config, 32, causal) == dense + router_flops(config.model.d_model, 1)
    assert router_flops(config.model.d_model, 1) == 2 * config.model.d_model


def test_train_step_flops_is_three_forwards_over_every_token() -> None:
    config = _config(["dense", "mod"], seq_len=32, grad_accum=3)
    forward = model_flops(config).forward_per_token
    tokens = 4 * 3 * 32  # batch x grad_accum x seq
    assert model_flops(config).train_per_token == 3 * forward
    assert train_step_flops(config) == pytest.approx(3 * forward * tokens, rel=1e-12)
    assert train_step_flops(config, world_size=2) == pytest.approx(2 * 3 * forward * tokens, rel=1e-12)


def test_mod_is_cheaper_than_dense_and_grows_with_capacity() -> None:
    dense = model_flops(_config(["dense"], seq_len=64)).forward_per_token
    ratios = [
        model_flops(_config(["dense", "mod"], seq_len=64, capacity=c)).forward_per_token / dense
        for c in (0.125, 0.25, 0.5, 1.0)
    ]
    assert ratios[0] < 1.0
    assert ratios == sorted(ratios) and len(set(ratios)) == 4
    assert ratios[-1] > 1.0  # at capacity 1 the routers are pure overhead


def test_hand_counted_example() -> None:
    """D=64, F=96, V=256, S=32, blocks [dense, mod] at capacity 0.125 (k=4), causal; counted by hand."""
    config = _config(["dense", "mod"], seq_len=32, capacity=0.125, n_layers=2)
    dense = 8 * 64 * 64 + 4 * 64 * (33 / 2) + 6 * 64 * 96  # q,k,v,o + scores/values + SwiGLU = 73856
    mod = 2 * 64 + (4 / 32) * (8 * 64 * 64 + 4 * 64 * (5 / 2) + 6 * 64 * 96)  # router + k/S of the block = 8912
    lm_head = 2 * 64 * 256
    report = model_flops(config)
    assert report.per_block == [dense, mod] == [73856, 8912]
    assert report.lm_head == lm_head
    assert report.forward_per_token == 115536


def test_causal_predictor_is_counted_and_aux_loss_is_free() -> None:
    """routing.causal=predictor adds its MLP (D -> hidden -> slots) per token a router sees."""
    base = {"model": {"d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 128, "max_seq_len": 64,
                      "block_pattern": ["mod", "mode_integrated"]},
            "moe": {"n_experts": 4, "n_noop": 4}, "data": {"seq_len": 64}}
    flops = {}
    for causal in ("none", "aux_loss", "predictor"):
        raw = {**base, "routing": {"causal": causal, "predictor_hidden": 16}}
        flops[causal] = model_flops(config_from_dict(raw)).per_block
    assert flops["aux_loss"] == flops["none"]
    d, h = 64, 16
    assert flops["predictor"][0] - flops["none"][0] == pytest.approx(2 * d * h + 2 * h * 1)
    assert flops["predictor"][1] - flops["none"][1] == pytest.approx(2 * d * h + 2 * h * 4)


@pytest.mark.parametrize(
    "pattern, moe",
    [
        (["dense", "moe"], {"scheme": "expert_choice", "n_experts": 4, "shared_expert_d": 40}),
        (["moe"], {"scheme": "token_choice", "n_experts": 4, "top_k": 2, "shared_expert_d": 40,
                   "shared_expert_gate": True, "renormalize": True}),
        (["mode_staged"], {"scheme": "expert_choice", "n_experts": 2, "n_noop": 1, "shared_expert_d": 24,
                           "shared_expert_gate": True}),  # the shared expert sees the k chosen tokens only
    ],
)
def test_counter_matches_direct_count_with_a_shared_expert(monkeypatch, pattern, moe) -> None:
    """A shared expert (and its gate) runs on every token the MoE sees: static shapes, an exact count."""
    raw = _config(["dense"], seq_len=32, capacity=0.25).to_dict()
    raw["model"]["block_pattern"] = pattern
    raw["moe"].update(moe)
    assert_counter_matches_direct_count(monkeypatch, config_from_dict(raw), 32)


def test_shared_expert_hand_count() -> None:
    """D=64, a shared SwiGLU expert of width 40: 6 * 64 * 40 = 15360 FLOPs a token, its gate 2 * 64 = 128
    more; under Staged MoDE at capacity 0.25 only k / S = 1/4 of the tokens reach it."""
    def per_block(pattern: list[str], **moe) -> list[float]:
        raw = _config(["dense"], seq_len=32, capacity=0.25, n_layers=1).to_dict()
        raw["model"]["block_pattern"] = pattern
        raw["moe"].update(n_experts=4, n_noop=1, **moe)
        return model_flops(config_from_dict(raw)).per_block

    for kind, share in (("moe", 1.0), ("mode_integrated", 1.0), ("mode_staged", 0.25)):
        plain = per_block([kind])[0]
        assert per_block([kind], shared_expert_d=40)[0] - plain == pytest.approx(share * 15360, rel=1e-12)
        gated = per_block([kind], shared_expert_d=40, shared_expert_gate=True)[0]
        assert gated - plain == pytest.approx(share * (15360 + 128), rel=1e-12)
    assert per_block(["moe"], scheme="token_choice", top_k=2, renormalize=True) == per_block(["moe"], scheme="token_choice", top_k=2)
