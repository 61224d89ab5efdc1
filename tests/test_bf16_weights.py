"""train.bf16_weights: bf16 matrices with float32 masters train as float32 weights under autocast do.

The update (mode/kernels/adamw.py, Triton's interpreter on CPU) against torch.optim.AdamW; the
forward and backward against float32 weights under bf16 autocast (CPU autocast here, CUDA on a
GPU); checkpoints; and where the setting applies."""
from __future__ import annotations

import io
from pathlib import Path

import pytest
import torch

from mode.config import ConfigError, config_from_dict, load_config
from mode.kernels.policy import KernelPolicy, use_kernels
from mode.model import LanguageModel
from mode.training.bf16_weights import bf16_weights_apply, master_updates_, matrix_weights
from mode.training.optim import TorchOptimization

ROOT = Path(__file__).resolve().parents[1]
TINY = sorted((ROOT / "configs").glob("*_tiny.yaml"))
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Matrix weights' names end so; every other parameter stays float32.
MATRIX_SUFFIXES = (".attn.qkv.weight", ".attn.out.weight", ".gate_up.weight", ".down.weight", ".w_in", ".w_out")


@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "torch ops"])
@pytest.mark.parametrize("decay, grad_scale", [(0.1, 1.0), (0.0, 2.5)], ids=["decay", "no decay, clipped"])
def test_the_update_equals_adamw_and_writes_the_rounded_copy(kernel: bool, decay: float, grad_scale: float) -> None:
    """Three updates of float32 masters from bf16 gradients, in one call, equal torch.optim.AdamW's
    on float32 weights given the same gradients (divided by grad_scale), to float32 rounding; each
    bf16 copy is its master rounded to nearest even, bit for bit. Sizes: under one block of the
    kernel, one block, several with a partial last one, a matrix; a weight one step ahead of the
    others (its own step count); a master 4 bytes off 16-byte alignment (the kernel leaves it to the
    PyTorch ops). In the same call, two masters whose gradients are float32 (summed over micro-batches)
    and two float32 weights without copies, from float32 gradients (each kind a launch of its own)."""
    gen = torch.Generator().manual_seed(0)
    shapes = [(7,), (1024,), (2500,), (33, 70), (300,), (2500,), (40, 33), (2500,), (16, 64)]
    grad_float32 = [False] * 5 + [True] * 4  # a float32 gradient: a summed one with a copy, or a float32 weight's
    float32 = [False] * 7 + [True] * 2  # no copy: the weight is its own master
    masters = [torch.randn(shape, generator=gen).to(DEVICE) for shape in shapes]
    masters[4] = torch.cat([masters[4].new_zeros(1), masters[4]])[1:]  # a view 4 bytes into its storage
    assert masters[4].data_ptr() % 16 == 4
    references = [m.clone().requires_grad_() for m in masters]
    moments = [(torch.zeros_like(m), torch.zeros_like(m)) for m in masters]
    steps = [torch.full((), 1.0 if i == 2 else 0.0, device=DEVICE) for i in range(len(shapes))]
    copies = [None if f else m.to(torch.bfloat16) for m, f in zip(masters, float32)]
    adamw = torch.optim.AdamW(references, lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=decay, foreach=False)
    adamw.step()  # no gradients yet: no state
    ahead = references[2]
    adamw.state[ahead].update(step=torch.tensor(1.0), exp_avg=torch.zeros_like(ahead), exp_avg_sq=torch.zeros_like(ahead))
    scale = torch.tensor(grad_scale, device=DEVICE)
    for _ in range(3):
        grads = [(torch.randn(shape, generator=gen) * 1e-2).to(torch.float32 if f else torch.bfloat16).to(DEVICE)
                 for shape, f in zip(shapes, grad_float32)]
        for step in steps:
            step += 1
        with use_kernels(KernelPolicy(optimizer=kernel, cpu=True)):
            master_updates_([(m, a, b, g, c, s) for m, (a, b), g, c, s in zip(masters, moments, grads, copies, steps)],
                            scale, 3e-3, (0.9, 0.95), 1e-8, decay)
        for reference, grad in zip(references, grads):
            reference.grad = grad.float() / grad_scale
        adamw.step()
        for master, reference, copy in zip(masters, references, copies):
            torch.testing.assert_close(master, reference.detach(), rtol=1e-6, atol=1e-7)
            assert copy is None or torch.equal(copy, master.to(torch.bfloat16))
    for (exp_avg, exp_avg_sq), reference in zip(moments, references):
        state = adamw.state[reference]
        torch.testing.assert_close(exp_avg, state["exp_avg"], rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(exp_avg_sq, state["exp_avg_sq"], rtol=1e-6, atol=1e-12)


def test_the_norm_kernel_equals_total_norm_and_reads_the_gradients_of_now() -> None:
    """GradNorm (one launch a dtype) equals the float64 norm to float32 rounding, and total_norm's
    PyTorch ops to theirs, over bf16 and float32 gradients of sizes under, at and over its block, more of them than one launch takes;
    called again it reads the same addresses' new values, the same bit for bit for the same values.
    On the GPU where there is one (Triton's interpreter on CPU tensors otherwise)."""
    from mode.kernels.grad_norm import BLOCK, GradNorm
    from mode.training.optim import grad_norm, total_norm

    gen = torch.Generator().manual_seed(0)
    sizes = [1, 7, BLOCK, BLOCK + 3, 3 * BLOCK - 1, 2 * BLOCK + 8] + [5] * 300
    grads = [(torch.randn(n, generator=gen) * 10.0 ** (i % 5 - 2)).to(torch.bfloat16 if i % 3 else torch.float32)
             .to(DEVICE) for i, n in enumerate(sizes)]
    grads.append(torch.randn(6, 40, generator=gen).to(DEVICE))  # a matrix
    with pytest.raises(ValueError, match="GradNorm"):
        GradNorm(grads + [grads[-1].t()])
    unaligned = torch.zeros(BLOCK + 1, dtype=torch.bfloat16, device=DEVICE)[1:]  # 2 bytes past an aligned address
    with pytest.raises(ValueError, match="GradNorm"):
        GradNorm(grads + [unaligned])
    with use_kernels(KernelPolicy(optimizer=True, cpu=True)):
        assert grad_norm(grads + [unaligned]) is None and grad_norm(grads) is not None
    norm = GradNorm(grads)
    assert len(norm.launches) == 2  # one a dtype

    def exact() -> torch.Tensor:
        return torch.cat([g.double().flatten() for g in grads]).norm().float()

    first = norm()
    torch.testing.assert_close(first, exact(), rtol=1e-6, atol=0)
    torch.testing.assert_close(first, total_norm(grads), rtol=1e-5, atol=0)  # its per-tensor sums round more
    assert torch.equal(first, norm())
    for g in grads:
        g.mul_(-0.5)
    torch.testing.assert_close(norm(), exact(), rtol=1e-6, atol=0)
    torch.testing.assert_close(norm(), first * 0.5, rtol=1e-6, atol=0)


def _tiny(path: Path):
    return load_config(path, ["--model.n_layers=2", "--model.max_seq_len=32", "--data.seq_len=32"])


@pytest.mark.parametrize("path", TINY, ids=[p.stem for p in TINY])
def test_only_the_matrices_that_autocast_matmuls_read_become_bf16(path: Path) -> None:
    config = _tiny(path)
    model = LanguageModel(config)
    chosen = {id(p) for p in matrix_weights(model)}
    names = [name for name, p in model.named_parameters() if id(p) in chosen]
    assert names and all(name.endswith(MATRIX_SUFFIXES) for name in names), names
    assert not any(part in name for name in names for part in ("router", "predictor", "norm", "embed", "lm_head"))
    expected = {name for name, p in model.named_parameters() if name.endswith(MATRIX_SUFFIXES)}
    assert set(names) == expected
    TorchOptimization(model, config, torch.device("cpu"), bf16_weights=True)
    for name, p in model.named_parameters():
        assert p.dtype == (torch.bfloat16 if name in expected else torch.float32), name


def _train(config, bf16: bool, steps: int, state: tuple[dict, dict] | None = None):
    """steps optimizer steps of a tiny model under bf16 autocast (from state: model and optimizer
    state dicts), on batches drawn from one seed: (losses, first step's gradients, optimization)."""
    torch.manual_seed(0)
    model = LanguageModel(config).to(DEVICE)
    optimization = TorchOptimization(model, config, torch.device(DEVICE), bf16_weights=bf16)
    if state is not None:
        optimization.load_model_state_dict(state[0])
        optimization.optimizer.load_state_dict(state[1])
    gen = torch.Generator().manual_seed(1)
    losses, first_grads = [], None
    for _ in range(steps):
        tokens = torch.randint(0, config.model.vocab_size, (2, 33), generator=gen).to(DEVICE)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:]).loss
        loss.backward()
        if first_grads is None:
            first_grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
        optimization.step(1e-3)
        losses.append(loss.item())
    return losses, first_grads, optimization


