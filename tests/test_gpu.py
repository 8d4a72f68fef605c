"""CUDA schedule tests (`pytest -m gpu` on a GPU machine; skipped elsewhere).

Every placement the plan can choose (gradients held on the GPU or in host memory or both, a
two-pass step, immediate stepping without clipping; GPU-resident units, units stepped on the GPU
from streamed state, kept graphs, parked activations, memory page-locked in pieces) must give
bitwise the same weights as the plain serial schedule; bf16 CUDA training must track the fp32
CPU reference within bf16 tolerance; an evaluation right after an asynchronous optimizer step
must see the updated weights.
FlexAttention (packed rows, sliding windows) must equal the dense-mask path and need memory far
below S x S.
"""

from __future__ import annotations

import time
from dataclasses import replace

import pytest
import torch
from helpers import hash_bits, llama_layer, random_kernel_timings, tiny_config

from megatrain.data.batch import MicroBatch
from megatrain.engine import clipadam, optim
from megatrain.engine.optim import AdamWConfig
from megatrain.host import hostmem
from megatrain.host.split import join, split, to_bf16
from megatrain.models.compiling import INDUCTOR_OPTIONS, compiled
from megatrain.models.config import ModelConfig
from megatrain.planning.placement import Plan
from megatrain.runtime import build_model

pytestmark = pytest.mark.gpu
LLAMA_8B_LAYER = dict(
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8
)


def _cfg(family="llama", tied=False, **kw):
    base = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=640,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        initializer_range=0.05,
    )
    base.update(kw)
    return ModelConfig.from_hf(tiny_config(family, tied, **base))


