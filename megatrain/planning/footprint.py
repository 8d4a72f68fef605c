"""What a placement costs: the memory model behind placement.py, and the step time.

Given a model's shape, the largest step of a run and a `Plan` (where each class of bytes
lives), it predicts the peak of allocated GPU memory by replaying one optimizer step phase by
phase (`_phases`) and the growth of the host resident set (`_host`); `evaluate` adds the step
time from costmodel.py, which owns the rates. Its constants were measured with
bench/calibrate.py and bench/memory.py; bench/replay.py checks the memory model against every
recorded measurement. It decides nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..host.activations import HostActivations
from ..host.disk import ring_bytes, tier_bytes
from ..host.moments import FP32, STEP_CHUNK, STEP_TEMP_BYTES, Moments
from ..host.split import HALF_BYTES
from ..models.attention import mask_bytes
from ..models.config import ModelConfig
from ..models.family import layer_params
from ..parallel.layout import Layout
from .costmodel import step_time
from .planspec import (
    EMBED_GRAD_ROWS,
    LANDING_BYTES,
    ROW_HEADROOM,
    Batch,
    Machine,
    Plan,
    Shape,
    landing_bytes,
    looked_up_rows,
    model_shape,
)
from .probe import BACKWARD_H, FORWARD_H, GRAPH_F, GRAPH_H, LayerMemory, formula_layer_memory

GiB, MiB = 2**30, 2**20
ALONE = Layout()  # a world of one process

# --- measured constants (bench/calibrate.py, bench/memory.py; bf16, compiled layer, Hopper); one
# layer's activations are probe.py's (measured, or its formula)
# The loss head, per logit of a chunk: bf16 logits, their fp32 copy, softmax and its gradient, and
# per token x hidden of a chunk: the norm in fp32 and its gradient. Measured 16.3 bytes per logit
# before the head moved into losshead.py; since, every run's head phase stood a chunk x vocab x 4
# bytes under the model at 16 (0.8-1.1 GiB; 19 runs of 2026-11-23, chunks of 1,646-2,092 tokens,
# vocabularies of 128k-152k): 12.
LOGIT_BYTES = 12
# The objectives that take their loss through autograd over a chunk's logits (log-probs as logsumexp
# and a gather: the preference stages but rm, grpo, rloo) hold more: the fp32 logits saved for the
# backward, then the softmax, its product with the gradient, the gather's scatter and their sum.
# Their runs with chunks sized at 12 stood 3.3-3.7 GiB above the plan on one H200 (DPO of the 3.6B
# and 8B shapes, grpo of Qwen2.5-7B's, chunks of 357.8 M logits: bench/results/2026-12-03_1158_
# dpo-rm, _1417_dpo-rm, _1111_grpo), 21.9-23.1 bytes a logit; tracked tensor by tensor on the CPU,
# 22.25 (tests/test_loss_head.py). An objective tells the plan which it is (Batch.autograd_head).
AUTOGRAD_LOGIT_BYTES = 23
HEAD_TOKEN_H = 24
LOGIT_GRAD_BYTES = 6  # the logits' gradient (fp32 and compute dtype) while the weight's is formed
# The backward sweep's peak stood 3.9 and 7.3 GB above the model in the 8B runs at 128k and 256k
# tokens (one row each, H200; phase peaks in bench/results/2026-11-23_*_longctx.json). 2.1 GB of
# each was the LM head's gradient, which the engine kept through the sweep (no longer); the rest,
# 3.4 and 4.8 bytes per token x hidden, is not attributed by a measurement. A candidate, the
# embedding gradient's fp32 copy of the whole sequence (4 bytes per token x hidden), is now a
# chunk's (EMBED_GRAD_ROWS). Charged in every backward phase until a run with the embedding's
# phase measured apart (bench/memory.py records it) says more: at 16k tokens of a 3072-wide model
# that is 0.25 GB.
BACKWARD_TOKEN_H = 5
LOSS_CHUNK_BUDGET = {"cuda": 4 * GiB, "cpu": 1 * GiB}
LOSS_CHUNK_SHARE = 0.04  # of a GPU budget below 100 GiB
# Host memory of the runtime beside the model state, above the resident set before the model is
# built (CUDA libraries, kernels, pinned pools; measured 0.84 GiB), and the GPU memory outside the
# allocator (the CUDA context).
HOST_RUNTIME = {"cuda": 1 * GiB, "cpu": 256 * MiB}
# Each further process of a data-parallel machine: its interpreter and libraries, CUDA's and NCCL's
# host allocations, its own staging buffers. The machine's used memory (MemTotal - MemAvailable)
# grew by 3.5-5.6 GiB from one process to two (8B, two H200s, bench/results/2026-11-23_0206_,
# _0411_ and _0740_multigpu.md), where the plan had counted nothing for it. On the CPU (gloo, tests
# only) one runtime's worth, not measured.
PROCESS_HOST = {"cuda": 5 * GiB, "cpu": 256 * MiB}
CUDA_CONTEXT = 600 * MiB
# Several processes, a streamed backward sweep (two_pass, immediate): processgroup.py's
# `reduce_then` starts a unit's all-reduce and hands its gradient on only when the next unit's
# starts, so while a unit is differentiated the previous unit's fp32 gradient is still alive (the
# stored mode counts it already, as the gradient on its way to be held). Unit by unit, the
# two-pass runs stood a plateau of one layer's fp32 gradient above the model without it: 1.45 GiB
# of 18.7B on two H200s (bench/results/2026-11-23_0929_multigpu.json, +1.20 GiB measured; _0942_,
# +2.05, whose forward sweep stood 0.9 GiB above the model too), 0.81 GiB of 8B on four H100s
# (2026-11-27_0122_x4-multigpu-B64k.json, +0.80); one-GPU two-pass runs show no such plateau.
REDUCING_UNITS = 1
GPU_RESERVE = 0.03  # of the GPU budget, against allocator fragmentation
# Of the host budget: the kernel's and the GPU driver's own memory for page-locked pages, the page
# tables of a state of 100+ GB. An 8B run planned to within 0.1% of MemAvailable (124.8 GiB) was
# killed by the kernel's OOM killer with 4.7 GB of it still unused by the run.
HOST_RESERVE = 0.05
STAGING_SLOTS = 2
# GPU-stepped units' fp32 state (weights and two moments) passes through this many chunks of GPU
# scratch, `staging_elems` elements each: one loading while the other is stepped and written back.
STEP_SLOTS = 2


def _masks(b: Batch, flex: bool) -> int:
    """The attention masks of a step's micro-batches, alive from its start to its end."""
    return b.micro_batches * mask_bytes(b.rows, b.seq_len, flex, b.compute_bytes) if b.masked else 0


