"""megatrain beside TRL's own trainers (the release pyproject.toml's `trl` extra pins), on a tiny
random model in fp32 on the CPU, the same tokens in the same order: three optimizer steps of two
micro-batches with clipping active, then the per-step loss, the gradient norm, TRL's metrics and the
final weights must agree. A TRL release that changes a formula fails here.

TRL tokenises text itself; the data here is megatrain's pre-tokenised form, handed to TRL's
trainer as the token ids its own preprocessing would produce (`_prepare_dataset` left out; ORPO's
and CPO's `tokenize_row` given the ids), so the two sides see the same ids whatever either's
tokenisation; that each trainer's own text preprocessing gives megatrain's ids is tested apart,
on text and conversational records (the `*_records_are_tokenised_as_trls` tests). Stages: SFT (SFTTrainer), DPO (every loss type), KTO, ORPO and SimPO (trl.experimental's
ORPOTrainer and CPOTrainer), and GRPO: GRPOTrainer on the completions megatrain sampled (its
`rollout_func`), scored by the same reward functions."""

from __future__ import annotations

import copy
import dataclasses
import json
from unittest import mock

import pytest
import torch
import transformers
import trl
from datasets import Dataset
from helpers import assert_trained_alike, saved_parameters, tiny_tokenizer
from safetensors.torch import load_file
from test_grpo import EPS
from test_grpo import model as grpo_model
from test_preference_training import GA, MAX_NORM, STEPS, WD, B, kto_rows, model, pairs, run, write_pairs
from torch.utils.data import SequentialSampler
from trl.experimental.cpo import CPOConfig, CPOTrainer
from trl.experimental.orpo import ORPOConfig, ORPOTrainer
from trl.trainer.utils import shuffle_sequence_dict as trl_shuffle

from megatrain.config import TrainConfig
from megatrain.data.preference import build_preference_pairs, build_reward_pairs, build_unpaired_examples
from megatrain.data.samples import build_samples
from megatrain.objectives.preference import DPO_LOSS_TYPES
from megatrain.rl.rewards import exact_match, length
from megatrain.rl.rollout import generation_order

TRL_VERSION = "1.16.0"
# A step moves a weight by up to the learning rate (AdamW), so the weights' tolerance of 1e-5 is
# 1% of one step's move: an entry whose gradient is near 0 moves by lr x its rounding's sign.
LR = 1e-3
PAIR_METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"]  # fmt: skip
TOKEN_METRICS = ["entropy", "mean_token_accuracy", "num_tokens"]  # TRL 1.x's, from its fused LM head


def test_the_trl_followed_is_installed():
    assert trl.__version__ == TRL_VERSION


def trl_args(tmp_path, config_class, **kw):
    """TRL's config with the schedule megatrain runs: sequential batches, constant learning rate,
    fp32 on the CPU, a log every step, no truncation."""
    untruncated = (
        {"max_length": None} if "max_length" in {f.name for f in dataclasses.fields(config_class)} else {}
    )
    return config_class(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=B, gradient_accumulation_steps=GA,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", weight_decay=WD,
        max_grad_norm=MAX_NORM, use_cpu=True, bf16=False, gradient_checkpointing=False, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
        train_sampling_strategy="sequential", **(untruncated | kw),
    )  # fmt: skip


class Tokenised:
    """A trainer fed token ids: its text preprocessing skipped, its batches in file order."""

    def _prepare_dataset(self, dataset, *args, **kwargs):
        return dataset

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset or self.train_dataset)


class DPOTrainer(Tokenised, trl.DPOTrainer):
    pass


class SFTTrainer(Tokenised, trl.SFTTrainer):
    pass


class KTOTrainer(Tokenised, trl.KTOTrainer):
    pass


class PairRows:
    """ORPO and CPO (TRL's pre-1.0 trainers) tokenise in their constructor, row by row: here each row
    is the pair's ids as `tokenize_row` lays them out (prompt + answer, labels -100 on the prompt)."""

    def tokenize_row(self, feature, model=None):
        p = feature["prompt_ids"]
        row = {"prompt_input_ids": p, "prompt_attention_mask": [1] * len(p)}
        for side in ("chosen", "rejected"):
            a = feature[f"{side}_ids"]
            row |= {
                f"{side}_input_ids": p + a,
                f"{side}_attention_mask": [1] * (len(p) + len(a)),
                f"{side}_labels": [-100] * len(p) + a,
            }
        return row

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset or self.train_dataset)


