"""RLOO (`stage: rloo`) against TRL 1.16's RLOOTrainer: its advantages against a transcription of
`_generate_and_score_completions` (NaN rewards, groups of one scorable completion); three
optimizer steps (gradient accumulation, clipping, AdamW) against a plain PyTorch loop of TRL's
formulas over the completions megatrain sampled (read back from completions.jsonl); and TRL's
RLOOTrainer itself trained on those completions (its generation patched to return them)."""

from __future__ import annotations

import json

import pytest
import test_grpo
import torch
from helpers import saved_parameters, tiny_tokenizer
from test_grpo import (
    EPS,
    GA,
    LR,
    LR_AGAIN,
    MAX_NEW,
    MAX_NORM,
    SEED,
    STEPS,
    WD,
    B,
    model,
    run,
    slices_of,
    trl_inputs,
    trl_logps,
    two_against_one,
    write_eval_prompts,
)
from test_parity import _decay_groups

from megatrain.config import TrainConfig
from megatrain.errors import ConfigError
from megatrain.objectives.rloo import RLOOConfig, advantages
from megatrain.rl.rollout import ROLLOUT_FILE, generation_order
from megatrain.trackers import is_eval

G = 4  # test_grpo's runs: 4 completions a prompt
WEIGHTS = [-0.05, 1.0]  # test_grpo's runs: length, exact_match


@pytest.fixture
def setup(tmp_path):
    """test_grpo's tiny Llama, its tokenizer and 12 prompts in `tmp_path`."""
    return test_grpo.setup.__wrapped__(tmp_path)


def sometimes(completions, **_):
    """A reward function that skips some completions (None: TRL's unscorable where it is the only one)."""
    return [None if len(c) % 3 == 0 else float(len(c)) for c in completions]


# ------------------------------------------------------------------------ TRL, transcribed
def nanstd(tensor, dim=None, keepdim=False):
    """trl.trainer.utils.nanstd."""
    mean = torch.nanmean(tensor, dim=dim, keepdim=True)
    variance = torch.nanmean((tensor - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(tensor), dim=dim, keepdim=True)
    correction = count / (count - 1)
    correction = torch.where(count > 1, correction, torch.full_like(correction, float("nan")))
    variance *= correction
    std = torch.sqrt(variance)
    return std if keepdim else std.squeeze(dim) if dim is not None else std.squeeze()


def trl_advantages(rewards_per_func, weights, g, kl=None, beta=0.0, normalize=False, clip=None):
    """RLOOTrainer._generate_and_score_completions (TRL 1.16): (advantages, metrics)."""
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * torch.tensor(weights, dtype=rewards_per_func.dtype).unsqueeze(0)).nansum(
        dim=1
    )
    rewards[unscorable_mask] = torch.nan
    if clip:
        rewards = rewards.clamp(min=clip[0], max=clip[1])
    if beta != 0.0:
        rewards = rewards - beta * kl
    grouped_rewards = rewards.view(-1, g)
    mean_grouped_rewards = torch.nanmean(grouped_rewards, dim=1)
    if g > 1:
        std_rewards = nanstd(grouped_rewards, dim=1)
    else:
        std_rewards = torch.zeros_like(mean_grouped_rewards)
    scorable_counts = (~torch.isnan(grouped_rewards)).sum(dim=1, keepdim=True)
    grouped_sum = torch.nansum(grouped_rewards, dim=1, keepdim=True)
    if g > 1:
        baselines = (grouped_sum - grouped_rewards) / (scorable_counts - 1)
        advantages = rewards - baselines.view(-1)
    else:
        advantages = torch.zeros_like(rewards)
    if normalize:
        advantages = (advantages - torch.nanmean(advantages)) / (nanstd(advantages) + 1e-4)
    advantages = torch.nan_to_num(advantages, nan=0.0)
    is_std_zero = torch.isclose(std_rewards, torch.zeros_like(std_rewards))
    logged = (rewards_per_func * torch.tensor(weights, dtype=rewards_per_func.dtype).unsqueeze(0)).nansum(
        dim=1
    )
    logged[unscorable_mask] = torch.nan
    metrics = {
        "reward": torch.nanmean(logged).item(),
        "reward_std": nanstd(logged).item(),
        "frac_reward_zero_std": is_std_zero.float().mean().item(),
    }
    return advantages, metrics


