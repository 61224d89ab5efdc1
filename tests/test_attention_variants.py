"""The attention variants of Llama / Mistral / Qwen2 in the one block forward: grouped-query
attention (model.n_kv_heads), a head width of its own (model.head_dim), q/k/v biases
(model.qkv_bias) and Llama-3 rotary scaling (model.rope_scaling); and today's models unchanged.

tests/data/legacy_mod_checkpoint.pt is the checkpoint.pt of a 3-step `mode.train` run (configs/
mod_tiny.yaml with model.d_model=8, n_heads=2, n_layers=2, d_ff=16, max_seq_len=32,
data.seq_len=32, routing.causal=aux_loss, routing.capacity=0.5, train.batch_size=2, on CPU),
written by the code before these fields existed; tests/data/legacy_mod_expected.pt holds what
that code computed from it: logits of both routing modes on fixed tokens, and greedy samples.
"""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mode.checkpoint import load_model
from mode.config import ConfigError, config_from_dict
from mode.flops import attention_flops
from mode.generate import Decoder, generate
from mode.layers.rotary import RotaryEmbedding, inverse_frequencies
from mode.model import LanguageModel
from tests.test_generate import F64_TOL, decoded_logits, spread_weights_

DATA = Path(__file__).parent / "data"
S = 16