class ORPOTrainer(PairRows, ORPOTrainer):
    pass


class CPOTrainer(PairRows, CPOTrainer):
    pass


def trl_steps(trainer) -> tuple[list[dict], dict[str, torch.Tensor]]:
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]
    assert len(logs) == STEPS
    return logs, {k: p.detach() for k, p in saved_parameters(trainer.model).items()}


def compare(records, logs, final, trained, metrics, weight_tol=1e-5):
    for rec, log in zip(records, logs, strict=True):
        step = rec["step"]
        assert rec["loss"] == pytest.approx(log["loss"], rel=1e-5, abs=1e-7), step
        assert rec["grad_norm"] == pytest.approx(log["grad_norm"], rel=1e-4), step
        for k in metrics:  # rewards: beta x a difference of two sums of ~20 fp32 log-probs
            assert rec[k] == pytest.approx(log[k], rel=1e-4, abs=1e-5), (step, k)
    assert sum(log["grad_norm"] > MAX_NORM for log in logs) >= 2, "the test should exercise clipping"
    assert final.keys() == trained.keys()
    for k, p in trained.items():
        torch.testing.assert_close(final[k], p, rtol=1e-5, atol=weight_tol, msg=lambda m, k=k: f"{k}: {m}")


@pytest.fixture(scope="module")
def pair_data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("dpo")
    model().save_pretrained(tmp / "model")
    rows = pairs()
    data = write_pairs(tmp / "pairs.jsonl", rows)
    dataset = Dataset.from_list([{"prompt_ids": p, "chosen_ids": c, "rejected_ids": r} for p, c, r in rows])
    return tmp, data, dataset


# Every DPO loss type both have, with the options that change a formula; MPO and RPO's mixtures.
DPO_CASES = [dict(loss_type=t) for t in DPO_LOSS_TYPES if t not in ("robust", "exo_pair")] + [
    dict(loss_type="robust", label_smoothing=0.1),
    dict(loss_type="exo_pair", label_smoothing=1e-3),
    dict(loss_type="aot", label_smoothing=0.1),
    dict(loss_type="hinge", beta=2.0),
    dict(loss_type=["sigmoid", "bco_pair", "sft"], loss_weights=[0.8, 0.2, 1.0]),
    dict(loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5]),
]


@pytest.mark.parametrize("kw", DPO_CASES, ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()))
def test_dpo_trains_as_trls_dpo_trainer(pair_data, tmp_path, kw):
    tmp, data, dataset = pair_data
    records, final, _ = run(
        tmp_path, data, stage="dpo", model_name_or_path=str(tmp / "model"), learning_rate=LR, **kw
    )
    loss_type = kw["loss_type"] if isinstance(kw["loss_type"], list) else [kw["loss_type"]]
    hf = model()
    trainer = DPOTrainer(
        model=hf,
        ref_model=copy.deepcopy(hf),
        args=trl_args(tmp_path, trl.DPOConfig, **(kw | {"loss_type": loss_type})),
        train_dataset=dataset,
        processing_class=tiny_tokenizer(),
    )
    logs, trained = trl_steps(trainer)
    compare(records, logs, final, trained, PAIR_METRICS + TOKEN_METRICS)


# ORPO's and CPO's `logits/*` are the mean over every position of the padded batch (prompt and
# padding included), megatrain's over the completions' tokens (docs/preference.md): not compared.
ORPO_METRICS = PAIR_METRICS[:6] + ["nll_loss", "log_odds_ratio", "log_odds_chosen"]


@pytest.mark.parametrize("beta", [0.1, 0.5])
def test_orpo_trains_as_trls_orpo_trainer(pair_data, tmp_path, beta):
    tmp, data, dataset = pair_data
    records, final, _ = run(
        tmp_path, data, stage="orpo", model_name_or_path=str(tmp / "model"), learning_rate=LR, beta=beta
    )
    args = trl_args(tmp_path, ORPOConfig, beta=beta, remove_unused_columns=False)
    trainer = ORPOTrainer(model=model(), args=args, train_dataset=dataset, processing_class=tiny_tokenizer())
    logs, trained = trl_steps(trainer)
    # beta 0.5: one gate_proj entry of 3,072 is 1.6e-5 apart, fp32 rounding of a gradient near 0
    # that AdamW turns into lr x its sign: against TRL's trainer in fp64, megatrain's is 2.1e-5 off
    # there and TRL's fp32 run 3.7e-5.
    compare(records, logs, final, trained, ORPO_METRICS, weight_tol=2e-5 if beta == 0.5 else 1e-5)


