"""AdamW on the host-resident fp32 master weights (the learning-rate schedules: schedule.py).

The update is torch's fused CPU AdamW kernel's arithmetic (`torch._fused_adamw_`, what
`torch.optim.AdamW(fused=True)` calls), applied to any sub-range of a unit's flat state: AdamW
is elementwise, so stepping a unit in chunks as its gradients arrive gives bitwise the same
result as stepping it whole, where the chunks are cut at multiples of 64 elements (the kernel
runs a tensor's last few elements through a scalar loop whose rounding may differ from its
vector loop's; its threads split a tensor at multiples of 16 elements, so that loop takes the
tensor's last length-mod-8-or-16 elements whatever the thread count, and a cut at a multiple of
64 leaves every element in the loop it takes in the whole tensor; parameters start on 64-element
boundaries, and every cut the engine makes is on one). Semantics follow the Hugging Face
Trainer: no weight decay on biases and norm weights, one global step count. The master weights
are two 16-bit halves (host/split.py): a kernel of ours that repeats torch's arithmetic reads and
writes them in its one pass, and multiplies by the clip coefficient as it steps
(`clipadam.py`, where it builds and checks: `FUSED_CLIP`), bitwise; elsewhere torch's kernel
steps fp32 made from the halves a piece at a time and split back. bf16 and 8-bit moments
(`optim`, host/moments.py) take engine/moments.py's arithmetic: in host memory momentkernel.py's
kernel, which reads and writes the halves and multiplies the clip in its pass in the same way
(else the torch ops on fp32 made from the halves). Two other ways
to take the multiply off the pass were measured and removed: the gradient scaled in cache-sized
pieces just before each is stepped (27-60% of the kernel on a 64-core host, against 67% for the
multiply's own pass), and the multiply on threads of its own beside the kernel (69-79% on 16- and
32-core hosts, against 99-111% for clipadam's kernel).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from ..host.hostmem import populate
from ..host.moments import BF16, BLOCK, FP32, Q8, Moments
from ..host.split import Halves, cast, join
from ..host.state import HostState, Unit
from ..parallel.distributed import Collective, Single
from . import clipadam, momentgpu, momentkernel
from . import moments as low

log = logging.getLogger(__name__)


@dataclass
class AdamWConfig:
    lr: float = 1e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    moments: Moments = FP32
    """How the moments are stored (`optim`, host/moments.py): fp32 steps with torch's fused kernel,
    the others with engine/moments.py's arithmetic."""


# Whether the host AdamW is a kernel that steps the master weights' halves in its pass and
# multiplies a clip that fires as it steps (one read of the gradient, 28 bytes an element against
# 36 with fp32 moments): clipadam's, or momentkernel's for bf16 and 8-bit moments, where it builds
# and its results equal torch's kernel (the torch ops) on this host (checked once a process; else
# fp32 made from the halves, after a multiply of its own, and a warning says why). The engine's
# clipped pass against torch's kernel at the same state size, with it and without: 111% against
# 69% on a 16-core host (2.58B), 99% against 61% on a 32-core host (5.0B), 105% against 71% on the
# 2-core development host
# (results/2026-11-27_1256_h100-adamw-engine.md, _1254_x2-adamw-engine.md, _1202_adamw-engine.md).
FUSED_CLIP = True
# Elements of the fp32 weights torch's kernel steps at a time, made from the halves and split
# back (a multiple of 64: cuts there leave each element in the loop it takes in a whole tensor).
PASS_CHUNK = 1 << 18


def chunk_ranges(unit: Unit, max_elems: int, span: tuple[int, int] | None = None) -> list[tuple[int, int]]:
    """Split a unit's flat range (or its elements `span` = [lo, hi)) into pieces of at most
    `max_elems` elements."""
    lo, hi = span or (0, unit.numel)
    return [(a, min(a + max_elems, hi)) for a in range(lo, hi, max_elems)]


def clip_scaled(g: torch.Tensor, coef: torch.Tensor | None) -> torch.Tensor:
    """The gradient times the clip coefficient (None: not clipped), in place: an fp32 multiply,
    the same on either device. A coefficient of exactly one in host memory (the norm under the
    threshold) multiplies nothing: x * 1.0 is x, bitwise, and the pass over the gradient (8 bytes
    a parameter moved beside the kernel's 28) is skipped. A device coefficient is not read: that
    would wait for the GPU."""
    return g.mul_(coef.to(g.device)) if multiplies(coef) else g


