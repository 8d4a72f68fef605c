"""The plan of a grpo run: its rollout (the policy in the compute dtype, the KV cache of a step's
completions, the prefill) is kept out of the GPU budget the update is planned in, shown by
`megatrain plan`, and a rollout that cannot fit is refused in one line."""

from __future__ import annotations

from dataclasses import replace

from transformers import LlamaConfig

from megatrain import plan as planning
from megatrain.config import TrainConfig
from megatrain.models.config import ModelConfig
from megatrain.planning.footprint import HOST_RESERVE, usable_gpu
from megatrain.planning.placement import Machine
from megatrain.planning.placement import plan as make_placement

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
    assert r["prefill (one layer, every prompt)"] > ROWS * PROMPT * 3 * 2816 * 2
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

    text = planning.report(model_cfg, got, "a GPU", "bfloat16", cfg)
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
