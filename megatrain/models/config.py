"""Typed model configuration, built straight from a Hugging Face `config.json`."""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import ConfigError

# Model types with a fast block (`block`: its name in decoder.BLOCKS); the flags say how the
# families sharing a block differ. Every other decoder transformers knows runs on the generic path.
# None: the bias follows `attention_bias`, the q/k norm `use_qk_norm`; `eps`: the config key of
# the norms' epsilon (default rms_norm_eps); `window`: one sliding window for every layer.
# The mixture-of-experts families (block `moe`, `moe.py`) replace the MLP with an expert block
# (`MoESpec`); `qk_norm="full"`: one q/k RMSNorm over all heads, before the split (OLMoE).
# gpt-oss has a block of its own (`gpt_oss.py`): attention sinks, biased experts, clamped SwiGLU.
FAMILIES = {
    "llama": dict(block="llama", qkv_bias=None, o_bias=None, qk_norm=False),
    "mistral": dict(block="llama", qkv_bias=False, o_bias=False, qk_norm=False, window=True),
    "qwen2": dict(block="llama", qkv_bias=True, o_bias=False, qk_norm=False),
    "qwen3": dict(block="llama", qkv_bias=None, o_bias=None, qk_norm=True),
    "phi3": dict(block="phi3", qkv_bias=False, o_bias=False, qk_norm=False, window=True),
    "olmo2": dict(block="olmo2", qkv_bias=None, o_bias=None, qk_norm=False),
    "cohere": dict(block="cohere", qkv_bias=None, o_bias=None, qk_norm=None, eps="layer_norm_eps"),
    "gemma2": dict(block="gemma", qkv_bias=None, o_bias=None, qk_norm=False),
    "gemma3_text": dict(block="gemma", qkv_bias=None, o_bias=None, qk_norm=True),
    "mixtral": dict(block="moe", qkv_bias=False, o_bias=False, qk_norm=False, window=True),
    "qwen2_moe": dict(block="moe", qkv_bias=True, o_bias=False, qk_norm=False),
    "qwen3_moe": dict(block="moe", qkv_bias=None, o_bias=None, qk_norm=True),
    "olmoe": dict(block="moe", qkv_bias=None, o_bias=None, qk_norm="full"),
    "gpt_oss": dict(block="gpt_oss", qkv_bias=None, o_bias=None, qk_norm=False),
    # Latent attention and routed experts, dense MLPs in the first layers (`deepseek.py`); Kimi-K2
    # is a DeepSeek-V3 (MODEL_TYPE_ALIASES).
    "deepseek_v2": dict(block="deepseek", qkv_bias=None, o_bias=None, qk_norm=False),
    "deepseek_v3": dict(block="deepseek", qkv_bias=None, o_bias=None, qk_norm=False),
    # The language models of Qwen2-VL and Qwen2.5-VL (Qwen2's block) and Qwen3-VL (Qwen3's); their
    # 3D (M-RoPE) positions are the vision-language model's inputs (vision.py), one position for
    # all three in text.
    "qwen2_vl_text": dict(block="llama", qkv_bias=True, o_bias=False, qk_norm=False),
    "qwen2_5_vl_text": dict(block="llama", qkv_bias=True, o_bias=False, qk_norm=False),
    "qwen3_vl_text": dict(block="llama", qkv_bias=None, o_bias=None, qk_norm=True),
}
MOE_BLOCKS = ("moe", "gpt_oss", "deepseek")
"""The blocks whose MLP is a mixture of experts (their configs have a `MoESpec`; their model types
refuse the generic path, hf.py)."""
# Why the router-loss keys are refused where transformers adds no auxiliary loss.
NO_BALANCE_LOSS = "transformers' {mt} has no auxiliary load-balancing loss to add"
# config.json model types that transformers implements under another name (their custom code is
# that model's): Kimi-K2 ships DeepSeek-V3's code under its own name.
MODEL_TYPE_ALIASES = {"kimi_k2": "deepseek_v3"}


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
    expert_bias: bool = False
    """Biases on the router and on each expert's projections (gpt-oss)."""
    dense_layers: int = 0
    """Leading layers whose MLP is dense, not experts (DeepSeek's `first_k_dense_replace`)."""
    balance_loss: bool = True
    """Whether transformers has a load-balancing loss for the family (DeepSeek has none)."""

    @property
    def token_ffn(self) -> int:
        """The MLP width a token passes through: its top-k experts and the shared expert."""
        return self.top_k * self.expert_size + self.shared_expert_size

    def expert_params(self, hidden: int) -> int:
        """Parameters of one expert (its gate, up and down projections, and their biases)."""
        bias = 2 * self.expert_size + hidden if self.expert_bias else 0
        return 3 * hidden * self.expert_size + bias

    def inactive_params(self, hidden: int) -> int:
        """Parameters of a layer's experts that one token is not routed to."""
        return (self.num_experts - self.top_k) * self.expert_params(hidden)

    def layer_params(self, hidden: int) -> int:
        """Parameters of one layer's expert block: router, experts, shared expert and its gate."""
        router = self.num_experts * (hidden + self.expert_bias)
        n = self.num_experts * self.expert_params(hidden) + router
        if self.shared_expert_size:
            n += 3 * hidden * self.shared_expert_size + hidden
        return n


