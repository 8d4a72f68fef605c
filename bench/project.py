"""Projections, not measurements: what the plan says models too large for the lent machines would
need and do (host and GPU memory, placement, step time) on one GPU with a large host.

The plan is the one `megatrain train` makes before it allocates anything (placement.py): memory
from its model of every pool, step time from its cost model (costmodel.py). Where a run of the
same layer shape was measured (MEASURED: the 120B-class layer, four layers of it on an H200), its
probe's layer memory and FLOP rate and its host's AdamW rate are used; otherwise one layer's
activations come from the formula (probe.py) and the rates are the cost model's defaults. Both
models were checked against measured runs up to 32B (`bench/results/*_summary.md`: memory
within a few percent, step time within 8-15%); these sizes are beyond what was measured, so the
figures are arithmetic until a run says otherwise.

    python bench/project.py                     # every projection, table + JSON/markdown
    python bench/project.py --runs X120-16k-h200
    python bench/project.py --runs disk          # with a disk tier (DISK_RUNS): projection-disk.*

A disk tier's rates were not measured on a GPU machine: the runs of DISK_RUNS take a drive's
nominal rates (`--disk-read`, `--disk-write`, per drive, in GB/s; both at once, unless
`--disk-duplex` says otherwise, as if in turn) times the drives, as if striped linearly under one
file system: assumptions, printed with the results. A run measures its own (host/disk.py).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
from dataclasses import dataclass, replace

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import memory  # noqa: E402  (a sibling module; bench/ is not a package)

GiB = 2**30
# name: memory.py's run spec, the machine as the plan is told it (GPU memory, host memory)
RUNS = {
    "L70-16k-h200": ("L70:16384", "139GiB", "1024GiB"),
    "L70-64k-h200": ("L70:65536", "139GiB", "1024GiB"),
    "L70-64k-h100-1T": ("L70:65536", "78GiB", "1024GiB"),
    "X120-16k-h200": ("X120-full:16384", "139GiB", "1536GiB"),
    "X120-64k-h200": ("X120-full:65536", "139GiB", "1536GiB"),
    "X120-16k-h100": ("X120-full:16384", "78GiB", "1536GiB"),
    "X120-64k-h100-1T": ("X120-full:65536", "78GiB", "1024GiB"),
    "X120-16k-h200-off": ("X120-full:16384:gpu_state=off", "139GiB", "1536GiB"),
    "X120-16k-h200-off-gpustepauto": (
        "X120-full:16384:gpu_state=off,gpu_step_units=auto",
        "139GiB",
        "1536GiB",
    ),
}


# name: as RUNS, with the drives under offload_dir; `layers=max`: the deepest model of the shape's
# width the machine holds (memory.py's `at_largest`). gpu_state=off as the measured X120 run;
# `-auto`: the plan's default (no GPU state where the tier takes every unit).
DISK_RUNS = {
    "X120-16k-h200-512G-2nvme": ("X120-full:16384:gpu_state=off", "139GiB", "512GiB", 2),
    "X120-64k-h200-512G-2nvme": ("X120-full:65536:gpu_state=off", "139GiB", "512GiB", 2),
    "X120-16k-h200-512G-4nvme": ("X120-full:16384:gpu_state=off", "139GiB", "512GiB", 4),
    "X120-64k-h200-512G-4nvme": ("X120-full:65536:gpu_state=off", "139GiB", "512GiB", 4),
    "X120-16k-h200-512G-4nvme-auto": ("X120-full:16384", "139GiB", "512GiB", 4),
    "X120-16k-h200-512G-nodisk": ("X120-full:16384:gpu_state=off", "139GiB", "512GiB", 0),
    "Xmax-16k-h200-512G-2nvme": ("X120-full:16384:gpu_state=off,layers=max", "139GiB", "512GiB", 2),
    "Xmax-64k-h200-512G-2nvme": ("X120-full:65536:gpu_state=off,layers=max", "139GiB", "512GiB", 2),
    "Xmax-16k-h200-512G-4nvme": ("X120-full:16384:gpu_state=off,layers=max", "139GiB", "512GiB", 4),
    "Xmax-64k-h200-512G-4nvme": ("X120-full:65536:gpu_state=off,layers=max", "139GiB", "512GiB", 4),
    "Xmax-16k-h200-512G-nodisk": ("X120-full:16384:gpu_state=off,layers=max", "139GiB", "512GiB", 0),
}


@dataclass(frozen=True)
class Drives:
    """The drives under offload_dir as the plan is told them: ASSUMED rates of one drive, GB/s
    (nominal PCIe 4.0 x4 NVMe figures, not measured here), striped linearly over `count`."""

    count: int
    read: float = 6.5
    write: float = 5.0
    duplex: float | None = None  # read and written at once; None: in turn
    size: str = "3.84TB"  # each drive's room for the tier

    def machine(self, m):
        """`m` with this disk tier, where the run would measure its rates (plan.machine_of)."""
        from megatrain.config import parse_size

        if not self.count:
            return m
        duplex = self.duplex or 2 / (1 / self.read + 1 / self.write)
        return replace(
            m,
            disk_bytes=self.count * parse_size(self.size),
            disk_read_bytes_s=self.count * self.read * 1e9,
            disk_write_bytes_s=self.count * self.write * 1e9,
            disk_duplex_bytes_s=self.count * duplex * 1e9,
        )


# model -> (a memory.py record in results/, the run in it measuring the same layer shape)
MEASURED = {"X120-full": ("2026-11-22_2215_memory.json", "X120-16k")}


def measured_layer(model: str) -> tuple[dict | None, float | None, str]:
    """(the probe's layer memory, the host's AdamW rate in a step, where from) for `model`."""
    if model not in MEASURED:
        return None, None, "formula, default rates"
    file, name = MEASURED[model]
    with open(os.path.join(BENCH, "results", file)) as f:
        [run] = [r for r in json.load(f)["runs"] if r["name"] == name]
    return run["layer_mem"], run["machine"]["adam_params_s"], f"measured: {name} in results/{file}"


def project(spec: str, gpu: str, host: str, drives: Drives | None = None) -> dict:
    """The plan of one run on the stated machine, or the plan's one-line refusal."""
    from megatrain.config import parse_size
    from megatrain.planning.placement import Batch, Machine, PlanError, plan
    from megatrain.planning.planspec import ADAM_PARAMS_S
    from megatrain.planning.probe import LayerMemory

    run = memory.parse(spec)
    layer, adam, source = measured_layer(run["model"])
    machine = Machine(
        "cuda", parse_size(gpu), parse_size(host), gpu_capped=True, adam_params_s=adam or ADAM_PARAMS_S
    )
    machine = drives.machine(machine) if drives else machine
    if run.get("layers") == "max":
        run = memory.at_largest(run, machine, LayerMemory(**layer) if layer else None)
    cfg, seq, mbs, accum = memory.shape_of(run)
    batch = Batch(mbs * seq, accum, seq, 2, True, rows=mbs)
    out = {
        "spec": spec,
        "gpu": gpu,
        "host": host,
        "params": cfg.num_params,
        "tokens": run["tokens"],
        "layer": source,
        "layers": cfg.num_hidden_layers,
    }
    if drives:
        out["drives"] = vars(drives) | {
            "machine": {k: v for k, v in vars(machine).items() if k.startswith("disk")}
        }
    try:
        p = plan(cfg, batch, machine, memory.choices_of(run), LayerMemory(**layer) if layer else None)
    except PlanError as e:
        return {**out, "error": str(e)}
    step = p.step_time_s
    out |= {
        "plan": p.to_json(),
        "tokens_per_s": run["tokens"] / step,
        "model_tflops": 6 * cfg.num_params * run["tokens"] / step / 1e12,
    }
    return out | (disk_cost(cfg, batch, p, machine, layer) if p.disk_units else {})


