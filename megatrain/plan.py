"""Preflight memory estimate: will a run fit in host memory (and GPU memory) before anything is
allocated? `megatrain plan` prints it; `train` runs the same check and refuses a run that cannot
fit, naming the settings that would.

Everything is computed from the model config's shapes (ModelConfig.num_params) and the batch
settings; nothing is allocated. The constants:

* Host, CUDA runs: 13.0 bytes per parameter, the resident set megatrain measured on a 3.6B
  model (fp32 master weights and two AdamW moments are 12 B/param; the rest is the runtime),
  plus two pinned staging buffers for gradients (transport.StreamingTransport). The master
  weights themselves are page-locked in place, so the pinned total is 4 B/param + staging.
* Host, CPU runs: 12 B/param of state + 4 B/param fp32 gradients + the activations below +
  1 GiB for the Python/torch runtime.
* GPU: bf16 weight buffers of ~3 units in flight (the computing one and two prefetched) plus an
  fp32 staging copy of one; fp32 gradients of *all* units (4 B/param: they live on the GPU until
  the optimizer takes them after the backward sweep); the boundary activations the forward sweep
  keeps (tokens per step x hidden x layers); one layer's recompute working set (tokens per
  micro-batch x (10 hidden + 4 intermediate)); one loss chunk (at most 4 GiB of fp32 logits and
  their gradient); 512 MiB of allocator slack. Boundary activations move to page-locked host
  memory when `offload_activations` says so (auto: above a third of the GPU), as the engine does. Tokens are upper bounds (rows padded to
  max_length). Device-resident state (gpu_state=auto) only uses memory left over, so it is not
  counted.
* Tokenized data (`plan` only: in `train` the samples already sit in memory when it checks):
  ~12 bytes per byte of JSON/JSONL (Python lists of ints), ~40 per byte of Parquet.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from .errors import MegatrainError
from .models.config import ModelConfig

GiB, MiB = 2**30, 2**20
HOST_BYTES_PER_PARAM_CUDA = 13.0
CPU_RUNTIME_BYTES = 1 * GiB
STAGING_ELEMS = 32 * 2**20  # StreamingTransport's chunk_elems
UNITS_IN_FLIGHT = 3
GPU_SLACK_BYTES = 512 * MiB
LOSS_BUDGET = {"cuda": 2**32, "cpu": 2**30}  # Engine's logits budget per chunk
DATA_BYTES_PER_FILE_BYTE = {".parquet": 40}
DATA_BYTES_DEFAULT = 12


class InsufficientMemory(MegatrainError):
    """The preflight estimate says the run cannot fit."""


@dataclass
class Estimate:
    """Bytes needed, by component, for one run."""

    device: str
    """cpu or cuda."""
    params: int
    compute_bytes: int
    tokens_per_micro_batch: int
    tokens_per_step: int
    host: dict[str, int] = field(default_factory=dict)
    gpu: dict[str, int] = field(default_factory=dict)
    pinned: int = 0

    @property
    def host_total(self) -> int:
        return sum(self.host.values())

    @property
    def gpu_total(self) -> int:
        return sum(self.gpu.values())


def _largest_unit(cfg: ModelConfig) -> int:
    """Parameters of the largest streamed unit (embedding, a layer, or the head)."""
    h, V, L = cfg.hidden_size, cfg.vocab_size, max(1, cfg.num_hidden_layers)
    emb = V * h
    layer = (cfg.num_params - emb * (1 if cfg.tie_word_embeddings else 2) - h) // L
    head = h + (0 if cfg.tie_word_embeddings else emb)
    return max(emb, layer, head)


def estimate(
    cfg: ModelConfig,
    *,
    device: str,
    compute_bytes: int,
    batch: int,
    accum: int,
    max_length: int,
    data_bytes: int = 0,
    offload_activations: bool | None = None,
    gpu_bytes: int | None = None,
) -> Estimate:
    """The memory a run needs (see the module docstring for the model behind each number)."""
    P, h, L, V = cfg.num_params, cfg.hidden_size, cfg.num_hidden_layers, cfg.vocab_size
    mb_tokens = batch * max_length
    step_tokens = mb_tokens * accum
    est = Estimate(device, P, compute_bytes, mb_tokens, step_tokens)
    activations = {
        "boundary activations": step_tokens * h * compute_bytes * L,
        "one layer's recompute": mb_tokens * (10 * h + 4 * cfg.intermediate_size) * compute_bytes,
        "loss chunk": min(LOSS_BUDGET[device], mb_tokens * V * 8),
    }
    if device == "cuda":
        largest = _largest_unit(cfg)
        staging = 2 * min(STAGING_ELEMS, largest) * 4
        est.host["fp32 weights + AdamW moments + runtime"] = int(HOST_BYTES_PER_PARAM_CUDA * P)
        est.host["pinned gradient staging"] = staging
        est.pinned = 4 * P + staging
        fp32_stage = largest * 4 if compute_bytes != 4 else 0
        est.gpu["weight buffers"] = UNITS_IN_FLIGHT * largest * compute_bytes + fp32_stage
        est.gpu["fp32 gradients (all units)"] = 4 * P
        boundary = activations["boundary activations"]
        offload = offload_activations
        if offload is None:  # the engine's rule: when they would take more than a third of the card
            offload = gpu_bytes is not None and boundary > gpu_bytes / 3
        if offload:
            name = "boundary activations (page-locked)"
            est.host[name] = activations.pop("boundary activations")
            est.pinned += est.host[name]
        est.gpu.update(activations)
        est.gpu["allocator slack"] = GPU_SLACK_BYTES
    else:
        est.host["fp32 weights + AdamW moments"] = 12 * P
        est.host["fp32 gradients"] = 4 * P
        est.host.update(activations)
        est.host["runtime"] = CPU_RUNTIME_BYTES
    if data_bytes:
        est.host["tokenized data (estimate)"] = data_bytes
    return est


# ---------------------------------------------------------------------------- what is there
def host_available(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes (None where /proc/meminfo is not there)."""
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_available(device) -> int | None:
    """Free memory of a CUDA device in bytes (None without CUDA)."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def data_bytes(cfg) -> int:
    """Estimated host memory of the tokenized datasets (training and eval), from their file sizes."""
    from .data.sources import resolve_dataset

    files = resolve_dataset(cfg) + (resolve_dataset(cfg, "eval_dataset") if cfg.eval_strategy != "no" else [])
    total = 0
    for f in files:
        factor = DATA_BYTES_PER_FILE_BYTE.get(f.path.suffix, DATA_BYTES_DEFAULT)
        total += f.path.stat().st_size * factor
    return total


# ---------------------------------------------------------------------------- checking
@dataclass
class Check:
    estimate: Estimate
    host_available: int | None
    gpu_available: int | None
    problems: list[str]
    """One phrase per memory that is short; empty when the run fits (or nothing is known)."""

    @property
    def fits(self) -> bool:
        return not self.problems


def check(
    model_cfg: ModelConfig,
    cfg,
    device: str,
    device_name: str,
    compute_bytes: int,
    host_avail: int | None,
    gpu_avail: int | None,
    data: int = 0,
) -> Check:
    """Compare the estimate with what is available; for each shortfall, name the largest
    per_device_train_batch_size, gradient_accumulation_steps or max_length that would fit."""

    def est(batch: int, accum: int, length: int) -> Estimate:
        return estimate(
            model_cfg,
            device=device,
            compute_bytes=compute_bytes,
            batch=batch,
            accum=accum,
            max_length=length,
            data_bytes=data,
            offload_activations=getattr(cfg, "offload_activations", None),
            gpu_bytes=gpu_avail,
        )

    knobs = {
        "per_device_train_batch_size": cfg.per_device_train_batch_size,
        "gradient_accumulation_steps": cfg.gradient_accumulation_steps,
        "max_length": cfg.max_length,
    }
    base = est(*knobs.values())
    problems = []
    for what, total, avail, where in (
        ("host memory", lambda e: e.host_total, host_avail, "available (MemAvailable)"),
        ("GPU memory", lambda e: e.gpu_total, gpu_avail, f"free on {device_name}"),
    ):
        need = total(base)
        if avail is None or need == 0 or need <= avail:
            continue
        fixes = _fixes(est, knobs, total, avail)
        machine = "a machine" if what == "host memory" else "a GPU"
        hint = (
            "would fit with " + " or ".join(fixes)
            if fixes
            else f"no batch setting fits: use {machine} with more memory or a smaller model"
        )
        problems.append(f"not enough {what}: need ~{fmt_bytes(need)}, {fmt_bytes(avail)} {where}; {hint}")
    return Check(base, host_avail, gpu_avail, problems)


def _fixes(est, knobs: dict[str, int], total, avail: int) -> list[str]:
    """`knob=value` for each knob whose largest fitting value (others unchanged) exists."""
    out = []
    for name, value in knobs.items():

        def fits(v: int, name: str = name) -> bool:
            return total(est(*dict(knobs, **{name: v}).values())) <= avail

        best = _largest_fitting(fits, value - 1)
        if best:
            out.append(f"{name}={best}")
    return out


def _largest_fitting(fits, hi: int) -> int | None:
    """Largest v in [1, hi] with fits(v), for a fits() that is monotone (true below a limit)."""
    if hi < 1 or not fits(1):
        return None
    lo = 1
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(mid):
            lo = mid
        else:
            hi = mid - 1
    return lo


def preflight(model_cfg: ModelConfig, cfg, device, compute_bytes: int, warn=print) -> Check:
    """The check `train` runs before allocating: raises InsufficientMemory with a one-line
    message when the run cannot fit (only warns with preflight_check=false)."""
    gpu = gpu_available(device) if device.type == "cuda" else None
    result = check(model_cfg, cfg, device.type, str(device), compute_bytes, host_available(), gpu)
    if not result.fits:
        msg = (
            "; ".join(result.problems)
            + " (estimate: see `megatrain plan`; preflight_check=false runs anyway)"
        )
        if cfg.preflight_check:
            raise InsufficientMemory(msg)
        warn(f"megatrain: warning: {msg}")
    return result


# ---------------------------------------------------------------------------- report
def fmt_bytes(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def report(model_cfg: ModelConfig, result: Check, device_name: str, dtype_name: str, cfg) -> str:
    """The table `megatrain plan` prints."""
    e = result.estimate
    lines = [
        f"model: {model_cfg.model_type}, {_count(e.params)} parameters ({e.params:,}), {model_cfg.num_hidden_layers} layers, "
        f"hidden {model_cfg.hidden_size}, vocab {model_cfg.vocab_size}",
        f"device: {device_name}, {dtype_name} compute",
        f"tokens: {cfg.per_device_train_batch_size} x {cfg.max_length} per micro-batch, "
        f"x {cfg.gradient_accumulation_steps} accumulation = {e.tokens_per_step:,} per optimizer step "
        "(upper bound: rows padded to max_length)",
        "",
    ]

    def table(title: str, parts: dict[str, int], total: int, avail: int | None, where: str) -> None:
        lines.append(title)
        lines.extend(f"  {k:<42}{fmt_bytes(v):>12}" for k, v in parts.items())
        have = f"{fmt_bytes(avail)} {where}" if avail is not None else f"unknown ({where})"
        verdict = "" if avail is None else ("  ok" if total <= avail else "  DOES NOT FIT")
        lines.append(f"  {'total':<42}{fmt_bytes(total):>12}   {have}{verdict}")

    table("host memory", e.host, e.host_total, result.host_available, "available (MemAvailable)")
    if e.device == "cuda":
        lines.append(f"  {'of which pinned (page-locked)':<42}{fmt_bytes(e.pinned):>12}")
        where = (
            f"free on {device_name}" if result.gpu_available is not None else "no CUDA device visible here"
        )
        table("GPU memory", e.gpu, e.gpu_total, result.gpu_available, where)
    lines.append("")
    lines.append("fits" if result.fits else "does not fit: " + "; ".join(result.problems))
    return "\n".join(lines)
