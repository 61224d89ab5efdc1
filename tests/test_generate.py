"""Causal routing (paper section 3.5) and generation with per-layer sparse KV caches.

Tiny float64 models on CPU. The router and the predictor compute in float32 by design; the
decisions they make are the same in every path (same inputs, same per-token arithmetic),
so the comparisons below are between float64 computations that differ only in summation
order and batch shape.
"""
from __future__ import annotations

import functools
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from mode.checkpoint import load_model
from mode.config import config_from_dict
from mode.generate import Decoder, LayerCache, decode_tokens, generate, layer_step, main, sample
from mode.layers.mod import MoDBlock
from mode.model import LanguageModel
from mode.routing import ExpertChoiceRouter, token_mask
from mode.training.trainer import Trainer

# The model is float64 but the router and its gate g(r) = sigmoid(r) compute in float32 by
# design. A float32 sigmoid can differ by one ulp (~6e-8 relative) depending on the shape of
# the tensor it runs in (vectorised vs scalar tail), and the compacted shapes differ between
# paths (full forward, a changed future, decode): logits then agree to ~1e-7. 1e-6 bounds
# that with margin; a wrong mask or a misplaced cache slot moves logits by O(0.1-1).
F64_TOL = 1e-6
# A changed future token must move later logits by more than this, or the test proves nothing.
EFFECT_FLOOR = 1e-3

S = 16
PATTERNS = {
    "mod": (["dense", "mod"], {}),
    "mode_staged": (["mode_staged", "dense"], {"moe": {"n_experts": 4}}),
    "mode_integrated": (["mode_integrated"], {"moe": {"n_experts": 4, "n_noop": 2}}),
    "moe_token_choice": (["moe", "mod"], {"moe": {"n_experts": 4, "scheme": "token_choice", "top_k": 2}}),
    "mode_staged_token_choice": (["mode_staged", "dense"], {"moe": {"n_experts": 4, "scheme": "token_choice", "top_k": 2}}),
    "dense": (["dense"], {}),
}


def make_config(pattern: str, causal: str = "aux_loss", n_layers: int = 2, **routing):
    blocks, extra = PATTERNS[pattern]
    raw = {
        "model": {"d_model": 32, "n_heads": 4, "n_layers": n_layers, "d_ff": 64, "max_seq_len": 48,
                  "block_pattern": blocks},
        "routing": {"causal": causal, "capacity": 0.25, "predictor_hidden": 16, **routing},
        "data": {"seq_len": S},
        **extra,
    }
    return config_from_dict(raw)


def make_model(pattern: str, causal: str = "aux_loss", n_layers: int = 2, **routing) -> LanguageModel:
    """float64, weights of size ~1/sqrt(fan_in) so every layer moves the output visibly;
    routers and predictors scaled so their causal decisions split the tokens."""
    torch.manual_seed(0)
    return spread_weights_(LanguageModel(make_config(pattern, causal, n_layers, **routing)).double().eval())


@torch.no_grad()
def spread_weights_(model: LanguageModel) -> LanguageModel:
    """Every weight drawn anew from the global generator: norm gains near 1, matrices of size
    ~1/sqrt(fan_in) (an expert's (E, fan_in, out) too), other vectors (biases) of size 0.3."""
    for name, p in model.named_parameters():
        if "norm" in name:
            p.copy_(1.0 + 0.2 * torch.randn_like(p))
        elif p.dim() >= 2:
            p.copy_(torch.randn_like(p) / math.sqrt(p.shape[-2] if p.dim() == 3 else p.shape[1]))
        else:
            p.copy_(0.3 * torch.randn_like(p))
    return model


@torch.no_grad()
def decoded_logits(model: LanguageModel, tokens: torch.Tensor, prompt: int, routed_rows: str) -> torch.Tensor:
    """The decoder's logits for positions prompt-1 .. S-1 of tokens (B, S): a prefill of the first
    `prompt` tokens, then one step per token."""
    decoder = Decoder(model, tokens.shape[0], tokens.shape[1], routed_rows=routed_rows)
    logits = [decoder.prefill(tokens[:, :prompt].tolist())]
    for t in range(prompt, tokens.shape[1]):
        logits.append(decoder.step(tokens[:, t]))
    return torch.stack(logits, 1)  # (B, S - prompt + 1, V)


