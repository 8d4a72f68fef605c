"""The stale sampler (`max_staleness: 1`) against TRL 1.16's correction of vLLM's sampler: each step
trained by a plain PyTorch loop over the transformers model implementing GRPOTrainer's
`_generate_and_score_completions` (the importance-sampling ratio of each
`vllm_importance_sampling_mode`, its metrics) and `_compute_loss` (with TRL's own
`get_off_policy_mask`), on the completions the run recorded, the sampler's log-probs taken from the
weights of two steps before (those each batch's sampling step started from) under transformers'
warpers: losses, metrics and final weights agree in fp32. The rollout of step k+1 is sampling with
step k's starting weights (the run's own checkpoints), not the newest; the default is unchanged;
a resume is exact; the rollout engine's and `generate`'s sampler log-probs are those of the warped
distribution."""

from __future__ import annotations

import copy
import json
import math

import pytest
import test_grpo
import torch
import trl
from helpers import saved_parameters, tiny_tokenizer
from test_checkpoint import signal_after_step
from test_grpo import (
    GA,
    LR,
    MAX_NEW,
    MAX_NORM,
    SEED,
    WD,
    B,
    G,
    model,
    reward_table,
    run,
    trl_advantages,
    trl_inputs,
    trl_logps,
    two_against_one,
)
from test_parity import _decay_groups
from transformers import AutoModelForCausalLM, LogitsProcessorList
from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper

from megatrain.engine.engine import Engine
from megatrain.engine.transport import SerialTransport
from megatrain.errors import ConfigError
from megatrain.guard import TrainingInterrupted
from megatrain.rl.decode import Decoder
from megatrain.rl.offpolicy import PENDING_FILE
from megatrain.rl.rollout import ROLLOUT_FILE, Rollout, generation_order
from megatrain.rl.sampling import RowSampler, Warpers, row_seed

EPS = 1e-4  # AdamW's (test_grpo's)
LR_STALE = 1e-3  # the sampler two steps behind: ratios that reach the clip bounds, not all of them
SAMPLING = [
    f"sampling/{k}"
    for k in ("sampling_logp_difference/mean", "sampling_logp_difference/max", "importance_sampling_ratio/min",
              "importance_sampling_ratio/mean", "importance_sampling_ratio/max")
]  # fmt: skip


@pytest.fixture
def setup(tmp_path):
    """test_grpo's tiny Llama, its tokenizer and 12 prompts in `tmp_path`."""
    return test_grpo.setup.__wrapped__(tmp_path)


