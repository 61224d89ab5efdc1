"""The Mixture-of-Recursions block (mode/layers/mor.py) against its definition (docs/routing-math.md):
one recursion at full capacity with a unit gate is a dense block; recursion r chooses among the
tokens recursion r-1 chose; a token that leaves keeps its state; decoding with one sparse KV cache
per recursion gives the full causal forward; the FLOP counter counts what runs; it trains.

Tiny float64 blocks on CPU (the routers compute in float32: F64_TOL as in test_generate.py).
"""
from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
import torch

from mode.config import ConfigError, config_from_dict, load_config
from mode.flops import model_flops, recursion_tokens
from mode.generate import Decoder, generate
from mode.layers.block import TransformerBlock
from mode.layers.chunks import GatherStep, Prefill, StaticStep
from mode.layers.kv_cache import LayerCache, PackedRows
from mode.layers.mor import MoRBlock
from mode.model import LanguageModel
from mode.routing import apply_gate, token_mask
from mode.training.trainer import Trainer
from tests.test_flops import assert_counter_matches_direct_count
from tests.test_generate import EFFECT_FLOOR, F64_TOL, spread_weights_

S, B = 16, 3
CONFIGS = Path(__file__).resolve().parent.parent / "configs"
# The loss must fall by a clear margin in 30 steps (from ~ln 256 = 5.5 nats per byte), as test_train.py asks.
LOSS_DROP = 0.3


def make_config(causal: str = "aux_loss", pattern: tuple[str, ...] = ("dense", "mor"), n_layers: int = 2,
                mor: dict | None = None, **routing):
    return config_from_dict({
        "model": {"d_model": 32, "n_heads": 4, "n_layers": n_layers, "d_ff": 64, "max_seq_len": 48,
                  "block_pattern": list(pattern)},
        "routing": {"causal": causal, "predictor_hidden": 16, **routing},
        "mor": mor if mor is not None else {"recursions": 3, "capacities": [1.0, 0.5, 0.25]},
        "data": {"seq_len": S},
    })


def make_model(causal: str = "aux_loss", **kwargs) -> LanguageModel:
    """float64, weights of size ~1/sqrt(fan_in) so every recursion moves the output visibly and the
    causal decisions split the tokens (as test_generate.make_model)."""
    torch.manual_seed(0)
    return spread_weights_(LanguageModel(make_config(causal, **kwargs)).double().eval())


def mor_block(model: LanguageModel) -> MoRBlock:
    return next(b for b in model.blocks if isinstance(b, MoRBlock))


def states(seed: int = 2) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.randn(B, S, 32, dtype=torch.float64)


# ----------------------------------------------------------------------------- the math
@pytest.mark.parametrize("residual_owned", [False, True])
@torch.no_grad()
def test_one_recursion_at_full_capacity_with_a_unit_gate_is_a_dense_block(residual_owned: bool) -> None:
    model = make_model("none", pattern=("mor",), n_layers=1, mor={"recursions": 1}, gate="identity", router_bias=True)
    block = mor_block(model)
    block.routers[0].router.proj.weight.zero_()
    block.routers[0].router.proj.bias.fill_(1.0)  # every score 1: g = 1 for every token
    dense = TransformerBlock(model.config.model).double()
    dense.load_state_dict(block.block.state_dict())
    x, angles = states(), model.rotary.prefix(S)
    want = dense(x, angles)[0]
    got, info = block(x.clone(), angles, residual_owned=residual_owned)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    assert info.routing.positions.shape == (B, S) and torch.equal(info.routing.gates, torch.ones(B, S))


@torch.no_grad()
def test_one_recursion_at_full_capacity_adds_the_gated_update_to_every_token() -> None:
    """With any router: x + g(r(x)) * f(x) for every token, f the shared block's update."""
    model = make_model("none", pattern=("mor",), n_layers=1, mor={"recursions": 1})
    block = mor_block(model)
    x, angles = states(), model.rotary.prefix(S)
    gates = apply_gate(block.routers[0].router(x).squeeze(-1), "sigmoid").double()  # (B, S)
    want = x + gates.unsqueeze(-1) * block.block.update(x, angles)
    torch.testing.assert_close(block(x, angles)[0], want, rtol=0, atol=1e-12)


def truncated(block: MoRBlock, recursions: int) -> MoRBlock:
    """The block with only its first `recursions` routers: its output is the state after them."""
    partial = copy.deepcopy(block)
    partial.routers = partial.routers[:recursions]
    return partial


