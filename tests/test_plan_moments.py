"""The plan's host AdamW in each moment format (`optim`): the step it predicts and its choice
between stored gradients and the two-pass step take the format's rate as this host's probe of
its own kernel read it (`Machine.moment_adam_params_s`, runtime.probe_machine), not fp32's, on
the 8B Llama shape at 16k tokens with all state in host memory, as measured on a 16-core H200
host (docs/memory.md's optim section); plan.json records that rate."""

from __future__ import annotations

import math
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from megatrain import runtime
from megatrain.engine import momentkernel
from megatrain.host.moments import BF16, FORMATS, FP32, Q8, Moments
from megatrain.planning import costmodel, probe
from megatrain.planning.memory import MemoryRecord
from megatrain.planning.placement import Machine, optimizer_threads, plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import memory  # noqa: E402

GiB = 2**30
FP32_RATE = 3.66e9  # the fp32 pass inside that host's 8B steps (params/s)


def _plan(moments: str, probed: dict[str, float] | None = None):
    run = memory.parse("B:16384")
    choices = replace(memory.choices_of(run), moments=moments, gpu_state="off")
    machine = Machine(
        "cuda", 139 * GiB, 120 * GiB, adam_params_s=FP32_RATE, moment_adam_params_s=probed or {}
    )
    return plan(memory.shape_of(run)[0], memory.batch_of(run), machine, choices)


def test_the_plan_steps_each_format_at_its_probed_rate():
    """Probed at fp32's rate, the 8-bit plan keeps its gradients (`stored`: the lighter state
    leaves the room) and predicts a step below fp32's; probed at 0.38 of it (the 8-bit pass's
    share inside a step before its kernel's 32-bit gathers: 1.39 against 3.66 G params/s, a 7.18 s
    step) it predicts a step near that one and hides the slower pass behind the backward sweep
    (`two_pass`), as fp32 does. A plan that ignored the probe's rate would give both the same."""
    fast, fp32 = _plan("8bit", {"8bit": FP32_RATE}), _plan("fp32")
    assert fast.grad_mode == "stored" and fp32.grad_mode == "two_pass"
    assert fast.step_time_s < fp32.step_time_s
    slow = _plan("8bit", {"8bit": 0.38 * FP32_RATE})
    assert slow.grad_mode == "two_pass"
    assert 6.5 < slow.step_time_s < 7.6  # measured: 7.18 s
    assert _plan("fp32", {"8bit": 0.38 * FP32_RATE}).step_time_s == fp32.step_time_s  # fp32 keeps its own


def test_a_format_not_probed_takes_fp32s_rate_and_mixed_moments_the_torch_ops():
    """Where nothing was probed (a plan made away from the run's host) bf16 and 8-bit moments step
    at fp32's rate, as 8-bit nearly did on the H200 host (0.95); a probed rate of another format
    changes nothing; moments of two formats (the torch ops' pass an operation) take MIXED_RATE of
    fp32's, probed or not."""
    m = Machine("cpu", adam_params_s=1e9, moment_adam_params_s={"bf16": 0.7e9})
    base = _plan("fp32")
    rates = {f.name: costmodel.adam_params_s(replace(base, moments=f.name), m) for f in FORMATS}
    assert rates == {"fp32": 1e9, "bf16": 0.7e9, "8bit": 1e9}
    mixed = replace(base, moments=Moments("bfloat16", "float32").name)
    assert costmodel.adam_params_s(mixed, m) == 1e9 * costmodel.MIXED_RATE < min(rates.values())


def test_the_machine_carries_the_probe_of_the_runs_format(monkeypatch):
    """On CUDA the run's format is timed on the optimizer threads and the probe's size fp32's are
    (the machine's threads, `probe.ADAM_PROBE`), read again as fp32's second reading is, and kept
    at the same share of the reading a step keeps (ADAM_IN_STEP); fp32 moments add no probe.
    plan.json records the format's rate beside fp32's, and the plan's rate is it."""
    asked = []

    def reading(moments, threads, numel, again=False):
        asked.append((moments.name, threads, numel, again))
        return 2.0e9 if moments == Q8 else None

    monkeypatch.setattr(probe, "_adam_rate", lambda numel: 5.0e9)
    monkeypatch.setattr(probe, "_ADAM_RATES", {})
    monkeypatch.setattr(momentkernel, "rate", reading)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    machine = Machine("cuda", 139 * GiB, 120 * GiB)
    q8, _ = runtime.probe_machine(machine, lambda: None, Q8)
    fp32, _ = runtime.probe_machine(machine, lambda: None, FP32)
    assert asked == [("8bit", optimizer_threads(), probe.ADAM_PROBE, True), ("fp32", *asked[0][1:])]
    assert q8.adam_params_s == fp32.adam_params_s == costmodel.ADAM_IN_STEP * 5.0e9
    assert q8.moment_adam_params_s == {"8bit": costmodel.ADAM_IN_STEP * 2.0e9}
    assert fp32.moment_adam_params_s == {}
    p = _plan("8bit")
    record = MemoryRecord(p, q8).record()
    assert record["machine"]["moment_adam_params_s"] == {"8bit": costmodel.ADAM_IN_STEP * 2.0e9}
    assert record["predicted"]["host_adam_params_s"] == costmodel.ADAM_IN_STEP * 2.0e9
    assert Machine.from_json(record["machine"]) == q8


def test_the_kernels_probe_times_its_pass_here(monkeypatch):
    """momentkernel.rate times the kernel itself on this host (a pass of 256K elements on one
    thread: parameters a second, once per process and size, the best kept when read again), and
    answers None where the kernel does not step the format (fp32, moments of two formats) or
    does not build here (then the torch ops step it)."""
    if momentkernel.load()[0] is None:
        pytest.skip(momentkernel.load()[1])
    monkeypatch.setattr(momentkernel, "_RATES", {})
    n = 2**18
    for f in (BF16, Q8):
        first = momentkernel.rate(f, 1, n)
        assert math.isfinite(first) and first > 1e6
        assert momentkernel.rate(f, 1, n) == first  # cached
        assert momentkernel.rate(f, 1, n, again=True) >= first
    assert set(momentkernel._RATES) == {("bf16", 1, n), ("8bit", 1, n)}
    assert momentkernel.rate(FP32, 1, n) is None
    assert momentkernel.rate(Moments("bfloat16", "float32"), 1, n) is None
    monkeypatch.setattr(momentkernel, "_LOADED", (None, "no compiler"))
    assert momentkernel.rate(Q8, 1, 2 * n) is None
