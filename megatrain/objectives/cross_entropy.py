"""Next-token cross-entropy, the causal language model's loss as Hugging Face computes it: the sum
of the label tokens' losses over the number of label tokens of the whole step (all micro-batches,
all ranks), labels -100 left out.

The loss and its gradient come from one function of the chunk's logits (`loss_and_grad`, a
`ChunkGrad`): the label's log-probability as every objective takes it (logprobs.py), then softmax
minus the label's one-hot, scaled, in place. Compiled (on CUDA) it reads the logits in the compute dtype and fuses its steps, where
autograd through `F.cross_entropy` of fp32 logits runs a kernel over the whole chunk for each (the
cast, log-softmax, its gradient's fill, softmax's backward, the cast back): the 8B shape's head
took 94 ms instead of 110 (bench/results/2026-11-28_1235_losshead.md). The same numbers to
rounding (tests/test_loss_head.py); training and evaluation call the same function, so an
evaluation's loss sum is the training loss's numerator bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.batch import IGNORE_INDEX, MicroBatch
from .base import Objective
from .logprobs import entropy, is_top1, log_normaliser, token_logps
from .losshead import Head


def loss_and_grad(
    z: torch.Tensor, labels: torch.Tensor, scale: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The summed cross-entropy of logits `z` [T, V] (any float dtype, computed in fp32) against
    `labels` [T] (IGNORE_INDEX left out), its gradient w.r.t. `z` times `scale` (an fp32 scalar
    tensor), in z's dtype, and TRL's metrics' sums over the labels: [entropy, labels the most
    likely token]."""
    valid = labels != IGNORE_INDEX
    target = torch.where(valid, labels, 0)
    zf = z.to(torch.float32, copy=True)
    lse = log_normaliser(zf)
    loss = torch.where(valid, -token_logps(zf, target, lse), 0.0).sum()
    top1 = (is_top1(zf, target) & valid).sum()
    zf.sub_(lse).exp_()  # softmax
    ent = torch.where(valid, entropy(z.float(), lse, zf), 0.0).sum()
    zf.scatter_add_(-1, target[:, None], -valid[:, None].float())  # minus the label's one-hot
    zf.mul_(torch.where(valid[:, None], scale, 0.0))
    return loss, zf.to(z.dtype), torch.stack((ent, top1.float()))


class CrossEntropy(Objective):
    """Cross-entropy of each micro-batch's logits against its shifted labels. `one_pass=False`:
    autograd through `F.cross_entropy` of the fp32 logits instead (what `loss_and_grad` replaces:
    the reference its tests and bench/losshead.py compare it with)."""

    def __init__(self, one_pass: bool = True):
        self.one_pass = one_pass

    def targets(self, mb: MicroBatch, device: torch.device) -> torch.Tensor:
        """The flat shifted labels ([B*S])."""
        return mb.shifted_labels.to(device, non_blocking=True).reshape(-1)

    def count(self, mb: MicroBatch) -> int:
        return mb.num_label_tokens

    def loss_and_grads(
        self, head: Head, hidden: list[torch.Tensor], targets: list[torch.Tensor], total: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        if not self.one_pass:

            def chunk_loss(m: int, a: int, logits: torch.Tensor):
                labels = targets[m][a : a + head.chunk]
                l_sum = F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")
                return l_sum / total, l_sum

            loss, dh = head.backward(hidden, chunk_loss)
            return loss / total, dh
        fn = head.fused(loss_and_grad)
        scale = torch.full((), 1.0 / total, device=head.W.device)
        stats = torch.zeros(len(targets), 2, device=head.W.device)

        def chunk_grad(m: int, a: int, z: torch.Tensor):
            loss, grad, chunk_stats = fn(z, targets[m][a : a + head.chunk], scale)
            stats[m] += chunk_stats
            return loss, grad

        loss, dh = head.backward(hidden, chunk_grad=chunk_grad)
        self._record(stats, targets)
        return loss / total, dh

    def loss_sum(self, head: Head, hidden: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
        fn = head.fused(loss_and_grad)
        scale = torch.ones((), device=head.W.device)
        loss = torch.zeros((), device=head.W.device)
        stats = torch.zeros(len(targets), 2, device=head.W.device)
        for m, a, z in head.forward(hidden, raw=True):
            chunk_loss, _, chunk_stats = fn(z, targets[m][a : a + head.chunk], scale)
            loss += chunk_loss
            stats[m] += chunk_stats
        self._record(stats, targets)
        return loss

    def _record(self, stats: torch.Tensor, targets: list[torch.Tensor]) -> None:
        """TRL's SFT metrics of each micro-batch: the mean entropy and top-1 accuracy over its
        labels (0 where it has none). One copy to the host for all micro-batches."""
        labels = torch.stack([(t != IGNORE_INDEX).sum() for t in targets]).clamp(min=1)
        for ent, acc in (stats / labels[:, None]).tolist():
            self.record({"entropy": ent, "mean_token_accuracy": acc})
