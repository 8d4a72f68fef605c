"""DeepSeek-V2 and DeepSeek-V3 (and Kimi-K2, a DeepSeek-V3): multi-head latent attention and
routed experts, with Hugging Face parameter names and transformers' arithmetic.

What differs from `decoder.py`'s block:
* Attention (`LatentAttention`): the query goes through a low-rank path (`q_a_proj`, an RMSNorm,
  `q_b_proj`) or one `q_proj`; `kv_a_proj_with_mqa` gives one compressed latent (normed, then
  expanded per head by `kv_b_proj` into keys and values) and a rotary key part shared by every
  head. Only the last `qk_rope_head_dim` dimensions of each head rotate, in interleaved pairs
  (DeepSeek's weights); values are narrower than queries and keys. The scores are scaled by
  1/sqrt(qk head dim) times YaRN's mscale squared (config.MLASpec).
* Experts (`DeepseekMoE`): a router with sigmoid (V3) or softmax (V2) scores, an expert choice
  limited to the best groups of experts, weights optionally renormalised and multiplied by
  `routed_scaling_factor`; V3 adds `e_score_correction_bias` to the scores for the choice only.
  That bias is a buffer in transformers, trained by no loss: here a frozen parameter (no
  gradient, no optimizer, but in checkpoints and exports). The routed experts are `moe.py`'s
  grouped-matmul `Experts`, with its per-expert checkpoint pieces; shared experts are a plain
  gated MLP, always on.
* The first `first_k_dense_replace` layers have a dense MLP: two layer templates (`layer_key`).
transformers computes no load-balancing loss for these models: the layers return hidden states.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .attention import Mask, attend, attention_mask
from .base import meta
from .config import NO_BALANCE_LOSS, ModelConfig, MoESpec
from .decoder import BLOCKS, MLP, RMSNorm, apply_rope, rope_cos_sin, rope_inv_freq
from .moe import Experts, checkpoint_pieces

LATENT_NORM_EPS = 1e-6  # transformers builds the q and kv latent norms with RMSNorm's default eps


@dataclass(frozen=True)
class Router:
    """How a DeepSeek router scores and chooses experts, read from its Hugging Face config."""

    sigmoid: bool
    """Independent sigmoid scores (V3); else a softmax over the experts (V2)."""
    correction_bias: bool
    """V3's `e_score_correction_bias`, added to the scores to choose experts, not to weigh them."""
    groups: int
    topk_groups: int
    """Experts are chosen among the `topk_groups` best of `groups` equal groups (1, 1: all)."""
    group_by_top2: bool
    """A group's score: the sum of its two best scores (V3), or its best (V2)."""
    norm_topk_prob: bool
    scale: float
    """`routed_scaling_factor`: the chosen experts' weights are multiplied by it."""


def router_of(hf) -> Router:
    """The router of a DeepSeek config; refuses, naming the key, what transformers' router does not run."""
    mt, E, k = hf.model_type, hf.n_routed_experts, hf.num_experts_per_tok
    v3 = mt == "deepseek_v3"
    method = "noaux_tc" if v3 else getattr(hf, "topk_method", "greedy")
    if method not in ("greedy", "group_limited_greedy", "noaux_tc"):
        raise ConfigError(f"{mt}: topk_method {method!r} is not supported (greedy, group_limited_greedy)")
    grouped = method != "greedy"
    groups, top = (hf.n_group or 1, hf.topk_group or 1) if grouped else (1, 1)
    if E % groups or not 1 <= top <= groups:
        raise ConfigError(
            f"{mt}: n_group ({groups}) must divide n_routed_experts ({E}) and be >= topk_group ({top})"
        )
    if k > top * E // groups:
        raise ConfigError(f"{mt}: num_experts_per_tok ({k}) exceeds the experts of topk_group groups")
    if v3 and top < groups and E // groups < 2:
        raise ConfigError(f"{mt}: groups of one expert ({E} experts, n_group {groups}) have no top-2 score")
    return Router(
        sigmoid=v3,
        correction_bias=v3,
        groups=groups,
        topk_groups=top,
        group_by_top2=v3,
        norm_topk_prob=v3 and bool(hf.norm_topk_prob),  # transformers' V2 router never renormalises
        scale=float(hf.routed_scaling_factor),
    )