def _steps(model, n_steps=4, n_micro=3, seq=128, vocab=512, max_norm=0.5, lr=2e-3):
    losses, norms = [], []
    for step in range(n_steps):
        g = torch.Generator().manual_seed(step)
        mbs = []
        for _ in range(n_micro):
            ids = torch.randint(0, vocab, (2, seq), generator=g)
            labels = ids.clone()
            labels[:, : seq // 4] = -100
            mbs.append(MicroBatch(ids, labels))
        loss, _ = model.engine.forward_backward(mbs)
        norm, coef = model.engine.clip_grad_norm(max_norm)
        measured = model.engine.step(lr, coef)
        losses.append(loss.item())
        norms.append((norm if norm is not None else measured).item())
    model.transport.synchronize()
    return losses, norms


ADAMW = AdamWConfig(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)
UNITS = 6  # embed, 4 layers, head


def _plan(
    mode="stored", gpu_grads=UNITS, resident=0, keep=0, parked=0, tile=0, stepped=0, order="layer"
) -> Plan:
    return Plan("cuda", mode, gpu_grads, resident, keep, parked, 100, mlp_tile_tokens=tile,
                gpu_stepped_units=stepped, update_order=order)  # fmt: skip


def _build(cfg, plan, overlap=True, staging=None, dtype="bfloat16", compile=False):
    if staging:  # many chunks per unit: exercise the chunked pipelines (and a slow optimizer)
        plan = replace(plan, staging_elems=staging)
    return build_model(
        cfg,
        seed=3,
        device="cuda",
        compute_dtype=dtype,
        adamw=ADAMW,
        overlap=overlap,
        plan=plan,
        compile=compile,  # off but where a test says: the schedule is under test
    )


def _train(cfg, plan, overlap, max_norm=0.5, staging=None, dtype="bfloat16", compile=False):
    m = _build(cfg, plan, overlap, staging, dtype, compile)
    losses, norms = _steps(m, max_norm=max_norm)
    out = (losses, norms, m.state.master(), m.state.exp_avg_sq.clone())
    moved = m.engine.host_acts.bytes_moved if m.engine.host_acts is not None else 0
    m.close()
    return out, moved


CASES = {
    # gradients held until the clip: all on the GPU / all in host memory / shared; kept graphs
    "stored-gpu": ("qwen3", True, _plan(keep=2)),
    "stored-host": ("llama", False, _plan(gpu_grads=0)),
    "stored-shared": ("qwen2", False, _plan(gpu_grads=3, keep=1)),
    # a norm-only backward, then one that steps each unit as it lands; activations parked
    "two-pass": ("llama", True, _plan("two_pass", 0, parked=2)),
    "parked": ("qwen2", True, _plan(gpu_grads=0, parked=4)),
    # the MLP over tiles of 100 tokens (a micro-batch has 256), a kept graph among them
    "tiled": ("llama", False, _plan(gpu_grads=0, keep=1, parked=2, tile=100)),
    # the embedding and two layers stepped on the GPU from streamed state (the tied head fetches
    # the embedding again, after its update), the rest by the CPU from host gradients; their state
    # loaded during the backward sweep (prestaged), or after the clip through scratch (against the
    # serial schedule's prestaged steps)
    "gpu-stepped": ("qwen3", True, _plan(gpu_grads=0, keep=1, stepped=3)),
    "gpu-stepped-chunked": ("qwen3", True, replace(_plan(gpu_grads=0, keep=1, stepped=3), prestage=False)),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_placement_equals_the_serial_schedule_bitwise(case):
    family, tied, plan = CASES[case]
    cfg = _cfg(family, tied)
    # the plain reference: every gradient on the GPU, nothing kept or parked, the same MLP tiles
    # (tiling changes the summation order of the MLP's weight gradients, placement does not) and
    # the same units stepped by the CUDA AdamW (its rounding is not the CPU kernel's)
    ref = _plan(tile=plan.mlp_tile_tokens, stepped=plan.gpu_stepped_units)
    (l0, n0, w0, v0), _ = _train(cfg, ref, overlap=False)
    (l1, n1, w1, v1), moved = _train(cfg, plan, overlap=True, staging=10_000)
    assert l0 == l1 and n0 == n1
    diff = (w0 - w1).abs()
    assert torch.equal(w0, w1), f"weights differ: max {diff.max():.3g} mean {diff.mean():.3g}"
    assert torch.equal(v0, v1)
    assert (moved > 0) == (plan.parked_layers > 0)


def test_the_clip_multiplied_in_the_kernel_equals_the_serial_schedule_bitwise(monkeypatch):
    """Held gradients in host memory, many chunks a unit, the overlapped schedule's host AdamW
    multiplying by the clip in its kernel's own pass (clipadam.py: it must build and equal torch's
    kernel on this host) against the serial schedule's torch kernel after the multiply: weights
    and moments bitwise, and a clip that fired."""
    cfg = _cfg("llama", False)
    monkeypatch.setattr(optim, "FUSED_CLIP", False)
    (l0, n0, w0, v0), _ = _train(cfg, _plan(), overlap=False)
    assert clipadam.load()[0] is not None, clipadam.load()[1]
    monkeypatch.setattr(optim, "FUSED_CLIP", True)
    (l1, n1, w1, v1), _ = _train(cfg, _plan(gpu_grads=0), overlap=True, staging=10_000)
    assert max(n0) > 0.5  # the clip fired: the multiply ran
    assert l0 == l1 and n0 == n1
    assert torch.equal(w0, w1) and torch.equal(v0, v1)


def test_immediate_steps_equal_the_serial_schedule_without_clipping():
    cfg = _cfg("qwen2", True)
    (l0, n0, w0, v0), _ = _train(cfg, _plan(), overlap=False, max_norm=0.0)
    (l1, n1, w1, v1), _ = _train(cfg, _plan("immediate", 0), overlap=True, max_norm=0.0, staging=10_000)
    assert l0 == l1 and n0 == n1
    assert torch.equal(w0, w1) and torch.equal(v0, v1)


def test_resident_units_overlapped_equal_serial():
    """Leading units' state on the GPU, stepped there (CUDA AdamW): the overlapped schedule equals
    the serial one with the same residency, in each gradient mode."""
    cfg = _cfg("qwen2")
    for plan, max_norm in (
        (_plan(resident=2, gpu_grads=0, keep=1), 0.5),
        (_plan("two_pass", 0, resident=2), 0.5),
        (_plan("immediate", 0, resident=2), 0.0),
    ):
        ref, _ = _train(cfg, _plan(resident=2), overlap=False, max_norm=max_norm)
        got, _ = _train(cfg, plan, overlap=True, max_norm=max_norm)
        assert ref[0] == got[0] and ref[1] == got[1]
        assert torch.equal(ref[2], got[2]) and torch.equal(ref[3], got[3])


def test_the_micro_batch_major_update_equals_the_serial_layer_major_one_bitwise():
    """Every unit GPU-resident, each micro-batch's forward, loss and backward through every layer
    in turn, every layer's graph kept (`update_order: micro_batch`): the overlapped schedule and
    the serial one equal the serial layer-major schedule (every layer recomputed) bitwise, with
    gradients held for the clip and stepped without it, tied and untied."""
    for family, tied in (("qwen3", True), ("llama", False)):
        cfg = _cfg(family, tied)
        for mode, max_norm in (("stored", 0.5), ("immediate", 0.0)):
            ref, _ = _train(cfg, _plan(resident=UNITS), overlap=False, max_norm=max_norm)
            assert max_norm == 0 or max(ref[1]) > max_norm  # the clip fired
            for overlap in (False, True):
                plan = _plan(mode, UNITS, resident=UNITS, order="micro_batch")
                got, _ = _train(cfg, plan, overlap=overlap, max_norm=max_norm)
                assert ref[0] == got[0] and ref[1] == got[1], (family, mode, overlap)
                diff = (ref[2] - got[2]).abs()
                assert torch.equal(ref[2], got[2]), (
                    f"{family} {mode}: max {diff.max():.3g} mean {diff.mean():.3g}"
                )
                assert torch.equal(ref[3], got[3])


@pytest.mark.parametrize("keep", [4, 0], ids=["layer-major-kept", "layer-major-recomputed"])
def test_the_compiled_micro_batch_major_update_equals_the_layer_major_one_bitwise(keep):
    """The same with the decoder layer compiled, against the compiled layer-major schedule keeping
    every layer's graph (the same compiled training graph runs every forward) and recomputing
    every layer (its forward sweep runs the layer compiled without autograd, the boundary
    activations those forwards' outputs): bitwise where Inductor computes the layer's output to
    the same bits with and without autograd."""
    cfg = _cfg("llama", False)
    ref, _ = _train(cfg, _plan(resident=UNITS, keep=keep), overlap=False, compile=True)
    got, _ = _train(cfg, _plan(resident=UNITS, order="micro_batch"), overlap=True, compile=True)
    assert ref[0] == got[0] and ref[1] == got[1]
    diff = (ref[2] - got[2]).abs()
    assert torch.equal(ref[2], got[2]), f"max {diff.max():.3g} mean {diff.mean():.3g}"
    assert torch.equal(ref[3], got[3])


def test_the_step_stream_reads_the_callers_flags_after_it_lets_them_go():
    """The GPU stepper's stream runs behind the caller (here its loads are held back on purpose):
    the clip coefficient and the skip flag it reads must keep the caller's values after the caller
    drops them and the compute stream reuses their memory. (The immediate mode's skip flag, made
    and dropped per unit during the backward sweep, was once read after the compute stream had
    written a later tensor there: an update skipped, or applied with another tensor's bytes.)"""
    from test_gpustep import _copy, _state

    from megatrain.engine.gpustep import GpuStepper

    cfg = ModelConfig.from_hf(tiny_config("qwen2"))
    state = _state(cfg, 0)
    ref, before = _copy(state), _copy(state)
    units = state.units[:2]
    grads = [torch.randn(u.numel, generator=torch.Generator().manual_seed(u.index)).cuda() for u in units]
    compute = torch.cuda.current_stream()

    def flags():
        return torch.full((), 0.37, device="cuda"), torch.zeros((), dtype=torch.bool, device="cuda")

    # the reference: everything in program order on the compute stream
    serial = GpuStepper(ref, ADAMW, ref.units[:2], torch.float32, 1000, compute, compute, overlap=False)
    c, k = flags()
    serial.step([(u, g.clone()) for u, g in zip(units, grads)], c, 1e-2, 1, k)
    torch.cuda.synchronize()
    serial.close()
    pinned = [hostmem.Registration(state.hi), hostmem.Registration(state.lo)]  # the transport's
    load = torch.cuda.Stream()
    stepper = GpuStepper(state, ADAMW, units, torch.float32, 1000, compute, load)
    with torch.cuda.stream(load):
        torch.cuda._sleep(1_000_000_000)  # the step stream waits for its loads: ~0.5 s behind
    coef, skip = flags()
    stepper.step([(u, g.clone()) for u, g in zip(units, grads)], coef, 1e-2, 1, skip)
    del coef, skip  # the caller lets them go; the compute stream writes what it allocates next
    junk = [torch.full((), 1e30, device="cuda") for _ in range(64)]
    junk += [torch.ones((), dtype=torch.bool, device="cuda") for _ in range(64)]
    stepper.wait()
    torch.cuda.synchronize()
    stepper.close()
    for r in pinned:
        r.close()
    assert not torch.equal(ref.master(), before.master())  # the reference stepped at all
    for w in state.buffers:
        assert torch.equal(getattr(state, w), getattr(ref, w)), w
    del junk


def test_gpu_stepped_units_equal_serial_and_resident_ones():
    """The first units' state streamed to the GPU for each step and back (stored: during the
    backward sweep into buffers held for the step; two-pass and immediate: after the clip, in many
    small chunks): the overlapped schedule equals the serial one with the same units GPU-stepped
    (prestaged), in each gradient mode, and those equal the same units kept GPU-resident (one
    kernel, the same numbers); their state crosses PCIe both ways once per step, and where
    gradients are held it is all in before the clip and their weights do not cross again."""
    cfg = _cfg("qwen2", True)
    stepped = 3  # the embedding (fetched again by the tied head) and two layers
    serial = {}
    for plan, max_norm in (
        (_plan(gpu_grads=0, stepped=stepped), 0.5),
        (_plan("two_pass", 0, stepped=stepped), 0.5),
        (_plan("immediate", 0, stepped=stepped), 0.0),
    ):
        ref, _ = _train(cfg, _plan(stepped=stepped), overlap=False, max_norm=max_norm)
        serial.setdefault(max_norm, ref)
        got, _ = _train(cfg, plan, overlap=True, max_norm=max_norm, staging=10_000)
        assert ref[0] == got[0] and ref[1] == got[1], plan.grad_mode
        diff = (ref[2] - got[2]).abs()
        assert torch.equal(ref[2], got[2]), f"{plan.grad_mode}: max {diff.max():.3g} mean {diff.mean():.3g}"
        assert torch.equal(ref[3], got[3]), plan.grad_mode
    resident, _ = _train(cfg, _plan(resident=stepped), overlap=False)
    streamed = serial[0.5]
    diff = (resident[2] - streamed[2]).abs()
    assert resident[0] == streamed[0], (resident[0], streamed[0])
    assert torch.equal(resident[2], streamed[2]), f"max {diff.max():.3g} mean {diff.mean():.3g}"
    assert torch.equal(resident[3], streamed[3])
    m = _build(cfg, _plan(gpu_grads=0, stepped=stepped), staging=10_000)
    stepper = m.transport.stepper
    assert stepper.slots == []  # prestaged: no scratch, so no chunked step
    _steps(m, n_steps=2)
    state_bytes = 12 * sum(u.numel for u in m.state.units[:stepped])
    assert stepper.h2d_bytes == stepper.d2h_bytes == 2 * state_bytes
    ids = torch.randint(0, 512, (2, 128), generator=torch.Generator().manual_seed(5))
    fetched = m.transport.h2d_bytes
    m.engine.forward_backward([MicroBatch(ids, ids)])
    assert stepper.h2d_bytes == 3 * state_bytes  # queued during the backward sweep
    # the stepped units' weights come from their step in both sweeps (and for the tied head): only
    # the other units' cross, layers 3 and 4 twice, as the master's bf16 halves
    n = [u.numel for u in m.state.units]
    assert m.transport.h2d_bytes - fetched == 2 * (2 * n[3] + 2 * n[4] + n[5])
    m.engine.step(1e-3, m.engine.clip_grad_norm(0.5)[1])
    assert stepper.h2d_bytes == stepper.d2h_bytes == 3 * state_bytes
    m.close()


def test_the_embeddings_rows_equal_the_serial_schedule_bitwise():
    """The embedding stepped in host memory and fetched as the rows a step looks up (engine/rows.py).
    Overlapped, the worker computes the next pass's rows ahead and the table's update after the
    other host units; serial, the fetch gathers the rows from the stepped table. Both equal the
    serial schedule that fetches the whole table, bit for bit (losses, norms, weights, moments),
    with a clip that fires and one that does not; so do overlapped and serial with GPU-stepped
    units after the embedding and a kept graph. Only the rows cross the link: fewer bytes than the
    table."""
    cfg = _cfg("llama")
    for max_norm in (0.5, 1e9):
        ref, _ = _train(cfg, _plan(gpu_grads=1), overlap=False, max_norm=max_norm)
        for overlap in (False, True):
            got, _ = _train(cfg, replace(_plan(gpu_grads=1), embed_rows=True), overlap, max_norm, 10_000)
            assert ref[0] == got[0] and ref[1] == got[1], (max_norm, overlap)
            diff = (ref[2] - got[2]).abs()
            assert torch.equal(ref[2], got[2]), f"{max_norm, overlap}: max {diff.max():.3g}"
            assert torch.equal(ref[3], got[3]), (max_norm, overlap)
    plan = replace(_plan(gpu_grads=0, keep=1, stepped=2), embed_rows=True)
    ref, _ = _train(cfg, plan, overlap=False)
    got, _ = _train(cfg, plan, overlap=True, staging=10_000)
    assert ref[0] == got[0] and ref[1] == got[1]
    assert torch.equal(ref[2], got[2]) and torch.equal(ref[3], got[3])
    moved = []
    for rows in (False, True):
        m = _build(cfg, replace(_plan(gpu_grads=1), embed_rows=rows))
        _steps(m, n_steps=2, vocab=200)  # 768 tokens a step of the table's first 200 rows
        moved.append(m.transport.h2d_bytes)
        m.close()
    # a step: the table as the master's bf16 halves (2 B a parameter), or at most 200 rows in bf16
    assert moved[0] - moved[1] >= 2 * (2 * 512 * 256 - 2 * 200 * 256), moved


def test_the_rows_wait_for_the_next_pass_is_counted_apart_from_the_adamw():
    """The worker's wait for the next pass to post its rows (here: the launching thread sleeps
    before it begins) is counted in `rows_wait_s`, not in the AdamW's seconds, so the in-step
    AdamW rate (params / adam_s) is its own."""
    cfg = _cfg("llama")
    m = _build(cfg, replace(_plan(gpu_grads=1), embed_rows=True))
    _steps(m, n_steps=1)  # nothing computed ahead in the first step
    c = m.transport.counters
    adam0, wait0, rows0 = c.adam_s, c.rows_wait_s, c.rows_s
    pause, steps = 0.25, 3
    g = torch.Generator().manual_seed(0)
    for _ in range(steps):
        mbs = [
            MicroBatch(ids, ids) for ids in (torch.randint(0, 512, (2, 128), generator=g) for _ in range(3))
        ]
        m.engine.forward_backward(mbs)
        m.engine.step(2e-3, m.engine.clip_grad_norm(0.5)[1])
        time.sleep(pause)  # the worker has the step's job and waits for the next pass's rows
    m.transport.synchronize()
    waited, adam, rows = c.rows_wait_s - wait0, c.adam_s - adam0, c.rows_s - rows0
    assert waited >= (steps - 1) * pause * 0.9, (waited, adam)
    assert adam < pause, (waited, adam)  # a tiny model's AdamW: milliseconds, none of the sleep
    assert 0 < rows <= adam, (rows, adam)
    m.close()


def test_page_locking_in_pieces(monkeypatch):
    """Master weights and host gradients registered in many pieces (as for a model past the
    drivers' 512 GiB limit) train exactly as with one registration."""
    cfg = _cfg("llama")
    (ref, _) = _train(cfg, _plan(gpu_grads=0), overlap=True)
    monkeypatch.setattr(hostmem, "MAX_REGISTRATION", 2**20)
    m = _build(cfg, _plan(gpu_grads=0))
    assert all(len(r.ptrs) >= 3 for r in m.transport._registrations)
    losses, norms = _steps(m)
    diff = (ref[2] - m.state.master()).abs()
    assert ref[0] == losses, (ref[0], losses)
    assert ref[1] == norms, (ref[1], norms)
    assert torch.equal(ref[2], m.state.master()), (
        f"weights differ: max {diff.max():.3g}, {int((diff > 0).sum())} elements"
    )
    m.close()


def test_bf16_cuda_tracks_fp32_cpu():
    cfg = _cfg("llama")
    ref = build_model(cfg, seed=5, device="cpu", compute_dtype="float32", adamw=ADAMW)
    gpu = build_model(cfg, seed=5, device="cuda", compute_dtype="bfloat16", adamw=ADAMW)  # its own plan
    w_init = ref.state.master()
    l_ref, n_ref = _steps(ref)
    l_gpu, n_gpu = _steps(gpu)
    for a, b in zip(l_ref, l_gpu):
        assert abs(a - b) / a < 2e-2, (l_ref, l_gpu)
    for a, b in zip(n_ref, n_gpu):
        assert abs(a - b) / a < 5e-2, (n_ref, n_gpu)
    d_ref, d_gpu = ref.state.master() - w_init, gpu.state.master() - w_init
    cos = torch.nn.functional.cosine_similarity(d_ref, d_gpu, dim=0)
    assert cos > 0.95, f"update directions differ: cosine {cos:.3f}"
    gpu.close()


def test_fp32_cuda_matches_cpu():
    cfg = _cfg("qwen2", tied=True)
    ref = build_model(cfg, seed=7, device="cpu", compute_dtype="float32", adamw=ADAMW)
    gpu = build_model(cfg, seed=7, device="cuda", compute_dtype="float32", adamw=ADAMW)
    l_ref, _ = _steps(ref, n_steps=2)
    l_gpu, _ = _steps(gpu, n_steps=2)
    assert l_ref == pytest.approx(l_gpu, rel=1e-4)
    # Adam divides by sqrt(v): where a gradient is ~0, rounding noise moves a weight by up to lr.
    diff = (gpu.state.master() - ref.state.master()).abs()
    assert (diff > 1e-4).float().mean() < 1e-4, f"max {diff.max():.3g} mean {diff.mean():.3g}"
    assert diff.max() < 2 * ADAMW.lr
    gpu.close()


EVAL_CASES = {
    # gradients held until the clip; kept graphs and GPU-resident units stepped on the device
    "stored": (_plan(gpu_grads=0), 0.5),
    "stored-resident-kept": (_plan(resident=2, keep=1), 0.5),
    # the next sweep takes GPU-stepped units' weights from their step, the one after from host memory
    "stored-gpu-stepped": (_plan(gpu_grads=0, stepped=2), 0.5),
    # steps whose backward sweep runs inside `step`: evaluation comes after it
    "two-pass": (_plan("two_pass", 0, resident=2), 0.5),
    "immediate": (_plan("immediate", 0), 0.0),
    # the embedding's rows: computed ahead for the evaluation's pass, so the next training pass
    # gathers its rows from the table once its update is done
    "stored-embedding-rows": (replace(_plan(gpu_grads=0, stepped=2), embed_rows=True), 0.5),
}


@pytest.mark.parametrize("case", list(EVAL_CASES))
def test_eval_after_an_async_step_sees_the_updated_weights(case):
    """Evaluating right after `step`, while the optimizer still runs behind on its worker
    thread, reads the updated weights (the serial schedule's eval losses, bit for bit), and
    leaves training as it is without evaluation."""
    plan, max_norm = EVAL_CASES[case]
    cfg = _cfg("llama")
    g = torch.Generator().manual_seed(99)
    evaluation = [MicroBatch(ids, ids) for ids in (torch.randint(0, 512, (2, 96), generator=g),) * 2]
    results = []
    for overlap, evaluate in ((False, True), (True, True), (True, False)):
        # overlapped: a slow, many-chunk optimizer; a fetch that did not wait would read old weights
        m = _build(cfg, plan, overlap, staging=10_000 if overlap else None)
        evals, step = [], m.engine.step

        def step_then_eval(lr, coef, m=m, evals=evals, step=step, evaluate=evaluate):
            measured = step(lr, coef)  # the gradient norm in immediate mode
            if evaluate:
                evals.append(m.engine.eval_loss(evaluation)[0].item())
            return measured

        m.engine.step = step_then_eval
        losses, norms = _steps(m, max_norm=max_norm)
        results.append((evals, losses, norms, m.state.master()))
        m.close()
    (e0, l0, n0, w0), (e1, l1, n1, w1), (_, l2, n2, w2) = results
    assert len(e0) == 4 and e0 == e1, (e0, e1)
    assert l0 == l1 == l2 and n0 == n1 == n2
    assert torch.equal(w0, w1) and torch.equal(w1, w2)


def test_gradients_are_freed_once_stepped():
    """Gradients held on the GPU until the clip are released by the optimizer worker as their
    units are stepped: after the step's updates, the GPU holds no gradient (a released job must
    not stay referenced until the next step hands over its own)."""
    cfg = _cfg("llama")
    m = _build(cfg, _plan(gpu_grads=UNITS), staging=10_000)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 512, (2, 128), generator=g)
    m.engine.eval_loss([MicroBatch(ids, ids)])  # the weight buffers exist from here on
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    grad_bytes = sum(u.numel for u in m.state.units) * 4
    m.engine.forward_backward([MicroBatch(ids, ids)])
    held = torch.cuda.memory_allocated() - base
    assert held >= grad_bytes, (held, grad_bytes)
    _, coef = m.engine.clip_grad_norm(0.5)
    m.engine.step(1e-3, coef)
    m.transport.wait_updates()
    deadline = time.monotonic() + 5  # the worker drops its last references just after the update
    while torch.cuda.memory_allocated() - base > grad_bytes // 4 and time.monotonic() < deadline:
        time.sleep(0.01)
    left = torch.cuda.memory_allocated() - base
    m.close()
    assert left < grad_bytes // 4, (
        f"{left / 2**20:.1f} MiB still held after the step, gradients {grad_bytes / 2**20:.1f} MiB"
    )


