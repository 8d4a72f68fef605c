"""Preference stages trained end to end (`megatrain train` with stage dpo, orpo, simpo, kto)
against a plain PyTorch loop over the transformers model that implements TRL's formulas
(test_preference_losses.py's transcriptions): each micro-batch's loss is TRL's over its pairs
(chosen rows, then rejected rows, right-padded), the step's loss is their mean (TRL's gradient
accumulation), then clip_grad_norm_ and torch AdamW. Losses, TRL's metrics and the final weights
must agree in fp32, over three steps of two micro-batches with clipping active. The reference
log-probs come from a pass before the first step (stored in output_dir/reference/); a resume
reads them, and they equal the reference model's."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from helpers import assert_trained_alike, saved_parameters, tiny_hf_model
from safetensors.torch import load_file
from test_parity import _decay_groups
from test_preference_losses import DPO_CASES, TrlDpo, _padded, trl_kl, trl_kto, trl_orpo, trl_simpo

from megatrain.config import TrainConfig
from megatrain.errors import CheckpointError, ConfigError
from megatrain.trainer import train

V, B, GA, STEPS = 97, 2, 2, 3
LR, WD, MAX_NORM = 5e-3, 0.01, 0.05


def model(seed=0):
    # head_dim 16: the smallest FlexAttention (packed pairs on CUDA) takes
    return tiny_hf_model("llama", seed=seed, num_hidden_layers=2, hidden_size=64, intermediate_size=48)


def pairs(n=B * GA * STEPS, seed=0):
    """(prompt, chosen, rejected) token lists of varied lengths; ids from 1 (TRL's NLL ignores 0)."""
    rng = random.Random(seed)
    ids = lambda k: [rng.randrange(1, V) for _ in range(k)]  # noqa: E731
    return [(ids(rng.randrange(1, 6)), ids(rng.randrange(1, 6)), ids(rng.randrange(1, 6))) for _ in range(n)]


def write_pairs(path: Path, rows) -> str:
    with open(path, "w") as f:
        for p, c, r in rows:
            f.write(
                json.dumps({"prompt_input_ids": p, "chosen_input_ids": c, "rejected_input_ids": r}) + "\n"
            )
    return str(path)


def pair_tensors(rows):
    """TRL's concatenated batch: chosen rows then rejected rows, right-padded; completion masks."""
    seqs = [(torch.tensor(p), torch.tensor(c)) for p, c, _ in rows]
    seqs += [(torch.tensor(p), torch.tensor(r)) for p, _, r in rows]
    return _padded(seqs)


def run(tmp_path: Path, data: str, name="out", **kw) -> tuple[list[dict], dict[str, torch.Tensor], Path]:
    """megatrain with the test's schedule; its step records and final weights."""
    out = tmp_path / name
    args = dict(
        model_name_or_path=str(tmp_path / "model"),
        dataset=data,
        output_dir=str(out),
        per_device_train_batch_size=B,
        gradient_accumulation_steps=GA,
        max_steps=STEPS,
        learning_rate=LR,
        lr_scheduler_type="constant",
        weight_decay=WD,
        max_grad_norm=MAX_NORM,
        shuffle=False,
        save_strategy="no",
        save_dtype="float32",
        disable_tqdm=True,
        max_length=64,
    )
    train(TrainConfig(**(args | kw)))
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "loss" in r], load_file(out / "final" / "model.safetensors"), out


def plain_loop(hf, batch_loss, batches, per_step=GA):
    """TRL's step over the transformers model: the mean of the micro-batches' losses (`per_step`
    of them: every process's), clipped, torch AdamW (Hugging Face's decay groups). Per step: the
    loss, the micro-batches' metrics."""
    opt = torch.optim.AdamW(_decay_groups(hf, WD), lr=LR, betas=(0.9, 0.999), eps=1e-8)
    steps, norms = [], []
    for step in range(STEPS):
        loss, metrics = 0.0, []
        for m in range(per_step):
            mb_loss, mb_metrics = batch_loss(batches[step * per_step + m])
            (mb_loss / per_step).backward()
            loss += mb_loss.item() / per_step
            metrics.append({k: float(torch.as_tensor(v).detach()) for k, v in mb_metrics.items()})
        norms.append(torch.nn.utils.clip_grad_norm_(hf.parameters(), MAX_NORM).item())
        opt.step()
        opt.zero_grad()
        steps.append((loss, metrics))
    assert sum(n > MAX_NORM for n in norms) >= 2, "the test should exercise clipping"
    return steps


