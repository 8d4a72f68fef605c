"""Where every byte of a run lives: the one module that decides memory placement.

From the model's shape, the batch shape and the memory the run may use (measured, or capped by
`max_gpu_memory` / `max_host_memory`), `plan()` decides, before anything is allocated:

* **gradients**: how the exact global-norm clip is served.
  `stored`: each unit's fp32 gradient is kept until the norm is known, the leading units' on the
  GPU and the rest in page-locked host memory (copied there as each unit finishes, during the
  backward sweep: only what spills costs host bytes); `two_pass`: where neither holds them, a
  backward sweep that only measures the norm, then a second one that steps each unit as its
  gradient lands (no storage, a second recompute); `immediate`: without clipping
  (`max_grad_norm: 0`) each unit is stepped as its gradient lands.
* **boundary activations**: on the GPU as far as it holds them; the leading layers' beyond that
  are parked in page-locked host memory and brought back ahead of the backward sweep.
* **GPU-resident state** (`gpu_state: auto`): the fp32 weights and moments of the leading units,
  stepped on the GPU, and **kept graphs**: the trailing layers' autograd graphs from the forward
  sweep, not recomputed. What GPU memory is left goes to whichever of the two the cost model says
  saves more time per byte; the gradient modes (stored, two-pass) are compared after it is spent.
* **MLP tiles**: where one layer's working set does not fit otherwise (long context), the
  decoder layer's MLP runs over tiles of the sequence, as large as fit, so its intermediates
  (3 x tokens x ffn) exist for one tile at a time; each backward recomputes them once more.
* the sizes of the pools: loss chunk, weight prefetch depth, gradient staging.
* **update order** (`update_order: auto`): where every unit's state fits on the GPU with every
  layer's graph of one micro-batch beside it, and the cost model puts it faster (no recompute),
  the step runs micro-batch-major (engine.py), the same bits as layer-major.

**GPU-stepped units** (`gpu_step_units`: a count, or `auto`: the fewest the cost model puts
within STEPPING_TOLERANCE of its fastest, leaving the allocator STEPPING_GPU_HEADROOM of the card,
with the last layers' graphs kept where that saves KEEP_GRAPHS_GAIN and adds nothing to the GPU
peak):
the first streamed units after the resident ones are stepped on the GPU, their fp32 state copied
in and back each step (gpustep.py); the plan keeps their gradients on the GPU and counts the
scratch or, where gradients are held, the state loaded during the backward sweep (prestaged,
where that fits and is faster), the weights they keep for the next forward sweep and the PCIe
traffic.

The engine and the transport receive the `Plan` and carry it out; they keep no rules of their
own. `megatrain plan` prints the same plan, and a training run records it in `plan.json` beside
the peaks it measured.

What each choice costs comes from footprint.py (memory at its peak, host bytes) and
costmodel.py (step time, which footprint's `evaluate` adds to each plan).
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path

from ..errors import ConfigError, MegatrainError
from ..host.moments import FP32, named
from ..models.config import ModelConfig
from ..parallel.layout import Layout
from .costmodel import ADAM_IN_STEP
from .footprint import (
    CUDA_CONTEXT,
    HOST_RESERVE,
    GiB,
    disk_tier_bytes,
    evaluate,
    fits,
    fmt_bytes,
    loss_chunk,
    phase_peaks,
    unit_peaks,
    usable_gpu,
    usable_host,
)
from .planspec import ADAM_PARAMS_S, KERNEL_TAIL, Batch, Machine, Plan, Shape, looked_up_rows, model_shape
from .probe import LayerMemory, LayerProbe, formula_layer_memory

__all__ = [
    "Batch",
    "Choices",
    "Machine",
    "Plan",
    "PlanError",
    "fmt_bytes",
    "phase_peaks",
    "plan",
    "unit_peaks",
]


MIN_MLP_TILE = 1024  # tokens: smaller MLP tiles leave the GPU's matmul units idle
# Longer tiles run no faster (a 16k-token tile's matmuls already fill the GPU) and their
# intermediates would be counted far beyond the tiles the probe measures.
MAX_MLP_TILE = 16384
# The share of a step that GPU stepping must save by the cost model before the plan spends GPU
# memory on it (`gpu_step_units: auto`).
STEPPING_GAIN = 0.05
# `gpu_step_units: auto` takes the fewest units whose step the cost model puts within this share
# of the fastest count's. Closer than that the model cannot rank counts (its error on the recorded
# runs of today's schedule is -7% to +11%, tests/test_costmodel_replay.py), and fewer units hold
# less GPU memory: 8B at 64k tokens on an H200, 34 units (the model's fastest, 1-2% ahead of 30)
# ran 7,054-7,376 tokens/s in five runs (three of them with schedule variants not kept), 30 units
# 8,429-8,771 in four (two), the allocator's reserve at the card's limit at 34 (bench/host-only.md). Those runs predate the reordered write-backs of
# gpustep.py, which removed a per-step allocator retry; 34 units are not measured since.
STEPPING_TOLERANCE = 0.02
# `gpu_step_units: auto` takes no count whose plan leaves less than this free of the GPU budget
# (`Machine.gpu_bytes`). The plan counts allocated bytes; the caching allocator maps more: it keeps
# each stream's freed memory for that stream, and the prestaged state (the load stream's) and the
# compute stream's working set take turns at the card's limit. In a traced step of 8B at 16k
# tokens on an H100 with 21 units (4.3 GiB left free by the plan), it gave memory back and mapped
# it again three times: first where the forward sweep asked for activations, the load stream
# holding the last step's state cached, the compute stream 3.6 GiB over its own share of the plan
# (results/2026-11-27_2353_h100-B16k-auto-trace.json; 13 retries in 5 steps, the step 14% over its
# plan). The records, by what the plan left free: 4.3-7.7 GiB, 9-18 retries a run (8B at 16k on
# H100s, 20-21 units: 2026-11-26_1747, 2026-11-27_1817, _1820, _2003, _2353; the 14.77B shape at
# 16k on an H200, 30 units: 2026-11-27_1012, 8% over its plan); 13.5 GiB, one retry, and 9.7% more
# tokens/s than 21 units on the same machine (8B, H100, 18 units: _2355_h100-B16k-s18-s15.json);
# 21.7 GiB, none (8B at 64k on an H200, 32 units: 2026-11-23_2116). A fit to these runs, not a
# model of the allocator: 8B at 16k on an H200 retried with 23-39 GiB free (29-31 units, chosen
# only with a misread AdamW rate; `auto` steps 24-26 there, 44 GiB free or more). On a budget
# under 80 GiB, STEPPING_GPU_HEADROOM_SHARE of it (11.8 GiB on the H100s; smaller ones measured
# nothing).
STEPPING_GPU_HEADROOM = 12 * GiB
STEPPING_GPU_HEADROOM_SHARE = 0.15
# The share of the step kept graphs must save by the cost model beside `auto`'s GPU-stepped units
# (`_keep_stepped_graphs`). 8B at 16k tokens, all state in host memory: on the H200s 2 graphs under
# the peak of 25-26 units, 1.2-1.3% by the model; 4 graphs with 26 units ran 2.0% faster than none
# on the same machine, no retries (results/2026-11-27_2331_x2-B16k-auto-ds5.json,
# _2338_x2-B16k-keep4-ds6.json), and 2 took 1.3% off the step's serial compute (_0221 against
# 2026-11-27_2112). On the H100s 1 graph under the peak of 18 units, 0.4-0.5% by the model: the
# runs with it retried the allocator 2 and 9 times (2026-11-28_0228_h100-B16k-auto-keep.json,
# _0213_x2-h100-B16k-auto-keep-ds7.json) against once without it (2026-11-27_2355, another
# machine): not attributed, and a gain under the model's resolution is not worth it. At 64k tokens
# on the H200s every graph raises the peak.
KEEP_GRAPHS_GAIN = 0.01
# The share of the step the embedding's rows (`Plan.embed_rows`) must save by the cost model before
# `auto` takes them over the same search without them: below it the model cannot tell them apart
# (the 14.77B shape at 64k: 0.3%). 8B at 16k tokens on the two-H200 machine: 1.9% by the model,
# 5.8% measured on one machine (results/2026-11-28_1045_summary.md).
ROWS_GAIN = 0.01


class PlanError(MegatrainError):
    """No placement fits the memory this run may use."""


@dataclass(frozen=True)
class Choices:
    """The user's settings that constrain placement; None means the plan decides."""

    gpu_state: str = "auto"  # auto | off
    gradient_placement: str = "auto"  # auto | gpu | host | two_pass
    offload_activations: bool | None = None
    keep_layers: int | None = None
    resident_units: int | None = None
    loss_chunk_tokens: int | None = None
    mlp_tile_tokens: int | None = None  # 0: never tile
    gpu_step_units: int | None = 0  # streamed units stepped on the GPU (None: the plan chooses)
    # the embedding fetched as the rows a step looks up (None: the plan decides, with
    # gpu_step_units: auto)
    embedding_rows: bool | None = None
    moments: str = FP32.name  # how the AdamW moments are stored (`optim`: host/moments.py)
    update_order: str = "auto"  # auto | layer | micro_batch (`Plan.update_order`)
    fetch_both_halves: bool = False  # `Plan.fetch_both_halves`


