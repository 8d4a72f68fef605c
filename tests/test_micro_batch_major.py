"""The micro-batch-major update (`update_order: micro_batch`: each micro-batch's forward, loss and
backward through every layer in turn, every layer's graph kept) against the layer-major one on the
CPU in fp32: the same losses, every gradient, the norms and the weights after AdamW steps with
clipping and accumulation, bit for bit, for cross-entropy (tied, mixture of experts with its aux
loss, a vision-language model with DeepStack), GRPO and DPO; and the plan: where it takes it, what
it counts, what it refuses."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from helpers import fp32_parameters, tiny_config, tiny_hf_model
from safetensors.torch import load_file
from test_grpo import settings as grpo_settings
from test_grpo import setup  # noqa: F401 (fixture)
from test_preference_training import model as pair_model
from test_preference_training import pairs, write_pairs
from test_preference_training import run as pair_run

from megatrain.config import TrainConfig
from megatrain.data.batch import MicroBatch
from megatrain.engine.optim import AdamWConfig
from megatrain.errors import ConfigError
from megatrain.models.config import ModelConfig
from megatrain.objectives.grpo import GRPO, GRPOConfig
from megatrain.parallel.layout import Layout
from megatrain.plan import check, rollout_memory
from megatrain.planning import costmodel, footprint, placement
from megatrain.planning.placement import Batch, Choices, Machine, Plan, PlanError
from megatrain.planning.planspec import model_shape
from megatrain.planning.probe import formula_layer_memory
from megatrain.runtime import build_model, make_plan
from megatrain.trainer import train

GiB = 2**30
ADAMW = AdamWConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
MAX_NORM = 0.5


def _steps(hf, tmp_path, order: str, mode: str, batches, objective=None, cfg_of=None, steps=3):
    """`steps` optimizer steps of megatrain on `hf`'s weights in update order `order`: per step the
    loss, the gradient norm and (stored mode) every gradient; then the final weights (which the
    steps moved)."""
    hf.save_pretrained(tmp_path / "hf")
    cfg = ModelConfig.from_json(tmp_path / "hf")
    cfg = cfg_of(cfg) if cfg_of else cfg
    clip = mode == "stored"
    choices = Choices(loss_chunk_tokens=9, update_order=order)
    plan, _ = make_plan(cfg, "cpu", torch.float32, clip=clip, choices=choices)
    assert plan.grad_mode == mode and plan.update_order == order
    mt = build_model(cfg, weights=tmp_path / "hf", device="cpu", adamw=ADAMW, plan=plan, objective=objective)
    losses, norms, grads = [], [], []
    start = fp32_parameters(mt.state)
    for step in range(steps):
        loss, _ = mt.engine.forward_backward(batches(step))
        if clip:
            grads.append({k: g.clone() for k, g in mt.engine.named_grads().items()})
        norm, coef = mt.engine.clip_grad_norm(MAX_NORM if clip else 0.0)
        measured = mt.engine.step(2e-3 if step else 1e-3, coef)
        losses.append(loss.item())
        norms.append((norm if clip else measured).item())
    final = fp32_parameters(mt.state)
    assert any(not torch.equal(final[k], start[k]) for k in start)  # it trained
    return losses, norms, grads, final


def _assert_same_bits(layer, micro):
    (l0, n0, g0, w0), (l1, n1, g1, w1) = layer, micro
    assert l0 == l1 and n0 == n1, (l0, l1, n0, n1)
    for a, b in zip(g0, g1):
        assert a.keys() == b.keys()
        for k in a:
            assert torch.equal(a[k], b[k]), f"{k}: gradients {float((a[k] - b[k]).abs().max()):.3g} apart"
    for k in w0:
        assert torch.equal(w0[k], w1[k]), f"{k}: weights {float((w0[k] - w1[k]).abs().max()):.3g} apart"


def _text_batches(vocab: int, lengths=(12, 16, 20)):
    def batches(step):
        out = []
        for m, S in enumerate(lengths):
            g = torch.Generator().manual_seed(10 * step + m)
            ids = torch.randint(0, vocab, (2, S), generator=g)
            labels = ids.clone()
            labels[:, :3] = -100
            out.append(MicroBatch(ids, labels))
        return out

    return batches


CE_CASES = [
    ("llama", False, "stored"),
    ("llama", True, "immediate"),  # the tied head's share of the embedding's gradient
    ("qwen3", True, "stored"),
    ("qwen2_moe", False, "stored"),  # routing's aux loss: each micro-batch's, from its own forward
]


@pytest.mark.parametrize("family,tied,mode", CE_CASES)
def test_cross_entropy_steps_are_the_layer_major_ones_bit_for_bit(family, tied, mode, tmp_path):
    """Three steps of three micro-batches of different lengths, clipping at 0.5 (but in immediate
    mode), weight decay: the losses, the norms, every gradient and the final weights are the
    layer-major schedule's (which recomputes every layer), bit for bit."""
    hf = tiny_hf_model(family, tied)
    batches = _text_batches(hf.config.vocab_size)
    layer = _steps(hf, tmp_path, "layer", mode, batches)
    micro = _steps(hf, tmp_path, "micro_batch", mode, batches)
    _assert_same_bits(layer, micro)
    if mode == "stored":
        assert max(layer[1]) > MAX_NORM  # the clip acted


