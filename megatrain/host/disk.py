"""The disk tier: AdamW moments of the model's last units in a file on local disk (`offload_dir`),
where host memory cannot hold the whole state.

Where the moments are. One file (one per drive: below) holds the tier's units back to back, each
cut in blocks of at most `BLOCK_ELEMS` elements (fewer in a small tier: `block_elems`), a block's
moment buffers side by side in their format (its exp_avg, then its exp_avg_sq, then an 8-bit
format's absmax; each from a page: `record`), so that staging a block is one read and one write
of one extent. One file per drive, not one per unit or per thread: what keeps a
drive busy is large requests in flight (an O_DIRECT request of 64 MiB reaches the drive as many at
once, and the I/O threads keep several of them going), not a number of files; a file is one
reservation and one descriptor.

Several drives. offload_dir may name several folders, one per drive (a workstation's NVMe drives
mounted apart, no RAID): the blocks are striped over them round-robin, block i in folder i % N,
each folder's file holding its share back to back, so that the read-ahead and write-behind keep N
drives busy at once. Two folders on one file system are refused (`drive_folders`): striping over
one drive buys nothing and would count its free space twice.

How they move. The optimizer steps a block of a tier unit on a *staged* copy of its moments
(`staged`), one of `RING_SLOTS` page-aligned host buffers. Its pass takes the tier's units in an
order known up front (`expect`: the engine's `step_order`), so `IO_THREADS` threads read the
next `AHEAD` blocks while the current one is stepped, and write each block back as soon as its
step is done, beside the AdamW (torch's threads). The I/O is O_DIRECT where the file system
takes it, else buffered (tierfile.py; `direct` says which, and so does the plan's note). A block
still in the ring is not read again, and the ring keeps those the pass reaches again soonest.

Exact. A block's elements are stepped by the same fused AdamW as in host memory, and AdamW is
elementwise: a unit stepped block by block is bitwise the unit stepped whole, so a run with a
tier is bitwise the run without one. Checkpoints read the tier's moments from the file a block at
a time (`pieces`, after the writes in flight) and a resume writes them in through the ring
(`fill`): the tier is never held whole in memory.

Scratch. The file never has a name in offload_dir and its blocks are reserved up front
(tierfile.py): nothing is left when the process ends, however it ends, a full disk is one line
when the tier is made, and a resume rebuilds the tier from its checkpoint.

The tier's units are the last ones (the plan keeps GPU-resident and GPU-stepped units, which need
page-locked moments, at the front).
"""

from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch

from .hostmem import PAGE, host_buffer
from .moments import FP32, Field, Moments
from .state import UNIT_ALIGN, HostState, Unit, fill_range
from .tierfile import ALIGN_ELEMS, DiskTierError, TierFile, free_bytes, tier_error

GiB, MiB = 2**30, 2**20
BLOCK_ELEMS = 8 * 2**20  # elements of each moment in a block: 64 MiB read and written at once
RING_SLOTS = 6  # blocks staged in host memory: one stepped, AHEAD read ahead, the rest written back
AHEAD = 3
RING_SHARE = 4  # a small tier's blocks are smaller: its ring takes at most ~1/4 of what it frees
IO_THREADS = 4
RATE_PROBE_BYTES = 256 * MiB  # large enough for a drive's sequential rates, ~0.3 s on NVMe
ONE_DRIVE_PER_FOLDER = True  # off only where folders on one disk stand for drives (the tests)