@pytest.mark.parametrize("causal", [False, True])
@torch.no_grad()
def test_recursions_nest_and_tokens_that_leave_stop_changing(causal: bool) -> None:
    model = make_model("aux_loss")
    block = mor_block(model)
    x, angles = states(), model.rotary.prefix(S)
    out, routings = block.recursion_routings(x, angles, causal=causal)
    assert torch.equal(out, block(x, angles, causal=causal)[0])
    chosen = []
    for routing in routings:
        taken = routing.gates != 0 if causal else torch.ones_like(routing.gates, dtype=torch.bool)
        mask = torch.zeros(B, S, dtype=torch.bool).scatter_(1, routing.positions, taken)  # (B, S)
        chosen.append(mask)
    if not causal:  # top-k: k_r tokens a sequence, 16, 8 and 4
        assert [int(c.sum(1).unique()) for c in chosen] == recursion_tokens(S, block_capacities(block)) == [16, 8, 4]
    for earlier, later in zip(chosen, chosen[1:]):
        assert not (later & ~earlier).any()  # nested: recursion r chooses among those r-1 chose
        assert (earlier & ~later).any()  # and leaves some out
    for r in range(1, block.recursions):
        before = truncated(block, r)(x, angles, causal=causal)[0]  # the state entering recursion r
        gone = ~chosen[r]
        assert torch.equal(out[gone], before[gone])  # left at r: unchanged through r..R-1
        assert (out[chosen[r]] != before[chosen[r]]).any(dim=-1).all()  # chosen: updated


def block_capacities(block: MoRBlock) -> list[float]:
    return [router.capacity for router in block.routers]


def reference_recursions(block: MoRBlock, x: torch.Tensor, rotary) -> torch.Tensor:
    """A slow reference in plain ops: recursion r's router scores the state entering it, top-k over
    the tokens still active, and those tokens get x + g * f(x) with f attending among them alone,
    at their own rotary positions."""
    state, active = x, torch.ones(B, S, dtype=torch.bool)
    for router in block.routers:
        scores = router.router(state).squeeze(-1)  # (B, S) float32
        k = math.floor(router.capacity * int(active[0].sum()) + 0.5)
        positions = scores.detach().masked_fill(~active, float("-inf")).topk(k, dim=1).indices.sort(dim=1).values
        new = state.clone()
        for b in range(B):
            rows = state[b, positions[b]].unsqueeze(0)  # (1, k, D)
            update = block.block.update(rows, rotary.angles(positions[b].unsqueeze(0)))[0]
            new[b, positions[b]] += apply_gate(scores[b, positions[b]], router.gate).double().unsqueeze(-1) * update
        state, active = new, token_mask(positions, S)
    return state


@pytest.mark.parametrize("residual_owned", [False, True])
def test_each_recursion_is_a_gated_update_at_the_original_positions(residual_owned: bool) -> None:
    """The block's output and its gradients (input, shared block, every router) against the reference."""
    model = make_model("none")
    block, rotary = mor_block(model), model.rotary
    params = [p for p in block.parameters()]
    grad = states(5)
    results = []
    for run in ("block", "reference"):
        x = states().requires_grad_()
        if run == "block":  # the block may add into its input's memory: give it a copy it owns
            out = block(x * 1.0 if residual_owned else x, rotary.prefix(S), residual_owned=residual_owned)[0]
        else:
            out = reference_recursions(block, x, rotary)
        results.append((out.detach(), *torch.autograd.grad(out, [x, *params], grad)))
    for got, want in zip(*results):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=F64_TOL)


@torch.no_grad()
def test_the_block_reports_every_recursion() -> None:
    model = make_model("aux_loss")
    block = mor_block(model)
    x, angles = states(), model.rotary.prefix(S)
    _, routings = block.recursion_routings(x, angles)
    report = block(x, angles)[1].routing
    assert torch.equal(report.positions, routings[0].positions)
    assert torch.equal(report.aux_loss, sum(r.aux_loss for r in routings))
    assert float(report.stats["recursion1.processed"]) == 8 / S and float(report.stats["recursion2.processed"]) == 4 / S
    assert "recursion2.causal_accuracy" in report.stats


# ----------------------------------------------------------------------------- decoding
def fresh_caches(block: MoRBlock) -> list[LayerCache]:
    caches = [LayerCache.empty(B, S, 4, 8, torch.float64, torch.device("cpu")) for _ in range(block.recursions)]
    for cache, weights in zip(caches, block.router_weights()):
        cache.router_weights = weights
    return caches