# ---------------------------------------------------------------------------- deciding
def plan(
    cfg: ModelConfig,
    batch: Batch,
    machine: Machine,
    choices: Choices | None = None,
    layer_mem: LayerMemory | LayerProbe | None = None,
) -> Plan:
    """The placement of a run, or PlanError naming what does not fit (see the module docstring).
    `layer_mem`: one layer's activation memory as probe.py measured it (default: a formula); of a
    `LayerProbe`, the tiled layer is measured only where the plan would read it (`_in_memory`).
    Where host memory cannot hold the state and the machine has a disk tier (`disk_bytes`), the
    AdamW moments of the fewest trailing units that make the run fit go to disk."""
    return _placed(cfg, batch, machine, choices or Choices(), layer_mem)


def _placed(cfg: ModelConfig, batch: Batch, machine: Machine, choices: Choices, layer_mem) -> Plan:
    """`plan`: in memory, else with the disk tier."""
    try:
        return _in_memory(cfg, batch, machine, choices, layer_mem)
    except PlanError as e:
        if machine.disk_bytes is None or machine.host_bytes is None:
            raise
        try:  # would any amount of host memory do? If not, the GPU is what does not fit
            _in_memory(cfg, batch, replace(machine, host_bytes=None), choices, layer_mem)
        except PlanError:
            raise e from None
        return _with_disk_tier(cfg, batch, machine, choices, layer_mem, str(e))


def _where(m: Machine) -> str:
    """Where the disk tier is, as the plan's notes say it."""
    return "offload_dir" if m.disk_folders == 1 else f"offload_dir ({m.disk_folders} folders, striped)"


