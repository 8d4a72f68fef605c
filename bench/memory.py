"""Planner accuracy and bounded GPU memory: train Llama-shaped models under chosen placements and
put the plan's predicted peaks beside the measured ones.

Each run is its own process (clean allocator peaks and resident set): it plans as `megatrain
train` does (placement.plan with the machine's budgets, or the caps given), builds the model
(random init), trains a few steps of random tokens, and reports the predicted and measured GPU
peak (torch.cuda.max_memory_allocated), host peak (VmHWM), the plan's choices and tokens/s.

    python bench/memory.py --runs A16k-off,A16k-auto,B16k-off --out bench/results
    python bench/memory.py --list

Run specs are `NAME` from RUNS below, or `model:tokens:key=value,...` (e.g.
`B:16384:gpu_state=off,max_gpu_memory=22GiB`). Each run records the caching allocator's retries
per step (a retry frees its cache and synchronises the device); after the timed steps,
`profile=1` runs one more step under the CUDA profiler (GPU and link busy), and `trace_alloc=1`
one more with the allocator's history recorded: where it gave memory back to the device, and
the request that followed, and each stream's memory when it began (bench/_alloc_trace.py). The
allocator's reserve is its peak over the run, kept across the per-phase resets of the peak
counters (runs before 2026-11-23 21:16 recorded only the peak since the last unit began).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import subprocess
import sys
import time
import traceback

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _phases import instrument_phases  # noqa: E402
from _shapes import DENSE_SHAPES, MOE_SHAPES, moe_config  # noqa: E402

from megatrain import CUDA_ALLOC_CONF  # noqa: E402

MODELS = DENSE_SHAPES
RUNS = {
    "A16k-off": "A:16384:gpu_state=off",
    "A16k-auto": "A:16384:gpu_state=auto",
    # the same model through the generic path (transformers' layer modules, not compiled)
    "A16k-off-generic": "A:16384:gpu_state=off,generic=1",
    "A64k-off": "A:65536:gpu_state=off",
    "A16k-twopass": "A:16384:gpu_state=off,gradient_placement=two_pass",
    "A16k-noclip": "A:16384:gpu_state=off,max_grad_norm=0",
    # all state in host memory, the first N of 30 units stepped on the GPU (bench/host-only.md)
    "A16k-off-gpustep8": "A:16384:gpu_state=off,gpu_step_units=8",
    "A16k-off-gpustep15": "A:16384:gpu_state=off,gpu_step_units=15",
    "A16k-off-gpustep22": "A:16384:gpu_state=off,gpu_step_units=22",
    "A16k-off-gpustep30": "A:16384:gpu_state=off,gpu_step_units=30",
    "A16k-off-gpustepauto": "A:16384:gpu_state=off,gpu_step_units=auto",
    "A16k-off-gpustepauto-24GiB": "A:16384:gpu_state=off,gpu_step_units=auto,max_gpu_memory=24GiB",
    "A128k-park": "A:131072:gpu_state=off,seq=131072,mbs=1,max_gpu_memory=40GiB",
    "B16k-off": "B:16384:gpu_state=off",
    "B64k-auto": "B:65536:gpu_state=auto",
    "B64k-off": "B:65536:gpu_state=off",
    "B64k-78GiB": "B:65536:max_gpu_memory=78GiB",
    "B64k-78GiB-gpustepauto": "B:65536:max_gpu_memory=78GiB,gpu_step_units=auto",
    "B16k-22GiB": "B:16384:max_gpu_memory=22GiB",
    "B16k-22GiB-gpustepauto": "B:16384:max_gpu_memory=22GiB,gpu_step_units=auto",
    "B16k-off-gpustepauto": "B:16384:gpu_state=off,gpu_step_units=auto",
    "B64k-off-gpustepauto": "B:65536:gpu_state=off,gpu_step_units=auto",
    "B64k-off-gpustep30": "B:65536:gpu_state=off,gpu_step_units=30,profile=1",
    # the same with one more step under the allocator's history: what each step's retry frees for
    "B64k-off-gpustep30-trace": "B:65536:gpu_state=off,gpu_step_units=30,trace_alloc=1",
    # the default mode where most of the state streams (a 40 GiB card), without and with GPU stepping
    "B16k-40GiB": "B:16384:max_gpu_memory=40GiB",
    "B16k-40GiB-gpustepauto": "B:16384:max_gpu_memory=40GiB,gpu_step_units=auto",
    # gradients shared: the host holds a fifth of them, the GPU the rest
    "B16k-shared": "B:16384:max_gpu_memory=60GiB,max_host_memory=103GiB",
    "B18-16k-off": "B18:16384:gpu_state=off",
    "B18-16k-70GiB": "B18:16384:max_gpu_memory=70GiB",
    # one GPU of a two-GPU machine whose MemTotal starts at 31 GiB and grows as it is used
    "x2-B18-16k-off": "B18:16384:gpu_state=off,max_host_memory=240GiB,steps=4",
    # the deepest model of 18.7B's width the plan accepts on that host, and one layer more (refused)
    "x2-largest-16k": "B18:16384:layers=max,max_host_memory=240GiB,steps=3",
    "x2-largest+1-16k": "B18:16384:layers=max,layers_extra=1,max_host_memory=240GiB,steps=3",
    "x2-largest-16k-128GiB": "B18:16384:layers=max,max_host_memory=240GiB,max_gpu_memory=128GiB,steps=3",
    "x2-largest+1-16k-128GiB": "B18:16384:layers=max,layers_extra=1,max_host_memory=240GiB,max_gpu_memory=128GiB,steps=3",
    "x2-B18-16k-70GiB": "B18:16384:max_gpu_memory=70GiB,max_host_memory=240GiB,steps=4",
    # the default mode with GPU stepping where the plan says it pays (an H100's memory)
    "x2-B18-16k-70GiB-gpustepauto": "B18:16384:max_gpu_memory=70GiB,max_host_memory=240GiB,gpu_step_units=auto,steps=4",
    "x2-B16k-off": "B:16384:gpu_state=off,max_host_memory=240GiB,steps=4",
    "x2-B16k-off-gpustep17": "B:16384:gpu_state=off,gpu_step_units=17,max_host_memory=240GiB,steps=4",
    "x2-B16k-off-gpustepauto": "B:16384:gpu_state=off,gpu_step_units=auto,max_host_memory=240GiB,steps=4",
    # host-only at 64k tokens per step (the aim: 450 model TFLOP/s for 8B)
    "x2-B64k-off": "B:65536:gpu_state=off,max_host_memory=240GiB,steps=4",
    "x2-B64k-off-gpustepauto": "B:65536:gpu_state=off,gpu_step_units=auto,max_host_memory=240GiB,steps=4",
    "X120-16k": "X120:16384:gpu_state=off",
    # one GPU of a four-GPU host (512 GiB, whose MemTotal grows as memory is used)
    "x4-Q32-64k": "Q32:65536:max_host_memory=480GiB,steps=4",
    "x4-Q14-64k": "Q14:65536:max_host_memory=480GiB",
    "x4-Q14-64k-off": "Q14:65536:gpu_state=off,max_host_memory=480GiB",
    "x4-B18-16k-70GiB": "B18:16384:max_gpu_memory=70GiB,max_host_memory=480GiB,steps=4",
    # the deepest model of Qwen2.5-32B's width the plan accepts on that host, and one layer more
    "x4-largest-16k": "Q32:16384:layers=max,max_host_memory=480GiB,steps=3",
    "x4-largest+1-16k": "Q32:16384:layers=max,layers_extra=1,max_host_memory=480GiB,steps=3",
    "tiny": "tiny:1024:gpu_state=auto,seq=256,steps=3",
    # 64k tokens per micro-batch: sixteen 4k rows (flash kernel) against one row of sixteen packed
    # 4k documents (FlexAttention block mask)
    "A64k-rows4k": "A:65536:seq=4096,mbs=16",
    "A64k-packed4k": "A:65536:seq=65536,mbs=1,doc=4096",
    "tiny-packed": "tiny:1024:gpu_state=auto,seq=1024,mbs=1,doc=256,steps=3",
    # mixture of experts (bench/_shapes.py): OLMoE-1B-7B (6.9 B) at 64k tokens; a 15.6 B Qwen3-MoE
    # needs 187 GB of host state, so one GPU of a two-GPU machine (256 GiB host)
    "olmoe-64k-auto": "olmoe-1b-7b:65536:gpu_state=auto",
    "olmoe-64k-off": "olmoe-1b-7b:65536:gpu_state=off",
    "x2-qwen3moe15b-16k-off": "qwen3-moe-15b:16384:gpu_state=off,max_host_memory=240GiB,steps=4",
    "x2-qwen3moe15b-64k-auto": "qwen3-moe-15b:65536:gpu_state=auto,max_host_memory=240GiB,steps=4",
    # DeepSeek-V2-Lite (15.7 B, 188 GB of host state): one GPU of a two-GPU machine; gpt-oss-20b
    # (20.9 B, 251 GB) needs more than a 256 GiB host
    "x2-dsv2lite-16k-off": "deepseek-v2-lite:16384:gpu_state=off,max_host_memory=240GiB,steps=4",
    "x4-gptoss20b-16k": "gpt-oss-20b:16384:max_host_memory=480GiB,steps=4",
    "moe-tiny": "moe-tiny:1024:gpu_state=auto,seq=256,steps=3",
}


def split_runs(text: str) -> list[str]:
    """`--runs`, a comma-separated list of run specs whose own options are comma-separated too: a
    piece without a `:` that sets a key (`gpu_step_units=auto`) belongs to the spec before it."""
    specs: list[str] = []
    for piece in text.split(","):
        if specs and ":" not in piece and "=" in piece and ":" in specs[-1]:
            specs[-1] += "," + piece
        else:
            specs.append(piece)
    return specs


def parse(spec: str) -> dict:
    spec = RUNS.get(spec, spec)
    model, tokens, *rest = spec.split(":")
    opts = dict(kv.split("=", 1) for kv in (rest[0].split(",") if rest and rest[0] else []))
    return {"spec": spec, "model": model, "tokens": int(tokens), **opts}


# ---------------------------------------------------------------------------- worker
def shape_of(run: dict):
    """(ModelConfig, sequence length, sequences per micro-batch, micro-batches per step) of a run.
    `generic=1`: the same Llama computed by the generic path (transformers' own layer modules), as
    Granite with every multiplier neutral (Llama's arithmetic under a family without a fast block)."""
    from transformers import GraniteConfig, LlamaConfig

    from megatrain.models.config import ModelConfig

    seq = int(run.get("seq", 4096))
    T = run["tokens"]
    mbs = int(run.get("mbs", max(1, min(16384, T) // seq)))
    if run["model"] in MOE_SHAPES:
        return ModelConfig.from_hf(moe_config(MOE_SHAPES[run["model"]], seq)), seq, mbs, T // (mbs * seq)
    d = MODELS[run["model"]]
    shape = dict(
        hidden_size=d["hidden"],
        num_hidden_layers=int(run.get("layers", d["layers"])),
        num_attention_heads=d["heads"],
        num_key_value_heads=d["kv"],
        intermediate_size=d["ffn"],
        vocab_size=d["vocab"],
        max_position_embeddings=max(seq, 8192),
        rope_theta=500000.0,
    )
    if run.get("generic"):
        neutral = dict(embedding_multiplier=1.0, logits_scaling=1.0, residual_multiplier=1.0)
        hf = GraniteConfig(**shape, **neutral, attention_multiplier=(d["hidden"] // d["heads"]) ** -0.5)
    else:
        hf = LlamaConfig(**shape)
    return ModelConfig.from_hf(hf), seq, mbs, T // (mbs * seq)


def choices_of(run: dict):
    """The placement choices a run spec sets (gpu_state, gradient_placement, offload_activations,
    mlp_tile_tokens, gpu_step_units); the rest the plan decides."""
    from megatrain.planning.placement import Choices

    offload = {"true": True, "false": False}.get(str(run.get("offload_activations")).lower())
    return Choices(
        gpu_state=run.get("gpu_state", "auto"),
        gradient_placement=run.get("gradient_placement", "auto"),
        offload_activations=offload,
        mlp_tile_tokens=int(run["mlp_tile_tokens"]) if "mlp_tile_tokens" in run else None,
        gpu_step_units=None if run.get("gpu_step_units") == "auto" else int(run.get("gpu_step_units", 0)),
    )


def batch_of(run: dict):
    """The placement's view of a run's batch (bf16 compute)."""
    from megatrain.planning.placement import Batch

    _, seq, mbs, accum = shape_of(run)
    doc, clip = int(run.get("doc", 0)), float(run.get("max_grad_norm", 1.0))
    return Batch(mbs * seq, accum, seq, 2, clip > 0, masked=doc > 0, rows=mbs, attention_span=doc or None)


def _packed(ids, doc: int):
    """Rows of `doc`-token documents packed end to end, as `packing: true` makes them: positions
    restart per document and no loss crosses a boundary."""
    import torch

    from megatrain.data.batch import MicroBatch

    at = torch.arange(ids.shape[1])
    labels = ids.clone()
    labels[:, at % doc == 0] = -100
    rows = ids.shape[0]
    return MicroBatch(
        ids.pin_memory(),
        labels,
        position_ids=(at % doc).expand(rows, -1).contiguous(),
        document_ids=(at // doc).expand(rows, -1).contiguous(),
    )


def at_limit(run: dict, machine, layer_mem) -> dict:
    """`seq=limit`: the run at the longest sequence the plan accepts on `machine` (one sequence per
    step, as `megatrain plan`'s "longest context" line says), times `limit_scale` (default 1; e.g.
    1.03 for a run the preflight must refuse). `layer_mem`: the probe's (None: the formula)."""
    from megatrain.config import TrainConfig
    from megatrain.plan import longest_context

    cfg, _, _, _ = shape_of({**run, "seq": 8192, "tokens": 8192, "mbs": 1})
    clip = float(run.get("max_grad_norm", 1.0))
    tc = TrainConfig(model_config="-", max_length=8192, per_device_train_batch_size=1, max_grad_norm=clip)
    found = longest_context(cfg, tc, machine, 2, layer_mem)
    limit = found[0] if found else 0
    n = int(limit * float(run.get("limit_scale", 1.0)))
    return {**run, "seq": str(n), "tokens": n, "mbs": "1", "limit": limit}


def at_largest(run: dict, machine, layer_mem) -> dict:
    """`layers=max`: the run of the model's shape with the most layers the plan accepts on
    `machine` (the largest model of that width the host holds), plus `layers_extra` (default 0;
    1 for a run the preflight must refuse)."""
    from megatrain.planning.placement import PlanError, plan

    def fits(layers: int) -> bool:
        r = {**run, "layers": str(layers)}
        try:
            plan(shape_of(r)[0], batch_of(r), machine, choices_of(r), layer_mem)
        except PlanError:
            return False
        return True

    lo, hi = 0, 1
    while fits(hi):
        lo, hi = hi, hi * 2
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    n = lo + int(run.get("layers_extra", 0))
    return {**run, "layers": str(n), "largest_layers": lo}


def worker(run: dict, out: dict) -> dict:
    """Plan, build and train `run`, filling `out` as it goes (a run that fails keeps what it
    had: the plan, the resolved run, each phase's predicted and measured peak so far)."""
    import torch

    from megatrain.config import parse_size
    from megatrain.data.batch import MicroBatch
    from megatrain.engine.optim import AdamWConfig
    from megatrain.planning.memory import MemoryRecord, status_bytes
    from megatrain.planning.placement import phase_peaks, unit_peaks
    from megatrain.planning.placement import plan as make_placement
    from megatrain.planning.probe import layer_memory_for
    from megatrain.runtime import build_model, configure_allocator, make_plan

    size = lambda k: parse_size(run[k]) if k in run else None  # noqa: E731
    limit_basis = None
    if run.get("seq") == "limit" or run.get("layers") == "max":
        from megatrain.planning.placement import measure
        from megatrain.planning.probe import PROBE_TOKENS

        configure_allocator()
        machine = measure("cuda", size("max_gpu_memory"), size("max_host_memory"))
        limit = run.get("seq") == "limit"  # else the depth: the probe's layer at the run's length
        at = {"seq": PROBE_TOKENS, "tokens": PROBE_TOKENS, "mbs": 1} if limit else {"layers": "1"}
        probe_cfg, seq, mbs, _ = shape_of({**run, **at})
        probed = layer_memory_for(probe_cfg, "cuda", torch.bfloat16, True, mbs * seq)
        torch.cuda.empty_cache()
        run = (at_limit if limit else at_largest)(run, machine, probed)
        limit_basis = machine, probed  # the run is planned on what its limit was found with
    cfg, seq, mbs, accum = shape_of(run)
    T, V = run["tokens"], cfg.vocab_size
    doc = int(run.get("doc", 0))  # packed rows of `doc`-token documents (0: plain rows)
    clip = float(run.get("max_grad_norm", 1.0))
    t0 = time.perf_counter()
    batch = batch_of(run)
    if limit_basis is None:
        plan, machine = make_plan(
            cfg,
            "cuda",
            torch.bfloat16,
            batch_size=mbs,
            seq_len=seq,
            grad_accum=accum,
            clip=clip > 0,
            masked=doc > 0,
            attention_span=doc or None,  # documents of equal length: sum(len^2) / sum(len) = doc
            choices=choices_of(run),
            max_gpu_memory=size("max_gpu_memory"),
            max_host_memory=size("max_host_memory"),
        )
        layer_mem = layer_memory_for(cfg, "cuda", torch.bfloat16, True, mbs * seq, masked=doc > 0)
    else:  # the machine and layer the limit was found with (measured again, the free memory differs)
        machine, layer_mem = limit_basis
        plan = make_placement(cfg, batch, machine, choices_of(run), layer_mem)
    record = MemoryRecord(plan, machine)
    out.update(
        plan=plan.to_json(),
        machine=dataclasses.asdict(machine),
        resolved_run=run,  # with seq=limit / layers=max: the length / depth the plan accepted
        params=cfg.num_params,
        plan_s=time.perf_counter() - t0,
        phase_predicted=phase_peaks(cfg, batch, plan, layer_mem),
        unit_predicted=unit_peaks(cfg, batch, plan, layer_mem),
        layer_mem=layer_mem.__dict__ if layer_mem is not None else None,
    )
    json.dumps(out)  # a record that cannot be written fails now, not after the run
    model = build_model(
        cfg,
        seed=0,
        device="cuda",
        compute_dtype="bfloat16",
        adamw=AdamWConfig(lr=1e-5),
        plan=plan,
        machine=machine,
    )
    out["init_s"] = time.perf_counter() - t0
    out["host_hwm_after_init"] = status_bytes("VmHWM")
    phases, units, reserve = instrument_phases(model.engine)
    out.update(phase_peaks=phases, unit_peaks=units)
    gen = torch.Generator().manual_seed(0)
    steps = int(run.get("steps", 5))
    times, losses, retries, outside = [], [], [], []

    def train_step() -> float:
        mb = []
        for _ in range(accum):
            ids = torch.randint(0, V, (mbs, seq), generator=gen)
            mb.append(_packed(ids, doc) if doc else MicroBatch(ids.pin_memory(), ids))
        loss, _ = model.engine.forward_backward(mb)
        norm, coef = model.engine.clip_grad_norm(clip)
        lv = loss.item()
        measured = model.engine.step(1e-5, coef)
        if measured is not None:
            measured.item()
        elif norm is not None:
            norm.item()
        return lv

    t_prev = time.perf_counter()
    for _ in range(steps):
        losses.append(train_step())
        t = time.perf_counter()
        times.append(t - t_prev)
        t_prev = t
        record.measure(len(times))
        # times so far the caching allocator freed its cache to satisfy a request (each one
        # synchronises the device and maps the memory again)
        stats = torch.cuda.memory_stats()
        retries.append(stats.get("num_alloc_retries", 0))
        free, total = torch.cuda.mem_get_info()
        outside.append(total - free - stats.get("reserved_bytes.all.current", 0))  # context, libraries
    out.update(alloc_retries=retries[-1], alloc_retries_by_step=retries, gpu_outside_allocator=outside)
    if int(run.get("profile", 0)):  # one more step under the profiler: GPU and link busy
        from _profile import profile_busy, warm_profiler

        warm_profiler()
        out.update(profile_busy(train_step))
    if int(run.get("trace_alloc", 0)):  # one more step with the allocator's history: its releases
        from _alloc_trace import traced_step

        tr, acts = model.transport, model.engine.host_acts
        streams = {"compute": tr.compute, "fetch": tr.h2d, "write-back": tr.d2h, "step": tr.stepper.stream}
        if acts is not None:
            streams.update({"park": acts.d2h, "unpark": acts.h2d})
        names: dict = {}
        for label, s in streams.items():  # one stream may serve several roles
            names[s.cuda_stream] = "+".join(filter(None, (names.get(s.cuda_stream), label)))
        out["alloc_releases"] = traced_step(train_step, names)[:100]
    model.transport.wait_updates()
    torch.cuda.synchronize()
    record.measure(len(times))
    record.measured["gpu_peak_allocated"] = max(phases.values())  # the phases reset the counters
    record.measured["gpu_peak_reserved"] = max(reserve["reserved"], torch.cuda.max_memory_reserved())
    steady = times[2:] or times
    tr = model.transport  # bytes over PCIe per step, each way (GPU-stepped units' state included)
    ran = steps + int(run.get("profile", 0)) + int(run.get("trace_alloc", 0))
    for way in ("h2d", "d2h"):
        moved = getattr(tr, f"{way}_bytes") + getattr(tr.stepper, f"{way}_bytes")
        out[f"{way}_bytes_per_step"] = moved / ran
    out.update(
        step_times=times,
        step_s=sum(steady) / len(steady),
        tokens_per_s=T / (sum(steady) / len(steady)),
        losses=losses,
        predicted=record.predicted,
        measured=record.measured,
        host_rss_before=record.baseline,
        host_acts_moved=model.engine.host_acts.bytes_moved if model.engine.host_acts else 0,
        host_hwm_after={
            k.removeprefix("host_hwm_after_"): v for k, v in reserve.items() if k.startswith("host_hwm")
        },
    )
    model.close()
    return out


# ---------------------------------------------------------------------------- parent
def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", default="tiny")
    ap.add_argument("--out", default=os.path.join(REPO, "bench", "results"))
    ap.add_argument("--tag", default="memory")
    ap.add_argument("--timeout", type=int, default=400)
    ap.add_argument("--deadline", type=int, default=560)
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.list:
        for k, v in RUNS.items():
            print(f"{k:<16} {v}")
        return
    if args.worker:
        os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", CUDA_ALLOC_CONF)  # as `megatrain train` sets it
        run = json.loads(args.worker)
        res: dict = {}
        try:
            worker(run, res)
        except Exception as e:  # noqa: BLE001 - recorded as the run's result, with what it had
            res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            res["traceback"] = traceback.format_exc()[-3000:]
        print("RESULT " + json.dumps(res), flush=True)
        return
    runs = []  # a name may repeat: the run is made again
    for name in split_runs(args.runs):  # every spec checked before the first run starts
        try:
            runs.append((name, parse(name)))
        except ValueError:
            ap.error(f"--runs: {name!r} is neither a name from --list nor model:tokens[:key=value,...]")
    start = time.time()
    results = []
    stamp = datetime.datetime.now().strftime("%Y-%m-%d_%H%M")
    os.makedirs(args.out, exist_ok=True)
    for name, run in runs:
        left = args.deadline - (time.time() - start) if args.deadline else args.timeout
        if left < 30:
            results.append({"name": name, "error": "skipped: deadline"})
            continue
        cmd = [sys.executable, os.path.abspath(__file__), "--worker", json.dumps(run)]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=min(args.timeout, left))
            line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
            res = (
                json.loads(line[-1][7:])
                if line
                else {"error": f"exit {p.returncode}: {p.stderr.strip()[-300:]}"}
            )
        except subprocess.TimeoutExpired:
            res = {"error": f"timeout after {min(args.timeout, left):.0f} s"}
        res.update(name=name, run=res.pop("resolved_run", run), wall_s=time.time() - t0)
        results.append(res)
        print(row(res), flush=True)
        write(results, args, stamp)
    print()
    print(table(results))


def _gib(b) -> str:
    return "-" if b is None else f"{b / 2**30:.1f}"


def _err(got, want) -> str:
    return "-" if not got or not want else f"{100 * (got / want - 1):+.1f}%"


def row(r: dict) -> str:
    if r.get("error"):
        return f"| {r['name']} | {r['run']['spec']} | error: {r['error']} |"
    p, pr, me = r["plan"], r["predicted"], r["measured"]
    return (
        f"| {r['name']} | {r['params'] / 1e9:.2f}B | {r['run']['tokens']:,} | {plan_str(p)} | "
        f"{_gib(pr.get('gpu_peak_allocated'))} | {_gib(me.get('gpu_peak_allocated'))} | "
        f"{_err(me.get('gpu_peak_allocated'), pr.get('gpu_peak_allocated'))} | "
        f"{_gib(pr['host_peak_rss'])} | {_gib(me.get('host_peak_rss'))} | {_err(me.get('host_peak_rss'), pr['host_peak_rss'])} | "
        f"{r['tokens_per_s']:,.0f} | {p['step_time_s'] and r['run']['tokens'] / p['step_time_s']:,.0f} | "
        f"{_gib(me.get('gpu_peak_reserved'))} | {r.get('alloc_retries', '')} | {_pct(r.get('gpu_busy'))} | "
        f"{r['init_s']:.0f} |"
    )


def _pct(x) -> str:
    return "" if x is None else f"{100 * x:.0f}%"


def plan_str(p: dict) -> str:
    """A plan's choices in a table cell: gradient mode, units whose gradients / state are on the
    GPU, GPU-stepped units (only where there are), kept graphs, parked layers, MLP tile (only
    where tiled)."""
    tile = f" tile{p['mlp_tile_tokens']}" if p.get("mlp_tile_tokens") else ""
    stepped = f" s{p['gpu_stepped_units']}" if p.get("gpu_stepped_units") else ""
    return (
        f"{p['grad_mode']} g{p['gpu_grad_units']} r{p['resident_units']}{stepped} k{p['keep_layers']} "
        f"park{p['parked_layers']}{tile}"
    )


HEADER = (
    "| run | params | tokens/step | plan | GPU plan GiB | GPU measured GiB | GPU err | host plan GiB | "
    "host measured GiB | host err | tokens/s | plan tokens/s | GPU reserved GiB | allocator retries | "
    "GPU busy | init s |\n|" + "---|" * 16
)


def table(results) -> str:
    return HEADER + "\n" + "\n".join(row(r) for r in results)


def write(
    results, args, stamp, script: str = "memory.py", title: str = "plan vs measured", table=table
) -> None:
    """`{stamp}_{tag}.json` and `.md` in args.out: date, device, the exact command, the runs."""
    import torch

    meta = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpus": os.cpu_count(),
        "command": f"python bench/{script} " + " ".join(sys.argv[1:]),
    }
    base = os.path.join(args.out, f"{stamp}_{args.tag}")
    with open(base + ".json", "w") as f:
        json.dump({**meta, "runs": results}, f, indent=1)
    with open(base + ".md", "w") as f:
        f.write(f"# {args.tag}: {title}\n\n")
        f.write("".join(f"- {k}: {v}\n" for k, v in meta.items()) + "\n")
        f.write(table(results) + "\n")
        f.write(host_marks(results))


def host_marks(results) -> str:
    """Each run's host high-water mark after the model's build and after each phase of a step
    (GiB), where the run recorded them: the phase the host's peak was reached in."""
    lines = []
    for r in results:
        marks = {"build": r.get("host_hwm_after_init"), **(r.get("host_hwm_after") or {})}
        if any(marks.values()):
            text = ", ".join(f"{k} {v / 2**30:.1f}" for k, v in marks.items() if v)
            lines.append(f"- {r.get('name', '?')}: host high-water mark (GiB) after {text}\n")
    return "\n" + "".join(lines) if lines else ""


if __name__ == "__main__":
    main()
