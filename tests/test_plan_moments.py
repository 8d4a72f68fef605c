"""The plan's host AdamW in each moment format (`optim`): the step it predicts and its choice
between stored gradients and the two-pass step take the format's rate (costmodel.MOMENT_RATE),
not fp32's, on the 8B Llama shape at 16k tokens with all state in host memory, as measured on a
16-core H200 host (docs/memory.md's optim section)."""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

from megatrain.planning import costmodel
from megatrain.planning.placement import Machine, plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import memory  # noqa: E402

GiB = 2**30
FP32_RATE = 3.66e9  # the fp32 pass inside that host's 8B steps (params/s)


def _plan(moments: str):
    run = memory.parse("B:16384")
    choices = replace(memory.choices_of(run), moments=moments, gpu_state="off")
    machine = Machine("cuda", 139 * GiB, 120 * GiB, adam_params_s=FP32_RATE)
    return plan(memory.shape_of(run)[0], memory.batch_of(run), machine, choices)


def test_the_plan_steps_each_format_at_its_own_rate(monkeypatch):
    """At fp32's rate the 8-bit plan keeps its gradients (`stored`: the lighter state leaves the
    room) and predicts a step below fp32's; at 0.38 of it (the 8-bit pass's share inside a step
    before its kernel's 32-bit gathers: 1.39 against 3.66 G params/s, a 7.18 s step) it predicts
    a step near that one and hides the slower pass behind the backward sweep (`two_pass`), as
    fp32 does. A plan that ignored the format's rate would give both the same."""
    monkeypatch.setitem(costmodel.MOMENT_RATE, "8bit", 1.0)
    fast, fp32 = _plan("8bit"), _plan("fp32")
    assert fast.grad_mode == "stored" and fp32.grad_mode == "two_pass"
    assert fast.step_time_s < fp32.step_time_s
    monkeypatch.setitem(costmodel.MOMENT_RATE, "8bit", 0.38)
    slow = _plan("8bit")
    assert slow.grad_mode == "two_pass"
    assert 6.5 < slow.step_time_s < 7.6  # measured: 7.18 s
    assert _plan("fp32").step_time_s == fp32.step_time_s  # fp32's plan keeps its own rate


def test_each_format_has_a_rate_and_mixed_moments_the_torch_ops():
    """Every format `megatrain plan` compares has its rate; moments of two formats (the torch
    ops' pass an operation) take the slowest."""
    from megatrain.host.moments import FORMATS, Moments

    assert {f.name for f in FORMATS} <= set(costmodel.MOMENT_RATE)
    m = Machine("cpu", adam_params_s=1e9)
    mixed = replace(_plan("fp32"), moments=Moments("bfloat16", "float32").name)
    assert (
        costmodel.adam_params_s(mixed, m)
        == 1e9 * costmodel.MIXED_RATE
        < 1e9 * min(costmodel.MOMENT_RATE.values())
    )