def trl_loss(logps, entropy, cmask, adv, old, eps=0.2, eps_high=0.2):
    """RLOOTrainer._compute_loss for one micro-batch: its loss (before the Trainer's division by
    gradient_accumulation_steps) and its metrics."""
    log_ratio = (logps * cmask).sum(1) - old
    coef_1 = torch.exp(log_ratio)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps_high)
    loss = -torch.min(coef_1 * adv, coef_2 * adv).mean()
    low, high = (coef_1 < 1 - eps) & (adv < 0), (coef_1 > 1 + eps_high) & (adv > 0)
    metrics = {
        "entropy": float((entropy * cmask).sum() / cmask.sum().clamp(min=1.0)),
        "clip_ratio/low_mean": float(low.float().mean()),
        "clip_ratio/low_min": float(low.float().min()),
        "clip_ratio/high_mean": float(high.float().mean()),
        "clip_ratio/high_max": float(high.float().max()),
        "clip_ratio/region_mean": float((low | high).float().mean()),
    }
    return loss, metrics


def reward_table(rollouts, funcs):
    """The per-function rewards of the recorded completions, computed here (NaN for None)."""

    def one(name, text, answer):
        if name == "length":
            return float(len(text))
        if name == "exact_match":
            return float(text.strip() == answer)
        value = sometimes([text])[0]
        return float("nan") if value is None else value

    return torch.tensor(
        [[one(f, r["completion"], str(int(r["prompt"].split()[1]))) for f in funcs] for r in rollouts],
        dtype=torch.float64,
    )


def recorded(rollouts):
    """The per-function rewards megatrain recorded, in the functions' order (NaN for None)."""
    return torch.tensor(
        [[float("nan") if v is None else v for v in r["rewards"].values()] for r in rollouts],
        dtype=torch.float64,
    )


def plain_run(tok, rollouts, steps, kw):
    """RLOOTrainer's training, plainly, on the completions megatrain sampled, micro-batch by
    micro-batch as its `_prepare_inputs` buffers them: each generation batch's sampling policy's
    and reference's log-probs taken once (the KL penalty in its rewards), its advantages, then
    shuffled (the run's permutation) and split into steps_per_generation micro-batches; each
    micro-batch's loss / gradient_accumulation_steps back-propagated; clip_grad_norm_ and AdamW a
    step. Each step's loss, grad_norm and metrics, and the trained model."""
    hf, ref_model = model(len(tok)), model(len(tok))
    lr, k, beta = kw.get("learning_rate", LR), kw.get("num_iterations", 1), kw.get("beta", 0.05)
    funcs, weights = kw.get("reward_funcs", ["length", "exact_match"]), kw.get("reward_weights", WEIGHTS)
    mask_truncated, temperature = kw.get("mask_truncated_completions", False), kw.get("temperature", 1.0)
    slices, eps = slices_of(kw), kw.get("epsilon", 0.2)
    opt = torch.optim.AdamW(_decay_groups(hf, WD), lr=lr, betas=(0.9, 0.999), eps=EPS)
    pending, out = iter(rollouts), []
    for step in range(1, steps + 1):
        sampled, loss, metrics = [], 0.0, []
        for micro in range((step - 1) * GA, step * GA):
            if micro % (slices * k) == 0:
                batch = [next(pending) for _ in range(B * slices)]
                assert all(r["step"] == step for r in batch)
                rewards = reward_table(batch, funcs)
                torch.testing.assert_close(recorded(batch), rewards, equal_nan=True)
                rows = [(tok(r["prompt"])["input_ids"], r["completion_ids"], r["truncated"]) for r in batch]
                ids, attn, cmask = trl_inputs(rows, mask_truncated)
                with torch.no_grad():
                    old_tok = trl_logps(hf, ids, attn, temperature)[0]
                    kl_tok = old_tok - trl_logps(ref_model, ids, attn, temperature)[0]
                old, kl = (old_tok * cmask).sum(1), (kl_tok * cmask).sum(-1)
                adv, m = trl_advantages(rewards, weights, G, kl.double(), beta, kw.get("normalize_advantages", False),
                                        kw.get("reward_clip_range"))  # fmt: skip
                torch.testing.assert_close(
                    adv.float(), torch.tensor([r["advantage"] for r in batch]), rtol=1e-5, atol=1e-5
                )
                if beta:
                    m["kl"] = float((kl_tok * cmask).sum() / cmask.sum().clamp(min=1.0))
                sampled.append(m)
                order = generation_order(kw.get("seed", SEED), micro // (slices * k), len(rows))
                rows, adv, old = [rows[i] for i in order.tolist()], adv[order].float(), old[order]
                mbs = [trl_inputs(rows[m * B : (m + 1) * B], mask_truncated) for m in range(slices)]
            m = micro % slices
            ids, attn, cmask = mbs[m]
            logps, entropy = trl_logps(hf, ids, attn, temperature)
            part = slice(m * B, (m + 1) * B)
            lm, mm = trl_loss(logps, entropy, cmask, adv[part], old[part], eps, kw.get("epsilon_high") or eps)
            (lm / GA).backward()
            loss += lm.item() / GA
            metrics.append(mm)
        norm = float(torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_NORM))
        opt.step()
        opt.zero_grad()
        record = {name: sum(g[name] for g in sampled) / len(sampled) for name in (sampled or [{}])[0]}
        means = {name: sum(mm[name] for mm in metrics) / GA for name in metrics[0]}
        out.append(record | means | {"loss": loss, "grad_norm": norm})
    assert next(pending, None) is None  # every completion sampled was trained on
    return hf, out


