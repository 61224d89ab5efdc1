"""DeepSpeedOptimization with bf16 weights under ZeRO 0, on 2 CPU processes over gloo.

    python -m torch.distributed.run --nproc_per_node 2 tests/bf16_engine.py CONFIG

Run by tests/test_parallel.py. With bf16 weights (forced here: training autocasts on CUDA only, so
the steps autocast on the CPU by hand) the engine holds the matrices in bf16 with float32 masters,
reduces the gradients itself and steps through the one-process optimizer. Over the config's
train.max_steps steps, each rank on its own tokens, this checks:
- the matrices are bf16, and the masters start as rank 0's on every rank (rank 1 builds other weights);
- every step equals a one-process TorchOptimization with bf16 weights stepped from the mean over
  ranks of each rank's own gradients (bf16 ones averaged in bf16): the same masters, bf16 copies
  and gradient norms; with train.grad_accum above 1, each rank's matrices' gradients summed over
  its micro-batches in float32 (the one-process sums) and those sums averaged in float32, the
  matrices keeping no .grad;
- a checkpoint holds the float32 masters (checkpoint.pt's weights and DeepSpeed's files), and loading
  it after one more step brings back the masters, their bf16 copies and the optimizer's moments;
- an engine with float32 weights loads the same checkpoint: the masters become its weights;
- with parallel.reduce_bucket_mb above 0 and one micro-batch (OverlappedGradients), the first bucket
  starts before the backward has produced every gradient, and every bucket starts once a step.
Prints "bf16 engine: ok" on rank 0; an assertion names what differed.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mode.config import load_config
from mode.model import LanguageModel
from mode.parallel.engine import DeepSpeedOptimization, OverlappedGradients, init_distributed, quiet_deepspeed
from mode.parallel.launch import exit_without_teardown
from mode.training.optim import TorchOptimization


def assert_equal(got: list[Tensor], want: list[Tensor], what: str) -> None:
    """Equal to float32 rounding: both sides run the same ops on the same numbers."""
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-7, msg=lambda m, i=i: f"{what}, tensor {i}: {m}")


def loss_of(model: nn.Module, tokens: Tensor) -> Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(tokens[:, :-1], tokens[:, 1:]).loss


def mean_over_ranks(grads: list[list[Tensor]]) -> list[Tensor]:
    """Each parameter's gradients of the ranks (in rank order) summed in their dtype, then halved:
    the reduction's arithmetic on 2 ranks."""
    return [(g0 + g1).mul_(0.5) for g0, g1 in zip(*grads, strict=True)]


