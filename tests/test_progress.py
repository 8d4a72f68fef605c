"""What a run shows and writes: the ETA counts training steps only, not an evaluation before the
first step (nor one between steps, nor a save); the tokenizer files it saves are the user's."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from megatrain.data.tokenizer import TOKENIZER_FILES
from megatrain.metrics import MetricsLogger


def _record(step: int, seconds: float) -> dict:
    return {
        "step": step,
        "loss": 1.0,
        "grad_norm": 1.0,
        "lr": 1e-3,
        "tokens_per_s": 100.0,
        "step_time_s": seconds,
    }


EVAL = {"step": 0, "eval_loss": 2.0, "eval_perplexity": 7.4, "eval_runtime": 1.0, "eval_tokens_per_s": 10.0}


def test_log_line_eta_counts_training_steps_only(tmp_path, capsys, monkeypatch):
    """10 steps of 2 s after an evaluation of an hour: the first ETA is 18 s, not 10 hours."""
    clock = [0.0]
    monkeypatch.setattr(time, "time", lambda: clock[0])
    log = MetricsLogger(tmp_path, total_steps=10, disable_tqdm=True)
    clock[0] += 3600  # eval_on_start
    log.log_eval(EVAL)
    clock[0] += 2
    log.log(_record(1, 2.0))
    log.close()
    line = capsys.readouterr().out.strip().splitlines()[-1]
    assert line.startswith("step 1/10") and line.endswith("eta 18s"), line


def test_progress_bar_leaves_a_pause_out_of_its_rate(tmp_path):
    log = MetricsLogger(tmp_path, total_steps=10, disable_tqdm=False)
    time.sleep(1.0)  # an evaluation
    log.exclude_pause()
    log.log(_record(1, 0.01))
    elapsed = log.bar.format_dict["elapsed"]
    log.close()
    assert elapsed == pytest.approx(0.0, abs=0.5)


# ---------------------------------------------------------------------------- what a run writes
def test_saved_tokenizer_files_are_the_users(tmp_path):
    """Checkpoints and final/ hold the tokenizer files the run read, byte for byte: no loader
    arguments (`"local_files_only": true`) and no rewrite in this transformers' dialect."""
    import shutil

    from test_checkpoint import make_run

    from megatrain.config import TrainConfig
    from megatrain.trainer import train

    src = tmp_path / "tok"
    shutil.copytree(Path(__file__).resolve().parent.parent / "examples" / "tokenizer", src)
    base = make_run(tmp_path, vocab=1900)  # the example tokenizer's 1,893 ids fit
    out = tmp_path / "out"
    train(TrainConfig(**base, output_dir=str(out), max_steps=1, tokenizer_name_or_path=str(src)))
    for d in (out / "checkpoint-1", out / "final"):
        written = {n: (d / n).read_bytes() for n in TOKENIZER_FILES if (d / n).is_file()}
        assert written == {p.name: p.read_bytes() for p in src.iterdir()}, d
        assert b"local_files_only" not in written["tokenizer_config.json"]
