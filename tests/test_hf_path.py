"""The path docs/huggingface.md walks, end to end at tiny size on CPU, through the commands' main()
functions and the configs it names: a stand-in Llama with a tokenizer -> python -m mode.hf import
-> python -m mode.data prepare --tokenizer -> python -m mode.train --config configs/hf_router_tune.yaml
(MoD conversion with a capacity schedule, routers trained alone) -> python -m mode.evaluate ->
python -m mode.generate -> python -m mode.hf export --family mode -> from_pretrained.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import mode.hf  # noqa: E402,F401  (registers model_type "mode")
from mode.checkpoint import build_model, load_model  # noqa: E402
from mode.config import load_config  # noqa: E402
from mode.data.prepare import main as data_main  # noqa: E402
from mode.evaluate import main as evaluate_main  # noqa: E402
from mode.generate import main as generate_main  # noqa: E402
from mode.hf.__main__ import main as hf_main  # noqa: E402
from mode.train import main as train_main  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
CONFIG = ROOT / "configs" / "hf_router_tune.yaml"
TEXT = ["--source", "stdlib", "--max-bytes", "200000"]


def stand_in_llama(folder: Path, tokenizer: Path) -> None:
    """A random Llama of the configs' shape, saved with a tokenizer.json: as a downloaded folder is."""
    vocab = json.loads((tokenizer.parent / "meta.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                                      rms_norm_eps=1e-6)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    shutil.copy(tokenizer, folder / "tokenizer.json")


def test_the_documented_path_runs_end_to_end(tmp_path: Path, capsys) -> None:
    hf, run, tokens, tuned = tmp_path / "hf", tmp_path / "llama", tmp_path / "tokens", tmp_path / "llama_mod"
    assert data_main(["prepare", *TEXT, "--train-bpe", "--vocab-size", "300", "--out", str(tmp_path / "bpe")]) == 0
    stand_in_llama(hf, tmp_path / "bpe" / "tokenizer.json")

    assert hf_main(["import", str(hf), str(run), "--max-seq-len", "128"]) == 0
    assert data_main(["prepare", *TEXT, "--tokenizer", str(hf), "--out", str(tokens)]) == 0
    paths = [f"--train.init_from={run}", f"--data.path={tokens}", f"--train.out_dir={tuned}"]

    # step 0 of the conversion at capacity 1.0 is the imported model
    config = load_config(CONFIG, paths)
    imported = load_model(run)
    converted = build_model(config.at_capacity(1.0), "cpu").eval()
    ids = torch.randint(0, config.model.vocab_size, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (converted(ids).logits - imported(ids).logits).abs().max() <= 1e-6

    short = ["--train.max_steps=3", "--routing.capacity_schedule.steps=2", "--routing.capacity_schedule.stages=2",
             "--train.batch_size=2", "--data.seq_len=64", "--train.eval_interval=3", "--train.eval_batches=1",
             "--train.checkpoint_interval=3", "--train.warmup_steps=1", "--train.device=cpu", "--train.progress=false"]
    assert train_main(["--config", str(CONFIG), *paths, *short]) == 0
    model = load_model(tuned)
    before, after = imported.state_dict(), model.state_dict()
    moved = [name for name, t in after.items() if name in before and not torch.equal(t, before[name])]
    assert moved == []  # router tuning: every pretrained tensor bit-identical
    assert any(".router." in name for name in after if name not in before)

    capsys.readouterr()
    assert evaluate_main([str(tuned), "--batches", "1", "--device", "cpu"]) == 0
    assert "val_loss" in capsys.readouterr().out
    assert generate_main(["--checkpoint", str(tuned), "--prompt", "def ", "--max-new-tokens", "8", "--greedy",
                          "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("def ")

    assert hf_main(["export", str(tuned), str(tmp_path / "hf_mod"), "--family", "mode"]) == 0
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf_mod").eval()
    with torch.no_grad():
        out = loaded(ids, labels=ids)
        assert torch.equal(out.logits, model(ids, routing_mode="causal").logits)
        assert abs(float(out.loss) - float(model(ids[:, :-1], ids[:, 1:], routing_mode="causal").lm_loss)) <= 1e-5
