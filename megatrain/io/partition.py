"""Checkpoints and `final/` written by a data-parallel world: which rank writes what.

A whole host state (one machine, or every machine holding it all) is written by the first rank
alone, in the format of one process (checkpoint.py, weights.py). A state partitioned over
machines (layout.py) is written by every machine at once, each its part, into the one directory
the first rank creates (so `output_dir` must be on a file system the machines share):

    model.machine-00001-of-00002.safetensors      machine 1's segments of the fp32 weights
    optimizer.machine-00001-of-00002.safetensors  and of the moments (`exp_avg.<key>[a:b]`, ...; an
                                                  absmax's segments count its blocks)
    model.safetensors.index.json                  every segment key -> its file
    optimizer.safetensors.index.json

A segment `key[a:b]` holds elements a to b of checkpoint tensor `key` flattened (a machine's
part cuts tensors where its ranks' spans end), so the files are keyed by tensor, not by the host
layout, and reader.TensorReader reads a tensor, or any range of one, from segments as from a
whole tensor: a partitioned checkpoint resumes exactly in any world, partitioned or not, and
`megatrain export` makes one Hugging Face model of it (transformers cannot read it directly).
The first rank writes the small files (config, trainer state, RNG state, tokenizer), the indexes
and the manifest, with every machine's checksums, and renames the directory into place: it is
atomic as any checkpoint. `final/` of a partitioned state is written from a weights-only
dump of the machines' segments (a dot-named temporary in output_dir, removed after), read back
a tensor at a time by the first rank.

The writes meet at three collectives, each reached by every rank or by none: the first rank
names the directory (or its failure), every rank reports its files (or why it could not write
them), the first rank says whether it completed the directory. So a failure on any machine
stops every rank with one line, and nothing half-written is left in place.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import zlib
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import MegatrainError, OutputError
from ..host.state import HostState, checkpoint_entries, moment_entries, tensor_entries
from ..parallel.distributed import Collective
from ..planning.placement import fmt_bytes
from . import checkpoint, ownership
from .reader import TensorReader, checkpoint_files, segment_key
from .weights import save_hf_checkpoint
from .writing import AtomicDir, free_bytes, plan_shards, write_safetensors

PREFIXES = ("model", "optimizer")  # the weights; the moment buffers of the state's format


def save_checkpoint(
    world: Collective, output_dir: Path, trainer_state, state: HostState, *args, **kw
) -> Path:
    """checkpoint.save_checkpoint in a world, called by every rank (the module docstring says who
    writes what); the first rank's `trainer_state` is the one written. Returns the checkpoint."""
    if state.whole:
        path = checkpoint.checkpoint_dir(output_dir, trainer_state.global_step)
        if world.is_main:
            path = checkpoint.save_checkpoint(output_dir, trainer_state, state, *args, **kw)
        world.barrier()  # no rank steps the state while it is written
        return path
    parts = _Parts(world, state, trainer_state.weights_only, kw.get("max_shard_bytes", 5 * 10**9))

    def write(d: AtomicDir) -> None:
        d.checksums.update(parts.segments(d.path))

    return parts.run(
        lambda: checkpoint.save_checkpoint(output_dir, trainer_state, state, *args, **kw, write_tensors=write)
    )


def save_model(world: Collective, state: HostState, model_cfg, out_dir: Path, **kw) -> Path:
    """weights.save_hf_checkpoint (`final/`) in a world, called by every rank: the first rank
    writes it, from the state or, partitioned, from the machines' segments (module docstring)."""
    if state.whole:
        if world.is_main:
            return save_hf_checkpoint(state, model_cfg, out_dir, **kw)
        return Path(out_dir)
    parts = _Parts(world, state, weights_only=True, max_shard_bytes=kw.get("max_shard_bytes", 5 * 10**9))

    def write() -> Path:
        dump = Path(tempfile.mkdtemp(prefix=f".{Path(out_dir).name}.tmp-parts-", dir=Path(out_dir).parent))
        try:
            ownership.mark(dump)  # a kill leaves it to the next writer to delete (writing.py)
            parts.segments(dump)
            reader = TensorReader(checkpoint_files(dump), dump)
            for key, shape in checkpoint_entries(state.units):
                reader.check(key, shape)
            return save_hf_checkpoint(state, model_cfg, out_dir, read=reader.get, **kw)
        finally:
            shutil.rmtree(dump, ignore_errors=True)

    return parts.run(write)


def check_shared(world: Collective, path: Path) -> None:
    """Refuse, on every rank, a partitioned world whose machines do not all see `path` (a file
    the first rank has just written in output_dir) as the first rank wrote it: they could not
    save checkpoints together."""
    if not world.layout.partitioned:
        return
    want = world.first(_crc(path) if world.is_main else None)
    seen = _crc(path) if world.holds_state else want
    bad = [r for r, crc in enumerate(world.each(seen)) if crc != want]
    if bad:
        raise OutputError(
            f"{path.parent}: rank {bad[0]} does not see it as rank 0 wrote it; a host state partitioned over "
            "machines is saved by every machine into output_dir, which must be on a file system they all share"
        )


def _crc(path: Path) -> int | None:
    try:
        return zlib.crc32(path.read_bytes())
    except OSError:
        return None


