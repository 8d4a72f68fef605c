"""The placement plan: which gradient mode, what goes where, and what it predicts; `megatrain plan`
and the training preflight built on it; page-locking in pieces."""

from __future__ import annotations

import json
import re
import weakref

import pytest
import torch
from helpers import tiny_config
from test_checkpoint import make_run, one_thread, write_yaml  # noqa: F401 (fixture)
from test_cli import run_cli

from megatrain.config import TrainConfig
from megatrain.data.batch import MicroBatch
from megatrain.engine.optim import AdamWConfig
from megatrain.host.hostmem import PAGE, host_buffer, pieces
from megatrain.host.state import HostState, build_units
from megatrain.models.attention import span
from megatrain.models.config import ModelConfig
from megatrain.plan import batch_of
from megatrain.planning import footprint, placement
from megatrain.planning.placement import Batch, Choices, Machine, PlanError
from megatrain.runtime import build_model

GiB = 2**30


def llama(hidden, layers, heads, kv, ffn, vocab=128256) -> ModelConfig:
    return ModelConfig.from_hf(
        tiny_config(
            "llama",
            hidden_size=hidden,
            num_hidden_layers=layers,
            num_attention_heads=heads,
            num_key_value_heads=kv,
            intermediate_size=ffn,
            vocab_size=vocab,
        )
    )


B8 = llama(4096, 32, 32, 8, 14336)  # Llama-3.1-8B shape
B18 = llama(6144, 44, 48, 8, 16384)  # 18.7B
STEP16K = Batch(micro_batch_tokens=16384, micro_batches=1, seq_len=4096, compute_bytes=2, clip=True, rows=4)


def cuda(gpu_gib, host_gib, capped=False) -> Machine:
    """A machine whose host budget leaves `host_gib` usable beside the plan's host reserve."""
    host = host_gib * GiB / (1 - footprint.HOST_RESERVE)
    return Machine("cuda", int(gpu_gib * GiB), int(host), gpu_capped=capped)


def test_gpu_state_off_bounds_gpu_memory_whatever_the_model_size():
    """All state and gradients in host memory: the GPU holds a few layers' working set and the
    boundary activations, not 4 bytes/param; with the activations parked too, a model twice as
    deep needs no more GPU memory at all."""
    off = Choices(gpu_state="off")
    for c in (B8, B18):
        p = placement.plan(c, STEP16K, cuda(139, 1000), off)
        assert (
            p.grad_mode == "stored" and p.gpu_grad_units == 0 and p.resident_units == 0 and p.keep_layers == 0
        )
        assert p.gpu_peak < 40 * GiB
        assert p.gpu["gradients"] < 4 * 3 * max(u.numel for u in build_units(c))  # a few units, not all
        n = sum(u.numel for u in build_units(c))
        assert p.host["fp32 gradients waiting for the clip (page-locked)"] == 4 * n
    deep = llama(4096, 64, 32, 8, 14336)
    parked = Choices(gpu_state="off", offload_activations=True)
    p32, p64 = (placement.plan(c, STEP16K, cuda(139, 1000), parked) for c in (B8, deep))
    assert p64.gpu_peak == p32.gpu_peak
    g32, g64 = (placement.plan(c, STEP16K, cuda(139, 1000), off) for c in (B8, deep))
    assert g64.gpu_peak - g32.gpu_peak == 32 * 16384 * 4096 * 2  # exactly the added activations