def decisions(model: LanguageModel, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Per MoD layer, the (B, S) causal choice made in the full causal forward."""
    out = model(tokens, routing_mode="causal")
    masks = []
    for r in out.routings:
        if r is not None:
            mask = torch.zeros(tokens.shape, dtype=torch.bool).scatter_(1, r.positions, r.gates != 0)
            masks.append(mask)
    return masks


# ----------------------------------------------------------------------------- causality
@pytest.mark.parametrize("causal", ["aux_loss", "predictor"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_causal_routing_never_looks_ahead(pattern: str, causal: str) -> None:
    model = make_model(pattern, causal)
    tokens = torch.randint(0, 256, (3, S))
    base = model(tokens, routing_mode="causal").logits
    for t in (0, 5, S - 2):
        changed = tokens.clone()
        changed[:, t + 1:] = torch.randint(0, 256, (3, S - t - 1))
        other = model(changed, routing_mode="causal").logits
        assert (other[:, : t + 1] - base[:, : t + 1]).abs().max() <= F64_TOL
        assert (other[:, t + 1:] - base[:, t + 1:]).abs().max() > EFFECT_FLOOR
    # ... whereas top-k routing does look ahead (the reason this exists)
    if pattern in ("mod", "mode_staged", "mode_integrated"):
        changed = tokens.clone()
        changed[:, S // 2:] = torch.randint(0, 256, (3, S - S // 2))
        topk_a, topk_b = model(tokens).logits, model(changed).logits
        assert (topk_a[:, : S // 2] - topk_b[:, : S // 2]).abs().max() > EFFECT_FLOOR


def test_causal_mode_routes_a_variable_number_of_tokens() -> None:
    model = make_model("mod", "aux_loss")
    tokens = torch.randint(0, 256, (4, S))
    chosen = decisions(model, tokens)[0]
    counts = chosen.sum(1)
    assert counts.min() != counts.max() or counts.max() != round(0.25 * S)  # not top-k's fixed k
    router = model.blocks[1].router
    with torch.no_grad():
        x = model.blocks[0](model.embed(tokens), model.rotary.prefix(S))[0]
        assert torch.equal(chosen, router.router(x).squeeze(-1) > 0)  # method (a): sigmoid(logit) > 0.5


# ----------------------------------------------------------------------------- cached decode
@pytest.mark.parametrize("routed_rows", ["gather", "masked"])
@pytest.mark.parametrize("causal", ["aux_loss", "predictor"])
@pytest.mark.parametrize("pattern", list(PATTERNS))
def test_cached_decode_matches_full_causal_forward(pattern: str, causal: str, routed_rows: str) -> None:
    model = make_model(pattern, causal, n_layers=3)
    tokens = torch.randint(0, 256, (2, S))
    full = model(tokens, routing_mode="causal").logits.float()  # (B, S, V)
    prompt = 5
    got = decoded_logits(model, tokens, prompt, routed_rows)  # positions prompt-1 .. S-1
    assert (got - full[:, prompt - 1:]).abs().max() <= F64_TOL


@pytest.mark.parametrize("routed_rows", ["gather", "masked"])
@pytest.mark.parametrize("pattern", ["mod", "mode_staged", "mode_integrated", "dense"])
def test_padded_batch_equals_prompts_one_by_one(pattern: str, routed_rows: str) -> None:
    model = make_model(pattern, "aux_loss", n_layers=3)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (3, 9, 6)]
    follow = torch.randint(0, 256, (3, 5))
    batch = Decoder(model, 3, 20, routed_rows=routed_rows)
    batched = [batch.prefill(prompts)] + [batch.step(follow[:, i]) for i in range(5)]
    for row, prompt in enumerate(prompts):
        one = Decoder(model, 1, 20)
        alone = [one.prefill([prompt])] + [one.step(follow[row : row + 1, i]) for i in range(5)]
        for a, b in zip(alone, batched):
            assert (a[0] - b[row]).abs().max() <= F64_TOL
    # and the generate() API: greedy continuations equal
    together = generate(model, prompts, max_new_tokens=6, temperature=0)
    apart = [generate(model, [p], max_new_tokens=6, temperature=0)[0] for p in prompts]
    assert together == apart


@pytest.mark.parametrize("routed_rows", ["gather", "masked"])
def test_finished_rows_compute_nothing_and_leave_the_others_unchanged(routed_rows: str) -> None:
    model = make_model("mod", "aux_loss", n_layers=4)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (4, 7, 7)]
    follow = torch.randint(0, 256, (3, 6))
    active = torch.tensor([True, False, True])
    batch = Decoder(model, 3, 20, routed_rows=routed_rows)
    batch.prefill(prompts)
    before = [(int(c.lengths[1]), c.k[1].clone(), c.v[1].clone()) for c in batch.caches]
    got = [batch.step(follow[:, i], active) for i in range(6)]
    for row in (0, 2):
        one = Decoder(model, 1, 20)
        one.prefill([prompts[row]])
        alone = [one.step(follow[row : row + 1, i]) for i in range(6)]
        for a, b in zip(alone, got):
            assert (a[0] - b[row]).abs().max() <= F64_TOL
    for cache, (length, k, v) in zip(batch.caches, before):  # the finished row: no trace in the cache
        # (masked: the row writes only its scratch slot, past every length; the test reads up to max_len)
        k, v = k[:, : batch.max_len], v[:, : batch.max_len]
        assert int(cache.lengths[1]) == length and torch.equal(cache.k[1, :, : batch.max_len], k) and torch.equal(cache.v[1, :, : batch.max_len], v)
    assert batch.positions.tolist() == [10, 7, 13]


# ----------------------------------------------------------------------------- sparse caches
def test_skipped_tokens_are_absent_from_the_layer_cache_and_invisible() -> None:
    model = make_model("mod", "aux_loss")
    block = model.blocks[1]
    assert isinstance(block, MoDBlock)
    torch.manual_seed(1)
    x = torch.randn(2, S, 32, dtype=torch.float64)
    positions = torch.arange(S).expand(2, S)
    select = torch.rand(2, S) < 0.4
    select[:, 0] = True
    cache = LayerCache.empty(2, S, 4, 8, torch.float64, torch.device("cpu"))
    out = layer_step(block, cache, model.rotary, x, positions, select)
    assert cache.lengths.tolist() == select.sum(1).tolist()  # one cache slot per processed token
    assert torch.equal(out[~select], x[~select])  # skipped tokens pass untouched
    # Change the skipped tokens' hidden states: nothing the layer computes for others changes,
    # and the cache holds exactly the same keys and values.
    x2 = torch.where(select.unsqueeze(-1), x, torch.randn_like(x))
    cache2 = LayerCache.empty(2, S, 4, 8, torch.float64, torch.device("cpu"))
    out2 = layer_step(block, cache2, model.rotary, x2, positions, select)
    assert torch.equal(out2[select], out[select])
    for b in range(2):
        n = int(select[b].sum())
        assert torch.equal(cache.k[b, :, :n], cache2.k[b, :, :n]) and torch.equal(cache.v[b, :, :n], cache2.v[b, :, :n])
    # A decode step for a token the layer skips leaves its cache alone and costs nothing.
    step_x = torch.randn(2, 1, 32, dtype=torch.float64)
    before = cache.lengths.clone()
    same = layer_step(block, cache, model.rotary, step_x, torch.full((2, 1), S - 1), torch.zeros(2, 1, dtype=torch.bool))
    assert torch.equal(same, step_x) and torch.equal(cache.lengths, before)


def test_prefill_caches_hold_only_processed_tokens() -> None:
    model = make_model("mod", "aux_loss", n_layers=4)
    tokens = torch.randint(0, 256, (3, S))
    masks = decisions(model, tokens)
    decoder = Decoder(model, 3, S)
    decoder.prefill(tokens.tolist())
    routed = [c for b, c in zip(model.blocks, decoder.caches) if isinstance(b, MoDBlock)]
    dense = [c for b, c in zip(model.blocks, decoder.caches) if not isinstance(b, MoDBlock)]
    for cache, mask in zip(routed, masks):
        assert cache.lengths.tolist() == mask.sum(1).tolist()
        assert (cache.lengths < S).any()  # some tokens really skipped
    for cache in dense:
        assert cache.lengths.tolist() == [S] * 3


# ----------------------------------------------------------------------------- training losses
def test_predictor_loss_never_reaches_the_language_model() -> None:
    model = make_model("mod", "predictor")
    model.train()
    tokens = torch.randint(0, 256, (2, S))
    out = model(tokens, tokens)
    params = dict(model.named_parameters())
    predictor = {n for n in params if ".predictor." in n}
    assert predictor
    grads = torch.autograd.grad(out.aux_loss, list(params.values()), allow_unused=True)
    for name, g in zip(params, grads):
        if name in predictor:
            assert g is not None and g.abs().sum() > 0
        else:
            assert g is None or torch.count_nonzero(g) == 0, name


def test_aux_loss_method_adds_the_bce_on_router_logits() -> None:
    model = make_model("mod", "aux_loss", causal_loss_weight=0.3)
    tokens = torch.randint(0, 256, (2, S))
    out = model(tokens, tokens)
    routing = out.routings[1]
    member = token_mask(routing.positions, S).double()
    bce = F.binary_cross_entropy_with_logits(routing.logits, member.to(routing.logits.dtype))
    assert torch.allclose(out.aux_loss.double(), 0.3 * bce.double(), atol=1e-6)
    # its gradient reaches the router (method (a) trains the router itself)
    grad = torch.autograd.grad(out.aux_loss, model.blocks[1].router.router.proj.weight)[0]
    assert grad.abs().sum() > 0
    assert 0.0 <= float(routing.stats["causal_accuracy"]) <= 1.0


def test_integrated_mode_has_per_expert_causal_decision() -> None:
    model = make_model("mode_integrated", "aux_loss")
    tokens = torch.randint(0, 256, (2, S))
    out = model(tokens, tokens)
    r = out.ffn_routings[0]
    assert {"causal_accuracy", "causal_fraction", "causal_bce"} <= set(r.stats)
    router = model.blocks[0].ffn.router
    assert isinstance(router, ExpertChoiceRouter) and router.causal is not None


def test_model_trained_without_causal_routing_cannot_sample() -> None:
    model = make_model("mod", "none")
    with pytest.raises(ValueError, match="routing.causal"):
        model(torch.randint(0, 256, (1, S)), routing_mode="causal")
    with pytest.raises(ValueError, match="routing.causal"):
        generate(model, [[1, 2, 3]], max_new_tokens=2)
    with pytest.raises(ValueError, match="routing_mode"):
        model(torch.randint(0, 256, (1, S)), routing_mode="future")


def test_evaluation_reports_causal_accuracy_and_both_losses(tmp_path: Path) -> None:
    corpus = tmp_path / "c.txt"
    corpus.write_text("def f(x):\n    return x + 1\n" * 400)
    raw = {
        "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 32,
                  "block_pattern": ["dense", "mod"]},
        "routing": {"capacity": 0.25, "causal": "aux_loss"},
        "data": {"source": "text", "path": str(corpus), "seq_len": 32},
        "train": {"batch_size": 2, "max_steps": 2, "eval_batches": 2, "out_dir": str(tmp_path / "run"),
                  "progress": False, "device": "cpu"},
    }
    result = Trainer(config_from_dict(raw)).evaluate()
    assert math.isfinite(result["val_loss"]) and math.isfinite(result["val_loss_causal"])
    layer = result["routing"]["layer1"]
    assert 0.0 <= layer["causal_accuracy"] <= 1.0
    assert 0.0 <= layer["causal_fraction"] <= 1.0 and 0.0 <= layer["causal_processed"] <= 1.0
    raw["routing"]["causal"] = "none"
    raw["train"]["out_dir"] = str(tmp_path / "run2")
    assert "val_loss_causal" not in Trainer(config_from_dict(raw)).evaluate()


# ----------------------------------------------------------------------------- generate API
def test_dense_model_generates_text_and_respects_stops() -> None:
    model = make_model("dense", "none")
    texts = generate(model, ["ab", "hello"], max_new_tokens=4, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    assert len(texts) == 2 and all(isinstance(t, str) for t in texts)
    again = generate(model, ["ab", "hello"], max_new_tokens=4, temperature=0.8, top_k=20, top_p=0.9, seed=3)
    assert texts == again
    greedy = generate(model, [[1, 2, 3]], max_new_tokens=5, temperature=0)[0]
    assert len(greedy) == 5
    stopped = generate(model, [[1, 2, 3]], max_new_tokens=5, temperature=0, stop_tokens=[greedy[2]])[0]
    assert stopped == greedy[: greedy.index(greedy[2])]


def sync_tokens(decoder: Decoder, logits: torch.Tensor, room: list[int], stops: set[int], draw) -> list[list[int]]:
    """The reference loop: the host reads each step's tokens before it queues the next step."""
    outputs: list[list[int]] = [[] for _ in room]
    active = [r > 0 for r in room]
    while any(active):
        sampled = draw(logits)
        for i, token in enumerate(sampled.tolist()):
            if active[i] and token in stops:
                active[i] = False
            elif active[i]:
                outputs[i].append(token)
                active[i] = len(outputs[i]) < room[i]
        if not any(active):
            break
        logits = decoder.step(sampled, torch.tensor(active))
    return outputs


class CountingDecoder(Decoder):
    steps = 0

    def step(self, tokens, active=None):
        self.steps += 1
        return super().step(tokens, active)


@pytest.mark.parametrize("routed_rows", ["gather", "masked"])
def test_tokens_read_a_step_late_are_the_tokens_read_at_once(routed_rows: str) -> None:
    """decode_tokens queues step t + 1 before reading step t's tokens: the same tokens as the loop
    that reads first, with stop tokens met and rooms running out at different steps, in at most one
    step more (the one a row computes after its stop token). read_ahead=False: the reference's steps."""

    model = make_model("mod", "aux_loss")  # max_seq_len 48
    prompts = [[3, 1, 4], [1, 5] * 20, [9, 2, 6, 5], [5] * 48]  # room: 12, 8, 12, 0
    room = [min(12, 48 - len(p)) for p in prompts]

    def run(loop, stops: set[int]) -> tuple[list[list[int]], int]:
        decoder = CountingDecoder(model, len(prompts), 48, routed_rows=routed_rows)
        generator = torch.Generator().manual_seed(7)
        draw = lambda logits: sample(logits, 1.3, 0, 1.0, generator)  # noqa: E731
        return loop(decoder, decoder.prefill(prompts), room, stops, draw), decoder.steps

    free, _ = run(sync_tokens, set())
    assert [len(o) for o in free] == room
    cases = [set(), {free[0][2]}, {free[0][5], free[2][1]}, {free[1][-1]}, {free[0][0], free[1][0], free[2][0]}]
    read_first = functools.partial(decode_tokens, read_ahead=False)
    for stops in cases:
        want, want_steps = run(sync_tokens, stops)
        assert run(read_first, stops) == (want, want_steps)
        got, got_steps = run(decode_tokens, stops)
        assert got == want, stops
        # room runs out at a step known ahead: a step more only where a stop token was read late
        assert want_steps <= got_steps <= want_steps + bool(stops), (stops, want_steps, got_steps)
    assert any(len(o) < r for o, r in zip(run(decode_tokens, cases[2])[0], room))  # a stop token cut a row


def generations(model: LanguageModel, decoder: Decoder | None) -> list[list[list[int]]]:
    """Three generate calls (prompts of other lengths, a stop token, seeded sampling), with the
    decoder given (reset and reused by each) or a fresh one each."""
    calls = [([[3, 1, 4], [1, 5, 9, 2, 6]], {}), ([[5] * 11, [8]], {"stop_tokens": [7, 11]}),
             ([[2, 7], [1, 8, 2, 8]], {"temperature": 0})]
    return [generate(model, prompts, max_new_tokens=6, seed=5, decoder=decoder, **how) for prompts, how in calls]


@pytest.mark.parametrize("pattern", ["mod", "mode_staged", "dense"])
@pytest.mark.parametrize("routed_rows", ["gather", "masked"])
def test_a_reused_decoder_generates_as_a_fresh_one(pattern: str, routed_rows: str) -> None:
    """generate(decoder=...) resets the decoder each call: the same tokens as a new decoder per call,
    and after the router is trained in place, the tokens of the router as it is now."""
    model = make_model(pattern)
    decoder = Decoder(model, 2, 48, routed_rows=routed_rows)
    assert generations(model, decoder) == generations(model, None)
    with torch.no_grad():  # a step of training, in place: every routed decision moves
        for block in model.blocks:
            if isinstance(block, MoDBlock):
                block.router.router.proj.weight.neg_()
    fresh = generations(model, None)
    assert generations(model, decoder) == fresh
    if pattern != "dense":
        with torch.no_grad():
            for block in model.blocks:
                if isinstance(block, MoDBlock):
                    block.router.router.proj.weight.neg_()
        assert generations(model, None) != fresh  # the routers' change showed in the tokens


def test_a_decoder_that_cannot_serve_a_call_is_named() -> None:
    model = make_model("mod")
    with pytest.raises(ValueError, match="decoder: it was built for another model"):
        generate(model, [[1, 2]], max_new_tokens=2, decoder=Decoder(make_model("mod"), 1, 8))
    with pytest.raises(ValueError, match="decoder: it was built for batch 2, but 1 prompts"):
        generate(model, [[1, 2]], max_new_tokens=2, decoder=Decoder(model, 2, 8))
    with pytest.raises(ValueError, match="decoder: its max_len 8 is below the 12"):
        generate(model, [[1, 2]], max_new_tokens=10, decoder=Decoder(model, 1, 8))


def test_a_decoder_over_replaced_weights_is_refused() -> None:
    """Weights changed in place keep a decoder serving (its graph reads them where they are); weights
    replaced by new tensors (load_state_dict(assign=True), model.to(dtype)) are refused by
    generate, naming decoder, and by Decoder.reset."""
    model = make_model("mod")
    decoder = Decoder(model, 1, 8)
    with torch.no_grad():
        model.lm_head.weight.mul_(2.0)
    assert not decoder.weights_replaced()
    assert len(generate(model, [[1, 2]], max_new_tokens=2, temperature=0, decoder=decoder)[0]) == 2
    model.load_state_dict({k: v.clone() for k, v in model.state_dict().items()}, assign=True)
    assert decoder.weights_replaced()
    with pytest.raises(ValueError, match="decoder: the model's weights were replaced"):
        generate(model, [[1, 2]], max_new_tokens=2, decoder=decoder)
    with pytest.raises(ValueError, match="Decoder.reset: the model's weights were replaced"):
        decoder.reset()
    fresh = Decoder(model, 1, 8)
    assert not fresh.weights_replaced()
    model.to(torch.float32 if model.embed.weight.dtype != torch.float32 else torch.float64)
    assert fresh.weights_replaced()


def test_generation_stops_at_the_context_window() -> None:
    model = make_model("mod", "aux_loss")
    out = generate(model, [[5] * 45], max_new_tokens=10, temperature=0)[0]
    assert len(out) == 48 - 45


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"prompts": [[]]}, "empty"),
        ({"prompts": [[1] * 49]}, "context window"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"prompts": [[300]]}, "vocabulary"),
        ({"prompts": []}, "non-empty"),
    ],
)
def test_bad_input_is_a_clear_error(kwargs: dict, match: str) -> None:
    model = make_model("mod", "aux_loss")
    args = {"prompts": [[1, 2]], "max_new_tokens": 2, **kwargs}
    with pytest.raises(ValueError, match=match):
        generate(model, **args)


