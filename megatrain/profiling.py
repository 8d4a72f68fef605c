"""Traces of the steps a run names (`profile_steps`): torch.profiler over each such step (its
rollout, scoring and update), written to output_dir/profile/ as a Chrome trace (step-N.json.gz:
Perfetto, chrome://tracing) and a table of the ops and kernels by device time (step-N.txt);
with several processes each rank writes its own (step-N-rank-R.*); a name taken already gets
a number (step-N.1.*), never overwritten."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import torch

TABLE_ROWS = 40  # ops and kernels in step-N.txt, the dearest first


def _name(step: int, rank: int, world_size: int) -> str:
    return f"step-{step}" if world_size == 1 else f"step-{step}-rank-{rank}"


@contextlib.contextmanager
def profiled(steps: list[int], step: int, out: Path, rank: int = 0, world_size: int = 1) -> Iterator[None]:
    """Trace the body where `step` is one of `steps` (else run it as it is); the files are
    written whole (a temporary name, then renamed) once the step has run."""
    if step not in steps:
        yield
        return
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        yield
        if cuda:
            torch.cuda.synchronize()
    folder = out / "profile"
    folder.mkdir(parents=True, exist_ok=True)
    base = _free(folder, _name(step, rank, world_size))
    sort = "device_time_total" if cuda else "cpu_time_total"
    _write(
        Path(f"{base}.txt"),
        lambda p: p.write_text(prof.key_averages().table(sort_by=sort, row_limit=TABLE_ROWS)),
    )
    _write(Path(f"{base}.json.gz"), lambda p: prof.export_chrome_trace(str(p)))


def _free(folder: Path, name: str) -> Path:
    """folder/name, or name.1, name.2, ... where a file of that name is there already (a resumed
    run tracing the step again, a file of the user's): nothing there is overwritten."""
    taken = lambda base: Path(f"{base}.txt").exists() or Path(f"{base}.json.gz").exists()  # noqa: E731
    base, n = folder / name, 0
    while taken(base):
        n += 1
        base = folder / f"{name}.{n}"
    return base


def _write(path: Path, write) -> None:
    """`write(tmp)` then rename tmp to `path` (the temporary keeps `path`'s suffixes: the trace's
    .gz says to compress it)."""
    tmp = path.with_name(f".tmp-{os.getpid()}-{path.name}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
