"""The disk tier's optimizer pass alone (host/disk.py): AdamW over the last `--units` units of a
model shape with their moments in `--offload-dir`, staged through the ring (read ahead, written
behind), beside the same AdamW with the moments in host memory, and beside the tier's I/O alone
(every block read and written back through the ring, no AdamW). Each pass takes the units last
first, as a step whose gradients land in the backward sweep does.

The cost model (costmodel.py) says a pass over the tier takes the longer of its AdamW and its I/O
(`tier_io_s`: each way at its rate, both together at their rate at once, as measured at start);
the table puts that beside what the passes took. Before
the table it checks that the tier's passes leave bitwise the master weights and moments of the
in-memory ones (`exact`).

    python bench/tierpass.py --model S --units 8 --offload-dir /work/tier --passes 4

Writes `<stamp>_<tag>.json` and `.md` in --out.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import tempfile
import time

import torch

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import packed  # noqa: E402  (a sibling module; bench/ is not a package)
from _report import write_once  # noqa: E402

from megatrain.engine.optim import AdamWConfig, HostAdamW  # noqa: E402
from megatrain.host.disk import RING_SLOTS, DiskTier, measure_rates  # noqa: E402
from megatrain.host.state import HostState, build_units  # noqa: E402
from megatrain.models.config import ModelConfig  # noqa: E402
from megatrain.planning.costmodel import tier_io_s  # noqa: E402
from megatrain.planning.planspec import Machine  # noqa: E402

GB = 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="S", help="a shape of bench/_shapes.py")
    ap.add_argument("--units", type=int, default=8, help="trailing units in the tier")
    ap.add_argument("--offload-dir", default=os.path.join(tempfile.gettempdir(), "megatrain-tier"))
    ap.add_argument("--passes", type=int, default=4, help="timed passes (after one that warms up)")
    ap.add_argument("--threads", type=int, help="torch's threads (default: its own)")
    ap.add_argument("--out", default=os.path.join(packed.REPO, "bench", "results"))
    ap.add_argument("--tag", default="tierpass")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as work:
        path, _, params = packed.write_model(args.model, 256, work)
        units = build_units(ModelConfig.from_json(path))
    rates = measure_rates(args.offload_dir)
    ram, disk = HostState(units), HostState(units)
    tier = DiskTier(disk, args.units, args.offload_dir)
    order = tier.units[::-1]
    gen = torch.Generator().manual_seed(0)
    grads = {}
    for u in order:
        weights = torch.empty(u.numel).normal_(generator=gen)
        ram.set_master(u, 0, weights)
        disk.set_master(u, 0, weights)
        grads[u.index] = torch.randn(u.numel, generator=gen).mul_(1e-3)
    tier.expect(order)
    opts = {"ram": HostAdamW(ram, AdamWConfig(lr=1e-4)), "tier": HostAdamW(disk, AdamWConfig(lr=1e-4))}

    def adamw(which: str, step: int) -> float:
        t0 = time.perf_counter()
        for u in order:
            opts[which].step_range(u, 0, u.numel, grads[u.index], 1e-4, step)
        return time.perf_counter() - t0

    def io_alone() -> float:
        t0 = time.perf_counter()
        for u in order:
            for a, b in tier.blocks(u, 0, u.numel):
                with tier.staged(u, a, b):
                    pass
        return time.perf_counter() - t0

    rows = []
    for step in range(1, args.passes + 2):  # the first warms up: its reads find unwritten blocks
        row = {"pass": step, "ram_s": adamw("ram", step), "tier_s": adamw("tier", step), "io_s": io_alone()}
        if step > 1:
            rows.append(row)
            print(row, flush=True)
    exact = all(
        torch.equal(ram.master(u), disk.master(u))
        and all(
            torch.equal(ram.flat(u, w), torch.cat(list(tier.pieces(u, w, 0, u.numel))))
            for w in ("exp_avg", "exp_avg_sq")
        )
        for u in order
    )
    tier.close()
    med = {k: statistics.median(r[k] for r in rows) for k in ("ram_s", "tier_s", "io_s")}
    machine = Machine("cpu", disk_read_bytes_s=rates.read_bytes_s, disk_write_bytes_s=rates.write_bytes_s,
                      disk_duplex_bytes_s=rates.duplex_bytes_s)  # fmt: skip
    io_model = tier_io_s(tier.nbytes, machine)
    predicted = max(med["ram_s"], io_model)
    tier_params = sum(u.numel for u in order)
    lines = [
        f"tier: {len(order)} units, {tier_params / 1e6:.0f}M params, {tier.nbytes / GB:.2f} GB of moments "
        f"({'O_DIRECT' if tier.direct else 'buffered'}), blocks of {tier.block_elems:,} elements, "
        f"a ring of {RING_SLOTS}; disk at start: read {rates.read_bytes_s / GB:.2f} GB/s, "
        f"written {rates.write_bytes_s / GB:.2f}, both at once {rates.duplex_bytes_s / GB:.2f}",
        "",
        "| pass | AdamW, moments in memory s | AdamW, moments in the tier s | tier I/O alone s |",
        "|---|---|---|---|",
        *(f"| {r['pass']} | {r['ram_s']:.3f} | {r['tier_s']:.3f} | {r['io_s']:.3f} |" for r in rows),
        "",
        f"median: in memory {med['ram_s']:.3f} s, in the tier {med['tier_s']:.3f} s, I/O alone "
        f"{med['io_s']:.3f} s ({2 * tier.nbytes / med['io_s'] / GB:.2f} GB/s read and written together)",
        f"cost model: max(AdamW {med['ram_s']:.3f}, I/O {io_model:.3f}) = {predicted:.3f} s; "
        f"measured {med['tier_s']:.3f} s ({100 * (med['tier_s'] / predicted - 1):+.0f}%)",
        f"exact (the tier's passes leave bitwise the in-memory ones' weights and moments): {exact}",
    ]
    text = "\n".join(lines)
    print(text)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python bench/tierpass.py " + " ".join(sys.argv[1:]),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "model": args.model,
        "num_params": params,
        "tier_units": len(order),
        "tier_bytes": tier.nbytes,
        "direct": tier.direct,
        "read_bytes_s": rates.read_bytes_s,
        "write_bytes_s": rates.write_bytes_s,
        "duplex_bytes_s": rates.duplex_bytes_s,
        "median": med,
        "predicted_s": predicted,
        "exact": exact,
    }
    write_once(args.out, args.tag, "the disk tier's optimizer pass", meta, rows, text, key="passes")
    if not exact:
        sys.exit("the tier's passes differ from the in-memory ones")


if __name__ == "__main__":
    main()
