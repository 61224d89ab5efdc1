"""The Triton kernels of mode/kernels/ against the PyTorch code they replace in eager mode.

On a CUDA machine they run compiled on the GPU; without one, in Triton's interpreter on CPU
tensors (tests/conftest.py sets TRITON_INTERPRET), so CI checks the same kernel code.
With bf16 inputs (as under autocast) the kernels keep float32 until one final rounding to
bf16, so they are compared with a float64 computation from the same bf16 inputs (and the
same bf16 incoming gradients) at one bf16 rounding: rtol 2^-8 = 3.9e-3, plus an atol of
1e-5 for float32 arithmetic on results that cancel to near 0.
"""
from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from mode.kernels import KernelPolicy, kernel_policy, set_kernel_policy, use_kernels, use_triton
from mode.kernels.common import store_rounded
from mode.kernels.gelu import gated_gelu
from mode.kernels.rotary import rotary_qkv
from mode.kernels.swiglu import swiglu
from mode.layers.rotary import RotaryEmbedding, apply_rotary

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ONE_BF16_ROUNDING = dict(rtol=2**-8, atol=1e-5)


@pytest.fixture(autouse=True)
def _restore_kernel_policy():
    """Each test may set the process's kernel policy (kernels_on); it is restored after the test."""
    before = kernel_policy()
    yield
    set_kernel_policy(before)


def kernels_on(on: bool = True, **ops: bool) -> None:
    """Until the test ends: the Triton kernels wherever they may run (CPU tensors too: Triton's
    interpreter, as on CUDA in eager mode), or (on=False) the PyTorch ops; `ops` turn single ones off."""
    set_kernel_policy(KernelPolicy(enabled=on, cpu=True, **ops))


def _reference_rotary(qkv: torch.Tensor, cos_full: torch.Tensor, sin_signed: torch.Tensor):
    from mode.layers.rotary import RotaryAngles

    q, k = apply_rotary(qkv[:, :, :2], RotaryAngles(cos_full, sin_signed)).unbind(2)
    return q, k, qkv[:, :, 2]


def _grads(fn, inputs: tuple[torch.Tensor, ...], probes: tuple[torch.Tensor, ...]):
    inputs = tuple(t.detach().clone().requires_grad_() for t in inputs)
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    sum((o.float() * p).sum() for o, p in zip(outs, probes)).backward()
    return [o.detach() for o in outs], [t.grad for t in inputs]


@pytest.mark.parametrize("per_sequence", [False, True], ids=["prefix angles", "routed angles (B, k)"])
def test_rotary_qkv_matches_apply_rotary(per_sequence: bool) -> None:
    batch, seq, heads, head_dim = 2, 12, 3, 8  # heads and half-dim not powers of two: masked lanes
    rotary = RotaryEmbedding(head_dim, 64, 10000.0).to(DEVICE)
    if per_sequence:  # MoD: each sequence's chosen tokens at their original positions
        positions = torch.stack([torch.randperm(64)[:seq].sort().values for _ in range(batch)]).to(DEVICE)
        angles = rotary.angles(positions)
    else:
        angles = rotary.prefix(seq)
    qkv = torch.randn(batch, seq, 3, heads, head_dim, device=DEVICE).bfloat16()
    # Incoming gradients as bf16 values, as the kernel receives them.
    probes = tuple(torch.randn(batch, seq, heads, head_dim, device=DEVICE).bfloat16().float() for _ in range(3))
    cos64, sin64 = angles.cos_full.double(), angles.sin_signed.double()
    want, (want_grad,) = _grads(lambda t: _reference_rotary(t, cos64, sin64), (qkv.double(),), probes)
    got, (got_grad,) = _grads(lambda t: rotary_qkv(t, angles.cos_full, angles.sin_signed), (qkv,), probes)
    for g, w in zip(got, want):
        assert g.dtype == torch.bfloat16 and g.shape == w.shape
        torch.testing.assert_close(g.double(), w, **ONE_BF16_ROUNDING)
    assert torch.equal(got[2], qkv[:, :, 2])  # v is copied, bit for bit
    torch.testing.assert_close(got_grad.double(), want_grad, **ONE_BF16_ROUNDING)
    # The model's own eager path (float32 arithmetic, one rounding) gives the same forward.
    model_path = _reference_rotary(qkv, angles.cos_full, angles.sin_signed)
    for g, w in zip(got, model_path):
        torch.testing.assert_close(g.float(), w.float(), rtol=2**-8, atol=1e-5)


def test_rotary_qkv_backward_reads_strided_gradients() -> None:
    """Attention hands back dq, dk, dv as transposed (B, H, S, hd) tensors: any strides are read right."""
    batch, seq, heads, head_dim = 2, 5, 4, 16
    angles = RotaryEmbedding(head_dim, 8, 10000.0).to(DEVICE).prefix(seq)
    qkv = torch.randn(batch, seq, 3, heads, head_dim, device=DEVICE, dtype=torch.float32, requires_grad=True)
    q, k, v = rotary_qkv(qkv, angles.cos_full, angles.sin_signed)
    grads = [torch.randn(batch, heads, seq, head_dim, device=DEVICE).transpose(1, 2) for _ in range(3)]
    (got,) = torch.autograd.grad((q, k, v), qkv, grads)
    ref = qkv.detach().clone().requires_grad_()
    (want,) = torch.autograd.grad(_reference_rotary(ref, angles.cos_full, angles.sin_signed), ref, grads)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # float32 throughout: rounding order only


def test_rotary_qkv_rejects_tables_that_do_not_fit() -> None:
    qkv = torch.randn(2, 5, 3, 2, 8, device=DEVICE)
    angles = RotaryEmbedding(8, 16, 10000.0).to(DEVICE).prefix(6)
    with pytest.raises(ValueError, match="angle tables"):
        rotary_qkv(qkv, angles.cos_full, angles.sin_signed)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("per_row", [False, True], ids=["shared angles", "a row's own angles"])
def test_rotate_in_place_equals_rotate(dtype: torch.dtype, per_row: bool) -> None:
    """The cached forward's rotation of q and k inside a qkv projection (rotate_in_place, strided
    heads) equals rotate_'s PyTorch ops bit for bit, and leaves v untouched."""
    from mode.kernels.rotary import rotate_in_place
    from mode.layers.rotary import rotate_

    n, seq, heads, kv_heads, head_dim = 3, 4, 3, 2, 12  # 5 rotated heads, half-dim 6: masked lanes
    rotary = RotaryEmbedding(head_dim, 64, 10000.0).to(DEVICE)
    positions = torch.randint(0, 64, (n if per_row else 1, seq), device=DEVICE)
    angles = rotary.angles(positions)
    qkv = torch.randn(n, seq, heads + 2 * kv_heads, head_dim, device=DEVICE).to(dtype)
    got, want = qkv.clone(), qkv.clone()
    rotate_in_place(got[:, :, : heads + kv_heads], angles.cos_full, angles.sin_signed)
    kernels_on(False)  # rotate_'s PyTorch ops
    rotate_(want[:, :, : heads + kv_heads], angles)
    assert torch.equal(got, want) and torch.equal(got[:, :, heads + kv_heads:], qkv[:, :, heads + kv_heads:])
    with pytest.raises(ValueError, match="angle tables"):
        rotate_in_place(got[:, :, : heads + kv_heads], angles.cos_full[:, :2], angles.sin_signed[:, :2])


@pytest.mark.parametrize("shape", [(7, 2 * 24), (3, 5, 2 * 1500)], ids=["rows", "experts, width over one block"])
def test_swiglu_matches_silu_times_up(shape: tuple[int, ...]) -> None:
    h = torch.randn(*shape, device=DEVICE).bfloat16()
    probe = (torch.randn(*shape[:-1], shape[-1] // 2, device=DEVICE).bfloat16().float(),)

    def reference(t: torch.Tensor) -> torch.Tensor:
        gate, up = t.chunk(2, dim=-1)
        return F.silu(gate) * up

    (want,), (want_grad,) = _grads(reference, (h.double(),), probe)
    (got,), (got_grad,) = _grads(swiglu, (h,), probe)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, **ONE_BF16_ROUNDING)
    torch.testing.assert_close(got_grad.double(), want_grad, **ONE_BF16_ROUNDING)


def test_swiglu_float32_matches_to_float32_rounding() -> None:
    h = torch.randn(4, 2 * 40, device=DEVICE, dtype=torch.float32)
    probe = (torch.randn(4, 40, device=DEVICE),)
    (want,), (want_grad,) = _grads(lambda t: F.silu(t[..., :40]) * t[..., 40:], (h,), probe)
    (got,), (got_grad,) = _grads(swiglu, (h,), probe)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_grad, want_grad, rtol=1e-5, atol=1e-6)


