"""Host memory for streaming: page-aligned buffers, page-locked in pieces the driver accepts.

Copies between the GPU and host memory run at the full PCIe rate only from page-locked
(pinned) memory; from pageable memory they run 7x slower and block the calling thread. Pinning
memory that already exists (`cudaHostRegister`) is 5x faster than allocating pinned memory and
needs no second copy, so the large host buffers (master weights, gradients waiting for the clip
norm, parked activations) are allocated as ordinary memory and registered in place.

Two facts shape this module:
* NVIDIA drivers refuse a single registration of 512 GiB or more, so a buffer is registered in
  pieces of at most `MAX_REGISTRATION` bytes. A copy must not straddle two pieces (the driver
  would treat it as pageable), so pieces are cut only at the boundaries the caller names
  (unit boundaries), each of which must be page-aligned.
* Registrations are tracked per page: two pieces may not share one. `host_buffer` therefore
  maps anonymous memory (page-aligned, and zero pages that cost nothing until written) rather
  than using the allocator, whose large blocks start mid-page.

Untouched pages cost nothing, but a pass that reads them before it writes them faults twice a
page; `populate` maps them ahead of it, on several threads.
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

PAGE = mmap.PAGESIZE
MAX_REGISTRATION = 64 * 2**30  # bytes per cudaHostRegister call, well under the drivers' limit
MADV_POPULATE_WRITE = 23  # Linux 5.14 on; Python's mmap module does not name it


@functools.cache
def libc():
    """The C library, with the signatures of the memory calls made through it."""
    lib = ctypes.CDLL(None, use_errno=True)
    lib.mmap.restype = ctypes.c_void_p
    lib.mmap.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    lib.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return lib


def host_buffer(numel: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A zero-filled, page-aligned host tensor of `numel` elements. Pages are mapped on first
    write, so an untouched buffer costs no memory."""
    nbytes = max(1, numel * dtype.itemsize)
    mem = mmap.mmap(-1, -(-nbytes // PAGE) * PAGE)
    t = torch.frombuffer(mem, dtype=torch.uint8, count=numel * dtype.itemsize).view(dtype)
    t._megatrain_mmap = mem  # the tensor keeps its mapping alive
    return t


def populate(tensors: Sequence[torch.Tensor], threads: int) -> bool:
    """Map every page under `tensors` writable now, contents kept (MADV_POPULATE_WRITE), split
    over `threads` threads (each call releases the GIL). Untouched memory that is read before it
    is written, as AdamW reads its moments, faults twice a page: the read maps the shared zero
    page, the write then copies it. Populated first, the first pass over fresh moments took 1.33 s
    against 1.88 (2 GiB of them, two cores, the median of six). False where the kernel refuses
    (before Linux 5.14): the pages are then mapped as they are touched, as before."""
    pieces = []
    for t in tensors:
        if t.numel() == 0:
            continue
        start = t.data_ptr() // PAGE * PAGE
        end = t.data_ptr() + t.numel() * t.element_size()
        step = -(-(end - start) // threads // PAGE) * PAGE
        pieces += [(a, min(end, a + step) - a) for a in range(start, end, step)]
    if not pieces:
        return True
    with ThreadPoolExecutor(min(threads, len(pieces))) as pool:
        return all(rc == 0 for rc in pool.map(lambda p: libc().madvise(*p, MADV_POPULATE_WRITE), pieces))


def shared_buffer(path: Path, numel: int, create: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """A page-aligned host tensor mapped from the file `path` (on a tmpfs such as /dev/shm),
    shared with every process that maps the same file: `create` makes it, zero-filled and
    sparse (pages cost memory on first write, as with `host_buffer`); the others open it."""
    nbytes = -(-max(1, numel * dtype.itemsize) // PAGE) * PAGE
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
        mem = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
    finally:
        os.close(fd)  # the mapping keeps the memory
    t = torch.frombuffer(mem, dtype=torch.uint8, count=numel * dtype.itemsize).view(dtype)
    t._megatrain_mmap = mem
    return t


def pieces(cuts: Sequence[int], total: int, max_bytes: int, itemsize: int) -> list[tuple[int, int]]:
    """Split [0, total) elements into consecutive ranges of at most `max_bytes`, cut only at
    `cuts` (element offsets); a range between two cuts that is larger on its own stays whole."""
    bounds = sorted({c for c in cuts if 0 < c < total} | {total})
    out, start, prev = [], 0, 0
    for b in bounds:
        if (b - start) * itemsize > max_bytes and prev > start:
            out.append((start, prev))
            start = prev
        prev = b
    out.append((start, total))
    return out


class Registration:
    """`tensor`'s memory page-locked in pieces cut at `cuts` (element offsets, page-aligned
    addresses); `close()` unregisters. On failure nothing stays registered."""

    def __init__(self, tensor: torch.Tensor, cuts: Sequence[int] = (), max_bytes: int | None = None):
        max_bytes = max_bytes or MAX_REGISTRATION
        self.ptrs: list[int] = []
        itemsize = tensor.element_size()
        base = tensor.data_ptr()
        cudart = torch.cuda.cudart()
        try:
            for a, b in pieces(cuts, tensor.numel(), max_bytes, itemsize):
                ptr = base + a * itemsize
                if a and ptr % PAGE:
                    raise ValueError(f"registration piece at element {a} is not page-aligned")
                rc = cudart.cudaHostRegister(ptr, (b - a) * itemsize, 0)
                if int(rc) != 0:
                    raise RuntimeError(
                        f"cudaHostRegister of {(b - a) * itemsize / 2**30:.1f} GiB failed ({rc}); "
                        "is the locked-memory limit (ulimit -l) too low?"
                    )
                self.ptrs.append(ptr)
        except BaseException:
            self.close()
            raise

    def close(self) -> None:
        cudart = torch.cuda.cudart()
        for ptr in self.ptrs:
            cudart.cudaHostUnregister(ptr)
        self.ptrs = []
