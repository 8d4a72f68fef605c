"""The host's AdamW on bf16 and 8-bit moments in one pass over each element: a C kernel with
engine/moments.py's arithmetic, operation for operation.

engine/moments.py's torch ops are the arithmetic (and run it on CUDA); on the CPU they make a pass
over memory per operation and a parallel region per chunk, 12-25x slower than torch's fused fp32
kernel. This kernel decodes a block's moments, steps its weights and encodes the moments again in
one pass, on threads that take blocks from a shared counter (as clipadam.py's do). The weights are
fp32 or the master's halves (`step_halves`: joined and split in-register by clipadam.py's rule,
as its kernel does, so the host pass makes no fp32 copy of them), and the gradient is multiplied
by the clip coefficient as it is read. Every operation is one IEEE rounding in both (compiled
without contraction), so the results are the same bits; whether they are here is checked when
the kernel is first asked for (`check`: both forms of the weights, every kind of block end, decay
and none, a clip and none, zero and huge moments, several threads), else `load` says why and the
host steps with the torch ops on fp32 made from the halves. The nearest value of the dynamic map
is one load from a table on each value's top 16 bits and one comparison of its low 16 (`lookup`):
the index torch's searchsorted gives, exactly. Where the CPU has AVX-512, a block's decode and
encode run 16 elements at a time through 32-bit gathers (the compiler's own loops gathered 4 at a
time through 64-bit indices), the update in the compiler's vector loop between them, the absmax
taken in that loop: 2.4x the rate of 64-bit-indexed gathers on one core (bench/results'
optim-modes runs give the rates beside fp32's). How fast it runs beside fp32's depends on the
host (bound by its cores on a few, by memory like fp32's on many): the plan times its pass here
(`rate`).
"""

from __future__ import annotations

import ctypes
import logging
import math
import platform

import torch

from ..host.moments import BF16, BLOCK, Q8, Moments
from ..host.split import Halves, split
from ..planning.probe import best_pass
from . import moments as low
from .cbuild import Unavailable, build
from .clipadam import HALVES, check_halves
from .osthreads import OptimizerThreads

log = logging.getLogger(__name__)

MIN_PER_THREAD = 1 << 16  # elements a thread is given at least (clipadam's figure)
TAKE = 256  # blocks a thread takes from the shared counter at a time: 64K elements
# Vector loops of the machine's widest registers where it has 512-bit ones (the compiler's default
# for these targets is 256): 1.3-2x this kernel's rate; no result changes (no sum is reordered).
WIDE = ("-mprefer-vector-width=512",) if platform.machine().lower() in ("x86_64", "amd64") else ()

