"""The embedding's rows (`Plan.embed_rows`): the token table stepped in host memory and fetched as
the rows a step looks up, for the streaming transport (transport.py).

A forward sweep reads only the rows of its tokens (about 15,000 of a 128,256-row table for 16k
tokens), and the backward sweep writes the table's gradient only there. So the table need not
cross the link whole, either way:

* **out**: at the step, the rows of the gradient that this step's tokens touched (the only
  nonzero ones) are gathered on the GPU and copied to host memory ahead of the other copies
  queued there; the host optimizer adds them into the table's gradient there (zero elsewhere)
  just before the table's own update, the only reader of it.
* **ahead**: the next pass announces the rows it looks up (`begin`); the optimizer worker first
  computes what those rows become in this step's update (from the step's gradient rows, before
  they are added into the table's), reading their state where it lies, into a page-locked buffer
  that the fetch copies in. The state is not touched: the next forward sweep
  starts once those rows are done, not the whole table.
* **whole**: the table's own update, after every other host-stepped unit, in the time the host
  optimizer would idle through the backward sweep. It computes the rows again from the same
  numbers with the same kernel (`HostAdamW.step_rows` says why bitwise), then zeroes them in the
  gradient. A fetch of the whole table (`synchronize`, a pass announced with no rows) waits for
  it, as for any unit.

Where nothing was computed ahead (the first step; a pass begun without a step before it; the
transport's serial schedule) the fetch gathers the rows from the stepped table itself.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass

import torch

from ..host.split import Halves, cast
from ..host.state import HostState, Unit
from ..planning.planspec import ROW_HEADROOM
from .optim import HostAdamW


@dataclass
class RowsGrad:
    """The step's rows of the table's gradient, on their way to host memory."""

    ids: torch.Tensor  # the rows (sorted token ids, host memory)
    landed: torch.cuda.Event


class EmbeddingRows:
    """The buffers and hand-overs of the embedding's rows (see the module docstring). The main
    thread calls `begin`, `hold`, `release`, `gather` and `fetch`; the optimizer worker `next_rows`,
    `settle`, `ahead`, `land` and `whole`, in that order within a step's job."""

    def __init__(self, state: HostState, optimizer: HostAdamW, unit: Unit, dtype: torch.dtype):
        spec = unit.params[0]
        self.state, self.optimizer, self.unit = state, optimizer, unit
        self.vocab, self.width = spec.shape
        self.span = slice(spec.offset, spec.offset + spec.numel)
        # The table's gradient in host memory, zero but for the rows of the step being stepped.
        self.grad = torch.zeros(unit.numel)
        self.table_grad = self.grad[self.span].view(self.vocab, self.width)
        # The rows' ways out and in, page-locked, sized for the most rows a pass has looked up so
        # far with ROW_HEADROOM (at most a step's tokens: planspec.looked_up_rows). Made again only
        # where a pass looks up more: fresh memory costs its page faults on first touch.
        self.grad_rows = torch.empty(0, pin_memory=True)
        self.out = torch.empty(0, dtype=dtype, pin_memory=True)
        self.current: torch.Tensor | None = None  # the rows the pass begun last looks up
        self.current_dev: torch.Tensor | None = None  # the same on the device
        self.held: torch.Tensor | None = None  # the rows of the gradient held for the step
        self.held_dev: torch.Tensor | None = None  # the same on the device
        self.posted: torch.Tensor | None = None  # the rows the worker computes ahead, if any
        self.awaiting = False  # a step's job waits for the next pass's rows
        self._post: queue.Queue = queue.Queue()
        self.computed = threading.Event()  # the posted rows are in `out`
        self.scattered = threading.Event()  # `grad_rows` is free again
        self.computed.set()
        self.scattered.set()
        self.read: torch.cuda.Event | None = None  # the last fetch's copy out of `out`

    # ------------------------------------------------------------- main thread
    def begin(self, rows: torch.Tensor | None, on_device: torch.Tensor | None = None) -> None:
        """A pass begins that looks up `rows` (None: it fetches the whole table; `on_device`: the
        same ids on the device, copied with the pass's inputs, which the step's gather reads: a
        copy queued at the step would wait behind the link's copies queued before it); where a
        step's job waits for them, they are computed ahead for its fetch."""
        self.current, self.current_dev, self.posted = rows, on_device, None
        if self.awaiting:
            self.awaiting = False
            if rows is not None:
                self.posted = rows
                self.computed.clear()
            self._post.put(rows)

    def hold(self) -> None:
        """The table's gradient from the pass begun last is held for the step: its rows with it."""
        self.held, self.held_dev = self.current, self.current_dev

    def release(self) -> None:
        """Nothing is computed ahead for the step's job (the caller waits for its updates)."""
        if self.awaiting:
            self.awaiting = False
            self._post.put(None)

    def gather(self, grad: torch.Tensor, compute, d2h) -> RowsGrad:
        """At the step: the held rows of the table's gradient (`grad`, fp32 on the GPU) gathered
        there and copied out on `d2h`, queued ahead of what the step queues after it: nothing
        crosses the link into the device first (the ids came with the pass's inputs)."""
        ids, index = self.held, self.held_dev
        n = ids.numel() * self.width
        self.scattered.wait()  # the last step's rows are out of the buffer
        self.scattered.clear()
        self.grad_rows = _room(self.grad_rows, n)
        if d2h is not compute:
            d2h.wait_stream(compute)
        with torch.cuda.stream(d2h):
            picked = grad[self.span].view(self.vocab, self.width).index_select(0, index)
            self.grad_rows[:n].copy_(picked.view(-1), non_blocking=True)
            landed = torch.cuda.Event()
            landed.record(d2h)
        if d2h is not compute:
            grad.record_stream(d2h)
            index.record_stream(d2h)
        return RowsGrad(ids, landed)

    def fetch(
        self, h2d, compute, device, ready, overlap: bool
    ) -> tuple[torch.Tensor, torch.cuda.Event, float]:
        """The rows the pass looks up on the device ([rows, width], compute dtype), copied on `h2d`,
        with the copy's event and the seconds waited for them: computed ahead where they were
        posted, else gathered from the table once its update is done (`ready()` waits for it)."""
        rows = self.current
        n = rows.numel() * self.width
        waited = 0.0
        if self.posted is not None and self.posted is rows:
            t = time.perf_counter()
            self.computed.wait()
            waited = time.perf_counter() - t
        else:
            ready()
            self._wait_read()
            self.out = _room(self.out, n)
            table = self.state.halves(self.unit)[self.span].view(self.vocab, self.width)
            picked = Halves(table.hi.index_select(0, rows), table.lo.index_select(0, rows))
            self.out[:n].view(-1, self.width).copy_(cast(picked, self.out.dtype))
        with torch.cuda.stream(h2d):
            buf = torch.empty(n, dtype=self.out.dtype, device=device)
            buf.copy_(self.out[:n], non_blocking=True)
            ev = torch.cuda.Event()
            ev.record(h2d)
        if overlap:
            buf.record_stream(compute)
        self.read = ev
        return buf.view(-1, self.width), ev, waited

    def fail(self) -> None:
        """The worker failed: nothing waits for it here."""
        self.computed.set()
        self.scattered.set()

    # ------------------------------------------------------------- optimizer worker
    def next_rows(self, wait: bool) -> torch.Tensor | None:
        """The rows the next pass posts (`wait`: a pass will begin or be released; this waits for
        it); None where none are."""
        return self._post.get() if wait else None

    def settle(self, g: RowsGrad) -> None:
        """Wait for the step's rows of the gradient (`g`) to land and for the last fetch to have
        read `out`: what `ahead` reads and writes."""
        g.landed.synchronize()
        self._wait_read()

    def ahead(self, g: RowsGrad, rows: torch.Tensor, coef, lr: float, step: int) -> int:
        """What the posted `rows` become in this step's update, into `out` for their fetch, their
        gradient read from the step's rows (`g`, settled: zero where it has none); returns their
        parameters."""
        n = rows.numel() * self.width
        self.out = _room(self.out, n)
        out, held = self.out[:n].view(-1, self.width), g.ids
        pos = torch.searchsorted(held, rows).clamp_(max=held.numel() - 1)
        index = torch.where(held[pos] == rows, pos, -1)
        grads = self.grad_rows[: held.numel() * self.width].view(-1, self.width)
        self.optimizer.step_rows(self.unit, rows, grads, coef, lr, step, out, index)
        self.computed.set()
        return n

    def land(self, g: RowsGrad) -> None:
        """The step's rows of the gradient into the table's, zero elsewhere."""
        g.landed.synchronize()
        n = g.ids.numel() * self.width
        self.table_grad.index_copy_(0, g.ids, self.grad_rows[:n].view(-1, self.width))
        self.scattered.set()

    def whole(self, g: RowsGrad, coef, lr: float, step: int, chunk: int) -> None:
        """The table's update from its gradient in host memory; then the step's rows zeroed there."""
        self.optimizer.step_held(self.unit, self.grad, coef, lr, step, chunk)
        self.table_grad.index_fill_(0, g.ids, 0.0)

    def _wait_read(self) -> None:
        if self.read is not None:
            self.read.synchronize()


def _room(buf: torch.Tensor, n: int) -> torch.Tensor:
    """`buf`, or a page-locked buffer of its dtype with room for `n` elements and ROW_HEADROOM,
    where it has not the room for `n`."""
    return buf if buf.numel() >= n else torch.empty(int(n * ROW_HEADROOM), dtype=buf.dtype, pin_memory=True)
