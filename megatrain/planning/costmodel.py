"""How long a placement's optimizer step takes: the step-time model behind the plan.

`step_time` estimates the seconds of one optimizer step of a `Plan` from the model's shape, the
step's tokens and the machine's rates. It counts the GPU's compute (each layer's forward and
backward, the recompute of the layers whose graphs are not kept (none in a micro-batch-major
step, `Plan.update_order`), the second backward sweep of a two-pass step, the MLP tiles recomputed in each backward, causal attention over the keys a token
covers), the PCIe traffic (weights in, from the compute-dtype copy where there is one,
gradients out, parked activations, the fp32 state of
GPU-stepped units both ways, the embedding's looked-up rows where those are fetched), the CPU AdamW and how much of it the overlap hides (the next
forward sweep; in two-pass and immediate steps the backward sweep that lands the gradients), the
GPU's wait for the GPU-stepped state, the optimizer's interference with the sweep it hides
behind, and the disk tier's reads and writes beyond the AdamW they overlap. The plan only compares
choices with it and projects step times: an estimate, not a promise. It decides nothing;
footprint.py's `evaluate` calls it beside the memory model.

The rates below were measured on H100/H200 with 16-core hosts (bench/README.md). Where the run
happens, the plan uses the layer's rate measured on the device by probe.py
(`LayerMemory.flops_per_s`; where the probe split it, the causal attention's rate and the rest's
apart: at long context attention is most of the work and runs slower than the matmuls; on the CPU,
the rate of a matmul shaped like the layer's, `probe.cpu_layer_memory`) instead of GPU_FLOPS, and
this host's AdamW rate
(`probe.adam_rate`, times ADAM_IN_STEP; for bf16 and 8-bit moments their own kernel's pass timed
alike, `Machine.moment_adam_params_s`) instead of ADAM_PARAMS_S, and the disk tier's read and
write rates measured in offload_dir at start (`host.disk.measure_drives`, summed over its folders) instead of DISK_BYTES_S;
PCIE_BYTES_S is always the constant (all are the `Machine`'s defaults, planspec.py; the figures'
sources are below).
bench/host-only.md has the model's terms for GPU-stepped units; tests/test_costmodel_replay.py
replays the recorded runs of them (`python bench/replay.py --steps bench/results/*.json` lists
every run's measured and predicted step).
"""

from __future__ import annotations

from ..host.moments import FORMATS
from .planspec import Batch, Machine, Plan, Shape, fetch_bytes, looked_up_rows