def compare(records, final, hf, steps, metric_names):
    assert len(records) == STEPS
    for rec, (loss, metrics) in zip(records, steps):
        # Step 1 from the same weights; later steps from weights as far apart as
        # assert_trained_alike allows (ipo's squared margins: 1.2e-5 relative at step 3 on AVX2).
        assert rec["loss"] == pytest.approx(loss, rel=1e-5 if rec["step"] == 1 else 1e-4, abs=1e-7)
        for k in metric_names:
            want = sum(m[k] for m in metrics) / len(metrics)
            assert rec[k] == pytest.approx(want, rel=1e-3, abs=2e-5), k
    assert_trained_alike(final, saved_parameters(hf), LR)
    start = saved_parameters(model())
    assert any(not torch.equal(final[k], start[k].detach()) for k in final)  # it trained


@pytest.fixture
def setup(tmp_path):
    model().save_pretrained(tmp_path / "model")
    rows = pairs()
    return tmp_path, rows, write_pairs(tmp_path / "pairs.jsonl", rows)


def micro_batches(rows):
    return [rows[i : i + B] for i in range(0, len(rows), B)]


PAIR_METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"]  # fmt: skip


@pytest.mark.parametrize("kw", DPO_CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_dpo_trains_as_trl(setup, kw):
    tmp_path, rows, data = setup
    records, final, out = run(tmp_path, data, stage="dpo", **kw)
    hf, ref = model(), model()
    trl = TrlDpo(**kw)
    steps = plain_loop(
        hf, lambda mb: trl.get_batch_loss_metrics(hf, ref, *pair_tensors(mb)), micro_batches(rows)
    )
    compare(records, final, hf, steps, PAIR_METRICS)
    assert (out / "reference" / "logps.safetensors").is_file()


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_trains_as_trl(setup, beta):
    tmp_path, rows, data = setup
    records, final, out = run(tmp_path, data, stage="orpo", beta=beta)
    hf = model()
    steps = plain_loop(hf, lambda mb: trl_orpo(hf, *pair_tensors(mb), beta), micro_batches(rows))
    compare(records, final, hf, steps, PAIR_METRICS[:6] + ["nll_loss", "log_odds_ratio", "log_odds_chosen"])
    assert not (out / "reference").exists()  # orpo takes no reference


@pytest.mark.parametrize("kw", [dict(), dict(cpo_alpha=0.0, simpo_gamma=1.0, label_smoothing=0.1)])
def test_simpo_trains_as_trl(setup, kw):
    tmp_path, rows, data = setup
    records, final, _ = run(tmp_path, data, stage="simpo", **kw)
    args = dict(beta=0.1, simpo_gamma=0.5, cpo_alpha=1.0, label_smoothing=0.0) | kw
    hf = model()
    steps = plain_loop(hf, lambda mb: trl_simpo(hf, *pair_tensors(mb), **args), micro_batches(rows))
    compare(records, final, hf, steps, PAIR_METRICS[:6])


def kto_rows(path: Path, n: int, seed: int) -> tuple[list, str]:
    """(prompt, completion, label) examples written as a KTO file; the rows and the file."""
    rng = random.Random(seed)
    rows = [(p, c, rng.random() < 0.5) for p, c, _ in pairs(n, seed=seed)]
    with open(path, "w") as f:
        for p, c, label in rows:
            f.write(json.dumps({"prompt_input_ids": p, "completion_input_ids": c, "label": label}) + "\n")
    return rows, str(path)


def kto_tensors(mb):
    """TRL's KTO batch: the examples and their KL pairs (each prompt with the previous example's
    completion, within the batch), right-padded; the labels."""
    seqs = [(torch.tensor(p), torch.tensor(c)) for p, c, _ in mb]
    kl = [(torch.tensor(p), torch.tensor(mb[i - 1][1])) for i, (p, _, _) in enumerate(mb)]
    return _padded(seqs), _padded(kl), [label for _, _, label in mb]


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_trains_as_trl(tmp_path, loss_type):
    model().save_pretrained(tmp_path / "model")
    rows, data = kto_rows(tmp_path / "kto.jsonl", B * GA * STEPS, seed=3)
    records, final, _ = run(tmp_path, data, stage="kto", loss_type=loss_type)
    hf, ref = model(), model()

    def batch_loss(mb):
        seqs, kl, labels = kto_tensors(mb)
        return trl_kto(hf, ref, seqs, kl, 0.1, loss_type, 1.0, 1.0, labels=labels)

    compare(records, final, hf, plain_loop(hf, batch_loss, micro_batches(rows)), [])


def test_reference_model_is_another_model_and_is_read_back(setup):
    """ref_model_name_or_path: the stored log-probs are that model's, the training equals TRL's with
    it as the reference; a second run into the same output_dir reads them instead of sweeping."""
    tmp_path, rows, data = setup
    model(seed=7).save_pretrained(tmp_path / "ref")
    records, final, out = run(tmp_path, data, stage="dpo", ref_model_name_or_path=str(tmp_path / "ref"))
    stored = load_file(out / "reference" / "logps.safetensors")["train"]
    ref = model(seed=7)
    with torch.no_grad():
        for i, mb in enumerate(micro_batches(rows)):
            ids, attn, mask = pair_tensors(mb)
            logits = ref(ids, attention_mask=attn).logits.log_softmax(-1)
            tok = logits[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1) * mask[:, 1:]
            sums = tok.sum(-1)
            torch.testing.assert_close(
                stored[i * B : (i + 1) * B].float(), torch.stack((sums[:B], sums[B:]), 1)
            )
    hf = model()
    trl = TrlDpo()
    steps = plain_loop(
        hf, lambda mb: trl.get_batch_loss_metrics(hf, ref, *pair_tensors(mb)), micro_batches(rows)
    )
    compare(records, final, hf, steps, PAIR_METRICS)


def test_resume_reads_the_stored_reference_and_is_exact(setup):
    """A run saved after step 2 and resumed equals the uninterrupted run; the resume takes the
    reference from output_dir/reference/ (the policy's weights are no longer the initial ones)."""
    tmp_path, _, data = setup
    whole, final, _ = run(
        tmp_path, data, "whole", stage="dpo", loss_type="bco_pair", save_strategy="steps", save_steps=1
    )
    _, _, out = run(
        tmp_path,
        data,
        "cut",
        stage="dpo",
        loss_type="bco_pair",
        save_strategy="steps",
        save_steps=1,
        max_steps=2,
    )
    before = (out / "reference" / "logps.safetensors").stat().st_mtime_ns
    resumed, final2, _ = run(
        tmp_path, data, "cut", stage="dpo", loss_type="bco_pair", save_strategy="steps", save_steps=1,
        resume_from_checkpoint=True,
    )  # fmt: skip
    assert (out / "reference" / "logps.safetensors").stat().st_mtime_ns == before  # read, not rewritten
    for key in ("loss", "num_tokens"):  # TRL's running token count carries on from the checkpoint
        assert [r[key] for r in resumed if r["step"] == 3] == [r[key] for r in whole if r["step"] == 3]
    for k in final:
        assert torch.equal(final[k], final2[k]), k


def test_corrupt_reference_is_one_line_naming_the_file(setup):
    tmp_path, _, data = setup
    _, _, out = run(tmp_path, data, stage="dpo", max_steps=1)
    path = out / "reference" / "logps.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError, match="logps.safetensors: checksum mismatch"):
        run(tmp_path, data, stage="dpo", max_steps=2, resume_from_checkpoint=False, overwrite_output_dir=True)


def test_reference_model_of_another_shape_is_refused(setup):
    tmp_path, _, data = setup
    tiny_hf_model("llama", num_hidden_layers=1, hidden_size=64, intermediate_size=48).save_pretrained(
        tmp_path / "ref"
    )
    with pytest.raises(ConfigError, match="ref_model_name_or_path: .* num_hidden_layers 1, the policy 2"):
        run(tmp_path, data, stage="dpo", ref_model_name_or_path=str(tmp_path / "ref"))
    assert not (tmp_path / "out").exists()  # refused before anything was written


@pytest.mark.slow
def test_two_processes_equal_one(setup):
    """bco_pair (whose running mean takes every micro-batch of the step in order) and the
    reference pass split over two gloo processes: the same losses, metrics and weights as one
    process with the same global batch."""
    from test_checkpoint import write_yaml
    from test_distributed import assert_close_weights, launch

    tmp_path, _, data = setup
    kw = dict(stage="dpo", loss_type=["sigmoid", "bco_pair"], eval_dataset=data, eval_steps=STEPS)
    one, final_one, _ = run(tmp_path, data, "one", **kw)
    base = dict(
        model_name_or_path=str(tmp_path / "model"), dataset=data, per_device_train_batch_size=B,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", weight_decay=WD,
        max_grad_norm=MAX_NORM, shuffle=False, save_strategy="no", save_dtype="float32",
        disable_tqdm=True, max_length=64, **kw,
    )  # fmt: skip
    proc = launch(
        write_yaml(tmp_path / "run.yaml", base),
        "gradient_accumulation_steps=1",
        f"output_dir={tmp_path / 'two'}",
    )
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    for got, want in zip([r for r in records if "loss" in r], one):
        for k in ["loss", "grad_norm", "label_tokens", *PAIR_METRICS]:
            assert got[k] == pytest.approx(want[k], rel=1e-5, abs=1e-7), k
    (got,) = [r for r in records if "eval_loss" in r]
    assert got["eval_rewards/accuracies"] is not None
    assert_close_weights(load_file(tmp_path / "two" / "final" / "model.safetensors"), final_one)
    two_ref = load_file(tmp_path / "two" / "reference" / "logps.safetensors")
    one_ref = load_file(tmp_path / "one" / "reference" / "logps.safetensors")
    for k in one_ref:
        torch.testing.assert_close(two_ref[k], one_ref[k], rtol=1e-6, atol=1e-6)


@pytest.mark.slow
def test_two_kto_processes_gather_the_kl_term_as_trl(tmp_path):
    """loss_type kto over two gloo processes of two micro-batches each: each micro-batch's KL is
    the mean of its own estimate and that of the other process's micro-batch of the same place in
    the step, clamped at 0 (KTOTrainer's accelerator.gather(kl).mean().clamp(min=0) at each
    forward). The reference is another model, so the micro-batches' estimates differ and the
    gathered KL is none of them: the losses, the KL metric and the weights must be TRL's."""
    from test_checkpoint import write_yaml
    from test_distributed import launch

    ranks = 2
    per_step = ranks * GA  # micro-batches of a step, both processes'
    model().save_pretrained(tmp_path / "model")
    model(seed=7).save_pretrained(tmp_path / "ref")
    rows, data = kto_rows(tmp_path / "kto.jsonl", B * per_step * STEPS, seed=5)
    cfg = dict(
        model_name_or_path=str(tmp_path / "model"), dataset=data, per_device_train_batch_size=B,
        gradient_accumulation_steps=GA, max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
        weight_decay=WD, max_grad_norm=MAX_NORM, shuffle=False, save_strategy="no", save_dtype="float32",
        disable_tqdm=True, max_length=64, stage="kto", ref_model_name_or_path=str(tmp_path / "ref"),
    )  # fmt: skip
    proc = launch(write_yaml(tmp_path / "run.yaml", cfg), f"output_dir={tmp_path / 'two'}")
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(line) for line in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines()]
    final = load_file(tmp_path / "two" / "final" / "model.safetensors")

    hf, ref = model(), model(seed=7)
    mbs = micro_batches(rows)
    apart = []  # |gathered KL - the micro-batch's own| after the clamp

    def batch_loss(i):
        # rank r's m-th micro-batch of a step is the step's (r * GA + m)-th; it meets every rank's m-th
        first, m = i - i % per_step, i % GA
        seqs, kl, labels = kto_tensors(mbs[i])
        gathered = torch.stack(
            [trl_kl(hf, ref, kto_tensors(mbs[first + r * GA + m])[1]) for r in range(ranks)]
        )
        apart.append(abs(gathered.mean().clamp(min=0) - trl_kl(hf, ref, kl).clamp(min=0)).item())
        return trl_kto(hf, ref, seqs, kl, 0.1, "kto", 1.0, 1.0, labels=labels, gathered=gathered)

    steps = plain_loop(hf, batch_loss, list(range(len(mbs))), per_step=per_step)
    assert max(apart) > 0.1, "the micro-batches' own KL estimates should differ from the gathered ones"
    compare([r for r in records if "loss" in r], final, hf, steps, ["kl"])


