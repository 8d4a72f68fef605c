"""A user never loses a file: export targets, reused output directories, disk space and a full
disk, what gets saved when, and checksums. CPU, tiny random models."""

from __future__ import annotations

import builtins
import errno
import io
import json
import os
import shutil
import sys
from collections import namedtuple
from pathlib import Path

import pytest
import torch
from helpers import tiny_tokenizer
from test_checkpoint import load_fully, make_run, metrics, one_thread, signal_after_step, tensors  # noqa: F401 (fixture)
from test_cli import run_cli, write_yaml

from megatrain.config import TrainConfig
from megatrain.errors import CheckpointError, ConfigError
from megatrain.guard import TrainingInterrupted
from megatrain.io.checkpoint import list_checkpoints, open_checkpoint
from megatrain.io.ownership import Owner
from megatrain.metrics import MetricsLogger
from megatrain.models.config import ModelConfig
from megatrain.trainer import train


class _FileProxy:
    """An open file whose `write` a test replaces (a kill, a full disk); the rest passes through."""

    def __init__(self, f):
        self.f = f

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def snapshot(d: Path) -> dict[str, bytes]:
    """Every file under `d` with its bytes: what must stay exactly as it was."""
    return {str(p.relative_to(d)): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}


def one_line_error(rc: int, err: str) -> str:
    lines = err.strip().splitlines()
    assert rc == 2 and len(lines) == 1 and lines[0].startswith("megatrain: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A finished 2-step run with a tokenizer: output_dir/checkpoint-2, final/, metrics.jsonl."""
    tmp = tmp_path_factory.mktemp("run")
    base = make_run(tmp, vocab=640)
    tiny_tokenizer("chatml").save_pretrained(tmp / "tok")
    base["tokenizer_name_or_path"] = str(tmp / "tok")
    train(TrainConfig(**base, output_dir=str(tmp / "out"), max_steps=2))
    return tmp, base


# ---------------------------------------------------------------------------- export
def test_export_never_replaces_what_it_did_not_write(run, tmp_path, capsys, monkeypatch):
    src = run[0] / "out" / "checkpoint-2"
    before = snapshot(run[0] / "out")
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "notes.txt").write_text("my own file")
    for extra in ([], ["--overwrite"]):
        rc, _, err = run_cli(capsys, "export", src, mine, *extra)
        assert f"{mine}: exists and is not empty" in one_line_error(rc, err)
        assert snapshot(mine) == {"notes.txt": b"my own file"}
    # Into the run's own output_dir: refused, every checkpoint and metrics.jsonl intact.
    for extra in ([], ["--overwrite"]):
        rc, _, err = run_cli(capsys, "export", src, run[0] / "out", *extra)
        one_line_error(rc, err)
    assert snapshot(run[0] / "out") == before

    # A new directory, then an empty one, are written; a previous export is replaced only with
    # --overwrite.
    rc, stdout, _ = run_cli(capsys, "export", src, tmp_path / "hf")
    assert rc == 0 and "checksums verified" in stdout
    from megatrain.io import manifest

    assert manifest.kind_of(tmp_path / "hf") == manifest.MODEL
    (tmp_path / "empty").mkdir()
    assert run_cli(capsys, "export", src, tmp_path / "empty")[0] == 0
    assert snapshot(tmp_path / "empty") == snapshot(tmp_path / "hf")
    rc, _, err = run_cli(capsys, "export", src, tmp_path / "hf", "--dtype", "float32")
    assert "--overwrite replaces a previous export" in one_line_error(rc, err)
    rc, _, _ = run_cli(capsys, "export", src, tmp_path / "hf", "--dtype", "float32", "--overwrite")
    assert rc == 0 and tensors(tmp_path / "hf")["model.norm.weight"].dtype == torch.float32
    # A checkpoint is not an export: --overwrite does not replace it either.
    rc, _, err = run_cli(capsys, "export", tmp_path / "hf", src, "--overwrite")
    one_line_error(rc, err)
    assert snapshot(run[0] / "out") == before

    # `export CKPT .`: one line, whether the current directory is empty or not.
    for cwd in (mine, tmp_path / "cwd"):
        cwd.mkdir(exist_ok=True)
        monkeypatch.chdir(cwd)
        rc, _, err = run_cli(capsys, "export", src, ".")
        one_line_error(rc, err)
    assert snapshot(mine) == {"notes.txt": b"my own file"} and not any((tmp_path / "cwd").iterdir())
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_export_of_a_checkpoint_deleted_meanwhile_is_whole_or_fails(run, tmp_path, capsys, monkeypatch):
    """A run prunes the checkpoint being exported (rename, then delete) after the export has
    started: the export is complete and correct, or fails with one line; never partial."""
    from megatrain.io import weights

    src = tmp_path / "checkpoint-2"
    shutil.copytree(run[0] / "out" / "checkpoint-2", src)
    want = snapshot(src)
    orig_get = weights.TensorReader.get

    def get_then_prune(self, key):
        if src.exists():
            trash = src.with_name(".checkpoint-2.del-1")
            os.replace(src, trash)
            shutil.rmtree(trash)
        return orig_get(self, key)

    monkeypatch.setattr(weights.TensorReader, "get", get_then_prune)
    rc, _, err = run_cli(capsys, "export", src, tmp_path / "hf", "--dtype", "float32")
    assert not src.exists()
    if rc != 0:
        one_line_error(rc, err)
        assert not (tmp_path / "hf").exists()
        return
    got = snapshot(tmp_path / "hf")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        assert got.get(name) == want[name], name
    assert got["model.safetensors"] == want["model.safetensors"]  # fp32: the same bytes


