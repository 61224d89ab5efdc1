"""MoE FFN, Staged and Integrated MoDE: ablation identities, routing invariants, backends.

CPU tests run in float64 (the router itself computes in float32 by design, so routing is
identical between the compared models). GPU backend tests run only where CUDA and the
packages are present; elsewhere pytest reports them as skipped, never as passed.
"""
from __future__ import annotations

import math
from typing import Any, Callable

import pytest
import torch
import torch.nn.functional as F

from mode.config import ConfigError, ModelConfig, MoEConfig, RoutingConfig, config_from_dict
from mode.layers.block import TransformerBlock
from mode.layers.mlp import SwiGLU
from mode.layers.mode import IntegratedMoDEBlock, StagedMoDEBlock
from mode.layers.moe import MoEFFN
from mode.layers.rotary import RotaryAngles, RotaryEmbedding
from mode.model import LanguageModel
from mode.routing import (
    Routing,
    TokenChoiceRouting,
    capacity_to_k,
    rows_by_slot,
    token_choice_capacity,
    token_choice_head,
    top_k_positions,
)

# float64 comparisons of the same mathematics computed in a different order.
F64_ATOL = 1e-10
F64_RTOL = 1e-9
# bf16 GPU backends against the torch backend: relative error of the whole tensor (norm).
GPU_REL_TOL = 2e-2

BATCH, SEQ = 4, 8
E, N_NOOP = 4, 2

SCHEMES = {
    "expert_choice": dict(scheme="expert_choice"),
    "expert_choice_grouped": dict(scheme="expert_choice", group_size=2, capacity_factor=1.5),
    "token_choice_capacity": dict(scheme="token_choice", top_k=2, capacity_factor=0.75),
    "token_choice_dropless": dict(scheme="token_choice", top_k=2, dropless=True),
}


def model_cfg() -> ModelConfig:
    return ModelConfig(d_model=16, n_heads=2, n_layers=2, d_ff=24, max_seq_len=32)


def moe_cfg(**kw) -> MoEConfig:
    return MoEConfig(**{"n_experts": E, **kw})


def chosen(routing: Routing) -> tuple[torch.Tensor, ...]:
    """What an MoE routing chose: expert choice's positions, token choice's slots and rows."""
    if isinstance(routing, TokenChoiceRouting):
        return routing.slots, routing.positions
    return (routing.positions,)


def angles(seq: int = SEQ) -> RotaryAngles:
    cfg = model_cfg()
    return RotaryEmbedding(cfg.d_model // cfg.n_heads, cfg.max_seq_len, cfg.rope_base).prefix(seq)


def inputs(batch: int = BATCH, seq: int = SEQ, width: int = 16) -> torch.Tensor:
    return torch.randn(batch, seq, width, dtype=torch.float64, requires_grad=True)


def close(a: torch.Tensor, b: torch.Tensor) -> None:
    torch.testing.assert_close(a, b, atol=F64_ATOL, rtol=F64_RTOL)


def grads(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in module.named_parameters() if p.grad is not None}


RunResult = tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor], Any]  # output, x.grad, param grads, info


def run(module: Callable[..., Any], x: torch.Tensor, *args: Any) -> RunResult:
    """Forward, then backward of a fixed random projection of the output."""
    out = module(x, *args)
    y = out[0] if isinstance(out, tuple) else out
    weight = torch.randn(y.shape, dtype=y.dtype, generator=torch.Generator().manual_seed(1))
    (y * weight).sum().backward()
    params = grads(module) if isinstance(module, torch.nn.Module) else {}
    return y.detach(), x.grad.clone(), params, out[1] if isinstance(out, tuple) else None


def run_pair(first: Callable[..., Any], second: Callable[..., Any], *args: Any) -> tuple[RunResult, RunResult]:
    """run() both on one input (its gradient reset in between); asserts equal outputs and input
    gradients, and returns both runs' (output, input gradient, parameter gradients, info)."""
    x = inputs()
    a = run(first, x, *args)
    x.grad = None
    b = run(second, x, *args)
    close(a[0], b[0])
    close(a[1], b[1])
    return a, b


# ----------------------------------------------------------------------------- ablation identities
@pytest.mark.parametrize("scheme", SCHEMES)
def test_integrated_mode_without_noop_equals_moe_block(scheme):
    moe = moe_cfg(**SCHEMES[scheme])
    integrated = IntegratedMoDEBlock(model_cfg(), moe).double()
    block = TransformerBlock(model_cfg(), ffn=MoEFFN(16, 24, moe)).double()
    block.load_state_dict(integrated.state_dict())
    (_, _, g1, _), (_, _, g2, _) = run_pair(integrated, block, angles())
    assert g1.keys() == g2.keys() and len(g1) > 0
    for name in g1:
        close(g1[name], g2[name])