def block_elems(unit_numels: Sequence[int]) -> int:
    """Elements of each moment in a block of a tier of units of these lengths: BLOCK_ELEMS, or
    fewer in a small tier, so that its ring takes at most about 1/RING_SHARE of the host memory
    the tier frees; whole pages."""
    share = -(-sum(unit_numels) // (RING_SHARE * RING_SLOTS))
    return max(UNIT_ALIGN, min(BLOCK_ELEMS, -(-share // UNIT_ALIGN) * UNIT_ALIGN))


def record(numel: int, moments: Moments) -> list[tuple[Field, int]]:
    """Where each moment buffer of a block of `numel` elements lies in its extent: (field, byte
    offset), each from a page (O_DIRECT reads pages, and a checkpoint reads one buffer)."""
    out, at = [], 0
    for f in moments.fields:
        out.append((f, at))
        at += -(-f.nbytes(numel) // PAGE) * PAGE
    return out


def record_bytes(numel: int, moments: Moments) -> int:
    """Bytes of a block of `numel` elements in the file (`record`)."""
    return sum(-(-f.nbytes(numel) // PAGE) * PAGE for f in moments.fields)


def tier_bytes(unit_numels: Sequence[int], moments: Moments) -> int:
    """Bytes in offload_dir of a tier of units of these lengths (elements)."""
    if not unit_numels:
        return 0
    block = block_elems(unit_numels)  # each unit: its whole blocks, then the rest (0 bytes if none)
    whole = record_bytes(block, moments)
    return sum(n // block * whole + record_bytes(n % block, moments) for n in unit_numels)


def ring_bytes(unit_numels: Sequence[int], moments: Moments = FP32) -> int:
    """Host bytes of the staging ring of a tier of units of these lengths (elements): RING_SLOTS
    blocks, or as many as the tier has, each of the largest block's size."""
    if not unit_numels:
        return 0
    block = block_elems(unit_numels)
    blocks = sum(-(-n // block) for n in unit_numels)
    return min(RING_SLOTS, blocks) * record_bytes(min(block, max(unit_numels)), moments)


@dataclass(frozen=True)
class DiskRates:
    read_bytes_s: float
    write_bytes_s: float
    duplex_bytes_s: float
    """Bytes per second read and written together, reads and writes in flight at once (as the
    ring keeps them): a drive may serve both at once, or in turn."""
    direct: bool
    """O_DIRECT (False: the file system refuses it, the tier's I/O is buffered)."""


def measure_rates(directory: str | Path, nbytes: int = RATE_PROBE_BYTES) -> DiskRates:
    """The rates the tier moves data at here, as it moves them: blocks of fp32 moments of
    BLOCK_ELEMS elements on IO_THREADS threads, O_DIRECT where the file system takes it. `nbytes` are
    written, then timed: written again (the tier overwrites its blocks from its second step on,
    and a first write of reserved blocks can be slower), read back (buffered: from the drive, the
    page cache dropped), and read and written at once. Holds a block per thread in memory; leaves
    nothing in `directory`."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise tier_error(directory, "making it", e) from None
    block = min(max(nbytes, PAGE), record_bytes(BLOCK_ELEMS, FP32)) // PAGE * PAGE
    count = max(1, nbytes // block)
    need = count * block

    def no_space(free: int) -> str:
        return f"offload_dir: {directory}: measuring the disk's rates needs {need / MiB:.0f} MiB, {free / MiB:.0f} MiB free"

    f = TierFile(directory, need, no_space)
    # Every block alike: two transfers that share a buffer at a moment cannot mix anything up.
    bufs = [host_buffer(block // 4).fill_(0.5) for _ in range(IO_THREADS)]
    writes = [(f.write, i) for i in range(count)]
    reads = [(f.read, i) for i in range(count)]
    try:
        with ThreadPoolExecutor(IO_THREADS, thread_name_prefix="megatrain-disk") as pool:

            def timed(ops) -> float:
                t0 = time.perf_counter()
                list(pool.map(lambda op: op[0](bufs[op[1] % IO_THREADS], op[1] * block), ops))
                os.fsync(f.fd)
                return time.perf_counter() - t0

            timed(writes)
            write = timed(writes)
            for b in bufs:
                b.zero_()
            read = timed(reads)
            intact = all(bool((b == 0.5).all()) for b in bufs[: min(count, IO_THREADS)])
            both = timed([op for pair in zip(reads, writes) for op in pair])
    except OSError as e:
        raise tier_error(directory, "measuring the disk's rates", e) from None
    finally:
        f.close()
    if not intact:
        raise DiskTierError(f"offload_dir: {directory}: read back other bytes than written")
    return DiskRates(need / read, need / write, 2 * need / both, f.direct)


def drive_folders(directories: str | Path | Sequence[str | Path]) -> list[Path]:
    """offload_dir's folders, one per drive, made where missing; two on one file system (the same
    `st_dev`) are refused in one line (see the module docstring)."""
    folders = [Path(directories)] if isinstance(directories, (str, Path)) else [Path(d) for d in directories]
    seen: dict[int, Path] = {}
    for folder in folders:
        try:
            folder.mkdir(parents=True, exist_ok=True)
            dev = os.stat(folder).st_dev
        except OSError as e:
            raise tier_error(folder, "the disk tier's folder", e) from None
        if dev in seen and ONE_DRIVE_PER_FOLDER:
            raise DiskTierError(
                f"offload_dir: {seen[dev]} and {folder} are on one file system: striping the disk "
                "tier over one drive buys nothing; give one folder per drive"
            )
        seen.setdefault(dev, folder)
    return folders


def measure_drives(directories: Sequence[str | Path], nbytes: int | None = None) -> DiskRates:
    """The rates of the tier striped over these folders' drives: each measured alone
    (`measure_rates`, `nbytes` each, default RATE_PROBE_BYTES), their rates summed (the stripe
    keeps every drive busy at once; a bus the drives share is not measured), O_DIRECT only where
    every folder takes it."""
    each = [measure_rates(d, nbytes or RATE_PROBE_BYTES) for d in drive_folders(directories)]
    return DiskRates(
        sum(r.read_bytes_s for r in each),
        sum(r.write_bytes_s for r in each),
        sum(r.duplex_bytes_s for r in each),
        all(r.direct for r in each),
    )


@dataclass
class _Slot:
    """A ring buffer: a block's moments (`record`, bytes), and the last read or write of it
    (queued or done)."""

    buf: torch.Tensor
    block: int | None = None
    io: Future | None = None
    busy: bool = False
    """Staged: the optimizer is stepping it."""


class DiskTier:
    """The AdamW moments of `state`'s last `units` units in a file in each of `directories` (one
    folder, or several: one per drive, the blocks striped over them), moved through a ring of host
    buffers (see the module docstring). Made before anything is written to the moments: it takes
    their host memory away (`state.exp_avg` and `exp_avg_sq` stop where its units start) and
    becomes `state.tier`."""

    def __init__(self, state: HostState, units: int, directories: str | Path | Sequence[str | Path]):
        self.moments = state.moments
        if state.exp_avg is None:
            raise ValueError("a disk tier holds AdamW moments; this state has none")
        if not state.whole:
            raise ValueError("a disk tier holds whole units (one process per machine)")
        if not 0 < units <= len(state.units):
            raise ValueError(f"a disk tier of {units} units; the model has {len(state.units)}")
        self.units = state.units[len(state.units) - units :]
        self.first = self.units[0].index
        self.directories = drive_folders(directories)
        B = self.block_elems = block_elems([u.numel for u in self.units])
        if B % UNIT_ALIGN or B % ALIGN_ELEMS:
            raise ValueError(f"a block of {B} elements does not end on a page")
        # (lo, hi) of a unit, the file the block is in (round-robin), its offset in that file
        self._blocks: list[tuple[int, int, int, int]] = []
        self._first_block: dict[int, int] = {}
        self.file_bytes = [0] * len(self.directories)
        for u in self.units:
            self._first_block[u.index] = len(self._blocks)
            for a in range(0, u.numel, B):
                b = min(a + B, u.numel)
                f = len(self._blocks) % len(self.directories)
                self._blocks.append((a, b, f, self.file_bytes[f]))
                self.file_bytes[f] += record_bytes(b - a, self.moments)
        self.nbytes = sum(self.file_bytes)
        self.files = self._reserve()
        self.direct = all(f.direct for f in self.files)
        lo = state.starts[self.first]
        for f in self.moments.fields:
            setattr(state, f.name, getattr(state, f.name)[: lo // f.per])
        state.tier = self
        slot = record_bytes(min(B, max(u.numel for u in self.units)), self.moments)
        self._slots = [
            _Slot(host_buffer(slot, torch.uint8)) for _ in range(min(RING_SLOTS, len(self._blocks)))
        ]
        self._pool = ThreadPoolExecutor(IO_THREADS, thread_name_prefix="megatrain-disk")
        self._lock = threading.Lock()
        self._written: dict[int, Future] = {}  # each block's last write
        self._order = list(range(len(self._blocks)))
        self._pos = {b: i for i, b in enumerate(self._order)}
        self._at = -1  # the position in `_order` of the block last staged
        self.counters = {"disk_read_bytes": 0, "disk_written_bytes": 0, "disk_wait_s": 0.0, "disk_misses": 0}
        """Bytes read and written, seconds the optimizer waited for reads, blocks it found
        unread (not read ahead): since the tier was made."""

    def _reserve(self) -> list[TierFile]:
        """A reserved file in each folder, every folder's room checked before any is made."""
        for i, folder in enumerate(self.directories):
            try:
                free = free_bytes(folder)
            except OSError as e:
                raise tier_error(folder, "the disk tier's folder", e) from None
            if free < self.file_bytes[i]:
                raise DiskTierError(self._no_space(i, free))
        files: list[TierFile] = []
        try:
            for i, folder in enumerate(self.directories):
                files.append(TierFile(folder, self.file_bytes[i], partial(self._no_space, i)))
        except BaseException:
            for f in files:
                f.close()
            raise
        return files

    def _no_space(self, i: int, free: int) -> str:
        """The line a full disk raises: folder `i`, its share of the tier, its free bytes."""
        n = len(self.directories)
        share = f" there (its share of {self.nbytes / GiB:.2f} GiB striped over {n} folders)" if n > 1 else ""
        return (
            f"offload_dir: {self.directories[i]}: the disk tier needs {self.file_bytes[i] / GiB:.2f} GiB"
            f"{share} (AdamW moments of the last {len(self.units)} units), {free / GiB:.2f} GiB free"
        )

    # ------------------------------------------------------------- where the moments are
    def holds(self, unit: Unit) -> bool:
        return unit.index >= self.first

    def blocks(self, unit: Unit, lo: int, hi: int) -> list[tuple[int, int]]:
        """[lo, hi) of `unit` cut where its blocks end."""
        B = self.block_elems
        return [(a, min((a // B + 1) * B, hi)) for a in _starts(lo, hi, B)]

    def _block(self, unit: Unit, lo: int, hi: int) -> int:
        if not self.holds(unit):
            raise ValueError(f"{unit.name} is not in the disk tier")
        block = self._first_block[unit.index] + lo // self.block_elems
        a, b, _, _ = self._blocks[block]
        if not (a <= lo < hi <= b):
            raise ValueError(f"{unit.name}[{lo}:{hi}] is not within one block of the disk tier")
        return block

    def expect(self, units: Sequence[Unit]) -> None:
        """The order the optimizer's passes take units in (those outside the tier are ignored):
        its blocks are read ahead in this order, the first ones from now on."""
        order = [b for u in units if self.holds(u) for b in self._unit_blocks(u)]
        named = set(order)
        order += [b for b in range(len(self._blocks)) if b not in named]
        with self._lock:
            self._order, self._pos, self._at = order, {b: i for i, b in enumerate(order)}, -1
            self._ahead()

    def _unit_blocks(self, unit: Unit) -> range:
        first = self._first_block[unit.index]
        return range(first, first + -(-unit.numel // self.block_elems))

    # ------------------------------------------------------------- the optimizer's pass
    @contextmanager
    def staged(self, unit: Unit, lo: int, hi: int) -> Iterator[tuple[torch.Tensor, ...]]:
        """The moment buffers (`Moments.fields` order) of elements [lo, hi) of `unit`, which lie in
        one block: views of its ring slot, read from disk (ahead of the call, as a rule) and
        written back on leaving. One block is staged at a time."""
        block = self._block(unit, lo, hi)
        slot = self._acquire(block)
        a, b, _, _ = self._blocks[block]
        views = []
        for f, at in record(b - a, self.moments):
            t = slot.buf[at : at + f.nbytes(b - a)].view(getattr(torch, f.dtype))
            views.append(t[(lo - a) // f.per : -(-(hi - a) // f.per)])
        try:
            yield tuple(views)
        except BaseException:
            with self._lock:  # half stepped: dropped, not written (the run fails anyway)
                slot.busy, slot.block = False, None
            raise
        self._release(slot)

    def _acquire(self, block: int) -> _Slot:
        t0 = time.perf_counter()
        with self._lock:
            if any(s.busy for s in self._slots):
                raise RuntimeError("the disk tier stages one block at a time")
            self._at = self._pos[block]
            slot = self._holding(block)
            if slot is None:
                slot = self._victim({block})
                self._read(slot, block)
                self.counters["disk_misses"] += 1
            slot.busy = True
            io = slot.io
            self._ahead()
        if io is not None:
            self._wait(io, block, "reading")
        self.counters["disk_wait_s"] += time.perf_counter() - t0
        return slot

    def _release(self, slot: _Slot) -> None:
        with self._lock:
            block = slot.block
            a, b, f, offset = self._blocks[block]
            buf = slot.buf[: record_bytes(b - a, self.moments)]
            slot.io = self._written[block] = self._pool.submit(self.files[f].write, buf, offset)
            slot.busy = False
            self.counters["disk_written_bytes"] += buf.numel()

    def _holding(self, block: int) -> _Slot | None:
        return next((s for s in self._slots if s.block == block), None)

    def _upcoming(self) -> list[int]:
        N = len(self._order)
        count = min(AHEAD, N - 1 if self._at >= 0 else N)  # not the block staged now
        return [self._order[(self._at + i) % N] for i in range(1, count + 1)]

    def _ahead(self) -> None:
        """Queue reads of the next AHEAD blocks of the pass that the ring does not hold."""
        upcoming = self._upcoming()
        keep = set(upcoming) | ({self._order[self._at]} if self._at >= 0 else set())
        for block in upcoming:
            if self._holding(block) is None:
                slot = self._victim(keep)
                if slot is None:
                    return
                self._read(slot, block)

    def _victim(self, keep: set[int]) -> _Slot | None:
        """A slot to read another block into: an empty one, else the one whose block the pass
        reaches again last (never a staged one, nor one holding a block of `keep`)."""
        free = [s for s in self._slots if not s.busy and s.block not in keep]
        N = len(self._order)
        return max(
            free, key=lambda s: N if s.block is None else (self._pos[s.block] - self._at) % N, default=None
        )

    def _read(self, slot: _Slot, block: int) -> None:
        """Queue the read of `block` into `slot`, after the slot's last I/O and the block's last
        write (which another slot may still be doing)."""
        a, b, f, offset = self._blocks[block]
        buf = slot.buf[: record_bytes(b - a, self.moments)]
        after = [io for io in (slot.io, self._written.get(block)) if io is not None]
        slot.block = block
        slot.io = self._pool.submit(_after, after, self.files[f].read, buf, offset)
        self.counters["disk_read_bytes"] += buf.numel()

    def _wait(self, io: Future, block: int, doing: str) -> None:
        """Wait for `io`, a read or write of `block`; its error is one line naming the block's folder."""
        f = self._blocks[block][2]
        try:
            io.result()
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                raise DiskTierError(self._no_space(f, free_bytes(self.directories[f]))) from None
            raise tier_error(self.directories[f], f"{doing} the disk tier", e) from None

    # ------------------------------------------------------------- checkpoints
    def pieces(self, unit: Unit, which: str, lo: int, hi: int) -> Iterator[torch.Tensor]:
        """Elements [lo, hi) of `unit`'s moment buffer `which` (of an absmax: the blocks they
        cover), read from the file a block at most at a time once the block's writes are done:
        each piece a tensor of its own. What a checkpoint writes; not while a block is staged."""
        for a, b in self.blocks(unit, lo, hi):
            block = self._block(unit, a, b)
            with self._lock:
                if any(s.busy for s in self._slots):
                    raise RuntimeError("the disk tier is read while the optimizer steps it")
                written = self._written.get(block)
            if written is not None:
                self._wait(written, block, "writing")
            ba, bb, f, offset = self._blocks[block]
            field, at = next((g, at) for g, at in record(bb - ba, self.moments) if g.name == which)
            first = at + (a - ba) // field.per * field.itemsize  # bytes of [a, b) in the block
            end = at + -(-(b - ba) // field.per) * field.itemsize
            s, e = first // PAGE * PAGE, -(-end // PAGE) * PAGE  # whole pages around them
            buf = host_buffer(e - s, torch.uint8)
            try:
                self.files[f].read(buf, offset + s)
            except OSError as err:
                raise tier_error(self.directories[f], "reading the disk tier", err) from None
            yield buf[first - s : end - s].view(getattr(torch, field.dtype))

    def fill(
        self, unit: Unit, entries: dict[str, list], read: Callable[[str, int, int], torch.Tensor]
    ) -> None:
        """Write `unit`'s moments from tensors, a block at a time through the ring: `entries[which]`
        and `read` as `HostState.load` takes them (a resumed checkpoint's moments)."""
        for a, b in self.blocks(unit, 0, unit.numel):
            with self.staged(unit, a, b) as views:
                for f, view in zip(self.moments.fields, views):  # an absmax's entries count blocks
                    fill_range(view, a // f.per, -(-b // f.per), entries[f.name], read)

    def close(self) -> None:
        """Finish the I/O in flight and close the files (they are gone then: they have no name)."""
        self._pool.shutdown(wait=True)
        for f in self.files:
            f.close()


def _starts(lo: int, hi: int, block: int) -> list[int]:
    """Where the pieces of [lo, hi) cut at multiples of `block` start."""
    return [lo] + list(range((lo // block + 1) * block, hi, block)) if lo < hi else []


def _after(futures: list[Future], fn, *args) -> None:
    """`fn(*args)` once `futures` are done. They were queued before this task, to a pool that starts
    tasks in order, so each is running or done: the wait cannot deadlock."""
    for f in futures:
        f.result()
    fn(*args)
