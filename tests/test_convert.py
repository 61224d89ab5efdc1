"""Conversion of a trained dense model into a routed one (train.init_from with another
block_pattern), upcycling into experts, and router tuning (train.trainable)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mode.checkpoint import load_checkpoint_file
from mode.config import ConfigError
from mode.convert import converted_state
from mode.layers.mlp import SwiGLU
from mode.model import LanguageModel
from mode.trainable import router_parameter_names
from mode.training.trainer import Trainer
from tests.test_train import make_config

# The converted model at capacity 1.0 runs the pretrained blocks' float32 arithmetic with a gate of
# exactly 1; only the MoD block's gather / scatter of every token sits between: equal to rounding.
CONVERSION_ATOL = 1e-6
DENSE = {"block_pattern": ["dense"]}
UNIT_ROUTERS = {"capacity": 1.0, "gate": "identity", "router_bias": True}


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory: pytest.TempPathFactory, corpus: Path) -> Path:
    """A dense model trained a few steps (so its weights are not the initial ones)."""
    out = tmp_path_factory.mktemp("dense")
    Trainer(make_config(out, corpus, model=DENSE)).run()
    return out


def _logits(model: LanguageModel, seed: int = 0) -> torch.Tensor:
    tokens = torch.randint(0, model.config.model.vocab_size, (2, 32), generator=torch.Generator().manual_seed(seed))
    with torch.no_grad():
        return model(tokens).logits


def _dense_model(run: Path) -> LanguageModel:
    payload = load_checkpoint_file(run)
    trainer_config = make_config(run / "unused", run, model=DENSE)
    model = LanguageModel(trainer_config)
    model.load_state_dict(payload["model"])
    return model.eval()


@pytest.mark.parametrize("pattern", [["dense", "mod"], ["mod"]])
def test_mod_conversion_at_capacity_one_is_the_pretrained_model(tmp_path: Path, corpus: Path, dense_run: Path,
                                                                pattern: list[str]) -> None:
    converted = Trainer(make_config(tmp_path / "mod", corpus, model={"block_pattern": pattern}, routing=UNIT_ROUTERS,
                                    train={"init_from": str(dense_run)}))
    assert any("computes the pretrained block" in note for note in converted.notes), converted.notes
    torch.testing.assert_close(_logits(converted.model.eval()), _logits(_dense_model(dense_run)),
                               atol=CONVERSION_ATOL, rtol=0)
    router = converted.model.blocks[-1].router.router.proj
    assert torch.equal(router.weight, torch.zeros_like(router.weight)) and torch.equal(router.bias, torch.ones(1))


def test_mod_conversion_below_capacity_one_changes_only_the_routed_tokens(tmp_path: Path, corpus: Path,
                                                                          dense_run: Path) -> None:
    """At capacity 0.25 a converted MoD layer skips 3 of 4 tokens: the model is no longer the dense one."""
    converted = Trainer(make_config(tmp_path / "mod", corpus, routing={**UNIT_ROUTERS, "capacity": 0.25},
                                    train={"init_from": str(dense_run)}))
    assert not torch.allclose(_logits(converted.model.eval()), _logits(_dense_model(dense_run)), atol=1e-3)


def test_a_sigmoid_gate_is_said_not_to_reproduce_the_model(tmp_path: Path, corpus: Path, dense_run: Path) -> None:
    converted = Trainer(make_config(tmp_path / "mod", corpus, routing={"capacity": 1.0, "gate": "sigmoid"},
                                    train={"init_from": str(dense_run)}))
    assert any("not the pretrained one" in note for note in converted.notes), converted.notes
    assert not torch.allclose(_logits(converted.model.eval()), _logits(_dense_model(dense_run)), atol=1e-3)


@pytest.mark.parametrize("kind", ["moe", "mode_integrated", "mode_staged"])
def test_upcycling_copies_the_dense_mlp_into_every_expert(tmp_path: Path, corpus: Path, dense_run: Path,
                                                         kind: str) -> None:
    """Each real expert computes the dense MLP of its layer (the identity upcycling rests on)."""
    moe = {"n_experts": 3, "n_noop": 1 if kind == "mode_integrated" else 0, "d_expert": 64}
    converted = Trainer(make_config(tmp_path / kind, corpus, model={"block_pattern": [kind]}, routing=UNIT_ROUTERS,
                                    moe=moe, train={"init_from": str(dense_run)}))
    assert any("copied into 3 experts" in note for note in converted.notes), converted.notes
    dense = _dense_model(dense_run)
    x = torch.randn(5, 32)
    for i, block in enumerate(converted.model.blocks):
        inner = block.block if kind == "mode_staged" else block
        mlp = dense.blocks[i].ffn
        assert isinstance(mlp, SwiGLU)
        experts = inner.ffn.experts
        for e in range(3):
            h = x @ experts.w_in[e]  # (5, 2F)
            gate, up = h.chunk(2, dim=-1)
            out = (torch.nn.functional.silu(gate) * up) @ experts.w_out[e]  # (5, D)
            torch.testing.assert_close(out, mlp(x), atol=1e-6, rtol=0)
        torch.testing.assert_close(inner.attn.qkv.weight, dense.blocks[i].attn.qkv.weight, atol=0, rtol=0)


def test_upcycled_token_choice_output_is_the_gate_sum_times_the_mlp(tmp_path: Path, corpus: Path,
                                                                    dense_run: Path) -> None:
    """Dropless top-2 token choice over identical experts: FFN(x) = (g1 + g2) * MLP(x) for every token."""
    moe = {"n_experts": 4, "d_expert": 64, "scheme": "token_choice", "top_k": 2, "dropless": True}
    converted = Trainer(make_config(tmp_path / "tc", corpus, model={"block_pattern": ["moe"]}, moe=moe,
                                    train={"init_from": str(dense_run)}))
    ffn = converted.model.blocks[0].ffn
    mlp = _dense_model(dense_run).blocks[0].ffn
    x = torch.randn(2, 32, 32)
    with torch.no_grad():
        out, routing = ffn(x)
        gate_sum = routing.gates.float().reshape(2 * 32, -1).sum(-1).reshape(2, 32, 1)  # (B, S, 1)
        torch.testing.assert_close(out, gate_sum * mlp(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize("kind", ["moe", "mode_staged"])
def test_upcycled_renormalised_dropless_token_choice_is_the_pretrained_model(tmp_path: Path, corpus: Path,
                                                                             dense_run: Path, kind: str) -> None:
    """Renormalised top-2 gates sum to 1 and dropless drops nothing: the upcycled model (Staged MoDE:
    with unit depth routers at capacity 1.0) computes the dense model's logits."""
    moe = {"n_experts": 4, "d_expert": 64, "scheme": "token_choice", "top_k": 2, "dropless": True,
           "renormalize": True}
    converted = Trainer(make_config(tmp_path / kind, corpus, model={"block_pattern": [kind]}, routing=UNIT_ROUTERS,
                                    moe=moe, train={"init_from": str(dense_run)}))
    assert any("the upcycled FFN computes the dense MLP" in note for note in converted.notes), converted.notes
    torch.testing.assert_close(_logits(converted.model.eval()), _logits(_dense_model(dense_run)),
                               atol=CONVERSION_ATOL, rtol=0)


