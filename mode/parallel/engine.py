"""The DeepSpeed engine in the place of the plain optimizer step.

`deepspeed_config(config, ...)` derives DeepSpeed's JSON from the project's config (there is
no second, hand-kept file); `DeepSpeedOptimization` implements the training loop's
`Optimization` protocol (and `DistributedOptimization`, its multi-process hooks) on a
`deepspeed.initialize` engine, so the Trainer's one loop, logging, evaluation and
checkpoints run unchanged.

Gradient accumulation: the loop owns it. It divides each micro-batch's loss by
train.grad_accum, calls backward once per micro-batch and step once per optimizer step.
DeepSpeed is told the same gradient_accumulation_steps (its batch bookkeeping and ZeRO's
buffers depend on it) but never rescales: backward runs with scale_wrt_gas=False, and the
accumulation boundary is set explicitly (False before each micro-batch but the last), so
gradients are reduced across processes once per optimizer step, after the last backward.

Precision: on CUDA every step computes under the Trainer's bf16 autocast. Under ZeRO 1/2
DeepSpeed's bf16 is on as well (bf16 weights, an fp32 master copy sharded in its
optimizer). Under ZeRO 0 it is off (with it on, DeepSpeed's BF16_Optimizer leaves the
trajectory of one GPU and of ZeRO 1/2); there the matrices are
held in bf16 with float32 masters as in a one-GPU run (train.bf16_weights): the one-process
optimizer (TorchOptimization) steps them, and the gradients are all-reduced here, each dtype in
its own (the matrices' bf16 gradients in bf16: half the bytes of float32, where DeepSpeed's
reduction would send every gradient as float32), in buckets started beside the backward
(OverlappedGradients, parallel.reduce_bucket_mb); with grad_accum > 1 all after the last
micro-batch, the matrices' gradients summed over micro-batches in float32 and reduced in float32.
Sharded experts (expert parallelism) are reduced as DeepSpeed reduces them: summed over the
processes holding the same experts, divided by every process's count. With float32 weights
(train.bf16_weights=false) weights and gradients stay fp32 and DeepSpeed reduces and steps. On
CPU everything is fp32.

Clipping: DeepSpeed clips with train.grad_clip under ZeRO 1/2. Under ZeRO 0 DeepSpeed
would clip by the *mean over ranks* of each rank's local norm, which with expert
parallelism is not the norm of the gradient (each rank holds other experts); there we
compute the exact global norm (shared parameters once, experts summed over the
expert-parallel group) and clip ourselves, with DeepSpeed's clipping off. ZeRO 1/2 gave
the exact norm too with ep = world size, and with expert-data-parallel replicas (ep < world
size: 4 processes, ep 2, ZeRO 2), both checked against one process (tests/test_parallel.py).
The causal predictors are clipped apart by their own norm under ZeRO 0 (mode.training.optim's
predictor_parameter_ids); DeepSpeed's ZeRO 1/2 clipping counts them in its one norm. With bf16
weights (ZeRO 0) the one-process optimizer clips, by the same rules (its ShardedParams: the
experts' squared norm summed over the expert-parallel group).

The learning rate is the project's schedule: the loop passes it to step(), which writes it
into the optimizer's parameter groups; DeepSpeed has no scheduler.

Checkpoints: with bf16 weights DeepSpeed saves and loads the float32 masters in the weights'
places (Bf16Weights.masters_as_params), so the files are those of float32 weights and a run may
resume with the setting changed. Every file of DeepSpeed's checkpoint is read as checkpoint.pt
is, without running code (SafeLoading: tensors, plain data and the three DeepSpeed classes its
optimizer state holds); a file that would run code is refused with an error naming it. Saving
removes only the step folders this run wrote (step<N>, holding nothing but DeepSpeed's shard files).
"""
from __future__ import annotations

import contextlib
import logging
import os
import pickle
import re
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import deepspeed
import torch
import torch.distributed as dist
from deepspeed.moe.utils import (
    is_moe_param,
    split_params_into_different_moe_groups_for_optimizer,
)
from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
from deepspeed.runtime.zero.config import ZeroStageEnum
from deepspeed.utils import groups as ds_groups
from deepspeed.utils.tensor_fragment import fragment_address
from torch import Tensor, nn

from mode.config import Config, ConfigError
from mode.parallel.expert_parallel import ExpertParallelExperts, full_state_dict
from mode.run_folder import DEEPSPEED_DIR
from mode.training.bf16_weights import Bf16Weights, bf16_weights_apply
from mode.training.optim import (
    ShardedParams,
    TorchOptimization,
    clipped_gradients,
    parameter_groups,
    predictor_parameter_ids,
    split_predictor_parameters,
)

