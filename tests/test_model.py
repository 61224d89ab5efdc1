"""Whole-model checks: every routed layer owns its router, and torch.compile matches eager."""
from __future__ import annotations

import torch

from mode.config import config_from_dict
from mode.model import LanguageModel

COMPILE_TOL = 1e-5  # float32 on CPU: inductor fuses and reorders elementwise arithmetic


def tiny(pattern: list[str]) -> LanguageModel:
    cfg = config_from_dict({
        "model": {"d_model": 32, "n_heads": 4, "n_layers": 4, "d_ff": 64, "max_seq_len": 32, "block_pattern": pattern},
        "moe": {"n_experts": 2, "n_noop": 1},
        "data": {"seq_len": 32},
    })
    return LanguageModel(cfg)


def test_every_routed_layer_has_its_own_router() -> None:
    """A pitfall of public implementations: one router shared across layers."""
    model = tiny(["mod", "mode_staged", "mode_integrated", "moe"])
    routers = [m for m in model.modules() if type(m).__name__ == "Router"]
    assert len(routers) == 5  # mod; staged: depth + experts; integrated; moe
    weights = [r.proj.weight for r in routers]
    assert len({w.data_ptr() for w in weights}) == len(weights)


def test_compiled_model_matches_eager() -> None:
    torch.manual_seed(0)
    model = tiny(["dense", "mod"])
    tokens = torch.randint(0, 256, (2, 33))
    x, y = tokens[:, :-1], tokens[:, 1:]
    eager = model(x, y)
    eager.loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model)(x, y)
    compiled.loss.backward()
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=COMPILE_TOL, atol=COMPILE_TOL)
    for r_eager, r_compiled in zip(eager.routings, compiled.routings):
        if r_eager is not None:
            assert torch.equal(r_eager.indices, r_compiled.indices)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=COMPILE_TOL, atol=COMPILE_TOL)
