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
    """TRL's prompt-completion record: both text, or both conversations (lists of messages)."""

    prompt: str | list[dict[str, str]]
    completion: str | list[dict[str, str]]


Messages = list[dict]
"""Turns: role and content, the content a string or (with images) a list of parts, TRL's
`{"type": "text", "text": ...}` and `{"type": "image"}`."""
ImageRef = str | bytes
"""An image of the data: a path (resolved against the dataset file's folder) or its bytes."""
IMAGE_COLUMNS = ("images", "image")  # TRL's: a list of images, or one


@dataclass
class ImageChat:
    """A conversation with images (vision-language data): one image part per image, in order."""

    messages: Messages
    images: tuple[ImageRef, ...]


Item = str | Tokens | Messages | PromptCompletion | ImageChat


def detect_format(where: str, record: dict[str, Any], columns: dict[str, str] | None = None) -> str:
    """The format of a file, from the keys of its first record (`where` is its file:line), the
    fields that `columns` maps found under their columns' names."""
    keys = set(record)
    col = _columns(columns or {})
    if col("messages") in keys:
        return "messages"
    if "conversations" in keys:
        return "sharegpt"
    if col("input_ids") in keys:
        return "tokens"
    if {col("prompt", "instruction"), col("response", "output")} <= keys:
        return "alpaca"
    if {col("prompt"), col("completion")} <= keys:
        return "prompt_completion"
    if col("text") in keys:
        return "text"
    mapped = f" with columns {columns}" if columns else ""
    raise DataError(
        f"{where}: cannot detect the dataset format from the keys {sorted(keys)}{mapped}; expected messages, "
        "conversations, input_ids, instruction+output, prompt+completion or text (or set dataset_format)"
    )


def _columns(columns: dict[str, str]):
    """The column of a field: where `columns` maps it, else the format's own name (`default`,
    else the field's)."""
    return lambda name, default=None: columns.get(name, default or name)


def normalize(fmt: str, file: DataFile, where: str, rec: dict[str, Any], vocab_size: int) -> Item:
    """One record of format `fmt` as a canonical item; `where` (file:line) prefixes errors and
    token ids of pre-tokenised records must be below `vocab_size`."""
    col = _columns(file.columns)
    if fmt not in ("messages", "sharegpt") and images_of(rec, where, file):
        raise DataError(f"{where}: images are read with conversations only (the messages format)")
    if fmt == "text":
        return _string(rec, col("text"), where)
    if fmt == "tokens":
        return _tokens(rec, where, vocab_size, col("input_ids"), col("labels"))
    if fmt == "prompt_completion":
        return _prompt_completion(rec, where, col("prompt"), col("completion"))
    if fmt == "alpaca":
        return _alpaca(rec, where, file.columns)
    if fmt in ("messages", "sharegpt"):
        return with_images(_conversation(rec, where, fmt, file.columns, file.tags), rec, where, file)
    raise DataError(f"{where}: unknown dataset format {fmt!r}")


def _prompt_completion(rec: dict, where: str, prompt: str, completion: str) -> PromptCompletion:
    """Text (strings) or conversational (lists of messages: TRL's conversational form) fields."""
    if isinstance(rec.get(prompt), list) or isinstance(rec.get(completion), list):
        for key in (prompt, completion):
            if not isinstance(rec.get(key), list):
                raise DataError(
                    f"{where}: fields {prompt!r} and {completion!r} must both be strings or both lists of messages"
                )
        turns = [
            _conversation({k: rec[k]}, where, "messages", {"messages": k}, {}) for k in (prompt, completion)
        ]
        return PromptCompletion(*turns)
    return PromptCompletion(_string(rec, prompt, where), _string(rec, completion, where))


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