# The classes (besides tensors and plain data) DeepSpeed's optimizer shards hold: plain records,
# rebuilt from their fields, never by running code.
SHARD_GLOBALS = [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]
STEP_TAG = re.compile(r"step\d+")
# The files DeepSpeed writes into a tag's folder: the model's, each expert's and each optimizer shard's.
SHARD_FILE = re.compile(
    r"(mp_rank_\d+_model_states|layer_\d+_expert_\d+_mp_rank_\d+_model_states"
    r"|(bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states|expp_rank_\d+_mp_rank_\d+_optim_states)\.pt"
)


class UnsafeCheckpointError(ValueError):
    """A DeepSpeed checkpoint file holds objects whose loading could run code; the message names it."""


def load_shard(path: str | Path, map_location: Any = None) -> Any:
    """One file of DeepSpeed's checkpoint, loaded as checkpoint.pt is: without running code."""
    try:
        with torch.serialization.safe_globals(SHARD_GLOBALS):
            return torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError:  # torch's text advises weights_only=False, which would run the file's code
        raise UnsafeCheckpointError(
            f"{path} holds objects other than tensors and plain data: refused, as loading it could run code"
        ) from None


class SafeLoading:
    """DeepSpeed's checkpoint engine with its load() replaced by load_shard; everything else its own."""

    def __init__(self, engine: Any) -> None:
        self._engine = engine

    def load(self, path: str, map_location: Any = None) -> Any:
        return load_shard(path, map_location)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def written_tag(folder: Path) -> bool:
    """Whether `folder` is a step folder DeepSpeed wrote for a run: named step<N>, holding DeepSpeed's
    shard files and nothing else."""
    if not (STEP_TAG.fullmatch(folder.name) and folder.is_dir() and not folder.is_symlink()):
        return False
    entries = list(folder.iterdir())
    return bool(entries) and all(e.is_file() and not e.is_symlink() and SHARD_FILE.fullmatch(e.name) for e in entries)


def remove_tag(folder: Path) -> None:
    """Delete a written_tag folder: its shard files, then the folder itself. A file that cannot be
    removed (permissions) leaves the folder in place; training goes on."""
    with contextlib.suppress(OSError):
        for shard in folder.iterdir():
            shard.unlink()
        folder.rmdir()


# ----------------------------------------------------------------------------- processes
@dataclass(frozen=True)
class Processes:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device
    backend: str


def resolve_backend(name: str, device_type: str) -> str:
    if name == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if name == "nccl" and device_type != "cuda":
        raise ConfigError("parallel.backend 'nccl' needs CUDA devices; use gloo (or auto) on CPU")
    return name


def init_distributed(config: Config) -> Processes:
    """deepspeed.init_distributed with the configured backend; one device per process on CUDA.

    Reads the launcher's environment (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR/PORT), as
    set by `deepspeed`, `torchrun` and `python -m torch.distributed.run`.
    """
    wanted = config.train.device
    cuda = torch.cuda.is_available() and wanted != "cpu"
    if wanted == "cuda" and not torch.cuda.is_available():
        raise ConfigError("train.device is 'cuda' but no CUDA device is available")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if cuda:
        torch.cuda.set_device(local_rank)
    device = torch.device("cuda", local_rank) if cuda else torch.device("cpu")
    backend = resolve_backend(config.parallel.backend, device.type)
    match_accelerator(device.type)
    if not dist.is_initialized():
        deepspeed.init_distributed(dist_backend=backend)
    return Processes(dist.get_rank(), dist.get_world_size(), local_rank, device, backend)


def match_accelerator(device_type: str) -> None:
    """DeepSpeed's accelerator for this run's device. DeepSpeed picks CUDA whenever a GPU is visible,
    and then binds the process group and the engine to cuda:<local_rank>, even for a CPU run over gloo
    (on a one-GPU machine rank 1 failed: cuda:1 out of range). A CPU run takes its CPU accelerator,
    as on a machine without a GPU."""
    from deepspeed.accelerator import get_accelerator, set_accelerator

    if get_accelerator().device_name() == device_type:
        return
    if device_type == "cpu":
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        set_accelerator(CPU_Accelerator())
    else:
        from deepspeed.accelerator.cuda_accelerator import CUDA_Accelerator

        set_accelerator(CUDA_Accelerator())