def test_packed_pairs_train_as_trl(setup):
    """packing: whole pairs laid into rows of 2 x max_length tokens, each sequence a document of
    its own (no attention across them): the same as TRL over the pairs each micro-batch holds."""
    from megatrain.data import Batcher
    from megatrain.stages import build_stage_samples

    tmp_path, rows, data = setup
    kw = dict(stage="dpo", packing=True, max_length=12, per_device_train_batch_size=1)
    records, final, _ = run(tmp_path, data, **kw)
    cfg = TrainConfig(model_name_or_path=str(tmp_path / "model"), dataset=data, shuffle=False, **kw)
    batcher = Batcher(build_stage_samples(cfg, None, V, "dataset", 1), 1, GA, 12, packing=True, shuffle=False)
    held = [[rows[i] for i in mb.units] for _ in range(STEPS) for mb in batcher.next_step()]
    assert max(len(mb) for mb in held) > 1  # some row holds several pairs
    hf, ref = model(), model()
    trl = TrlDpo()
    steps = plain_loop(hf, lambda mb: trl.get_batch_loss_metrics(hf, ref, *pair_tensors(mb)), held)
    compare(records, final, hf, steps, PAIR_METRICS)


@pytest.mark.parametrize(
    "row,match",
    [
        (
            {"prompt_input_ids": [1], "chosen_input_ids": [2]},
            r"bad\.jsonl:2: missing field 'rejected_input_ids'",
        ),
        (
            {"prompt_input_ids": [1], "chosen_input_ids": [2], "rejected_input_ids": [500]},
            r"bad\.jsonl:2: token id 500",
        ),
        ({"text": "plain text"}, r"bad\.jsonl:1: cannot detect the preference format"),
    ],
)
def test_a_bad_row_is_one_line_and_nothing_is_written(tmp_path, row, match):
    from megatrain.errors import DataError

    model().save_pretrained(tmp_path / "model")
    good = {"prompt_input_ids": [1, 2], "chosen_input_ids": [3], "rejected_input_ids": [4]}
    lines = [row] if "text" in row else [good, row]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    with pytest.raises(DataError, match=match):
        run(tmp_path, str(tmp_path / "bad.jsonl"), stage="dpo")
    assert not (tmp_path / "out").exists()


