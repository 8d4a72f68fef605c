"""Phi-3 (and Phi-4-mini): the Llama block with fused projections, under Hugging Face names.

`qkv_proj` holds q, k and v stacked along its output (q heads, then k, then v); `gate_up_proj`
holds the gate then the up projection. Everything else (norms, rotary embedding with an optional
partial factor, one sliding window for every layer, embedding, head) is `decoder.py`'s.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn
from transformers.activations import ACT2FN

from .base import meta
from .config import ModelConfig
from .decoder import BLOCKS, Attention, DecoderLayer


class FusedAttention(Attention):
    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)  # Attention's projections are replaced, not added to
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=False)
        self.qkv_proj = nn.Linear(h, (self.n_heads + 2 * self.n_kv) * d, bias=False)
        self.qk_norm, self.scale, self.softcap = False, None, None

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, S, _ = x.shape
        q, k, v = self.qkv_proj(x).split(
            [self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], dim=-1
        )
        return (
            q.view(B, S, self.n_heads, self.head_dim),
            k.view(B, S, self.n_kv, self.head_dim),
            v.view(B, S, self.n_kv, self.head_dim),
        )


class FusedMLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act = ACT2FN[cfg.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(up * self.act(gate))


class Phi3Layer(DecoderLayer):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.self_attn = FusedAttention(cfg)
        self.mlp = FusedMLP(cfg)


PHI3 = dataclasses.replace(
    BLOCKS["llama"], name="phi3", layer=lambda cfg, i: meta(lambda: Phi3Layer(cfg)), hf_init=True
)
