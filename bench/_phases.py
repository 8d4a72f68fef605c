"""Peak GPU memory in each phase of a training step, measured by wrapping the engine's phases:
the figures the plan's per-phase prediction (placement.phase_peaks) is put beside, by
memory.py's runs and by bench.py's and multigpu.py's megatrain workers.
"""

from __future__ import annotations


def instrument_phases(engine) -> tuple[dict[str, int], dict[int, int], dict[str, int]]:
    """Peak allocated GPU memory within each phase of a step (forward sweep, loss head, backward
    sweep, and the embedding's gradient within it), and within the backward sweep while each unit
    is differentiated (from its gradient buffer's allocation to the next unit's, by unit index),
    by resetting the allocator's peak at each boundary; a phase that encloses another takes the
    peak of each of its stretches. Both dicts fill as the run goes: a run that dies keeps them,
    and the phase it died in (`failed_in`). The resets clear the reserve's peak too, so the third
    dict keeps it across them (`reserved`: the largest of each stretch's peak so far) and the
    host's high-water mark (VmHWM) as each phase ended (`host_hwm_after_<phase>`, the largest
    seen): where the host's peak was reached."""
    import torch

    from megatrain.planning.memory import status_bytes

    peaks: dict[str, int] = {}
    units: dict[int, int] = {}
    open_phases: list[str] = []
    current: list[int | None] = [None]  # the unit being differentiated
    reserve = {"reserved": 0}

    def note() -> None:
        reserve["reserved"] = max(reserve["reserved"], torch.cuda.max_memory_reserved())
        now = torch.cuda.max_memory_allocated()
        for n in open_phases:
            peaks[n] = max(peaks.get(n, 0), now)
        if current[0] is not None:
            units[current[0]] = max(units.get(current[0], 0), now)

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
                key = f"host_hwm_after_{name}"
                reserve[key] = max(reserve.get(key, 0), status_bytes("VmHWM") or 0)
                open_phases.pop()
                current[0] = None

        return inner

    grad_buffer = engine._grad_buffer

    def unit_starts(unit, *names):
        note()
        torch.cuda.reset_peak_memory_stats()
        current[0] = unit.index if "backward" in open_phases else None
        return grad_buffer(unit, *names)

    for name, attr in (
        ("forward", "_forward_sweep"),
        ("head", "_head_loss_backward"),
        ("backward", "_backward_sweep"),
        ("embedding", "_embedding_backward"),
    ):
        setattr(engine, attr, wrap(name, getattr(engine, attr)))
    engine._grad_buffer = unit_starts
    return peaks, units, reserve
