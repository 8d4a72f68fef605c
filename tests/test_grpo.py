"""GRPO (`stage: grpo`) end to end against TRL 1.16's formulas: the step's completions (read back
from output_dir/completions.jsonl, so sampling noise cannot make the two sides differ) are scored
by the same reward functions, turned into advantages as TRL's `_generate_and_score_completions`
does, and trained by a plain PyTorch loop over the transformers model with TRL's `_compute_loss`
(per-token clipped ratio, aggregated by loss_type, gradient accumulation), clip_grad_norm_ and
torch AdamW. Losses and final weights must agree in fp32. The first step's completions must be
transformers' `generate` with the run's seed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import fp32_parameters, saved_parameters, tiny_hf_model, tiny_tokenizer
from safetensors.torch import load_file
from test_parity import _decay_groups

from megatrain.config import TrainConfig
from megatrain.data.batch import MicroBatch
from megatrain.errors import ConfigError
from megatrain.host.split import cast, to_bf16
from megatrain.models.config import ModelConfig
from megatrain.models.family import layer_params
from megatrain.objectives.grpo import GRPO, GRPOConfig, reference_copy_bytes
from megatrain.objectives.losshead import Head
from megatrain.rl import rollout
from megatrain.rl.rewards import RewardError
from megatrain.rl.rollout import EVAL_STREAM, ROLLOUT_FILE, generation_order
from megatrain.rl.sampling import RowSampler, row_seed
from megatrain.stages import grpo_reference
from megatrain.trackers import is_eval
from megatrain.trainer import train

B, GA, G, STEPS, MAX_NEW = 4, 2, 4, 3, 10
SEED = TrainConfig.seed  # the runs' unless a test sets one
LR, WD, MAX_NORM = 5e-3, 0.01, 0.5
LR_AGAIN = 2e-4  # rollouts trained again: the clip acts on a share of the tokens, not all
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


def settings(tmp_path, **kw) -> dict:
    """The runs' settings on `setup`'s model and prompts, `kw` over them (no output_dir)."""
    args = dict(
        model_name_or_path=str(tmp_path / "model"), dataset=str(tmp_path / "prompts.jsonl"), stage="grpo",
        reward_funcs=["length", "exact_match"], reward_weights=[-0.05, 1.0],
        num_generations=G, max_completion_length=MAX_NEW, per_device_train_batch_size=B,
        gradient_accumulation_steps=GA, max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
        weight_decay=WD, max_grad_norm=MAX_NORM, shuffle=False, save_strategy="no", save_dtype="float32",
        disable_tqdm=True, logging_steps=1, adam_epsilon=EPS,
    )  # fmt: skip
    return args | kw


def outputs(out: Path) -> tuple[list[dict], list[dict], dict]:
    """A run's metrics.jsonl and completions.jsonl records and its final weights."""
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rollouts = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    return records, rollouts, load_file(out / "final" / "model.safetensors")


def run(tmp_path, name="out", **kw):
    out = tmp_path / name
    train(TrainConfig(**settings(tmp_path, output_dir=str(out), **kw)))
    return outputs(out)


