"""The memory plan of a run, before anything is allocated: `megatrain plan` prints it, `train`
makes the same plan and refuses a run that no placement fits, naming the settings that would.

The decisions and the memory model are placement.py's; this module turns a training config into
its inputs (the largest step: rows padded to max_length), reports the result, and searches the
batch settings for the largest that fit (`limits`) and the longest sequence a step of one
sequence may have (`longest_context`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path

from .checks import beyond_positions
from .errors import MegatrainError
from .host.disk import measure_rates
from .io.writing import free_bytes
from .models.attention import span, uses_mask
from .models.config import ModelConfig
from .models.family import describe
from .objectives.grpo import reference_copy_bytes
from .parallel.layout import Layout
from .planning.footprint import rollout_bytes
from .planning.placement import Batch, Choices, Machine, Plan, PlanError, fmt_bytes
from .planning.placement import plan as make_placement

# Compressed text is about a quarter of its JSON; Arrow holds the strings without JSON's keys.
DATA_BYTES_PER_FILE_BYTE = {".parquet": 40, ".gz": 50, ".zst": 50, ".arrow": 15}
DATA_BYTES_DEFAULT = 12  # host bytes per byte of JSON/JSONL once tokenized (Python lists of ints)
KNOBS = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_length")


class InsufficientMemory(MegatrainError):
    """No placement of the run fits the memory it may use."""


def batch_of(
    cfg, model_cfg: ModelConfig, compute_bytes: int, attention_span: float | None = None, **knobs: int
) -> Batch:
    """The largest optimizer step of a training config (knobs override its batch settings);
    `attention_span` as the packed data gives it (`attention.span`), None: whole rows (under the
    model's windows)."""
    k = {name: knobs.get(name, getattr(cfg, name)) for name in KNOBS}
    if attention_span is None:
        attention_span = span([k["max_length"]], model_cfg.windows)
    # A preference sample is several sequences (a pair: two): rows of their own, or one packed row.
    g = cfg.preference().sequences if cfg.preference() else 1
    rows, seq_len = k["per_device_train_batch_size"] * g, k["max_length"]
    if (grpo := cfg.grpo()) is not None:  # a row: a prompt and a completion sampled for it
        seq_len = (cfg.max_prompt_length or k["max_length"]) + grpo.max_completion_length
    if cfg.packing:
        rows, seq_len = rows // g, seq_len * g
    return Batch(
        micro_batch_tokens=rows * seq_len,
        micro_batches=k["gradient_accumulation_steps"],
        seq_len=seq_len,
        compute_bytes=compute_bytes,
        clip=cfg.max_grad_norm > 0,
        masked=uses_mask(bool(cfg.packing), model_cfg.sliding_window, seq_len) or model_cfg.needs_mask,
        rows=rows,
        attention_span=attention_span,
    )


def choices_of(cfg) -> Choices:
    return Choices(
        gpu_state=cfg.gpu_state,
        gradient_placement=cfg.gradient_placement,
        offload_activations=cfg.offload_activations,
        mlp_tile_tokens=cfg.mlp_tile_tokens,
        gpu_step_units=None if cfg.gpu_step_units == "auto" else cfg.gpu_step_units,
    )


def machine_of(cfg, device, world: Layout | None = None) -> Machine:
    """The budgets of a training config on `device` (its max_gpu_memory / max_host_memory caps,
    else what is free now), one machine of `world` (default: the world the config describes,
    nnodes x nproc_per_node processes)."""
    from .config import parse_size
    from .planning.placement import measure

    def size(v):
        return None if v is None else parse_size(v)

    machine = measure(device, size(cfg.max_gpu_memory), size(cfg.max_host_memory), world or cfg.world())
    if cfg.offload_dir is None:
        return machine
    room = size(cfg.max_disk_memory) or free_bytes(Path(cfg.offload_dir))
    rates = measure_rates(cfg.offload_dir)
    return replace(
        machine,
        disk_bytes=room,
        disk_read_bytes_s=rates.read_bytes_s,
        disk_write_bytes_s=rates.write_bytes_s,
        disk_duplex_bytes_s=rates.duplex_bytes_s,
        disk_direct=rates.direct,
    )


@dataclass
class Check:
    plan: Plan | None
    machine: Machine
    problem: str | None
    """Why nothing fits, with the settings that would (None when the run fits)."""

    @property
    def fits(self) -> bool:
        return self.problem is None


def check(
    model_cfg: ModelConfig,
    cfg,
    machine: Machine,
    compute_bytes: int,
    data: int = 0,
    layer_mem=None,
    attention_span: float | None = None,
) -> Check:
    """Plan the run; when nothing fits, name the largest value of each batch knob that would.
    `layer_mem`: the layer's activation memory as probe.py measured it (None: the formula)."""
    machine = _less_data(machine, data)

    attempt = _attempt(model_cfg, cfg, machine, compute_bytes, layer_mem, attention_span)
    try:
        return Check(attempt(), machine, None)
    except PlanError as e:
        fixes = []
        for name in KNOBS:
            best = _largest_fitting(lambda v, name=name: _fits(attempt, **{name: v}), getattr(cfg, name) - 1)
            if best:
                fixes.append(f"{name}={best}")
        hint = (
            "would fit with " + " or ".join(fixes)
            if fixes
            else "no batch setting fits: use a machine with more memory or a smaller model"
        )
        return Check(None, machine, f"{e}; {hint}")


def limits(
    model_cfg: ModelConfig, cfg, machine: Machine, compute_bytes: int, layer_mem=None
) -> dict[str, int | None]:
    """The largest value of each batch knob (the others as configured) that a placement fits
    (searched up to 2**24)."""
    attempt = _attempt(model_cfg, cfg, machine, compute_bytes, layer_mem)
    out = {}
    for name in KNOBS:
        out[name] = _largest(lambda v, name=name: _fits(attempt, **{name: v}), getattr(cfg, name))
    return out


def longest_context(
    model_cfg: ModelConfig, cfg, machine: Machine, compute_bytes: int, layer_mem=None
) -> tuple[int, Plan] | None:
    """The most tokens one sequence may have (one sequence per optimizer step, the other settings
    as configured) that a placement fits, with that placement; None when not even one token fits.
    MLP tiles and parked activations count as the plan would choose them."""
    attempt = _attempt(model_cfg, cfg, machine, compute_bytes, layer_mem)
    one = dict(per_device_train_batch_size=1, gradient_accumulation_steps=1)
    n = _largest(lambda v: _fits(attempt, max_length=v, **one), cfg.max_length)
    return None if n is None else (n, attempt(max_length=n, **one))


def context_line(model_cfg: ModelConfig, cfg, machine: Machine, compute_bytes: int, layer_mem=None) -> str:
    """`megatrain plan`'s answer to "how long may a sequence be on this machine"."""
    found = longest_context(model_cfg, cfg, machine, compute_bytes, layer_mem)
    if found is None:
        return "longest context: none (not one token per sequence fits)"
    n, p = found
    how = [f"MLP tiles of {p.mlp_tile_tokens:,} tokens" if 0 < p.mlp_tile_tokens < n else "MLP untiled"]
    if p.device == "cuda":
        layers = model_cfg.num_hidden_layers
        how.append(f"{p.parked_layers} of {layers} layers' boundary activations in host memory")
    how.append(f"gradients {p.grad_mode}")
    if p.device == "cuda":
        how.append(f"GPU peak ~{fmt_bytes(p.gpu_peak)}")
    how.append(f"host ~{fmt_bytes(p.host_total)}")
    caveat = beyond_positions(n, model_cfg)
    line = f"longest context: {n:,} tokens per sequence (one sequence per step; {', '.join(how)})"
    return line + (f"; {caveat}" if caveat else "")


def rollout_memory(cfg, model_cfg: ModelConfig, compute_bytes: int, **knobs: int) -> dict[str, int]:
    """stage grpo: the GPU memory a step's rollout adds, by part (footprint.rollout_bytes); the
    training plan gets the GPU less this. Empty for the other stages. `knobs` as in batch_of."""
    if (grpo := cfg.grpo()) is None:
        return {}
    k = {name: knobs.get(name, getattr(cfg, name)) for name in KNOBS}
    rows = k["per_device_train_batch_size"] * k["gradient_accumulation_steps"]
    prompt = cfg.max_prompt_length or k["max_length"]
    return rollout_bytes(model_cfg, rows, prompt, grpo.max_completion_length, compute_bytes)


def _less_rollout(machine: Machine, rollout: dict[str, int]) -> Machine:
    """The machine a grpo run's training plan gets: the GPU less its rollout's memory."""
    need = sum(rollout.values())
    if not need or machine.device != "cuda" or machine.gpu_bytes is None:
        return machine
    if need >= machine.gpu_bytes:
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in rollout.items())
        raise PlanError(f"GPU memory: the rollout alone needs ~{fmt_bytes(need)} ({parts}), "
                        f"{fmt_bytes(machine.gpu_bytes)} available")  # fmt: skip
    return replace(machine, gpu_bytes=machine.gpu_bytes - need)