def test_conversion_errors_name_the_field(tmp_path: Path, corpus: Path, dense_run: Path) -> None:
    mod_run = tmp_path / "modrun"
    Trainer(make_config(mod_run, corpus)).run()
    with pytest.raises(ConfigError, match=r"train\.init_from: converting .*layer 1 is mod in the checkpoint"):
        Trainer(make_config(tmp_path / "a", corpus, model=DENSE, train={"init_from": str(mod_run)}))
    with pytest.raises(ConfigError, match=r"layer 0 cannot become mor"):
        Trainer(make_config(tmp_path / "m", corpus, model={"block_pattern": ["mor"]}, train={"init_from": str(dense_run)}))
    with pytest.raises(ConfigError, match=r"holds another model: model\.d_ff"):
        Trainer(make_config(tmp_path / "b", corpus, model={"d_ff": 96}, train={"init_from": str(dense_run)}))
    with pytest.raises(ConfigError, match=r"moe\.activation: upcycling"):
        Trainer(make_config(tmp_path / "c", corpus, model={"block_pattern": ["moe"]},
                            moe={"activation": "gelu", "d_expert": 64}, train={"init_from": str(dense_run)}))
    with pytest.raises(ConfigError, match=r"moe\.d_expert: upcycling needs experts as wide as the dense MLP \(64\)"):
        Trainer(make_config(tmp_path / "d", corpus, model={"block_pattern": ["moe"]},
                            moe={"d_expert": 32}, train={"init_from": str(dense_run)}))


def test_moe_layers_cannot_become_dense(tmp_path: Path, corpus: Path) -> None:
    moe_run = tmp_path / "moerun"
    Trainer(make_config(moe_run, corpus, model={"block_pattern": ["moe"]}, moe={"n_experts": 2})).run()
    source = make_config(moe_run, corpus, model={"block_pattern": ["moe"]}, moe={"n_experts": 2})
    target = make_config(tmp_path / "t", corpus, model=DENSE)
    with pytest.raises(ConfigError, match="layer 0 is moe in the checkpoint and cannot become dense"):
        converted_state(load_checkpoint_file(moe_run)["model"], source, LanguageModel(target).state_dict(), target)


def test_router_tuning_changes_only_routers(tmp_path: Path, corpus: Path, dense_run: Path) -> None:
    """train.trainable=routers after conversion: 8 steps move every router and predictor tensor
    and leave every other tensor bit-identical."""
    config = make_config(tmp_path / "tune", corpus, routing={**UNIT_ROUTERS, "causal": "predictor"},
                         train={"init_from": str(dense_run), "trainable": "routers"})
    trainer = Trainer(config)
    before = {k: v.clone() for k, v in trainer.model.state_dict().items()}
    routers = router_parameter_names(trainer.model)
    assert routers and all("router" in name or "predictor" in name for name in routers), routers
    trainer.run()
    after = load_checkpoint_file(tmp_path / "tune")["model"]
    for name, value in before.items():
        if name in routers:
            assert not torch.equal(after[name], value), f"{name} did not train"
        else:
            assert torch.equal(after[name], value), f"{name} changed"


def test_trainable_patterns_and_errors(tmp_path: Path, corpus: Path) -> None:
    trainer = Trainer(make_config(tmp_path / "p", corpus, train={"trainable": ["blocks.0.*", "embed.*"]}))
    grads = {name for name, p in trainer.model.named_parameters() if p.requires_grad}
    assert grads and all(name.startswith(("blocks.0.", "embed.")) for name in grads)
    with pytest.raises(ConfigError, match=r"train\.trainable: 'blocks\.9\.\*' selects nothing"):
        Trainer(make_config(tmp_path / "q", corpus, train={"trainable": "blocks.9.*"}))
    with pytest.raises(ConfigError, match=r"train\.trainable: 'routers' selects nothing \(this model has no router"):
        Trainer(make_config(tmp_path / "r", corpus, model=DENSE, train={"trainable": "routers"}))
