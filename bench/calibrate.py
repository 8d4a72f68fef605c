"""Measure the constants of the placement memory model (megatrain/planning/placement.py) on a GPU.

For each decoder-layer shape and token count it runs one layer the way the engine does
(bf16, `torch.compile`d template bound with functional_call) and measures with the CUDA caching
allocator's counters:
  graph      bytes the autograd graph of one layer's forward holds (output excluded)
  backward   peak bytes above that while the layer is differentiated (its parameter gradients
             excluded: the plan counts them with the gradients)
  forward    peak bytes above the input while a layer runs without autograd
and fits `GRAPH_H, GRAPH_F` and `BACKWARD_H, BACKWARD_F` (bytes per token = cb * (a*h + b*ffn))
by least squares over all shapes. The loss head is measured the same way for one chunk
(bytes per logit and per token x hidden). It also times each layer (forward, recompute +
backward) for the cost model. Results: a table, and JSON under --out.

    python bench/calibrate.py --out bench/results
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import torch
import torch.nn.functional as F
from torch.func import functional_call

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from megatrain.models.config import ModelConfig  # noqa: E402
from megatrain.models.decoder import DecoderLayer, Head, rope_cos_sin, rope_inv_freq  # noqa: E402

SHAPES = {  # hidden, ffn, heads, kv heads
    "A-3.6B": (3072, 8192, 24, 8),
    "B-8B": (4096, 14336, 32, 8),
    "18.7B": (6144, 16384, 48, 8),
    "120B-class": (12288, 28672, 96, 8),
}


def model_cfg(h, f, heads, kv, vocab=128256) -> ModelConfig:
    from transformers import LlamaConfig

    c = LlamaConfig(
        hidden_size=h,
        intermediate_size=f,
        num_attention_heads=heads,
        num_key_value_heads=kv,
        num_hidden_layers=1,
        vocab_size=vocab,
        rope_theta=500000.0,
        max_position_embeddings=131072,
    )
    return ModelConfig.from_hf(c)


def measure_layer(cfg: ModelConfig, tokens: int, seq: int, compiled) -> dict:
    dev = torch.device("cuda")
    dt = torch.bfloat16
    with torch.device("meta"):
        layer = DecoderLayer(cfg)
    params = {n: (torch.randn(p.shape, device=dev) * 0.02).to(dt) for n, p in layer.named_parameters()}
    inv, scale = rope_inv_freq(cfg)
    B = tokens // seq
    pos = torch.arange(seq, device=dev).expand(B, seq)
    cos, sin = rope_cos_sin(inv.to(dev), scale, pos, dt)

    def call(p, x):
        return functional_call(layer, p, (x, (cos, sin), None))

    fn = compiled(call)
    x = torch.randn(B, seq, cfg.hidden_size, device=dev, dtype=dt)
    dy = torch.randn_like(x)
    leaves = {n: t.detach().requires_grad_() for n, t in params.items()}
    pgrad_bytes = sum(t.numel() * t.element_size() for t in params.values())

    def once():
        xr = x.detach().requires_grad_()
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        with torch.enable_grad():
            y = fn(leaves, xr)
        torch.cuda.synchronize()
        t_fwd = time.perf_counter() - t0
        graph = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        g = torch.autograd.grad(y, [xr, *leaves.values()], dy)
        torch.cuda.synchronize()
        t_bwd = time.perf_counter() - t0
        backward = torch.cuda.max_memory_allocated() - before - pgrad_bytes
        del g, y, xr
        # forward without autograd
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        with torch.no_grad():
            y = fn(params, x)
        torch.cuda.synchronize()
        forward = torch.cuda.max_memory_allocated() - before - y.numel() * y.element_size()
        del y
        return graph, backward, forward, t_fwd, t_bwd

    once()  # compile and warm up
    once()
    graph, backward, forward, t_fwd, t_bwd = once()
    n_layer = sum(t.numel() for t in params.values())
    q = cfg.num_attention_heads * cfg.head_dim
    flops_fwd = 2 * n_layer * tokens + 2 * tokens * seq * q
    return dict(
        graph=graph,
        backward=backward,
        forward=forward,
        t_fwd=t_fwd,
        t_recompute_bwd=t_bwd,
        tflops_fwd=flops_fwd / t_fwd / 1e12,
        tflops_bwd=2 * flops_fwd / t_bwd / 1e12,
    )


def measure_head(cfg: ModelConfig, chunk: int) -> dict:
    """One chunk of the engine's loss head: norm, LM head, fp32 cross-entropy, gradients."""
    dev, dt = torch.device("cuda"), torch.bfloat16
    with torch.device("meta"):
        head = Head(cfg)
    V, h = cfg.vocab_size, cfg.hidden_size
    W = (torch.randn(V, h, device=dev) * 0.02).to(dt)
    nw = torch.ones(h, device=dev, dtype=dt)
    x = torch.randn(chunk, h, device=dev, dtype=dt)
    tgt = torch.randint(0, V, (chunk,), device=dev)

    def once():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        xc, nwl, Wl = x.detach().requires_grad_(), nw.detach().requires_grad_(), W.detach().requires_grad_()
        with torch.enable_grad():
            hn = functional_call(head.norm, {"weight": nwl}, (xc,))
            logits = F.linear(hn, Wl).float()
            loss = F.cross_entropy(logits, tgt, reduction="sum")
            g = torch.autograd.grad(loss / 1000, (xc, nwl, Wl))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before - W.numel() * W.element_size()  # gW
        del g, hn, logits, loss
        return peak

    once()
    return {"peak": once(), "chunk": chunk, "vocab": V, "hidden": h}