def quiet_deepspeed(level: int = logging.WARNING) -> None:
    """DeepSpeed logs every group and engine detail at INFO; keep its warnings only."""
    logging.getLogger("DeepSpeed").setLevel(level)
    deepspeed.utils.logger.setLevel(level)


# ----------------------------------------------------------------------------- configuration
def clips_itself(config: Config, device_type: str) -> bool:
    """ZeRO 0 (fp32 weights and gradients): we clip by the exact global norm (module docstring)."""
    return config.parallel.zero_stage == 0


def deepspeed_bf16(config: Config, device_type: str) -> bool:
    """DeepSpeed's bf16 (bf16 weights, fp32 master copy in its optimizer) under ZeRO 1/2 on CUDA."""
    return device_type == "cuda" and config.parallel.zero_stage > 0


def reduces_gradients(config: Config, world_size: int) -> bool:
    """Whether the engine's backward reduces gradients: not under ZeRO 0 on one process, where
    that is an identity (DeepSpeed averages over a group of one; expert gradients too)."""
    return world_size > 1 or config.parallel.zero_stage > 0


def bf16_weights_refusal(config: Config) -> str | None:
    """Why the engine cannot hold the matrices in bf16 with the project's float32 masters
    (train.bf16_weights); None under ZeRO 0."""
    p = config.parallel
    if p.zero_stage > 0:
        return (f"parallel.zero_stage={p.zero_stage}: DeepSpeed's bf16 optimizer holds every weight in bf16 "
                "with float32 masters itself")
    return None