@pytest.mark.parametrize("scheme", SCHEMES)
def test_staged_mode_at_full_capacity_with_unit_gate_equals_moe_block(scheme):
    moe = moe_cfg(n_noop=N_NOOP, **SCHEMES[scheme])
    routing = RoutingConfig(capacity=1.0, gate="identity", router_bias=True)
    staged = StagedMoDEBlock(model_cfg(), routing, moe).double()
    with torch.no_grad():
        staged.router.router.proj.weight.zero_()
        staged.router.router.proj.bias.fill_(1.0)  # every score 1: g = 1 for every token
    block = TransformerBlock(model_cfg(), ffn=MoEFFN(16, 24, moe)).double()
    block.load_state_dict(staged.block.state_dict())
    (_, _, g1, info1), (_, _, g2, info2) = run_pair(staged, block, angles())
    for name, g in g2.items():
        close(g1[f"block.{name}"], g)
    assert info1.routing is not None and info1.ffn_routing is not None  # both routings reported
    assert info2.routing is None and info2.ffn_routing is not None
    for a, b in zip(chosen(info1.ffn_routing), chosen(info2.ffn_routing), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


@pytest.mark.parametrize(
    "kw",
    [
        dict(scheme="token_choice", top_k=1, dropless=True),
        dict(scheme="token_choice", top_k=1, capacity_factor=1.0),  # C = T: nothing can drop
        dict(scheme="expert_choice", capacity_factor=1.0),  # C = T: the one expert takes every token
    ],
)
def test_one_expert_top1_without_dropping_equals_dense_mlp(kw):
    moe = MoEFFN(16, 24, MoEConfig(n_experts=1, **kw)).double()
    mlp = SwiGLU(16, 24).double()
    with torch.no_grad():  # softmax over one slot is 1.0, so the gate is exactly 1
        moe.experts.w_in[0].copy_(mlp.gate_up.weight.t())
        moe.experts.w_out[0].copy_(mlp.down.weight.t())
    (_, _, g1, routing), (_, _, g2, _) = run_pair(moe, mlp)
    close(g1["experts.w_in"][0], g2["gate_up.weight"].t())
    close(g1["experts.w_out"][0], g2["down.weight"].t())
    assert float(g1["router.router.proj.weight"].abs().max()) == 0.0  # a constant gate has no gradient
    assert float(routing.stats["processed"]) == 1.0 and float(routing.stats["dropped_fraction"]) == 0.0


# ----------------------------------------------------------------------------- no-op experts
@pytest.mark.parametrize("kw", [dict(scheme="expert_choice"), dict(scheme="token_choice", dropless=True)])
def test_tokens_routed_to_noop_experts_get_exactly_zero_update(kw):
    moe = moe_cfg(n_experts=2, n_noop=6, **kw)
    block = IntegratedMoDEBlock(model_cfg(), moe).double()
    x = inputs()
    out, info = block(x, angles())
    h = x + block.attn(block.attn_norm(x), angles())
    ffn_out, routing = block.ffn(block.ffn_norm(h))
    for a, b in zip(chosen(routing), chosen(info.ffn_routing), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    if isinstance(routing, TokenChoiceRouting):
        skipped = (routing.positions < 0).all(-1).view(BATCH, SEQ)  # dropless: only no-op slots
        assert bool((routing.slots >= 2).view(BATCH, SEQ)[skipped].all())
    else:
        taken = torch.zeros(BATCH * SEQ, dtype=torch.bool)
        taken[routing.positions.reshape(BATCH, -1) + SEQ * torch.arange(BATCH).view(BATCH, 1)] = True
        skipped = ~taken.view(BATCH, SEQ)
    assert 0 < int(skipped.sum()) < BATCH * SEQ
    assert bool((ffn_out[skipped] == 0).all()), "a no-op token got a nonzero FFN update"
    assert bool((ffn_out[~skipped] != 0).any())
    assert torch.equal(out[skipped], h[skipped])  # it rides the residual, bit for bit
    assert math.isclose(float(routing.stats["processed"]), 1 - float(skipped.float().mean()))


# ----------------------------------------------------------------------------- routing invariants
@pytest.mark.parametrize("group_size", [1, 2, 4])
def test_expert_choice_gives_every_expert_exactly_c_tokens(group_size):
    moe = MoEFFN(16, 24, moe_cfg(n_noop=N_NOOP, group_size=group_size, capacity_factor=1.5)).double()
    x = inputs()
    _, routing = moe(x)
    groups, tokens = BATCH // group_size, group_size * SEQ
    capacity = capacity_to_k(tokens, 1.5 / (E + N_NOOP))
    assert capacity == max(1, round(1.5 * tokens / (E + N_NOOP)))
    assert routing.positions.shape == (groups, E, capacity)
    assert routing.gates.shape == (groups, E, capacity)
    for row in routing.positions.reshape(-1, capacity):
        assert len(set(row.tolist())) == capacity  # C distinct tokens
        assert row.tolist() == sorted(row.tolist())  # in causal order
        assert 0 <= int(row.min()) and int(row.max()) < tokens
    assert routing.stats["tokens_per_expert"].tolist() == [groups * capacity] * E
    # the chosen tokens are that expert's top-C probabilities within the group
    probs = routing.logits.softmax(-1)[..., :E].transpose(1, 2)
    torch.testing.assert_close(routing.positions, top_k_positions(probs, capacity), atol=0, rtol=0)


def test_expert_choice_group_size_must_divide_batch():
    moe = MoEFFN(16, 24, moe_cfg(group_size=3)).double()
    with pytest.raises(ValueError, match="moe.group_size"):
        moe(inputs())


def test_expert_choice_groups_do_not_leak():
    moe = MoEFFN(16, 24, moe_cfg(group_size=2)).double()
    x = inputs().detach()
    y = x.clone()
    y[3] = torch.randn(SEQ, 16, dtype=torch.float64)  # change the second group only
    (a, ra), (b, rb) = moe(x), moe(y)
    assert torch.equal(ra.positions[0], rb.positions[0])
    close(a[:2], b[:2])
    assert not torch.equal(a[2:], b[2:])


@pytest.mark.parametrize("top_k", [1, 2])
def test_token_choice_with_dropping_never_exceeds_capacity(top_k):
    batch, seq = 8, 16
    moe = MoEFFN(16, 24, moe_cfg(scheme="token_choice", top_k=top_k, n_noop=N_NOOP, capacity_factor=0.5)).double()
    x = inputs(batch, seq)
    out, routing = moe(x)
    tokens = batch * seq
    capacity = token_choice_capacity(tokens, E + N_NOOP, top_k, 0.5)
    assert routing.capacity == capacity == math.ceil(0.5 * tokens * top_k / (E + N_NOOP))
    counts = routing.stats["tokens_per_expert"]
    assert int(counts.max()) <= capacity and float(routing.stats["dropped_fraction"]) > 0
    slots, pos = routing.slots, routing.positions
    for e in range(E):
        rows = pos[(slots == e) & (pos >= 0)]
        assert sorted(rows.tolist()) == list(range(len(rows)))  # distinct rows 0..n-1 < C
        assert counts[e] == len(rows)
        # priority: first choices before second ones, earlier tokens first
        order = torch.cat([torch.nonzero(slots[:, j] == e).flatten() + j * tokens for j in range(top_k)])
        kept = (pos.t().reshape(-1)[order] >= 0).int()
        assert kept.tolist() == sorted(kept.tolist(), reverse=True)
    assert torch.equal(pos[slots >= E], torch.full_like(pos[slots >= E], -1))  # no-op slots: no row
    dropped_all = (pos < 0).all(-1).view(batch, seq)
    assert bool((out[dropped_all] == 0).all())


# ----------------------------------------------------------------------------- the torch backend
def slow_reference(moe: MoEFFN, x: torch.Tensor) -> torch.Tensor:
    """The MoE written the slow, obvious way: python loops over groups, experts and tokens."""
    cfg = moe.router
    w_in, w_out = moe.experts.w_in, moe.experts.w_out

    def expert(e: int, token: torch.Tensor) -> torch.Tensor:
        h = token @ w_in[e]
        h = F.silu(h[: h.shape[0] // 2]) * h[h.shape[0] // 2 :] if moe.experts.activation == "swiglu" else F.gelu(h)
        return h @ w_out[e]

    batch, seq, width = x.shape
    logits = F.linear(x.float(), cfg.router.proj.weight.float())  # the router scores in float32
    n_slots = logits.shape[-1]
    contributions: dict[int, list[torch.Tensor]] = {}
    flat = x.reshape(-1, width)
    if moe.router.__class__.__name__ == "ExpertChoiceRouter":
        groups, tokens = batch // cfg.group_size, cfg.group_size * seq
        probs = logits.reshape(groups, tokens, n_slots).softmax(-1)
        capacity = max(1, round(cfg.capacity_factor * tokens / n_slots))
        for g in range(groups):
            for e in range(cfg.n_experts):
                for t in probs[g, :, e].topk(capacity).indices.tolist():
                    i = g * tokens + t
                    contributions.setdefault(i, []).append(probs[g, t, e].to(x.dtype) * expert(e, flat[i]))
    else:
        probs = logits.reshape(-1, n_slots).softmax(-1)
        values, slots = probs.topk(cfg.top_k, dim=-1)
        tokens = flat.shape[0]
        capacity = math.inf if cfg.dropless else math.ceil(cfg.capacity_factor * tokens * cfg.top_k / n_slots)
        load = [0] * cfg.n_experts
        for j in range(cfg.top_k):
            for t in range(tokens):
                e = int(slots[t, j])
                if e >= cfg.n_experts or load[e] >= capacity:
                    continue  # a no-op expert, or dropped
                load[e] += 1
                contributions.setdefault(t, []).append(values[t, j].to(x.dtype) * expert(e, flat[t]))
    rows = [torch.stack(contributions[i]).sum(0) if i in contributions else flat.new_zeros(width) for i in range(len(flat))]
    return torch.stack(rows).view_as(x)


@pytest.mark.parametrize("activation", ["swiglu", "gelu"])
@pytest.mark.parametrize("n_noop", [0, N_NOOP])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_torch_backend_equals_slow_loop_reference(scheme, n_noop, activation):
    moe = MoEFFN(16, 24, moe_cfg(n_noop=n_noop, activation=activation, **SCHEMES[scheme])).double()
    x = inputs()
    y1, gx1, g1, _ = run(moe, x)
    x.grad = None
    moe.zero_grad()
    y2, gx2, _, _ = run(lambda t: slow_reference(moe, t), x)
    g2 = grads(moe)
    close(y1, y2)
    close(gx1, gx2)
    for name in ("experts.w_in", "experts.w_out", "router.router.proj.weight"):
        close(g1[name], g2[name])


class _PoisonPastEnd(torch.autograd.Function):
    """Rows from `end` on become NaN, forward and backward: what torch._grouped_mm leaves there
    (undefined memory) made loud. Rows before `end` pass unchanged."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, end: int) -> torch.Tensor:
        ctx.end = end
        out = t.clone()
        out[end:] = math.nan
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        grad = grad.clone()
        grad[ctx.end :] = math.nan
        return grad, None


def _poison_past_end(monkeypatch: pytest.MonkeyPatch, owner: Any, name: str, end_of: Callable[..., int]) -> list[int]:
    """owner.name, a grouped GEMM f(a, b, *group_args), with its rows past the groups' end (end_of(*group_args))
    NaN (_PoisonPastEnd) on both its input (so their gradient is NaN) and its output. Returns the
    list each call appends its count of such rows to."""
    real, calls = getattr(owner, name), []

    def poisoned(a: torch.Tensor, b: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        end = end_of(*args, **kwargs)
        calls.append(a.shape[0] - end)
        return _PoisonPastEnd.apply(real(_PoisonPastEnd.apply(a, end), b, *args, **kwargs), end)

    monkeypatch.setattr(owner, name, poisoned)
    return calls


def poison_grouped_mm(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """torch._grouped_mm(a, b, offs=ends), its rows from ends[-1] on poisoned."""
    return _poison_past_end(monkeypatch, torch, "_grouped_mm", lambda offs: int(offs[-1]))


def poison_gmm(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """grouped_gemm's gmm(a, b, batch_sizes, trans_b), its rows from sum(batch_sizes) on poisoned."""
    import grouped_gemm.ops

    return _poison_past_end(monkeypatch, grouped_gemm.ops, "gmm", lambda batch_sizes, trans_b=False: int(batch_sizes.sum()))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the row kernels take CPU tensors only in Triton's interpreter "
                    "(no GPU); on a GPU test_dropless_by_ends_on_gpu_equals_the_computed_rows_only runs these checks")
@pytest.mark.parametrize("layout", ["counting sort kernel", "argsort"])
@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("n_noop", [0, N_NOOP])
def test_dropless_by_ends_equals_slow_loop_reference(monkeypatch, n_noop, top_k, layout):
    """The torch backend's sync-free dropless layout (Experts.by_ends: all T*k rows, the no-op ones
    past the grouped GEMMs' last end), run here on CPU in float32: torch._grouped_mm's CPU version,
    the row kernels in Triton's interpreter, the rows sorted by the counting sort kernel or (where it
    does not fit) by PyTorch's argsort. Rows past the end are NaN in the GEMMs' outputs and in the
    gradients they return: nothing of them may reach the output or any gradient."""
    from mode.kernels import KernelPolicy, sort_rows, use_kernels

    monkeypatch.setattr(sort_rows, "fits", lambda *args: layout == "counting sort kernel")
    with use_kernels(KernelPolicy.only("rows", cpu=True)):
        _check_by_ends_against_slow_reference(monkeypatch, n_noop, top_k)


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("n_noop", [0, N_NOOP])
def test_dropless_by_ends_without_the_inverse_map_equals_slow_loop_reference(monkeypatch, n_noop, top_k):
    """The same layout where the rows have no inverse map (under torch.compile, or with the row
    kernels off): the gather's backward and the combine read every row, so Experts.by_ends zeroes
    the rows past the end on the way out and their gradient on the way in; the NaN there must
    still reach nothing."""
    _check_by_ends_against_slow_reference(monkeypatch, n_noop, top_k)


def _check_by_ends_against_slow_reference(monkeypatch: pytest.MonkeyPatch, n_noop: int, top_k: int) -> None:
    calls = poison_grouped_mm(monkeypatch)
    moe = MoEFFN(16, 24, moe_cfg(scheme="token_choice", top_k=top_k, dropless=True, n_noop=n_noop, activation="gelu"))
    moe.experts.use_by_ends = True  # on CPU it would not apply
    x = inputs().float().detach().requires_grad_(True)
    y1, gx1, g1, routing = run(moe, x)
    assert len(calls) == 2, "the by_ends path did not run"
    noop_rows = int((routing.slots >= E).sum())
    assert calls[0] == noop_rows and (n_noop == 0 or noop_rows > 0)  # the no-op rows: past the end
    x.grad = None
    moe.zero_grad()
    y2, gx2, _, _ = run(lambda t: slow_reference(moe, t), x)
    g2 = grads(moe)
    tol = dict(atol=1e-5, rtol=1e-4)  # float32, summed in another order
    torch.testing.assert_close(y1, y2, **tol)
    torch.testing.assert_close(gx1, gx2, **tol)
    for name in ("experts.w_in", "experts.w_out", "router.router.proj.weight"):
        torch.testing.assert_close(g1[name], g2[name], **tol)


def test_rows_left_out_need_the_inverse_map():
    x = torch.randn(4, 8)
    with pytest.raises(ValueError, match="inverse map"):
        rows_by_slot(torch.arange(4), torch.zeros(4, dtype=torch.long), 1, x, computed=torch.ones(4, dtype=torch.bool))


def test_aux_losses_and_stats():
    moe = MoEFFN(16, 24, moe_cfg(scheme="token_choice", top_k=2, n_noop=N_NOOP, lb_loss_weight=0.5, z_loss_weight=0.1))
    _, routing = moe(inputs().float())
    probs = routing.logits[0].softmax(-1)
    f = torch.bincount(routing.slots.flatten(), minlength=E + N_NOOP).float() / routing.slots.numel()
    lb = (E + N_NOOP) * (f * probs.mean(0)).sum()
    z = routing.logits.logsumexp(-1).square().mean()
    torch.testing.assert_close(routing.aux_loss, 0.5 * lb + 0.1 * z)
    assert routing.aux_loss.requires_grad
    assert math.isclose(float(routing.stats["noop_fraction"]), float((routing.slots >= E).float().mean()))


@pytest.mark.parametrize("group_size", [1, 2])
def test_expert_choice_aux_loss_is_the_weighted_z_loss(group_size):
    """Expert choice has no balancing loss (every expert takes C tokens): its aux_loss is
    moe.z_loss_weight x the mean over tokens of logsumexp(router logits)^2, the weight the config's."""
    moe = MoEFFN(16, 24, moe_cfg(scheme="expert_choice", n_noop=N_NOOP, group_size=group_size, z_loss_weight=0.3))
    _, routing = moe(inputs().float())
    z = routing.logits.logsumexp(-1).square().mean()
    torch.testing.assert_close(routing.aux_loss, 0.3 * z)
    assert routing.aux_loss.requires_grad


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("kw", [dict(capacity_factor=0.5), dict(dropless=True)], ids=["dropping", "dropless"])
def test_token_choice_stats_from_counts_equal_the_per_row_stats(kw, top_k):
    """The statistics derived from the per-slot choice counts (every row) equal those counted row by
    row (as causal routing counts them, its padding left out) when every row is valid."""
    moe = MoEFFN(16, 24, moe_cfg(scheme="token_choice", top_k=top_k, n_noop=N_NOOP, **kw)).float()
    router, x = moe.router, inputs().float()
    routing = router(x)
    head = token_choice_head(routing.logits[0], top_k, E, routing.capacity, router.lb_loss_weight, router.z_loss_weight)
    per_row = router._stats_of_rows(head, routing.positions, torch.ones(x.shape[0] * x.shape[1], 1, dtype=torch.bool))
    assert routing.stats.keys() == per_row.keys()
    for name, value in routing.stats.items():
        torch.testing.assert_close(value, per_row[name], msg=lambda m, n=name: f"{n}: {m}")
    if "capacity_factor" in kw:
        assert float(routing.stats["dropped_fraction"]) > 0


# ----------------------------------------------------------------------------- MoDE and the model
def test_staged_mode_random_routing_switch():
    moe = moe_cfg()
    learned = StagedMoDEBlock(model_cfg(), RoutingConfig(capacity=0.25, random=False), moe).double()
    random = StagedMoDEBlock(model_cfg(), RoutingConfig(capacity=0.25, random=True), moe).double()
    random.load_state_dict(learned.state_dict())
    x = inputs(8, 16).detach()
    _, info = learned(x, angles(16))
    scores = info.routing.logits
    assert torch.equal(info.routing.positions, top_k_positions(scores, 4))
    picks = [random(x, angles(16))[1].routing for _ in range(2)]
    assert all(p.positions.shape == (8, 4) for p in picks)
    assert not torch.equal(picks[0].positions, top_k_positions(scores, 4))
    assert not torch.equal(picks[0].positions, picks[1].positions)
    torch.testing.assert_close(picks[0].gates, torch.sigmoid(scores.gather(1, picks[0].positions)))


def tiny_config(pattern, **moe):
    return config_from_dict(
        dict(
            model=dict(d_model=16, n_heads=2, n_layers=4, d_ff=24, max_seq_len=32, block_pattern=pattern),
            routing=dict(capacity=0.5),
            moe=dict(n_experts=E, **moe),
            data=dict(seq_len=32),
        )
    )


@pytest.mark.parametrize("kind", ["moe", "mode_staged", "mode_integrated"])
@pytest.mark.parametrize("scheme", ["expert_choice", "token_choice"])
def test_model_sums_every_routing_aux_loss(kind, scheme):
    model = LanguageModel(tiny_config(["dense", kind], scheme=scheme, n_noop=N_NOOP, top_k=1))
    tokens = torch.randint(0, 256, (2, 32))
    out = model(tokens, tokens)
    assert len(out.routings) == len(out.ffn_routings) == 4
    expert_routings = [r for r in out.ffn_routings if r is not None]
    depth_routings = [r for r in out.routings if r is not None]
    assert len(expert_routings) == 2 and len(depth_routings) == (2 if kind == "mode_staged" else 0)
    total = sum(r.aux_loss for r in expert_routings + depth_routings)
    torch.testing.assert_close(out.aux_loss, total)
    assert float(out.aux_loss.detach()) > 0
    torch.testing.assert_close(out.loss, out.lm_loss + out.aux_loss)
    out.loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing, f"no gradient for {missing}"


def test_config_errors_name_the_moe_field():
    with pytest.raises(ConfigError, match="moe.n_noop"):
        tiny_config(["dense", "mode_integrated"])
    with pytest.raises(ConfigError, match="moe.*n_expert.*unknown key"):
        tiny_config(["moe"], n_expert=3)
    with pytest.raises(ConfigError, match="moe.*top_k"):
        tiny_config(["moe"], scheme="token_choice", top_k=5)
    with pytest.raises(ConfigError, match="moe.*capacity_factor"):
        tiny_config(["moe"], capacity_factor=0)
    with pytest.raises(ConfigError, match="moe.*backend"):
        tiny_config(["moe"], backend="triton")


# ----------------------------------------------------------------------------- GPU backends
@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU-only check: this machine has CUDA")
@pytest.mark.parametrize("backend", ["grouped_gemm", "megablocks"])
def test_gpu_backends_on_cpu_raise_naming_the_field(backend):
    with pytest.raises(ConfigError, match="moe.backend"):
        MoEFFN(16, 24, moe_cfg(scheme="token_choice", dropless=True, backend=backend))
    with pytest.raises(ConfigError, match="moe.backend"):
        LanguageModel(tiny_config(["dense", "moe"], scheme="token_choice", dropless=True, backend=backend))


GPU_CASES = {
    "expert_choice": dict(scheme="expert_choice", n_noop=N_NOOP),
    "token_choice_dropless": dict(scheme="token_choice", top_k=2, dropless=True, n_noop=N_NOOP),
    "token_choice_capacity": dict(scheme="token_choice", top_k=1, capacity_factor=1.0, n_noop=N_NOOP),
    # Every assignment computed (no no-op slot, no dropping): megablocks' path appends no zero rows.
    "token_choice_dropless_top1_no_noop": dict(scheme="token_choice", top_k=1, dropless=True, n_noop=0),
}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.detach().float() - b.detach().float()).norm() / b.detach().float().norm().clamp_min(1e-12))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", GPU_CASES)
@pytest.mark.parametrize("backend", ["grouped_gemm", "megablocks"])
def test_gpu_backend_equals_torch_backend(backend, case):
    pytest.importorskip("grouped_gemm")
    if backend == "megablocks":
        pytest.importorskip("megablocks.ops")
    width, ffn, experts = 256, 512, 8
    torch.manual_seed(0)
    ref = MoEFFN(width, ffn, MoEConfig(n_experts=experts, **GPU_CASES[case])).cuda()
    other = MoEFFN(width, ffn, MoEConfig(n_experts=experts, backend=backend, **GPU_CASES[case])).cuda()
    other.load_state_dict(ref.state_dict())
    x = torch.randn(4, 256, width, device="cuda", requires_grad=True)
    weight = torch.randn(4, 256, width, device="cuda")
    results = []
    for moe in (ref, other):
        x.grad = None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            y, routing = moe(x)
        (y.float() * weight).sum().backward()
        results.append((y, x.grad.clone(), grads(moe), routing))
    (y1, gx1, g1, r1), (y2, gx2, g2, r2) = results
    assert all(torch.equal(a, b) for a, b in zip(chosen(r1), chosen(r2), strict=True))
    assert _rel(y2, y1) < GPU_REL_TOL and _rel(gx2, gx1) < GPU_REL_TOL
    for name in g1:
        assert _rel(g2[name], g1[name]) < GPU_REL_TOL, name


def _gpu_pass(moe: MoEFFN, x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    x.grad = None
    moe.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, _ = moe(x)
    (y.float() * weight).sum().backward()
    return y.detach().clone(), x.grad.clone(), grads(moe)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["token_choice_dropless", "token_choice_dropless_top1_no_noop"])
@pytest.mark.parametrize("backend", ["torch", "grouped_gemm"])
def test_dropless_by_ends_on_gpu_equals_the_computed_rows_only(monkeypatch, backend, case):
    """Dropless token choice with every assignment a row (Experts.by_ends: torch._grouped_mm with the
    rows' ends on the device, or gmm) against the computed rows only (use_by_ends=False: the loop over
    experts, or gmm, with host counts), bf16, first with the rows past the grouped GEMMs' end
    poisoned (NaN), which nothing may read. On torch, having no host sync, the whole pass captured
    as one CUDA graph replays the eager results bit for bit."""
    if backend == "grouped_gemm":
        pytest.importorskip("grouped_gemm")
    torch.manual_seed(0)
    moe = MoEFFN(256, 512, MoEConfig(n_experts=8, backend=backend, **GPU_CASES[case])).cuda()
    x = torch.randn(4, 256, 256, device="cuda", requires_grad=True)
    weight = torch.randn(4, 256, 256, device="cuda")
    if not moe.experts.by_ends_applies(x.to(torch.bfloat16)):
        pytest.skip(f"torch._grouped_mm is not one kernel on {torch.cuda.get_device_name()}")
    with monkeypatch.context() as patch:
        calls = (poison_grouped_mm if backend == "torch" else poison_gmm)(patch)
        y0, gx0, g0 = _gpu_pass(moe, x, weight)
        assert len(calls) == 2 and (calls[0] > 0) == (GPU_CASES[case]["n_noop"] > 0)
    y1, gx1, g1 = _gpu_pass(moe, x, weight)
    moe.experts.use_by_ends = False
    y2, gx2, g2 = _gpu_pass(moe, x, weight)
    moe.experts.use_by_ends = None
    for y, gx, g in ((y0, gx0, g0), (y1, gx1, g1)):
        assert _rel(y, y2) < GPU_REL_TOL and _rel(gx, gx2) < GPU_REL_TOL
        for name in g2:
            assert _rel(g[name], g2[name]) < GPU_REL_TOL, name
    if backend == "torch":
        _assert_replays_as_a_cuda_graph(moe, x, weight, (y1, gx1, g1))


def _assert_replays_as_a_cuda_graph(moe: MoEFFN, x: torch.Tensor, weight: torch.Tensor, eager: tuple) -> None:
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture requires
        _gpu_pass(moe, x, weight)
    torch.cuda.current_stream().wait_stream(side)
    graph, captured = torch.cuda.CUDAGraph(), {}
    x.grad = None
    moe.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):  # fails if anything in the pass syncs with the host
        with torch.autocast("cuda", dtype=torch.bfloat16):
            captured["y"], _ = moe(x)
        (captured["y"].float() * weight).sum().backward()
    graph.replay()
    torch.cuda.synchronize()
    y, gx, g = eager
    assert torch.equal(captured["y"], y) and torch.equal(x.grad, gx)
    assert all(torch.equal(p.grad, g[n]) for n, p in moe.named_parameters() if p.grad is not None)


