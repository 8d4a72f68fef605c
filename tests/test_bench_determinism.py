"""bench/determinism.py on the CPU: four runs of a tiny Llama, the results it writes, and the
CPU's answer (every run repeats, in both modes)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_the_determinism_bench_compares_every_run_with_its_modes_first(tmp_path):
    args = ["--shape", "tiny", "--seq", "64", "--accum", "2", "--steps", "3", "--device", "cpu"]
    p = subprocess.run([sys.executable, "bench/determinism.py", *args, "--out", str(tmp_path)],
                       cwd=REPO, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    [js] = tmp_path.glob("*_determinism.json")
    assert js.with_suffix(".md").read_text().count("| full_determinism |") == 2
    rows = json.loads(js.read_text())["rows"]
    assert [(r["mode"], r["run"]) for r in rows] == [
        ("default", 1),
        ("default", 2),
        ("full_determinism", 1),
        ("full_determinism", 2),
    ]
    assert all(r["differ"] == 0 and r["norms_equal"] and r["tensors"] == 21 for r in rows)
    assert rows[0]["grad_norms"] == rows[2]["grad_norms"]  # the CPU rounds alike in both modes
    assert "command: python bench/determinism.py --shape tiny" in js.with_suffix(".md").read_text()
