"""Read a profiled step's trace (`bench.py --trace`): what each GPU stream did over the step.

`bench.py --trace` keeps the one profiled steady-state step of each megatrain run as a gzipped
Chrome trace (kineto) beside its log. This prints, from such a trace:

* each stream's kernels and copies: how many, when the first began and the last ended, and
  their busy time;
* the step's two ends: how long the compute stream waited before its first kernel, and after its
  last one until its last copy (the step's closing read of the gradient norm: its idle tail;
  what follows in the trace is the profiler's own synchronisation);
* a timeline in bins of `--bin` ms: the share of each bin each stream was busy;
* copies held up by another stream's: each copy that began more than `--late` ms after it was
  queued while the copy engine of its direction was busy with other streams' copies (the way
  device->host copies queue behind whatever that direction was given before them, whatever stream
  each is on);
* the large host->device copies in the order they were launched (`--fetches`, at least
  `--fetch-bytes`): when the launching thread issued each, the time since the one before, and
  when it ran. A host-stepped unit's fetch is issued once the host optimizer has stepped it, so in
  the forward sweep these launch times are the host AdamW's pace, unit by unit.

    python bench/steptrace.py bench/results/..._logs/megatrain-host_16384.trace.json.gz --bin 50
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from typing import Any

GPU = ("kernel", "gpu_memcpy", "gpu_memset")
HOST = ("cuda_runtime", "cuda_driver")


def load(path: str) -> list[dict]:
    """The trace's complete events (those with a duration)."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    return [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]


def _ms(us: float) -> float:
    return us / 1e3


def streams(events: list[dict]) -> dict[tuple[str, Any], list[dict]]:
    """The GPU events by (category, stream)."""
    out: dict[tuple[str, Any], list[dict]] = defaultdict(list)
    for e in events:
        if e.get("cat") in GPU:
            out[(e["cat"], (e.get("args") or {}).get("stream"))].append(e)
    return out


def summary(events: list[dict]) -> dict[str, Any]:
    """Each stream's events, first start, last end and busy time (ms from the trace's start), and
    the compute stream's idle head and tail (the stream with the most kernel time)."""
    t0 = min(e["ts"] for e in events)
    end = max(e["ts"] + e["dur"] for e in events)
    rows = []
    for (cat, stream), evs in streams(events).items():
        rows.append(
            {
                "kind": cat,
                "stream": stream,
                "events": len(evs),
                "first_ms": _ms(min(e["ts"] for e in evs) - t0),
                "last_ms": _ms(max(e["ts"] + e["dur"] for e in evs) - t0),
                "busy_ms": _ms(sum(e["dur"] for e in evs)),
            }
        )
    rows.sort(key=lambda r: -r["busy_ms"])
    kernels = [r for r in rows if r["kind"] == "kernel"]
    if not kernels:
        return {"span_ms": _ms(end - t0), "streams": rows, "compute_stream": None}
    compute = kernels[0]
    closing = max(r["last_ms"] for r in rows if r["stream"] == compute["stream"])
    return {
        "span_ms": _ms(end - t0),
        "streams": rows,
        "compute_stream": compute["stream"],
        "idle_head_ms": compute["first_ms"],
        "idle_tail_ms": closing - compute["last_ms"],
    }


