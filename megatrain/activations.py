"""Layer-boundary activations parked in host memory when the GPU cannot hold them all.

The forward sweep keeps one activation per layer and micro-batch (tokens x hidden in compute
dtype); at long context these outgrow the GPU (a 7B model at 512k tokens: 137 GB in bf16). Then
each one is copied device->host on its own stream as soon as it is produced, and copied back one
layer ahead of the backward sweep that needs it. The host side is a single pageable buffer
page-locked in place once (`cudaHostRegister`, 5x faster than allocating pinned memory) and
reused every step; it only grows.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_ALIGN = 512  # bytes


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
        self.offset = 0
        self.bytes_moved = 0

    def begin(self, nbytes: int) -> None:
        """Start a step that will park up to `nbytes` (plus alignment)."""
        if self.buf is None or self.buf.numel() < nbytes:
            self.close()
            self.buf = torch.empty(nbytes, dtype=torch.uint8)
            rc = torch.cuda.cudart().cudaHostRegister(self.buf.data_ptr(), nbytes, 0)
            if int(rc) != 0:
                raise RuntimeError(
                    f"cudaHostRegister of {nbytes / 2**30:.1f} GiB for activations failed ({rc})"
                )
        self.offset = 0

    def park(self, t: torch.Tensor) -> Parked:
        """Copy `t` to host memory behind the compute stream; `t` may be dropped at once."""
        n = t.numel() * t.element_size()
        host = self.buf[self.offset : self.offset + n].view(t.dtype).view(t.shape)
        self.offset += -(-n // _ALIGN) * _ALIGN
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
        if self.buf is not None:
            torch.cuda.synchronize(self.device)
            torch.cuda.cudart().cudaHostUnregister(self.buf.data_ptr())
            self.buf = None
