"""Mixture-of-experts on CUDA (`pytest -m gpu`; skipped elsewhere): the grouped-matmul experts in
bf16 under every schedule equal the serial one bitwise, track the fp32 CPU reference, compile,
and the fp32 CUDA path (experts one after another) matches the CPU."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config
from test_gpu import ADAMW, _build, _plan, _steps

from megatrain.models.config import ModelConfig
from megatrain.runtime import build_model

pytestmark = pytest.mark.gpu


def _cfg(family="olmoe"):
    experts = (
        dict(num_local_experts=8) if family == "mixtral" else dict(num_experts=8, moe_intermediate_size=128)
    )
    hf = tiny_config(
        family,
        vocab_size=512,
        hidden_size=256,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        initializer_range=0.05,
        **experts,
    )
    return ModelConfig.from_hf(hf)


def _run(cfg, plan, overlap, max_norm=0.5):
    m = _build(cfg, plan, overlap, staging=10_000 if overlap else None)
    losses, norms = _steps(m, max_norm=max_norm)
    out = (losses, norms, m.state.master.clone(), m.state.exp_avg_sq.clone())
    m.close()
    return out


@pytest.mark.parametrize(
    "family,plan,max_norm",
    [
        ("olmoe", _plan(keep=2), 0.5),
        ("qwen2_moe", _plan(gpu_grads=0, keep=1), 0.5),
        ("mixtral", _plan("two_pass", 0), 0.5),
        ("qwen3_moe", _plan("immediate", 0), 0.0),
    ],
)
def test_moe_placements_equal_the_serial_schedule_bitwise(family, plan, max_norm):
    cfg = _cfg(family)
    l0, n0, w0, v0 = _run(cfg, _plan(), overlap=False, max_norm=max_norm)
    l1, n1, w1, v1 = _run(cfg, plan, overlap=True, max_norm=max_norm)
    assert l0 == l1 and n0 == n1
    diff = (w0 - w1).abs()
    assert torch.equal(w0, w1), f"weights differ: max {diff.max():.3g} mean {diff.mean():.3g}"
    assert torch.equal(v0, v1)


@pytest.mark.parametrize("compile", [False, True])
def test_bf16_grouped_experts_track_fp32_cpu(compile):
    cfg = _cfg("qwen2_moe")
    ref = build_model(cfg, seed=5, device="cpu", compute_dtype="float32", adamw=ADAMW)
    gpu = build_model(cfg, seed=5, device="cuda", compute_dtype="bfloat16", adamw=ADAMW, compile=compile)
    l_ref, _ = _steps(ref)
    l_gpu, _ = _steps(gpu)
    for a, b in zip(l_ref, l_gpu):
        assert abs(a - b) / a < 2e-2, (l_ref, l_gpu)
    assert gpu.engine.aux_metrics()["aux_loss"] > 0
    gpu.close()


def test_fp32_cuda_experts_match_cpu():
    cfg = _cfg("olmoe")
    ref = build_model(cfg, seed=7, device="cpu", compute_dtype="float32", adamw=ADAMW)
    gpu = build_model(cfg, seed=7, device="cuda", compute_dtype="float32", adamw=ADAMW)
    l_ref, _ = _steps(ref, n_steps=2)
    l_gpu, _ = _steps(gpu, n_steps=2)
    assert l_ref == pytest.approx(l_gpu, rel=1e-4)
    gpu.close()
