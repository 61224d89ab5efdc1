"""The Mixture-of-Depths block against slow, obvious references (docs/routing-math.md).

Everything runs in float64 so the block and the reference agree to summation-order
rounding. The router alone computes in float32 by design; where its score matters the
tests take the gate from the block's Routing and check that gate separately.
"""
from __future__ import annotations

import copy
import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor

from mode.config import ModelConfig, RoutingConfig
from mode.layers.block import TransformerBlock
from mode.layers.mod import MoDBlock
from mode.layers.rotary import RotaryEmbedding
from mode.routing import apply_gate, capacity_to_k, gather_tokens, token_mask

# float64 fast path vs float64 reference: the two differ only in the order of sums
# (SDPA vs explicit softmax, fused vs separate residual adds) on values of size ~1-10,
# so errors are ~1e-14; 1e-10 leaves a wide margin and still catches any real mistake.
F64_TOL = 1e-10
# The router scores in float32 by design (see mode/routing/router.py): a float64 reference
# score agrees to float32 rounding, ~1e-6 on scores of size ~1-10.
ROUTER_F32_TOL = 1e-5
# A change in rotary positions moves attention outputs by O(0.1-1) here; anything
# below this floor would mean the positions made no visible difference.
POSITION_EFFECT_FLOOR = 1e-3

B, S, D, H, DFF = 3, 16, 32, 4, 64
HD = D // H


@pytest.fixture
def cfg() -> ModelConfig:
    return ModelConfig(d_model=D, n_heads=H, d_ff=DFF, n_layers=2, max_seq_len=32)


def make_block(cfg: ModelConfig) -> TransformerBlock:
    """A dense block in float64 with every weight random (norm gains too), updates of size ~1."""
    block = TransformerBlock(cfg).double()
    with torch.no_grad():
        for name, p in block.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.2 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / math.sqrt(p.shape[1]))
    return block


def make_mod(cfg: ModelConfig, routing: RoutingConfig, block: TransformerBlock | None = None) -> MoDBlock:
    mod = MoDBlock(cfg, routing, block=block if block is not None else make_block(cfg)).double()
    with torch.no_grad():
        mod.router.router.proj.weight.copy_(torch.randn(1, D) / math.sqrt(D) * 2)
    return mod


def set_constant_gate(mod: MoDBlock, value: float) -> None:
    """Identity gate with weight 0 and bias `value`: every token scores `value`, g = value."""
    with torch.no_grad():
        mod.router.router.proj.weight.zero_()
        mod.router.router.proj.bias.fill_(value)


def rotary(cfg: ModelConfig) -> RotaryEmbedding:
    return RotaryEmbedding(HD, cfg.max_seq_len, cfg.rope_base).double()


# ------------------------------------------------------------------------- the reference

def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x (B, S, H, hd); cos, sin (S, hd/2): pair (i, i + hd/2) rotated by token's angle."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[None, :, None, :], sin[None, :, None, :]
    return torch.cat((x1 * c - x2 * s, x1 * s + x2 * c), dim=-1)


def reference_update(
    block: TransformerBlock, x: Tensor, chosen: Tensor, cos: Tensor, sin: Tensor, eps: float
) -> Tensor:
    """f for every token of x (B, S, D), the slow obvious way.

    Attention runs over all S tokens, each rotated by the angle of its own row in cos/sin,
    with an explicit mask: query i sees key j only if both are chosen and j <= i.
    Rows of unchosen queries are meaningless (they see only themselves) and must be ignored.
    """
    batch, seq, width = x.shape
    wq, wk, wv = block.attn.qkv.weight.split(width, dim=0)
    hx = rms_norm(x, block.attn_norm.weight, eps)
    q = (hx @ wq.T).view(batch, seq, H, HD)
    k = (hx @ wk.T).view(batch, seq, H, HD)
    v = (hx @ wv.T).view(batch, seq, H, HD)
    q, k = rotate(q, cos, sin), rotate(k, cos, sin)
    logits = torch.einsum("bihd,bjhd->bhij", q, k) / math.sqrt(HD)  # (B, H, S, S)
    causal = torch.ones(seq, seq, dtype=torch.bool).tril()  # [i, j]: j <= i
    allowed = chosen[:, :, None] & chosen[:, None, :] & causal  # (B, S, S)
    allowed = allowed | torch.eye(seq, dtype=torch.bool)  # unchosen rows: avoid an empty softmax
    logits = logits.masked_fill(~allowed[:, None], float("-inf"))
    probs = logits.softmax(dim=-1)
    y = torch.einsum("bhij,bjhd->bihd", probs, v).reshape(batch, seq, width)
    a = y @ block.attn.out.weight.T
    h = x + a
    gate, up = (rms_norm(h, block.ffn_norm.weight, eps) @ block.ffn.gate_up.weight.T).split(DFF, dim=-1)
    m = (F.silu(gate) * up) @ block.ffn.down.weight.T
    return a + m  # out - x


