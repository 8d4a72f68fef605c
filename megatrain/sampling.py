"""Sampling in which each completion has its own random stream: a completion depends on its
prompt, the weights and its seed, never on the completions sampled beside it. So a rollout
gives the same completions whether one process samples a step's prompts or several split them,
in one batch or in many (vLLM's per-request seeds serve the same end).

`RowSampler` is a transformers logits processor for `generate(..., do_sample=False)`: it filters
each row's logits with transformers' own warpers (temperature, then top-k, then top-p, as
`generate` applies them when it samples), draws the row's token by the Gumbel-max rule with
uniform noise from the row's own `torch.Generator`, and leaves only that token for the greedy
pick. Gumbel-max samples exactly from the softmax of the filtered logits.
"""

from __future__ import annotations

import hashlib

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


class RowSampler(LogitsProcessor):
    """Each row sampled from its own generator (seeded with `seeds[i]`, on `device`)."""

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
        self.generators = [torch.Generator(self.device).manual_seed(s) for s in seeds]

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if scores.shape[0] != len(self.generators):
            raise ValueError(f"{scores.shape[0]} rows to sample, seeds for {len(self.generators)}")
        logp = torch.log_softmax(self.warpers(input_ids, scores.float()), dim=-1)
        vocab = scores.shape[-1]
        noise = torch.stack([torch.rand(vocab, generator=g, device=self.device) for g in self.generators])
        gumbel = -torch.log(-torch.log(noise.clamp_(min=torch.finfo(noise.dtype).tiny)))
        choice = (logp + gumbel).argmax(dim=-1, keepdim=True)
        out = torch.full_like(scores, -float("inf"))
        return out.scatter_(1, choice, 0.0)
