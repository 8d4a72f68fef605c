"""Mixture-of-experts decoder blocks with Hugging Face semantics: Mixtral, Qwen2-MoE, Qwen3-MoE,
OLMoE.

Like `decoder.py`, these are stateless templates bound to a unit's weights for each visit. The
parameter names are transformers' own (`mlp.gate.weight`, `mlp.experts.gate_up_proj` [E, 2F, H],
`mlp.experts.down_proj` [E, H, F]); checkpoints hold one tensor per expert instead, under names
that `EXPERT_KEYS` maps (as data), each a contiguous block of the fused tensor. Routed tokens go
through the experts as two grouped matrix products (`F.grouped_mm`), sorted by expert, with no
loop over experts and no host synchronisation (`route`, shared with gpt-oss's experts).

A block returns, beside its output, what the auxiliary load-balancing loss needs from the layer:
each token's top-k experts and its router probabilities (differentiable). `routing.py` turns
those into transformers' `aux_loss`.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .base import meta
from .decoder import BLOCKS, MLP, Attention, RMSNorm

# Checkpoint names of the fused expert tensors: each fused [E, R, C] tensor is, for expert e, the
# listed per-expert tensors ([R / n, C] each) back to back. transformers' weight conversion
# (`conversion_mapping.py`) fuses and splits them the same way; `save_pretrained` writes these.
EXPERT_KEYS = {
    "mixtral": {
        "mlp.gate.weight": ("block_sparse_moe.gate.weight",),
        "mlp.experts.gate_up_proj": (
            "block_sparse_moe.experts.{e}.w1.weight",
            "block_sparse_moe.experts.{e}.w3.weight",
        ),
        "mlp.experts.down_proj": ("block_sparse_moe.experts.{e}.w2.weight",),
    },
    "default": {
        "mlp.experts.gate_up_proj": ("mlp.experts.{e}.gate_proj.weight", "mlp.experts.{e}.up_proj.weight"),
        "mlp.experts.down_proj": ("mlp.experts.{e}.down_proj.weight",),
    },
}


def checkpoint_pieces(cfg, kind: str, layer: int, name: str, shape: tuple[int, ...]):
    """The checkpoint tensors that make up template parameter `name`: a list of (checkpoint key,
    element offset inside the parameter, shape); one per expert (and gate/up half) for the fused
    expert tensors, the parameter itself otherwise."""
    key = _LLAMA.param_key(cfg, kind, layer, name)
    names = EXPERT_KEYS.get(cfg.model_type, EXPERT_KEYS["default"]).get(name) if kind == "layer" else None
    prefix = key[: len(key) - len(name)]
    if names is None:
        return [(key, 0, shape)]
    if len(shape) == 2:  # a renamed tensor (Mixtral's router)
        return [(prefix + names[0], 0, shape)]
    E, R, C = shape
    rows = R // len(names)
    return [
        (prefix + n.format(e=e), (e * len(names) + j) * rows * C, (rows, C))
        for e in range(E)
        for j, n in enumerate(names)
    ]


def grouped_linear(x: torch.Tensor, w: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
    """Rows of `x` sorted by expert ([N, in]) times their expert's `w` ([E, in, out]); `offs` are
    the groups' cumulative ends (int32). One grouped matmul on the CPU and on CUDA in bf16;
    CUDA's grouped kernels take no fp32, so there (only) the experts run one after another."""
    if x.device.type != "cuda" or x.dtype == torch.bfloat16:
        return F.grouped_mm(x, w, offs=offs)
    ends = offs.tolist()  # a host sync: fp32 on CUDA is a debugging setting
    starts = [0, *ends[:-1]]
    return torch.cat([x[a:b] @ w[e] for e, (a, b) in enumerate(zip(starts, ends))])


def expert_counts(idx: torch.Tensor, num_experts: int) -> torch.Tensor:
    """Assignments per expert [E] of the router's choice `idx` [T, k]."""
    flat = idx.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=idx.device)
    return counts.scatter_add_(0, flat, torch.ones_like(flat))


