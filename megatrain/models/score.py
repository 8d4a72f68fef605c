"""The score head of a reward model, as transformers' `...ForSequenceClassification` has it: the
family's final norm, then `score`, a Linear hidden -> num_labels without bias, in place of the LM
head (no logit scaling or soft-capping: the classification models apply none). Its weight is a
head parameter the host state trains like an LM head's, under transformers' key `score.weight`;
a reward model read from a causal LM's checkpoint starts it as transformers does (io/weights.py).
Which token a sequence is scored at is the data's (data/preference.py: `score_sample`)."""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn

from .base import Family, meta
from .config import ModelConfig

SCORE = "score.weight"


class ScoreHead(nn.Module):
    """A family head's final norm (its modules, shared, so one functional_call binds both) with
    `score` for its LM head; `forward(x, score_weight)` gives the scores."""

    lm_weight_name = SCORE

    def __init__(self, head: nn.Module, cfg: ModelConfig):
        super().__init__()
        lm = head.lm_weight_name.rpartition(".")[0]
        for name, module in head.named_children():
            if name != lm:
                self.add_module(name, module)
        self.score = nn.Linear(cfg.hidden_size, cfg.num_labels, bias=False)
        self._normed = head.normed

    def forward(self, x: torch.Tensor, lm_weight: torch.Tensor) -> torch.Tensor:
        return F.linear(self._normed(x), lm_weight)


def scored(fam: Family) -> Family:
    """`fam` with the score head in place of its LM head."""

    def key(cfg, kind, layer, name):
        return name if name == SCORE else fam.param_key(cfg, kind, layer, name)

    def pieces(cfg, kind, layer, name, shape):
        return [(SCORE, 0, shape)] if name == SCORE else fam.pieces(cfg, kind, layer, name, shape)

    return dataclasses.replace(
        fam,
        head=lambda cfg: meta(lambda: ScoreHead(fam.head(cfg), cfg)),
        param_key=key,
        pieces=pieces if fam.pieces is not None else None,
    )


def classification_class(cfg: ModelConfig) -> str:
    """The transformers class of the model type's sequence-classification model."""
    from transformers import MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING

    try:
        return MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING[type(cfg.hf_config)].__name__
    except KeyError:
        from ..errors import ConfigError

        raise ConfigError(
            f"stage rm: transformers has no sequence-classification model for {cfg.model_type}"
        ) from None
