"""Finding and reading dataset files: JSON, JSONL, CSV/TSV (those also gzip- or
zstandard-compressed), Parquet and Arrow files, directories of them, directories Hugging Face
`datasets` saved (files.py), names registered in a LlamaFactory-style dataset_info.json, and
Hub datasets (hub.py: the Arrow files `datasets.load_dataset` prepares for their split)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import hub
from ..errors import ConfigError, DataError
from .files import KINDS, data_kind, is_saved_dataset, read_arrow, read_csv, read_text, saved_dataset_files

DATA_FILES = "/".join(f".{k}" for k in KINDS) + " (.gz/.zst compressed text too)"
_WS = re.compile(r"[ \t\n\r]*")
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # only escapes can make a surrogate in JSON
_TOO_DEEP = "JSON nested too deeply to read (Python's recursion limit)"


@dataclass
class DataFile:
    """One file to read, with how to interpret its records."""

    path: Path
    format: str = "auto"
    """A dataset format name, or auto (detected from the first record)."""
    columns: dict[str, str] = field(default_factory=dict)
    """Our field name -> the file's column name: dataset_info.json's `columns`, or the config's."""
    tags: dict[str, str] = field(default_factory=dict)
    """dataset_info.json `tags` for sharegpt turns (role_tag, content_tag, user_tag, ...)."""


# ------------------------------------------------------------------------ resolving names
def resolve_dataset(cfg, key: str = "dataset") -> list[DataFile]:
    """The files `cfg.dataset` (or the key named, e.g. eval_dataset) refers to, in order.

    Each entry may be a file, a directory (one Hugging Face `datasets` saved: its data files,
    of the train split for `dataset` and the validation or test split for `eval_dataset` when it
    is a DatasetDict; with a dataset_info.json: every dataset registered there; else every data
    file in it, sorted), or a name registered in `cfg.dataset_info` or in the dataset_info.json
    of the entry's directory ("data/alpaca_en"). A single string may list several entries
    separated by commas, as in LlamaFactory. Files given directly take `cfg.columns`; registered
    ones their registry entry's.
    """
    value = getattr(cfg, key)
    entries = value if isinstance(value, list) else [value]
    if isinstance(value, str) and "," in value and not Path(value).exists():
        entries = [e.strip() for e in value.split(",") if e.strip()]
    if not entries or entries == [None]:
        raise ConfigError(f"{key}: no dataset given")
    info = _load_info(Path(cfg.dataset_info)) if cfg.dataset_info else None
    split = cfg.dataset_test_split if key == "eval_dataset" else cfg.dataset_train_split
    hub_dataset = lambda name: hub.dataset_files(name, key, split, cfg.dataset_config)  # noqa: E731
    files: list[DataFile] = []
    for entry in entries:
        files += _resolve_entry(entry, info, cfg.dataset_format, key, dict(cfg.columns or {}), hub_dataset)
    return files


def _resolve_entry(
    entry: str, info: tuple[Path, dict] | None, fmt: str, key: str, columns: dict[str, str], hub_dataset
) -> list[DataFile]:
    """The files of one entry: a registered name, a file, a directory, a name in the registry of
    its directory, else a Hub dataset (`hub_dataset(name)`: its split's files)."""
    p = Path(entry)
    if info is not None and entry in info[1]:
        return _registered(entry, *info, key)
    if p.is_file():
        return [DataFile(p, fmt, columns)]
    if p.is_dir():
        if is_saved_dataset(p):  # before dataset_info.json: save_to_disk writes one of its own
            return [DataFile(f, fmt, columns) for f in saved_dataset_files(p, key)]
        if (p / "dataset_info.json").is_file():
            info_path, registry = _load_info(p / "dataset_info.json")
            return [f for name in registry for f in _registered(name, info_path, registry, key)]
        found = _files_in(p)
        if not found:
            raise ConfigError(f"{key} {entry}: directory has no dataset_info.json and no {DATA_FILES} files")
        return [DataFile(f, fmt, columns) for f in found]
    local = p.parent / "dataset_info.json"
    if p.parent != Path(".") and local.is_file():
        info_path, registry = _load_info(local)
        if p.name in registry:
            return _registered(p.name, info_path, registry, key)
        raise ConfigError(
            f"{key} {entry}: no such file, and {p.name!r} is not registered in {local} ({_names(registry)})"
        )
    if info is not None:
        raise ConfigError(f"{key} {entry}: no such file, and not a name in {info[0]} ({_names(info[1])})")
    if data_kind(p) is None and hub.is_repo_id(entry):  # a data file's name is a path, not a Hub name
        return [DataFile(f, fmt, columns) for f in hub_dataset(entry)]
    raise ConfigError(
        f"{key} {entry}: no such file or directory (to use a registered name, set dataset_info)"
    )


