"""The collectives of a world of processes (distributed.py's `Collective`) over
torch.distributed: NCCL between GPUs, gloo on the CPU. Collectives time out after `timeout_s`,
so a rank that dies or hangs stops the others with an error, not a hang.

`ProcessGroup` is the plain design: gradients all-reduced, whole units copied to every device,
one host state per machine of which each rank steps its span; a unit's update is complete when
every rank has applied its span (`updated`, a barrier per unit met by the ranks' optimizer
threads), so a fetch waits for that unit alone and the next forward sweep overlaps the optimizer.

`ShardedGroup` is the sharded design (layout.py): a rank copies only its span of a unit to its
device and the ranks all-gather the rest there; gradients are reduce-scattered, so a rank
receives only its span, which it copies to host memory and steps. A rank then reads from host
memory only what it wrote itself, so no barrier per unit is needed. Where the backend has no
reduce-scatter (gloo, in some versions) it is an all-reduce and a slice: the same sums. Across
machines the host state is partitioned: each machine holds its ranks' spans only.

`start` gives a process its collective: one of these in a world, `Single` outside one.
"""

from __future__ import annotations

import datetime
import os
import shutil
import uuid
from collections import deque
from pathlib import Path

import torch

from ..devices import in_world
from ..errors import ConfigError
from ..host.hostmem import shared_buffer
from ..host.moments import FP32, Moments
from ..host.state import MASTER, MASTER_BYTES, HostState, Unit
from .distributed import Collective, Cuts, Single, T, param_norms, world_device, world_layout
from .layout import Layout, piece_len

SHM_DIR = Path("/dev/shm")


class ProcessGroup(Cuts):
    """A torch.distributed world in the plain design (module docstring)."""

    def __init__(self, device: torch.device, timeout_s: float, layout: Layout | None = None):
        import torch.distributed as dist

        self.dist = dist
        env = os.environ
        self.rank, self.world_size = int(env["RANK"]), int(env["WORLD_SIZE"])
        self.local_rank = int(env.get("LOCAL_RANK", self.rank))
        self.local_world_size = int(env.get("LOCAL_WORLD_SIZE", self.world_size))
        self.layout = layout or world_layout()
        self.machine = self.layout.machine_of(self.rank)
        self.device = device
        if device.type == "cuda":
            if not dist.is_nccl_available():
                raise ConfigError("device: cuda with several processes needs NCCL, which this PyTorch lacks")
            self.backend = "nccl"
        else:
            self.backend = "gloo"
        timeout = datetime.timedelta(seconds=timeout_s)
        kw = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(self.backend, timeout=timeout, **kw)
        if device.type == "cuda":
            # NCCL may set up its buffers at the first collective: make it happen before the plan
            # measures the GPU's free memory, so that the plan leaves them room (an 18.7B run on two
            # H200s ran out of memory with 1.9 GiB outside PyTorch's allocator, CUDA's context included).
            dist.all_reduce(torch.zeros(1, device=device))
            torch.cuda.synchronize(device)
        # Barriers and flags go through gloo on the CPU: no device sync, the same timeout.
        self.cpu = dist.new_group(backend="gloo", timeout=timeout) if self.backend != "gloo" else None
        self.updates = dist.new_group(backend="gloo", timeout=timeout)
        self._pending: deque = deque()

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def holds_state(self) -> bool:
        return self.rank % self.layout.ranks_per_machine == 0

    def sum_count(self, n: int) -> int:
        t = torch.tensor([n], dtype=torch.int64)
        self.dist.all_reduce(t, group=self.cpu)
        return int(t)

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        self.dist.all_reduce(t)
        return t

    def gather_(self, unit: Unit, buf: torch.Tensor) -> None:
        pass  # every rank copies the whole unit

    def _reduce(self, unit: Unit, grad: torch.Tensor):
        """Start reducing `grad`: the work and a function giving this rank's piece once done."""
        return self.dist.all_reduce(grad, async_op=True), lambda: grad

    def reduce(self, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
        work, piece = self._reduce(unit, grad)
        work.wait()
        return piece()

    def reduce_then(self, unit, grad, finish) -> None:
        # Asynchronous: the next unit's recompute overlaps this reduction; one unit's gradient
        # waits at a time.
        work, piece = self._reduce(unit, grad)
        self.flush()
        self._pending.append((work, unit, grad, piece, finish))

    def flush(self) -> None:
        while self._pending:
            work, unit, _, piece, finish = self._pending.popleft()
            work.wait()
            finish(unit, piece())

    def norms(self, unit: Unit, grad: torch.Tensor) -> list[torch.Tensor]:
        return param_norms(unit, grad)

    def any(self, flag: bool) -> bool:
        t = torch.tensor([int(flag)], dtype=torch.int64)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX, group=self.cpu)
        return bool(t)

    def first(self, obj: T) -> T:
        box = [obj]
        self.dist.broadcast_object_list(box, src=0, group=self.cpu)
        return box[0]

    def each(self, obj: T) -> list[T]:
        out: list = [None] * self.world_size
        self.dist.all_gather_object(out, obj, group=self.cpu)
        return out

    def barrier(self) -> None:
        self.dist.barrier(group=self.cpu)

    def updated(self, unit: Unit) -> None:
        # A group of its own: the optimizer's thread meets the other ranks' optimizer threads
        # while the main threads go on with the next forward sweep and their own collectives.
        self.dist.barrier(group=self.updates)

    def host_state(self, units: list[Unit], moments: Moments = FP32) -> HostState:
        """The first rank of each machine creates the buffers of its machine's state (the master
        weights' halves, `moments.fields`) as files in /dev/shm, the machine's other ranks map
        them, and once all have, they are unlinked: the memory lives while a rank maps it and
        nothing is left behind, whatever happens later."""
        parts = [self.layout.part(u.numel, self.machine) for u in units]
        held = sum(hi - lo for lo, hi in parts)
        need = MASTER_BYTES * held + moments.nbytes(held)
        free = shutil.disk_usage(SHM_DIR).free if SHM_DIR.is_dir() else 0
        if need > free:
            raise ConfigError(
                f"{SHM_DIR}: the shared host state needs {need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free "
                "(in a container: docker run --shm-size)"
            )
        names = self.each(f"megatrain-{uuid.uuid4().hex[:12]}" if self.holds_state else None)
        name = names[self.machine * self.layout.ranks_per_machine]
        paths = [SHM_DIR / f"{name}-{kind}" for kind in (*MASTER, *(f.name for f in moments.fields))]
        files = iter(paths)

        def alloc(n: int, dtype: torch.dtype) -> torch.Tensor:
            return shared_buffer(next(files), n, create=self.holds_state, dtype=dtype)

        state = HostState(units, alloc=alloc, parts=parts, moments=moments) if self.holds_state else None
        self.barrier()
        if state is None:
            state = HostState(units, alloc=alloc, parts=parts, moments=moments)
        self.barrier()
        if self.holds_state:
            for p in paths:
                p.unlink(missing_ok=True)
        return state

    def close(self) -> None:
        if self.dist.is_initialized():
            self.dist.destroy_process_group()


