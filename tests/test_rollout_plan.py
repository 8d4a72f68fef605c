"""The plan of a grpo run: its rollout (the policy in the compute dtype, the KV cache of a step's
completions, the prefill) is kept out of the GPU budget the update is planned in, shown by
`megatrain plan`, and a rollout that cannot fit is refused in one line."""

from __future__ import annotations

import math
import re
from dataclasses import replace

import pytest
from transformers import LlamaConfig

from megatrain import plan as planning
from megatrain import planreport
from megatrain.config import TrainConfig
from megatrain.errors import ConfigError
from megatrain.models.config import ModelConfig
from megatrain.planning.footprint import HOST_RESERVE, usable_gpu
from megatrain.planning.placement import Machine
from megatrain.planning.placement import plan as make_placement
from megatrain.planning.planspec import Plan

GiB = 2**30
ROWS, PROMPT, COMPLETION = 8 * 4, 96, 160


def shapes():
    hf = LlamaConfig(hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4,
                     intermediate_size=2816, vocab_size=32000, tie_word_embeddings=False)  # fmt: skip
    model_cfg = ModelConfig.from_hf(hf)
    cfg = TrainConfig(
        model_config="unused", dataset="unused", stage="grpo", num_generations=4, per_device_train_batch_size=8,
        gradient_accumulation_steps=4, max_prompt_length=PROMPT, max_completion_length=COMPLETION,
    )  # fmt: skip
    return model_cfg, cfg


