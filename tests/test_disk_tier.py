"""The disk tier (host/disk.py, `offload_dir`): where host memory cannot hold the state, the plan
puts the AdamW moments of the last units in a file on disk, moved through a ring of host buffers
read ahead of the optimizer's pass and written behind it. A run with a tier trains bitwise as the
run without one, through O_DIRECT or buffered I/O, resumes from its checkpoints as exactly (also
after a SIGKILL in the middle of its I/O), leaves no file behind, and a tier the disk cannot hold
is refused in one line. Striped over several folders (one per drive), its blocks alternate
between their files and a run is as exact; here the folders share tmp_path's disk (`one_disk`)."""

from __future__ import annotations

import errno
import fcntl
import json
import math
import mmap
import os
import signal
import subprocess
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_checkpoint import assert_bitwise, make_run, one_thread, tensors  # noqa: F401

from megatrain import plan as planning
from megatrain.config import TrainConfig
from megatrain.errors import MegatrainError
from megatrain.host import disk, tierfile
from megatrain.host.disk import DiskTier, DiskTierError
from megatrain.host.moments import FP32
from megatrain.host.state import HostState, build_units
from megatrain.models.config import ModelConfig
from megatrain.trainer import train

REPO = Path(__file__).resolve().parents[1]

MOMENT_BYTES = int(FP32.bytes_per_param)  # the fp32 moments a parameter


def takes_o_direct(directory: Path) -> bool:
    """Whether `directory`'s file system reads and writes O_DIRECT (asked here, not of disk.py)."""
    directory.mkdir(parents=True, exist_ok=True)
    fd, path = tempfile.mkstemp(dir=directory)
    os.unlink(path)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) | os.O_DIRECT)
        page = mmap.mmap(-1, mmap.PAGESIZE)
        return os.pwritev(fd, [page], 0) == mmap.PAGESIZE and os.preadv(fd, [page], 0) == mmap.PAGESIZE
    except OSError:
        return False
    finally:
        os.close(fd)


@pytest.fixture
def direct_dir(tmp_path):
    """A folder whose file system takes O_DIRECT: tmp_path's, else one under /var/tmp (a real disk
    where /tmp is a tmpfs that refuses it); skipped, saying so, where neither does."""
    if takes_o_direct(tmp_path / "probe"):
        yield tmp_path / "direct"
        return
    with tempfile.TemporaryDirectory(dir="/var/tmp") as d:
        if not takes_o_direct(Path(d) / "probe"):
            pytest.skip(f"neither {tmp_path} nor /var/tmp takes O_DIRECT: the direct path is not tested here")
        yield Path(d) / "direct"


@pytest.fixture
def refuse_o_direct(monkeypatch):
    """offload_dir's file system refuses O_DIRECT, as an older kernel's tmpfs does."""
    real = fcntl.fcntl

    def refusing(fd, cmd, arg=0):
        if cmd == fcntl.F_SETFL and arg & os.O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real(fd, cmd, arg)

    monkeypatch.setattr(tierfile.fcntl, "fcntl", refusing)


def tiny_state() -> HostState:
    from helpers import tiny_config

    return HostState(build_units(ModelConfig.from_hf(tiny_config("llama"))))


PLACED = {"host": "stored", "two_pass": "two_pass"}  # gradient_placement -> the plan's grad_mode


def planned(out: Path) -> dict:
    """The plan of the run in output folder `out` (its plan.json's "plan")."""
    return json.loads((out / "plan.json").read_text())["plan"]


# The plan's choices that change a step's arithmetic (the order of a sum): two runs that agree on
# them train bitwise alike, wherever their state lives.
ARITHMETIC = ("grad_mode", "gpu_grad_units", "resident_units", "gpu_stepped_units", "keep_layers",
              "parked_layers", "loss_chunk_tokens", "mlp_tile_tokens", "staging_elems")  # fmt: skip


def assert_same_arithmetic(a: Path, b: Path) -> None:
    """The runs in output folders `a` and `b` were planned to compute alike (ARITHMETIC)."""
    pa, pb = planned(a), planned(b)
    assert {k: pa[k] for k in ARITHMETIC} == {k: pb[k] for k in ARITHMETIC}