@pytest.mark.parametrize("kw", [dict(), dict(cpo_alpha=0.0, simpo_gamma=1.0, label_smoothing=0.1)])
def test_simpo_trains_as_trls_cpo_trainer(pair_data, tmp_path, kw):
    tmp, data, dataset = pair_data
    records, final, _ = run(
        tmp_path, data, stage="simpo", model_name_or_path=str(tmp / "model"), learning_rate=LR, **kw
    )
    args = trl_args(tmp_path, CPOConfig, **(dict(loss_type="simpo", cpo_alpha=1.0, simpo_gamma=0.5) | kw))
    trainer = CPOTrainer(model=model(), args=args, train_dataset=dataset, processing_class=tiny_tokenizer())
    logs, trained = trl_steps(trainer)
    # TRL logs nll_loss 0 where cpo_alpha is 0, megatrain the NLL it leaves out (docs/preference.md)
    compare(records, logs, final, trained, ORPO_METRICS[: 7 if kw.get("cpo_alpha", 1.0) else 6])


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_trains_as_trls_kto_trainer(pair_data, tmp_path, loss_type):
    tmp = pair_data[0]
    rows, data = kto_rows(tmp_path / "kto.jsonl", B * GA * STEPS, seed=3)
    records, final, _ = run(
        tmp_path,
        data,
        stage="kto",
        model_name_or_path=str(tmp / "model"),
        learning_rate=LR,
        loss_type=loss_type,
    )
    dataset = Dataset.from_list([{"prompt_ids": p, "completion_ids": c, "label": y} for p, c, y in rows])
    if loss_type == "kto":  # KTOTrainer's KL pairs: the completions rotated by one within each batch
        dataset = dataset.map(
            lambda b: {"KL_completion_ids": b["completion_ids"][-1:] + b["completion_ids"][:-1]},
            batched=True, batch_size=B,
        )  # fmt: skip
    hf = model()
    trainer = KTOTrainer(
        model=hf, ref_model=copy.deepcopy(hf), args=trl_args(tmp_path, trl.KTOConfig, loss_type=loss_type),
        train_dataset=dataset, processing_class=tiny_tokenizer(),
    )  # fmt: skip
    logs, trained = trl_steps(trainer)
    metrics = ["kl", "rewards/chosen", "rewards/rejected", "logps/chosen", "logps/rejected", "logits/chosen",
               "logits/rejected", "entropy", "num_tokens"]  # fmt: skip
    compare(records, logs, final, trained, metrics)


def sft_rows(n=B * GA * STEPS, seed=0):
    """Pre-tokenised SFT records: a prompt left out of the loss (-100), then its completion."""
    return [{"input_ids": p + c, "labels": [-100] * len(p) + c} for p, c, _ in pairs(n, seed)]


def test_sft_trains_as_trls_sft_trainer(pair_data, tmp_path):
    tmp = pair_data[0]
    rows = sft_rows()
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    records, final, _ = run(
        tmp_path, str(data), stage="sft", model_name_or_path=str(tmp / "model"), learning_rate=LR
    )
    trainer = SFTTrainer(
        model=model(), args=trl_args(tmp_path, trl.SFTConfig),
        train_dataset=Dataset.from_list(rows), processing_class=tiny_tokenizer(),
    )  # fmt: skip
    logs, trained = trl_steps(trainer)
    compare(records, logs, final, trained, TOKEN_METRICS)


# ------------------------------------------------------------------------ GRPO
G, MAX_NEW = 4, 10
GRPO_METRICS = ["reward", "reward_std", "frac_reward_zero_std", "rewards/length/mean", "rewards/length/std",
                "rewards/exact_match/mean", "completions/mean_length", "completions/clipped_ratio", "entropy",
                "clip_ratio/region_mean", "num_tokens"]  # fmt: skip


