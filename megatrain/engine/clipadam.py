"""The host AdamW in one pass over the master weights' halves, with the clip's multiply in it.

The master weights are held as two 16-bit halves (host/split.py); torch's fused AdamW steps fp32,
which would cost a pass to make it and one to split it back. This kernel reads each weight's
halves, steps it in fp32 and writes its halves back as it goes, and multiplies each gradient
element by the clip coefficient as it steps it (one read of a held gradient, not three: the
multiply in place, then torch's kernel), 28 bytes an element, with the same arithmetic element for
element as that multiply and torch's kernel (`torch._fused_adamw_`, what
`torch.optim.AdamW(fused=True)` runs), so the weights and moments are bitwise the same.

"The same arithmetic" is that of torch's compiled kernel, not of its source: its compiler fused
some multiply-adds, one way in its vector loops (its own, and the eights its compiler makes of a
tensor's last elements) and another in the last `n % 8` elements it takes one at a time. The C
source below repeats those forms. Whether they hold for the torch build at hand is checked
before the kernel is used: on every tail length, in every combination of weight decay or none, a
clip or none and either form of the moment's lerp (each combination a vectorised loop of its
own), its results must equal torch's bit for bit, and its halves split.py's, else `load` says why
and the engine keeps torch's kernel (on fp32 made from the halves and split back). It is built
with the machine's C compiler (cbuild.py, which keeps the build for the next process) when first
asked for, once a process, and runs on threads of the caller's (ctypes releases the GIL). The threads take blocks of `BLOCK` elements from a counter they share until none is
left, not a fixed share each: a thread that runs slower (preempted, or reading memory the link's
copies contend for) holds up the pass by the block it is on, not by its whole share: 8-10% faster
alone, 8-15% beside a step's link traffic (bench/results/2026-11-28_0440_summary.md).
"""

from __future__ import annotations

import ctypes
import math

import torch

from ..host.split import Halves, split, to_bf16
from ..planning.planspec import KERNEL_TAIL
from .cbuild import Unavailable, build
from .osthreads import OptimizerThreads

# The CPU code torch dispatches to where the forms were found (AVX512; AVX2 is left to the check);
# elsewhere the kernel is not used.
CAPABILITIES = ("AVX512", "AVX2")
# A tensor's last `n % ONES` elements take the form of torch's scalar loop (planspec.py's
# KERNEL_TAIL: the plan fetches the embedding's rows only where a row never falls there).
ONES = KERNEL_TAIL
# Elements a thread is given at least: below it the threads' start costs more than they save.
MIN_PER_THREAD = 1 << 16
# Elements a thread takes from the shared counter at a time (a multiple of 64): 1.1 MB of the
# pass's traffic, ~0.1 ms of a thread's time. 0: a tensor's elements in as many blocks as threads
# (the split before, which bench/adamw.py --beside times beside it).
BLOCK = 1 << 16

# The halves' rule in C (host/split.py's, checked against it in `check`), which momentkernel.py's
# kernel takes too.
HALVES = r"""
#include <stdint.h>
#include <string.h>

/* The fp32 master weights' halves (host/split.py, its rule repeated here): a weight is `hi`, its
   bf16 rounded half away from zero (the largest finite magnitudes to a zero, inf and NaN kept),
   and `lo`, its low 16 bits. Written without branches, so that the loops below vectorise. */
static inline float join(uint16_t hi, uint16_t lo) {
    uint32_t mag = hi & 0x7FFFu, carry = lo >> 15;
    uint32_t top = hi - (carry & (mag != 0) & (mag <= 0x7F7Fu));
    top = (carry & (mag == 0)) ? (hi | 0x7F7Fu) : top;
    uint32_t u = (top << 16) | lo;
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

static inline uint16_t high(float x) {
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    uint32_t top = u >> 16, mag = top & 0x7FFFu, carry = (u >> 15) & 1u;
    uint32_t hi = top + (carry & (mag < 0x7F7Fu));
    return (uint16_t)((carry & (mag == 0x7F7Fu)) ? (top & 0x8000u) : hi);
}
"""