def host_budget(base: dict, units: int, device: str = "cpu", compute_bytes: int = 4) -> int:
    """A max_host_memory under which the run fits only with the moments of its last `units` units
    on disk: the least host memory any in-memory placement needs, less those moments. Found by
    bisection, not from the default plan's total: on a GPU the plan meets a tighter budget by
    moving gradients to the device, so the default plan's total less the moments still fits."""
    cfg = TrainConfig(**base)
    model_cfg = ModelConfig.from_json(cfg.model_config)
    machine = planning.machine_of(cfg, device)
    layer_mem = planning.layer_memory(model_cfg, cfg, device, compute_bytes)

    def fits(host: int) -> bool:
        at = replace(machine, host_bytes=host)
        return planning.check(model_cfg, cfg, at, compute_bytes, layer_mem=layer_mem).fits

    lo, hi = 0, 1 << 40  # max_host_memory (the plan keeps its reserve): lo does not fit, hi does
    while hi - lo > 4096:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    state = HostState(build_units(model_cfg), with_optimizer=False)
    tail = [u.numel for u in state.units[len(state.units) - units :]]
    ring = disk.ring_bytes(tail, cfg.moments())  # the tier's staging ring takes host memory back
    return hi - disk.tier_bytes(tail, cfg.moments()) + ring + 4096


@pytest.fixture
def base(tmp_path):
    return make_run(tmp_path) | dict(max_steps=4, save_strategy="no")


@pytest.fixture(autouse=True)
def small_blocks(monkeypatch):
    """Blocks of 4096 elements through a ring of 3, in the tier and in the plan: the tiny models'
    units are cut in several blocks, the optimizer's pass evicts and reads ahead, and a tier frees
    more host memory than its ring takes (with 64 MiB blocks no tiny model's would). The plan
    measures each drive's rates on 16 MiB (a run's own rates are not what these tests check)."""
    monkeypatch.setattr(disk, "BLOCK_ELEMS", 4096)
    monkeypatch.setattr(disk, "RING_SLOTS", 3)
    monkeypatch.setattr(disk, "RATE_PROBE_BYTES", 16 * 2**20)


@pytest.fixture
def one_disk(monkeypatch):
    """Folders on one file system stand for drives (disk.py refuses them otherwise)."""
    monkeypatch.setattr(disk, "ONE_DRIVE_PER_FOLDER", False)


@pytest.fixture
def tiers(monkeypatch):
    """The tiers a run makes."""
    made = []
    real = DiskTier.__init__

    def recorded(self, *args):
        real(self, *args)
        made.append(self)

    monkeypatch.setattr(DiskTier, "__init__", recorded)
    return made


def fill_blocks(tier: DiskTier, seed: int) -> dict[tuple[int, str], torch.Tensor]:
    """Random moments through the ring, unit by unit; returns each unit's, by (unit, moment)."""
    g = torch.Generator().manual_seed(seed)
    want = {}
    for u in tier.units:
        m, v = torch.randn(u.numel, generator=g), torch.rand(u.numel, generator=g)
        want[u.index, "exp_avg"], want[u.index, "exp_avg_sq"] = m, v
        for a, b in tier.blocks(u, 0, u.numel):
            with tier.staged(u, a, b) as (sm, sv):
                sm.copy_(m[a:b])
                sv.copy_(v[a:b])
    return want


def test_the_tiers_moments_live_in_its_file_and_come_back_exactly(tmp_path):
    state = tiny_state()
    tier = DiskTier(state, 3, tmp_path / "tier")
    first = state.units[-3]
    lo = state.starts[first.index]
    assert state.tier is tier and tier.nbytes == MOMENT_BYTES * (state.numel - lo)
    assert state.exp_avg.numel() == state.exp_avg_sq.numel() == lo  # no host memory behind the tier
    assert state.nbytes == 4 * (state.numel + 2 * lo)
    with pytest.raises(ValueError, match="disk tier"):
        state.flat(first, "exp_avg")
    assert os.listdir(tmp_path / "tier") == []  # the file never has a name there
    assert len(tier._blocks) > len(tier._slots)  # the ring cannot hold the tier: it evicts
    want = fill_blocks(tier, 0)
    for u in reversed(tier.units):  # back through the ring in another order
        for a, b in tier.blocks(u, 0, u.numel):
            with tier.staged(u, a, b) as (m, v):
                assert torch.equal(m, want[u.index, "exp_avg"][a:b])
                assert torch.equal(v, want[u.index, "exp_avg_sq"][a:b])
    for u in tier.units:  # what a checkpoint reads: the file, a block at most at a time
        for which in ("exp_avg", "exp_avg_sq"):
            pieces = list(tier.pieces(u, which, 100, u.numel - 64))
            assert max(p.numel() for p in pieces) <= disk.BLOCK_ELEMS
            assert torch.equal(torch.cat(pieces), want[u.index, which][100 : u.numel - 64])
    c = tier.counters
    assert c["disk_written_bytes"] == 2 * tier.nbytes and c["disk_read_bytes"] >= tier.nbytes
    tier.close()