def _with_disk_tier(cfg, batch: Batch, m: Machine, choices, layer_mem, problem: str) -> Plan:
    """The plan with the fewest trailing units' moments on disk, or PlanError."""
    untiled = layer_mem.untiled if isinstance(layer_mem, LayerProbe) else layer_mem  # for the units
    s = model_shape(cfg, untiled or formula_layer_memory(cfg, batch.compute_bytes))
    n, c = len(s.units), choices or Choices()

    def with_tier(k: int) -> Plan | None:
        tier = disk_tier_bytes(s, k, m.world, named(c.moments))
        if tier > m.disk_bytes:
            return None
        # The moments on disk free their bytes of host memory for the rest of the plan: all of
        # them, the reserve being a share of the host's memory, not of bytes it no longer holds
        # (`fits` below checks the tiered plan against the machine's own budget). Counted at 95%,
        # a 122B tier of 910 GiB lost 45 GiB and refused a run that fits 512 GiB.
        room = replace(m, host_bytes=m.host_bytes + math.ceil(tier / (1 - HOST_RESERVE)))
        try:
            p = _in_memory(cfg, batch, room, choices, layer_mem)
            if p.resident_units + p.gpu_stepped_units > n - k and c.gpu_state == "auto":
                # GPU-resident and GPU-stepped units need their moments page-locked: where `auto`
                # spends free GPU memory on the tier's units, the plan without GPU state (nor kept
                # graphs: `off` turns both off) and with the user's GPU-stepped units, if any.
                off = replace(c, gpu_state="off", gpu_step_units=c.gpu_step_units or 0)
                p = _in_memory(cfg, batch, room, off, layer_mem)
                p.notes.append("gpu_state: no state on the GPU: the disk tier takes the units it would hold")
        except PlanError:
            return None
        if p.resident_units + p.gpu_stepped_units + int(p.embed_rows) > n - k:
            if p.gpu_stepped_units or p.resident_units:
                return None
            p = replace(p, embed_rows=False)  # the tier holds the embedding too
        p = evaluate(s, batch, replace(p, disk_units=k, notes=list(p.notes)), m)
        if not fits(p, m):
            return None
        io = "O_DIRECT" if m.disk_direct else "buffered: its file system refuses O_DIRECT"
        p.notes.append(f"disk tier: the AdamW moments of the last {k} of {n} units in {_where(m)} ({fmt_bytes(tier)}; "
                       f"read at {m.disk_read_bytes_s / 1e9:.2f} GB/s, written at {m.disk_write_bytes_s / 1e9:.2f}, "
                       f"both at once {m.disk_duplex_bytes_s / 1e9:.2f}, {io})")  # fmt: skip
        return p

    # The most units whose moments the disk holds; more units on disk only free more host memory,
    # so if that many do not make the rest fit, no fewer do.
    most = max(
        (k for k in range(1, n + 1) if disk_tier_bytes(s, k, m.world, named(c.moments)) <= m.disk_bytes),
        default=0,
    )
    if not most or with_tier(most) is None:
        held = f"the last {most} of {n} units', " if most < n else "every unit's, "
        raise PlanError(f"{problem}; with the disk tier: the AdamW moments of the most units {_where(m)} holds "
                        f"({held}{fmt_bytes(disk_tier_bytes(s, most, m.world, named(c.moments)))}; {fmt_bytes(m.disk_bytes)} free) "
                        "leave too much for host memory")  # fmt: skip
    lo, hi = 1, most  # the fewest units that fit
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if with_tier(mid) is not None else (mid + 1, hi)
    return with_tier(lo)


def _in_memory(
    cfg: ModelConfig,
    batch: Batch,
    machine: Machine,
    choices: Choices | None = None,
    layer_mem: LayerMemory | LayerProbe | None = None,
) -> Plan:
    """The placement with the whole state in host memory (and on the GPU), or PlanError. Of a
    `LayerProbe`, the untiled layer's, unless its tile loop would go past the untiled layer (no
    untiled placement fits, or only a two-pass one; the user's `mlp_tile_tokens`): then the tiled
    layer is measured and planned with. Up to that point a plan reads no tiled field, so this is
    the plan of the layer measured both ways."""
    if isinstance(layer_mem, LayerProbe):
        p = _in_memory_of(cfg, batch, machine, choices, layer_mem.untiled, untiled_only=True)
        if p is not None:
            return p
        layer_mem = layer_mem.with_tiles()
    return _in_memory_of(cfg, batch, machine, choices, layer_mem)


