"""Group-relative policy optimisation (GRPO): TRL 0.27's GRPOTrainer loss over completions that
megatrain sampled itself, with its names, defaults and metrics.

Each prompt is sampled `num_generations` times; a completion's reward is the weighted sum of the
reward functions' (rewards.py); its advantage is its reward less its group's mean, over the
group's standard deviation (`scale_rewards: group`), the batch's (`batch`) or not scaled
(`none`). Every completion token then has the loss

    -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A),   r = pi(token) / pi_old(token),

pi the policy's probability of the token at logits / temperature, pi_old the sampling policy's
(with `num_iterations` 1, the policy itself: r is 1 with the policy's gradient). The per-token
losses are aggregated as `loss_type` says: `grpo` the mean over each completion's tokens, then
over completions; `bnpo` over a micro-batch's tokens; `dr_grpo` over completions x
max_completion_length; `dapo` (TRL's default) over every completion token of the step; the
first three then averaged over the step's micro-batches, as TRL's gradient accumulation does.

Not built yet: `beta` > 0 (a KL term to the initial policy, which needs its per-token log-probs)
and `num_iterations` > 1 (reusing a rollout with its stored log-probs); both are refused in one
line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import torch
from torch import Tensor

from ..data.batch import IGNORE_INDEX, MicroBatch
from ..errors import ConfigError
from .base import Objective
from .losshead import Head

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


@dataclass
class GRPOConfig:
    """The keys of GRPO, TRL 0.27's names and defaults."""

    num_generations: int = 8
    """Completions sampled per prompt (a group)."""
    max_completion_length: int | None = 256
    """Tokens a completion may have; one cut there is truncated (`completions/clipped_ratio`)."""
    temperature: float = 1.0
    """Sampling temperature; the loss takes the logits divided by it too."""
    top_p: float = 1.0
    top_k: int | None = None
    """None or 0: no top-k."""
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float | None = None
    """The clip's upper bound (None: epsilon)."""
    beta: float = 0.0
    """KL coefficient to the initial policy (0: no reference; > 0 not built yet)."""
    scale_rewards: str | bool = "group"
    mask_truncated_completions: bool = False
    """Leave completions cut at max_completion_length out of the loss."""
    num_iterations: int = 1
    reward_weights: list[float] | None = None

    def __post_init__(self):
        def bad(key, why):
            raise ConfigError(f"{key}: {why} (got {getattr(self, key)!r})")

        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                bad(f.name, "must be a finite number")
        if self.num_generations < 2:
            bad("num_generations", "must be >= 2 (advantages compare completions of one prompt)")
        if self.max_completion_length is None or self.max_completion_length < 1:
            bad("max_completion_length", "must be a number of tokens >= 1 for grpo")
        if self.temperature <= 0:
            bad("temperature", "must be > 0")
        if not 0 < self.top_p <= 1:
            bad("top_p", "must be in (0, 1]")
        if self.top_k is not None and self.top_k < 0:
            bad("top_k", "must be >= 0 (0: off)")
        if self.loss_type not in LOSS_TYPES:
            bad("loss_type", f"must be one of {', '.join(LOSS_TYPES)} with stage grpo")
        if self.epsilon_high is None:
            self.epsilon_high = self.epsilon
        if not 0 <= self.epsilon < 1 or self.epsilon_high < 0:
            bad("epsilon", "must be in [0, 1), epsilon_high >= 0")
        if self.scale_rewards is True:
            self.scale_rewards = "group"
        if self.scale_rewards is False:
            self.scale_rewards = "none"
        if self.scale_rewards not in SCALE_REWARDS:
            bad("scale_rewards", f"must be one of {', '.join(SCALE_REWARDS)}")
        if self.beta != 0:
            bad("beta", "a KL term (beta > 0) is not supported yet with stage grpo; use 0 (TRL's default)")
        if self.num_iterations != 1:
            bad("num_iterations", "reusing a rollout (num_iterations > 1) is not supported yet; use 1")


# ------------------------------------------------------------------------ advantages
def advantages(cfg: GRPOConfig, rewards_per_func: Tensor) -> tuple[Tensor, Tensor, dict[str, float]]:
    """(rewards, advantages, metrics) of a generation batch: `rewards_per_func` [completions,
    functions] (NaN where a function gave None), groups of num_generations consecutive rows."""
    n, k = rewards_per_func.shape
    weights = torch.tensor(cfg.reward_weights or [1.0] * k, dtype=rewards_per_func.dtype)
    if len(weights) != k:
        raise ConfigError(f"reward_weights: needs one weight per reward function ({k}), got {len(weights)}")
    rewards = (rewards_per_func * weights[None]).nansum(1)
    grouped = rewards.view(-1, cfg.num_generations)
    mean = grouped.mean(1).repeat_interleave(cfg.num_generations)
    group_std = grouped.std(1).repeat_interleave(cfg.num_generations)
    std = rewards.std().expand_as(rewards) if cfg.scale_rewards == "batch" else group_std
    adv = rewards - mean
    if cfg.scale_rewards != "none":
        adv = adv / (std + STD_EPS)
    metrics = {
        "reward": float(rewards.mean()),
        "reward_std": float(std.mean()),
        "frac_reward_zero_std": float((group_std < 1e-6).float().mean()),
    }
    return rewards, adv, metrics