class _Parts:
    """One directory written by every machine: the first rank runs `run(finish)`, where `finish`
    creates the directory, calls `segments(path)` once it exists and completes it; the other
    ranks write their machine's segments into it (`_follow`)."""

    def __init__(self, world: Collective, state: HostState, weights_only: bool, max_shard_bytes: int):
        self.world, self.state = world, state
        self.prefixes = ["model"] if weights_only else list(PREFIXES)
        self.max_shard_bytes = max_shard_bytes
        self.phase = "naming"  # -> writing -> written, or failed (every rank knows why)

    def run(self, finish: Callable[[], Path]) -> Path:
        if not self.world.is_main:
            return self._follow()
        try:
            path = finish()
        except BaseException as e:
            if self.phase in ("naming", "written"):  # the others wait for the outcome
                self.world.first(("error", _one_line(e)))
            raise
        self.world.first(("ok", str(path)))
        return path

    def segments(self, directory: Path) -> dict[str, tuple[int, int]]:
        """On the first rank: have every machine write its segments into `directory`; write the
        indexes; return every segment file's (bytes, CRC-32)."""
        self.world.first(("ok", str(directory)))
        self.phase = "writing"
        reports = self.world.each(self._write(directory))
        self._raise_problems(reports)
        self.phase = "written"
        files: dict[str, tuple[int, int]] = {}
        for prefix in self.prefixes:
            weight_map = {k: f for r in reports if r for k, f in r[1][prefix].items()}
            index = {"metadata": {"machines": self.world.layout.machines}, "weight_map": weight_map}
            (directory / f"{prefix}.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        for r in reports:
            if r:
                files.update(r[0])
        return files

    def _follow(self) -> Path:
        kind, where = self.world.first(None)
        if kind == "error":
            raise OutputError(where)
        self._raise_problems(self.world.each(self._write(Path(where))))
        kind, what = self.world.first(None)
        if kind == "error":
            raise OutputError(what)
        return Path(what)

    def _raise_problems(self, reports: list) -> None:
        problems = [r[2] for r in reports if r and r[2]]
        if problems:
            self.phase = "failed"
            raise OutputError(problems[0])

    def _write(self, directory: Path):
        """This machine's segments into `directory` (by its first rank): (files, {prefix: segment
        key -> file}, problem); None from the other ranks."""
        w = self.world
        if not w.holds_state:
            return None
        machine, machines = w.layout.machine_of(w.rank), w.layout.machines
        if not directory.is_dir():
            why = (
                f"{directory}: machine {machine + 1} (rank {w.rank}) cannot see the directory rank 0 created; a host "
                "state partitioned over machines is saved by every machine into output_dir, which must be on a "
                "file system they all share"
            )
            return {}, {}, why
        files: dict[str, tuple[int, int]] = {}
        maps: dict[str, dict[str, str]] = {}
        try:
            for prefix in self.prefixes:
                entries, getters, dtype = self._entries(prefix)
                name = f"{prefix}.machine-{machine + 1:05d}-of-{machines:05d}"
                written = write_safetensors(
                    directory, name, entries, dtype, getters.__getitem__, self.max_shard_bytes, index=False
                )
                files.update(written)
                maps[prefix] = _weight_map(name, entries, dtype, self.max_shard_bytes)
        except (OSError, MegatrainError) as e:
            where = f" ({Path(e.filename).name})" if isinstance(e, OSError) and e.filename else ""
            return (
                {},
                {},
                (
                    f"cannot write {directory.name}{where} on machine {machine + 1} (rank {w.rank}): "
                    f"{getattr(e, 'strerror', None) or e}; {fmt_bytes(free_bytes(directory))} free"
                ),
            )
        return files, maps, None

    def _entries(self, prefix: str):
        """The segments of this machine's part: (key, shape) entries, key -> tensor, key -> dtype.
        A moment buffer's in its own elements (an absmax's: blocks; parts start on pages)."""
        st = self.state
        entries, getters, dtypes = [], {}, {}
        buffers = ["master"] if prefix == "model" else [f.name for f in st.moments.fields]
        for which in buffers:
            per = st.per(which)
            for unit in st.units:
                lo, hi = st.part(unit)
                if which == "master":  # its halves: written in fp32, joined (io/writing.py)
                    flat, dtype = st.halves(unit), torch.float32
                else:
                    flat = st.flat(unit, which)
                    dtype = flat.dtype
                lo, hi = lo // per, -(-hi // per)
                if which == "master":
                    tensors = tensor_entries(unit, "piece")
                else:
                    tensors = moment_entries(unit, next(f for f in st.moments.fields if f.name == which))
                for key, start, shape in tensors:
                    a, b = max(lo, start), min(hi, start + math.prod(shape))
                    if a < b:
                        k = segment_key(key, a - start, b - start)
                        entries.append((k, (b - a,)))
                        getters[k] = flat[a - lo : b - lo]
                        dtypes[k] = dtype
        return entries, getters, dtypes.__getitem__


def _weight_map(prefix: str, entries, dtype, max_shard_bytes: int) -> dict[str, str]:
    """Segment key -> file, as write_safetensors names the files for these entries."""
    shards, _ = plan_shards(prefix, entries, dtype, None, max_shard_bytes)
    return {k: s.name for s in shards for k, _ in s.entries}


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__