@pytest.mark.parametrize("causal", ["aux_loss", "predictor"])
@torch.no_grad()
def test_forward_cached_equals_the_causal_forward(causal: str) -> None:
    """A prefill chunk, and one token at a time through the gather and the static step, against
    the block's causal forward; each recursion's cache holds exactly the tokens it took."""
    model = make_model(causal)
    block, rotary = mor_block(model), model.rotary
    x = states()
    want, routings = block.recursion_routings(x, rotary.prefix(S), causal=True)
    taken = [int((r.gates != 0).sum()) for r in routings]
    assert taken[0] > taken[1] > taken[2] > 0  # the decisions split the tokens
    positions, valid = torch.arange(S).expand(B, S), torch.ones(B, S, dtype=torch.bool)
    caches = fresh_caches(block)
    got = block.forward_cached(x, caches, Prefill(rotary, positions, valid, valid.sum(1)))
    assert (got - want).abs().max() <= F64_TOL
    for cache, routing in zip(caches, routings):
        assert torch.equal(cache.lengths, (routing.gates != 0).sum(1))
    gather_caches, static_caches = fresh_caches(block), fresh_caches(block)
    for cache in static_caches:
        cache.lengths_dev = cache.lengths_cpu.clone()
    packed = PackedRows.build(B, S, x.device, x.dtype, 8)
    all_rows, active = torch.arange(B), torch.ones(B, dtype=torch.bool)
    for t in range(S):
        pos = torch.full((B,), t)
        gather = GatherStep.at(rotary, pos, active, S, x.device, packed.slot_ids, all_rows)
        static = StaticStep(rotary, pos, active, S, all_rows * (S + 1), packed)
        for step, step_caches in ((gather, gather_caches), (static, static_caches)):
            out = block.forward_cached(x[:, t : t + 1].clone(), step_caches, step)
            assert (out - want[:, t : t + 1]).abs().max() <= F64_TOL
    for a, b, c in zip(caches, gather_caches, static_caches):
        assert torch.equal(a.lengths, b.lengths) and torch.equal(a.lengths, c.lengths)


@pytest.mark.parametrize("routed_rows", ["gather", "masked"])
@pytest.mark.parametrize("causal", ["aux_loss", "predictor"])
def test_cached_decode_matches_full_causal_forward(causal: str, routed_rows: str) -> None:
    model = make_model(causal, pattern=("mor", "dense"), n_layers=3)
    tokens = torch.randint(0, 256, (2, S), generator=torch.Generator().manual_seed(1))
    full = model(tokens, routing_mode="causal").logits.float()  # (B, S, V)
    prompt = 5
    decoder = Decoder(model, 2, S, routed_rows=routed_rows)
    assert [len(c) if isinstance(c, list) else 1 for c in decoder.block_caches] == [3, 1, 3]
    assert len(decoder.caches) == 7
    logits = [decoder.prefill(tokens[:, :prompt].tolist())]
    for t in range(prompt, S):
        logits.append(decoder.step(tokens[:, t]))
    got = torch.stack(logits, 1)  # positions prompt-1 .. S-1
    assert (got - full[:, prompt - 1:]).abs().max() <= F64_TOL
    deeper = [int(c.lengths.sum()) for c in decoder.block_caches[0]]
    assert 2 * S > deeper[0] > deeper[1] > deeper[2] > 0  # each recursion's cache: the tokens it took


@pytest.mark.parametrize("routed_rows", ["gather", "masked"])
def test_a_reused_decoder_takes_the_recursion_routers_as_they_are_now(routed_rows: str) -> None:
    """generate(decoder=...) after the recursions' routers changed in place: a fresh decoder's tokens."""
    model = make_model("aux_loss", pattern=("mor", "dense"), n_layers=3)
    decoder = Decoder(model, 2, S, routed_rows=routed_rows)
    prompts = [[3, 1, 4, 1], [5, 9]]
    first = generate(model, prompts, max_new_tokens=8, temperature=0, decoder=decoder)
    assert first == generate(model, prompts, max_new_tokens=8, temperature=0)
    with torch.no_grad():
        for router in mor_block(model).routers:
            router.router.proj.weight.neg_()
    now = generate(model, prompts, max_new_tokens=8, temperature=0)
    assert now != first and generate(model, prompts, max_new_tokens=8, temperature=0, decoder=decoder) == now


