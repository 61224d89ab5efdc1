"""train.attention_backend: the SDPA kernel of the training forward, chosen per attention layer.

On CPU, PyTorch runs math and its CPU flash kernel (auto picks flash); efficient and cudnn need
CUDA and are refused at start-up, naming the field and the device.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from mode.config import ConfigError, config_from_dict
from mode.flops import model_flops
from mode.layers.attention import (
    ATTENTION_BACKENDS,
    CausalSelfAttention,
    attention_backend_problem,
    set_attention_backend,
)
from mode.layers.rotary import RotaryEmbedding
from mode.model import LanguageModel
from mode.training.trainer import Trainer, use_attention_backend

# Math and the CPU flash kernel sum in different orders (float32): the loss and gradients agree to
# rounding, not bit for bit.
LOSS_ATOL = 1e-5
GRAD_ATOL = 1e-5
CPU_KERNELS = ("auto", "math", "flash")
CUDA_ONLY = ("efficient", "cudnn")
FLASH_CPU_OP = "aten._scaled_dot_product_flash_attention_for_cpu.default"


def tiny_config(attention_backend: str = "auto", **train):
    return config_from_dict({
        "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 32,
                  "block_pattern": ["dense", "mod"]},
        "routing": {"capacity": 0.25},
        "data": {"seq_len": 32},
        "train": {"device": "cpu", "attention_backend": attention_backend, **train},
    })


def loss_and_grads(backend: str) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    config = tiny_config(backend)
    model = LanguageModel(config)
    assert set_attention_backend(model, backend) == 2
    tokens = torch.randint(0, config.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(1))
    loss = model(tokens[:, :-1], tokens[:, 1:]).loss
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


class AttentionOps(TorchDispatchMode):
    """The names of the attention ops dispatched inside it."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "attention" in str(func):
            self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_backends_give_the_same_loss_and_gradients() -> None:
    """A dense and an MoD block (attention over the chosen tokens): every kernel CPU runs agrees."""
    ref_loss, ref_grads = loss_and_grads("math")
    for backend in ("auto", "flash"):
        loss, grads = loss_and_grads(backend)
        assert loss == pytest.approx(ref_loss, abs=LOSS_ATOL), backend
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], atol=GRAD_ATOL, rtol=0, msg=f"{backend}: {name}")


@pytest.mark.parametrize("backend, flash", [("auto", True), ("flash", True), ("math", False)])
def test_the_named_kernel_runs(backend: str, flash: bool) -> None:
    """The choice reaches the kernel: math runs no flash op, where auto (on CPU) and flash do."""
    attn = CausalSelfAttention(32, 2, backend=backend)
    angles = RotaryEmbedding(16, 8, 10000.0).prefix(8)
    with AttentionOps() as seen:
        attn(torch.randn(2, 8, 32), angles)  # (B, S, D)
    assert (FLASH_CPU_OP in seen.ops) == flash, seen.ops


def test_bad_backend_is_a_config_error_naming_the_field() -> None:
    with pytest.raises(ConfigError, match=r"train\.attention_backend: .*'auto'.*'cudnn'"):
        tiny_config("fast")
    with pytest.raises(ValueError, match="unknown attention backend 'fast'"):
        CausalSelfAttention(32, 2, backend="fast")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU refusals")
@pytest.mark.parametrize("backend", CUDA_ONLY)
def test_cuda_only_kernel_on_cpu_is_refused_at_start(tmp_path: Path, backend: str) -> None:
    """Asked for on CPU, efficient and cudnn stop the run before it starts, naming the field and device."""
    config = tiny_config(backend, out_dir=str(tmp_path / "run"))
    model = LanguageModel(config)
    with pytest.raises(ConfigError, match=rf"^train\.attention_backend={backend}: the {backend} kernel needs a CUDA "
                                          r"device \(this run computes on cpu\)$"):
        use_attention_backend(config, model, torch.device("cpu"))
    with pytest.raises(ConfigError, match=rf"train\.attention_backend={backend}"):
        Trainer(config)
    assert not (tmp_path / "run").exists()  # refused before the run folder is touched


def test_trainer_sets_every_attention_layer(tmp_path: Path) -> None:
    trainer = Trainer(tiny_config("math", out_dir=str(tmp_path / "run"), max_steps=1))
    try:
        layers = [m for m in trainer.model.modules() if isinstance(m, CausalSelfAttention)]
        assert len(layers) == 2 and all(m.backend is ATTENTION_BACKENDS["math"] for m in layers)
    finally:
        trainer.close()


def test_problem_is_none_where_the_kernel_runs() -> None:
    """...and the probe leaves the random generator as it was (a run's random routing draws from it)."""
    state = torch.get_rng_state()
    for backend in CPU_KERNELS:
        assert attention_backend_problem(backend, torch.device("cpu"), 16, torch.float32) is None
    assert torch.equal(torch.get_rng_state(), state)