# --------------------------------------------------------------------------- packed rows, windows
def _packed_rows(rows: list[list[int]], vocab=512, seed=0) -> MicroBatch:
    """Rows of documents (lengths) as the Batcher packs them."""
    g = torch.Generator().manual_seed(seed)
    seq = sum(rows[0])
    ids = torch.randint(0, vocab, (len(rows), seq), generator=g)
    labels = ids.clone()
    pos, doc = torch.empty_like(ids), torch.empty_like(ids)
    for r, lengths in enumerate(rows):
        a = 0
        for d, n in enumerate(lengths):
            labels[r, a], pos[r, a : a + n], doc[r, a : a + n] = -100, torch.arange(n), d
            a += n
    return MicroBatch(ids, labels, position_ids=pos, document_ids=doc)


def _attention_run(cfg, dtype, flex: bool, compile: bool, mbs):
    """Logits of the first micro-batch, then one step's loss and gradient norm."""
    m = build_model(
        cfg, seed=3, device="cuda", compute_dtype=dtype, adamw=ADAMW, plan=_plan(), compile=compile
    )
    m.engine.flex_masks = flex
    logits = m.engine.logits(mbs[0])
    loss, _ = m.engine.forward_backward(mbs)
    norm, _ = m.engine.clip_grad_norm(0.5)
    out = logits, loss.item(), norm.item()
    m.engine.skip_step()
    m.close()
    return out


