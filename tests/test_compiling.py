"""Compiled layers stay compiled however many models a process builds (megatrain/models/compiling.py)."""

from __future__ import annotations

import functools

import torch
from helpers import tiny_config
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from megatrain.data.batch import MicroBatch
from megatrain.engine.engine import Engine
from megatrain.engine.optim import AdamWConfig
from megatrain.models.config import ModelConfig
from megatrain.runtime import build_model


def test_the_sixth_model_of_a_process_still_runs_its_layer_compiled(monkeypatch):
    """Each model shape costs `Engine._call_layer` two compiled variants (with and without grad);
    at the compiler's default limit of 8 the fifth model's layer would run uncompiled (and
    uncompiled FlexAttention materialises every score). Six shapes on the CPU, the compiler's
    tracing alone (the `eager` backend: no code generated), from a clean slate."""
    torch._dynamo.reset()
    monkeypatch.setattr(torch, "compile", functools.partial(torch.compile, backend="eager"))
    with torch._dynamo.config.patch(recompile_limit=8):  # the default; restored after
        _six_models()
    torch._dynamo.reset()


def _six_models() -> None:
    code = Engine._call_layer.__code__
    for i in range(6):
        hf = tiny_config("llama", hidden_size=32 + 16 * i, num_hidden_layers=1, num_attention_heads=4,
                         num_key_value_heads=2, intermediate_size=64, vocab_size=64)  # fmt: skip
        m = build_model(ModelConfig.from_hf(hf), seed=i, device="cpu", compute_dtype="float32",
                        adamw=AdamWConfig(), compile=True)  # fmt: skip
        ids = torch.randint(0, 64, (1, 16), generator=torch.Generator().manual_seed(i))
        loss, _ = m.engine.forward_backward([MicroBatch(ids, ids.clone())])
        assert torch.isfinite(loss)
        m.engine.skip_step()
        m.close()
        assert len(_debug_get_cache_entry_list(code)) == 2 * (i + 1), i  # both variants compiled
    assert torch._dynamo.config.recompile_limit >= 12
