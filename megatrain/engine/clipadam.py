"""AdamW with the clip's multiply in the same pass: one read of each held gradient, not three.

The engine's host pass over a clipped gradient multiplies it by the clip coefficient in place
(`optim.clip_scaled`), then runs torch's fused AdamW over it: the gradient is read, written and
read again, 36 bytes an element against the kernel's 28. This kernel reads the gradient once and
multiplies each element as it steps it, with the same arithmetic element for element as that
multiply and torch's kernel (`torch._fused_adamw_`, what `torch.optim.AdamW(fused=True)` runs),
so the weights and moments are bitwise the same.

"The same arithmetic" is that of torch's compiled kernel, not of its source: its compiler fused
some multiply-adds, one way in its vector loops (its own, and the eights its compiler makes of a
tensor's last elements) and another in the last `n % 8` elements it takes one at a time. The C
source below repeats those forms. Whether they hold for the torch build at hand is checked
before the kernel is used: on every tail length, in every combination of weight decay or none, a
clip or none, either form of the moment's lerp and the bf16 copy or none (each combination a
vectorised loop of its own), its results must equal torch's bit for bit, else `load` says why and
the engine keeps torch's kernel. It is built with the machine's C compiler (`cc`, or
CC) when first asked for, once a process, and runs on threads of the caller's (ctypes releases
the GIL). The threads take blocks of `BLOCK` elements from a counter they share until none is
left, not a fixed share each: a thread that runs slower (preempted, or reading memory the link's
copies contend for) holds up the pass by the block it is on, not by its whole share: 8-10% faster
alone, 8-15% beside a step's link traffic (bench/results/2026-11-28_0440_summary.md).

It can also write the new weights into a bf16 copy as it steps them (`copy`): the cast
`Tensor.to(torch.bfloat16)` does (round to nearest even; checked the same way), in the same pass,
for a copy of the master weights that the GPU fetches at half the bytes (host_weight_copy).
"""

from __future__ import annotations

import ctypes
import math
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor

import torch

from .osthreads import OPTIMIZER_THREAD, name_os_thread

# The CPU code torch dispatches to where the forms were found (AVX512; AVX2 is left to the check);
# elsewhere the kernel is not used.
CAPABILITIES = ("AVX512", "AVX2")
# A tensor's last `n % ONES` elements take the form of torch's scalar loop.
ONES = 8
# Elements a thread is given at least: below it the threads' start costs more than they save.
MIN_PER_THREAD = 1 << 16
# Elements a thread takes from the shared counter at a time (a multiple of 64): 1.1 MB of the
# pass's traffic, ~0.1 ms of a thread's time. 0: a tensor's elements in as many blocks as threads
# (the split before, which bench/adamw.py --beside times beside it).
BLOCK = 1 << 16

