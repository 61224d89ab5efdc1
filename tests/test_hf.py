"""Hugging Face folders in and out (mode.hf): tiny random Llama, Mistral and Qwen2 models, saved
by save_pretrained as a downloaded model is, imported into mode and exported back.

float32 on CPU. The two sides compute the same operations in another order (fused q/k/v,
rotary tables in float64 here, float32 there): logits agree to ~2e-7, well inside 1e-5.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from mode.checkpoint import build_model, load_model  # noqa: E402
from mode.config import load_config  # noqa: E402
from mode.evaluate import evaluate_checkpoint  # noqa: E402
from mode.generate import generate  # noqa: E402
from mode.generate import main as generate_main  # noqa: E402
from mode.hf import HFError, load_hf, save_hf  # noqa: E402
from mode.hf.__main__ import main as hf_main  # noqa: E402
from mode.model import LanguageModel  # noqa: E402
from tests.test_attention_variants import make_model  # noqa: E402

TOL = 1e-5
BASE = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            vocab_size=128, max_position_embeddings=64)
CASES = {
    "llama": ("LlamaForCausalLM", transformers.LlamaConfig, {}),
    "llama_rope_llama3": ("LlamaForCausalLM", transformers.LlamaConfig, {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32}}),
    "llama_tied": ("LlamaForCausalLM", transformers.LlamaConfig, {"tie_word_embeddings": True}),
    "llama_head_dim": ("LlamaForCausalLM", transformers.LlamaConfig, {"head_dim": 24}),
    # a window at least as long as the context never binds: the model is exact
    "mistral": ("MistralForCausalLM", transformers.MistralConfig, {"sliding_window": 64}),
    "qwen2": ("Qwen2ForCausalLM", transformers.Qwen2Config, {}),
}
FAMILY = {"llama": "llama", "llama_rope_llama3": "llama", "llama_tied": "llama", "llama_head_dim": "llama",
          "mistral": "mistral", "qwen2": "qwen2"}


def hf_model(case: str, seed: int = 0, **overrides):
    """A random model of the case, every weight drawn (biases and norms too, which init leaves at 0 / 1)."""
    arch, config_class, extra = CASES[case]
    return random_hf_model(arch, config_class, {**BASE, **extra, **overrides}, seed)


def random_hf_model(arch: str, config_class, fields: dict, seed: int = 0):
    """transformers' `arch` of config_class(**fields), every weight drawn from the seed: norms
    around 1, everything else around 0 (biases too)."""
    torch.manual_seed(seed)
    model = getattr(transformers, arch)(config_class(**fields)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.1 * torch.randn_like(p))
    model.generation_config.eos_token_id = None  # random models: decode every step, as mode.generate
    model.generation_config.pad_token_id = 0
    return model


def saved(model, folder: Path, **kwargs) -> Path:
    model.save_pretrained(folder, **kwargs)
    return folder


@pytest.fixture(scope="module")
def llama_folder(tmp_path_factory) -> Path:
    return saved(hf_model("llama"), tmp_path_factory.mktemp("hf") / "llama")


def tokens(seed: int = 1, batch: int = 2, seq: int = 40, vocab: int = 128) -> torch.Tensor:
    return torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))


def hf_logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


def hf_greedy(model, prompt: list[int], new: int) -> list[int]:
    """transformers' greedy generate: the new tokens. The attention mask is given: left to itself,
    generate would mask every prompt token equal to the pad id."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, do_sample=False)
    return out[0, len(prompt):].tolist()