# --- rates of the cost model (measured on H100/H200 with 16-core hosts; see shared figures in
# bench/README.md). The plan only compares choices with them and projects step times.
GPU_FLOPS = {"cuda": 550e12, "cpu": 0.5e12}  # where nothing was measured (a CPU run measures its own)
# The link's rate one way (planspec.PCIE_BYTES_S, the plan never measures it): 55 GB/s, what whole
# units' page-locked copies moved alone on an H200 host (55.5 host->device, 55.4 back; bench/link.py,
# results/2026-11-23_2217_link.md). At 45, the figure of the earlier schedules, today's prestaged
# schedule was predicted 20-35% slow with model A at 24-30 units and 8B at 16k tokens
# (2026-11-23_2217_a16-count.json, _2224_auto.json, _2228_a16-count2.json, _2234_b16-auto.json,
# _2236_auto-repeat.json); at 55 no plan of the recorded runs without GPU-stepped units changes.
# Both directions at once move more than one, but not twice. Page-locked copies alone moved 102
# GB/s both ways together on an H200 host, 70 beside the CPU AdamW on 15 threads (the same
# results). Since the GPU-stepped units' write-backs queue behind all their kernels (gpustep.py),
# the steps carry both directions at once: 84-89 GB/s together at 26-28 units (the runs above),
# where the earlier schedule never passed 56.6-59.5. 1.6 x 55 = 88 GB/s.
PCIE_DUPLEX_GAIN = 1.6
# The fused CPU AdamW runs at ~5.8 G params/s alone on 15 threads but ~3 G/s inside a training step
# (it shares host memory bandwidth with the copies and cores with the launching thread), and even
# "hidden" behind the next forward sweep it slows that sweep by about a quarter of its own time.
# ADAM_IN_STEP is the share of the probe's reading a step's host AdamW keeps. 0.55 until
# 2026-11-28; since the engine's own kernel (engine/clipadam.py: shared blocks, every flag
# combination vectorised) the steps' passes ran at 0.56-0.67 of their process's reading on the
# 32-core two-H200 host (8B at 16k, all state in host memory: results/2026-11-28_0414, _0437,
# _0555, _0558, _0624) and 0.75 on a 16-core H100 host (_0410). At 0.55 the plan under-read every
# one of them, and `auto` stepped more units on the GPU than a count measured faster: 24 units
# with 4 kept graphs ran 4.2% faster than the 26 `auto` chose, one process apart (_0555, _0558).
# At 0.62 the next three such steps ran at 0.62-0.67 of their reading (_0746, _0755, _0809), and
# `auto`'s plans came within 2% of the measured steps (results/2026-11-28_0825_summary.md).
ADAM_IN_STEP = 0.62
OPT_INTERFERENCE = 0.25
# Where gradients land during the backward sweep (two-pass, immediate), the CPU AdamW steps each
# unit as it lands and ran 1.16-1.24x faster than ADAM_IN_STEP says (three two-pass runs: 3.6B,
# 8.7B of 120B-class layers, 18.7B; bench/results/2026-11-22_2215_memory.json, _2236_x2.json).
ADAM_LANDING_GAIN = 1.2
# The fused CUDA AdamW: ~1 ms per GB of fp32 state (weights and moments) on H100/H200.
GPU_ADAMW_STATE_BYTES_S = 1e12
# The host AdamW's rate in each moment format (host/moments.py's `Moments.name`). bf16 and 8-bit
# moments are stepped by engine/momentkernel.py's kernel, whose pass the plan times on this host
# as it times fp32's (`Machine.moment_adam_params_s`, runtime.probe_machine): its share of fp32's
# rate is the machine's. On a 2-core CPU, two threads, 8-bit read 0.5 of clipadam's fp32 pass and
# bf16 0.8 (bound by the cores: docs/memory.md's optim section); on a 16-core H200 host, inside an
# 8B step, 8-bit ran at 0.95 (3.48 against 3.66 G params/s: there fp32's pass is bound by memory),
# a 4.23 s step that the 2-core share, a constant before the probe, put at 6.07 s. Where nothing
# is probed (a plan made away from the run's host, at ADAM_PARAMS_S, those hosts' rate) the two
# formats take fp32's rate. Moments of two formats are stepped by engine/moments.py's torch ops, a
# pass over memory an operation: MIXED_RATE of fp32's (docs/memory.md: 12-14%).
MIXED_RATE = 0.1


def adam_params_s(plan: Plan, m: Machine) -> float:
    """Parameters a second of the host AdamW in the plan's moment format on machine `m`."""
    f = plan.moment_format
    if f.name in m.moment_adam_params_s:
        return m.moment_adam_params_s[f.name]
    return m.adam_params_s * (1.0 if f in FORMATS else MIXED_RATE)


