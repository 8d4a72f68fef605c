"""Host-resident model state: the units a model streams as, and their fp32 master weights and
AdamW moments in host memory.

A model is a sequence of *units*, the granularity at which weights travel to the device:
`embed`, `layers.0` ... `layers.{L-1}`, `head` (final norm + LM head). Each unit's parameters
are packed into one flat range of each host allocation, in the template's parameter order, each
parameter's start aligned to ALIGN elements. The fp32 master weights are held as two 16-bit halves
(split.py: `hi`, the bf16 weights a fetch reads as they are, and `lo`), 4 bytes a parameter,
exact; `master` makes fp32 of them where a reader needs it. The AdamW moments have the same
layout in the dtype of their format (moments.py; an 8-bit one's absmax one element per block),
so a unit's state is a contiguous range of each buffer.

In a world partitioned over several machines (layout.py) a machine's `HostState` holds only its
*part* of each unit, a consecutive range of elements; the parts of all machines make the whole.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch

from ..models.config import ModelConfig
from ..models.family import checkpoint_pieces, family_of, templates
from .hostmem import PAGE, host_buffer
from .moments import BLOCK, FP32, Field, Moments
from .split import HALF_BYTES, HI, LO, Halves, join, split_

# Elements: every parameter starts on a block of the 8-bit moments, so a block holds one tensor as
# in bitsandbytes (512 bytes aligned in the 16-bit halves).
ALIGN = BLOCK
# Every unit starts on a page of its own in each buffer of 2-byte elements or more (the halves',
# fp32 and bf16 moments), so host memory can be page-locked in pieces cut at unit boundaries
# (hostmem.py); 8-bit moments and their absmax are locked from their units' pages (gpustep.py).
UNIT_ALIGN = PAGE // 2
MASTER = ("hi", "lo")  # the master weights' buffers: its two halves
MASTER_BYTES = HALF_BYTES  # per parameter

# Hugging Face Trainer's rule (`get_decay_parameter_names`): no weight decay on biases and
# normalisation weights, by the (lower-cased) name, and on the parameters of LayerNorm modules
# whatever their names (a vision tower's `pre_layrnorm`, `layer_norm1`, `ln_q`).
_NO_DECAY = re.compile(r"bias|layernorm|rmsnorm|(?:^|\.)norm(?:$|\.)|_norm(?:$|\.)")


@dataclass(frozen=True)
class Piece:
    """A tensor of the checkpoint: a contiguous block of a parameter."""

    key: str
    offset: int
    """Start inside the parameter (elements)."""
    shape: tuple[int, ...]


@dataclass(frozen=True)
class ParamSpec:
    name: str
    """Name inside the unit's template module, e.g. `self_attn.q_proj.weight`."""
    key: str
    """The parameter's name in transformers' model, e.g. `model.layers.3.self_attn.q_proj.weight`;
    the checkpoint key too, but for the fused expert tensors of MoE families."""
    shape: tuple[int, ...]
    offset: int
    """Start inside the unit's flat range."""
    decay: bool
    pieces: tuple[Piece, ...]
    """The checkpoint tensors it is made of: itself, or one per expert (and gate/up half)."""
    train: bool = True
    """False: a tensor of the checkpoint that no loss trains (DeepSeek-V3's router correction
    bias, a buffer in transformers): loaded, fetched and saved with its unit, never
    differentiated or stepped."""

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class Unit:
    name: str
    """`embed`, `layers.{i}` or `head`."""
    kind: str
    """`embed`, `layer` or `head`."""
    index: int
    """Position in `units` (forward order)."""
    params: tuple[ParamSpec, ...]
    numel: int
    """Flat length including alignment padding (a multiple of UNIT_ALIGN)."""
    start: int = 0
    """Start of this unit inside `HostState.master`."""


