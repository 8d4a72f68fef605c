"""`megatrain plot`: loss (training and eval), learning rate, gradient norm and throughput from
metrics.jsonl, as one figure of 2 x 2 panels (PNG, JPEG, SVG or PDF: plotfile.py writes it)."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

from .errors import MegatrainError
from .plotfile import check_target, format_of, write_plot
from .trackers import is_eval

PANELS = (
    ("loss", "training loss", "loss"),
    ("lr", "learning rate", "learning rate"),
    ("grad_norm", "gradient norm (before clipping)", "L2 norm"),
    ("tokens_per_s", "throughput", "tokens / s"),
)
SHORT_RUN = 20  # steps: below it every point is marked and the loss is not smoothed


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


def _smooth(values: list[float | None], half: int) -> list[float]:
    """Centred moving average over `half` steps on each side, the window narrowed alike on both
    sides near the ends, ignoring gaps (None). Centred, it does not lag: an exponential average
    sits above a falling loss by its lag times the slope, a centred one on the trend."""
    sums, counts = [0.0], [0]  # prefix sums: O(1) per window
    for v in values:
        sums.append(sums[-1] + (v if v is not None else 0.0))
        counts.append(counts[-1] + (v is not None))
    out, n = [], len(values)
    for i in range(n):
        h = min(half, i, n - 1 - i)
        k = counts[i + h + 1] - counts[i - h]
        out.append((sums[i + h + 1] - sums[i - h]) / k if k else math.nan)
    return out


def draw(records: list[dict], evals: list[dict], title: str):
    """The four panels of `read_metrics`' records, as a matplotlib Figure (with an Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    # A Figure with its own Agg canvas: no pyplot global state, no display needed.
    fig = Figure(figsize=(11, 7), layout="constrained")
    FigureCanvasAgg(fig)
    steps = [r["step"] for r in records]
    skipped = [r["step"] for r in records if r.get("skipped")]
    short = len(steps) < SHORT_RUN
    for ax, (key, name, ylabel) in zip(fig.subplots(2, 2).flat, PANELS):
        ys = [r.get(key) if isinstance(r.get(key), (int, float)) else None for r in records]
        raw: dict = dict(lw=0.8)
        if key == "loss":
            raw.update(label="training", alpha=1.0 if short else 0.45)  # faint under the smoothed line
        if short:  # a line needs two points: a one-step run would show nothing
            raw.update(marker="o", ms=3.5)
        ax.plot(steps, [math.nan if y is None else y for y in ys], **raw)
        if key == "loss" and not short:
            ax.plot(steps, _smooth(ys, max(2, len(steps) // 100)), lw=1.6, label="smoothed")
        if key == "loss" and evals:  # held-out loss, at the steps it was evaluated
            ev = [math.nan if r.get("eval_loss") is None else r["eval_loss"] for r in evals]
            ax.plot([r["step"] for r in evals], ev, marker="o", ms=3.5, lw=1.4, label="eval")
            name = "training and eval loss"
        if key == "loss" and skipped:
            # x marks at the bottom edge of the panel (axes coordinates in y): a skipped step has no loss.
            marks = dict(marker="x", color="red", clip_on=False, label="skipped (non-finite)")
            ax.scatter(skipped, [0] * len(skipped), transform=ax.get_xaxis_transform(), **marks)
        if key == "loss" and (not short or skipped or evals):
            ax.legend(loc="upper right", fontsize=8)
        finite = [y for y in ys if y is not None]
        if key == "grad_norm" and finite and min(finite) > 0 and max(finite) / min(finite) > 100:
            ax.set_yscale("log")  # early spikes would flatten the rest of the curve
        # Steps are whole: no 1.5 on a short run, and one tick where a one-step run has one integer in view.
        ax.xaxis.set_major_locator(MaxNLocator(integer=True, min_n_ticks=1))
        ax.set_title(name)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3)
    fig.suptitle(f"{title}: {len(records)} step{'s' if len(records) != 1 else ''}")
    return fig


def plot_metrics(output_dir: str | Path, out: str | Path | None = None, overwrite: bool = False) -> Path:
    """Draw the four panels to `out` (default `output_dir/training.png`), in the format its suffix
    names; an existing file there is replaced only with `overwrite`, and only if it is a plot
    megatrain wrote (plotfile.py). Returns the path."""
    base = Path(output_dir) if Path(output_dir).suffix != ".jsonl" else Path(output_dir).parent
    out = Path(out) if out is not None else base / "training.png"
    fmt = format_of(out)
    check_target(out, overwrite)  # before any work: refused now, not after drawing
    records, evals = read_metrics(output_dir)
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise MegatrainError("plot needs matplotlib (pip install 'megatrain[plot]')") from None
    buffer = io.BytesIO()
    draw(records, evals, base.resolve().name).savefig(buffer, dpi=110, format=fmt)
    write_plot(out, buffer.getvalue(), overwrite)
    return out
