"""Preference data: TRL's preference formats -> token ids of prompt + completion, with the loss on
the completion only; stage rm's pairs of whole sequences.

Paired records (stages dpo, orpo, simpo), one format per file, detected from its first record:
  {"prompt": str, "chosen": str, "rejected": str}                        standard
  {"prompt": [messages], "chosen": [messages], "rejected": [messages]}   conversational
  {"chosen": ..., "rejected": ...}        implicit prompt: the longest shared prefix (of messages,
                                          or of characters) is the prompt, as TRL's extract_prompt
  {"prompt_input_ids": [...], "chosen_input_ids": [...], "rejected_input_ids": [...]}
Unpaired records (stage kto): {"prompt", "completion", "label": true|false}, its pre-tokenised form
{"prompt_input_ids", "completion_input_ids", "label"}, or any paired file (unpaired as TRL's
unpair_preference_dataset does it).

Reward pairs (stage rm: TRL 1.16's RewardTrainer, `build_reward_pairs`): {"prompt"?, "chosen",
"rejected", "margin"?}, text or messages, each of chosen and rejected tokenised whole, the prompt
(where there is one; none is extracted) before it: chat.joint_sequences, the joint rule's full
sequence; or their pre-tokenised form {"chosen_ids", "rejected_ids"} (TRL's legacy
"chosen_input_ids", "rejected_input_ids" too), each a whole sequence. A pair with either sequence
over max_length is left out, not cut, as TRL filters it.

Tokenisation (Limits.rule), TRL's trainer of each stage:
  joint (dpo, kto: TRL 1.16's DPOTrainer and KTOTrainer): prompt + completion tokenised together
    (chat.joint_prompt_completions, SFT's rule), the completion starting where that parts from the
    prompt's own tokenisation; chosen and rejected keep the shorter of their two prompts.
  answer (orpo, simpo: TRL 1.16's ORPOTrainer and CPOTrainer, `tokenize_row`): prompt + completion
    tokenised together without special tokens, the completion starting at the prompt's own length
    (one token before where the last merged across the boundary), each side its own prompt; then
    the BOS id before a prompt that does not start with it and the EOS id after a completion that
    does not end with it, rendered conversations too.
A conversation's prompt is rendered with the generation prompt and each completion is what the
chat template writes after it (the answer rule's render_completions, the joint rule's common
prefix).
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DataError
from .batch import IGNORE_INDEX
from .chat import _render, joint_prompt_completions, joint_sequences, require_chat_template
from .formats import CHAT_ROLES, Messages, _int_list, _parts, images_of, joined, out_of_vocab
from .samples import CHUNK, INT64_LIMIT, Sample
from .sources import DataFile, read_records

log = logging.getLogger(__name__)

TRUNCATION_MODES = ("keep_end", "keep_start")
RULES = ("joint", "answer")  # how prompt and completion are tokenised (Limits)
# TRL unpairs a paired dataset through datasets.map's default batches of 1000 rows: each batch
# lists its chosen completions, then its rejected ones. The KL pairs are made from that order.
UNPAIR_BLOCK = 1000
_PROMPT_ENDS = ("user", "tool")  # the roles after which the generation prompt makes sense
PAIRED_TOKEN_KEYS = ("prompt_input_ids", "chosen_input_ids", "rejected_input_ids")
# stage rm's pre-tokenised whole sequences, as TRL 1.16's RewardTrainer reads them: its own keys,
# then its legacy ones (renamed to them).
REWARD_TOKEN_KEYS = (("chosen_ids", "rejected_ids"), ("chosen_input_ids", "rejected_input_ids"))
# The per-sequence sums a sample's tokens feed (`Sample.slots` codes): a pair's chosen and
# rejected completions and its chosen prompt (ORPO's NLL covers it); a KTO example's completion
# and its KL sequence's.
CHOSEN, REJECTED, CHOSEN_PROMPT = 0, 1, 2
COMPLETION, KL = 0, 1
PAIR_SUMS, UNPAIRED_SUMS = 3, 2


@dataclass(slots=True)
class CompletionTokens:
    """Prompt + completion token ids; the loss covers input_ids[prompt_length:]."""

    input_ids: list[int]
    prompt_length: int

    @property
    def completion_mask(self) -> list[bool]:
        """True on completion tokens."""
        return [t >= self.prompt_length for t in range(len(self.input_ids))]

    @property
    def labels(self) -> list[int]:
        """Unshifted labels as in megatrain.data.Sample: -100 on the prompt."""
        return [IGNORE_INDEX] * self.prompt_length + self.input_ids[self.prompt_length :]

    @property
    def n_targets(self) -> int:
        """Completion tokens with a token before them (the first token is never predicted)."""
        return len(self.input_ids) - max(self.prompt_length, 1)


@dataclass(slots=True)
class PreferencePair:
    """One paired example; `source` is its file:line."""

    chosen: CompletionTokens
    rejected: CompletionTokens
    source: str
    margin: float = 0.0
    """The record's `margin` (TRL's reward-model margin column; 0 where it has none)."""
    images: tuple | None = None
    """A vision-language pair's prompt images (both sequences hold their tokens)."""