class GRPOTrainer(trl.GRPOTrainer):
    """TRL's GRPOTrainer trained on megatrain's completions: its `rollout_func` hands it, for each
    generation batch's prompts, the completions megatrain sampled for them (completions.jsonl, in
    order); its generation batch is shuffled by megatrain's permutation (`generation_order`) in
    place of its own random one. Everything after (rewards, advantages, loss, step) is TRL's."""

    def __init__(self, *args, sampled: list[dict], seed: int, **kw):
        self.sampled, self.seed, self.generation = iter(sampled), seed, 0
        super().__init__(*args, rollout_func=self.replay, **kw)

    def replay(self, prompts, trainer):
        records = [next(self.sampled) for _ in prompts]
        assert [r["prompt"] for r in records] == prompts
        return {
            "prompt_ids": [self.processing_class(p)["input_ids"] for p in prompts],
            "completion_ids": [r["completion_ids"] for r in records],
            "logprobs": None,
        }

    def _prepare_inputs(self, generation_batch):
        def shuffle(batch):
            n = len(next(v for v in batch.values() if v is not None))
            perm = generation_order(self.seed, self.generation, n)
            self.generation += 1
            with mock.patch("torch.randperm", lambda *a, **k: perm):
                return trl_shuffle(batch)

        with mock.patch("trl.trainer.grpo_trainer.shuffle_sequence_dict", shuffle):
            return super()._prepare_inputs(generation_batch)