class FlatGradients:
    """The gradients of `params` averaged over the processes, one collective a dtype: each step's
    gradients are copied into one flat buffer a dtype (bf16 ones reduced in bf16), which is reduced
    in place, and each parameter's .grad then is its view of the buffer, with no copy back. Each
    view starts 16 bytes aligned (the optimizer's kernels load them whole), so a parameter's
    gradient sits at the same address every step. The buffers hold the parameters in reverse
    order, the order in which the backward produces their gradients (OverlappedGradients).

    summed: bf16 weights whose gradients are summed over micro-batches in float32 (Bf16Weights with
    sums): their sums become views of the float32 buffer, written there by the backward itself
    (nothing to copy in, and no .grad handed out), and are reduced with the float32 gradients.

    Experts sharded by expert parallelism (DeepSpeed's `allreduce = False` parameters) are reduced
    apart, in buffers of their own: summed over their expert-data-parallel group (the processes
    holding the same experts) and divided by every process's count, as DeepSpeed's engine reduces
    them (each expert's gradient already holds every process's tokens, brought by the all-to-all)."""

    ALIGN_BYTES = 16
    during_backward = False  # reduces after the backward, outside a CUDA graph holding it

    def __init__(self, params: list[nn.Parameter], world_size: int, backend: str,
                 summed: Bf16Weights | None = None) -> None:
        self.params, self.world_size = params, world_size
        self.average = backend == "nccl"  # NCCL averages in the collective; gloo sums, then the mean is taken
        self.summed = summed if summed is not None and summed.sums is not None else None
        # each parameter's index among the summed weights (None: its .grad is reduced)
        self.sum_index = [None if self.summed is None else self.summed.index_of.get(id(p)) for p in params]
        # each parameter's buffer: its gradient's dtype, and its expert group's name (None: every process)
        self.keys = [(p.dtype if j is None else torch.float32, p.group_name if is_moe_param(p) else None)
                     for p, j in zip(params, self.sum_index)]
        sizes: dict[ReductionKey, int] = {}
        self.offsets = [0] * len(params)
        for i in reversed(range(len(params))):
            key = self.keys[i]
            step = self.ALIGN_BYTES // key[0].itemsize
            self.offsets[i] = -(-sizes.get(key, 0) // step) * step
            sizes[key] = self.offsets[i] + params[i].numel()
        self.buffers = {key: torch.zeros(size, dtype=key[0], device=params[0].device) for key, size in sizes.items()}
        self.views = [self.buffers[key][start:start + p.numel()].view_as(p)
                      for p, key, start in zip(params, self.keys, self.offsets)]
        if self.summed is not None:
            self.summed.place_sums({j: view for j, view in zip(self.sum_index, self.views) if j is not None})
            self.summed.sums_always_held = True  # the reduction zeroes those no micro-batch reached

    def begin(self) -> None:
        """Before a backward whose gradients reduce_mean_ reduces: nothing to do here."""

    def reduce_mean_(self) -> None:
        """Every parameter's gradient replaced by its mean over the processes (a parameter no
        micro-batch reached counts zeros, as DeepSpeed's reduction does)."""
        self._copy_in(range(len(self.params)))
        for key, buffer in self.buffers.items():
            self._all_reduce_mean_(buffer, key[1])
        self._hand_out()

    def _copy_in(self, indices: range | list[int]) -> None:
        """The gradients of params[indices] copied into their views; zeros where there is none (a
        summed weight's sum is its view already: zeros where no micro-batch of the step reached it)."""
        copies = [(self.views[i], self.params[i].grad) for i in indices if self.sum_index[i] is None
                  and self.params[i].grad is not None and self.params[i].grad is not self.views[i]]
        if copies:
            torch._foreach_copy_([view for view, _ in copies], [grad for _, grad in copies])
        unreached = [self.views[i] for i in indices if not self._reached(i)]
        if unreached:
            torch._foreach_zero_(unreached)

    def _reached(self, i: int) -> bool:
        j = self.sum_index[i]
        return self.params[i].grad is not None if j is None else self.summed.summed[j]

    def _all_reduce_mean_(self, flat: Tensor, expert_group: str | None) -> None:
        """flat averaged over the processes; an expert group's (its name): summed over the
        processes holding those experts, divided by every process's count."""
        if expert_group is not None:
            group = ds_groups._get_expert_data_parallel_group(expert_group)
            if dist.get_world_size(group) > 1:
                dist.all_reduce(flat, group=group)
            flat.mul_(1.0 / self.world_size)
        elif self.average:
            dist.all_reduce(flat, op=dist.ReduceOp.AVG)
        else:  # DeepSpeed's arithmetic: the sum, then times 1 / world_size
            dist.all_reduce(flat)
            flat.mul_(1.0 / self.world_size)

    def _hand_out(self) -> None:
        for p, view, j in zip(self.params, self.views, self.sum_index):
            if j is None:
                p.grad = view


# A flat buffer's key: its dtype, and the expert group whose processes reduce it (None: every process)
ReductionKey = tuple[torch.dtype, str | None]


@dataclass
class GradientBucket:
    """A contiguous slice of one flat buffer and the parameters it holds."""

    key: ReductionKey
    start: int
    end: int
    members: list[int]


class OverlappedGradients(FlatGradients):
    """FlatGradients reduced bucket by bucket beside the backward (parallel.reduce_bucket_mb): a
    hook on each parameter counts its gradient in, and a bucket complete, and every bucket before
    it started, is copied in and all-reduced on a stream of its own, while the backward computes
    the earlier layers' gradients. The buckets start in one fixed order on every process (the
    collectives must match), whatever order the gradients arrive in; reduce_mean_, after the
    backward, starts the rest (zeros for a parameter no gradient reached) and waits for all.
    Inside a CUDA graph's capture the collectives and the stream's joins are captured with the
    backward, so each replay reduces as it goes, with nothing left for the host."""

    during_backward = True

    def __init__(self, params: list[nn.Parameter], world_size: int, backend: str, bucket_bytes: int) -> None:
        super().__init__(params, world_size, backend)
        self.buckets = self._buckets(bucket_bytes)
        self.bucket_of = {i: b for b, bucket in enumerate(self.buckets) for i in bucket.members}
        cuda = params[0].device.type == "cuda"
        self.stream = torch.cuda.Stream(params[0].device) if cuda else None
        self.hooks = [p.register_post_accumulate_grad_hook(self._arrived) for p in params]
        self.index = {id(p): i for i, p in enumerate(params)}
        self.begin()

    def _buckets(self, bucket_bytes: int) -> list[GradientBucket]:
        """Consecutive parameters of one buffer in reverse order, closed at bucket_bytes: the
        order they close in is the order they start in."""
        closed: list[GradientBucket] = []
        open_: dict[ReductionKey, GradientBucket] = {}
        for i in reversed(range(len(self.params))):
            p, key = self.params[i], self.keys[i]
            bucket = open_.setdefault(key, GradientBucket(key, self.offsets[i], self.offsets[i], []))
            bucket.members.append(i)
            bucket.end = self.offsets[i] + p.numel()
            if (bucket.end - bucket.start) * key[0].itemsize >= bucket_bytes:
                closed.append(open_.pop(key))
        return closed + list(open_.values())

    def begin(self) -> None:
        """Before each backward: no gradient arrived and no bucket started; the last step's views
        are dropped, so that the backward writes fresh gradients instead of adding into them."""
        self.missing = [len(bucket.members) for bucket in self.buckets]
        self.arrived: set[int] = set()
        self.started = 0
        for p in self.params:
            p.grad = None

    def _arrived(self, p: nn.Parameter) -> None:
        i = self.index[id(p)]
        if i in self.arrived:  # its bucket may be reduced already: a second gradient would be lost
            raise RuntimeError(f"OverlappedGradients: parameter {i} received two gradients in one backward")
        self.arrived.add(i)
        self.missing[self.bucket_of[i]] -= 1
        while self.started < len(self.buckets) and self.missing[self.started] == 0:
            self._start(self.started)

    def _start(self, b: int) -> None:
        bucket = self.buckets[b]
        self.started += 1
        if self.stream is None:
            self._reduce(bucket)
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))  # the gradients are ready there
        with torch.cuda.stream(self.stream):
            self._reduce(bucket)

    def _reduce(self, bucket: GradientBucket) -> None:
        self._copy_in(bucket.members)
        self._all_reduce_mean_(self.buffers[bucket.key][bucket.start:bucket.end], bucket.key[1])

    def reduce_mean_(self) -> None:
        """After the backward: the buckets not started yet reduced (with zeros for the parameters
        no gradient reached), the stream joined, and every parameter handed its view."""
        while self.started < len(self.buckets):
            self._start(self.started)
        if self.stream is not None:
            torch.cuda.current_stream(self.stream.device).wait_stream(self.stream)
        self._hand_out()