# Documents crossing the 128-token blocks, a window shorter than them, grouped K/V heads.
PACKED = [[300, 500, 1, 223], [1024]]


@pytest.mark.parametrize("compile", [False, True], ids=["flex-compiled", "layer-compiled"])
def test_flex_attention_equals_the_masked_path(compile):
    """FlexAttention (compiled on its own, or inside the compiled layer) against the dense-mask
    SDPA path on the same GPU, compiled the same way (so that only the attention differs): fp32 to
    1e-4; in bf16 both are as far from the fp32 result as each other (FlexAttention's logits no
    further than 1.25x the masked path's on average and 2x at most), loss within 5e-3 and the
    gradient norm within 2e-2 of the masked path's."""
    cfg = _cfg("mistral", sliding_window=200)
    mbs = [_packed_rows(PACKED, seed=s) for s in (0, 1)]
    exact = None
    for dtype, tol in (("float32", 1e-4), ("bfloat16", None)):
        ref = _attention_run(cfg, dtype, flex=False, compile=compile, mbs=mbs)
        got = _attention_run(cfg, dtype, flex=True, compile=compile, mbs=mbs)
        d = (got[0] - ref[0]).abs()
        msg = f"{dtype}: logits max {d.max():.3g} mean {d.mean():.3g}, loss {got[1]} vs {ref[1]}, norm {got[2]} vs {ref[2]}"
        if tol:
            torch.testing.assert_close(got[0], ref[0], rtol=tol, atol=tol, msg=msg)
            assert got[1] == pytest.approx(ref[1], rel=tol) and got[2] == pytest.approx(ref[2], rel=tol), msg
            exact = ref[0]
        else:
            flex_err, masked_err = (got[0] - exact).abs(), (ref[0] - exact).abs()
            msg += f"; from fp32: flex max {flex_err.max():.3g} mean {flex_err.mean():.3g}, "
            msg += f"masked max {masked_err.max():.3g} mean {masked_err.mean():.3g}"
            assert flex_err.mean() <= 1.25 * masked_err.mean(), msg
            assert flex_err.max() <= 2 * masked_err.max(), msg
            assert got[1] == pytest.approx(ref[1], rel=5e-3) and got[2] == pytest.approx(ref[2], rel=2e-2), (
                msg
            )