@pytest.mark.parametrize("k", [1, 2])
def test_top_k_slots_equals_topk(k: int) -> None:
    """Top-1 runs as a max reduction (faster on GPU): the same values and slots as topk."""
    from mode.routing import top_k_slots

    scores = torch.randn(64, 6).softmax(-1)
    values, slots = top_k_slots(scores, k)
    want = scores.topk(k, dim=-1)
    assert values.shape == slots.shape == (64, k)
    assert torch.equal(values, want.values) and torch.equal(slots, want.indices)


def test_causal_expert_choice_with_no_token_chosen_gives_zero_update() -> None:
    """Causal routing that chooses nothing still runs the expert path (expert parallelism needs
    every rank in the exchange) and returns an exact zero update of the input's shape."""
    from mode.config import MoEConfig, RoutingConfig
    from mode.layers.moe import MoEFFN

    ffn = MoEFFN(16, 32, MoEConfig(n_experts=2, n_noop=1), RoutingConfig(causal="aux_loss")).double()
    torch.nn.init.zeros_(ffn.router.router.proj.weight)  # every logit 0: the decision (logit > 0) is "no"
    x = torch.randn(2, 5, 16, dtype=torch.float64, requires_grad=True)
    out, routing = ffn(x, causal=True)
    assert out.shape == x.shape and torch.equal(out, torch.zeros_like(out))
    assert not routing.mask.any()
    out.sum().backward()  # the empty path still has a gradient graph


