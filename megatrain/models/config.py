"""Typed model configuration, built straight from a Hugging Face `config.json`."""

from __future__ import annotations

import copy
import dataclasses
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# Families that share the pre-norm attention of `decoder.py`; the flags say how they differ. The
# mixture-of-experts families (`moe.py`) replace the MLP with an expert block (`MoESpec`).
FAMILIES = {
    "llama": dict(qkv_bias=None, qk_norm=False),  # bias from `attention_bias`
    "mistral": dict(qkv_bias=False, qk_norm=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False),
    "qwen3": dict(qkv_bias=None, qk_norm=True),
    "mixtral": dict(qkv_bias=False, qk_norm=False),
    "qwen2_moe": dict(qkv_bias=True, qk_norm=False),
    "qwen3_moe": dict(qkv_bias=None, qk_norm=True),
    "olmoe": dict(qkv_bias=None, qk_norm="full"),  # q/k RMSNorm over all heads at once
}
# Sliding-window attention: Mistral's and Mixtral's `sliding_window` (Qwen's needs use_sliding_window).
_SLIDING = ("mistral", "mixtral")


@dataclass(frozen=True)
class MoESpec:
    """The expert layer of an MoE family, read from its Hugging Face config."""

    num_experts: int
    top_k: int
    """`num_experts_per_tok`."""
    expert_size: int
    """Each expert's intermediate size (`moe_intermediate_size`, Mixtral/OLMoE `intermediate_size`)."""
    norm_topk_prob: bool
    """Renormalise the top-k probabilities to sum to one (always for Mixtral)."""
    shared_expert_size: int = 0
    """Qwen2-MoE's always-on expert, scaled by a sigmoid gate; 0 for none."""
    fp32_scores: bool = False
    """Mixtral keeps the routing weights in fp32 when it scales the experts' outputs."""
    router_aux_loss_coef: float = 0.0
    output_router_logits: bool = False
    """Whether the loss includes `router_aux_loss_coef * aux_loss`, as in transformers."""

    @property
    def token_ffn(self) -> int:
        """The MLP width a token passes through: its top-k experts and the shared expert."""
        return self.top_k * self.expert_size + self.shared_expert_size

    def inactive_params(self, hidden: int) -> int:
        """Parameters of a layer's experts that one token is not routed to."""
        return (self.num_experts - self.top_k) * 3 * hidden * self.expert_size

    def layer_params(self, hidden: int) -> int:
        """Parameters of one layer's expert block: router, experts, shared expert and its gate."""
        n = self.num_experts * (3 * hidden * self.expert_size + hidden)
        if self.shared_expert_size:
            n += 3 * hidden * self.shared_expert_size + hidden
        return n


def _get(hf, name, default=None):
    v = getattr(hf, name, None)
    return default if v is None else v


