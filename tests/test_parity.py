"""megatrain against Hugging Face transformers on the CPU in fp32: logits, every gradient, and
several optimizer steps with accumulation, clipping and weight decay."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from helpers import FAMILY_OVERRIDES, fp32_parameters, saved_parameters, tiny_hf_model

from megatrain.data.batch import MicroBatch
from megatrain.engine.optim import AdamWConfig
from megatrain.engine.schedule import SCHEDULES, lr_at
from megatrain.host.state import build_units
from megatrain.models.config import ModelConfig
from megatrain.planning.placement import Choices
from megatrain.runtime import build_model, make_plan

# Llama 3.1's RoPE scaling with an original context shorter than the test sequences' positions
# matter for: the low frequencies are divided by `factor`, the middle band interpolated.
LLAMA3_ROPE = dict(
    rope_scaling={
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    rope_theta=500000.0,
)
CASES = [
    ("llama", False, {}),
    ("llama", True, {}),
    ("llama", False, LLAMA3_ROPE),
    ("llama", False, {"attention_bias": True}),  # bias on q, k, v and o
    ("llama", False, {"pad_token_id": 0}),  # the padding row gets no gradient (every batch has 0s)
    ("qwen3", False, {"attention_bias": True}),  # bias on q, k, v and o, as for Llama
    ("phi3", False, {"partial_rotary_factor": 0.5, "sliding_window": 8}),  # Phi-4-mini's rotary
    ("cohere", True, {"use_qk_norm": True}),  # per-head q/k LayerNorms
    (
        "llama",
        False,
        {"rope_scaling": {"rope_type": "dynamic", "factor": 2.0}, "max_position_embeddings": 12},
    ),
    ("mistral", False, {}),
    ("qwen2", False, {}),
    ("qwen2", True, {}),
    ("qwen3", False, {}),
    ("qwen3", True, {}),
    # Fast blocks where they exist, else transformers' own modules (the generic path).
    *[(f, tied, {}) for f in FAMILY_OVERRIDES for tied in (False, True) if (f, tied) != ("phi", True)],
]
CASE_IDS = [
    "llama",
    "llama-tied",
    "llama3-rope",
    "llama-attention-bias",
    "llama-pad-row",
    "qwen3-attention-bias",
    "phi3-partial-rotary-window",
    "cohere-qk-norm",
    "llama-dynamic-rope",  # frequencies that change with the length: transformers' rotary module
    "mistral",
    "qwen2",
    "qwen2-tied",
    "qwen3",
    "qwen3-tied",
    *[f"{f}{'-tied' if tied else ''}" for f, tied, _ in CASES[14:]],
]


def _megatrain(hf_model, tmp_path, **kw):
    hf_model.save_pretrained(tmp_path / "hf")
    cfg = ModelConfig.from_json(tmp_path / "hf")
    return build_model(cfg, weights=tmp_path / "hf", device="cpu", **kw)


def _batch(vocab, B=2, S=20, seed=1, ignore_prefix=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    ids[:, S // 2] = 0  # token 0 is some families' padding row
    labels = ids.clone()
    labels[:, :ignore_prefix] = -100
    return MicroBatch(ids, labels)


def _hf_loss_sum(model, mb):
    logits = model(input_ids=mb.input_ids).logits.float()
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        mb.shifted_labels.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


@pytest.mark.parametrize("family,tied,overrides", CASES, ids=CASE_IDS)
def test_logits_and_grads_match_transformers(family, tied, overrides, tmp_path):
    hf = tiny_hf_model(family, tied, attn_implementation="same", **overrides)
    # Loss chunks that do not divide the batch; the last layer's graph kept, the others recomputed.
    _check_parity(hf, _megatrain(hf, tmp_path, choices=Choices(loss_chunk_tokens=7, keep_layers=1)))


TILED = [
    ("llama", False, {}),
    ("llama", True, {"mlp_bias": True}),  # biases on gate, up and down
    ("qwen2", True, {}),
    ("mistral", False, {}),
]


@pytest.mark.parametrize(
    "family,tied,overrides", TILED, ids=["llama", "llama-mlp-bias", "qwen2-tied", "mistral"]
)
def test_tiled_mlp_matches_transformers(family, tied, overrides, tmp_path, monkeypatch):
    """The MLP over tiles of 7 tokens (not dividing the 40 of a micro-batch): logits and every
    gradient as transformers computes them, in the kept layer's graph and in the recomputed ones."""
    from megatrain.models import decoder

    tiles = []
    apply = decoder._TiledMLP.apply
    monkeypatch.setattr(decoder._TiledMLP, "apply", lambda x, t, *w: tiles.append(t) or apply(x, t, *w))
    hf = tiny_hf_model(family, tied, **overrides)
    mt = _megatrain(hf, tmp_path, choices=Choices(loss_chunk_tokens=7, keep_layers=1, mlp_tile_tokens=7))
    assert mt.plan.mlp_tile_tokens == 7
    _check_parity(hf, mt)
    assert tiles and set(tiles) == {7}


