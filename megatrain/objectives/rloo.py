"""REINFORCE leave-one-out (RLOO, `stage: rloo`): TRL 1.16's RLOOTrainer over the completions that
GRPO's rollouts sample (rl/rollout.py), with its names, defaults and metrics.

A completion's reward is the reward functions' weighted sum (NaN where every function gave None:
unscorable), clipped to reward_clip_range, less beta x its KL to the reference policy summed over
its tokens, each token's the first-order log ratio logp_old - ref (TRL's: RLOO's KL is a penalty
in the reward, not a term of the loss). Its advantage is its reward less the mean of its group's
other scorable rewards; normalize_advantages scales them over the generation batch; an unscorable
completion, or the only scorable one of its group, has advantage 0. The loss is per completion,
over its summed log-probs at logits / temperature:

    -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A),   r = exp(sum logp - sum logp_old)

averaged over a micro-batch's completions, then over the step's micro-batches and ranks (TRL's
accumulation). It couples a completion's tokens, so `loss_and_grads` takes two passes over the
head, as sequence_sums.py does: forward for each completion's sum, then the loss and its
derivative w for each completion, then `Head.backward` with each chunk's term the sum of w x logp.

Metrics (TRL's): `entropy` a micro-batch's mean over its completion tokens, and `clip_ratio/
low_mean`, `high_mean`, `region_mean`, `low_min`, `high_max` the mean, least and most over its
completions of where the clip binds, each over every rank's micro-batch of its place in the step,
then averaged over the step; `kl` (beta > 0) the generation batch's mean over its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from ..data.batch import IGNORE_INDEX, MicroBatch
from ..errors import ConfigError
from .grpo import GRPO, OLD_LOGP, REF_LOGP, STD_EPS, GRPOConfig, _Targets, log_probs, weighted_rewards
from .logprobs import entropy
from .losshead import Head


@dataclass
class RLOOConfig(GRPOConfig):
    """The keys of RLOO: GRPO's sampling and generation batch, TRL 1.16 RLOOConfig's defaults."""

    num_generations: int = 2
    max_completion_length: int | None = 512
    beta: float = 0.05
    """The KL penalty's coefficient in the reward (0: no reference policy)."""
    normalize_advantages: bool = False
    """Advantages scaled to mean 0 and std 1 over the generation batch's scorable completions."""
    reward_clip_range: list[float] | None = None
    """[low, high]: each completion's reward clamped to it (before the KL penalty)."""

    @property
    def couples_micro_batches(self) -> str:
        return ""  # RLOO's loss takes no sampler metrics (GRPO's `_per_completion`)

    def __post_init__(self):
        if self.beta < 0:
            raise ConfigError(f"beta: must be >= 0 with stage rloo (0: no KL penalty) (got {self.beta!r})")
        r = self.reward_clip_range
        if r is not None and (len(r) != 2 or not r[0] <= r[1]):
            raise ConfigError(f"reward_clip_range: must be [low, high] with low <= high (got {r!r})")
        super().__post_init__()

    @property
    def needs_old_logps(self) -> bool:
        """GRPO's test, or the KL penalty (the sampling policy's log-probs less the reference's)."""
        return super().needs_old_logps or self.needs_reference


def nanstd(x: Tensor, dim: int | None = None) -> Tensor:
    """TRL's nanstd: the unbiased standard deviation of the non-NaN values (NaN for fewer than 2)."""
    keep = dict(dim=dim, keepdim=True) if dim is not None else {}
    mean = x.nanmean(**keep)
    count = (~x.isnan()).sum(**keep)
    var = ((x - mean) ** 2).nanmean(**keep) * torch.where(count > 1, count / (count - 1), torch.nan)
    var = var.squeeze(dim) if dim is not None else var.squeeze()
    return var.sqrt()


def sequence_kl(batches: list[MicroBatch]) -> Tensor:
    """[rows of every micro-batch, 2]: each completion's KL to the reference summed over its tokens
    in the loss, sum(logp_old - ref) (`MicroBatch.token_extra`), and how many tokens it has."""
    out = []
    for mb in batches:
        mask = (mb.shifted_labels != IGNORE_INDEX).float()
        kl = mb.token_extra[..., OLD_LOGP] - mb.token_extra[..., REF_LOGP]
        out.append(torch.stack([(kl * mask).sum(1), mask.sum(1)], 1).double())
    return torch.cat(out) if out else torch.zeros(0, 2, dtype=torch.float64)


