"""The preference losses against plain transcriptions of TRL's formulas (DPO's 1.16, the
experimental ORPO's and CPO's, KTO's; tests/test_trl_parity.py runs TRL's trainers themselves).

Each reference below follows TRL's code path literally: a tiny transformers model's full logits,
TRL's rolled per-token log-probs with its loss mask (DPO) or its shifted labels with -100 (ORPO,
CPO, KTO), then the trainer's loss and metrics. The megatrain path goes through
`sequence_logps` (completion mask -> per-sequence sums) and `preference_loss`. Loss, metrics and
the gradients of the model's parameters must agree in fp32.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
from helpers import tiny_hf_model

from megatrain.errors import ConfigError
from megatrain.objectives.preference import (
    PairedLogps,
    PreferenceConfig,
    UnpairedLogps,
    loss_and_grads,
    preference_loss,
    sequence_logps,
)

V = 97  # tiny_config's vocabulary
PROMPTS = [3, 5, 2]
CHOSEN = [4, 2, 5]
REJECTED = [3, 6, 1]
TOL = dict(rtol=1e-5, atol=1e-6)


def tiny(seed):
    return tiny_hf_model("llama", seed=seed, num_hidden_layers=1, hidden_size=32, intermediate_size=48)


@pytest.fixture(scope="module")
def models():
    return tiny(0), tiny(1)  # policy, reference


def pair_batch(seed=0, prompts=PROMPTS, chosen=CHOSEN, rejected=REJECTED):
    """2B right-padded sequences (chosen rows first), their attention and completion masks.
    Token ids start at 1: TRL's NLL ignores label 0 as padding."""
    g = torch.Generator().manual_seed(seed)
    rows, comp = [], []
    for lengths in (chosen, rejected):
        for p, n in zip(prompts, lengths):
            ids = torch.randint(1, V, (p + n,), generator=g)
            if lengths is rejected:  # the pair's prompt is shared
                ids[:p] = rows[len(rows) - len(prompts)][:p]
            rows.append(ids)
            comp.append(torch.arange(p + n) >= p)
    T = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), T, dtype=torch.long)
    attn = torch.zeros(len(rows), T, dtype=torch.long)
    mask = torch.zeros(len(rows), T, dtype=torch.bool)
    for i, (r, c) in enumerate(zip(rows, comp)):
        ids[i, : len(r)], attn[i, : len(r)], mask[i, : len(r)] = r, 1, c
    return ids, attn, mask


def params(model):
    return [p for p in model.parameters() if p.requires_grad]


def compare(model, ours, trl, skip_metrics=()):
    """Loss, metrics and parameter gradients of two (loss, metrics) closures."""
    (l1, m1), (l2, m2) = ours(), trl()
    torch.testing.assert_close(l1, l2, **TOL)
    for k, v in m2.items():
        if k not in skip_metrics:
            assert m1[k] == pytest.approx(float(torch.as_tensor(v).detach()), rel=1e-5, abs=1e-6), k
    for a, b in zip(torch.autograd.grad(l1, params(model)), torch.autograd.grad(l2, params(model))):
        torch.testing.assert_close(a, b, **TOL)


# ------------------------------------------------------------------------ TRL, transcribed
def selective_log_softmax(logits, labels):
    """TRL's per-token log-probs: the label's logit less the log-sum-exp."""
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - logits.logsumexp(-1)


def trl_concatenated_forward(model, ids, attn, loss_mask):
    """DPOTrainer._compute_loss's forward: the shifted completion mask, summed logps."""
    logits = model(ids, attention_mask=attn).logits[:, :-1]
    m = loss_mask[:, 1:]
    per_token = selective_log_softmax(logits, ids[:, 1:]) * m
    n = len(ids) // 2
    return dict(
        chosen_logps=per_token[:n].sum(-1),
        rejected_logps=per_token[n:].sum(-1),
        nll_loss=-per_token[:n][m[:n]].mean(),
        mean_chosen_logits=logits[:n][m[:n]].mean(),
        mean_rejected_logits=logits[n:][m[n:]].mean(),
        lengths=loss_mask.sum(-1).clamp(min=1),
    )


