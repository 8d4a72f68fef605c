"""The loss head a chunk of tokens at a time: final norm, LM head and cross-entropy over at most
`chunk` tokens at once, so neither the full logits nor the normalised states of a whole
micro-batch ever exist (at 128k vocabulary the logits alone are 0.5 MB per token in fp32).

Training (`loss_and_grads`) and evaluation (`loss_sum`) run the same chunks in the same order, so
an evaluation's loss sum is the training loss's numerator bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from ..data.batch import IGNORE_INDEX


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


def loss_sum(head, params, W, hidden: list[torch.Tensor], targets: list[torch.Tensor], chunk: int):
    """Sum of token losses (an fp32 device scalar) of each micro-batch's last hidden states
    against its flat shifted labels."""
    loss = torch.zeros((), device=W.device)
    for x, t in zip(hidden, targets):
        for a, xc in _chunks(x, chunk):
            loss += F.cross_entropy(
                logits(head, params, xc, W), t[a : a + chunk], ignore_index=IGNORE_INDEX, reduction="sum"
            )
    return loss


def loss_and_grads(
    head,
    params: dict[str, torch.Tensor],
    W: torch.Tensor,
    hidden: list[torch.Tensor],
    targets: list[torch.Tensor],
    chunk: int,
    n_tokens: int,
    g_params: dict[str, torch.Tensor],
    g_W: torch.Tensor,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Loss sum / n_tokens and its gradient w.r.t. each micro-batch's last hidden states; the
    gradients of the head's own parameters and of the LM weight are added into `g_params` (by
    name) and `g_W` (fp32 buffers)."""
    names = list(params)
    g_own = [g_params[n] for n in names]
    loss = torch.zeros((), device=W.device)
    dh = []
    for x, t in zip(hidden, targets):
        dx = torch.empty_like(x.reshape(-1, x.shape[-1]))
        for a, xc in _chunks(x, chunk):
            xc = xc.detach().requires_grad_()
            own = {n: params[n].detach().requires_grad_() for n in names}
            Wl = W.detach().requires_grad_()
            with torch.enable_grad():
                l_sum = F.cross_entropy(
                    logits(head, own, xc, Wl), t[a : a + chunk], ignore_index=IGNORE_INDEX, reduction="sum"
                )
                gx, *g, gW = torch.autograd.grad(l_sum / n_tokens, (xc, *own.values(), Wl))
            dx[a : a + chunk] = gx
            torch._foreach_add_(g_own, g)
            g_W.add_(gW)
            loss += l_sum.detach()
            del own, gx, g, gW, l_sum
        dh.append(dx.view(x.shape))
    return loss / n_tokens, dh