@dataclass(slots=True)
class UnpairedExample:
    """One KTO example. `kl` is its prompt with another example's completion (TRL's mismatched
    pair for the KL estimate), None when no KL term is wanted."""

    sequence: CompletionTokens
    label: bool
    source: str
    kl: CompletionTokens | None = None


@dataclass(frozen=True)
class Limits:
    """How prompt and completion become one sequence (`rule`, the module docstring's), and its
    length limit: a sequence over `max_length` keeps its first (keep_start) or last (keep_end)
    max_length tokens (TRL 1.16's trainers: max_length the one bound). None: no limit."""

    max_length: int | None
    truncation_mode: str = "keep_start"
    rule: str = "joint"

    def __post_init__(self):
        _check_max_length(self.max_length)
        if self.truncation_mode not in TRUNCATION_MODES:
            raise ConfigError(
                f"truncation_mode: must be one of {', '.join(TRUNCATION_MODES)} (got {self.truncation_mode!r})"
            )
        if self.rule not in RULES:
            raise ValueError(f"tokenisation rule {self.rule!r}: one of {RULES}")

    def cut(self, prompt: list[int], completion: list[int]) -> CompletionTokens:
        """prompt + completion within the limit."""
        ids, p = prompt + completion, len(prompt)
        excess = len(ids) - self.max_length if self.max_length is not None else 0
        if excess > 0 and self.truncation_mode == "keep_start":
            ids, p = ids[: self.max_length], min(p, self.max_length)
        elif excess > 0:
            ids, p = ids[excess:], max(p - excess, 0)
        return CompletionTokens(ids, p)


def _check_max_length(value) -> None:
    if value is not None and (type(value) is not int or value < 1):
        raise ConfigError(f"max_length: must be a number of tokens >= 1 or null (got {value!r})")


# ------------------------------------------------------------------------ samples
def pair_sample(pair: PreferencePair) -> Sample:
    """A pair as one training sample of two sequences, chosen then rejected, their completion
    tokens labelled and coded CHOSEN / REJECTED, the chosen prompt's tokens CHOSEN_PROMPT."""
    c, r = pair.chosen, pair.rejected
    slots = [CHOSEN_PROMPT] * c.prompt_length + [CHOSEN] * (len(c.input_ids) - c.prompt_length)
    slots += [-1] * r.prompt_length + [REJECTED] * (len(r.input_ids) - r.prompt_length)
    return Sample(
        c.input_ids + r.input_ids,
        _first_unlabelled(c.labels) + _first_unlabelled(r.labels),
        pair.source,
        parts=(len(c.input_ids), len(r.input_ids)),
        slots=slots,
        images=pair.images,
    )


def score_sample(pair: PreferencePair, pad_id: int) -> Sample:
    """A pair as stage rm reads it: pair_sample's two sequences, each coded (CHOSEN, REJECTED) at
    the one token its reward is read at, transformers' sequence-classification rule: its last
    token that is not `pad_id` (its first where every token is); extra: the pair's margin."""
    slots = []
    for seq, code in ((pair.chosen, CHOSEN), (pair.rejected, REJECTED)):
        at = max((j for j, t in enumerate(seq.input_ids) if t != pad_id), default=0)
        slots += [code if j == at else -1 for j in range(len(seq.input_ids))]
    sample = pair_sample(pair)
    sample.slots, sample.extra = slots, (pair.margin,)
    return sample


