"""Peak GPU memory in each phase of a training step, measured by wrapping the engine's phases:
the figures the plan's per-phase prediction (placement.phase_peaks) is put beside, by
memory.py's runs and by bench.py's and multigpu.py's megatrain workers.
"""

from __future__ import annotations


def instrument_phases(engine) -> dict[str, int]:
    """Peak allocated GPU memory within each phase of a step (forward sweep, loss head, backward
    sweep, and the embedding's gradient within it), by resetting the allocator's peak at each
    phase's start; a phase that encloses another takes the peak of each of its stretches."""
    import torch

    peaks: dict[str, int] = {}
    open_phases: list[str] = []

    def note() -> None:
        for n in open_phases:
            peaks[n] = max(peaks.get(n, 0), torch.cuda.max_memory_allocated())

    def wrap(name: str, fn):
        def inner(*a, **kw):
            note()
            torch.cuda.reset_peak_memory_stats()
            open_phases.append(name)
            try:
                return fn(*a, **kw)
            except BaseException:
                peaks.setdefault("failed_in", name)  # the (innermost) phase a run that died was in
                raise
            finally:
                note()
                open_phases.pop()

        return inner

    for name, attr in (
        ("forward", "_forward_sweep"),
        ("head", "_head_loss_backward"),
        ("backward", "_backward_sweep"),
        ("embedding", "_embedding_backward"),
    ):
        setattr(engine, attr, wrap(name, getattr(engine, attr)))
    return peaks
