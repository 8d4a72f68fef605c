"""DPO throughput and memory: `megatrain train` with `stage: dpo` on a dense shape, random
weights and random pre-tokenised pairs, beside TRL's DPOTrainer (bench/_trl_dpo.py, DeepSpeed
ZeRO-3 with CPU offload, precompute_ref_log_probs) on the same GPU in the same call.

    python bench/dpo.py --shape B --prompt 512 --completion 512 --pairs 8 --steps 6 --systems megatrain,trl

A step is `--pairs` pairs (each 2 x (prompt + completion) tokens: 8 pairs of 512 + 512 are 16k
tokens). tokens/s counts every token of the step (prompt twice, as both sequences hold it) over
the steps after the first two; the reference pass is timed apart. Host bytes per parameter: the
process's peak RSS over the parameters. Writes {stamp}_{tag}.json/.md into --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(1, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
from _report import write_once  # noqa: E402
from _shapes import DENSE_SHAPES  # noqa: E402
from _systems import model_config  # noqa: E402

WARMUP = 2  # steps left out of the rate


def write_inputs(d: Path, shape: dict, args) -> tuple[Path, Path]:
    """config.json of the shape and `pairs * steps` random pairs."""
    # The model every system of bench/ trains (the TRL worker builds the same from the shape).
    model_config({"shape": shape, "seq": args.prompt + args.completion}).save_pretrained(d / "model")
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1, shape["vocab"]) for _ in range(n)]  # noqa: E731
    with open(d / "pairs.jsonl", "w") as f:
        for _ in range(args.pairs * args.steps):
            row = dict(prompt_input_ids=ids(args.prompt), chosen_input_ids=ids(args.completion),
                       rejected_input_ids=ids(args.completion))  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return d / "model", d / "pairs.jsonl"


def run_megatrain(d: Path, model: Path, data: Path, args) -> dict:
    out = d / "out"
    settings = dict(
        model_config=str(model), dataset=str(data), stage="dpo", output_dir=str(out),
        max_length=args.prompt + args.completion,
        per_device_train_batch_size=args.pairs // args.accum, gradient_accumulation_steps=args.accum,
        max_steps=args.steps, learning_rate=1e-6, save_strategy="no", disable_tqdm=True, logging_steps=1,
        shuffle=False,
    )  # fmt: skip
    (d / "dpo.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in settings.items()))
    cmd = [sys.executable, "-m", "megatrain", "train", str(d / "dpo.yaml"), *args.megatrain]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    rec: dict = {"system": "megatrain", "command": " ".join(cmd[1:]), "wall_s": wall, "rc": proc.returncode}
    if proc.returncode != 0:
        rec["error"] = (proc.stdout + proc.stderr)[-3000:]
        return rec
    steps = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "loss" in r]
    timed = steps[WARMUP:]
    plan = json.loads((out / "plan.json").read_text())
    m = re.search(r"reference log-probs of (\d+) samples .* in ([\d.]+) s", proc.stdout)
    rec.update(
        tokens_per_s=sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed),
        step_s=[round(r["step_time_s"], 3) for r in steps],
        losses=[round(r["loss"], 5) for r in steps],
        reference_s=float(m.group(2)) if m else None,
        predicted=plan.get("predicted"),
        measured=plan.get("measured"),
        log_tail=proc.stdout[-2000:],
    )
    return rec


def run_trl(d: Path, model: Path, data: Path, args) -> dict:
    cmd = [sys.executable, os.path.join(os.path.dirname(__file__), "_trl_dpo.py"), "--model", str(model),
           "--data", str(data), "--prompt", str(args.prompt), "--completion", str(args.completion),
           "--pairs", str(args.pairs), "--accum", str(args.accum), "--steps", str(args.steps),
           "--out", str(d / "trl.json")]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rec = {
        "system": "trl+deepspeed",
        "command": " ".join(cmd[1:]),
        "wall_s": time.perf_counter() - t0,
        "rc": proc.returncode,
    }
    if proc.returncode != 0 or not (d / "trl.json").exists():
        rec["error"] = (proc.stdout + proc.stderr)[-3000:]
        return rec
    rec.update(json.loads((d / "trl.json").read_text()))
    return rec


def table(runs: list[dict], num_params: int) -> str:
    lines = ["| system | tokens/s | step s (after warm-up) | reference pass s | GPU peak GiB (plan) | host peak GiB (plan) | host B/param |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    gib = lambda b: f"{b / 2**30:.1f}" if b else "-"  # noqa: E731
    for r in runs:
        if r.get("error"):
            lines.append(f"| {r['system']} | failed: see json | | | | | |")
            continue
        plan = r.get("predicted") or {}
        gpu = (r.get("measured") or {}).get("gpu_peak_allocated") or r.get("gpu_peak_bytes")
        host = (r.get("measured") or {}).get("host_peak_rss") or r.get("host_peak_bytes")
        planned = lambda k, plan=plan: f" ({gib(plan[k])})" if plan.get(k) else ""  # noqa: E731
        steps = r.get("step_s", [])[WARMUP:]
        lines.append(
            f"| {r['system']} | {r['tokens_per_s']:,.0f} | {sum(steps) / max(len(steps), 1):.2f} | "
            f"{round(r['reference_s'], 1) if r.get('reference_s') else '-'} | {gib(gpu)}{planned('gpu_peak_allocated')} | "
            f"{gib(host)}{planned('host_peak_rss')} | {host / num_params if host else float('nan'):.1f} |"
        )
    ok = {r["system"]: r["tokens_per_s"] for r in runs if not r.get("error")}
    if len(ok) == 2:
        lines.append(
            f"\nmegatrain / TRL+DeepSpeed: **{ok['megatrain'] / ok['trl+deepspeed']:.2f}x** tokens/s"
        )
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="B")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--pairs", type=int, default=8, help="pairs per optimizer step")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--systems", default="megatrain,trl")
    p.add_argument("--megatrain", nargs="*", default=[], help="extra key=value for megatrain")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tag", default="dpo")
    p.add_argument("--combine", nargs=2, metavar=("MEGATRAIN_JSON", "TRL_JSON"),
                   help="run nothing: one table from a result of this script (--systems megatrain) and "
                        "_trl_dpo.py's --out of an earlier call on the same machine")  # fmt: skip
    args = p.parse_args()
    if args.combine:
        return combine(*map(Path, args.combine), Path(args.out), args.tag)
    import torch

    shape = DENSE_SHAPES[args.shape]
    runs = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        d = Path(tmp)
        model, data = write_inputs(d, shape, args)
        for system in args.systems.split(","):
            runs.append((run_megatrain if system == "megatrain" else run_trl)(d, model, data, args))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "log_tail"})[:1500], flush=True)
    from megatrain.models.config import ModelConfig

    n = ModelConfig.from_hf(model_config({"shape": shape, "seq": args.prompt + args.completion})).num_params
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpus": os.cpu_count(),
        "command": "python bench/dpo.py " + " ".join(sys.argv[1:]),
        "shape": args.shape,
        "num_params": n,
        "tokens_per_step": args.pairs * 2 * (args.prompt + args.completion),
    }
    write(
        Path(args.out),
        datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M"),
        args.tag,
        meta,
        runs,
    )


def write(out: Path, stamp: str, tag: str, meta: dict, runs: list[dict]) -> None:
    text = table(runs, meta["num_params"])
    print(text)
    title = " beside ".join(
        dict.fromkeys("TRL" if r["system"].startswith("trl") else r["system"] for r in runs)
    )
    write_once(str(out), tag, f"{stamp}_{tag}: DPO, {title}", meta, runs, text, key="runs", stamp=stamp)


def combine(megatrain: Path, trl: Path, out: Path, tag: str) -> None:
    """One result of two calls on one machine (each system's run alone fits a call's time limit)."""
    mine = json.loads(megatrain.read_text())
    peer = json.loads(trl.read_text())
    runs = [r for r in mine["runs"] if r["system"] == "megatrain"] + [peer | {"system": "trl+deepspeed"}]
    meta = {k: v for k, v in mine.items() if k != "runs"}
    meta["peer_command"] = "python " + peer["command"]
    meta["peer_device"] = peer.get("gpu")
    meta["note"] = (
        "two calls on the same machine, one after the other: megatrain's (command), TRL's (peer_command)"
    )
    write(out, datetime.datetime.fromisoformat(mine["date"]).strftime("%Y-%m-%d_%H%M"), tag, meta, runs)


if __name__ == "__main__":
    main()
