"""The rollout's transformers model of a policy on the device (rollout.py samples with it and
computes the reference log-probs with it): the embedding, the final norm, the LM head and the
first `resident` decoder layers in the compute dtype on the device, and the other decoder layers
streamed through the device during every forward (the prefill and each decode step of
transformers' `generate`, which stays the decode loop). Each layer's q/k/v and gate/up
projections are one fused parameter each where fuse.py knows the layer: every member's weights are
written (or fetched) straight into their rows of it, so the fused layout costs no copy.

A streamed layer's weights are fetched one layer ahead, on a copy stream of their own, into one
of SLOTS rotating device buffers: the layer waits for its fetch's event before it computes, and a
buffer is written again only after the layer that read it has finished (an event recorded on the
compute stream). The fetch after the last streamed layer is the first one's, for the next
forward: it overlaps the head, the sampling and the next step's resident layers. The KV cache of
every layer stays on the device, as the whole policy's does. The weights are the same numbers in
the same ops as a resident model's, so the completions are bitwise the same; on the CPU the
fetches are plain copies, so the same code runs (and is tested) there.

The source of the streamed weights is the one the caller holds. For the policy: the host state's
master weights as their halves (host/split.py), which the engine's transport page-locks in place:
in bf16 a fetch moves their `hi` straight into its device buffer (2 bytes a parameter, the numbers
the engine's own fetch brings), in fp32 both halves, joined on the device through a landing
buffer; units whose fp32 state lives on the device are cast there by the halves' rounding. The
reference policy's weights (beta > 0) are already a host copy in the compute dtype
(stages.grpo_reference), fetched as they are. (Measured on one H100 before the halves, a 7B model
with 14 of 28 layers streamed from the fp32 master: 452 completion tokens/s against 3,514 with the
policy resident; the link set the rate.)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from ..host.split import HI, Halves, cast, join_, to_bf16
from ..planning.footprint import ROLLOUT_BUFFERS as SLOTS
from .fuse import fuse

ALIGN = 256  # elements: every view in a buffer starts 512-byte aligned in bf16, as an allocation


@dataclass
class _Param:
    """A parameter of a streamed layer: its view of the layer's buffer, installed for the forward."""

    module: torch.nn.Module
    name: str
    offset: int  # in the layer's buffer
    shape: torch.Size
    placeholder: torch.nn.Parameter  # on the meta device: the module's between its forwards


@dataclass
class _Source:
    """Weights a streamed layer fetches: a whole parameter's, or a fused parameter's member's."""

    offset: int  # in the layer's buffer
    source: torch.Tensor | Halves  # in host memory (the master's halves), or fp32 on the device


