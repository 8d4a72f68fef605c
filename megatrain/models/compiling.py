"""torch.compile for megatrain's hot functions (the decoder layer, FlexAttention, the probe's layer).

The compiler keeps its compiled variants per function (per code object, not per call of
`torch.compile`), at most `recompile_limit` of them (8 by default), and past it runs the function
uncompiled, with one warning. Every engine of a process shares `Engine._call_layer`, and each model
shape costs it a variant per grad mode (the forward sweep's and the recompute's): a fifth model
built in one process (a sweep, a notebook, a test session) would run uncompiled, and uncompiled
FlexAttention materialises every score (memory the plan never counted). So the limit is raised,
never lowered, to RECOMPILE_LIMIT where these functions are compiled.
"""

from __future__ import annotations

import torch

RECOMPILE_LIMIT = 64  # compiled variants per function: 32 model shapes, both grad modes


def compiled(fn, **kwargs):
    """`torch.compile(fn, **kwargs)`, with the compiler's per-function limit at least RECOMPILE_LIMIT."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, **kwargs)
