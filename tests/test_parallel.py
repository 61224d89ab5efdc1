"""Multi-process training through DeepSpeed, on CPU: 2 processes over gloo, launched from
pytest with `python -m torch.distributed.run` on launch/train.py (the user's command).

Each launch has a time limit (LAUNCH_TIMEOUT) and its whole process group is killed on
timeout or failure. Reference runs are one process, in this interpreter, through the plain
`Trainer` (torch AdamW, no DeepSpeed): the distributed runs must reproduce them.

Tolerances: both sides compute in float32 on CPU, but the distributed runs sum gradients
and losses in another order (all-reduce, all-to-all, accumulation), so they agree to
rounding. At step 1 (identical weights) that is all: FIRST_RTOL. Later, routing is
discontinuous (top-k) and routers start near ties, so a rounding-level difference in the
weights can flip one token's route: observed, up to 3e-6 relative on the loss and 6e-5 on
the gradient norm over 6 steps; LOSS_RTOL and NORM_RTOL allow 30x that (the step-1 gradient
norm and compiled runs after step 1 have their own, wider: see COMPILED_LOSS_RTOL). A parallelism
error (a missed or doubled reduction, a misplaced expert, a lost token) moves them by 1e-2
or more, from step 1.
"""
from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch
import yaml

from mode.checkpoint import load_checkpoint_file
from mode.config import ConfigError, config_from_dict, load_config
from mode.data import batch_generator, load_splits, sample_batch
from mode.model import LanguageModel
from mode.run_folder import CHECKPOINT, METRICS
from mode.training.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
LAUNCH_TIMEOUT = 240  # seconds per 2-process launch (the first one may build DeepSpeed's CPU comm op)
FIRST_RTOL = 1e-5
# The gradient norm at step 1 sums every gradient's square in another order when the batch is
# split: compiled on a 16-core H100 host it read 1.02e-5 relative from the one-process run.
FIRST_NORM_RTOL = 3e-5
LOSS_RTOL = 1e-4
NORM_RTOL = 2e-3
# Compiled, after step 1: Inductor's CPU kernels for the per-process batch and for the doubled
# batch round differently. On a 16-core H100 host (not on CI's 2 cores) the comparison came out
# differently in each of three runs (one passed): the step-3 loss up to
# 1.8e-4 and the step-3 gradient norm 2.1e-3 relative from the one-process run (the step-1
# gradient norm 1.02e-5). Step 1 is held to FIRST_RTOL / FIRST_NORM_RTOL as in every case.
COMPILED_LOSS_RTOL = 1e-3
COMPILED_NORM_RTOL = 1e-2
STEPS = 6
WORLD = 2


# ----------------------------------------------------------------------------- helpers
def raw_config(corpus: Path, out_dir: Path, **sections: dict) -> dict[str, Any]:
    """A tiny model: 2 layers, width 32, 4 experts, 32-token sequences, 2 sequences per rank."""
    raw: dict[str, Any] = {
        "model": {"d_model": 32, "n_heads": 2, "n_layers": 2, "d_ff": 64, "max_seq_len": 32,
                  "block_pattern": ["dense", "moe"]},
        "moe": {"n_experts": 4, "scheme": "expert_choice"},
        "data": {"source": "text", "path": str(corpus), "seq_len": 32},
        "train": {"batch_size": 2, "max_steps": STEPS, "lr": 3e-3, "min_lr": 3e-4, "warmup_steps": 2,
                  "grad_clip": 1.0, "log_interval": 1, "eval_interval": 100, "eval_batches": 1,
                  "checkpoint_interval": 3, "out_dir": str(out_dir), "progress": False, "device": "cpu"},
    }
    for section, values in sections.items():
        raw.setdefault(section, {}).update(values)
    return raw


def write_config(raw: dict[str, Any], path: Path) -> Path:
    path.write_text(yaml.safe_dump(raw))
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(config: Path | None, *args: str, world: int = WORLD,
          script: Path | None = None) -> tuple[list[str], subprocess.Popen]:
    """launch/train.py (or `script`, given the config's path alone, if any) started on `world`
    processes, in a process group of its own: (command, process)."""
    if script is None:
        target = [str(ROOT / "launch" / "train.py"), "--config", str(config)]
    else:
        target = [str(script)] + ([] if config is None else [str(config)])
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}", "--master_addr=127.0.0.1",
           f"--master_port={free_port()}", *target, *args]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return cmd, subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                 start_new_session=True)


@contextlib.contextmanager
def killed_on_exit(proc: subprocess.Popen) -> Iterator[None]:
    """The block's end, however it ends, leaves no process of start()'s group running."""
    try:
        yield
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def output_within(proc: subprocess.Popen, timeout: float, failure: str) -> str:
    """The process's output once it ends; past `timeout` seconds its group is killed and the test
    fails with `failure` and the output's tail."""
    try:
        return proc.communicate(timeout=timeout)[0]
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        pytest.fail(f"{failure}:\n{proc.communicate()[0][-4000:]}")


def launch(config: Path | None, *args: str, expect_ok: bool = True, world: int = WORLD,
           script: Path | None = None) -> subprocess.CompletedProcess:
    """launch/train.py (or `script`) on `world` processes; the process group is killed on timeout."""
    cmd, proc = start(config, *args, world=world, script=script)
    with killed_on_exit(proc):
        out = output_within(proc, LAUNCH_TIMEOUT, f"launch timed out after {LAUNCH_TIMEOUT} s: {' '.join(cmd)}")
    if expect_ok and proc.returncode != 0:
        pytest.fail(f"launch failed ({proc.returncode}): {' '.join(cmd)}\n{out[-6000:]}")
    return subprocess.CompletedProcess(cmd, proc.returncode, out)


def records(run_dir: Path) -> tuple[dict[int, dict], dict[int, dict]]:
    """(training records by step, evaluation records by step) of a run folder."""
    lines = [json.loads(line) for line in (run_dir / METRICS).read_text().splitlines() if line]
    return ({r["step"]: r for r in lines if "loss" in r}, {r["step"]: r for r in lines if "val_loss" in r})


def single_process(raw: dict[str, Any], out_dir: Path, world: int = WORLD) -> Path:
    """The reference: one process, the plain Trainer, the global batch of all `world` ranks at once."""
    raw = json.loads(json.dumps(raw))
    raw["train"].update(batch_size=raw["train"]["batch_size"] * world, out_dir=str(out_dir))
    raw.pop("parallel", None)
    Trainer(config_from_dict(raw)).run()
    return out_dir


def relative_tolerance(step: int, key: str, loss_rtol: float, norm_rtol: float) -> float:
    if key == "grad_norm":
        return FIRST_NORM_RTOL if step == 1 else norm_rtol
    return FIRST_RTOL if step == 1 else loss_rtol


def assert_same_curves(reference: Path, distributed: Path, steps: range, loss_rtol: float = LOSS_RTOL,
                       norm_rtol: float = NORM_RTOL) -> None:
    (ref_train, ref_val), (dist_train, dist_val) = records(reference), records(distributed)
    for step in steps:
        for key in ("loss", "lm_loss", "aux_loss", "grad_norm"):
            rtol = relative_tolerance(step, key, loss_rtol, norm_rtol)
            # The auxiliary loss is ~1e-3 of the objective and is where one flipped route shows
            # most (a z-loss over another set of chosen tokens: seen 1.5e-3 relative, 2.5e-6
            # absolute, in Staged MoDE). After step 1 it is judged on the objective's scale;
            # at step 1, where no route can have flipped, it is held to FIRST_RTOL.
            atol = loss_rtol * ref_train[step]["loss"] if key == "aux_loss" and step > 1 else 1e-7
            assert dist_train[step][key] == pytest.approx(ref_train[step][key], rel=rtol, abs=atol), (step, key)
    assert set(dist_val) == set(ref_val)
    for step in ref_val:
        assert dist_val[step]["val_loss"] == pytest.approx(ref_val[step]["val_loss"], rel=loss_rtol), step
    assert_same_routing(ref_train[1]["routing"], dist_train[1]["routing"])