def unpaired_sample(example: UnpairedExample) -> Sample:
    """A KTO example as one sample: its sequence (completion coded COMPLETION) and, with a KL
    term, its KL sequence (completion coded KL, no labels: a constant of the loss). Its extra
    starts with the label (1.0: desirable)."""
    seq, kl = example.sequence, example.kl
    ids, labels = list(seq.input_ids), _first_unlabelled(seq.labels)
    slots = [-1] * seq.prompt_length + [COMPLETION] * (len(ids) - seq.prompt_length)
    parts = (len(ids),)
    if kl is not None:
        ids += kl.input_ids
        labels += [IGNORE_INDEX] * len(kl.input_ids)
        slots += [-1] * kl.prompt_length + [KL] * (len(kl.input_ids) - kl.prompt_length)
        parts += (len(kl.input_ids),)
    return Sample(
        ids,
        labels,
        example.source,
        parts=parts,
        slots=slots,
        extra=(float(example.label),),
        counted=len(seq.input_ids),
    )


def _first_unlabelled(labels: list[int]) -> list[int]:
    """A sequence's labels with its first token's ignored (nothing predicts it)."""
    return [IGNORE_INDEX] + labels[1:]


# ------------------------------------------------------------------------ building
def build_preference_pairs(
    paths: Iterable[str | Path], tokenizer, limits: Limits, vocab_size: int | None = None, vision=None
) -> list[PreferencePair]:
    """Every pair of the files, tokenised and cut to `limits`, in file order.

    Pairs where chosen or rejected keeps no completion token are skipped with a warning (an error
    if none is left). `tokenizer` may be None for pre-tokenised files; every id must be below
    `vocab_size` (default: the tokenizer's size). `vision`: a vision-language model's processor
    (data/vision.py's `VisionData.pair`), which reads the records' images."""
    pairs, skipped = [], []
    for where, prompts, completions, _, margin, images in _encoded(
        paths, tokenizer, vocab_size, limits.rule, paired_only=True, vision=vision
    ):
        longest = max(len(p) + len(c) for p, c in zip(prompts, completions))
        if images and limits.max_length is not None and longest > limits.max_length:
            raise DataError(
                f"{where}: the pair has {longest} tokens with its images', "
                f"more than max_length {limits.max_length}; pairs with images are not cut (raise max_length)"
            )
        chosen, rejected = (limits.cut(p, c) for p, c in zip(prompts, completions))
        pair = PreferencePair(chosen, rejected, where, margin, images or None)
        if pair.chosen.n_targets and pair.rejected.n_targets:
            pairs.append(pair)
        else:
            skipped.append(where)
    _report_skipped(skipped, pairs, limits, "pairs")
    return pairs


def build_unpaired_examples(
    paths: Iterable[str | Path],
    tokenizer,
    limits: Limits,
    kl_batch_size: int | None,
    vocab_size: int | None = None,
) -> list[UnpairedExample]:
    """Every KTO example of the files, tokenised and cut to `limits`.

    With `kl_batch_size` (the per-device batch size), each example also gets its KL sequence as
    TRL builds it: in consecutive blocks of that many examples, example i's prompt with the
    completion of example i-1 (the first takes the block's last). None: no KL sequences (loss_type
    apo_zero_unpaired has no KL term)."""
    if kl_batch_size is not None and kl_batch_size < 2:
        raise ConfigError(
            "per_device_train_batch_size: KTO needs at least 2 sequences per batch (its KL estimate pairs "
            f"each prompt with another example's completion; got {kl_batch_size})"
        )
    kept, skipped = [], []
    for where, prompt, completion, label in _unpaired(
        _encoded(paths, tokenizer, vocab_size, limits.rule, paired_only=False)
    ):
        example = UnpairedExample(limits.cut(prompt, completion), label, where)
        if example.sequence.n_targets:
            kept.append((prompt, completion, example))
        else:
            skipped.append(where)
    examples = [e for _, _, e in kept]
    _report_skipped(skipped, examples, limits, "examples")
    if kl_batch_size is not None:
        for a in range(0, len(kept), kl_batch_size):
            block = kept[a : a + kl_batch_size]
            for i, (prompt, _, example) in enumerate(block):
                example.kl = limits.cut(prompt, block[i - 1][1])
    return examples


def _report_skipped(skipped: list[str], kept: list, limits: Limits, what: str) -> None:
    if not skipped:
        return
    why = f"is max_length {limits.max_length} shorter than the prompts?"
    if not kept:
        raise DataError(
            f"no trainable {what}: all {len(skipped)} keep no completion token (first: {skipped[0]}); {why}"
        )
    log.warning(
        "skipped %d %s that keep no completion token (first: %s); %s", len(skipped), what, skipped[0], why
    )