def mode_logits(model: LanguageModel, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(ids).logits


# ----------------------------------------------------------------------------- import
@pytest.mark.parametrize("case", list(CASES))
def test_an_imported_model_gives_the_hugging_face_logits(case: str, tmp_path: Path) -> None:
    hf = hf_model(case)
    config, model = load_hf(saved(hf, tmp_path / case))
    ids = tokens()
    assert (mode_logits(model, ids) - hf_logits(hf, ids)).abs().max() <= TOL
    m = config.model
    assert m.kv_heads == 2 and m.qkv_bias == (case == "qwen2") and m.tie_embeddings == (case == "llama_tied")
    assert m.head_width == (24 if case == "llama_head_dim" else 16)
    assert (m.rope_scaling is not None) == (case == "llama_rope_llama3")
    if case == "llama_tied":
        assert model.lm_head.weight is model.embed.weight


@pytest.mark.parametrize("case", list(CASES))
def test_greedy_decoding_equals_transformers_generate(case: str, tmp_path: Path) -> None:
    hf = hf_model(case)
    _, model = load_hf(saved(hf, tmp_path / case))
    for prompt in (tokens(2, 1, 5)[0].tolist(), tokens(3, 1, 11)[0].tolist()):
        with torch.no_grad():
            want = hf_greedy(hf, prompt, 16)
        assert generate(model, [prompt], max_new_tokens=16, temperature=0.0) == [want]


def test_a_sharded_folder_is_read_through_its_index(tmp_path: Path) -> None:
    hf = hf_model("llama")
    folder = saved(hf, tmp_path / "sharded", max_shard_size="100KB")
    assert (folder / "model.safetensors.index.json").is_file() and not (folder / "model.safetensors").exists()
    _, model = load_hf(folder)
    ids = tokens()
    assert (mode_logits(model, ids) - hf_logits(hf, ids)).abs().max() <= TOL


def test_a_sliding_window_shorter_than_the_context_imports_with_a_context_that_fits(tmp_path: Path) -> None:
    hf = hf_model("mistral", sliding_window=16)
    folder = saved(hf, tmp_path / "window")
    with pytest.raises(HFError, match="sliding_window 16 is in use.*max_seq_len <= 16"):
        load_hf(folder)
    config, model = load_hf(folder, max_seq_len=16)
    assert config.model.max_seq_len == 16
    ids = tokens(seq=16)
    assert (mode_logits(model, ids) - hf_logits(hf, ids)).abs().max() <= TOL


# ----------------------------------------------------------------------------- export
@pytest.mark.parametrize("case", list(CASES))
def test_import_export_from_pretrained_gives_the_same_logits(case: str, tmp_path: Path) -> None:
    hf = hf_model(case)
    config, model = load_hf(saved(hf, tmp_path / "in"))
    save_hf(model, config, tmp_path / "out", family=FAMILY[case])
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(again).__name__ == CASES[case][0]
    ids = tokens()
    assert (hf_logits(again, ids) - hf_logits(hf, ids)).abs().max() <= TOL
    assert (hf_logits(again, ids) - mode_logits(model, ids)).abs().max() <= TOL


@pytest.mark.parametrize("family", ["llama", "mistral", "qwen2"])
def test_a_model_trained_in_mode_exports_to_each_family(family: str, tmp_path: Path) -> None:
    variant = {"n_kv_heads": 2, "head_dim": 12, "rope_scaling": {"factor": 4.0, "original_max_seq_len": 64}}
    model = make_model(**variant).float()
    save_hf(model, None, tmp_path / family, family=family)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / family).eval()
    ids = tokens(vocab=256, seq=32)
    assert (hf_logits(again, ids) - mode_logits(model, ids)).abs().max() <= TOL
    if family == "qwen2":  # qwen2 always has q/k/v biases: zero ones, computing the same
        assert all(p.abs().max() == 0 for n, p in again.named_parameters() if n.endswith("proj.bias"))


# ----------------------------------------------------------------------------- run folders and the command line
def test_the_command_line_imports_a_run_that_generate_evaluate_and_init_from_use(tmp_path: Path, capsys) -> None:
    hf = hf_model("llama", vocab_size=256)  # byte ids: the run's default data (the stdlib's bytes) fits
    folder, run = saved(hf, tmp_path / "hf"), tmp_path / "run"
    assert hf_main(["import", str(folder), str(run)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf", "run"]  # no temporary left beside
    assert sorted(p.name for p in run.iterdir()) == ["checkpoint.pt", "config.yaml"]
    ids = tokens(vocab=256)
    model = load_model(run)
    assert (mode_logits(model, ids) - hf_logits(hf, ids)).abs().max() <= TOL
    # generate: greedy ids from the run folder equal transformers'
    prompt = ids[0, :6].tolist()
    capsys.readouterr()
    assert generate_main(["--checkpoint", str(run), "--prompt-ids", " ".join(map(str, prompt)), "--greedy",
                          "--max-new-tokens", "8", "--device", "cpu"]) == 0
    printed = [int(t) for t in capsys.readouterr().out.split()]
    with torch.no_grad():
        want = prompt + hf_greedy(hf, prompt, 8)
    assert printed == want
    # train --train.init_from: the run's config.yaml describes the model the checkpoint holds
    config = load_config(run / "config.yaml", [f"--train.init_from={run}", f"--train.out_dir={tmp_path / 'tuned'}"])
    tuned = build_model(config, "cpu")
    assert all(torch.equal(a, b) for a, b in zip(tuned.state_dict().values(), model.state_dict().values()))
    # evaluate
    result = evaluate_checkpoint(run, batches=1, device="cpu")
    assert result["step"] == 0 and torch.isfinite(torch.tensor(result["val_loss"]))
    # and out again
    assert hf_main(["export", str(run), str(tmp_path / "out"), "--family", "llama"]) == 0
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert (hf_logits(again, ids) - hf_logits(hf, ids)).abs().max() <= TOL


# ----------------------------------------------------------------------------- bad input
def edited(source: Path, target: Path, **changes) -> Path:
    """A copy of a Hugging Face folder with config.json fields changed (None: removed)."""
    shutil.copytree(source, target)
    path = target / "config.json"
    raw = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            raw.pop(key, None)
        else:
            raw[key] = value
    path.write_text(json.dumps(raw))
    return target


@pytest.mark.parametrize("changes, message", [
    ({"model_type": "gpt2"}, "model_type 'gpt2' is not supported; supported: llama, mistral, qwen2, mixtral, qwen2_moe"),
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"mlp_bias": True}, "mlp_bias true is not supported"),
    ({"attention_bias": True}, "attention_bias true is not supported"),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0}},
     "rope_scaling type 'yarn' is not supported"),
    ({"rope_parameters": None, "rope_theta": 5e5, "rope_scaling": {"type": "dynamic", "factor": 2.0}},
     "rope_scaling type 'dynamic' is not supported"),
    ({"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}},
     "partial_rotary_factor 0.5 is not supported"),
    ({"hidden_size": None}, "lacks hidden_size"),
])
def test_a_config_mode_cannot_represent_is_one_line_naming_the_field(llama_folder: Path, tmp_path: Path,
                                                                     changes: dict, message: str) -> None:
    folder = edited(llama_folder, tmp_path / "bad", **changes)
    with pytest.raises(HFError) as info:
        load_hf(folder)
    text = str(info.value)
    assert message in text and "\n" not in text and "config.json" in text