@pytest.fixture(scope="module")
def grpo_data(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("grpo")
    tok = tiny_tokenizer()
    tok.save_pretrained(tmp / "model")
    grpo_model(len(tok)).save_pretrained(tmp / "model")
    prompts = [{"prompt": f"Say {i} once:", "answer": f"{i}"} for i in range(B * GA * STEPS // G)]
    (tmp / "prompts.jsonl").write_text("".join(json.dumps(p) + "\n" for p in prompts))
    return tmp, tok, Dataset.from_list(prompts)


@pytest.mark.parametrize("kw", [dict(), dict(loss_type="grpo", beta=0.04), dict(loss_type="dr_grpo", scale_rewards="batch")],
                         ids=lambda kw: "-".join(f"{k}={v}" for k, v in kw.items()) or "dapo")  # fmt: skip
def test_grpo_trains_as_trls_grpo_trainer(grpo_data, tmp_path, kw):
    tmp, tok, dataset = grpo_data
    # AdamW's epsilon test_grpo.py's: above the rounding of the smallest gradients, which Adam amplifies
    grpo = dict(
        num_generations=G, max_completion_length=MAX_NEW, reward_weights=[-0.05, 1.0], adam_epsilon=EPS
    )
    grpo |= kw
    out = tmp_path / "out"
    records, final, _ = run(
        tmp_path,
        str(tmp / "prompts.jsonl"),
        stage="grpo",
        model_name_or_path=str(tmp / "model"),
        learning_rate=LR,
        reward_funcs=["length", "exact_match"],
        logging_steps=1,
        **grpo,
    )  # fmt: skip  (logging_steps 1: every step's completions in completions.jsonl)
    sampled = [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]
    # from its directory: with beta > 0 TRL loads the reference by the policy's name
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp / "model", dtype=torch.float32)
    trainer = GRPOTrainer(
        model=hf, reward_funcs=[length, exact_match], train_dataset=dataset, processing_class=tok,
        args=trl_args(tmp_path, trl.GRPOConfig, shuffle_dataset=False, **grpo) ,
        sampled=sampled, seed=TrainConfig.seed,
    )  # fmt: skip
    logs, trained = trl_steps(trainer)
    compare(records, logs, final, trained, GRPO_METRICS + (["kl"] if "beta" in kw else []))


PC_RECORDS = {
    "text": [{"prompt": "Where is the hou", "completion": "se?"}, {"prompt": "Say it.", "completion": " It.</s>"}],
    "conversational": [
        {"prompt": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
                    {"role": "user", "content": "The name?"}],
         "completion": [{"role": "assistant", "content": "None."}]},
    ],
}  # fmt: skip


@pytest.mark.parametrize("form", list(PC_RECORDS))
def test_sft_prompt_completion_records_are_tokenised_as_trls(tmp_path, form):
    """SFTTrainer's own preprocessing of prompt-completion records (text: plain text + EOS;
    conversations: the chat template) gives megatrain's ids and labels (the first token of a
    sequence is never a target)."""
    records = PC_RECORDS[form]
    tok = tiny_tokenizer()
    data = tmp_path / "pc.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    samples = build_samples(TrainConfig(model_config="unused", dataset=str(data)), tok)
    trainer = trl.SFTTrainer(
        model=model(), args=trl_args(tmp_path, trl.SFTConfig), train_dataset=Dataset.from_list(records),
        processing_class=tok,
    )  # fmt: skip
    theirs = list(trainer.train_dataset)
    assert any(-100 in r["labels"] for r in theirs)
    assert [s.input_ids for s in samples] == [r["input_ids"] for r in theirs]
    for s, r in zip(samples, theirs):
        assert s.labels[1:] == r["labels"][1:]


USER = {"role": "user", "content": "Where does Pip live?"}
# Text and conversational preference records: a token merged across the prompt/completion
# boundary ("hou" + "se"), a completion that ends with the EOS already; with max_length 28,
# completions cut, and in each form one prompt that fills it (dropped, or cut by keep_end).
PREF_RECORDS = {
    "text": [
        {"prompt": "Where is the hou", "chosen": "se?", "rejected": "se! No."},
        {"prompt": "Say it.", "chosen": " It.</s>", "rejected": " Not it."},
        {"prompt": "Pip the rabbit ran to the old house by the river", "chosen": " and slept.",
         "rejected": " then he ate carrots all day long."},
        {"prompt": "Pip the rabbit ran to the old house by the river at night, far from the wood.",
         "chosen": " Home.", "rejected": " Away."},
    ],
    "conversational": [
        {"prompt": [USER], "chosen": [{"role": "assistant", "content": "In a burrow."}],
         "rejected": [{"role": "assistant", "content": "On the moon, with the stars."}]},
        {"prompt": [USER, {"role": "assistant", "content": "By the river."}, {"role": "user", "content": "Why?"}],
         "chosen": [{"role": "assistant", "content": "The water."}],
         "rejected": [{"role": "assistant", "content": "No idea."}]},
    ],
}  # fmt: skip
TRUNCATIONS = [dict(max_length=None), dict(max_length=28), dict(max_length=28, truncation_mode="keep_end")]


def trl_sequences(trainer, keys=("",)) -> list[list[tuple[list[int], list[int]]]]:
    """Each example of a TRL trainer's prepared dataset through its own collator (which truncates):
    per sequence (input_ids, completion_mask) without the padding; `keys`: the collator's prefixes
    of the sequences (KTO's KL_), each a row of the output."""
    out = []
    for example in trainer.train_dataset:
        batch = trainer.data_collator([example])
        rows = [(r, k) for k in keys for r in range(len(batch[f"{k}input_ids"]))]
        out.append([
            (batch[f"{k}input_ids"][r][batch[f"{k}attention_mask"][r].bool()].tolist(),
             batch[f"{k}completion_mask"][r][batch[f"{k}attention_mask"][r].bool()].tolist())
            for r, k in rows
        ])  # fmt: skip
    return out


def ours(seq) -> tuple[list[int], list[int]]:
    return seq.input_ids, [int(m) for m in seq.completion_mask]


@pytest.mark.parametrize("limits", TRUNCATIONS, ids=lambda kw: "-".join(map(str, kw.values())))
@pytest.mark.parametrize("form", list(PREF_RECORDS))
def test_dpo_records_are_tokenised_as_trls(tmp_path, form, limits):
    """DPOTrainer's own preprocessing and collator (prompt + completion tokenised together, the
    completion where the joint tokenisation leaves the prompt; cut to max_length as
    truncation_mode says, keep_start dropping a pair whose prompt fills it) give megatrain's
    chosen and rejected ids and completion masks."""
    records, tok = PREF_RECORDS[form], tiny_tokenizer()
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    mode = {k: v for k, v in limits.items() if k != "max_length"}
    cfg = TrainConfig(model_config="unused", dataset=str(data), stage="dpo", **mode)
    pairs_ = build_preference_pairs([data], tok, cfg.preference().limits(limits["max_length"]))
    trainer = trl.DPOTrainer(
        model=model(), ref_model=model(), args=trl_args(tmp_path, trl.DPOConfig, **limits),
        train_dataset=Dataset.from_list(records),
        processing_class=tok,
    )  # fmt: skip
    theirs = trl_sequences(trainer)
    if form == "text":  # the merged token: TRL's completion starts with "house"'s token, so does ours
        assert len(trainer.train_dataset[0]["prompt_ids"]) < len(tok(records[0]["prompt"])["input_ids"])
    assert len(theirs) == len(records) - (limits == dict(max_length=28))
    assert [[ours(p.chosen), ours(p.rejected)] for p in pairs_] == theirs


@pytest.mark.parametrize("max_length", [None, 28])
@pytest.mark.parametrize("form", list(PREF_RECORDS))
def test_kto_records_are_tokenised_as_trls(tmp_path, form, max_length):
    """KTOTrainer's own preprocessing and collator (paired records unpaired, prompt + completion
    tokenised together, cut from the right, an example whose prompt fills max_length dropped, KL
    pairs rotated within each batch) give megatrain's sequences and KL sequences."""
    records, tok = PREF_RECORDS[form], tiny_tokenizer()
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    limits = (
        TrainConfig(model_config="unused", dataset=str(data), stage="kto").preference().limits(max_length)
    )
    examples = build_unpaired_examples([data], tok, limits, kl_batch_size=B)
    trainer = trl.KTOTrainer(
        model=model(), ref_model=model(), train_dataset=Dataset.from_list(records), processing_class=tok,
        args=trl_args(tmp_path, trl.KTOConfig, max_length=max_length),
    )  # fmt: skip
    theirs = trl_sequences(trainer, keys=("", "KL_"))
    assert len(theirs) == 2 * len(records) - 2 * (max_length is not None)  # a pair's two, unpaired
    assert [ex["label"] for ex in trainer.train_dataset] == [e.label for e in examples]
    assert [[ours(e.sequence), ours(e.kl)] for e in examples] == theirs


# ORPO's and CPO's tokenize_row on text, conversational and implicit-prompt records: a prompt
# ending mid-word whose last tokens merge with the chosen completion's first but not with the
# rejected one's (each side its own prompt), a completion ending with the EOS; with max_length 28
# completions cut and in each form one prompt that fills it (TRL keeps it, empty; megatrain
# leaves it out: docs/preference.md).
LONG = "Pip the rabbit ran to the old house by the river at night, far from the wood."
ANSWER_RECORDS = {
    "text": PREF_RECORDS["text"] + [
        {"prompt": "Pip ran to the ho", "chosen": "use.", "rejected": " river."},
        {"prompt": "The cat sa", "chosen": "t down on the warm mat by the door.", "rejected": "ng."},
    ],
    "conversational": PREF_RECORDS["conversational"] + [
        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": LONG}],
         "chosen": [{"role": "assistant", "content": "Home."}], "rejected": [{"role": "assistant", "content": "No."}]},
    ],
    "implicit text": [
        {"chosen": "The cat sat. It purred.", "rejected": "The cat sat. purred It."},
        {"chosen": "Pip ran to the house by the river and slept there all night, warm and dry.",
         "rejected": "Pip ran to the hill."},
        {"chosen": LONG + " Home.", "rejected": LONG + " Away."},
    ],
    "implicit conversational": [
        {"chosen": [USER, {"role": "assistant", "content": "In a burrow by the river."}],
         "rejected": [USER, {"role": "assistant", "content": "Nowhere."}]},
        {"chosen": [{"role": "user", "content": LONG}, {"role": "assistant", "content": "Yes."}],
         "rejected": [{"role": "user", "content": LONG}, {"role": "assistant", "content": "No."}]},
    ],
}  # fmt: skip


