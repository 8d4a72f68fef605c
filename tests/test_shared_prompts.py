"""data/shared.py: the rows of a step that share a prompt, laid out with each prompt once in the
layers: the attention rule of a shared prefix (its block tables against torch's), the layout's
refusals and sizes, and the loss and every gradient of shared rows against transformers' of
separate rows, through the gathered unshared rows and through either mask."""

from __future__ import annotations

import pytest
import torch
from test_attention import _hf, _megatrain, cpu_flex  # noqa: F401  (a fixture)
from torch.nn.attention.flex_attention import create_block_mask

from megatrain.data.batch import IGNORE_INDEX, MicroBatch
from megatrain.data.shared import share_prompts
from megatrain.models.attention import attention_mask, mask_rule, shared_prefix_ids

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def _pair(layouts, S):
    """[B, S, 2] ids of rows of (prefix, completions...) lengths: the prefix document 0, each
    completion a document reading it."""
    doc, reads = torch.full((len(layouts), S), 99), torch.full((len(layouts), S), -1)
    for r, (prefix, *rest) in enumerate(layouts):
        doc[r, :prefix] = 0
        a = prefix
        for j, n in enumerate(rest, 1):
            doc[r, a : a + n], reads[r, a : a + n] = j, 0
            a += n
    return shared_prefix_ids(doc, reads)


@pytest.mark.parametrize("layouts", [[[127, 1, 60, 112], [200, 100]], [[5, 40, 30, 25], [256, 44]]])
def test_block_tables_of_a_shared_prefix_equal_torchs(layouts):
    """The tables from block bounds equal create_block_mask's for the rule with a shared prefix:
    the same partial and full blocks; the dense rule lets a completion read the prefix and
    itself, never another completion."""
    S = 300
    ids = _pair(layouts, S)
    ours = attention_mask(ids, S, None, "cpu", flex=True)
    ref = create_block_mask(mask_rule(ids, None), 2, None, S, S, device="cpu")
    assert torch.equal(ours.to_dense(), ref.to_dense())
    assert torch.equal(ours.full_kv_num_blocks, ref.full_kv_num_blocks)
    dense = attention_mask(ids, S, None, "cpu", flex=False)
    a, b = layouts[0][0], layouts[0][0] + layouts[0][1]  # the first two completions' starts
    assert dense[0, 0, b, 0] and dense[0, 0, b, b] and not dense[0, 0, b, a]


def _rows(vocab, prompts, completions, seed=0):
    """Loss micro-batches of prompt + completion rows, right-padded, labels on the completions;
    `prompts[i]` the prompt length of row group i, `completions[i]` its completions' lengths."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for p, lengths in zip(prompts, completions):
        prompt = torch.randint(0, vocab, (p,), generator=g).tolist()
        rows += [(prompt, torch.randint(0, vocab, (n,), generator=g).tolist()) for n in lengths]
    order = torch.randperm(len(rows), generator=g).tolist()  # a group's rows over micro-batches
    rows = [rows[i] for i in order]
    out = []
    for a in range(0, len(rows), 4):
        part = rows[a : a + 4]
        width = max(len(p) + len(c) for p, c in part)
        ids, labels, real = [], [], []
        for p, c in part:
            pad = width - len(p) - len(c)
            ids.append(p + c + [0] * pad)
            labels.append([IGNORE_INDEX] * len(p) + c + [IGNORE_INDEX] * pad)
            real.append([1] * (len(p) + len(c)) + [0] * pad)
        mask = torch.tensor(real)
        out.append(MicroBatch(torch.tensor(ids), torch.tensor(labels), attention_mask=mask,
                              prompt_lengths=[len(p) for p, _ in part]))  # fmt: skip
    return out


def _separate_rows_loss(hf, mbs) -> float:
    """transformers' cross-entropy over the label tokens of each row alone, backpropagated into
    `hf`'s gradients; its value."""
    n, total = sum(mb.num_label_tokens for mb in mbs), 0
    for mb in mbs:
        logits = hf(input_ids=mb.input_ids, attention_mask=mb.attention_mask, use_cache=False).logits.float()
        total = total + torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), mb.shifted_labels.reshape(-1), reduction="sum"
        )
    (total / n).backward()
    return total.item() / n


def test_the_layout_holds_each_prompt_once_and_refuses_what_it_cannot_share():
    mbs = _rows(50, [40, 25], [[10, 3, 17, 1], [6, 6, 30, 2]])
    shared = share_prompts(mbs)
    assert shared is not None and len(shared.compute) <= len(mbs)
    real = sum(int(mb.attention_mask.sum()) for mb in shared.compute)
    # each prompt's tokens less the last once; each row's completion and the prompt's last token
    assert real == (40 - 1) + (25 - 1) + sum(n + 1 for n in [10, 3, 17, 1, 6, 6, 30, 2])
    assert sum(mb.num_tokens for mb in shared.compute) < sum(mb.num_tokens for mb in mbs)
    every = torch.cat([g[v] for g, v in zip(shared.gather, shared.live)])
    assert len(every.unique()) == len(every) == sum(mb.num_label_tokens for mb in mbs)
    assert share_prompts([MicroBatch(mbs[0].input_ids, mbs[0].labels)]) is None  # no prompt lengths
    on_prompt = mbs[0].labels.clone()
    on_prompt[0, 1] = mbs[0].input_ids[0, 1]  # a loss on a prompt token
    assert (
        share_prompts([MicroBatch(mbs[0].input_ids, on_prompt, prompt_lengths=mbs[0].prompt_lengths)]) is None
    )
    distinct = _rows(50, [3] * 8, [[20]] * 8)  # no prompt shared: nothing gained
    assert share_prompts(distinct) is None