def multiplies(coef: torch.Tensor | None) -> bool:
    """Whether `clip_scaled` multiplies by `coef` (`clip_scaled` says when it does not)."""
    return coef is not None and (coef.device.type != "cpu" or coef.item() != 1.0)


def tensors(unit: Unit, lo: int, hi: int) -> dict[bool, list[tuple[int, int]]]:
    """The tensors the kernel steps elements [lo, hi) of `unit` as, by weight decay: the trained
    parameters' spans in the range, those that follow each other with no padding between them
    (sizes in multiples of 64, as a layer's matrices are) joined into one (`adamw_range` says
    why)."""
    groups: dict[bool, list[tuple[int, int]]] = {True: [], False: []}
    for spec in unit.params:
        a, b = max(lo, spec.offset), min(hi, spec.offset + spec.numel)
        if a < b and spec.train:  # frozen tensors are not stepped
            spans = groups[spec.decay]
            if spans and spans[-1][1] == a:
                spans[-1] = (spans[-1][0], b)
            else:
                spans.append((a, b))
    return groups


def adamw_range(
    unit: Unit,
    lo: int,
    hi: int,
    p: torch.Tensor,
    g: torch.Tensor,
    moments: tuple[torch.Tensor, ...],
    cfg: AdamWConfig,
    lr: float,
    step: int,
    found_inf: torch.Tensor | None = None,
    base: int = 0,
) -> None:
    """AdamW on elements [lo, hi) of one unit. `p` and `moments` (the state's moment buffers,
    `Moments.fields` order) hold the unit's flat state from element `base` on (the whole unit, a
    machine's part of it, or a chunk of it in a GPU scratch; an absmax from `base`'s block) and `g`
    exactly the range; host or device tensors alike. A nonzero `found_inf` (a float flag on the
    same device) leaves everything unchanged.

    Parameters that follow each other with no padding between them (sizes in multiples of ALIGN,
    as a layer's matrices are) and with the same weight decay are stepped as one tensor: the kernel
    runs each tensor in a parallel region of its own, and their starts and ends cost threads idle
    at the barrier; the elements its vector loop covers stay the same. Moments in bf16 or 8 bits
    take engine/moments.py's arithmetic; 8-bit ones are cut only on blocks (`lo`, `hi` and `base`
    multiples of BLOCK, or `hi` the unit's end)."""
    if cfg.moments != FP32:
        _moments_range(unit, lo, hi, p, g, moments, cfg, lr, step, found_inf, base)
        return
    m, v = moments
    for decay, spans in tensors(unit, lo, hi).items():
        if not spans:
            continue
        sl = [slice(a - base, b - base) for a, b in spans]
        gl = [slice(a - lo, b - lo) for a, b in spans]
        # A fill, not torch.tensor(..., device=...): a copy from host memory would synchronise
        # the calling thread with the stream the update is queued on.
        steps = [torch.full((), float(step), device=p.device) for _ in spans]
        torch._fused_adamw_(
            [p[s] for s in sl],
            [g[s] for s in gl],
            [m[s] for s in sl],
            [v[s] for s in sl],
            [],
            steps,
            amsgrad=False,
            lr=lr,
            beta1=cfg.betas[0],
            beta2=cfg.betas[1],
            weight_decay=cfg.weight_decay if decay else 0.0,
            eps=cfg.eps,
            maximize=False,
            found_inf=None if found_inf is None else found_inf.float(),
        )


def _moments_range(unit, lo, hi, p, g, moments, cfg: AdamWConfig, lr, step, found_inf, base) -> None:
    """`adamw_range` of bf16 or 8-bit moments: engine/moments.py's step, span by span; in host
    memory by momentkernel.py's kernel, on CUDA by momentgpu.py's, where they build and check (one
    pass, the same bits)."""
    kernel = None
    one_pass = cfg.moments in (Q8, BF16)
    if p.device.type == "cpu" and found_inf is None and one_pass:
        kernel = momentkernel.load()[0]
    on_gpu = p.device.type == "cuda" and one_pass and momentgpu.load(p.device)[0]
    for a, b, views, h, decay in moment_spans(unit, lo, hi, moments, cfg, lr, step, base):
        pa, ga = p[a - base : b - base], g[a - lo : b - lo]
        if kernel is not None:
            kernel.step(pa, ga, views, h, decay, torch.get_num_threads())
        elif on_gpu:
            momentgpu.step(pa, ga, views, h, decay, found_inf)
        else:
            low.step_span(pa, ga, views, h, decay, found_inf)


