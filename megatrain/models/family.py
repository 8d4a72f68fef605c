"""Which family runs a model (`family_of`: its fast block, or transformers' own modules) and what
the engine, the host state and the planner build from it: the templates, each parameter's
checkpoint tensors, the parameter count, the one-line description. The interface a family
implements is base.py's.
"""

from __future__ import annotations

from collections.abc import Hashable
from typing import Any

from torch import nn

from .base import Family
from .config import ModelConfig


def family_of(cfg: ModelConfig) -> Family:
    """The family that runs `cfg`: its fast block, or transformers' modules; a reward model's
    with the score head (score.py); a vision-language model's with its tower (vision.py)."""
    fam = _text_family(cfg)
    if cfg.vision is not None:
        from .vision import multimodal

        return multimodal(fam)
    return fam


def _text_family(cfg: ModelConfig) -> Family:
    if cfg.path == "generic":
        from .hf import GENERIC

        fam = GENERIC
        if cfg.num_labels is not None:
            from .score import scored

            return scored(fam)
        return fam
    from .cohere import COHERE
    from .decoder import BLOCKS
    from .deepseek import DEEPSEEK
    from .gemma import GEMMA
    from .gpt_oss import GPT_OSS
    from .moe import MOE
    from .olmo2 import OLMO2
    from .phi3 import PHI3

    fams = {
        **BLOCKS,
        "gemma": GEMMA,
        "phi3": PHI3,
        "olmo2": OLMO2,
        "cohere": COHERE,
        "moe": MOE,
        "gpt_oss": GPT_OSS,
        "deepseek": DEEPSEEK,
    }
    fam = fams[cfg.block]
    if cfg.num_labels is not None:
        from .score import scored

        return scored(fam)
    return fam


def checkpoint_pieces(
    fam: Family, cfg: ModelConfig, kind: str, layer: int, name: str, shape: tuple[int, ...]
):
    """(checkpoint key, element offset, shape) of each checkpoint tensor parameter `name` is made of."""
    if fam.pieces is not None:
        return fam.pieces(cfg, kind, layer, name, shape)
    return [(fam.param_key(cfg, kind, layer, name), 0, shape)]


def describe(cfg: ModelConfig) -> str:
    """Which path a model runs on, for the log, `megatrain plan` and plan.json."""
    if cfg.vision is not None:
        return f"{_describe_text(cfg)} with transformers' vision tower"
    return _describe_text(cfg)


def _describe_text(cfg: ModelConfig) -> str:
    if cfg.path == "generic":
        from .hf import layer_class

        return f"generic path (transformers' {layer_class(cfg)}, {cfg.attn_implementation} attention)"
    return f"fast block ({cfg.block})"


def templates(cfg: ModelConfig) -> dict[str, Any]:
    """The embedding, head and per-layer templates of a model (layers sharing a key share one)."""
    fam = family_of(cfg)
    layers: dict[Hashable, nn.Module] = {}
    keys = [fam.layer_key(cfg, i) for i in range(cfg.num_hidden_layers)]
    for i, k in enumerate(keys):
        if k not in layers:
            layers[k] = fam.layer(cfg, i)
    return {"embed": fam.embedding(cfg), "head": fam.head(cfg), "layers": layers, "keys": keys}


def count_params(cfg: ModelConfig) -> int:
    """Parameters of the model, from its templates (tied tables counted once; frozen tensors,
    buffers in transformers, are not parameters)."""
    t = templates(cfg)
    return sum(layer_params(cfg)) + _trained(t["embed"]) + _trained(t["head"])


def layer_params(cfg: ModelConfig) -> list[int]:
    """Each decoder layer's parameters, counted as `count_params` counts them."""
    t = templates(cfg)
    return [_trained(t["layers"][k]) for k in t["keys"]]


def _trained(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters() if p.requires_grad)
