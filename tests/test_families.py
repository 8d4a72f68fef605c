"""Decoder families beyond the parity tests' logits and gradients: which path each runs on, what is
refused (and why, in one line), checkpoints in and out with Hugging Face names, random
initialisation, and the memory plan's layer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from helpers import (
    DEEPSEEK_CONFIGS,
    FAMILY_OVERRIDES,
    MOE_CONFIGS,
    fp32_parameters,
    tiny_config,
    tiny_hf_model,
)

from megatrain.data.batch import MicroBatch
from megatrain.errors import ConfigError
from megatrain.io.weights import save_hf_checkpoint
from megatrain.models.config import ModelConfig
from megatrain.models.family import describe
from megatrain.runtime import build_model

FAST = {"llama": "llama", "qwen3": "llama", "gemma2": "gemma", "gemma3_text": "gemma", "phi3": "phi3"}
FAST |= {"olmo2": "olmo2", "cohere": "cohere"} | {f: "moe" for f in MOE_CONFIGS} | {"gpt_oss": "gpt_oss"}
FAST |= {f: "deepseek" for f in DEEPSEEK_CONFIGS}
PATHS = {
    f: f"fast block ({FAST[f]})" if f in FAST else "generic path"
    for f in ["llama", *FAMILY_OVERRIDES, *MOE_CONFIGS, *DEEPSEEK_CONFIGS]
}


@pytest.mark.parametrize("family,path", PATHS.items())
def test_each_family_says_which_path_it_takes(family, path):
    assert describe(ModelConfig.from_hf(tiny_config(family))).startswith(path)


@pytest.mark.parametrize(
    "raw,why",
    [
        ({"model_type": "t5"}, "encoder-decoder"),
        ({"model_type": "clip"}, "composite (multimodal)"),
        ({"model_type": "qwen3_vl_moe"}, "a vision-language model megatrain does not train yet"),
        ({"model_type": "vit"}, "no causal language model"),
        ({"model_type": "gpt2"}, "(wpe, ln_f) are not supported"),  # learned positions
        ({"model_type": "gemma3_text", "use_bidirectional_attention": True}, "not a causal decoder"),
        ({"model_type": "no-such-model"}, "not a model transformers knows"),
        # mixture of experts without a fast block: the generic path does not run them
        ({"model_type": "deepseek_v32"}, "'deepseek_v32' is a mixture-of-experts model without a fast block"),
        (
            {"model_type": "deepseek_v3", "rope_scaling": {"rope_type": "dynamic", "factor": 2.0}},
            "no fast MoE block",
        ),
        ({"model_type": "qwen2_moe", "use_sliding_window": True}, "has no fast MoE block"),
        # fp8 blocks with their scales beside them would load as if they were the weights
        (
            {"model_type": "llama", "quantization_config": {"quant_method": "fp8"}},
            "fp8 checkpoints are not supported",
        ),
    ],
)
def test_what_cannot_train_is_refused_in_one_line(raw, why, tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        ModelConfig.from_json(tmp_path)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(str(tmp_path / "config.json")) and why in msg, msg


@pytest.mark.parametrize("family", ["llama", *FAMILY_OVERRIDES])
def test_export_loads_in_transformers_with_the_same_logits(family, tmp_path):
    """Weights in from a Hugging Face directory, one optimizer step (so the export is not the
    input), out with Hugging Face names: transformers loads the export and computes the logits
    megatrain computes."""
    hf = tiny_hf_model(family, attn_implementation="same")
    hf.save_pretrained(tmp_path / "hf")
    cfg = ModelConfig.from_json(tmp_path / "hf")
    mt = build_model(cfg, weights=tmp_path / "hf", device="cpu")
    ids = torch.randint(0, cfg.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    mt.engine.forward_backward([MicroBatch(ids, ids.clone())])
    mt.engine.step(1e-2, None)
    save_hf_checkpoint(mt.state, cfg, tmp_path / "out", dtype=torch.float32, progress=False)
    back = transformers.AutoModelForCausalLM.from_pretrained(
        tmp_path / "out", attn_implementation=hf.config._attn_implementation
    ).eval()
    assert type(back) is type(hf)
    with torch.no_grad():
        ref = back(input_ids=ids).logits
    torch.testing.assert_close(mt.engine.logits(MicroBatch(ids, ids)), ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ref, hf(input_ids=ids).logits)  # the step changed the model


@pytest.mark.parametrize("family,norm", [("gemma2", 0.0), ("olmo2", 1.0)])
def test_random_init_follows_transformers_rules(family, norm):
    """A model trained from a config gets transformers' initialisation: Gemma's norms are
    zero-centred (weight 0 means scale 1), linear weights N(0, initializer_range)."""
    cfg = ModelConfig.from_hf(tiny_config(family, initializer_range=0.05))
    mt = build_model(cfg, seed=3, device="cpu")
    params = fp32_parameters(mt.state)
    assert torch.equal(params["model.layers.0.post_attention_layernorm.weight"], torch.full((64,), norm))
    q = params["model.layers.1.self_attn.q_proj.weight"]
    assert 0.045 < q.std().item() < 0.055
    again = fp32_parameters(build_model(cfg, seed=3, device="cpu").state)
    assert all(torch.equal(params[k], again[k]) for k in params)  # the seed alone decides
    # the master weights are plain memory, not a node of the initialised modules' autograd graph
    assert not mt.state.master().requires_grad and mt.state.master().grad_fn is None


_INIT_RSS = """
import gc, sys
sys.path.insert(0, sys.argv[1])
from helpers import tiny_config
from megatrain.models.config import ModelConfig
from megatrain.models.family import templates
from megatrain.host.state import HostState, build_units
from megatrain.io.weights import init_random
def resident_bytes():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
shape = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=32000)
cfg = ModelConfig.from_hf(tiny_config("granite", **shape))
templates(cfg)  # transformers' modules imported and the skeleton built before measuring
state = HostState(build_units(cfg), with_optimizer=False)
before = resident_bytes()
init_random(state, cfg, 0)
gc.collect()
print(resident_bytes() - before, state.nbytes)
"""


def test_random_init_by_transformers_rules_holds_nothing_but_the_weights():
    """Initialising a model with transformers' modules (the generic path, here Granite's 55 M
    parameters) grows the resident set by the fp32 weights it writes, as the fast path's does and
    the plan counts: the materialised modules are freed unit by unit, not kept alive (they were,
    by the autograd graph of copying a parameter into the state: a second fp32 model)."""
    tests = Path(__file__).resolve().parent
    env = dict(os.environ, PYTHONPATH=str(tests.parent), OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-c", _INIT_RSS, str(tests)], env=env, capture_output=True, text=True, check=True
    )
    grown, weights = map(int, out.stdout.split())
    assert weights > 200 * 2**20
    assert grown < 1.1 * weights + 32 * 2**20, (grown / 2**20, weights / 2**20)


@pytest.mark.parametrize("family", ["llama", *FAMILY_OVERRIDES])
def test_parameter_count_and_plan_come_from_the_family(family):
    """The parameter count (disk checks, the plan, the log) is the template's, equal to
    transformers' for every family; the plan without a device is made for that layer and says
    which path the model takes."""
    from megatrain.planning.placement import Batch, Machine, plan

    hf = tiny_hf_model(family)
    cfg = ModelConfig.from_hf(hf.config)
    assert cfg.num_params == sum(p.numel() for p in hf.parameters())
    batch = Batch(micro_batch_tokens=64, micro_batches=1, seq_len=32, compute_bytes=4, clip=True, rows=2)
    p = plan(cfg, batch, Machine(device="cpu", gpu_bytes=None, host_bytes=2**34), None)
    # the host holds fp32 weights and two moments, 12 bytes per parameter and padding
    assert p.host_total >= 12 * cfg.num_params


@pytest.mark.parametrize(
    "family", ["llama", "gemma2", "gemma3_text", "phi3", "olmo2", "cohere", "granite", "starcoder2"]
)
def test_packed_documents_match_each_document_alone(family, tmp_path):
    """A row packing two documents gives each one the logits transformers gives it alone:
    attention never crosses documents, positions restart, sliding windows (8 tokens here) count
    within a document."""
    hf = tiny_hf_model(family, attn_implementation="same")
    hf.save_pretrained(tmp_path / "hf")
    cfg = ModelConfig.from_json(tmp_path / "hf")
    mt = build_model(cfg, weights=tmp_path / "hf", device="cpu")
    g = torch.Generator().manual_seed(5)
    docs = [torch.randint(1, cfg.vocab_size, (n,), generator=g) for n in (11, 9)]
    ids = torch.cat(docs)[None]
    pos = torch.cat([torch.arange(len(d)) for d in docs])[None]
    doc = torch.cat([torch.full((len(d),), i) for i, d in enumerate(docs)])[None]
    got = mt.engine.logits(MicroBatch(ids, ids.clone(), position_ids=pos, document_ids=doc))[0]
    with torch.no_grad():
        ref = torch.cat([hf(input_ids=d[None]).logits[0] for d in docs])
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