def test_gradients_spill_to_host_then_two_pass_then_refuse():
    """Exact clipping at every scale: GPU and host share the gradients while they can; where
    neither can, a two-pass step; where not even the state fits, a one-line refusal."""
    n = sum(u.numel for u in build_units(B18))
    state = 12 * n + footprint.HOST_RUNTIME["cuda"] + 2 * GiB
    # Host holds the state and a third of the gradients: the rest waits on the GPU.
    hybrid = placement.plan(B18, STEP16K, cuda(139, state / GiB + 4 * n / 3 / GiB))
    assert hybrid.grad_mode == "stored" and 0 < hybrid.gpu_grad_units < len(build_units(B18))
    assert "leading units' on the GPU" in hybrid.notes[0]
    # An 80 GB card cannot take the other two thirds: two passes, nothing stored.
    two = placement.plan(B18, STEP16K, cuda(40, state / GiB + 4 * n / 3 / GiB))
    assert two.grad_mode == "two_pass" and "two-pass step" in two.notes[0]
    assert "usable, and the GPU holds no more of them" in two.notes[0]
    # with gpu_state: off the note says which setting keeps them off a GPU that has room
    off = placement.plan(B18, STEP16K, cuda(139, state / GiB + 4 * n / 3 / GiB), Choices(gpu_state="off"))
    assert off.grad_mode == "two_pass" and "gpu_state: off keeps none on the GPU" in off.notes[0]
    need = float(off.notes[0].split("would need ~")[1].split(" GiB")[0])
    assert need * GiB > footprint.usable_host(cuda(139, state / GiB + 4 * n / 3 / GiB))
    asked = placement.plan(B8, STEP16K, cuda(139, 1000), Choices(gradient_placement="two_pass"))
    assert "as configured (gradient_placement: two_pass)" in asked.notes[0]
    assert two.host_total < 12 * n + 4 * GiB
    with pytest.raises(PlanError, match="host memory: needs"):
        placement.plan(B18, STEP16K, cuda(40, 12 * n / GiB))
    # Without clipping nothing waits: each unit is stepped as it lands.
    free = placement.plan(B18, Batch(16384, 1, 4096, 2, clip=False), cuda(78, state / GiB))
    assert free.grad_mode == "immediate"


def test_user_choices_are_honoured():
    for choice, mode in (("two_pass", "two_pass"), ("host", "stored"), ("gpu", "stored")):
        p = placement.plan(B8, STEP16K, cuda(139, 1000), Choices(gpu_state="off", gradient_placement=choice))
        assert p.grad_mode == mode
        on_gpu = max(p.gpu_grad_units, p.resident_units)
        if choice == "gpu":
            assert on_gpu == len(build_units(B8))
        if choice == "host":
            assert "fp32 gradients waiting for the clip (page-locked)" in p.host
    forced = placement.plan(B8, STEP16K, cuda(139, 1000), Choices(gpu_state="off", offload_activations=True))
    assert forced.parked_layers == 32 and "boundary activations (page-locked)" in forced.host


def test_activations_go_to_host_only_beyond_what_the_gpu_holds():
    long = Batch(micro_batch_tokens=131072, micro_batches=1, seq_len=131072, compute_bytes=2, clip=True)
    roomy = placement.plan(B8, long, cuda(139, 1000), Choices(gpu_state="off"))
    tight = placement.plan(B8, long, cuda(60, 1000), Choices(gpu_state="off"))
    assert roomy.parked_layers < tight.parked_layers < 32
    act = 131072 * 4096 * 2  # one layer's boundary activation
    assert tight.host["boundary activations (page-locked)"] == tight.parked_layers * act
    assert tight.gpu_peak <= footprint.usable_gpu(cuda(60, 1000))


def test_gpu_state_auto_spends_free_memory_by_the_cost_model():
    """Free GPU memory goes to resident state and kept graphs while the cost model says they save
    time, never past the budget: a 3.6B model at 16k tokens fits whole on a 139 GiB card, every
    layer's graph kept; an 8B model gets what fits."""
    A = llama(3072, 28, 24, 8, 8192)
    for cfg, gpu in ((A, 139), (B8, 139), (B8, 75)):
        auto = placement.plan(cfg, STEP16K, cuda(gpu, 1000))
        off = placement.plan(cfg, STEP16K, cuda(gpu, 1000), Choices(gpu_state="off"))
        assert auto.step_time_s < off.step_time_s and auto.resident_units > 0
        assert auto.gpu_peak <= footprint.usable_gpu(cuda(gpu, 1000))
    whole = placement.plan(A, STEP16K, cuda(139, 1000))
    assert whole.resident_units == 30 and whole.keep_layers == 28
    assert whole.gpu["fp32 state of GPU-resident units"] == 12 * sum(u.numel for u in build_units(A))


