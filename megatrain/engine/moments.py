"""AdamW on moments stored in bf16 or 8 bits (host/moments.py's formats), in torch ops that run on
the CPU and on CUDA alike; the fp32 format is torch's fused kernel's (optim.py).

One step of a span of one tensor (or of tensors back to back, each starting on a block), a chunk
at a time: the moments decoded to fp32, AdamW in fp32, the weights updated from the fp32 moments,
the moments encoded again. The arithmetic is bitsandbytes' (its CPU backend's
`_optimizer_update_8bit_blockwise`, the same update as torch's AdamW):

    m = m * b1 + g * (1 - b1);  v = v * b2 + (g * (1 - b2)) * g
    p = p * (1 - lr * wd);  p = p + (m / (sqrt(v) / sqrt(1 - b2^t) + eps)) * (-lr / (1 - b1^t))

every operation one correctly rounded fp32 operation (no fused multiply-add; the square root
through fp64), so a chunk, a thread, a device, a vector or scalar loop give each element the same
bits. bf16 moments are stored rounded to nearest
even. 8-bit moments are bitsandbytes' blockwise quantisation: per BLOCK elements the absmax of the
new moment, each element divided by it and stored as the index of the nearest value of the
dynamic map (`dynamic_map`; the lower one of two as near; a block of zeros: all index 0), decoded
as that value times the absmax. Where bitsandbytes departs from that: its CPU quantiser looks the
nearest value up in a 65536-bin table (a value next to a midpoint may take the other neighbour)
and multiplies by the absmax's reciprocal; its CUDA kernel divides approximately, decays the
weights after the update, keeps exp_avg's sign in its code and steps no element whose gradient is
not finite (here the engine's check skips the whole step). docs/memory.md measures the difference.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass

import torch

from ..host.moments import BLOCK, STEP_CHUNK


def dynamic_map(signed: bool) -> torch.Tensor:
    """bitsandbytes' dynamic quantisation map (`functional.create_dynamic_map(signed)`, 7 exponent
    bits of 8): 256 sorted fp32 values in [-1, 1] (signed) or [0, 1], 0 and 1 among them."""
    data: list[float] = []
    exponents, bits = 7, 8
    extra = 2 ** (bits - 1 - exponents) - 1  # 0 for these sizes: no linear region
    for i in range(exponents):
        items = 2 ** (i + bits - 1 - exponents) + 1 if signed else 2 ** (i + bits - exponents) + 1
        edges = torch.linspace(0.1, 1, items, dtype=torch.float32)
        means = (edges[:-1] + edges[1:]) / 2.0
        data += ((10 ** (-(exponents - 1) + i)) * means).tolist()  # an fp32 multiply, as theirs
        if signed:
            data += (-(10 ** (-(exponents - 1) + i)) * means).tolist()
    assert extra == 0
    data += [0.0, 1.0]
    assert len(data) == 2**bits
    return torch.tensor(sorted(data), dtype=torch.float32)


@functools.cache
def maps(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(signed, unsigned) dynamic maps on `device`: exp_avg's and exp_avg_sq's."""
    return dynamic_map(True).to(device), dynamic_map(False).to(device)


