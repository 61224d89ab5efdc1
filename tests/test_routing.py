"""Router primitives and the depth router, checked against obvious per-row Python references."""
from __future__ import annotations

import pytest
import torch

from mode.config import ModelConfig, RoutingConfig
from mode.layers.mod import MoDBlock
from mode.routing import (
    DepthRouter,
    Router,
    apply_gate,
    capacity_to_k,
    combine_tokens,
    count_ids,
    gather_tokens,
    primitives,
    scatter_add_tokens,
    split_tokens,
    token_choice_capacity,
    token_mask,
    top_k_positions,
)

# The router computes its scores in float32 by design (stable top-k under autocast), so a
# float64 reference of the score w^T x agrees only to float32 rounding: |r| ~ 1-10, float32
# epsilon ~1.2e-7, a dot product of 32 terms -> errors of order 1e-6; 1e-5 leaves margin.
ROUTER_F32_TOL = 1e-5

D, S = 32, 16


# ---------------------------------------------------------------------------- capacity_to_k

def test_capacity_to_k_edge_cases() -> None:
    assert capacity_to_k(16, 0.125) == 2
    assert capacity_to_k(16, 1.0) == 16  # full capacity: every token
    assert capacity_to_k(16, 1e-6) == 1  # never zero tokens
    assert capacity_to_k(1, 0.01) == 1
    assert capacity_to_k(1, 1.0) == 1
    assert capacity_to_k(8, 1.5) == 8  # never more tokens than the group holds
    assert capacity_to_k(2048, 0.125) == 256
    for bad in (0.0, -0.5):
        with pytest.raises(ValueError):
            capacity_to_k(16, bad)


def test_capacity_to_k_bounds_and_rounding_sweep() -> None:
    for tokens in range(1, 65):
        for capacity in (0.01, 0.05, 0.1, 0.125, 0.2, 0.25, 1 / 3, 0.5, 0.7, 0.9, 0.99, 1.0):
            k = capacity_to_k(tokens, capacity)
            assert isinstance(k, int)
            assert 1 <= k <= tokens, (tokens, capacity, k)
            exact = capacity * tokens
            if exact >= 1.0:  # rounded, so within half a token of capacity * T
                assert abs(k - exact) <= 0.5 + 1e-9, (tokens, capacity, k)
            else:
                assert k == 1 or abs(k - exact) <= 0.5 + 1e-9


def test_capacity_rounds_halves_up_without_float_error() -> None:
    assert capacity_to_k(20, 0.125) == 3 and capacity_to_k(36, 0.125) == 5  # 2.5 and 4.5: halves up
    assert capacity_to_k(28, 0.125) == 4 and capacity_to_k(44, 0.125) == 6  # 3.5 and 5.5, as before
    assert capacity_to_k(55, 1.5 / 11) == 8  # 7.5, which floats compute as 7.4999999999999991
    assert capacity_to_k(30, 0.1) == 3  # 3.0000000000000004
    assert token_choice_capacity(100, 10, 1, 1.1) == 11  # 11.000000000000002 is 11 tokens, not 12
    assert token_choice_capacity(100, 10, 1, 1.13) == 12  # a real fraction still rounds up
    assert token_choice_capacity(100, 3, 1, 1.0) == 34


# ------------------------------------------------------------------------- top_k_positions

def _python_top_k(row: list[float], k: int) -> list[int]:
    """The k largest entries of one row, their positions in increasing order."""
    by_score = sorted(range(len(row)), key=lambda i: row[i], reverse=True)
    return sorted(by_score[:k])


@pytest.mark.parametrize("shape", [(3, S), (2, 3, S)])
@pytest.mark.parametrize("k", [1, 4, 7, S])
def test_top_k_positions_matches_python_reference(shape: tuple[int, ...], k: int) -> None:
    scores = torch.randn(shape)  # continuous: no ties
    got = top_k_positions(scores, k)
    assert got.shape == (*shape[:-1], k)
    assert got.dtype == torch.int64
    rows = scores.reshape(-1, S).tolist()
    got_rows = got.reshape(-1, k).tolist()
    for row, got_row in zip(rows, got_rows):
        assert got_row == _python_top_k(row, k)


