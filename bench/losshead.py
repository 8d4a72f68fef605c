"""The loss head's backward, three ways, on one GPU: what cross-entropy's one-pass loss and gradient
and the projection's own accumulation of the LM weight's gradient (megatrain/objectives/) save.

  autograd     the chunk's logits cast to fp32, `F.cross_entropy`, autograd through both; the LM
               weight's gradient formed in bf16 and then added into its fp32 buffer
  one-pass     cross-entropy's `loss_and_grad`, compiled; the weight's gradient as above
  + into fp32  and the projection's backward adding the weight's gradient into the fp32 buffer
               in its GEMM (megatrain's default)

`--shape`'s final norm and LM head (bench/_shapes.py) in bf16 over `--tokens` tokens in chunks of
`--chunk`: the median milliseconds of `--iters` after warm-up, the peak GPU memory above the
inputs, and each way's gradients against the first's (the largest difference over the largest
value).

    python bench/losshead.py --shape B --tokens 16384 --chunk 2790 --out bench/results
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import os
import statistics
import sys
import time
from types import SimpleNamespace

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.join(HERE, "..")]
from _report import write_once  # noqa: E402
from _shapes import DENSE_SHAPES  # noqa: E402

from megatrain.data.batch import IGNORE_INDEX  # noqa: E402
from megatrain.models.decoder import Head  # noqa: E402
from megatrain.objectives import losshead  # noqa: E402
from megatrain.objectives.cross_entropy import CrossEntropy  # noqa: E402

WAYS = ("autograd", "one-pass", "+ into fp32")


def run(way: str, hidden, labels, params, W, chunk: int, iters: int):
    """(median ms, peak bytes above the inputs, loss, dh, the LM weight's fp32 gradient) of one way."""
    dev = hidden.device
    template = _template(hidden.shape[-1], W.shape[0], dev)
    objective = CrossEntropy(one_pass=way != "autograd")
    plain = staticmethod(lambda W, g: contextlib.nullcontext())
    own = {n: torch.zeros_like(p, dtype=torch.float32) for n, p in params.items()}
    grad_W = torch.zeros_like(W, dtype=torch.float32)
    total = int((labels != IGNORE_INDEX).sum())
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    routed = losshead._IntoGradW.__dict__["routed"]
    if way != "+ into fp32":
        losshead._IntoGradW.routed = plain
    times = []
    try:
        for i in range(iters + 2):
            for g in (*own.values(), grad_W):
                g.zero_()
            head = losshead.Head(template, params, W, chunk, own, grad_W, compile=cuda)
            if cuda:
                torch.cuda.synchronize()
            t = time.perf_counter()
            loss, dh = objective.loss_and_grads(head, [hidden], [labels], total)
            if cuda:
                torch.cuda.synchronize()
            if i >= 2:
                times.append((time.perf_counter() - t) * 1e3)
    finally:
        losshead._IntoGradW.routed = routed
    peak = torch.cuda.max_memory_allocated() - base if cuda else 0
    return statistics.median(times), peak, loss, dh[0], grad_W


def _template(h: int, v: int, dev: torch.device):
    """decoder.Head (the final norm; the LM weight comes as an argument, as a tied model's)."""
    cfg = SimpleNamespace(hidden_size=h, rms_norm_eps=1e-5, tie_word_embeddings=True, vocab_size=v)
    return Head(cfg).to(dev, torch.bfloat16)


def _diff(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="B", choices=sorted(DENSE_SHAPES))
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=2790)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--vocab", type=int, default=None, help="instead of the shape's")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    dev = torch.device(a.device)
    shape = DENSE_SHAPES[a.shape]
    h, v = shape["hidden"], a.vocab or shape["vocab"]
    g = torch.Generator(device=dev).manual_seed(0)
    hidden = torch.randn(a.tokens, h, device=dev, generator=g).bfloat16()
    W = (torch.randn(v, h, device=dev, generator=g) * 0.02).bfloat16()
    labels = torch.randint(0, v, (a.tokens,), device=dev, generator=g)
    labels[::7] = IGNORE_INDEX
    params = {"norm.weight": torch.ones(h, device=dev, dtype=torch.bfloat16)}
    rows, ref = [], None
    for way in WAYS:
        ms, peak, loss, dh, gW = run(way, hidden, labels, params, W, a.chunk, a.iters)
        if ref is None:
            ref = (loss, dh, gW)
        row = dict(way=way, ms=round(ms, 2), peak_gib=round(peak / 2**30, 2), loss=loss.item(),
                   dh_diff=_diff(dh, ref[1]), grad_W_diff=_diff(gW, ref[2]))  # fmt: skip
        rows.append(row)
        print(row, flush=True)
        del dh, gW
    base = rows[0]["ms"]
    lines = [
        "| way | ms | vs autograd | peak GiB above inputs | loss | dh vs autograd | grad W vs autograd |"
    ]
    lines.append("|---|---|---|---|---|---|---|")
    for r in rows:
        lines.append(f"| {r['way']} | {r['ms']:.2f} | {base / r['ms']:.2f}x | {r['peak_gib']:.2f} | "
                     f"{r['loss']:.6f} | {r['dh_diff']:.2e} | {r['grad_W_diff']:.2e} |")  # fmt: skip
    table = "\n".join(lines)
    print(table)
    if a.out:
        meta = dict(date=datetime.datetime.now().isoformat(timespec="seconds"),
                    device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", torch=torch.__version__,
                    shape=f"{a.shape} {shape}", tokens=a.tokens, chunk=a.chunk, iters=a.iters,
                    command="python bench/losshead.py " + " ".join(sys.argv[1:]))  # fmt: skip
        print(write_once(a.out, "losshead", "The loss head's backward, three ways", meta, rows, table))


if __name__ == "__main__":
    main()
