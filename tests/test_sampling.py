"""megatrain/rl/sampling.py: each row sampled from its own stream. A row's tokens do not depend on
the rows beside it; the tokens follow the softmax of the logits as transformers' warpers filter
them (temperature, top-k, top-p); the rule inside `generate` gives the same completion to a
prompt sampled alone and in a padded batch."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_hf_model

from megatrain.rl.sampling import RowSampler, fixed_bits, row_seed
from megatrain.rl.sampling import draw as sampling_draw


def draw(sampler: RowSampler, logits: torch.Tensor) -> torch.Tensor:
    out = sampler(torch.zeros(logits.shape[0], 1, dtype=torch.long), logits)
    assert bool((out == 0).sum(-1).eq(1).all())  # one token left per row, for the greedy pick
    return out.argmax(-1)


def test_row_seeds_are_distinct_and_stable():
    seeds = {row_seed(7, step, i, j) for step in range(3) for i in range(20) for j in range(8)}
    assert len(seeds) == 3 * 20 * 8 and max(seeds) < 2**63
    assert row_seed(7, 1, 2, 3) == row_seed(7, 1, 2, 3) != row_seed(7, 1, 3, 2)


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, None, 1.0), (0.7, None, 1.0), (1.0, 3, 1.0), (1.3, None, 0.8)]
)
def test_tokens_follow_the_softmax_of_the_filtered_logits(temperature, top_k, top_p):
    torch.manual_seed(0)
    logits = torch.randn(6) * 1.5
    n = 20000
    sampler = RowSampler([row_seed(1, i) for i in range(n)], "cpu", temperature, top_k, top_p)
    counts = torch.bincount(draw(sampler, logits.expand(n, -1).clone()), minlength=6).double() / n
    # transformers' own sampling path: the same warpers, then softmax
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    s = logits[None].clone()
    for w, on in ((TemperatureLogitsWarper(temperature), temperature != 1), (TopKLogitsWarper(top_k or 1), top_k),
                  (TopPLogitsWarper(top_p), top_p < 1)):  # fmt: skip
        s = w(None, s) if on else s
    probs = torch.softmax(s[0].double(), -1)
    assert torch.allclose(counts, probs, atol=0.012), (counts, probs)
    assert bool((counts[probs == 0] == 0).all())  # nothing outside what the warpers keep


def test_a_rows_tokens_do_not_depend_on_the_rows_beside_it():
    torch.manual_seed(1)
    logits = torch.randn(4, 3, 50)  # 4 rows, 3 decode steps
    seeds = [row_seed(3, i) for i in range(4)]
    together = RowSampler(seeds, "cpu", 0.9, 10, 0.95)
    alone = [RowSampler([s], "cpu", 0.9, 10, 0.95) for s in seeds]
    for t in range(3):
        both = draw(together, logits[:, t].clone())
        for i in range(4):
            assert both[i] == draw(alone[i], logits[i : i + 1, t].clone())[0]


def test_generate_gives_a_prompt_the_same_completion_alone_and_in_a_padded_batch():
    model = tiny_hf_model(
        "llama", seed=0, num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=97
    )
    prompts = [[5, 9, 13, 2, 40], [7, 3], [11, 12, 13, 14, 15, 16, 17]]
    seeds = [row_seed(0, 1, i) for i in range(3)]
    kw = dict(do_sample=False, max_new_tokens=12, pad_token_id=0, eos_token_id=None)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        batch = model.generate(ids, attention_mask=mask, logits_processor=[RowSampler(seeds, "cpu")], **kw)
        for i, p in enumerate(prompts):
            one = model.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                                 logits_processor=[RowSampler([seeds[i]], "cpu")], **kw)  # fmt: skip
            assert batch[i, width:].tolist() == one[0, len(p) :].tolist()
    assert len({tuple(r) for r in batch[:, width:].tolist()}) == 3  # sampled, not one greedy answer


def test_top_k_1_is_transformers_greedy_generate():
    model = tiny_hf_model(
        "llama", seed=1, num_hidden_layers=2, hidden_size=64, intermediate_size=96, vocab_size=97
    )
    ids = torch.tensor([[5, 9, 13, 2, 40], [7, 3, 3, 8, 1]])
    kw = dict(max_new_tokens=10, pad_token_id=0, eos_token_id=None, attention_mask=torch.ones_like(ids))
    with torch.no_grad():
        greedy = model.generate(ids, do_sample=False, **kw)
        ours = model.generate(
            ids, do_sample=False, logits_processor=[RowSampler([1, 2], "cpu", top_k=1)], **kw
        )
    assert torch.equal(ours, greedy)


@pytest.mark.parametrize("vocab", [7, 1000, 1024, 2500, 5003])
def test_the_draw_inverts_the_exact_fixed_point_cumulative_weights(vocab):
    """`draw`'s two-level search lands where one scan over the whole row of fixed-point weights
    does (rows peaked, flat, with entries filtered to -inf, uniforms at both ends), and the
    weights it inverts are the fp32 softmax weights' within vocab x 2^-bits."""
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(64, vocab, generator=g) * torch.tensor([0.1, 1.0, 8.0, 30.0]).repeat(16)[:, None]
    logits[::3, ::2] = -float("inf")  # top-k or top-p's filtered entries
    logits[5] = -float("inf")
    logits[5, vocab // 2] = 0.0  # one entry left
    u = torch.rand(64, generator=g, dtype=torch.float64)
    u[:4] = torch.tensor([2.0**-54, 1 - 2.0**-53, 0.5, 2.0**-30], dtype=torch.float64)

    bits = fixed_bits(vocab)
    weights = torch.exp(logits - logits.amax(-1, keepdim=True))
    fixed = (weights * 2.0**bits).to(torch.int64)
    cdf = fixed.cumsum(-1)
    target = (u * cdf[:, -1].double()).to(torch.int64)
    expect = torch.searchsorted(cdf, target[:, None], right=True)[:, 0]
    got = sampling_draw(logits, u)
    assert torch.equal(got, expect)
    assert bool((logits.gather(1, got[:, None]) > -float("inf")).all())  # never a filtered entry
    assert got[5] == vocab // 2
    probs = fixed.double() / cdf[:, -1:].double()
    exact = weights.double() / weights.double().sum(-1, keepdim=True)
    assert float((probs - exact).abs().max()) <= vocab * 2.0**-bits + 1e-15  # + float64 division
