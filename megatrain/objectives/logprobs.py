"""Per-token log-probabilities of fp32 logits, the one rule every objective takes them by:
log p(t) = z[t] - logsumexp(z), as TRL's `selective_log_softmax` and its fused LM head do.

`log_softmax(z).gather(t)` forms z - logsumexp(z) for the whole vocabulary first and rounds each
entry, then picks one: its error grows with the vocabulary's spread of logits, where the label's
logit less one log-sum-exp is rounded once (tests/test_logprobs.py measures both against fp64).
"""

from __future__ import annotations

import torch
from torch import Tensor


def log_normaliser(z: Tensor) -> Tensor:
    """logsumexp over the vocabulary of logits `z` [..., V], keeping the last dimension ([..., 1])."""
    return torch.logsumexp(z, dim=-1, keepdim=True)


def token_logps(z: Tensor, tokens: Tensor, lse: Tensor | None = None) -> Tensor:
    """log p(token) at each position of logits `z` [..., V] (fp32 or fp64): z[token] less the
    log-normaliser (`lse`, [..., 1], when the caller has it already). tokens [...]: valid ids."""
    lse = log_normaliser(z) if lse is None else lse
    return (z.gather(-1, tokens[..., None]) - lse).squeeze(-1)


def entropy(z: Tensor, lse: Tensor | None = None, p: Tensor | None = None) -> Tensor:
    """The entropy of softmax(z) at each position, logsumexp(z) - E_p[z] (TRL's fused head's form);
    `p`: softmax(z) where the caller has it already."""
    lse = log_normaliser(z) if lse is None else lse
    p = torch.exp(z - lse) if p is None else p
    return lse.squeeze(-1) - (p * z).sum(-1)


def is_top1(z: Tensor, tokens: Tensor) -> Tensor:
    """Whether each token is the most likely one at its position (the first of equal maxima, as
    TRL's `is_top1`): its `mean_token_accuracy`."""
    return z.argmax(-1) == tokens