@pytest.mark.parametrize("max_length", [1024, 28])
@pytest.mark.parametrize("form", list(ANSWER_RECORDS))
@pytest.mark.parametrize("template", ["chatml", "llama3"])
@pytest.mark.parametrize("stage", ["orpo", "simpo"])
def test_orpo_and_simpo_records_are_tokenised_as_trls(tmp_path, stage, template, form, max_length):
    """trl.experimental's ORPOTrainer and CPOTrainer (loss_type simpo) build their train_dataset
    (maybe_extract_prompt, maybe_apply_chat_template, tokenize_row: prompt + completion tokenised
    together, the BOS and EOS ids added where missing, the completion cut to max_length) with the
    ids and labels megatrain's pairs have, under a template that writes the BOS and its own
    end-of-turn EOS (llama3) and one that writes neither (chatml)."""
    records, tok = ANSWER_RECORDS[form], tiny_tokenizer(template)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    cfg = TrainConfig(model_config="unused", dataset=str(data), stage=stage)
    pairs_ = build_preference_pairs([data], tok, cfg.preference().limits(max_length))
    if stage == "orpo":
        args = trl_args(tmp_path, ORPOConfig, max_length=max_length)
        trainer = trl.experimental.orpo.ORPOTrainer(model=model(), args=args, train_dataset=Dataset.from_list(records),
                                                    processing_class=tok)  # fmt: skip
    else:
        args = trl_args(tmp_path, CPOConfig, max_length=max_length, loss_type="simpo")
        trainer = trl.experimental.cpo.CPOTrainer(model=model(), args=args, train_dataset=Dataset.from_list(records),
                                                  processing_class=tok)  # fmt: skip
    theirs = [[(r[f"{k}_input_ids"], [int(x != -100) for x in r[f"{k}_labels"]]) for k in ("chosen", "rejected")]
              for r in trainer.train_dataset]  # fmt: skip
    kept = [i for i, row in enumerate(theirs) if all(any(mask) for _, mask in row)]
    assert [p.source for p in pairs_] == [f"{data}:{i + 1}" for i in kept]
    assert [[ours(p.chosen), ours(p.rejected)] for p in pairs_] == [theirs[i] for i in kept]
    if max_length == 28:  # the limits are exercised: a pair left out, a completion cut
        assert len(kept) < len(records)
        assert any(len(ids) == 28 for p in pairs_ for ids in (p.chosen.input_ids, p.rejected.input_ids))
    if form == "text":  # "ho": chosen's prompt lost its last token, merged into " house"; rejected's kept it
        (p,) = [p for p in pairs_ if p.source == f"{data}:5"]
        assert p.rejected.prompt_length == p.chosen.prompt_length + 1


