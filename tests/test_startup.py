"""What a run does before its first step, kept exact while it is made faster: random weights drawn
a chunk at a time on a thread pool (the numbers of one draw per parameter, unit by unit), filled
while the plan probes a layer (runtime.WeightsFill: the same state, the same run; an error of
either stops or names the other cleanly), the GPU-resident state made from the halves (the bits
of the host's join), and the parts' seconds reported (build_model's `timings`, bench/startup.py's
reading of the trainer's line)."""

from __future__ import annotations

import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_config, tiny_hf_model
from test_checkpoint import make_run, metrics, tensors

from megatrain import plan as planning
from megatrain import runtime, trainer
from megatrain.config import TrainConfig
from megatrain.engine.transport import device_state
from megatrain.errors import CheckpointError
from megatrain.host.moments import FP32
from megatrain.host.split import HI, LO, Halves, fetch_join_, join
from megatrain.host.state import HostState, build_units
from megatrain.io import weights
from megatrain.io.weights import draw_chunks, fills_apart, init_random
from megatrain.models.config import ModelConfig
from megatrain.parallel.distributed import Single
from megatrain.planning import placement
from megatrain.planning.probe import layer_probe_for

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


def _weights_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "megatrain-weights"]


def _fill_beside(cfg: ModelConfig, weights, seed: int, monkeypatch) -> runtime.TrainableModel:
    """build_model of a state filled while a probe runs: the probe waits until the fill has begun
    on its own thread, so the two overlap."""
    begun = threading.Event()
    fill_of = runtime._fill

    def fill(*args, **kw):
        assert threading.current_thread().name == "megatrain-weights"
        begun.set()
        fill_of(*args, **kw)

    monkeypatch.setattr(runtime, "_fill", fill)

    def probe():
        assert begun.wait(30), "the fill did not begin beside the probe"
        return layer_probe_for(cfg, "cpu", torch.float32, None, 4096)

    filled = runtime.WeightsFill(cfg, Single(), FP32, weights, seed)
    machine, layer = runtime.probe_machine(placement.measure("cpu"), probe, FP32, filled)
    p = placement.plan(cfg, placement.Batch(4096, 1, 4096, 4, True), machine, layer_mem=layer)
    assert filled.seconds > 0 and filled.waited >= 0 and _weights_threads() == []
    return runtime.build_model(cfg, weights=weights, seed=seed, plan=p, machine=machine, filled=filled)


@pytest.mark.parametrize("source", ["random", "checkpoint"])
def test_weights_filled_beside_the_probe_are_the_weights_built_after_it(source, tmp_path, monkeypatch):
    if source == "checkpoint":
        tiny_hf_model("qwen2").save_pretrained(tmp_path / "model")
        weights, cfg = tmp_path / "model", ModelConfig.from_json(tmp_path / "model")
    else:
        weights, cfg = None, ModelConfig.from_hf(tiny_config("qwen2", hidden_size=48))
    want = runtime.build_model(cfg, weights=weights, seed=3)
    got = _fill_beside(cfg, weights, 3, monkeypatch)
    try:
        assert torch.equal(_bits(got.state.hi), _bits(want.state.hi)) and torch.equal(
            got.state.lo, want.state.lo
        )
        assert got.state.master().abs().sum() > 0
        for w in got.state.moment_names:
            assert torch.equal(getattr(got.state, w), getattr(want.state, w))
    finally:
        got.close()
        want.close()


def test_transformers_own_initialisation_is_not_drawn_beside_anything():
    """Its draws take the process's global generator, which torch.compile saves and restores."""
    gemma = ModelConfig.from_hf(tiny_config("gemma2"))
    llama = ModelConfig.from_hf(tiny_config("llama"))
    assert not fills_apart(gemma, None) and fills_apart(gemma, "model") and fills_apart(llama, None)


def _sft(tmp_path: Path, name: str, **settings) -> TrainConfig:
    return TrainConfig(**make_run(tmp_path), output_dir=str(tmp_path / name), max_steps=3, **settings)


