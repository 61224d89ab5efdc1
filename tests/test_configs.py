"""Every config in configs/ loads and builds its model.

Models are built on the meta device (no memory, no init cost), so GPU-sized configs are
checked on any machine. A config whose moe.backend needs CUDA must fail with an error
naming moe.backend where there is none, and then build with --moe.backend=torch. CPU-sized
configs also run one forward pass on a short batch.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mode.config import ConfigError, load_config
from mode.model import LanguageModel

CONFIGS = sorted((Path(__file__).resolve().parent.parent / "configs").glob("*.yaml"))
SMALL_PARAMETERS = 20_000_000  # below this a config counts as CPU-sized: run a forward too


def test_configs_exist():
    assert CONFIGS, "no configs/*.yaml found"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_config_loads_and_builds(path: Path) -> None:
    config = load_config(path)
    overrides: list[str] = []
    if config.moe.backend != "torch" and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="moe.backend"):
            with torch.device("meta"):
                LanguageModel(config)
        overrides = ["--moe.backend=torch"]
        config = load_config(path, overrides)
    with torch.device("meta"):
        model = LanguageModel(config)
    kinds = config.model.block_kinds()
    assert len(model.blocks) == config.model.n_layers == len(kinds)
    if model.num_parameters() < SMALL_PARAMETERS:
        model = LanguageModel(config)
        tokens = torch.randint(0, config.model.vocab_size, (2, min(32, config.data.seq_len)))
        out = model(tokens, tokens)
        assert torch.isfinite(out.loss)
        assert len(out.routings) == len(out.ffn_routings) == len(kinds)


TINY = [p for p in CONFIGS if p.stem.endswith("_tiny")]


@pytest.mark.parametrize("causal", ["none", "aux_loss", "predictor"])
@pytest.mark.parametrize("path", TINY, ids=[p.stem for p in TINY])
def test_every_parameter_gets_a_gradient(path: Path, causal: str) -> None:
    """One training step reaches every parameter of every block kind and causal method. CUDA-graphed
    training (train.compile_mode=reduce-overhead) keeps gradients allocated, so a parameter
    without a gradient would see AdamW move it by a zero gradient instead of being skipped."""
    config = load_config(path, [f"--routing.causal={causal}"])
    torch.manual_seed(0)
    model = LanguageModel(config)
    tokens = torch.randint(0, config.model.vocab_size, (2, config.data.seq_len + 1))
    model(tokens[:, :-1], tokens[:, 1:]).loss.backward()
    assert [n for n, p in model.named_parameters() if p.grad is None] == []