def test_dpo_is_as_close_to_fp64_as_trls(pair_data, tmp_path):
    """megatrain's fp32 DPO after 3 steps against TRL's DPOTrainer in fp64 (the same steps, exact
    to ~1e-16) is no farther than 2x TRL's own fp32 run: the largest entry's distance and the
    entries over 1e-6 (docs/preference.md records the figures)."""
    tmp, data, dataset = pair_data
    _, final, _ = run(tmp_path, data, stage="dpo", model_name_or_path=str(tmp / "model"), learning_rate=LR)
    trained = {}
    for dtype in (torch.float32, torch.float64):
        hf = model().to(dtype)
        trainer = DPOTrainer(
            model=hf, ref_model=copy.deepcopy(hf), args=trl_args(tmp_path / str(dtype), trl.DPOConfig),
            train_dataset=dataset, processing_class=tiny_tokenizer(),
        )  # fmt: skip
        trained[dtype] = trl_steps(trainer)[1]
    exact = trained[torch.float64]
    dist = {
        who: torch.cat([(w[k].double() - exact[k]).abs().flatten() for k in exact])
        for who, w in (("megatrain", final), ("trl", trained[torch.float32]))
    }
    print({who: (f"{d.max().item():.2e}", int((d > 1e-6).sum())) for who, d in dist.items()})
    assert dist["megatrain"].max() <= 2 * dist["trl"].max()
    assert (dist["megatrain"] > 1e-6).sum() <= 2 * (dist["trl"] > 1e-6).sum()


class RewardTrainer(Tokenised, trl.RewardTrainer):
    pass


