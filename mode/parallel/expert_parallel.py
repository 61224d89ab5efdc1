"""Expert parallelism, applied to a model written as if every expert were local.

`apply_expert_parallel(model, ep_size)` swaps the `experts` of every MoE FFN (MoE blocks,
Staged and Integrated MoDE) for an `ExpertParallelExperts`: it keeps only this rank's
n_experts / ep slice of the weights and answers the same two calls the FFN makes,

- padded(xs (E, R, D)) -> (E, R, D): every expert R rows (expert choice; token choice with
  a capacity on the torch backend). One all-to-all with equal splits sends expert e's rows
  to the rank holding e, the local experts run on the rows of every rank, a second
  all-to-all brings the results back.
- grouped(xs (M, D) sorted by expert, counts (E,)) -> (M, D): uneven loads (dropless token
  choice, the grouped GEMM backends). The counts are exchanged first, then the rows with
  uneven splits, which the host reads in one sync; the local experts run as one grouped GEMM
  each way (on torch where Experts.by_ends applies). (by_ends_applies is False here: the FFN's
  sync-free dropless layout, every assignment a row, stays for one process.)

Both all-to-alls are autograd functions: the backward of one is the all-to-all the other
way. No-op experts (MoDE) never reach this module: the FFN never computes them, and those that
output something (moe.noop_kind copy or constant: x or a learned vector, times the gate) are
added by the FFN on the token's own process, so they are never communicated. Experts are placed contiguously: ep rank j holds experts
[j * E/ep, (j+1) * E/ep), DeepSpeed's own placement (global id = ep rank * local + local id).

DeepSpeed conventions, so its engine and ZeRO optimizer treat these as expert weights:
the wrapper is a `deepspeed.moe.layer.MoE` (the engine switches on MoE handling when it
finds one), its parameters carry `allreduce = False` and `group_name = "ep_size_{ep}"`
(gradients are reduced over the expert-data-parallel group only), and its state dict names
each expert `deepspeed_moe.experts.deepspeed_experts.{local id}.w_in` / `.w_out`, the layout
DeepSpeed's checkpoints write one file per global expert from. The weights themselves stay
stacked, (E/ep, D, W), so the local compute is the `Experts` backends unchanged.
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.utils import groups
from torch import Tensor, nn

from mode.config import ConfigError
from mode.layers.experts import Experts
from mode.layers.moe import MoEFFN

WEIGHTS = ("w_in", "w_out")


def group_name(ep_size: int) -> str:
    """DeepSpeed's name for the expert groups of size ep."""
    return f"ep_size_{ep_size}"


def create_expert_groups(ep_size: int) -> Any:
    """DeepSpeed's expert-parallel and expert-data-parallel groups (E + D layout); returns ours.

    With world W and ep: ranks [i*ep, (i+1)*ep) share one copy of every expert (an
    expert-parallel group, all-to-all); ranks j, j+ep, j+2ep, ... hold the same experts (an
    expert-data-parallel group, where expert gradients are reduced).
    """
    world = dist.get_world_size()
    if world % ep_size != 0:
        raise ConfigError(f"parallel.expert_parallel ({ep_size}) must divide the number of processes ({world})")
    name = group_name(ep_size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)
    return groups._get_expert_parallel_group(name)


# ----------------------------------------------------------------------------- all-to-all
class _AllToAll(torch.autograd.Function):
    """dist.all_to_all_single with autograd: the gradient goes back the way the rows came."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, output_splits: list[int] | None, input_splits: list[int] | None, group: Any) -> Tensor:
        ctx.group, ctx.output_splits, ctx.input_splits = group, output_splits, input_splits
        x = x.contiguous()
        rows = x.shape[0] if output_splits is None else sum(output_splits)
        out = x.new_empty((rows, *x.shape[1:]))
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return _AllToAll.apply(grad, ctx.input_splits, ctx.output_splits, ctx.group), None, None, None


def all_to_all(x: Tensor, group: Any, output_splits: list[int] | None = None, input_splits: list[int] | None = None) -> Tensor:
    """Rows of x (N, ...) split by input_splits go to the ranks of group; equal splits when None."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


