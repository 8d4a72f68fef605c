"""Host-resident model state: the units a model streams as, and their fp32 master weights and
AdamW moments in host memory.

A model is a sequence of *units*, the granularity at which weights travel to the device:
`embed`, `layers.0` ... `layers.{L-1}`, `head` (final norm + LM head). Each unit's parameters
are packed into one flat fp32 range of a single host allocation (`HostState.master`), in the
template's parameter order, each parameter's start aligned to 64 elements. The AdamW moments
have the same layout, so a unit's state is three contiguous ranges and a checkpoint is three
tensors per unit.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from .hostmem import PAGE, host_buffer
from .models.config import ModelConfig
from .models.family import checkpoint_pieces, family_of, templates

ALIGN = 64  # elements; keeps every parameter's start 256-byte aligned in fp32, 128 in bf16
# Every unit starts on a page of its own, so host memory can be page-locked in pieces cut at unit
# boundaries (hostmem.py).
UNIT_ALIGN = PAGE // 4

# Hugging Face Trainer's rule (`get_decay_parameter_names`): no weight decay on biases and
# normalisation weights.
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
        for pname, p in template.named_parameters():
            key, shape = fam.param_key(cfg, kind, layer, pname), tuple(p.shape)
            pieces = tuple(Piece(*x) for x in checkpoint_pieces(fam, cfg, kind, layer, pname, shape))
            decay = not _NO_DECAY.search(key)
            specs.append(ParamSpec(pname, key, shape, off, decay, pieces, train=p.requires_grad))
            off += -(-p.numel() // ALIGN) * ALIGN
        off = -(-off // UNIT_ALIGN) * UNIT_ALIGN
        units.append(Unit(name, kind, index, tuple(specs), off, start))
        start += off
    return units


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
    """fp32 master weights and AdamW moments of every unit, each one host allocation."""

    def __init__(self, units: list[Unit], with_optimizer: bool = True, alloc=host_buffer):
        """`alloc(numel)` makes each buffer (master, exp_avg, exp_avg_sq, in that order): by
        default private memory; the ranks of a machine share theirs (distributed.py)."""
        self.units = units
        self.numel = units[-1].start + units[-1].numel
        # Fresh zero pages, page-aligned: nothing is touched until a unit is written.
        self.master = alloc(self.numel)
        self.exp_avg = alloc(self.numel) if with_optimizer else None
        self.exp_avg_sq = alloc(self.numel) if with_optimizer else None
        self.step = 0  # optimizer steps taken

    def flat(self, unit: Unit, which: str = "master") -> torch.Tensor:
        t = getattr(self, which)
        return t[unit.start : unit.start + unit.numel]

    @property
    def boundaries(self) -> list[int]:
        """Element offsets where units start: where host memory may be cut into pieces."""
        return [u.start for u in self.units]

    def params(self, unit: Unit) -> dict[str, torch.Tensor]:
        return unit_views(self.flat(unit), unit)

    def named_parameters(self):
        """(transformers' parameter name, fp32 master view) for every parameter, in forward order."""
        for u in self.units:
            views = self.params(u)
            for p in u.params:
                yield p.key, views[p.name]

    def checkpoint_tensors(self):
        """(checkpoint key, fp32 master view) for every tensor of a Hugging Face checkpoint."""
        for u in self.units:
            yield from piece_views(self.flat(u), u)

    @property
    def num_params(self) -> int:
        return sum(p.numel for u in self.units for p in u.params)


def checkpoint_entries(units: list[Unit]) -> list[tuple[str, tuple[int, ...]]]:
    """(key, shape) of every tensor of a Hugging Face checkpoint of these units."""
    return [(c.key, c.shape) for u in units for p in u.params for c in p.pieces]
