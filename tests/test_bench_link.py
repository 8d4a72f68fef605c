"""bench/link.py on the CPU: its table and its results, which never overwrite earlier ones (the
copies themselves need a CUDA device)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_bench_adamw import _Frozen

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import _report  # noqa: E402  (bench/ is not a package)
import link  # noqa: E402

ROWS = [
    {"case": "AdamW alone", "copy_GBps": None, "adam_Gparams_s": 4.1},
    {"case": "both ways + AdamW", "copy_GBps": 70.3, "adam_Gparams_s": 3.8},
]


def test_the_table_has_a_row_per_case_and_a_dash_where_nothing_was_measured():
    lines = link.table(ROWS).splitlines()
    assert lines[2:] == ["| AdamW alone | - | 4.1 |", "| both ways + AdamW | 70.3 | 3.8 |"]


def test_results_are_written_once(tmp_path, monkeypatch):
    monkeypatch.setattr(_report.datetime, "datetime", _Frozen("2026-11-23_2217"))  # one minute for both
    meta = {"command": "python bench/link.py", "device": "test"}
    stem = _report.write_once(str(tmp_path), "link", "title", meta, ROWS, link.table(ROWS))
    record = json.loads(Path(stem + ".json").read_text())
    assert record["rows"] == ROWS and record["command"] == meta["command"]
    text = Path(stem + ".md").read_text()
    with pytest.raises(SystemExit, match="exists; nothing is overwritten"):
        _report.write_once(str(tmp_path), "link", "title", meta, ROWS[:1], link.table(ROWS[:1]))
    assert Path(stem + ".md").read_text() == text


def test_no_cuda_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(link.torch.cuda, "is_available", lambda: False)
    with pytest.raises(SystemExit, match="^link.py: needs a CUDA device$"):
        link.main([])