def assert_same_routing(reference: dict[str, dict[str, Any]], distributed: dict[str, dict[str, Any]]) -> None:
    """Router statistics of step 1 (identical weights): every rank's share pooled equals the whole
    batch in one process (means averaged, tokens_per_expert summed, the spread pooled).

    Not lb_loss: each rank's load-balancing loss is a product of means over its own tokens (as
    in DeepSpeed), so the pooled value is the mean of the ranks' losses, which the distributed
    run optimises, not the loss of the whole batch at once.
    """
    assert set(distributed) == set(reference)
    for layer, stats in reference.items():
        assert set(distributed[layer]) == set(stats), layer
        for name, value in stats.items():
            if name == "lb_loss":
                continue
            # 5e-5: statistics are logged rounded to 5 decimals.
            assert distributed[layer][name] == pytest.approx(value, rel=FIRST_RTOL, abs=5e-5), (layer, name)


# ----------------------------------------------------------------------------- data parallel
@pytest.fixture(scope="module")
def data_parallel(corpus, tmp_path_factory) -> dict[str, Any]:
    """2 processes, ZeRO 1, gradient accumulation 2, MoD + MoE blocks, no expert parallelism."""
    tmp = tmp_path_factory.mktemp("dp")
    raw = raw_config(corpus, tmp / "dist", model={"block_pattern": ["mod", "moe"]}, routing={"capacity": 0.25},
                     train={"grad_accum": 2}, parallel={"zero_stage": 1, "expert_parallel": 1})
    config = write_config(raw, tmp / "config.yaml")
    launch(config)
    return {"raw": raw, "config": config, "dir": tmp / "dist", "tmp": tmp}


def test_data_parallel_equals_one_process_with_the_doubled_batch(data_parallel):
    reference = single_process(data_parallel["raw"], data_parallel["tmp"] / "single")
    assert_same_curves(reference, data_parallel["dir"], range(1, STEPS + 1))
    train, _ = records(data_parallel["dir"])
    assert train[STEPS]["tokens"] == STEPS * 2 * 2 * WORLD * 32  # grad_accum * batch * world * seq
    assert train[STEPS]["processes"] == WORLD and records(reference)[0][STEPS]["processes"] == 1


def test_a_multi_process_checkpoint_evaluates_on_its_global_batch(data_parallel):
    """mode.evaluate on a 2-process run's checkpoint: one process, the global batch of both
    (batch_size x 2), repeats the run's last evaluation (to rounding: the sums run in another order)."""
    from mode.evaluate import evaluate_checkpoint

    _, evals = records(data_parallel["dir"])
    last = evals[max(evals)]
    result = evaluate_checkpoint(data_parallel["dir"], data_parallel["raw"]["train"]["eval_batches"], "cpu")
    assert result["step"] == max(evals) and result["processes"] == WORLD
    assert result["val_loss"] == pytest.approx(last["val_loss"], rel=LOSS_RTOL)


def test_stop_after_checkpoint_and_resume_continues_the_run(data_parallel):
    """Stop after step 4 (checkpoint at 3, step 4 logged), resume: steps 4-6 as uninterrupted."""
    out = data_parallel["tmp"] / "resumed"
    args = [f"--train.out_dir={out}"]
    stopped = launch(data_parallel["config"], *args, "--stop-at-step=4")
    assert f"stopped by --stop-at-step at step 4; {out / CHECKPOINT} holds step 3: continue with --resume" in stopped.stdout
    first, _ = records(out)
    assert sorted(first) == [1, 2, 3, 4] and not (out / "deepspeed" / "step6").exists()
    assert (out / "loss_vs_flops.png").is_file()
    for folder in ("my_notes", "step1"):  # a user's files beside DeepSpeed's tags: never the run's to delete
        (out / "deepspeed" / folder).mkdir()
        (out / "deepspeed" / folder / "notes.txt").write_text("keep me")
    resumed_run = launch(data_parallel["config"], *args, "--resume", "--train.eval_interval=50")
    assert resumed_run.stdout.count("note: --resume changes train.eval_interval (100 there, 50 here)") == 1  # rank 0 alone
    resumed, resumed_val = records(out)
    uninterrupted, uninterrupted_val = records(data_parallel["dir"])
    assert sorted(resumed) == list(range(1, STEPS + 1))  # step 4 logged once: the stale record was dropped
    for step in range(1, STEPS + 1):
        assert resumed[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], rel=1e-6), step
    assert resumed_val[STEPS]["val_loss"] == pytest.approx(uninterrupted_val[STEPS]["val_loss"], rel=1e-6)
    payload = load_checkpoint_file(out / CHECKPOINT)
    assert payload["state"]["step"] == STEPS and payload["optimizer"]["tag"] == f"step{STEPS}"
    assert sorted(p.name for p in (out / "deepspeed").iterdir() if p.is_dir()) == ["my_notes", "step1", "step3", "step6"]
    assert all((out / "deepspeed" / f / "notes.txt").read_text() == "keep me" for f in ("my_notes", "step1"))


