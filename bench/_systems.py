"""Worker process of bench.py: trains one system for one (model, tokens-per-step) and writes raw
measurements to a JSON file.

Run as `python bench/_systems.py SPEC.json`. Each run lives in its own process so a crash or an
out-of-memory kill of one system cannot take the others down, and so host memory is measured per
system. The result file is rewritten after every step: a run killed by the parent's timeout still
leaves the steps it finished. Derived metrics (tokens/s, TFLOP/s, ratios) are computed by bench.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
from _phases import instrument_phases
from _profile import profile_busy, warm_profiler
from _sched import per_step as sched_per_step
from _sched import snapshot as sched_snapshot

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the megatrain package of this checkout, whatever is installed

LR, BETAS, CLIP = 1e-5, (0.9, 0.95), 1.0
DEVICE = "cuda"  # the baselines' device; a seam for testing their loops on the CPU


def require_cuda() -> None:
    if not torch.cuda.is_available():
        raise BenchError("CUDA not available")


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


class BenchError(Exception):
    """An expected failure, recorded as its message alone (no traceback)."""


class Result:
    """The worker's record; saved atomically so the parent never reads half a file."""

    def __init__(self, path: str, **fields: Any):
        self.path, self.data = path, dict(fields)

    def update(self, **fields: Any) -> None:
        self.data.update(fields)
        self.save()

    def save(self) -> None:
        tmp = self.path + ".tmp"
        with open(tmp, "w") as f:
            json.dump(self.data, f, indent=1)
        os.replace(tmp, self.path)


def vm_hwm_bytes() -> int | None:
    """Peak resident set of this process (VmHWM)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def model_config(spec: dict, **extra: Any):
    """The one model config every system trains (random init, so rope_theta only fixes numerics):
    a Llama, or an MoE shape of bench/_shapes.py."""
    from _shapes import is_moe, moe_config
    from transformers import LlamaConfig

    m = spec["shape"]
    if is_moe(m):
        return moe_config(m, spec["seq"], **extra)
    cfg = LlamaConfig(
        hidden_size=m["hidden"],
        num_hidden_layers=m["layers"],
        num_attention_heads=m["heads"],
        num_key_value_heads=m["kv"],
        intermediate_size=m["ffn"],
        vocab_size=m["vocab"],
        max_position_embeddings=spec["seq"],
        rope_theta=500000.0,
        tie_word_embeddings=False,
        **extra,
    )
    cfg._attn_implementation = "sdpa"
    return cfg


def cuda_peak(res: Result) -> None:
    """The run's peak allocated GPU memory: megatrain's phases reset the allocator's counter at
    each phase's start (`phase_peaks`), so the peak is the largest of theirs and the counter's;
    the reserved peak is then the last phase's."""
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        phases = [v for v in res.data.get("phase_peaks", {}).values() if isinstance(v, int)]
        res.data["gpu_peak_bytes"] = max([torch.cuda.max_memory_allocated(), *phases])
        res.data["gpu_reserved_peak_bytes"] = torch.cuda.max_memory_reserved()


def drain(tr) -> None:
    """Wait for the pending optimizer updates: `transport.wait_updates()`, i.e. `synchronize()`
    without its copy of device-resident state back to host memory, which only checkpoints need
    (it would inflate the measured tail)."""
    getattr(tr, "wait_updates", tr.synchronize)()
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def step_stats(times: list[float], warmup: int) -> dict[str, Any]:
    meas = times[warmup:] or times
    return {"step_times": times, "step_s": sum(meas) / len(meas), "step_median_s": statistics.median(meas)}