def _collective(dist, name: str, older: str):
    """torch.distributed's function `name`, or its `older` name in the PyTorch versions before it."""
    return getattr(dist, name, None) or getattr(dist, older)


class ShardedGroup(ProcessGroup):
    """A torch.distributed world in the sharded design (module docstring)."""

    def gather_(self, unit: Unit, buf: torch.Tensor) -> None:
        step = piece_len(unit.numel, self.world_size)
        mine = buf[self.rank * step : (self.rank + 1) * step]  # in place: NCCL and gloo allow it
        gather = _collective(self.dist, "all_gather_single", "all_gather_into_tensor")
        # On NCCL the wait makes the current stream (the copy stream) wait, not this thread.
        gather(buf, mine, async_op=True).wait()

    def _reduce(self, unit: Unit, grad: torch.Tensor):
        step = piece_len(unit.numel, self.world_size)
        if grad.numel() != step * self.world_size:
            raise ValueError(
                f"{unit.name}: gradient of {grad.numel()} elements, expected {step * self.world_size}"
            )
        if self.backend == "nccl":
            out = torch.empty(step, dtype=grad.dtype, device=grad.device)
            scatter = _collective(self.dist, "reduce_scatter_single", "reduce_scatter_tensor")
            return scatter(out, grad, async_op=True), lambda: out
        # gloo: an all-reduce and this rank's slice of it (a copy, so the whole buffer is freed).
        mine = slice(self.rank * step, (self.rank + 1) * step)
        return self.dist.all_reduce(grad, async_op=True), lambda: grad[mine].clone()

    def norms(self, unit: Unit, grad: torch.Tensor) -> list[torch.Tensor]:
        # The squares of the ranks' pieces' norms summed: the norm of the whole (the padding is 0).
        sq = torch.linalg.vector_norm(grad).square().reshape(1)
        self.dist.all_reduce(sq)
        return [sq.sqrt().reshape(())]

    def updated(self, unit: Unit) -> None:
        pass  # a rank fetches only the span it stepped itself


def start(
    device: torch.device, timeout_s: float, traffic: str = "auto", nnodes: int | None = None
) -> tuple[Collective, torch.device]:
    """The collective of this process and its device: `Single` outside a world. `traffic` and
    `nnodes` are the ddp_traffic and nnodes keys (layout.py)."""
    if not in_world():
        if (nnodes or 1) > 1:
            raise ConfigError(
                f"nnodes: {nnodes} machines need several processes: start them with `megatrain train` "
                "(nnodes x nproc_per_node of them on this machine) or torchrun"
            )
        return Single(), device
    layout = world_layout(traffic, nnodes)
    device = world_device(device)
    group = ShardedGroup if layout.sharded else ProcessGroup
    return group(device, timeout_s, layout), device