def test_launch_arguments_and_environment_are_clear_errors(tmp_path, monkeypatch, capsys):
    """launch/train.py's own flag and its need for a launcher: one error line, exit 2, before any
    process group (in this process, as rank 0)."""
    from mode.parallel.launch import main as launch_main

    config = tmp_path / "x.yaml"
    config.write_text("model: {block_pattern: [dense, moe]}\n")
    for bad in (["--stop-at-step"], ["--stop-at-step=abc"], ["--stop-at-step", "0"]):
        assert launch_main(["--config", str(config), *bad]) == 2
        assert "error: --stop-at-step needs a number of optimizer steps >= 1" in capsys.readouterr().err
    for name in ("RANK", "LOCAL_RANK", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert launch_main(["--config", str(config)]) == 2
    assert "runs one process per GPU under a launcher: torchrun" in capsys.readouterr().err


def test_a_config_error_is_printed_once(tmp_path):
    """Every rank reads the same config: rank 0 alone reports it, in one line."""
    config = tmp_path / "x.yaml"
    config.write_text("model: {block_pattern: [dense, moe]}\nparallel: {expert_parallel: 3}\n")
    out = launch(config, "--train.device=cpu", expect_ok=False).stdout
    assert out.count("error: invalid config") == 1, out
    assert "parallel.expert_parallel (3) must divide moe.n_experts (8)" in out


def test_expert_parallel_without_experts_is_refused():
    with pytest.raises(ConfigError, match=r"parallel\.expert_parallel \(2\) shards experts, and model\.block_pattern"):
        load_config(None, ["--model.block_pattern=[dense, mod]", "--parallel.expert_parallel=2"])


# ----------------------------------------------------------------------------- expert parallel
EXPERT_CASES = {
    # Expert choice routes within each sequence: independent of how the batch is split.
    "moe_expert_choice": dict(parallel={"zero_stage": 0}),
    # Token choice routes over a rank's whole batch: capacity and the load-balancing loss
    # depend on the batch split (data parallelism), so the comparison uses dropless routing
    # without that loss; the expert computation itself is per token.
    "moe_token_choice": dict(moe={"n_experts": 4, "scheme": "token_choice", "top_k": 2, "dropless": True,
                                  "lb_loss_weight": 0.0}, parallel={"zero_stage": 1}),
    "mode_integrated": dict(model={"block_pattern": ["dense", "mode_integrated"]},
                            moe={"n_experts": 4, "n_noop": 4}, parallel={"zero_stage": 2}),
    "mode_staged": dict(model={"block_pattern": ["dense", "mode_staged"]}, routing={"capacity": 0.5},
                        parallel={"zero_stage": 0}),
    # torch.compile with expert parallelism: the all-to-all inside the compiled model.
    "mode_integrated_compiled": dict(model={"block_pattern": ["dense", "mode_integrated"]},
                                     moe={"n_experts": 4, "n_noop": 4}, train={"compile": True},
                                     parallel={"zero_stage": 1}),
}


@pytest.fixture(scope="module")
def expert_runs() -> dict[str, dict[str, Any]]:
    """Expert-parallel runs by case name, launched once and shared by the tests below."""
    return {}


def expert_parallel_run(name: str, corpus: Path, tmp_path_factory, cache: dict) -> dict[str, Any]:
    """The 2-process, expert_parallel=2 run of EXPERT_CASES[name] (launched on first use)."""
    if name not in cache:
        tmp = tmp_path_factory.mktemp(name)
        sections = EXPERT_CASES[name]
        raw = raw_config(corpus, tmp / "dist", **{k: dict(v) for k, v in sections.items()})
        raw["parallel"]["expert_parallel"] = WORLD
        launch(write_config(raw, tmp / "config.yaml"))
        cache[name] = {"raw": raw, "dir": tmp / "dist", "tmp": tmp}
    return cache[name]


@pytest.mark.parametrize("name", list(EXPERT_CASES))
def test_expert_parallel_equals_one_process_holding_every_expert(name, corpus, tmp_path_factory, expert_runs):
    run = expert_parallel_run(name, corpus, tmp_path_factory, expert_runs)
    reference = single_process(run["raw"], run["tmp"] / "single")
    if run["raw"]["train"].get("compile", False):
        assert_same_curves(reference, run["dir"], range(1, STEPS + 1), COMPILED_LOSS_RTOL, COMPILED_NORM_RTOL)
    else:
        assert_same_curves(reference, run["dir"], range(1, STEPS + 1))


def test_expert_parallel_run_under_zero_2_resumes_as_uninterrupted(corpus, tmp_path_factory, expert_runs):
    """Stop after step 4 and resume an ep=2, ZeRO 2 run (Integrated MoDE, no-op experts): each
    process's expert slice and optimizer shard come back, and steps 4-6 are the uninterrupted run's."""
    run = expert_parallel_run("mode_integrated", corpus, tmp_path_factory, expert_runs)
    config = write_config(run["raw"], run["tmp"] / "resume.yaml")
    out = run["tmp"] / "resumed"
    launch(config, f"--train.out_dir={out}", "--stop-at-step=4")
    launch(config, f"--train.out_dir={out}", "--resume")
    resumed, uninterrupted = records(out)[0], records(run["dir"])[0]
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in range(1, STEPS + 1):
        for key in ("loss", "grad_norm"):
            assert resumed[step][key] == pytest.approx(uninterrupted[step][key], rel=1e-6), (step, key)


def test_expert_parallel_checkpoint_loads_on_one_device(corpus, tmp_path_factory, expert_runs):
    """checkpoint.pt of an ep=2 run: every expert gathered, in order; a one-process model loads it."""
    run = expert_parallel_run("moe_expert_choice", corpus, tmp_path_factory, expert_runs)
    payload = load_checkpoint_file(run["dir"] / CHECKPOINT)
    config = config_from_dict(payload["config"])
    model = LanguageModel(config)
    model.load_state_dict(payload["model"])  # strict: same keys and shapes as a one-process model
    assert payload["model"]["blocks.1.ffn.experts.w_in"].shape[0] == config.moe.n_experts
    # The gathered weights give the validation loss the distributed run logged (same rows).
    model.eval()
    t = config.train
    x, y = sample_batch(load_splits(config.data).val, t.batch_size * WORLD, config.data.seq_len, batch_generator(t.seed, -1, 0))
    with torch.no_grad():
        loss = float(model(x, y).lm_loss)
    _, val = records(run["dir"])
    assert loss == pytest.approx(val[STEPS]["val_loss"], rel=FIRST_RTOL)  # same weights, one process
    # Expert e of the gathered tensor is DeepSpeed's global expert e (its per-expert files).
    tag = payload["optimizer"]["tag"]
    prefix = "blocks.1.ffn.experts"
    for e in range(config.moe.n_experts):
        shard = torch.load(run["dir"] / "deepspeed" / tag / f"layer_0_expert_{e}_mp_rank_00_model_states.pt")
        for weight in ("w_in", "w_out"):
            torch.testing.assert_close(shard[f"{prefix}.deepspeed_moe.experts.deepspeed_experts.{e}.{weight}"],
                                       payload["model"][f"{prefix}.{weight}"][e], rtol=0, atol=0)


def test_resume_with_another_layout_is_a_clear_error(corpus, tmp_path_factory, expert_runs):
    """The sharded optimizer state cannot follow another expert-parallel size; one process cannot resume it either."""
    run = expert_parallel_run("moe_expert_choice", corpus, tmp_path_factory, expert_runs)
    raw = json.loads(json.dumps(run["raw"]))
    raw["parallel"]["expert_parallel"] = 1
    config = write_config(raw, run["tmp"] / "ep1.yaml")
    result = launch(config, "--resume", expect_ok=False)
    assert result.returncode != 0 and "cannot follow" in result.stdout
    with pytest.raises(ConfigError, match="sharded over its processes"):
        Trainer(config_from_dict(run["raw"] | {"parallel": {}}), resume=True)


def test_a_shard_only_one_process_reads_missing_is_an_error_every_process_reports(corpus, tmp_path_factory,
                                                                                    expert_runs, tmp_path):
    """Rank 1's optimizer shard of an ep=2 run gone: rank 1 alone meets it, yet every process stops
    before training with one error naming the rank and the file (rank 1 left silently, and rank 0
    trained on until the all-to-all failed)."""
    run = expert_parallel_run("moe_expert_choice", corpus, tmp_path_factory, expert_runs)
    copy = tmp_path / "dist"
    shutil.copytree(run["dir"], copy)
    tag = load_checkpoint_file(copy)["optimizer"]["tag"]  # the step checkpoint.pt resumes from
    (shard,) = copy.glob(f"deepspeed/{tag}/expp_rank_1_*optim_states.pt")
    shard.unlink()
    raw = json.loads(json.dumps(run["raw"]))
    raw["train"].update(out_dir=str(copy), max_steps=STEPS + 2)
    result = launch(write_config(raw, tmp_path / "config.yaml"), "--resume", expect_ok=False)
    assert result.returncode != 0
    assert "--resume: DeepSpeed's checkpoint" in result.stdout and "[rank 1]" in result.stdout, result.stdout[-4000:]
    assert shard.name in result.stdout, result.stdout[-4000:]
    assert "[rank 0]" not in result.stdout.split("--resume: DeepSpeed's checkpoint")[1].splitlines()[0]  # rank 0 loaded
    assert max(records(copy)[0]) == STEPS  # nothing trained


def test_four_processes_with_ep_2_equal_one_process(corpus, tmp_path):
    """4 processes, ep=2: every expert lives on 2 ranks (expert-data-parallel 2), its gradient
    reduced over those 2 only, under ZeRO 2's sharded optimizer and DeepSpeed's clipping
    (a wrong group or a norm over the wrong ranks moves the gradient norm from step 1)."""
    raw = raw_config(corpus, tmp_path / "dist", parallel={"zero_stage": 2, "expert_parallel": 2})
    launch(write_config(raw, tmp_path / "config.yaml"), world=4)
    reference = single_process(raw, tmp_path / "single", world=4)
    assert_same_curves(reference, tmp_path / "dist", range(1, STEPS + 1))


def test_multi_process_run_starts_from_one_device_weights(corpus, tmp_path):
    """train.init_from a one-process checkpoint: 2 processes with ep=2 slice its experts and
    train as one process started from the same weights does."""
    source = raw_config(corpus, tmp_path / "source", train={"max_steps": 3})
    Trainer(config_from_dict(source)).run()
    raw = raw_config(corpus, tmp_path / "dist", train={"init_from": str(tmp_path / "source")},
                     parallel={"zero_stage": 0, "expert_parallel": WORLD})
    launch(write_config(raw, tmp_path / "config.yaml"))
    reference = single_process(raw, tmp_path / "single")
    assert_same_curves(reference, tmp_path / "dist", range(1, STEPS + 1))
    from_scratch, _ = records(single_process(raw_config(corpus, tmp_path / "x"), tmp_path / "scratch"))
    started, _ = records(reference)
    assert abs(started[1]["loss"] - from_scratch[1]["loss"]) > 1e-2  # the saved weights, not a fresh init


def test_one_process_through_deepspeed_equals_the_plain_trainer(corpus, tmp_path):
    """ZeRO 0 on one process skips DeepSpeed's gradient reduction (an identity there) and clips
    through the optimizer: the curve is the plain Trainer's, MoD and expert-choice MoE blocks.
    Causal predictors with a heavy loss: both clip them apart from the model by their own norm."""
    raw = raw_config(corpus, tmp_path / "dist", model={"block_pattern": ["mod", "moe"]},
                     routing={"causal": "predictor", "causal_loss_weight": 10.0},
                     parallel={"zero_stage": 0, "expert_parallel": 1})
    launch(write_config(raw, tmp_path / "config.yaml"), world=1)
    reference = single_process(raw, tmp_path / "single", world=1)
    assert_same_curves(reference, tmp_path / "dist", range(1, STEPS + 1))


def worker_ranks(launcher_pid: int, world: int) -> dict[int, int]:
    """{rank: pid} of the workers a torch.distributed.run process started (its children)."""
    found: dict[int, int] = {}
    for pid in (int(p) for p in subprocess.run(["pgrep", "-P", str(launcher_pid)], capture_output=True,
                                               text=True).stdout.split()):
        environ = dict(item.split("=", 1) for item in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in item)
        if "RANK" in environ:
            found[int(environ["RANK"])] = pid
    assert len(found) == world, found
    return found


@pytest.mark.parametrize("signalled,number", [([1], signal.SIGINT), ([0, 1], signal.SIGINT), ([0, 1], signal.SIGTERM)],
                         ids=["rank 1 alone", "every rank", "SIGTERM to every rank"])
def test_ctrl_c_stops_every_process_at_the_same_step(corpus, tmp_path, signalled: list[int], number: int) -> None:
    """SIGINT or SIGTERM to some ranks of an expert-parallel run (kill, a scheduler, a terminal's Ctrl-C):
    each rank that gets it marks a request, every rank reads the marks in the next all-reduce and
    stops at the same step. Raised where it landed, one rank could wait in the all-to-all while
    another reported its last step (an all-reduce): both hung. Each worker exits 128 + the signal
    with the stop's line, the checkpoint holds a step, and --resume continues the run. While it
    trains, rank 0 holds the run folder: another training there is refused naming rank 0's pid."""
    raw = raw_config(corpus, tmp_path / "dist", train={"max_steps": 100000, "checkpoint_interval": 2,
                                                       "eval_interval": 100000},
                     parallel={"zero_stage": 0, "expert_parallel": 2})
    _, proc = start(write_config(raw, tmp_path / "config.yaml"))
    with killed_on_exit(proc):
        metrics = tmp_path / "dist" / METRICS
        deadline = time.monotonic() + LAUNCH_TIMEOUT
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # training, past a checkpoint
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.2)
        ranks = worker_ranks(proc.pid, WORLD)
        if number == signal.SIGTERM:
            second = subprocess.run([sys.executable, "-m", "mode.train", "--config", str(tmp_path / "config.yaml"),
                                     "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=LAUNCH_TIMEOUT)
            assert second.returncode == 2 and f"is in use by another training (pid {ranks[0]})" in second.stderr, \
                second.stderr
        for rank in signalled:
            os.kill(ranks[rank], number)
        out = output_within(proc, 60, "the processes did not stop within 60 s of the signal (hung)")
    # torchrun's summary: the first worker to leave exited 128 + the signal (it then stops the others,
    # which leave at the same moment, with that status or by its SIGTERM), after rank 0 printed the stop.
    assert f"exitcode  : {128 + number}" in out and "exitcode  : 1 " not in out, out[-4000:]
    how = "interrupted" if number == signal.SIGINT else "stopped by SIGTERM"
    assert f"{how} at step" in out and "continue with --resume" in out, out[-4000:]
    assert not re.search(r'File ".*/(mode|launch)/', out), out[-4000:]  # no traceback from the workers (torchrun's own is there)
    saved = load_checkpoint_file(tmp_path / "dist")["state"]["step"]
    assert saved >= 2
    raw["train"]["max_steps"] = saved + 2
    launch(write_config(raw, tmp_path / "config.yaml"), "--resume")
    assert max(records(tmp_path / "dist")[0]) == saved + 2


# ----------------------------------------------------------------------------- config and JSON
def test_gradients_are_reduced_except_under_zero_0_on_one_process():
    from mode.parallel.engine import reduces_gradients

    config = load_config(None, [])
    for stage, world, expected in ((0, 1, False), (0, 2, True), (1, 1, True), (2, 1, True), (2, 4, True)):
        config.parallel.zero_stage = stage
        assert reduces_gradients(config, world) is expected, (stage, world)


def test_zero_stage_3_is_rejected_at_validation():
    with pytest.raises(ConfigError, match=r"parallel\.zero_stage.*ZeRO.*3.*MoE"):
        load_config(None, ["--parallel.zero_stage=3"])
    with pytest.raises(ConfigError, match=r"parallel\.expert_parallel \(3\) must divide moe\.n_experts \(8\)"):
        load_config(None, ["--model.block_pattern=[moe]", "--parallel.expert_parallel=3"])


def test_deepspeed_config_is_derived_from_the_project_config():
    from mode.parallel.engine import deepspeed_config

    config = load_config(None, ["--train.batch_size=3", "--train.grad_accum=4", "--train.grad_clip=0.5",
                                "--parallel.zero_stage=2"])
    gpu = deepspeed_config(config, world_size=8, device_type="cuda")
    assert gpu["train_micro_batch_size_per_gpu"] == 3 and gpu["gradient_accumulation_steps"] == 4
    assert gpu["train_batch_size"] == 3 * 4 * 8
    assert gpu["zero_optimization"] == {"stage": 2} and gpu["bf16"] == {"enabled": True}
    assert gpu["gradient_clipping"] == 0.5
    cpu = deepspeed_config(config, world_size=2, device_type="cpu")
    assert cpu["bf16"] == {"enabled": False} and cpu["gradient_clipping"] == 0.5
    # ZeRO 0: fp32 weights (bf16 autocast on CUDA); mode.parallel clips by the exact global norm.
    config.parallel.zero_stage = 0
    for device in ("cpu", "cuda"):
        zero0 = deepspeed_config(config, world_size=2, device_type=device)
        assert zero0["gradient_clipping"] == 0.0 and zero0["bf16"] == {"enabled": False}


def test_cuda_graphs_are_refused_through_deepspeed(tmp_path: Path) -> None:
    """launch/train.py refuses train.compile_mode=reduce-overhead, and train.cuda_graphs=true where
    a graph cannot hold the engine's backward (ZeRO 1/2), naming the fields, before it builds
    anything. ZeRO 0 is not refused; with expert parallelism, cuda_graphs=true captures the
    all-to-alls and auto trains plain eager, saying so."""
    from mode.parallel.engine import Processes, capture_refusal
    from mode.parallel.launch import build_trainer

    config = load_config(None, ["--train.compile=true", "--train.compile_mode=reduce-overhead",
                                f"--train.out_dir={tmp_path / 'run'}"])
    processes = Processes(rank=0, world_size=1, local_rank=0, device=torch.device("cpu"), backend="gloo")
    with pytest.raises(ConfigError, match="compile_mode"):
        build_trainer(config, processes)
    config = load_config(None, ["--train.cuda_graphs=true", "--parallel.zero_stage=1",
                                f"--train.out_dir={tmp_path / 'run'}"])
    assert re.match(r"parallel\.zero_stage=1", capture_refusal(config))
    with pytest.raises(ConfigError, match=r"train\.cuda_graphs=true: parallel\.zero_stage=1"):
        build_trainer(config, processes)
    assert not (tmp_path / "run").exists()
    zero0 = ["--parallel.zero_stage=0", "--model.block_pattern=[dense,moe]"]
    assert capture_refusal(load_config(None, [*zero0, "--parallel.expert_parallel=1"])) is None
    assert capture_refusal(load_config(None, [*zero0, "--parallel.expert_parallel=2", "--train.cuda_graphs=true"])) is None
    auto = capture_refusal(load_config(None, [*zero0, "--parallel.expert_parallel=2"]))
    assert re.match(r"parallel\.expert_parallel=2: .*train\.cuda_graphs=true", auto)


@pytest.mark.parametrize("blocks, ep", [(["dense", "mod"], 1), (["moe", "mode_staged"], 2)],
                         ids=["mod", "experts sharded"])
def test_the_backward_a_graph_holds_reduces_as_the_engines(corpus: Path, tmp_path: Path, blocks: list[str],
                                                           ep: int) -> None:
    """Under ZeRO 0 a CUDA graph holds DeepSpeedOptimization.captured_backward and after_replay runs
    the rest on the host: on 2 processes, with 2 micro-batches, nothing is reduced before the
    boundary and at it the gradients are the mean over ranks, as the engine's own backward gives,
    also after the engine's step dropped them (tests/captured_backward.py; CPU, no graph). With
    the experts sharded (expert_parallel=2, expert choice: equal splits; cuda_graphs=true, which
    graphs them), the experts' gradients as DeepSpeed reduces them, and the same experts dropless
    named as reading the host."""
    train = {"grad_accum": 2} if ep == 1 else {"grad_accum": 2, "cuda_graphs": True}
    raw = raw_config(corpus, tmp_path / "run", model={"block_pattern": blocks}, routing={"capacity": 0.25},
                     train=train, parallel={"zero_stage": 0, "expert_parallel": ep})
    out = launch(write_config(raw, tmp_path / "config.yaml"), script=ROOT / "tests" / "captured_backward.py").stdout
    assert "captured backward: ok" in out, out[-4000:]


@pytest.mark.parametrize("bucket_mb, grad_accum", [(0, 1), (0.01, 1), (0.01, 2)],
                         ids=["after-backward", "buckets-beside-backward", "2 micro-batches"])
def test_the_engine_holds_bf16_weights_as_one_process_does(corpus: Path, tmp_path: Path, bucket_mb: float,
                                                           grad_accum: int) -> None:
    """Under ZeRO 0 with bf16 weights the engine reduces the gradients itself (bf16 ones in bf16) and
    steps through the one-process optimizer: on 2 processes each step equals TorchOptimization
    stepped from the mean over ranks, and a checkpoint holds and restores the float32 masters
    (tests/bf16_engine.py; CPU, bf16 weights forced, autocast by hand). Both reductions: all after
    the backward, and 10 KiB buckets started within it (several a dtype at this size); with two
    micro-batches (reduced after the last backward), the matrices' gradients summed in float32 and
    reduced in float32."""
    raw = raw_config(corpus, tmp_path / "run", model={"block_pattern": ["mode_integrated", "mode_staged"]},
                     routing={"capacity": 0.25}, moe={"n_experts": 4, "n_noop": 2, "scheme": "expert_choice"},
                     parallel={"zero_stage": 0, "expert_parallel": 1, "reduce_bucket_mb": bucket_mb})
    raw["train"]["max_steps"] = 3
    raw["train"]["grad_accum"] = grad_accum
    out = launch(write_config(raw, tmp_path / "config.yaml"), script=ROOT / "tests" / "bf16_engine.py").stdout
    assert "bf16 engine: ok" in out, out[-4000:]


@pytest.mark.parametrize("world", [2, 4], ids=["ep 2 of 2 processes", "ep 2 of 4 processes"])
def test_the_engine_holds_bf16_experts_under_expert_parallelism(corpus: Path, tmp_path: Path, world: int) -> None:
    """Under ZeRO 0 with expert parallelism (ep 2) bf16 weights hold the experts too: each step's
    reduced expert gradients, gradient norm and weights follow an engine with float32 weights
    (DeepSpeed's own reduction, the exact norm) to bf16 rounding, and a checkpoint holds and
    restores the float32 masters of each rank's experts (tests/bf16_expert_parallel.py; CPU, bf16
    weights forced). On 4 processes two hold each expert: its gradient is reduced over those two."""
    raw = raw_config(corpus, tmp_path / "run", model={"block_pattern": ["mode_staged", "moe"]},
                     routing={"capacity": 0.5}, moe={"n_experts": 4, "scheme": "expert_choice"},
                     parallel={"zero_stage": 0, "expert_parallel": 2})
    raw["train"]["max_steps"] = 3
    out = launch(write_config(raw, tmp_path / "config.yaml"), script=ROOT / "tests" / "bf16_expert_parallel.py",
                 world=world).stdout
    assert "bf16 expert parallel: ok" in out, out[-4000:]


def test_expert_parallel_uneven_splits_equal_one_process_holding_every_expert() -> None:
    """ExpertParallelExperts.grouped (dropless token choice's uneven splits) on 2 gloo processes: the
    output, the rows' gradient and each process's expert weight gradients equal one process holding
    every expert, with the local experts as a loop and as one grouped GEMM reading their ends
    (tests/ep_grouped.py; CPU, float32)."""
    out = launch(None, script=ROOT / "tests" / "ep_grouped.py").stdout
    assert "ep grouped: ok" in out, out[-4000:]


def _sharded_expert(shape: tuple[int, ...]) -> torch.nn.Parameter:
    """A bf16 parameter marked as expert parallelism marks its experts (DeepSpeed's attributes)."""
    p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.bfloat16))
    p.allreduce, p.group_name = False, "ep_size_2"
    return p


