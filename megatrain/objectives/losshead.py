"""The loss head a chunk of tokens at a time: final norm and LM head over at most `chunk` tokens
at once, so neither the full logits nor the normalised states of a whole micro-batch ever exist
(at 128k vocabulary the logits alone are 0.5 MB per token in fp32). An objective (base.py) takes
its loss from these chunks.

Training (`Head.backward`) and evaluation (`Head.forward`) run the same chunks in the same order, so
an evaluation's loss sum is the training loss's numerator bit for bit.

An objective gives its loss a chunk at a time in one of two forms: a function of the chunk's fp32
logits that autograd differentiates (`ChunkLoss`: any loss), or one that returns the loss and its
gradient with respect to the logits as the head computes them, in one pass (`ChunkGrad`:
cross_entropy.py's, which reads the logits once to form both instead of casting them to fp32,
normalising, and running softmax's backward as separate kernels; `Head.fused` compiles it where
the engine compiles its layers).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call
from torch.overrides import TorchFunctionMode

from ..models.compiling import compiled

ChunkLoss = Callable[[int, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
"""(micro-batch, its first token in the chunk, the chunk's fp32 logits) -> (the chunk's term of the
loss to differentiate, the term to add to the sum `Head.backward` returns, or None: an objective
that sums its loss otherwise)."""

ChunkGrad = Callable[[int, int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]
"""(micro-batch, its first token in the chunk, the chunk's logits as the head template returns them,
in the compute dtype and outside autograd) -> (the term to add to the sum `Head.backward` returns,
the gradient of the chunk's term of the loss with respect to those logits, in their dtype)."""

_fused: dict[Callable, Callable] = {}  # one compiled variant per function, shared by every head


def logits(
    head: nn.Module, params: dict[str, torch.Tensor], x: torch.Tensor, W: torch.Tensor
) -> torch.Tensor:
    """Logits of hidden states `x` through the head template bound to `params` and the LM weight
    `W`, as the template returns them (the compute dtype); `.float()` for fp32."""
    return functional_call(head, params, (x, W))


WIDE_GEMM = hasattr(torch.ops.aten.addmm, "dtype_out")  # `addmm(..., out_dtype=)`; GPU-tested on torch 2.11


def add_product(out: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """`out += a @ b`: on CUDA, with `out` wider than the operands (an fp32 gradient of bf16
    ones), one GEMM that accumulates into `out` at its own precision; elsewhere (or with a torch
    that has no such GEMM) the product in the operands' dtype, then added (as autograd's gradient,
    then its add, would be)."""
    if out.is_cuda and out.dtype != a.dtype and WIDE_GEMM:
        torch.addmm(out, a, b, out_dtype=out.dtype, out=out)
    else:
        out.add_(a @ b)


class _IntoGradW(torch.autograd.Function):
    """The head template's LM projection `F.linear(x, W)`, its backward adding W's gradient into the
    fp32 buffer itself (`add_product`) and returning none: no compute-dtype gradient of the whole
    vocabulary per chunk, and no separate pass adding it."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, W: torch.Tensor, grad_W: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, W)
        ctx.grad_W = grad_W
        return F.linear(x, W)

    @staticmethod
    def backward(ctx, dz: torch.Tensor):
        x, W = ctx.saved_tensors
        add_product(ctx.grad_W, dz.reshape(-1, dz.shape[-1]).T, x.reshape(-1, x.shape[-1]))
        return dz @ W, None, None

    @staticmethod
    def routed(W: torch.Tensor, grad_W: torch.Tensor) -> TorchFunctionMode:
        """Within this block the template's `F.linear(·, W)` (no bias) runs as `_IntoGradW`."""
        return _Route(W, grad_W)


class _Route(TorchFunctionMode):
    def __init__(self, W: torch.Tensor, grad_W: torch.Tensor):
        super().__init__()
        self.W, self.grad_W = W, grad_W

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        plain = len(args) == 2 or (len(args) == 3 and args[2] is None)
        if func is F.linear and plain and args[1] is self.W and kwargs.get("bias") is None:
            return _IntoGradW.apply(args[0], self.W, self.grad_W)
        return func(*args, **kwargs)


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
    compile: bool = False
    """Whether `fused` compiles (the engine's choice for its layers)."""
    loss_sum: torch.Tensor | None = None
    """The step's running sum of its loss terms (an fp32 device scalar, 0 to start with), which
    `backward` adds each chunk's term to in place, and an objective that sums its loss otherwise
    its own terms. Where the engine calls the objective once a micro-batch (its micro-batch-major
    update) every call continues it, so it ends as one call over every micro-batch ends it, bit
    for bit, as the gradient buffers do."""

    def __post_init__(self):
        if self.loss_sum is None:
            self.loss_sum = torch.zeros((), device=self.W.device)

    def fused(self, fn: Callable) -> Callable:
        """An objective's one-pass chunk function (`ChunkGrad`'s body), compiled where the engine
        compiles, else `fn` itself; training and evaluation call the same one."""
        if not self.compile:
            return fn
        if fn not in _fused:
            _fused[fn] = compiled(fn)
        return _fused[fn]

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 logits of hidden states `x` (all at once: for evaluation and parity tests)."""
        return logits(self.template, self.params, x, self.W).float()

    def forward(
        self, hidden: list[torch.Tensor], raw: bool = False
    ) -> Iterator[tuple[int, int, torch.Tensor]]:
        """(micro-batch, first token, fp32 logits) of each chunk of each micro-batch's last hidden
        states, flattened to tokens; no gradients. `raw`: the logits as the template returns them,
        for a `ChunkGrad` objective's evaluation."""
        for m, x in enumerate(hidden):
            for a, xc in _chunks(x, self.chunk):
                z = logits(self.template, self.params, xc, self.W)
                yield m, a, z if raw else z.float()

    def backward(
        self,
        hidden: list[torch.Tensor],
        chunk_loss: ChunkLoss | None = None,
        chunk_grad: ChunkGrad | None = None,
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The chunks of `forward` with gradients, the loss given by `chunk_loss` or `chunk_grad`
        (one of them): `loss_sum` with its terms added (an fp32 device scalar) and the gradient of
        its loss w.r.t. each micro-batch's last hidden states; the gradients of the head's own
        parameters and of the LM weight are added into `grads` (by name) and `grad_W`."""
        if (chunk_loss is None) == (chunk_grad is None):
            raise TypeError("Head.backward takes one of chunk_loss and chunk_grad")
        names = list(self.params)
        g_own = [self.grads[n] for n in names]
        loss = self.loss_sum
        dh = []
        for m, x in enumerate(hidden):
            dx = torch.empty_like(x.reshape(-1, x.shape[-1]))
            for a, xc in _chunks(x, self.chunk):
                xc = xc.detach().requires_grad_()
                own = {n: self.params[n].detach().requires_grad_() for n in names}
                Wl = self.W.detach().requires_grad_()
                inputs = (xc, *own.values(), Wl)
                with torch.enable_grad(), _IntoGradW.routed(Wl, self.grad_W):
                    z = logits(self.template, own, xc, Wl)
                if chunk_grad is None:
                    with torch.enable_grad():
                        term, kept = chunk_loss(m, a, z.float())
                    gx, *g, gW = torch.autograd.grad(term, inputs, allow_unused=True)
                    del term
                else:
                    kept, dz = chunk_grad(m, a, z.detach())
                    gx, *g, gW = torch.autograd.grad(z, inputs, dz, allow_unused=True)
                    del dz
                dx[a : a + self.chunk] = gx
                torch._foreach_add_(g_own, g)
                if gW is not None:  # a template whose projection `_IntoGradW` did not take
                    self.grad_W.add_(gW)
                if kept is not None:
                    loss += kept.detach()
                del own, gx, g, gW, z, kept
            dh.append(dx.view(x.shape))
        return loss, dh