def timeline(events: list[dict], bin_ms: float, keys: list[tuple[str, Any]]) -> list[list[float]]:
    """For each bin of `bin_ms` from the trace's start, the share of it each of `keys` was busy."""
    t0 = min(e["ts"] for e in events)
    n = int(_ms(max(e["ts"] + e["dur"] for e in events) - t0) // bin_ms) + 1
    by = streams(events)
    out = [[0.0] * len(keys) for _ in range(n)]
    width = bin_ms * 1e3
    for j, key in enumerate(keys):
        for e in by.get(key, []):
            a, b = e["ts"] - t0, e["ts"] + e["dur"] - t0
            i = int(a // width)
            while i < n and i * width < b:
                out[i][j] += (min(b, (i + 1) * width) - max(a, i * width)) / width
                i += 1
    return out


def _direction(name: str) -> str | None:
    return next((d for d in ("HtoD", "DtoH") if d in name), None)


def _launching_calls(events: list[dict]) -> dict[Any, dict]:
    """The host's CUDA calls by correlation id: the call that queued each GPU event."""
    calls = {}
    for e in events:
        corr = (e.get("args") or {}).get("correlation")
        if e.get("cat") in HOST and corr is not None:
            calls[corr] = e
    return calls


def blocked_copies(events: list[dict], late_ms: float, share: float = 0.9) -> list[dict[str, Any]]:
    """Copies that waited behind another stream's copies of the same direction: queued more than
    `late_ms` before they ran, the copy engine of their direction busy with other streams for at
    least `share` of that wait (the launching calls matched by the trace's correlation ids). In
    the order they ran, with the streams that held them up."""
    t0 = min(e["ts"] for e in events)
    calls = _launching_calls(events)
    copies = [e for e in events if e.get("cat") == "gpu_memcpy" and _direction(e["name"])]
    out = []
    for e in sorted(copies, key=lambda e: e["ts"]):
        args = e.get("args") or {}
        call = calls.get(args.get("correlation"))
        if call is None or _ms(e["ts"] - call["ts"]) <= late_ms:
            continue
        a, b, stream, way = call["ts"], e["ts"], args.get("stream"), _direction(e["name"])
        held: dict[Any, float] = defaultdict(float)
        for o in copies:
            other = (o.get("args") or {}).get("stream")
            if other != stream and _direction(o["name"]) == way:
                overlap = min(b, o["ts"] + o["dur"]) - max(a, o["ts"])
                if overlap > 0:
                    held[other] += overlap
        if sum(held.values()) < share * (b - a):
            continue
        out.append(
            {
                "name": e["name"],
                "stream": stream,
                "bytes": args.get("bytes"),
                "queued_ms": _ms(a - t0),
                "ran_ms": _ms(b - t0),
                "dur_ms": _ms(e["dur"]),
                "behind": sorted(held, key=lambda k: -held[k]),
            }
        )
    return out


def fetch_launches(events: list[dict], min_bytes: float) -> list[dict[str, Any]]:
    """The host->device copies of at least `min_bytes`, in the order they were launched: each
    one's bytes, launch and run times (ms from the trace's start) and the time since the launch
    before it."""
    t0 = min(e["ts"] for e in events)
    calls = _launching_calls(events)
    rows = []
    for e in events:
        args = e.get("args") or {}
        call = calls.get(args.get("correlation"))
        big = (args.get("bytes") or 0) >= min_bytes
        if e.get("cat") == "gpu_memcpy" and _direction(e["name"]) == "HtoD" and call is not None and big:
            rows.append(
                {"bytes": args["bytes"], "launched_ms": _ms(call["ts"] - t0), "ran_ms": _ms(e["ts"] - t0)}
            )
    rows.sort(key=lambda r: r["launched_ms"])
    for prev, r in zip([None, *rows], rows):
        r["since_ms"] = r["launched_ms"] - prev["launched_ms"] if prev else 0.0
    return rows


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="a trace kept by bench.py --trace (.json or .json.gz)")
    ap.add_argument("--bin", type=float, default=50.0, help="timeline bin, ms (default 50)")
    ap.add_argument(
        "--late", type=float, default=20.0, help="report copies queued this many ms before they ran"
    )
    ap.add_argument("--fetches", type=int, default=12, help="how many large host->device copies to list")
    ap.add_argument("--fetch-bytes", type=float, default=1e8, help="the least bytes of those (default 1e8)")
    a = ap.parse_args(argv)
    events = load(a.trace)
    s = summary(events)
    if s["compute_stream"] is None:
        print(f"trace span {s['span_ms']:.1f} ms; no kernels")
        return s
    print(
        f"trace span {s['span_ms']:.1f} ms; compute stream {s['compute_stream']}: idle "
        f"{s['idle_head_ms']:.1f} ms before its first kernel, {s['idle_tail_ms']:.1f} ms after its "
        "last until its last copy"
    )
    print(f"{'kind':<11} {'stream':>6} {'events':>7} {'first ms':>9} {'last ms':>9} {'busy ms':>9}")
    for r in s["streams"]:
        print(
            f"{r['kind']:<11} {r['stream']!s:>6} {r['events']:>7} {r['first_ms']:>9.1f} "
            f"{r['last_ms']:>9.1f} {r['busy_ms']:>9.1f}"
        )
    keys = [(r["kind"], r["stream"]) for r in s["streams"] if r["busy_ms"] > 1.0]
    print("\nbusy share per bin (" + ", ".join(f"{k[:6]}/{st}" for k, st in keys) + ")")
    for i, row in enumerate(timeline(events, a.bin, keys)):
        print(f"{i * a.bin:7.0f} ms  " + "  ".join(f"{x:4.0%}" for x in row))
    blocked = blocked_copies(events, a.late)
    print(f"\ncopies held up over {a.late:g} ms behind other streams' copies: {len(blocked)}")
    for c in blocked:
        print(
            f"  stream {c['stream']}: {c['name']}, {c['bytes']} B, queued at {c['queued_ms']:.1f} ms, "
            f"ran at {c['ran_ms']:.1f} for {c['dur_ms']:.1f} ms, behind stream(s) {c['behind']}"
        )
    fetches = fetch_launches(events, a.fetch_bytes)
    print(
        f"\nthe first {min(a.fetches, len(fetches))} of {len(fetches)} host->device copies of {a.fetch_bytes:g} B or more, by launch"
    )
    for r in fetches[: a.fetches]:
        print(
            f"  {r['bytes'] / 1e9:6.2f} GB launched at {r['launched_ms']:7.1f} ms "
            f"(+{r['since_ms']:5.1f}), ran at {r['ran_ms']:7.1f}"
        )
    return {**s, "blocked_copies": blocked, "fetches": fetches}


if __name__ == "__main__":
    main()
