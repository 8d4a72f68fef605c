"""The CPU threads of a run: OpenMP waits passively under the command line, and a CPU run takes
the CPUs its process may use (its affinity, the load where OpenMP spins), unless the user chose."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_config

from megatrain import OMP_WAIT_POLICY
from megatrain.models.config import ModelConfig
from megatrain.runtime import build_model, cpu_threads

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def threads():
    """Restores torch's intra-op threads after a test that lets megatrain choose them."""
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def _machine(monkeypatch, cpus: int, load: float, policy: str | None) -> None:
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cpus)))
    monkeypatch.setattr(os, "getloadavg", lambda: (load, load, load))
    if policy is None:
        monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    else:
        monkeypatch.setenv("OMP_WAIT_POLICY", policy)


def test_cpu_threads_are_the_affinity_share_and_leave_busy_cpus_where_openmp_spins(monkeypatch):
    _machine(monkeypatch, cpus=8, load=3.6, policy="passive")  # sleeping threads: the load is harmless
    assert cpu_threads() == 8 and cpu_threads(ranks_per_machine=2) == 4 and cpu_threads(16) == 1
    _machine(monkeypatch, cpus=8, load=3.6, policy=None)  # spinning threads: 3 CPUs are busy
    assert cpu_threads() == 5 and cpu_threads(ranks_per_machine=2) == 4
    _machine(monkeypatch, cpus=8, load=20.0, policy="ACTIVE")
    assert cpu_threads() == 1


def test_a_cpu_run_sets_its_threads_unless_the_user_chose(monkeypatch, threads):
    cfg = ModelConfig.from_hf(tiny_config("llama"))
    _machine(monkeypatch, cpus=3, load=0.0, policy=OMP_WAIT_POLICY)
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(1)
    build_model(cfg, device="cpu").close()
    assert torch.get_num_threads() == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    torch.set_num_threads(2)
    build_model(cfg, device="cpu").close()
    assert torch.get_num_threads() == 2  # the user's OMP_NUM_THREADS: left as torch set it


def test_the_command_line_sets_the_wait_policy_before_torch_loads():
    """libgomp reads OMP_WAIT_POLICY once, as torch loads it: the command line's module does not
    load torch, main sets the policy before any command does, and leaves the user's own; where
    torch was loaded first, main leaves it unset (cpu_threads then counts on spinning threads)."""
    code = """
import os, sys
from megatrain.cli import main
loaded = "torch" in sys.modules
if sys.argv[1] == "torch-first":  # a stand-in: main looks for a loaded torch, and plot needs none
    sys.modules["torch"] = type(sys)("torch")
main(["plot", "/nonexistent-run"])
print(loaded, os.environ.get("OMP_WAIT_POLICY"))
"""
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "PYTHONPATH")}

    def run(how: str, **extra: str) -> str:
        argv = [sys.executable, "-c", code, how]
        out = subprocess.run(
            argv, env=env | extra | {"PYTHONPATH": str(REPO)}, capture_output=True, text=True
        )
        assert "error" in out.stderr, out.stderr  # the command ran, and failed as it should
        return out.stdout.strip()

    assert run("cli-first") == f"False {OMP_WAIT_POLICY}"
    assert run("cli-first", OMP_WAIT_POLICY="ACTIVE") == "False ACTIVE"  # the user's own
    assert run("torch-first") == "False None"
