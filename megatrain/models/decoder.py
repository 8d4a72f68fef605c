"""The pre-norm decoder of Llama, Mistral, Qwen2 and Qwen3, with Hugging Face parameter names.

These modules are *templates*: the engine builds each one once, on the meta device, and binds
weights to it for every visit with `torch.func.functional_call`. Nothing here owns state.

The four families differ only by flags of `ModelConfig`: q/k/v bias (Qwen2, Llama with
`attention_bias`), q/k RMSNorm (Qwen3; over all heads for OLMoE), and Mistral's sliding window.
The mixture-of-experts families reuse `Attention` with an expert block as MLP (`moe.py`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Statistics in fp32 whatever the compute dtype, as transformers does.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.n_heads, self.n_kv, self.head_dim = cfg.num_attention_heads, cfg.num_key_value_heads, d
        self.q_proj = nn.Linear(h, self.n_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, self.n_kv * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, self.n_kv * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.n_heads * d, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            full = cfg.qk_norm_full  # OLMoE: one norm over all heads, before the split
            self.q_norm = RMSNorm(self.n_heads * d if full else d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.n_kv * d if full else d, cfg.rms_norm_eps)
        self.qk_norm, self.qk_norm_full = cfg.qk_norm, cfg.qk_norm_full

    def forward(self, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], mask) -> torch.Tensor:
        B, S, _ = x.shape
        q, k = self.q_proj(x), self.k_proj(x)
        if self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(B, S, self.n_heads, self.head_dim)
        k = k.view(B, S, self.n_kv, self.head_dim)
        v = self.v_proj(x).view(B, S, self.n_kv, self.head_dim)
        if self.qk_norm and not self.qk_norm_full:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = rope  # [B, 1, S, head_dim]
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        if mask is None:
            # Plain causal attention: the fused flash kernel on CUDA, which reads grouped K/V as is.
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
        else:
            # Packed documents or a sliding window: an explicit mask, K/V heads repeated.
            rep = self.n_heads // self.n_kv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h, f, b = cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias
        self.gate_proj = nn.Linear(h, f, bias=b)
        self.up_proj = nn.Linear(h, f, bias=b)
        self.down_proj = nn.Linear(f, h, bias=b)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """One transformer block; parameter names are those under `model.layers.{i}.`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        # Declared in transformers' order, so parameters iterate in the checkpoint's order.
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, mask=None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


class Embedding(nn.Module):
    """Parameter names are those under `model.`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)


class Head(nn.Module):
    """Final norm and LM head. Names: `norm.weight` lives under `model.`, `lm_head.weight` at top
    level; a tied model has no `lm_head` here and borrows the embedding's weight."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if not cfg.tie_word_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)


def rope_inv_freq(cfg: ModelConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention scaling, exactly as transformers computes them."""
    hf = cfg.hf_config
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        base = params.get("rope_theta", getattr(hf, "rope_theta", 10000.0))
        d = cfg.head_dim
        inv = 1.0 / (base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, scale = ROPE_INIT_FUNCTIONS[rope_type](hf, torch.device("cpu"))
    return inv.float(), float(scale)


def rope_cos_sin(inv_freq: torch.Tensor, scale: float, position_ids: torch.Tensor, dtype):
    """cos/sin tables for `position_ids` [B, S], shaped [B, 1, S, head_dim] for broadcasting."""
    freqs = position_ids[..., None].float() * inv_freq.to(position_ids.device)
    emb = torch.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos() * scale, emb.sin() * scale
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


def attention_mask(
    document_ids: torch.Tensor | None, seq_len: int, sliding_window: int | None, device
) -> torch.Tensor | None:
    """Boolean [B|1, 1, S, S] mask (True = attend) or None for plain causal attention.

    Packed sequences (`document_ids`) never attend across documents; Mistral's sliding window
    limits how far back a token looks.
    """
    window = sliding_window if sliding_window and sliding_window < seq_len else None
    if document_ids is None and window is None:
        return None
    i = torch.arange(seq_len, device=device)
    mask = i[:, None] >= i[None, :]
    if window is not None:
        mask = mask & (i[:, None] - i[None, :] < window)
    mask = mask[None, None]
    if document_ids is not None:
        same = document_ids[:, :, None] == document_ids[:, None, :]
        mask = mask & same[:, None]
    return mask