def flat_gradients(params: list[nn.Parameter], config: Config, processes: Processes,
                   summed: Bf16Weights | None = None) -> FlatGradients:
    """The reduction of bf16 weights' gradients: bucket by bucket beside the backward, or with
    parallel.reduce_bucket_mb=0 (or micro-batches accumulated, reduced at the last one alone, the
    bf16 weights' float32 sums among them: `summed`) all of them after it."""
    mib = config.parallel.reduce_bucket_mb
    if mib == 0 or config.train.grad_accum > 1:
        return FlatGradients(params, processes.world_size, processes.backend, summed)
    return OverlappedGradients(params, processes.world_size, processes.backend, bucket_bytes=int(mib * 2**20))


def capture_refusal(config: Config) -> str | None:
    """Why a CUDA graph (train.cuda_graphs) cannot hold the engine's backward for this config; None
    under ZeRO 0, where that backward is autograd and then, outside the graph, the all-reduce
    (DeepSpeedOptimization.captured_backward and after_replay). Expert parallelism's all-to-alls
    are captured with the forward and backward where their splits are equal (padded rows), with
    train.cuda_graphs=true only: auto keeps them plain eager until graphed runs have been run and timed
    against plain eager on GPUs. A layer whose splits are read on the host is the Trainer's to
    find (graphs.eager_graphs)."""
    p = config.parallel
    if p.zero_stage > 0:
        return (f"parallel.zero_stage={p.zero_stage}: DeepSpeed's ZeRO optimizer runs its own hooks in and around "
                "the backward (gradient partitions, bf16 buffers), which a graph would run only at its capture "
                "(zero_stage=0 graphs)")
    if p.expert_parallel > 1 and config.train.cuda_graphs is not True:
        return (f"parallel.expert_parallel={p.expert_parallel}: the experts' all-to-alls are captured with "
                "train.cuda_graphs=true only (where every process sends each expert equal rows)")
    return None


def deepspeed_config(config: Config, world_size: int, device_type: str) -> dict[str, Any]:
    """DeepSpeed's JSON config, from the project's config alone."""
    t, p = config.train, config.parallel
    return {
        "train_micro_batch_size_per_gpu": t.batch_size,
        "gradient_accumulation_steps": t.grad_accum,
        "train_batch_size": t.batch_size * t.grad_accum * world_size,
        "gradient_clipping": 0.0 if clips_itself(config, device_type) else t.grad_clip,
        "zero_optimization": {"stage": p.zero_stage},
        "bf16": {"enabled": deepspeed_bf16(config, device_type)},
        "steps_per_print": 2**31 - 1,  # the Trainer logs; DeepSpeed stays quiet
        "wall_clock_breakdown": False,
    }


def build_optimizer(model: nn.Module, config: Config, device_type: str) -> torch.optim.Optimizer:
    """AdamW on the Trainer's parameter groups; expert weights in groups of their own (DeepSpeed's rule)."""
    t = config.train
    groups = parameter_groups(model, t.weight_decay)
    for i, group in enumerate(groups):
        group["name"] = f"group{i}"
    if any(is_moe_param(p) for p in model.parameters()):
        groups = split_params_into_different_moe_groups_for_optimizer(groups)
    groups = [g for g in groups if g["params"]]
    return torch.optim.AdamW(groups, lr=t.lr, betas=(t.beta1, t.beta2), fused=device_type == "cuda")