def disk_cost(cfg, batch, p, machine, layer: dict | None) -> dict:
    """What the tier costs the plan's step: its I/O alone, and the step with the same placement on
    a disk that moved its bytes for free (the cost model's wait beyond the AdamW it overlaps)."""
    from megatrain.planning.costmodel import tier_io_s
    from megatrain.planning.footprint import evaluate
    from megatrain.planning.planspec import model_shape
    from megatrain.planning.probe import LayerMemory, formula_layer_memory

    lm = LayerMemory(**layer) if layer else formula_layer_memory(cfg, batch.compute_bytes)
    free = replace(machine, disk_read_bytes_s=1e18, disk_write_bytes_s=1e18, disk_duplex_bytes_s=1e18)
    without = evaluate(model_shape(cfg, lm), batch, p, free).step_time_s
    return {
        "tier_io_s": tier_io_s(p.disk, machine),
        "step_free_disk_s": without,
        "disk_share": 1 - without / p.step_time_s,
    }


def row(name: str, r: dict) -> str:
    if "error" in r:
        return f"| {name} | {r['params'] / 1e9:.0f}B | {r['gpu']} + {r['host']} | {r['tokens']:,} | refused: {r['error']} |"
    p = r["plan"]
    cells = [
        name,
        f"{r['params'] / 1e9:.0f}B",
        f"{r['gpu']} + {r['host']}",
        f"{r['tokens']:,}",
        memory.plan_str(p),
        f"{p['gpu_peak'] / GiB:.1f}",
        f"{p['host_total'] / GiB:.0f}",
        f"{p['host_total'] / r['params']:.1f}",
        f"{p['step_time_s']:.1f}",
        f"{r['tokens_per_s']:,.0f}",
        f"{r['model_tflops']:.0f}",
        r["layer"],
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| run | params | machine (GPU + host) | tokens/step | plan | GPU peak GiB | host GiB | host B/param | "
    "step s | tokens/s | model TFLOP/s | layer and rates |\n|" + "---|" * 12
)