def test_cli_errors_exit_2_and_cli_samples(tmp_path: Path, capsys) -> None:
    assert main(["--checkpoint", str(tmp_path / "missing"), "--prompt", "x"]) == 2
    assert "not found" in capsys.readouterr().err
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": 1}, foreign)
    assert main(["--checkpoint", str(foreign), "--prompt", "x"]) == 2
    assert "not a mode checkpoint" in capsys.readouterr().err
    model = make_model("mod", "aux_loss").float()
    ckpt = tmp_path / "checkpoint.pt"
    torch.save({"format": "mode-checkpoint-v1", "config": model.config.to_dict(), "model": model.state_dict()}, ckpt)
    assert main(["--checkpoint", str(ckpt), "--prompt", "x", "--temperature", "-1"]) == 2
    assert "temperature" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path), "--prompt", "", "--greedy"]) == 2
    assert "empty" in capsys.readouterr().err
    assert main(["--checkpoint", str(tmp_path), "--prompt", "ab", "--max-new-tokens", "3", "--greedy", "--device", "cpu"]) == 0
    assert capsys.readouterr().out.startswith("ab")


def save_checkpoint(model: LanguageModel, path: Path) -> Path:
    """A checkpoint.pt as mode.train writes it (float32 weights)."""
    torch.save({"format": "mode-checkpoint-v1", "config": model.config.to_dict(), "model": model.float().state_dict()}, path)
    return path


