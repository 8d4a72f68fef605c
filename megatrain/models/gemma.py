"""Gemma 2 and Gemma 3 (text): the Llama block's attention and gated MLP, wrapped in norms on
both sides, with Hugging Face parameter names.

What differs from `decoder.py`'s block: RMSNorm weights are zero-centred (the scale is 1 + w,
applied in fp32 before the cast); every sub-block is normed before and after
(`x = x + post(attn(pre(x)))`); the scores are scaled by `query_pre_attn_scalar` and, in Gemma 2,
soft-capped; layers alternate between sliding-window and global attention (`layer_types`), and
Gemma 3's local layers have their own rotary base; the embedding is scaled by sqrt(hidden) and
Gemma 2's logits are soft-capped. Gemma 3 adds q/k norms over head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .base import Family, meta
from .config import ModelConfig
from .decoder import MLP, Attention, Embedding, layer_type, layer_type_inputs


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # (x * (1 + w)) in fp32, then cast: unlike Llama's (x cast) * w.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).type_as(x)


class GemmaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        hf, h, eps = cfg.hf_config, cfg.hidden_size, cfg.rms_norm_eps
        self.self_attn = Attention(
            cfg,
            norm=lambda d: GemmaRMSNorm(d, eps),
            scale=hf.query_pre_attn_scalar**-0.5,
            softcap=getattr(hf, "attn_logit_softcapping", None),
        )
        self.mlp = MLP(cfg)
        self.input_layernorm = GemmaRMSNorm(h, eps)
        self.post_attention_layernorm = GemmaRMSNorm(h, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(h, eps)
        self.post_feedforward_layernorm = GemmaRMSNorm(h, eps)

    def forward(self, x: torch.Tensor, rope, mask=None) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(self.input_layernorm(x), rope, mask))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class GemmaEmbedding(Embedding):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.scale = cfg.hidden_size**0.5

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        w = self.embed_tokens.weight
        # transformers keeps sqrt(hidden) as an fp32 tensor and rounds it to the weights' dtype.
        return self.embed_tokens(input_ids) * torch.tensor(self.scale, device=w.device).to(w.dtype)


class GemmaHead(nn.Module):
    lm_weight_name = "lm_head.weight"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.softcap = getattr(cfg.hf_config, "final_logit_softcapping", None)

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x)

    def forward(self, x: torch.Tensor, lm_weight: torch.Tensor) -> torch.Tensor:
        logits = F.linear(self.normed(x), lm_weight)
        return logits if self.softcap is None else torch.tanh(logits / self.softcap) * self.softcap


def _inputs(cfg: ModelConfig, device: torch.device):
    # Soft-capped scores (Gemma 2) have no fused causal kernel but FlexAttention's.
    capped = getattr(cfg.hf_config, "attn_logit_softcapping", None) is not None
    return layer_type_inputs(cfg, device, always_mask=capped)


def _key(cfg: ModelConfig, kind: str, layer: int, name: str) -> str:
    if kind == "layer":
        return f"model.layers.{layer}.{name}"
    return name if name.startswith("lm_head.") else f"model.{name}"


GEMMA = Family(
    name="gemma",
    path="fast",
    embedding=lambda cfg: meta(lambda: GemmaEmbedding(cfg)),
    layer=lambda cfg, i: meta(lambda: GemmaLayer(cfg)),
    layer_key=lambda cfg, i: "layer",  # global and local layers differ only in their inputs
    layer_kind=layer_type,
    inputs=_inputs,
    head=lambda cfg: meta(lambda: GemmaHead(cfg)),
    param_key=_key,
)
