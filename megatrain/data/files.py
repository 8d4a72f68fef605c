"""Dataset files as people have them, beside JSON/JSONL and Parquet: CSV and TSV, text files
compressed with gzip or zstandard (`.jsonl.gz`, `.csv.zst`, ...), Arrow files, and the
directories Hugging Face `datasets` writes with `save_to_disk`, read with pyarrow alone.

A `save_to_disk` directory holds `state.json` (its `data-*.arrow` files, in order),
`dataset_info.json` and the Arrow stream files; a DatasetDict's holds `dataset_dict.json` and
one such directory per split. Errors are one line naming the file and the line or row.
"""

from __future__ import annotations

import csv
import gzip
import io
import json
import zlib
from pathlib import Path
from typing import Any

from ..errors import ConfigError, DataError

KINDS = ("jsonl", "json", "csv", "tsv", "parquet", "arrow")
TEXT_KINDS = ("jsonl", "json", "csv", "tsv")
COMPRESSIONS = ("gz", "zst")  # of the text kinds
SAVED_STATE, SAVED_DICT = "state.json", "dataset_dict.json"  # what `save_to_disk` writes
# The split a key reads from a DatasetDict directory, in order of preference.
SPLITS = {"dataset": ("train",), "eval_dataset": ("validation", "test")}


def data_kind(path: Path) -> tuple[str, str | None] | None:
    """What a file's name says it holds: (kind, compression), e.g. ("jsonl", "gz"); None when
    it is not a data file megatrain reads."""
    parts = path.name.lower().split(".")
    compression = parts.pop() if len(parts) > 2 and parts[-1] in COMPRESSIONS else None
    kind = parts[-1] if len(parts) > 1 else ""
    if kind not in KINDS or (compression and kind not in TEXT_KINDS):
        return None
    return kind, compression


def read_text(path: Path, compression: str | None) -> str:
    """A text file's contents, decompressed, without a leading UTF-8 byte-order mark (editors'
    and Excel's exports write one; Hugging Face `datasets` reads past it); DataError naming the
    file, and the line of a byte that is not UTF-8, when it cannot be read."""
    data = path.read_bytes()
    if compression == "gz":
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as e:
            raise DataError(f"{path}: not a readable gzip file ({e})") from None
    elif compression == "zst":
        data = _unzstd(path, data)
    try:
        return data.decode("utf-8").removeprefix("\ufeff")
    except UnicodeDecodeError as e:
        line = data.count(b"\n", 0, e.start) + 1
        where = " of the decompressed text" if compression else ""
        raise DataError(f"{path}:{line}: not UTF-8 text ({e.reason} at byte {e.start}{where})") from None


def _unzstd(path: Path, data: bytes) -> bytes:
    try:
        from compression.zstd import ZstdError, decompress  # Python 3.14's own
    except ImportError:
        try:
            import zstandard
        except ImportError:
            raise DataError(f"{path}: reading .zst files needs zstandard (pip install zstandard)") from None
        ZstdError = zstandard.ZstdError  # noqa: N806 (the class either module names so)

        def decompress(data: bytes) -> bytes:
            # A stream reader: frames written without their size (streamed) decompress too.
            return zstandard.ZstdDecompressor().stream_reader(io.BytesIO(data)).read()

    try:
        return decompress(data)
    except ZstdError as e:
        raise DataError(f"{path}: not a readable zstandard file ({e})") from None


def read_csv(path: Path, text: str, delimiter: str) -> list[tuple[int, dict[str, Any]]]:
    """The rows of CSV/TSV text as (line, record) pairs, keyed by the header row; a row's line
    is where it starts (a quoted field may span lines). Every value is a string."""
    reader = csv.reader(io.StringIO(text), delimiter=delimiter)
    name = "TSV" if delimiter == "\t" else "CSV"
    try:
        header = next(reader, None)
        if header is None:
            raise DataError(f"{path}: file is empty")
        dup = next((h for h in header if header.count(h) > 1), None)
        if dup is not None:
            raise DataError(f"{path}:1: the header names column {dup!r} twice")
        rows, line = [], reader.line_num + 1
        for row in reader:
            if row and len(row) != len(header):
                raise DataError(
                    f"{path}:{line}: {len(row)} fields, but the header has {len(header)} ({', '.join(header)})"
                )
            if row:
                rows.append((line, dict(zip(header, row))))
            line = reader.line_num + 1
    except csv.Error as e:
        raise DataError(f"{path}:{reader.line_num}: not valid {name} ({e})") from None
    return rows


def read_arrow(path: Path) -> list[tuple[int, dict[str, Any]]]:
    """The rows of an Arrow IPC file, stream format (what `datasets` writes) or file format
    (Feather v2), as (row, record) pairs, rows counted from 1."""
    try:
        import pyarrow as pa
        import pyarrow.ipc as ipc
    except ImportError:
        raise DataError(f"{path}: reading Arrow files needs pyarrow (pip install pyarrow)") from None
    errors = []
    for opener in (ipc.open_stream, ipc.open_file):
        try:
            with pa.memory_map(str(path)) as source:
                table = opener(source).read_all()
            return list(enumerate(table.to_pylist(), 1))
        except (pa.ArrowInvalid, OSError) as e:  # not this format: try the other
            errors.append(str(e).splitlines()[0] if str(e) else type(e).__name__)
    raise DataError(f"{path}: not a readable Arrow file ({errors[-1]})")


def is_saved_dataset(directory: Path) -> bool:
    """Whether a directory is one `datasets`' save_to_disk wrote (a Dataset or a DatasetDict)."""
    return (directory / SAVED_STATE).is_file() or (directory / SAVED_DICT).is_file()


def saved_dataset_files(directory: Path, key: str, split: str | None = None) -> list[Path]:
    """The Arrow files of a `save_to_disk` directory, in order. A DatasetDict's: those of `split`,
    else of the split `key` (dataset, eval_dataset) reads (SPLITS); a single dataset's whatever
    `split` says (LlamaFactory's registries name "train" for every local file). ConfigError
    naming the directory when it is incomplete or has no such split."""
    if (directory / SAVED_DICT).is_file():
        splits = _json(directory / SAVED_DICT).get("splits")
        if not isinstance(splits, list):
            raise ConfigError(f"{key} {directory}: {SAVED_DICT} has no list of splits")
        wanted = (split,) if split else SPLITS.get(key, SPLITS["dataset"])
        chosen = next((s for s in wanted if s in splits), None)
        if chosen is None:
            raise ConfigError(
                f"{key} {directory}: a dataset dictionary without a {' or '.join(wanted)} split "
                f"(splits: {', '.join(map(str, splits))}); name one as {directory / str(splits[0])}"
            )
        return saved_dataset_files(directory / chosen, key)
    state = _json(directory / SAVED_STATE)
    entries = state.get("_data_files")
    if not isinstance(entries, list) or not all(isinstance(e, dict) and "filename" in e for e in entries):
        raise ConfigError(f"{key} {directory / SAVED_STATE}: no _data_files list of filenames")
    files = [directory / e["filename"] for e in entries]
    missing = next((f for f in files if not f.is_file()), None)
    if missing is not None:
        raise ConfigError(f"{key} {directory}: {missing.name}, listed in {SAVED_STATE}, is missing")
    if not files:
        raise ConfigError(f"{key} {directory}: {SAVED_STATE} lists no data files")
    return files


def _json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"{path}: not readable JSON ({e})") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{path}: expected a JSON object")
    return value