SOURCE = (
    HALVES
    + r"""
#include <math.h>

void halves(const float *x, uint16_t *hi, uint16_t *lo, int64_t n) {
    for (int64_t i = 0; i < n; i++) {
        uint32_t u;
        memcpy(&u, x + i, sizeof u);
        hi[i] = high(x[i]);
        lo[i] = (uint16_t)u;
    }
}

/* Every fp32 bit pattern from `first` for `n` patterns through the halves and back: how many
   do not come back (the tests run it over all 2^32). */
int64_t round_trips(uint32_t first, int64_t n) {
    int64_t bad = 0;
    for (int64_t i = 0; i < n; i++) {
        uint32_t u = first + (uint32_t)i, v;
        float x, y;
        memcpy(&x, &u, sizeof x);
        y = join(high(x), (uint16_t)u);
        memcpy(&v, &y, sizeof v);
        bad += v != u;
    }
    return bad;
}

/* One element's AdamW: its new weight, the new moments into `*mo` and `*vo`. */
static inline float adamw(float pi, float gi, float mi, float vi, float *mo, float *vo, int scale,
                          float coef, int decay, float keep, float w, int small, float b2, float c2,
                          float bc2s, float eps, float neg_step, int last) {
    gi = scale ? gi * coef : gi;
    pi = decay ? pi * keep : pi;
    mi = small ? fmaf(w, gi - mi, mi) : fmaf(w - 1.0f, gi - mi, gi);
    vi = last ? fmaf(vi, b2, c2 * gi * gi) : fmaf(c2 * gi, gi, vi * b2);
    *mo = mi;
    *vo = vi;
    return pi + neg_step * mi / (sqrtf(vi) / bc2s + eps);
}

static inline void element(uint16_t *ph, uint16_t *pl, const float *g, float *m, float *v, int64_t i,
                           int scale, float coef, int decay, float keep, float w, int small,
                           float b2, float c2, float bc2s, float eps, float neg_step, int last) {
    float pi = adamw(join(ph[i], pl[i]), g[i], m[i], v[i], m + i, v + i, scale, coef, decay, keep, w,
                     small, b2, c2, bc2s, eps, neg_step, last);
    uint32_t u;
    memcpy(&u, &pi, sizeof u);
    ph[i] = high(pi);
    pl[i] = (uint16_t)u;
}

/* Elements [lo, hi) of a tensor, its weights as halves (ph, pl): those before `ones` in the form
   of torch's vector loops, the rest in the form of its scalar loop. */
void clip_adamw(uint16_t *ph, uint16_t *pl, const float *g, float *m, float *v, int64_t lo,
                int64_t hi, int64_t ones, int scale, float coef, int decay, float keep, float w,
                int small, float b2, float c2, float bc2s, float eps, float neg_step) {
    int64_t mid = hi < ones ? hi : ones;
    if (mid < lo) mid = lo;
    /* Each combination of the flags in a loop of its own, the flags constants in it, so that
       every one of them is vectorised (a flag read in the loop kept it scalar: 3x slower). */
#define LOOP(S, D, SM)                                                                          \
    for (int64_t i = lo; i < mid; i++)                                                          \
        element(ph, pl, g, m, v, i, S, coef, D, keep, w, SM, b2, c2, bc2s, eps, neg_step, 0)
    switch ((scale ? 4 : 0) | (decay ? 2 : 0) | (small ? 1 : 0)) {
    case 0: LOOP(0, 0, 0); break;
    case 1: LOOP(0, 0, 1); break;
    case 2: LOOP(0, 1, 0); break;
    case 3: LOOP(0, 1, 1); break;
    case 4: LOOP(1, 0, 0); break;
    case 5: LOOP(1, 0, 1); break;
    case 6: LOOP(1, 1, 0); break;
    default: LOOP(1, 1, 1); break;
    }
#undef LOOP
    for (int64_t i = mid; i < hi; i++)
        element(ph, pl, g, m, v, i, scale, coef, decay, keep, w, small, b2, c2, bc2s, eps, neg_step, 1);
}

/* Elements [0, n) taken `block` at a time from `*next`, which the threads running this share,
   until none is left. */
void clip_adamw_shared(uint16_t *ph, uint16_t *pl, const float *g, float *m, float *v, int64_t *next,
                       int64_t block, int64_t n, int64_t ones, int scale, float coef, int decay,
                       float keep, float w, int small, float b2, float c2, float bc2s, float eps,
                       float neg_step) {
    for (;;) {
        int64_t lo = __atomic_fetch_add(next, block, __ATOMIC_RELAXED);
        if (lo >= n) return;
        int64_t hi = lo + block < n ? lo + block : n;
        clip_adamw(ph, pl, g, m, v, lo, hi, ones, scale, coef, decay, keep, w, small, b2, c2, bc2s,
                   eps, neg_step);
    }
}

/* Rows [lo, hi) of the list `rows` of a [*, width] table (its weights as halves): what each
   element becomes in the form of torch's vector loops (`adamw`, as `element` computes it), into
   `q` ([rows, width] bf16, the halves' hi) and nowhere else; the weights in fp32 into `f` too
   where it is given (the check's). Row r's gradient is row `grow[r]` of `g`, or `zero` where that
   is negative. */
static void rows_adamw(const uint16_t *ph, const uint16_t *pl, const float *g, const float *m,
                       const float *v, uint16_t *q, float *f, const int64_t *rows, const int64_t *grow,
                       const float *zero, int64_t lo, int64_t hi, int64_t width, int scale, float coef,
                       int decay, float keep, float w, int small, float b2, float c2, float bc2s,
                       float eps, float neg_step) {
    /* As `clip_adamw`'s: the flags constants in a loop of their own, so that each is vectorised. */
#define ROWS(S, D, SM, F)                                                                       \
    for (int64_t r = lo; r < hi; r++) {                                                         \
        const uint16_t *hr = ph + rows[r] * width, *lr = pl + rows[r] * width;                  \
        const float *gr = grow[r] < 0 ? zero : g + grow[r] * width;                             \
        const float *mr = m + rows[r] * width, *vr = v + rows[r] * width;                       \
        uint16_t *qr = q + r * width;                                                           \
        float *fr = F ? f + r * width : 0;                                                      \
        for (int64_t j = 0; j < width; j++) {                                                   \
            float mo, vo, pi = adamw(join(hr[j], lr[j]), gr[j], mr[j], vr[j], &mo, &vo, S, coef, \
                                     D, keep, w, SM, b2, c2, bc2s, eps, neg_step, 0);           \
            qr[j] = high(pi);                                                                   \
            if (F) fr[j] = pi;                                                                  \
        }                                                                                       \
    }
    switch ((scale ? 8 : 0) | (decay ? 4 : 0) | (small ? 2 : 0) | (f ? 1 : 0)) {
    case 0: ROWS(0, 0, 0, 0); break;
    case 1: ROWS(0, 0, 0, 1); break;
    case 2: ROWS(0, 0, 1, 0); break;
    case 3: ROWS(0, 0, 1, 1); break;
    case 4: ROWS(0, 1, 0, 0); break;
    case 5: ROWS(0, 1, 0, 1); break;
    case 6: ROWS(0, 1, 1, 0); break;
    case 7: ROWS(0, 1, 1, 1); break;
    case 8: ROWS(1, 0, 0, 0); break;
    case 9: ROWS(1, 0, 0, 1); break;
    case 10: ROWS(1, 0, 1, 0); break;
    case 11: ROWS(1, 0, 1, 1); break;
    case 12: ROWS(1, 1, 0, 0); break;
    case 13: ROWS(1, 1, 0, 1); break;
    case 14: ROWS(1, 1, 1, 0); break;
    default: ROWS(1, 1, 1, 1); break;
    }
#undef ROWS
}

/* `rows_adamw` over rows [0, n) of the list, `block` rows at a time from `*next`. */
void rows_adamw_shared(const uint16_t *ph, const uint16_t *pl, const float *g, const float *m,
                       const float *v, uint16_t *q, float *f, const int64_t *rows, const int64_t *grow,
                       const float *zero, int64_t *next, int64_t block, int64_t n, int64_t width,
                       int scale, float coef, int decay, float keep, float w, int small, float b2,
                       float c2, float bc2s, float eps, float neg_step) {
    for (;;) {
        int64_t lo = __atomic_fetch_add(next, block, __ATOMIC_RELAXED);
        if (lo >= n) return;
        int64_t hi = lo + block < n ? lo + block : n;
        rows_adamw(ph, pl, g, m, v, q, f, rows, grow, zero, lo, hi, width, scale, coef, decay, keep,
                   w, small, b2, c2, bc2s, eps, neg_step);
    }
}
"""
)


