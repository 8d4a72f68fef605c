"""Streamed units stepped on the GPU: their optimizer state crosses PCIe instead of their gradients.

With all state in host memory every unit is stepped by the CPU AdamW once the clip coefficient is
known, and only the next forward sweep hides it, while PCIe is mostly idle. For the plan's
GPU-stepped units (`Plan.stepped`: the first streamed units in forward order, which the next
forward sweep needs first, and whose gradients the backward sweep produces last) the step runs on
the GPU instead, with the fused CUDA AdamW GPU-resident units are stepped with, on the same
numbers, so a unit stepped this way ends bitwise where a resident one would:

* their gradients wait on the GPU for the clip (the plan counts them);
* **prestaged** (`Plan.prestaged`: gradients held for the clip): the state's way in does not
  depend on the clip coefficient, so each unit's master weights (their halves, joined into fp32
  on the GPU a chunk at a time: host/split.py) and two AdamW moments are copied host->device
  during the backward sweep, into buffers of their own held until the step.
  The transport says how far the sweep has come (`prestage`); the copies queue on its
  host->device stream a share at a time, behind the sweep's own weight fetches, in the order the
  units will be stepped. After the clip only the kernels and the way back remain: every unit's
  kernels first, then the write-backs, so the next forward sweep's weights wait for none of the
  way back, and each gradient is let go as soon as its kernel is queued;
* **chunked** (a step whose gradients land during the backward sweep: two-pass, immediate, or a
  plan without prestage): after the clip, each unit's state is copied in a chunk at a time into
  one of `STEP_SLOTS` scratch slots, stepped there and copied back; one slot loads while the
  other is stepped and written back (AdamW is elementwise: chunks change nothing);
* either way, the updated weights go back as their halves (split on the GPU) and in the compute
  dtype (in bf16 the halves' `hi`, the numbers a fetch brings) into a buffer that the unit's next
  fetch takes as it is (`take`): the next forward sweep's weights of these units never cross PCIe.
  Prestaged units keep it for every fetch of the next step's schedule (the backward sweep's, a
  tied head's): their weights cross PCIe only as part of their state. Any later fetch, and the
  next step's loads, read host memory after the write-back (`order_read`, `_written`).

Loads queue on the transport's host->device stream, steps and write-backs on a stream of their
own, so the CPU optimizer's gradient copies and the next forward sweep go on beside them; the
order is kept by events and nothing blocks the calling thread. With `overlap=False` everything
runs on the compute stream in program order: the serial reference. Off CUDA (`compute=None`:
tests; the plan refuses GPU stepping on the CPU) the same code runs in program order.
"""

from __future__ import annotations

import math

import torch

from ..host.hostmem import PAGE, Registration
from ..host.moments import BLOCK
from ..host.split import HALF_BYTES, HI, Halves, fetch_join_, split_, to_bf16
from ..host.state import HostState, Unit
from ..planning.footprint import STEP_SLOTS
from .optim import AdamWConfig, adamw_range, chunk_ranges, clip_scaled


def _mark(stream) -> torch.cuda.Event | None:
    """An event at the current end of `stream` (None off CUDA, where work runs in program order)."""
    if stream is None:
        return None
    ev = torch.cuda.Event()
    ev.record(stream)
    return ev


def _wait(stream, ev) -> None:
    if ev is not None:
        stream.wait_event(ev)


