"""The optimizer modes (`optim`): the chat example's fine-tune with fp32, bf16 and 8-bit AdamW
moments side by side, and the host optimizer's pass over each mode's state.

* **fine-tune**: the quickstart's pretraining (examples/quickstart.yaml, its 200 steps) makes the
  chat example's model; then examples/chat.yaml trains it `--steps` steps (its 100 by default in
  the example; 200 here) once per mode: adamw_torch, adamw_anyprecision with bf16 moments,
  adamw_8bit. The same data in the same order: the curves differ only by the moments. The final
  loss is the mean of the last `--tail` steps' losses (one step's loss is one batch's); each
  mode's is beside fp32's, within 1% or not.
* **pass**: `HostAdamW.step_held` (the optimizer worker's pass over gradients held in host memory)
  over the state of a Llama of `--shape`'s layers nearest `--pass-params` parameters, in each
  mode, on one thread and on every CPU: elements a second, beside fp32's
  (clipadam's kernel on the master's halves); the bf16 and 8-bit ones by engine/momentkernel.py's
  kernel on the halves where it builds (the run says which).

Results: JSON (both curves, every step) + Markdown under --out.

    python bench/optim_modes.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from megatrain import OMP_WAIT_POLICY  # noqa: E402  (no torch: libgomp reads the policy as torch loads)

os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)

import torch  # noqa: E402
from _adamw_engine import llama  # noqa: E402
from _report import params_str, write_once  # noqa: E402
from adamw import host  # noqa: E402

from megatrain.engine import momentkernel  # noqa: E402
from megatrain.engine.optim import AdamWConfig, HostAdamW  # noqa: E402
from megatrain.host.moments import BF16, FP32, Q8  # noqa: E402
from megatrain.host.split import Halves, split_  # noqa: E402
from megatrain.host.state import HostState, build_units, state_bytes  # noqa: E402
from megatrain.planning.planspec import STAGING_CHUNK  # noqa: E402

MODES = {"fp32": FP32, "bf16": BF16, "8bit": Q8}


def _train(config: Path, out: Path, *overrides: str) -> float:
    """`megatrain train config key=value...` in a subprocess from the repository root; its seconds."""
    t = time.perf_counter()
    cmd = [sys.executable, "-m", "megatrain", "train", str(config), f"output_dir={out}", *overrides]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"{' '.join(cmd)} failed:\n{done.stderr[-2000:]}")
    return time.perf_counter() - t


def _losses(out: Path) -> list[float]:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


def fine_tune(work: Path, steps: int, tail: int, base: str | None) -> tuple[list[dict], dict]:
    """The chat fine-tune in each mode: rows (mode, final loss, vs fp32, seconds) and curves."""
    if base is None:
        seconds = _train(REPO / "examples" / "quickstart.yaml", work / "quickstart", "save_strategy=no")
        print(f"quickstart (the chat example's model): {seconds:.0f} s", flush=True)
        base = str(work / "quickstart" / "final")
    rows, curves = [], {}
    for name, fmt in MODES.items():
        settings = [f"{k}={v}" for k, v in fmt.settings.items()]
        out = work / f"chat-{name}"
        seconds = _train(
            REPO / "examples" / "chat.yaml", out, f"model_name_or_path={base}", f"max_steps={steps}",
            "save_strategy=no", "save_final_model=false", *settings,
        )  # fmt: skip
        curves[name] = _losses(out)
        final = sum(curves[name][-tail:]) / tail
        rows.append({"mode": name, "optim": " ".join(settings), "final_loss": final, "seconds": seconds})
        print(f"{name}: final loss {final:.4f} ({seconds:.0f} s)", flush=True)
    ref = rows[0]["final_loss"]
    for r in rows:
        r["vs_fp32"] = r["final_loss"] / ref - 1
        r["within_1pct"] = abs(r["vs_fp32"]) <= 0.01
    return rows, curves


def host_pass(params: float, shape: str, vocab: int, repeats: int) -> list[dict]:
    """Elements a second of the host optimizer's pass in each mode, on one and on all threads."""
    cfg = llama(shape, params, vocab)
    units = build_units(cfg)
    n = sum(u.numel for u in units)
    gen = torch.Generator().manual_seed(0)
    grads = [torch.randn(u.numel, generator=gen) * 1e-3 for u in units]
    rows = []
    for name, fmt in MODES.items():
        state = HostState(units, moments=fmt)
        split_(torch.empty(state.numel).normal_(0, 0.02, generator=gen), Halves(state.hi, state.lo))
        opt = HostAdamW(state, AdamWConfig(1e-4, (0.9, 0.95), 1e-8, 0.1, fmt))
        for threads in sorted({1, os.cpu_count() or 1}):
            torch.set_num_threads(threads)
            times = []
            for step in range(1, repeats + 2):  # the first maps the moments' pages: not timed
                t = time.perf_counter()
                for u, g in zip(units, grads):
                    opt.step_held(u, g, torch.tensor(0.5), 1e-4, step, STAGING_CHUNK)
                times.append(time.perf_counter() - t)
            best = min(times[1:])
            rows.append({"mode": name, "threads": threads, "elements": n, "best_s": best, "elements_per_s": n / best,
                         "state_bytes_per_param": state_bytes(fmt)})  # fmt: skip
            print(f"{name} on {threads} thread(s): {n / best / 1e6:.0f} M elements/s", flush=True)
        del state, opt
    for r in rows:
        ref = next(x for x in rows if x["mode"] == "fp32" and x["threads"] == r["threads"])
        r["vs_fp32"] = r["elements_per_s"] / ref["elements_per_s"]
    return rows