# `megatrain export SRC OUT`, killed (SIGKILL) once its first safetensors file is written.
KILLED_EXPORT = """
import os, signal, sys
from megatrain.io import writing
from megatrain.cli import main

write = writing._write_shard

def write_then_die(*args):
    write(*args)
    os.kill(os.getpid(), signal.SIGKILL)

writing._write_shard = write_then_die
sys.exit(main(["export", *sys.argv[1:]]))
"""


def test_a_killed_exports_temporary_is_deleted_by_the_next_one(run, tmp_path, capsys):
    import subprocess
    import sys

    from test_checkpoint import subprocess_env

    src = run[0] / "out" / "checkpoint-2"
    proc = subprocess.run(
        [sys.executable, "-c", KILLED_EXPORT, str(src), str(tmp_path / "hf"), "--max-shard-size", "20KB"],
        env=subprocess_env(),
        capture_output=True,
    )
    assert proc.returncode == -9, proc.stderr
    (left,) = [p for p in tmp_path.iterdir() if p.name.startswith(".hf.tmp-")]
    assert list(left.glob("model-*.safetensors"))  # a partial export, no manifest
    # Not megatrain's, or a live writer's: never touched.
    theirs = {n: tmp_path / n for n in (".hf.tmp-mine", ".other.tmp-x", ".hf.tmp-live")}
    for p in theirs.values():
        p.mkdir()
        (p / "data").write_text("keep")
    (theirs[".other.tmp-x"] / ".megatrain-partial").write_text("not a marker")
    (theirs[".hf.tmp-live"] / ".megatrain-partial").write_text(Owner.me().to_json())
    rc, _, err = run_cli(capsys, "export", src, tmp_path / "hf2")
    assert rc == 0, err
    assert not left.exists() and all((p / "data").read_text() == "keep" for p in theirs.values())
    assert not (tmp_path / "hf2" / ".megatrain-partial").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["hf2", *theirs])


def test_training_never_replaces_a_final_dir_it_did_not_write(tmp_path, capsys):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    (out / "final").mkdir(parents=True)
    (out / "final" / "model.safetensors").write_bytes(b"a user's model")
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=1))
    for extra in ([], ["overwrite_output_dir=true"]):
        rc, _, err = run_cli(capsys, "train", cfg, *extra)
        assert f"{out / 'final'}: exists and is not empty" in one_line_error(rc, err)
        assert snapshot(out) == {"final/model.safetensors": b"a user's model"}


