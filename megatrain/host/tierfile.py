"""The disk tier's file (disk.py): scratch that never has a name in offload_dir, every block
reserved up front, read and written in whole pages, O_DIRECT where the file system takes it.

Scratch. The file is made with O_TMPFILE (where the file system has none: created and unlinked at
once), so nothing is left in offload_dir when the process ends, however it ends, and nothing of
the user's there is touched. Its blocks are reserved before anything is written
(posix_fallocate): a full disk is one line then, with the numbers, never a failed write later.

Direct. O_DIRECT moves data between the drive and the caller's buffer with no page cache between:
the host memory the tier takes is its ring, which the plan counts, and nothing grows behind it.
It moves whole logical blocks of the drive from aligned memory, so offsets, lengths and buffers
are whole pages (every drive's logical block divides a page). Where the file system refuses it
(the flag, or the first I/O: some accept one and refuse the other) the file is read and written
through the page cache, each range dropped from it once moved. os.preadv and os.pwritev release
the GIL: the tier's threads move data while Python and torch's threads go on.
"""

from __future__ import annotations

import errno
import fcntl
import os
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from ..errors import MegatrainError
from .hostmem import PAGE, host_buffer

ALIGN_ELEMS = PAGE // 4  # fp32 elements in a page
O_DIRECT = getattr(os, "O_DIRECT", 0)  # Linux's; elsewhere the I/O is buffered


class DiskTierError(MegatrainError):
    """The disk tier could not be made or moved (no space, a bad offload_dir, a failed read)."""


def free_bytes(directory: Path) -> int:
    """Bytes an unprivileged process may still write in `directory`'s file system."""
    st = os.statvfs(directory)
    return st.f_bavail * st.f_frsize


def tier_error(directory: Path, what: str, e: OSError) -> DiskTierError:
    """The one line an OSError of `what` becomes."""
    return DiskTierError(f"offload_dir: {directory}: {what}: {e.strerror or e}")


class TierFile:
    """A file of `nbytes` in `directory` that never has a name there, its blocks reserved, read
    and written in whole pages: O_DIRECT where the file system takes it (`direct`), else
    buffered. `no_space(free)`: the line a full disk raises."""

    def __init__(self, directory: Path, nbytes: int, no_space: Callable[[int], str]):
        self.directory = directory
        self.fd = self._unnamed()
        try:
            try:
                os.posix_fallocate(self.fd, 0, max(nbytes, PAGE))  # every block now: no write fails later
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise DiskTierError(no_space(free_bytes(directory))) from None
                raise tier_error(directory, "reserving the disk tier's file", e) from None
            self._go_direct()
        except BaseException:
            os.close(self.fd)
            raise

    def _unnamed(self) -> int:
        try:
            return os.open(self.directory, getattr(os, "O_TMPFILE", 0) | os.O_RDWR, 0o600)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                raise tier_error(self.directory, "making the disk tier's file", e) from None
        try:  # a file system without O_TMPFILE: a name for an instant
            fd, path = tempfile.mkstemp(prefix="megatrain-", suffix=".tier", dir=self.directory)
        except OSError as e:
            raise tier_error(self.directory, "making the disk tier's file", e) from None
        os.unlink(path)
        return fd

    def _go_direct(self) -> None:
        """Switch the file to O_DIRECT if its file system takes it: the flag, then a page written
        and read back (some file systems accept the flag and refuse the I/O)."""
        self.direct = bool(O_DIRECT)
        if not self.direct:
            return
        flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
        try:
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags | O_DIRECT)
            page = host_buffer(ALIGN_ELEMS)  # zeros, as the fresh file holds
            self.write(page, 0)
            self.read(page, 0)
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise tier_error(self.directory, "the disk tier's first read", e) from None
            fcntl.fcntl(self.fd, fcntl.F_SETFL, flags)
            self.direct = False

    def read(self, buf: torch.Tensor, offset: int) -> None:
        """Fill `buf` (a page-aligned tensor of whole pages) from the file at `offset`."""
        self._move(os.preadv, buf, offset)

    def write(self, buf: torch.Tensor, offset: int) -> None:
        self._move(os.pwritev, buf, offset)

    def _move(self, op, buf: torch.Tensor, offset: int) -> None:
        view = memoryview(buf.view(torch.uint8).numpy())
        done = 0
        while done < len(view):  # a transfer may stop short (a signal); the rest follows
            n = op(self.fd, [view[done:]], offset + done)
            if n <= 0:
                raise OSError(errno.EIO, "the disk tier's file ended early")
            done += n
        if not self.direct:  # buffered: keep the page cache from holding the tier beside the ring
            os.posix_fadvise(self.fd, offset, len(view), os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