def test_the_gpu_cap_includes_the_cuda_context():
    capped = cuda(22, 1000, capped=True)
    assert footprint.usable_gpu(capped) < 22 * GiB - placement.CUDA_CONTEXT
    p = placement.plan(B8, STEP16K, capped)
    assert p.gpu_peak <= footprint.usable_gpu(capped)
    frac = placement.allocator_fraction(capped, 80 * GiB)
    assert frac == pytest.approx((22 * GiB - placement.CUDA_CONTEXT) / (80 * GiB))
    assert placement.allocator_fraction(cuda(22, 1000), 80 * GiB) is None


def test_loss_chunk_counts_its_bytes_per_logit():
    """The chunk is as long as the budget holds at LOGIT_BYTES per logit, and the memory model
    counts that much for it (LOGIT_BYTES itself is checked against the runs in
    test_bench_memory.py)."""
    p = placement.plan(B8, STEP16K, cuda(139, 1000))
    per_chunk = p.loss_chunk_tokens * 128256 * footprint.LOGIT_BYTES
    assert per_chunk <= footprint.LOSS_CHUNK_BUDGET["cuda"] < per_chunk + 128256 * footprint.LOGIT_BYTES
    assert p.gpu.get("loss head", 0) == 0 or p.gpu["loss head"] >= per_chunk


def test_host_available_reads_meminfo(tmp_path):
    (tmp_path / "meminfo").write_text("MemTotal: 100 kB\nMemFree: 10 kB\nMemAvailable:   2048 kB\n")
    assert placement.host_available(str(tmp_path / "meminfo")) == 2048 * 1024
    assert placement.host_available(str(tmp_path / "nope")) is None
    assert placement.host_available() > 0  # this machine


# ---------------------------------------------------------------------------- page-locking
def test_registration_pieces_cut_only_at_unit_boundaries():
    assert pieces([10, 20, 30], 40, 50 * 4, 4) == [(0, 40)]
    assert pieces([10, 20, 30], 40, 25 * 4, 4) == [(0, 20), (20, 40)]
    assert pieces([10, 20, 30], 40, 10 * 4, 4) == [(0, 10), (10, 20), (20, 30), (30, 40)]
    assert pieces([], 40, 4, 4) == [(0, 40)]  # nowhere to cut: one piece, however large
    # Units start on pages of their own in every buffer (the halves' 2-byte ones too), and host
    # buffers start on a page.
    state = HostState(build_units(ModelConfig.from_hf(tiny_config("qwen3"))))
    for which in state.buffers:
        t = getattr(state, which)
        assert all((t.data_ptr() + t.element_size() * b) % PAGE == 0 for b in state.boundaries), which
    assert host_buffer(3).data_ptr() % PAGE == 0 and host_buffer(3).sum() == 0


# ---------------------------------------------------------------------------- plan / preflight
def _cuda_plan_run(tmp_path, **settings) -> dict:
    """A tiny Llama planned for a CUDA machine of 1 GiB GPU and 8 GiB host budgets (from here)."""
    tiny_config("llama", vocab_size=97).save_pretrained(tmp_path / "model")
    return dict(
        model_config=str(tmp_path / "model"),
        device="cuda",
        max_gpu_memory="1GiB",
        max_host_memory="8GiB",
        max_length=4096,
        per_device_train_batch_size=4,
        output_dir=str(tmp_path / "out"),
        **settings,
    )


