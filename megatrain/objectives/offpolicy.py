"""TRL 1.16's correction of a stale sampler and its off-policy sequence mask, as formulas over
per-token log-probs (GRPOTrainer's `vllm_importance_sampling_*` and `get_off_policy_mask`), with
the metrics TRL logs for the correction.

A token has the sampler's log-prob (of the drawn token under the warped distribution the draw
used: vLLM's `processed_logprobs`) and the trainer's, `old` (the policy's at the step its
generation batch starts training: TRL's `old_per_token_logps`). The ratio is exp(old - sampler)
per token (`token_*` modes) or of the sum over a completion (`sequence_*`), truncated to
[clip_min, clip_max] or set to 0 outside them; it multiplies each token's policy term, not its KL
term. The off-policy mask (`off_policy_mask_threshold`, DeepSeek-V3.2's) drops a completion whose
advantage is negative and whose mean KL from the sampling policy to the policy, over its tokens,
exceeds the threshold. NaN differences count 0, as TRL's.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

IS_MODES = ("token_truncate", "token_mask", "sequence_truncate", "sequence_mask")
# One process's share of a generation batch's sampling metrics, in this order (`sampling_stats`).
SAMPLING_STATS = ("delta_sum", "tokens", "delta_max", "ratio_sum", "ratios", "ratio_min", "ratio_max")


def per_sequence(mode: str) -> bool:
    """Whether `vllm_importance_sampling_mode` takes one ratio a completion."""
    return mode.startswith("sequence")


def sampling_ratio(cfg, diff: Tensor) -> Tensor:
    """TRL's `vllm_importance_sampling_ratio` of `diff`, the log-prob differences old - sampler (a
    token's, or a completion's sum in the sequence modes): exp(diff) truncated to, or zeroed
    outside, [vllm_importance_sampling_clip_min, vllm_importance_sampling_clip_max] (None: no bound)."""
    ratio = torch.exp(diff)
    lo, hi = cfg.vllm_importance_sampling_clip_min, cfg.vllm_importance_sampling_clip_max
    if cfg.vllm_importance_sampling_mode.endswith("truncate"):
        return torch.clamp(ratio, min=lo, max=hi)
    lo, hi = -math.inf if lo is None else lo, math.inf if hi is None else hi
    return ratio.masked_fill((ratio < lo) | (ratio > hi), 0.0)


def row_sums(values: Tensor, mask: Tensor, rows: int) -> Tensor:
    """[rows] each completion's sum over its tokens in the loss of `values` (flat [rows x length],
    NaN counting 0), `mask` flat alike."""
    return torch.nan_to_num(values * mask, nan=0.0).view(rows, -1).sum(1)


def off_policy_keep(adv: Tensor, kl_sum: Tensor, tokens: Tensor, threshold: float) -> Tensor:
    """TRL's `get_off_policy_mask` of each completion ([rows] float, 1 keep, 0 drop): its advantage
    `adv` >= 0, or its mean KL (`kl_sum`, of sampling - policy log-probs over its `tokens`) at most
    `threshold`."""
    return ((adv >= 0) | (kl_sum / tokens.clamp(min=1.0) <= threshold)).float()


def sampling_stats(cfg, old: Tensor, sampler: Tensor, mask: Tensor, rows: int) -> Tensor:
    """One micro-batch's share (SAMPLING_STATS, float64 on the inputs' device) of TRL's sampling
    metrics: |old - sampler| over its tokens in the loss (sum, count, most), and the correction's
    ratios (over those tokens; one a completion, every row, in the sequence modes): sum, count,
    least and most (an empty set's least and most are +-inf). Flat [rows x length] inputs."""
    diff = old - sampler
    delta = diff.abs()[(mask > 0) & ~torch.isnan(diff)].double()
    diff = torch.nan_to_num(diff * mask, nan=0.0)
    if per_sequence(cfg.vllm_importance_sampling_mode):
        ratio = sampling_ratio(cfg, diff.view(rows, -1).sum(1)).double()
    else:
        ratio = sampling_ratio(cfg, diff)[mask > 0].double()
    inf = torch.tensor(math.inf, dtype=torch.float64, device=old.device)

    def count(x: Tensor) -> Tensor:
        return torch.tensor(float(x.numel()), dtype=torch.float64, device=old.device)

    return torch.stack([delta.sum(), count(delta), delta.max() if delta.numel() else -inf,
                        ratio.sum(), count(ratio), ratio.min() if ratio.numel() else inf,
                        ratio.max() if ratio.numel() else -inf])  # fmt: skip


def combine(parts: list[list[float]]) -> list[float]:
    """The SAMPLING_STATS of several micro-batches of one generation batch on one process."""
    s = [list(col) for col in zip(*parts)]
    return [sum(s[0]), sum(s[1]), max(s[2]), sum(s[3]), sum(s[4]), min(s[5]), max(s[6])]


def sampling_metrics(ranks: list[list[float]]) -> dict[str, float]:
    """TRL's metrics of one generation batch from every process's SAMPLING_STATS of it: each
    process's mean and most |old - sampler|, least, mean and most ratio (0 where it has none), then
    the mean of the means, the most of the most and the least of the least over the processes."""
    per = []
    for s in ranks:
        tokens, ratios = s[1], s[4]
        delta = (s[0] / tokens, s[2]) if tokens else (0.0, 0.0)
        ratio = (s[5], s[3] / ratios, s[6]) if ratios else (0.0, 0.0, 0.0)
        per.append(delta + ratio)
    mean_delta, max_delta, lo, mean, hi = zip(*per)
    return {
        "sampling/sampling_logp_difference/mean": sum(mean_delta) / len(per),
        "sampling/sampling_logp_difference/max": max(max_delta),
        "sampling/importance_sampling_ratio/min": min(lo),
        "sampling/importance_sampling_ratio/mean": sum(mean) / len(per),
        "sampling/importance_sampling_ratio/max": max(hi),
    }


# ------------------------------------------------------------------------ over a step's targets
# (GRPO's `_Targets`: flat [rows x length] mask, adv, old, sampler; row_tokens [rows])
def _sampling(t) -> Tensor | None:
    """The log-probs the off-policy mask takes as the sampling policy's (TRL's: the sampler's, else
    the stored old ones; None: the policy itself sampled)."""
    return t.sampler if t.sampler is not None else t.old


def needs_policy(cfg, targets) -> bool:
    """Whether `factors` or `step_metrics` need the policy's own log-probs of these targets."""
    own = cfg.corrects and any(t.sampler is not None and t.old is None for t in targets)
    masking = cfg.off_policy_mask_threshold is not None and any(_sampling(t) is not None for t in targets)
    return own or masking


def factors(cfg, targets, current: list[Tensor] | None) -> list[tuple[Tensor | None, Tensor | None]]:
    """Each micro-batch's (off-policy mask, sequence-level ratio) of its completions ([rows] each,
    None where it does not apply), `current` the policy's log-probs (`needs_policy`)."""
    out = []
    for i, t in enumerate(targets):
        rows, keep, ratio = len(t.row_tokens), None, None
        logp = current[i] if current is not None else None
        if cfg.off_policy_mask_threshold is not None:
            s = _sampling(t)  # None: the policy itself, a KL of 0
            kl = torch.zeros(rows, device=t.mask.device) if s is None else row_sums(s - logp, t.mask, rows)
            keep = off_policy_keep(
                t.adv.view(rows, -1)[:, 0], kl, t.row_tokens, cfg.off_policy_mask_threshold
            )
        if cfg.corrects and per_sequence(cfg.vllm_importance_sampling_mode) and t.sampler is not None:
            old = logp if t.old is None else t.old
            ratio = sampling_ratio(cfg, row_sums(old - t.sampler, t.mask, rows))
        out.append((keep, ratio))
    return out


def step_metrics(cfg, targets, current: list[Tensor], collective) -> dict[str, float]:
    """TRL's sampler metrics of a step that trains whole generation batches, `current` the policy's
    log-probs (their old ones): each batch's over its micro-batches' first pass on every rank
    (`collective`), then their mean over the step's batches (TRL logs one value a batch)."""
    per, first = cfg.micro_batches_per_generation, cfg.steps_per_generation
    batches: dict[int, list[Tensor]] = {}
    for i, (t, logp) in enumerate(zip(targets, current)):
        if i % per < first:
            batches.setdefault(i // per, []).append(
                sampling_stats(cfg, logp, t.sampler, t.mask, len(t.row_tokens))
            )
    mine = [combine(torch.stack(b).tolist()) for _, b in sorted(batches.items())]
    ranks = collective.each(mine) if collective is not None else [mine]
    each = [sampling_metrics([r[j] for r in ranks]) for j in range(len(mine))]
    return {k: sum(e[k] for e in each) / len(each) for k in each[0]}