RATES_NOTE = (
    "- one layer's memory and rates: measured where the last column says so, else the formula and the "
    "cost model's defaults\n"
)
DISK_HEADER = (
    "| run | params (layers) | machine (GPU + host) | drives | tokens/step | plan | host GiB | units on disk | "
    "disk GiB | step s | tokens/s | tier I/O s | step on a free disk s | disk's share of the step |\n|"
    + "---|"
    * 14
)


def disk_row(name: str, r: dict) -> str:
    head = [
        name,
        f"{r['params'] / 1e9:.1f}B ({r['layers']})",
        f"{r['gpu']} + {r['host']}",
        str(r["drives"]["count"]),
    ]
    if "error" in r:
        return "| " + " | ".join(head) + f" | {r['tokens']:,} | refused: {r['error']} |"
    p = r["plan"]
    cells = [
        f"{r['tokens']:,}",
        memory.plan_str(p),
        f"{p['host_total'] / GiB:.1f}",
        f"{p['disk_units']}",
        f"{p['disk'] / GiB:.0f}",
        f"{p['step_time_s']:.1f}",
        f"{r['tokens_per_s']:,.0f}",
    ]
    if p["disk_units"]:
        cells += [f"{r['tier_io_s']:.1f}", f"{r['step_free_disk_s']:.1f}", f"{100 * r['disk_share']:.0f}%"]
    else:
        cells += ["-", "-", "-"]
    return "| " + " | ".join(head + cells) + " |"