def _tables(tune: list[dict], passes: list[dict], steps: int, tail: int) -> str:
    out = []
    if tune:
        out += [f"## fine-tune: examples/chat.yaml, {steps} steps (final loss: the mean of the last {tail})", "",
                "| mode | optim | final loss | vs fp32 | within 1% | seconds |", "|---|---|---|---|---|---|"]  # fmt: skip
        out += [
            f"| {r['mode']} | `{r['optim']}` | {r['final_loss']:.4f} | {r['vs_fp32']:+.2%} | "
            f"{'yes' if r['within_1pct'] else 'NO'} | {r['seconds']:.0f} |"
            for r in tune
        ]
        out.append("")
    if passes:
        out += ["## host pass: HostAdamW.step_held over held gradients, clipped", "",
                "| mode | state B/param | threads | elements | best s | M elements/s | vs fp32 |",
                "|---|---|---|---|---|---|---|"]  # fmt: skip
        out += [
            f"| {r['mode']} | {r['state_bytes_per_param']:.2f} | {r['threads']} | {params_str(r['elements'])} | "
            f"{r['best_s']:.3f} | {r['elements_per_s'] / 1e6:.0f} | {r['vs_fp32']:.0%} |"
            for r in passes
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200, help="the fine-tune's steps")
    ap.add_argument("--tail", type=int, default=10, help="steps whose mean loss is the final one")
    ap.add_argument(
        "--base", default=None, help="the chat example's model (default: pretrain the quickstart's)"
    )
    ap.add_argument("--pass-params", type=float, default=1e8, help="the host pass's model size (0: no pass)")
    ap.add_argument("--shape", default="A", help="the host pass's layer shape (bench/_shapes.py)")
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-fine-tune", action="store_true")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    kernel, why = momentkernel.load()
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": "cpu",
        "host": host(),
        "load": os.getloadavg()[0],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "moment_kernel": why,
        "command": "python bench/optim_modes.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    tune, curves = [], {}
    if not args.no_fine_tune:
        with tempfile.TemporaryDirectory(prefix="optim-modes-") as d:
            tune, curves = fine_tune(Path(d), args.steps, args.tail, args.base)
    passes = host_pass(args.pass_params, args.shape, args.vocab, args.repeats) if args.pass_params else []
    table = _tables(tune, passes, args.steps, args.tail)
    print(table)
    if args.out:
        rows = {"fine_tune": tune, "curves": curves, "host_pass": passes}
        stem = write_once(
            args.out,
            "optim-modes",
            "AdamW moments: fp32, bf16, 8-bit (optim)",
            meta,
            rows,
            table,
            key="results",
        )
        print(f"wrote {stem}.json, {stem}.md")


if __name__ == "__main__":
    main()