def moment_spans(unit: Unit, lo: int, hi: int, moments, cfg: AdamWConfig, lr: float, step: int, base: int):
    """The spans [a, b) of elements [lo, hi) of `unit` that engine/moments.py's step takes as one
    (`tensors`), each with its moment buffers' views (`moments` from element `base` on, an absmax
    from its block), its constants and its weight decay; 8-bit moments cut only on blocks."""
    quantized = cfg.moments.quantized
    if quantized and (lo % BLOCK or base % BLOCK or (hi % BLOCK and hi != unit.numel)):
        raise ValueError(
            f"{unit.name}[{lo}:{hi}] from {base}: 8-bit moments are stepped in whole blocks of {BLOCK}"
        )
    for decay, spans in tensors(unit, lo, hi).items():
        h = low.Hyper.of(lr, step, cfg.betas, cfg.eps, cfg.weight_decay if decay else 0.0)
        for a, b in spans:
            if quantized:  # codes element for element, absmax block for block
                ka, kb = (a - base) // BLOCK, -(-(b - base) // BLOCK)
                views = (*(t[a - base : b - base] for t in moments[:2]), *(t[ka:kb] for t in moments[2:]))
            else:
                views = tuple(t[a - base : b - base] for t in moments)
            yield a, b, views, h, decay


