"""Training: `python -m mode.train --config configs/X.yaml [--resume] [--section.field=value ...]`.

One loop for every setting: the optimizer step is delegated to an `Optimization` object
(plain AdamW here; mode.parallel supplies a DeepSpeed one), so logging, evaluation and
checkpoints exist once. A run folder holds config.yaml, metrics.jsonl, checkpoint.pt and
loss_vs_flops.png (mode.run_folder); everything is written to a temporary file first and
renamed, and the run holds the folder's lock while it trains. SIGINT (Ctrl-C) and SIGTERM
(kill, timeout, a job scheduler) stop it cleanly: every file whole, the checkpoint resumable.
"""
from __future__ import annotations

from mode.cli import finish, quiet_start, started

quiet_start(__name__)  # before torch: Ctrl-C while it imports ends with one line

import argparse
import contextlib
import io
import json
import math
import pickle
import sys
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor, nn
from tqdm import tqdm

from mode.config import Config, ConfigError, config_text, field_differences, load_config, save_config
from mode.data import DataError, TokenSplits, batch_generator, describe_source, load_splits, sample_batch
from mode.flops import model_flops, train_step_flops
from mode.layers.moe import MoEFFN
from mode.model import LanguageModel, ModelOutput
from mode.routing import CausalPredictor, Routing, TokenChoiceRouting, token_mask
from mode.run_folder import CHECKPOINT, CONFIG, METRICS, PLOT, FolderInUse, RunFolderLock, run_files_in
from mode.utils import (
    atomic_torch_save,
    atomic_write_bytes,
    atomic_write_text,
    folder_problem,
    interrupts_deferred,
    pick_device,
    read_metrics,
    remove_stale_temporaries,
    stop_how,
    stop_status,
    stops_on_signals,
)

POSITION_BINS = 16


# ----------------------------------------------------------------------------- schedule
def learning_rate(step: int, cfg: Any) -> float:
    """Linear warmup to train.lr, then cosine decay to train.min_lr at train.max_steps."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (cfg.lr - cfg.min_lr) * (1 + math.cos(math.pi * progress))


# ----------------------------------------------------------------------------- optimizer step
class Optimization(Protocol):
    """What the loop needs from an optimizer: backward, one step, and state for checkpoints."""

    def backward(self, loss: Tensor) -> None: ...

    def step(self, lr: float) -> Tensor: ...  # returns the gradient norm before clipping, 0-d, on the device

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@runtime_checkable
class DistributedOptimization(Optimization, Protocol):
    """An Optimization spread over processes (mode.parallel.DeepSpeedOptimization).

    Every rank calls these (they are collective); the Trainer writes checkpoint.pt from rank 0.
    """

    def mean_over_ranks(self, values: dict[str, float]) -> dict[str, float]: ...

    def save_checkpoint(self, run_dir: Path, client_state: dict[str, Any]) -> dict[str, Any]:
        """Save the sharded state; return checkpoint.pt's "model" (one-device layout) and "optimizer" entries."""
        ...

    def load_checkpoint(self, run_dir: Path, payload: dict[str, Any]) -> None: ...


def steps_within_budget(config: Config, world_size: int = 1) -> int:
    """train.flops_budget -> the whole optimizer steps whose training FLOPs (3 x forward, the tokens of
    every process's micro-batches) fit in it; a budget under one step is a ConfigError."""
    t = config.train
    per_step = train_step_flops(config, world_size)
    steps = math.floor(round(t.flops_budget / per_step, 9))  # 300 steps' FLOPs give 300, not 299.99999
    if steps < 1:
        raise ConfigError(f"train.flops_budget ({t.flops_budget:.4g}) is less than one step's training FLOPs "
                          f"({per_step:.4g} with {world_size} process(es))")
    return steps


def parameter_groups(model: nn.Module, weight_decay: float) -> list[dict[str, Any]]:
    """Decay matrices (linear and embedding weights), never norms' scales or biases."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


@contextlib.contextmanager
def clipped_gradients(
    optimizer: torch.optim.Optimizer,
    grads: list[Tensor],
    norm: Tensor,
    max_norm: float,
    apart: Sequence[tuple[list[Tensor], Tensor]] = (),
) -> Iterator[None]:
    """Inside, optimizer.step() steps on the gradients times min(1, max_norm / (norm + 1e-6)),
    clip_grad_norm_'s factor; max_norm <= 0 clips nothing.

    apart: more (gradients, their norm) groups, each clipped by its own norm, not counted in
    `norm` (the causal predictors: see TorchOptimization). Every gradient the optimizer steps
    on belongs to grads or to one group of apart.

    A fused AdamW applies the factor inside its own pass over the gradients (its grad_scale,
    with which GradScaler unscales, divides them by 1 / factor): one read and write of every
    gradient fewer than scaling them first (for 730M float32 gradients, 5.8 GB of traffic).
    Other optimizers get the factor multiplied into the gradients on entry.
    """
    if max_norm <= 0:
        yield
        return
    coef = _clip_factor(norm, max_norm)
    fused = bool(optimizer.defaults.get("fused"))
    for group_grads, group_norm in apart:
        if group_grads:  # the fused step multiplies these by coef too: their own factor over it
            group_coef = _clip_factor(group_norm, max_norm)
            torch._foreach_mul_(group_grads, group_coef / coef if fused else group_coef)
    if not fused:
        torch._foreach_mul_(grads, coef)
        yield
        return
    optimizer.grad_scale = coef.reciprocal()  # read by Adam(W).step()
    try:
        yield
    finally:
        del optimizer.grad_scale  # this step only


def _clip_factor(norm: Tensor, max_norm: float) -> Tensor:
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def predictor_parameter_ids(model: nn.Module) -> frozenset[int]:
    """The ids of the causal predictors' parameters (routing.causal=predictor), found once per model.

    The predictors are clipped apart from the model: their loss must never reach the language
    model, and in one global norm it would, by scaling the model's clipping (DESIGN.md: the
    predictor does not touch the LM loss).
    """
    return frozenset(id(p) for m in model.modules() if isinstance(m, CausalPredictor) for p in m.parameters())


def split_predictor_parameters(model: nn.Module, predictor_ids: frozenset[int]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the model's parameters, the causal predictors' parameters: predictor_parameter_ids), each with a gradient."""
    params = [p for p in model.parameters() if p.grad is not None]
    return [p for p in params if id(p) not in predictor_ids], [p for p in params if id(p) in predictor_ids]