def fit(rows: list[dict], key: str) -> tuple[float, float]:
    """Least squares of bytes/token/cb = a*h + b*ffn over the measured rows."""
    A = torch.tensor([[r["hidden"], r["ffn"]] for r in rows], dtype=torch.float64)
    y = torch.tensor([r[key] / r["tokens"] / 2 for r in rows], dtype=torch.float64)
    sol = torch.linalg.lstsq(A, y[:, None]).solution[:, 0]
    return float(sol[0]), float(sol[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--tokens", default="4096,16384")
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--eager", action="store_true", help="no torch.compile")
    args = ap.parse_args()
    torch.manual_seed(0)
    compiled = (lambda f: f) if args.eager else torch.compile
    rows = []
    for name in args.shapes.split(","):
        h, f, heads, kv = SHAPES[name]
        cfg = model_cfg(h, f, heads, kv)
        for tokens in (int(t) for t in args.tokens.split(",")):
            try:
                r = measure_layer(cfg, tokens, min(args.seq, tokens), compiled)
            except torch.OutOfMemoryError:
                print(f"{name} {tokens}: out of memory", flush=True)
                continue
            r.update(shape=name, hidden=h, ffn=f, tokens=tokens)
            rows.append(r)
            print(
                f"{name:<11} {tokens:>7} tokens: graph {r['graph'] / tokens:8.0f} B/tok  backward "
                f"{r['backward'] / tokens:8.0f} B/tok  forward {r['forward'] / tokens:8.0f} B/tok  "
                f"fwd {r['tflops_fwd']:.0f} TFLOP/s  bwd {r['tflops_bwd']:.0f} TFLOP/s",
                flush=True,
            )
            torch.cuda.empty_cache()
    heads = [measure_head(model_cfg(4096, 14336, 32, 8), c) for c in (1024, 2048)]
    for hd in heads:
        print(f"head chunk {hd['chunk']}: {hd['peak'] / hd['chunk'] / hd['vocab']:.2f} B/logit (all in)")
    # bytes per logit and per token x hidden from the two chunk sizes (both scale with chunk)
    per_token = [hd["peak"] / hd["chunk"] for hd in heads]
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "compiled": not args.eager,
        "command": "python " + " ".join(sys.argv),
        "layers": rows,
        "head": heads,
        "fit": {
            "GRAPH_H, GRAPH_F": fit(rows, "graph"),
            "BACKWARD_H, BACKWARD_F": fit(rows, "backward"),
            "FORWARD_H, FORWARD_F": fit(rows, "forward"),
            "head bytes per token (chunk 1024, 2048)": per_token,
        },
    }
    print(json.dumps(result["fit"], indent=1))
    os.makedirs(args.out, exist_ok=True)
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M")
    path = os.path.join(args.out, f"{stamp}_calibrate{'_eager' if args.eager else ''}.json")
    with open(path, "w") as fh:
        json.dump(result, fh, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main()
