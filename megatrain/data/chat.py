"""Chat conversations -> tokens and labels, with the loss on the assistant turns.

The conversation is rendered with the tokenizer's own chat template. Which characters belong
to each assistant turn is found by rendering growing prefixes of the conversation (the way
TRL and LlamaFactory do it): the turn starts where `messages[:i]` plus the generation prompt
ends and stops where `messages[:i+1]` ends. That needs no knowledge of the template, so it
works for ChatML, Llama 3, Mistral, Gemma... alike. The character spans are then mapped to
tokens through the fast tokenizer's offsets, so a template's whitespace or a BPE merge across
the boundary cannot shift the mask by a token.
"""

from __future__ import annotations

from ..errors import ConfigError, DataError
from .batch import IGNORE_INDEX
from .formats import Messages

Span = tuple[int, int]


def require_chat_template(tokenizer, where: str) -> None:
    """ConfigError when `tokenizer` cannot render chat data (`where` names the dataset file)."""
    if not getattr(tokenizer, "chat_template", None):
        name = getattr(tokenizer, "name_or_path", "") or "(in memory)"
        raise ConfigError(
            f"tokenizer at {name} has no chat template; {where} is chat data. Use a tokenizer with a "
            "chat_template (tokenizer_config.json or chat_template.jinja), or a text/tokens dataset"
        )


_PROBE = "megatrain end-of-turn probe"


def end_of_turn_id(tokenizer, render=None) -> int | None:
    """The special token a chat template closes an assistant turn with (<|im_end|>, <|eot_id|>,
    <end_of_turn>, </s>...): the first special token after the assistant's content when a short
    conversation is rendered (by `render`, a vision-language model's processor, where it holds
    the template). None without a chat template, or when the template puts none there.

    Generation has to stop at it: a model fine-tuned on chats ends its answers with it, and an
    EOS that the template never writes is never generated."""
    render = render if render is not None else tokenizer
    if not getattr(render, "chat_template", None):
        return None
    messages = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": _PROBE}]
    try:
        text = render.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template that cannot render this conversation names no token
        return None
    at = text.rfind(_PROBE) if isinstance(text, str) else -1
    if at < 0:
        return None
    special = set(tokenizer.all_special_ids) | {
        i for i, t in tokenizer.added_tokens_decoder.items() if t.special
    }
    ids = tokenizer(text[at + len(_PROBE) :], add_special_tokens=False)["input_ids"]
    return next((i for i in ids if i in special), None)


def encode_chats(
    tokenizer, chats: list[tuple[str, Messages]], train_on_prompt: bool
) -> list[tuple[list[int], list[int]]]:
    """Token ids and unshifted labels for each (file:line, messages) conversation.

    Labels are -100 everywhere except on assistant turns (content and end-of-turn token), or
    on every token when `train_on_prompt`. The rendered text is tokenised without adding
    special tokens: templates that want a BOS write it themselves, so adding one would double it.
    """
    texts, spans = [], []
    for where, messages in chats:
        text, sp = render_with_spans(tokenizer, messages, where)
        texts.append(text)
        spans.append(sp)
    # One batched call: the Rust tokenizer parallelises across the texts.
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    out = []
    for ids, offsets, sp in zip(enc["input_ids"], enc["offset_mapping"], spans):
        labels = list(ids) if train_on_prompt else _labels_in_spans(ids, offsets, sp)
        out.append((list(ids), labels))
    return out


def render_with_spans(tokenizer, messages: Messages, where: str) -> tuple[str, list[Span]]:
    """The rendered conversation and the character spans of its assistant turns."""
    full = _render(tokenizer, messages, False, where)
    spans: list[Span] = []
    cursor = 0
    for i, m in enumerate(messages):
        if m["role"] != "assistant":
            continue
        span = _prefix_span(tokenizer, messages, i, full, cursor, where)
        if span is None:
            span = _search_span(tokenizer, messages, i, full, cursor, where)
        start, end = span
        # The newline a template puts after the end-of-turn token belongs to the next turn's
        # layout; the model should learn to emit the end-of-turn token, not what follows it.
        while end > start and full[end - 1].isspace():
            end -= 1
        spans.append((start, end))
        cursor = span[1]
    return full, spans


def _render(tokenizer, messages: Messages, generation_prompt: bool, where: str) -> str:
    try:
        out = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    except Exception as e:  # jinja2 errors, including the template's own raise_exception
        msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{where}: the chat template refused this conversation ({msg})") from None
    if not isinstance(out, str):
        raise DataError(f"{where}: the chat template did not render to a string")
    return out


