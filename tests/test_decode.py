"""The rollout's static KV cache (`rollout_cache: static`, rl/rollout.py): its completions are
transformers' `generate` with the same static cache and the same per-completion sampler, and on
the CPU (fp32) the dynamic cache's too; where it cannot apply, a one-line refusal before anything
is written. On CUDA, `generate` compiles the decoding step with it: the greedy completions follow
the dynamic cache's up to a near-tie of the two top logits."""

from __future__ import annotations

import pytest
import test_grpo
import torch
import transformers
from test_grpo import MAX_NEW, G, model, run

from megatrain.config import TrainConfig
from megatrain.errors import ConfigError
from megatrain.rl.rollout import check_cache
from megatrain.rl.sampling import RowSampler, row_seed

GREEDY, SAMPLED = dict(top_k=1), dict(temperature=0.9, top_p=0.95)


@pytest.fixture
def setup(tmp_path):
    """test_grpo's tiny Llama, its tokenizer and 12 prompts in `tmp_path`."""
    return test_grpo.setup.__wrapped__(tmp_path)


def generate_alone(hf, tok, prompt, seed, device, settings, **kw) -> list[int]:
    """`generate`'s completion of `prompt` alone with the rollout's sampler (`settings`: its
    temperature, top_k, top_p), cut after the first end token."""
    ids = torch.tensor([tok(prompt)["input_ids"]], device=device)
    sampler = RowSampler([seed], device, **settings)
    out = hf.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, logits_processor=[sampler],
                      max_new_tokens=MAX_NEW, eos_token_id=[tok.eos_token_id], pad_token_id=tok.pad_token_id,
                      **kw)  # fmt: skip
    row = out[0, ids.shape[1] :].tolist()
    end = next((i for i, t in enumerate(row) if t == tok.eos_token_id), None)
    return row if end is None else row[: end + 1]


@pytest.mark.parametrize("settings", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_static_cache_completions_are_generate_with_a_static_cache_and_the_dynamic_ones(
    setup, settings, monkeypatch
):
    """With the run's seed, each first-step completion of a static-cache rollout (one batch of
    left-padded prompts, the cache sized at their width + max_completion_length - 1) is `generate`'s
    with a static cache for its prompt alone, from its own stream; and the whole run (completions,
    losses) is the dynamic cache's, on the CPU in fp32."""
    tmp_path, tok = setup
    made = []

    class Counted(transformers.StaticCache):  # the static caches `generate` makes, with their length
        def __init__(self, *args, max_cache_len, **kw):
            made.append(max_cache_len)
            super().__init__(*args, max_cache_len=max_cache_len, **kw)

    monkeypatch.setattr(transformers.generation.utils, "StaticCache", Counted)
    static = run(
        tmp_path, "static", max_steps=1, seed=7, rollout_cache="static", rollout_engine="generate", **settings
    )
    widest = max(len(tok(r["prompt"])["input_ids"]) for r in static[1])
    assert made == [widest + MAX_NEW - 1]  # one generation batch, one cache (the last token is never fed)
    made.clear()
    dynamic = run(tmp_path, "dynamic", max_steps=1, seed=7, **settings)
    assert made == []
    first = [r for r in static[1] if r["step"] == 1]
    hf = model(len(tok)).eval()
    for n, r in enumerate(first):
        seed = row_seed(7, 1, n // G, n % G)
        alone = generate_alone(hf, tok, r["prompt"], seed, "cpu", settings, cache_implementation="static")
        assert r["completion_ids"] == alone
    assert static[1] == dynamic[1]
    assert [r["loss"] for r in static[0] if "loss" in r] == [r["loss"] for r in dynamic[0] if "loss" in r]
    assert len({tuple(r["completion_ids"]) for r in first}) > 1  # not one completion for all


def test_a_bad_rollout_cache_is_one_line():
    with pytest.raises(ConfigError, match=r"^rollout_cache: must be one of dynamic, static \(got 'paged'\)$"):
        TrainConfig(model_config="config.json", rollout_cache="paged")


def test_a_static_cache_beside_streamed_layers_is_refused_before_anything_is_written(setup):
    tmp_path, _ = setup
    with pytest.raises(ConfigError, match=r"^rollout_cache: static needs the whole policy on the GPU"):
        run(tmp_path, rollout_cache="static", rollout_engine="generate", rollout_resident_layers=1)
    assert not (tmp_path / "out").exists()


def test_a_model_without_a_compilable_static_cache_is_refused_by_name():
    dbrx = transformers.DbrxConfig()  # transformers' DbrxForCausalLM: _can_compile_fullgraph False
    with pytest.raises(ConfigError, match=r"^rollout_cache: static is not supported by transformers' dbrx"):
        check_cache("static", dbrx, streamed=False)
    check_cache("dynamic", dbrx, streamed=True)  # the default applies everywhere
    check_cache("static", transformers.LlamaConfig(), streamed=False)


NEAR_TIE = 1e-3  # fp32 logits of the tiny model: compiled kernels reorder sums by far less


@pytest.mark.gpu
def test_on_cuda_the_compiled_static_decode_follows_the_dynamic_one_up_to_a_near_tie(setup):
    """On CUDA in fp32, greedy (top_k 1): `generate` compiles the decoding step with the static
    cache (dynamo makes graphs, the engine's own compile off), and each completion is the dynamic
    cache's, or leaves it only where the dynamic policy's logits of the two tokens are within
    NEAR_TIE (compiled kernels may round the last bits otherwise, which can flip a near-tie; no
    more can be promised honestly)."""
    from torch._dynamo.utils import counters

    tmp_path, tok = setup
    kw = dict(max_steps=1, seed=7, device="cuda", compute_dtype="float32", torch_compile=False, **GREEDY)
    dynamic = run(tmp_path, "dynamic", **kw)[1]
    counters.clear()
    static = run(tmp_path, "static", rollout_cache="static", rollout_engine="generate", **kw)[1]
    assert counters["stats"]["unique_graphs"] > 0
    hf = model(len(tok)).cuda().eval()
    same = 0
    for s, d in zip(static, dynamic, strict=True):
        a, b = s["completion_ids"], d["completion_ids"]
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None)
        if k is None:
            assert a == b
            same += 1
            continue
        ids = torch.tensor([tok(s["prompt"])["input_ids"] + b[:k]], device="cuda")
        with torch.no_grad():
            logits = hf(ids).logits[0, -1].float()
        gap = float(logits[b[k]] - logits[a[k]])
        assert abs(gap) <= NEAR_TIE, f"row {d['prompt']!r} leaves the dynamic decode at token {k}: gap {gap}"
    assert same > 0  # not every row at a near-tie: the comparison means something