class TorchOptimization:
    """AdamW with global-norm clipping, clipped *before* the optimizer step.

    keep_grads: gradients stay allocated and are zeroed in place between steps, instead of
    being freed. Needed under CUDA graphs (compile_mode=reduce-overhead): a freed gradient is
    replaced by the backward graph's own output tensor, which the next micro-batch's replay
    overwrites; an allocated one has each micro-batch's gradient added into it. (A parameter
    that got no gradient in a step then has a zero one: AdamW still decays it and moves it by
    its momentum, where a freed gradient would skip it; in every shipped config each
    parameter gets a gradient each step: tests/test_configs.py.)
    """

    def __init__(self, model: nn.Module, config: Config, device: torch.device, keep_grads: bool = False) -> None:
        t = config.train
        self.model = model
        self.keep_grads = keep_grads
        self.grad_clip = t.grad_clip
        self.predictor_ids = predictor_parameter_ids(model)
        self.optimizer = torch.optim.AdamW(
            parameter_groups(model, t.weight_decay),
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            fused=device.type == "cuda",
        )
        if keep_grads:
            for p in model.parameters():
                if p.requires_grad and p.grad is None:
                    p.grad = torch.zeros_like(p)

    def backward(self, loss: Tensor) -> None:
        loss.backward()

    def step(self, lr: float) -> Tensor:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        params, predictor_params = split_predictor_parameters(self.model, self.predictor_ids)
        grads, predictor_grads = [p.grad for p in params], [p.grad for p in predictor_params]
        norm = torch.nn.utils.get_total_norm(grads, 2.0)
        apart = [(predictor_grads, torch.nn.utils.get_total_norm(predictor_grads, 2.0))] if predictor_grads else []
        with clipped_gradients(self.optimizer, grads, norm, self.grad_clip, apart):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=not self.keep_grads)
        return norm.detach()

    def state_dict(self) -> dict[str, Any]:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state)


# ----------------------------------------------------------------------------- eager CUDA graphs
def eager_graphs(config: Config, device: torch.device, model: nn.Module, one_process: bool) -> tuple[bool, str | None]:
    """Whether the eager model's micro-batches run as CUDA graphs (train.cuda_graphs), and, where
    auto decides on a GPU, a note for the user saying which and why. true: required, and an error naming
    the field where they cannot run; auto: wherever they can; false: never. Without graphs an eager
    routed model is bound by the host's launches (bench/block_profile.py), with them by its kernels."""
    t = config.train
    if t.cuda_graphs is False or t.compile:  # compiled: train.compile_mode=reduce-overhead graphs it
        return False, None
    required = t.cuda_graphs is True
    if device.type != "cuda":
        if required:
            raise ConfigError(f"train.cuda_graphs needs a CUDA device (train.device is {t.device!r}: {device})")
        return False, None
    if not one_process:  # a DeepSpeed engine (launch/train.py) owns the gradients
        if required:
            raise ConfigError("train.cuda_graphs=true runs with python -m mode.train (one process) only")
        return False, "train.cuda_graphs=auto: plain eager (CUDA graphs run in one process, python -m mode.train)"
    reason = _host_reading_layer(model, device)
    if reason is None:
        return True, None if required else ("train.cuda_graphs=auto: each micro-batch's forward and backward run as one "
                                            "CUDA graph, captured at the first step (false: plain eager)")
    if required:
        raise ConfigError(f"train.cuda_graphs: {reason}; use moe.capacity_factor instead of dropless")
    return False, f"train.cuda_graphs=auto: plain eager, since {reason}"


def _host_reading_layer(model: nn.Module, device: torch.device) -> str | None:
    """The first MoE FFN that reads its routing on the host (bf16 tokens on this device, as training
    runs them), which would fail a capture mid-step; None if there is none."""
    probe = torch.empty(1, 8, device=device, dtype=torch.bfloat16)
    for name, module in model.named_modules():
        if isinstance(module, MoEFFN) and module.syncs_with_host(probe):
            backend = module.experts.backend
            why = (f"token choice on moe.backend={backend} sizes its expert groups there" if backend != "torch" else
                   "dropless token choice runs sync-free on moe.backend=torch only on an H100/H200-class GPU "
                   f"(this is a {torch.cuda.get_device_name(device)})")
            return f"{name} reads its routing on the host: {why}"
    return None


class GraphedMicroStep:
    """One micro-batch's forward and backward as one CUDA graph, for the eager model (train.cuda_graphs).

    Captured on the first call, after warm-up passes on a side stream (cuBLAS and Triton set
    themselves up; their gradients are zeroed after), then replayed: the batch is copied into
    the graph's input tensors and one launch runs every kernel. Without torch.compile this
    removes the host's cost per kernel, which routed blocks feel most: on an H100 an eager MoD
    block at 12.5% capacity ran 0.8 ms of kernels in 3.6 ms of wall time (bench/block_profile.py).

    The returned outputs live in the graph's memory, which the next replay overwrites: copy
    what must outlive it (the Trainer does). Gradients must stay allocated between steps
    (TorchOptimization(keep_grads=True)): each replay adds its gradients into those tensors.
    """

    WARMUP_PASSES = 3

    def __init__(self, model: nn.Module, backward: Callable[[Tensor], None], loss_divisor: int) -> None:
        self.model, self.backward, self.loss_divisor = model, backward, loss_divisor
        self.graph: torch.cuda.CUDAGraph | None = None

    def __call__(self, x: Tensor, y: Tensor) -> ModelOutput:
        if self.graph is None:
            self._capture(x, y)
        self.x.copy_(x)
        self.y.copy_(y)
        self.graph.replay()
        return self.out

    def _pass(self) -> ModelOutput:
        # No autocast cache: cast weights cached across the capture's boundary would outlive it.
        with torch.autocast("cuda", dtype=torch.bfloat16, cache_enabled=False):
            out = self.model(self.x, self.y)
        self.backward(out.loss / self.loss_divisor)
        return out

    def _capture(self, x: Tensor, y: Tensor) -> None:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if any(p.grad is None for p in params):
            raise RuntimeError("GraphedMicroStep: allocate every gradient first (TorchOptimization(keep_grads=True))")
        self.x, self.y = x.clone(), y.clone()  # the graph's inputs: each call copies its batch in
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        # The warm-up passes draw no numbers from the run's generators (routing.random): replay k
        # draws what eager pass k would, and a resumed run, which captures again, what the
        # uninterrupted one drew.
        with torch.cuda.stream(side), torch.random.fork_rng(devices=[self.x.device]):
            for _ in range(self.WARMUP_PASSES):
                self._pass()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self.out = self._pass()
        for p in params:  # the warm-up passes' gradients belong to no step (capturing ran nothing)
            p.grad.zero_()
        self.graph = graph


