"""Data parallel scaling: megatrain on 1 and on N GPUs of one machine (one shared host state),
beside DeepSpeed ZeRO-3 offload on the same GPUs, at the same global batch.

Every (system, GPUs) runs as bench.py's workers do (bench/_systems.py, its own process group and
timeout); with N > 1 the worker is started by torchrun, one rank per GPU, and rank 0 records.
Host memory is the machine's (MemTotal - MemAvailable, sampled), so memory the ranks share is
counted once: megatrain's should stay ~12 bytes per parameter whatever N.

megatrain's data-parallel designs (`--designs`, layout.py) run side by side on N > 1 GPUs:
`plain` (whole units copied to every GPU, gradients all-reduced), `sharded` (each GPU copies 1/N
of every unit and the GPUs all-gather the rest, gradients reduce-scattered) and `partitioned`
(sharded, with every GPU a simulated machine holding only its part of the host state: the
several-machine path on one machine). On one GPU they are the same run, made once.

    python bench/multigpu.py                    # 8B shape, 64k tokens/step, 1 vs 2 GPUs
    python bench/multigpu.py --gpus 1,2,4 --systems megatrain
    python bench/multigpu.py --systems megatrain --designs plain,sharded,partitioned
    python bench/multigpu.py --dry-run          # tiny model on the CPU (gloo): checks the plumbing
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _report  # noqa: E402  (siblings; bench/ is not a package)

from bench import BENCH, MODELS, derive, gpu_name, meminfo, param_counts, parse_tokens, run_worker  # noqa: E402

SYSTEMS = ("megatrain", "deepspeed")
# megatrain's data-parallel designs: (ddp_traffic, simulated machines: one per GPU or None).
DESIGNS = {"plain": ("plain", False), "sharded": ("sharded", False), "partitioned": ("sharded", True)}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="B", choices=sorted(MODELS), help="shape preset (default B, 8B)")
    ap.add_argument("--gpus", default="1,2", help="comma list of GPU counts (default 1,2)")
    ap.add_argument("--tokens-per-step", default="64k", help="global tokens per optimizer step")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--mbs", type=int, default=4, help="sequences per micro-batch and GPU")
    ap.add_argument("--steps", type=int, default=7, help="timed steps incl. warm-up")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--systems", default="megatrain,deepspeed")
    ap.add_argument("--designs", default="plain", help=f"megatrain's, on N > 1 GPUs: {', '.join(DESIGNS)}")
    ap.add_argument(
        "--runs",
        default=None,
        help="system:GPUs pairs instead of every system on every count, e.g. megatrain:1,deepspeed:2",
    )
    ap.add_argument(
        "--max-host-memory",
        default=None,
        help="megatrain's host budget per machine, e.g. 240GiB (hosts whose MemTotal grows as memory is used)",
    )
    ap.add_argument(
        "--max-gpu-memory", default=None, help="megatrain's GPU budget, e.g. 70GiB (an 80 GB card's)"
    )
    ap.add_argument("--timeout", type=float, default=540.0, help="seconds per run")
    ap.add_argument("--out", default=str(BENCH / "results"))
    ap.add_argument("--dry-run", action="store_true", help="tiny model, CPU allowed (no DeepSpeed)")
    a = ap.parse_args(argv)
    if a.dry_run:
        a.model, a.seq, a.mbs, a.steps, a.warmup, a.tokens_per_step = "tiny", 64, 1, 4, 2, "512"
        a.systems = "megatrain"
    a.gpus = [int(g) for g in a.gpus.split(",")]
    a.tokens = parse_tokens(a.tokens_per_step)[0]
    a.systems = [s.strip() for s in a.systems.split(",") if s.strip()]
    if a.runs:
        try:
            a.runs = [(s, int(g)) for s, g in (r.split(":") for r in a.runs.split(","))]
        except ValueError:
            ap.error(f"--runs: expected system:GPUs pairs, got {a.runs!r}")
        a.systems, a.gpus = sorted({s for s, _ in a.runs}), sorted({g for _, g in a.runs})
    else:
        a.runs = [(s, g) for g in a.gpus for s in a.systems]
    if bad := [s for s in a.systems if s not in SYSTEMS]:
        ap.error(f"--systems: unknown {bad} (choose from {', '.join(SYSTEMS)})")
    a.designs = [d.strip() for d in a.designs.split(",") if d.strip()]
    if bad := [d for d in a.designs if d not in DESIGNS]:
        ap.error(f"--designs: unknown {bad} (choose from {', '.join(DESIGNS)})")
    for g in a.gpus:
        if g < 1 or a.tokens % (a.seq * a.mbs * g):
            ap.error(
                f"--tokens-per-step {a.tokens} does not split into {g} GPUs x micro-batches of {a.mbs} x {a.seq}"
            )
    return a


def write_md(records: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    def f(v, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    head = "| system | design | GPUs | step s | tokens/s | x 1 GPU | vs plain | vs DeepSpeed | host used GiB | bytes/param | peak RSS GiB | GPU peak GiB | error |"
    rows = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in records:
        rows.append(
            f"| {r['system']} | {r.get('design') or '-'} | {r['gpus']} | {f(r.get('step_s'), '.3f')} | "
            f"{f(r.get('tokens_per_s'), ',.0f')} | {f(r.get('scaling'), '.2f')} | {f(r.get('vs_plain'), '.2f')} | "
            f"{f(r.get('vs_deepspeed'), '.2f')} | {f(r.get('host_sys_peak_gib'), '.1f')} | "
            f"{f(r.get('host_bytes_per_param'), '.1f')} | {f(r.get('host_peak_rss_gib'), '.1f')} | "
            f"{f(r.get('gpu_peak_gib'), '.1f')} | {(r.get('error') or '')[:70]} |"
        )
    text = [
        f"# megatrain data parallel: {meta['stem']}",
        "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}",
        f"- model: {meta['model']} {meta['shape']}, {_report.params_str(meta['params'])} params, seq {meta['seq_len']}",
        f"- global batch: {meta['tokens_per_step']:,} tokens/step, the same on every GPU count",
        f"- command: `{meta['command']}`",
        "",
        *rows,
        "",
        "host used: the machine's MemTotal - MemAvailable at its peak, above what it was before the run",
        "(shared memory counted once); bytes/param: that over the parameter count. Peak RSS: the largest",
        "process's (it counts the shared pages it touched, so ranks' RSS overlap). GPU peak: rank 0.",
        "design: megatrain's data-parallel design (plain, sharded, partitioned: one GPU is the same run for all);",
        "vs plain: tokens/s over the plain design's on as many GPUs.",
        "",
    ]
    path.write_text("\n".join(text))


def add_ratios(records: list[dict[str, Any]]) -> None:
    for r in records:
        one = next((x for x in records if x["system"] == r["system"] and x["gpus"] == 1), None)
        ds = next((x for x in records if x["system"] == "deepspeed" and x["gpus"] == r["gpus"]), None)
        plain = next(
            (x for x in records if x.get("design") == "plain" and x["gpus"] == r["gpus"] and x is not r), None
        )
        ok = r.get("tokens_per_s")
        r["scaling"] = ok / one["tokens_per_s"] if ok and one and one.get("tokens_per_s") else None
        r["vs_deepspeed"] = ok / ds["tokens_per_s"] if ok and ds and ds.get("tokens_per_s") else None
        r["vs_plain"] = ok / plain["tokens_per_s"] if ok and plain and plain.get("tokens_per_s") else None
        used = r.get("host_sys_peak_bytes")
        r["host_bytes_per_param"] = used / r["params"] if used else None


def runs(systems: list[str], designs: list[str], gpus: int) -> list[tuple[str, str | None]]:
    """(system, design) of each run on `gpus` GPUs: megatrain once per design on several GPUs,
    once (plain) on one, where the designs are the same run; other systems have none."""
    out = []
    for system in systems:
        if system != "megatrain":
            out.append((system, None))
        else:
            out += [(system, d) for d in (designs if gpus > 1 else designs[:1])]
    return out


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    now = dt.datetime.now().astimezone()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{now:%Y-%m-%d_%H%M}_multigpu{'-dry' if a.dry_run else ''}"
    logs = out / f"{stem}_logs"
    logs.mkdir(exist_ok=True)
    shape, pc = MODELS[a.model], param_counts(MODELS[a.model])
    mem = meminfo()
    host = f"{os.cpu_count()} CPU cores, {mem.get('MemTotal', 0) / 2**30:.0f} GiB host RAM"
    meta = {
        "command": "python " + shlex.join(sys.argv if argv is None else ["bench/multigpu.py", *argv]),
        "date": now.isoformat(timespec="seconds"),
        "device": f"{gpu_name() or 'no GPU'}; {host}",
        "model": a.model,
        "shape": shape,
        "params": pc["params"],
        "seq_len": a.seq,
        "tokens_per_step": a.tokens,
        "stem": stem,
    }
    print(f"# {meta['command']}\n# {meta['device']}\n# outputs {out / stem}.*", flush=True)
    records: list[dict[str, Any]] = []
    for system_, gpus in a.runs:
        for system, design in runs([system_], a.designs, gpus):
            name = system if design is None else f"{system}-{design}"
            rec: dict[str, Any] = {
                "system": system,
                "design": design,
                "gpus": gpus,
                "model": a.model,
                **pc,
                "seq_len": a.seq,
                "tokens_per_step": a.tokens,
                "mbs": a.mbs,
                "date": meta["date"],
                "command": meta["command"],
                "log": f"{logs.name}/{name}_{gpus}gpu.log",
                "error": None,
            }
            spec = {
                "system": system,
                "shape": shape,
                "seq": a.seq,
                "tokens_per_step": a.tokens,
                "mbs": a.mbs,
                "steps": a.steps,
                "warmup": a.warmup,
                "smoke": a.dry_run,
                "nproc": gpus,
                "max_host_memory": a.max_host_memory,
                "max_gpu_memory": a.max_gpu_memory,
            }
            if design is not None:
                traffic, machines = DESIGNS[design]
                spec.update(ddp_traffic=traffic, nnodes=gpus if machines else None)
            print(f"{name} on {gpus} GPU(s) ...", flush=True)
            t0 = time.monotonic()
            raw = run_worker(spec, a.timeout, out / rec["log"])
            raw.pop("params", None)
            rec.update(raw)
            derive(rec, shape)
            records.append(rec)
            add_ratios(records)
            status = rec["error"] or f"{rec['tokens_per_s']:,.0f} tokens/s"
            print(f"    {status} ({time.monotonic() - t0:.0f} s)", flush=True)
            _report.write_json(records, meta, out / f"{stem}.json")
            write_md(records, meta, out / f"{stem}.md")
    print((out / f"{stem}.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())
