"""Writing directories: atomically, checksummed, and safetensors shards in parallel.

Every directory megatrain writes (a checkpoint, `final/`, an export) goes through `AtomicDir`:
its files are written into a dot-named temporary sibling, the manifest (manifest.py) last,
everything is fsynced and the directory renamed into place, so it is either complete or absent,
and nothing that looks for `checkpoint-N` or `final` can mistake the temporary for one. An
existing directory at that path is replaced only when it is empty or the caller's rule allows it
(it is a directory of the same kind that megatrain wrote); anything else is refused with an
OutputError and left untouched.

Safetensors files are written by a pool of threads, one file per thread at a time and one
tensor at a time per file: the header is computed from the shapes, then each tensor is
converted to the target dtype and appended while its CRC-32 is updated. File writes, dtype
conversion and zlib.crc32 release the GIL, so the writers keep a fast disk busy; peak memory is
one converted tensor per writer (none for the master weights' bf16 halves and the moments'
fp32 views, written in place). fp32 becomes bf16 by the master weights' rounding (host/split.py),
and the master weights' halves are joined where the file holds fp32.

An OSError while writing (a full disk above all) removes the temporary directory and becomes one
OutputError naming the directory, the file, and the bytes needed and free. A killed writer
cannot remove it: the temporary holds a marker naming its writer (ownership.py) from the start,
and the next AtomicDir in the same parent directory deletes the temporaries whose writer is gone.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import struct
import tempfile
import threading
import zlib
from collections.abc import Callable
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import OutputError
from ..host.split import Halves, cast
from ..metrics import ByteProgress
from ..planning.placement import fmt_bytes
from . import manifest, ownership

ST_DTYPES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.uint8: "U8"}
CHUNK = 64 << 20  # bytes per write: the progress bar moves, and a stop request is seen soon
MAX_WRITERS = 8

Entries = list[tuple[str, tuple[int, ...]]]
_TEMPORARY = re.compile(r"^\..+\.tmp-")  # mkdtemp's names below: `.{name}.tmp-XXXXXXXX`
DType = torch.dtype | Callable[[str], torch.dtype]
"""One dtype for every tensor, or each key's."""


def dtype_of(dtype: DType) -> Callable[[str], torch.dtype]:
    """The dtype of each key."""
    return dtype if callable(dtype) else lambda key: dtype


def _existing(path: Path) -> Path:
    """`path`, or where it would be made: its nearest existing parent."""
    p = Path(os.path.abspath(path))
    while not p.exists() and p != p.parent:
        p = p.parent
    return p


def free_bytes(path: Path) -> int:
    """Free bytes on the file system that holds `path` (or would)."""
    return shutil.disk_usage(_existing(path)).free


def same_file_system(a: Path, b: Path) -> bool:
    """Whether `a` and `b` are (or would be) on one file system."""
    return _existing(a).stat().st_dev == _existing(b).stat().st_dev


