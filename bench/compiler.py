"""Inductor's kernel choices by rule (megatrain/models/compiling.py): do they repeat, and what do they cost?

Two measurements, each with the choices made by rule (`rule`: inductor's deterministic mode, what
megatrain compiles with) and by timing (`timed`: torch.compile's default):

  repeat  `--compiles` fresh compiles (empty caches, the compiler reset) of a small Llama's
          engine layer, every candidate's timing replaced by a random number (a busy GPU,
          exaggerated), each training `--steps` fp32 steps through the engine: how many
          distinct results (losses, norms, weights, moments, bit for bit) they give. The GPU
          test `test_compiled_layers_compute_the_same_bits_whatever_the_compilers_timings` asserts
          one for `rule`; this shows whether `timed` gives more.
  cost    one decoder layer of `--shape` (bench/_shapes.py) in bf16 on `--rows` x `--seq` tokens,
          forward with its graph and backward, compiled both ways and eager: the median seconds of
          `--iters` after warm-up, and the ratio to `timed`.

    python bench/compiler.py --out bench/results
"""

from __future__ import annotations

import argparse
import hashlib
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
from torch.func import functional_call  # noqa: E402

from megatrain.models import compiling  # noqa: E402
from megatrain.models.config import ModelConfig  # noqa: E402
from megatrain.models.family import family_of  # noqa: E402

MODES = {"rule": compiling.INDUCTOR_OPTIONS, "timed": {}}


def _digest(*values) -> str:
    h = hashlib.sha256()
    for v in values:
        h.update(v.cpu().numpy().tobytes() if isinstance(v, torch.Tensor) else repr(v).encode())
    return h.hexdigest()[:12]


def repeat(mode: str, compiles: int, steps: int) -> dict:
    """Distinct results of `compiles` fresh compiles under random timings, one training each."""
    from helpers import random_kernel_timings
    from test_gpu import ADAMW, _cfg, _plan, _steps

    from megatrain.runtime import build_model

    compiling.INDUCTOR_OPTIONS = MODES[mode]
    digests = []
    with random_kernel_timings():
        for _ in range(compiles):
            torch._dynamo.reset()
            m = build_model(_cfg("llama"), seed=3, device="cuda", compute_dtype="float32", adamw=ADAMW,
                            plan=_plan(), compile=True)  # fmt: skip
            losses, norms = _steps(m, n_steps=steps, seq=512)
            digests.append(_digest(losses, norms, m.state.master, m.state.exp_avg_sq))
            m.close()
    torch._dynamo.reset()
    return dict(test="repeat", mode=mode, compiles=compiles, distinct=len(set(digests)), digests=digests)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def cost(shape: str, rows: int, seq: int, iters: int) -> list[dict]:
    """Seconds of one layer's forward and backward, compiled by rule, by timing, and eager."""
    from transformers import LlamaConfig

    s = DENSE_SHAPES[shape]
    hf = LlamaConfig(hidden_size=s["hidden"], intermediate_size=s["ffn"], num_attention_heads=s["heads"],
                     num_key_value_heads=s["kv"], vocab_size=s["vocab"], num_hidden_layers=1)  # fmt: skip
    cfg = ModelConfig.from_hf(hf)
    family, dt = family_of(cfg), torch.bfloat16
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # the CPU: a smoke run
    layer = family.layer(cfg, 0)
    gen = torch.Generator(device=dev).manual_seed(0)
    params = {
        n: (torch.randn(p.shape, device=dev, generator=gen) * 0.02).to(dt).requires_grad_()
        for n, p in layer.named_parameters()
    }
    pos = torch.arange(seq, device=dev)[None].expand(rows, seq)
    inputs = family.inputs(cfg, dev)(pos, None, seq, dt, False)["layer"]
    x = torch.randn(rows, seq, cfg.hidden_size, device=dev, dtype=dt, generator=gen).requires_grad_()
    dy = torch.randn_like(x)

    def call(p, h, inp):
        return functional_call(layer, p, (h,), inp)

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
            y = fn(params, x, inputs)
            torch.autograd.grad(y, [x, *params.values()], dy)
            _sync()
            if i >= 3:
                times.append(time.perf_counter() - t0)
        del y
        out.append(dict(test="cost", mode=mode, shape=shape, tokens=rows * seq, s=statistics.median(times)))
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
    ap.add_argument("--out", default=None, help="write JSON + Markdown here")
    a = ap.parse_args()
    if not compiling.INDUCTOR_OPTIONS:
        sys.exit("this torch's inductor has no deterministic mode: nothing to compare")
    rows = cost(a.shape, a.rows, a.seq, a.iters)
    rows += [repeat(m, a.compiles, a.steps) for m in ("rule", "timed")]
    lines = ["| test | mode | result |", "|---|---|---|"]
    for r in rows:
        if r["test"] == "repeat":
            res = f"{r['distinct']} distinct result(s) of {r['compiles']} compiles: {' '.join(r['digests'])}"
        else:
            res = f"{r['shape']} layer, {r['tokens']:,} tokens: {r['s'] * 1e3:.2f} ms ({r['vs_timed']:.3f}x timed)"
        lines.append(f"| {r['test']} | {r['mode']} | {res} |")
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