def test_plan_command_needs_no_dataset_and_plans_for_another_machine(tmp_path, capsys):
    cfg = write_yaml(tmp_path / "run.yaml", _cuda_plan_run(tmp_path, gradient_accumulation_steps=2))
    rc, stdout, _ = run_cli(capsys, "plan", cfg)
    assert rc == 0, stdout
    n = ModelConfig.from_json(tmp_path / "model").num_params
    assert f"parameters ({n:,})" in stdout
    assert "4 x 4096 per micro-batch, x 2 accumulation = 32,768 per optimizer step" in stdout
    assert "budget: GPU 1.00 GiB (max_gpu_memory), host 8.00 GiB" in stdout
    assert "GPU memory at its peak" in stdout and "plan: gradients:" in stdout
    assert re.search(r"largest that fit.*max_length=\d+", stdout)
    assert not (tmp_path / "out").exists()


def test_planner_limit_trains_and_three_percent_past_it_is_refused(tmp_path, capsys):
    """A run at the limit `megatrain plan` names fits; 3% past it the preflight refuses it with one
    line naming the settings that would fit."""
    from megatrain import plan
    from megatrain.config import TrainConfig

    base = make_run(tmp_path)
    cfg = TrainConfig(**base, device="cpu", max_host_memory="400MB", output_dir=str(tmp_path / "out"))
    mcfg = ModelConfig.from_json(tmp_path / "model")
    machine = plan.machine_of(cfg, "cpu")
    lim = plan.limits(mcfg, cfg, machine, 4)["max_length"]
    assert lim and lim > cfg.max_length
    assert plan.check(
        mcfg, TrainConfig(**dict(base, max_length=lim), device="cpu", max_host_memory="400MB"), machine, 4
    ).fits
    over = int(lim * 1.03) + 1
    path = write_yaml(
        tmp_path / "over.yaml",
        dict(base, device="cpu", max_host_memory="400MB", max_length=over, output_dir=str(tmp_path / "out")),
    )
    rc, _, err = run_cli(capsys, "train", path)
    assert rc == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(
        "megatrain: error: no placement fits: host memory: needs ~"
    )
    assert "would fit with per_device_train_batch_size=" in lines[0] or "max_length=" in lines[0]
    assert not (tmp_path / "out").exists()
    rc, stdout, _ = run_cli(capsys, "plan", path)
    assert rc == 1 and "does not fit" in stdout
    # preflight_check=false only warns, and trains.
    rc, stdout, err = run_cli(capsys, "train", path, "preflight_check=false", "max_steps=1")
    assert rc == 0 and "megatrain: warning: no placement fits" in stdout + err


def test_run_records_plan_and_measured_peaks(tmp_path):
    from megatrain.config import TrainConfig
    from megatrain.trainer import train

    base = make_run(tmp_path)
    train(TrainConfig(**base, output_dir=str(tmp_path / "out"), max_steps=2))
    rec = json.loads((tmp_path / "out" / "plan.json").read_text())
    assert rec["plan"]["grad_mode"] == "stored" and rec["plan"]["device"] == "cpu"
    assert rec["predicted"]["host_peak_rss"] == rec["host_rss_before"] + rec["plan"]["host_total"]
    assert rec["measured"]["step"] == 2 and rec["measured"]["host_peak_rss"] >= rec["host_rss_before"]


