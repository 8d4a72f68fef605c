"""A reward model in grpo's reward_funcs, as TRL's GRPOTrainer takes one: the run equals the same
run whose reward function returns the model's scores precomputed, each completion's alone by a
plain transformers forward of its prompt + completion text (TRL's scoring), and the plan counts
the reward model's memory."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from helpers import tiny_config, tiny_tokenizer
from test_grpo import model

from megatrain.config import TrainConfig
from megatrain.models.config import ModelConfig
from megatrain.plan import rollout_memory
from megatrain.trainer import train

TABLE_MODULE = """
import json, pathlib
TABLE = json.loads((pathlib.Path(__file__).parent / "scores.json").read_text())
def score(prompts, completions, **_):
    return [TABLE[json.dumps([p, c])] for p, c in zip(prompts, completions)]
"""


def run(tmp_path, name, reward_funcs):
    out = tmp_path / name
    train(
        TrainConfig(
            model_name_or_path=str(tmp_path / "model"),
            dataset=str(tmp_path / "prompts.jsonl"),
            stage="grpo",
            output_dir=str(out),
            reward_funcs=reward_funcs,
            num_generations=4,
            max_completion_length=8,
            per_device_train_batch_size=4,
            gradient_accumulation_steps=2,
            max_steps=2,
            learning_rate=5e-3,
            lr_scheduler_type="constant",
            shuffle=False,
            save_strategy="no",
            disable_tqdm=True,
            logging_steps=1,  # every step's completions in completions.jsonl
        )  # fmt: skip
    )
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return records, [json.loads(x) for x in (out / "completions.jsonl").read_text().splitlines()]


def test_a_reward_model_scores_as_its_precomputed_scores(tmp_path, monkeypatch):
    tok = tiny_tokenizer()
    tok.save_pretrained(tmp_path / "model")
    model(len(tok)).save_pretrained(tmp_path / "model")
    with open(tmp_path / "prompts.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"Say {i} once:"}) + "\n")
    torch.manual_seed(1)
    cfg = tiny_config(
        "llama", num_hidden_layers=2, vocab_size=len(tok), num_labels=1, pad_token_id=tok.pad_token_id
    )
    rm = transformers.LlamaForSequenceClassification(cfg).eval()
    rm.save_pretrained(tmp_path / "rm")
    tok.save_pretrained(tmp_path / "rm")

    records, rollouts = run(tmp_path, "model", [str(tmp_path / "rm")])
    table = {}
    with torch.no_grad():
        for r in rollouts:  # each alone: no padding, no batch
            ids = tok(r["prompt"] + r["completion"], add_special_tokens=False, return_tensors="pt").input_ids
            table[json.dumps([r["prompt"], r["completion"]])] = rm(ids).logits[0, 0].item()
    (tmp_path / "scores.json").write_text(json.dumps(table))
    (tmp_path / "rm_table.py").write_text(TABLE_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    again, rollouts_again = run(tmp_path, "table", ["rm_table:score"])

    assert [r["completion_ids"] for r in rollouts] == [r["completion_ids"] for r in rollouts_again]
    scores = [next(iter(r["rewards"].values())) for r in rollouts]
    assert scores == pytest.approx([next(iter(r["rewards"].values())) for r in rollouts_again], abs=1e-5)
    assert len(set(scores)) > 4  # the model tells the completions apart
    steps = [r for r in records if "loss" in r]
    assert [r["loss"] for r in steps] == pytest.approx([r["loss"] for r in again if "loss" in r], abs=1e-6)
    assert all(
        r["reward"] == pytest.approx(a["reward"], abs=1e-5) for r, a in zip(steps, again) if "reward" in r
    )

    # the plan keeps the reward model's weights and its forward's activations on the GPU
    policy = ModelConfig.from_json(tmp_path / "model")
    args = dict(
        model_name_or_path=str(tmp_path / "model"),
        stage="grpo",
        per_device_train_batch_size=4,
        num_generations=4,
    )
    parts = rollout_memory(TrainConfig(**args, reward_funcs=[str(tmp_path / "rm")]), policy, 2)
    scorer = ModelConfig.from_json(tmp_path / "rm")
    assert scorer.num_labels == 1
    assert parts["reward models"] >= scorer.num_params * 2
    assert "reward models" not in rollout_memory(TrainConfig(**args, reward_funcs=["length"]), policy, 2)