# ---------------------------------------------------------------------------- output_dir reuse
def test_a_fresh_run_refuses_a_used_output_dir(tmp_path, capsys):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=3, save_steps=1))
    assert run_cli(capsys, "train", cfg)[0] == 0
    before = snapshot(out)
    rc, _, err = run_cli(capsys, "train", cfg, "max_steps=2")
    line = one_line_error(rc, err)
    assert f"output_dir: {out} holds a previous run (checkpoint-1" in line
    assert "resume_from_checkpoint=true" in line and "overwrite_output_dir=true" in line
    assert snapshot(out) == before


def test_overwrite_output_dir_keeps_the_previous_run(tmp_path, capsys):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    train(TrainConfig(**base, output_dir=str(out), max_steps=10, save_steps=5))
    a_metrics = (out / "metrics.jsonl").read_bytes()
    a_plan = (out / "plan.json").read_bytes()
    (out / ".plan.json.tmp-99").write_text("{")  # what a kill while writing plan.json leaves
    a_ckpts = {n: snapshot(out / n) for n in ("checkpoint-5", "checkpoint-10")}
    run_a = json.loads((out / "checkpoint-10" / "trainer_state.json").read_text())["run_id"]

    # A rolled-back run: fewer steps than the previous one, keeping 2 checkpoints.
    b = dict(base, output_dir=str(out), save_steps=1, save_total_limit=2, overwrite_output_dir=True)
    capsys.readouterr()
    train(TrainConfig(**b, max_steps=4))
    said = capsys.readouterr().out
    assert (
        "overwrite_output_dir: a previous run's checkpoint-5, checkpoint-10: left as they are "
        "(never pruned by this run)\n" in said
    )
    assert [s for s, _ in list_checkpoints(out)] == [3, 4, 5, 10]
    assert {n: snapshot(out / n) for n in a_ckpts} == a_ckpts
    kept = [p for p in out.glob("metrics-*.jsonl")]
    assert len(kept) == 1 and kept[0].read_bytes() == a_metrics
    # The run's other own files go aside with its metrics, under the same time stamp.
    stamp = kept[0].name.removeprefix("metrics-").removesuffix(".jsonl")
    assert (out / f"plan-{stamp}.json").read_bytes() == a_plan
    assert (out / f"train_config-{stamp}.json").is_file()
    assert json.loads((out / "plan.json").read_text())["measured"]["step"] == 4
    assert not (out / ".plan.json.tmp-99").exists()
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4]
    run_b = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())["run_id"]
    assert run_a and run_b and run_a != run_b

    # `resume_from_checkpoint: true` continues the newest run (B), not A's higher step. It says
    # which of A's checkpoints it leaves and which it replaces, and does what it says.
    train(TrainConfig(**b, max_steps=6, resume_from_checkpoint=True))
    said = capsys.readouterr().out
    assert (
        f"{out} also holds another run's checkpoint-10: left as they are (never pruned by this run); "
        "checkpoint-5: replaced by this run's checkpoint of the same step\n" in said
    )
    assert (
        f"megatrain: saved {out / 'checkpoint-5'} in place of another run's checkpoint of that step" in said
    )
    assert "left as they are" not in said.split("checkpoint-10: left as they are")[1]
    assert [r["step"] for r in metrics(out)] == [1, 2, 3, 4, 5, 6]
    # Resuming its own run rewrites plan.json in place; nothing more is kept aside.
    assert len(list(out.glob("plan-*.json"))) == 1 and len(list(out.glob("metrics-*.jsonl"))) == 1
    assert json.loads((out / "plan.json").read_text())["measured"]["step"] == 6
    assert [s for s, _ in list_checkpoints(out)] == [5, 6, 10]  # B's 5 replaced A's 5 (it said so)
    assert json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["run_id"] == run_b
    assert snapshot(out / "checkpoint-10") == a_ckpts["checkpoint-10"]