def assert_same_weights(final, hf, lr):
    atol = 1e-4 * lr / LR  # a share of what the steps move each weight
    for k, p in saved_parameters(hf).items():
        torch.testing.assert_close(final[k], p.detach(), rtol=1e-4, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
    start = saved_parameters(model(len(tiny_tokenizer())))
    assert any(not torch.equal(final[k], start[k].detach()) for k in final)


# ------------------------------------------------------------------------ advantages
def reward_cases():
    """[completions, functions] rewards of 4 groups of 4: plain; a None here and there; a group
    with one scorable completion (a None of both functions elsewhere); a group none of whose
    completions is scorable."""
    g = torch.Generator().manual_seed(0)
    r = torch.randn(16, 2, generator=g, dtype=torch.float64)
    r[1, 0] = r[6, 1] = float("nan")  # one function skipped: scorable still
    r[8:11] = float("nan")  # group 3: only its last completion is scorable
    r[12:16] = float("nan")  # group 4: none
    r[5] = float("nan")  # unscorable in group 2
    return r


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(normalize_advantages=True), dict(reward_clip_range=[-0.5, 0.7], beta=0.1),
     dict(beta=0.05, normalize_advantages=True, reward_clip_range=[-1.0, 1.0]), dict(group=1), dict(group=2)],
    ids=["plain", "normalized", "clipped-kl", "all", "groups-of-one", "groups-of-two"],
)  # fmt: skip
def test_the_advantages_are_trls(kw):
    """RLOO's advantages and reward metrics equal TRL's code over rewards with None (NaN) values,
    unscorable completions (advantage 0, out of their siblings' baselines), a group with one
    scorable completion (0), one with none, with the KL penalty, clipping and normalisation, and
    an evaluation's groups of one."""
    group = kw.pop("group", None)
    cfg = RLOOConfig(reward_weights=[0.5, 2.0], per_device_train_batch_size=16, num_generations=4, **kw)
    r = reward_cases()
    kl = torch.rand(16, 2, generator=torch.Generator().manual_seed(1), dtype=torch.float64) * 5
    kl[:, 1] = 7.0  # tokens
    _, adv, metrics = advantages(cfg, r, group, kl if cfg.beta > 0 else None)
    want, want_metrics = trl_advantages(r, [0.5, 2.0], group or 4, kl[:, 0], cfg.beta if cfg.beta else 0.0,
                                        cfg.normalize_advantages, cfg.reward_clip_range)  # fmt: skip
    torch.testing.assert_close(adv, want, rtol=1e-12, atol=1e-12)
    assert not adv.isnan().any() and adv[12:16].eq(0).all() and adv[5] == 0 and adv[8:11].eq(0).all()
    if group is None and not cfg.normalize_advantages:
        assert adv[11] == 0  # the only scorable completion of its group: no baseline
        assert adv[0] != 0
    for name, value in want_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-12, nan_ok=True), name
    if cfg.beta > 0:
        assert metrics["kl"] == pytest.approx(float(kl[:, 0].sum() / kl[:, 1].sum()))


