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

  Where GPU memory is free, the fp32 state (weights and moments) of the leading units can live
  on the device (`make_resident`), stepped there by the fused CUDA AdamW: those units need no
  PCIe traffic and no CPU time, and the CPU optimizer, which is the bottleneck at small batch
  sizes, has that much less to do (DeepSpeed calls this "Twin-Flow"). `synchronize` writes their
  state back to host memory, so checkpoints always see one place.
"""

from __future__ import annotations

import os
import queue
import threading

import torch

from .optim import HostAdamW, adamw_range, chunk_ranges
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

    def wait_updates(self) -> None:
        pass

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
        gpu_state: str = "auto",
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
        self.resident: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}
        self.gpu_state = gpu_state  # "auto": decide residency after the first step; "off": never
        self._updates = 0
        # One core stays free for the thread that launches kernels; the optimizer's OpenMP
        # threads would otherwise preempt it and starve the GPU.
        torch.set_num_threads(max(1, (os.cpu_count() or 2) - 1))
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
        if self.gpu_state == "auto" and self._updates >= 1:  # one step measured in this process
            self.gpu_state = "decided"
            self.auto_resident()
        self.schedule, self._pos, self._issued = list(schedule), 0, {}

    def _issue(self, k: int) -> None:
        unit = self.schedule[k]
        if unit.index in self.resident:
            p32 = self.resident[unit.index][0]
            buf = p32 if self.dtype == torch.float32 else p32.to(self.dtype)  # on the compute stream
            ev = torch.cuda.Event()
            ev.record(self.compute)
            self._issued[k] = (buf, ev)
            return
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
        self._updates += 1
        for i, (p, m, v) in self.resident.items():  # on the compute stream, ~1 ms per GB
            unit, g = self.state.units[i], grads.pop(i)
            if coef is not None:
                g.mul_(coef)
            adamw_range(unit, 0, unit.numel, p, g, m, v, self.optimizer.cfg, lr, step)
        done = torch.cuda.Event()
        done.record(self.compute)
        for u in self.state.units:
            if u.index in self.resident:
                continue
            self._ready[u.index].clear()
            if self.overlap:
                grads[u.index].record_stream(self.d2h)
        job = (grads, coef, lr, step, done)
        if self.overlap:
            self._jobs.put(job)
        else:
            self._apply(*job)

    def _apply(self, grads, coef, lr, step, done) -> None:
        units = [u for u in self.state.units if u.index in grads]
        items = [(u, a, b) for u in units for a, b in chunk_ranges(u, self.chunk_elems)]
        if not items:
            return
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

    def wait_updates(self) -> None:
        """Wait until every pending host update has been applied."""
        for u in self.state.units:
            self._ready[u.index].wait()
        self._check()

    def synchronize(self) -> None:
        """Wait until every pending update has reached the host state (device-resident units
        are copied back)."""
        self.wait_updates()
        for i, tensors in self.resident.items():
            unit = self.state.units[i]
            for which, t in zip(("master", "exp_avg", "exp_avg_sq"), tensors):
                self.state.flat(unit, which).copy_(t, non_blocking=True)
        torch.cuda.synchronize(self.device)

    # ------------------------------------------------------------- device-resident units
    def make_resident(self, units: list[Unit]) -> None:
        """Move the fp32 weights and moments of `units` to the device for good."""
        self.synchronize()
        for u in units:
            self.resident[u.index] = tuple(
                self.state.flat(u, w).to(self.device, non_blocking=True)
                for w in ("master", "exp_avg", "exp_avg_sq")
            )
        torch.cuda.synchronize(self.device)

    def auto_resident(self, reserve: float = 0.1) -> list[Unit]:
        """After a step has shown the peak memory of streaming, keep the state of as many
        leading units on the device as fits in what is left (minus `reserve` of the card)."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        free = total * (1 - reserve) - torch.cuda.max_memory_reserved(self.device)
        chosen, need = [], 0
        for u in self.state.units:
            if u.index in self.resident:
                continue
            need += 12 * u.numel
            if need > free:
                break
            chosen.append(u)
        if chosen:
            self.make_resident(chosen)
        return chosen

    def close(self) -> None:
        if self._worker is not None:
            self._jobs.put(None)
            self._worker.join()
            self._worker = None
        if self._registered:
            torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(self.state.master.data_ptr())
            self._registered = False
