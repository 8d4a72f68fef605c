"""bench/steptrace.py: a kept step trace read back (streams, the compute stream's idle ends, the
timeline, and copies held up behind other streams' copies)."""

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))

import steptrace as bench_trace  # noqa: E402

MS = 1000.0  # trace times are in microseconds


def _gpu(cat, name, start_ms, dur_ms, stream, corr=None):
    args = {"stream": stream}
    if corr is not None:
        args["correlation"] = corr
    return {"ph": "X", "cat": cat, "name": name, "ts": start_ms * MS, "dur": dur_ms * MS, "args": args}


def _call(name, at_ms, corr):
    return {
        "ph": "X",
        "cat": "cuda_runtime",
        "name": name,
        "ts": at_ms * MS,
        "dur": 10,
        "tid": 1,
        "args": {"correlation": corr},
    }


@pytest.fixture
def events():
    return [
        _call("cudaLaunchKernel", 0, 1),
        _gpu("kernel", "fwd", 20, 60, stream=7, corr=1),  # compute: 20-80 ms, then 100-150
        _gpu("kernel", "bwd", 100, 50, stream=7),
        _call("cudaMemcpyAsync", 0, 2),
        _gpu("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 0, 100, stream=53, corr=2),  # write-back
        _call("cudaMemcpyAsync", 10, 3),
        _gpu("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 100, 10, stream=49, corr=3),  # held up
        _call("cudaMemcpyAsync", 0, 4),
        _gpu("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 50, 10, stream=45, corr=4),  # own direction free
        _call("cudaMemcpyAsync", 150, 5),
        _gpu("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 155, 5, stream=7, corr=5),  # 5 ms: not late
    ]


def test_summary_reads_each_stream_and_the_compute_streams_idle_ends(events):
    s = bench_trace.summary(events)
    assert s["span_ms"] == pytest.approx(160.0)
    assert s["compute_stream"] == 7
    # the tail: from the last kernel (150 ms) to the stream's closing copy (the norm's read, 160)
    assert s["idle_head_ms"] == pytest.approx(20.0) and s["idle_tail_ms"] == pytest.approx(10.0)
    assert bench_trace.summary(events[:-1])["idle_tail_ms"] == pytest.approx(0.0)
    rows = {(r["kind"], r["stream"]): r for r in s["streams"]}
    assert rows[("kernel", 7)]["busy_ms"] == pytest.approx(110.0) and rows[("kernel", 7)]["events"] == 2
    assert rows[("gpu_memcpy", 53)]["last_ms"] == pytest.approx(100.0)


def test_timeline_shares_each_bin(events):
    rows = bench_trace.timeline(events, 50.0, [("kernel", 7), ("gpu_memcpy", 53)])
    assert len(rows) == 4  # 0-50, 50-100, 100-150, 150-160
    assert rows[0] == pytest.approx([0.6, 1.0]) and rows[1] == pytest.approx([0.6, 1.0])
    assert rows[2] == pytest.approx([1.0, 0.0]) and rows[3] == pytest.approx([0.0, 0.0])


def test_blocked_copies_are_those_behind_another_streams_copies_of_their_direction(events):
    (c,) = bench_trace.blocked_copies(events, late_ms=20.0)
    assert (c["stream"], c["queued_ms"], c["ran_ms"], c["behind"]) == (49, 10.0, 100.0, [53])
    # the host->device copy waited 50 ms with its own direction free: not held up by another stream
    assert bench_trace.blocked_copies(events, late_ms=100.0) == []


def test_fetch_launches_list_large_host_to_device_copies_by_launch(events):
    more = [
        _call("cudaMemcpyAsync", 30, 6),
        _gpu("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 70, 5, stream=45, corr=6),
        _gpu("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 90, 5, stream=45),  # no launching call
    ]
    for e in events + more:
        if e["name"].startswith("Memcpy HtoD"):
            e["args"]["bytes"] = 2e8
    rows = bench_trace.fetch_launches(events + more, min_bytes=1e8)
    assert [(r["launched_ms"], r["ran_ms"], r["since_ms"]) for r in rows] == [
        (0.0, 50.0, 0.0),
        (30.0, 70.0, 30.0),
    ]
    assert bench_trace.fetch_launches(events + more, min_bytes=3e8) == []


def test_main_reads_a_gzipped_trace(tmp_path, events, capsys):
    path = tmp_path / "step.trace.json.gz"
    next(e for e in events if e["name"].startswith("Memcpy HtoD"))["args"]["bytes"] = 2e8
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": events + [{"ph": "i", "name": "marker", "ts": 0}]}, f)
    out = bench_trace.main([str(path), "--bin", "50"])
    assert out["idle_head_ms"] == pytest.approx(20.0) and len(out["blocked_copies"]) == 1
    printed = capsys.readouterr().out
    assert "behind stream(s) [53]" in printed
    assert [(r["launched_ms"], r["ran_ms"]) for r in out["fetches"]] == [(0.0, 50.0)]
    assert "0.20 GB launched at     0.0 ms (+  0.0), ran at    50.0" in printed
