"""Group-relative policy optimisation (GRPO): TRL 1.16's GRPOTrainer loss over completions that
megatrain sampled itself, with its names, defaults and metrics.

Each prompt is sampled `num_generations` times; a completion's reward is the weighted sum of the
reward functions' (rl/rewards.py); its advantage is its reward less its group's mean, over the
group's standard deviation (`scale_rewards: group`), the batch's (`batch`) or not scaled
(`none`). Every completion token then has the loss

    -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta * r * kl,   r = pi(token) / pi_old(token),
    kl = exp(ref - logp) - (ref - logp) - 1,

(the KL term without r where use_bias_correction_kl is false, TRL 0.x's),
logp = log pi(token), pi the policy's probability of the token at logits / temperature, pi_old
the sampling policy's, ref the reference policy's log-probability (the initial policy's, or
ref_model_name_or_path's). A generation batch (a rollout) is split into `steps_per_generation`
micro-batches and trained on `num_iterations` times; where all of that happens inside one
optimizer step, pi_old is the policy itself (r is 1 with the policy's gradient), else its
log-probs were computed once after sampling (MicroBatch.token_extra, column OLD_LOGP), so r is 1
until the policy moves and the clip acts after. The per-token losses are aggregated as
`loss_type` says: `grpo` the mean over each completion's tokens, then over completions; `bnpo`
over a micro-batch's tokens; `dr_grpo` over completions x max_completion_length; the three then
averaged over the step's micro-batches, as TRL's gradient accumulation does; `dapo` (TRL's
default) summed over the step's completion tokens and divided by its generation batch's
completion tokens per optimizer step (MicroBatch.extra, column TOKENS_PER_STEP): with one
generation batch a step, TRL's default, every completion token of the step.

Where the generation batch was sampled by the weights of one step before (`max_staleness: 1`),
each token's policy term is weighted as TRL weights vLLM's samples (offpolicy.py), with the
sampler's log-probs from the rollout (MicroBatch.token_extra, column SAMPLER_LOGP); TRL's
off-policy mask (`off_policy_mask_threshold`) applies in either mode.

The metrics are TRL's, each the mean over the completion tokens of a micro-batch and its
counterparts on the other ranks, averaged over the step's micro-batches: `entropy`, `kl`
(beta > 0), `clip_ratio/low_mean` (r below 1 - epsilon where A < 0), `clip_ratio/high_mean`
(r above 1 + epsilon_high where A > 0), `clip_ratio/region_mean` (either), and
`clip_ratio/low_min`, `clip_ratio/high_max`, the least and most of a completion's own ratio.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

import torch
from torch import Tensor

from ..data.batch import IGNORE_INDEX, MicroBatch
from ..errors import ConfigError
from .base import Objective
from .logprobs import entropy, log_normaliser, token_logps
from .losshead import Head
from .offpolicy import IS_MODES, factors, needs_policy, sampling_ratio, step_metrics

LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo")
# The columns of MicroBatch.token_extra: the sampling policy's log-probs (computed by the trainer),
# the reference's, and the sampler's own (max_staleness: 1; rl/decode.py).
OLD_LOGP, REF_LOGP, SAMPLER_LOGP = 0, 1, 2
ADVANTAGE, TOKENS_PER_STEP = 0, 1  # the columns of MicroBatch.extra (rows: completions)
SCALE_REWARDS = ("group", "batch", "none")
STD_EPS = 1e-4  # TRL's: advantages / (std + 1e-4)


@dataclass
class GRPOConfig:
    """The keys of GRPO, TRL 1.16's names and defaults."""

    num_generations: int = 8
    """Completions sampled per prompt (a group)."""
    num_generations_eval: int | None = None
    """Completions sampled per eval prompt (None: num_generations; 1: a group's std is 0)."""
    max_completion_length: int | None = 512
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
    """The KL term's coefficient (0: no reference policy)."""
    use_bias_correction_kl: bool = True
    """Weight each token's KL term by the importance ratio r (TRL 1.x's default; false: TRL 0.x's
    unweighted term)."""
    scale_rewards: str | bool = "group"
    mask_truncated_completions: bool = False
    """Leave completions cut at max_completion_length out of the loss."""
    num_iterations: int = 1
    """Times each generation batch is trained on."""
    share_prompts: bool = False
    """The update computes each prompt its rows share once (data/shared.py), not once a row."""
    max_staleness: int = 0
    """0: each generation batch sampled by the weights its first step starts from; 1: by those of
    the step before (rl/rollout.py), corrected as TRL corrects vLLM's sampler (offpolicy.py)."""
    vllm_importance_sampling_correction: bool = True
    vllm_importance_sampling_mode: str = "sequence_mask"
    vllm_importance_sampling_clip_max: float | None = 3.0
    vllm_importance_sampling_clip_min: float | None = None
    off_policy_mask_threshold: float | None = None
    """Drop completions with A < 0 whose mean KL from the sampler exceeds it (None: off)."""
    reward_weights: list[float] | None = None
    generation_batch_size: int | None = None
    """Completions sampled at a time over every process (TRL's; default: per_device_train_batch_size
    x processes x steps_per_generation)."""
    steps_per_generation: int | None = None
    """Micro-batches a generation batch is split into (TRL's; default gradient_accumulation_steps:
    one generation an optimizer step)."""
    # The step's shape, which the generation batch is counted in: the training config's keys
    # (TrainConfig.grpo), here with TRL's GRPOConfig defaults.
    per_device_train_batch_size: int = 8
    gradient_accumulation_steps: int = 1
    processes: int = 1
    """The data-parallel world's processes (not a key: the run's)."""

    def __post_init__(self):
        def bad(key, why):
            raise ConfigError(f"{key}: {why} (got {getattr(self, key)!r})")

        for f in fields(self):
            v = getattr(self, f.name)
            if isinstance(v, float) and not math.isfinite(v):
                bad(f.name, "must be a finite number")
        if self.num_generations < 2:
            bad("num_generations", "must be >= 2 (advantages compare completions of one prompt)")
        if self.num_generations_eval is None:
            self.num_generations_eval = self.num_generations
        if self.num_generations_eval < 1:
            bad("num_generations_eval", "must be >= 1")
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
        if self.beta < 0:
            bad("beta", "must be >= 0 with stage grpo (0: no KL term)")
        if self.num_iterations < 1:
            bad("num_iterations", "must be >= 1")
        if self.max_staleness not in (0, 1):
            bad(
                "max_staleness",
                "must be 0 (on-policy) or 1 (the weights of one step before); more is not built",
            )
        if self.vllm_importance_sampling_mode not in IS_MODES:
            bad("vllm_importance_sampling_mode", f"must be one of {', '.join(IS_MODES)}")
        self._generation_batch(bad)

    def _generation_batch(self, bad) -> None:
        """generation_batch_size and steps_per_generation from each other, as TRL derives them:
        one of the two, or neither (one generation batch an optimizer step)."""
        b, world = self.per_device_train_batch_size, self.per_device_train_batch_size * self.processes
        if self.generation_batch_size is not None and self.steps_per_generation is not None:
            bad("steps_per_generation", "cannot be set with generation_batch_size (set one of the two)")
        if self.generation_batch_size is not None:
            if self.generation_batch_size < 1 or self.generation_batch_size % world:
                bad("generation_batch_size", f"must be a multiple of per_device_train_batch_size x processes "
                    f"({b} x {self.processes} = {world})")  # fmt: skip
            self.steps_per_generation = self.generation_batch_size // world
        if self.steps_per_generation is None:
            self.steps_per_generation = self.gradient_accumulation_steps
        if self.steps_per_generation < 1:
            bad("steps_per_generation", "must be >= 1")
        self.generation_batch_size = world * self.steps_per_generation
        if (b * self.steps_per_generation) % self.num_generations:
            bad("num_generations", f"must divide the completions a process samples at a time, "
                f"per_device_train_batch_size x steps_per_generation ({b} x {self.steps_per_generation})")  # fmt: skip

    @property
    def micro_batches_per_generation(self) -> int:
        """The micro-batches trained on one generation batch: its steps_per_generation slices,
        num_iterations times."""
        return self.steps_per_generation * self.num_iterations

    @property
    def needs_old_logps(self) -> bool:
        """Whether a rollout carries the sampling policy's log-probs: where some generation batch
        is trained on by more than one optimizer step (reused, or split over steps), so the policy
        moves between its sampling and some of its micro-batches (TRL's test)."""
        return self.gradient_accumulation_steps % self.micro_batches_per_generation > 0

    @property
    def stale(self) -> bool:
        """Whether generation batches are sampled by the weights of one step before (their
        per-token log-probs under the sampler carried with them)."""
        return self.max_staleness > 0

    @property
    def corrects(self) -> bool:
        """Whether the loss corrects the stale sampler (TRL's importance sampling)."""
        return self.stale and self.vllm_importance_sampling_correction

    @property
    def needs_reference(self) -> bool:
        """Whether a rollout carries the reference policy's log-probs (the KL term)."""
        return self.beta > 0

    @property
    def couples_micro_batches(self) -> str:
        """Why GRPO's loss of a step cannot be taken a micro-batch at a time ("": it can;
        `Objective.coupled`): a stale generation batch trained within its step takes TRL's
        sampler metrics over the step's micro-batches at once (offpolicy.step_metrics)."""
        if self.corrects and not self.needs_old_logps:
            return "max_staleness: 1 with the sampler's correction takes its metrics over the step at once"
        if self.share_prompts:
            return "share_prompts lays out the step's micro-batches at once"
        return ""


