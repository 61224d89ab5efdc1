"""ExpertParallelExperts.grouped (uneven splits: dropless token choice) on 2 CPU processes over gloo.

    python -m torch.distributed.run --nproc_per_node 2 tests/ep_grouped.py

Run by tests/test_parallel.py. Each process holds half of 4 experts and its own rows, sorted by
expert with uneven counts (one expert gets none from one process). Its output, its rows' gradient
and its experts' weight gradients must equal one process holding every expert: the same rows
through the whole Experts, the weight gradients summed over both processes' rows. Twice: the local
experts as a loop over them (Experts.grouped) and as one grouped GEMM each way reading their ends
(Experts.by_ends; torch._grouped_mm in float32 on CPU). Prints "ep grouped: ok" on rank 0.
"""
from __future__ import annotations

import deepspeed
import torch
import torch.distributed as dist
from torch import Tensor

from mode.layers.experts import Experts
from mode.parallel.engine import match_accelerator
from mode.parallel.expert_parallel import ExpertParallelExperts, create_expert_groups
from mode.parallel.launch import exit_without_teardown

E, D, W = 4, 16, 8
TOL = dict(rtol=1e-5, atol=1e-5)  # float32: the same products, summed in another order


def rows_of(rank: int) -> tuple[Tensor, Tensor, Tensor]:
    """This process's rows (M, D), their counts by expert (E,) and an upstream gradient (M, D)."""
    counts = torch.tensor([[3, 0, 5, 2], [1, 4, 2, 6]][rank])
    draws = torch.Generator().manual_seed(10 + rank)
    rows = int(counts.sum())
    return torch.randn(rows, D, generator=draws), counts, torch.randn(rows, D, generator=draws)


def main() -> None:
    match_accelerator("cpu")  # DeepSpeed's groups, on the CPU even where a GPU is visible
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    rank = dist.get_rank()
    group = create_expert_groups(2)
    torch.manual_seed(0)
    whole = Experts(E, D, W, "gelu", "torch")
    xs, counts, upstream = rows_of(rank)

    x = xs.clone().requires_grad_(True)  # one process holding every expert
    (whole.grouped(x, counts) * upstream).sum().backward()
    want_y, want_gx = whole.grouped(xs, counts).detach(), x.grad
    want_w = [getattr(whole, name).grad.clone() for name in ("w_in", "w_out")]
    for g in want_w:
        dist.all_reduce(g)  # every process's rows reach every expert's gradient
    local = slice(rank * E // 2, (rank + 1) * E // 2)

    for by_ends in (False, True):
        sharded = ExpertParallelExperts(whole, group, 2)
        sharded.local.use_by_ends = by_ends
        assert sharded.local.by_ends_applies(xs) is by_ends
        x = xs.clone().requires_grad_(True)
        y = sharded.grouped(x, counts)
        (y * upstream).sum().backward()
        what = "by_ends" if by_ends else "loop"
        torch.testing.assert_close(y.detach(), want_y, **TOL, msg=lambda m: f"{what}: output: {m}")
        torch.testing.assert_close(x.grad, want_gx, **TOL, msg=lambda m: f"{what}: rows' gradient: {m}")
        for name, want in zip(("w_in", "w_out"), want_w):
            got = getattr(sharded.local, name).grad
            torch.testing.assert_close(got, want[local], **TOL, msg=lambda m: f"{what}: {name} gradient: {m}")
    dist.barrier()
    if rank == 0:
        print("ep grouped: ok", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
    exit_without_teardown(0)  # as launch/train.py leaves: gloo's teardown once aborted a finished run