def _unpaired(records):
    """(where, prompt, completion, label) per example: a paired record gives a chosen (label true)
    and a rejected (false) example, the chosen ones first within each UNPAIR_BLOCK records."""
    block: list = []
    for where, prompts, completions, label, _, _ in records:
        if label is not None:
            yield where, prompts[0], completions[0], label
            continue
        block.append((where, prompts, completions))
        if len(block) == UNPAIR_BLOCK:
            yield from _unpair(block)
            block = []
    yield from _unpair(block)


def _unpair(block):
    for side, label in ((0, True), (1, False)):
        for where, prompts, completions in block:
            yield where, prompts[side], completions[side], label


# ------------------------------------------------------------------------ stage rm
def build_reward_pairs(
    paths: Iterable[str | Path], tokenizer, max_length: int | None, vocab_size: int | None = None
) -> list[PreferencePair]:
    """stage rm's pairs of the files, in file order, as TRL 1.16's RewardTrainer prepares them
    (the module docstring): chosen and rejected whole sequences (`prompt_length` 0), the margin
    column's value. A pair with either sequence over `max_length` is left out, counted in one
    warning; none left is a ConfigError naming max_length and the files."""
    _check_max_length(max_length)
    paths = [str(p) for p in paths]
    pairs, over = [], []
    for where, sequences, margin in _reward_sequences(paths, tokenizer, vocab_size):
        if max_length is not None and max(map(len, sequences)) > max_length:
            over.append((where, max(map(len, sequences))))
            continue
        pairs.append(PreferencePair(*(CompletionTokens(ids, 0) for ids in sequences), where, margin))
    if over and not pairs:
        raise ConfigError(
            f"max_length: all {len(over)} pairs of {', '.join(paths)} have a sequence over max_length "
            f"{max_length} (the shortest {min(n for _, n in over)} tokens), and TRL's RewardTrainer "
            "leaves such pairs out; raise max_length"
        )
    if over:
        log.warning(
            "left out %d pairs with a sequence over max_length %d, as TRL's RewardTrainer does (first: %s)",
            len(over),
            max_length,
            over[0][0],
        )
    return pairs


def _reward_sequences(paths: list[str], tokenizer, vocab_size: int | None):
    """(file:line, [chosen ids, rejected ids], margin) per record of the files, in order."""
    if vocab_size is None:
        vocab_size = len(tokenizer) if tokenizer is not None else INT64_LIMIT
    for path in paths:
        records = read_records(Path(path))
        first = f"{path}:{records[0][0]}"
        keys = next((k for k in REWARD_TOKEN_KEYS if set(k) <= set(records[0][1])), None)
        if keys is None and _detect(first, records[0][1]).startswith("unpaired"):
            raise DataError(f"{first}: unpaired (KTO) preference data; this stage needs chosen and rejected")
        chat = keys is None and isinstance(_text_or_messages(records[0][1], "chosen", first), list)
        for a in range(0, len(records), CHUNK):
            chunk = [(f"{path}:{line}", rec) for line, rec in records[a : a + CHUNK]]
            if keys is not None:
                for where, rec in chunk:
                    if keys[0] != "chosen_ids" and "prompt_input_ids" in rec:
                        raise DataError(
                            f"{where}: prompt_input_ids: TRL 1.16's RewardTrainer reads none; chosen_input_ids "
                            "and rejected_input_ids are the whole sequences (put the prompt's ids at their start)"
                        )
                    yield where, [_ids(rec, k, where, vocab_size) for k in keys], _margin(rec, where)
                continue
            rows = [(where, *_reward_texts(rec, where, chat)) for where, rec in chunk]
            _need_tokenizer(tokenizer, first, chat)
            seqs = iter(joint_sequences(tokenizer, [(w, p, c) for w, p, cs in rows for c in cs]))
            for where, rec in chunk:
                sequences = [next(seqs), next(seqs)]
                _check_vocab(where, sequences, vocab_size)
                yield where, sequences, _margin(rec, where)


