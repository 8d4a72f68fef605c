"""Vision-language models (transformers' image-text-to-text classes): which train, and what the
engine runs of them.

The language model is read from the composite config's `text_config` and runs as its family
does (fast block, or the generic path). The vision tower and the multi-modal projector are
transformers' own modules, taken from the composite model built on the meta device, and belong
to the embedding unit: `VisionEmbedding` looks the tokens up, runs the model's own
`get_image_features` on the micro-batch's images and writes the features over the image
tokens' embeddings (transformers' `masked_scatter`), so the first decoder layer sees what
transformers' does. Checkpoint keys are the names transformers saves (`SavedNames`, read from
its own weight-conversion rules: LLaVA's `language_model.model.layers.0...`). Which modules are
the tower and which the projector is data (`VLMS`, LlamaFactory's keys); frozen ones are
frozen tensors of the unit (`ParamSpec.train`). Qwen2-VL's, Qwen2.5-VL's and Qwen3-VL's language
model takes 3D positions (M-RoPE), computed by transformers' `get_rope_index` (`positions`);
Gemma 3's attends bidirectionally within each image (its masks, `_inputs`). Qwen3-VL's tower also
gives DeepStack features, one per tower layer of its `deepstack_visual_indexes`: the embedding
unit returns them beside the first hidden state, and the k-th is added at the image tokens to the
output of decoder layer k (`add_deepstack`, as transformers' `_deepstack_process`).
"""

from __future__ import annotations

import copy
import dataclasses
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..errors import ConfigError
from .attention import image_groups
from .base import Family
from .config import VisionSpec


def _llava_unused(hf, names: list[str]) -> tuple[str, ...]:
    """LLaVA's tower parameters no feature depends on, of the tower's parameter `names`: the
    layers from the one after `vision_feature_layer` on (the hidden state it takes is layer k's
    input), the final norm and any pooling head (they serve the pooled output alone).
    transformers gives them no gradient, so its optimizer never steps them."""
    layers = hf.vision_config.num_hidden_layers
    picked = hf.vision_feature_layer
    k = max(i % (layers + 1) for i in (picked if isinstance(picked, list) else [picked]))
    late = {str(i) for i in range(k, layers)}

    def dead(name: str) -> bool:
        layer = re.search(r"\.encoder\.layers\.(\d+)\.", name)
        return (layer is not None and layer[1] in late) or re.search(
            r"\.(post_layernorm|head)\.", name
        ) is not None

    return tuple(n for n in names if n.startswith("vision_tower.") and dead(n))


@dataclass(frozen=True)
class _Kind:
    tower: tuple[str, ...]
    projector: tuple[str, ...]
    mrope: bool = False
    bidirectional: bool = False
    text: tuple[tuple[str, Any], ...] = ()
    """Language-model config keys the composite model does not apply (set so in its text config)."""
    unused: Callable[[Any, list[str]], tuple[str, ...]] | None = None
    """The tower's parameters (of its names) that no image feature depends on (frozen)."""


# model_type -> the modules (paths in the composite base model) of its tower and projector.
QWEN_VL = _Kind(tower=("visual.patch_embed", "visual.blocks"), projector=("visual.merger",), mrope=True)
# Qwen3-VL's tower: its learned position grid (interpolated to each image's) and the DeepStack
# mergers are the tower's, as LlamaFactory freezes them.
QWEN3_VL = _Kind(
    tower=("visual.pos_embed", "visual.patch_embed", "visual.blocks", "visual.deepstack_merger_list"),
    projector=("visual.merger",),
    mrope=True,
)
VLMS = {
    "llava": _Kind(tower=("vision_tower",), projector=("multi_modal_projector",), unused=_llava_unused),
    # LLaVA-NeXT's `image_newline` (a parameter of the base model) is the projector's: LlamaFactory
    # trains and freezes it with the projector.
    "llava_next": _Kind(
        tower=("vision_tower",), projector=("multi_modal_projector", "image_newline"), unused=_llava_unused
    ),
    # Gemma3ForConditionalGeneration caps no logits, whatever its text config says.
    "gemma3": _Kind(
        tower=("vision_tower",),
        projector=("multi_modal_projector",),
        bidirectional=True,
        text=(("final_logit_softcapping", None),),
    ),
    "idefics3": _Kind(tower=("vision_model",), projector=("connector",)),
    "smolvlm": _Kind(tower=("vision_model",), projector=("connector",)),
    "qwen2_vl": QWEN_VL,
    "qwen2_5_vl": QWEN_VL,
    "qwen3_vl": QWEN3_VL,
}
_CACHE = 8  # skeletons kept, by config object