@pytest.mark.parametrize("path", TINY, ids=[p.stem for p in TINY])
def test_bf16_weights_train_as_float32_weights_under_autocast(path: Path) -> None:
    """Every block kind: the first step's loss and gradients are bit for bit those of float32 weights
    (the forward reads what autocast's cast gave); later losses differ by the update's float32
    rounding only, carried through the bf16 rounding of the weights."""
    config = _tiny(path)
    float32_losses, float32_grads, _ = _train(config, False, 3)
    losses, grads, optimization = _train(config, True, 3)
    _assert_trains_as_float32_weights(losses, grads, float32_losses, float32_grads, optimization)


def _assert_trains_as_float32_weights(losses: list[float], grads: dict, float32_losses: list[float],
                                      float32_grads: dict, optimization: TorchOptimization) -> None:
    """The first step's loss and gradients bit for bit float32 weights', later losses within the
    update's float32 rounding, and each bf16 weight its float32 master rounded."""
    assert losses[0] == float32_losses[0]
    assert grads.keys() == float32_grads.keys()
    for name, grad in grads.items():
        assert torch.equal(grad, float32_grads[name]), name
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(float32_losses), rtol=1e-4, atol=0)
    bf16 = optimization.bf16
    for param, master in zip(bf16.params, bf16.masters, strict=True):
        assert param.dtype == torch.bfloat16 and master.dtype == torch.float32
        assert torch.equal(param, master.to(torch.bfloat16))


