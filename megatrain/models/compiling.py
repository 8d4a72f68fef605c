"""torch.compile for megatrain's hot functions (the decoder layer, FlexAttention, the probe's layer).

The compiler keeps its compiled variants per function (per code object, not per call of
`torch.compile`), at most `recompile_limit` of them (8 by default), and past it runs the function
uncompiled, with one warning. Every engine of a process shares `Engine._call_layer`, and each model
shape costs it a variant per grad mode (the forward sweep's and the recompute's): a fifth model
built in one process (a sweep, a notebook, a test session) would run uncompiled, and uncompiled
FlexAttention materialises every score (memory the plan never counted). So the limit is raised,
never lowered, to RECOMPILE_LIMIT where these functions are compiled.

Kernel choices by rule, not by timing (INDUCTOR_OPTIONS). By default inductor times candidate
kernels on the device as it compiles (a reduction's block sizes, whether to pad a matmul) and
keeps the fastest; each candidate orders a sum differently, so the choice changes the last bits.
On a busy GPU the timings vary, and two compiles of one layer (two runs, a run and its resume in a
new process, two data-parallel ranks) could compute different numbers: Llama-3-8B's layer
compiled four times under random timings gave three different results
(bench/results/2026-11-27_1743_compiler.md). Inductor's deterministic mode picks by rule instead,
at 0.99x the layer's time there (bench/compiler.py). Torch releases without the mode compile as
before.
"""

from __future__ import annotations

import torch
from torch._inductor import config as inductor_config

RECOMPILE_LIMIT = 64  # compiled variants per function: 32 model shapes, both grad modes
INDUCTOR_OPTIONS = {"deterministic": True} if hasattr(inductor_config, "deterministic") else {}


def compiled(fn, **kwargs):
    """`torch.compile(fn, **kwargs)` with inductor's kernel choices made by rule
    (INDUCTOR_OPTIONS), and the compiler's per-function limit at least RECOMPILE_LIMIT."""
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, options=dict(INDUCTOR_OPTIONS), **kwargs)
