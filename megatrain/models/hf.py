"""The generic path: any decoder-only `*ForCausalLM` of transformers, run through its own modules.

The model is built once on the meta device from its config (`skeleton`); its decoder layers,
token embedding, final norm, LM head and rotary embedding become the family's templates, bound to
each unit's weights per use like the fast blocks' (family.py). Non-persistent buffers (rotary
frequencies, embedding scales) are computed from the config on the host by transformers' own
`_init_weights`. Layers take what their `forward` expects: the rotary (cos, sin), position ids and
the attention mask of their kind (full or sliding window), boolean for `sdpa`, additive for
`eager`. Slower than a fast block (no compiled layer, transformers' attention), but exact.

What happens outside the layers in a transformers model's `forward` is not read from its code:
the known extras are data here (EMBED_MULTIPLIERS, the head's logit rules in `_post_logits`).
Anything with parameters beyond embedding, layers, final norm and LM head is refused by name, and
so are mixture-of-experts models: those with a fast block (`moe.py`, `gpt_oss.py`, `deepseek.py`)
run there, the others have none.
"""

from __future__ import annotations

import copy
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import ConfigError
from .attention import attention_mask, dense_ids
from .base import Family
from .config import FAMILIES, MOE_BLOCKS, ModelConfig

# Config attributes a transformers model's forward multiplies the token embeddings by (Granite).
EMBED_MULTIPLIERS = ("embedding_multiplier",)
LAYER_TYPES = ("full_attention", "sliding_attention")
_CACHE = 8  # skeletons kept (by config object): a run builds every template from one


@dataclass(frozen=True)
class Skeleton:
    """transformers' model of a config, on the meta device, and where its parts are."""

    model: nn.Module
    parts: dict
    """Attribute names: `embed`, `layers`, `norm` (in the base model), `lm` (in the causal LM)."""
    saved_name: Callable[[str], str]
    """Module parameter name -> the checkpoint key transformers saves it under."""


_SKELETONS: dict[int, tuple[object, Skeleton]] = {}


def generic_attention(hf) -> str:
    """The attention implementation the generic path uses for `hf` (`sdpa` where transformers
    supports it, else `eager`), or a ConfigError naming why the model cannot train here."""
    from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

    mt = hf.model_type
    if getattr(hf, "is_encoder_decoder", False):
        raise ConfigError(f"model_type {mt!r} is an encoder-decoder model (only decoders train here)")
    if getattr(hf, "sub_configs", None):
        names = ", ".join(hf.sub_configs)
        raise ConfigError(
            f"model_type {mt!r} is a composite (multimodal) model ({names}); train its text model"
        )
    if getattr(hf, "output_router_logits", None) is not None:  # every MoE config transformers has
        raise ConfigError(_no_moe(mt))
    if getattr(hf, "use_bidirectional_attention", False):
        raise ConfigError(f"model_type {mt!r}: use_bidirectional_attention=true is not a causal decoder")
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf)]
    except KeyError:
        raise ConfigError(f"model_type {mt!r} has no causal language model in transformers") from None
    types = set(getattr(hf, "layer_types", None) or ()) - set(LAYER_TYPES)
    if types:
        raise ConfigError(f"model_type {mt!r}: layer types {sorted(types)} are not supported")
    return "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"


def _no_moe(mt: str) -> str:
    """Why a mixture-of-experts model cannot run on the generic path: transformers fuses or
    splits its expert tensors on loading, and its router's load-balancing loss spans layers."""
    fast = [t for t, f in FAMILIES.items() if f["block"] in MOE_BLOCKS]
    if mt in fast:
        return f"model_type {mt!r}: this configuration (sliding window or dynamic RoPE) has no fast MoE block"
    return (
        f"model_type {mt!r} is a mixture-of-experts model without a fast block (fast MoE: {', '.join(fast)})"
    )


def skeleton(cfg: ModelConfig) -> Skeleton:
    """The transformers model of `cfg`, parameters on the meta device, buffers computed on the
    host; built once per config object. Refuses, by name, what the generic path cannot run."""
    hit = _SKELETONS.get(id(cfg.hf_config))
    if hit is not None and hit[0] is cfg.hf_config:
        return hit[1]
    from transformers import AutoModelForCausalLM

    hf = copy.deepcopy(cfg.hf_config)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf, attn_implementation=cfg.attn_implementation)
    model.eval()
    for mod in model.modules():
        metas = [n for n, b in mod.named_buffers(recurse=False) if b is not None and b.is_meta]
        for n in metas:
            mod._buffers[n] = torch.empty_like(mod._buffers[n], device="cpu")
        if metas:
            model._init_weights(mod)
    _check_parts(cfg, model)
    sk = Skeleton(model, _parts(model), _saved_names(cfg, model))
    while len(_SKELETONS) >= _CACHE:
        _SKELETONS.pop(next(iter(_SKELETONS)))
    _SKELETONS[id(cfg.hf_config)] = (cfg.hf_config, sk)
    return sk


