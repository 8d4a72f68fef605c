"""Moving weights to the compute device and gradients back into the host optimizer.

The engine asks for one unit's weights at a time (`fetch`) in an order it announces up front
(`begin`). Each unit's gradient, once complete, is either held until the clip coefficient is
known (`hold`, then `step` for all of them) or stepped at once (`step_unit`), as the placement
plan says (placement.py). Two implementations of the `Transport` protocol:

* `SerialTransport`: the plain schedule. Each fetch copies a unit's master weights to the device
  (on the CPU in bf16 they are the state's own `hi`); every update runs inline. This is the
  reference the fast path must equal.

Both fetch from the master weights' halves (host/split.py): in bf16 their `hi` alone, as it is
(2 bytes a parameter, no cast on the device), in fp32 both halves, joined on the device.

* `StreamingTransport` (CUDA): the overlapped schedule. Host->device copies run on their own
  stream, `prefetch` units ahead of compute, from master weights page-locked in place. Held
  gradients wait on the GPU (the leading units the plan keeps there) or are copied at once, on a
  device->host stream, into page-locked host memory; either way the GPU buffer is released as
  soon as possible. Updates run on a worker thread with torch's fused CPU AdamW, unit by unit in
  the order they were handed over, device-resident gradients copied out in chunks through two
  small pinned buffers; the main thread and the GPU go on at once, and a `fetch` waits only for
  the update of the unit it needs. The leading units' fp32 state may live on the GPU for good
  (`resident_units`), stepped there by the fused CUDA AdamW (DeepSpeed's "Twin-Flow"):
  `synchronize` writes it back so checkpoints see one place. The next units' state may instead
  be streamed to the GPU for each step and back (`gpu_stepped_units`, gpustep.py): where
  gradients are held, each `hold` marks a step of the backward sweep, and that share of their
  state is queued on the host->device stream behind the fetches issued so far (`prestage`).

Every path computes the same arithmetic: the fp32 gradient times the clip coefficient (an fp32
multiply, exact on either device), then the fused AdamW. `overlap=False` runs the streaming
transport's copies and updates inline on the compute stream: the serial reference on CUDA.

In a data-parallel world (distributed.py) a transport copies in the rank's *piece* of a unit and
the collective gathers the rest on the device (the piece is the whole unit in the plain design);
the gradient handed to `hold` / `step_unit` is the rank's piece of the reduced gradient, of which
it steps its span (layout.py).
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass
from typing import Protocol

import torch

from ..host.hostmem import Registration, host_buffer
from ..host.split import HI, LO, Halves, fetch_join_, join_, split, to_bf16, to_device
from ..host.state import HostState, Unit
from ..parallel.distributed import Collective, Single
from ..planning.placement import Plan, optimizer_threads
from ..planning.planspec import fetch_bytes
from .gpustep import GpuStepper
from .optim import HostAdamW, adamw_range, chunk_ranges
from .optim import clip_scaled as _scaled
from .osthreads import OPTIMIZER_THREAD, name_os_thread
from .rows import EmbeddingRows, RowsGrad

PINNING, RESIDENT = "page-locking the host memory", "the GPU-resident state"  # `setup_s`'s parts


def device_state(
    state: HostState, unit: Unit, device, landing: Halves, zero_moments: bool
) -> tuple[torch.Tensor, ...]:
    """The fp32 master weights and moment buffers of `unit` (its part held here) as new tensors
    on `device`, queued on the current stream: the weights as their halves, from page-locked host
    memory through `landing` (on `device`), joined there (the same bits as a join on the host,
    without the host's pass over them and a copy from pageable memory twice their size); the
    moments zero where `zero_moments` (the host's are, untouched: reading them would map every
    page; zero is every format's fresh state, an 8-bit block's codes and absmax too), else copied."""
    halves = state.halves(unit)
    master = fetch_join_(halves, torch.empty(halves.numel(), dtype=torch.float32, device=device), landing)
    if zero_moments:
        moments = (torch.zeros_like(state.flat(unit, w), device=device) for w in state.moment_names)
    else:
        moments = (state.flat(unit, w).to(device, non_blocking=True) for w in state.moment_names)
    return (master, *moments)


@dataclass
class HostAdamCounters:
    """The host optimizer's own seconds and the parameters it stepped (its AdamW, not its waits for
    gradients), and the launching thread's seconds blocked on an update, since the run began: how
    fast the host AdamW runs inside a step, and whether the step waits for it. GPU-resident and
    GPU-stepped units are not counted (their AdamW runs on the GPU)."""

    adam_s: float = 0.0
    params: int = 0
    wait_s: float = 0.0
    rows_s: float = 0.0
    """Of the AdamW's seconds, the next pass's rows of the embedding computed ahead (rows.py), before
    the other units' AdamW."""
    rows_wait_s: float = 0.0
    """The worker's seconds waiting, before the rows computed ahead, for the next pass to post
    them; counted in no AdamW's seconds."""
    rows_copy_wait_s: float = 0.0
    """Then its seconds waiting for the step's rows of the gradient to land in host memory and the
    last fetch to have read its buffer; counted in no AdamW's seconds."""

    def stepped(self, params: int, since: float) -> None:
        """`params` stepped in the time since `since` (time.perf_counter())."""
        self.adam_s += time.perf_counter() - since
        self.params += params


