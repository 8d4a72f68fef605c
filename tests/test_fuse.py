"""The rollout policy's fused projections (rl/fuse.py): for each family fuse.py names, every layer's
q/k/v and gate/up are one GEMM over one weight built from the master's weights, whose logits are
the unfused policy's within LOGITS_TOL (fp32 on the CPU: the GEMMs give the same bits, an activation
over the gate's strided columns rounds its last bit otherwise) and whose seeded completions are the
unfused policy's and `generate`'s; streamed layers fetch into the fused layout; the policy's device
bytes do not change; and the decode step traces into one graph, as the unfused one does."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_hf_model
from test_policy import master_weights
from test_rollout_engine import PROMPTS, SAMPLED, SEEDS, generate

from megatrain.models.config import ModelConfig
from megatrain.planning.footprint import rollout_bytes
from megatrain.rl import decode
from megatrain.rl.decode import Decoder
from megatrain.rl.fuse import Slice
from megatrain.rl.policy import PolicyModel
from megatrain.rl.sampling import Warpers

LOGITS_TOL = dict(rtol=1e-5, atol=1e-5)  # fp32; the largest difference seen is 5e-6 (Gemma)
DENSE = ["llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "gemma3_text", "olmo2", "cohere", "granite"]
MOE = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe"]  # the attention (and Qwen2-MoE's shared expert)
IDS = torch.tensor([[5, 9, 13, 2, 40, 11, 7], [0, 0, 0, 7, 3, 70, 8]])


def policy(hf, fused=True, resident=None, dtype=torch.float32):
    return PolicyModel(hf.config, master_weights(hf), "cpu", dtype, resident, fused=fused)


def logits(p: PolicyModel) -> torch.Tensor:
    with p as model, torch.no_grad():
        ids = IDS.to(p.device)
        return model(ids, attention_mask=(ids != 0).long()).logits


def fused_modules(model) -> list[str]:
    return [n for n, m in model.named_modules() if type(m).__name__.startswith("Fused")]


@pytest.mark.parametrize("family", DENSE + MOE)
def test_the_fused_policy_gives_the_unfused_logits(family):
    hf = tiny_hf_model(family, attn_implementation="same")
    fused, separate = policy(hf), policy(hf, fused=False)
    layers = hf.config.num_hidden_layers
    attention = [n for n in fused_modules(fused.model) if n.endswith("self_attn")]
    assert len(attention) == layers  # every layer's attention fused
    mlps = [n for n in fused_modules(fused.model) if not n.endswith("self_attn")]
    assert len(mlps) == (layers if family in DENSE else layers if family == "qwen2_moe" else 0), mlps
    assert not fused_modules(separate.model)
    attn = fused.model.model.layers[0].self_attn
    src = dict(hf.named_parameters())
    for name in ("q_proj", "k_proj", "v_proj"):  # the members are views of the fused weight's rows
        member = getattr(attn, name)
        assert isinstance(member, Slice)
        assert member.weight.data_ptr() >= attn.qkv_proj.weight.data_ptr()
        assert torch.equal(member.weight, src[f"model.layers.0.self_attn.{name}.weight"])
        if family == "qwen2":
            assert torch.equal(member.bias, src[f"model.layers.0.self_attn.{name}.bias"])
    got, want = logits(fused), logits(separate)
    torch.testing.assert_close(got, want, **LOGITS_TOL)
    assert not torch.equal(want, torch.zeros_like(want))


def test_biased_mlps_and_untouched_layouts():
    """Biased gate/up projections fuse their biases too; Phi-3 (fused in transformers already) and
    a family fuse.py does not name (StarCoder2: an ungated MLP) stay as transformers builds them."""
    hf = tiny_hf_model("llama", mlp_bias=True, attention_bias=True)
    fused = policy(hf)
    assert fused.model.model.layers[1].mlp.gate_up_proj.bias.shape == (2 * hf.config.intermediate_size,)
    torch.testing.assert_close(logits(fused), logits(policy(hf, fused=False)), **LOGITS_TOL)
    for family in ("phi3", "starcoder2"):
        p = policy(tiny_hf_model(family))
        assert p.fused == {} and not fused_modules(p.model), family


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_seeded_completions_are_the_unfused_policys_and_generates(family):
    hf = tiny_hf_model(family, seed=0, num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                       vocab_size=97, attn_implementation="sdpa")  # fmt: skip
    runs = []
    for fused in (True, False):
        with policy(hf, fused) as model:
            runs.append(
                Decoder(model, "cpu", [], 0, Warpers(**SAMPLED), graphs=False).sample(PROMPTS, SEEDS, 10)
            )
    assert runs[0] == runs[1] == generate(hf, PROMPTS, SEEDS, SAMPLED)
    assert len({tuple(r) for r in runs[0][:3]}) == 3  # sampled, not one answer


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_layers_fetch_into_the_fused_layout(dtype):
    """Streamed from the master's halves (qwen2: q/k/v biases), the fused policy's logits are the
    resident fused policy's bit for bit, each member fetched into its rows of the fused weight;
    the bytes fetched are the unfused layout's."""
    hf = tiny_hf_model("qwen2", num_hidden_layers=3)
    want = logits(policy(hf, dtype=dtype))
    fetched = {}
    for fused in (True, False):
        p = policy(hf, fused, resident=1, dtype=dtype)
        got = logits(p)
        assert p.streamed_layers == 2
        if fused:
            assert torch.equal(got, want)
            shapes = {(q.name, tuple(q.shape)) for q in p.layers[0]}  # the streamed parameters
            c = hf.config
            rows = (
                (c.num_attention_heads + 2 * c.num_key_value_heads) * c.hidden_size // c.num_attention_heads
            )
            assert {("weight", (rows, c.hidden_size)), ("bias", (rows,)),
                    ("weight", (2 * c.intermediate_size, c.hidden_size))} <= shapes  # fmt: skip
        fetched[fused] = p.fetched_bytes
    assert fetched[True] == fetched[False] > 0


