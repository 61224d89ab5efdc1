"""Training: the optimizer step, CUDA graphs, router statistics and the Trainer loop."""