def _mixed_params(shapes: list[tuple[int, ...]]) -> list[torch.nn.Parameter]:
    """A bf16 and a float32 parameter of each shape, and a sharded expert of every other one."""
    params = [torch.nn.Parameter(torch.zeros(shape, dtype=dtype)) for shape in shapes for dtype in (torch.bfloat16, torch.float32)]
    return params + [_sharded_expert(shape) for shape in shapes[::2]]


def test_flat_gradients_lay_each_view_aligned_and_apart() -> None:
    """The reduction's flat buffers: one a dtype, and one for the sharded experts (reduced over their
    own group), each parameter's view shaped as it, 16 bytes aligned (the optimizer's kernels load
    gradients whole), no two views overlapping."""
    from mode.parallel.engine import FlatGradients

    params = _mixed_params([(3,), (5, 7), (1,), (4, 9), (2, 3, 5)])
    flat = FlatGradients(params, world_size=2, backend="gloo")
    assert set(flat.buffers) == {(torch.bfloat16, None), (torch.float32, None), (torch.bfloat16, "ep_size_2")}
    spans = []
    for p, view, key in zip(params, flat.views, flat.keys, strict=True):
        assert view.shape == p.shape and view.dtype == p.dtype and view.data_ptr() % 16 == 0
        assert key == (p.dtype, getattr(p, "group_name", None))
        spans.append((view.data_ptr(), view.data_ptr() + view.numel() * view.element_size()))
    spans.sort()
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))