def moe_spec(hf) -> MoESpec:
    """The expert layers of a DeepSeek config (config.moe_spec), its router checked."""
    mt = hf.model_type
    rule = router_of(hf)
    if getattr(hf, "output_router_logits", False):
        raise ConfigError(f"output_router_logits: {NO_BALANCE_LOSS.format(mt=mt)}")
    if hf.hidden_act != "silu":
        raise ConfigError(f"{mt}: hidden_act {hf.hidden_act!r} is not supported in the experts (silu)")
    return MoESpec(
        num_experts=hf.n_routed_experts,
        top_k=hf.num_experts_per_tok,
        expert_size=hf.moe_intermediate_size,
        norm_topk_prob=rule.norm_topk_prob,
        shared_expert_size=hf.n_shared_experts * hf.moe_intermediate_size,
        fp32_scores=True,  # the router's weights stay fp32 when they scale the experts' outputs
        dense_layers=min(hf.first_k_dense_replace or 0, hf.num_hidden_layers),
        balance_loss=False,
    )


# ---------------------------------------------------------------------------- attention
def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, fp32: bool) -> torch.Tensor:
    """Rotate the interleaved pairs (x0, x1), (x2, x3), ... of x [B, H, S, r] by cos/sin [B, 1, S, r]
    (each angle twice, as `rope_cos_sin` makes them); the result lists the pairs' first halves,
    then their second halves, as transformers' `apply_rotary_pos_emb_interleave` does (queries
    and keys alike, so the scores do not change). `fp32`: in fp32, cast back (DeepSeek-V2's
    complex product)."""
    dtype = x.dtype
    if fp32:
        x = x.float()
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(dtype)


def attend_latent(q, k, v, mask: Mask, scale: float, pad: bool) -> torch.Tensor:
    """Attention with values narrower than queries and keys. `pad`: v padded with zeros to the
    qk width and the output cut back, for SDPA's flash kernel (CUDA, unmasked rows), which takes
    only equal widths; the extra output columns are zeros, so nothing else changes. FlexAttention
    (masked rows) and the CPU take v as it is."""
    dv = v.shape[-1]
    if not pad or dv >= q.shape[-1]:
        return attend(q, k, v, mask, scale)
    return attend(q, k, F.pad(v, (0, q.shape[-1] - dv)), mask, scale)[..., :dv]


