"""Expert choice's layout and its one-function dispatch (router head, layout and gather)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from mode.kernels import use_triton
from mode.routing.expert_rows import rows_dtype, rows_kernel_applies
from mode.routing.scores import half_router_applies, router_scores

if TYPE_CHECKING:
    from mode.kernels.expert_choice import Dispatch


def expert_major_ids(indices: Tensor, tokens_per_group: int) -> Tensor:
    """Expert choice (G, E, C) positions within groups -> (E, G*C) ids in the flattened (G*T) axis.

    Expert-major, so gather_tokens on x viewed as (1, G*T, D) yields (1, E, G*C, D) directly:
    every expert's rows are contiguous, ready for one batched matmul.
    """
    groups = indices.shape[0]
    offsets = torch.arange(0, groups * tokens_per_group, tokens_per_group, device=indices.device)  # (G,)
    return (indices + offsets.view(groups, 1, 1)).transpose(0, 1).reshape(indices.shape[1], -1)


def expert_choice_kernel_applies(x: Tensor, weight: Tensor, bias: Tensor | None, groups: int) -> bool:
    """x (N, D) routed in `groups` equal runs by a router of weight (S, D): where expert choice's
    router head, layout and gather run as one autograd function (mode/kernels/expert_choice.py,
    its backward adding the router's input gradient into the gather's): the row kernels apply and
    the policy allows the "expert_choice" kernels."""
    if not (bias is None and rows_kernel_applies(x) and use_triton(x, "expert_choice")):
        return False
    from mode.kernels.expert_choice import fits

    return fits(x.shape[0], groups, weight.shape[0])


def expert_choice_dispatch(x: Tensor, weight: Tensor, groups: int, n_experts: int, capacity: int,
                           z_weight: float, null_gates: bool = False) -> "Dispatch":
    """Expert choice in one autograd function (where expert_choice_kernel_applies): x (N, D) in `groups`
    equal runs, router weight (S, D), the first n_experts slots real -> mode.kernels.expert_choice.Dispatch:
    the rows x[ids] (E*G*C, D) expert-major, gates (G, E, C), aux = z_weight * z-loss, with null_gates
    every token's no-op slot probabilities (N, S - E), indices (G, E, C), ids, the inverse map (N, E)
    and the statistics. The same routing as ExpertChoiceRouter.forward,
    expert_major_ids, expert_choice_rows and gather_rows (the selection bit for bit)."""
    from mode.kernels.expert_choice import expert_choice_dispatch as dispatch

    dtype = rows_dtype(x)  # read under the caller's autocast
    with torch.autocast(device_type=x.device.type, enabled=False):
        with torch.no_grad():  # the function's backward owns the scores' gradient path
            logits = router_scores(x, weight)  # (N, S) float32
        return dispatch(x, weight, logits, groups, n_experts, capacity, z_weight, half_router_applies(x, weight), dtype,
                        null_gates)
