"""The model's matrices held in bf16 while it trains, each with a float32 master that AdamW steps
(train.bf16_weights).

Under bf16 autocast a float32 matrix is cast to bf16 by every forward that reads it, and its bf16
gradient is cast back to float32 by the backward, which AdamW then reads: three passes over each
matrix a step besides the update. Held in bf16, with its float32 master kept by the optimizer, none
of them runs: the matmuls read the bf16 weight as they read its cast before, the gradient stays
the backward's bf16 product, and one kernel (mode/kernels/adamw.py) steps the master and writes
the new bf16 copy. Same values: the copy is the master rounded as the cast rounded it, and the
gradient is the same bf16 product, so the master moves as the float32 weight did. (A weight read
twice in a step, a recursion's shared block, has its bf16 gradients summed in bf16, as autocast's
cached cast sums them in a plain eager step.)

Which matrices: the attention projections, the dense FFNs' and the experts' (matrix_weights), the
ones only autocast matmuls read. Embeddings (the float32 residual stream starts there), the output
head (the loss adds into its float32 gradient itself), norms, routers and causal predictors
(computed in float32) stay float32; the same kernel steps them (float32_updates), with no copy.

Micro-batches (train.grad_accum > 1): autocast's cast adds each micro-batch's bf16 gradient into the
float32 weight's float32 gradient. Here each bf16 gradient is added into a float32 sum as the
backward makes it (a hook on the weight, which then drops the bf16 gradient), and the update reads
the sum: the same float32 additions in the same order, so the same gradient bit for bit.

Outside the step the masters are the model's weights: TorchOptimization.model_state_dict() puts
them in checkpoints, so a checkpoint is the same with or without bf16 weights, and the optimizer
state keeps torch.optim.AdamW's layout (each master in its weight's place).
"""
from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from mode.config import Config, ConfigError
from mode.kernels.policy import use_triton
from mode.layers.attention import CausalSelfAttention
from mode.layers.experts import Experts
from mode.layers.mlp import SwiGLU

if TYPE_CHECKING:  # Triton: the kernel's module is imported where it runs
    from mode.kernels.adamw import MastersLaunch, Update


def bf16_weights_apply(config: Config, device: torch.device,
                       engine_refusal: str | None = None) -> tuple[bool, str | None]:
    """Whether the model trains with bf16 matrices and float32 masters (train.bf16_weights), and,
    where auto turns it off on a GPU, a note saying why. true: required, a ConfigError naming the
    field where it cannot run; auto: wherever it can; false: never. engine_refusal: why a
    multi-process engine cannot hold them (mode.parallel.engine.bf16_weights_refusal), None if it can."""
    t = config.train
    if t.bf16_weights is False:
        return False, None
    required = t.bf16_weights is True
    reason = None
    if device.type != "cuda":
        reason = f"training autocasts to bf16 on CUDA only (train.device is {t.device!r}: {device})"
    elif engine_refusal is not None:
        reason = engine_refusal
    if reason is None:
        return True, None
    if required:
        raise ConfigError(f"train.bf16_weights=true: {reason}")
    return False, None if device.type != "cuda" else f"train.bf16_weights=auto: off, since {reason}"


def matrix_weights(model: nn.Module) -> list[nn.Parameter]:
    """The trainable float32 matrices that only autocast matmuls read: attention, dense FFNs, experts."""
    found: dict[int, nn.Parameter] = {}
    for module in model.modules():
        if isinstance(module, CausalSelfAttention):
            weights = [module.qkv.weight, module.out.weight]
        elif isinstance(module, SwiGLU):
            weights = [module.gate_up.weight, module.down.weight]
        elif isinstance(module, Experts):
            weights = [module.w_in, module.w_out]
        else:
            continue
        found.update((id(w), w) for w in weights if w.requires_grad and w.dtype == torch.float32)
    return list(found.values())


def hold_in_bf16_(params: list[nn.Parameter]) -> None:
    """Each param's data turned into contiguous bf16 in place (the same Parameter objects)."""
    for p in params:
        p.data = p.data.to(torch.bfloat16, memory_format=torch.contiguous_format)