def test_blocks_are_read_ahead_in_the_order_expected(tmp_path):
    """In the expected order no block is found unread (each was read while the one before was
    stepped); out of it, the ring reads what it misses and the values stay right."""
    state = tiny_state()
    tier = DiskTier(state, 3, tmp_path / "tier")
    want = fill_blocks(tier, 1)
    order = state.units[::-1]
    tier.expect(order)
    misses = tier.counters["disk_misses"]
    for _ in range(2):  # two passes: the second's first blocks are read ahead at the end of the first
        for u in order[:3]:
            for a, b in tier.blocks(u, 0, u.numel):
                with tier.staged(u, a, b) as (m, v):
                    assert torch.equal(m, want[u.index, "exp_avg"][a:b])
                    m.add_(1.0)
                    want[u.index, "exp_avg"][a:b] += 1.0
    assert tier.counters["disk_misses"] == misses
    fill_blocks(tier, 2)  # forward order, against the expected one
    assert tier.counters["disk_misses"] > misses
    tier.close()


@pytest.mark.parametrize(
    "clip, io, grads",
    [
        (1.0, "direct", "host"),
        (0.0, "buffered", "auto"),
        (1.0, "striped", "host"),
        (1.0, "direct", "two_pass"),
    ],
)
def test_a_run_with_a_disk_tier_trains_bitwise_as_in_memory_and_leaves_nothing(
    tmp_path, base, clip, io, grads, tiers, request
):
    """Gradients held for the clip (the pass in forward order), stepped as they land (last first)
    and the two-pass step's, through O_DIRECT where the file system takes it and through buffered
    I/O; striped over two folders (as its file system takes it)."""
    base = base | dict(max_grad_norm=clip, gradient_placement=grads)
    if io == "direct":
        dirs = [request.getfixturevalue("direct_dir")]
    elif io == "buffered":
        request.getfixturevalue("refuse_o_direct")
        dirs = [tmp_path / "nvme"]
    else:
        request.getfixturevalue("one_disk")
        dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    train(TrainConfig(**base, output_dir=str(tmp_path / "ram")))
    dirs[0].mkdir(parents=True, exist_ok=True)
    (dirs[0] / "notes.txt").write_text("the user's")  # offload_dir may hold the user's files
    max_host = host_budget(base, 2)
    folders = str(dirs[0]) if len(dirs) == 1 else [str(d) for d in dirs]
    train(
        TrainConfig(**base, output_dir=str(tmp_path / "disk"), offload_dir=folders, max_host_memory=max_host)
    )
    [tier] = tiers
    assert tier.directories == dirs and 1 <= len(tier.units) <= 2
    assert io == "striped" or tier.direct == (io == "direct")
    assert_same_arithmetic(tmp_path / "disk", tmp_path / "ram")
    assert planned(tmp_path / "disk")["grad_mode"] == PLACED.get(grads, "immediate")
    assert_bitwise(tensors(tmp_path / "disk" / "final"), tensors(tmp_path / "ram" / "final"))
    record = json.loads((tmp_path / "disk" / "plan.json").read_text())
    assert record["plan"]["disk_units"] == len(tier.units) and record["machine"]["disk_direct"] == tier.direct
    assert record["machine"]["disk_folders"] == len(dirs)
    [note] = [n for n in record["plan"]["notes"] if "disk tier" in n]
    assert (", O_DIRECT)" in note) == tier.direct and ("buffered" in note) == (not tier.direct)
    assert ("in offload_dir (2 folders, striped)" in note) == (io == "striped")
    measured = record["measured"]  # every block read ahead of the optimizer, each step's written back
    assert measured["disk_misses"] == 0 and measured["disk_written_bytes"] == 4 * tier.nbytes
    assert os.listdir(dirs[0]) == ["notes.txt"] and (dirs[0] / "notes.txt").read_text() == "the user's"
    assert all(os.listdir(d) == [] for d in dirs[1:])


@pytest.mark.parametrize("folders", [1, 2])
def test_a_resume_rebuilds_the_tier_from_its_checkpoint(tmp_path, base, tiers, folders, one_disk):
    """The checkpoint the tier's run writes holds the in-memory run's moments (read from the
    file, or the files it is striped over), and a resume writes them back through the ring."""
    ram = dict(output_dir=str(tmp_path / "ram"), save_strategy="steps", save_steps=2)
    train(TrainConfig(**(base | ram)))
    max_host = host_budget(base, 3)
    where = ",".join(str(tmp_path / f"nvme{i}") for i in range(folders))  # as on the command line
    kw = dict(offload_dir=where, max_host_memory=max_host, output_dir=str(tmp_path / "disk"))
    train(TrainConfig(**(base | kw | dict(max_steps=2, save_strategy="steps", save_steps=2))))
    assert_bitwise(tensors(tmp_path / "disk" / "checkpoint-2"), tensors(tmp_path / "ram" / "checkpoint-2"))
    train(TrainConfig(**(base | kw | dict(resume_from_checkpoint=True))))
    assert len(tiers) == 2 and len(tiers[1].units) >= 1 and len(tiers[1].files) == folders
    assert_bitwise(tensors(tmp_path / "disk" / "final"), tensors(tmp_path / "ram" / "final"))


@pytest.mark.parametrize(
    "optim",
    [
        dict(optim="adamw_8bit"),
        dict(optim="adamw_anyprecision", optim_args="momentum_dtype=bfloat16,variance_dtype=bfloat16"),
    ],
)
def test_a_tier_of_8bit_or_bf16_moments_trains_and_resumes_bitwise_as_in_memory(tmp_path, base, tiers, optim):
    """The tier holds a format's buffers (8-bit codes and absmax, bf16) block by block, each from
    a page: a run with it, its checkpoint (read from the file) and its resume (written back
    through the ring) are bitwise the in-memory run's."""
    base = base | optim
    ram = dict(output_dir=str(tmp_path / "ram"), save_strategy="steps", save_steps=2)
    train(TrainConfig(**(base | ram)))
    kw = dict(
        offload_dir=str(tmp_path / "nvme"),
        max_host_memory=host_budget(base, 2),
        output_dir=str(tmp_path / "disk"),
    )
    train(TrainConfig(**(base | kw | dict(max_steps=2, save_strategy="steps", save_steps=2))))
    [tier] = tiers
    fmt = TrainConfig(**base).moments()
    assert tier.moments == fmt and tier.nbytes == disk.tier_bytes([u.numel for u in tier.units], fmt)
    assert tier.nbytes < MOMENT_BYTES * sum(u.numel for u in tier.units)  # leaner than fp32's
    assert_bitwise(tensors(tmp_path / "disk" / "checkpoint-2"), tensors(tmp_path / "ram" / "checkpoint-2"))
    train(TrainConfig(**(base | kw | dict(resume_from_checkpoint=True))))
    assert len(tiers) == 2
    assert_bitwise(tensors(tmp_path / "disk" / "final"), tensors(tmp_path / "ram" / "final"))


@pytest.mark.slow
def test_a_kill_in_the_middle_of_the_tiers_io_leaves_the_last_checkpoint_to_resume(tmp_path, base):
    """SIGKILL in step 3, half of the tier stepped and its writes in flight: nothing is left in
    offload_dir, and checkpoint-2 resumes to the in-memory run's weights."""
    train(TrainConfig(**base, output_dir=str(tmp_path / "ram")))
    max_host = host_budget(base, 2)
    kw = dict(offload_dir=str(tmp_path / "nvme"), max_host_memory=max_host, output_dir=str(tmp_path / "disk"),
              save_strategy="steps", save_steps=1)  # fmt: skip
    code = (
        "import os, signal, sys; sys.path.insert(0, 'tests')\n"
        "from megatrain.host.disk import DiskTier\n"
        "from megatrain.config import TrainConfig\n"
        "from megatrain.trainer import train\n"
        "from megatrain.host import disk\n"
        "disk.BLOCK_ELEMS, disk.RING_SLOTS = 4096, 3  # as this module's runs\n"
        "real, seen = DiskTier._release, []\n"
        "def release(self, slot):\n"
        "    real(self, slot)\n"
        "    seen.append(1)\n"
        "    if len(seen) == 2 * len(self._blocks) + len(self._blocks) // 2:\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "DiskTier._release = release\n"
        f"train(TrainConfig(**{base | kw!r}))\n"
    )
    p = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert p.returncode == -signal.SIGKILL, p.stderr
    assert os.listdir(tmp_path / "nvme") == []
    assert sorted(x.name for x in (tmp_path / "disk").glob("checkpoint-*")) == [
        "checkpoint-1",
        "checkpoint-2",
    ]
    train(TrainConfig(**(base | kw | dict(resume_from_checkpoint=True, save_strategy="no"))))
    assert_bitwise(tensors(tmp_path / "disk" / "final"), tensors(tmp_path / "ram" / "final"))


def test_a_tier_the_disk_cannot_hold_is_refused_in_one_line(tmp_path, base):
    cfg = TrainConfig(**base, output_dir=str(tmp_path / "out"), offload_dir=str(tmp_path / "nvme"),
                      max_host_memory=host_budget(base, 2), max_disk_memory="1KB")  # fmt: skip
    with pytest.raises(MegatrainError) as e:
        train(cfg)
    msg = str(e.value)
    assert "disk tier" in msg and "offload_dir" in msg and "\n" not in msg


def test_no_space_when_the_tier_is_made_is_one_line_with_the_numbers(tmp_path, monkeypatch):
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tierfile.os, "posix_fallocate", full)
    state = tiny_state()
    with pytest.raises(DiskTierError) as e:
        DiskTier(state, 1, tmp_path / "tier")
    msg = str(e.value)
    assert str(tmp_path / "tier") in msg and "GiB free" in msg and "needs" in msg and "\n" not in msg
    assert os.listdir(tmp_path / "tier") == []
    assert state.tier is None and state.exp_avg.numel() == state.numel  # the state is as it was


def test_a_failed_write_behind_is_one_line_at_the_next_block(tmp_path, monkeypatch):
    state = tiny_state()
    tier = DiskTier(state, 2, tmp_path / "tier")
    u = tier.units[0]

    def full(fd, buffers, offset):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(tierfile.os, "pwritev", full)
    with tier.staged(u, 0, 4096):
        pass  # written behind: the error comes with the next wait on that block
    with pytest.raises(DiskTierError) as e:
        list(tier.pieces(u, "exp_avg", 0, 4096))
    msg = str(e.value)
    assert str(tmp_path / "tier") in msg and "GiB free" in msg and "needs" in msg and "\n" not in msg
    tier.close()


def test_striped_blocks_alternate_between_the_folders_files(tmp_path, one_disk):
    """Block i in folder i % 2, each file its blocks back to back and reserved to their size; the
    moments come back exactly from either file."""
    state = tiny_state()
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    tier = DiskTier(state, 3, dirs)
    assert [f for _, _, f, _ in tier._blocks] == [i % 2 for i in range(len(tier._blocks))]
    for f in (0, 1):
        mine = [(b - a, offset) for a, b, g, offset in tier._blocks if g == f]
        assert [offset for _, offset in mine] == [
            MOMENT_BYTES * sum(n for n, _ in mine[:i]) for i in range(len(mine))
        ]
        assert tier.file_bytes[f] == MOMENT_BYTES * sum(n for n, _ in mine)
        assert os.fstat(tier.files[f].fd).st_size == tier.file_bytes[f]
    assert sum(tier.file_bytes) == tier.nbytes and min(tier.file_bytes) > 0
    want = fill_blocks(tier, 4)
    for u in tier.units:
        got = torch.cat(list(tier.pieces(u, "exp_avg_sq", 0, u.numel)))
        assert torch.equal(got, want[u.index, "exp_avg_sq"])
    tier.close()
    assert os.listdir(dirs[0]) == os.listdir(dirs[1]) == []


def test_a_striped_tier_a_folder_cannot_hold_is_refused_naming_that_folder(tmp_path, monkeypatch, one_disk):
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    real = disk.free_bytes
    monkeypatch.setattr(disk, "free_bytes", lambda d: 0 if d == dirs[1] else real(d))
    state = tiny_state()
    with pytest.raises(DiskTierError) as e:
        DiskTier(state, 3, dirs)
    msg = str(e.value)
    assert msg.startswith(f"offload_dir: {dirs[1]}: the disk tier needs ") and "\n" not in msg
    assert "striped over 2 folders" in msg and "0.00 GiB free" in msg and str(dirs[0]) not in msg
    assert os.listdir(dirs[0]) == os.listdir(dirs[1]) == []
    assert state.tier is None and state.exp_avg.numel() == state.numel  # the state is as it was


def test_folders_on_one_file_system_are_refused_in_one_line(tmp_path):
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    state = tiny_state()
    with pytest.raises(DiskTierError) as e:
        DiskTier(state, 2, dirs)
    msg = str(e.value)
    assert msg.startswith(f"offload_dir: {dirs[0]} and {dirs[1]} are on one file system") and "\n" not in msg
    assert state.tier is None
    with pytest.raises(DiskTierError, match="on one file system"):
        disk.measure_drives(dirs, nbytes=2**20)


def test_the_machine_has_the_drives_rates_summed_and_n_times_the_least_room(
    tmp_path, base, monkeypatch, one_disk
):
    dirs = [tmp_path / "nvme0", tmp_path / "nvme1"]
    monkeypatch.setattr(
        disk, "measure_rates", lambda d, nbytes: disk.DiskRates(1e9, 2e9, 3e9, direct=Path(d) == dirs[0])
    )
    rates = disk.measure_drives(dirs)
    assert (rates.read_bytes_s, rates.write_bytes_s, rates.duplex_bytes_s, rates.direct) == (
        2e9,
        4e9,
        6e9,
        False,
    )
    free = {str(dirs[0]): 10 * 2**30, str(dirs[1]): 4 * 2**30}
    monkeypatch.setattr(planning, "free_bytes", lambda p: free[str(p)])
    cfg = TrainConfig(**base, offload_dir=[str(d) for d in dirs])
    m = planning.machine_of(cfg, "cpu")
    assert (m.disk_bytes, m.disk_folders, m.disk_read_bytes_s, m.disk_direct) == (8 * 2**30, 2, 2e9, False)
    capped = planning.machine_of(
        TrainConfig(**base, offload_dir=cfg.offload_dir, max_disk_memory="5GB"), "cpu"
    )
    assert capped.disk_bytes == 5 * 10**9  # max_disk_memory is the total over the folders