def route(x: torch.Tensor, idx: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor, experts):
    """Each token of `x` [T, H] through its top-k experts (`idx`, `scores` [T, k]; `counts` [E]),
    weighted and summed: the assignments sorted by expert, as rows, go through
    `experts(rows, offs, expert_of_row)` (grouped products, `offs` the groups' int32 ends)."""
    T, k = idx.shape
    order = idx.reshape(-1).argsort(stable=True)  # assignments grouped by expert
    # Each assignment's token row, gathered from a broadcast view (no [T*k, H] copy of it): the
    # gradient scatters to distinct (token, slot) places and sums over the slots, so it is
    # deterministic on CUDA, unlike an index_add over tokens.
    xs = x[:, None].expand(T, k, x.shape[-1])[order // k, order % k]
    offs = counts.cumsum(0).to(torch.int32)
    y = experts(xs, offs, idx.reshape(-1)[order])
    y = (y * scores.reshape(-1)[order, None]).to(x.dtype)
    # Back to token order (the inverse permutation, by a scatter rather than a second sort); each
    # token's k outputs summed (for k = 2 the same sum, bit for bit, as transformers' per-expert
    # accumulation).
    inverse = torch.empty_like(order).scatter_(0, order, torch.arange(T * k, device=order.device))
    return y[inverse].view(T, k, -1).sum(1)


class Experts(nn.Module):
    """E SwiGLU experts as fused 3-D weights (transformers' layout, [E, out, in])."""

    def __init__(self, num_experts: int, hidden: int, size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * size, hidden))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, size))

    def forward(self, x: torch.Tensor, idx: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor):
        """x [T, H]; idx, scores [T, k]: each token's experts and routing weights; counts [E]."""
        return route(x, idx, scores, counts, self.mlp)

    def mlp(self, xs: torch.Tensor, offs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert (`offs` the groups' ends) through their expert's SwiGLU."""
        gate, up = grouped_linear(xs, self.gate_up_proj.transpose(-2, -1), offs).chunk(2, dim=-1)
        return grouped_linear(F.silu(gate) * up, self.down_proj.transpose(-2, -1), offs)


class SparseMoeBlock(nn.Module):
    """Router (softmax, top-k, optional renormalisation), routed experts, optional shared expert
    behind a sigmoid gate. Names: those under `model.layers.{i}.mlp.`."""

    def __init__(self, cfg):
        super().__init__()
        spec, h = cfg.moe, cfg.hidden_size
        self.spec = spec
        self.gate = nn.Linear(h, spec.num_experts, bias=False)
        self.experts = Experts(spec.num_experts, h, spec.expert_size)
        if spec.shared_expert_size:
            self.shared_expert = MLP(dataclasses.replace(cfg, intermediate_size=spec.shared_expert_size))
            self.shared_expert_gate = nn.Linear(h, 1, bias=False)

    def forward(self, x: torch.Tensor):
        """Output [B, S, H] and the router's choice: each token's experts [T, k] and its
        probabilities over all experts [T, E] (fp32)."""
        spec, shape = self.spec, x.shape
        flat = x.reshape(-1, shape[-1])
        logits = self.gate(flat)
        probs = F.softmax(logits, dim=-1, dtype=torch.float32)
        scores, idx = probs.topk(spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            scores = scores / scores.sum(dim=-1, keepdim=True)
        if not spec.fp32_scores:
            scores = scores.to(logits.dtype)
        y = self.experts(flat, idx, scores, expert_counts(idx, spec.num_experts)).view(shape)
        if spec.shared_expert_size:
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y, (idx, probs)


class MoeDecoderLayer(nn.Module):
    """A pre-norm block whose MLP is a `SparseMoeBlock`; returns (output, router statistics)."""

    def __init__(self, cfg):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = SparseMoeBlock(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        y, router = self.mlp(self.post_attention_layernorm(x))
        return x + y, router


def router_balance(cfg, num_layers: int, device: torch.device):
    """The keeper of transformers' load-balancing loss over a model's layers (`Family.aux`)."""
    from .routing import RouterBalance  # the engine's side of the aux loss

    return RouterBalance(cfg.moe, num_layers, device)


# Llama's attention, embedding, head and rotary inputs with an expert block as MLP (config.FAMILIES
# `block="moe"`); its layers return (hidden state, router choice), which `aux` turns into the loss.
_LLAMA = BLOCKS["llama"]
MOE = dataclasses.replace(
    _LLAMA,
    name="moe",
    layer=lambda cfg, i: meta(lambda: MoeDecoderLayer(cfg)),
    pieces=checkpoint_pieces,
    aux=router_balance,
)