@pytest.fixture(scope="module")
def byte_ckpt(tmp_path_factory) -> Path:
    """A byte-level model (max_seq_len 48) saved as a checkpoint."""
    return save_checkpoint(make_model("mod", "aux_loss"), tmp_path_factory.mktemp("byte") / "checkpoint.pt")


@pytest.fixture(scope="module")
def token_ckpt(tmp_path_factory) -> Path:
    """A model trained on pre-tokenized ids (data.source tokens, vocab 1000) saved as a checkpoint."""
    raw = make_config("mod").to_dict()
    raw["model"]["vocab_size"] = 1000
    raw["data"].update(source="tokens", path="corpus.bin")
    torch.manual_seed(0)
    model = LanguageModel(config_from_dict(raw))
    return save_checkpoint(model, tmp_path_factory.mktemp("tokens") / "checkpoint.pt")


def greedy(ckpt: Path, prompts: list, n: int, device_flag: str = "auto") -> list:
    """What generate() gives for the checkpoint the CLI loads, on the device the CLI's --device picks and
    in the dtype --dtype auto gives there: the reference for its output."""
    from mode.generate import sampling_dtype
    from mode.utils import pick_device

    device = pick_device(device_flag)
    model = load_model(ckpt, device).to(sampling_dtype("auto", device))
    return generate(model, prompts, max_new_tokens=n, temperature=0)