def expert_parallel_group(model: nn.Module) -> Any | None:
    """The process group model's sharded experts exchange tokens in; None without expert parallelism."""
    return next((m.group for m in model.modules() if isinstance(m, ExpertParallelExperts)), None)


def sharded_experts(model: nn.Module, ep_group: Any | None) -> ShardedParams | None:
    """The experts expert parallelism shards (each process holds others): their squared gradient
    norm summed over the expert-parallel group, as the engine's own clipping sums it (_exact_norm).
    None without expert parallelism."""
    if ep_group is None:
        return None
    return ShardedParams([p for p in model.parameters() if is_moe_param(p)], partial(dist.all_reduce, group=ep_group))


def broadcast_masters(bf16: Bf16Weights) -> None:
    """Each float32 master made the first process's, as DeepSpeed made the weights: an expert's
    within the processes holding the same experts (its expert-data-parallel group)."""
    for param, master in zip(bf16.params, bf16.masters, strict=True):
        if not is_moe_param(param):
            dist.broadcast(master, src=0)
            continue
        group = ds_groups._get_expert_data_parallel_group(param.group_name)
        if dist.get_world_size(group) > 1:
            dist.broadcast(master, src=ds_groups._get_expert_broadcast_src_rank(param.group_name), group=group)


# ----------------------------------------------------------------------------- the Optimization
class DeepSpeedOptimization:
    """The Trainer's Optimization (and DistributedOptimization) on a DeepSpeed engine."""

    def __init__(self, model: nn.Module, config: Config, processes: Processes, bf16_weights: bool | None = None) -> None:
        """bf16_weights: hold the matrices in bf16 with float32 masters (None: as bf16_weights_apply
        decides from the config; tests force it on CPU, where training does not autocast)."""
        self.config = config
        self.processes = processes
        self.grad_accum = config.train.grad_accum
        self.grad_clip = config.train.grad_clip
        self.clip_here = clips_itself(config, processes.device.type)
        self.ds_config = deepspeed_config(config, processes.world_size, processes.device.type)
        self.ep_group = expert_parallel_group(model)
        refusal = bf16_weights_refusal(config)
        self.bf16_setting = ((bf16_weights, None) if bf16_weights is not None else
                             bf16_weights_apply(config, processes.device, refusal))
        # With bf16 weights the one-process optimizer steps (norm, clipping, the masters' update)
        # and the gradients are reduced here; DeepSpeed keeps the rest (broadcast, checkpoints).
        self.local = None
        if self.bf16_setting[0]:
            if refusal is not None:
                raise ValueError(f"DeepSpeedOptimization(bf16_weights=True): {refusal}")
            self.local = TorchOptimization(model, config, processes.device, bf16_weights=True,
                                           sharded=sharded_experts(model, self.ep_group))
            self.optimizer = self.local.optimizer
        else:
            self.optimizer = build_optimizer(model, config, processes.device.type)
        match_accelerator(processes.device.type)
        self.engine, _, _, _ = deepspeed.initialize(model=model, optimizer=self.optimizer, config=self.ds_config)
        if self.engine.checkpoint_engine is not None:  # DeepSpeed makes none under ZeRO 3 offload
            self.engine.checkpoint_engine = SafeLoading(self.engine.checkpoint_engine)
        # DeepSpeed's ZeRO 0 "all-reduce" on one process flattens every gradient into buckets,
        # averages over a group of one and copies back: an identity that costs a pass over every
        # gradient. Under ZeRO 1/2 the same hook fills the sharded optimizer's buffers: on there.
        # With bf16 weights the gradients are reduced here (FlatGradients), each in its dtype.
        if not reduces_gradients(config, processes.world_size) or self.local is not None:
            self.engine.enable_backward_allreduce = False
        if self.local is not None:  # DeepSpeed broadcast the first rank's weights; the masters follow
            broadcast_masters(self.local.bf16)
        self.model = self.engine.module
        self.summed_params = [] if self.local is None else self.local.summed_params
        self.flat_grads = None
        if self.local is not None and processes.world_size > 1:
            self.flat_grads = flat_gradients([p for p in self.model.parameters() if p.requires_grad],
                                             config, processes, self.local.bf16)
        self.predictor_ids = predictor_parameter_ids(self.model)
        self._pending = 0  # backward calls since the last step
        self._last_tag: str | None = None

    # -- the layout a checkpoint can be resumed under
    def layout(self) -> dict[str, int]:
        p = self.config.parallel
        return {"world_size": self.processes.world_size, "expert_parallel": p.expert_parallel, "zero_stage": p.zero_stage}

    # -- Optimization
    def _count_micro_batch(self) -> bool:
        """One more backward of this step, told to the engine: whether it is the accumulation boundary."""
        self._pending += 1
        boundary = self._pending >= self.grad_accum
        self.engine.set_gradient_accumulation_boundary(boundary)
        return boundary

    def backward(self, loss: torch.Tensor) -> None:
        boundary = self._count_micro_batch()
        if self.local is not None:  # bf16 weights summed over micro-batches: the first one starts the sums
            self.local.begin_micro_batch(accumulate=self._pending > 1)
        if self.flat_grads is not None:  # OverlappedGradients counts this backward's gradients from none
            self.flat_grads.begin()
        self.engine.backward(loss, scale_wrt_gas=False)  # the loop divided by grad_accum already
        if boundary and self.flat_grads is not None:
            self.flat_grads.reduce_mean_()

    def capture_refusal(self) -> str | None:
        return capture_refusal(self.config)

    def bf16_weights_applied(self) -> tuple[bool, str | None]:
        return self.bf16_setting

    def captured_backward(self, loss: torch.Tensor, accumulate: bool) -> None:
        """What a CUDA graph holds of backward() (mode.training.graphs.GraphedMicroStep): autograd,
        and the all-reduce where it runs beside the backward (OverlappedGradients). Under ZeRO 0
        (capture_refusal) the engine's backward is just that, then at the accumulation boundary
        the all-reduce, which after_replay runs outside the graph otherwise. accumulate: the graph
        of the later micro-batches (bf16 weights' sums: added to, not started)."""
        if self.local is not None:
            self.local.begin_micro_batch(accumulate)
        overlapped = self.flat_grads is not None and self.flat_grads.during_backward
        if overlapped:
            self.flat_grads.begin()
        loss.backward()
        if overlapped:
            self.flat_grads.reduce_mean_()

    def after_replay(self) -> None:
        """After each replay of a graph holding captured_backward: the micro-batch counted, and at
        the accumulation boundary every gradient all-reduced, as the engine's backward does."""
        if not self._count_micro_batch():
            return
        if self.flat_grads is not None:
            if not self.flat_grads.during_backward:  # otherwise the graph reduced them
                self.flat_grads.reduce_mean_()
        elif self.engine.enable_backward_allreduce:
            self.engine.allreduce_gradients()

    def step(self, lr: float) -> Tensor:
        if self._pending != self.grad_accum:
            raise RuntimeError(f"step() after {self._pending} backward calls; train.grad_accum is {self.grad_accum}")
        self._pending = 0
        if self.local is not None:  # norm, clipping, masters: the engine's step would run optimizer.step() alone
            return self.local.step(lr)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.clip_here:
            # Under ZeRO 0 the engine steps our AdamW itself (no wrapper), which applies the factor.
            params, predictor_params = split_predictor_parameters(self.model, self.predictor_ids)
            norm = self._exact_norm(params)
            apart = [([p.grad for p in predictor_params], self._exact_norm(predictor_params))] if predictor_params else []
            with clipped_gradients(self.engine.optimizer, [p.grad for p in params], norm, self.grad_clip, apart):
                self.engine.step()
        else:
            norm = None
            self.engine.step()
        if norm is None:
            norm = self.engine.get_global_grad_norm()
        if norm is None:
            norm = float("nan")
        return torch.as_tensor(norm, dtype=torch.float32, device=self.processes.device).detach()

    def _exact_norm(self, params: list[nn.Parameter]) -> Tensor:
        """Global gradient norm over params (those with a gradient), each once; experts summed over the ep group."""
        expert_sq = self._squared_norm([p.grad for p in params if is_moe_param(p)])
        shared_sq = self._squared_norm([p.grad for p in params if not is_moe_param(p)])
        if self.ep_group is not None:
            dist.all_reduce(expert_sq, group=self.ep_group)
        return (shared_sq + expert_sq).sqrt()

    def _squared_norm(self, grads: list[Tensor]) -> Tensor:
        """Sum of squares of every gradient, float32, 0-d on the device: one multi-tensor norm
        (a few kernels for all of them, instead of three per parameter)."""
        if not grads:
            return torch.zeros((), dtype=torch.float32, device=self.processes.device)
        return torch.nn.utils.get_total_norm(grads, 2.0).float().square()

    def state_dict(self) -> dict[str, Any]:
        raise RuntimeError("DeepSpeedOptimization saves through save_checkpoint (its state is sharded)")

    def load_state_dict(self, state: dict[str, Any]) -> None:
        raise RuntimeError("DeepSpeedOptimization loads through load_checkpoint (its state is sharded)")

    # -- DistributedOptimization
    def mean_over_ranks(self, values: dict[str, float]) -> dict[str, float]:
        keys = list(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.processes.device)
        dist.all_reduce(t)
        t /= self.processes.world_size
        return dict(zip(keys, t.tolist()))

    def save_checkpoint(self, run_dir: Path, client_state: dict[str, Any]) -> dict[str, Any]:
        """DeepSpeed's checkpoint in run_dir/deepspeed/<tag>; weights gathered for checkpoint.pt."""
        step = client_state["state"]["step"]
        tag = f"step{step}"
        save_dir = Path(run_dir) / DEEPSPEED_DIR
        with self._weights_as_saved():
            self.engine.save_checkpoint(
                str(save_dir), tag=tag,
                client_state={"mode_config": client_state["config"], "mode_state": client_state["state"],
                              "mode_layout": self.layout()},
            )
            weights = full_state_dict(self.model)
        dist.barrier()
        if self.processes.rank == 0:  # keep this tag and the one checkpoint.pt names until rank 0 rewrites it
            keep = {tag, self._last_tag}
            for old in save_dir.iterdir():
                if old.name not in keep and written_tag(old):
                    remove_tag(old)
        self._last_tag = tag
        return {
            "model": weights,
            "optimizer": {"engine": "deepspeed", "dir": DEEPSPEED_DIR, "tag": tag, "layout": self.layout()},
            "sharded": f"DeepSpeed ZeRO {self.config.parallel.zero_stage}, {self.processes.world_size} processes, "
                       f"expert_parallel {self.config.parallel.expert_parallel}",
        }

    def load_checkpoint(self, run_dir: Path, payload: dict[str, Any]) -> None:
        info = payload.get("optimizer")
        if not (isinstance(info, dict) and info.get("engine") == "deepspeed"):
            raise ConfigError(
                "--resume: this checkpoint.pt was written by a one-process run (python -m mode.train): its "
                "optimizer state is plain AdamW; resume it with python -m mode.train --resume"
            )
        if info["layout"] != self.layout():
            raise ConfigError(
                f"--resume: the checkpoint was saved with {info['layout']} and this run has {self.layout()}: "
                "DeepSpeed's sharded optimizer state cannot follow a different number of processes, "
                "expert_parallel or zero_stage; relaunch with the saved layout (the weights alone, in "
                "checkpoint.pt, load into any layout)"
            )
        load_dir = Path(run_dir) / info["dir"]
        with self._weights_as_saved():
            error = self._load_engine(load_dir, info["tag"], payload["state"])
        # Some files only one process reads (its optimizer shard): agree before anyone trains, so
        # that every process stops with every process's error, not one alone (which the launcher
        # would see as a crash, its message unprinted, while the others waited in a collective).
        errors = [None] * self.processes.world_size
        dist.all_gather_object(errors, error)
        failed = [f"[rank {rank}] {e}" for rank, e in enumerate(errors) if e is not None]
        if failed:
            raise ConfigError(f"--resume: DeepSpeed's checkpoint {load_dir / info['tag']}: {'; '.join(failed)}")
        self._last_tag = info["tag"]

    def _weights_as_saved(self) -> contextlib.AbstractContextManager[None]:
        """With bf16 weights, the float32 masters in the params' places: checkpoints hold (and a
        load writes) the masters, as a one-process run's do; the bf16 copies are rounded after."""
        return contextlib.nullcontext() if self.local is None else self.local.bf16.masters_as_params()

    def _load_engine(self, load_dir: Path, tag: str, state: dict[str, Any]) -> str | None:
        """Load this process's share of DeepSpeed's checkpoint: None, or what went wrong."""
        try:
            path, client = self.engine.load_checkpoint(
                str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=False
            )
        except UnsafeCheckpointError as e:
            return str(e)
        except (OSError, RuntimeError, KeyError, ValueError, EOFError) as e:  # a file missing, cut short or foreign
            return f"{type(e).__name__}: {e}"
        if path is None:
            return "missing or unreadable"
        if client.get("mode_state") != state:
            return f"holds step {client.get('mode_state')} but checkpoint.pt says {state}"
        return None
