"""Grouped expert matmuls against a dense matmul of equal FLOPs (CUDA, bf16).

megatrain's expert block (`megatrain/models/moe.py: Experts`) runs every routed token through its
expert as two grouped matrix products (gate/up, then down) over tokens sorted by expert. This
measures forward + backward of that block at MoE shapes and compares its TFLOP/s with one dense
SwiGLU MLP of the same FLOPs (tokens x top-k rows through one expert-sized MLP), so the cost of
grouping (uneven groups, the sort and gathers) is visible.

    python bench/experts.py                        # on a GPU: the shapes below, 16k tokens
    python bench/experts.py --tokens 4096,16384 --shapes olmoe-1b-7b
    python bench/experts.py --dry-run              # anywhere: tiny shapes on the CPU, checked

Ratios are dense ms / ms: "block" is the whole expert block eager (sort, gathers, weighting),
"compiled" the block as the engine runs it (inside the compiled layer), "matmuls" the two grouped
matmuls alone on rows already sorted by expert.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import memory  # noqa: E402  (a sibling module: its result writer)
from _shapes import MOE_SHAPES  # noqa: E402

from megatrain.models.moe import Experts, _grouped_linear  # noqa: E402


def _routing(T: int, E: int, k: int, device):
    logits = torch.randn(T, E, device=device)
    scores, idx = logits.softmax(-1).topk(k, dim=-1)
    counts = torch.zeros(E, dtype=torch.int64, device=device).scatter_add_(
        0, idx.reshape(-1), torch.ones(T * k, dtype=torch.int64, device=device)
    )
    return idx, scores, counts


def _time(fn, reps: int) -> float:
    fn()  # warm-up (and the first CUDA kernels' set-up)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps


def measure(shape: dict, T: int, device, dtype, reps: int, compile: bool = True) -> dict:
    """Forward + backward seconds and TFLOP/s of the expert block (eager, and compiled as the
    engine runs it), of its two grouped matmuls alone (rows already sorted by expert), and of one
    dense SwiGLU MLP of the same FLOPs."""
    H, Fe, E, k = shape["hidden"], shape["ffn"], shape["experts"], shape["topk"]
    with torch.device(device):
        experts = Experts(E, H, Fe).to(dtype)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.02)
    x = torch.randn(T, H, device=device, dtype=dtype, requires_grad=True)
    idx, scores, counts = _routing(T, E, k, device)
    scores = scores.to(dtype)
    w1 = torch.randn(2 * Fe, H, device=device, dtype=dtype, requires_grad=True)
    w2 = torch.randn(H, Fe, device=device, dtype=dtype, requires_grad=True)
    xd = torch.randn(T * k, H, device=device, dtype=dtype, requires_grad=True)
    offs = counts.cumsum(0).to(torch.int32)

    def block(fn):
        def run():
            y = fn(x, idx, scores, counts)
            y.backward(torch.ones_like(y))

        return run

    def swiglu(xs, up, down):
        g, u = up(xs).chunk(2, dim=-1)
        y = down(F.silu(g) * u)
        y.backward(torch.ones_like(y))

    def matmuls():
        swiglu(
            xd,
            lambda a: _grouped_linear(a, experts.gate_up_proj, offs),
            lambda a: _grouped_linear(a, experts.down_proj, offs),
        )

    def dense():
        swiglu(xd, lambda a: F.linear(a, w1), lambda a: F.linear(a, w2))

    flops = 3 * 2 * T * k * 3 * H * Fe  # forward 2 x rows x params, backward twice that
    cases = {"block": block(experts), "matmuls": matmuls, "dense": dense}
    if compile:
        cases["compiled"] = block(torch.compile(experts))
    out = {}
    for name, fn in cases.items():
        t = _time(fn, reps)
        out[f"{name}_ms"], out[f"{name}_tflops"] = t * 1e3, flops / t / 1e12
    for name in ("block", "matmuls", "compiled"):
        if f"{name}_ms" in out:
            out[f"{name}_ratio"] = out["dense_ms"] / out[f"{name}_ms"]
    return out


def check_exact(shape: dict, T: int) -> float:
    """Grouped experts vs a loop over experts on the CPU in fp32: the largest difference."""
    H, Fe, E, k = shape["hidden"], shape["ffn"], shape["experts"], shape["topk"]
    experts = Experts(E, H, Fe)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    x = torch.randn(T, H)
    idx, scores, counts = _routing(T, E, k, "cpu")
    y = experts(x, idx, scores, counts)
    ref = torch.zeros_like(x)
    for e in range(E):
        tok, slot = torch.where(idx == e)
        g, u = F.linear(x[tok], experts.gate_up_proj[e]).chunk(2, dim=-1)
        ref.index_add_(0, tok, F.linear(F.silu(g) * u, experts.down_proj[e]) * scores[tok, slot, None])
    return (y - ref).abs().max().item()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="olmoe-1b-7b,qwen3-moe-15b", help=f"from {', '.join(MOE_SHAPES)}")
    ap.add_argument("--tokens", default="16384", help="tokens per call, comma list")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU, checked against a loop")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    ap.add_argument("--tag", default="experts")
    a = ap.parse_args(argv)
    if a.dry_run:
        err = check_exact(MOE_SHAPES["moe-tiny"], 64)
        print(f"grouped experts vs loop over experts (CPU fp32): max difference {err:.2e}")
        r = measure(MOE_SHAPES["moe-tiny"], 64, "cpu", torch.float32, reps=2, compile=False)
        print(f"moe-tiny, 64 tokens (CPU): {r}")
        return 0 if err < 1e-4 else 1
    if not torch.cuda.is_available():
        ap.error("needs CUDA (use --dry-run to check the script on a CPU)")
    results = []
    for name in a.shapes.split(","):
        for T in (int(t) for t in a.tokens.split(",")):
            r = measure(MOE_SHAPES[name], T, "cuda", torch.bfloat16, a.reps)
            results.append({"shape": name, "tokens": T, **r})
            print(table(results[-1:]).splitlines()[-1])
    memory.write(results, a, time.strftime("%Y-%m-%d_%H%M"), "experts.py", TITLE, table)
    return 0


TITLE = "expert block (bf16, forward + backward) against a dense MLP of equal FLOPs"


def table(results: list[dict]) -> str:
    head = "| shape | tokens | block ms | compiled ms | matmuls ms | dense ms | dense TFLOP/s | block | compiled | matmuls |"
    rows = [head, "|" + "---|" * 10]
    for r in results:
        rows.append(
            f"| {r['shape']} | {r['tokens']:,} | {r['block_ms']:.2f} | {r.get('compiled_ms', 0):.2f} | "
            f"{r['matmuls_ms']:.2f} | {r['dense_ms']:.2f} | {r['dense_tflops']:.0f} | {r['block_ratio']:.2f} | "
            f"{r.get('compiled_ratio', 0):.2f} | {r['matmuls_ratio']:.2f} |"
        )
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