def _reward_texts(rec: dict, where: str, chat: bool) -> tuple[str | Messages, list[str | Messages]]:
    """A reward record's prompt ("" or [] where it has none: TRL extracts none) and its chosen
    and rejected completions, all text or all messages as the file's first record (`chat`)."""
    chosen, rejected = (_plain(_text_or_messages(rec, k, where)) for k in ("chosen", "rejected"))
    has_prompt = rec.get("prompt") is not None
    prompt = _plain(_text_or_messages(rec, "prompt", where)) if has_prompt else [] if chat else ""
    if any(isinstance(x, list) != chat for x in (prompt, chosen, rejected)):
        keys = ("'prompt', " if has_prompt else "") + "'chosen', 'rejected'"
        kind = "message lists" if chat else "strings"
        raise DataError(f"{where}: fields {keys} must all be {kind}, as in the file's first record")
    return prompt, [chosen, rejected]


# ------------------------------------------------------------------------ reading and tokenising
@dataclass
class _Text:
    """A text record: the prompt and completions as the tokenizer will see them."""

    where: str
    prompt: str
    completions: list[str]
    chat: bool


def _encoded(paths, tokenizer, vocab_size: int | None, rule: str, paired_only: bool, vision=None):
    """(file:line, prompt ids of each completion, completion ids (chosen and rejected, or one),
    label or None, margin, images) per record, in order; text tokenised as `rule` says (Limits), a
    record with images as TRL's vision collator does (`VisionData.pair`). `paired_only` refuses
    unpaired files."""
    if vocab_size is None:
        vocab_size = len(tokenizer) if tokenizer is not None else INT64_LIMIT
    for path in paths:
        records = read_records(Path(path))
        first = f"{path}:{records[0][0]}"
        fmt = _detect(first, records[0][1])
        unpaired = fmt.startswith("unpaired")
        if paired_only and unpaired:
            raise DataError(f"{first}: unpaired (KTO) preference data; this stage needs chosen and rejected")
        for a in range(0, len(records), CHUNK):
            chunk = [(f"{path}:{line}", rec) for line, rec in records[a : a + CHUNK]]
            labels = [_label(rec, where) if unpaired else None for where, rec in chunk]
            if fmt.endswith("tokens"):
                keys = ("prompt_input_ids", "completion_input_ids") if unpaired else PAIRED_TOKEN_KEYS
                for (where, rec), label in zip(chunk, labels):
                    prompt, *completions = (_ids(rec, k, where, vocab_size) for k in keys)
                    yield where, [prompt] * len(completions), completions, label, _margin(rec, where), ()
                continue
            split = [(where, *_split(rec, where, not unpaired)) for where, rec in chunk]
            images = [images_of(rec, where, DataFile(Path(path))) for where, rec in chunk]
            if any(images) or vision is not None:
                for (where, prompt, completions), rec, label in zip(split, (r for _, r in chunk), labels):
                    if vision is None:
                        raise DataError(
                            f"{where}: images: the model is a text model (images train a vision-language one)"
                        )
                    ids, done = vision.pair(where, prompt, completions, rec, DataFile(Path(path)))
                    _check_vocab(where, (ids, *done), vocab_size)
                    yield (
                        where,
                        [ids] * len(done),
                        done,
                        label,
                        _margin(rec, where),
                        images_of(rec, where, DataFile(Path(path))),
                    )
                continue
            margins = [_margin(rec, where) for where, rec in chunk]
            split = [(w, _plain(p), [_plain(c) for c in cs]) for w, p, cs in split]  # a text model's turns
            if rule == "joint":
                encoded = _joint(tokenizer, split)
            else:
                encoded = _answers(tokenizer, [_text(tokenizer, *x) for x in split])
            for (where, *_), (prompts, completions), label, margin in zip(split, encoded, labels, margins):
                _check_vocab(where, (*prompts, *completions), vocab_size)
                yield where, prompts, completions, label, margin, ()


def _plain(x):
    """Text, or a conversation with its text parts joined (a text model's chat template takes strings)."""
    return joined(x) if isinstance(x, list) else x


def _check_vocab(where: str, seqs, vocab_size: int) -> None:
    for ids in seqs:
        if (bad := out_of_vocab(ids, vocab_size)) is not None:
            raise DataError(
                f"{where}: the tokenizer gives token id {bad}, outside the model's vocabulary "
                f"[0, {vocab_size}) (is it the model's tokenizer?)"
            )


def _detect(where: str, rec: dict[str, Any]) -> str:
    keys = set(rec)
    if set(PAIRED_TOKEN_KEYS) <= keys:
        return "paired_tokens"
    if {"prompt_input_ids", "completion_input_ids", "label"} <= keys:
        return "unpaired_tokens"
    if {"chosen", "rejected"} <= keys:
        return "paired"
    if {"prompt", "completion", "label"} <= keys:
        return "unpaired"
    raise DataError(
        f"{where}: cannot detect the preference format from the keys {sorted(keys)}; expected chosen+rejected "
        "(and prompt), prompt+completion+label, or their *_input_ids forms"
    )