SOURCE = (
    HALVES
    + r"""
#include <math.h>

typedef struct { float b1, w1, b2, w2, c2, eps, keep, step_size, coef; int decay, scale; } hyper;

/* A span's weights: fp32 `p`, or the master's halves `hi` and `lo`, joined as they are read and
   split as they are written (clipadam.py's rule, `HALVES`). */
typedef struct { float *p; uint16_t *hi, *lo; } weights;

#define INLINE static inline __attribute__((always_inline))

static inline uint16_t to_bf16(float x) {  /* round to nearest even, as torch's cast */
    if (isnan(x)) return 0x7FC0;
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

static inline float from_bf16(uint16_t b) {
    uint32_t u = (uint32_t)b << 16;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline uint32_t bits(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

/* `halves` a constant where these are inlined: a loop of its own for each form. */
INLINE float load(weights w, int64_t i, int halves) { return halves ? join(w.hi[i], w.lo[i]) : w.p[i]; }

INLINE void store(weights w, int64_t i, float x, int halves) {
    if (halves) {
        w.hi[i] = high(x);
        w.lo[i] = (uint16_t)bits(x);
    } else {
        w.p[i] = x;
    }
}

/* engine/moments.py's `update`, one rounding an operation, the gradient first times the clip
   coefficient (optim.py's `clip_scaled`: one fp32 multiply): the new weight; the moments in place. */
static inline float adamw(float p, float g, float *m, float *v, const hyper *h) {
    g = h->scale ? g * h->coef : g;
    float mm = *m * h->b1, t = g * h->w1;
    mm = mm + t;
    float vv = *v * h->b2, u = g * h->w2;
    u = u * g;
    vv = vv + u;
    float d = sqrtf(vv);
    d = d / h->c2;
    d = d + h->eps;
    float q = h->decay ? p * h->keep : p;
    float r = mm / d;
    r = r * h->step_size;
    *m = mm;
    *v = vv;
    return q + r;
}

/* The index torch's `nearest` gives for x in [-1, 1] or NaN (searchsorted, then the nearer of two
   neighbours): the number of edges below x, where edge[j] is the largest float that the nearer
   of values j and j + 1 takes to j (edge[255]: infinity). look[top 16 bits of x] holds, in its
   low 8 bits, how many edges lie below the floats with those bits, and above them the low 16 bits
   of the one edge among them (at most one lies there: `lookup` checks), in the order of x's low
   16 bits (reversed for a negative x: its bits order magnitudes) or 0xFFFF for none; NaN's: 255.
   One load and one comparison. */
static inline uint8_t nearest(float x, const uint32_t *look) {
    uint32_t u = bits(x), e = look[u >> 16];
    uint32_t key = (u ^ (uint32_t)((int32_t)u >> 31)) & 0xFFFFu;
    return (uint8_t)((e & 0xFFu) + (key > (e >> 8)));
}

static inline float clamp1(float x) { return x < -1.0f ? -1.0f : (x > 1.0f ? 1.0f : x); }

#ifdef __AVX512F__
#include <immintrin.h>
#define LANES 16
/* The loops below 16 elements at a time where the compiler's vector loops would gather through
   64-bit indices, 4 at a time: the same operations, each lane an IEEE operation as the scalar's. */
static inline int64_t decode_vec(const uint8_t *restrict c, float scale, const float *restrict code,
                                 float *restrict x, int64_t n) {
    int64_t i = 0;
    __m512 s = _mm512_set1_ps(scale);
    for (; i + LANES <= n; i += LANES) {
        __m512i k = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(c + i)));
        _mm512_storeu_ps(x + i, _mm512_mul_ps(_mm512_i32gather_ps(k, code, 4), s));
    }
    return i;
}

static inline int64_t encode_vec(const float *restrict x, float a, uint8_t *restrict codes,
                                 const uint32_t *restrict look, int64_t n) {
    int64_t i = 0;
    const __m512 va = _mm512_set1_ps(a), one = _mm512_set1_ps(1.0f), minus = _mm512_set1_ps(-1.0f);
    const __m512i low = _mm512_set1_epi32(0xFFFF), byte = _mm512_set1_epi32(0xFF), inc = _mm512_set1_epi32(1);
    for (; i + LANES <= n; i += LANES) {
        /* max(-1, y), min(1, y): y where y is NaN, as clamp1 */
        __m512 y = _mm512_min_ps(one, _mm512_max_ps(minus, _mm512_div_ps(_mm512_loadu_ps(x + i), va)));
        __m512i u = _mm512_castps_si512(y);
        __m512i e = _mm512_i32gather_epi32(_mm512_srli_epi32(u, 16), (const int *)look, 4);
        __m512i key = _mm512_and_si512(_mm512_xor_si512(u, _mm512_srai_epi32(u, 31)), low);
        __mmask16 up = _mm512_cmpgt_epu32_mask(key, _mm512_srli_epi32(e, 8));
        __m512i j = _mm512_and_si512(e, byte);
        _mm_storeu_si128((__m128i *)(codes + i), _mm512_cvtepi32_epi8(_mm512_mask_add_epi32(j, up, j, inc)));
    }
    return i;
}
#else
static inline int64_t decode_vec(const uint8_t *c, float scale, const float *code, float *x, int64_t n) {
    return 0;
}
static inline int64_t encode_vec(const float *x, float a, uint8_t *codes, const uint32_t *look, int64_t n) {
    return 0;
}
#endif

/* A block's codes `c` of absmax `scale` decoded into x. */
static inline void decode(const uint8_t *restrict c, float scale, const float *restrict code,
                          float *restrict x, int64_t n) {
    for (int64_t i = decode_vec(c, scale, code, x, n); i < n; i++) x[i] = code[c[i]] * scale;
}

/* x's codes into `codes` and its absmax (`top`: the largest bit pattern of |x|, the order of
   non-negative floats, a NaN's above infinity's: NaN-propagating as torch's amax) into *absmax. */
static inline void encode(const float *restrict x, int64_t n, uint32_t top, uint8_t *restrict codes,
                          float *absmax, const uint32_t *restrict look) {
    float a;
    memcpy(&a, &top, sizeof a);
    *absmax = a;
    if (a == 0.0f) {
        memset(codes, 0, (size_t)n);
        return;
    }
    for (int64_t i = encode_vec(x, a, codes, look, n); i < n; i++) codes[i] = nearest(clamp1(x[i] / a), look);
}

INLINE void q8_blocks(weights w, const float *restrict g, uint8_t *restrict cm, uint8_t *restrict cv,
                      float *restrict am, float *restrict av, int64_t n, int64_t *next, int64_t take,
                      const hyper *h, const float *restrict signed_code,
                      const float *restrict unsigned_code, const uint32_t *restrict signed_look,
                      const uint32_t *restrict unsigned_look, int halves) {
    int64_t blocks = (n + 255) / 256;
    float m[256], v[256];
    const hyper hh = *h;
    for (;;) {
        int64_t k0 = __atomic_fetch_add(next, take, __ATOMIC_RELAXED);
        if (k0 >= blocks) return;
        int64_t k1 = k0 + take < blocks ? k0 + take : blocks;
        for (int64_t k = k0; k < k1; k++) {
            int64_t a = k * 256, e = a + 256 < n ? a + 256 : n, len = e - a;
            decode(cm + a, am[k], signed_code, m, len);
            decode(cv + a, av[k], unsigned_code, v, len);
            uint32_t tm = 0, tv = 0;
            for (int64_t i = 0; i < len; i++) {
                float mm = m[i], vv = v[i];
                store(w, a + i, adamw(load(w, a + i, halves), g[a + i], &mm, &vv, &hh), halves);
                m[i] = mm;
                v[i] = vv;
                uint32_t bm = bits(mm) & 0x7FFFFFFFu, bv = bits(vv) & 0x7FFFFFFFu;
                tm = bm > tm ? bm : tm;
                tv = bv > tv ? bv : tv;
            }
            encode(m, len, tm, cm + a, am + k, signed_look);
            encode(v, len, tv, cv + a, av + k, unsigned_look);
        }
    }
}

/* Blocks of a span of n elements (8-bit moments), `take` at a time from *next; the weights fp32
   `p`, or the halves `hi` and `lo` where `hi` is given. */
void q8_span(float *p, uint16_t *hi, uint16_t *lo, const float *g, uint8_t *cm, uint8_t *cv,
             float *am, float *av, int64_t n, int64_t *next, int64_t take, const hyper *h,
             const float *signed_code, const float *unsigned_code, const uint32_t *signed_look,
             const uint32_t *unsigned_look) {
    weights w = {p, hi, lo};
    if (hi)
        q8_blocks(w, g, cm, cv, am, av, n, next, take, h, signed_code, unsigned_code, signed_look,
                  unsigned_look, 1);
    else
        q8_blocks(w, g, cm, cv, am, av, n, next, take, h, signed_code, unsigned_code, signed_look,
                  unsigned_look, 0);
}

INLINE void bf16_elements(weights w, const float *restrict g, uint16_t *restrict m,
                          uint16_t *restrict v, int64_t n, int64_t *next, int64_t take,
                          const hyper *h, int halves) {
    const hyper hh = *h;
    for (;;) {
        int64_t a = __atomic_fetch_add(next, take * 256, __ATOMIC_RELAXED);
        if (a >= n) return;
        int64_t e = a + take * 256 < n ? a + take * 256 : n;
        for (int64_t i = a; i < e; i++) {
            float mm = from_bf16(m[i]), vv = from_bf16(v[i]);
            store(w, i, adamw(load(w, i, halves), g[i], &mm, &vv, &hh), halves);
            m[i] = to_bf16(mm);
            v[i] = to_bf16(vv);
        }
    }
}

/* Elements of a span of n elements (bf16 moments), `take` * 256 at a time from *next; the
   weights as `q8_span`'s. */
void bf16_span(float *p, uint16_t *hi, uint16_t *lo, const float *g, uint16_t *m, uint16_t *v,
               int64_t n, int64_t *next, int64_t take, const hyper *h) {
    weights w = {p, hi, lo};
    if (hi)
        bf16_elements(w, g, m, v, n, next, take, h, 1);
    else
        bf16_elements(w, g, m, v, n, next, take, h, 0);
}
"""
)