def f32(x: float) -> float:
    """`x` rounded to fp32, as torch's kernel casts its double constants (a C cast)."""
    return ctypes.c_float(x).value


class ClipAdamW:
    """The built kernel; `step` runs it over one tensor's elements on the given threads."""

    def __init__(self, ones: int = ONES):
        self.ones = ones
        self._lib = build(SOURCE, "clipadam")
        f, i64, ptr, i = ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        hyper = [i, f, i, f, f, i, f, f, f, f, f]  # _hyper's
        self._fn = self._lib.clip_adamw_shared
        self._fn.argtypes, self._fn.restype = [*[ptr] * 6, i64, i64, i64, *hyper], None
        self._rows = self._lib.rows_adamw_shared
        self._rows.argtypes, self._rows.restype = [*[ptr] * 11, i64, i64, i64, *hyper], None
        self._halves = self._lib.halves
        self._halves.argtypes, self._halves.restype = [ptr, ptr, ptr, i64], None
        self._round_trips = self._lib.round_trips
        self._round_trips.argtypes, self._round_trips.restype = [ctypes.c_uint32, i64], i64
        self._threads = OptimizerThreads("megatrain-clipadam")

    def step(
        self,
        p: Halves,
        g: torch.Tensor,
        m: torch.Tensor,
        v: torch.Tensor,
        coef: float | None,
        lr: float,
        step: int,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        threads: int = 1,
    ) -> None:
        """AdamW over contiguous host tensors of one length (one tensor to torch's kernel), the
        weights `p` as the fp32 master's halves (read and written in the pass, host/split.py), the
        gradient times `coef` first (None: as it is); `g` is left as it was."""
        n = g.numel()
        check_halves(p, n)
        args = (n - n % self.ones, *_hyper(coef, lr, step, betas, eps, weight_decay))
        taken = ctypes.c_int64(0)  # the counter the threads take their blocks from
        head = (*(t.data_ptr() for t in (p.hi, p.lo, g, m, v)), ctypes.addressof(taken))
        parts = max(1, min(threads, n // MIN_PER_THREAD))
        if parts == 1:
            self._fn(*head, n, n, *args)
            return
        block = BLOCK or -(-n // parts // 64) * 64
        self._threads.run(parts, self._fn, *head, block, n, *args)

    def rows(
        self,
        tables: tuple[Halves, torch.Tensor, torch.Tensor, torch.Tensor],
        rows: torch.Tensor,
        out: torch.Tensor,
        coef: float | None,
        lr: float,
        step: int,
        betas: tuple[float, float],
        eps: float,
        weight_decay: float,
        threads: int = 1,
        exact: torch.Tensor | None = None,
        index: torch.Tensor | None = None,
    ) -> None:
        """What rows `rows` (int64) of a table become in `step`'s AdamW, into `out` ([rows, width]
        bf16: the halves' hi; and in fp32 into `exact` where it is given), the table's weights
        (halves), gradient and moments (`tables`: contiguous, in `step`'s order p, g, m, v) only
        read: the arithmetic `step` applies to elements of a tensor outside its last `n % ONES`,
        element for element. The gradient of row `rows[r]` is row `index[r]` of g ([*, width]; a
        negative index: zero), or with no `index` row `rows[r]` of g (the table's whole gradient)."""
        p, g, m, v = tables
        n, width = rows.numel(), m.shape[1]
        index = rows if index is None else index
        if index.shape != rows.shape or g.shape[1:] != m.shape[1:] or not g.is_contiguous():
            raise ValueError("the gradient's rows are contiguous, of the table's width, one index a row")
        if out.dtype != torch.bfloat16 or tuple(out.shape) != (n, width) or not out.is_contiguous():
            raise ValueError(
                f"rows are written into [{n}, {width}] contiguous bf16, not {out.dtype} x {out.shape}"
            )
        check_halves(p, m.numel())
        if not all(t.is_contiguous() and t.dtype == torch.float32 and t.shape == m.shape for t in (m, v)):
            raise ValueError("the moments must be contiguous fp32 of one shape")
        if exact is not None and (
            exact.dtype != torch.float32 or exact.shape != out.shape or not exact.is_contiguous()
        ):
            raise ValueError("exact takes the rows in contiguous fp32, shaped as out")
        taken, zero = ctypes.c_int64(0), torch.zeros(width)
        head = (
            *(t.data_ptr() for t in (p.hi, p.lo, g, m, v)),
            out.data_ptr(),
            None if exact is None else exact.data_ptr(),
            rows.data_ptr(),
            index.data_ptr(),
            zero.data_ptr(),
            ctypes.addressof(taken),
        )
        hyper = _hyper(coef, lr, step, betas, eps, weight_decay)
        block = max(1, BLOCK // width)
        parts = max(1, min(threads, n * width // MIN_PER_THREAD))
        self._threads.run(parts, self._rows, *head, block, n, width, *hyper)

    def halves(self, x: torch.Tensor) -> Halves:
        """The halves of contiguous fp32 `x`, as the kernel makes them."""
        if x.dtype != torch.float32 or not x.is_contiguous():
            raise ValueError("halves takes contiguous fp32")
        out = Halves(torch.empty(x.shape, dtype=torch.bfloat16), torch.empty(x.shape, dtype=torch.int16))
        self._halves(x.data_ptr(), out.hi.data_ptr(), out.lo.data_ptr(), x.numel())
        return out

    def round_trips(self, first: int, n: int) -> int:
        """Of the `n` fp32 bit patterns from `first`, how many the kernel's halves do not give back."""
        return self._round_trips(first, n)


def check_halves(p: Halves, n: int) -> None:
    """Raise ValueError unless `p` is the halves of `n` contiguous elements, as the kernels take them."""
    if not (p.hi.dtype == torch.bfloat16 and p.lo.dtype == torch.int16 and p.hi.is_contiguous()
            and p.lo.is_contiguous() and p.hi.numel() == p.lo.numel() == n):  # fmt: skip
        raise ValueError(f"the weights are the halves of {n} contiguous elements (bf16 hi, int16 lo)")


def _hyper(coef: float | None, lr: float, step: int, betas, eps: float, weight_decay: float) -> tuple:
    """The kernel's arguments after `ones`: the flags and fp32 constants torch's kernel has."""
    b1, b2 = betas
    bc1, bc2 = 1 - b1 ** float(step), 1 - b2 ** float(step)  # doubles, as the kernel has them
    w = f32(1 - b1)
    return (
        int(coef is not None),
        f32(1.0 if coef is None else coef),
        int(weight_decay != 0),
        f32(1 - lr * weight_decay),
        w,
        int(abs(w) < 0.5),
        f32(b2),
        f32(1 - b2),
        f32(math.sqrt(bc2)),
        f32(eps),
        f32(-(lr / bc1)),
    )


def check(kernel: ClipAdamW) -> None:
    """Raise Unavailable unless the kernel's results equal torch's, bit for bit: every tail
    length past two vector loops, every combination of a clip and none, weight decay and none and
    both forms of the moment's lerp (beta1 below and above one half; each a loop of its own),
    three steps, split over threads, its weights' halves those host/split.py makes of torch's
    weights; its rows of a table likewise (`_check_rows`); and its halves split.py's on every high
    half beside low halves of either sign (the rule reads only the low half's sign bit), special
    values among them."""
    gen = torch.Generator().manual_seed(0)
    for n in [32 + k for k in range(16)] + [MIN_PER_THREAD * 2 + 13]:
        for b1, wd, coef in [(b1, wd, c) for b1 in (0.9, 0.3) for wd in (0.1, 0.0) for c in (0.37, None)]:
            p, g = torch.randn(n, generator=gen) * 0.02, torch.randn(n, generator=gen) * 1e-3
            m, v = torch.randn(n, generator=gen) * 1e-4, torch.rand(n, generator=gen) * 1e-6
            ours, theirs = [split(p), m.clone(), v.clone()], [t.clone() for t in (p, m, v)]
            for step in (1, 2, 3):
                hyper = (coef, 1e-3, step, (b1, 0.95), 1e-8, wd)
                kernel.step(ours[0], g, ours[1], ours[2], *hyper, threads=2)
                scaled = g.clone() if coef is None else g * torch.tensor(coef)
                torch._fused_adamw_(
                    [theirs[0]], [scaled], [theirs[1]], [theirs[2]], [], [torch.tensor(float(step))],
                    amsgrad=False, lr=1e-3, beta1=b1, beta2=0.95, weight_decay=wd, eps=1e-8, maximize=False,
                )  # fmt: skip
            want = split(theirs[0])
            same = _bits_equal(ours[0].hi, want.hi) and torch.equal(ours[0].lo, want.lo)
            if not (same and all(torch.equal(a, b) for a, b in zip(ours[1:], theirs[1:]))):
                raise Unavailable(
                    f"its results differ from torch {torch.__version__}'s kernel here ({n} elements, "
                    f"beta1 {b1}, weight decay {wd}, coefficient {coef})"
                )
    _check_rows(kernel, gen)
    tops = torch.arange(1 << 16, dtype=torch.int32)
    lows = torch.tensor([0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=torch.int32)
    bits = (tops[:, None] << 16 | lows).reshape(-1)  # int32 wraps past the sign bit, as fp32 bits do
    x = bits.view(torch.float32)
    got, want = kernel.halves(x), split(x)
    if not (_bits_equal(got.hi, want.hi) and torch.equal(got.lo, want.lo)):
        raise Unavailable("its halves of the fp32 weights differ from host/split.py's")


def _check_rows(kernel: ClipAdamW, gen: torch.Generator) -> None:
    """Raise Unavailable unless what `rows` writes for rows of a table equals torch's kernel's
    update of the whole table at those rows, in fp32 and as the halves' hi, bit for bit, in every
    combination of the flags, from the table's gradient and from its nonzero rows alone, the
    table itself left as it was (an fp32 element that differs in its last bit seldom differs in
    bf16)."""
    V, H = 37, 64
    for b1, wd, coef in [(b1, wd, c) for b1 in (0.9, 0.3) for wd in (0.1, 0.0) for c in (0.37, None)]:
        p, m = torch.randn(V, H, generator=gen) * 0.02, torch.randn(V, H, generator=gen) * 1e-4
        v, g = torch.rand(V, H, generator=gen) * 1e-6, torch.zeros(V, H)
        held = torch.randperm(V, generator=gen)[: V // 2].sort().values  # the rows with a gradient
        g[held] = torch.randn(len(held), H, generator=gen) * 1e-3
        rows = torch.randperm(V, generator=gen)[: V // 2].sort().values
        pos = torch.searchsorted(held, rows).clamp(max=len(held) - 1)
        index = torch.where(held[pos] == rows, pos, -1)
        theirs = [t.clone() for t in (p, m, v)]
        torch._fused_adamw_(
            [theirs[0]], [g if coef is None else g * torch.tensor(coef)], [theirs[1]], [theirs[2]], [],
            [torch.tensor(2.0)], amsgrad=False, lr=1e-3, beta1=b1, beta2=0.95, weight_decay=wd, eps=1e-8,
            maximize=False,
        )  # fmt: skip
        want, table = theirs[0][rows], split(p)
        for grads, at in ((g, None), (g[held].contiguous(), index)):
            out, exact = torch.empty(len(rows), H, dtype=torch.bfloat16), torch.empty(len(rows), H)
            before = [t.clone() for t in (*table, grads, m, v)]
            hyper = (coef, 1e-3, 2, (b1, 0.95), 1e-8, wd)
            kernel.rows((table, grads, m, v), rows, out, *hyper, threads=2, exact=exact, index=at)
            kept = all(torch.equal(a, b) for a, b in zip((*table, grads, m, v), before))
            if not (kept and torch.equal(exact, want) and _bits_equal(out, to_bf16(want))):
                raise Unavailable(
                    f"its rows differ from torch {torch.__version__}'s kernel here (beta1 {b1}, weight "
                    f"decay {wd}, coefficient {coef}, the gradient's rows {at is not None})"
                )


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int16), b.view(torch.int16))


_LOADED: tuple[ClipAdamW | None, str] | None = None


def load() -> tuple[ClipAdamW | None, str]:
    """The kernel, built and checked once a process, or None and why not."""
    global _LOADED
    if _LOADED is None:
        capability = torch.backends.cpu.get_cpu_capability()
        try:
            if capability not in CAPABILITIES:
                raise Unavailable(f"torch's kernel runs {capability} code here, whose forms are not known")
            kernel = ClipAdamW()
            check(kernel)
            _LOADED = (kernel, "built and equal to torch's kernel here")
        except Unavailable as e:
            _LOADED = (None, str(e))
    return _LOADED