def test_cli_token_model_reads_prompt_ids_and_prints_ids(token_ckpt: Path, capsys) -> None:
    base = ["--checkpoint", str(token_ckpt), "--greedy", "--max-new-tokens", "6", "--device", "cpu"]
    assert main(base + ["--prompt-ids", "3 999, 7", "--prompt-ids", "12,0"]) == 0
    new = greedy(token_ckpt, [[3, 999, 7], [12, 0]], 6, "cpu")
    assert any(t >= 256 for row in new for t in row)  # ids a byte decoder would have dropped
    rows = [" ".join(map(str, ids)) for ids in ([3, 999, 7] + new[0], [12, 0] + new[1])]
    assert capsys.readouterr().out == f"--- sample 1 ---\n{rows[0]}\n--- sample 2 ---\n{rows[1]}\n"
    with pytest.raises(ValueError, match="reads token ids"):  # the Python API refuses text too
        generate(load_model(token_ckpt), ["hello"], max_new_tokens=2)


@pytest.mark.parametrize(
    "prompt_args, message",
    [
        (["--prompt", "hello"], 'error: --prompt: this model reads token ids (data.source \'tokens\', '
                                'model.vocab_size 1000), not text; give the prompt as --prompt-ids "12 7 99"'),
        (["--prompt-ids", "5 1000"], "error: --prompt-ids '5 1000': token id 1000 is outside the vocabulary "
                                     "[0, 1000) of this model (model.vocab_size)"),
        (["--prompt-ids", "-1"], "error: --prompt-ids '-1': token id -1 is outside the vocabulary "
                                 "[0, 1000) of this model (model.vocab_size)"),
        (["--prompt-ids", "5 x"], "error: --prompt-ids '5 x': 'x' is not an integer token id "
                                  "(give ids separated by spaces or commas)"),
        (["--prompt-ids", "1", "--prompt-ids", " , "], "error: --prompt-ids #2 is empty: a prompt needs at least one token"),
        (["--prompt-ids", "1", "--prompt", "a"], "error: give exactly one of --prompt (text) and --prompt-ids (token ids)"),
        ([], "error: give exactly one of --prompt (text) and --prompt-ids (token ids)"),
    ],
    ids=["text-prompt", "id-past-vocab", "negative-id", "not-an-int", "empty", "both-flags", "no-prompt"],
)
def test_cli_prompt_errors_name_the_flag(token_ckpt: Path, capsys, prompt_args: list, message: str) -> None:
    assert main(["--checkpoint", str(token_ckpt), "--device", "cpu"] + prompt_args) == 2
    captured = capsys.readouterr()
    assert captured.err == message + "\n" and captured.out == ""


def test_cli_prompt_ids_on_a_byte_level_model_print_ids(byte_ckpt: Path, capsys) -> None:
    assert main(["--checkpoint", str(byte_ckpt), "--prompt-ids", "104 105", "--greedy", "--max-new-tokens", "5"]) == 0
    new = greedy(byte_ckpt, [[104, 105]], 5)[0]
    assert capsys.readouterr().out == " ".join(map(str, [104, 105] + new)) + "\n"


def test_cli_separates_several_text_samples_and_not_one(byte_ckpt: Path, capsys) -> None:
    base = ["--checkpoint", str(byte_ckpt), "--greedy", "--max-new-tokens", "8"]
    assert main(base + ["--prompt", "a\nb", "--prompt", "cd"]) == 0
    first, second = greedy(byte_ckpt, ["a\nb", "cd"], 8)
    assert capsys.readouterr().out == f"--- sample 1 ---\na\nb{first}\n--- sample 2 ---\ncd{second}\n"
    assert main(base + ["--prompt", "cd"]) == 0
    assert capsys.readouterr().out == f"cd{second}\n"  # one sample: the text alone, for pipes


def test_cli_says_when_the_context_window_cuts_generation(byte_ckpt: Path, capsys) -> None:
    base = ["--checkpoint", str(byte_ckpt), "--greedy"]
    assert main(base + ["--prompt-ids", " ".join(["5"] * 45), "--max-new-tokens", "10"]) == 0  # max_seq_len 48
    captured = capsys.readouterr()
    assert len(captured.out.split()) == 48
    assert captured.err == ("note: generated 3 new tokens, not --max-new-tokens 10: the prompt (45 tokens) and the "
                            "output fill the context window model.max_seq_len (48)\n")
    assert main(base + ["--prompt-ids", "5 5", "--prompt-ids", " ".join(["5"] * 46), "--max-new-tokens", "3"]) == 0
    captured = capsys.readouterr()
    assert captured.err.startswith("note: sample 2: generated 2 new tokens, not --max-new-tokens 3:")
    assert captured.err.count("\n") == 1  # sample 1 got its 3 tokens: no note
    assert main(base + ["--prompt-ids", "5 5", "--max-new-tokens", "46"]) == 0  # exactly fills it: asked for, no note
    assert capsys.readouterr().err == ""
    # a prompt that fills the window leaves no room at all: an error, not an empty sample
    assert main(base + ["--prompt", "a" * 48, "--max-new-tokens", "1"]) == 2
    assert capsys.readouterr().err == ("error: --prompt has 48 UTF-8 bytes, the whole context window "
                                       "model.max_seq_len (48): no room to generate\n")
    assert main(base + ["--prompt", "a" * 48, "--max-new-tokens", "0"]) == 0  # nothing asked: nothing lost
    assert capsys.readouterr().out == "a" * 48 + "\n"


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--temperature", "5"], "--temperature"),
        (["--top-k", "3"], "--top-k"),
        (["--top-p", "0.9", "--temperature", "0.5"], "--temperature, --top-p"),
    ],
    ids=["temperature", "top-k", "top-p-and-temperature"],
)
def test_cli_greedy_with_sampling_flags_is_an_error(byte_ckpt: Path, capsys, flags: list, named: str) -> None:
    assert main(["--checkpoint", str(byte_ckpt), "--prompt", "ab", "--greedy"] + flags) == 2
    assert capsys.readouterr().err == f"error: --greedy takes the argmax and would ignore {named}: drop one or the other\n"


def test_cli_greedy_agrees_with_temperature_zero(byte_ckpt: Path, capsys) -> None:
    assert main(["--checkpoint", str(byte_ckpt), "--prompt", "ab", "--greedy", "--temperature", "0", "--max-new-tokens", "3"]) == 0
    assert capsys.readouterr().out == "ab" + greedy(byte_ckpt, ["ab"], 3)[0] + "\n"


def test_cli_cuda_without_a_device_names_the_flag(byte_ckpt: Path, capsys, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["--checkpoint", str(byte_ckpt), "--prompt", "ab", "--device", "cuda"]) == 2
    assert capsys.readouterr().err == "error: --device is 'cuda' but no CUDA device is available\n"


