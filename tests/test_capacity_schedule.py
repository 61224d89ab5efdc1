"""routing.capacity_schedule: the depth routers' capacity annealed from a start value to
routing.capacity, the FLOP counter and the budget following it, resume on the same curve."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from mode.config import ConfigError
from mode.flops import train_step_flops
from mode.routing import DepthRouter
from mode.training.optim import steps_within_budget
from mode.training.trainer import Trainer
from tests.test_train import RESUME_ATOL, make_config, read_metrics, train_losses

SCHEDULE = {"start": 1.0, "steps": 6, "stages": 3}


def _config(out: Path, corpus: Path, **train):
    return make_config(out, corpus, routing={"capacity": 0.25, "capacity_schedule": SCHEDULE}, train=train)


def test_capacity_at_steps_through_the_stages(tmp_path: Path, corpus: Path) -> None:
    routing = _config(tmp_path, corpus).routing
    capacities = [routing.capacity_at(step) for step in range(8)]
    # 3 stages over 6 steps: 1.0, 0.75, 0.5 two steps each, then the target 0.25.
    assert capacities == [1.0, 1.0, 0.75, 0.75, 0.5, 0.5, 0.25, 0.25]


def test_training_routes_at_the_scheduled_capacity_and_counts_its_flops(tmp_path: Path, corpus: Path) -> None:
    config = _config(tmp_path / "run", corpus)
    seen: list[float] = []
    trainer = Trainer(config)
    launch = trainer.launch_step

    def launch_and_look():
        launched = launch()
        seen.append(_router_capacity(trainer))
        return launched

    trainer.launch_step = launch_and_look
    trainer.run()
    assert seen == [config.routing.capacity_at(step) for step in range(8)]  # after each step's launch
    records = [r for r in read_metrics(tmp_path / "run") if "loss" in r]
    assert [r["capacity"] for r in records] == [config.routing.capacity_at(r["step"] - 1) for r in records]
    flops = [0.0] + [r["flops"] for r in records]
    for step, (before, after) in enumerate(zip(flops, flops[1:])):
        assert math.isclose(after - before, train_step_flops(config, step=step), rel_tol=1e-9), step
    assert train_step_flops(config, step=0) > train_step_flops(config, step=6)  # capacity 1.0 costs more


def _router_capacity(trainer: Trainer) -> float:
    return next(m for m in trainer.model.modules() if isinstance(m, DepthRouter)).capacity


def test_flops_budget_sums_the_scheduled_steps(tmp_path: Path, corpus: Path) -> None:
    config = _config(tmp_path, corpus)
    per_step = [train_step_flops(config, step=s) for s in range(20)]
    for steps in (3, 6, 11):
        budget = sum(per_step[:steps]) + 0.5 * per_step[steps]
        config.train.flops_budget = budget
        assert steps_within_budget(config) == steps


def test_resume_mid_schedule_continues_the_same_curve(tmp_path: Path, corpus: Path) -> None:
    Trainer(_config(tmp_path / "a", corpus, max_steps=8, checkpoint_interval=3)).run()
    Trainer(_config(tmp_path / "b", corpus, max_steps=3, checkpoint_interval=3)).run()
    Trainer(_config(tmp_path / "b", corpus, max_steps=8, checkpoint_interval=3), resume=True).run()
    losses_a, losses_b = train_losses(tmp_path / "a"), train_losses(tmp_path / "b")
    assert sorted(losses_b) == list(range(1, 9))
    for step in range(1, 9):
        assert abs(losses_a[step] - losses_b[step]) <= RESUME_ATOL, (step, losses_a, losses_b)


def test_schedule_errors_name_the_field(tmp_path: Path, corpus: Path) -> None:
    with pytest.raises(ConfigError, match=r"routing\.capacity_schedule: stages \(3\) must not exceed steps \(2\)"):
        make_config(tmp_path, corpus, routing={"capacity_schedule": {"start": 1.0, "steps": 2, "stages": 3}})
    with pytest.raises(ConfigError, match=r"routing\.capacity_schedule\.start"):
        make_config(tmp_path, corpus, routing={"capacity_schedule": {"start": 1.5, "steps": 4}})
    with pytest.raises(ConfigError, match=r"routing\.capacity_schedule anneals depth routers"):
        make_config(tmp_path, corpus, model={"block_pattern": ["dense"]},
                    routing={"capacity_schedule": {"start": 1.0, "steps": 8}})
    with pytest.raises(ValueError, match="outside"):
        next(m for m in Trainer(_config(tmp_path / "r", corpus)).model.modules()
             if isinstance(m, DepthRouter)).set_capacity(0.0)


def test_routed_share_follows_the_schedule(tmp_path: Path, corpus: Path) -> None:
    """The routed block processes capacity x seq_len tokens per sequence at each stage."""
    trainer = Trainer(_config(tmp_path / "s", corpus))
    router = next(m for m in trainer.model.modules() if isinstance(m, DepthRouter))
    x = torch.randn(2, 32, 32)
    for step, k in ((0, 32), (2, 24), (4, 16), (6, 8)):
        trainer.follow_capacity_schedule(step)
        assert router(x).positions.shape == (2, k), step
