"""Packed documents and sliding windows (models/attention.py) against transformers on the CPU in
fp32: the dense-mask path the CPU runs and the FlexAttention path CUDA runs, with documents that
cross FlexAttention's 128-token blocks, a window shorter than the row, and grouped K/V heads."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_hf_model
from torch.nn.attention.flex_attention import BlockMask, create_block_mask

from megatrain.data.batch import IGNORE_INDEX, MicroBatch
from megatrain.models.attention import BLOCK, attention_mask, image_groups, mask_bytes, mask_rule
from megatrain.models.config import ModelConfig
from megatrain.planning.placement import Choices
from megatrain.runtime import build_model

# Eager FlexAttention (the CPU's) warns that it is unfused; that is the point of these tests.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

S = 300  # three FlexAttention blocks, the last one cut short
# Logits as in test_parity.py but atol 2e-5, not 1e-5: sums over 300 tokens instead of 20 round
# differently (the masked path before FlexAttention is off by 1.5e-5 on one logit too).
LOGITS_TOL = dict(rtol=1e-5, atol=2e-5)
LAYOUTS = [[130, 90, 80], [1, 127, 129, 43]]  # document lengths of the two rows


@pytest.fixture
def cpu_flex(monkeypatch):
    """FlexAttention refuses to differentiate on the CPU (its fused kernels are CUDA's); its eager
    implementation, the reference the fused kernels are tested against in PyTorch, can. Lift the
    refusal so the engine's FlexAttention path is checked here end to end."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)


def _packed(vocab: int, layouts=LAYOUTS, seed=0) -> MicroBatch:
    """Rows of documents as the Batcher packs them: positions restart, first labels ignored."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (len(layouts), S), generator=g)
    labels, pos, doc = ids.clone(), torch.empty_like(ids), torch.empty_like(ids)
    for r, lengths in enumerate(layouts):
        assert sum(lengths) == S
        a = 0
        for d, n in enumerate(lengths):
            labels[r, a], pos[r, a : a + n], doc[r, a : a + n] = IGNORE_INDEX, torch.arange(n), d
            a += n
    return MicroBatch(ids, labels, position_ids=pos, document_ids=doc)


def _doc_ids(layouts) -> torch.Tensor:
    return torch.stack([torch.cat([torch.full((n,), d) for d, n in enumerate(r)]) for r in layouts])


@pytest.mark.parametrize("window", [None, 100])
@pytest.mark.parametrize(
    "layouts", [LAYOUTS, [[S], [S]], [[128, 172], [256, 44]]], ids=["mixed", "one", "edges"]
)
def test_block_tables_equal_torchs(layouts, window):
    """The tables built from block bounds equal create_block_mask's (which evaluates the rule at
    every one of the S x S positions): the same partial and full blocks, in the same order."""
    doc = _doc_ids(layouts)
    ours = attention_mask(doc, S, window, "cpu", flex=True)
    ref = create_block_mask(mask_rule(doc, window), 2, None, S, S, device="cpu")
    assert isinstance(ours, BlockMask) and ours.BLOCK_SIZE == (BLOCK, BLOCK)
    for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices"):
        n = getattr(ref, name.replace("indices", "num_blocks"))  # compare the used entries only
        a, b = getattr(ours, name), getattr(ref, name)
        if name.endswith("indices"):
            a = torch.where(torch.arange(a.shape[-1]) < n[..., None], a, -1)
            b = torch.where(torch.arange(b.shape[-1]) < n[..., None], b, -1)
        assert torch.equal(a, b), name


def _groups(runs) -> torch.Tensor:
    """Image groups ([2, S], models/attention.py's `image_groups`) of each row's (start, length) runs."""
    mask = torch.zeros(len(runs), S, dtype=torch.bool)
    for r, row in enumerate(runs):
        for a, n in row:
            mask[r, a : a + n] = True
    return image_groups(mask)


IMAGE_RUNS = [[(100, 60), (200, 5), (205, 3)], [(0, 1), (250, 50)]]  # across blocks, adjacent, at the edges


@pytest.mark.parametrize("window", [None, 100, 20])
@pytest.mark.parametrize("docs", [False, True])
def test_block_tables_with_images_equal_torchs(window, docs):
    """Images' tokens attending to their whole image (Gemma 3) widen the tables: the blocks that
    two tokens of one image share become partial, as create_block_mask finds them; the dense
    mask is the same rule."""
    doc = _doc_ids([[100, 200], [250, 50]]) if docs else None
    groups = _groups(IMAGE_RUNS)
    assert groups[0, 199] == -1 and groups[0, 204] == 1 and groups[0, 205] == 1  # one run, one image
    ours = attention_mask(doc, S, window, "cpu", flex=True, groups=groups)
    ref = create_block_mask(mask_rule(doc, window, groups), 2, None, S, S, device="cpu")
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
    dense = attention_mask(doc, S, window, "cpu", flex=False, groups=groups)
    assert dense[0, 0, 100, 159] and not dense[0, 0, 99, 100]  # forward within an image, not into it
    assert bool(dense[0, 0, 159, 100]) == (window is None or window > 59)  # the window bounds the way back


def test_window_alone_needs_no_documents():
    ours = attention_mask(None, S, 100, "cpu", flex=True)
    ref = create_block_mask(mask_rule(None, 100), None, None, S, S, device="cpu")
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert attention_mask(None, S, S, "cpu", flex=True) is None  # a window as long as the row: causal


def test_block_tables_stay_far_below_s_squared():
    """At 32k tokens the tables are (S/128)^2 entries: 4 MiB per row, against 1 GiB for one
    boolean S x S mask."""
    seq = 32768
    doc = (torch.arange(seq) // 4096)[None]  # eight 4k documents
    bm = attention_mask(doc, seq, None, "cpu", flex=True)
    tensors = [t for t in vars(bm).values() if isinstance(t, torch.Tensor)]
    held = sum(t.numel() * t.element_size() for t in tensors)
    assert held <= mask_bytes(1, seq, flex=True) < mask_bytes(1, seq, flex=False) // 200
    # Eight documents of 32 blocks: the rule is evaluated on the diagonal blocks only, the blocks
    # below them in the same document are full, the rest skipped.
    assert int(bm.kv_num_blocks.sum()) == 8 * 32
    assert int(bm.full_kv_num_blocks.sum()) == 8 * (32 * 31 // 2)


def _hf(family: str, **overrides):
    # Two layers: the last one's graph is kept, the first one's recomputed (keep_layers=1).
    return tiny_hf_model(family, num_hidden_layers=2, **overrides)


def _megatrain(hf, tmp_path, flex: bool):
    hf.save_pretrained(tmp_path / "hf")
    mt = build_model(
        ModelConfig.from_json(tmp_path / "hf"),
        weights=tmp_path / "hf",
        device="cpu",
        choices=Choices(loss_chunk_tokens=97, keep_layers=1),
    )
    mt.engine.flex_masks = flex
    return mt


def _hf_logits(hf, mb: MicroBatch) -> torch.Tensor:
    # transformers reads restarting position_ids as packed documents (masking_utils), without a
    # KV cache only
    return hf(input_ids=mb.input_ids, position_ids=mb.position_ids, use_cache=False).logits


CASES = [
    ("llama", {}),  # 4 query heads, 2 K/V heads
    ("mistral", {"sliding_window": 100}),  # a window inside documents and across blocks
    ("qwen3", {"num_key_value_heads": 1}),
]


@pytest.mark.parametrize("flex", [False, True], ids=["dense", "flex"])
@pytest.mark.parametrize("family,overrides", CASES, ids=[c[0] for c in CASES])
def test_packed_rows_match_transformers(family, overrides, flex, cpu_flex, tmp_path):
    """Logits, loss and every gradient of packed rows equal transformers' (documents as
    transformers reads them from position_ids), through either mask."""
    hf = _hf(family, **overrides)
    mt = _megatrain(hf, tmp_path, flex)
    mb = _packed(hf.config.vocab_size)
    torch.testing.assert_close(mt.engine.logits(mb), _hf_logits(hf, mb), **LOGITS_TOL)

    n = mb.num_label_tokens
    logits = _hf_logits(hf, mb).float()
    ref = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), mb.shifted_labels.reshape(-1), reduction="sum"
    )
    (ref / n).backward()
    loss, _ = mt.engine.forward_backward([mb])
    assert loss.item() == pytest.approx(ref.item() / n, rel=1e-6)
    grads = mt.engine.named_grads()
    for k, p in hf.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("flex", [False, True], ids=["dense", "flex"])
def test_sliding_window_rows_match_transformers(flex, cpu_flex, tmp_path):
    """Unpacked rows longer than Mistral's window: logits and gradients equal transformers'."""
    hf = _hf("mistral", sliding_window=70)
    mt = _megatrain(hf, tmp_path, flex)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, hf.config.vocab_size, (2, S), generator=g)
    mb = MicroBatch(ids, ids.clone())
    torch.testing.assert_close(mt.engine.logits(mb), hf(input_ids=ids).logits, **LOGITS_TOL)
    mt.engine.forward_backward([mb])
    logits = hf(input_ids=ids).logits.float()
    loss = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), mb.shifted_labels.reshape(-1), reduction="sum"
    )
    (loss / mb.num_label_tokens).backward()
    grads = mt.engine.named_grads()
    for k, p in hf.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_eval_loss_is_the_same_through_either_mask(cpu_flex, tmp_path):
    hf = _hf("mistral", sliding_window=100)
    mbs = [_packed(hf.config.vocab_size, seed=s) for s in (1, 2)]
    dense = _megatrain(hf, tmp_path / "a", flex=False).engine.eval_loss(mbs)
    flex = _megatrain(hf, tmp_path / "b", flex=True).engine.eval_loss(mbs)
    assert dense[1] == flex[1]
    assert flex[0].item() == pytest.approx(dense[0].item(), rel=1e-6)