def test_masked_and_gathered_routed_rows_build_the_same_sparse_caches() -> None:
    """routed_rows="masked" (the static step) computes every row but caches only the chosen
    tokens, at the same slots as "gather", which computes only the chosen rows."""
    model = make_model("mod", "aux_loss", n_layers=4)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (4, 9, 7)]
    follow = torch.randint(0, 256, (3, 8))
    decoders = {rows: Decoder(model, 3, 24, routed_rows=rows) for rows in ("gather", "masked")}
    for decoder in decoders.values():
        decoder.prefill(prompts)
        for i in range(8):
            decoder.step(follow[:, i])
    gather, masked = decoders["gather"], decoders["masked"]
    skipped = False
    for block, a, b in zip(model.blocks, gather.caches, masked.caches):
        assert a.lengths.tolist() == b.lengths.tolist()
        if isinstance(block, MoDBlock):
            assert b.lengths_dev is not None  # the static step keeps the lengths on the device
            skipped |= bool((b.lengths < masked.positions).any())  # some decode or prompt token skipped it
        for row, n in enumerate(a.lengths.tolist()):
            assert (a.kv[:, row, :n] - b.kv[:, row, :n]).abs().max() <= F64_TOL
    assert skipped
    buffers = [c.lengths_dev for c in masked.caches]
    for decoder in decoders.values():  # a later prefill first makes the host lengths exact again
        decoder.prefill([[1, 2]] * 3)
    assert all(c.lengths_dev is None for c in masked.caches)
    for decoder in decoders.values():
        for i in range(2):
            decoder.step(follow[:, i])
    # the static step goes on in the same device buffers (those a captured CUDA graph updates)
    assert all(c.lengths_dev is b for c, b in zip(masked.caches, buffers))
    for a, b in zip(gather.caches, masked.caches):
        assert a.lengths.tolist() == b.lengths.tolist()


@pytest.mark.parametrize("routed_rows", ["gather", "masked"])
def test_a_step_with_no_active_row_computes_nothing(routed_rows: str) -> None:
    model = make_model("mod", "aux_loss", n_layers=2)
    decoder = Decoder(model, 2, 12, routed_rows=routed_rows)
    decoder.prefill([[1, 2, 3], [4, 5]])
    caches = [c.kv.clone() for c in decoder.caches]
    lengths = [c.lengths.clone() for c in decoder.caches]
    logits = decoder.step(torch.tensor([7, 8]), torch.tensor([False, False]))
    assert logits.shape == (2, 256) and decoder.positions.tolist() == [3, 2]
    for cache, kv, n in zip(decoder.caches, caches, lengths):
        assert torch.equal(cache.kv, kv) and torch.equal(cache.lengths, n)


def test_routed_rows_policy_is_checked() -> None:
    with pytest.raises(ValueError, match="routed_rows"):
        Decoder(make_model("mod"), 1, 8, routed_rows="sometimes")


# ----------------------------------------------------------------------------- GPU: the captured step
needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs and flash attention need a GPU")


@needs_gpu
def test_cuda_graph_replays_the_static_step_exactly() -> None:
    """The captured step runs the same kernels as the eager static step: identical logits and caches."""
    model = make_model("mod", "aux_loss", n_layers=4).to("cuda", torch.bfloat16)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (4, 9, 7)]
    follow = torch.randint(0, 256, (3, 8), device="cuda")
    active = torch.tensor([True, False, True])
    graphed = Decoder(model, 3, 32, routed_rows="masked", cuda_graph=True)
    eager = Decoder(model, 3, 32, routed_rows="masked", cuda_graph=False, compact_rows=graphed.compact_rows)
    assert graphed._flash_varlen and eager._flash_varlen
    for decoder in (graphed, eager):
        decoder.prefill(prompts)
    for i in range(8):
        act = active if i >= 4 else None  # row 1 finishes halfway
        assert torch.equal(graphed.step(follow[:, i], act), eager.step(follow[:, i], act))
    assert graphed._graph is not None and eager._graph is None
    for a, b in zip(graphed.caches, eager.caches):
        assert torch.equal(a.lengths, b.lengths) and torch.equal(a.kv[:, :, :-1], b.kv[:, :, :-1])
    # A second prefill, then the same graph again: it reads the lengths the prefill left.
    graph = graphed._graph
    for decoder in (graphed, eager):
        decoder.prefill([[3, 1], [4, 1], [5, 9]])
    for i in range(3):
        assert torch.equal(graphed.step(follow[:, i]), eager.step(follow[:, i]))
    assert graphed._graph is graph
    for a, b in zip(graphed.caches, eager.caches):
        assert torch.equal(a.lengths, b.lengths)


@needs_gpu
def test_a_reused_decoder_replays_its_first_cuda_graph() -> None:
    """generate(decoder=...) on a GPU captures the step once, in the first call, and every later call
    replays that graph: the tokens of a fresh decoder per call (bf16, greedy and seeded)."""
    model = make_model("mod", "aux_loss", n_layers=4).to("cuda", torch.bfloat16)
    decoder = Decoder(model, 2, 48)
    assert decoder.cuda_graph
    first = generations(model, decoder)
    graph = decoder._graph
    assert graph is not None
    assert generations(model, decoder) == first == generations(model, None)
    assert decoder._graph is graph


@needs_gpu
def test_flash_varlen_attention_equals_masked_sdpa() -> None:
    """Decoder._attend: flash's variable-length kernel (reads used slots only) == SDPA with a length mask."""
    model = make_model("mod", "aux_loss").to("cuda", torch.bfloat16)
    decoder = Decoder(model, 5, 40, routed_rows="masked")
    cache = decoder.caches[0]
    cache.kv.normal_()
    q = torch.randn(5, 4, 8, device="cuda", dtype=torch.bfloat16)
    used = torch.tensor([1, 7, 40, 16, 33], device="cuda")
    flash = decoder._attend(q, cache, used)
    decoder._flash_varlen = False
    masked = decoder._attend(q, cache, used)
    # bf16 inputs, float32 accumulation in both: outputs of size ~1 agree to a few bf16 ulps.
    torch.testing.assert_close(flash, masked, rtol=0, atol=2e-2)


@pytest.mark.parametrize("pattern", ["mod", "mode_staged_token_choice"])
def test_compiled_static_step_matches_the_eager_one(pattern: str) -> None:
    """Decoder(compile=True): one torch.compile of each static-step piece serves every layer, an MoE
    FFN's static pass included."""
    model = make_model(pattern, "aux_loss", n_layers=3)
    torch.manual_seed(9)
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in (4, 9)]
    follow = torch.randint(0, 256, (2, 5))
    runs = []
    for compile in (False, True):
        decoder = Decoder(model, 2, 20, routed_rows="masked", compile=compile)
        runs.append([decoder.prefill(prompts)] + [decoder.step(follow[:, i]) for i in range(5)])
    for eager, compiled in zip(*runs):
        assert (eager - compiled).abs().max() <= F64_TOL
    with pytest.raises(ValueError, match="compile"):
        Decoder(model, 2, 20, routed_rows="gather", compile=True)


