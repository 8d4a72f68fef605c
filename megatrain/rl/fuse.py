"""The rollout policy's fused projections: each decoder layer's q, k and v projections as one GEMM
(`qkv_proj`: weight [Wq; Wk; Wv], bias [bq; bk; bv]) and its gated MLP's gate and up as one
(`gate_up_proj`: [Wg; Wu]), the layout of vLLM and gpt-fast. A decode step reads every weight
once whatever the layout; one GEMM of the three shapes keeps the GPU nearer its copy rate than
three narrow ones (the k and v projections are a few hundred columns).

The transformers modules' own forwards still run: a fused module's class is swapped for a
subclass (one a class, made once a process) whose forward computes the fused projection of its
input and hands that to the original forward in the input's place, each member projection
replaced by a `Slice` of it. No state is kept between module calls, so the forward traces under
torch.compile and is captured in CUDA graphs as the original is. That holds where the module
reads its input only through its member projections and its leading shape, which the classes
named here do (FUSED_ATTENTION, FUSED_MLP; the tests check each against its unfused logits);
other modules stay as transformers builds them. Phi-3 ships both fused already.

The fused parameters are the model's only copy of the weights: PolicyModel (policy.py) writes
each member's weights into its rows of them (`fuse`'s `Member`), resident or streamed.
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

# The families (transformers' class prefixes) whose attention and gated MLP read their input only
# through the member projections and `input.shape[:-1]`; of the mixture-of-experts ones, the
# attention and the dense MLPs (Qwen2-MoE's shared expert; the experts' weights are one tensor).
FAMILIES = ("Llama", "Mistral", "Qwen2", "Qwen3", "Gemma", "Gemma2", "Gemma3", "Olmo2", "Cohere", "Granite",
            "Mixtral", "Qwen2Moe", "Qwen3Moe", "Olmoe")  # fmt: skip
FUSED_ATTENTION = {f"{f}Attention": ("qkv_proj", ("q_proj", "k_proj", "v_proj")) for f in FAMILIES}
FUSED_MLP = {f"{f}MLP": ("gate_up_proj", ("gate_proj", "up_proj")) for f in FAMILIES}
FUSED = FUSED_ATTENTION | FUSED_MLP


@dataclass(frozen=True)
class Member:
    """Where a member projection's parameter lives: `attr` of the fused module at `module` (its
    path in the model), from element `start` on."""

    module: str
    attr: str
    start: int


class Slice(torch.nn.Module):
    """A member projection of a fused one: the columns [start, stop) of the fused output. Its
    `weight` and `bias` are views of the fused module's rows (whatever parameter it holds now: a
    streamed layer's is swapped in for each forward)."""

    def __init__(self, of: torch.nn.Linear, start: int, stop: int):
        super().__init__()
        self.start, self.stop = start, stop
        self.in_features, self.out_features = of.in_features, stop - start
        object.__setattr__(self, "of", of)  # not a submodule: the parameters are the parent's

    def forward(self, fused: torch.Tensor) -> torch.Tensor:
        return fused[..., self.start : self.stop]

    @property
    def weight(self) -> torch.Tensor:
        return self.of.weight[self.start : self.stop]

    @property
    def bias(self) -> torch.Tensor | None:
        return None if self.of.bias is None else self.of.bias[self.start : self.stop]

    def extra_repr(self) -> str:
        return f"columns {self.start}:{self.stop}"


def fuse(model: torch.nn.Module) -> dict[str, Member]:
    """Fuse the projections of every module of `model` whose class FUSED names (its parameters
    not yet written: the fused ones are made on the members' device, uninitialised). Returns each
    member parameter's name -> its place in the fused parameter."""
    places: dict[str, Member] = {}
    for path, module in list(model.named_modules()):
        cls = type(module)
        spec = FUSED.get(cls.__name__) if cls.__module__.startswith("transformers.models.") else None
        members = [getattr(module, m, None) for m in spec[1]] if spec else []
        if not spec or not _fusable(members):
            continue
        fused_name, names = spec
        first = members[0]
        rows = [m.out_features for m in members]
        biased = first.bias is not None
        fused = torch.nn.Linear(first.in_features, sum(rows), bias=biased,
                                device=first.weight.device, dtype=first.weight.dtype)  # fmt: skip
        fused.requires_grad_(False)
        prefix = f"{path}.{fused_name}".lstrip(".")
        at = 0
        for name, n in zip(names, rows):
            places[f"{path}.{name}.weight".lstrip(".")] = Member(prefix, "weight", at * first.in_features)
            if biased:
                places[f"{path}.{name}.bias".lstrip(".")] = Member(prefix, "bias", at)
            setattr(module, name, Slice(fused, at, at + n))
            at += n
        module.add_module(fused_name, fused)
        module.__class__ = _fused_class(cls, fused_name)
    return places


def _fusable(members: list) -> bool:
    """Linear projections of one input, all biased or none, in one dtype on one device."""
    if not all(type(m) is torch.nn.Linear for m in members):
        return False
    first = members[0]
    return all(
        m.in_features == first.in_features
        and (m.bias is None) == (first.bias is None)
        and (m.weight.dtype, m.weight.device) == (first.weight.dtype, first.weight.device)
        for m in members
    )


@functools.cache
def _fused_class(cls: type, fused: str) -> type:
    """`cls` whose forward takes the fused projection of its input (its first argument, given by
    position or by name) in the input's place."""
    arg = list(inspect.signature(cls.forward).parameters)[1]

    class Fused(cls):
        def forward(self, *args, **kwargs):
            project = getattr(self, fused)
            if arg in kwargs:
                kwargs[arg] = project(kwargs[arg])
            else:
                args = (project(args[0]), *args[1:])
            return super().forward(*args, **kwargs)

    Fused.__name__ = Fused.__qualname__ = f"Fused{cls.__name__}"
    return Fused
