"""Sampling in which each completion has its own random stream: a completion depends on its
prompt, the weights and its seed, never on the completions sampled beside it. So a rollout
gives the same completions whether one process samples a step's prompts or several split them,
in one batch or in many (vLLM's per-request seeds serve the same end).

A row's n-th token: its logits filtered by transformers' own warpers (temperature, then top-k,
then top-p, as `generate` applies them when it samples), the token drawn by inverting the
cumulative distribution of their softmax (summed exactly, in fixed point: `draw`) at the row's
n-th uniform number, a counter-based hash (splitmix64) of (the row's seed, n). The rollout engine (decode.py) makes the
numbers on the device (`device_uniforms`), inside its CUDA graphs; `RowSampler`, a logits
processor for transformers' `generate(..., do_sample=False)`, on the host (`uniforms`), leaving
the drawn token alone for the greedy pick. Both give the same numbers, bit for bit.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch
import torch.nn.functional as F
from transformers import LogitsProcessor, LogitsProcessorList
from transformers.generation.logits_process import (
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from ..objectives.logprobs import token_logps


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


def device_uniforms(seeds: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """`uniforms` on the device: `seeds` [rows] int64 (the seeds' bits), `n` [1] int64 (the token's
    index); the same float64 numbers, bit for bit (int64 products wrap as uint64 ones do, and the
    right shifts are made logical)."""
    x = seeds + (n + 1) * _signed(GOLDEN)
    x = (x ^ _shr(x, 30)) * _signed(0xBF58476D1CE4E5B9)
    x = (x ^ _shr(x, 27)) * _signed(0x94D049BB133111EB)
    x = x ^ _shr(x, 31)
    return (_shr(x, 11).double() + 0.5) * 2.0**-53


def _signed(c: int) -> int:
    return c - 2**64 if c >= 2**63 else c


def _shr(x: torch.Tensor, k: int) -> torch.Tensor:
    """x >> k on int64 as on uint64 (torch shifts int64 arithmetically)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


class Warpers:
    """transformers' temperature, top-k and top-p warpers, in `generate`'s order, on [rows, vocab]
    fp32 logits (the identity where all are off)."""

    def __init__(self, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0):
        self.warpers = LogitsProcessorList()
        if temperature != 1.0:
            self.warpers.append(TemperatureLogitsWarper(temperature))
        if top_k:
            self.warpers.append(TopKLogitsWarper(top_k))
        if top_p < 1.0:
            self.warpers.append(TopPLogitsWarper(top_p))

    def __call__(self, scores: torch.Tensor) -> torch.Tensor:
        return self.warpers(None, scores) if self.warpers else scores


DRAW_BLOCK = 1024  # vocabulary entries a block of the two-level search over the cumulative weights


def draw(filtered: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Each row's token [rows]: the inverse of the cumulative distribution of softmax(`filtered`)
    at the row's uniform number `u` [rows] (float64).

    The weights exp(l - max) (at most 1) are held in fixed point, `fixed_bits(vocab)` bits below
    the point, so their sums are exact integers in any order: the same token on every device,
    kernel and batch, which a float scan does not promise. A weight below 2^-bits of the row's
    largest counts as 0 (at most vocab x 2^-bits of the mass, under 1e-8 for 152k entries: below
    the fp32 softmax's own rounding). The search is two-level: the block whose running sum passes
    the target, then the entry within it; no scan runs over the whole vocabulary."""
    rows, vocab = filtered.shape
    weights = torch.exp(filtered - filtered.amax(-1, keepdim=True))
    fixed = (weights * 2.0 ** fixed_bits(vocab)).to(torch.int64)  # exact scaling, then truncation
    blocks = -(-vocab // DRAW_BLOCK)
    fixed = F.pad(fixed, (0, blocks * DRAW_BLOCK - vocab)).view(rows, blocks, DRAW_BLOCK)
    running = fixed.sum(-1).cumsum(-1)  # [rows, blocks]
    target = (u * running[:, -1].double()).to(torch.int64).clamp_(max=running[:, -1] - 1)[:, None]
    block = torch.searchsorted(running, target, right=True)  # the first block past the target
    before = torch.where(block > 0, running.gather(1, (block - 1).clamp(min=0)), 0)
    inner = fixed.gather(1, block[:, :, None].expand(-1, -1, DRAW_BLOCK))[:, 0].cumsum(-1) + before
    at = torch.searchsorted(inner, target, right=True)
    return (block * DRAW_BLOCK + at)[:, 0].clamp_(max=vocab - 1)


def fixed_bits(vocab: int) -> int:
    """Bits below the point of `draw`'s fixed-point weights: a row's sum (at most `vocab` weights
    of at most 1) stays below 2^62."""
    return 62 - vocab.bit_length()


class RowSampler(LogitsProcessor):
    """`generate`'s logits processor: each row sampled from its own stream (seeded with `seeds[i]`),
    its tokens on `device`."""

    def __init__(self, seeds: list[int], device, temperature: float = 1.0, top_k: int | None = None,
                 top_p: float = 1.0, logps: bool = False):  # fmt: skip
        self.warpers = Warpers(temperature, top_k, top_p)
        self.device = torch.device(device)
        self.seeds = np.array(seeds, dtype=np.uint64)
        self.drawn = 0  # tokens drawn per row so far: generate calls once per new token
        # `logps`: each drawn token's log-prob under the warped distribution, a [rows] tensor a token
        self.logps: list[torch.Tensor] | None = [] if logps else None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.seeds):
            raise ValueError(f"{scores.shape[0]} rows to sample, seeds for {len(self.seeds)}")
        u = torch.from_numpy(uniforms(self.seeds, self.drawn)).to(self.device, non_blocking=True)
        self.drawn += 1
        warped = self.warpers(scores.float())
        choice = draw(warped, u)
        if self.logps is not None:
            self.logps.append(token_logps(warped, choice))
        out = torch.full_like(scores, -float("inf"))
        return out.scatter_(1, choice[:, None], 0.0)
