"""AdamW on bf16 and 8-bit moments on CUDA in one pass over each element: a Triton kernel with
engine/moments.py's arithmetic, operation for operation.

engine/moments.py's torch ops make some forty passes over memory and as many launches for each
chunk of a million elements: on GPU-resident state they are bound by the thread that launches
them (10.4 s a step of 14.8B parameters with 8-bit moments on one H200, against 0.08 s for the
state's bytes at the GPU's rate). This kernel reads a block's moments, steps its weights and
writes the moments again in one pass. Every operation is one IEEE rounding: no contraction into
fused multiply-adds (`enable_fp_fusion=False`), the correctly rounded division and square root
(`div_rn`, `sqrt_rn`: fp64's square root rounded to fp32 is the same bits); the map's nearest
value by the host kernel's table on the quotient's top 16 bits (one load, one comparison); an
absmax and a clamp that keep NaN: the bits of the torch ops on the CPU, and so of the host's
kernel (on CUDA the torch ops divide by a scalar through its reciprocal). That they are is
checked when the kernel is first asked for on a device (`load`: momentkernel.py's cases, a
skipped step), else the torch ops step.
"""

from __future__ import annotations

import functools
import logging

import torch

from ..errors import first_line
from ..host.moments import BLOCK
from . import moments as low
from .clipadam import Unavailable
from .momentkernel import check_cases, lookup, same_bits

log = logging.getLogger(__name__)

ROWS = 8  # blocks of BLOCK elements a program steps: 2,048 elements

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU build of torch comes without it
    triton = None

