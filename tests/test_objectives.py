"""A loss other than cross-entropy trains through the engine unchanged (objectives/): a preference
loss that couples all tokens of two sequences, computed in two passes over the chunked head,
against transformers' model and autograd on its full logits."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import saved_parameters, tiny_hf_model
from test_parity import _batch, _megatrain

from megatrain.data.batch import IGNORE_INDEX, MicroBatch
from megatrain.objectives.base import Objective
from megatrain.objectives.losshead import Head
from megatrain.planning.placement import Choices

BETA = 0.1


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Each token's log-probability of its label (0 where there is none)."""
    keep = labels != IGNORE_INDEX
    return -F.cross_entropy(logits, labels.clamp(min=0), reduction="none") * keep


def pair_losses(seq_logps: torch.Tensor) -> torch.Tensor:
    """DPO's loss with a reference model that gives every sequence the same probability: rows 2k
    (chosen) and 2k + 1 (rejected) of a micro-batch are a pair."""
    return -F.logsigmoid(BETA * (seq_logps[0::2] - seq_logps[1::2]))


class Preference(Objective):
    """The mean of `pair_losses` over the step's pairs."""

    def targets(self, mb: MicroBatch, device: torch.device):
        labels = mb.shifted_labels.to(device)
        rows = torch.arange(labels.shape[0], device=device)[:, None].expand_as(labels)
        return labels.reshape(-1), rows.reshape(-1)

    def count(self, mb: MicroBatch) -> int:
        return mb.input_ids.shape[0] // 2

    def seq_logps(self, head: Head, hidden, targets) -> list[torch.Tensor]:
        sums = [torch.zeros(x.shape[0], device=x.device) for x in hidden]
        for m, a, logits in head.forward(hidden):
            (labels, rows), chunk = targets[m], slice(a, a + logits.shape[0])
            sums[m].index_add_(0, rows[chunk], token_logps(logits, labels[chunk]))
        return sums

    def loss_sum(self, head: Head, hidden, targets) -> torch.Tensor:
        return sum(pair_losses(s).sum() for s in self.seq_logps(head, hidden, targets))

    def loss_and_grads(self, head: Head, hidden, targets, total: int):
        seqs = [s.requires_grad_() for s in self.seq_logps(head, hidden, targets)]
        with torch.enable_grad():
            loss = sum(pair_losses(s).sum() for s in seqs) / total
            weights = torch.autograd.grad(loss, seqs)  # d loss / d each sequence's log-probability

        def chunk_loss(m: int, a: int, logits: torch.Tensor):
            (labels, rows), chunk = targets[m], slice(a, a + logits.shape[0])
            term = (weights[m][rows[chunk]] * token_logps(logits, labels[chunk])).sum()
            return term, term.detach()

        _, dh = head.backward(hidden, chunk_loss)
        return loss.detach(), dh


def test_a_preference_loss_trains_through_the_engine_as_transformers_computes_it(tmp_path):
    hf = tiny_hf_model("llama", attn_implementation="same")
    # Chunks of 7 tokens straddle the rows: each token's weight is its own sequence's.
    mt = _megatrain(hf, tmp_path, choices=Choices(loss_chunk_tokens=7), objective=Preference())
    mbs = [_batch(hf.config.vocab_size, B=4, seed=s) for s in (1, 2)]

    ref_loss = 0.0
    for mb in mbs:
        logits = hf(input_ids=mb.input_ids).logits.float()
        logps = token_logps(logits.reshape(-1, logits.shape[-1]), mb.shifted_labels.reshape(-1))
        loss = pair_losses(logps.view(mb.labels.shape).sum(1)).sum() / 4
        loss.backward()
        ref_loss += loss.item()
    loss, pairs = mt.engine.forward_backward(mbs)
    assert pairs == 4
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)

    grads = mt.engine.named_grads()
    ref = {k: p.grad for k, p in saved_parameters(hf).items()}
    assert set(grads) == set(ref)
    for k, g in grads.items():
        assert g.abs().sum() > 0, k
        torch.testing.assert_close(g, ref[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")

    mt.engine.skip_step()
    loss_sum, pairs = mt.engine.eval_loss(mbs)
    assert pairs == 4 and loss_sum.item() / pairs == pytest.approx(ref_loss, rel=1e-6)
