"""The host AdamW pass: what it costs, and what two changes to it would cost (bench/host-only.md).

On the machine's optimizer threads, G params/s of each pass over `--params` elements of fp32
state, a chunk at a time:

  step           torch's fused CPU AdamW in place (what megatrain runs), unclipped
  clip in place  the gradient chunk times the clip coefficient in place, then the step: what
                 the optimizer worker runs on gradients held in host memory today
  clip scratch   the same product written into a scratch of the given size (the kernel could
                 read it back from the caches), then the step: one pass over the gradient fewer
  backup         each chunk's master and moments copied aside, then the step: speculative
                 stepping (the update made before the clip coefficient is known)
  restore        the backup copied back: the repair when the clip then fires
  step + bf16 K  the step, then the updated master cast into a bf16 copy, K elements at a time
                 (the cast reads what the step just wrote, from the caches where K is small):
                 what writing the compute-dtype copy the next fetch takes would cost the pass

`--threads 8,16,31` instead times the step alone at each thread count, on the calling thread and
on a worker thread (where the engine's optimizer runs: torch's intra-op threads are set on the
main thread, as the transport sets them), to tell the kernel's scaling from the engine's threads.

`--engine` instead times the engine's own pass beside the kernel at the same size: the host
state of a Llama with `--shape`'s layers (bench/_shapes.py) and as many of them as bring it
nearest `--engine-params`, its gradients held in host memory as the transport holds them, stepped
by `HostAdamW.step_held` (what the optimizer worker runs in a step) on a worker thread with the
optimizer's threads; and `torch._fused_adamw_` over flat arrays of as many elements, in chunks of
the same size, on the calling thread and on a worker thread. The engine's pass runs clipped (a
coefficient below one: each chunk scaled whole, then stepped by torch's kernel; with
`--clip-fused` also in the kernel that multiplies as it steps, where it builds and equals torch's
kernel here: `megatrain/engine/clipadam.py`, the engine's default, which reads and writes the
master weights' halves in its pass; torch's kernel steps fp32 made from them and split back),
with a coefficient of one (the norm under the threshold) and unclipped. Its
first pass is reported apart: it maps the moments' pages, as a run's first step does. Host
memory: 32 bytes a parameter (the engine's state and gradients, the kernel's four arrays). The
clip in cache-sized pieces and on threads of its own beside the kernel, measured here before
(`--clip-pieces`, `--clip-threads`: results of 2026-11-27), lost to clipadam's kernel and were
removed.

`--engine --beside none,launch,link,launch+link` instead times the kernel and the engine's pass in
clipadam's kernel beside what a training step runs beside
it: a thread launching small GPU kernels in a Python loop, as the launching thread does, and the
link's copies to and from the GPU through page-locked host memory (bench/_adamw_engine.py's
`Beside`); at each of `--blocks` (clipadam's BLOCK: the elements a thread takes at a time, 0 for
one share a thread, the split before). What the step takes from the host AdamW, told apart: the
cores, or host memory's bandwidth.

Before timing (but with `--engine`), it checks on a slice that the two clip passes give bitwise the same state and
that backup, step and restore give back the state bitwise (`exact` in the results). Results: a
table, and JSON + Markdown under --out. OpenMP's threads wait as they do under the command line
(OMP_WAIT_POLICY, unless set).

    python bench/adamw.py --params 1.8e9 --out bench/results
    python bench/adamw.py --engine --engine-params 8e9 --out bench/results
    python bench/adamw.py --engine --engine-params 2e9 --beside none,launch,link,launch+link --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from megatrain import OMP_WAIT_POLICY  # noqa: E402  (no torch: libgomp reads the policy as torch loads)

os.environ.setdefault("OMP_WAIT_POLICY", OMP_WAIT_POLICY)

import torch  # noqa: E402
from _adamw_engine import (  # noqa: E402
    BESIDE,
    WEIGHT_DECAY,
    beside_table,
    engine_table,
    llama,
    measure_beside,
    measure_engine,
)
from _report import params_str, write_once  # noqa: E402

from megatrain.models.family import count_params  # noqa: E402
from megatrain.planning.placement import optimizer_threads  # noqa: E402
from megatrain.planning.probe import adam_rate  # noqa: E402

COEF = 1.0  # a multiply like any other; values do not drift over the repeats


class State:
    """fp32 master, gradient and moments of `n` elements, and room for a backup."""

    def __init__(self, n: int, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.p, self.g, self.m, self.v = (torch.randn(n, generator=gen) for _ in range(4))
        self.v.abs_()
        self.saved = [torch.empty(n) for _ in range(3)]
        self.w16 = torch.empty(n, dtype=torch.bfloat16)
        self.coef = torch.tensor(COEF)
        self.step_no = torch.full((), 3.0)
        self.scratch: torch.Tensor | None = None

    def step(self, a: int, b: int, g: torch.Tensor | None = None) -> None:
        torch._fused_adamw_(
            [self.p[a:b]], [self.g[a:b] if g is None else g], [self.m[a:b]], [self.v[a:b]], [], [self.step_no],
            amsgrad=False, lr=1e-5, beta1=0.9, beta2=0.95, weight_decay=0.0, eps=1e-8, maximize=False,
        )  # fmt: skip

    def clip_in_place(self, a: int, b: int) -> None:
        self.g[a:b].mul_(self.coef)
        self.step(a, b)

    def clip_scratch(self, size: int):
        def run(a: int, b: int) -> None:
            if self.scratch is None or self.scratch.numel() != size:
                self.scratch = torch.empty(size)
            for x in range(a, b, size):
                y = min(b, x + size)
                self.step(x, y, torch.mul(self.g[x:y], self.coef, out=self.scratch[: y - x]))

        return run

    def step_bf16(self, size: int):
        def run(a: int, b: int) -> None:
            for x in range(a, b, size):
                y = min(b, x + size)
                self.step(x, y)
                self.w16[x:y].copy_(self.p[x:y])

        return run

    def backup(self, a: int, b: int) -> None:
        for dst, src in zip(self.saved, (self.p, self.m, self.v)):
            dst[a:b].copy_(src[a:b])
        self.step(a, b)

    def restore(self, a: int, b: int) -> None:
        for dst, src in zip((self.p, self.m, self.v), self.saved):
            dst[a:b].copy_(src[a:b])


def exactness(n: int = 1 << 20, scratch: int = 1 << 16) -> dict[str, bool]:
    """The claims the passes rest on, on `n` elements with a coefficient below one."""
    one, two = State(n), State(n)
    for s in (one, two):
        s.coef = torch.tensor(0.37)
    one.clip_in_place(0, n)
    two.clip_scratch(scratch)(0, n)
    clip = all(torch.equal(x, y) for x, y in ((one.p, two.p), (one.m, two.m), (one.v, two.v)))
    s = State(n, seed=1)
    before = [t.clone() for t in (s.p, s.m, s.v)]
    s.backup(0, n)
    changed = not torch.equal(s.p, before[0])
    s.restore(0, n)
    repair = changed and all(torch.equal(x, y) for x, y in zip((s.p, s.m, s.v), before))
    return {"clip_scratch_equals_in_place": clip, "restore_returns_the_state": repair}


def measure(n: int, chunks: list[int], scratches: list[int], repeats: int, casts: list[int]) -> list[dict]:
    s = State(n)
    passes = [("step", s.step), ("clip in place", s.clip_in_place)]
    passes += [(f"clip scratch {k:,}", s.clip_scratch(k)) for k in scratches]
    passes += [(f"step + bf16 {k:,}", s.step_bf16(k)) for k in casts]
    passes += [("backup", s.backup), ("restore", s.restore)]
    rows = []
    for name, fn in passes:
        for chunk in chunks:
            times = []
            for _ in range(repeats + 1):  # the first warms up
                t = time.perf_counter()
                for a in range(0, n, chunk):
                    fn(a, min(n, a + chunk))
                times.append(time.perf_counter() - t)
            best = min(times[1:])
            rows.append({"pass": name, "chunk": chunk, "seconds": best, "gparams_per_s": n / best / 1e9})
            print(
                f"{name:22s} chunk {chunk:>11,d}  {best:6.3f} s  {n / best / 1e9:5.2f} G params/s", flush=True
            )
    base = {r["chunk"]: r["seconds"] for r in rows if r["pass"] == "step"}
    for r in rows:
        r["vs_step"] = r["seconds"] / base[r["chunk"]]
    return rows


def _timed(fn, n: int, chunk: int) -> float:
    t = time.perf_counter()
    for a in range(0, n, chunk):
        fn(a, min(n, a + chunk))
    return time.perf_counter() - t


def _on_worker(fn, n: int, chunk: int) -> float:
    box: list[float] = []
    worker = threading.Thread(target=lambda: box.append(_timed(fn, n, chunk)))
    worker.start()
    worker.join()
    return box[0]


def measure_threads(n: int, chunk: int, threads: list[int], repeats: int) -> list[dict]:
    """The step alone at each thread count, on this thread and on a worker thread."""
    s, rows = State(n), []
    for k in threads:
        torch.set_num_threads(k)
        for where, run in (("calling thread", _timed), ("worker thread", _on_worker)):
            best = min(run(s.step, n, chunk) for _ in range(repeats + 1))
            rows.append({"pass": f"step, {k} threads, {where}", "chunk": chunk, "seconds": best,
                         "gparams_per_s": n / best / 1e9, "threads": k})  # fmt: skip
            print(f"{rows[-1]['pass']:40s} {best:6.3f} s  {n / best / 1e9:5.2f} G params/s", flush=True)
    top = max(r["gparams_per_s"] for r in rows)
    for r in rows:
        r["vs_step"] = top / r["gparams_per_s"]
    return rows


def table(rows: list[dict]) -> str:
    out = ["| pass | chunk | seconds | G params/s | time vs step |", "|---|---|---|---|---|"]
    out += [
        f"| {r['pass']} | {r['chunk']:,} | {r['seconds']:.3f} | {r['gparams_per_s']:.2f} | {r['vs_step']:.2f}x |"
        for r in rows
    ]
    return "\n".join(out)


def host() -> str:
    """The machine: its CPU model, CPUs and memory."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next(
                (line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model
            )
    except OSError:
        pass
    memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return f"{model}, {os.cpu_count()} CPUs, {memory:.0f} GiB"


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=float, default=1.8e9, help="elements stepped (state: 28 B each)")
    ap.add_argument("--chunks", default="33554432,4194304", help="elements per chunk")
    ap.add_argument("--scratch", default="4194304,1048576,262144", help="clip scratch sizes (elements)")
    ap.add_argument("--bf16", default="33554432,4194304,1048576", help="step + bf16 copy slice sizes")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", default=None, help="thread counts: time the step alone at each")
    ap.add_argument("--engine", action="store_true", help="the engine's pass beside the kernel")
    ap.add_argument("--engine-params", type=float, default=1e9, help="--engine: the model's size")
    ap.add_argument(
        "--clip-fused",
        action="store_true",
        help="--engine: also the kernel that multiplies as it steps (clipadam)",
    )
    ap.add_argument(
        "--beside",
        default=None,
        help=f"--engine: time the pass beside each of these, comma-separated ({', '.join(BESIDE)})",
    )
    ap.add_argument("--blocks", default="65536,0", help="--beside: clipadam's blocks (0: a share a thread)")
    ap.add_argument(
        "--weight-decay",
        type=float,
        default=WEIGHT_DECAY,
        help=f"--engine: the AdamW's weight decay (default {WEIGHT_DECAY}; training's default and bench.py's: 0)",
    )
    ap.add_argument("--shape", default="B", help="--engine: the layer shape (bench/_shapes.py)")
    ap.add_argument("--vocab", type=int, default=None, help="--engine: in place of the shape's")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(optimizer_threads())
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": host(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "command": "python bench/adamw.py " + " ".join(sys.argv[1:] if argv is None else argv),
    }
    if args.beside and not args.engine:
        ap.error("--beside goes with --engine")
    if args.engine:
        cfg = llama(args.shape, args.engine_params, args.vocab)
        n = count_params(cfg)
        print(f"{params_str(n)} parameters: {32 * n / 2**30:.1f} GiB of host memory", flush=True)
        if args.beside:
            return _beside(args, cfg, meta)
        rows, summary = measure_engine(cfg, args.repeats, args.clip_fused, args.weight_decay)
        # the plan's probe of this host's AdamW (its small array, alone), beside the kernel over
        # the model's size: the cost model's in-step rate is the probe's times ADAM_IN_STEP
        probe = adam_rate(torch.get_num_threads())
        meta.update(
            shape=args.shape,
            vocab=cfg.vocab_size,
            weight_decay=args.weight_decay,
            probe_gparams_per_s=probe / 1e9,
            **summary,
        )
        text = engine_table(rows)
        print(text)
        print(f"engine {summary['engine_gparams_per_s']:.2f} G params/s, kernel {summary['kernel_gparams_per_s']:.2f}: "
              f"{summary['ratio']:.0%}; the plan's probe {probe / 1e9:.2f}")  # fmt: skip
        if args.out:
            title = "host AdamW: the engine's pass in a step beside the fused kernel"
            write_once(args.out, "adamw-engine", title, meta, rows, text)
        return {**meta, "rows": rows}
    exact = exactness()
    print("exact:", exact, flush=True)
    split = lambda text: [int(x) for x in text.split(",")]  # noqa: E731
    if args.threads:
        rows = measure_threads(int(args.params), split(args.chunks)[0], split(args.threads), args.repeats)
    else:
        rows = measure(
            int(args.params), split(args.chunks), split(args.scratch), args.repeats, split(args.bf16)
        )
    meta.update(params=int(args.params), exact=exact)
    print(table(rows))
    if args.out:
        title = "host AdamW: the step, the clip's pass, speculative stepping's backup and restore"
        write_once(args.out, "adamw", title, meta, rows, table(rows))
    return {**meta, "rows": rows}


def _beside(args, cfg, meta: dict) -> dict:
    kinds = args.beside.split(",")
    wrong = [k for k in kinds if k not in BESIDE]
    if wrong:
        sys.exit(f"adamw.py: --beside {wrong[0]!r} is not one of {', '.join(BESIDE)}")
    blocks = [int(x) for x in args.blocks.split(",")]
    try:
        rows = measure_beside(cfg, args.repeats, kinds, blocks, args.weight_decay)
    except ValueError as e:
        sys.exit(f"adamw.py: {e}")
    meta.update(
        shape=args.shape,
        vocab=cfg.vocab_size,
        engine_params=count_params(cfg),
        blocks=blocks,
        weight_decay=args.weight_decay,
    )
    text = beside_table(rows)
    print(text)
    if args.out:
        write_once(
            args.out, "adamw-beside", "host AdamW beside a step's launching thread and link", meta, rows, text
        )
    return {**meta, "rows": rows}


if __name__ == "__main__":
    main()