def test_packed_rows_need_memory_linear_in_the_sequence():
    """Rows of packed 4k documents train through FlexAttention with a step peak that grows
    linearly with the row (16k -> 32k tokens: under 3x, where anything S x S would give 4x) and
    stays far below one S x S boolean mask at 32k (1 GiB), let alone the masked path's scores."""
    cfg = _cfg("llama")
    m = build_model(cfg, seed=3, device="cuda", compute_dtype="bfloat16", adamw=ADAMW, plan=_plan())
    assert m.engine.flex_masks
    peaks = {}
    for docs in (4, 8):
        mb = _packed_rows([[4096] * docs])
        for _ in range(3):  # the first compiles FlexAttention for this shape
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            loss, _ = m.engine.forward_backward([mb])
            torch.cuda.synchronize()
            peaks[docs * 4096] = torch.cuda.max_memory_allocated() - base
            assert torch.isfinite(loss)
            m.engine.skip_step()
    m.close()
    ratio = peaks[32768] / peaks[16384]
    assert ratio < 3, f"step peaks {peaks}: x{ratio:.2f} for twice the tokens"
    assert peaks[32768] < 32768 * 32768, f"step peak {peaks[32768] / 2**20:.0f} MiB"  # one bool mask


def test_probe_measures_the_masked_layer():
    """A run with packed rows probes its layer through FlexAttention: a graph of the same order
    as the flash kernel's (both keep O(S) per head), not O(S^2)."""
    from megatrain.planning.probe import layer_memory_for

    cfg = _cfg("mistral", sliding_window=1024)
    plain = layer_memory_for(cfg, "cuda", torch.bfloat16, True, 8192)
    masked = layer_memory_for(cfg, "cuda", torch.bfloat16, True, 8192, masked=True)
    assert masked.graph_per_token < 1.5 * plain.graph_per_token, (masked, plain)
    assert masked.backward_per_token < 1.5 * plain.backward_per_token + 64, (masked, plain)


