"""Reading safetensors checkpoints: which file holds each tensor, and the tensors themselves.

A Hugging Face checkpoint holds each tensor whole (`model.safetensors`, or shards named by
`model.safetensors.index.json`). A checkpoint of a host state partitioned over machines
(partition.py) holds each as *segments*, `key[a:b]` (elements a to b of the tensor flattened), in
the machines' files, named by the same index. `TensorReader` reads either form, a whole tensor or
any range of one, so loading, resuming and exporting need not know which they read. MXFP4 pairs
(`{key}_blocks`, `{key}_scales`: gpt-oss as published) read as the full-precision tensor `key`,
decoded as they are read (mxfp4.py).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import CheckpointError
from ..models import mxfp4

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_SEGMENT = re.compile(r"^(.+)\[(\d+):(\d+)\]$")


def segment_key(key: str, a: int, b: int) -> str:
    """The key of elements [a, b) of tensor `key` flattened, in a partitioned checkpoint."""
    return f"{key}[{a}:{b}]"


def checkpoint_files(model_dir: str | Path, prefix: str = "model") -> dict[str, Path]:
    """Map every tensor key to the safetensors file holding it (`{prefix}.safetensors`, or the
    shards named by `{prefix}.safetensors.index.json`)."""
    d = Path(model_dir)
    if not d.is_dir():
        raise CheckpointError(f"{d}: model directory does not exist")
    index, single = d / f"{prefix}.safetensors.index.json", d / f"{prefix}.safetensors"
    if index.is_file():
        try:
            wm = json.loads(index.read_text())["weight_map"]
            files = {k: d / f for k, f in wm.items()}
        except (json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: malformed index ({e})") from None
        for f in set(files.values()):
            if not f.is_file():
                raise CheckpointError(f"{index}: names {f.name}, which does not exist")
        return files
    if single.is_file():
        with _open_safetensors(single) as f:
            return {k: single for k in f.keys()}  # noqa: SIM118 (safe_open has no __iter__)
    raise CheckpointError(f"{d}: no {single.name} or {index.name} (only safetensors checkpoints are read)")


def _open_safetensors(path: Path):
    """safe_open, with a corrupt or truncated file reported as a CheckpointError naming it."""
    try:
        return safe_open(path, framework="pt")
    except Exception as e:  # SafetensorError, OSError: the header does not match the file
        raise CheckpointError(f"{path}: not a readable safetensors file ({e})") from None


class TensorReader:
    """Reads tensors by key from a set of safetensors files, all opened (memory-mapped) at
    construction: the files stay readable even if their directory is deleted afterwards, and
    several threads may read at once. A tensor is stored whole, as segments or as an MXFP4 pair
    (the module docstring); `check` must see a segmented tensor's shape before it is read."""

    def __init__(self, files: dict[str, Path], where: str | Path):
        self.files, self.where = files, where  # `where` names the checkpoint in errors
        self._handles = {path: _open_safetensors(path) for path in set(files.values())}
        self.segments: dict[str, list[tuple[int, int, str]]] = {}  # key -> (a, b, segment key)
        for k in files:
            if m := _SEGMENT.match(k):
                self.segments.setdefault(m.group(1), []).append((int(m.group(2)), int(m.group(3)), k))
        for segs in self.segments.values():
            segs.sort()
        self._shapes: dict[str, tuple[int, ...]] = {}
        self.quantized = mxfp4.quantized_keys(files)

    def _handle(self, key: str):
        return self._handles[self.files[key]]

    def file(self, key: str) -> Path:
        """The file holding `key` (its blocks, for an MXFP4 pair)."""
        return self.files[self.quantized[key][0] if key in self.quantized else key]

    def shape(self, key: str) -> tuple[int, ...]:
        if key in self.quantized:
            return mxfp4.decoded_shape(self.shape(self.quantized[key][0]))
        return tuple(self._handle(key).get_slice(key).get_shape())

    def dtype(self, key: str) -> str:
        """The safetensors dtype name, e.g. F32 or BF16 (MXFP4 for a quantized pair)."""
        if key in self.quantized:
            return "MXFP4"
        return self._handle(key).get_slice(key).get_dtype()

    def get(self, key: str) -> torch.Tensor:
        if key in self.quantized:  # decoded in bf16: exact, and half the memory of fp32
            blocks, scales = (self.get(k) for k in self.quantized[key])
            return mxfp4.decode(blocks, scales, torch.bfloat16)
        if key in self.segments:
            n = math.prod(self._shapes[key])
            return self.get_range(key, 0, n).view(self._shapes[key])
        try:
            return self._handle(key).get_tensor(key)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{self.files[key]}: cannot read {key} ({e})") from None

    def get_range(self, key: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of tensor `key` flattened, reading only the rows or segments they lie in
        (for an MXFP4 pair, decoding only the experts they lie in)."""
        if key in self.quantized:
            return self._decoded_range(key, a, b)
        try:
            if key in self.segments:
                parts = [
                    self._handle(k).get_slice(k)[max(a, lo) - lo : min(b, hi) - lo]
                    for lo, hi, k in self.segments[key]
                    if lo < b and a < hi
                ]
                return parts[0] if len(parts) == 1 else torch.cat(parts)
            sl = self._handle(key).get_slice(key)
            shape = sl.get_shape()
            if len(shape) == 0:
                return sl[:].reshape(-1)[a:b]
            row = math.prod(shape[1:])
            r0, r1 = a // row, -(-b // row)
            return sl[r0:r1].reshape(-1)[a - r0 * row : b - r0 * row]
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{self.where}: cannot read {key}[{a}:{b}] ({e})") from None

    def _decoded_range(self, key: str, a: int, b: int) -> torch.Tensor:
        """Elements [a, b) of an MXFP4 pair's parameter, decoding only the experts (the first
        dimension's entries) they lie in."""
        blocks, scales = self.quantized[key]
        shape = self.shape(key)
        if len(shape) < 3:  # no expert dimension: one matrix
            return self.get(key).reshape(-1)[a:b]
        per = math.prod(shape[1:])
        e0, e1 = a // per, -(-b // per)
        part = [self._handle(k).get_slice(k)[e0:e1] for k in (blocks, scales)]
        return mxfp4.decode(*part, torch.bfloat16).reshape(-1)[a - e0 * per : b - e0 * per]

    def check(self, key: str, shape: tuple[int, ...], dtype: str | None = None) -> None:
        """Raise a CheckpointError naming the file unless `key` exists with this shape (and dtype),
        whole, as segments that cover it exactly, or as an MXFP4 pair."""
        if key in self.segments:
            return self._check_segments(key, shape, dtype)
        if key not in self.files and key not in self.quantized:
            raise CheckpointError(f"{self.where}: tensor {key} is missing")
        if self.shape(key) != shape:
            raise CheckpointError(
                f"{self.file(key)}: {key} has shape {self.shape(key)}, config.json implies {shape}"
            )
        if dtype is not None and self.dtype(key) != dtype:
            raise CheckpointError(f"{self.file(key)}: {key} is {self.dtype(key)}, expected {dtype}")

    def _check_segments(self, key: str, shape: tuple[int, ...], dtype: str | None) -> None:
        at = 0
        for lo, hi, k in self.segments[key]:
            if lo != at or self.shape(k) != (hi - lo,):
                why = f"a gap or overlap at element {at}" if lo != at else f"shape {self.shape(k)}"
                raise CheckpointError(f"{self.files[k]}: segment {k} of {key} has {why}")
            if dtype is not None and self.dtype(k) != dtype:
                raise CheckpointError(f"{self.files[k]}: {k} is {self.dtype(k)}, expected {dtype}")
            at = hi
        if at != math.prod(shape):
            raise CheckpointError(
                f"{self.where}: the segments of {key} end at element {at}, config.json implies shape {shape}"
            )
        self._shapes[key] = shape

    def close(self) -> None:
        self._handles.clear()
