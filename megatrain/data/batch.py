"""What the data pipeline hands the engine."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the tensors' own methods serve: importing this module (data/) needs no torch
    import torch

    from ..models.attention import SharedRows

IGNORE_INDEX = -100


@dataclass
class MicroBatch:
    """One micro-batch of token sequences, Hugging Face conventions.

    `labels` are *unshifted* (labels[t] is the token at position t, the engine predicts it from
    position t-1) with -100 where no loss is taken. Packed sequences carry `document_ids`
    (attention never crosses a change of id) and `position_ids` that restart per document; the
    first token of each packed document must carry label -100 so no loss crosses a boundary.
    """

    input_ids: torch.Tensor  # [B, S] int64
    labels: torch.Tensor  # [B, S] int64
    position_ids: torch.Tensor | None = None  # [B, S] int64; default arange(S)
    document_ids: torch.Tensor | None = None  # [B, S] int64; packing only ([B, S, 2]: data/shared.py)
    attention_mask: torch.Tensor | None = None
    """[B, S] 1 for real tokens, 0 for padding, as transformers' `attention_mask`; None: no
    padding. Attention needs none (pads only ever follow real tokens, which never see them);
    the MoE load-balancing loss leaves padding out, as transformers does given this mask."""
    slots: torch.Tensor | None = None
    """[B, S] int64, unshifted like labels: the per-sequence sum that predicting token t adds its
    log-prob to, -1 for none. Slot c * units + k is code c (`Sample.slots`) of the k-th sample of
    the micro-batch. None: the objective sums nothing per sequence (cross-entropy)."""
    units: list[int] | None = None
    """The indices of the micro-batch's samples in their dataset, in order."""
    extra: torch.Tensor | None = None
    """[units, k] float64: each sample's `Sample.extra`; None where samples carry none."""
    input_tokens: int | None = None
    """The tokens TRL's `num_tokens` counts where not every real one (KTO: not its KL sequences'
    tokens); None: every token that is not padding."""
    token_extra: torch.Tensor | None = None
    """[B, S, k] float32, aligned with `shifted_labels` (value t belongs to the token predicted at
    position t): per-token values an objective reads (grpo: the sampling and reference policies'
    log-probs); None where there are none."""

    prompt_lengths: list[int] | None = None
    """Each row's prompt length where its first tokens are a prompt the loss takes nothing on,
    which the rows of the same prompt may share in the layers (data/shared.py; GRPO's, RLOO's);
    None: no row shares."""

    shared_rows: SharedRows | None = None
    """A shared-prompt layout's attention rows (data/shared.py); None: attention over the rows as
    they are (with `document_ids` where packed)."""

    images: dict[str, torch.Tensor] | None = None
    """A vision-language model's image inputs, as its processor gives them for the micro-batch's
    images in the order of their image tokens (`pixel_values`, `image_grid_thw`, ...); None: no
    images."""

    def __post_init__(self):
        if self.input_ids.shape != self.labels.shape:
            raise ValueError(f"input_ids {tuple(self.input_ids.shape)} vs labels {tuple(self.labels.shape)}")

    @property
    def shifted_labels(self) -> torch.Tensor:
        """Targets aligned with the logits: target[t] = labels[t + 1], the last is ignored."""
        t = self.labels.new_full(self.labels.shape, IGNORE_INDEX)
        t[:, :-1] = self.labels[:, 1:]
        return t

    @property
    def shifted_slots(self) -> torch.Tensor:
        """Slots aligned with the logits, as `shifted_labels`."""
        t = self.slots.new_full(self.slots.shape, -1)
        t[:, :-1] = self.slots[:, 1:]
        return t

    @property
    def num_label_tokens(self) -> int:
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()

    @property
    def num_input_tokens(self) -> int:
        """The tokens TRL's `num_tokens` metric counts of the micro-batch: its real tokens (not
        padding), less any `input_tokens` leaves out."""
        if self.input_tokens is not None:
            return self.input_tokens
        return int(self.attention_mask.sum()) if self.attention_mask is not None else self.input_ids.numel()

    @property
    def num_samples(self) -> int:
        """Samples (documents) in the micro-batch: one per row, or with packing each document
        that starts in a row's real tokens (padding is a document of its own and not counted); a
        sample of several sequences (a preference pair) counts once."""
        if self.units is not None:
            return len(self.units)
        if self.document_ids is None:
            return self.input_ids.shape[0]
        d = self.document_ids
        starts = d != d.roll(1, dims=1)
        starts[:, 0] = True
        if self.attention_mask is not None:
            starts &= self.attention_mask.bool()
        return int(starts.sum())
