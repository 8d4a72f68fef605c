"""The disk tier: AdamW moments of the model's last units in files on local disk (`offload_dir`),
where host memory cannot hold the whole state.

The moments stay where every reader expects them: the tier maps a file over the tail of each
moment buffer (`HostState.exp_avg`, `exp_avg_sq`) at the same addresses, so the optimizer,
checkpoints and resume read and write them as before and a run with a tier is bitwise the run
without one. The kernel moves the pages between the page cache and the disk: read ahead as the
optimizer's pass walks a unit (the mapping is advised sequential), written back behind it.

The files are scratch. Each is created in `offload_dir`, its blocks reserved at once (so the disk
cannot run out later, when a write-back would have nowhere to report it), mapped, and unlinked
before any state is written: nothing is left on disk when the process ends, however it ends, and
a resume rebuilds the tier from its checkpoint.

The tier's units are the last ones (the plan keeps GPU-resident and GPU-stepped units, which need
page-locked moments, at the front).
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import tempfile
import time
from pathlib import Path

from ..errors import MegatrainError
from .hostmem import libc
from .state import HostState

GiB = 2**30
MOMENTS = ("exp_avg", "exp_avg_sq")
MOMENT_BYTES = 8  # per parameter: the two fp32 moments the tier holds
RATE_PROBE_BYTES = 256 * 2**20  # large enough for a drive's sequential rate, ~0.3 s on NVMe
RATE_PROBE_BLOCK = 16 * 2**20


class DiskTierError(MegatrainError):
    """The disk tier could not be made (no space, a bad offload_dir)."""


def measure_rate(directory: str | Path, nbytes: int = RATE_PROBE_BYTES) -> float:
    """Bytes per second the tier moves each way on average here (harmonic mean of a write and a
    read of `nbytes`), through the page cache as the tier's pages move: written and synced, then,
    dropped from the cache, read again. A block of RATE_PROBE_BLOCK bytes is all it holds in
    memory."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    block = bytearray(b"\x5a" * RATE_PROBE_BLOCK)
    count = max(1, nbytes // len(block))
    fd, path = tempfile.mkstemp(prefix="megatrain-rate-", suffix=".tier", dir=directory)
    try:
        os.unlink(path)
        t0 = time.perf_counter()
        for i in range(count):
            os.pwrite(fd, block, i * len(block))
        os.fsync(fd)
        write = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, count * len(block), os.POSIX_FADV_DONTNEED)  # clean now: reads hit the disk
        back = bytearray(len(block))
        t0 = time.perf_counter()
        intact = all(os.preadv(fd, [back], i * len(block)) == len(block) for i in range(count))
        read = time.perf_counter() - t0
    finally:
        os.close(fd)
    if not intact or back != block:
        raise DiskTierError(f"offload_dir: {directory}: read back other bytes than written")
    return 2 * count * len(block) / (write + read)


def tier_elements(state: HostState, units: int) -> tuple[int, int]:
    """The elements [lo, hi) of each moment buffer that the last `units` units take."""
    if not 0 < units <= len(state.units):
        raise ValueError(f"a disk tier of {units} units; the model has {len(state.units)}")
    first = state.units[len(state.units) - units]
    return state.starts[first.index], state.numel


class DiskTier:
    """The moments of `state`'s last `units` units mapped from files in `directory`."""

    def __init__(self, state: HostState, units: int, directory: str | Path):
        if state.exp_avg is None:
            raise ValueError("a disk tier holds AdamW moments; this state has none")
        self.units = units
        self.directory = Path(directory)
        lo, hi = tier_elements(state, units)
        self.nbytes = len(MOMENTS) * (hi - lo) * 4
        self._check_space()
        for name in MOMENTS:
            buf = getattr(state, name)
            if buf.data_ptr() % mmap.PAGESIZE or (lo * 4) % mmap.PAGESIZE:
                raise ValueError("the moment buffers must be page-aligned at unit boundaries")
            self._map(buf.data_ptr() + lo * 4, (hi - lo) * 4, name)
        state.disk_from = len(state.units) - units

    def _check_space(self) -> None:
        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            free = os.statvfs(self.directory)
        except OSError as e:
            raise DiskTierError(f"offload_dir: {self.directory}: {e.strerror or e}") from None
        if free.f_bavail * free.f_frsize < self.nbytes:
            raise DiskTierError(self._no_space(free.f_bavail * free.f_frsize))

    def _no_space(self, free: int) -> str:
        return (
            f"offload_dir: {self.directory}: the disk tier needs {self.nbytes / GiB:.2f} GiB "
            f"(AdamW moments of the last {self.units} units), {free / GiB:.2f} GiB free"
        )

    def _map(self, address: int, nbytes: int, name: str) -> None:
        """Map a fresh file of `nbytes` over [address, address + nbytes), then unlink it."""
        fd, path = tempfile.mkstemp(prefix=f"megatrain-{name}-", suffix=".tier", dir=self.directory)
        try:
            os.unlink(path)  # scratch from the start: gone with the process, however it ends
            try:
                os.posix_fallocate(fd, 0, nbytes)  # every block now, so no write-back can fail later
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    free = os.statvfs(self.directory)
                    raise DiskTierError(self._no_space(free.f_bavail * free.f_frsize)) from None
                raise DiskTierError(f"offload_dir: {self.directory}: {e.strerror or e}") from None
            prot, flags = mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_SHARED | 0x10  # MAP_FIXED
            got = libc().mmap(address, nbytes, prot, flags, fd, 0)
            if got != address:
                err = ctypes.get_errno()
                raise DiskTierError(
                    f"offload_dir: {self.directory}: mapping the tier failed: {os.strerror(err)}"
                )
            libc().madvise(address, nbytes, 2)  # MADV_SEQUENTIAL: read ahead, drop behind
        finally:
            os.close(fd)  # the mapping keeps the file
