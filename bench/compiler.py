"""Inductor's kernel choices by rule (megatrain/models/compiling.py): do they repeat, and what do they cost?

Three measurements, with the choices made by rule (`rule`: inductor's deterministic mode, what
megatrain compiles with) and by timing (`timed`: torch.compile's default):

  cost           one decoder layer of `--shape` (bench/_shapes.py) in bf16 on `--rows` x `--seq`
                 tokens, forward with its graph and backward, compiled both ways and eager: the
                 median seconds of `--iters` after warm-up, and the ratio to `timed`.
  layer repeat   `--compiles` fresh compiles (empty caches, the compiler reset) of that layer on
                 `--short-rows` x `--short-seq` tokens (one key block of the attention), every
                 candidate's timing replaced by a random number (a busy GPU, exaggerated): how many
                 distinct results (the output and every gradient, bit for bit) they give. The GPU
                 test `test_compiled_layers_compute_the_same_bits_whatever_the_compilers_timings`
                 asserts one for `rule`; this shows whether `timed` gives more.
  engine repeat  the same for the GPU tests' small Llama, training `--steps` fp32 steps through
                 the engine (losses, norms, weights, moments).

    python bench/compiler.py --out bench/results
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [
    HERE,
    os.path.join(HERE, ".."),
    os.path.join(HERE, "..", "tests"),
]  # _report; megatrain; test_gpu
from _report import write_once  # noqa: E402
from _shapes import DENSE_SHAPES  # noqa: E402

from megatrain.models import compiling  # noqa: E402

MODES = {"rule": compiling.INDUCTOR_OPTIONS, "timed": {}}


def engine_repeat(mode: str, compiles: int, steps: int) -> dict:
    """Distinct results of `compiles` fresh compiles of the GPU test's small Llama under random
    timings, each training `steps` fp32 steps through the engine."""
    from helpers import hash_bits, random_kernel_timings
    from test_gpu import ADAMW, _cfg, _plan, _steps

    from megatrain.runtime import build_model

    compiling.INDUCTOR_OPTIONS = MODES[mode]
    digests = []
    with random_kernel_timings() as calls:
        for _ in range(compiles):
            torch._dynamo.reset()
            m = build_model(_cfg("llama"), seed=3, device="cuda", compute_dtype="float32", adamw=ADAMW,
                            plan=_plan(), compile=True)  # fmt: skip
            losses, norms = _steps(m, n_steps=steps, seq=512)
            digests.append(hash_bits(losses, norms, m.state.master(), m.state.exp_avg_sq))
            m.close()
    torch._dynamo.reset()
    compiling.INDUCTOR_OPTIONS = MODES["rule"]
    return dict(test="engine repeat", mode=mode, what="test_gpu's Llama, fp32", compiles=compiles,
                timings=len(calls), distinct=len(set(digests)), digests=digests)  # fmt: skip


def _layer(shape: str, rows: int, seq: int):
    """One bf16 decoder layer of `shape` and its inputs: (call, params, x, inputs, dy)."""
    from helpers import llama_layer

    s = DENSE_SHAPES[shape]
    return llama_layer(rows, seq, hidden_size=s["hidden"], intermediate_size=s["ffn"],
                       num_attention_heads=s["heads"], num_key_value_heads=s["kv"], vocab_size=s["vocab"])  # fmt: skip


def _fwd_bwd(fn, params, x, inputs, dy):
    y = fn(params, x, inputs)
    return y, torch.autograd.grad(y, [x, *params.values()], dy)


def layer_repeat(mode: str, shape: str, rows: int, seq: int, compiles: int) -> dict:
    """Distinct results (the output and every gradient) of `compiles` fresh compiles of one layer
    under random timings; rows of `seq` tokens short enough for one key block of the attention
    (whose backward adds over key blocks atomically at longer rows)."""
    from helpers import hash_bits, random_kernel_timings

    call, params, x, inputs, dy = _layer(shape, rows, seq)
    compiling.INDUCTOR_OPTIONS = MODES[mode]
    digests = []
    with random_kernel_timings() as calls:
        for _ in range(compiles):
            torch._dynamo.reset()
            y, grads = _fwd_bwd(compiling.compiled(call, dynamic=False), params, x, inputs, dy)
            digests.append(hash_bits(y, *grads))
    torch._dynamo.reset()
    compiling.INDUCTOR_OPTIONS = MODES["rule"]
    return dict(test="layer repeat", mode=mode, what=f"{shape} layer, bf16, {rows} x {seq} tokens",
                compiles=compiles, timings=len(calls), distinct=len(set(digests)), digests=digests)  # fmt: skip


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cost(shape: str, rows: int, seq: int, iters: int) -> list[dict]:
    """Seconds of one layer's forward and backward, compiled by rule, by timing, and eager."""
    call, params, x, inputs, dy = _layer(shape, rows, seq)
    out = []
    for mode in ("rule", "timed", "eager"):
        torch._dynamo.reset()
        if mode == "eager":
            fn = call
        else:
            compiling.INDUCTOR_OPTIONS = MODES[mode]
            fn = compiling.compiled(call, dynamic=False)
        times = []
        for i in range(iters + 3):
            _sync()
            t0 = time.perf_counter()
            _fwd_bwd(fn, params, x, inputs, dy)
            _sync()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        out.append(dict(test="cost", mode=mode, what=f"{shape} layer, bf16, {rows} x {seq} tokens",
                        s=statistics.median(times)))  # fmt: skip
    timed = next(r["s"] for r in out if r["mode"] == "timed")
    for r in out:
        r["vs_timed"] = r["s"] / timed
    compiling.INDUCTOR_OPTIONS = MODES["rule"]
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--compiles", type=int, default=4)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--shape", default="B", choices=sorted(DENSE_SHAPES))
    ap.add_argument("--rows", type=int, default=4)
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--short-rows", type=int, default=128, help="layer repeat: rows of --short-seq")
    ap.add_argument("--short-seq", type=int, default=128, help="layer repeat: one key block")
    ap.add_argument("--out", default=None, help="write JSON + Markdown here")
    a = ap.parse_args()
    if not compiling.INDUCTOR_OPTIONS:
        sys.exit("this torch's inductor has no deterministic mode: nothing to compare")
    rows = cost(a.shape, a.rows, a.seq, a.iters)
    for mode in ("rule", "timed"):
        rows.append(layer_repeat(mode, a.shape, a.short_rows, a.short_seq, a.compiles))
    for mode in ("rule", "timed"):
        rows.append(engine_repeat(mode, a.compiles, a.steps))
    lines = ["| test | mode | what | result |", "|---|---|---|---|"]
    for r in rows:
        if r["test"] == "cost":
            res = f"{r['s'] * 1e3:.2f} ms forward + backward ({r['vs_timed']:.3f}x timed)"
        else:
            res = (f"{r['distinct']} distinct of {r['compiles']} compiles ({r['timings']} timings taken): "
                   + " ".join(r["digests"]))  # fmt: skip
        lines.append(f"| {r['test']} | {r['mode']} | {r['what']} | {res} |")
    table = "\n".join(lines)
    print(table)
    if a.out:
        meta = dict(
            date=time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            device=torch.cuda.get_device_name(),
            torch=torch.__version__,
            command="python bench/compiler.py " + " ".join(sys.argv[1:]),
        )
        print(
            write_once(
                a.out, "compiler", "Inductor's kernel choices by rule and by timing", meta, rows, table
            )
        )


if __name__ == "__main__":
    main()