def device_bytes(model) -> int:
    """Bytes of the model's distinct parameter storages on the device (a tied head's counted once;
    a streamed layer's are on the meta device between its forwards)."""
    params = [p for p in model.parameters() if not p.is_meta]
    seen = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in params}
    return sum(seen.values())


def test_the_policys_memory_is_the_unfused_and_the_plans():
    """Resident: the fused policy holds the unfused one's bytes, the plan's `policy weights`
    (rollout_bytes); streamed: its buffers are no larger (a fused parameter pads once)."""
    hf = tiny_hf_model("qwen2", num_hidden_layers=3)
    cfg = ModelConfig.from_hf(hf.config)
    planned = rollout_bytes(cfg, 4, 8, 8, 4)["policy weights"]
    sizes = {fused: device_bytes(policy(hf, fused).model) for fused in (True, False)}
    assert sizes[True] == sizes[False] == planned
    streamed = {f: policy(hf, f, resident=1).stream.buffers[0].numel() for f in (True, False)}
    layer = sum(p.numel() for p in hf.model.layers[0].parameters())
    assert layer <= streamed[True] <= streamed[False]
    planned = rollout_bytes(cfg, 4, 8, 8, 4, resident_layers=1)
    assert planned["policy weights"] == device_bytes(policy(hf, resident=1).model)


def test_the_fused_decode_step_traces_into_one_graph_and_is_reused(monkeypatch):
    """torch.compile (dynamo, its eager backend on the CPU) traces the fused decode step without a
    graph break, as the unfused one; a second policy of the same shapes (the next rollout's)
    reuses the compiled step; the completions are the eager step's."""
    from torch._dynamo.utils import counters

    hf = tiny_hf_model("qwen2", num_hidden_layers=2, attn_implementation="sdpa")
    eager = []
    for fused in (True, False):
        with policy(hf, fused) as model:
            eager.append(
                Decoder(model, "cpu", [], 0, Warpers(**SAMPLED), graphs=False).sample(PROMPTS, SEEDS, 6)
            )
    assert eager[0] == eager[1]
    for fused in (True, False):
        torch._dynamo.reset()
        counters.clear()
        step = torch.compile(decode._State._step, dynamic=False, backend="eager")
        monkeypatch.setattr(decode, "compiled_decode", lambda step=step: step)
        for _ in range(2):
            with policy(hf, fused) as model:
                dec = Decoder(model, "cpu", [], 0, Warpers(**SAMPLED), graphs=False)
                dec.compile = True  # the CPU never compiles; forced to reach the path
                assert dec.sample(PROMPTS, SEEDS, 6) == eager[0]
            assert dec.compile  # no compile failure fell back to eager
            assert dict(counters["graph_break"]) == {} and counters["stats"]["unique_graphs"] == 1, fused


CUDA_TOL = dict(rtol=1e-4, atol=1e-4)  # fp32: cuBLAS may take another kernel for the wider GEMM


@pytest.mark.gpu
def test_on_cuda_the_fused_policy_compiles_and_graphs_as_it_runs_eagerly():
    """On CUDA in fp32: the fused policy's logits are the unfused one's within CUDA_TOL, and its
    compiled, graphed decode draws the completions its eager decode does, streamed layers too."""
    hf = tiny_hf_model("qwen2", num_hidden_layers=3, attn_implementation="sdpa")
    got, want = (
        logits(PolicyModel(hf.config, master_weights(hf), "cuda", torch.float32, fused=f))
        for f in (True, False)
    )
    torch.testing.assert_close(got, want, **CUDA_TOL)
    prompts = [[3 + i % 90 for i in range(n)] for n in (30, 7, 50)]
    seeds = SEEDS[:3]
    runs = []
    for graphs, compile, resident in ((False, False, None), (True, True, None), (False, False, 1)):
        with PolicyModel(hf.config, master_weights(hf, True), "cuda", torch.float32, resident) as model:
            dec = Decoder(model, "cuda", [], 0, Warpers(temperature=0.9), graphs=graphs, compile=compile)
            runs.append(dec.sample(prompts, seeds, 40))
    assert runs[0] == runs[1] == runs[2]
