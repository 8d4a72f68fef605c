"""Long context: one sequence per optimizer step at 128k to 1M tokens, the plan's prediction
beside what each run measured.

Each run is bench/memory.py's worker in its own process (it plans as `megatrain train` does,
trains a few steps of random tokens and reads the allocator's and the host's peaks); this script
chooses the runs and reports tokens/s and model TFLOP/s counting causal attention:

    model FLOPs per step = 6 x params x tokens + 3 x layers x 2 x tokens x seq x q_dim

(the attention term is QK^T and PV of the forward, halved for the causal mask, and twice that for
the backward; the engine's recompute is not counted). tokens/s and TFLOP/s are of the last step
(the first one compiles the layer).

    python bench/longctx.py --runs B128k,B256k --out bench/results
    CUDA_VISIBLE_DEVICES=0 python bench/longctx.py --runs B512k     # one GPU of a 2-GPU host
    python bench/longctx.py --dry-run                                # the plans, on any machine

A step at 512k tokens takes about ten minutes and at 1M about thirty, longer than a command may
run on a lent machine. `--detach DIR` starts one process of its own session that runs them one
after another (each alone on the machine), writing into DIR, and returns at once; `--collect DIR` (any later command on the same machine) reports each run as
running, failed or done, and writes the results table once every run has finished:

    CUDA_VISIBLE_DEVICES=0 python bench/longctx.py --runs B512k --detach /tmp/longctx
    python bench/longctx.py --collect /tmp/longctx --out bench/results

`--dry-run` plans every run without a GPU (one layer's memory from the formula, not measured),
for a GPU with DRY_GPU free and DRY_HOST available host memory unless the run caps them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import time

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import memory  # noqa: E402  (a sibling module; bench/ is not a package)

GiB = 2**30
RUNS = {  # memory.py's run specs: one sequence of `seq` tokens per step
    "B128k": "B:131072:seq=131072,mbs=1,steps=3",
    # an H200 with a 128 GiB host
    "B256k": "B:262144:seq=262144,mbs=1,steps=2",
    # one GPU of a two-GPU machine with 256 GiB (its MemTotal grows as it is used: cap it)
    "B512k": "B:524288:seq=524288,mbs=1,steps=1,max_host_memory=240GiB",
    "A1M": "A:1048576:seq=1048576,mbs=1,steps=1,max_host_memory=240GiB",
    # the longest sequence the plan accepts on this machine (its measured layer), and 3% more,
    # which the preflight must refuse: `megatrain plan`'s "longest context" line, trained
    "B-limit": "B:0:seq=limit,steps=1",
    "B-limit+3%": "B:0:seq=limit,limit_scale=1.03,steps=1",
    "tiny": "tiny:8192:seq=8192,mbs=1,steps=2",
}
DRY_GPU, DRY_HOST = "139GiB", "120GiB"  # an H200's free memory; MemAvailable of a 128 GiB host


def model_flops(cfg, tokens: int, seq: int) -> float:
    """Model FLOPs of one optimizer step (see the module docstring)."""
    q_dim = cfg.num_attention_heads * cfg.head_dim
    return 6 * cfg.num_params * tokens + 3 * cfg.num_hidden_layers * 2 * tokens * seq * q_dim


def dry_plan(run: dict) -> dict:
    """What a run's record would hold before it ran: the plan for the assumed machine."""
    from megatrain.config import parse_size
    from megatrain.planning.placement import Batch, Machine, PlanError, plan

    gpu = parse_size(run.get("max_gpu_memory", DRY_GPU))
    host = parse_size(run.get("max_host_memory", DRY_HOST))
    machine = Machine("cuda", gpu, host, gpu_capped="max_gpu_memory" in run)
    if run.get("seq") == "limit":
        run = memory.at_limit(run, machine, None)
    cfg, seq, mbs, accum = memory.shape_of(run)
    clip = float(run.get("max_grad_norm", 1.0)) > 0
    try:
        p = plan(cfg, Batch(mbs * seq, accum, seq, 2, clip, rows=mbs), machine, memory.choices_of(run))
    except PlanError as e:
        return {"error": str(e)}
    return {
        "plan": p.to_json(),
        "params": cfg.num_params,
        "predicted": {"gpu_peak_allocated": p.gpu_peak, "host_peak_rss": p.host_total},
        "measured": {},
        "machine": {"gpu_bytes": gpu, "host_bytes": host},
        "resolved_run": run,
    }


