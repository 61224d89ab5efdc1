"""The Trainer: one loop for every setting (one process or a DeepSpeed engine), its steps and
checkpoints. Its run folder's rules live in mode.training.folder, its evaluation in
mode.training.evaluation, its progress bar and records in mode.training.progress."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import Tensor, nn

from mode.checkpoint import (
    build_model,
    curve_differences,
    load_checkpoint_file,
    may_change_on_resume,
    restore_rng,
)
from mode.config import Config, ConfigError, field_differences, save_config
from mode.data import (
    TokenSplits,
    batch_generator,
    describe_source,
    load_splits,
    sample_batch,
)
from mode.flops import model_flops, train_step_flops
from mode.layers.attention import attention_backend_problem, set_attention_backend
from mode.routing import bias_balanced_routers, set_depth_capacities
from mode.run_folder import CHECKPOINT, CONFIG, METRICS
from mode.training.bf16_weights import bf16_weights_apply
from mode.training.deferred_update import overlap_update_apply
from mode.training.evaluation import validation_metrics
from mode.training.folder import (
    CheckpointWriteError,
    check_not_past_the_end,
    check_run_folder,
    lock_run_folder,
    truncate_metrics,
)
from mode.training.graphs import GraphedMicroStep, eager_graphs
from mode.training.optim import (
    DistributedOptimization,
    Optimization,
    TorchOptimization,
    learning_rate,
    steps_within_budget,
)
from mode.training.plot import plot_losses
from mode.training.progress import Progress, RunLog, StepTimer
from mode.training.router_stats import (
    HostCopy,
    Outputs,
    average_summaries,
    copy_outputs,
    expert_loads,
    output_tensors,
    outputs_to_host,
    parse_outputs,
    pool_summaries,
    split_list,
)
from mode.training.tracking import summary_writer_class
from mode.utils import (
    atomic_torch_save,
    interrupts_deferred,
    pick_device,
    remove_stale_temporaries,
)


# ----------------------------------------------------------------------------- the trainer
@dataclass
class RunState:
    step: int = 0  # optimizer steps completed
    tokens: int = 0
    flops: float = 0.0


LOSS_KEYS = ("loss", "lm_loss", "aux_loss")  # what a step reports of ModelOutput


@dataclass
class LaunchedStep:
    """A step queued on the device (Trainer.launch_step), its values still on their way to the host."""

    state: RunState  # the run's state after this step
    lr: float
    outputs: Outputs  # output_tensors of each micro-batch
    copy: HostCopy  # of outputs, then the gradient norm
    timer: StepTimer  # how long it computed, for tokens/s


def _token_dtype_hint(config: Config, data: TokenSplits) -> str:
    """A vocabulary past uint16's range from a file read as uint32 is most likely uint16 ids read in pairs."""
    d = config.data
    if d.source == "tokens" and d.token_dtype == "uint32" and data.vocab_size > 1 << 16:
        return "; if the file holds uint16 ids, set data.token_dtype=uint16"
    return ""


def use_attention_backend(config: Config, model: nn.Module, device: torch.device) -> None:
    """Every attention layer of model on train.attention_backend's kernel; a ConfigError naming the
    field where that kernel cannot run the model here (in bf16 on CUDA, as training autocasts)."""
    name = config.train.attention_backend
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    problem = attention_backend_problem(name, device, config.model.head_width, dtype)
    if problem is not None:
        raise ConfigError(f"train.attention_backend={name}: {problem}")
    set_attention_backend(model, name)


