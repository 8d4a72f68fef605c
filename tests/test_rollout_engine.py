"""megatrain/rl/decode.py, the rollout engine: its completions are transformers' `generate`'s
(greedy, and sampled with the same per-completion streams as `RowSampler`), for each family's
transformers model; a row's completion does not depend on the rows beside it (padding, repeated
prompts prefilled once, other prompts); the device uniforms are the host's bit for bit; rows stop
at their end token. On CUDA, the graphed decode gives the eager decode's completions."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from helpers import tiny_hf_model

from megatrain.rl.decode import Decoder, KVCache, supports
from megatrain.rl.sampling import RowSampler, Warpers, device_uniforms, row_seed, uniforms

MAX_NEW = 10
PROMPTS = [[5, 9, 13, 2, 40], [7, 3], [11, 12, 13, 14, 15, 16, 17], [7, 3]]


def generate(model, prompts, seeds, warpers_kw, eos=None, device="cpu") -> list[list[int]]:
    """`generate` (dynamic cache, left-padded batch) with the rollout's per-row sampler."""
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=MAX_NEW, pad_token_id=0,
                             eos_token_id=eos, logits_processor=[RowSampler(seeds, device, **warpers_kw)])  # fmt: skip
    return out[:, width:].tolist()


def engine(model, prompts, seeds, warpers_kw, stops=(), device="cpu", graphs=False) -> list[list[int]]:
    dec = Decoder(model, device, list(stops), 0, Warpers(**warpers_kw), graphs=graphs)
    return dec.sample(prompts, seeds, MAX_NEW)


def model_of(family: str, **kw):
    return tiny_hf_model(family, seed=0, num_hidden_layers=2, hidden_size=64, intermediate_size=96,
                         vocab_size=97, **kw)  # fmt: skip


SEEDS = [row_seed(0, 1, i) for i in range(len(PROMPTS))]
GREEDY, SAMPLED = dict(top_k=1), dict(temperature=0.9, top_p=0.95)


def test_device_uniforms_are_the_hosts_bit_for_bit():
    seeds = [row_seed(5, i) for i in range(64)] + [0, 1, 2**63 - 1]
    for n in (0, 1, 7, 511, 2**33):
        host = uniforms(np.array(seeds, dtype=np.uint64), n)
        dev = device_uniforms(torch.tensor(seeds), torch.tensor([n]))
        assert dev.dtype == torch.float64 and np.array_equal(dev.numpy(), host)


@pytest.mark.parametrize("settings", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "mistral"])
def test_completions_are_generates(family, settings):
    """Greedy and sampled completions of a left-padded batch (a prompt twice) equal `generate`'s,
    fp32 on the CPU; gemma2 takes the soft-capped scores, mistral a sliding window shorter than
    the rows."""
    kw = {"sliding_window": 4} if family == "mistral" else {}
    model = model_of(family, **kw)
    assert supports(model)
    ours = engine(model, PROMPTS, SEEDS, settings)
    assert ours == generate(model, PROMPTS, SEEDS, settings)
    if settings is SAMPLED:
        assert len({tuple(r) for r in ours[:3]}) == 3  # sampled, not one answer


def test_a_completion_does_not_depend_on_the_rows_beside_it():
    """Each prompt alone gives the completion it gets in the batch (its seed's stream); the repeated
    prompt's two rows differ by their seeds alone."""
    model = model_of("llama")
    batch = engine(model, PROMPTS, SEEDS, SAMPLED)
    for p, s, row in zip(PROMPTS, SEEDS, batch):
        assert engine(model, [p], [s], SAMPLED) == [row]
    assert batch[1] != batch[3]
    assert engine(model, [PROMPTS[1]] * 2, [SEEDS[3]] * 2, SAMPLED) == [batch[3]] * 2