def test_offload_dir_takes_a_list_or_comma_separated_folders(tmp_path, base):
    from test_checkpoint import write_yaml

    from megatrain.errors import ConfigError

    settings = write_yaml(tmp_path / "run.yaml", base | dict(offload_dir=["/nvme0/t", "/nvme1/t"]))
    assert TrainConfig.load(settings).offload_dirs() == ["/nvme0/t", "/nvme1/t"]
    plain = write_yaml(tmp_path / "plain.yaml", base)
    assert TrainConfig.load(plain, ["offload_dir=/nvme0/t,/nvme1/t"]).offload_dirs() == [
        "/nvme0/t",
        "/nvme1/t",
    ]
    assert TrainConfig.load(plain, ["offload_dir=/nvme0/t"]).offload_dir == "/nvme0/t"  # one folder as before
    for bad in ("/nvme0/t,,/nvme1/t", "/nvme0/t,/nvme0/t/", "[/nvme0/t, 3]", "[]"):
        with pytest.raises(ConfigError) as e:
            TrainConfig.load(plain, [f"offload_dir={bad}"])
        assert str(e.value).startswith("offload_dir") and "\n" not in str(e.value), bad


def test_offload_dir_needs_one_process_and_max_disk_memory_needs_offload_dir(base, tmp_path):
    from megatrain.errors import ConfigError

    with pytest.raises(ConfigError, match="offload_dir"):
        TrainConfig(**base, offload_dir=str(tmp_path), nproc_per_node=2)
    with pytest.raises(ConfigError, match="max_disk_memory: needs offload_dir"):
        TrainConfig(**base, max_disk_memory="10GB")


@pytest.mark.parametrize("folders", [1, 2])
def test_megatrain_plan_shows_the_tier_and_its_staging(tmp_path, base, capsys, folders, one_disk):
    from test_checkpoint import write_yaml
    from test_cli import run_cli

    where = [str(tmp_path / f"nvme{i}") for i in range(folders)]
    settings = base | dict(offload_dir=where, max_host_memory=host_budget(base, 3))
    rc, out, _ = run_cli(capsys, "plan", write_yaml(tmp_path / "run.yaml", settings))
    assert rc == 0, out
    line = next(x for x in out.splitlines() if "disk tier:" in x)
    assert "AdamW moments of the last" in line and "offload_dir" in line
    assert ("offload_dir (2 folders, striped)" in line) == (folders == 2)
    assert "read at" in line and "written at" in line and "both at once" in line and "GB/s" in line
    staging = next(x for x in out.splitlines() if "disk tier staging" in x)
    assert staging.split()[-1] in ("KiB", "MiB", "GiB")


def test_the_disks_rates_are_measured_where_the_tier_goes(tmp_path, direct_dir):
    rates = disk.measure_rates(direct_dir, nbytes=16 * 2**20)
    assert all(1e6 < r < 1e12 for r in (rates.read_bytes_s, rates.write_bytes_s, rates.duplex_bytes_s))
    assert rates.direct
    assert os.listdir(direct_dir) == []


def test_where_o_direct_is_refused_the_tier_is_buffered_and_says_so(tmp_path, refuse_o_direct):
    assert not disk.measure_rates(tmp_path / "nvme", nbytes=4 * 2**20).direct
    state = tiny_state()
    tier = DiskTier(state, 2, tmp_path / "nvme")
    assert not tier.direct
    want = fill_blocks(tier, 3)
    u = tier.units[-1]
    assert torch.equal(torch.cat(list(tier.pieces(u, "exp_avg_sq", 0, u.numel))), want[u.index, "exp_avg_sq"])
    tier.close()
    assert os.listdir(tmp_path / "nvme") == []


def test_a_small_tiers_blocks_are_smaller_so_that_its_ring_frees_memory(monkeypatch):
    """Blocks of BLOCK_ELEMS where the tier is large (64 MiB requests), fewer elements where six of
    them would take more than a quarter of what the tier frees."""
    monkeypatch.setattr(disk, "BLOCK_ELEMS", 8 * 2**20)
    monkeypatch.setattr(disk, "RING_SLOTS", 6)
    large = [100_000 * 1024] * 3
    assert disk.block_elems(large) == 8 * 2**20 and disk.ring_bytes(large) == 6 * 64 * 2**20
    small = [34816, 7168]
    block = disk.block_elems(small)
    assert block < 34816 and block % 1024 == 0
    assert disk.ring_bytes(small) <= MOMENT_BYTES * sum(small) / 3


