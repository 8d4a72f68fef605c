"""Which process a file megatrain leaves on disk while it works belongs to, and whether that
process still runs: the lock a run holds on its output_dir, and the marker inside a directory
being written (writing.AtomicDir), so a later process can tell a dead writer's leftovers from
work in progress.

* **The run's lock**, `output_dir/.megatrain.lock`, is created with O_CREAT|O_EXCL (one process
  wins, on a local disk or NFS) and holds its owner: pid, host, start time. A second run into
  the same output_dir is refused naming the first. A lock whose process is gone (same host, the
  pid not running, or running as another process since: its start time differs) is taken over
  with a note; a lock from another host cannot be checked, so it is refused with the command
  that removes it. In a data-parallel world only the writing rank takes it. It is released when
  the run ends, however it ends; a killed run's lock is found stale by the next run.
* **The marker** `.megatrain-partial` holds the writer's owner too; a temporary directory with
  one whose owner is dead is megatrain's, and may be deleted.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from ..errors import OutputError

LOCK = ".megatrain.lock"
MARKER = ".megatrain-partial"
READ_PATIENCE_S = 2.0  # a lock is written just after it is created: an empty one may be in the making
TAKE_OVER_TRIES = 5


def _start_ticks(pid: int) -> int | None:
    """When process `pid` started (clock ticks since boot, /proc/PID/stat's 22nd field), so a
    pid reused by another process is not mistaken for the owner; None where there is no /proc."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return int(stat.rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


@dataclass(frozen=True)
class Owner:
    """A process of a host, as megatrain records it in a lock or marker."""

    pid: int
    host: str
    started: str
    """Local time the owner started working, for the user."""
    ticks: int | None = None
    """The process's start in clock ticks since boot (Linux), None where unknown."""

    @classmethod
    def me(cls) -> Owner:
        return cls(
            os.getpid(), socket.gethostname(), time.strftime("%Y-%m-%d %H:%M:%S"), _start_ticks(os.getpid())
        )

    def to_json(self) -> str:
        return json.dumps(asdict(self)) + "\n"

    @classmethod
    def from_json(cls, text: str) -> Owner | None:
        """The owner a lock or marker records; None for anything megatrain did not write."""
        try:
            raw = json.loads(text)
            owner = cls(**raw)
        except (ValueError, TypeError):
            return None
        ok = isinstance(owner.pid, int) and isinstance(owner.host, str) and isinstance(owner.started, str)
        return owner if ok and (owner.ticks is None or isinstance(owner.ticks, int)) else None

    def alive(self) -> bool | None:
        """Whether the owner still runs; None when it runs on another host (cannot be checked)."""
        if self.host != socket.gethostname():
            return None
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass  # another user's process: it exists
        now = _start_ticks(self.pid)
        return self.ticks is None or now is None or now == self.ticks

    def __str__(self) -> str:
        return f"pid {self.pid} on {self.host}, started {self.started}"


# ---------------------------------------------------------------------------- the run's lock
class RunLock:
    """`with RunLock(output_dir) as lock:` makes output_dir this process's until the block ends
    (module docstring); `lock.note` says whether a dead run's lock was taken over. Creates
    output_dir (and missing parents), and removes those it created if they are left empty.
    Raises OutputError (one line) when another run holds it or it cannot be written."""

    def __init__(self, output_dir: str | Path):
        self.dir = Path(output_dir)
        self.path = self.dir / LOCK
        self.owner = Owner.me()
        self.note: str | None = None
        self._made: list[Path] = []
        self._held = False

    def __enter__(self) -> RunLock:
        self._make_dirs()
        try:
            self._acquire()
        except BaseException:
            self._remove_made()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.release()

    def _make_dirs(self) -> None:
        missing = []
        d = Path(os.path.abspath(self.dir))
        while not d.exists() and d != d.parent:
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            try:
                d.mkdir()
            except FileExistsError:
                continue  # made meanwhile by someone else: not ours to remove
            except OSError as e:
                self._remove_made()
                raise OutputError(f"output_dir: cannot create {d}: {e.strerror}") from None
            self._made.append(d)

    def _acquire(self) -> None:
        for _ in range(TAKE_OVER_TRIES):
            try:
                fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            except FileExistsError:
                self._take_over_stale()  # raises while a live run holds it
                continue
            except OSError as e:
                raise OutputError(f"output_dir: cannot write in {self.dir}: {e.strerror}") from None
            try:
                os.write(fd, self.owner.to_json().encode())
                os.fsync(fd)
            except OSError as e:
                os.close(fd)
                os.unlink(self.path)
                raise OutputError(f"output_dir: cannot write {self.path}: {e.strerror}") from None
            os.close(fd)
            self._held = True
            return
        raise OutputError(f"output_dir: {self.path} keeps changing hands; is another run starting there?")

    def _take_over_stale(self) -> None:
        """Delete the lock at self.path if its owner is gone (setting self.note), else refuse.
        The check and the delete happen under an flock of the lock file, and only if the path
        still names that file: two runs finding one stale lock cannot delete each other's."""
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except FileNotFoundError:
            return  # released meanwhile: try again
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            if not _names(self.path, fd):
                return  # taken over (or released) by another process meanwhile: try again
            owner = _read_owner(fd)
            if owner is None:
                raise OutputError(
                    f"output_dir: {self.path} is not a lock megatrain can read; if no run is using "
                    f"{self.dir}, delete it and start again"
                )
            alive = owner.alive()
            if alive is None:
                raise OutputError(
                    f"output_dir: {self.dir} is in use by a run on another host ({owner}); if that run "
                    f"has ended, delete {self.path} and start again"
                )
            if alive:
                raise OutputError(
                    f"output_dir: {self.dir} is in use by another run ({owner}); wait for it to end or "
                    "choose another output_dir"
                )
            os.unlink(self.path)
            self.note = (
                f"megatrain: took over {self.path} from a run that ended without releasing it ({owner})"
            )
        finally:
            os.close(fd)  # and its flock

    def release(self) -> None:
        """Delete the lock if it is still this process's, then the directories it created if
        they are empty."""
        if self._held:
            self._held = False
            with contextlib.suppress(OSError):
                fd = os.open(self.path, os.O_RDONLY)
                try:
                    if _names(self.path, fd) and _read_owner(fd, patience=0) == self.owner:
                        os.unlink(self.path)
                finally:
                    os.close(fd)
        self._remove_made()

    def _remove_made(self) -> None:
        while self._made:
            try:
                self._made.pop().rmdir()
            except OSError:
                self._made.clear()  # not empty: this run wrote there, or someone else did
                return


def _names(path: Path, fd: int) -> bool:
    """Whether `path` is still the file open as `fd`."""
    try:
        st, now = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_ino, st.st_dev) == (now.st_ino, now.st_dev)


def _read_owner(fd: int, patience: float = READ_PATIENCE_S) -> Owner | None:
    """The owner recorded in the open file `fd`, waiting up to `patience` seconds for a file
    that is still being written."""
    deadline = time.monotonic() + patience
    while True:
        owner = Owner.from_json(os.pread(fd, 4096, 0).decode(errors="replace"))
        if owner is not None or time.monotonic() >= deadline:
            return owner
        time.sleep(0.05)


# ---------------------------------------------------------------------------- markers
def mark(directory: Path) -> None:
    """Record this process as the writer of `directory` (a temporary one, before anything else)."""
    (directory / MARKER).write_text(Owner.me().to_json())


def unmark(directory: Path) -> None:
    """The directory is complete: it is no longer a temporary of this process."""
    (directory / MARKER).unlink(missing_ok=True)


def abandoned(directory: Path) -> bool:
    """Whether `directory` is a temporary that megatrain marked and whose writer is gone (on
    this host: a writer elsewhere cannot be checked, so its directory is never called abandoned)."""
    try:
        owner = Owner.from_json((directory / MARKER).read_text(errors="replace"))
    except OSError:
        return False
    return owner is not None and owner.alive() is False