def test_probe_splits_the_layer_rate_into_matmuls_and_attention():
    """The probe times the causal attention alone at 32k tokens and the rest of the layer from its
    own run: both rates are those of a Hopper GPU in bf16 (0.1 to 1.2 PFLOP/s), and the cost model
    takes them (a 256k-token step, mostly attention, costs more than at the layer's one rate where
    attention runs slower than the layer did at 8k tokens, less where it runs faster)."""
    import dataclasses

    from megatrain.planning import footprint, planspec
    from megatrain.planning.placement import Batch, Machine, Plan
    from megatrain.planning.probe import layer_memory_for

    cfg = _cfg(
        "llama", hidden_size=2048, intermediate_size=7168, num_attention_heads=16, num_key_value_heads=4
    )
    lm = layer_memory_for(cfg, "cuda", torch.bfloat16, True, 8192)
    assert 1e14 < lm.attention_flops_per_s < 1.2e15 and 1e14 < lm.dense_flops_per_s < 1.2e15, lm
    one = dataclasses.replace(lm, dense_flops_per_s=None, attention_flops_per_s=None)
    long = Batch(262144, 1, 262144, 2, True, rows=1)
    plan, machine = Plan("cuda", "stored", 0, 0, 0, 0, 4096, 0, 0), Machine("cuda", 139 * 2**30, 120 * 2**30)
    t = {
        k: footprint.evaluate(planspec.model_shape(cfg, m), long, plan, machine).step_time_s
        for k, m in (("split", lm), ("one", one))
    }
    # most of a 256k-token step is attention: it costs more where attention runs slower than the layer
    assert (t["split"] > t["one"]) == (lm.attention_flops_per_s < lm.flops_per_s), (t, lm)