def _tables_only(monkeypatch):
    """The shared layout's attention through its mask (the block tables, or the dense mask),
    as the families whose scores need one take it (Gemma 2's soft cap on CUDA), not its rows."""
    from dataclasses import replace

    import megatrain.engine.engine as engine

    def without_rows(mbs):
        shared = share_prompts(mbs)
        if shared is not None:
            shared.compute = [replace(mb, shared_rows=None) for mb in shared.compute]
        return shared

    monkeypatch.setattr(engine, "share_prompts", without_rows)


PATHS = [("rows", False), ("dense", False), ("flex", True)]  # (attention, FlexAttention's tables)


@pytest.mark.parametrize("path,flex", PATHS, ids=[p for p, _ in PATHS])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2"])
@pytest.mark.usefixtures("cpu_flex")
def test_shared_rows_match_transformers_on_separate_rows(family, path, flex, tmp_path, monkeypatch):
    """Cross-entropy over the completions of rows whose prompts are shared, the shared layout
    in the layers: the loss and every gradient equal transformers' over each row alone, whether
    attention reads the unshared rows again (`SharedRows`) or takes the layout's mask."""
    if path != "rows":
        _tables_only(monkeypatch)
    hf = _hf(family, **({"sliding_window": 4096} if family == "gemma2" else {}))  # the soft cap, no window
    mt = _megatrain(hf, tmp_path, flex)
    mt.engine.objective.shares_prompts = True
    mbs = _rows(hf.config.vocab_size, [40, 25, 9], [[10, 3, 17, 1], [6, 6, 30, 2], [12, 12]])
    assert share_prompts(mbs) is not None
    want = _separate_rows_loss(hf, mbs)
    loss, _ = mt.engine.forward_backward(mbs)
    assert loss.item() == pytest.approx(want, rel=1e-6)
    grads = mt.engine.named_grads()
    for k, p in hf.named_parameters():
        torch.testing.assert_close(grads[k], p.grad, rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_the_plan_of_shared_prompts_keeps_the_update_layer_major_and_the_rows_tokens():
    """The layout is laid out over the step's micro-batches at once: the plan never takes the
    micro-batch-major update, whose loss runs a micro-batch at a time, and its token counts are
    the rows', never less (attention reads the unshared rows again: no mask on the fast path)."""
    from dataclasses import replace

    from test_rollout_plan import shapes

    from megatrain import plan as planning

    model_cfg, cfg = shapes()
    rows, shared = (planning.batch_of(c, model_cfg, 2) for c in (cfg, replace(cfg, share_prompts=True)))
    assert not rows.masked and not rows.coupled
    assert not shared.masked and "share_prompts" in shared.coupled
    generic = planning.batch_of(replace(cfg, share_prompts=True), replace(model_cfg, path="generic"), 2)
    assert generic.masked  # transformers' own layers take the layout's dense mask
    assert (shared.micro_batch_tokens, shared.micro_batches) == (rows.micro_batch_tokens, rows.micro_batches)


@pytest.mark.gpu
def test_on_cuda_shared_rows_match_separate_rows(tmp_path):
    """The CUDA path: each completion's unshared row gathered for SDPA's kernels, fp32, compiled
    layers (the serial schedule, whose gradients are held where a test reads them). The shared step equals the same engine's step over the separate rows to rounding (the loss
    and every gradient), and that one transformers' on the CPU as every fp32 CUDA test does."""
    from megatrain.models.config import ModelConfig
    from megatrain.planning.placement import Choices
    from megatrain.runtime import build_model

    hf = _hf("llama")
    hf.save_pretrained(tmp_path / "hf")
    mt = build_model(ModelConfig.from_json(tmp_path / "hf"), weights=tmp_path / "hf", device="cuda",
                     choices=Choices(loss_chunk_tokens=97, keep_layers=1), overlap=False)  # fmt: skip
    mbs = _rows(hf.config.vocab_size, [140, 25], [[100, 3, 170, 1], [6, 6, 300, 2]])
    want = _separate_rows_loss(hf, mbs)
    rows_loss, _ = mt.engine.forward_backward(mbs)
    rows = {k: g.cpu().clone() for k, g in mt.engine.named_grads().items()}
    mt.engine.objective.shares_prompts = True
    loss, _ = mt.engine.forward_backward(mbs)
    shared = {k: g.cpu() for k, g in mt.engine.named_grads().items()}
    worst = max(((shared[k] - rows[k]).abs().max() / rows[k].abs().max(), k) for k in rows)
    print(
        f"loss: shared {loss.item()!r}, rows {rows_loss.item()!r}, transformers {want!r}; "
        f"largest gradient difference over its tensor's largest entry {worst[0]:.2e} ({worst[1]})"
    )
    assert rows_loss.item() == pytest.approx(want, rel=1e-4)
    assert loss.item() == pytest.approx(rows_loss.item(), rel=1e-5)
    for k, p in hf.named_parameters():
        torch.testing.assert_close(rows[k], p.grad, rtol=1e-3, atol=1e-5, msg=lambda m, k=k: f"rows {k}: {m}")
        torch.testing.assert_close(
            shared[k], rows[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"shared {k}: {m}"
        )
