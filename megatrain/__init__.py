"""megatrain: full-precision LLM training on one GPU, streaming layers from host memory."""

__version__ = "0.1.0"

# The CUDA caching allocator's setting for megatrain's memory pattern (runtime.configure_allocator
# says why); the command line sets it before torch starts, unless the user set their own.
CUDA_ALLOC_CONF = "expandable_segments:True"