class Transport(Protocol):
    """What the engine streams through: weights in, gradients out, the optimizer."""

    counters: HostAdamCounters

    def begin(self, schedule: list[Unit], rows: torch.Tensor | None = None) -> None:
        """Announce the order in which units will be fetched until the next `begin`, and where the
        plan fetches the embedding's rows (`Plan.embed_rows`), the rows the pass looks up (sorted
        token ids in host memory)."""

    def fetch(self, unit: Unit) -> torch.Tensor:
        """The unit's flat weights in compute dtype on the compute device (next in the order)."""

    def fetch_rows(self, unit: Unit, rows: torch.Tensor) -> torch.Tensor:
        """`fetch` of a one-table unit (the embedding) that brings only `rows`, those announced:
        [rows, width] in compute dtype on the compute device."""

    def hold(self, unit: Unit, grad: torch.Tensor) -> None:
        """The unit's complete fp32 gradient of this step; keep it for `step`."""

    def step(self, coef: torch.Tensor | None, lr: float, step: int) -> None:
        """AdamW on every held gradient, multiplied by `coef` (None: not clipped)."""

    def step_unit(
        self, unit: Unit, grad: torch.Tensor, coef: torch.Tensor | None, lr: float, step: int, skip=None
    ) -> None:
        """AdamW on one unit now, its gradient complete and the clip coefficient known; `skip`, a
        device flag, cancels the update when nonzero (a gradient that is not finite)."""

    def discard(self) -> None:
        """Drop held gradients: the step is skipped."""

    def run_updates(self) -> None:
        """Let the pending updates run without waiting for the next pass (nothing computed ahead
        for it: `Plan.embed_rows`), not waiting for them either: the caller reads no weight."""

    def wait_updates(self) -> None:
        """Block until every pending update has been applied to the host state."""

    def synchronize(self) -> None:
        """`wait_updates`, and device-resident state copied back: host memory is current."""

    def device_masters(self) -> dict[int, torch.Tensor]:
        """After `wait_updates`: the current fp32 master weights of the units whose state lives on
        the device, by unit index (the host's copy of them is current only after `synchronize`);
        empty where none does or several ranks each step a part of them."""

    def close(self) -> None: ...


