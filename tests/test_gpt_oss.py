"""gpt-oss beyond the mixture-of-experts tests it shares (test_moe.py: logits, aux loss and every
gradient, optimizer steps, checkpoint keys, parameter counts): attention sinks with sliding and
full layers through both of the engine's attention paths, MXFP4 checkpoints in and plain ones
out, a harmony-style chat template, and a run from the command line. CPU, fp32."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from helpers import fp32_parameters, tiny_config, tiny_hf_model, tiny_tokenizer
from safetensors.torch import load_file, save_file
from test_attention import LOGITS_TOL, _packed, cpu_flex  # noqa: F401 (fixture)
from test_checkpoint import metrics, one_thread, tensors, write_yaml  # noqa: F401 (fixture)
from test_cli import run_cli

from megatrain.data.batch import MicroBatch
from megatrain.errors import ConfigError
from megatrain.host.split import cast
from megatrain.models.config import ModelConfig
from megatrain.models.family import family_of
from megatrain.planning.placement import Choices
from megatrain.runtime import build_model

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.usefixtures("one_thread"),  # tiny models: threads only spin against a busy machine
]

# How the published config.json names its quantised parts.
MXFP4_CONFIG = {
    "quant_method": "mxfp4",
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
}
EXPERT_WEIGHTS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def _each_document_alone(hf, mb: MicroBatch) -> torch.Tensor:
    """transformers' logits of every document of a packed micro-batch, run alone (its gpt-oss
    does not read documents from restarting position_ids), back in the rows' layout."""
    rows = []
    for ids, doc in zip(mb.input_ids, mb.document_ids):
        rows.append(torch.cat([hf(input_ids=ids[doc == d][None]).logits[0] for d in doc.unique()]))
    return torch.stack(rows)


def _grads_match(mt, hf) -> None:
    grads = mt.engine.named_grads()
    for k, p in hf.named_parameters():
        assert grads[k].abs().sum() > 0, k
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("flex", [False, True], ids=["dense", "flex"])
@pytest.mark.parametrize("packed", [False, True], ids=["plain", "packed"])
def test_sinks_and_windows_match_transformers(flex, packed, cpu_flex, tmp_path, monkeypatch):  # noqa: F811
    """Logits, loss and every gradient (the sinks' included) equal transformers' eager attention,
    over 300-token rows (a window of 8 in the sliding layer, the full layer beside it, documents
    crossing FlexAttention's blocks), through the explicit scores the CPU runs and through the
    FlexAttention path CUDA runs (the sinks from its log-sum-exp; here its eager reference)."""
    hf = tiny_hf_model("gpt_oss", output_router_logits=False)
    clamped = []
    apply_gate = transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts._apply_gate

    def recording(self, gate_up):
        clamped.append((gate_up[..., ::2] > self.limit).float().mean().item())
        return apply_gate(self, gate_up)

    monkeypatch.setattr(transformers.models.gpt_oss.modeling_gpt_oss.GptOssExperts, "_apply_gate", recording)
    hf.save_pretrained(tmp_path / "hf")
    cfg = ModelConfig.from_json(tmp_path / "hf")
    mt = build_model(cfg, weights=tmp_path / "hf", device="cpu", choices=Choices(keep_layers=1))
    mt.engine.flex_masks = flex
    if packed:
        mb = _packed(cfg.vocab_size)
    else:
        ids = torch.randint(0, cfg.vocab_size, (2, 300), generator=torch.Generator().manual_seed(4))
        mb = MicroBatch(ids, ids.clone())
    pos = mb.position_ids if packed else torch.arange(300).expand(2, 300)
    kinds = family_of(cfg).inputs(cfg, torch.device("cpu"))(pos, mb.document_ids, 300, torch.float32, flex)
    assert set(kinds) == {"sliding_attention", "full_attention"}
    if flex:  # sinks take FlexAttention's path even for plain rows
        assert all(isinstance(k["mask"], torch.nn.attention.flex_attention.BlockMask) for k in kinds.values())
    logits = _each_document_alone(hf, mb) if packed else hf(input_ids=mb.input_ids).logits
    torch.testing.assert_close(mt.engine.logits(mb), logits, **LOGITS_TOL)
    assert 0.05 < sum(clamped) / len(clamped) < 0.95  # the SwiGLU's clamp cuts some activations

    logits = logits.float()
    ref = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), mb.shifted_labels.reshape(-1), reduction="sum"
    )
    (ref / mb.num_label_tokens).backward()
    loss, _ = mt.engine.forward_backward([mb])
    assert loss.item() == pytest.approx(ref.item() / mb.num_label_tokens, rel=1e-6)
    _grads_match(mt, hf)