if triton is not None:

    @triton.jit
    def _nearest(x, look):
        """The index (int32) of the dynamic map's value nearest each of `x` (in [-1, 1], or NaN),
        the lower of two as near: moments.py's `nearest`, by the host kernel's table
        (momentkernel.py's `lookup`: on x's top 16 bits the count of the map's edges below them
        and the low 16 bits of the one edge among their values) in one load and one comparison."""
        u = x.to(tl.uint32, bitcast=True)
        e = tl.load(look + (u >> 16)).to(tl.uint32, bitcast=True)
        # a negative value's low bits order magnitudes: flipped, they order values
        flip = (x.to(tl.int32, bitcast=True) >> 31).to(tl.uint32, bitcast=True)
        key = (u ^ flip) & 0xFFFF
        return (e & 0xFF).to(tl.int32) + (key > (e >> 8)).to(tl.int32)

    @triton.jit
    def _encode(x, mask, look, codes_ptr, absmax_ptr, offs, rows):
        """moments.py's `quantize` of a tile [ROWS, BLOCK] (its masked elements left out)."""
        a = tl.where(mask, tl.abs(x), 0.0)
        nan = tl.max(tl.where(a != a, 1, 0), axis=1) > 0  # amax keeps NaN; tl.max does not
        absmax = tl.where(nan, float("nan"), tl.max(a, axis=1))
        tl.store(absmax_ptr + rows, absmax, mask=tl.max(mask.to(tl.int32), axis=1) > 0)
        scale = absmax[:, None]
        t = tl.math.div_rn(x, scale)
        t = tl.where(t > 1.0, 1.0, tl.where(t < -1.0, -1.0, t))  # a clamp that keeps NaN
        idx = tl.where(scale == 0.0, 0, _nearest(t, look))
        tl.store(codes_ptr + offs, idx.to(tl.uint8), mask=mask)

    @triton.jit
    def _step_kernel(
        p_ptr, g_ptr, m_ptr, v_ptr, am_ptr, av_ptr, signed_ptr, unsigned_ptr, look_s_ptr, look_u_ptr,
        skip_ptr, n,
        b1, w1, b2, w2, c2, eps, keep, step_size,
        QUANTIZED: tl.constexpr, DECAY: tl.constexpr, SKIP: tl.constexpr, ROWS: tl.constexpr,
        BLOCK: tl.constexpr,
    ):  # fmt: skip
        if SKIP:  # noqa: SIM102 (a constexpr branch, then a loaded flag)
            if tl.load(skip_ptr) != 0:
                return
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        offs = rows[:, None] * BLOCK + tl.arange(0, BLOCK)[None, :]
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0)
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        if QUANTIZED:
            m = tl.load(signed_ptr + tl.load(m_ptr + offs, mask=mask, other=0).to(tl.int32))
            m = m * tl.load(am_ptr + rows, mask=rows * BLOCK < n, other=0.0)[:, None]
            v = tl.load(unsigned_ptr + tl.load(v_ptr + offs, mask=mask, other=0).to(tl.int32))
            v = v * tl.load(av_ptr + rows, mask=rows * BLOCK < n, other=0.0)[:, None]
        else:
            m = tl.load(m_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            v = tl.load(v_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        m = m * b1 + g * w1
        v = v * b2 + (g * w2) * g
        d = tl.math.div_rn(tl.math.sqrt_rn(v), c2) + eps
        if DECAY:
            p = p * keep
        p = p + tl.math.div_rn(m, d) * step_size
        tl.store(p_ptr + offs, p, mask=mask)
        if QUANTIZED:
            _encode(m, mask, look_s_ptr, m_ptr, am_ptr, offs, rows)
            _encode(v, mask, look_u_ptr, v_ptr, av_ptr, offs, rows)
        else:
            tl.store(m_ptr + offs, m.to(tl.bfloat16), mask=mask)
            tl.store(v_ptr + offs, v.to(tl.bfloat16), mask=mask)


def step(
    p: torch.Tensor,
    g: torch.Tensor,
    moments: tuple[torch.Tensor, ...],
    h: low.Hyper,
    decay: bool,
    found_inf: torch.Tensor | None = None,
) -> None:
    """moments.py's `step_span` on CUDA tensors (contiguous; 8-bit spans from a block's start) in
    one launch."""
    n = p.numel()
    quantized = len(moments) == 4
    if quantized:
        m, v, am, av = moments
        signed, unsigned, look_s, look_u = _tables(p.device)
    else:
        (m, v), am, av = moments, p, p  # unread
        signed = unsigned = look_s = look_u = p
    skip = found_inf if found_inf is not None else p
    grid = (triton.cdiv(n, ROWS * BLOCK),)
    _step_kernel[grid](
        p, g, m, v, am, av, signed, unsigned, look_s, look_u, skip, n,
        h.b1, h.w1, h.b2, h.w2, h.c2, h.eps, h.keep, h.step_size,
        QUANTIZED=quantized, DECAY=decay, SKIP=found_inf is not None, ROWS=ROWS, BLOCK=BLOCK,
        enable_fp_fusion=False,
    )  # fmt: skip


@functools.cache
def _tables(device: torch.device) -> tuple[torch.Tensor, ...]:
    """The dynamic maps (exp_avg's, exp_avg_sq's) and their lookup tables, on `device`."""
    signed, unsigned = low.maps(torch.device("cpu"))
    return tuple(t.to(device) for t in (signed, unsigned, lookup(signed), lookup(unsigned)))


def check(device: torch.device) -> None:
    """Raise Unavailable unless `step` on `device` gives the bits the torch ops give on the CPU (a
    NaN a NaN; on CUDA they divide by a scalar through its reciprocal, so they may round apart):
    momentkernel.py's cases (every kind of span end, decay and none, zero moments, huge and tiny
    values, both formats, three steps; the gradient scaled first, as `clip_scaled` does), and a
    step that a nonzero flag skips."""
    for n, q8, decay, p, state, steps in check_cases():
        ours = [t.to(device) for t in (p, *state)]
        theirs = [p.clone(), *(t.clone() for t in state)]
        for g, coef, h in steps:
            if coef is not None:  # optim.py's clip_scaled
                g = g * torch.tensor(coef)
            step(ours[0], g.to(device), tuple(ours[1:]), h, decay)
            low.step_span(theirs[0], g, tuple(theirs[1:]), h, decay)
        before = [t.clone() for t in ours]
        step(ours[0], g.to(device), tuple(ours[1:]), h, decay, torch.ones((), device=device))
        if not all(same_bits(a.cpu(), b.cpu()) for a, b in zip(ours + ours, theirs + before)):
            raise Unavailable(
                f"its results differ from the torch ops' on the CPU ({n} elements, "
                f"{'8-bit' if q8 else 'bf16'}, weight decay {decay})"
            )


_LOADED: dict[torch.device, tuple[bool, str]] = {}


def load(device: torch.device) -> tuple[bool, str]:
    """Whether the kernel steps on CUDA `device` (Triton there, compiled and checked once a
    process and device), and why not."""
    device = torch.device(device)
    if device not in _LOADED:
        try:
            if triton is None:
                raise Unavailable("Triton is not installed")
            check(device)
            _LOADED[device] = (True, "compiled and equal to the torch ops here")
        except Exception as e:  # Unavailable, or whatever a Triton that cannot build it raises
            why = str(e) if isinstance(e, Unavailable) else f"Triton failed: {first_line(e)}"
            _LOADED[device] = (False, why)
            log.warning(
                "AdamW of bf16 and 8-bit moments on %s: the torch ops step them, a pass an operation (%s)",
                device,
                why,
            )
    return _LOADED[device]
