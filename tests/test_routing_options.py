"""Routing options: auxiliary-loss-free balancing (moe.bias_update_rate, moe.score), router jitter
(moe.jitter), null experts of several kinds (moe.noop_kind) and per-layer capacity
(routing.capacity as a list). Each off by default, where the models are today's."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from mode.checkpoint import load_checkpoint_file
from mode.config import ConfigError, MoEConfig, config_from_dict
from mode.layers.moe import MoEFFN, NullExperts
from mode.model import LanguageModel
from mode.routing import TokenChoiceRouter, bias_balanced_routers, token_choice_head
from mode.training.router_stats import expert_loads

D, E = 16, 4


def skewed_router(rate: float, score: str = "softmax", **kw) -> tuple[TokenChoiceRouter, torch.Tensor]:
    """A top-1 dropless token-choice router whose logits favour expert 0 for every token of x."""
    router = TokenChoiceRouter(D, E, 0, 1, 1.0, True, 0.0, 0.0, score=score, bias_update_rate=rate, **kw)
    x = torch.randn(4, 32, D) * 0.3
    x[..., 0] += 1.0
    with torch.no_grad():
        router.router.proj.weight.normal_(std=0.1)
        router.router.proj.weight[0, 0] = 2.0  # expert 0's logit grows with the shared direction
    return router, x


# ----------------------------------------------------------------------------- bias balancing
def test_bias_is_off_by_default_and_adds_no_state() -> None:
    router = TokenChoiceRouter(D, E, 0, 1, 1.0, True, 0.0, 0.0)
    assert router.expert_bias is None
    assert set(router.state_dict()) == {"router.proj.weight"}
    assert "expert_load" not in router(torch.randn(2, 8, D)).stats


@pytest.mark.parametrize("score", ["softmax", "sigmoid"])
def test_bias_moves_against_the_load_and_the_spread_shrinks(score: str) -> None:
    router, x = skewed_router(0.005, score)
    loads = router(x).stats["expert_load"]
    assert loads[0] > loads.mean()  # the skew: expert 0 takes most tokens
    spread = loads.std()
    router.update_bias(loads)
    bias = router.expert_bias
    assert bias[0] == pytest.approx(-0.005)
    assert torch.equal(torch.sign(bias), torch.sign(loads.mean() - loads))
    spreads = []
    for _ in range(200):
        loads = router(x).stats["expert_load"]
        spreads.append(loads.std())
        router.update_bias(loads)
    # a fixed rate oscillates around balance: the spread of the last steps, on average
    assert torch.stack(spreads[-50:]).mean() < 0.25 * spread
    assert "expert_bias" in router.state_dict()  # a buffer: saved in checkpoints


def test_bias_chooses_but_never_scales_the_gates() -> None:
    router, x = skewed_router(0.1, "sigmoid")
    with torch.no_grad():
        router.expert_bias.copy_(torch.tensor([-5.0, 0.0, 0.0, 5.0]))  # forces expert 3
    routing = router(x)
    assert torch.all(routing.slots == 3)
    logits = routing.logits.view(-1, E)
    assert torch.allclose(routing.gates.squeeze(-1), torch.sigmoid(logits[:, 3]))
    routing.gates.sum().backward()
    assert router.expert_bias.grad is None


def test_sigmoid_scores_without_a_bias_choose_the_largest_logits() -> None:
    logits = torch.randn(20, 6)
    head = token_choice_head(logits, 2, 6, None, 0.0, 0.0, score="sigmoid")
    assert torch.equal(head.slots, logits.topk(2, -1).indices)
    assert torch.allclose(head.gates, torch.sigmoid(logits.topk(2, -1).values))


def test_expert_loads_sum_the_micro_batches() -> None:
    a = {"layer1.ffn": {"expert_load": torch.tensor([1.0, 2.0]), "processed": torch.tensor(1.0)},
         "layer0": {"processed": torch.tensor(0.5)}}
    b = {"layer1.ffn": {"expert_load": torch.tensor([3.0, 0.0]), "processed": torch.tensor(1.0)},
         "layer0": {"processed": torch.tensor(0.5)}}
    (loads,) = expert_loads([([], a), ([], b)])
    assert loads.tolist() == [4.0, 2.0]


def test_bias_options_need_token_choice() -> None:
    with pytest.raises(ValueError, match="bias_update_rate"):
        MoEConfig(scheme="expert_choice", bias_update_rate=0.01)
    with pytest.raises(ValueError, match="score=sigmoid"):
        MoEConfig(scheme="expert_choice", score="sigmoid")


def tiny_raw(tmp_path: Path, **moe) -> dict:
    return {
        "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 32,
                  "block_pattern": ["dense", "moe"]},
        "moe": {"n_experts": 4, "scheme": "token_choice", "top_k": 2, "dropless": True, **moe},
        "data": {"source": "stdlib", "seq_len": 32},
        "train": {"batch_size": 4, "max_steps": 4, "eval_interval": 100, "eval_batches": 1, "warmup_steps": 1,
                  "checkpoint_interval": 4, "out_dir": str(tmp_path / "run"), "progress": False, "device": "cpu"},
    }


def test_the_trainer_updates_the_bias_after_each_step(tmp_path: Path) -> None:
    """Through the Trainer: the bias moves every step by a multiple of the rate, and is checkpointed."""
    from mode.training.trainer import Trainer

    raw = tiny_raw(tmp_path, bias_update_rate=0.01, score="sigmoid", renormalize=True, lb_loss_weight=0.0)
    raw["train"]["grad_accum"] = 2
    trainer = Trainer(config_from_dict(raw))
    (router,) = bias_balanced_routers(trainer.model)
    trainer.train_step()
    # one update of +-rate per expert (0 where the load is exactly the mean)
    assert torch.all(router.expert_bias.abs() <= 0.01 + 1e-7)
    assert router.expert_bias.abs().sum() > 0
    trainer.run()
    state = load_checkpoint_file(tmp_path / "run" / "checkpoint.pt", "cpu")["model"]
    assert torch.equal(state["blocks.1.ffn.router.expert_bias"], router.expert_bias)
    steps = (router.expert_bias / 0.01).round()
    assert torch.allclose(router.expert_bias, steps * 0.01, atol=1e-6)


def test_moe_defaults_are_bit_identical_to_an_explicit_off(tmp_path: Path) -> None:
    """A token-choice model with the new options at their defaults equals one without them: same
    state dict keys, same logits (seeded alike)."""
    raw = tiny_raw(tmp_path)
    torch.manual_seed(0)
    plain = LanguageModel(config_from_dict(raw))
    explicit = tiny_raw(tmp_path, bias_update_rate=0.0, score="softmax", jitter=0.0)
    torch.manual_seed(0)
    off = LanguageModel(config_from_dict(explicit))
    assert list(plain.state_dict()) == list(off.state_dict())
    tokens = torch.randint(0, 256, (2, 32))
    plain.train()
    off.train()
    torch.manual_seed(1)
    a = plain(tokens).logits
    torch.manual_seed(1)
    assert torch.equal(a, off(tokens).logits)


def test_bias_config_errors_name_the_field() -> None:
    with pytest.raises(ConfigError, match="moe.bias_update_rate"):
        config_from_dict({"moe": {"bias_update_rate": -1.0}})


def test_moe_ffn_passes_the_options_to_its_router() -> None:
    ffn = MoEFFN(D, 32, MoEConfig(n_experts=E, scheme="token_choice", bias_update_rate=0.5, score="sigmoid", jitter=0.1))
    assert ffn.router.bias_update_rate == 0.5 and ffn.router.score == "sigmoid" and ffn.router.jitter == 0.1


def test_bias_balancing_on_two_processes_equals_one_process(corpus, tmp_path: Path) -> None:
    """2 gloo processes, experts sharded (expert_parallel=2): each process counts its own tokens' loads,
    LaunchTrainer sums them before every router updates its bias, so both processes keep one bias and
    train as one process with the doubled batch."""
    from test_parallel import assert_same_curves, launch, raw_config, records, single_process, write_config

    raw = raw_config(corpus, tmp_path / "dist",
                     moe={"n_experts": 4, "scheme": "token_choice", "top_k": 2, "dropless": True, "lb_loss_weight": 0.0,
                          "bias_update_rate": 0.01, "score": "sigmoid", "renormalize": True},
                     parallel={"zero_stage": 1, "expert_parallel": 2})
    launch(write_config(raw, tmp_path / "config.yaml"))
    reference = single_process(raw, tmp_path / "single")
    steps = max(records(reference)[0])
    assert_same_curves(reference, tmp_path / "dist", range(1, steps + 1))
    key = "blocks.1.ffn.router.expert_bias"
    one = load_checkpoint_file(reference / "checkpoint.pt", "cpu")["model"][key]
    two = load_checkpoint_file(tmp_path / "dist" / "checkpoint.pt", "cpu")["model"][key]
    assert one.abs().sum() > 0
    assert torch.equal(one, two)


# ----------------------------------------------------------------------------- jitter
def jitter_model(tmp_path: Path, jitter: float) -> LanguageModel:
    torch.manual_seed(0)
    return LanguageModel(config_from_dict(tiny_raw(tmp_path, jitter=jitter)))


def logits_seeded(model: LanguageModel, tokens: torch.Tensor, train: bool, seed: int = 1) -> torch.Tensor:
    model.train(train)
    torch.manual_seed(seed)
    with torch.no_grad():
        return model(tokens).logits


def test_jitter_changes_training_only_and_follows_the_seed(tmp_path: Path) -> None:
    tokens = torch.randint(0, 256, (2, 32))
    off, on = jitter_model(tmp_path, 0.0), jitter_model(tmp_path, 0.3)
    assert torch.equal(logits_seeded(off, tokens, True), logits_seeded(jitter_model(tmp_path, 0.0), tokens, True))
    assert not torch.equal(logits_seeded(on, tokens, True), logits_seeded(off, tokens, True))
    assert torch.equal(logits_seeded(on, tokens, False), logits_seeded(off, tokens, False))
    assert torch.equal(logits_seeded(on, tokens, True), logits_seeded(on, tokens, True))
    assert not torch.equal(logits_seeded(on, tokens, True), logits_seeded(on, tokens, True, seed=2))


def test_jitter_scales_only_the_router_input() -> None:
    router, x = skewed_router(0.0, jitter=0.2)
    router.train()
    torch.manual_seed(3)
    noise = torch.empty_like(x).uniform_(0.8, 1.2)
    torch.manual_seed(3)
    routing = router(x)
    assert torch.allclose(routing.logits.view(-1, E), (x * noise).reshape(-1, D) @ router.router.proj.weight.t(), atol=1e-6)


def test_jitter_needs_token_choice() -> None:
    with pytest.raises(ValueError, match="jitter"):
        MoEConfig(scheme="expert_choice", jitter=0.1)
    with pytest.raises(ValueError):
        MoEConfig(scheme="token_choice", jitter=1.0)


# ----------------------------------------------------------------------------- null experts
N_NULL = 3


def null_pair(scheme: str, kinds: list[str], **moe) -> tuple[MoEFFN, MoEFFN]:
    """(an FFN whose no-op slots are `kinds`, the same FFN with zero slots), sharing every weight."""
    base = dict(n_experts=E, n_noop=N_NULL, scheme=scheme, **moe)
    torch.manual_seed(0)
    ffn = MoEFFN(D, 32, MoEConfig(noop_kind=kinds, **base)).double()
    if ffn.null_experts.constants is not None:
        with torch.no_grad():
            ffn.null_experts.constants.normal_()
    zero = MoEFFN(D, 32, MoEConfig(**base)).double()
    missing = zero.load_state_dict(ffn.state_dict(), strict=False)
    assert missing.missing_keys == [] and set(missing.unexpected_keys) <= {"null_experts.constants"}
    return ffn, zero


def null_reference(ffn: MoEFFN, x: torch.Tensor, kinds: list[str], slot_gates: torch.Tensor) -> torch.Tensor:
    """sum_j gate_tj * (x_t for copy, v_j for constant, 0 for zero), one token and slot at a time."""
    flat = x.reshape(-1, D)
    out = torch.zeros_like(flat)
    constants = iter(ffn.null_experts.constants) if ffn.null_experts.constants is not None else iter(())
    vectors = {j: next(constants) for j, kind in enumerate(kinds) if kind == "constant"}
    for t in range(flat.shape[0]):
        for j, kind in enumerate(kinds):
            g = slot_gates[t, j].double()
            if kind == "copy":
                out[t] += g * flat[t]
            elif kind == "constant":
                out[t] += g * vectors[j].double()
    return out.view_as(x)


KIND_CASES = [["copy"] * N_NULL, ["constant"] * N_NULL, ["zero", "copy", "constant"]]


@pytest.mark.parametrize("kinds", KIND_CASES)
@pytest.mark.parametrize("scheme", ["expert_choice", "token_choice"])
def test_null_experts_equal_the_hand_written_reference(scheme: str, kinds: list[str]) -> None:
    moe = {"top_k": 2, "renormalize": True} if scheme == "token_choice" else {}
    ffn, zero = null_pair(scheme, kinds, **moe)
    x = torch.randn(2, 16, D, dtype=torch.float64)
    out, routing = ffn(x)
    if scheme == "token_choice":
        slot_gates = torch.zeros(x.shape[0] * x.shape[1], N_NULL, dtype=torch.float64)
        for t in range(slot_gates.shape[0]):
            for j in range(2):
                slot = int(routing.slots[t, j])
                if slot >= E:
                    slot_gates[t, slot - E] += routing.gates[t, j]
        assert slot_gates.sum() > 0  # some token chose a no-op slot
    else:
        slot_gates = routing.logits.reshape(-1, E + N_NULL).softmax(-1)[:, E:]
    expected = zero(x)[0] + null_reference(ffn, x, kinds, slot_gates)
    # the gates are float32 (the router computes in float32): summed over the slots in float32 here
    assert torch.allclose(out, expected, atol=1e-6, rtol=1e-6)
    for kind in ("copy", "constant"):
        assert (f"{kind}_gate" in routing.stats) == (kind in kinds)


def test_copy_gates_are_summed_in_float32_under_autocast() -> None:
    """The PyTorch path (compiled, CPU) sums each token's copy gates in float32 as the kernel does:
    under bf16 autocast a matmul would round the sum (and its gradient) to bf16."""
    torch.manual_seed(0)
    null = NullExperts(["copy", "zero", "copy"], D)
    gates = torch.softmax(torch.randn(32, 3), -1).requires_grad_()
    x = torch.randn(32, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = null(x, gates)
    expected = (gates[:, 0] + gates[:, 2]).unsqueeze(-1) * x  # float32 throughout
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)
    grad = torch.randn(32, D)
    (got,) = torch.autograd.grad(out, gates, grad)
    assert torch.allclose(got[:, 0], (grad * x).sum(-1), atol=1e-5, rtol=1e-6)


def test_constant_slots_are_summed_in_float32_under_autocast() -> None:
    """The PyTorch path sums the constant slots' g_tc * v_c in float32 as the kernel does: under bf16
    autocast a matmul would round the gates, the constants and the product (and their gradients)."""
    torch.manual_seed(0)
    null = NullExperts(["constant", "zero", "copy", "constant"], D)
    with torch.no_grad():
        null.constants.copy_(torch.randn(2, D))
    gates = torch.softmax(torch.randn(32, 4), -1).requires_grad_()
    x = torch.randn(32, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = null(x, gates)
    v = null.constants
    expected = gates[:, 2:3] * x + gates[:, 0:1] * v[0] + gates[:, 3:4] * v[1]  # float32 throughout
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-6, rtol=1e-6)
    grad = torch.randn(32, D)
    got_gates, got_v = torch.autograd.grad(out, (gates, v), grad)
    torch.testing.assert_close(got_gates[:, 0], grad @ v[0], atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(got_v[1], (gates[:, 3:4] * grad).sum(0), atol=1e-5, rtol=1e-6)


def test_null_expert_constants_learn_and_copy_gates_get_gradient() -> None:
    ffn, _ = null_pair("token_choice", ["copy", "constant", "constant"], top_k=2)
    x = torch.randn(2, 16, D, dtype=torch.float64)
    ffn(x)[0].square().sum().backward()
    assert ffn.null_experts.constants.grad.abs().sum() > 0
    assert ffn.router.router.proj.weight.grad.abs().sum() > 0


def test_zero_null_experts_add_no_state() -> None:
    ffn = MoEFFN(D, 32, MoEConfig(n_experts=E, n_noop=2))
    assert ffn.null_experts is None
    assert not any("null" in key for key in ffn.state_dict())


def test_null_kind_list_must_match_n_noop() -> None:
    with pytest.raises(ConfigError, match=r"moe: .*noop_kind lists 2 kinds .* n_noop is 3"):
        config_from_dict({"moe": {"n_noop": 3, "noop_kind": ["copy", "zero"]}})
    with pytest.raises(ConfigError, match="noop_kind"):
        config_from_dict({"moe": {"n_noop": 0, "noop_kind": "copy"}})
    with pytest.raises(ConfigError, match="noop_kind"):
        config_from_dict({"moe": {"n_noop": 1, "noop_kind": "identity"}})


def test_null_experts_cost_no_flops() -> None:
    from mode.flops import model_flops

    raw = {"model": {"block_pattern": ["dense", "mode_integrated"]}, "moe": {"n_noop": 3}}
    zero = model_flops(config_from_dict(raw)).per_block
    for kinds in KIND_CASES:
        raw["moe"]["noop_kind"] = kinds
        assert model_flops(config_from_dict(raw)).per_block == zero


@pytest.mark.parametrize("scheme", ["expert_choice", "token_choice"])
def test_integrated_mode_with_copy_and_constant_experts_trains(tmp_path: Path, scheme: str) -> None:
    from mode.training.trainer import Trainer

    raw = tiny_raw(tmp_path, scheme=scheme, n_noop=2, noop_kind=["copy", "constant"])
    raw["model"]["block_pattern"] = ["dense", "mode_integrated"]
    if scheme == "expert_choice":
        for key in ("top_k", "dropless"):
            raw["moe"].pop(key)
    trainer = Trainer(config_from_dict(raw))
    records = trainer.run()
    routing = records[-1]["routing"]["layer1.ffn"]
    assert 0 < routing["copy_gate"] < 1 and 0 < routing["constant_gate"] < 1
    assert trainer.model.blocks[1].ffn.null_experts.constants.abs().sum() > 0


def test_null_experts_under_expert_parallelism_equal_one_process(corpus, tmp_path: Path) -> None:
    """Integrated MoDE with copy and constant slots, experts sharded over 2 gloo processes: the null
    outputs are computed where the tokens are (only the real experts' rows are exchanged), and the
    run trains as one process holding every expert with the doubled batch."""
    from test_parallel import assert_same_curves, launch, raw_config, records, single_process, write_config

    raw = raw_config(corpus, tmp_path / "dist", model={"block_pattern": ["dense", "mode_integrated"]},
                     moe={"n_experts": 4, "n_noop": 2, "noop_kind": ["copy", "constant"]},
                     parallel={"zero_stage": 1, "expert_parallel": 2})
    launch(write_config(raw, tmp_path / "config.yaml"))
    reference = single_process(raw, tmp_path / "single")
    assert_same_curves(reference, tmp_path / "dist", range(1, max(records(reference)[0]) + 1))


# ----------------------------------------------------------------------------- per-layer capacity
def per_layer_raw(capacity, **routing) -> dict:
    return {"model": {"d_model": 32, "n_heads": 2, "n_layers": 4, "d_ff": 64, "max_seq_len": 32,
                      "block_pattern": ["dense", "mod", "mode_staged", "mod"]},
            "moe": {"n_experts": 4},
            "routing": {"capacity": capacity, **routing}, "data": {"seq_len": 32}, "train": {"batch_size": 2}}


def test_two_mod_layers_at_their_own_capacities_route_their_own_k() -> None:
    torch.manual_seed(0)
    model = LanguageModel(config_from_dict(per_layer_raw([0.25, 0.5, 0.75])))
    out = model(torch.randint(0, 256, (2, 32)))
    ks = [routing.positions.shape[1] for routing in out.routings if routing is not None]
    assert ks == [8, 16, 24]


def test_per_layer_flops_equal_a_hand_count() -> None:
    from mode.flops import block_flops, dense_block_flops, model_flops, router_flops

    config = config_from_dict(per_layer_raw([0.25, 0.5, 0.75]))
    report = model_flops(config)
    model = config.model
    mod_at = [router_flops(32, 1) + (k / 32) * dense_block_flops(model, k) for k in (8, 24)]
    assert report.per_block[0] == dense_block_flops(model, 32)
    assert report.per_block[1] == pytest.approx(mod_at[0])
    assert report.per_block[3] == pytest.approx(mod_at[1])
    assert report.per_block[2] == block_flops("mode_staged", config.at_capacity(0.5), 32)
    one = model_flops(config_from_dict(per_layer_raw(0.5)))
    assert one.per_block[2] == report.per_block[2] and one.per_block[1] != report.per_block[1]


def test_a_capacity_list_of_the_wrong_length_names_both_lengths() -> None:
    with pytest.raises(ConfigError, match="routing.capacity lists 2 capacities .* builds 3 depth-routed blocks"):
        config_from_dict(per_layer_raw([0.25, 0.5]))
    with pytest.raises(ConfigError, match=r"routing.capacity: .*capacity 1.5 is outside \(0, 1\]"):
        config_from_dict(per_layer_raw([0.25, 1.5, 0.5]))
    with pytest.raises(ConfigError, match="routing.capacity"):
        config_from_dict(per_layer_raw(0.0))


def test_the_schedule_anneals_each_layer_to_its_own_target() -> None:
    config = config_from_dict(per_layer_raw([0.25, 0.5, 1.0], capacity_schedule={"start": 1.0, "steps": 4, "stages": 2}))
    routing = config.routing
    assert routing.capacity_at(0) == (1.0, 1.0, 1.0)
    assert routing.capacity_at(2) == (0.625, 0.75, 1.0)
    assert routing.capacity_at(4) == (0.25, 0.5, 1.0)
    assert config_from_dict(per_layer_raw(0.25, capacity_schedule={"start": 1.0, "steps": 4, "stages": 2})
                            ).routing.capacity_at(2) == 0.625


def test_the_trainer_sets_each_router_its_own_scheduled_capacity(tmp_path: Path) -> None:
    from mode.routing import DepthRouter
    from mode.training.trainer import Trainer

    raw = per_layer_raw([0.25, 0.5, 1.0], capacity_schedule={"start": 1.0, "steps": 4, "stages": 2})
    raw["data"] = {"source": "stdlib", "seq_len": 32}
    raw["train"].update(max_steps=4, eval_interval=100, eval_batches=1, warmup_steps=1, checkpoint_interval=4,
                        out_dir=str(tmp_path / "run"), progress=False, device="cpu")
    trainer = Trainer(config_from_dict(raw))
    routers = [m for m in trainer.model.modules() if isinstance(m, DepthRouter)]
    trainer.follow_capacity_schedule(2)
    assert [r.capacity for r in routers] == [0.625, 0.75, 1.0]
    trainer.run()
    logged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["capacity"] for r in logged if "capacity" in r][-1] == [0.625, 0.75, 1.0]  # step 4 routed at step 3's
    assert [r.capacity for r in routers] == [0.625, 0.75, 1.0]


def test_sweep_varies_a_capacity_list() -> None:
    from mode.sweep import parse_vary

    assert parse_vary("routing.capacity=[0.25,0.5],0.125") == ("routing.capacity", ["[0.25,0.5]", "0.125"])


def test_the_null_expert_tiny_config_trains(tmp_path: Path, corpus: Path) -> None:
    """configs/mode_integrated_null_tiny.yaml (copy and constant null experts), shrunk: 30 steps
    lower the loss, and the constant vectors and copy gates take part (statistics logged)."""
    import math

    from mode.config import load_config
    from mode.training.trainer import Trainer

    config = load_config(Path(__file__).resolve().parent.parent / "configs" / "mode_integrated_null_tiny.yaml", [
        "--model.d_model=64", "--model.d_ff=128", "--model.n_layers=2", "--model.max_seq_len=32",
        "--data.source=text", f"--data.path={corpus}", "--data.seq_len=32", "--train.batch_size=8",
        "--train.max_steps=30", "--train.warmup_steps=5", "--train.eval_interval=100", "--train.log_interval=1",
        "--train.device=cpu", "--train.progress=false", f"--train.out_dir={tmp_path / 'run'}",
    ])
    assert config.moe.noop_kind == ["copy", "copy", "constant", "constant"]
    trainer = Trainer(config)
    records = [r for r in trainer.run() if "loss" in r]
    losses = [r["loss"] for r in records]
    assert len(losses) == 30 and all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3
    constants = [p for name, p in trainer.model.named_parameters() if "constant" in name]
    assert constants and any(bool(p.abs().sum() > 0) for p in constants)  # they start at zero and learned