class PolicyModel:
    """A transformers model of `weights` ((name, weights) pairs, transformers' names: tensors, or
    the master's halves) for `hf_config`, on `device` in `dtype`, its decoder layers from
    `resident` on streamed (None: none streamed), its projections fused where fuse.py knows the
    layer (`fused` False: as transformers builds them, for comparison). Use it in a `with` block:
    leaving it waits for the last fetch and frees the buffers."""

    def __init__(self, hf_config, weights: Iterable[tuple[str, torch.Tensor | Halves]], device, dtype,
                 resident: int | None = None, fused: bool = True):  # fmt: skip
        import transformers

        self.device, self.dtype = torch.device(device), dtype
        with _parameters_on_meta(), torch.device(self.device):  # buffers (RoPE's) made as usual
            self.model = transformers.AutoModelForCausalLM.from_config(hf_config, dtype=dtype).eval()
        self.fused = fuse(self.model) if fused else {}  # a member's name -> its fused parameter's rows
        layers = list(self.model.get_decoder().layers)
        resident = len(layers) if resident is None else min(resident, len(layers))
        streamed = layers[resident:]
        self.streamed_layers = len(streamed)
        owner = {id(m): i for i, layer in enumerate(streamed) for m in layer.modules()}
        # The weights must give every parameter, a fused one by its members: (id, start) -> name.
        unwritten = {(i, 0): name for i, name in self._materialize(owner).items()}
        for name, m in self.fused.items():
            unwritten[(id(getattr(self.model.get_submodule(m.module), m.attr)), m.start)] = name
        # Each streamed layer's parameters, one after another in its buffer (a fused one's members
        # adjacent in it, as in the parameter), and the weights fetched into them.
        self.layers: list[list[_Param]] = [[] for _ in streamed]
        self.sources: list[list[_Source]] = [[] for _ in streamed]
        ends = [0] * len(streamed)
        offsets: dict[int, int] = {}
        for i, layer in enumerate(streamed):
            for module in layer.modules():
                for name, p in module._parameters.items():
                    if p is not None:
                        self.layers[i].append(_Param(module, name, ends[i], p.shape, p))
                        offsets[id(p)], ends[i] = ends[i], ends[i] + -(-p.numel() // ALIGN) * ALIGN
        with torch.no_grad():
            for name, value in weights:
                member = self.fused.get(name)
                path, _, attr = name.rpartition(".")
                start = 0
                if member is not None:
                    path, attr, start = member.module, member.attr, member.start
                module = self.model.get_submodule(path)
                i = owner.get(id(module))
                target = getattr(module, attr)  # in its dtype (a buffer kept in fp32 too)
                unwritten.pop((id(target), start), None)
                if i is None or attr not in module._parameters:  # resident, or a buffer (made on the device)
                    into = (
                        target
                        if member is None
                        else target.view(-1)[start:][: value.numel()].view(value.shape)
                    )
                    into.copy_(cast(value, target.dtype), non_blocking=True)
                    continue
                self.sources[i].append(_Source(offsets[id(target)] + start, value))
        if unwritten:
            raise ValueError(f"no weights for {', '.join(list(unwritten.values())[:3])}")
        # Whether the model reads none of `weights` after its build (a snapshot of the weights,
        # rl/offpolicy.py): every layer on the device. Streamed layers read the master's halves,
        # which the next update rewrites.
        self.owns_weights = not streamed
        self.fetched_bytes = 0
        self.stream = _LayerStream(self, max(ends, default=0)) if streamed else None
        # Removed on leaving: they refer to this object, which holds the model, and a cycle would
        # keep the model's device memory until the garbage collector ran (into the update's).
        self.hooks = [
            hook
            for i, layer in enumerate(streamed)
            for hook in (
                layer.register_forward_pre_hook(lambda m, args, i=i: self.stream.before(i)),
                layer.register_forward_hook(lambda m, args, out, i=i: self.stream.after(i)),
            )
        ]

    def _materialize(self, streamed: dict[int, int]) -> dict[int, str]:
        """Every parameter outside the streamed layers allocated on the device (a tied head keeps
        its embedding's); the streamed layers' stay on the meta device between their forwards.
        Returns every parameter, by id, with its name: the weights must give each."""
        made: dict[int, torch.nn.Parameter] = {}
        names: dict[int, str] = {}
        for path, module in self.model.named_modules():
            for name, p in module._parameters.items():
                if p is None:
                    continue
                if id(module) in streamed:  # stays on the meta device
                    names[id(p)] = f"{path}.{name}"
                    continue
                if id(p) not in made:
                    made[id(p)] = torch.nn.Parameter(
                        torch.empty_like(p, device=self.device), requires_grad=False
                    )
                    names[id(made[id(p)])] = f"{path}.{name}".lstrip(".")
                module._parameters[name] = made[id(p)]
        return names

    def __enter__(self):
        return self.model

    def __exit__(self, *exc):
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        if self.stream is not None:
            self.stream.close()
            self.stream = None  # it refers back to this object


class _LayerStream:
    """The streamed layers' fetches (see the module docstring): the n-th fetch of a rollout goes to
    buffer n mod SLOTS, issued as the layer before it starts."""

    def __init__(self, policy: PolicyModel, numel: int):
        self.policy, self.layers, self.sources = policy, policy.layers, policy.sources
        device, dtype = policy.device, policy.dtype
        self.cuda = device.type == "cuda"
        self.buffers = [torch.empty(numel, dtype=dtype, device=device) for _ in range(SLOTS)]
        # In fp32 the master's halves land here and are joined into the buffer: one landing
        # buffer, as the copies and the joins are in order on the copy stream.
        halves = any(isinstance(s.source, Halves) for layer in self.sources for s in layer)
        self.landing = None
        if halves and dtype != HI:
            self.landing = Halves(
                torch.empty(numel, dtype=HI, device=device),
                torch.empty(numel, dtype=torch.int16, device=device),
            )
        self.copies = torch.cuda.Stream(device) if self.cuda else None
        self.compute = torch.cuda.current_stream(device) if self.cuda else None
        self.free: list[torch.cuda.Event | None] = [None] * SLOTS  # when each buffer's reader finished
        self.slot = 0  # the buffer of the next fetch
        self.pending: tuple[int, int, torch.cuda.Event | None] | None = None  # (layer, buffer, ready)
        self.current: int | None = None

    def before(self, i: int) -> None:
        """Layer `i` (of the streamed ones) is about to compute: its weights in place, the next
        layer's fetch issued."""
        if self.pending is None or self.pending[0] != i:
            self._fetch(i)
        _, slot, ready = self.pending
        if ready is not None:
            self.compute.wait_event(ready)
        buf = self.buffers[slot]
        for p in self.layers[i]:
            view = buf[p.offset : p.offset + p.shape.numel()].view(p.shape)
            p.module._parameters[p.name] = torch.nn.Parameter(view, requires_grad=False)
        self.current = slot
        self._fetch((i + 1) % len(self.layers))

    def after(self, i: int) -> None:
        """Layer `i` has computed: its buffer may be written once the compute stream gets here."""
        if self.cuda:
            self.free[self.current] = self.compute.record_event()
        for p in self.layers[i]:  # no view of a buffer outlives its layer's forward
            p.module._parameters[p.name] = p.placeholder

    def _fetch(self, i: int) -> None:
        slot, self.slot = self.slot, (self.slot + 1) % SLOTS
        buf = self.buffers[slot]
        with torch.cuda.stream(self.copies) if self.cuda else contextlib.nullcontext():
            if self.free[slot] is not None:
                self.copies.wait_event(self.free[slot])
            for s in self.sources[i]:
                self._copy(s, buf[s.offset : s.offset + s.source.numel()])
            ready = self.copies.record_event() if self.cuda else None
        self.pending = (i, slot, ready)

    def _copy(self, s: _Source, into: torch.Tensor) -> None:
        """Queue the weights of `s` into `into` (flat, the policy's dtype, on the device)."""
        src, n = s.source, into.numel()
        if isinstance(src, Halves) and into.dtype == HI:  # the master's hi, as it is
            into.copy_(src.hi.view(-1), non_blocking=True)
            self.policy.fetched_bytes += 2 * n
        elif isinstance(src, Halves):  # fp32: both halves, joined here
            stage = self.landing[s.offset : s.offset + n]
            for dst, half in zip(stage, src):
                dst.copy_(half.view(-1), non_blocking=True)
            join_(stage, into)
            self.policy.fetched_bytes += 4 * n
        elif src.dtype == into.dtype:
            into.copy_(src.view(-1), non_blocking=True)
            self.policy.fetched_bytes += n * src.element_size()
        else:  # fp32 state on the device, cast there by the halves' rounding
            to_bf16(src.reshape(-1).to(into.device), out=into)

    def close(self) -> None:
        if self.cuda:
            self.copies.synchronize()  # the last fetch (the next forward's) still writes a buffer
        self.buffers, self.landing = [], None


@contextlib.contextmanager
def _parameters_on_meta():
    """Every parameter a module registers inside goes to the meta device (no memory, no random
    initialisation); buffers are made where the default device says. A tied head registers its
    embedding's meta parameter again, which stays itself."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and not param.is_meta:
            module._parameters[name] = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register