def test_metrics_trim_on_resume_is_atomic(tmp_path, monkeypatch):
    """A kill while metrics.jsonl is trimmed for a resume leaves it whole (simulated by a write
    that dies half way through any file opened for writing in output_dir)."""
    out = tmp_path / "out"
    out.mkdir()
    text = "".join(json.dumps({"step": s, "loss": 1.0}) + "\n" for s in range(1, 6))
    (out / "metrics.jsonl").write_text(text)
    real_open = builtins.open

    class DiesHalfway(_FileProxy):
        def write(self, data):
            self.f.write(data[: len(data) // 2])
            self.f.flush()
            raise KeyboardInterrupt  # the kill

    def dying_open(file, mode="r", *args, **kwargs):
        f = real_open(file, mode, *args, **kwargs)
        return DiesHalfway(f) if "w" in mode and str(out) in str(file) else f

    monkeypatch.setattr(builtins, "open", dying_open)
    monkeypatch.setattr(io, "open", dying_open)
    with pytest.raises(KeyboardInterrupt):
        MetricsLogger(out, total_steps=10, start_step=2, disable_tqdm=True)
    monkeypatch.undo()
    assert (out / "metrics.jsonl").read_text() == text
    MetricsLogger(out, total_steps=10, start_step=2, disable_tqdm=True).close()
    assert [r["step"] for r in metrics(out)] == [1, 2]


def test_every_name_a_run_writes_is_checked_before_step_one(tmp_path, capsys):
    """A user's checkpoint-N where the schedule saves, or a directory where a run file goes, is
    refused before training (not after it, at save time); one where it does not save is kept."""
    base = make_run(tmp_path)
    out = tmp_path / "out"
    cfg = write_yaml(
        tmp_path / "run.yaml",
        dict(base, output_dir=str(out), max_steps=4, save_steps=2, overwrite_output_dir=True),
    )
    for name in ("checkpoint-3", "checkpoint-4"):
        (out / name).mkdir(parents=True)
        (out / name / "notes.txt").write_text("mine")
    before = snapshot(out)
    rc, _, err = run_cli(capsys, "train", cfg)
    line = one_line_error(rc, err)
    assert snapshot(out) == before and not (out / "metrics.jsonl").exists()
    assert f"{out / 'checkpoint-4'}: exists and is not empty; it is not a megatrain checkpoint" in line
    assert "(this run saves step 4)" in line
    # A run file's name taken by a directory.
    (out / "plan.json").mkdir()
    rc, _, err = run_cli(capsys, "train", cfg, "max_steps=1", "save_steps=0")
    assert f"{out / 'plan.json'}: exists and is not a file" in one_line_error(rc, err)
    (out / "plan.json").rmdir()
    # checkpoint-3 is saved by neither schedule below: it stays, and the run says so.
    rc, stdout, err = run_cli(capsys, "train", cfg, "max_steps=2", "save_steps=1")
    assert rc == 0, err
    assert "a previous run's checkpoint-3, checkpoint-4: left as they are" in stdout
    assert snapshot(out / "checkpoint-3") == {"notes.txt": b"mine"}
    assert snapshot(out / "checkpoint-4") == {"notes.txt": b"mine"}


# ---------------------------------------------------------------------------- disk space
Usage = namedtuple("Usage", "total used free")


def test_disk_space_is_checked_before_training(tmp_path, capsys, monkeypatch):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    cfg = write_yaml(
        tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=4, save_steps=1, save_total_limit=2)
    )
    n = ModelConfig.from_json(tmp_path / "model").num_params
    # 4 saves, 2 kept + 1 being written = 3 full checkpoints of 12 B/param; final/ in float32.
    need = 3 * 12 * n + 4 * n
    free = {"bytes": need - 1}
    monkeypatch.setattr(shutil, "disk_usage", lambda p: Usage(10**12, 0, free["bytes"]))
    rc, _, err = run_cli(capsys, "train", cfg)
    line = one_line_error(rc, err)
    assert f"not enough disk space in {out}" in line and "3 checkpoint(s)" in line and "free" in line
    assert not out.exists()
    # Weights-only checkpoints need a third of that; they fit.
    rc, _, _ = run_cli(capsys, "train", cfg, "save_only_model=true")
    assert rc == 0 and not (out / "checkpoint-4" / "optimizer.safetensors").exists()
    shutil.rmtree(out)
    rc, stdout, err = run_cli(capsys, "train", cfg, "preflight_check=false")
    assert rc == 0 and "megatrain: warning: not enough disk space" in stdout + err
    shutil.rmtree(out)
    free["bytes"] = need
    assert run_cli(capsys, "train", cfg)[0] == 0
    assert (out / "final" / "model.safetensors").exists()
    # Without final/ the checkpoints alone must fit; nothing is exported, the checkpoints stay.
    shutil.rmtree(out)
    free["bytes"] = need - 4 * n
    rc, stdout, err = run_cli(capsys, "train", cfg, "save_final_model=false")
    assert rc == 0, err
    assert not (out / "final").exists() and (out / "checkpoint-4" / "optimizer.safetensors").exists()
    assert "megatrain: memory:" in stdout


def test_load_best_model_at_end_needs_the_final_export(tmp_path):
    base = make_run(tmp_path)
    with pytest.raises(ConfigError, match="^load_best_model_at_end: .* needs save_final_model$"):
        TrainConfig(**base, eval_dataset=base["dataset"], eval_strategy="steps", save_steps=1,
                    eval_steps=1, metric_for_best_model="eval_loss", load_best_model_at_end=True,
                    save_final_model=False)  # fmt: skip


class FullDisk:
    """Files written under a directory whose path contains `where` fail with ENOSPC after
    `quota` bytes, as a disk that fills up would: the write that meets the end of the space
    writes what fits, then fails."""

    def __init__(self, monkeypatch, where: str, quota: int = 100_000):
        self.where, self.left = where, quota
        real_open = builtins.open
        disk = self

        class Filling(_FileProxy):
            def write(self, data):
                n = len(memoryview(data).cast("B")) if not isinstance(data, str) else len(data)
                if n > disk.left:
                    fits = data if isinstance(data, str) else memoryview(data).cast("B")
                    self.f.write(fits[: disk.left])
                    self.f.flush()
                    disk.left = 0
                    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
                disk.left -= n
                return self.f.write(data)

        def filling_open(file, mode="r", *args, **kwargs):
            f = real_open(file, mode, *args, **kwargs)
            return Filling(f) if ("w" in mode or "a" in mode) and where in str(file) else f

        monkeypatch.setattr(builtins, "open", filling_open)
        monkeypatch.setattr(io, "open", filling_open)


def test_a_full_disk_while_saving_is_one_line_and_leaves_nothing_half_written(tmp_path, capsys, monkeypatch):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=4, save_steps=2))
    FullDisk(monkeypatch, "checkpoint-4")
    rc, _, err = run_cli(capsys, "train", cfg)
    line = one_line_error(rc, err)
    assert f"cannot write {out / 'checkpoint-4'}" in line and "No space left on device" in line
    assert "needs" in line and "free" in line
    assert [s for s, _ in list_checkpoints(out)] == [2]
    assert load_fully(out / "checkpoint-2", ModelConfig.from_json(tmp_path / "model")) == 2
    assert not [p for p in out.iterdir() if p.name.startswith(".")]

    # The same for an export.
    monkeypatch.undo()
    FullDisk(monkeypatch, "export-target")
    rc, _, err = run_cli(capsys, "export", out / "checkpoint-2", tmp_path / "export-target")
    assert f"cannot write {tmp_path / 'export-target'}" in one_line_error(rc, err)
    assert not (tmp_path / "export-target").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]

    # And for the metrics of a run: one line, not a traceback.
    monkeypatch.undo()
    FullDisk(monkeypatch, "metrics.jsonl", quota=300)
    rc, _, err = run_cli(capsys, "train", cfg, f"output_dir={tmp_path / 'other'}")
    assert f"cannot write {tmp_path / 'other' / 'metrics.jsonl'}: No space left" in one_line_error(rc, err)


