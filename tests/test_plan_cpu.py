"""`megatrain plan` for a CPU run and for long sequences: the step time from this CPU's measured
rate, and the caveat wherever a length passes the model's max_position_embeddings; the host AdamW
rate a run records beside the plan's."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import tiny_config
from test_checkpoint import make_run, write_yaml
from test_cli import run_cli

from megatrain.config import TrainConfig
from megatrain.host.state import build_units
from megatrain.models.config import ModelConfig
from megatrain.planning import probe
from megatrain.trainer import train

BEYOND = "beyond the model's max_position_embeddings 256: positions past it were never trained"


def _plan_yaml(tmp_path, **settings):
    if not (tmp_path / "model").exists():
        tiny_config("llama", vocab_size=97).save_pretrained(tmp_path / "model")  # 256 positions
    run = dict(model_config=str(tmp_path / "model"), device="cpu", max_host_memory="4GiB", **settings)
    return write_yaml(tmp_path / "run.yaml", run)


def test_plan_warns_as_train_does_and_caveats_long_contexts(tmp_path, capsys):
    rc, stdout, _ = run_cli(capsys, "plan", _plan_yaml(tmp_path, max_length=300))
    assert rc == 0
    assert f"megatrain: warning: max_length 300 is {BEYOND}" in stdout.splitlines()
    context = next(line for line in stdout.splitlines() if line.startswith("longest context: "))
    n = int(re.match(r"longest context: ([\d,]+) tokens", context).group(1).replace(",", ""))
    assert n > 256 and context.endswith(f"; {BEYOND}")
    largest = next(line for line in stdout.splitlines() if line.startswith("largest that fit"))
    longest = re.search(r"max_length=(\d+)", largest).group(1)
    assert largest.endswith(f"(max_length {longest}: {BEYOND})")
    rc, stdout, _ = run_cli(capsys, "plan", _plan_yaml(tmp_path, max_length=256))
    assert rc == 0 and "warning" not in stdout


def test_cpu_plan_times_the_step_at_this_cpus_rate(tmp_path, capsys, monkeypatch):
    """The step time scales with the rate measured here (it was a fixed 0.5 TFLOP/s, 3.5-4x
    optimistic on 2 cores), and the measurement is made once per process and shape."""
    calls, measured = [], [0.0]

    def rate(*args):
        calls.append(args)
        return measured[0]

    monkeypatch.setattr(probe, "cpu_matmul_rate", rate)
    monkeypatch.setattr(probe, "adam_rate", lambda *a: 1e15)  # the optimizer's share out of the way
    seconds = []
    for flops in (1e7, 2e7):
        measured[0] = flops
        monkeypatch.setattr(probe, "_PROBED", {})
        rc, stdout, _ = run_cli(capsys, "plan", _plan_yaml(tmp_path, max_length=128))
        assert rc == 0
        seconds.append(float(re.search(r"estimated step: ([\d.]+) s", stdout).group(1)))
    assert seconds[0] == pytest.approx(2 * seconds[1], rel=0.01) and seconds[1] > 1
    cfg = ModelConfig.from_json(tmp_path / "model")
    calls.clear()
    first = probe.cpu_layer_memory(cfg, torch.float32, 1024)
    assert probe.cpu_layer_memory(cfg, torch.float32, 1024) is first and len(calls) == 1
    assert first.flops_per_s == 2e7


def test_cpu_matmul_rate_is_a_rate():
    rate = probe.cpu_matmul_rate(64, 32, 48, torch.float32)
    assert 1e6 < rate < 1e15  # FLOP/s of any CPU


def test_the_run_records_its_host_adamw_rate_beside_the_plans(tmp_path, capsys):
    """plan.json puts the host AdamW's rate inside the run's steps (the transport's counters: every
    parameter once a step, in the time of the AdamW alone) beside the rate the plan assumed, and
    the run's last line says both."""
    base = make_run(tmp_path)
    steps = 3
    train(TrainConfig(**base, output_dir=str(tmp_path / "out"), max_steps=steps, logging_steps=1))
    record = json.loads((tmp_path / "out" / "plan.json").read_text())
    n = sum(
        u.numel for u in build_units(ModelConfig.from_json(tmp_path / "model"))
    )  # padded units: stepped whole
    measured, predicted = record["measured"], record["predicted"]
    assert measured["step"] == steps and measured["host_adam_params"] == steps * n
    assert measured["host_adam_s"] > 0 and measured["update_wait_s"] == 0  # the CPU steps in program order
    assert measured["host_adam_params_s"] == pytest.approx(steps * n / measured["host_adam_s"])
    assert predicted["host_adam_params_s"] == record["machine"]["adam_params_s"] > 0
    out = capsys.readouterr()
    line = [ln for ln in (out.out + out.err).splitlines() if "megatrain: memory:" in ln][-1]
    assert re.search(r"host AdamW \d+\.\d\d G params/s in its steps \(plan \d+\.\d\d\)", line), line


def test_a_host_cap_above_what_the_host_has_free_is_warned_of(tmp_path, monkeypatch):
    """max_host_memory above MemAvailable: the plan trusts it (hosts whose memory grows as it is
    used need that), and a run's preflight says so in one line; at or below it, or unknown,
    nothing is said."""
    from megatrain import plan
    from megatrain.plan import host_cap_beyond, preflight

    free = 20 * 2**30
    monkeypatch.setattr(plan, "host_available", lambda: free)  # MemAvailable moves as others run
    cfg = ModelConfig.from_hf(tiny_config())
    for cap, warned in (("1000TB", True), ("20GiB", False), (None, False)):
        run = TrainConfig(**make_run(tmp_path), output_dir=str(tmp_path / "out"), max_host_memory=cap)
        said: list[str] = []
        preflight(cfg, run, "cpu", 4, warn=said.append)
        assert [w for w in said if "max_host_memory" in w] == (
            [f"megatrain: warning: {host_cap_beyond(1000 * 10**12, free)}"] if warned else []
        )

    GiB = 2**30
    said = host_cap_beyond(124 * GiB, 120 * GiB)
    assert "max_host_memory" in said and "124" in said and "120" in said and "\n" not in said
    assert host_cap_beyond(120 * GiB, 120 * GiB) == ""
    assert host_cap_beyond(None, 120 * GiB) == "" and host_cap_beyond(124 * GiB, None) == ""