def _saved_names(cfg: ModelConfig, model: nn.Module):
    """Module name -> checkpoint key, as transformers renames on save (GPT-NeoX's `lm_head` is
    `embed_out` on disk). Conversions that split or fuse tensors cannot stream one tensor per
    parameter: refused."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import PrefixChange, WeightRenaming

    convs = [
        c for c in get_model_conversion_mapping(model, add_legacy=False) if not isinstance(c, PrefixChange)
    ]
    if any(not isinstance(c, WeightRenaming) for c in convs):
        raise ConfigError(
            f"model_type {cfg.model_type!r}: its checkpoint tensors are split or fused on loading "
            "(not one tensor per parameter)"
        )
    renamings = [c.reverse_transform() for c in convs[::-1]]

    def saved(name: str) -> str:
        # Each renaming in turn, as transformers applies them (its own helper for this is not in
        # every 5.x release; `rename_source_key` is).
        for r in renamings:
            name, _ = r.rename_source_key(name)
        return name

    return saved


def _parts(model: nn.Module) -> dict[str, str]:
    """Attribute names of the embedding, the layer list, the final norm (in the base model) and
    the LM head (in the causal LM); "" where there is not exactly one."""
    base = model.base_model
    children = dict(base.named_children())
    embeds = [n for n, m in children.items() if m is model.get_input_embeddings()]
    n_layers = model.config.num_hidden_layers
    layers = [n for n, m in children.items() if isinstance(m, nn.ModuleList) and len(m) == n_layers]
    rest = [n for n, m in children.items() if n not in embeds + layers and any(True for _ in m.parameters())]
    lm = [n for n, m in model.named_children() if m is model.get_output_embeddings()]
    one = lambda names: names[0] if len(names) == 1 else ""  # noqa: E731
    return {"embed": one(embeds), "layers": one(layers), "norm": one(rest), "lm": one(lm), "rest": rest}


def _check_parts(cfg: ModelConfig, model: nn.Module) -> None:
    """Refuse, by name, a model whose parameters are not embedding, layers, norm and LM head."""
    p, mt = _parts(model), cfg.model_type
    if len(p["rest"]) > 1:
        raise ConfigError(
            f"model_type {mt!r}: modules with parameters besides token embedding, decoder layers and "
            f"final norm ({', '.join(p['rest'])}) are not supported"
        )
    missing = [what for k, what in _PART_NAMES.items() if not p[k]]
    if missing:
        raise ConfigError(f"model_type {mt!r}: no single {' / '.join(missing)} found")
    prefix = model.base_model_prefix
    known = (f"{prefix}.{p['embed']}.", f"{prefix}.{p['layers']}.", f"{prefix}.{p['norm']}.", f"{p['lm']}.")
    extra = [n for n, _ in model.named_parameters() if not n.startswith(known)]
    if extra:
        raise ConfigError(f"model_type {mt!r}: parameters outside the decoder ({extra[0]}, ...)")
    emb, lm = model.get_input_embeddings(), model.get_output_embeddings()
    if type(emb).forward not in (nn.Embedding.forward, *_scaled_forwards(emb)):
        raise ConfigError(f"model_type {mt!r}: its token embedding ({type(emb).__name__}) is not supported")
    tied = lm.weight is emb.weight
    if tied != cfg.tie_word_embeddings:
        raise ConfigError(
            f"model_type {mt!r}: tie_word_embeddings says {cfg.tie_word_embeddings}, the model {tied}"
        )
    if tied and getattr(lm, "bias", None) is not None:
        raise ConfigError(f"model_type {mt!r}: a tied LM head with a bias is not supported")


_PART_NAMES = {
    "embed": "token embedding",
    "layers": "decoder layer list",
    "norm": "final norm",
    "lm": "LM head",
}


def _scaled_forwards(emb: nn.Module) -> tuple:
    """Embeddings that multiply the looked-up rows by a constant (Gemma's sqrt(hidden))."""
    return (type(emb).forward,) if hasattr(emb, "scalar_embed_scale") else ()


class HFEmbedding(nn.Module):
    """transformers' token embedding under its own name, times the model's embedding multiplier."""

    def __init__(self, name: str, module: nn.Embedding, multiplier: float):
        super().__init__()
        self.add_module(name, module)
        self.name, self.multiplier = name, multiplier
        self.weight_name = f"{name}.weight"
        self.scale = float(getattr(module, "scalar_embed_scale", 1.0)) * multiplier
        self.padding_idx = module.padding_idx

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        h = getattr(self, self.name)(input_ids)
        return h * self.multiplier if self.multiplier != 1.0 else h


class HFLayer(nn.Module):
    """transformers' decoder layer; returns the hidden state whatever the layer returns."""

    def __init__(self, block: nn.Module):
        super().__init__()
        self.block = block

    def forward(self, x: torch.Tensor, **inputs) -> torch.Tensor:
        y = self.block(x, **inputs)
        return y[0] if isinstance(y, tuple) else y


class HFHead(nn.Module):
    """transformers' final norm and LM head (its bias, if any), then the model's logit rules."""

    def __init__(self, cfg: ModelConfig, norm_name: str, norm: nn.Module, lm_name: str, lm: nn.Module | None):
        super().__init__()
        self.add_module(norm_name, norm)
        if lm is not None:
            self.add_module(lm_name, lm)
        self.norm_name, self.lm_name = norm_name, lm_name
        self.lm_weight_name = f"{lm_name}.weight"
        self.hf = cfg.hf_config

    def normed(self, x: torch.Tensor) -> torch.Tensor:
        return getattr(self, self.norm_name)(x)

    def forward(self, x: torch.Tensor, lm_weight: torch.Tensor) -> torch.Tensor:
        lm = getattr(self, self.lm_name, None)
        bias = getattr(lm, "bias", None)
        return _post_logits(self.hf, F.linear(self.normed(x), lm_weight, bias))


def _post_logits(hf, logits: torch.Tensor) -> torch.Tensor:
    """What transformers' causal LMs do to the LM head's output before the loss."""
    scale = getattr(hf, "logit_scale", None)  # Cohere
    if scale is not None:
        logits = logits * scale
    div = getattr(hf, "logits_scaling", None)  # Granite
    if div is not None:
        logits = logits / div
    cap = getattr(hf, "final_logit_softcapping", None)  # Gemma 2/3
    if cap is not None:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _embedding(cfg: ModelConfig) -> nn.Module:
    sk = skeleton(cfg)
    mult = 1.0
    for name in EMBED_MULTIPLIERS:
        mult *= float(getattr(cfg.hf_config, name, None) or 1.0)
    return HFEmbedding(sk.parts["embed"], sk.model.get_input_embeddings(), mult)


def layer_class(cfg: ModelConfig) -> str:
    """The class name of the transformers decoder layer the generic path runs."""
    return type(_layers(cfg)[0]).__name__


def _layers(cfg: ModelConfig) -> nn.ModuleList:
    sk = skeleton(cfg)
    return getattr(sk.model.base_model, sk.parts["layers"])


def _layer(cfg: ModelConfig, i: int) -> nn.Module:
    return HFLayer(_layers(cfg)[i])


def _head(cfg: ModelConfig) -> nn.Module:
    sk = skeleton(cfg)
    lm = None if cfg.tie_word_embeddings else sk.model.get_output_embeddings()
    norm = sk.parts["norm"]
    return HFHead(cfg, norm, getattr(sk.model.base_model, norm), sk.parts["lm"], lm)


def _kind(cfg: ModelConfig, i: int) -> str:
    types = getattr(cfg.hf_config, "layer_types", None)
    if types is not None:
        return types[i]
    return "sliding_attention" if cfg.windows[i] else "full_attention"


def _inputs(cfg: ModelConfig, device: torch.device):
    base = skeleton(cfg).model.base_model
    rotary = getattr(base, "rotary_emb", None)
    rotary = copy.deepcopy(rotary).to(device) if rotary is not None else None
    by_type = rotary is not None and "layer_type" in inspect.signature(rotary.forward).parameters
    kinds = {_kind(cfg, i): cfg.windows[i] for i in range(cfg.num_hidden_layers)}
    eager = cfg.attn_implementation == "eager"

    def inputs(position_ids, document_ids, seq_len, dtype, flex):
        out = {}
        for kind, window in kinds.items():
            # transformers' own layers take dense masks only (`flex` aside): the generic path is the slow one
            mask = attention_mask(
                dense_ids(document_ids), seq_len, window, position_ids.device, False, always=eager
            )
            if eager:  # an additive mask, as transformers' eager attention adds it to the scores
                mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(
                    ~mask, torch.finfo(dtype).min
                )
            x = torch.empty(0, dtype=dtype, device=position_ids.device)
            kw = dict(attention_mask=mask, position_ids=position_ids)
            if rotary is not None:
                extra = (kind,) if by_type else ()
                kw["position_embeddings"] = rotary(x, position_ids, *extra)
            out[kind] = kw
        return out

    return inputs


def _key(cfg: ModelConfig, kind: str, layer: int, name: str) -> str:
    sk = skeleton(cfg)
    p, prefix = sk.parts, sk.model.base_model_prefix
    if kind == "layer":
        name = f"{prefix}.{p['layers']}.{layer}.{name.removeprefix('block.')}"
    elif not name.startswith(f"{p['lm']}."):
        name = f"{prefix}.{name}"
    return sk.saved_name(name)


GENERIC = Family(
    name="generic",
    path="generic",
    embedding=_embedding,
    layer=_layer,
    layer_key=lambda cfg, i: i,  # a transformers layer knows its index (layer type, window)
    layer_kind=_kind,
    inputs=_inputs,
    head=_head,
    param_key=_key,
    compile=False,
)