# ------------------------------------------------------------------------ training
CASES = [
    dict(), dict(beta=0.0), dict(num_iterations=2, learning_rate=LR_AGAIN),
    dict(mask_truncated_completions=True, normalize_advantages=True, reward_clip_range=[-0.9, 0.0]),
    dict(reward_funcs=["test_rloo:sometimes"], reward_weights=[-0.05]),
    dict(steps_per_generation=2 * GA, temperature=0.7, epsilon_high=0.28),
    dict(share_prompts=True, num_iterations=2, learning_rate=LR_AGAIN),  # each prompt once in the layers
]  # fmt: skip


@pytest.mark.parametrize(
    "kw", CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "defaults"
)
def test_rloo_trains_as_trls_formula(setup, kw):
    """Three optimizer steps of two micro-batches (max_grad_norm clipping, AdamW) of stage rloo equal
    a plain PyTorch loop of TRL's formulas on the same completions: each step's loss, grad_norm,
    reward and loss metrics, each completion's advantage, and the final weights; with TRL's
    defaults (beta 0.05: the KL penalty to the initial policy), without the penalty, a rollout
    trained twice (the clip acting), truncated completions masked with clipped, normalised
    advantages, a reward function that skips completions, and a generation batch over two steps."""
    tmp_path, tok = setup
    records, rollouts, final = run(tmp_path, stage="rloo", **kw)
    got = [r for r in records if "loss" in r]
    hf, want = plain_run(tok, rollouts, STEPS, kw)
    assert len(got) == len(want) == STEPS
    for rec, expected in zip(got, want):
        for name, value in expected.items():
            assert rec[name] == pytest.approx(value, rel=1e-4, abs=1e-6, nan_ok=True), (rec["step"], name)
        assert ("kl" in rec) == (kw.get("beta", 0.05) > 0 and "reward" in rec)  # a rollout's metric
    if kw.get("num_iterations"):  # a rollout trained again: the ratio moved, the clip bound
        assert any(r["clip_ratio/region_mean"] > 0 for r in got)
        assert any(abs(r["loss"]) > 1e-3 for r in got)
    if "reward_funcs" in kw:  # some completions unscorable: advantage 0
        assert any(list(r["rewards"].values()) == [None] and r["advantage"] == 0 for r in rollouts)
    assert_same_weights(final, hf, kw.get("learning_rate", LR))