def test_a_disk_that_fills_while_metrics_are_written(tmp_path, capsys, monkeypatch):
    """The whole disk fills in the middle of a metrics record: the error names metrics.jsonl (not
    plan.json, which the run then fails to write too) and the file holds whole records only."""
    base = make_run(tmp_path)
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=6))
    disk = FullDisk(monkeypatch, str(out), quota=10**9)
    start = MetricsLogger.__init__

    def start_then_fill(self, *args, **kwargs):
        start(self, *args, **kwargs)
        disk.left = 700  # two records and part of a third

    monkeypatch.setattr(MetricsLogger, "__init__", start_then_fill)
    rc, _, err = run_cli(capsys, "train", cfg)
    assert f"cannot write {out / 'metrics.jsonl'}: No space left on device" in one_line_error(rc, err)
    monkeypatch.undo()
    text = (out / "metrics.jsonl").read_text()
    assert text.endswith("\n") and [r["step"] for r in metrics(out)] == [1, 2]


def test_checkpoints_are_written_by_parallel_writers_as_loadable_safetensors(tmp_path, capsys, monkeypatch):
    import threading

    from safetensors.torch import load_file

    from megatrain.host.split import to_bf16
    from megatrain.io import manifest, writing

    t = {f"t{i}": torch.randn(100, 50) for i in range(8)}
    both_writing = threading.Barrier(2, timeout=10)  # breaks unless two shards are written at once

    def get(key):
        if key in ("t0", "t2"):  # the first tensors of the first two shards
            both_writing.wait()
        return t[key]

    monkeypatch.setattr(os, "cpu_count", lambda: 4)
    with writing.AtomicDir(tmp_path / "d", manifest.MODEL, progress=True) as d:
        names = d.write_tensors(
            "model", [(k, tuple(v.shape)) for k, v in t.items()], torch.bfloat16, get, 20_000
        )
        d.commit()
    assert len(names) == 4 and not both_writing.broken
    got = {}
    for name in names:
        got.update(load_file(tmp_path / "d" / name))
    # in bf16 by the master weights' rounding (host/split.py), bit for bit
    assert all(torch.equal(got[k].view(torch.int16), to_bf16(v).view(torch.int16)) for k, v in t.items())
    assert manifest.verify(tmp_path / "d")
    assert "saving d/model" in capsys.readouterr().err  # the byte progress bar