def main(path: str) -> None:
    config = load_config(path, [])
    t = config.train
    assert config.parallel.zero_stage == 0, "the check needs ZeRO 0"
    micro_batches = t.grad_accum
    quiet_deepspeed()
    processes = init_distributed(config)
    assert processes.world_size == 2, "the reference averages 2 ranks"
    torch.manual_seed(t.seed + processes.rank)  # rank 1 starts elsewhere: the engine takes rank 0's weights
    optimization = DeepSpeedOptimization(LanguageModel(config), config, processes, bf16_weights=True)
    torch.manual_seed(t.seed)
    reference = TorchOptimization(LanguageModel(config), config, torch.device("cpu"), bf16_weights=True)
    model, ref_model = optimization.model, reference.model
    bf16, ref_bf16 = optimization.local.bf16, reference.bf16
    assert bf16.params and all(p.dtype == torch.bfloat16 for p in bf16.params), "the matrices are not bf16"
    sums = torch.stack([m.double().sum() for m in bf16.masters])
    gathered = [torch.zeros_like(sums) for _ in range(2)]
    dist.all_gather(gathered, sums)
    assert torch.equal(gathered[0], gathered[1]), "the masters differ between ranks"

    arrived_at_start: list[int] = []  # per bucket started: how many gradients had arrived
    flat = optimization.flat_grads
    overlapped = isinstance(flat, OverlappedGradients)
    assert overlapped is (config.parallel.reduce_bucket_mb > 0 and micro_batches == 1), type(flat)
    if overlapped:
        start = flat._start
        flat._start = lambda b: (arrived_at_start.append(len(flat.arrived)), start(b))[1]

    draws = torch.Generator().manual_seed(100)  # both ranks draw every rank's tokens alike
    assert bool(optimization.summed_params) is (micro_batches > 1)
    for step in range(t.max_steps):
        batches = [[torch.randint(0, config.model.vocab_size, (t.batch_size, config.data.seq_len + 1), generator=draws)
                    for _ in range(micro_batches)] for _ in range(2)]  # (rank, micro-batch)
        lr = t.lr * (step + 1) / t.max_steps
        for tokens in batches[processes.rank]:
            optimization.backward(loss_of(model, tokens) / micro_batches)
        assert all(p.grad is None for p in optimization.summed_params), "a summed matrix kept a .grad"
        norm = optimization.step(lr)
        own = []  # each rank's gradients as the update reads them: the matrices' float32 sums where summed
        for rank_batches in batches:
            for micro, tokens in enumerate(rank_batches):
                reference.backward(loss_of(ref_model, tokens) / micro_batches, accumulate=micro > 0)
            own.append([ref_bf16.grad(p).clone() for p in ref_model.parameters()])
            ref_model.zero_grad(set_to_none=True)
        for p, g in zip(ref_model.parameters(), mean_over_ranks(own), strict=True):
            if ref_bf16.sums is not None and ref_bf16.owns(p):
                ref_bf16.grad(p).copy_(g)
            else:
                p.grad = g
        ref_norm = reference.step(lr)
        if overlapped:
            assert len(arrived_at_start) == len(flat.buckets) > 1, (len(arrived_at_start), len(flat.buckets))
            assert arrived_at_start[0] < len(flat.params), f"step {step + 1}: no bucket started within the backward"
            arrived_at_start.clear()
        assert_equal([norm], [ref_norm], f"step {step + 1}: the gradient norm")
        assert_equal(bf16.masters, ref_bf16.masters, f"step {step + 1}: the masters")
        assert_equal([p.float() for p in bf16.params], [p.float() for p in ref_bf16.params], f"step {step + 1}: the bf16 weights")

    run_dir = Path(t.out_dir)
    saved = optimization.save_checkpoint(run_dir, {"state": {"step": t.max_steps}, "config": {"name": "bf16 engine"}})
    master_of = {name: bf16.master_of[id(p)] for name, p in model.named_parameters() if bf16.owns(p)}
    names = list(master_of)
    assert all(saved["model"][name].dtype == torch.float32 for name in names), "checkpoint.pt's weights are not the masters"
    assert_equal([saved["model"][name] for name in names], [master_of[name] for name in names],
                 "checkpoint.pt's weights against the masters")
    masters = [master_of[name].clone() for name in names]
    moments = [optimization.optimizer.state[master_of[name]]["exp_avg_sq"].clone() for name in names]
    for tokens in batches[processes.rank]:
        optimization.backward(loss_of(model, tokens) / micro_batches)
    optimization.step(t.lr)
    assert not torch.equal(master_of[names[0]], masters[0]), "the extra step moved nothing"
    optimization.load_checkpoint(run_dir, {"optimizer": saved["optimizer"], "state": {"step": t.max_steps}})
    assert_equal([master_of[name] for name in names], masters, "the masters after loading the checkpoint")
    weights = dict(model.named_parameters())
    assert_equal([weights[name].float() for name in names], [m.bfloat16().float() for m in masters],
                 "the bf16 weights after loading")
    assert_equal([optimization.optimizer.state[master_of[name]]["exp_avg_sq"] for name in names], moments,
                 "the moments after loading")
    # a run with float32 weights resumes from it: the masters become its weights, the moments its own
    float32 = DeepSpeedOptimization(LanguageModel(config), config, processes, bf16_weights=False)
    float32.load_checkpoint(run_dir, {"optimizer": saved["optimizer"], "state": {"step": t.max_steps}})
    weights = dict(float32.model.named_parameters())
    assert_equal([weights[name].detach() for name in names], masters, "float32 weights resumed from the checkpoint")
    assert_equal([float32.optimizer.state[weights[name]]["exp_avg_sq"] for name in names], moments,
                 "float32 weights' moments resumed from the checkpoint")
    dist.barrier()
    if processes.rank == 0:
        print("bf16 engine: ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_teardown(0)  # as launch/train.py leaves: gloo's teardown once aborted a finished run