# ------------------------------------------------------------------------ TRL's RLOOTrainer itself
def test_trls_rloo_trainer_on_the_same_completions_trains_alike(setup, monkeypatch):
    """TRL's RLOOTrainer (CPU, fp32), its generation patched to return the completions megatrain
    sampled for the same prompts and its shuffle to megatrain's permutation, with the same reward
    functions, reference (the initial policy), accumulation, clipping and AdamW: three steps, the
    rollout trained twice, give each step's loss within 1e-5 relative (1e-7 absolute where the
    fresh rollout's loss is a sum of advantages, 0), the same grad_norm and metrics, and the same
    final weights."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from trl.trainer import rloo_trainer

    tmp_path, tok = setup
    kw = dict(num_iterations=2, learning_rate=LR_AGAIN)
    records, rollouts, final = run(tmp_path, stage="rloo", **kw)
    pending = iter(rollouts)

    seen = []  # TRL's num_input_tokens_seen after each generation batch (counted in `_generate`)

    def generate(self, prompts):  # RLOOTrainer._generate: megatrain's completions of these prompts
        recs = [next(pending) for _ in prompts]
        assert [r["prompt"] for r in recs] == prompts
        ids = [tok(p)["input_ids"] for p in prompts]
        completion_ids = [r["completion_ids"] for r in recs]
        total_prompt_tokens = torch.tensor([len(i) for i in ids]).sum()  # TRL's count, transcribed
        seen.append((seen[-1] if seen else 0) + (total_prompt_tokens + sum(map(len, completion_ids))).item())
        return ids, completion_ids, [r["completion"] for r in recs]

    generations = iter(range(STEPS))

    def shuffle(batch):  # shuffle_sequence_dict, by the run's permutation of the generation batch
        order = generation_order(SEED, next(generations), len(batch["advantages"]))
        return {k: v[order] if isinstance(v, torch.Tensor) and v.dim() else v for k, v in batch.items()}

    losses = []
    compute_loss = rloo_trainer.RLOOTrainer._compute_loss

    def recorded_loss(self, model, inputs):  # each micro-batch's, unrounded
        loss = compute_loss(self, model, inputs)
        losses.append(loss.item())
        return loss

    monkeypatch.setattr(rloo_trainer.RLOOTrainer, "_generate", generate)
    monkeypatch.setattr(rloo_trainer.RLOOTrainer, "_compute_loss", recorded_loss)
    monkeypatch.setattr(rloo_trainer, "shuffle_sequence_dict", shuffle)

    def length(completions, **_):
        return [float(len(c)) for c in completions]

    def exact_match(completions, answer, **_):
        return [float(c.strip() == a) for c, a in zip(completions, answer)]

    prompts = [json.loads(x) for x in (tmp_path / "prompts.jsonl").read_text().splitlines()]
    args = trl.RLOOConfig(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=B, gradient_accumulation_steps=GA,
        num_generations=G, max_completion_length=MAX_NEW, learning_rate=LR_AGAIN, lr_scheduler_type="constant",
        weight_decay=WD, max_grad_norm=MAX_NORM, adam_epsilon=EPS, max_steps=STEPS, logging_steps=1,
        num_iterations=2, reward_weights=WEIGHTS, bf16=False, use_cpu=True, gradient_checkpointing=False,
        shuffle_dataset=False, report_to="none", save_strategy="no", optim="adamw_torch", seed=SEED,
        model_init_kwargs={"dtype": torch.float32},
    )  # fmt: skip
    trainer = rloo_trainer.RLOOTrainer(
        model=str(tmp_path / "model"), reward_funcs=[length, exact_match], args=args,
        train_dataset=datasets.Dataset.from_list(prompts), processing_class=tok,
    )  # fmt: skip
    trainer.train()
    assert next(pending, None) is None  # every completion megatrain sampled, trained on
    theirs = [h for h in trainer.state.log_history if "loss" in h and "step" in h]
    got = [r for r in records if "loss" in r]
    assert len(theirs) == len(got) == STEPS
    for step, (ours, trls) in enumerate(zip(got, theirs), 1):
        want = sum(losses[(step - 1) * GA : step * GA]) / GA
        assert trls["loss"] == pytest.approx(want, rel=1e-6)
        assert ours["loss"] == pytest.approx(want, rel=1e-5, abs=1e-7), step
        names = [
            "grad_norm",
            "entropy",
            "clip_ratio/region_mean",
            "clip_ratio/low_mean",
            "clip_ratio/high_mean",
        ]
        if "reward" in ours:  # a step that sampled
            names += ["reward", "reward_std", "frac_reward_zero_std", "kl"]
        for name in names:
            # kl: a mean of log-prob differences (~1e-2 from terms ~5), so fp32's rounding of the
            # log-probs (~5e-7) is its floor, not 1e-5 of it
            tol = 1e-6 if name == "kl" else 1e-7
            assert ours[name] == pytest.approx(trls[name], rel=1e-5, abs=tol), (step, name)
    # num_tokens: each generation batch's prompt and completion tokens, once (not when trained again)
    assert [r["num_tokens"] for r in got if "reward" in r] == seen
    assert all(r["num_tokens"] == got[i - 1]["num_tokens"] for i, r in enumerate(got) if "reward" not in r)
    assert abs(got[1]["loss"]) > 1e-3 and got[1]["clip_ratio/region_mean"] > 0  # the rollout trained again
    for k, p in saved_parameters(trainer.model).items():
        torch.testing.assert_close(final[k], p.detach(), rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


# ------------------------------------------------------------------------ settings
def test_the_defaults_and_the_generation_batch_are_trls_rlooconfig():
    """stage rloo's defaults are TRL 1.16 RLOOConfig's (num_generations 2, beta 0.05,
    max_completion_length 512, epsilon 0.2, normalize_advantages off), and its generation batch
    is derived as RLOOConfig derives it."""
    trl = pytest.importorskip("trl")
    base = dict(model_config="unused", stage="rloo", reward_funcs=["length"])
    ours = TrainConfig(**base, per_device_train_batch_size=4).grpo()
    theirs = trl.RLOOConfig(
        output_dir="unused", use_cpu=True, report_to="none", per_device_train_batch_size=4
    )
    for name in ("num_generations", "beta", "max_completion_length", "epsilon", "epsilon_high", "num_iterations",
                 "normalize_advantages", "reward_clip_range", "temperature", "top_p", "mask_truncated_completions"):  # fmt: skip
        want = getattr(theirs, name)
        want = want if name != "epsilon_high" or want is not None else theirs.epsilon
        assert getattr(ours, name) == want, name
    assert (
        isinstance(ours, RLOOConfig)
        and TrainConfig(**base | dict(stage="grpo", per_device_train_batch_size=8)).grpo().num_generations
        == 8
    )
    for shape in (dict(steps_per_generation=8), dict(generation_batch_size=24, num_generations=6), dict()):
        shape = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2) | shape
        theirs = trl.RLOOConfig(output_dir="unused", use_cpu=True, report_to="none", **shape)
        ours = TrainConfig(**base, **shape).grpo()
        assert (ours.steps_per_generation, ours.generation_batch_size) == (
            theirs.steps_per_generation,
            theirs.generation_batch_size,
        )


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(stage="rloo", loss_type="dapo"), r"^loss_type: is stage grpo's, not in TRL's trainer of stage rloo: "),
        (dict(stage="rloo", scale_rewards="none"), r"^scale_rewards: is stage grpo's, not in TRL's trainer of stage "
         r"rloo: RLOO's advantage is the leave-one-out baseline; normalize_advantages scales it \(got 'none'\)$"),
        (dict(stage="grpo", normalize_advantages=True), r"^normalize_advantages: is stage rloo's, not in TRL's "),
        (dict(stage="grpo", reward_clip_range=[0, 1]), r"^reward_clip_range: is stage rloo's"),
        (dict(stage="rloo", reward_clip_range=[1, 0]), r"^reward_clip_range: must be \[low, high\] with low <= high"),
        (dict(stage="rloo", beta=-1), r"^beta: must be >= 0 with stage rloo"),
        (dict(stage="rloo", num_generations=1), r"^num_generations: must be >= 2"),
    ],
)  # fmt: skip
def test_keys_of_the_other_stage_are_one_line(kw, match):
    with pytest.raises(ConfigError, match=match):
        TrainConfig(model_config="unused", reward_funcs=["length"], per_device_train_batch_size=4, **kw)


# ------------------------------------------------------------------------ resume, evaluation
def test_resume_in_the_middle_of_a_rollout_trains_as_the_uninterrupted_run(setup):
    """A run stopped after step 1 of a rollout trained twice (the KL penalty on) resumes on the
    rollout its checkpoint holds: bitwise the uninterrupted run's losses, completions and weights."""
    tmp_path, _ = setup
    kw = dict(stage="rloo", num_iterations=2, learning_rate=LR_AGAIN, save_strategy="steps", save_steps=1)
    whole_records, whole_rollouts, whole = run(tmp_path, "whole", **kw)
    assert (tmp_path / "whole" / "checkpoint-1" / ROLLOUT_FILE).is_file()
    run(tmp_path, "cut", max_steps=1, **kw)
    records, rollouts, resumed = run(tmp_path, "cut", resume_from_checkpoint=True, **kw)
    assert [r["loss"] for r in records] == [r["loss"] for r in whole_records]
    assert [r["completion_ids"] for r in rollouts] == [r["completion_ids"] for r in whole_rollouts]
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