# ----------------------------------------------------------------------------- router statistics
class HostCopy:
    """Tensors' values on their way to the host, in one transfer.

    On CUDA the copy is queued behind the work that computes the values (into pinned memory,
    without waiting) and values() waits for that copy alone, not for work queued after it: the
    training loop reads a step's losses after it has queued the next step, so the GPU never runs
    dry while the host waits. One transfer instead of one per value: a step reads its losses and
    some ten statistics per routed layer, and each separate read would stall the queue again.
    """

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        self.sizes = [t.numel() for t in tensors]
        flat = torch.cat([t.detach().float().reshape(-1) for t in tensors])
        self.done: torch.cuda.Event | None = None
        if flat.is_cuda:
            self.host = torch.empty(flat.shape, dtype=flat.dtype, pin_memory=True)
            self.host.copy_(flat, non_blocking=True)
            self.done = torch.cuda.Event()
            self.done.record(torch.cuda.current_stream(flat.device))
        else:
            self.host = flat

    def values(self) -> list[list[float]]:
        if self.done is not None:
            self.done.synchronize()
        return split_list(self.host.tolist(), self.sizes)


def split_list(flat: list[float], sizes: Sequence[int]) -> list[list[float]]:
    """flat cut into consecutive pieces of the given sizes."""
    out, start = [], 0
    for size in sizes:
        out.append(flat[start : start + size])
        start += size
    return out


def summary_tensors(routing: Routing) -> dict[str, Tensor]:
    """What a step reports for one router, still on the device: the fraction of tokens
    processed, the gate's mean and spread, then the router's own stats."""
    gates = routing.gates.detach().float()
    processed = routing.stats["processed"] if "processed" in routing.stats else processed_fraction(routing)
    # The population spread (no Bessel correction), so that several ranks' spreads pool exactly.
    out = {"processed": processed, "gate_mean": gates.mean(), "gate_std": gates.std(correction=0)}
    for name, value in routing.stats.items():
        out.setdefault(name, value)
    return out


def summaries_from(tensors: dict[str, dict[str, Tensor]], values: list[list[float]]) -> dict[str, dict[str, Any]]:
    """Per layer and statistic: a float, or a list rounded to 5 decimals (tokens per expert), in the
    order of `tensors`; values are HostCopy.values() of those tensors."""
    out: dict[str, dict[str, Any]] = {}
    entries = ((layer, name, t) for layer, stats in tensors.items() for name, t in stats.items())
    for (layer, name, t), vals in zip(entries, values, strict=True):
        out.setdefault(layer, {})[name] = vals[0] if t.numel() == 1 else [round(v, 5) for v in vals]
    return out


# Statistics that count tokens (summed over ranks); every other one is a mean over tokens.
COUNT_STATS = ("tokens_per_expert",)


def pool_summaries(summaries: list[dict[str, dict[str, Any]]], mean_over_ranks: Callable[[list[float]], list[float]],
                   world_size: int) -> list[dict[str, dict[str, Any]]]:
    """Each rank's per-micro-batch statistics -> those of the whole micro-batch over all ranks.

    Every rank holds the same number of sequences, so each router has as many gates and
    tokens on every rank: a mean over tokens pools as the mean over ranks, a count as the
    sum, and the spread through the second moment (std^2 + mean^2). Collective: every rank
    calls it, with summaries of the same layout; one all-reduce for all of them.
    """
    return _unpooled(summaries, mean_over_ranks(_pooling_values(summaries)), world_size)


