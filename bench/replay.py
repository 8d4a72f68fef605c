"""Replay recorded bench/memory.py runs through the current memory model.

Each run recorded its plan, the layer memory the probe measured and the peak of allocated GPU
memory in each phase of a step (forward sweep, loss head, backward sweep). This recomputes the
model's prediction for each phase from the same inputs, so a change to placement.py can be
checked against every measurement taken so far without a GPU:

    python bench/replay.py bench/results/*_memory.json bench/results/*_x2.json
    python bench/replay.py --units bench/results/<file>.json   # per unit of the backward sweep
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import replace

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from memory import batch_of, plan_str, shape_of  # noqa: E402

from megatrain.planning.placement import Plan, phase_peaks, unit_peaks  # noqa: E402
from megatrain.planning.probe import LayerMemory  # noqa: E402

GiB = 2**30


def _plan(record: dict) -> Plan:
    """The record's plan; records made before GPU-stepped state was prestaged measured it loaded
    after the clip."""
    return replace(Plan.from_json(record["plan"]), prestage=record["plan"].get("prestage", False))


def replay(record: dict) -> dict[str, tuple[int, int]]:
    """phase -> (measured, predicted) peak bytes."""
    run = record.get("resolved_run") or record["run"]  # seq=limit / layers=max: as resolved
    plan = _plan(record)
    predicted = phase_peaks(shape_of(run)[0], batch_of(run), plan, LayerMemory(**record["layer_mem"]))
    return {k: (v, predicted[k]) for k, v in record["phase_peaks"].items() if isinstance(v, int)}


def replay_units(record: dict) -> dict[int, tuple[int, int]]:
    """unit -> (measured, predicted) peak bytes while it is differentiated, for a record that
    measured them (bench/_phases.py)."""
    run = record.get("resolved_run") or record["run"]
    plan = _plan(record)
    predicted = unit_peaks(shape_of(run)[0], batch_of(run), plan, LayerMemory(**record["layer_mem"]))
    return {int(u): (v, predicted[int(u)]) for u, v in record.get("unit_peaks", {}).items()}


def main() -> None:
    if "--units" in sys.argv:  # each unit of each run that measured them: where model and allocator part
        sys.argv.remove("--units")
        print("| file | run | unit | measured GiB | predicted GiB | measured - predicted |")
        print("|---|---|---|---|---|---|")
        for path in sys.argv[1:]:
            with open(path) as f:
                for r in json.load(f)["runs"]:
                    for u, (m, q) in (
                        sorted(replay_units(r).items(), reverse=True) if "unit_peaks" in r else ()
                    ):
                        name = os.path.basename(path)
                        print(
                            f"| {name} | {r['name']} | {u} | {m / GiB:.2f} | {q / GiB:.2f} | {(m - q) / GiB:+.2f} |"
                        )
        return
    print(
        "| file | run | plan | forward | head | backward | peak measured GiB | peak predicted GiB | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for path in sys.argv[1:]:
        with open(path) as f:
            runs = json.load(f)["runs"]
        for r in runs:
            if "phase_peaks" not in r:
                continue
            ph = replay(r)
            mode = plan_str(r["plan"])
            cells = [f"{m / GiB:.2f} / {q / GiB:.2f}" for m, q in ph.values()]
            meas, pred = max(m for m, _ in ph.values()), max(q for _, q in ph.values())
            print(
                f"| {os.path.basename(path)} | {r['name']} | {mode} | {' | '.join(cells)} | "
                f"{meas / GiB:.2f} | {pred / GiB:.2f} | {100 * (pred / meas - 1):+.1f}% |"
            )


if __name__ == "__main__":
    main()
