"""The other families on CUDA (`pytest -m gpu`; skipped elsewhere): Gemma 2 and 3 (soft-capped
scores through FlexAttention's score modifier, alternating sliding-window layers), Phi-3, OLMo 2,
Cohere, and Granite through the generic path (transformers' own layer). For each, the overlapped
schedule with gradients held on the GPU and a kept graph equals the serial one bitwise, and fp32
CUDA training matches the fp32 CPU."""

from __future__ import annotations

import pytest
import torch
from test_gpu import ADAMW, _cfg, _plan, _steps, _train

from megatrain.runtime import build_model

pytestmark = pytest.mark.gpu

FAMILIES = {
    "gemma2": {},
    "gemma3_text": dict(layer_types=["sliding_attention", "full_attention"] * 2),
    "phi3": dict(sliding_window=64),
    "olmo2": {},
    "cohere": {},
    "granite": {},  # the generic path
}


@pytest.mark.parametrize("family", FAMILIES)
def test_overlapped_equals_the_serial_schedule_bitwise(family):
    cfg = _cfg(family, **FAMILIES[family])
    (l0, n0, w0, v0), _ = _train(cfg, _plan(), overlap=False)
    (l1, n1, w1, v1), _ = _train(cfg, _plan(gpu_grads=3, keep=1), overlap=True, staging=10_000)
    assert l0 == l1 and n0 == n1
    diff = (w0 - w1).abs()
    assert torch.equal(w0, w1), f"weights differ: max {diff.max():.3g} mean {diff.mean():.3g}"
    assert torch.equal(v0, v1)


@pytest.mark.parametrize("family", FAMILIES)
def test_fp32_cuda_matches_the_cpu(family):
    cfg = _cfg(family, **FAMILIES[family])
    ref = build_model(cfg, seed=7, device="cpu", compute_dtype="float32", adamw=ADAMW)
    gpu = build_model(cfg, seed=7, device="cuda", compute_dtype="float32", adamw=ADAMW)
    l_ref, _ = _steps(ref, n_steps=2)
    l_gpu, _ = _steps(gpu, n_steps=2)
    assert l_gpu == pytest.approx(l_ref, rel=1e-4), (l_ref, l_gpu)
    gpu.close()