def test_top_k_positions_is_per_row() -> None:
    """Top-k over the whole batch would let one row's large scores steal another row's slots."""
    scores = torch.randn(3, S)
    k = 4
    before = top_k_positions(scores, k)
    boosted = scores.clone()
    boosted[1] = boosted[1] * 100 + 1000  # row 1 now outscores every other row everywhere
    after = top_k_positions(boosted, k)
    assert torch.equal(after[0], before[0]) and torch.equal(after[2], before[2])
    assert after.shape == (3, k)


# ------------------------------------------------------------------- gather / scatter / mask

def test_gather_tokens_matches_indexing() -> None:
    x = torch.randn(3, S, D)
    idx = top_k_positions(torch.randn(3, S), 5)  # (G, k)
    got = gather_tokens(x, idx)
    want = torch.stack([x[g, idx[g]] for g in range(3)])
    assert torch.equal(got, want)

    idx3 = torch.randint(0, S, (3, 4, 6))  # (G, E, C): expert choice, repeats allowed
    got3 = gather_tokens(x, idx3)
    assert got3.shape == (3, 4, 6, D)
    for g in range(3):
        for e in range(4):
            assert torch.equal(got3[g, e], x[g, idx3[g, e]])


def test_gather_scatter_round_trip() -> None:
    x = torch.randn(3, S, D, dtype=torch.float64)
    idx = top_k_positions(torch.randn(3, S), 6)
    mask = token_mask(idx, S)
    # scatter(0, idx, gather(x, idx)) keeps exactly the chosen tokens of x.
    kept = scatter_add_tokens(torch.zeros_like(x), idx, gather_tokens(x, idx))
    assert torch.equal(kept, x * mask.unsqueeze(-1))
    # Adding updates: chosen tokens get x + u, the others are bit-identical.
    updates = torch.randn(3, 6, D, dtype=torch.float64)
    out = scatter_add_tokens(x, idx, updates)
    assert torch.equal(out[~mask], x[~mask])
    assert torch.equal(gather_tokens(out, idx), gather_tokens(x, idx) + updates)
    assert x.data_ptr() != out.data_ptr()  # out of place: the input is not modified


def test_scatter_add_sums_repeated_tokens() -> None:
    """A token chosen by several experts receives the sum of their updates."""
    x = torch.randn(2, S, D, dtype=torch.float64)
    idx = torch.randint(0, S, (2, 3, 5))  # repeats within and across experts
    updates = torch.randn(2, 3, 5, D, dtype=torch.float64)
    want = x.clone()
    for g in range(2):
        for e in range(3):
            for c in range(5):
                want[g, idx[g, e, c]] += updates[g, e, c]
    # float64 sums of at most 16 terms of size ~1: reordering error far below 1e-12.
    torch.testing.assert_close(scatter_add_tokens(x, idx, updates), want, rtol=0, atol=1e-12)


def test_gather_scatter_gradients() -> None:
    x = torch.randn(2, 8, 4, dtype=torch.float64, requires_grad=True)
    u = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
    idx = top_k_positions(torch.randn(2, 8), 3)
    assert torch.autograd.gradcheck(lambda t: gather_tokens(t, idx), (x,))
    assert torch.autograd.gradcheck(lambda t, v: scatter_add_tokens(t, idx, v), (x, u))
    # repeated tokens (expert choice: several experts take one token): gradients sum over the repeats
    rep = torch.randint(0, 8, (2, 3, 5))
    u = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(lambda t: gather_tokens(t, rep), (x,))
    assert torch.autograd.gradcheck(lambda t, v: scatter_add_tokens(t, rep, v), (x, u))


