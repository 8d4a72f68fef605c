"""A run's time before its first step, by part: `megatrain train` with `stage: grpo` on a dense
shape (random weights, random prompts), stopped at its "ready for step 1" line, whose parts
(imports, inputs and plan, random weights, page-locking, GPU-resident state, the rest of the
engine; and what ran beside the plan: the weights drawn while it probed a layer) are the record; or (`--mode build`) build_model alone in this process, timed the same way,
with `--profile` its cProfile top.

    python bench/startup.py --shape Q7 --device cuda --prompts 16 --generations 8 --prompt 128 --completion 256
    python bench/startup.py --shape Q7 --layers 4 --device cpu --mode build --profile

The target (docs/open-work.md): a 7.6 B Qwen2.5-7B shape ready within 45 s on one H200. Writes
{stamp}_{tag}.json/.md into --out.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import os
import pstats
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # the repository
from _report import write_once  # noqa: E402
from _shapes import DENSE_SHAPES  # noqa: E402
from grpo import write_inputs  # noqa: E402

READY = re.compile(r"ready for step 1 ([0-9.]+) s after the command: (.*)$")


def parse_ready(line: str) -> dict | None:
    """The total and the parts of the trainer's "ready for step 1" line (None: not that line),
    and what it says ran beside a part (`beside`: {part: its parts}, not in the total)."""
    m = READY.search(line)
    if m is None:
        return None
    listed, _, beside = m.group(2).partition("; beside ")
    rec = {"total_s": float(m.group(1)), "parts": _seconds(listed)}
    if beside:
        part, _, items = beside.partition(": ")
        rec["beside"] = {part: _seconds(items)}
    return rec


def _seconds(items: str) -> dict[str, float]:
    """{name: seconds} of "name 1.2, other name 3.4"."""
    return {name: float(s) for name, _, s in (item.rpartition(" ") for item in items.split(", "))}


def run_train(d: Path, shape: dict, args) -> dict:
    """`megatrain train` until its "ready for step 1" line, then stopped (its first step is not
    the measurement)."""
    model, data = write_inputs(d, shape, args)
    rows = args.prompts * args.generations
    settings = dict(
        model_config=str(model), dataset=str(data), stage="grpo", output_dir=str(d / "out"),
        reward_funcs=["_grpo_reward:parity"], num_generations=args.generations,
        max_prompt_length=args.prompt, max_completion_length=args.completion,
        per_device_train_batch_size=min(16, rows), gradient_accumulation_steps=max(1, rows // 16),
        max_steps=1, learning_rate=1e-6, save_strategy="no", save_final_model=False,
        disable_tqdm=True, logging_steps=1, shuffle=False, device=args.device,
    )  # fmt: skip
    (d / "startup.yaml").write_text("".join(f"{k}: {json.dumps(v)}\n" for k, v in settings.items()))
    cmd = [sys.executable, "-m", "megatrain", "train", str(d / "startup.yaml"), *args.megatrain]
    env = os.environ | {
        "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")]),
        "PYTHONUNBUFFERED": "1",  # its lines as they are written, not when a buffer fills
    }
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=d, env=env)
    rec: dict = {"mode": "train", "command": " ".join(cmd[1:]), "settings": settings}
    tail: list[str] = []
    for line in proc.stdout:
        # echoed as it comes, so that a run cut by a time limit shows where it was
        print(f"  {time.perf_counter() - t0:6.1f} s | {line}", end="", flush=True)
        tail = (tail + [line])[-40:]
        got = parse_ready(line)
        if got is not None:
            rec.update(got, wall_s=time.perf_counter() - t0)
            # the child this script started; SIGTERM would let it finish its step (the trainer's
            # graceful stop), and nothing of the run is kept
            proc.kill()
            break
    proc.wait()
    if "total_s" not in rec:
        rec["error"] = "".join(tail)[-4000:]
    rec["log_tail"] = "".join(tail)[-2500:]
    return rec


def run_build(shape: dict, args) -> dict:
    """build_model of the shape with random weights, in this process, its parts timed (and
    profiled with `--profile`)."""
    import torch
    from _systems import model_config

    from megatrain.models.config import ModelConfig
    from megatrain.runtime import build_model

    cfg = ModelConfig.from_hf(model_config({"shape": shape, "seq": args.prompt + args.completion}))
    timings: dict[str, float] = {}
    prof = cProfile.Profile() if args.profile else None
    t0 = time.perf_counter()
    if prof is not None:
        prof.enable()
    model = build_model(cfg, device=args.device, timings=timings)
    if prof is not None:
        prof.disable()
    total = time.perf_counter() - t0
    rec = {"mode": "build", "total_s": total, "parts": timings, "params": model.state.num_params,
           "threads": torch.get_num_threads()}  # fmt: skip
    model.close()
    if prof is not None:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(25)
        rec["profile"] = s.getvalue()[-6000:]
    return rec


def table(rec: dict) -> str:
    lines = ["| part | s |", "|---|---:|"]
    lines += [f"| {k} | {v:.1f} |" for k, v in rec.get("parts", {}).items()]
    for part, parts in rec.get("beside", {}).items():
        lines += [f"| {k} (beside {part}, not in the total) | {v:.1f} |" for k, v in parts.items()]
    lines.append(f"| **total** | **{rec.get('total_s', float('nan')):.1f}** |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="Q7")
    p.add_argument("--layers", type=int, default=None, help="the shape with this many layers")
    p.add_argument("--device", default="auto")
    p.add_argument("--mode", choices=("train", "build"), default="train")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--generations", type=int, default=8)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--completion", type=int, default=256)
    p.add_argument("--steps", type=int, default=1, help="prompts are written for this many steps")
    p.add_argument("--profile", action="store_true", help="--mode build: cProfile's top, by cumulative time")
    p.add_argument("--megatrain", nargs="*", default=[], help="extra key=value for megatrain")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tag", default="startup")
    args = p.parse_args()
    shape = dict(DENSE_SHAPES[args.shape])
    if args.layers is not None:
        shape["layers"] = args.layers
    if args.mode == "train":
        with tempfile.TemporaryDirectory() as tmp:
            rec = run_train(Path(tmp), shape, args)
    else:
        rec = run_build(shape, args)
    print(table(rec))
    if "profile" in rec:
        print(rec["profile"])
    if "error" in rec:
        print(rec["error"], file=sys.stderr)
    import torch  # (after the run: the run's own imports are timed in its process)

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    meta = {"shape": args.shape, "layers": shape["layers"], "device": f"{args.device} ({gpu})", "mode": args.mode,
            "command": "python bench/startup.py " + " ".join(sys.argv[1:])}  # fmt: skip
    stem = write_once(args.out, args.tag, "Time to the first step", meta, [rec], table(rec))
    print(f"wrote {stem}.json and .md")


if __name__ == "__main__":
    main()
