"""Stage rm against the real thing: TRL RewardTrainer's loss (1.16: `-logsigmoid(chosen -
rejected - margin).mean() + center_rewards_coefficient x mean((chosen + rejected)^2)`) over
transformers' LlamaForSequenceClassification (its last non-pad token's score) with
torch.optim.AdamW, fp32 on the CPU: three steps of two micro-batches with clipping give the same
losses, TRL's metrics and final weights; the export loads with AutoModelForSequenceClassification
and scores as the trained model does."""

from __future__ import annotations

import json
import random
import re

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import saved_parameters, tiny_config
from safetensors.torch import load_file
from test_parity import _decay_groups

from megatrain.config import TrainConfig
from megatrain.data.preference import build_reward_pairs
from megatrain.errors import ConfigError, DataError
from megatrain.trainer import train

V, B, GA, STEPS, PAD = 97, 2, 2, 3, 0
PAIRED_KEYS = ("chosen_input_ids", "rejected_input_ids")  # TRL's legacy pre-tokenised keys
LR, WD, MAX_NORM, CENTER = 5e-3, 0.01, 0.05, 0.1


def reward_model(seed=0):
    torch.manual_seed(seed)
    cfg = tiny_config("llama", num_hidden_layers=2, intermediate_size=48, num_labels=1, pad_token_id=PAD)
    return transformers.LlamaForSequenceClassification(cfg).float().eval()


def pairs(n=B * GA * STEPS, seed=0):
    """(prompt, chosen, rejected, margin); ids from 1, some completions ending in pad tokens (the
    score is then read before them)."""
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(1, V) for _ in range(k)]  # noqa: E731
    out = []
    for i in range(n):
        chosen = ids(rng.randrange(1, 6)) + [PAD] * (i % 3 == 0)
        out.append((ids(rng.randrange(1, 6)), chosen, ids(rng.randrange(1, 6)), rng.uniform(-1, 1)))
    return out


def write(path, rows, keys=("chosen_ids", "rejected_ids")):
    """The pairs as TRL 1.16's RewardTrainer reads them pre-tokenised: whole sequences (`keys`:
    its own or its legacy chosen_input_ids, rejected_input_ids) and the margin column."""
    with open(path, "w") as f:
        for p, c, r, m in rows:
            f.write(json.dumps({keys[0]: p + c, keys[1]: p + r, "margin": m}) + "\n")
    return str(path)


def run(tmp_path, data, name="out", **kw):
    out = tmp_path / name
    args = dict(
        stage="rm", model_name_or_path=str(tmp_path / "model"), dataset=data, output_dir=str(out),
        per_device_train_batch_size=B, gradient_accumulation_steps=GA, max_steps=STEPS, learning_rate=LR,
        lr_scheduler_type="constant", weight_decay=WD, max_grad_norm=MAX_NORM, shuffle=False,
        save_strategy="no", save_dtype="float32", disable_tqdm=True, max_length=64,
        center_rewards_coefficient=CENTER,
    )  # fmt: skip
    train(TrainConfig(**(args | kw)))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], out


def batch(rows):
    """TRL's collated batch: chosen sequences then rejected ones, right-padded with PAD."""
    seqs = [p + c for p, c, _, _ in rows] + [p + r for p, _, r, _ in rows]
    width = max(map(len, seqs))
    ids = torch.tensor([s + [PAD] * (width - len(s)) for s in seqs])
    mask = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
    return ids, mask, torch.tensor([m for *_, m in rows], dtype=torch.float32)


def trl_loss(model, rows):
    """RewardTrainer.compute_loss, transcribed, and its metrics."""
    ids, mask, margin = batch(rows)
    chosen, rejected = model(input_ids=ids, attention_mask=mask).logits.squeeze(-1).chunk(2)
    loss = -F.logsigmoid(chosen - rejected - margin).mean() + CENTER * torch.mean((chosen + rejected) ** 2)
    both = torch.cat([chosen, rejected]).detach()
    metrics = dict(
        min_reward=both.min(), mean_reward=both.mean(), max_reward=both.max(),
        accuracy=(chosen > rejected).float().mean(), margin=(chosen - rejected).mean(),
    )  # fmt: skip
    return loss, {k: float(v) for k, v in metrics.items()}


