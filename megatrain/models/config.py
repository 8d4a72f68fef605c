"""Typed model configuration, built straight from a Hugging Face `config.json`."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# Families that share the pre-norm decoder block in `decoder.py`; the flags say how they differ.
FAMILIES = {
    "llama": dict(qkv_bias=None, qk_norm=False),  # bias from `attention_bias`
    "mistral": dict(qkv_bias=False, qk_norm=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False),
    "qwen3": dict(qkv_bias=None, qk_norm=True),
}


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only model (Llama, Mistral, Qwen2, Qwen3)."""

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
    """RMSNorm over head_dim on q and k before RoPE (Qwen3)."""
    hidden_act: str = "silu"
    sliding_window: int | None = None
    """Mistral's local attention window; None means full causal attention."""
    max_position_embeddings: int = 4096
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
        mlp = 3 * h * self.intermediate_size + (2 * self.intermediate_size + h if self.mlp_bias else 0)
        norms = 2 * h + (2 * self.head_dim if self.qk_norm else 0)
        layer = attn + mlp + norms
        emb = self.vocab_size * h
        return emb * (1 if self.tie_word_embeddings else 2) + h + self.num_hidden_layers * layer

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
            o_bias=attention_bias and mt == "llama",
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=fam["qk_norm"],
            hidden_act=hf.hidden_act,
            sliding_window=getattr(hf, "sliding_window", None) if mt == "mistral" else None,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
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
