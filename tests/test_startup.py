"""What a run does before its first step, kept exact while it is made faster: random weights drawn
a chunk at a time on a thread pool (the numbers of one draw per parameter, unit by unit), the
GPU-resident state made from the halves (the bits of the host's join), and the parts' seconds
reported (build_model's `timings`, bench/startup.py's reading of the trainer's line)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_config

from megatrain import runtime
from megatrain.engine.transport import device_state
from megatrain.host.split import HI, LO, Halves, fetch_join_, join
from megatrain.host.state import HostState, build_units
from megatrain.io import weights
from megatrain.io.weights import draw_chunks, init_random
from megatrain.models.config import ModelConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import startup  # noqa: E402  (bench/ is not a package)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


def _reference_init(state: HostState, cfg: ModelConfig, seed: int) -> None:
    """The plain rule, serial: each unit's generator, each parameter drawn whole."""
    std = cfg.hf_config.initializer_range
    for unit in state.units:
        gen = torch.Generator().manual_seed(seed * 100_003 + unit.index)
        for p in unit.params:
            v = torch.empty(p.shape)
            if "norm" in p.name:
                v.fill_(1.0)
            elif p.name.endswith("bias"):
                v.zero_()
            else:
                v.normal_(0.0, std, generator=gen)
            state.set_master(unit, p.offset, v.reshape(-1))


@pytest.mark.parametrize("n", [5, 16, 17, 63, 64, 65, 79, 80, 81, 128, 130, 1000])
def test_chunked_draws_are_the_numbers_of_one_draw(n):
    whole = torch.empty(n).normal_(0.0, 0.02, generator=torch.Generator().manual_seed(7))
    gen, got = torch.Generator().manual_seed(7), torch.empty(n)
    chunks = draw_chunks(n, 64)
    assert chunks[0][0] == 0 and chunks[-1][1] == n and all(b - a >= min(n, 16) for a, b in chunks)
    for a, b in chunks:
        got[a:b].normal_(0.0, 0.02, generator=gen)
    assert torch.equal(_bits(got), _bits(whole)), [(a, b) for a, b in chunks]
    # and the generator moved on as far: the next number is the same
    after = torch.empty(1).normal_(generator=torch.Generator().manual_seed(7).set_state(gen.get_state()))
    ref = torch.Generator().manual_seed(7)
    torch.empty(n).normal_(0.0, 0.02, generator=ref)
    assert torch.equal(after, torch.empty(1).normal_(generator=ref))


@pytest.mark.parametrize("draw", [64, 80, weights.DRAW])
def test_parallel_chunked_init_is_bitwise_the_serial_whole_draws(draw, monkeypatch):
    monkeypatch.setattr(weights, "DRAW", draw)
    cfg = ModelConfig.from_hf(tiny_config("qwen2", hidden_size=48))  # biases, and norms
    got, want = HostState(build_units(cfg)), HostState(build_units(cfg))
    torch.set_num_threads(2)  # the pool runs its units' ops on fewer; restored after
    try:
        init_random(got, cfg, seed=3)
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    _reference_init(want, cfg, seed=3)
    assert torch.equal(_bits(got.hi), _bits(want.hi)) and torch.equal(got.lo, want.lo)
    assert torch.equal(_bits(got.master()), _bits(want.master()))