def weights_on_disk(runs: list[dict]) -> str:
    """Arithmetic, not a plan: the bytes per parameter and the disk traffic of a step with the
    master weights on disk too (not built), beside the tier that is, for accepted runs of one
    model on drives of several counts."""
    P, passes = runs[0]["params"], 2 if runs[0]["plan"]["grad_mode"] == "two_pass" else 1
    sweeps = 1 + passes  # the sweeps that fetch each unit's weights: forward, backward(s)

    def io(read: int, write: int, d: dict) -> str:  # seconds, as costmodel.tier_io_s counts them
        rate = d["disk_read_bytes_s"], d["disk_write_bytes_s"], d["disk_duplex_bytes_s"]
        return f"{max(read * P / rate[0], write * P / rate[1], (read + write) * P / rate[2]):.0f}"

    cases = [
        ("moments on disk (built)", 4, 8, 8, 8),
        (
            "weights and moments on disk, the sweeps reading fp32 weights from disk",
            0,
            12,
            12 + 4 * sweeps,
            12,
        ),
        (
            "weights and moments on disk, a bf16 copy of the weights in host memory for the sweeps",
            2,
            12,
            12,
            12,
        ),
    ]
    counts = [r["drives"]["count"] for r in runs]
    lines = [
        "| state placement | host B/param (state) | disk B/param | disk read B/param/step | disk written B/param/step | "
        f"host GB (state, all {P / 1e9:.1f}B) | disk GB | "
        + " | ".join(f"disk I/O s a step, {c} drives" for c in counts)
        + " |",
        "|" + "---|" * (7 + len(counts)),
    ]
    for what, host, disk, read, write in cases:
        ios = " | ".join(io(read, write, r["drives"]["machine"]) for r in runs)
        lines.append(
            f"| {what} | {host} | {disk} | {read} | {write} | {host * P / 1e9:.0f} | {disk * P / 1e9:.0f} | {ios} |"
        )
    return "\n".join(lines) + (
        f"\n\nThe plan's step is {runs[0]['plan']['grad_mode']} ({sweeps} sweeps fetch each unit's weights). "
        "Besides the state, host memory holds the plan's other pools (gradient staging, parked activations, the "
        "tier's ring, the runtime). A bf16 copy cast from the fp32 master weights is bitwise what the GPU casts "
        "today; the optimizer would write it back beside the master weights. Disk I/O: every unit's, at the "
        "assumed rates, counted as costmodel.tier_io_s counts the tier's; the step hides only what overlaps the "
        "AdamW over the same units.\n"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--runs", default=",".join(RUNS), help="names of RUNS and DISK_RUNS; `disk`: every one of DISK_RUNS"
    )
    ap.add_argument("--disk-read", type=float, default=Drives.read, help="GB/s one drive reads (assumed)")
    ap.add_argument("--disk-write", type=float, default=Drives.write, help="GB/s one drive writes (assumed)")
    ap.add_argument(
        "--disk-duplex", type=float, help="GB/s one drive reads and writes at once (default: in turn)"
    )
    ap.add_argument("--disk-size", default=Drives.size, help="each drive's room for the tier")
    ap.add_argument("--out", default=os.path.join(BENCH, "results"))
    a = ap.parse_args()
    names = [m for n in a.runs.split(",") if n for m in (DISK_RUNS if n == "disk" else [n])]
    unknown = [n for n in names if n not in RUNS and n not in DISK_RUNS]
    if unknown:
        ap.error(f"--runs: unknown {unknown} (choose from {', '.join([*RUNS, *DISK_RUNS])}, or disk)")
    drives = Drives(0, a.disk_read, a.disk_write, a.disk_duplex, a.disk_size)
    results = {n: project(*RUNS[n]) for n in names if n in RUNS}
    results |= {
        n: project(*DISK_RUNS[n][:3], replace(drives, count=DISK_RUNS[n][3])) for n in names if n in DISK_RUNS
    }
    tables = []
    if any(n in RUNS for n in names):
        tables.append(HEADER + "\n" + "\n".join(row(n, r) for n, r in results.items() if n in RUNS))
    if any(n in DISK_RUNS for n in names):
        tables.append(
            DISK_HEADER + "\n" + "\n".join(disk_row(n, r) for n, r in results.items() if n in DISK_RUNS)
        )
    table = "\n\n".join(tables)
    print(table)
    now = datetime.datetime.now(datetime.timezone.utc)
    disk = any(n in DISK_RUNS for n in names)
    stem = os.path.join(a.out, f"{now:%Y-%m-%d_%H%M}_projection" + ("-disk" if disk else ""))
    command = " ".join(["python bench/project.py", *sys.argv[1:]])
    notes = tail = ""
    if disk:
        duplex = f"{a.disk_duplex} GB/s" if a.disk_duplex else "as if in turn (the two rates' harmonic mean)"
        notes = (
            f"- ASSUMED, not measured (no disk rate has been measured on a GPU machine): per drive {a.disk_read} GB/s "
            f"read, {a.disk_write} GB/s written, both at once {duplex}, {a.disk_size} of room; the drives "
            "striping linearly under one file system (a RAID 0 array; the tier writes one file, with "
            "4 I/O threads of 64 MiB requests: whether they keep several drives busy is not measured)\n"
        )
        notes += f"- layer and AdamW rate: {next(iter(results.values()))['layer']}\n"
        # the named shape's accepted runs at its first step size (not the deepest that fits)
        ok = [
            r
            for n, r in results.items()
            if n in DISK_RUNS and r.get("plan") and "layers=max" not in r["spec"]
        ]
        ok = {
            r["drives"]["count"]: r for r in ok if r["tokens"] == ok[0]["tokens"] and r["plan"]["disk_units"]
        }
        if ok:
            tail = f"\n## Master weights on disk too (arithmetic, not built)\n\n{weights_on_disk(list(ok.values()))}"
    with open(stem + ".json", "w") as f:
        json.dump({"date": now.isoformat(), "command": command, "runs": results}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(
            f"# Projections from the plan (projected, not measured)\n\n- date: {now.isoformat()}\n- command: `{command}`\n"
            + (RATES_NOTE if any(n in RUNS for n in names) else "")
            + notes
            + "\n"
            + table
            + "\n"
            + tail
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
