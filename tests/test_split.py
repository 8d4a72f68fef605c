"""The fp32 master's two halves (host/split.py): exact for every fp32 bit pattern, `hi` the
rounding half away from zero, which differs from torch's round-to-nearest-even cast only at ties.

The rule reads an fp32's high half and only the sign bit of its low half, and keeps the low half
as it is (checked here for every low half), so every high half crossed with low halves of both
signs, their extremes among them, is every case of the rule: 2^16 x 256 patterns.
"""

from __future__ import annotations

import pytest
import torch

from megatrain.host import split as S

LARGEST_HALF_AWAY = 0x7F7F8000  # the first magnitude whose rounding half away from zero is inf


def patterns() -> torch.Tensor:
    """Every high half crossed with 256 low halves (the first 64, 64 either side of the sign
    bit's flip, the last 64), as int32 fp32 bits."""
    tops = torch.arange(1 << 16, dtype=torch.int64)
    lows = torch.cat(
        [torch.arange(0, 64), torch.arange(0x8000 - 64, 0x8000 + 64), torch.arange(0xFFC0, 0x10000)]
    )
    bits = ((tops[:, None] << 16) | lows[None, :]).reshape(-1)
    return torch.where(bits >= 1 << 31, bits - (1 << 32), bits).to(torch.int32)


@pytest.fixture(scope="module")
def cases():
    bits = patterns()
    x = bits.view(torch.float32)
    return bits, x, S.split(x)


def test_every_pattern_round_trips_and_the_low_half_is_kept(cases):
    bits, x, halves = cases
    assert torch.equal(S.join(halves).view(torch.int32), bits)
    assert torch.equal(
        halves.lo, (bits & 0xFFFF).to(torch.int32).sub(0x10000 * ((bits & 0x8000) != 0)).to(torch.int16)
    )
    # every low half passes through as it is, whatever the high half
    lows = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int16)
    for top in (0x0000, 0x3F80, 0x7F7F, 0x7F80, 0x7FC0, 0x8000, 0xFF7F, 0xFFFF):
        word = torch.stack([lows, torch.full_like(lows, top - (1 << 16) if top >= 1 << 15 else top)], -1)
        y = word.view(torch.float32).view(-1)
        h = S.split(y)
        assert torch.equal(h.lo, lows) and torch.equal(S.join(h).view(torch.int32), y.view(torch.int32))


def test_hi_is_the_rounding_half_away_from_zero(cases):
    bits, x, halves = cases
    b = bits.to(torch.int64)
    sign, mag = b & (1 << 31), b & 0x7FFFFFFF
    away = sign >> 16 | (mag + 0x8000) >> 16  # on the magnitude, the sign kept
    hi = halves.hi.view(torch.int16).to(torch.int64) & 0xFFFF
    below = mag < LARGEST_HALF_AWAY
    assert torch.equal(hi[below], away[below])
    assert torch.equal(S.to_bf16(x).view(torch.int16), halves.hi.view(torch.int16))
    assert torch.equal(S.cast(x, torch.bfloat16).view(torch.int16), halves.hi.view(torch.int16))


def test_hi_differs_from_round_to_nearest_even_only_at_ties(cases):
    bits, x, halves = cases
    mag = bits.to(torch.int64) & 0x7FFFFFFF
    finite = mag < LARGEST_HALF_AWAY
    rne = x.to(torch.bfloat16).view(torch.int16)
    differ = (halves.hi.view(torch.int16) != rne) & finite
    tie = (bits & 0xFFFF) == 0x8000
    even = ((bits >> 16) & 1) == 0
    # exactly the ties that round to nearest even rounds down (an even high half)
    assert torch.equal(differ, finite & tie & even)
    assert differ.any()
    assert (halves.hi[differ].float().abs() > rne[differ].view(torch.bfloat16).float().abs()).all()


def test_finite_stays_finite_and_non_finite_stays_non_finite(cases):
    bits, x, halves = cases
    hi = halves.hi.float()
    assert torch.equal(torch.isfinite(hi), torch.isfinite(x))
    mag = bits.to(torch.int64) & 0x7FFFFFFF
    top = (mag >= LARGEST_HALF_AWAY) & torch.isfinite(x)
    assert top.any() and (hi[top] == 0).all()  # the zeros' spare half holds them
    assert torch.equal(torch.signbit(hi), torch.signbit(x))
    nan = x.isnan() & ((mag >> 16) > 0x7F80)  # a NaN with payload in its high half stays a NaN
    assert nan.any() and hi[nan].isnan().all()
    assert (hi[x.isinf()] == x[x.isinf()]).all()


def test_halves_write_into_views_and_refuse_other_shapes():
    x = torch.randn(3, 64)
    into = S.Halves(torch.empty(192, dtype=torch.bfloat16), torch.empty(192, dtype=torch.int16))
    S.split_(x.view(-1), into)
    out = torch.empty(3, 64)
    S.join_(into.view(3, 64), out)
    assert torch.equal(out, x) and S.join(into[64:128]).equal(x[1])
    with pytest.raises(ValueError, match="halves of 192 elements for 64"):
        S.split_(x[0], into)
    with pytest.raises(ValueError, match="made from float32, not torch.int64"):
        S.split(torch.arange(3))
    assert torch.equal(S.join(S.split(x.t())), x.t())  # any layout, any float dtype, made fp32
    assert torch.equal(S.join(S.split(x.to(torch.bfloat16))), x.to(torch.bfloat16).float())


def test_cast_of_halves_and_of_other_dtypes():
    x = torch.randn(257)
    h = S.split(x)
    assert S.cast(h, torch.bfloat16) is h.hi
    assert torch.equal(S.cast(h, torch.float32), x)
    assert torch.equal(S.cast(x, torch.float32), x)
    assert torch.equal(S.cast(x.to(torch.bfloat16), torch.float32), x.to(torch.bfloat16).float())
    assert torch.equal(
        S.split(x.to(torch.bfloat16).float()).hi, x.to(torch.bfloat16)
    )  # a bf16 weight is its own hi