class _Hyper(ctypes.Structure):
    _fields_ = [
        *((k, ctypes.c_float) for k in ("b1", "w1", "b2", "w2", "c2", "eps", "keep", "step_size", "coef")),
        *((k, ctypes.c_int) for k in ("decay", "scale")),
    ]


def edges(code: torch.Tensor) -> torch.Tensor:
    """edge[j]: the largest fp32 value x in [code[j], code[j + 1]) whose nearer of the two (in
    fp32: x - code[j] <= code[j + 1] - x, ties to the lower) is j; edge[255] = infinity. The
    choice is monotone in x: a bisection over the floats between the two, in their order (the
    bit patterns as sign and magnitude), finds it, all pairs at once."""
    a, b = code[:-1], code[1:]
    lo, hi = _key(a), _key(b)  # lo takes j, hi takes j + 1
    while bool((hi - lo > 1).any()):
        mid = (lo + hi) // 2
        x = _float(mid)
        lower = (x - a) <= (b - x)
        lo, hi = torch.where(lower, mid, lo), torch.where(lower, hi, mid)
    return torch.cat([_float(lo), torch.tensor([math.inf])])


def _key(x: torch.Tensor) -> torch.Tensor:
    """fp32 values as int64 keys in their order (-0 and 0 alike)."""
    bits = x.view(torch.int32).to(torch.int64)
    return torch.where(bits < 0, -(bits & 0x7FFFFFFF), bits)