def vision_spec(hf) -> tuple[Any, VisionSpec] | None:
    """The language model's config and the vision spec of a vision-language config; None for a
    config that is not composite; a ConfigError naming why for a composite one that cannot train."""
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING

    if not getattr(hf, "sub_configs", None) or type(hf) not in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING:
        return None
    mt = hf.model_type
    kind = VLMS.get(mt)
    if kind is None:
        raise ConfigError(
            f"model_type {mt!r} is a vision-language model megatrain does not train yet "
            f"(it trains {', '.join(VLMS)}); train its text model"
        )
    if getattr(hf, "image_token_id", None) is None:
        raise ConfigError(f"model_type {mt!r}: config.json has no image_token_id")
    text = copy.deepcopy(hf.text_config)
    # The composite config decides the tying (transformers ties by it, the text config follows).
    text.tie_word_embeddings = bool(getattr(hf, "tie_word_embeddings", False))
    for key, value in kind.text:
        setattr(text, key, value)
    spec = VisionSpec(
        model_type=mt,
        hf_config=hf,
        image_token_id=int(hf.image_token_id),
        tower=kind.tower,
        projector=kind.projector,
        text_model="",
        mrope=kind.mrope,
        bidirectional=kind.bidirectional,
    )
    sk = skeleton(spec)
    names = [n.removeprefix(f"{sk.model.base_model_prefix}.") for n, _ in sk.model.named_parameters()]
    unused = kind.unused(hf, names) if kind.unused else ()
    return text, dataclasses.replace(spec, text_model=sk.text_model, unused=unused)


@dataclass(frozen=True)
class Skeleton:
    """transformers' composite model of a vision spec on the meta device (buffers on the host)."""

    model: nn.Module
    text_model: str
    """The language model's attribute in the base model."""
    saved: dict[str, str]
    """Module parameter name -> the checkpoint key transformers saves it under."""


_SKELETONS: dict[int, tuple[object, Skeleton]] = {}


def skeleton(spec: VisionSpec) -> Skeleton:
    """The composite transformers model of `spec`, built once per config object; refuses, by
    name, parameters outside the language model, the tower and the projector."""
    hit = _SKELETONS.get(id(spec.hf_config))
    if hit is not None and hit[0] is spec.hf_config:
        return hit[1]
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, AutoModelForImageTextToText
    from transformers.core_model_loading import revert_weight_conversion

    hf = copy.deepcopy(spec.hf_config)
    cls = MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING[type(hf)]
    impl = "sdpa" if getattr(cls, "_supports_sdpa", False) else "eager"
    with torch.device("meta"):
        model = AutoModelForImageTextToText.from_config(hf, attn_implementation=impl)
    model.eval()
    _materialise_buffers(model)
    base = model.base_model
    embed = model.get_input_embeddings()
    texts = [n for n, m in base.named_children() if _input_embeddings(m) is embed]
    if len(texts) != 1:
        raise ConfigError(f"model_type {spec.model_type!r}: no single language model found")
    prefix = model.base_model_prefix
    known = [f"{prefix}.{texts[0]}.", "lm_head."] + [f"{prefix}.{p}." for p in (*spec.tower, *spec.projector)]
    params = dict(model.named_parameters())
    extra = [n for n in params if not n.startswith(tuple(known)) and f"{n}." not in known]
    if extra:
        raise ConfigError(
            f"model_type {spec.model_type!r}: parameters outside its known parts ({extra[0]}, ...)"
        )
    renamed = revert_weight_conversion(model, params)
    by_id = {id(v): k for k, v in renamed.items()}
    sk = Skeleton(model, texts[0], {n: by_id[id(p)] for n, p in params.items()})
    while len(_SKELETONS) >= _CACHE:
        _SKELETONS.pop(next(iter(_SKELETONS)))
    _SKELETONS[id(spec.hf_config)] = (spec.hf_config, sk)
    return sk


def _input_embeddings(module: nn.Module) -> nn.Module | None:
    """A child's token embedding; None where it has none (transformers raises for Qwen3-VL's tower)."""
    try:
        return module.get_input_embeddings() if hasattr(module, "get_input_embeddings") else None
    except NotImplementedError:
        return None


def _materialise_buffers(model: nn.Module) -> None:
    """Non-persistent buffers (rotary frequencies, position ids) computed on the host, each by the
    `_init_weights` of the innermost transformers model that holds it."""
    from transformers import PreTrainedModel

    def visit(module: nn.Module, owner: PreTrainedModel) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        metas = [n for n, b in module.named_buffers(recurse=False) if b is not None and b.is_meta]
        for n in metas:
            module._buffers[n] = torch.empty_like(module._buffers[n], device="cpu")
        if metas:
            owner._init_weights(module)
        for child in module.children():
            visit(child, owner)

    visit(model, model)


