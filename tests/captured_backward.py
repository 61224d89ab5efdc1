"""DeepSpeedOptimization's backward split as a CUDA graph runs it, on 2 CPU processes over gloo.

    python -m torch.distributed.run --nproc_per_node 2 tests/captured_backward.py CONFIG

Run by tests/test_parallel.py. Under ZeRO 0 a graphed multi-process step (mode.training.graphs.
GraphedMicroStep) replays captured_backward (autograd alone) and then calls after_replay on the
host. Over the config's train.grad_accum micro-batches of each rank's own tokens this checks, with
the graph left out (CPU):
- before the boundary, after_replay reduces nothing: each rank's gradients are its own;
- at the boundary they are the mean over ranks of every micro-batch's, as the engine's backward
  leaves them, and after the engine's step (which drops the gradients) the split runs again.
With parallel.expert_parallel > 1 each rank holds a slice of the experts, whose gradients are summed
over the ranks holding the same experts and divided by every rank's count (DeepSpeed's rule); the
config's experts must route with equal splits (padded rows), which the graph can hold, and the
same FFN dropless is named as reading its routing on the host.
Prints "captured backward: ok" on rank 0; an assertion names what differed.
"""
from __future__ import annotations

import sys

import torch
import torch.distributed as dist
from deepspeed.moe.utils import is_moe_param
from deepspeed.utils import groups
from torch import Tensor, nn

from mode.config import Config, load_config
from mode.model import LanguageModel
from mode.parallel.engine import DeepSpeedOptimization, init_distributed, quiet_deepspeed
from mode.parallel.expert_parallel import apply_expert_parallel, group_name
from mode.parallel.launch import exit_without_teardown
from mode.training.graphs import _host_reading_layer

RTOL, ATOL = 1e-5, 1e-7  # float32 on CPU: the two paths sum the same numbers, the reduction in another order


def assert_close(got: list[Tensor], want: list[Tensor], what: str) -> None:
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=RTOL, atol=ATOL, msg=lambda m, i=i: f"{what}, parameter {i}: {m}")


def mean_over_ranks(grads: list[Tensor], params: list[nn.Parameter], config: Config, world: int) -> list[Tensor]:
    """What the engine's reduction makes of each rank's summed gradients: shared ones averaged over
    every rank, a sharded expert's summed over the ranks holding it and divided by every rank's count."""
    out = []
    for grad, p in zip(grads, params, strict=True):
        grad = grad.clone()
        if is_moe_param(p):
            dist.all_reduce(grad, group=groups._get_expert_data_parallel_group(group_name(config.parallel.expert_parallel)))
        else:
            dist.all_reduce(grad)
        out.append(grad / world)
    return out


def check_dropless_is_named(config: Config) -> None:
    """The same experts routed dropless (uneven splits, sized on the host) are named as reading their
    routing there: the Trainer then trains plain eager (or refuses train.cuda_graphs=true)."""
    config = config.model_copy(deep=True)
    config.moe.scheme, config.moe.dropless = "token_choice", True
    model = LanguageModel(config)
    apply_expert_parallel(model, config.parallel.expert_parallel)
    reason = _host_reading_layer(model, torch.device("cpu"))
    assert reason is not None and "expert-parallel processes" in reason, reason


def main(path: str) -> None:
    config = load_config(path, [])
    assert config.parallel.zero_stage == 0 and config.train.grad_accum >= 2, "the check needs ZeRO 0 and grad_accum >= 2"
    quiet_deepspeed()
    processes = init_distributed(config)
    torch.manual_seed(config.train.seed)
    model = LanguageModel(config)
    sharded = apply_expert_parallel(model, config.parallel.expert_parallel)
    optimization = DeepSpeedOptimization(model, config, processes)
    model = optimization.model
    assert optimization.capture_refusal() is None
    if sharded:
        assert _host_reading_layer(model, torch.device("cpu")) is None, "padded experts read nothing on the host"
        check_dropless_is_named(config)
    params = [p for p in model.parameters() if p.requires_grad]
    accum, t = config.train.grad_accum, config.train
    draws = torch.Generator().manual_seed(100 + processes.rank)  # each rank's own tokens
    batches = [torch.randint(0, config.model.vocab_size, (t.batch_size, config.data.seq_len + 1), generator=draws)
               for _ in range(accum)]

    def loss_of(tokens: Tensor) -> Tensor:
        return model(tokens[:, :-1], tokens[:, 1:]).loss / accum

    own = []  # each micro-batch's gradients on this rank alone
    for tokens in batches:
        model.zero_grad(set_to_none=True)
        loss_of(tokens).backward()
        own.append([p.grad.clone() for p in params])
    model.zero_grad(set_to_none=True)
    mean = mean_over_ranks([sum(grads) for grads in zip(*own)], params, config, processes.world_size)

    for tokens in batches:
        optimization.backward(loss_of(tokens))
    assert_close([p.grad for p in params], mean, "the engine's backward against the mean over ranks")
    optimization.step(0.0)  # no move (lr 0); the engine drops every gradient
    assert all(p.grad is None for p in params), "the engine's step kept a gradient"

    for micro, tokens in enumerate(batches):
        optimization.captured_backward(loss_of(tokens), accumulate=micro > 0)
        optimization.after_replay()
        if micro == 0:
            assert_close([p.grad for p in params], own[0], "before the boundary: this rank's own gradients")
    assert_close([p.grad for p in params], mean, "captured_backward and after_replay against the mean over ranks")
    optimization.step(0.0)  # the count of micro-batches after_replay kept is the step's
    dist.barrier()
    if processes.rank == 0:
        print("captured backward: ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_teardown(0)  # as launch/train.py leaves: gloo's teardown once aborted a finished run