def test_a_run_whose_weights_fill_beside_its_plan_is_the_run_filled_after_it(tmp_path, monkeypatch, capsys):
    """The same losses and the same final weights, bit for bit; the ready line tells the part of
    the draw hidden behind the plan apart from what the run waited for, and the bench reads it."""
    policy_fill = trainer._policy_fill
    fills = []

    def counted(*args):
        fills.append(policy_fill(*args))
        return fills[-1]

    monkeypatch.setattr(trainer, "_policy_fill", counted)
    fill_of, layer_memory = runtime._fill, planning.layer_memory

    def slow_fill(*args, **kw):  # a fill, and a probe, long enough to be seen on the clock
        time.sleep(0.3)
        fill_of(*args, **kw)

    def slow_probe(*args):
        time.sleep(0.6)
        return layer_memory(*args)

    monkeypatch.setattr(runtime, "_fill", slow_fill)
    monkeypatch.setattr(planning, "layer_memory", slow_probe)
    trainer.train(_sft(tmp_path, "beside"))
    assert isinstance(fills[0], runtime.WeightsFill) and _weights_threads() == []
    line = next(x for x in capsys.readouterr().out.splitlines() if "ready for step 1" in x)
    ready = startup.parse_ready(line)
    assert 0.25 < ready["beside"][trainer.PLAN_PART]["the random weights"] < 0.4, line
    assert ready["parts"][trainer.PLAN_PART] >= 0.6 and ready["parts"].get("the random weights", 0) < 0.2
    assert "(beside the memory plan, not in the total)" in startup.table(ready)
    monkeypatch.setattr(trainer, "_policy_fill", lambda *args: None)
    trainer.train(_sft(tmp_path, "after"))
    line = next(x for x in capsys.readouterr().out.splitlines() if "ready for step 1" in x)
    assert "beside" not in startup.parse_ready(line) and "the random weights" in line
    losses = [[r["loss"] for r in metrics(tmp_path / name) if "loss" in r] for name in ("beside", "after")]
    assert len(losses[0]) == 3 and losses[0] == losses[1]
    final = [tensors(tmp_path / name / "final") for name in ("beside", "after")]
    assert final[0].keys() == final[1].keys() and all(torch.equal(final[0][k], final[1][k]) for k in final[0])


@pytest.mark.parametrize(
    "settings, fresh, resumed",
    [
        ({}, True, True),
        ({"stage": "dpo"}, True, False),  # a resume computes the reference with a model of its own
        ({"stage": "dpo", "ref_model_name_or_path": "model"}, False, False),
        ({"stage": "grpo", "reward_funcs": ["length"], "num_generations": 2}, True, True),
        ({"stage": "grpo", "reward_funcs": ["length"], "num_generations": 2, "beta": 0.1}, False, False),
        ({"stage": "rloo", "reward_funcs": ["length"], "num_generations": 2}, False, False),  # beta 0.05
    ],
)
def test_the_policy_is_filled_beside_the_plan_where_nothing_else_is_read_before_it(
    settings, fresh, resumed, tmp_path
):
    """Where the stage reads other weights into host memory before the policy is built (a
    reference model's pass, grpo's reference copy), the plan's one model at a time stands."""
    run = make_run(tmp_path)
    if "ref_model_name_or_path" in settings:
        settings = dict(settings, ref_model_name_or_path=run["model_config"])
    cfg = TrainConfig(**run, output_dir=str(tmp_path / "out"), **settings)
    model_cfg = ModelConfig.from_json(tmp_path / "model")
    resume = type("Resume", (), {"path": tmp_path / "checkpoint-1"})()
    got = [trainer._policy_fill(cfg, model_cfg, r, Single()) for r in (None, resume)]
    assert [isinstance(f, runtime.WeightsFill) for f in got] == [fresh, resumed]
    assert [f.weights for f in got if f is not None] == [w for w, f in zip((None, resume.path), got) if f]


def test_a_probe_that_fails_stops_the_fill_and_raises_its_own_error():
    cfg = ModelConfig.from_hf(tiny_config("llama"))
    stopped = threading.Event()
    filled = runtime.WeightsFill(cfg, Single(), FP32, None, 0)

    def fill(state, cfg, weights, seed, progress, gate):  # a fill still under way when the probe fails
        assert gate.wait_stopped(30)
        stopped.set()

    def probe():
        raise RuntimeError("CUDA error: the probe failed")

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(runtime, "_fill", fill)
        with pytest.raises(RuntimeError, match="the probe failed"):
            runtime.probe_machine(placement.measure("cpu"), probe, FP32, filled)
    assert stopped.is_set() and filled.state is None and _weights_threads() == []
    # units not begun are skipped once stopped
    state, gate = HostState(build_units(cfg)), weights.Gate()
    gate.stop()
    init_random(state, cfg, seed=1, gate=gate)
    assert not state.hi.any() and not state.lo.any()


def test_a_run_that_does_not_fit_says_so_in_one_line_with_the_fill_joined(tmp_path):
    with pytest.raises(planning.InsufficientMemory) as e:
        trainer.train(_sft(tmp_path, "out", max_host_memory="1MB"))
    assert "\n" not in str(e.value) and str(e.value).startswith("no placement fits: ")
    assert _weights_threads() == [] and not (tmp_path / "out").exists()