def master_updates_(updates: list[Update], grad_scale: Tensor, lr: float | Tensor, betas: tuple[float, float],
                    eps: float, weight_decay: float) -> None:
    """One AdamW update of each (master, exp_avg, exp_avg_sq, grad, copy, step): the master (float32)
    from its grad (bf16, or a float32 sum of micro-batches' bf16 ones), and copy = the master
    rounded to bf16 (copy None: a float32 weight from its float32 grad, nothing else written). The
    kernel where it runs
    (mode/kernels/adamw.py, whose docstring gives the arithmetic), else the same in PyTorch ops.
    step: the count after this update; grad_scale: what the gradients are divided by; lr: a number
    or a 0-d tensor (read on the host by the PyTorch ops)."""
    if updates and use_triton(updates[0][0], "optimizer"):
        from mode.kernels.adamw import adamw_masters_step_, kernel_takes  # Triton: imported where it runs

        takes = [kernel_takes(update) for update in updates]
        taken = [update for update, ok in zip(updates, takes) if ok]
        if taken:
            adamw_masters_step_(taken, grad_scale, lr, betas, eps, weight_decay)
        updates = [update for update, ok in zip(updates, takes) if not ok]  # views off 16 bytes: rare
    if isinstance(lr, Tensor) and updates:
        lr = lr.item()
    beta1, beta2 = betas
    for master, exp_avg, exp_avg_sq, grad, copy, step in updates:
        g = grad.float() / grad_scale
        master.sub_(lr * weight_decay * master)
        exp_avg.mul_(beta1).add_(g, alpha=1.0 - beta1)
        exp_avg_sq.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)
        correction1 = 1.0 - torch.pow(beta1, step)
        correction2 = 1.0 - torch.pow(beta2, step)
        master.sub_((lr / correction1) * exp_avg / (exp_avg_sq.sqrt() / correction2.sqrt() + eps))
        if copy is not None:
            copy.copy_(master)


def step_updates(found: list[tuple[dict, list[Update]]], grad_scale: Tensor) -> None:
    """Each (optimizer group, its updates) stepped with the group's settings, step counts first."""
    for group, updates in found:
        torch._foreach_add_([update[-1] for update in updates], 1.0)
        master_updates_(updates, grad_scale, group["lr"], group["betas"], group["eps"], group["weight_decay"])


class MastersStep:
    """step_updates' work as the masters' kernel launches (mode/kernels/adamw.py), their tables built
    once: each run() steps the same weights from the gradients at the tables' addresses (the caller
    keeps them true: TorchOptimization's step plan rewrites a table's GRAD_ROW where a gradient
    moved). Building the tables takes the host milliseconds for a model with experts; running them
    takes one launch per MAX_TENSORS weights."""

    def __init__(self, found: list[tuple[dict, list[Update]]]) -> None:
        from mode.kernels.adamw import masters_launches  # Triton: imported where it runs

        device = found[0][1][0][0].device
        self.groups = [(group, [update[-1] for update in updates], masters_launches(updates),
                        torch.zeros((), dtype=torch.float32, device=device))  # the group's lr, read on the device
                       for group, updates in found]

    @classmethod
    def of(cls, found: list[tuple[dict, list[Update]]]) -> MastersStep | None:
        """found's launches; None where the kernel does not run or does not take every update (then
        step_updates steps them, leaving the rest to PyTorch ops)."""
        updates = [update for _, group_updates in found for update in group_updates]
        if not updates or not use_triton(updates[0][0], "optimizer"):
            return None
        from mode.kernels.adamw import kernel_takes  # Triton: imported where it runs

        return cls(found) if all(kernel_takes(update) for update in updates) else None

    def launches(self) -> list[MastersLaunch]:
        return [launch for _, _, launches, _ in self.groups for launch in launches]

    def run(self, grad_scale: Tensor) -> None:
        """One update, as step_updates(found, grad_scale) with each group's settings as they are now."""
        for group, steps, launches, lr in self.groups:
            torch._foreach_add_(steps, 1.0)
            lr.fill_(group["lr"])
            for launch in launches:
                launch.run(grad_scale, lr, group["betas"], group["eps"], group["weight_decay"])


