"""The name the operating system shows for the host optimizer's threads (`top -H`,
/proc/<pid>/task/*/comm), so that one name covers them all: the transport's worker (the OpenMP
threads of torch's AdamW, started from it, take its name) and clipadam's threads, whichever
thread starts them."""

from __future__ import annotations

import ctypes

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