class HostAdamW:
    """Steps ranges of units' host fp32 state in place, given fp32 gradients for the same range.

    In a data-parallel world (`world`, distributed.py) the ranks of a machine share the state:
    each steps its own span of every unit, and a unit's update is complete once every rank has
    `published` it."""

    def __init__(self, state: HostState, cfg: AdamWConfig, world: Collective | None = None):
        if state.moments != cfg.moments:
            raise ValueError(
                f"the host state holds {state.moments.name} moments, the optimizer steps {cfg.moments.name}"
            )
        self.state, self.cfg = state, cfg
        if cfg.moments in (Q8, BF16):
            momentkernel.load()  # built and checked now, before a step: not on the optimizer's thread
        self.world = world or Single()
        self._populated: set[int] = set()  # units whose moments' pages are mapped (`_populate`)
        # a kernel steps the halves, where it is available (FUSED_CLIP, `_loaded`)
        self.fused_clip = FUSED_CLIP
        self._fused: clipadam.ClipAdamW | None = None

    def span(self, unit: Unit) -> tuple[int, int]:
        """The elements [lo, hi) of `unit` this process steps."""
        return self.world.span(unit)

    def piece(self, unit: Unit) -> tuple[int, int]:
        """The elements [lo, hi) of `unit` that a gradient handed to this process covers."""
        return self.world.piece(unit)

    def own(self, unit: Unit, grad: torch.Tensor) -> torch.Tensor:
        """The elements of a handed-over gradient (covering `piece(unit)`) that this process steps."""
        (lo, hi), (p0, _) = self.span(unit), self.piece(unit)
        return grad[lo - p0 : hi - p0]

    def published(self, unit: Unit) -> None:
        """This process is done with `unit` for this step (stepped or skipped its part); returns
        once every rank is, so its weights may be read. Called for the units in the order they
        were handed over, from one thread."""
        self.world.updated(unit)

    def step_range(self, unit: Unit, lo: int, hi: int, grad: torch.Tensor, lr: float, step: int) -> None:
        """Update elements [lo, hi) of `unit`; `grad` holds exactly that range (multiplied by the
        clip coefficient already)."""
        self._step(unit, lo, hi, grad, None, lr, step)

    def _step(self, unit: Unit, lo: int, hi: int, grad: torch.Tensor, coef, lr: float, step: int) -> None:
        """Elements [lo, hi) of `unit` from `grad` (exactly that range) times `coef` (a float, for
        a kernel on the halves alone, `_loaded`; None: as it is). A unit of the disk tier is
        stepped a block at a time, on its moments staged in host memory (host/disk.py)."""
        if unit.index not in self._populated:
            self._populate(unit)
        st, base = self.state, self.state.part(unit)[0]
        tier = st.tier
        if tier is None or not tier.holds(unit):
            moments = tuple(st.flat(unit, w) for w in st.moment_names)
            self._pass(unit, lo, hi, grad, moments, base, coef, lr, step)
            return
        for a, b in tier.blocks(unit, lo, hi):
            with tier.staged(unit, a, b) as moments:
                self._pass(unit, a, b, grad[a - lo : b - lo], moments, a, coef, lr, step)

    def _pass(
        self, unit: Unit, lo: int, hi: int, grad, moments, base: int, coef, lr: float, step: int
    ) -> None:
        """AdamW on elements [lo, hi) of `unit`, `moments` its moment buffers from element `base`
        on (an absmax from its block) and `grad` exactly the range: a kernel on the halves
        (`_loaded`: clipadam's for fp32 moments, the same tensors as torch's kernel is given,
        `tensors`; momentkernel's for bf16 and 8-bit ones, `moment_spans`), each split over the
        optimizer's threads, `grad` left unscaled; else the weights made fp32 from the halves,
        stepped by torch's kernel (or engine/moments.py's arithmetic for bf16 and 8-bit moments)
        and split back, cut at multiples of PASS_CHUNK (of 64 and of BLOCK: bitwise the range
        stepped whole)."""
        kernel = self._loaded()
        if isinstance(kernel, momentkernel.MomentKernel):
            threads = torch.get_num_threads()
            for a, b, views, h, decay in moment_spans(unit, lo, hi, moments, self.cfg, lr, step, base):
                p = self.state.halves(unit, a, b)
                kernel.step_halves(p, grad[a - lo : b - lo], views, h, decay, threads, coef)
            return
        if kernel is not None:
            m, v = moments
            hyper = (lr, step, self.cfg.betas, self.cfg.eps)
            for decay, spans in tensors(unit, lo, hi).items():
                wd = self.cfg.weight_decay if decay else 0.0
                for a, b in spans:
                    s, g = slice(a - base, b - base), slice(a - lo, b - lo)
                    p = self.state.halves(unit, a, b)
                    kernel.step(p, grad[g], m[s], v[s], coef, *hyper, wd, torch.get_num_threads())
            return
        assert coef is None, "torch's kernel steps a gradient multiplied already"
        a = lo
        while a < hi:
            b = min(hi, (a // PASS_CHUNK + 1) * PASS_CHUNK)
            p = self.state.master(unit, a, b)
            views = tuple(
                t[(a - base) // self.state.per(w) :] for w, t in zip(self.state.moment_names, moments)
            )
            adamw_range(unit, a, b, p, grad[a - lo : b - lo], views, self.cfg, lr, step, base=a)
            self.state.set_master(unit, a, p)
            a = b

    def _populate(self, unit: Unit) -> None:
        """Before the first update of `unit`, the pages of this process's span of its moments
        mapped writable on the optimizer's threads (hostmem.populate: the kernel reads the fresh
        moments before it writes them, two faults a page), contents kept (a resumed state's
        moments are in place already). Not the disk tier's files: their pages come and go as the
        pass walks them."""
        self._populated.add(unit.index)
        if self.state.exp_avg is None or (self.state.tier is not None and self.state.tier.holds(unit)):
            return
        lo, hi = self.span(unit)
        populate(
            [self.state.range(unit, lo, hi, w) for w in self.state.moment_names], torch.get_num_threads()
        )

    def step_held(
        self, unit: Unit, grad: torch.Tensor, coef: torch.Tensor | None, lr: float, step: int, chunk: int
    ) -> None:
        """Update this process's span of `unit` from its gradient held in host memory (`grad`
        covers the span; scaled in place, but by a kernel on the halves), times the clip coefficient (a
        host tensor; None: not clipped): the optimizer worker's pass over held gradients. A clip
        that fires is multiplied in the pass of a kernel on the halves where asked for and
        available (`fused_clip`, `_loaded`), else `chunk` elements at a time before torch's kernel
        (or engine/moments.py's arithmetic) steps them."""
        lo, hi = self.span(unit)
        if self._loaded() is not None:
            self._step(unit, lo, hi, grad, coef.item() if multiplies(coef) else None, lr, step)
            return
        for a, b in chunk_ranges(unit, chunk, (lo, hi)):
            self.step_range(unit, a, b, clip_scaled(grad[a - lo : b - lo], coef), lr, step)

    def step_rows(
        self,
        unit: Unit,
        rows: torch.Tensor,
        grad: torch.Tensor,
        coef: torch.Tensor | None,
        lr: float,
        step: int,
        out: torch.Tensor,
        index: torch.Tensor | None = None,
    ) -> None:
        """The weights that rows `rows` (sorted token ids) of a one-table unit (the embedding)
        take in this step's update, written into `out` ([rows, hidden] in any dtype, cast as a
        fetch casts), the state left as it is: the update `step_held` makes of the whole table
        later from its gradient, of which `grad` (fp32, only read) holds the table's rows, or
        with `index` some rows, row `index[r]` that of `rows[r]` (a negative one: zero). Bitwise
        the same:
        clipadam's kernel computes each row's elements as it steps a tensor's outside its last
        `n % KERNEL_TAIL`, reading the table where it lies (its `rows`, checked against torch's
        kernel); without it, or into another dtype than bf16, torch's kernel steps gathered
        copies of the rows. Every element of the table takes that one form in `step_held`, whose
        tensors' lengths are multiples of KERNEL_TAIL (a hidden size the plan allows), as every
        element of the copies does in theirs. bf16 and 8-bit moments: engine/moments.py's
        arithmetic on the rows' decoded moments, element for element as a step of the table."""
        spec = unit.params[0]
        table = self.state.halves(unit, spec.offset, spec.offset + spec.numel).view(spec.shape)
        wd, (b1, b2) = (self.cfg.weight_decay if spec.decay else 0.0), self.cfg.betas

        def gathered() -> torch.Tensor:  # the rows' gradient, times the clip coefficient
            if index is None:
                return clip_scaled(grad.index_select(0, rows), coef)
            g = grad.index_select(0, index.clamp(min=0)).masked_fill_((index < 0)[:, None], 0.0)
            return clip_scaled(g, coef)

        def weights() -> torch.Tensor:  # the rows' fp32 master weights
            return join(Halves(table.hi.index_select(0, rows), table.lo.index_select(0, rows)))

        if self.cfg.moments != FP32:
            width = spec.shape[1]
            at = (spec.offset + rows[:, None] * width + torch.arange(width)).view(-1)
            m, v = low.decode_at(tuple(self.state.flat(unit, w) for w in self.state.moment_names), at)
            h = low.Hyper.of(lr, step, self.cfg.betas, self.cfg.eps, wd)
            new = low.update(weights().view(-1), gathered().view(-1), m, v, h, spec.decay)
            out.copy_(cast(new.view(out.shape), out.dtype))  # a fetch's rounding (host/split.py)
            return
        m, v = (
            self.state.flat(unit, w)[spec.offset : spec.offset + spec.numel].view(spec.shape)
            for w in ("exp_avg", "exp_avg_sq")
        )
        kernel = self._loaded()
        if kernel is not None and out.dtype == torch.bfloat16:
            c = coef.item() if multiplies(coef) else None
            hyper = (lr, step, self.cfg.betas, self.cfg.eps, wd, torch.get_num_threads())
            kernel.rows((table, grad, m, v), rows, out, c, *hyper, index=index)
            return
        p = weights()
        m, v = (t.index_select(0, rows) for t in (m, v))
        torch._fused_adamw_(
            [p], [gathered()], [m], [v], [], [torch.full((), float(step))],
            amsgrad=False, lr=lr, beta1=b1, beta2=b2, weight_decay=wd, eps=self.cfg.eps, maximize=False,
        )  # fmt: skip
        out.copy_(cast(p, out.dtype))  # a fetch's rounding (host/split.py)

    def _loaded(self) -> clipadam.ClipAdamW | momentkernel.MomentKernel | None:
        """The kernel that steps the master's halves in its pass and multiplies the clip as it
        steps, where asked for (`fused_clip`) and it builds and checks here: clipadam's for fp32
        moments, momentkernel's for bf16 and 8-bit ones (else, and for moments of two formats, the
        join/step/split path, and `load` has warned why)."""
        if not self.fused_clip:
            return None
        if self.cfg.moments in (Q8, BF16):
            return momentkernel.load()[0]
        if self.cfg.moments != FP32:
            return None
        if self._fused is None:
            self._fused, why = clipadam.load()
            if self._fused is None:
                self.fused_clip = False
                log.warning(
                    "host AdamW: torch's kernel on fp32 made from the halves, the clip's multiply apart (%s)",
                    why,
                )
        return self._fused
