"""full_determinism (TrainingArguments' name) and the sums megatrain orders itself.

On the CPU: the switch turns PyTorch's strict deterministic mode on for the run and puts every mode
back, refuses a cuBLAS setting that is not deterministic, and trains bitwise as without it (the
CPU's kernels repeat already) through every op the families and stages run. On a GPU: a run at
training lengths (4,096-token rows, where the default attention backward adds dQ atomically)
repeats bit for bit under it, and so does its resume.
"""

from __future__ import annotations

import json
import os
import random

import pytest
import torch
from helpers import tiny_config
from test_checkpoint import assert_bitwise, make_run, metrics, tensors

from megatrain import trainer
from megatrain.config import TrainConfig
from megatrain.determinism import CUBLAS_WORKSPACE, full_determinism, sorted_sums
from megatrain.errors import ConfigError


def _modes():
    return (
        torch.are_deterministic_algorithms_enabled(),
        torch.is_deterministic_algorithms_warn_only_enabled(),
        torch.backends.cudnn.deterministic,
        torch.backends.cudnn.benchmark,
        os.environ.get(CUBLAS_WORKSPACE),
    )


def test_the_switch_turns_the_strict_mode_on_and_puts_every_mode_back(monkeypatch):
    monkeypatch.delenv(CUBLAS_WORKSPACE, raising=False)
    before = _modes()
    assert before[0] is False  # the suite runs in PyTorch's default mode
    with full_determinism(False):
        assert _modes() == before
    with full_determinism(True):
        assert _modes() == (True, False, True, False, ":4096:8")
        with sorted_sums():  # strict stays strict
            assert _modes()[:2] == (True, False)
        assert _modes()[:2] == (True, False)
    assert _modes() == before
    with sorted_sums():
        assert _modes()[:2] == (True, True)  # only the ops without a deterministic form warn
    assert _modes() == before


def test_the_users_cublas_setting_is_kept_or_refused(monkeypatch):
    monkeypatch.setenv(CUBLAS_WORKSPACE, ":16:8")
    with full_determinism(True):
        assert os.environ[CUBLAS_WORKSPACE] == ":16:8"
    assert os.environ[CUBLAS_WORKSPACE] == ":16:8"
    monkeypatch.setenv(CUBLAS_WORKSPACE, ":0:0")
    refused = pytest.raises(ConfigError, match=r"full_determinism: .*CUBLAS_WORKSPACE_CONFIG=:0:0 is not")
    with refused, full_determinism(True):
        pass
    assert not torch.are_deterministic_algorithms_enabled()


def _spy_on_the_run(monkeypatch) -> list:
    """The deterministic mode as each run's body (`trainer._train`) finds it."""
    seen, body = [], trainer._train

    def spied(*args, **kw):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return body(*args, **kw)

    monkeypatch.setattr(trainer, "_train", spied)
    return seen


@pytest.mark.parametrize("family", ["llama", "olmoe", "gpt_oss"])
def test_on_the_cpu_the_switch_trains_bitwise_as_without_it(tmp_path, monkeypatch, family):
    """Every op the run takes has a deterministic form on the CPU (strict mode would raise on one
    that has not), and none of them rounds differently in it."""
    seen = _spy_on_the_run(monkeypatch)
    base = make_run(tmp_path, config=None if family == "llama" else tiny_config(family, vocab_size=97))
    runs = {}
    for on in (False, True):
        out = tmp_path / f"out-{on}"
        train_cfg = TrainConfig(**base, output_dir=str(out), max_steps=3, full_determinism=on, packing=True)
        trainer.train(train_cfg)
        runs[on] = (tensors(out / "checkpoint-3"), [r["grad_norm"] for r in metrics(out)])
    assert seen == [False, True]
    assert not torch.are_deterministic_algorithms_enabled()  # put back after the run
    (w0, n0), (w1, n1) = runs[False], runs[True]
    assert n1 == n0
    assert_bitwise(w1, w0)


def test_a_yaml_full_determinism_is_read_and_huggingfaces_untaken_keys_say_why(tmp_path):
    model = {"model_config": str(tmp_path)}
    assert TrainConfig.from_dict(model | {"full_determinism": True}).full_determinism is True
    with pytest.raises(ConfigError, match=r"'deepspeed' \(Hugging Face's\) is not taken: megatrain places"):
        TrainConfig.from_dict(model | {"deepspeed": "ds_config.json"})
    with pytest.raises(ConfigError, match=r"'bf16' \(Hugging Face's\) is not taken: .*compute_dtype"):
        TrainConfig.from_dict(model | {"bf16": True})


