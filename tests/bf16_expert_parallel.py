"""DeepSpeedOptimization with bf16 weights and expert parallelism under ZeRO 0, on CPU processes
over gloo (expert_parallel=2: each process holds half the experts; on 4 processes two hold each).

    python -m torch.distributed.run --nproc_per_node 2 tests/bf16_expert_parallel.py CONFIG

Run by tests/test_parallel.py. Two engines train side by side from the same weights on the same
tokens (autocast on the CPU by hand): one with bf16 weights (forced: training autocasts on CUDA
only), one with float32 weights, which DeepSpeed reduces and the engine clips by the exact global
norm. Over the config's train.max_steps steps this checks:
- the matrices are bf16, the experts among them; each rank starts from other weights, and the
  masters become the first rank's (an expert's: the first of the ranks holding it), as the
  engine's weights do;
- each step's reduced expert gradients equal the float32 engine's to bf16 rounding (summed over
  the processes holding the same experts, divided by every process's count, as DeepSpeed's
  reduction does), and so does the gradient norm;
- the masters follow the float32 engine's weights to the same rounding, experts and shared (all
  but a few elements, whose gradients nearly cancel over the ranks);
- a checkpoint holds the masters, every expert included, and loading it after one more step
  brings them back.
Prints "bf16 expert parallel: ok" on rank 0; an assertion names what differed.
"""
from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch import Tensor, nn

from mode.config import load_config
from mode.model import LanguageModel
from mode.parallel.engine import DeepSpeedOptimization, init_distributed, is_moe_param, quiet_deepspeed
from mode.parallel.expert_parallel import apply_expert_parallel
from mode.parallel.launch import exit_without_teardown

# bf16 weights against float32 weights: the matrices' gradients are reduced in bf16 (the shared
# ones; rounded once more than float32's), so norms and weights agree to about bf16's precision
NORM_RTOL = 1e-3
GRAD_ATOL = 1e-2  # of the gradient's largest element: bf16 rounds at 2 ** -9 of each
WEIGHT_ATOL = 2e-4


def loss_of(model: nn.Module, tokens: Tensor) -> Tensor:
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return model(tokens[:, :-1], tokens[:, 1:]).loss


def built(config, processes, bf16: bool) -> DeepSpeedOptimization:
    torch.manual_seed(config.train.seed)  # every rank alike: expert parallelism slices one initialisation
    model = LanguageModel(config)
    assert apply_expert_parallel(model, config.parallel.expert_parallel) > 0, "no MoE FFN to shard"
    with torch.no_grad():  # each rank's weights apart: the engine must make them (and the masters) the first's
        for p in model.parameters():
            p.add_(1e-2 * processes.rank)
    return DeepSpeedOptimization(model, config, processes, bf16_weights=bf16)


def main(path: str) -> None:
    config = load_config(path, [])
    t = config.train
    assert config.parallel.zero_stage == 0 and config.parallel.expert_parallel > 1, "the check needs ZeRO 0 and ep > 1"
    quiet_deepspeed()
    processes = init_distributed(config)
    ours, reference = built(config, processes, True), built(config, processes, False)
    bf16 = ours.local.bf16
    experts = [p for p in bf16.params if is_moe_param(p)]
    assert experts and all(p.dtype == torch.bfloat16 for p in bf16.params), "the experts are not bf16 matrices"
    assert ours.local.sharded is not None and {id(p) for p in ours.local.sharded.params} == {
        id(p) for p in ours.model.parameters() if is_moe_param(p)}, "the sharded norm does not hold the experts"
    weights = dict(reference.model.named_parameters())
    names = [name for name, p in ours.model.named_parameters() if bf16.owns(p)]

    def compare(what: str, moved: float) -> None:
        """Each master against the float32 weight: 99 % of elements within WEIGHT_ATOL, every one
        within `moved` (an element whose gradients nearly cancel over the ranks may get the other sign
        from a bf16 reduction, and AdamW then steps it the other way: at most 2 lr a step)."""
        params = dict(ours.model.named_parameters())
        for name in names:
            diff = (bf16.master_of[id(params[name])] - weights[name].detach()).abs()
            within = (diff <= WEIGHT_ATOL).float().mean().item()
            assert within >= 0.99 and diff.max().item() <= moved + WEIGHT_ATOL, (what, name, within, diff.max().item())

    compare("the masters as built", 0.0)
    moved = 0.0
    draws = torch.Generator().manual_seed(100 + processes.rank)  # each rank its own tokens
    for step in range(t.max_steps):
        tokens = torch.randint(0, config.model.vocab_size, (t.batch_size, config.data.seq_len + 1), generator=draws)
        lr = t.lr * (step + 1) / t.max_steps
        norms, expert_grads = [], []
        for optimization in (ours, reference):
            optimization.backward(loss_of(optimization.model, tokens))
            expert_grads.append([p.grad.float() for p in optimization.model.parameters() if is_moe_param(p)])
            norms.append(optimization.step(lr))
        for i, (got, want) in enumerate(zip(*expert_grads, strict=True)):  # reduced: the experts' own rule
            torch.testing.assert_close(got, want, rtol=0, atol=GRAD_ATOL * want.abs().max().item(),
                                       msg=lambda m, s=step, i=i: f"step {s + 1}: expert weight {i}'s gradient: {m}")
        torch.testing.assert_close(norms[0], norms[1], rtol=NORM_RTOL, atol=0,
                                   msg=lambda m, s=step: f"step {s + 1}: the gradient norm: {m}")
        moved += 2 * lr
        compare(f"step {step + 1}: the masters against float32 weights", moved)

    run_dir = Path(t.out_dir)
    saved = ours.save_checkpoint(run_dir, {"state": {"step": t.max_steps}, "config": {"name": "bf16 ep"}})
    assert all(saved["model"][n].dtype == torch.float32 for n in saved["model"] if n.endswith((".w_in", ".w_out"))), \
        "checkpoint.pt's experts are not the masters"
    masters = [m.clone() for m in bf16.masters]
    ours.backward(loss_of(ours.model, tokens))
    ours.step(t.lr)
    assert not all(torch.equal(m, k) for m, k in zip(bf16.masters, masters)), "the extra step moved nothing"
    ours.load_checkpoint(run_dir, {"optimizer": saved["optimizer"], "state": {"step": t.max_steps}})
    for i, (master, kept) in enumerate(zip(bf16.masters, masters, strict=True)):
        assert torch.equal(master, kept), f"master {i} after loading the checkpoint"
        assert torch.equal(bf16.params[i], kept.to(torch.bfloat16)), f"bf16 weight {i} after loading"
    dist.barrier()
    if processes.rank == 0:
        print("bf16 expert parallel: ok", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
    exit_without_teardown(0)  # as launch/train.py leaves: gloo's teardown once aborted a finished run
