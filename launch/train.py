#!/usr/bin/env python
"""Multi-process training through DeepSpeed (any block kind; data and expert parallelism).

    deepspeed --num_gpus N launch/train.py --config configs/X.yaml [--resume] [--section.field=value ...]
    torchrun --nproc_per_node N launch/train.py --config configs/X.yaml [...]
    # CPU, 2 processes over gloo:
    .venv/bin/python -m torch.distributed.run --nproc_per_node 2 launch/train.py \
        --config configs/moe_tiny.yaml --train.device=cpu --parallel.expert_parallel=2

The `parallel:` section of the config (zero_stage, expert_parallel, backend) and the
train section drive DeepSpeed; its JSON config is generated (mode/parallel/engine.py).
--stop-at-step N leaves the loop after N optimizer steps, as a preempted job would.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository, installed or not

from mode.cli import quiet_start  # noqa: E402

quiet_start(__name__)  # before torch and DeepSpeed: Ctrl-C while they import ends with one line

from mode.parallel.launch import run_and_exit  # noqa: E402

if __name__ == "__main__":
    run_and_exit()
