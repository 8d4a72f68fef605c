"""bench/_profile.py: GPU occupancy and the compute stream's idle gaps, from a Chrome trace."""

import gzip
import json
import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "bench"))

from _profile import busy_from_trace, idle_gaps, kernel_label, merged, union_s  # noqa: E402


def _ev(cat: str, name: str, ts_us: float, dur_us: float, stream: int | None = None) -> dict:
    ev = {"ph": "X", "cat": cat, "name": name, "ts": ts_us, "dur": dur_us}
    if stream is not None:
        ev["args"] = {"stream": stream}
    return ev


def test_merged_and_union():
    assert merged([(3, 4), (0, 1), (0.5, 2), (4, 5)]) == [(0, 2), (3, 5)]
    assert union_s([(3, 4), (0, 1), (0.5, 2)]) == pytest.approx(3.0)


def test_kernel_label_drops_templates_and_namespaces():
    assert kernel_label("void at::native::vectorized_elementwise_kernel<4, Foo<bar> >(int)") == (
        "vectorized_elementwise_kernel"
    )
    assert kernel_label("triton_poi_fused_add_0") == "triton_poi_fused_add_0"


def test_idle_gaps_finds_the_longest_with_their_neighbours_and_copies():
    # Compute stream: k0 [0,1) ms, k1 [1.1,2) (a 0.1 ms gap: under the floor), k2 [5,6) (3 ms
    # gap), k3 overlaps k2 and ends later [5.5,7), k4 [7.5,8) (0.5 ms gap after k3).
    ks = [
        (0.0, 1e-3, "k0"),
        (1.1e-3, 2e-3, "k1"),
        (5e-3, 6e-3, "k2"),
        (5.5e-3, 7e-3, "k3"),
        (7.5e-3, 8e-3, "k4"),
    ]
    h2d = [(2e-3, 3.5e-3)]  # half of the 3 ms gap
    out = idle_gaps(ks, {"h2d": h2d, "d2h": []}, top=1, least_s=2e-4)
    assert out["idle_gap_count"] == 2
    assert out["idle_gap_s"] == pytest.approx(3.5e-3)
    (g,) = out["idle_gaps"]
    assert (g["at_ms"], g["ms"], g["before"], g["after"]) == (2.0, 3.0, "k1", "k2")
    assert (g["h2d"], g["d2h"]) == (0.5, 0.0)
    both = idle_gaps(ks, {}, top=5)["idle_gaps"]
    assert [(g["before"], g["after"], g["ms"]) for g in both] == [("k1", "k2", 3.0), ("k3", "k4", 0.5)]


def test_busy_from_trace_reads_the_compute_stream_and_copies():
    trace = {
        "traceEvents": [
            _ev("kernel", "void fwd<1>(int)", 0, 1000, stream=7),
            _ev("kernel", "void bwd<1>(int)", 3000, 1000, stream=7),
            _ev("kernel", "void adam(int)", 1000, 500, stream=9),
            _ev("gpu_memcpy", "Memcpy HtoD (Pinned -> Device)", 1000, 2000, stream=11),
            _ev("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 0, 400, stream=12),
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 0},  # no duration: not counted
        ]
    }
    out = busy_from_trace(trace, wall_s=4e-3)
    assert out["gpu_busy"] == pytest.approx(0.5)
    assert out["gpu_busy_any"] == pytest.approx(0.625)
    assert out["h2d_busy"] == pytest.approx(0.5) and out["d2h_busy"] == pytest.approx(0.1)
    (g,) = out["idle_gaps"]
    assert (g["before"], g["after"], g["ms"], g["h2d"], g["d2h"]) == ("fwd", "bwd", 2.0, 1.0, 0.0)


def test_profile_busy_keeps_the_trace_where_asked(tmp_path):
    import torch
    from _profile import profile_busy

    dest = tmp_path / "deep" / "step.trace.json.gz"
    out = profile_busy(lambda: torch.ones(4).add_(1), trace_to=str(dest))
    if torch.cuda.is_available():  # pragma: no cover - the GPU machines
        with gzip.open(dest, "rt") as f:
            assert "traceEvents" in json.load(f)
    else:
        assert out == {"gpu_busy": None, "gpu_busy_note": "no CUDA"} and not dest.exists()
