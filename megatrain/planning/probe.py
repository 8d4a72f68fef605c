"""Measure one decoder layer's activation memory on the device a run will use.

How much memory one layer's autograd graph holds per token is not a simple function of the
layer's shape once `torch.compile` decides which intermediates to save and which to recompute
(measured on Hopper: 27 bytes per token x hidden for a 3072-wide layer, 42 for a 6144-wide one).
So before a CUDA run is planned, the layer the engine will run (same template, dtype and
compilation) is run on random data at two token counts, and the allocator's counters give the
bytes per token of its graph and the peak while it is differentiated: untiled, and with its MLP
tiled over the sequence only when a plan asks (`LayerProbe`: no untiled placement fits, or only a
two-pass one; six of the probe's ten compiles). placement.py turns these into the plan; without a
device (`megatrain plan` on a login node) `formula_layer_memory` gives a conservative estimate.
Beside it the host AdamW's rate (`adam_rate`: torch's fused fp32 kernel; `best_pass` times any
kernel's pass, engine/momentkernel.py's for bf16 and 8-bit moments). The probe decides nothing.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch
from torch.func import functional_call

from ..models.compiling import compiled
from ..models.config import ModelConfig
from ..models.decoder import set_mlp_tiles, tiled_backward_phases
from ..models.family import family_of, templates

Quiet = Callable[[], contextlib.AbstractContextManager]  # what a timed pass runs inside
PROBE_TOKENS = 8192  # the largest token count the probe runs (it also runs a quarter of it)
PROBE_TILES = 4  # MLP tiles in the smaller probe of the tiled layer
# The causal attention kernel alone, timed at a length where its work dominates a layer's: at long
# context it runs slower than the layer's matmuls (8B, H200: ~450 against ~630 TFLOP/s, fitted on
# the 128k-400k runs), which one rate for both would hide.
ATTENTION_PROBE_TOKENS = 32768
# Without a flash kernel (fp32: SDPA's math path, which grouped-query attention also takes) the
# kernel holds about this many [heads, tokens, tokens] score tensors over its forward and backward.
SCORE_COPIES = 4
# On the CPU the plan times one matmul shaped like the layer's MLP projection, each side capped at
# these sizes (beyond them a CPU's GEMM runs no faster), for at least CPU_PROBE_SECONDS.
CPU_PROBE_TOKENS, CPU_PROBE_WIDTH, CPU_PROBE_SECONDS = 512, 1024, 0.05
CPU_ADAM_PROBE = 4 * 2**20  # parameters a CPU run's AdamW rate is timed on (64 MB of state: past the caches)
ADAM_PROBE = 32 * 2**20  # and a CUDA run's (a pass ~5 ms on a 32-core host)
ADAM_PROBE_SECONDS = 0.1  # the AdamW rate is the best pass over at least this long

# One decoder layer's activations when no device is there to measure them: bytes per token =
# cb * (a*hidden + b*ffn), bf16, compiled layer, Hopper (bench/calibrate.py). An upper envelope of
# four measured shapes (hidden 3072..12288): within 1-4% for wide layers, up to 1.5x for narrow ones.
GRAPH_H, GRAPH_F = 14.4, 2.5  # the ffn term: the MLP's saved intermediates
BACKWARD_H = 5.4  # peak above the graph while differentiating (parameter gradients aside)
FORWARD_H = 9.0  # peak above the input of a forward without autograd
MOE_ROWS = 3  # not measured: an MoE layer's [tokens x top-k, hidden] tensors kept for backward, rounded up
# Not measured: latent attention (DeepSeek) keeps per head q and k at the qk width, v, the output
# and o_proj's input at the v width, kv_b_proj's output and the rotated query part; all counted
# on top of the GRAPH_H, BACKWARD_H and FORWARD_H terms, which already cover a Llama attention.
# One tile of the tiled MLP, per tile token x ffn (estimates, not measured): gate, up, their
# product's inputs and, in the backward, their gradients; a forward holds gate, up and the product.
TILE_BACKWARD_F, TILE_FORWARD_F = 8.0, 3.0


@dataclass(frozen=True)
class LayerMemory:
    """Bytes of one decoder layer's activations, as linear functions of its tokens (and, with the
    MLP tiled, of the tile's tokens)."""

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
    dense_flops_per_s: float | None = None
    attention_flops_per_s: float | None = None
    """The same split: the causal attention kernel's rate alone (timed at ATTENTION_PROBE_TOKENS,
    its FLOPs counted as costmodel.py counts them) and the rest of the layer's, the probe's time
    less its attention's at that rate (None: not measured; the plan uses `flops_per_s` for all)."""
    tiled_graph_per_token: float | None = None
    """The same rates with the MLP tiled (None: not known, the plan never tiles). The backward of
    a tiled layer has two phases whose peaks are measured apart: the MLP's tile loop (the fp32
    weight-gradient sums, one tile's intermediates, the layer's incoming and outgoing gradients)
    and the rest of the layer (attention above all); its peak is the larger of the two."""
    tiled_backward_per_token: float = 0.0
    tiled_backward_fixed: float = 0.0
    tiled_backward_proportional: float = 0.0
    """The rest of the tiled layer's backward: the larger of fixed + per_token * tokens (the line
    through both probe sizes) and proportional * tokens (through the larger one): its peak moves
    from fixed costs at few tokens to the attention's gradients at many, so the line through
    small counts alone would under-count long sequences."""
    tiled_forward_per_token: float = 0.0
    mlp_backward_per_token: float = 0.0
    """The MLP's tile loop: tile_fixed + mlp_backward_per_token * tokens ..."""
    tile_backward_per_token: float = 0.0
    """... + tile_backward_per_token * tile."""
    tile_forward_per_token: float = 0.0
    """A forward without autograd, per tile token beyond tiled_forward_per_token * tokens."""
    tile_fixed: float = 0.0
    """The loop's bytes that grow with neither: the fp32 sums of the MLP's weight gradients and
    one tile's weight gradients (at least)."""

    def tiles(self, tokens: int, tile: int) -> bool:
        """Whether a layer with MLP tiles of `tile` tokens tiles a micro-batch of `tokens`."""
        return bool(tile) and tokens > tile and self.tiled_graph_per_token is not None

    def graph(self, tokens: int, tile: int = 0) -> int:
        rate = self.tiled_graph_per_token if self.tiles(tokens, tile) else self.graph_per_token
        return int(rate * tokens)

    def backward(self, tokens: int, tile: int = 0) -> int:
        if self.tiles(tokens, tile):
            return max(0, self.tile_loop(tokens, tile), self.tiled_rest(tokens))
        return max(0, int(self.backward_fixed + self.backward_per_token * tokens))

    def tile_loop(self, tokens: int, tile: int) -> int:
        """The tiled layer's backward while its MLP's tile loop runs."""
        per_tile = self.tile_backward_per_token * tile
        return int(self.tile_fixed + self.mlp_backward_per_token * tokens + per_tile)

    def tiled_rest(self, tokens: int) -> int:
        """The tiled layer's backward outside the tile loop (parameter gradients excluded)."""
        line = self.tiled_backward_fixed + self.tiled_backward_per_token * tokens
        return int(max(line, self.tiled_backward_proportional * tokens))

    def graph_peak(self, tokens: int, tile: int = 0) -> int:
        """The peak of a forward with autograd: its graph and, with the MLP tiled, one tile's
        intermediates beside it (the tile loop saves only its input)."""
        extra = self.tile_forward_per_token * tile if self.tiles(tokens, tile) else 0
        return int(self.graph(tokens, tile) + extra)

    def forward(self, tokens: int, tile: int = 0) -> int:
        if self.tiles(tokens, tile):
            return int(self.tiled_forward_per_token * tokens + self.tile_forward_per_token * tile)
        return int(self.forward_per_token * tokens)