def _in_memory_of(
    cfg: ModelConfig,
    batch: Batch,
    machine: Machine,
    choices: Choices | None,
    layer_mem: LayerMemory | None,
    untiled_only: bool = False,
) -> Plan | None:
    """`_in_memory` of a measured layer; `untiled_only`: its tiled fields are not measured, and
    None is returned where the plan would read them."""
    c, m = choices or Choices(), machine
    check_gpu_stepping(c.gpu_step_units or 0, m.device)
    s = model_shape(cfg, layer_mem or formula_layer_memory(cfg, batch.compute_bytes))
    L = s.layers
    keep = min(c.keep_layers or 0, L)
    resident = min(c.resident_units or 0, len(s.units))
    stepped = min(c.gpu_step_units or 0, len(s.units) - resident)
    chunk = loss_chunk(s, batch, m, c.loss_chunk_tokens)

    if m.device == "cpu":
        parked_options: list[int] | range = [0]
    elif c.offload_activations is not None:
        parked_options = [L - keep] if c.offload_activations else [0]
    else:
        parked_options = range(L - keep + 1)

    if c.embedding_rows and (why := rows_refused(s, m, resident)):
        raise ConfigError(f"embedding_rows: {why}; set it false or auto")

    def candidate(mode: str, gpu_grad_units: int, parked: int, tile: int) -> Plan:
        rows = bool(c.embedding_rows) and mode == "stored"
        p = Plan(m.device, mode, gpu_grad_units, resident, keep, parked, chunk, tile, stepped,
                 embed_rows=rows, moments=c.moments, fetch_both_halves=c.fetch_both_halves)  # fmt: skip
        return _stepped_loading(s, batch, p, m)

    # the fastest plan of each gradient mode that fits, whichever mode wins below
    by_mode: dict[str, Plan] = {}

    def fastest(tile: int) -> Plan | None:
        best: Plan | None = None
        host = usable_host(m)
        start = _fewest_parked(parked_options, partial(gpu_room, tile=tile))
        for parked in parked_options[start:]:
            options = list(_gradient_options(s, batch, c, m, parked, partial(candidate, tile=tile)))
            for p in options:
                if not fits(p, m):
                    continue
                if p.grad_mode not in by_mode or p.step_time_s < by_mode[p.grad_mode].step_time_s * 0.999:
                    by_mode[p.grad_mode] = p
                if best is None or p.step_time_s < best.step_time_s * 0.999:
                    best = p
            if best is not None and best.grad_mode != "two_pass":
                break  # parking more activations only adds PCIe traffic
            if host is not None and all(p.host_total > host for p in options):
                break  # nor does it make room in host memory
        return best

    def gpu_room(parked: int, tile: int) -> bool:
        """The GPU holds the working set with `parked` layers' activations parked, no gradient held."""
        least = candidate("stored" if batch.clip else "immediate", 0, parked, tile)
        return fits(replace(least, host={}), m)

    # Untiled where it fits, else the largest MLP tile that does (tiling costs a recompute of the
    # MLP, less than the second sweep of a two-pass step).
    tiles = _tile_options(s, batch, c, untiled_only)
    best = None
    for tile in tiles:
        if tile and untiled_only:
            return None  # the tiled layer is read from here on
        p = fastest(tile)
        if p is not None and (best is None or p.step_time_s < best.step_time_s * 0.999):
            best = p
        if best is not None and best.grad_mode != "two_pass":
            break
    if best is None:
        # the least demanding placement the user's choices allow
        mode = (
            "immediate"
            if not batch.clip
            else "stored"
            if c.gradient_placement in ("gpu", "host")
            else "two_pass"
        )
        worst = candidate(mode, resident, parked_options[-1], tiles[-1])
        raise PlanError(_too_big(worst, m, batch))
    auto = c.gpu_state != "off" and c.keep_layers is None and c.resident_units is None
    if m.device == "cuda" and auto:
        # What the free GPU memory buys differs by mode (resident state saves a stored step more
        # of its host optimizer than a two-pass one): the modes are compared after spending it.
        # Compared before, a stored plan 0.4% slower lost to a two-pass one that ran 7% slower
        # (8B, 16k, 22 GiB cap: bench/results/2026-11-23_1647_memory.json).
        spent = [
            _spend_free_gpu(s, batch, p, m) for p in (best, *(q for q in by_mode.values() if q is not best))
        ]
        best = min(spent, key=lambda p: p.step_time_s)
    can_step = m.device == "cuda" and m.world.ranks == 1  # where GPU stepping is built
    may_store = batch.clip and c.gradient_placement in ("auto", "host")
    headroom, keep_graphs = "", c.keep_layers is None
    if c.gpu_step_units is None and can_step:
        rows = c.embedding_rows is not False
        best, headroom = _fastest_stepping(s, batch, best, m, may_store, keep_graphs, rows)
    if c.embedding_rows and not best.embed_rows:
        best.notes.append("embedding_rows: not in a two-pass or unclipped step (gradients held for the clip)")
    best, order_note = _update_order(s, batch, best, m, c)
    why = _why_two_pass(best, c, m, candidate)
    if c.gpu_step_units == 0 and can_step and may_store:  # the user's default: say what auto would do
        why += _stepping_would_store(s, batch, best, m, keep_graphs)
    best = _note(best, s, batch, m, why)
    if order_note:
        best.notes.append(order_note)
    if headroom:
        best.notes.append(headroom)
    if m.device == "cuda":
        how = "measured on the device" if layer_mem else "estimated (no device here to measure it)"
        best.notes.append(f"one layer's activation memory: {how}")
    return best


def micro_batch_refused(s: Shape, b: Batch, m: Machine, c: Choices) -> str:
    """Why this run's step cannot be micro-batch-major (`Plan.update_order`; "": it can). On a GPU
    it holds every unit's state there; the engine refuses what is not the layer-major step's
    arithmetic to the bit (engine.py: several processes, a coupled objective)."""
    if m.world.ranks > 1:
        return "built for one process (the objectives meet the other ranks' once a step)"
    if b.coupled:
        return b.coupled
    if b.clip and c.gradient_placement == "two_pass":
        return "a two-pass step keeps no graphs (gradient_placement: two_pass)"
    if c.offload_activations:
        return "it keeps one micro-batch's activations on the GPU (offload_activations: true)"
    if c.keep_layers is not None:
        return "it keeps every layer's graph of a micro-batch (keep_layers is the layer-major step's)"
    if m.device != "cuda":
        return ""
    if c.gpu_state == "off":
        return "it keeps every unit's state on the GPU (gpu_state: off)"
    if c.resident_units is not None and c.resident_units < len(s.units):
        return f"it keeps every unit's state on the GPU ({len(s.units)} units; resident_units {c.resident_units})"
    if c.gpu_step_units or c.embedding_rows:
        return "it keeps every unit's state on the GPU, none streamed (gpu_step_units, embedding_rows)"
    return ""


def _micro_batch_major(s: Shape, b: Batch, base: Plan, m: Machine) -> Plan:
    """`base` made micro-batch-major: on a GPU every unit resident (their gradients wait there),
    nothing parked, stepped on the GPU from streamed state or fetched as rows; costed."""
    n = len(s.units)
    gpu = m.device == "cuda"
    p = replace(
        base,
        grad_mode="stored" if b.clip else "immediate",
        gpu_grad_units=n,
        resident_units=n if gpu else base.resident_units,
        keep_layers=0,
        parked_layers=0,
        gpu_stepped_units=0,
        embed_rows=False,
        update_order="micro_batch",
        notes=[],
    )
    return evaluate(s, b, p, m)


