"""A run owns its output_dir: a second run there is refused naming the first, a dead run's lock
is taken over, and leftovers of a killed writer are recognised as such. CPU, tiny models."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

from test_checkpoint import make_run, one_thread, subprocess_env, write_yaml  # noqa: F401 (fixture)
from test_cli import run_cli
from test_outputs import one_line_error, snapshot

from megatrain.io.ownership import LOCK, Owner

# Run `megatrain ARGS`, holding its first optimizer step until the file GATE exists (it writes
# GATE.waiting once it is there).
HOLD_AT_FIRST_STEP = """
import os, sys, time
from megatrain.cli import main
from megatrain.engine.engine import Engine

gate, step = sys.argv[1], Engine.step

def held(self, lr, coef):
    out = step(self, lr, coef)
    open(gate + ".waiting", "w").close()
    while not os.path.exists(gate):
        time.sleep(0.01)
    return out

Engine.step = held
sys.exit(main(sys.argv[2:]))
"""


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 120.0) -> None:
    t0 = time.time()
    while not path.exists():
        assert proc.poll() is None, f"the first run exited early with {proc.returncode}"
        assert time.time() - t0 < timeout, "timed out"
        time.sleep(0.02)


def _dead_pid() -> int:
    """The pid of a process that has exited."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_a_second_run_into_the_same_output_dir_is_refused_naming_the_first(tmp_path, capsys):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=3, save_steps=1))
    gate = tmp_path / "gate"
    log = open(tmp_path / "first.log", "w")  # noqa: SIM115
    first = subprocess.Popen(
        [sys.executable, "-c", HOLD_AT_FIRST_STEP, str(gate), "train", str(cfg)],
        env=subprocess_env(),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        _wait_for(Path(f"{gate}.waiting"), first)
        owner = Owner.from_json((out / LOCK).read_text())
        assert owner is not None and owner.pid == first.pid and owner.host == socket.gethostname()
        before = snapshot(out)
        # Even with overwrite_output_dir (which would replace its final/ and checkpoints).
        for extra in ([], ["overwrite_output_dir=true"], ["resume_from_checkpoint=false"]):
            rc, _, err = run_cli(capsys, "train", cfg, *extra)
            line = one_line_error(rc, err)
            assert f"output_dir: {out} is in use by another run (pid {first.pid} on {owner.host}" in line
            assert snapshot(out) == before
        gate.touch()
        assert first.wait(timeout=120) == 0
    finally:
        first.kill()
        log.close()
    assert (out / "final").is_dir() and (out / "checkpoint-3").is_dir()
    assert not (out / LOCK).exists()  # released at the end
    assert "megatrain: saved" in (tmp_path / "first.log").read_text()


def test_a_dead_runs_lock_is_taken_over_and_another_hosts_is_refused(tmp_path, capsys):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=1))
    here = socket.gethostname()
    # A run on another host: megatrain cannot tell whether it still runs.
    elsewhere = Owner(1234, f"not-{here}", "2026-01-02 03:04:05")
    (out / LOCK).write_text(elsewhere.to_json())
    rc, _, err = run_cli(capsys, "train", cfg)
    line = one_line_error(rc, err)
    assert f"output_dir: {out} is in use by a run on another host (pid 1234 on not-{here}" in line
    assert f"if that run has ended, delete {out / LOCK} and start again" in line
    assert snapshot(out) == {LOCK: elsewhere.to_json().encode()}

    # A dead process of this host; then a live pid that is another process now (pid reuse).
    me = Owner.me()
    for stale in (Owner(_dead_pid(), here, "2026-01-02 03:04:05"), Owner(me.pid, here, me.started, -1)):
        (out / LOCK).write_text(stale.to_json())
        rc, stdout, err = run_cli(capsys, "train", cfg, "overwrite_output_dir=true")
        assert rc == 0, err
        assert (
            f"megatrain: took over {out / LOCK} from a run that ended without releasing it ({stale})"
            in stdout
        )
        assert (out / "final").is_dir() and not (out / LOCK).exists()


def test_a_refused_or_failed_run_leaves_no_lock_and_no_directory(tmp_path, capsys):
    base = make_run(tmp_path)
    out = tmp_path / "a" / "b" / "out"
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=1))
    rc, _, err = run_cli(capsys, "train", cfg, f"dataset={tmp_path / 'nowhere.jsonl'}")
    assert "no such file" in one_line_error(rc, err) and not (tmp_path / "a").exists()
    # A lock that is not megatrain's (or half written) is never taken over.
    out.mkdir(parents=True)
    (out / LOCK).write_text("mine")
    rc, _, err = run_cli(capsys, "train", cfg)
    assert f"output_dir: {out / LOCK} is not a lock megatrain can read" in one_line_error(rc, err)
    assert snapshot(out) == {LOCK: b"mine"}


def test_plan_takes_no_lock(tmp_path, capsys):
    base = make_run(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "then"}))
    cfg = write_yaml(tmp_path / "run.yaml", dict(base, output_dir=str(out), max_steps=1))
    rc, _, err = run_cli(capsys, "plan", cfg)
    assert rc == 0, err