# ----------------------------------------------------------------------------- the experts
class LocalExperts(Experts):
    """This rank's slice of an `Experts`: stacked weights, per-expert names in the state dict."""

    def __init__(self, source: Experts, first: int, count: int, ep_size: int) -> None:
        d_model, d_expert = source.w_out.shape[2], source.w_out.shape[1]
        with torch.random.fork_rng(devices=[]):  # the throwaway initialisation leaves the RNG as it was
            super().__init__(count, d_model, d_expert, source.activation, source.backend)
        self.to(device=source.w_in.device, dtype=source.w_in.dtype)
        with torch.no_grad():
            self.w_in.copy_(source.w_in[first : first + count])
            self.w_out.copy_(source.w_out[first : first + count])
        for p in (self.w_in, self.w_out):
            p.allreduce = False  # DeepSpeed: not reduced over the whole data-parallel group ...
            p.group_name = group_name(ep_size)  # ... but over this expert-data-parallel group

    def _key(self, prefix: str, local_id: int, weight: str) -> str:
        return f"{prefix}experts.deepspeed_experts.{local_id}.{weight}"

    def _save_to_state_dict(self, destination: dict[str, Any], prefix: str, keep_vars: bool) -> None:
        for weight in WEIGHTS:
            stacked = getattr(self, weight)
            stacked = stacked if keep_vars else stacked.detach()
            for i in range(self.n_experts):
                destination[self._key(prefix, i, weight)] = stacked[i]

    def _load_from_state_dict(
        self, state_dict: dict[str, Any], prefix: str, local_metadata: Any, strict: bool,
        missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str],
    ) -> None:
        expected = set()
        for weight in WEIGHTS:
            stacked = getattr(self, weight)
            for i in range(self.n_experts):
                key = self._key(prefix, i, weight)
                expected.add(key)
                if key not in state_dict:
                    missing_keys.append(key)
                elif state_dict[key].shape != stacked.shape[1:]:
                    error_msgs.append(f"{key}: shape {tuple(state_dict[key].shape)} != {tuple(stacked.shape[1:])}")
                else:
                    with torch.no_grad():
                        stacked[i].copy_(state_dict[key])
        if strict:
            unexpected_keys.extend(k for k in state_dict if k.startswith(prefix) and k not in expected)