def _update_order(s: Shape, b: Batch, best: Plan, m: Machine, c: Choices) -> tuple[Plan, str]:
    """The step's update order (`Plan.update_order`) and a note naming it: `update_order:
    micro_batch` as configured (ConfigError or PlanError where it cannot be); `auto`, on a GPU
    with several micro-batches, where `gpu_state: auto` plans, micro-batch-major where that fits
    and the cost model puts it faster than `best`, layer-major."""
    if c.update_order == "layer":
        return best, ""
    why = micro_batch_refused(s, b, m, c)
    if c.update_order == "micro_batch":
        if why:
            raise ConfigError(f"update_order: micro_batch: {why}; set it auto or layer")
        p = _micro_batch_major(s, b, best, m)
        if not fits(p, m):
            raise PlanError(
                f"update_order: micro_batch: it would need {_short_of(p, m)}; set it auto or layer"
            )
        return p, "update order: micro-batch-major, as configured (update_order: micro_batch)"
    auto = c.gpu_state != "off" and c.keep_layers is None and c.resident_units is None
    if m.device != "cuda" or b.micro_batches < 2 or not auto:
        return best, ""  # one micro-batch: the layer-major step keeps every graph already where it pays
    if why:
        return best, f"update order: layer-major (micro-batch-major: {why})"
    p = _micro_batch_major(s, b, best, m)
    if not fits(p, m):
        return best, (
            "update order: layer-major; micro-batch-major (every unit's state on the GPU, every layer's "
            f"graph of a micro-batch kept, no recompute) would need {_short_of(p, m)}"
        )
    faster = p.step_time_s < best.step_time_s * 0.999
    times = f"~{p.step_time_s:.2f} s a step against ~{best.step_time_s:.2f} layer-major"
    if not faster:
        return best, f"update order: layer-major; micro-batch-major would fit, {times} by the cost model"
    graphs = p.gpu.get("kept graphs (one micro-batch)", 0)
    return p, (
        f"update order: micro-batch-major (each micro-batch's forward, loss and backward through every "
        f"layer in turn, its graphs kept: ~{fmt_bytes(graphs)} at the peak; no layer recomputed), {times}"
    )


def _short_of(p: Plan, m: Machine) -> str:
    """What plan `p` needs beyond the machine's budgets, in words."""
    gpu, host = usable_gpu(m), usable_host(m)
    parts = []
    if p.device == "cuda" and gpu is not None and p.gpu_peak > gpu:
        parts.append(f"~{fmt_bytes(p.gpu_peak)} of GPU memory, {fmt_bytes(gpu)} usable")
    if host is not None and p.host_total > host:
        parts.append(f"~{fmt_bytes(p.host_total)} of host memory, {fmt_bytes(host)} usable")
    return " and ".join(parts)


def rows_refused(s: Shape, m: Machine, resident: int = 0) -> str:
    """Why the embedding's rows cannot be fetched on its own (`Plan.embed_rows`; "": they can).
    The head of a tied model reads the whole table; the host pass writes the table once, equal
    to the rows computed ahead of it, where the host kernel takes one form for every element of
    both (engine/rows.py: a width that is a multiple of KERNEL_TAIL)."""
    if m.device != "cuda":
        return "a GPU's (on the CPU the table is not fetched)"
    if s.tied:
        return "not with tied embeddings (the LM head reads the whole table)"
    if not s.rows_embedding:
        return "this model's embedding is not one table that its forward reads a row at a time"
    if s.hidden % KERNEL_TAIL:
        return f"hidden_size {s.hidden} is not a multiple of {KERNEL_TAIL}"
    if m.world.ranks > 1:
        return "built for one process"
    if resident:
        return "not with GPU-resident state (resident_units)"
    return ""


def check_gpu_stepping(units: int, device: str, world_size: int = 1) -> None:
    """ConfigError (one line) where `gpu_step_units` cannot be honoured: on the CPU, where every
    unit is stepped there anyway, and in a data-parallel world (not built yet)."""
    if units and world_size > 1:
        raise ConfigError(
            f"gpu_step_units: not supported with several processes yet ({world_size}; set it to 0)"
        )
    if units and device == "cpu":
        raise ConfigError("gpu_step_units: steps units on a GPU, and this run is on the CPU (set it to 0)")


def _fewest_parked(options: list[int] | range, fits_gpu) -> int:
    """Index of the first of `options` (parked layers, ascending) whose GPU memory fits, by
    bisection (the GPU peak falls as layers are parked); len(options) when none does."""
    lo, hi = 0, len(options)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits_gpu(options[mid]):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _tile_options(s: Shape, b: Batch, c: Choices, untiled_only: bool = False) -> list[int]:
    """MLP tile sizes worth trying, best first: untiled, then halving from MAX_MLP_TILE (or the
    largest power of two below the micro-batch) down to MIN_MLP_TILE. `untiled_only`: those a
    layer measured tiled too would have."""
    if c.mlp_tile_tokens is not None:
        return [c.mlp_tile_tokens]
    out = [0]
    measured = untiled_only or s.layer_mem.tiled_graph_per_token is not None
    if not measured or b.micro_batch_tokens <= MIN_MLP_TILE:
        return out  # the tiled layer was not measured, or a tile would be the whole micro-batch
    tile = min(MAX_MLP_TILE, 1 << ((b.micro_batch_tokens - 1).bit_length() - 1))  # a power of two below
    while tile >= MIN_MLP_TILE:
        out.append(tile)
        tile //= 2
    return out