def test_no_clipping_trains_immediately_and_logs_the_norm(tmp_path):
    from test_checkpoint import metrics

    from megatrain.config import TrainConfig
    from megatrain.trainer import train

    base = make_run(tmp_path)
    out = tmp_path / "out"
    train(TrainConfig(**dict(base, max_grad_norm=0.0), output_dir=str(out), max_steps=3))
    assert json.loads((out / "plan.json").read_text())["plan"]["grad_mode"] == "immediate"
    recs = metrics(out)
    assert [r["step"] for r in recs] == [1, 2, 3]
    assert all(r["grad_norm"] > 0 for r in recs) and recs[-1]["loss"] < recs[0]["loss"] + 1.0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_two_pass_trains_like_stored(tmp_path, device):
    """Through `train`: the two-pass step (nothing stored) gives bitwise the weights, moments and
    gradient norms of the stored step, with the clip active. On CUDA every unit streams and the
    host steps it (`gpu_state: off`): the disk tier's GPU test once found `lm_head` apart between
    these two placements through `train` (results/2026-11-27_1455_gpu-suite-h200-x4.md)."""
    from test_checkpoint import assert_bitwise, metrics, tensors

    from megatrain.config import TrainConfig
    from megatrain.trainer import train

    base = make_run(tmp_path)
    if device == "cuda":
        base |= dict(device="cuda", compute_dtype="float32", gpu_state="off")
    runs = {}
    for key, mode in (("host", "stored"), ("two_pass", "two_pass")):
        out = tmp_path / f"out-{key}"
        train(TrainConfig(**base, output_dir=str(out), max_steps=3, gradient_placement=key))
        assert json.loads((out / "plan.json").read_text())["plan"]["grad_mode"] == mode
        runs[key] = (tensors(out / "checkpoint-3"), [r["grad_norm"] for r in metrics(out)])
    (w0, n0), (w1, n1) = runs["host"], runs["two_pass"]
    assert n1 == n0 and max(n0) > base["max_grad_norm"]  # clipped
    assert_bitwise(w1, w0)


def test_packed_documents_cost_attention_over_their_own_length():
    """The cost model charges packed rows attention over their documents, not the whole row: a
    64k row of 4k documents is planned as faster than one 64k document, and the span the trainer
    hands the plan is sum(len^2) / sum(len) over the documents it packed."""
    from megatrain.data.batching import Batcher
    from megatrain.data.samples import Sample

    A = llama(3072, 28, 24, 8, 8192)
    row = dict(micro_batch_tokens=65536, micro_batches=1, seq_len=65536, compute_bytes=2, clip=True)
    whole = placement.plan(A, Batch(**row, masked=True), cuda(139, 1000))
    packed = placement.plan(A, Batch(**row, masked=True, attention_span=4096), cuda(139, 1000))
    assert packed.step_time_s < 0.6 * whole.step_time_s
    docs = [Sample([1] * n, [1] * n, f"d:{i}") for i, n in enumerate((1000, 3000, 3000, 1000))]
    lengths = Batcher(docs, batch_size=1, grad_accum=1, max_length=4096, packing=True).packed_lengths
    assert sorted(lengths) == [1000, 1000, 3000, 3000]
    assert span(lengths, [None]) == pytest.approx((2 * 1000**2 + 2 * 3000**2) / 8000)
    assert Batcher(docs, batch_size=1, grad_accum=1, max_length=4096).packed_lengths is None


def test_sliding_windows_cost_attention_over_the_window():
    """Under a window w < n a document of n tokens covers n*w - w^2/2 keys, not n^2/2: the span is
    averaged over the layers' windows (alternating families), and a training config's batch of
    windowed rows carries it, so the plan charges a 64k row of a 4k-window model less attention."""
    w = 1024
    assert span([4096], [None]) == 4096
    assert span([4096], [w]) == pytest.approx((2 * 4096 * w - w * w) / 4096)
    assert span([4096, 512], [w, None]) == pytest.approx(
        ((2 * 4096 * w - w * w) + 512**2 + 4096**2 + 512**2) / (2 * 4608)
    )
    full, windowed = (
        ModelConfig.from_hf(tiny_config("mistral", sliding_window=sw, max_position_embeddings=65536))
        for sw in (None, 4096)
    )
    cfg = TrainConfig(model_config="m", max_length=65536, per_device_train_batch_size=1)
    b_full, b_win = (batch_of(cfg, m, 2) for m in (full, windowed))
    assert b_full.attention_span == 65536
    assert b_win.attention_span == pytest.approx(2 * 4096 - 4096**2 / 65536)
    assert batch_of(cfg, windowed, 2, attention_span=100.0).attention_span == 100.0  # the packed data's