def pool_as_ranks(shares: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """One micro-batch's statistics from those of its row blocks, each one process's share computed
    here in turn (mode.evaluate of a multi-process run): pooled as pool_summaries pools ranks."""
    if len(shares) == 1 or not shares[0]:
        return shares[0]
    columns = zip(*(_pooling_values([share]) for share in shares), strict=True)
    return _unpooled([shares[0]], [sum(column) / len(shares) for column in columns], len(shares))[0]


def _pooling_values(summaries: list[dict[str, dict[str, Any]]]) -> list[float]:
    """The statistics as the values that average over ranks: gate_std as the second moment."""
    flat: list[float] = []
    for summary in summaries:
        for stats in summary.values():
            for name, value in stats.items():
                if name == "gate_std":
                    value = value**2 + stats["gate_mean"] ** 2
                flat.extend(value if isinstance(value, list) else [value])
    return flat


def _unpooled(summaries: list[dict[str, dict[str, Any]]], pooled_values: list[float], world_size: int
              ) -> list[dict[str, dict[str, Any]]]:
    """The layout of summaries filled with pooled_values (their _pooling_values averaged over ranks)."""
    pooled = iter(pooled_values)
    out = []
    for summary in summaries:
        out.append({})
        for layer, stats in summary.items():
            new = out[-1][layer] = {}
            for name, value in stats.items():
                n = len(value) if isinstance(value, list) else 1
                vals = [next(pooled) * (world_size if name in COUNT_STATS else 1) for _ in range(n)]
                new[name] = [round(v, 5) for v in vals] if isinstance(value, list) else vals[0]
            new["gate_std"] = math.sqrt(max(0.0, new["gate_std"] - new["gate_mean"] ** 2))
    return out


def processed_fraction(routing: Routing) -> Tensor:
    """Share of tokens an expert-choice routing sent through (indices are positions in a group); 0-d."""
    groups, tokens_per_group = routing.logits.shape[:2]
    return token_mask(routing.indices.reshape(groups, -1), tokens_per_group).float().mean()


def output_tensors(out: ModelOutput, loss_keys: Sequence[str]) -> tuple[list[Tensor], dict[str, dict[str, Tensor]]]:
    """The named losses and every routed layer's summary_tensors, still on the device."""
    return [getattr(out, key).detach() for key in loss_keys], {layer: summary_tensors(r) for layer, r in routed_layers(out)}


def copy_outputs(tensors: tuple[list[Tensor], dict[str, dict[str, Tensor]]]) -> tuple[list[Tensor], dict[str, dict[str, Tensor]]]:
    """output_tensors' result with every tensor cloned (detached)."""
    losses, summaries = tensors
    return ([t.detach().clone() for t in losses],
            {layer: {name: t.detach().clone() for name, t in stats.items()} for layer, stats in summaries.items()})


Outputs = list[tuple[list[Tensor], dict[str, dict[str, Tensor]]]]  # output_tensors of each micro-batch


def outputs_to_host(outputs: Outputs, extra: Sequence[Tensor] = ()) -> HostCopy:
    """output_tensors of several micro-batches (and extra 0-d tensors), queued to the host in one transfer."""
    flat = [t for losses, stats in outputs for t in [*losses, *(v for per_layer in stats.values() for v in per_layer.values())]]
    return HostCopy(flat + list(extra))


def parse_outputs(outputs: Outputs, loss_keys: Sequence[str], copy: HostCopy,
                  ) -> tuple[list[dict[str, float]], list[dict[str, dict[str, Any]]], list[float]]:
    """outputs_to_host's values: per micro-batch its losses and its layers' summaries, then the extra values."""
    values = iter(copy.values())
    losses, summaries = [], []
    for _, stats in outputs:
        losses.append({key: next(values)[0] for key in loss_keys})
        count = sum(len(per_layer) for per_layer in stats.values())
        summaries.append(summaries_from(stats, [next(values) for _ in range(count)]))
    return losses, summaries, [v[0] for v in values]


def read_output(out: ModelOutput, loss_keys: Sequence[str]) -> tuple[dict[str, float], dict[str, dict[str, Any]]]:
    """The named losses and every routed layer's summary, copied from the device in one transfer."""
    outputs = [output_tensors(out, loss_keys)]
    losses, summaries, _ = parse_outputs(outputs, loss_keys, outputs_to_host(outputs))
    return losses[0], summaries[0]


EXPERT_ROUTER = ".ffn"  # the suffix routed_layers gives an expert router's name


def routed_layers(output: ModelOutput) -> Iterator[tuple[str, Routing]]:
    """(name, routing) of every router: 'layer3' routes around a block, 'layer3.ffn' among experts."""
    for i, (depth, ffn) in enumerate(zip(output.routings, output.ffn_routings)):
        if depth is not None:
            yield f"layer{i}", depth
        if ffn is not None:
            yield f"layer{i}{EXPERT_ROUTER}", ffn


def is_expert_router(name: str) -> bool:
    """Whether a routed_layers name is an expert router's (else a depth router's)."""
    return name.endswith(EXPERT_ROUTER)


def share_reaching(name: str, processed: dict[str, float]) -> float:
    """The share of all tokens that reach router `name`, from the routers' `processed` shares: a
    Staged MoDE FFN (layer3.ffn under layer3) sees only the tokens its depth router chose, and
    reports its own shares over those; every other router sees every token (1.0)."""
    return processed.get(name.removesuffix(EXPERT_ROUTER), 1.0) if is_expert_router(name) else 1.0


def chosen_positions(output: ModelOutput, seq_len: int) -> Iterator[tuple[str, Tensor]]:
    """(name, the sequence positions (N,) in [0, seq_len) its routing chose) for every router whose
    indices are tokens: depth routers, and expert choice (token choice's indices are slots: left out).

    An expert-choice index is a token's place in its group of group_size sequences laid end to end;
    inside a Staged MoDE block the group is of the depth router's chosen tokens, whose index in the
    flattened (B, k) chosen set maps back to a position through the depth router's own indices."""
    for i, (depth, ffn) in enumerate(zip(output.routings, output.ffn_routings)):
        if depth is not None:
            yield f"layer{i}", depth.indices.reshape(-1) % seq_len  # (B, k) positions in their sequences
        if ffn is None or isinstance(ffn, TokenChoiceRouting):
            continue
        groups, group_tokens = ffn.logits.shape[:2]
        offsets = torch.arange(groups, device=ffn.indices.device).unsqueeze(1) * group_tokens  # (G, 1)
        flat = (ffn.indices.reshape(groups, -1) + offsets).reshape(-1)  # index among all B * T_inner tokens
        yield f"layer{i}{EXPERT_ROUTER}", (flat % seq_len if depth is None else depth.indices.reshape(-1)[flat])


def position_bins(seq_len: int) -> int:
    """POSITION_BINS, or one bin a position in sequences shorter than that."""
    return min(POSITION_BINS, seq_len)


def position_histogram(positions: Tensor, seq_len: int, bins: int) -> Tensor:
    """How often each of `bins` buckets of the sequence was chosen: positions (N,) -> (bins,).
    Bucket b holds the positions p with p * bins // seq_len == b (bucket_widths)."""
    return torch.bincount(positions * bins // seq_len, minlength=bins).float().cpu()


def bucket_widths(seq_len: int, bins: int) -> Tensor:
    """How many positions each bucket of position_histogram holds: equal where bins divides seq_len."""
    return position_histogram(torch.arange(seq_len), seq_len, bins)


def position_share(histogram: Tensor, seq_len: int) -> list[float]:
    """Each bucket's share of the choices per position it holds, normalised to sum to 1: a router
    choosing every position equally often reads 1 / bins in every bucket, whatever their widths."""
    density = histogram / bucket_widths(seq_len, len(histogram))
    return [round(float(v), 4) for v in density / density.sum()]


def average_summaries(summaries: list[dict[str, dict[str, Any]]], sum_counts: bool = False) -> dict[str, dict[str, Any]]:
    """Per-layer statistics over several micro-batches: means averaged; counts (COUNT_STATS) summed
    with sum_counts (the micro-batches of one optimizer step: its tokens, as over processes), else
    averaged (per validation batch)."""
    out: dict[str, dict[str, Any]] = {}
    for layer in summaries[0]:
        out[layer] = {}
        for key, first in summaries[0][layer].items():
            values = [s[layer][key] for s in summaries]
            divisor = 1 if sum_counts and key in COUNT_STATS else len(values)
            if isinstance(first, list):
                out[layer][key] = [round(sum(col) / divisor, 5) for col in zip(*values)]
            else:
                out[layer][key] = round(sum(values) / divisor, 5)
        if "gate_std" in out[layer]:
            # Every micro-batch has as many gates: the spread of all of them pools, as over
            # processes (pool_summaries), not as a mean of the spreads. Each micro-batch's variance
            # plus its mean's distance from the unrounded overall mean: E[g^2] - mean^2 with the
            # rounded mean lost spreads below about 3e-3 to the rounding (gates near 0.5).
            means = [s[layer]["gate_mean"] for s in summaries]
            mean = sum(means) / len(means)
            variance = sum(s[layer]["gate_std"] ** 2 + (m - mean) ** 2 for s, m in zip(summaries, means)) / len(means)
            out[layer]["gate_std"] = round(math.sqrt(variance), 5)
    return out


def to_device(batch: Tensor, device: torch.device) -> Tensor:
    """A host batch on device. To CUDA from contiguous pinned memory without waiting: a copy
    from pageable memory, or from a strided view (which PyTorch first makes contiguous in
    pageable memory), waits for the device's queue to drain (the step before it)."""
    if device.type != "cuda":
        return batch.to(device)
    return batch.contiguous().pin_memory().to(device, non_blocking=True)


# ----------------------------------------------------------------------------- the trainer
@dataclass
class RunState:
    step: int = 0  # optimizer steps completed
    tokens: int = 0
    flops: float = 0.0


LOSS_KEYS = ("loss", "lm_loss", "aux_loss")  # what a step reports of ModelOutput
# How a run executes, not what it learns: how often it logs, evaluates and saves, where and how
# it runs (and parallel.*: the same mathematics up to rounding).
EXECUTION_FIELDS = (
    "train.log_interval", "train.eval_interval", "train.eval_batches", "train.checkpoint_interval", "train.device",
    "train.compile", "train.compile_mode", "train.cuda_graphs",
)
RESUMABLE_FIELDS = (
    "train.max_steps", "train.flops_budget", "train.progress", "train.out_dir", *EXECUTION_FIELDS,
    "train.init_from",  # a resumed run loads its own weights
)
INTERRUPTED = 130  # the exit status of a run stopped by Ctrl-C (by SIGTERM: TERMINATED)
TERMINATED = 143


@dataclass
class LaunchedStep:
    """A step queued on the device (Trainer.launch_step), its values still on their way to the host."""

    state: RunState  # the run's state after this step
    lr: float
    outputs: Outputs  # output_tensors of each micro-batch
    copy: HostCopy  # of outputs, then the gradient norm
    timer: "StepTimer"  # how long it computed, for tokens/s


class StepTimer:
    """How long one step computed: between two CUDA events the step's stream passes (the GPU's
    view: the time it waited for the host's launches counts, evaluation and the host's pauses
    between steps do not), or two host clock readings on CPU, which computes as it launches."""

    def __init__(self, device: torch.device) -> None:
        self.events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else None
        self.start()

    def start(self) -> None:
        if self.events is None:
            self.began = time.perf_counter()
        else:
            self.events[0].record()

    def stop(self) -> None:
        if self.events is None:
            self.ended = time.perf_counter()
        else:
            self.events[1].record()

    def seconds(self) -> float:
        if self.events is None:
            return self.ended - self.began
        self.events[1].synchronize()  # just after the step's values: no wait to speak of
        return self.events[0].elapsed_time(self.events[1]) / 1e3


def _token_dtype_hint(config: Config, data: TokenSplits) -> str:
    """A vocabulary past uint16's range from a file read as uint32 is most likely uint16 ids read in pairs."""
    d = config.data
    if d.source == "tokens" and d.token_dtype == "uint32" and data.vocab_size > 1 << 16:
        return "; if the file holds uint16 ids, set data.token_dtype=uint16"
    return ""


class CheckpointWriteError(OSError):
    """A checkpoint could not be written (a full disk, a lost mount); the message says which step the
    run folder's checkpoint still holds, whole."""

    def __init__(self, trainer: "Trainer", error: OSError) -> None:
        path = trainer.out_dir / CHECKPOINT
        kept = (f"{path} still holds step {trainer.saved_step}, whole: continue with --resume once there is room"
                if trainer.saved_step is not None else "the run has no checkpoint yet")
        super().__init__(f"cannot write the checkpoint of step {trainer.state.step} to {path} "
                         f"({error.strerror or error}); {kept}")


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
        self.model = model if model is not None else build_model(config, self.device, resume)
        t = config.train
        self.forward = torch.compile(self.model, mode=t.compile_mode) if t.compile else self.model
        self.notes: list[str] = []  # for the user, before training starts
        # The eager model as CUDA graphs (train.cuda_graphs); one process: a given optimization is an engine's.
        eager_graphed, note = eager_graphs(config, self.device, self.model, one_process=optimization is None)
        if note:
            self.notes.append(note)
        # CUDA graphs (compiled, or the eager model's) own their outputs and add into kept gradients.
        self.graphed = (t.compile and t.compile_mode == "reduce-overhead") or eager_graphed
        self.optimization = optimization or TorchOptimization(self.model, config, self.device, keep_grads=self.graphed)
        self.graphed_step: GraphedMicroStep | None = None
        if eager_graphed:
            self.graphed_step = GraphedMicroStep(self.model, self.optimization.backward, t.grad_accum)
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
        problem = folder_problem(self.out_dir)
        if problem:
            raise ConfigError(f"train.out_dir: {self.out_dir} {problem}")
        checkpoint = self.out_dir / CHECKPOINT
        if resume and not checkpoint.is_file():
            raise FileNotFoundError(f"--resume: no checkpoint at {checkpoint}")
        if not resume:
            self._refuse_written_folder()
        self._lock_run_folder()
        try:
            if resume:
                self._resume_from(checkpoint)
            if self.is_main:
                save_config(self.config, self.out_dir / CONFIG)
        except BaseException:  # a refused resume leaves the folder free for the next attempt
            self.close()
            raise

    def _resume_from(self, checkpoint: Path) -> None:
        self.load_checkpoint(checkpoint)
        self._check_not_past_the_end()
        self._truncate_metrics()
        if self.is_main:  # a checkpoint write killed outright (SIGKILL, out of memory) left its temporary
            self.notes += [f"removed {stale.name}, a checkpoint write that never finished"
                           for stale in remove_stale_temporaries(checkpoint)]

    def _refuse_written_folder(self) -> None:
        """A new run writes no file over another run's (nor over a --config file kept there). A config.yaml
        holding exactly what this run writes is its own, left by the same command stopped before training."""
        written = [name for name in run_files_in(self.out_dir) if not (name == CONFIG and self._own_config())]
        if CHECKPOINT in written:
            raise FileExistsError(
                f"{self.out_dir} already holds a run ({self.out_dir / CHECKPOINT}); pass --resume to continue it "
                f"or choose another --train.out_dir"
            )
        if METRICS in written:  # a new run would append its curve to the old one's
            raise FileExistsError(
                f"{self.out_dir} holds {METRICS} of a run that stopped before its first checkpoint: remove "
                f"it (or the folder) or choose another --train.out_dir"
            )
        if written:
            raise FileExistsError(
                f"{self.out_dir} holds {', '.join(written)}, which a new run would replace: choose another "
                f"--train.out_dir (or move them away)"
            )

    def _own_config(self) -> bool:
        path = self.out_dir / CONFIG
        try:
            return path.is_file() and path.read_text() == config_text(self.config)
        except (OSError, UnicodeDecodeError):
            return False

    def _lock_run_folder(self) -> None:
        """Rank 0 makes the folder and holds its lock for the run's lifetime; every rank learns whether
        it could, so all stop together when another process holds it."""
        self.lock = RunFolderLock(self.out_dir)
        problem = None
        if self.is_main:
            try:
                self.out_dir.mkdir(parents=True, exist_ok=True)
                self.lock.acquire()
            except FolderInUse as e:
                problem = f"train.out_dir: {e}"
            except OSError as e:  # no permission, a read-only disk: one line naming the field, not a traceback
                problem = f"train.out_dir: cannot create {self.out_dir}: {e.strerror or e}"
        failed = self.mean_over_ranks({"lock_failed": float(problem is not None)})["lock_failed"] > 0
        if failed:
            raise ConfigError(problem or f"train.out_dir: rank 0 could not take {self.out_dir} (it says why)")

    def close(self) -> None:
        """Release the run folder (the lock); the process ending does the same."""
        lock = getattr(self, "lock", None)
        if lock is not None:
            lock.release()

    def _check_not_past_the_end(self) -> None:
        """A resume whose max_steps (or budget) ends before the checkpoint's step would leave the run
        folder's config.yaml contradicting its checkpoint and metrics."""
        t = self.config.train
        if self.state.step > t.max_steps:
            source = f" (train.flops_budget={t.flops_budget:.4g})" if t.flops_budget is not None else ""
            raise ConfigError(f"--resume: the run is at step {self.state.step}, past train.max_steps={t.max_steps}"
                              f"{source}; resume with at least its steps")

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
            payload.update(model=self.model.state_dict(), optimizer=self.optimization.state_dict())
        return payload

    def save_checkpoint(self) -> None:
        with interrupts_deferred():  # a Ctrl-C while writing stops the run after the checkpoint is whole
            payload = self.checkpoint_payload()
            if self.is_main:
                try:
                    atomic_torch_save(payload, self.out_dir / CHECKPOINT)
                except OSError as e:  # a full disk: the rename never happened, the previous file is whole
                    raise CheckpointWriteError(self, e) from None
            self.saved_step = self.state.step

    def load_checkpoint(self, path: Path) -> None:
        payload = load_checkpoint_file(path, self.device)
        differ = curve_differences(payload["config"], self.config)
        if differ:
            raise ConfigError(
                f"--resume: the config differs from the run's, saved in {path}: {', '.join(differ)}. Resume with "
                f"the run's settings ({self.out_dir / 'config.yaml'}), or start a new run in another --train.out_dir"
            )
        changes = field_differences(payload["config"], self.config, _may_change_on_resume)
        self.notes += [f"--resume changes {change}" for change in changes]
        if isinstance(self.optimization, DistributedOptimization):
            self.optimization.load_checkpoint(self.out_dir, payload)
        elif payload.get("sharded"):
            raise ConfigError(
                f"--resume: {path} belongs to a multi-process run ({payload['sharded']}) whose optimizer state is "
                "sharded over its processes: resume it with launch/train.py (its weights load on one device)"
            )
        else:
            self.model.load_state_dict(payload["model"])
            self.optimization.load_state_dict(payload["optimizer"])
        self.state = RunState(**payload["state"])
        self.saved_step = self.state.step
        restore_rng(payload, self.device)

    def _truncate_metrics(self) -> None:
        """Drop records a crashed run logged after its last checkpoint, so the curve continues; a last
        line cut short by the crash goes with them (a bad line elsewhere is an error naming it)."""
        path = self.out_dir / METRICS
        if not (self.is_main and path.exists()):
            return
        records, notes = read_metrics(path)
        self.notes += notes
        kept = [record for record in records if record["step"] <= self.state.step]
        atomic_write_text(path, "".join(json.dumps(record) + "\n" for record in kept))  # as log() wrote them

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
            with open(self.out_dir / METRICS, "a") as f:
                f.write(json.dumps(record) + "\n")

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

    def micro_batch(self, split: Tensor, step: int, micro: int) -> tuple[Tensor, Tensor]:
        """This rank's share of the global micro-batch: one sample for every world size."""
        t = self.config.train
        global_batch = t.batch_size * self.world_size
        x, y = sample_batch(split, global_batch, self.config.data.seq_len, batch_generator(t.seed, step, micro))
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
        outputs = []
        timer = StepTimer(self.device)
        self.model.train()
        for micro in range(t.grad_accum):
            x, y = self.micro_batch(self.data.train, step, micro)
            self._new_step()
            if self.graphed_step is not None:
                out = self.graphed_step(x, y)  # forward and backward: one graph replayed
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
        tokens = self.tokens_per_step
        self.state = RunState(step + 1, self.state.tokens + tokens, self.state.flops + tokens * self.flops_per_token)
        # One device-to-host transfer per step: losses, statistics, norm.
        copy = outputs_to_host(outputs, [grad_norm])
        timer.stop()
        return LaunchedStep(self.state, lr, outputs, copy, timer)

    def finish_step(self, launched: LaunchedStep) -> dict[str, Any]:
        """A launched step's metrics: waits for its values alone (not for steps queued after it);
        pooled over ranks (collective: every rank finishes the same steps in the same order)."""
        t = self.config.train
        micro_losses, summaries, (norm,) = parse_outputs(launched.outputs, LOSS_KEYS, launched.copy)
        losses = self.mean_over_ranks({key: sum(m[key] for m in micro_losses) / t.grad_accum for key in LOSS_KEYS})
        summaries = self.pool_over_ranks(summaries)
        routing = average_summaries(summaries, sum_counts=True) if summaries[0] else {}
        return {**losses, "lr": launched.lr, "grad_norm": norm, "routing": routing}

    def _new_step(self) -> None:
        """Before each compiled forward: the last one's outputs have been read (a CUDA-graphed
        model, compile_mode=reduce-overhead, reuses their memory on its next replay)."""
        if self.config.train.compile:
            torch.compiler.cudagraph_mark_step_begin()

    def evaluate(self) -> dict[str, Any]:
        """Validation loss and router statistics; leaves the global RNG as it found it.

        The random-routing ablation draws from the global RNG, which checkpoints save: were
        evaluation to advance it, a run that evaluates at other steps (a resumed one, whose
        first leg ended with an evaluation) would route differently from then on.
        """
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices):
            return self._evaluate()

    @torch.no_grad()
    def _evaluate(self) -> dict[str, Any]:
        t = self.config.train
        self.model.eval()
        total, summaries, histograms = 0.0, [], {}
        seq_len = self.config.data.seq_len
        bins = position_bins(seq_len)
        for i in range(t.eval_batches):
            shares = []
            for x, y in self._validation_blocks(i):
                self._new_step()
                with self.autocast():
                    out = self.forward(x, y)
                micro_losses, summary = read_output(out, ("lm_loss",))
                total += micro_losses["lm_loss"] / self.eval_splits
                shares.append(summary)
                for name, positions in chosen_positions(out, seq_len):
                    histograms[name] = histograms.get(name, 0) + position_histogram(positions, seq_len, bins)
            summaries.append(pool_as_ranks(shares))
        routing = average_summaries(self.pool_over_ranks(summaries)) if summaries[0] else {}
        for name, hist in histograms.items():
            hist = torch.tensor(self.mean_of_lists([hist.tolist()])[0])  # every rank's positions
            routing[name]["position_share"] = position_share(hist, seq_len)
        losses = {"val_loss": total / t.eval_batches}
        if self.config.routing.causal != "none":
            losses["val_loss_causal"] = self._causal_val_loss(routing)
        return {**self.mean_over_ranks(losses), "routing": routing}

    def _validation_blocks(self, batch: int) -> Iterator[tuple[Tensor, Tensor]]:
        """Validation batch `batch` (the same at every evaluation: seeded apart from training's), in
        eval_splits row blocks of equal size."""
        x, y = self.micro_batch(self.data.val, -1, batch)
        return zip(x.chunk(self.eval_splits), y.chunk(self.eval_splits), strict=True)

    def _causal_val_loss(self, routing: dict[str, dict[str, Any]]) -> float:
        """The same validation batches routed by the causal decision (as sampling routes them).

        Adds each routed layer's share of tokens actually processed under causal routing
        ("causal_processed"), pooled over the batches: a Staged MoDE FFN's share is of the tokens
        its depth router chose, whose number varies from batch to batch, so each batch weighs by
        it. Runs the uncompiled model: causal routing has data-dependent shapes.
        """
        t = self.config.train
        total, processed, weights = 0.0, {}, {}
        for i in range(t.eval_batches):
            for x, y in self._validation_blocks(i):
                with self.autocast():
                    out = self.model(x, y, routing_mode="causal")
                total += float(out.lm_loss) / self.eval_splits
                shares = {name: float(r.stats["processed"]) for name, r in routed_layers(out) if "processed" in r.stats}
                for name, share in shares.items():
                    weight = share_reaching(name, shares)
                    processed[name] = processed.get(name, 0.0) + share * weight
                    weights[name] = weights.get(name, 0.0) + weight
        names = [name for name in processed if name in routing]
        pooled = self.mean_of_lists([[processed[n] for n in names], [weights[n] for n in names]])
        for name, value, weight in zip(names, *pooled):
            routing[name]["causal_processed"] = round(value / weight, 5) if weight > 0 else 0.0
        return total / t.eval_batches

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
        self.records: list[dict[str, Any]] = []
        self.bar = tqdm(
            total=t.max_steps, initial=self.state.step, disable=not (t.progress and self.is_main),
            dynamic_ncols=True, file=sys.stdout,
        )
        self.window_seconds, self.window_tokens = 0.0, 0
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
                self.records.append(evaluation)
                self.log(evaluation)
                if self.is_main:
                    self.bar.write(f"step {step}: val_loss {evaluation['val_loss']:.4f}")
            if step % t.checkpoint_interval == 0 or step == t.max_steps:
                self.save_checkpoint()
        self.bar.close()
        if self.is_main:
            plot_losses(self.out_dir)
        return self.records

    def _report(self, launched: LaunchedStep) -> None:
        """Finish a launched step: progress bar, tokens/s, and its record at log intervals."""
        t = self.config.train
        metrics = self.finish_step(launched)
        self.window_tokens += self.tokens_per_step
        self.window_seconds += launched.timer.seconds()
        step = launched.state.step
        record = {"step": step, "tokens": launched.state.tokens, "flops": launched.state.flops, **metrics}
        record["tokens_per_s"] = self.window_tokens / max(self.window_seconds, 1e-9)
        record["processes"] = self.world_size  # tokens and tokens_per_s count every process's
        self.bar.update(1)
        self.bar.set_postfix_str(self._progress_text(record))
        if step % t.log_interval == 0 or step == t.max_steps:
            self.records.append(record)
            self.log(record)
            self.window_seconds, self.window_tokens = 0.0, 0

    def _progress_text(self, record: dict[str, Any]) -> str:
        fractions = " ".join(
            f"{name.removeprefix('layer')}:{stats['processed']:.2f}" for name, stats in record["routing"].items()
        )
        text = f"loss {record['loss']:.3f} | {record['tokens_per_s']:.0f} tok/s"
        return f"{text} | routed {fractions}" if fractions else text


# ----------------------------------------------------------------------------- checkpoints & plots
def build_model(config: Config, device: torch.device | str, resume: bool = False) -> LanguageModel:
    """The model a run trains: initialised from train.seed's RNG as it stands, or, for a new run
    with train.init_from, holding that checkpoint's weights (one-device layout: a one-process
    run's, or a multi-process run's with every expert gathered). A resumed run loads its own."""
    model = LanguageModel(config).to(device)
    if config.train.init_from is not None and not resume:
        load_init_weights(model, config)
    return model


def load_init_weights(model: LanguageModel, config: Config) -> None:
    """train.init_from: copy a checkpoint's weights into model; its model section must be this run's."""
    path = config.train.init_from
    try:
        payload = load_checkpoint_file(Path(path))
    except (FileNotFoundError, ValueError) as e:
        raise ConfigError(f"train.init_from: {e}") from None
    differ = field_differences(payload["config"], config, lambda name: name.startswith("model."))
    if differ:
        raise ConfigError(f"train.init_from: {path} holds another model: {', '.join(differ)}")
    try:
        model.load_state_dict(payload["model"])
    except RuntimeError as e:  # routing or moe fields that add, drop or reshape weights
        routed = field_differences(payload["config"], config, lambda name: name.startswith(("routing.", "moe.")))
        first = str(e).strip().splitlines()[-1].strip()
        raise ConfigError(
            f"train.init_from: the weights in {path} do not fit this model ({first}); its routing / moe "
            f"fields that differ: {', '.join(routed) or 'none'}"
        ) from None


def describes_execution(name: str) -> bool:
    """Whether a config field says how a run executes (EXECUTION_FIELDS, parallel.*), not what it learns."""
    return name in EXECUTION_FIELDS or name.startswith("parallel.")


def _may_change_on_resume(name: str) -> bool:
    """Fields a resumed run may change: how long it runs, how often it logs, evaluates and saves,
    where and how it executes; every other field defines the curve it continues."""
    return name in RESUMABLE_FIELDS or describes_execution(name)


def curve_differences(saved: dict[str, Any], config: Config) -> list[str]:
    """The fields in which config differs from a run's saved config and that define the curve a resume
    continues (every one but those _may_change_on_resume), each as field_differences words them."""
    return field_differences(saved, config, lambda name: not _may_change_on_resume(name))


def restore_rng(payload: dict[str, Any], device: torch.device | None = None) -> None:
    """The random generators as a checkpoint saved them: the CPU's, and the CUDA ones of the GPUs here;
    a CUDA `device` (the one this process computes on) takes the generator of the GPU the run computed on."""
    torch.set_rng_state(payload["rng"].cpu())  # the payload may have been mapped to a GPU
    if payload.get("cuda_rng") is not None and torch.cuda.is_available():
        restore_cuda_rng(payload["cuda_rng"])
    run_state = payload.get("cuda_rng_run")
    if run_state is not None and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(run_state.cpu(), device)


def restore_cuda_rng(states: Sequence[Tensor]) -> None:
    """The CUDA generators' states a checkpoint saved (one per GPU its process saw), on the GPUs this
    process sees: a run saved on a machine with more GPUs resumes on one with fewer; GPUs it did not
    have keep their seeds."""
    for index, state in enumerate(states[: torch.cuda.device_count()]):
        torch.cuda.set_rng_state(state.cpu(), index)


def load_checkpoint_file(path: Path, device: torch.device | str = "cpu", mmap: bool = False) -> dict[str, Any]:
    """Read a checkpoint written by this project; a missing or foreign file is a clear error.
    mmap: tensors are mapped, not read (for a look at its step and config)."""
    path = Path(path)
    if path.is_dir():
        path = path / CHECKPOINT
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint not found: {path}")
    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; YAML, text or a file cut short is none
        raise ValueError(f"{path} is not a readable checkpoint: not a checkpoint written by mode.train "
                         "(not the zip archive torch.save writes, or cut short)")
    try:
        # weights_only: tensors, numbers, strings and containers, which is all a checkpoint holds;
        # a file that would run code on loading (a pickle of anything else) is refused.
        payload = torch.load(path, map_location=device, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError:  # torch's text advises weights_only=False, which would run the file's code
        raise ValueError(f"{path} is not a readable checkpoint: not a checkpoint written by mode.train (it holds "
                         "objects other than tensors and plain data; refused, as loading them could run code)") from None
    except Exception as e:  # a zip archive of something else, or a damaged one: torch's first line says which
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ValueError(f"{path} is not a readable checkpoint: not a checkpoint written by mode.train ({first})") from None
    if not isinstance(payload, dict) or payload.get("format") != "mode-checkpoint-v1":
        raise ValueError(f"{path} is not a mode checkpoint (no 'format: mode-checkpoint-v1' entry)")
    return payload


def plot_losses(run_dir: Path) -> Path:
    """loss_vs_flops.png: train and validation loss against cumulative training FLOPs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records, _ = read_metrics(run_dir / METRICS)  # a line cut short by a crash is left out
    train = [(r["flops"], r["loss"]) for r in records if "loss" in r]
    val = [(r["flops"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("cumulative training FLOPs")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(run_dir.name)
    ax.legend()
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=100)
    plt.close(fig)
    target = run_dir / PLOT
    atomic_write_bytes(target, png.getvalue())
    return target


# ----------------------------------------------------------------------------- command line
def parse_args(argv: list[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(
        description="Train a MoD / MoDE language model.",
        epilog="Any config field can be overridden: --train.lr=3e-4 --model.n_layers=8",
    )
    parser.add_argument("--config", required=True, help="YAML experiment file (see configs/)")
    parser.add_argument("--resume", action="store_true", help="continue the run in train.out_dir")
    args, rest = parser.parse_known_args(argv)
    bad = [a for a in rest if not (a.startswith("--") and "." in a.split("=", 1)[0] and "=" in a)]
    if bad:
        parser.error(f"unrecognised arguments {bad}: overrides look like --section.field=value")
    return args, rest


SETUP_ERRORS = (ConfigError, DataError, FileExistsError, FileNotFoundError, ValueError)


def main(argv: list[str] | None = None) -> int:
    """SIGINT and SIGTERM stop the run cleanly wherever they arrive (stops_on_signals)."""
    started()
    args, overrides = parse_args(argv)
    with stops_on_signals():
        try:
            return _train_from_args(args, overrides)
        except KeyboardInterrupt as stop:  # while a line about an earlier stop was being printed
            return stop_status(stop)


def _train_from_args(args: argparse.Namespace, overrides: list[str]) -> int:
    try:
        config = load_config(args.config, overrides)
        trainer = Trainer(config, resume=args.resume)
    except SETUP_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as stop:  # while the data and model are built: no step has run
        print(f"\n{stop_how(stop)} before training started: nothing to resume; run the command again", file=sys.stderr)
        return stop_status(stop)
    for note in trainer.notes:
        print(f"note: {note}", file=sys.stderr)
    print(
        f"model: {trainer.model.num_parameters() / 1e6:.2f}M parameters, blocks {config.model.block_kinds()}, "
        f"{model_flops(config).forward_per_token / 1e6:.2f} MFLOPs/token forward; run folder {trainer.out_dir}"
    )
    try:
        trainer.run()
    except KeyboardInterrupt as stop:  # stopped between steps or inside one: every file is whole (written, then renamed)
        print(f"\n{interrupted_message(trainer, stop_how(stop))}", file=sys.stderr)
        return stop_status(stop)
    except CheckpointWriteError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"done: run folder {trainer.out_dir}")
    return 0


def interrupted_message(trainer: Trainer, how: str = "interrupted") -> str:
    """What a run stopped before its end left: which step its checkpoint holds, and how to go on."""
    if trainer.saved_step is None:
        return (f"{how} at step {trainer.state.step}, before the run's first checkpoint: nothing to resume; "
                f"remove {trainer.out_dir} to start the run again")
    return (f"{how} at step {trainer.state.step}; {trainer.out_dir / CHECKPOINT} holds step {trainer.saved_step}: "
            "continue with --resume (the metrics logged after it are dropped then)")


if __name__ == "__main__":
    finish(main())