def _gradient_options(s: Shape, b: Batch, c: Choices, m: Machine, parked: int, candidate):
    """The gradient placements worth trying with `parked` layers' activations in host memory."""
    n = len(s.units)
    if not b.clip:
        yield candidate("immediate", 0, parked)
        return
    if c.gradient_placement == "two_pass":
        yield candidate("two_pass", 0, parked)
        return
    if c.gradient_placement == "gpu" or m.device == "cpu":
        yield candidate("stored", n, parked)
    elif c.gradient_placement == "host" or c.gpu_state == "off":
        yield candidate("stored", 0, parked)
    else:
        # As many trailing units' gradients in host memory as it holds (they move there during
        # the backward sweep, off the critical path); the leading units' wait on the GPU.
        lo, hi = 0, n
        host = usable_host(m)
        if host is not None:
            while lo < hi:
                mid = (lo + hi) // 2
                if candidate("stored", mid, parked).host_total <= host:
                    hi = mid
                else:
                    lo = mid + 1
        yield candidate("stored", lo, parked)
    if c.gradient_placement == "auto":
        yield candidate("two_pass", 0, parked)


def _spend_free_gpu(s: Shape, b: Batch, base: Plan, m: Machine) -> Plan:
    """Give the GPU memory a plan leaves free to resident state or kept graphs, one unit or
    layer at a time, whichever the cost model says saves more time per byte."""
    cur = base
    while True:
        options = []
        # sharded: no state on the GPU; the GPU-stepped units (the user's) move back one; the
        # embedding's rows come from host memory
        if cur.stepped.stop < len(s.units) and not m.world.sharded and not cur.embed_rows:
            options.append(replace(cur, resident_units=cur.resident_units + 1))
        if cur.grad_mode != "two_pass" and cur.keep_layers < s.layers - cur.parked_layers:
            options.append(replace(cur, keep_layers=cur.keep_layers + 1))
        scored = []
        for o in options:
            o = evaluate(s, b, o, m)
            gain = cur.step_time_s - o.step_time_s
            if gain > 1e-6 and fits(o, m):
                scored.append((gain / max(1, o.gpu_peak - cur.gpu_peak), o))
        if not scored:
            return cur
        cur = max(scored, key=lambda x: x[0])[1]


def _fastest_stepping(
    s: Shape, b: Batch, base: Plan, m: Machine, may_store: bool, keep_graphs: bool, rows: bool = True
) -> tuple[Plan, str]:
    """`gpu_step_units: auto`: the number of streamed units to step on the GPU that the cost model
    says is fastest, among those whose memory fits with STEPPING_GPU_HEADROOM left for the
    allocator (the fewest within STEPPING_TOLERANCE of it);
    none unless that saves STEPPING_GAIN of the step, the cost model's error on the runs it was
    checked against. Only where gradients are held for the clip (stored): in a two-pass step the
    CPU AdamW already runs beside the second backward sweep, and GPU stepping measured no faster
    there (8B, 16k, all state in host memory, H200: 11 units 4,058 tokens/s against 4,045
    without, where the model said 31% faster; bench/results/2026-11-23_1650_memory.json). But a
    plan that is two-pass because the host cannot hold the gradients can hold them once enough
    units are stepped on the GPU, whose gradients wait there (`may_store`: the user's
    gradient_placement allows storing them). `keep_graphs` (kept graphs left to the plan, as a
    run's config always leaves them): then the last layers' graphs kept where that is faster
    (`_keep_stepped_graphs`). `rows`: with the embedding's rows fetched (`Plan.embed_rows`) too,
    where they can be and the cost model puts them ROWS_GAIN faster. Also returns a note where the headroom
    held back a count the cost model puts faster (else "")."""
    if base.grad_mode == "stored":
        start = base
    elif base.grad_mode == "two_pass" and may_store:
        start = replace(base, grad_mode="stored", gpu_grad_units=0)
    else:
        return base, ""
    room = None
    if m.gpu_bytes is not None:
        room = m.gpu_bytes - min(STEPPING_GPU_HEADROOM, STEPPING_GPU_HEADROOM_SHARE * m.gpu_bytes)
    starts = [replace(start, embed_rows=False)]
    if rows and not rows_refused(s, m, start.resident_units):
        starts.append(replace(start, embed_rows=True))
    found = {st.embed_rows: f for st in starts if (f := _fewest_fast(s, b, st, m, room)) is not None}
    if not found:
        return base, ""
    plain, rows_found = found.get(False), found.get(True)
    pick = plain
    if rows_found and (plain is None or rows_found[0].step_time_s < (1 - ROWS_GAIN) * plain[0].step_time_s):
        pick = rows_found
    best, counts, fastest = pick
    if best.step_time_s >= (1 - STEPPING_GAIN) * base.step_time_s:
        return base, ""
    if keep_graphs:
        best = _keep_stepped_graphs(s, b, best, m)
    held_back = [p for p in counts if fits(p, m) and p.step_time_s < (1 - STEPPING_TOLERANCE) * fastest]
    if not held_back:
        return best, ""
    other = min(held_back, key=lambda p: p.step_time_s)
    return best, (
        f"gpu_step_units: auto leaves {fmt_bytes(m.gpu_bytes - best.gpu_peak)} of the GPU free for the "
        f"allocator's caches; {other.gpu_stepped_units} units would fit its plan, "
        f"~{best.step_time_s - other.step_time_s:.2f} s a step faster by the cost model, where runs that left "
        "the allocator less room retried it every step (a number in gpu_step_units takes them)"
    )


def _fewest_fast(s: Shape, b: Batch, start: Plan, m: Machine, room: int | None):
    """Of `start` with 1.. GPU-stepped units (0.. with the embedding's rows, which step none on
    the GPU alone), the fewest whose step the cost model puts within STEPPING_TOLERANCE of the
    fastest that fits under `room`: (that plan, every count's plan, the fastest step), or None
    where none fits."""
    first = 0 if start.embed_rows else 1
    # not monotone: more units free host memory (their gradients) and take GPU memory
    counts = [
        _stepped_loading(s, b, replace(start, gpu_stepped_units=k), m)
        for k in range(first, len(s.units) - start.stepped.start + 1)
    ]
    fitting = [p for p in counts if fits(p, m) and (room is None or p.gpu_peak <= room)]
    if not fitting:
        return None
    fastest = min(p.step_time_s for p in fitting)
    best = next(p for p in fitting if p.step_time_s <= (1 + STEPPING_TOLERANCE) * fastest)
    return best, counts, fastest


