"""The compute-dtype copy of the master weights (`host_weight_copy`, host/weightcopy.py): the
fetches of the host-stepped units read it, it is current whenever they do (after the
initialisation, a load, every step, a skipped step, a resume), a run with it trains bitwise as
one without it (bf16 compute, in memory and with the disk tier), and the plan counts its host
memory, its fetch bytes and refuses a host without room for it in one line."""

from __future__ import annotations

import json
import math
from dataclasses import replace

import pytest
import torch
from helpers import tiny_config
from test_checkpoint import _inject, assert_bitwise, make_run, metrics, one_thread, tensors  # noqa: F401
from test_disk_tier import host_budget, small_blocks  # noqa: F401

from megatrain import plan as planning
from megatrain.config import TrainConfig
from megatrain.engine import clipadam, optim
from megatrain.engine.engine import Engine
from megatrain.errors import ConfigError
from megatrain.models.config import ModelConfig
from megatrain.parallel.layout import Layout
from megatrain.planning import footprint, placement
from megatrain.planning.costmodel import COPY_CAST_SHARE, COPY_KERNEL_SHARE, fetched_bytes
from megatrain.planning.footprint import WEIGHT_COPY
from megatrain.planning.planspec import Batch, Machine, model_shape
from megatrain.planning.probe import formula_layer_memory
from megatrain.runtime import build_model, make_plan
from megatrain.trainer import train

BF16 = dict(device="cpu", compute_dtype="bfloat16")


def copy_is_current(state) -> int:
    """Assert the copy holds every copied unit's master weights cast to bf16, bitwise; returns the
    number of units checked."""
    checked = 0
    for u in state.units:
        if state.copy.holds(u):
            lo, hi = state.part(u)
            assert torch.equal(state.copy.range(u, lo, hi), state.range(u, lo, hi).to(torch.bfloat16)), u.name
            checked += 1
    return checked


@pytest.fixture
def checked(monkeypatch):
    """Before every forward and backward pass of a run (so after its load, every step, a skipped
    step), the copy is checked against the master weights; returns the count of checks per run."""
    seen: list[int] = []
    fb = Engine.forward_backward

    def forward_backward(self, mbs):
        if self.state.copy is not None:
            seen.append(copy_is_current(self.state))
        return fb(self, mbs)

    monkeypatch.setattr(Engine, "forward_backward", forward_backward)
    return seen


@pytest.fixture
def base(tmp_path):
    return make_run(tmp_path) | BF16 | dict(max_steps=4, save_strategy="steps", save_steps=4)


def run(base: dict, out, **kw) -> dict:
    train(TrainConfig(**(base | kw), output_dir=str(out)))
    return json.loads((out / "plan.json").read_text())["plan"]


@pytest.mark.parametrize("clip", [1.0, 0.0])  # held for the clip, and stepped as they land
@pytest.mark.parametrize("kernel", [True, False])  # the copy written by clipadam's pass, or cast apart
def test_a_run_with_the_copy_trains_bitwise_as_without_it(tmp_path, base, checked, clip, kernel, monkeypatch):
    """Losses, every fp32 master weight and both moments after four steps with accumulation; the
    copy written in the kernel's own pass (clipadam.py) where it is used, else cast after
    torch's kernel."""
    base = base | dict(max_grad_norm=clip)
    without = run(base, tmp_path / "fp32")
    assert not without["host_weight_copy"] and not checked
    monkeypatch.setattr(optim, "FUSED_CLIP", kernel)
    if kernel:
        assert clipadam.load()[0] is not None, clipadam.load()[1]
    writes, step = [], clipadam.ClipAdamW.step

    def spy(self, *args, copy=None, **kw):
        writes.append(copy is not None)
        return step(self, *args, copy=copy, **kw)

    monkeypatch.setattr(clipadam.ClipAdamW, "step", spy)
    with_copy = run(base, tmp_path / "copy", host_weight_copy=True)
    assert with_copy["host_weight_copy"] and with_copy["host"][WEIGHT_COPY] > 0
    assert len(checked) == 4 and min(checked) > 0  # before each step's passes
    assert (sum(writes) > 0) == kernel
    assert [r.get("loss") for r in metrics(tmp_path / "copy")] == [
        r.get("loss") for r in metrics(tmp_path / "fp32")
    ]
    ckpt = "checkpoint-4"
    assert_bitwise(tensors(tmp_path / "copy" / ckpt), tensors(tmp_path / "fp32" / ckpt))  # weights, moments


