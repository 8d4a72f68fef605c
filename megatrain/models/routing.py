"""The auxiliary load-balancing loss of transformers' mixture-of-experts models, exact with the
layers streamed one at a time.

transformers (`load_balancing_loss_func`, the same in Mixtral, Qwen2/3-MoE and OLMoE) pools
every layer's router output of one forward pass: with c_e the number of top-k assignments to
expert e and p_e the sum of its router probabilities, both over all L layers and the R real
(not padding) token rows,

    aux = E * sum_e (c_e / (L R)) * (p_e / (L R)),

c not differentiated. It is not a sum of per-layer terms, but c is known once the forward sweep
has passed every layer. So the forward sweep records each layer's counts and probability sums;
the loss is then known, and each layer's recompute in the backward sweep gives its router
probabilities the gradient of `router_aux_loss_coef * aux`, coef * E * c_e / (L R)^2 on each
real row, which autograd carries into the router (and everything below it) with the layer's own
gradient.

Micro-batches: each is one forward pass of transformers' model, with its own aux loss. The step's
loss adds `coef * aux` of every micro-batch as it is, not averaged: what a plain accumulation
loop computes when, as the Hugging Face Trainer does for models that take `num_items_in_batch`
(every MoE model), the token loss is normalised over the whole step and the model's loss
(token loss + coef * aux) is not divided by the number of micro-batches. Padding rows
(`MicroBatch.attention_mask`) are left out, as transformers leaves them out given that mask.
"""

from __future__ import annotations

import torch

from .config import MoESpec


class RouterBalance:
    """Router statistics of one optimizer step, per micro-batch and per layer."""

    def __init__(self, spec: MoESpec, num_layers: int, device: torch.device):
        self.spec, self.L, self.device = spec, num_layers, device
        self.coef = spec.router_aux_loss_coef if spec.output_router_logits else 0.0
        self.masks: list[torch.Tensor | None] = []

    def begin(self, masks: list[torch.Tensor | None]) -> None:
        """A new step; `masks[m]`: micro-batch m's real rows (flat [B*S] fp32), or None for all."""
        E, dev = self.spec.num_experts, self.device
        self.masks = masks
        self.counts = [torch.zeros(E, device=dev) for _ in masks]  # over layers, per micro-batch
        self.probs = [torch.zeros(E, device=dev) for _ in masks]
        self.rows = [torch.zeros((), device=dev) for _ in masks]
        self.layer_counts = torch.zeros(self.L, E, device=dev)  # over micro-batches, per layer

    def record(self, layer: int, m: int, router) -> None:
        """Layer `layer`'s routing of micro-batch `m` (top-k experts [T, k], probabilities [T, E])."""
        idx, probs = router[0], router[1].detach()
        mask = self.masks[m]
        ones = torch.ones(idx.shape, device=self.device) if mask is None else mask[:, None].expand(idx.shape)
        counts = torch.zeros(self.spec.num_experts, device=self.device)
        counts.scatter_add_(0, idx.reshape(-1), ones.reshape(-1))
        self.counts[m] += counts
        self.probs[m] += probs.sum(0) if mask is None else (probs * mask[:, None]).sum(0)
        self.rows[m] += probs.shape[0] if mask is None else mask.sum()
        self.layer_counts[layer] += counts

    def aux_losses(self) -> list[torch.Tensor]:
        """transformers' `aux_loss` of each micro-batch (`rows` sums every layer's real rows: L R)."""
        E = self.spec.num_experts
        return [E * torch.sum(c * p) / r**2 for c, p, r in zip(self.counts, self.probs, self.rows)]

    def loss(self) -> torch.Tensor:
        """What the step's loss adds: coef * aux of every micro-batch (0 without output_router_logits)."""
        if not self.coef:
            return torch.zeros((), device=self.device)
        return self.coef * torch.stack(self.aux_losses()).sum()

    def grad_targets(self, m: int, out, dh: torch.Tensor):
        """Outputs of a recomputed layer on micro-batch `m` and their gradients, for
        `torch.autograd.grad`: the hidden state's, and the aux loss's on the router probabilities."""
        y, (_, probs) = out
        if not self.coef:
            return [y], [dh]
        w = self.coef * self.spec.num_experts * self.counts[m] / self.rows[m] ** 2
        mask = self.masks[m]
        return [y, probs], [dh, w.expand(probs.shape) if mask is None else mask[:, None] * w]

    def totals(self) -> torch.Tensor | None:
        """What `metrics` reads, as sums (over processes too, where each sums its own): the
        micro-batches' aux losses, their number, every layer's expert counts; None before a step."""
        if not self.masks:
            return None
        aux = torch.stack(self.aux_losses()).sum()
        n = torch.tensor(float(len(self.masks)), device=self.device)
        return torch.cat([torch.stack([aux, n]), self.layer_counts.reshape(-1)])

    def metrics(self, totals: torch.Tensor | None) -> dict[str, float]:
        """The aux loss (mean over micro-batches, as transformers reports it per forward) and the
        expert load: each expert's share of a layer's assignments times the number of experts, so
        1.0 is a balanced load; the most and least loaded over all layers. Of `totals`."""
        if totals is None:
            return {}
        E = self.spec.num_experts
        counts = totals[2:].view(self.L, E)
        load = counts / counts.sum(1, keepdim=True) * E
        values = torch.stack([totals[0] / totals[1], load.max(), load.min()]).tolist()
        return dict(zip(("aux_loss", "expert_load_max", "expert_load_min"), values))  # one host sync