def _keep_stepped_graphs(s: Shape, b: Batch, p: Plan, m: Machine) -> Plan:
    """A plan with GPU-stepped units, keeping the last layers' autograd graphs from the forward
    sweep one layer more at a time while the cost model puts each faster and the plan's GPU peak
    does not rise, where together they save KEEP_GRAPHS_GAIN of the step (else `p`). Under the
    peak the graphs live in memory the plan already counts at the step's busiest moment, so they
    bring its allocated bytes no nearer the card's limit. A kept layer is neither recomputed nor
    fetched again in the backward sweep; its graph is activation memory, which does not grow with
    the model's depth, so `gpu_state: off` allows it here."""
    base = p
    while p.keep_layers < s.layers - p.parked_layers:
        more = _stepped_loading(s, b, replace(p, keep_layers=p.keep_layers + 1), m)
        if more.step_time_s >= p.step_time_s - 1e-6 or more.gpu_peak > p.gpu_peak or not fits(more, m):
            break
        p = more
    return p if p.step_time_s <= (1 - KEEP_GRAPHS_GAIN) * base.step_time_s else base


def _stepped_loading(s: Shape, b: Batch, p: Plan, m: Machine) -> Plan:
    """Where gradients are held for the clip: the GPU-stepped state loaded during the backward
    sweep (prestaged) where that fits and is faster, else after the clip. Prestaging puts the
    load on the backward sweep's link, beside its fetches, where loading after the clip overlaps
    it with the CPU optimizer's tail: with few units the CPU binds and the latter can be faster
    (at the same speed it is chosen: it holds no state on the GPU)."""
    staged = evaluate(s, b, replace(p, prestage=True), m)
    if not staged.prestaged:
        return staged
    after = evaluate(s, b, replace(p, prestage=False), m)
    if fits(staged, m) and (not fits(after, m) or staged.step_time_s < after.step_time_s - 1e-6):
        return staged
    return after


def _too_big(p: Plan, m: Machine, b: Batch) -> str:
    gpu = usable_gpu(m)
    parts = []
    if p.device == "cuda" and gpu is not None and p.gpu_peak > gpu:
        tiled = (
            f" and MLP tiles of {p.mlp_tile_tokens:,} tokens"
            if 0 < p.mlp_tile_tokens < b.micro_batch_tokens
            else ""
        )
        parts.append(
            f"GPU memory: one layer's working set at {b.micro_batch_tokens:,} tokens per micro-batch needs "
            f"~{fmt_bytes(p.gpu_peak)} with every activation in host memory{tiled}, {fmt_bytes(gpu)} usable"
        )
    host = usable_host(m)
    if host is not None and p.host_total > host:
        parts.append(f"host memory: needs ~{fmt_bytes(p.host_total)}, {fmt_bytes(host)} usable")
    return "no placement fits: " + "; ".join(parts or ["unknown"])


def _why_two_pass(p: Plan, c: Choices, m: Machine, candidate) -> str:
    """Why a plan's gradients are not stored for the clip, in words for its note ('' if they are)."""
    if p.grad_mode != "two_pass":
        return ""
    if c.gradient_placement == "two_pass":
        return "as configured (gradient_placement: two_pass)"
    in_host = candidate("stored", 0, p.parked_layers, p.mlp_tile_tokens)
    if fits(in_host, m):
        return "faster than storing them, by the cost model"
    host = f"host memory would need ~{fmt_bytes(in_host.host_total)} with them, {fmt_bytes(usable_host(m))} usable"
    if c.gpu_state == "off":
        return f"{host}, and gpu_state: off keeps none on the GPU"
    return f"{host}, and the GPU holds no more of them"


def _stepping_would_store(s: Shape, b: Batch, p: Plan, m: Machine, keep_graphs: bool) -> str:
    """Where a two-pass plan without GPU-stepped units would store the gradients instead with
    `gpu_step_units: auto`, that, with its cost (for the note; '' otherwise)."""
    if p.grad_mode != "two_pass":
        return ""
    alt, _ = _fastest_stepping(s, b, p, m, may_store=True, keep_graphs=keep_graphs)
    if alt.grad_mode != "stored":
        return ""
    return (
        f"; gpu_step_units: auto would store them, {alt.gpu_stepped_units} units stepped on the GPU "
        f"(~{fmt_bytes(alt.gpu_peak)} of GPU memory), ~{alt.step_time_s:.2f} s a step against "
        f"~{p.step_time_s:.2f}"
    )


