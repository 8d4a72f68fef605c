"""gpt-oss (transformers' `GptOssForCausalLM`), with Hugging Face parameter names and semantics.

What differs from the other mixture-of-experts blocks (`moe.py`):
* attention sinks: a learned logit per head (`self_attn.sinks`) joins each query's softmax
  denominator and attends to nothing (`attention.attend`); q/k/v/o carry biases;
* layers alternate sliding-window and full attention (`layer_types`); YaRN rotary scaling, as
  every RoPE variant with fixed frequencies, is transformers' own (`decoder.rope_inv_freq`);
* the router has a bias and takes the top-k of its logits, then a softmax over those k;
* the experts are stored [E, in, out] (`gate_up_proj` [E, H, 2F], `down_proj` [E, F, H]) with
  biases, gate and up interleaved along 2F (gate at even columns), and a clamped SwiGLU:
  (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g), g = clamp(gate, max=limit);
* the norms multiply by their weight in fp32 before casting back (transformers keeps them fp32).

The checkpoints on the Hub store the experts in MXFP4; `mxfp4.py` decodes them on loading. The
auxiliary load-balancing loss is transformers' (`routing.py`), from the softmax of all the
router's logits.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .base import meta
from .config import ModelConfig
from .decoder import BLOCKS, Attention, Head, RMSNorm, layer_type, layer_type_inputs
from .moe import expert_counts, grouped_linear, route, router_balance

SWIGLU_ALPHA = 1.702  # the published models' gate scale


class GptOssRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (self.weight.float() * xf).to(x.dtype)  # (w * x) in fp32, then cast; Llama casts x first


class GptOssExperts(nn.Module):
    """E biased experts with the clamped SwiGLU, weights [E, in, out] as transformers has them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        E, h, f = cfg.moe.num_experts, cfg.hidden_size, cfg.moe.expert_size
        self.gate_up_proj = nn.Parameter(torch.empty(E, h, 2 * f))
        self.gate_up_proj_bias = nn.Parameter(torch.empty(E, 2 * f))
        self.down_proj = nn.Parameter(torch.empty(E, f, h))
        self.down_proj_bias = nn.Parameter(torch.empty(E, h))
        # transformers before 5.2x has no `swiglu_alpha` key: its experts use this constant.
        self.alpha = getattr(cfg.hf_config, "swiglu_alpha", SWIGLU_ALPHA)
        self.limit = cfg.hf_config.swiglu_limit

    def forward(self, x: torch.Tensor, idx: torch.Tensor, scores: torch.Tensor, counts: torch.Tensor):
        """x [T, H]; idx, scores [T, k]: each token's experts and routing weights; counts [E]."""
        return route(x, idx, scores, counts, self.mlp)

    def mlp(self, xs: torch.Tensor, offs: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
        """Rows sorted by expert through their expert. The biases are looked up per row as an
        embedding: its backward sums each expert's rows deterministically, on CUDA too."""
        gate_up = grouped_linear(xs, self.gate_up_proj, offs) + F.embedding(experts, self.gate_up_proj_bias)
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        gate = gate.clamp(max=self.limit)
        up = up.clamp(min=-self.limit, max=self.limit)
        h = (up + 1) * (gate * torch.sigmoid(gate * self.alpha))
        return grouped_linear(h, self.down_proj, offs) + F.embedding(experts, self.down_proj_bias)


class GptOssMoE(nn.Module):
    """Router (biased; softmax over the top-k logits) and experts. Names: under `mlp.`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.top_k, self.num_experts = cfg.moe.top_k, cfg.moe.num_experts
        self.router = nn.Linear(cfg.hidden_size, self.num_experts)
        self.experts = GptOssExperts(cfg)

    def forward(self, x: torch.Tensor):
        """Output [B, S, H] and the router's choice: each token's experts [T, k] and the softmax
        of all its logits [T, E] (fp32), what transformers' aux loss reads."""
        flat = x.reshape(-1, x.shape[-1])
        logits = self.router(flat)
        top, idx = logits.topk(self.top_k, dim=-1)
        scores = F.softmax(top, dim=-1)  # in the logits' dtype, as transformers
        y = self.experts(flat, idx, scores, expert_counts(idx, self.num_experts))
        return y.view(x.shape), (idx, F.softmax(logits, dim=-1).float())


class GptOssLayer(nn.Module):
    """A pre-norm block: attention with sinks, then the expert block; returns (output, router
    choice). Names: those under `model.layers.{i}.`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg, sinks=True)
        self.mlp = GptOssMoE(cfg)
        self.input_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, mask=None):
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        y, router = self.mlp(self.post_attention_layernorm(x))
        return x + y, router


class GptOssHead(Head):
    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.norm = GptOssRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


# Llama's embedding and checkpoint keys (every tensor under its transformers name, the experts
# one fused tensor each, as `save_pretrained` writes them); sliding and full layers share one
# template and differ in their masks. Sinks need FlexAttention on CUDA, so every row takes a
# block mask there.
GPT_OSS = dataclasses.replace(
    BLOCKS["llama"],
    name="gpt_oss",
    layer=lambda cfg, i: meta(lambda: GptOssLayer(cfg)),
    layer_kind=layer_type,
    inputs=lambda cfg, device: layer_type_inputs(cfg, device, always_mask=True),
    head=lambda cfg: meta(lambda: GptOssHead(cfg)),
    aux=router_balance,
)