def test_rows_stop_at_their_end_token_and_take_padding_after():
    model = model_of("llama")
    free = engine(model, PROMPTS, SEEDS, SAMPLED)
    stop = free[0][3]  # a token the first row draws at its 4th step
    ours = engine(model, PROMPTS, SEEDS, SAMPLED, stops=[stop])
    assert ours == generate(model, PROMPTS, SEEDS, SAMPLED, eos=[stop])
    for row, base in zip(ours, free):
        end = base.index(stop) if stop in base else None
        expect = base if end is None else base[: end + 1] + [0] * (MAX_NEW - end - 1)
        assert row == expect


def ending_early(model, prompts, seeds, max_new: int) -> list[int]:
    """End tokens that end most of the rows within their first few tokens and leave at least one
    row to its limit (the rows' free completions searched)."""
    free = Decoder(model, "cpu", [], 0, Warpers(**SAMPLED), graphs=False).sample(prompts, seeds, max_new)
    for k in range(len(free) - 1, 0, -1):
        stops = sorted({row[1] for row in free[:k]})
        open_rows = [r for r in free if not set(r) & set(stops)]
        if open_rows:
            return stops
    raise AssertionError("no end tokens leave a row open")


def test_rows_that_end_leave_the_batch_and_the_others_sample_as_before(monkeypatch):
    """Where at most LEAVE_AT of the rows still draw, the ended ones leave the batch: the rows
    left keep their cache, tokens and streams, so every completion and each drawn token's log-prob
    are those of the batch that kept every row, and `generate`'s."""
    from megatrain.rl import decode

    monkeypatch.setattr(decode, "SYNC_EVERY", 2)
    model = model_of("llama")
    prompts = PROMPTS * 2
    seeds = [row_seed(0, 3, i) for i in range(len(prompts))]
    max_new = 24
    stops = ending_early(model, prompts, seeds, max_new)

    def run(leave_at: float):
        monkeypatch.setattr(decode, "LEAVE_AT", leave_at)
        dec = Decoder(model, "cpu", stops, 0, Warpers(**SAMPLED), graphs=False, logps=True)
        return dec.sample(prompts, seeds, max_new), dec.sampled_logps, dec.timing

    kept, kept_logps, kept_t = run(0.0)
    left, left_logps, left_t = run(0.5)
    assert kept_t["widths"] == [(1, 8)] and len(left_t["widths"]) > 1  # rows left the batch
    assert left_t["widths"][-1][1] < 8
    assert left == kept
    ends = [next((i + 1 for i, t in enumerate(r) if t in stops), max_new) for r in kept]
    assert min(ends) <= 3 and max(ends) == max_new  # some ended early, one ran to its limit
    for r, end in enumerate(ends):
        # (fewer rows: the CPU's GEMMs may round the last bits otherwise)
        torch.testing.assert_close(left_logps[r, :end], kept_logps[r, :end], rtol=0, atol=1e-5)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    with torch.no_grad():
        ref = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=max_new, pad_token_id=0,
                             eos_token_id=stops, logits_processor=[RowSampler(seeds, "cpu", **SAMPLED)])  # fmt: skip
    assert left == ref[:, width:].tolist()


def test_the_cache_holds_every_layer_at_the_batch_width_plus_the_new_tokens():
    model = model_of("llama")
    made = []
    orig = KVCache.__init__

    def counted(self, rows, length, device):
        made.append((rows, length))
        orig(self, rows, length, device)

    KVCache.__init__ = counted
    try:
        engine(model, PROMPTS, SEEDS, GREEDY)
    finally:
        KVCache.__init__ = orig
    assert made == [(4, 7 + MAX_NEW)]  # one position beyond the last written (decode.py)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_on_cuda_graphed_decode_is_the_eager_decode(dtype):
    """The CUDA-graphed decode steps (several spans: rows longer than SPAN_BLOCK) replay what the
    eager ones compute: the same completions, bit for bit."""
    from megatrain.rl import decode

    model = model_of("qwen3").to("cuda", dtype)
    prompts = [[3 + i % 90 for i in range(n)] for n in (60, 121, 9, 121)]  # ids < vocab 97
    seeds = [row_seed(2, i) for i in range(4)]
    old = decode.SPAN_BLOCK
    decode.SPAN_BLOCK = 64
    try:
        eager = Decoder(model, "cuda", [], 0, Warpers(temperature=0.8), graphs=False).sample(
            prompts, seeds, 80
        )
        graphed = Decoder(model, "cuda", [], 0, Warpers(temperature=0.8), graphs=True).sample(
            prompts, seeds, 80
        )
    finally:
        decode.SPAN_BLOCK = old
    assert graphed == eager
    assert (
        engine(model, PROMPTS, SEEDS, GREEDY, device="cuda")
        == generate(model, PROMPTS, SEEDS, GREEDY, device="cuda")
        or dtype == torch.bfloat16
    )  # bf16 kernels of other shapes may break a near-tie


