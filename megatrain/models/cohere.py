"""Cohere (Command R): a parallel block, `x = x + attn(norm(x)) + mlp(norm(x))`, under Hugging
Face names. Its norm is a LayerNorm without bias (mean-centred, statistics and weight in fp32);
its rotary embedding rotates interleaved pairs of dimensions (in fp32); optional q/k LayerNorms
have one weight per head; the logits are multiplied by `logit_scale`."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .attention import attention_mask
from .base import meta
from .config import ModelConfig
from .decoder import BLOCKS, MLP, Attention, rope_inv_freq


class CohereLayerNorm(nn.Module):
    def __init__(self, shape: int | tuple[int, ...], eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(shape))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf - xf.mean(-1, keepdim=True)
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)


def rotate_pairs(x: torch.Tensor) -> torch.Tensor:
    """(x0, x1, x2, x3, ...) -> (-x1, x0, -x3, x2, ...): rotation of interleaved pairs."""
    return torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)


class CohereAttention(Attention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        if cfg.qk_norm:  # over head_dim, one weight per head
            self.q_norm = CohereLayerNorm((self.n_heads, self.head_dim), cfg.rms_norm_eps)
            self.k_norm = CohereLayerNorm((self.n_kv, self.head_dim), cfg.rms_norm_eps)

    def rotate(self, q, k, rope):
        cos, sin = rope
        qf, kf = q.float(), k.float()
        return (
            (qf * cos + rotate_pairs(qf) * sin).to(q.dtype),
            (kf * cos + rotate_pairs(kf) * sin).to(k.dtype),
        )


class CohereLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = CohereAttention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = CohereLayerNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, mask=None) -> torch.Tensor:
        h = self.input_layernorm(x)
        return x + self.self_attn(h, rope, mask) + self.mlp(h)


class CohereHead(nn.Module):
    lm_weight_name = "lm_head.weight"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = CohereLayerNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.logit_scale = cfg.hf_config.logit_scale

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def forward(self, x: torch.Tensor, lm_weight: torch.Tensor) -> torch.Tensor:
        return F.linear(self.normed(x), lm_weight) * self.logit_scale


def _inputs(cfg: ModelConfig, device: torch.device):
    inv_freq, scale = rope_inv_freq(cfg)
    inv_freq = inv_freq.to(device)

    def inputs(position_ids, document_ids, seq_len, dtype, flex):
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.repeat_interleave(freqs, 2, dim=-1)  # pairs share a frequency
        rope = ((emb.cos() * scale).to(dtype)[:, None], (emb.sin() * scale).to(dtype)[:, None])
        mask = attention_mask(document_ids, seq_len, None, position_ids.device, flex)
        return {"layer": {"rope": rope, "mask": mask}}

    return inputs


COHERE = dataclasses.replace(
    BLOCKS["llama"],
    name="cohere",
    layer=lambda cfg, i: meta(lambda: CohereLayer(cfg)),
    head=lambda cfg: meta(lambda: CohereHead(cfg)),
    inputs=_inputs,
    hf_init=True,
)