def test_a_vision_language_models_steps_are_the_layer_major_ones_bit_for_bit(tmp_path):
    """Qwen3-VL, its tower and projector trained: the image features over the image tokens and the
    DeepStack features added to the first layers' outputs, differentiated once every micro-batch
    is done (the embedding fetched again), as the layer-major sweep does: the same bits."""
    from vision_helpers import tiny_vlm, vlm_batch

    kind = "qwen3_vl"

    def batches(step):
        return [vlm_batch(kind, seed=10 * step + m, starts=[3 + 7 * m, 11]) for m in range(2)]

    def trained(cfg):
        return cfg.with_vision(False, False)

    hf = tiny_vlm(kind, num_hidden_layers=2)
    layer = _steps(hf, tmp_path, "layer", "stored", batches, cfg_of=trained)
    micro = _steps(hf, tmp_path, "micro_batch", "stored", batches, cfg_of=trained)
    _assert_same_bits(layer, micro)
    assert any("deepstack_merger_list" in k and g.abs().sum() > 0 for k, g in micro[2][0].items())


def _grpo_batches(vocab: int, rows: int = 2):
    """Micro-batches of prompt + completion rows of different lengths, each row's advantage, the
    step's completion tokens (dapo's divisor) and stored log-probs of the sampling and reference
    policies (far enough from the policy's that the clip and the off-policy mask act)."""

    def batches(step):
        out = []
        for m, S in enumerate((10, 14, 12)):
            g = torch.Generator().manual_seed(100 * step + m)
            ids = torch.randint(0, vocab, (rows, S), generator=g)
            labels = ids.clone()
            labels[:, :4] = -100  # the prompt
            labels[0, S - 2 :] = -100  # a shorter completion, padded
            adv = torch.randn(rows, generator=g, dtype=torch.float64)
            extra = torch.stack([adv, torch.full((rows,), 40.0, dtype=torch.float64)], 1)
            token_extra = -3 * torch.rand(rows, S, 2, generator=g) - 2
            out.append(MicroBatch(ids, labels, extra=extra, token_extra=token_extra))
        return out

    return batches