def test_reward_model_trains_as_trl_over_transformers(tmp_path):
    reward_model().save_pretrained(tmp_path / "model")
    rows = pairs()
    records, out = run(tmp_path, write(tmp_path / "pairs.jsonl", rows))
    hf = reward_model()
    opt = torch.optim.AdamW(_decay_groups(hf, WD), lr=LR, betas=(0.9, 0.999), eps=1e-8)
    norms = []
    for step in range(STEPS):
        loss, metrics = 0.0, []
        for m in range(GA):
            a = (step * GA + m) * B
            mb_loss, mb_metrics = trl_loss(hf, rows[a : a + B])
            (mb_loss / GA).backward()
            loss += mb_loss.item() / GA
            metrics.append(mb_metrics)
        rec = records[step]
        assert rec["loss"] == pytest.approx(loss, rel=1e-5, abs=1e-7)
        for k in metrics[0]:
            assert rec[k] == pytest.approx(sum(x[k] for x in metrics) / GA, rel=1e-4, abs=1e-6), k
        norms.append(torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_NORM).item())
        assert rec["grad_norm"] == pytest.approx(norms[-1], rel=1e-4)
        opt.step()
        opt.zero_grad()
    assert sum(n > MAX_NORM for n in norms) >= 2, "the test should exercise clipping"
    final = load_file(out / "final" / "model.safetensors")
    ref = saved_parameters(hf)
    assert final.keys() == ref.keys() and "score.weight" in final
    for k, p in ref.items():
        torch.testing.assert_close(final[k], p.detach(), rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    exported = transformers.AutoModelForSequenceClassification.from_pretrained(out / "final")
    assert type(exported).__name__ == "LlamaForSequenceClassification" and exported.config.pad_token_id == PAD


def test_a_causal_lm_starts_a_reward_model_and_eval_reports_trl_metrics(tmp_path):
    """From a causal LM's checkpoint (no score head: one is drawn, as transformers draws it), with
    evaluation; a reward model is refused by the other stages."""
    torch.manual_seed(0)
    cfg = tiny_config("llama", num_hidden_layers=2, intermediate_size=48, pad_token_id=PAD)
    transformers.LlamaForCausalLM(cfg).save_pretrained(tmp_path / "model")
    data = write(tmp_path / "pairs.jsonl", pairs())
    rows = pairs()
    records, out = run(tmp_path, data, eval_dataset=data, eval_steps=3)
    [last] = [
        json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if "eval_loss" in line
    ]
    # the export scores as megatrain's evaluation of the final weights did: TRL's eval metrics
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out / "final").float().eval()
    assert model.score.weight.shape == (1, 64)
    with torch.no_grad():
        per_batch = [trl_loss(model, rows[a : a + B]) for a in range(0, len(rows), B)]
    assert last["eval_loss"] == pytest.approx(sum(float(x) for x, _ in per_batch) / len(per_batch), rel=1e-5)
    for k in ("accuracy", "margin", "min_reward", "mean_reward", "max_reward"):
        want = sum(m[k] for _, m in per_batch) / len(per_batch)
        assert last[f"eval_{k}"] == pytest.approx(want, rel=1e-5, abs=1e-6), k
    with pytest.raises(ConfigError, match="a sequence-classification model .* trains with stage rm"):
        run(tmp_path, data, name="dpo", stage="dpo", model_name_or_path=str(out / "final"))


@pytest.mark.slow
def test_two_processes_take_min_and_max_reward_over_both_as_trl(tmp_path):
    """Two gloo processes of B pairs a micro-batch against one process of 2B: rank r's micro-batch
    is the r-th half of the one process's, and TRL's min_reward / max_reward are over every
    process's batch at once, so both runs log the same figures, in training and evaluation; each
    rank's own extremes averaged (which the data makes differ) would not."""
    from test_checkpoint import write_yaml
    from test_distributed import launch

    reward_model().save_pretrained(tmp_path / "model")
    rows = pairs(2 * B * STEPS, seed=3)
    data = write(tmp_path / "pairs.jsonl", rows)
    kw = dict(eval_dataset=data, eval_steps=STEPS, gradient_accumulation_steps=1)
    one, out_one = run(tmp_path, data, "one", per_device_train_batch_size=2 * B, **kw)
    cfg = dict(
        stage="rm", model_name_or_path=str(tmp_path / "model"), dataset=data, per_device_train_batch_size=B,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", weight_decay=WD,
        max_grad_norm=MAX_NORM, shuffle=False, save_strategy="no", save_dtype="float32", disable_tqdm=True,
        max_length=64, center_rewards_coefficient=CENTER, **kw,
    )  # fmt: skip
    proc = launch(write_yaml(tmp_path / "run.yaml", cfg), f"output_dir={tmp_path / 'two'}")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    two = [r for r in records if "loss" in r]
    (got_eval,) = [r for r in records if "eval_loss" in r]
    (want_eval,) = [
        json.loads(line)
        for line in (out_one / "metrics.jsonl").read_text().splitlines()
        if "eval_loss" in line
    ]
    assert len(two) == len(one) == STEPS
    names = ("loss", "grad_norm", "accuracy", "margin", "min_reward", "mean_reward", "max_reward")
    for got, want in zip(two, one):
        for k in names:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-6), (got["step"], k)
    for k in names[2:]:
        assert got_eval[f"eval_{k}"] == pytest.approx(want_eval[f"eval_{k}"], rel=1e-5, abs=1e-6), k
    # the weights as close as this file's TRL comparison asks: the two sum a gradient in other
    # orders, and AdamW's first steps turn a near-0 entry's rounding into lr x its sign (2 of the
    # 6,208 embedding entries 5e-6 apart, all else under 6e-7)
    final, final_one = (load_file(d / "final" / "model.safetensors") for d in (tmp_path / "two", out_one))
    assert final.keys() == final_one.keys()
    for k in final:
        torch.testing.assert_close(
            final[k], final_one[k], rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}"
        )
    # The extremes of the final model's rewards over the eval pairs: each half's averaged differs.
    model = transformers.AutoModelForSequenceClassification.from_pretrained(out_one / "final").float().eval()
    with torch.no_grad():
        halves = [trl_loss(model, rows[a : a + B])[1] for a in range(0, len(rows), B)]
        whole = [trl_loss(model, rows[a : a + 2 * B])[1] for a in range(0, len(rows), 2 * B)]
    for k in ("min_reward", "max_reward"):
        assert want_eval[f"eval_{k}"] == pytest.approx(
            sum(m[k] for m in whole) / len(whole), rel=1e-5, abs=1e-6
        )
        assert abs(sum(m[k] for m in halves) / len(halves) - want_eval[f"eval_{k}"]) > 1e-3, k