class VisionEmbedding(nn.Module):
    """The token embedding of the language model (its parameters under their own names), the
    vision modules under their names in the composite base model. `forward(ids, images)`: the
    embeddings with the images' features at the image tokens, and the DeepStack features (a
    tuple, empty but for Qwen3-VL's images); `features=True`: the features and the DeepStack ones
    alone (what the backward sweep differentiates)."""

    looks_up_rows = False  # the unit holds more than the token table

    def __init__(self, text: nn.Module, spec: VisionSpec, vocab_size: int):
        super().__init__()
        for name, module in text.named_children():
            self.add_module(name, module)
        object.__setattr__(self, "_text", text)  # its forward, not a child: its modules are ours
        sk = skeleton(spec)
        base = sk.model.base_model
        shell = copy.copy(base)  # the base model's methods, over our copies of its vision modules
        shell._modules = dict(base._modules)
        # The base model's own parameters (LLaVA-NeXT's image_newline) are ours, the shell reading
        # them from our dict: functional_call swaps tensors in it in place.
        shell._parameters = self._parameters
        for root in roots(spec):
            mine = copy.deepcopy(getattr(base, root))
            if isinstance(mine, nn.Parameter):
                self.register_parameter(root, mine)
            else:
                self.add_module(root, mine)
                shell._modules[root] = mine
        object.__setattr__(self, "_shell", shell)
        trained = [
            p for p, t in ((spec.tower, spec.train_tower), (spec.projector, spec.train_projector)) if t
        ]
        trained = tuple(path for paths in trained for path in paths)
        for name, p in self.named_parameters():
            if name.split(".")[0] in roots(spec):
                under = any(name == t or name.startswith(f"{t}.") for t in trained)
                p.requires_grad_(under and name not in spec.unused)
        self.weight_name, self.scale, self.padding_idx = text.weight_name, text.scale, text.padding_idx
        self.image_token_id = spec.image_token_id
        # Gemma's image token lies past the text vocabulary: transformers looks it up as token 0.
        self.outside = spec.image_token_id >= vocab_size

    def image_mask(self, input_ids: torch.Tensor) -> torch.Tensor:
        return input_ids == self.image_token_id

    def forward(self, input_ids: torch.Tensor, images: dict | None = None, features: bool = False):
        if features:
            return self.image_features(images)
        mask = self.image_mask(input_ids)
        ids = input_ids.masked_fill(mask, 0) if self.outside else input_ids
        h = self._text(ids)
        if images is None:
            return h, ()
        feats, *deepstack = self.image_features(images)
        return h.masked_scatter(mask[..., None], feats.to(h.dtype)), tuple(deepstack)

    def image_features(self, images: dict) -> tuple[torch.Tensor, ...]:
        """Every image's features, in the order of the image tokens ([image tokens, hidden]), then
        each of the tower's DeepStack features (Qwen3-VL's), laid out alike."""
        shell = self._shell
        out = type(shell).get_image_features(shell, **images, return_dict=True)
        stacks = getattr(out, "deepstack_features", None) or ()
        return tuple(_flat(f) for f in (out.pooler_output, *stacks))


def _flat(features) -> torch.Tensor:
    """Features per image (a tuple of [tokens, hidden], or one batched tensor) as [image tokens, hidden]."""
    if isinstance(features, (list, tuple)):
        return torch.cat(list(features))
    return features.reshape(-1, features.shape[-1])