def test_summed_bf16_weights_sum_into_the_float32_buffer() -> None:
    """With bf16 weights summed over micro-batches, each matrix's float32 sum is its view of the
    float32 buffer (aligned, apart from the float32 gradients' views), so the backward's hooks write
    where the reduction reads; the reduction hands no .grad to a summed matrix and zeroes the sum of
    one no micro-batch reached."""
    from mode.parallel.engine import FlatGradients
    from mode.training.bf16_weights import Bf16Weights

    matrices = [torch.nn.Parameter(torch.randn(shape)) for shape in [(4, 9), (3, 5), (7,)]]
    others = [torch.nn.Parameter(torch.randn(shape)) for shape in [(5,), (2, 3)]]
    weights = Bf16Weights(matrices, sum_micro_batches=True)
    flat = FlatGradients([matrices[0], others[0], matrices[1], others[1], matrices[2]], world_size=1, backend="gloo",
                         summed=weights)
    assert set(flat.buffers) == {(torch.float32, None)}
    float32 = flat.buffers[(torch.float32, None)]
    for s in weights.sums:
        assert s.dtype == torch.float32 and s.data_ptr() % 16 == 0
        assert float32.data_ptr() <= s.data_ptr() < float32.data_ptr() + float32.numel() * 4
    assert all(flat.views[i].data_ptr() == s.data_ptr() for i, s in zip((0, 2, 4), weights.sums, strict=True))
    spans = sorted((v.data_ptr(), v.data_ptr() + v.numel() * 4) for v in flat.views)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    weights.start_sums()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = (torch.ones(2, 9) @ matrices[0].t()).float().sum() + (others[0] * 2).sum()  # matrices[1:] unreached
    loss.backward()
    weights.sums[1].fill_(7.0)  # a stale sum of an earlier step
    flat._copy_in(range(len(flat.params)))
    flat._hand_out()
    assert all(p.grad is None for p in matrices) and others[0].grad is flat.views[1]
    assert torch.equal(weights.grad(matrices[0]), torch.full((4, 9), 2.0))
    assert torch.equal(weights.sums[1], torch.zeros(3, 5)) and torch.equal(flat.views[3], torch.zeros(2, 3))