def derive(r: dict) -> None:
    """tokens/s and model TFLOP/s of a record, measured (last step) and predicted (plan)."""
    run = r["run"]
    cfg, seq, _, _ = memory.shape_of(run)
    T = run["tokens"]
    flops = model_flops(cfg, T, seq)
    last = r.get("step_times", [])[-1:] or [None]
    r["tokens_per_s"] = T / last[0] if last[0] else None
    r["model_tflops"] = flops / last[0] / 1e12 if last[0] else None
    step = r["plan"]["step_time_s"]
    r["plan_tokens_per_s"] = T / step if step else None
    r["plan_model_tflops"] = flops / step / 1e12 if step else None


def _num(v, fmt: str) -> str:
    return "-" if v is None else format(v, fmt)


def row(r: dict) -> str:
    if r.get("error"):
        return f"| {r['name']} | {r['run']['spec']} | error: {r['error']} |"
    pr, me = r["predicted"], r["measured"]
    cells = [
        r["name"],
        f"{r['params'] / 1e9:.2f}B",
        f"{r['run']['tokens']:,}",
        memory.plan_str(r["plan"]),
        _num(r["tokens_per_s"], ",.0f"),
        _num(r["plan_tokens_per_s"], ",.0f"),
        _num(r["model_tflops"], ".0f"),
        _num(r["plan_model_tflops"], ".0f"),
        _num(pr.get("gpu_peak_allocated", 0) / GiB, ".1f"),
        _num(me["gpu_peak_allocated"] / GiB if me.get("gpu_peak_allocated") else None, ".1f"),
        _num(pr["host_peak_rss"] / GiB, ".1f"),
        _num(me["host_peak_rss"] / GiB if me.get("host_peak_rss") else None, ".1f"),
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| run | params | tokens/seq | plan | tokens/s | plan tokens/s | model TFLOP/s | plan TFLOP/s | "
    "GPU peak plan GiB | GPU peak GiB | host peak plan GiB | host peak GiB |\n|" + "---|" * 12
)


def table(results: list[dict]) -> str:
    return HEADER + "\n" + "\n".join(row(r) for r in results)