def test_a_qwen2_model_with_sliding_layers_is_refused(tmp_path: Path) -> None:
    hf = hf_model("qwen2", use_sliding_window=True, sliding_window=8, max_window_layers=2)
    with pytest.raises(HFError, match="sliding_window 8 is in use"):
        load_hf(saved(hf, tmp_path / "qwen"))


def test_a_folder_that_is_not_a_hugging_face_model_names_the_file(llama_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(HFError, match=r"config.json: not found"):
        load_hf(tmp_path)
    with pytest.raises(HFError, match="not a folder"):
        load_hf(tmp_path / "nowhere")
    no_weights = tmp_path / "no_weights"
    no_weights.mkdir()
    shutil.copy(llama_folder / "config.json", no_weights)
    with pytest.raises(HFError, match=r"model.safetensors: not found"):
        load_hf(no_weights)
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "config.json").write_text("{not json")
    with pytest.raises(HFError, match=r"config.json: not a JSON config"):
        load_hf(tmp_path / "broken")


def test_weights_mode_has_no_place_for_are_named(llama_folder: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    folder = edited(llama_folder, tmp_path / "extra")
    state = load_file(folder / "model.safetensors")
    state["model.layers.0.self_attn.q_norm.weight"] = torch.ones(16)
    save_file(state, folder / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(HFError, match="holds weights mode has no place for: model.layers.0.self_attn.q_norm.weight"):
        load_hf(folder)


def test_the_import_command_reports_one_line_and_writes_nothing(llama_folder: Path, tmp_path: Path, capsys) -> None:
    bad = edited(llama_folder, tmp_path / "bad", hidden_act="relu")
    run = tmp_path / "run"
    assert hf_main(["import", str(bad), str(run)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and "hidden_act 'relu'" in err and err.count("\n") == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad"]  # no run folder, no temporary
    # an existing run is never written over
    assert hf_main(["import", str(llama_folder), str(run)]) == 0
    assert hf_main(["import", str(llama_folder), str(run)]) == 2
    assert "exists and is not an empty folder (it holds checkpoint.pt, config.yaml)" in capsys.readouterr().err


def test_export_refuses_what_no_family_holds(tmp_path: Path) -> None:
    with pytest.raises(HFError, match=r"only dense models export"):
        save_hf(make_model(["dense", "mod"]).float(), None, tmp_path / "mod")
    with pytest.raises(HFError, match="model.qkv_bias true: family llama has no q/k/v biases; export as family qwen2"):
        save_hf(make_model(qkv_bias=True).float(), None, tmp_path / "bias", family="llama")
    with pytest.raises(HFError, match="family 'gpt2' is not supported; supported: llama, mistral, qwen2, mixtral, qwen2_moe, mode$"):
        save_hf(make_model().float(), None, tmp_path / "gpt2", family="gpt2")
    assert list(tmp_path.iterdir()) == []