def test_combine_tokens_is_scatter_add_into_zeros() -> None:
    """combine_tokens = scatter_add_tokens on zeros (repeats summed), in eager and traced form, gradients included."""
    rep = torch.randint(0, 8, (2, 3, 5))  # (G, E, C): expert choice, repeats allowed
    u = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    want = scatter_add_tokens(torch.zeros(2, 8, 4, dtype=torch.float64), rep, u)
    got = combine_tokens(rep, u, 8)
    assert got.shape == (2, 8, 4) and got.dtype == u.dtype
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # float64 sums of <= 15 terms
    assert torch.autograd.gradcheck(lambda v: combine_tokens(rep, v, 8), (u,))
    w = torch.randn(2, 8, 4, dtype=torch.float64)
    (want_grad,) = torch.autograd.grad((combine_tokens(rep, u, 8) * w).sum(), (u,))
    torch._dynamo.reset()
    compiled = torch.compile(lambda v: combine_tokens(rep, v, 8), backend="aot_eager", fullgraph=True)
    traced = compiled(u)
    (traced_grad,) = torch.autograd.grad((traced * w).sum(), (u,))
    torch.testing.assert_close(traced, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(traced_grad, want_grad, rtol=0, atol=1e-12)


def test_combine_tokens_into_a_residual_adds_the_combine_to_it() -> None:
    """combine_tokens(..., into=r) = r + combine_tokens(...): the rows summed straight into r, eager and
    traced, gradients of r and of the rows included; r itself is left unchanged."""
    rep = torch.randint(0, 8, (2, 3, 5))  # (G, E, C): expert choice, repeats allowed
    u = torch.randn(2, 3, 5, 4, dtype=torch.float64, requires_grad=True)
    r = torch.randn(2, 8, 4, dtype=torch.float64, requires_grad=True)
    kept = r.detach().clone()
    w = torch.randn(2, 8, 4, dtype=torch.float64)
    want = r + combine_tokens(rep, u, 8)
    want_grads = torch.autograd.grad((want * w).sum(), (r, u))
    torch._dynamo.reset()
    traced = torch.compile(lambda a, v: combine_tokens(rep, v, 8, a), backend="aot_eager", fullgraph=True)
    for run in (lambda a, v: combine_tokens(rep, v, 8, a), traced):
        got = run(r, u)
        got_grads = torch.autograd.grad((got * w).sum(), (r, u))
        torch.testing.assert_close(got, want, rtol=0, atol=1e-12)  # float64 sums of <= 16 terms, reordered
        for g, h in zip(got_grads, want_grads):
            torch.testing.assert_close(g, h, rtol=0, atol=1e-12)
        assert torch.equal(r, kept)
    assert torch.autograd.gradcheck(lambda a, v: combine_tokens(rep, v, 8, a), (r, u))


def test_split_tokens_is_gather_and_identity() -> None:
    """split_tokens(x, idx) = (gather_tokens(x, idx), x), gradients included (repeats summed)."""
    x = torch.randn(2, 8, 4, dtype=torch.float64, requires_grad=True)
    rep = torch.randint(0, 8, (2, 3, 5))
    rows, residual = split_tokens(x, rep)
    assert torch.equal(rows, gather_tokens(x, rep)) and torch.equal(residual, x)

    def routed(t: torch.Tensor) -> torch.Tensor:
        chosen, rest = split_tokens(t, rep)
        return scatter_add_tokens(rest, rep, chosen.sin())

    assert torch.autograd.gradcheck(routed, (x,))
    # Only one output used: the other's gradient is zero, not an error.
    assert torch.autograd.gradcheck(lambda t: split_tokens(t, rep)[0], (x,))
    assert torch.autograd.gradcheck(lambda t: split_tokens(t, rep)[1] * 3, (x,))


def test_compiled_gather_scatter_match_eager() -> None:
    """Under torch.compile the primitives trace plain gather / scatter_add: same values and gradients.

    aot_eager runs the traced forward and backward graphs without generating kernels, so this
    checks the traced ops and their derivatives (the compiled branch), quickly, on CPU.
    """
    x = torch.randn(2, S, D, dtype=torch.float64, requires_grad=True)
    u = torch.randn(2, 3, 5, D, dtype=torch.float64, requires_grad=True)
    idx = torch.randint(0, S, (2, 3, 5))  # repeats: several experts take one token

    def routed(t: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        chosen, rest = split_tokens(t * 2, idx)
        return scatter_add_tokens(rest, idx, gather_tokens(t, idx).sin() * v * chosen)

    w = torch.randn(2, S, D, dtype=torch.float64)
    want = routed(x, u)
    want_grads = torch.autograd.grad((want * w).sum(), (x, u))
    torch._dynamo.reset()
    got = torch.compile(routed, backend="aot_eager", fullgraph=True)(x, u)
    got_grads = torch.autograd.grad((got * w).sum(), (x, u))
    # float64, sums of at most 16 terms: the same up to the order of the additions.
    torch.testing.assert_close(got, want, rtol=0, atol=1e-12)
    for g, h in zip(got_grads, want_grads):
        torch.testing.assert_close(g, h, rtol=0, atol=1e-12)


def test_count_ids_is_a_static_bincount() -> None:
    ids = torch.randint(0, 7, (40, 3))
    assert torch.equal(count_ids(ids, 9), torch.bincount(ids.reshape(-1), minlength=9))
    assert count_ids(torch.zeros(0, dtype=torch.long), 4).tolist() == [0, 0, 0, 0]


def test_token_mask() -> None:
    idx = top_k_positions(torch.randn(3, S), 5)
    mask = token_mask(idx, S)
    assert mask.dtype == torch.bool and mask.shape == (3, S)
    for g in range(3):
        assert mask[g].nonzero().flatten().tolist() == idx[g].tolist()


def test_apply_gate() -> None:
    r = torch.randn(4, 5)
    assert torch.equal(apply_gate(r, "identity"), r)
    assert torch.equal(apply_gate(r, "sigmoid"), torch.sigmoid(r))
    with pytest.raises(ValueError):
        apply_gate(r, "softmax")


# ------------------------------------------------------------------------------ DepthRouter

def _check_exact_k_sorted(indices: torch.Tensor, batch: int, k: int) -> None:
    assert indices.shape == (batch, k)
    for row in indices.tolist():
        assert row == sorted(set(row)), row  # k distinct positions in increasing order
        assert all(0 <= i < S for i in row)


@pytest.mark.parametrize("gate", ["sigmoid", "identity"])
def test_depth_router_scores_gates_and_k(gate: str) -> None:
    capacity = 0.25
    router = DepthRouter(D, capacity, gate, random=False)
    x = torch.randn(3, S, D)
    routing = router(x)
    k = capacity_to_k(S, capacity)
    _check_exact_k_sorted(routing.positions, 3, k)
    ref_scores = (x.double() @ router.router.proj.weight.double().T).squeeze(-1)  # (B, S)
    assert routing.logits.dtype == torch.float32
    torch.testing.assert_close(routing.logits.double(), ref_scores, rtol=ROUTER_F32_TOL, atol=ROUTER_F32_TOL)
    for b in range(3):
        assert routing.positions[b].tolist() == _python_top_k(routing.logits[b].tolist(), k)
    torch.testing.assert_close(
        routing.gates, apply_gate(routing.logits.gather(1, routing.positions), gate), rtol=0, atol=0
    )
    assert float(routing.aux_loss) == 0.0


@pytest.mark.parametrize("gate", ["sigmoid", "identity"])
def test_random_routing_switch(gate: str) -> None:
    """RoutingConfig(random=True): random choice of tokens, still k per sequence, gate still learned."""
    cfg = ModelConfig(d_model=D, n_heads=4, d_ff=64, n_layers=2, max_seq_len=32)
    capacity = 0.25
    k = capacity_to_k(S, capacity)
    block = MoDBlock(cfg, RoutingConfig(capacity=capacity, gate=gate, random=True))
    assert block.router.random
    router = block.router
    x = torch.randn(3, S, D)

    torch.manual_seed(123)
    routing = router(x)
    _check_exact_k_sorted(routing.positions, 3, k)
    learned = top_k_positions(routing.logits.detach(), k)
    assert not torch.equal(routing.positions, learned)  # chooses differently from the scores

    torch.manual_seed(123)
    again = router(x)
    assert torch.equal(again.positions, routing.positions)  # reproducible under a fixed seed
    torch.manual_seed(124)
    assert not torch.equal(router(x).positions, routing.positions)  # but actually random

    # The gate comes from the learned score at the randomly chosen positions...
    torch.testing.assert_close(
        routing.gates, apply_gate(routing.logits.gather(1, routing.positions), gate), rtol=0, atol=0
    )
    # ... so the router still learns through it.
    (routing.gates * torch.randn_like(routing.gates)).sum().backward()
    grad = router.router.proj.weight.grad
    assert grad is not None and torch.isfinite(grad).all() and grad.abs().sum() > 0


@pytest.mark.parametrize("causal", ["none", "predictor", "aux_loss"])
@pytest.mark.parametrize("random", [False, True])
def test_route_equals_forward_then_gather(causal: str, random: bool) -> None:
    """DepthRouter.route (what MoDBlock uses) gives forward()'s routing and gather_tokens' rows,
    and the same gradients for x and every router parameter, whether it takes its sparse path
    (causal none / predictor: the gate is recomputed from the chosen rows) or not (aux_loss)."""
    router = DepthRouter(D, 0.25, "sigmoid", random=random, causal=causal)
    x = torch.randn(3, S, D, requires_grad=True)
    update = torch.randn(3, capacity_to_k(S, 0.25), D)

    def loss_of(routing, chosen: torch.Tensor) -> torch.Tensor:
        return (routing.gates.unsqueeze(-1) * chosen * update).sum() + routing.aux_loss

    torch.manual_seed(5)
    ref = router(x)
    ref_chosen = gather_tokens(x, ref.positions)
    ref_grads = torch.autograd.grad(loss_of(ref, ref_chosen), [x, *router.parameters()])
    torch.manual_seed(5)
    got, got_chosen, residual, writable, _ = router.route(x)
    assert writable is (causal == "none")  # a causal predictor or the aux-loss logit saved x
    got_grads = torch.autograd.grad(loss_of(got, got_chosen) + (residual * update.sum()).sum(), [x, *router.parameters()])
    ref_grads = (ref_grads[0] + update.sum(), *ref_grads[1:])  # the residual's gradient reaches x unchanged
    assert torch.equal(residual, x)

    assert torch.equal(got.positions, ref.positions) and torch.equal(got_chosen, ref_chosen)
    assert torch.equal(got.logits, ref.logits.detach())
    # The recomputed gate scores are the same float32 dot products over fewer rows.
    torch.testing.assert_close(got.gates, ref.gates, rtol=ROUTER_F32_TOL, atol=ROUTER_F32_TOL)
    torch.testing.assert_close(got.aux_loss, ref.aux_loss, rtol=ROUTER_F32_TOL, atol=ROUTER_F32_TOL)
    for g, h in zip(got_grads, ref_grads):
        torch.testing.assert_close(g, h, rtol=ROUTER_F32_TOL, atol=ROUTER_F32_TOL)


def test_updates_added_in_place_equal_a_copy() -> None:
    """split_tokens then scatter_add_tokens(in_place=True): x's memory updated, the output and
    the gradients of x and the updates those of the out-of-place path (float64, exact), the
    updates' duplicates summed; the copy path leaves x as it was."""
    idx = torch.tensor([[1, 3, 3], [0, 2, 5]])  # a token twice: its updates sum
    outputs = {}
    for in_place in (False, True):
        torch.manual_seed(0)
        leaf = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
        updates = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
        x = leaf * 1.0  # a non-leaf, as a block's input is
        before = x.detach().clone()
        chosen, residual = split_tokens(x, idx)
        out = scatter_add_tokens(residual, idx, updates * chosen, in_place=in_place)
        assert (out.data_ptr() == x.data_ptr()) is in_place
        assert torch.equal(x.detach(), out.detach() if in_place else before)
        weights = torch.randn_like(out)
        (out * weights).sum().backward()
        outputs[in_place] = (out.detach(), leaf.grad, updates.grad)
    for a, b in zip(outputs[False], outputs[True], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


@pytest.mark.parametrize("in_place_update", [True, False], ids=["update in place", "update copied"])
def test_rows_gradient_added_into_an_owned_gradient_equals_a_copy(in_place_update: bool) -> None:
    """split_tokens(grad_in_place=True): the chosen rows' gradient is added into the gradient that
    reached the residual itself (observable: that tensor changes), with the same gradients as
    the copy path (float64, exact)."""
    idx = torch.tensor([[1, 3, 3], [0, 2, 5]])
    weights = torch.randn(2, 6, 4, dtype=torch.float64)
    outputs = {}
    for grad_in_place in (False, True):
        torch.manual_seed(0)
        leaf = torch.randn(2, 6, 4, dtype=torch.float64, requires_grad=True)
        updates = torch.randn(2, 3, 4, dtype=torch.float64, requires_grad=True)
        chosen, residual = split_tokens(leaf * 1.0, idx, grad_in_place=grad_in_place)
        out = scatter_add_tokens(residual, idx, updates * chosen, in_place=in_place_update)
        reached = []
        out.register_hook(reached.append)
        (out * weights).sum().backward()  # the gradient reaching out is weights' product: a new tensor
        assert torch.equal(reached[0], weights) is not grad_in_place
        outputs[grad_in_place] = (leaf.grad, updates.grad)
    for a, b in zip(outputs[False], outputs[True], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_in_place_update_of_a_saved_tensor_is_refused() -> None:
    """Were anything to save x for its backward, the in-place update makes autograd raise
    (the alias shares x's version counter): never a gradient from overwritten values."""
    x = torch.randn(2, 6, 4, requires_grad=True) * 1.0
    saved = x.sin()  # sin saves x
    idx = torch.tensor([[0, 1], [2, 3]])
    chosen, residual = split_tokens(x, idx)
    out = scatter_add_tokens(residual, idx, chosen * 2.0, in_place=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (out.sum() + saved.sum()).backward()


# ------------------------------------------------------------------------- bf16 router scores

def _fp32_router_reference(x: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Scores, dx, dw of the float32 path for the loss sum(scores * probe): autograd through x.float()."""
    x, weight = x.detach().requires_grad_(), weight.detach().requires_grad_()
    scores = torch.nn.functional.linear(x.float(), weight.float())
    probe = torch.linspace(-1, 1, scores.numel()).view_as(scores)
    (scores * probe).sum().backward()
    return scores.detach(), x.grad, weight.grad


def test_half_router_scores_match_the_float32_path() -> None:
    """The bf16-in / float32-out router GEMM gives the float32 path's scores (the same exact
    products, summed in float32) and its gradients up to the bf16 rounding of the score gradient."""
    from mode.routing.primitives import _HalfRouterScores

    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, D, generator=gen).bfloat16()
    weight = (0.1 * torch.randn(5, D, generator=gen)).bfloat16()
    ref_scores, ref_dx, ref_dw = _fp32_router_reference(x, weight)

    xh, wh = x.clone().requires_grad_(), weight.clone().requires_grad_()
    scores = _HalfRouterScores.apply(xh, wh)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(scores, ref_scores, rtol=0, atol=ROUTER_F32_TOL)
    probe = torch.linspace(-1, 1, scores.numel()).view_as(scores)
    (scores * probe).sum().backward()
    assert xh.grad.dtype == wh.grad.dtype == torch.bfloat16
    # Both paths end in bf16 gradients; this one also rounds the score gradient to bf16 first:
    # a few bf16 ulps (2^-8 relative each) on a sum of 5 (dx) or 64 (dw) terms.
    torch.testing.assert_close(xh.grad.float(), ref_dx.float(), rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(wh.grad.float(), ref_dw.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the bf16 router GEMM runs on CUDA only")
@pytest.mark.parametrize("bias", [False, True])
def test_router_scores_on_cuda_take_the_bf16_gemm_and_match_float32(bias: bool) -> None:
    from mode.routing import router_scores

    router = Router(D, 4, bias=bias).cuda().bfloat16()
    x = torch.randn(2, 48, D, device="cuda", dtype=torch.bfloat16)
    assert primitives.half_router_applies(x, router.proj.weight)
    runs = {}
    for half in (True, False):  # False: the float32 copy of x
        router.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            scores = router(xi) if half else router_scores(xi, router.proj.weight, router.proj.bias, half=False)
        assert scores.dtype == torch.float32
        probe = torch.linspace(-1, 1, scores.numel(), device="cuda").view_as(scores)
        (scores * probe).sum().backward()
        runs[half] = (scores.detach(), xi.grad.float(), router.proj.weight.grad.float())
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=0, atol=ROUTER_F32_TOL)
    torch.testing.assert_close(runs[True][1], runs[False][1], rtol=2e-2, atol=2e-3)
    torch.testing.assert_close(runs[True][2], runs[False][2], rtol=2e-2, atol=2e-2)


# ------------------------------------------------- the router and the update as two autograd nodes

@pytest.mark.parametrize("gate, bias, random, in_place", [
    ("sigmoid", False, False, False),
    ("identity", True, False, True),
    ("sigmoid", True, True, True),
], ids=["sigmoid", "identity with a bias, in place", "random routing, in place"])
def test_two_autograd_nodes_equal_the_separate_ops(gate: str, bias: bool, random: bool, in_place: bool) -> None:
    """route_tokens and add_gated_tokens as two autograd nodes with hand-written backwards (fused,
    the eager default) against the separate ops autograd records (fused=False, as under
    torch.compile), around a block (a linear map and tanh of the chosen rows): the same chosen
    tokens, and the output, the input's gradient and the router's and the block's gradients (the
    router's float32 scores of the chosen rows come from another GEMV: ROUTER_F32_TOL)."""
    from mode.routing import add_gated_tokens, route_tokens

    groups, k = 3, 4
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(groups, S, D, dtype=torch.float64, generator=gen)
    probe = torch.randn(groups, S, D, dtype=torch.float64, generator=gen)
    params0 = {"weight": 0.2 * torch.randn(1, D, dtype=torch.float64, generator=gen),
               "block": 0.2 * torch.randn(D, D, dtype=torch.float64, generator=gen)}
    if bias:
        params0["bias"] = torch.randn(1, dtype=torch.float64, generator=gen)
    runs = []
    for fused in (True, False):
        params = {n: p.clone().requires_grad_() for n, p in params0.items()}
        leaf = x0.clone().requires_grad_()
        x = leaf * 1.0  # a tensor the caller owns (the in-place update writes into it)
        torch.manual_seed(1)  # random routing draws the same tokens both ways
        route = route_tokens(x, params["weight"], params.get("bias"), k, gate, random, grad_in_place=in_place,
                             fused=fused)
        update = torch.tanh(route.chosen @ params["block"])  # (G, k, D)
        out = add_gated_tokens(route.residual, route.positions, route.gates, update, in_place, route.flat, fused=fused)
        assert (out.data_ptr() == x.data_ptr()) == in_place
        (out * probe).sum().backward()
        runs.append((route.positions, out.detach(), leaf.grad, {n: p.grad for n, p in params.items()}))
    (idx, out, x_grad, grads), (want_idx, want_out, want_x_grad, want_grads) = runs
    assert torch.equal(idx, want_idx)
    tolerance = dict(rtol=ROUTER_F32_TOL, atol=ROUTER_F32_TOL)
    torch.testing.assert_close(out, want_out, **tolerance)
    torch.testing.assert_close(x_grad, want_x_grad, **tolerance)
    assert grads["weight"].abs().sum() > 0 and (not bias or grads["bias"].abs() > 0)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], **tolerance, msg=lambda m, n=name: f"{n}: {m}")


# ------------------------------------------------- random routing under data parallelism

@pytest.mark.parametrize("fused", [True, False])
def test_random_rows_of_two_processes_are_one_process_halves(fused: bool) -> None:
    """random_rows = (rank, world): each of 2 processes, its generator seeded as the other's, draws
    the random scores of the 2-fold batch and keeps its rows, so the two route as one process with
    the whole batch; set_random_score_rows gives every depth router of a model its rows."""
    from mode.routing import random_scores, route_tokens, set_random_score_rows

    x = torch.randn(4, S, D)
    weight = torch.randn(1, D)
    torch.manual_seed(3)
    whole = route_tokens(x, weight, None, 3, "sigmoid", random=True, fused=fused).positions
    halves = []
    for rank in (0, 1):
        torch.manual_seed(3)
        halves.append(route_tokens(x[2 * rank : 2 * rank + 2], weight, None, 3, "sigmoid", random=True,
                                   random_rows=(rank, 2), fused=fused).positions)
    assert torch.equal(torch.cat(halves), whole)
    torch.manual_seed(3)
    kept = random_scores(torch.zeros(2, S), (1, 2))
    torch.manual_seed(3)
    assert torch.equal(kept, torch.rand(4, S)[2:])

    cfg = ModelConfig(d_model=D, n_heads=4, n_layers=2, d_ff=64, max_seq_len=S)
    model = torch.nn.ModuleList([MoDBlock(cfg, RoutingConfig(random=True)) for _ in range(2)])
    assert set_random_score_rows(model, 1, 4) == 2
    assert all(block.router.random_rows == (1, 4) for block in model)
    with pytest.raises(ValueError, match="rank 4 of 4"):
        set_random_score_rows(model, 4, 4)