def mlp_sums_bytes(cfg: ModelConfig, compute_bytes: int) -> int:
    """The tiled MLP's fp32 weight-gradient sums beside one tile's gradients in compute dtype."""
    return (4 + compute_bytes) * 3 * cfg.hidden_size * cfg.intermediate_size


def token_ffn(cfg: ModelConfig) -> int:
    """The MLP width a token passes through: the dense MLP's, or its experts' and shared expert's
    (the wider of the two where dense layers come first, as in DeepSeek)."""
    if cfg.moe is None:
        return cfg.intermediate_size
    if cfg.moe.dense_layers:
        return max(cfg.moe.token_ffn, cfg.intermediate_size)
    return cfg.moe.token_ffn


def latent_attention_width(cfg: ModelConfig) -> int:
    """Per token, the elements latent attention keeps beyond a Llama attention (the note under
    MOE_ROWS); 0 for other attention."""
    m = cfg.mla
    if m is None:
        return 0
    heads = cfg.num_attention_heads * (2 * m.qk_head_dim + 3 * m.v_head_dim + m.qk_rope_head_dim)
    heads += cfg.num_attention_heads * (m.qk_nope_head_dim + m.v_head_dim)  # kv_b_proj's output
    return heads + 2 * (m.q_lora_rank or 0) + 2 * m.kv_lora_rank + m.qk_rope_head_dim


