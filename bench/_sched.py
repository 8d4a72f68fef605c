"""Each thread's time on a CPU and waiting for one, from the kernel's scheduler statistics
(/proc/self/task/<tid>/schedstat: nanoseconds run, nanoseconds waited on a run queue).

Taken before and after a benchmark's timed steps, it says where a step's CPU time goes and
whether the host optimizer's threads (the worker, its OpenMP threads and clipadam's, all under
engine/osthreads.py's OPTIMIZER_THREAD) wait for cores, preempted by the process's other threads,
or run their whole time and step slower on them (host memory shared with the link's copies).
"""

from __future__ import annotations

import os
import threading

TASKS = "/proc/self/task"


def snapshot(tasks: str = TASKS) -> dict[int, tuple[str, int, int]] | None:
    """{thread id: (name, ns on a CPU, ns waiting on a run queue)} for the calling process's
    threads, or None where the kernel keeps no scheduler statistics."""
    try:
        tids = os.listdir(tasks)
    except OSError:
        return None
    out = {}
    for tid in tids:
        try:
            with open(f"{tasks}/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"{tasks}/{tid}/schedstat") as f:
                run, wait = (int(x) for x in f.read().split()[:2])
        except (OSError, ValueError):
            continue  # a thread that ended between the listing and the read
        out[int(tid)] = (name, run, wait)
    return out or None


def per_step(before, after, steps: int, launching: int | None = None) -> dict[str, dict] | None:
    """Seconds a step on a CPU and waiting for one, by thread name (the `launching` thread id apart,
    as "launching"), over the threads alive at `after` (one born since counts from zero); the
    number of threads of each name that ran at all. None without both snapshots."""
    if not before or not after or steps <= 0:
        return None
    launching = threading.get_native_id() if launching is None else launching
    groups: dict[str, dict] = {}
    for tid, (name, run, wait) in after.items():
        _, run0, wait0 = before.get(tid, (name, 0, 0))
        if run == run0 and wait == wait0:
            continue  # idle over the steps
        g = groups.setdefault(
            "launching" if tid == launching else name, {"threads": 0, "cpu_s": 0.0, "wait_s": 0.0}
        )
        g["threads"] += 1
        g["cpu_s"] += (run - run0) / 1e9 / steps
        g["wait_s"] += (wait - wait0) / 1e9 / steps
    return dict(sorted(groups.items(), key=lambda kv: -kv[1]["cpu_s"]))


def describe(groups: dict[str, dict] | None) -> str:
    """One line: each group's threads, CPU seconds and run-queue seconds a step."""
    if not groups:
        return "-"
    return "; ".join(
        f"{name} ({g['threads']} threads) {g['cpu_s']:.3f} s on a CPU, {g['wait_s']:.3f} s waiting for one"
        for name, g in groups.items()
    )