def test_the_eval_metrics_are_trls(setup):
    """At an evaluation (one eval batch of every eval completion, as TRL's eval batch), stage
    rloo's eval metrics are TRL's computed plainly with the weights evaluated: the reward
    metrics, eval_kl (the KL penalty's, the policy's log-probs less the reference's over the
    tokens), each completion's advantage, eval_entropy and eval_loss (the ratio 1)."""
    import transformers

    tmp_path, tok = setup
    path = write_eval_prompts(tmp_path)
    records, _, _ = run(
        tmp_path, stage="rloo", max_steps=1, eval_dataset=path, per_device_eval_batch_size=3 * G
    )
    (got,) = [r for r in records if is_eval(r)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "final", dtype=torch.float32)
    samples = [json.loads(x) for x in (tmp_path / "out" / "eval_completions.jsonl").read_text().splitlines()]
    rows = [(tok(r["prompt"])["input_ids"], r["completion_ids"], r["truncated"]) for r in samples]
    ids, attn, cmask = trl_inputs(rows, False)
    with torch.no_grad():
        logps, entropy = trl_logps(hf.eval(), ids, attn, 1.0)
        kl_tok = logps - trl_logps(model(len(tok)).eval(), ids, attn, 1.0)[0]
    rewards = reward_table(samples, ["length", "exact_match"])
    adv, want = trl_advantages(rewards, WEIGHTS, G, (kl_tok * cmask).sum(-1).double(), 0.05)
    loss, metrics = trl_loss(logps, entropy, cmask, adv.float(), (logps * cmask).sum(1))
    want |= metrics | {"kl": float((kl_tok * cmask).sum() / cmask.sum()), "loss": float(loss)}
    for name, value in want.items():
        assert got[f"eval_{name}"] == pytest.approx(value, rel=1e-5, abs=1e-6), name
    assert got["eval_kl"] > 0  # the weights moved from the reference
    assert [r["advantage"] for r in samples] == pytest.approx(adv.tolist(), abs=1e-5)


