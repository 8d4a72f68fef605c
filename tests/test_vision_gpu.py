"""Vision-language models on CUDA (`pytest -m gpu`; skipped elsewhere): the embedding unit with
its tower, the image features over the image tokens, the trained tower's second fetch in the
backward sweep. For LLaVA, Idefics3, Qwen2.5-VL (M-RoPE), Qwen3-VL (DeepStack), LLaVA-NeXT
(tiles) and Gemma 3 (its images' bidirectional block masks), the overlapped schedule (gradients
held on the GPU or in host memory, the embedding stepped on the GPU, a kept graph) equals the
serial one bitwise, and fp32 CUDA matches the fp32 CPU in logits and after two steps."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from test_gpu import ADAMW, _plan
from vision_helpers import hf_inputs, tiny_vlm, vlm_batch

from megatrain.models.config import ModelConfig
from megatrain.runtime import build_model

pytestmark = pytest.mark.gpu

KINDS = ["llava", "idefics3", "qwen2_5_vl", "qwen3_vl", "llava_next", "gemma3"]
UNITS = 5  # embed (with the tower), 3 layers, head
PLANS = {
    "gpu-grads-kept": _plan(gpu_grads=UNITS, keep=1),
    "host-grads": _plan(gpu_grads=0),
    "embed-gpu-stepped": _plan(gpu_grads=0, stepped=2),
    "two-pass": _plan("two_pass", 0),
}


def _cfg(kind, tmp_path):
    hf = tiny_vlm(kind)
    hf.save_pretrained(tmp_path / kind)
    return ModelConfig.from_json(tmp_path / kind).with_vision(False, False), tmp_path / kind


def _steps(model, kind, n_steps=3, max_norm=0.5, lr=2e-3):
    losses, norms = [], []
    for step in range(n_steps):
        mbs = [vlm_batch(kind, seed=10 * step + m, starts=[3 + 7 * m, 11]) for m in range(2)]
        loss, _ = model.engine.forward_backward(mbs)
        norm, coef = model.engine.clip_grad_norm(max_norm)
        measured = model.engine.step(lr, coef)
        losses.append(loss.item())
        norms.append((norm if norm is not None else measured).item())
    model.transport.synchronize()
    return losses, norms


@pytest.mark.parametrize("plan", PLANS)
@pytest.mark.parametrize("kind", KINDS)
def test_overlapped_equals_the_serial_schedule_bitwise(kind, plan, tmp_path):
    cfg, weights = _cfg(kind, tmp_path)
    runs = []
    for overlap in (False, True):  # the same plan: the serial schedule steps the same units the same way
        m = build_model(
            cfg,
            weights=weights,
            device="cuda",
            compute_dtype="bfloat16",
            adamw=ADAMW,
            overlap=overlap,
            plan=replace(PLANS[plan], staging_elems=10_000),
            compile=False,
        )
        runs.append((*_steps(m, kind), m.state.master(), m.state.exp_avg_sq.clone()))
        m.close()
    (l0, n0, w0, v0), (l1, n1, w1, v1) = runs
    assert l0 == l1 and n0 == n1
    diff = (w0 - w1).abs()
    assert torch.equal(w0, w1), f"weights differ: max {diff.max():.3g} mean {diff.mean():.3g}"
    assert torch.equal(v0, v1)


@pytest.mark.parametrize("kind", KINDS)
def test_fp32_cuda_matches_the_cpu(kind, tmp_path):
    cfg, weights = _cfg(kind, tmp_path)
    mb = vlm_batch(kind)
    hf = tiny_vlm(kind)
    with torch.no_grad():
        ref_logits = hf(**hf_inputs(kind, mb)).logits
    results = []
    for device in ("cpu", "cuda"):
        m = build_model(cfg, weights=weights, device=device, compute_dtype="float32", adamw=ADAMW)
        logits = m.engine.logits(mb).cpu()
        results.append((logits, *_steps(m, kind, n_steps=2)))
        m.close()
    (cpu_logits, l_cpu, _), (gpu_logits, l_gpu, _) = results
    torch.testing.assert_close(gpu_logits, ref_logits, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(cpu_logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert l_gpu == pytest.approx(l_cpu, rel=1e-4), (l_cpu, l_gpu)
