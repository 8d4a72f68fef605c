"""DPO throughput and memory: `megatrain train` with `stage: dpo` on a dense shape, random
weights and random pre-tokenised pairs, beside TRL's DPOTrainer (bench/_trl_dpo.py, DeepSpeed
ZeRO-3 with CPU offload, precompute_ref_log_probs) on the same GPU in the same call; with
`--stages dpo,rm`, also `stage: rm` (a reward model: the score head, TRL RewardTrainer's loss) on
the same shape and the same pairs, and the ratio rm / dpo.

    python bench/dpo.py --shape B --prompt 512 --completion 512 --pairs 8 --steps 6 --systems megatrain,trl
    python bench/dpo.py --shape B --prompt 512 --completion 512 --pairs 8 --steps 4 --systems megatrain --stages dpo,rm
    python bench/dpo.py --smoke --stages dpo,rm --out /tmp/dpo-smoke   # the CPU: tiny shape, megatrain only

A step is `--pairs` pairs (each 2 x (prompt + completion) tokens: 8 pairs of 512 + 512 are 16k
tokens). tokens/s counts every token of the step (prompt twice, as both sequences hold it) over
the steps after the first two; the reference pass is timed apart. Each record of the pairs file
holds dpo's pre-tokenised keys (prompt_input_ids, chosen_input_ids, rejected_input_ids) and rm's
(chosen_ids, rejected_ids: the prompt's ids then the completion's, the whole sequences rm reads),
so both stages train on the same tokens. Host bytes per parameter: the process's peak RSS over
the parameters. Each row is printed as its run finishes; writes {stamp}_{tag}.json/.md into --out.
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
from _megatrain_run import train  # noqa: E402
from _report import write_once  # noqa: E402
from _shapes import DENSE_SHAPES  # noqa: E402
from _systems import model_config  # noqa: E402

WARMUP = 2  # steps left out of the rate
STAGES = ("dpo", "rm")
SMOKE = dict(shape="tiny", prompt=16, completion=16, pairs=4, steps=3, systems="megatrain")


def write_inputs(d: Path, shape: dict, args) -> tuple[Path, Path]:
    """config.json of the shape and `pairs * steps` random pairs, in the form of each stage."""
    # The model every system of bench/ trains (the TRL worker builds the same from the shape).
    model_config({"shape": shape, "seq": args.prompt + args.completion}).save_pretrained(d / "model")
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(1, shape["vocab"]) for _ in range(n)]  # noqa: E731
    with open(d / "pairs.jsonl", "w") as f:
        for _ in range(args.pairs * args.steps):
            row = dict(prompt_input_ids=ids(args.prompt), chosen_input_ids=ids(args.completion),
                       rejected_input_ids=ids(args.completion))  # fmt: skip
            if "rm" in args.stages:  # read first by rm (data/preference.py: REWARD_TOKEN_KEYS)
                row.update(chosen_ids=row["prompt_input_ids"] + row["chosen_input_ids"],
                           rejected_ids=row["prompt_input_ids"] + row["rejected_input_ids"])  # fmt: skip
            f.write(json.dumps(row) + "\n")
    return d / "model", d / "pairs.jsonl"


def run_megatrain(d: Path, model: Path, data: Path, args, stage: str) -> dict:
    out = d / f"out-{stage}"
    settings = dict(
        model_config=str(model), dataset=str(data), stage=stage, output_dir=str(out),
        max_length=args.prompt + args.completion,
        per_device_train_batch_size=args.pairs // args.accum, gradient_accumulation_steps=args.accum,
        max_steps=args.steps, learning_rate=1e-6, save_strategy="no", save_final_model=False,
        disable_tqdm=True, logging_steps=1, shuffle=False,  # no export: its minute and disk are no step's
    )  # fmt: skip
    rec, steps, plan, log = train(d, stage, settings, args.megatrain, stage=stage)
    if rec["rc"] != 0:
        return rec
    timed = steps[WARMUP:]
    m = re.search(r"reference log-probs of (\d+) samples .* in ([\d.]+) s", log)
    rec.update(
        tokens_per_s=sum(r["tokens"] for r in timed) / sum(r["step_time_s"] for r in timed),
        tokens=[r["tokens"] for r in steps],
        step_s=[round(r["step_time_s"], 3) for r in steps],
        plan_step_s=plan["plan"].get("step_time_s"),
        losses=[round(r["loss"], 5) for r in steps],
        reference_s=float(m.group(2)) if m else None,
        predicted=plan.get("predicted"),
        measured=plan.get("measured"),
        log_tail=log[-2000:],
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
        "stage": "dpo",
        "command": " ".join(cmd[1:]),
        "wall_s": time.perf_counter() - t0,
        "rc": proc.returncode,
    }
    if proc.returncode != 0 or not (d / "trl.json").exists():
        rec["error"] = (proc.stdout + proc.stderr)[-3000:]
        return rec
    rec.update(json.loads((d / "trl.json").read_text()))
    return rec


HEADER = (
    "| system | stage | tokens/s (plan) | step s after warm-up (plan) | reference pass s | GPU peak GiB (plan) "
    "| host peak GiB (plan) | host B/param |\n|---|---|---|---|---|---|---|---|"
)


def _gib(b) -> str:
    return f"{b / 2**30:.1f}" if b else "-"


def figures(r: dict) -> dict:
    """A run's measured figures and the plan's (None where it has none): tokens/s, step s, peaks."""
    measured, plan = r.get("measured") or {}, r.get("predicted") or {}
    steps = r.get("step_s", [])[WARMUP:]
    step, plan_step = sum(steps) / max(len(steps), 1), r.get("plan_step_s")
    per_step = (r.get("tokens") or [0])[-1]
    return dict(
        tokens_per_s=(r["tokens_per_s"], per_step / plan_step if plan_step else None),
        step_s=(step, plan_step),
        gpu=(measured.get("gpu_peak_allocated") or r.get("gpu_peak_bytes"), plan.get("gpu_peak_allocated")),
        host=(measured.get("host_peak_rss") or r.get("host_peak_bytes"), plan.get("host_peak_rss")),
    )


def row(r: dict, num_params: int) -> str:
    """One run's line of the table."""
    if r.get("error"):
        return f"| {r['system']} | {r.get('stage', 'dpo')} | failed: see json | | | | | |"
    f = figures(r)
    beside = lambda pair, fmt: fmt(pair[0]) + (f" ({fmt(pair[1])})" if pair[1] else "")  # noqa: E731
    host, num_params = f["host"][0], r.get("num_params") or num_params
    return (
        f"| {r['system']} | {r.get('stage', 'dpo')} | {beside(f['tokens_per_s'], lambda v: f'{v:,.0f}')} | "
        f"{beside(f['step_s'], lambda v: f'{v:.2f}')} | "
        f"{round(r['reference_s'], 1) if r.get('reference_s') else '-'} | {beside(f['gpu'], _gib)} | "
        f"{beside(f['host'], _gib)} | {host / num_params if host else float('nan'):.1f} |"
    )