@pytest.mark.parametrize("scheme", ["expert_choice", "expert_choice_grouped", "token_choice_capacity"])
def test_static_schemes_trace_as_one_graph(scheme: str) -> None:
    """Expert choice and token choice with a capacity have static shapes: torch.compile traces each
    as one graph (no data-dependent bincount splitting it), which CUDA graphs need. Dynamo tracing
    only: no kernels are generated."""
    layer = MoEFFN(16, 24, moe_cfg(n_noop=N_NOOP, **SCHEMES[scheme])).double()
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(inputs())
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


def test_dropless_by_ends_traces_as_one_graph(monkeypatch: pytest.MonkeyPatch) -> None:
    """Dropless token choice by ends reads nothing on the host: torch.compile traces it as one graph
    (the rows by host counts split it in eight). bf16, as torch._grouped_mm's meta function requires;
    Dynamo tracing only, by_ends forced on (on CPU it would not apply)."""
    layer = MoEFFN(16, 32, moe_cfg(scheme="token_choice", top_k=2, dropless=True, n_noop=N_NOOP)).bfloat16()
    layer.experts.use_by_ends = True
    torch._dynamo.reset()
    explained = torch._dynamo.explain(layer)(inputs().bfloat16())
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    assert explained.graph_count == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_compiled_dropless_token_choice_is_one_graph_and_matches_eager() -> None:
    """On a GPU where by ends applies, the compiled dropless layer (no inverse map: the experts mask
    the rows past the end) traces as one graph and equals the eager layer (the row kernels)."""
    torch.manual_seed(0)
    moe = MoEFFN(256, 512, MoEConfig(n_experts=8, **GPU_CASES["token_choice_dropless"])).cuda()
    x = torch.randn(4, 256, 256, device="cuda", requires_grad=True)
    weight = torch.randn(4, 256, 256, device="cuda")
    if not moe.experts.by_ends_applies(x.to(torch.bfloat16)):
        pytest.skip(f"torch._grouped_mm is not one kernel on {torch.cuda.get_device_name()}")
    torch._dynamo.reset()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        explained = torch._dynamo.explain(moe)(x)
    assert explained.graph_break_count == 0, [b.reason for b in explained.break_reasons]
    eager = _gpu_pass(moe, x, weight)
    torch._dynamo.reset()
    compiled_moe = torch.compile(moe)
    x.grad = None
    moe.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        y, _ = compiled_moe(x)
    (y.float() * weight).sum().backward()
    compiled = (y.detach(), x.grad.clone(), grads(moe))
    for got, want in zip(compiled[:2], eager[:2]):
        assert _rel(got, want) < GPU_REL_TOL
    for name in eager[2]:
        assert _rel(compiled[2][name], eager[2][name]) < GPU_REL_TOL, name


