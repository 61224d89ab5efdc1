"""mode: Mixture-of-Depths and Mixture-of-Depths-and-Experts transformers."""
__version__ = "0.1.0"