def _names(registry: dict) -> str:
    names = sorted(registry)
    return "registered: " + ", ".join(names[:10]) + (", ..." if len(names) > 10 else "")


def _files_in(directory: Path) -> list[Path]:
    return sorted(
        f for f in directory.iterdir() if data_kind(f) and f.is_file() and f.name != "dataset_info.json"
    )


def _load_info(path: Path) -> tuple[Path, dict]:
    if not path.is_file():
        raise ConfigError(f"dataset_info {path}: no such file")
    try:
        registry = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"dataset_info {path}:{e.lineno}: not valid JSON ({e.msg})") from None
    if not isinstance(registry, dict) or not all(isinstance(v, dict) for v in registry.values()):
        raise ConfigError(
            f"dataset_info {path}: expected an object of name -> {{file_name, formatting, ...}}"
        )
    return path, registry


def _registered(name: str, info_path: Path, registry: dict, key: str) -> list[DataFile]:
    """The files of one dataset_info.json entry (for config key `key`): a local `file_name`, or
    a Hub dataset's `hf_hub_url` (with LlamaFactory's `subset`, `split` and `folder`). A `split`
    picks one of a saved DatasetDict's."""
    spec = registry[name]
    where = f"dataset_info {info_path}: {name!r}"
    if "file_name" not in spec and "hf_hub_url" not in spec:
        remote = [k for k in ("ms_hub_url", "om_hub_url", "script_url", "cloud_file_name") if k in spec]
        why = (
            f"has {remote[0]}, but only local files and hf_hub_url are read" if remote else "has no file_name"
        )
        raise ConfigError(f"{where} {why}")
    if spec.get("ranking"):
        raise ConfigError(f"{where} is a ranking (preference) dataset, which supervised training cannot use")
    formatting = spec.get("formatting", "alpaca")
    if formatting not in ("alpaca", "sharegpt"):
        raise ConfigError(f"{where}: formatting must be alpaca or sharegpt (got {formatting!r})")
    for k in ("columns", "tags"):
        if not isinstance(spec.get(k, {}), dict):
            raise ConfigError(f"{where}: {k} must be an object")
    target = info_path.parent / spec.get("file_name", "")
    if "file_name" not in spec:
        split = spec.get("split", "train")
        paths = hub.dataset_files(spec["hf_hub_url"], where, split, spec.get("subset"), spec.get("folder"))
    elif target.is_dir() and is_saved_dataset(target):
        paths = saved_dataset_files(target, key, spec.get("split"))
    elif target.is_dir():
        paths = _files_in(target)
    elif target.is_file():
        paths = [target]
    else:
        raise ConfigError(f"{where}: file_name {target} does not exist")
    if not paths:
        raise ConfigError(f"{where}: directory {target} has no {DATA_FILES} files")
    return [DataFile(p, formatting, dict(spec.get("columns", {})), dict(spec.get("tags", {}))) for p in paths]