def _label(rec: dict, where: str) -> bool:
    if "label" not in rec:
        raise DataError(f"{where}: missing field 'label' (record has {sorted(rec)})")
    if not isinstance(rec["label"], bool):
        raise DataError(f"{where}: field 'label' must be true or false, got {rec['label']!r}")
    return rec["label"]


def _margin(rec: dict, where: str) -> float:
    value = rec.get("margin", 0.0)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DataError(f"{where}: field 'margin' must be a finite number, got {value!r}")
    return float(value)


def _ids(rec: dict, key: str, where: str, vocab_size: int) -> list[int]:
    if key not in rec:
        raise DataError(f"{where}: missing field {key!r} (record has {sorted(rec)})")
    ids = _int_list(rec, key, where)
    if not ids and key != "prompt_input_ids":
        raise DataError(f"{where}: {key!r} is empty")
    if (bad := out_of_vocab(ids, vocab_size)) is not None:
        raise DataError(f"{where}: token id {bad} in {key!r} is outside the vocabulary [0, {vocab_size})")
    return ids


def _text_or_messages(rec: dict, key: str, where: str) -> str | Messages:
    if key not in rec:
        raise DataError(f"{where}: missing field {key!r} (record has {sorted(rec)})")
    value = rec[key]
    if value is None:
        raise DataError(f"{where}: field {key!r} is null, expected a string or a list of messages")
    if isinstance(value, str):
        return value
    if not isinstance(value, list) or not value:
        raise DataError(f"{where}: field {key!r} must be a string or a non-empty list of messages")
    out = []
    for k, m in enumerate(value):
        content = m.get("content") if isinstance(m, dict) else None
        if not (isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(content, (str, list))):
            raise DataError(f"{where}: message {k} of {key!r} must be an object with string role and content")
        if m["role"] not in CHAT_ROLES:
            raise DataError(f"{where}: message {k} of {key!r} has unknown role {m['role']!r}")
        if isinstance(content, list):  # TRL's content parts (vision-language data)
            content = _parts(content, f"{where}: message {k} of {key!r}")
        out.append({"role": m["role"], "content": content})
    return out


def _split(rec: dict, where: str, paired: bool) -> tuple[str | Messages, list[str | Messages]]:
    """The prompt and completions of a text record, with an implicit prompt extracted."""
    keys = ("chosen", "rejected") if paired else ("completion",)
    completions = [_text_or_messages(rec, k, where) for k in keys]
    chat = isinstance(completions[0], list)
    if paired and isinstance(completions[1], list) != chat:
        raise DataError(f"{where}: fields 'chosen' and 'rejected' must both be strings or both message lists")
    prompt = _text_or_messages(rec, "prompt", where) if rec.get("prompt") is not None or not paired else None
    if prompt is None or isinstance(prompt, list) != chat:
        if not paired:
            raise DataError(
                f"{where}: fields 'prompt' and 'completion' must both be strings or both message lists"
            )
        # TRL's maybe_extract_prompt: without a prompt of the same kind, the shared start is the prompt
        return _extract_prompt(where, *completions)
    return prompt, completions


def _extract_prompt(where: str, chosen, rejected) -> tuple[str | Messages, list[str | Messages]]:
    n = min(len(chosen), len(rejected))
    i = next((k for k in range(n) if chosen[k] != rejected[k]), n)
    if isinstance(chosen, str):
        if chosen == rejected:
            raise DataError(f"{where}: fields 'chosen' and 'rejected' are identical")
        if i > 0 and chosen[i - 1] == " ":
            i -= 1  # the space before the first different word starts both completions, as in TRL
    elif i == 0 or i == len(chosen) or i == len(rejected):
        what = "no leading message" if i == 0 else "no completion after their shared messages"
        raise DataError(f"{where}: fields 'chosen' and 'rejected' have {what}, so no implicit prompt")
    return chosen[:i], [chosen[i:], rejected[i:]]


def _need_tokenizer(tokenizer, where: str, chat: bool) -> None:
    """Text needs a tokenizer; a conversation (`chat`) its chat template too."""
    if tokenizer is None:
        raise ConfigError(f"{where}: preference text needs a tokenizer (set tokenizer_name_or_path)")
    if chat:
        require_chat_template(tokenizer, where)