def test_gradient_buckets_tile_each_buffer_in_backward_order() -> None:
    """OverlappedGradients' buckets: each a contiguous slice of one buffer (a dtype's, or the sharded
    experts') holding whole
    parameters, together every parameter once, laid out from the last parameter to the first (the
    order the backward produces them) and closed once they reach the bucket size."""
    from mode.parallel.engine import OverlappedGradients

    params = _mixed_params([(64,), (5, 7), (1,), (300,), (2, 3, 5), (40,), (70,)])
    flat = OverlappedGradients(params, world_size=2, backend="gloo", bucket_bytes=128)
    members = sorted(i for bucket in flat.buckets for i in bucket.members)
    assert members == list(range(len(params)))
    for bucket in flat.buckets:
        assert bucket.members == sorted(bucket.members, reverse=True)
        assert all(flat.keys[i] == bucket.key for i in bucket.members)
        spans = [(flat.offsets[i], flat.offsets[i] + params[i].numel()) for i in bucket.members]
        assert spans[0][0] == bucket.start and spans[-1][1] == bucket.end
        assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
        whole = (bucket.end - bucket.start) * params[bucket.members[0]].element_size()
        assert whole >= 128 or bucket in flat.buckets[-3:]  # the last open ones
    for key in flat.buffers:
        own = [b for b in flat.buckets if b.key == key]
        assert len(own) > 1 and own[0].start == 0
        assert all(a.end <= b.start for a, b in zip(own, own[1:]))


def assert_resumed_run_continues(config: Path, out_dir: Path, uninterrupted: dict[int, dict]) -> None:
    """launch/train.py on config stopped after step 4 and resumed (from step 3's checkpoint, the
    config's interval) continues as the uninterrupted run's records: the losses within 2e-3."""
    launch(config, f"--train.out_dir={out_dir}", "--stop-at-step=4")
    launch(config, f"--train.out_dir={out_dir}", "--resume")
    resumed, _ = records(out_dir)
    assert sorted(resumed) == list(range(1, STEPS + 1))
    for step in resumed:
        assert resumed[step]["loss"] == pytest.approx(uninterrupted[step]["loss"], abs=2e-3), step