def test_tiled_mlp_compiled_tracks_the_untiled_layer():
    """The tiled MLP inside the compiled layer (inductor; the tile loop runs eagerly): bf16
    training follows the untiled compiled layer's within bf16 tolerance."""
    cfg = _cfg("llama")
    runs = []
    for tile in (0, 100):
        plan = _plan(tile=tile)
        m = build_model(
            cfg, seed=3, device="cuda", compute_dtype="bfloat16", adamw=ADAMW, plan=plan, compile=True
        )
        assert all(t.mlp.tile_tokens == tile for t in m.engine.layers.values())
        w_init = m.state.master()
        losses, norms = _steps(m)
        runs.append((losses, norms, m.state.master() - w_init))
        m.close()
    (l0, n0, d0), (l1, n1, d1) = runs
    assert l1 == pytest.approx(l0, rel=1e-2) and n1 == pytest.approx(n0, rel=3e-2), (l0, l1, n0, n1)
    cos = torch.nn.functional.cosine_similarity(d0, d1, dim=0)
    assert cos > 0.99, f"update directions differ: cosine {cos:.4f}"


def test_compiled_layers_compute_the_same_bits_whatever_the_compilers_timings():
    """Inductor times candidate kernels as it compiles (a reduction's block sizes, a matmul's
    padding) and keeps the fastest; each orders sums differently. With every timing random (a busy
    GPU, exaggerated), three compiles of Llama-3-8B's layer from empty caches give bitwise the same
    output and gradients, since megatrain compiles with inductor's choices made by rule
    (models/compiling.py). By timing, four such compiles gave three different results on an H200
    (bench/results/2026-11-27_1743_compiler.md). Rows of 128 tokens: one key block of the
    attention, whose backward adds over key blocks atomically."""
    assert INDUCTOR_OPTIONS, f"torch {torch.__version__}: inductor has no deterministic mode"
    call, params, x, inputs, dy = llama_layer(128, 128, **LLAMA_8B_LAYER)
    digests = set()
    with random_kernel_timings() as timings:
        for _ in range(3):
            torch._dynamo.reset()  # a fresh compile, as in a new process
            y = compiled(call, dynamic=False)(params, x, inputs)
            grads = torch.autograd.grad(y, [x, *params.values()], dy)
            digests.add(hash_bits(y, *grads))
    torch._dynamo.reset()
    assert timings, "no kernel was timed: nothing tested"
    assert len(digests) == 1, digests


def test_tiled_layer_memory_is_what_the_probe_predicts():
    """A 2048-wide layer at 32k tokens, compiled: the probe's prediction of the tiled layer's graph
    and of both phases of its backward (the MLP's tile loop, the rest of the layer), measured at 8k
    tokens and extrapolated, is within 15% of the allocator's counters, and tiling takes the MLP's
    intermediates out of them."""
    from torch.func import functional_call

    from megatrain.models.decoder import DecoderLayer, rope_cos_sin, rope_inv_freq
    from megatrain.planning.probe import measure_layer, probe_tiled, probe_untiled

    cfg = _cfg(
        "llama", hidden_size=2048, intermediate_size=7168, num_attention_heads=16, num_key_value_heads=4
    )
    lm = probe_tiled(
        probe_untiled(cfg, "cuda", torch.bfloat16, True, 8192), cfg, "cuda", torch.bfloat16, True, 8192
    )
    T, tile = 32768, 2048
    inv, scale = rope_inv_freq(cfg)
    cos, sin = rope_cos_sin(inv.cuda(), scale, torch.arange(T, device="cuda")[None], torch.bfloat16)
    measured = {}
    for t in (0, tile):
        with torch.device("meta"):
            layer = DecoderLayer(cfg, mlp_tile_tokens=t)
        params = {
            n: (torch.randn(p.shape, device="cuda") * 0.02).bfloat16() for n, p in layer.named_parameters()
        }
        leaves = {n: p.detach().requires_grad_() for n, p in params.items()}
        pgrads = sum(p.numel() * 2 for p in params.values())
        fn = torch.compile(lambda p, x, rope, layer=layer: functional_call(layer, p, (x, rope, None)))
        x = torch.randn(1, T, cfg.hidden_size, device="cuda", dtype=torch.bfloat16)
        for _ in range(2):  # the first compiles
            graph, rest, _, loop = measure_layer(fn, leaves, params, x, (cos, sin), pgrads, "cuda")
        measured[t] = (graph, rest, loop)
    (g0, b0, _), (g1, rest, loop) = measured[0], measured[tile]
    want = dict(graph=lm.graph(T, tile), loop=lm.tile_loop(T, tile), rest=lm.tiled_rest(T))
    msg = f"measured graph {g1} loop {loop} rest {rest}; predicted {want}; {lm}"
    assert g0 - g1 >= 2 * T * cfg.intermediate_size * 2, msg  # at least gate and up are not kept
    assert g1 + max(loop, rest) < g0 + b0, msg
    assert g1 == pytest.approx(want["graph"], rel=0.15), msg
    # The tile loop's prediction errs high (H200, torch 2.11: 524 MB measured against 633
    # predicted, +21%; the 400k-token run's backward stood 11.8 GiB under its plan for the same
    # reason): safe, but bounded, so that a probe that grows it further fails here.
    assert loop <= want["loop"] * 1.15 and want["loop"] <= loop * 1.25, msg
    assert rest == pytest.approx(want["rest"], rel=0.15), msg


