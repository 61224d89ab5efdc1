"""Whole-model checks: every routed layer owns its router, and torch.compile matches eager."""
from __future__ import annotations

import pytest
import torch

from mode.config import config_from_dict
from mode.layers.mod import MoDBlock
from mode.model import LanguageModel
from mode.routing import primitives

COMPILE_TOL = 1e-5  # float32 on CPU: inductor fuses and reorders elementwise arithmetic


def tiny(pattern: list[str], routing: dict | None = None, moe: dict | None = None) -> LanguageModel:
    cfg = config_from_dict({
        "model": {"d_model": 32, "n_heads": 4, "n_layers": 4, "d_ff": 64, "max_seq_len": 32, "block_pattern": pattern},
        "routing": routing or {},
        "moe": {"n_experts": 2, "n_noop": 1, **(moe or {})},
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


@pytest.mark.parametrize("pattern, routing, moe", [
    (["dense", "mod"], {}, {}),
    (["mod", "dense"], {"causal": "aux_loss"}, {}),  # the router's BCE: its scores' gradient reaches x
    (["dense", "mod"], {"causal": "predictor"}, {}),
    (["mode_staged", "dense"], {}, {}),
    (["dense", "mode_integrated"], {}, {"n_noop": 2, "noop_kind": "constant"}),
    (["dense", "mode_integrated"], {}, {"n_noop": 2, "noop_kind": ["copy", "constant"]}),
], ids=["router score as a reduction", "causal aux_loss", "causal predictor", "staged MoDE",
        "constant null experts", "copy and constant null experts"])
def test_compiled_model_matches_eager(pattern: list[str], routing: dict, moe: dict) -> None:
    """Compiled against eager: same routing, loss and gradients, with the depth routers' compiled
    scores as a product summed over D (router_scores), and the routed tokens split off and added
    back by the traced functions (_SplitRowsTraced, index_put); the null slots' outputs by the
    kinds present only (NullExperts), with constants made nonzero so that they reach the loss."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = tiny(pattern, routing, moe)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("null_experts.constants"):
                p.normal_(0.0, 0.5)
    tokens = torch.randint(0, 256, (2, 33))
    x, y = tokens[:, :-1], tokens[:, 1:]
    eager = model(x, y)
    eager.loss.backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    compiled = torch.compile(model, fullgraph=True)(x, y)
    compiled.loss.backward()
    torch.testing.assert_close(compiled.loss, eager.loss, rtol=COMPILE_TOL, atol=COMPILE_TOL)
    for r_eager, r_compiled in zip(eager.routings, compiled.routings):
        if r_eager is not None:
            assert torch.equal(r_eager.positions, r_compiled.positions)
    for name, grad in eager_grads.items():
        torch.testing.assert_close(dict(model.named_parameters())[name].grad, grad, rtol=COMPILE_TOL, atol=COMPILE_TOL)


def test_models_of_two_capacities_compile_in_one_process() -> None:
    """routing.capacity stays a constant under torch.compile (DepthRouter keeps it as text): a second value recompiles
    with its own k, where a plain float became a symbol that the depth router's split (an autograd
    function) could not take, and compiling failed. Each model gives its eager loss, in one graph."""
    torch._dynamo.reset()
    tokens = torch.randint(0, 256, (2, 33))
    for capacity in (0.25, 0.5, 0.125):
        torch.manual_seed(0)
        model = tiny(["dense", "mod"], {"capacity": capacity})
        eager = model(tokens[:, :-1], tokens[:, 1:])
        compiled = torch.compile(model, fullgraph=True)(tokens[:, :-1], tokens[:, 1:])
        compiled.loss.backward()
        assert compiled.routings[1].positions.shape[1] == round(32 * capacity)
        torch.testing.assert_close(compiled.loss, eager.loss, rtol=COMPILE_TOL, atol=COMPILE_TOL)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Inductor's Triton kernels need a GPU")
@pytest.mark.parametrize("pattern, routing", [
    (["dense", "mod"], {}),
    (["dense", "mod"], {"causal": "aux_loss"}),
    (["dense", "mod"], {"causal": "predictor"}),
    (["dense", "mode_staged"], {}),  # the inner MoE sums its rows into the attention's output
    # Triton 3.6 (torch 2.11) fails on the kernel Inductor writes for the last scalars of an expert-choice
    # model with few tokens: the auxiliary loss stored and the total using it, in a reduction block
    # smaller than the kernel's threads (triton-lang/triton#8257, reproduced on the kernel alone; not at
    # bench.block_kinds' shape). Strict: passing means it is fixed.
    pytest.param(["dense", "mode_integrated"], {}, marks=pytest.mark.xfail(
        strict=True, reason="Triton 3.6's layout pass fails on the loss's last kernel at this token count")),
], ids=["top-k", "aux_loss", "predictor", "staged", "integrated"])
def test_compiled_model_on_the_gpu_matches_eager(pattern: list[str], routing: dict) -> None:
    """On CUDA under bf16 autocast, as training runs it: the compiled model builds (torch 2.11's
    Triton once failed on a kernel fusing the loss's one-hot with causal routing's BCE) and gives
    eager's loss and gradients to bf16 rounding."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = tiny(pattern, routing).cuda()
    tokens = torch.randint(0, 256, (4, 33), device="cuda")
    results = []
    for run in (model, torch.compile(model, fullgraph=True)):
        with torch.autocast("cuda", dtype=torch.bfloat16):
            out = run(tokens[:, :-1], tokens[:, 1:])
        out.loss.backward()
        results.append((out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}))
        model.zero_grad(set_to_none=True)
    (loss, grads), (compiled_loss, compiled_grads) = results
    torch.testing.assert_close(compiled_loss, loss, rtol=2e-3, atol=2e-3)
    assert compiled_grads.keys() == grads.keys()
    for name, grad in grads.items():  # relative to the tensor's largest entry: bf16 products, reordered sums
        assert (compiled_grads[name] - grad).abs().max() <= 3e-2 * grad.abs().max(), name