class LatentAttention(nn.Module):
    """Multi-head latent attention; names under `model.layers.{i}.self_attn.`."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        m, h, b = cfg.mla, cfg.hidden_size, cfg.qkv_bias
        self.spec, self.n_heads = m, cfg.num_attention_heads
        q_out = self.n_heads * m.qk_head_dim
        # Declared in transformers' order, so parameters iterate in the checkpoint's order.
        if m.q_lora_rank is None:
            self.q_proj = nn.Linear(h, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(h, m.q_lora_rank, bias=b)
            self.q_a_layernorm = RMSNorm(m.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(m.q_lora_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(h, m.kv_lora_rank + m.qk_rope_head_dim, bias=b)
        self.kv_a_layernorm = RMSNorm(m.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(
            m.kv_lora_rank, self.n_heads * (m.qk_nope_head_dim + m.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(self.n_heads * m.v_head_dim, h, bias=cfg.o_bias)

    def rotate(self, x: torch.Tensor, rope) -> torch.Tensor:
        if self.spec.rope_interleave:
            return rotate_pairs(x, *rope, fp32=self.spec.rope_fp32)
        return apply_rope(x, *rope)

    def forward(self, x: torch.Tensor, rope, mask: Mask) -> torch.Tensor:
        m, H = self.spec, self.n_heads
        B, S, _ = x.shape
        q = self.q_proj(x) if m.q_lora_rank is None else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_pass, q_rot = (
            q.view(B, S, H, m.qk_head_dim)
            .transpose(1, 2)
            .split([m.qk_nope_head_dim, m.qk_rope_head_dim], dim=-1)
        )
        latent, k_rot = self.kv_a_proj_with_mqa(x).split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(B, S, H, -1).transpose(1, 2)
        k_pass, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
        k_rot = self.rotate(k_rot.view(B, 1, S, m.qk_rope_head_dim), rope)  # one rotary key for all heads
        q = torch.cat([q_pass, self.rotate(q_rot, rope)], dim=-1)
        k = torch.cat([k_pass, k_rot.expand(B, H, S, m.qk_rope_head_dim)], dim=-1)
        y = attend_latent(q, k, v, mask, m.softmax_scale, pad=q.is_cuda and mask is None)
        return self.o_proj(y.transpose(1, 2).reshape(B, S, H * m.v_head_dim))


# ---------------------------------------------------------------------------- experts
class TopkRouter(nn.Module):
    """transformers' DeepSeek router (`mlp.gate.`): scores in fp32, the group-limited choice, the
    chosen experts' weights."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.rule, self.top_k = router_of(cfg.hf_config), cfg.moe.top_k
        self.weight = nn.Parameter(torch.empty(cfg.moe.num_experts, cfg.hidden_size))
        if self.rule.correction_bias:
            # A buffer in transformers (no loss trains it), kept in checkpoints: frozen here.
            self.e_score_correction_bias = nn.Parameter(torch.empty(cfg.moe.num_experts), requires_grad=False)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts [T, k] and their weights (fp32) for x [T, hidden]."""
        r = self.rule
        logits = F.linear(x.float(), self.weight.float())
        scores = logits.sigmoid() if r.sigmoid else logits.softmax(dim=-1, dtype=torch.float32)
        choice = scores + self.e_score_correction_bias.float() if r.correction_bias else scores
        if r.topk_groups < r.groups:
            grouped = choice.view(-1, r.groups, choice.shape[-1] // r.groups)
            best = grouped.topk(2, dim=-1)[0].sum(dim=-1) if r.group_by_top2 else grouped.amax(dim=-1)
            keep = torch.zeros_like(best).scatter_(1, best.topk(r.topk_groups, dim=-1, sorted=False)[1], 1.0)
            keep = keep.bool()[..., None].expand_as(grouped).reshape(choice.shape)
            # V3 never picks an expert of a dropped group; V2's zeros cannot beat a kept group's
            # scores, as num_experts_per_tok <= the kept experts (router_of)
            choice = choice.masked_fill(~keep, float("-inf") if r.correction_bias else 0.0)
        idx = choice.topk(self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, idx)
        if r.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weights * r.scale


class DeepseekMoE(nn.Module):
    """Routed experts and shared experts (`mlp.`): y = experts(x) + shared_experts(x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        spec = cfg.moe
        self.num_experts = spec.num_experts
        self.experts = Experts(spec.num_experts, cfg.hidden_size, spec.expert_size)
        self.gate = TopkRouter(cfg)
        self.shared_experts = MLP(dataclasses.replace(cfg, intermediate_size=spec.shared_expert_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, x.shape[-1])
        idx, weights = self.gate(flat)
        ones = torch.ones_like(idx.reshape(-1))
        counts = torch.zeros(self.num_experts, dtype=idx.dtype, device=x.device).scatter_add_(
            0, idx.reshape(-1), ones
        )
        return self.experts(flat, idx, weights, counts).view(x.shape) + self.shared_experts(x)


class DeepseekLayer(nn.Module):
    """One block: latent attention, then a dense MLP (the first `dense_layers`) or experts."""

    def __init__(self, cfg: ModelConfig, moe: bool):
        super().__init__()
        self.self_attn = LatentAttention(cfg)
        self.mlp = DeepseekMoE(cfg) if moe else MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: torch.Tensor, rope, mask: Mask = None) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), rope, mask)
        return x + self.mlp(self.post_attention_layernorm(x))


def _layer_key(cfg: ModelConfig, i: int) -> str:
    return "dense" if i < cfg.moe.dense_layers else "moe"


def _inputs(cfg: ModelConfig, device: torch.device):
    inv_freq, scale = rope_inv_freq(cfg)  # over qk_rope_head_dim (the config's head_dim), YaRN included
    inv_freq = inv_freq.to(device)
    fp32 = cfg.mla.rope_fp32  # V2 rotates with fp32 tables

    def inputs(position_ids, document_ids, seq_len, dtype, flex):
        rope = rope_cos_sin(inv_freq, scale, position_ids, torch.float32 if fp32 else dtype)
        mask = attention_mask(document_ids, seq_len, None, position_ids.device, flex)
        return {"layer": {"rope": rope, "mask": mask}}

    return inputs


# Llama's embedding, head and checkpoint keys; two layer templates; the experts' checkpoint pieces.
DEEPSEEK = dataclasses.replace(
    BLOCKS["llama"],
    name="deepseek",
    layer=lambda cfg, i: meta(lambda: DeepseekLayer(cfg, _layer_key(cfg, i) == "moe")),
    layer_key=_layer_key,
    inputs=_inputs,
    pieces=checkpoint_pieces,
)