def test_a_row_at_the_context_window_waits_while_the_others_decode() -> None:
    """The static step computes every row: a finished row at the last position must not index
    past the rotary table (positions are clamped), and the others go on unchanged."""
    model = make_model("mod", "aux_loss")  # max_seq_len 48
    outputs = {}
    for rows in ("gather", "masked"):
        decoder = Decoder(model, 2, 48, routed_rows=rows)
        decoder.prefill([[5] * 47, [6] * 3])
        decoder.step(torch.tensor([1, 2]))  # row 0 reaches position 48: the context is full
        outputs[rows] = [decoder.step(torch.tensor([0, 3 + i]), torch.tensor([False, True]))[1] for i in range(4)]
    for a, b in zip(outputs["gather"], outputs["masked"]):
        assert (a - b).abs().max() <= F64_TOL


# ----------------------------------------------------------------------------- audit
def test_a_full_window_row_beside_two_others_at_different_positions() -> None:
    """With two other rows at different positions the gather step looks up an angle per row, the
    finished one's (at max_seq_len, past the rotary table) included: it is clamped, as the static
    step's is, and the others decode as they would alone."""
    model = make_model("mod", "aux_loss")  # max_seq_len 48
    for rows in ("gather", "masked"):
        decoder = Decoder(model, 3, 48, routed_rows=rows)
        decoder.prefill([[5] * 47, [6] * 3, [7] * 5])
        decoder.step(torch.tensor([1, 2, 3]))  # row 0 reaches position 48
        alone = Decoder(model, 2, 48, routed_rows=rows)
        alone.prefill([[6] * 3, [7] * 5])
        alone.step(torch.tensor([2, 3]))
        for i in range(3):
            got = decoder.step(torch.tensor([0, 4 + i, 5 + i]), torch.tensor([False, True, True]))[1:]
            want = alone.step(torch.tensor([4 + i, 5 + i]))
            assert (got - want).abs().max() <= F64_TOL, rows
    outputs = generate(model, [[5] * 48, [6] * 3, [7] * 10], max_new_tokens=3, temperature=0)
    assert outputs[0] == [] and outputs[1:] == [generate(model, [p], max_new_tokens=3, temperature=0)[0]
                                                for p in ([6] * 3, [7] * 10)]


def test_temperature_nan_is_refused_and_a_tiny_one_is_greedy() -> None:
    model = make_model("mod", "aux_loss")
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number"):
            generate(model, [[1, 2]], max_new_tokens=2, temperature=bad)
    logits = torch.tensor([[0.5, 3.0, -1.0, 2.9], [10.0, -4.0, 9.99, 0.0]])
    assert sample(logits, 1e-45, 0, 1.0, torch.Generator().manual_seed(0)).tolist() == [1, 0]


def test_a_checkpoint_without_config_or_with_other_weights_is_a_clear_error(tmp_path: Path, capsys) -> None:
    model = make_model("mod", "aux_loss").float()
    no_config = tmp_path / "no_config.pt"
    torch.save({"format": "mode-checkpoint-v1", "model": model.state_dict()}, no_config)
    other = make_model("mod", "aux_loss").float()
    weights = {name: value for name, value in other.state_dict().items() if "predictor" not in name}
    weights["embed.weight"] = torch.zeros(3, 3)
    mismatched = tmp_path / "mismatched.pt"
    torch.save({"format": "mode-checkpoint-v1", "config": model.config.to_dict(), "model": weights}, mismatched)
    for path, message in ((no_config, "holds no config"), (mismatched, "weights do not fit")):
        assert main(["--checkpoint", str(path), "--prompt", "x", "--greedy"]) == 2
        err = capsys.readouterr().err
        assert str(path) in err and message in err, err


def test_a_gpu_backend_model_samples_on_the_torch_backend_where_its_backend_cannot_run(tmp_path: Path, capsys,
                                                                                       monkeypatch) -> None:
    """The experts' weights do not depend on moe.backend: a run trained on grouped_gemm loads where that
    cannot run, on the torch backend, with a note, and samples what the torch model samples."""
    import mode.checkpoint as checkpoint_module
    from mode.config import ConfigError

    def no_gpu_backend(name: str) -> None:
        if name != "torch":
            raise ConfigError(f"moe.backend={name!r} needs a CUDA GPU")

    monkeypatch.setattr(checkpoint_module, "check_backend", no_gpu_backend)
    model = make_model("mode_integrated", "aux_loss").float()
    raw = model.config.to_dict()
    raw["moe"]["backend"] = "grouped_gemm"
    ckpt = tmp_path / "checkpoint.pt"
    torch.save({"format": "mode-checkpoint-v1", "config": raw, "model": model.state_dict()}, ckpt)
    loaded = load_model(ckpt)
    assert loaded.config.moe.backend == "torch" and "grouped_gemm" in capsys.readouterr().err
    assert generate(loaded, [[1, 2, 3]], max_new_tokens=4, temperature=0) == generate(
        model, [[1, 2, 3]], max_new_tokens=4, temperature=0)


def test_cli_dtype_auto_is_bfloat16_on_a_gpu_and_float32_on_cpu(byte_ckpt: Path, capsys) -> None:
    from mode.generate import sampling_dtype

    assert sampling_dtype("auto", torch.device("cuda")) == torch.bfloat16
    assert sampling_dtype("auto", torch.device("cpu")) == torch.float32
    assert sampling_dtype("bfloat16", torch.device("cpu")) == torch.bfloat16
    assert main(["--checkpoint", str(byte_ckpt), "--prompt", "ab", "--max-new-tokens", "3", "--greedy",
                 "--device", "cpu", "--dtype", "bfloat16"]) == 0
    assert capsys.readouterr().out.startswith("ab")


def test_a_decoder_fed_another_batch_size_says_so() -> None:
    decoder = Decoder(make_model("mod", "aux_loss"), 2, 48)
    with pytest.raises(ValueError, match="Decoder.prefill: 3 rows, but the decoder was built for batch 2"):
        decoder.prefill([[1], [2], [3]])
    decoder.prefill([[1], [2]])
    with pytest.raises(ValueError, match="Decoder.step: 1 rows"):
        decoder.step(torch.tensor([1]))


def test_a_prompt_that_is_not_utf8_names_the_flag(byte_ckpt: Path, capsys) -> None:
    import os

    assert main(["--checkpoint", str(byte_ckpt), "--prompt", "ok", "--prompt", os.fsdecode(b"caf\xe9"), "--greedy"]) == 2
    assert "--prompt #2 is not valid UTF-8 text" in capsys.readouterr().err


# ----------------------------------------------------------------------------- a file that is no checkpoint, --seed
def test_a_file_that_is_not_a_checkpoint_is_one_line(tmp_path: Path, capsys) -> None:
    """A run's config.yaml passed as --checkpoint: one line naming it, not torch's text advising
    weights_only=False (an unsafe workaround that does not apply: the file is YAML)."""
    config_yaml = tmp_path / "config.yaml"
    config_yaml.write_text("model:\n  d_model: 32\n")
    assert main(["--checkpoint", str(config_yaml), "--prompt", "x"]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {config_yaml} is not a readable checkpoint: not a checkpoint written by mode.train "
                   "(not the zip archive torch.save writes, or cut short)\n"), err