def add_deepstack(h: torch.Tensor, image_mask: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
    """A decoder layer's output [B, S, hidden] with DeepStack `features` [image tokens, hidden]
    added at the image tokens (`image_mask` [B, S]), in the compute dtype, as transformers'
    `_deepstack_process` adds them."""
    out = h.clone()
    out[image_mask] = h[image_mask] + features.to(h.dtype)
    return out


def tower_shape(spec: VisionSpec) -> tuple[float, int, int, int]:
    """What the memory plan needs of a tower: its tokens per image token (at most: LLaVA's CLS
    beside each image's patches, Idefics3's pixel shuffle, Qwen2-VL's merge of patches, Gemma 3's
    pooling, LLaVA-NeXT's tiles), width, MLP width and layers."""
    hf, v = spec.hf_config, spec.hf_config.vision_config
    hidden = getattr(v, "embed_dim", None) or v.hidden_size
    ffn = getattr(v, "intermediate_size", None) or int(getattr(v, "mlp_ratio", 4) * hidden)
    if getattr(hf, "image_grid_pinpoints", None):
        # LLaVA-NeXT: the tower sees the base image and each tile of the largest grid, every one
        # with its CLS; the image's tokens are at least the base image's patches (its tiles'
        # features are unpadded, some rows or columns dropped).
        tile = v.image_size
        tiles = max((h // tile) * (w // tile) for h, w in hf.image_grid_pinpoints)
        patches = (tile // v.patch_size) ** 2
        per = (1 + tiles) * (patches + 1) / patches
    elif getattr(hf, "mm_tokens_per_image", None):  # Gemma 3: the patches average-pooled
        per = (v.image_size // v.patch_size) ** 2 / hf.mm_tokens_per_image
    elif spec.mrope:
        per = v.spatial_merge_size**2
    elif getattr(hf, "scale_factor", None):
        per = hf.scale_factor**2
    else:
        per = 2.0  # one patch per image token, and LLaVA's CLS: at most one more per image
    return float(per), hidden, ffn, v.num_hidden_layers


def roots(spec: VisionSpec) -> tuple[str, ...]:
    """The base model's attributes that hold the tower and the projector (`visual` holds both in
    Qwen2-VL)."""
    return tuple(dict.fromkeys(p.split(".")[0] for p in (*spec.tower, *spec.projector)))


def multimodal(fam: Family) -> Family:
    """`fam` (the language model's family) as part of a vision-language model: its embedding with
    the tower and projector, keys under the composite model's names, and where the model has
    M-RoPE, the rotary tables of 3D positions (`positions`)."""

    def embedding(cfg):
        with torch.device("meta"):
            return VisionEmbedding(fam.embedding(cfg), cfg.vision, cfg.vocab_size).eval()

    def key(cfg, kind, layer, name):
        sk = skeleton(cfg.vision)
        prefix = sk.model.base_model_prefix
        if kind == "embed" and name.split(".")[0] in roots(cfg.vision):
            module = f"{prefix}.{name}"
        else:  # the language model's key, under the composite model's names
            text_key = fam.param_key(cfg, kind, layer, name)
            inner = text_key.removeprefix(f"{prefix}.")
            module = text_key if inner == text_key else f"{prefix}.{sk.text_model}.{inner}"
        if module not in sk.saved:
            raise ConfigError(
                f"model_type {cfg.vision.model_type!r}: no parameter {module} in transformers' model"
            )
        return sk.saved[module]

    return dataclasses.replace(
        fam,
        name=f"{fam.name}+vision",
        embedding=embedding,
        param_key=key,
        pieces=None,  # a mixture-of-experts language model is refused (config.py)
        inputs=lambda cfg, device: _inputs(fam, cfg, device),
        positions=_positions,
    )


def _inputs(fam: Family, cfg, device: torch.device):
    """The family's per-micro-batch inputs, given the micro-batch's `image_mask` [B, S] too (None:
    no images): with Gemma 3's bidirectional images, masks where each image's tokens attend to
    all of their image; with M-RoPE and 3D positions [3, B, S], the rotary tables transformers'
    own rotary module makes of them (text positions, equal on the three axes, give the family's
    own tables)."""
    inner = fam.inputs(cfg, device)
    if cfg.vision.bidirectional:

        def bidirectional(position_ids, document_ids, seq_len, dtype, flex, image_mask=None):
            groups = None if image_mask is None else image_groups(image_mask)
            return inner(position_ids, document_ids, seq_len, dtype, flex, groups=groups)

        return bidirectional
    if not cfg.vision.mrope:
        return lambda position_ids, document_ids, seq_len, dtype, flex, image_mask=None: inner(
            position_ids, document_ids, seq_len, dtype, flex
        )
    base = skeleton(cfg.vision).model.base_model
    rotary = copy.deepcopy(getattr(base, skeleton(cfg.vision).text_model).rotary_emb).to(device)

    def inputs(position_ids, document_ids, seq_len, dtype, flex, image_mask=None):
        if position_ids.dim() == 2:
            return inner(position_ids, document_ids, seq_len, dtype, flex)
        out = inner(position_ids[0], document_ids, seq_len, dtype, flex)
        x = torch.empty(0, dtype=dtype, device=position_ids.device)
        cos, sin = rotary(x, position_ids)
        for kw in out.values():
            kw["rope"] = (cos[:, None], sin[:, None])
        return out

    return inputs


def _positions(cfg):
    """(input_ids [B, S], images, attention_mask) -> the 3D positions transformers computes for
    the micro-batch (`get_rope_index`), or None where the model or the micro-batch needs none."""
    if not cfg.vision.mrope:
        return lambda input_ids, images, attention_mask: None
    import inspect

    base = skeleton(cfg.vision).model.base_model
    takes_types = "mm_token_type_ids" in inspect.signature(base.get_rope_index).parameters
    token = cfg.vision.image_token_id

    def positions(input_ids, images, attention_mask):
        if images is None:
            return None
        kw = {"mm_token_type_ids": (input_ids == token).int()} if takes_types else {}
        pos, _ = base.get_rope_index(
            input_ids, image_grid_thw=images["image_grid_thw"], attention_mask=attention_mask, **kw
        )
        return pos

    return positions