@pytest.mark.parametrize("pattern, routing", [
    (["dense", "mod"], {}),
    (["mod", "mod"], {"random": True}),  # MoD after MoD: the second adds into the first's output
    (["mode_staged", "dense"], {}),
    (["dense", "mod"], {"causal": "predictor"}),  # the predictor saves x: the copy path
    (["mod", "dense"], {}),  # the first block adds into the embeddings' output
])
def test_routed_updates_in_place_equal_the_copy_path(pattern: list[str], routing: dict, monkeypatch) -> None:
    """LanguageModel's MoD blocks add their updates into the residual stream in place
    (MoDBlock.forward's residual_owned) unless their router saved x (a causal predictor), and in the
    backward the chosen tokens' gradient into the stream's gradient; with it off (the model's
    residual_in_place) every block copies both. Same loss and gradients, exactly."""
    calls, grad_in_place = [], []
    add_apply, route_apply = primitives._AddGatedRows.apply, primitives._RouteTokens.apply
    monkeypatch.setattr(primitives._AddGatedRows, "apply", lambda *a: calls.append(a[4]) or add_apply(*a))
    monkeypatch.setattr(primitives._RouteTokens, "apply", lambda *a: grad_in_place.append(a[6]) or route_apply(*a))
    results = []
    for in_place in (True, False):
        torch.manual_seed(0)
        model = tiny(pattern, routing)
        mods = [m for m in model.modules() if isinstance(m, MoDBlock)]
        assert mods and model.residual_in_place  # the model turns it on
        model.residual_in_place = in_place
        tokens = torch.randint(0, 256, (2, 33))
        torch.manual_seed(1)  # random routing draws the same tokens in both runs
        out = model(tokens[:, :-1], tokens[:, 1:])
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad for p in model.parameters()]))
    routed = sum(kind in ("mod", "mode_staged") for kind in pattern) * 2  # n_layers 4: the pattern twice
    assert calls == [not routing.get("causal")] * routed + [False] * routed  # in place in the first run only
    assert grad_in_place == [True] * routed + [False] * routed  # the rows' gradient too, in the first run
    (loss_a, grads_a), (loss_b, grads_b) = results
    assert torch.equal(loss_a, loss_b)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_a_mod_block_on_its_own_leaves_its_input_alone() -> None:
    """Outside a LanguageModel a MoDBlock (residual_owned off) returns a new tensor: a researcher's
    `block(x, angles)[0] - x` is the update."""
    model = tiny(["dense", "mod"])
    block = MoDBlock(model.config.model, model.config.routing)
    x = torch.randn(2, 32, 32, requires_grad=True) * 1.0
    before = x.detach().clone()
    out, info = block(x, model.rotary.prefix(32))
    assert torch.equal(x.detach(), before)
    changed = (out.detach() != before).any(-1)  # (B, S): the chosen tokens
    assert changed.sum(-1).tolist() == [info.routing.positions.shape[1]] * 2