@pytest.mark.gpu
def test_dpo_on_cuda_repeats_bit_for_bit(setup):
    """Two DPO runs on the GPU in its default mode (bf16; rows of one key block, so the attention's
    backward adds no dQ atomically) are bitwise equal: each sequence's log-prob sums its tokens in
    index order (`determinism.sorted_sums`), not by atomic adds in the order threads arrive."""
    from test_checkpoint import assert_bitwise

    tmp_path, _, data = setup
    (ra, fa, oa), (rb, fb, ob) = (run(tmp_path, data, name, device="cuda", stage="dpo") for name in "ab")
    assert [r["loss"] for r in ra] == [r["loss"] for r in rb]
    assert_bitwise(fb, fa)
    assert_bitwise(*(load_file(o / "reference" / "logps.safetensors") for o in (ob, oa)))


@pytest.mark.gpu
@pytest.mark.parametrize("packing", [False, True])
def test_dpo_on_cuda_in_fp32_equals_the_cpu(setup, packing):
    """The GPU's schedule (streamed weights, the CPU AdamW overlapping; FlexAttention's block
    masks for packed pairs) trains DPO as the CPU's serial path does, and its reference pass
    stores the same log-probs."""
    tmp_path, _, data = setup
    kw = dict(stage="dpo", loss_type=["sigmoid", "bco_pair"], compute_dtype="float32", packing=packing,
              max_length=12 if packing else 64, per_device_train_batch_size=1 if packing else B)  # fmt: skip
    cpu, final_cpu, out_cpu = run(tmp_path, data, "cpu", device="cpu", **kw)
    gpu, final_gpu, out_gpu = run(tmp_path, data, "gpu", device="cuda", **kw)
    for a, b in zip(gpu, cpu):
        # not rewards/accuracies: at the first step every reward is 0 up to rounding
        for k in ["loss", "grad_norm", *(m for m in PAIR_METRICS if m != "rewards/accuracies")]:
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-5), k
    for k in final_cpu:
        torch.testing.assert_close(final_gpu[k], final_cpu[k], rtol=1e-4, atol=1e-4, msg=k)
    ref = [load_file(o / "reference" / "logps.safetensors")["train"] for o in (out_gpu, out_cpu)]
    torch.testing.assert_close(ref[0], ref[1], rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("packing,rows,seq", [(False, 8, 100), (True, 4, 200)])
def test_the_plan_counts_both_sequences_of_a_pair(tmp_path, packing, rows, seq):
    """A pair is two sequences: two rows of max_length, or one packed row of 2 x max_length."""
    from megatrain.models.config import ModelConfig
    from megatrain.plan import batch_of

    model().save_pretrained(tmp_path / "model")
    model_cfg = ModelConfig.from_json(tmp_path / "model")

    def batch(stage):
        cfg = TrainConfig(model_name_or_path=str(tmp_path / "model"), stage=stage, max_length=100,
                          per_device_train_batch_size=4, packing=packing)  # fmt: skip
        return batch_of(cfg, model_cfg, 4)

    b = batch("dpo")
    assert (b.rows, b.seq_len, b.micro_batch_tokens) == (rows, seq, 800)
    assert batch("sft").micro_batch_tokens == 400


@pytest.mark.parametrize("stage", ["dpo", "kto", "orpo", "simpo", "grpo"])
def test_the_config_leaves_each_stage_its_own_defaults(stage):
    """TrainConfig's keys and a stage's settings dataclass both state the defaults: unset keys
    give exactly the stage's (TRL's), so the two cannot drift apart."""
    from dataclasses import asdict

    from megatrain.objectives.grpo import GRPOConfig
    from megatrain.objectives.preference import PreferenceConfig

    # grpo: TRL's per_device_train_batch_size, whose generation batch holds num_generations' 8.
    extra = {"reward_funcs": ["length"], "per_device_train_batch_size": 8} if stage == "grpo" else {}
    cfg = TrainConfig(model_config="unused", stage=stage, **extra)
    got = cfg.grpo() if stage == "grpo" else cfg.preference()
    want = GRPOConfig() if stage == "grpo" else PreferenceConfig(stage=stage)
    assert asdict(got) == asdict(want)
