"""bench/adamw.py on the CPU: the exactness its passes rest on, every pass timed, and results
that never overwrite earlier ones."""

from __future__ import annotations

import json
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


class _Frozen:
    """datetime.datetime whose now() is the minute `stamp` (YYYY-mm-dd_HHMM)."""

    def __init__(self, stamp: str):
        import datetime

        self._dt, self._at = datetime.datetime, datetime.datetime.strptime(stamp, "%Y-%m-%d_%H%M")

    def now(self, tz=None):
        return self._at if tz is None else self._dt.now(tz)