@pytest.mark.parametrize("scheme", ["expert_choice", "expert_choice_grouped"])
def test_compiled_expert_choice_matches_eager(scheme: str) -> None:
    """Compiled, the row primitives trace plain gather / scatter_add (eagerly: autograd functions).
    Traced with aot_eager (the compiled branch's ops and derivatives, no kernels generated): the
    same output, input gradient and parameter gradients."""
    layer = MoEFFN(16, 24, moe_cfg(n_noop=N_NOOP, **SCHEMES[scheme])).double()
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    torch._dynamo.reset()
    x = inputs()
    eager_out, eager_x_grad, eager_grads, _ = run(layer, x)
    layer.zero_grad(set_to_none=True)
    x.grad = None
    out, x_grad, _, _ = run(compiled, x)
    close(out, eager_out)
    close(x_grad, eager_x_grad)
    assert grads(layer).keys() == eager_grads.keys() and eager_grads
    for name, grad in grads(layer).items():
        close(grad, eager_grads[name])


@pytest.mark.parametrize("scheme", ["expert_choice", "token_choice_capacity", "token_choice_dropless"])
def test_staged_mode_causal_routing_keeps_padding_out_of_the_inner_moe(scheme: str) -> None:
    """Under causal routing a Staged MoDE block pads each sequence's chosen tokens to the batch's
    longest. The inner MoE computes and counts the chosen tokens only: its output and statistics
    equal the MoE's on those tokens alone, and the padding rows get an exact zero update."""
    torch.manual_seed(3)
    staged = StagedMoDEBlock(model_cfg(), RoutingConfig(causal="aux_loss"), moe_cfg(n_noop=N_NOOP, **SCHEMES[scheme])).double()
    seen = {}

    def record(module, args, out):  # the MoE's own output: the block passes the attention's as residual
        residual = args[5]
        seen.update(x=args[0], valid=args[1], out=out[0] - residual)

    hook = staged.block.ffn.register_forward_hook(record)
    _, info = staged(inputs(batch=6), angles(), causal=True)
    hook.remove()
    valid = info.routing.valid  # (B, K)
    assert valid is seen["valid"] and not valid.all() and valid.any(-1).all()  # padding in some rows
    rows = seen["x"][valid].unsqueeze(0)  # (1, M, D): the chosen tokens alone
    want_out, want = staged.block.ffn(rows, causal=True)
    close(seen["out"][valid], want_out[0])
    assert torch.equal(seen["out"][~valid], torch.zeros_like(seen["out"][~valid]))
    got = info.ffn_routing.stats
    for name in ("processed", "noop_fraction", "dropped_fraction", "tokens_per_expert"):
        if name in want.stats:
            close(got[name], want.stats[name])
    assert got["tokens_per_expert"].sum() > 0  # the experts took some tokens