def _attempt(model_cfg: ModelConfig, cfg, machine: Machine, compute_bytes: int, layer_mem, span=None):
    """The placement of `cfg` with some batch knobs changed (PlanError when none fits)."""

    extra = stage_host_memory(cfg, model_cfg, compute_bytes, machine.world)
    host = (
        machine
        if not extra or machine.host_bytes is None
        else replace(machine, host_bytes=machine.host_bytes - sum(extra.values()))
    )

    def attempt(**knobs: int) -> Plan:
        batch = batch_of(cfg, model_cfg, compute_bytes, span, **knobs)
        trains_on = _less_rollout(host, rollout_memory(cfg, model_cfg, compute_bytes, **knobs))
        p = make_placement(model_cfg, batch, trains_on, choices_of(cfg), layer_mem)
        return replace(p, host={**p.host, **extra}) if extra else p

    return attempt


def stage_host_memory(cfg, model_cfg: ModelConfig, compute_bytes: int, world: Layout) -> dict[str, int]:
    """Host memory a stage keeps beside the plan's on one machine of `world`: grpo's reference
    weights (a KL term, beta > 0) in the compute dtype, a copy per process."""
    ref = reference_copy_bytes(model_cfg.num_params, compute_bytes, cfg.grpo())
    return {"reference weights (grpo, beta > 0)": ref * world.ranks_per_machine} if ref else {}


