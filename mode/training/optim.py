"""The learning-rate schedule and the optimizer step: the `Optimization` protocol the Trainer
calls (plain AdamW here; mode.parallel supplies a DeepSpeed one), clipping, and step budgets."""
from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Protocol, Sequence, runtime_checkable

import torch
from torch import Tensor, nn

from mode.config import Config, ConfigError
from mode.flops import train_step_flops
from mode.kernels.policy import kernel_policy, use_triton
from mode.routing import CausalPredictor
from mode.training.bf16_weights import Bf16Weights, MastersStep, matrix_weights
from mode.training.deferred_update import DeferredUpdate

if TYPE_CHECKING:  # Triton: the kernel's module is imported where it runs
    from mode.kernels.grad_norm import GradNorm


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

    def capture_refusal(self) -> str | None:
        """Why a CUDA graph cannot hold this engine's backward (train.cuda_graphs), None if it can."""
        ...

    def bf16_weights_applied(self) -> tuple[bool, str | None]:
        """Whether this engine holds the matrices in bf16 with float32 masters (train.bf16_weights),
        and, where auto turned that off on a GPU, a note saying why."""
        ...

    summed_params: list[nn.Parameter]  # bf16 weights whose gradients are summed over micro-batches (no .grad)

    def captured_backward(self, loss: Tensor, accumulate: bool) -> None:
        """The part of backward() a CUDA graph holds (GraphedMicroStep; accumulate: a later micro-batch's
        graph); after_replay() does the rest."""
        ...

    def after_replay(self) -> None:
        """After each replay of a graph holding captured_backward: what backward() does on the host
        (the gradients' reduction at the accumulation boundary)."""
        ...


def steps_within_budget(config: Config, world_size: int = 1) -> int:
    """train.flops_budget -> the whole optimizer steps whose training FLOPs (3 x forward, the tokens of
    every process's micro-batches) fit in it; a budget under one step is a ConfigError."""
    t = config.train
    budget, scheduled = t.flops_budget, scheduled_steps_flops(config, world_size)
    steps = 0
    for flops in scheduled:  # the annealed steps, one by one (their capacity changes)
        if budget <= 0 or round(flops / budget, 9) > 1:
            break
        budget, steps = budget - flops, steps + 1
    else:
        per_step = train_step_flops(config, world_size)
        steps += math.floor(round(budget / per_step, 9))  # 300 steps' FLOPs give 300, not 299.99999
    if steps < 1:
        first = scheduled[0] if scheduled else train_step_flops(config, world_size)
        raise ConfigError(f"train.flops_budget ({t.flops_budget:.4g}) is less than one step's training FLOPs "
                          f"({first:.4g} with {world_size} process(es))")
    return steps


def scheduled_steps_flops(config: Config, world_size: int = 1) -> list[float]:
    """Each annealed step's training FLOPs (routing.capacity_schedule); none without a schedule."""
    plan = config.routing.capacity_schedule
    if plan is None:
        return []
    at = {}  # one FLOP count per stage
    for step in range(plan.steps):
        at.setdefault(config.routing.capacity_at(step), step)
    flops = {capacity: train_step_flops(config, world_size, step) for capacity, step in at.items()}
    return [flops[config.routing.capacity_at(step)] for step in range(plan.steps)]


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
    step_divides: bool | None = None,
) -> Iterator[Tensor | None]:
    """Inside, optimizer.step() steps on the gradients times min(1, max_norm / (norm + 1e-6)),
    clip_grad_norm_'s factor; max_norm <= 0 clips nothing. Yields what the gradients are divided
    by, 1 / the factor (0-d, for updates outside the optimizer: bf16 weights' masters), or None.

    apart: more (gradients, their norm) groups, each clipped by its own norm, not counted in
    `norm` (the causal predictors: see TorchOptimization). Every gradient the optimizer steps
    on belongs to grads or to one group of apart.

    A fused AdamW applies the factor inside its own pass over the gradients (its grad_scale,
    with which GradScaler unscales, divides them by 1 / factor): one read and write of every
    gradient fewer than scaling them first (for 730M float32 gradients, 5.8 GB of traffic).
    Other optimizers get the factor multiplied into the gradients on entry. step_divides: whether
    the step divides the gradients by the yielded value itself (None: where the optimizer is fused;
    True: the masters' kernel steps them instead of the optimizer).
    """
    if max_norm <= 0:
        yield None
        return
    coef = _clip_factor(norm, max_norm)
    grad_scale = coef.reciprocal()
    fused = bool(optimizer.defaults.get("fused"))
    divides = fused if step_divides is None else step_divides
    for group_grads, group_norm in apart:
        if group_grads:  # a dividing step multiplies these by coef too: their own factor over it
            group_coef = _clip_factor(group_norm, max_norm)
            torch._foreach_mul_(group_grads, group_coef / coef if divides else group_coef)
    if not divides:
        torch._foreach_mul_(grads, coef)
        yield grad_scale
        return
    if not fused:
        yield grad_scale
        return
    optimizer.grad_scale = grad_scale  # read by Adam(W).step()
    try:
        yield grad_scale
    finally:
        del optimizer.grad_scale  # this step only