def run_two(tmp_path, name="two", **kw):
    """`run`'s settings over two gloo processes through the command line, each of half the
    micro-batches a step (the same global batch): `outputs` of the run (completions.jsonl holds
    the main process's half of each step's completions, the first)."""
    from test_checkpoint import write_yaml
    from test_distributed import launch

    cfg = settings(tmp_path, **kw)
    half = f"gradient_accumulation_steps={cfg.pop('gradient_accumulation_steps') // 2}"
    proc = launch(
        write_yaml(tmp_path / f"{name}.yaml", cfg), half, f"output_dir={tmp_path / name}", timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return outputs(tmp_path / name)


def two_against_one(
    tmp_path, keys, steps=STEPS, rel=1e-5, atol=1e-7, advantages=False, same_keys=False, **kw
):
    """`run` and `run_two` of `kw`, compared: the main process's half of each step's completions
    (it writes its half, the first) is the first half of the one process's (their advantages too
    where `advantages`), `steps` steps each with the `keys` the one process logs within rel/atol
    (`same_keys`: each logged by both or neither), and close final weights. Returns the metrics
    records of one process and of two."""
    from test_distributed import assert_close_weights

    one, one_rollouts, final_one = run(tmp_path, "one", **kw)
    two, two_rollouts, final_two = run_two(tmp_path, **kw)
    for step in {r["step"] for r in two_rollouts}:
        mine = [r for r in two_rollouts if r["step"] == step]
        theirs = [r for r in one_rollouts if r["step"] == step][: len(mine)]
        assert [r["completion_ids"] for r in mine] == [r["completion_ids"] for r in theirs]
        if advantages:
            assert [r["advantage"] for r in mine] == pytest.approx([r["advantage"] for r in theirs], abs=1e-6)
    got, want = [r for r in two if "loss" in r], [r for r in one if "loss" in r]
    assert len(got) == len(want) == steps
    for a, b in zip(got, want):
        for k in keys:
            if same_keys:
                assert (k in a) == (k in b), (a["step"], k)
            if k in b:
                assert a[k] == pytest.approx(b[k], rel=rel, abs=atol), (a["step"], k)
    assert_close_weights(final_two, final_one)
    return one, two


# ------------------------------------------------------------------------ TRL, transcribed
def trl_advantages(rewards_per_func, weights, scale, g=G):
    rewards = (rewards_per_func * torch.tensor(weights, dtype=rewards_per_func.dtype)[None]).nansum(1)
    mean = rewards.view(-1, g).mean(1).repeat_interleave(g)
    std = (
        rewards.view(-1, g).std(1).repeat_interleave(g)
        if scale in ("group", "none")
        else rewards.std().expand_as(rewards)
    )
    adv = rewards - mean
    return adv / (std + 1e-4) if scale != "none" else adv


def trl_inputs(rows, mask_truncated):
    """(ids, attention mask, completion mask) of one micro-batch of (prompt ids, completion ids,
    truncated), right-padded; the completion mask aligned with the logits of positions :-1."""
    width = max(len(p) + len(c) for p, c, _ in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    attn = torch.zeros_like(ids)
    cmask = torch.zeros(len(rows), width - 1)
    for i, (p, c, cut) in enumerate(rows):
        ids[i, : len(p) + len(c)] = torch.tensor(p + c)
        attn[i, : len(p) + len(c)] = 1
        if not (cut and mask_truncated):
            cmask[i, len(p) - 1 : len(p) + len(c) - 1] = 1
    return ids, attn, cmask


def trl_logps(hf, ids, attn, temperature):
    """GRPOTrainer._get_per_token_logps_and_entropies: the log-probs at logits / temperature and
    the entropies."""
    z = hf(ids, attention_mask=attn).logits[:, :-1] / temperature
    lse = z.logsumexp(-1)
    entropy = (lse - (z.softmax(-1) * z).sum(-1)).detach()
    return z.gather(-1, ids[:, 1:, None]).squeeze(-1) - lse, entropy


def trl_loss(
    logps,
    entropy,
    cmask,
    adv,
    loss_type,
    num_items,
    old=None,
    ref=None,
    beta=0.0,
    eps=0.2,
    ga=GA,
    bias_kl=True,
):
    """GRPOTrainer._compute_loss for one micro-batch: its loss and its metrics (masked means);
    `ga`: its normaliser, but dapo's (1 at evaluation)."""
    coef_1 = torch.exp(logps - (logps.detach() if old is None else old))
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    a = adv[:, None]
    per_token = -torch.min(coef_1 * a, coef_2 * a)
    kl = torch.zeros_like(logps)
    if beta != 0.0:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        if bias_kl:  # use_bias_correction_kl
            kl = kl * coef_1
        per_token = per_token + beta * kl
    if loss_type == "grpo":
        loss = ((per_token * cmask).sum(-1) / cmask.sum(-1).clamp(min=1.0)).mean() / ga
    elif loss_type == "bnpo":
        loss = (per_token * cmask).sum() / cmask.sum().clamp(min=1.0) / ga
    elif loss_type == "dr_grpo":
        loss = (per_token * cmask).sum() / (per_token.size(0) * MAX_NEW) / ga
    else:
        loss = (per_token * cmask).sum() / num_items  # dapo

    def mean(x):
        return float((x * cmask).sum() / cmask.sum().clamp(min=1.0))

    low, high = (coef_1 < 1 - eps) & (a < 0), (coef_1 > 1 + eps) & (a > 0)
    metrics = {
        "entropy": mean(entropy),
        "clip_ratio/low_mean": mean(low.float()),
        "clip_ratio/high_mean": mean(high.float()),
        "clip_ratio/region_mean": mean((low | high).float()),
    }
    rows = cmask.sum(-1) > 0
    if ga != 1 and rows.any():  # training: the least and most of a completion's own clip ratio
        metrics["clip_ratio/low_min"] = float(((low * cmask).sum(-1) / cmask.sum(-1))[rows].min())
        metrics["clip_ratio/high_max"] = float(((high * cmask).sum(-1) / cmask.sum(-1))[rows].max())
    if beta != 0.0:
        metrics["kl"] = mean(kl.detach())
    return loss, metrics


def reward_table(rollouts):
    """The per-function rewards megatrain recorded, recomputed here from the completions."""
    out = []
    for r in rollouts:
        text = r["completion"]
        answer = str(int(r["prompt"].split()[1]))
        out.append([float(len(text)), float(text.strip() == answer)])
    return torch.tensor(out, dtype=torch.float64)


def slices_of(kw):
    """TRL's steps_per_generation: set, derived from generation_batch_size (one process), or
    gradient_accumulation_steps."""
    if "generation_batch_size" in kw:
        return kw["generation_batch_size"] // B
    return kw.get("steps_per_generation", GA)


def trl_run(tok, rollouts, steps, ref_model, kw):
    """GRPOTrainer's training on the completions megatrain sampled, micro-batch by micro-batch as
    its `_prepare_inputs` buffers them: each step's loss and metrics, and the trained model. A
    generation batch of B x steps_per_generation completions is sampled every steps_per_generation
    x num_iterations micro-batches, shuffled (by the run's permutation: `generation_order`) and
    split into steps_per_generation micro-batches; the
    log-probs of the policy that sampled it (where the policy moves before its last micro-batch)
    and of `ref_model` (beta > 0) are taken once."""
    hf = model(len(tok))
    lr, k, beta = kw.get("learning_rate", LR), kw.get("num_iterations", 1), kw.get("beta", 0.0)
    slices = slices_of(kw)
    opt = torch.optim.AdamW(_decay_groups(hf, WD), lr=lr, betas=(0.9, 0.999), eps=EPS)
    loss_type, scale = kw.get("loss_type", "dapo"), kw.get("scale_rewards", "group")
    mask_truncated, temperature = kw.get("mask_truncated_completions", False), kw.get("temperature", 1.0)
    pending = iter(rollouts)  # in the order they were sampled
    out = []
    for step in range(1, steps + 1):
        sampled, loss, metrics = [], 0.0, []
        for micro in range((step - 1) * GA, step * GA):
            if micro % (slices * k) == 0:  # _prepare_inputs: generate_every
                batch = [next(pending) for _ in range(B * slices)]
                assert all(r["step"] == step for r in batch)
                rewards = reward_table(batch)
                for r, got in zip(rewards, batch):
                    assert [got["rewards"]["length"], got["rewards"]["exact_match"]] == r.tolist()
                adv = trl_advantages(rewards, [-0.05, 1.0], scale).float()
                torch.testing.assert_close(
                    adv, torch.tensor([r["advantage"] for r in batch]), rtol=1e-5, atol=1e-6
                )
                rows = [(tok(r["prompt"])["input_ids"], r["completion_ids"], r["truncated"]) for r in batch]
                # _prepare_inputs: shuffle_sequence_dict, with the run's permutation of this batch
                order = generation_order(kw.get("seed", SEED), micro // (slices * k), len(rows))
                rows, adv = [rows[i] for i in order.tolist()], adv[order]
                for _, c, cut in rows:  # cut: max_completion_length tokens and no end token
                    assert cut == (
                        len(c) == MAX_NEW
                        and c[-1] not in (tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>"))
                    )
                num_items = sum(len(c) for _, c, cut in rows if not (cut and mask_truncated))
                assert num_items > 0
                if mask_truncated:  # some completions in the loss, some left out
                    assert any(cut for *_, cut in rows) and not all(cut for *_, cut in rows)
                mbs = [trl_inputs(rows[m * B : (m + 1) * B], mask_truncated) for m in range(slices)]
                stale = GA % (slices * k) != 0  # TRL's test for old_per_token_logps
                with torch.no_grad():  # _generate_and_score_completions: once per generation batch
                    old = [
                        trl_logps(hf, ids, attn, temperature)[0] if stale else None for ids, attn, _ in mbs
                    ]
                    ref = [
                        trl_logps(ref_model, ids, attn, temperature)[0] if beta else None
                        for ids, attn, _ in mbs
                    ]
                sampled.append({
                    "reward": float((rewards * torch.tensor([-0.05, 1.0], dtype=torch.float64)).sum(1).mean()),
                    "completions/mean_length": sum(len(c) for _, c, _ in rows) / len(rows),
                })  # fmt: skip
            m = micro % slices
            ids, attn, cmask = mbs[m]
            logps, entropy = trl_logps(hf, ids, attn, temperature)
            a = adv[m * B : (m + 1) * B]
            normaliser = num_items * GA / slices  # dapo: num_items_in_batch x GA / steps_per_generation
            lm, mm = trl_loss(
                logps, entropy, cmask, a, loss_type, normaliser, old[m], ref[m], beta,
                bias_kl=kw.get("use_bias_correction_kl", True),
            )  # fmt: skip
            lm.backward()
            loss += lm.item()
            metrics.append(mm)
        torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        record = {name: sum(g[name] for g in sampled) / len(sampled) for name in (sampled or [{}])[0]}
        names = {name for mm in metrics for name in mm}
        means = {
            name: sum(mm[name] for mm in metrics if name in mm) / sum(name in mm for mm in metrics)
            for name in names
        }
        out.append(record | means | {"loss": loss})
    assert next(pending, None) is None  # every completion sampled was trained on
    return hf, out


# TRL's formulas over each loss type, with the rollout trained once and again (num_iterations),
# with and without the KL term to the initial policy or to another model, and with generation
# batches split over several steps, several in a step, or straddling steps (steps_per_generation,
# generation_batch_size). Rollouts trained after the policy moved need a learning rate at which
# the clip acts on a share of the tokens.
CASES = [
    dict(), dict(loss_type="grpo"), dict(loss_type="bnpo", scale_rewards="batch"),
    dict(loss_type="dr_grpo", scale_rewards="none"), dict(mask_truncated_completions=True),
    dict(temperature=0.7, top_k=20), dict(beta=0.04), dict(beta=0.04, use_bias_correction_kl=False),
    dict(beta=0.04, ref_model_name_or_path="other"),
    *(dict(loss_type=t, num_iterations=3, learning_rate=LR_AGAIN) for t in ("dapo", "grpo", "bnpo", "dr_grpo")),
    *(dict(loss_type=t, num_iterations=2, beta=0.04, learning_rate=LR_AGAIN) for t in ("dapo", "grpo", "bnpo", "dr_grpo")),
    dict(num_iterations=2, beta=0.04, temperature=0.7, learning_rate=LR_AGAIN),
    dict(steps_per_generation=2 * GA),
    dict(steps_per_generation=2 * GA, loss_type="bnpo", scale_rewards="batch"),
    dict(share_prompts=True, loss_type="grpo", num_iterations=2, beta=0.04, learning_rate=LR_AGAIN),
    dict(generation_batch_size=2 * B * GA, num_iterations=2, beta=0.04, loss_type="grpo", learning_rate=LR_AGAIN),
    dict(steps_per_generation=1, scale_rewards="batch"), dict(steps_per_generation=1, num_iterations=2),
    dict(steps_per_generation=3), dict(steps_per_generation=3, loss_type="dr_grpo", beta=0.04),
]  # fmt: skip


def sampling_steps(kw, steps):
    """The steps (1-based) that sample a generation batch: those holding a micro-batch that is a
    multiple of steps_per_generation x num_iterations."""
    every = slices_of(kw) * kw.get("num_iterations", 1)
    return {s for s in range(1, steps + 1) if any(m % every == 0 for m in range((s - 1) * GA, s * GA))}


@pytest.mark.parametrize("kw", CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "dapo")
def test_grpo_trains_as_trl(setup, kw, monkeypatch):
    tmp_path, tok = setup
    if kw.get("ref_model_name_or_path") == "other":  # a reference that is not the initial policy
        monkeypatch.setattr(rollout, "REFERENCE_LOGIT_BYTES", 1)  # and its pass a row at a time
        other = model(len(tok))
        with torch.no_grad():
            for p in other.parameters():
                p.add_(torch.randn_like(p) * 0.02, alpha=1.0)
        other.save_pretrained(tmp_path / "other")
        kw = kw | dict(ref_model_name_or_path=str(tmp_path / "other"))
    # A rollout trained again, and the next one; two generation batches at least.
    steps = max(
        STEPS + (kw.get("num_iterations", 1) > 1), -(-2 * slices_of(kw) * kw.get("num_iterations", 1) // GA)
    )
    records, rollouts, final = run(tmp_path, max_steps=steps, **kw)
    got = [r for r in records if "loss" in r]
    ref_model = model(len(tok)) if "ref_model_name_or_path" not in kw else other
    hf, want = trl_run(tok, rollouts, steps, ref_model, kw)
    for rec, expected in zip(got, want, strict=True):
        step = rec["step"]
        assert rec["loss"] == pytest.approx(expected.pop("loss"), rel=1e-4, abs=1e-6), step
        for name, value in expected.items():
            assert rec[name] == pytest.approx(value, rel=1e-4, abs=1e-6), (step, name)
        # A rollout's own metrics go with the step that sampled it.
        assert ("reward" in rec) == (step in sampling_steps(kw, steps))
        assert ("kl" in rec) == ("beta" in kw)
        if "reward" in rec:  # the rollout's time, by part: within its whole (summed over batches)
            parts = [rec[f"time/rollout_{p}_s"] for p in ("wait", "build", "sample")]
            assert min(parts) >= 0 and sum(parts) <= rec["time/rollout_s"]
    every = slices_of(kw) * kw.get("num_iterations", 1)
    if every % GA == 0 and every > GA:  # the first step on a rollout: ratio 1; the later: clipped
        assert all(r["clip_ratio/region_mean"] == 0 for r in got if "reward" in r)
        assert any(r["clip_ratio/region_mean"] > 0 for r in got if "reward" not in r)
    if GA % every and every % GA:  # generation batches straddle steps: clipped on the stale ones
        assert any(r["clip_ratio/region_mean"] > 0 for r in got)
    if "ref_model_name_or_path" in kw:  # far from the reference from the start
        assert got[0]["kl"] > 1e-3
    atol = 1e-4 * kw.get("learning_rate", LR) / LR  # a share of what the steps move each weight
    for k, p in saved_parameters(hf).items():
        torch.testing.assert_close(final[k], p.detach(), rtol=1e-4, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
    start = saved_parameters(model(len(tok)))
    assert any(not torch.equal(final[k], start[k].detach()) for k in final)


def assert_each_is_generate_alone(first, tok, hf, device):
    """Each recorded completion of step 1 (run with seed 7, shuffle off: row n is prompt n // G of
    the dataset, completion n % G) is `generate`'s for its prompt alone with its own stream, cut
    after the first end token."""
    for n, r in enumerate(first):
        ids = torch.tensor([tok(r["prompt"])["input_ids"]], device=device)
        sampler = RowSampler([row_seed(7, 1, n // G, n % G)], device)
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, logits_processor=[sampler],
                          max_new_tokens=MAX_NEW, eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)  # fmt: skip
        row = out[0, ids.shape[1] :].tolist()
        end = next((i for i, t in enumerate(row) if t == tok.eos_token_id), None)
        assert r["completion_ids"] == (row if end is None else row[: end + 1])


def test_each_completion_is_transformers_generate_of_its_prompt_alone(setup):
    """With the run's seed, each of the first step's completions is `generate`'s for its prompt
    alone, sampled from its own stream (row_seed(seed, step, prompt, completion)), cut after the
    first end token: the batch it was sampled in changes nothing."""
    tmp_path, tok = setup
    _, rollouts, _ = run(tmp_path, max_steps=1, seed=7)
    first = [r for r in rollouts if r["step"] == 1]
    assert len(first) == B * GA
    hf = model(len(tok)).eval()
    assert_each_is_generate_alone(first, tok, hf, "cpu")
    assert len({tuple(r["completion_ids"]) for r in first[:G]}) > 1  # a group's completions differ


# ------------------------------------------------------------------------ evaluation
def write_eval_prompts(tmp_path, numbers=(20, 21, 22)):
    with open(tmp_path / "eval.jsonl", "w") as f:
        for i in numbers:
            f.write(json.dumps({"prompt": f"Say {i} once:", "answer": f"{i}"}) + "\n")
    return str(tmp_path / "eval.jsonl")


def plain_eval(hf, tok, path, seed=SEED, g=G):
    """TRL's eval metrics of `hf`, plainly, and its completions: each eval prompt sampled g
    (num_generations_eval) times by `generate` alone, each completion from its stream of
    evaluation's (row_seed(seed, EVAL_STREAM, prompt, n)), cut after the first end token, scored
    by the run's reward functions; the rewards' group statistics as TRL's
    `_generate_and_score_completions` takes them (a group of one: std 0)."""
    prompts = [json.loads(x) for x in Path(path).read_text().splitlines()]
    completions, truncated, answers = [], [], []
    for i, rec in enumerate(prompts):
        ids = torch.tensor([tok(rec["prompt"])["input_ids"]])
        for n in range(g):
            sampler = RowSampler([row_seed(seed, EVAL_STREAM, i, n)], "cpu")
            out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, logits_processor=[sampler],
                              max_new_tokens=MAX_NEW, eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id)  # fmt: skip
            row = out[0, ids.shape[1] :].tolist()
            end = next((k for k, t in enumerate(row) if t == tok.eos_token_id), None)
            completions.append(row if end is None else row[: end + 1])
            truncated.append(end is None)
            answers.append(rec["answer"])
    texts = tok.batch_decode(completions, skip_special_tokens=True)
    per_func = torch.tensor(
        [[float(len(t)), float(t.strip() == a)] for t, a in zip(texts, answers)], dtype=torch.float64
    )
    rewards = per_func @ torch.tensor([-0.05, 1.0], dtype=torch.float64)
    group_std = rewards.view(-1, g).std(1) if g > 1 else torch.zeros(len(prompts), dtype=torch.float64)
    lengths = torch.tensor([len(c) for c in completions], dtype=torch.float64)
    return completions, {
        "eval_reward": float(rewards.mean()), "eval_reward_std": float(rewards.std()),
        "eval_frac_reward_zero_std": float((group_std < 1e-6).double().mean()),
        "eval_rewards/length/mean": float(per_func[:, 0].mean()), "eval_rewards/length/std": float(per_func[:, 0].std()),
        "eval_rewards/exact_match/mean": float(per_func[:, 1].mean()),
        "eval_completions/mean_length": float(lengths.mean()), "eval_completions/max_length": float(lengths.max()),
        "eval_completions/clipped_ratio": sum(truncated) / len(truncated),
    }  # fmt: skip


def test_evaluation_samples_and_scores_and_leaves_the_training_run_as_it_was(setup):
    """eval_dataset with stage grpo: at eval_on_start, every eval_steps and the last step, each
    eval prompt is sampled num_generations times (batches of per_device_eval_batch_size
    completions, here cutting groups) and scored: TRL's eval_ metrics, each as `generate` alone
    and the reward functions give them for the weights of that step (the initial ones, the final
    ones). The run trains bitwise as one without evaluation: the same completions, losses and
    weights."""
    import transformers

    tmp_path, tok = setup
    path = write_eval_prompts(tmp_path)
    kw = dict(
        eval_dataset=path,
        eval_steps=2,
        eval_on_start=True,
        per_device_eval_batch_size=5,
        save_dtype="float32",
    )
    records, rollouts, final = run(tmp_path, "eval", **kw)
    plain_records, plain_rollouts, plain_final = run(tmp_path, "plain")
    evals = [r for r in records if is_eval(r)]
    assert [r["step"] for r in evals] == [0, 2, STEPS]

    def training(rs):  # the step records less their timings
        return [
            {k: v for k, v in r.items() if "time" not in k and "_per_s" not in k}
            for r in rs
            if not is_eval(r)
        ]

    assert training(records) == training(plain_records) and rollouts == plain_rollouts
    for k in plain_final:
        assert torch.equal(final[k], plain_final[k]), k
    start = model(len(tok)).eval()
    end = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "eval" / "final", dtype=torch.float32
    ).eval()
    samples = eval_completions(tmp_path / "eval")
    assert [r["step"] for r in samples] == [s for s in (0, 2, STEPS) for _ in range(3 * G)]
    for got, hf in ((evals[0], start), (evals[-1], end)):
        completions, metrics = plain_eval(hf, tok, path)
        for name, value in metrics.items():
            assert got[name] == pytest.approx(value, rel=1e-6, abs=1e-9), (got["step"], name)
        assert [r["completion_ids"] for r in samples if r["step"] == got["step"]] == completions
    assert evals[0]["eval_reward"] != evals[-1]["eval_reward"]  # the weights moved between them
    assert not (tmp_path / "plain" / "eval_completions.jsonl").exists()


def plain_eval_loss(hf, ref, tok, samples, kw, size):
    """TRL's loss metrics at evaluation (prediction_step -> _compute_loss in eval mode, the
    Trainer's eval_loss), plainly: the eval completions in batches of `size` in order, each
    batch's loss with the policy as its own sampling policy, not accumulated (dapo: over the
    batch's tokens), weighted by the batch's rows; its metrics' masked means averaged over the
    batches."""
    loss_type, beta = kw.get("loss_type", "dapo"), kw.get("beta", 0.0)
    rows = [(tok(r["prompt"])["input_ids"], r["completion_ids"], r["truncated"]) for r in samples]
    adv = trl_advantages(reward_table(samples), [-0.05, 1.0], "group").float()
    losses, metrics = [], []
    for a in range(0, len(rows), size):
        ids, attn, cmask = trl_inputs(rows[a : a + size], False)
        with torch.no_grad():
            logps, entropy = trl_logps(hf, ids, attn, 1.0)
            ref_logps = trl_logps(ref, ids, attn, 1.0)[0] if beta else None
            loss, m = trl_loss(logps, entropy, cmask, adv[a : a + size], loss_type, cmask.sum(), ref=ref_logps,
                               beta=beta, ga=1)  # fmt: skip
        losses.append((len(ids), float(loss)))
        metrics.append(
            m
            | {
                "clip_ratio/low_min": m["clip_ratio/low_mean"],
                "clip_ratio/high_max": m["clip_ratio/high_mean"],
            }
        )
    out = {"eval_loss": sum(n * x for n, x in losses) / len(rows)}
    return out | {f"eval_{k}": sum(m[k] for m in metrics) / len(metrics) for k in metrics[0]}


@pytest.mark.parametrize(
    "kw",
    [dict(beta=0.04), dict(loss_type="bnpo", num_iterations=2, beta=0.04)],
    ids=["dapo-beta", "bnpo-stale"],
)
def test_the_eval_loss_and_its_metrics_are_trls(setup, kw):
    """At an evaluation, TRL's GRPOTrainer also computes the loss on the eval completions
    (prediction_step): eval_loss, eval_entropy, eval_kl (beta > 0) and the clip ratios (0: the
    ratio is 1, even where training keeps the sampling policy's log-probs), each as a plain
    computation with the weights evaluated (the last step's, per_device_eval_batch_size 5 cutting
    groups, the last batch short) and the reference."""
    import transformers

    tmp_path, tok = setup
    path = write_eval_prompts(tmp_path)
    records, _, _ = run(tmp_path, max_steps=1, eval_dataset=path, per_device_eval_batch_size=5, **kw)
    (got,) = [r for r in records if is_eval(r)]
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out" / "final", dtype=torch.float32
    ).eval()
    want = plain_eval_loss(hf, model(len(tok)).eval(), tok, eval_completions(tmp_path / "out"), kw, size=5)
    assert ("eval_kl" in got) == ("beta" in kw) and set(want) <= set(got)
    for name, value in want.items():
        assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name
    if "beta" in kw:
        assert got["eval_kl"] > 0  # the weights moved from the reference


def eval_completions(out):
    return [json.loads(x) for x in (out / "eval_completions.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("g", [2, 1])
def test_num_generations_eval_is_the_completions_per_eval_prompt(setup, g):
    """num_generations_eval (TRL's): each eval prompt sampled that many times (1: groups of one,
    whose std is 0); the eval metrics are the plain computation's over those completions, and
    eval_completions.jsonl holds each with the fields of completions.jsonl: its prompt, text, the
    rewards and the advantage in its group, the step evaluated."""
    tmp_path, tok = setup
    path = write_eval_prompts(tmp_path)
    records, rollouts, _ = run(
        tmp_path, max_steps=1, eval_dataset=path, eval_on_start=True, num_generations_eval=g
    )
    (got,) = [r for r in records if is_eval(r) and r["step"] == 0]
    completions, metrics = plain_eval(model(len(tok)).eval(), tok, path, g=g)
    for name, value in metrics.items():
        assert got[name] == pytest.approx(value, rel=1e-6, abs=1e-9), name
    samples = [r for r in eval_completions(tmp_path / "out") if r["step"] == 0]
    assert [r["completion_ids"] for r in samples] == completions and len(samples) == 3 * g
    assert set(samples[0]) == set(rollouts[0])
    assert [r["prompt"] for r in samples] == [f"Say {i} once:" for i in (20, 21, 22) for _ in range(g)]
    rewards = reward_table(samples)
    assert [[r["rewards"]["length"], r["rewards"]["exact_match"]] for r in samples] == rewards.tolist()
    adv = (
        trl_advantages(rewards, [-0.05, 1.0], "group", g)
        if g > 1
        else torch.zeros(3 * g, dtype=torch.float64)
    )
    assert [r["advantage"] for r in samples] == pytest.approx(adv.tolist(), abs=1e-6)
    assert len(samples[0]["completion"]) > 0


def test_the_completion_files_survive_a_resume_without_duplicates_or_cut_lines(setup):
    """A run killed after step 2's checkpoint, having written step 3's records and half a line to
    completions.jsonl and eval_completions.jsonl, resumes with both files trimmed to whole
    records of the checkpoint's steps: at the end they are the uninterrupted run's, byte for
    byte. A new run in that output_dir keeps them aside."""
    tmp_path, _ = setup
    kw = dict(eval_dataset=write_eval_prompts(tmp_path), eval_steps=1, save_strategy="steps", save_steps=1)
    run(tmp_path, "whole", **kw)
    run(tmp_path, "cut", **kw, max_steps=2)
    names = ("completions.jsonl", "eval_completions.jsonl")
    for name in names:
        with open(tmp_path / "cut" / name, "a") as f:  # what the killed run wrote after step 2
            f.write(json.dumps({"step": 3, "prompt": "stale"}) + "\n" + '{"step": 3, "prompt": "cut sh')
    run(tmp_path, "cut", **kw, resume_from_checkpoint=True)
    for name in names:
        whole = (tmp_path / "whole" / name).read_text()
        assert (tmp_path / "cut" / name).read_text() == whole, name
        assert {json.loads(x)["step"] for x in whole.splitlines()} >= {1, 2, 3}
    # A new run there keeps them aside with metrics.jsonl, and starts its own.
    run(tmp_path, "cut", **kw, max_steps=1, overwrite_output_dir=True)
    for name in names:
        stem, suffix = name.split(".")
        (aside,) = (tmp_path / "cut").glob(f"{stem}-*.{suffix}")
        assert aside.read_text() == (tmp_path / "whole" / name).read_text(), name
        assert {json.loads(x)["step"] for x in (tmp_path / "cut" / name).read_text().splitlines()} <= {0, 1}


def test_the_best_grpo_checkpoint_is_the_one_with_the_most_eval_reward(setup):
    """load_best_model_at_end with stage grpo: eval_reward, greater is better (TRL's; a tie keeps
    the earlier); final/ is the checkpoint whose evaluation had the most reward, here not the
    last one."""
    tmp_path, _ = setup
    kw = dict(eval_dataset=write_eval_prompts(tmp_path), eval_steps=1, save_steps=1, load_best_model_at_end=True,
              save_dtype="float32", learning_rate=0.05)  # fmt: skip
    records, _, final = run(tmp_path, "best", **kw, save_strategy="steps")
    rewards = {r["step"]: r["eval_reward"] for r in records if is_eval(r)}
    best = min(s for s in rewards if rewards[s] == max(rewards.values()))
    state = json.loads((tmp_path / "best" / f"checkpoint-{STEPS}" / "trainer_state.json").read_text())
    assert (state["best_global_step"], state["best_metric"]) == (best, rewards[best])
    kept, last = (
        load_file(tmp_path / "best" / f"checkpoint-{s}" / "model.safetensors") for s in (best, STEPS)
    )
    assert all(torch.equal(final[k], kept[k]) for k in final)
    assert any(not torch.equal(final[k], last[k]) for k in final)  # the choice changed final/


def test_grpo_evaluation_settings():
    """The best model's metric with stage grpo is eval_reward (by default with
    load_best_model_at_end) or eval_loss (lower is better); another is refused by name."""
    args = dict(model_config="unused", stage="grpo", reward_funcs=["length"], per_device_train_batch_size=8,
                eval_dataset="unused", eval_steps=2, save_steps=2)  # fmt: skip
    cfg = TrainConfig(**args, load_best_model_at_end=True)
    assert (cfg.metric_for_best_model, cfg.greater_is_better) == ("eval_reward", True)
    cfg = TrainConfig(**args, load_best_model_at_end=True, metric_for_best_model="eval_loss")
    assert (cfg.metric_for_best_model, cfg.greater_is_better) == ("eval_loss", False)
    with pytest.raises(ConfigError, match=r"^metric_for_best_model: must be eval_reward or eval_loss \(the metrics "
                       r"evaluation computes with stage grpo\) \(got 'eval_entropy'\)$"):  # fmt: skip
        TrainConfig(**args, metric_for_best_model="eval_entropy")


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
        (
            dict(num_generations=3),
            r"num_generations: must divide the completions a process samples at a "
            r"time, per_device_train_batch_size x steps_per_generation \(4 x 2\) \(got 3\)",
        ),
        (dict(steps_per_generation=1, num_generations=8), r"num_generations: must divide .* \(4 x 1\)"),
        (
            dict(steps_per_generation=2, generation_batch_size=8),
            "steps_per_generation: cannot be set with generation_batch_size",
        ),
        (
            dict(generation_batch_size=6),
            r"generation_batch_size: must be a multiple of "
            r"per_device_train_batch_size x processes \(4 x 1 = 4\) \(got 6\)",
        ),
        (dict(steps_per_generation=0), "steps_per_generation: must be >= 1"),
        (dict(beta=-0.04), "beta: must be >= 0"),
        (dict(num_iterations=0), "num_iterations: must be >= 1"),
        (dict(num_generations_eval=0), r"^num_generations_eval: must be >= 1 \(got 0\)$"),
        (dict(loss_type="sigmoid"), "loss_type: must be one of dapo"),
        (dict(share_prompts=True, stage="sft"), "^share_prompts: shares the prompts of sampled completions"),
    ],
)
def test_bad_settings_are_one_line_and_nothing_is_written(setup, kw, match):
    tmp_path, _ = setup
    with pytest.raises(ConfigError, match=match):
        run(tmp_path, **kw)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "kw",
    [
        dict(), dict(steps_per_generation=8), dict(steps_per_generation=1, num_generations=2),
        dict(generation_batch_size=24, num_generations=6), dict(generation_batch_size=4, num_generations=4),
    ],
)  # fmt: skip
def test_the_generation_batch_is_derived_as_trl_derives_it(kw):
    """steps_per_generation and generation_batch_size from each other and the step's shape, as
    TRL's own GRPOConfig derives them (one process)."""
    trl = pytest.importorskip("trl")
    shape = dict(per_device_train_batch_size=4, gradient_accumulation_steps=2) | kw
    theirs = trl.GRPOConfig(output_dir="unused", use_cpu=True, report_to="none", **shape)
    ours = TrainConfig(model_config="unused", stage="grpo", reward_funcs=["length"], **shape).grpo()
    assert ours.steps_per_generation == theirs.steps_per_generation
    assert ours.generation_batch_size == theirs.generation_batch_size


def test_the_generation_batch_is_counted_over_the_processes():
    """generation_batch_size counts every process's completions (TRL's): with 4 processes of 4
    completions a micro-batch, 32 is 2 micro-batches each; 24 is no whole number of them."""
    cfg = TrainConfig(model_config="unused", stage="grpo", reward_funcs=["length"], num_generations=2,
                      per_device_train_batch_size=4, generation_batch_size=32)  # fmt: skip
    assert cfg.grpo().steps_per_generation == 8  # one process: the config's world
    assert cfg.grpo(processes=4).steps_per_generation == 2
    with pytest.raises(ConfigError, match=r"generation_batch_size: .* \(4 x 3 = 12\) \(got 32\)"):
        cfg.grpo(processes=3)


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


def test_the_first_step_on_a_rollout_is_exact(setup):
    """The sampling policy's log-probs come from the engine's forward sweep, computed as the loss
    computes its own: the ratio of a rollout's first step is exactly 1, so with num_iterations 2
    that step gives bitwise the weights of num_iterations 1."""
    tmp_path, _ = setup
    records, _, once = run(tmp_path, "once", max_steps=1, beta=0.04)
    again_records, _, again = run(tmp_path, "again", max_steps=1, beta=0.04, num_iterations=2)
    assert records[0]["loss"] == again_records[0]["loss"]
    for k in once:
        assert torch.equal(once[k], again[k]), k


@pytest.mark.parametrize(
    "kw,stop,held",
    [
        (dict(num_iterations=3, beta=0.04), 2, [True, True, False, True, True]),
        (dict(steps_per_generation=3, beta=0.04), 2, [True, True, False, True, True]),
        (dict(steps_per_generation=2 * GA), 3, [True, False, True, False, True]),
    ],
    ids=["num_iterations", "straddling", "over-two-steps"],
)
def test_resume_in_the_middle_of_a_rollout_trains_as_the_uninterrupted_run(setup, kw, stop, held):
    """A run stopped where the next step goes on with a generation batch (num_iterations 3 with a
    KL term: one step before its rollout's last; steps_per_generation 3 with 2 micro-batches a
    step: inside a generation batch that straddles steps; steps_per_generation 4: between its two
    steps) resumes on the rollout its checkpoint holds, with the reference of the initial weights
    (not the checkpoint's): bitwise the uninterrupted run's losses and weights, and the next
    rollout samples the same completions."""
    tmp_path, _ = setup
    kw = kw | dict(learning_rate=LR_AGAIN, save_strategy="steps", save_steps=1)
    whole_records, whole_rollouts, whole = run(tmp_path, "whole", max_steps=5, **kw)
    got = [(tmp_path / "whole" / f"checkpoint-{s}" / ROLLOUT_FILE).is_file() for s in range(1, 6)]
    assert got == held  # not where the next step starts a generation batch
    run(tmp_path, "cut", max_steps=stop, **kw)
    records, rollouts, resumed = run(tmp_path, "cut", max_steps=5, resume_from_checkpoint=True, **kw)
    assert [r["loss"] for r in records] == [r["loss"] for r in whole_records]
    assert [r.get("kl") for r in records] == [r.get("kl") for r in whole_records]
    later = [[r["completion_ids"] for r in rs if r["step"] > stop] for rs in (whole_rollouts, rollouts)]
    assert later[0] == later[1] and later[0]
    for k in whole:
        assert torch.equal(whole[k], resumed[k]), k


def test_the_generation_order_is_a_permutation_of_the_seed_and_the_generation_batch_alone():
    """generation_order draws from a generator of its own: the global generator's state changes
    nothing, and nothing is drawn from it; each generation batch has an order of its own."""
    torch.manual_seed(0)
    first = generation_order(SEED, 3, 16)
    state = torch.random.get_rng_state()
    torch.manual_seed(1)
    assert torch.equal(generation_order(SEED, 3, 16), first)
    torch.manual_seed(0)
    generation_order(SEED, 3, 16)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert sorted(first.tolist()) == list(range(16)) and first.tolist() != list(range(16))
    assert not torch.equal(generation_order(SEED, 4, 16), first)
    assert not torch.equal(generation_order(SEED + 1, 3, 16), first)


def test_the_reference_copy_is_the_initial_weights_in_the_compute_dtype(setup):
    """stages.grpo_reference: the initial weights, in bf16 as on a GPU by the master's halves'
    rounding (the policy's own numbers before its first step: host/split.py), as many bytes as
    reference_copy_bytes counts for the plan; nothing without a KL term."""
    tmp_path, tok = setup
    args = dict(
        model_name_or_path=str(tmp_path / "model"),
        dataset="x",
        stage="grpo",
        reward_funcs=["length"],
        per_device_train_batch_size=8,
    )
    cfg = TrainConfig(**args, beta=0.04)
    model_cfg = ModelConfig.from_json(tmp_path / "model")
    copy = grpo_reference(cfg, model_cfg, torch.bfloat16)
    for k, p in model(len(tok)).named_parameters():
        assert torch.equal(copy[k].view(torch.int16), to_bf16(p.detach().float()).view(torch.int16)), k
    size = sum(v.numel() * v.element_size() for v in copy.values())
    assert size == reference_copy_bytes(model_cfg.num_params, 2, cfg.grpo()) > 0
    assert grpo_reference(TrainConfig(**args), model_cfg, torch.bfloat16) is None
    assert reference_copy_bytes(model_cfg.num_params, 2, TrainConfig(**args).grpo()) == 0
    assert reference_copy_bytes(model_cfg.num_params, 2, None) == 0  # another stage


def test_tokens_outside_the_loss_cannot_make_it_nan():
    """Positions outside the loss whose log-prob is far below the value stored there (exp of the
    difference overflows) leave the loss finite."""

    class Project(torch.nn.Module):
        def forward(self, x, W):
            return x @ W.T

    vocab, width = 8, 6
    ids = torch.tensor([[1, 2, 3, 4, 5, 0]])
    labels = torch.tensor([[-100, -100, -100, 4, 5, -100]])  # a prompt of three, two completion tokens
    objective = GRPO(GRPOConfig(num_generations=2, beta=0.04, num_iterations=2), micro_batches=1)
    mb = MicroBatch(
        ids, labels, extra=torch.ones(1, 1, dtype=torch.float64), token_extra=torch.zeros(1, width, 2)
    )
    mb.token_extra[0, 2:4] = -2.0  # stored log-probs of the completion tokens; 0 elsewhere
    hidden = torch.zeros(1, width, vocab)
    hidden[0, :2, 1] = 1e3  # in the prompt, the log-prob taken (of token 0) is about -1000
    head = Head(Project(), {}, torch.eye(vocab), chunk=4)
    loss = objective.loss_sum(head, [hidden], [objective.targets(mb, torch.device("cpu"))])
    assert torch.isfinite(loss)


@pytest.mark.slow
def test_two_processes_equal_one(setup):
    """The step's prompts split over two gloo processes (each samples its half from the
    completions' own streams, advantages over both halves, reused for num_iterations steps with a
    KL term), and the eval prompts (one to the first, two to the second): the same completions,
    losses, rewards, eval metrics and weights as one process with the same global batch. The
    per-micro-batch means (entropy, kl, clip ratios) are not compared: one process shuffles its 8
    completions into two micro-batches, two processes each shuffle their 4 into one (as TRL's
    processes do), so the micro-batches hold other completions; grpo's loss, a mean over
    completions of micro-batches of one size, is the same."""
    tmp_path, _ = setup
    kw = dict(
        num_iterations=2, beta=0.04, loss_type="grpo", eval_dataset=write_eval_prompts(tmp_path), eval_steps=2
    )
    keys = (
        "loss",
        "grad_norm",
        "reward",
        "reward_std",
        "completions/mean_length",
        "completions/clipped_ratio",
    )
    one, two = two_against_one(tmp_path, keys, **kw)
    got, want = [r for r in two if is_eval(r)], [r for r in one if is_eval(r)]
    assert [r["step"] for r in got] == [r["step"] for r in want] == [2, STEPS]
    # Every process's eval completions, in the prompts' order, with their group's advantages.
    assert eval_completions(tmp_path / "two") == eval_completions(tmp_path / "one")
    assert all("eval_loss" in r for r in got + want)
    for a, b in zip(got, want):
        # (grpo's eval_loss is a mean over completions, whichever batches they are in)
        for k in [
            k for k in b if k.startswith(("eval_reward", "eval_completions/", "eval_frac", "eval_loss"))
        ]:
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k)


@pytest.mark.slow
def test_generation_batch_size_counts_every_process(setup):
    """generation_batch_size 16 with 4 completions a micro-batch: one process splits each
    generation batch over 4 micro-batches (2 steps of 2), two processes of one micro-batch a step
    each over 2: generation batches at the same steps, the first sampled alike (each completion
    from its own stream), with the same rewards over both processes."""
    tmp_path, _ = setup
    kw = dict(generation_batch_size=4 * B, max_steps=4, learning_rate=LR_AGAIN)
    one, one_rollouts, _ = run(tmp_path, "one", **kw)
    two, two_rollouts, _ = run_two(tmp_path, **kw)
    assert [r["step"] for r in one if "reward" in r] == [r["step"] for r in two if "reward" in r] == [1, 3]
    # The first generation batch (the initial weights; the steps after train on other slices of
    # it): the main process writes its half, the first.
    mine = [r["completion_ids"] for r in two_rollouts if r["step"] == 1]
    assert (
        len(mine) == 2 * B and mine == [r["completion_ids"] for r in one_rollouts if r["step"] == 1][: 2 * B]
    )
    for k in ("reward", "reward_std", "completions/mean_length", "completions/clipped_ratio"):
        assert two[0][k] == pytest.approx(one[0][k], rel=1e-6), k


def test_streamed_rollout_layers_train_as_resident_ones(setup):
    """A run whose rollouts stream the policy's layers through the device (none kept, one kept)
    samples, trains and ends bitwise as one that keeps them all, with beta > 0 (the reference
    policy's layers streamed too); the metrics say how many layers streamed and what they cost."""
    tmp_path, _ = setup
    kw = dict(max_steps=2, beta=0.04, num_iterations=2)
    resident = run(tmp_path, "resident", **kw)
    for kept in (0, 1):
        records, rollouts, weights = run(tmp_path, f"kept{kept}", rollout_resident_layers=kept, **kw)
        assert rollouts == resident[1]
        sampled = [r for r in records if "loss" in r and "rollout/streamed_layers" in r]
        assert sampled and all(r["rollout/streamed_layers"] == 2 - kept for r in sampled)
        assert all(r["rollout/fetched_bytes"] > 0 for r in sampled)
        losses = [(r["loss"], r["grad_norm"]) for r in records if "loss" in r]
        assert losses == [(r["loss"], r["grad_norm"]) for r in resident[0] if "loss" in r]
        assert weights.keys() == resident[2].keys()
        assert all(torch.equal(weights[k], resident[2][k]) for k in weights)
    assert all(r.get("rollout/streamed_layers", 0) == 0 for r in resident[0])


def test_streamed_layers_fetched_from_the_masters_bf16_half_train_as_resident_ones(setup):
    """In bf16 the streamed layers are fetched from the master weights' bf16 halves as they are
    (host/split.py): the run samples, trains and ends bitwise as one that keeps every layer, each
    rollout fetching 2 bytes a streamed parameter a time."""
    tmp_path, _ = setup
    kw = dict(max_steps=2, num_iterations=1, compute_dtype="bfloat16")
    resident = run(tmp_path, "resident", **kw)
    records, rollouts, weights = run(tmp_path, "streamed", rollout_resident_layers=0, **kw)
    plan = json.loads((tmp_path / "streamed" / "plan.json").read_text())["plan"]
    assert plan["rollout_layers"] == 0
    assert rollouts == resident[1]
    losses = [(r["loss"], r["grad_norm"]) for r in records if "loss" in r]
    assert losses == [(r["loss"], r["grad_norm"]) for r in resident[0] if "loss" in r]
    assert all(torch.equal(weights[k], resident[2][k]) for k in weights)
    model_cfg = ModelConfig.from_json(tmp_path / "model")
    layer = layer_params(model_cfg)[0] * 2  # one layer in bf16
    sampled = [r for r in records if "rollout/fetched_bytes" in r]
    fetched = [r["rollout/fetched_bytes"] for r in sampled]
    assert fetched and all(n % layer == 0 < n for n in fetched)
    assert all(n % (2 * layer) for n in fetched)  # an odd number of layers: not fp32 bytes


@pytest.mark.gpu
def test_on_cuda_each_completion_is_generate_of_its_prompt_alone(setup):
    """The rollout on the GPU (the policy built on the device from the host state, one batch of
    left-padded prompts, fp32): each completion of the first step is `generate`'s on the GPU for
    its prompt alone with its own stream."""
    tmp_path, tok = setup
    _, rollouts, _ = run(tmp_path, max_steps=1, seed=7, device="cuda", compute_dtype="float32")
    first = [r for r in rollouts if r["step"] == 1]
    hf = model(len(tok)).cuda().eval()
    assert_each_is_generate_alone(first, tok, hf, "cuda")


@pytest.mark.gpu
def test_on_cuda_grpo_repeats_bit_for_bit_under_full_determinism(setup):
    """GRPO on the GPU (bf16: the rollout's `generate`, the policy's loss) under strict
    deterministic mode: no op refuses, and two runs sample the same completions and train to
    bitwise the same weights."""
    from test_checkpoint import assert_bitwise

    tmp_path, _ = setup
    (ra, ca, wa), (rb, cb, wb) = (run(tmp_path, name, device="cuda", full_determinism=True) for name in "ab")
    assert [c["completion"] for c in ca] == [c["completion"] for c in cb]
    assert [r.get("loss") for r in ra] == [r.get("loss") for r in rb]
    assert_bitwise(wb, wa)


def test_a_resume_with_other_stage_settings_says_which(setup, capsys):
    """A resume may change the stage's settings, with a warning naming each (the continuation is
    then not the uninterrupted run's)."""
    tmp_path, _ = setup
    run(tmp_path, max_steps=2, save_strategy="steps", save_steps=1)
    capsys.readouterr()
    run(tmp_path, max_steps=3, resume_from_checkpoint=True, beta=0.04, temperature=0.9)
    line = next(
        x for x in capsys.readouterr().out.splitlines() if "settings changed since the checkpoint" in x
    )
    assert "beta: None -> 0.04" in line and "temperature: 1.0 -> 0.9" in line  # None: the stage default


@pytest.mark.gpu
def test_on_cuda_the_policy_reads_device_resident_units_on_the_device(setup, monkeypatch):
    """Units whose state lives on the GPU are read there for the rollout's policy, not copied
    back to host memory first: the weights each rollout is built from equal the host state's after
    a full write-back, bit for bit, and some units were read from the device."""
    from megatrain.rl import rollout as rollout_module

    tmp_path, _ = setup
    seen = []
    build = rollout_module.Rollout._on_device

    def checked(self, weights):
        weights = [(n, t) for n, t in weights]
        on_device = sum(isinstance(t, torch.Tensor) and t.device.type == "cuda" for _, t in weights)
        self.model.transport.synchronize()  # host memory current: what the rollout used to read
        host = fp32_parameters(self.model.state)
        assert all(torch.equal(cast(t, torch.float32).cpu(), host[n]) for n, t in weights)
        seen.append(on_device)
        return build(self, weights)

    monkeypatch.setattr(rollout_module.Rollout, "_on_device", checked)
    run(tmp_path, max_steps=3, device="cuda", compute_dtype="float32")  # gpu_state auto: resident state
    assert len(seen) == 3 and seen[-1] > 0


@pytest.mark.parametrize("kw", [{}, dict(loss_type="bnpo", beta=0.04), dict(steps_per_generation=1)], ids=str)
def test_shared_prompts_train_as_separate_rows(setup, kw):
    """`share_prompts`: each prompt through the layers once for its completions of the step,
    against each completion's row of its own: the same completions, the losses, the gradient
    norms and the final weights equal to rounding."""
    tmp_path, _ = setup
    records, rollouts, final = run(tmp_path, "rows", **kw)
    shared, shared_rollouts, shared_final = run(tmp_path, "shared", share_prompts=True, **kw)
    assert [r["completion_ids"] for r in shared_rollouts] == [r["completion_ids"] for r in rollouts]
    got, want = [r for r in shared if "loss" in r], [r for r in records if "loss" in r]
    assert len(got) == len(want) == STEPS
    for a, b in zip(got, want):
        for k in ("loss", "grad_norm", "entropy", "clip_ratio/region_mean"):
            assert a[k] == pytest.approx(b[k], rel=1e-5, abs=1e-7), (a["step"], k)
    for k in final:
        torch.testing.assert_close(shared_final[k], final[k], rtol=1e-5, atol=1e-6)
    assert any(not torch.equal(shared_final[k], final[k]) for k in final)  # another order of sums


def test_shared_prompts_are_refused_where_the_layout_would_change_the_arithmetic(setup):
    """A sliding window counts along the row, which the shared layout reorders: one line,
    nothing written."""
    tmp_path, tok = setup
    tiny_hf_model(
        "mistral", seed=0, num_hidden_layers=2, vocab_size=len(tok), sliding_window=8
    ).save_pretrained(tmp_path / "windowed")
    tok.save_pretrained(tmp_path / "windowed")
    with pytest.raises(ConfigError, match="^share_prompts: the model's sliding-window attention"):
        run(tmp_path, model_name_or_path=str(tmp_path / "windowed"), share_prompts=True)
    assert not (tmp_path / "out").exists()