# ---------------------------------------------------------------------------- safetensors
@dataclass
class Shard:
    """One safetensors file to write: its tensors, in order, fetched by `get(key)`: a tensor, or
    an iterable of flat tensors, its pieces in order (a tensor read from disk a piece at a time)."""

    name: str
    entries: Entries
    dtype: Callable[[str], torch.dtype]
    """Each key's dtype in the file."""
    get: Callable[[str], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return sum(math.prod(shape) * self.dtype(key).itemsize for key, shape in self.entries)


def plan_shards(
    prefix: str, entries: Entries, dtype: DType, get, max_shard_bytes: int
) -> tuple[list[Shard], dict | None]:
    """`{prefix}.safetensors`, or shards `{prefix}-0000i-of-0000N.safetensors` and the index
    `{prefix}.safetensors.index.json` transformers writes when the tensors exceed
    `max_shard_bytes` (a tensor larger than that gets a shard of its own). Returns the shards
    and the index (None for a single file)."""
    groups: list[Entries] = [[]]
    size, dtype = 0, dtype_of(dtype)
    for key, shape in entries:
        nbytes = math.prod(shape) * dtype(key).itemsize
        if groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append((key, shape))
        size += nbytes
    n = len(groups)
    shards = [
        Shard(
            f"{prefix}.safetensors" if n == 1 else f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors",
            g,
            dtype,
            get,
        )
        for i, g in enumerate(groups)
    ]
    if n == 1:
        return shards, None
    weight_map = {k: s.name for s in shards for k, _ in s.entries}
    return shards, {"metadata": {"total_size": sum(s.nbytes for s in shards)}, "weight_map": weight_map}


class _Stopped(Exception):
    """Another writer failed: stop this one at the next tensor."""


def _write_shard(path: Path, shard: Shard, progress: ByteProgress, stop: threading.Event) -> tuple[int, int]:
    """Stream one safetensors file; returns its (bytes, CRC-32)."""
    header: dict = {"__metadata__": {"format": "pt"}}
    off = 0
    for key, shape in shard.entries:
        n = math.prod(shape) * shard.dtype(key).itemsize
        header[key] = {
            "dtype": ST_DTYPES[shard.dtype(key)],
            "shape": list(shape),
            "data_offsets": [off, off + n],
        }
        off += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the format aligns the data to 8 bytes
    head = struct.pack("<Q", len(raw)) + raw
    crc = zlib.crc32(head)
    try:
        with open(path, "wb") as f:
            f.write(head)
            for key, shape in shard.entries:
                if stop.is_set():
                    raise _Stopped
                got = shard.get(key)
                if isinstance(got, (torch.Tensor, Halves)):
                    if tuple(got.shape) != tuple(shape):
                        raise ValueError(f"{key}: shape {tuple(got.shape)}, announced {shape}")
                    got = iter((got,))  # which lets go of it once it is written
                numel = 0
                for t in got:  # the tensor, or its pieces in order
                    t = cast(t, shard.dtype(key)).contiguous()  # bf16 by the master's rounding
                    data = memoryview(t.reshape(-1).view(torch.uint8).numpy())
                    for i in range(0, len(data), CHUNK):
                        chunk = data[i : i + CHUNK]
                        crc = zlib.crc32(chunk, crc)
                        f.write(chunk)
                        progress.update(len(chunk))
                    numel += t.numel()
                    del t, data  # one tensor (or piece) per writer
                if numel != math.prod(shape):
                    raise ValueError(f"{key}: {numel} elements, announced {shape}")
            f.flush()
            os.fsync(f.fileno())  # here, so the writers' flushes overlap too (commit's is then cheap)
    except OSError as e:
        e.filename = e.filename or str(path)  # a failed write() names no file
        raise
    return len(head) + off, crc


def write_safetensors(
    directory: Path,
    prefix: str,
    entries: Entries,
    dtype: DType,
    get,
    max_shard_bytes: int,
    progress: bool = False,
    desc: str = "saving",
    index: bool = True,
) -> dict[str, tuple[int, int]]:
    """Write `entries` into `directory` as (sharded) safetensors in `dtype` (one, or each key's),
    several files at a time, with the index when sharded (unless `index` is false); `get(key)` may
    be called from several threads at once. Returns each file's (bytes, CRC-32)."""
    shards, index_json = plan_shards(prefix, entries, dtype, get, max_shard_bytes)
    stop = threading.Event()
    written: dict[str, tuple[int, int]] = {}
    with (
        ByteProgress(sum(s.nbytes for s in shards), desc, progress) as bar,
        ThreadPoolExecutor(max_workers=max(1, min(MAX_WRITERS, os.cpu_count() or 1, len(shards)))) as pool,
    ):
        futures = {pool.submit(_write_shard, directory / s.name, s, bar, stop): s.name for s in shards}
        try:
            done, _ = wait(futures, return_when=FIRST_EXCEPTION)
            failed = [f for f in done if f.exception() is not None]
            if failed:
                raise failed[0].exception()
        except BaseException:
            stop.set()  # the others finish their current chunk and stop
            pool.shutdown(wait=True, cancel_futures=True)
            raise
        for future, name in futures.items():
            written[name] = future.result()
    if index and index_json is not None:
        (directory / f"{prefix}.safetensors.index.json").write_text(json.dumps(index_json, indent=2) + "\n")
    return written


# ---------------------------------------------------------------------------- directories
def _same_kind(kind: str) -> Callable[[Path], bool]:
    return lambda path: manifest.kind_of(path) == kind


class AtomicDir:
    """Write `out_dir` atomically (see the module docstring):

        with AtomicDir(out_dir, manifest.MODEL, nbytes=...) as d:
            d.write_tensors("model", entries, dtype, get, max_shard_bytes)
            (d.path / "config.json").write_text(...)
            d.commit()

    An existing non-empty `out_dir` is replaced only if `may_replace(out_dir)` (default: it is
    a directory of the same kind that megatrain wrote); otherwise entering (before anything is
    written) and committing raise an OutputError ending in `why_not`. `nbytes` (what the
    directory will hold, roughly) is quoted when the disk is full."""

    def __init__(
        self,
        out_dir: str | Path,
        kind: str,
        may_replace: Callable[[Path], bool] | None = None,
        why_not: str = "",
        nbytes: int = 0,
        progress: bool = False,
    ):
        self.out_dir, self.kind, self.nbytes, self.progress = Path(out_dir), kind, nbytes, progress
        self.may_replace = may_replace or _same_kind(kind)
        self.why_not = why_not or f"it is not a {kind} directory megatrain wrote, so it is never replaced"
        self.checksums: dict[str, tuple[int, int]] = {}
        self.path = Path()

    def check_target(self) -> None:
        """Raise OutputError unless `out_dir` is absent, an empty directory, or replaceable."""
        out = self.out_dir
        if not (out.exists() or out.is_symlink()):
            return
        if not out.is_dir() or out.is_symlink():
            raise OutputError(f"{out}: exists and is not a directory; refusing to replace it")
        if any(out.iterdir()) and not self.may_replace(out):
            raise OutputError(f"{out}: exists and is not empty; {self.why_not}")

    def __enter__(self) -> AtomicDir:
        self.check_target()
        try:
            self.out_dir.parent.mkdir(parents=True, exist_ok=True)
            remove_abandoned(self.out_dir.parent)
            self.path = Path(tempfile.mkdtemp(prefix=f".{self.out_dir.name}.tmp-", dir=self.out_dir.parent))
            ownership.mark(self.path)
        except OSError as e:
            raise self._error(e) from None
        umask = os.umask(0o022)  # mkdtemp makes the directory private; give it the usual mode
        os.umask(umask)
        self.path.chmod(0o777 & ~umask)
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is None:
            return
        shutil.rmtree(self.path, ignore_errors=True)
        if isinstance(exc, OSError):
            raise self._error(exc) from None

    def _error(self, e: OSError) -> OutputError:
        where = f" ({Path(e.filename).name})" if e.filename else ""
        need = f"it needs {fmt_bytes(self.nbytes)}, " if self.nbytes else ""
        return OutputError(
            f"cannot write {self.out_dir}{where}: {e.strerror or e}; {need}"
            f"{fmt_bytes(free_bytes(self.out_dir))} free; nothing was left half-written"
        )

    def write_tensors(
        self, prefix: str, entries: Entries, dtype: DType, get, max_shard_bytes: int, index: bool = True
    ) -> list[str]:
        """Write `entries` as (sharded) safetensors in `dtype` (one, or each key's), through
        `write_safetensors`; returns the file names."""
        desc = f"saving {self.out_dir.name}/{prefix}"
        written = write_safetensors(
            self.path, prefix, entries, dtype, get, max_shard_bytes, self.progress, desc, index
        )
        self.checksums.update(written)
        return list(written)

    def commit(self) -> Path:
        """Write the manifest, fsync everything and swap the directory into place."""
        ownership.unmark(self.path)
        manifest.write(self.path, self.kind, self.checksums)
        _fsync_dir(self.path)
        out = self.out_dir
        self.check_target()  # again: something may have appeared there while we wrote
        if out.exists():
            old = out.with_name(f".{out.name}.old-{os.getpid()}")
            os.replace(out, old)
            try:
                os.replace(self.path, out)
            except BaseException:
                os.replace(old, out)  # put the previous one back: dot names are deleted as leftovers
                raise
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(self.path, out)
        _fsync(out.parent)
        return out


def remove_abandoned(parent: Path) -> list[Path]:
    """Delete the temporaries in `parent` that a killed writer left (dot-named, marked by
    megatrain, their writer gone); a user's files and a live writer's are never touched.
    Returns those deleted."""
    gone = []
    for p in parent.iterdir():
        if _TEMPORARY.match(p.name) and p.is_dir() and not p.is_symlink() and ownership.abandoned(p):
            shutil.rmtree(p, ignore_errors=True)
            gone.append(p)
    return gone


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    for f in path.iterdir():
        if f.is_file():
            _fsync(f)
    _fsync(path)