# ---------------------------------------------------------------------------------------- megatrain
def run_megatrain(spec: dict, res: Result) -> None:
    from megatrain.config import parse_size
    from megatrain.data.batch import MicroBatch
    from megatrain.engine.optim import AdamWConfig, chunk_ranges
    from megatrain.host.moments import resolve
    from megatrain.models.config import ModelConfig
    from megatrain.parallel.processgroup import start
    from megatrain.planning.placement import Batch, Choices, phase_peaks, unit_peaks
    from megatrain.planning.probe import layer_memory_for
    from megatrain.runtime import build_model, make_plan

    cuda = torch.cuda.is_available()
    if not cuda and not spec["smoke"]:
        raise BenchError("CUDA not available")
    dev, dtype = ("cuda", "bfloat16") if cuda else ("cpu", "float32")
    # Under torchrun (bench/multigpu.py): data parallel, each rank a share of the step's micro-batches.
    # The data-parallel design under test (bench/multigpu.py --designs; layout.py).
    world, dev = start(torch.device(dev), 900, spec.get("ddp_traffic", "auto"), spec.get("nnodes"))
    mcfg = ModelConfig.from_hf(model_config(spec))
    t0 = time.perf_counter()
    # The placement `megatrain train` would choose for this step shape on this machine.
    gpu_state = "off" if spec["system"] == "megatrain-host" else "auto"
    size = lambda k: parse_size(spec[k]) if spec.get(k) else None  # noqa: E731
    accum = spec["tokens_per_step"] // spec["seq"] // spec["mbs"] // world.world_size
    moments = resolve(spec.get("optim", "adamw_torch"), spec.get("optim_args"))  # records before: fp32
    plan, machine = make_plan(
        mcfg,
        dev,
        getattr(torch, dtype),
        batch_size=spec["mbs"],
        seq_len=spec["seq"],
        grad_accum=accum,
        choices=Choices(
            gpu_state=gpu_state,
            gpu_step_units=_step_units(spec.get("gpu_step_units", "0")),
            # records before the key: none fetched the rows
            embedding_rows=_tristate(spec.get("embedding_rows", "false")),
            keep_layers=spec.get("keep_layers"),
            update_order=spec.get("update_order", "auto"),
            fetch_both_halves=bool(spec.get("fetch_both_halves")),
            moments=moments.name,
        ),
        max_gpu_memory=size("max_gpu_memory"),
        max_host_memory=size("max_host_memory"),
        world=world.layout,
    )
    # the machine the plan was made for: with the probe's layer (below), enough to replay the plan
    res.update(plan=plan.to_json(), machine=dataclasses.asdict(machine))
    if cuda:  # each phase's predicted peak (the plan's probe reused; its tiled layer probed for the record)
        tokens, dt = spec["mbs"] * spec["seq"], getattr(torch, dtype)
        batch = Batch(tokens, accum, spec["seq"], dt.itemsize, True, rows=spec["mbs"])
        lm = layer_memory_for(mcfg, dev, dt, None, tokens)
        res.update(
            phase_predicted=phase_peaks(mcfg, batch, plan, lm, world.layout),
            unit_predicted=unit_peaks(mcfg, batch, plan, lm, world.layout),
            layer_mem=lm.__dict__,
        )
    model = build_model(
        mcfg,
        seed=0,
        device=dev,
        compute_dtype=dtype,
        adamw=AdamWConfig(lr=LR, betas=BETAS, weight_decay=0.0, moments=moments),
        plan=plan,
        machine=machine,
        collective=world,
    )
    eng, tr, state = model.engine, model.transport, model.state
    if cuda:  # filled as the run goes: a run that dies keeps the phase it died in
        res.data["phase_peaks"], res.data["unit_peaks"], _ = instrument_phases(eng)
    res.update(params=state.num_params, init_s=time.perf_counter() - t0, compute_dtype=dtype)

    # The unhidden cost of the optimizer: AdamW over the whole real state in the chunks the
    # transport uses, zero gradients (state unchanged: m, v stay 0 and the update is 0/(0+eps)).
    # The first pass also first-touches the moment pages, so the second is the steady figure.
    chunk = getattr(tr, "chunk_elems", 32 * 2**20)
    zero = torch.zeros(chunk)
    opt_times = []
    for _ in range(2):
        t = time.perf_counter()
        for u in state.units:
            for a, b in chunk_ranges(u, chunk, model.optimizer.span(u)):  # this rank's share
                model.optimizer.step_range(u, a, b, zero[: b - a], LR, 1)
        opt_times.append(time.perf_counter() - t)
    del zero
    res.update(opt_first_s=opt_times[0], opt_s=opt_times[1])

    T, S, mbs = spec["tokens_per_step"], spec["seq"], spec["mbs"]
    W, N = spec["warmup"], spec["steps"] - spec["warmup"]
    gen = torch.Generator().manual_seed(0)

    def batches() -> list:
        out = []
        for _ in range(T // S // mbs // world.world_size):
            ids = torch.randint(0, mcfg.vocab_size, (mbs, S), generator=gen)
            out.append(MicroBatch(ids.pin_memory() if cuda else ids, ids))
        return out

    data = [batches() for _ in range(spec["steps"] + 3)]
    it = iter(data)
    losses: list[float] = []
    fb_count = 0

    def fb() -> torch.Tensor | None:
        """Forward + backward + global norm; norm.item() is the one host sync of a step."""
        nonlocal fb_count
        loss, _ = eng.forward_backward(next(it))
        norm, coef = eng.clip_grad_norm(CLIP)
        norm.item()
        fb_count += 1
        losses.append(loss.item())  # already computed: the sync above covered it
        return coef

    # Steady state: step k's optimizer runs on the host while step k+1 computes, so a step is the
    # wall time between consecutive norm.item() returns.
    # The engine tunes itself in its first steps (GPU-resident units, kept layer graphs); the
    # schedule in force at each step is recorded, so warm-up can be checked to cover it.
    times: list[float] = []
    schedule: list[dict[str, int]] = []
    counted: list[tuple[float, int, float]] = []
    sched: list = []  # each thread's CPU and run-queue time at the same two points (_sched.py)
    t_prev = time.perf_counter()
    for i in range(W + N):
        coef = fb()
        t = time.perf_counter()
        times.append(t - t_prev)
        t_prev = t
        if i in (W - 1, W + N - 1):  # each pass of the timed steps' optimizer is done, none begun
            counted.append(_host_counters(tr))
            sched.append(sched_snapshot())
        eng.step(LR, coef)
        schedule.append(_tuning(eng, tr))
        res.update(**step_stats(times, W), losses=losses, schedule_per_step=schedule)
    # In steady state each interval already contains the wait for the previous step's optimizer;
    # the last step's optimizer would overlap the next step, so its tail is recorded, not charged.
    drain(tr)
    res.update(**step_stats(times, W), **schedule[-1], optimizer_tail_s=time.perf_counter() - t_prev)
    if len(counted) == 2:
        (s0, p0, w0, r0, q0, c0), (s1, p1, w1, r1, q1, c1) = counted
        res.update(
            host_adam_s=(s1 - s0) / N,
            host_adam_params_s=(p1 - p0) / (s1 - s0) if s1 > s0 else None,
            update_wait_s=(w1 - w0) / N,
            rows_ahead_s=(r1 - r0) / N,
            rows_wait_s=(q1 - q0) / N,
            rows_copy_wait_s=(c1 - c0) / N,
            threads_per_step=sched_per_step(*sched, N),
        )
    if cuda:  # times the allocator freed its cache to serve a request (each synchronises the device)
        res.update(alloc_retries=torch.cuda.memory_stats().get("num_alloc_retries", 0))
    # Bytes per step from the transport's counters (the CPU transport has none). After the
    # synchronize every forward-backward so far has also had its optimizer update.
    h2d, d2h = getattr(tr, "h2d_bytes", None), getattr(tr, "d2h_bytes", None)
    if h2d is not None and d2h is not None:  # the GPU-stepped units' state included
        stepper = getattr(tr, "stepper", None)
        h2d, d2h = h2d + getattr(stepper, "h2d_bytes", 0), d2h + getattr(stepper, "d2h_bytes", 0)
        res.update(h2d_bytes_per_step=h2d / fb_count, d2h_bytes_per_step=d2h / fb_count)

    # GPU occupancy of one steady-state step: the interval the timed steps measure, from one
    # norm.item() to the next, so the previous step's update (its GPU-stepped units' kernels and
    # write-backs, queued by eng.step) is inside it, beside this step's forward-backward.
    if cuda:
        warm_profiler()
        box: dict[str, Any] = {"coef": fb()}

        def interval() -> None:
            eng.step(LR, box["coef"])
            box["coef"] = fb()

        res.update(**profile_busy(interval, spec.get("trace")))
        eng.step(LR, box["coef"])
        drain(tr)
    else:
        res.update(gpu_busy=None, gpu_busy_note="no CUDA")

    # One serial step: nothing pending before it, synchronize right after the optimizer. Its two
    # halves are the compute of a step and the full optimizer pass (D2H + AdamW) left exposed.
    t0 = time.perf_counter()
    coef = fb()
    t1 = time.perf_counter()
    eng.step(LR, coef)
    drain(tr)
    t2 = time.perf_counter()
    serial_fb, serial_opt = t1 - t0, t2 - t1
    hidden = (serial_fb + serial_opt - res.data["step_median_s"]) / serial_opt if serial_opt > 0 else None
    res.update(
        serial_fb_s=serial_fb,
        serial_opt_s=serial_opt,
        opt_hidden_frac=None if hidden is None else max(0.0, min(1.0, hidden)),
        losses=losses,
    )
    tr.synchronize()  # the full API call once, untimed: it must work too
    cuda_peak(res)
    model.close()


def _host_counters(tr) -> tuple[float, int, float, float, float, float]:
    """The transport's host AdamW seconds and parameters so far, its launching thread's wait for
    updates, and the worker's seconds on the embedding's rows: computing them (`rows_s`, part of
    the AdamW's) and waiting before it, for their post and for their gradient's copy
    (`rows_wait_s`, `rows_copy_wait_s`, part of none)."""
    c = tr.counters
    return c.adam_s, c.params, c.wait_s, c.rows_s, c.rows_wait_s, c.rows_copy_wait_s


def _tristate(value) -> bool | None:
    """embedding_rows from a spec: auto (None), true or false (records before auto: a bool)."""
    return value if isinstance(value, bool) else {"auto": None, "true": True, "false": False}[value]


def _step_units(value: str) -> int | None:
    """bench.py's --gpu-step-units as placement.Choices takes it (None: the plan's choice)."""
    return None if str(value) == "auto" else int(value)


def _tuning(eng, tr) -> dict[str, int]:
    """What megatrain's plan chose: layers whose graphs are kept (not recomputed), units whose
    fp32 state lives on the GPU (stepped there, never copied), gradients and activations."""
    resident = getattr(tr, "resident", None) or {}
    units = eng.state.units
    return {
        "keep_layers": int(eng.plan.keep_layers),
        "update_order": eng.plan.update_order,
        "gpu_resident_units": len(resident),
        "gpu_resident_params": sum(units[i].numel for i in resident),
        "grad_mode": eng.plan.grad_mode,
        "gpu_grad_units": eng.plan.gpu_grad_units,
        "parked_layers": eng.plan.parked_layers,
        "gpu_stepped_units": eng.plan.gpu_stepped_units,
    }


# ---------------------------------------------------------------------------------------- deepspeed
def zero3(offload: bool = True) -> dict[str, Any]:
    """The DeepSpeed baselines' ZeRO-3 section: with `offload`, parameters and optimizer state live in
    pinned host memory (CPUAdam steps there); without, both stay on the GPU."""
    z: dict[str, Any] = {"stage": 3}
    if offload:
        z["offload_param"] = {"device": "cpu", "pin_memory": True}
        z["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    return z | {
        "overlap_comm": True,
        "contiguous_gradients": True,
        "stage3_prefetch_bucket_size": 5e8,
        "stage3_param_persistence_threshold": 1e5,
        "stage3_max_live_parameters": 1e9,
        "stage3_max_reuse_distance": 1e9,
    }


def single_process_env(port: int = 29511) -> None:
    """torch.distributed's rendezvous for one process outside a launcher (DeepSpeed needs a group)."""
    env = {
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "RANK": "0",
        "WORLD_SIZE": "1",
        "LOCAL_RANK": "0",
    }
    for k, v in env.items():
        os.environ.setdefault(k, v)


def run_deepspeed(spec: dict, res: Result) -> None:
    """Mirrors /work/shared/reference-probes/ds_baseline.py, plus gradient accumulation."""
    require_cuda()
    import deepspeed
    from transformers import AutoModelForCausalLM

    res.data.setdefault("versions", {})["deepspeed"] = deepspeed.__version__
    single_process_env()
    deepspeed.init_distributed()
    cfg = model_config(spec, torch_dtype="bfloat16")
    mbs, S = spec["mbs"], spec["seq"]
    gas = spec["tokens_per_step"] // S // mbs // int(os.environ["WORLD_SIZE"])  # per GPU
    ds = {
        "train_micro_batch_size_per_gpu": mbs,
        "gradient_accumulation_steps": gas,
        "bf16": {"enabled": True},
        "gradient_clipping": CLIP,
        "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "weight_decay": 0.0}},
        "zero_optimization": zero3(),
        "wall_clock_breakdown": False,
        "steps_per_print": 10**9,
    }
    t0 = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=ds, dtype=torch.bfloat16):
        model = AutoModelForCausalLM.from_config(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    nparam = sum(p.ds_numel for p in model.parameters())
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds)
    res.update(params=nparam, init_s=time.perf_counter() - t0, grad_accum=gas, ds_config=ds)

    losses: list[float] = []

    def step() -> None:
        # DeepSpeed runs the optimizer inside engine.step() at the accumulation boundary.
        xs = [torch.randint(0, cfg.vocab_size, (mbs, S), device=DEVICE) for _ in range(gas)]
        for x in xs:
            loss = engine(input_ids=x, labels=x).loss
            engine.backward(loss)
            engine.step()
        sync()
        losses.append(loss.item())

    _timed_steps(spec, res, step, losses)
    # Optimizer steps DeepSpeed took: one per `step()` call proves the accumulation boundaries.
    res.update(
        ds_global_steps=engine.global_steps,
        ds_optimizer=type(getattr(engine.optimizer, "optimizer", engine.optimizer)).__name__,
    )


