"""The plan of a grpo run: its rollout (the policy in the compute dtype, the KV cache of a step's
completions, the prefill) is kept out of the GPU budget the update is planned in, shown by
`megatrain plan`, and a rollout that cannot fit is refused in one line."""

from __future__ import annotations

import json
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
from megatrain.planning.placement import Machine, fmt_bytes
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
    assert got.fits and got.plan.rollout_layers == 12 and got.plan.rollout_host_copy

    batch, choices = planning.batch_of(cfg, model_cfg, 2), planning.choices_of(cfg)

    def update_fits(resident):
        rollout = sum(planning.rollout_memory(cfg, model_cfg, 2, None, resident, host_copy=True).values())
        copy = planning.rollout_copy_bytes(model_cfg, resident, 2)
        room = Machine("cuda", machine.gpu_bytes - rollout, machine.host_bytes - copy)
        try:
            make_placement(model_cfg, batch, room, choices)
            return True
        except planning.PlanError:
            return False

    assert update_fits(12) and not update_fits(13) and not update_fits(None)
    parts = planning.rollout_memory(cfg, model_cfg, 2, resident_layers=12)
    whole = planning.rollout_memory(cfg, model_cfg, 2)
    assert whole["policy weights"] - parts["policy weights"] == 12 * layer * 2
    assert parts["streamed layers' buffers"] == layer * (2 * 2 + 4)  # two bf16 buffers, an fp32 stage
    copied = planning.rollout_memory(cfg, model_cfg, 2, resident_layers=12, host_copy=True)
    assert copied["streamed layers' buffers"] == layer * 2 * 2  # from the host copy: no stage
    text = planreport.report(model_cfg, got, "a GPU", "bfloat16", cfg)
    assert (
        "rollout: 12 of 24 layers streamed through the GPU in every decode step (the first 12 "
        f"resident), fetched from a bfloat16 copy in host memory ({fmt_bytes(12 * layer * 2)})" in text
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


def test_streamed_layers_are_fetched_from_a_host_copy_where_the_host_has_room_for_it():
    """The plan keeps a copy of the streamed layers in the compute dtype in host memory (2 bytes a
    parameter, one a process, page-locked: `rollout_copy_bytes`, the size the rollout allocates)
    where the host holds it beside the update, counts it, and records the choice in plan.json;
    on a host without room for it the layers are fetched from the fp32 master weights, and in
    fp32 there is no copy to make."""
    model_cfg, cfg = shapes()
    cfg = replace(cfg, rollout_resident_layers=2)
    machine = Machine("cuda", 80 * GiB, 64 * GiB)
    p = planning.check(model_cfg, cfg, machine, 2).plan
    copy = planning.rollout_copy_bytes(model_cfg, 2, 2)
    whole = planning.rollout_memory(cfg, model_cfg, 2, None, 0)["policy weights"] // 2  # all but layers
    assert copy == 4 * (model_cfg.num_params - whole) // 6 * 2  # 4 of 6 layers, 2 bytes a parameter
    assert p.rollout_host_copy and p.host[planning.ROLLOUT_COPY] == copy
    fp32 = planning.check(model_cfg, cfg, machine, 4).plan
    assert not fp32.rollout_host_copy and planning.ROLLOUT_COPY not in fp32.host
    assert (
        planning.rollout_copy_bytes(model_cfg, 2, 4) == planning.rollout_copy_bytes(model_cfg, None, 2) == 0
    )
    assert Plan.from_json(json.loads(json.dumps(p.to_json()))).rollout_host_copy

    without = p.host_total - copy  # the update's host memory, and the rest beside it
    short = Machine("cuda", 80 * GiB, int((without + copy // 2) / (1 - HOST_RESERVE)))
    tight = planning.check(model_cfg, cfg, short, 2).plan
    assert not tight.rollout_host_copy and tight.host_total == without and tight.rollout_layers == 2
    text = planreport.report(model_cfg, planning.check(model_cfg, cfg, short, 2), "a GPU", "bfloat16", cfg)
    assert "fetched from the fp32 master weights" in text
    roomy = Machine("cuda", 80 * GiB, int((without + copy) / (1 - HOST_RESERVE)) + 2**20)
    assert planning.check(model_cfg, cfg, roomy, 2).plan.rollout_host_copy


def test_rollout_host_copy_overrides_the_plans_choice():
    """`rollout_host_copy: false` fetches the streamed layers from the fp32 master weights where
    the plan would take the copy; `true` takes the copy where the plan would not, and a host
    without room for it refuses the run in one line; neither changes a rollout that streams
    nothing or a run in fp32; `auto` is the default and reads as the plan's own choice."""
    model_cfg, cfg = shapes()
    cfg = replace(cfg, rollout_resident_layers=2)
    roomy = Machine("cuda", 80 * GiB, 64 * GiB)
    auto = planning.check(model_cfg, cfg, roomy, 2).plan
    assert auto.rollout_host_copy and cfg.rollout_host_copy is None
    off = planning.check(model_cfg, replace(cfg, rollout_host_copy=False), roomy, 2).plan
    assert not off.rollout_host_copy and planning.ROLLOUT_COPY not in off.host
    assert off.rollout_layers == auto.rollout_layers == 2
    copy = planning.rollout_copy_bytes(model_cfg, 2, 2)
    assert off.host_total == auto.host_total - copy

    # a host with room for the update but not for the copy: auto declines it, true is refused
    short = Machine("cuda", 80 * GiB, int((off.host_total + copy // 2) / (1 - HOST_RESERVE)))
    assert not planning.check(model_cfg, cfg, short, 2).plan.rollout_host_copy
    forced = planning.check(model_cfg, replace(cfg, rollout_host_copy=True), short, 2)
    assert forced.plan is None and "\n" not in forced.problem
    assert re.match(r"no placement fits: host memory: .* \(with rollout_host_copy: true;", forced.problem)
    on = planning.check(model_cfg, replace(cfg, rollout_host_copy=True), roomy, 2).plan
    assert on.rollout_host_copy and on.host[planning.ROLLOUT_COPY] == copy

    resident = replace(cfg, rollout_resident_layers=6, rollout_host_copy=True)  # nothing streams
    assert not planning.check(model_cfg, resident, roomy, 2).plan.rollout_host_copy
    assert not planning.check(
        model_cfg, replace(cfg, rollout_host_copy=True), roomy, 4
    ).plan.rollout_host_copy
    keys = {"model_config": "m", "dataset": "d"}
    assert TrainConfig.from_dict({**keys, "rollout_host_copy": "auto"}).rollout_host_copy is None
    assert TrainConfig.from_dict({**keys, "rollout_host_copy": False}).rollout_host_copy is False
    with pytest.raises(ConfigError, match=r"^rollout_host_copy: expected bool"):
        TrainConfig.from_dict({**keys, "rollout_host_copy": "sometimes"})
