"""Data parallel training over torch.distributed: the one place that knows about other ranks.

Every rank runs the same engine on its share of each optimizer step's micro-batches. The engine
and the trainer talk to the other ranks only through a `Collective`:

* the step's label tokens are counted over all ranks before the backward sweep, so every rank's
  loss is normalised by the step's total (the loss of one process with the same global batch);
* each unit's gradient is summed over all ranks (all-reduce) as soon as the backward sweep has
  it, before its norm is taken: the clip norm is the global one, bit for bit the same on every
  rank, and every rank takes the same decisions (clip, skip a non-finite step, stop on signal);
* the fp32 master weights and AdamW moments exist once per machine, in shared host memory
  (hostmem.shared_buffer); each rank applies AdamW to its own slice of every unit (`span`) and
  a unit's update is complete when every rank has applied its slice (`updated`, a barrier per
  unit met by the ranks' optimizer threads): a fetch waits for that unit alone, so the next
  forward sweep overlaps the optimizer as it does in one process.

`Single` is the world of one process: every method is the identity, so a one-process run is
unchanged. `ProcessGroup` is a torch.distributed process group: NCCL between GPUs, gloo on the
CPU. A world is started by torchrun (or `megatrain train ... nproc_per_node=N`, launch.py),
which sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE.

Multi-machine training keeps this interface: the machines' shared states would each hold a
partition of the units (`span` then names whole units) and fetches of another machine's units
would arrive by broadcast; that mode is not implemented.
"""

from __future__ import annotations

import datetime
import os
import shutil
import uuid
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Protocol, TypeVar

import torch

from .errors import ConfigError
from .hostmem import PAGE, shared_buffer
from .state import HostState, Unit

SHM_DIR = Path("/dev/shm")
T = TypeVar("T")