def reference_copy_bytes(num_params: int, compute_bytes: int, grpo: GRPOConfig | None) -> int:
    """Host memory of the reference policy's weights a run keeps (stages.grpo_reference), per
    process: the compute dtype's copy of every parameter where grpo (`TrainConfig.grpo()`, None
    for the other stages) has a KL term, else 0."""
    return num_params * compute_bytes if grpo is not None and grpo.needs_reference else 0


def log_probs(logits: Tensor, tokens: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(logits / temperature, their log-prob at each token): TRL's per-token log-probs, taken as
    every objective takes them (logprobs.py)."""
    z = tempered(logits, temperature)
    return z, token_logps(z, tokens)


def tempered(logits: Tensor, temperature: float) -> Tensor:
    """The logits the policy samples from and the loss scores: logits / temperature."""
    return logits if temperature == 1 else logits / temperature


# ------------------------------------------------------------------------ advantages
def weighted_rewards(cfg: GRPOConfig, rewards_per_func: Tensor) -> Tensor:
    """Each completion's reward: `rewards_per_func` [completions, functions] weighted by
    reward_weights and summed, a function's None (NaN) counting 0 (TRL's nansum)."""
    k = rewards_per_func.shape[1]
    weights = torch.tensor(cfg.reward_weights or [1.0] * k, dtype=rewards_per_func.dtype)
    if len(weights) != k:
        raise ConfigError(f"reward_weights: needs one weight per reward function ({k}), got {len(weights)}")
    return (rewards_per_func * weights[None]).nansum(1)


def advantages(
    cfg: GRPOConfig, rewards_per_func: Tensor, group: int | None = None
) -> tuple[Tensor, Tensor, dict[str, float]]:
    """(rewards, advantages, metrics) of a generation batch as TRL 1.16 takes them:
    `rewards_per_func` [completions, functions] (NaN where a function gave None), groups of `group`
    (default num_generations; an evaluation's: num_generations_eval) consecutive rows. A
    completion no function scored has a NaN reward, left out of its group's mean and std, and
    advantage 0. The std of one reward is 0 (TRL's, where an evaluation has groups of one);
    `reward_std` is the std of the whole batch's rewards."""
    n = len(rewards_per_func)
    g = group or cfg.num_generations
    rewards = weighted_rewards(cfg, rewards_per_func)
    rewards[rewards_per_func.isnan().all(1)] = math.nan
    grouped = rewards.view(-1, g)
    mean = grouped.nanmean(1).repeat_interleave(g)
    if cfg.scale_rewards == "batch":
        std = _nanstd(rewards).expand_as(rewards) if n > 1 else torch.zeros_like(rewards)
    else:
        std = _nanstd(grouped, 1).repeat_interleave(g) if g > 1 else torch.zeros_like(rewards)
    adv = rewards - mean
    if cfg.scale_rewards != "none":
        adv = adv / (std + STD_EPS)
    metrics = {
        "reward": float(rewards.nanmean()),
        "reward_std": float(_nanstd(rewards)),
        "frac_reward_zero_std": float(torch.isclose(std, torch.zeros_like(std)).float().mean()),
    }
    return rewards, adv.nan_to_num(0.0), metrics


def _nanstd(x: Tensor, dim: int | None = None) -> Tensor:
    """The unbiased std of x's non-NaN entries (over `dim`, or all), TRL's `nanstd`."""
    var = ((x - x.nanmean(dim, keepdim=True)) ** 2).nanmean(dim, keepdim=True)
    count = (~x.isnan()).sum(dim, keepdim=True)
    std = (var * count / (count - 1)).sqrt()
    return std.squeeze(dim) if dim is not None else std.reshape(())


# ------------------------------------------------------------------------ the objective
# A chunk's sums over its completion tokens, in this order (the metrics' numerators).
STATS = ("entropy", "clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean", "kl")


def eval_metrics(cfg: GRPOConfig, ranks: list[list[tuple[int, list[float]]]]) -> dict[str, float]:
    """TRL's loss metrics at an evaluation from every rank's eval micro-batches, each (its rows,
    its `GRPO.eval_sums` row): `loss` the mean of their losses weighted by their rows (the
    Trainer's eval_loss), the STATS the mean over them of their masked means (TRL's log of one
    value an eval batch), `clip_ratio/low_min` and `high_max` the least and most over the ranks
    of each micro-batch's index. Empty where there is no eval completion."""
    every = [x for rank in ranks for x in rank]
    if not every:
        return {}

    def mean(s: list[float], name: str) -> float:  # a micro-batch's masked mean of a STATS entry
        return s[2 + STATS.index(name)] / max(s[1], 1.0)

    out = {"loss": sum(n * s[0] for n, s in every) / sum(n for n, _ in every)}
    out |= {
        k: sum(mean(s, k) for _, s in every) / len(every) for k in STATS if k != "kl" or cfg.needs_reference
    }
    index = [[r[i][1] for r in ranks if i < len(r)] for i in range(max(map(len, ranks)))]
    for name, of, pick in (("clip_ratio/low_min", "clip_ratio/low_mean", min),
                           ("clip_ratio/high_max", "clip_ratio/high_mean", max)):  # fmt: skip
        out[name] = sum(pick(mean(s, of) for s in at) for at in index) / len(index)
    return out


@dataclass
class _Targets:
    tokens: Tensor  # [N] the token each position predicts
    mask: Tensor  # [N] float: 1 on completion tokens in the loss
    adv: Tensor  # [N] each token's completion's advantage
    weight: Tensor  # [N] each token's share of its micro-batch's aggregate (not dapo)
    old: Tensor | None  # [N] the sampling policy's log-prob of the token (None: the policy's own)
    ref: Tensor | None  # [N] the reference policy's (None: no KL term)
    tokens_in_mb: int
    per_step: float | None  # dapo's divisor: its generation batch's loss tokens per optimizer step
    row_tokens: Tensor  # [rows] each completion's tokens in the loss
    sampler: Tensor | None = None  # [N] the stale sampler's log-prob of the token (max_staleness: 1)
    keep: Tensor | None = None  # [rows] the off-policy mask of each completion (None: keep all)
    row_ratio: Tensor | None = None  # [rows] the sampler's correction of each (sequence modes)


class GRPO(Objective):
    """TRL's GRPO loss over micro-batches of sampled completions: each row is prompt +
    completion, labels on the completion tokens in the loss, `MicroBatch.extra[:, 0]` its
    advantage, `MicroBatch.token_extra` the sampling and reference policies' log-probs where the
    config needs them. `micro_batches` is the step's count over every rank (TRL's accumulation);
    `collective` the ranks, for the least and most clip ratios over them."""

    empty_step_ok = True  # every completion masked (mask_truncated_completions): TRL's loss is 0

    def __init__(self, cfg: GRPOConfig, micro_batches: int, collective=None):
        self.cfg, self.micro_batches, self.collective = cfg, micro_batches, collective
        self.shares_prompts = cfg.share_prompts

    @property
    def coupled(self) -> str:
        return self.cfg.couples_micro_batches

    def targets(self, mb: MicroBatch, device: torch.device) -> _Targets:
        labels = mb.shifted_labels
        mask = (labels != IGNORE_INDEX).float()
        rows = labels.shape[0]
        adv = mb.extra[:, ADVANTAGE].float()[:, None].expand_as(mask)
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

        def column(c: int, wanted: bool):  # absent while the rollout computes them (token_logps)
            return dev(mb.token_extra[..., c]) if wanted and mb.token_extra is not None else None

        old, ref = column(OLD_LOGP, self.cfg.needs_old_logps), column(REF_LOGP, self.cfg.needs_reference)
        sampled = mb.token_extra is not None and mb.token_extra.shape[-1] > SAMPLER_LOGP  # a stale rollout's
        per_step = float(mb.extra[0, TOKENS_PER_STEP]) if mb.extra.shape[1] > TOKENS_PER_STEP else None
        return _Targets(
            dev(labels.clamp(min=0)), dev(mask), dev(adv), dev(weight), old, ref, int(mask.sum()), per_step,
            mask.sum(1).to(device), column(SAMPLER_LOGP, sampled),
        )  # fmt: skip

    def count(self, mb: MicroBatch) -> int:
        return mb.num_label_tokens  # dapo's normaliser: every completion token of the step

    def _scale(self, t: _Targets, total: int) -> float:
        """What a micro-batch's aggregate is divided by: dapo, its generation batch's loss tokens
        (every rank's, at least 1) x gradient_accumulation_steps / steps_per_generation, TRL's
        normaliser (with one generation batch a step: the step's tokens; `total` where a
        checkpoint's rollout predates the column); the others, the step's micro-batches."""
        if self.cfg.loss_type != "dapo":
            return self.micro_batches
        return max(total, 1) if t.per_step is None else t.per_step

    def _chunk(self, t: _Targets, a: int, logits: Tensor, scale: float) -> tuple[Tensor, Tensor, Tensor]:
        """(the chunk's loss, its STATS summed over its completion tokens, each token's [low, high]
        clip on completion tokens)."""
        n, cfg = logits.shape[0], self.cfg
        z = tempered(logits, cfg.temperature)
        lse = log_normaliser(z)
        logp = token_logps(z, t.tokens[a : a + n], lse)
        old = logp.detach() if t.old is None else t.old[a : a + n]
        adv, mask = t.adv[a : a + n], t.mask[a : a + n]
        # Prompt and padding tokens have no stored log-probs: left out before exp, which could
        # overflow there, rather than after (inf x 0 is NaN, in the loss and its gradient).
        real = mask > 0
        ratio = torch.exp(torch.where(real, logp - old, 0.0))
        low, high = 1 - cfg.epsilon, 1 + cfg.epsilon_high
        per_token = -torch.min(ratio * adv, torch.clamp(ratio, low, high) * adv)
        if t.keep is not None or t.row_ratio is not None:  # a completion's (offpolicy.py)
            row = torch.arange(a, a + n, device=logits.device) // (len(t.mask) // len(t.row_tokens))
        if t.keep is not None:  # TRL's order: the off-policy mask, then the sampler's correction
            per_token = per_token * t.keep[row]
        if t.sampler is not None and cfg.corrects:
            per_token = per_token * (
                t.row_ratio[row]
                if t.row_ratio is not None
                else sampling_ratio(cfg, torch.nan_to_num((old - t.sampler[a : a + n]) * mask, nan=0.0))
            )
        kl = torch.zeros_like(logp)
        if t.ref is not None:
            d = torch.where(real, t.ref[a : a + n] - logp, 0.0)
            kl = torch.exp(d) - d - 1
            if cfg.use_bias_correction_kl:  # the KL of the policy, estimated on the sampler's tokens
                kl = kl * ratio
            per_token = per_token + cfg.beta * kl
        loss = (per_token * mask * t.weight[a : a + n]).sum() / scale
        with torch.no_grad():
            ent = entropy(z, lse)
            below, above = (ratio < low) & (adv < 0), (ratio > high) & (adv > 0)  # where the clip binds
            stats = torch.stack([ent, below.float(), above.float(), (below | above).float(), kl.detach()])
        return loss, stats @ mask, stats[1:3].T * mask[:, None]

    def _per_completion(self, head: Head, hidden: list[Tensor], targets: list[_Targets]) -> list[_Targets]:
        """`targets` with each completion's factors on its policy term (offpolicy.py: the
        off-policy mask, the sampler's sequence-level correction), from a forward of the head
        where they take the policy's own log-probs; where those are TRL's old ones (a stale
        generation batch trained within this step), the sampler's metrics recorded too."""
        cfg = self.cfg
        if not (cfg.off_policy_mask_threshold is not None or cfg.corrects):
            return targets
        own = [cfg.corrects and t.sampler is not None and t.old is None for t in targets]
        current = self.token_logps(head, hidden, targets) if needs_policy(cfg, targets) else None
        out = [replace(t, keep=k, row_ratio=r) for t, (k, r) in zip(targets, factors(cfg, targets, current))]
        if any(own):
            self.record(step_metrics(cfg, targets, current, self.collective))
        return out

    def loss_and_grads(self, head: Head, hidden: list[Tensor], targets: list[_Targets], total: int):
        targets = self._per_completion(head, hidden, targets)
        stats = torch.zeros(len(targets), len(STATS), device=head.W.device)
        rows = [torch.zeros(len(t.row_tokens), 2, device=head.W.device) for t in targets]

        def chunk_loss(m: int, a: int, logits: Tensor):
            t = targets[m]
            loss, sums, clips = self._chunk(t, a, logits, self._scale(t, total))
            stats[m] += sums
            width = len(t.mask) // len(t.row_tokens)  # the micro-batch's row length
            rows[m].index_add_(0, torch.arange(a, a + len(clips), device=clips.device) // width, clips)
            return loss, loss.detach()

        loss, dh = head.backward(hidden, chunk_loss)
        self._record(stats, rows, targets)
        return loss, dh

    def _record(self, stats: Tensor, rows: list[Tensor], targets: list[_Targets]) -> None:
        """Each micro-batch's metrics as TRL logs them at each forward: its STATS summed over the
        ranks' micro-batches of its place in the step, over their completion tokens; the least low
        and the most high clip ratio of a completion (its tokens' mean) over theirs."""
        tokens = [float(t.tokens_in_mb) for t in targets]
        clips = [(r / t.row_tokens[:, None])[t.row_tokens > 0].tolist() for r, t in zip(rows, targets)]
        mine = list(zip(stats.tolist(), tokens, clips))
        ranks = self.collective.each(mine) if self.collective is not None else [mine]
        for m in range(len(targets)):
            at = [r[m] for r in ranks if m < len(r)]
            count = max(sum(n for _, n, _ in at), 1.0)
            record = {k: sum(s[i] for s, _, _ in at) / count for i, k in enumerate(STATS)}
            if not self.cfg.needs_reference:
                del record["kl"]
            per_row = [c for _, _, c in at for c in c]
            if per_row:  # none: every completion masked (TRL logs NaN; megatrain leaves it out)
                record["clip_ratio/low_min"] = min(c[0] for c in per_row)
                record["clip_ratio/high_max"] = max(c[1] for c in per_row)
            self.record(record)

    @torch.no_grad()
    def token_logps(self, head: Head, hidden: list[Tensor], targets: list[_Targets]) -> list[Tensor]:
        """Forward only (`Engine.head_outputs`): each micro-batch's per-token log-probs at
        logits / temperature, flat as its targets, in the chunks of the loss: the sampling policy's
        equal the loss's first ones bit for bit."""
        out = [torch.zeros_like(t.mask) for t in targets]
        for m, a, logits in head.forward(hidden):
            n = logits.shape[0]
            out[m][a : a + n] = log_probs(logits, targets[m].tokens[a : a + n], self.cfg.temperature)[1]
        return out

    @torch.no_grad()
    def eval_sums(self, head: Head, hidden: list[Tensor], targets: list[_Targets]) -> Tensor:
        """Forward only (`Engine.head_outputs`), TRL's evaluation (`prediction_step`): each
        micro-batch's [loss, completion tokens, STATS summed over them] ([micro-batches, 2 +
        len(STATS)]) with the policy as its own sampling policy (the ratio is 1: TRL's old
        log-probs at evaluation are the policy's), the loss aggregated by loss_type over the
        micro-batch alone, not accumulated (dapo: over its own completion tokens)."""
        out = torch.zeros(len(targets), 2 + len(STATS), device=head.W.device)
        targets = self._per_completion(head, hidden, [replace(t, old=None, sampler=None) for t in targets])
        for m, a, logits in head.forward(hidden):
            t = targets[m]
            scale = max(t.tokens_in_mb, 1) if self.cfg.loss_type == "dapo" else 1.0
            loss, sums, _ = self._chunk(t, a, logits, scale)
            out[m, 0] += loss
            out[m, 2:] += sums
        out[:, 1] = torch.tensor([float(t.tokens_in_mb) for t in targets])
        return out

    def loss_sum(self, head: Head, hidden: list[Tensor], targets: list[_Targets]) -> Tensor:
        loss = torch.zeros((), device=head.W.device)
        targets = self._per_completion(head, hidden, targets)
        for m, a, logits in head.forward(hidden):
            loss += self._chunk(targets[m], a, logits, 1.0)[0]
        return loss