class ExpertParallelExperts(DeepSpeedMoE):
    """Stands in for an `Experts` of E experts; holds E / ep of them and exchanges tokens.

    A `deepspeed.moe.layer.MoE` only so that DeepSpeed's engine enables its MoE handling
    (expert gradient groups, per-expert checkpoint files); none of that class's own gate or
    experts are built. The FFN reads `n_experts` (all E) and `backend`; megablocks' own
    dispatch is bypassed (it would index all E experts): tokens come sorted by expert
    through `grouped`, and the local experts still run megablocks' grouped GEMM.
    """

    def __init__(self, experts: Experts, group: Any, ep_size: int) -> None:
        nn.Module.__init__(self)  # not DeepSpeedMoE.__init__: it would build DeepSpeed's gate and experts
        if experts.n_experts % ep_size != 0:
            raise ConfigError(
                f"parallel.expert_parallel ({ep_size}) must divide moe.n_experts ({experts.n_experts})"
            )
        self.group = group
        self.ep_size = ep_size
        self.ep_rank = dist.get_rank(group)
        self.n_experts = self.num_experts = experts.n_experts
        self.num_local_experts = experts.n_experts // ep_size
        self.expert_group_name = group_name(ep_size)  # the names DeepSpeed's engine reads
        self.enable_expert_tensor_parallelism = False
        self.use_residual = False
        self.activation = experts.activation
        self.backend = "grouped_gemm" if experts.backend == "megablocks" else experts.backend
        first = self.ep_rank * self.num_local_experts
        self.deepspeed_moe = LocalExperts(experts, first, self.num_local_experts, ep_size)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        """The engine calls this on every MoE; our groups exist already (create_expert_groups)."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("ExpertParallelExperts is called through padded() / grouped(), as Experts is")

    @property
    def local(self) -> LocalExperts:
        return self.deepspeed_moe

    def gates_in_activation(self, x: Tensor) -> bool:
        """Never: the gates stay with the FFN's combine on the rows' own rank (no third exchange)."""
        return False

    def by_ends_applies(self, x: Tensor) -> bool:
        """Never: the exchange's uneven splits are read on the host anyway, from the counts (grouped)."""
        return False

    @staticmethod
    def _no_gates(gates: Tensor | None) -> None:
        if gates is not None:
            raise ValueError("ExpertParallelExperts takes no gates (gates_in_activation is False)")

    def padded(self, xs: Tensor, gates: Tensor | None = None) -> Tensor:
        """xs (E, R, D) -> (E, R, D); equal splits: every rank sends R rows per expert."""
        self._no_gates(gates)
        n_experts, rows, width = xs.shape
        ep, local = self.ep_size, self.num_local_experts
        received = all_to_all(xs.reshape(n_experts * rows, width), self.group)  # [source rank][local expert][row]
        mine = received.view(ep, local, rows, width).transpose(0, 1).reshape(local, ep * rows, width)
        ys = self.local.padded(mine)  # (local, ep*R, D)
        back = ys.view(local, ep, rows, width).transpose(0, 1).reshape(n_experts * rows, width)
        return all_to_all(back, self.group).view(n_experts, rows, width)

    def grouped(self, xs: Tensor, counts: Tensor, gates: Tensor | None = None) -> Tensor:
        """xs (M, D) sorted by expert, counts (E,) -> (M, D); uneven splits, exchanged first."""
        self._no_gates(gates)
        ep, local = self.ep_size, self.num_local_experts
        counts = counts.to(device=xs.device, dtype=torch.long)
        received_counts = torch.empty_like(counts)  # (ep*local,): [source rank][local expert]
        dist.all_to_all_single(received_counts, counts, group=self.group)
        table = received_counts.view(ep, local)
        # both exchanges' splits in one read from the device (the host sizes them)
        send_splits, receive_splits = torch.stack([counts.view(ep, local).sum(1), table.sum(1)]).tolist()
        received = all_to_all(xs, self.group, receive_splits, send_splits)  # [source][local expert][row]
        # Expert-major for the local compute: a stable sort of the rows by their local expert.
        segment = torch.repeat_interleave(torch.arange(ep * local, device=xs.device), received_counts,
                                          output_size=sum(receive_splits))
        order = torch.argsort(segment % local, stable=True)
        ys = self._local_experts(received.index_select(0, order), table.sum(0))
        ys = ys.index_select(0, torch.argsort(order))  # back to [source][local expert][row]
        return all_to_all(ys, self.group, send_splits, receive_splits)

    def _local_experts(self, xs: Tensor, counts: Tensor) -> Tensor:
        """The local experts on xs (M, D) sorted by expert, counts (local,) rows of each: on the torch
        backend one grouped GEMM each way reading the experts' ends on the device where by_ends
        applies (torch._grouped_mm on an H100/H200), else Experts.grouped (there a loop over the
        experts; on the grouped GEMM backends one gmm each way, from the counts)."""
        if self.local.backend == "torch" and self.local.by_ends_applies(xs):
            return self.local.by_ends(xs, counts.cumsum(0).to(torch.int32))  # every row computed: ends[-1] = M
        return self.local.grouped(xs, counts)


# ----------------------------------------------------------------------------- model-level
def expert_modules(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, FFN) for every MoE FFN of the model, in module order."""
    return [(name, m) for name, m in model.named_modules() if isinstance(m, MoEFFN)]


def apply_expert_parallel(model: nn.Module, ep_size: int, group: Any | None = None) -> int:
    """Shard every MoE FFN's experts over the expert-parallel group; returns how many were sharded.

    Call after the model is built (every rank with the same seed, so the slices are of one
    initialisation) and before the DeepSpeed engine. ep_size 1 leaves the model unchanged.
    """
    if ep_size == 1:
        return 0
    group = group if group is not None else create_expert_groups(ep_size)
    ffns = expert_modules(model)
    for _, ffn in ffns:
        if not isinstance(ffn.experts, Experts):
            raise TypeError(f"expected the FFN's experts to be mode.layers.experts.Experts, got {type(ffn.experts)}")
        ffn.experts = ExpertParallelExperts(ffn.experts, group, ep_size)
    return len(ffns)


def full_state_dict(model: nn.Module) -> dict[str, Tensor]:
    """The model's weights in the one-device layout, every expert gathered (collective).

    Every rank must call it; each gets the full dict. Keys and shapes are those of the same
    model before apply_expert_parallel, so a one-process LanguageModel loads it as is.
    """
    state = model.state_dict()
    for name, module in model.named_modules():
        if not isinstance(module, ExpertParallelExperts):
            continue
        prefix = f"{name}." if name else ""
        for key in [k for k in state if k.startswith(prefix + "deepspeed_moe.")]:
            del state[key]
        for weight in WEIGHTS:
            local = getattr(module.local, weight).detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(module.ep_size)]
            dist.all_gather(parts, local, group=module.group)
            state[prefix + weight] = torch.cat(parts)  # ep rank j holds experts [j*local, (j+1)*local)
    return state