# ------------------------------------------------------------------------ reading records
def read_records(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """All records of a file as (line, record) pairs; for Parquet and Arrow the "line" is the
    1-based row, for CSV/TSV the line a row starts on (the header is line 1).

    JSON files may hold a top-level list of records or one record per line (JSONL), whatever
    the suffix says, as the Hugging Face `json` loader accepts both; so is a file whose name
    says nothing. Raises DataError naming file:line for anything malformed, and for files that
    are empty or hold no records.
    """
    if not path.is_file():
        raise DataError(f"{path}: no such file")
    kind, compression = data_kind(path) or ("json", None)
    if kind == "parquet":
        records = list(_read_parquet(path))
    elif kind == "arrow":
        records = read_arrow(path)
    elif kind in ("csv", "tsv"):
        records = read_csv(path, read_text(path, compression), "," if kind == "csv" else "\t")
    else:
        text = read_text(path, compression)
        start = _WS.match(text).end()
        if start == len(text):
            raise DataError(f"{path}: file is empty")
        records = list(_read_json_array(path, text, start) if text[start] == "[" else _read_jsonl(path, text))
    if not records:
        raise DataError(f"{path}: no records")
    for line, rec in records:
        if not isinstance(rec, dict):
            raise DataError(f"{path}:{line}: expected a JSON object per record, got {type(rec).__name__}")
    return records


def _read_jsonl(path: Path, text: str) -> Iterator[tuple[int, Any]]:
    # Records end at "\n" only (a "\r" before it is JSON whitespace): str.splitlines() would also
    # split at U+2028, U+0085 and friends, which JSON allows unescaped inside strings.
    for line_no, line in enumerate(text.split("\n"), 1):
        if _WS.fullmatch(line):
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{line_no}: not valid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise DataError(f"{path}:{line_no}: {_TOO_DEEP}") from None
        _check_text(path, line_no, obj, line, 0, len(line))
        yield line_no, obj


def _check_text(path: Path, line: int, obj: Any, text: str, start: int, end: int) -> None:
    """DataError unless every string of `obj` (decoded from text[start:end]) is valid Unicode:
    JSON's \\udXXX escapes can encode half a surrogate pair, which tokenizers cannot take."""
    if not _SURROGATE_ESCAPE.search(text, start, end):
        return  # the common case: no escape that could make a surrogate
    stack = [obj]
    while stack:  # iterative: the value may be nested as deep as json could read
        x = stack.pop()
        if isinstance(x, str):
            try:
                x.encode("utf-8")
            except UnicodeEncodeError:
                raise DataError(
                    f"{path}:{line}: a string holds an unpaired UTF-16 surrogate escape "
                    "(\\ud800-\\udfff), which is not text"
                ) from None
        elif isinstance(x, dict):
            stack += [*x.keys(), *x.values()]
        elif isinstance(x, list):
            stack += x


def _read_json_array(path: Path, text: str, i: int) -> Iterator[tuple[int, Any]]:
    # Decode element by element (json's C scanner) rather than json.loads the whole list, so
    # every record knows the line it starts on and errors can name it.
    decoder = json.JSONDecoder()
    line, counted = 1, 0
    i = _WS.match(text, i + 1).end()
    if text.startswith("]", i):
        return
    while True:
        line += text.count("\n", counted, i)
        counted = i
        try:
            obj, end = decoder.raw_decode(text, i)
        except json.JSONDecodeError as e:
            raise DataError(f"{path}:{e.lineno}: not valid JSON ({e.msg} at column {e.colno})") from None
        except RecursionError:
            raise DataError(f"{path}:{line}: {_TOO_DEEP}") from None
        _check_text(path, line, obj, text, i, end)
        yield line, obj
        i = _WS.match(text, end).end()
        if text.startswith("]", i):
            break
        if not text.startswith(",", i):
            where = line + text.count("\n", counted, i)
            raise DataError(f"{path}:{where}: not valid JSON (expected ',' or ']' after a record)")
        i = _WS.match(text, i + 1).end()
    if _WS.match(text, i + 1).end() != len(text):
        raise DataError(
            f"{path}:{line + text.count(chr(10), counted, i)}: not valid JSON (extra data after the list)"
        )


def _read_parquet(path: Path) -> Iterator[tuple[int, Any]]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise DataError(f"{path}: reading Parquet needs pyarrow (pip install 'megatrain[parquet]')") from None
    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises ArrowInvalid/OSError with long messages
        raise DataError(f"{path}: not a readable Parquet file ({str(e).splitlines()[0]})") from None
    yield from enumerate(table.to_pylist(), 1)