def test_the_step_time_counts_the_tiers_io_beyond_the_adamw_it_overlaps():
    """Pass over the tier = max(AdamW, read + write): a fast disk costs nothing, a slow one its I/O
    less the AdamW it hides behind."""
    from helpers import tiny_config

    from megatrain.planning import footprint, placement
    from megatrain.planning.planspec import Batch, Machine, model_shape
    from megatrain.planning.probe import formula_layer_memory

    cfg = ModelConfig.from_hf(tiny_config("llama"))
    batch = Batch(micro_batch_tokens=256, micro_batches=1, seq_len=256, compute_bytes=4, clip=True)
    s = model_shape(cfg, formula_layer_memory(cfg, 4))
    adam = 1e8
    for device in ("cpu", "cuda"):
        m = Machine(device, gpu_bytes=80 * 2**30, adam_params_s=adam, disk_bytes=2**40)
        p = placement.plan(cfg, batch, m)
        none = footprint.evaluate(s, batch, p, m).step_time_s
        tiered = replace(p, disk_units=2)
        fast = replace(m, disk_read_bytes_s=1e15, disk_write_bytes_s=1e15)
        fast = replace(fast, disk_duplex_bytes_s=1e15)
        assert footprint.evaluate(s, batch, tiered, fast).step_time_s == pytest.approx(none)
        # Reads bind where the drive serves both ways at once; both together where it serves them in turn.
        for duplex, io in ((1e9, lambda d: d / 1e6), (1e6, lambda d: 2 * d / 1e6)):
            slow = replace(m, disk_read_bytes_s=1e6, disk_write_bytes_s=2e6, disk_duplex_bytes_s=duplex)
            t = footprint.evaluate(s, batch, tiered, slow)
            assert t.step_time_s > none
            if device == "cpu":  # the optimizer's pass is on the step's path: all of the wait shows
                assert t.step_time_s - none == pytest.approx(io(t.disk) - t.disk / MOMENT_BYTES / adam)
        assert "disk tier staging (host buffers)" in t.host


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
@pytest.mark.parametrize("grads", ["host", "two_pass"])
def test_on_cuda_a_tier_trains_bitwise_as_in_memory(tmp_path, base, tiers, grads):
    """The GPU's schedule (page-locked master weights, the CPU AdamW overlapping the sweeps on its
    worker thread) with the moments of the last units in the tier: the same weights as without,
    for gradients held in host memory for the clip and for the two-pass step. The placement is
    pinned, so that the test checks the tier alone: on a GPU the least host memory that holds the
    run in memory is the two-pass step's, so which step a tier's budget leaves depends on the
    host, and the two steps through `train` on CUDA are compared by test_placement.py."""
    base = base | dict(device="cuda", compute_dtype="float32", gpu_state="off", gradient_placement=grads)
    train(TrainConfig(**base, output_dir=str(tmp_path / "ram")))
    max_host = host_budget(base, 2, "cuda")
    train(TrainConfig(**base, output_dir=str(tmp_path / "disk"), offload_dir=str(tmp_path / "nvme"),
                      max_host_memory=max_host))  # fmt: skip
    assert planned(tmp_path / "disk")["disk_units"] >= 1
    assert_same_arithmetic(tmp_path / "disk", tmp_path / "ram")
    assert planned(tmp_path / "disk")["grad_mode"] == PLACED[grads]
    assert tiers and tiers[0].counters["disk_misses"] == 0
    assert_bitwise(tensors(tmp_path / "disk" / "final"), tensors(tmp_path / "ram" / "final"))