def test_the_engine_keeps_no_gradient_it_has_handed_to_the_transport():
    """Stored mode: each unit's fp32 gradient, the LM head's first, goes to the transport and the
    engine keeps no reference to it, so a transport that moves it to host memory frees it. The
    memory model counts the head's gradient only while it is on its way out; kept by the engine
    it stood 1.6 GB above the plan through a 3.6B model's backward sweep (H100)."""
    cfg = ModelConfig.from_hf(tiny_config("llama"))
    plan = placement.Plan("cpu", "stored", 0, 0, 0, 0, 64)
    model = build_model(
        cfg, seed=0, device="cpu", compute_dtype="float32", adamw=AdamWConfig(lr=1e-3), plan=plan
    )
    handed: list[weakref.ref] = []
    alive_at_each_hold: list[list[bool]] = []
    hold = model.transport.hold

    def moving_hold(unit, g):  # as a streaming transport does: a copy elsewhere, the original freed
        alive_at_each_hold.append([r() is not None for r in handed])
        handed.append(weakref.ref(g))
        hold(unit, g.clone())

    model.transport.hold = moving_hold
    ids = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    model.engine.forward_backward([MicroBatch(ids, ids.clone())])
    assert len(handed) == len(build_units(cfg))
    assert alive_at_each_hold[1:] and not any(any(a) for a in alive_at_each_hold), alive_at_each_hold
    model.close()


def test_host_budget_keeps_a_reserve():
    """The plan leaves HOST_RESERVE of the host budget free (the kernel's and the driver's own
    memory): a plan that needs all of MemAvailable is refused, one that needs 95% of it is not."""
    fixed = Choices(gpu_state="off", gradient_placement="host")
    need = placement.plan(B8, STEP16K, cuda(139, 1000), fixed).host_total
    exact = Machine("cuda", 139 * GiB, need)
    with pytest.raises(PlanError, match="host memory: needs"):
        placement.plan(B8, STEP16K, exact, fixed)
    roomy = Machine("cuda", 139 * GiB, int(need / (1 - footprint.HOST_RESERVE)) + 1)
    assert placement.plan(B8, STEP16K, roomy, fixed).host_total == need


def test_embedding_gradient_phase_grows_only_by_the_activation_gradient():
    """The embedding's gradient is scattered a chunk of tokens at a time: its fp32 temporaries
    are one chunk's, so past a chunk the phase grows with the sequence only by the (compute dtype)
    activation gradient it reads, not by an fp32 copy of it (4 bytes per token x hidden more)."""
    off = Choices(gpu_state="off")

    def embedding_phase(tokens: int) -> int:
        b = Batch(
            micro_batch_tokens=tokens, micro_batches=1, seq_len=tokens, compute_bytes=2, clip=True, rows=1
        )
        return footprint.phase_peaks(B8, b, placement.plan(B8, b, cuda(139, 1000), off))["embedding"]

    grown = embedding_phase(262144) - embedding_phase(131072)
    assert grown == 131072 * 4096 * 2


def test_the_adam_rate_is_measured_on_the_threads_the_optimizers_will_have(monkeypatch):
    """A process under torchrun starts with one OpenMP thread; its optimizer later gets its share
    of the machine's cores. The plan's CPU AdamW rate is measured on all of the machine's optimizer
    threads (each rank's share, times its ranks), and the caller's thread count is left as it was:
    measured on one thread, an 18.7B run on two GPUs planned a step of 21.6 s that took 8.3."""
    import os

    import torch

    from megatrain.parallel.layout import Layout
    from megatrain.planning import placement, probe
    from megatrain.planning.costmodel import ADAM_IN_STEP
    from megatrain.planning.placement import optimizer_threads
    from megatrain.planning.planspec import ADAM_PARAMS_S

    seen = []
    monkeypatch.setattr(probe, "_adam_rate", lambda numel: seen.append(torch.get_num_threads()) or 1e9)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(os, "cpu_count", lambda: 32)
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        one = placement.measure("cuda", 80 * GiB, 100 * GiB)
        two = placement.measure("cuda", 80 * GiB, 100 * GiB, Layout(ranks=2))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert optimizer_threads(1) == 31 and optimizer_threads(2) == 15
    assert seen == [31, 30]  # one process: all cores but the launcher's; two: 15 each
    assert one.adam_params_s == two.adam_params_s == ADAM_IN_STEP * 1e9
    monkeypatch.setenv("RANK", "1")  # its plan is not the one run: it leaves the cores alone
    assert placement.measure("cuda", 80 * GiB, 100 * GiB, Layout(ranks=2)).adam_params_s == ADAM_PARAMS_S
    assert seen == [31, 30]