def formula_layer_memory(cfg: ModelConfig, compute_bytes: int) -> LayerMemory:
    """A conservative estimate of one layer's activation memory (see GRAPH_H). An MoE layer
    counts as an MLP as wide as the experts a token passes through (`token_ffn`), plus MOE_ROWS
    hidden-sized rows per routed copy of a token (gathered input, weighted output); its experts
    are not tiled (only a shared expert is), so its tiled graph is counted as the untiled one.
    gpt-oss's clamped SwiGLU counts as a SwiGLU: compiled, its pointwise chain between the two
    grouped products fuses, keeping gate_up and the product as SwiGLU does (not measured). Latent
    attention adds its wider tensors to the graph and both peaks (`latent_attention_width`)."""
    h, f, cb = cfg.hidden_size, token_ffn(cfg), compute_bytes
    rows = MOE_ROWS * cfg.moe.top_k * h if cfg.moe else 0
    attn = latent_attention_width(cfg)
    graph = cb * (GRAPH_H * h + GRAPH_F * f + rows + attn)
    return LayerMemory(
        graph,
        cb * (BACKWARD_H * h + attn),
        0.0,
        cb * (FORWARD_H * h + attn),
        tiled_graph_per_token=graph if cfg.moe else cb * (GRAPH_H * h + attn),
        tiled_backward_per_token=cb * (BACKWARD_H * h + attn),
        tiled_forward_per_token=cb * (FORWARD_H * h + attn),
        mlp_backward_per_token=cb * (BACKWARD_H * h + attn),  # the loop's phase also counted in full
        tile_backward_per_token=cb * TILE_BACKWARD_F * f,
        tile_forward_per_token=cb * TILE_FORWARD_F * f,
        tile_fixed=mlp_sums_bytes(cfg, cb),
    )