class TrlDpo:
    """DPOTrainer._compute_loss's loss and metrics (TRL 1.16)."""

    def __init__(
        self, beta=0.1, loss_type="sigmoid", loss_weights=None, label_smoothing=0.0, discopop_tau=0.05
    ):
        self.beta, self.label_smoothing, self.discopop_tau = beta, label_smoothing, discopop_tau
        self.loss_type = [loss_type] if isinstance(loss_type, str) else loss_type
        self.loss_weights = loss_weights or [1.0] * len(self.loss_type)

    def dpo_loss(self, c, r, rc, rr, loss_type, out):
        beta, ls, n = self.beta, self.label_smoothing, len(c)
        cw, rw = c - rc, r - rr
        delta = cw - rw
        if loss_type == "sigmoid":
            return -F.logsigmoid(beta * delta)
        if loss_type == "robust":
            return (-(1 - ls) * F.logsigmoid(beta * delta) + ls * F.logsigmoid(-beta * delta)) / (1 - 2 * ls)
        if loss_type == "exo_pair":
            eps = torch.tensor(ls)
            return torch.sigmoid(beta * delta) * (
                F.logsigmoid(beta * delta) - torch.log1p(-eps)
            ) + torch.sigmoid(-beta * delta) * (F.logsigmoid(-beta * delta) - torch.log(eps))
        if loss_type == "hinge":
            return torch.relu(1 - beta * delta)
        if loss_type in ("ipo", "sigmoid_norm"):
            d = cw / out["lengths"][:n] - rw / out["lengths"][n:]
            return (d - 1 / (2 * beta)) ** 2 if loss_type == "ipo" else -F.logsigmoid(beta * d)
        if loss_type == "bco_pair":
            return -F.logsigmoid(beta * cw) - F.logsigmoid(-beta * rw)
        if loss_type == "sppo_hard":
            return (cw - 0.5 / beta) ** 2 + (rw + 0.5 / beta) ** 2
        if loss_type == "nca_pair":
            return -F.logsigmoid(beta * cw) - 0.5 * F.logsigmoid(-beta * cw) - 0.5 * F.logsigmoid(-beta * rw)
        if loss_type in ("aot", "aot_unpaired"):
            if loss_type == "aot":
                d = torch.sort(c - r, dim=0)[0] - torch.sort(rc - rr, dim=0)[0]
            else:
                d = torch.sort(cw, dim=0)[0] - torch.sort(rw, dim=0)[0]
            return -F.logsigmoid(beta * d) * (1 - ls) - F.logsigmoid(-beta * d) * ls
        if loss_type == "apo_zero":
            return (1 - torch.sigmoid(beta * cw)) + torch.sigmoid(beta * rw)
        if loss_type == "apo_down":
            return torch.sigmoid(beta * cw) + (1 - torch.sigmoid(beta * (cw - rw)))
        if loss_type == "discopop":
            lg = delta * beta
            mod = torch.sigmoid(lg / self.discopop_tau)
            return -F.logsigmoid(lg) * (1 - mod) + torch.exp(-lg) * mod
        if loss_type == "sft":
            return out["nll_loss"].expand(n)
        raise ValueError(loss_type)

    def get_batch_loss_metrics(self, model, ref_model, ids, attn, mask):
        out = trl_concatenated_forward(model, ids, attn, mask)
        with torch.no_grad():
            ref = trl_concatenated_forward(ref_model, ids, attn, mask)
        c, r, rc, rr = out["chosen_logps"], out["rejected_logps"], ref["chosen_logps"], ref["rejected_logps"]
        loss = sum(
            self.dpo_loss(c, r, rc, rr, t, out).mean() * w for t, w in zip(self.loss_type, self.loss_weights)
        )
        chosen_rewards, rejected_rewards = self.beta * (c - rc).detach(), self.beta * (r - rr).detach()
        metrics = {
            "rewards/chosen": chosen_rewards.mean(),
            "rewards/rejected": rejected_rewards.mean(),
            "rewards/accuracies": (chosen_rewards > rejected_rewards).float().mean(),
            "rewards/margins": (chosen_rewards - rejected_rewards).mean(),
            "logps/chosen": c.mean(),
            "logps/rejected": r.mean(),
            "logits/chosen": out["mean_chosen_logits"],
            "logits/rejected": out["mean_rejected_logits"],
        }
        return loss, metrics


def trl_get_batch_logps(logits, labels, average):
    """ORPO/CPO/KTO get_batch_logps: shifted labels, -100 ignored."""
    labels = labels[:, 1:].clone()
    logits = logits[:, :-1, :]
    loss_mask = labels != -100
    labels[labels == -100] = 0
    per_token = selective_log_softmax(logits, labels)
    if average:
        return (per_token * loss_mask).sum(-1) / loss_mask.sum(-1)
    return (per_token * loss_mask).sum(-1)


