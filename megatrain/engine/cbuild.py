"""The host kernels' C (clipadam.py, momentkernel.py) built by the machine's compiler and loaded.

A build is kept in a cache directory (MEGATRAIN_KERNEL_CACHE, else megatrain/kernels under
XDG_CACHE_HOME or ~/.cache; an empty MEGATRAIN_KERNEL_CACHE keeps none) under a name made from
everything the library's code depends on: the source, the compiler's name, version and flags, and
the CPU that `-march=native` builds for. The next process loads it instead of compiling it again
(1.5-2 s of CPU a kernel, which every training process would spend). The checks that a kernel's
results equal torch's run on every load, cached or not. Where no cache can be written, a build
lives in a temporary directory that is gone once the library is mapped.
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]
# The lines of /proc/cpuinfo that say which instructions `-march=native` may use (x86, Arm).
CPU_FIELDS = ("vendor_id", "cpu family", "model", "model name", "stepping", "flags", "Features",
              "CPU implementer", "CPU architecture", "CPU variant", "CPU part")  # fmt: skip


class Unavailable(RuntimeError):
    """Why a kernel cannot stand in for torch's here (no compiler, another CPU, another build)."""


def build(source: str, name: str, extra: tuple[str, ...] = ()) -> ctypes.CDLL:
    """C `source` compiled with FLAGS (and `extra`) by $CC (default cc) into a shared library,
    loaded: the cache's build where there is one, else built (and kept there). Unavailable (one
    line) where no compiler builds it."""
    cc, args = os.environ.get("CC", "cc"), [*FLAGS, *extra]
    kept = _cached(source, name, cc, args)
    if kept is not None and kept.is_file():
        try:
            return ctypes.CDLL(str(kept))
        except OSError:
            pass  # unreadable: built again, and replaced
    with tempfile.TemporaryDirectory(prefix=f"megatrain-{name}-") as d:
        src, lib = os.path.join(d, f"{name}.c"), os.path.join(d, f"{name}.so")
        with open(src, "w") as f:
            f.write(source)
        try:
            done = subprocess.run([cc, *args, "-o", lib, src], capture_output=True, text=True, timeout=120)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise Unavailable(f"no C compiler ({cc}: {e})") from None
        if done.returncode:
            raise Unavailable(f"{cc} failed: {done.stderr.strip()[-300:]}")
        if kept is not None and _keep(lib, kept):
            return ctypes.CDLL(str(kept))
        return ctypes.CDLL(lib)


def cache_dir() -> Path | None:
    """Where builds are kept (None: nowhere)."""
    env = os.environ.get("MEGATRAIN_KERNEL_CACHE")
    if env is not None:
        return Path(env) if env else None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base, "megatrain", "kernels") if os.path.isabs(base) else None  # no home: none


def _cached(source: str, name: str, cc: str, args: list[str]) -> Path | None:
    """The cache's path for this build, or None where there is no cache or the compiler or the
    CPU cannot be told (then it is built as if there were no cache)."""
    where = cache_dir()
    if where is None:
        return None
    try:
        version = subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout
        first = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except (OSError, subprocess.TimeoutExpired):
        return None
    cpu = [line for line in first.splitlines() if line.split(":")[0].strip() in CPU_FIELDS]
    if not cpu:
        return None
    key = json.dumps([source, cc, args, version, cpu, platform.machine()])
    return where / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:32]}.so"


def _keep(lib: str, kept: Path) -> bool:
    """Copy the built library to `kept` whole (a temporary name, then renamed: a process that
    loads it meanwhile finds the whole file or none); False where it cannot be written."""
    try:
        kept.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{kept.name}.", dir=kept.parent)
        os.close(fd)
        try:
            shutil.copyfile(lib, tmp)
            os.replace(tmp, kept)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError:
        return False
    return True