# ------------------------------------------------------------------------ TRL, transcribed
def warped_logps(hf, ids, attn, temperature=1.0, top_k=None):
    """vLLM's `processed_logprobs` of each next token: the log-softmax of the logits after
    transformers' temperature and top-k warpers (the distribution the token was drawn from)."""
    logits = hf(ids, attention_mask=attn).logits[:, :-1].float()
    warpers = LogitsProcessorList()
    if temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(temperature))
    if top_k:
        warpers.append(TopKLogitsWarper(top_k))
    flat = logits.reshape(-1, logits.shape[-1])
    warped = (warpers(None, flat) if warpers else flat).view_as(logits)
    return warped.log_softmax(-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def trl_is_ratio(old, sampling, mask, mode, lo, hi):
    """GRPOTrainer._generate_and_score_completions' vllm_importance_sampling_ratio."""
    per_token_logps_diff = (old - sampling) * mask
    per_token_logps_diff = torch.nan_to_num(per_token_logps_diff, nan=0.0)
    sequence_level_is = mode in ["sequence_mask", "sequence_truncate"]
    logps_diff = per_token_logps_diff.sum(dim=-1, keepdim=True) if sequence_level_is else per_token_logps_diff
    ratio = torch.exp(logps_diff)
    if mode in ["sequence_truncate", "token_truncate"]:
        ratio = torch.clamp(ratio, min=lo, max=hi)
    else:
        min_val = lo if lo is not None else -math.inf
        max_val = hi if hi is not None else math.inf
        ratio = ratio.masked_fill((ratio < min_val) | (ratio > max_val), value=0.0)
    return ratio


def trl_sampling_metrics(old, sampling, ratio, masks, mode):
    """TRL's sampling/* metrics of one generation batch (one process), from its micro-batches'
    old and sampler log-probs, ratios and completion masks."""
    deltas, flats = [], []
    for o, s, r, m in zip(old, sampling, ratio, masks):
        delta = torch.abs(o - s)
        deltas.append(delta[m.bool() & ~torch.isnan(delta)])
        flats.append(r.flatten() if mode.startswith("sequence") else r[m.bool()])
    delta, flat = torch.cat(deltas), torch.cat(flats)
    return dict(zip(SAMPLING, [float(delta.mean()), float(delta.max()), float(flat.min()), float(flat.mean()),
                               float(flat.max())]))  # fmt: skip


def trl_step_loss(logps, entropy, cmask, a, num_items, old, ratio, opsm_sampling, kw, ref=None):
    """GRPOTrainer._compute_loss of one micro-batch (dapo or grpo): the off-policy mask (TRL's
    own get_off_policy_mask) and the sampler's correction on the policy term, the KL term after."""
    eps, beta, loss_type = 0.2, kw.get("beta", 0.0), kw.get("loss_type", "dapo")
    old = logps.detach() if old is None else old
    threshold = kw.get("off_policy_mask_threshold")
    if threshold is not None:
        off_policy_mask = trl.GRPOTrainer.get_off_policy_mask(
            advantages=a,
            per_token_logps=logps,
            sampling_per_token_logps=old if opsm_sampling is None else opsm_sampling,
            mask=cmask,
            off_policy_threshold=threshold,
        )
    coef_1 = torch.exp(logps - old)
    coef_2 = torch.clamp(coef_1, 1 - eps, 1 + eps)
    per_token_loss = -torch.min(coef_1 * a, coef_2 * a)
    if threshold is not None:
        per_token_loss = per_token_loss * off_policy_mask
    if ratio is not None:
        per_token_loss = per_token_loss * ratio
    if beta != 0.0:
        kl = torch.exp(ref - logps) - (ref - logps) - 1
        per_token_loss = per_token_loss + beta * kl * coef_1
    if loss_type == "grpo":
        loss = ((per_token_loss * cmask).sum(-1) / cmask.sum(-1).clamp(min=1.0)).mean() / GA
    else:
        loss = (per_token_loss * cmask).sum() / num_items

    def mean(x):
        return float((x * cmask).sum() / cmask.sum().clamp(min=1.0))

    low, high = (coef_1 < 1 - eps) & (a < 0), (coef_1 > 1 + eps) & (a > 0)
    return loss, {"entropy": mean(entropy), "clip_ratio/region_mean": mean((low | high).float())}


def trl_stale_run(tok, rollouts, steps, kw):
    """GRPOTrainer (use_vllm, its importance-sampling correction) on the completions the run
    recorded, micro-batch by micro-batch as `_prepare_inputs` buffers them: each generation batch
    sampled (where max_staleness is 1) by the weights of two steps before its first (its sampling
    step's start; step 1's and 2's: the initial ones), its old log-probs the policy's when it is
    generated. Each step's loss and metrics, the trained model and the weights after each step."""
    hf, sampler, reference = model(len(tok)), model(len(tok)), model(len(tok))
    stale = kw.get("max_staleness", 0) == 1
    mode = kw.get("vllm_importance_sampling_mode", "sequence_mask")
    lo, hi = kw.get("vllm_importance_sampling_clip_min"), kw.get("vllm_importance_sampling_clip_max", 3.0)
    corrects = stale and kw.get("vllm_importance_sampling_correction", True)
    temperature, top_k = kw.get("temperature", 1.0), kw.get("top_k")
    k, slices = kw.get("num_iterations", 1), kw.get("steps_per_generation", GA)
    opt = torch.optim.AdamW(
        _decay_groups(hf, WD), lr=kw.get("learning_rate", LR), betas=(0.9, 0.999), eps=EPS
    )
    history = [copy.deepcopy(hf.state_dict())]  # the weights after each step (0: the initial ones)
    pending, out, seen = iter(rollouts), [], 0
    for step in range(1, steps + 1):
        sampled, loss, metrics = [], 0.0, []
        for micro in range((step - 1) * GA, step * GA):
            if micro % (slices * k) == 0:
                batch = [next(pending) for _ in range(B * slices)]
                assert all(r["step"] == step for r in batch)
                adv = trl_advantages(reward_table(batch), [-0.05, 1.0], "group").float()
                rows = [(tok(r["prompt"])["input_ids"], r["completion_ids"], r["truncated"]) for r in batch]
                order = generation_order(SEED, micro // (slices * k), len(rows))
                rows, adv = [rows[i] for i in order.tolist()], adv[order]
                num_items = sum(len(c) for _, c, _ in rows)
                seen += sum(len(p) + len(c) for p, c, _ in rows)  # num_input_tokens_seen, when generated
                mbs = [trl_inputs(rows[m * B : (m + 1) * B], False) for m in range(slices)]
                sampler.load_state_dict(history[max(step - 2, 0)])
                with torch.no_grad():  # once per generation batch, as TRL takes them
                    needs_old = stale or GA % (slices * k) != 0
                    old = [
                        trl_logps(hf, ids, attn, temperature)[0] if needs_old else None
                        for ids, attn, _ in mbs
                    ]
                    ref = [trl_logps(reference, ids, attn, temperature)[0] for ids, attn, _ in mbs]
                    sampling = [warped_logps(sampler, ids, attn, temperature, top_k) for ids, attn, _ in mbs]
                    ratio = [trl_is_ratio(o, s, c, mode, lo, hi) for o, s, (*_, c) in zip(old, sampling, mbs)]
                sampled.append(trl_sampling_metrics(old, sampling, ratio, [c for *_, c in mbs], mode))
            m = micro % slices
            ids, attn, cmask = mbs[m]
            logps, entropy = trl_logps(hf, ids, attn, temperature)
            lm, mm = trl_step_loss(
                logps, entropy, cmask, adv[m * B : (m + 1) * B, None], num_items * GA / slices, old[m],
                ratio[m] if corrects else None, sampling[m] if stale else None, kw, ref[m],
            )  # fmt: skip
            lm.backward()
            loss += lm.item()
            metrics.append(mm)
        torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad()
        history.append(copy.deepcopy(hf.state_dict()))
        record = (
            {n: sum(s[n] for s in sampled) / len(sampled) for n in SAMPLING} if sampled and corrects else {}
        )
        record |= {n: sum(mm[n] for mm in metrics) / len(metrics) for n in metrics[0]}
        record |= {"num_tokens": seen} if sampled else {}  # TRL logs it where it generates
        out.append(record | {"loss": loss})
    assert next(pending, None) is None
    return hf, out, history


# Each correction mode with bounds that bind on a share of the ratios; the off-policy mask with and
# without the correction and on-policy (where it takes the stored old log-probs); the correction
# where a generation batch's old log-probs are stored (num_iterations 2: its metrics when sampled),
# several batches a step (their metrics averaged), a KL term, the warped distribution of
# temperature and top-k, grpo's aggregation, and `generate` as the sampler.
TOKEN, SEQUENCE = (
    dict(vllm_importance_sampling_clip_min=0.8, vllm_importance_sampling_clip_max=1.25),
    dict(vllm_importance_sampling_clip_min=0.5, vllm_importance_sampling_clip_max=2.0),
)
CASES = [
    dict(vllm_importance_sampling_mode="token_truncate", **TOKEN),
    dict(vllm_importance_sampling_mode="token_mask", **TOKEN),
    dict(vllm_importance_sampling_mode="sequence_truncate", **SEQUENCE),
    dict(vllm_importance_sampling_mode="sequence_mask", **SEQUENCE),
    dict(vllm_importance_sampling_mode="sequence_mask", off_policy_mask_threshold=0.02, **SEQUENCE),
    dict(vllm_importance_sampling_correction=False, off_policy_mask_threshold=0.02),
    dict(vllm_importance_sampling_mode="token_mask", num_iterations=2, **TOKEN),
    dict(vllm_importance_sampling_mode="token_truncate", steps_per_generation=1, **TOKEN),
    dict(vllm_importance_sampling_mode="sequence_truncate", beta=0.04, loss_type="grpo", **SEQUENCE),
    dict(vllm_importance_sampling_mode="token_mask", temperature=0.7, top_k=20, **TOKEN),
    dict(vllm_importance_sampling_mode="token_mask", rollout_engine="generate", **TOKEN),
]
ON_POLICY = [dict(max_staleness=0, num_iterations=2, off_policy_mask_threshold=0.001)]


@pytest.mark.parametrize(
    "kw",
    [dict(max_staleness=1, learning_rate=LR_STALE) | c for c in CASES] + ON_POLICY,
    ids=lambda kw: "-".join(f"{k.removeprefix('vllm_importance_sampling_')}={v}" for k, v in kw.items()),
)
def test_the_stale_sampler_trains_as_trls_correction(setup, kw):
    tmp_path, tok = setup
    steps = 3 + (kw.get("num_iterations", 1) > 1)
    records, rollouts, final = run(tmp_path, max_steps=steps, **kw)
    got = [r for r in records if "loss" in r]
    hf, want, _ = trl_stale_run(tok, rollouts, steps, kw)
    for rec, expected in zip(got, want, strict=True):
        assert rec["loss"] == pytest.approx(expected.pop("loss"), rel=1e-4, abs=1e-6), rec["step"]
        for name, value in expected.items():  # the sampler's log-probs: the engine's rounding apart
            close = 2e-5 if name in SAMPLING else 1e-6
            assert rec[name] == pytest.approx(value, rel=1e-4, abs=close), (rec["step"], name)
        assert (SAMPLING[0] in rec) == (SAMPLING[0] in expected)
    if kw.get("max_staleness") and kw.get("vllm_importance_sampling_correction", True):
        # The sampler's first batch is the policy's own: ratios of 1 but for the engine's rounding
        # (with top-k, the sampler's distribution is the truncated one: theirs differ from 1).
        assert (got[0][SAMPLING[0]] < 1e-5) == ("top_k" not in kw)
        lo, hi = kw["vllm_importance_sampling_clip_min"], kw["vllm_importance_sampling_clip_max"]
        bound = [(r[SAMPLING[2]], r[SAMPLING[4]]) for r in got[1:] if SAMPLING[2] in r]
        if kw["vllm_importance_sampling_mode"].endswith("mask"):  # some ratios set to 0, not all
            assert any(low == 0 < high for low, high in bound)
        else:  # some truncated
            assert any(low == pytest.approx(lo) or high == pytest.approx(hi) for low, high in bound)
    for name, p in saved_parameters(hf).items():
        torch.testing.assert_close(
            final[name], p.detach(), rtol=1e-4, atol=1e-4 * kw.get("learning_rate", LR) / LR
        )


def test_the_stale_rollout_is_sampled_by_the_weights_the_step_before_started_from(setup):
    """max_staleness 1: step k+1's completions are those that the weights step k started from
    (the run's checkpoint after step k-1) sample from the completions' own streams, and not those
    of the newest weights (after step k); step 1's and 2's both the initial weights'. A run that
    checkpoints (the next batch sampled before each save) samples what one that does not does."""
    tmp_path, tok = setup
    kw = dict(max_staleness=1, max_steps=3, seed=7)
    _, rollouts, plain = run(tmp_path, "plain", **kw)
    _, saved_rollouts, saved = run(tmp_path, "saved", save_strategy="steps", save_steps=1, **kw)
    assert saved_rollouts == rollouts
    assert all(torch.equal(saved[k], plain[k]) for k in plain)
    weights = [model(len(tok))] + [
        AutoModelForCausalLM.from_pretrained(tmp_path / "saved" / f"checkpoint-{s}") for s in (1, 2)
    ]

    def sampled_by(hf, step):
        rows = []
        for n, r in enumerate(x for x in rollouts if x["step"] == step):
            ids, prompt = torch.tensor([tok(r["prompt"])["input_ids"]]), int(r["prompt"].split()[1])
            out = hf.eval().generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=MAX_NEW,
                logits_processor=[RowSampler([row_seed(7, step, prompt, n % G)], "cpu")],
                eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
            )[0, ids.shape[1] :].tolist()  # fmt: skip
            end = next((i for i, t in enumerate(out) if t == tok.eos_token_id), None)
            rows.append(out if end is None else out[: end + 1])
        return rows

    for step, by in ((1, 0), (2, 0), (3, 1)):
        mine = [r["completion_ids"] for r in rollouts if r["step"] == step]
        assert mine == sampled_by(weights[by], step), step
    assert [r["completion_ids"] for r in rollouts if r["step"] == 3] != sampled_by(weights[2], 3)


@pytest.mark.parametrize("stale", [0, 1])
def test_the_stale_rollout_samples_before_it_waits_for_the_last_update(setup, monkeypatch, stale):
    """The order of a run's waits for the last step's optimizer, samplings and updates. On-policy
    a rollout waits for the last update, then samples. Stale, it lets the last update run and
    samples from the policy built before it (a snapshot), and waits only after, to build the next
    step's snapshot; the last step builds none. So on a GPU the sampling overlaps the host AdamW
    of the step before."""
    tmp_path, _ = setup
    events = []

    def logged(cls, name, event):
        orig = getattr(cls, name)

        def call(self, *a, **k):
            events.append(event)
            return orig(self, *a, **k)

        monkeypatch.setattr(cls, name, call)

    logged(Rollout, "_sample", "sample")
    logged(SerialTransport, "wait_updates", "wait")
    logged(SerialTransport, "run_updates", "run")
    logged(Engine, "step", "update")
    run(tmp_path, max_staleness=stale)
    if not stale:
        assert events == ["wait", "sample", "update"] * 3
    else:
        assert events == ["wait", "sample", "wait", "update"] + ["run", "sample", "wait", "update"] + [
            "run",
            "sample",
            "update",
        ]


def test_max_staleness_0_is_the_default_and_the_correction_keys_leave_it_alone(setup):
    """The correction's keys act with max_staleness 1 alone: set with 0 the run is the default's,
    bitwise, and neither logs the sampler's metrics nor checkpoints a sampled batch."""
    tmp_path, _ = setup
    records, rollouts, weights = run(tmp_path, "default", save_strategy="steps", save_steps=1)
    keys = dict(vllm_importance_sampling_mode="token_truncate", vllm_importance_sampling_clip_max=1.1)
    again, again_rollouts, again_weights = run(tmp_path, "keys", max_staleness=0, **keys)
    assert again_rollouts == rollouts
    assert [r["loss"] for r in again if "loss" in r] == [r["loss"] for r in records if "loss" in r]
    assert all(torch.equal(again_weights[k], weights[k]) for k in weights)
    assert not any(k.startswith("sampling/") for r in records for k in r)
    assert not list((tmp_path / "default").glob(f"checkpoint-*/{PENDING_FILE}"))


@pytest.mark.parametrize("kw,stop", [(dict(), 2), (dict(num_iterations=2, beta=0.04), 2),
                                     (dict(steps_per_generation=1), 1)],
                         ids=["one-a-step", "num_iterations", "two-a-step"])  # fmt: skip
def test_a_stale_resume_trains_as_the_uninterrupted_run(setup, kw, stop, monkeypatch):
    """A checkpoint after step k holds the batches sampled for step k+1 by step k's starting
    weights (which it does not hold), and a resume trains on them, then samples on from the
    checkpoint's weights: a run stopped by a signal after step k and resumed gives bitwise the
    uninterrupted run's losses, completions and weights."""
    tmp_path, _ = setup
    kw = kw | dict(max_staleness=1, learning_rate=LR_STALE, save_strategy="steps", save_steps=1, max_steps=4)
    whole_records, whole_rollouts, whole = run(tmp_path, "whole", **kw)
    starts = [(tmp_path / "whole" / f"checkpoint-{s}" / PENDING_FILE).is_file() for s in range(1, 5)]
    every = kw.get("num_iterations", 1)
    assert starts == [s % every == 0 and s < 4 for s in range(1, 5)]  # none after the last step
    if every > 1:
        assert (tmp_path / "whole" / "checkpoint-1" / ROLLOUT_FILE).is_file()
    orig = signal_after_step(monkeypatch, stop)
    with pytest.raises(TrainingInterrupted, match=f"saved checkpoint-{stop}"):
        run(tmp_path, "cut", **(kw | dict(save_strategy="no")))
    monkeypatch.setattr(Engine, "step", orig)
    assert (tmp_path / "cut" / f"checkpoint-{stop}" / PENDING_FILE).is_file()
    records, rollouts, resumed = run(tmp_path, "cut", resume_from_checkpoint=True, **kw)
    assert [r["loss"] for r in records] == [r["loss"] for r in whole_records]
    assert [r.get(SAMPLING[3]) for r in records] == [r.get(SAMPLING[3]) for r in whole_records]
    later = [[r["completion_ids"] for r in rs if r["step"] > stop] for rs in (whole_rollouts, rollouts)]
    assert later[0] == later[1] and later[0]
    assert all(torch.equal(whole[k], resumed[k]) for k in whole)


@pytest.mark.parametrize("kw", [dict(), dict(compute_dtype="bfloat16")], ids=["fp32", "bf16"])
def test_stale_rollouts_with_streamed_layers_train_as_resident_ones(setup, kw):
    """A stale policy whose streamed layers come from the master weights (which the step's update
    writes) samples at once, before it; a resident one keeps its policy through the update:
    bitwise alike, in fp32 and bf16 compute."""
    tmp_path, _ = setup
    kw = kw | dict(max_steps=3, max_staleness=1, learning_rate=LR_STALE)
    resident = run(tmp_path, "resident", **kw)
    records, rollouts, weights = run(tmp_path, "streamed", rollout_resident_layers=1, **kw)
    assert rollouts == resident[1]
    assert [r["loss"] for r in records if "loss" in r] == [r["loss"] for r in resident[0] if "loss" in r]
    assert all(torch.equal(weights[k], resident[2][k]) for k in weights)
    assert all(r["rollout/streamed_layers"] == 1 for r in records if "reward" in r)


@pytest.mark.parametrize("warpers", [dict(), dict(temperature=0.7, top_k=20)], ids=["plain", "warped"])
def test_each_drawn_tokens_log_prob_is_the_warped_distributions(warpers):
    """The rollout engine's and `generate`'s (RowSampler's) log-prob of each drawn token: that of
    the distribution it was drawn from (the logits under temperature and top-k), as the model's
    full forward gives it, both ways alike."""
    tok = tiny_tokenizer()
    hf = model(len(tok)).eval()
    prompts = [tok("Say 1 once:")["input_ids"], tok("Say 22 twice, then stop:")["input_ids"]]
    seeds = [row_seed(3, i) for i in range(len(prompts))]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    decoder = Decoder(hf, "cpu", [eos], pad, Warpers(**warpers), graphs=False, logps=True)
    rows = decoder.sample(prompts, seeds, MAX_NEW)
    for i, (p, row) in enumerate(zip(prompts, rows)):
        row = row[: row.index(eos) + 1] if eos in row else row
        ids = torch.tensor([p + row])
        with torch.no_grad():
            want = warped_logps(hf, ids, torch.ones_like(ids), **warpers)[0, len(p) - 1 :]
        torch.testing.assert_close(decoder.sampled_logps[i, : len(row)], want, rtol=1e-5, atol=1e-5)
        sampler = RowSampler([seeds[i]], "cpu", logps=True, **warpers)
        out = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                          do_sample=False, logits_processor=[sampler], max_new_tokens=MAX_NEW,
                          eos_token_id=[eos], pad_token_id=pad)  # fmt: skip
        assert out[0, len(p) :].tolist() == row
        torch.testing.assert_close(torch.stack(sampler.logps, 1)[0], want, rtol=1e-5, atol=1e-5)
    assert any(eos in r for r in rows) or any(len(r) == MAX_NEW for r in rows)


