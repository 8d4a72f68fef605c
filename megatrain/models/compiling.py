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

Nothing here imports torch's compiler until something is compiled: importing dynamo and inductor
costs seconds of CPU, which a process that never compiles (every CPU run) would pay for nothing.
So `eager` applies `torch.compiler.disable` when compiling starts, and INDUCTOR_OPTIONS is read
from inductor's config at its first use.
"""

from __future__ import annotations

import functools
import sys

import torch

RECOMPILE_LIMIT = 64  # compiled variants per function: 32 model shapes, both grad modes

_eager: list[tuple] = []  # (function, {"disabled": its torch.compiler.disable}) of every `eager`


def __getattr__(name: str):
    # INDUCTOR_OPTIONS, read from inductor's config at its first use (a caller may set it: the
    # modes of bench/compiler.py).
    if name != "INDUCTOR_OPTIONS":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from torch._inductor import config

    options = globals()[name] = {"deterministic": True} if hasattr(config, "deterministic") else {}
    return options


def eager(fn):
    """`torch.compiler.disable(fn)`: `fn` runs eagerly where compiled code calls it (the compiler
    breaks the graph there), as itself elsewhere. The disabled function is made by `compiled`
    before it compiles (or, under a plain `torch.compile`, as the first trace reaches it)."""
    made: dict = {}
    _eager.append((fn, made))

    @functools.wraps(fn)
    def call(*args, **kwargs):
        if torch.compiler.is_compiling():
            return _disabled(fn, made)(*args, **kwargs)
        return fn(*args, **kwargs)

    return call


def _disabled(fn, made: dict):
    if "disabled" not in made:
        made["disabled"] = torch.compiler.disable(fn)
    return made["disabled"]


def compiled(fn, **kwargs):
    """`torch.compile(fn, **kwargs)` with inductor's kernel choices made by rule
    (INDUCTOR_OPTIONS), and the compiler's per-function limit at least RECOMPILE_LIMIT."""
    for f, made in _eager:
        _disabled(f, made)
    config = torch._dynamo.config
    config.recompile_limit = max(config.recompile_limit, RECOMPILE_LIMIT)
    return torch.compile(fn, options=dict(sys.modules[__name__].INDUCTOR_OPTIONS), **kwargs)
