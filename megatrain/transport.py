"""Moving weights to the compute device and gradients back into the host optimizer.

The engine asks for one unit's weights at a time (`fetch`) in an order it announces up front
(`begin`), and hands over all gradients once per optimizer step (`update`). Two implementations:

* `SerialTransport`: the plain schedule. Each fetch copies a unit's fp32 master to the device
  (on the CPU with fp32 compute it is the master itself); `update` steps every unit in turn.
  This is the reference the fast path must equal.

* `StreamingTransport` (CUDA): the overlapped schedule. Host->device copies run on their own
  stream, `prefetch` units ahead of compute; the master weights are page-locked once
  (cudaHostRegister), so copies run at full PCIe rate without a staging copy. `update` returns at
  once: a worker thread copies each unit's gradients device->host in chunks on a third stream
  into two small pinned buffers and runs AdamW on them as they land, in forward order, while the
  main thread already runs the next step's forward sweep; a fetch waits only for the update of
  the unit it needs. The GPU and the launching thread never wait on each other per layer.
"""

from __future__ import annotations

import queue
import threading

import torch

from .optim import HostAdamW, chunk_ranges
from .state import HostState, Unit


class SerialTransport:
    def __init__(self, state: HostState, optimizer: HostAdamW, device, dtype: torch.dtype):
        self.state, self.optimizer = state, optimizer
        self.device, self.dtype = torch.device(device), dtype

    def begin(self, schedule: list[Unit]) -> None:
        pass

    def fetch(self, unit: Unit) -> torch.Tensor:
        master = self.state.flat(unit)
        return master.to(self.device, self.dtype)

    def update(self, grads: dict[int, torch.Tensor], coef, lr: float, step: int) -> None:
        for unit in self.state.units:
            g = grads[unit.index]
            if coef is not None:
                g.mul_(coef)
            self.optimizer.step_range(unit, 0, unit.numel, g.to("cpu"), lr, step)

    def synchronize(self) -> None:
        pass

    def close(self) -> None:
        pass


class StreamingTransport:
    """Overlapped CUDA transport (see module docstring). `overlap=False` runs the same copies and
    the same optimizer arithmetic inline on the compute stream: the serial reference on CUDA."""

    def __init__(
        self,
        state: HostState,
        optimizer: HostAdamW,
        device,
        dtype: torch.dtype,
        overlap: bool = True,
        prefetch: int = 2,
        chunk_elems: int = 32 * 2**20,
    ):
        self.state, self.optimizer = state, optimizer
        self.device, self.dtype = torch.device(device), dtype
        self.overlap, self.prefetch = overlap, (prefetch if overlap else 0)
        self.compute = torch.cuda.current_stream(self.device)
        self.h2d = torch.cuda.Stream(self.device) if overlap else self.compute
        self.d2h = torch.cuda.Stream(self.device) if overlap else self.compute
        # Page-lock the master weights in place: 5x faster than allocating pinned memory, and no
        # second copy. Copies from pageable memory would run 7x slower.
        m = state.master
        rc = torch.cuda.cudart().cudaHostRegister(m.data_ptr(), m.numel() * 4, 0)
        self._registered = int(rc) == 0
        if not self._registered:
            raise RuntimeError(f"cudaHostRegister of {m.numel() * 4 / 2**30:.1f} GiB failed ({rc})")
        chunk_elems = min(chunk_elems, max(u.numel for u in state.units))
        self.chunk_elems = chunk_elems
        self.staging = [torch.empty(chunk_elems, pin_memory=True) for _ in range(2)]
        self._ready = {u.index: threading.Event() for u in state.units}
        for e in self._ready.values():
            e.set()
        self._error: BaseException | None = None
        self._jobs: queue.Queue = queue.Queue()
        self._worker = None
        if overlap:
            self._worker = threading.Thread(target=self._work, name="megatrain-optimizer", daemon=True)
            self._worker.start()
        self.schedule: list[Unit] = []
        self._pos = 0
        self._issued: dict[int, tuple[torch.Tensor, torch.cuda.Event]] = {}
        # Accounting for benchmarks.
        self.h2d_bytes = 0
        self.d2h_bytes = 0

    # ------------------------------------------------------------- weights in
    def begin(self, schedule: list[Unit]) -> None:
        self._check()
        self.schedule, self._pos, self._issued = list(schedule), 0, {}

    def _issue(self, k: int) -> None:
        unit = self.schedule[k]
        self._wait_ready(unit)
        src = self.state.flat(unit)
        with torch.cuda.stream(self.h2d):
            if self.dtype == torch.float32:
                buf = torch.empty(unit.numel, device=self.device)
                buf.copy_(src, non_blocking=True)
            else:
                stage = torch.empty(unit.numel, device=self.device)
                stage.copy_(src, non_blocking=True)
                buf = stage.to(self.dtype)
                del stage
            ev = torch.cuda.Event()
            ev.record(self.h2d)
        if self.overlap:
            buf.record_stream(self.compute)
        self.h2d_bytes += unit.numel * 4
        self._issued[k] = (buf, ev)

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
    def update(self, grads: dict[int, torch.Tensor], coef, lr: float, step: int) -> None:
        self._check()
        done = torch.cuda.Event()
        done.record(self.compute)
        for u in self.state.units:
            self._ready[u.index].clear()
            if self.overlap:
                grads[u.index].record_stream(self.d2h)
        job = (grads, coef, lr, step, done)
        if self.overlap:
            self._jobs.put(job)
        else:
            self._apply(*job)

    def _apply(self, grads, coef, lr, step, done) -> None:
        items = [(u, a, b) for u in self.state.units for a, b in chunk_ranges(u, self.chunk_elems)]
        events: dict[int, torch.cuda.Event] = {}

        def issue(i: int) -> None:
            u, a, b = items[i]
            with torch.cuda.stream(self.d2h):
                g = grads[u.index][a:b]
                if coef is not None:
                    g.mul_(coef)
                self.staging[i % 2][: b - a].copy_(g, non_blocking=True)
                ev = torch.cuda.Event()
                ev.record(self.d2h)
            self.d2h_bytes += (b - a) * 4
            events[i] = ev

        self.d2h.wait_event(done)
        issue(0)
        for i, (u, a, b) in enumerate(items):
            if i + 1 < len(items):
                issue(i + 1)  # the copy of the next chunk overlaps this chunk's AdamW
            events.pop(i).synchronize()
            self.optimizer.step_range(u, a, b, self.staging[i % 2][: b - a], lr, step)
            if b == u.numel:
                grads.pop(u.index)
                self._ready[u.index].set()

    def _work(self) -> None:
        with torch.cuda.device(self.device):
            while True:
                job = self._jobs.get()
                if job is None:
                    return
                try:
                    self._apply(*job)
                except BaseException as e:  # surfaced on the main thread at the next call
                    self._error = e
                    for ev in self._ready.values():
                        ev.set()

    def _wait_ready(self, unit: Unit) -> None:
        self._ready[unit.index].wait()
        self._check()

    def _check(self) -> None:
        if self._error is not None:
            e, self._error = self._error, None
            raise RuntimeError("the optimizer worker failed") from e

    def synchronize(self) -> None:
        """Wait until every pending update has reached the host master weights."""
        for u in self.state.units:
            self._ready[u.index].wait()
        self._check()
        torch.cuda.synchronize(self.device)

    def close(self) -> None:
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()
            self._worker = None
        if self._registered:
            torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(self.state.master.data_ptr())
            self._registered = False
