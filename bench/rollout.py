"""Sampling alone: the rollout engine (megatrain/rl/decode.py) against transformers' `generate` on
the same GPU, model and batch, beside the memory-bandwidth bound measured in the same call; the
decode attention kernels PyTorch ships at the shape; and the engine with streamed layers against
the host-to-device link's measured rate. The engine and profile parts run each of `--layouts`:
`separate` (transformers' q/k/v and gate/up projections) and `fused` (the rollout's policy,
rl/fuse.py: one q/k/v GEMM and one gate/up GEMM a layer, built from the same weights).

    python bench/rollout.py --shape Q7 --rows 128 --prompt 128 --completion 256,512 --out bench/results
    python bench/rollout.py --shape Q7 --parts engine,compiled --completion 256 --layouts separate,fused

Random weights in bf16, random prompts, every completion run to its limit (no end token; the
`leave` part draws end tokens, its rows leaving the batch as they end against every row kept). The
bound: a decode step reads every weight but the embedding once and each row's keys and values up
to its length; bytes over the copy rate this GPU measured (a device-to-device copy, reads and
writes counted) and over its 4.8 TB/s data sheet rate. Each part prints its line as it finishes;
the JSON and markdown are written at the end (and on SIGINT, with what finished).
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))
from _report import write_once  # noqa: E402
from _shapes import DENSE_SHAPES  # noqa: E402
from _systems import model_config  # noqa: E402

LAYOUTS = ("separate", "fused")  # the engine's model: transformers' projections, or rl/fuse.py's
HBM_SHEET = 4.8e12  # H200 (H100 SXM: 3.35e12)
lines: list[str] = []
records: list[dict] = []


def say(text: str, **rec) -> None:
    print(text, flush=True)
    lines.append(text)
    if rec:
        records.append(rec)


def timed(fn, repeats: int = 20) -> float:
    """Seconds a call of `fn` takes on the GPU (CUDA events, after two warm-ups)."""
    for _ in range(2):
        fn()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(repeats):
        fn()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / repeats


def machine() -> dict:
    n = 2**30
    x, y = torch.empty(n, dtype=torch.uint8, device="cuda"), torch.empty(n, dtype=torch.uint8, device="cuda")
    h = torch.empty(n, dtype=torch.uint8).pin_memory()
    d2d = 2 * n / timed(lambda: y.copy_(x))
    h2d = n / timed(lambda: x.copy_(h, non_blocking=True), 5)
    say(f"device-to-device copy {d2d / 1e12:.2f} TB/s (reads + writes); pinned host-to-device {h2d / 1e9:.1f} GB/s",
        part="machine", d2d_bytes_per_s=d2d, h2d_bytes_per_s=h2d)  # fmt: skip
    return {"d2d": d2d, "h2d": h2d}


def attention_kernels(shape: dict, rows: int, spans: list[int]) -> None:
    """One decode step's attention of one layer: grouped SDPA (the engine's), SDPA with enable_gqa,
    FlexAttention (compiled, its decoding kernel), and explicit grouped scores."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    for span in spans:
        _kernels_at(shape, rows, span, flex, create_block_mask)


