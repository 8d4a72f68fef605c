"""Compiled layers stay compiled however many models a process builds; what compiled code runs
eagerly stays out of its graphs; a process that compiles nothing never imports the compiler
(megatrain/models/compiling.py)."""

from __future__ import annotations

import functools
import subprocess
import sys

import torch
from helpers import tiny_config
from test_checkpoint import subprocess_env
from test_tiling import CFG, _inputs
from torch._dynamo.eval_frame import _debug_get_cache_entry_list
from torch.func import functional_call

from megatrain.data.batch import MicroBatch
from megatrain.engine.engine import Engine
from megatrain.engine.optim import AdamWConfig
from megatrain.models.compiling import compiled
from megatrain.models.config import ModelConfig
from megatrain.models.decoder import DecoderLayer
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


def test_a_compiled_layer_breaks_its_graph_at_the_tiled_mlp_alone():
    """The tiled MLP (`eager`) runs outside the compiled layer's graphs, as
    `torch.compiler.disable` leaves it: one break, at it, the layer's other ops in the graphs."""
    params, x, _, rope = _inputs()
    with torch.device("meta"):
        layer = DecoderLayer(CFG, mlp_tile_tokens=48)
    compiled(lambda: None)  # what every compile of megatrain's does first

    def call(p, x, cos, sin):
        return functional_call(layer, p, (x, (cos, sin), None))

    torch._dynamo.reset()
    e = torch._dynamo.explain(call)(params, x, *rope)
    torch._dynamo.reset()
    assert (e.graph_count, e.graph_break_count) == (2, 1), e
    assert "torch.compiler.disable" in e.break_reasons[0].reason, e.break_reasons[0].reason
    assert e.op_count > 20  # the norms, attention and residual adds are traced


def test_a_process_that_compiles_nothing_never_imports_the_compiler():
    """Importing the trainer loads neither torch's compiler (dynamo, inductor) nor transformers'
    modeling_utils: seconds of CPU that each process of a CPU run would spend for nothing."""
    heavy = ["torch._dynamo", "torch._inductor", "transformers.modeling_utils"]
    code = f"import sys, megatrain.trainer; print([m for m in {heavy!r} if m in sys.modules])"
    done = subprocess.run([sys.executable, "-c", code], env=subprocess_env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", done.stdout