@pytest.mark.parametrize("center", [None, 0.1])
def test_rm_trains_as_trls_reward_trainer(tmp_path, center):
    """stage rm beside TRL's RewardTrainer itself (its collator, loss, margin and centring, the
    metrics it logs) over transformers' LlamaForSequenceClassification: the same losses, norms and
    metrics as its fp32 run, and final weights about as close to its fp64 run as its fp32 run is."""
    import test_reward as rm

    rm.reward_model().save_pretrained(tmp_path / "model")
    rows = rm.pairs()
    records, out = rm.run(
        tmp_path, rm.write(tmp_path / "pairs.jsonl", rows), center_rewards_coefficient=center
    )
    final = load_file(out / "final" / "model.safetensors")
    dataset = Dataset.from_list(
        [{"chosen_ids": p + c, "rejected_ids": p + r, "margin": m} for p, c, r, m in rows]
    )
    runs = {}
    for dtype in (torch.float32, torch.float64):
        args = trl_args(tmp_path / str(dtype), trl.RewardConfig, center_rewards_coefficient=center)
        for k, v in dict(learning_rate=rm.LR, weight_decay=rm.WD, max_grad_norm=rm.MAX_NORM,
                         per_device_train_batch_size=rm.B, gradient_accumulation_steps=rm.GA, max_steps=rm.STEPS).items():  # fmt: skip
            setattr(args, k, v)  # test_reward's schedule
        trainer = RewardTrainer(model=rm.reward_model().to(dtype), args=args, train_dataset=dataset,
                                processing_class=tiny_tokenizer())  # fmt: skip
        runs[dtype] = trl_steps(trainer)
    logs, trained = runs[torch.float32]
    for rec, log in zip(records, logs, strict=True):
        assert rec["loss"] == pytest.approx(log["loss"], rel=1e-5, abs=1e-7), rec["step"]
        assert rec["grad_norm"] == pytest.approx(log["grad_norm"], rel=1e-4), rec["step"]
        for k in ("mean_reward", "accuracy", "margin", "min_reward", "max_reward"):
            assert rec[k] == pytest.approx(log[k], rel=1e-4, abs=1e-6), (rec["step"], k)
    assert sum(log["grad_norm"] > rm.MAX_NORM for log in logs) >= 2, "the test should exercise clipping"
    assert final.keys() == trained.keys() and "score.weight" in final
    assert_trained_alike(final, trained, rm.LR)
    # Both fp32 runs within a few percent of a step's move of the fp64 run, entry by entry. Their
    # summed distances from it are no measure: with 4 pairs a step, a few per-sequence rounding
    # errors steer every entry alike (summed 3.5e-3 against TRL's 1.2e-3 on an AVX512 build, 1.8e-3
    # against 1.5e-3 on AVX2; the step-1 gradients' and rewards' errors TRL's size on both).
    exact = runs[torch.float64][1]
    for k, p in exact.items():
        for who, w in (("megatrain", final), ("TRL", trained)):
            assert (w[k].double() - p).abs().max() <= 0.02 * rm.LR, (who, k)


# stage rm's records as TRL 1.16's RewardTrainer reads them: text with a prompt (a token merged
# across its boundary, a completion ending with the EOS already) and without one (chosen and
# rejected whole, no prompt extracted), conversations with a prompt and without (one whose first
# messages differ: no shared prompt), a margin column; with each form's REWARD_MAX_LENGTH the
# longer pairs are left out (the text forms keep a pair of exactly max_length tokens).
REWARD_RECORDS = {
    "text": PREF_RECORDS["text"],
    "implicit text": ANSWER_RECORDS["implicit text"],
    "conversational": PREF_RECORDS["conversational"],
    "implicit conversational": ANSWER_RECORDS["implicit conversational"] + [
        {"chosen": [USER, {"role": "assistant", "content": "Home."}],
         "rejected": [{"role": "user", "content": "Who is Pip?"}, {"role": "assistant", "content": "A rabbit."}]},
    ],
    "margin": [dict(r, margin=m) for r, m in zip(PREF_RECORDS["text"], (0.5, -1.0, 0.0, 2.25))],
}  # fmt: skip
REWARD_MAX_LENGTH = {"text": 13, "implicit text": 35, "conversational": 45, "implicit conversational": 45,
                     "margin": 13}  # fmt: skip


@pytest.mark.parametrize("limited", [False, True])
@pytest.mark.parametrize("form", list(REWARD_RECORDS))
@pytest.mark.parametrize("template", ["chatml", "llama3"])
def test_rm_records_are_tokenised_as_trls(tmp_path, template, form, limited):
    """trl.RewardTrainer's train_dataset (the EOS string added to text completions without it,
    prompt + completion tokenised as one sequence, a conversation through the chat template
    whole, pairs with a sequence over max_length filtered out) holds the chosen and rejected ids
    and margins of megatrain's rm pairs, under templates with (llama3) and without a BOS."""
    import test_reward as rm

    records, tok = REWARD_RECORDS[form], tiny_tokenizer(template)
    max_length = REWARD_MAX_LENGTH[form] if limited else None
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    pairs_ = build_reward_pairs([data], tok, max_length)
    args = trl_args(tmp_path, trl.RewardConfig, max_length=max_length)
    trainer = trl.RewardTrainer(
        model=rm.reward_model(), args=args, train_dataset=Dataset.from_list(records), processing_class=tok
    )
    theirs = list(trainer.train_dataset)
    assert [(p.chosen.input_ids, p.rejected.input_ids) for p in pairs_] == [
        (r["chosen_ids"], r["rejected_ids"]) for r in theirs
    ]
    assert [p.margin for p in pairs_] == [r.get("margin", 0.0) for r in theirs]
    if max_length is not None:  # the filter is exercised: some pairs left out, some kept
        assert 0 < len(pairs_) < len(records)