def advantages(
    cfg: RLOOConfig, rewards_per_func: Tensor, group: int | None = None, kl: Tensor | None = None
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """(rewards, advantages, metrics) of a generation batch, TRL's `_generate_and_score_completions`:
    `rewards_per_func` [completions, functions] (NaN where a function gave None), groups of `group`
    (default num_generations) consecutive rows, `kl` each completion's `sequence_kl` (beta > 0)."""
    g = group or cfg.num_generations
    unscorable = rewards_per_func.isnan().all(1)
    logged = weighted_rewards(cfg, rewards_per_func)
    logged[unscorable] = torch.nan
    rewards = logged
    if cfg.reward_clip_range:
        rewards = rewards.clamp(*cfg.reward_clip_range)
    if kl is not None:
        rewards = rewards - cfg.beta * kl[:, 0]
    grouped = rewards.view(-1, g)
    std = nanstd(grouped, 1) if g > 1 else torch.zeros(len(grouped), dtype=rewards.dtype)
    if g > 1:  # a group of one scorable completion: 0 / 0, NaN, then 0
        count = (~grouped.isnan()).sum(1, keepdim=True)
        baseline = (grouped.nansum(1, keepdim=True) - grouped) / (count - 1)
        adv = rewards - baseline.view(-1)
    else:
        adv = torch.zeros_like(rewards)
    if cfg.normalize_advantages:
        adv = (adv - adv.nanmean()) / (nanstd(adv) + STD_EPS)
    metrics = {
        "reward": float(logged.nanmean()),
        "reward_std": float(nanstd(logged)),
        "frac_reward_zero_std": float(torch.isclose(std, torch.zeros_like(std)).float().mean()),
    }
    if kl is not None:
        metrics["kl"] = float(kl[:, 0].sum() / kl[:, 1].sum().clamp(min=1.0))
    return rewards, adv.nan_to_num(nan=0.0), metrics


# ------------------------------------------------------------------------ the objective
# A micro-batch's sums, in this order: the metrics' numerators and denominators.
SUMS = ("entropy", "tokens", "rows", "low", "high", "region")


def batch_metrics(ranks: list[list[float]]) -> dict[str, float]:
    """TRL's loss metrics of one micro-batch from every rank's SUMS of it: the entropy's mean over
    their tokens, the clip's mean, least and most over their completions."""
    s = dict(zip(SUMS, torch.tensor(ranks, dtype=torch.float64).sum(0).tolist()))
    rows = max(s["rows"], 1.0)
    return {
        "entropy": s["entropy"] / max(s["tokens"], 1.0),
        "clip_ratio/low_mean": s["low"] / rows,
        "clip_ratio/low_min": float(s["low"] == s["rows"] > 0),
        "clip_ratio/high_mean": s["high"] / rows,
        "clip_ratio/high_max": float(s["high"] > 0),
        "clip_ratio/region_mean": s["region"] / rows,
    }


def eval_metrics(cfg: RLOOConfig, ranks: list[list[tuple[int, list[float]]]]) -> dict[str, float]:
    """TRL's loss metrics at an evaluation from every rank's eval micro-batches, each (its rows,
    its `RLOO.eval_sums` row): `loss` the mean of their losses weighted by their rows (the
    Trainer's eval_loss), the others `batch_metrics` of each place over the ranks, averaged over
    the places. Empty where there is no eval completion."""
    every = [x for rank in ranks for x in rank]
    if not every:
        return {}
    out = {"loss": sum(n * s[0] for n, s in every) / sum(n for n, _ in every)}
    places = [batch_metrics([r[i][1][1:] for r in ranks if i < len(r)]) for i in range(max(map(len, ranks)))]
    return out | {k: sum(p[k] for p in places) / len(places) for k in places[0]}


@dataclass
class _Rows(_Targets):
    rows: int = 0  # the micro-batch's completions (its rows)

    def sums(self, token_values: Tensor) -> Tensor:
        """[rows] each completion's sum of `token_values` ([N], flat as the targets) over its tokens."""
        return (token_values * self.mask).view(self.rows, -1).sum(1)


class RLOO(GRPO):
    """TRL's RLOO loss over micro-batches of sampled completions (GRPO's: each row prompt +
    completion, `MicroBatch.extra[:, 0]` its advantage, `token_extra` the sampling and reference
    policies' log-probs where the config needs them), per completion."""

    cfg: RLOOConfig

    def targets(self, mb: MicroBatch, device: torch.device) -> _Rows:
        return _Rows(**vars(super().targets(mb, device)), rows=mb.input_ids.shape[0])

    def count(self, mb: MicroBatch) -> int:
        return mb.input_ids.shape[0]

    @torch.no_grad()
    def _forward(self, head: Head, hidden: list[Tensor], targets: list[_Rows]) -> list[tuple[Tensor, Tensor]]:
        """Each micro-batch's (per-token log-probs, flat as its targets; entropy summed over its
        completion tokens), in the chunks of `Head.backward`."""
        out = [(torch.zeros_like(t.mask), torch.zeros((), device=head.W.device)) for t in targets]
        for m, a, logits in head.forward(hidden):
            t, n = targets[m], logits.shape[0]
            z, logp = log_probs(logits, t.tokens[a : a + n], self.cfg.temperature)
            out[m][0][a : a + n] = logp
            out[m][1].add_((entropy(z) * t.mask[a : a + n]).sum())
        return out

    def _loss(self, t: _Rows, logps: Tensor, own_old: bool) -> tuple[Tensor, Tensor, Tensor]:
        """(the micro-batch's loss, its derivative w.r.t. each completion's summed log-prob, the
        [low, high, region] counts of its completions where the clip binds); the ratio's
        denominator the stored sampling policy's, or (`own_old`, or none stored) the policy's own."""
        cfg, adv = self.cfg, t.adv.view(t.rows, -1)[:, 0]
        s = t.sums(logps).requires_grad_()
        old = s.detach() if own_old or t.old is None else t.sums(t.old)
        with torch.enable_grad():
            ratio = torch.exp(s - old)
            low, high = 1 - cfg.epsilon, 1 + cfg.epsilon_high
            loss = -torch.min(ratio * adv, torch.clamp(ratio, low, high) * adv).mean()
            (w,) = torch.autograd.grad(loss, s)
        below, above = (ratio < low) & (adv < 0), (ratio > high) & (adv > 0)
        clips = torch.stack([below.sum(), above.sum(), (below | above).sum()]).float()
        return loss.detach(), w, clips

    def loss_and_grads(self, head: Head, hidden: list[Tensor], targets: list[_Rows], total: int):
        forward = self._forward(head, hidden, targets)
        loss, weights, sums = head.loss_sum, [], []  # the step's running sum (`Head.loss_sum`)
        for t, (logps, ent) in zip(targets, forward):
            value, w, clips = self._loss(t, logps, own_old=False)
            loss += value / self.micro_batches
            weights.append(w / self.micro_batches)
            sums.append([float(ent), float(t.mask.sum()), float(t.rows), *clips.tolist()])

        def chunk_loss(m: int, a: int, logits: Tensor):
            t, n = targets[m], logits.shape[0]
            logp = log_probs(logits, t.tokens[a : a + n], self.cfg.temperature)[1]
            row = torch.arange(a, a + n, device=logits.device) // (len(t.mask) // t.rows)
            term = (weights[m][row] * t.mask[a : a + n] * logp).sum()
            return term, None

        _, dh = head.backward(hidden, chunk_loss)
        ranks = self.collective.each(sums) if self.collective is not None else [sums]
        for m in range(len(targets)):
            self.record(batch_metrics([r[m] for r in ranks]))
        return loss, dh

    @torch.no_grad()
    def eval_sums(self, head: Head, hidden: list[Tensor], targets: list[_Rows]) -> Tensor:
        """Forward only, TRL's evaluation (`prediction_step`): each micro-batch's [loss, SUMS]
        with the policy as its own sampling policy (the ratio is 1), not accumulated."""
        out = []
        for t, (logps, ent) in zip(targets, self._forward(head, hidden, targets)):
            value, _, clips = self._loss(t, logps, own_old=True)
            rows = value.new_tensor(float(t.rows))
            out.append(torch.cat([torch.stack([value, ent, t.mask.sum(), rows]), clips]))
        return torch.stack(out) if out else torch.zeros(0, 1 + len(SUMS))

    def loss_sum(self, head: Head, hidden: list[Tensor], targets: list[_Rows]) -> Tensor:
        """Forward only: the completions' losses summed (over `count`, the rows: their mean)."""
        loss = torch.zeros((), device=head.W.device)
        for t, (logps, _) in zip(targets, self._forward(head, hidden, targets)):
            loss += self._loss(t, logps, own_old=False)[0] * t.rows
        return loss