# How the Trainer keeps gradients: (keep_grads, zero_grads) of TorchOptimization
KEEPING = {"freed": (False, True), "kept and zeroed (compiled)": (True, True), "written by a graph": (True, False)}


def _train_micro_batches(config, bf16: bool, steps: int, keeping: str = "freed", kernel: bool = False):
    """steps optimizer steps of config.train.grad_accum micro-batches each under bf16 autocast, as the
    Trainer queues them (each loss divided by their number): (each step's mean loss, the first step's
    gradients as the update reads them, by name, whether a matrix kept a .grad, optimization)."""
    torch.manual_seed(0)
    model = LanguageModel(config).to(DEVICE)
    keep_grads, zero_grads = KEEPING[keeping]
    optimization = TorchOptimization(model, config, torch.device(DEVICE), keep_grads=keep_grads,
                                     zero_grads=zero_grads, bf16_weights=bf16)
    micro_batches = config.train.grad_accum
    gen = torch.Generator().manual_seed(1)
    losses, first_grads, matrix_kept_grad = [], None, False
    for _ in range(steps):
        if keeping == "written by a graph":  # the first micro-batch's backward hands out its own tensors
            for p in model.parameters():
                p.grad = None
        step_loss = 0.0
        for micro in range(micro_batches):
            tokens = torch.randint(0, config.model.vocab_size, (2, 33), generator=gen).to(DEVICE)
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], tokens[:, 1:]).loss
            accumulate = micro > 0 if keeping == "written by a graph" else None  # the graphs say; else counted
            optimization.backward(loss / micro_batches, accumulate)
            step_loss += loss.item() / micro_batches
            matrix_kept_grad |= any(p.grad is not None for p in optimization.summed_params)
        if first_grads is None:
            grad = (lambda p: p.grad) if optimization.bf16 is None else optimization.bf16.grad
            first_grads = {n: grad(p).float().clone() for n, p in model.named_parameters() if grad(p) is not None}
        with use_kernels(KernelPolicy(optimizer=kernel, cpu=True)):
            optimization.step(1e-3)
        losses.append(step_loss)
    return losses, first_grads, matrix_kept_grad, optimization


MICRO_BATCH_CASES = ([(path, "freed", False) for path in TINY]
                     + [(ROOT / "configs" / "mode_integrated_tiny.yaml", keeping, kernel)
                        for keeping in KEEPING for kernel in (False, True)]
                     + [(ROOT / "configs" / "mor_tiny.yaml", "written by a graph", True)])


