"""Mixture-of-experts families against transformers on the CPU in fp32: logits, the auxiliary
load-balancing loss and every gradient; optimizer steps with accumulation and clipping; the
checkpoint's per-expert tensors in and out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import MOE_CONFIGS, tiny_hf_model

from megatrain.data.batch import MicroBatch
from megatrain.models.config import ModelConfig
from megatrain.planning.placement import Choices
from megatrain.runtime import build_model

FAMILIES = list(MOE_CONFIGS)


def _batch(vocab, B=2, S=20, seed=1, pad=0):
    """Random rows; with `pad`, the first row's last `pad` tokens are right padding."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    if not pad:
        return MicroBatch(ids, labels)
    mask = torch.ones_like(ids)
    ids[0, S - pad :], labels[0, S - pad :], mask[0, S - pad :] = 0, -100, 0
    return MicroBatch(ids, labels, attention_mask=mask)


def _megatrain(hf, tmp_path, **kw):
    hf.save_pretrained(tmp_path / "hf")
    cfg = ModelConfig.from_json(tmp_path / "hf")
    return build_model(cfg, weights=tmp_path / "hf", device="cpu", **kw)


def export_round_trip(hf, tmp_path) -> set[str]:
    """Load transformers' save_pretrained files of `hf` into megatrain, export them back, and
    assert every tensor and the logits of the reloaded model are transformers' exactly; returns
    the saved keys for family-specific checks."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from megatrain.io.weights import save_hf_checkpoint

    mt = _megatrain(hf, tmp_path)
    with safe_open(tmp_path / "hf" / "model.safetensors", "pt") as f:
        source = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    out = save_hf_checkpoint(mt.state, mt.cfg, tmp_path / "export", dtype=torch.float32, progress=False)
    with safe_open(out / "model.safetensors", "pt") as f:
        assert set(f.keys()) == set(source)
        for k, t in source.items():
            assert torch.equal(f.get_tensor(k), t), k
    back = AutoModelForCausalLM.from_pretrained(out, attn_implementation="eager").float().eval()
    ids = _batch(hf.config.vocab_size).input_ids
    torch.testing.assert_close(back(input_ids=ids).logits, hf(input_ids=ids).logits, rtol=0, atol=0)
    return set(source)


def _hf_step_loss(hf, mbs):
    """A plain accumulation loop over transformers' model: each micro-batch's token loss over the
    step's label tokens, plus coef * its own aux loss (the Trainer's rule with num_items_in_batch)."""
    n = sum(mb.num_label_tokens for mb in mbs)
    total, auxes = 0.0, []
    for mb in mbs:
        out = hf(input_ids=mb.input_ids, attention_mask=mb.attention_mask, output_router_logits=True)
        logits = out.logits.float()
        ce = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            mb.shifted_labels.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        loss = ce / n + hf.config.router_aux_loss_coef * out.aux_loss
        loss.backward()
        total += loss.item()
        auxes.append(out.aux_loss.item())
    return total, auxes


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_aux_loss_and_grads_match_transformers(family, tmp_path):
    hf = tiny_hf_model(family)
    mt = _megatrain(hf, tmp_path, choices=Choices(loss_chunk_tokens=7, keep_layers=1))
    # the second micro-batch right-padded: padding is left out of the aux loss, as transformers does
    mbs = [_batch(hf.config.vocab_size, seed=1), _batch(hf.config.vocab_size, seed=2, pad=6)]
    torch.testing.assert_close(
        mt.engine.logits(mbs[0]), hf(input_ids=mbs[0].input_ids).logits, rtol=1e-5, atol=1e-5
    )

    ref_loss, ref_aux = _hf_step_loss(hf, mbs)
    loss, _ = mt.engine.forward_backward(mbs)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)
    aux = [a.item() for a in mt.engine.aux.aux_losses()]
    assert aux == pytest.approx(ref_aux, rel=1e-6)

    grads = mt.engine.named_grads()
    ref = {k: p.grad for k, p in hf.named_parameters()}
    assert set(grads) == set(ref), set(grads) ^ set(ref)
    for k, g in grads.items():
        assert g.abs().sum() > 0, k
        torch.testing.assert_close(g, ref[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


# Each family once, the three ways the plan serves the clip spread over them.
STEP_CASES = [
    ("mixtral", "stored"),
    ("qwen2_moe", "two_pass"),
    ("qwen3_moe", "immediate"),
    ("olmoe", "stored"),
    ("gpt_oss", "two_pass"),
]


@pytest.mark.parametrize("family,mode", STEP_CASES)
def test_optimizer_steps_match_plain_accumulation_loop(family, mode, tmp_path):
    """Three steps of 3 micro-batches with the aux loss on, clipping (but in immediate mode),
    weight decay: losses, gradient norms and final weights equal a plain loop over transformers'
    model with torch.optim.AdamW."""
    from test_parity import _decay_groups, steps_against_plain_loop

    from megatrain.engine.optim import AdamWConfig
    from megatrain.runtime import make_plan

    hf = tiny_hf_model(family)
    adamw = AdamWConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    hf.save_pretrained(tmp_path / "hf")
    cfg = ModelConfig.from_json(tmp_path / "hf")
    clip = mode != "immediate"
    choices = Choices(gradient_placement="two_pass" if mode == "two_pass" else "auto", loss_chunk_tokens=9)
    plan, _ = make_plan(cfg, "cpu", torch.float32, clip=clip, choices=choices)
    assert plan.grad_mode == mode
    mt = build_model(cfg, weights=tmp_path / "hf", device="cpu", adamw=adamw, plan=plan)
    opt = torch.optim.AdamW(
        _decay_groups(hf, adamw.weight_decay), lr=adamw.lr, betas=adamw.betas, eps=adamw.eps
    )

    def batches(step):
        return [_batch(hf.config.vocab_size, B=2, S=12 + 4 * m, seed=10 * step + m, pad=m) for m in range(3)]

    final = steps_against_plain_loop(
        hf, mt, opt, adamw.lr, clip, batches, lambda hf, mbs: _hf_step_loss(hf, mbs)[0]
    )
    for k, p in hf.named_parameters():
        torch.testing.assert_close(final[k], p.detach(), rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    metrics = mt.engine.aux_metrics()
    assert metrics["expert_load_max"] > 1.0 > metrics["expert_load_min"] >= 0.0
    assert metrics["aux_loss"] > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_checkpoint_keys_load_and_export_round_trip(family, tmp_path):
    """megatrain reads the tensors transformers' save_pretrained writes (the Hub's names: one per
    expert, but gpt-oss's fused ones), and its export loads back into transformers with
    identical logits."""
    keys = export_round_trip(tiny_hf_model(family), tmp_path)
    # per-expert tensors, as on the Hub; gpt-oss's files hold each fused tensor whole
    assert any(".experts.3." in k for k in keys) == (family != "gpt_oss")


def test_training_run_logs_router_metrics_and_resumes_exactly(tmp_path):
    """A CLI-style run of an OLMoE from random initialisation: metrics.jsonl carries the aux loss
    and the expert load, and a resume from the step-2 checkpoint (per-expert tensors, per-parameter
    moments) ends bit for bit where the uninterrupted run does."""
    from test_checkpoint import assert_bitwise, make_run, metrics, tensors

    from megatrain.config import TrainConfig
    from megatrain.trainer import train

    base = make_run(tmp_path, n=32, config=tiny_hf_model("olmoe").config)
    # the same learning rates in the 2-step and the 4-step run
    base.update(lr_scheduler_type="constant", warmup_steps=0, max_steps=4, save_steps=2)
    ref = train(TrainConfig(**base, output_dir=str(tmp_path / "a")))
    records = metrics(tmp_path / "a")
    assert all(r["aux_loss"] > 0 and r["expert_load_max"] >= 1.0 >= r["expert_load_min"] for r in records)
    b = tmp_path / "b"
    train(TrainConfig(**{**base, "max_steps": 2}, output_dir=str(b)))
    final = train(TrainConfig(**base, output_dir=str(b), resume_from_checkpoint=str(b / "checkpoint-2")))
    assert [r["loss"] for r in metrics(b)] == [r["loss"] for r in records]
    assert_bitwise(tensors(final), tensors(ref))
    assert any(".experts.7." in k for k in tensors(final))
    # `megatrain export` of a checkpoint: the per-expert tensors transformers loads
    from transformers import AutoModelForCausalLM

    from megatrain.io.weights import export_model

    out, _ = export_model(b / "checkpoint-4", tmp_path / "export", dtype=torch.float32, progress=False)
    assert_bitwise(tensors(out), tensors(final))
    model = AutoModelForCausalLM.from_pretrained(out)
    assert torch.equal(
        model.model.layers[1].mlp.experts.down_proj[7],
        tensors(final)["model.layers.1.mlp.experts.7.down_proj.weight"],
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_parameters_decay_groups_and_count_are_transformers(family):
    """Parameter names and shapes, the Trainer's weight-decay groups, and the parameter count the
    plan uses (experts included) are transformers'."""
    from test_parity import _hf_decay_names

    from megatrain.host.state import build_units

    hf = tiny_hf_model(family)
    cfg = ModelConfig.from_hf(hf.config)
    specs = [p for u in build_units(cfg) for p in u.params]
    assert {p.key: p.shape for p in specs} == {k: tuple(v.shape) for k, v in hf.named_parameters()}
    assert {p.key for p in specs if p.decay} == _hf_decay_names(hf)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())


