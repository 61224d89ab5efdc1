"""The bf16 weights' update deferred into the next training forward (mode/training/deferred_update.py)
leaves the run as the immediate update does: the same losses, weights and optimizer state, bit for
bit. The staged kernel launch (conditional, its table rebound in place) runs in Triton's
interpreter on CPU; the CUDA-graphed training run is in tests/test_train.py."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from mode.config import load_config
from mode.kernels.policy import KernelPolicy, use_kernels
from mode.model import LanguageModel
from mode.training.optim import TorchOptimization

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

ROOT = Path(__file__).resolve().parents[1]
TINY = sorted((ROOT / "configs").glob("*_tiny.yaml"))


def _tiny(path: Path):
    return load_config(path, ["--model.n_layers=2", "--model.max_seq_len=32", "--data.seq_len=32"])


def _train(config, defer: bool, steps: int, flush_after: int | None = None) -> tuple[list[float], TorchOptimization]:
    """steps optimizer steps of a tiny model with bf16 weights under CPU autocast, each of
    config.train.grad_accum micro-batches. Deferred, the gradients are written afresh by each step's
    first backward, as the CUDA graph writes them (zero_grads=False); flush_after: flush once after
    that step (as an evaluation does) and go on."""
    torch.manual_seed(0)
    model = LanguageModel(config)
    optimization = TorchOptimization(model, config, torch.device("cpu"), keep_grads=defer, zero_grads=not defer,
                                     bf16_weights=True, defer_update=defer)
    micro_batches = config.train.grad_accum
    gen = torch.Generator().manual_seed(1)
    losses = []
    for step in range(steps):
        for micro in range(micro_batches):
            tokens = torch.randint(0, config.model.vocab_size, (2, 33), generator=gen)
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], tokens[:, 1:]).loss  # deferred: the last step's update runs first
            if micro == 0:
                for p in model.parameters():
                    p.grad = None
            optimization.backward(loss / micro_batches, micro > 0)
            losses.append(loss.item())
        optimization.step(1e-3 * (step + 1))  # a different rate each step: each update reads its own
        if step == flush_after:
            optimization.flush()
    return losses, optimization


DEFERRED_CASES = [(path, 1) for path in TINY] + [(ROOT / "configs" / f"{name}_tiny.yaml", 3)
                                                  for name in ("mode_integrated", "mor")]


@pytest.mark.parametrize("path, micro_batches", DEFERRED_CASES,
                         ids=[f"{p.stem}, {m} micro-batches" for p, m in DEFERRED_CASES])
def test_a_deferred_update_trains_as_the_immediate_one_bit_for_bit(path: Path, micro_batches: int) -> None:
    """Every block kind, four steps, a flush between two of them: the losses, the masters, the bf16
    weights and AdamW's state equal the immediate update's exactly; with three micro-batches a step,
    the update reads the float32 sums of their gradients, which the next step's first backward
    starts afresh only after its forward ran the update."""
    config = load_config(path, ["--model.n_layers=2", "--model.max_seq_len=32", "--data.seq_len=32",
                                f"--train.grad_accum={micro_batches}"])
    losses, immediate = _train(config, False, 4)
    deferred_losses, deferred = _train(config, True, 4, flush_after=1)
    assert deferred_losses == losses
    assert bool(deferred.summed_params) == (micro_batches > 1)
    want, got = immediate.model_state_dict(), deferred.model_state_dict()  # the second flushes the last step's
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name
    for param, master in zip(deferred.bf16.params, deferred.bf16.masters, strict=True):
        assert torch.equal(param, master.to(torch.bfloat16))
    want_state, got_state = immediate.state_dict()["state"], deferred.state_dict()["state"]
    assert want_state.keys() == got_state.keys()
    for index in want_state:
        for key, value in want_state[index].items():
            assert torch.equal(value, got_state[index][key]), (index, key)


def test_a_staged_update_is_flushed_by_the_checkpoint_and_dropped_by_a_load() -> None:
    """model_state_dict after a step holds the stepped masters (a flush); loading state into a run with
    an update staged drops it: the next forward does not move the loaded weights."""
    config = _tiny(ROOT / "configs" / "mode_staged_tiny.yaml")
    _, immediate = _train(config, False, 2)
    _, deferred = _train(config, True, 2)
    assert deferred.deferred.maybe_staged
    saved = {name: t.clone() for name, t in deferred.model_state_dict().items()}
    assert not deferred.deferred.maybe_staged
    for name, t in immediate.model_state_dict().items():
        assert torch.equal(saved[name], t), name

    _, other = _train(config, True, 1)  # staged, from its own gradients
    other.load_model_state_dict(saved)
    other.load_state_dict(deferred.state_dict())
    model = other.model
    tokens = torch.randint(0, config.model.vocab_size, (2, 33), generator=torch.Generator().manual_seed(3))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(tokens[:, :-1], tokens[:, 1:])
    for name, t in other.model_state_dict().items():
        assert torch.equal(t, saved[name]), name


def test_deferral_is_refused_where_the_gradients_would_not_wait() -> None:
    config = _tiny(ROOT / "configs" / "dense_tiny.yaml")
    with pytest.raises(ValueError, match="defer_update"):
        TorchOptimization(LanguageModel(config), config, torch.device("cpu"), bf16_weights=True, defer_update=True)
    with pytest.raises(ValueError, match="defer_update"):
        TorchOptimization(LanguageModel(config), config, torch.device("cpu"), keep_grads=True, zero_grads=False,
                          defer_update=True)


def test_the_staged_launch_runs_only_when_active_and_reads_its_rebound_table() -> None:
    """MastersLaunch.run with active 0 moves nothing (masters, moments, copies, step counts); with active
    1 it advances the counts and equals the immediate kernel bit for bit; rebind() points the same
    table at other gradients, which the next run reads. On the GPU where there is one (Triton's
    interpreter on CPU tensors otherwise)."""
    from mode.kernels.adamw import adamw_masters_step_, masters_launches

    gen = torch.Generator().manual_seed(0)
    shapes = [(7,), (1024,), (2500,), (33, 70)]

    def weights():
        masters = [torch.randn(shape, generator=torch.Generator().manual_seed(i)).to(DEVICE)
                   for i, shape in enumerate(shapes)]
        return [(m, torch.zeros_like(m), torch.zeros_like(m), None, m.to(torch.bfloat16), torch.zeros((), device=DEVICE))
                for m in masters]

    staged, immediate = weights(), weights()
    grads = [[(torch.randn(shape, generator=gen) * 1e-2).to(torch.bfloat16).to(DEVICE) for shape in shapes]
             for _ in range(2)]
    with_grads = [(m, a, b, g, c, s) for (m, a, b, _, c, s), g in zip(staged, grads[0])]
    launches = masters_launches(with_grads)
    lr, scale = torch.tensor(2e-3, device=DEVICE), torch.tensor(1.5, device=DEVICE)
    before = [[t.clone() for t in update if t is not None] for update in staged]
    with use_kernels(KernelPolicy(optimizer=True, cpu=True)):
        for launch in launches:
            launch.run(scale, lr, (0.9, 0.95), 1e-8, 0.1, active=torch.tensor(0.0, device=DEVICE))
        for update, saved in zip(staged, before):
            assert all(torch.equal(t, s) for t, s in zip([t for t in update if t is not None], saved))
        for step_grads in grads:
            for launch in launches:
                launch.rebind([(m, a, b, g, c, s) for (m, a, b, _, c, s), g in zip(staged, step_grads)])
                launch.run(scale, lr, (0.9, 0.95), 1e-8, 0.1, active=torch.tensor(1.0, device=DEVICE))
            updates = [(m, a, b, g, c, s) for (m, a, b, _, c, s), g in zip(immediate, step_grads)]
            torch._foreach_add_([u[-1] for u in updates], 1.0)
            adamw_masters_step_(updates, scale, lr, (0.9, 0.95), 1e-8, 0.1)
    for got, want in zip(staged, immediate):
        for a, b in zip(got, want):
            if a is not None:
                assert torch.equal(a, b)
    assert all(update[-1].item() == 2.0 for update in staged)


def test_where_the_overlapped_update_applies() -> None:
    from mode.config import ConfigError, config_from_dict
    from mode.training.deferred_update import overlap_update_apply

    def config(**train):
        return config_from_dict({"train": train}, "test")

    model = LanguageModel(config())
    cpu = torch.device("cpu")
    assert config().train.overlap_update is False  # the default: the update runs in the step
    assert overlap_update_apply(config(), model, cpu, bf16_weights=True, eager_graphed=True) == (False, None)
    auto = config(overlap_update="auto")
    assert overlap_update_apply(auto, model, cpu, bf16_weights=True, eager_graphed=True) == (True, None)
    assert overlap_update_apply(auto, model, cpu, bf16_weights=False, eager_graphed=False) == (False, None)
    on, note = overlap_update_apply(auto, model, cpu, bf16_weights=True, eager_graphed=False)
    assert not on and note.startswith("train.overlap_update=auto: the update runs in the step") and "cuda_graphs" in note
    for bf16, graphed, why in [(False, True, "train.bf16_weights"), (True, False, "train.cuda_graphs")]:
        with pytest.raises(ConfigError, match=f"train.overlap_update=true: .*{why}"):
            overlap_update_apply(config(overlap_update=True), model, cpu, bf16, graphed)
    engine = "a multi-process engine runs the update in its step"  # launch/train.py with bf16 weights
    on, note = overlap_update_apply(auto, model, cpu, bf16_weights=True, eager_graphed=True, engine_refusal=engine)
    assert not on and note.endswith(engine)
    with pytest.raises(ConfigError, match=f"train.overlap_update=true: {engine}"):
        overlap_update_apply(config(overlap_update=True), model, cpu, True, True, engine)
    with pytest.raises(Exception, match="overlap_update"):
        config(overlap_update="yes")
