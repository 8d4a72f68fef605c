"""Replay recorded bench/ runs through the current memory and step-time models.

Each bench/memory.py run recorded its plan, the layer memory the probe measured and the peak of
allocated GPU memory in each phase of a step (forward sweep, loss head, backward sweep). This
recomputes the model's prediction for each phase from the same inputs, so a change to
placement.py can be checked against every measurement taken so far without a GPU:

    python bench/replay.py bench/results/*_memory.json bench/results/*_x2.json
    python bench/replay.py --units bench/results/<file>.json   # per unit of the backward sweep
    python bench/replay.py --steps bench/results/*.json         # step time, every run that can
    python bench/replay.py --rates bench/results/*x2-B16k*.json # auto's plan at the AdamW rate
                                                                # assumed, and at the step's own

A record of several GPUs (bench/multigpu.py) is replayed for one of its processes, in its world.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from memory import batch_of, plan_str, shape_of  # noqa: E402

from megatrain.parallel.layout import Layout  # noqa: E402
from megatrain.planning import footprint  # noqa: E402
from megatrain.planning.footprint import evaluate  # noqa: E402
from megatrain.planning.placement import Choices, Machine, Plan, phase_peaks, plan, unit_peaks  # noqa: E402
from megatrain.planning.planspec import FETCH_BYTES, LANDING_BYTES, PCIE_BYTES_S, model_shape  # noqa: E402
from megatrain.planning.probe import LayerMemory  # noqa: E402

GiB = 2**30


@contextlib.contextmanager
def as_recorded(record: dict):
    """The memory and step-time models with the link bytes of the system a record ran: before the
    master weights were held as two halves (a plan without `halves`), a fetch in bf16 moved the
    fp32 master (4 B a parameter, converted on the GPU through an fp32 landing buffer), or with
    the bf16 copy of the weights the run kept (`host_weight_copy`) 2 B; today's fetch moves the
    master's bf16 half (planspec.py's FETCH_BYTES), and GPU-stepped units' weights cross as halves
    through chunks of their own. Records of today's system replay as they are."""
    plan = record.get("plan") if isinstance(record.get("plan"), dict) else {}
    if plan.get("halves"):
        yield
        return
    saved = dict(FETCH_BYTES), dict(LANDING_BYTES), footprint.HALVES_STAGES
    copy = bool(plan.get("host_weight_copy"))
    FETCH_BYTES.update({2: 2 if copy else 4, 4: 4})
    LANDING_BYTES.update({2: 0 if copy else 4, 4: 0})
    footprint.HALVES_STAGES = 0  # GPU-stepped units' state crossed in fp32, straight into scratch
    try:
        yield
    finally:
        FETCH_BYTES.update(saved[0])
        LANDING_BYTES.update(saved[1])
        footprint.HALVES_STAGES = saved[2]


def _plan(record: dict) -> Plan:
    """The record's plan; records made before GPU-stepped state was prestaged measured it loaded
    after the clip."""
    return replace(Plan.from_json(record["plan"]), prestage=record["plan"].get("prestage", False))


def machine_of(record: dict) -> Machine:
    """The machine a run was planned for, at today's PCIe rate: the plan never measures the link,
    so a record holds the constant of its day, not a measurement (its GPU and host budgets, layer
    and AdamW rates were measured where the run happened)."""
    return replace(Machine.from_json(record["machine"]), pcie_bytes_s=PCIE_BYTES_S)


def runs_in(path: str) -> list[dict]:
    """The records of a results file: memory.py's and bench.py's {"runs": [...]}, multigpu.py's
    list."""
    with open(path) as f:
        data = json.load(f)
    runs = data.get("runs", []) if isinstance(data, dict) else data
    return [r for r in runs if isinstance(r, dict)]


def _model(record: dict) -> str | None:
    """A record's shape preset: its own key, or (multigpu.py's records before they had one) the
    `--model` of its command, multigpu.py's default B where the command names none."""
    if "model" in record or "multigpu.py" not in record.get("command", ""):
        return record.get("model")
    args = record["command"].split()
    return args[args.index("--model") + 1] if "--model" in args else "B"


def run_of(record: dict) -> dict | None:
    """memory.py's run spec of a record: memory.py's own, or bench.py's and multigpu.py's shape and
    step, a process's share of it (None for a record without a plan to replay)."""
    if "run" in record:
        return record.get("resolved_run") or record["run"]
    model = _model(record)
    if not isinstance(record.get("plan"), dict) or model is None:
        return None  # early bench.py records wrote the plan as text
    return {
        "model": model,
        "tokens": record["tokens_per_step"] // record.get("gpus", 1),
        "seq": record["seq_len"],
        "mbs": record["mbs"],
    }


def world_of(record: dict) -> Layout:
    """The data-parallel world a run's processes formed: its machine's, or multigpu.py's GPUs and
    design (one process where a record says neither)."""
    if "machine" in record:
        return machine_of(record).world
    return Layout(ranks=record.get("gpus", 1), sharded=record.get("design") == "sharded")


def step_time(record: dict) -> tuple[float, Plan]:
    """(predicted step seconds, the plan as evaluated) of a run that recorded its plan, machine and
    measured layer: the current cost model on the run's own inputs."""
    run = run_of(record)
    shape = model_shape(shape_of(run)[0], LayerMemory(**record["layer_mem"]))
    with as_recorded(record):
        p = evaluate(shape, batch_of(run), _plan(record), machine_of(record))
    return p.step_time_s, p


def replay(record: dict) -> dict[str, tuple[int, int]]:
    """phase -> (measured, predicted) peak bytes."""
    run = run_of(record)  # seq=limit / layers=max: as resolved
    lm, world = LayerMemory(**record["layer_mem"]), world_of(record)
    with as_recorded(record):
        predicted = phase_peaks(shape_of(run)[0], batch_of(run), _plan(record), lm, world)
    return {k: (v, predicted[k]) for k, v in record["phase_peaks"].items() if isinstance(v, int)}