def total_norm(grads: list[Tensor]) -> Tensor:
    """The 2-norm of all of grads, each tensor's summed in float32 whatever its dtype (bf16 weights'
    gradients: their per-tensor norms are not rounded to bf16, as get_total_norm's would be)."""
    by_dtype: dict[torch.dtype, list[Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    if len(by_dtype) < 2 and torch.bfloat16 not in by_dtype:
        return torch.nn.utils.get_total_norm(grads, 2.0)
    norms = [n for group in by_dtype.values() for n in torch._foreach_norm(group, 2.0, dtype=torch.float32)]
    return torch.linalg.vector_norm(torch.stack(norms))


def grad_norm(grads: list[Tensor]) -> GradNorm | None:
    """The kernel that norms grads (mode/kernels/grad_norm.py), where it runs and takes them all;
    None: total_norm's PyTorch ops."""
    if not grads or not use_triton(grads[0], "optimizer"):
        return None
    from mode.kernels.grad_norm import GradNorm  # Triton: imported where it runs

    return GradNorm(grads) if GradNorm.takes(grads) else None


def grad_columns(addresses: tuple[int, ...], norms: list[GradNorm | None],
                 steps: list[MastersStep | None]) -> list[GradColumns]:
    """The gradient-address rows of the norms' and the updates' tables, each column traced to its
    parameter by the address it holds (addresses: each parameter's gradient's, 0 for none)."""
    if not any(norms) and not any(steps):
        return []
    from mode.kernels.adamw import ADDRESSES, GRAD_ROW  # Triton: imported where it runs
    from mode.kernels.grad_norm import ADDRESS_ROW

    param_at = {address: i for i, address in enumerate(addresses) if address}
    columns = [GradColumns(launch[0], ADDRESS_ROW, [param_at[a] for a in held])
               for norm in norms if norm is not None for launch, held in zip(norm.launches, norm.addresses)]
    for step in steps:
        for launch in [] if step is None else step.launches():
            held = launch.addresses[GRAD_ROW::ADDRESSES]  # (the ones it was built with: point_at leaves them)
            columns.append(GradColumns(launch.table, GRAD_ROW, [param_at[a] for a in held]))
    return columns


def _norm_of(grads: list[Tensor], kernel: GradNorm | None, like: Tensor | None = None) -> Tensor:
    """The 2-norm of grads: the kernel's where given, else total_norm's; none: 0 (beside `like`)."""
    if kernel is not None:
        return kernel()
    if not grads:
        return torch.zeros((), dtype=torch.float32, device=None if like is None else like.device)
    return total_norm(grads)


def _clip_factor(norm: Tensor, max_norm: float) -> Tensor:
    return (max_norm / (norm + 1e-6)).clamp(max=1.0)


def predictor_parameter_ids(model: nn.Module) -> frozenset[int]:
    """The ids of the causal predictors' parameters (routing.causal=predictor), found once per model.

    The predictors are clipped apart from the model: their loss must never reach the language
    model, and in one global norm it would, by scaling the model's clipping (the predictor must
    not touch the LM loss: docs/routing-math.md).
    """
    return frozenset(id(p) for m in model.modules() if isinstance(m, CausalPredictor) for p in m.parameters())


def predictor_split(params: list[nn.Parameter], predictor_ids: frozenset[int],
                    grads: list[Tensor | None] | None = None) -> tuple[list[int], list[int]]:
    """Indices into params of those with a gradient: (the model's, the causal predictors':
    predictor_parameter_ids). grads: each param's gradient (None: its .grad)."""
    grads = [p.grad for p in params] if grads is None else grads
    with_grads = [i for i, g in enumerate(grads) if g is not None]
    return ([i for i in with_grads if id(params[i]) not in predictor_ids],
            [i for i in with_grads if id(params[i]) in predictor_ids])


def split_predictor_parameters(model: nn.Module, predictor_ids: frozenset[int]) -> tuple[list[nn.Parameter], list[nn.Parameter]]:
    """(the model's parameters, the causal predictors' parameters: predictor_parameter_ids), each with a gradient."""
    params = list(model.parameters())
    model_indices, predictor_indices = predictor_split(params, predictor_ids)
    return [params[i] for i in model_indices], [params[i] for i in predictor_indices]


@dataclass
class GradColumns:
    """One kernel table's row of gradient addresses, and the parameters (indices into
    TorchOptimization.params) whose gradients its columns read, in order."""

    table: Tensor
    row: int
    params: list[int]

    def point_at(self, addresses: tuple[int, ...]) -> None:
        """Rewrite the row from the parameters' gradient addresses (of all params), in stream order."""
        row = torch.tensor([addresses[i] for i in self.params], dtype=torch.int64)
        self.table[self.row].copy_(row.pin_memory() if self.table.is_cuda else row, non_blocking=True)


@dataclass
class ShardedParams:
    """Parameters each process holds a different shard of (expert parallelism's experts): the
    global norm adds their squared gradient norm summed over the processes (sum_squares: in place,
    a collective every process calls at each step) to the other gradients' squared norm."""

    params: list[nn.Parameter]
    sum_squares: Callable[[Tensor], None]


@dataclass
class StepPlan:
    """What TorchOptimization.step finds in its model each step: which gradients its norms and
    clipping read, and the kernels' launches (the norm, the masters' and float32 weights' updates).
    Finding it walks every parameter and builds the kernels' tables, host milliseconds for a model
    with experts, so a plan is kept while `key` holds: every weight at the same address, the same
    parameters with a gradient, each gradient as aligned as it was, the same kernel policy, the same
    optimizer state object (load_state_dict replaces it). Where only gradients moved (freed after a
    step and allocated again elsewhere by the next backward) the tables' address rows are rewritten
    (`columns`). It holds no gradient."""

    key: tuple
    state: dict  # the optimizer's state when built: the launches' tables point at its moments
    addresses: tuple[int, ...]  # each parameter's gradient address the tables hold (0: none)
    # indices into TorchOptimization.params of the gradients: the causal predictors' are clipped by a
    # norm of their own, the model's others (shared + sharded) by the global norm
    predictors: list[int]
    shared: list[int]  # the model's that every process holds alike (all of them without ShardedParams)
    sharded: list[int]  # the model's others: their squared norm is summed over the processes
    scaled: list[int]  # the model's that clipped_gradients scales (with bf16 weights, the masters' are divided in their update)
    norm: GradNorm | None  # the kernel's norm of the shared gradients (None: total_norm's PyTorch ops)
    sharded_norm: GradNorm | None  # the same of the sharded ones
    float32_step: MastersStep | None  # with bf16 weights, the float32 weights' launches (None: optimizer.step)
    masters_step: MastersStep | None  # the masters' launches (None: Bf16Weights.step, or the deferred update)
    columns: list[GradColumns]  # every table's gradient addresses

    def point_at(self, addresses: tuple[int, ...]) -> None:
        for columns in self.columns:
            columns.point_at(addresses)
        self.addresses = addresses


class TorchOptimization:
    """AdamW with global-norm clipping, clipped *before* the optimizer step.

    keep_grads: gradients stay allocated and are zeroed in place between steps, instead of
    being freed. Needed under CUDA graphs (compile_mode=reduce-overhead): a freed gradient is
    replaced by the backward graph's own output tensor, which the next micro-batch's replay
    overwrites; an allocated one has each micro-batch's gradient added into it. (A parameter
    that got no gradient in a step then has a zero one: AdamW still decays it and moves it by
    its momentum, where a freed gradient would skip it; in every shipped config each
    parameter gets a gradient each step: tests/test_configs.py.) zero_grads=False: kept
    gradients are left as the step found them, for an owner that writes them afresh each step
    (the eager model's CUDA graph, mode/training/graphs.py). bf16_weights: the model's matrices
    become bf16, their float32 masters in the optimizer (mode/training/bf16_weights.py); the
    model's weights for checkpoints are model_state_dict()'s, not model.state_dict()'s.
    defer_update (with bf16_weights and kept gradients): step() stages the masters' update and the
    next training forward runs it beside its matmuls (mode/training/deferred_update.py); flush()
    applies a staged one (model_state_dict and state_dict do it themselves). With bf16_weights and
    train.grad_accum > 1 the matrices' bf16 gradients are summed in float32 as the backward makes
    them (Bf16Weights.grad), and the matrices keep no .grad: `summed_params`.
    """

    def __init__(self, model: nn.Module, config: Config, device: torch.device, keep_grads: bool = False,
                 zero_grads: bool = True, bf16_weights: bool = False, defer_update: bool = False,
                 sharded: ShardedParams | None = None) -> None:
        t = config.train
        self.model = model
        self.sharded = sharded
        self.sharded_ids = frozenset() if sharded is None else frozenset(id(p) for p in sharded.params)
        self.keep_grads, self.zero_grads = keep_grads, zero_grads
        self.grad_clip = t.grad_clip
        self.predictor_ids = predictor_parameter_ids(model)
        # train.bf16_weights: the matrices in bf16, their float32 masters in the optimizer
        self.bf16 = Bf16Weights(matrix_weights(model), sum_micro_batches=t.grad_accum > 1) if bf16_weights else None
        self.summed_params = [] if self.bf16 is None or self.bf16.sums is None else self.bf16.params
        if self.summed_params and keep_grads and not zero_grads:  # a graph writes every sum afresh each step
            self.bf16.sums_always_held = True
        self.backwards = 0  # since the last step
        groups = parameter_groups(model, t.weight_decay)
        self.optimizer = torch.optim.AdamW(
            groups if self.bf16 is None else self.bf16.in_groups(groups),
            lr=t.lr,
            betas=(t.beta1, t.beta2),
            fused=device.type == "cuda",
        )
        self.params = list(model.parameters())
        self.plan: StepPlan | None = None  # built by the first step, kept while the gradients stay in place
        self.deferred: DeferredUpdate | None = None
        if defer_update:
            if self.bf16 is None or not keep_grads or zero_grads:
                raise ValueError("TorchOptimization(defer_update=True) needs bf16_weights and gradients kept "
                                 "unzeroed until the next forward (keep_grads=True, zero_grads=False)")
            self.deferred = DeferredUpdate(model, self.bf16, self.optimizer)
        if keep_grads and zero_grads:  # else their owner makes them
            summed = {id(p) for p in self.summed_params}
            for p in model.parameters():
                if p.requires_grad and p.grad is None and id(p) not in summed:
                    p.grad = torch.zeros_like(p)

    def backward(self, loss: Tensor, accumulate: bool | None = None) -> None:
        """loss.backward() of one micro-batch (begin_micro_batch says what accumulate means; None:
        False for the first backward since the last step)."""
        self.begin_micro_batch(self.backwards > 0 if accumulate is None else accumulate)
        loss.backward()

    def begin_micro_batch(self, accumulate: bool) -> None:
        """Before a micro-batch's backward. With bf16 weights summed over micro-batches: False, the
        step's first, whose gradients start the sums; True, a later one's, added to them."""
        if self.summed_params and not accumulate:
            self.bf16.start_sums()
        self.backwards += 1

    def step(self, lr: float) -> Tensor:
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.backwards = 0
        grads_now = [p.grad for p in self.params] if self.bf16 is None else [self.bf16.grad(p) for p in self.params]
        plan = self._plan(grads_now)
        predictor_grads = [grads_now[i] for i in plan.predictors]
        norm = self._global_norm(plan, grads_now)
        apart = [(predictor_grads, total_norm(predictor_grads))] if predictor_grads else []
        # bf16 weights' gradients: scaled inside their masters' update, not by clipped_gradients
        float32_grads = [grads_now[i] for i in plan.scaled]
        # with bf16 weights the masters' kernel also steps the float32 weights, where it takes them all
        divides = None if plan.float32_step is None else True
        with clipped_gradients(self.optimizer, float32_grads, norm, self.grad_clip, apart, divides) as grad_scale:
            if plan.float32_step is None:
                self.optimizer.step()  # every parameter but the masters, which have no gradient
        if self.bf16 is not None:  # the masters divide their gradients as fused AdamW did
            grad_scale = torch.ones_like(norm) if grad_scale is None else grad_scale
            if plan.float32_step is not None:
                plan.float32_step.run(grad_scale)
            if self.deferred is not None:  # run by the next training forward, or by flush()
                self.deferred.stage(lr, grad_scale)
            elif plan.masters_step is not None:
                plan.masters_step.run(grad_scale)
            else:  # the PyTorch ops, or a weight the kernel does not take
                self.bf16.step(self.optimizer, grad_scale)
        if self.zero_grads or not self.keep_grads:
            self._clear_grads()
        return norm.detach()

    def _global_norm(self, plan: StepPlan, grads: list[Tensor | None]) -> Tensor:
        """The 2-norm of the model's gradients (the predictors' apart), the sharded ones' squares
        summed over the processes."""
        shared = _norm_of([grads[i] for i in plan.shared], plan.norm)
        if self.sharded is None:
            return shared
        squares = _norm_of([grads[i] for i in plan.sharded], plan.sharded_norm, shared).float().square()
        self.sharded.sum_squares(squares)
        return (shared.float().square() + squares).sqrt()

    def _clear_grads(self) -> None:
        """Free the model's gradients, or zero them in place where kept. Over self.params, not
        Module.zero_grad, which walks every module to find them on the host at each step."""
        if self.keep_grads:
            grads = [p.grad for p in self.params if p.grad is not None]
            if grads:
                torch._foreach_zero_(grads)
        else:
            for p in self.params:
                p.grad = None

    def _plan(self, grads: list[Tensor | None]) -> StepPlan:
        """The step's plan for these gradients (of self.params): the last one while its key holds,
        pointed at where the gradients are now."""
        addresses = tuple(0 if g is None else g.data_ptr() for g in grads)
        # which parameters have a gradient, and which gradients the kernels can read 16 bytes at a time
        # (kernel_takes, GradNorm.takes): a gradient moved off that alignment needs a plan without them
        layout = tuple(None if a == 0 else a % 16 == 0 for a in addresses)
        key = (kernel_policy(), tuple(p.data_ptr() for p in self.params), layout)
        plan = self.plan
        if plan is None or plan.key != key or plan.state is not self.optimizer.state:
            plan = self.plan = self._new_plan(key, grads, addresses)
        elif plan.addresses != addresses:
            plan.point_at(addresses)
        return plan

    def _new_plan(self, key: tuple, grads: list[Tensor | None], addresses: tuple[int, ...]) -> StepPlan:
        model, predictors = predictor_split(self.params, self.predictor_ids, grads)
        shared = [i for i in model if id(self.params[i]) not in self.sharded_ids]
        sharded = [i for i in model if id(self.params[i]) in self.sharded_ids]
        norm, sharded_norm = grad_norm([grads[i] for i in shared]), grad_norm([grads[i] for i in sharded])
        scaled, float32_step, masters_step = model, None, None
        if self.bf16 is not None:
            scaled = [i for i in model if not self.bf16.owns(self.params[i])]
            float32_updates = self.bf16.float32_updates(self.optimizer)
            float32_step = None if float32_updates is None else MastersStep(float32_updates)
            masters_step = None if self.deferred is not None else MastersStep.of(
                self.bf16.updates(self.optimizer, self.bf16.params))
        return StepPlan(key, self.optimizer.state, addresses, predictors, shared, sharded, scaled, norm,
                        sharded_norm, float32_step, masters_step,
                        grad_columns(addresses, [norm, sharded_norm], [float32_step, masters_step]))

    def flush(self) -> None:
        """Apply an update still staged (defer_update): the model's weights are then the last step's."""
        if self.deferred is not None:
            self.deferred.flush()

    def model_state_dict(self) -> dict[str, Tensor]:
        """The model's weights for a checkpoint: with bf16 weights, their float32 masters."""
        self.flush()
        state = self.model.state_dict()
        return state if self.bf16 is None else self.bf16.masters_in(state)

    def load_model_state_dict(self, state: dict[str, Tensor]) -> None:
        self.plan = None
        if self.deferred is not None:
            self.deferred.discard()
        self.model.load_state_dict(state)
        if self.bf16 is not None:
            self.bf16.load(self.model, state)

    def state_dict(self) -> dict[str, Any]:
        self.flush()
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.plan = None  # it holds the replaced state's moments
        if self.deferred is not None:
            self.deferred.discard()
        self.optimizer.load_state_dict(state)
