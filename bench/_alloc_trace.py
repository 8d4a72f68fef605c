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


def releases(trace: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each run of consecutive release events in one device's trace (`device_traces[i]` of
    `torch.cuda.memory._snapshot()`), with the bytes released and the first allocation after it
    (`size`, `stream`, `where`; None if the trace ends first)."""
    out: list[dict[str, Any]] = []
    current: dict[str, Any] | None = None
    for ev in trace:
        action = ev.get("action")
        if action in RELEASE:
            if current is None:
                current = {"released_bytes": 0, "releases": 0, "then": None}
                out.append(current)
            current["released_bytes"] += int(ev.get("size", 0))
            current["releases"] += 1
        elif action == "alloc" and current is not None:
            current["then"] = {
                "size": int(ev.get("size", 0)),
                "stream": ev.get("stream"),
                "where": _where(ev.get("frames", [])),
            }
            current = None
    return out


def traced_step(run_step: Callable[[], Any]) -> list[dict[str, Any]]:
    """Run one step (exactly once) with the allocator's history recorded; its releases."""
    import torch

    torch.cuda.memory._record_memory_history(max_entries=MAX_ENTRIES, stacks="python")
    try:
        run_step()
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    device = torch.cuda.current_device()
    return releases(snapshot["device_traces"][device])