@pytest.mark.parametrize("family", FAMILIES)
def test_expert_parameter_counts_are_the_templates(family):
    """The counts the plan's step time and FLOP rate use: a layer's expert block (router, experts
    and their biases, shared expert) and the parameters a token is not routed to."""
    from megatrain.models.family import templates

    cfg = ModelConfig.from_hf(tiny_hf_model(family).config)
    spec, h = cfg.moe, cfg.hidden_size
    mlp = templates(cfg)["layers"]["layer"].mlp
    assert spec.layer_params(h) == sum(p.numel() for p in mlp.parameters())
    experts = sum(p.numel() for p in mlp.experts.parameters())
    assert spec.inactive_params(h) * spec.num_experts == experts * (spec.num_experts - spec.top_k)


def test_unsupported_moe_settings_are_refused_by_name():
    from megatrain.errors import ConfigError

    for family, bad, key in [
        ("qwen2_moe", dict(mlp_only_layers=[0]), "mlp_only_layers"),
        ("mixtral", dict(router_jitter_noise=0.1), "router_jitter_noise"),
        ("olmoe", dict(clip_qkv=8.0), "clip_qkv"),
    ]:
        with pytest.raises(ConfigError, match=key):
            ModelConfig.from_hf(tiny_hf_model(family, **bad).config)