@pytest.mark.parametrize("loss_type", ["dapo", "grpo"])
def test_grpo_steps_are_the_layer_major_ones_bit_for_bit(loss_type, tmp_path):
    """GRPO's loss (clipped ratios against stored log-probs, the KL term, TRL's off-policy mask,
    each taking a forward of the head first), one micro-batch at a time: its losses, norms,
    gradients, weights and metrics are one call's over the step, bit for bit."""
    cfg = GRPOConfig(num_generations=2, beta=0.04, num_iterations=2, per_device_train_batch_size=2,
                     gradient_accumulation_steps=3, off_policy_mask_threshold=0.05, loss_type=loss_type,
                     epsilon=0.1)  # fmt: skip
    assert cfg.needs_old_logps and cfg.couples_micro_batches == ""
    hf = tiny_hf_model("llama")
    batches = _grpo_batches(hf.config.vocab_size)
    runs, metrics = [], []
    for order in ("layer", "micro_batch"):
        objective = GRPO(cfg, micro_batches=3)
        runs.append(_steps(hf, tmp_path, order, "stored", batches, objective=objective))
        metrics.append(objective.take_metrics())
    _assert_same_bits(*runs)
    assert metrics[0] == metrics[1] and metrics[0]["clip_ratio/region_mean"][1]
    assert any(v > 0 for v in metrics[0]["clip_ratio/region_mean"][1])  # the clip bound somewhere


def test_an_objective_that_couples_the_micro_batches_keeps_the_layer_major_update(tmp_path):
    """A stale generation batch trained within its step takes TRL's sampler metrics over the whole
    step: the engine refuses a micro-batch-major plan for it, and the plan keeps it layer-major."""
    cfg = GRPOConfig(num_generations=2, max_staleness=1, per_device_train_batch_size=2,
                     gradient_accumulation_steps=3)  # fmt: skip
    why = GRPO(cfg, micro_batches=3).coupled
    assert why == cfg.couples_micro_batches and "max_staleness" in why
    hf = tiny_hf_model("llama")
    hf.save_pretrained(tmp_path / "hf")
    model_cfg = ModelConfig.from_json(tmp_path / "hf")
    plan, _ = make_plan(model_cfg, "cpu", torch.float32, choices=Choices(update_order="micro_batch"))
    with pytest.raises(ValueError, match="max_staleness"):
        build_model(model_cfg, weights=tmp_path / "hf", plan=plan, objective=GRPO(cfg, micro_batches=3))
    batch = Batch(3072, 16, 384, 2, clip=True, rows=8, coupled=why)
    p = placement.plan(A, batch, Machine("cuda", 139 * GiB, 1000 * GiB))
    assert p.update_order == "layer" and any(f"micro-batch-major: {why}" in n for n in p.notes)


# ---------------------------------------------------------------------------- whole runs
def _records(out) -> list[dict]:
    """A run's step records without what a clock measures."""
    timed = ("time", "per_s", "eta")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not any(t in k for t in timed)} for r in rows if "loss" in r]


def _same_runs(outs: dict) -> None:
    """Two runs' step records and final weights are equal, and the second's plan names its order."""
    assert _records(outs["layer"]) == _records(outs["micro_batch"])
    w0, w1 = (load_file(outs[o] / "final" / "model.safetensors") for o in ("layer", "micro_batch"))
    assert w0.keys() == w1.keys() and all(torch.equal(w0[k], w1[k]) for k in w0)
    plan = json.loads((outs["micro_batch"] / "plan.json").read_text())["plan"]
    assert plan["update_order"] == "micro_batch"
    assert any("update order: micro-batch-major" in n for n in plan["notes"])


def test_a_grpo_run_trains_as_the_layer_major_one_bit_for_bit(setup):  # noqa: F811 (the fixture)
    """`megatrain train` with stage grpo: completions sampled from the policy each step, a KL term;
    the step records (loss, grad_norm, rewards, TRL's metrics) and the final weights with
    update_order micro_batch are layer's, and its plan.json names the order."""
    tmp, _ = setup
    outs = {o: tmp / o for o in ("layer", "micro_batch")}
    for order, out in outs.items():
        train(TrainConfig(**grpo_settings(tmp, output_dir=str(out), beta=0.04, update_order=order)))
    _same_runs(outs)


