"""The disk tier (host/disk.py, `offload_dir`): where host memory cannot hold the state, the plan
puts the AdamW moments of the last units in files on disk. A run with a tier trains bitwise as
the run without one, resumes from its checkpoints as exactly, leaves no file behind, and a tier
the disk cannot hold is refused in one line."""

from __future__ import annotations

import errno
import json
import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_checkpoint import assert_bitwise, make_run, one_thread, tensors  # noqa: F401

from megatrain import plan as planning
from megatrain.config import TrainConfig
from megatrain.errors import MegatrainError
from megatrain.host import disk
from megatrain.host.disk import MOMENT_BYTES, DiskTier, DiskTierError
from megatrain.host.state import HostState, build_units
from megatrain.models.config import ModelConfig
from megatrain.trainer import train


def mapped_from_tier(t: torch.Tensor) -> bool:
    """Whether any of `t`'s memory is mapped from a tier file."""
    start, end = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            a, b = (int(x, 16) for x in fields[0].split("-"))
            if a < end and start < b and len(fields) >= 6 and ".tier" in fields[5]:
                return True
    return False


def host_budget(base: dict, units: int, device: str = "cpu") -> int:
    """A max_host_memory under which the run fits only with the moments of its last `units` units
    on disk: the least host memory any in-memory placement needs, less those moments. Found by
    bisection, not from the default plan's total: on a GPU the plan meets a tighter budget by
    moving gradients to the device, so the default plan's total less the moments still fits."""
    cfg = TrainConfig(**base)
    model_cfg = ModelConfig.from_json(cfg.model_config)
    machine = planning.machine_of(cfg, device)
    layer_mem = planning.layer_memory(model_cfg, cfg, device, 4)

    def fits(host: int) -> bool:
        return planning.check(model_cfg, cfg, replace(machine, host_bytes=host), 4, layer_mem=layer_mem).fits

    lo, hi = 0, 1 << 40  # max_host_memory (the plan keeps its reserve): lo does not fit, hi does
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    state = HostState(build_units(model_cfg), with_optimizer=False)
    tail = state.units[len(state.units) - units :]
    return hi - MOMENT_BYTES * sum(u.numel for u in tail) + 4096  # the tier adds its bytes back


@pytest.fixture
def base(tmp_path):
    return make_run(tmp_path) | dict(max_steps=4, save_strategy="no")


def test_moments_mapped_from_a_deleted_file_keep_their_values(tmp_path):
    from helpers import tiny_config

    state = HostState(build_units(ModelConfig.from_hf(tiny_config("llama"))))
    tier = DiskTier(state, 2, tmp_path / "tier")
    lo = state.starts[state.units[-2].index]
    assert tier.nbytes == 2 * 4 * (state.numel - lo)
    assert mapped_from_tier(state.exp_avg[lo:]) and not mapped_from_tier(state.exp_avg[:lo])
    assert os.listdir(tmp_path / "tier") == []  # scratch from the start
    state.exp_avg.copy_(torch.arange(state.numel, dtype=torch.float32))
    state.exp_avg_sq.fill_(0.25)
    assert torch.equal(state.exp_avg, torch.arange(state.numel, dtype=torch.float32))
    assert float(state.exp_avg_sq[lo:].sum()) == 0.25 * (state.numel - lo)


def test_a_run_with_a_disk_tier_trains_bitwise_as_in_memory_and_leaves_nothing(tmp_path, base, monkeypatch):
    train(TrainConfig(**base, output_dir=str(tmp_path / "ram")))

    seen = []
    real = DiskTier.__init__

    def watched(self, state, units, directory):
        real(self, state, units, directory)
        seen.append((units, mapped_from_tier(state.exp_avg[-1:]), mapped_from_tier(state.exp_avg_sq[-1:])))

    monkeypatch.setattr(DiskTier, "__init__", watched)
    tier = tmp_path / "nvme"
    tier.mkdir()
    (tier / "notes.txt").write_text("the user's")  # offload_dir may hold the user's files
    max_host = host_budget(base, 2)
    train(
        TrainConfig(
            **base, output_dir=str(tmp_path / "disk"), offload_dir=str(tier), max_host_memory=max_host
        )
    )
    assert seen and all(s[1] and s[2] for s in seen) and 1 <= seen[0][0] <= 2
    assert_bitwise(tensors(tmp_path / "disk" / "final"), tensors(tmp_path / "ram" / "final"))
    recorded = json.loads((tmp_path / "disk" / "plan.json").read_text())["plan"]
    assert recorded["disk_units"] == seen[0][0]
    assert any("disk tier" in n for n in recorded["notes"])
    assert os.listdir(tier) == ["notes.txt"] and (tier / "notes.txt").read_text() == "the user's"


def test_a_resume_rebuilds_the_tier_from_its_checkpoint(tmp_path, base):
    train(TrainConfig(**base, output_dir=str(tmp_path / "ram")))
    max_host = host_budget(base, 3)
    kw = dict(offload_dir=str(tmp_path / "nvme"), max_host_memory=max_host, output_dir=str(tmp_path / "disk"))
    train(TrainConfig(**(base | kw | dict(max_steps=2, save_strategy="steps", save_steps=2))))
    train(TrainConfig(**(base | kw | dict(resume_from_checkpoint=True))))
    assert json.loads((tmp_path / "disk" / "plan.json").read_text())["plan"]["disk_units"] >= 1
    assert_bitwise(tensors(tmp_path / "disk" / "final"), tensors(tmp_path / "ram" / "final"))