# Two-GPU graphed runs: (block pattern, train settings, parallel settings, the graphed run's cuda_graphs)
TWO_GPU_GRAPHED = {
    "mod and moe": (["mod", "moe"], {"grad_accum": 2}, {}, "auto"),
    "experts sharded, float32 weights": (["moe", "mode_staged"], {"grad_accum": 2, "bf16_weights": False},
                                         {"expert_parallel": 2}, True),
    "experts sharded, bf16 weights": (["moe", "mode_staged"], {}, {"expert_parallel": 2, "reduce_bucket_mb": 0.01},
                                      True),
}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two processes on two GPUs (NCCL)")
@pytest.mark.parametrize("case", list(TWO_GPU_GRAPHED))
def test_two_gpus_train_graphed_as_plain_eager(corpus: Path, tmp_path: Path, case: str) -> None:
    """launch/train.py on 2 GPUs under ZeRO 0: the default train.cuda_graphs=auto graphs each
    micro-batch (a note says so) and trains as plain eager (cuda_graphs=false) does: the losses
    within 2e-3 nats (bf16; only atomics' order differs), gradient norms within 5e-3 relative. MoD
    and MoE blocks with 2 micro-batches a step; the experts sharded over the GPUs
    (expert_parallel=2, cuda_graphs=true, which an EP run must ask for: an error where it cannot
    graph), their all-to-alls inside the graph, with float32 weights (DeepSpeed's reduction after
    the replay) and with bf16 weights (the project's, in buckets inside the graph).
    A graph that missed the all-reduce or an all-to-all, or read a gradient the engine's step
    dropped, is off from step 2 by far more. A graphed run stopped after step 4 and resumed from
    step 3's checkpoint (captured again) continues as the uninterrupted one."""
    blocks, train, parallel, graphed_setting = TWO_GPU_GRAPHED[case]
    runs, configs = {}, {}
    for graphs in ("false", "graphed"):
        setting = False if graphs == "false" else graphed_setting
        raw = raw_config(corpus, tmp_path / graphs, model={"block_pattern": blocks}, routing={"capacity": 0.25},
                         train={"device": "cuda", "cuda_graphs": setting, "eval_interval": 3, **train},
                         parallel={"zero_stage": 0, "expert_parallel": 1, **parallel})
        configs[graphs] = write_config(raw, tmp_path / f"{graphs}.yaml")
        out = launch(configs[graphs]).stdout
        noted = "each micro-batch's forward and backward run as one CUDA graph" in out
        assert noted is (setting == "auto") and "train.cuda_graphs=auto: plain eager" not in out, out[-4000:]
        runs[graphs] = records(tmp_path / graphs)
    (plain, plain_val), (replayed, replayed_val) = runs["false"], runs["graphed"]
    assert sorted(plain) == sorted(replayed) == list(range(1, STEPS + 1))
    for step in plain:
        assert replayed[step]["loss"] == pytest.approx(plain[step]["loss"], abs=2e-3), step
        assert replayed[step]["grad_norm"] == pytest.approx(plain[step]["grad_norm"], rel=5e-3), step
    assert set(plain_val) == set(replayed_val)
    for step in plain_val:
        assert replayed_val[step]["val_loss"] == pytest.approx(plain_val[step]["val_loss"], abs=2e-3), step
    assert_resumed_run_continues(configs["graphed"], tmp_path / "resumed", replayed)


# Two-GPU bf16 runs: (block pattern, train settings, parallel settings)
TWO_GPU_BF16 = {
    "1 micro-batch": (["mod", "mode_staged"], {}, {}),
    "2 micro-batches": (["mod", "mode_staged"], {"grad_accum": 2}, {}),
    "expert parallel": (["moe", "mode_staged"], {}, {"expert_parallel": 2}),
}


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="two processes on two GPUs (NCCL)")
@pytest.mark.parametrize("case", list(TWO_GPU_BF16))
def test_two_gpus_train_bf16_weights_as_float32_weights(corpus: Path, tmp_path: Path, case: str) -> None:
    """launch/train.py on 2 GPUs under ZeRO 0: bf16 weights (on by default there) train as float32
    weights (train.bf16_weights=false) do: the losses within 5e-3 nats, gradient norms within 2e-2
    relative (the bf16 gradients are averaged in bf16, one rounding more than float32's). Graphed,
    the bf16 run reduces in 10 KiB buckets, several of which start within the captured backward
    (NCCL inside the graph); with 2 micro-batches, the matrices' float32 sums after the last one.
    With expert parallelism (plain eager under auto: its all-to-alls are graphed with
    cuda_graphs=true only) each GPU holds half the experts in bf16, reduced and clipped as DeepSpeed
    does float32 ones. A run stopped after step 4
    and resumed from step 3's checkpoint continues as the uninterrupted one (within 2e-3): the
    checkpoint held the float32 masters."""
    blocks, train, parallel = TWO_GPU_BF16[case]
    runs, configs = {}, {}
    for name, setting in (("float32", False), ("bf16", "auto")):
        raw = raw_config(corpus, tmp_path / name, model={"block_pattern": blocks}, routing={"capacity": 0.25},
                         train={"device": "cuda", "bf16_weights": setting, **train},
                         parallel={"zero_stage": 0, "expert_parallel": 1, "reduce_bucket_mb": 0.01, **parallel})
        configs[name] = write_config(raw, tmp_path / f"{name}.yaml")
        out = launch(configs[name]).stdout
        assert "train.bf16_weights=auto" not in out, out[-4000:]  # on where asked: no note turning it off
        graphed = "each micro-batch's forward and backward run as one CUDA graph" in out
        assert graphed is ("expert_parallel" not in parallel), out[-4000:]
        runs[name], _ = records(tmp_path / name)
    float32, bf16 = runs["float32"], runs["bf16"]
    assert sorted(float32) == sorted(bf16) == list(range(1, STEPS + 1))
    losses = {step: abs(bf16[step]["loss"] - float32[step]["loss"]) for step in float32}
    print(f"bf16 weights against float32 weights, loss differences by step: {losses}")
    for step in float32:
        assert bf16[step]["loss"] == pytest.approx(float32[step]["loss"], abs=5e-3), step
        assert bf16[step]["grad_norm"] == pytest.approx(float32[step]["grad_norm"], rel=2e-2), step
    assert_resumed_run_continues(configs["bf16"], tmp_path / "resumed", bf16)


def test_launcher_exits_with_mains_code_and_its_output_written(tmp_path: Path) -> None:
    """launch/train.py leaves through os._exit (no interpreter teardown, where the gloo / DeepSpeed
    stack once aborted a finished run): the exit code is main()'s and its output is flushed."""
    missing = tmp_path / "missing.yaml"
    proc = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "--config", str(missing)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "error:" in proc.stderr and "missing.yaml" in proc.stderr


def test_a_cpu_run_takes_deepspeeds_cpu_accelerator(monkeypatch) -> None:
    """DeepSpeed picks its CUDA accelerator whenever a GPU is visible, and binds a CPU run over gloo
    to cuda:<local_rank> (on a one-GPU machine rank 1 failed: cuda:1 out of range). The run's
    device decides: here DeepSpeed is made to hold its CUDA accelerator, as on a GPU machine."""
    import deepspeed.accelerator.real_accelerator as real
    from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

    from mode.parallel.engine import match_accelerator

    monkeypatch.setattr(real, "ds_accelerator", CUDA_Accelerator())
    assert real.get_accelerator().device_name() == "cuda"
    match_accelerator("cpu")
    assert real.get_accelerator().device_name() == "cpu"
    assert real.get_accelerator().communication_backend_name() == "gloo"
    match_accelerator("cuda")
    assert real.get_accelerator().device_name() == "cuda"


def test_random_routing_on_two_processes_equals_one_process(corpus, tmp_path) -> None:
    """routing.random draws the global micro-batch's scores on every process and keeps its own rows
    (each depth router's random_rows, set by mode/parallel through set_random_score_rows): 2 processes route and train as
    one process with the doubled batch, as learned routing does. (Each process drew alike for its own
    sequences before: the loss differed by about 1e-2 after a few steps.) mode.evaluate of the checkpoint,
    one process on the global batch, repeats the run's last evaluation."""
    from mode.evaluate import evaluate_checkpoint

    raw = raw_config(corpus, tmp_path / "dist", model={"block_pattern": ["dense", "mod"]},
                     routing={"capacity": 0.25, "random": True}, parallel={"zero_stage": 0, "expert_parallel": 1})
    launch(write_config(raw, tmp_path / "config.yaml"))
    reference = single_process(raw, tmp_path / "single")
    assert_same_curves(reference, tmp_path / "dist", range(1, STEPS + 1))
    _, evals = records(tmp_path / "dist")
    result = evaluate_checkpoint(tmp_path / "dist", raw["train"]["eval_batches"], "cpu")
    assert result["val_loss"] == pytest.approx(evals[max(evals)]["val_loss"], rel=LOSS_RTOL)