def test_causal_routing_never_looks_ahead() -> None:
    model = make_model("predictor")
    tokens = torch.randint(0, 256, (3, S), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        base = model(tokens, routing_mode="causal").logits
        t = 6
        changed = tokens.clone()
        changed[:, t + 1:] = torch.randint(0, 256, (3, S - t - 1), generator=torch.Generator().manual_seed(4))
        other = model(changed, routing_mode="causal").logits
    assert (other[:, : t + 1] - base[:, : t + 1]).abs().max() <= F64_TOL
    assert (other[:, t + 1:] - base[:, t + 1:]).abs().max() > EFFECT_FLOOR


# ----------------------------------------------------------------------------- FLOPs
def test_flop_counter_hand_count() -> None:
    """D=64, F=96, S=32, [dense, mor] with capacities [1.0, 0.5, 0.25]: k = 32, 16, 8, causal."""
    config = config_from_dict({
        "model": {"d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 96, "max_seq_len": 64, "block_pattern": ["dense", "mor"]},
        "mor": {"recursions": 3, "capacities": [1.0, 0.5, 0.25]},
        "data": {"seq_len": 32},
    })

    def block(k: int) -> float:  # q,k,v,o + scores/values over (k + 1) / 2 keys + SwiGLU, per token
        return 8 * 64 * 64 + 4 * 64 * (k + 1) / 2 + 6 * 64 * 96

    router = 2 * 64
    mor = (32 * router + 32 * block(32) + 32 * router + 16 * block(16) + 16 * router + 8 * block(8)) / 32
    report = model_flops(config)
    assert report.per_block == [block(32), mor] == [73856, 127776]


@pytest.mark.parametrize("causal, capacities", [("none", [1.0, 0.5, 0.25]), ("predictor", [0.75, 0.3])])
def test_flop_counter_matches_direct_count(monkeypatch, causal: str, capacities: list[float]) -> None:
    config = config_from_dict({
        "model": {"d_model": 64, "n_heads": 4, "n_layers": 2, "d_ff": 96, "max_seq_len": 64, "block_pattern": ["dense", "mor"]},
        "routing": {"causal": causal, "predictor_hidden": 16},
        "mor": {"recursions": len(capacities), "capacities": capacities},
        "data": {"seq_len": 32},
        "train": {"batch_size": 4},
    })
    # the dense block's attention, then one a recursion: every one explicit
    assert_counter_matches_direct_count(monkeypatch, config, 32, attention_calls=1 + len(capacities))


# ----------------------------------------------------------------------------- config and training
@pytest.mark.parametrize("mor, field", [
    ({"recursions": 0}, "mor.recursions"),
    ({"recursions": 2, "capacities": [1.0]}, "capacities has 1 values but recursions is 2"),
    ({"recursions": 2, "capacities": [0.5, 0.75]}, "must not increase"),
    ({"recursions": 2, "capacities": [1.5, 0.5]}, r"must be in \(0, 1\]"),
])
def test_bad_recursion_settings_are_errors_naming_the_field(mor: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        config_from_dict({"model": {"block_pattern": ["dense", "mor"]}, "mor": mor})


def test_default_capacities_and_schedule_refused() -> None:
    config = config_from_dict({"model": {"block_pattern": ["dense", "mor"]}, "mor": {"recursions": 4}})
    assert config.mor.capacity_list() == [1.0, 0.75, 0.5, 0.25]
    assert block_capacities(LanguageModel(config).blocks[1]) == pytest.approx([1.0, 0.75, 2 / 3, 0.5])
    with pytest.raises(ConfigError, match="capacity_schedule"):
        config_from_dict({"model": {"block_pattern": ["mod", "mor"]},
                          "routing": {"capacity_schedule": {"start": 1.0, "steps": 10}}})


def test_short_run_on_the_tiny_config_lowers_the_loss(tmp_path: Path, corpus: Path) -> None:
    config = load_config(CONFIGS / "mor_tiny.yaml", [
        "--model.d_model=64", "--model.d_ff=128", "--model.max_seq_len=32", "--data.source=text",
        f"--data.path={corpus}", "--data.seq_len=32", "--train.batch_size=8", "--train.max_steps=30",
        "--train.warmup_steps=5", "--train.eval_interval=100", "--train.log_interval=1", "--train.device=cpu",
        "--train.progress=false", f"--train.out_dir={tmp_path / 'run'}",
    ])
    losses = [r["loss"] for r in Trainer(config).run() if "loss" in r]
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - LOSS_DROP