def test_a_skipped_step_leaves_the_copy_current(tmp_path, base, checked, monkeypatch):
    stepped = _inject(monkeypatch, {2}, "loss")
    run(base, tmp_path / "out", host_weight_copy=True)
    assert stepped == [1, 3, 4] and len(checked) == 4  # checked before step 3's passes too


def test_a_resume_fills_the_copy_from_the_checkpoint(tmp_path, base, checked):
    """Were the copy not cast again from the resumed weights, the fetches would read zeros."""
    run(base, tmp_path / "whole", host_weight_copy=True)
    kw = dict(host_weight_copy=True, save_steps=2)
    run(base | dict(max_steps=2), tmp_path / "resumed", **kw)
    run(base, tmp_path / "resumed", resume_from_checkpoint=True, **kw)
    assert_bitwise(
        tensors(tmp_path / "resumed" / "checkpoint-4"), tensors(tmp_path / "whole" / "checkpoint-4")
    )


def test_with_the_disk_tier_the_copy_trains_bitwise_as_in_memory(tmp_path, base, checked):
    """The tier steps its units a block at a time; each block is cast into the copy."""
    base = base | dict(save_strategy="no")
    run(base, tmp_path / "ram")
    budget = host_budget(base | dict(host_weight_copy=True), 2, compute_bytes=2)
    p = run(
        base,
        tmp_path / "disk",
        host_weight_copy=True,
        offload_dir=str(tmp_path / "nvme"),
        max_host_memory=budget,
    )
    assert p["disk_units"] >= 1 and p["host_weight_copy"] and checked
    assert_bitwise(tensors(tmp_path / "disk" / "final"), tensors(tmp_path / "ram" / "final"))


def test_loaded_weights_fill_the_copy_and_fetches_read_it(tmp_path, base):
    """A model loaded from a checkpoint directory: the copy holds its weights, and the serial
    transport's fetch of a copied unit reads the copy, not the fp32 master (poisoned here)."""
    run(base | dict(max_steps=1, save_strategy="no"), tmp_path / "out")
    cfg = ModelConfig.from_json(tmp_path / "out" / "final" / "config.json")
    models = {
        copy: build_model(
            cfg,
            weights=tmp_path / "out" / "final",
            compute_dtype=torch.bfloat16,
            choices=placement.Choices(host_weight_copy=copy),
        )  # fmt: skip
        for copy in (True, False)
    }
    state = models[True].state
    assert copy_is_current(state) == len(state.units) and models[False].state.copy is None
    for m in models.values():
        unit = m.state.units[1]
        m.state.flat(unit).fill_(float("nan"))  # the master, behind the copy's back
        fetched = m.transport.fetch(unit)
        assert fetched.dtype == torch.bfloat16
        assert torch.isfinite(fetched).all() == (m.state.copy is not None)
        m.close()


# ---------------------------------------------------------------------------- the plan
def shape_and_batch(compute_bytes: int):
    cfg = ModelConfig.from_hf(tiny_config("llama"))
    s = model_shape(cfg, formula_layer_memory(cfg, compute_bytes))
    return cfg, s, Batch(4096, 2, 4096, compute_bytes, clip=True)


@pytest.mark.parametrize("device", ["cuda", "cpu"])
def test_the_plan_counts_the_copys_host_bytes_and_halves_its_fetches(device):
    cfg, s, b = shape_and_batch(2)
    m = Machine(device, gpu_bytes=80 * 2**30 if device == "cuda" else None)
    off = placement.Choices(gpu_state="off", host_weight_copy=False)
    plain = placement.plan(cfg, b, m, off)
    copied = placement.plan(cfg, b, m, replace(off, host_weight_copy=True))
    n = len(s.units)
    assert copied.host_weight_copy and list(copied.copied(n)) == list(range(copied.stepped.stop, n))
    copy_bytes = 2 * sum(s.units[u] for u in copied.copied(n))
    assert copied.host[WEIGHT_COPY] == copy_bytes and WEIGHT_COPY not in plain.host
    assert copied.host_total == plain.host_total + copy_bytes
    if device == "cuda":  # page-locked beside the master, and half the bytes a fetch
        assert copied.pinned == plain.pinned + copy_bytes
        everything = range(n)
        assert fetched_bytes(s, copied, everything) * 2 == fetched_bytes(s, plain, everything) == 4 * s.total
        slow_link = replace(m, pcie_bytes_s=1e6)  # where the link binds, the copy is faster
        times = [
            placement.plan(cfg, b, slow_link, replace(off, host_weight_copy=c)).step_time_s for c in (1, 0)
        ]
        assert times[0] < times[1]
    else:  # no link: only the cast's cost, a share of the copied units' AdamW
        cast = copied.step_time_s - plain.step_time_s
        in_kernel = placement.plan(
            cfg, b, replace(m, copy_in_kernel=True), replace(off, host_weight_copy=True)
        )
        copied_params = sum(s.units[u] for u in copied.copied(n))
        assert cast == pytest.approx(COPY_CAST_SHARE * copied_params / m.adam_params_s)
        assert in_kernel.step_time_s - plain.step_time_s == pytest.approx(
            COPY_KERNEL_SHARE * copied_params / m.adam_params_s
        )
        assert 0 < COPY_KERNEL_SHARE < COPY_CAST_SHARE


