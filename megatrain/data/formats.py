"""Record formats: detecting them and turning each record into one of four canonical items
(plain text, pre-tokenised ids, a chat conversation, a prompt/completion pair), with a
one-line DataError naming file:line for anything malformed."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import DataError
from .batch import IGNORE_INDEX
from .sources import DataFile

CHAT_ROLES = ("system", "user", "assistant", "tool")
# Role names accepted in plain files: OpenAI style and ShareGPT style are both common under
# either key, so both are mapped rather than refused.
_DEFAULT_ROLE_MAP = {r: r for r in CHAT_ROLES} | {"human": "user", "gpt": "assistant"}


@dataclass
class Tokens:
    input_ids: list[int]
    labels: list[int] | None


@dataclass
class PromptCompletion:
    prompt: str
    completion: str


Messages = list[dict[str, str]]
Item = str | Tokens | Messages | PromptCompletion


def detect_format(where: str, record: dict[str, Any]) -> str:
    """The format of a file, from the keys of its first record (`where` is its file:line)."""
    keys = set(record)
    if "messages" in keys:
        return "messages"
    if "conversations" in keys:
        return "sharegpt"
    if "input_ids" in keys:
        return "tokens"
    if {"instruction", "output"} <= keys:
        return "alpaca"
    if {"prompt", "completion"} <= keys:
        return "prompt_completion"
    if "text" in keys:
        return "text"
    raise DataError(
        f"{where}: cannot detect the dataset format from the keys {sorted(keys)}; expected messages, "
        "conversations, input_ids, instruction+output, prompt+completion or text (or set dataset_format)"
    )


def normalize(fmt: str, file: DataFile, where: str, rec: dict[str, Any], vocab_size: int) -> Item:
    """One record of format `fmt` as a canonical item; `where` (file:line) prefixes errors and
    token ids of pre-tokenised records must be below `vocab_size`."""
    if fmt == "text":
        return _string(rec, "text", where)
    if fmt == "tokens":
        return _tokens(rec, where, vocab_size)
    if fmt == "prompt_completion":
        return PromptCompletion(_string(rec, "prompt", where), _string(rec, "completion", where))
    if fmt == "alpaca":
        return _alpaca(rec, where, file.columns)
    if fmt in ("messages", "sharegpt"):
        return _conversation(rec, where, fmt, file.columns, file.tags)
    raise DataError(f"{where}: unknown dataset format {fmt!r}")


def _string(rec: dict, key: str, where: str, optional: bool = False) -> str:
    if key not in rec or rec[key] is None:
        if optional:
            return ""
        if key in rec:
            raise DataError(f"{where}: field {key!r} is null, expected a string")
        raise DataError(f"{where}: missing field {key!r} (record has {sorted(rec)})")
    value = rec[key]
    if not isinstance(value, str):
        raise DataError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def _int_list(rec: dict, key: str, where: str) -> list[int]:
    value = rec[key]
    if not isinstance(value, list) or not all(type(x) is int for x in value):
        raise DataError(f"{where}: {key!r} must be a list of integers")
    return value


def out_of_vocab(ids: list[int], vocab_size: int) -> int | None:
    """The first id outside [0, vocab_size), or None: such an id would index past the
    embedding in the middle of a run."""
    return next((x for x in ids if not 0 <= x < vocab_size), None)


def _tokens(rec: dict, where: str, vocab_size: int) -> Tokens:
    if "input_ids" not in rec:
        raise DataError(f"{where}: missing field 'input_ids' (record has {sorted(rec)})")
    ids = _int_list(rec, "input_ids", where)
    if not ids:
        raise DataError(f"{where}: 'input_ids' is empty")
    bad = out_of_vocab(ids, vocab_size)
    if bad is not None:
        raise DataError(f"{where}: token id {bad} in 'input_ids' is outside the vocabulary [0, {vocab_size})")
    labels = None
    if rec.get("labels") is not None:
        labels = _int_list(rec, "labels", where)
        if len(labels) != len(ids):
            raise DataError(f"{where}: 'labels' has {len(labels)} entries but 'input_ids' has {len(ids)}")
        bad = out_of_vocab([x for x in labels if x != IGNORE_INDEX], vocab_size)
        if bad is not None:
            raise DataError(
                f"{where}: label {bad} is neither -100 nor a token id of the vocabulary [0, {vocab_size})"
            )
    return Tokens(ids, labels)


def _alpaca(rec: dict, where: str, columns: dict[str, str]) -> Messages:
    col = {
        "prompt": "instruction",
        "query": "input",
        "response": "output",
        "system": "system",
        "history": "history",
    }
    col |= {k: v for k, v in columns.items() if k in col}
    instruction = _string(rec, col["prompt"], where)
    query = _string(rec, col["query"], where, optional=True)
    response = _string(rec, col["response"], where)
    system = _string(rec, col["system"], where, optional=True)
    messages: Messages = [{"role": "system", "content": system}] if system else []
    history = rec.get(col["history"]) or []
    if not isinstance(history, list):
        raise DataError(f"{where}: {col['history']!r} must be a list of [prompt, response] pairs")
    for k, pair in enumerate(history):
        if not (isinstance(pair, list) and len(pair) == 2 and all(isinstance(x, str) for x in pair)):
            raise DataError(
                f"{where}: {col['history']!r} entry {k} must be a [prompt, response] pair of strings"
            )
        messages += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    user = instruction + "\n\n" + query if query else instruction
    return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": response}]


def _conversation(rec: dict, where: str, fmt: str, columns: dict[str, str], tags: dict[str, str]) -> Messages:
    key = columns.get("messages", "messages" if fmt == "messages" else "conversations")
    if tags:  # dataset_info.json: exact keys and role names, as LlamaFactory reads them
        role_keys, content_keys = (tags.get("role_tag", "from"),), (tags.get("content_tag", "value"),)
        role_map = {
            tags.get("user_tag", "human"): "user",
            tags.get("assistant_tag", "gpt"): "assistant",
            tags.get("system_tag", "system"): "system",
        }
    else:
        role_keys, content_keys, role_map = ("role", "from"), ("content", "value"), _DEFAULT_ROLE_MAP
    if key not in rec:
        raise DataError(f"{where}: missing field {key!r} (record has {sorted(rec)})")
    turns = rec[key]
    if not isinstance(turns, list):
        raise DataError(f"{where}: {key!r} must be a list of turns, got {type(turns).__name__}")
    if not turns:
        raise DataError(f"{where}: {key!r} is an empty conversation")
    messages: Messages = []
    system_col = columns.get("system")
    if system_col and rec.get(system_col):
        messages.append({"role": "system", "content": _string(rec, system_col, where)})
    for k, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise DataError(f"{where}: turn {k} of {key!r} must be an object, got {type(turn).__name__}")
        rk = next((r for r in role_keys if r in turn), None)
        ck = next((c for c in content_keys if c in turn), None)
        if rk is None or ck is None:
            missing = role_keys[0] if rk is None else content_keys[0]
            raise DataError(f"{where}: turn {k} of {key!r} has no {missing!r} (has {sorted(turn)})")
        role, content = turn[rk], turn[ck]
        if not isinstance(role, str) or role not in role_map:
            raise DataError(
                f"{where}: turn {k} has unknown role {role!r} (expected one of {', '.join(map(str, role_map))})"
            )
        if not isinstance(content, str):
            raise DataError(
                f"{where}: turn {k} ({role}) content must be a string, got {type(content).__name__}"
            )
        messages.append({"role": role_map[role], "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"{where}: conversation has no assistant turn, so nothing to train on")
    return messages
