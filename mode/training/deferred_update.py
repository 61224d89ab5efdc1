"""The bf16 weights' update of one step run inside the next step's forward, block by block, beside
its matmuls (train.overlap_update).

The masters' update (mode/kernels/adamw.py) reads and writes every matrix's master, moments,
gradient and bf16 copy: bound by memory, it leaves the GPU's matmul units idle for as long as it
runs, the longer the more experts a model has. It cannot start before the backward ends (clipping
needs the norm of every gradient), but nothing needs a block's new weights before the next
forward reaches that block. So step() only stages the update (its learning rate and clipping on the
device), and the next forward runs it on a side stream: every block's update launched as the
forward starts, in the blocks' order, and each attention, FFN or MoE module of block i waits for
block i's update alone before it reads its weights. Block 0's update runs alone; the others'
overlap the blocks computing before them.

The arithmetic and its inputs are the immediate update's (the same kernel, the same gradients,
clipping factor and learning rate), so the weights and the optimizer state are the same bit for
bit. Inside a CUDA graph (train.cuda_graphs) the launches are captured with the forward: the
graph reads the learning rate, the clipping factor and whether an update is staged from device
tensors, and the kernel's tables are rebound to the gradients the graph writes (MastersLaunch).
Before anything reads the weights or the optimizer state outside a training forward (evaluation,
checkpoints, the end of the run), flush() applies a staged update.
"""
from __future__ import annotations

from functools import partial
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from mode.config import Config, ConfigError
from mode.kernels.policy import use_triton
from mode.layers.attention import CausalSelfAttention
from mode.layers.mlp import SwiGLU
from mode.layers.moe import MoEFFN
from mode.training.bf16_weights import Bf16Weights, matrix_weights

if TYPE_CHECKING:  # Triton: the kernel's module is imported where it runs
    from mode.kernels.adamw import MastersLaunch, Update

# The modules whose forward reads the bf16 matrices (experts' through their MoE FFN)
READERS = (CausalSelfAttention, SwiGLU, MoEFFN)


def overlap_update_apply(config: Config, model: nn.Module, device: torch.device, bf16_weights: bool,
                         eager_graphed: bool, engine_refusal: str | None = None) -> tuple[bool, str | None]:
    """Whether the bf16 weights' update runs inside the next forward (train.overlap_update), and, where
    auto turns it off though bf16 weights are on, a note saying why. true: required, a ConfigError
    naming the field where it cannot run; auto: wherever it can; false: never. engine_refusal: why a
    given optimization (a multi-process engine) cannot defer its update, None in one process."""
    setting = config.train.overlap_update
    if setting is False:
        return False, None
    reason = None
    if not bf16_weights:
        reason = "it moves the update of bf16 weights (train.bf16_weights is off here)"
    elif engine_refusal is not None:
        reason = engine_refusal
    elif not eager_graphed:
        reason = "it runs under the eager CUDA graphs (train.cuda_graphs), which keep the gradients for it"
    else:
        reason = deferrable(model, matrix_weights(model), device)
    if reason is None:
        return True, None
    if setting is True:
        raise ConfigError(f"train.overlap_update=true: {reason}")
    return False, None if not bf16_weights else f"train.overlap_update=auto: the update runs in the step, since {reason}"