def _tokens(
    rec: dict, where: str, vocab_size: int, ids_key: str = "input_ids", labels_key: str = "labels"
) -> Tokens:
    if ids_key not in rec:
        raise DataError(f"{where}: missing field {ids_key!r} (record has {sorted(rec)})")
    ids = _int_list(rec, ids_key, where)
    if not ids:
        raise DataError(f"{where}: {ids_key!r} is empty")
    bad = out_of_vocab(ids, vocab_size)
    if bad is not None:
        raise DataError(f"{where}: token id {bad} in {ids_key!r} is outside the vocabulary [0, {vocab_size})")
    labels = None
    if rec.get(labels_key) is not None:
        labels = _int_list(rec, labels_key, where)
        if len(labels) != len(ids):
            raise DataError(
                f"{where}: {labels_key!r} has {len(labels)} entries but {ids_key!r} has {len(ids)}"
            )
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
        if isinstance(content, list):
            content = _parts(content, f"{where}: turn {k} ({role})")
        elif not isinstance(content, str):
            raise DataError(
                f"{where}: turn {k} ({role}) content must be a string or a list of parts, got {type(content).__name__}"
            )
        messages.append({"role": role_map[role], "content": content})
    return messages  # one without an assistant turn has nothing to train on: build_samples drops it


def _parts(parts: list, where: str) -> list[dict]:
    """TRL's content parts: text (`{"type": "text", "text": ...}`) and images (`{"type": "image"}`,
    the image itself in the record's images column)."""
    out = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "text" and isinstance(part.get("text"), str):
            out.append({"type": "text", "text": part["text"]})
        elif kind == "image":
            out.append({"type": "image"})
        else:
            raise DataError(
                f'{where}: content part {j} must be {{"type": "text", "text": ...}} or {{"type": "image"}}, got {part!r:.60}'
            )
    return out


def image_parts(messages: Messages) -> int:
    """The image parts of a conversation."""
    return sum(
        1 for m in messages if isinstance(m["content"], list) for p in m["content"] if p["type"] == "image"
    )


def with_images(messages: Messages, rec: dict, where: str, file: DataFile) -> Messages | ImageChat:
    """A conversation with the record's images (its `images` column, or TRL's single `image`): an
    ImageChat, one image part per image (where the turns are plain strings, the images go before
    the first user turn's text, as TRL's `prepare_multimodal_messages` puts them); a conversation
    without images as it is, text parts joined."""
    refs = images_of(rec, where, file)
    parts = image_parts(messages)
    if refs and not parts and all(isinstance(m["content"], str) for m in messages):
        first = next((i for i, m in enumerate(messages) if m["role"] == "user"), None)
        if first is not None:
            text = [{"type": "text", "text": messages[first]["content"]}]
            messages = [*messages]
            messages[first] = {**messages[first], "content": [{"type": "image"}] * len(refs) + text}
            parts = len(refs)
    if parts != len(refs):
        column = next((c for c in IMAGE_COLUMNS if c in rec), IMAGE_COLUMNS[0])
        raise DataError(
            f"{where}: field {column!r}: {len(refs)} images for {parts} image parts in the messages"
        )
    return ImageChat(messages, refs) if refs else joined(messages)


def joined(messages: Messages) -> Messages:
    """A conversation without images, each turn's text parts joined into its content string."""
    return [
        m if isinstance(m["content"], str) else {**m, "content": "".join(p["text"] for p in m["content"])}
        for m in messages
    ]


def images_of(rec: dict, where: str, file: DataFile) -> tuple[ImageRef, ...]:
    """The images of a record: paths (relative to the dataset file's folder), bytes, or the
    `{"bytes": ..., "path": ...}` of a datasets Image column; a list of them, or one."""
    column = next((c for c in IMAGE_COLUMNS if rec.get(c) is not None), None)
    if column is None:
        return ()
    value = rec[column]
    values = value if isinstance(value, list) else [value]
    out = []
    for k, v in enumerate(values):
        if isinstance(v, dict) and (v.get("bytes") is not None or v.get("path") is not None):
            v = v["bytes"] if v.get("bytes") is not None else v["path"]
        if isinstance(v, (bytes, bytearray)):
            out.append(bytes(v))
        elif isinstance(v, str) and v:
            out.append(str(file.path.parent / v))  # an absolute path stays as it is
        else:
            raise DataError(
                f"{where}: field {column!r}: entry {k} must be a path or image bytes, got {type(v).__name__}"
            )
    return tuple(out)
