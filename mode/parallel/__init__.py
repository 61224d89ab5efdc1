"""Parallelism applied from outside the model: the only package that imports torch.distributed or deepspeed.

- expert_parallel: experts sharded over DeepSpeed's expert-parallel groups, tokens exchanged
  by all-to-all (`apply_expert_parallel`, `full_state_dict`).
- engine: DeepSpeed's JSON derived from the project's config, and `DeepSpeedOptimization`,
  the engine in the place of the Trainer's optimizer step.
- launch: the multi-process entry point (launch/train.py).

Importing this package imports deepspeed (a few seconds); mode.training never does.
"""
from mode.parallel.engine import DeepSpeedOptimization, Processes, deepspeed_config, init_distributed
from mode.parallel.expert_parallel import (
    ExpertParallelExperts,
    apply_expert_parallel,
    create_expert_groups,
    full_state_dict,
)

__all__ = [
    "DeepSpeedOptimization",
    "ExpertParallelExperts",
    "Processes",
    "apply_expert_parallel",
    "create_expert_groups",
    "deepspeed_config",
    "full_state_dict",
    "init_distributed",
]
