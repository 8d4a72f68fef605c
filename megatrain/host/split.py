"""The fp32 master weights held as two 16-bit halves, and the one rounding of fp32 to bf16.

A weight's fp32 bits are kept as `hi`, a bf16 value (the weight rounded half away from zero:
what the GPU fetches where it computes in bf16, with no cast), and `lo`, the fp32's low 16 bits
as they are: together they give the fp32 back exactly, for every bit pattern. No split whose
`hi` rounds to nearest even can be exact (an even bf16 is the rounding of 65,537 fp32 values,
both ties counted; 16 bits hold 65,536); rounded half away from zero (Megatron-Core's
`store_param_remainders`), `hi` is `lo`'s sign bit added to the fp32's high half, and each bf16
is the rounding of 65,536 values. It differs from a round-to-nearest-even cast only at ties
that cast rounds down to even (about one value in 2^17).

Two magnitudes have no such `hi`. The 32,768 largest finite ones (from 0x7F7F8000: past the
largest bf16 by half a step or more) would round to inf; their `hi` is a zero of their sign,
which the spare half of zero's 65,536 (the values that round to zero are only 32,768) leaves
for them, so a finite weight never fetches as inf. inf and NaN keep their high half (a NaN
whose payload lies in the low bits alone fetches as inf: 16 bits cannot name every NaN).

Every path that makes bf16 weights from fp32 ones uses this module (`to_bf16`, `cast`): the
host fetch (the halves themselves), the GPU-stepped units' and GPU-resident units' casts, the
rollout's policy, the reference policy, exports in bf16; the host AdamW's kernel
(engine/clipadam.py) repeats the rule in C, checked against it. The functions here are plain
torch integer ops, so they run alike on the CPU and on CUDA.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

import torch

HI, LO = torch.bfloat16, torch.int16  # the halves' dtypes
HALF_BYTES = 4  # a parameter's two halves
# Elements a call takes at a time, so that its temporaries stay a few times this: on the host
# within the allocator's reused blocks (whole-tensor temporaries of a large one grew the resident
# set by half the weights written) and in cache; on a GPU few enough launches.
CHUNK = {"cpu": 1 << 18, "cuda": 1 << 24}

# The high halves' magnitudes the rule names (bits 14..0 of a bf16).
_MAG, _TOP = 0x7FFF, 0x7F7F  # the largest finite bf16 magnitude
_SIGN = -0x8000  # bit 15 as an int16

if sys.byteorder != "little":  # an fp32 viewed as two int16 is (low half, high half)
    raise ImportError("megatrain.host.split reads fp32 as two 16-bit halves on little-endian hosts")


class Halves(NamedTuple):
    """The two halves of fp32 weights: `hi` (bf16) and `lo` (int16), of one shape."""

    hi: torch.Tensor
    lo: torch.Tensor

    @property
    def shape(self) -> torch.Size:
        return self.hi.shape

    def numel(self) -> int:
        return self.hi.numel()

    def view(self, *shape) -> Halves:
        return Halves(self.hi.view(*shape), self.lo.view(*shape))

    def __getitem__(self, index) -> Halves:
        return Halves(self.hi[index], self.lo[index])


def _pairs(x: torch.Tensor) -> torch.Tensor:
    """fp32 `x` (contiguous) as [n, 2] int16: each element's low half, then its high half."""
    if x.dtype != torch.float32 or not x.is_contiguous():
        raise ValueError(f"the halves are made from contiguous float32, not {x.dtype}")
    return x.view(-1).view(LO).view(-1, 2)