def trl_cross_entropy(logits, labels):
    return torch.nn.CrossEntropyLoss()(logits[..., :-1, :].flatten(0, 1), labels[..., 1:].flatten())


def trl_orpo(model, ids, attn, mask, beta):
    """ORPOTrainer.concatenated_forward, odds_ratio_loss, get_batch_loss_metrics."""
    n = len(ids) // 2
    logits = model(ids, attention_mask=attn).logits
    labels = torch.where(mask, ids, -100)
    nll = trl_cross_entropy(logits[:n], torch.where(attn == 1, ids, -100)[:n])  # prompt and response
    logps = trl_get_batch_logps(logits, labels, average=True)
    c, r = logps[:n], logps[n:]
    log_odds = (c - r) - (torch.log1p(-torch.exp(c)) - torch.log1p(-torch.exp(r)))
    ratio = F.logsigmoid(log_odds)
    cr, rr = beta * c.detach(), beta * r.detach()
    metrics = {
        "rewards/chosen": cr.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/accuracies": (cr > rr).float().mean(),
        "rewards/margins": (cr - rr).mean(),
        "logps/chosen": c.mean(),
        "logps/rejected": r.mean(),
        "nll_loss": nll,
        "log_odds_ratio": ratio.mean(),
        "log_odds_chosen": log_odds.mean(),
    }
    return nll - (beta * ratio).mean(), metrics


def trl_simpo(model, ids, attn, mask, beta, simpo_gamma, cpo_alpha, label_smoothing):
    """CPOTrainer with loss_type simpo: averaged logps, NLL over the chosen completions."""
    n = len(ids) // 2
    logits = model(ids, attention_mask=attn).logits
    labels = torch.where(mask, ids, -100)
    nll = trl_cross_entropy(logits[:n], labels[:n])
    logps = trl_get_batch_logps(logits, labels, average=True)
    c, r = logps[:n], logps[n:]
    lg = (c - r) - simpo_gamma / beta
    losses = -F.logsigmoid(beta * lg) * (1 - label_smoothing) - F.logsigmoid(-beta * lg) * label_smoothing
    cr, rr = beta * c.detach(), beta * r.detach()
    metrics = {
        "rewards/chosen": cr.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/accuracies": (cr > rr).float().mean(),
        "rewards/margins": (cr - rr).mean(),
        "logps/chosen": c.mean(),
        "logps/rejected": r.mean(),
        "nll_loss": nll,
    }
    return losses.mean() + cpo_alpha * nll, metrics


# ------------------------------------------------------------------------ megatrain's path
def paired(model, ref_model, ids, attn, mask):
    """PairedLogps through sequence_logps: completion sums, and the chosen prompts' sums."""
    n = len(ids) // 2
    logits = model(ids, attention_mask=attn).logits
    logps, lengths, logit_sums = sequence_logps(logits, ids, mask)
    p_logps, p_lengths, _ = sequence_logps(logits, ids, attn.bool() & ~mask)
    with torch.no_grad():
        ref, _, _ = sequence_logps(ref_model(ids, attention_mask=attn).logits, ids, mask)
    return PairedLogps(
        logps[:n], logps[n:], lengths[:n], lengths[n:], ref[:n], ref[n:],
        logit_sums[:n], logit_sums[n:], p_logps[:n], p_lengths[:n],
    )  # fmt: skip


DPO_CASES = [
    dict(loss_type="sigmoid"),
    dict(loss_type="sigmoid", label_smoothing=0.2),  # ignored, as TRL 1.x does
    dict(loss_type="robust", label_smoothing=0.1),
    dict(loss_type="exo_pair", label_smoothing=1e-3),
    dict(loss_type="exo_pair", label_smoothing=0.05),
    dict(loss_type="aot"),
    dict(loss_type="aot", label_smoothing=0.1),
    dict(loss_type="aot_unpaired"),
    dict(loss_type="sigmoid_norm"),
    dict(loss_type="hinge", beta=0.5),
    dict(loss_type="ipo"),
    dict(loss_type="bco_pair"),
    dict(loss_type="sppo_hard"),
    dict(loss_type="nca_pair"),
    dict(loss_type="apo_zero"),
    dict(loss_type="apo_down"),
    dict(loss_type="discopop"),
    dict(loss_type="sft"),
    dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),  # MPO
    dict(loss_type=["sigmoid", "ipo"]),  # ipo averages its own term's logps only
    dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),  # RPO
    dict(loss_type="hinge", beta=2.0),
]


