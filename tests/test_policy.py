"""The rollout's policy with streamed decoder layers (rl/policy.py) samples exactly what the
resident transformers model does: same weights, same ops, so greedy and seeded completions are
bitwise equal, whatever number of layers stays on the device."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import transformers
from helpers import tiny_hf_model

from megatrain.host.split import Halves, split, to_bf16
from megatrain.rl.policy import PolicyModel
from megatrain.rl.sampling import RowSampler

LAYERS, NEW = 3, 6


def prompts(vocab: int):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (4, 7), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = mask[3, :5] = 0  # left-padded, as the rollout pads them
    return ids, mask


def sample(model, ids, mask, device, sampled: bool):
    processors = [RowSampler([11, 12, 13, 14], device, 0.9, 20, 0.95)] if sampled else []
    return model.generate(
        ids.to(device), attention_mask=mask.to(device), do_sample=False, logits_processor=processors,
        max_new_tokens=NEW, pad_token_id=0, eos_token_id=None,
    ).cpu()  # fmt: skip


def master_weights(hf, pinned=False):
    """The host state's view of the weights: the fp32 master's halves under transformers' names
    (page-locked, as the engine's transport keeps them, for the copies to be asynchronous)."""
    out = [(n, split(p.detach().float())) for n, p in hf.named_parameters()]
    return [(n, Halves(*(t.pin_memory() for t in h))) for n, h in out] if pinned else out


def whole_model(hf, device, dtype):
    """The whole policy on the device, as transformers builds it in the compute dtype (RoPE's
    frequencies stay fp32), its weights the master's in that dtype: in bf16 the halves' `hi`."""
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=dtype)
    params = dict(hf.named_parameters())
    state = {k: to_bf16(v.detach().float()) if k in params and dtype == torch.bfloat16 else v
             for k, v in hf.state_dict().items()}  # fmt: skip
    model.load_state_dict(state)
    return model.eval()


def check_same(device, dtype, tied=False):
    hf = tiny_hf_model("llama", tied=tied, num_hidden_layers=LAYERS, attn_implementation="sdpa")
    ids, mask = prompts(hf.config.vocab_size)
    resident = whole_model(hf, device, dtype)
    layer = sum(p.numel() for p in hf.model.layers[0].parameters())
    for sampled in (False, True):
        want = sample(resident, ids, mask, device, sampled)
        for r in (0, 1, LAYERS):
            policy = PolicyModel(hf.config, master_weights(hf, device == "cuda"), device, dtype, r)
            with policy as model:
                got = sample(model, ids, mask, device, sampled)
            assert policy.streamed_layers == LAYERS - r
            # A forward (prefill, each step) fetches each streamed layer once, and the last one the
            # first's again, for the next forward: the master's bf16 half in bf16, both halves in fp32.
            size = 2 if dtype == torch.bfloat16 else 4
            assert policy.fetched_bytes == (NEW * (LAYERS - r) + (r < LAYERS)) * layer * size
            assert torch.equal(got, want), (r, sampled, got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_layers_sample_what_the_resident_model_does(dtype):
    check_same("cpu", dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_streamed_and_resident_weights_are_the_masters_by_the_halves_rounding(dtype):
    """A streamed layer's weights, and a resident one's, in bf16 are the master's `hi` bit for
    bit (ties rounded away from zero, not to even: the engine's fetch's numbers), in fp32 the
    master itself, joined from its halves; a unit whose fp32 state is on the device (a tensor
    among the weights) is cast by the same rule."""
    bits = torch.tensor([0x3F808000, 0x3F818000, 0xBF808000, 0x7F7F7FFF, 0x00018000, 0x7F800000]).to(
        torch.int32
    )
    g = torch.Generator().manual_seed(0)
    hf = tiny_hf_model("llama", num_hidden_layers=2)
    shape = hf.model.layers[0].mlp.up_proj.weight.shape
    x = torch.cat([bits.view(torch.float32), torch.randn(shape.numel(), generator=g)])[: shape.numel()].view(
        shape
    )
    want = to_bf16(x) if dtype == torch.bfloat16 else x
    assert dtype == torch.float32 or not torch.equal(want, x.to(torch.bfloat16))  # a tie that rounds apart
    for layer in (0, 1):  # streamed (resident 1: layer 1 streamed), resident
        name = f"model.layers.{layer}.mlp.up_proj.weight"
        for as_tensor in (False, True):
            weights = [(n, (x if as_tensor else split(x)) if n == name else h) for n, h in master_weights(hf)]
            policy = PolicyModel(hf.config, weights, "cpu", dtype, resident=1)
            module = policy.model.model.layers[layer].mlp.up_proj
            if layer == 1:
                policy.stream.before(0)  # layer 1 is the first streamed one: its weights in place
            assert torch.equal(module.weight.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
                               want.view(torch.int16 if dtype == torch.bfloat16 else torch.int32)), (layer, as_tensor)  # fmt: skip
            policy.__exit__(None, None, None)


def test_a_tied_head_and_missing_weights():
    check_same("cpu", torch.float32, tied=True)
    hf = tiny_hf_model("llama", num_hidden_layers=LAYERS)
    for missing in ("lm_head.weight", "model.layers.2.mlp.up_proj.weight"):  # resident, streamed
        with pytest.raises(ValueError, match=missing):
            PolicyModel(
                hf.config, [w for w in master_weights(hf) if w[0] != missing], "cpu", torch.float32, 1
            )


def test_leaving_frees_the_model_at_once():
    """The rollout drops its policy before the update, whose plan does not count it: leaving the
    block and letting the object go must free the model there and then, streamed layers or not (a
    reference cycle through the layers' hooks once held a streamed policy's memory, 16 GiB of a
    7B model's, through the next update, until the garbage collector ran)."""
    hf = tiny_hf_model("llama", num_hidden_layers=LAYERS)
    ids, mask = prompts(hf.config.vocab_size)
    gc.collect()
    gc.disable()
    try:
        for r in (None, 1, 0):
            policy = PolicyModel(hf.config, master_weights(hf), "cpu", torch.float32, resident=r)
            with policy as model:
                sample(model, ids, mask, "cpu", False)
            gone = weakref.ref(model)
            del model, policy
            assert gone() is None, r
    finally:
        gc.enable()


@pytest.mark.gpu
def test_on_cuda_streamed_layers_sample_the_same_in_less_memory():
    """On the GPU, bf16 from the master's halves: the same completions, and a peak while sampling
    below the resident policy's by the streamed layers' bytes less the two bf16 buffers (the
    halves' `hi` lands in them as it is: no staging buffer)."""
    check_same("cuda", torch.bfloat16)
    hf = tiny_hf_model(
        "llama", num_hidden_layers=8, hidden_size=512, intermediate_size=1536, attn_implementation="sdpa"
    )
    ids, mask = prompts(hf.config.vocab_size)
    weights = master_weights(hf, pinned=True)
    peaks = {}
    for r in (None, 2):
        gc.collect()  # the last run's policy gone before the baseline
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with PolicyModel(hf.config, weights, "cuda", torch.bfloat16, r) as model:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            sample(model, ids, mask, "cuda", True)
        peaks[r] = torch.cuda.max_memory_allocated() - base
        del model
    layer = sum(p.numel() for p in hf.model.layers[0].parameters())
    streamed = 6 * layer * 2  # 6 layers' bf16 weights no longer on the device
    kept = layer * 2 * 2  # the two buffers
    saved = peaks[None] - peaks[2]
    assert 0.9 * (streamed - kept) < saved < 1.1 * (streamed - kept), (peaks, layer)
