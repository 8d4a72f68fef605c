"""The loss head a chunk of tokens at a time: final norm and LM head over at most `chunk` tokens
at once, so neither the full logits nor the normalised states of a whole micro-batch ever exist
(at 128k vocabulary the logits alone are 0.5 MB per token in fp32). An objective (base.py) takes
its loss from these chunks.

Training (`Head.backward`) and evaluation (`Head.forward`) run the same chunks in the same order, so
an evaluation's loss sum is the training loss's numerator bit for bit.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn
from torch.func import functional_call

ChunkLoss = Callable[[int, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(micro-batch, its first token in the chunk, the chunk's fp32 logits) -> (the chunk's term of the
loss to differentiate, the term to add to the sum `Head.backward` returns)."""


def logits(
    head: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, W: torch.Tensor
) -> torch.Tensor:
    """fp32 logits of hidden states `x` through the head template bound to `params` and the LM
    weight `W`."""
    return functional_call(head, params, (x, W)).float()


def _chunks(x: torch.Tensor, chunk: int):
    flat = x.reshape(-1, x.shape[-1])
    for a in range(0, flat.shape[0], chunk):
        yield a, flat[a : a + chunk]


@dataclass
class Head:
    """The loss head bound to its weights for one step: the head template (final norm, soft-capping),
    its own parameters, the LM weight (its own, or the embedding's table in a tied model), the
    tokens per chunk and, in training, the fp32 buffers its gradients are added to."""

    template: nn.Module
    params: dict[str, torch.Tensor]
    W: torch.Tensor
    chunk: int
    grads: dict[str, torch.Tensor] | None = None
    """The fp32 gradients of the head's own parameters, by name (None: forward only)."""
    grad_W: torch.Tensor | None = None
    """The fp32 gradient of the LM weight."""

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits of hidden states `x` (all at once: for evaluation and parity tests)."""
        return logits(self.template, self.params, x, self.W)

    def forward(self, hidden: list[torch.Tensor]) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(micro-batch, first token, fp32 logits) of each chunk of each micro-batch's last hidden
        states, flattened to tokens; no gradients."""
        for m, x in enumerate(hidden):
            for a, xc in _chunks(x, self.chunk):
                yield m, a, self.logits(xc)

    def backward(
        self, hidden: list[torch.Tensor], chunk_loss: ChunkLoss
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The chunks of `forward` with gradients: the sum of `chunk_loss`'s second terms (an fp32
        device scalar) and the gradient of its first terms w.r.t. each micro-batch's last hidden
        states; the gradients of the head's own parameters and of the LM weight are added into
        `grads` (by name) and `grad_W`."""
        names = list(self.params)
        g_own = [self.grads[n] for n in names]
        loss = torch.zeros((), device=self.W.device)
        dh = []
        for m, x in enumerate(hidden):
            dx = torch.empty_like(x.reshape(-1, x.shape[-1]))
            for a, xc in _chunks(x, self.chunk):
                xc = xc.detach().requires_grad_()
                own = {n: self.params[n].detach().requires_grad_() for n in names}
                Wl = self.W.detach().requires_grad_()
                with torch.enable_grad():
                    term, kept = chunk_loss(m, a, logits(self.template, own, xc, Wl))
                    gx, *g, gW = torch.autograd.grad(term, (xc, *own.values(), Wl))
                dx[a : a + self.chunk] = gx
                torch._foreach_add_(g_own, g)
                self.grad_W.add_(gW)
                loss += kept.detach()
                del own, gx, g, gW, term, kept
            dh.append(dx.view(x.shape))
        return loss, dh
