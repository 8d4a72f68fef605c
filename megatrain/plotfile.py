"""The files `megatrain plot` writes: in the format the file name's suffix names, with a mark
that proves the file is one megatrain wrote, and written only where that is safe.

A plot goes where nothing is, or, with --overwrite, over a plot megatrain wrote and nobody has
changed since; anything else at that path (a user's own training.png, an essay named by --out, a
plot edited or re-saved by another program) is never replaced. The proof is in the file: a mark
holding the SHA-256 of the file without the mark, placed where each format keeps text that
readers pass over (a PNG tEXt chunk before IEND, a JPEG comment after the JFIF header, an XML
comment after an SVG's root element, a PDF comment line after %%EOF). A file whose mark is
missing, or whose bytes no longer hash to it, is not megatrain's.

The file appears whole or not at all: it is written to a dot-named temporary beside it, synced,
and renamed into place after the target is checked again.
"""

from __future__ import annotations

import hashlib
import os
import re
import struct
import tempfile
import zlib
from pathlib import Path

from .errors import OutputError

FORMATS = {".png": "png", ".jpg": "jpeg", ".jpeg": "jpeg", ".svg": "svg", ".pdf": "pdf"}
"""Suffix -> the matplotlib format written."""
MARK = b"megatrain plot sha256:"
_TEXT = re.compile(re.escape(MARK) + rb"([0-9a-f]{64})")
_TEXT_LEN = len(MARK) + 64
_PNG_END = 12  # the IEND chunk closes every PNG: 4 bytes of length, "IEND", its CRC
MAX_PLOT_BYTES = 64 << 20  # larger than any plot megatrain draws: not read to be checked


def format_of(path: Path) -> str:
    """The format a plot at `path` is written in, from its suffix; OutputError for any other."""
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None:
        what = f"a {path.suffix} file" if path.suffix else "a name without a suffix"
        raise OutputError(
            f"{path}: plot writes {', '.join(FORMATS)} files (the suffix says which), not {what}"
        )
    return fmt


def check_target(path: Path, overwrite: bool) -> None:
    """OutputError unless a plot may be written to `path`: nothing is there, or (with
    `overwrite`) a plot megatrain wrote, unchanged since."""
    if not (path.exists() or path.is_symlink()):
        return
    if path.is_symlink() or not path.is_file():
        raise OutputError(
            f"{path}: exists and is not a plain file; plot never replaces it (choose another --out)"
        )
    if not written_by_megatrain(path):
        raise OutputError(
            f"{path}: exists and is not a plot megatrain wrote (or it was changed since); plot never "
            "replaces it (move it away or choose another --out)"
        )
    if not overwrite:
        raise OutputError(f"{path}: exists (a plot megatrain wrote); --overwrite replaces it")


def write_plot(path: Path, data: bytes, overwrite: bool) -> None:
    """Write `data` (a file of `path`'s format, as matplotlib saved it) to `path` with its mark,
    atomically, where `check_target` allows it."""
    fmt = format_of(path)
    check_target(path, overwrite)
    marked = _with_mark(fmt, data)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(marked)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes the file private; give it the usual mode
        check_target(path, overwrite)  # again: something may have appeared there meanwhile
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def written_by_megatrain(path: Path) -> bool:
    """Whether `path` is a plot megatrain wrote, byte for byte (see the module docstring)."""
    fmt = FORMATS.get(path.suffix.lower())
    if fmt is None or path.stat().st_size > MAX_PLOT_BYTES:
        return False
    data = path.read_bytes()
    unit_len = len(_unit(fmt, b"\0" * _TEXT_LEN))
    at = _offset(fmt, data, marked=True, unit_len=unit_len)
    if at is None or not 0 <= at <= len(data) - unit_len:
        return False
    unit, rest = data[at : at + unit_len], data[:at] + data[at + unit_len :]
    found = _TEXT.search(unit)
    if found is None or unit != _unit(fmt, found.group(0)):
        return False
    return found.group(1).decode() == hashlib.sha256(rest).hexdigest()


def _with_mark(fmt: str, data: bytes) -> bytes:
    text = MARK + hashlib.sha256(data).hexdigest().encode()
    at = _offset(fmt, data, marked=False)
    return data[:at] + _unit(fmt, text) + data[at:]


def _unit(fmt: str, text: bytes) -> bytes:
    """The bytes that carry the mark's `text` in a file of `fmt`."""
    if fmt == "png":
        body = b"tEXt" + b"Comment\0" + text
        return struct.pack(">I", len(body) - 4) + body + struct.pack(">I", zlib.crc32(body))
    if fmt == "jpeg":
        return b"\xff\xfe" + struct.pack(">H", len(text) + 2) + text  # a COM segment
    if fmt == "svg":
        return b"<!-- " + text + b" -->\n"
    return b"%" + text + b"\n"  # pdf


def _offset(fmt: str, data: bytes, marked: bool, unit_len: int = 0) -> int | None:
    """Where the mark goes in `data` (or, `marked`, where it is): before a PNG's IEND chunk, after
    a JPEG's SOI and JFIF (APP0) segment, at the end of an SVG or PDF. None: not such a file."""
    if fmt == "jpeg":
        if data[:2] != b"\xff\xd8":
            return None
        app0 = data[2:4] == b"\xff\xe0"
        return 4 + int.from_bytes(data[4:6], "big") if app0 else 2
    tail = _PNG_END if fmt == "png" else 0
    if fmt == "png" and data[-_PNG_END + 4 : -_PNG_END + 8] != b"IEND":
        return None
    return len(data) - tail - (unit_len if marked else 0)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask
