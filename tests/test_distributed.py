"""Data parallel training (distributed.py, launch.py) on the CPU with gloo: two processes equal
one process with the same global batch, checkpoints move between world sizes, a dead rank stops
the run with one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from helpers import tiny_config
from test_checkpoint import make_run, metrics, subprocess_env, tensors, write_yaml

from megatrain.config import TrainConfig
from megatrain.devices import check_devices
from megatrain.errors import ConfigError
from megatrain.host.hostmem import shared_buffer
from megatrain.parallel.launch import children
from megatrain.parallel.layout import slices
from megatrain.parallel.processgroup import SHM_DIR, ProcessGroup
from megatrain.trainer import train

STEPS = 3


def launch(cfg_path: Path, *overrides: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """`megatrain train cfg_path nproc_per_node=2 ...` in a subprocess (unless the overrides set
    nproc_per_node: a key given twice is refused)."""
    nproc = [] if any(o.startswith("nproc_per_node=") for o in overrides) else ["nproc_per_node=2"]
    return subprocess.run(
        [sys.executable, "-m", "megatrain", "train", str(cfg_path), *nproc, *overrides],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_same_run(got: list[dict], want: list[dict], steps: list[int]) -> None:
    """The same data in the same order (token counts are integers), the same schedule, and
    losses and gradient norms equal up to the order of fp32 sums."""
    got = {r["step"]: r for r in got if "loss" in r}
    want = {r["step"]: r for r in want if "loss" in r}
    for s in steps:
        a, b = got[s], want[s]
        assert (a["tokens"], a["label_tokens"], a["lr"]) == (b["tokens"], b["label_tokens"], b["lr"]), s
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5, abs=0), s
        assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-5, abs=0), s


def assert_close_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6, msg=k)


def one_and_two(tmp: Path, base: dict) -> subprocess.CompletedProcess:
    """`base` (4 micro-batches a step) trained by one process into tmp/one, then by two with 2
    micro-batches each (the same global batch) into tmp/two; the two-process launch's result."""
    train(TrainConfig(**base, output_dir=str(tmp / "one")))
    proc = launch(
        write_yaml(tmp / "run.yaml", base), "gradient_accumulation_steps=2", f"output_dir={tmp / 'two'}"
    )
    assert proc.returncode == 0, proc.stderr
    return proc


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One process with gradient_accumulation_steps 4, and two with 2 each (the same global
    batch), 3 steps with clipping active (grad norms ~6 against max_grad_norm 1), a checkpoint
    after every step."""
    tmp = tmp_path_factory.mktemp("dp")
    base = make_run(tmp)
    base.update(max_steps=STEPS, save_steps=1, gradient_accumulation_steps=4)
    base.update(eval_dataset=base["dataset"], eval_steps=STEPS)  # evaluated once, at the end
    torch.set_num_threads(1)
    shm_before = set(os.listdir(SHM_DIR))
    proc = one_and_two(tmp, base)
    return tmp, base, tmp / "run.yaml", proc, shm_before


@pytest.mark.slow
def test_two_processes_equal_one_with_the_same_global_batch(runs):
    tmp, _, _, proc, shm_before = runs
    one, two = tmp / "one", tmp / "two"
    assert max(r.get("grad_norm", 0) for r in metrics(one)) > 1.0  # clipping was active
    assert_same_run(metrics(two), metrics(one), list(range(1, STEPS + 1)))
    assert_close_weights(tensors(two / "final"), tensors(one / "final"))
    # The ranks split the eval set between them; the loss is over all of it.
    (got,), (want,) = ([r for r in metrics(d) if "eval_loss" in r] for d in (two, one))
    assert got["eval_label_tokens"] == want["eval_label_tokens"]
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-5, abs=0)
    # The checkpoints hold the same moments: the two ranks' slices made one whole state.
    assert_close_weights(tensors(two / "checkpoint-3"), tensors(one / "checkpoint-3"))
    assert "data parallel over 2 processes" in proc.stdout
    assert proc.stdout.count("megatrain: saved") == STEPS + 1  # one writer
    assert set(os.listdir(SHM_DIR)) <= shm_before  # the shared state left nothing behind
    assert not (two / ".megatrain.lock").exists()  # rank 0's; the other rank was not refused by it
    assert json.loads((two / "checkpoint-1" / "train_config.json").read_text())["world_size"] == 2


@pytest.mark.slow
def test_checkpoint_of_two_processes_resumes_in_one_and_back(runs):
    tmp, base, cfg_path, _, _ = runs
    one, two = tmp / "one", tmp / "two"
    # Two processes' checkpoint-1, continued by one process with the same global batch.
    a = tmp / "two_then_one"
    train(TrainConfig(**base, output_dir=str(a), resume_from_checkpoint=str(two / "checkpoint-1")))
    assert_same_run(metrics(a), metrics(two), [2, 3])
    assert_close_weights(tensors(a / "checkpoint-3"), tensors(two / "checkpoint-3"))
    # One process's checkpoint-1, continued by two.
    b = tmp / "one_then_two"
    proc = launch(
        cfg_path,
        "gradient_accumulation_steps=2",
        f"output_dir={b}",
        f"resume_from_checkpoint={one / 'checkpoint-1'}",
    )
    assert proc.returncode == 0, proc.stderr
    assert "settings changed" not in proc.stdout  # the global batch is the same
    assert_same_run(metrics(b), metrics(one), [2, 3])
    assert_close_weights(tensors(b / "checkpoint-3"), tensors(one / "checkpoint-3"))


@pytest.mark.slow
def test_moe_aux_loss_two_processes_equal_one(tmp_path):
    """An OLMoE with the load-balancing loss on: each micro-batch's aux loss uses its own router
    counts, so two processes with half the micro-batches each give one process's losses (aux terms
    included), gradient norms and weights; the logged aux loss and expert loads are every
    process's micro-batches', as one process logs them."""
    base = make_run(tmp_path, n=16)
    tiny_config("olmoe").save_pretrained(tmp_path / "model")  # aux loss on, coefficient 0.5
    base.update(max_steps=2, gradient_accumulation_steps=4)
    torch.set_num_threads(1)
    one_and_two(tmp_path, base)
    one, two = metrics(tmp_path / "one"), metrics(tmp_path / "two")
    assert all(r["aux_loss"] > 0 for r in one if "loss" in r)
    assert_same_run(two, one, [1, 2])
    steps = [(a, b) for a, b in zip(two, one) if "loss" in b]
    assert len(steps) == 2
    for a, b in steps:
        assert a["aux_loss"] == pytest.approx(b["aux_loss"], rel=1e-6)
        assert (a["expert_load_max"], a["expert_load_min"]) == pytest.approx(
            (b["expert_load_max"], b["expert_load_min"]), rel=1e-6
        )
    assert_close_weights(tensors(tmp_path / "two" / "final"), tensors(tmp_path / "one" / "final"))


def rank_of(pid: int) -> str | None:
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(e.decode().split("=", 1) for e in env if b"=" in e).get("RANK")


def start_endless(base: dict, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """Two processes training for ever (no saves), once the first step is logged."""
    out = tmp_path / "out"
    cfg_path = write_yaml(tmp_path / "run.yaml", dict(base, max_steps=100_000, save_steps=0))
    proc = subprocess.Popen(
        [sys.executable, "-m", "megatrain", "train", str(cfg_path), "nproc_per_node=2", f"output_dir={out}"],
        env=subprocess_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 120
    while not ((out / "metrics.jsonl").exists() and (out / "metrics.jsonl").read_text()):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.2)
    return proc, out


@pytest.mark.slow
def test_a_killed_rank_stops_the_run_with_one_line(runs, tmp_path):
    proc, _ = start_endless(runs[1], tmp_path)
    (victim,) = [pid for pid in children(proc.pid) if rank_of(pid) == "1"]
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    _, err = proc.communicate(timeout=90)
    assert time.monotonic() - t0 < 60
    assert proc.returncode == 128 + signal.SIGKILL
    assert f"megatrain: error: rank 1 of 2 (pid {victim}) was killed by SIGKILL" in err
    assert "Traceback" not in err


@pytest.mark.slow
def test_sigterm_to_the_launcher_saves_one_checkpoint_and_exits_143(runs, tmp_path):
    proc, out = start_endless(runs[1], tmp_path)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=90)
    assert proc.returncode == 143, err
    last = metrics(out)[-1]["step"]
    assert [p.name for p in out.glob("checkpoint-*")] == [f"checkpoint-{last}"]
    assert err.count(f"megatrain: received SIGTERM, saved checkpoint-{last}") == 1, err
    assert "Traceback" not in err


def test_shared_buffer_is_one_memory(tmp_path):
    a = shared_buffer(tmp_path / "buf", 5000, create=True)
    b = shared_buffer(tmp_path / "buf", 5000, create=False)
    a[4321] = 7.0
    assert b[4321] == 7.0 and b.sum() == 7.0  # created zero-filled
    with pytest.raises(FileExistsError):
        shared_buffer(tmp_path / "buf", 5000, create=True)  # never another run's memory


def test_slices_cover_a_unit_on_page_boundaries():
    for numel, parts in [(1024 * 7, 2), (1024 * 8, 3), (1024, 4)]:
        s = slices(numel, parts)
        assert s[0][0] == 0 and s[-1][1] == numel and len(s) == parts
        assert all(a[1] == b[0] for a, b in zip(s, s[1:]))
        assert all(lo % 1024 == 0 and lo <= hi for lo, hi in s)


def test_cuda_world_without_nccl_is_one_line(monkeypatch):
    import torch.distributed as dist

    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setattr(dist, "is_nccl_available", lambda: False)
    with pytest.raises(ConfigError, match="needs NCCL"):
        ProcessGroup(torch.device("cuda", 0), timeout_s=10)


# ---------------------------------------------------------------------------- on GPUs
@pytest.mark.gpu
def test_resume_with_device_resident_state_is_exact(tmp_path, monkeypatch):
    """The units whose fp32 state the plan keeps on the GPU get the checkpoint's moments too
    (they were copied to the GPU before the moments were loaded). Three units are made resident
    whatever the cost model would choose for so small a model."""
    from dataclasses import replace

    from megatrain import plan as plan_module

    choices_of = plan_module.choices_of
    monkeypatch.setattr(plan_module, "choices_of", lambda cfg: replace(choices_of(cfg), resident_units=3))
    base = make_run(tmp_path)
    base.update(device="cuda", compute_dtype="float32", torch_compile=False, max_steps=4)
    train(TrainConfig(**base, output_dir=str(tmp_path / "a")))
    b = tmp_path / "b"
    train(TrainConfig(**dict(base, max_steps=2), output_dir=str(b)))
    train(TrainConfig(**base, output_dir=str(b), resume_from_checkpoint=True))
    assert json.loads((b / "plan.json").read_text())["plan"]["resident_units"] > 0  # the case at issue
    assert [r["loss"] for r in metrics(b)] == [r["loss"] for r in metrics(tmp_path / "a")]
    got, want = tensors(b / "final"), tensors(tmp_path / "a" / "final")
    assert all(torch.equal(got[k], want[k]) for k in want)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("gpu_state", ["auto", "off"])
def test_two_gpus_equal_one_with_the_same_global_batch(tmp_path, gpu_state):
    """NCCL, the streaming transport on page-locked shared state, each rank stepping its slice
    (on the GPU for resident units, on the host otherwise)."""
    base = make_run(tmp_path)
    base.update(device="cuda", compute_dtype="float32", torch_compile=False, gpu_state=gpu_state)
    base.update(max_steps=STEPS, save_steps=1, gradient_accumulation_steps=4)
    one_and_two(tmp_path, base)
    assert_same_run(metrics(tmp_path / "two"), metrics(tmp_path / "one"), list(range(1, STEPS + 1)))
    assert_close_weights(
        tensors(tmp_path / "two" / "checkpoint-3"), tensors(tmp_path / "one" / "checkpoint-3")
    )


def test_more_processes_than_gpus_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    with pytest.raises(ConfigError, match="nproc_per_node: 3 processes, but this machine has 2 GPUs"):
        check_devices(torch.device("cuda"), 3)
    with pytest.raises(ConfigError, match="device: cuda:1 names one GPU"):
        check_devices(torch.device("cuda", 1), 2)
    check_devices(torch.device("cpu"), 8)  # gloo: any number of processes
