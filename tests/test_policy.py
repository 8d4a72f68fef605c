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

from megatrain.models.config import ModelConfig
from megatrain.planning.footprint import rollout_copy_bytes
from megatrain.rl.policy import HostCopy, PolicyModel
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


def fp32_weights(hf, pinned=False):
    """The host state's view of the weights: fp32 tensors under transformers' names (page-locked,
    as the engine's transport keeps them, for the copies to be asynchronous)."""
    out = [(n, p.detach().float().clone()) for n, p in hf.named_parameters()]
    return [(n, w.pin_memory()) for n, w in out] if pinned else out


def model_cfg(hf) -> ModelConfig:
    return ModelConfig.from_hf(hf.config)


def whole_model(hf, device, dtype):
    """The whole policy on the device, as transformers builds it in the compute dtype (RoPE's
    frequencies stay fp32), the weights copied in."""
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(hf.config, dtype=dtype)
    model.load_state_dict(hf.state_dict())
    return model.eval()


def check_same(device, dtype, tied=False):
    hf = tiny_hf_model("llama", tied=tied, num_hidden_layers=LAYERS, attn_implementation="sdpa")
    ids, mask = prompts(hf.config.vocab_size)
    resident = whole_model(hf, device, dtype)
    layer = sum(p.numel() for p in hf.model.layers[0].parameters())
    for sampled in (False, True):
        want = sample(resident, ids, mask, device, sampled)
        for r, copied in ((0, False), (0, True), (1, False), (1, True), (LAYERS, False)):
            # The host copy, where the compute dtype is not fp32: each streamed parameter in it once.
            numel = rollout_copy_bytes(model_cfg(hf), r, dtype.itemsize) // dtype.itemsize
            copy = HostCopy(numel, dtype, device) if copied and numel else None
            weights = fp32_weights(hf, device == "cuda")
            policy = PolicyModel(hf.config, weights, device, dtype, r, copy and copy.tensor)
            with policy as model:
                got = sample(model, ids, mask, device, sampled)
            assert policy.streamed_layers == LAYERS - r
            # A forward (prefill, each step) fetches each streamed layer once, and the last one the
            # first's again, for the next forward: from the copy in the compute dtype where there is
            # one (half the fp32 bytes in bf16), else from the fp32 master.
            size = dtype.itemsize if copy is not None else 4
            assert policy.fetched_bytes == (NEW * (LAYERS - r) + (r < LAYERS)) * layer * size
            assert torch.equal(got, want), (r, copied, sampled, got, want)
            if copy is not None:
                assert policy.stream is None and numel == (LAYERS - r) * layer
                copy.close()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_streamed_layers_sample_what_the_resident_model_does(dtype):
    check_same("cpu", dtype)


def test_the_host_copy_rounds_as_the_device_cast_does():
    """The cast into the host copy (a `copy_` on the CPU's threads) gives bitwise what `.to(bf16)`
    gives, and both round to nearest even, as CUDA's cast does: ties, the largest finite values,
    subnormals, infinities and random values, checked against the rounding done on the bits."""
    g = torch.Generator().manual_seed(0)
    bits = torch.tensor([0x3F808000, 0x3F818000, 0x3F80C000, 0x7F7FFFFF, 0x7F7F7FFF, 0x00018000,
                         0x80008000, 0x7F800000, 0xFF800000, 0x3F7FFFFF]).to(torch.int32)  # fmt: skip
    x = torch.cat([bits.view(torch.float32), torch.randn(1 << 16, generator=g) * 1e3])
    hf = tiny_hf_model("llama", num_hidden_layers=1)
    weights = [(n, x.clone() if n.endswith("up_proj.weight") else w) for n, w in fp32_weights(hf)]
    shape = hf.model.layers[0].mlp.up_proj.weight.shape
    weights = [(n, w[: shape.numel()].view(shape) if n.endswith("up_proj.weight") else w) for n, w in weights]
    x = x[: shape.numel()]
    numel = rollout_copy_bytes(model_cfg(hf), 0, 2) // 2
    copy = HostCopy(numel, torch.bfloat16, "cpu")
    PolicyModel(hf.config, weights, "cpu", torch.bfloat16, 0, copy.tensor)
    names = [n for n, _ in weights if n.startswith("model.layers.0.")]
    at = sum(w.numel() for n, w in weights if n in names[: names.index("model.layers.0.mlp.up_proj.weight")])
    got = copy.tensor[at : at + x.numel()].view(torch.int16).int() & 0xFFFF
    assert torch.equal(got, x.to(torch.bfloat16).view(torch.int16).int() & 0xFFFF)
    u = x.view(torch.int32).long() & 0xFFFFFFFF  # round to nearest even on the bits (finite values)
    rne = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    finite = x.isfinite()
    assert torch.equal(got[finite].long(), rne[finite])
    assert torch.equal(got[~finite].long(), (u[~finite] >> 16))


def test_a_tied_head_and_missing_weights():
    check_same("cpu", torch.float32, tied=True)
    hf = tiny_hf_model("llama", num_hidden_layers=LAYERS)
    for missing in ("lm_head.weight", "model.layers.2.mlp.up_proj.weight"):  # resident, streamed
        with pytest.raises(ValueError, match=missing):
            PolicyModel(hf.config, [w for w in fp32_weights(hf) if w[0] != missing], "cpu", torch.float32, 1)


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
            policy = PolicyModel(hf.config, fp32_weights(hf), "cpu", torch.float32, resident=r)
            with policy as model:
                sample(model, ids, mask, "cpu", False)
            gone = weakref.ref(model)
            del model, policy
            assert gone() is None, r
    finally:
        gc.enable()


@pytest.mark.gpu
def test_on_cuda_streamed_layers_sample_the_same_in_less_memory():
    """On the GPU, bf16 from the fp32 weights: the same completions, and a peak while sampling
    below the resident policy's by the streamed layers' bytes less the two bf16 buffers and, unless
    the layers come from a bf16 host copy, the fp32 staging buffer."""
    check_same("cuda", torch.bfloat16)
    hf = tiny_hf_model(
        "llama", num_hidden_layers=8, hidden_size=512, intermediate_size=1536, attn_implementation="sdpa"
    )
    ids, mask = prompts(hf.config.vocab_size)
    weights = fp32_weights(hf, pinned=True)
    numel = rollout_copy_bytes(model_cfg(hf), 2, 2) // 2
    peaks = {}
    for r, copied in ((None, False), (2, False), (2, True)):
        copy = HostCopy(numel, torch.bfloat16, "cuda") if copied else None
        gc.collect()  # the last run's policy gone before the baseline
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        with PolicyModel(hf.config, weights, "cuda", torch.bfloat16, r, copy and copy.tensor) as model:
            # while sampling: building the resident layers casts each fp32 tensor on the device
            # (a transient of the largest tensor), which is not what streaming saves
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            sample(model, ids, mask, "cuda", True)
        peaks[r, copied] = torch.cuda.max_memory_allocated() - base
        del model
        if copy is not None:
            copy.close()
    layer = sum(p.numel() for p in hf.model.layers[0].parameters())
    streamed = 6 * layer * 2  # 6 layers' bf16 weights no longer on the device
    for copied, kept in ((False, layer * (2 * 2 + 4)), (True, layer * 2 * 2)):  # two buffers (and a stage)
        saved = peaks[None, False] - peaks[2, copied]
        assert 0.9 * (streamed - kept) < saved < 1.1 * (streamed - kept), (copied, peaks, layer)