@dataclass(frozen=True)
class VisionSpec:
    """The vision side of a vision-language model (transformers' image-text-to-text classes):
    what vision.py builds its tower and projector from, and which of them train."""

    model_type: str
    """The composite model's `model_type` (`llava`, `idefics3`, `qwen2_5_vl`, ...)."""
    hf_config: Any = field(repr=False, compare=False)
    """The composite transformers config (what an export saves)."""
    image_token_id: int
    tower: tuple[str, ...]
    """Module paths, in the composite base model, of the vision tower (LlamaFactory's
    `vision_model_keys`)."""
    projector: tuple[str, ...]
    """Module paths of the multi-modal projector (LlamaFactory's `projector_key`)."""
    text_model: str
    """The language model's attribute in the composite base model (`language_model`, `text_model`)."""
    mrope: bool = False
    """The language model's rotary takes 3D positions computed from the images' grids (M-RoPE)."""
    bidirectional: bool = False
    """Each image's tokens attend to all of their image, later ones too (Gemma 3), on top of the
    causal rule and the sliding window (models/attention.py)."""
    unused: tuple[str, ...] = ()
    """Tower parameters (names in the base model) no image feature depends on (LLaVA's layers
    after its `vision_feature_layer`): frozen whatever the settings, as transformers never steps
    them."""
    # What the run trains (freeze_vision_tower, freeze_multi_modal_projector), not the architecture:
    # a checkpoint of the same model with other settings is the same model.
    train_tower: bool = field(default=False, compare=False)
    train_projector: bool = field(default=False, compare=False)

    @property
    def trains(self) -> bool:
        """Whether any vision parameter trains (the backward sweep then recomputes the features)."""
        return self.train_tower or self.train_projector


