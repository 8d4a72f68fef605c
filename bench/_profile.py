"""GPU occupancy of one training step, from the CUDA profiler's trace.

The union of kernel intervals on the busiest stream (the compute stream) over the step's wall
time says how much of a step the GPU computed; the same on all streams, and for each copy
direction, says what ran beside it. One step only: the profiler is too heavy to leave on.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by a set of (start, end) intervals, overlaps counted once."""
    total, cur_a, cur_b = 0.0, None, None
    for a, b in sorted(intervals):
        if cur_b is None or a > cur_b:
            if cur_b is not None:
                total += cur_b - cur_a
            cur_a, cur_b = a, b
        else:
            cur_b = max(cur_b, b)
    if cur_b is not None:
        total += cur_b - cur_a
    return total


def busy_from_trace(trace: dict, wall_s: float) -> dict[str, Any]:
    """GPU occupancy of one step from a Chrome trace (kineto): the union of kernel intervals on the
    busiest stream (the compute stream), on all streams, and of each copy direction, over wall."""
    kernels: dict[Any, list[tuple[float, float]]] = defaultdict(list)
    h2d, d2h = [], []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, name = str(ev.get("cat", "")).lower(), str(ev.get("name", ""))
        iv = (float(ev["ts"]) * 1e-6, (float(ev["ts"]) + float(ev["dur"])) * 1e-6)  # us -> s
        if cat == "kernel":
            kernels[(ev.get("args") or {}).get("stream", ev.get("tid"))].append(iv)
        elif cat == "gpu_memcpy" and "HtoD" in name:
            h2d.append(iv)
        elif cat == "gpu_memcpy" and "DtoH" in name:
            d2h.append(iv)
    if not kernels:
        return {"gpu_busy": None, "gpu_busy_note": "profiler recorded no kernels (CUPTI unavailable?)"}
    per_stream = {s: union_s(iv) for s, iv in kernels.items()}
    compute = max(per_stream, key=per_stream.get)
    every = [iv for ivs in kernels.values() for iv in ivs]
    raw = per_stream[compute] / wall_s
    out = {
        "gpu_busy": min(1.0, raw),
        "gpu_busy_any": min(1.0, union_s(every) / wall_s),
        "h2d_busy": min(1.0, union_s(h2d) / wall_s),
        "d2h_busy": min(1.0, union_s(d2h) / wall_s),
        "profiled_step_s": wall_s,
        "gpu_busy_note": f"stream {compute} of {len(kernels)} with kernels; {len(every)} kernels",
    }
    if raw > 1.05:  # timestamps and wall clock disagree: say so rather than hide it
        out["gpu_busy_note"] += f"; raw ratio {raw:.2f} clipped to 1"
    return out


def profile_busy(run_step: Callable[[], None]) -> dict[str, Any]:
    """Run one step (always exactly once) under the CUDA profiler. A failure of the step itself
    propagates; a failure of the profiler only nulls the result."""
    prof, note = None, None
    if not torch.cuda.is_available():
        note = "no CUDA"
    else:
        try:
            from torch.profiler import ProfilerActivity, profile

            prof = profile(activities=[ProfilerActivity.CUDA])
            prof.__enter__()
        except Exception as e:
            prof, note = None, f"profiler failed to start: {e!r}"[:300]
    try:
        t0 = time.perf_counter()
        run_step()
        wall = time.perf_counter() - t0
    finally:
        if prof is not None:
            try:
                prof.__exit__(None, None, None)
            except Exception as e:
                prof, note = None, f"profiler failed to stop: {e!r}"[:300]
    if prof is None:
        return {"gpu_busy": None, "gpu_busy_note": note}
    try:
        with tempfile.TemporaryDirectory() as d:
            path = os.path.join(d, "trace.json")
            prof.export_chrome_trace(path)
            with open(path) as f:
                return busy_from_trace(json.load(f), wall)
    except Exception as e:
        return {"gpu_busy": None, "gpu_busy_note": f"profiler failed: {e!r}"[:300]}


def warm_profiler() -> None:
    """Start CUPTI once on a trivial op, so the profiled step does not pay its first-use cost."""
    if torch.cuda.is_available():
        profile_busy(lambda: torch.ones(1, device="cuda").add_(1).cpu())
