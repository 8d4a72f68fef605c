"""bench/dpo.py's inputs and table on the CPU: its one pairs file gives stage dpo and stage rm the
same token sequences (as megatrain's own readers read it), and the table's ratios are rm's figures
over dpo's."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import dpo  # noqa: E402  (bench/ is not a package)
from _shapes import DENSE_SHAPES  # noqa: E402

from megatrain.data.preference import Limits, build_preference_pairs, build_reward_pairs  # noqa: E402

SEQ = 16 + 16


def test_both_stages_read_the_same_sequences_from_the_pairs_file(tmp_path):
    args = argparse.Namespace(prompt=16, completion=16, pairs=4, steps=3, stages=["dpo", "rm"])
    _, data = dpo.write_inputs(tmp_path, DENSE_SHAPES["tiny"], args)
    vocab = DENSE_SHAPES["tiny"]["vocab"]
    as_dpo = build_preference_pairs([data], None, Limits(SEQ), vocab)
    as_rm = build_reward_pairs([data], None, SEQ, vocab)
    assert len(as_dpo) == len(as_rm) == 12
    for a, b in zip(as_dpo, as_rm):
        assert a.chosen.prompt_length == a.rejected.prompt_length == 16
        assert a.chosen.input_ids == b.chosen.input_ids and a.rejected.input_ids == b.rejected.input_ids
        assert len(b.chosen.input_ids) == len(b.rejected.input_ids) == SEQ
        assert a.chosen.input_ids != a.rejected.input_ids


def test_ratios_are_rm_over_dpo_and_megatrain_over_trl():
    def rec(system, stage, tps, step, gpu, host):
        return dict(system=system, stage=stage, tokens_per_s=tps, tokens=[1000] * 4, step_s=[9, 9, step, step],
                    plan_step_s=step, measured=dict(gpu_peak_allocated=gpu, host_peak_rss=host), predicted={})  # fmt: skip

    runs = [rec("megatrain", "dpo", 1000.0, 2.0, 40, 100), rec("megatrain", "rm", 1500.0, 1.0, 30, 100)]
    runs.append(rec("trl+deepspeed", "dpo", 400.0, 5.0, 20, 200))
    lines = dpo.ratios(runs)
    assert lines[0].startswith("megatrain / TRL+DeepSpeed: **2.50x**")
    assert (
        lines[1]
        == "megatrain rm / dpo: tokens/s **1.50x**, step s **0.50x**, GPU peak **0.75x**, host peak **1.00x**"
    )
    assert dpo.plan_runs(argparse.Namespace(systems="megatrain,trl", stages=["dpo", "rm"])) == [
        ("megatrain", "dpo"),
        ("megatrain", "rm"),
        ("trl", "dpo"),
    ]
    assert dpo.plan_runs(argparse.Namespace(systems="megatrain,trl", stages=["rm"])) == [("megatrain", "rm")]
