"""Measure one decoder layer's activation memory on the device a run will use.

How much memory one layer's autograd graph holds per token is not a simple function of the
layer's shape once `torch.compile` decides which intermediates to save and which to recompute
(measured on Hopper: 27 bytes per token x hidden for a 3072-wide layer, 42 for a 6144-wide one).
So before a CUDA run is planned, the layer the engine will run (same template, dtype and
compilation) is run on random data at two token counts, and the allocator's counters give the
bytes per token of its graph and the peak while it is differentiated. placement.py turns these
into the plan; without a device (`megatrain plan` on a login node) it uses a conservative
formula instead. The probe decides nothing.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
from torch.func import functional_call

from .models.config import ModelConfig
from .models.decoder import rope_cos_sin, rope_inv_freq
from .models.moe import layer_class

PROBE_TOKENS = 8192  # the largest token count the probe runs (it also runs a quarter of it)


@dataclass(frozen=True)
class LayerMemory:
    """Bytes of one decoder layer's activations, as linear functions of its tokens."""

    graph_per_token: float
    """Saved tensors of a forward with autograd (its output excluded)."""
    backward_per_token: float
    backward_fixed: float
    """Peak above the graph while the layer is differentiated, its parameter gradients excluded:
    backward_fixed + backward_per_token * tokens (the intercept may be negative: the graph is
    freed as the backward runs)."""
    forward_per_token: float
    """Peak above the input of a forward without autograd (its output excluded)."""
    flops_per_s: float | None = None
    """The rate the layer's forward + backward ran at (matmul and attention FLOPs / s)."""

    def graph(self, tokens: int) -> int:
        return int(self.graph_per_token * tokens)

    def backward(self, tokens: int) -> int:
        return max(0, int(self.backward_fixed + self.backward_per_token * tokens))

    def forward(self, tokens: int) -> int:
        return int(self.forward_per_token * tokens)


def probe_layer_memory(
    cfg: ModelConfig, device, dtype: torch.dtype, compile: bool, tokens: int
) -> LayerMemory:
    """Run one layer at `tokens` and a quarter of it (one sequence each) and measure."""
    device = torch.device(device)
    with torch.device("meta"):
        layer = layer_class(cfg)(cfg)  # an MoE layer as it runs: router, grouped experts
    params = {n: (torch.randn(p.shape, device=device) * 0.02).to(dtype) for n, p in layer.named_parameters()}
    leaves = {n: t.detach().requires_grad_() for n, t in params.items()}
    pgrads = sum(t.numel() * t.element_size() for t in params.values())
    inv, scale = rope_inv_freq(cfg)
    inv = inv.to(device)

    def call(p, x, cos, sin):
        out = functional_call(layer, p, (x, (cos, sin), None))
        return out[0] if cfg.moe else out  # the hidden state, not the router statistics

    fn = torch.compile(call) if compile else call
    sizes = sorted({max(128, tokens // 4), max(128, tokens)})
    rows = []
    for t in sizes:
        pos = torch.arange(t, device=device)[None]
        cos, sin = rope_cos_sin(inv, scale, pos, dtype)
        x = torch.randn(1, t, cfg.hidden_size, device=device, dtype=dtype)
        for _ in range(2):  # the first compiles; the second is measured
            t0 = time.perf_counter()
            rows.append((t, *_measure(fn, leaves, params, x, cos, sin, pgrads, device)))
            elapsed = time.perf_counter() - t0
        rows.pop(-2)
        del x
    torch.cuda.empty_cache()
    (t1, g1, b1, f1), (t2, g2, b2, f2) = rows[0], rows[-1]
    n = sum(t.numel() for t in params.values())
    n -= cfg.moe.inactive_params(cfg.hidden_size) if cfg.moe else 0  # what a token passes through
    q = cfg.num_attention_heads * cfg.head_dim
    flops = 3 * (2 * n * t2 + 2 * t2 * t2 * q) + (2 * n * t2 + 2 * t2 * t2 * q)  # + the no-grad forward
    slope = (b2 - b1) / (t2 - t1) if t2 > t1 else b2 / t2
    return LayerMemory(
        graph_per_token=max(g1 / t1, g2 / t2),
        backward_per_token=slope,
        backward_fixed=b2 - slope * t2,
        forward_per_token=max(f1 / t1, f2 / t2),
        flops_per_s=flops / elapsed,
    )


def _measure(fn, leaves, params, x, cos, sin, pgrads, device) -> tuple[int, int, int]:
    """(graph bytes, backward peak above the graph less parameter gradients, forward peak)."""
    out_bytes = x.numel() * x.element_size()
    xr = x.detach().requires_grad_()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    with torch.enable_grad():
        y = fn(leaves, xr, cos, sin)
    graph = torch.cuda.memory_allocated(device) - base - out_bytes
    dy = torch.randn_like(y)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    grads = torch.autograd.grad(y, [xr, *leaves.values()], dy)
    torch.cuda.synchronize(device)
    backward = torch.cuda.max_memory_allocated(device) - before - pgrads
    del grads, y, dy, xr
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.no_grad():
        y = fn(params, x, cos, sin)
    torch.cuda.synchronize(device)
    forward = torch.cuda.max_memory_allocated(device) - before - out_bytes
    del y
    return graph, backward, forward


def layer_memory_for(
    cfg: ModelConfig, device, dtype: torch.dtype, compile: bool | None, micro_batch_tokens: int
) -> LayerMemory | None:
    """The probe for a run on `device` (None off CUDA, where the plan's formula is used);
    `compile` as the engine will run the layer (None: on, the CUDA default)."""
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    compile = True if compile is None else compile
    return probe_layer_memory(cfg, device, dtype, compile, min(micro_batch_tokens, PROBE_TOKENS))


def adam_rate(numel: int = 32 * 2**20) -> float:
    """Parameters per second of the fused CPU AdamW on this host's threads, alone."""
    p, g, m, v = (torch.rand(numel) for _ in range(4))
    steps = [torch.tensor(1.0)]

    def once() -> float:
        t0 = time.perf_counter()
        torch._fused_adamw_(
            [p],
            [g],
            [m],
            [v],
            [],
            steps,
            amsgrad=False,
            lr=1e-5,
            beta1=0.9,
            beta2=0.999,
            weight_decay=0.0,
            eps=1e-8,
            maximize=False,
        )
        return time.perf_counter() - t0

    once()
    return numel / min(once() for _ in range(3))