class Trainer:
    # Exceptions that stop a run between two steps (an interrupt; launch/train.py's --stop-at-step):
    # the step still in flight is reported before the run stops.
    clean_stops: tuple[type[BaseException], ...] = (KeyboardInterrupt,)

    def __init__(
        self,
        config: Config,
        resume: bool = False,
        optimization: Optimization | None = None,
        model: nn.Module | None = None,
        rank: int = 0,
        world_size: int = 1,
    ) -> None:
        self.config = config
        self.rank, self.world_size = rank, world_size
        # Row blocks a validation batch is evaluated in, each pooled as a process's share: mode.evaluate
        # of a multi-process run (token choice's capacity and dropping are per process's micro-batch).
        self.eval_splits = 1
        self.is_main = rank == 0
        self.out_dir = Path(config.train.out_dir)
        self.device = pick_device(config.train.device)
        torch.manual_seed(config.train.seed)
        self.data: TokenSplits = load_splits(config.data)
        if self.data.vocab_size > config.model.vocab_size:
            raise ConfigError(
                f"model.vocab_size ({config.model.vocab_size}) is smaller than the data's vocabulary "
                f"({self.data.vocab_size} token ids in {describe_source(config.data)}){_token_dtype_hint(config, self.data)}"
            )
        self.notes: list[str] = []  # for the user, before training starts
        self.model = model if model is not None else build_model(config, self.device, resume, self.notes)
        use_attention_backend(config, self.model, self.device)
        t = config.train
        self.forward = torch.compile(self.model, mode=t.compile_mode) if t.compile else self.model
        # The eager model as CUDA graphs (train.cuda_graphs); a given optimization is a multi-process
        # engine's, which says whether a graph can hold its backward.
        engine_refusal = None
        if isinstance(optimization, DistributedOptimization):
            engine_refusal = optimization.capture_refusal()
        elif optimization is not None:
            engine_refusal = f"a given {type(optimization).__name__} is not known to keep a graph's gradients"
        eager_graphed, note = eager_graphs(config, self.device, self.model, engine_refusal)
        if note:
            self.notes.append(note)
        # CUDA graphs own their outputs and keep the gradients: compiled ones add into zeroed
        # gradients, the eager model's graph writes them itself (GraphedMicroStep).
        self.graphed = (t.compile and t.compile_mode == "reduce-overhead") or eager_graphed
        # bf16 weights: a multi-process engine says whether it holds them (it builds its optimizer first)
        update_refusal = None
        if isinstance(optimization, DistributedOptimization):
            bf16_weights, note = optimization.bf16_weights_applied()
            update_refusal = "a multi-process engine (launch/train.py) runs the update in its step"
        else:
            given = None if optimization is None else f"a given {type(optimization).__name__} holds the weights as built"
            bf16_weights, note = bf16_weights_apply(config, self.device, given)
        if note:
            self.notes.append(note)
        overlap, note = overlap_update_apply(config, self.model, self.device, bf16_weights, eager_graphed, update_refusal)
        if note:
            self.notes.append(note)
        self.optimization = optimization or TorchOptimization(self.model, config, self.device, keep_grads=self.graphed,
                                                              zero_grads=not eager_graphed, bf16_weights=bf16_weights,
                                                              defer_update=overlap)
        self.graphed_step: GraphedMicroStep | None = None
        if eager_graphed and optimization is None:
            self.graphed_step = GraphedMicroStep(self.model, self.optimization.backward, t.grad_accum,
                                                 summed=self.optimization.summed_params)
        elif eager_graphed:  # the graph holds the engine's autograd; its reduction runs after each replay
            self.graphed_step = GraphedMicroStep(self.model, optimization.captured_backward, t.grad_accum,
                                                 after_replay=optimization.after_replay,
                                                 summed=optimization.summed_params)
        # the depth routers' as built (capacity_at's form: a list as a tuple); launch_step follows the schedule
        capacity = config.routing.capacity
        self.capacity = tuple(capacity) if isinstance(capacity, list) else capacity
        self.flops_per_token = model_flops(config).train_per_token
        if t.flops_budget is not None:  # before the run folder's config is written: it records the steps
            given, t.max_steps = t.max_steps, steps_within_budget(config, world_size)
            instead = "" if given == t.max_steps else f", in place of the config's max_steps={given}"
            self.notes.append(f"train.flops_budget={t.flops_budget:.4g}: max_steps={t.max_steps}{instead} "
                              f"({train_step_flops(config, world_size):.4g} training FLOPs a step)")
        if t.warmup_steps >= t.max_steps:  # legal (a short smoke run), but a budget sweep's small points land here unseen
            reach = ("reaches train.lr={lr:g} only at the last step" if t.warmup_steps == t.max_steps
                     else "never reaches train.lr={lr:g}").format(lr=t.lr)
            self.notes.append(f"train.warmup_steps={t.warmup_steps} is not below max_steps={t.max_steps}: the learning "
                              f"rate {reach} and there is no decay")
        self.state = RunState()
        self.saved_step: int | None = None  # the step the run folder's checkpoint holds
        self._prepare_run_folder(resume)

    # -- run folder and checkpoints
    def _prepare_run_folder(self, resume: bool) -> None:
        writer_class = summary_writer_class(self.config.train)  # on every rank: a missing package stops all alike
        check_run_folder(self.out_dir, self.config, resume)
        self.lock = lock_run_folder(self.out_dir, self.is_main, self.mean_over_ranks)
        try:
            if resume:
                self._resume_from(self.out_dir / CHECKPOINT)
            if self.is_main:
                save_config(self.config, self.out_dir / CONFIG)
                self.run_log = RunLog(self.out_dir, writer_class, self.state.step if resume else None)
        except BaseException:  # a refused resume leaves the folder free for the next attempt
            self.close()
            raise

    def _resume_from(self, checkpoint: Path) -> None:
        self.load_checkpoint(checkpoint)
        check_not_past_the_end(self.state.step, self.config.train)
        if self.is_main:
            self.notes += truncate_metrics(self.out_dir / METRICS, self.state.step)
            # a checkpoint write killed outright (SIGKILL, out of memory) left its temporary
            self.notes += [f"removed {stale.name}, a checkpoint write that never finished"
                           for stale in remove_stale_temporaries(checkpoint)]

    def close(self) -> None:
        """Release the run folder (the lock); the process ending does the same."""
        run_log = getattr(self, "run_log", None)
        if run_log is not None:
            run_log.close()
        lock = getattr(self, "lock", None)
        if lock is not None:
            lock.release()

    def checkpoint_payload(self) -> dict[str, Any]:
        """Every rank builds it (a distributed engine saves collectively); rank 0 writes it."""
        payload = {
            "format": "mode-checkpoint-v1",
            "config": self.config.to_dict(),
            "state": vars(self.state).copy(),
            "rng": torch.get_rng_state(),
            "cuda_rng": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None,
            # The generator of the GPU the run computed on (rank 0's): every process of a
            # multi-process run draws alike from its own GPU's (routing.random: the global batch's
            # scores), so this is the state of every process's GPU, which the list above, of the
            # GPUs rank 0's process saw, does not give for the others.
            "cuda_rng_run": torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None,
        }
        if isinstance(self.optimization, DistributedOptimization):
            payload.update(self.optimization.save_checkpoint(self.out_dir, payload))
        else:
            payload.update(model=self.model_state_dict(), optimizer=self.optimization.state_dict())
        return payload

    def save_checkpoint(self) -> None:
        with interrupts_deferred():  # a Ctrl-C while writing stops the run after the checkpoint is whole
            payload = self.checkpoint_payload()
            if self.is_main:
                try:
                    atomic_torch_save(payload, self.out_dir / CHECKPOINT)
                except OSError as e:  # a full disk: the rename never happened, the previous file is whole
                    raise CheckpointWriteError(self.out_dir, self.state.step, self.saved_step, e) from None
            self.saved_step = self.state.step

    def load_checkpoint(self, path: Path) -> None:
        payload = load_checkpoint_file(path, self.device)
        differ = curve_differences(payload["config"], self.config)
        if differ:
            raise ConfigError(
                f"--resume: the config differs from the run's, saved in {path}: {', '.join(differ)}. Resume with "
                f"the run's settings ({self.out_dir / 'config.yaml'}), or start a new run in another --train.out_dir"
            )
        changes = field_differences(payload["config"], self.config, may_change_on_resume)
        self.notes += [f"--resume changes {change}" for change in changes]
        if isinstance(self.optimization, DistributedOptimization):
            self.optimization.load_checkpoint(self.out_dir, payload)
        elif payload.get("sharded"):
            raise ConfigError(
                f"--resume: {path} belongs to a multi-process run ({payload['sharded']}) whose optimizer state is "
                "sharded over its processes: resume it with launch/train.py (its weights load on one device)"
            )
        else:
            self.load_model_state_dict(payload["model"])
            self.optimization.load_state_dict(payload["optimizer"])
        self.state = RunState(**payload["state"])
        self.saved_step = self.state.step
        restore_rng(payload, self.device)

    def model_state_dict(self) -> dict[str, Tensor]:
        """The model's weights as a checkpoint holds them (float32 masters of bf16 weights)."""
        if isinstance(self.optimization, TorchOptimization):
            return self.optimization.model_state_dict()
        return self.model.state_dict()

    def load_model_state_dict(self, state: dict[str, Tensor]) -> None:
        if isinstance(self.optimization, TorchOptimization):
            self.optimization.load_model_state_dict(state)
        else:
            self.model.load_state_dict(state)

    def mean_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        """Losses averaged over data-parallel ranks (each rank saw its share of the batch)."""
        if isinstance(self.optimization, DistributedOptimization):
            return self.optimization.mean_over_ranks(values)
        return values

    def pool_over_ranks(self, summaries: list[dict[str, dict[str, Any]]]) -> list[dict[str, dict[str, Any]]]:
        """Router statistics of each micro-batch over every rank's share of it (pool_summaries)."""
        if not isinstance(self.optimization, DistributedOptimization) or not summaries[0]:
            return summaries
        return pool_summaries(summaries, lambda values: self.mean_of_lists([values])[0], self.world_size)

    def mean_of_lists(self, lists: list[list[float]]) -> list[list[float]]:
        """Element-wise means over ranks (one all-reduce); the lists themselves on one process."""
        flat = [v for values in lists for v in values]
        if not isinstance(self.optimization, DistributedOptimization) or not flat:  # same on every rank
            return lists
        pooled = self.optimization.mean_over_ranks({str(i): v for i, v in enumerate(flat)})
        return split_list([pooled[str(i)] for i in range(len(flat))], [len(values) for values in lists])

    def log(self, record: dict[str, Any]) -> None:
        if self.is_main:
            self.run_log.write(record)

    # -- one step
    def autocast(self) -> contextlib.AbstractContextManager:
        if self.device.type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        return contextlib.nullcontext()

    @property
    def tokens_per_step(self) -> int:
        """Tokens one optimizer step consumes over all ranks and micro-batches."""
        t = self.config.train
        return t.grad_accum * t.batch_size * self.config.data.seq_len * self.world_size

    def micro_batch(self, split: Tensor, step: int, micro: int, seed: int | None = None) -> tuple[Tensor, Tensor]:
        """This rank's share of the global micro-batch: one sample for every world size. seed: the
        draw's seed (default train.seed)."""
        t = self.config.train
        global_batch = t.batch_size * self.world_size
        seed = t.seed if seed is None else seed
        x, y = sample_batch(split, global_batch, self.config.data.seq_len, batch_generator(seed, step, micro))
        rows = slice(self.rank * t.batch_size, (self.rank + 1) * t.batch_size)
        return to_device(x[rows], self.device), to_device(y[rows], self.device)

    def train_step(self) -> dict[str, Any]:
        """One optimizer step, queued and then read: its losses, learning rate, gradient norm and
        router statistics."""
        return self.finish_step(self.launch_step())

    def launch_step(self) -> LaunchedStep:
        """Queue one optimizer step (every micro-batch's forward and backward, then the update) and
        its outputs' copy to the host, without waiting for the device; advances self.state."""
        t = self.config.train
        step = self.state.step
        self.follow_capacity_schedule(step)
        outputs = []
        timer = StepTimer(self.device)
        self.model.train()
        for micro in range(t.grad_accum):
            x, y = self.micro_batch(self.data.train, step, micro)
            self.mark_step_begin()
            if self.graphed_step is not None:  # forward and backward: one graph replayed
                out = self.graphed_step(x, y, accumulate=micro > 0)
            else:
                with self.autocast():
                    out = self.forward(x, y)
                self.optimization.backward(out.loss / t.grad_accum)
            tensors = output_tensors(out, LOSS_KEYS)  # read after the optimizer step
            # A CUDA-graphed forward's outputs live in memory its next replay (the next
            # micro-batch) overwrites: keep copies (a few scalars and small vectors).
            outputs.append(copy_outputs(tensors) if self.graphed else tensors)
        lr = learning_rate(step, t)
        grad_norm = self.optimization.step(lr)
        self.balance_experts(outputs)
        tokens = self.tokens_per_step
        self.state = RunState(step + 1, self.state.tokens + tokens, self.state.flops + tokens * self.flops_per_token)
        # One device-to-host transfer per step: losses, statistics, norm.
        copy = outputs_to_host(outputs, [grad_norm])
        timer.stop()
        return LaunchedStep(self.state, lr, outputs, copy, timer)

    def balance_experts(self, outputs: Outputs) -> None:
        """After the optimizer step: bias-balanced expert routers (moe.bias_update_rate) move their
        selection bias by the step's loads, summed over micro-batches and processes (on the device)."""
        routers = bias_balanced_routers(self.model)
        if routers:
            loads = self.sum_over_ranks(torch.stack(expert_loads(outputs)))  # (layers, E)
            for router, load in zip(routers, loads, strict=True):
                router.update_bias(load)

    def sum_over_ranks(self, values: Tensor) -> Tensor:
        """values summed over the data-parallel processes (one process: values)."""
        return values

    def follow_capacity_schedule(self, step: int) -> None:
        """Set the depth routers to step's capacity (routing.capacity_schedule) and count its FLOPs."""
        capacity = self.config.routing.capacity_at(step)
        if capacity == self.capacity:
            return
        set_depth_capacities(self.model, self.config.routing.layer_capacities(self.config.model.block_kinds(), capacity))
        self.capacity = capacity
        self.flops_per_token = model_flops(self.config.at_capacity(capacity)).train_per_token
        if self.graphed_step is not None:
            self.graphed_step.forget()

    def release_graphs(self) -> None:
        """Drop the captured CUDA graphs, before the process group is destroyed: a graph holding
        NCCL collectives (OverlappedGradients) keeps their communicator in use, and destroying
        it would wait for the graph forever."""
        if self.graphed_step is not None:
            self.graphed_step.forget()
            torch.cuda.synchronize(self.device)

    def finish_step(self, launched: LaunchedStep) -> dict[str, Any]:
        """A launched step's metrics: waits for its values alone (not for steps queued after it);
        pooled over ranks (collective: every rank finishes the same steps in the same order)."""
        t = self.config.train
        micro_losses, summaries, (norm,) = parse_outputs(launched.outputs, LOSS_KEYS, launched.copy)
        losses = self.mean_over_ranks({key: sum(m[key] for m in micro_losses) / t.grad_accum for key in LOSS_KEYS})
        summaries = self.pool_over_ranks(summaries)
        routing = average_summaries(summaries, sum_counts=True) if summaries[0] else {}
        return {**losses, "lr": launched.lr, "grad_norm": norm, "routing": routing}

    def mark_step_begin(self) -> None:
        """Before each compiled forward: the last one's outputs have been read (a CUDA-graphed
        model, compile_mode=reduce-overhead, reuses their memory on its next replay)."""
        if self.config.train.compile:
            torch.compiler.cudagraph_mark_step_begin()

    def evaluate(self) -> dict[str, Any]:
        """Validation loss and router statistics (mode.training.evaluation); leaves the RNG as it was."""
        self.flush_update()
        return validation_metrics(self)

    def flush_update(self) -> None:
        """Apply a step's update still staged for the next forward (train.overlap_update): the model's
        weights are then the last step's, for whatever reads them outside training."""
        if isinstance(self.optimization, TorchOptimization):
            self.optimization.flush()

    # -- the loop
    def run(self) -> list[dict[str, Any]]:
        """Train to train.max_steps, then release the run folder. A run that stops early (a signal, an
        error) redraws its loss plot first, so the plot shows what the metrics hold."""
        try:
            return self._train()
        except BaseException:
            if self.is_main and self.saved_step is not None and (self.out_dir / METRICS).exists():
                with contextlib.suppress(Exception):  # the stop's own reason is what the user must see
                    plot_losses(self.out_dir)
            raise
        finally:
            self.close()

    def _train(self) -> list[dict[str, Any]]:
        """The host queues step n+1 before it reads step n's losses, so the device is never left idle
        while the host waits for a read or prepares the next batch; before an evaluation, a
        checkpoint or the end, the step in flight is read first."""
        t = self.config.train
        self.progress = Progress(t, self.state.step, self.world_size, t.progress and self.is_main, self.log)
        in_flight: LaunchedStep | None = None
        while self.state.step < t.max_steps:
            try:
                launched = self.launch_step()
            except self.clean_stops:  # a stop between steps: the step before it is still reported
                if in_flight is not None:
                    self._report(in_flight)
                raise
            if in_flight is not None:
                self._report(in_flight)
            in_flight = launched
            step = self.state.step
            if step % t.eval_interval and step % t.checkpoint_interval and step != t.max_steps:
                continue
            self._report(in_flight)
            in_flight = None
            if step % t.eval_interval == 0 or step == t.max_steps:
                evaluation = {"step": step, "tokens": self.state.tokens, "flops": self.state.flops, **self.evaluate()}
                self.progress.keep(evaluation)
                if self.is_main:
                    self.progress.bar.write(f"step {step}: val_loss {evaluation['val_loss']:.4f}")
            if step % t.checkpoint_interval == 0 or step == t.max_steps:
                self.save_checkpoint()
        self.flush_update()
        self.progress.bar.close()
        if self.is_main:
            plot_losses(self.out_dir)
        return self.progress.records

    def _report(self, launched: LaunchedStep) -> None:
        """Finish a launched step: its record, with tokens/s, to the progress bar and, at log intervals, the log."""
        metrics = self.finish_step(launched)
        record = {"step": launched.state.step, "tokens": launched.state.tokens, "flops": launched.state.flops, **metrics}
        if self.config.routing.capacity_schedule is not None:  # the capacity the step routed at
            record["capacity"] = self.config.routing.capacity_at(launched.state.step - 1)
        self.progress.step(record, self.tokens_per_step, launched.timer.seconds())


def to_device(batch: Tensor, device: torch.device) -> Tensor:
    """A host batch on device. To CUDA from contiguous pinned memory without waiting: a copy
    from pageable memory, or from a strided view (which PyTorch first makes contiguous in
    pageable memory), waits for the device's queue to drain (the step before it)."""
    if device.type != "cuda":
        return batch.to(device)
    return batch.contiguous().pin_memory().to(device, non_blocking=True)
