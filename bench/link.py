"""What bounds the all-in-host step's traffic: PCIe each way and both at once, alone and beside
the CPU AdamW (bench/host-only.md, "Both directions at once").

The GPU-stepped runs never moved more than ~60 GB/s host->device and device->host together,
where copies alone reach 90-100. Either the step's schedule leaves one direction idle, or the host
cannot feed both directions while its optimizer threads stream their own state through the same
memory. This script tells them apart: page-locked copies of `--block` bytes queued back to back
on two streams (as the transport's and the stepper's are), for `--seconds`, with and without the
fused CPU AdamW running over `--params` elements of fp32 state on the optimizer's threads.

    python bench/link.py --params 1.3e9 --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _report import write_once  # noqa: E402

from megatrain.planning.placement import optimizer_threads  # noqa: E402

GB = 1e9
CASES = [  # (name, host->device, device->host, CPU AdamW)
    ("AdamW alone", False, False, True),
    ("host->device", True, False, False),
    ("device->host", False, True, False),
    ("both ways", True, True, False),
    ("host->device + AdamW", True, False, True),
    ("device->host + AdamW", False, True, True),
    ("both ways + AdamW", True, True, True),
]


class Adam:
    """fp32 master, gradient and moments of `n` elements, stepped a chunk at a time."""

    def __init__(self, n: int, chunk: int = 1 << 25):
        self.p, self.g, self.m, self.v = (torch.rand(n) for _ in range(4))
        self.step_no, self.chunk, self.n = torch.full((), 3.0), chunk, n

    def chunk_step(self, a: int) -> int:
        b = min(self.n, a + self.chunk)
        torch._fused_adamw_(
            [self.p[a:b]], [self.g[a:b]], [self.m[a:b]], [self.v[a:b]], [], [self.step_no],
            amsgrad=False, lr=1e-5, beta1=0.9, beta2=0.95, weight_decay=0.0, eps=1e-8, maximize=False,
        )  # fmt: skip
        return b - a


def run_case(h2d: bool, d2h: bool, adam: Adam | None, block: int, seconds: float, dev) -> dict:
    """Copies queued back to back for about `seconds` on each direction asked for, while the
    calling thread steps `adam` over and over (if given) until the copies are done."""
    streams, events, moved = [], [], 0  # the streams kept until their copies are timed
    reps = max(1, int(seconds * 50 * GB / block))  # about `seconds` at 50 GB/s
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for on, src, dst in ((h2d, _HOST[0], _DEV[0]), (d2h, _DEV[1], _HOST[1])):
        if not on:
            continue
        s = torch.cuda.Stream(dev)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(s):
            start.record(s)
            for _ in range(reps):
                dst.copy_(src, non_blocking=True)
            end.record(s)
        streams.append(s)
        events.append((start, end))
        moved += reps * block
    stepped, a = 0, 0
    if adam is not None:
        deadline = t0 + seconds
        while (events and not all(e.query() for _, e in events)) or (
            not events and time.perf_counter() < deadline
        ):
            stepped += adam.chunk_step(a)
            a = (a + adam.chunk) % adam.n
    t_adam = time.perf_counter() - t0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    copy_s = max((s.elapsed_time(e) / 1e3 for s, e in events), default=0.0)
    return {
        "copy_GBps": moved / copy_s / GB if copy_s else None,
        "copy_GB": moved / GB,
        "copy_s": copy_s,
        "adam_Gparams_s": stepped / t_adam / 1e9 if adam is not None else None,
        "wall_s": wall,
    }


_HOST: list[torch.Tensor] = []
_DEV: list[torch.Tensor] = []


def measure(params: int, block: int, seconds: float) -> list[dict]:
    dev = torch.device("cuda")
    _HOST[:] = [torch.empty(block, dtype=torch.uint8, pin_memory=True).fill_(1) for _ in range(2)]
    _DEV[:] = [torch.empty(block, dtype=torch.uint8, device=dev).fill_(1) for _ in range(2)]
    adam = Adam(params)
    adam.chunk_step(0)  # warm the kernel and the threads
    run_case(True, True, None, block, 0.2, dev)
    rows = []
    for name, h2d, d2h, with_adam in CASES:
        r = run_case(h2d, d2h, adam if with_adam else None, block, seconds, dev)
        rows.append({"case": name, **r})
        print(f"{name:24s} " + "  ".join(f"{k} {v:.2f}" for k, v in r.items() if v is not None), flush=True)
    return rows


def table(rows: list[dict]) -> str:
    cell = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    out = ["| case | copies GB/s (both directions together) | CPU AdamW G params/s |", "|---|---|---|"]
    out += [f"| {r['case']} | {cell(r['copy_GBps'])} | {cell(r['adam_Gparams_s'])} |" for r in rows]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1.3e9, help="elements of AdamW state (28 B each a pass)")
    ap.add_argument("--block", type=float, default=256e6, help="bytes per copy")
    ap.add_argument("--seconds", type=float, default=2.0, help="length of each case")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("link.py: needs a CUDA device")
    torch.set_num_threads(optimizer_threads())
    rows = measure(int(args.params), int(args.block), args.seconds)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "params": int(args.params),
        "command": "python bench/link.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    print(table(rows))
    if args.out:
        write_once(args.out, "link", "PCIe beside the CPU AdamW", meta, rows, table(rows))
    return {**meta, "rows": rows}


if __name__ == "__main__":
    main()