def ratios(runs: list[dict]) -> list[str]:
    """megatrain over TRL (tokens/s) and megatrain's rm over its dpo (each figure), where both ran."""
    ok = {(r["system"], r.get("stage", "dpo")): r for r in runs if not r.get("error")}
    lines = []
    mine, peer, rm = (
        ok.get(("megatrain", "dpo")),
        ok.get(("trl+deepspeed", "dpo")),
        ok.get(("megatrain", "rm")),
    )
    if mine and peer:
        lines.append(
            f"megatrain / TRL+DeepSpeed: **{mine['tokens_per_s'] / peer['tokens_per_s']:.2f}x** tokens/s"
        )
    if mine and rm:
        a, b = figures(rm), figures(mine)
        names = dict(tokens_per_s="tokens/s", step_s="step s", gpu="GPU peak", host="host peak")
        parts = [f"{name} **{a[k][0] / b[k][0]:.2f}x**" for k, name in names.items() if a[k][0] and b[k][0]]
        lines.append("megatrain rm / dpo: " + ", ".join(parts))
    return lines


def table(runs: list[dict], num_params: int) -> str:
    lines = [HEADER, *(row(r, num_params) for r in runs)]
    extra = ratios(runs)
    return "\n".join(lines + ([""] + extra if extra else []))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="B")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--pairs", type=int, default=8, help="pairs per optimizer step")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--systems", default="megatrain,trl")
    p.add_argument(
        "--stages", default="dpo", help=f"megatrain's stages, of {','.join(STAGES)} (TRL runs dpo)"
    )
    p.add_argument(
        "--smoke", action="store_true", help="the CPU: " + " ".join(f"--{k} {v}" for k, v in SMOKE.items())
    )
    p.add_argument("--megatrain", nargs="*", default=[], help="extra key=value for megatrain")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tag", help="default: the stages, joined by '-' (dpo; dpo-rm)")
    p.add_argument("--combine", nargs=2, metavar=("MEGATRAIN_JSON", "TRL_JSON"),
                   help="run nothing: one table from a result of this script (--systems megatrain) and "
                        "_trl_dpo.py's --out of an earlier call on the same machine")  # fmt: skip
    args = p.parse_args()
    if args.smoke:
        for k, v in SMOKE.items():
            if getattr(args, k) == p.get_default(k):
                setattr(args, k, v)
    args.stages = [x for x in args.stages.split(",") if x]
    if bad := sorted(set(args.stages) - set(STAGES)):
        p.error(f"--stages: unknown {bad} (choose from {', '.join(STAGES)})")
    args.tag = args.tag or "-".join(args.stages) + ("-smoke" if args.smoke else "")
    if args.combine:
        return combine(*map(Path, args.combine), Path(args.out), args.tag)
    import torch

    from megatrain.models.config import ModelConfig

    shape = DENSE_SHAPES[args.shape]
    lm = ModelConfig.from_hf(model_config({"shape": shape, "seq": args.prompt + args.completion}))
    n = lm.num_params
    params = {"dpo": n, "rm": lm.with_score_head(0).num_params}  # rm: the score head for the LM head
    runs = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        d = Path(tmp)
        model, data = write_inputs(d, shape, args)
        print(HEADER, flush=True)
        for system, stage in plan_runs(args):
            if system == "megatrain":
                runs.append(run_megatrain(d, model, data, args, stage))
            else:
                runs.append(run_trl(d, model, data, args))
            runs[-1]["num_params"] = params[stage]
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "log_tail"})[:1500], file=sys.stderr)
            print(row(runs[-1], n), flush=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpus": os.cpu_count(),
        "command": "python bench/dpo.py " + " ".join(sys.argv[1:]),
        "shape": args.shape,
        "stages": args.stages,
        "num_params": n,
        "num_params_rm": params["rm"],
        "tokens_per_step": args.pairs * 2 * (args.prompt + args.completion),
    }
    write(
        Path(args.out),
        datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M"),
        args.tag,
        meta,
        runs,
        rows_printed=True,
    )


def write(out: Path, stamp: str, tag: str, meta: dict, runs: list[dict], rows_printed: bool = False) -> None:
    """The JSON and Markdown of the runs; printed: the table (its ratios alone where its rows were)."""
    text = table(runs, meta["num_params"])
    print("\n".join(ratios(runs)) if rows_printed else text)
    title = " beside ".join(
        dict.fromkeys("TRL" if r["system"].startswith("trl") else r["system"] for r in runs)
    )
    stages = " and ".join(dict.fromkeys(r.get("stage", "dpo").upper() for r in runs))
    write_once(str(out), tag, f"{stamp}_{tag}: {stages}, {title}", meta, runs, text, key="runs", stamp=stamp)


def plan_runs(args) -> list[tuple[str, str]]:
    """(system, stage) of each run in order: megatrain's stages, then TRL (dpo only) where asked."""
    systems = [x for x in args.systems.split(",") if x]
    out = [("megatrain", stage) for stage in args.stages] if "megatrain" in systems else []
    return out + [("trl", "dpo")] * ("trl" in systems and "dpo" in args.stages)


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
