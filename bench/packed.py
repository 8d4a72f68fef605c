"""Packed rows through the command line: the same model trained twice by `python -m megatrain
train`, as a user runs it, on the same documents of exactly `--doc` tokens:

- rows:   one document per row (`max_length` = doc), tokens-per-step / doc rows per step;
- packed: `packing: true`, one row of tokens-per-step tokens per step, doc-token documents in it.

Both take one micro-batch per optimizer step (one weight sweep), the same tokens per step, bf16
compute on CUDA, the default placement, no evaluation and no checkpoint (`save_strategy: no`;
the CLI still writes `final/`, which this script deletes once the run is read). The model is a
Llama shape of bench/memory.py (`A`: 3.61B), random init from a config.json (`model_config`);
the documents are random token ids in a pre-tokenised JSONL (`dataset_format: tokens`), so no
tokenizer is needed and every document is exactly `--doc` tokens.

tokens/s is read from each run's metrics.jsonl: its tokens over its step time, on every step but
the first (which compiles). The GPU and host peaks, predicted and measured, from its plan.json.

    python bench/packed.py --model A --steps 4 --out bench/results          # a GPU machine
    python bench/packed.py --model tiny --doc 256 --tokens-per-step 1024 --steps 3   # the CPU

Writes `<stamp>_<tag>.json` and `.md` in --out (date, device, the exact command of this script
and of both CLI runs, the table) and `<stamp>_<tag>_logs/<run>/` (each run's log, metrics.jsonl,
plan.json, train_config.json).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import yaml

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import memory  # noqa: E402  (a sibling module; bench/ is not a package)

REPO = memory.REPO
GiB = 2**30


def write_model(name: str, tokens: int, folder: str) -> tuple[str, int, int]:
    """The config.json of memory.py's shape `name` in `folder`; (its path, vocab size, params)."""
    cfg, _, _, _ = memory.shape_of({"model": name, "tokens": tokens, "seq": tokens, "mbs": 1})
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, "config.json")
    cfg.hf_config.to_json_file(path)
    return path, cfg.vocab_size, cfg.num_params


