"""Training: the loss falls, the run folder, exact resume, guarded run folders, schedule,
gradient accumulation and the command line. Tiny models on a small text corpus, on CPU."""
from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

from mode.checkpoint import build_model, load_checkpoint_file
from mode.config import Config, ConfigError, TrainConfig, config_from_dict, load_config
from mode.data import batch_generator, sample_batch
from mode.flops import model_flops, train_step_flops
from mode.model import LanguageModel
from mode.run_folder import CHECKPOINT, METRICS
from mode.train import main
from mode.training.graphs import eager_graphs
from mode.training.optim import TorchOptimization, clipped_gradients, learning_rate
from mode.training.router_stats import POSITION_BINS
from mode.training.trainer import LaunchedStep, RunState, Trainer

# Resumed and uninterrupted runs do the same float32 operations on CPU in the same order;
# the constant only absorbs printing/JSON round trips (json keeps full float precision).
RESUME_ATOL = 1e-6
# position_share entries are rounded to 4 decimals: 16 bins can be off by 16 * 5e-5 in sum.
SHARE_SUM_ATOL = 2e-3
# The loss must fall by a clear margin in 40 steps (from ~ln 256 = 5.5 nats per byte).
LOSS_DROP = 0.3


def _merge(base: dict, extra: dict) -> dict:
    out = copy.deepcopy(base)
    for section, values in extra.items():
        out.setdefault(section, {}).update(values)
    return out


def raw_config(out_dir: Path, corpus: Path, **sections: dict) -> dict:
    base = {
        "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 32,
                  "block_pattern": ["dense", "mod"]},
        "routing": {"capacity": 0.25},  # k = 8 of 32
        "data": {"source": "text", "path": str(corpus), "seq_len": 32},
        "train": {"batch_size": 4, "max_steps": 8, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 4,
                  "log_interval": 1, "eval_interval": 100, "eval_batches": 2, "checkpoint_interval": 100,
                  "out_dir": str(out_dir), "progress": False, "device": "cpu"},
    }
    return _merge(base, sections)


def make_config(out_dir: Path, corpus: Path, **sections: dict) -> Config:
    return config_from_dict(raw_config(out_dir, corpus, **sections))


def write_config_file(path: Path, out_dir: Path, corpus: Path, **sections: dict) -> Path:
    """raw_config(out_dir, corpus, **sections) as a YAML file at path, for main(["--config", ...])."""
    path.write_text(yaml.safe_dump(raw_config(out_dir, corpus, **sections)))
    return path


def read_metrics(run_dir: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines() if line]


def train_losses(run_dir: Path) -> dict[int, float]:
    records = [r for r in read_metrics(run_dir) if "loss" in r]
    steps = [r["step"] for r in records]
    assert len(steps) == len(set(steps)), f"duplicated steps in {run_dir / METRICS}: {steps}"
    return {r["step"]: r["loss"] for r in records}


# ----------------------------------------------------------------------------- a short run
def test_short_run_lowers_loss_and_writes_run_folder(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "run"
    config = make_config(
        out, corpus,
        model={"d_model": 64, "n_heads": 4, "d_ff": 128, "n_layers": 4},
        train={"max_steps": 40, "warmup_steps": 5, "eval_interval": 20, "checkpoint_interval": 20},
    )
    records = Trainer(config).run()

    metrics = read_metrics(out)
    assert metrics == json.loads(json.dumps(records))  # what run() returns is what it logged
    train = [r for r in metrics if "loss" in r]
    evals = [r for r in metrics if "val_loss" in r]

    # The loss falls.
    losses = [r["loss"] for r in train]
    assert all(math.isfinite(x) for x in losses)
    assert abs(losses[0] - math.log(256)) < 0.5  # starts near uniform over bytes
    assert sum(losses[-5:]) / 5 < losses[0] - LOSS_DROP, losses

    # Every step logged once, with cumulative tokens and training FLOPs (3 x forward).
    assert [r["step"] for r in train] == list(range(1, 41))
    step_flops = train_step_flops(config)
    for r in train:
        assert r["tokens"] == r["step"] * 4 * 32
        assert r["flops"] == pytest.approx(r["step"] * step_flops, rel=1e-9)
        assert r["lr"] == pytest.approx(learning_rate(r["step"] - 1, config.train), rel=1e-12)
        assert math.isfinite(r["grad_norm"]) and r["grad_norm"] > 0
    assert all(b["flops"] > a["flops"] for a, b in zip(train, train[1:]))

    # Evaluations at steps 20 and 40, with held-out loss and router statistics per routed layer.
    k_fraction = 8 / 32
    assert [r["step"] for r in evals] == [20, 40]
    assert evals[-1]["val_loss"] < math.log(256) - LOSS_DROP
    for r in evals:
        assert set(r["routing"]) == {"layer1", "layer3"}  # the mod blocks of [dense, mod, dense, mod]
        for stats in r["routing"].values():
            assert stats["processed"] == pytest.approx(k_fraction, abs=1e-6)
            assert abs(stats["processed"] - config.routing.capacity) <= 0.5 / 32  # k = round(capacity * S)
            assert 0.0 < stats["gate_mean"] < 1.0  # sigmoid gate
            assert stats["gate_std"] >= 0.0
            share = stats["position_share"]
            assert len(share) == POSITION_BINS and min(share) >= 0.0
            assert sum(share) == pytest.approx(1.0, abs=SHARE_SUM_ATOL)
    assert train[-1]["routing"]["layer1"]["processed"] == pytest.approx(k_fraction, abs=1e-6)

    # config.yaml is the run's config; the checkpoint is the final state; the plot is a PNG.
    assert load_config(out / "config.yaml") == config
    payload = load_checkpoint_file(out / CHECKPOINT)
    assert payload["state"]["step"] == 40 and payload["state"]["tokens"] == 40 * 4 * 32
    assert payload["config"] == config.to_dict()
    assert (out / "loss_vs_flops.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*.tmp"))  # atomic writes left nothing


