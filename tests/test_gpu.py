"""CUDA schedule tests (`pytest -m gpu` on a GPU machine; skipped elsewhere).

The overlapped schedule must give bitwise the same weights as the serial one, and bf16 CUDA
training must track the fp32 CPU reference within bf16 tolerance.
"""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from megatrain.batch import MicroBatch
from megatrain.models.config import ModelConfig
from megatrain.optim import AdamWConfig
from megatrain.runtime import build_model

pytestmark = pytest.mark.gpu


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
        losses.append(loss.item())
        norms.append(norm.item())
        model.engine.step(lr, coef)
    model.transport.synchronize()
    return losses, norms


ADAMW = AdamWConfig(lr=2e-3, betas=(0.9, 0.95), weight_decay=0.1)


@pytest.mark.parametrize(
    "family,tied,resident,keep", [("llama", False, 0, 0), ("qwen3", True, 0, 2), ("qwen2", False, 2, 1)]
)
def test_overlapped_equals_serial_bitwise(family, tied, resident, keep):
    cfg = _cfg(family, tied)
    results = []
    for overlap in (False, True):
        m = build_model(
            cfg,
            seed=3,
            device="cuda",
            compute_dtype="bfloat16",
            adamw=ADAMW,
            overlap=overlap,
            gpu_state="off",
            keep_layers=keep,
        )
        if resident:  # the leading units' state on the GPU, stepped there
            m.transport.make_resident(m.state.units[:resident])
        if overlap:
            m.transport.chunk_elems = 10_000  # many chunks per unit: exercise the chunked pipeline
            m.transport.staging = [torch.empty(10_000, pin_memory=True) for _ in range(2)]
        losses, norms = _steps(m)
        results.append((losses, norms, m.state.master.clone(), m.state.exp_avg_sq.clone()))
        m.close()
    (l0, n0, w0, v0), (l1, n1, w1, v1) = results
    assert l0 == l1 and n0 == n1
    diff = (w0 - w1).abs()
    assert torch.equal(w0, w1), f"weights differ: max {diff.max():.3g} mean {diff.mean():.3g}"
    assert torch.equal(v0, v1)


def test_bf16_cuda_tracks_fp32_cpu():
    cfg = _cfg("llama")
    ref = build_model(cfg, seed=5, device="cpu", compute_dtype="float32", adamw=ADAMW)
    gpu = build_model(cfg, seed=5, device="cuda", compute_dtype="bfloat16", adamw=ADAMW)  # auto residency
    w_init = ref.state.master.clone()
    l_ref, n_ref = _steps(ref)
    l_gpu, n_gpu = _steps(gpu)
    for a, b in zip(l_ref, l_gpu):
        assert abs(a - b) / a < 2e-2, (l_ref, l_gpu)
    for a, b in zip(n_ref, n_gpu):
        assert abs(a - b) / a < 5e-2, (n_ref, n_gpu)
    d_ref, d_gpu = ref.state.master - w_init, gpu.state.master - w_init
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
    diff = (gpu.state.master - ref.state.master).abs()
    assert (diff > 1e-4).float().mean() < 1e-4, f"max {diff.max():.3g} mean {diff.mean():.3g}"
    assert diff.max() < 2 * ADAMW.lr
    gpu.close()


def test_activations_parked_in_host_memory_change_nothing():
    """Boundary activations offloaded to host memory give bitwise the same training."""
    cfg = _cfg("llama")
    results = []
    for offload in (False, True):
        m = build_model(
            cfg,
            seed=11,
            device="cuda",
            compute_dtype="bfloat16",
            adamw=ADAMW,
            gpu_state="off",
            keep_layers=1,
            offload_activations=offload,
        )
        losses, norms = _steps(m, n_steps=3)
        assert (m.engine._host_acts is not None) == offload
        if offload:
            assert m.engine._host_acts.bytes_moved > 0
        results.append((losses, norms, m.state.master.clone()))
        m.close()
    assert results[0][0] == results[1][0] and results[0][1] == results[1][1]
    assert torch.equal(results[0][2], results[1][2])


@pytest.mark.parametrize("resident,keep", [(0, 0), (2, 1)])
def test_eval_after_an_async_step_sees_the_updated_weights(resident, keep):
    """Evaluating right after `step`, while the optimizer still runs behind on its worker
    thread, reads the updated weights (the serial schedule's eval losses, bit for bit), and
    leaves training as it is without evaluation."""
    cfg = _cfg("llama")
    g = torch.Generator().manual_seed(99)
    evaluation = [MicroBatch(ids, ids) for ids in (torch.randint(0, 512, (2, 96), generator=g),) * 2]
    results = []
    for overlap, evaluate in ((False, True), (True, True), (True, False)):
        m = build_model(
            cfg,
            seed=3,
            device="cuda",
            compute_dtype="bfloat16",
            adamw=ADAMW,
            overlap=overlap,
            gpu_state="off",
            keep_layers=keep,
        )
        if resident:
            m.transport.make_resident(m.state.units[:resident])
        if overlap:  # a slow, many-chunk optimizer: a fetch that did not wait would read old weights
            m.transport.chunk_elems = 10_000
            m.transport.staging = [torch.empty(10_000, pin_memory=True) for _ in range(2)]
        evals, step = [], m.engine.step

        def step_then_eval(lr, coef, m=m, evals=evals, step=step, evaluate=evaluate):
            step(lr, coef)
            if evaluate:
                evals.append(m.engine.eval_loss(evaluation)[0].item())

        m.engine.step = step_then_eval
        losses, norms = _steps(m)
        results.append((evals, losses, norms, m.state.master.clone()))
        m.close()
    (e0, l0, n0, w0), (e1, l1, n1, w1), (_, l2, n2, w2) = results
    assert len(e0) == 4 and e0 == e1, (e0, e1)
    assert l0 == l1 == l2 and n0 == n1 == n2
    assert torch.equal(w0, w1) and torch.equal(w1, w2)
