"""bench/_trl_dpo.py, the TRL side of bench/dpo.py, on the CPU: its word tokenizer gives TRL back the
exact token ids, and a tiny model trains through DPOTrainer with the reference pass precomputed.
Skipped where TRL or datasets are not installed (CI installs neither; the GPU machine gets them as
wheels, bench/README.md)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import _trl_dpo  # noqa: E402  (bench/ is not a package)


def test_word_tokenizer_gives_back_the_ids_with_the_prompt_as_prefix():
    rows = [dict(prompt_input_ids=[5, 17, 511], chosen_input_ids=[1, 2, 3], rejected_input_ids=[9, 10, 11])]
    [text] = [_trl_dpo.text_row(r) for r in rows]
    tok = _trl_dpo.word_tokenizer(512)
    ids = lambda s: tok(text=s)["input_ids"]  # noqa: E731  (as TRL's DPOTrainer tokenizes)
    assert ids(text["prompt"]) == [5, 17, 511]
    assert ids(text["prompt"] + text["chosen"]) == [5, 17, 511, 1, 2, tok.eos_token_id]
    assert ids(text["prompt"] + text["rejected"]) == [5, 17, 511, 9, 10, tok.eos_token_id]
    assert text["chosen"].endswith(tok.eos_token)  # so TRL appends no second EOS


def test_args_derive_pairs_and_micro_batches_from_tokens_per_step():
    a = _trl_dpo.parse_args(["--shape", "B", "--tokens-per-step", "16384", "--accum", "2"])
    assert (a.pairs, a.mbs, a.accum) == (8, 4, 2)
    assert _trl_dpo.ds_config(offload=True)["zero_optimization"]["offload_param"]["device"] == "cpu"
    assert "offload_param" not in _trl_dpo.ds_config(offload=False)["zero_optimization"]


def test_tiny_model_trains_through_dpotrainer_after_the_reference_pass(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    out = tmp_path / "trl.json"
    args = ["--shape", "tiny", "--prompt", "16", "--completion", "16", "--pairs", "4", "--accum", "2"]
    p = subprocess.run(
        [
            sys.executable,
            "bench/_trl_dpo.py",
            *args,
            "--steps",
            "3",
            "--warmup",
            "1",
            "--ds",
            "none",
            "--out",
            str(out),
        ],
        cwd=REPO,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["error"] is None and r["tokens_per_step"] == 4 * 2 * 32
    assert [p["rows"] for p in r["reference"]] == [12] and r["reference_s"] > 0
    assert len(r["step_s"]) == 3 and len(r["losses"]) == 3 and r["tokens_per_s"] > 0
    steps = [g for g in r["logs"] if "loss" in g]
    # TRL's own token count agrees, and before the first update the policy is the reference
    assert [g["num_tokens"] for g in steps] == [256, 512, 768]
    assert steps[0]["rewards/margins"] == 0.0
