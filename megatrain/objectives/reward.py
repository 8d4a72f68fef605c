"""Stage rm: reward modelling as TRL 1.16's RewardTrainer does it, over the score head
(models/score.py) of a sequence-classification model.

Each pair's chosen and rejected sequences (data/preference.py `build_reward_pairs`: tokenised as
TRL 1.16's RewardTrainer does) get one reward each, the score of the token their sample codes
(`score_sample`: transformers' last non-pad token). A
micro-batch's loss is TRL's Bradley-Terry loss over its pairs,
`-logsigmoid(chosen - rejected - margin).mean()`, plus `center_rewards_coefficient x
mean((chosen + rejected)^2)` where that is set; the step's is the mean of its micro-batches' (TRL's
gradient accumulation: `count` is 1 a micro-batch). Metrics, TRL's names: accuracy, margin (of the
rewards, without the margin column), min_reward, mean_reward, max_reward, each micro-batch's, which
the log averages; min_reward and max_reward are first taken over the ranks' micro-batches of the
same place in the step, as TRL takes them over every process's batch at once (`extremes`).

The loss takes two passes over the head, as the preference stages' do, on the scored tokens'
hidden states alone: `Head.forward` for the rewards, the loss and its derivative w.r.t. each
reward, then `Head.backward` with each chunk's term the rewards weighted by those derivatives.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data.batch import MicroBatch
from ..errors import ConfigError
from .base import Objective
from .losshead import Head


@dataclass
class RewardConfig:
    """The keys of reward modelling: TRL 1.16 RewardConfig's. It has no max_prompt_length,
    max_completion_length nor truncation_mode: its data is whole sequences, a pair over max_length
    left out (data/preference.py `build_reward_pairs`); config.py refuses them under stage rm."""

    stage: str = "rm"
    center_rewards_coefficient: float | None = None
    """Weight of mean((chosen + rejected)^2) added to the loss, which centres the rewards on 0
    (TRL's; None: none)."""

    # What the stages' shared code asks of a preference stage's settings (PreferenceConfig's).
    needs_reference = False
    needs_kl = False
    sequences = 2

    def __post_init__(self):
        c = self.center_rewards_coefficient
        if c is not None and not (math.isfinite(c) and c >= 0):
            raise ConfigError(f"center_rewards_coefficient: must be a number >= 0 or null (got {c!r})")


@dataclass
class _Targets:
    """One micro-batch's scored tokens (flat positions: chosen rewards, then rejected) and margins."""

    positions: Tensor  # [2 x pairs]
    margins: Tensor  # [pairs] float32


def reward_loss(cfg: RewardConfig, chosen: Tensor, rejected: Tensor, margins: Tensor) -> Tensor:
    """TRL RewardTrainer.compute_loss's loss of one batch of pairs' rewards."""
    loss = -F.logsigmoid(chosen - rejected - margins).mean()
    if cfg.center_rewards_coefficient is not None:
        loss = loss + cfg.center_rewards_coefficient * torch.mean((chosen + rejected) ** 2)
    return loss


def reward_metrics(chosen: Tensor, rejected: Tensor) -> dict[str, float]:
    """TRL RewardTrainer's metrics of one batch of pairs' rewards."""
    both = torch.cat([chosen, rejected])
    return {
        "min_reward": both.min().item(),
        "mean_reward": both.mean().item(),
        "max_reward": both.max().item(),
        "accuracy": (chosen > rejected).float().mean().item(),
        "margin": (chosen - rejected).mean().item(),
    }


class Reward(Objective):
    """The reward model's loss of `cfg` over micro-batches of scored pairs."""

    extremes = {"min_reward": "min", "max_reward": "max"}

    def __init__(self, cfg: RewardConfig):
        self.cfg = cfg

    def targets(self, mb: MicroBatch, device: torch.device) -> _Targets:
        if mb.slots is None or mb.units is None or mb.extra is None:
            raise ValueError("stage rm needs micro-batches of scored pairs (slots, margins)")
        slots = mb.slots.reshape(-1)
        at = (slots >= 0).nonzero().squeeze(-1)
        positions = torch.empty(2 * len(mb.units), dtype=torch.long)
        positions[slots[at]] = at  # slot code x pairs + pair: chosen rewards first
        return _Targets(positions.to(device), mb.extra[:, 0].to(device, torch.float32))

    def count(self, mb: MicroBatch) -> int:
        return 1

    def rewards(self, head: Head, scored: list[Tensor]) -> list[Tensor]:
        """Each micro-batch's rewards, from the hidden states of its scored tokens."""
        out = [torch.empty(x.shape[0], device=x.device) for x in scored]
        for m, a, logits in head.forward(scored):
            out[m][a : a + logits.shape[0]] = logits[:, 0]
        return out

    def loss_and_grads(
        self, head: Head, hidden: list[Tensor], targets: list[_Targets], total: int
    ) -> tuple[Tensor, list[Tensor]]:
        scored = [_gather(x, t) for x, t in zip(hidden, targets)]
        loss, weights = head.loss_sum, []  # the step's running sum (`Head.loss_sum`)
        for r, t in zip(self.rewards(head, scored), targets):
            r = r.detach().requires_grad_()
            with torch.enable_grad():
                value = reward_loss(self.cfg, *r.chunk(2), t.margins)
            (w,) = torch.autograd.grad(value / total, r)
            loss += value.detach()
            weights.append(w)
            self.record(reward_metrics(*r.detach().chunk(2)))

        def chunk_loss(m: int, a: int, logits: Tensor):
            term = (weights[m][a : a + logits.shape[0]] * logits[:, 0]).sum()
            return term, None

        _, d_scored = head.backward(scored, chunk_loss)
        return loss / total, [_scatter(x, t, d) for x, t, d in zip(hidden, targets, d_scored)]

    def loss_sum(self, head: Head, hidden: list[Tensor], targets: list[_Targets]) -> Tensor:
        loss = torch.zeros((), device=head.W.device)
        for r, t in zip(self.rewards(head, [_gather(x, t) for x, t in zip(hidden, targets)]), targets):
            chosen, rejected = r.chunk(2)
            loss += reward_loss(self.cfg, chosen, rejected, t.margins)
            self.record(reward_metrics(chosen, rejected))
        return loss


def _gather(hidden: Tensor, t: _Targets) -> Tensor:
    """The hidden states of a micro-batch's scored tokens, [2 x pairs, hidden]."""
    return hidden.reshape(-1, hidden.shape[-1])[t.positions]


def _scatter(hidden: Tensor, t: _Targets, d: Tensor) -> Tensor:
    """The gradient w.r.t. a micro-batch's hidden states: the scored tokens' `d`, 0 elsewhere."""
    out = torch.zeros_like(hidden).reshape(-1, hidden.shape[-1])
    out[t.positions] = d
    return out.view(hidden.shape)
