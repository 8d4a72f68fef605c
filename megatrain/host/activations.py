"""Layer-boundary activations parked in host memory when the GPU cannot hold them all.

The forward sweep keeps one activation per layer and micro-batch (tokens x hidden in compute
dtype); at long context these outgrow the GPU (a 7B model at 512k tokens: 137 GB in bf16). The
placement plan parks the leading layers' beyond what the GPU holds: each one is copied
device->host on its own stream as soon as it is produced, and copied back one layer ahead of the
backward sweep that needs it. The host side is one buffer with a page-aligned slot per layer,
page-locked in place (hostmem.py) and reused every step; it only grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .hostmem import PAGE, Registration, host_buffer

_ALIGN = 512  # bytes between micro-batches of one layer


@dataclass
class Parked:
    host: torch.Tensor  # a view of the host buffer
    written: torch.cuda.Event  # the device->host copy has finished


class HostActivations:
    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.buf: torch.Tensor | None = None
        self._registration: Registration | None = None
        self.stride = 0  # bytes per layer slot
        self._offsets: dict[int, int] = {}
        self.bytes_moved = 0

    @staticmethod
    def layer_bytes(tokens_per_micro_batch: list[int], hidden: int, itemsize: int) -> int:
        """Bytes one layer's parked inputs take in its slot."""
        return sum(-(-t * hidden * itemsize // _ALIGN) * _ALIGN for t in tokens_per_micro_batch)

    @staticmethod
    def slot_bytes(layer_bytes: int) -> int:
        """A layer's slot: page-aligned, so the buffer can be page-locked in pieces at slots."""
        return -(-layer_bytes // PAGE) * PAGE

    def begin(self, layer_bytes: int, layers: int) -> None:
        """Start a step that parks up to `layer_bytes` for each of `layers` layers."""
        stride = self.slot_bytes(layer_bytes)
        if self.buf is None or stride > self.stride or stride * layers > self.buf.numel():
            self.close()
            self.stride = stride
            self.buf = host_buffer(stride * layers, torch.uint8)
            self._registration = Registration(self.buf, [i * stride for i in range(layers)])
        self._offsets = {}

    def park(self, t: torch.Tensor, layer: int) -> Parked:
        """Copy `t` (an input of `layer`) to host memory behind the compute stream; `t` may be
        dropped at once."""
        n = t.numel() * t.element_size()
        start = layer * self.stride + self._offsets.get(layer, 0)
        self._offsets[layer] = self._offsets.get(layer, 0) + -(-n // _ALIGN) * _ALIGN
        host = self.buf[start : start + n].view(t.dtype).view(t.shape)
        self.d2h.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.d2h):
            host.copy_(t, non_blocking=True)
            written = torch.cuda.Event()
            written.record(self.d2h)
        t.record_stream(self.d2h)  # its memory is reused only after the copy
        self.bytes_moved += n
        return Parked(host, written)

    def fetch(self, p: Parked) -> tuple[torch.Tensor, torch.cuda.Event]:
        """Start copying a parked tensor back; the compute stream must wait on the event."""
        self.h2d.wait_event(p.written)
        with torch.cuda.stream(self.h2d):
            t = torch.empty(p.host.shape, dtype=p.host.dtype, device=self.device)
            t.copy_(p.host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(self.h2d)
        t.record_stream(torch.cuda.current_stream(self.device))
        self.bytes_moved += t.numel() * t.element_size()
        return t, ready

    def close(self) -> None:
        if self._registration is not None:
            torch.cuda.synchronize(self.device)
            self._registration.close()
            self._registration = None
        self.buf = None