def _probe_sizes(tokens: int) -> tuple[list[int], int]:
    """The token counts a layer is probed at (`tokens` and a quarter of it) and its tile."""
    sizes = sorted({max(128, tokens // 4), max(128, tokens)})
    return sizes, max(32, sizes[0] // PROBE_TILES)


def _probe_params(cfg: ModelConfig, i: int, device, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    layer = family_of(cfg).layer(cfg, i)
    return {n: (torch.randn(p.shape, device=device) * 0.02).to(dtype) for n, p in layer.named_parameters()}


def probe_untiled(
    cfg: ModelConfig,
    device,
    dtype: torch.dtype,
    compile: bool,
    tokens: int,
    masked: bool = False,
    quiet: Quiet = contextlib.nullcontext,
) -> LayerMemory:
    """Run one layer untiled at `tokens` and a quarter of it (one sequence each) and measure it
    (its tiled fields None): the family's template of the largest full-attention layer where
    there is one (the largest working set: DeepSeek's expert layers, not its dense first ones);
    `masked`: through the attention a run with packed rows or a sliding window uses (a
    one-document block mask, the model's window); `quiet`: what the timed passes run inside (the
    host's other work held: runtime.WeightsFill)."""
    device = torch.device(device)
    i = probed_layer(cfg)
    params = _probe_params(cfg, i, device, dtype)
    sizes, _ = _probe_sizes(tokens)
    (t1, g1, b1, f1, _), (t2, g2, b2, f2, _), elapsed = _probe(
        cfg, i, params, device, dtype, compile, sizes, 0, masked, quiet
    )
    n = sum(t.numel() for t in params.values())
    n -= cfg.moe.inactive_params(cfg.hidden_size) if cfg.moe else 0  # what a token passes through
    q = cfg.attention_width
    flops = 3 * (2 * n * t2 + 2 * t2 * t2 * q) + (2 * n * t2 + 2 * t2 * t2 * q)  # + the no-grad forward
    slope, fixed = _line((t1, b1), (t2, b2))
    rates = _split_rates(cfg, device, dtype, flops, 4 * 2 * t2 * t2 * q, elapsed, quiet)
    return LayerMemory(
        graph_per_token=max(g1 / t1, g2 / t2),
        backward_per_token=slope,
        backward_fixed=fixed,
        forward_per_token=max(f1 / t1, f2 / t2),
        flops_per_s=flops / elapsed,
        **rates,
    )


def probe_tiled(
    untiled: LayerMemory,
    cfg: ModelConfig,
    device,
    dtype: torch.dtype,
    compile: bool,
    tokens: int,
    masked: bool = False,
) -> LayerMemory:
    """`untiled` (`probe_untiled`'s) with the same layer measured with MLP tiles of a quarter of
    the smaller count, at both counts, and with tiles four times as long at the larger one (on
    weights of its own: its memory depends on their shapes alone)."""
    device = torch.device(device)
    i = probed_layer(cfg)
    params = _probe_params(cfg, i, device, dtype)
    sizes, tile = _probe_sizes(tokens)
    (t1, tg1, tb1, tf1, tl1), (t2, tg2, tb2, tf2, tl2), _ = _probe(
        cfg, i, params, device, dtype, compile, sizes, tile, masked
    )
    # a third run at the larger count with tiles four times as long separates tiles from tokens
    (_, _, _, tf3, tl3), _, _ = _probe(cfg, i, params, device, dtype, compile, [t2], 4 * tile, masked)
    sums = mlp_sums_bytes(cfg, dtype.itemsize)
    tiled = dict(tiled_graph_per_token=max(tg1 / t1, tg2 / t2))
    t_slope, t_fixed = _line((t1, tb1), (t2, tb2))
    tf_slope, _ = _line((t1, tf1), (t2, tf2))
    tiled.update(tiled_backward_per_token=t_slope, tiled_backward_fixed=t_fixed)
    tiled.update(tiled_backward_proportional=tb2 / t2, tiled_forward_per_token=tf_slope)
    tile_fwd = (tf2 - tf_slope * t2) / tile
    if tl3 is not None:
        tile_fwd = max(tile_fwd, (tf3 - tf2) / (3 * tile))
    # A tile's intermediates are measured on tiles of a few hundred to a few thousand tokens, where
    # the loop's other buffers hide part of them; counted as at least the formula's (an 8B run
    # whose plan took 69.6 kB per tile token where the formula says 229 died in its tile loop).
    floor = formula_layer_memory(cfg, dtype.itemsize)
    tiled.update(tile_forward_per_token=max(tile_fwd, floor.tile_forward_per_token))
    if tl2 is not None:  # the MLP's tile loop ran: its phase in tokens and tile tokens
        l_slope, l_fixed = _line((t1, tl1), (t2, tl2))
        # the longer tiles tile only a count above them (not so at the smallest probe sizes)
        per_tile = (tl3 - tl2) / (3 * tile) if tl3 is not None else (l_fixed - sums) / tile
        per_tile = max(per_tile, floor.tile_backward_per_token)
        fixed_loop = max(sums, tl2 - l_slope * t2 - per_tile * tile)
        tiled.update(mlp_backward_per_token=l_slope, tile_backward_per_token=per_tile, tile_fixed=fixed_loop)
    return replace(untiled, **tiled)


def _split_rates(
    cfg: ModelConfig,
    device,
    dtype,
    flops: float,
    attention: float,
    elapsed: float,
    quiet: Quiet = contextlib.nullcontext,
) -> dict:
    """`dense_flops_per_s` and `attention_flops_per_s` of a layer whose `flops` (of which
    `attention` are the attention's) took `elapsed` seconds; {} where the split is not measurable."""
    fa = attention_rate(cfg, device, dtype, quiet=quiet)
    rest = elapsed - attention / fa
    if rest <= 0.1 * elapsed:  # the attention alone ran slower than inside the layer: noise
        return {}
    return dict(dense_flops_per_s=(flops - attention) / rest, attention_flops_per_s=fa)


def attention_probe_tokens(cfg: ModelConfig, dtype: torch.dtype, free_bytes: int) -> int:
    """The row length the attention kernel is timed at: ATTENTION_PROBE_TOKENS where a flash
    kernel runs it (bf16, fp16: memory linear in the row); in fp32 the longest multiple of 1024
    (at most that) whose SCORE_COPIES score tensors fit in a quarter of `free_bytes`. At 32k tokens
    eight fp32 heads' scores are 34 GB a copy: more than an 80 GB card holds over the backward."""
    if dtype.itemsize <= 2:
        return ATTENTION_PROBE_TOKENS
    per_square_token = SCORE_COPIES * cfg.num_attention_heads * dtype.itemsize
    longest = int((free_bytes / 4 / per_square_token) ** 0.5) // 1024 * 1024
    return max(1024, min(ATTENTION_PROBE_TOKENS, longest))


def attention_rate(
    cfg: ModelConfig, device, dtype, tokens: int | None = None, quiet: Quiet = contextlib.nullcontext
) -> float:
    """FLOP/s of one causal attention's forward + backward on SDPA's kernel for `dtype`, with the
    model's heads, at `tokens` tokens in one row (default: `attention_probe_tokens`); FLOPs
    counted as costmodel.py counts a layer's (the forward 2 x tokens^2 x width, the backward
    twice that)."""
    if tokens is None:
        tokens = attention_probe_tokens(cfg, dtype, torch.cuda.mem_get_info(device)[0])
    seconds = _attention_seconds(cfg, device, dtype, tokens, quiet=quiet)
    torch.cuda.empty_cache()
    return 3 * 2 * tokens * tokens * cfg.attention_width / seconds


def _attention_seconds(
    cfg: ModelConfig, device, dtype, tokens: int, reps: int = 3, quiet: Quiet = contextlib.nullcontext
) -> float:
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    d = cfg.attention_width // heads
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (
        torch.randn(1, n, tokens, d, device=device, dtype=dtype, generator=gen).requires_grad_()
        for n in (heads, kv, kv)
    )

    def once() -> None:
        out = torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True, enable_gqa=kv != heads
        )
        torch.autograd.grad(out, (q, k, v), torch.ones_like(out))

    once()  # kernels chosen and loaded
    with quiet():
        torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        for _ in range(reps):
            once()
        torch.cuda.synchronize(device)
        return (time.perf_counter() - t0) / reps


def _line(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    """(slope, intercept) through two (tokens, bytes) points (through the origin if one)."""
    (x1, y1), (x2, y2) = a, b
    slope = (y2 - y1) / (x2 - x1) if x2 > x1 else y2 / x2
    return slope, y2 - slope * x2


def probed_layer(cfg: ModelConfig) -> int:
    """The layer the probe measures: the one with the most parameters among the full-attention
    layers (all layers where every one has a window); the first of them on a tie."""
    t = templates(cfg)
    windows = cfg.windows
    full = [j for j, w in enumerate(windows) if w is None] or list(range(len(windows)))
    size = {k: sum(p.numel() for p in m.parameters()) for k, m in t["layers"].items()}
    return max(full, key=lambda j: size[t["keys"][j]])


def _probe(
    cfg,
    i: int,
    params,
    device,
    dtype,
    compile: bool,
    sizes: list[int],
    tile: int,
    masked: bool,
    quiet: Quiet = contextlib.nullcontext,
):
    """Measure layer `i`'s template with MLP tiles of `tile` tokens (0: untiled) at each of
    `sizes` tokens: one row per size, and the seconds of the last measurement (made `quiet`)."""
    family = family_of(cfg)
    layer, kind = family.layer(cfg, i), family.layer_kind(cfg, i)
    set_mlp_tiles(layer, tile)
    inputs_of = family.inputs(cfg, device)
    frozen = {n for n, p in layer.named_parameters() if not p.requires_grad}  # ParamSpec.train
    leaves = {n: t.detach().requires_grad_(n not in frozen) for n, t in params.items()}
    pgrads = sum(t.numel() * t.element_size() for t in params.values())

    def call(p, x, inputs):
        out = functional_call(layer, p, (x,), inputs)
        return out[0] if family.aux else out  # the hidden state, not the auxiliary-loss statistics

    # Static shapes, as the engine runs a layer at one length: a recompile for the next size would
    # otherwise be traced with a dynamic length (the compiler's default on a second shape), whose
    # kernels keep and allocate other tensors (FlexAttention's backward most of all).
    fn = compiled(call, dynamic=False) if compile and family.compile else call
    rows = []
    for t in sizes:
        one_doc = torch.zeros(1, t, dtype=torch.int64, device=device) if masked else None
        inputs = inputs_of(torch.arange(t, device=device)[None], one_doc, t, dtype, True)[kind]
        x = torch.randn(1, t, cfg.hidden_size, device=device, dtype=dtype)
        for k in range(2):  # the first compiles; the second is measured
            with quiet() if k else contextlib.nullcontext():
                t0 = time.perf_counter()
                rows.append((t, *measure_layer(fn, leaves, params, x, inputs, pgrads, device)))
                elapsed = time.perf_counter() - t0
        rows.pop(-2)
        del x, inputs
    torch.cuda.empty_cache()
    return rows[0], rows[-1], elapsed


def measure_layer(fn, leaves, params, x, inputs, pgrads, device) -> tuple[int, int, int, int | None]:
    """(graph bytes, backward peak above the graph less parameter gradients outside the MLP's
    tile loop, forward peak, the tile loop's peak above the graph or None if the MLP is untiled)."""
    out_bytes = x.numel() * x.element_size()
    xr = x.detach().requires_grad_()
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    with torch.enable_grad():
        y = fn(leaves, xr, inputs)
    graph = torch.cuda.memory_allocated(device) - base - out_bytes
    dy = torch.randn_like(y)
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    peaks = []

    def phase(_where: str) -> None:  # the peak up to here, then a fresh count
        torch.cuda.synchronize(device)
        peaks.append(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)

    with tiled_backward_phases(phase):
        grads = torch.autograd.grad(y, [xr, *(v for v in leaves.values() if v.requires_grad)], dy)
    phase("done")
    # peaks: before the first tile loop, each loop, between and after them
    loop = max(peaks[1::2]) - before if len(peaks) > 1 else None
    backward = max(peaks[0::2]) - before - pgrads
    del grads, y, dy, xr
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    with torch.no_grad():
        y = fn(params, x, inputs)
    torch.cuda.synchronize(device)
    forward = torch.cuda.max_memory_allocated(device) - before - out_bytes
    del y
    return graph, backward, forward, loop


class LayerProbe:
    """One layer measured on the device untiled (`untiled`, its tiled fields None), and with its
    MLP tiled too only when a plan asks (`with_tiles`, which calls `measure_tiled` once): that
    probe compiles the layer six more times, and a plan reads the tiled layer only where no
    untiled placement fits or only a two-pass one does (placement.py's `_in_memory`)."""

    def __init__(self, untiled: LayerMemory, measure_tiled: Callable[[], LayerMemory]):
        self.untiled = untiled
        self._measure_tiled = measure_tiled
        self._tiled: LayerMemory | None = None

    def with_tiles(self) -> LayerMemory:
        """The layer measured untiled and tiled (measured on the first call)."""
        if self._tiled is None:
            self._tiled = self._measure_tiled()
        return self._tiled


def layer_probe_for(
    cfg: ModelConfig,
    device,
    dtype: torch.dtype,
    compile: bool | None,
    micro_batch_tokens: int,
    masked: bool = False,
    quiet: Quiet = contextlib.nullcontext,
) -> LayerMemory | LayerProbe | None:
    """The layer a plan of a run on `device` takes: on CUDA its probe, untiled, the tiled layer
    measured when the plan asks (`LayerProbe`); None where no CUDA device is there to run it (the
    plan's formula is used); on the CPU the formula, with this CPU's rate (`cpu_layer_memory`).
    `compile` as the engine will run the layer (None: on, the CUDA default); `masked` as
    `attention.uses_mask` says for the run's rows; `quiet`: what the untiled probe's timed passes
    run inside (the tiled probe runs once the plan asks, on its own). Each measurement is made once
    per process (a benchmark putting phases beside the plan asks again, a replanning search many
    times)."""
    if torch.device(device).type == "cpu":
        return cpu_layer_memory(cfg, dtype, micro_batch_tokens, quiet)
    if torch.device(device).type != "cuda" or not torch.cuda.is_available():
        return None
    compile = True if compile is None else compile
    args = (cfg, device, dtype, compile, min(micro_batch_tokens, PROBE_TOKENS), masked)
    key = (repr(cfg), str(device), *args[2:])
    untiled = _kept((*key, "untiled"), lambda: probe_untiled(*args, quiet=quiet))
    return LayerProbe(untiled, lambda: _kept(key, lambda: probe_tiled(untiled, *args)))


def layer_memory_for(
    cfg: ModelConfig,
    device,
    dtype: torch.dtype,
    compile: bool | None,
    micro_batch_tokens: int,
    masked: bool = False,
) -> LayerMemory | None:
    """`layer_probe_for`'s layer with its tiled fields measured (a benchmark's record of it)."""
    layer = layer_probe_for(cfg, device, dtype, compile, micro_batch_tokens, masked)
    return layer.with_tiles() if isinstance(layer, LayerProbe) else layer


def _kept(key: tuple, measure: Callable[[], LayerMemory]) -> LayerMemory:
    if key not in _PROBED:
        _PROBED[key] = measure()
    return _PROBED[key]


_PROBED: dict[tuple, LayerMemory] = {}  # the layers measured, one per layer, size and variant


def cpu_layer_memory(
    cfg: ModelConfig, dtype: torch.dtype, micro_batch_tokens: int, quiet: Quiet = contextlib.nullcontext
) -> LayerMemory:
    """A CPU run's layer: the formula's memory (nothing to measure it with), and the FLOP rate of
    this CPU on torch's threads (`cpu_matmul_rate`, measured once per process and shape, inside
    `quiet`) in place of a GPU's: a fixed rate missed a 2-core CPU's step time 3.5-4x."""
    tokens = min(micro_batch_tokens, CPU_PROBE_TOKENS)
    key = (repr(cfg), "cpu", dtype, tokens, torch.get_num_threads())
    if key not in _PROBED:
        with quiet():
            rate = cpu_matmul_rate(tokens, cfg.hidden_size, token_ffn(cfg), dtype)
        _PROBED[key] = replace(formula_layer_memory(cfg, dtype.itemsize), flops_per_s=rate)
    return _PROBED[key]


def cpu_matmul_rate(tokens: int, hidden: int, ffn: int, dtype: torch.dtype) -> float:
    """FLOP/s of this CPU in `dtype` on a [tokens, hidden] x [hidden, ffn] matmul, each side
    capped (CPU_PROBE_WIDTH), run for at least CPU_PROBE_SECONDS after one warm-up."""
    m, k, n = min(tokens, CPU_PROBE_TOKENS), min(hidden, CPU_PROBE_WIDTH), min(ffn, CPU_PROBE_WIDTH)
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(shape, generator=gen).to(dtype) for shape in ((m, k), (k, n)))
    a @ b  # the kernel chosen, the memory touched
    reps, t0 = 0, time.perf_counter()
    while reps < 3 or time.perf_counter() - t0 < CPU_PROBE_SECONDS:
        a @ b
        reps += 1
    return 2 * m * k * n * reps / (time.perf_counter() - t0)


def adam_rate(threads: int, numel: int = ADAM_PROBE, again: bool = False) -> float:
    """Parameters per second of the fused CPU AdamW on `threads` of this host's threads, alone.
    Measured on the threads the run's optimizers will have: under torchrun a process starts with
    one (OMP_NUM_THREADS=1), and an 18.7B run on two GPUs measured 0.4 G/s there, planned a step
    of 21.6 s and took 8.3 (bench/results/2026-11-23_0942_multigpu.json). Measured once per
    process and thread count; `again` measures once more and keeps the best reading: a host can
    read slower than it runs (busy for a while: a 32-core host read 2.96 G params/s at a
    process's start, then 5.86 in the next process; that run's own steps ran 4.46,
    bench/results/2026-11-27_2140_x2-summary.md), never faster."""
    key = (threads, numel)
    if key not in _ADAM_RATES or again:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            _ADAM_RATES[key] = max(_ADAM_RATES.get(key, 0.0), _adam_rate(numel))
        finally:
            torch.set_num_threads(before)
    return _ADAM_RATES[key]


_ADAM_RATES: dict[tuple[int, int], float] = {}


def _adam_rate(numel: int) -> float:
    # Filled in parallel, so each page is first touched by one of the threads that will step it
    # and lands in that thread's memory node, as the run's state does (initialised and loaded on a
    # thread pool); torch.rand fills on the calling thread alone.
    p, g, m, v = (torch.empty(numel).fill_(x) for x in (0.5, 1e-3, 1e-4, 1e-6))
    steps = [torch.tensor(1.0)]
    return numel / best_pass(
        lambda: torch._fused_adamw_(
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
    )


def best_pass(once: Callable[[], object]) -> float:
    """Seconds of the fastest call of `once` (a host AdamW's pass) after one to warm it, of at
    least three calls over at least ADAM_PROBE_SECONDS: a pass over 32M parameters takes ~5 ms
    on a 32-core host, so three of them, as this took before, were 17 ms that any hiccup of the
    host spoils (inside runs on 32-core hosts, 2.4-4.7 G params/s, where the same function alone
    read 5.1-6.2 and the runs' own passes 3.8-5.4 inside their steps:
    bench/results/2026-11-27_2015_x2-summary.md)."""
    once()
    best, t0, reps = math.inf, time.perf_counter(), 0
    while reps < 3 or time.perf_counter() - t0 < ADAM_PROBE_SECONDS:
        t = time.perf_counter()
        once()
        best, reps = min(best, time.perf_counter() - t), reps + 1
    return best
