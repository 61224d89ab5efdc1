"""Parallelism applied from outside the model: the only package that imports torch.distributed or deepspeed."""