def loss_chunk(s: Shape, b: Batch, m: Machine, given: int | None) -> int:
    """Tokens per loss-head chunk: as many as LOSS_CHUNK_BUDGET (or 4% of a small GPU) holds;
    fewer, larger chunks launch fewer kernels."""
    if given:
        return given
    budget = LOSS_CHUNK_BUDGET[m.device]
    if m.device == "cuda" and m.gpu_bytes is not None:
        budget = min(budget, int(LOSS_CHUNK_SHARE * m.gpu_bytes))
    return max(256, min(b.micro_batch_tokens, budget // (logit_bytes(b) * s.vocab)))


def logit_bytes(b: Batch) -> int:
    """The loss head's device bytes a logit of a chunk, by how the run's objective differentiates."""
    return AUTOGRAD_LOGIT_BYTES if b.autograd_head else LOGIT_BYTES


# ---------------------------------------------------------------------------- GPU memory model
def _schedule(s: Shape, plan: Plan) -> list[list[int]]:
    """The engine's fetch orders in one step (unit j+1 is layer j), one list per `begin`: forward
    and backward in one for the stored and two-pass first sweeps, apart in immediate mode (whose
    backward sweep runs in `step`)."""
    forward = list(range(len(s.units))) + ([0] if s.tied else [])  # a tied head borrows the embedding
    if plan.update_order == "micro_batch":  # each unit fetched once for every micro-batch
        return [forward + ([0] if s.vision_trains else [])]
    backward = list(range(s.layers - plan.keep_layers, 0, -1)) + ([0] if s.vision_trains else [])
    return [forward, backward] if plan.grad_mode == "immediate" else [forward + backward]


def _windows(s: Shape, plan: Plan, cb: int) -> list[tuple[int, int]]:
    """For each fetch of a step, in order: the weight buffers alive while that unit computes (it
    and the `prefetch` units copied ahead, in compute dtype), and the landing buffer of the unit
    being copied then (in fp32 the master's halves, joined on the device; resident units and bf16
    fetches need none). The landing buffer lives only while that copy is issued, before the unit's
    own work allocates anything."""
    out = []
    for order in _schedule(s, plan):
        for i in range(len(order)):
            win = order[i : i + plan.prefetch + 1]
            newest = win[-1]
            stage = landing_bytes(plan, cb) * s.units[newest] if newest >= plan.resident_units else 0
            out.append((cb * sum(s.units[u] for u in win), stage))
    return out


@dataclass
class _Phase:
    """GPU memory at one point of a step: `rest` is alive throughout, `work` while the unit
    computes, `landing` while the next copy is issued (before the work starts)."""

    name: str
    window: tuple[int, int]
    rest: dict[str, int]
    work: dict[str, int]
    unit: int | None = None  # the backward sweep's: the unit differentiated

    @property
    def total(self) -> int:
        return sum(self.rest.values()) + self.window[0] + max(self.window[1], sum(self.work.values()))

    def parts(self) -> dict[str, int]:
        if self.window[1] > sum(self.work.values()):
            return {**self.rest, "weight buffers": self.window[0] + self.window[1]}
        return {**self.rest, "weight buffers": self.window[0], **self.work}


def _phases(s: Shape, b: Batch, plan: Plan, world: Layout = ALONE) -> list[_Phase]:
    """Replay one optimizer step of one process of `world`: the GPU memory alive at each point
    (forward at each layer, the loss head, backward at each layer, the embedding), by kind."""
    cb, L, h, lm = b.compute_bytes, s.layers, s.hidden, s.layer_mem
    T, Tm = b.tokens, b.micro_batch_tokens
    act = T * h * cb  # one layer's boundary activations, all micro-batches
    R, k, p = plan.resident_units, plan.keep_layers, plan.parked_layers
    stored, two_pass = plan.grad_mode == "stored", plan.grad_mode == "two_pass"
    n = len(s.units)
    win = _windows(s, plan, cb)
    # Gradients held on the GPU until the optimizer step: resident units' always, and in stored
    # mode the leading units' the plan keeps there (GPU-stepped ones among them). suffix[u]: their
    # bytes over units >= u.
    on_gpu = [u < R or (stored and u < plan.gpu_grad_lead) for u in range(n)]
    # The next forward sweep still holds those of streamed units until the host optimizer (in
    # forward order, behind it) has taken them; prestaged units' are gone after the step's kernels.
    waits = [on_gpu[u] and u >= R and u not in plan.prestaged for u in range(n)]
    suffix, suffix_streamed = [0] * (n + 1), [0] * (n + 1)
    for u in range(n - 1, -1, -1):
        suffix[u] = suffix[u + 1] + (4 * s.units[u] if on_gpu[u] else 0)
        suffix_streamed[u] = suffix_streamed[u + 1] + (4 * s.units[u] if waits[u] else 0)
    resident = {  # in every phase
        "fp32 state of GPU-resident units": plan.state_bytes(sum(s.units[:R])),
        "GPU-stepped state (scratch)": _step_scratch(s, plan),
        "GPU-stepped weights' halves (landing, leaving)": _step_halves(s, plan),
        "AdamW temporaries (bf16, 8-bit moments)": _moment_temporaries(s, plan),
        "attention masks": _masks(b, flex=True),
    }
    if plan.update_order == "micro_batch":
        return _micro_batch_phases(s, b, plan, resident, win)

    def stepped_weights(u: int) -> int:
        """GPU-stepped units >= u: their updated weights (compute dtype), kept from the optimizer
        step until the next forward sweep fetches them."""
        return cb * sum(s.units[v] for v in plan.stepped if v >= u)

    refetched = plan.kept_fresh(L, s.embed_again)

    def kept_weights(lo: int, hi: int) -> int:
        """Prestaged units lo <= u < hi fetched again later in the step: their updated weights,
        kept from the forward sweep's fetch to the later one."""
        return cb * sum(s.units[v] for v in refetched if lo <= v < hi)

    def prestaged_state(u: int) -> int:
        """Prestaged units >= u: their fp32 state, loaded during the backward sweep (counted whole
        from its start), stepped after the clip and freed after its write-back, which runs in
        forward order behind the next forward sweep (as the host optimizer does)."""
        return plan.state_bytes(sum(s.units[v] for v in plan.prestaged if v >= u))

    tile = plan.mlp_tile_tokens
    kept_graph = lm.graph(Tm, tile) * b.micro_batches + act + cb * s.layer  # graphs, outputs, weights

    def acts_before(j: int) -> int:
        """Boundary activations on the GPU for layers < j: p .. L-k-1 (parked ones lead; kept
        layers hold theirs inside their graphs)."""
        return act * max(0, min(j, L - k) - p)

    head_grad = 4 * s.units[-1] + (4 * s.units[0] if s.tied else 0)
    reducing = REDUCING_UNITS if world.ranks > 1 else 0

    def reduced(u: int) -> int:
        """Several processes: the gradient of the unit differentiated before unit u, still being
        reduced (the head's is reduced before the sweep)."""
        return sum(4 * s.units[v] for v in range(u + 1, min(n - 1, u + 1 + reducing)))

    def inflight(u: int) -> int:
        """immediate, two_pass: gradients of the units stepped just before unit u (backward
        order: head, last layer, ..., embedding) that the host optimizer has not taken yet, behind
        the one still being reduced on several processes."""
        return sum(4 * s.units[v] for v in range(u + 1, min(n, u + 1 + plan.inflight_units + reducing)))

    phases: list[_Phase] = []
    vision_tokens = math.ceil(s.vision[0] * Tm) if s.vision else 0  # at most, every token an image's
    if s.vision:
        # The embedding with a vision tower: its layers run on a micro-batch's images without
        # autograd, one at a time (the decoder layer's forward rule, its MLP counted whole), while
        # the first hidden states of all micro-batches are made.
        _, hv, fv, _ = s.vision
        rest = {"boundary activations": act, "gradients": suffix_streamed[1] if stored else 0}
        work = {"vision tower forward": vision_tokens * cb * (FORWARD_H * hv + fv)}
        phases.append(_Phase("forward", win[0], {**resident, **rest}, work))
    # Forward sweep at layer j. In stored mode the previous step's gradients wait on the GPU until
    # the host optimizer, which runs in forward order behind this sweep, has taken them.
    for j in range(L):
        kept = j >= L - k
        rest = {
            "boundary activations": acts_before(j) + Tm * h * cb,
            # the kept layers before this one, and this one's graphs of the micro-batches before
            # the one it computes (each with its output)
            "kept graphs": kept_graph * max(0, j - (L - k))
            + ((b.micro_batches - 1) * (lm.graph(Tm, tile) + Tm * h * cb) if kept else 0),
            "gradients": suffix_streamed[j + 2] if stored else 0,
            # beyond the fetch window, and those fetched again later
            "GPU-stepped weights": stepped_weights(j + 2 + plan.prefetch) + kept_weights(0, j + 1),
            "GPU-stepped state (prestaged)": prestaged_state(j + 2),
        }
        work = {"layer forward": lm.graph_peak(Tm, tile) if kept else lm.forward(Tm, tile)}
        phases.append(_Phase("forward", win[j + 1], {**resident, **rest}, work))
    # The head: every boundary activation and kept graph alive, the loss chunk on top.
    head = L + 1
    rest = {
        "boundary activations": acts_before(L),
        "kept graphs": kept_graph * k,
        "GPU-stepped weights": kept_weights(1, L + 1),  # for the backward sweep
    }
    work = {
        # a chunk's logits and their gradients, or later the LM head weight's gradient of the chunk
        # beside the logits' gradient in compute dtype (wins for wide layers); the last hidden states
        # and their gradient
        "loss head": max(
            plan.loss_chunk_tokens * (s.vocab * logit_bytes(b) + h * HEAD_TOKEN_H),
            plan.loss_chunk_tokens * s.vocab * LOGIT_GRAD_BYTES + cb * s.vocab * h,
        )
        + 2 * T * h * cb,
        "gradients": head_grad,
    }
    phases.append(_Phase("head", win[head], {**resident, **rest}, work))
    # Backward sweep at layer j (from the last): activations of layers <= j (all of them during a
    # norm-only first pass), the activation gradients of all micro-batches, the gradients held
    # before it; the layer's recomputed graph, its output, the backward's working set, its fp32
    # gradient and its parameter gradients in compute dtype.
    back = {u: head + 1 + int(s.tied) + i for i, u in enumerate(range(L - k, 0, -1))}
    for j in range(L - 1, -1, -1):
        u = j + 1
        kept = j >= L - k
        if stored:
            held = suffix[u + 1] + (0 if on_gpu[u + 1] else 4 * s.units[u + 1])  # + one on its way out
        elif two_pass:  # the first pass holds the head's gradient; the second streams
            held = max(head_grad + reduced(u), inflight(u))
        else:
            held = inflight(u)
        rest = {
            "boundary activations": (acts_before(L) if two_pass else acts_before(j + 1))
            + (2 * act if j < p else 0),  # parked inputs brought back, this layer's and the next
            "kept graphs": kept_graph * max(0, j + 1 - (L - k)),
            "activation gradients": T * h * cb + int(BACKWARD_TOKEN_H * T * h),
            "gradients": held,
            # stored: those the sweep fetches after this window; else units stepped earlier in it
            "GPU-stepped weights": kept_weights(1, u - plan.prefetch) if stored else stepped_weights(u + 1),
            "GPU-stepped state (prestaged)": prestaged_state(0),
        }
        recomputed = 0 if kept else lm.graph(Tm, tile) + Tm * h * cb  # its graph and output
        work = {
            "layer backward": recomputed + lm.backward(Tm, tile),
            "unit gradient": (4 + cb) * s.units[u],
        }
        phases.append(_Phase("backward", win[back.get(u, len(win) - 1)], {**resident, **rest}, work, u))
    # The embedding's gradient: a scatter-add of the last activation gradient, in fp32, a chunk of
    # tokens at a time: the gradient's fp32 copy, as much again for what the deterministic scatter
    # allocates beside it, and a masked or scaled copy in compute dtype; beside them its fp32
    # gradient buffer (counted with the held gradients where those are the stored mode's) and,
    # in a norm-only first pass, every boundary activation, kept for the second.
    # A norm-only first pass holds the head's gradient here too, and on several processes the
    # first layer's still being reduced beside it (on one GPU not counted: docs/open-work.md).
    first_pass = head_grad + reduced(0) if two_pass and reducing else 0
    rest = {
        "boundary activations": acts_before(L) if two_pass else 0,
        "activation gradients": T * h * cb,
        "gradients": suffix[0] if stored else max(first_pass, inflight(0)),
        "GPU-stepped weights": 0 if stored else stepped_weights(1),
        "GPU-stepped state (prestaged)": prestaged_state(0),
    }
    rows = min(Tm, EMBED_GRAD_ROWS)
    own = 0 if stored and on_gpu[0] else 4 * s.units[0]
    # After it, where the embedding's rows are fetched (`embed_rows`): the step's rows of its
    # gradient gathered for their way out (its working set is gone by then).
    gathered = 4 * h * looked_up_rows(s, b) if plan.embed_rows else 0
    work = {"embedding backward": max(rows * h * (8 + cb), gathered) + own}
    window = (0, 0)
    if s.vision_trains:
        # The tower recomputed on a micro-batch's images with autograd and differentiated (the
        # decoder layer's graph and backward rules): the embedding's weights fetched again.
        _, hv, fv, lv = s.vision
        graph = vision_tokens * cb * (GRAPH_H * hv + GRAPH_F * fv)
        work["vision tower backward"] = lv * graph + vision_tokens * cb * BACKWARD_H * hv
        window = win[-1]
    phases.append(_Phase("backward", window, {**resident, **rest}, work, 0))
    return phases


def _micro_batch_phases(s: Shape, b: Batch, plan: Plan, resident: dict[str, int], win) -> list[_Phase]:
    """`_phases` of a micro-batch-major step (`Plan.update_order`; every unit GPU-resident, one
    process): the first micro-batch, whose gradients come into being as its backward reaches each
    unit, and, with more, a later one, beside every unit's gradient and every layer's weights
    (bound at the first micro-batch's visit, for the step). Alive throughout: each micro-batch's
    first hidden state, or once its backward is done the gradient reaching the embedding (kept
    for the embedding's at the end); in a micro-batch, its graphs of the layers it has passed
    and not yet differentiated, each with its output."""
    cb, L, h, lm, tile = b.compute_bytes, s.layers, s.hidden, s.layer_mem, plan.mlp_tile_tokens
    Tm, M, n = b.micro_batch_tokens, b.micro_batches, len(s.units)
    act = Tm * h * cb  # one micro-batch's hidden states at a layer boundary
    graph = lm.graph(Tm, tile) + act  # one layer's graph of a micro-batch, with its output
    grad = [4 * u for u in s.units]
    head_grad = grad[-1] + (grad[0] if s.tied else 0)
    head_w = cb * s.units[-1] + (cb * s.units[0] if s.tied else 0)  # bound for the step
    phases: list[_Phase] = []
    vision_tokens = math.ceil(s.vision[0] * Tm) if s.vision else 0
    if s.vision:  # every micro-batch's first hidden states made, a micro-batch's images at a time
        _, hv, fv, lv = s.vision
        work = {"vision tower forward": vision_tokens * cb * (FORWARD_H * hv + fv)}
        p = {**resident, "boundary activations (first hidden states, their gradients)": M * act}
        phases.append(_Phase("forward", win[0], p, work))
    for later in [False, True] if M > 1 else [False]:

        def rest(graphs: int, weights_below: int, grads: int) -> dict[str, int]:
            return {
                **resident,
                "boundary activations (first hidden states, their gradients)": M * act,
                "kept graphs (one micro-batch)": graphs * graph,
                "layer weights (bound for the step)": cb * sum(s.units[1 : weights_below + 1]),
                "gradients": grads,
            }

        # a later micro-batch fetches nothing: its weights were bound by the first one's visit
        for j in range(L):
            weights = L if later else j
            p = rest(j, weights, sum(grad[1:-1]) + head_grad if later else 0)
            if later:
                p["head weights"] = head_w
            work = {"layer forward": lm.graph_peak(Tm, tile)}
            phases.append(_Phase("forward", (0, 0) if later else win[j + 1], p, work))
        loss_head = max(
            plan.loss_chunk_tokens * (s.vocab * logit_bytes(b) + h * HEAD_TOKEN_H),
            plan.loss_chunk_tokens * s.vocab * LOGIT_GRAD_BYTES + cb * s.vocab * h,
        )
        p = rest(L, L, sum(grad[1:-1]) + head_grad if later else 0)
        work = {"loss head": loss_head + 2 * act}
        if not later:  # its buffers made here
            work["head gradient"] = head_grad
        phases.append(_Phase("head", (0, 0) if later else win[L + 1], {**p, "head weights": head_w}, work))
        for j in range(L - 1, -1, -1):
            u = j + 1
            held = sum(grad[1:-1]) + head_grad if later else sum(grad[u + 1 : n - 1]) + head_grad
            p = rest(j + 1, L, held) | {"head weights": head_w}
            p["activation gradients"] = act + int(BACKWARD_TOKEN_H * Tm * h)
            work = {"layer backward": lm.backward(Tm, tile), "unit gradient": cb * s.units[u]}
            if not later:  # its fp32 buffer made here, micro-batch 0's gradient copied in
                work["unit gradient"] += grad[u]
            phases.append(_Phase("backward", (0, 0), p, work, u))
    # The embedding's gradient from every micro-batch's (as the layer-major sweep takes it), beside
    # every other unit's, held for the clip (or, in immediate mode, for `step`).
    p = {
        **resident,
        "activation gradients": M * act,
        "gradients": sum(grad[1:-1]) + head_grad,
        "head weights": head_w,
    }
    rows = min(Tm, EMBED_GRAD_ROWS)
    work = {"embedding backward": rows * h * (8 + cb) + (0 if s.tied else grad[0])}
    window = (0, 0)
    if s.vision_trains:  # as `_phases` counts it
        graph_v = vision_tokens * cb * (GRAPH_H * hv + GRAPH_F * fv)
        work["vision tower backward"] = lv * graph_v + vision_tokens * cb * BACKWARD_H * hv
        window = win[-1]
    phases.append(_Phase("backward", window, p, work, 0))
    return phases


# GPU-stepped units' master weights cross as their halves through a chunk on the way in and one
# on the way out (engine/gpustep.py).
HALVES_STAGES = 2


def _step_chunk(s: Shape, plan: Plan) -> int:
    """Elements of a GPU-stepped unit's chunk: `staging_elems`, or the largest such unit's."""
    return min(plan.staging_elems, max(s.units[u] for u in plan.stepped))


def _step_scratch(s: Shape, plan: Plan) -> int:
    """GPU scratch for the state of GPU-stepped units, allocated for the whole run: STEP_SLOTS
    chunks (`_step_chunk`); none where all of them are prestaged."""
    if not plan.gpu_stepped_units or plan.prestaged:
        return 0
    return STEP_SLOTS * plan.state_bytes(_step_chunk(s, plan))


def _step_halves(s: Shape, plan: Plan) -> int:
    """The HALVES_STAGES chunks the GPU-stepped units' master weights land in and leave through as
    their halves (engine/gpustep.py), allocated for the whole run."""
    return HALVES_STAGES * HALF_BYTES * _step_chunk(s, plan) if plan.gpu_stepped_units else 0


def _moment_temporaries(s: Shape, plan: Plan) -> int:
    """GPU memory of engine/moments.py's step where the GPU steps bf16 or 8-bit moments: its fp32
    temporaries of a chunk (host/moments.py's STEP_TEMP_BYTES)."""
    if plan.moments == FP32.name or not (plan.resident_units or plan.gpu_stepped_units):
        return 0
    return STEP_TEMP_BYTES * min(STEP_CHUNK["cuda"], max(s.units))


def _gpu_peak(s: Shape, b: Batch, plan: Plan, world: Layout) -> tuple[int, dict[str, int]]:
    """The most GPU memory alive at once in one step of one process, with its parts."""
    worst = max(_phases(s, b, plan, world), key=lambda ph: ph.total)
    return worst.total, {name: v for name, v in worst.parts().items() if v}


def phase_peaks(
    cfg: ModelConfig,
    batch: Batch,
    plan: Plan,
    layer_mem: LayerMemory | None = None,
    world: Layout = ALONE,
) -> dict[str, int]:
    """The predicted GPU peak of each phase of a step (forward, head, backward; and the
    embedding's gradient, the backward sweep's last stretch) on each GPU of `world`, for comparing
    the memory model with the allocator's counters phase by phase."""
    s = model_shape(cfg, layer_mem or formula_layer_memory(cfg, batch.compute_bytes))
    out: dict[str, int] = {}
    phases = _phases(s, batch, plan, world)
    for ph in phases:
        out[ph.name] = max(out.get(ph.name, 0), ph.total)
    out["embedding"] = phases[-1].total
    return out


def unit_peaks(
    cfg: ModelConfig,
    batch: Batch,
    plan: Plan,
    layer_mem: LayerMemory | None = None,
    world: Layout = ALONE,
) -> dict[int, int]:
    """The predicted GPU peak while each unit is differentiated in the backward sweep (the last
    layer's first, the embedding's last), by unit index, on each GPU of `world`: where within the
    sweep the model and the allocator part, where they do."""
    s = model_shape(cfg, layer_mem or formula_layer_memory(cfg, batch.compute_bytes))
    return {ph.unit: ph.total for ph in _phases(s, batch, plan, world) if ph.unit is not None}


# ---------------------------------------------------------------------------- host memory model
def _host(s: Shape, b: Batch, plan: Plan, world: Layout) -> tuple[dict[str, int], int]:
    """Host memory of this machine by kind, and how much of it is page-locked. Its share of the
    state (all of it, unless partitioned over machines) and of the gradients its ranks step; each
    of its processes' runtime and parked activations; the staging buffers once (in the runtime's
    measure for the further processes)."""
    cb, T, h = b.compute_bytes, b.tokens, s.hidden
    state = world.held(s.units)
    tier = disk_tier_bytes(s, plan.disk_units, world, plan.moment_format)
    host = {STATE_KEY: plan.state_bytes(state) - tier}
    if plan.disk_units:  # the tier's moments pass through it a block at a time
        host["disk tier staging (host buffers)"] = ring_bytes(
            s.units[len(s.units) - plan.disk_units :], plan.moment_format
        )
    if plan.device == "cpu":
        if plan.grad_mode == "stored":
            host["fp32 gradients"] = 4 * s.total
        else:
            host["fp32 gradients in flight"] = 4 * (2 * max(s.units))
        Tm, tile = b.micro_batch_tokens, plan.mlp_tile_tokens
        if plan.update_order == "micro_batch":  # as `_micro_batch_phases` counts them
            host["boundary activations"] = T * h * cb
            host["kept graphs (one micro-batch)"] = s.layers * (s.layer_mem.graph(Tm, tile) + Tm * h * cb)
            host["layer working set"] = s.layer_mem.backward(Tm, tile)
        else:
            host["boundary activations"] = T * h * cb * s.layers
            host["layer working set"] = s.layer_mem.graph(Tm, tile) + s.layer_mem.backward(Tm, tile)
        host["loss chunk"] = plan.loss_chunk_tokens * s.vocab * logit_bytes(b)
        if b.masked:
            host["attention masks"] = _masks(b, flex=False)
        host["runtime"] = _runtime(plan.device, world)
        return host, 0
    pinned = HALF_BYTES * state  # the master weights' halves, registered in place
    pinned += plan.moment_format.nbytes(
        world.held(s.units[u] for u in plan.stepped)
    )  # and GPU-stepped units' moments
    spilled = world.held(s.units[plan.gpu_grad_lead :]) if plan.grad_mode == "stored" else 0
    if spilled > 0:
        host["fp32 gradients waiting for the clip (page-locked)"] = 4 * spilled
        pinned += 4 * spilled
    if plan.parked_layers:  # each process parks its own micro-batches'
        parked = world.ranks_per_machine * plan.parked_layers * _parked_layer_bytes(b, h)
        host["boundary activations (page-locked)"] = parked
        pinned += parked
    host["gradient staging (page-locked)"] = STAGING_SLOTS * plan.staging_elems * 4
    pinned += host["gradient staging (page-locked)"]
    if plan.embed_rows:  # engine/rows.py: the table's gradient, the rows' ways out and in with
        # their headroom (host kernels that cannot step rows in place also gather four fp32 copies
        # of them for a moment: not counted)
        rows = int(ROW_HEADROOM * h * looked_up_rows(s, b))
        host["embedding gradient (fp32, the step's rows)"] = 4 * s.units[0]
        host["embedding rows (page-locked)"] = (4 + cb) * rows
        pinned += host["embedding rows (page-locked)"]
    host["runtime"] = _runtime(plan.device, world)
    return host, pinned


STATE_KEY = "fp32 weights + AdamW moments"  # plan.host's key


def disk_tier_bytes(s: Shape, units: int, world: Layout, moments: Moments) -> int:
    """The AdamW moments a disk tier of the last `units` units holds (a plan's `disk_units`) in
    their format."""
    held = [world.held([n]) for n in s.units[len(s.units) - units :]] if units else []
    return tier_bytes(held, moments)


def _runtime(device: str, world: Layout) -> int:
    """Host memory of the machine's processes beside the state and the plan's buffers."""
    return HOST_RUNTIME[device] + (world.ranks_per_machine - 1) * PROCESS_HOST[device]


def _parked_layer_bytes(b: Batch, hidden: int) -> int:
    """One layer's slot in the host buffer of parked activations."""
    # The micro-batches are alike: one's bytes times their count, not a list of them (the search
    # for the most micro-batches a step may have tries up to 2**24).
    one = HostActivations.layer_bytes([b.micro_batch_tokens], hidden, b.compute_bytes)
    return HostActivations.slot_bytes(one * b.micro_batches)


# A rollout (stage grpo): transformers' `generate` over a step's completions, the policy on the
# GPU in the compute dtype. Its prefill takes every prompt through a layer at once: per token the
# MLP's gate, up and product (3 x its width) and ~6 x hidden of attention and residuals. Sampling
# holds a few fp32 copies of the last position's logits (the logits, the processors', softmax).
ROLLOUT_PREFILL_TOKEN_H = 6
ROLLOUT_LOGIT_COPIES = 4
# A rollout whose policy streams its last layers (rl/policy.py) fetches them, in every forward,
# a layer ahead into this many rotating buffers in the compute dtype (a double buffer), in fp32
# through one landing buffer of the master's halves.
ROLLOUT_BUFFERS = 2


def reward_model_bytes(cfg: ModelConfig, rows: int, tokens: int, compute_bytes: int) -> int:
    """The GPU memory of a reward model scoring `rows` sequences of `tokens` (grpo's reward_funcs):
    its weights in the compute dtype, and the widest activations of one layer's forward over them
    (the MLP's gate and up; no graph is kept)."""
    return (
        cfg.num_params * compute_bytes
        + rows * tokens * (cfg.hidden_size + 2 * cfg.intermediate_size) * compute_bytes
    )


def rollout_bytes(
    cfg: ModelConfig,
    rows: int,
    prompt_tokens: int,
    completion_tokens: int,
    compute_bytes: int,
    resident_layers: int | None = None,
    prefill_rows: int | None = None,
) -> dict[str, int]:
    """The GPU memory a rollout adds to what the engine holds between steps, by part: `rows`
    completions of prompts up to `prompt_tokens`, each up to `completion_tokens` long, of which
    `prefill_rows` distinct prompts are prefilled (default: every row; the rollout engine
    prefills a prompt once for its group, rl/decode.py), the policy's
    decoder layers from `resident_layers` on streamed (None: none), fetched from the master's
    halves into the two buffers (in fp32 through a landing buffer, LANDING_BYTES)."""
    if cfg.mla is not None:  # transformers' DeepSeek caches each head's whole key and value
        kv = cfg.num_attention_heads * (cfg.mla.qk_head_dim + cfg.mla.v_head_dim)
    else:
        kv = 2 * cfg.num_key_value_heads * cfg.head_dim
    ffn = cfg.moe.token_ffn if cfg.moe is not None else cfg.intermediate_size
    prefill_h = 3 * ffn + ROLLOUT_PREFILL_TOKEN_H * cfg.hidden_size
    streamed = layer_params(cfg)[resident_layers:] if resident_layers is not None else []
    buffers = {}
    if streamed:
        stage = LANDING_BYTES[compute_bytes]
        buffers = {"streamed layers' buffers": max(streamed) * (ROLLOUT_BUFFERS * compute_bytes + stage)}
    return {
        "policy weights": (cfg.num_params - sum(streamed)) * compute_bytes,
        **buffers,
        "KV cache": rows * (prompt_tokens + completion_tokens) * cfg.num_hidden_layers * kv * compute_bytes,
        "prefill (one layer, every prompt)": (prefill_rows or rows)
        * prompt_tokens
        * prefill_h
        * compute_bytes,
        "sampling logits": rows * cfg.vocab_size * 4 * ROLLOUT_LOGIT_COPIES,
    }


def usable_gpu(m: Machine) -> int | None:
    if m.gpu_bytes is None:
        return None
    ctx = CUDA_CONTEXT if m.gpu_capped else 0
    return int((m.gpu_bytes - ctx) * (1 - GPU_RESERVE))


def usable_host(m: Machine) -> int | None:
    return None if m.host_bytes is None else int(m.host_bytes * (1 - HOST_RESERVE))


def evaluate(s: Shape, b: Batch, plan: Plan, m: Machine) -> Plan:
    plan = replace(plan)
    if plan.device == "cuda":
        plan.gpu_peak, plan.gpu = _gpu_peak(s, b, plan, m.world)
    plan.host, plan.pinned = _host(s, b, plan, m.world)
    plan.disk = disk_tier_bytes(s, plan.disk_units, m.world, plan.moment_format)
    plan.step_time_s = step_time(s, b, plan, m)
    return plan


def fits(plan: Plan, m: Machine) -> bool:
    gpu = usable_gpu(m)
    if plan.device == "cuda" and gpu is not None and plan.gpu_peak > gpu:
        return False
    host = usable_host(m)
    return host is None or plan.host_total <= host


def fmt_bytes(n: float) -> str:
    if n >= GiB:
        return f"{n / GiB:.2f} GiB"
    return f"{n / MiB:.1f} MiB" if n >= MiB else f"{n / 1024:.1f} KiB"