def _float(k: torch.Tensor) -> torch.Tensor:
    return torch.where(k < 0, (-k) | (1 << 31), k).to(torch.int32).view(torch.float32)


def lookup(code: torch.Tensor) -> torch.Tensor:
    """The kernel's table for `nearest` (the C comment's `look`): for each 16-bit prefix of an fp32
    value, how many `edges(code)` lie below the least value with that prefix (NaN's: 255), and
    above it the low 16 bits of the edge among its values, in the order of the values' low bits
    (flipped for a negative prefix, whose bits order magnitudes), or 0xFFFF where none lies there.
    Unavailable unless at most one edge lies among the values of a prefix in [-1, 1], and the
    table's count equals `edge`'s at every prefix's least and largest value and at its edge and
    the float above it: the count is monotone in x within a prefix and steps only at its edge, so
    that settles every value of [-1, 1]."""
    edge = edges(code)
    prefix = torch.arange(1 << 16, dtype=torch.int64)
    negative = prefix >= 1 << 15  # a negative prefix's least value has its largest magnitude
    least = _float32((prefix << 16) | torch.where(negative, 0xFFFF, 0))
    most = _float32((prefix << 16) | torch.where(negative, 0, 0xFFFF))
    start = _below(edge, least)
    inside = _below(edge, most) - start  # edges in [least, most)
    ranged = (least.abs() <= 1) & (most.abs() <= 1)
    if (inside[ranged] > 1).any():
        raise Unavailable("two edges of the dynamic map lie within one 16-bit prefix")
    low = edge[start.clamp(max=254)].view(torch.int32).to(torch.int64) & 0xFFFF
    at = torch.where(negative, 0xFFFF ^ low, low)
    look = (start | torch.where(ranged & (inside == 1), at, 0xFFFF) << 8).to(torch.int32)
    inner = edge[start[ranged & (inside == 1)]]
    x = torch.cat([least, most, inner, inner.nextafter(torch.tensor(math.inf)), torch.tensor([-1.0, 1.0])])
    x = x[(x.abs() <= 1) | x.isnan()]
    if not torch.equal(_nearest(look, x), _below(edge, x)):
        raise Unavailable("the lookup table's count differs from the dynamic map's")
    return look