def _note(p: Plan, s: Shape, b: Batch, m: Machine, why_two_pass: str) -> Plan:
    n, w = len(s.units), m.world
    notes = []
    if w.sharded:
        notes.append(
            f"data parallel, sharded: each of {w.ranks} processes copies 1/{w.ranks} of every unit to its "
            f"device (the rest all-gathered there) and receives 1/{w.ranks} of its gradient (reduce-scatter)"
        )
    if w.partitioned:
        notes.append(
            f"host state partitioned over {w.machines} machines: this machine holds "
            f"{fmt_bytes(p.state_bytes(w.held(s.units)))} of {fmt_bytes(p.state_bytes(s.total))}"
        )
    if p.grad_mode == "stored" and p.device == "cpu":
        notes.append("gradients: kept until the clip norm is known")
    elif p.grad_mode == "stored":
        on_gpu = p.gpu_grad_lead
        where = (
            "all on the GPU"
            if on_gpu == n
            else "all in host memory"
            if on_gpu == 0
            else f"the {on_gpu} leading units' on the GPU, the other {n - on_gpu} in host memory"
        )
        notes.append(f"gradients: kept until the clip norm is known, {where}")
    elif p.grad_mode == "two_pass":
        extra = 3 * s.layers * 2 * s.layer * b.tokens
        notes.append(
            f"gradients: two-pass step ({why_two_pass}): a norm-only "
            f"backward sweep, then one that steps each unit as it lands; ~{extra / 1e12:.0f} TFLOP more per step"
        )
    else:
        notes.append("gradients: no clipping, each unit stepped as its gradient lands")
    if s.layer_mem.tiles(b.micro_batch_tokens, p.mlp_tile_tokens):
        notes.append(
            f"MLP tiled over the sequence, {p.mlp_tile_tokens:,} tokens per tile: one tile's intermediates "
            "at a time, recomputed in each backward"
        )
    if p.parked_layers:
        notes.append(f"boundary activations: {p.parked_layers} of {s.layers} layers in host memory")
    if p.resident_units:
        notes.append(f"GPU-resident state: {p.resident_units} leading units")
    if p.gpu_stepped_units:
        notes.append(
            f"GPU-stepped: {p.gpu_stepped_units} leading streamed units (state {p.state_bytes(1024) / 1024:g} B/param "
            "host->device and back each step, fused CUDA AdamW; gradients wait on the GPU)"
        )
    if p.embed_rows:
        notes.append(
            f"embedding: stepped in host memory, fetched as the rows a step looks up (at most "
            f"{looked_up_rows(s, b):,}); those rows updated first, the whole table in the backward sweep"
        )
    if p.keep_layers:
        notes.append(f"kept graphs: last {p.keep_layers} layers (not recomputed)")
    p.notes = notes
    return p


# ---------------------------------------------------------------------------- what is there
def host_available(meminfo: str = "/proc/meminfo") -> int | None:
    """MemAvailable in bytes (None where /proc/meminfo is not there). Virtual machines whose
    memory grows as it is used report too little here: set max_host_memory there."""
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


def optimizer_threads(ranks_per_machine: int = 1) -> int:
    """CPU threads of one process's AdamW: the machine's cores shared by its ranks' optimizers,
    with one core each left free for the thread that launches kernels (the optimizer's OpenMP
    threads would otherwise preempt it and starve the GPU)."""
    return max(1, (os.cpu_count() or 2) // ranks_per_machine - 1)


def measure(
    device, max_gpu_memory: int | None = None, max_host_memory: int | None = None, world: Layout | None = None
) -> Machine:
    """The budgets of a run on `device` (a torch.device or "cpu"/"cuda[:N]"): the caps where the
    user set them, else what is free now; and this host's CPU AdamW rate (`host_adam_rate`).
    `world`: the data-parallel world the machine belongs to (layout.py; default one process)."""
    kind = str(device).split(":")[0]
    gpu = None
    if kind == "cuda":
        gpu = max_gpu_memory if max_gpu_memory is not None else gpu_available(device)
    host = max_host_memory if max_host_memory is not None else host_available()
    world = world or Layout()
    capped = max_gpu_memory is not None
    return Machine(kind, gpu, host, gpu_capped=capped, adam_params_s=host_adam_rate(kind, world), world=world)


def host_adam_rate(kind: str, world: Layout, again: bool = False) -> float:
    """The CPU AdamW rate (parameters/s) a plan on a `kind` device assumes: measured (~0.1 s) where
    the run happens (`measured_adam_rate` of `probe.adam_rate`, torch's fused fp32 kernel); else
    ADAM_PARAMS_S. `again` (CUDA): read the host once more and keep the best of this process's
    readings."""
    from .probe import adam_rate

    rate = measured_adam_rate(kind, world, adam_rate, again)
    return ADAM_PARAMS_S if rate is None else rate


def measured_adam_rate(
    kind: str, world: Layout, reading: Callable[[int, int, bool], float | None], again: bool = False
) -> float | None:
    """The host AdamW rate a plan on a `kind` device takes from `reading(threads, parameters,
    again)`, a kernel's pass alone in parameters/s (None: it does not run here): on the CPU on
    torch's threads, over CPU_ADAM_PROBE parameters, as read; on CUDA on the optimizer threads of
    all the machine's ranks, over ADAM_PROBE, times ADAM_IN_STEP (`again` passed on). None where
    the run does not happen here (planned from a login node, or by a rank whose plan is not run)."""
    import torch

    from ..parallel.distributed import plans_for_all
    from .probe import ADAM_PROBE, CPU_ADAM_PROBE

    # This host's rate only where the run will happen (not when planning from a login node): the
    # machine's, all its ranks' optimizer threads together (each steps its share of every unit at
    # once, and AdamW is bound by the host's memory bandwidth, which they share). Measured by the
    # rank whose plan all run, alone: the others measuring at once would oversubscribe the cores.
    if kind == "cpu" and plans_for_all():  # planned where it runs; the optimizer steps after the backward
        return reading(torch.get_num_threads(), CPU_ADAM_PROBE, False)
    if not (kind == "cuda" and torch.cuda.is_available() and plans_for_all()):
        return None
    threads = world.ranks_per_machine * optimizer_threads(world.ranks_per_machine)
    rate = reading(threads, ADAM_PROBE, again)
    return None if rate is None else ADAM_IN_STEP * rate


def allocator_fraction(machine: Machine, total_gpu_bytes: int) -> float | None:
    """The share of the card the CUDA caching allocator may take under a user's max_gpu_memory
    (torch.cuda.set_per_process_memory_fraction), or None without a cap."""
    if not machine.gpu_capped or machine.gpu_bytes is None:
        return None
    return max(0.01, min(1.0, (machine.gpu_bytes - CUDA_CONTEXT) / total_gpu_bytes))