@pytest.mark.gpu
def test_on_cuda_the_compiled_decode_samples_what_the_eager_one_does():
    """The decode step compiled (its elementwise work fused, the graphs captured over it) draws the
    same completions as the eager step, fp32 (the fused ops round otherwise only at the last bits)."""
    model = model_of("llama").to("cuda")
    prompts = [[3 + i % 90 for i in range(n)] for n in (30, 7, 50)]
    seeds = [row_seed(4, i) for i in range(3)]
    runs = [
        Decoder(model, "cuda", [], 0, Warpers(temperature=0.9), graphs=True, compile=c).sample(
            prompts, seeds, 40
        )
        for c in (False, True)
    ]
    assert runs[0] == runs[1]


@pytest.mark.gpu
@pytest.mark.parametrize("compile", [False, True], ids=["graphed", "compiled"])
def test_on_cuda_rows_that_leave_the_graphed_batch_sample_what_the_kept_batch_does(monkeypatch, compile):
    """Rows leaving a CUDA-graphed batch: the narrower steps' graphs are captured again over the
    gathered buffers, and every completion is the eager batch's that kept all rows (fp32); a
    compiled step keeps every row (decode.LEAVE_AT), sampling the same."""
    from megatrain.rl import decode

    monkeypatch.setattr(decode, "SYNC_EVERY", 2)
    model = model_of("llama")
    prompts, seeds = PROMPTS * 2, [row_seed(0, 3, i) for i in range(8)]
    stops = ending_early(model, prompts, seeds, 24)
    monkeypatch.setattr(decode, "LEAVE_AT", 0.0)
    kept = Decoder(model.to("cuda"), "cuda", stops, 0, Warpers(**SAMPLED), graphs=False).sample(
        prompts, seeds, 24
    )
    monkeypatch.setattr(decode, "LEAVE_AT", 0.5)
    dec = Decoder(model, "cuda", stops, 0, Warpers(**SAMPLED), graphs=True, compile=compile)
    assert dec.sample(prompts, seeds, 24) == kept
    assert (len(dec.timing["widths"]) > 1) == (not compile)


def test_a_decode_step_that_does_not_compile_is_sampled_eagerly(monkeypatch):
    """rollout_compile: a compile failure warns once and the rollout samples what the eager engine
    does (a failure after part of the step ran leaves nothing the eager step does not redo)."""
    import megatrain.rl.decode as decode

    model = model_of("llama")
    calls = []

    def failing():
        def step(state):
            calls.append(1)
            state._forward(state.tokens, state.positions, state.pad, 1)  # part of a step ran
            raise torch._dynamo.exc.TorchDynamoException("no kernel for this op")

        return step

    monkeypatch.setattr(decode, "compiled_decode", failing)
    expect = engine(model, PROMPTS, SEEDS, SAMPLED)
    dec = Decoder(model, "cpu", [], 0, Warpers(**SAMPLED), graphs=False)
    dec.compile = True  # the CPU never compiles; forced to reach the path
    with pytest.warns(UserWarning, match="did not compile, sampling eagerly"):
        got = dec.sample(PROMPTS, SEEDS, MAX_NEW)
    assert got == expect and calls == [1] and not dec.compile