def write_docs(path: str, n: int, doc: int, vocab: int) -> None:
    """`n` documents of exactly `doc` random token ids, pre-tokenised JSONL."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"input_ids": [rng.randrange(vocab) for _ in range(doc)]}) + "\n")


def runs_of(args) -> dict[str, list[str]]:
    """Each run's key=value overrides: what differs between the two, then what the bench's
    command line passes to both."""
    rows = args.tokens_per_step // args.doc
    both = [
        f"{k}={v}"
        for k, v in (("max_gpu_memory", args.max_gpu_memory), ("max_host_memory", args.max_host_memory))
        if v
    ]
    both += args.set
    return {
        "rows": [f"max_length={args.doc}", f"per_device_train_batch_size={rows}", *both],
        "packed": [f"max_length={args.tokens_per_step}", "packing=true", "per_device_train_batch_size=1", *both],
    }  # fmt: skip


def train(name: str, yaml_path: str, overrides: list[str], work: str, logs: str, timeout: float) -> dict:
    """One `python -m megatrain train` run; its record from the files it wrote."""
    out = os.path.join(work, name)
    cmd = [sys.executable, "-m", "megatrain", "train", yaml_path, *overrides, f"output_dir={out}"]
    keep = os.path.join(logs, name)
    os.makedirs(keep, exist_ok=True)
    rec: dict = {"name": name, "command": shlex.join(cmd)}
    t0 = time.time()
    with open(os.path.join(keep, "train.log"), "w") as log:
        # Its own process group: a timeout kills the run with its compile workers.
        p = subprocess.Popen(cmd, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            rec["rc"] = p.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)  # not SIGTERM: that saves a resumable checkpoint
            p.wait()
            rec["rc"], rec["error"] = None, f"timeout after {timeout:.0f} s"
    rec["wall_s"] = time.time() - t0
    for f in ("metrics.jsonl", "plan.json", "train_config.json"):
        if os.path.exists(os.path.join(out, f)):
            shutil.copy(os.path.join(out, f), os.path.join(keep, f))
    shutil.rmtree(os.path.join(out, "final"), ignore_errors=True)  # the model: gigabytes, not a result
    if rec["rc"] != 0 and "error" not in rec:
        with open(os.path.join(keep, "train.log"), errors="replace") as f:
            tail = f.read().strip().splitlines()[-3:]
        rec["error"] = f"exit {rec['rc']}: " + " / ".join(tail)[-300:]
    if os.path.exists(os.path.join(keep, "metrics.jsonl")):
        rec.update(measure(os.path.join(keep, "metrics.jsonl")))
    if os.path.exists(os.path.join(keep, "plan.json")):
        with open(os.path.join(keep, "plan.json")) as f:
            plan = json.load(f)
        rec.update(plan=plan["plan"], predicted=plan["predicted"], measured=plan["measured"])
    return rec


def measure(path: str) -> dict:
    """What one run's metrics.jsonl says: per step tokens, rows, documents and time; tokens/s
    over the steps after the first (the first compiles)."""
    with open(path) as f:
        steps = [r for r in map(json.loads, f) if "eval_loss" not in r]
    timed = steps[1:] or steps
    seconds = sum(r["step_time_s"] for r in timed)
    per_step = lambda k: sorted({r.get(k) for r in steps}, key=str)  # noqa: E731
    return {
        "steps": len(steps),
        "tokens_per_step": per_step("tokens"),
        "rows_per_step": per_step("rows"),
        "docs_per_step": per_step("samples"),
        "step_times": [r["step_time_s"] for r in steps],
        "losses": [r["loss"] for r in steps],
        "timed_steps": len(timed),
        "step_s": seconds / len(timed) if timed else None,
        "tokens_per_s": sum(r["tokens"] for r in timed) / seconds if seconds else None,
    }


def check(rec: dict, tokens: int, rows: int, docs: int) -> None:
    """Mark a run whose metrics do not show the steps it was asked for (every step `tokens`
    tokens in `rows` rows holding `docs` documents) as failed: its tokens/s measures another thing."""
    want = {"tokens_per_step": [tokens], "rows_per_step": [rows], "docs_per_step": [docs]}
    wrong = [f"{k} {rec.get(k)} (expected {v[0]})" for k, v in want.items() if rec.get(k) != v]
    if wrong and "error" not in rec:
        rec["error"] = "metrics show " + ", ".join(wrong)


def _one(values):
    return values[0] if values and len(values) == 1 else values


def _num(v, fmt: str) -> str:
    return "-" if v is None or isinstance(v, list) else format(v, fmt)


def row(r: dict) -> str:
    if r.get("error") or r.get("tokens_per_s") is None:
        return f"| {r['name']} | error: {r.get('error')} |"
    pr, me, plan = r.get("predicted", {}), r.get("measured", {}), r.get("plan")
    T = _one(r["tokens_per_step"])
    plan_tps = T / plan["step_time_s"] if plan and plan.get("step_time_s") and isinstance(T, int) else None
    gib = lambda d, k: _num(d[k] / GiB if d.get(k) else None, ".1f")  # noqa: E731
    cells = [
        r["name"],
        str(r["max_length"]),
        f"{_one(r['rows_per_step'])} x {_one(r['docs_per_step'])}",
        _num(T, ",d") if isinstance(T, int) else str(T),
        memory.plan_str(plan) if plan else "-",
        f"{r['timed_steps']} of {r['steps']}",
        _num(r["step_s"], ".3f"),
        _num(r["tokens_per_s"], ",.0f"),
        _num(plan_tps, ",.0f"),
        _num(r.get("vs_rows"), ".3f"),
        gib(pr, "gpu_peak_allocated"),
        gib(me, "gpu_peak_allocated"),
        gib(pr, "host_peak_rss"),
        gib(me, "host_peak_rss"),
    ]
    return "| " + " | ".join(cells) + " |"


HEADER = (
    "| run | max_length | rows x docs per step | tokens/step | plan | steps timed | step s | tokens/s | "
    "plan tokens/s | vs rows | GPU peak plan GiB | GPU peak GiB | host peak plan GiB | host peak GiB |\n|"
    + "---|"
    * 14
)


def table(results: list[dict]) -> str:
    lines = [HEADER, *map(row, results), ""]
    packed = next((r for r in results if r["name"] == "packed"), {})
    if packed.get("vs_rows") is not None:
        lines.append(f"packed / rows tokens/s: {packed['vs_rows']:.3f}x")
    else:
        lines.append("packed / rows tokens/s: - (a run did not finish)")
    lines += ["", "Each run (run.yaml and each run's files in the logs folder):", ""]
    lines += [f"- {r['name']}: `{r['command']}`" for r in results]
    return "\n".join(lines)


def check_args(ap: argparse.ArgumentParser, args) -> None:
    if args.model not in memory.MODELS:
        ap.error(f"--model {args.model}: one of {', '.join(memory.MODELS)}")
    if args.doc < 2 or args.tokens_per_step % args.doc:
        ap.error(f"--tokens-per-step {args.tokens_per_step} must be a multiple of --doc {args.doc} (>= 2)")
    if args.steps < 2:
        ap.error("--steps must be at least 2 (the first step compiles and is not timed)")
    for kv in args.set:
        if "=" not in kv:
            ap.error(f"--set {kv}: expected key=value")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="A", help="a Llama shape of bench/memory.py (A: 3.61B; tiny)")
    ap.add_argument("--steps", type=int, default=4, help="max_steps of each run (the first is not timed)")
    ap.add_argument("--tokens-per-step", type=int, default=65536)
    ap.add_argument("--doc", type=int, default=4096, help="tokens per document")
    ap.add_argument("--out", default=os.path.join(BENCH, "results"))
    ap.add_argument("--tag", default="packed")
    ap.add_argument("--max-gpu-memory", help="passed to both runs as max_gpu_memory")
    ap.add_argument("--max-host-memory", help="passed to both runs as max_host_memory")
    ap.add_argument(
        "--set", action="append", default=[], metavar="KEY=VALUE", help="another key for both runs"
    )
    ap.add_argument("--timeout", type=int, default=560, help="seconds per run")
    ap.add_argument("--deadline", type=int, default=570, help="seconds for both runs (0: none)")
    args = ap.parse_args(argv)
    check_args(ap, args)
    start, stamp = time.time(), datetime.datetime.now().strftime("%Y-%m-%d_%H%M")
    logs = os.path.join(args.out, f"{stamp}_{args.tag}_logs")
    os.makedirs(logs, exist_ok=True)
    work = tempfile.mkdtemp(prefix="megatrain-packed-")
    try:
        yaml_path, params = prepare(args, work, logs)
        results = []
        for name, overrides in runs_of(args).items():
            print(
                f"{name}: {shlex.join(['python', '-m', 'megatrain', 'train', 'run.yaml', *overrides])}",
                flush=True,
            )
            left = args.deadline - (time.time() - start) if args.deadline else args.timeout
            if left < 30:
                results.append({"name": name, "command": "-", "error": "skipped: deadline"})
                continue
            rec = train(name, yaml_path, overrides, work, logs, min(args.timeout, left))
            keys = dict(kv.split("=", 1) for kv in overrides)
            rec.update(max_length=int(keys["max_length"]), params=params)
            n_rows = int(keys["per_device_train_batch_size"])
            check(rec, args.tokens_per_step, n_rows, args.tokens_per_step // args.doc)
            results.append(rec)
            print(row(rec), flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    rows, packed = results
    if not (rows.get("error") or packed.get("error")) and rows["tokens_per_s"] and packed["tokens_per_s"]:
        packed["vs_rows"] = packed["tokens_per_s"] / rows["tokens_per_s"]
    memory.write(
        results, args, stamp, "packed.py", "packed rows vs one document per row, through the CLI", table
    )
    print()
    print(table(results))
    if any(r.get("error") for r in results):
        sys.exit(1)


def prepare(args, work: str, logs: str) -> tuple[str, int]:
    """The model's config.json, the documents and the runs' common YAML in `work` (copies of
    the YAML and the config.json in `logs`); (the YAML's path, the model's parameters)."""
    model, vocab, params = write_model(args.model, args.tokens_per_step, os.path.join(work, "model"))
    data = os.path.join(work, "docs.jsonl")
    write_docs(data, args.steps * args.tokens_per_step // args.doc, args.doc, vocab)
    common = {
        "model_config": model,
        "dataset": data,
        "dataset_format": "tokens",
        "gradient_accumulation_steps": 1,
        "max_steps": args.steps,
        "learning_rate": 1.0e-5,
        "save_strategy": "no",
        "disable_tqdm": True,
    }
    yaml_path = os.path.join(work, "run.yaml")
    with open(yaml_path, "w") as f:
        yaml.safe_dump(common, f, sort_keys=False)
    shutil.copy(yaml_path, logs)
    shutil.copy(model, logs)
    return yaml_path, params


if __name__ == "__main__":
    main()
