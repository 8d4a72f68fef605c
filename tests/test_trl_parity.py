"""megatrain beside TRL's own trainers (the release pyproject.toml's `trl` extra pins), on a tiny
random model in fp32 on the CPU, the same tokens in the same order: three optimizer steps of two
micro-batches with clipping active, then the per-step loss, the gradient norm, TRL's metrics and the
final weights must agree. A TRL release that changes a formula fails here.

TRL tokenises text itself; the data here is megatrain's pre-tokenised form, handed to TRL's
trainer as the token ids its own preprocessing would produce (`_prepare_dataset` left out), so the
two sides see the same ids whatever either's tokenisation."""

from __future__ import annotations

import copy

import pytest
import torch
import trl
from datasets import Dataset
from helpers import saved_parameters, tiny_tokenizer
from test_preference_training import GA, MAX_NORM, STEPS, WD, B, model, pairs, run, write_pairs
from torch.utils.data import SequentialSampler

from megatrain.objectives.preference import DPO_LOSS_TYPES

TRL_VERSION = "1.16.0"
# A step moves a weight by up to the learning rate (AdamW), so the weights' tolerance of 1e-5 is
# 1% of one step's move: an entry whose gradient is near 0 moves by lr x its rounding's sign.
LR = 1e-3
PAIR_METRICS = ["rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins",
                "logps/chosen", "logps/rejected", "logits/chosen", "logits/rejected"]  # fmt: skip


def test_the_trl_followed_is_installed():
    assert trl.__version__ == TRL_VERSION


def trl_args(tmp_path, config_class, **kw):
    """TRL's config with the schedule megatrain runs: sequential batches, constant learning rate,
    fp32 on the CPU, a log every step."""
    return config_class(
        output_dir=str(tmp_path / "trl"), per_device_train_batch_size=B, gradient_accumulation_steps=GA,
        max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant", weight_decay=WD,
        max_grad_norm=MAX_NORM, use_cpu=True, bf16=False, gradient_checkpointing=False, logging_steps=1,
        report_to="none", save_strategy="no", disable_tqdm=True, seed=0, max_length=None,
        train_sampling_strategy="sequential", **kw,
    )  # fmt: skip


class Tokenised:
    """A trainer fed token ids: its text preprocessing skipped, its batches in file order."""

    def _prepare_dataset(self, dataset, *args, **kwargs):
        return dataset

    def _get_train_sampler(self, train_dataset=None):
        return SequentialSampler(train_dataset or self.train_dataset)


class DPOTrainer(Tokenised, trl.DPOTrainer):
    pass


def trl_steps(trainer) -> tuple[list[dict], dict[str, torch.Tensor]]:
    trainer.train()
    logs = [r for r in trainer.state.log_history if "loss" in r and "train_runtime" not in r]
    assert len(logs) == STEPS
    return logs, {k: p.detach() for k, p in saved_parameters(trainer.model).items()}


def compare(records, logs, final, trained, metrics):
    for rec, log in zip(records, logs, strict=True):
        step = rec["step"]
        assert rec["loss"] == pytest.approx(log["loss"], rel=1e-5, abs=1e-7), step
        assert rec["grad_norm"] == pytest.approx(log["grad_norm"], rel=1e-4), step
        for k in metrics:  # rewards: beta x a difference of two sums of ~20 fp32 log-probs
            assert rec[k] == pytest.approx(log[k], rel=1e-4, abs=1e-5), (step, k)
    assert sum(log["grad_norm"] > MAX_NORM for log in logs) >= 2, "the test should exercise clipping"
    assert final.keys() == trained.keys()
    for k, p in trained.items():
        torch.testing.assert_close(final[k], p, rtol=1e-5, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")


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
    compare(records, logs, final, trained, PAIR_METRICS)
