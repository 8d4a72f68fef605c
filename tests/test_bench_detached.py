"""bench/detached.py: benchmark commands run one after another in a process of their own session,
read back by later commands, packed into one archive; nothing overwritten."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "bench"
sys.path.insert(0, str(BENCH))
import detached  # noqa: E402


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(BENCH / "detached.py"), *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_commands_run_in_order_detached_and_their_states_and_outputs_are_read_back(tmp_path):
    q = tmp_path / "q"
    started = _cli(
        "start",
        str(q),
        "--",
        "echo first; pwd",
        "sleep 0.3; echo second >&2; exit 7",
        "echo third",
        cwd=tmp_path,
    )
    assert started.returncode == 0, started.stderr
    pid = int((q / "queue.pid").read_text())
    assert os.getsid(pid) != os.getsid(0)  # a session of its own: it outlives the starting command
    done = _cli("status", str(q), "--wait", "60", cwd=tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    states = detached.states(q)
    assert [s["state"] for s in states] == ["ended"] * 3
    assert [s["rc"] for s in states] == [0, 7, 0]
    assert (q / "0.out").read_text().splitlines() == ["first", str(tmp_path)]  # the starter's folder
    assert (q / "1.out").read_text() == "second\n"
    assert float((q / "1.start").read_text()) >= float((q / "0.start").read_text())
    assert float((q / "2.start").read_text()) >= float((q / "1.start").read_text()) + 0.3  # one after another
    assert "[1] ended, exit 7" in done.stdout and "    second" in done.stdout


def test_status_says_running_and_exits_3_until_the_queue_ends(tmp_path):
    q = tmp_path / "q"
    assert _cli("start", str(q), "--", "sleep 3", "echo after", cwd=tmp_path).returncode == 0
    deadline = time.time() + 30
    while not (q / "0.start").exists() and time.time() < deadline:
        time.sleep(0.05)
    early = _cli("status", str(q), cwd=tmp_path)
    assert early.returncode == detached.RUNNING
    assert "[0] running" in early.stdout and "[1] waiting" in early.stdout
    assert _cli("status", str(q), "--wait", "60", cwd=tmp_path).returncode == 0


def test_a_queue_whose_process_is_gone_is_lost_not_running(tmp_path):
    q = tmp_path / "q"
    detached.start(q, ["sleep 30", "echo never"])
    pid = int((q / "queue.pid").read_text())
    deadline = time.time() + 30
    while not (q / "0.start").exists() and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(pid, 9)
    os.waitpid(pid, 0)
    assert [s["state"] for s in detached.states(q)] == ["lost", "lost"]
    assert detached.status(q, 0, 0) == 0  # nothing left to wait for


def test_nothing_is_overwritten(tmp_path):
    q = tmp_path / "q"
    q.mkdir()
    (q / "mine.txt").write_text("the user's")
    refused = _cli("start", str(q), "--", "echo x", cwd=tmp_path)
    assert refused.returncode != 0 and "not an empty folder" in refused.stderr
    assert sorted(p.name for p in q.iterdir()) == ["mine.txt"]
    archive = tmp_path / "out.tgz"
    archive.write_text("kept")
    with pytest.raises(SystemExit, match="exists"):
        detached.pack(q, archive)
    assert archive.read_text() == "kept"


def test_pack_writes_the_folder_as_one_archive(tmp_path):
    q = tmp_path / "q"
    assert (
        _cli(
            "start", str(q), "--", "mkdir -p q/results && echo 1 > q/results/r.json", cwd=tmp_path
        ).returncode
        == 0
    )
    assert _cli("status", str(q), "--wait", "60", cwd=tmp_path).returncode == 0
    archive = tmp_path / "q.tgz"
    assert _cli("pack", str(q), str(archive), cwd=tmp_path).returncode == 0
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    assert {"q/queue.json", "q/0.out", "q/0.end", "q/queue.done", "q/results/r.json"} <= names
    assert not (tmp_path / "q.tgz.tmp").exists()