def _kernels_at(shape: dict, rows: int, span: int, flex, create_block_mask) -> None:
    import torch.nn.functional as F

    H, kv = shape["heads"], shape["kv"]
    D = shape["hidden"] // H
    q = torch.randn(rows, H, 1, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(rows, kv, span, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    pad = torch.randint(0, 16, (rows,), device="cuda")
    mask = (torch.arange(span, device="cuda")[None] >= pad[:, None])[:, None, None]
    g = q.view(rows, kv, H // kv, D)

    def grouped():
        return F.scaled_dot_product_attention(g, k, v, attn_mask=mask)

    def gqa():
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    def explicit():
        s = (g @ k.transpose(-1, -2)) * D**-0.5
        return torch.softmax(s.masked_fill(~mask, float("-inf")).float(), -1).to(g.dtype) @ v

    bm = create_block_mask(lambda b, h, qi, ki: ki >= pad[b], rows, None, 1, span, device="cuda")

    def flexed():
        return flex(q, k, v, block_mask=bm, enable_gqa=True)

    read = 2 * k.numel() * k.element_size()
    ref = grouped().view(rows, H, 1, D).float()
    for name, fn in (("grouped SDPA (the engine's)", grouped), ("SDPA enable_gqa", gqa),
                     ("explicit grouped scores", explicit), ("FlexAttention, compiled", flexed)):  # fmt: skip
        try:
            err = (fn().reshape(rows, H, 1, D).float() - ref).abs().max().item()
            s = timed(fn, 50)
            say(f"attention, {rows} rows x {span} keys: {name}: {s * 1e6:.0f} us, {read / s / 1e12:.2f} TB/s "
                f"of keys and values, max diff {err:.1e}",
                part="attention", kernel=name, rows=rows, span=span, s=s, bytes=read, max_diff=err)  # fmt: skip
        except Exception as e:  # a kernel this build lacks: say so, go on
            say(f"attention, {rows} rows x {span} keys: {name}: failed ({type(e).__name__}: {str(e)[:120]})")


def step_bytes(cfg, rows: int, prompt: int, completion: int) -> float:
    """Bytes a rollout's decode steps read at best: the weights but the embedding, once a step, and
    each row's cache up to its length."""
    from megatrain.models.config import ModelConfig

    m = ModelConfig.from_hf(cfg)
    weights = (m.num_params - m.vocab_size * m.hidden_size) * 2
    kv_token = 2 * m.num_key_value_heads * m.head_dim * m.num_hidden_layers * 2
    return sum(weights + rows * (prompt + n) * kv_token for n in range(1, completion))


def engine(model, cfg, rows: int, prompt: int, completion: int, ceiling: dict, compile: bool = False,
           layout: str = "separate") -> None:  # fmt: skip
    from megatrain.models.config import ModelConfig
    from megatrain.planning.footprint import rollout_bytes
    from megatrain.rl.decode import Decoder
    from megatrain.rl.sampling import Warpers, row_seed

    g = torch.Generator().manual_seed(0)
    prompts = (
        torch.randint(3, cfg.vocab_size, (rows // 8, prompt), generator=g).repeat_interleave(8, 0).tolist()
    )
    seeds = [row_seed(0, 1, i) for i in range(rows)]
    dec = Decoder(model, "cuda", [], 0, Warpers(), graphs=True, compile=compile)
    t0 = time.perf_counter()
    dec.sample(prompts, seeds, completion)  # cuBLAS, the allocator (and the compiler) warmed
    first_s = time.perf_counter() - t0
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    out = dec.sample(prompts, seeds, completion)
    s = time.perf_counter() - t0
    added = torch.cuda.max_memory_allocated() - base
    assert all(len(r) == completion for r in out)
    t = dec.timing
    bound = step_bytes(cfg, rows, prompt, completion)
    plan = rollout_bytes(ModelConfig.from_hf(cfg), rows, prompt, completion, 2)
    planned = sum(v for k, v in plan.items() if k != "policy weights")
    rate = rows * completion / s
    steady = rows * (completion - 1) / t["decode_s"]
    what = f"megatrain engine, {layout}" + (", compiled" if compile else "")
    say(f"{what}, {rows} rows x ({prompt} + {completion}): **{rate:,.0f} completion tokens/s** (first call {first_s:.1f} s) "
        f"({s:.2f} s: prefill {t['prefill_s']:.2f}, {t['graphs']} graph captures {t['capture_s']:.2f}, "
        f"{t['steps']} decode steps {t['decode_s']:.2f} = {t['decode_s'] / t['steps'] * 1e3:.2f} ms a step, "
        f"{steady:,.0f} tokens/s); bandwidth bound {rows * completion / (bound / ceiling['d2d']):,.0f} at the "
        f"measured copy rate, {rows * completion / (bound / HBM_SHEET):,.0f} at 4.8 TB/s "
        f"({rate / (rows * completion / (bound / HBM_SHEET)):.0%} of it); GPU added {added / 2**30:.2f} GiB, "
        f"the plan keeps {planned / 2**30:.2f} GiB past the weights",
        part="engine", layout=layout, compile=compile, first_call_s=first_s, rows=rows, prompt=prompt, completion=completion, s=s, tokens_per_s=rate,
        decode_tokens_per_s=steady, timing=t, bound_bytes=bound,
        bound_tokens_per_s_measured=rows * completion / (bound / ceiling["d2d"]),
        bound_tokens_per_s_sheet=rows * completion / (bound / HBM_SHEET), gpu_added=added,
        plan_bytes=plan)  # fmt: skip


def leaving(model, cfg, rows: int, prompt: int, completion: int, mean: int) -> None:
    """Completions that end: end tokens drawn at 1 in `mean` a token (a random model's near-uniform
    distribution over the vocabulary; the lengths about geometric, a few rows to the limit), the
    engine (compiled, and eager with graphs) with the ended rows leaving the batch
    (decode.LEAVE_AT) and keeping every row to the last one's end (LEAVE_AT 0), the same prompts
    and streams. In fp32 the completions are the same (the CPU test holds it); in bf16 a GEMM of
    another width rounds otherwise and breaks near-ties: the bench counts the rows that differ."""
    from megatrain.rl import decode
    from megatrain.rl.sampling import Warpers, row_seed

    g = torch.Generator().manual_seed(0)
    prompts = (
        torch.randint(3, cfg.vocab_size, (rows // 8, prompt), generator=g).repeat_interleave(8, 0).tolist()
    )
    seeds = [row_seed(0, 1, i) for i in range(rows)]
    stops = list(range(3, 3 + cfg.vocab_size // mean))
    ends, rule = set(stops), decode.LEAVE_AT
    for compiled in (True, False):
        kept = None
        for leave_at in (0.0, rule):
            decode.LEAVE_AT = leave_at
            try:
                dec = decode.Decoder(model, "cuda", stops, 0, Warpers(), graphs=True, compile=compiled)
                dec.sample(prompts, seeds, completion)  # compiled, captured and warmed
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                out = dec.sample(prompts, seeds, completion)
                s = time.perf_counter() - t0
            finally:
                decode.LEAVE_AT = rule
            kept = out if kept is None else kept
            differ = sum(a != b for a, b in zip(kept, out))
            lengths = [next((i + 1 for i, t in enumerate(r) if t in ends), completion) for r in out]
            t = dec.timing
            widths = t["widths"] + [(t["steps"] + 1, 0)]
            row_steps = sum((b - a) * w for (a, w), (b, _) in zip(widths, widths[1:]))
            what = "rows leave the batch" if leave_at else "every row kept"
            how = "compiled" if compiled else "eager, graphed"
            say(f"completions that end (1 in {mean} a token), {how}, {what}: {rows} rows x ({prompt} + at "
                f"most {completion}), mean completion {sum(lengths) / rows:.0f}, longest {max(lengths)}: "
                f"**{sum(lengths) / s:,.0f} completion tokens/s** ({s:.2f} s; {t['steps']} decode steps "
                f"{t['decode_s']:.2f} s, {row_steps / max(t['steps'], 1):.1f} rows a step on average, "
                f"widths {t['widths']}; {differ} of {rows} completions not the kept batch's)",
                part="leave", compiled=compiled, leave_at=leave_at, mean_end=mean, rows=rows,
                prompt=prompt, completion=completion, s=s, tokens=sum(lengths),
                tokens_per_s=sum(lengths) / s, differ=differ, timing=t)  # fmt: skip


def profile(model, cfg, rows: int, prompt: int, span: int, compile: bool, layout: str = "separate",
            steps: int = 10) -> None:  # fmt: skip
    """Where one eager decode step's GPU time goes at `span` attended positions: the kernels'
    time a step (CUDA's own records through the profiler), largest first, grouped by kind. A
    graphed step runs the same kernels without the launches between them."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    from megatrain.rl.decode import Decoder, KVCache, _State, engine_attention
    from megatrain.rl.sampling import Warpers, row_seed

    dec = Decoder(model, "cuda", [], 0, Warpers(), graphs=False, compile=compile)
    prompts = torch.randint(3, cfg.vocab_size, (rows // 8, prompt)).repeat_interleave(8, 0).tolist()
    cache = KVCache(rows, span + 1, "cuda")
    pad = torch.zeros(rows, dtype=torch.long, device="cuda")
    seeds = torch.tensor([row_seed(0, 3, i) for i in range(rows)], device="cuda")
    s = _State(dec, cache, pad, seeds, steps * 3)
    with torch.no_grad(), engine_attention(model):
        s.prefill(prompts, prompt)
        cache.span = span
        cache.at.fill_(span - steps * 3)
        s.decode()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                s.decode()
            torch.cuda.synchronize()
    kernels: dict[str, float] = {}
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            kernels[e.name] = kernels.get(e.name, 0.0) + e.device_time_total / 1e3 / steps
    total = sum(kernels.values())
    kinds: dict[str, float] = {}
    for name, ms in kernels.items():
        kinds[_kind(name)] = kinds.get(_kind(name), 0.0) + ms
    say(f"profile, {layout}{', compiled' if compile else ''}, {rows} rows at span {span}: kernels {total:.2f} ms a decode step; by kind: "
        + ", ".join(f"{k} {v:.2f}" for k, v in sorted(kinds.items(), key=lambda kv: -kv[1])),
        part="profile", layout=layout, compile=compile, rows=rows, span=span, kernel_ms=total, kinds=kinds,
        kernels=dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:40]))  # fmt: skip
    for name, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:25]:
        say(f"    {ms:7.3f} ms  {name[:110]}")


def _kind(name: str) -> str:
    n = name.lower()
    for kind, keys in (("gemm", ("gemm", "nvjet", "cutlass", "sm90_xmma", "cublas")),
                       ("attention", ("fmha", "attention", "flash", "sdpa")),
                       ("scan", ("scan", "cumsum")), ("sort", ("sort", "radix")),
                       ("copy", ("copy", "memcpy", "index", "cat")), ("reduce", ("reduce", "softmax", "max", "sum"))):  # fmt: skip
        if any(k in n for k in keys):
            return kind
    return "elementwise"


def generate(model, cfg, rows: int, prompt: int, completion: int) -> None:
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, cfg.vocab_size, (rows, prompt), generator=g).cuda()
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, max_new_tokens=completion,
              min_new_tokens=completion, pad_token_id=0)  # fmt: skip
    with torch.no_grad():
        model.generate(
            ids[:8],
            attention_mask=torch.ones_like(ids[:8]),
            **(kw | {"max_new_tokens": 8, "min_new_tokens": 8}),
        )
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=torch.ones_like(ids), **kw)
        torch.cuda.synchronize()
    s = time.perf_counter() - t0
    say(f"transformers generate (dynamic cache, sdpa), {rows} rows x ({prompt} + {completion}): "
        f"{rows * completion / s:,.0f} completion tokens/s ({s:.2f} s)",
        part="generate", rows=rows, prompt=prompt, completion=completion, s=s, tokens_per_s=rows * completion / s)  # fmt: skip


def streamed(model, cfg, rows: int, prompt: int, completion: int, resident: int, ceiling: dict) -> None:
    """The policy with its layers from `resident` on streamed from page-locked host memory in bf16
    (rl/policy.py) through the engine: the decode's host-to-device rate against the link's."""
    from megatrain.rl.decode import Decoder
    from megatrain.rl.policy import PolicyModel
    from megatrain.rl.sampling import Warpers, row_seed

    def host(name: str, p: torch.Tensor) -> torch.Tensor:
        parts = name.split(".")
        layer = int(parts[2]) if name.startswith("model.layers.") else -1
        return p.detach().cpu().pin_memory() if layer >= resident else p.detach()

    weights = [(n, host(n, p)) for n, p in model.named_parameters()]
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(3, cfg.vocab_size, (rows, prompt), generator=g).tolist()
    seeds = [row_seed(0, 2, i) for i in range(rows)]
    policy = PolicyModel(cfg, weights, "cuda", torch.bfloat16, resident)  # fused, as the rollout's
    with policy as hf:
        dec = Decoder(hf, "cuda", [], 0, Warpers(), graphs=False)
        dec.sample(prompts[:8], seeds[:8], 4)
        torch.cuda.synchronize()
        before, t0 = policy.fetched_bytes, time.perf_counter()
        dec.sample(prompts, seeds, completion)
        torch.cuda.synchronize()
        s, fetched = time.perf_counter() - t0, policy.fetched_bytes - before
    rate = fetched / s
    say(f"streamed: {cfg.num_hidden_layers - resident} of {cfg.num_hidden_layers} layers from host memory, "
        f"{rows} rows x ({prompt} + {completion}): {rows * completion / s:,.0f} completion tokens/s, "
        f"**host-to-device {rate / 1e9:.1f} GB/s = {rate / ceiling['h2d']:.0%} of the link's "
        f"{ceiling['h2d'] / 1e9:.1f}**",
        part="streamed", rows=rows, prompt=prompt, completion=completion, resident=resident, s=s,
        tokens_per_s=rows * completion / s, h2d_bytes_per_s=rate, link=ceiling["h2d"])  # fmt: skip


def layout_of(model, cfg, layout: str):
    """`model` itself (`separate`), or the rollout's fused policy of its weights (`fused`: a second
    copy of them on the GPU while the block runs)."""
    import contextlib

    from megatrain.rl.policy import PolicyModel

    if layout == "separate":
        return contextlib.nullcontext(model)
    return PolicyModel(cfg, [(n, p.detach()) for n, p in model.named_parameters()], "cuda", torch.bfloat16)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="Q7")
    p.add_argument("--rows", type=int, default=128)
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--completion", default="256,512")
    p.add_argument("--parts", default="machine,attention,profile,engine,compiled,generate,streamed")
    p.add_argument("--layouts", default="separate,fused", help="projection layouts of engine and profile")
    p.add_argument("--streamed-rows", type=int, default=128)
    p.add_argument("--streamed-completion", type=int, default=32)
    p.add_argument("--end-every", type=int, default=128, help="leave: end tokens drawn 1 in N a token")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tag", default="rollout")
    a = p.parse_args()
    parts, completions = a.parts.split(","), [int(c) for c in a.completion.split(",")]
    layouts = a.layouts.split(",")
    if set(layouts) - set(LAYOUTS):
        p.error(f"--layouts: {a.layouts!r} names a layout not among {', '.join(LAYOUTS)}")
    shape = DENSE_SHAPES[a.shape]
    stopped = None
    try:
        ceiling = machine()
        if "attention" in parts:
            attention_kernels(shape, a.rows, [a.prompt + c for c in completions])
        import transformers

        cfg = model_config({"shape": shape, "seq": a.prompt + max(completions)})
        with torch.device("cuda"):
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
        for layout in layouts:
            with layout_of(model, cfg, layout) as m:
                for c in completions:
                    if "engine" in parts:
                        engine(m, cfg, a.rows, a.prompt, c, ceiling, layout=layout)
                    if "compiled" in parts:
                        engine(m, cfg, a.rows, a.prompt, c, ceiling, compile=True, layout=layout)
                for compiled in [False, True] if "profile" in parts else []:
                    profile(m, cfg, a.rows, a.prompt, a.prompt + max(completions) // 2, compiled, layout)
        if "leave" in parts:
            with layout_of(model, cfg, "fused") as m:  # the rollout's policy
                leaving(m, cfg, a.rows, a.prompt, max(completions), a.end_every)
        if "generate" in parts:
            generate(model, cfg, a.rows, a.prompt, completions[0])
        if "streamed" in parts:
            streamed(
                model, cfg, a.streamed_rows, a.prompt, a.streamed_completion, shape["layers"] // 2, ceiling
            )
    except KeyboardInterrupt:
        stopped = "stopped by SIGINT; the parts before it finished"
    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "cpus": os.cpu_count(),
        "command": "python bench/rollout.py " + " ".join(sys.argv[1:]),
        "shape": a.shape,
        "torch": torch.__version__,
        **({"stopped": stopped} if stopped else {}),
    }
    write_once(a.out, a.tag, f"{a.tag}: sampling", meta, records, "\n\n".join(lines), key="runs",
               stamp=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d_%H%M"))  # fmt: skip


if __name__ == "__main__":
    main()