def test_each_router_returns_its_own_routing_type() -> None:
    """One meaning per field: a depth router gives positions (B, k), expert choice positions (G, E, C)
    (or, routed causally, a bool mask (..., E)), token choice slots and rows (T, k); causal routing is
    a forward argument, False unless passed."""
    from mode.routing import (
        CausalExpertRouting,
        DepthRouter,
        DepthRouting,
        ExpertChoiceRouter,
        ExpertChoiceRouting,
        TokenChoiceRouter,
    )

    x = inputs().float()
    depth = DepthRouter(16, 0.25, "sigmoid", False, causal="aux_loss")
    routing = depth(x)
    assert type(routing) is DepthRouting and routing.positions.shape == (BATCH, capacity_to_k(SEQ, 0.25))
    assert type(depth(x, causal=True)) is DepthRouting and depth(x, causal=True).valid is not None
    expert = ExpertChoiceRouter(16, E, N_NOOP, 1.0, 1, 0.0, causal="aux_loss")
    routing = expert(x)
    assert type(routing) is ExpertChoiceRouting and routing.positions.shape[:2] == (BATCH, E)
    routing = expert(x, causal=True)
    assert type(routing) is CausalExpertRouting and routing.mask.dtype == torch.bool
    assert routing.mask.shape == (BATCH, SEQ, E)
    token = TokenChoiceRouter(16, E, N_NOOP, 2, 1.0, False, 0.0, 0.0)
    routing = token(x)
    assert type(routing) is TokenChoiceRouting
    assert routing.slots.shape == routing.positions.shape == routing.gates.shape == (BATCH * SEQ, 2)
    assert routing.capacity is not None and token(x, causal=True).capacity is None  # causal: no dropping
    for router in (depth, expert, token):
        assert not hasattr(router, "causal_mode")


