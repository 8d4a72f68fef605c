"""DeepSeek-V2/V3 (latent attention, group-limited routers, dense first layers) against
transformers on the CPU in fp32: logits and every gradient, optimizer steps with accumulation and
clipping, the checkpoint's per-expert tensors and router correction bias in and out, a training
run; and what is refused."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F
from helpers import DEEPSEEK_CONFIGS, tiny_hf_model
from test_moe import _batch, _megatrain, export_round_trip

from megatrain.errors import ConfigError
from megatrain.models.config import ModelConfig
from megatrain.planning.placement import Choices
from megatrain.runtime import build_model

CASES = list(DEEPSEEK_CONFIGS)
BIAS = "model.layers.1.mlp.gate.e_score_correction_bias"


def _hf_step_loss(hf, mbs) -> float:
    """A plain accumulation loop over transformers' model: each micro-batch's token loss over the
    step's label tokens (transformers has no auxiliary loss for these models)."""
    n = sum(mb.num_label_tokens for mb in mbs)
    total = 0.0
    for mb in mbs:
        logits = hf(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits.float()
        loss = F.cross_entropy(
            logits.reshape(-1, logits.shape[-1]),
            mb.shifted_labels.reshape(-1),
            ignore_index=-100,
            reduction="sum",
        )
        (loss / n).backward()
        total += loss.item() / n
    return total


@pytest.mark.parametrize("case", CASES)
def test_logits_and_grads_match_transformers(case, tmp_path):
    hf = tiny_hf_model(case)
    mt = _megatrain(hf, tmp_path, choices=Choices(loss_chunk_tokens=7, keep_layers=1))
    assert mt.engine.layer_keys == ["dense", "moe", "moe"]  # first_k_dense_replace=1
    mbs = [_batch(hf.config.vocab_size, seed=1), _batch(hf.config.vocab_size, seed=2, pad=6)]
    ref_logits = hf(input_ids=mbs[0].input_ids).logits
    torch.testing.assert_close(mt.engine.logits(mbs[0]), ref_logits, rtol=1e-5, atol=1e-5)

    ref_loss = _hf_step_loss(hf, mbs)
    loss, _ = mt.engine.forward_backward(mbs)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)
    grads = mt.engine.named_grads()
    ref = {k: p.grad for k, p in hf.named_parameters()}
    assert set(grads) == set(ref), set(grads) ^ set(ref)  # the correction bias is no parameter
    for k, g in grads.items():
        assert g.abs().sum() > 0, k
        torch.testing.assert_close(g, ref[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
    if case == "v3":  # the router's correction bias changes which experts are chosen
        with torch.no_grad():
            for layer in hf.model.layers[1:]:
                layer.mlp.gate.e_score_correction_bias.zero_()
            assert not torch.allclose(hf(input_ids=mbs[0].input_ids).logits, ref_logits, atol=1e-3)


def test_optimizer_steps_match_plain_accumulation_loop(tmp_path):
    """Three steps of 3 right-padded micro-batches with clipping and weight decay: losses,
    gradient norms and final weights equal a plain loop over transformers' model with
    torch.optim.AdamW; the frozen correction bias is where it started."""
    from test_parity import _decay_groups, steps_against_plain_loop

    from megatrain.engine.optim import AdamWConfig
    from megatrain.runtime import make_plan

    hf = tiny_hf_model("v3")
    adamw = AdamWConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    hf.save_pretrained(tmp_path / "hf")
    cfg = ModelConfig.from_json(tmp_path / "hf")
    plan, _ = make_plan(cfg, "cpu", torch.float32, clip=True, choices=Choices(loss_chunk_tokens=9))
    mt = build_model(cfg, weights=tmp_path / "hf", device="cpu", adamw=adamw, plan=plan)
    opt = torch.optim.AdamW(
        _decay_groups(hf, adamw.weight_decay), lr=adamw.lr, betas=adamw.betas, eps=adamw.eps
    )

    def batches(step):
        return [_batch(hf.config.vocab_size, B=2, S=12 + 4 * m, seed=10 * step + m, pad=m) for m in range(3)]

    final = steps_against_plain_loop(hf, mt, opt, adamw.lr, True, batches, _hf_step_loss)
    for k, p in hf.named_parameters():
        torch.testing.assert_close(final[k], p.detach(), rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    buffers = dict(hf.named_buffers())
    for k in (k for k in final if k.endswith("e_score_correction_bias")):
        assert torch.equal(final[k], buffers[k]) and final[k].abs().sum() > 0, k


def test_checkpoint_keys_load_and_export_round_trip(tmp_path):
    """megatrain reads the per-expert tensors and the router correction bias transformers'
    save_pretrained writes (the Hub's names), and its export loads back into transformers with
    identical logits."""
    keys = export_round_trip(tiny_hf_model("v3"), tmp_path)
    assert "model.layers.2.mlp.experts.7.gate_proj.weight" in keys and BIAS in keys


def test_bfloat16_export_keeps_in_fp32_what_transformers_keeps_in_fp32(tmp_path):
    """transformers keeps some tensors of a bf16 DeepSeek-V3 in fp32 (`_keep_in_fp32_modules_strict`:
    the router's correction bias, and in newer releases its gate weight too), so its bf16 files
    hold them in fp32: megatrain's bf16 export holds exactly the tensors that the installed
    transformers keeps in fp32 when it loads the model in bf16 (the rest in bf16), and
    transformers reads the bias back unrounded."""
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from megatrain.io.weights import save_hf_checkpoint

    hf = tiny_hf_model("v3")
    with torch.no_grad():
        hf.model.layers[1].mlp.gate.e_score_correction_bias += 1 / 3  # not a bf16 number
    mt = _megatrain(hf, tmp_path)
    out = save_hf_checkpoint(mt.state, mt.cfg, tmp_path / "export", dtype=torch.bfloat16, progress=False)
    with safe_open(out / "model.safetensors", "pt") as f:
        dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}  # noqa: SIM118
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    kept = {k for k, t in back.state_dict().items() if t.dtype == torch.float32}
    assert {k for k, d in dtypes.items() if d == "F32"} == kept
    assert {BIAS, BIAS.replace("layers.1", "layers.2")} <= kept  # in every supported release
    assert set(dtypes.values()) == {"F32", "BF16"}
    bias = hf.model.layers[1].mlp.gate.e_score_correction_bias
    with safe_open(out / "model.safetensors", "pt") as f:
        assert torch.equal(f.get_tensor(BIAS), bias)
    assert back.model.layers[1].mlp.experts.down_proj.dtype == torch.bfloat16
    assert torch.equal(back.model.layers[1].mlp.gate.e_score_correction_bias, bias)


def test_parameters_decay_groups_count_and_plan(tmp_path):
    """Parameter names and shapes, the Trainer's weight-decay groups and the parameter count are
    transformers' (the correction bias a frozen tensor beside them); the plan counts the model at
    its expert layers' cost, not its dense first layer's."""
    from test_parity import _hf_decay_names

    from megatrain.host.state import build_units
    from megatrain.planning.placement import Batch, Machine, plan
    from megatrain.planning.planspec import model_shape
    from megatrain.planning.probe import formula_layer_memory, probed_layer

    hf = tiny_hf_model("v3")
    cfg = ModelConfig.from_hf(hf.config)
    specs = [p for u in build_units(cfg) for p in u.params]
    assert {p.key: p.shape for p in specs if p.train} == {k: tuple(v.shape) for k, v in hf.named_parameters()}
    assert {p.key for p in specs if not p.train} == {k for k, _ in hf.named_buffers() if "correction" in k}
    assert {p.key for p in specs if p.decay and p.train} == _hf_decay_names(hf)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    # the probe measures an expert layer; the formula's layer is no cheaper than an all-expert model's
    assert probed_layer(cfg) == 1
    dense = ModelConfig.from_hf(tiny_hf_model("v3", first_k_dense_replace=0).config)
    lm = formula_layer_memory(cfg, 2)
    assert model_shape(cfg, lm).layer == model_shape(dense, lm).layer
    batch = Batch(micro_batch_tokens=64, micro_batches=1, seq_len=32, compute_bytes=4, clip=True, rows=2)
    machine = Machine(device="cpu", gpu_bytes=None, host_bytes=2**34)

    def compute_s(c):  # the step time less the CPU optimizer's share (the dense model has more parameters)
        return plan(c, batch, machine, None).step_time_s - model_shape(c, lm).total / machine.adam_params_s

    assert compute_s(cfg) == pytest.approx(compute_s(dense), rel=1e-9)


def test_latent_attention_width_in_the_memory_formula():
    """Latent attention's per-head tensors (queries and keys wider than the hidden size in
    DeepSeek-V3) enlarge the formula's layer; dense layers first make its MLP at least theirs."""
    from megatrain.planning.probe import formula_layer_memory, token_ffn

    cfg = ModelConfig.from_hf(tiny_hf_model("v3").config)
    plain = ModelConfig.from_hf(tiny_hf_model("qwen3_moe").config)
    per_token = formula_layer_memory(cfg, 2).graph_per_token
    assert per_token > formula_layer_memory(plain, 2).graph_per_token
    assert token_ffn(cfg) == max(cfg.intermediate_size, 2 * 32 + 32)


def test_padded_values_for_the_flash_kernel_change_nothing():
    """On CUDA unmasked rows pad v to the qk width for SDPA's flash kernel: outputs and gradients
    equal the unpadded attention's (checked here with the CPU's kernel)."""
    from megatrain.models.deepseek import attend_latent

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(2, 3, 10, 24, generator=g, requires_grad=True) for _ in range(2))
    v = torch.randn(2, 3, 10, 12, generator=g, requires_grad=True)
    outs = []
    for pad in (False, True):
        y = attend_latent(q, k, v, None, 0.3, pad=pad)
        assert y.shape == (2, 3, 10, 12)
        outs.append((y, *torch.autograd.grad(y.square().sum(), [q, k, v])))
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


def test_cli_plan_train_resume_export_of_a_kimi_k2_config(tmp_path, capsys):
    """`megatrain plan`, `train` (random initialisation: the correction bias zero, as transformers
    initialises it), a resume that ends where the uninterrupted run does, and `export`, for a
    Kimi-K2 config.json: DeepSeek-V3's architecture under its own model type and custom code,
    read as a DeepSeek-V3 and exported as one that transformers loads without that code."""

    from test_checkpoint import assert_bitwise, make_run, metrics, tensors, write_yaml
    from test_cli import run_cli
    from transformers import AutoModelForCausalLM

    raw = tiny_hf_model("v3").config.to_dict()
    kimi = {
        **raw,
        "model_type": "kimi_k2",
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config"},
    }
    run = make_run(tmp_path, n=24, config=kimi)
    # the same learning rates in the 2-step and the 4-step run
    run.update(lr_scheduler_type="constant", warmup_steps=0, max_steps=4, save_steps=2)
    yaml = write_yaml(tmp_path / "run.yaml", run)
    n = ModelConfig.from_json(tmp_path / "model").num_params
    rc, out, _ = run_cli(capsys, "plan", yaml, "device=cuda", "max_gpu_memory=8GiB", "max_host_memory=8GiB")
    assert (
        rc == 0
        and f"model: deepseek_v3, 0.2M parameters ({n:,})" in out
        and "runs on: fast block (deepseek)" in out
    )
    assert "GPU memory at its peak" in out and "\nfits\n" in out and "longest context:" in out

    a, b = tmp_path / "a", tmp_path / "b"
    assert run_cli(capsys, "train", yaml, f"output_dir={a}")[0] == 0
    losses = [r["loss"] for r in metrics(a)]
    assert len(losses) == 4 and losses[-1] < losses[0]
    assert run_cli(capsys, "train", yaml, f"output_dir={b}", "max_steps=2")[0] == 0
    resume = ["resume_from_checkpoint=true", "max_steps=4"]
    assert run_cli(capsys, "train", yaml, f"output_dir={b}", *resume)[0] == 0
    assert [r["loss"] for r in metrics(b)] == losses
    final = tensors(b / "checkpoint-4")
    assert_bitwise(final, tensors(a / "checkpoint-4"))
    assert torch.equal(final[BIAS], torch.zeros(8))

    rc, _, _ = run_cli(capsys, "export", b / "checkpoint-4", tmp_path / "hf", "--dtype", "float32")
    assert rc == 0
    saved = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert saved["model_type"] == "deepseek_v3" and "auto_map" not in saved
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    expert = "model.layers.2.mlp.experts.7.down_proj.weight"
    assert torch.equal(model.model.layers[2].mlp.experts.down_proj[7], final[expert])


# The shapes of DeepSeek-V3's, DeepSeek-R1's and Kimi-K2's chat templates (system prompt first,
# the end of an assistant turn; R1's generation prompt opens a <think> block, so rendering a
# conversation's prefix is not a prefix of the whole).
_DS_TURNS = (
    "{% for m in messages %}{% if m['role'] == 'user' %}{{ '<｜User｜>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<｜Assistant｜>' + m['content'] + '<｜end▁of▁sentence｜>' }}"
    "{% endif %}{% endfor %}"
)
_DS_SYSTEM = "{{ bos_token }}{% for m in messages %}{% if m['role'] == 'system' %}{{ m['content'] }}{% endif %}{% endfor %}"
CHAT_TEMPLATES = {
    "deepseek_v3": (
        _DS_SYSTEM + _DS_TURNS + "{% if add_generation_prompt %}<｜Assistant｜>{% endif %}",
        "<｜end▁of▁sentence｜>",
    ),
    "deepseek_r1": (
        _DS_SYSTEM + _DS_TURNS + "{% if add_generation_prompt %}<｜Assistant｜><think>\n{% endif %}",
        "<｜end▁of▁sentence｜>",
    ),
    "kimi_k2": (
        "{% for m in messages %}<|im_{{ m['role'] }}|>{{ m['role'] }}<|im_middle|>{{ m['content'] }}<|im_end|>"
        "{% endfor %}{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}",
        "<|im_end|>",
    ),
}


@pytest.mark.parametrize("style", CHAT_TEMPLATES)
def test_chat_templates_supervise_each_answer_and_its_end_of_turn(style, tmp_path):
    """Chat data rendered with these templates: the loss is on each assistant answer and the token
    that ends it (the EOS for DeepSeek), and exports stop generating at that token."""
    from helpers import tiny_tokenizer
    from test_data import ASSISTANT, CONV, cfg_for, supervised_spans, write_jsonl

    from megatrain.data import build_samples
    from megatrain.data.chat import end_of_turn_id

    template, eot = CHAT_TEMPLATES[style]
    tok = tiny_tokenizer(None)
    specials = ["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜User｜>", "<｜Assistant｜>"]
    specials += ["<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "<|im_end|>"]
    tok.add_special_tokens({"additional_special_tokens": specials})
    tok.bos_token, tok.eos_token = specials[:2]
    tok.chat_template = template
    (sample,) = build_samples(cfg_for(write_jsonl(tmp_path / "m.jsonl", [{"messages": CONV}])), tok)
    assert supervised_spans(tok, sample) == [c + eot for c in ASSISTANT]
    assert end_of_turn_id(tok) == tok.convert_tokens_to_ids(eot)


@pytest.mark.parametrize(
    "overrides,key",
    [
        (dict(output_router_logits=True), "output_router_logits"),
        (dict(num_key_value_heads=2), "num_key_value_heads"),
        (dict(n_group=3), "n_group"),
        (dict(num_experts_per_tok=6), "num_experts_per_tok"),
        (
            dict(quantization_config={"quant_method": "fp8", "weight_block_size": [128, 128]}),
            "quantization_config",
        ),
    ],
)
def test_what_deepseek_cannot_train_is_refused_by_name(overrides, key, tmp_path):
    raw = {**tiny_hf_model("v3").config.to_dict(), **overrides}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=key) as e:
        ModelConfig.from_json(tmp_path)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(tmp_path / "config.json"))


def test_router_loss_keys_are_refused_for_deepseek():
    """transformers adds no auxiliary loss for DeepSeek: asking for one is refused, not invented."""
    cfg = ModelConfig.from_hf(tiny_hf_model("v3").config)
    assert cfg.with_router(None, None) is cfg and not cfg.with_router(False, None).moe.output_router_logits
    with pytest.raises(ConfigError, match="output_router_logits: transformers' deepseek_v3 has no auxiliary"):
        cfg.with_router(True, None)
