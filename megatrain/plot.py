"""`megatrain plot`: loss (training and eval), learning rate, gradient norm and throughput from
metrics.jsonl, as one PNG of 2 x 2 panels."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from .errors import MegatrainError
from .metrics import is_eval

PANELS = (
    ("loss", "training loss", "loss"),
    ("lr", "learning rate", "learning rate"),
    ("grad_norm", "gradient norm (before clipping)", "L2 norm"),
    ("tokens_per_s", "throughput", "tokens / s"),
)


def read_metrics(path: str | Path) -> tuple[list[dict], list[dict]]:
    """The step records and the evaluation records of a metrics.jsonl (or of the one in an output
    directory), each by step: a torn last line (a killed run) is ignored, and a step logged twice
    keeps its last record."""
    p = Path(path)
    if p.suffix != ".jsonl":  # an output directory
        p = p / "metrics.jsonl"
    if not p.is_file():
        raise MegatrainError(f"{p}: no such file (plot reads the metrics.jsonl a training run writes)")
    steps: dict[int, dict] = {}
    evals: dict[int, dict] = {}
    for line in p.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(rec, dict) and isinstance(rec.get("step"), int):
            (evals if is_eval(rec) else steps)[rec["step"]] = rec
    if not steps:
        raise MegatrainError(f"{p}: no training records")
    return [steps[s] for s in sorted(steps)], [evals[s] for s in sorted(evals)]


def _smooth(values: list[float], span: int) -> list[float]:
    """Exponential moving average that ignores gaps (None); TensorBoard-style smoothing."""
    alpha, out, avg = 2.0 / (span + 1), [], None
    for v in values:
        if v is not None:
            avg = v if avg is None else avg + alpha * (v - avg)
        out.append(avg if avg is not None else math.nan)
    return out


def plot_metrics(output_dir: str | Path, out: str | Path | None = None) -> Path:
    """Draw the four panels to `out` (default `output_dir/training.png`); returns the path."""
    records, evals = read_metrics(output_dir)
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError:
        raise MegatrainError("plot needs matplotlib (pip install 'megatrain[plot]')") from None
    base = Path(output_dir) if Path(output_dir).suffix != ".jsonl" else Path(output_dir).parent
    out = Path(out) if out is not None else base / "training.png"

    # A Figure with its own Agg canvas: no pyplot global state, no display needed.
    fig = Figure(figsize=(11, 7), layout="constrained")
    FigureCanvasAgg(fig)
    steps = [r["step"] for r in records]
    skipped = [r["step"] for r in records if r.get("skipped")]
    for ax, (key, title, ylabel) in zip(fig.subplots(2, 2).flat, PANELS):
        ys = [r.get(key) if isinstance(r.get(key), (int, float)) else None for r in records]
        raw = dict(lw=0.8, alpha=0.45, label="training") if key == "loss" else dict(lw=0.8)
        ax.plot(steps, [math.nan if y is None else y for y in ys], **raw)
        if key == "loss" and len(steps) >= 20:
            ax.plot(steps, _smooth(ys, max(5, len(steps) // 50)), lw=1.6, label="smoothed")
        if key == "loss" and evals:  # held-out loss, at the steps it was evaluated
            ev = [math.nan if r.get("eval_loss") is None else r["eval_loss"] for r in evals]
            ax.plot([r["step"] for r in evals], ev, marker="o", ms=3.5, lw=1.4, label="eval")
            title = "training and eval loss"
        if key == "loss" and skipped:
            # x marks at the bottom edge of the panel (axes coordinates in y): a skipped step has no loss.
            marks = dict(marker="x", color="red", clip_on=False, label="skipped (non-finite)")
            ax.scatter(skipped, [0] * len(skipped), transform=ax.get_xaxis_transform(), **marks)
        if key == "loss" and (len(steps) >= 20 or skipped or evals):
            ax.legend(loc="upper right", fontsize=8)
        finite = [y for y in ys if y is not None]
        if key == "grad_norm" and finite and min(finite) > 0 and max(finite) / min(finite) > 100:
            ax.set_yscale("log")  # early spikes would flatten the rest of the curve
        ax.set_title(title)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{base.resolve().name}: {len(records)} steps")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    fig.savefig(tmp, dpi=110, format="png")
    os.replace(tmp, out)  # a viewer never sees a half-written image
    return out