class Bf16Weights:
    """params (float32, on one device) turned into bf16, each with a float32 master: the masters
    take the params' places in the optimizer's groups (in_groups), and step() updates them from the
    params' bf16 gradients, or, with sum_micro_batches, from their float32 sums (grad())."""

    def __init__(self, params: list[nn.Parameter], sum_micro_batches: bool = False) -> None:
        self.params = params
        self.masters = [p.detach().clone(memory_format=torch.contiguous_format) for p in params]
        self.param_of = {id(m): p for m, p in zip(self.masters, params, strict=True)}
        self.master_of = {id(p): m for m, p in zip(self.masters, params, strict=True)}
        self.index_of = {id(p): i for i, p in enumerate(params)}
        # sum_micro_batches: each param's gradients of a step, added in float32 as the backward makes
        # them; summed[i]: whether params[i]'s sum holds some of this step's (else it is stale)
        self.sums: list[Tensor] | None = [torch.zeros_like(m) for m in self.masters] if sum_micro_batches else None
        self.summed = [False] * len(params)
        self.sums_always_held = False  # a graph owner's: every sum is the step's (zero where none reached it)
        self.hooks = [p.register_post_accumulate_grad_hook(self._add_to_sum) for p in params] if sum_micro_batches else []
        hold_in_bf16_(params)

    def _add_to_sum(self, param: Tensor) -> None:
        """The backward has made param's bf16 gradient: into its float32 sum, the gradient dropped."""
        i = self.index_of[id(param)]
        if self.summed[i]:
            self.sums[i].add_(param.grad)
        else:  # the step's first gradient of it
            self.sums[i].copy_(param.grad)
            self.summed[i] = True
        param.grad = None

    def place_sums(self, places: dict[int, Tensor]) -> None:
        """Hold sums[i] in places[i] from now on (float32, its shape: a view of a flat buffer that a
        reduction reads), with the value it has."""
        for i, place in places.items():
            if place.dtype != torch.float32 or place.shape != self.sums[i].shape:
                raise ValueError(f"Bf16Weights.place_sums: sum {i} is float32 {tuple(self.sums[i].shape)}, "
                                 f"not {place.dtype} {tuple(place.shape)}")
            self.sums[i] = place.copy_(self.sums[i])

    def start_sums(self) -> None:
        """The next gradients start the step's sums (its first micro-batch) instead of adding to them."""
        self.summed = [False] * len(self.params)

    def grad(self, param: Tensor) -> Tensor | None:
        """What the update reads as param's gradient: with sum_micro_batches, a param of this object's
        float32 sum (None where no micro-batch of the step reached it); else param.grad."""
        i = self.index_of.get(id(param)) if self.sums is not None else None
        if i is None:
            return param.grad
        return self.sums[i] if self.summed[i] or self.sums_always_held else None

    def in_groups(self, groups: list[dict]) -> list[dict]:
        """Optimizer parameter groups with each param replaced by its master."""
        return [{**g, "params": [self.master_of.get(id(p), p) for p in g["params"]]} for g in groups]

    def owns(self, param: Tensor) -> bool:
        return id(param) in self.master_of

    def step(self, optimizer: torch.optim.Optimizer, grad_scale: Tensor, params: list[nn.Parameter] | None = None) -> None:
        """One AdamW update of every master whose param has a gradient (grad(); divided by `grad_scale`, 0-d
        float32: 1 / the clipping factor), with its group's settings; the param becomes the new master
        rounded to bf16. The state is torch.optim.AdamW's (step, exp_avg, exp_avg_sq), made on the first step.
        params: only these of this object's params (None: all)."""
        step_updates(self.updates(optimizer, self.params if params is None else params), grad_scale)

    def updates(self, optimizer: torch.optim.Optimizer, params: list[nn.Parameter]) -> list[tuple[dict, list[Update]]]:
        """The updates of those of `params` (bf16 params of this object) that have a gradient, by
        optimizer group: (the group, its updates), groups without one left out."""
        wanted = {id(p) for p in params}
        found = []
        for group in optimizer.param_groups:
            updates = []
            for master in group["params"]:
                param = self.param_of.get(id(master))
                grad = None if param is None or id(param) not in wanted else self.grad(param)
                if grad is not None:
                    updates.append(self._update(optimizer, master, grad, param.data))
            if updates:
                found.append((group, updates))
        return found

    def float32_updates(self, optimizer: torch.optim.Optimizer) -> list[tuple[dict, list[Update]]] | None:
        """The updates of the optimizer's float32 weights (every param but the masters) that have a
        gradient, by group, each without a copy, for the masters' kernel to step (step_updates);
        None where the kernel does not run or cannot take one of them: then torch.optim.AdamW's own
        step takes them all, as it would without bf16 weights."""
        by_group = [(group, [p for p in group["params"] if id(p) not in self.param_of and p.grad is not None])
                    for group in optimizer.param_groups]
        params = [p for _, group_params in by_group for p in group_params]
        if not params or not use_triton(params[0], "optimizer"):
            return None
        from mode.kernels.adamw import kernel_takes  # Triton: imported where it runs

        # the moments are made like the weight (contiguous, aligned): the weight stands in for them here
        if not all(kernel_takes((p, p, p, p.grad, None, p)) for p in params):
            return None
        return [(group, [self._update(optimizer, p, p.grad, None) for p in group_params])
                for group, group_params in by_group if group_params]

    @classmethod
    def _update(cls, optimizer: torch.optim.Optimizer, master: Tensor, grad: Tensor, copy: Tensor | None) -> Update:
        """(master, exp_avg, exp_avg_sq, grad, copy, step) of one weight, its AdamW state made if new."""
        state = cls._state(optimizer, master)
        return master, state["exp_avg"], state["exp_avg_sq"], grad, copy, state["step"]

    @staticmethod
    def _state(optimizer: torch.optim.Optimizer, master: Tensor) -> dict[str, Tensor]:
        state = optimizer.state[master]
        if not state:  # as AdamW makes it: the step count a float32 tensor beside the weight
            state["step"] = torch.zeros((), dtype=torch.float32, device=master.device)
            state["exp_avg"] = torch.zeros_like(master, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(master, memory_format=torch.preserve_format)
        elif state["step"].device != master.device:  # a CPU count from a non-fused AdamW's checkpoint
            state["step"] = state["step"].to(master.device, torch.float32)
        return state

    @contextlib.contextmanager
    def masters_as_params(self) -> Iterator[None]:
        """Inside, each param holds its float32 master itself (the same tensor), for code that saves
        or loads the model's weights in place (a DeepSpeed checkpoint); after, each param holds its
        bf16 copy again, rounded afresh from its master, which a load inside may have written."""
        copies = [p.data for p in self.params]
        for p, master in zip(self.params, self.masters, strict=True):
            p.data = master
        try:
            yield
        finally:
            for p, copy, master in zip(self.params, copies, self.masters, strict=True):
                p.data = copy
                copy.copy_(master)

    def masters_in(self, state: dict[str, Tensor]) -> dict[str, Tensor]:
        """A model state_dict with each bf16 param's entry replaced by its master."""
        by_storage = {p.data_ptr(): m for p, m in zip(self.params, self.masters, strict=True)}
        return {name: by_storage.get(t.data_ptr(), t) if t.dtype == torch.bfloat16 else t for name, t in state.items()}

    def load(self, model: nn.Module, state: dict[str, Tensor]) -> None:
        """After model.load_state_dict(state) (which rounded state's float32 weights into the bf16
        params): the masters take state's float32 values."""
        for name, p in model.named_parameters():
            if self.owns(p):
                self.master_of[id(p)].copy_(state[name])