# ---------------------------------------------------------------------------- what is saved when
def test_save_strategy_steps_epoch_and_no(tmp_path, monkeypatch):
    base = make_run(tmp_path, n=16)  # 4 optimizer steps per epoch
    cases = [
        (dict(max_steps=4, save_steps=0.5), [2, 4]),  # a fraction of all steps
        (dict(max_steps=5, save_steps=2), [2, 4, 5]),  # the last step is always saved
        (dict(num_train_epochs=2, save_strategy="epoch"), [4, 8]),
        (dict(max_steps=3, save_strategy="no"), []),
    ]
    for i, (kw, steps) in enumerate(cases):
        out = tmp_path / f"out{i}"
        train(TrainConfig(**base, output_dir=str(out), **kw))
        assert [s for s, _ in list_checkpoints(out)] == steps, kw
        assert (out / "final" / "model.safetensors").is_file()

    # save_strategy=no still saves a (complete) checkpoint when a signal stops the run.
    signal_after_step(monkeypatch, 2)
    out = tmp_path / "stopped"
    with pytest.raises(TrainingInterrupted, match="saved checkpoint-2"):
        train(TrainConfig(**base, output_dir=str(out), max_steps=4, save_strategy="no", save_only_model=True))
    assert load_fully(out / "checkpoint-2", ModelConfig.from_json(tmp_path / "model")) == 2

    with pytest.raises(ConfigError, match="save_strategy: must be one of steps, epoch, no"):
        TrainConfig(**base, save_strategy="best")
    with pytest.raises(ConfigError, match="save_steps: must be a whole number"):
        TrainConfig(**base, save_steps=2.5)


