"""bench/adamw.py on the CPU: the exactness its passes rest on, every pass timed, and results
that never overwrite earlier ones."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import _report  # noqa: E402  (bench/ is not a package)
import adamw  # noqa: E402

ARGS = ["--params", "300000", "--chunks", "131072", "--scratch", "65536", "--bf16", "32768", "--repeats", "1"]


def test_the_clip_through_a_scratch_and_the_speculative_repair_are_exact():
    """Both claims hold; and the check is able to fail: a restore from a backup taken after the
    step does not give the state back."""
    assert adamw.exactness(n=100_000, scratch=4096) == {
        "clip_scratch_equals_in_place": True,
        "restore_returns_the_state": True,
    }
    s = adamw.State(1000)
    before = s.p.clone()
    s.step(0, 1000)
    for dst, src in zip(s.saved, (s.p, s.m, s.v)):
        dst.copy_(src)
    s.restore(0, 1000)
    assert not torch.equal(s.p, before)


def test_every_pass_is_timed_and_written_once(tmp_path, monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # the suite's threads stay as they are
    out = adamw.main([*ARGS, "--out", str(tmp_path)])
    passes = [r["pass"] for r in out["rows"]]
    assert passes == [
        "step",
        "clip in place",
        "clip scratch 65,536",
        "step + bf16 32,768",
        "backup",
        "restore",
    ]
    assert all(r["gparams_per_s"] > 0 for r in out["rows"])
    (js,) = tmp_path.glob("*_adamw.json")
    record = json.loads(js.read_text())
    assert record["exact"] == {"clip_scratch_equals_in_place": True, "restore_returns_the_state": True}
    assert record["command"].startswith("python bench/adamw.py --params 300000")
    # a second run in the same minute names the same files: refused, the first left as it was
    text = js.read_text()
    monkeypatch.setattr(_report.datetime, "datetime", _Frozen(js.name[:15]))
    with pytest.raises(SystemExit, match="exists; nothing is overwritten"):
        adamw.main([*ARGS, "--out", str(tmp_path)])
    assert js.read_text() == text


ENGINE_ARGS = [
    "--engine",
    "--shape",
    "tiny",
    "--engine-params",
    "1e6",
    "--repeats",
    "2",
    "--clip-fused",
]


@pytest.mark.slow
def test_the_engines_pass_is_timed_beside_the_kernel(tmp_path):
    """`--engine` at a tiny size, as a user runs it: the JSON holds the kernel's and the engine's
    rates over the same elements, their ratio, the first pass apart, the threads the worker
    ran on, the clipped pass in clipadam's kernel, and the command; the Markdown its table."""
    p = subprocess.run(
        [sys.executable, "bench/adamw.py", *ENGINE_ARGS, "--out", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    [js] = tmp_path.glob("*_adamw-engine.json")
    record = json.loads(js.read_text())
    assert record["command"] == "python bench/adamw.py " + " ".join([*ENGINE_ARGS, "--out", str(tmp_path)])
    assert (
        record["device"]
        and record["date"]
        and record["omp_wait_policy"] == os.environ.get("OMP_WAIT_POLICY", "PASSIVE")
    )
    rows = {(r["pass"], r["thread"]): r for r in record["rows"]}
    assert list(rows) == [
        ("kernel", "calling"),
        ("kernel", "worker"),
        ("engine, clipped", "worker"),
        ("engine, clipped, multiplied in the kernel's pass", "worker"),
        ("engine, coefficient 1", "worker"),
        ("engine, unclipped", "worker"),
    ]
    for r in rows.values():  # the best of the repeats after the first pass, in G params/s
        assert len(r["times_s"]) == 2 and r["seconds"] == min(r["times_s"]) and r["first_s"] > 0
        assert r["gparams_per_s"] == pytest.approx(record["engine_params"] / r["seconds"] / 1e9)
    kernel = max(rows["kernel", w]["gparams_per_s"] for w in ("calling", "worker"))
    engine = rows["engine, clipped", "worker"]
    assert record["kernel_gparams_per_s"] == kernel
    assert record["engine_gparams_per_s"] == engine["gparams_per_s"]
    assert record["ratio"] == pytest.approx(engine["gparams_per_s"] / kernel)
    assert record["engine_first_pass_s"] == engine["first_s"]
    assert record["threads_on_worker"] == record["threads"]  # the optimizer's threads, on its thread
    assert record["probe_gparams_per_s"] > 0  # the plan's probe
    assert (
        record["fused_ratio"]
        == rows["engine, clipped, multiplied in the kernel's pass", "worker"]["vs_kernel"]
    )
    assert 0 < record["engine_params"] < 2e6 and record["layers"] >= 1
    chunk = record["chunk"]
    assert {r["piece"] for r in rows.values()} == {chunk}
    assert f"| engine, clipped | {chunk:,} | worker |" in js.with_suffix(".md").read_text()


def test_beside_a_step_each_pass_is_timed_at_each_block_beside_each_kind(tmp_path, monkeypatch):
    """`--engine --beside`: under each kind of work beside it, the kernel and the engine's pass at
    each of clipadam's blocks, each rate against the kernel beside the same and beside nothing;
    the kinds that need a GPU refused in one line without one; the results written once."""
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    args = ["--engine", "--shape", "tiny", "--engine-params", "1e6", "--repeats", "1"]
    out = adamw.main(
        [*args, "--beside", "none,launch", "--blocks", "64,0", "--weight-decay", "0", "--out", str(tmp_path)]
    )
    assert out["weight_decay"] == 0.0  # training's default, in the results
    rows = [(r["beside"], r["block"]) for r in out["rows"]]
    assert rows == [
        ("none", None),
        ("none", 64),
        ("none", 0),
        ("launch", None),
        ("launch", 64),
        ("launch", 0),
    ]
    kernel = {r["beside"]: r["gparams_per_s"] for r in out["rows"] if r["block"] is None}
    for r in out["rows"]:
        assert r["gparams_per_s"] == pytest.approx(out["engine_params"] / r["seconds"] / 1e9)
        assert r["vs_kernel"] == pytest.approx(r["gparams_per_s"] / kernel[r["beside"]])
        assert r["vs_alone"] == pytest.approx(r["gparams_per_s"] / kernel["none"])
        assert r["link_gb_s"] is None and r["first_s"] > 0 and len(r["times_s"]) == 1
    assert out["blocks"] == [64, 0]
    (md,) = tmp_path.glob("*_adamw-beside.md")
    assert "| launch | kernel | - |" in md.read_text() and "a thread's share" in md.read_text()
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="--beside link needs a GPU"):
            adamw.main([*args, "--beside", "link"])
    with pytest.raises(SystemExit, match="'disk' is not one of"):
        adamw.main([*args, "--beside", "none,disk"])
    assert len(list(tmp_path.iterdir())) == 2  # the one run's JSON and Markdown, nothing more


class _Frozen:
    """datetime.datetime whose now() is the minute `stamp` (YYYY-mm-dd_HHMM)."""

    def __init__(self, stamp: str):
        import datetime

        self._dt, self._at = datetime.datetime, datetime.datetime.strptime(stamp, "%Y-%m-%d_%H%M")

    def now(self, tz=None):
        return self._at if tz is None else self._dt.now(tz)