def step_time(s: Shape, b: Batch, plan: Plan, m: Machine) -> float:
    """Seconds per optimizer step: GPU compute plus its wait for the updates the overlap does not
    hide, or PCIe traffic plus the link's wait for the CPU optimizer, or both directions' traffic
    at their joint rate, whichever is longest (without GPU-stepped units: compute or PCIe,
    whichever binds, plus the CPU optimizer's unhidden part)."""
    F, Fa = _rates(s, m)
    T, L = b.tokens, s.layers
    attn = 2 * T * (b.attention_span or b.seq_len) * s.q_dim  # causal QK^T and PV, one layer's forward
    layer_fwd = 2 * (s.layer - s.inactive) * T / F + attn / Fa  # seconds
    head = 6 * s.vocab * s.hidden * T / F
    micro_batch_major = plan.update_order == "micro_batch"  # every layer's graph kept, a unit fetched once
    recompute = 0 if micro_batch_major else L - plan.keep_layers
    passes = 2 if plan.grad_mode == "two_pass" else 1
    gpu = 3 * L * layer_fwd + recompute * layer_fwd + head + (passes - 1) * 3 * L * layer_fwd
    backward = 2 * L * layer_fwd + recompute * layer_fwd  # the (last) backward sweep's
    if s.layer_mem.tiles(b.micro_batch_tokens, plan.mlp_tile_tokens):
        tiles = L * 2 * 3 * s.hidden * s.ffn * T / F  # each backward recomputes the MLP's tiles
        gpu += passes * tiles
        backward += tiles
    n = len(s.units)
    host_adam = adam_params_s(plan, m)
    if m.device == "cpu":
        return gpu + s.total / host_adam + _tier_wait(plan, m, host_adam)
    rate = m.pcie_bytes_s
    streamed = sum(s.units[plan.resident_units :])
    gpu_stepped = sum(s.units[u] for u in plan.stepped)
    act_bytes = plan.parked_layers * T * s.hidden * b.compute_bytes
    # A GPU-stepped unit's state crosses each way where a streamed unit's gradient goes out (4 B)
    # and the next forward fetches its weights (`fetch_bytes`): the rest of its state's bytes more.
    extra_in = plan.state_bytes(gpu_stepped) - fetch_bytes(plan, b.compute_bytes) * gpu_stepped
    extra_out = plan.state_bytes(gpu_stepped) - 4 * gpu_stepped
    # Prestaged layers' backward fetches take the updated weights kept on the GPU (a tied head's
    # fetch of the embedding is not counted here either way).
    kept = fetched_bytes(s, b, plan, [u for u in plan.kept_fresh(L, s.embed_again) if u > 0])
    fetches = fetched_bytes(s, b, plan, range(plan.resident_units, n))
    h2d = fetches * (1 if micro_batch_major else 1 + passes) + act_bytes * passes + extra_in - kept
    d2h = 4 * streamed + act_bytes + extra_out
    # The embedding's rows (`embed_rows`): the looked-up rows cross, not the table (its weights in
    # compute dtype, its gradient's rows back in fp32); the host computes those rows in the next
    # forward sweep's window and steps the whole table (`late`) in the backward sweep's.
    rows = looked_up_rows(s, b) * s.hidden if plan.embed_rows else 0
    late = s.units[0] if plan.embed_rows else 0
    if plan.embed_rows:
        h2d += rows * b.compute_bytes - (1 + passes) * fetched_bytes(s, b, plan, [0])
        d2h -= 4 * (s.units[0] - rows)
    pcie = max(h2d, d2h) / rate
    duplex = (h2d + d2h) / (PCIE_DUPLEX_GAIN * rate)  # the link's two directions together
    adam = host_adam * (ADAM_LANDING_GAIN if plan.grad_mode != "stored" else 1)
    cpu = (streamed - gpu_stepped - late + rows) / adam + _tier_wait(plan, m, adam)
    late /= adam
    forward = L * layer_fwd  # the next forward sweep
    if plan.grad_mode == "stored":
        held = sum(s.units[plan.stepped.stop : plan.gpu_grad_units])  # on the GPU, for the CPU optimizer
        cpu = max(cpu, 4 * held / rate)
        window = forward
    else:
        window = 3 * forward  # the backward sweep that lands the gradients
    stretch, gpu_step = _gpu_stepping(s, b, plan, backward, forward, act_bytes, rate)
    waits = max(0.0, cpu - window, gpu_step)  # the GPU, for the last update it needs
    idle = max(0.0, cpu - window)  # the link, for the CPU optimizer (GPU stepping keeps it busy)
    busy = max(gpu + stretch + waits, pcie + idle, duplex, cpu + late)  # the host: all its work
    return busy + OPT_INTERFERENCE * (min(cpu, window) + late)


def fetched_bytes(s: Shape, b: Batch, plan: Plan, units) -> int:
    """Bytes one fetch of each of `units` moves host->device (`fetch_bytes` a parameter)."""
    return fetch_bytes(plan, b.compute_bytes) * sum(s.units[u] for u in units)


def tier_io_s(disk: int, m: Machine) -> float:
    """Seconds the disk tier takes to read `disk` bytes and write them back: each way at most at
    its rate, both together at most at the rate they reached at once (the rates measured at start,
    host/disk.py)."""
    return max(disk / m.disk_read_bytes_s, disk / m.disk_write_bytes_s, 2 * disk / m.disk_duplex_bytes_s)