@dataclass(frozen=True)
class MLASpec:
    """Multi-head latent attention (DeepSeek-V2/V3), read from its Hugging Face config: queries
    through an optional low-rank path, each head's key and value expanded from one compressed
    latent, and a rotary part per head whose key is shared by all heads."""

    q_lora_rank: int | None
    """Rank of the query's low-rank path (None: one q_proj)."""
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    rope_interleave: bool
    """Rotary dimensions pair as (0, 1), (2, 3), ... (DeepSeek's weights), not as two halves."""
    rope_fp32: bool
    """The rotation runs in fp32 whatever the compute dtype (DeepSeek-V2's complex product)."""
    softmax_scale: float
    """1/sqrt(qk head dim), times YaRN's mscale(factor, mscale_all_dim) squared (transformers'
    `yarn_apply_mscale`)."""

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def mla_spec(hf) -> MLASpec | None:
    """The latent attention of a DeepSeek config, or None for other families."""
    mt = hf.model_type
    if FAMILIES.get(mt, {}).get("block") != "deepseek":
        return None
    if hf.num_key_value_heads != hf.num_attention_heads:
        raise ConfigError(
            f"{mt}: num_key_value_heads ({hf.num_key_value_heads}) must equal num_attention_heads "
            f"({hf.num_attention_heads}): latent attention expands a key and value for every head"
        )
    qk = hf.qk_nope_head_dim + hf.qk_rope_head_dim
    scale = qk**-0.5
    rope = getattr(hf, "rope_parameters", None) or {}
    if rope.get("rope_type", "default") != "default" and rope.get("mscale_all_dim", 0):
        m = _yarn_mscale(rope["factor"], rope["mscale_all_dim"])
        scale = scale * m * m
    v2 = mt == "deepseek_v2"
    return MLASpec(
        q_lora_rank=hf.q_lora_rank,
        kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim,
        v_head_dim=hf.v_head_dim,
        rope_interleave=True if v2 else bool(hf.rope_interleave),
        rope_fp32=v2,
        softmax_scale=scale,
    )


def _get(hf, name, default=None):
    v = getattr(hf, name, None)
    return default if v is None else v


@dataclass(frozen=True)
class Hooks:
    """What reading a config and counting its parameters take from the modules built on this one.
    They import this module, so it cannot import them: models/__init__.py hands them in (`HOOKS`)
    before any config is read."""

    deepseek_moe: Callable[[Any], MoESpec]
    """DeepSeek's expert layers, its router checked (deepseek.moe_spec: its rules live with its block)."""
    generic_attention: Callable[[Any], str]
    """The generic path's attention, or a ConfigError naming why a model cannot train (hf.py)."""
    skeleton: Callable[[ModelConfig], Any]
    """transformers' model built on the meta device, refusing what cannot run (hf.py)."""
    count_params: Callable[[ModelConfig], int]
    """Parameters counted on the templates (family.py)."""
    vision: Callable[[Any], tuple[Any, VisionSpec] | None]
    """A vision-language config's language-model config and vision spec; None for any other
    config (vision.py: which composite models train, and their modules)."""


HOOKS: Hooks | None = None  # set by models/__init__.py, which every import of this module runs first


def moe_spec(hf) -> MoESpec | None:
    """The MoE part of a transformers config, or None for a dense family. Refuses what the
    templates do not implement, naming the key."""
    mt = hf.model_type
    block = FAMILIES.get(mt, {}).get("block")
    if block == "deepseek":
        return HOOKS.deepseek_moe(hf)
    if block not in MOE_BLOCKS:
        return None
    if _get(hf, "router_jitter_noise", 0.0):
        raise ConfigError(f"{mt}: router_jitter_noise > 0 is not supported")
    if _get(hf, "clip_qkv") is not None:
        raise ConfigError(f"{mt}: clip_qkv is not supported")
    if _get(hf, "decoder_sparse_step", 1) != 1 or _get(hf, "mlp_only_layers", []):
        raise ConfigError(
            f"{mt}: dense layers among MoE ones (decoder_sparse_step, mlp_only_layers) are not supported"
        )
    mixtral, gpt_oss = mt == "mixtral", mt == "gpt_oss"
    dense_size = mt in ("mixtral", "olmoe", "gpt_oss")  # the experts' size is `intermediate_size`
    return MoESpec(
        num_experts=hf.num_local_experts if mixtral or gpt_oss else hf.num_experts,
        top_k=hf.num_experts_per_tok,
        expert_size=hf.intermediate_size if dense_size else hf.moe_intermediate_size,
        # gpt-oss: a softmax over the top-k logits, the top-k probabilities renormalised
        norm_topk_prob=True if mixtral or gpt_oss else bool(hf.norm_topk_prob),
        shared_expert_size=hf.shared_expert_intermediate_size if mt == "qwen2_moe" else 0,
        fp32_scores=mixtral,
        router_aux_loss_coef=float(_get(hf, "router_aux_loss_coef", 0.0)),
        output_router_logits=bool(_get(hf, "output_router_logits", False)),
        expert_bias=gpt_oss,
    )