def _require_tokenizer(tokenizer, where: str, prompt) -> None:
    """Text needs a tokenizer; a conversation its chat template and a prompt ending on a user or
    tool turn (after which the generation prompt makes sense)."""
    _need_tokenizer(tokenizer, where, isinstance(prompt, list))
    if isinstance(prompt, list) and prompt[-1]["role"] not in _PROMPT_ENDS:
        raise DataError(
            f"{where}: the prompt's last message is {prompt[-1]['role']!r}; it must be a user or tool turn"
        )


def _joint(tokenizer, records: list[tuple]) -> list[tuple[list[list[int]], list[list[int]]]]:
    """TRL 1.16's DPOTrainer and KTOTrainer: for each (file:line, prompt, completions) record, each
    completion tokenised with its prompt (chat.joint_prompt_completions); the prompt tokens are
    what all of them keep of it, the shortest (chosen and rejected share them), as TRL takes them."""
    chat = isinstance(records[0][1], list)
    for where, prompt, _ in records:
        _require_tokenizer(tokenizer, where, prompt)
        if isinstance(prompt, list) != chat:
            raise DataError(
                f"{where}: a record of another form than the first's ({'text' if chat else 'messages'})"
            )
    seqs = iter(joint_prompt_completions(tokenizer, [(w, p, c) for w, p, cs in records for c in cs]))
    out = []
    for _, _, completions in records:
        row = [next(seqs) for _ in completions]
        n = min(p for _, p in row)
        out.append(([row[0][0][:n]] * len(row), [ids[n:] for ids, _ in row]))
    return out


def _text(tokenizer, where: str, prompt, completions) -> _Text:
    _require_tokenizer(tokenizer, where, prompt)
    if isinstance(prompt, str):
        return _Text(where, prompt, completions, chat=False)
    return _Text(where, *render_completions(tokenizer, prompt, completions, where), chat=True)


def _answers(tokenizer, texts: list[_Text]) -> list[tuple[list[list[int]], list[list[int]]]]:
    """TRL 1.16's ORPOTrainer and CPOTrainer (`tokenize_row`, `build_tokenized_answer`), in two
    batched tokenizer calls: each completion tokenised with its prompt, no special tokens; its
    prompt is the joint tokens up to the prompt's own length, one fewer where the last of those
    differs (a token merged across the boundary); the BOS id goes before a prompt that does not
    start with it and the EOS id after a completion that does not end with it (a rendered
    conversation's too). As TRL refuses them, chosen and rejected prompts more than one token
    apart are an error."""
    own = tokenizer([x.prompt for x in texts], add_special_tokens=False)["input_ids"]
    joint = iter(
        tokenizer([x.prompt + c for x in texts for c in x.completions], add_special_tokens=False)["input_ids"]
    )
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    out = []
    for x, prompt in zip(texts, own):
        prompts, completions = [], []
        for _ in x.completions:
            ids = list(next(joint))
            n = len(prompt) - (ids[: len(prompt)] != prompt)
            prompts.append(ids[:n])
            completions.append(ids[n:])
        if len(prompts) == 2 and (
            abs(len(prompts[0]) - len(prompts[1])) > 1 or sum(a != b for a, b in zip(*prompts)) > 1
        ):
            raise DataError(
                f"{x.where}: the prompt tokenises with chosen and with rejected more than one token apart "
                "(TRL's ORPO and CPO trainers refuse it)"
            )
        if bos is not None:
            prompts = [p if p[:1] == [bos] else [bos, *p] for p in prompts]
        if eos is not None:
            completions = [c if c[-1:] == [eos] else [*c, eos] for c in completions]
        out.append((prompts, completions))
    return out


def render_completions(
    tokenizer, prompt: Messages, completions: list[Messages], where: str
) -> tuple[str, list[str]]:
    """The prompt rendered with the generation prompt and, for each completion, the text the chat
    template writes after it in prompt + completion. As TRL does, the prompt text is cut back to
    what every rendering shares (a template may write the generation prompt differently)."""
    _require_tokenizer(tokenizer, where, prompt)
    full = [_render(tokenizer, prompt + c, False, where) for c in completions]
    shared = os.path.commonprefix([_render(tokenizer, prompt, True, where), *full])
    return shared, [f[len(shared) :] for f in full]