def test_a_checkpoint_of_today_loads_and_computes_what_it_computed() -> None:
    model = load_model(DATA / "legacy_mod_checkpoint.pt")
    expected = torch.load(DATA / "legacy_mod_expected.pt", weights_only=True)
    cfg = model.config.model
    assert (cfg.n_kv_heads, cfg.head_dim, cfg.qkv_bias, cfg.rope_scaling) == (None, None, False, None)
    tokens = expected["tokens"]
    with torch.no_grad():
        # float32 on CPU: processors' BLAS kernels differ in summation order (1.5e-8 apart seen on
        # logits of 0.2); a checkpoint read wrongly is off by far more
        close = dict(rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(model(tokens).logits, expected["logits_topk"], **close)
        torch.testing.assert_close(model(tokens, routing_mode="causal").logits, expected["logits_causal"], **close)
    prompts = [tokens[0, :5].tolist(), tokens[1, :9].tolist()]
    assert generate(model, prompts, max_new_tokens=8, temperature=0.0) == expected["greedy"].tolist()


def make_config(block_pattern: list[str] | None = None, **model):
    raw = {
        "model": {"d_model": 32, "n_heads": 4, "n_layers": 2, "d_ff": 64, "max_seq_len": 48,
                  "block_pattern": block_pattern or ["dense"], **model},
        "routing": {"causal": "aux_loss", "capacity": 0.25},
        "data": {"seq_len": S},
    }
    return config_from_dict(raw)


def make_model(block_pattern: list[str] | None = None, seed: int = 0, **model) -> LanguageModel:
    """float64, weights of size ~1/sqrt(fan_in) (so every layer moves the output), biases nonzero."""
    torch.manual_seed(seed)
    return spread_weights_(LanguageModel(make_config(block_pattern, **model)).double().eval())


VARIANTS = {
    "gqa": {"n_kv_heads": 2},
    "mqa_head_dim": {"n_kv_heads": 1, "head_dim": 12},
    "gqa_bias_scaled": {"n_kv_heads": 2, "qkv_bias": True, "head_dim": 16,
                        "rope_scaling": {"factor": 4.0, "original_max_seq_len": 64}},
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_the_fused_projection_and_the_cache_are_sized_by_the_key_value_heads(variant: str) -> None:
    model = make_model(**VARIANTS[variant])
    cfg = model.config.model
    attn = model.blocks[0].attn
    assert attn.qkv.weight.shape == ((cfg.n_heads + 2 * cfg.kv_heads) * cfg.head_width, cfg.d_model)
    assert attn.out.weight.shape == (cfg.d_model, cfg.n_heads * cfg.head_width)
    assert (attn.qkv.bias is not None) == cfg.qkv_bias
    decoder = Decoder(model, 2, S)
    assert decoder.caches[0].kv.shape == (2, 2, S + 1, cfg.kv_heads, cfg.head_width)


def _as_full_heads(gqa: LanguageModel) -> LanguageModel:
    """The multi-head model (n_kv_heads = n_heads) that computes what gqa computes: each key and
    value head copied to the query heads of its group."""
    cfg = gqa.config.model
    full = make_model(**{**VARIANTS["gqa"], "n_kv_heads": None})
    heads, kv_heads, hd = cfg.n_heads, cfg.kv_heads, cfg.head_width
    state = {}
    for name, t in gqa.state_dict().items():
        if name.endswith("attn.qkv.weight"):
            q, k, v = t.split((heads * hd, kv_heads * hd, kv_heads * hd))
            k, v = (w.view(kv_heads, hd, -1).repeat_interleave(heads // kv_heads, 0).reshape(heads * hd, -1) for w in (k, v))
            t = torch.cat((q, k, v))
        state[name] = t
    full.load_state_dict(state)
    return full


def test_grouped_query_attention_shares_each_key_value_head_with_its_group() -> None:
    gqa = make_model(**VARIANTS["gqa"])
    full = _as_full_heads(gqa)
    tokens = torch.randint(0, 256, (2, S))
    with torch.no_grad():
        want, got = full(tokens).logits, gqa(tokens).logits
    assert (got - want).abs().max() <= 1e-12


@pytest.mark.parametrize("routed_rows", ["gather", "masked"])
@pytest.mark.parametrize("pattern", [["dense"], ["dense", "mod"]])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_cached_decode_matches_the_causal_forward(variant: str, pattern: list[str], routed_rows: str) -> None:
    model = make_model(pattern, n_layers=3, **VARIANTS[variant])
    tokens = torch.randint(0, 256, (2, S))
    with torch.no_grad():
        full = model(tokens, routing_mode="causal").logits.float()  # (B, S, V)
    prompt = 5
    got = decoded_logits(model, tokens, prompt, routed_rows)  # positions prompt-1 .. S-1
    assert (got - full[:, prompt - 1:]).abs().max() <= F64_TOL


def test_padded_prompts_of_a_grouped_model_equal_the_prompts_one_by_one() -> None:
    model = make_model(["dense", "mod"], n_layers=3, **VARIANTS["gqa_bias_scaled"])
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 9, 6)]
    together = generate(model, prompts, max_new_tokens=6, temperature=0)
    apart = [generate(model, [p], max_new_tokens=6, temperature=0)[0] for p in prompts]
    assert together == apart


def test_llama3_scaling_stretches_long_wavelengths_keeps_short_ones_and_blends_between() -> None:
    cfg = make_config(**VARIANTS["gqa_bias_scaled"]).model
    scaling, hd = cfg.rope_scaling, cfg.head_width
    plain = inverse_frequencies(hd, cfg.rope_base)
    scaled = inverse_frequencies(hd, cfg.rope_base, scaling)
    wavelength = 2 * math.pi / plain
    long = wavelength > scaling.original_max_seq_len / scaling.low_freq_factor
    short = wavelength < scaling.original_max_seq_len / scaling.high_freq_factor
    middle = ~long & ~short
    assert long.any() and short.any() and middle.any()  # the test sees all three bands
    assert torch.equal(scaled[short], plain[short])
    assert torch.allclose(scaled[long], plain[long] / scaling.factor, rtol=1e-15)
    assert ((scaled[middle] < plain[middle]) & (scaled[middle] > plain[middle] / scaling.factor)).all()
    # and the model's tables are built from the scaled frequencies
    rotary = RotaryEmbedding(hd, cfg.max_seq_len, cfg.rope_base, scaling)
    angles = torch.outer(torch.arange(cfg.max_seq_len, dtype=torch.float64), scaled)
    assert torch.equal(rotary.cos, angles.cos().float())


def test_llama3_scaling_is_the_one_transformers_computes() -> None:
    transformers = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = transformers.LlamaConfig(hidden_size=64, num_attention_heads=2, max_position_embeddings=256, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    })
    want, _ = ROPE_INIT_FUNCTIONS["llama3"](hf, "cpu")
    cfg = make_config(d_model=64, n_heads=2, rope_base=500000.0, rope_scaling={"original_max_seq_len": 64}).model
    got = inverse_frequencies(cfg.head_width, cfg.rope_base, cfg.rope_scaling)
    assert torch.allclose(got.float(), want, rtol=1e-6, atol=0)


def test_default_tables_are_unchanged_by_the_scaling_option() -> None:
    hd, base = 8, 10000.0
    want = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    assert torch.equal(inverse_frequencies(hd, base), want)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_attention_flops_count_the_projections_the_model_holds(variant: str) -> None:
    model = make_model(**VARIANTS[variant])
    cfg = model.config.model
    attn = model.blocks[0].attn
    projections = 2 * (attn.qkv.weight.numel() + attn.out.weight.numel())
    # scores and values: each query head scores head_width-wide keys and weighs as wide values
    pairs = 10.0
    want = projections + 2 * 2 * cfg.n_heads * cfg.head_width * pairs
    assert attention_flops(cfg, 19, causal=True) == pytest.approx(want)
    # the default model's count is the one of plain multi-head attention
    plain = make_config().model
    d = plain.d_model
    assert attention_flops(plain, 19, causal=True) == 2 * d * 3 * d + 2 * d * d + 2 * 2 * d * pairs


def test_tied_embeddings_share_one_tensor_through_a_save_and_load() -> None:
    model = make_model(tie_embeddings=True)
    assert model.lm_head.weight is model.embed.weight
    again = LanguageModel(model.config).double()
    again.load_state_dict(model.state_dict())
    assert again.lm_head.weight is again.embed.weight and torch.equal(again.lm_head.weight, model.embed.weight)


@pytest.mark.parametrize("model, field", [
    ({"n_kv_heads": 3}, "n_kv_heads (3) must divide n_heads (4)"),
    ({"head_dim": 7}, "head_dim (7) must be even"),
    ({"n_kv_heads": 0}, "model.n_kv_heads"),
    ({"rope_scaling": {"low_freq_factor": 4.0, "high_freq_factor": 2.0}}, "high_freq_factor (2.0) must exceed"),
    ({"rope_scaling": {"factr": 4.0}}, "model.rope_scaling.factr: unknown key"),
])
def test_bad_attention_fields_name_themselves(model: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field.replace("(", r"\(").replace(")", r"\)")):
        make_config(**model)


def test_an_independent_head_width_lifts_the_divisibility_rule() -> None:
    cfg = make_config(d_model=30, n_heads=4, head_dim=8).model
    assert cfg.head_width == 8 and cfg.kv_heads == 4
    with pytest.raises(ConfigError, match="divisible by n_heads"):
        make_config(d_model=30, n_heads=4)
