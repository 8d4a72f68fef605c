"""The per-token log-probabilities every objective takes (objectives/logprobs.py): against fp64,
z[t] - logsumexp(z) of fp32 logits and its gradient are much closer than log_softmax(z).gather(t)'s,
and the cross-entropy's loss is its negation bit for bit."""

from __future__ import annotations

import torch

from megatrain.objectives.cross_entropy import loss_and_grad
from megatrain.objectives.logprobs import entropy, token_logps


def _logits(seed: int = 0, tokens: int = 256, vocab: int = 32000) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 logits spread as a trained model's are (std 5: a few far above the rest), and labels."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(tokens, vocab, generator=g, dtype=torch.float64) * 5
    return z.float(), torch.randint(0, vocab, (tokens,), generator=g)


def _gathered(z: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """What the rule replaces: the whole log-softmax, then the label's entry."""
    return torch.log_softmax(z, -1).gather(-1, t[:, None]).squeeze(-1)


def _grad(f, z: torch.Tensor, t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    z = z.clone().requires_grad_()
    (f(z, t) * w.to(z.dtype)).sum().backward()
    return z.grad.double()


def test_log_probs_and_their_gradient_are_closer_to_fp64_than_log_softmax_gather():
    z, t = _logits()
    exact = token_logps(z.double(), t)
    ours, plain = ((f(z, t).double() - exact).abs() for f in (token_logps, _gathered))
    assert ours.mean() < plain.mean() / 2, (ours.mean(), plain.mean())
    # The gradient (softmax less the one-hot, times the sequence's weight) that trains the model.
    w = torch.randn(len(t), generator=torch.Generator().manual_seed(1))
    exact = _grad(token_logps, z.double(), t, w)
    ours, plain = ((_grad(f, z, t, w) - exact).abs() for f in (token_logps, _gathered))
    assert ours.max() < plain.max() / 3, (ours.max(), plain.max())
    assert ours.sum() < plain.sum() / 2, (ours.sum(), plain.sum())


def test_cross_entropy_is_the_negated_log_prob_bit_for_bit():
    z, t = _logits(1, tokens=64, vocab=500)
    t[::5] = -100
    loss, _, _ = loss_and_grad(z, t, torch.ones(()))
    keep = t != -100
    assert torch.equal(loss, (-token_logps(z[keep], t[keep])).sum())


def test_entropy_is_the_softmax_entropy():
    z, _ = _logits(2, tokens=32, vocab=300)
    logp = torch.log_softmax(z.double(), -1)
    torch.testing.assert_close(entropy(z).double(), -(logp.exp() * logp).sum(-1), rtol=1e-5, atol=1e-5)
