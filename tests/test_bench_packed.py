"""bench/packed.py end to end on the CPU: a tiny Llama trained twice through the real command
line, one document per row and packed rows, and the report built from what the runs wrote."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import packed  # noqa: E402  (bench/ is not a package)

ARGS = ["--model", "tiny", "--doc", "128", "--tokens-per-step", "512", "--steps", "3"]


def steps_of(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.slow
def test_packed_bench_trains_both_through_the_cli_and_reports_their_ratio(tmp_path):
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    tmp.mkdir()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}
    p = subprocess.run(
        [sys.executable, "bench/packed.py", *ARGS, "--out", str(out)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    [js] = out.glob("*_packed.json")
    [md] = out.glob("*_packed.md")
    [logs] = out.glob("*_packed_logs")
    record = json.loads(js.read_text())
    command = "python bench/packed.py " + " ".join([*ARGS, "--out", str(out)])
    assert record["command"] == command and record["device"] == "cpu" and record["date"]
    runs = {r["name"]: r for r in record["runs"]}
    assert list(runs) == ["rows", "packed"]
    for name, rows in (("rows", 4), ("packed", 1)):
        r = runs[name]
        assert "-m megatrain train" in r["command"] and ("packing=true" in r["command"]) == (name == "packed")
        # What the run's own metrics say: every step 512 tokens in `rows` rows holding 4 documents.
        steps = steps_of(logs / name / "metrics.jsonl")
        assert [(s["tokens"], s["rows"], s["samples"]) for s in steps] == [(512, rows, 4)] * 3
        assert r["max_length"] == 512 // rows
        # tokens/s over the steps after the first, from the two measured figures of each step.
        timed = steps[1:]
        want = sum(s["tokens"] for s in timed) / sum(s["step_time_s"] for s in timed)
        assert r["tokens_per_s"] == pytest.approx(want, rel=1e-12)
        plan = json.loads((logs / name / "plan.json").read_text())
        assert r["measured"] == plan["measured"] and r["measured"]["host_peak_rss"] > 0
    ratio = runs["packed"]["tokens_per_s"] / runs["rows"]["tokens_per_s"]
    assert runs["packed"]["vs_rows"] == pytest.approx(ratio, rel=1e-12)
    text = md.read_text()
    assert f"- command: {command}" in text and f"packed / rows tokens/s: {ratio:.3f}x" in text
    assert all(r["command"] in text for r in runs.values())
    assert f"packed / rows tokens/s: {ratio:.3f}x" in p.stdout
    assert not list(tmp.glob("megatrain-packed-*"))  # the model, documents and final/ models are gone


def test_packed_bench_flags_a_run_whose_steps_are_not_what_was_asked():
    """A run whose metrics show other rows or documents per step measured something else."""
    good = {"tokens_per_step": [512], "rows_per_step": [1], "docs_per_step": [4]}
    rec = dict(good)
    packed.check(rec, 512, 1, 4)
    assert "error" not in rec
    rec = dict(good, rows_per_step=[4], docs_per_step=[4])  # one document per row: not packed
    packed.check(rec, 512, 1, 4)
    assert rec["error"] == "metrics show rows_per_step [4] (expected 1)"


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--doc", "100", "--tokens-per-step", "512"], "must be a multiple of --doc 100"),
        (["--model", "nope"], "--model nope: one of"),
        (["--steps", "1"], "--steps must be at least 2"),
    ],
)
def test_packed_bench_refuses_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit) as e:
        packed.main(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err