def test_a_dpo_run_trains_as_the_layer_major_one_bit_for_bit(tmp_path):
    """`megatrain train` with stage dpo (pairs of varied lengths, the reference pass first): the
    step records and final weights with update_order micro_batch are layer's."""
    pair_model().save_pretrained(tmp_path / "model")
    data = write_pairs(tmp_path / "pairs.jsonl", pairs())
    outs = {}
    for order in ("layer", "micro_batch"):
        outs[order] = pair_run(tmp_path, data, name=order, stage="dpo", update_order=order)[2]
    _same_runs(outs)


# ---------------------------------------------------------------------------- the plan
def _llama(hidden, layers, heads, kv, ffn, vocab=128256) -> ModelConfig:
    return ModelConfig.from_hf(
        tiny_config("llama", hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                    num_key_value_heads=kv, intermediate_size=ffn, vocab_size=vocab)
    )  # fmt: skip


A = _llama(3072, 28, 24, 8, 8192)  # 3.61B
STEP = Batch(micro_batch_tokens=4096, micro_batches=16, seq_len=4096, compute_bytes=2, clip=True, rows=1)


def _cuda(gpu_gib) -> Machine:
    return Machine("cuda", int(gpu_gib * GiB), 1000 * GiB)


def test_the_plan_takes_it_where_every_unit_is_resident_and_its_graphs_fit():
    """3.6B at 16 micro-batches of 4,096 tokens on a 139 GiB card: every unit resident, every
    layer's graph of a micro-batch kept (no recompute), faster by the cost model than the best
    layer-major plan, within the budget, the choice named; on a 70 GiB card the state alone does
    not fit beside the graphs, and the plan stays layer-major, saying what it would need."""
    p = placement.plan(A, STEP, _cuda(139))
    layer = placement.plan(A, STEP, _cuda(139), Choices(update_order="layer"))
    n = len(model_shape(A, formula_layer_memory(A, 2)).units)
    assert p.update_order == "micro_batch" and p.resident_units == n and p.keep_layers == 0
    assert layer.update_order == "layer" and layer.keep_layers < 28  # it recomputes some layers
    assert p.step_time_s < layer.step_time_s
    assert p.gpu_peak <= footprint.usable_gpu(_cuda(139))
    note = next(x for x in p.notes if x.startswith("update order"))
    assert "micro-batch-major" in note and f"{layer.step_time_s:.2f}" in note
    assert Plan.from_json(p.to_json()).update_order == "micro_batch"  # plan.json names it
    small = placement.plan(A, STEP, _cuda(70))
    assert small.update_order == "layer"
    assert any("micro-batch-major" in x and "would need" in x for x in small.notes)
    one = placement.plan(A, replace(STEP, micro_batches=1), _cuda(139))
    assert one.update_order == "layer" and one.keep_layers == 28  # one micro-batch: the same step


def test_the_footprint_counts_one_micro_batchs_graphs_of_every_layer():
    """At the micro-batch-major step's peak: every layer's graph of one micro-batch (and its
    output), one layer boundary's worth of hidden states (every micro-batch's first ones or their
    gradients), every unit's fp32 gradient and the layers' weights bound for the step; the
    layer-major step with no graph kept holds every layer's boundary activations instead."""
    s = model_shape(A, formula_layer_memory(A, 2))
    p = placement.plan(A, STEP, _cuda(139))
    Tm, h, L, M = STEP.micro_batch_tokens, s.hidden, s.layers, STEP.micro_batches
    act = Tm * h * 2
    assert p.gpu["kept graphs (one micro-batch)"] == L * (s.layer_mem.graph(Tm) + act)
    assert p.gpu["boundary activations (first hidden states, their gradients)"] == M * act
    assert p.gpu["layer weights (bound for the step)"] == 2 * sum(s.units[1:-1])
    assert p.gpu["gradients"] >= 4 * sum(s.units[1:])  # the embedding's is made at the end
    assert max(footprint.phase_peaks(A, STEP, p).values()) == p.gpu_peak
    layer = replace(p, update_order="layer")  # the same placement, every layer recomputed
    head = next(ph for ph in footprint._phases(s, STEP, layer) if ph.name == "head")
    assert head.rest["boundary activations"] == L * M * act