def deferrable(model: nn.Module, params: list[nn.Parameter], device: torch.device) -> str | None:
    """Why the update of params (the model's bf16 weights) cannot be deferred (None: it can): each must
    sit in a block of model.blocks, and on a GPU the update must run as the Triton kernel (the
    PyTorch ops read the learning rate on the host)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        return "the model has no blocks"
    in_blocks = {id(p) for block in blocks for p in block.parameters()}
    if any(id(p) not in in_blocks for p in params):
        return "a bf16 weight lies outside the model's blocks"
    probe = torch.empty(0, device=device)
    if device.type == "cuda" and not use_triton(probe, "optimizer"):
        return "the masters' update runs as PyTorch ops here (kernel policy op optimizer)"
    return None


class DeferredUpdate:
    """Stages the bf16 weights' update at step() (stage) and runs it within the next training forward
    of `model` (hooks on the model and on each block's READERS modules); flush() runs a staged one now.

    An update is staged on the device (`active`), so that a captured forward runs it only when one is:
    after a flush the graph's launches find nothing to do."""

    def __init__(self, model: nn.Module, bf16: Bf16Weights, optimizer: torch.optim.Optimizer) -> None:
        why = deferrable(model, bf16.params, bf16.masters[0].device)
        if why is not None:
            raise ValueError(f"DeferredUpdate: {why}")
        self.bf16, self.optimizer = bf16, optimizer
        # Each weight is updated once, with the first block that holds it (MoR's shared block: its first use).
        owner: dict[int, int] = {}
        for index, block in enumerate(model.blocks):
            for p in block.parameters():
                if bf16.owns(p):
                    owner.setdefault(id(p), index)
        self.blocks: list[list[nn.Parameter]] = [
            [p for p in block.parameters() if owner.get(id(p)) == index] for index, block in enumerate(model.blocks)]
        device = bf16.masters[0].device
        self.active = torch.zeros((), dtype=torch.float32, device=device)  # 1: an update is staged
        self.lr = torch.zeros((), dtype=torch.float32, device=device)
        self.grad_scale = torch.ones((), dtype=torch.float32, device=device)
        self.maybe_staged = False  # False: surely nothing staged (flush has nothing to do)
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        self.events = [torch.cuda.Event() for _ in self.blocks] if self.stream is not None else []
        self.launches: list[dict[int, list[MastersLaunch]]] = [{} for _ in self.blocks]  # per block: group index -> launches
        self.handles = [model.register_forward_pre_hook(self._launch), model.register_forward_hook(self._join)]
        for block in model.blocks:
            for module in block.modules():
                if isinstance(module, READERS):
                    waits = sorted({owner[id(p)] for p in module.parameters() if id(p) in owner})
                    if waits:
                        self.handles.append(module.register_forward_pre_hook(partial(self._wait, waits)))

    # -- the step
    def stage(self, lr: float, grad_scale: Tensor) -> None:
        """Stage an update with lr and grad_scale (0-d float32 on the device: what the gradients are
        divided by) for the next training forward, from the gradients as they are now."""
        if self.stream is not None:
            for index in range(len(self.blocks)):
                self._bind(index)
        self.lr.fill_(lr)
        self.grad_scale.copy_(grad_scale)
        self.active.fill_(1.0)
        self.maybe_staged = True

    def flush(self) -> None:
        """Apply a staged update now, on the current stream: the weights and the optimizer state are
        then the step's."""
        if not self.maybe_staged:
            return
        self._apply_all(record=False)
        self.maybe_staged = False

    def discard(self) -> None:
        """Drop a staged update (the weights and state were replaced: a checkpoint loaded)."""
        self.active.zero_()
        self.maybe_staged = False
        self.launches = [{} for _ in self.blocks]

    # -- the hooks
    def _runs(self, module: nn.Module) -> bool:
        return module.training and torch.is_grad_enabled()

    def _launch(self, model: nn.Module, args: Any) -> None:
        """The model's forward starts: every block's update, in order, on the side stream."""
        if not self._runs(model):  # evaluation reads flushed weights
            return
        if self.stream is None:
            self._apply_all(record=False)
            return
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            self._apply_all(record=True)

    def _wait(self, blocks: list[int], module: nn.Module, args: Any) -> None:
        """A module is about to read its weights: after the updates of the blocks that own them."""
        if self.stream is not None and self._runs(module):
            for index in blocks:
                torch.cuda.current_stream().wait_event(self.events[index])

    def _join(self, model: nn.Module, args: Any, output: Any) -> None:
        """The forward ends: every update done before the backward writes the next gradients."""
        if self.stream is not None and self._runs(model):
            torch.cuda.current_stream().wait_stream(self.stream)

    # -- one block's update
    def _apply_all(self, record: bool) -> None:
        """Every block's update in order on the current stream (record: each block's event after
        its own), then nothing staged."""
        for index in range(len(self.blocks)):
            self._apply(index)
            if record:
                self.events[index].record()
        self.active.zero_()

    def _updates(self, index: int) -> list[tuple[dict, list[Update]]] | None:
        """Block index's updates by optimizer group; None while some weight has no gradient (a CUDA
        graph's capture, which makes them: the tables bound before it are used)."""
        params = self.blocks[index]
        if any(self.bf16.grad(p) is None for p in params):
            return None
        return self.bf16.updates(self.optimizer, params)

    def _bind(self, index: int) -> list[tuple[dict, list[MastersLaunch]]] | None:
        """Block index's kernel launches by optimizer group, their tables pointed at the tensors of now
        (not while a graph is captured: stage() rebinds them after it)."""
        from mode.kernels.adamw import MAX_TENSORS, masters_launches  # Triton: imported where it runs

        updates = self._updates(index)
        if updates is None or torch.cuda.is_current_stream_capturing():
            return None if not self.launches[index] else self._with_groups(index)
        bound = self.launches[index]
        group_ids = [id(group) for group in self.optimizer.param_groups]
        for group, group_updates in updates:
            group_index = group_ids.index(id(group))
            if group_index in bound:
                for start, launch in zip(range(0, len(group_updates), MAX_TENSORS), bound[group_index]):
                    launch.rebind(group_updates[start:start + MAX_TENSORS])
            else:
                bound[group_index] = masters_launches(group_updates)
        return self._with_groups(index)

    def _with_groups(self, index: int) -> list[tuple[dict, list[MastersLaunch]]]:
        groups = self.optimizer.param_groups
        return [(groups[group_index], launches) for group_index, launches in self.launches[index].items()]

    def _apply(self, index: int) -> None:
        """Block index's update, where one is staged (read on the device by the kernel)."""
        if not self.blocks[index]:
            return
        if self.stream is None:  # the PyTorch ops (CPU): the flag read on the host, the step's own lr in the groups
            if any(self.bf16.grad(p) is None for p in self.blocks[index]) or not self.active.item():
                return
            self.bf16.step(self.optimizer, self.grad_scale, self.blocks[index])
            return
        bound = self._bind(index)
        if bound is None:  # no gradient has ever existed: nothing can be staged
            return
        for group, launches in bound:
            for launch in launches:
                launch.run(self.grad_scale, self.lr, group["betas"], group["eps"], group["weight_decay"], self.active)
