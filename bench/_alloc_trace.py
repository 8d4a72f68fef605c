"""Where the CUDA caching allocator gives memory back to the device inside a step, and why.

A request the allocator's cache cannot serve makes it map more device memory; where the device
has none left it frees cached blocks (synchronising the device) and tries again, which
`torch.cuda.memory_stats()["num_alloc_retries"]` counts. `traced_step` runs one step with the
allocator's history recorded; `releases` reads the history: each run of blocks given back to the
device, how much, and the request that followed it (its size, stream and the first frame of this
project's code that made it), so a retry can be put on the line that caused it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

RELEASE = ("segment_free", "segment_unmap")  # memory given back to the device
GROW = ("segment_alloc", "segment_map")  # memory taken from the device
MAX_ENTRIES = 2_000_000  # events kept by the recorder; a 64k-token 8B step makes ~10^5


def _where(frames: list[dict]) -> str:
    """The innermost frame in this project's code (megatrain/ or bench/), else the innermost."""
    ours = [f for f in frames if "megatrain/" in f.get("filename", "") or "bench/" in f.get("filename", "")]
    f = (ours or frames or [{}])[0]
    name = f.get("filename", "?")
    for root in ("megatrain/", "bench/"):
        if root in name:
            name = root + name.split(root, 1)[1]
    return f"{name}:{f.get('line', '?')} {f.get('name', '')}".strip()


def _streams(segments: list[dict[str, Any]]) -> tuple[dict[Any, int], dict[Any, int]]:
    """Bytes mapped and bytes allocated on each stream, from a snapshot's segments (an expandable
    segment is reported as one segment per mapped range)."""
    mapped: dict[Any, int] = {}
    allocated: dict[Any, int] = {}
    for seg in segments:
        s = seg.get("stream")
        mapped[s] = mapped.get(s, 0) + int(seg.get("total_size", 0))
        allocated[s] = allocated.get(s, 0) + int(seg.get("allocated_size", 0))
    return mapped, allocated


def releases(
    trace: list[dict[str, Any]],
    segments: list[dict[str, Any]] | None = None,
    names: dict[Any, str] | None = None,
) -> list[dict[str, Any]]:
    """Each run of consecutive release events in one device's trace (`device_traces[i]` of
    `torch.cuda.memory._snapshot()`), with the bytes released (in all and by stream) and the first
    allocation after it (`size`, `stream`, `where`; None if the trace ends first). Given the
    segments at the trace's start, each run also has `before`: the bytes each stream had mapped
    and allocated when it began, and so held cached. `names` names the streams."""
    names = names or {}

    def label(stream) -> str:
        return names.get(stream, str(stream))

    mapped, allocated = _streams(segments or [])
    out: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for ev in trace:
        action, size, stream = ev.get("action"), int(ev.get("size", 0)), ev.get("stream")
        if action in RELEASE:
            if current is None:
                current = {"released_bytes": 0, "releases": 0, "by_stream": {}, "then": None}
                if segments is not None:
                    held = {
                        s: (m, allocated.get(s, 0)) for s, m in sorted(mapped.items(), key=lambda kv: -kv[1])
                    }
                    current["before"] = {
                        label(s): {"mapped": m, "allocated": a, "cached": m - a} for s, (m, a) in held.items()
                    }
                out.append(current)
            current["released_bytes"] += size
            current["releases"] += 1
            by = current["by_stream"]
            by[label(stream)] = by.get(label(stream), 0) + size
            mapped[stream] = mapped.get(stream, 0) - size
        elif action in GROW:
            mapped[stream] = mapped.get(stream, 0) + size
        elif action == "free_completed":
            allocated[stream] = allocated.get(stream, 0) - size
        elif action == "alloc":
            allocated[stream] = allocated.get(stream, 0) + size
            if current is not None:
                current["then"] = {
                    "size": size,
                    "stream": label(stream),
                    "where": _where(ev.get("frames", [])),
                }
                current = None
    return out


def traced_step(run_step: Callable[[], Any], names: dict[Any, str] | None = None) -> list[dict[str, Any]]:
    """Run one step (exactly once) with the allocator's history recorded; its releases, with each
    stream's memory when each began (`names`: a name for each stream's handle)."""
    import torch

    device = torch.cuda.current_device()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    try:
        start = [s for s in torch.cuda.memory._snapshot()["segments"] if s.get("device", device) == device]
        run_step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    return releases(snapshot["device_traces"][device], start, names)