SOURCE = r"""
#include <math.h>
#include <stdint.h>
#include <string.h>

/* fp32 to bf16, rounded to nearest even, as torch's cast; a NaN to the quiet 0x7FC0 (torch's
   scalar loop's; its vector loops write 0xFFFF). */
static inline uint16_t bf16(float x) {
    if (isnan(x)) return 0x7FC0;
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return (uint16_t)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

void to_bf16(const float *x, uint16_t *y, int64_t n) {
    for (int64_t i = 0; i < n; i++) y[i] = bf16(x[i]);
}

static inline void element(float *p, const float *g, float *m, float *v, uint16_t *q, int64_t i,
                           int scale, float coef, int decay, float keep, float w, int small,
                           float b2, float c2, float bc2s, float eps, float neg_step, int last) {
    float gi = scale ? g[i] * coef : g[i];
    float pi = decay ? p[i] * keep : p[i];
    float mi = m[i];
    mi = small ? fmaf(w, gi - mi, mi) : fmaf(w - 1.0f, gi - mi, gi);
    float vi = last ? fmaf(v[i], b2, c2 * gi * gi) : fmaf(c2 * gi, gi, v[i] * b2);
    m[i] = mi;
    v[i] = vi;
    pi = pi + neg_step * mi / (sqrtf(vi) / bc2s + eps);
    p[i] = pi;
    if (q) q[i] = bf16(pi);
}

/* Elements [lo, hi) of a tensor: those before `ones` in the form of torch's vector loops, the
   rest in the form of its scalar loop; the new weights also into `q` as bf16 where it is given. */
void clip_adamw(float *p, const float *g, float *m, float *v, uint16_t *q, int64_t lo, int64_t hi,
                int64_t ones, int scale, float coef, int decay, float keep, float w, int small,
                float b2, float c2, float bc2s, float eps, float neg_step) {
    int64_t mid = hi < ones ? hi : ones;
    if (mid < lo) mid = lo;
    /* Each combination of the flags in a loop of its own, the flags constants in it, so that
       every one of them is vectorised (a flag read in the loop kept it scalar: 3x slower). */
#define LOOP(S, D, SM, Q)                                                                       \
    for (int64_t i = lo; i < mid; i++)                                                          \
        element(p, g, m, v, (Q) ? q : 0, i, S, coef, D, keep, w, SM, b2, c2, bc2s, eps, neg_step, 0)
    switch ((scale ? 8 : 0) | (decay ? 4 : 0) | (small ? 2 : 0) | (q ? 1 : 0)) {
    case 0: LOOP(0, 0, 0, 0); break;
    case 1: LOOP(0, 0, 0, 1); break;
    case 2: LOOP(0, 0, 1, 0); break;
    case 3: LOOP(0, 0, 1, 1); break;
    case 4: LOOP(0, 1, 0, 0); break;
    case 5: LOOP(0, 1, 0, 1); break;
    case 6: LOOP(0, 1, 1, 0); break;
    case 7: LOOP(0, 1, 1, 1); break;
    case 8: LOOP(1, 0, 0, 0); break;
    case 9: LOOP(1, 0, 0, 1); break;
    case 10: LOOP(1, 0, 1, 0); break;
    case 11: LOOP(1, 0, 1, 1); break;
    case 12: LOOP(1, 1, 0, 0); break;
    case 13: LOOP(1, 1, 0, 1); break;
    case 14: LOOP(1, 1, 1, 0); break;
    default: LOOP(1, 1, 1, 1); break;
    }
#undef LOOP
    for (int64_t i = mid; i < hi; i++)
        element(p, g, m, v, q, i, scale, coef, decay, keep, w, small, b2, c2, bc2s, eps, neg_step, 1);
}

/* Elements [0, n) taken `block` at a time from `*next`, which the threads running this share,
   until none is left. */
void clip_adamw_shared(float *p, const float *g, float *m, float *v, uint16_t *q, int64_t *next,
                       int64_t block, int64_t n, int64_t ones, int scale, float coef, int decay,
                       float keep, float w, int small, float b2, float c2, float bc2s, float eps,
                       float neg_step) {
    for (;;) {
        int64_t lo = __atomic_fetch_add(next, block, __ATOMIC_RELAXED);
        if (lo >= n) return;
        int64_t hi = lo + block < n ? lo + block : n;
        clip_adamw(p, g, m, v, q, lo, hi, ones, scale, coef, decay, keep, w, small, b2, c2, bc2s,
                   eps, neg_step);
    }
}
"""

FLAGS = ["-O3", "-march=native", "-ffp-contract=off", "-fno-math-errno", "-fPIC", "-shared"]


class Unavailable(RuntimeError):
    """Why the kernel cannot stand in for torch's here (no compiler, another CPU, another build)."""


def f32(x: float) -> float:
    """`x` rounded to fp32, as torch's kernel casts its double constants (a C cast)."""
    return ctypes.c_float(x).value


class ClipAdamW:
    """The built kernel; `step` runs it over one tensor's elements on the given threads."""

    def __init__(self, ones: int = ONES):
        self.ones = ones
        with tempfile.TemporaryDirectory(prefix="megatrain-clipadam-") as d:
            src, lib = os.path.join(d, "clipadam.c"), os.path.join(d, "clipadam.so")
            with open(src, "w") as f:
                f.write(SOURCE)
            cc = os.environ.get("CC", "cc")
            try:
                done = subprocess.run(
                    [cc, *FLAGS, "-o", lib, src], capture_output=True, text=True, timeout=120
                )
            except (OSError, subprocess.TimeoutExpired) as e:
                raise Unavailable(f"no C compiler ({cc}: {e})") from None
            if done.returncode:
                raise Unavailable(f"{cc} failed: {done.stderr.strip()[-300:]}")
            self._lib = ctypes.CDLL(lib)  # mapped: the file may go
        fn = self._lib.clip_adamw_shared
        f, i64, ptr, i = ctypes.c_float, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
        fn.argtypes = [ptr, ptr, ptr, ptr, ptr, ptr, i64, i64, i64, i, f, i, f, f, i, f, f, f, f, f]
        fn.restype = None
        self._fn = fn
        self._to_bf16 = self._lib.to_bf16
        self._to_bf16.argtypes, self._to_bf16.restype = [ptr, ptr, i64], None
        self._pool: ThreadPoolExecutor | None = None
        self._workers = 0

    def step(
        self,
        p: torch.Tensor,
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
        copy: torch.Tensor | None = None,
    ) -> None:
        """AdamW over contiguous fp32 host tensors of one length (one tensor to torch's kernel),
        the gradient times `coef` first (None: as it is); `g` is left as it was. The new weights
        are also written, cast, into `copy` where it is given (a contiguous bf16 tensor of the
        same length): `p.to(torch.bfloat16)`, bit for bit."""
        n = p.numel()
        if copy is not None and (
            copy.dtype != torch.bfloat16 or copy.numel() != n or not copy.is_contiguous()
        ):
            raise ValueError(
                f"the copy must be {n} contiguous bf16 elements, not {copy.dtype} x {copy.numel()}"
            )
        b1, b2 = betas
        bc1, bc2 = 1 - b1 ** float(step), 1 - b2 ** float(step)  # doubles, as the kernel has them
        w = f32(1 - b1)
        args = (
            n - n % self.ones,
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
        q = None if copy is None else copy.data_ptr()
        taken = ctypes.c_int64(0)  # the counter the threads take their blocks from
        head = (p.data_ptr(), g.data_ptr(), m.data_ptr(), v.data_ptr(), q, ctypes.addressof(taken))
        parts = max(1, min(threads, n // MIN_PER_THREAD))
        if parts == 1:
            self._fn(*head, n, n, *args)
            return
        if self._pool is None or self._workers < parts:
            if self._pool is not None:
                self._pool.shutdown()
            self._pool, self._workers = (
                ThreadPoolExecutor(
                    parts,
                    thread_name_prefix="megatrain-clipadam",
                    initializer=name_os_thread,  # the host optimizer's, whichever thread starts them
                    initargs=(OPTIMIZER_THREAD,),
                ),
                parts,
            )
        block = BLOCK or -(-n // parts // 64) * 64
        for job in [self._pool.submit(self._fn, *head, block, n, *args) for _ in range(parts)]:
            job.result()

    def cast(self, x: torch.Tensor, y: torch.Tensor) -> None:
        """`y` = `x` in bf16, as the kernel casts its copy (contiguous fp32 into bf16)."""
        if x.dtype != torch.float32 or y.dtype != torch.bfloat16 or x.numel() != y.numel():
            raise ValueError("cast takes fp32 into bf16 of the same length")
        self._to_bf16(x.data_ptr(), y.data_ptr(), x.numel())


def check(kernel: ClipAdamW) -> None:
    """Raise Unavailable unless the kernel's results equal torch's, bit for bit: every tail
    length past two vector loops, every combination of a clip and none, weight decay and none,
    both forms of the moment's lerp (beta1 below and above one half) and the bf16 copy and none
    (each a loop of its own), three steps, split over threads; and its cast equals torch's on
    special values (infinities, ties, the largest finite, subnormals; a NaN stays a NaN, its bits those of a quiet NaN, where torch's
    vector and scalar loops write different ones)."""
    gen = torch.Generator().manual_seed(0)
    for n in [32 + k for k in range(16)] + [MIN_PER_THREAD * 2 + 13]:
        for b1, wd, coef in [(b1, wd, c) for b1 in (0.9, 0.3) for wd in (0.1, 0.0) for c in (0.37, None)]:
            p, g = torch.randn(n, generator=gen) * 0.02, torch.randn(n, generator=gen) * 1e-3
            m, v = torch.randn(n, generator=gen) * 1e-4, torch.rand(n, generator=gen) * 1e-6
            for copy in (None, torch.empty(n, dtype=torch.bfloat16)):
                ours, theirs = [t.clone() for t in (p, m, v)], [t.clone() for t in (p, m, v)]
                for step in (1, 2, 3):
                    hyper = (coef, 1e-3, step, (b1, 0.95), 1e-8, wd)
                    kernel.step(ours[0], g, ours[1], ours[2], *hyper, threads=2, copy=copy)
                    scaled = g.clone() if coef is None else g * torch.tensor(coef)
                    torch._fused_adamw_(
                        [theirs[0]], [scaled], [theirs[1]], [theirs[2]], [], [torch.tensor(float(step))],
                        amsgrad=False, lr=1e-3, beta1=b1, beta2=0.95, weight_decay=wd, eps=1e-8, maximize=False,
                    )  # fmt: skip
                same = all(torch.equal(a, b) for a, b in zip(ours, theirs))
                if copy is not None:
                    same = same and _bits_equal(copy, theirs[0].to(torch.bfloat16))
                if not same:
                    raise Unavailable(
                        f"its results differ from torch {torch.__version__}'s kernel here ({n} elements, "
                        f"beta1 {b1}, weight decay {wd}, coefficient {coef}, bf16 copy {copy is not None})"
                    )
    info = torch.finfo(torch.float32)
    ties = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, -(1 + 2**-8), 2**-130 * (1 + 2**-8)])
    special = [math.inf, -math.inf, math.nan, -math.nan, info.max, -info.max, info.tiny, 2**-140, 0.0, -0.0]
    x = torch.cat([torch.tensor(special), ties, torch.randn(4096, generator=gen)])
    y = torch.empty(x.numel(), dtype=torch.bfloat16)
    kernel.cast(x, y)
    theirs, nan = x.to(torch.bfloat16), x.isnan()  # a NaN is a NaN: torch's bits for one vary by path
    if not (_bits_equal(y[~nan], theirs[~nan]) and y[nan].isnan().all()):
        raise Unavailable(f"its bf16 cast differs from torch {torch.__version__}'s here")


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