def test_launcher_flags_match_by_their_whole_name(tmp_path) -> None:
    """--stop-at-step and --local_rank are matched by name, not by prefix: a typo such as
    --stop-at-steps=2 was read as --stop-at-step 2; now it reaches parse_args, which refuses it.
    Pure argument parsing: no process group, no launch."""
    from mode.parallel.launch import _launcher_args
    from mode.parallel.launch import main as launch_main

    assert _launcher_args(["--stop-at-step=4", "--x.y=1"]) == (["--x.y=1"], 4)
    assert _launcher_args(["--stop-at-step", "4"]) == ([], 4)
    assert _launcher_args(["--local_rank=1", "--local-rank", "0", "--a.b=2"]) == (["--a.b=2"], None)
    for typo in (["--stop-at-steps=2"], ["--stop-at-stepX", "3"], ["--local_rankfoo"]):
        assert _launcher_args(typo) == (typo, None)
    config = tmp_path / "x.yaml"
    config.write_text("model: {block_pattern: [dense, moe]}\n")
    with pytest.raises(SystemExit) as info:
        launch_main(["--config", str(config), "--stop-at-steps=2"])
    assert info.value.code == 2


# ----------------------------------------------------------------------------- a received run folder is safe to resume
class _RunsCode:
    """Pickled, it calls os.system on loading: what a malicious shard holds."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _poison(shard: Path, marker: Path) -> None:
    torch.save({"module": _RunsCode(marker)}, shard)


@pytest.mark.parametrize("name", ["moe_expert_choice", "moe_token_choice", "mode_integrated"])
def test_every_deepspeed_file_loads_without_running_code(name, corpus, tmp_path_factory, expert_runs, tmp_path):
    """Every file of DeepSpeed's checkpoint under ZeRO 0, 1 and 2 (model, expert and optimizer shards) loads
    through the safe loader, whose allow-list its optimizer state needs; each one, replaced by a pickle that
    runs code, is refused naming the file, and the code never runs."""
    from mode.parallel.engine import UnsafeCheckpointError, load_shard

    run = expert_parallel_run(name, corpus, tmp_path_factory, expert_runs)
    shards = sorted((run["dir"] / "deepspeed").glob("step*/*.pt"))
    assert any("optim_states" in s.name for s in shards) and any("expert" in s.name for s in shards), shards
    for shard in shards:
        assert isinstance(load_shard(shard, "cpu"), dict)
        poisoned, marker = tmp_path / shard.name, tmp_path / f"{shard.name}.ran"
        _poison(poisoned, marker)
        with pytest.raises(UnsafeCheckpointError, match=re.escape(str(poisoned))):
            load_shard(poisoned, "cpu")
        assert not marker.exists()


def test_resuming_a_run_folder_with_a_malicious_shard_runs_no_code(corpus, tmp_path_factory, expert_runs, tmp_path):
    """Every shard of the tag checkpoint.pt names replaced by a pickle that runs code: --resume stops on
    every process with one line naming a file, before training, and no code ran."""
    run = expert_parallel_run("moe_expert_choice", corpus, tmp_path_factory, expert_runs)
    copy = tmp_path / "dist"
    shutil.copytree(run["dir"], copy)
    tag = load_checkpoint_file(copy)["optimizer"]["tag"]
    markers = []
    for shard in sorted(copy.glob(f"deepspeed/{tag}/*.pt")):
        markers.append(tmp_path / f"{shard.name}.ran")
        _poison(shard, markers[-1])
    raw = json.loads(json.dumps(run["raw"]))
    raw["train"].update(out_dir=str(copy), max_steps=STEPS + 2)
    result = launch(write_config(raw, tmp_path / "config.yaml"), "--resume", expect_ok=False)
    assert result.returncode != 0
    line = next(x for x in result.stdout.splitlines() if x.startswith("error: --resume: DeepSpeed's checkpoint"))
    assert "holds objects other than tensors and plain data: refused, as loading it could run code" in line, line
    assert f"deepspeed/{tag}/" in line
    assert not [m for m in markers if m.exists()]
    assert max(records(copy)[0]) == STEPS  # nothing trained


def test_saving_removes_only_the_step_folders_the_run_wrote(tmp_path):
    """deepspeed/ may hold a user's folders (notes, a copy of DeepSpeed's csrc), a step-named folder with
    other files, a link: saving prunes only step<N> folders of DeepSpeed's shard files."""
    from mode.parallel.engine import remove_tag, written_tag

    save_dir = tmp_path / "deepspeed"
    ours = save_dir / "step2"
    ours.mkdir(parents=True)
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt",
                 "layer_0_expert_3_mp_rank_00_model_states.pt", "expp_rank_1_mp_rank_00_optim_states.pt"):
        (ours / name).write_bytes(b"shard")
    theirs = {"my_notes": "notes.txt", "csrc": "adam.cpp", "step7": "notes.txt"}
    for folder, file in theirs.items():
        (save_dir / folder).mkdir()
        (save_dir / folder / file).write_text("keep me")
    mixed = save_dir / "step4"
    shutil.copytree(ours, mixed)
    (mixed / "README").write_text("keep me")
    (save_dir / "step9").mkdir()  # empty: nothing says a run wrote it
    (save_dir / "step5").symlink_to(ours)
    assert written_tag(ours)
    assert not any(written_tag(save_dir / name) for name in (*theirs, "step4", "step9", "step5"))
    remove_tag(ours)
    assert not ours.exists() and (save_dir / "step5").is_symlink()
    assert all((save_dir / folder / file).read_text() == "keep me" for folder, file in theirs.items())


def test_two_nodes_on_one_host_equal_the_one_node_run(data_parallel, tmp_path):
    """Two launchers, one a "node" (--nnodes 2 --node_rank 0/1, one process each, rendezvous on
    127.0.0.1 over gloo): the losses of the one-node 2-process run, to rounding."""
    raw = json.loads(json.dumps(data_parallel["raw"]))
    raw["train"]["out_dir"] = str(tmp_path / "dist")
    config = write_config(raw, tmp_path / "config.yaml")
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    nodes = []
    for node_rank in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", f"--node_rank={node_rank}",
               "--nproc_per_node=1", "--master_addr=127.0.0.1", f"--master_port={port}",
               str(ROOT / "launch" / "train.py"), "--config", str(config)]
        nodes.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True, start_new_session=True))
    with killed_on_exit(nodes[0]), killed_on_exit(nodes[1]):
        outputs = [output_within(node, LAUNCH_TIMEOUT, f"node {i} did not finish") for i, node in enumerate(nodes)]
    assert [node.returncode for node in nodes] == [0, 0], outputs[0][-3000:] + outputs[1][-3000:]
    assert "2 processes (gloo, cpu)" in outputs[0]
    one_node, two_nodes = records(data_parallel["dir"])[0], records(tmp_path / "dist")[0]
    assert sorted(two_nodes) == sorted(one_node)
    for step, record in one_node.items():
        for key in ("loss", "grad_norm"):
            assert two_nodes[step][key] == pytest.approx(record[key], rel=FIRST_RTOL), (step, key)