def run_one(name: str, run: dict, timeout: float) -> dict:
    cmd = [sys.executable, os.path.join(BENCH, "memory.py"), "--worker", json.dumps(run)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
        return (
            json.loads(line[-1][7:]) if line else {"error": f"exit {p.returncode}: {p.stderr.strip()[-300:]}"}
        )
    except subprocess.TimeoutExpired:
        return {"error": f"timeout after {timeout:.0f} s"}


def _worker(run: dict) -> list[str]:
    return [sys.executable, os.path.join(BENCH, "memory.py"), "--worker", json.dumps(run)]


def detach(names: list[str], folder: str, command: str) -> None:
    """Start one process of its own session (it outlives this command) that runs the runs one
    after another, each alone on the machine as a run at the machine's limits must be; each run's
    output in `folder`/<name>.out, its start time in `folder`/<name>.start, the whole in
    `folder`/runs.json."""
    if os.path.exists(os.path.join(folder, "runs.json")):
        sys.exit(
            f"longctx.py: {folder} already holds detached runs (runs.json): collect them or choose another folder"
        )
    if os.path.isdir(folder) and os.listdir(folder):
        sys.exit(f"longctx.py: {folder} is not empty: choose a new folder (nothing in it is overwritten)")
    os.makedirs(folder, exist_ok=True)
    runs = {}
    for name in names:
        run = memory.parse(RUNS.get(name, name))
        runs[name] = {"run": run, "argv": _worker(run)}
    record = {"command": command, "runs": runs, "started": time.time()}
    with open(os.path.join(folder, "runs.json.tmp"), "w") as f:
        json.dump(record, f, indent=1)
    os.replace(os.path.join(folder, "runs.json.tmp"), os.path.join(folder, "runs.json"))
    serve = [sys.executable, os.path.abspath(__file__), "--serve", folder]
    with open(os.path.join(folder, "serve.out"), "w") as out:
        p = subprocess.Popen(serve, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    with open(os.path.join(folder, "serve.pid"), "w") as f:
        f.write(str(p.pid))
    print(f"started {', '.join(names)} one after another, pid {p.pid}, output in {folder}/", flush=True)


def serve(folder: str) -> None:
    """The detached process: each run of `folder`/runs.json in turn."""
    with open(os.path.join(folder, "runs.json")) as f:
        runs = json.load(f)["runs"]
    for name, s in runs.items():
        with open(os.path.join(folder, f"{name}.start"), "w") as f:
            f.write(str(time.time()))
        with open(os.path.join(folder, f"{name}.out"), "w") as out:
            subprocess.run(s["argv"], stdout=out, stderr=subprocess.STDOUT)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def _read(path: str) -> str | None:
    try:
        with open(path, errors="replace") as f:
            return f.read()
    except FileNotFoundError:
        return None


def collect(folder: str) -> list[dict] | None:
    """Each detached run's state; its records once every run has finished (None before)."""
    with open(os.path.join(folder, "runs.json")) as f:
        record = json.load(f)
    serving = _alive(int(_read(os.path.join(folder, "serve.pid"))))
    results, done = [], True
    for name, s in record["runs"].items():
        start = _read(os.path.join(folder, f"{name}.start"))
        lines = (_read(os.path.join(folder, f"{name}.out")) or "").splitlines()
        found = [x for x in lines if x.startswith("RESULT ")]
        elapsed = time.time() - float(start) if start else 0.0
        if found:
            res = json.loads(found[-1][7:])
        elif serving and start is None:
            print(f"{name}: waiting for the runs before it")
            done = False
            continue
        elif serving and not any(_read(os.path.join(folder, f"{n}.start")) for n in _after(record, name)):
            print(f"{name}: running for {elapsed / 60:.1f} min; last output: {(lines or [''])[-1][:200]}")
            done = False
            continue
        elif start is None:
            res = {"error": "never started: the detached process ended first (see serve.out)"}
        else:
            res = {"error": "exited without a result: " + " / ".join(lines[-3:])[-300:]}
        res.update(
            name=name, run=res.pop("resolved_run", s["run"]), wall_s=elapsed, started_by=record["command"]
        )
        if not res.get("error"):
            derive(res)
        print(row(res), flush=True)
        results.append(res)
    return results if done else None


def _after(record: dict, name: str) -> list[str]:
    names = list(record["runs"])
    return names[names.index(name) + 1 :]


def write(results: list[dict], args, stamp: str) -> None:
    memory.write(results, args, stamp, "longctx.py", "long context, plan vs measured", table)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="B128k,B256k,B512k,A1M")
    ap.add_argument("--out", default=os.path.join(BENCH, "results"))
    ap.add_argument("--tag", default="longctx")
    ap.add_argument("--timeout", type=int, default=560, help="seconds per run")
    ap.add_argument("--deadline", type=int, default=560, help="seconds for all runs (0: none)")
    ap.add_argument("--dry-run", action="store_true", help="print each run's plan; run nothing")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--detach", metavar="DIR", help="start the runs in their own sessions, return at once")
    ap.add_argument(
        "--collect", metavar="DIR", help="report detached runs; write the table when all are done"
    )
    ap.add_argument("--serve", metavar="DIR", help=argparse.SUPPRESS)  # the detached process
    args = ap.parse_args(argv)
    if args.serve:
        serve(args.serve)
        return
    if args.list:
        for k, v in RUNS.items():
            print(f"{k:<8} {v}")
        return
    start, stamp = time.time(), datetime.datetime.now().strftime("%Y-%m-%d_%H%M")
    if args.detach:
        argv = sys.argv[1:] if argv is None else argv
        detach(args.runs.split(","), args.detach, "python bench/longctx.py " + " ".join(argv))
        return
    if args.collect:
        results = collect(args.collect)
        if results is not None:
            os.makedirs(args.out, exist_ok=True)
            write(results, args, stamp)
            print(table(results))
        return
    results = []
    for name in args.runs.split(","):
        run = memory.parse(RUNS.get(name, name))
        if args.dry_run:
            res = dry_plan(run)
        else:
            left = args.deadline - (time.time() - start) if args.deadline else args.timeout
            if left < 30:
                results.append({"name": name, "run": run, "error": "skipped: deadline"})
                continue
            t0 = time.time()
            res = run_one(name, run, min(args.timeout, left))
            res["wall_s"] = time.time() - t0
        res.update(name=name, run=res.pop("resolved_run", run))
        if not res.get("error"):
            derive(res)
        results.append(res)
        print(row(res), flush=True)
        if not args.dry_run:
            os.makedirs(args.out, exist_ok=True)
            write(results, args, stamp)
    print()
    if args.dry_run:
        print(f"dry run: planned for {DRY_GPU} GPU / {DRY_HOST} host unless capped; host figures are growth")
    print(table(results))


if __name__ == "__main__":
    main()
