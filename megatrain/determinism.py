"""How sums on a GPU are ordered: the one module that turns PyTorch's deterministic modes on.

On the CPU every megatrain run repeats bit for bit. On a GPU, kernels that add into one place
from many threads (atomics) round in whatever order the threads arrive. megatrain avoids them
where it chooses the kernel: the embedding's gradient and the per-sequence sums of the preference
stages are scatter-adds, taken in PyTorch's sort-based form (`sorted_sums`). One it does not
choose stays: PyTorch's default attention backward (FlashAttention 2) adds dQ over key blocks
atomically, so at training lengths (4,096 tokens) two backward passes differ in the last bits
(bench/results/2026-11-27_1625_h100-determinism.md).

`full_determinism` (Hugging Face TrainingArguments' name) removes that too: PyTorch's strict
deterministic mode, in which the flash backward takes its deterministic algorithm, cuDNN's
attention is left out, and an op with no deterministic form raises instead of running, with
cuBLAS's workspace set as NVIDIA's notes require. transformers' `enable_full_determinism` also sets
CUDA_LAUNCH_BLOCKING=1; megatrain does not, because every kernel launch waiting for the GPU would
undo the overlap of copies, compute and the optimizer, and nothing in a serialised launch is more
deterministic than the same launches in stream order.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import torch

from .errors import ConfigError

CUBLAS_WORKSPACE = "CUBLAS_WORKSPACE_CONFIG"
# The settings under which cuBLAS repeats itself on CUDA >= 10.2 (PyTorch checks for these two).
CUBLAS_DETERMINISTIC = (":4096:8", ":16:8")


def _modes() -> tuple[bool, bool, bool, bool]:
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
    )


def _set_modes(modes: tuple[bool, bool, bool, bool]) -> None:
    enabled, warn_only, cudnn_deterministic, cudnn_benchmark = modes
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
    torch.backends.cudnn.deterministic = cudnn_deterministic
    torch.backends.cudnn.benchmark = cudnn_benchmark


@contextlib.contextmanager
def sorted_sums() -> Iterator[None]:
    """Scatter-adds (`index_add_`, `index_put_(accumulate=True)`) inside take PyTorch's sort-based
    form on CUDA, which sums each target's values in index order, instead of atomics. Strict mode,
    if on, stays strict; otherwise only these ops change."""
    before = _modes()
    if not before[0]:
        torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        _set_modes(before)


@contextlib.contextmanager
def full_determinism(enabled: bool) -> Iterator[None]:
    """Within: PyTorch's strict deterministic mode, cuDNN's deterministic choices, and cuBLAS's
    workspace config (the user's, if one of the deterministic two; else ':4096:8'). Everything is
    put back on leaving. Refuses a cuBLAS setting of the user's that is not deterministic."""
    if not enabled:
        yield
        return
    mine = os.environ.get(CUBLAS_WORKSPACE)
    if mine is not None and mine not in CUBLAS_DETERMINISTIC:
        raise ConfigError(
            f"full_determinism: the environment's {CUBLAS_WORKSPACE}={mine} is not one of cuBLAS's deterministic settings "
            f"({' or '.join(CUBLAS_DETERMINISTIC)}); unset it or pick one"
        )
    before = _modes()
    if mine is None:
        os.environ[CUBLAS_WORKSPACE] = CUBLAS_DETERMINISTIC[0]
    _set_modes((True, False, True, False))
    try:
        yield
    finally:
        _set_modes(before)
        if mine is None:
            os.environ.pop(CUBLAS_WORKSPACE, None)