@pytest.mark.parametrize(
    "tied,overrides", [(False, {"pad_token_id": 0}), (True, {})], ids=["pad-row", "tied"]
)
def test_embedding_gradient_in_token_chunks_matches_transformers(tied, overrides, tmp_path, monkeypatch):
    """The embedding's gradient is scattered a chunk of tokens at a time (5 here, not dividing the
    40 of a micro-batch), so its fp32 temporaries are a chunk's, not the sequence's: every
    gradient still as transformers computes it (the padding row's none, a tied head's share)."""
    from megatrain.engine import engine

    rows = []
    index_add = torch.Tensor.index_add_

    def recording(self, dim, index, source, *a, **kw):
        rows.append(source.shape[0])
        return index_add(self, dim, index, source, *a, **kw)

    monkeypatch.setattr(engine, "EMBED_GRAD_ROWS", 5)
    monkeypatch.setattr(torch.Tensor, "index_add_", recording)
    hf = tiny_hf_model("llama", tied, attn_implementation="same", **overrides)
    _check_parity(hf, _megatrain(hf, tmp_path, choices=Choices(loss_chunk_tokens=7)))
    assert rows and max(rows) == 5


def _check_parity(hf, mt) -> None:
    """Logits of one micro-batch, then the loss and every gradient of two, against transformers."""
    mbs = [_batch(hf.config.vocab_size, seed=s) for s in (1, 2)]

    ref_logits = hf(input_ids=mbs[0].input_ids).logits
    torch.testing.assert_close(mt.engine.logits(mbs[0]), ref_logits, rtol=1e-5, atol=1e-5)

    n = sum(mb.num_label_tokens for mb in mbs)
    ref_loss = 0.0
    for mb in mbs:
        loss = _hf_loss_sum(hf, mb) / n
        loss.backward()
        ref_loss += loss.item()
    loss, n_tok = mt.engine.forward_backward(mbs)
    assert n_tok == n
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)

    grads = mt.engine.named_grads()
    ref = {k: p.grad for k, p in saved_parameters(hf).items()}
    assert set(grads) == set(ref), set(grads) ^ set(ref)
    for k, g in grads.items():
        assert g.abs().sum() > 0, k
        torch.testing.assert_close(g, ref[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def _hf_decay_names(model) -> set[str]:
    """The parameters Hugging Face's Trainer applies weight decay to (its own rule: not biases,
    not norms, not LayerNorm modules), among the model's distinct parameters."""
    from transformers import Trainer

    # An instance method that does not use the instance: no Trainer (and no dataset) needed.
    return set(Trainer.get_decay_parameter_names(None, model)) & dict(model.named_parameters()).keys()


def _decay_groups(model, wd):
    decay = _hf_decay_names(model)
    return [
        {"params": [p for n, p in model.named_parameters() if n in decay], "weight_decay": wd},
        {"params": [p for n, p in model.named_parameters() if n not in decay], "weight_decay": 0.0},
    ]


@pytest.mark.parametrize("family,tied,overrides", CASES, ids=CASE_IDS)
def test_weight_decay_groups_are_hugging_faces(family, tied, overrides):
    hf = tiny_hf_model(family, tied, **overrides)
    specs = [p for u in build_units(ModelConfig.from_hf(hf.config)) for p in u.params]
    module_name = {id(p): n for n, p in hf.named_parameters()}
    saved = {k: module_name[id(p)] for k, p in saved_parameters(hf).items()}
    assert {p.key for p in specs} == saved.keys()
    no_decay = {p.key for p in specs if not p.decay}
    assert {saved[p.key] for p in specs if p.decay} == _hf_decay_names(hf), no_decay
    assert any("norm" in k for k in no_decay)  # the rule is not vacuous here


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("warmup", [0, 3, 12])
def test_lr_schedules_match_transformers(schedule, warmup):
    """Every step's learning rate equals what transformers' scheduler gives (warmup 12 is longer
    than the 10-step run)."""
    from transformers import get_scheduler

    total, base = 10, 0.5
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=base)
    sched = get_scheduler(schedule, opt, num_warmup_steps=warmup, num_training_steps=total)
    for step in range(total):
        assert lr_at(step, base, schedule, warmup, total) == pytest.approx(
            sched.get_last_lr()[0], abs=1e-12
        ), step
        opt.step()
        sched.step()


# Every way the plan can serve the clip: gradients held until the norm is known (stored), a
# norm-only backward then a stepping one (two_pass), and no clipping, each unit stepped as its
# gradient lands (immediate).
# The MLP tiled (5 tokens a tile) in each mode too.
MODES = [
    ("llama", False, "stored", 0),
    ("qwen2", True, "stored", 0),
    ("qwen2", True, "stored", 5),
    ("llama", False, "two_pass", 0),
    ("qwen2", True, "two_pass", 0),
    ("llama", False, "two_pass", 5),
    ("llama", False, "immediate", 0),
    ("qwen3", True, "immediate", 0),
    ("qwen3", True, "immediate", 5),
    # one per fast block, and the generic path (Granite, StableLM) in two modes
    ("gemma2", True, "stored", 0),
    ("phi3", False, "stored", 0),
    ("olmo2", False, "immediate", 0),
    ("cohere", True, "stored", 0),
    ("granite", False, "stored", 0),
    # (not GPT-NeoX: the key bias of its unrotated head dimensions has a zero gradient, whose
    # rounding noise AdamW normalises into steps of full size)
    ("stablelm", False, "two_pass", 0),
]


@pytest.mark.parametrize("family,tied,mode,tile", MODES)
def test_optimizer_steps_match_plain_pytorch_loop(family, tied, mode, tile, tmp_path):
    """Three steps, 3 micro-batches each, clipping active (but in immediate mode), weight decay,
    warmup + cosine: losses, gradient norms and final weights equal a plain PyTorch loop."""
    hf = tiny_hf_model(family, tied, attn_implementation="same")
    adamw = AdamWConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    hf.save_pretrained(tmp_path / "hf")
    cfg = ModelConfig.from_json(tmp_path / "hf")
    clip = mode != "immediate"
    choices = Choices(
        gradient_placement="two_pass" if mode == "two_pass" else "auto",
        loss_chunk_tokens=9,
        mlp_tile_tokens=tile,
    )
    plan, _ = make_plan(cfg, "cpu", torch.float32, clip=clip, choices=choices)
    assert plan.grad_mode == mode and plan.mlp_tile_tokens == tile
    mt = build_model(cfg, weights=tmp_path / "hf", device="cpu", adamw=adamw, plan=plan)
    opt = torch.optim.AdamW(
        _decay_groups(hf, adamw.weight_decay), lr=adamw.lr, betas=adamw.betas, eps=adamw.eps, fused=True
    )

    def reference_loss(hf, mbs):
        n = sum(mb.num_label_tokens for mb in mbs)
        return sum(_backward(hf, mb, n) for mb in mbs)

    def batches(step):
        return [_batch(hf.config.vocab_size, B=2, S=12 + 4 * m, seed=10 * step + m) for m in range(3)]

    final = steps_against_plain_loop(hf, mt, opt, adamw.lr, clip, batches, reference_loss)
    for k, p in saved_parameters(hf).items():
        torch.testing.assert_close(final[k], p.detach(), rtol=1e-4, atol=1e-5, msg=lambda m, k=k: f"{k}: {m}")
    # and the step changed the weights at all
    first = next(k for k in final if ".layers.0." in k and k.endswith("weight") and "norm" not in k)
    assert not torch.equal(final[first], saved_parameters(tiny_hf_model(family, tied))[first])


def steps_against_plain_loop(hf, mt, opt, lr0: float, clip: bool, batches, reference_loss, steps: int = 3):
    """`steps` optimizer steps of megatrain (`mt`) and of a plain loop over the transformers model
    `hf` with `opt` (torch AdamW), warmup + cosine, clipping at 0.5 unless `clip` is off:
    `batches(step)` gives a step's micro-batches, `reference_loss(hf, mbs)` runs the reference's
    backward and returns its loss. Losses and gradient norms must agree at every step; returns
    megatrain's final parameters by checkpoint key."""
    max_norm, clipped = (0.5 if clip else 0.0), 0
    for step in range(steps):
        mbs = batches(step)
        lr = lr_at(step, lr0, "cosine", warmup_steps=1, total_steps=steps)
        ref_loss = reference_loss(hf, mbs)
        ref_norm = torch.nn.utils.clip_grad_norm_(hf.parameters(), max_norm if clip else math.inf)
        for gr in opt.param_groups:
            gr["lr"] = lr
        opt.step()
        opt.zero_grad()
        loss, _ = mt.engine.forward_backward(mbs)
        norm, coef = mt.engine.clip_grad_norm(max_norm)
        measured = mt.engine.step(lr, coef)
        norm = norm if clip else measured
        assert loss.item() == pytest.approx(ref_loss, rel=1e-5)
        assert norm.item() == pytest.approx(ref_norm.item(), rel=1e-5)
        clipped += ref_norm.item() > max_norm
    if clip:
        assert clipped >= 2, "the test should exercise clipping"
    return fp32_parameters(mt.state)


def _backward(model, mb, n):
    loss = _hf_loss_sum(model, mb) / n
    loss.backward()
    return loss.item()
