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
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

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


def project(spec: str, gpu: str, host: str) -> dict:
    """The plan of one run on the stated machine, or the plan's one-line refusal."""
    from megatrain.config import parse_size
    from megatrain.planning.placement import Batch, Machine, PlanError, plan
    from megatrain.planning.planspec import ADAM_PARAMS_S
    from megatrain.planning.probe import LayerMemory

    run = memory.parse(spec)
    cfg, seq, mbs, accum = memory.shape_of(run)
    layer, adam, source = measured_layer(run["model"])
    machine = Machine(
        "cuda", parse_size(gpu), parse_size(host), gpu_capped=True, adam_params_s=adam or ADAM_PARAMS_S
    )
    batch = Batch(mbs * seq, accum, seq, 2, True, rows=mbs)
    out = {
        "spec": spec,
        "gpu": gpu,
        "host": host,
        "params": cfg.num_params,
        "tokens": run["tokens"],
        "layer": source,
    }
    try:
        p = plan(cfg, batch, machine, memory.choices_of(run), LayerMemory(**layer) if layer else None)
    except PlanError as e:
        return {**out, "error": str(e)}
    step = p.step_time_s
    return {
        **out,
        "plan": p.to_json(),
        "tokens_per_s": run["tokens"] / step,
        "model_tflops": 6 * cfg.num_params * run["tokens"] / step / 1e12,
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default=",".join(RUNS))
    ap.add_argument("--out", default=os.path.join(BENCH, "results"))
    a = ap.parse_args()
    names = [n for n in a.runs.split(",") if n]
    unknown = [n for n in names if n not in RUNS]
    if unknown:
        ap.error(f"--runs: unknown {unknown} (choose from {', '.join(RUNS)})")
    results = {n: project(*RUNS[n]) for n in names}
    table = HEADER + "\n" + "\n".join(row(n, r) for n, r in results.items())
    print(table)
    now = datetime.datetime.now(datetime.timezone.utc)
    stem = os.path.join(a.out, f"{now:%Y-%m-%d_%H%M}_projection")
    command = "python bench/project.py" + (f" --runs {a.runs}" if a.runs != ",".join(RUNS) else "")
    with open(stem + ".json", "w") as f:
        json.dump({"date": now.isoformat(), "command": command, "runs": results}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(
            f"# Projections from the plan (not measured)\n\n- date: {now.isoformat()}\n- command: `{command}`\n"
            "- one layer's memory and rates: measured where the last column says so, else the formula "
            "and the cost model's defaults\n\n" + table + "\n"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