@pytest.mark.parametrize("backend", ["auto", "math"])
def test_compiled_forward_traces_the_choice(backend: str) -> None:
    """torch.compile traces the kernel choice inside the forward (fullgraph: no graph break)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    config = tiny_config()
    model = LanguageModel(config)
    tokens = torch.randint(0, config.model.vocab_size, (2, 33))
    set_attention_backend(model, backend)
    eager = model(tokens[:, :-1], tokens[:, 1:]).loss
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    torch.testing.assert_close(compiled(tokens[:, :-1], tokens[:, 1:]).loss, eager)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("backend", ["flash", "cudnn", "efficient"])
def test_cuda_kernels_match_math(backend: str) -> None:
    """bf16 on a GPU: each fused kernel's loss and gradients against math's, to bf16 rounding."""
    device = torch.device("cuda")
    if attention_backend_problem(backend, device, 16, torch.bfloat16) is not None:
        pytest.skip(f"{backend} does not run on this GPU")
    results = {}
    for name in ("math", backend):
        torch.manual_seed(0)
        config = tiny_config(name)
        model = LanguageModel(config).to(device)
        set_attention_backend(model, name)
        tokens = torch.randint(0, config.model.vocab_size, (2, 33), device=device,
                               generator=torch.Generator(device).manual_seed(1))
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(tokens[:, :-1], tokens[:, 1:]).loss
        loss.backward()
        results[name] = loss.item(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    (ref_loss, ref_grads), (loss, grads) = results["math"], results[backend]
    assert loss == pytest.approx(ref_loss, abs=2e-2)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, ref_grads[name], atol=2e-2, rtol=5e-2, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_kernel_that_cannot_run_the_shape_is_named() -> None:
    """Flash attention takes heads up to 256 wide: a wider one is refused with PyTorch's reason."""
    problem = attention_backend_problem("flash", torch.device("cuda"), 512, torch.bfloat16)
    assert problem is not None and problem.startswith("the flash kernel cannot run on cuda (bfloat16, head width 512): ")


def test_a_resumed_run_may_change_the_kernel() -> None:
    """How attention is computed, not what the run learns: a resume may switch it, as it may compile."""
    from mode.checkpoint import may_change_on_resume

    assert may_change_on_resume("train.attention_backend")


def table_rows(text: str) -> list[list[str]]:
    """The rows of a markdown table printed by a benchmark, header and separators left out."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines() if line.startswith("| ")]
    return rows[2:]


def mod_step_args() -> argparse.Namespace:
    """--tiny's shape, as bench/mod_step.py sets it."""
    return argparse.Namespace(batch=2, seq=128, width=64, heads=4, layers=4, ffn=128, vocab=256, capacity=0.125)


def test_mod_step_compares_attention_kernels(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/mod_step.py --attention-backend: both models timed once per kernel (CPU: eager only),
    each row naming its kernel and its training TFLOP/s over the step and back-to-back times."""
    from bench import mod_step

    mod_step.main(["--tiny", "--modes", "eager", "--attention-backend", "math", "flash"])
    out = capsys.readouterr().out
    assert "| attention | TFLOP/s (step, back to back) |" in out
    rows = table_rows(out)
    assert [(r[0], r[1], r[10]) for r in rows] == [("eager", model, kernel) for kernel in ("math", "flash")
                                                   for model in ("dense", "MoD")]
    for row in rows:
        step, back_to_back = (float(v) for v in row[11].split(", "))
        assert step > 0 and back_to_back > 0
    # the dense row's TFLOP/s is mode.flops's training FLOPs of a step over its step time
    args, dense_step_ms = mod_step_args(), float(rows[0][3])
    flops = model_flops(mod_step.make_config(["dense"], args)).train_per_token * args.batch * args.seq
    assert float(rows[0][11].split(", ")[0]) == pytest.approx(flops / (dense_step_ms * 1e-3) / 1e12, rel=1e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU refusal")
def test_mod_step_refuses_a_kernel_that_cannot_run(capsys: pytest.CaptureFixture[str]) -> None:
    from bench import mod_step

    with pytest.raises(SystemExit) as stop:
        mod_step.main(["--tiny", "--attention-backend", "auto", "cudnn"])
    assert stop.value.code == 2
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith("error: --attention-backend cudnn: the cudnn kernel needs a CUDA device (this run computes on cpu)")


def test_mod_step_steps_as_mode_train(capsys: pytest.CaptureFixture[str]) -> None:
    """--optimizer train: the step is mode.train's (TorchOptimization), said in the header."""
    from bench import mod_step

    mod_step.main(["--tiny", "--modes", "eager", "--optimizer", "train"])
    out = capsys.readouterr().out
    assert "the step's update: mode.train's (AdamW, decay on matrices, gradients clipped at norm 1.0)" in out
    rows = table_rows(out)
    assert [(r[0], r[1], r[10]) for r in rows] == [("eager", "dense", "auto"), ("eager", "MoD", "auto")]
    assert all(float(r[3]) > 0 and float(r[4]) > 0 for r in rows)  # step and back-to-back ms
