"""Inference: the decoder that runs a model's blocks incrementally against per-layer KV caches."""
from mode.inference.decoder import DECODE_SDPA_BACKENDS, ROUTED_ROWS, Decoder, layer_step

__all__ = ["DECODE_SDPA_BACKENDS", "ROUTED_ROWS", "Decoder", "layer_step"]