def replay_units(record: dict) -> dict[int, tuple[int, int]]:
    """unit -> (measured, predicted) peak bytes while it is differentiated, for a record that
    measured them (bench/_phases.py)."""
    run = run_of(record)
    lm, world = LayerMemory(**record["layer_mem"]), world_of(record)
    with as_recorded(record):
        predicted = unit_peaks(shape_of(run)[0], batch_of(run), _plan(record), lm, world)
    return {int(u): (v, predicted[int(u)]) for u, v in record.get("unit_peaks", {}).items()}


def _name(record: dict) -> str:
    """A record's run: memory.py's name, or the system (and data-parallel design) and its GPUs."""
    if "name" in record:
        return record["name"]
    design = f"-{record['design']}" if record.get("design") else ""
    return f"{record.get('system')}{design}" + (f" x{record['gpus']}" if record.get("gpus", 1) > 1 else "")


def _replayable(record: dict, key: str) -> bool:
    """The record measured `key` and holds what a replay needs: the plan, step and probed layer
    (multigpu.py's records before 2026-11-27 kept no layer)."""
    return key in record and "layer_mem" in record and run_of(record) is not None


def _steps(paths: list[str]) -> None:
    """Each run's measured step beside the cost model's, for every record that can be replayed."""
    print("| file | run | plan | measured s | predicted s | error |")
    print("|---|---|---|---|---|---|")
    for path in paths:
        for r in runs_in(path):
            if not r.get("step_s") or not _replayable(r, "plan"):
                continue
            t, _ = step_time(r)
            print(
                f"| {os.path.basename(path)} | {_name(r)} | {plan_str(r['plan'])} | {r['step_s']:.3f} | "
                f"{t:.3f} | {100 * (t / r['step_s'] - 1):+.1f}% |"
            )


def auto_at(record: dict, adam_params_s: float) -> Plan:
    """The plan `gpu_step_units: auto` makes for a run's own inputs, as the run's system moved its
    bytes (`as_recorded`), with the host AdamW at `adam_params_s` (its kept layer graphs and its
    embedding's fetch, rows or the table, as the run had them)."""
    run = run_of(record)
    m = replace(machine_of(record), adam_params_s=adam_params_s)
    off = record.get("system") == "megatrain-host" or run.get("gpu_state") == "off"
    c = Choices(
        gpu_state="off" if off else "auto",
        gpu_step_units=None,
        keep_layers=record["plan"]["keep_layers"] or None,
        embedding_rows=record["plan"].get("embed_rows", False),  # as the run fetched the embedding
    )
    cfg, b, lm = shape_of(run)[0], batch_of(run), LayerMemory(**record["layer_mem"])
    with as_recorded(record):
        return plan(cfg, b, m, c, lm)


def _rates(paths: list[str]) -> None:
    """Each run's `auto` plan at the host AdamW rate its plan assumed and, where the run timed it
    inside the step (`host_adam_params_s`), at that rate."""
    print(
        "| file | run | measured s | AdamW G params/s: plan's / in the step | auto at the plan's rate | at the step's |"
    )
    print("|---|---|---|---|---|---|")

    def cell(p: Plan) -> str:
        return f"{p.gpu_stepped_units} stepped, {p.step_time_s:.3f} s"

    for path in paths:
        for r in runs_in(path):
            if not r.get("step_s") or not _replayable(r, "plan"):
                continue
            assumed, measured = machine_of(r).adam_params_s, r.get("host_adam_params_s")
            at = [cell(auto_at(r, rate)) if rate else "-" for rate in (assumed, measured)]
            rates = f"{assumed / 1e9:.2f} / " + (f"{measured / 1e9:.2f}" if measured else "-")
            print(
                f"| {os.path.basename(path)} | {_name(r)} | {r['step_s']:.3f} | {rates} | {at[0]} | {at[1]} |"
            )


def main() -> None:
    if "--rates" in sys.argv:
        sys.argv.remove("--rates")
        return _rates(sys.argv[1:])
    if "--steps" in sys.argv:
        sys.argv.remove("--steps")
        return _steps(sys.argv[1:])
    if "--units" in sys.argv:  # each unit of each run that measured them: where model and allocator part
        sys.argv.remove("--units")
        print("| file | run | unit | measured GiB | predicted GiB | measured - predicted |")
        print("|---|---|---|---|---|---|")
        for path in sys.argv[1:]:
            for r in runs_in(path):
                for u, (m, q) in (
                    sorted(replay_units(r).items(), reverse=True) if _replayable(r, "unit_peaks") else ()
                ):
                    print(
                        f"| {os.path.basename(path)} | {_name(r)} | {u} | {m / GiB:.2f} | {q / GiB:.2f} | "
                        f"{(m - q) / GiB:+.2f} |"
                    )
        return
    print(
        "| file | run | plan | forward | head | backward | peak measured GiB | peak predicted GiB | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for path in sys.argv[1:]:
        for r in runs_in(path):
            if not _replayable(r, "phase_peaks"):
                continue
            ph = replay(r)
            mode = plan_str(r["plan"])
            cells = [f"{m / GiB:.2f} / {q / GiB:.2f}" for m, q in ph.values()]
            meas, pred = max(m for m, _ in ph.values()), max(q for _, q in ph.values())
            print(
                f"| {os.path.basename(path)} | {_name(r)} | {mode} | {' | '.join(cells)} | "
                f"{meas / GiB:.2f} | {pred / GiB:.2f} | {100 * (pred / meas - 1):+.1f}% |"
            )


if __name__ == "__main__":
    main()