# --------------------------------------------------------------------------- the master's halves
def test_the_halves_rule_on_cuda_is_the_cpus_bit_for_bit():
    """split, join and to_bf16 (host/split.py), the device-side halves of every CUDA path (the
    fp32 fetch's join, the GPU-stepped and GPU-resident units' split and cast, the rollout's),
    give on CUDA the CPU's bits: every high half beside low halves of either sign."""
    from test_split import patterns

    x = patterns().view(torch.float32)
    cpu, gpu = split(x), split(x.cuda())
    assert torch.equal(gpu.hi.cpu().view(torch.int16), cpu.hi.view(torch.int16))
    assert torch.equal(gpu.lo.cpu(), cpu.lo)
    assert torch.equal(join(gpu).cpu().view(torch.int32), x.view(torch.int32))
    assert torch.equal(to_bf16(x.cuda()).cpu().view(torch.int16), cpu.hi.view(torch.int16))


def test_fetches_move_the_halves_and_fp32_compute_equals_the_serial_schedule():
    """A fetch in bf16 moves the master's `hi` (2 B a parameter), in fp32 both halves (4 B),
    joined on the device: twice the bytes. In fp32, the overlapped schedule (GPU-resident and
    GPU-stepped units, gradients in host memory, many chunks) equals the serial one bitwise, and
    the weights a bf16 run fetched are the halves' `hi` (the resident units' cast by that rule)."""
    cfg = _cfg()
    for plan in (_plan(gpu_grads=0), _plan(gpu_grads=0, resident=1, stepped=2)):
        ref, _ = _train(cfg, plan, overlap=False, dtype="float32")
        got, _ = _train(cfg, plan, overlap=True, staging=10_000, dtype="float32")
        assert ref[0] == got[0] and ref[1] == got[1]
        assert torch.equal(ref[2], got[2]) and torch.equal(ref[3], got[3])
    moved = []
    for dtype in ("bfloat16", "float32"):
        m = _build(cfg, _plan(), dtype=dtype)
        _steps(m, n_steps=2)
        moved.append(m.transport.h2d_bytes)
        m.close()
    assert moved[0] > 0 and moved[0] * 2 == moved[1]
    m = _build(cfg, _plan(resident=2))
    m.transport.begin(m.state.units)
    for u in m.state.units:
        fetched = m.transport.fetch(u).cpu()
        assert torch.equal(fetched.view(torch.int16), m.state.flat(u, "hi").view(torch.int16)), u.name
    m.close()


def test_fetching_both_halves_moves_twice_the_bytes_and_trains_the_same_bits():
    """`fetch_both_halves` (the fp32 master's bytes, for comparison): a bf16 fetch moves both
    halves, 4 B a parameter, and keeps their `hi`: the same losses, norms and state as today's."""
    cfg = _cfg()
    runs, moved = [], []
    for both in (False, True):
        m = _build(cfg, replace(_plan(gpu_grads=0, keep=1), fetch_both_halves=both))
        runs.append((*_steps(m), m.state.master(), m.state.exp_avg_sq.clone()))
        moved.append(m.transport.h2d_bytes)
        m.close()
    assert runs[0][0] == runs[1][0] and runs[0][1] == runs[1][1]
    assert torch.equal(runs[0][2], runs[1][2]) and torch.equal(runs[0][3], runs[1][3])
    assert moved[0] > 0 and moved[1] == 2 * moved[0]


@pytest.mark.parametrize("moments", ["8bit", "bf16"])
def test_low_precision_moments_on_the_gpu_equal_the_serial_schedule(moments):
    """bf16 and 8-bit AdamW moments (`optim`) stepped on the GPU: GPU-resident and GPU-stepped
    units (the one-pass kernel on CUDA) beside host-stepped ones (the host kernel), gradients in host memory,
    many chunks: the overlapped schedule equals the serial one bitwise, and the units stepped on
    the GPU end where the host steps them, bitwise."""
    from megatrain.host.moments import BF16, Q8

    fmt = {"8bit": Q8, "bf16": BF16}[moments]
    adamw = replace(ADAMW, moments=fmt)
    cfg = _cfg()

    def train(plan, overlap, staging=None):
        if staging:
            plan = replace(plan, staging_elems=staging)
        m = build_model(
            cfg,
            seed=3,
            device="cuda",
            compute_dtype="bfloat16",
            adamw=adamw,
            overlap=overlap,
            plan=plan,
            compile=False,
        )
        losses, norms = _steps(m)
        out = losses, norms, m.state.master(), [getattr(m.state, b).clone() for b in m.state.buffers]
        m.close()
        return out

    plan = _plan(gpu_grads=0, resident=1, stepped=2)
    ref = train(plan, overlap=False)
    got = train(plan, overlap=True, staging=10_240)  # whole 8-bit blocks
    assert ref[0] == got[0] and ref[1] == got[1]
    assert torch.equal(ref[2], got[2])
    assert all(torch.equal(a, b) for a, b in zip(ref[3], got[3]))
    host = train(_plan(gpu_grads=0), overlap=True)
    # the GPU's one-pass kernel steps the host's bits (engine/momentgpu.py)
    assert host[0] == got[0] and host[1] == got[1]
    assert torch.equal(host[2], got[2])
    assert all(torch.equal(a, b) for a, b in zip(host[3], got[3]))