def build_units(cfg: ModelConfig) -> list[Unit]:
    """The units of a model in forward order, laid out back to back; parameters in the family's
    template order, named by its checkpoint keys."""
    fam, t = family_of(cfg), templates(cfg)
    plan = [("embed", "embed", 0, t["embed"])]
    plan += [(f"layers.{i}", "layer", i, t["layers"][k]) for i, k in enumerate(t["keys"])]
    plan += [("head", "head", 0, t["head"])]
    units, start = [], 0
    for index, (name, kind, layer, template) in enumerate(plan):
        specs, off = [], 0
        layer_norms = {
            f"{m}.{n}" if m else n
            for m, mod in template.named_modules()
            if isinstance(mod, torch.nn.LayerNorm)
            for n, _ in mod.named_parameters(recurse=False)
        }
        for pname, p in template.named_parameters():
            key, shape = fam.param_key(cfg, kind, layer, pname), tuple(p.shape)
            pieces = tuple(Piece(*x) for x in checkpoint_pieces(fam, cfg, kind, layer, pname, shape))
            decay = not _NO_DECAY.search(key.lower()) and pname not in layer_norms
            specs.append(ParamSpec(pname, key, shape, off, decay, pieces, train=p.requires_grad))
            off += -(-p.numel() // ALIGN) * ALIGN
        off = -(-off // UNIT_ALIGN) * UNIT_ALIGN
        units.append(Unit(name, kind, index, tuple(specs), off, start))
        start += off
    return units


def state_bytes(moments: Moments = FP32) -> float:
    """Host bytes a parameter's state takes: its fp32 master weight (two halves) and its AdamW moments."""
    return MASTER_BYTES + moments.bytes_per_param


def unit_views(flat: torch.Tensor, unit: Unit) -> dict[str, torch.Tensor]:
    """Parameter-shaped views of a unit's flat range (`flat` holds that unit alone)."""
    return {p.name: flat[p.offset : p.offset + p.numel].view(p.shape) for p in unit.params}


def piece_views(flat: torch.Tensor, unit: Unit):
    """(checkpoint key, view) of every checkpoint tensor of a unit (`flat` holds that unit alone)."""
    for p in unit.params:
        for c in p.pieces:
            start = p.offset + c.offset
            yield c.key, flat[start : start + math.prod(c.shape)].view(c.shape)


class HostState:
    """The master weights, as two 16-bit halves (split.py), and the AdamW moments of every unit
    (or of a part of each), each one host allocation."""

    def __init__(
        self,
        units: list[Unit],
        with_optimizer: bool = True,
        alloc=host_buffer,
        parts: list[tuple[int, int]] | None = None,
        moments: Moments = FP32,
    ):
        """`alloc(numel, dtype)` makes each buffer (the master's halves, then the moments'
        `moments.fields`, in that order): by default private memory; the ranks of a machine share
        theirs (processgroup.py). `parts`: the elements [lo, hi) of each unit held here (default:
        whole units)."""
        self.units = units
        self.parts = parts or [(0, u.numel) for u in units]
        self.whole = all(p == (0, u.numel) for p, u in zip(self.parts, units))
        lengths = [hi - lo for lo, hi in self.parts]
        self.starts = [sum(lengths[:i]) for i in range(len(units))]  # each part's place in a buffer
        self.numel = sum(lengths)
        self.moments = moments
        self._per = {f.name: f.per for f in moments.fields}
        # Fresh zero pages, page-aligned: nothing is touched until a unit is written.
        self.hi = alloc(self.numel, HI)
        """The master weights' bf16 halves: what a fetch in bf16 reads as it is."""
        self.lo = alloc(self.numel, LO)
        """Their low halves: with `hi`, the fp32 master weights exactly (`master`)."""
        for f in moments.fields:
            setattr(
                self, f.name, alloc(f.length(self.numel), getattr(torch, f.dtype)) if with_optimizer else None
            )
        self.step = 0  # optimizer steps taken
        self.tier = None
        """The disk tier holding the AdamW moments of the last units (host/disk.py's `DiskTier`),
        or None. Their moments are read and written through it only: the moment buffers stop
        where its units start."""

    @property
    def buffers(self) -> tuple[str, ...]:
        """The state's host allocations, in the order they are made: the master's halves, then
        the moment buffers."""
        return (*MASTER, *self.moment_names)

    @property
    def moment_names(self) -> tuple[str, ...]:
        """The moment buffers (`moments.fields`), in the order the optimizer takes them."""
        return tuple(self._per)

    @property
    def nbytes(self) -> int:
        """Bytes of host memory the state takes (weights, and moments where there are)."""
        buffers = [getattr(self, w) for w in self.buffers]
        return sum(b.numel() * b.element_size() for b in buffers if b is not None)

    def part(self, unit: Unit) -> tuple[int, int]:
        """The elements [lo, hi) of `unit` held here."""
        return self.parts[unit.index]

    def flat(self, unit: Unit, which: str) -> torch.Tensor:
        """The unit's part held here (the whole unit in a whole state) of buffer `which`
        (`buffers`): an 8-bit absmax has one element per block."""
        if which not in MASTER and self.tier is not None and self.tier.holds(unit):
            raise ValueError(f"{unit.name}: its AdamW moments are in the disk tier, not in host memory")
        lo, hi = self.parts[unit.index]
        start, per = self.starts[unit.index], self._per.get(which, 1)
        return getattr(self, which)[start // per : (start + hi - lo) // per]

    def range(self, unit: Unit, lo: int, hi: int, which: str) -> torch.Tensor:
        """Elements [lo, hi) of `unit` of buffer `which`, which must lie in its part held here; of
        an absmax, the blocks they cover (`lo` on a block, `hi` on one or a tensor's end)."""
        a, b = self.parts[unit.index]
        if not a <= lo <= hi <= b:
            raise ValueError(f"{unit.name}[{lo}:{hi}] is outside the part held here [{a}:{b}]")
        per = self._per.get(which, 1)
        if (lo - a) % per:
            raise ValueError(f"{unit.name}[{lo}:{hi}]: {which} is cut at blocks of {per} elements")
        return self.flat(unit, which)[(lo - a) // per : -(-(hi - a) // per)]

    def per(self, which: str) -> int:
        """Elements of the state per element of buffer `which` (an 8-bit absmax: a block's)."""
        return self._per.get(which, 1)

    def cut(self, t: torch.Tensor, lo: int, hi: int, which: str) -> torch.Tensor:
        """Elements [lo, hi) of a unit in `t`, a buffer `which` of that unit (from its start): of an
        absmax, the blocks they cover."""
        per = self._per.get(which, 1)
        return t[lo // per : -(-hi // per)]

    def halves(self, unit: Unit, lo: int | None = None, hi: int | None = None) -> Halves:
        """The master weights [lo, hi) of `unit` (default: its part held here) as their halves."""
        a, b = self.parts[unit.index]
        lo, hi = a if lo is None else lo, b if hi is None else hi
        return Halves(self.range(unit, lo, hi, "hi"), self.range(unit, lo, hi, "lo"))

    def master(self, unit: Unit | None = None, lo: int | None = None, hi: int | None = None) -> torch.Tensor:
        """The fp32 master weights [lo, hi) of `unit` (default: its part held here; no unit: every
        part held, back to back), made from the halves: a new tensor, for the readers that need
        fp32 (checkpoints, the fp32 fetches, the torch AdamW's ranges, tests)."""
        if unit is None:
            return join(Halves(self.hi, self.lo))
        return join(self.halves(unit, lo, hi))

    def set_master(self, unit: Unit, lo: int, values: torch.Tensor) -> None:
        """Write fp32 `values` (flat) as the master weights of `unit` from element `lo` on."""
        split_(values, self.halves(unit, lo, lo + values.numel()))

    def load(self, unit: Unit, which: str, entries, read: Callable[[str, int, int], torch.Tensor]) -> None:
        """Fill the part of `unit` held here of `master` (its halves) or a moment from tensors:
        `entries` are (key, start in the unit, shape) as `tensor_entries` gives them, `read(key,
        a, b)` the elements [a, b) of the tensor flattened. Tensors outside the part are not read.
        Without autograd: a copy from a tensor that requires grad (a module's parameter) would
        make the whole buffer a node of its graph, holding every such source alive (a second fp32
        copy of the model)."""
        lo, hi = self.parts[unit.index]
        if which == "master":
            fill_range(self.halves(unit), lo, hi, entries, read)
        else:
            per = self._per.get(which, 1)  # an absmax's entries count blocks (`moment_entries`)
            fill_range(self.flat(unit, which), lo // per, -(-hi // per), entries, read)

    def _whole(self) -> None:
        if not self.whole:
            raise RuntimeError("this host state holds a part of the model (partitioned over machines)")

    @property
    def boundaries(self) -> list[int]:
        """Element offsets where units start: where host memory may be cut into pieces."""
        return list(self.starts)

    def params(self, unit: Unit) -> dict[str, Halves]:
        """The unit's parameters, by template name, as the halves of their master weights."""
        self._whole()
        h = self.halves(unit)
        return {p.name: h[p.offset : p.offset + p.numel].view(p.shape) for p in unit.params}

    def named_parameters(self, elsewhere: dict[int, torch.Tensor] | None = None):
        """(transformers' parameter name, master weights) for every parameter, in forward order:
        the halves' views (split.py's `Halves`), or for a unit of `elsewhere` (unit index -> its
        flat fp32 master weights, e.g. on the device) fp32 views of those. A consumer takes them
        in its dtype with split.cast (bf16: the halves' `hi` as it is) or fetches the halves."""
        for u in self.units:
            views = (
                unit_views(elsewhere[u.index], u) if elsewhere and u.index in elsewhere else self.params(u)
            )
            for p in u.params:
                yield p.key, views[p.name]

    def checkpoint_tensors(self):
        """(checkpoint key, its master weights as halves) for every tensor of a Hugging Face
        checkpoint: written in bf16 as their `hi`, in fp32 joined (io/writing.py, split.cast)."""
        self._whole()
        for u in self.units:
            h = self.halves(u)
            for p in u.params:
                for c in p.pieces:
                    start = p.offset + c.offset
                    yield c.key, h[start : start + math.prod(c.shape)].view(c.shape)

    @property
    def num_params(self) -> int:
        return sum(p.numel for u in self.units for p in u.params)


@torch.no_grad()
def fill_range(
    flat: torch.Tensor | Halves, lo: int, hi: int, entries, read: Callable[[str, int, int], torch.Tensor]
) -> None:
    """Fill `flat`, elements [lo, hi) of a unit (fp32, or the master's halves), from the tensors of
    `entries` (key, start in the unit, shape) that meet it; `read(key, a, b)`: the elements
    [a, b) of the tensor flattened, in any float dtype."""
    for key, start, shape in entries:
        a, b = max(lo, start), min(hi, start + math.prod(shape))
        if a < b:
            values = read(key, a - start, b - start)
            if isinstance(flat, Halves):
                split_(values, flat[a - lo : b - lo])
            else:
                flat[a - lo : b - lo].copy_(values)


def tensor_entries(unit: Unit, per: str = "piece") -> Iterable[tuple[str, int, tuple[int, ...]]]:
    """(key, start in the unit's flat range, shape) of the unit's checkpoint tensors (`piece`: the
    Hugging Face tensors, one per expert where a parameter is fused) or of its parameters
    (`param`: the AdamW moments are keyed by parameter)."""
    for p in unit.params:
        if per == "param":
            yield p.key, p.offset, p.shape
        else:
            for c in p.pieces:
                yield c.key, p.offset + c.offset, c.shape


def moment_entries(unit: Unit, field: Field) -> Iterable[tuple[str, int, tuple[int, ...]]]:
    """(key, start, shape) of a moment buffer's checkpoint tensors of `unit`, in that buffer's
    elements: one per parameter, keyed `<field>.<parameter key>`, the parameter's shape, or an
    absmax's blocks of it (bitsandbytes' absmax of a tensor)."""
    for p in unit.params:
        shape = p.shape if field.per == 1 else (field.length(p.numel),)
        yield f"{field.name}.{p.key}", p.offset // field.per, shape


def checkpoint_entries(units: list[Unit]) -> list[tuple[str, tuple[int, ...]]]:
    """(key, shape) of every tensor of a Hugging Face checkpoint of these units."""
    return [(c.key, c.shape) for u in units for p in u.params for c in p.pieces]
