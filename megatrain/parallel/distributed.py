"""Data parallel training over torch.distributed: what a training process needs from the other
ranks of its world (the `Collective` protocol), the world of one process (`Single`), and the
world torchrun started (its layout, each rank's device). The engine, transports and trainer
talk to other ranks only through it:

* the step's label tokens are counted over all ranks before the backward sweep, so every rank's
  loss is normalised by the step's total (the loss of one process with the same global batch);
* each unit's gradient is reduced over all ranks as soon as the backward sweep has it, before
  its norm is taken: the clip norm is the global one, the same on every rank, and every rank
  takes the same decisions (clip, skip a non-finite step, stop on signal);
* the fp32 master weights and AdamW moments live in host memory shared by a machine's ranks
  (hostmem.shared_buffer); each rank applies AdamW to its own span of every unit.

How units are cut between ranks and machines, and the two designs (plain: whole units copied
and gradients all-reduced; sharded: spans copied and all-gathered on the device, gradients
reduce-scattered, the state partitioned when the world spans machines), is layout.py's. The
process groups themselves (NCCL between GPUs, gloo on the CPU) are processgroup.py's, and so is
`start`, which gives a process its collective.

A world is started by torchrun (or `megatrain train ... nproc_per_node=N`, launch.py), which
sets RANK, WORLD_SIZE, LOCAL_RANK and LOCAL_WORLD_SIZE.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Protocol, TypeVar

import torch

from ..devices import check_devices
from ..errors import ConfigError
from ..host.moments import FP32, Moments
from ..host.state import HostState, Unit, unit_views
from .layout import Layout, resolve

T = TypeVar("T")


class Collective(Protocol):
    """What a training process needs from the other ranks of its world."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    layout: Layout
    """How units are cut between the ranks and machines (layout.py)."""

    @property
    def is_main(self) -> bool:
        """This rank writes the outputs (metrics, checkpoints, final/) and shows progress."""

    @property
    def holds_state(self) -> bool:
        """This rank fills its machine's host state (weights, restored moments) and writes its
        part of a partitioned checkpoint."""

    def sum_count(self, n: int) -> int:
        """`n` summed over all ranks."""

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        """`t` summed over all ranks, in place; returns it."""

    def span(self, unit: Unit) -> tuple[int, int]:
        """The elements [lo, hi) of `unit` this rank applies AdamW to."""

    def piece(self, unit: Unit) -> tuple[int, int]:
        """The elements of `unit` this rank copies to its device and receives as gradient: the
        whole unit (plain) or its span (sharded)."""

    def padded(self, unit: Unit) -> int:
        """Length of the unit's device buffers: gathered weights, gradients to reduce."""

    def gather_(self, unit: Unit, buf: torch.Tensor) -> None:
        """`buf` (`padded(unit)` long) holds this rank's piece in its place; fill in the other
        ranks' pieces. Called for the units in the same order on every rank."""

    def reduce(self, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
        """`grad` (`padded(unit)` long) summed over all ranks: this rank's piece of the sum."""

    def reduce_then(
        self, unit: Unit, grad: torch.Tensor, finish: Callable[[Unit, torch.Tensor], None]
    ) -> None:
        """`reduce`, then `finish(unit, piece)`; finishes may be deferred (the reduction
        overlapping the next unit's compute) until `flush`, in order."""

    def flush(self) -> None:
        """Complete every deferred `reduce_then`."""

    def norms(self, unit: Unit, grad: torch.Tensor) -> list[torch.Tensor]:
        """Norms whose L2 norm is that of the unit's whole reduced gradient, of which `grad` is
        this rank's piece; the same on every rank."""

    def any(self, flag: bool) -> bool:
        """Whether `flag` is true on some rank (signals: every rank stops at the same step)."""

    def first(self, obj: T) -> T:
        """Rank 0's `obj` (picklable) on every rank: one decision for all, such as the plan."""

    def each(self, obj: T) -> list[T]:
        """Every rank's `obj` (picklable), in rank order, on every rank."""

    def barrier(self) -> None: ...

    def updated(self, unit: Unit) -> None:
        """This rank has applied its part of `unit`'s update; returns once the weights a fetch of
        `unit` reads are current (the units in the same order on every rank, from one thread:
        the optimizer's)."""

    def host_state(self, units: list[Unit], moments: Moments = FP32) -> HostState:
        """The machine's host state (its part of it, when partitioned), its moments stored as
        `moments` says: shared by its ranks, allocated once."""

    def close(self) -> None: ...


def param_norms(unit: Unit, grad: torch.Tensor) -> list[torch.Tensor]:
    """Per-parameter norms of a unit's whole gradient (`Collective.norms` where every rank has
    the whole gradient), taken on the compute stream while the buffer is hot."""
    views = unit_views(grad, unit)
    return torch._foreach_norm([views[p.name] for p in unit.params])


class Cuts:
    """`span`, `piece` and `padded` of a collective, from its layout and rank."""

    rank: int
    layout: Layout

    def span(self, unit: Unit) -> tuple[int, int]:
        return self.layout.span(unit.numel, self.rank)

    def piece(self, unit: Unit) -> tuple[int, int]:
        return self.layout.piece(unit.numel, self.rank)

    def padded(self, unit: Unit) -> int:
        return self.layout.padded(unit.numel)


class Single(Cuts):
    """The world of one process: every collective is the identity."""

    rank, world_size, local_rank, local_world_size = 0, 1, 0, 1
    layout = Layout()
    is_main = holds_state = True

    def sum_count(self, n: int) -> int:
        return n

    def sum_(self, t: torch.Tensor) -> torch.Tensor:
        return t

    def gather_(self, unit, buf) -> None:
        pass

    def reduce(self, unit, grad):
        return grad

    def reduce_then(self, unit, grad, finish) -> None:
        finish(unit, grad)

    def flush(self) -> None:
        pass

    def norms(self, unit, grad):
        return param_norms(unit, grad)

    def any(self, flag: bool) -> bool:
        return flag

    def first(self, obj: T) -> T:
        return obj

    def each(self, obj: T) -> list[T]:
        return [obj]

    def barrier(self) -> None:
        pass

    def updated(self, unit: Unit) -> None:
        pass

    def host_state(self, units: list[Unit], moments: Moments = FP32) -> HostState:
        return HostState(units, moments=moments)

    def close(self) -> None:
        pass


def plans_for_all() -> bool:
    """This process is the world's first rank, whose plan every rank runs (runtime.build_model);
    a single process is its own."""
    return int(os.environ.get("RANK", "0")) == 0


def world_layout(traffic: str = "auto", nnodes: int | None = None) -> Layout:
    """The layout of the world torchrun started (RANK, WORLD_SIZE, LOCAL_WORLD_SIZE): its machines
    are torchrun's, or `nnodes` machines simulated within them (each a share of a real one's
    processes); ConfigError for a world that cannot be cut so."""
    world = int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    if world % local:
        raise ConfigError(
            f"WORLD_SIZE {world} with LOCAL_WORLD_SIZE {local}: every machine must run the same number of processes"
        )
    real = world // local
    machines = nnodes or real
    if machines % real or world % machines:
        raise ConfigError(
            f"nnodes: {machines}, but the world is {world} processes on {real} machine(s), {local} on each: "
            f"nnodes must be a multiple of {real} that divides {world}"
        )
    return resolve(traffic, world, machines)


def world_device(device: torch.device) -> torch.device:
    """Each rank's GPU: cuda:LOCAL_RANK."""
    check_devices(device, int(os.environ.get("LOCAL_WORLD_SIZE", os.environ["WORLD_SIZE"])))
    if device.type != "cuda":
        return device
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)