@pytest.mark.parametrize("path, keeping, kernel", MICRO_BATCH_CASES,
                         ids=[f"{p.stem}, {k}, {'triton' if t else 'torch ops'}" for p, k, t in MICRO_BATCH_CASES])
def test_bf16_weights_sum_micro_batches_in_float32_as_float32_weights_do(path: Path, keeping: str, kernel: bool) -> None:
    """train.grad_accum=3: each matrix's three bf16 gradients are summed in float32 as the backward
    makes them, and the first step's summed gradients equal float32 weights' own, bit for bit (autocast's
    cast adds the same bf16 gradients in float32 in the same order; a sum in bf16 would not). The
    matrices keep no .grad. Later losses follow float32 weights' to the update's float32 rounding.
    Every block kind with the gradients freed between steps; every way the Trainer keeps them, with
    the masters' kernel (Triton's interpreter on CPU) and the PyTorch ops; MoR's shared block (read
    twice a micro-batch) under the graph's keeping."""
    config = load_config(path, ["--model.n_layers=2", "--model.max_seq_len=32", "--data.seq_len=32",
                                "--train.grad_accum=3"])
    float32_losses, float32_grads, _, _ = _train_micro_batches(config, False, 3)
    losses, grads, matrix_kept_grad, optimization = _train_micro_batches(config, True, 3, keeping, kernel)
    assert optimization.summed_params and not matrix_kept_grad
    _assert_trains_as_float32_weights(losses, grads, float32_losses, float32_grads, optimization)


def test_a_matrix_no_micro_batch_of_a_step_reached_has_no_gradient() -> None:
    """Summed micro-batches: a bf16 matrix that only a later micro-batch reaches has that one's
    gradient; one that no micro-batch of the step reaches has none (AdamW leaves it alone, as a
    float32 weight without a gradient), though earlier steps summed into it."""
    from mode.training.bf16_weights import Bf16Weights

    torch.manual_seed(0)
    a, b = torch.nn.Linear(8, 8, bias=False), torch.nn.Linear(8, 8, bias=False)
    reference = [w.weight.detach().clone() for w in (a, b)]
    weights = Bf16Weights([a.weight, b.weight], sum_micro_batches=True)
    x = torch.randn(4, 8)

    def backward(*layers: torch.nn.Linear) -> list[torch.Tensor]:
        """One micro-batch through layers: each layer's bf16 weight gradient, as float32 weights' cast gives it."""
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x
            for layer in layers:
                h = layer(h)
        h.float().square().sum().backward()
        ref = [w.clone().requires_grad_() for w in reference]
        with torch.autocast("cpu", dtype=torch.bfloat16):
            h = x
            for layer in layers:
                h = h @ ref[(a, b).index(layer)].t()
        h.float().square().sum().backward()
        return [r.grad for r in ref]

    weights.start_sums()
    first = backward(a)
    assert weights.grad(a.weight) is not None and weights.grad(b.weight) is None and a.weight.grad is None
    second = backward(a, b)
    assert torch.equal(weights.grad(a.weight), first[0] + second[0])
    assert torch.equal(weights.grad(b.weight), second[1])
    weights.start_sums()  # the next step: only `a`
    backward(a)
    assert weights.grad(b.weight) is None


