"""Preference objectives (DPO and its loss types, KTO, ORPO, SimPO) over per-sequence sums.

The formulas, names, defaults and metrics are TRL 1.16's: DPOTrainer and KTOTrainer
(`_compute_loss`), and from trl.experimental ORPOTrainer (`odds_ratio_loss`) and CPOTrainer
(`cpo_loss`, loss_type simpo). TRL 1.x has no rpo_alpha or reference_free (config.py refuses
them, naming what to write instead).

Every input is a per-sequence sum over a completion's tokens (log-probs, token counts), so the
engine computes token log-probs a chunk at a time, sums them per sequence, and calls
`loss_and_grads`; the gradient of a token's log-prob is then its sequence's d loss / d logps (any
length normalisation is inside the loss, so it is already in that number).

Where this differs from TRL, on purpose:
- `logits/chosen` and `logits/rejected` are the mean logit over the completion positions for every
  stage (DPO's definition); TRL's ORPO, CPO and KTO average over the whole padded batch tensor.
- simpo reports its `nll_loss` also when cpo_alpha is 0 (TRL reports 0 then).
Not supported: the f-divergence options, use_weighting (WPO), ld_alpha and CPOTrainer's AlphaPO
`alpha`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F
from torch import Tensor

from ..data.preference import Limits
from ..errors import ConfigError
from .logprobs import token_logps

STAGES = ("dpo", "kto", "orpo", "simpo")
DPO_LOSS_TYPES = (
    "sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
    "aot", "aot_unpaired", "discopop", "apo_zero", "apo_down", "sft", "sigmoid_norm",
)  # fmt: skip
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")
# The loss types each stage takes, its default first; orpo has its one loss and no loss_type.
LOSS_TYPES = {"dpo": DPO_LOSS_TYPES, "kto": KTO_LOSS_TYPES, "orpo": (), "simpo": ("simpo",)}
# How each stage's TRL 1.16 trainer tokenises prompt + completion (data/preference.py's rules):
# DPOTrainer and KTOTrainer as SFT does, ORPOTrainer and CPOTrainer by their `tokenize_row`. In
# all of them max_length is the one bound (no max_prompt_length), keep_start by default.
TOKENISATION = {"dpo": "joint", "kto": "joint", "orpo": "answer", "simpo": "answer"}
# The trainers among them without a truncation_mode: a sequence keeps its first max_length tokens.
KEEP_START_ONLY = {"kto": "KTOTrainer", "orpo": "ORPOTrainer", "simpo": "CPOTrainer"}


@dataclass
class PreferenceConfig:
    """The keys of preference training, with TRL's names and defaults (1.16)."""

    stage: str = "dpo"
    """dpo, kto, orpo or simpo (TRL's DPOTrainer, KTOTrainer, ORPOTrainer, CPOTrainer with
    loss_type simpo)."""
    beta: float = 0.1
    """Temperature of the implicit reward; for ipo the regularisation tau, for orpo lambda."""
    loss_type: str | list[str] | None = None
    """dpo: one of DPO_LOSS_TYPES or a list of them, summed with loss_weights (default sigmoid);
    kto: kto or apo_zero_unpaired (default kto); simpo: simpo. After validation: a list ([] for
    orpo, which has one loss)."""
    loss_weights: list[float] | None = None
    """dpo: one weight per loss_type (default 1.0 each)."""
    label_smoothing: float = 0.0
    """Probability that a preference label is flipped: robust's, aot's and simpo's; exo_pair's
    epsilon (> 0 there); in [0, 0.5]."""
    discopop_tau: float = 0.05
    """dpo loss_type discopop: the temperature of its log-ratio modulation."""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin."""
    cpo_alpha: float = 1.0
    """simpo: weight of the NLL of the chosen completions (CPO's behaviour cloning term; 0 for pure SimPO)."""
    desirable_weight: float = 1.0
    """kto: weight of the losses of desirable (label true) examples."""
    undesirable_weight: float = 1.0
    """kto: weight of the losses of undesirable (label false) examples."""
    truncation_mode: str | None = None
    """What of a prompt + completion over max_length is kept: keep_start (the default; kto's,
    orpo's and simpo's only one: TRL 1.16) or, for dpo, keep_end."""

    def __post_init__(self):
        def bad(key, why):
            raise ConfigError(f"{key}: {why} (got {getattr(self, key)!r})")

        for f in fields(self):
            value = getattr(self, f.name)
            values = value if isinstance(value, list) else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                bad(f.name, "must be a finite number")
        if self.stage not in STAGES:
            bad("stage", f"must be one of {', '.join(STAGES)}")
        if self.beta <= 0:
            bad("beta", "must be > 0")
        self.loss_type = self._loss_types(bad)
        if self.loss_weights is not None:
            if self.stage != "dpo":
                bad("loss_weights", "is only used with stage dpo")
            if len(self.loss_weights) != len(self.loss_type):
                bad("loss_weights", f"needs one weight per loss_type ({len(self.loss_type)})")
        if not 0.0 <= self.label_smoothing <= 0.5:
            bad("label_smoothing", "must be in [0, 0.5]")
        if "robust" in self.loss_type and self.label_smoothing == 0.5:
            bad(
                "label_smoothing",
                "must be below 0.5 for loss_type robust (it divides by 1 - 2 label_smoothing)",
            )
        if "exo_pair" in self.loss_type and self.label_smoothing == 0:
            bad(
                "label_smoothing",
                "must be > 0 for loss_type exo_pair (its epsilon; the EXO paper takes 1e-3)",
            )
        if self.discopop_tau <= 0:
            bad("discopop_tau", "must be > 0")
        for key in ("cpo_alpha", "desirable_weight", "undesirable_weight"):
            if getattr(self, key) < 0:
                bad(key, "must be >= 0")
        if self.desirable_weight == self.undesirable_weight == 0:
            bad("desirable_weight", "and undesirable_weight cannot both be 0")
        if self.truncation_mode is None:
            self.truncation_mode = "keep_start"
        if self.stage in KEEP_START_ONLY and self.truncation_mode != "keep_start":
            bad(
                "truncation_mode",
                f"TRL 1.x's {KEEP_START_ONLY[self.stage]} has none: a sequence keeps its first max_length tokens",
            )
        self.limits(None)

    def _loss_types(self, bad) -> list[str]:
        """loss_type as a list: the stage's default (the first it allows) when not given."""
        allowed, given = LOSS_TYPES[self.stage], self.loss_type
        types = list(allowed[:1]) if given is None else [given] if isinstance(given, str) else given
        if (
            not isinstance(types, list)
            or any(t not in allowed for t in types)
            or not (len(types) >= 1 if self.stage == "dpo" else len(types) == len(allowed[:1]))
        ):
            if self.stage == "dpo":
                bad("loss_type", f"must be one of {', '.join(allowed)} or a list of them")
            if allowed:
                bad("loss_type", f"must be {' or '.join(allowed)} with stage {self.stage}")
            bad("loss_type", f"is not used with stage {self.stage}, which has one loss")
        return list(types)

    def limits(self, max_length: int | None) -> Limits:
        """The data's tokenisation and length limits with the run's max_length."""
        return Limits(max_length, truncation_mode=self.truncation_mode, rule=TOKENISATION[self.stage])

    @property
    def needs_reference(self) -> bool:
        """Whether the loss takes a reference model's log-probs."""
        return self.stage in ("dpo", "kto")

    @property
    def needs_kl(self) -> bool:
        """Whether the loss takes KTO's KL sequences (the mismatched pairs)."""
        return self.loss_type == ["kto"]

    @property
    def sequences(self) -> int:
        """Sequences per sample: a pair's two, a KTO example's one and its KL sequence's."""
        return 1 if self.stage == "kto" and not self.needs_kl else 2

    @property
    def normalized(self) -> bool:
        """Whether sequence log-probs are divided by their token counts before the loss: orpo and
        simpo (dpo's ipo and sigmoid_norm divide their own terms)."""
        return self.stage in ("orpo", "simpo")


# ------------------------------------------------------------------------ inputs and outputs
@dataclass
class PairedLogps:
    """One micro-batch of pairs as per-sequence sums, each of shape (pairs,)."""

    chosen_logps: Tensor
    """Sum of the log-probs of the chosen completion's tokens under the policy."""
    rejected_logps: Tensor
    chosen_lengths: Tensor
    """Tokens summed in chosen_logps."""
    rejected_lengths: Tensor
    ref_chosen_logps: Tensor | None = None
    """The same sums under the reference model (None when the config needs no reference)."""
    ref_rejected_logps: Tensor | None = None
    chosen_logits: Tensor | None = None
    """Metrics only: the sum over the chosen completion's positions of the mean logit over the
    vocabulary (the logits that predict its tokens)."""
    rejected_logits: Tensor | None = None
    chosen_prompt_logps: Tensor | None = None
    """orpo only: the sum of log-probs of the chosen sequence's prompt tokens but the first (TRL's
    ORPO takes its NLL over prompt and completion)."""
    chosen_prompt_lengths: Tensor | None = None


@dataclass
class UnpairedLogps:
    """One micro-batch of KTO examples as per-sequence sums, each of shape (examples,)."""

    logps: Tensor
    lengths: Tensor
    labels: Tensor
    """bool: true for desirable examples."""
    ref_logps: Tensor
    kl_logps: Tensor | None = None
    """The policy's log-probs of the KL sequences (mismatched pairs), taken as constants."""
    ref_kl_logps: Tensor | None = None
    logits: Tensor | None = None
    """Metrics only, as PairedLogps.chosen_logits."""
    shared_kl: Tensor | None = None
    """loss_type kto over several processes: the mean of `kl_estimate` over this micro-batch and
    its counterparts on the other processes (TRL gathers the estimate at each forward); None: this
    micro-batch's own estimate."""


POLICY_FIELDS = ("chosen_logps", "rejected_logps", "chosen_prompt_logps", "logps")


@dataclass
class PreferenceResult:
    """The loss of a micro-batch, its metrics (TRL's names) and the gradient of the loss with
    respect to each policy log-prob sum given (by field name: chosen_logps, rejected_logps,
    chosen_prompt_logps or logps)."""

    loss: Tensor
    metrics: dict[str, float]
    grads: dict[str, Tensor]


# ------------------------------------------------------------------------ the losses
def loss_and_grads(cfg: PreferenceConfig, batch: PairedLogps | UnpairedLogps) -> PreferenceResult:
    """The loss, its metrics and d loss / d (each policy log-prob sum) for one micro-batch."""
    leaves = {
        n: getattr(batch, n).detach().float().requires_grad_()
        for n in POLICY_FIELDS
        if getattr(batch, n, None) is not None
    }
    batch = dataclasses.replace(batch, **leaves)
    with torch.enable_grad():
        loss, metrics = preference_loss(cfg, batch)
        grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
    return PreferenceResult(
        loss.detach(),
        metrics,
        {n: torch.zeros_like(x) if g is None else g for (n, x), g in zip(leaves.items(), grads)},
    )


def preference_loss(
    cfg: PreferenceConfig, batch: PairedLogps | UnpairedLogps
) -> tuple[Tensor, dict[str, float]]:
    """The mean loss of one micro-batch (differentiable in the policy log-probs) and its metrics."""
    if cfg.stage == "kto":
        return _kto(cfg, batch)
    if cfg.stage == "orpo":
        return _orpo(cfg, batch)
    c, r, rc, rr = _pair_logps(cfg, batch)
    if cfg.stage == "simpo":
        nll = _nll(batch.chosen_logps, batch.chosen_lengths)
        losses = _smoothed_sigmoid(cfg.beta * ((c - r) - cfg.simpo_gamma / cfg.beta), cfg.label_smoothing)
        loss = losses.mean() + cfg.cpo_alpha * nll if cfg.cpo_alpha else losses.mean()
        return loss, _pair_metrics(cfg.beta * c, cfg.beta * r, c, r, batch) | {"nll_loss": _item(nll)}
    weights = cfg.loss_weights or [1.0] * len(cfg.loss_type)
    loss = sum(w * _dpo_losses(t, cfg, batch, c, r, rc, rr).mean() for t, w in zip(cfg.loss_type, weights))
    return loss, _pair_metrics(cfg.beta * (c - rc), cfg.beta * (r - rr), c, r, batch)


def _pair_logps(cfg: PreferenceConfig, b: PairedLogps) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """Policy and reference log-probs of chosen and rejected, per token where normalised."""
    c, r = b.chosen_logps, b.rejected_logps
    if cfg.needs_reference:
        if b.ref_chosen_logps is None or b.ref_rejected_logps is None:
            raise ValueError(
                f"stage {cfg.stage} needs the reference log-probs (ref_chosen_logps, ref_rejected_logps)"
            )
        rc, rr = b.ref_chosen_logps.detach().float(), b.ref_rejected_logps.detach().float()
    else:
        rc = rr = torch.zeros_like(c)
    if cfg.normalized:
        lc, lr = b.chosen_lengths.to(c.dtype), b.rejected_lengths.to(c.dtype)
        c, r, rc, rr = c / lc, r / lr, rc / lc, rr / lr
    return c, r, rc, rr


def _dpo_losses(t: str, cfg, b: PairedLogps, c, r, rc, rr) -> Tensor:
    """Per-pair losses of DPO loss type `t` (TRL's `_compute_loss`)."""
    beta, ls = cfg.beta, cfg.label_smoothing
    cw, rw = c - rc, r - rr  # chosen and rejected log-ratios to the reference
    x = beta * (cw - rw)  # beta times the policy's margin over the reference's
    if t == "sigmoid":
        return -F.logsigmoid(x)
    if t == "robust":
        return (-(1 - ls) * F.logsigmoid(x) + ls * F.logsigmoid(-x)) / (1 - 2 * ls)
    if t == "exo_pair":
        return x.sigmoid() * (F.logsigmoid(x) - math.log1p(-ls)) + (-x).sigmoid() * (
            F.logsigmoid(-x) - math.log(ls)
        )
    if t == "hinge":
        return torch.relu(1 - x)
    if t in ("ipo", "sigmoid_norm"):  # the log-ratios per completion token
        lc, lr = b.chosen_lengths.clamp(min=1), b.rejected_lengths.clamp(min=1)
        d = cw / lc - rw / lr
        return (d - 1 / (2 * beta)) ** 2 if t == "ipo" else -F.logsigmoid(beta * d)
    if t == "bco_pair":
        return -F.logsigmoid(beta * cw) - F.logsigmoid(-beta * rw)
    if t == "sppo_hard":
        return (cw - 0.5 / beta) ** 2 + (rw + 0.5 / beta) ** 2
    if t == "nca_pair":
        return -F.logsigmoid(beta * cw) - 0.5 * F.logsigmoid(-beta * cw) - 0.5 * F.logsigmoid(-beta * rw)
    if t in ("aot", "aot_unpaired"):  # the batch's sorted margins, matched in order
        if t == "aot":
            delta = torch.sort(c - r).values - torch.sort(rc - rr).values
        else:
            delta = torch.sort(cw).values - torch.sort(rw).values
        return _smoothed_sigmoid(beta * delta, ls)
    if t == "apo_zero":
        return (1 - torch.sigmoid(beta * cw)) + torch.sigmoid(beta * rw)
    if t == "apo_down":
        return torch.sigmoid(beta * cw) + (1 - torch.sigmoid(x))
    if t == "discopop":
        mix = torch.sigmoid(x / cfg.discopop_tau)
        return -F.logsigmoid(x) * (1 - mix) + torch.exp(-x) * mix
    if t == "sft":
        return _nll(b.chosen_logps, b.chosen_lengths).expand_as(c)
    raise ValueError(f"unknown loss type {t!r}")


def _smoothed_sigmoid(x: Tensor, label_smoothing: float) -> Tensor:
    """-log sigmoid(x), with the label flipped with probability label_smoothing."""
    return -(1 - label_smoothing) * F.logsigmoid(x) - label_smoothing * F.logsigmoid(-x)


def _nll(logps: Tensor, lengths: Tensor) -> Tensor:
    """Mean negative log-likelihood over all tokens of the batch (a token-weighted mean)."""
    return -logps.sum() / lengths.sum().clamp(min=1)


def _orpo(cfg: PreferenceConfig, b: PairedLogps) -> tuple[Tensor, dict[str, float]]:
    if b.chosen_prompt_logps is None or b.chosen_prompt_lengths is None:
        raise ValueError(
            "stage orpo needs chosen_prompt_logps and chosen_prompt_lengths (its NLL covers the prompt)"
        )
    c, r, _, _ = _pair_logps(cfg, b)
    log_odds = (c - r) - (_log1mexp(c) - _log1mexp(r))
    ratio = F.logsigmoid(log_odds)
    nll = _nll(b.chosen_logps + b.chosen_prompt_logps, b.chosen_lengths + b.chosen_prompt_lengths)
    metrics = _pair_metrics(cfg.beta * c, cfg.beta * r, c, r, b) | {
        "nll_loss": _item(nll),
        "log_odds_ratio": _item(ratio.mean()),
        "log_odds_chosen": _item(log_odds.mean()),
    }
    return nll - (cfg.beta * ratio).mean(), metrics


def _log1mexp(x: Tensor) -> Tensor:
    """log(1 - exp(x)) for x < 0, accurate on both sides of -log 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def _kto(cfg: PreferenceConfig, b: UnpairedLogps) -> tuple[Tensor, dict[str, float]]:
    ratio = b.logps - b.ref_logps.detach().float()
    if cfg.needs_kl:
        kl = (kl_estimate(b) if b.shared_kl is None else b.shared_kl).clamp(min=0)
        desirable = 1 - torch.sigmoid(cfg.beta * (ratio - kl))
        undesirable = 1 - torch.sigmoid(cfg.beta * (kl - ratio))
    else:  # apo_zero_unpaired
        kl = torch.zeros(())
        desirable, undesirable = 1 - torch.sigmoid(cfg.beta * ratio), torch.sigmoid(cfg.beta * ratio)
    labels = b.labels.bool()
    losses = torch.where(labels, cfg.desirable_weight * desirable, cfg.undesirable_weight * undesirable)
    rewards = cfg.beta * ratio.detach()
    metrics = {"kl": _item(kl)}
    for split, sel in (("chosen", labels), ("rejected", ~labels)):
        if sel.any():
            metrics[f"rewards/{split}"] = _item(rewards[sel].mean())
            metrics[f"logps/{split}"] = _item(b.logps[sel].mean())
            if b.logits is not None:
                metrics[f"logits/{split}"] = _item(b.logits[sel].sum() / b.lengths[sel].sum())
            metrics[f"count/{split}"] = float(sel.sum())
    if labels.any() and not labels.all():
        metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return losses.mean(), metrics


def kl_estimate(b: UnpairedLogps) -> Tensor:
    """KTO's KL estimate of one micro-batch, before the clamp: the mean log-ratio of its KL
    sequences to the reference, a constant of the loss."""
    if b.kl_logps is None or b.ref_kl_logps is None:
        raise ValueError("loss_type kto needs kl_logps and ref_kl_logps (the mismatched pairs)")
    return (b.kl_logps.detach().float() - b.ref_kl_logps.detach().float()).mean()


def _pair_metrics(chosen_rewards, rejected_rewards, c: Tensor, r: Tensor, b: PairedLogps) -> dict[str, float]:
    chosen_rewards, rejected_rewards = chosen_rewards.detach(), rejected_rewards.detach()
    metrics = {
        "rewards/chosen": _item(chosen_rewards.mean()),
        "rewards/rejected": _item(rejected_rewards.mean()),
        "rewards/accuracies": _item((chosen_rewards > rejected_rewards).float().mean()),
        "rewards/margins": _item((chosen_rewards - rejected_rewards).mean()),
        "logps/chosen": _item(c.mean()),
        "logps/rejected": _item(r.mean()),
    }
    if b.chosen_logits is not None and b.rejected_logits is not None:
        metrics["logits/chosen"] = _item(b.chosen_logits.sum() / b.chosen_lengths.sum())
        metrics["logits/rejected"] = _item(b.rejected_logits.sum() / b.rejected_lengths.sum())
    return metrics


def _item(x: Tensor) -> float:
    return float(x.detach())


# ------------------------------------------------------------------------ the reference path
def sequence_logps(logits: Tensor, input_ids: Tensor, mask: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Per-sequence (sum of log-probs, token count, sum of vocabulary-mean logits) over the tokens
    where `mask` is true, each predicted by the logits of the position before it (the first token
    is never counted). logits (batch, T, vocab); input_ids and mask (batch, T).

    The plain full-logit form of what the engine computes a chunk at a time."""
    logits = logits[:, :-1].float()
    m = mask[:, 1:].to(logits.dtype)
    logps = token_logps(logits, input_ids[:, 1:])
    return (logps * m).sum(-1), m.sum(-1), (logits.mean(-1) * m).sum(-1)