def nearest(x: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """The index (int64) of the value of `code` (sorted) nearest each element of `x` (in [-1, 1]),
    the lower of two as near: what argmin of |x - code| gives, in fp32."""
    j = torch.searchsorted(code, x)  # the first value >= x
    lo, hi = (j - 1).clamp_(min=0), j.clamp_(max=code.numel() - 1)
    return torch.where(x - code[lo] <= code[hi] - x, lo, hi)


def quantize(x: torch.Tensor, code: torch.Tensor, codes: torch.Tensor, absmax: torch.Tensor) -> None:
    """`x` (fp32, from a block's start; a partial block only at its end) into `codes` (uint8, as
    long) and `absmax` (fp32, one a block): see the module docstring."""
    n = x.numel()
    full = n // BLOCK * BLOCK
    a = x.abs()
    if full:
        torch.amax(a[:full].view(-1, BLOCK), dim=1, out=absmax[: full // BLOCK])
    if full < n:
        absmax[full // BLOCK] = a[full:].amax()
    scale = _spread(absmax, n)
    t = torch.div(x, scale).clamp_(-1.0, 1.0)  # a block of zeros: 0/0, set below
    idx = nearest(t, code).masked_fill_(scale == 0, 0)
    codes.copy_(idx)


def dequantize(codes: torch.Tensor, absmax: torch.Tensor, code: torch.Tensor) -> torch.Tensor:
    """fp32 values of `codes` (uint8) in blocks of `absmax`: the map's value times the absmax."""
    return code[codes.long()] * _spread(absmax, codes.numel())


def _spread(absmax: torch.Tensor, n: int) -> torch.Tensor:
    """Each block's absmax for each of `n` elements."""
    return absmax.repeat_interleave(BLOCK)[:n]


@dataclass(frozen=True)
class Hyper:
    """A step's fp32 constants (Python floats, each exactly an fp32 value)."""

    b1: float
    w1: float  # 1 - beta1
    b2: float
    w2: float  # 1 - beta2
    c2: float  # sqrt(1 - beta2^t)
    eps: float
    keep: float  # 1 - lr * weight_decay
    step_size: float  # -lr / (1 - beta1^t)

    @classmethod
    def of(cls, lr: float, step: int, betas: tuple[float, float], eps: float, weight_decay: float) -> Hyper:
        b1, b2 = betas
        c1, c2 = 1 - b1 ** float(step), math.sqrt(1 - b2 ** float(step))  # doubles, then fp32
        return cls(*map(_f32, (b1, 1 - b1, b2, 1 - b2, c2, eps, 1 - lr * weight_decay, -lr / c1)))


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def step_span(
    p: torch.Tensor,
    g: torch.Tensor,
    moments: tuple[torch.Tensor, ...],
    h: Hyper,
    decay: bool,
    found_inf: torch.Tensor | None = None,
) -> None:
    """AdamW on one span: `p`, `g` fp32 of its elements, `moments` its moment buffers in
    `Moments.fields` order (exp_avg and exp_avg_sq in fp32 or bf16; or their uint8 codes, then
    their absmax of the span's blocks). A nonzero `found_inf` (a float flag on the same device)
    leaves everything as it was. Chunks of STEP_CHUNK elements, each on whole blocks."""
    quantized = len(moments) == 4
    step = STEP_CHUNK[p.device.type]
    for a in range(0, p.numel(), step):
        b = min(a + step, p.numel())
        if quantized:
            m, v, am, av = moments
            ka, kb = a // BLOCK, -(-b // BLOCK)
            chunk = (m[a:b], v[a:b], am[ka:kb], av[ka:kb])
        else:
            chunk = tuple(t[a:b] for t in moments)
        _step_chunk(p[a:b], g[a:b], chunk, h, decay, found_inf)


def _step_chunk(p, g, moments, h: Hyper, decay: bool, found_inf) -> None:
    quantized = len(moments) == 4
    if quantized:
        signed, unsigned = maps(p.device)
        m = dequantize(moments[0], moments[2], signed)
        v = dequantize(moments[1], moments[3], unsigned)
    else:
        m, v = moments[0].float(), moments[1].float()  # a copy: fp32 moments are stored after the skip
    new = update(p, g, m, v, h, decay)
    if quantized:
        out = [torch.empty_like(t) for t in moments]
        quantize(m, signed, out[0], out[2])
        quantize(v, unsigned, out[1], out[3])
    else:
        out = [m.to(moments[0].dtype), v.to(moments[1].dtype)]  # round to nearest even
    if found_inf is None:
        p.copy_(new)
        for t, o in zip(moments, out):
            t.copy_(o)
        return
    skip = found_inf != 0  # on the device: read without a wait
    torch.where(skip, p, new, out=p)
    for t, o in zip(moments, out):
        torch.where(skip, t, o, out=t)


def update(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, h: Hyper, decay: bool
) -> torch.Tensor:
    """AdamW in fp32 (the module docstring's arithmetic): `m` and `v` (decoded) become the new
    moments in place; returns the new weights (`p` is only read)."""
    m.mul_(h.b1).add_(g * h.w1)
    v.mul_(h.b2).add_((g * h.w2).mul_(g))
    # fp32's correctly rounded square root, through fp64 (exact: 53 bits > 2 x 24 + 2). torch's
    # CPU vector sqrt is not correctly rounded (a fifth of fp32 values differ by an ulp).
    d = v.double().sqrt_().float().div_(h.c2).add_(h.eps)
    new = p * h.keep if decay else p.clone()
    return new.add_(torch.div(m, d).mul_(h.step_size))


def decode_at(moments: tuple[torch.Tensor, ...], index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """exp_avg and exp_avg_sq in fp32 at elements `index` (int64) of a unit's moment buffers
    (`Moments.fields` order, bf16 or 8-bit): what the step decodes them to."""
    if len(moments) != 4:
        return moments[0][index].float(), moments[1][index].float()
    signed, unsigned = maps(index.device)
    block = index // BLOCK
    m = signed[moments[0][index].long()] * moments[2][block]
    v = unsigned[moments[1][index].long()] * moments[3][block]
    return m, v
