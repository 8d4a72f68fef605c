"""The disk tier (`offload_dir`): a model whose state does not fit host memory, trained by
`python -m megatrain train` with the AdamW moments of its last units on disk, beside the same
run with the whole state in host memory where that fits (the step the disk costs).

    python bench/disk.py --model B20 --tokens-per-step 16384 --offload-dir /nvme/tier --runs disk
    python bench/disk.py --model A --max-host-memory 40GiB --offload-dir /tmp/tier --runs disk,ram
    python bench/disk.py --model tiny --tokens-per-step 256 --doc 128 --steps 2 --runs disk --max-host-memory 300MiB

The model is a Llama shape of bench/memory.py, random init from a config.json, trained on random
pre-tokenised documents of `--doc` tokens. Each run records the plan's disk tier (units, bytes,
the disk's read, write and both-at-once rates as measured at start, O_DIRECT or buffered), the bytes the tier
read and wrote per step and the seconds the optimizer waited for its reads (plan.json's
measured counters over the run's steps), its predicted step time beside the measured one,
tokens/s over the steps after the first, and the GPU and host peaks beside the plan's; the model's
fp32 weights and moments against the host memory the plan had, and the share of the step the
optimizer waited for the tier; with both runs, the share of the step the tier costs. Writes
`<stamp>_<tag>.json` and `.md` in --out, each run's log and plan under `<stamp>_<tag>_logs/`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import tempfile

BENCH = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, BENCH)
import packed  # noqa: E402  (a sibling module; bench/ is not a package)
from _report import write_once  # noqa: E402

GiB = 2**30


def overrides(args, run: str) -> list[str]:
    rows = args.tokens_per_step // args.doc
    out = [f"max_length={args.doc}", f"per_device_train_batch_size={rows}", f"max_steps={args.steps}",
           "save_strategy=no", "save_final_model=false", "disable_tqdm=true", "logging_steps=1", "learning_rate=1e-5", *args.set]  # fmt: skip
    if run == "disk":
        out += [f"offload_dir={args.offload_dir}"]
        out += [f"max_host_memory={args.max_host_memory}"] if args.max_host_memory else []
    return out


def row(r: dict) -> str:
    gib = lambda b: f"{b / GiB:.1f}" if b else "-"  # noqa: E731
    if r.get("error"):
        return f"| {r['name']} | failed: {r['error'][:120]} | | | | | | | | |"
    plan, machine = r.get("plan") or {}, r.get("machine") or {}
    p, m = r.get("predicted") or {}, r.get("measured") or {}
    tier = plan.get("disk_units")
    disk = f"{tier} units, {gib(plan.get('disk'))} GiB" if tier else "-"
    rates, moved, wait = "-", "-", "-"
    if tier:
        io = "O_DIRECT" if machine.get("disk_direct", True) else "buffered"
        rates = (f"{machine['disk_read_bytes_s'] / 1e9:.2f} / {machine['disk_write_bytes_s'] / 1e9:.2f} / "
                 f"{machine['disk_duplex_bytes_s'] / 1e9:.2f} ({io})")  # fmt: skip
        steps = max(1, r.get("steps") or 1)  # the tier's counters run from its start: every step's
        if "disk_read_bytes" in m:
            moved = f"{m['disk_read_bytes'] / steps / GiB:.2f} / {m['disk_written_bytes'] / steps / GiB:.2f}"
            wait = f"{m['disk_wait_s'] / steps:.2f}"
    return (f"| {r['name']} | {disk} | {rates} | {moved} | {wait} | {r['step_s']:.2f} ({plan.get('step_time_s', 0):.2f}) | "
            f"{r['tokens_per_s']:,.0f} | {gib(m.get('gpu_peak_allocated'))} ({gib(p.get('gpu_peak_allocated'))}) | "
            f"{gib(m.get('host_peak_rss'))} ({gib(p.get('host_peak_rss'))}) |")  # fmt: skip


def past_host(r: dict) -> str | None:
    """How far past host memory the tiered run went: the model's fp32 weights and AdamW moments
    (in host memory and in the tier) against the host memory the plan had, and the share of the
    step the optimizer waited for the tier's reads."""
    plan, machine, m = r.get("plan") or {}, r.get("machine") or {}, r.get("measured") or {}
    state = (plan.get("host") or {}).get("fp32 weights + AdamW moments", 0) + (plan.get("disk") or 0)
    if not state or not machine.get("host_bytes"):
        return None
    line = (f"the model's fp32 weights and AdamW moments: {state / GiB:.1f} GiB, "
            f"{state / machine['host_bytes']:.2f}x the host memory the plan had ({machine['host_bytes'] / GiB:.1f} GiB)")  # fmt: skip
    if "disk_wait_s" in m and r.get("step_s"):
        wait = m["disk_wait_s"] / max(1, r.get("steps") or 1)
        line += f"; the optimizer waited {wait:.2f} s a step for the tier's reads ({100 * wait / r['step_s']:.0f}% of the step)"
    return line