def test_save_only_model_checkpoints_cannot_be_resumed(tmp_path, capsys):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    cfg = write_yaml(
        tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=2, save_only_model=True)
    )
    assert run_cli(capsys, "train", cfg)[0] == 0
    ck = out / "checkpoint-2"
    assert (ck / "model.safetensors").is_file() and not (ck / "optimizer.safetensors").exists()
    assert not (ck / "rng_state.pt").exists()
    rc, _, err = run_cli(capsys, "train", cfg, "max_steps=4", "resume_from_checkpoint=true")
    line = one_line_error(rc, err)
    assert f"{ck}: saved with save_only_model=true" in line and f"model_name_or_path={ck}" in line
    # It is a model: its weights load (a new run can start from them).
    from megatrain.runtime import build_model

    model = build_model(ModelConfig.from_json(ck), weights=ck, device="cpu")
    assert torch.equal(
        model.state.master(), build_model(model.cfg, weights=out / "final", device="cpu").state.master()
    )


# ---------------------------------------------------------------------------- integrity
def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x10  # the last byte of the last tensor's data
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("name", ["model.safetensors", "optimizer.safetensors"])
def test_a_flipped_byte_is_refused_by_name(run, tmp_path, capsys, name):
    src = tmp_path / "checkpoint-2"
    shutil.copytree(run[0] / "out" / "checkpoint-2", src)
    flip_last_byte(src / name)
    model_cfg = ModelConfig.from_json(run[0] / "model")
    with pytest.raises(CheckpointError, match=f"{src / name}: checksum mismatch, the file is corrupt"):
        open_checkpoint(src, model_cfg)
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "run.yaml", dict(run[1], output_dir=str(out), max_steps=4))
    rc, _, err = run_cli(capsys, "train", cfg, f"resume_from_checkpoint={src}")
    assert f"{src / name}: checksum mismatch" in one_line_error(rc, err)
    assert not out.exists()
    if name == "model.safetensors":  # export reads the weights only
        rc, _, err = run_cli(capsys, "export", src, tmp_path / "hf")
        assert f"{src / name}: checksum mismatch" in one_line_error(rc, err)
        assert not (tmp_path / "hf").exists()


def test_a_checkpoint_without_manifest_resumes_with_a_warning(run, tmp_path, capsys):
    from megatrain.io import manifest

    src = tmp_path / "checkpoint-2"
    shutil.copytree(run[0] / "out" / "checkpoint-2", src)
    (src / manifest.MANIFEST).unlink()
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "run.yaml", dict(run[1], output_dir=str(out), max_steps=3))
    rc, stdout, err = run_cli(capsys, "train", cfg, f"resume_from_checkpoint={src}")
    assert rc == 0 and f"megatrain: warning: {src} has no checksums" in stdout + err


def test_save_schedule_counts_what_it_saves():
    from megatrain.io.outputs import SaveSchedule

    for every in (0, 1, 3, 5):
        for at_end in (True, False):
            for total in (1, 5, 6, 10):
                s = SaveSchedule(every, at_end, total)
                for start in range(total + 1):
                    assert s.count(start) == sum(s.due(k) for k in range(start + 1, total + 1))


def test_a_message_reaches_a_piped_stdout_at_once(tmp_path, monkeypatch):
    """Without a progress bar (stdout a pipe or a file, block-buffered) a message such as the
    "ready for step" line is written through at once, not when the buffer fills or the run ends."""
    raw = io.BytesIO()
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.BufferedWriter(raw, buffer_size=1 << 16)))
    log = MetricsLogger(tmp_path, total_steps=1, disable_tqdm=True)
    log.message("megatrain: ready for step 1")
    assert b"ready for step 1" in raw.getvalue()
    log.close()
