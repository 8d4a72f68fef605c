"""The memory plan of a run, before anything is allocated: `megatrain plan` prints it
(planreport.py), `train` makes the same plan and refuses a run that no placement fits, naming the
settings that would.

The decisions and the memory model are placement.py's; this module turns a training config into
its inputs (the largest step: rows padded to the stage's row length, `stages.row_length`) and
searches the stage's batch settings (`knobs_of`) for the largest that fit (`limits`) and the
longest sequence the smallest step may have (`longest_context`): for grpo, the longest
completion.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import ConfigError, MegatrainError
from .host.disk import measure_drives
from .host.moments import FORMATS, Moments
from .host.state import state_bytes
from .io.writing import free_bytes
from .models.attention import span, uses_mask
from .models.config import ModelConfig
from .objectives.grpo import reference_copy_bytes
from .parallel.layout import Layout
from .planning.footprint import STATE_KEY, reward_model_bytes, rollout_bytes, usable_host
from .planning.placement import Batch, Choices, Machine, Plan, PlanError, fmt_bytes, host_available
from .planning.placement import plan as make_placement
from .rl import rewards
from .stages import autograd_head, coupled, row_length

if TYPE_CHECKING:
    from .runtime import WeightsFill

# Compressed text is about a quarter of its JSON; Arrow holds the strings without JSON's keys.
DATA_BYTES_PER_FILE_BYTE = {".parquet": 40, ".gz": 50, ".zst": 50, ".arrow": 15}
DATA_BYTES_DEFAULT = 12  # host bytes per byte of JSON/JSONL once tokenized (Python lists of ints)
# The batch settings the searches change: a row is max_length tokens, but grpo's is a prompt and a
# completion (max_completion_length), sampled per_device_train_batch_size x steps_per_generation
# at a time (the rollout's batch). num_generations takes no memory: it only groups completions.
KNOBS = ("per_device_train_batch_size", "gradient_accumulation_steps", "max_length")
GRPO_KNOBS = (
    "per_device_train_batch_size", "gradient_accumulation_steps", "steps_per_generation", "max_completion_length",
)  # fmt: skip


class InsufficientMemory(MegatrainError):
    """No placement of the run fits the memory it may use."""


def batch_of(cfg, model_cfg: ModelConfig, compute_bytes: int, attention_span: float | None = None) -> Batch:
    """The largest optimizer step of a training config; `attention_span` as the packed data gives
    it (`attention.span`), None: whole rows (under the model's windows)."""
    seq_len = row_length(cfg)
    if attention_span is None:
        attention_span = span([seq_len], model_cfg.windows)
    # A preference sample is several sequences (a pair: two): rows of their own, or one packed row.
    g = cfg.preference().sequences if cfg.preference() else 1
    rows = cfg.per_device_train_batch_size * g
    if cfg.packing:
        rows, seq_len = rows // g, seq_len * g
    return Batch(
        micro_batch_tokens=rows * seq_len,
        micro_batches=cfg.gradient_accumulation_steps,
        seq_len=seq_len,
        compute_bytes=compute_bytes,
        clip=cfg.max_grad_norm > 0,
        # shared prompts (data/shared.py), in no more tokens: the fast families attend over the
        # unshared rows again (attention.SharedRows), transformers' own layers take the dense mask
        masked=uses_mask(bool(cfg.packing), model_cfg.sliding_window, seq_len)
        or model_cfg.needs_mask
        or (cfg.share_prompts and model_cfg.path == "generic"),
        rows=rows,
        autograd_head=autograd_head(cfg),
        attention_span=attention_span,
        coupled=coupled(cfg),
    )


def choices_of(cfg) -> Choices:
    return Choices(
        gpu_state=cfg.gpu_state,
        gradient_placement=cfg.gradient_placement,
        offload_activations=cfg.offload_activations,
        mlp_tile_tokens=cfg.mlp_tile_tokens,
        gpu_step_units=None if cfg.gpu_step_units == "auto" else cfg.gpu_step_units,
        embedding_rows=cfg.embedding_rows,
        moments=cfg.moments().name,
        update_order=cfg.update_order,
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
    # The tier striped over the folders' drives: their rates summed, and round-robin puts about
    # 1/N of its bytes in each, so the least room in one folder bounds it (max_disk_memory: all).
    folders = cfg.offload_dirs()
    rates = measure_drives(folders)
    room = size(cfg.max_disk_memory) or len(folders) * min(free_bytes(Path(d)) for d in folders)
    return replace(
        machine,
        disk_bytes=room,
        disk_folders=len(folders),
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
    machine = _less_host(machine, data)

    attempt = _attempt(model_cfg, cfg, machine, compute_bytes, layer_mem, attention_span)
    try:
        return Check(attempt(), machine, None)
    except PlanError as e:
        base = with_knobs(cfg, machine.world.ranks)
        fixes = [
            " ".join(f"{k}={v}" for k, v in f.settings.items())
            for f in leaner_formats(cfg)
            if _fits(
                _attempt(
                    model_cfg, replace(cfg, **_settings(f)), machine, compute_bytes, layer_mem, attention_span
                )
            )
        ][:1]  # the leanest would fit too: name the first
        fixes += [f"{k}={v}" for k in knobs_of(cfg) if (v := _search(attempt, base, k, below=True))]
        hint = (
            "would fit with " + " or ".join(fixes)
            if fixes
            else "no batch setting fits: use a machine with more memory or a smaller model"
        )
        return Check(None, machine, f"{e}; {hint}")


def leaner_formats(cfg) -> list[Moments]:
    """The moment formats (host/moments.py) leaner than the one `cfg`'s optim selects, the
    nearest first."""
    own = cfg.moments().bytes_per_param
    return sorted((f for f in FORMATS if f.bytes_per_param < own), key=lambda f: -f.bytes_per_param)


def _settings(f: Moments) -> dict[str, str | None]:
    """The config keys that select format `f` (optim_args cleared where it takes none)."""
    return {"optim_args": None, **f.settings}


def state_room(p: Plan, machine: Machine) -> int | None:
    """Host memory left for the state (fp32 master weights and moments) beside the rest of plan
    `p`'s host memory, under the machine's budget (None: no budget known)."""
    host = usable_host(machine)
    if host is None:
        return None
    return host - (p.host_total - p.host.get(STATE_KEY, 0))


def largest_models(p: Plan, machine: Machine) -> dict[Moments, int]:
    """The most parameters whose state each moment format holds in `state_room`: the largest
    model this host holds in each optimizer mode, its other buffers as this run's."""
    room = state_room(p, machine)
    if room is None:
        return {}
    return {f: max(0, int(room // state_bytes(f))) for f in FORMATS}


def knobs_of(cfg) -> tuple[str, ...]:
    """The batch settings `check`, `limits` and `megatrain plan` speak in, the stage's."""
    return GRPO_KNOBS if cfg.grpo() is not None else KNOBS


def length_knob(cfg) -> str:
    """The batch setting of the row length: max_length, or grpo's max_completion_length."""
    return knobs_of(cfg)[-1]


def limits(
    model_cfg: ModelConfig, cfg, machine: Machine, compute_bytes: int, layer_mem=None
) -> dict[str, int | None]:
    """The largest value of each of the stage's batch knobs (the others as configured) that a
    placement fits (searched up to 2**24 steps of its unit)."""
    attempt = _attempt(model_cfg, cfg, machine, compute_bytes, layer_mem)
    base = with_knobs(cfg, machine.world.ranks)
    return {name: _search(attempt, base, name, below=False) for name in knobs_of(cfg)}


def _search(attempt, cfg, name: str, below: bool) -> int | None:
    """The largest value of batch knob `name` (in steps of its unit) that `attempt` fits: below
    its value in `cfg` (what would fit), or from it up (how far it may go)."""
    unit = _unit(cfg, name)

    def fits(m: int) -> bool:
        return _fits(attempt, **{name: m * unit})

    start = _value(cfg, name)
    found = _largest_fitting(fits, (start - 1) // unit) if below else _largest(fits, start // unit)
    return None if found is None else found * unit


def smallest_step(cfg) -> dict[str, int]:
    """The smallest step of the stage: one sequence (one preference sample); for grpo one
    completion a step, of a generation batch of one group."""
    one = dict(per_device_train_batch_size=1, gradient_accumulation_steps=1)
    grpo = cfg.grpo()
    return one if grpo is None else one | dict(steps_per_generation=grpo.num_generations)


def longest_context(
    model_cfg: ModelConfig, cfg, machine: Machine, compute_bytes: int, layer_mem=None
) -> tuple[int, Plan] | None:
    """The most tokens one sequence may have (the smallest step, `smallest_step`, the other
    settings as configured) that a placement fits, with that placement; None when not even one
    token fits. For grpo, the most tokens a completion may have after a prompt of
    max_prompt_length. MLP tiles and parked activations count as the plan would choose them."""
    attempt = _attempt(model_cfg, cfg, machine, compute_bytes, layer_mem)
    one, name = smallest_step(cfg), length_knob(cfg)
    n = _largest(lambda v: _fits(attempt, **{name: v}, **one), _value(cfg, name))
    return None if n is None else (n, attempt(**{name: n}, **one))


def with_knobs(cfg, processes: int | None = None, **knobs: int):
    """`cfg` with some batch settings changed (checked again, as a config file's), its
    generation_batch_size, where set, given as the steps_per_generation it makes over `processes`
    (default: the config's world), so that the knobs are independent settings."""
    if cfg.generation_batch_size is not None:
        slices = cfg.grpo(processes).steps_per_generation
        cfg = replace(cfg, generation_batch_size=None, steps_per_generation=slices)
    return replace(cfg, **knobs) if knobs else cfg


def _value(cfg, name: str) -> int:
    """A batch knob's value in `cfg`, as the stage resolves it."""
    grpo = cfg.grpo()
    return getattr(grpo, name) if grpo is not None and hasattr(grpo, name) else getattr(cfg, name)


def _unit(cfg, name: str) -> int:
    """The step of a batch knob's values: 1, but a grpo generation batch holds whole groups (its
    per_device_train_batch_size x steps_per_generation a multiple of num_generations), and
    steps_per_generation follows gradient_accumulation_steps where it is not set."""
    grpo = cfg.grpo()
    if grpo is None:
        return 1
    g = grpo.num_generations
    if name == "per_device_train_batch_size":
        return g // math.gcd(g, grpo.steps_per_generation)
    if name == "steps_per_generation" or (
        name == "gradient_accumulation_steps" and cfg.steps_per_generation is None
    ):
        return g // math.gcd(g, grpo.per_device_train_batch_size)
    return 1


def rollout_memory(
    cfg,
    model_cfg: ModelConfig,
    compute_bytes: int,
    processes: int | None = None,
    resident_layers: int | None = None,
) -> dict[str, int]:
    """stage grpo: the GPU memory a rollout adds, by part (footprint.rollout_bytes), for the most
    completions a process samples at a time: a generation batch, per_device_train_batch_size x
    steps_per_generation (over `processes`: default, the config's world), or an evaluation's
    per_device_eval_batch_size, the policy's layers from `resident_layers` on streamed (a plan's
    `rollout_layers`); the training plan gets the GPU less this. Empty for the other stages."""
    if (grpo := cfg.grpo(processes)) is None:
        return {}
    rows = cfg.per_device_train_batch_size * grpo.steps_per_generation
    distinct = -(-rows // grpo.num_generations)
    if cfg.eval_strategy != "no" and cfg.per_device_eval_batch_size > rows:
        rows, distinct = (
            cfg.per_device_eval_batch_size,
            -(-cfg.per_device_eval_batch_size // grpo.num_generations_eval),
        )
    prompt = cfg.max_prompt_length or cfg.max_length
    completion = grpo.max_completion_length
    # The rollout engine prefills each distinct prompt once; `generate` every row.
    prefill = (
        min(rows, distinct + 1) if cfg.rollout_engine == "megatrain" else rows
    )  # a batch's edge splits a group
    parts = rollout_bytes(model_cfg, rows, prompt, completion, compute_bytes, resident_layers, prefill)
    scorers = [
        ModelConfig.from_json(rewards.model_config(spec)) for spec in rewards.model_dirs(cfg.reward_funcs)
    ]
    if scorers:  # on the device for the whole run: beside the update too
        parts["reward models"] = sum(
            reward_model_bytes(s, rows, prompt + completion, compute_bytes) for s in scorers
        )
    return parts


def rollout_split(update, cfg, layers: int, device: str) -> Plan:
    """The one rule for how many of the policy's `layers` decoder layers a grpo rollout keeps on
    the GPU (`Plan.rollout_layers`; None: all), given `update(resident)`, the update's plan beside
    such a rollout (PlanError where none fits). The rollout and the update take turns on the GPU,
    the update planned for the GPU less the rollout's room (`_less_rollout`): the whole policy
    where the update still fits beside it (every run that fitted before streaming existed keeps
    its plan), else the most layers that leave the update a plan that fits. Each layer kept saves
    its fetch over PCIe in every decode step (the master's bf16 half in bf16), so the rollout
    takes what it can; the update's plan makes the best of the rest. On the CPU every layer stays
    (nothing to save). `rollout_resident_layers: N` keeps N instead (every layer where N is more)."""
    cap = cfg.rollout_resident_layers
    if cfg.grpo() is None or (cap == "auto" and device != "cuda"):
        return update(None)
    if cap != "auto":
        return update(cap if cap < layers else None)
    with contextlib.suppress(PlanError):
        return update(None)
    # Fewer resident layers leave the update more: the largest count that fits, bisected (v = r + 1).
    # Where none does, the error is that of every layer streamed, the least the rollout can take.
    best = _largest_fitting(lambda v: _fits(update, resident=v - 1), layers)
    return update(0 if best is None else best - 1)


def with_rollout(p: Plan, resident: int | None) -> Plan:
    """`p`, the update's plan, beside a rollout keeping `resident` layers on the GPU."""
    return replace(p, rollout_layers=resident)


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
        c = with_knobs(cfg, machine.world.ranks, **knobs)
        batch = batch_of(c, model_cfg, compute_bytes, span)

        def update(resident: int | None) -> Plan:
            rollout = rollout_memory(c, model_cfg, compute_bytes, resident_layers=resident)
            p = make_placement(model_cfg, batch, _less_rollout(host, rollout), choices_of(cfg), layer_mem)
            return with_rollout(p, resident)

        p = rollout_split(update, c, model_cfg.num_hidden_layers, machine.device)
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


def _less_host(machine: Machine, used: int) -> Machine:
    """The machine less `used` bytes of host memory: `plan`'s tokenized dataset (in `train` it
    already sits in memory)."""
    if not used or machine.host_bytes is None:
        return machine
    return replace(machine, host_bytes=machine.host_bytes - used)


def _fits(attempt, **knobs: int) -> bool:
    try:
        attempt(**knobs)
        return True
    except (PlanError, ConfigError):  # a setting the config refuses fits nothing
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


def layer_memory(model_cfg: ModelConfig, cfg, device, compute_bytes: int, quiet=contextlib.nullcontext):
    """One layer's activation memory measured on `device`, its tiled layer when a plan asks
    (`probe.LayerProbe`); None where no CUDA device is there to measure it: the formula; on the
    CPU, the formula with this CPU's FLOP rate. `quiet`: what its timed passes run inside."""
    from .planning.probe import layer_probe_for

    b = batch_of(cfg, model_cfg, compute_bytes)
    dtype = _compute_dtype(compute_bytes)
    return layer_probe_for(model_cfg, device, dtype, cfg.torch_compile, b.micro_batch_tokens, b.masked, quiet)


def _compute_dtype(compute_bytes: int):
    """A training config's compute dtype by its width (compute_dtype: bfloat16 or float32)."""
    import torch

    return torch.bfloat16 if compute_bytes == 2 else torch.float32


def measured(
    model_cfg: ModelConfig,
    cfg,
    device,
    compute_bytes: int,
    world: Layout | None = None,
    fill: WeightsFill | None = None,
):
    """(machine, layer memory) a plan of `cfg` on `device` is made from: `machine_of`'s budgets,
    completed as every plan's are (`runtime.probe_machine`, `fill` filled meanwhile and held
    quiet while the layer is timed), and `layer_memory`."""
    from .runtime import probe_machine

    return probe_machine(
        machine_of(cfg, device, world),
        lambda: layer_memory(
            model_cfg, cfg, device, compute_bytes, fill.gate.quiet if fill else contextlib.nullcontext
        ),
        cfg.moments(),
        fill,
    )


def preflight(
    model_cfg: ModelConfig,
    cfg,
    device,
    compute_bytes: int,
    warn=print,
    world: Layout | None = None,
    attention_span: float | None = None,
    fill: WeightsFill | None = None,
) -> tuple[Plan, Machine]:
    """The plan `train` runs under, on one machine of `world` (its part of a partitioned state).
    Raises InsufficientMemory with a one-line message when no placement fits; with
    preflight_check=false it warns and plans as if memory were unlimited. `attention_span`: the
    training data's (`Batcher.attention_span`); `fill`: the run's host state filled while its
    layer is probed (`runtime.WeightsFill`)."""
    from .config import parse_size

    cap = None if cfg.max_host_memory is None else parse_size(cfg.max_host_memory)
    beyond = host_cap_beyond(cap, host_available())  # read before the fill takes its memory
    machine, layer_mem = measured(model_cfg, cfg, device, compute_bytes, world, fill)
    if beyond:
        warn(f"megatrain: warning: {beyond}")
    result = check(model_cfg, cfg, machine, compute_bytes, layer_mem=layer_mem, attention_span=attention_span)
    if result.fits:
        return result.plan, machine
    msg = result.problem + " (see `megatrain plan`; preflight_check=false runs anyway)"
    if cfg.preflight_check:
        raise InsufficientMemory(msg)
    warn(f"megatrain: warning: {msg}")
    unlimited = Machine(machine.device, world=machine.world)
    batch = batch_of(cfg, model_cfg, compute_bytes, attention_span)
    choices = replace(choices_of(cfg), gpu_state="off", update_order="layer")
    p = rollout_split(
        lambda r: with_rollout(make_placement(model_cfg, batch, unlimited, choices, layer_mem), r),
        cfg,
        model_cfg.num_hidden_layers,
        machine.device,
    )
    return p, unlimited


def host_cap_beyond(cap: int | None, available: int | None) -> str:
    """A warning where the user's max_host_memory (`cap`) is above the host memory this machine
    has free now ("" where it is not, or either is unknown): the plan trusts the cap, which hosts
    whose memory grows as it is used need, and elsewhere a run using it may be killed for memory."""
    if cap is None or available is None or cap <= available:
        return ""
    return (
        f"max_host_memory: {fmt_bytes(cap)} is above the {fmt_bytes(available)} this host has free "
        "(MemAvailable); the plan trusts it, and unless this host's memory grows as it is used the "
        "run may be killed for memory"
    )


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
