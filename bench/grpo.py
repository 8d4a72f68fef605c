"""GRPO throughput: `megatrain train` with `stage: grpo` on a dense shape (random weights, random
pre-tokenised prompts), counted as the reference system counts it: prompt + completion tokens of
a step over the step's wall time (rollout, scoring and update), with the split; beside it, in the
same call, transformers' `generate` alone on the same GPU, model and batch (bench/_generate.py).

    python bench/grpo.py --shape Q7 --prompts 32 --generations 8 --prompt 256 --completion 512 --steps 3

The rollout's policy keeps the layers the plan gives it on the GPU and streams the rest in every
forward; `--megatrain rollout_resident_layers=N` keeps N (the same run with N = 0 and without it
compares streamed against resident sampling); `--megatrain rollout_engine=generate` samples with
transformers' `generate` instead of the rollout engine. `--systems megatrain,generate,generate-static`
times `generate` alone both ways (eager with the dynamic cache; the static cache, compiled);
`--systems megatrain,megatrain+share_prompts=true,trl` runs megatrain twice, the second with that
override, each beside TRL in one call.

Random weights rarely sample the end token, so every completion runs to --completion tokens: the
longest rollout the settings allow. The reward (`_grpo_reward.py`: the parity of a completion's
token sum) only has to vary within a group. Rates are over the steps after the first `--warmup`
(default 1: the step whose rollout and update compile), for every system alike. Writes
{stamp}_{tag}.json/.md into --out.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # the repository
from _megatrain_run import train  # noqa: E402
from _report import write_once  # noqa: E402
from _shapes import DENSE_SHAPES  # noqa: E402
from _systems import model_config  # noqa: E402

WARMUP = 1  # steps left out of the rate (--warmup)


def write_inputs(d: Path, shape: dict, args) -> tuple[Path, Path]:
    """config.json of the shape, `prompts * steps` random prompts and the reward module."""
    seq = args.prompt + args.completion
    model_config({"shape": shape, "seq": seq}).save_pretrained(d / "model")
    rng = random.Random(0)
    with open(d / "prompts.jsonl", "w") as f:
        for _ in range(args.prompts * args.steps):
            ids = [rng.randrange(3, shape["vocab"]) for _ in range(args.prompt)]
            f.write(json.dumps({"prompt_input_ids": ids}) + "\n")
    shutil.copy(HERE / "_grpo_reward.py", d / "_grpo_reward.py")
    return d / "model", d / "prompts.jsonl"


def run_megatrain(d: Path, model: Path, data: Path, args, variant: list[str] | None = None) -> dict:
    """`megatrain train` on the inputs; `variant`: key=value overrides of this run alone, after
    --megatrain's (a system `megatrain+share_prompts=true` in --systems)."""
    out = d / ("out-" + "-".join(variant) if variant else "out")
    rows = args.prompts * args.generations
    settings = dict(
        model_config=str(model), dataset=str(data), stage="grpo", output_dir=str(out),
        reward_funcs=["_grpo_reward:parity"], num_generations=args.generations,
        max_prompt_length=args.prompt, max_completion_length=args.completion,
        per_device_train_batch_size=args.rows_per_micro_batch,
        gradient_accumulation_steps=rows // args.rows_per_micro_batch, max_steps=args.steps,
        learning_rate=1e-6, save_strategy="no", save_final_model=False, disable_tqdm=True, logging_steps=1,
        shuffle=False,
    )  # fmt: skip
    rec, steps, plan, log = train(
        d, "grpo", settings, args.megatrain + (variant or []), cwd=d, settings=settings
    )
    rec["variant"] = " ".join(variant or [])
    if rec["rc"] != 0:
        return rec
    per_step = []
    for r in steps:
        tokens = rows * (args.prompt + r["completions/mean_length"])
        rollout, scoring = r["time/rollout_s"], r["time/scoring_s"]
        per_step.append(dict(step_s=r["step_time_s"], tokens=tokens, rollout_s=rollout, scoring_s=scoring,
                             update_s=r["step_time_s"] - rollout - scoring, reward=r["reward"],
                             mean_length=r["completions/mean_length"],
                             wait_s=r.get("time/rollout_wait_s"), build_s=r.get("time/rollout_build_s"),
                             sample_s=r.get("time/rollout_sample_s"),
                             streamed_layers=r.get("rollout/streamed_layers", 0),
                             fetched_bytes=r.get("rollout/fetched_bytes", 0)))  # fmt: skip
    timed = per_step[args.warmup :]
    rec.update(
        steps=per_step,
        tokens_per_s=sum(s["tokens"] for s in timed) / sum(s["step_s"] for s in timed),
        decode_tokens_per_s=sum(rows * s["mean_length"] for s in timed) / sum(s["rollout_s"] for s in timed),
        # the sampler alone (the rollout less its wait for the last step's optimizer and the
        # policy's build): what `generate` alone is compared with
        sample_tokens_per_s=(
            sum(rows * s["mean_length"] for s in timed) / sum(s["sample_s"] for s in timed)
            if timed and all(s["sample_s"] for s in timed)
            else None
        ),  # fmt: skip
        predicted=plan.get("predicted"),
        measured=plan.get("measured"),
        plan_notes=plan.get("plan", {}).get("notes"),
        log_tail=log[-2500:],
        profile=_profiles(out, Path(args.out), rec["variant"]),
    )
    return rec