def _tier_wait(plan: Plan, m: Machine, adam_params_s: float) -> float:
    """Seconds the optimizer's pass waits for the disk tier beyond its AdamW on the tier's units.
    Their moments are read and written once a step (`plan.disk` bytes each way). The ring reads
    ahead of the pass and writes behind it (host/disk.py), so the I/O overlaps the AdamW and the
    pass over a block takes the longer of the two; the blocks are alike, so over the tier too.
    Not counted: the first block's read and the last one's write, which nothing hides, nor the
    blocks the ring still holds from the step before (a few of a tier of hundreds)."""
    if not plan.disk_units:
        return 0.0
    params = plan.disk / plan.moment_format.bytes_per_param
    return max(0.0, tier_io_s(plan.disk, m) - params / adam_params_s)


def _rates(s: Shape, m: Machine) -> tuple[float, float]:
    """FLOP/s of the layers' matmuls and of their attention: the machine's rate where it is given,
    else the probe's split where it measured one (attention runs slower at long context), else the
    probe's rate (or GPU_FLOPS) for both."""
    if m.gpu_flops:
        return m.gpu_flops, m.gpu_flops
    lm = s.layer_mem
    if lm.dense_flops_per_s and lm.attention_flops_per_s:
        return lm.dense_flops_per_s, lm.attention_flops_per_s
    F = lm.flops_per_s or GPU_FLOPS[m.device]
    return F, F


def _gpu_stepping(
    s: Shape, b: Batch, plan: Plan, backward_s: float, forward_s: float, act_bytes: int, rate: float
) -> tuple[float, float]:
    """The GPU-stepped units' time on the critical path: how long the GPU waits for their state
    beyond the sweeps it comes in beside (prestaged), and its wait after the clip before the next
    forward sweep has their updated weights. Their way back overlaps the next sweeps; the link's
    total traffic bounds it."""
    stepped = sum(s.units[u] for u in plan.stepped)
    prestaged = sum(s.units[u] for u in plan.prestaged)
    if not prestaged:
        # The state comes in after the clip through two scratch slots, one loading while the other
        # is written back: both ways at once, at the link's joint rate. The GPU waits for all of
        # it; the next forward sweep hides none of it (it shares the link with its own fetches).
        # Measured (model A, 16k tokens, H100, results/2026-11-23_0402_gpustep.json): 30 such
        # units took 1.85 s a step, where hiding a forward's length of it predicted 1.67 and this
        # 1.90 (15 and 22 units within 4%); the 14.77B shape with 39 (`auto`'s count there, too
        # many to prestage) 6.42 s, this 6.80 (PERFORMANCE.md, 2026-11-26).
        return 0.0, 2 * plan.state_bytes(stepped) / (PCIE_DUPLEX_GAIN * rate)
    # Prestaged: the backward sweep carries its fetches (the weights of the recomputed streamed
    # layers but the prestaged ones), the parked activations and the state. The step stream takes
    # the units in forward order, each once its state is in, and the next forward sweep waits
    # only for the unit it reaches: the state has the backward sweep and the next forward sweep
    # up to the last stepped unit. Counted over the backward sweep alone, model A at 16k tokens
    # with 26-30 of 30 units was predicted 8-18% slow even at 55 GB/s, where the GPU was busy
    # 90-96% of the step (results/2026-11-23_2224_auto.json, _2228_a16-count2.json,
    # _2236_auto-repeat.json); counted so, -2% to +11%.
    skip = set(plan.kept_fresh(s.layers, s.embed_again))
    recomputed = range(max(1, plan.resident_units), s.layers - plan.keep_layers + 1)
    fetched = fetched_bytes(s, b, plan, [u for u in recomputed if u not in skip])
    link = (fetched + act_bytes + plan.state_bytes(prestaged)) / rate
    reach = forward_s * min(plan.stepped.stop - 1, s.layers) / max(1, s.layers)
    return max(0.0, link - backward_s - reach), plan.state_bytes(prestaged) / GPU_ADAMW_STATE_BYTES_S