# ----------------------------------------------------------------------------- resume
def _params(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_checkpoint_file(run_dir / CHECKPOINT)["model"]


@pytest.mark.parametrize("random_routing", [False, True])
def test_resume_continues_the_same_curve(tmp_path: Path, corpus: Path, monkeypatch, random_routing: bool) -> None:
    # warmup_steps=4 covers the first leg, so steps 1..4 see the same learning rates whether
    # max_steps is 4 or 8; from step 5 on both runs use the max_steps=8 schedule.
    def cfg(out: Path, max_steps: int) -> Config:
        return make_config(out, corpus, routing={"random": random_routing},
                           train={"max_steps": max_steps, "checkpoint_interval": 4})

    # A: 8 steps straight.
    a = tmp_path / "a"
    Trainer(cfg(a, 8)).run()
    losses_a = train_losses(a)
    assert sorted(losses_a) == list(range(1, 9))

    # B: 4 steps (which end with an evaluation and a checkpoint), then resume to 8.
    b = tmp_path / "b"
    Trainer(cfg(b, 4)).run()
    resumed = Trainer(cfg(b, 8), resume=True)
    assert resumed.state.step == 4
    resumed.run()
    losses_b = train_losses(b)
    assert sorted(losses_b) == list(range(1, 9))
    for step in range(1, 9):
        assert abs(losses_b[step] - losses_a[step]) <= RESUME_ATOL, (step, losses_a, losses_b)
    eval_steps = [r["step"] for r in read_metrics(b) if "val_loss" in r]
    assert eval_steps == [4, 8]
    val_a = [r["val_loss"] for r in read_metrics(a) if "val_loss" in r]
    val_b = [r["val_loss"] for r in read_metrics(b) if "val_loss" in r]
    assert abs(val_a[-1] - val_b[-1]) <= RESUME_ATOL
    for name, tensor in _params(a).items():
        torch.testing.assert_close(_params(b)[name], tensor, atol=RESUME_ATOL, rtol=0)

    # C: a run of 8 steps that crashes during step 7, after its step-4 checkpoint; metrics
    # logged after the checkpoint (steps 5, 6) are dropped on resume and written again.
    c = tmp_path / "c"
    original = Trainer.launch_step

    def crash_at_step_7(self: Trainer) -> LaunchedStep:
        if self.state.step == 6:
            raise KeyboardInterrupt("simulated crash")
        return original(self)

    monkeypatch.setattr(Trainer, "launch_step", crash_at_step_7)
    with pytest.raises(KeyboardInterrupt):
        Trainer(cfg(c, 8)).run()
    assert sorted(train_losses(c)) == list(range(1, 7))  # step 6, in flight at the interrupt, reported
    assert load_checkpoint_file(c / CHECKPOINT)["state"]["step"] == 4
    monkeypatch.setattr(Trainer, "launch_step", original)
    Trainer(cfg(c, 8), resume=True).run()
    losses_c = train_losses(c)  # asserts no step is logged twice
    assert sorted(losses_c) == list(range(1, 9))
    for step in range(1, 9):
        assert abs(losses_c[step] - losses_a[step]) <= RESUME_ATOL, (step, losses_a, losses_c)


def test_the_loop_reads_a_step_after_queuing_the_next(tmp_path: Path, corpus: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Trainer.run keeps one step in flight: step n is read (finish_step) after step n+1 is queued
    (launch_step), except before an evaluation, a checkpoint and the end, which read the step
    first; the records are those of the plain one-step-at-a-time train_step."""
    calls: list[str] = []
    launch, finish = Trainer.launch_step, Trainer.finish_step

    def launch_step(self: Trainer) -> LaunchedStep:
        calls.append(f"launch {self.state.step + 1}")
        return launch(self)

    def finish_step(self: Trainer, launched: LaunchedStep) -> dict[str, Any]:
        calls.append(f"finish {launched.state.step}")
        return finish(self, launched)

    def evaluate(self: Trainer) -> dict[str, Any]:
        calls.append(f"evaluate {self.state.step}")
        return {"val_loss": 0.0}

    config = make_config(tmp_path / "run", corpus, train={"max_steps": 6, "eval_interval": 3, "checkpoint_interval": 100,
                                                          "log_interval": 1})
    monkeypatch.setattr(Trainer, "launch_step", launch_step)
    monkeypatch.setattr(Trainer, "finish_step", finish_step)
    monkeypatch.setattr(Trainer, "evaluate", evaluate)
    records = [r for r in Trainer(config).run() if "loss" in r]
    assert calls == ["launch 1", "launch 2", "finish 1", "launch 3", "finish 2", "finish 3", "evaluate 3",
                     "launch 4", "launch 5", "finish 4", "launch 6", "finish 5", "finish 6", "evaluate 6"]
    assert [r["step"] for r in records] == list(range(1, 7))
    monkeypatch.setattr(Trainer, "launch_step", launch)
    monkeypatch.setattr(Trainer, "finish_step", finish)
    plain = Trainer(make_config(tmp_path / "plain", corpus, train={"max_steps": 6}))
    for record in records:
        expected = plain.train_step()
        assert {k: record[k] for k in expected} == expected, record["step"]
        assert (record["tokens"], record["flops"]) == (plain.state.tokens, plain.state.flops)


def test_tokens_per_s_counts_training_compute_only(tmp_path: Path, corpus: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """tokens/s is the tokens of a log window over the time its steps computed: a clock that a
    training forward advances by 1 s and an evaluation forward by 7 s gives every record exactly
    tokens_per_step / 1 s, at and after evaluation and checkpoint steps too (the step read at
    once before an evaluation, the one queued after it)."""
    clock = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: clock[0])
    config = make_config(tmp_path / "run", corpus, train={"max_steps": 7, "eval_interval": 3, "checkpoint_interval": 2,
                                                          "log_interval": 1, "eval_batches": 2})
    trainer = Trainer(config)

    def tick(module: torch.nn.Module, args: Any) -> None:
        clock[0] += 1.0 if module.training else 7.0

    trainer.model.register_forward_pre_hook(tick)
    records = [r for r in trainer.run() if "loss" in r]
    assert [r["step"] for r in records] == list(range(1, 8))
    assert [r["tokens_per_s"] for r in records] == [trainer.tokens_per_step / 1.0] * 7
    config = make_config(tmp_path / "run2", corpus, train={"max_steps": 6, "eval_interval": 3, "log_interval": 2})
    trainer = Trainer(config)
    trainer.model.register_forward_pre_hook(tick)
    records = [r for r in trainer.run() if "loss" in r]  # windows of two steps
    assert [r["tokens_per_s"] for r in records] == [trainer.tokens_per_step / 1.0] * 3


def test_fresh_run_refuses_a_folder_with_a_checkpoint(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "run"
    config = make_config(out, corpus, train={"max_steps": 1})
    Trainer(config).run()
    before = {name: (out / name).read_bytes() for name in (CHECKPOINT, "config.yaml", METRICS)}
    changed = make_config(out, corpus, train={"max_steps": 3, "lr": 1e-3})
    with pytest.raises(FileExistsError, match="--resume"):
        Trainer(changed)
    after = {name: (out / name).read_bytes() for name in before}
    assert after == before


def test_resume_without_checkpoint_is_clear_error(tmp_path: Path, corpus: Path, capsys) -> None:
    out = tmp_path / "never_ran"
    with pytest.raises(FileNotFoundError, match=str(out / CHECKPOINT)):
        Trainer(make_config(out, corpus), resume=True)
    config_file = write_config_file(tmp_path / "x.yaml", out, corpus)
    assert main(["--config", str(config_file), "--resume"]) == 2
    assert "no checkpoint" in capsys.readouterr().err


def test_resume_with_another_config_is_refused(tmp_path: Path, corpus: Path, capsys) -> None:
    """--resume continues the run's curve: a field that defines it (the model, routing, data, the
    optimizer's settings) may not change; how long and how it runs may, with a note."""
    out = tmp_path / "run"
    Trainer(make_config(out, corpus, train={"max_steps": 1})).run()
    saved = (out / CHECKPOINT).read_bytes()
    with pytest.raises(ConfigError, match=r"config differs .*: model\.d_ff \(64 there, 96 here\)"):
        Trainer(make_config(out, corpus, model={"d_ff": 96}, train={"max_steps": 2}), resume=True)
    with pytest.raises(ConfigError, match=r"routing\.capacity \(0\.25 there, 0\.5 here\), train\.lr"):
        Trainer(make_config(out, corpus, routing={"capacity": 0.5}, train={"max_steps": 2, "lr": 1e-2}), resume=True)
    with pytest.raises(ConfigError, match=r"routing\.router_bias \(False there, True here\)"):  # a new weight
        Trainer(make_config(out, corpus, routing={"router_bias": True}, train={"max_steps": 2}), resume=True)
    assert (out / CHECKPOINT).read_bytes() == saved
    config_file = write_config_file(tmp_path / "x.yaml", out, corpus, train={"max_steps": 1})
    assert main(["--config", str(config_file), "--resume", "--train.max_steps=2", "--train.eval_interval=1"]) == 0
    err = capsys.readouterr().err
    assert "note: --resume changes train.max_steps (1 there, 2 here)" in err
    assert "train.eval_interval (100 there, 1 here)" in err
    assert train_losses(out).keys() == {1, 2}


def test_interrupt_exits_130_saying_where_to_resume(tmp_path: Path, corpus: Path, capsys,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    launch = Trainer.launch_step

    def interrupted_at_step_4(self: Trainer) -> LaunchedStep:
        if self.state.step == 3:
            raise KeyboardInterrupt
        return launch(self)

    monkeypatch.setattr(Trainer, "launch_step", interrupted_at_step_4)
    out = tmp_path / "run"
    config_file = write_config_file(tmp_path / "x.yaml", out, corpus, train={"checkpoint_interval": 2})
    assert main(["--config", str(config_file)]) == 130
    err = capsys.readouterr().err
    assert f"interrupted at step 3; {out / CHECKPOINT} holds step 2: continue with --resume" in err
    assert "Traceback" not in err
    assert load_checkpoint_file(out)["state"]["step"] == 2
    assert max(train_losses(out)) == 3  # the step in flight was reported
    assert (out / "loss_vs_flops.png").is_file()
    first = tmp_path / "early"
    write_config_file(config_file, first, corpus, train={"checkpoint_interval": 10})
    assert main(["--config", str(config_file)]) == 130
    assert f"before the run's first checkpoint: nothing to resume; remove {first}" in capsys.readouterr().err


def test_interrupt_while_the_trainer_is_built_exits_130_and_the_command_runs_again(
        tmp_path: Path, corpus: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C before the first step (the data and model being built; here as late as it gets, the
    run folder prepared): one line, exit 130, no traceback; the same command then trains."""
    prepare = Trainer._prepare_run_folder

    def interrupted_after_preparing(self: Trainer, resume: bool) -> None:
        prepare(self, resume)
        raise KeyboardInterrupt

    monkeypatch.setattr(Trainer, "_prepare_run_folder", interrupted_after_preparing)
    out = tmp_path / "run"
    config_file = write_config_file(tmp_path / "x.yaml", out, corpus, train={"max_steps": 1})
    assert main(["--config", str(config_file)]) == 130
    err = capsys.readouterr().err
    assert "interrupted before training started: nothing to resume; run the command again" in err
    assert "Traceback" not in err
    monkeypatch.setattr(Trainer, "_prepare_run_folder", prepare)
    assert main(["--config", str(config_file)]) == 0
    assert train_losses(out).keys() == {1}


def test_cuda_device_without_one_and_file_permissions(tmp_path: Path, corpus: Path, capsys) -> None:
    """train.device=cuda on a machine without CUDA is an error naming the field; the run folder's
    files get the permissions open() gives (the temporary files they are renamed from are 0600)."""
    config_file = write_config_file(tmp_path / "x.yaml", tmp_path / "run", corpus, train={"max_steps": 1})
    if not torch.cuda.is_available():
        assert main(["--config", str(config_file), "--train.device=cuda"]) == 2
        assert "train.device is 'cuda' but no CUDA device is available" in capsys.readouterr().err
    assert main(["--config", str(config_file)]) == 0
    umask = os.umask(0)
    os.umask(umask)
    for name in ("config.yaml", CHECKPOINT, METRICS, "loss_vs_flops.png"):
        assert (tmp_path / "run" / name).stat().st_mode & 0o777 == 0o666 & ~umask, name


def test_fresh_run_refuses_a_folder_with_metrics_but_no_checkpoint(tmp_path: Path, corpus: Path) -> None:
    """A run stopped before its first checkpoint leaves metrics.jsonl: a new run there would append
    its curve to that one's."""
    out = tmp_path / "run"
    out.mkdir()
    (out / METRICS).write_text('{"step": 1, "flops": 1.0, "loss": 5.0}\n')
    with pytest.raises(FileExistsError, match="stopped before its first checkpoint"):
        Trainer(make_config(out, corpus, train={"max_steps": 1}))
    assert (out / METRICS).read_text() == '{"step": 1, "flops": 1.0, "loss": 5.0}\n'


def test_init_from_weights_that_do_not_fit_name_the_routing_fields(tmp_path: Path, corpus: Path) -> None:
    Trainer(make_config(tmp_path / "a", corpus, train={"max_steps": 1})).run()
    with pytest.raises(ConfigError, match=r"do not fit this model .*routing\.causal \('none' there, 'predictor' here\)"):
        Trainer(make_config(tmp_path / "b", corpus, routing={"causal": "predictor"}, train={"init_from": str(tmp_path / "a")}))
    fits = Trainer(make_config(tmp_path / "c", corpus, routing={"capacity": 0.5}, train={"init_from": str(tmp_path / "a")}))
    assert fits.state.step == 0  # routing fields that keep the weights' shapes are a fine-tune's choice


def test_init_from_starts_a_new_run_from_saved_weights(tmp_path: Path, corpus: Path) -> None:
    """train.init_from: step 0 of a new run holds the checkpoint's weights, with a fresh
    optimizer; a missing file or another model is an error naming the field."""
    source = make_config(tmp_path / "a", corpus)
    Trainer(source).run()
    saved = load_checkpoint_file(tmp_path / "a")
    fresh = Trainer(make_config(tmp_path / "b", corpus, train={"init_from": str(tmp_path / "a")}))
    assert fresh.state.step == 0
    for name, value in fresh.model.state_dict().items():
        assert torch.equal(value, saved["model"][name]), name
    assert not fresh.optimization.optimizer.state  # AdamW starts empty: a new run, not a resume
    untouched = Trainer(make_config(tmp_path / "c", corpus))
    assert not torch.equal(untouched.model.embed.weight, fresh.model.embed.weight)
    with pytest.raises(ConfigError, match=r"train\.init_from: checkpoint not found"):
        Trainer(make_config(tmp_path / "d", corpus, train={"init_from": str(tmp_path / "nothing")}))
    with pytest.raises(ConfigError, match=r"train\.init_from: .* holds another model: model\.d_model \(32 there, 64 here\)"):
        Trainer(make_config(tmp_path / "e", corpus, model={"d_model": 64}, train={"init_from": str(tmp_path / "a")}))


def test_foreign_checkpoint_files_name_the_path(tmp_path: Path) -> None:
    foreign = tmp_path / "foreign.pt"
    torch.save({"a": 1}, foreign)
    with pytest.raises(ValueError, match=str(foreign)):
        load_checkpoint_file(foreign)
    text = tmp_path / "notes.pt"
    text.write_text("this is not a checkpoint\n")
    with pytest.raises(ValueError, match=str(text)):
        load_checkpoint_file(text)
    with pytest.raises(FileNotFoundError, match="missing.pt"):
        load_checkpoint_file(tmp_path / "missing.pt")
    code = tmp_path / "runs_code.pt"  # unpickling it would call a function: weights only refuses
    torch.save({"format": "mode-checkpoint-v1", "hook": RunState}, code)
    with pytest.raises(ValueError, match=rf"{code} is not a readable checkpoint"):
        load_checkpoint_file(code)


# ----------------------------------------------------------------------------- schedule
def test_learning_rate_schedule() -> None:
    t = TrainConfig(lr=1e-3, min_lr=1e-4, warmup_steps=10, max_steps=110)
    warm = [learning_rate(s, t) for s in range(10)]
    assert warm[0] == pytest.approx(1e-4) and warm[-1] == pytest.approx(1e-3)
    steps = [b - a for a, b in zip(warm, warm[1:])]
    assert steps == pytest.approx([1e-4] * 9)  # linear
    assert learning_rate(10, t) == pytest.approx(1e-3)  # peak when warmup ends
    assert learning_rate(60, t) == pytest.approx((1e-3 + 1e-4) / 2)  # cosine: halfway at mid-decay
    assert learning_rate(110, t) == pytest.approx(1e-4)  # min_lr at max_steps
    assert learning_rate(500, t) == pytest.approx(1e-4)  # and stays there
    decay = [learning_rate(s, t) for s in range(10, 111)]
    assert all(b < a for a, b in zip(decay, decay[1:]))  # strictly decreasing after warmup
    assert all(1e-4 - 1e-15 <= x <= 1e-3 + 1e-15 for x in decay)
    no_warmup = TrainConfig(lr=2e-3, min_lr=0.0, warmup_steps=0, max_steps=10)
    assert learning_rate(0, no_warmup) == pytest.approx(2e-3)
    assert learning_rate(10, no_warmup) == pytest.approx(0.0, abs=1e-15)


# ----------------------------------------------------------------------------- gradient accumulation
class RecordingOptimization:
    """An Optimization that records the accumulated gradients instead of stepping."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self.grads: dict[str, torch.Tensor] = {}

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def step(self, lr: float) -> torch.Tensor:
        self.grads = {n: p.grad.clone() for n, p in self.model.named_parameters() if p.grad is not None}
        self.model.zero_grad(set_to_none=True)
        return torch.zeros(())

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass


def test_gradient_accumulation_equals_one_large_batch(tmp_path: Path, corpus: Path) -> None:
    """grad_accum=2 x batch 2 == one batch of the same 4 sequences: the same loss and gradients."""
    config = make_config(tmp_path / "run", corpus, train={"batch_size": 2, "grad_accum": 2})
    torch.manual_seed(0)
    model = LanguageModel(config)
    recorder = RecordingOptimization(model)
    trainer = Trainer(config, optimization=recorder, model=model)
    metrics = trainer.train_step()
    assert trainer.state.tokens == 2 * 2 * 32

    # The two micro-batches of step 0, as one batch of 4.
    parts = [sample_batch(trainer.data.train, 2, 32, batch_generator(config.train.seed, 0, m)) for m in (0, 1)]
    assert not torch.equal(parts[0][0], parts[1][0])  # two different micro-batches
    x = torch.cat([p[0] for p in parts])
    y = torch.cat([p[1] for p in parts])
    model.zero_grad(set_to_none=True)
    out = model(x, y)
    out.loss.backward()
    assert metrics["loss"] == pytest.approx(float(out.loss.detach()), abs=1e-5)
    assert set(recorder.grads) == {n for n, p in model.named_parameters() if p.grad is not None}
    for name, p in model.named_parameters():
        if p.grad is not None:
            # Summation order differs (two halves vs one batch): float32 rounding only.
            torch.testing.assert_close(recorder.grads[name], p.grad, rtol=1e-4, atol=1e-7, msg=name)
    assert any(float(g.abs().max()) > 0 for g in recorder.grads.values())


# ----------------------------------------------------------------------------- command line
def _cli_config(tmp_path: Path, corpus: Path) -> Path:
    path = write_config_file(tmp_path / "tiny.yaml", tmp_path / "unused", corpus)
    return path


def test_cli_trains_and_writes_run_folder(tmp_path: Path, corpus: Path) -> None:
    out = tmp_path / "cli_run"
    result = subprocess.run(
        [sys.executable, "-m", "mode.train", "--config", str(_cli_config(tmp_path, corpus)),
         "--train.max_steps=2", f"--train.out_dir={out}", "--train.eval_batches=1"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 0, result.stderr
    for name in ("config.yaml", METRICS, CHECKPOINT, "loss_vs_flops.png"):
        assert (out / name).is_file(), name
    assert load_config(out / "config.yaml").train.max_steps == 2
    assert sorted(train_losses(out)) == [1, 2]


def test_cli_bad_override_exits_2_naming_the_field(tmp_path: Path, corpus: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "mode.train", "--config", str(_cli_config(tmp_path, corpus)),
         "--routing.capacity=1.5", f"--train.out_dir={tmp_path / 'never'}"],
        capture_output=True, text=True, timeout=120,
    )
    assert result.returncode == 2
    assert "routing.capacity" in result.stderr
    assert not (tmp_path / "never").exists()


def test_main_returns_2_on_config_errors(tmp_path: Path, corpus: Path, capsys) -> None:
    config = str(_cli_config(tmp_path, corpus))
    assert main(["--config", config, "--train.lrr=0.1"]) == 2
    assert "train.lrr" in capsys.readouterr().err
    assert main(["--config", config, "--train.lr=fast"]) == 2
    assert "train.lr" in capsys.readouterr().err
    assert main(["--config", str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml" in capsys.readouterr().err
    with pytest.raises(SystemExit) as info:  # not an override at all: argparse's usage error
        main(["--config", config, "--train.lr"])
    assert info.value.code == 2


# ------------------------------------------------------------------- compile_mode (CUDA graphs)
def test_compile_mode_needs_compile(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(ConfigError, match="compile_mode"):
        make_config(tmp_path / "run", corpus, train={"compile_mode": "reduce-overhead"})
    with pytest.raises(ConfigError, match="compile_mode"):
        make_config(tmp_path / "run", corpus, train={"compile": True, "compile_mode": "fast"})


def test_kept_gradients_train_like_freed_ones(tmp_path: Path, corpus: Path) -> None:
    """TorchOptimization(keep_grads=True), as CUDA graphs use it: gradients allocated from the
    start and zeroed in place, micro-batches added into them; the same steps as freeing them."""
    params = {}
    for keep in (False, True):
        config = make_config(tmp_path / f"keep{keep}", corpus, train={"grad_accum": 2, "max_steps": 3})
        torch.manual_seed(0)
        model = build_model(config, "cpu")
        optimization = TorchOptimization(model, config, torch.device("cpu"), keep_grads=keep)
        trainer = Trainer(config, optimization=optimization, model=model)
        trainer.run()
        grads = [p.grad for p in model.parameters()]
        if keep:
            assert all(g is not None and not g.any() for g in grads)  # zeroed after the step, still there
        else:
            assert all(g is None for g in grads)
        params[keep] = [p.detach().clone() for p in model.parameters()]
    for a, b in zip(params[False], params[True], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def adamw_steps(fused: bool, max_norm: float, how: str) -> list[torch.Tensor]:
    """Three AdamW steps on fixed random gradients (norm about 1), clipped `how`: "inside"
    (clipped_gradients), "clip_grad_norm_" (first, then step), or "none"."""
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(7))]
    optimizer = torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, fused=fused)
    for _ in range(3):
        for p in params:
            p.grad = torch.randn_like(p) * 0.2
        grads = [p.grad for p in params]
        if how == "inside":
            norm = torch.nn.utils.get_total_norm(grads, 2.0)
            with clipped_gradients(optimizer, grads, norm, max_norm):
                optimizer.step()
            assert not hasattr(optimizer, "grad_scale")  # one step only
        else:
            if how == "clip_grad_norm_":
                torch.nn.utils.clip_grad_norm_(params, max_norm if max_norm > 0 else float("inf"))
            optimizer.step()
    return [p.detach().clone() for p in params]


@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("max_norm", [0.0, 0.05, 1e3])
def test_clipped_gradients_step_like_clip_grad_norm(fused: bool, max_norm: float) -> None:
    """clipped_gradients around optimizer.step() equals clip_grad_norm_ then step(): a fused AdamW
    takes the factor as its grad_scale (CPU runs the fused kernel too), others get it multiplied
    in. 0.05 clips, 1e3 does not, 0 means no clipping."""
    inside = adamw_steps(fused, max_norm, "inside")
    # float32: the fused kernel divides by 1 / factor where clip_grad_norm_ multiplies by it
    for a, b in zip(inside, adamw_steps(fused, max_norm, "clip_grad_norm_"), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    unclipped = adamw_steps(fused, max_norm, "none")
    clipped = max_norm == 0.05
    assert any(not torch.allclose(a, b, rtol=0, atol=1e-4) for a, b in zip(inside, unclipped)) is clipped


@pytest.mark.parametrize("fused", [False, True])
def test_clipped_gradients_clip_a_group_apart_by_its_own_norm(fused: bool) -> None:
    """apart=[(grads, norm)]: that group is clipped by its own norm, the rest by theirs, as two
    clip_grad_norm_ calls would; with a fused AdamW the group's factor is taken over the rest's."""
    def steps(inside: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        main_params = [torch.nn.Parameter(torch.randn(5, 7)), torch.nn.Parameter(torch.randn(7))]
        apart_params = [torch.nn.Parameter(torch.randn(3, 4))]
        optimizer = torch.optim.AdamW(main_params + apart_params, lr=1e-2, weight_decay=0.1, fused=fused)
        for scale in (0.2, 30.0, 0.01):  # the group's norm below, far above and near the main one's
            for p in main_params:
                p.grad = torch.randn_like(p) * 0.2
            for p in apart_params:
                p.grad = torch.randn_like(p) * scale
            if inside:
                grads, apart = [p.grad for p in main_params], [p.grad for p in apart_params]
                norms = [torch.nn.utils.get_total_norm(g, 2.0) for g in (grads, apart)]
                with clipped_gradients(optimizer, grads, norms[0], 0.05, [(apart, norms[1])]):
                    optimizer.step()
            else:
                torch.nn.utils.clip_grad_norm_(main_params, 0.05)
                torch.nn.utils.clip_grad_norm_(apart_params, 0.05)
                optimizer.step()
        return [p.detach().clone() for p in main_params + apart_params]

    for a, b in zip(steps(True), steps(False), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_the_predictors_loss_never_changes_how_the_model_is_clipped(tmp_path: Path, corpus: Path) -> None:
    """routing.causal=predictor: the predictors are clipped by their own norm, so their loss weight
    leaves every other parameter bit-identical under clipping (one global norm coupled them: a
    larger predictor loss clipped the language model harder), and grad_norm is the model's."""
    params, norms = {}, {}
    for weight in (0.01, 100.0):
        config = make_config(tmp_path / f"w{weight}", corpus, routing={"causal": "predictor", "causal_loss_weight": weight},
                             train={"max_steps": 4, "grad_clip": 0.05})  # every step clipped
        torch.manual_seed(0)
        model = build_model(config, "cpu")
        Trainer(config, model=model).run()
        params[weight] = dict(model.named_parameters())
        norms[weight] = [r["grad_norm"] for r in read_metrics(Path(config.train.out_dir)) if "grad_norm" in r]
    predictor = [n for n in params[0.01] if ".predictor." in n]
    assert predictor  # the test reaches the predictors
    for name, p in params[0.01].items():
        same = torch.equal(p, params[100.0][name])
        assert same is (name not in predictor), name  # the predictors' own steps do differ
    assert norms[0.01] == norms[100.0] and len(norms[0.01]) == 4


# Eager and compiled bf16 steps round differently (fused, reordered arithmetic); over six
# steps of a tiny model the losses stay within 2e-2 nats of each other, while a step that
# read a gradient or loss overwritten by a later CUDA-graph replay would be off by far more.
# The eager model's graph runs eager's own kernels: only atomics' order differs, so 10x tighter.
# (loss atol, grad-norm rtol) per kind of graphs
GRAPHED_TOLERANCE = {"compiled": (2e-2, 5e-2), "eager": (2e-3, 5e-3)}


GRAPHS = {"compiled": {"compile": True, "compile_mode": "reduce-overhead"}, "eager": {"cuda_graphs": True}}


def assert_same_curves(eager: list[dict[str, Any]], graphed: list[dict[str, Any]], graphs: str) -> None:
    """Two runs' records (Trainer.run) step by step: losses and validation losses within the kind of
    graphs' loss atol, gradient norms within its rtol (GRAPHED_TOLERANCE)."""
    loss_atol, norm_rtol = GRAPHED_TOLERANCE[graphs]
    for plain, replayed in zip(eager, graphed, strict=True):
        assert plain["step"] == replayed["step"]
        for key in ("loss", "val_loss"):
            if key in plain:
                assert replayed[key] == pytest.approx(plain[key], abs=loss_atol), (key, plain["step"])
        if "grad_norm" in plain:  # a norm of ~1: bf16 rounding moves it by a few per cent at most
            assert replayed["grad_norm"] == pytest.approx(plain["grad_norm"], rel=norm_rtol), plain["step"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("grad_accum", [1, 2])
@pytest.mark.parametrize("block, graphs", [(b, g) for b in ("mod", "moe") for g in sorted(GRAPHS)] + [("moe dropless", "eager")])
def test_cuda_graphed_training_matches_eager(tmp_path: Path, corpus: Path, block: str, grad_accum: int, graphs: str) -> None:
    """train.compile_mode=reduce-overhead, and train.cuda_graphs (the eager model captured): the
    same losses, gradient norms and evaluation as eager, also with gradient accumulation (each
    micro-batch's replay overwrites the last one's outputs and adds into the kept gradients).
    Dropless token choice (eager graphs: compiled, its host-sized groups break the graph), on a GPU
    where its sync-free layout runs; elsewhere the trainer refuses it, naming train.cuda_graphs."""
    from mode.layers.experts import _GROUPED_MM_CAPABILITIES

    dropless = block == "moe dropless"
    runs = {}
    for name, train in (("eager", {"cuda_graphs": False}), ("graphs", GRAPHS[graphs])):  # plain eager: not the default
        config = make_config(
            tmp_path / name, corpus, model={"block_pattern": ["dense", block.split()[0]]},
            moe={"scheme": "token_choice", **({"dropless": True} if dropless else {"capacity_factor": 1.0})},
            train={"device": "cuda", "max_steps": 6, "eval_interval": 3, "grad_accum": grad_accum, **train},
        )
        if dropless and name == "graphs" and torch.cuda.get_device_capability() not in _GROUPED_MM_CAPABILITIES:
            with pytest.raises(ConfigError, match=r"train\.cuda_graphs: .* reads its routing on the host"):
                Trainer(config)
            return
        runs[name] = Trainer(config).run()
    assert_same_curves(runs["eager"], runs["graphs"], graphs)


# Every block kind, and each way a depth router decides (random, causal methods), under the default
# train.cuda_graphs=auto on a GPU against plain eager.
# case -> (block kind, routing section, moe section)
AUTO_GRAPHED = {
    "dense": ("dense", {}, {}), "mod": ("mod", {}, {}), "mod random": ("mod", {"random": True}, {}),
    "mod causal aux_loss": ("mod", {"causal": "aux_loss"}, {}), "mod causal predictor": ("mod", {"causal": "predictor"}, {}),
    "moe": ("moe", {}, {}), "moe token choice": ("moe", {}, {"scheme": "token_choice", "capacity_factor": 1.0}),
    "mode_staged": ("mode_staged", {}, {}), "mode_integrated": ("mode_integrated", {}, {"n_noop": 1}),
    "mode_integrated copy and constant slots": ("mode_integrated", {}, {"n_noop": 2, "noop_kind": ["copy", "constant"]}),
}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("case", sorted(AUTO_GRAPHED))
def test_default_cuda_graphs_train_as_plain_eager(tmp_path: Path, corpus: Path, case: str) -> None:
    """train.cuda_graphs=auto, the default, graphs the eager model on a GPU, and every block kind and
    routing method trains as plain eager (cuda_graphs=false) does: the same losses, gradient norms
    and evaluation, and the same draws from the GPU's generator (random routing: the capture's
    warm-up passes draw nothing, so replay k draws what eager pass k draws)."""
    block, routing, moe = AUTO_GRAPHED[case]
    runs, rng = {}, {}
    for graphs in (False, "auto"):
        config = make_config(tmp_path / str(graphs), corpus, model={"block_pattern": ["dense", block]}, routing=routing,
                             moe=moe, train={"device": "cuda", "max_steps": 4, "warmup_steps": 2, "eval_interval": 2,
                                             "cuda_graphs": graphs})
        trainer = Trainer(config)
        assert (trainer.graphed_step is not None) is (graphs == "auto")
        assert trainer.notes == ([] if graphs is False else [
            "train.cuda_graphs=auto: each micro-batch's forward and backward run as one CUDA graph, captured at "
            "the first step (false: plain eager)"])
        runs[graphs] = trainer.run()
        rng[graphs] = torch.cuda.get_rng_state(trainer.device)
    assert torch.equal(rng[False], rng["auto"])
    assert_same_curves(runs[False], runs["auto"], "eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="synchronisation is a GPU's")
@pytest.mark.parametrize("grad_accum", [1, 2], ids=["1 micro-batch", "2 micro-batches"])
@pytest.mark.parametrize("graphs", [False, "auto"], ids=["plain eager", "cuda graphs"])
@pytest.mark.parametrize("case", sorted(AUTO_GRAPHED))
def test_a_step_is_queued_without_waiting_for_the_gpu(tmp_path: Path, corpus: Path, case: str,
                                                      graphs: bool | str, grad_accum: int) -> None:
    """Trainer.launch_step makes no synchronising call (torch.cuda's sync debug mode raises on one),
    for every block kind and routing method, with bf16 weights (summed over micro-batches or not), plain eager and CUDA-graphed: what
    lets the loop queue step n+1 while the GPU still runs step n. The step queued that way trains
    as the ones before it (finite loss, the next step number)."""
    block, routing, moe = AUTO_GRAPHED[case]
    config = make_config(tmp_path / "run", corpus, model={"block_pattern": ["dense", block]}, routing=routing,
                         moe=moe, train={"device": "cuda", "max_steps": 4, "cuda_graphs": graphs, "grad_accum": grad_accum})
    trainer = Trainer(config)
    assert trainer.optimization.bf16 is not None
    for _ in range(2):  # the capture, the step's plan and the kernels' first launches (compiles) happen here
        trainer.finish_step(trainer.launch_step())
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = trainer.launch_step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    record = trainer.finish_step(launched)
    assert launched.state.step == 3 and math.isfinite(record["loss"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 autocast trains on a GPU")
@pytest.mark.parametrize("case", sorted(AUTO_GRAPHED))
def test_bf16_weights_train_as_float32_weights(tmp_path: Path, corpus: Path, case: str) -> None:
    """train.bf16_weights (auto: on, under the default CUDA graphs) against float32 weights: the same
    curves to the eager graphs' tolerance (the update rounds in another order); the checkpoint holds
    float32 weights, and a resume with float32 weights continues it."""
    block, routing, moe = AUTO_GRAPHED[case]
    runs = {}
    for bf16 in (False, "auto"):
        config = make_config(tmp_path / str(bf16), corpus, model={"block_pattern": ["dense", block]}, routing=routing,
                             moe=moe, train={"device": "cuda", "max_steps": 4, "warmup_steps": 2, "eval_interval": 2,
                                             "bf16_weights": bf16})
        trainer = Trainer(config)
        assert (trainer.optimization.bf16 is not None) is (bf16 == "auto")
        runs[bf16] = trainer.run()
    assert_same_curves(runs[False], runs["auto"], "eager")
    weights = torch.load(tmp_path / "auto" / CHECKPOINT, weights_only=False)["model"]
    assert all(t.dtype == torch.float32 for t in weights.values() if t.is_floating_point())
    config = make_config(tmp_path / "auto", corpus, model={"block_pattern": ["dense", block]}, routing=routing, moe=moe,
                         train={"device": "cuda", "max_steps": 6, "warmup_steps": 2, "eval_interval": 2,
                                "bf16_weights": False})
    assert [r["step"] for r in Trainer(config, resume=True).run() if "loss" in r] == [5, 6]


# How a run with bf16 weights may run its micro-batches (train settings)
MICRO_BATCH_RUNS = {"plain eager": {"cuda_graphs": False}, "cuda graphs": {},
                    "cuda graphs, update overlapped": {"overlap_update": True}, "compiled": GRAPHS["compiled"]}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 autocast trains on a GPU")
@pytest.mark.parametrize("run", sorted(MICRO_BATCH_RUNS))
@pytest.mark.parametrize("case", ["mod", "mode_staged", "mode_integrated copy and constant slots"])
def test_bf16_weights_with_micro_batches_train_as_float32_weights(tmp_path: Path, corpus: Path, case: str,
                                                                   run: str) -> None:
    """train.grad_accum=2 with bf16 weights (auto: on) against float32 weights run the same way: the
    same curves to that way's tolerance, the matrices' gradients summed in float32 (they keep no
    .grad of their own), in plain eager, under the CUDA graphs (the first micro-batch's graph starts
    the sums, the second's adds to them), with the update overlapped, and compiled."""
    block, routing, moe = AUTO_GRAPHED[case]
    runs = {}
    for bf16 in (False, "auto"):
        train = {k: v for k, v in MICRO_BATCH_RUNS[run].items() if bf16 or k != "overlap_update"}
        config = make_config(tmp_path / str(bf16), corpus, model={"block_pattern": ["dense", block]}, routing=routing,
                             moe=moe, train={"device": "cuda", "max_steps": 4, "warmup_steps": 2, "eval_interval": 2,
                                             "grad_accum": 2, "bf16_weights": bf16, **train})
        trainer = Trainer(config)
        assert (trainer.optimization.bf16 is not None) is (bf16 == "auto")
        runs[bf16] = trainer.run()
        if bf16:
            summed = trainer.optimization.summed_params
            assert summed and all(p.grad is None for p in summed)
            assert (trainer.optimization.deferred is not None) is ("overlapped" in run)
    assert_same_curves(runs[False], runs["auto"], "compiled" if run == "compiled" else "eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 weights and CUDA graphs train on a GPU")
@pytest.mark.parametrize("case", sorted(AUTO_GRAPHED))
def test_the_update_overlapped_with_the_next_forward_trains_as_in_the_step(tmp_path: Path, corpus: Path,
                                                                          case: str) -> None:
    """train.overlap_update=auto (on with bf16 weights under the default CUDA graphs) against the
    update in the step: the same curves to the eager graphs' tolerance (the same kernels; only
    atomics' order may differ), with an evaluation between steps (a flush) and the checkpoint at
    the end holding the last step's weights, from which a run in the step resumes."""
    block, routing, moe = AUTO_GRAPHED[case]
    runs = {}
    for overlap in (False, "auto"):
        config = make_config(tmp_path / str(overlap), corpus, model={"block_pattern": ["dense", block]},
                             routing=routing, moe=moe, train={"device": "cuda", "max_steps": 5, "warmup_steps": 2,
                                                              "eval_interval": 2, "overlap_update": overlap})
        trainer = Trainer(config)
        assert (trainer.optimization.deferred is not None) is (overlap == "auto")
        runs[overlap] = trainer.run()
        assert trainer.optimization.deferred is None or not trainer.optimization.deferred.maybe_staged
    assert_same_curves(runs[False], runs["auto"], "eager")
    config = make_config(tmp_path / "auto", corpus, model={"block_pattern": ["dense", block]}, routing=routing, moe=moe,
                         train={"device": "cuda", "max_steps": 7, "warmup_steps": 2, "eval_interval": 2,
                                "overlap_update": False})
    resumed = Trainer(config, resume=True).run()
    assert [r["step"] for r in resumed if "loss" in r] == [6, 7]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 weights and CUDA graphs train on a GPU")
def test_a_capture_mid_run_applies_the_staged_update_once(tmp_path: Path, corpus: Path) -> None:
    """An annealed capacity (routing.capacity_schedule) captures the graph again mid-run, with an
    update staged: the capture's warm-up passes apply it once, and the curve is the update in the
    step's."""
    runs = {}
    for overlap in (False, "auto"):
        config = make_config(tmp_path / str(overlap), corpus,
                             routing={"capacity": 0.25, "capacity_schedule": {"start": 1.0, "steps": 4, "stages": 2}},
                             train={"device": "cuda", "max_steps": 6, "warmup_steps": 2, "eval_interval": 3,
                                    "overlap_update": overlap})
        runs[overlap] = Trainer(config).run()
    assert_same_curves(runs[False], runs["auto"], "eager")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphed_resume_continues_the_same_curve(tmp_path: Path, corpus: Path) -> None:
    """Under the default CUDA graphs a resumed run captures again: with random routing it must draw
    what the uninterrupted run drew (the warm-up passes draw nothing), so the curves agree."""
    def cfg(out: Path, max_steps: int) -> Config:
        return make_config(out, corpus, routing={"random": True},
                           train={"device": "cuda", "max_steps": max_steps, "checkpoint_interval": 4})

    Trainer(cfg(tmp_path / "a", 8)).run()
    Trainer(cfg(tmp_path / "b", 4)).run()
    Trainer(cfg(tmp_path / "b", 8), resume=True).run()
    losses_a, losses_b = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert sorted(losses_a) == sorted(losses_b) == list(range(1, 9))
    for step in range(1, 9):  # the same kernels in the same order: only atomics' order may differ
        assert losses_b[step] == pytest.approx(losses_a[step], abs=GRAPHED_TOLERANCE["eager"][0]), step


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_default_cuda_graphs_give_way_to_a_layer_reading_the_host(tmp_path: Path, corpus: Path) -> None:
    """Dropless token choice on grouped_gemm sizes its groups on the host: under auto the run trains
    plain eager and says why, naming the layer (true refuses it at the config:
    test_eager_cuda_graphs_are_validated)."""
    pytest.importorskip("grouped_gemm")  # the GPU extras (README): test_moe's grouped_gemm tests need them too
    moe = {"scheme": "token_choice", "dropless": True, "backend": "grouped_gemm"}
    trainer = Trainer(make_config(tmp_path / "run", corpus, model={"block_pattern": ["dense", "moe"]}, moe=moe,
                                  train={"device": "cuda", "max_steps": 2, "warmup_steps": 1}))
    assert trainer.graphed_step is None and trainer.optimization.keep_grads is False
    assert trainer.notes == ["train.cuda_graphs=auto: plain eager, since blocks.1.ffn reads its routing on the host: "
                             "token choice on moe.backend=grouped_gemm sizes its expert groups there"]
    assert [r["step"] for r in trainer.run() if "loss" in r] == [1, 2]


# The graphed run's peak reserved memory against plain eager's, each a fresh process: 1.36 x on
# an H100 for this test's model (the graph's pool is held from step to step, evaluation and the
# optimizer allocate beside it). Had the warm-up passes' cached blocks not been handed back before
# the capture (torch.cuda.graph does it), both pools would add up: about 2 x.
GRAPHED_MEMORY_RATIO = 1.7
_PEAK_RESERVED = """
import sys, torch
from mode.config import load_config
from mode.training.trainer import Trainer
Trainer(load_config(sys.argv[1], [])).run()
print(torch.cuda.max_memory_reserved())
"""


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_graphed_training_reserves_little_more_than_plain_eager(tmp_path: Path, corpus: Path) -> None:
    """The default graphs a GPU run: it must fit where plain eager fits, give or take the graph's
    pool. Each run in a fresh process, as training runs (false: plain eager, if it does not)."""
    def peak_reserved(name: str, graphs: bool) -> int:
        path = write_config_file(tmp_path / f"{name}.yaml", tmp_path / name, corpus,
                                 model={"d_model": 512, "n_heads": 8, "n_layers": 4, "d_ff": 1536, "max_seq_len": 2048},
                                 data={"seq_len": 2048}, train={"device": "cuda", "batch_size": 8, "max_steps": 3,
                                                                "warmup_steps": 1, "cuda_graphs": graphs})
        done = subprocess.run([sys.executable, "-c", _PEAK_RESERVED, str(path)], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent.parent, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        return int(done.stdout.split()[-1])

    plain, graphed = peak_reserved("plain", False), peak_reserved("graphs", True)
    print(f"peak reserved: plain eager {plain / 2**20:.0f} MiB, graphed {graphed / 2**20:.0f} MiB ({graphed / plain:.2f} x)")
    assert graphed <= GRAPHED_MEMORY_RATIO * plain


def test_cuda_graphs_default_to_auto(tmp_path: Path, corpus: Path) -> None:
    """train.cuda_graphs is auto unless set: plain eager on a CPU (no note) and beside torch.compile,
    and in a multi-process run whose engine a graph cannot hold (with a note giving the engine's
    reason, and for a routed model that compile takes its launches off the host); only true, false
    or auto are read."""
    assert TrainConfig().cuda_graphs == "auto"
    make_config(tmp_path / "run", corpus, train={"compile": True})  # auto gives way to compile
    trainer = Trainer(make_config(tmp_path / "run", corpus))
    assert trainer.graphed_step is None and trainer.optimization.keep_grads is False and trainer.notes == []
    config = make_config(tmp_path / "other", corpus, train={"device": "cuda"})
    refusal = "parallel.zero_stage=2: the engine's reason"
    graphed, note = eager_graphs(config, torch.device("cuda"), trainer.model, engine_refusal=refusal)
    assert graphed is False and "plain eager" in note and refusal in note
    assert "--train.compile=true" in note  # a routed model's eager step is host-bound: the note says what helps
    dense = make_config(tmp_path / "dense", corpus, model={"block_pattern": ["dense"]}, train={"device": "cuda"})
    _, note = eager_graphs(dense, torch.device("cuda"), LanguageModel(dense), engine_refusal=refusal)
    assert "plain eager" in note and "compile" not in note
    config.train.cuda_graphs = True
    with pytest.raises(ConfigError, match=r"train\.cuda_graphs=true: parallel\.zero_stage=2: the engine's reason"):
        eager_graphs(config, torch.device("cuda"), trainer.model, engine_refusal=refusal)
    assert eager_graphs(make_config(tmp_path / "other", corpus, train={"compile": True}), torch.device("cuda"),
                        trainer.model) == (False, None)
    for bad in ("yes", 1, "always"):
        with pytest.raises(ConfigError, match=r"train\.cuda_graphs"):
            make_config(tmp_path / "other", corpus, train={"cuda_graphs": bad})
    assert load_config(None, ["--train.cuda_graphs=auto"]).train.cuda_graphs == "auto"
    assert load_config(None, ["--train.cuda_graphs=false"]).train.cuda_graphs is False


def test_eager_cuda_graphs_are_validated(tmp_path: Path, corpus: Path) -> None:
    """train.cuda_graphs: refused with compile (that is compile_mode=reduce-overhead), with
    token choice on a grouped backend (host-sized groups), and on a CPU device, naming the field;
    no run folder is made. Dropless token choice on torch passes the config (the trainer checks
    its device: test_cuda_graphed_training_matches_eager)."""
    with pytest.raises(ConfigError, match=r"train: cuda_graphs=true .* compile_mode=reduce-overhead"):
        make_config(tmp_path / "run", corpus, train={"cuda_graphs": True, "compile": True})
    with pytest.raises(ConfigError, match=r"train\.cuda_graphs needs static shapes"):
        make_config(tmp_path / "run", corpus, model={"block_pattern": ["moe"]},
                    moe={"scheme": "token_choice", "dropless": True, "backend": "grouped_gemm"}, train={"cuda_graphs": True})
    # Expert choice and token choice with a capacity (or dropless) on torch pass the config.
    make_config(tmp_path / "run", corpus, model={"block_pattern": ["mod", "moe"]}, train={"cuda_graphs": True})
    make_config(tmp_path / "run", corpus, model={"block_pattern": ["moe"]}, moe={"scheme": "token_choice", "dropless": True},
                train={"cuda_graphs": True})
    config = make_config(tmp_path / "run", corpus, train={"cuda_graphs": True, "device": "cpu"})
    with pytest.raises(ConfigError, match=r"train\.cuda_graphs needs a CUDA device"):
        Trainer(config)
    assert not (tmp_path / "run").exists()


# ------------------------------------------------------------------ reading a step's statistics
def _reference_summary(routing) -> dict[str, Any]:
    """Each value read on its own, the obvious way."""
    from mode.training.router_stats import processed_fraction

    gates = routing.gates.detach().float()
    out = {
        "processed": float(routing.stats["processed"]) if "processed" in routing.stats else float(processed_fraction(routing)),
        "gate_mean": float(gates.mean()),
        "gate_std": float(gates.std(correction=0)),  # the population spread
    }
    for name, value in routing.stats.items():
        value = value.detach().float()
        out[name] = float(value) if value.numel() == 1 else [round(float(v), 5) for v in value.flatten()]
    return out


@pytest.mark.parametrize("block", ["mod", "moe", "mode_integrated"])
def test_read_output_equals_reading_each_value(tmp_path: Path, corpus: Path, block: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's losses, router statistics and gradient norm come from the device in one transfer,
    with the values (and rounding) of reading each one on its own."""
    from mode.training.router_stats import HostCopy, read_output, routed_layers

    config = make_config(tmp_path / "run", corpus, model={"block_pattern": ["dense", block]},
                         moe={"n_noop": 2}, routing={"causal": "aux_loss"}, train={"grad_accum": 2})
    model = LanguageModel(config)
    x = torch.randint(0, 256, (4, 32))
    out = model(x, x)
    losses, summaries = read_output(out, ("loss", "lm_loss", "aux_loss"))
    assert losses == {key: float(getattr(out, key).detach()) for key in ("loss", "lm_loss", "aux_loss")}
    layers = list(routed_layers(out))
    assert layers and summaries == {name: _reference_summary(r) for name, r in layers}

    transfers = []

    counted_init = HostCopy.__init__

    def counting_init(self: HostCopy, tensors: list[torch.Tensor]) -> None:
        transfers.append(len(tensors))
        counted_init(self, tensors)

    monkeypatch.setattr(HostCopy, "__init__", counting_init)
    record = Trainer(config).train_step()
    assert len(transfers) == 1  # one per step (two micro-batches), whatever the number of statistics
    assert set(record["routing"]) == {name for name, _ in layers}


def test_pool_summaries_equals_the_statistics_of_the_whole_batch() -> None:
    """Two ranks' statistics pooled = those of both ranks' tokens at once: means average, counts
    add, and the spread pools through the second moment."""
    from mode.training.router_stats import pool_summaries

    gates = [torch.rand(40, dtype=torch.float64), torch.rand(40, dtype=torch.float64)]
    counts = [[3.0, 5.0], [4.0, 1.0]]

    def summary(g: torch.Tensor, c: list[float], processed: float) -> dict:
        return {"layer1": {"processed": processed, "gate_mean": float(g.mean()), "gate_std": float(g.std(correction=0)),
                           "tokens_per_expert": c}}

    ranks = [summary(g, c, p) for g, c, p in zip(gates, counts, (0.25, 0.75))]

    def flat(s: dict) -> list[float]:  # what each rank sends: the spread as a second moment
        st = s["layer1"]
        return [st["processed"], st["gate_mean"], st["gate_std"] ** 2 + st["gate_mean"] ** 2, *st["tokens_per_expert"]]

    def mean_over_two_ranks(values: list[float]) -> list[float]:
        assert values == flat(ranks[0])  # called on rank 0 with its own values
        return [(a + b) / 2 for a, b in zip(flat(ranks[0]), flat(ranks[1]))]

    (pooled,) = pool_summaries([ranks[0]], mean_over_two_ranks, world_size=2)
    whole = torch.cat(gates)
    assert pooled["layer1"]["processed"] == pytest.approx(0.5, rel=1e-12)
    assert pooled["layer1"]["gate_mean"] == pytest.approx(float(whole.mean()), rel=1e-12)
    assert pooled["layer1"]["gate_std"] == pytest.approx(float(whole.std(correction=0)), rel=1e-9)
    assert pooled["layer1"]["tokens_per_expert"] == [7.0, 6.0]


@pytest.mark.parametrize("sum_counts", [False, True])
def test_average_summaries_pools_the_spread_of_every_micro_batch(sum_counts: bool) -> None:
    """Micro-batches (of a step, or validation batches) pool like processes: the spread of all
    their gates through the second moment, not the mean of their spreads (which reads low when
    the micro-batches' means differ); means average, counts add over a step's micro-batches."""
    from mode.training.router_stats import average_summaries

    gates = [torch.rand(40, dtype=torch.float64) * 0.2, 0.6 + torch.rand(40, dtype=torch.float64) * 0.2]
    summaries = [{"layer1": {"gate_mean": float(g.mean()), "gate_std": float(g.std(correction=0)),
                             "tokens_per_expert": [float(i), 2.0]}} for i, g in enumerate(gates)]
    whole = torch.cat(gates)
    stats = average_summaries(summaries, sum_counts=sum_counts)["layer1"]
    assert stats["gate_mean"] == pytest.approx(float(whole.mean()), abs=1e-5)  # rounded to 5 decimals
    assert stats["gate_std"] == pytest.approx(float(whole.std(correction=0)), abs=2e-5)
    assert stats["gate_std"] > max(summaries[0]["layer1"]["gate_std"], summaries[1]["layer1"]["gate_std"]) + 0.1
    assert stats["tokens_per_expert"] == ([1.0, 4.0] if sum_counts else [0.5, 2.0])


@pytest.mark.parametrize("batches", [1, 3])
def test_average_summaries_keeps_a_small_spread(batches: int) -> None:
    """Gates near 0.5 with a spread of 1e-3 (sigmoid gates early in training, expert choice's
    softmax gates): the pooled spread is the spread, not the rounding of the mean (read 0.0 or
    several times too large when the rounded mean entered E[g^2] - mean^2)."""
    from mode.training.router_stats import average_summaries

    generator = torch.Generator().manual_seed(3)
    gates = [0.5 + 1e-4 * i + 1e-3 * torch.randn(64, generator=generator, dtype=torch.float64) for i in range(batches)]
    summaries = [{"layer1": {"gate_mean": float(g.mean()), "gate_std": float(g.std(correction=0))}} for g in gates]
    spread = float(torch.cat(gates).std(correction=0))
    assert 5e-4 < spread < 2e-3
    assert average_summaries(summaries)["layer1"]["gate_std"] == pytest.approx(spread, rel=2e-2)


@pytest.mark.parametrize("seq_len", [12, 20, 40, 256])
def test_position_share_reads_a_uniform_router_as_uniform_whatever_the_sequence_length(seq_len: int) -> None:
    """Buckets hold unequal numbers of positions where 16 does not divide seq_len (and sequences
    shorter than 16 get one bucket a position): each bucket's share is per position it holds."""
    from mode.training.router_stats import (
        position_bins,
        position_histogram,
        position_share,
    )

    bins = position_bins(seq_len)
    positions = torch.arange(seq_len).repeat(3)  # every position chosen three times
    share = position_share(position_histogram(positions, seq_len, bins), seq_len)
    assert len(share) == min(16, seq_len)
    assert share == pytest.approx([1 / bins] * bins, abs=1e-4)
    late = position_share(position_histogram(torch.arange(seq_len // 2, seq_len), seq_len, bins), seq_len)
    assert sum(late[: bins // 2 - 1]) == 0 and sum(late) == pytest.approx(1.0, abs=SHARE_SUM_ATOL)


# ----------------------------------------------------------------------------- a FLOP budget
def test_flops_budget_sets_the_whole_steps_within_it(tmp_path: Path, corpus: Path, capsys) -> None:
    """train.flops_budget: max_steps becomes the whole steps whose training FLOPs fit (every process's
    tokens), the run stops there, and its saved config records them; under one step is an error."""
    from mode.training.optim import steps_within_budget

    config = make_config(tmp_path / "run", corpus)
    per_step = model_flops(config).train_per_token * 4 * 32  # batch 4 x seq 32, one process
    for budget, world, steps in ((3 * per_step, 1, 3), (3 * per_step * (1 - 1e-6), 1, 2), (6.5 * per_step, 2, 3)):
        config.train.flops_budget = budget
        assert steps_within_budget(config, world) == steps, (budget, world)
    config.train.flops_budget = 0.5 * per_step
    with pytest.raises(ConfigError, match=r"train\.flops_budget .* less than one step"):
        steps_within_budget(config)

    config = make_config(tmp_path / "run", corpus, train={"flops_budget": 5.5 * per_step, "max_steps": 100,
                                                          "warmup_steps": 1})
    trainer = Trainer(config)
    assert config.train.max_steps == 5
    assert trainer.notes[0].startswith("train.flops_budget=") and "in place of the config's max_steps=100" in trainer.notes[0]
    records = trainer.run()
    last = [r for r in records if "loss" in r][-1]
    assert last["step"] == 5 and last["flops"] == pytest.approx(5 * per_step) and last["flops"] <= 5.5 * per_step
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())["train"]
    assert saved["max_steps"] == 5 and saved["flops_budget"] == 5.5 * per_step
    resumed = Trainer(make_config(tmp_path / "run", corpus, train={"flops_budget": 5.5 * per_step, "max_steps": 5,
                                                                   "warmup_steps": 1}), resume=True)
    assert "in place of" not in resumed.notes[0]  # the run's own steps: nothing replaced
    resumed.close()  # built, not run: it holds the run folder until closed
    saved_config = (tmp_path / "run" / "config.yaml").read_bytes()
    with pytest.raises(ConfigError, match=r"run is at step 5, past train\.max_steps=2 \(train\.flops_budget="):
        Trainer(make_config(tmp_path / "run", corpus, train={"flops_budget": 2.5 * per_step, "warmup_steps": 1}),
                resume=True)
    assert (tmp_path / "run" / "config.yaml").read_bytes() == saved_config  # left as it was
    with pytest.raises(ConfigError, match=r"train\.flops_budget"):
        make_config(tmp_path / "inf", corpus, train={"flops_budget": float("inf")})


def test_warmup_not_below_the_run_is_a_note(tmp_path: Path, corpus: Path) -> None:
    """A run whose warmup covers all of its steps (a budget sweep's smallest point) trains, and says so;
    a warmup shorter than the run adds no note."""
    short = Trainer(make_config(tmp_path / "short", corpus, train={"max_steps": 3, "warmup_steps": 3}))
    assert any("train.warmup_steps=3 is not below max_steps=3: the learning rate reaches train.lr=0.003 only at "
               "the last step" in note for note in short.notes), short.notes
    assert learning_rate(2, short.config.train) == pytest.approx(short.config.train.lr)  # as the note says
    longer = Trainer(make_config(tmp_path / "longer", corpus, train={"max_steps": 3, "warmup_steps": 4}))
    assert any("rate never reaches train.lr=0.003" in note for note in longer.notes), longer.notes
    assert learning_rate(2, longer.config.train) < longer.config.train.lr
    usual = Trainer(make_config(tmp_path / "usual", corpus, train={"max_steps": 3, "warmup_steps": 2}))
    assert not any("warmup_steps" in note for note in usual.notes), usual.notes


# ----------------------------------------------------------------------------- what a killed run leaves
def test_resume_after_a_kill_mid_write(tmp_path: Path, corpus: Path, capsys) -> None:
    """A run killed outright (SIGKILL, out of memory) can leave metrics.jsonl's last line cut short and a
    checkpoint's temporary file beside it: --resume drops both, saying so, and continues the curve; a
    damaged line before the last is an error naming the file and line, and the file is left as it was."""
    run = tmp_path / "run"
    Trainer(make_config(run, corpus, train={"max_steps": 4, "checkpoint_interval": 2})).run()
    metrics = run / METRICS
    whole = metrics.read_text()
    metrics.write_text(whole + '{"step": 5, "flops": 1.0, "lo')  # the kill came mid-line
    stale = run / ".checkpoint.pt.abc123.tmp"
    stale.write_bytes(b"half a checkpoint")
    config = make_config(run, corpus, train={"max_steps": 6, "checkpoint_interval": 2})
    resumed = Trainer(config, resume=True)
    assert any("line" in note and "incomplete" in note for note in resumed.notes), resumed.notes
    assert any(".checkpoint.pt.abc123.tmp" in note for note in resumed.notes), resumed.notes
    assert not stale.exists() and metrics.read_text() == whole
    resumed.run()
    assert sorted(train_losses(run)) == list(range(1, 7))

    lines = metrics.read_text().splitlines()
    lines[2] = lines[2][:20]  # damaged in the middle: not a crash's doing, so not silently dropped
    damaged = "\n".join(lines) + "\n"
    metrics.write_text(damaged)
    assert main(["--config", str(_yaml(tmp_path, config)), "--resume"]) == 2
    err = capsys.readouterr().err
    assert f"{metrics}: line 3" in err, err
    assert metrics.read_text() == damaged


def _yaml(tmp_path: Path, config: Config) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config.to_dict()))
    return path


def test_cuda_generators_restore_onto_fewer_gpus(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint saved by a process that saw 3 GPUs resumes where it sees 1: the states of the GPUs
    present are restored, the others left out (set_rng_state_all would index GPUs that are not there)."""
    from mode.checkpoint import restore_cuda_rng

    restored: list[tuple[int, torch.Tensor]] = []
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.append((device, state)))
    states = [torch.full((4,), i, dtype=torch.uint8) for i in range(3)]
    restore_cuda_rng(states)
    assert [device for device, _ in restored] == [0] and torch.equal(restored[0][1], states[0])


def test_each_process_resumes_its_gpu_generator_from_the_one_the_run_computed_on(monkeypatch) -> None:
    """A multi-process run's checkpoint holds rank 0's generators: the list of every GPU its process
    saw (GPU 1's never advanced there) and the one it computed on (cuda_rng_run). Every process draws
    alike from its own GPU (routing.random), so rank 1, on GPU 1, must resume GPU 1's generator from
    cuda_rng_run, not from the list, which would restart its draws from the seed."""
    from mode.checkpoint import restore_rng

    restored: dict[int, torch.Tensor] = {}
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_rng_state", lambda state, device: restored.__setitem__(
        device if isinstance(device, int) else torch.device(device).index, state))
    advanced, seed_state = torch.full((4,), 7, dtype=torch.uint8), torch.full((4,), 1, dtype=torch.uint8)
    payload = {"rng": torch.get_rng_state(), "cuda_rng": [advanced, seed_state], "cuda_rng_run": advanced}
    restore_rng(payload, torch.device("cuda", 1))
    assert torch.equal(restored[1], advanced) and torch.equal(restored[0], advanced)
    restored.clear()
    restore_rng({**payload, "cuda_rng_run": None}, torch.device("cuda", 1))  # a checkpoint from before
    assert torch.equal(restored[1], seed_state)


# ----------------------------------------------------------------------------- audit: statistics
@pytest.mark.parametrize("block", ["moe", "mode_staged"])
def test_chosen_positions_are_positions_in_the_sequence(tmp_path: Path, corpus: Path, block: str) -> None:
    """position_share bins sequence positions: an expert-choice group of 2 sequences maps its indices back
    to (sequence, position), and a Staged MoDE block's FFN router, which indexes the depth router's chosen
    tokens, maps through the depth router's indices. Checked against a slow loop over every index."""
    from mode.training.router_stats import chosen_positions

    seq = 32
    config = make_config(tmp_path / "run", corpus, model={"block_pattern": [block]}, moe={"group_size": 2})
    model = LanguageModel(config).eval()
    out = model(torch.randint(0, 256, (4, seq)))
    got = dict(chosen_positions(out, seq))
    depth, ffn = out.routings[0], out.ffn_routings[0]
    want = []
    for g in range(ffn.positions.shape[0]):
        for index in ffn.positions[g].reshape(-1).tolist():
            if depth is None:  # group g is sequences 2g, 2g+1 end to end
                want.append(index % seq)
            else:  # group g is the chosen tokens of sequences 2g, 2g+1 (k each), end to end
                k = depth.positions.shape[1]
                sequence, rank = 2 * g + index // k, index % k
                want.append(int(depth.positions[sequence, rank]))
    assert got["layer0.ffn"].tolist() == want
    assert int(got["layer0.ffn"].max()) < seq


def test_tokens_per_expert_counts_the_whole_step_under_accumulation(tmp_path: Path, corpus: Path) -> None:
    """tokens_per_expert counts the rows of one optimizer step: grad_accum=2 of batch 2 logs what one batch
    of 4 does (expert choice: C rows of each sequence, so exactly), as processes add up theirs."""
    records = {}
    for accum, batch in ((1, 4), (2, 2)):
        config = make_config(tmp_path / f"a{accum}", corpus, model={"block_pattern": ["moe"]},
                             train={"grad_accum": accum, "batch_size": batch, "max_steps": 1})
        records[accum] = Trainer(config).run()[0]["routing"]["layer0.ffn"]
    assert records[1]["tokens_per_expert"] == records[2]["tokens_per_expert"]
    assert records[1]["processed"] == pytest.approx(records[2]["processed"], abs=0.1)


def test_ctrl_c_while_a_checkpoint_is_written_finishes_it_then_stops(tmp_path: Path, corpus: Path, capsys,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A Ctrl-C that lands while checkpoint.pt is written is held until the write ends: the checkpoint is
    the new one, the message names its step, and the exit is 130 without a traceback (an interrupt
    inside torch.save's zip writer came out as a RuntimeError and exit status 1)."""
    import signal

    real_save = torch.save

    def interrupted_save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        os.kill(os.getpid(), signal.SIGINT)  # delivered now, in the middle of the write
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", interrupted_save)
    out = tmp_path / "run"
    config_file = write_config_file(tmp_path / "x.yaml", out, corpus, train={"checkpoint_interval": 2})
    assert main(["--config", str(config_file)]) == 130
    err = capsys.readouterr().err
    assert f"{out / CHECKPOINT} holds step 2" in err and "Traceback" not in err, err
    assert load_checkpoint_file(out)["state"]["step"] == 2
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored


# ----------------------------------------------------------------------------- run folders and init_from that cannot be
@pytest.mark.parametrize("where", ["a file", "under a file"])
def test_an_out_dir_that_cannot_be_a_folder_is_one_line_naming_train_out_dir(tmp_path: Path, corpus: Path, capsys,
                                                                             where: str) -> None:
    """An errno line naming no field (a file), or a NotADirectoryError traceback (under a file), before."""
    a_file = tmp_path / "afile"
    a_file.write_text("keep me\n")
    out = a_file if where == "a file" else a_file / "run"
    config_file = write_config_file(tmp_path / "x.yaml", out, corpus)
    assert main(["--config", str(config_file)]) == 2
    err = capsys.readouterr().err
    problem = "is a file, not a folder" if where == "a file" else f"lies under {a_file}, which is a file, not a folder"
    assert err == f"error: train.out_dir: {out} {problem}\n", err
    assert a_file.read_text() == "keep me\n"


def test_a_file_that_is_not_a_checkpoint_as_init_from_is_one_line(tmp_path: Path, corpus: Path) -> None:
    """A run's config.yaml, or a torch file holding code, as train.init_from: one line naming the file,
    without torch's advice to load it with weights_only=False."""
    Trainer(make_config(tmp_path / "a", corpus, train={"max_steps": 1})).run()
    code = tmp_path / "code.pt"  # unpickling it would call a function: weights only refuses
    torch.save({"format": "mode-checkpoint-v1", "hook": RunState}, code)
    for path in (tmp_path / "a" / "config.yaml", code):
        with pytest.raises(ConfigError) as info:
            Trainer(make_config(tmp_path / "b", corpus, train={"init_from": str(path)}))
        message = str(info.value)
        assert message.startswith(f"train.init_from: {path} is not a readable checkpoint: not a checkpoint written "
                                  "by mode.train ("), message
        assert "\n" not in message and "weights_only" not in message, message
    assert not (tmp_path / "b").exists()


# ----------------------------------------------------------------------------- a run folder is one run's; stops by any signal
ROOT = Path(__file__).resolve().parents[1]


def _long_run(tmp_path: Path, corpus: Path, out: Path, *extra: str, **popen: Any) -> subprocess.Popen:
    """python -m mode.train of a run too long to end by itself, checkpointing every step."""
    config_file = write_config_file(tmp_path / "long.yaml", out, corpus,
                                    train={"max_steps": 100000, "checkpoint_interval": 1})
    return subprocess.Popen([sys.executable, "-m", "mode.train", "--config", str(config_file), *extra],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _wait_for(path: Path, process: subprocess.Popen, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert process.poll() is None and time.monotonic() < deadline, process.communicate()
        time.sleep(0.1)


def test_a_second_writer_of_a_run_folder_is_refused_naming_the_holder(tmp_path: Path, corpus: Path) -> None:
    """Two real processes: while one trains, another mode.train into its folder (a resume, here) gets one
    line naming the folder and the holder's pid, and writes nothing; once the first is killed outright
    (kill -9: no clean-up), the lock died with it and the resume trains."""
    import signal

    out = tmp_path / "run"
    first = _long_run(tmp_path, corpus, out)
    try:
        _wait_for(out / CHECKPOINT, first)
        second = subprocess.run([sys.executable, "-m", "mode.train", "--config", str(tmp_path / "long.yaml"),
                                 "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2, second.stderr
        assert second.stderr.strip() == (f"error: train.out_dir: {out} is in use by another training (pid {first.pid}); "
                                         "wait for it to end, or stop it, before writing to this folder"), second.stderr
    finally:
        first.send_signal(signal.SIGKILL)
        first.communicate()
    resumed = subprocess.run([sys.executable, "-m", "mode.train", "--config", str(tmp_path / "long.yaml"), "--resume",
                              f"--train.max_steps={load_checkpoint_file(out)['state']['step'] + 1}"],
                             cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    train_losses(out)  # one record a step: nobody else wrote


def test_an_unrun_trainer_holds_the_folder_until_closed(tmp_path: Path, corpus: Path) -> None:
    """In one process too: a built Trainer holds its folder; a refused resume releases it at once."""
    config = make_config(tmp_path / "run", corpus, train={"max_steps": 2})
    Trainer(config).run()  # run() releases the folder when it ends
    held = Trainer(make_config(tmp_path / "run", corpus, train={"max_steps": 4}), resume=True)
    with pytest.raises(ConfigError, match="is in use by another training"):
        Trainer(make_config(tmp_path / "run", corpus, train={"max_steps": 4}), resume=True)
    held.close()
    with pytest.raises(ConfigError, match="past train.max_steps=1"):  # refused after taking the lock
        Trainer(make_config(tmp_path / "run", corpus, train={"max_steps": 1}), resume=True)
    Trainer(make_config(tmp_path / "run", corpus, train={"max_steps": 4}), resume=True).run()
    assert max(train_losses(tmp_path / "run")) == 4


@pytest.mark.parametrize("how", ["timeout", "kill"])
def test_sigterm_stops_training_cleanly_and_the_run_resumes(tmp_path: Path, corpus: Path, how: str) -> None:
    """SIGTERM (a job scheduler's kill; `timeout`, which passes its own SIGTERM on) gets Ctrl-C's clean stop:
    one line saying which step the checkpoint holds, exit 143, no traceback, and --resume continues."""
    import signal

    out = tmp_path / "run"
    wrapper = ["timeout", "600"] if how == "timeout" else []
    config_file = write_config_file(tmp_path / "long.yaml", out, corpus,
                                    train={"max_steps": 100000, "checkpoint_interval": 1})
    process = subprocess.Popen([*wrapper, sys.executable, "-m", "mode.train", "--config", str(config_file)],
                               cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    _wait_for(out / CHECKPOINT, process)
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 143, err
    assert "Traceback" not in err and "stopped by SIGTERM at step" in err, err
    saved = load_checkpoint_file(out)["state"]["step"]
    assert f"{out / CHECKPOINT} holds step {saved}: continue with --resume" in err, err
    resumed = main(["--config", str(config_file), "--resume", f"--train.max_steps={saved + 1}"])
    assert resumed == 0 and max(train_losses(out)) == saved + 1


def test_signals_during_the_stops_clean_up_are_ignored(tmp_path: Path, corpus: Path) -> None:
    """A burst of Ctrl-Cs (a user pressing it again while the first one's clean-up runs): the first stops
    the run, the rest are ignored, and the line saying which step the checkpoint holds is printed."""
    import signal

    out = tmp_path / "run"
    process = _long_run(tmp_path, corpus, out)
    _wait_for(out / CHECKPOINT, process)
    for _ in range(200):
        if process.poll() is not None:
            break
        process.send_signal(signal.SIGINT)
        time.sleep(0.01)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 130, err
    assert "Traceback" not in err and "continue with --resume" in err, err


def test_ctrl_c_while_the_command_imports_is_one_line(tmp_path: Path, corpus: Path) -> None:
    """Ctrl-C (or SIGTERM) while python -m mode.train is still importing torch: one line, the signal's exit
    status, no traceback, nothing written."""
    import signal

    out = tmp_path / "run"
    config_file = write_config_file(tmp_path / "x.yaml", out, corpus)
    for number in (signal.SIGINT, signal.SIGTERM):
        process = subprocess.Popen([sys.executable, "-m", "mode.train", "--config", str(config_file)], cwd=ROOT,
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(0.5)  # the interpreter is up; torch takes seconds to import
        process.send_signal(number)
        _, err = process.communicate(timeout=60)
        assert process.returncode == 128 + number, err
        assert "Traceback" not in err and err.strip().endswith("while starting: nothing was written"), err
        assert not out.exists()


def test_a_new_run_refuses_a_folder_holding_files_a_run_writes(tmp_path: Path, corpus: Path, capsys) -> None:
    """config.yaml (here the very file given as --config, with its comments) or loss_vs_flops.png in the
    folder of a new run: one line naming them, nothing replaced. The same command stopped before training
    (its own config.yaml, byte for byte) runs again."""
    out = tmp_path / "run"
    out.mkdir()
    config_file = out / "config.yaml"
    config_file.write_text("# my notes on this experiment\n" + yaml.safe_dump(raw_config(out, corpus)))
    before = config_file.read_bytes()
    assert main(["--config", str(config_file)]) == 2
    err = capsys.readouterr().err
    assert err == (f"error: {out} holds config.yaml, which a new run would replace: choose another "
                   "--train.out_dir (or move them away)\n"), err
    assert config_file.read_bytes() == before and sorted(p.name for p in out.iterdir()) == ["config.yaml"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "loss_vs_flops.png").write_bytes(b"a plot of another run")
    elsewhere = write_config_file(tmp_path / "x.yaml", other, corpus, train={"max_steps": 1})
    assert main(["--config", str(elsewhere)]) == 2
    assert "holds loss_vs_flops.png, which a new run would replace" in capsys.readouterr().err
    assert (other / "loss_vs_flops.png").read_bytes() == b"a plot of another run"
    own = tmp_path / "own"
    mine = write_config_file(tmp_path / "y.yaml", own, corpus, train={"max_steps": 1})
    from mode.config import save_config

    own.mkdir()
    save_config(load_config(mine), own / "config.yaml")  # what the same command wrote before it was stopped
    assert main(["--config", str(mine)]) == 0


def test_a_full_disk_during_a_checkpoint_write_is_one_line_and_the_last_checkpoint_stays(
        tmp_path: Path, corpus: Path, capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    """The second checkpoint's write fails half-way with ENOSPC: one line naming the step the folder's
    checkpoint still holds (whole, loadable), exit 1, no traceback, no temporary left behind."""
    import errno

    real_save = torch.save
    calls = []

    def disk_fills(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        calls.append(1)
        if len(calls) == 2:
            f.write(b"half a checkpoint")
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", disk_fills)
    out = tmp_path / "run"
    config_file = write_config_file(tmp_path / "x.yaml", out, corpus, train={"checkpoint_interval": 2})
    assert main(["--config", str(config_file)]) == 1
    err = capsys.readouterr().err
    assert err.strip() == (f"error: cannot write the checkpoint of step 4 to {out / CHECKPOINT} (No space left on "
                           f"device); {out / CHECKPOINT} still holds step 2, whole: continue with --resume once there "
                           "is room"), err
    assert load_checkpoint_file(out)["state"]["step"] == 2
    assert not list(out.glob(".checkpoint.pt.*"))