def _float32(bits: torch.Tensor) -> torch.Tensor:
    return bits.to(torch.int32).view(torch.float32)


def _below(edge: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """How many of `edge` lie below each x, 255 at most; NaN: 255 (torch's `nearest`: the last)."""
    return torch.searchsorted(edge, torch.nan_to_num(x, nan=2.0)).clamp_(max=255)


def _nearest(look: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The C `nearest`'s count of x (fp32) from `look`, in int64."""
    u = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    e = look.to(torch.int64)[u >> 16] & 0xFFFFFFFF
    key = (u ^ torch.where(u >> 31 == 1, 0xFFFF, 0)) & 0xFFFF
    return (e & 0xFF) + (key > e >> 8).long()


class MomentKernel:
    """The built kernel; `step` (fp32 weights) and `step_halves` run it over one span on the given
    threads."""

    def __init__(self):
        self._lib = build(SOURCE, "moments", WIDE)
        ptr, i64 = ctypes.c_void_p, ctypes.c_int64
        self._lib.q8_span.argtypes = [ptr] * 8 + [i64, ptr, i64, ptr] + [ptr] * 4
        self._lib.bf16_span.argtypes = [ptr] * 6 + [i64, ptr, i64, ptr]
        self._lib.q8_span.restype = self._lib.bf16_span.restype = None
        signed, unsigned = (low.dynamic_map(s) for s in (True, False))
        self._tables = (signed, unsigned, lookup(signed), lookup(unsigned))
        self._threads = OptimizerThreads("megatrain-moments")

    def step(
        self,
        p: torch.Tensor,
        g: torch.Tensor,
        moments: tuple[torch.Tensor, ...],
        h: low.Hyper,
        decay: bool,
        threads: int = 1,
        coef: float | None = None,
    ) -> None:
        """engine/moments.py's `step_span` (on contiguous host tensors, no skip flag) of fp32
        weights `p`, the gradient times `coef` first (an fp32 value, as `clip_scaled` multiplies;
        None: as it is; `g` is left as it was)."""
        self._span((p.data_ptr(), None, None), g, moments, h, decay, threads, coef)

    def step_halves(
        self,
        p: Halves,
        g: torch.Tensor,
        moments: tuple[torch.Tensor, ...],
        h: low.Hyper,
        decay: bool,
        threads: int = 1,
        coef: float | None = None,
    ) -> None:
        """`step` of weights held as the fp32 master's halves (host/split.py), read and written in
        the pass: no fp32 copy made of them, none split back."""
        check_halves(p, g.numel())
        self._span((None, p.hi.data_ptr(), p.lo.data_ptr()), g, moments, h, decay, threads, coef)

    def _span(self, weights: tuple, g, moments, h: low.Hyper, decay: bool, threads: int, coef) -> None:
        n = g.numel()
        c = 1.0 if coef is None else coef
        hyper = _Hyper(
            h.b1, h.w1, h.b2, h.w2, h.c2, h.eps, h.keep, h.step_size, c, int(decay), int(coef is not None)
        )
        taken = ctypes.c_int64(0)
        head = [*weights, g.data_ptr(), *(t.data_ptr() for t in moments)]
        tail = (n, ctypes.addressof(taken), TAKE, ctypes.byref(hyper))
        if len(moments) == 4:
            fn, args = self._lib.q8_span, (*head, *tail, *(t.data_ptr() for t in self._tables))
        elif all(t.dtype == torch.bfloat16 for t in moments):
            fn, args = self._lib.bf16_span, (*head, *tail)
        else:
            raise ValueError("the kernel steps 8-bit moments or two bf16 moments")
        self._threads.run(max(1, min(threads, n // MIN_PER_THREAD)), fn, *args)


def check_cases(device: str | torch.device = "cpu"):
    """The kernels' self-checks' cases, on `device`: (n, q8, decay, p, state, steps) for spans of
    every kind of end (one element, a block less one, whole blocks, partial blocks over several
    threads' takes), 8-bit moments and bf16 (`q8`), weight decay and none; fp32 weights `p` with
    the halves' special cases among them, zero moments `state` (`Moments.fields` order), and three
    steps `steps` of (gradient, clip coefficient or None, constants): a block of zero moments after
    a step, a gradient whose square is near fp32's largest beside tiny ones."""
    gen = torch.Generator().manual_seed(0)
    patterns = (0x7F7FFFFF, 0xFF7F8000, 0x7F7F7FFF, 0x00008000)  # fp32 bits, as int32 below
    special = torch.tensor([b - (b >> 31 << 32) for b in patterns], dtype=torch.int32).view(torch.float32)
    for n in (1, 255, 256, 1000, 3 * TAKE * BLOCK + 77):
        for decay in (True, False):
            for q8 in (True, False):
                p = torch.randn(n, generator=gen) * 0.02
                k = min(n, len(special))  # bf16 half a zero; the largest below them; a subnormal
                p[:k] = special[:k]
                if q8:
                    state = [torch.zeros(n, dtype=torch.uint8) for _ in "mv"]
                    state += [torch.zeros(-(-n // BLOCK)) for _ in "mv"]
                else:
                    state = [torch.zeros(n, dtype=torch.bfloat16) for _ in "mv"]
                steps = []
                for step, coef in ((1, None), (2, 0.37), (3, 0.61)):
                    g = torch.randn(n, generator=gen) * 1e-2
                    if step == 2:
                        g[:300] = 0.0
                    if step == 3:
                        g[n // 2] = 4e18
                    h = low.Hyper.of(1e-3, step, (0.9, 0.95), 1e-8, 0.1 if decay else 0.0)
                    steps.append((g.to(device), coef, h))
                yield n, q8, decay, p.to(device), [t.to(device) for t in state], steps


def check(kernel: MomentKernel) -> None:
    """Raise Unavailable unless the kernel's results equal the torch ops' bit for bit (a NaN a
    NaN) in `check_cases`, of fp32 weights and of the master's halves (`step_halves`: split.py's
    halves of the torch ops' weights), the gradient as it is and times two clip coefficients."""
    for n, q8, decay, p, st, steps in check_cases():
        ours, theirs = [p.clone(), *(t.clone() for t in st)], [p.clone(), *(t.clone() for t in st)]
        halves = [split(p), *(t.clone() for t in st)]
        for g, coef, h in steps:
            kernel.step(ours[0], g, tuple(ours[1:]), h, decay, threads=2, coef=coef)
            kernel.step_halves(halves[0], g, tuple(halves[1:]), h, decay, threads=2, coef=coef)
            scaled = g if coef is None else g * torch.tensor(coef)  # optim.py's clip_scaled
            low.step_span(theirs[0], scaled, tuple(theirs[1:]), h, decay)
        want = split(theirs[0])
        bits = [(t.hi.view(torch.int16), t.lo) for t in (halves[0], want)]
        if not (
            all(same_bits(a, b) for a, b in zip(ours, theirs))
            and all(same_bits(a, b) for a, b in zip((*bits[0], *halves[1:]), (*bits[1], *theirs[1:])))
        ):
            raise Unavailable(
                f"its results differ from the torch ops' here ({n} elements, {'8-bit' if q8 else 'bf16'}, "
                f"weight decay {decay})"
            )


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two tensors hold the same bits (any NaN equal to any NaN)."""
    if a.is_floating_point() and a.isnan().any():
        nan = a.isnan()
        return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])
    view = {4: torch.int32, 2: torch.int16, 1: torch.uint8}[a.element_size()]
    return torch.equal(a.view(view), b.view(view))


_LOADED: tuple[MomentKernel | None, str] | None = None


def load() -> tuple[MomentKernel | None, str]:
    """The kernel, built and checked once a process, or None and why not."""
    global _LOADED
    if _LOADED is None:
        try:
            kernel = MomentKernel()
            check(kernel)
            _LOADED = (kernel, "built and equal to the torch ops here")
        except Unavailable as e:
            _LOADED = (None, str(e))
            log.warning(
                "host AdamW of bf16 and 8-bit moments: the torch ops step fp32 made from the halves, a pass an "
                "operation (%s)",
                e,
            )
    return _LOADED


def rate(moments: Moments, threads: int, numel: int, again: bool = False) -> float | None:
    """Parameters per second of this kernel's pass over `numel` elements of the master's halves in
    moment format `moments` (bf16 or 8-bit: the host state's buffers, `Moments.fields`) on
    `threads` threads, alone, as the engine steps them (`step_halves`, no clip): the plan's
    reading of the format on this host, beside probe.adam_rate's of fp32 (runtime.probe_machine).
    None where the kernel does not step that format here (no kernel built: the torch ops step it).
    Measured once per process, format, thread count and size; `again` reads once more and keeps
    the best, as probe.adam_rate does."""
    kernel = load()[0] if moments in (Q8, BF16) else None
    if kernel is None:
        return None
    key = (moments.name, threads, numel)
    if key not in _RATES or again:
        seconds = best_pass(_probe_pass(kernel, moments, threads, numel))
        _RATES[key] = max(_RATES.get(key, 0.0), numel / seconds)
    return _RATES[key]


_RATES: dict[tuple[str, int, int], float] = {}


def _probe_pass(kernel: MomentKernel, moments: Moments, threads: int, numel: int):
    """One pass of the kernel over fresh buffers of `numel` elements. Filled in parallel (each
    page first touched by a thread that steps it, as probe.adam_rate's), from a block of varied
    values repeated: a block of one value would find its moments' table entries in the cache
    every time."""
    gen = torch.Generator().manual_seed(0)
    block = torch.randn(TAKE * BLOCK, generator=gen)

    def filled(dtype: torch.dtype, scale: float) -> torch.Tensor:
        out = torch.empty(-(-numel // block.numel()) * block.numel(), dtype=dtype)
        out.view(-1, block.numel()).copy_(block * scale)
        return out[:numel]

    p = Halves(filled(torch.bfloat16, 0.02), torch.zeros(numel, dtype=torch.int16))
    g = filled(torch.float32, 1e-3)
    state = tuple(torch.zeros(f.length(numel), dtype=getattr(torch, f.dtype)) for f in moments.fields)
    h = low.Hyper.of(1e-5, 10, (0.9, 0.999), 1e-8, 0.0)
    return lambda: kernel.step_halves(p, g, state, h, False, threads)