class Collective(Protocol):
    """What a training process needs from the other ranks of its world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int

    @property
    def is_main(self) -> bool:
        """This rank writes the outputs (metrics, checkpoints, final/) and shows progress."""

    @property
    def holds_state(self) -> bool:
        """This rank fills the machine's host state (weights, restored moments)."""

    def sum_count(self, n: int) -> int:
        """`n` summed over all ranks."""

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over all ranks, in place; returns it."""

    def reduce_then(
        self, unit: Unit, grad: torch.Tensor, finish: Callable[[Unit, torch.Tensor], None]
    ) -> None:
        """Sum `grad` over all ranks and then call `finish(unit, grad)`; finishes may be
        deferred (the reduction overlapping the next unit's compute) until `flush`, in order."""

    def flush(self) -> None:
        """Complete every deferred `reduce_then`."""

    def any(self, flag: bool) -> bool:
        """Whether `flag` is true on some rank (signals: every rank stops at the same step)."""

    def first(self, obj: T) -> T:
        """Rank 0's `obj` (picklable) on every rank: one decision for all, such as the plan."""

    def span(self, unit: Unit) -> tuple[int, int]:
        """The elements [lo, hi) of `unit` this rank applies AdamW to."""

    def barrier(self) -> None: ...

    def updated(self, unit: Unit) -> None:
        """This rank has applied its part of `unit`'s update; returns once every rank has (the
        units in the same order on every rank, from one thread: the optimizer's)."""

    def host_state(self, units: list[Unit]) -> HostState:
        """The machine's host state: shared by its ranks, allocated once."""

    def close(self) -> None: ...


class Single:
    """The world of one process."""

    rank, world_size, local_rank, local_world_size = 0, 1, 0, 1
    is_main = holds_state = True

    def sum_count(self, n: int) -> int:
        return n

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def reduce_then(self, unit, grad, finish) -> None:
        finish(unit, grad)

    def flush(self) -> None:
        pass

    def any(self, flag: bool) -> bool:
        return flag

    def first(self, obj: T) -> T:
        return obj

    def span(self, unit: Unit) -> tuple[int, int]:
        return 0, unit.numel

    def barrier(self) -> None:
        pass

    def updated(self, unit: Unit) -> None:
        pass

    def host_state(self, units: list[Unit]) -> HostState:
        return HostState(units)

    def close(self) -> None:
        pass


def slices(numel: int, parts: int, align: int = PAGE // 4) -> list[tuple[int, int]]:
    """[0, numel) cut into `parts` consecutive ranges as equal as `align` allows (each starts on
    a page, so ranks never write the same page of the shared state)."""
    step = -(-numel // (parts * align)) * align
    return [(min(r * step, numel), min((r + 1) * step, numel)) for r in range(parts)]


class ProcessGroup:
    """A torch.distributed world (see the module docstring). Collectives time out after
    `timeout_s`, so a rank that dies or hangs stops the others with an error, not a hang."""

    def __init__(self, device: torch.device, timeout_s: float):
        import torch.distributed as dist

        self.dist = dist
        env = os.environ
        self.rank, self.world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        self.local_rank = int(env.get("LOCAL_RANK", self.rank))
        self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", self.world_size))
        if self.local_world_size != self.world_size:
            raise ConfigError(
                f"WORLD_SIZE {self.world_size} over several machines (LOCAL_WORLD_SIZE {self.local_world_size}): "
                "multi-machine training is not supported yet"
            )
        self.device = device
        if device.type == "cuda":
            if not dist.is_nccl_available():
                raise ConfigError("device: cuda with several processes needs NCCL, which this PyTorch lacks")
            backend = "nccl"
        else:
            backend = "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, timeout=timeout, **kw)
        # Barriers and flags go through gloo on the CPU: no device sync, the same timeout.
        self.cpu = dist.new_group(backend="gloo", timeout=timeout) if backend != "gloo" else None
        self.updates = dist.new_group(backend="gloo", timeout=timeout)
        self._pending: deque = deque()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def holds_state(self) -> bool:
        return self.local_rank == 0

    def sum_count(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64)
        self.dist.all_reduce(t, group=self.cpu)
        return int(t)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        self.dist.all_reduce(t)
        return t

    def reduce_then(self, unit, grad, finish) -> None:
        # Asynchronous: the next unit's recompute overlaps this reduction; one unit's gradient
        # waits at a time.
        work = self.dist.all_reduce(grad, async_op=True)
        self.flush()
        self._pending.append((work, unit, grad, finish))

    def flush(self) -> None:
        while self._pending:
            work, unit, grad, finish = self._pending.popleft()
            work.wait()
            finish(unit, grad)

    def any(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.cpu)
        return bool(t)

    def first(self, obj: T) -> T:
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.cpu)
        return box[0]

    def span(self, unit: Unit) -> tuple[int, int]:
        return slices(unit.numel, self.world_size)[self.rank]

    def barrier(self) -> None:
        self.dist.barrier(group=self.cpu)

    def updated(self, unit: Unit) -> None:
        # A group of its own: the optimizer's thread meets the other ranks' optimizer threads
        # while the main threads go on with the next forward sweep and their own collectives.
        self.dist.barrier(group=self.updates)

    def host_state(self, units: list[Unit]) -> HostState:
        """Local rank 0 creates the three buffers as files in /dev/shm, the other ranks map
        them, and once all have, they are unlinked: the memory lives while a rank maps it and
        nothing is left behind, whatever happens later."""
        numel = units[-1].start + units[-1].numel
        need = 3 * numel * 4
        free = shutil.disk_usage(SHM_DIR).free if SHM_DIR.is_dir() else 0
        if need > free:
            raise ConfigError(
                f"{SHM_DIR}: the shared host state needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free "
                "(in a container: docker run --shm-size)"
            )
        names = [None]
        if self.holds_state:
            names = [f"megatrain-{uuid.uuid4().hex[:12]}"]
        self.dist.broadcast_object_list(names, src=0, group=self.cpu)
        paths = [SHM_DIR / f"{names[0]}-{kind}" for kind in ("master", "exp_avg", "exp_avg_sq")]
        files = iter(paths)

        def alloc(n: int) -> torch.Tensor:
            return shared_buffer(next(files), n, create=self.holds_state)

        state = HostState(units, alloc=alloc) if self.holds_state else None
        self.barrier()
        if state is None:
            state = HostState(units, alloc=alloc)
        self.barrier()
        if self.holds_state:
            for p in paths:
                p.unlink(missing_ok=True)
        return state

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def in_world() -> bool:
    """Started by torchrun (or launch.py) with more than one process."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def check_devices(device: torch.device, nproc: int) -> None:
    """Refuse a world of `nproc` processes per machine that `device` cannot give a GPU each."""
    if device.type != "cuda":
        return
    if device.index is not None:
        raise ConfigError(f"device: {device} names one GPU; with several processes each uses cuda:LOCAL_RANK")
    if nproc > torch.cuda.device_count():
        raise ConfigError(
            f"nproc_per_node: {nproc} processes, but this machine has {torch.cuda.device_count()} GPUs"
        )


def world_device(device: torch.device) -> torch.device:
    """Each rank's GPU: cuda:LOCAL_RANK."""
    check_devices(device, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    if device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def start(device: torch.device, timeout_s: float) -> tuple[Collective, torch.device]:
    """The collective of this process and its device: `Single` outside a world."""
    if not in_world():
        return Single(), device
    device = world_device(device)
    return ProcessGroup(device, timeout_s), device
