"""One decoder layer, forward + backward, as the engine runs it (bf16, compiled): unpacked 4k
rows (SDPA's flash kernel) against long rows of packed 4k documents (FlexAttention block masks),
at the same tokens per call. The aim: packed rows at >= 0.9x the unpacked rows' tokens/s.

    python bench/attention.py                       # model A's layer, 64k tokens per call
    python bench/attention.py --tokens 524288 --rows packed

Prints one line per case (tokens/s, ratio to the unpacked rows, GPU peak above the inputs) and
writes them to bench/results/<date>_<time>_attention.json.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from torch.func import functional_call
from transformers import LlamaConfig, MistralConfig

from megatrain.models.attention import attention_mask
from megatrain.models.config import ModelConfig
from megatrain.models.decoder import DecoderLayer, rope_cos_sin, rope_inv_freq

RESULTS = Path(__file__).parent / "results"


def _case(layer, params, cfg, rows: int, seq: int, doc_len: int | None, window, iters: int) -> dict:
    dev, dtype = "cuda", torch.bfloat16
    inv, scale = rope_inv_freq(cfg)
    doc = None
    if doc_len is not None:
        doc = (torch.arange(seq, device=dev) // doc_len).expand(rows, seq).contiguous()
        pos = torch.arange(seq, device=dev) % doc_len
    else:
        pos = torch.arange(seq, device=dev)
    cos, sin = rope_cos_sin(inv.to(dev), scale, pos.expand(rows, seq), dtype)
    mask = attention_mask(doc, seq, window, dev, flex=True)
    x = torch.randn(rows, seq, cfg.hidden_size, device=dev, dtype=dtype, requires_grad=True)
    call = torch.compile(lambda p, x: functional_call(layer, p, (x, (cos, sin), mask)))
    dy = torch.randn_like(x)

    def once():
        y = call(params, x)
        torch.autograd.grad(y, [x, *params.values()], dy)

    once()  # compiles
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    for _ in range(iters):
        once()
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    return {
        "rows": rows,
        "seq": seq,
        "document": doc_len,
        "window": window,
        "tokens_s": rows * seq / dt,
        "peak_gib": (torch.cuda.max_memory_allocated() - base) / 2**30,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=65536, help="tokens per call")
    ap.add_argument("--doc", type=int, default=4096, help="document (and unpacked row) length")
    ap.add_argument("--window", type=int, default=None, help="a sliding window (Mistral)")
    ap.add_argument("--rows", choices=("both", "packed"), default="both")
    ap.add_argument("--iters", type=int, default=5)
    a = ap.parse_args()
    shape = dict(  # model A's layer (README); Mistral's family for a window
        hidden_size=3072,
        intermediate_size=8192,
        num_attention_heads=24,
        num_key_value_heads=8,
        vocab_size=128256,
    )
    hf = MistralConfig(sliding_window=a.window, **shape) if a.window else LlamaConfig(**shape)
    cfg = ModelConfig.from_hf(hf)
    with torch.device("meta"):
        layer = DecoderLayer(cfg)
    params = {
        n: (torch.randn(p.shape, device="cuda") * 0.02).to(torch.bfloat16).requires_grad_()
        for n, p in layer.named_parameters()
    }
    out = []
    if a.rows == "both":
        out.append(_case(layer, params, cfg, a.tokens // a.doc, a.doc, None, a.window, a.iters))
    out.append(_case(layer, params, cfg, 1, a.tokens, a.doc, a.window, a.iters))
    for r in out:
        r["ratio"] = r["tokens_s"] / out[0]["tokens_s"]
        print(json.dumps(r))
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / f"{time.strftime('%Y-%m-%d_%H%M')}_attention.json"
    path.write_text(
        json.dumps({"args": vars(a), "device": torch.cuda.get_device_name(), "cases": out}, indent=1)
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