# ------------------------------------------------------------------------ the objective
@dataclass
class _Targets:
    tokens: Tensor  # [N] the token each position predicts
    mask: Tensor  # [N] float: 1 on completion tokens in the loss
    adv: Tensor  # [N] each token's completion's advantage
    weight: Tensor  # [N] each token's share of its micro-batch's aggregate (not dapo)
    tokens_in_mb: int


class GRPO(Objective):
    """TRL's GRPO loss over micro-batches of sampled completions: each row is prompt +
    completion, labels on the completion tokens in the loss, `MicroBatch.extra[:, 0]` its
    advantage. `micro_batches` is the step's count over every rank (TRL's accumulation)."""

    empty_step_ok = True  # every completion masked (mask_truncated_completions): TRL's loss is 0

    def __init__(self, cfg: GRPOConfig, micro_batches: int):
        self.cfg, self.micro_batches = cfg, micro_batches

    def targets(self, mb: MicroBatch, device: torch.device) -> _Targets:
        labels = mb.shifted_labels
        mask = (labels != IGNORE_INDEX).float()
        rows = labels.shape[0]
        adv = mb.extra[:, 0].float()[:, None].expand_as(mask)
        lengths = mask.sum(1, keepdim=True).clamp(min=1)
        if self.cfg.loss_type == "grpo":
            weight = 1 / (lengths * rows)
        elif self.cfg.loss_type == "bnpo":
            weight = torch.full_like(mask, 1 / max(float(mask.sum()), 1.0))
        elif self.cfg.loss_type == "dr_grpo":
            weight = torch.full_like(mask, 1 / (rows * self.cfg.max_completion_length))
        else:
            weight = torch.ones_like(mask)  # dapo: over the step's tokens, known at the loss
        weight = weight.expand_as(mask)

        def dev(t):
            return t.reshape(-1).to(device, non_blocking=True)

        return _Targets(dev(labels.clamp(min=0)), dev(mask), dev(adv), dev(weight), int(mask.sum()))

    def count(self, mb: MicroBatch) -> int:
        return mb.num_label_tokens  # dapo's normaliser: every completion token of the step

    def _scale(self, total: int) -> float:
        """What each micro-batch's aggregate is divided by over the step."""
        return max(total, 1) if self.cfg.loss_type == "dapo" else self.micro_batches

    def _chunk(self, t: _Targets, a: int, logits: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """(the chunk's loss, its entropy sum, its clipped-token count) over its completion tokens."""
        n = logits.shape[0]
        temp = self.cfg.temperature
        logp_all = torch.log_softmax(logits if temp == 1 else logits / temp, -1)
        logp = logp_all.gather(-1, t.tokens[a : a + n, None]).squeeze(-1)
        ratio = torch.exp(logp - logp.detach())  # num_iterations 1: the sampling policy is this one
        adv, mask = t.adv[a : a + n], t.mask[a : a + n]
        clipped = torch.clamp(ratio, 1 - self.cfg.epsilon, 1 + self.cfg.epsilon_high)
        per_token = -torch.min(ratio * adv, clipped * adv)
        loss = (per_token * mask * t.weight[a : a + n]).sum() / scale
        with torch.no_grad():  # one more chunk x vocab tensor, reused in place
            entropy = -logp_all.exp().mul_(logp_all).sum(-1)
            out = ((ratio < 1 - self.cfg.epsilon) | (ratio > 1 + self.cfg.epsilon_high)).float()
        return loss, (entropy * mask).sum(), (out * mask).sum()

    def loss_and_grads(self, head: Head, hidden: list[Tensor], targets: list[_Targets], total: int):
        scale = self._scale(total)
        stats = torch.zeros(2, device=head.W.device)

        def chunk_loss(m: int, a: int, logits: Tensor):
            loss, entropy, clipped = self._chunk(targets[m], a, logits, scale)
            stats[0] += entropy
            stats[1] += clipped
            return loss, loss.detach()

        loss, dh = head.backward(hidden, chunk_loss)
        tokens = max(sum(t.tokens_in_mb for t in targets), 1)
        self.record({"entropy": float(stats[0]) / tokens, "clip_ratio/region_mean": float(stats[1]) / tokens})
        return loss, dh

    def loss_sum(self, head: Head, hidden: list[Tensor], targets: list[_Targets]) -> Tensor:
        loss = torch.zeros((), device=head.W.device)
        for m, a, logits in head.forward(hidden):
            loss += self._chunk(targets[m], a, logits, 1.0)[0]
        return loss
