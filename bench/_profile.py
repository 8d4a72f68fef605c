"""GPU occupancy of one training step, from the CUDA profiler's trace.

The union of kernel intervals on the busiest stream (the compute stream) over the step's wall
time says how much of a step the GPU computed; the same on all streams, and for each copy
direction, says what ran beside it. Where the compute stream stood idle (`idle_gaps`): its
longest gaps, when in the step, between which kernels, and how busy each copy direction was
meanwhile. One step only: the profiler is too heavy to leave on. `profile_busy(trace_to=...)`
keeps the trace itself (gzipped Chrome trace: chrome://tracing, Perfetto).
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import torch


def union_s(intervals: list[tuple[float, float]]) -> float:
    """Total length covered by a set of (start, end) intervals, overlaps counted once."""
    return sum(b - a for a, b in merged(intervals))


def merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """The intervals' union as disjoint intervals, in order."""
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def covered(intervals: list[tuple[float, float]], a: float, b: float) -> float:
    """The share of [a, b) that the disjoint, ordered `intervals` cover."""
    if b <= a:
        return 0.0
    return sum(max(0.0, min(b, y) - max(a, x)) for x, y in intervals) / (b - a)


def kernel_label(name: str) -> str:
    """A kernel's name without its return type, namespaces' noise and template arguments."""
    name = name.removeprefix("void ").split("<")[0].split("(")[0]
    return name.rsplit("::", 1)[-1][:60]


def idle_gaps(
    kernels: list[tuple[float, float, str]],
    copies: dict[str, list[tuple[float, float]]],
    top: int = 8,
    least_s: float = 2e-4,
) -> dict[str, Any]:
    """Where the compute stream stood idle between its first and last kernel: the gaps of at least
    `least_s` (their count and seconds), and the `top` longest, each with its start (ms after the
    first kernel), its length (ms), the kernels before and after it, and the share of it each copy
    direction (`copies`: direction -> disjoint intervals) was busy."""
    if not kernels:
        return {"idle_gap_s": 0.0, "idle_gap_count": 0, "idle_gap_least_ms": least_s * 1e3, "idle_gaps": []}
    ordered = sorted(kernels)
    t0, gaps, end, last = ordered[0][0], [], ordered[0][1], ordered[0][2]
    for a, b, name in ordered[1:]:
        if a - end >= least_s:
            gaps.append((end, a, last, name))
        if b >= end:
            end, last = b, name
    longest = sorted(gaps, key=lambda g: g[0] - g[1])[:top]
    return {
        "idle_gap_s": sum(b - a for a, b, _, _ in gaps),
        "idle_gap_count": len(gaps),
        "idle_gap_least_ms": least_s * 1e3,
        "idle_gaps": [
            {
                "at_ms": round((a - t0) * 1e3, 2),
                "ms": round((b - a) * 1e3, 2),
                "before": kernel_label(before),
                "after": kernel_label(after),
                **{k: round(covered(iv, a, b), 2) for k, iv in copies.items()},
            }
            for a, b, before, after in sorted(longest)
        ],
    }


def busy_from_trace(trace: dict, wall_s: float) -> dict[str, Any]:
    """GPU occupancy of one step from a Chrome trace (kineto): the union of kernel intervals on the
    busiest stream (the compute stream), on all streams, and of each copy direction, over wall;
    and the compute stream's idle gaps (`idle_gaps`)."""
    kernels: dict[Any, list[tuple[float, float, str]]] = defaultdict(list)  # stream -> (start, end, name)
    h2d, d2h = [], []
    for ev in trace.get("traceEvents", []):
        if ev.get("ph") != "X" or "dur" not in ev:
            continue
        cat, name = str(ev.get("cat", "")).lower(), str(ev.get("name", ""))
        iv = (float(ev["ts"]) * 1e-6, (float(ev["ts"]) + float(ev["dur"])) * 1e-6)  # us -> s
        if cat == "kernel":
            kernels[(ev.get("args") or {}).get("stream", ev.get("tid"))].append((*iv, name))
        elif cat == "gpu_memcpy" and "HtoD" in name:
            h2d.append(iv)
        elif cat == "gpu_memcpy" and "DtoH" in name:
            d2h.append(iv)
    if not kernels:
        return {"gpu_busy": None, "gpu_busy_note": "profiler recorded no kernels (CUPTI unavailable?)"}
    per_stream = {s: union_s([(a, b) for a, b, _ in ks]) for s, ks in kernels.items()}
    compute = max(per_stream, key=per_stream.get)
    every = [(a, b) for ks in kernels.values() for a, b, _ in ks]
    raw = per_stream[compute] / wall_s
    out = {
        "gpu_busy": min(1.0, raw),
        "gpu_busy_any": min(1.0, union_s(every) / wall_s),
        "h2d_busy": min(1.0, union_s(h2d) / wall_s),
        "d2h_busy": min(1.0, union_s(d2h) / wall_s),
        "profiled_step_s": wall_s,
        "gpu_busy_note": f"stream {compute} of {len(kernels)} with kernels; {len(every)} kernels",
        **idle_gaps(kernels[compute], {"h2d": merged(h2d), "d2h": merged(d2h)}),
    }
    if raw > 1.05:  # timestamps and wall clock disagree: say so rather than hide it
        out["gpu_busy_note"] += f"; raw ratio {raw:.2f} clipped to 1"
    return out


def profile_busy(run_step: Callable[[], None], trace_to: str | None = None) -> dict[str, Any]:
    """Run one step (always exactly once) under the CUDA profiler. A failure of the step itself
    propagates; a failure of the profiler only nulls the result. `trace_to`: where to keep the
    trace, gzipped (its folder is made)."""
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
            if trace_to:
                os.makedirs(os.path.dirname(os.path.abspath(trace_to)), exist_ok=True)
                with open(path, "rb") as src, gzip.open(trace_to, "wb") as dst:
                    shutil.copyfileobj(src, dst)
            with open(path) as f:
                return busy_from_trace(json.load(f), wall)
    except Exception as e:
        return {"gpu_busy": None, "gpu_busy_note": f"profiler failed: {e!r}"[:300]}


def warm_profiler() -> None:
    """Start CUPTI once on a trivial op, so the profiled step does not pay its first-use cost."""
    if torch.cuda.is_available():
        profile_busy(lambda: torch.ones(1, device="cuda").add_(1).cpu())
