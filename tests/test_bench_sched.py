"""bench/_sched.py: each thread's CPU and run-queue time by name, and the host optimizer's threads
under one name (the transport names its worker; OpenMP threads started from it inherit it)."""

from __future__ import annotations

import itertools
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from megatrain.engine import clipadam, osthreads
from megatrain.engine.osthreads import OPTIMIZER_THREAD, name_os_thread
from megatrain.host.split import split

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import _sched  # noqa: E402  (bench/ is not a package)

LINUX = Path(_sched.TASKS).is_dir()


def test_per_step_groups_threads_by_name_and_divides_by_the_steps():
    before = {
        1: ("python", 10**9, 0),
        2: ("megatrain-optim", 0, 0),
        3: ("megatrain-optim", 5, 5),
        4: ("idle", 7, 7),
    }
    after = {
        1: ("python", 3 * 10**9, 2 * 10**8),  # the launching thread
        2: ("megatrain-optim", 4 * 10**9, 10**9),
        3: ("megatrain-optim", 2 * 10**9 + 5, 5),
        4: ("idle", 7, 7),  # ran nothing over the steps: left out
        5: ("pt_autograd", 10**9, 0),  # born since: counted from zero
    }
    got = _sched.per_step(before, after, steps=2, launching=1)
    assert got == {
        "megatrain-optim": {"threads": 2, "cpu_s": 3.0, "wait_s": 0.5},
        "launching": {"threads": 1, "cpu_s": 1.0, "wait_s": 0.1},
        "pt_autograd": {"threads": 1, "cpu_s": 0.5, "wait_s": 0.0},
    }
    assert list(got) == ["megatrain-optim", "launching", "pt_autograd"]  # most CPU first
    line = _sched.describe(got)
    assert line.startswith("megatrain-optim (2 threads) 3.000 s on a CPU, 0.500 s waiting for one; launching")
    assert _sched.per_step(None, after, 2) is None and _sched.per_step(before, after, 0) is None
    assert _sched.describe(None) == "-"


def test_a_host_without_scheduler_statistics_gives_none(tmp_path):
    assert _sched.snapshot(str(tmp_path / "absent")) is None
    (tmp_path / "7").mkdir()  # a thread whose files cannot be read is skipped
    assert _sched.snapshot(str(tmp_path)) is None


@pytest.mark.skipif(not LINUX, reason="/proc/self/task is Linux's")
def test_the_optimizer_thread_and_its_openmp_threads_share_its_name():
    """A thread named as the transport names its worker, running a parallel torch op on two
    threads: its name covers it and the OpenMP thread it started, and both ran; the launching
    thread is reported apart."""
    seen: dict = {}
    threads = torch.get_num_threads()

    def work() -> None:
        seen["named"] = name_os_thread(OPTIMIZER_THREAD)
        before = _sched.snapshot()
        torch.set_num_threads(2)
        x = torch.ones(8_000_000)
        for _ in range(20):
            x = x * 1.000001 + 1e-7
        seen["groups"] = _sched.per_step(
            before, _sched.snapshot(), steps=1, launching=threading.get_native_id()
        )

    t = threading.Thread(target=work)
    try:
        t.start()
        t.join()
    finally:
        torch.set_num_threads(threads)
    assert seen["named"] is True and len(OPTIMIZER_THREAD) <= 15
    groups = seen["groups"]
    assert groups["launching"]["threads"] == 1 and groups["launching"]["cpu_s"] > 0
    assert groups[OPTIMIZER_THREAD]["threads"] >= 1 and groups[OPTIMIZER_THREAD]["cpu_s"] > 0


@pytest.mark.skipif(not LINUX, reason="/proc/self/task is Linux's")
def test_clipadams_threads_take_the_optimizers_name_whichever_thread_starts_them(monkeypatch):
    """The kernel's threads started from the launching thread (a benchmark's standalone pass
    does) still show as the host optimizer's: the step's CPU time is not split over names."""
    monkeypatch.setattr(clipadam, "MIN_PER_THREAD", 64)
    kernel = clipadam.ClipAdamW()
    n = 4096
    p, g, m, v = split(torch.zeros(n)), torch.ones(n), torch.zeros(n), torch.ones(n)  # the master's halves
    before = _sched.snapshot()
    kernel.step(p, g, m, v, 0.5, 1e-3, 1, (0.9, 0.95), 1e-8, 0.0, threads=3)
    after = _sched.snapshot()
    born = {tid: name for tid, (name, *_) in after.items() if tid not in before}
    assert born and set(born.values()) == {OPTIMIZER_THREAD}, born
    assert len(born) <= 3  # the pool's threads, at most one for each part


@pytest.mark.skipif(not LINUX, reason="/proc/self/task is Linux's")
def test_every_optimizer_thread_is_started_and_named_before_its_first_call(monkeypatch):
    """A thread slow to start (here each a little slower than the last) lets the first take every
    job: the pool's threads still all start, and all under the optimizer's name, before `run`
    returns."""
    started = itertools.count()

    def slowly(name):
        time.sleep(0.05 * next(started))
        return name_os_thread(name)

    monkeypatch.setattr(osthreads, "name_os_thread", slowly)
    threads = osthreads.OptimizerThreads("megatrain-test")
    before = _sched.snapshot()
    threads.run(4, lambda: None)
    born = {tid: name for tid, (name, *_) in _sched.snapshot().items() if tid not in before}
    assert len(born) == 4 and set(born.values()) == {OPTIMIZER_THREAD}, born
