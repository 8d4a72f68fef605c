"""`megatrain train CONFIG nproc_per_node=N`: start N training processes on this machine (N x M
with `nnodes=M`, the processes of M simulated machines).

The processes are started and watched by torch.distributed's own launcher (what `torchrun
--standalone --nproc-per-node N -m megatrain train CONFIG` runs): a rendezvous on a free local
port, RANK / LOCAL_RANK / WORLD_SIZE for each process, and when one process fails, the others are
stopped (SIGTERM, then SIGKILL) and the failure is reported here as one line.

Signals: the training processes run in sessions of their own (the launcher starts them so),
out of reach of the terminal. SIGTERM or SIGINT (Ctrl-C) sent to this process is passed on to
every one of them, so they behave as one process does: the first makes them finish their step,
save a checkpoint together and exit 143 / 130, a second aborts them at once (guard.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from pathlib import Path

from ..errors import MegatrainError


class LaunchError(MegatrainError):
    """A training process of a data-parallel world failed."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def launch(config: str, overrides: list[str], nproc: int) -> int:
    """Run `megatrain train config overrides` in `nproc` processes; 0 when all succeed, else
    raises LaunchError naming the first process that failed (its exit code is the launcher's)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    # The optimizer of each process gets its share of the cores (torchrun would say 1).
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    # Its log lines (rendezvous, "closing signal", a failure's table) are not the user's: a
    # failure is one line below. Each of its modules' loggers has a level of its own.
    for name in list(logging.root.manager.loggerDict):
        if name.startswith("torch.distributed"):
            logging.getLogger(name).setLevel(logging.CRITICAL)
    args = get_args_parser().parse_args(
        [
            "--standalone",
            f"--nproc-per-node={nproc}",
            "--monitor-interval=0.5",
            "--signals-to-handle=SIGHUP,SIGQUIT",  # SIGTERM, SIGINT: below
            "--no-python",
            sys.executable,
            "-m",
            "megatrain",
            "train",
            config,
            *overrides,
        ]
    )
    previous = {s: signal.signal(s, _pass_on) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        run(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode in (130, 143):  # stopped by a signal, checkpoint saved: rank 0 said so
            return failure.exitcode
        if failure.exitcode < 0:
            what, code = f"was killed by {failure.signal_name()}", 128 - failure.exitcode
        else:
            what, code = f"exited with code {failure.exitcode}", failure.exitcode
        raise LaunchError(
            f"rank {rank} of {nproc} (pid {failure.pid}) {what}; the other ranks were stopped", code
        ) from None
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
    return 0


def _pass_on(signum: int, frame) -> None:
    """Send `signum` to the training processes."""
    for pid in children(os.getpid()):
        with contextlib.suppress(ProcessLookupError):  # gone meanwhile
            os.kill(pid, signum)


def children(parent: int) -> list[int]:
    """The processes whose parent is `parent` (the training processes of a launcher)."""
    out = []
    for p in Path("/proc").iterdir():
        try:
            if p.name.isdigit() and int((p / "stat").read_text().rsplit(")", 1)[1].split()[1]) == parent:
                out.append(int(p.name))
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
    return out