# ---------------------------------------------------------------------------------------- resident
def run_resident(spec: dict, res: Result) -> None:
    """Mirrors /work/shared/reference-probes/resident.py, plus gradient accumulation."""
    require_cuda()
    from transformers import AutoModelForCausalLM

    cfg = model_config(spec)
    mbs, S = spec["mbs"], spec["seq"]
    gas = spec["tokens_per_step"] // S // mbs
    t0 = time.perf_counter()
    with torch.device(DEVICE):
        model = AutoModelForCausalLM.from_config(cfg)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    n = sum(p.numel() for p in model.parameters())
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, weight_decay=0.0, fused=True)
    res.update(params=n, init_s=time.perf_counter() - t0, grad_accum=gas)
    losses: list[float] = []

    def step() -> None:
        xs = [torch.randint(0, cfg.vocab_size, (mbs, S), device=DEVICE) for _ in range(gas)]
        total = torch.zeros((), device=DEVICE)
        for x in xs:
            with torch.autocast(DEVICE, dtype=torch.bfloat16):
                loss = model(input_ids=x, labels=x).loss / gas
            loss.backward()
            total += loss.detach()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        losses.append(total.item())

    _timed_steps(spec, res, step, losses)


def _timed_steps(spec: dict, res: Result, step: Callable[[], None], losses: list[float]) -> None:
    """Synchronous baselines: each step ends with a device sync, so it is timed on its own."""
    times: list[float] = []
    for _ in range(spec["steps"]):
        sync()
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
        res.update(**step_stats(times, spec["warmup"]), losses=losses)
    warm_profiler()  # after the timed steps: profiling cannot perturb them
    res.update(**profile_busy(step, spec.get("trace")))
    cuda_peak(res)