@pytest.mark.parametrize("grad_clip", [1e-3, 0.0], ids=["clipped", "unclipped"])
def test_the_masters_kernel_steps_the_float32_weights_as_adamw_does(grad_clip: float) -> None:
    """With bf16 weights and the kernel, the float32 weights (embeddings, head, norms, routers, causal
    predictors) are stepped by the masters' kernel, not by torch.optim.AdamW. From the state of two
    steps, one more step with the kernel equals AdamW's own to float32 rounding, in every weight and
    moment. Clipped hard, so the clipping factor (and the predictors' own, routing.causal=predictor)
    is in the update."""
    config = load_config(ROOT / "configs" / "mode_integrated_tiny.yaml",
                         ["--model.n_layers=2", "--model.max_seq_len=32", "--data.seq_len=32",
                          "--routing.causal=predictor", f"--train.grad_clip={grad_clip}"])
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.model.vocab_size, (2, 33), generator=gen) for _ in range(3)]

    def train(optimization: TorchOptimization, tokens: torch.Tensor, kernel: bool) -> None:
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            output = optimization.model(tokens[:, :-1].to(DEVICE), tokens[:, 1:].to(DEVICE))
        (output.loss + output.aux_loss).backward()
        with use_kernels(KernelPolicy(optimizer=kernel, cpu=True)):
            optimization.step(1e-3)

    torch.manual_seed(0)
    start = TorchOptimization(LanguageModel(config).to(DEVICE), config, torch.device(DEVICE), bf16_weights=True)
    for tokens in batches[:2]:
        train(start, tokens, kernel=False)
    buffer = io.BytesIO()
    torch.save((start.model_state_dict(), start.optimizer.state_dict()), buffer)

    def one_more_step(kernel: bool) -> tuple[TorchOptimization, int]:
        buffer.seek(0)
        model_state, optimizer_state = torch.load(buffer, weights_only=True, map_location=DEVICE)
        optimization = TorchOptimization(LanguageModel(config).to(DEVICE), config, torch.device(DEVICE), bf16_weights=True)
        optimization.load_model_state_dict(model_state)
        optimization.optimizer.load_state_dict(optimizer_state)
        calls = []
        step = optimization.optimizer.step
        optimization.optimizer.step = lambda *a, **k: calls.append(1) or step(*a, **k)
        train(optimization, batches[2], kernel)
        return optimization, len(calls)

    (ours, calls), (adamw, adamw_calls) = one_more_step(True), one_more_step(False)
    assert (calls, adamw_calls) == (0, 1)  # the kernel stepped every float32 weight
    names = {id(p): name for name, p in ours.model.named_parameters() if p.dtype == torch.float32}
    assert any("predictor" in n for n in names.values()) and any("router" in n for n in names.values())
    state, reference = ours.model_state_dict(), adamw.model_state_dict()
    for name in state:
        torch.testing.assert_close(state[name], reference[name], rtol=1e-6, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
    for group, adamw_group in zip(ours.optimizer.param_groups, adamw.optimizer.param_groups, strict=True):
        for p, q in zip(group["params"], adamw_group["params"], strict=True):
            for key in ("exp_avg", "exp_avg_sq"):  # float32 rounding of the moment's scale (sums cancel)
                expected = adamw.optimizer.state[q][key]
                torch.testing.assert_close(ours.optimizer.state[p][key], expected, rtol=1e-5,
                                           atol=1e-6 * expected.abs().max().item(), msg=lambda m, k=key: f"{k}: {m}")
            assert ours.optimizer.state[p]["step"].item() == adamw.optimizer.state[q]["step"].item() == 3


@pytest.mark.parametrize("kernel", [True, False], ids=["triton", "torch ops"])
def test_sharded_experts_add_their_squares_summed_over_processes_to_the_norm(kernel: bool) -> None:
    """ShardedParams (expert parallelism's experts, each process holding others): the step's gradient
    norm is sqrt(the other gradients' squared norm + the experts' squared norm summed over the
    processes). Here the sum stands for three processes holding the same gradients (times 3); the
    causal predictors stay apart. With the norm kernel (Triton's interpreter) and the PyTorch ops."""
    from mode.training.optim import ShardedParams

    config = load_config(ROOT / "configs" / "mode_staged_tiny.yaml",
                         ["--model.n_layers=2", "--model.max_seq_len=32", "--data.seq_len=32",
                          "--routing.causal=predictor"])
    torch.manual_seed(0)
    model = LanguageModel(config).to(DEVICE)
    experts = [p for name, p in model.named_parameters() if name.endswith((".w_in", ".w_out"))]
    calls = []
    sharded = ShardedParams(experts, lambda squares: calls.append(1) or squares.mul_(3.0))
    optimization = TorchOptimization(model, config, torch.device(DEVICE), bf16_weights=True, sharded=sharded)
    tokens = torch.randint(0, config.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        output = model(tokens[:, :-1], tokens[:, 1:])
    (output.loss + output.aux_loss).backward()
    predictors = {id(p) for n, p in model.named_parameters() if "predictor" in n}
    assert experts and predictors
    for p in experts:  # weighty enough for the norm to show whether they are summed
        p.grad.mul_(64.0)
    squares = {id(p): p.grad.double().square().sum() for p in model.parameters() if p.grad is not None}
    expert_ids = {id(p) for p in experts}
    want = (sum(v for k, v in squares.items() if k not in expert_ids | predictors)
            + 3.0 * sum(squares[k] for k in expert_ids)).sqrt()
    unsharded = sum(v for k, v in squares.items() if k not in predictors).sqrt()
    with use_kernels(KernelPolicy(optimizer=kernel, cpu=True)):
        norm = optimization.step(1e-3)
    assert calls == [1]
    assert (optimization.plan.norm is not None, optimization.plan.sharded_norm is not None) == (kernel, kernel)
    torch.testing.assert_close(norm.double(), want, rtol=1e-5, atol=0)
    assert abs(want - unsharded) > 0.1 * want


def test_the_step_plan_is_kept_while_the_gradients_stay_and_rebuilt_when_one_moves() -> None:
    """TorchOptimization keeps its step plan (which gradients the norms read, the kernels' tables)
    from step to step; where a gradient moved it rewrites the tables' addresses; it builds a new one
    when a parameter loses or regains its gradient, the kernel policy changes or the optimizer state
    is loaded. Each step equals, bit for bit, a step whose plan is built afresh (the kernels, Triton's
    interpreter on CPU), in every weight, master and moment. The moved gradient's old memory is kept
    and scaled, so a table still reading it would step differently."""
    config = load_config(ROOT / "configs" / "mode_integrated_tiny.yaml",
                         ["--model.n_layers=2", "--model.max_seq_len=32", "--data.seq_len=32", "--model.d_model=32",
                          "--model.n_heads=2", "--model.d_ff=64", "--routing.causal=predictor",
                          "--train.grad_clip=1e-3"])
    gen = torch.Generator().manual_seed(1)
    batches = [torch.randint(0, config.model.vocab_size, (2, 33), generator=gen).to(DEVICE) for _ in range(6)]

    def built() -> TorchOptimization:
        torch.manual_seed(0)
        return TorchOptimization(LanguageModel(config).to(DEVICE), config, torch.device(DEVICE), keep_grads=True,
                                 zero_grads=False, bf16_weights=True)

    kept, fresh = built(), built()
    plans, left = [], []
    for index, tokens in enumerate(batches):
        for optimization in (kept, fresh):
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                output = optimization.model(tokens[:, :-1], tokens[:, 1:])
            for p in optimization.model.parameters():  # kept gradients, written afresh as a CUDA graph does
                p.grad = torch.zeros_like(p) if p.grad is None else p.grad.zero_()
            (output.loss + output.aux_loss).backward()
            if index == 2:  # gradients move, their old memory changed: a matrix (bf16) and the head (float32)
                for p in (optimization.model.blocks[1].ffn.experts.w_in, optimization.model.lm_head.weight):
                    left.append(p.grad)
                    p.grad = p.grad.clone()
                    left[-1].mul_(100.0)
            if index == 3:  # a parameter without a gradient: AdamW leaves it alone
                optimization.model.norm.weight.grad = None
            if index == 5:  # a matrix's gradient moves off 16-byte alignment: the kernels cannot read it
                p = optimization.model.blocks[0].attn.qkv.weight
                held = torch.empty(p.numel() + 1, dtype=p.grad.dtype, device=p.grad.device)[1:]
                p.grad = held.view_as(p.grad).copy_(p.grad)
        fresh.plan = None
        with use_kernels(KernelPolicy(optimizer=True, cpu=True)):
            kept.step(1e-3)
            fresh.step(1e-3)
        plans.append(kept.plan)
        for a, b in zip(kept.model.parameters(), fresh.model.parameters(), strict=True):
            assert torch.equal(a, b)
        for a, b in zip(kept.optimizer.param_groups, fresh.optimizer.param_groups, strict=True):
            for p, q in zip(a["params"], b["params"], strict=True):
                assert torch.equal(p, q)
                state, reference = kept.optimizer.state[p], fresh.optimizer.state[q]
                assert state.keys() == reference.keys()
                assert all(torch.equal(state[k], reference[k]) for k in state)
    assert plans[0].masters_step is not None and plans[0].float32_step is not None
    assert plans[1] is plans[0] and plans[2] is plans[1] and plans[3] is not plans[2]
    assert plans[4] is not plans[3]  # the norm's gradient is back
    assert plans[5] is not plans[4] and plans[5].norm is None and plans[5].masters_step is None
    with use_kernels(KernelPolicy(optimizer=False)):  # the policy changed: the PyTorch ops, a plan without launches
        kept.step(1e-3)
    assert kept.plan is not plans[5] and kept.plan.masters_step is None
    kept.load_state_dict(kept.state_dict())
    assert kept.plan is None


def test_checkpoints_hold_the_masters_and_resume_bit_for_bit() -> None:
    """model_state_dict holds the float32 masters; a run resumed from its state dicts continues as
    the uninterrupted run did, bit for bit, with bf16 weights or with float32 weights (one layout)."""
    config = _tiny(ROOT / "configs" / "mode_integrated_tiny.yaml")
    _, _, two = _train(config, True, 2)
    buffer = io.BytesIO()
    torch.save((two.model_state_dict(), two.optimizer.state_dict()), buffer)
    model_state = two.model_state_dict()
    assert all(t.dtype == torch.float32 for t in model_state.values() if t.is_floating_point())
    for param, master in zip(two.bf16.params, two.bf16.masters, strict=True):
        assert any(t is master for t in model_state.values()) and param.dtype == torch.bfloat16

    def resumed(bf16: bool) -> tuple[float, dict]:
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        model = LanguageModel(config).to(DEVICE)
        optimization = TorchOptimization(model, config, torch.device(DEVICE), bf16_weights=bf16)
        optimization.load_model_state_dict(state[0])
        optimization.optimizer.load_state_dict(state[1])
        tokens = torch.randint(0, config.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(5)).to(DEVICE)
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:]).loss
        loss.backward()
        optimization.step(1e-3)
        return loss.item(), optimization.model_state_dict()

    loss_a, state_a = resumed(True)
    loss_b, state_b = resumed(True)
    assert loss_a == loss_b and all(torch.equal(state_a[k], state_b[k]) for k in state_a)
    loss_float32, state_float32 = resumed(False)  # the same weights: the same forward
    assert loss_float32 == loss_a
    for name in state_a:
        torch.testing.assert_close(state_float32[name], state_a[name], rtol=1e-5, atol=2e-5, msg=name)


