"""Next-token cross-entropy, the causal language model's loss as Hugging Face computes it: the sum
of the label tokens' losses over the number of label tokens of the whole step (all micro-batches,
all ranks), labels -100 left out."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..data.batch import IGNORE_INDEX, MicroBatch
from .base import Objective
from .losshead import Head


class CrossEntropy(Objective):
    """Cross-entropy of each micro-batch's logits against its shifted labels."""

    def targets(self, mb: MicroBatch, device: torch.device) -> torch.Tensor:
        """The flat shifted labels ([B*S])."""
        return mb.shifted_labels.to(device, non_blocking=True).reshape(-1)

    def count(self, mb: MicroBatch) -> int:
        return mb.num_label_tokens

    def loss_and_grads(
        self, head: Head, hidden: list[torch.Tensor], targets: list[torch.Tensor], total: int
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        def chunk_loss(m: int, a: int, logits: torch.Tensor):
            l_sum = F.cross_entropy(
                logits, targets[m][a : a + head.chunk], ignore_index=IGNORE_INDEX, reduction="sum"
            )
            return l_sum / total, l_sum

        loss, dh = head.backward(hidden, chunk_loss)
        return loss / total, dh

    def loss_sum(self, head: Head, hidden: list[torch.Tensor], targets: list[torch.Tensor]) -> torch.Tensor:
        loss = torch.zeros((), device=head.W.device)
        for m, a, logits in head.forward(hidden):
            loss += F.cross_entropy(
                logits, targets[m][a : a + head.chunk], ignore_index=IGNORE_INDEX, reduction="sum"
            )
        return loss