@pytest.mark.parametrize("kw", DPO_CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_dpo_matches_trl(models, kw):
    model, ref_model = models
    ids, attn, mask = pair_batch()
    cfg = PreferenceConfig(**kw)
    trl = TrlDpo(**kw)
    compare(
        model,
        lambda: preference_loss(cfg, paired(model, ref_model, ids, attn, mask)),
        lambda: trl.get_batch_loss_metrics(model, ref_model, ids, attn, mask),
    )


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_matches_trl(models, beta):
    model, ref_model = models
    ids, attn, mask = pair_batch()
    cfg = PreferenceConfig(stage="orpo", beta=beta)
    compare(
        model,
        lambda: preference_loss(cfg, paired(model, ref_model, ids, attn, mask)),
        lambda: trl_orpo(model, ids, attn, mask, beta),
    )


@pytest.mark.parametrize(
    "kw", [dict(), dict(cpo_alpha=0.0, simpo_gamma=1.0, beta=2.0), dict(label_smoothing=0.1, beta=2.5)]
)
def test_simpo_matches_trl(models, kw):
    model, ref_model = models
    ids, attn, mask = pair_batch()
    cfg = PreferenceConfig(stage="simpo", **kw)
    args = dict(beta=0.1, simpo_gamma=0.5, cpo_alpha=1.0, label_smoothing=0.0) | kw
    skip = {"nll_loss"} if cfg.cpo_alpha == 0 else set()  # TRL reports 0 when it does not use the NLL
    compare(
        model,
        lambda: preference_loss(cfg, paired(model, ref_model, ids, attn, mask)),
        lambda: trl_simpo(model, ids, attn, mask, **args),
        skip_metrics=skip,
    )


# ------------------------------------------------------------------------ KTO
LABELS = [True, False, True, False, True]


def kto_batch():
    """Examples (prompt + completion) and their KL sequences: example i's prompt with example
    i-1's completion, as TRL's _get_kl_dataset pairs them."""
    g = torch.Generator().manual_seed(4)  # a seed where the policy's KL estimate is above 0
    prompts = [torch.randint(1, V, (n,), generator=g) for n in (3, 4, 2, 5, 3)]
    completions = [torch.randint(1, V, (n,), generator=g) for n in (4, 2, 3, 5, 2)]
    seqs = [(p, c) for p, c in zip(prompts, completions)]
    kl = [(p, completions[i - 1]) for i, p in enumerate(prompts)]
    return _padded(seqs), _padded(kl)


def _padded(seqs):
    T = max(len(p) + len(c) for p, c in seqs)
    ids = torch.zeros(len(seqs), T, dtype=torch.long)
    attn = torch.zeros_like(ids)
    mask = torch.zeros_like(ids, dtype=torch.bool)
    for i, (p, c) in enumerate(seqs):
        ids[i, : len(p) + len(c)] = torch.cat((p, c))
        attn[i, : len(p) + len(c)] = 1
        mask[i, len(p) : len(p) + len(c)] = True
    return ids, attn, mask


def _trl_logps(m, ids, attn, mask):
    return trl_get_batch_logps(m(ids, attention_mask=attn).logits, torch.where(mask, ids, -100), False)


def trl_kl(model, ref_model, kl_seqs):
    """One process's KL estimate of a batch (KTOTrainer's `kl` before the gather)."""
    with torch.no_grad():
        return (_trl_logps(model, *kl_seqs) - _trl_logps(ref_model, *kl_seqs)).mean().detach()


def trl_kto(
    model, ref_model, seqs, kl_seqs, beta, loss_type, desirable_weight, undesirable_weight, labels=LABELS,
    gathered=None,
):  # fmt: skip
    """KTOTrainer.forward, kto_loss and get_batch_loss_metrics (the metrics' sums over counts).
    `gathered`: the KL estimates of every process's batch (accelerator.gather(kl)); None: one
    process."""
    logps = _trl_logps
    labels = torch.tensor(labels)
    with torch.no_grad():
        ref_all = logps(ref_model, *seqs)
    all_logps = logps(model, *seqs)
    chosen, rejected = all_logps[labels], all_logps[~labels]
    if loss_type == "kto":
        kl = trl_kl(model, ref_model, kl_seqs) if gathered is None else gathered.mean()
        kl = kl.clamp(min=0)
    else:
        kl = torch.zeros(1)
    cl, rl = chosen - ref_all[labels], rejected - ref_all[~labels]
    if loss_type == "kto":
        chosen_losses, rejected_losses = 1 - F.sigmoid(beta * (cl - kl)), 1 - F.sigmoid(beta * (kl - rl))
    else:
        chosen_losses, rejected_losses = 1 - F.sigmoid(beta * cl), F.sigmoid(beta * rl)
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses), 0)
    metrics = {
        "kl": kl.item(),
        "rewards/chosen": (beta * cl.detach()).nansum() / labels.sum(),
        "logps/chosen": chosen.nansum() / labels.sum(),
        "count/chosen": labels.sum(),
        "rewards/rejected": (beta * rl.detach()).nansum() / (~labels).sum(),
        "logps/rejected": rejected.nansum() / (~labels).sum(),
        "count/rejected": (~labels).sum(),
    }
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return losses.nanmean(), metrics


