"""Result writers of bench.py: the table (stdout and Markdown), the JSON records and the plot.

Each writer is called after every system finishes and rewrites its file from all records so far;
a writer that fails (e.g. matplotlib missing) is reported and does not stop the others. The
one-shot scripts (adamw.py, link.py) write theirs once, with `write_once`.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _sched import describe as describe_threads

SYSTEM_ORDER = ("megatrain", "megatrain-host", "deepspeed", "resident")
COLORS = {"megatrain": "#1f77b4", "megatrain-host": "#9ecae1", "deepspeed": "#ff7f0e", "resident": "#2ca02c"}


def _f(fmt: str) -> Callable[[Any], str]:
    return lambda v: "-" if v is None else format(v, fmt)


# (header, record key, formatter)
COLUMNS: list[tuple[str, str, Callable[[Any], str]]] = [
    ("system", "system", str),
    ("tokens/step", "tokens_per_step", _f(",d")),
    ("step s", "step_s", _f(".3f")),
    ("tokens/s", "tokens_per_s", _f(",.0f")),
    ("model TFLOP/s", "model_tflops", _f(".1f")),
    ("hw TFLOP/s", "hw_tflops", _f(".1f")),
    ("GPU busy", "gpu_busy", _f(".0%")),
    ("H2D GB/s", "h2d_gbps", _f(".1f")),
    ("D2H GB/s", "d2h_gbps", _f(".1f")),
    ("opt s", "opt_s", _f(".2f")),
    ("GPU peak GiB", "gpu_peak_gib", _f(".1f")),
    ("host RSS GiB", "host_peak_rss_gib", _f(".1f")),
    ("bytes/param", "bytes_per_param", _f(".1f")),
    ("vs DeepSpeed", "ratio_vs_deepspeed", _f(".2f")),
    ("vs resident", "ratio_vs_resident", _f(".2f")),
    ("error", "error", lambda v: "" if v is None else str(v)[:70]),
]


def params_str(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e8 else f"{n / 1e6:.2f} M"


def add_ratios(records: list[dict[str, Any]]) -> None:
    """tokens/s of each record over that of a baseline at the same tokens per step."""
    for r in records:
        for base in ("deepspeed", "resident"):
            b = next(
                (x for x in records if x["system"] == base and x["tokens_per_step"] == r["tokens_per_step"]),
                None,
            )
            ok = b is not None and b.get("tokens_per_s") and r.get("tokens_per_s")
            r[f"ratio_vs_{base}"] = r["tokens_per_s"] / b["tokens_per_s"] if ok else None


def _rows(records: list[dict[str, Any]]) -> list[list[str]]:
    return [[fmt(r.get(key)) for _, key, fmt in COLUMNS] for r in records]


def text_table(records: list[dict[str, Any]]) -> str:
    head = [h for h, _, _ in COLUMNS]
    rows = _rows(records)
    widths = [max(len(x) for x in col) for col in zip(head, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i else c.ljust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(head), line(["-" * w for w in widths]), *map(line, rows)])


def md_table(records: list[dict[str, Any]]) -> str:
    head = [h for h, _, _ in COLUMNS]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    out += ["| " + " | ".join(c.replace("|", "/") for c in row) + " |" for row in _rows(records)]
    return "\n".join(out)


def write_once(out: str, name: str, title: str, meta: dict[str, Any], rows: list[dict], table: str,
               key: str = "rows", stamp: str | None = None) -> str:  # fmt: skip
    """`<out>/<minute>_<name>.json` (meta, and the rows under `key`) and `.md` (title, meta,
    table; the date first where meta has none); exits naming the file instead where either
    exists: nothing is overwritten. `stamp`: the minute (default now, as `%Y-%m-%d_%H%M`).
    Returns the path without suffix."""
    os.makedirs(out, exist_ok=True)
    stamp = stamp or datetime.datetime.now().strftime("%Y-%m-%d_%H%M")
    stem = os.path.join(out, stamp + "_" + name)
    for path in (stem + ".json", stem + ".md"):
        if os.path.exists(path):
            sys.exit(f"{path} exists; nothing is overwritten")
    meta = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"), **meta}
    with open(stem + ".json", "w") as f:
        json.dump({**meta, key: rows}, f, indent=1)
    with open(stem + ".md", "w") as f:
        f.write(f"# {title}\n\n" + "".join(f"- {k}: {v}\n" for k, v in meta.items()) + "\n" + table + "\n")
    return stem


def write_json(records: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(json.dumps(records, indent=1, default=str))
    os.replace(tmp, path)


def _summary_lines(records: list[dict[str, Any]]) -> list[str]:
    out = []
    for r in records:
        if r["system"].startswith("megatrain") and r.get("tokens_per_s"):
            parts = [
                f"{base} {r[f'ratio_vs_{base}']:.2f}x"
                for base in ("deepspeed", "resident")
                if r.get(f"ratio_vs_{base}") is not None
            ]
            out.append(
                f"- {r['tokens_per_step']:,} tokens/step: {r['system']} {r['tokens_per_s']:,.0f} tokens/s"
                + (f" = {', '.join(parts)}" if parts else " (no baseline finished)")
            )
    return out


def _giga(x: float | None) -> str:
    return "-" if x is None else f"{x / 1e9:.2f} G"


def _gaps(r: dict[str, Any]) -> str:
    """The compute stream's idle gaps (bench/_profile.py's `idle_gaps`), longest first, or nothing."""
    if not r.get("idle_gaps"):
        return ""
    each = [
        f"{g['ms']:.1f} ms at {g['at_ms']:.0f} ms ({g['before']} -> {g['after']}; "
        f"H2D {g['h2d']:.0%}, D2H {g['d2h']:.0%})"
        for g in sorted(r["idle_gaps"], key=lambda g: -g["ms"])
    ]
    return (
        f"compute stream idle {r['idle_gap_s']:.3f} s in {r['idle_gap_count']} gaps of "
        f"{r['idle_gap_least_ms']:g} ms or more, "
        f"the longest {'; '.join(each)}; "
    )


def _rows_ahead(r: dict[str, Any]) -> str:
    """Where the plan fetched the embedding's rows: the host's seconds a step computing them ahead,
    and its seconds waiting before it, for the next pass to post them and for the gradient's rows
    to land (records from before those counts held the waits in the first figure)."""
    if not (r.get("plan") or {}).get("embed_rows"):
        return ""
    line = f"the embedding's rows computed ahead in {(r.get('rows_ahead_s') or 0) * 1e3:.1f} ms a step"
    if r.get("rows_wait_s") is not None:
        line += (
            f" after {r['rows_wait_s'] * 1e3:.1f} ms waiting for them to be posted and "
            f"{(r.get('rows_copy_wait_s') or 0) * 1e3:.1f} ms for the gradient's rows to land"
        )
    return line + "; "


def _megatrain_detail(r: dict[str, Any]) -> str:
    def g(k: str, f: str = ".2f") -> str:
        return "-" if r.get(k) is None else format(r[k], f)

    return (
        f"- {r['tokens_per_step']:,} tokens/step: step {g('step_s', '.3f')} s (median {g('step_median_s', '.3f')}); "
        f"standalone optimizer {g('opt_s')} s (first pass {g('opt_first_s')} s); serial step = compute "
        f"{g('serial_fb_s')} s + optimizer {g('serial_opt_s')} s; optimizer hidden {g('opt_hidden_frac', '.0%')}; "
        f"host AdamW in a step {g('host_adam_s', '.3f')} s of work at {_giga(r.get('host_adam_params_s'))} "
        f"params/s, the launching thread blocked {g('update_wait_s', '.3f')} s a step on updates; "
        f"{_rows_ahead(r)}"
        f"threads a step: {describe_threads(r.get('threads_per_step'))}; "
        f"GPU busy {g('gpu_busy', '.0%')} on the compute stream, {g('gpu_busy_any', '.0%')} any stream, "
        f"H2D copies {g('h2d_busy', '.0%')}, D2H copies {g('d2h_busy', '.0%')}; "
        f"{_gaps(r)}"
        f"H2D {g('h2d_bytes_per_step', ',.0f')} B/step, D2H {g('d2h_bytes_per_step', ',.0f')} B/step; "
        f"kept layer graphs {r.get('keep_layers', '-')}, GPU-resident units {r.get('gpu_resident_units', '-')} "
        f"({g('gpu_resident_params', ',')} params), units stepped on the GPU {r.get('gpu_stepped_units', '-')}; "
        f"init {g('init_s', '.0f')} s; losses {[round(x, 3) for x in r.get('losses') or []]}"
    )


def write_md(records: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    lines = [
        f"# megatrain benchmark: {meta['stem']}",
        "",
        f"- date: {meta['date']}",
        f"- device: {meta['device']}",
        f"- model: {meta['model']} {meta['shape']}, {params_str(meta['params'])} params, seq {meta['seq_len']}",
        f"- command: `{meta['command']}`",
        "",
        md_table(records),
        "",
        "## megatrain vs baselines (tokens/s ratio)",
        "",
        *(_summary_lines(records) or ["- no megatrain run finished"]),
        "",
        "## megatrain details",
        "",
        *[
            _megatrain_detail(r)
            for r in records
            if r["system"].startswith("megatrain") and not r.get("error")
        ],
        "",
        "## other measurements",
        "",
    ]
    for r in records:
        lines.append(
            f"- {r['system']} {r['tokens_per_step']:,}: mbs {r.get('mbs')} x accumulation {r.get('grad_accum')}, "
            f"step times {[round(x, 3) for x in r.get('step_times') or []]} (first {r.get('warmup')} warm-up), "
            f"system-wide host memory peak {r.get('host_sys_peak_gib') or 0:.1f} GiB, "
            f"GPU busy note: {r.get('gpu_busy_note')}, run wall {r.get('wall_s') or 0:.0f} s"
        )
    failed = [r for r in records if r.get("error")]
    if failed:
        lines += ["", "## errors", ""]
        for r in failed:
            lines += [f"### {r['system']} {r['tokens_per_step']:,}: {r['error']}", ""]
            if r.get("error_detail"):
                lines += ["```", r["error_detail"][-3000:], "```", ""]
    path.write_text("\n".join(lines) + "\n")


def write_png(records: list[dict[str, Any]], meta: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tokens = sorted({r["tokens_per_step"] for r in records})
    systems = [s for s in SYSTEM_ORDER if any(r["system"] == s for r in records)]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(14, 5.5))
    width = 0.8 / max(1, len(systems))
    top = max([r.get("tokens_per_s") or 0 for r in records] + [1])
    for j, s in enumerate(systems):
        for i, t in enumerate(tokens):
            r = next((x for x in records if x["system"] == s and x["tokens_per_step"] == t), None)
            if r is None:
                continue
            x = i + (j - (len(systems) - 1) / 2) * width
            v = r.get("tokens_per_s")
            ax1.bar(x, v or 0, width, color=COLORS[s], label=s if i == 0 else None)
            if v is None:
                ax1.text(
                    x,
                    top * 0.02,
                    "failed: " + str(r.get("error"))[:40],
                    rotation=90,
                    ha="center",
                    va="bottom",
                    fontsize=7,
                )
                continue
            text = f"{v / 1000:.1f}k"
            if s.startswith("megatrain") and r.get("ratio_vs_deepspeed"):
                text += f"\n{r['ratio_vs_deepspeed']:.2f}x DS"
            ax1.text(x, v, text, ha="center", va="bottom", fontsize=8)
    ax1.set_xticks(range(len(tokens)), [f"{t:,}" for t in tokens])
    ax1.set_xlabel("tokens per optimizer step")
    ax1.set_ylabel("tokens/s")
    ax1.set_ylim(0, top * 1.25)
    ax1.set_title(f"throughput, model {meta['model']} ({params_str(meta['params'])}), seq {meta['seq_len']}")
    ax1.legend(loc="upper left")

    mt = [r for r in records if r["system"] == "megatrain" and r.get("step_times")]
    for k, r in enumerate(mt):
        c = f"C{k}"
        st, w = r["step_times"], r.get("warmup") or 0
        xs = list(range(1, len(st) + 1))
        ax2.plot(xs, st, "-", color=c, label=f"{r['tokens_per_step']:,} tokens/step")
        ax2.plot(xs[:w], st[:w], "o", mfc="none", color=c)
        ax2.plot(xs[w:], st[w:], "o", color=c)
        if r.get("serial_fb_s") is not None and r.get("serial_opt_s") is not None:
            ax2.axhline(r["serial_fb_s"], color=c, ls=":", lw=1)
            ax2.axhline(r["serial_fb_s"] + r["serial_opt_s"], color=c, ls="--", lw=1)
    if mt:
        ax2.set_title(
            "megatrain step times (hollow: warm-up; dotted: compute only; dashed: serial step)", fontsize=9
        )
        ax2.set_xlabel("step")
        ax2.xaxis.get_major_locator().set_params(integer=True)
        ax2.set_ylabel("seconds")
        ax2.set_ylim(bottom=0)
        ax2.legend(loc="lower right", fontsize=8)
    else:
        ax2.text(0.5, 0.5, "no megatrain step times", ha="center", va="center", transform=ax2.transAxes)
        ax2.set_axis_off()
    fig.suptitle(f"{meta['device']}  |  {meta['date']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_all(records: list[dict[str, Any]], meta: dict[str, Any], stem: Path) -> None:
    for writer, suffix in ((write_json, ".json"), (write_md, ".md"), (write_png, ".png")):
        try:
            writer(records, meta, stem.with_name(stem.name + suffix))
        except Exception:
            print(f"    (could not write {suffix}: {traceback.format_exc(limit=2).strip()})", flush=True)