def test_a_broken_checkpoint_read_beside_the_plan_names_itself(tmp_path, monkeypatch):
    tiny_hf_model("llama").save_pretrained(tmp_path / "model")
    shard = tmp_path / "model" / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:200])
    (tmp_path / "data").mkdir()
    run = make_run(tmp_path / "data")  # its data; the model is the broken one
    del run["model_config"]
    cfg = TrainConfig(**run, model_name_or_path=str(tmp_path / "model"), output_dir=str(tmp_path / "out"),
                      max_steps=1)  # fmt: skip
    with pytest.raises(CheckpointError) as beside:
        trainer.train(cfg)
    assert any(entry.name == "_run" for entry in beside.traceback)  # raised on the fill's thread
    monkeypatch.setattr(trainer, "_policy_fill", lambda *args: None)
    with pytest.raises(CheckpointError) as after:
        trainer.train(cfg)
    assert str(beside.value) == str(after.value) and "model.safetensors" in str(beside.value)
    assert _weights_threads() == [] and not (tmp_path / "out").exists()


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


@pytest.mark.gpu
def test_weights_drawn_beside_the_cuda_probe_are_the_weights_drawn_alone():
    """On CUDA the probe compiles the layer (torch.compile saves and restores the global generators
    around each compile) while the fill draws from generators of its own: the same bits as a draw
    alone; and the plan of the layer probed untiled is the plan of the layer probed both ways."""
    from megatrain.planning.probe import LayerProbe

    cfg = ModelConfig.from_hf(tiny_config("llama", vocab_size=512, hidden_size=256, intermediate_size=640))
    want = HostState(build_units(cfg))
    init_random(want, cfg, seed=4)
    filled = runtime.WeightsFill(cfg, Single(), FP32, None, 4)
    machine, layer = runtime.probe_machine(
        placement.measure("cuda"),
        lambda: layer_probe_for(cfg, "cuda", torch.bfloat16, True, 2048, quiet=filled.gate.quiet),
        FP32,
        filled,
    )
    assert isinstance(layer, LayerProbe) and layer.untiled.tiled_graph_per_token is None
    assert torch.equal(_bits(filled.state.hi), _bits(want.hi)) and torch.equal(filled.state.lo, want.lo)
    batch = placement.Batch(2048, 1, 2048, 2, True)
    lazy = placement.plan(cfg, batch, machine, layer_mem=layer)
    assert lazy == placement.plan(cfg, batch, machine, layer_mem=layer.with_tiles())


def test_a_quiet_gate_waits_for_the_piece_in_hand_and_holds_the_next():
    """What the probe times runs with no piece of the fill's work beside it (`weights.Gate`)."""
    gate, inside, release, log = weights.Gate(), threading.Event(), threading.Event(), []

    def worker():
        with gate.piece():
            inside.set()
            release.wait(30)
            log.append("piece 1 ends")
        with gate.piece():
            log.append("piece 2")

    def timed():
        with gate.quiet():
            log.append("quiet")
            time.sleep(0.05)  # the worker, past piece 1, waits at piece 2's start
            log.append("quiet ends")

    threads = [threading.Thread(target=worker)]
    threads[0].start()
    assert inside.wait(30)
    threads.append(threading.Thread(target=timed))
    threads[1].start()
    time.sleep(0.05)
    assert log == []  # quiet waits for the piece in hand
    release.set()
    for t in threads:
        t.join(30)
    assert log == ["piece 1 ends", "quiet", "quiet ends", "piece 2"]


def test_the_probe_times_the_layer_with_the_fill_held(tmp_path, monkeypatch):
    """The layer's timed pass (on the CPU, its matmul rate) runs inside the fill's `quiet`, and
    the fill, held meanwhile, goes on after it: the same weights."""
    from megatrain.planning import probe

    cfg = ModelConfig.from_hf(tiny_config("qwen2", hidden_size=40))  # a shape no other test probes
    filled = runtime.WeightsFill(cfg, Single(), FP32, None, 5)
    held = []
    rate_of = probe.cpu_matmul_rate

    def rate(*args):
        held.append(filled.gate.held)
        return rate_of(*args)

    monkeypatch.setattr(probe, "cpu_matmul_rate", rate)
    run = _sft(tmp_path, "out")
    runtime.probe_machine(
        placement.measure("cpu"),
        lambda: planning.layer_memory(cfg, run, "cpu", 4, filled.gate.quiet),
        FP32,
        filled,
    )
    assert held == [True] and not filled.gate.held
    want = runtime.build_model(cfg, seed=5)
    try:
        assert torch.equal(_bits(filled.state.hi), _bits(want.state.hi))
        assert torch.equal(filled.state.lo, want.state.lo)
    finally:
        want.close()