class GpuStepper:
    """AdamW on the GPU for units whose state lives in host memory (see the module docstring).
    Used from one thread, the one that launches the compute."""

    def __init__(
        self,
        state: HostState,
        cfg: AdamWConfig,
        units: list[Unit],
        dtype: torch.dtype,
        chunk: int,
        compute: torch.cuda.Stream | None = None,
        load: torch.cuda.Stream | None = None,
        overlap: bool = True,
        prestage: bool = False,
    ):
        """`units`: consecutive units; `chunk`: elements per scratch slot; `compute`: the stream
        that computes (None: the CPU); `load`: the transport's host->device stream; `prestage`:
        every step's state comes in before the step (`prestage`), none through scratch."""
        self.state, self.cfg, self.dtype = state, cfg, dtype
        self.order = list(units)  # the order they are stepped in, and prestaged in
        self.units = {u.index for u in units}
        self.device = torch.device("cpu") if compute is None else compute.device
        self.compute, self.load = compute, load
        self.overlap = overlap and compute is not None
        self.stream = torch.cuda.Stream(self.device) if self.overlap else compute
        self.chunk = min(chunk, max((u.numel for u in units), default=0))
        if state.moments.quantized and self.chunk % BLOCK:
            raise ValueError(
                f"GPU-stepped chunks of {self.chunk} elements: a multiple of {BLOCK} keeps 8-bit blocks whole"
            )
        self.prestaging = prestage
        # The buffers of a unit's state (master, then the moments), in their dtypes.
        self.fields = ("master", *state.moment_names)
        slots = 0 if prestage else STEP_SLOTS
        self.slots = [self._buffers(self.chunk) for _ in range(slots)]
        # The master weights cross as their halves, a chunk at a time through these: joined into
        # fp32 on the load stream, split from it on the step stream (host/split.py's rule).
        self.landing, self.leaving = (self._halves(self.chunk) for _ in range(2))
        self._free: list[torch.cuda.Event | None] = [None] * slots  # slot written back
        self._next = 0  # the slot the next chunk loads into
        # Prestaged state: unit -> (its master and moments on the GPU, elements loaded, the event
        # after which they are there); `_queued` elements of `order` queued so far this step.
        self._held: dict[int, tuple[list[torch.Tensor], int, torch.cuda.Event | None]] = {}
        self._queued = 0
        self._total = sum(u.numel for u in units)
        self._fresh: dict[int, tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self._written: dict[int, torch.cuda.Event | None] = {}  # a unit's last write-back
        self._registrations = self._register(units)
        self.h2d_bytes = self.d2h_bytes = 0  # accounting for benchmarks

    def _halves(self, n: int) -> Halves:
        return Halves(
            torch.empty(n, dtype=HI, device=self.device),
            torch.empty(n, dtype=torch.int16, device=self.device),
        )

    def _get_master(self, unit: Unit, a: int, b: int, p: torch.Tensor) -> None:
        """Queue on the current stream (the load stream) the master weights [a, b) of `unit` into
        `p` (fp32 on the GPU): their halves copied in through `landing`, then joined."""
        fetch_join_(self.state.halves(unit, a, b), p, self.landing)

    def _put_master(self, unit: Unit, a: int, p: torch.Tensor, fresh: torch.Tensor | None = None) -> None:
        """Queue on the current stream (the step stream) `p`, the unit's fp32 master weights from
        element `a` on, into host memory as their halves; and into `fresh` (the compute dtype, the
        same range) where given: in bf16 their `hi`, as a fetch would bring them."""
        for c in range(0, p.numel(), self.chunk):
            d = min(p.numel(), c + self.chunk)
            stage = split_(p[c:d], self.leaving[: d - c])
            if fresh is not None:
                fresh[c:d].copy_(stage.hi if fresh.dtype == HI else p[c:d])
            for dst, src in zip(self.state.halves(unit, a + c, a + d), stage):
                dst.copy_(src, non_blocking=True)

    def _buffers(self, numel: int) -> list[torch.Tensor]:
        """Device buffers for `numel` elements of state: the fp32 master weights (joined from their
        halves), then one per moment buffer of the host state, in its dtype."""
        return [torch.empty(numel, device=self.device)] + [
            torch.empty(
                -(-numel // self.state.per(w)), dtype=getattr(self.state, w).dtype, device=self.device
            )
            for w in self.fields[1:]
        ]

    def _bytes(self, a: int, b: int) -> int:
        """Bytes of elements [a, b) of a unit's state crossing the link: the master weights' halves
        and the moment buffers (from a block: an 8-bit absmax's too)."""
        return HALF_BYTES * (b - a) + sum(
            (-(-b // self.state.per(w)) - a // self.state.per(w)) * getattr(self.state, w).element_size()
            for w in self.fields[1:]
        )

    def _register(self, units: list[Unit]) -> list[Registration]:
        """Page-lock the moments of `units` (the transport locks all master weights): copies from
        pageable memory would run 7x slower and block this thread. A buffer of 1- or 2-byte
        elements (8-bit, bf16) from its first unit's page to its last's: a unit starts on a page
        of fp32 elements only."""
        if not units or self.compute is None:
            return []
        lo, hi = units[0].start, units[-1].start + units[-1].numel
        out = []
        for w in self.fields[1:]:
            t, per = getattr(self.state, w), self.state.per(w)
            page = PAGE // t.element_size()  # elements a page
            a, b = lo // per // page * page, min(t.numel(), -(-hi // per // page) * page)
            out.append(Registration(t[a:b], [u.start // per // page * page - a for u in units]))
        return out

    def __contains__(self, index: int) -> bool:
        return index in self.units

    # ------------------------------------------------------------- prestage
    def prestage(self, share: float) -> None:
        """Queue the loads of the units' state up to `share` (0..1) of it, in step order, behind
        what the load stream has queued so far (the sweep's fetches): called as the backward
        sweep advances, so the loads spread over it."""
        if not self.prestaging:
            return
        grain = BLOCK if self.state.moments.quantized else 1  # 8-bit state loads in whole blocks
        target = min(self._total, math.ceil(share * self._total / grain) * grain)
        start = 0
        for unit in self.order:
            a, b = max(self._queued, start) - start, min(target - start, unit.numel)
            if a < b:
                self._load_held(unit, a, b)
                self._queued += b - a
            start += unit.numel
            if start >= target:
                return

    def _load_held(self, unit: Unit, a: int, b: int) -> None:
        """Queue the copy of elements [a, b) of the unit's state into its held buffer."""
        with torch.cuda.stream(self.load):
            if unit.index not in self._held:
                # Allocated on the load stream, which writes it first: memory the allocator hands
                # back there is free of earlier work in that stream's order.
                _wait(self.load, self._written.get(unit.index))  # its previous update is back
                self._held[unit.index] = (self._buffers(unit.numel), 0, None)
            buf, done, _ = self._held[unit.index]
            assert done == a, (unit.name, done, a)
            for which, t in zip(self.fields[1:], buf[1:]):
                self.state.cut(t, a, b, which).copy_(self.state.range(unit, a, b, which), non_blocking=True)
            self._get_master(unit, a, b, buf[0][a:b])
            self._held[unit.index] = (buf, b, _mark(self.load))
        self.h2d_bytes += self._bytes(a, b)

    def discard(self) -> None:
        """Drop the prestaged state (a step skipped or begun again): host memory holds it as it was."""
        self._held, self._queued = {}, 0

    # ------------------------------------------------------------- step
    def step(self, items: list, coef: torch.Tensor | None, lr: float, step: int, skip=None) -> None:
        """Queue AdamW for `items` ((unit, its complete fp32 gradient on the GPU), in forward
        order), after what the compute stream has queued so far (the gradients, `coef`, `skip`).
        Consumes `items`: each gradient is let go once its kernel is queued, so its memory returns
        to the compute stream when that kernel is done, not after every write-back. The prestaged
        units' write-backs queue after all their kernels: the next forward sweep's weights
        (`take`) wait for no write-back."""
        if not items:
            return
        self.prestage(1.0)  # whatever the sweep has not brought in yet
        _wait(self.stream, _mark(self.compute))
        if self.overlap:  # read on this stream after the caller lets them go (immediate: per unit)
            for flag in (coef, skip):
                if isinstance(flag, torch.Tensor) and flag.is_cuda:
                    flag.record_stream(self.stream)
        stepped = []
        while items:
            unit, grad = items.pop(0)
            if self.overlap:
                grad.record_stream(self.stream)  # freed below; this stream still reads it
            fresh = self._fresh_buffer(unit)
            if unit.index in self._held:
                self._step_held(unit, grad, coef, lr, step, skip, fresh)
                stepped.append(unit)
            else:
                self._step(unit, grad, coef, lr, step, skip, fresh)
            del grad
        for unit in stepped:
            self._write_back(unit)
        self.discard()

    def _fresh_buffer(self, unit: Unit) -> torch.Tensor:
        # Allocated on the compute stream, which uses and frees it, after the event the step stream
        # waited for: nothing queued before can still touch this memory. Recorded on the step
        # stream, so that memory is not reused before its writes are done, even where no fetch
        # takes it (a schedule cut short).
        fresh = torch.empty(unit.numel, dtype=self.dtype, device=self.device)
        if self.overlap:
            fresh.record_stream(self.stream)
        return fresh

    def _step_held(self, unit: Unit, grad: torch.Tensor, coef, lr: float, step: int, skip, fresh) -> None:
        """AdamW on the unit's prestaged state, as a GPU-resident unit is stepped; then its fresh
        weights (the way back follows: `_write_back`)."""
        buf, done, loaded = self._held[unit.index]
        assert done == unit.numel, (unit.name, done)
        _wait(self.stream, loaded)
        p, *moments = buf
        with torch.cuda.stream(self.stream):
            adamw_range(unit, 0, unit.numel, p, clip_scaled(grad, coef), moments, self.cfg, lr, step, skip)
            if fresh.dtype == HI:  # the halves' hi, as a fetch would bring it
                to_bf16(p, out=fresh)
            else:
                fresh.copy_(p)
            self._fresh[unit.index] = (fresh, _mark(self.stream))

    def _write_back(self, unit: Unit) -> None:
        """Queue the copy of a stepped unit's prestaged state to host memory, and let the buffer go."""
        buf, _, _ = self._held.pop(unit.index)
        with torch.cuda.stream(self.stream):
            for which, t in zip(self.fields[1:], buf[1:]):
                self.state.flat(unit, which).copy_(t, non_blocking=True)
            self._put_master(unit, 0, buf[0])
            self._written[unit.index] = _mark(self.stream)
        if self.overlap:
            for t in buf:
                t.record_stream(self.stream)  # freed on return; not reused before the copy is done
        self.d2h_bytes += self._bytes(0, unit.numel)

    def _step(self, unit: Unit, grad: torch.Tensor, coef, lr: float, step: int, skip, fresh) -> None:
        """AdamW through the scratch slots, a chunk at a time."""
        ranges = chunk_ranges(unit, self.chunk)
        for i, (a, b) in enumerate(ranges):
            s, (p, *moments) = self._load(unit, a, b)
            with torch.cuda.stream(self.stream):
                g = clip_scaled(grad[a:b], coef)
                adamw_range(unit, a, b, p, g, moments, self.cfg, lr, step, skip, base=a)
                self._put_master(unit, a, p, fresh[a:b])
                if i == len(ranges) - 1:
                    self._fresh[unit.index] = (fresh, _mark(self.stream))
                for which, t in zip(self.fields[1:], moments):
                    self.state.range(unit, a, b, which).copy_(t, non_blocking=True)
                self._free[s] = _mark(self.stream)
            self.d2h_bytes += self._bytes(a, b)
        self._written[unit.index] = self._free[s]

    def _load(self, unit: Unit, a: int, b: int) -> tuple[int, list[torch.Tensor]]:
        """Queue the copy of elements [a, b) of the unit's state into the next slot; the step
        stream waits for it. Returns the slot and its views (master, then the moment buffers)."""
        s = self._next
        self._next = (s + 1) % STEP_SLOTS
        views = [self.state.cut(t, 0, b - a, w) for w, t in zip(self.fields, self.slots[s])]
        with torch.cuda.stream(self.load):
            _wait(self.load, self._free[s])  # the slot's previous chunk is back in host memory
            _wait(self.load, self._written.get(unit.index))  # and the unit's previous update
            for which, t in zip(self.fields[1:], views[1:]):
                t.copy_(self.state.range(unit, a, b, which), non_blocking=True)
            self._get_master(unit, a, b, views[0])
            loaded = _mark(self.load)
        _wait(self.stream, loaded)
        self.h2d_bytes += self._bytes(a, b)
        return s, views

    # ------------------------------------------------------------- after the step
    def take(self, unit: Unit, keep: bool = False) -> tuple[torch.Tensor, torch.cuda.Event | None] | None:
        """The unit's weights as its last step left them, in compute dtype on the GPU, and the
        event after which they are there (None: fetch it from host memory); `keep`: for a later
        fetch too (the backward sweep's), else given once."""
        return self._fresh.get(unit.index) if keep else self._fresh.pop(unit.index, None)

    def order_read(self, stream: torch.cuda.Stream, unit: Unit) -> None:
        """Make `stream` wait until the unit's last update is back in host memory."""
        _wait(stream, self._written.get(unit.index))

    def wait(self) -> None:
        """Block until every update is back in host memory."""
        for ev in self._written.values():
            if ev is not None:
                ev.synchronize()

    def close(self) -> None:
        """Unlock the moments (after the device is synchronised)."""
        for r in self._registrations:
            r.close()
        self._registrations = []