# ---------------------------------------------------------------------------- MXFP4
def test_mxfp4_decode_equals_transformers():
    """Every byte and every finite scale: the values transformers' own dequantisation gives, in the
    parameter's layout; bf16 holds each of them exactly."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    from megatrain.models.mxfp4 import decode, decoded_shape

    g = torch.Generator().manual_seed(0)
    blocks = torch.arange(256, dtype=torch.uint8).repeat(2 * 8 * 4 * 16 // 256 + 1)[: 2 * 8 * 4 * 16]
    blocks = blocks[torch.randperm(blocks.numel(), generator=g)].view(2, 8, 4, 16)
    scales = torch.randint(0, 255, (2, 8, 4), dtype=torch.uint8, generator=g)
    scales.view(-1)[:2] = torch.tensor([0, 254], dtype=torch.uint8)  # the extremes
    ours = decode(blocks, scales)
    ref = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert ours.shape == decoded_shape(tuple(blocks.shape)) == (2, 128, 8)
    assert torch.equal(ours, ref)
    assert torch.equal(decode(blocks, scales, torch.bfloat16).float(), ours)
    one = torch.full((1, 1, 1, 16), 0x3A, dtype=torch.uint8)  # nibbles 0xA (-1.0), then 0x3 (+1.5)
    assert decode(one, torch.full((1, 1, 1), 128, dtype=torch.uint8))[0, :2, 0].tolist() == [-2.0, 3.0]


def _mxfp4_checkpoint(path: Path, **overrides) -> tuple[transformers.PreTrainedModel, Path]:
    """A tiny gpt-oss as published: experts as random MXFP4 blocks and scales, the rest as it is,
    config.json with a quantization_config. Returns transformers' model of it, dequantised by
    transformers' own loader."""
    tiny_hf_model("gpt_oss", **overrides).save_pretrained(path)
    sd = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(1)
    for k in [k for k in sd if k.endswith(EXPERT_WEIGHTS)]:
        E, n_in, n_out = sd.pop(k).shape  # stored as the products read them: [E, out, in]
        sd[k + "_blocks"] = torch.randint(0, 256, (E, n_out, n_in // 32, 16), dtype=torch.uint8, generator=g)
        sd[k + "_scales"] = torch.randint(122, 127, (E, n_out, n_in // 32), dtype=torch.uint8, generator=g)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "quantization_config": MXFP4_CONFIG}))
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=torch.float32
    )
    return hf.eval(), path


def test_mxfp4_checkpoint_loads_decoded_and_exports_plain(tmp_path):
    """An MXFP4 checkpoint trains from its decoded experts (transformers' dequantised model's
    logits); checkpoints and exports are plain full-precision tensors under transformers' names,
    with no quantization_config, and load back into transformers."""
    from megatrain.io.weights import export_model, save_hf_checkpoint

    hf, src = _mxfp4_checkpoint(tmp_path / "mxfp4")
    cfg = ModelConfig.from_json(src)
    mt = build_model(cfg, weights=src, device="cpu")
    master = fp32_parameters(mt.state)
    for k, p in hf.named_parameters():
        assert torch.equal(master[k], p.detach()), k
    ids = torch.randint(0, cfg.vocab_size, (2, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(
            mt.engine.logits(MicroBatch(ids, ids)), hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5
        )

    saved = save_hf_checkpoint(mt.state, cfg, tmp_path / "saved", dtype=torch.float32, progress=False)
    exported, _ = export_model(src, tmp_path / "exported", dtype=torch.bfloat16, progress=False)  # from MXFP4
    for out in (saved, exported):
        assert "quantization_config" not in json.loads((out / "config.json").read_text())
        written = tensors(out)
        assert set(written) == set(master)  # the plain layout: no _blocks / _scales
        for k in written:
            assert torch.equal(written[k].float(), cast(master[k], written[k].dtype).float()), k
        back = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        assert torch.equal(
            back.model.layers[1].mlp.experts.down_proj, hf.model.layers[1].mlp.experts.down_proj
        )


def test_other_quantised_checkpoints_are_refused_in_one_line(tmp_path):
    """Their integer tensors would otherwise load as weights, and be exported without the config
    that says how to read them."""
    config = tiny_config("llama").to_dict()
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ConfigError, match=r"config.json: quantization_config: fp8 checkpoints are not supported"
    ):
        ModelConfig.from_json(tmp_path)


# ---------------------------------------------------------------------------- chat and the CLI
# The harmony format's shape, as gpt-oss's template renders it: a channel header opens each
# assistant answer; earlier answers end with <|end|>, the conversation's last one with <|return|>,
# the token generation stops at.
HARMONY_TEMPLATE = (
    "<|start|>system<|message|>You are a helpful assistant.<|end|>"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}"
    "<|start|>assistant<|channel|>final<|message|>{{ m['content'] }}"
    "{% if loop.last and not add_generation_prompt %}<|return|>{% else %}<|end|>{% endif %}"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}"
)
HARMONY_TOKENS = ["<|start|>", "<|message|>", "<|channel|>", "<|end|>", "<|return|>"]


def harmony_tokenizer():
    tok = tiny_tokenizer(None)
    tok.add_special_tokens({"additional_special_tokens": HARMONY_TOKENS})
    tok.chat_template = HARMONY_TEMPLATE
    return tok


def test_harmony_template_trains_the_answers_and_stops_at_return():
    """The last answer is trained with its channel header and <|return|>; an earlier one on its
    content (the history's <|end|> is not what the model emits there); generation stops at
    <|return|>."""
    from megatrain.data.chat import encode_chats, end_of_turn_id

    tok = harmony_tokenizer()
    assert end_of_turn_id(tok) == tok.convert_tokens_to_ids("<|return|>")
    chat = [
        {"role": "user", "content": "hello"},
        {"role": "assistant", "content": "hi there"},
        {"role": "user", "content": "what time"},
        {"role": "assistant", "content": "the same time"},
    ]
    [(ids, labels)] = encode_chats(tok, [("x:1", chat)], train_on_prompt=False)
    trained = tok.decode([i for i, label in zip(ids, labels) if label != -100])
    assert trained == "hi there<|channel|>final<|message|>the same time<|return|>"


def test_cli_trains_an_mxfp4_checkpoint_on_chats_and_exports_it(tmp_path, capsys):
    """`megatrain plan` and `megatrain train` on a published-style gpt-oss (MXFP4 experts, harmony
    chats): the plan names the block, the run logs the router metrics and its loss falls, and the
    exported model loads into transformers, which computes megatrain's logits."""
    _, src = _mxfp4_checkpoint(tmp_path / "model", vocab_size=640)
    harmony_tokenizer().save_pretrained(src)
    rows = [
        [{"role": "user", "content": f"say {w}"}, {"role": "assistant", "content": f"{w} {w} {w}"}]
        for w in ("hello", "water", "house", "world", "sound", "picture", "mother", "answer")
    ]
    (tmp_path / "chats.jsonl").write_text("".join(json.dumps({"messages": r}) + "\n" for r in rows))
    run = dict(
        model_name_or_path=str(src),
        dataset=str(tmp_path / "chats.jsonl"),
        dataset_format="messages",
        max_length=48,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=6,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        save_strategy="no",
        disable_tqdm=True,
        output_dir=str(tmp_path / "out"),
    )
    yaml_path = write_yaml(tmp_path / "run.yaml", run)
    rc, out, err = run_cli(capsys, "plan", yaml_path)
    assert rc == 0 and "runs on: fast block (gpt_oss)" in out, out + err
    rc, out, err = run_cli(capsys, "train", yaml_path)
    assert rc == 0, err
    records = metrics(tmp_path / "out")
    assert len(records) == 6 and records[-1]["loss"] < 0.8 * records[0]["loss"]
    assert all(r["expert_load_max"] >= 1.0 >= r["expert_load_min"] for r in records)

    final = tmp_path / "out" / "final"
    assert json.loads((final / "generation_config.json").read_text())["eos_token_id"][-1] == (
        harmony_tokenizer().convert_tokens_to_ids("<|return|>")
    )
    rc, _, err = run_cli(capsys, "export", final, tmp_path / "hf", "--dtype", "float32")
    assert rc == 0, err
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    mt = build_model(ModelConfig.from_json(final), weights=final, device="cpu")
    ids = torch.randint(0, 640, (1, 30), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        torch.testing.assert_close(
            model(input_ids=ids).logits, mt.engine.logits(MicroBatch(ids, ids)), rtol=1e-5, atol=1e-5
        )


def test_a_config_without_swiglu_alpha_uses_the_published_constant(monkeypatch):
    """transformers releases whose GptOssConfig has no `swiglu_alpha` (their experts hard-code
    1.702) build the block with that constant, the logits of a config that states it."""
    hf = tiny_config("gpt_oss", num_local_experts=4, head_dim=16, sliding_window=8, swiglu_alpha=1.702)
    ids = torch.randint(0, hf.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))

    def logits():
        model = build_model(ModelConfig.from_hf(hf), seed=0, device="cpu", compute_dtype="float32")
        try:
            return model.engine.logits(MicroBatch(ids, ids))
        finally:
            model.close()

    stated = logits()
    monkeypatch.delattr(type(hf), "swiglu_alpha", raising=False)
    monkeypatch.delitem(vars(hf), "swiglu_alpha", raising=False)
    assert not hasattr(hf, "swiglu_alpha")
    torch.testing.assert_close(logits(), stated, rtol=0, atol=0)