def unpaired(model, ref_model, seqs, kl_seqs):
    def sums(m, ids, attn, mask):
        return sequence_logps(m(ids, attention_mask=attn).logits, ids, mask)

    logps, lengths, logit_sums = sums(model, *seqs)
    with torch.no_grad():
        ref, kl, ref_kl = sums(ref_model, *seqs)[0], sums(model, *kl_seqs)[0], sums(ref_model, *kl_seqs)[0]
    return UnpairedLogps(logps, lengths, torch.tensor(LABELS), ref, kl, ref_kl, logit_sums)


@pytest.mark.parametrize(
    "kw",
    [
        dict(),
        dict(desirable_weight=1.33, undesirable_weight=0.7, beta=0.5),
        dict(loss_type="apo_zero_unpaired"),
    ],
)
def test_kto_matches_trl(models, kw):
    model, ref_model = models
    seqs, kl_seqs = kto_batch()
    cfg = PreferenceConfig(stage="kto", **kw)
    args = dict(beta=0.1, loss_type="kto", desirable_weight=1.0, undesirable_weight=1.0) | kw
    compare(
        model,
        lambda: preference_loss(cfg, unpaired(model, ref_model, seqs, kl_seqs)),
        lambda: trl_kto(model, ref_model, seqs, kl_seqs, **args),
    )
    if cfg.needs_kl:  # the KL term is exercised, not clamped away
        assert preference_loss(cfg, unpaired(model, ref_model, seqs, kl_seqs))[1]["kl"] > 0


# ------------------------------------------------------------------------ the engine's path
def per_token(model, ids, attn):
    """Token log-probs (batch, T-1) as the engine computes them, one per predicted token."""
    logits = model(ids, attention_mask=attn).logits[:, :-1]
    return selective_log_softmax(logits, ids[:, 1:])


@pytest.mark.parametrize(
    "kw",
    [
        dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),
        dict(loss_type=["ipo", "bco_pair"]),
        dict(loss_type="aot"),
        dict(stage="orpo"),
        dict(stage="simpo", beta=2.0),
    ],
)
def test_chain_rule_through_token_logps_equals_autograd(models, kw):
    """loss_and_grads' d loss / d (sequence sums), spread over each sequence's tokens, gives the
    same parameter gradients as autograd through the whole loss."""
    model, ref_model = models
    ids, attn, mask = pair_batch()
    n = len(ids) // 2
    cfg = PreferenceConfig(**kw)
    expected_loss, _ = preference_loss(cfg, paired(model, ref_model, ids, attn, mask))
    expected = torch.autograd.grad(expected_loss, params(model))

    lp = per_token(model, ids, attn)
    m, pm = mask[:, 1:].float(), (attn.bool() & ~mask)[:, 1:].float()
    sums, p_sums = (lp.detach() * m).sum(-1), (lp.detach() * pm).sum(-1)
    with torch.no_grad():
        ref = (per_token(ref_model, ids, attn) * m).sum(-1)
    batch = PairedLogps(sums[:n], sums[n:], m.sum(-1)[:n], m.sum(-1)[n:], ref[:n], ref[n:],
                        chosen_prompt_logps=p_sums[:n], chosen_prompt_lengths=pm.sum(-1)[:n])  # fmt: skip
    res = loss_and_grads(cfg, batch)
    token_grad = torch.cat((res.grads["chosen_logps"], res.grads["rejected_logps"]))[:, None] * m
    token_grad[:n] += res.grads["chosen_prompt_logps"][:, None] * pm[:n]
    got = torch.autograd.grad(lp, params(model), grad_outputs=token_grad)
    torch.testing.assert_close(res.loss, expected_loss.detach(), **TOL)
    assert any(g.abs().sum() > 0 for g in got)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, **TOL)


