"""Loading a local Hugging Face tokenizer (a Hub name is fetched to a local snapshot first:
io/pretrained.py)."""

from __future__ import annotations

import json
from pathlib import Path

from transformers import PreTrainedTokenizerFast

from ..errors import ConfigError

# Everything transformers' AutoTokenizer may read, chat templates included, and what AutoProcessor
# reads beside them for a vision-language model (its image processor's settings): the files a
# model directory's tokenizer is written back with.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "preprocessor_config.json",
    "processor_config.json",
)
_SOURCE = "_megatrain_source_files"
"""The attribute of a loaded tokenizer holding the files it was loaded from, name -> bytes."""


def load_tokenizer(path: str | Path, optional: bool = False) -> PreTrainedTokenizerFast | None:
    """Load a fast tokenizer from a local directory or a `tokenizer.json` file.

    A directory is loaded as Hugging Face saves it (tokenizer.json, tokenizer_config.json,
    special_tokens_map.json, chat_template.jinja). A bare tokenizer.json is loaded with the
    special tokens and chat template of a tokenizer_config.json / chat_template.jinja beside it
    when those exist. Raises ConfigError naming the path when nothing usable is there, except
    that with `optional` a directory without tokenizer files gives None (a model directory
    used for pre-tokenised data).
    """
    p = Path(path)
    if not p.exists():
        raise ConfigError(f"tokenizer {p}: no such file or directory")
    if p.is_file():
        if p.name == "tokenizer.json" and (p.parent / "tokenizer_config.json").is_file():
            return _load_dir(p.parent)  # the config beside it knows bos/eos/pad and the template
        return _load_file(p)
    if not (p / "tokenizer.json").is_file() and not (p / "tokenizer_config.json").is_file():
        if optional:
            return None
        raise ConfigError(f"tokenizer {p}: directory has no tokenizer.json or tokenizer_config.json")
    return _load_dir(p)


def save_tokenizer(tokenizer: PreTrainedTokenizerFast, directory: Path) -> None:
    """Write `tokenizer` into a model directory: the files `load_tokenizer` read, byte for byte
    (save_pretrained would add what it was loaded with, such as `"local_files_only": true`, and
    rewrite the rest in this transformers' dialect); a tokenizer built otherwise, as
    save_pretrained writes it."""
    files = getattr(tokenizer, _SOURCE, None)
    if files is None:
        tokenizer.save_pretrained(directory)
        return
    for name, data in files.items():
        (Path(directory) / name).write_bytes(data)


def _load_file(p: Path) -> PreTrainedTokenizerFast:
    try:
        tok = PreTrainedTokenizerFast(tokenizer_file=str(p))
    except Exception as e:  # tokenizers raises bare Exceptions for malformed JSON
        _check_json(p)
        raise ConfigError(f"tokenizer {p}: cannot be read ({_first_line(e)})") from None
    files = {"tokenizer.json": p.read_bytes()}  # under the name loaders look for
    template = p.parent / "chat_template.jinja"
    if template.is_file():
        files[template.name] = template.read_bytes()
        tok.chat_template = files[template.name].decode()
    setattr(tok, _SOURCE, files)
    return tok


def _load_dir(p: Path) -> PreTrainedTokenizerFast:
    # AutoTokenizer honours the model-specific class named in tokenizer_config.json (BOS/EOS
    # handling differs per family); fall back to the generic fast class when that class is not
    # available in this transformers version.
    from transformers import AutoTokenizer

    errors = []
    for loader in (AutoTokenizer, PreTrainedTokenizerFast):
        try:
            tok = loader.from_pretrained(str(p), local_files_only=True)
        except Exception as e:
            errors.append(_first_line(e))
            continue
        if not getattr(tok, "is_fast", False):
            errors.append(f"{type(tok).__name__} is not a fast tokenizer")
            continue
        setattr(tok, _SOURCE, {n: (p / n).read_bytes() for n in TOKENIZER_FILES if (p / n).is_file()})
        return tok
    for name in TOKENIZER_FILES:
        if name.endswith(".json") and (p / name).is_file():
            _check_json(p / name)
    raise ConfigError(f"tokenizer {p}: cannot be loaded ({errors[-1]})")


def _check_json(path: Path) -> None:
    """ConfigError naming `path` and the line where it is not JSON (transformers' and
    tokenizers' errors name neither); nothing when it parses."""
    try:
        json.loads(path.read_bytes())
    except UnicodeDecodeError:
        raise ConfigError(f"tokenizer {path}: not UTF-8 text") from None
    except json.JSONDecodeError as e:
        raise ConfigError(
            f"tokenizer {path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})"
        ) from None


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def pad_token_id(
    tokenizer: PreTrainedTokenizerFast | None, vocab_size: int | None = None, model_pad: int | None = None
) -> int:
    """The id used to pad micro-batches: the tokenizer's pad, else its EOS, else the model
    config's `pad_token_id` (`model_pad`), else 0; the first that is below `vocab_size`.

    The value never matters for the loss (padded positions carry label -100 and right padding
    is invisible to causal attention), it only has to be a valid embedding row.
    """
    candidates = (tokenizer.pad_token_id, tokenizer.eos_token_id) if tokenizer is not None else ()
    for tid in (*candidates, model_pad):
        if isinstance(tid, int) and tid >= 0 and (vocab_size is None or tid < vocab_size):
            return tid
    return 0
