"""Mixture-of-Experts Hugging Face folders (Mixtral, Qwen2-MoE) in and out of mode's token choice,
and any mode model (MoD, Integrated MoDE) through the registered `mode` model type.

float32 on CPU, as tests/test_hf.py: the two sides differ by summation order only (~2e-6).
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

import mode.hf  # noqa: E402,F401  (registers model_type "mode")
from mode.config import load_config  # noqa: E402
from mode.generate import generate  # noqa: E402
from mode.hf import HFError, load_hf, save_hf  # noqa: E402
from mode.hf.__main__ import main as hf_main  # noqa: E402
from mode.model import LanguageModel  # noqa: E402
from tests.test_attention_variants import make_model  # noqa: E402
from tests.test_hf import (  # noqa: E402
    BASE,
    edited,
    hf_greedy,
    hf_logits,
    mode_logits,
    random_hf_model,
    saved,
    tokens,
)

TOL = 1e-5
QWEN_MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
CASES = {
    "mixtral": ("MixtralForCausalLM", transformers.MixtralConfig, dict(num_local_experts=4, num_experts_per_tok=2)),
    "mixtral_top1": ("MixtralForCausalLM", transformers.MixtralConfig, dict(num_local_experts=3, num_experts_per_tok=1)),
    "qwen2_moe": ("Qwen2MoeForCausalLM", transformers.Qwen2MoeConfig, dict(QWEN_MOE)),
    "qwen2_moe_norm_topk": ("Qwen2MoeForCausalLM", transformers.Qwen2MoeConfig, dict(QWEN_MOE, norm_topk_prob=True)),
    "qwen2_moe_mlp_only": ("Qwen2MoeForCausalLM", transformers.Qwen2MoeConfig, dict(QWEN_MOE, mlp_only_layers=[0, 2])),
    "qwen2_moe_sparse_step": ("Qwen2MoeForCausalLM", transformers.Qwen2MoeConfig,
                              dict(QWEN_MOE, decoder_sparse_step=2, norm_topk_prob=True)),
}
KINDS = {"mixtral": ["moe"], "mixtral_top1": ["moe"], "qwen2_moe": ["moe"], "qwen2_moe_norm_topk": ["moe"],
         "qwen2_moe_mlp_only": ["dense", "moe", "dense", "moe"], "qwen2_moe_sparse_step": ["dense", "moe", "dense", "moe"]}


def family(case: str) -> str:
    return "mixtral" if case.startswith("mixtral") else "qwen2_moe"


def hf_model(case: str, seed: int = 0, **overrides):
    """A random model of the case, every weight drawn (norms around 1)."""
    arch, config_class, extra = CASES[case]
    return random_hf_model(arch, config_class, {**BASE, **extra, **overrides}, seed)


# ----------------------------------------------------------------------------- import
@pytest.mark.parametrize("case", list(CASES))
def test_an_imported_moe_model_gives_the_hugging_face_logits(case: str, tmp_path: Path) -> None:
    hf = hf_model(case)
    config, model = load_hf(saved(hf, tmp_path / case))
    ids = tokens()
    assert (mode_logits(model, ids) - hf_logits(hf, ids)).abs().max() <= TOL
    m, moe = config.model, config.moe
    assert m.block_pattern == KINDS[case]
    assert moe.scheme == "token_choice" and moe.dropless and moe.n_noop == 0 and moe.z_loss_weight == 0.0
    assert moe.renormalize == (family(case) == "mixtral" or "norm_topk" in case or "sparse_step" in case)
    assert moe.top_k == CASES[case][2]["num_experts_per_tok"]
    assert moe.lb_loss_weight == hf.config.router_aux_loss_coef
    if family(case) == "qwen2_moe":
        assert (m.d_ff, moe.d_expert, moe.shared_expert_d, moe.shared_expert_gate, m.qkv_bias) == (128, 32, 48, True, True)
    else:
        assert moe.d_expert is None and moe.shared_expert_d is None and not m.qkv_bias


@pytest.mark.parametrize("case", ["mixtral", "qwen2_moe", "qwen2_moe_mlp_only"])
def test_greedy_decoding_of_an_moe_model_equals_transformers_generate(case: str, tmp_path: Path) -> None:
    hf = hf_model(case)
    _, model = load_hf(saved(hf, tmp_path / case))
    for prompt in (tokens(2, 1, 5)[0].tolist(), tokens(3, 1, 11)[0].tolist()):
        assert generate(model, [prompt], max_new_tokens=16, temperature=0.0) == [hf_greedy(hf, prompt, 16)]


def test_the_fused_expert_layout_reads_the_same(tmp_path: Path) -> None:
    """transformers' modules hold experts fused (gate_up_proj (E, 2F, D), down_proj (E, D, F));
    a folder holding them so reads as the per-expert one."""
    from safetensors.torch import save_file

    hf = hf_model("mixtral")
    folder = saved(hf, tmp_path / "per_expert")
    fused = tmp_path / "fused"
    fused.mkdir()
    (fused / "config.json").write_text((folder / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()}, fused / "model.safetensors", metadata={"format": "pt"})
    assert any(k.endswith("experts.gate_up_proj") for k in hf.state_dict())
    ids = tokens()
    assert (mode_logits(load_hf(fused)[1], ids) - mode_logits(load_hf(folder)[1], ids)).abs().max() == 0


# ----------------------------------------------------------------------------- export
@pytest.mark.parametrize("case", list(CASES))
def test_moe_import_export_from_pretrained_gives_the_same_logits(case: str, tmp_path: Path) -> None:
    hf = hf_model(case)
    config, model = load_hf(saved(hf, tmp_path / "in"))
    save_hf(model, config, tmp_path / "out", family=family(case))
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again).__name__ == CASES[case][0]
    ids = tokens()
    assert (hf_logits(again, ids) - hf_logits(hf, ids)).abs().max() <= TOL
    assert (hf_logits(again, ids) - mode_logits(model, ids)).abs().max() <= TOL


def test_a_mixtral_model_exports_as_qwen2_moe_with_a_shared_expert_adding_zero(tmp_path: Path) -> None:
    hf = hf_model("mixtral")
    config, model = load_hf(saved(hf, tmp_path / "in"))
    save_hf(model, config, tmp_path / "out", family="qwen2_moe")
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = tokens()
    assert (hf_logits(again, ids) - hf_logits(hf, ids)).abs().max() <= TOL


def test_export_refuses_what_an_moe_family_cannot_hold(tmp_path: Path) -> None:
    _, qwen = load_hf(saved(hf_model("qwen2_moe_mlp_only"), tmp_path / "qwen"))
    with pytest.raises(HFError, match="family mixtral has an MoE FFN in every layer; export as family qwen2_moe"):
        save_hf(qwen, None, tmp_path / "a", family="mixtral")
    with pytest.raises(HFError, match="family qwen2_moe holds moe and dense blocks only.*export as family mode"):
        save_hf(make_model(["dense", "mod"]).float(), None, tmp_path / "b", family="qwen2_moe")
    expert_choice = LanguageModel(load_config("configs/moe_tiny.yaml", ["--model.n_layers=2"]))
    with pytest.raises(HFError, match="moe.scheme 'expert_choice': family qwen2_moe computes moe.scheme 'token_choice'"):
        save_hf(expert_choice, None, tmp_path / "c", family="qwen2_moe")
    _, mixtral = load_hf(saved(hf_model("mixtral"), tmp_path / "mixtral"))
    with pytest.raises(HFError, match="only dense models export to family llama"):
        save_hf(mixtral, None, tmp_path / "d", family="llama")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mixtral", "qwen"]


@pytest.mark.parametrize("changes, message", [
    ({"router_jitter_noise": 0.1}, "router_jitter_noise 0.1 is not supported"),
    ({"sliding_window": 16}, "sliding_window 16 is in use"),
    ({"model_type": "deepseek_v3"},
     "model_type 'deepseek_v3' is not supported; supported: llama, mistral, qwen2, mixtral, qwen2_moe"),
])
def test_an_moe_config_mode_cannot_represent_is_one_line_naming_the_field(tmp_path: Path, changes: dict,
                                                                         message: str) -> None:
    folder = edited(saved(hf_model("mixtral"), tmp_path / "mixtral"), tmp_path / "bad", **changes)
    with pytest.raises(HFError) as info:
        load_hf(folder)
    text = str(info.value)
    assert message in text and "\n" not in text and "config.json" in text


# ----------------------------------------------------------------------------- the registered mode type
def routed_model(path: str, causal: str, tied: bool = False, seed: int = 0) -> LanguageModel:
    small = ["--model.n_layers=4", "--model.d_model=32", "--model.d_ff=64", "--model.max_seq_len=64",
             "--data.seq_len=64", f"--routing.causal={causal}", f"--model.tie_embeddings={str(tied).lower()}"]
    torch.manual_seed(seed)
    return LanguageModel(load_config(path, small)).eval()


ROUTED = {
    "mod_aux_loss": ("configs/mod_tiny.yaml", "aux_loss", False),
    "mod_predictor_tied": ("configs/mod_tiny.yaml", "predictor", True),
    "mode_integrated_predictor": ("configs/mode_integrated_tiny.yaml", "predictor", False),
    "mode_integrated_aux_loss_tied": ("configs/mode_integrated_tiny.yaml", "aux_loss", True),
}


@pytest.mark.parametrize("case", list(ROUTED))
def test_a_routed_model_loads_through_the_mode_type_with_its_causal_logits_and_loss(case: str, tmp_path: Path) -> None:
    model = routed_model(*ROUTED[case])
    ids = tokens(vocab=256, seq=48)
    save_hf(model, None, tmp_path / "hf", family="mode")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert type(loaded).__name__ == "ModeForCausalLM" and loaded.config.model_type == "mode"
    assert (loaded.model.lm_head.weight is loaded.model.embed.weight) == ROUTED[case][2]
    assert all(torch.equal(a, b) for a, b in zip(loaded.model.state_dict().values(), model.state_dict().values()))
    with torch.no_grad():
        out = loaded(ids, labels=ids)
        want = model(ids, routing_mode="causal").logits
        causal_loss = model(ids[:, :-1], ids[:, 1:], routing_mode="causal").lm_loss
        topk = model(ids, routing_mode="topk").logits
    assert torch.equal(out.logits, want)
    assert not torch.allclose(out.logits, topk)  # routed by the causal decision, not top-k
    assert abs(float(out.loss) - float(causal_loss)) <= 1e-5


def test_a_model_without_a_causal_decision_is_routed_by_top_k(tmp_path: Path) -> None:
    model = routed_model("configs/mod_tiny.yaml", "none")
    save_hf(model, None, tmp_path / "hf", family="mode")
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    ids = tokens(vocab=256, seq=48)
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, model(ids).logits)


def test_the_export_command_writes_the_mode_type(tmp_path: Path) -> None:
    """A run folder (checkpoint.pt) of a MoD model, exported with --family mode."""
    from mode.hf.convert import import_run

    hf = hf_model("mixtral", vocab_size=256)
    run = tmp_path / "run"
    import_run(saved(hf, tmp_path / "mixtral"), run)
    assert hf_main(["export", str(run), str(tmp_path / "out"), "--family", "mode"]) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["config.json", "model.safetensors"]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    ids = tokens(vocab=256)
    assert (hf_logits(loaded, ids) - hf_logits(hf, ids)).abs().max() <= TOL