@pytest.mark.parametrize("pattern", [["dense", "mod"], ["mode_staged", "dense"]], ids=["mod", "staged MoDE"])
@pytest.mark.parametrize("causal", [False, True], ids=["top-k", "causal"])
def test_a_block_of_a_built_model_leaves_a_users_leaf_alone(pattern: list[str], causal: bool) -> None:
    """model.blocks[i](x) on the caller's own leaf that requires grad: a new tensor comes back,
    x stays bit-identical, and the backward reaches x and the block's weights."""
    torch.manual_seed(0)
    model = tiny(pattern, {"causal": "aux_loss"})
    index = pattern.index(pattern[0] if pattern[0] != "dense" else pattern[1])
    block = model.blocks[index]
    assert isinstance(block, MoDBlock)
    x = torch.randn(2, 32, 32, requires_grad=True)
    before = x.detach().clone()
    out, info = block(x, model.rotary.prefix(32), causal=causal)
    assert out is not x and out.data_ptr() != x.data_ptr()
    assert torch.equal(x.detach(), before)
    changed = (out.detach() != before).any(-1)  # (B, S): the chosen tokens, the others pass as they were
    assert changed.any() and not changed.all()
    assert torch.equal(out.detach()[~changed], before[~changed])
    (out * torch.randn_like(out)).sum().backward()
    assert x.grad is not None and x.grad.abs().sum() > 0
    assert block.block.attn.qkv.weight.grad.abs().sum() > 0
    assert torch.equal(x.detach(), before)


@pytest.mark.parametrize("pattern", [["dense", "mod"], ["mod", "dense"], ["mode_staged", "dense"]])
@pytest.mark.parametrize("hook_on", ["block", "producer"])
def test_a_forward_pre_hook_sees_a_routed_blocks_input_unchanged(pattern: list[str], hook_on: str) -> None:
    """A hook that keeps a routed block's input (a pre-hook of the block, or a forward hook of the
    module whose output it is) inside the model's forward sees it unchanged after the forward: the
    model adds in place only into a stream no hook holds. Same loss and gradients as without it."""
    torch.manual_seed(0)
    model = tiny(pattern)
    index = next(i for i, b in enumerate(model.blocks) if isinstance(b, MoDBlock))
    tokens = torch.randint(0, 256, (2, 33))
    results, kept = [], []
    for hooked in (False, True):
        handle = None
        if hooked and hook_on == "block":
            handle = model.blocks[index].register_forward_pre_hook(lambda m, args: kept.append((args[0], args[0].clone())))
        elif hooked:
            producer = model.embed if index == 0 else model.blocks[index - 1]
            handle = producer.register_forward_hook(
                lambda m, args, out: kept.append((o := out if torch.is_tensor(out) else out[0], o.clone()))
            )
        model.zero_grad(set_to_none=True)
        out = model(tokens[:, :-1], tokens[:, 1:])
        out.loss.backward()
        results.append((out.loss.detach(), [p.grad for p in model.parameters()]))
        if handle is not None:
            handle.remove()
    assert kept
    for seen, copy in kept:
        assert torch.equal(seen, copy)
    (loss, grads), (hooked_loss, hooked_grads) = results
    assert torch.equal(loss, hooked_loss)
    for a, b in zip(grads, hooked_grads, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


def test_in_place_residual_gives_the_logits_of_the_copy_path(monkeypatch) -> None:
    """The model's own forward keeps its speed path (routed updates added into its residual stream,
    checked by the calls) and gives exactly the logits of the out-of-place path."""
    calls = []
    add_apply = primitives._AddGatedRows.apply
    monkeypatch.setattr(primitives._AddGatedRows, "apply", lambda *a: calls.append(a[4]) or add_apply(*a))
    torch.manual_seed(0)
    model = tiny(["dense", "mod", "mod", "mode_staged"])
    tokens = torch.randint(0, 256, (2, 32))
    logits = {}
    for in_place in (True, False):
        model.residual_in_place = in_place
        logits[in_place] = model(tokens).logits
    assert calls == [True] * 3 + [False] * 3
    assert torch.equal(logits[True], logits[False])


def test_rotary_tables_stay_float32_when_the_model_is_cast_to_bfloat16() -> None:
    """model.to(torch.bfloat16), as sampling runs a model, leaves the rotary tables float32:
    training rotates with float32 tables under autocast. The rotation of bf16 q and k then equals
    the float32 rotation rounded once, not a rotation by tables rounded to bf16 (2e-3 off)."""
    from mode.layers.rotary import apply_rotary

    model = tiny(["dense", "mod"])
    reference = {name: t.clone() for name, t in model.rotary.named_buffers()}
    model.to(torch.bfloat16)
    assert next(model.parameters()).dtype == torch.bfloat16
    for name, table in model.rotary.named_buffers():
        assert table.dtype == torch.float32 and torch.equal(table, reference[name]), name
    q = torch.randn(2, 32, 4, 8).to(torch.bfloat16)
    rotated = apply_rotary(q, model.rotary.prefix(32))
    assert rotated.dtype == torch.bfloat16
    assert torch.equal(rotated, apply_rotary(q.float(), model.rotary.prefix(32)).to(torch.bfloat16))
    model.to(torch.float64)  # widening casts apply as usual
    assert all(t.dtype == torch.float64 for t in model.rotary.buffers())
