"""Mixture-of-experts on CUDA (`pytest -m gpu`; skipped elsewhere): the grouped-matmul experts in
bf16 under every schedule equal the serial one bitwise, track the fp32 CPU reference, compile,
and the fp32 CUDA path (experts one after another) matches the CPU. gpt-oss's attention sinks
through FlexAttention's log-sum-exp equal the explicit scores."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config
from test_gpu import ADAMW, _build, _plan, _steps

from megatrain.models.attention import attend, attention_mask, eager_attention
from megatrain.models.config import ModelConfig
from megatrain.runtime import build_model

pytestmark = pytest.mark.gpu


def _cfg(family="olmoe"):
    experts = {
        "mixtral": dict(num_local_experts=8),
        "gpt_oss": dict(num_local_experts=8, head_dim=32, sliding_window=64, swiglu_limit=7.0),
        "v3": dict(num_key_value_heads=8),  # DeepSeek: helpers' latent shapes, 8 experts of 32
        "v2-lite": dict(num_key_value_heads=8),
    }.get(family, dict(num_experts=8, moe_intermediate_size=128))
    shape = dict(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        initializer_range=0.05,
    )
    hf = tiny_config(family, **{**shape, **experts})
    return ModelConfig.from_hf(hf)


def _run(cfg, plan, overlap, max_norm=0.5):
    m = _build(cfg, plan, overlap, staging=10_000 if overlap else None)
    losses, norms = _steps(m, max_norm=max_norm)
    out = (losses, norms, m.state.master(), m.state.exp_avg_sq.clone())
    m.close()
    return out


@pytest.mark.parametrize(
    "family,plan,max_norm",
    [
        ("olmoe", _plan(keep=2), 0.5),
        ("qwen2_moe", _plan(gpu_grads=0, keep=1), 0.5),
        ("mixtral", _plan("two_pass", 0), 0.5),
        ("qwen3_moe", _plan("immediate", 0), 0.0),
        ("gpt_oss", _plan(gpu_grads=3, keep=1), 0.5),
        ("mixtral", _plan(gpu_grads=3, keep=2), 0.5),  # windowed: FlexAttention in a kept graph
        ("v3", _plan(gpu_grads=3, keep=1), 0.5),
        ("v2-lite", _plan("two_pass", 0), 0.0),
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


@pytest.mark.parametrize("family", ["olmoe", "v3", "v2-lite"])
def test_fp32_cuda_experts_match_cpu(family):
    cfg = _cfg(family)
    ref = build_model(cfg, seed=7, device="cpu", compute_dtype="float32", adamw=ADAMW)
    gpu = build_model(cfg, seed=7, device="cuda", compute_dtype="float32", adamw=ADAMW)
    l_ref, _ = _steps(ref, n_steps=2)
    l_gpu, _ = _steps(gpu, n_steps=2)
    assert l_ref == pytest.approx(l_gpu, rel=1e-4)
    gpu.close()


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("window,packed", [(None, False), (100, False), (None, True), (100, True)])
def test_sinks_through_flex_attention_equal_the_explicit_scores(dtype, tol, window, packed):
    """gpt-oss's sinks on CUDA: compiled FlexAttention, its output rescaled by sigmoid(lse - sink),
    against the explicit scores with a sink column (transformers' eager attention): output and the
    gradients of q, k, v and the sinks, over 1024-token rows (plain, windowed, packed)."""
    g = torch.Generator(device="cuda").manual_seed(0)
    B, H, Hkv, S, D = 2, 8, 2, 1024, 64

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=g) * scale).to(dtype).requires_grad_()

    q, k, v, sinks = rand(B, H, S, D), rand(B, Hkv, S, D), rand(B, Hkv, S, D), rand(H, scale=2.0)
    doc = torch.cat([torch.zeros(B, 300), torch.ones(B, 500), torch.full((B, 224), 2)], 1).long().cuda()
    doc = doc if packed else None
    block = attention_mask(doc, S, window, "cuda", flex=True, always=True)
    dense = attention_mask(doc, S, window, "cuda", flex=False, always=True)
    got = attend(q, k, v, block, sinks=sinks)
    ref = eager_attention(q, k, v, dense, None, sinks=sinks)
    dy = torch.randn_like(ref)
    g_got = torch.autograd.grad(got, [q, k, v, sinks], dy)
    g_ref = torch.autograd.grad(ref, [q, k, v, sinks], dy)
    for name, a, b in zip(("out", "dq", "dk", "dv", "dsinks"), (got, *g_got), (ref, *g_ref)):
        d = (a.float() - b.float()).abs()
        scale = b.float().abs().max()
        assert d.max() <= tol * scale, f"{name}: max {d.max():.3g} mean {d.mean():.3g} (scale {scale:.3g})"


@pytest.mark.parametrize("compile", [False, True])
def test_gpt_oss_on_cuda_tracks_fp32_cpu(compile):
    """The whole gpt-oss block on CUDA (sinks through FlexAttention, biased grouped experts): fp32
    losses equal the CPU's to 1e-4, bf16 (compiled or not) within 2e-2."""
    cfg = _cfg("gpt_oss")
    ref = build_model(cfg, seed=5, device="cpu", compute_dtype="float32", adamw=ADAMW)
    l_ref, _ = _steps(ref, n_steps=2)
    for dtype, tol in (("float32", 1e-4), ("bfloat16", 2e-2)):
        gpu = build_model(cfg, seed=5, device="cuda", compute_dtype=dtype, adamw=ADAMW, compile=compile)
        l_gpu, _ = _steps(gpu, n_steps=2)
        assert l_gpu == pytest.approx(l_ref, rel=tol), (dtype, l_ref, l_gpu)
        assert gpu.engine.aux_metrics()["aux_loss"] > 0
        gpu.close()