def test_a_tier_the_disk_cannot_hold_is_refused_in_one_line(tmp_path, base):
    cfg = TrainConfig(**base, output_dir=str(tmp_path / "out"), offload_dir=str(tmp_path / "nvme"),
                      max_host_memory=host_budget(base, 2), max_disk_memory="1KB")  # fmt: skip
    with pytest.raises(MegatrainError) as e:
        train(cfg)
    msg = str(e.value)
    assert "disk tier" in msg and "offload_dir" in msg and "\n" not in msg


def test_no_space_when_the_tier_is_made_is_one_line_with_the_numbers(tmp_path, monkeypatch):
    from helpers import tiny_config

    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(disk.os, "posix_fallocate", full)
    state = HostState(build_units(ModelConfig.from_hf(tiny_config("llama"))))
    with pytest.raises(DiskTierError) as e:
        DiskTier(state, 1, tmp_path / "tier")
    msg = str(e.value)
    assert str(tmp_path / "tier") in msg and "GiB free" in msg and "needs" in msg and "\n" not in msg
    assert os.listdir(tmp_path / "tier") == []
    assert not mapped_from_tier(state.exp_avg)


def test_offload_dir_needs_one_process_and_max_disk_memory_needs_offload_dir(base, tmp_path):
    from megatrain.errors import ConfigError

    with pytest.raises(ConfigError, match="offload_dir"):
        TrainConfig(**base, offload_dir=str(tmp_path), nproc_per_node=2)
    with pytest.raises(ConfigError, match="max_disk_memory: needs offload_dir"):
        TrainConfig(**base, max_disk_memory="10GB")


def test_megatrain_plan_shows_the_tier(tmp_path, base, capsys):
    from test_checkpoint import write_yaml
    from test_cli import run_cli

    settings = base | dict(offload_dir=str(tmp_path / "nvme"), max_host_memory=host_budget(base, 3))
    rc, out, _ = run_cli(capsys, "plan", write_yaml(tmp_path / "run.yaml", settings))
    assert rc == 0, out
    line = next(x for x in out.splitlines() if "disk tier" in x)
    assert "AdamW moments of the last" in line and "offload_dir" in line and "GB/s each way" in line


def test_the_disk_rate_is_measured_where_the_tier_goes(tmp_path):
    rate = disk.measure_rate(tmp_path / "nvme", nbytes=16 * 2**20)
    assert 1e6 < rate < 1e12
    assert os.listdir(tmp_path / "nvme") == []


def test_the_tier_counts_in_output_dirs_disk_space_where_they_share_a_file_system(
    tmp_path, base, monkeypatch
):
    from megatrain.io import outputs

    cfg = TrainConfig(**base, output_dir=str(tmp_path / "out"), offload_dir=str(tmp_path / "nvme"),
                      max_host_memory=host_budget(base, 2))  # fmt: skip
    final = ModelConfig.from_json(cfg.model_config).num_params * 4  # save_dtype float32, no checkpoint
    monkeypatch.setattr(outputs, "free_bytes", lambda path: final + 64)  # final/ fits, the tier does not
    with pytest.raises(MegatrainError, match="the disk tier in offload_dir") as e:
        train(cfg)
    assert "\n" not in str(e.value)


@pytest.mark.gpu
def test_on_cuda_a_tier_trains_bitwise_as_in_memory(tmp_path, base):
    """The GPU's schedule (page-locked master weights, the CPU AdamW overlapping the sweeps) with
    the moments of the last units mapped from disk: the same weights as without the tier."""
    base = base | dict(device="cuda", compute_dtype="float32", gpu_state="off")
    train(TrainConfig(**base, output_dir=str(tmp_path / "ram")))
    max_host = host_budget(base, 2, "cuda")
    train(TrainConfig(**base, output_dir=str(tmp_path / "disk"), offload_dir=str(tmp_path / "nvme"),
                      max_host_memory=max_host))  # fmt: skip
    assert json.loads((tmp_path / "disk" / "plan.json").read_text())["plan"]["disk_units"] >= 1
    assert_bitwise(tensors(tmp_path / "disk" / "final"), tensors(tmp_path / "ram" / "final"))


def test_a_killed_process_leaves_no_tier_file(tmp_path):
    """SIGKILL while the tier holds moments: its files were unlinked when made, so nothing is
    left in offload_dir (the kernel frees their blocks with the process)."""
    import signal
    import subprocess
    import sys

    code = (
        "import sys, time; sys.path.insert(0, 'tests')\n"
        "from helpers import tiny_config\n"
        "from megatrain.host.disk import DiskTier\n"
        "from megatrain.host.state import HostState, build_units\n"
        "from megatrain.models.config import ModelConfig\n"
        "s = HostState(build_units(ModelConfig.from_hf(tiny_config('llama'))))\n"
        f"DiskTier(s, 2, {str(tmp_path / 'nvme')!r}); s.exp_avg.fill_(1.0)\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                         cwd=Path(__file__).resolve().parents[1])  # fmt: skip
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert os.listdir(tmp_path / "nvme") == []
