"""Sampling in which each completion has its own random stream: a completion depends on its
prompt, the weights and its seed, never on the completions sampled beside it. So a rollout
gives the same completions whether one process samples a step's prompts or several split them,
in one batch or in many (vLLM's per-request seeds serve the same end).

`RowSampler` is a transformers logits processor for `generate(..., do_sample=False)`: it filters
each row's logits with transformers' own warpers (temperature, then top-k, then top-p, as
`generate` applies them when it samples), draws the row's token by inverting the cumulative
distribution of their softmax at a uniform number of the row's own, and leaves only that token for
the greedy pick. The uniform number of a row's n-th token is a counter-based hash of (the row's
seed, n) made on the host for every row at once: one small copy and a few batched kernels per
decoding step, whatever the number of rows.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)


def row_seed(*parts: int) -> int:
    """A 63-bit seed from integers (the run's seed, the step, a prompt's index in the dataset, the
    completion's index in its group): well mixed, so nearby rows get unrelated streams."""
    digest = hashlib.blake2b(
        b"".join(int(p).to_bytes(8, "little", signed=True) for p in parts), digest_size=8
    )
    return int.from_bytes(digest.digest(), "little") & (2**63 - 1)


GOLDEN = 0x9E3779B97F4A7C15  # splitmix64's increment


def _mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser: uint64 in, well-mixed uint64 out (numpy's uint64 wraps)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms(seeds: np.ndarray, n: int) -> np.ndarray:
    """The uniform number in (0, 1) of each row's n-th token (float64), from its seed alone."""
    with np.errstate(over="ignore"):
        x = _mix(seeds + np.uint64(n + 1) * np.uint64(GOLDEN))
    return ((x >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


class RowSampler(LogitsProcessor):
    """Each row sampled from its own stream (seeded with `seeds[i]`), its tokens on `device`."""

    def __init__(self, seeds: list[int], device, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float = 1.0):  # fmt: skip
        self.warpers = LogitsProcessorList()
        if temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))
        self.device = torch.device(device)
        self.seeds = np.array(seeds, dtype=np.uint64)
        self.drawn = 0  # tokens drawn per row so far: generate calls once per new token

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.seeds):
            raise ValueError(f"{scores.shape[0]} rows to sample, seeds for {len(self.seeds)}")
        probs = torch.softmax(self.warpers(input_ids, scores.float()), dim=-1)
        cdf = probs.double().cumsum_(dim=-1)
        u = torch.from_numpy(uniforms(self.seeds, self.drawn)).to(self.device, non_blocking=True)
        self.drawn += 1
        choice = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None]).clamp_(max=scores.shape[-1] - 1)
        out = torch.full_like(scores, -float("inf"))
        return out.scatter_(1, choice, 0.0)