def test_a_killed_process_leaves_no_tier_file(tmp_path):
    """SIGKILL while the tier holds moments and writes them: its file never had a name in
    offload_dir, so nothing is left there (the kernel frees its blocks with the process)."""
    code = (
        "import sys, time; sys.path.insert(0, 'tests')\n"
        "from helpers import tiny_config\n"
        "from megatrain.host.disk import DiskTier\n"
        "from megatrain.host.state import HostState, build_units\n"
        "from megatrain.models.config import ModelConfig\n"
        "s = HostState(build_units(ModelConfig.from_hf(tiny_config('llama'))))\n"
        f"t = DiskTier(s, 2, {str(tmp_path / 'nvme')!r}); u = t.units[0]\n"
        "with t.staged(u, *t.blocks(u, 0, u.numel)[0]) as (m, v): m.fill_(1.0)\n"
        "print('ready', flush=True); time.sleep(60)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGKILL)
    p.wait(timeout=30)
    assert os.listdir(tmp_path / "nvme") == []


def _tiered_host(device: str, choices):
    """A ~1.3B Llama, its batch, and a machine on `device` whose host holds all but the moments
    (as little as the plan with every unit's moments on disk needs): the plan's inputs."""
    import math

    from transformers import LlamaConfig

    from megatrain.planning import footprint, placement
    from megatrain.planning.planspec import Batch, Machine, model_shape
    from megatrain.planning.probe import formula_layer_memory

    shape = dict(hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=16)
    cfg = ModelConfig.from_hf(LlamaConfig(**shape, num_hidden_layers=24, vocab_size=32000))
    batch = Batch(micro_batch_tokens=256, micro_batches=1, seq_len=256, compute_bytes=4, clip=True)
    s = model_shape(cfg, formula_layer_memory(cfg, 4))
    m = Machine(device, gpu_bytes=80 * 2**30, disk_bytes=2**42)
    # without state on the GPU the tier may take every unit
    bare = placement.plan(cfg, batch, m, replace(choices, gpu_state="off"))
    whole = footprint.evaluate(s, batch, replace(bare, disk_units=len(s.units)), m)
    assert whole.disk > 20 * disk.ring_bytes(s.units)  # its reserve share would outweigh its ring
    host = math.ceil(whole.host_total / (1 - footprint.HOST_RESERVE))
    return cfg, batch, replace(m, host_bytes=host), whole


def test_a_host_that_holds_all_but_the_moments_takes_them_all_on_disk():
    """The moments on disk free all their bytes of host memory: the host's reserve is a share of
    its own memory, not of the tier (counted at 95%, a 122B tier lost 45 GiB of a 512 GiB host)."""
    from megatrain.planning import footprint, placement

    two_pass = placement.Choices(gradient_placement="two_pass")
    cfg, batch, m, whole = _tiered_host("cpu", two_pass)
    p = placement.plan(cfg, batch, m, two_pass)
    assert p.disk_units == whole.disk_units
    assert p.host_total == whole.host_total <= footprint.usable_host(m)
    with pytest.raises(placement.PlanError, match="with the disk tier"):
        placement.plan(cfg, batch, replace(m, host_bytes=m.host_bytes - 2**20), two_pass)


def test_gpu_state_auto_keeps_the_gpus_state_off_the_tiers_units():
    """`gpu_state: auto` spends free GPU memory on resident units, whose moments must stay
    page-locked: where the tier needs every unit, the plan holds no state on the GPU instead of
    refusing the run."""
    from megatrain.planning import placement

    auto = placement.Choices(gradient_placement="two_pass")
    cfg, batch, m, whole = _tiered_host("cuda", auto)
    roomy = placement.plan(cfg, batch, replace(m, host_bytes=None), auto)
    assert roomy.resident_units > 0  # with host memory to spare, auto holds state on the GPU
    p = placement.plan(cfg, batch, m, auto)
    assert p.disk_units == whole.disk_units and p.resident_units + p.gpu_stepped_units == 0
    assert any("the disk tier takes the units" in note for note in p.notes)


def test_a_disk_smaller_than_all_the_moments_still_takes_the_units_it_holds():
    """The tier takes the fewest last units that make the run fit; a disk that cannot hold every
    unit's moments (a 24B model's 179 GiB on a 128 GiB drive) may still hold enough of them. Such
    a run was refused once, the search starting from the tier of every unit; it is refused only
    where the most units the disk holds leave too much for host memory, and says so in one line."""
    from megatrain.planning import footprint, placement
    from megatrain.planning.planspec import model_shape
    from megatrain.planning.probe import formula_layer_memory

    two_pass = placement.Choices(gradient_placement="two_pass")
    cfg, batch, m, whole = _tiered_host("cpu", two_pass)
    s = model_shape(cfg, formula_layer_memory(cfg, 4))
    n = len(s.units)
    host = math.ceil(footprint.evaluate(s, batch, replace(whole, disk_units=n // 2), m).host_total
                     / (1 - footprint.HOST_RESERVE))  # fmt: skip
    half = footprint.disk_tier_bytes(s, n // 2, m.world, FP32)
    small = replace(m, host_bytes=host, disk_bytes=half)  # holds the last half's moments, not all
    assert footprint.disk_tier_bytes(s, n, m.world, FP32) > small.disk_bytes
    p = placement.plan(cfg, batch, small, two_pass)
    assert p.disk_units == n // 2 and p.host_total <= footprint.usable_host(small)
    with pytest.raises(placement.PlanError, match=f"the last {n // 2} of {n} units'") as e:
        placement.plan(cfg, batch, replace(small, host_bytes=host - 2**20), two_pass)
    assert "\n" not in str(e.value)