def _largest(fits, start: int) -> int | None:
    """Largest v with fits(v), doubling from `start` (up to 2**24), then bisecting."""
    hi = max(1, start)
    while hi < 2**24 and fits(2 * hi):
        hi *= 2
    return _largest_fitting(fits, 2 * hi)


def _less_data(machine: Machine, data: int) -> Machine:
    """`plan` counts the tokenized dataset (in `train` it already sits in memory)."""
    if not data or machine.host_bytes is None:
        return machine
    return replace(machine, host_bytes=machine.host_bytes - data)


def _fits(attempt, **knobs: int) -> bool:
    try:
        attempt(**knobs)
        return True
    except PlanError:
        return False


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


def layer_memory(model_cfg: ModelConfig, cfg, device, compute_bytes: int):
    """One layer's activation memory measured on `device` (None where no CUDA device is there to
    measure it: the formula; on the CPU, the formula with this CPU's FLOP rate)."""
    import torch

    from .planning.probe import layer_memory_for

    dtype = torch.bfloat16 if compute_bytes == 2 else torch.float32
    tokens = cfg.per_device_train_batch_size * cfg.max_length
    masked = uses_mask(bool(cfg.packing), model_cfg.sliding_window, cfg.max_length)
    return layer_memory_for(model_cfg, device, dtype, cfg.torch_compile, tokens, masked)


def preflight(
    model_cfg: ModelConfig,
    cfg,
    device,
    compute_bytes: int,
    warn=print,
    world: Layout | None = None,
    attention_span: float | None = None,
) -> tuple[Plan, Machine]:
    """The plan `train` runs under, on one machine of `world` (its part of a partitioned state).
    Raises InsufficientMemory with a one-line message when no placement fits; with
    preflight_check=false it warns and plans as if memory were unlimited. `attention_span`: the
    training data's (`Batcher.attention_span`)."""
    machine = machine_of(cfg, device, world)
    layer_mem = layer_memory(model_cfg, cfg, device, compute_bytes)
    result = check(model_cfg, cfg, machine, compute_bytes, layer_mem=layer_mem, attention_span=attention_span)
    if result.fits:
        return result.plan, machine
    msg = result.problem + " (see `megatrain plan`; preflight_check=false runs anyway)"
    if cfg.preflight_check:
        raise InsufficientMemory(msg)
    warn(f"megatrain: warning: {msg}")
    unlimited = Machine(machine.device, world=machine.world)
    batch = batch_of(cfg, model_cfg, compute_bytes, attention_span)
    choices = replace(choices_of(cfg), gpu_state="off")
    return make_placement(model_cfg, batch, unlimited, choices, layer_mem), unlimited


