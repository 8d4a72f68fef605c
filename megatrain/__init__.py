"""megatrain: full-precision LLM training on one GPU, streaming layers from host memory."""

__version__ = "0.1.0"