def _prefix_span(tokenizer, messages: Messages, i: int, full: str, cursor: int, where: str) -> Span | None:
    """Assistant turn i by prefix rendering; None when the template is not prefix-stable (e.g.
    it drops the reasoning of earlier turns, or cannot render a conversation that ends early)."""
    try:
        before = _render(tokenizer, messages[:i], True, where)
        through = full if i == len(messages) - 1 else _render(tokenizer, messages[: i + 1], False, where)
    except DataError:
        return None
    if len(before) < cursor or not through.startswith(before) or not full.startswith(through):
        return None
    return len(before), len(through)


def _search_span(tokenizer, messages: Messages, i: int, full: str, cursor: int, where: str) -> Span:
    """Fallback: find the assistant content itself in the rendering, after the previous turn,
    and extend it over whatever the template writes after an assistant's content (its
    end-of-turn marker), as learnt from rendering the conversation up to this turn."""
    content = messages[i]["content"]
    if isinstance(content, list):  # parts (vision-language data): the assistant's text
        content = "".join(p.get("text", "") for p in content)
    start = full.find(content, cursor)
    if start < 0 or not content:
        raise DataError(
            f"{where}: cannot locate assistant turn {i} in the chat template's rendering, so the "
            "tokens to train on are unknown (the template changes or drops assistant content)"
        )
    end = start + len(content)
    try:
        through = _render(tokenizer, messages[: i + 1], False, where)
    except DataError:
        return start, end
    at = through.rfind(content)
    tail = through[at + len(content) :] if at >= 0 else ""
    if tail and full.startswith(tail, end):
        end += len(tail)
    return start, end


def _labels_in_spans(ids: list[int], offsets: list[Span], spans: list[Span]) -> list[int]:
    """ids where a token overlaps one of the (sorted, disjoint) character spans, else -100."""
    labels = [IGNORE_INDEX] * len(ids)
    k = 0
    for t, (a, b) in enumerate(offsets):
        while k < len(spans) and spans[k][1] <= a:
            k += 1
        if k == len(spans):
            break
        s, e = spans[k]
        if a < e and b > s:
            labels[t] = ids[t]
    return labels


def joint_prompt_completions(
    tokenizer, rows: list[tuple[str, object, object]]
) -> list[tuple[list[int], int]]:
    """TRL 1.16's tokenisation of (file:line, prompt, completion) rows (SFTTrainer's, DPOTrainer's,
    KTOTrainer's): prompt + completion tokenised together (`joint_sequences`), the completion
    starting where the prompt's own tokenisation parts from it (their common prefix: a token
    merged across the boundary belongs to the completion); a conversation's prompt is rendered
    with the generation prompt. Each: (ids, the prompt's length)."""
    prompts = [_render(tokenizer, p, True, w) if isinstance(p, list) else p for w, p, _ in rows]
    fulls = joint_sequences(tokenizer, rows)
    return [(f, _common_prefix(p, f)) for p, f in zip(_encode(tokenizer, rows, prompts), fulls)]


def joint_sequences(tokenizer, rows: list[tuple[str, object, object]]) -> list[list[int]]:
    """TRL 1.16's token ids of prompt + completion as one sequence, for each (file:line, prompt,
    completion) row (the full sequence of SFTTrainer, DPOTrainer and KTOTrainer; RewardTrainer's
    chosen and rejected sequences, whose prompt may be empty: "" or []). Text: the tokenizer's
    EOS string added to a completion that does not end with it, tokenised as the tokenizer does by
    default (its BOS); a conversation: rendered whole by the chat template (no generation prompt),
    no special tokens added (the template writes its own)."""
    eos = tokenizer.eos_token or ""
    texts = [
        _render(tokenizer, p + c, False, w)
        if isinstance(c, list)
        else p + c + ("" if c.endswith(eos) else eos)
        for w, p, c in rows
    ]
    return [list(ids) for ids in _encode(tokenizer, rows, texts)]


def _encode(tokenizer, rows, texts: list[str]) -> list[list[int]]:
    """`texts` tokenised in one batched call, with the tokenizer's special tokens for text rows
    and without them for rendered conversations (all of a kind, as the first row)."""
    chat = isinstance(rows[0][2], list) if rows else False
    return tokenizer(texts, add_special_tokens=not chat)["input_ids"] if texts else []


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
