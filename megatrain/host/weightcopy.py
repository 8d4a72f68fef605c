"""A copy of the master weights in the compute dtype (`host_weight_copy`), for the units the host
optimizer steps: the transports fetch those units from it, half the fp32 bytes over PCIe in
bf16, with no fp32 staging buffer on the device.

The copy is exact. Casting fp32 to bf16 (or fp16) on the host with `copy_` rounds to nearest
even, as the device's cast of the fetched fp32 weights does (tests/test_policy.py checks the two
agree bitwise, for the rollout's copy of the streamed layers, rl/policy.py), so a unit's weights
on the device are the same numbers from either source, as long as the copy is current.

This module owns "the copy is current": `refresh` casts a range of a unit's master weights into
it, and every writer of those master weights calls it right after writing (`HostState.written`
for loads and initialisation, HostAdamW.step_range for each range torch's kernel steps, on the
optimizer's threads while the range is still in cache), or writes the copy itself as it writes
them (the host AdamW's own kernel, engine/clipadam.py, given `range` as its bf16 output: the
same cast, checked bitwise against torch's). A skipped step writes nothing, so the copy stays
equal. The units it holds are given at construction (the plan's `copied`): neither the units
whose fp32 state lives on the GPU nor the GPU-stepped ones, whose masters are written back from
the GPU and whose fetches come from there or from the fp32 master as before.
"""

from __future__ import annotations

import torch

from .hostmem import PAGE, host_buffer


class WeightCopy:
    """The compute-dtype copy of the parts of `units` that `state` holds, each unit's part on pages
    of its own (so that the copy can be page-locked in pieces cut at unit boundaries, hostmem.py).
    Allocated zero; `refresh_all` fills it from the master weights."""

    def __init__(self, state, units, dtype: torch.dtype):
        self.state, self.dtype = state, dtype
        per_page = PAGE // dtype.itemsize
        self.starts: dict[int, int] = {}  # unit index -> start of its part in `buffer`
        at = 0
        for u in units:
            lo, hi = state.part(u)
            self.starts[u.index] = at
            at += -(-(hi - lo) // per_page) * per_page
        self.buffer = host_buffer(at, dtype)

    @property
    def boundaries(self) -> list[int]:
        """Element offsets where units start in `buffer` (page-aligned)."""
        return sorted(self.starts.values())

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()

    def holds(self, unit) -> bool:
        return unit.index in self.starts

    def range(self, unit, lo: int, hi: int) -> torch.Tensor:
        """Elements [lo, hi) of `unit` in the copy; they must lie in the part the state holds."""
        a, b = self.state.part(unit)
        if not a <= lo <= hi <= b:
            raise ValueError(f"{unit.name}[{lo}:{hi}] is outside the part held here [{a}:{b}]")
        start = self.starts[unit.index] - a
        return self.buffer[start + lo : start + hi]

    @torch.no_grad()
    def refresh(self, unit, lo: int, hi: int) -> None:
        """Cast the master weights [lo, hi) of `unit` into the copy (nothing where it is not held):
        elementwise, so any range of a unit casts as the whole unit would."""
        if self.holds(unit):
            self.range(unit, lo, hi).copy_(self.state.range(unit, lo, hi))

    def refresh_all(self) -> None:
        for u in self.state.units:
            self.refresh(u, *self.state.part(u))
