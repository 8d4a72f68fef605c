"""Mixture-of-experts families against transformers on the CPU in fp32: logits, the auxiliary
load-balancing loss and every gradient; optimizer steps with accumulation and clipping; the
checkpoint's per-expert tensors in and out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import MOE_CONFIGS, tiny_hf_model

from megatrain.batch import MicroBatch
from megatrain.models.config import ModelConfig
from megatrain.placement import Choices
from megatrain.runtime import build_model

FAMILIES = list(MOE_CONFIGS)


def _batch(vocab, B=2, S=20, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (B, S), generator=g)
    labels = ids.clone()
    labels[:, :3] = -100
    return MicroBatch(ids, labels)


def _megatrain(hf, tmp_path, **kw):
    hf.save_pretrained(tmp_path / "hf")
    cfg = ModelConfig.from_json(tmp_path / "hf")
    return build_model(cfg, weights=tmp_path / "hf", device="cpu", **kw)


def _hf_step_loss(hf, mbs):
    """A plain accumulation loop over transformers' model: each micro-batch's token loss over the
    step's label tokens, plus coef * its own aux loss (the Trainer's rule with num_items_in_batch)."""
    n = sum(mb.num_label_tokens for mb in mbs)
    total, auxes = 0.0, []
    for mb in mbs:
        out = hf(input_ids=mb.input_ids, output_router_logits=True)
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
    mbs = [_batch(hf.config.vocab_size, seed=s) for s in (1, 2)]
    torch.testing.assert_close(
        mt.engine.logits(mbs[0]), hf(input_ids=mbs[0].input_ids).logits, rtol=1e-5, atol=1e-5
    )

    ref_loss, ref_aux = _hf_step_loss(hf, mbs)
    loss, _ = mt.engine.forward_backward(mbs)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)
    aux = [a.item() for a in mt.engine.routing.aux_losses()]
    assert aux == pytest.approx(ref_aux, rel=1e-6)

    grads = mt.engine.named_grads()
    ref = {k: p.grad for k, p in hf.named_parameters()}
    assert set(grads) == set(ref), set(grads) ^ set(ref)
    for k, g in grads.items():
        assert g.abs().sum() > 0, k
        torch.testing.assert_close(g, ref[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")
