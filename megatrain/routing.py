"""The auxiliary load-balancing loss of transformers' mixture-of-experts models, exact with the
layers streamed one at a time.

transformers (`load_balancing_loss_func`, the same in Mixtral, Qwen2/3-MoE and OLMoE) pools
every layer's router output of one forward pass: with c_e the number of top-k assignments to
expert e and p_e the sum of its router probabilities, both over all L layers and R token rows,

    aux = E * sum_e (c_e / (L R)) * (p_e / (L R)),

c not differentiated. It is not a sum of per-layer terms, but c is known once the forward sweep
has passed every layer. So the forward sweep records each layer's counts and probability sums;
the loss is then known, and each layer's recompute in the backward sweep gives its summed
probabilities the gradient of `router_aux_loss_coef * aux`, coef * E * c_e / (L R)^2, which
autograd carries into the router (and everything below it) with the layer's own gradient.

Micro-batches: each is one forward pass of transformers' model, with its own aux loss. The step's
loss adds `coef * aux` of every micro-batch as it is, not averaged: what a plain accumulation
loop computes when, as the Hugging Face Trainer does for models that take `num_items_in_batch`
(every MoE model), the token loss is normalised over the whole step and the model's loss
(token loss + coef * aux) is not divided by the number of micro-batches. Every row counts (there
is no padding mask: transformers called without `attention_mask`).
"""

from __future__ import annotations

import torch

from .models.config import MoESpec


class RouterBalance:
    """Router statistics of one optimizer step, per micro-batch and per layer."""

    def __init__(self, spec: MoESpec, num_layers: int, device: torch.device):
        self.spec, self.L, self.device = spec, num_layers, device
        self.coef = spec.router_aux_loss_coef if spec.output_router_logits else 0.0
        self.rows: list[int] = []

    def begin(self, rows: list[int]) -> None:
        """A new step whose micro-batches have `rows` tokens each."""
        E, dev = self.spec.num_experts, self.device
        self.rows = rows
        self.counts = [torch.zeros(E, device=dev) for _ in rows]  # over layers, per micro-batch
        self.probs = [torch.zeros(E, device=dev) for _ in rows]
        self.layer_counts = torch.zeros(self.L, E, device=dev)  # over micro-batches, per layer

    def record(self, layer: int, m: int, router) -> None:
        """Layer `layer`'s (counts, summed probabilities) on micro-batch `m`, forward sweep."""
        counts, probs = router[0].detach().float(), router[1].detach()
        self.counts[m] += counts
        self.probs[m] += probs
        self.layer_counts[layer] += counts

    def aux_losses(self) -> list[torch.Tensor]:
        """transformers' `aux_loss` of each micro-batch."""
        E = self.spec.num_experts
        return [
            E * torch.sum(c * p) / (self.L * r) ** 2 for c, p, r in zip(self.counts, self.probs, self.rows)
        ]

    def loss(self) -> torch.Tensor:
        """What the step's loss adds: coef * aux of every micro-batch (0 without output_router_logits)."""
        if not self.coef:
            return torch.zeros((), device=self.device)
        return self.coef * torch.stack(self.aux_losses()).sum()

    def grad_targets(self, m: int, out, dh: torch.Tensor):
        """Outputs of a recomputed layer on micro-batch `m` and their gradients, for
        `torch.autograd.grad`: the hidden state's, and the aux loss's on the summed probabilities."""
        y, (_, probs) = out
        if not self.coef:
            return [y], [dh]
        w = self.coef * self.spec.num_experts * self.counts[m] / (self.L * self.rows[m]) ** 2
        return [y, probs], [dh, w]

    def metrics(self) -> dict[str, float]:
        """The aux loss (mean over micro-batches, as transformers reports it per forward) and the
        expert load: each expert's share of a layer's assignments times the number of experts, so
        1.0 is a balanced load; the most and least loaded over all layers."""
        if not self.rows:
            return {}
        load = self.layer_counts / self.layer_counts.sum(1, keepdim=True) * self.spec.num_experts
        values = torch.stack([torch.stack(self.aux_losses()).mean(), load.max(), load.min()]).tolist()
        return dict(zip(("aux_loss", "expert_load_max", "expert_load_min"), values))  # one host sync
