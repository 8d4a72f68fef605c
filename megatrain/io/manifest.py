"""`megatrain_manifest.json`: what megatrain writes into every directory it creates (a
checkpoint, `final/`, an export), last, just before the directory is renamed into place:

    {"format": 1, "kind": "checkpoint" | "model" | "reference",
     "files": {"model.safetensors": {"bytes": 123, "crc32": "89abcdef"}, ...}}

It makes two things checkable. *Integrity*: every file's CRC-32 (computed while the file was
written), verified when a checkpoint is resumed and when a directory is exported, so flipped
bytes are refused by file name instead of trained on. *Ownership*: a directory holding a
manifest was written by megatrain; only such a directory is ever replaced (`final/` by a later
run, an export by `export --overwrite`), and never one of another kind.

Directories written before manifests existed are read without verification (callers warn).
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import BinaryIO

from ..errors import CheckpointError
from ..metrics import ByteProgress

MANIFEST = "megatrain_manifest.json"
FORMAT = 1
CHECKPOINT, MODEL, REFERENCE = (
    "checkpoint",
    "model",
    "reference",
)  # reference: a preference run's reference log-probs
CHUNK = 16 << 20  # bytes per read while verifying; zlib.crc32 releases the GIL on large buffers
MAX_THREADS = 8


def crc32_of(f: BinaryIO, on_bytes: Callable[[int], None] = lambda n: None) -> tuple[int, int]:
    """(bytes, CRC-32) of an open file from its current position to the end."""
    crc, total, buf = 0, 0, bytearray(CHUNK)
    view = memoryview(buf)
    while n := f.readinto(buf):
        crc = zlib.crc32(view[:n], crc)
        total += n
        on_bytes(n)
    return total, crc


def write(directory: Path, kind: str, known: dict[str, tuple[int, int]]) -> None:
    """Write the manifest of `directory`: every regular file in it, with the (bytes, CRC-32)
    from `known` (computed while writing) or, for the small files others wrote (config.json,
    tokenizer files), read back now."""
    files = {}
    for p in sorted(directory.iterdir()):
        if p.name == MANIFEST or not p.is_file():
            continue
        if p.name in known:
            nbytes, crc = known[p.name]
        else:
            with open(p, "rb") as f:
                nbytes, crc = crc32_of(f)
        files[p.name] = {"bytes": nbytes, "crc32": f"{crc:08x}"}
    text = json.dumps({"format": FORMAT, "kind": kind, "files": files}, indent=1)
    (directory / MANIFEST).write_text(text + "\n")


def read(directory: Path) -> dict | None:
    """The manifest of `directory`, None when it has none; CheckpointError when malformed."""
    path = Path(directory) / MANIFEST
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}: unreadable ({e})") from None
    ok = (
        isinstance(raw, dict)
        and raw.get("format") == FORMAT
        and raw.get("kind") in (CHECKPOINT, MODEL, REFERENCE)
        and isinstance(raw.get("files"), dict)
        and all(isinstance(v, dict) and {"bytes", "crc32"} <= set(v) for v in raw["files"].values())
    )
    if not ok:
        raise CheckpointError(f"{path}: not a megatrain manifest of format {FORMAT}")
    return raw


def kind_of(directory: Path) -> str | None:
    """`checkpoint`, `model` or `reference` for a directory megatrain wrote; None for anything else."""
    try:
        raw = read(directory)
    except CheckpointError:
        return None
    return raw["kind"] if raw else None


def verify(directory: Path, only: Iterable[str] | None = None, progress: bool = False) -> bool:
    """Check the files the manifest lists (those in `only`, when given): size, then CRC-32,
    several files at a time. Returns False when the directory has no manifest; raises
    CheckpointError naming the first bad file."""
    directory = Path(directory)
    raw = read(directory)
    if raw is None:
        return False
    wanted = None if only is None else set(only)
    files = {k: v for k, v in raw["files"].items() if wanted is None or k in wanted}
    for name, entry in files.items():
        path = directory / name
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing ({MANIFEST} lists it)") from None
        if size != entry["bytes"]:
            raise CheckpointError(
                f"{path}: {size} bytes, {MANIFEST} records {entry['bytes']} (truncated or replaced)"
            )
    bar = ByteProgress(sum(e["bytes"] for e in files.values()), f"verifying {directory.name}", progress)

    def check(name: str) -> None:
        path = directory / name
        try:
            with open(path, "rb") as f:
                _, crc = crc32_of(f, bar.update)
        except OSError as e:
            raise CheckpointError(f"{path}: unreadable ({e.strerror or e})") from None
        if f"{crc:08x}" != files[name]["crc32"]:
            raise CheckpointError(
                f"{path}: checksum mismatch, the file is corrupt (crc32 {crc:08x}, "
                f"{MANIFEST} records {files[name]['crc32']})"
            )

    with bar, ThreadPoolExecutor(max_workers=max(1, min(MAX_THREADS, len(files)))) as pool:
        futures = [pool.submit(check, name) for name in files]
        try:
            for future in futures:
                future.result()
        except BaseException:
            pool.shutdown(cancel_futures=True)
            raise
    return True