def _profiles(out: Path, keep: Path, variant: str) -> dict[str, str]:
    """The tables of the steps `profile_steps` traced (name -> text), each also copied into
    `keep` (the results' folder) with the variant in its name; the traces themselves stay."""
    tables = {p.name: p.read_text() for p in sorted((out / "profile").glob("*.txt"))}
    for name, text in tables.items():
        keep.mkdir(parents=True, exist_ok=True)
        tag = variant.replace(" ", "_").replace("=", "-") or "plain"
        (keep / f"profile-{tag}-{name}").write_text(text)
    return tables


def run_generate(d: Path, model: Path, args, cache: str = "dynamic") -> dict:
    out = d / f"generate-{cache}.json"
    cmd = [sys.executable, str(HERE / "_generate.py"), "--model", str(model), "--rows",
           str(args.prompts * args.generations), "--prompt", str(args.prompt), "--completion",
           str(args.completion), "--cache", cache, "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    system = "transformers generate" + (" (static cache, compiled)" if cache == "static" else "")
    rec = {"system": system, "command": " ".join(cmd[1:]), "rc": proc.returncode}
    if proc.returncode != 0 or not out.exists():
        rec["error"] = (proc.stdout + proc.stderr)[-3000:]
        return rec
    return rec | json.loads(out.read_text())


def run_trl(d: Path, model: Path, data: Path, args) -> dict:
    """TRL's GRPOTrainer on the same model, prompts, lengths and reward (bench/_trl_grpo.py)."""
    out = d / "trl.json"
    cmd = [sys.executable, str(HERE / "_trl_grpo.py"), "--model", str(model), "--data", str(data),
           "--prompts", str(args.prompts), "--generations", str(args.generations), "--completion",
           str(args.completion), "--rows-per-micro-batch", str(args.rows_per_micro_batch),
           "--steps", str(args.steps), "--warmup", str(args.warmup), "--out", str(out)]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rec = {"system": "TRL GRPOTrainer", "command": " ".join(cmd[1:]), "rc": proc.returncode,
           "wall_s": time.perf_counter() - t0}  # fmt: skip
    if out.exists():
        rec |= json.loads(out.read_text())
    if proc.returncode != 0 or not rec.get("tokens_per_s"):
        rec["error"] = (proc.stdout + proc.stderr)[-3000:]
    return rec


# A rollout's time by part (Rollout.build_policy, generate): the last step's host AdamW it waits for, building
# the policy on the device from host memory, sampling.
ROLLOUT_PARTS = (
    ("waiting for the optimizer", "wait_s"),
    ("building the policy", "build_s"),
    ("sampling", "sample_s"),
)


def table(runs: list[dict], warmup: int = WARMUP) -> str:
    gib = lambda b: f"{b / 2**30:.1f}" if b else "-"  # noqa: E731
    lines = []
    for r in runs:
        if r.get("error"):
            lines.append(f"{r['system']}: failed (see the json)\n")
            continue
        if r["system"] == "TRL GRPOTrainer":
            lines.append(f"TRL {r['trl']} GRPOTrainer (bf16 weights on the GPU, transformers `generate`): "
                         f"**{r['tokens_per_s']:,.0f} tokens/s** over the steps after the warm-up; steps "
                         + ", ".join(f"{s['step_s']:.1f}" for s in r["steps"]) + " s; "
                         f"GPU peak {gib(r.get('gpu_peak_bytes'))} GiB")  # fmt: skip
            continue
        if r["system"] == "megatrain":
            p, m = r.get("predicted") or {}, r.get("measured") or {}
            if r.get("variant"):
                lines.append(f"megatrain with `{r['variant']}`:\n")
            lines += [
                "| step | wall s | rollout s | scoring s | update s | tokens (prompt + completion) | tokens/s | reward |",
                "|---|---|---|---|---|---|---|---|",
            ]
            for i, s in enumerate(r["steps"], 1):
                lines.append(f"| {i}{' (warm-up)' if i <= warmup else ''} | {s['step_s']:.1f} | {s['rollout_s']:.1f} | "
                             f"{s['scoring_s']:.2f} | {s['update_s']:.1f} | {s['tokens']:,.0f} | "
                             f"{s['tokens'] / s['step_s']:,.0f} | {s['reward']:.3f} |")  # fmt: skip
            lines += [
                "",
                f"megatrain GRPO: **{r['tokens_per_s']:,.0f} tokens/s** over the steps after the warm-up; "
                f"{r['decode_tokens_per_s']:,.0f} completion tokens/s of rollout time"
                + (f", {r['sample_tokens_per_s']:,.0f} of sampling time" if r.get("sample_tokens_per_s") else ""),
                "the last step's rollout: "
                + ", ".join(f"{what} {r['steps'][-1][k]:.1f} s" for what, k in ROLLOUT_PARTS
                            if r['steps'][-1].get(k) is not None),
                f"{r['steps'][-1]['streamed_layers']} layers streamed in every forward of the rollout "
                f"({gib(r['steps'][-1]['fetched_bytes'])} GiB fetched a rollout); "
                f"GPU peak of the update {gib(m.get('gpu_peak_allocated'))} GiB (plan {gib(p.get('gpu_peak_allocated'))}); "
                f"the rollout added {gib(m.get('rollout_gpu_added'))} GiB (plan keeps {gib(p.get('rollout_gpu_added'))}); "
                f"host {gib(m.get('host_peak_rss'))} GiB (plan {gib(p.get('host_peak_rss'))})",
                "",
            ]  # fmt: skip
        else:
            lines.append(f"{r['system']} alone (same model in bf16, same batch, {r['cache']} cache): "
                         f"{r['decode_tokens_per_s']:,.0f} completion tokens/s ({r['s']:.1f} s for "
                         f"{r['rows']} x {r['completion']} tokens), GPU peak {gib(r['gpu_peak_bytes'])} GiB")  # fmt: skip
    mine = next((r for r in runs if r["system"] == "megatrain" and not r.get("error")), None)
    trl = next((r for r in runs if r["system"] == "TRL GRPOTrainer" and not r.get("error")), None)
    for r in runs if trl else []:
        if r["system"] == "megatrain" and not r.get("error"):
            which = f" with `{r['variant']}`" if r.get("variant") else ""
            lines.append(f"\n**megatrain{which} / TRL GRPOTrainer: {r['tokens_per_s'] / trl['tokens_per_s']:.2f}x** "
                         "(tokens/s, the same GPU, model, prompts, lengths and reward)")  # fmt: skip
    peer = next((r for r in runs if r["system"].startswith("transformers") and not r.get("error")), None)
    if mine and peer:
        rate, of = (
            (mine["sample_tokens_per_s"], "sampling")
            if mine.get("sample_tokens_per_s")
            else (mine["decode_tokens_per_s"], "rollout")
        )  # records from before the rollout's parts were timed
        lines.append(f"\nsampling inside megatrain (per second of {of} time) / `generate` alone: "
                     f"{rate / peer['decode_tokens_per_s']:.2f}x")  # fmt: skip
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="Q7")
    p.add_argument("--prompts", type=int, default=32, help="prompts per optimizer step")
    p.add_argument("--generations", type=int, default=8, help="num_generations")
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens")
    p.add_argument("--completion", type=int, default=512, help="max_completion_length")
    p.add_argument("--rows-per-micro-batch", type=int, default=16, help="per_device_train_batch_size")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=WARMUP, help="steps left out of the rates, every system")
    p.add_argument(
        "--systems",
        default="megatrain,trl,generate",
        help="of megatrain, trl, generate, generate-static; megatrain+KEY=VALUE[+...] runs megatrain once more with those overrides",
    )
    p.add_argument("--megatrain", nargs="*", default=[], help="extra key=value for megatrain")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tag", default="grpo")
    args = p.parse_args()
    shape = DENSE_SHAPES[args.shape]
    runs, stopped = [], None
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        d = Path(tmp)
        model, data = write_inputs(d, shape, args)
        try:
            for system in args.systems.split(","):
                name, *variant = system.split("+")
                runs.append(
                    run_megatrain(d, model, data, args, variant)
                    if name == "megatrain"
                    else run_trl(d, model, data, args)
                    if system == "trl"
                    else run_generate(d, model, args, "static" if system == "generate-static" else "dynamic")
                )
                print(
                    json.dumps({k: v for k, v in runs[-1].items() if k not in ("log_tail", "profile")})[
                        :2000
                    ],
                    flush=True,
                )
        except KeyboardInterrupt:  # a time limit's SIGINT: the systems that finished are still written
            stopped = f"stopped by SIGINT during {system}; the systems before it finished"
        # written before the temporary directory goes: removing a model's files takes a while,
        # and a time limit then must not lose the runs
        write(args, runs, stopped)


def write(args, runs: list[dict], stopped: str | None) -> None:
    import torch

    from megatrain.models.config import ModelConfig

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpus": os.cpu_count(),
        "command": "python bench/grpo.py " + " ".join(sys.argv[1:]),
        "shape": args.shape,
        "num_params": ModelConfig.from_hf(
            model_config({"shape": DENSE_SHAPES[args.shape], "seq": 4096})
        ).num_params,
        "completions_per_step": args.prompts * args.generations,
    }
    if stopped:
        meta["stopped"] = stopped
    text = table(runs, args.warmup)
    print(text)
    write_once(args.out, args.tag, f"{args.tag}: GRPO", meta, runs, text, key="runs",
               stamp=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M"))  # fmt: skip


if __name__ == "__main__":
    main()