def _high(top: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The bf16 half (as int16) of fp32 values whose high halves are `top` and low halves `lo`."""
    mag, carry = top & _MAG, lo < 0  # carry: the low half is half a bf16 step or more
    hi = top + (carry & (mag < _TOP)).to(LO)
    return torch.where(carry & (mag == _TOP), top & _SIGN, hi)


def _top(hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The fp32's high half from its halves: `_high` undone."""
    mag, carry = hi & _MAG, lo < 0
    top = hi - (carry & (mag != 0) & (mag <= _TOP)).to(LO)
    return torch.where(carry & (mag == 0), hi | _TOP, top)


def _chunks(n: int, device: torch.device):
    step = CHUNK.get(device.type, CHUNK["cuda"])
    return ((a, min(a + step, n)) for a in range(0, n, step))


@torch.no_grad()
def split_(x: torch.Tensor, into: Halves) -> Halves:
    """Write the halves of `x` (fp32, or any float dtype made fp32 a chunk at a time) into `into`
    (contiguous, `x`'s length; on `x`'s device)."""
    if not x.is_floating_point():
        raise ValueError(f"the halves are made from float32, not {x.dtype}")
    flat, hi, lo = x.reshape(-1), into.hi.view(-1).view(LO), into.lo.view(-1)
    if hi.numel() != flat.numel() or lo.numel() != flat.numel():
        raise ValueError(f"halves of {hi.numel()} elements for {flat.numel()} fp32 ones")
    for a, b in _chunks(flat.numel(), flat.device):
        pairs = _pairs(flat[a:b].to(torch.float32).contiguous())
        low = pairs[:, 0]
        hi[a:b].copy_(_high(pairs[:, 1], low))
        lo[a:b].copy_(low)
    return into


def split(x: torch.Tensor) -> Halves:
    """The halves of fp32 `x`, new tensors of its shape on its device."""
    into = Halves(
        torch.empty(x.shape, dtype=HI, device=x.device), torch.empty(x.shape, dtype=LO, device=x.device)
    )
    return split_(x, into)


@torch.no_grad()
def join_(halves: Halves, out: torch.Tensor) -> torch.Tensor:
    """Write the fp32 values `halves` hold into `out` (contiguous fp32 of their length)."""
    pairs, hi, lo = _pairs(out), halves.hi.reshape(-1).view(LO), halves.lo.reshape(-1)
    if hi.numel() != pairs.shape[0] or lo.numel() != pairs.shape[0]:
        raise ValueError(f"{hi.numel()} halves for {pairs.shape[0]} fp32 elements")
    for a, b in _chunks(pairs.shape[0], pairs.device):
        pairs[a:b, 0].copy_(lo[a:b])
        pairs[a:b, 1].copy_(_top(hi[a:b], lo[a:b]))
    return out


@torch.no_grad()
def fetch_join_(src: Halves, out: torch.Tensor, landing: Halves) -> torch.Tensor:
    """Write the fp32 values `src` holds (in host memory) into `out` (on its device), a chunk of
    `landing`'s length at a time: both halves copied into `landing` (on `out`'s device; queued on
    the current stream, so from page-locked memory the copies do not block), then joined there."""
    n, step = src.numel(), landing.numel()
    if out.numel() != n:
        raise ValueError(f"{n} halves for {out.numel()} fp32 elements")
    for a in range(0, n, step):
        b = min(n, a + step)
        stage = landing[: b - a]
        for dst, part in zip(stage, src[a:b]):
            dst.copy_(part, non_blocking=True)
        join_(stage, out[a:b])
    return out


def join(halves: Halves) -> torch.Tensor:
    """The fp32 values `halves` hold: a new tensor of their shape on their device."""
    return join_(halves, torch.empty(halves.shape, dtype=torch.float32, device=halves.hi.device))


@torch.no_grad()
def to_bf16(x: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 `x` rounded to bf16 as the halves round (`hi` alone), into `out` where given."""
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=HI, device=x.device) if out is None else out
    pairs, hi = _pairs(x), out.view(-1).view(LO)
    if hi.numel() != pairs.shape[0]:
        raise ValueError(f"{hi.numel()} bf16 elements for {pairs.shape[0]} fp32 ones")
    for a, b in _chunks(pairs.shape[0], pairs.device):
        hi[a:b].copy_(_high(pairs[a:b, 1], pairs[a:b, 0]))
    return out


def to_device(halves: Halves, device, dtype: torch.dtype, non_blocking: bool = False) -> torch.Tensor:
    """fp32 weights held as `halves` on `device` in `dtype` (bf16 or fp32): in bf16 `hi` crosses
    alone, as it is (on its own device: the view itself); in fp32 both halves, joined there."""
    if dtype == HI:
        return halves.hi.to(device, non_blocking=non_blocking)
    if dtype != torch.float32:
        raise ValueError(f"weights are fetched in bfloat16 or float32, not {dtype}")
    on = Halves(*(t.to(device, non_blocking=non_blocking) for t in halves))
    return join(on)


def cast(x: torch.Tensor | Halves, dtype: torch.dtype) -> torch.Tensor:
    """`x` (a tensor, or fp32 weights as halves) in `dtype`: bf16 from fp32 by this module's
    rounding, every other conversion as torch's `to`. The halves' `hi` is returned as it is."""
    if isinstance(x, Halves):
        return x.hi if dtype == HI else join(x).to(dtype)
    if dtype == HI and x.dtype == torch.float32:
        return to_bf16(x)
    return x.to(dtype)