@pytest.mark.parametrize("path", ["make_plan", "train"])
def test_every_plan_takes_the_best_of_two_readings_of_the_host_adamw(monkeypatch, tmp_path, path):
    """The host's AdamW is read at the process's start and again after the layer's probe, and the
    plan takes the faster reading: a 32-core host read 2.96 G params/s at a process's start (its
    steps then ran 4.46) and the plan stepped 31 units on the GPU where 25 measured 33% faster
    (bench/results/2026-11-27_2140_x2-summary.md). A reading is never above what the host does.
    `train`'s plan (preflight, as `megatrain plan` makes it) and the library's (`make_plan`, what
    bench/ runs) complete the machine alike: the second reading."""
    from megatrain import plan as planning
    from megatrain import runtime
    from megatrain.planning import probe
    from megatrain.planning.costmodel import ADAM_IN_STEP

    readings = iter([2.0e9, 5.0e9, 3.0e9])
    monkeypatch.setattr(probe, "_ADAM_RATES", {})
    monkeypatch.setattr(probe, "_adam_rate", lambda numel: next(readings))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(runtime, "configure_allocator", lambda: None)
    seen = []

    def layer_memory(cfg, *args):  # the layer's probe comes between the two readings
        seen.append(probe._ADAM_RATES.copy())
        return probe.formula_layer_memory(cfg, 2)

    monkeypatch.setattr(runtime, "layer_probe_for", layer_memory)
    monkeypatch.setattr(probe, "layer_probe_for", layer_memory)
    cfg = ModelConfig.from_hf(tiny_config())
    if path == "make_plan":
        plan, machine = runtime.make_plan(
            cfg, "cuda", torch.bfloat16, max_gpu_memory=80 * GiB, max_host_memory=100 * GiB
        )
    else:
        run = TrainConfig(**make_run(tmp_path), output_dir=str(tmp_path / "out"), max_gpu_memory="80GiB",
                          max_host_memory="100GiB", device="cuda", compute_dtype="bfloat16")  # fmt: skip
        plan, machine = planning.preflight(cfg, run, "cuda", 2)
    assert list(seen[0].values()) == [2.0e9]  # the first reading, before the layer's probe
    assert machine.adam_params_s == ADAM_IN_STEP * 5.0e9  # the second, faster one
    ((threads, _),) = probe._ADAM_RATES
    assert probe.adam_rate(threads, again=True) == 5.0e9  # a third reading, 3.0: the best is kept
    assert plan.step_time_s is not None


def test_parked_activations_are_counted_from_one_micro_batch(monkeypatch):
    """A layer's slot of parked activations holds what HostActivations lays out for all the step's
    micro-batches, counted from one of them: `megatrain plan`'s search for the most micro-batches a
    step may have tries up to 2**24, and a list of that many took seconds a plan."""
    from dataclasses import replace

    from megatrain.host.activations import HostActivations

    real = HostActivations.layer_bytes
    b = Batch(micro_batch_tokens=1001, micro_batches=7, seq_len=1001, compute_bytes=2, clip=True)
    assert footprint._parked_layer_bytes(b, 3) == HostActivations.slot_bytes(real([1001] * 7, 3, 2))
    listed = []
    monkeypatch.setattr(HostActivations, "layer_bytes", lambda t, *a: listed.append(len(t)) or real(t, *a))
    many = replace(b, micro_batches=2**24)
    assert footprint._parked_layer_bytes(many, 3) == HostActivations.slot_bytes(2**24 * real([1001], 3, 2))
    assert listed == [1]