def python_top_k(row: list[float], k: int) -> list[int]:
    return sorted(sorted(range(len(row)), key=lambda i: row[i], reverse=True)[:k])


# ------------------------------------------------------------------ reference sanity check

def test_reference_with_all_tokens_equals_dense_block(cfg: ModelConfig) -> None:
    """The reference itself, on all tokens, must reproduce the dense block (SDPA path)."""
    block = make_block(cfg)
    rope = rotary(cfg)
    x = torch.randn(B, S, D, dtype=torch.float64)
    dense, _ = block(x, rope.prefix(S))
    f = reference_update(block, x, torch.ones(B, S, dtype=torch.bool), rope.cos[:S], rope.sin[:S], cfg.norm_eps)
    torch.testing.assert_close(x + f, dense, rtol=F64_TOL, atol=F64_TOL)


def test_rotary_table_is_cos_sin_of_positions(cfg: ModelConfig) -> None:
    rope = RotaryEmbedding(HD, cfg.max_seq_len, cfg.rope_base)  # tables stored in float32
    pos = torch.arange(cfg.max_seq_len, dtype=torch.float64)[:, None]
    inv = cfg.rope_base ** (-torch.arange(0, HD, 2, dtype=torch.float64) / HD)
    # float32 storage of cos/sin: rounding error <= 6e-8.
    torch.testing.assert_close(rope.cos.double(), torch.cos(pos * inv), rtol=0, atol=1e-7)
    torch.testing.assert_close(rope.sin.double(), torch.sin(pos * inv), rtol=0, atol=1e-7)
    idx = torch.tensor([[0, 3, 9], [2, 5, 15]])
    sel = rope.prefix(S).select(idx)
    assert sel.cos.shape == (2, 3, 1, HD // 2)
    for b in range(2):
        assert torch.equal(sel.cos[b, :, 0], rope.cos[idx[b]])
        assert torch.equal(sel.sin[b, :, 0], rope.sin[idx[b]])


# --------------------------------------------------------- 1. capacity 1 + unit gate = dense

def test_full_capacity_unit_gate_equals_dense(cfg: ModelConfig) -> None:
    dense = make_block(cfg)
    mod = make_mod(cfg, RoutingConfig(capacity=1.0, gate="identity", router_bias=True), copy.deepcopy(dense))
    set_constant_gate(mod, 1.0)
    angles = rotary(cfg).prefix(S)
    x = torch.randn(B, S, D, dtype=torch.float64)
    x_dense, x_mod = x.clone().requires_grad_(), x.clone().requires_grad_()

    out_dense, _ = dense(x_dense, angles)
    out_mod, info = mod(x_mod, angles)
    assert torch.equal(info.routing.positions, torch.arange(S).expand(B, S))
    assert torch.equal(info.routing.gates, torch.ones(B, S))
    torch.testing.assert_close(out_mod, out_dense, rtol=F64_TOL, atol=F64_TOL)

    weight = torch.randn_like(out_dense)
    (out_dense * weight).sum().backward()
    (out_mod * weight).sum().backward()
    torch.testing.assert_close(x_mod.grad, x_dense.grad, rtol=F64_TOL, atol=F64_TOL)
    mod_params = dict(mod.block.named_parameters())
    for name, p in dense.named_parameters():
        assert p.grad is not None and mod_params[name].grad is not None, name
        torch.testing.assert_close(mod_params[name].grad, p.grad, rtol=F64_TOL, atol=F64_TOL, msg=name)


# ------------------------------------- 2. unchosen untouched, k updated, router gets gradient

@pytest.mark.parametrize("gate", ["sigmoid", "identity"])
@pytest.mark.parametrize("capacity", [0.125, 0.5])
def test_unchosen_identical_k_updated_router_gradient(cfg: ModelConfig, gate: str, capacity: float) -> None:
    mod = make_mod(cfg, RoutingConfig(capacity=capacity, gate=gate))
    angles = rotary(cfg).prefix(S)
    x = torch.randn(B, S, D, dtype=torch.float64, requires_grad=True)
    out, info = mod(x, angles)
    idx = info.routing.positions
    k = capacity_to_k(S, capacity)
    assert idx.shape == (B, k)
    mask = token_mask(idx, S)
    assert (mask.sum(dim=1) == k).all()

    assert torch.equal(out[~mask], x[~mask])  # bit-identical, not merely close
    changed = (out != x).any(dim=-1)  # (B, S)
    assert torch.equal(changed, mask)  # exactly the chosen tokens moved
    assert (changed.sum(dim=1) == k).all()

    weight = torch.randn_like(out)
    (out * weight).sum().backward()
    grad = mod.router.router.proj.weight.grad
    assert grad is not None and grad.abs().sum() > 0

    # The router's gradient is exactly the gate path: sum_i g'(r_i) <dL/dout_i, f_i> x_i.
    with torch.no_grad():
        f = mod.block.update(gather_tokens(x, idx), angles.select(idx))  # (B, k, D)
        r = info.routing.logits.gather(1, idx).double()
        dg = torch.ones_like(r) if gate == "identity" else torch.sigmoid(r) * (1 - torch.sigmoid(r))
        dl_dgate = (gather_tokens(weight, idx) * f).sum(-1)  # (B, k)
        want = torch.einsum("bk,bkd->d", dl_dgate * dg, gather_tokens(x, idx))
    scale = want.abs().max()
    torch.testing.assert_close(grad[0], want, rtol=ROUTER_F32_TOL, atol=ROUTER_F32_TOL * scale)


# ----------------------------------------- 3. chosen tokens = masked full-attention reference

@pytest.mark.parametrize("gate", ["sigmoid", "identity"])
@pytest.mark.parametrize("capacity", [0.25, 0.5])
def test_matches_masked_full_attention_reference(cfg: ModelConfig, gate: str, capacity: float) -> None:
    mod = make_mod(cfg, RoutingConfig(capacity=capacity, gate=gate))
    rope = rotary(cfg)
    x = torch.randn(B, S, D, dtype=torch.float64)
    out, info = mod(x, rope.prefix(S))
    idx, gates = info.routing.positions, info.routing.gates
    k = capacity_to_k(S, capacity)

    # Selection and gate from a float64 score, per sequence, the obvious way.
    scores = (x @ mod.router.router.proj.weight[0]).tolist()  # (B, S)
    for b in range(B):
        assert idx[b].tolist() == python_top_k(scores[b], k)
    want_gates = apply_gate(torch.tensor(scores, dtype=torch.float64).gather(1, idx), gate)
    torch.testing.assert_close(gates.double(), want_gates, rtol=ROUTER_F32_TOL, atol=ROUTER_F32_TOL)
    # Selections differ between sequences, so one row's mask applied to all rows would show.
    assert not all(torch.equal(idx[0], idx[b]) for b in range(1, B))

    mask = token_mask(idx, S)
    f = reference_update(mod.block, x, mask, rope.cos[:S], rope.sin[:S], cfg.norm_eps)  # original positions
    want = x.clone()
    want[mask] = x[mask] + gates.double().reshape(-1, 1) * f[mask]
    torch.testing.assert_close(out, want, rtol=F64_TOL, atol=F64_TOL)
    assert torch.equal(out[~mask], x[~mask])


# ------------------------------------------------------------ 4. per-sequence selection

@pytest.mark.parametrize("random", [False, True])
def test_changing_one_sequence_leaves_others_unchanged(cfg: ModelConfig, random: bool) -> None:
    mod = make_mod(cfg, RoutingConfig(capacity=0.25, gate="sigmoid", random=random))
    angles = rotary(cfg).prefix(S)
    x = torch.randn(B, S, D, dtype=torch.float64)
    # Push every token of sequence 1 far above every score of the others: a top-k taken
    # across the batch would then hand all the slots to sequence 1.
    w = mod.router.router.proj.weight[0].detach()
    x2 = x.clone()
    x2[1] = torch.randn(S, D, dtype=torch.float64) + 50.0 * w / w.norm()

    torch.manual_seed(7)
    out1, info1 = mod(x, angles)
    torch.manual_seed(7)
    out2, info2 = mod(x2, angles)
    others = [0, 2]
    assert torch.equal(info2.routing.positions[others], info1.routing.positions[others])
    assert torch.equal(info2.routing.gates[others], info1.routing.gates[others])
    assert torch.equal(out2[others], out1[others])
    assert not torch.equal(out2[1], out1[1])  # the change to sequence 1 did take effect


# ------------------------------------------------------------------------ 6. pitfalls

def test_zero_gate_output_equals_input(cfg: ModelConfig) -> None:
    """g multiplies only f: with g = 0 the block is the identity, residual intact."""
    mod = make_mod(cfg, RoutingConfig(capacity=0.5, gate="identity", router_bias=True))
    set_constant_gate(mod, 0.0)
    angles = rotary(cfg).prefix(S)
    x = 3.0 * torch.randn(B, S, D, dtype=torch.float64)
    out, info = mod(x, angles)
    assert torch.equal(out, x)
    # Meaningful only if the block's update is not itself zero.
    idx = info.routing.positions
    assert mod.block.update(gather_tokens(x, idx), angles.select(idx)).abs().min() > 0


def test_constant_gate_scales_only_the_update(cfg: ModelConfig) -> None:
    """g = 0.5: out = x + 0.5 f for chosen tokens, not 0.5 (x + f), not 2x + 0.5 f."""
    mod = make_mod(cfg, RoutingConfig(capacity=0.5, gate="identity", router_bias=True))
    set_constant_gate(mod, 0.5)
    rope = rotary(cfg)
    x = torch.randn(B, S, D, dtype=torch.float64)
    out, info = mod(x, rope.prefix(S))
    mask = token_mask(info.routing.positions, S)
    f = reference_update(mod.block, x, mask, rope.cos[:S], rope.sin[:S], cfg.norm_eps)
    torch.testing.assert_close(out[mask], x[mask] + 0.5 * f[mask], rtol=F64_TOL, atol=F64_TOL)
    assert (out[mask] - 0.5 * (x[mask] + f[mask])).abs().max() > POSITION_EFFECT_FLOOR


def test_rotary_uses_original_positions(cfg: ModelConfig) -> None:
    mod = make_mod(cfg, RoutingConfig(capacity=0.5, gate="sigmoid"))
    rope = rotary(cfg)
    x = torch.randn(B, S, D, dtype=torch.float64)
    out, info = mod(x, rope.prefix(S))
    idx, gates = info.routing.positions, info.routing.gates.double()
    k = idx.shape[1]
    assert not torch.equal(idx, torch.arange(k).expand(B, k))  # chosen positions are not 0..k-1
    chosen = gather_tokens(x, idx)  # (B, k, D)
    got = gather_tokens(out, idx)
    all_k = torch.ones(B, k, dtype=torch.bool)

    # Right: each chosen token rotated by its original position idx[b, j].
    f_orig = torch.stack([
        reference_update(mod.block, chosen[b : b + 1], all_k[b : b + 1], rope.cos[idx[b]], rope.sin[idx[b]], cfg.norm_eps)[0]
        for b in range(B)
    ])
    torch.testing.assert_close(got, chosen + gates[..., None] * f_orig, rtol=F64_TOL, atol=F64_TOL)

    # Wrong: positions compacted to 0..k-1. The block must not agree with this.
    f_compact = reference_update(mod.block, chosen, all_k, rope.cos[:k], rope.sin[:k], cfg.norm_eps)
    assert (got - (chosen + gates[..., None] * f_compact)).abs().max() > POSITION_EFFECT_FLOOR
    # The block's own update with compacted angles reproduces the wrong answer, so the
    # difference above comes from the positions alone.
    torch.testing.assert_close(
        mod.block.update(chosen, rope.prefix(k)), f_compact, rtol=F64_TOL, atol=F64_TOL
    )


# ------------------------------------------------- the router node's backward

@pytest.mark.parametrize("used", ["gates and residual", "chosen rows"])
def test_route_tokens_backward_gets_none_for_unused_outputs(used: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The router node's backward gets None, not zero tensors made and filled for it, for every output
    the loss does not reach: the indices, flat positions and scores always, and here the chosen rows
    or the gates and residual; its gradients are those of the outputs used."""
    from mode.routing import primitives

    received = []
    backward = primitives._RouteTokens.backward

    def recording(ctx: object, *grads: torch.Tensor | None) -> tuple:
        received.append([g is not None for g in grads])
        return backward(ctx, *grads)

    monkeypatch.setattr(primitives._RouteTokens, "backward", staticmethod(recording))
    torch.manual_seed(0)
    x = torch.randn(B, S, D, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(1, D, dtype=torch.float64, requires_grad=True)
    route = primitives.route_tokens(x, weight, None, 4, "sigmoid")
    loss = (route.gates.sum() + route.residual.sum()) if used == "gates and residual" else route.chosen.sum()
    loss.backward()
    # outputs: chosen, residual, gates, indices, flat, scores
    assert received == [[used == "chosen rows", used != "chosen rows", used != "chosen rows", False, False, False]]
    assert x.grad is not None and (weight.grad is not None) == (used != "chosen rows")