def test_where_bf16_weights_apply() -> None:
    """On a GPU in one process, and through an engine that can hold them: launch/train.py under ZeRO 0,
    with expert parallelism or micro-batches or neither; DeepSpeed's ZeRO 1/2 (its own bf16) refuses,
    naming the field."""
    from mode.parallel.engine import bf16_weights_refusal

    def config(parallel: dict | None = None, **train):
        experts = {"model": {"block_pattern": ["dense", "moe"]}} if parallel and parallel.get("expert_parallel", 1) > 1 else {}
        return config_from_dict({"train": train, "parallel": parallel or {}, **experts}, "test")

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert bf16_weights_apply(config(), cuda) == (True, None)
    assert bf16_weights_apply(config(), cpu) == (False, None)
    assert bf16_weights_apply(config(bf16_weights=False), cuda) == (False, None)
    assert bf16_weights_apply(config(grad_accum=2), cuda) == (True, None)
    for parallel, train in [({"expert_parallel": 1}, {}), ({"expert_parallel": 1}, {"grad_accum": 2}),
                            ({"expert_parallel": 2}, {})]:
        zero0 = config({"zero_stage": 0, **parallel}, **train)
        assert bf16_weights_refusal(zero0) is None
        assert bf16_weights_apply(zero0, cuda, bf16_weights_refusal(zero0)) == (True, None)
    refusal = bf16_weights_refusal(config({"zero_stage": 2}))
    assert refusal.startswith("parallel.zero_stage=2"), refusal
    on, note = bf16_weights_apply(config({"zero_stage": 2}), cuda, refusal)
    assert not on and note == f"train.bf16_weights=auto: off, since {refusal}"
    for train, device, refusal in [({}, cpu, None), ({}, cuda, refusal), ({"grad_accum": 2}, cuda, refusal)]:
        with pytest.raises(ConfigError, match="train.bf16_weights=true"):
            bf16_weights_apply(config(bf16_weights=True, **train), device, refusal)
    with pytest.raises(Exception, match="bf16_weights"):
        config(bf16_weights="yes")