# ---------------------------------------------------------------------------------------- GPU


def _long_rows(tmp_path, packing: bool) -> dict:
    """A tiny Llama (head dim 64, FlashAttention's range) and rows of 4,096 tokens: 32 key blocks,
    so the default attention backward adds each query's dQ from many thread blocks at once."""
    cfg = tiny_config("llama", vocab_size=512, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
                      intermediate_size=512, num_hidden_layers=2, max_position_embeddings=4096)  # fmt: skip
    base = make_run(tmp_path, config=cfg, vocab=512)
    rng = random.Random(1)
    with open(tmp_path / "long.jsonl", "w") as f:
        for _ in range(12):  # packed: documents of 300-2,000 tokens laid into the rows
            n = rng.randint(300, 2000) if packing else 4096
            f.write(json.dumps({"input_ids": [rng.randrange(512) for _ in range(n)]}) + "\n")
    return base | dict(
        dataset=str(tmp_path / "long.jsonl"), device="cuda", compute_dtype="bfloat16", max_length=4096,
        per_device_train_batch_size=1, gradient_accumulation_steps=2, packing=packing, full_determinism=True,
        save_steps=2, shuffle=False,
    )  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("packing", [False, True], ids=["rows", "packed"])
def test_on_cuda_the_switch_repeats_a_run_at_training_lengths_bit_for_bit(tmp_path, packing):
    """Under full_determinism: two runs of 4,096-token rows (SDPA's flash backward; packed rows:
    FlexAttention's block masks) are bitwise equal, and a resume from step 2 equals them at step 4,
    with the clip active."""
    base = _long_rows(tmp_path, packing)
    runs = {}
    for name in ("a", "b"):
        out = tmp_path / name
        trainer.train(TrainConfig(**base, output_dir=str(out), max_steps=4))
        runs[name] = (tensors(out / "checkpoint-4"), [r["grad_norm"] for r in metrics(out) if "loss" in r])
    resumed = tmp_path / "a-resumed"
    trainer.train(TrainConfig(**base, output_dir=str(resumed), max_steps=2))
    trainer.train(
        TrainConfig(
            **base, output_dir=str(resumed), max_steps=4, resume_from_checkpoint=str(resumed / "checkpoint-2")
        )
    )
    (wa, na), (wb, nb) = runs["a"], runs["b"]
    assert na == nb and max(na) > base["max_grad_norm"]  # clipped
    assert_bitwise(wb, wa)
    assert_bitwise(tensors(resumed / "checkpoint-4"), wa)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.gpu
@pytest.mark.parametrize("family", ["olmoe", "gpt_oss"])
def test_on_cuda_the_switch_trains_the_expert_families_bit_for_bit(tmp_path, family):
    """Strict mode raises on an op with no deterministic form on CUDA: the expert blocks' routing,
    sorts, grouped products and scatters (and gpt-oss's sinks, FlexAttention's packed documents)
    all have one. Two runs under the switch are bitwise equal."""
    base = make_run(tmp_path, config=tiny_config(family, vocab_size=97))
    base |= dict(device="cuda", packing=True, full_determinism=True)
    runs = []
    for name in ("a", "b"):
        trainer.train(TrainConfig(**base, output_dir=str(tmp_path / name), max_steps=3))
        runs.append(
            (tensors(tmp_path / name / "checkpoint-3"), [r["grad_norm"] for r in metrics(tmp_path / name)])
        )
    (wa, na), (wb, nb) = runs
    assert na == nb and max(na) > base["max_grad_norm"]
    assert_bitwise(wb, wa)


@pytest.mark.parametrize("on", [False, True])
def test_the_plan_command_measures_as_the_run_will(tmp_path, monkeypatch, capsys, on):
    """`megatrain plan` measures the machine and the layer under the switch when the config sets
    it, as `train`'s own plan is made inside the run's modes."""
    from test_checkpoint import write_yaml

    from megatrain import cli, plan

    seen, measured = [], plan.measured

    def spied(*args, **kw):
        seen.append(torch.are_deterministic_algorithms_enabled())
        return measured(*args, **kw)

    monkeypatch.setattr(plan, "measured", spied)
    config = write_yaml(tmp_path / "run.yaml", make_run(tmp_path) | dict(output_dir=str(tmp_path / "out")))
    assert cli.main(["plan", str(config), f"full_determinism={str(on).lower()}"]) == 0
    assert seen == [on] and not torch.are_deterministic_algorithms_enabled()
    assert "host" in capsys.readouterr().out
