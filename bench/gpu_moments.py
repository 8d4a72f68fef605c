"""AdamW of GPU-resident state in each moment format (`optim`): elements a second of one step over
`--params` elements, beside the bound of the bytes it moves at the GPU's measured copy rate.

* fp32: torch's fused kernel (`torch._fused_adamw_`), what fp32 moments are stepped with;
* bf16 and 8-bit, one pass: engine/momentgpu.py's Triton kernel (the default where it loads);
* bf16 and 8-bit, torch ops: engine/moments.py's `step_span`, the fallback (on `--ops-params`
  elements: it is some hundred times slower).

The bound: the bytes of the weights, gradient and moments read and written once (fp32 28 a
parameter, bf16 20, 8-bit 14 and the absmax), at the rate of a device-to-device copy of the
same size. Each case's time is the best of `--repeats` synchronised steps after one warm-up.

    python bench/gpu_moments.py --params 2e9 --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from _report import write_once  # noqa: E402

from megatrain.engine import momentgpu  # noqa: E402
from megatrain.engine import moments as low  # noqa: E402
from megatrain.host.moments import BF16, BLOCK, Q8  # noqa: E402

STATE_BYTES = {"fp32": 28, "bf16": 20, "8bit": 14 + 8 / BLOCK}  # read and written once, a parameter


def _best(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return min(times)


def copy_rate(n: int, repeats: int) -> float:
    """Bytes a second of a device copy of n fp32 elements (read and written)."""
    a, b = torch.empty(n, device="cuda"), torch.empty(n, device="cuda")
    return 2 * 4 * n / _best(lambda: b.copy_(a), repeats)


def state(fmt: str, n: int):
    p = torch.randn(n, device="cuda") * 0.02
    g = torch.randn(n, device="cuda") * 1e-3
    if fmt == "fp32":
        return p, g, (torch.zeros(n, device="cuda"), torch.zeros(n, device="cuda"))
    f = {"bf16": BF16, "8bit": Q8}[fmt]
    return (
        p,
        g,
        tuple(torch.zeros(x.length(n), dtype=getattr(torch, x.dtype), device="cuda") for x in f.fields),
    )


def case(fmt: str, path: str, n: int, repeats: int) -> float:
    """Seconds of one step of n elements."""
    p, g, moments = state(fmt, n)
    h = low.Hyper.of(1e-5, 10, (0.9, 0.999), 1e-8, 0.1)
    if fmt == "fp32":
        step = torch.full((), 10.0, device="cuda")
        m, v = moments

        def run():
            torch._fused_adamw_([p], [g], [m], [v], [], [step], amsgrad=False, lr=1e-5, beta1=0.9,
                                beta2=0.999, weight_decay=0.1, eps=1e-8, maximize=False)  # fmt: skip
    elif path == "one pass":

        def run():
            momentgpu.step(p, g, moments, h, True)
    else:

        def run():
            low.step_span(p, g, moments, h, True)

    return _best(run, repeats)


def main() -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=2e9, help="elements a step (a multiple of 256 is used)")
    ap.add_argument("--ops-params", type=float, default=1e8, help="elements of the torch ops' step")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    n, n_ops = int(args.params) // BLOCK * BLOCK, int(args.ops_params) // BLOCK * BLOCK
    loaded, why = momentgpu.load(torch.device("cuda"))
    rate = copy_rate(n, args.repeats)
    print(f"# {torch.cuda.get_device_name()}: copy {rate / 1e9:,.0f} GB/s; one-pass kernel: {why}")
    cases = [("fp32", "torch fused", n), ("bf16", "one pass", n), ("8bit", "one pass", n)]
    cases += [("bf16", "torch ops", n_ops), ("8bit", "torch ops", n_ops)]
    rows = []
    print(f"{'moments':8} {'path':12} {'elements':>14} {'ms':>9} {'G elem/s':>9} {'of bound':>9}")
    for fmt, path, size in cases:
        if path == "one pass" and not loaded:
            continue
        s = case(fmt, path, size, args.repeats)
        torch.cuda.empty_cache()
        bound = STATE_BYTES[fmt] * size / rate
        row = {"moments": fmt, "path": path, "elements": size, "ms": s * 1e3, "g_elems_s": size / s / 1e9,
               "bound_ms": bound * 1e3, "of_bound": bound / s}  # fmt: skip
        rows.append(row)
        print(
            f"{fmt:8} {path:12} {size:>14,} {s * 1e3:>9.2f} {size / s / 1e9:>9.2f} {bound / s:>9.0%}",
            flush=True,
        )
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python " + " ".join(sys.argv),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "copy_bytes_s": rate,
        "one_pass_kernel": why,
    }
    if args.out:
        table = "| moments | path | elements | ms | G elements/s | of the copy-rate bound |\n|---|---|---|---|---|---|\n"
        table += "".join(
            f"| {r['moments']} | {r['path']} | {r['elements']:,} | {r['ms']:.2f} | {r['g_elems_s']:.2f} | {r['of_bound']:.0%} |\n"
            for r in rows
        )
        write_once(args.out, "gpu-moments", "AdamW of GPU-resident state by moment format", meta, rows, table)
    return {**meta, "rows": rows}


if __name__ == "__main__":
    main()
