"""Guard rails of the training loop: stopping cleanly on SIGTERM/SIGINT, and skipping steps
whose loss or gradient norm is not finite.

Exit codes (cli.py): a run stopped by a signal after saving its checkpoint exits with
128 + signal number, as a shell reports a process killed by that signal (130 for SIGINT, 143
for SIGTERM): the run did not finish, so `megatrain train ... && megatrain export ...` must not
go on, and schedulers (SLURM requeue, Kubernetes) see the preemption they caused. A second
signal aborts at once with the same code. A diverged run (too many non-finite steps) exits 1;
bad inputs exit 2.
"""

from __future__ import annotations

import math
import signal
import sys
import threading
from collections.abc import Callable

from .errors import MegatrainError


class TrainingInterrupted(MegatrainError):
    """A signal stopped training after the current step; its checkpoint has been saved."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class Aborted(KeyboardInterrupt):
    """A second signal arrived: stop now, without saving (the last checkpoint stays valid)."""

    def __init__(self, signum: int):
        super().__init__(f"received a second {signal.Signals(signum).name}, aborted without saving")
        self.exit_code = 128 + signum


class DivergedError(MegatrainError):
    """Too many consecutive steps with a non-finite loss or gradient norm."""

    exit_code = 1


class SignalGuard:
    """Within `with SignalGuard() as stop:`, the first SIGINT or SIGTERM only sets
    `stop.signum` (the loop finishes its step, saves and raises `stop.interrupted(...)`); a
    second one raises Aborted. Outside the main thread, where Python cannot install handlers,
    it does nothing."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self, notify: Callable[[str], None] | None = None):
        self.signum: int | None = None
        self._old: dict[int, object] = {}
        self._notify = notify or (lambda text: print(text, file=sys.stderr, flush=True))

    def __enter__(self) -> SignalGuard:
        if threading.current_thread() is threading.main_thread():
            for s in self.SIGNALS:
                self._old[s] = signal.signal(s, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        self._restore()

    def _restore(self) -> None:
        for s, handler in self._old.items():
            signal.signal(s, handler)
        self._old.clear()

    def _handle(self, signum: int, frame) -> None:
        if self.signum is not None:
            self._restore()
            raise Aborted(signum)
        self.signum = signum
        self._notify(
            f"megatrain: received {self.name}, finishing the current step and saving a checkpoint "
            "(send it again to abort without saving)"
        )

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum is not None else ""

    def interrupted(self, checkpoint) -> TrainingInterrupted:
        """The exception that ends a run stopped by a signal, once `checkpoint` is saved."""
        return TrainingInterrupted(
            f"received {self.name}, saved {checkpoint.name}; resume with resume_from_checkpoint=true",
            128 + (self.signum or 0),
        )


class NonFiniteGuard:
    """Counts consecutive steps whose loss or gradient norm is NaN or infinite. Such a step is
    skipped by the caller (its gradients dropped, the weights and moments untouched);
    `check_diverged` raises after `limit` in a row."""

    def __init__(self, limit: int, streak: int = 0, warn: Callable[[str], None] = print):
        self.limit, self.streak, self._warn = limit, streak, warn

    def finite(self, step: int, loss: float, grad_norm: float) -> bool:
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.streak = 0
            return True
        self.streak += 1
        self._warn(
            f"megatrain: warning: step {step} has loss {loss} and grad_norm {grad_norm}; skipped it "
            f"({self.streak} in a row, stopping at {self.limit})"
        )
        return False

    def check_diverged(self, step: int) -> None:
        if self.streak >= self.limit:
            raise DivergedError(
                f"step {step}: loss or grad_norm not finite for {self.streak} consecutive steps; training "
                "diverged (lower learning_rate or max_grad_norm, add warmup), then resume from the last "
                "checkpoint with resume_from_checkpoint=true"
            )