def _check_gated_activation(kernel: Callable[..., torch.Tensor], reference: Callable[..., torch.Tensor],
                            h: torch.Tensor, gates: torch.Tensor, probe: tuple[torch.Tensor]) -> None:
    """An activation kernel times float32 row gates, bf16 h, against a float64 reference on the same
    inputs: the output and h's gradient (bf16) at one bf16 rounding; the gates' gradient (float32),
    a float32 sum over each row, to rtol 1e-4."""
    (want,), want_grads = _grads(reference, (h.double(), gates.double()), probe)
    (got,), got_grads = _grads(kernel, (h, gates), probe)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, **ONE_BF16_ROUNDING)
    assert got_grads[0].dtype == torch.bfloat16 and got_grads[1].dtype == torch.float32
    torch.testing.assert_close(got_grads[0].double(), want_grads[0], **ONE_BF16_ROUNDING)
    torch.testing.assert_close(got_grads[1].double(), want_grads[1], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("leading", [(7,), (3, 5)], ids=["rows", "experts' (E, R)"])
def test_swiglu_times_row_gates_matches_pytorch(leading: tuple[int, ...]) -> None:
    """SwiGLU times a float32 gate per row (an MoE layer's gates, applied by its experts) against
    float64 PyTorch on the same bf16 inputs: the output and h's gradient at one bf16 rounding; the
    gates' gradient, a float32 sum of 1500 products per row (over one column block: masked lanes),
    to rtol 1e-4."""
    width = 1500
    h = torch.randn(*leading, 2 * width, device=DEVICE).bfloat16()
    gates = torch.rand(*leading, device=DEVICE)
    probe = (torch.randn(*leading, width, device=DEVICE).bfloat16().float(),)

    def reference(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
        return F.silu(t[..., :width]) * t[..., width:] * g.unsqueeze(-1)

    _check_gated_activation(swiglu, reference, h, gates, probe)


def test_swiglu_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="even"):
        swiglu(torch.zeros(2, 5, device=DEVICE))
    with pytest.raises(ValueError, match="leading shape"):
        swiglu(torch.zeros(2, 8, device=DEVICE), torch.zeros(4, device=DEVICE))


@pytest.mark.parametrize("leading, width", [((7,), 1500), ((3, 5), 48), ((2,), 5000)],
                         ids=["rows", "experts' (E, R)", "a row over two column blocks"])
def test_gated_gelu_matches_pytorch(leading: tuple[int, ...], width: int) -> None:
    """GELU (exact) times a float32 gate per row (an MoE layer's GELU experts) against float64 on the same
    bf16 inputs: the output and h's gradient at one bf16 rounding (the kernel's erfc fit is far closer
    than that); the gates' gradient, a float32 sum over the row, to rtol 1e-4. Inputs up to |h| = 12."""
    h = (torch.randn(*leading, width, device=DEVICE) * 3).clamp(-12, 12).bfloat16()
    gates = torch.rand(*leading, device=DEVICE)
    probe = (torch.randn(*leading, width, device=DEVICE).bfloat16().float(),)
    _check_gated_activation(gated_gelu, _gelu_float64_times, h, gates, probe)


def _gelu_float64_times(t: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """x Phi(x) with Phi from erfc: accurate in the negative tail, where F.gelu's 1 + erf cancels (in
    float64 it returns 0 below x = -8.3, in float32 it has no correct digit below x = -5)."""
    return t * 0.5 * torch.erfc(-t / 2**0.5) * g.unsqueeze(-1)


def test_gated_gelu_float32_is_as_close_to_exact_as_pytorchs_gelu() -> None:
    """float32 in and out, h on [-13, 13], gate 1, against float64: the kernel's GELU (an erf fit with
    |error| <= 1.5e-7) within 3e-7 (1 + |h|) of exact, and its largest error no more than PyTorch's
    own float32 GELU's or half a float32 ulp at 13 (measured: 4.1e-7 against PyTorch's 9.8e-7 on one
    machine, 3.6e-7 on another; half an ulp 4.8e-7); h's gradient within 3e-7 (1 + |h|) too.
    Then with gates and a random incoming gradient: the gates' gradient, a float32 sum of 1000
    products, to rtol 1e-5."""
    h = torch.linspace(-13, 13, 26001, device=DEVICE).view(1, -1)
    (want,), (want_grad, _) = _grads(_gelu_float64_times, (h.double(), torch.ones(1, device=DEVICE).double()),
                                     (torch.ones_like(h),))
    (got,), (got_grad, _) = _grads(gated_gelu, (h, torch.ones(1, device=DEVICE)), (torch.ones_like(h),))
    bound = 3e-7 * (1 + h.double().abs())
    assert ((got.double() - want).abs() <= bound).all()
    assert ((got_grad.double() - want_grad).abs() <= bound).all()
    # No worse than PyTorch's own float32 GELU, or than rounding to float32 at the range's end (half an
    # ulp of 13): PyTorch's own error depends on the CPU's vector unit (9.8e-7 measured on one machine,
    # 3.6e-7 on an AVX2-only one), so it alone is no fixed bar.
    half_ulp = (torch.tensor(13.0).nextafter(torch.tensor(14.0)) - 13.0).item() / 2
    pytorch_error = (F.gelu(h).double() - want).abs().max().item()
    assert (got.double() - want).abs().max().item() <= max(pytorch_error, half_ulp)

    h = torch.randn(5, 1000, device=DEVICE) * 3
    gates = torch.rand(5, device=DEVICE) + 0.5
    probe = (torch.randn(5, 1000, device=DEVICE),)
    (_,), want_grads = _grads(_gelu_float64_times, (h.double(), gates.double()), probe)
    (_,), got_grads = _grads(gated_gelu, (h, gates), probe)
    torch.testing.assert_close(got_grads[1].double(), want_grads[1], rtol=1e-5, atol=1e-6)


def test_gated_gelu_rejects_gates_of_another_shape() -> None:
    with pytest.raises(ValueError, match="leading shape"):
        gated_gelu(torch.zeros(2, 8, device=DEVICE), torch.zeros(4, device=DEVICE))


@triton.jit
def _store_float32(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    """out = x through store_rounded (for the test below)."""
    offsets = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    store_rounded(out_ptr + offsets, tl.load(x_ptr + offsets, mask=offsets < n), offsets < n)


def test_store_rounded_rounds_to_nearest_even_like_pytorch() -> None:
    """The kernels' bf16 store (mode.kernels.common.store_rounded: the GPU's cast, or bit arithmetic in
    Triton's interpreter) equals PyTorch's float32 -> bf16 rounding bit for bit: random values of
    every magnitude, and values exactly halfway between two bf16 numbers (ties to even, both ways)."""
    base = torch.randn(4096) * torch.logspace(-30, 30, 4096)
    exact = torch.randn(64).bfloat16().float()  # representable: their neighbours' midpoints are ties
    half_ulp = torch.ldexp(torch.ones(64), torch.frexp(exact).exponent - 9)  # half a bf16 step (8 bits)
    values = torch.cat([base, exact + half_ulp, exact - half_ulp, exact + 3 * half_ulp]).to(DEVICE)
    out = torch.empty(values.shape, dtype=torch.bfloat16, device=DEVICE)
    _store_float32[(triton.cdiv(values.numel(), 1024),)](values, out, values.numel(), BLOCK=1024)
    want = values.bfloat16()
    assert not torch.equal(values[4096:].bfloat16().float(), values[4096:])  # the ties are not representable
    assert torch.equal(out.view(torch.int16), want.view(torch.int16))


def test_use_triton_only_for_cuda_tensors_in_eager_mode() -> None:
    assert not use_triton(torch.zeros(2))  # CPU tensors: the PyTorch path
    if torch.cuda.is_available():
        x = torch.zeros(2, device="cuda")
        assert use_triton(x) and use_triton(x.bfloat16())
        assert not use_triton(x.double())  # the kernels compute in float32: float64 keeps the PyTorch ops
        with use_kernels(enabled=False):
            assert not use_triton(x)
        with use_kernels(topk=False):
            assert not use_triton(x, "topk") and use_triton(x, "rows")
    with use_kernels(cpu=True):  # Triton's interpreter takes CPU tensors
        assert use_triton(torch.zeros(2)) and not use_triton(torch.zeros(2, dtype=torch.float64))


def test_mode_kernels_environment_variable_is_checked(monkeypatch: pytest.MonkeyPatch) -> None:
    import mode.kernels as kernels

    monkeypatch.setenv("MODE_KERNELS", "cuda")
    with pytest.raises(ValueError, match="MODE_KERNELS"):
        kernels.policy_from_env()
    monkeypatch.setenv("MODE_KERNELS", "torch")
    assert kernels.policy_from_env() == KernelPolicy(enabled=False)
    assert not KernelPolicy(enabled=False).allows("rows") and KernelPolicy().allows("rows")
    assert KernelPolicy.only("rows").allows("rows") and not KernelPolicy.only("rows").allows("topk")
    with pytest.raises(ValueError, match="unknown kernel op"):
        KernelPolicy().allows("gemm")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cross_entropy_and_grad_matches_float64(dtype: torch.dtype) -> None:
    """Per-row loss and softmax - one_hot, with V over one block (masked tail) and extreme targets."""
    from mode.kernels.cross_entropy import cross_entropy_and_grad

    rows, vocab = 6, 3000
    logits = (4 * torch.randn(rows, vocab, device=DEVICE)).to(dtype)
    targets = torch.tensor([0, vocab - 1, 5, 2047, 2048, 17], device=DEVICE)
    loss, grad = cross_entropy_and_grad(logits, targets)
    exact = logits.double()
    want_loss = F.cross_entropy(exact, targets, reduction="none")
    want_grad = exact.softmax(-1) - F.one_hot(targets, vocab).double()
    assert loss.dtype == torch.float32 and grad.dtype == dtype
    torch.testing.assert_close(loss.double(), want_loss, rtol=1e-5, atol=1e-5)  # float32 log-sum-exp
    tol = ONE_BF16_ROUNDING if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(grad.double(), want_grad, **tol)


def test_cross_entropy_kernel_on_logits_near_float32s_lowest() -> None:
    """Rows whose every logit is below -3.0e38 (a diverged model): a finite loss and gradient, as
    F.cross_entropy gives (the running max started at -3.0e38, above them: -inf and inf)."""
    from mode.kernels.cross_entropy import cross_entropy_and_grad

    logits = torch.tensor([[-3.2e38, -3.3e38, -3.1e38], [-3.4e38, -3.4e38, -3.4e38]], device=DEVICE)
    targets = torch.tensor([0, 2], device=DEVICE)
    loss, grad = cross_entropy_and_grad(logits, targets)
    want = F.cross_entropy(logits.double(), targets, reduction="none")
    assert bool(loss.isfinite().all()) and bool(grad.isfinite().all())
    torch.testing.assert_close(loss.double(), want, rtol=1e-5, atol=1e-5)


def test_cross_entropy_and_grad_writes_its_losses_into_loss_out() -> None:
    """loss_out: the per-row losses land in the given float32 slice (nothing else of its buffer is
    touched), which is returned as the loss; a loss_out of another dtype, shape or layout is refused."""
    from mode.kernels.cross_entropy import cross_entropy_and_grad

    logits = torch.randn(5, 70, device=DEVICE)
    targets = torch.randint(0, 70, (5,), device=DEVICE)
    buffer = torch.full((9,), -7.0, device=DEVICE)
    loss, grad = cross_entropy_and_grad(logits, targets, loss_out=buffer[2:7])
    want_loss, want_grad = cross_entropy_and_grad(logits, targets)
    assert loss.data_ptr() == buffer[2:7].data_ptr()
    assert torch.equal(buffer[2:7], want_loss) and torch.equal(grad, want_grad)
    assert bool((buffer[:2] == -7.0).all()) and bool((buffer[7:] == -7.0).all())
    bad_ones = [torch.empty(5, dtype=torch.float64, device=DEVICE), torch.empty(4, device=DEVICE),
                torch.empty(10, device=DEVICE)[::2]]  # the wrong dtype, length, layout
    for bad in bad_ones:
        with pytest.raises(ValueError, match="loss_out must be a contiguous float32"):
            cross_entropy_and_grad(logits, targets, loss_out=bad)


def test_fused_loss_in_bf16_over_several_chunks_matches_float64(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel path with bf16 hidden states and weight, as autocast hands them over, in 5 chunks:
    the hidden states' gradient written by its GEMM into each chunk's rows and the weight's summed
    into float32 chunk by chunk (on CUDA one GEMM adding into it). Against float64 on the same bf16
    values: the loss within the bf16 rounding of its logits, the GEMM's output (on an H100 off by 3e-4
    of 6.8), the gradients within 1% of their largest entry (they are rounded to bf16 at the end;
    measured on CPU: 0.3%)."""
    from mode.layers.loss import linear_cross_entropy

    kernels_on()
    hidden = torch.randn(64, 32, device=DEVICE).bfloat16().requires_grad_()
    weight = (0.3 * torch.randn(300, 32, device=DEVICE)).bfloat16().requires_grad_()
    targets = torch.randint(0, 300, (64,), device=DEVICE)
    loss = linear_cross_entropy(hidden, weight, targets, chunk_elements=300 * 13)  # 13 rows a chunk: 64 rows in 5 chunks
    loss.backward()
    h64, w64 = hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()
    want = F.cross_entropy(h64 @ w64.t(), targets)
    want.backward()
    torch.testing.assert_close(loss.double(), want, rtol=0, atol=2e-3)
    for got, exact in ((hidden.grad, h64.grad), (weight.grad, w64.grad)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.double(), exact, rtol=0, atol=0.01 * exact.abs().max().item())


def test_fused_loss_takes_the_kernel_path_on_cuda_and_matches_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """linear_cross_entropy with the kernel (CUDA) against its PyTorch path; on CPU the kernel path
    is forced through the interpreter, so the branch itself is exercised too."""
    from mode.layers.loss import linear_cross_entropy

    hidden = torch.randn(40, 16, device=DEVICE, requires_grad=True)
    weight = torch.randn(300, 16, device=DEVICE, requires_grad=True)
    targets = torch.randint(0, 300, (40,), device=DEVICE)
    results = {}
    for fused in (True, False):
        kernels_on(fused)
        hidden.grad = weight.grad = None
        loss = linear_cross_entropy(hidden, weight, targets)
        loss.backward()
        results[fused] = (loss.detach(), hidden.grad.clone(), weight.grad.clone())
    for got, want in zip(results[True], results[False]):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)  # float32 both ways


def _top_k_positions_torch(scores: torch.Tensor, k: int) -> torch.Tensor:
    from mode.routing import top_k_positions

    with use_kernels(topk=False):
        return top_k_positions(scores, k)


@pytest.mark.parametrize(
    "shape, k", [((3, 5, 37), 7), ((2, 100), 100), ((4, 64), 1), ((2, 300), 150)],
    ids=["(G, E, T), T not a power of two", "k = T", "k = 1", "half the row"],
)
def test_top_k_positions_kernel_matches_topk_then_sort(shape: tuple[int, ...], k: int) -> None:
    from mode.kernels.topk import top_k_positions

    torch.manual_seed(0)
    scores = torch.randn(*shape, device=DEVICE)
    got = top_k_positions(scores, k)
    assert got.dtype == torch.long and got.shape == (*shape[:-1], k)
    assert torch.equal(got, _top_k_positions_torch(scores, k))
    # A transposed (non-contiguous) view, as expert choice's (G, E, T) softmax slice is.
    view = torch.randn(shape[-1], 6, device=DEVICE).t()
    assert torch.equal(top_k_positions(view, k), _top_k_positions_torch(view, k))
    # flat=True: the same positions in the flattened (rows * T) axis too, from the same launch
    positions, flat = top_k_positions(scores, k, flat=True)
    assert torch.equal(positions, got) and flat.shape == (got.numel(),)
    rows = torch.arange(got.numel() // k, device=DEVICE).view(*shape[:-1], 1)
    assert torch.equal(flat, (got + rows * shape[-1]).reshape(-1))


def test_top_k_positions_kernel_ties_signs_and_nan() -> None:
    """Equal scores go to the earlier position; negative scores order by value (not by their bits);
    NaN is the largest score, as in torch.topk."""
    from mode.kernels.topk import top_k_positions

    row = torch.tensor([[1.0, 3.0, 3.0, 3.0, 0.0, -0.5, float("nan"), -1.0]], device=DEVICE)
    assert top_k_positions(row, 3).tolist() == [[1, 2, 6]]  # NaN, then the two earliest 3.0s
    assert top_k_positions(row, 4).tolist() == [[1, 2, 3, 6]]
    negatives = torch.tensor([[-1.0, -2.0, -0.5, -3.0, -0.25]], device=DEVICE)
    assert top_k_positions(negatives, 2).tolist() == [[2, 4]]
    with pytest.raises(ValueError, match="k must be in"):
        top_k_positions(negatives, 6)


def test_top_k_positions_kernel_and_pytorch_path_break_ties_alike() -> None:
    """Where scores tie (equal tokens score alike before any attention: a routed first block), the
    kernel and the PyTorch path (CPU, torch.compile) choose the same positions: the earliest ones.
    torch.topk's choice among ties is unspecified (on CPU it took the last ones)."""
    from mode.kernels.topk import top_k_positions as kernel
    from mode.routing import primitives

    torch.manual_seed(0)
    rows = [torch.zeros(1, 100), torch.randint(0, 3, (6, 37)).float(),  # all equal; a few values, many ties
            torch.tensor([[-0.0, 0.0, 1.0, float("nan"), 1.0, -0.0, float("nan"), 0.0]])]
    for scores in rows:
        for k in range(1, scores.shape[-1] + 1, 3):
            want = primitives.top_k_positions(scores, k)  # on CPU: the PyTorch path
            assert torch.equal(kernel(scores.to(DEVICE), k).cpu(), want), (scores, k)
    assert primitives.top_k_positions(torch.zeros(1, 100), 2).tolist() == [[0, 1]]


def test_top_k_positions_takes_the_kernel_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    from mode.kernels.topk import MAX_TOKENS
    from mode.routing import primitives

    kernels_on()
    assert primitives.topk_kernel_applies(torch.zeros(2, MAX_TOKENS))
    assert not primitives.topk_kernel_applies(torch.zeros(2, MAX_TOKENS + 1))  # a row no longer fits
    assert not primitives.topk_kernel_applies(torch.zeros(2, 8, dtype=torch.float64))
    kernels_on(topk=False)
    assert not primitives.topk_kernel_applies(torch.zeros(2, 8))


HEAD_CASES = [  # tokens, slots, k, real experts, capacity, whether the capacity drops assignments
    (37, 8, 1, 8, None, False), (300, 12, 2, 10, 40, True), (5, 3, 3, 3, None, False), (1000, 64, 4, 60, 50, True),
    (2, 256, 8, 200, 1, False), (3, 1, 1, 1, None, False),
]


def test_token_choice_head_kernel_and_pytorch_path_break_ties_and_rank_nan_alike(monkeypatch: pytest.MonkeyPatch) -> None:
    """Equal logits go to the lowest slots on both paths (torch.topk's choice among ties is
    unspecified); a NaN logit's row chooses distinct slots with NaN gates on both, as PyTorch ranks
    NaN (the kernel chose one slot k times, with gates of -2)."""
    logits = torch.tensor([[0.0, 2.0, 2.0, 2.0, 1.0, 2.0], [1.0] * 6, [0.5, float("nan"), 1.0, 0.0, 0.0, 0.0]],
                          device=DEVICE)
    case = (3, 6, 3, 4, None, False)  # tokens, slots, top_k, experts (2 no-op), dropless
    got, want = (_head(logits, case, kernel, monkeypatch) for kernel in (True, False))
    assert torch.equal(got.slots.cpu(), want.slots.cpu())
    assert got.slots.tolist()[:2] == [[1, 2, 3], [0, 1, 2]]
    assert len(set(got.slots[2].tolist())) == 3 and bool(got.gates[2].isnan().all())
    assert torch.equal(got.tokens_per_expert.cpu().double(), want.tokens_per_expert.cpu().double())


def _head(logits: torch.Tensor, case: tuple, kernel: bool, monkeypatch: pytest.MonkeyPatch):
    from mode.routing import token_choice_head

    kernels_on(kernel)
    _, _, k, experts, capacity, _ = case
    return token_choice_head(logits, k, experts, capacity, 0.3, 0.02)


@pytest.mark.parametrize("case", HEAD_CASES, ids=["top-1, a partial block", "top-2, no-op slots, dropping",
                                                  "k = slots", "many blocks", "widest, capacity 1",
                                                  "one expert"])
def test_token_choice_head_kernel_matches_pytorch(case: tuple, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every field of the head, and the logits' gradient from the gates' and the auxiliary loss's
    gradients, against the PyTorch branch in float64 on the same float32 logits."""
    torch.manual_seed(0)
    tokens, n_slots, k = case[:3]
    logits = (3 * torch.randn(tokens, n_slots, device=DEVICE)).requires_grad_()
    probe = torch.randn(tokens, k, device=DEVICE)
    got = _head(logits, case, True, monkeypatch)
    (grad,) = torch.autograd.grad((got.gates * probe).sum() + 0.7 * got.aux_loss, logits)
    ref = logits.detach().double().requires_grad_()
    want = _head(ref, case, False, monkeypatch)
    (want_grad,) = torch.autograd.grad((want.gates * probe).sum() + 0.7 * want.aux_loss, ref)
    assert got.slots.dtype == torch.long and torch.equal(got.slots, want.slots)
    assert torch.equal(got.tokens_per_expert.double(), want.tokens_per_expert)  # counts are exact
    for name in ("gates", "aux_loss", "lb_loss", "z_loss", "noop_fraction", "dropped_fraction", "computed_fraction"):
        torch.testing.assert_close(getattr(got, name).double(), getattr(want, name).double(), rtol=1e-5, atol=1e-7,
                                   msg=lambda m, n=name: f"{n}: {m}")
    torch.testing.assert_close(grad.double(), want_grad, rtol=1e-4, atol=1e-6)
    assert (float(got.dropped_fraction) > 0) == case[5]


def test_token_choice_head_kernel_ties_go_to_the_lower_slot() -> None:
    from mode.kernels.softmax_topk import token_choice_head

    logits = torch.tensor([[0.0, 2.0, 2.0, 1.0], [5.0, 5.0, 5.0, 5.0]], device=DEVICE)
    _, slots, _, summary = token_choice_head(logits, 2, 4, None, 0.0, 0.0)
    assert slots.tolist() == [[1, 2], [0, 1]]
    assert summary[4:8].tolist() == [1.0, 2.0, 1.0, 0.0]  # choices per slot
    with pytest.raises(ValueError, match="k <="):
        token_choice_head(logits, 5, 4, None, 0.0, 0.0)
    with pytest.raises(ValueError, match="n_experts"):
        token_choice_head(logits, 1, 5, None, 0.0, 0.0)


def test_token_choice_head_kernel_gradient_from_the_gates_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """The auxiliary loss unused (no gradient reaches it): the gates' gradient alone."""
    logits = torch.randn(40, 6, device=DEVICE, requires_grad=True)
    probe = torch.randn(40, 2, device=DEVICE)
    case = (40, 6, 2, 4, None, False)
    (grad,) = torch.autograd.grad((_head(logits, case, True, monkeypatch).gates * probe).sum(), logits)
    ref = logits.detach().double().requires_grad_()
    (want,) = torch.autograd.grad((_head(ref, case, False, monkeypatch).gates * probe).sum(), ref)
    torch.testing.assert_close(grad.double(), want, rtol=1e-4, atol=1e-6)


def test_token_choice_head_takes_the_kernel_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    from mode.kernels.softmax_topk import MAX_SLOTS
    from mode.routing import primitives

    logits = torch.randn(50, 6, device=DEVICE)
    kernels_on()
    assert primitives.softmax_topk_kernel_applies(logits, 2)
    assert not primitives.softmax_topk_kernel_applies(torch.zeros(4, MAX_SLOTS + 1), 1)
    assert not primitives.softmax_topk_kernel_applies(logits.double(), 2)
    kernels_on(softmax_topk=False)
    assert not primitives.softmax_topk_kernel_applies(logits, 2)


def _expert_choice_ids(tokens: int, n_experts: int, per_expert: int) -> torch.Tensor:
    """(E, C) distinct tokens per expert: some tokens taken by several experts, some by none."""
    return torch.stack([torch.randperm(tokens)[:per_expert].sort().values for _ in range(n_experts)]).to(DEVICE)


def _rows_run(x: torch.Tensor, ids: torch.Tensor, weight: torch.Tensor | None, gates: torch.Tensor, probe: torch.Tensor,
              kernel: bool, monkeypatch: pytest.MonkeyPatch):
    """gather_rows -> a per-row linear map -> combine_rows; output and the gradients of x, weight and gates.
    weight None: the gathered rows are combined as they are; gates None: summed without gates."""
    from mode.routing import combine_rows, expert_choice_rows, gather_rows

    kernels_on(kernel)
    x = x.detach().clone().requires_grad_()
    gates = None if gates is None else gates.detach().clone().requires_grad_()
    weight = None if weight is None else weight.detach().clone().requires_grad_()
    rows = expert_choice_rows(ids, x)
    assert (rows.inverse is not None) == kernel
    ys = gather_rows(x, rows)  # (R, D)
    out = combine_rows(ys if weight is None else ys @ weight, gates, rows)  # (T, D)
    (out.float() * probe).sum().backward()
    return out.detach(), x.grad, None if gates is None else gates.grad, weight.grad if weight is not None else None


@pytest.mark.parametrize("gated", [True, False], ids=["gated combine", "plain sum"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expert_rows_kernels_match_pytorch(dtype: torch.dtype, gated: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """The token-major combine (gates applied in float32, one rounding; or a plain sum, whose backward
    is a gather) and the gather's backward
    against gather_tokens / combine_tokens in float64 on the same inputs; tokens no expert took get
    an exact zero output and an exact zero input gradient. A width that is not a multiple of the
    column block, and more tokens than one program. In float32 the rows pass a matmul between the
    two; in bf16 they are combined as gathered (no bf16 matmul rounding in the comparison), and the
    input gradient is rounded twice (each row's gradient, then their sum): rtol 2^-7, and an atol of
    3e-2 for sums that cancel (up to 5 rows of |gate * probe| < 5, each off by 2^-9 of itself)."""
    torch.manual_seed(0)
    tokens, width, n_experts, per_expert = 70, 300, 5, 24
    ids = _expert_choice_ids(tokens, n_experts, per_expert)
    x = torch.randn(tokens, width, device=DEVICE).to(dtype)
    weight = torch.randn(width, width, device=DEVICE) / width**0.5 if dtype == torch.float32 else None
    gates = torch.rand(n_experts * per_expert, device=DEVICE)
    probe = torch.randn(tokens, width, device=DEVICE).to(dtype).float()  # the same incoming gradient both ways
    got = _rows_run(x, ids, weight, gates if gated else None, probe, True, monkeypatch)
    want = _rows_run(x.double(), ids, None if weight is None else weight.double(), gates.double() if gated else None,
                     probe.double(), False, monkeypatch)
    tolerance = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2**-7, atol=3e-2)
    for name, g, w in zip(("output", "x grad", "gates grad", "weight grad"), got, want):
        if w is None:
            continue
        assert g.dtype == (torch.float32 if name in ("gates grad", "weight grad") else dtype), name
        torch.testing.assert_close(g.double(), w, **tolerance, msg=lambda m, n=name: f"{n}: {m}")
    untouched = torch.ones(tokens, dtype=torch.bool, device=DEVICE)
    untouched[ids.reshape(-1)] = False
    assert untouched.any()
    assert not got[0][untouched].any() and not got[1][untouched].any()


def test_expert_rows_combine_rounds_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 rows: the combine is the float32 sum of float32 gate x row, rounded once to bf16 (to
    nearest even): equal to that computation in PyTorch bit for bit."""
    from mode.routing import combine_rows, expert_choice_rows

    kernels_on()
    tokens, width, n_experts, per_expert = 33, 64, 3, 20
    ids = _expert_choice_ids(tokens, n_experts, per_expert)
    ys = torch.randn(n_experts * per_expert, width, device=DEVICE).bfloat16()
    gates = torch.rand(n_experts * per_expert, device=DEVICE)
    rows = expert_choice_rows(ids, torch.empty(tokens, width, device=DEVICE, dtype=torch.bfloat16))
    want = torch.zeros(tokens, width, device=DEVICE)
    for e in range(n_experts):  # expert order: the kernel adds a token's rows in expert order
        part = slice(e * per_expert, (e + 1) * per_expert)
        want[ids[e]] += gates[part, None] * ys[part].float()
    assert torch.equal(combine_rows(ys, gates, rows), want.bfloat16())


def test_expert_rows_kernels_take_the_kernel_only_where_they_apply(monkeypatch: pytest.MonkeyPatch) -> None:
    from mode.routing import expert_choice_rows

    ids = _expert_choice_ids(10, 2, 3)
    assert expert_choice_rows(ids, torch.zeros(10, 4)).inverse is None  # CPU (use_triton's own test: eager CUDA only)
    kernels_on()
    assert expert_choice_rows(ids, torch.zeros(10, 4, device=DEVICE)).inverse.shape == (10, 2)
    assert expert_choice_rows(ids, torch.zeros(10, 4, device=DEVICE, dtype=torch.float64)).inverse is None
    kernels_on(rows=False)
    assert expert_choice_rows(ids, torch.zeros(10, 4, device=DEVICE)).inverse is None


@pytest.mark.parametrize("in_place", [False, True], ids=["a copy of x", "in place"])
def test_add_gated_tokens_kernel_matches_pytorch(in_place: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A depth router's gated update of the residual through the kernels (add_gated_rows_ forward,
    combine_backward backward) against the same autograd node on PyTorch ops: float32 x, bf16
    updates, float32 gates; output and the gradients of x, gates and updates (the updates' at one
    bf16 rounding both ways, the gates' float32 sums in another order: rtol 1e-5). Tokens not chosen
    keep x's value and gradient exactly."""
    from mode.routing import add_gated_tokens, token_mask

    groups, tokens, width, k = 3, 40, 300, 7
    indices = torch.stack([torch.randperm(tokens)[:k].sort().values for _ in range(groups)]).to(DEVICE)
    x0 = torch.randn(groups, tokens, width, device=DEVICE)
    gates0 = torch.rand(groups, k, device=DEVICE)
    updates0 = torch.randn(groups, k, width, device=DEVICE).bfloat16()
    probe = torch.randn(groups, tokens, width, device=DEVICE)
    runs = []
    for kernel in (True, False):
        kernels_on(kernel)
        leaf, gates, updates = (t.clone().requires_grad_() for t in (x0, gates0, updates0))
        x = leaf * 1.0
        out = add_gated_tokens(x, indices, gates, updates, in_place=in_place)
        assert (out.data_ptr() == x.data_ptr()) == in_place
        (out * probe).sum().backward()
        runs.append((out.detach(), leaf.grad, gates.grad, updates.grad))
    for name, got, want in zip(("output", "x grad", "gates grad", "updates grad"), *runs):
        assert got.dtype == want.dtype, name
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")
    untouched = ~token_mask(indices, tokens)
    assert torch.equal(runs[0][0][untouched], x0[untouched]) and torch.equal(runs[0][1], probe)


MOE_ROW_CASES = {  # scheme settings: every token taken by 0..E experts; dropped and no-op choices
    "expert choice per sequence": dict(scheme="expert_choice"),
    "expert choice, groups of 2": dict(scheme="expert_choice", group_size=2, capacity_factor=1.5),
    "token choice top-2, dropping": dict(scheme="token_choice", top_k=2, capacity_factor=0.75),
    "token choice top-1, capacity 2": dict(scheme="token_choice", top_k=1, capacity_factor=2.0),
    "token choice top-2, dropless": dict(scheme="token_choice", top_k=2, dropless=True),
    "expert choice, causal decision": dict(scheme="expert_choice"),  # the sampling path: variable counts
    "expert choice, GELU experts": dict(scheme="expert_choice", activation="gelu"),
    "token choice top-2, GELU experts, dropless": dict(scheme="token_choice", top_k=2, dropless=True, activation="gelu"),
}


@pytest.mark.parametrize("case", MOE_ROW_CASES, ids=list(MOE_ROW_CASES))
def test_moe_layer_through_the_row_kernels_equals_pytorch(case: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole MoE layer (SwiGLU or GELU experts, 2 no-op slots) with its rows moved by the kernels, and
    the gates applied by the experts' activation kernel (the combine a plain sum), equals
    the layer on gather_tokens / combine_tokens with the gates in the combine: output, input gradient and every
    parameter's gradient, float32 both ways (sums in another order: rtol 1e-5). Every layout: expert
    choice's (E, G*C), token choice's (E, C) with empty rows, the grouped rows sorted by expert
    (dropless), and a causal decision's variable counts."""
    from mode.config import MoEConfig, RoutingConfig
    from mode.layers.experts import Experts
    from mode.layers.moe import MoEFFN

    gated_activations = []
    act = Experts.act
    monkeypatch.setattr(Experts, "act", lambda self, h, gates=None: gated_activations.append(gates is not None)
                        or act(self, h, gates))

    torch.manual_seed(0)
    causal = "causal" in case
    routing = RoutingConfig(causal="aux_loss") if causal else None
    layer = MoEFFN(32, 48, MoEConfig(n_experts=4, n_noop=2, **MOE_ROW_CASES[case]), routing).to(DEVICE)
    x = torch.randn(4, 24, 32, device=DEVICE)
    probe = torch.randn(4, 24, 32, device=DEVICE)
    runs = []
    for kernel in (True, False):
        kernels_on(kernel)
        layer.zero_grad(set_to_none=True)
        x_in = x.clone().requires_grad_()
        out, _ = layer(x_in, causal=causal)  # causal: expert e takes the tokens whose logit says so
        (out * probe).sum().backward()
        runs.append((out.detach(), x_in.grad, {n: p.grad for n, p in layer.named_parameters()}))
        # with the kernels the experts' activation applies the gates (every call); without, the combine
        assert gated_activations and set(gated_activations) == {kernel}
        gated_activations.clear()
    (out, x_grad, grads), (want_out, want_x_grad, want_grads) = runs
    assert out.abs().sum() > 0 and (out == 0).all(-1).any()  # some tokens updated, some not at all
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x_grad, want_x_grad, rtol=1e-5, atol=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, want_grads[name], rtol=1e-5, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


EXPERT_CHOICE_DISPATCH_CASES = {  # (batch, seq, group_size, n_experts, n_noop, capacity_factor)
    "per sequence": (4, 24, 1, 4, 0, 1.0),
    "groups of 2, no-op slots": (4, 24, 2, 4, 2, 1.5),
    "capacity 1, odd tokens": (2, 13, 1, 3, 1, 0.3),
    "one expert takes every token": (2, 16, 1, 1, 0, 1.0),
    "64 slots (56 no-op)": (2, 40, 1, 8, 56, 8.0),
}


def _expert_choice_run(layer: torch.nn.Module, x: torch.Tensor, use: str, kernel: bool,
                       monkeypatch: pytest.MonkeyPatch) -> tuple:
    """ExpertChoiceRouter.route with the kernels or the PyTorch ops; the loss uses the outputs `use`
    names (rows, gates, aux): the routing, the rows, and the gradients of x and the router's weight."""
    kernels_on(kernel)
    layer.zero_grad(set_to_none=True)
    x = x.clone().requires_grad_()
    routing, rows, xs = layer.router.route(x)
    assert (rows.inverse is not None) == kernel
    torch.manual_seed(1)  # the same probes both ways
    loss = x.new_zeros(())
    probe = lambda t: torch.randn(t.shape, device=t.device)  # noqa: E731 (randn_like would follow the strides)
    if "rows" in use:
        loss = loss + (xs * probe(xs)).sum()
    if "gates" in use:
        loss = loss + (routing.gates * probe(routing.gates)).sum()
    if "aux" in use:
        loss = loss + 3.0 * routing.aux_loss
    if "null" in use:
        loss = loss + (routing.null_gates * probe(routing.null_gates)).sum()
    loss.backward()
    return routing, rows, xs.detach(), x.grad, layer.router.router.proj.weight.grad


@pytest.mark.parametrize("use", ["rows gates aux", "gates", "aux", "rows"])
@pytest.mark.parametrize("case", EXPERT_CHOICE_DISPATCH_CASES, ids=list(EXPERT_CHOICE_DISPATCH_CASES))
def test_expert_choice_dispatch_matches_pytorch(case: str, use: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Expert choice's routing, rows and gather in one autograd function against the router's PyTorch
    ops, expert_choice_rows and gather_rows, float32: the same selection, gates and rows bit for bit
    (the softmax is PyTorch's both ways), the same ids and inverse map as expert_choice_rows, the
    same statistics, the z-loss and the gradients of x and the router's weight (the router's input
    gradient summed with the gather's in the kernel) to float32 rounding (rtol 1e-5); the loss
    uses every output or only some (the others' gradients are None)."""
    from mode.config import MoEConfig
    from mode.layers.moe import MoEFFN

    batch, seq, group_size, n_experts, n_noop, capacity_factor = EXPERT_CHOICE_DISPATCH_CASES[case]
    torch.manual_seed(0)
    layer = MoEFFN(32, 48, MoEConfig(n_experts=n_experts, n_noop=n_noop, scheme="expert_choice", group_size=group_size,
                                     capacity_factor=capacity_factor, z_loss_weight=0.1)).to(DEVICE)
    x = torch.randn(batch, seq, 32, device=DEVICE)
    got_routing, got_rows, got_xs, got_x_grad, got_w_grad = _expert_choice_run(layer, x, use, True, monkeypatch)
    routing, _, xs, x_grad, w_grad = _expert_choice_run(layer, x, use, False, monkeypatch)
    assert torch.equal(got_routing.positions, routing.positions)
    assert torch.equal(got_routing.gates, routing.gates)
    assert torch.equal(got_xs, xs)
    assert torch.equal(got_routing.logits, routing.logits.detach())
    with use_kernels(KernelPolicy(cpu=True)):  # the PyTorch path's layout, with its inverse map
        from mode.routing import expert_choice_rows, expert_major_ids

        want_rows = expert_choice_rows(expert_major_ids(routing.positions, group_size * seq), x.view(-1, 32))
    assert torch.equal(got_rows.ids, want_rows.ids) and torch.equal(got_rows.inverse, want_rows.inverse)
    torch.testing.assert_close(got_routing.aux_loss, routing.aux_loss, rtol=1e-6, atol=0)
    assert got_routing.stats.keys() == routing.stats.keys()
    for name, value in routing.stats.items():
        torch.testing.assert_close(got_routing.stats[name], value, rtol=1e-6, atol=0, msg=lambda m, n=name: f"{n}: {m}")
    assert 0 < routing.stats["processed"] <= 1
    torch.testing.assert_close(got_x_grad, x_grad, rtol=1e-5, atol=1e-6)
    if w_grad is None:  # the rows alone: PyTorch's router is not on the loss's path; here it gets zeros
        assert use == "rows" and not got_w_grad.any()
    else:
        torch.testing.assert_close(got_w_grad, w_grad, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("use", ["rows gates aux null", "null"])
@pytest.mark.parametrize("case", ["groups of 2, no-op slots", "capacity 1, odd tokens", "64 slots (56 no-op)"])
def test_expert_choice_dispatch_with_null_gates_matches_pytorch(case: str, use: str,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Copy null experts (moe.noop_kind): the dispatch also returns every token's no-op slot
    probabilities, equal to the PyTorch softmax's bit for bit, and their gradient reaches x and the
    router's weight through the scores as PyTorch's does (float32 rounding, rtol 1e-5)."""
    from mode.config import MoEConfig
    from mode.layers.moe import MoEFFN

    batch, seq, group_size, n_experts, n_noop, capacity_factor = EXPERT_CHOICE_DISPATCH_CASES[case]
    torch.manual_seed(0)
    layer = MoEFFN(32, 48, MoEConfig(n_experts=n_experts, n_noop=n_noop, noop_kind="copy", scheme="expert_choice",
                                     group_size=group_size, capacity_factor=capacity_factor,
                                     z_loss_weight=0.1)).to(DEVICE)
    assert layer.router.null_gates
    x = torch.randn(batch, seq, 32, device=DEVICE)
    got_routing, _, got_xs, got_x_grad, got_w_grad = _expert_choice_run(layer, x, use, True, monkeypatch)
    routing, _, xs, x_grad, w_grad = _expert_choice_run(layer, x, use, False, monkeypatch)
    assert torch.equal(got_routing.positions, routing.positions) and torch.equal(got_xs, xs)
    assert got_routing.null_gates.shape == routing.null_gates.shape == (batch // group_size, group_size * seq, n_noop)
    assert torch.equal(got_routing.null_gates, routing.null_gates.detach())
    torch.testing.assert_close(got_x_grad, x_grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_w_grad, w_grad, rtol=1e-5, atol=1e-6)


def test_expert_choice_dispatch_with_a_bf16_router_matches_pytorch(monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16 tokens and router weight (bf16 training, as DeepSpeed keeps parameters): the scores come
    from a bf16 GEMM into float32 (router_scores; on CPU through the policy's cpu flag) and the
    backward's GEMMs take the scores' gradient rounded to bf16, both ways. The same selection,
    gates and rows bit for bit; x's gradient is rounded once here and twice (the router's part, then
    the sum) by PyTorch, the weight's from scores' gradients that may differ by one bf16 rounding:
    rtol 2^-7, and an atol of 2e-2 where the sums cancel."""
    from mode.config import MoEConfig
    from mode.layers.moe import MoEFFN
    from mode.routing import primitives

    with use_kernels(KernelPolicy(enabled=False, cpu=True)):  # the bf16 GEMM, kernels or not
        assert primitives.half_router_applies(torch.zeros(2, 2).bfloat16(), torch.zeros(2, 2).bfloat16())
    torch.manual_seed(0)
    layer = MoEFFN(32, 48, MoEConfig(n_experts=4, n_noop=2, scheme="expert_choice", group_size=2,
                                     capacity_factor=1.5, z_loss_weight=0.1)).to(DEVICE).bfloat16()
    x = torch.randn(4, 24, 32, device=DEVICE).bfloat16()
    got_routing, _, got_xs, got_x_grad, got_w_grad = _expert_choice_run(layer, x, "rows gates aux", True, monkeypatch)
    routing, _, xs, x_grad, w_grad = _expert_choice_run(layer, x, "rows gates aux", False, monkeypatch)
    assert torch.equal(got_routing.positions, routing.positions) and torch.equal(got_routing.gates, routing.gates)
    assert torch.equal(got_xs, xs)
    assert got_x_grad.dtype == got_w_grad.dtype == torch.bfloat16
    torch.testing.assert_close(got_x_grad.float(), x_grad.float(), rtol=2**-7, atol=2e-2)
    torch.testing.assert_close(got_w_grad.float(), w_grad.float(), rtol=2**-7, atol=2e-2)
    torch.testing.assert_close(got_routing.aux_loss, routing.aux_loss, rtol=1e-6, atol=0)


def test_expert_choice_dispatch_takes_the_kernel_only_where_it_applies(monkeypatch: pytest.MonkeyPatch) -> None:
    """The one-function dispatch runs eager on CUDA (here patched) for float32/bf16/fp16 tokens without a
    router bias, a group that fits one program's sort and no causal decision; otherwise the PyTorch ops."""
    import mode.routing.expert_router as router_module
    from mode.config import MoEConfig, RoutingConfig
    from mode.kernels.topk import MAX_TOKENS
    from mode.layers.moe import MoEFFN
    from mode.routing import primitives

    weight = torch.zeros(6, 8, device=DEVICE)
    x = torch.zeros(32, 8, device=DEVICE)
    assert not primitives.expert_choice_kernel_applies(x.cpu(), weight.cpu(), None, 2)  # use_triton: CUDA only
    kernels_on()
    assert primitives.expert_choice_kernel_applies(x, weight, None, 2)
    assert not primitives.expert_choice_kernel_applies(x, weight, torch.zeros(6, device=DEVICE), 2)
    assert not primitives.expert_choice_kernel_applies(x.double(), weight.double(), None, 2)
    assert not primitives.expert_choice_kernel_applies(torch.zeros(2 * MAX_TOKENS + 2, 8, device=DEVICE), weight, None, 2)
    kernels_on(expert_choice=False)
    assert not primitives.expert_choice_kernel_applies(x, weight, None, 2)
    kernels_on(rows=False)  # the dispatch writes the rows' inverse map: no row kernels, no dispatch
    assert not primitives.expert_choice_kernel_applies(x, weight, None, 2)
    kernels_on()

    def refuse(*args: object) -> None:
        raise AssertionError("the dispatch kernel ran for a router with a causal decision")

    monkeypatch.setattr(router_module, "expert_choice_dispatch", refuse)
    layer = MoEFFN(8, 16, MoEConfig(n_experts=2, scheme="expert_choice"), RoutingConfig(causal="aux_loss")).to(DEVICE)
    out, routing = layer(torch.randn(2, 8, 8, device=DEVICE))  # the causal BCE trains the router's logits
    assert out.shape == (2, 8, 8) and routing.aux_loss.requires_grad


def _dropless_rows_by_pytorch(slots: torch.Tensor, positions: torch.Tensor, n_experts: int):
    """The layout sort_rows.dropless_rows builds, the obvious way: a stable argsort by key."""
    n = slots.numel()
    key = torch.where(positions >= 0, slots, n_experts).reshape(-1)
    order = key.argsort(stable=True)
    computed = key[order] < n_experts
    inverse = torch.full((n,), -1, dtype=torch.int32, device=slots.device)
    inverse[order[computed]] = torch.arange(n, dtype=torch.int32, device=slots.device)[computed]
    ends = torch.bincount(key, minlength=n_experts + 1)[:n_experts].cumsum(0).int()
    return order // slots.shape[1], torch.where(computed, order, n), inverse.view(slots.shape), ends


@pytest.mark.parametrize("tokens, top_k, n_experts, n_noop", [(1, 1, 4, 0), (70, 1, 8, 1), (700, 2, 8, 2),
                                                              (3000, 1, 8, 0), (2500, 2, 40, 3), (600, 4, 3, 1)])
def test_dropless_rows_kernel_matches_a_stable_argsort(tokens: int, top_k: int, n_experts: int, n_noop: int) -> None:
    """The counting sort (mode/kernels/sort_rows.py) equals the argsort layout exactly: each row's token
    and gate index, each assignment's row (-1 for no-op slots and for padding, position -1), each
    expert's row end; one program (a block sized to the assignments) and many (1024 assignments
    each with 8 experts, 128 with 40)."""
    from mode.kernels import sort_rows

    slots = torch.stack([torch.randperm(n_experts + n_noop)[:top_k] for _ in range(tokens)]).to(DEVICE)
    positions = torch.where(slots < n_experts, 0, -1)
    positions[torch.rand(tokens, device=DEVICE) < 0.1] = -1  # padding rows: no expert computes them
    assert sort_rows.fits(slots.numel(), n_experts)
    gates = torch.rand(tokens, top_k, device=DEVICE)
    *got, row_gates = sort_rows.dropless_rows(slots, positions, n_experts, gates)
    want = _dropless_rows_by_pytorch(slots, positions, n_experts)
    for name, a, b in zip(("ids", "gate_index", "inverse", "ends"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    # each row's gate: the gates padded with a 0 (the uncomputed rows'), indexed by gate_index
    want_gates = torch.cat([gates.reshape(-1), gates.new_zeros(1)]).index_select(0, want[1])
    assert row_gates.dtype == gates.dtype and torch.equal(row_gates, want_gates)
    assert torch.equal(row_gates == 0, want[1] == slots.numel())  # a 0 exactly where no expert computes the row
    assert sort_rows.dropless_rows(slots, positions, n_experts)[4] is None


@pytest.mark.parametrize("kernels", [False, True])
def test_dropless_layout_gives_each_row_its_gate(kernels: bool) -> None:
    """token_choice.dropless_rows with gates: each row's gate is the gates padded with a 0 at its
    gate_index, through the counting sort's kernel (kernels, no gradient) or the PyTorch ops; with
    gates that need a gradient it still reaches them, the kernel or not."""
    from mode.routing import dropless_positions, dropless_rows

    slots = torch.stack([torch.randperm(6)[:2] for _ in range(40)]).to(DEVICE)  # 4 experts, 2 no-op slots
    valid = torch.rand(40, 1, device=DEVICE) < 0.8
    positions = dropless_positions(slots, 4, valid)
    x = torch.randn(40, 8, device=DEVICE)
    gates = torch.rand(40, 2, device=DEVICE, requires_grad=True)
    policy = KernelPolicy(cpu=True) if kernels else KernelPolicy(enabled=False)
    with use_kernels(policy):
        with torch.no_grad():
            layout = dropless_rows(slots, positions, 4, x, gates)
        trained = dropless_rows(slots, positions, 4, x, gates)
    want = torch.cat([gates.reshape(-1), gates.new_zeros(1)]).index_select(0, layout.gate_index)
    assert (layout.rows.inverse is not None) == kernels
    assert torch.equal(layout.gates, want.detach()) and torch.equal(trained.gates, want)
    assert (layout.gates == 0).sum() == (positions < 0).sum()  # no-op slots and padding rows: a 0 gate
    trained.gates.sum().backward()
    assert torch.equal(gates.grad, (positions >= 0).float())


def test_dropless_positions_equal_positions_in_expert() -> None:
    """dropless_positions: positions_in_expert without a capacity (0, or -1 for a no-op slot), and
    -1 for every assignment of a row marked False (padding)."""
    from mode.routing import dropless_positions

    slots = torch.randint(0, 7, (50, 3), device=DEVICE)  # 5 experts, 2 no-op slots
    rows = torch.rand(50, 1, device=DEVICE) < 0.7
    want = torch.where(slots < 5, 0, -1)
    assert torch.equal(dropless_positions(slots, 5), want)
    got = dropless_positions(slots, 5, rows)
    assert got.dtype == torch.int64 and torch.equal(got, torch.where(rows, want, -1))
    assert (got == 0).any() and (got[~rows.expand_as(got)] == -1).all()


@pytest.mark.parametrize("tokens, top_k, n_experts, n_noop, capacity", [(1, 1, 4, 0, 1), (700, 2, 8, 2, 90),
                                                                        (3000, 1, 8, 0, 375), (2500, 2, 40, 3, 40),
                                                                        (600, 4, 3, 1, 900), (50, 2, 4, 0, 3)])
def test_capacity_rows_kernel_matches_pytorch(tokens: int, top_k: int, n_experts: int, n_noop: int, capacity: int) -> None:
    """Token choice with a capacity in two launches (sort_rows.capacity_rows: a counting sort in
    GShard's priority order) equals positions_in_expert, slot_table and token_choice_rows' ids and
    inverse exactly: dropping (capacity below the load), spare rows (above it), no-op slots, one
    program and many."""
    from mode.kernels import sort_rows
    from mode.routing import positions_in_expert, slot_table

    slots = torch.stack([torch.randperm(n_experts + n_noop)[:top_k] for _ in range(tokens)]).to(DEVICE)
    positions, table, ids, inverse = sort_rows.capacity_rows(slots, n_experts, capacity)
    want_positions = positions_in_expert(slots, n_experts, capacity)
    want_table = slot_table(slots, want_positions, n_experts, capacity)
    assert torch.equal(positions, want_positions)
    assert torch.equal(table, want_table)
    assert torch.equal(ids, torch.where(want_table < tokens * top_k, want_table // top_k, 0).reshape(-1))
    want_inverse = torch.where(want_positions >= 0, slots * capacity + want_positions, -1).int()
    assert inverse.dtype == torch.int32 and torch.equal(inverse, want_inverse)
    assert (want_positions < 0).any() or capacity * n_experts >= tokens * top_k  # the cases drop, or leave rows empty


def test_token_choice_rows_name_the_kept_assignments() -> None:
    """token_choice_rows' inverse: each kept choice's row in the (E, C) table, -1 for dropped and
    no-op choices; every row a token names holds that token."""
    from mode.routing import positions_in_expert, slot_table, token_choice_rows

    torch.manual_seed(0)
    slots = torch.randint(0, 5, (30, 2), device=DEVICE)  # 4 experts and one no-op slot
    positions = positions_in_expert(slots, 4, 6)
    table = slot_table(slots, positions, 4, 6)
    with use_kernels(KernelPolicy(cpu=True)):
        rows = token_choice_rows(table, slots, positions, torch.zeros(30, 8, device=DEVICE))
    kept = positions >= 0
    assert torch.equal(rows.inverse >= 0, kept) and (~kept).any() and kept.any()
    named = rows.inverse[kept].long()
    assert torch.equal(rows.ids[named], torch.arange(30, device=DEVICE).unsqueeze(1).expand(30, 2)[kept])
    assert torch.equal(table.reshape(-1)[named], (torch.arange(60, device=DEVICE).view(30, 2))[kept])


CONFIGS = sorted((Path(__file__).resolve().parents[1] / "configs").glob("*_tiny.yaml"))


def _one_step_both_ways(path: Path, policy: Callable[[bool], None], autocast: bool
                        ) -> dict[bool, tuple[torch.Tensor, dict[str, torch.Tensor]]]:
    """A 2-layer model of config `path`: its loss and gradients on one batch with policy(True) and
    policy(False) set (the kernel policy each way), under bf16 autocast or in float32."""
    from mode.config import load_config
    from mode.model import LanguageModel

    config = load_config(path, ["--model.n_layers=2", "--model.max_seq_len=32", "--data.seq_len=32"])
    torch.manual_seed(0)
    model = LanguageModel(config).to(DEVICE)
    tokens = torch.randint(0, config.model.vocab_size, (2, 33), device=DEVICE)
    runs = {}
    for fused in (True, False):
        policy(fused)
        model.zero_grad(set_to_none=True)
        with torch.autocast(DEVICE, dtype=torch.bfloat16, enabled=autocast):
            loss = model(tokens[:, :-1], tokens[:, 1:]).loss
        loss.backward()
        runs[fused] = (loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})
    return runs


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_models_train_the_same_through_the_kernels(path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block kind: a forward+backward with the layers' kernel branches taken (rotary on qkv,
    MoD's routed angles included; SwiGLU in MLPs and experts; the loss; the routers' top-k
    positions; token choice's softmax and top-k slots; expert choice's gather and combine) equals
    the PyTorch branches.
    float32 both ways, so they differ by float32 rounding only (sums in another order)."""
    runs = _one_step_both_ways(path, lambda fused: kernels_on(fused), autocast=False)
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-6)
    assert runs[True][1].keys() == runs[False][1].keys()
    for name, grad in runs[True][1].items():
        torch.testing.assert_close(grad, runs[False][1][name], rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_every_kernel_compiles_for_an_h100() -> None:
    """Triton's interpreter (these tests on CPU) accepts code the compiler rejects: every kernel the
    layers launch is also compiled ahead of time to PTX for sm_90 (no GPU needed), in a process
    of its own (tests/compile_kernels.py), and the list there covers every launch in mode/kernels/."""
    import re
    import subprocess
    import sys

    root = Path(__file__).resolve().parents[1]
    launched = {name for path in (root / "mode" / "kernels").glob("*.py")
                for name in re.findall(r"\b(_\w+)\[\(", path.read_text())}
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, str(root / "tests" / "compile_kernels.py")], cwd=root, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    compiled = set(re.findall(r"\.(\w+): compiled for sm_90", out.stdout))
    assert launched and launched <= compiled, f"launched but not compiled: {launched - compiled}"


@pytest.mark.parametrize("bias", [False, True], ids=["no bias", "bias"])
@pytest.mark.parametrize("active", [False, True], ids=["every row", "active rows"])
@pytest.mark.parametrize("shape", [(5, 1, 24), (3, 2, 700)], ids=["decode step", "two tokens, width over a block"])
def test_decide_rows_equals_the_float32_router_and_threshold(shape, active: bool, bias: bool) -> None:
    from mode.kernels.decision import decide_rows

    gen = torch.Generator().manual_seed(3)
    x = torch.randn(shape, generator=gen).to(torch.bfloat16).to(DEVICE)
    weight = torch.randn(1, shape[-1], generator=gen).to(DEVICE)
    b = torch.randn(1, generator=gen).to(DEVICE) if bias else None
    rows = shape[0] * shape[1]
    mask = (torch.arange(rows) % 3 != 1).to(DEVICE) if active else None
    expected = (x.double() @ weight.double().t()).squeeze(-1) + (b.double() if bias else 0)  # (B, n)
    taken, scores = decide_rows(x, weight, b, mask)
    assert taken.dtype == torch.bool and taken.shape == shape[:2] and scores.dtype == torch.float32
    torch.testing.assert_close(scores.double(), expected, rtol=1e-5, atol=1e-5)
    want = expected > 0
    if active:
        want &= mask.view(shape[:2])
    clear = expected.abs() > 1e-4  # a score this near 0 may round to either side in float32
    assert torch.equal(taken[clear], want[clear]) and (taken & ~want).sum() <= (~clear).sum()
    with pytest.raises(ValueError, match="active has 2 rows"):
        decide_rows(x, weight, b, torch.ones(2, dtype=torch.bool, device=DEVICE))


def test_the_decode_decision_is_the_same_with_and_without_its_kernel() -> None:
    from mode.config import ModelConfig, RoutingConfig
    from mode.layers.mod import MoDBlock

    torch.manual_seed(0)
    block = MoDBlock(ModelConfig(d_model=32, n_heads=4, n_layers=2, vocab_size=64),
                     RoutingConfig(capacity=0.5, causal="aux_loss")).to(DEVICE)
    x = torch.randn(6, 1, 32, device=DEVICE)
    mask = torch.tensor([True, False, True, True, False, True], device=DEVICE)
    weights = block.router_weights()
    kernels_on(True)
    fused = block.decide(x, weights, mask)
    kernels_on(False)
    plain = block.decide(x, weights, mask)
    unmasked = block.decide(x, weights)
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-5, atol=1e-6)
    assert torch.equal(fused[0], plain[0]) and torch.equal(plain[0], unmasked[0] & mask.view(6, 1))
    assert not plain[0][~mask].any() and unmasked[0].any()


@pytest.mark.parametrize("batch, width, count", [(1, 1, 0), (1, 1, 1), (8, 2, 1), (64, 9, 9), (64, 9, 20), (1000, 160, 0),
                                                 (1000, 160, 117)])
def test_compact_rows_equal_the_sorting_reference(batch: int, width: int, count: int) -> None:
    """The compaction kernel's rows, kept flags, cache slots and grown lengths equal the PyTorch
    reference's exactly (more rows chosen than W holds: the first W chosen kept)."""
    from mode.kernels.decision import compact_rows
    from mode.layers.chunks import compact_rows_reference

    gen = torch.Generator().manual_seed(batch + count)
    chosen = torch.zeros(batch, dtype=torch.bool)
    chosen[torch.randperm(batch, generator=gen)[:count]] = True
    chosen = chosen.to(DEVICE)
    lengths = torch.randint(0, 40, (batch,), generator=gen).to(DEVICE)
    base, max_len = torch.arange(batch, device=DEVICE) * 41, 40
    got_lengths, want_lengths = lengths.clone(), lengths.clone()
    got = compact_rows(chosen, width, got_lengths, base, max_len)
    want = compact_rows_reference(chosen, width, want_lengths, base, max_len)
    for name, a, b in zip(("rows", "keep", "write_at", "used"), got, want):
        assert a.dtype == b.dtype and torch.equal(a, b), name
    rows, keep, write_at, used = got
    assert rows.dtype == torch.int64 and keep.dtype == torch.bool
    assert int(keep.sum()) == min(count, width) and torch.equal(keep, chosen[rows])
    assert torch.equal(got_lengths, want_lengths)
    assert int((got_lengths - lengths).sum()) == min(count, width) and torch.equal(got_lengths[rows], lengths[rows] + keep)
    assert torch.equal(write_at, base[rows] + torch.where(keep, lengths[rows], max_len))
    assert torch.equal(used, torch.where(keep, lengths[rows] + 1, 1))
    with pytest.raises(ValueError, match="width 0"):
        compact_rows(chosen, 0, lengths, base, max_len)


@pytest.mark.parametrize("x_dtype, dtype", [(torch.bfloat16, torch.bfloat16), (torch.float32, torch.bfloat16),
                                            (torch.float32, torch.float32)])
@pytest.mark.parametrize("some_kept", [True, False])
def test_put_gated_rows_equals_the_pytorch_ops(x_dtype: torch.dtype, dtype: torch.dtype, some_kept: bool) -> None:
    """A compacted decode step's routed update in one kernel (rows.put_gated_rows_) equals
    RowPlan.add_gated's PyTorch ops bit for bit: x[ids] + round(gate * round(a + b)) where
    kept; padding rows and rows not listed untouched. keep None (a prefill's packed tokens):
    every listed row."""
    from mode.kernels.rows import put_gated_rows_

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(9, 300, generator=gen).to(DEVICE, x_dtype)
    ids = torch.tensor([0, 2, 3, 5, 8], device=DEVICE)
    keep = torch.tensor([True, False, True, True, False] if some_kept else [True] * 5, device=DEVICE)
    a, b = (torch.randn(5, 300, generator=gen).to(DEVICE, dtype) for _ in range(2))
    gates = torch.rand(5, generator=gen).to(DEVICE)
    update = a + b
    torch.mul(update, gates.unsqueeze(-1), out=update)
    want = x.clone()
    want[ids[keep]] = x[ids[keep]] + update[keep].to(x_dtype)
    got = x.clone()
    put_gated_rows_(got, ids, keep if some_kept else None, a, b, gates)
    assert torch.equal(got, want)
    with pytest.raises(ValueError, match="a is"):
        put_gated_rows_(got, ids, keep, a, b.float() if dtype != torch.float32 else b.bfloat16(), gates)


@pytest.mark.parametrize("score_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gate", ["identity", "sigmoid"])
@pytest.mark.parametrize("by_id", [True, False])
def test_put_gated_rows_gates_a_router_score_per_row(gate: str, by_id: bool, score_dtype: torch.dtype) -> None:
    """put_gated_rows_ with a gate function: each row's gate is g of the router score of the row of x
    it updates (scores one per row of x), as apply_gate(scores[ids]) before the kernel, in the
    scores' dtype: bit for bit with the identity, to the scores' rounding with the sigmoid (Triton's
    may differ in the last bit); ids None: row r of x itself, keep marking the rows updated (a
    masked decode step)."""
    from mode.kernels.rows import put_gated_rows_
    from mode.routing import apply_gate

    gen = torch.Generator().manual_seed(8)
    x = torch.randn(9, 300, generator=gen).to(DEVICE)
    ids = torch.tensor([0, 2, 3, 5, 8], device=DEVICE) if by_id else None
    rows = ids if by_id else torch.arange(9, device=DEVICE)
    keep = torch.rand(rows.shape[0], generator=gen).to(DEVICE) < 0.6
    a, b = (torch.randn(rows.shape[0], 300, generator=gen).to(DEVICE) for _ in range(2))
    scores = torch.randn(9, generator=gen).to(DEVICE, score_dtype)
    want, got = x.clone(), x.clone()
    put_gated_rows_(want, rows, keep, a, b, apply_gate(scores[rows], gate))
    put_gated_rows_(got, ids, keep, a, b, scores, gate)
    if gate == "identity":
        assert torch.equal(got, want)
    else:  # one unit in the last place of the scores' dtype at most
        tol = 1e-6 if score_dtype == torch.float32 else 2 ** -8
        torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert torch.equal(got[rows[~keep]], x[rows[~keep]]) and not torch.equal(got, x)
    with pytest.raises(ValueError, match="unknown gate"):
        put_gated_rows_(got, ids, keep, a, b, scores, "relu")


@pytest.mark.parametrize("x_dtype, b_dtype", [(torch.float32, torch.bfloat16), (torch.float32, torch.float32),
                                              (torch.bfloat16, torch.bfloat16)])
def test_put_sum_equals_the_where_of_the_sum(x_dtype: torch.dtype, b_dtype: torch.dtype) -> None:
    """A static decode step's layer output in one kernel (rows.put_sum) equals torch.where(keep,
    h + b, x) bit for bit (a float32 stream plus a bf16 FFN output, or one dtype), x's shape kept;
    dtypes it does not take are refused."""
    from mode.kernels.rows import put_sum, put_sum_applies

    gen = torch.Generator().manual_seed(9)
    x, h = (torch.randn(7, 1, 300, generator=gen).to(DEVICE, x_dtype) for _ in range(2))
    b = torch.randn(7, 1, 300, generator=gen).to(DEVICE, b_dtype)
    keep = torch.tensor([True, False, True, True, False, False, True], device=DEVICE)
    got = put_sum(x, h, b, keep)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert torch.equal(got, torch.where(keep.view(-1, 1, 1), h + b, x))
    assert not put_sum_applies(x.bfloat16(), h.bfloat16(), b.float(), keep)  # h + b would be float32
    with pytest.raises(ValueError, match="put_sum_applies"):
        put_sum(x, h, b, keep[:3])


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("qkv_dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads, kv_heads, head_dim", [(4, 2, 8), (3, 3, 16)])
@pytest.mark.parametrize("compacted", [False, True])
def test_rotate_write_equals_the_rotation_slots_and_index_copy(compacted: bool, heads: int, kv_heads: int,
                                                              head_dim: int, qkv_dtype: torch.dtype,
                                                              cache_dtype: torch.dtype) -> None:
    """A static step's attention input in one kernel (mode/kernels/step_cache.py) equals the PyTorch
    path bit for bit (rotate_, then written_slots, lengths.add_ and write_packed, mode/layers/chunks.py):
    q and k rotated (q into its own tensor, qkv untouched), the kept rows' keys and values at their
    lengths and the others' at their scratch slots, in the cache's dtype; the slots attended; the
    grown lengths. compacted: W of the batch's rows, their angles read by row and their slots given."""
    from mode.kernels.step_cache import rotate_write_every_row, rotate_write_rows
    from mode.layers.chunks import write_packed, written_slots
    from mode.layers.kv_cache import LayerCache
    from mode.layers.rotary import RotaryAngles, RotaryEmbedding, rotate_

    gen = torch.Generator().manual_seed(10)
    batch, max_len = 6, 12
    rotary = RotaryEmbedding(head_dim, 64, 10000.0)
    positions = torch.randint(0, 64, (batch,), generator=gen)
    cos, sin = (t.float()[positions].view(batch, 1, 1, head_dim).to(DEVICE) for t in (rotary.cos_full, rotary.sin_signed))
    keep = torch.tensor([True, False, True, True, False, True], device=DEVICE)
    lengths = torch.randint(0, max_len, (batch,), generator=gen).to(DEVICE)
    base = torch.arange(batch, device=DEVICE) * (max_len + 1)
    rows = torch.tensor([1, 2, 4], device=DEVICE) if compacted else torch.arange(batch, device=DEVICE)
    n = rows.shape[0]
    qkv = torch.randn(n, 1, heads + 2 * kv_heads, head_dim, generator=gen).to(DEVICE, qkv_dtype)  # (n, 1, H + 2Hkv, hd)
    caches = []
    for _ in range(2):
        cache = LayerCache.empty(batch, max_len, kv_heads, head_dim, cache_dtype, torch.device(DEVICE))
        cache.kv.copy_(torch.randn(cache.kv.shape, generator=gen).to(DEVICE, cache_dtype))
        cache.lengths_dev = lengths.clone()
        caches.append(cache)
    caches[1].kv.copy_(caches[0].kv)
    # the PyTorch path, on a copy of qkv
    want = qkv.clone()
    rotate_(want[:, :, : heads + kv_heads], RotaryAngles(cos[rows], sin[rows]))
    write_at, want_used = written_slots(keep[rows], caches[1].lengths_dev[rows], base[rows], max_len)
    if not compacted:
        caches[1].lengths_dev.add_(keep)
    write_packed(caches[1], write_at, want[:, 0, heads:].unflatten(1, (2, kv_heads)).transpose(0, 1))
    before = qkv.clone()
    if compacted:
        q = rotate_write_rows(qkv, heads, cos, sin, caches[0].kv, rows, write_at)
    else:
        q, used = rotate_write_every_row(qkv, heads, cos, sin, caches[0].kv, keep, caches[0].lengths_dev, base)
        assert used.dtype == torch.int64 and torch.equal(used, want_used)
        with pytest.raises(ValueError, match="lengths"):
            rotate_write_every_row(qkv, heads, cos, sin, caches[0].kv, keep, caches[0].lengths_dev.int(), base)
    assert q.shape == (n, heads, head_dim) and q.is_contiguous() and torch.equal(q, want[:, 0, :heads])
    assert torch.equal(qkv, before)
    assert torch.equal(caches[0].lengths_dev, caches[1].lengths_dev)
    assert torch.equal(caches[0].kv, caches[1].kv)
    assert not torch.equal(caches[0].kv, caches[0].kv.new_zeros(()).expand_as(caches[0].kv))


@pytest.mark.parametrize("rows", [9, 40, 100])  # one 16-row tile or several an expert; 64-row tiles
def test_grouped_rows_mm_equals_each_experts_product(rows: int) -> None:
    """The decode step's grouped GEMM (grouped_mm.grouped_rows_mm): each expert's rows times its
    weights, float32 sums rounded once (bf16), experts without rows and rows past the last end
    left alone; an expert with more rows than a tile takes several."""
    from mode.kernels.grouped_mm import grouped_rows_mm

    gen = torch.Generator().manual_seed(8)
    depth, width, experts = 48, 40, 5
    x = torch.randn(rows, depth, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(experts, depth, width, generator=gen) / depth ** 0.5).to(DEVICE, torch.bfloat16)
    counts = [rows // 4, 0, rows // 2, rows // 8, 0]  # experts 1 and 4 without rows; the rest past the end
    ends = torch.tensor(counts, device=DEVICE).cumsum(0).to(torch.int32)
    got = grouped_rows_mm(x, w, ends)
    start = 0
    for e, end in enumerate(ends.tolist()):
        want = (x[start:end].float() @ w[e].float()).to(torch.bfloat16)
        torch.testing.assert_close(got[start:end], want, rtol=1e-2, atol=1e-2)
        start = end
    assert got.shape == (rows, width) and got.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="bf16 / fp16"):
        grouped_rows_mm(x.float(), w.float(), ends)
    with pytest.raises(ValueError, match="do not fit"):
        grouped_rows_mm(x, w[:, :-1], ends)


@torch.no_grad()
def test_a_decode_steps_experts_run_the_grouped_kernel_and_equal_torch_grouped_mm() -> None:
    """Experts.by_ends over a decode step's few bf16 rows, no gradient: mode's grouped kernel for
    both products, equal to torch._grouped_mm's within bf16 rounding on the computed rows; with a
    gradient to compute, or more than FEW_ROWS rows, torch._grouped_mm runs."""
    from mode.kernels import KernelPolicy, use_kernels
    from mode.layers.experts import FEW_ROWS, Experts

    experts = Experts(4, 32, 48, "swiglu").to(DEVICE, torch.bfloat16)
    gen = torch.Generator().manual_seed(9)
    xs = torch.randn(20, 32, generator=gen).to(DEVICE, torch.bfloat16)
    ends = torch.tensor([5, 5, 12, 17], device=DEVICE, dtype=torch.int32)
    with use_kernels(KernelPolicy(cpu=True)):
        assert experts.few_rows_kernel_applies(xs, torch.bfloat16)
        fast = experts.by_ends(xs, ends, on_device=True)
        assert not experts.few_rows_kernel_applies(xs.new_empty(FEW_ROWS + 1, 32), torch.bfloat16)
        with torch.enable_grad():
            assert not experts.few_rows_kernel_applies(xs, torch.bfloat16)
    with use_kernels(KernelPolicy(enabled=False)):
        assert not experts.few_rows_kernel_applies(xs, torch.bfloat16)
        plain = experts.by_ends(xs, ends, on_device=True)
    torch.testing.assert_close(fast[:17], plain[:17], rtol=2e-2, atol=2e-2)


def test_the_library_imports_and_decodes_without_triton() -> None:
    """Triton is a test extra on CPU: `import mode` and a decode must not need it (the kernels are
    imported where the policy picks them, never at module import)."""
    import subprocess
    import sys

    program = """
import importlib.abc, sys
class NoTriton(importlib.abc.MetaPathFinder):  # finds every module but triton, as if it were not installed
    def __init__(self, finders):
        self.finders = finders
    def find_spec(self, name, path, target=None):
        if name == "triton" or name.startswith("triton."):
            return None
        specs = (f.find_spec(name, path, target) for f in self.finders if hasattr(f, "find_spec"))
        return next((spec for spec in specs if spec is not None), None)
sys.meta_path[:] = [NoTriton(list(sys.meta_path))]
import torch
from mode.kernels import KernelPolicy, use_kernels
from tests.test_generate import make_model
from mode.generate import Decoder
with use_kernels(KernelPolicy(cpu=True)):
    decoder = Decoder(make_model("mod", "aux_loss").float(), 2, 16, routed_rows="masked")
    decoder.prefill([[1, 2, 3], [4, 5]])
    print(decoder.step(torch.tensor([6, 7])).shape)
"""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", program], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("torch.Size([2, 256])")


def _reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


@pytest.mark.parametrize("shape", [(2, 7, 48), (300, 1024), (3, 8192)], ids=["masked lanes", "model width", "widest"])
def test_rms_norm_kernel_matches_float64(shape: tuple[int, ...]) -> None:
    """mode/kernels/rms_norm.py: float32 x into a bf16 y, one rounding from float64's values; dx in
    float32 and the weight's gradient (summed over the programs' partial sums) at float32 rounding."""
    from mode.kernels.rms_norm import rms_norm

    x = torch.randn(shape, device=DEVICE) * 3
    weight = 1 + 0.1 * torch.randn(shape[-1], device=DEVICE)
    probe = torch.randn(shape, device=DEVICE).bfloat16().float()  # the incoming gradient, as bf16 values
    want, (want_dx, want_dw) = _grads(lambda a, w: _reference_rms_norm(a, w, 1e-6), (x.double(), weight.double()), (probe,))
    got, (got_dx, got_dw) = _grads(lambda a, w: rms_norm(a, w, 1e-6, torch.bfloat16), (x, weight), (probe,))
    assert got[0].dtype == torch.bfloat16 and got_dx.dtype == torch.float32 and got_dw.dtype == torch.float32
    torch.testing.assert_close(got[0].double(), want[0], **ONE_BF16_ROUNDING)
    torch.testing.assert_close(got_dx.double(), want_dx, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_dw.double(), want_dw, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("to_autocast", [True, False], ids=["feeds matmuls", "feeds a float32 router"])
def test_rms_norm_module_under_autocast_equals_the_float32_norm_then_its_cast(to_autocast: bool) -> None:
    """mode.layers.norm.RMSNorm under bf16 autocast: with to_autocast the kernel's bf16 output and
    gradients equal nn.RMSNorm's float32 norm followed by the cast a matmul makes (float32 rounding
    apart); without it (and outside autocast, or with the op off) nn.RMSNorm's float32 output."""
    from mode.layers.norm import RMSNorm

    torch.manual_seed(0)
    norm = RMSNorm(40, eps=1e-5, to_autocast=to_autocast).to(DEVICE)
    reference = torch.nn.RMSNorm(40, eps=1e-5).to(DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        reference.weight.copy_(norm.weight)
    x = torch.randn(3, 5, 40, device=DEVICE)
    probe = torch.randn(3, 5, 40, device=DEVICE).bfloat16().float()
    kernels_on()
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        got, (got_dx, got_dw) = _grads(lambda a, w: torch.func.functional_call(norm, {"weight": w}, (a,)),
                                       (x, norm.weight), (probe,))
        want, (want_dx, want_dw) = _grads(
            lambda a, w: torch.func.functional_call(reference, {"weight": w}, (a,)).to(torch.bfloat16),
            (x, norm.weight), (probe,))
    assert got[0].dtype == (torch.bfloat16 if to_autocast else torch.float32)
    torch.testing.assert_close(got[0].to(torch.bfloat16).float(), want[0].float(), rtol=2**-8, atol=0)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-4, atol=1e-6)
    torch.testing.assert_close(got_dw, want_dw, rtol=1e-4, atol=1e-5)
    with torch.autocast(DEVICE, dtype=torch.bfloat16), use_kernels(norm=False):
        assert norm(x).dtype == torch.float32
    assert norm(x).dtype == torch.float32  # no autocast: nothing to fuse


def test_rms_norm_kernel_only_where_it_applies() -> None:
    """Rows wider than the kernel's registers, and norms without a weight, take PyTorch's norm."""
    from mode.kernels.rms_norm import MAX_WIDTH, rms_norm_applies

    weight = torch.ones(MAX_WIDTH + 1)
    assert not rms_norm_applies(torch.zeros(2, MAX_WIDTH + 1), weight)
    assert not rms_norm_applies(torch.zeros(2, 8), None)
    assert rms_norm_applies(torch.zeros(2, MAX_WIDTH), weight[:MAX_WIDTH])


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_models_under_bf16_autocast_train_the_same_with_the_fused_norm(path: Path) -> None:
    """Every block kind under bf16 autocast, the norms fused with their cast (mode/kernels/rms_norm.py)
    or not: the same loss (the norms' bf16 outputs are the same roundings), and gradients within
    bf16 rounding of each other (the kernel's float32 input gradient differs in its last bits, and
    the bf16 matmuls before it round that differently now and then)."""
    runs = _one_step_both_ways(path, lambda fused: kernels_on(norm=fused), autocast=True)
    torch.testing.assert_close(runs[True][0], runs[False][0], rtol=1e-5, atol=1e-6)
    assert runs[True][1].keys() == runs[False][1].keys()
    for name, grad in runs[True][1].items():
        want = runs[False][1][name]
        scale = want.abs().max().item()
        torch.testing.assert_close(grad, want, rtol=0, atol=1e-2 * scale + 1e-12, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("h_used", [True, False], ids=["h feeds the residual", "only the norm reads h"])
def test_add_rms_norm_kernel_matches_float64(h_used: bool) -> None:
    """The residual add fused into the norm: h = x + a exactly as PyTorch adds (float32), y one bf16
    rounding from float64's; x's gradient (h's own plus the norm's) at float32 rounding and a's the
    same rounded once to bf16; the weight's from the programs' partial sums."""
    from mode.kernels.rms_norm import add_rms_norm

    shape = (5, 9, 48)
    x = torch.randn(shape, device=DEVICE) * 3
    a = torch.randn(shape, device=DEVICE).bfloat16()
    weight = 1 + 0.1 * torch.randn(shape[-1], device=DEVICE)
    probes = tuple(torch.randn(shape, device=DEVICE).bfloat16().float() * (1 if h_used else 0) ** i for i in (0, 1))

    def reference(x_, a_, w_):
        h = x_ + a_
        return h, _reference_rms_norm(h, w_, 1e-6)

    want, want_grads = _grads(reference, (x.double(), a.double(), weight.double()), probes[::-1])
    got, got_grads = _grads(lambda x_, a_, w_: add_rms_norm(x_, a_, w_, 1e-6, torch.bfloat16), (x, a, weight), probes[::-1])
    assert torch.equal(got[0], x + a)  # the add itself: bit for bit
    torch.testing.assert_close(got[1].double(), want[1], **ONE_BF16_ROUNDING)
    torch.testing.assert_close(got_grads[0].double(), want_grads[0], rtol=1e-4, atol=1e-5)
    assert got_grads[1].dtype == torch.bfloat16
    torch.testing.assert_close(got_grads[1].double(), want_grads[1], **ONE_BF16_ROUNDING)
    torch.testing.assert_close(got_grads[2].double(), want_grads[2], rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="float32 x"):
        add_rms_norm(x.bfloat16(), a, weight, 1e-6, torch.bfloat16)


def test_gather_rows_as_equals_index_select_then_the_cast() -> None:
    """mode/kernels/rows.py gather_rows_as: x[ids] in bf16 bit for bit as index_select then .to(bf16)."""
    from mode.kernels.rows import gather_rows_as

    x = torch.randn(37, 600, device=DEVICE) * 10
    ids = torch.randint(0, 37, (51,), device=DEVICE)
    assert torch.equal(gather_rows_as(x, ids, torch.bfloat16), x.index_select(0, ids).to(torch.bfloat16))


@pytest.mark.parametrize("scheme", ["expert_choice", "token_choice"])
def test_moe_rows_gathered_in_the_autocast_dtype_change_nothing(scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under bf16 autocast the experts' rows of the float32 stream are gathered straight into bf16
    (routing.expert_rows.rows_dtype): the MoE FFN's output and every gradient are those of gathering
    float32 rows that the expert matmuls then cast, bit for bit."""
    from mode.config import MoEConfig
    from mode.layers.moe import MoEFFN
    from mode.routing import expert_choice, expert_rows

    kernels_on()
    torch.manual_seed(0)
    cfg = MoEConfig(n_experts=4, scheme=scheme, top_k=2 if scheme == "token_choice" else 1, capacity_factor=1.0,
                    activation="swiglu")
    ffn = MoEFFN(32, 48, cfg).to(DEVICE)
    x = torch.randn(2, 16, 32, device=DEVICE)
    probe = torch.randn(2, 16, 32, device=DEVICE).bfloat16().float()
    runs = []
    for fused in (True, False):
        if not fused:  # rows in x's dtype, cast by the experts' matmuls
            monkeypatch.setattr(expert_rows, "rows_dtype", lambda t: t.dtype)
            monkeypatch.setattr(expert_choice, "rows_dtype", lambda t: t.dtype)
        ffn.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            out, _ = ffn(xi)
        (out.float() * probe).sum().backward()
        runs.append((out.detach(), xi.grad, {n: p.grad.clone() for n, p in ffn.named_parameters() if p.grad is not None}))
    assert torch.equal(runs[0][0], runs[1][0]) and torch.equal(runs[0][1], runs[1][1])
    for name, grad in runs[0][2].items():
        assert torch.equal(grad, runs[1][2][name]), name


@pytest.mark.parametrize("copy, constants, tokens", [(True, 0, 7), (False, 3, 7), (True, 2, 7), (False, 3, 150),
                                                     (True, 2, 150), (False, 65, 7)],
                         ids=["copy slots", "constant slots", "both", "constant slots, 150 tokens",
                              "both, 150 tokens", "more constants than weighted_row_sums takes"])
def test_null_add_equals_the_pytorch_ops(copy: bool, constants: int, tokens: int) -> None:
    """out (bf16) + s * x + g @ v in one kernel: within one bf16 rounding of the float32 sum; every
    gradient (out's passed through, x's in x's dtype, s's, g's and v's in float32) to float32
    rounding (atol 1e-4: s's and g's sum 1500 products). Seven tokens (a partial tile) or 150 (the
    row pass's tiles of 64 rows, the last partial; v's gradient summed over groups of 32 rows, five
    here), width 1500 (over one block)."""
    from mode.kernels.null_experts import BACKWARD_BLOCK_T, null_add
    from mode.kernels.weighted_sums import BLOCK_T as SUMS_BLOCK_T

    assert tokens < BACKWARD_BLOCK_T or (tokens > 2 * BACKWARD_BLOCK_T and tokens % SUMS_BLOCK_T)
    gen = torch.Generator().manual_seed(4)
    width = 1500
    out = torch.randn(tokens, width, generator=gen).to(torch.bfloat16).to(DEVICE)
    x = torch.randn(tokens, width, generator=gen).to(DEVICE)
    scale = torch.rand(tokens, generator=gen).to(DEVICE) if copy else None
    gates = torch.rand(tokens, constants, generator=gen).to(DEVICE) if constants else None
    v = torch.randn(constants, width, generator=gen).to(DEVICE) if constants else None
    inputs = tuple(t for t in (out, x, scale, gates, v) if t is not None)

    def split(args):
        it = iter(args)
        return next(it), next(it), next(it) if copy else None, next(it) if constants else None, \
            next(it) if constants else None

    def reference(*args):
        o, xx, s, g, vv = split(args)
        total = o.float() + (s[:, None] * xx if copy else 0.0) + (g @ vv if constants else 0.0)
        return total + 0.0 * xx.sum()  # x takes part, as in the layer (constant slots alone: a zero gradient)

    def kernel(*args):
        o, xx, s, g, vv = split(args)
        return null_add(o, xx, s, g, vv) + 0.0 * xx.sum()

    probe = torch.randn(tokens, width, generator=gen).to(torch.bfloat16).float().to(DEVICE)
    want, want_grads = _grads(reference, inputs, (probe,))
    kernels_on()
    got, got_grads = _grads(kernel, inputs, (probe,))
    assert got[0].dtype == torch.bfloat16  # out's
    torch.testing.assert_close(got[0].float(), want[0], **ONE_BF16_ROUNDING)
    assert torch.equal(got_grads[0], want_grads[0])  # out's gradient passes through
    for g, w in zip(got_grads[1:], want_grads[1:], strict=True):  # s's and g's: sums of 1500 products, in another order
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("tokens, n_weights, width, dtype", [
    (7, 3, 100, torch.float32), (150, 16, 1500, torch.bfloat16), (5000, 40, 70, torch.float32)],
    ids=["one partial group", "five groups, bf16 rows, width over a block", "53 groups, 40 weights"])
def test_weighted_row_sums_equal_the_float32_product(tokens: int, n_weights: int, width: int,
                                                      dtype: torch.dtype) -> None:
    """w (T, C)^T @ rows (T, D) in float32, in groups of rows added after: equal to the float32
    product (float64 here) to float32 rounding of sums over up to 5000 rows; the same twice."""
    from mode.kernels.weighted_sums import MAX_WEIGHTS, weighted_row_sums

    gen = torch.Generator().manual_seed(5)
    weights = torch.randn(tokens, n_weights, generator=gen).to(DEVICE)
    rows = torch.randn(tokens, width, generator=gen).to(dtype).to(DEVICE)
    want = (weights.double().t() @ rows.double()).float()
    got = weighted_row_sums(weights, rows)
    assert got.dtype == torch.float32 and got.shape == (n_weights, width)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * tokens ** 0.5)
    assert torch.equal(weighted_row_sums(weights, rows), got)
    with pytest.raises(ValueError, match="weighted_row_sums"):
        weighted_row_sums(torch.zeros(tokens, MAX_WEIGHTS + 1, device=DEVICE), rows)


def test_float32_weighted_row_sums_stay_float32_under_autocast() -> None:
    """Past MAX_WEIGHTS weights a row the float32 product runs instead of the kernel: inside an
    autocast region (a backward called within the forward's, as the CUDA-graphed pass does) it
    stays a float32 product, not autocast's bf16 matmul."""
    from mode.kernels.weighted_sums import MAX_WEIGHTS, float32_weighted_row_sums

    gen = torch.Generator().manual_seed(6)
    weights = torch.randn(50, MAX_WEIGHTS + 1, generator=gen)
    rows = torch.randn(50, 96, generator=gen)
    want = (weights.double().t() @ rows.double()).float()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = float32_weighted_row_sums(weights, rows)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kinds", [["copy"] * 2, ["constant"] * 2, ["zero", "copy", "constant"]])
@pytest.mark.parametrize("scheme", ["expert_choice", "token_choice"])
def test_null_experts_through_the_kernel_equal_the_pytorch_ops(scheme: str, kinds: list[str], monkeypatch) -> None:
    """An MoE FFN with copy and constant slots (float32): its output and every parameter's and the
    input's gradient through null_add equal the PyTorch ops' to float32 rounding."""
    from mode.config import MoEConfig
    from mode.kernels import null_experts
    from mode.layers.moe import MoEFFN

    calls = []
    kernel = null_experts.null_add
    monkeypatch.setattr(null_experts, "null_add", lambda *args: calls.append(1) or kernel(*args))

    torch.manual_seed(0)
    moe = MoEConfig(n_experts=4, n_noop=len(kinds), noop_kind=kinds, scheme=scheme, capacity_factor=1.5,
                    **({"top_k": 2} if scheme == "token_choice" else {}))
    ffn = MoEFFN(24, 32, moe).to(DEVICE)
    if ffn.null_experts.constants is not None:
        with torch.no_grad():
            ffn.null_experts.constants.normal_()
    x = torch.randn(2, 16, 24, device=DEVICE)
    probe = torch.randn(2, 16, 24, device=DEVICE)
    runs = []
    for on in (False, True):
        kernels_on(on)
        ffn.zero_grad()
        xx = x.clone().requires_grad_()
        out, _ = ffn(xx)
        (out * probe).sum().backward()
        runs.append((out.detach(), xx.grad, {n: p.grad.clone() for n, p in ffn.named_parameters() if p.grad is not None}))
    (want, want_x, want_params), (got, got_x, got_params) = runs
    assert len(calls) == 1  # the kernels' pass alone
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-6)
    assert got_params.keys() == want_params.keys()
    for name, grad in want_params.items():
        torch.testing.assert_close(got_params[name], grad, rtol=1e-4, atol=1e-6, msg=name)
