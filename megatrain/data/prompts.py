"""Prompts for sampling (`stage: grpo`): records with a `prompt`, a string or a list of messages
(TRL's standard and conversational forms, or `prompt_input_ids`, pre-tokenised); every other
field is a column the reward functions receive.

A conversational prompt (ending with a user or tool turn) is rendered by the chat template with
the generation prompt; a string prompt gets the BOS the tokenizer adds by default. Prompts keep
their last `max_prompt_length` tokens (TRL's left truncation).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DataError
from .chat import _render, require_chat_template
from .formats import _int_list, out_of_vocab
from .preference import _PROMPT_ENDS, _text_or_messages
from .samples import INT64_LIMIT, Sample
from .sources import read_records


@dataclass
class Prompt:
    ids: list[int]
    prompt: Any
    """The record's prompt as written (a string or messages): what reward functions receive."""
    columns: dict[str, Any]
    source: str

    @property
    def conversational(self) -> bool:
        return isinstance(self.prompt, list)


def build_prompts(
    paths, tokenizer, max_prompt_length: int | None, vocab_size: int | None = None
) -> list[Prompt]:
    """Every record's prompt, tokenised, in file order."""
    if vocab_size is None:
        vocab_size = len(tokenizer) if tokenizer is not None else INT64_LIMIT
    out = []
    for path in paths:
        for line, rec in read_records(Path(path)):
            where = f"{path}:{line}"
            out.append(_prompt(rec, where, tokenizer, vocab_size, max_prompt_length))
    if not out:
        raise DataError(f"{paths[0]}: no prompts")
    return out


def _prompt(rec: dict, where: str, tokenizer, vocab_size: int, keep: int | None) -> Prompt:
    if "prompt_input_ids" in rec:
        ids = _int_list(rec, "prompt_input_ids", where)
        prompt = rec.get("prompt", ids)
        columns = {k: v for k, v in rec.items() if k not in ("prompt", "prompt_input_ids")}
    else:
        if "prompt" not in rec:
            raise DataError(f"{where}: missing field 'prompt' (record has {sorted(rec)})")
        prompt = _text_or_messages(rec, "prompt", where)
        if tokenizer is None:
            raise ConfigError(f"{where}: text prompts need a tokenizer (set tokenizer_name_or_path)")
        if isinstance(prompt, list):
            require_chat_template(tokenizer, where)
            if prompt[-1]["role"] not in _PROMPT_ENDS:
                raise DataError(
                    f"{where}: the prompt's last message is {prompt[-1]['role']!r}; it must be a user turn"
                )
            ids = tokenizer(_render(tokenizer, prompt, True, where), add_special_tokens=False)["input_ids"]
        else:
            ids = tokenizer(prompt, add_special_tokens=True)["input_ids"]
        columns = {k: v for k, v in rec.items() if k != "prompt"}
    if not ids:
        raise DataError(f"{where}: the prompt has no tokens")
    if (bad := out_of_vocab(ids, vocab_size)) is not None:
        raise DataError(f"{where}: token id {bad} in the prompt is outside the vocabulary [0, {vocab_size})")
    if keep is not None:
        ids = ids[-keep:]
    return Prompt(list(ids), prompt, columns, where)


def prompt_samples(prompts: list[Prompt]) -> list[Sample]:
    """The prompts as samples a Batcher orders (nothing in them is a target)."""
    return [Sample(p.ids, [-100] * len(p.ids), p.source) for p in prompts]
