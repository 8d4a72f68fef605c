"""OLMo 2: the Llama block with its norms after each sub-block instead of before
(`x = x + norm(attn(x))`), and q/k RMSNorms over the whole projection (all heads at once),
under Hugging Face names. Its RMSNorm multiplies by the weight in fp32, then casts."""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from .base import meta
from .config import ModelConfig
from .decoder import BLOCKS, MLP, Attention, Head, RMSNorm


class Olmo2RMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight * xf).to(x.dtype)


class Olmo2Attention(Attention):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        eps, d = cfg.rms_norm_eps, cfg.head_dim
        self.q_norm = Olmo2RMSNorm(self.n_heads * d, eps)
        self.k_norm = Olmo2RMSNorm(self.n_kv * d, eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, S, _ = x.shape
        q = self.q_norm(self.q_proj(x)).view(B, S, self.n_heads, self.head_dim)
        k = self.k_norm(self.k_proj(x)).view(B, S, self.n_kv, self.head_dim)
        return q, k, self.v_proj(x).view(B, S, self.n_kv, self.head_dim)


class Olmo2Layer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Olmo2Attention(cfg)
        self.mlp = MLP(cfg)
        self.post_attention_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_feedforward_layernorm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, mask=None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(x, rope, mask))
        return x + self.post_feedforward_layernorm(self.mlp(x))


class Olmo2Head(Head):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm = Olmo2RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


OLMO2 = dataclasses.replace(
    BLOCKS["llama"],
    name="olmo2",
    layer=lambda cfg, i: meta(lambda: Olmo2Layer(cfg)),
    head=lambda cfg: meta(lambda: Olmo2Head(cfg)),
    hf_init=True,
)
