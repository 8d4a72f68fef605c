"""Which elements of a unit each rank of a data-parallel world steps, copies to its device and
receives as gradient, and which each machine holds in host memory: the one place that cuts units.

A unit's flat range is cut into one consecutive *span* per rank, as equal as pages allow: every
span starts on a page, so ranks never write the same page of a shared state, and all spans but
the last ones have the same length (`piece`). Two designs use the spans:

* **plain**: every rank copies the whole unit to its device and receives the whole gradient
  (all-reduce); it steps its span of the machine's one shared state.
* **sharded**: every rank copies only its span to its device and the ranks all-gather the rest;
  gradients are reduce-scattered, so a rank receives only its span. A collective needs pieces
  of equal size, so device buffers are padded to `ranks x piece` elements (the padding is never
  read and never reaches host memory or a checkpoint).

A world on several machines (torchrun's LOCAL_WORLD_SIZE below WORLD_SIZE, or `nnodes` machines
simulated on one) is sharded and **partitioned**: each machine holds in host memory only its
*part* of every unit, the spans of its own ranks (consecutive ranks, consecutive spans), so the
fp32 weights and moments exist once over the whole world, not once per machine.
"""

from __future__ import annotations

import mmap
from collections.abc import Iterable
from dataclasses import dataclass

from ..errors import ConfigError

# fp32 elements per page (the OS's page, as host/hostmem.py's PAGE): spans start on pages. Read
# here, not from hostmem, which imports torch: the config checks a world before torch loads.
ALIGN = mmap.PAGESIZE // 4
TRAFFIC = ("auto", "plain", "sharded")


def slices(numel: int, parts: int, align: int = ALIGN) -> list[tuple[int, int]]:
    """[0, numel) cut into `parts` consecutive ranges as equal as `align` allows (each starts on
    a page, so ranks never write the same page of the shared state)."""
    step = piece_len(numel, parts, align)
    return [(min(r * step, numel), min((r + 1) * step, numel)) for r in range(parts)]


def piece_len(numel: int, parts: int, align: int = ALIGN) -> int:
    """The length of the longest of `slices(numel, parts)`: what every rank's piece is padded to."""
    return -(-numel // (parts * align)) * align


@dataclass(frozen=True)
class Layout:
    """How a world of `ranks` processes on `machines` machines cuts every unit (module docstring)."""

    ranks: int = 1
    machines: int = 1
    sharded: bool = False

    @property
    def ranks_per_machine(self) -> int:
        return self.ranks // self.machines

    @property
    def partitioned(self) -> bool:
        """Each machine holds only its part of the host state."""
        return self.machines > 1

    def machine_of(self, rank: int) -> int:
        return rank // self.ranks_per_machine

    def span(self, numel: int, rank: int) -> tuple[int, int]:
        """The elements [lo, hi) of a unit that `rank` applies AdamW to."""
        step = piece_len(numel, self.ranks)
        return min(rank * step, numel), min((rank + 1) * step, numel)

    def piece(self, numel: int, rank: int) -> tuple[int, int]:
        """The elements of a unit that pass between `rank`'s device and host memory: the weights
        it copies in and the gradient it receives. The whole unit (plain), or its span (sharded)."""
        return self.span(numel, rank) if self.sharded else (0, numel)

    def padded(self, numel: int) -> int:
        """Length of a unit's device buffers (gathered weights, gradients to reduce)."""
        return self.ranks * piece_len(numel, self.ranks) if self.sharded else numel

    def part(self, numel: int, machine: int) -> tuple[int, int]:
        """The elements of a unit whose fp32 state `machine` holds: its ranks' spans."""
        first, last = machine * self.ranks_per_machine, (machine + 1) * self.ranks_per_machine - 1
        return self.span(numel, first)[0], self.span(numel, last)[1]

    def held(self, numels: Iterable[int], machine: int = 0) -> int:
        """Elements of host state `machine` holds for units of these sizes (the first machine
        holds the most: spans are cut from the front)."""
        return sum(hi - lo for lo, hi in (self.part(n, machine) for n in numels))


def resolve(traffic: str, ranks: int, machines: int) -> Layout:
    """The layout of a world; a ConfigError (one line) for a combination that cannot work."""
    if traffic not in TRAFFIC:
        raise ConfigError(f"ddp_traffic: must be one of {', '.join(TRAFFIC)} (got {traffic!r})")
    if machines < 1 or ranks % machines:
        raise ConfigError(f"nnodes: {machines} machines do not split a world of {ranks} processes evenly")
    if machines > 1 and traffic == "plain":
        raise ConfigError(
            f"ddp_traffic: plain copies whole units from a whole host state, but the state is partitioned "
            f"over {machines} machines (nnodes): use sharded or auto"
        )
    sharded = traffic == "sharded" or (traffic == "auto" and machines > 1)
    return Layout(ranks, machines, sharded and ranks > 1)