def data_bytes(cfg) -> int:
    """Estimated host memory of the tokenized datasets (training and, when evaluating, eval),
    from their file sizes."""
    from .data.sources import resolve_dataset

    keys = ["dataset"] if cfg.dataset is not None else []
    if cfg.eval_strategy != "no":
        keys.append("eval_dataset")
    total = 0
    for f in (f for key in keys for f in resolve_dataset(cfg, key)):
        factor = DATA_BYTES_PER_FILE_BYTE.get(f.path.suffix, DATA_BYTES_DEFAULT)
        total += f.path.stat().st_size * factor
    return total


# ---------------------------------------------------------------------------- report
def _count(n: int) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.1f}M"


def report(
    model_cfg: ModelConfig, result: Check, device_name: str, dtype_name: str, cfg, data: int = 0
) -> str:
    """The text `megatrain plan` prints."""
    m = result.machine
    b = batch_of(cfg, model_cfg, 2 if dtype_name == "bfloat16" else 4)
    lines = [
        f"model: {model_cfg.model_type}, {_count(model_cfg.num_params)} parameters ({model_cfg.num_params:,}), "
        f"{model_cfg.num_hidden_layers} layers, hidden {model_cfg.hidden_size}, vocab {model_cfg.vocab_size}",
        f"runs on: {describe(model_cfg)}",
        f"device: {device_name}, {dtype_name} compute",
        f"tokens: {b.rows} x {b.seq_len} per micro-batch"
        + (f" ({cfg.per_device_train_batch_size} {cfg.stage} samples)" if cfg.preference() else "")
        + (" (completions: prompt + max_completion_length)" if cfg.stage == "grpo" else "")
        + ", "
        f"x {cfg.gradient_accumulation_steps} accumulation = {b.tokens:,} per optimizer step "
        "(upper bound: rows padded to max_length)",
        "budget: GPU "
        + (
            "unknown (no CUDA device visible here: set max_gpu_memory)"
            if m.device == "cuda" and m.gpu_bytes is None
            else f"{fmt_bytes(m.gpu_bytes)} ({'max_gpu_memory' if m.gpu_capped else 'free now'})"
            if m.device == "cuda"
            else "none (CPU run)"
        )
        + ", host "
        + ("unknown" if m.host_bytes is None else fmt_bytes(m.host_bytes + data))
        + (
            ""
            if cfg.max_host_memory is not None
            else " (MemAvailable: set max_host_memory to plan for another machine)"
        ),
    ]
    w = m.world
    if w.ranks > 1:
        lines.append(
            f"world: {w.ranks} processes on {w.machines} machine(s), {'sharded' if w.sharded else 'plain'} traffic"
            + (", host state partitioned (memory below: one machine's part)" if w.partitioned else "")
        )
    lines.append("")
    p = result.plan
    if p is None:
        lines.append("does not fit: " + result.problem)
        return "\n".join(lines)
    lines += [f"plan: {note}" for note in p.notes] or ["plan: all state in host memory"]
    rollout = rollout_memory(cfg, model_cfg, b.compute_bytes)
    if rollout and p.device == "cuda":
        parts = ", ".join(f"{k} {fmt_bytes(v)}" for k, v in rollout.items())
        lines.append(f"rollout: ~{fmt_bytes(sum(rollout.values()))} of the GPU kept for sampling ({parts}); "
                     "the memory below is the update's")  # fmt: skip
    lines.append("")
    if p.device == "cuda":
        lines.append("GPU memory at its peak (predicted torch.cuda.max_memory_allocated)")
        lines.extend(f"  {k:<50}{fmt_bytes(v):>12}" for k, v in p.gpu.items())
        lines.append(f"  {'total':<50}{fmt_bytes(p.gpu_peak):>12}")
    lines.append("host memory (growth of the resident set)")
    host = dict(p.host)
    if data:
        host["tokenized data (estimate)"] = data
    lines.extend(f"  {k:<50}{fmt_bytes(v):>12}" for k, v in host.items())
    lines.append(f"  {'total':<50}{fmt_bytes(sum(host.values())):>12}")
    if p.device == "cuda":
        lines.append(f"  {'of which page-locked':<50}{fmt_bytes(p.pinned):>12}")
    lines.append("")
    tps = b.tokens / p.step_time_s if p.step_time_s else 0
    lines.append(f"estimated step: {p.step_time_s:.2f} s ({tps:,.0f} tokens/s; a cost-model projection)")
    lines.append("fits")
    return "\n".join(lines)