# ----------------------------------------------------------------------------- renormalised gates, shared expert
@pytest.mark.parametrize("top_k, n_noop", [(1, 0), (2, 0), (2, N_NOOP), (3, 0)])
def test_renormalized_gates_are_the_softmax_of_the_top_k_logits(top_k: int, n_noop: int) -> None:
    """moe.renormalize (Mixtral): each token's k gates sum to 1 and equal the softmax of its k chosen
    logits alone; the slots chosen and the losses are those of the plain router."""
    moe = moe_cfg(scheme="token_choice", top_k=top_k, n_noop=n_noop, dropless=True)
    plain = MoEFFN(16, 24, moe).double()
    renorm = MoEFFN(16, 24, moe.model_copy(update={"renormalize": True})).double()
    renorm.load_state_dict(plain.state_dict())
    x = inputs()
    (_, want), (_, got) = plain(x), renorm(x)
    assert torch.equal(got.slots, want.slots) and torch.equal(got.aux_loss, want.aux_loss)
    torch.testing.assert_close(got.gates.sum(-1), torch.ones(BATCH * SEQ, dtype=got.gates.dtype), rtol=0, atol=1e-6)
    chosen_logits = got.logits[0].gather(-1, got.slots)  # (T, k)
    torch.testing.assert_close(got.gates, chosen_logits.softmax(-1), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(got.gates, want.gates / want.gates.sum(-1, keepdim=True), rtol=0, atol=0)
    if top_k > 1:
        assert not torch.allclose(got.gates, want.gates)  # the default keeps the plain probabilities


def _shared_reference(ffn: MoEFFN, x: torch.Tensor, gated: bool) -> torch.Tensor:
    """shared(x) = down(silu(x W_gate) * (x W_up)), times sigmoid(x w_g) with a gate, written out."""
    width = ffn.shared_expert.down.weight.shape[1]
    w_gate, w_up = ffn.shared_expert.gate_up.weight[:width], ffn.shared_expert.gate_up.weight[width:]  # (F, D) each
    out = (F.silu(x @ w_gate.t()) * (x @ w_up.t())) @ ffn.shared_expert.down.weight.t()
    return torch.sigmoid(x @ ffn.shared_expert_gate.weight.t()) * out if gated else out


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("scheme", SCHEMES)
def test_shared_expert_adds_its_mlp_to_every_token(scheme: str, gated: bool) -> None:
    """moe.shared_expert_d: the output is the routed experts' plus the shared SwiGLU expert on every
    token (times sigmoid(x W_g) with moe.shared_expert_gate), computed here by hand; the routed part
    and the routing are those of the same layer without it."""
    moe = moe_cfg(n_noop=N_NOOP, **SCHEMES[scheme])
    plain = MoEFFN(16, 24, moe).double()
    shared = MoEFFN(16, 24, moe.model_copy(update={"shared_expert_d": 20, "shared_expert_gate": gated})).double()
    missing, unexpected = shared.load_state_dict(plain.state_dict(), strict=False)
    want_keys = {"shared_expert.gate_up.weight", "shared_expert.down.weight"} | ({"shared_expert_gate.weight"} if gated else set())
    assert set(missing) == want_keys and not unexpected
    assert shared.shared_expert.gate_up.weight.shape == (40, 16) and shared.shared_expert.down.weight.shape == (16, 20)
    if gated:
        assert shared.shared_expert_gate.weight.shape == (1, 16) and shared.shared_expert_gate.bias is None
    x = inputs()
    (routed, want), (out, got) = plain(x), shared(x)
    for a, b in zip(chosen(got), chosen(want), strict=True):
        assert torch.equal(a, b)
    close(out, routed + _shared_reference(shared, x, gated))
    assert (out - routed).abs().min() > 0  # every token, the no-op ones included, gets the shared term


def test_shared_expert_leaves_causal_padding_rows_at_zero() -> None:
    """Under causal routing a Staged MoDE block's padding rows (valid False) get no update from the
    shared expert either."""
    ffn = MoEFFN(16, 24, moe_cfg(scheme="token_choice", top_k=2, shared_expert_d=20, shared_expert_gate=True)).double()
    x = inputs()
    valid = torch.rand(BATCH, SEQ) > 0.3
    out, _ = ffn(x, valid, causal=True)
    assert torch.equal(out[~valid], torch.zeros_like(out[~valid]))
    assert (out[valid] != 0).all(-1).all()


@pytest.mark.parametrize("scheme", SCHEMES)
def test_defaults_leave_the_moe_layer_unchanged(scheme: str) -> None:
    """renormalize false and no shared expert: the parameters of the MoE layer as before (router and
    experts alone), and its output that of its routed experts, bit for bit, with the plain gates."""
    torch.manual_seed(0)
    ffn = MoEFFN(16, 24, moe_cfg(n_noop=N_NOOP, **SCHEMES[scheme])).double()
    assert set(ffn.state_dict()) == {"router.router.proj.weight", "experts.w_in", "experts.w_out"}
    assert ffn.shared_expert is None and ffn.shared_expert_gate is None
    x = inputs()
    out, routing = ffn(x)
    routed, _ = ffn._routed(x, None, False)
    assert torch.equal(out, routed)
    if isinstance(routing, TokenChoiceRouting):
        assert not ffn.router.renormalize
        probs = routing.logits[0].softmax(-1)
        assert torch.equal(routing.gates, probs.gather(-1, routing.slots))


def test_renormalize_and_shared_expert_gate_are_checked() -> None:
    with pytest.raises(ValueError, match="renormalize applies to scheme token_choice"):
        MoEConfig(scheme="expert_choice", renormalize=True)
    with pytest.raises(ValueError, match="shared_expert_gate needs a shared expert"):
        MoEConfig(scheme="token_choice", shared_expert_gate=True)
    with pytest.raises(ValueError):
        MoEConfig(shared_expert_d=0)