def test_pretokenised_pairs_are_read_as_trls_whole_sequences(tmp_path, caplog):
    """chosen_ids / rejected_ids and TRL's legacy chosen_input_ids / rejected_input_ids are whole
    sequences; a prompt_input_ids beside them (which TRL 1.16 would not read) is refused; pairs
    over max_length are left out with one warning counting them."""
    rows = pairs(4, seed=1)
    new = build_reward_pairs([write(tmp_path / "new.jsonl", rows)], None, None)
    legacy = build_reward_pairs([write(tmp_path / "old.jsonl", rows, PAIRED_KEYS)], None, None)
    want = [(p + c, p + r, m) for p, c, r, m in rows]
    for got in (new, legacy):
        assert [(x.chosen.input_ids, x.rejected.input_ids, x.margin) for x in got] == want
    limit = sorted(max(len(c), len(r)) for c, r, _ in want)[1]
    with caplog.at_level("WARNING"):
        kept = build_reward_pairs([tmp_path / "new.jsonl"], None, limit)
    assert [(x.chosen.input_ids, x.rejected.input_ids) for x in kept] == [
        (c, r) for c, r, _ in want if max(len(c), len(r)) <= limit
    ]
    over = len(want) - len(kept)
    assert over > 0 and f"left out {over} pairs with a sequence over max_length {limit}" in caplog.text
    rec = {"prompt_input_ids": [1], "chosen_input_ids": [2], "rejected_input_ids": [3]}
    (tmp_path / "p.jsonl").write_text(json.dumps(rec) + "\n")
    with pytest.raises(
        DataError, match=r"p.jsonl:1: prompt_input_ids: TRL 1.16's RewardTrainer reads none[^\n]*$"
    ):
        build_reward_pairs([tmp_path / "p.jsonl"], None, None)


def test_every_pair_over_max_length_is_one_line_naming_the_key_and_file(tmp_path):
    data = write(tmp_path / "pairs.jsonl", [([1, 2], [3, 4], [5], 0.0), ([1], [2, 3, 4], [5, 6], 0.0)])
    with pytest.raises(
        ConfigError,
        match=rf"^max_length: all 2 pairs of {re.escape(data)} have a sequence over max_length 3 "
        r"\(the shortest 4 tokens\)[^\n]*raise max_length$",
    ):
        build_reward_pairs([data], None, 3)


@pytest.mark.parametrize(
    "kw", [dict(max_prompt_length=128), dict(max_prompt_length=None), dict(max_completion_length=64),
           dict(truncation_mode="keep_end"), dict(truncation_mode="keep_start")],
)  # fmt: skip
def test_trl_1_16s_missing_reward_keys_are_refused_in_one_line(kw):
    """TRL 1.16's RewardConfig has no max_prompt_length, max_completion_length nor truncation_mode;
    their defaults (unset) pass."""
    import dataclasses

    import trl

    assert not {"max_prompt_length", "max_completion_length", "truncation_mode"} & {
        f.name for f in dataclasses.fields(trl.RewardConfig)
    }
    ((key, value),) = kw.items()
    with pytest.raises(
        ConfigError,
        match=rf"^{key}: not in stage rm: TRL 1.16's RewardConfig has none: [^\n]*\(got {re.escape(repr(value))}\)$",
    ):
        TrainConfig(model_config="unused", stage="rm", **kw)
    TrainConfig(model_config="unused", stage="rm")