# ---------------------------------------------------------------------------------------- main
def classify(e: BaseException) -> tuple[str, str | None]:
    """(error, detail): one stable line per kind of failure, the traceback as detail."""
    detail = "".join(traceback.format_exception(type(e), e, e.__traceback__))[-4000:]
    msg = f"{type(e).__name__}: {e}"
    if isinstance(e, BenchError):
        return str(e), None
    if (
        isinstance(e, torch.OutOfMemoryError)
        or "CUDA out of memory" in msg
        or "CUDA error: out of memory" in msg
    ):
        return "out of GPU memory", detail
    if isinstance(e, MemoryError) or "can't allocate memory" in msg:
        return "out of host memory", detail
    return msg.splitlines()[0][:500] if msg.strip() else type(e).__name__, detail


def main() -> None:
    with open(sys.argv[1]) as f:
        spec = json.load(f)
    try:  # if the host runs out of memory, the kernel should kill this worker, not the parent
        with open("/proc/self/oom_score_adj", "w") as f:
            f.write("1000")
    except OSError:
        pass
    import transformers

    # Under torchrun every rank runs this; the first one's record is the result.
    rank = int(os.environ.get("RANK", "0"))
    path = spec["result_path"] if rank == 0 else f"{spec['result_path']}.rank{rank}"
    res = Result(path, error=None, versions={"torch": torch.__version__})
    res.data["versions"]["transformers"] = transformers.__version__
    try:
        if torch.cuda.is_available():
            res.data["gpu"] = torch.cuda.get_device_name(0)
            res.data["versions"]["cuda"] = torch.version.cuda
    except Exception as e:  # a broken driver shows up again, with its message, in the run itself
        res.data["gpu"] = f"unknown ({e!r})"[:200]
    res.update(pid=os.getpid(), grad_accum=spec["tokens_per_step"] // spec["seq"] // spec["mbs"])
    runner = {
        "megatrain": run_megatrain,
        "megatrain-host": run_megatrain,
        "deepspeed": run_deepspeed,
        "resident": run_resident,
    }
    ok = True
    try:
        from megatrain.determinism import full_determinism

        megatrain = spec["system"].startswith("megatrain")
        with full_determinism(megatrain and spec.get("full_determinism", False)):
            runner[spec["system"]](spec, res)
    except BaseException as e:  # recorded, never raised: the parent reads the file
        ok = False
        res.data["error"], res.data["error_detail"] = classify(e)
        print(res.data.get("error_detail") or res.data["error"], file=sys.stderr)
    with contextlib.suppress(Exception):
        cuda_peak(res)
    res.update(host_peak_rss_bytes=vm_hwm_bytes())
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: NCCL / DeepSpeed / pinned-memory destructors can hang or crash.
    os._exit(0 if ok else 1)


if __name__ == "__main__":
    main()