@pytest.mark.parametrize(
    "kw,match",
    [
        (dict(max_staleness=2), r"max_staleness: must be 0 \(on-policy\) or 1 .* \(got 2\)"),
        (
            dict(max_staleness=1, vllm_importance_sampling_mode="sequence"),
            r"vllm_importance_sampling_mode: must",
        ),
        (dict(stage="rloo", max_staleness=1), r"max_staleness: is stage grpo's.*RLOOTrainer"),
        (dict(stage="rloo", off_policy_mask_threshold=0.5), r"off_policy_mask_threshold: is stage grpo's"),
    ],
)
def test_bad_staleness_settings_are_one_line(setup, kw, match):
    tmp_path, _ = setup
    with pytest.raises(ConfigError, match=match):
        run(tmp_path, **kw)
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "kw",
    [dict(compute_dtype="float32"), dict(compute_dtype="float32", gpu_state="off"),
     dict(compute_dtype="bfloat16")],
    ids=["fp32", "host-adamw", "bf16"],
)  # fmt: skip
def test_on_cuda_the_overlapped_stale_rollout_equals_one_sampled_before_the_update(setup, monkeypatch, kw):
    """On the GPU the stale rollout samples from its snapshot while the streaming transport's
    worker runs the step before's host AdamW into the weights it was built from (all of them with
    gpu_state off): the same completions, losses and weights, bitwise, as a run that samples every
    snapshot at once, before the update."""
    from test_checkpoint import assert_bitwise

    from megatrain.models.config import ModelConfig
    from megatrain.planning.footprint import rollout_bytes
    from megatrain.rl.offpolicy import StaleSampler

    tmp_path, _ = setup
    kw = kw | dict(device="cuda", full_determinism=True, max_staleness=1, learning_rate=LR_STALE, max_steps=4)
    overlapped = run(tmp_path, "overlapped", **kw)
    ahead = StaleSampler.ahead

    def at_once(self, rollout, step):
        ahead(self, rollout, step)
        self.settle(rollout)

    monkeypatch.setattr(StaleSampler, "ahead", at_once)
    before = run(tmp_path, "before", **kw)
    assert [c["completion_ids"] for c in overlapped[1]] == [c["completion_ids"] for c in before[1]]
    assert [r.get("loss") for r in overlapped[0]] == [r.get("loss") for r in before[0]]
    assert_bitwise(before[2], overlapped[2])
    # The snapshot held through the update is the rollout's policy (its weights), which the
    # rollout's room counts.
    measured = json.loads((tmp_path / "overlapped" / "plan.json").read_text())["measured"]
    model_cfg = ModelConfig.from_json(tmp_path / "model")
    room = rollout_bytes(model_cfg, 1, 1, 1, 2 if kw["compute_dtype"] == "bfloat16" else 4)
    assert 0 < measured["rollout_snapshot"] <= 1.1 * room["policy weights"] + 2**20