def table(runs: list[dict]) -> str:
    lines = ["| run | disk tier | disk GB/s at start: read / write / both at once | read / written GiB per step | optimizer's wait for reads s/step "
             "| step s (plan) | tokens/s | GPU peak GiB (plan) | host peak GiB (plan) |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    lines += [row(r) for r in runs]
    done = {r["name"]: r for r in runs if not r.get("error")}
    if "disk" in done and (line := past_host(done["disk"])):
        lines.append("\n" + line)
    if "disk" in done and "ram" in done:
        share = 1 - done["ram"]["step_s"] / done["disk"]["step_s"]
        lines.append(
            f"\nthe disk's share of the step: {100 * share:.0f}% (the in-memory step against the tier's)"
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="A", help="a shape of bench/memory.py")
    ap.add_argument("--tokens-per-step", type=int, default=16384)
    ap.add_argument("--doc", type=int, default=4096, help="tokens per document (a row)")
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--runs", default="disk", help="disk, ram or both (disk,ram)")
    ap.add_argument("--offload-dir", default=os.path.join(tempfile.gettempdir(), "megatrain-tier"))
    ap.add_argument("--max-host-memory", help="the disk run's host budget (default: MemAvailable)")
    ap.add_argument("--set", nargs="*", default=[], help="more key=value for both runs")
    ap.add_argument("--timeout", type=float, default=560)
    ap.add_argument("--out", default=os.path.join(packed.REPO, "bench", "results"))
    ap.add_argument("--tag", default="disk")
    args = ap.parse_args()
    import torch

    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M")
    base = os.path.join(args.out, f"{stamp}_{args.tag}")
    if os.path.exists(base + "_logs"):
        sys.exit(f"{base}_logs exists; nothing is overwritten")
    runs = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as work:
        config, vocab, params = packed.write_model(args.model, args.doc, os.path.join(work, "model"))
        data = os.path.join(work, "docs.jsonl")
        rows = args.tokens_per_step // args.doc
        packed.write_docs(data, rows * args.steps, args.doc, vocab)
        yaml_path = os.path.join(work, "run.yaml")
        with open(yaml_path, "w") as f:
            json.dump({"model_config": os.path.dirname(config), "dataset": data}, f)
        for name in args.runs.split(","):
            rec = packed.train(name, yaml_path, overrides(args, name), work, base + "_logs", args.timeout)
            plan_file = os.path.join(base + "_logs", name, "plan.json")
            if os.path.exists(plan_file):
                with open(plan_file) as f:
                    rec["machine"] = json.load(f)["machine"]
            runs.append(rec)
            print(row(rec), flush=True)
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpus": os.cpu_count(),
        "command": "python bench/disk.py " + " ".join(sys.argv[1:]),
        "model": args.model,
        "num_params": params,
        "tokens_per_step": rows * args.doc,
    }
    text = table(runs)
    print(text)
    write_once(
        args.out, args.tag, f"{stamp}_{args.tag}: the disk tier", meta, runs, text, key="runs", stamp=stamp
    )


if __name__ == "__main__":
    main()