def test_router_loss_keys_override_the_model_config(tmp_path):
    """`output_router_logits` / `router_aux_loss_coef` in the training config turn the aux loss on
    and weigh it as transformers' config keys do, and are saved in the model's config; a dense
    model refuses them by name."""
    from megatrain.errors import ConfigError

    hf = tiny_hf_model("qwen3_moe", output_router_logits=False)
    mt = _megatrain(hf, tmp_path)
    mbs = [_batch(hf.config.vocab_size)]
    plain, _ = mt.engine.forward_backward(mbs)
    cfg = mt.cfg.with_router(True, 0.25)
    assert cfg.hf_config.output_router_logits and cfg.hf_config.router_aux_loss_coef == 0.25
    assert not mt.cfg.hf_config.output_router_logits  # the original is left as it was
    with_aux = build_model(cfg, weights=tmp_path / "hf", device="cpu").engine
    loss, _ = with_aux.forward_backward(mbs)
    aux = with_aux.aux.aux_losses()[0]
    assert loss.item() == pytest.approx(plain.item() + 0.25 * aux.item(), rel=1e-6)
    with pytest.raises(ConfigError, match="output_router_logits: llama is not a mixture-of-experts"):
        ModelConfig.from_hf(tiny_hf_model("llama").config).with_router(True, None)


@pytest.mark.parametrize("packing", [False, True])
def test_batches_mark_padding_as_transformers_attention_mask(packing):
    """Right-padded rows (and packed rows' padded tails) carry transformers' attention_mask; a
    micro-batch without padding carries none."""
    from megatrain.data import Batcher
    from megatrain.data.samples import Sample

    samples = [Sample(list(range(1, n + 1)), list(range(1, n + 1)), f"x:{n}") for n in (5, 8, 3, 8)]
    b = Batcher(samples, batch_size=2, grad_accum=2, max_length=8, packing=packing, shuffle=False, pad_id=0)
    for mb in b.next_step():
        real = (mb.input_ids != 0).long()  # the samples' ids are all > 0, the pad id is 0
        if bool(real.all()):
            assert mb.attention_mask is None
        else:
            assert torch.equal(mb.attention_mask, real)