def test_the_plan_takes_the_copy_in_the_kernels_pass_where_the_optimizer_writes_it_so(monkeypatch):
    """`make_plan` asks the optimizer whether its kernel writes the copy here (clipadam builds and
    checks, FUSED_CLIP): the machine it plans for says so, and not where the kernel is off or the
    compute dtype is not bf16."""
    cfg = ModelConfig.from_hf(tiny_config("llama", num_hidden_layers=2))
    choices = placement.Choices(host_weight_copy=True)

    def plan_on(dtype=torch.bfloat16):  # the machine make_plan planned for
        return make_plan(cfg, "cpu", dtype, batch_size=2, seq_len=16, choices=choices)[1]

    assert clipadam.load()[0] is not None, clipadam.load()[1]
    assert plan_on().copy_in_kernel
    assert not plan_on(torch.float16).copy_in_kernel
    monkeypatch.setattr(optim, "FUSED_CLIP", False)
    assert not plan_on().copy_in_kernel


def test_in_float32_the_copy_changes_nothing():
    cfg, s, b = shape_and_batch(4)
    m = Machine("cuda", gpu_bytes=80 * 2**30)
    off = placement.Choices(gpu_state="off", host_weight_copy=False)
    p = placement.plan(cfg, b, m, replace(off, host_weight_copy=True))
    assert not p.host_weight_copy and not p.copied(len(s.units))
    assert p.to_json() == placement.plan(cfg, b, m, off).to_json()


def _decided(p) -> dict:
    """A plan's decisions and costs, without its notes."""
    return {k: v for k, v in p.to_json().items() if k != "notes"}