def test_the_cost_model_counts_no_recompute():
    """Every unit resident, GPU-bound: the micro-batch-major step costs what the layer-major one
    keeping every layer's graph costs (neither recomputes), and one forward of every layer less
    than the layer-major one recomputing them all."""
    s = model_shape(A, formula_layer_memory(A, 2))
    m = _cuda(139)
    n = len(s.units)
    base = Plan("cuda", "stored", n, n, 0, 0, 1024)
    micro = costmodel.step_time(s, STEP, replace(base, update_order="micro_batch"), m)
    kept = costmodel.step_time(s, STEP, replace(base, keep_layers=s.layers), m)
    recomputed = costmodel.step_time(s, STEP, base, m)
    F = costmodel.GPU_FLOPS["cuda"]
    attn = 2 * STEP.tokens * STEP.seq_len * s.q_dim
    layer_fwd = 2 * s.layer * STEP.tokens / F + attn / F
    assert micro == pytest.approx(kept, rel=1e-12)
    assert recomputed - micro == pytest.approx(s.layers * layer_fwd, rel=1e-9)


def test_the_plan_refuses_what_is_not_the_layer_major_steps_arithmetic():
    """Forced where it cannot be: a one-line ConfigError naming why; where it does not fit, a
    PlanError; auto leaves a two-pass or multi-process step layer-major and says why."""
    with pytest.raises(ConfigError, match="update_order: micro_batch: .*gpu_state: off"):
        placement.plan(A, STEP, _cuda(139), Choices(gpu_state="off", update_order="micro_batch"))
    with pytest.raises(ConfigError, match="two-pass"):
        placement.plan(
            A, STEP, _cuda(139), Choices(gradient_placement="two_pass", update_order="micro_batch")
        )
    with pytest.raises(PlanError, match="update_order: micro_batch"):
        placement.plan(A, STEP, _cuda(70), Choices(update_order="micro_batch"))
    two = placement.plan(A, STEP, _cuda(139), Choices(gradient_placement="two_pass"))
    assert two.update_order == "layer" and any("keeps no graphs" in x for x in two.notes)
    world = replace(_cuda(139), world=Layout(ranks=2))
    two_ranks = placement.plan(A, STEP, world)
    assert two_ranks.update_order == "layer" and any("one process" in x for x in two_ranks.notes)
    with pytest.raises(ConfigError, match="update_order"):
        TrainConfig(model_config="x", dataset="y", update_order="sideways")


def test_grpos_update_is_planned_micro_batch_major_in_the_gpu_less_the_rollout():
    """stage grpo: the update's plan is made in the GPU less the rollout's room (plan.py): micro-
    batch-major where its graphs fit there, not where they would fit only the whole card."""
    args = dict(model_config="unread", dataset="unread.jsonl", stage="grpo",
                reward_funcs=["length"], num_generations=8, max_prompt_length=128, max_completion_length=256,
                per_device_train_batch_size=8, gradient_accumulation_steps=16)  # fmt: skip
    cfg = TrainConfig(**args)
    room = sum(rollout_memory(cfg, A, 2).values())
    roomy = check(A, cfg, _cuda(139), 2)
    assert roomy.fits and roomy.plan.update_order == "micro_batch"
    peak = roomy.plan.gpu_peak
    # a card whose whole holds that step, but not beside the rollout's room
    card = Machine("cuda", int(peak / (1 - footprint.GPU_RESERVE)) + 2 * GiB, 1000 * GiB)
    assert (
        footprint.usable_gpu(card)
        >= peak
        > footprint.usable_gpu(replace(card, gpu_bytes=card.gpu_bytes - room))
    )
    tight = check(A, cfg, card, 2)
    assert tight.fits and tight.plan.update_order == "layer"
    assert any("micro-batch-major" in x and "would need" in x for x in tight.plan.notes)
