"""build_samples: dataset files -> tokenised training samples with labels."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from tqdm.auto import tqdm

from ..errors import ConfigError, DataError
from ..metrics import show_progress
from .batch import IGNORE_INDEX
from .chat import encode_chats, joint_prompt_completions, require_chat_template
from .formats import ImageChat, PromptCompletion, Tokens, detect_format, normalize, out_of_vocab
from .sources import read_records, resolve_dataset

CHAT_FORMATS = ("messages", "sharegpt", "alpaca")
CHUNK = 2048  # records per batched tokenizer call: large enough to amortise, small for the bar
INT64_LIMIT = 2**63  # ids become int64 tensors
SPLIT = "split"  # truncation: split, the one string value (true and false are booleans)


@dataclass(slots=True)
class Sample:
    """One training sequence. `labels` are unshifted (labels[t] is the target at position t)
    with -100 where no loss is taken; `source` is "file:line" for messages."""

    input_ids: list[int]
    labels: list[int]
    source: str
    parts: tuple[int, ...] | None = None
    """Several sequences in one sample (a preference pair: chosen, rejected), their lengths in
    order: each is a row of its own (or, packed, a document), never attending to the others; None:
    one sequence."""
    slots: list[int] | None = None
    """Per token, the per-sequence sum its log-prob goes into, as a code an objective reads (the
    preference stages: data/preference.py), -1 for none; None: no per-sequence sums."""
    extra: tuple[float, ...] = ()
    """Per-sample numbers an objective needs (preference: the reference log-probs, KTO's label),
    carried to `MicroBatch.extra`."""
    counted: int | None = None
    """Its tokens TRL's `num_tokens` counts where not all (a KTO example: its sequence's, not its
    KL sequence's)."""
    images: tuple | None = None
    """A vision-language sample's images (paths or bytes, formats.ImageRef), in the order of its
    image tokens; their pixels are made with its micro-batch (data/vision.py)."""

    def __post_init__(self):
        if len(self.input_ids) != len(self.labels):
            raise DataError(f"{self.source}: {len(self.labels)} labels for {len(self.input_ids)} input_ids")
        if self.parts is not None and sum(self.parts) != len(self.input_ids):
            raise DataError(
                f"{self.source}: parts {self.parts} do not add up to {len(self.input_ids)} tokens"
            )

    @property
    def has_labels(self) -> bool:
        """Whether any token is trained on; labels[0] never is (nothing comes before it)."""
        return any(x != IGNORE_INDEX for x in self.labels[1:])


def build_samples(
    cfg,
    tokenizer,
    vocab_size: int | None = None,
    key: str = "dataset",
    warn: Callable[[str], None] = print,
    vision=None,
) -> list[Sample]:
    """Read, validate and tokenise every file of `cfg.dataset` (or of the key named, e.g.
    eval_dataset: the same formats and chat handling), in order.

    Samples longer than `cfg.max_length` are split into windows, truncated or refused with a
    DataError naming file:line, as `cfg.truncation` says (`split_windows`); plain text with
    packing is always split, so pretraining data loses nothing. One policy for rows with nothing
    to train on (a conversation without an assistant turn, labels all masked, or none left by the
    cut to max_length): they are dropped, counted per file and reason in one warning each
    (`warn`); if every row is dropped, it is a DataError. `tokenizer` may be None only for the
    pre-tokenised `tokens` format. Every token id, read or produced by the tokenizer, must be
    below `vocab_size` (the model's embedding rows; default: the tokenizer's size). `vision`: a
    vision-language model's processor (data/vision.py's VisionData), which renders its chat data,
    images included; without one, images in the data are refused.
    """
    if vocab_size is None:
        vocab_size = len(tokenizer) if tokenizer is not None else INT64_LIMIT
    samples: list[Sample] = []
    dropped: dict[tuple[str, str], list] = {}  # (file, reason) -> [rows, first file:line, rows of the file]
    for file in resolve_dataset(cfg, key):
        records = read_records(file.path)
        where0 = f"{file.path}:{records[0][0]}"
        fmt = file.format if file.format != "auto" else detect_format(where0, records[0][1], file.columns)
        encode = _encoder(fmt, cfg, tokenizer, str(file.path), vision)
        bar = tqdm(
            total=len(records),
            desc=f"tokenizing {file.path.name}",
            unit="rec",
            disable=not show_progress(cfg.disable_tqdm),
        )
        for chunk in _chunks(records, CHUNK):
            items = [
                (f"{file.path}:{line}", normalize(fmt, file, f"{file.path}:{line}", rec, vocab_size))
                for line, rec in chunk
            ]
            for (where, item), (ids, labels) in zip(items, encode(items)):
                if fmt != "tokens" and (bad := out_of_vocab(ids, vocab_size)) is not None:
                    raise DataError(
                        f"{where}: the tokenizer gives token id {bad}, outside the model's vocabulary "
                        f"[0, {vocab_size}) (is it the model's tokenizer?)"
                    )
                images = item.images if isinstance(item, ImageChat) else None
                whole = Sample(ids, labels, where, images=images)
                kept = [s for s in _fit(whole, fmt, cfg) if s.has_labels]
                if not kept:
                    reason = _why_dropped(fmt, item, whole, cfg.max_length)
                    dropped.setdefault((str(file.path), reason), [0, where, len(records)])[0] += 1
                samples += kept
            bar.update(len(chunk))
        bar.close()
    if not samples:
        rows = sum(n for n, _, _ in dropped.values())
        why = "; ".join(f"{n:,} with {reason}" for (_, reason), (n, _, _) in dropped.items())
        first = next(iter(dropped.values()))[1]
        raise DataError(f"{key}: no trainable samples: all {rows:,} rows dropped ({why}; first: {first})")
    for (path, reason), (n, first, total) in dropped.items():
        warn(f"megatrain: warning: dropped {n:,} of {total:,} rows of {path}: {reason} (first: {first})")
    return samples


def _why_dropped(fmt: str, item, sample: Sample, max_length: int) -> str:
    """Why a row gives no sample with a label: the reason as the warning words it."""
    what = "assistant tokens" if fmt in (*CHAT_FORMATS, "prompt_completion") else "label tokens"
    item = item.messages if isinstance(item, ImageChat) else item
    if isinstance(item, list) and not any(m["role"] == "assistant" for m in item):
        return "no assistant turn"
    if sample.has_labels:  # it had some before the cut
        return f"no {what} after truncation to max_length={max_length}"
    return f"no {what}"


def _chunks(items: list, size: int) -> Iterator[list]:
    for i in range(0, len(items), size):
        yield items[i : i + size]


Encoded = list[tuple[list[int], list[int]]]


def _encoder(
    fmt: str, cfg, tokenizer, where: str, vision=None
) -> Callable[[list[tuple[str, object]]], Encoded]:
    """The batched encoder for a format, after checking the tokenizer can serve it."""
    if fmt == "tokens":
        return _encode_tokens
    if tokenizer is None:
        raise ConfigError(f"{where}: the {fmt} format needs a tokenizer (set tokenizer_name_or_path)")
    if fmt == "text":
        return lambda items: _encode_text(tokenizer, items)
    if fmt == "prompt_completion":
        return lambda items: _encode_pc(tokenizer, items, cfg.train_on_prompt, where)
    if fmt in CHAT_FORMATS and vision is not None:  # the processor's template, images expanded
        return lambda items: vision.encode(list(items), cfg.train_on_prompt)
    if fmt in CHAT_FORMATS:
        require_chat_template(tokenizer, where)
        return lambda items: encode_chats(tokenizer, _no_images(items), cfg.train_on_prompt)
    raise ConfigError(f"dataset_format: unknown format {fmt!r}")


def _no_images(items: list[tuple[str, object]]) -> list[tuple[str, object]]:
    """The conversations of a text model's data, refusing images (they need a vision-language model)."""
    for where, item in items:
        if isinstance(item, ImageChat):
            raise DataError(
                f"{where}: images: the model is a text model (images train a vision-language one)"
            )
    return list(items)


def _encode_tokens(items: list[tuple[str, Tokens]]) -> Encoded:
    return [(t.input_ids, list(t.labels) if t.labels is not None else list(t.input_ids)) for _, t in items]


def _encode_text(tokenizer, items: list[tuple[str, str]]) -> Encoded:
    # add_special_tokens=True adds a BOS exactly when the tokenizer does so by default; the EOS
    # closes each document so the model learns where documents end.
    enc = tokenizer([t for _, t in items], add_special_tokens=True)["input_ids"]
    eos = tokenizer.eos_token_id
    out = []
    for ids in enc:
        ids = list(ids)
        if eos is not None and (not ids or ids[-1] != eos):
            ids.append(eos)
        out.append((ids, list(ids)))
    return out


def _encode_pc(
    tokenizer, items: list[tuple[str, PromptCompletion]], train_on_prompt: bool, where: str
) -> Encoded:
    """TRL's SFT of prompt-completion records: text as prompt + completion + EOS (its EOS string
    added where the completion does not end with it), conversations through the chat template;
    tokenised together (chat.joint_prompt_completions), the loss on every token after the prompt."""
    chat = isinstance(items[0][1].prompt, list)
    for w, x in items:
        if isinstance(x.prompt, list) != chat:
            kind = "conversations" if chat else "text"
            raise DataError(f"{w}: a prompt-completion record of another form than the first's ({kind})")
    if chat:
        require_chat_template(tokenizer, where)
    out = []
    for ids, p in joint_prompt_completions(tokenizer, [(w, x.prompt, x.completion) for w, x in items]):
        out.append((ids, list(ids) if train_on_prompt else [IGNORE_INDEX] * p + ids[p:]))
    return out


def _fit(sample: Sample, fmt: str, cfg) -> list[Sample]:
    """A sample within max_length: as is, split into windows (truncation: split, and plain text
    with packing), truncated, or refused."""
    n, m = len(sample.input_ids), cfg.max_length
    if n <= m:
        return [sample]
    if sample.images:  # a cut through an image's tokens would leave features without places
        raise DataError(
            f"{sample.source}: sample has {n} tokens with its images', more than max_length {m}; "
            "samples with images are not cut (raise max_length)"
        )
    if cfg.truncation == SPLIT or (fmt == "text" and cfg.packing):
        return split_windows(sample, m)
    if not cfg.truncation:
        raise DataError(
            f"{sample.source}: sample has {n} tokens, more than max_length {m} "
            "(set truncation: true to cut it, or split to train on all of it in windows)"
        )
    return [Sample(sample.input_ids[:m], sample.labels[:m], sample.source)]


def split_windows(sample: Sample, max_length: int) -> list[Sample]:
    """Consecutive windows of at most `max_length` tokens that overlap by one token, so every
    token but the sample's first is a target in exactly one window.

    A token is predicted from the one before it, so the first token of a window can never be
    its target: each window after the first starts with the previous window's last token, as
    context only (label -100; it was a target, or masked, in the window before), and its next
    token, a real next-token target within the same document, keeps its label. Masked labels
    (chat prompts) stay masked. Each window is its own sample: positions restart at 0 and, packed,
    it attends to no other window.
    """
    ids, labels, m = sample.input_ids, sample.labels, max_length
    if m < 2:
        return []  # no window can hold a target
    out = [Sample(ids[:m], labels[:m], sample.source)]
    for a in range(m - 1, len(ids) - 1, m - 1):
        out.append(Sample(ids[a : a + m], [IGNORE_INDEX] + labels[a + 1 : a + m], sample.source))
    return out