@pytest.mark.slow
def test_two_processes_equal_one(setup):
    """The step's prompts split over two gloo processes (each samples its half, the KL penalty and
    the leave-one-out advantages over both halves, the rollout trained twice) and the eval prompts
    (one to the first, two to the second: the ranks' sweeps of the eval log-probs pair up): the
    same completions, losses, grad norms, rewards, kl, eval metrics and weights as one process
    with the same global batch (RLOO's loss is a mean over completions of micro-batches of one
    size, whichever micro-batch they are in)."""
    tmp_path, _ = setup
    kw = dict(stage="rloo", num_iterations=2, learning_rate=LR_AGAIN, eval_dataset=write_eval_prompts(tmp_path),
              eval_steps=2)  # fmt: skip
    keys = ("loss", "grad_norm", "reward", "reward_std", "kl", "clip_ratio/region_mean")
    one, two = two_against_one(tmp_path, keys, advantages=True, **kw)
    got, want = [r for r in two if is_eval(r)], [r for r in one if is_eval(r)]
    assert [r["step"] for r in got] == [r["step"] for r in want] == [2, STEPS]
    for a, b in zip(got, want):
        for k in [k for k in b if k.startswith(("eval_reward", "eval_kl", "eval_loss", "eval_completions/"))]:
            # eval_kl, a small difference of log-probs, keeps the rounding of fp32 sweeps of other shapes
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-6 if k == "eval_kl" else 1e-7), (a["step"], k)