class SerialTransport:
    """The plain schedule (see the module docstring); the CPU's transport."""

    def __init__(
        self,
        state: HostState,
        optimizer: HostAdamW,
        device,
        dtype: torch.dtype,
        collective: Collective | None = None,
    ):
        self.state, self.optimizer = state, optimizer
        self.world = collective or Single()
        self.device, self.dtype = torch.device(device), dtype
        self.held: dict[int, torch.Tensor] = {}  # gradients waiting for `step`, inspectable
        self.counters = HostAdamCounters()

    def begin(self, schedule: list[Unit], rows: torch.Tensor | None = None) -> None:
        pass

    def fetch_rows(self, unit: Unit, rows: torch.Tensor) -> torch.Tensor:
        (spec,) = unit.params
        table = self.fetch(unit)[spec.offset : spec.offset + spec.numel].view(spec.shape)
        return table.index_select(0, rows.to(self.device))

    def fetch(self, unit: Unit) -> torch.Tensor:
        lo, hi = self.world.piece(unit)
        got, n = to_device(self.state.halves(unit, lo, hi), self.device, self.dtype), self.world.padded(unit)
        if hi - lo == n:  # the whole unit
            return got
        buf = torch.empty(n, dtype=self.dtype, device=self.device)
        buf[lo:hi].copy_(got)
        self.world.gather_(unit, buf)
        return buf[: unit.numel]

    def hold(self, unit: Unit, grad: torch.Tensor) -> None:
        self.held[unit.index] = grad

    def step(self, coef, lr: float, step: int) -> None:
        held, self.held = self.held, {}
        for unit in self.state.units:
            if unit.index in held:
                self.step_unit(unit, held.pop(unit.index), coef, lr, step)

    def step_unit(self, unit: Unit, grad: torch.Tensor, coef, lr: float, step: int, skip=None) -> None:
        if skip is None or not bool(skip):
            lo, hi = self.optimizer.span(unit)
            g = _scaled(self.optimizer.own(unit, grad), coef).to("cpu")
            t = time.perf_counter()
            self.optimizer.step_range(unit, lo, hi, g, lr, step)
            self.counters.stepped(hi - lo, t)
        self.optimizer.published(unit)

    def discard(self) -> None:
        self.held = {}

    def run_updates(self) -> None:
        pass

    def wait_updates(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def device_masters(self) -> dict[int, torch.Tensor]:
        return {}

    def close(self) -> None:
        pass


class StreamingTransport:
    """Overlapped CUDA transport (see the module docstring)."""

    def __init__(
        self,
        state: HostState,
        optimizer: HostAdamW,
        device,
        dtype: torch.dtype,
        plan: Plan,
        overlap: bool = True,
        threads: int | None = None,
        collective: Collective | None = None,
        zero_moments: bool = False,
    ):
        """`zero_moments`: the host state's AdamW moments are all zero still (a run that resumes
        none), so the GPU-resident units' moments are made zero on the device, not copied."""
        self.state, self.optimizer, self.plan = state, optimizer, plan
        # Seconds of the parts of this setup that take them (build_model's `timings`).
        self.setup_s: dict[str, float] = {}
        t = time.monotonic()
        self.world = collective or Single()
        if plan.resident_units and self.world.layout.sharded:
            raise ValueError("sharded traffic keeps no fp32 state on the GPU (resident_units must be 0)")
        self.device, self.dtype = torch.device(device), dtype
        self.overlap, self.prefetch = overlap, (plan.prefetch if overlap else 0)
        self.compute = torch.cuda.current_stream(self.device)
        self.h2d = torch.cuda.Stream(self.device) if overlap else self.compute
        self.d2h = torch.cuda.Stream(self.device) if overlap else self.compute
        units = state.units
        # Page-lock the master weights' halves in place (5x faster than allocating pinned memory,
        # and no second copy); copies from pageable memory would run 7x slower.
        self._registrations = [
            Registration(state.hi, state.boundaries),
            Registration(state.lo, state.boundaries),
        ]
        # Gradients the plan keeps in host memory until the clip: one page-locked buffer, holding
        # the part of each unit this process steps (`optimizer.span`).
        self._host_slots: dict[int, torch.Tensor] = {}
        first_host = plan.gpu_grad_lead
        if plan.grad_mode == "stored" and first_host < len(units):
            spans = [(u, *optimizer.span(u)) for u in units[first_host:]]
            buf = host_buffer(sum(hi - lo for _, lo, hi in spans))
            off, cuts = 0, []
            for u, lo, hi in spans:
                self._host_slots[u.index] = buf[off : off + hi - lo]
                cuts.append(off)
                off += hi - lo
            self._registrations.append(Registration(buf, cuts))
        self.setup_s[PINNING] = time.monotonic() - t
        self.chunk_elems = min(plan.staging_elems, max(u.numel for u in units))
        self.staging = [torch.empty(self.chunk_elems, pin_memory=True) for _ in range(2)]
        self._ready = {u.index: threading.Event() for u in units}
        for e in self._ready.values():
            e.set()
        self._held: dict[int, object] = {}
        # Gradients handed to the worker and still on the GPU: at most `inflight_units` at once.
        self._inflight = threading.BoundedSemaphore(max(1, plan.inflight_units))
        self.resident: dict[int, tuple[torch.Tensor, ...]] = {}  # master, then the moment buffers
        t = time.monotonic()
        self._make_resident(units[: plan.resident_units], zero_moments)
        self.setup_s[RESIDENT] = time.monotonic() - t
        stepped = [units[i] for i in plan.stepped]
        self.stepper = GpuStepper(
            state,
            optimizer.cfg,
            stepped,
            dtype,
            plan.staging_elems,
            self.compute,
            self.h2d,
            overlap,
            prestage=bool(plan.prestaged),
        )
        self.rows = None  # the embedding's rows (rows.py), where the plan fetches them
        if plan.embed_rows:
            self.rows = EmbeddingRows(state, optimizer, units[0], dtype)
        torch.set_num_threads(threads or optimizer_threads())
        self._error: BaseException | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._worker = None
        if overlap:
            self._worker = threading.Thread(target=self._work, name="megatrain-optimizer", daemon=True)
            self._worker.start()
        self.schedule: list[Unit] = []
        self._pos = 0
        self._issued: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}
        self.h2d_bytes = 0  # accounting for benchmarks
        self.d2h_bytes = 0
        self.counters = HostAdamCounters()

    # ------------------------------------------------------------- weights in
    def begin(self, schedule: list[Unit], rows: torch.Tensor | None = None) -> None:
        self._check()
        self.schedule, self._pos, self._issued = list(schedule), 0, {}
        if self.rows is not None:
            self.rows.begin(rows, None if rows is None else self._on_device(rows))

    def _on_device(self, ids: torch.Tensor) -> torch.Tensor:
        """Host `ids` on the device, copied on the compute stream with the pass's inputs (through
        page-locked memory: the copy blocks nothing here)."""
        with torch.cuda.stream(self.compute):
            return ids.pin_memory().to(self.device, non_blocking=True)

    def _issue(self, k: int) -> None:
        unit = self.schedule[k]
        if self.rows is not None and unit is self.rows.unit and self.rows.current is not None:
            ready = lambda: self._wait_ready(unit)  # noqa: E731
            buf, ev, waited = self.rows.fetch(self.h2d, self.compute, self.device, ready, self.overlap)
            self.counters.wait_s += waited
            self.h2d_bytes += buf.numel() * buf.element_size()
            self._issued[k] = (buf, ev)
            return
        if unit.index in self.resident:
            p32 = self.resident[unit.index][0]
            buf = p32 if self.dtype == torch.float32 else to_bf16(p32)  # on the compute stream
            ev = torch.cuda.Event()
            ev.record(self.compute)
            self._issued[k] = (buf, ev)
            return
        again = any(u.index == unit.index for u in self.schedule[k + 1 :])
        fresh = self.stepper.take(unit, keep=again and unit.index in self.plan.prestaged)
        if fresh is not None:  # stepped on the GPU, in compute dtype already
            self._issued[k] = fresh
            return
        self._wait_ready(unit)
        lo, hi = self.world.piece(unit)  # the whole unit, or this rank's span of it (sharded)
        src = self.state.halves(unit, lo, hi)
        self.stepper.order_read(self.h2d, unit)
        with torch.cuda.stream(self.h2d):
            buf = torch.empty(self.world.padded(unit), dtype=self.dtype, device=self.device)
            bf16 = self.dtype == src.hi.dtype
            if bf16 and not self.plan.fetch_both_halves:  # the halves' hi as it is
                buf[lo:hi].copy_(src.hi, non_blocking=True)
            else:  # both halves, landed here (the landing buffer lives while this is issued)
                stage = Halves(*(t.to(self.device, non_blocking=True) for t in src))
                if bf16:  # the fp32 master's bytes, for comparison: the same weights
                    buf[lo:hi].copy_(stage.hi)
                else:  # fp32: joined
                    join_(stage, buf[lo:hi])
                del stage
            if hi - lo < buf.numel():
                self.world.gather_(unit, buf)  # the other ranks' pieces, on this stream's timeline
            ev = torch.cuda.Event()
            ev.record(self.h2d)
        if self.overlap:
            buf.record_stream(self.compute)
        self.h2d_bytes += (hi - lo) * fetch_bytes(self.plan, self.dtype.itemsize)
        self._issued[k] = (buf[: unit.numel], ev)

    def fetch_rows(self, unit: Unit, rows: torch.Tensor) -> torch.Tensor:
        assert self.rows is not None and rows is self.rows.current, "fetch_rows: rows not announced"
        return self.fetch(unit)

    def fetch(self, unit: Unit) -> torch.Tensor:
        k = self._pos
        assert self.schedule[k] is unit, f"fetch({unit.name}) out of announced order"
        for j in range(k, min(k + 1 + self.prefetch, len(self.schedule))):
            if j not in self._issued:
                self._issue(j)
        buf, ev = self._issued.pop(k)
        self.compute.wait_event(ev)
        self._pos += 1
        return buf

    # ------------------------------------------------------------- gradients out
    def hold(self, unit: Unit, grad: torch.Tensor) -> None:
        self._check()
        if self.rows is not None and unit is self.rows.unit:
            self.rows.hold()  # the rows this gradient's pass looked up
        self._hold(unit, grad)
        # Each gradient held is a step of the backward sweep: the GPU-stepped units' state comes in
        # a share at a time, behind the fetches queued so far, complete by the last layer's.
        self.stepper.prestage(len(self._held) / max(1, len(self.state.units) - 1))

    def _hold(self, unit: Unit, grad: torch.Tensor) -> None:
        slot = self._host_slots.get(unit.index)
        if slot is None or unit.index in self.resident:
            self._held[unit.index] = grad
            return
        # To host memory now, during the backward sweep; the GPU buffer is free after the copy.
        lo, hi = self.optimizer.span(unit)
        self.d2h.wait_stream(self.compute)
        with torch.cuda.stream(self.d2h):
            slot.copy_(self.optimizer.own(unit, grad), non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(self.d2h)
        if self.overlap:
            grad.record_stream(self.d2h)
        self.d2h_bytes += (hi - lo) * 4
        self._held[unit.index] = (slot, landed)

    def step(self, coef, lr: float, step: int) -> None:
        self._check()
        held, self._held = self._held, {}
        items, stepped = [], []
        for unit in self.state.units:
            if unit.index not in held:
                continue
            g = held.pop(unit.index)
            if unit.index in self.resident:
                self._step_resident(unit, g, coef, lr, step)
            else:
                (stepped if unit.index in self.stepper else items).append((unit, g))
        if self.rows is not None and items and items[0][0] is self.rows.unit:
            # The step's rows of its gradient out first, the table's update last (rows.py).
            unit, g = items.pop(0)
            items.append((unit, self.rows.gather(g, self.compute, self.d2h)))
            del g
            self.rows.awaiting = self.overlap
        self._submit(items, coef, lr, step)
        self.stepper.step(stepped, coef, lr, step)

    def step_unit(self, unit: Unit, grad: torch.Tensor, coef, lr: float, step: int, skip=None) -> None:
        self._check()
        if unit.index in self.resident:
            self._step_resident(unit, grad, coef, lr, step, skip)
            return
        if unit.index in self.stepper:
            self.stepper.step([(unit, grad)], coef, lr, step, skip)
            return
        if self.overlap:
            self._inflight.acquire()  # bounded GPU memory: wait while the worker is behind
        self._submit([(unit, grad)], coef, lr, step, release=self.overlap, skip=skip)

    def discard(self) -> None:
        self._held = {}
        self.stepper.discard()

    def _step_resident(self, unit: Unit, g: torch.Tensor, coef, lr: float, step: int, skip=None) -> None:
        p, *moments = self.resident[unit.index]  # on the compute stream, ~1 ms per GB
        adamw_range(unit, 0, unit.numel, p, _scaled(g, coef), moments, self.optimizer.cfg, lr, step, skip)

    def _submit(self, items, coef, lr: float, step: int, release: bool = False, skip=None) -> None:
        if not items:
            return
        done = torch.cuda.Event()
        done.record(self.compute)
        for unit, g in items:
            self._ready[unit.index].clear()
            if self.overlap and isinstance(g, torch.Tensor):
                g.record_stream(self.d2h)
        job = (items, coef, lr, step, done, release, skip)
        if self.overlap:
            self._jobs.put(job)
        else:
            self._apply(*job)

    def _apply(self, items, coef, lr: float, step: int, done, release: bool, skip) -> None:
        """Step `items` (unit, gradient on the GPU or (host slot, landed event)) in order."""
        self.d2h.wait_event(done)
        coef_host = None
        if items and isinstance(items[-1][1], RowsGrad):  # the embedding's rows (rows.py)
            if coef is not None:
                done.synchronize()  # the clip coefficient is computed on the compute stream
                coef_host = coef.to("cpu")
            t = time.perf_counter()
            rows = self.rows.next_rows(wait=self.overlap)
            t_posted = time.perf_counter()
            self.counters.rows_wait_s += t_posted - t
            if rows is not None:
                self.rows.settle(items[-1][1])
                t_rows = time.perf_counter()
                self.counters.rows_copy_wait_s += t_rows - t_posted
                n = self.rows.ahead(items[-1][1], rows, coef_host, lr, step)
                self.counters.stepped(n, t_rows)
                self.counters.rows_s += time.perf_counter() - t_rows
        items.reverse()
        while items:
            # Popped, so each gradient's GPU memory is free once its unit is stepped, not when
            # the whole step is: the next forward sweep reuses it layer by layer.
            unit, g = items.pop()
            if skip is not None:
                done.synchronize()
                if bool(skip.to("cpu")):
                    if release:
                        self._inflight.release()
                    self.optimizer.published(unit)
                    self._ready[unit.index].set()
                    continue
            if isinstance(g, torch.Tensor):
                self._apply_from_device(unit, g, coef, lr, step)
                if release:
                    self._inflight.release()
            elif isinstance(g, RowsGrad):
                # Into the table's gradient only now: the units the next forward sweep waits for
                # are stepped first, and only the table's own update reads it.
                self.rows.land(g)
                t = time.perf_counter()
                self.rows.whole(g, coef_host, lr, step, self.chunk_elems)
                self.counters.stepped(unit.numel, t)
            else:
                slot, landed = g
                landed.synchronize()
                if coef is not None and coef_host is None:
                    done.synchronize()  # the clip coefficient is computed on the compute stream
                    coef_host = coef.to("cpu")
                t = time.perf_counter()
                self.optimizer.step_held(unit, slot, coef_host, lr, step, self.chunk_elems)
                lo, hi = self.optimizer.span(unit)
                self.counters.stepped(hi - lo, t)
            del g
            self.optimizer.published(unit)  # every rank's part of it is in the shared state
            self._ready[unit.index].set()

    def _apply_from_device(self, unit: Unit, grad: torch.Tensor, coef, lr: float, step: int) -> None:
        """Copy a gradient out in chunks through the two pinned buffers, each chunk's AdamW
        overlapping the next chunk's copy."""
        span = self.optimizer.span(unit)
        ranges = chunk_ranges(unit, self.chunk_elems, span)
        own = self.optimizer.own(unit, grad)
        events: dict[int, torch.cuda.Event] = {}
        if not ranges:
            return

        def issue(i: int) -> None:
            a, b = ranges[i]
            with torch.cuda.stream(self.d2h):
                g = _scaled(own[a - span[0] : b - span[0]], coef)
                self.staging[i % 2][: b - a].copy_(g, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.d2h)
            self.d2h_bytes += (b - a) * 4
            events[i] = ev

        issue(0)
        for i, (a, b) in enumerate(ranges):
            if i + 1 < len(ranges):
                issue(i + 1)  # the copy of the next chunk overlaps this chunk's AdamW
            events.pop(i).synchronize()
            t = time.perf_counter()
            self.optimizer.step_range(unit, a, b, self.staging[i % 2][: b - a], lr, step)
            self.counters.stepped(b - a, t)

    def _work(self) -> None:
        name_os_thread(OPTIMIZER_THREAD)
        with torch.cuda.device(self.device):
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                try:
                    self._apply(*job)
                    del job  # its gradients' GPU memory is free now, not when the next job comes
                except BaseException as e:  # surfaced on the main thread at the next call
                    self._error = e
                    if self.rows is not None:
                        self.rows.fail()
                    for ev in self._ready.values():
                        ev.set()
                    for _ in range(self.plan.inflight_units):
                        try:
                            self._inflight.release()
                        except ValueError:
                            break

    def _wait_ready(self, unit: Unit) -> None:
        ready = self._ready[unit.index]
        if not ready.is_set():
            t = time.perf_counter()
            ready.wait()
            self.counters.wait_s += time.perf_counter() - t
        self._check()

    def _check(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError("the optimizer worker failed") from e

    def run_updates(self) -> None:
        if self.rows is not None:
            self.rows.release()

    def wait_updates(self) -> None:
        self.run_updates()
        for u in self.state.units:
            self._ready[u.index].wait()
        self.stepper.wait()
        self._check()

    def synchronize(self) -> None:
        self.wait_updates()
        for i, (p, *moments) in self.resident.items():
            unit = self.state.units[i]
            lo, hi = self.optimizer.span(unit)  # every rank's copy is whole; each writes its part
            for which, t in zip(self.state.moment_names, moments):
                self.state.range(unit, lo, hi, which).copy_(
                    self.state.cut(t, lo, hi, which), non_blocking=True
                )
            for a, b in chunk_ranges(unit, self.chunk_elems, (lo, hi)):  # split here, a chunk at a time
                host = self.state.halves(unit, a, b)
                for dst, src in zip(host, split(p[a:b])):  # freed in this stream's order, after its copy
                    dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize(self.device)

    def device_masters(self) -> dict[int, torch.Tensor]:
        if self.world.world_size > 1:  # each rank steps its part of the copy it holds
            return {}
        return {i: tensors[0] for i, tensors in self.resident.items()}

    # ------------------------------------------------------------- device-resident units
    def _make_resident(self, units: list[Unit], zero_moments: bool) -> None:
        """Move the fp32 weights and moments of `units` to the device for good (`device_state`)."""
        if not units:
            return
        landing = Halves(*(torch.empty(self.chunk_elems, dtype=d, device=self.device) for d in (HI, LO)))
        for u in units:
            self.resident[u.index] = device_state(self.state, u, self.device, landing, zero_moments)
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if self.rows is not None:
            self.rows.release()
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()
            self._worker = None
        if self._registrations:
            torch.cuda.synchronize(self.device)
            for r in self._registrations:
                r.close()
            self._registrations = []
            self.stepper.close()
