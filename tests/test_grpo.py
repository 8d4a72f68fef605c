"""GRPO (`stage: grpo`) end to end against TRL 0.27's formulas: the step's completions (read back
from output_dir/completions.jsonl, so sampling noise cannot make the two sides differ) are scored
by the same reward functions, turned into advantages as TRL's `_generate_and_score_completions`
does, and trained by a plain PyTorch loop over the transformers model with TRL's `_compute_loss`
(per-token clipped ratio, aggregated by loss_type, gradient accumulation), clip_grad_norm_ and
torch AdamW. Losses and final weights must agree in fp32. The first step's completions must be
transformers' `generate` with the run's seed."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import saved_parameters, tiny_hf_model, tiny_tokenizer
from safetensors.torch import load_file
from test_parity import _decay_groups

from megatrain.config import TrainConfig
from megatrain.errors import ConfigError
from megatrain.rewards import RewardError
from megatrain.rollout import sampling_seed
from megatrain.trainer import train

B, GA, G, STEPS, MAX_NEW = 4, 2, 4, 3, 10
LR, WD, MAX_NORM = 5e-3, 0.01, 0.5
EPS = 1e-4  # AdamW's: well above the rounding of the smallest gradients, which Adam would amplify


def model(vocab):
    m = tiny_hf_model(
        "llama", seed=0, num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=vocab
    )
    with torch.no_grad():  # a random model that ends some completions early: EOS made likely
        m.lm_head.weight[tiny_tokenizer().eos_token_id] = m.model.norm.weight * 0.4
    return m


@pytest.fixture
def setup(tmp_path):
    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path / "model")
    model(len(tok)).save_pretrained(tmp_path / "model")
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i in range(12):
            f.write(json.dumps({"prompt": f"Say {i} once:", "answer": f"{i}"}) + "\n")
    return tmp_path, tok


def run(tmp_path, name="out", **kw):
    out = tmp_path / name
    args = dict(
        model_name_or_path=str(tmp_path / "model"), dataset=str(tmp_path / "prompts.jsonl"), stage="grpo",
        output_dir=str(out), reward_funcs=["length", "exact_match"], reward_weights=[-0.05, 1.0],
        num_generations=G, max_completion_length=MAX_NEW, per_device_train_batch_size=B,
        gradient_accumulation_steps=GA, max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
        weight_decay=WD, max_grad_norm=MAX_NORM, shuffle=False, save_strategy="no", save_dtype="float32",
        disable_tqdm=True, logging_steps=1, adam_epsilon=EPS,
    )  # fmt: skip
    train(TrainConfig(**(args | kw)))
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    return records, rollouts, load_file(out / "final" / "model.safetensors")


# ------------------------------------------------------------------------ TRL, transcribed
def trl_advantages(rewards_per_func, weights, scale):
    rewards = (rewards_per_func * torch.tensor(weights, dtype=rewards_per_func.dtype)[None]).nansum(1)
    mean = rewards.view(-1, G).mean(1).repeat_interleave(G)
    std = (
        rewards.view(-1, G).std(1).repeat_interleave(G)
        if scale in ("group", "none")
        else rewards.std().expand_as(rewards)
    )
    adv = rewards - mean
    return adv / (std + 1e-4) if scale != "none" else adv


def trl_loss(hf, rows, adv, loss_type, num_items, mask_truncated, temperature=1.0, eps=0.2):
    """GRPOTrainer._compute_loss for one micro-batch of (prompt ids, completion ids, truncated)."""
    width = max(len(p) + len(c) for p, c, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    cmask = torch.zeros(len(rows), width - 1)
    for i, (p, c, cut) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
        if not (cut and mask_truncated):
            cmask[i, len(p) - 1 : len(p) + len(c) - 1] = 1
    logits = hf(ids, attention_mask=attn).logits[:, :-1] / temperature
    logps = logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    coef_1 = torch.exp(logps - logps.detach())
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    a = adv[:, None]
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    if loss_type == "grpo":
        return ((per_token * cmask).sum(-1) / cmask.sum(-1).clamp(min=1.0)).mean() / GA
    if loss_type == "bnpo":
        return (per_token * cmask).sum() / cmask.sum().clamp(min=1.0) / GA
    if loss_type == "dr_grpo":
        return (per_token * cmask).sum() / (per_token.size(0) * MAX_NEW) / GA
    return (per_token * cmask).sum() / num_items  # dapo


def reward_table(rollouts):
    """The per-function rewards megatrain recorded, recomputed here from the completions."""
    out = []
    for r in rollouts:
        text = r["completion"]
        answer = str(int(r["prompt"].split()[1]))
        out.append([float(len(text)), float(text.strip() == answer)])
    return torch.tensor(out, dtype=torch.float64)


@pytest.mark.parametrize(
    "kw",
    [dict(), dict(loss_type="grpo"), dict(loss_type="bnpo", scale_rewards="batch"),
     dict(loss_type="dr_grpo", scale_rewards="none"), dict(mask_truncated_completions=True),
     dict(temperature=0.7, top_k=20)],
    ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "dapo",
)  # fmt: skip
def test_grpo_trains_as_trl(setup, kw):
    tmp_path, tok = setup
    records, rollouts, final = run(tmp_path, **kw)
    steps = [r for r in records if "loss" in r]
    hf = model(len(tok))
    opt = torch.optim.AdamW(_decay_groups(hf, WD), lr=LR, betas=(0.9, 0.999), eps=EPS)
    loss_type, scale = kw.get("loss_type", "dapo"), kw.get("scale_rewards", "group")
    mask_truncated = kw.get("mask_truncated_completions", False)
    for step in range(1, STEPS + 1):
        batch = [r for r in rollouts if r["step"] == step]
        assert len(batch) == B * GA
        rewards = reward_table(batch)
        for r, got in zip(rewards, batch):
            assert [got["rewards"]["length"], got["rewards"]["exact_match"]] == r.tolist()
        adv = trl_advantages(rewards, [-0.05, 1.0], scale).float()
        torch.testing.assert_close(adv, torch.tensor([r["advantage"] for r in batch]), rtol=1e-5, atol=1e-6)
        rows = [(tok(r["prompt"])["input_ids"], r["completion_ids"], r["truncated"]) for r in batch]
        for _, c, cut in rows:  # cut: max_completion_length tokens and no end token
            assert cut == (
                len(c) == MAX_NEW and c[-1] not in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"))
            )
        num_items = sum(len(c) for _, c, cut in rows if not (cut and mask_truncated))
        assert num_items > 0
        if mask_truncated:  # some completions in the loss, some left out
            assert any(cut for *_, cut in rows) and not all(cut for *_, cut in rows)
        loss = 0.0
        for m in range(GA):
            mb = slice(m * B, (m + 1) * B)
            lm = trl_loss(
                hf, rows[mb], adv[mb], loss_type, num_items, mask_truncated, kw.get("temperature", 1.0)
            )
            lm.backward()
            loss += lm.item()
        torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        rec = steps[step - 1]
        assert rec["loss"] == pytest.approx(loss, rel=1e-4, abs=1e-6)
        assert rec["reward"] == pytest.approx(
            float((rewards * torch.tensor([-0.05, 1.0], dtype=torch.float64)).sum(1).mean())
        )
        assert rec["completions/mean_length"] == pytest.approx(sum(len(c) for _, c, _ in rows) / len(rows))
    for k, p in saved_parameters(hf).items():
        torch.testing.assert_close(final[k], p.detach(), rtol=1e-4, atol=1e-4, msg=lambda m, k=k: f"{k}: {m}")
    start = saved_parameters(model(len(tok)))
    assert any(not torch.equal(final[k], start[k].detach()) for k in final)


def test_first_rollout_is_transformers_generate(setup):
    """With the run's seed, the first step's completions are `generate`'s (left-padded prompts,
    each repeated num_generations times, sampled), cut after the first end token."""
    tmp_path, tok = setup
    _, rollouts, _ = run(tmp_path, max_steps=1, seed=7)
    first = [r for r in rollouts if r["step"] == 1]
    prompts = [tok(r["prompt"])["input_ids"] for r in first]
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    hf = model(len(tok)).eval()
    torch.manual_seed(sampling_seed(7, 1))
    out = hf.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                      max_new_tokens=MAX_NEW, eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)  # fmt: skip
    for row, r in zip(out[:, width:].tolist(), first):
        end = next((i for i, t in enumerate(row) if t == tok.eos_token_id), None)
        assert r["completion_ids"] == (row if end is None else row[: end + 1])


def failing_reward(completions, **_):
    raise KeyError("no such column")


def test_a_failing_reward_function_is_one_line(setup):
    tmp_path, _ = setup
    with pytest.raises(RewardError, match=r"reward function test_grpo:failing_reward raised on the batch starting "
                       r"at .*prompts\.jsonl:1: KeyError"):  # fmt: skip
        run(tmp_path, reward_funcs=["test_grpo:failing_reward"], reward_weights=None)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(reward_funcs=None), "reward_funcs: stage grpo needs at least one"),
        (dict(reward_funcs=["nosuchmodule:f"]), "reward_funcs: cannot load 'nosuchmodule:f'"),
        (dict(num_generations=3), "num_generations: 3 must divide"),
        (dict(beta=0.04), "beta: a KL term"),
        (dict(loss_type="sigmoid"), "loss_type: must be one of dapo"),
    ],
)
def test_bad_settings_are_one_line_and_nothing_is_written(setup, kw, match):
    tmp_path, _ = setup
    with pytest.raises(ConfigError, match=match):
        run(tmp_path, **kw)
    assert not (tmp_path / "out").exists()


def test_resume_samples_and_trains_as_the_uninterrupted_run(setup):
    """A run stopped after step 2 and resumed samples step 3's completions from the seed and the
    step, as the uninterrupted run did: the same completions and bitwise the same weights."""
    tmp_path, _ = setup
    _, whole_rollouts, whole = run(tmp_path, "whole", save_strategy="steps", save_steps=1)
    run(tmp_path, "cut", save_strategy="steps", save_steps=1, max_steps=2)
    _, rollouts, resumed = run(
        tmp_path, "cut", save_strategy="steps", save_steps=1, resume_from_checkpoint=True
    )
    third = [[r["completion_ids"] for r in rs if r["step"] == 3] for rs in (whole_rollouts, rollouts)]
    assert third[0] == third[1] and third[0]
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k