def test_a_part_of_the_state_holds_the_numbers_of_the_whole():
    cfg = ModelConfig.from_hf(tiny_config("llama"))
    units = build_units(cfg)
    whole = HostState(units)
    init_random(whole, cfg, seed=1)
    parts = [(u.numel // 3, u.numel - 7 * 64) for u in units]
    part = HostState(units, parts=parts)
    init_random(part, cfg, seed=1)
    for u, (lo, hi) in zip(units, parts):
        assert torch.equal(_bits(part.master(u)), _bits(whole.master(u, lo, hi)))


def test_the_pool_takes_the_largest_units_first(monkeypatch):
    cfg = ModelConfig.from_hf(tiny_config("llama", vocab_size=4000))  # embedding and head the largest
    seen: list[int] = []
    monkeypatch.setattr(weights.os, "cpu_count", lambda: 1)  # one worker: the order is the queue's
    weights._per_unit(lambda u: seen.append(u.numel), build_units(cfg), "x", False)
    assert seen == sorted(seen, reverse=True) and len(seen) == cfg.num_hidden_layers + 2


def _filled_state(cfg: ModelConfig) -> HostState:
    state = HostState(build_units(cfg))
    init_random(state, cfg, seed=5)
    gen = torch.Generator().manual_seed(0)
    for w in state.moment_names:
        getattr(state, w).copy_(torch.rand(state.numel, generator=gen))
    return state


@pytest.mark.parametrize("landing", [64, 1000, 10**6])
def test_the_device_state_is_the_hosts_join_and_moments(landing):
    cfg = ModelConfig.from_hf(tiny_config("llama"))
    state = _filled_state(cfg)
    stage = Halves(torch.empty(landing, dtype=HI), torch.empty(landing, dtype=LO))
    for u in state.units:
        p, m, v = device_state(state, u, "cpu", stage, zero_moments=False)
        assert torch.equal(_bits(p), _bits(state.master(u)))
        assert torch.equal(m, state.flat(u, "exp_avg")) and torch.equal(v, state.flat(u, "exp_avg_sq"))
        p0, m0, v0 = device_state(state, u, "cpu", stage, zero_moments=True)
        assert torch.equal(_bits(p0), _bits(p)) and not m0.any() and not v0.any()
        assert m0.numel() == v0.numel() == u.numel


def test_fetch_join_refuses_a_length_mismatch():
    h = Halves(torch.zeros(8, dtype=HI), torch.zeros(8, dtype=LO))
    with pytest.raises(ValueError, match="8 halves for 9"):
        fetch_join_(h, torch.empty(9), h)
    assert torch.equal(fetch_join_(h, torch.empty(8), h[:3]), join(h))


def test_build_model_reports_its_parts_and_the_clocks_parts_add_up(monkeypatch):
    cfg = ModelConfig.from_hf(tiny_config("llama"))
    timings: dict[str, float] = {}
    model = runtime.build_model(cfg, device="cpu", timings=timings)
    model.close()
    assert list(timings) == ["the plan", "the host state", "the random weights", "the engine on the device"]
    assert all(v >= 0 for v in timings.values())
    now = iter([0.0, 10.0, 14.0])
    monkeypatch.setattr(runtime.time, "monotonic", lambda: next(now))
    got: dict[str, float] = {}
    clock = runtime._Clock(got)
    clock.mark("a")  # 10 s
    clock.parts({"pinning": 1.5, "upload": 2.0})
    clock.mark("rest")  # 4 s, of which the parts took 3.5
    assert got == {"a": 10.0, "pinning": 1.5, "upload": 2.0, "rest": 0.5}


def test_the_bench_reads_the_trainers_ready_line():
    line = (
        "megatrain: ready for step 1 162.0 s after the command: imports and the command line 11.4, "
        "the inputs and the memory plan 28.3, the random weights 24.7, the engine on the device 97.7"
    )
    got = startup.parse_ready(line)
    assert got == {
        "total_s": 162.0,
        "parts": {
            "imports and the command line": 11.4,
            "the inputs and the memory plan": 28.3,
            "the random weights": 24.7,
            "the engine on the device": 97.7,
        },
    }
    assert startup.parse_ready("megatrain: step 1 loss 2.3") is None
    assert "| **total** | **162.0** |" in startup.table(got)


@pytest.mark.gpu
@pytest.mark.parametrize("resumed", [False, True])
def test_the_gpu_resident_state_is_the_hosts_bits(resumed):
    """On CUDA, build_model's resident units hold the host's master weights (joined on the GPU from
    the halves, through a landing slot smaller than a unit) and its moments: zero made there, or a
    resume's (`after_load`) copied; the parts of the setup are timed."""
    from megatrain.planning.placement import Plan

    cfg = ModelConfig.from_hf(tiny_config("llama", vocab_size=512, hidden_size=256, intermediate_size=640))
    plan = Plan("cuda", "stored", 5, 3, 0, 0, 100, staging_elems=1000)

    def moments(state: HostState) -> None:
        gen = torch.Generator().manual_seed(1)
        for w in state.moment_names:
            getattr(state, w).copy_(torch.rand(state.numel, generator=gen))

    timings: dict[str, float] = {}
    model = runtime.build_model(
        cfg, seed=2, device="cuda", plan=plan, compile=False, timings=timings,
        after_load=moments if resumed else None,
    )  # fmt: skip
    try:
        assert len(model.transport.resident) == 3
        for i, (p, m, v) in model.transport.resident.items():
            u = model.state.units[i]
            assert torch.equal(_bits(p.cpu()), _bits(model.state.master(u)))
            assert torch.equal(m.cpu(), model.state.flat(u, "exp_avg"))
            assert torch.equal(v.cpu(), model.state.flat(u, "exp_avg_sq"))
            assert m.any() == resumed
        assert {"page-locking the host memory", "the GPU-resident state"} <= set(timings)
    finally:
        model.close()
