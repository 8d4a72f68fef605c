"""megatrain: full-precision LLM training on one GPU, streaming layers from host memory."""

import time as _time

__version__ = "0.1.0"

STARTED = _time.monotonic()  # the process's start, for the time to the first step (trainer.py)

# The CUDA caching allocator's setting for megatrain's memory pattern (runtime.configure_allocator
# says why); the command line sets it before torch starts, unless the user set their own.
CUDA_ALLOC_CONF = "expandable_segments:True"

# OpenMP threads that wait for work by sleeping, not spinning: a spinning thread whose core another
# process takes holds every op's barrier until it runs again (the quickstart on 2 busy cores: 3-17 s
# a step, against 1-3 s). libgomp reads it once, as torch loads, so the command line sets it before
# torch starts (unless the user set their own, or torch was loaded already).
OMP_WAIT_POLICY = "PASSIVE"
