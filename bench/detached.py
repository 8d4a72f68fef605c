"""Benchmark commands one after another, in a process that outlives the shell that started them.

A remote GPU machine is often reached through commands with a time limit of their own, shorter
than a queue of benchmarks (a 14.77B run beside DeepSpeed takes ~10 minutes, four GPUs beside
DeepSpeed another ten). `start` launches the queue in a process of its own session and returns at
once; each command runs alone, in order, through bash, its output in DIR/<n>.out; `status` (any
later command on the same machine) tells each one's state, waiting up to `--wait` seconds for the
queue to end; `pack` writes DIR as one archive, to copy off the machine.

    python bench/detached.py start /tmp/q -- "python bench/bench.py --model Q14 ..." "python bench/multigpu.py ..."
    python bench/detached.py status /tmp/q --wait 540     # exit 0 once every command has ended, 3 before
    python bench/detached.py pack /tmp/q $OUT/queue.tgz

Nothing is overwritten: `start` refuses a folder that is not empty, `pack` an archive that exists.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

RUNNING = 3  # status's exit code while commands are still waiting or running


def start(folder: Path, commands: list[str]) -> int:
    """Write the queue to `folder` (new or empty) and start the process that runs it; its pid."""
    if not commands:
        sys.exit("detached.py start: no commands after --")
    if folder.exists() and (not folder.is_dir() or any(folder.iterdir())):
        sys.exit(
            f"detached.py start: {folder} is not an empty folder: choose a new one (nothing in it is overwritten)"
        )
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / "queue.json.tmp"
    tmp.write_text(json.dumps({"commands": commands, "cwd": os.getcwd(), "started": time.time()}, indent=1))
    tmp.replace(folder / "queue.json")
    with open(folder / "queue.log", "w") as log:
        p = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), "_run", str(folder)],
            stdout=log,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,  # outlives the command that started it
        )
    (folder / "queue.pid").write_text(str(p.pid))
    return p.pid


def run(folder: Path) -> None:
    """The detached process: each command in turn, its start, output, exit status and end."""
    queue = json.loads((folder / "queue.json").read_text())
    for n, command in enumerate(queue["commands"]):
        (folder / f"{n}.start").write_text(str(time.time()))
        with open(folder / f"{n}.out", "w") as out:
            rc = subprocess.run(
                ["bash", "-c", command], cwd=queue["cwd"], stdout=out, stderr=subprocess.STDOUT
            ).returncode
        (folder / f"{n}.end").write_text(json.dumps({"rc": rc, "time": time.time()}))
    (folder / "queue.done").write_text(str(time.time()))


def states(folder: Path) -> list[dict]:
    """Each command's state: waiting, running (seconds so far) or ended (exit status, seconds);
    `lost` where the queue's process is gone before it ended (the machine restarted, a kill)."""
    queue = json.loads((folder / "queue.json").read_text())
    alive = _alive(int((folder / "queue.pid").read_text()))
    out = []
    for n, command in enumerate(queue["commands"]):
        s = {"n": n, "command": command}
        begun, end = folder / f"{n}.start", folder / f"{n}.end"
        if end.exists():
            e = json.loads(end.read_text())
            s.update(state="ended", rc=e["rc"], seconds=e["time"] - float(begun.read_text()))
        elif begun.exists():
            s.update(state="running" if alive else "lost", seconds=time.time() - float(begun.read_text()))
        else:
            s.update(state="waiting" if alive else "lost")
        out.append(s)
    return out


def status(folder: Path, wait: float, tail: int) -> int:
    """Print each command's state and the last `tail` lines of its output, once the queue has
    ended or `wait` seconds have passed; 0 when every command has ended, RUNNING before."""
    deadline = time.time() + wait
    while any(s["state"] in ("waiting", "running") for s in states(folder)) and time.time() < deadline:
        time.sleep(min(0.5, max(0.0, deadline - time.time())))
    current = states(folder)
    for s in current:
        head = f"[{s['n']}] {s['state']}"
        if "rc" in s:
            head += f", exit {s['rc']}"
        if "seconds" in s:
            head += f", {s['seconds']:.0f} s"
        print(f"{head}: {s['command']}")
        out = folder / f"{s['n']}.out"
        if tail and out.exists():
            for line in out.read_text(errors="replace").splitlines()[-tail:]:
                print(f"    {line}")
    return RUNNING if any(s["state"] in ("waiting", "running") for s in current) else 0


def pack(folder: Path, archive: Path) -> None:
    """`folder` as one gzip'd tar at `archive` (new), written whole or not at all."""
    if archive.exists():
        sys.exit(f"detached.py pack: {archive} exists: choose a new name (nothing is overwritten)")
    tmp = archive.with_name(archive.name + ".tmp")
    with tarfile.open(tmp, "w:gz") as tar:
        tar.add(folder, arcname=folder.name)
    tmp.replace(archive)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="what", required=True)
    a = sub.add_parser("start", help="start the commands after -- one after another, detached")
    a.add_argument("folder", type=Path)
    a.add_argument("commands", nargs="+", help="shell command lines, after --")
    b = sub.add_parser("status", help="each command's state (exit 3 while the queue runs)")
    b.add_argument("folder", type=Path)
    b.add_argument("--wait", type=float, default=0.0, help="seconds to wait for the queue to end")
    b.add_argument("--tail", type=int, default=5, help="lines of each command's output")
    c = sub.add_parser("pack", help="the folder as one .tar.gz")
    c.add_argument("folder", type=Path)
    c.add_argument("archive", type=Path)
    d = sub.add_parser("_run")  # the detached process
    d.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    if args.what == "start":
        pid = start(args.folder, args.commands)
        print(
            f"started {len(args.commands)} command(s) one after another, pid {pid}, output in {args.folder}/"
        )
        return 0
    if args.what == "status":
        return status(args.folder, args.wait, args.tail)
    if args.what == "pack":
        pack(args.folder, args.archive)
        return 0
    run(args.folder)
    return 0


if __name__ == "__main__":
    sys.exit(main())