def test_auto_takes_the_copy_where_it_pays_and_the_host_holds_it():
    """`host_weight_copy: auto` (the default): the plan with the copy where the cost model puts its
    step faster (a link that binds), with a note saying why; the plan without it
    where the host cannot hold the copy (never moving moments to disk for it), where it saves
    less (a link that never binds), on the CPU, in fp32 and with several processes."""
    cfg, s, b = shape_and_batch(2)
    slow = Machine("cuda", gpu_bytes=80 * 2**30, pcie_bytes_s=1e6)
    auto = placement.Choices(gpu_state="off", host_weight_copy=None)
    assert (
        planning.choices_of(TrainConfig(model_config="{}", output_dir="o")).host_weight_copy is None
    )  # a run's default
    on, off = (placement.plan(cfg, b, slow, replace(auto, host_weight_copy=c)) for c in (True, False))
    assert on.step_time_s < off.step_time_s
    chosen = placement.plan(cfg, b, slow, auto)
    assert _decided(chosen) == _decided(on) and chosen.host_weight_copy
    assert any(n.startswith("host_weight_copy: auto takes the copy") for n in chosen.notes), chosen.notes

    # a gain the model puts small is taken too (the copy measured 21% faster where the model said
    # 1.1-4.2%): the link's rate where the copy's gain crosses zero, then just below it
    def gain(m: Machine) -> float:
        on, off = (placement.plan(cfg, b, m, replace(auto, host_weight_copy=c)) for c in (True, False))
        return 1 - on.step_time_s / off.step_time_s

    lo, hi = 1e6, 1e15  # the copy pays at lo, not at hi (below)
    for _ in range(60):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if gain(replace(slow, pcie_bytes_s=mid)) > 0 else (lo, mid)
    small = replace(slow, pcie_bytes_s=lo)
    assert 0 < gain(small) < placement.STEPPING_GAIN
    assert placement.plan(cfg, b, small, auto).host_weight_copy
    assert not placement.plan(cfg, b, replace(slow, pcie_bytes_s=hi), auto).host_weight_copy
    # a host that holds the least demanding plan (two-pass) but not the copy beside it, with a
    # disk tier that would make room for the copy
    least = placement.plan(cfg, b, slow, replace(auto, host_weight_copy=False, gradient_placement="two_pass"))
    tight = replace(
        slow, host_bytes=math.ceil(least.host_total / (1 - footprint.HOST_RESERVE)) + 1, disk_bytes=2**42
    )
    assert least.host_total + on.host[WEIGHT_COPY] > footprint.usable_host(tight) >= least.host_total
    assert placement.plan(cfg, b, tight, replace(auto, host_weight_copy=True)).disk_units > 0
    p = placement.plan(cfg, b, tight, auto)
    assert not p.host_weight_copy and p.disk_units == 0
    assert _decided(p) == _decided(placement.plan(cfg, b, tight, replace(auto, host_weight_copy=False)))
    # where moments go to disk even without the copy, no copy
    short = replace(tight, host_bytes=tight.host_bytes - 2**16)  # the moments are ~1 MiB
    p = placement.plan(cfg, b, short, auto)
    assert p.disk_units > 0 and not p.host_weight_copy
    for m, batch in (
        (replace(slow, pcie_bytes_s=1e15), b),  # the link never binds: only the copy's cast is left
        (Machine("cpu"), b),
        (slow, replace(b, compute_bytes=4)),
        (replace(slow, world=Layout(ranks=2)), b),
    ):
        p = placement.plan(cfg, batch, m, auto)
        assert not p.host_weight_copy, (m, batch)
        assert _decided(p) == _decided(placement.plan(cfg, batch, m, replace(auto, host_weight_copy=False)))


def test_gpu_resident_and_gpu_stepped_units_are_not_copied():
    cfg, s, b = shape_and_batch(2)
    p = placement.plan(
        cfg, b, Machine("cuda", gpu_bytes=80 * 2**30),
        placement.Choices(gpu_state="off", resident_units=1, gpu_step_units=2, host_weight_copy=True),
    )  # fmt: skip
    n = len(s.units)
    assert p.stepped == range(1, 3) and list(p.copied(n)) == list(range(3, n))
    assert [p.fetch_bytes(u, n) for u in range(n)] == [4, 4, 4] + [2] * (n - 3)


def test_a_host_without_room_for_the_copy_is_refused_in_one_line(tmp_path, base):
    """The least host memory a run needs without the copy (any placement, two-pass included)
    holds no placement with it."""
    cfg = TrainConfig(**base, output_dir=str(tmp_path / "out"))
    model_cfg = ModelConfig.from_json(cfg.model_config)
    machine = planning.machine_of(cfg, "cpu")
    layer_mem = planning.layer_memory(model_cfg, cfg, "cpu", 2)

    def check(copy: bool, host: int):
        c = replace(cfg, host_weight_copy=copy)
        return planning.check(model_cfg, c, replace(machine, host_bytes=host), 2, layer_mem=layer_mem)

    lo, hi = 0, 1 << 40  # lo does not fit without the copy, hi does
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if check(False, mid).fits else (mid, hi)
    refused = check(True, hi)
    assert not refused.fits and "host_weight_copy: true takes" in refused.problem
    assert "\n" not in refused.problem


def test_the_key_is_checked_in_one_line(tmp_path, base):
    for bad, why in (
        (dict(host_weight_copy="yes"), "true, false or auto"),
        (dict(host_weight_copy=True, nproc_per_node=2), "one process"),
    ):
        with pytest.raises(ConfigError, match=f"^host_weight_copy: .*{why}") as e:
            TrainConfig(**(base | bad), output_dir=str(tmp_path / "out"))
        assert "\n" not in str(e.value)


def test_megatrain_plan_shows_the_copy(tmp_path, base, capsys):
    from test_checkpoint import write_yaml
    from test_cli import run_cli

    rc, out, _ = run_cli(
        capsys, "plan", write_yaml(tmp_path / "run.yaml", base | dict(host_weight_copy=True))
    )
    assert rc == 0, out
    assert "fetched from a bfloat16 copy in host memory" in out and WEIGHT_COPY in out