def test_kto_grads_are_per_example(models):
    model, ref_model = models
    seqs, kl_seqs = kto_batch()
    cfg = PreferenceConfig(stage="kto")
    batch = unpaired(model, ref_model, seqs, kl_seqs)
    res = loss_and_grads(cfg, batch)
    logps = batch.logps.detach().requires_grad_()
    loss, _ = preference_loss(cfg, UnpairedLogps(logps, batch.lengths, batch.labels, batch.ref_logps,
                                                 batch.kl_logps, batch.ref_kl_logps))  # fmt: skip
    torch.testing.assert_close(res.grads["logps"], torch.autograd.grad(loss, logps)[0])
    assert set(res.grads) == {"logps"} and (res.grads["logps"] != 0).all()


# ------------------------------------------------------------------------ config
def test_config_defaults_are_trls():
    cfg, simpo = PreferenceConfig(), PreferenceConfig(stage="simpo")
    assert (cfg.stage, cfg.beta, cfg.loss_type, cfg.label_smoothing) == ("dpo", 0.1, ["sigmoid"], 0)
    assert cfg.truncation_mode == "keep_start"  # TRL 1.16's DPOConfig; dpo and kto take max_length alone
    assert PreferenceConfig(stage="orpo").truncation_mode == "keep_start"  # ORPOConfig: max_length alone
    assert PreferenceConfig(stage="kto").loss_type == ["kto"]
    assert (simpo.loss_type, simpo.cpo_alpha, simpo.simpo_gamma) == (["simpo"], 1.0, 0.5)
    assert PreferenceConfig(stage="orpo").needs_reference is False


@pytest.mark.parametrize("stage", ["dpo", "kto", "orpo", "simpo"])
def test_a_validated_config_validates_again(stage):
    """A config rebuilt from its own fields (as from a saved train_config.json) is the same."""
    cfg = PreferenceConfig(stage=stage)
    assert dataclasses.replace(cfg) == cfg


@pytest.mark.parametrize(
    "kw, key",
    [
        (dict(stage="ppo"), "stage"),
        (dict(beta=0.0), "beta"),
        (dict(beta=float("nan")), "beta"),
        (dict(loss_type="kto"), "loss_type"),
        (dict(loss_type=["sigmoid", "nope"]), "loss_type"),
        (dict(loss_type=[]), "loss_type"),
        (dict(stage="kto", loss_type="sigmoid"), "loss_type"),
        (dict(stage="kto", loss_type=["kto", "kto"]), "loss_type"),
        (dict(stage="simpo", loss_type="ipo"), "loss_type"),
        (dict(stage="orpo", loss_type="sigmoid"), "loss_type"),
        (dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0]), "loss_weights"),
        (dict(stage="kto", loss_weights=[1.0]), "loss_weights"),
        (dict(label_smoothing=0.6), "label_smoothing"),
        (dict(loss_type="robust", label_smoothing=0.5), "label_smoothing"),
        (dict(loss_type="exo_pair"), "label_smoothing"),
        (dict(discopop_tau=0.0), "discopop_tau"),
        (dict(cpo_alpha=-0.1), "cpo_alpha"),
        (dict(desirable_weight=0.0, undesirable_weight=0.0), "desirable_weight"),
        (dict(stage="simpo", truncation_mode="keep_end"), "truncation_mode"),
        (dict(truncation_mode="keep_middle"), "truncation_mode"),
    ],
)
def test_config_errors_name_the_key(kw, key):
    with pytest.raises(ConfigError, match=rf"^{key}: [^\n]*$"):
        PreferenceConfig(**kw)


def test_missing_inputs_are_refused():
    x = torch.tensor([-3.0, -4.0])
    n = torch.tensor([2.0, 3.0])
    with pytest.raises(ValueError, match="reference log-probs"):
        preference_loss(PreferenceConfig(), PairedLogps(x, x, n, n))
    with pytest.raises(ValueError, match="chosen_prompt_logps"):
        preference_loss(PreferenceConfig(stage="orpo"), PairedLogps(x, x, n, n))
    with pytest.raises(ValueError, match="kl_logps"):
        preference_loss(PreferenceConfig(stage="kto"), UnpairedLogps(x, n, torch.tensor([True, False]), x))