# RoPE whose frequencies change with the sequence length: transformers' own rotary module
# (the generic path) updates them as it goes.
DYNAMIC_ROPE = ("dynamic", "longrope")


def _rope_type(hf) -> str:
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if params and all(isinstance(v, dict) for v in params.values()):  # per layer type (Gemma 3)
        types = {_rope_type_of(v) for v in params.values()}
        return next((t for t in types if t in DYNAMIC_ROPE), "default")
    return _rope_type_of(params)


def _rope_type_of(params: dict) -> str:
    return params.get("rope_type", params.get("type", "default"))


def _check_quantization(hf) -> None:
    """Refuse a quantised checkpoint whose tensors are not decoded on loading: only MXFP4 ones are
    (`mxfp4.py`, gpt-oss as published); others would load their raw integers as weights."""
    from .mxfp4 import QUANT_METHOD

    quant = getattr(hf, "quantization_config", None)
    if quant is None:
        return
    method = quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
    if method != QUANT_METHOD:
        raise ConfigError(
            f"quantization_config: {method} checkpoints are not supported (full-precision weights train "
            f"here; of quantised ones only {QUANT_METHOD} is decoded on loading)"
        )


@dataclass
class ModelConfig:
    """Shape and numerics of a decoder-only model: a fast block's flags (FAMILIES), or a model
    that runs on the generic path through transformers' own modules (`path`)."""

    model_type: str
    """Hugging Face `model_type`."""
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    """Epsilon of the block's norms (RMSNorm, or Cohere's LayerNorm: its `layer_norm_eps`)."""
    tie_word_embeddings: bool
    qkv_bias: bool
    """Bias on q/k/v projections (Qwen2; Llama with `attention_bias`)."""
    o_bias: bool
    """Bias on o_proj (Llama and Qwen3 with `attention_bias`)."""
    mlp_bias: bool
    qk_norm: bool
    """RMSNorm on q and k before RoPE: over head_dim (Qwen3), or over all heads (OLMoE)."""
    qk_norm_full: bool = False
    """The q/k RMSNorm spans all heads, before the split into heads (OLMoE)."""
    hidden_act: str = "silu"
    sliding_window: int | None = None
    """Mistral's local attention window; None means full causal attention."""
    max_position_embeddings: int = 4096
    path: str = "fast"
    """`fast` (a block of FAMILIES) or `generic` (transformers' own layer modules, `hf.py`)."""
    attn_implementation: str | None = None
    """The generic path's attention: `sdpa` where transformers supports it for the family, else
    `eager` (both exact)."""
    moe: MoESpec | None = None
    """The expert layer of a mixture-of-experts family; None for a dense MLP."""
    mla: MLASpec | None = None
    """DeepSeek's latent attention (q/kv low-rank paths, qk and v head dims); None otherwise."""
    vision: VisionSpec | None = None
    """A vision-language model's tower and projector (vision.py), part of its embedding unit;
    None: a text model. The rest of the config is its language model's."""
    num_labels: int | None = None
    """A sequence-classification model's outputs (a reward model's 1: models/score.py), its score
    head in place of the LM head; None: a causal LM."""
    hf_config: Any = field(default=None, repr=False, compare=False)
    """The transformers config object (kept for RoPE variants and for export)."""

    def __post_init__(self):
        if self.path == "fast" and self.model_type not in FAMILIES:
            raise ConfigError(
                f"model_type {self.model_type!r} has no fast block (fast: {', '.join(FAMILIES)})"
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    @property
    def block(self) -> str:
        """The fast block that runs this model (decoder.BLOCKS)."""
        return FAMILIES[self.model_type]["block"]

    @property
    def num_params(self) -> int:
        """Parameters of the model, counted on its templates (whatever the family)."""
        return HOOKS.count_params(self)

    @property
    def windows(self) -> list[int | None]:
        """Each layer's sliding attention window (None: full causal attention)."""
        hf = self.hf_config
        types = getattr(hf, "layer_types", None)
        if types is not None:  # Gemma 2/3, gpt-oss, Qwen2/3: per layer
            return [hf.sliding_window if t == "sliding_attention" else None for t in types]
        if self.path == "fast":
            return [self.sliding_window] * self.num_hidden_layers
        # Mistral-style: one window for every layer, if any
        window = getattr(hf, "sliding_window", None)
        return [window if getattr(hf, "use_sliding_window", True) else None] * self.num_hidden_layers

    @property
    def attention_width(self) -> int:
        """Heads x the head width of the attention's q.k and p.v products (for FLOP counts): the
        mean of the two in latent attention, whose values are narrower."""
        if self.mla is not None:
            return self.num_attention_heads * (self.mla.qk_head_dim + self.mla.v_head_dim) // 2
        return self.num_attention_heads * self.head_dim

    @property
    def needs_mask(self) -> bool:
        """Whether attention takes an explicit mask even for unpacked rows (for the memory plan)."""
        images = self.vision is not None and self.vision.bidirectional
        return any(self.windows) or self.attn_implementation == "eager" or images

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
        if not self.moe.balance_loss and (output_router_logits or router_aux_loss_coef is not None):
            raise ConfigError(f"{', '.join(given)}: {NO_BALANCE_LOSS.format(mt=self.model_type)}")
        hf = copy.deepcopy(self.hf_config)
        for k, v in given.items():
            setattr(hf, k, v)
        return dataclasses.replace(self, moe=dataclasses.replace(self.moe, **given), hf_config=hf)

    def with_vision(self, freeze_vision_tower: bool, freeze_multi_modal_projector: bool) -> ModelConfig:
        """This vision-language model with its tower and projector frozen or trained, as
        LlamaFactory's keys say; a text model is returned as it is."""
        if self.vision is None:
            return self
        spec = dataclasses.replace(
            self.vision, train_tower=not freeze_vision_tower, train_projector=not freeze_multi_modal_projector
        )
        return dataclasses.replace(self, vision=spec)

    @property
    def name(self) -> str:
        """The model_type a run names the model by: a vision-language model's composite one."""
        return self.vision.model_type if self.vision is not None else self.model_type

    @property
    def saved_config(self):
        """The transformers config a checkpoint or export saves: a vision-language model's
        composite one, else the model's own."""
        return self.vision.hf_config if self.vision is not None else self.hf_config

    def with_score_head(self, pad_token_id: int | None) -> ModelConfig:
        """This model as a reward model (transformers' `...ForSequenceClassification`, one label):
        the score head in place of the LM head, nothing tied to the embedding; its config the one
        `AutoModelForSequenceClassification` reads, `pad_token_id` the token it scores before."""
        hf = copy.deepcopy(self.hf_config)
        hf.num_labels = 1
        hf.pad_token_id = pad_token_id
        hf.tie_word_embeddings = False
        return dataclasses.replace(self, num_labels=1, tie_word_embeddings=False, hf_config=hf)

    @classmethod
    def from_hf(cls, hf) -> ModelConfig:
        """Build from a transformers `PretrainedConfig`: a fast block where one fits (FAMILIES,
        without Qwen's optional sliding window), else the generic path (which refuses, naming the
        reason, what cannot train as a decoder)."""
        mt = hf.model_type
        _check_quantization(hf)
        vlm = HOOKS.vision(hf)  # refuses, naming why, a composite model that cannot train
        if vlm is not None:
            text, spec = vlm
            cfg = cls.from_hf(text)
            if cfg.moe is not None or cfg.mla is not None:
                raise ConfigError(f"model_type {mt!r}: a mixture-of-experts language model is not supported")
            if spec.mrope and cfg.path != "fast":
                raise ConfigError(
                    f"model_type {mt!r}: its language model ({text.model_type}) has no fast block"
                )
            return dataclasses.replace(cfg, vision=spec)
        act = getattr(hf, "hidden_act", None) or getattr(hf, "hidden_activation", None) or ""
        fast = (
            mt in FAMILIES
            and not any(getattr(hf, k, False) for k in ("use_sliding_window", "use_bidirectional_attention"))
            and _rope_type(hf) not in DYNAMIC_ROPE
        )
        if not fast:
            impl = HOOKS.generic_attention(hf)  # refuses, naming why, what cannot train as a decoder
        common = dict(
            model_type=mt,
            vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            intermediate_size=getattr(hf, "intermediate_size", None) or 4 * hf.hidden_size,
            num_hidden_layers=hf.num_hidden_layers,
            num_attention_heads=hf.num_attention_heads,
            num_key_value_heads=getattr(hf, "num_key_value_heads", None) or hf.num_attention_heads,
            head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
            tie_word_embeddings=bool(getattr(hf, "tie_word_embeddings", False)),
            hidden_act=act,
            max_position_embeddings=getattr(hf, "max_position_embeddings", 4096),
            hf_config=hf,
        )
        if not fast:
            flags = dict(qkv_bias=False, o_bias=False, mlp_bias=False, qk_norm=False)
            eps = getattr(hf, "rms_norm_eps", None) or getattr(hf, "layer_norm_eps", None) or 1e-6
            cfg = cls(**common, **flags, rms_norm_eps=eps, path="generic", attn_implementation=impl)
            HOOKS.skeleton(cfg)  # builds transformers' model on the meta device, refusing what cannot run
            return cfg
        fam = FAMILIES[mt]
        attention_bias = bool(getattr(hf, "attention_bias", False))
        return cls(
            **common,
            rms_norm_eps=getattr(hf, fam.get("eps", "rms_norm_eps")),
            qkv_bias=attention_bias if fam["qkv_bias"] is None else fam["qkv_bias"],
            o_bias=attention_bias if fam["o_bias"] is None else fam["o_bias"],
            mlp_bias=bool(getattr(hf, "mlp_bias", False)),
            qk_norm=bool(getattr(hf, "use_qk_norm", False))
            if fam["qk_norm"] is None
            else bool(fam["qk_norm"]),
            qk_norm_full=fam["qk_norm"] == "full",
            sliding_window=getattr(hf, "sliding_window", None) if fam.get("window") else None,
            moe=moe_spec(hf),
            mla=mla_spec(hf),
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
        except UnicodeDecodeError:  # model_name_or_path naming a weights file, say
            raise ConfigError(f"{path}: not a JSON file (binary, or not UTF-8 text)") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot be read ({e.strerror})") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: expected a JSON object (a Hugging Face config.json)")
        mt = raw.get("model_type")
        if mt in MODEL_TYPE_ALIASES:  # read as the model transformers implements, without its auto_map
            raw = {k: v for k, v in raw.items() if k != "auto_map"} | {"model_type": MODEL_TYPE_ALIASES[mt]}
            mt = raw["model_type"]
        from transformers import CONFIG_MAPPING, AutoConfig

        if mt not in CONFIG_MAPPING:
            raise ConfigError(f"{path}: model_type {mt!r} is not a model transformers knows")
        try:
            hf = AutoConfig.for_model(**raw)
        except Exception as e:  # transformers validates rope parameters and friends
            raise ConfigError(f"{path}: {e}") from None
        try:
            cfg = cls.from_hf(hf)
        except ConfigError as e:
            raise ConfigError(f"{path}: {e}") from None
        if any(str(a).endswith("ForSequenceClassification") for a in raw.get("architectures") or []):
            cfg = cfg.with_score_head(hf.pad_token_id)  # a reward model (models/score.py)
        return cfg