@pytest.mark.slow
@pytest.mark.parametrize("every", [1, 2], ids=["metrics-in-the-loss", "metrics-when-sampled"])
def test_two_stale_processes_equal_one(setup, every):
    """max_staleness 1 with the step's prompts split over two gloo processes (each samples its half
    by the snapshot of the step before, advantages over both halves, reused for num_iterations
    steps, each process's metrics of the correction gathered as TRL gathers them): the same
    completions, losses, rewards, the correction's least and most ratio and log-prob difference,
    and weights as one process with the same global batch (grpo's loss: a mean over completions;
    truncated ratios: the processes' micro-batches hold other completions, so the policy's
    log-probs differ in their rounding, which could move a masked ratio across its bound)."""
    tmp_path, _ = setup
    kw = dict(max_staleness=1, learning_rate=LR_STALE, num_iterations=every, loss_type="grpo", max_steps=4,
              vllm_importance_sampling_mode="token_truncate", **TOKEN)  # fmt: skip
    names = ["loss", "grad_norm", "reward", "reward_std", SAMPLING[1], SAMPLING[2], SAMPLING[4]]
    # rel 1e-4: the ratios are exp of differences of log-probs, their rounding scaled up
    two_against_one(tmp_path, names, steps=4, rel=1e-4, atol=1e-6, same_keys=True, **kw)
