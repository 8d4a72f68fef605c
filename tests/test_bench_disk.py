"""bench/disk.py end to end on the CPU: a tiny Llama trained through the command line with the
whole state in memory, then under a host budget that only a disk tier meets; the report shows
the tier the plan chose and the run that trained with it; and bench/tierpass.py, the tier's
optimizer pass alone on the tiny shape."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from megatrain.planning.footprint import HOST_RESERVE

REPO = Path(__file__).resolve().parents[1]
ARGS = ["--model", "tiny", "--doc", "128", "--tokens-per-step", "512", "--steps", "3"]


def bench(tmp_path: Path, tag: str, *more: str, md_text: list | None = None) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_TMP": str(tmp_path)}
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "bench/disk.py", *ARGS, *more, "--tag", tag, "--out", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    [js] = out.glob(f"*_{tag}.json")
    [md] = out.glob(f"*_{tag}.md")
    assert "| run | disk tier |" in md.read_text()
    if md_text is not None:
        md_text.append(md.read_text())
    return json.loads(js.read_text())


@pytest.mark.slow
def test_disk_bench_trains_past_its_host_budget_with_a_tier(tmp_path):
    [ram] = bench(tmp_path, "ram", "--runs", "ram")["runs"]
    assert not ram.get("error") and ram["plan"]["disk_units"] == 0
    state = ram["plan"]["host"]["fp32 weights + AdamW moments"]
    budget = math.ceil((sum(ram["plan"]["host"].values()) - state // 3) / (1 - HOST_RESERVE))
    tier = tmp_path / "tier"
    text = []
    [disk] = bench(
        tmp_path, "disk", "--runs", "disk", "--max-host-memory", str(budget), "--offload-dir", str(tier),
        md_text=text,
    )["runs"]  # fmt: skip
    assert not disk.get("error"), disk
    assert disk["plan"]["disk_units"] >= 1 and disk["plan"]["disk"] > 0
    assert disk["machine"]["disk_read_bytes_s"] > 0 and disk["machine"]["disk_write_bytes_s"] > 0
    assert disk["measured"]["disk_written_bytes"] > 0 and disk["tokens_per_s"] > 0
    assert os.listdir(tier) == []
    # the report says how far past its host budget the run went: all of the state against the budget
    ratio = state / disk["machine"]["host_bytes"]
    assert disk["plan"]["host"]["fp32 weights + AdamW moments"] + disk["plan"]["disk"] == state
    assert f"weights and AdamW moments: {state / 2**30:.1f} GiB, {ratio:.2f}x the host memory" in text[0]


@pytest.mark.slow
def test_tierpass_times_the_tiers_pass_and_finds_it_exact(tmp_path):
    out = tmp_path / "out"
    p = subprocess.run([sys.executable, "bench/tierpass.py", "--model", "tiny", "--units", "2", "--passes", "2",
                        "--offload-dir", str(tmp_path / "tier"), "--out", str(out), "--tag", "pass"],
                       cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    [js] = out.glob("*_pass.json")
    rec = json.loads(js.read_text())
    assert rec["exact"] and len(rec["passes"]) == 2 and rec["tier_bytes"] > 0 and rec["predicted_s"] > 0
    assert all(r["tier_s"] > 0 and r["io_s"] > 0 for r in rec["passes"])
    assert os.listdir(tmp_path / "tier") == []