def test_the_rollout_counts_the_policy_and_the_kv_cache_of_every_completion():
    model_cfg, cfg = shapes()
    r = planning.rollout_memory(cfg, model_cfg, 2)
    assert r["policy weights"] == model_cfg.num_params * 2
    assert r["KV cache"] == ROWS * (PROMPT + COMPLETION) * 6 * 2 * 4 * 64 * 2
    # the rollout engine prefills each distinct prompt once (num_generations 4: 8 of the 32 rows)
    assert r["prefill (one layer, every prompt)"] > (ROWS // 4 + 1) * PROMPT * 3 * 2816 * 2
    assert r["prefill (one layer, every prompt)"] < ROWS * PROMPT * 3 * 2816 * 2
    generate = planning.rollout_memory(replace(cfg, rollout_engine="generate"), model_cfg, 2)
    assert generate["prefill (one layer, every prompt)"] > ROWS * PROMPT * 3 * 2816 * 2
    assert planning.rollout_memory(replace(cfg, stage="sft"), model_cfg, 2) == {}


def test_the_update_is_planned_in_the_gpu_less_the_rollout_and_too_large_a_rollout_is_refused():
    model_cfg, cfg = shapes()
    rollout = sum(planning.rollout_memory(cfg, model_cfg, 2).values())
    batch, choices = planning.batch_of(cfg, model_cfg, 2), planning.choices_of(cfg)
    # A GPU the update alone would fill past the rollout's room.
    wants = make_placement(model_cfg, batch, Machine("cuda", 64 * GiB, 64 * GiB), choices).gpu_peak
    gpu = wants + rollout // 2
    machine = Machine("cuda", gpu, 64 * GiB)

    got = planning.check(model_cfg, cfg, machine, 2)
    assert got.fits
    alone = make_placement(model_cfg, batch, replace(machine, gpu_bytes=gpu - rollout), choices)
    assert got.plan.gpu_peak == alone.gpu_peak < wants
    assert got.plan.gpu_peak + rollout <= usable_gpu(machine)  # the update and the rollout fit at once

    text = planreport.report(model_cfg, got, "a GPU", "bfloat16", cfg)
    assert "rollout: ~" in text and "KV cache" in text

    small = planning.check(model_cfg, cfg, Machine("cuda", rollout - GiB // 4, 64 * GiB), 2)
    assert not small.fits and "the rollout alone needs" in small.problem and "\n" not in small.problem


def test_a_kl_term_keeps_the_reference_weights_in_host_memory_in_the_plan():
    model_cfg, cfg = shapes()
    machine = Machine("cuda", 80 * GiB, 64 * GiB)
    plain = planning.check(model_cfg, cfg, machine, 2).plan
    kl = planning.check(model_cfg, replace(cfg, beta=0.04), machine, 2).plan
    ref = kl.host["reference weights (grpo, beta > 0)"]
    assert ref == model_cfg.num_params * 2
    assert kl.host_total == plain.host_total + ref
    tight = Machine("cuda", 80 * GiB, int((plain.host_total + ref // 2) / (1 - HOST_RESERVE)))
    assert planning.check(model_cfg, cfg, tight, 2).fits
    assert not planning.check(model_cfg, replace(cfg, beta=0.04), tight, 2).fits


# ---------------------------------------------------------------------------- `megatrain plan`
def _plan_cli(tmp_path, capsys, **settings) -> tuple[TrainConfig, ModelConfig, list[str]]:
    """`megatrain plan` of a run of the `shapes()` model, whose positions are PROMPT + COMPLETION,
    on a GPU named but not present; the config, the model and the printed lines."""
    from test_checkpoint import write_yaml
    from test_cli import run_cli

    hf = LlamaConfig(hidden_size=1024, num_hidden_layers=6, num_attention_heads=16, num_key_value_heads=4,
                     intermediate_size=2816, vocab_size=32000, max_position_embeddings=PROMPT + COMPLETION)  # fmt: skip
    hf.save_pretrained(tmp_path / "model")
    (tmp_path / "data.jsonl").write_text('{"prompt_input_ids": [1, 2, 3]}\n')
    run = dict(model_config=str(tmp_path / "model"), dataset=str(tmp_path / "data.jsonl"), device="cuda",
               max_gpu_memory="4GiB", max_host_memory="16GiB") | settings  # fmt: skip
    path = write_yaml(tmp_path / "run.yaml", run)
    rc, stdout, _ = run_cli(capsys, "plan", path)
    assert rc == 0, stdout
    return TrainConfig.load(path), ModelConfig.from_json(tmp_path / "model"), stdout.splitlines()


def _fits(cfg: TrainConfig, model_cfg: ModelConfig, **settings) -> bool:
    """Whether `megatrain plan` would say the run with these settings fits (the data counted)."""
    changed = replace(cfg, **settings)
    machine = planning.machine_of(changed, "cuda")
    return planning.check(model_cfg, changed, machine, 2, data=planning.data_bytes(changed)).fits


def _settings(line: str) -> dict[str, int]:
    return {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", line)}


GRPO_RUN = dict(stage="grpo", reward_funcs=["length"], num_generations=4, per_device_train_batch_size=8,
                gradient_accumulation_steps=4, max_prompt_length=PROMPT, max_completion_length=COMPLETION)  # fmt: skip


def test_the_plan_of_grpo_speaks_in_its_settings(tmp_path, capsys):
    """A grpo row is a prompt and a completion: no max_length anywhere (nor a warning that it passes
    the model's positions); the largest settings that fit are grpo's, each the largest (one unit
    more does not fit: per_device_train_batch_size in steps that keep whole groups); the longest
    completion fits in the smallest step and one token more does not."""
    cfg, model_cfg, lines = _plan_cli(tmp_path, capsys, **GRPO_RUN)
    assert not any("max_length" in line or "warning" in line for line in lines), lines
    largest = _settings(next(x for x in lines if x.startswith("largest that fit")))
    assert list(largest) == ["per_device_train_batch_size", "gradient_accumulation_steps",
                             "steps_per_generation", "max_completion_length"]  # fmt: skip
    units = {"per_device_train_batch_size": 4 // math.gcd(4, 4)}  # num_generations / gcd(it, slices)
    for key, value in largest.items():
        assert value >= {**GRPO_RUN, "steps_per_generation": 4}[key]  # the configured run fits
        assert _fits(cfg, model_cfg, **{key: value})
        assert not _fits(cfg, model_cfg, **{key: value + units.get(key, 1)}), key
    line = next(x for x in lines if x.startswith("longest completion: "))
    n = int(
        re.match(r"longest completion: ([\d,]+) tokens after a prompt of up to 96 ", line)
        .group(1)
        .replace(",", "")
    )
    smallest = dict(per_device_train_batch_size=1, gradient_accumulation_steps=1, steps_per_generation=4)
    assert _fits(cfg, model_cfg, max_completion_length=n, **smallest)
    assert not _fits(cfg, model_cfg, max_completion_length=n + 1, **smallest)
    assert line.endswith("never trained")  # the longest completion passes the model's positions

    _, _, lines = _plan_cli(tmp_path, capsys, **GRPO_RUN | dict(max_completion_length=COMPLETION + 1))
    assert lines[0] == (f"megatrain: warning: max_prompt_length {PROMPT} + max_completion_length {COMPLETION + 1} "
                        f"= {PROMPT + COMPLETION + 1} is beyond the model's max_position_embeddings "
                        f"{PROMPT + COMPLETION}: positions past it were never trained")  # fmt: skip


def test_a_grpo_run_that_does_not_fit_is_told_grpo_settings_that_would(tmp_path):
    """Too small a GPU for long completions: the settings that would fit are grpo's (the
    generation batch, the completion length), each one fits, whole groups kept."""
    model_cfg, cfg = shapes()
    cfg, machine = replace(cfg, max_completion_length=4096), Machine("cuda", 4 * GiB, 64 * GiB)
    result = planning.check(model_cfg, cfg, machine, 2)
    assert not result.fits and "max_length" not in result.problem
    fixes = _settings(result.problem.split("would fit with ")[1])
    assert {"steps_per_generation", "max_completion_length"} <= set(fixes)
    for key, value in fixes.items():
        changed = replace(cfg, **{key: value})  # a config it accepts: whole groups
        assert planning.check(model_cfg, changed, machine, 2).fits, key


def test_the_rollout_samples_a_generation_batch_at_a_time():
    """The rollout's room is for per_device_train_batch_size x steps_per_generation completions
    (by default gradient_accumulation_steps: a step's), as generation_batch_size makes it too, or
    for an evaluation's per_device_eval_batch_size where that is more."""
    model_cfg, cfg = shapes()

    def kv(changed, processes=None):
        return planning.rollout_memory(changed, model_cfg, 2, processes)["KV cache"]

    for changed in (replace(cfg, steps_per_generation=1), replace(cfg, generation_batch_size=8)):
        assert kv(changed) * 4 == kv(cfg)
    assert kv(replace(cfg, generation_batch_size=16), processes=2) * 4 == kv(cfg)
    evaluating = replace(cfg, eval_dataset="unused", eval_strategy="steps")
    assert kv(replace(evaluating, per_device_eval_batch_size=64)) == 2 * kv(cfg)
    assert kv(replace(evaluating, per_device_eval_batch_size=8)) == kv(cfg)


def test_the_plan_of_dpo_counts_pairs(tmp_path, capsys):
    """dpo: per_device_train_batch_size counts pairs, and the longest context is that of one pair
    (two sequences) a step: it fits, one token more does not."""
    (tmp_path / "pairs.jsonl").write_text(
        '{"prompt_input_ids": [1], "chosen_input_ids": [2], "rejected_input_ids": [3]}\n'
    )
    cfg, model_cfg, lines = _plan_cli(tmp_path, capsys, stage="dpo", dataset=str(tmp_path / "pairs.jsonl"),
                                      max_length=256, per_device_train_batch_size=4)  # fmt: skip
    largest = next(x for x in lines if x.startswith("largest that fit"))
    assert re.search(r"per_device_train_batch_size=\d+ \(dpo samples\)", largest)
    line = next(x for x in lines if x.startswith("longest context: "))
    n = int(re.match(r"longest context: ([\d,]+) tokens per sequence \(one dpo sample per step, 2 sequences;", line)
            .group(1).replace(",", ""))  # fmt: skip
    one = dict(per_device_train_batch_size=1, gradient_accumulation_steps=1)
    assert _fits(cfg, model_cfg, max_length=n, **one) and not _fits(cfg, model_cfg, max_length=n + 1, **one)


# ---------------------------------------------------------------------------- streamed layers
def test_a_policy_that_does_not_fit_beside_the_update_streams_the_fewest_layers_it_must():
    """On a GPU where the update fits beside the rollout only if some of the policy's layers
    stream: the plan keeps the most layers that leave the update a plan that fits (one more does
    not), the rollout's room counts them and two buffers, and `megatrain plan` says how many
    stream. `rollout_resident_layers: N` keeps N; a bad value is a one-line error naming it."""
    hf = LlamaConfig(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, num_key_value_heads=4,
                     intermediate_size=2816, vocab_size=32000, tie_word_embeddings=False)  # fmt: skip
    model_cfg, (_, cfg) = ModelConfig.from_hf(hf), shapes()
    cfg = replace(cfg, per_device_train_batch_size=4, gradient_accumulation_steps=1, max_completion_length=32)
    layer = (
        model_cfg.num_params
        - planning.rollout_memory(cfg, model_cfg, 2, resident_layers=0)["policy weights"] // 2
    ) // 24
    half = sum(planning.rollout_memory(cfg, model_cfg, 2, resident_layers=12).values())

    def fits(gpu, **kw):
        return planning.check(model_cfg, replace(cfg, **kw), Machine("cuda", gpu, 64 * GiB), 2).fits

    lo, hi = half, 64 * GiB  # the smallest GPU where keeping 12 layers fits
    while hi - lo > 2**20:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid, rollout_resident_layers=12) else (mid, hi)
    machine = Machine("cuda", hi, 64 * GiB)
    got = planning.check(model_cfg, cfg, machine, 2)
    assert got.fits and got.plan.rollout_layers == 12

    batch, choices = planning.batch_of(cfg, model_cfg, 2), planning.choices_of(cfg)

    def update_fits(resident):
        rollout = sum(planning.rollout_memory(cfg, model_cfg, 2, None, resident).values())
        room = Machine("cuda", machine.gpu_bytes - rollout, machine.host_bytes)
        try:
            make_placement(model_cfg, batch, room, choices)
            return True
        except planning.PlanError:
            return False

    assert update_fits(12) and not update_fits(13) and not update_fits(None)
    parts = planning.rollout_memory(cfg, model_cfg, 2, resident_layers=12)
    whole = planning.rollout_memory(cfg, model_cfg, 2)
    assert whole["policy weights"] - parts["policy weights"] == 12 * layer * 2
    # two bf16 buffers the master's bf16 halves land in as they are; in fp32 two fp32 buffers and
    # the halves' landing buffer
    assert parts["streamed layers' buffers"] == layer * 2 * 2
    fp32 = planning.rollout_memory(cfg, model_cfg, 4, resident_layers=12)
    assert fp32["streamed layers' buffers"] == layer * (2 * 4 + 4)
    text = planreport.report(model_cfg, got, "a GPU", "bfloat16", cfg)
    assert (
        "rollout: 12 of 24 layers streamed through the GPU in every decode step (the first 12 "
        "resident), fetched from host memory as the master weights' bf16 half" in text
    )

    roomy = Machine("cuda", 64 * GiB, 64 * GiB)
    assert planning.check(model_cfg, cfg, roomy, 2).plan.rollout_layers is None  # the whole policy fits
    assert (
        planning.check(model_cfg, replace(cfg, rollout_resident_layers=5), roomy, 2).plan.rollout_layers == 5
    )
    with pytest.raises(
        ConfigError, match=r"^rollout_resident_layers: must be auto or a number of layers >= 0"
    ):
        replace(cfg, rollout_resident_layers="some")


def test_the_retired_rollout_host_copy_key_is_refused_in_one_line():
    """The rollout's copy of the streamed layers is gone (the master's bf16 half is fetched as it
    is): the key is refused, saying why, and plan.json's of a run before keeps loading."""
    keys = {"model_config": "m", "dataset": "d"}
    with pytest.raises(ConfigError, match=r"^config key 'rollout_host_copy' is retired: .*bf16 half") as e:
        TrainConfig.from_dict({**keys, "rollout_host_copy": True})
    assert "\n" not in str(e.value)
    old = {**Plan("cuda", "stored", 0, 0, 0, 0, 64).to_json(), "rollout_host_copy": True}
    assert Plan.from_json(old).rollout_layers is None


def test_the_log_prob_stages_plan_their_loss_head_at_autogradss_bytes_a_logit():
    """grpo's and dpo's loss head (autograd over each chunk's logits) is planned at
    AUTOGRAD_LOGIT_BYTES a logit, sft's (cross-entropy's one pass) and rm's (a score head) at
    LOGIT_BYTES: their chunks hold the same bytes, so dpo's has fewer tokens."""
    from types import SimpleNamespace

    from megatrain.planning.footprint import AUTOGRAD_LOGIT_BYTES, LOGIT_BYTES, loss_chunk

    model_cfg, cfg = shapes()
    machine = Machine(device="cuda", gpu_bytes=200 * GiB, host_bytes=256 * GiB)
    s = SimpleNamespace(vocab=model_cfg.vocab_size)  # all loss_chunk reads of the shape
    chunks = {}
    for stage in ("grpo", "dpo", "sft", "rm"):
        c = cfg if stage == "grpo" else TrainConfig(
            model_config="unused", dataset="unused", stage=stage, per_device_train_batch_size=8, max_length=2048
        )  # fmt: skip
        b = planning.batch_of(c, model_cfg, 2)
        assert b.autograd_head == (stage in ("grpo", "dpo")), stage
        chunks[stage] = loss_chunk(s, replace(b, micro_batch_tokens=2**20), machine, None)
    assert chunks["sft"] == chunks["rm"]
    assert (
        chunks["dpo"] * AUTOGRAD_LOGIT_BYTES
        <= chunks["sft"] * LOGIT_BYTES
        < (chunks["dpo"] + 1) * AUTOGRAD_LOGIT_BYTES
    )
