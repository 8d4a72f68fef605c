"""The name the operating system shows for the host optimizer's threads (`top -H`,
/proc/<pid>/task/*/comm), so that one name covers them all: the transport's worker (the OpenMP
threads of torch's AdamW, started from it, take its name) and clipadam's threads, whichever
thread starts them."""

from __future__ import annotations

import ctypes
import threading
from concurrent.futures import ThreadPoolExecutor

# At most 15 characters.
OPTIMIZER_THREAD = "megatrain-optim"


def name_os_thread(name: str) -> bool:
    """Give the calling thread `name` where the operating system shows one (Linux: prctl
    PR_SET_NAME, 15 characters kept); threads it starts from then on inherit it. Whether it was
    set."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(15, name.encode()[:15], 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


class OptimizerThreads:
    """Threads under the host optimizer's name that run one function on several of them at once:
    the kernels split a tensor's elements over `parts` calls that take blocks from a counter
    they share, so `run` waits for all of them."""

    def __init__(self, prefix: str):
        self.prefix = prefix
        self._pool: ThreadPoolExecutor | None = None
        self._workers = 0

    def run(self, parts: int, fn, *args) -> None:
        """`fn(*args)` on `parts` threads at once (the caller's alone for one)."""
        if parts == 1:
            fn(*args)
            return
        if self._pool is None or self._workers < parts:
            self._start(parts)
        for job in [self._pool.submit(fn, *args) for _ in range(parts)]:
            job.result()

    def _start(self, parts: int) -> None:
        """A pool of `parts` threads, every one started and named before the first call: a pool
        starts its threads lazily, and one started while another took its job would run on
        unnamed."""
        if self._pool is not None:
            self._pool.shutdown()
        self._pool = ThreadPoolExecutor(
            parts, thread_name_prefix=self.prefix, initializer=name_os_thread, initargs=(OPTIMIZER_THREAD,)
        )
        self._workers = parts
        started = threading.Barrier(parts)
        for job in [self._pool.submit(started.wait) for _ in range(parts)]:
            job.result()
