"""Units stepped on the GPU from state streamed out of host memory (`gpu_step_units`): what the
plan predicts for them (memory, step time), the refusals, and the stepper's arithmetic and
bookkeeping run in program order on the CPU. The CUDA schedule itself is tested in test_gpu.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import tiny_config
from test_checkpoint import make_run, one_thread, write_yaml  # noqa: F401 (fixture)
from test_cli import run_cli
from test_placement import STEP16K, cuda, llama

from megatrain.config import TrainConfig
from megatrain.engine.gpustep import GpuStepper
from megatrain.engine.optim import AdamWConfig, HostAdamW, clip_scaled
from megatrain.errors import ConfigError
from megatrain.host.split import HALF_BYTES, to_bf16
from megatrain.host.state import HostState, build_units, state_bytes
from megatrain.io.weights import init_random
from megatrain.models.config import ModelConfig
from megatrain.parallel.distributed import Single
from megatrain.parallel.layout import Layout
from megatrain.planning import costmodel, footprint, placement, planspec
from megatrain.planning.placement import Choices, Machine, Plan
from megatrain.planning.probe import formula_layer_memory
from megatrain.runtime import build_model

A = llama(3072, 28, 24, 8, 8192)  # 3.6B: 30 units (embedding, 28 layers, head)

STATE_BYTES = int(state_bytes())  # fp32 weights and moments a parameter


def _off(cfg, k: int, machine: Machine | None = None, batch=STEP16K, prestage: bool | None = None) -> Plan:
    """All state in host memory, the first `k` units GPU-stepped; their state loaded during the
    backward sweep (`prestage=True`), after the clip (False: the schedule the committed runs
    measured) or as the plan chose (None)."""
    m = machine or cuda(139, 1000)
    p = placement.plan(cfg, batch, m, Choices(gpu_state="off", gpu_step_units=k))
    if prestage is None:
        return p
    shape = planspec.model_shape(cfg, formula_layer_memory(cfg, batch.compute_bytes))
    return footprint.evaluate(shape, batch, dataclasses.replace(p, prestage=prestage), m)


def _numel(cfg) -> list[int]:
    return [u.numel for u in build_units(cfg)]


# ---------------------------------------------------------------------------- plan and memory
def test_the_plan_steps_on_the_gpu_only_when_asked_and_honours_the_users_count():
    for choices in (Choices(), Choices(gpu_state="off")):
        assert placement.plan(A, STEP16K, cuda(139, 1000), choices).gpu_stepped_units == 0
    p = _off(A, 8)
    assert p.gpu_stepped_units == 8 and list(p.stepped) == list(range(8))
    assert any(n.startswith("GPU-stepped: 8 leading streamed units") for n in p.notes)
    assert _off(A, 99).gpu_stepped_units == 30  # at most every unit
    # after the resident units, which keep their place; where the plan spends free GPU memory on
    # resident state, on the units before them
    r = placement.plan(A, STEP16K, cuda(139, 1000), Choices(resident_units=25, gpu_step_units=10))
    assert (r.resident_units, r.gpu_stepped_units, list(r.stepped)) == (25, 5, [25, 26, 27, 28, 29])
    auto = placement.plan(A, STEP16K, cuda(139, 1000), Choices(gpu_step_units=4))
    assert auto.gpu_stepped_units == 4 and list(auto.stepped) == list(
        range(auto.resident_units, auto.resident_units + 4)
    )
    assert auto.resident_units > 10


def test_gpu_stepped_units_keep_their_gradients_on_the_gpu_not_in_host_memory():
    """Their gradients wait on the GPU (page-locked host memory no longer holds them), their
    moments are page-locked in place; host memory grows by nothing."""
    n = _numel(A)
    p0, p8 = _off(A, 0), _off(A, 8)
    grads = "fp32 gradients waiting for the clip (page-locked)"
    assert p0.host[grads] - p8.host[grads] == 4 * sum(n[:8])
    assert p0.host_total - p8.host_total == 4 * sum(n[:8])
    assert p8.pinned - p0.pinned == 8 * sum(n[:8]) - 4 * sum(n[:8])
    assert p8.gpu_grad_lead == 8 and p0.gpu_grad_lead == 0
    assert "the 8 leading units' on the GPU, the other 22 in host memory" in p8.notes[0]


def test_gpu_peak_grows_by_the_scratch_the_held_gradients_and_the_kept_weights():
    """State loaded after the clip: two chunks of scratch in every phase; at the end of the
    backward sweep every GPU-stepped gradient waits for the clip; at the start of the next forward
    sweep the gradients not yet stepped and the updated weights (compute dtype) of the units past
    the fetch window."""
    n = _numel(A)
    scratch = footprint.STEP_SLOTS * STATE_BYTES * planspec.STAGING_CHUNK  # layers are larger
    halves = 2 * HALF_BYTES * planspec.STAGING_CHUNK  # the master's halves landing and leaving
    p0, p8, pall = (_off(A, k, prestage=False) for k in (0, 8, 30))
    assert p8.gpu["GPU-stepped state (scratch)"] == scratch
    assert p8.gpu["GPU-stepped weights' halves (landing, leaving)"] == halves
    assert "GPU-stepped state (scratch)" not in p0.gpu
    assert p8.gpu_peak >= p0.gpu_peak + scratch
    peaks0 = footprint.phase_peaks(A, STEP16K, p0)
    peaks = footprint.phase_peaks(A, STEP16K, pall)
    assert peaks["backward"] >= 4 * sum(n) + scratch > peaks0["backward"]
    first_fetch_window = 2 + p0.prefetch  # forward at layer 0: units 1 .. 1 + prefetch in its window
    held = 4 * sum(n[2:]) + 2 * sum(n[first_fetch_window:])
    assert peaks["forward"] >= held + scratch > peaks0["forward"]
    assert pall.gpu_peak == max(peaks.values())


def test_prestaged_state_waits_on_the_gpu_through_the_backward_sweep():
    """Prestaged (where gradients are held for the clip): the stepped units' fp32 state (12
    B/param) is on the GPU in every backward phase, beside their gradients, and in the next
    forward sweep until its write-back (in forward order, as the host optimizer's); their updated
    weights (2 B/param) from the forward sweep to their backward fetch; no scratch. Two-pass and
    immediate steps load it after the clip, through scratch, as before."""
    n = _numel(A)
    scratch = footprint.STEP_SLOTS * STATE_BYTES * planspec.STAGING_CHUNK
    p8, old8 = _off(A, 8, prestage=True), _off(A, 8, prestage=False)
    assert list(p8.prestaged) == list(range(8)) and list(old8.prestaged) == []
    assert "GPU-stepped state (scratch)" not in p8.gpu
    assert p8.gpu["GPU-stepped state (prestaged)"] == STATE_BYTES * sum(n[:8])
    assert p8.gpu["GPU-stepped weights' halves (landing, leaving)"] == 2 * HALF_BYTES * planspec.STAGING_CHUNK
    new, old = (footprint.phase_peaks(A, STEP16K, p) for p in (p8, old8))
    # beside them, the updated weights of layers 1..7 wait for their backward fetch (2 B/param)
    state, kept = STATE_BYTES * sum(n[:8]), 2 * sum(n[1:8])
    assert state - scratch <= new["backward"] - old["backward"] <= state + kept - scratch
    assert new["head"] - old["head"] == kept - scratch  # the state loaded from the head's gradient on
    # next forward at layer j (unit j + 1 computing): the state of units j + 2 .. 7 is not back
    # yet, where their gradients waited before (stepped right after the clip now)
    assert 0 < new["forward"] - old["forward"] <= (STATE_BYTES - 4) * sum(n[2:8]) - scratch
    assert p8.gpu_peak == max(new.values()) > old8.gpu_peak
    for mode in ("two_pass", "immediate"):
        assert list(dataclasses.replace(p8, grad_mode=mode).prestaged) == []


def test_step_time_falls_while_the_cpu_optimizer_binds_and_rises_once_pcie_does():
    """Model A at 16k tokens, all state in host memory: the CPU AdamW (3 G params/s) binds at
    k=0; moving units to the GPU shortens the step until their state traffic (12 B/param each
    way) makes PCIe bind. With a CPU optimizer fast enough to hide, GPU stepping gains nothing
    (its interference with the sweep was under a millisecond) and each further unit costs PCIe
    traffic."""
    times = [_off(A, k, prestage=False).step_time_s for k in range(31)]
    best = min(range(31), key=times.__getitem__)
    assert 8 < best < 30
    assert all(times[k + 1] < times[k] for k in range(best))
    assert all(times[k + 1] > times[k] for k in range(best + 1, 30))
    assert times[best] < 0.8 * times[0]
    fast_cpu = Machine("cuda", 139 * 2**30, 1000 * 2**30, adam_params_s=1e12)
    base = _off(A, 0, fast_cpu).step_time_s
    fast = [_off(A, k, fast_cpu).step_time_s for k in (1, 8, 15, 22, 30)]
    assert min(fast) > base - 1e-3 and fast[-1] > fast[-2] > base


def test_gpu_stepping_costs_its_state_on_pcie():
    """Each GPU-stepped parameter moves 8 bytes more out and 10 more in (12 B of state where a
    streamed unit moves a 4 B gradient out and 2 B of weights in for the next forward: the
    master's bf16 half). Where nothing else
    binds, the link is the step: each direction's bytes at the one-way rate, or both together at
    the joint rate (PCIE_DUPLEX_GAIN times one direction's), whichever is longer; with either
    schedule (prestaged, less the layers' backward fetches, which take their kept weights). Where
    the CPU keeps up: loaded after the clip, the GPU waits for the stepped state (the next forward
    sweep hides none of it), which goes in and out through two scratch slots at once, each
    further unit costing its 24 B/param at the joint rate; prestaged, the backward sweep carries
    it beside its own fetches and the way back overlaps the next sweeps, so each further unit
    costs at least its state's way in and at most its bytes both ways, at the joint rate, less
    the backward fetches its kept weights save."""
    n, rate = _numel(A), planspec.PCIE_BYTES_S
    duplex = costmodel.PCIE_DUPLEX_GAIN * rate
    link_only = Machine("cuda", 139 * 2**30, 1000 * 2**30, gpu_flops=1e18, adam_params_s=1e15)
    total = sum(n)
    for prestage in (True, False):
        for k in (0, 4, 15, 30):
            t = _off(A, k, link_only, prestage=prestage).step_time_s
            # prestaged layers' backward fetches take their updated weights, kept on the GPU
            saved = 2 * sum(n[1 : min(k, 29)]) if prestage else 0
            h2d = 4 * total + 10 * sum(n[:k]) - saved  # two fetches a step, the state less a fetch
            d2h = 4 * total + 8 * sum(n[:k])  # the gradients, the state less a gradient
            assert t == pytest.approx(max(h2d / rate, d2h / rate, (h2d + d2h) / duplex), abs=1e-4), k
    fast_cpu = Machine("cuda", 139 * 2**30, 1000 * 2**30, adam_params_s=1e15)
    t22, t30 = (_off(A, k, fast_cpu, prestage=False).step_time_s for k in (22, 30))
    assert t30 - t22 == pytest.approx(24 * sum(n[22:30]) / duplex, rel=1e-6)
    t22, t30 = (_off(A, k, fast_cpu, prestage=True).step_time_s for k in (22, 30))
    both_ways = 24 * sum(n[22:30]) - 2 * sum(n[22:29])  # the state both ways, less the layers' fetches
    way_in = 12 * sum(n[22:30]) - 2 * sum(n[22:29])  # the state in, less the layers' fetches
    assert way_in / duplex - 1e-6 <= t30 - t22 <= both_ways / duplex + 1e-6


def test_gpu_stepping_in_every_gradient_mode_is_counted():
    """Two-pass and immediate steps: units stepped during the backward sweep keep their updated
    weights on the GPU from then on, so its last phase (the embedding's, the peak of this model:
    tied, with a wide vocabulary and short rows) holds those of every other unit, beside the
    scratch; where the CPU optimizer binds, the step is shorter."""
    cfg = ModelConfig.from_hf(
        tiny_config(
            "llama",
            True,
            hidden_size=2048,
            num_hidden_layers=8,
            num_attention_heads=16,
            num_key_value_heads=4,
            intermediate_size=5632,
            vocab_size=262144,
        )
    )
    n = _numel(cfg)
    scratch = (
        footprint.STEP_SLOTS * STATE_BYTES + 2 * HALF_BYTES
    ) * planspec.STAGING_CHUNK  # and the halves'
    slow_cpu = Machine("cuda", 139 * 2**30, 1000 * 2**30, adam_params_s=1e9)  # it binds, not the link
    for mode, clip in (("two_pass", True), ("auto", False)):
        batch = placement.Batch(1024, 1, 1024, 2, clip)
        p0, p = (
            placement.plan(cfg, batch, slow_cpu, Choices("off", mode, gpu_step_units=k)) for k in (0, 10)
        )
        assert p.grad_mode == p0.grad_mode == ("two_pass" if mode == "two_pass" else "immediate")
        assert p.gpu_stepped_units == 10 and p.resident_units == 0
        peak0, peak = (footprint.phase_peaks(cfg, batch, q)["backward"] for q in (p0, p))
        if p.grad_mode == "immediate":
            assert peak - peak0 == scratch + 2 * sum(n[1:])
        assert peak > peak0 + scratch
        assert p.step_time_s < p0.step_time_s


def test_auto_steps_the_fastest_count_that_fits_and_none_where_it_does_not_pay():
    """`gpu_step_units: auto` (None): the fewest units whose step is within STEPPING_TOLERANCE of
    the shortest among the user-count plans, where the CPU optimizer binds; none where the CPU
    keeps up, where the count's memory does not fit, or in a data-parallel world (not built
    there). (Kept graphs pinned to none: `test_auto_keeps_graphs_under_the_stepped_peak`.)"""
    auto = Choices(gpu_state="off", gpu_step_units=None, keep_layers=0, embedding_rows=False)
    p = placement.plan(A, STEP16K, cuda(139, 1000), auto)
    times = {k: _off(A, k).step_time_s for k in range(31)}
    near = (1 + placement.STEPPING_TOLERANCE) * min(times.values())
    assert 0 < p.gpu_stepped_units < 30 and p.step_time_s < 0.9 * times[0]
    assert p.step_time_s == pytest.approx(times[p.gpu_stepped_units]) and p.step_time_s <= near
    assert all(times[k] > near for k in range(p.gpu_stepped_units))
    assert min(times, key=times.get) >= p.gpu_stepped_units  # never more memory than the fastest
    fast_cpu = Machine("cuda", 139 * 2**30, 1000 * 2**30, adam_params_s=1e12)
    assert placement.plan(A, STEP16K, fast_cpu, auto).gpu_stepped_units == 0
    # Smaller GPUs: fewer units (their held gradients), then none (not even the scratch fits with
    # the allocator's headroom); the state loaded after the clip where prestaging it (12 B/param
    # more) does not fit
    small = cuda(24, 1000)
    plans = [placement.plan(A, STEP16K, cuda(gib, 1000), auto) for gib in (8, 11)]
    plans.append(placement.plan(A, STEP16K, small, auto))
    counts = [q.gpu_stepped_units for q in plans]
    assert counts[0] == 0 < counts[1] <= counts[2] < p.gpu_stepped_units
    assert p.prestaged and not plans[2].prestaged
    shape = planspec.model_shape(A, formula_layer_memory(A, STEP16K.compute_bytes))
    for k in (counts[2], p.gpu_stepped_units):  # the fastest count prestaged does not fit, nor this
        staged = dataclasses.replace(plans[2], gpu_stepped_units=k, prestage=True)
        assert not footprint.fits(footprint.evaluate(shape, STEP16K, staged, small), small), k
    two = Machine("cuda", 139 * 2**30, 1000 * 2**30, world=Layout(ranks=2))
    assert placement.plan(A, STEP16K, two, auto).gpu_stepped_units == 0
    # none in a two-pass step (measured no faster there), though the model says a count is
    twopass = Choices(gpu_state="off", gradient_placement="two_pass", gpu_step_units=None)
    q = placement.plan(A, STEP16K, cuda(139, 1000), twopass)
    assert q.grad_mode == "two_pass" and q.gpu_stepped_units == 0
    counted = placement.plan(A, STEP16K, cuda(139, 1000), dataclasses.replace(twopass, gpu_step_units=8))
    assert counted.gpu_stepped_units == 8 and counted.step_time_s < 0.95 * q.step_time_s


def test_auto_stores_the_gradients_where_stepped_units_make_host_room_for_them():
    """A host too small for every unit's gradient beside the state makes the step two-pass (a
    second backward sweep). GPU-stepped units' gradients wait on the GPU, so with enough of them
    the rest fit the host: `auto` then stores gradients (no second sweep) where that is faster,
    within the host's budget; not where the user asked for two-pass."""
    stored = placement.plan(A, STEP16K, cuda(139, 1000), Choices(gpu_state="off", gradient_placement="host"))
    twopass = placement.plan(
        A, STEP16K, cuda(139, 1000), Choices(gpu_state="off", gradient_placement="two_pass")
    )
    host = (stored.host_total + twopass.host_total) // 2  # holds the state, not every gradient
    m = Machine("cuda", 139 * 2**30, int(host / (1 - footprint.HOST_RESERVE)))
    assert placement.plan(A, STEP16K, m, Choices(gpu_state="off")).grad_mode == "two_pass"
    p = placement.plan(A, STEP16K, m, Choices(gpu_state="off", gpu_step_units=None))
    assert p.grad_mode == "stored" and p.gpu_stepped_units > 0
    assert p.host_total <= host and footprint.fits(p, m)
    assert p.step_time_s < 0.95 * placement.plan(A, STEP16K, m, Choices(gpu_state="off")).step_time_s
    asked = Choices(gpu_state="off", gradient_placement="two_pass", gpu_step_units=None)
    assert placement.plan(A, STEP16K, m, asked).gpu_stepped_units == 0
    # without it, the two-pass plan's note says what `auto` would do
    (note,) = [n for n in placement.plan(A, STEP16K, m, Choices(gpu_state="off")).notes if "two-pass" in n]
    assert f"gpu_step_units: auto would store them, {p.gpu_stepped_units} units stepped on the GPU" in note
    assert f"~{p.step_time_s:.2f} s a step against" in note
    assert not [n for n in placement.plan(A, STEP16K, m, asked).notes if "would store" in n]


def test_a_count_whose_prestaged_state_does_not_fit_is_loaded_after_the_clip():
    """The user's count on a GPU too small to hold its state through the backward sweep: the
    state comes in after the clip, through scratch, with the gradients still held (not refused,
    not a two-pass step)."""
    small = cuda(16, 1000)
    p = _off(A, 15, small)
    assert (p.grad_mode, p.gpu_stepped_units, list(p.prestaged)) == ("stored", 15, [])
    assert footprint.fits(p, small) and not footprint.fits(_off(A, 15, small, prestage=True), small)


# ---------------------------------------------------------------------------- refusals
def test_gpu_step_units_is_validated_in_one_line():
    for bad in (-1, "fast"):
        with pytest.raises(
            ConfigError,
            match=rf"^gpu_step_units: must be auto or a number of units >= 0 \(0: none\) \(got {bad!r}\)$",
        ):
            TrainConfig(model_config="m", gpu_step_units=bad)
    with pytest.raises(ConfigError, match=r"^gpu_step_units: expected int or str, got 2.5$"):
        TrainConfig.from_dict({"model_config": "m", "gpu_step_units": 2.5})
    assert TrainConfig.from_dict({"model_config": "m", "gpu_step_units": "auto"}).gpu_step_units == "auto"


def test_gpu_stepping_is_refused_on_the_cpu_and_in_a_data_parallel_world(tmp_path, capsys):
    base = make_run(tmp_path)
    path = write_yaml(tmp_path / "run.yaml", dict(base, device="cpu", output_dir=str(tmp_path / "out")))
    for command in ("plan", "train"):
        rc, stdout, err = run_cli(capsys, command, path, "gpu_step_units=2")
        lines = err.strip().splitlines()
        assert rc == 2 and len(lines) == 1, stdout + err
        assert lines[0] == (
            "megatrain: error: gpu_step_units: steps units on a GPU, and this run is on the CPU (set it to 0)"
        )
    assert not (tmp_path / "out").exists()
    # planned for a GPU elsewhere, it is shown
    rc, stdout, _ = run_cli(capsys, "plan", path, "device=cuda", "max_gpu_memory=8GiB", "gpu_step_units=2")
    assert rc == 0 and "plan: GPU-resident state: 3 leading units" in stdout  # the rest
    assert "plan: GPU-stepped: 2 leading streamed units" in stdout
    assert "GPU-stepped state (prestaged)" in stdout

    class TwoRanks(Single):
        world_size = local_world_size = 2

    cfg = ModelConfig.from_json(tmp_path / "model")
    plan = Plan("cuda", "stored", 0, 0, 0, 0, 64, gpu_stepped_units=1)
    with pytest.raises(ConfigError, match=r"^gpu_step_units: not supported with several processes yet \(2;"):
        build_model(cfg, device="cpu", plan=plan, collective=TwoRanks())
    with pytest.raises(
        ConfigError, match=r"^gpu_step_units: steps units on a GPU, and this run is on the CPU"
    ):
        build_model(cfg, device="cpu", plan=plan)  # a plan made by hand is refused too


# ---------------------------------------------------------------------------- the stepper
def _state(cfg: ModelConfig, seed: int) -> HostState:
    state = HostState(build_units(cfg))
    init_random(state, cfg, seed)
    g = torch.Generator().manual_seed(seed)
    state.exp_avg.copy_(torch.randn(state.numel, generator=g) * 1e-3)
    state.exp_avg_sq.copy_(torch.rand(state.numel, generator=g) * 1e-5)
    return state


def _copy(state: HostState) -> HostState:
    out = HostState(state.units)
    for w in state.buffers:
        getattr(out, w).copy_(getattr(state, w))
    return out


def test_the_stepper_steps_in_chunks_exactly_as_the_host_optimizer_steps_whole_units():
    """In program order (the CPU), the stepper's chunks of scratch (smaller than a parameter,
    crossing parameter boundaries, two slots reused across units and steps) give bitwise the
    host optimizer's update of each whole unit, clipped; other units are untouched; each unit's
    next fetch gets its updated weights in compute dtype, once; a skipped update changes
    nothing."""
    cfg = ModelConfig.from_hf(tiny_config("qwen2"))
    state = _state(cfg, 0)
    ref = _copy(state)
    adamw = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    units = state.units[:3]
    stepper = GpuStepper(state, adamw, units, torch.bfloat16, chunk=1000)
    host = HostAdamW(ref, adamw)
    g = torch.Generator().manual_seed(1)
    coef = torch.tensor(0.37)
    for step in (1, 2):
        grads = [torch.randn(u.numel, generator=g) for u in units]
        stepper.step([(u, gr.clone()) for u, gr in zip(units, grads)], coef, 1e-2, step)
        for u, gr in zip(units, grads):
            host.step_range(u, 0, u.numel, clip_scaled(gr, coef), 1e-2, step)
        for w in state.buffers:
            assert torch.equal(getattr(state, w), getattr(ref, w)), (step, w)
        for u in units:
            fresh, _ = stepper.take(u)
            assert torch.equal(fresh, ref.flat(u, "hi"))
            assert stepper.take(u) is None
    assert stepper.take(state.units[3]) is None and 3 not in stepper and 2 in stepper
    assert stepper.h2d_bytes == stepper.d2h_bytes == 2 * 12 * sum(u.numel for u in units)
    before = state.master()
    stepper.step([(units[0], torch.randn(units[0].numel))], None, 1e-2, 3, skip=torch.tensor(True))
    assert torch.equal(state.master(), before)
    assert torch.equal(stepper.take(units[0])[0], to_bf16(before[: units[0].numel]))


def test_prestaged_stepping_equals_the_chunked_path_and_whole_unit_adamw_bitwise():
    """In program order (the CPU): state loaded a share at a time as the backward sweep hands
    over gradients (the first unit split between two loads, a step begun with only part of it
    loaded, a discarded prestage) and stepped in place gives bitwise what the chunked path
    through scratch and AdamW on each whole unit give, clipped, over several steps; the fresh
    weights too, kept for a second fetch where asked; a skipped update changes nothing. Each step
    loads each unit's state once."""
    cfg = ModelConfig.from_hf(tiny_config("qwen2"))
    adamw = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    state = _state(cfg, 0)
    ref, chunked_state = _copy(state), _copy(state)
    units = state.units[:3]
    total = sum(u.numel for u in units)
    staged = GpuStepper(state, adamw, units, torch.bfloat16, chunk=1000, prestage=True)
    chunked = GpuStepper(chunked_state, adamw, chunked_state.units[:3], torch.bfloat16, chunk=1000)
    assert staged.slots == [] and len(chunked.slots) == 2  # no scratch where all is prestaged
    host = HostAdamW(ref, adamw)
    g = torch.Generator().manual_seed(1)
    sweeps = {1: [0.1, 0.3, 0.55, 0.8, 1.0], 2: [0.2], 3: [0.4, 0.9], 4: [0.5]}
    for step, shares in sweeps.items():
        coef = torch.tensor(0.37 + 0.1 * step)
        skip = torch.tensor(step == 4)
        if step == 3:  # a step skipped, or begun again: what was loaded is dropped
            staged.prestage(0.7)
            staged.discard()
        loaded = staged.h2d_bytes
        for share in shares:
            staged.prestage(share)
            assert staged.h2d_bytes - loaded == 12 * math.ceil(share * total)
        grads = [torch.randn(u.numel, generator=g) for u in units]
        staged.step([(u, gr.clone()) for u, gr in zip(units, grads)], coef, 1e-2, step, skip)
        assert staged.h2d_bytes - loaded == staged.d2h_bytes // step == 12 * total
        chunked.step([(u, gr.clone()) for u, gr in zip(chunked_state.units, grads)], coef, 1e-2, step, skip)
        if step < 4:
            for u, gr in zip(units, grads):
                host.step_range(u, 0, u.numel, clip_scaled(gr.clone(), coef), 1e-2, step)
        for w in state.buffers:
            assert torch.equal(getattr(state, w), getattr(ref, w)), (step, w)
            assert torch.equal(getattr(chunked_state, w), getattr(ref, w)), (step, w)
        for u in units:
            fresh, _ = staged.take(u, keep=True)  # the forward sweep's fetch, then the backward's
            assert staged.take(u)[0] is fresh and staged.take(u) is None
            assert torch.equal(fresh, ref.flat(u, "hi")), (step, u.name)
            assert torch.equal(fresh, chunked.take(chunked_state.units[u.index])[0])
    assert staged.h2d_bytes == staged.d2h_bytes + 12 * math.ceil(0.7 * total)  # the dropped load


def test_prestaged_write_backs_come_after_every_kernel_with_the_gradients_let_go():
    """The prestaged units' write-backs queue after all their kernels and fresh weights (the next
    forward sweep's weights wait for none of the way back), and by then no gradient is held any
    more: on CUDA each one's memory returns to the compute stream when its kernel is done, not
    after the step's last write-back. The state still ends where whole-unit AdamW puts it."""
    import weakref

    cfg = ModelConfig.from_hf(tiny_config("qwen2"))
    adamw = AdamWConfig(lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    state = _state(cfg, 0)
    ref = _copy(state)
    units = state.units[:3]
    staged = GpuStepper(state, adamw, units, torch.bfloat16, chunk=1000, prestage=True)
    g = torch.Generator().manual_seed(2)
    grads = [torch.randn(u.numel, generator=g) for u in units]
    items = [(u, gr.clone()) for u, gr in zip(units, grads)]
    alive = [weakref.ref(gr) for _, gr in items]
    seen = []
    write_back = staged._write_back

    def checked(unit):
        seen.append(
            (
                unit.index,
                [r() is not None for r in alive],
                [staged.take(v, keep=True) is not None for v in units],
            )
        )
        write_back(unit)

    staged._write_back = checked
    staged.prestage(1.0)
    staged.step(items, torch.tensor(0.5), 1e-2, 1)
    assert items == []  # consumed
    assert seen == [(u.index, [False] * 3, [True] * 3) for u in units]
    host = HostAdamW(ref, adamw)
    for u, gr in zip(units, grads):
        host.step_range(u, 0, u.numel, clip_scaled(gr, torch.tensor(0.5)), 1e-2, 1)
    for w in state.buffers:
        assert torch.equal(getattr(state, w), getattr(ref, w)), w
