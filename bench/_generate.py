"""Worker of bench/grpo.py: transformers' `generate` alone, the peer of megatrain's rollout: the
model of --model (a config.json; random weights) in bf16 on the GPU, `rows` random prompts of
--prompt tokens, sampled (temperature 1) to exactly --completion new tokens (no end token), timed
over --repeats calls after one warm-up. --cache static: transformers' static KV cache, with which
`generate` compiles the decoding step on CUDA (the warm-up call compiles; the peak is of the timed
calls), as megatrain's `rollout_cache: static`. Writes one JSON record to --out."""

from __future__ import annotations

import argparse
import json
import time

import torch
import transformers


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rows", type=int, default=256)
    p.add_argument("--prompt", type=int, default=256)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--cache", choices=("dynamic", "static"), default="dynamic")
    p.add_argument("--out", required=True)
    a = p.parse_args()
    cfg = transformers.AutoConfig.from_pretrained(a.model)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (a.rows, a.prompt), generator=g).to(device)
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=a.completion,
              min_new_tokens=a.completion, pad_token_id=0)  # fmt: skip
    if a.cache == "static":
        kw["cache_implementation"] = "static"

    def once() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        if device.type == "cuda":
            torch.cuda.synchronize()
        assert out.shape[1] == a.prompt + a.completion, out.shape
        return time.perf_counter() - t0

    once()  # warm-up
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    s = min(once() for _ in range(a.repeats))
    rec = {
        "rows": a.rows, "prompt": a.prompt, "completion": a.completion, "cache": a.cache, "s": s,
        "decode_tokens_per_s": a.rows * a.completion / s,
        "gpu_peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None,
        "transformers": transformers.__version__, "torch": torch.__version__,
    }  # fmt: skip
    with open(a.out, "w") as f:
        json.dump(rec, f)
    print(json.dumps(rec))


if __name__ == "__main__":
    main()