@pytest.mark.parametrize("seed", ["99999999999999999999", "-1"])
def test_a_seed_out_of_range_names_the_flag(byte_ckpt: Path, capsys, seed: str) -> None:
    """torch's "Overflow when unpacking long long" named no flag."""
    with pytest.raises(SystemExit) as info:
        main(["--checkpoint", str(byte_ckpt), "--prompt", "x", "--seed", seed])
    assert info.value.code == 2
    assert f"argument --seed: {seed} is out of range: a seed must be between 0 and 2**63 - 1" in capsys.readouterr().err


# ----------------------------------------------------------------------------- tokenized models
def small_tokenizer(path: Path, vocab_size: int) -> Path:
    """A byte-level BPE of vocab_size tokens trained on a little Python, saved as a tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(["def hello(world):\n    return world + 1\n" * 20, "class Héllo:\n    pass\n" * 20], trainer)
    tokenizer.save(str(path))
    return path


def word_tokenizer(path: Path, size: int) -> Path:
    """A word-level tokenizer.json of exactly `size` tokens."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tokenizer = Tokenizer(models.WordLevel({f"w{i}": i for i in range(size - 1)} | {"[UNK]": size - 1}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.save(str(path))
    return path


def test_cli_text_prompt_on_a_token_model_goes_through_its_tokenizer(token_ckpt: Path, tmp_path: Path, capsys) -> None:
    from mode.data.tokenizer import load_tokenizer

    path = small_tokenizer(tmp_path / "tokenizer.json", 300)
    tokenizer = load_tokenizer(path)
    base = ["--checkpoint", str(token_ckpt), "--greedy", "--max-new-tokens", "6", "--device", "cpu", "--tokenizer", str(path)]
    assert main(base + ["--prompt", "def héllo"]) == 0
    ids = tokenizer.encode("def héllo")
    assert len(ids) < len("def héllo".encode())  # merged tokens, not bytes
    new = greedy(token_ckpt, [ids], 6, "cpu")[0]
    assert capsys.readouterr().out == tokenizer.decode(ids + new) + "\n"
    model = load_model(token_ckpt)
    text = generate(model, ["def héllo"], max_new_tokens=6, temperature=0, tokenizer=tokenizer)
    assert text == [tokenizer.decode(ids + new)[len(tokenizer.decode(ids)):]]


@pytest.mark.parametrize(
    "which, extra, message",
    [
        ("token", ["--prompt", "hi"], "error: --tokenizer {path}: its 2000 tokens do not fit this model's model.vocab_size "
                                      "(1000): not the tokenizer it was trained with"),
        ("byte", ["--prompt", "hi"], "error: --tokenizer {path}: this model is byte-level (its tokens are UTF-8 bytes); "
                                     "give no tokenizer"),
        ("token", ["--prompt-ids", "1 2"], "error: --tokenizer encodes --prompt text; --prompt-ids are token ids already: "
                                           "drop --tokenizer"),
    ],
    ids=["too-large", "byte-level-model", "with-prompt-ids"],
)
def test_cli_tokenizer_that_cannot_apply_is_refused(token_ckpt: Path, byte_ckpt: Path, tmp_path: Path, capsys,
                                                    which: str, extra: list, message: str) -> None:
    path = word_tokenizer(tmp_path / "tokenizer.json", 2000) if which == "token" else small_tokenizer(tmp_path / "t.json", 300)
    ckpt = token_ckpt if which == "token" else byte_ckpt
    assert main(["--checkpoint", str(ckpt), "--device", "cpu", "--tokenizer", str(path), *extra]) == 2
    captured = capsys.readouterr()
    assert captured.err == message.format(path=path) + "\n" and captured.out == ""


def _decode_with_each_attention(model: LanguageModel, lengths: tuple[int, ...], steps: int, max_len: int,
                                cuda_graph: bool) -> list[list[torch.Tensor]]:
    """Random prompts of these lengths prefilled and decoded `steps` steps by a static-step decoder with
    decode_attention="triton", then "flash": each run's logits, prefill first."""
    device = model.embed.weight.device
    prompts = [torch.randint(0, 256, (n,)).tolist() for n in lengths]
    follow = torch.randint(0, 256, (len(lengths), steps), device=device)
    runs = []
    for attention in ("triton", "flash"):
        decoder = Decoder(model, len(lengths), max_len, routed_rows="masked", cuda_graph=cuda_graph,
                          decode_attention=attention)
        runs.append([decoder.prefill(prompts)] + [decoder.step(follow[:, i]) for i in range(steps)])
    return runs


@needs_gpu
@pytest.mark.parametrize("pattern", ["mod", "mode_staged_token_choice"])
def test_the_decode_attention_kernel_decodes_as_sdpa_does(pattern: str) -> None:
    """The captured static step with mode/kernels/decode_attention.py at every batch
    (decode_attention="triton") == the same step without it (float32: SDPA with a length mask)."""
    from mode.kernels.decode_attention import decode_attention_applies

    model = make_model(pattern, "aux_loss", n_layers=4).to("cuda", torch.float32)
    assert decode_attention_applies(torch.empty(3, 4, 8, device="cuda"), any_batch=True)  # the model's heads
    runs = _decode_with_each_attention(model, (4, 9, 7), steps=6, max_len=32, cuda_graph=True)
    for fast, masked in zip(*runs):
        torch.testing.assert_close(fast, masked, rtol=0, atol=1e-4)


def test_decode_attention_names_its_choices() -> None:
    with pytest.raises(ValueError, match="decode_attention must be one of auto, triton, flash, got 'fast'"):
        Decoder(make_model("mod"), 1, 8, decode_attention="fast")


def test_the_decode_attention_kernel_at_every_batch_decodes_as_without_it() -> None:
    """decode_attention="triton" == "flash" (SDPA in float32), float32: on CPU through Triton's
    interpreter, on a GPU compiled (an uncaptured static step: the kernel at batch 2)."""
    from mode.kernels import KernelPolicy, use_kernels
    from mode.kernels.decode_attention import decode_attention_applies

    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = make_model("mod", "aux_loss", n_layers=3).float().to(device)
    with use_kernels(KernelPolicy.only("decode_attention", cpu=True)):
        assert decode_attention_applies(torch.empty(2, 4, 8, device=device), any_batch=True)  # the model's heads
        runs = _decode_with_each_attention(model, (4, 9), steps=4, max_len=20, cuda_graph=False)
    for kernel, sdpa in zip(*runs):
        torch.testing.assert_close(kernel, sdpa, rtol=1e-5, atol=1e-5)