def moe_spec(hf) -> MoESpec | None:
    """The MoE part of a transformers config, or None for a dense family. Refuses what the
    templates do not implement, naming the key."""
    mt = hf.model_type
    if mt not in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe"):
        return None
    if _get(hf, "router_jitter_noise", 0.0):
        raise ConfigError(f"{mt}: router_jitter_noise > 0 is not supported")
    if _get(hf, "clip_qkv") is not None:
        raise ConfigError(f"{mt}: clip_qkv is not supported")
    if _get(hf, "decoder_sparse_step", 1) != 1 or _get(hf, "mlp_only_layers", []):
        raise ConfigError(
            f"{mt}: dense layers among MoE ones (decoder_sparse_step, mlp_only_layers) are not supported"
        )
    mixtral = mt == "mixtral"
    return MoESpec(
        num_experts=hf.num_local_experts if mixtral else hf.num_experts,
        top_k=hf.num_experts_per_tok,
        expert_size=hf.intermediate_size if mt in ("mixtral", "olmoe") else hf.moe_intermediate_size,
        norm_topk_prob=True if mixtral else bool(hf.norm_topk_prob),
        shared_expert_size=hf.shared_expert_intermediate_size if mt == "qwen2_moe" else 0,
        fp32_scores=mixtral,
        router_aux_loss_coef=float(_get(hf, "router_aux_loss_coef", 0.0)),
        output_router_logits=bool(_get(hf, "output_router_logits", False)),
    )


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only model (Llama, Mistral, Qwen2, Qwen3 and the MoE
    families Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE)."""

    model_type: str
    """Hugging Face `model_type` (one of FAMILIES)."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    qkv_bias: bool
    """Bias on q/k/v projections (Qwen2; Llama with `attention_bias`)."""
    o_bias: bool
    """Bias on o_proj (Llama with `attention_bias` only)."""
    mlp_bias: bool
    qk_norm: bool
    """RMSNorm on q and k before RoPE: over head_dim (Qwen3), or over all heads (OLMoE)."""
    qk_norm_full: bool = False
    """The q/k RMSNorm spans all heads, before the split into heads (OLMoE)."""
    hidden_act: str = "silu"
    sliding_window: int | None = None
    """Mistral's local attention window; None means full causal attention."""
    max_position_embeddings: int = 4096
    pad_token_id: int | None = None
    """transformers' embedding `padding_idx`: that row gets no gradient from the input side."""
    moe: MoESpec | None = None
    """The expert layer of a mixture-of-experts family; None for a dense MLP."""
    hf_config: Any = field(default=None, repr=False, compare=False)
    """The transformers config object (kept for RoPE variants and for export)."""

    def __post_init__(self):
        if self.model_type not in FAMILIES:
            raise ConfigError(
                f"model_type {self.model_type!r} is not supported (supported: {', '.join(FAMILIES)})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.hidden_act not in ("silu", "swish"):
            raise ConfigError(f"hidden_act {self.hidden_act!r} is not supported (only silu)")

    @property
    def num_params(self) -> int:
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        attn = h * q + 2 * h * kv + q * h
        if self.qkv_bias:
            attn += q + 2 * kv
        if self.o_bias:
            attn += h
        if self.moe is not None:
            mlp = self.moe.layer_params(h)
        else:
            mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h if self.mlp_bias else 0)
        qk = q + kv if self.qk_norm_full else 2 * self.head_dim
        norms = 2 * h + (qk if self.qk_norm else 0)
        layer = attn + mlp + norms
        emb = self.vocab_size * h
        return emb * (1 if self.tie_word_embeddings else 2) + h + self.num_hidden_layers * layer

    def with_router(
        self, output_router_logits: bool | None, router_aux_loss_coef: float | None
    ) -> ModelConfig:
        """This MoE model with transformers' router-loss keys set (None: as its config.json has
        them), in the config it saves too, as `model.config.x = ...` does in transformers."""
        given = dict(output_router_logits=output_router_logits, router_aux_loss_coef=router_aux_loss_coef)
        given = {k: v for k, v in given.items() if v is not None}
        if not given:
            return self
        if self.moe is None:
            raise ConfigError(f"{', '.join(given)}: {self.model_type} is not a mixture-of-experts model")
        hf = copy.deepcopy(self.hf_config)
        for k, v in given.items():
            setattr(hf, k, v)
        return dataclasses.replace(self, moe=dataclasses.replace(self.moe, **given), hf_config=hf)

    @classmethod
    def from_hf(cls, hf) -> ModelConfig:
        """Build from a transformers `PretrainedConfig`."""
        mt = hf.model_type
        if mt not in FAMILIES:
            raise ConfigError(f"model_type {mt!r} is not supported (supported: {', '.join(FAMILIES)})")
        if getattr(hf, "use_sliding_window", False):
            raise ConfigError(f"{mt}: use_sliding_window=true is not supported")
        fam = FAMILIES[mt]
        attention_bias = bool(getattr(hf, "attention_bias", False))
        qkv_bias = attention_bias if fam["qkv_bias"] is None else fam["qkv_bias"]
        head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
        return cls(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=hf.intermediate_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.rms_norm_eps,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=attention_bias and mt in ("llama", "olmoe"),
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=bool(fam["qk_norm"]),
            qk_norm_full=fam["qk_norm"] == "full",
            hidden_act=hf.hidden_act,
            sliding_window=getattr(hf, "sliding_window", None) if mt in _SLIDING else None,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
            pad_token_id=getattr(hf, "pad_token_id", None),
            moe=moe_spec(hf),
            hf_config=hf,
        )

    @classmethod
    def from_json(cls, path: str | Path) -> ModelConfig:
        """Read a `config.json` file (or the directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        if not path.is_file():
            raise ConfigError(f"{path}: no such file (expected a Hugging Face config.json)")
        try:
            raw = json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path}: not valid JSON ({e})") from None
        mt = raw.get("model_type")
        if mt not in FAMILIES:
            raise ConfigError(
                f"{path}: model_type {mt!r} is not supported (supported: {', '.join(FAMILIES)})"
            )
        from transformers import AutoConfig

        try:
            hf = AutoConfig.for_model(**raw)
        except Exception as e:  # transformers validates rope parameters and friends
            raise ConfigError(f"{path}: {e}") from None
        return cls.from_hf(hf)
