"""Vision-language models against transformers on the CPU in fp32: logits, every gradient (the
language model's, the projector's, the tower's), optimizer steps with clipping against
torch.optim.AdamW, the image features at the image tokens, frozen towers, checkpoints out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers
from helpers import fp32_parameters, saved_parameters
from test_parity import _decay_groups, steps_against_plain_loop
from vision_helpers import FEATURES, IMAGE, KEY_BIAS, VLMS, hf_inputs, tiny_vlm, vlm_batch

from megatrain.engine.optim import AdamWConfig
from megatrain.io.weights import save_hf_checkpoint
from megatrain.models.config import ModelConfig
from megatrain.models.family import describe
from megatrain.planning.placement import Choices
from megatrain.runtime import build_model, make_plan


def _megatrain(hf, tmp_path, tower=True, projector=True, **kw):
    hf.save_pretrained(tmp_path / "hf")
    cfg = ModelConfig.from_json(tmp_path / "hf").with_vision(not tower, not projector)
    return build_model(cfg, weights=tmp_path / "hf", device="cpu", **kw)


# The tower's checkpoint keys (LLaVA's, Idefics3's vision_model, Qwen's ViT with Qwen3-VL's
# position grid and DeepStack mergers), and the projector's.
TOWER = ("vision", "visual.patch_embed", "visual.pos_embed", "visual.blocks", "deepstack_merger")
PROJECTOR = ("projector", "connector", "visual.merger", "image_newline")


def _loss_sum(hf, kind, mb):
    logits = hf(**hf_inputs(kind, mb)).logits.float()
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]),
        mb.shifted_labels.reshape(-1),
        ignore_index=-100,
        reduction="sum",
    )


@pytest.mark.parametrize("kind", VLMS)
def test_each_model_says_its_tower_and_language_model(kind):
    cfg = ModelConfig.from_hf(tiny_vlm(kind).config)
    block = "gemma" if kind == "gemma3" else "llama"
    assert describe(cfg) == f"fast block ({block}) with transformers' vision tower"
    assert cfg.name == kind.partition("-")[0]


@pytest.mark.parametrize("kind", VLMS)
def test_logits_and_every_gradient_match_transformers(kind, tmp_path):
    """Two micro-batches, their images' tokens at other places in each row: logits, the loss and
    every gradient (tower, projector, language model) as transformers computes them. LLaVA's tower
    layer after its feature layer and its final norm get none there: here, zero, and frozen."""
    hf = tiny_vlm(kind)
    mt = _megatrain(hf, tmp_path, choices=Choices(loss_chunk_tokens=7, keep_layers=1))
    mbs = [vlm_batch(kind, seed=1), vlm_batch(kind, seed=2, starts=[20, 7])]
    torch.testing.assert_close(
        mt.engine.logits(mbs[0]), hf(**hf_inputs(kind, mbs[0])).logits, rtol=1e-5, atol=1e-5
    )

    n = sum(mb.num_label_tokens for mb in mbs)
    ref_loss = 0.0
    for mb in mbs:
        loss = _loss_sum(hf, kind, mb) / n
        loss.backward()
        ref_loss += loss.item()
    loss, _ = mt.engine.forward_backward(mbs)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)

    grads = mt.engine.named_grads()
    ref = {k: p.grad for k, p in saved_parameters(hf).items()}
    unused = {k for k, g in ref.items() if g is None}
    assert set(grads) == set(ref) - unused, set(grads) ^ (set(ref) - unused)
    assert bool(unused) == kind.startswith("llava"), unused  # its last CLIP layer and final norm
    tower = [k for k in grads if any(w in k for w in TOWER)]
    projector = [k for k in grads if any(w in k for w in PROJECTOR)]
    assert tower and projector
    assert ("image_newline" in grads) == (kind == "llava_next")  # LLaVA-NeXT's, beside its projector
    for k, g in grads.items():
        assert g.abs().sum() > 0, k
        torch.testing.assert_close(g, ref[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def _reference_grads(hf, kind, mbs) -> tuple[float, dict[str, torch.Tensor | None]]:
    """transformers' loss over the micro-batches (summed over their label tokens) and each
    checkpoint key's gradient of it (None: no gradient reached it)."""
    hf.zero_grad(set_to_none=True)
    n = sum(mb.num_label_tokens for mb in mbs)
    total = 0.0
    for mb in mbs:
        loss = _loss_sum(hf, kind, mb) / n
        loss.backward()
        total += loss.item()
    return total, {k: p.grad for k, p in saved_parameters(hf).items()}


def _assert_grads_match(grads, ref) -> None:
    assert set(grads) == {k for k, g in ref.items() if g is not None}, set(grads) ^ set(ref)
    for k, g in grads.items():
        assert g.abs().sum() > 0, k
        torch.testing.assert_close(g, ref[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


@pytest.mark.parametrize("keep", [0, 1], ids=["recomputed", "kept"])
def test_qwen3_vl_deepstack_features_reach_their_layers(keep, monkeypatch, tmp_path):
    """Qwen3-VL's DeepStack features are added at the image tokens to the outputs of its first
    layers (here both of its two: the last one's gradient comes straight from the loss head, its
    graph recomputed or kept): the loss and every gradient, the DeepStack mergers' too, are
    transformers'; and they are not what transformers gives without the features (its
    `_deepstack_process` skipped), whose mergers get no gradient at all."""
    kind = "qwen3_vl"
    hf = tiny_vlm(kind, num_hidden_layers=2)
    mt = _megatrain(hf, tmp_path, choices=Choices(loss_chunk_tokens=7, keep_layers=keep))
    mbs = [vlm_batch(kind, seed=1), vlm_batch(kind, seed=2, starts=[20, 7])]
    loss, _ = mt.engine.forward_backward(mbs)
    grads = mt.engine.named_grads()
    ref_loss, ref = _reference_grads(hf, kind, mbs)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(grads, ref)
    stacks = [k for k in grads if "deepstack_merger_list" in k]
    assert {k.split(".")[3] for k in stacks} == {"0", "1"}, stacks  # both mergers, both layers

    lm = type(hf.model.language_model)
    monkeypatch.setattr(lm, "_deepstack_process", lambda self, h, mask, feats: h)
    bare_loss, bare = _reference_grads(hf, kind, mbs)
    assert abs(bare_loss - ref_loss) > 1e-3 * abs(ref_loss), (bare_loss, ref_loss)
    assert all(bare[k] is None for k in stacks)
    for k in (
        "model.language_model.layers.0.self_attn.q_proj.weight",
        "model.visual.blocks.0.attn.qkv.weight",
    ):
        assert (bare[k] - ref[k]).abs().amax() > 1e-3 * ref[k].abs().amax(), k


@pytest.mark.parametrize("projector", [False, True], ids=["all-frozen", "projector-trained"])
def test_qwen3_vl_gradients_with_a_frozen_tower_match_transformers(projector, tmp_path):
    """freeze_vision_tower: Qwen3-VL's DeepStack features still reach the first layers but train
    nothing (their mergers are the tower's): the loss and every gradient as transformers' with the
    tower's parameters (and the projector's, where it is frozen) frozen."""
    kind = "qwen3_vl"
    hf = tiny_vlm(kind)
    mt = _megatrain(hf, tmp_path, tower=False, projector=projector, choices=Choices(keep_layers=1))
    frozen = TOWER if projector else TOWER + PROJECTOR
    for k, p in saved_parameters(hf).items():
        p.requires_grad_(not any(w in k for w in frozen))
    mbs = [vlm_batch(kind, seed=3), vlm_batch(kind, seed=4, starts=[9, 30])]
    loss, _ = mt.engine.forward_backward(mbs)
    ref_loss, ref = _reference_grads(hf, kind, mbs)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)
    grads = mt.engine.named_grads()
    _assert_grads_match(grads, ref)
    assert any("visual.merger" in k for k in grads) == projector
    assert not any(any(w in k for w in TOWER) for k in grads)


# One kind per gradient mode of the clip, the tower and projector trained.
MODES = [
    ("llava", "stored"),
    ("idefics3", "two_pass"),
    ("qwen2_5_vl", "stored"),
    ("qwen3_vl", "two_pass"),
    ("llava-tied", "immediate"),
    ("llava_next", "two_pass"),
    ("gemma3", "stored"),
]


@pytest.mark.parametrize("kind,mode", MODES)
def test_optimizer_steps_match_transformers_and_adamw(kind, mode, tmp_path):
    """Three steps of two micro-batches, clipping at 0.5 (but in immediate mode), weight decay,
    warmup + cosine: losses, gradient norms and every final weight equal transformers' model
    stepped by torch.optim.AdamW."""
    hf = tiny_vlm(kind)
    hf.save_pretrained(tmp_path / "hf")
    cfg = ModelConfig.from_json(tmp_path / "hf").with_vision(False, False)
    adamw = AdamWConfig(lr=3e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    clip = mode != "immediate"
    choices = Choices(gradient_placement="two_pass" if mode == "two_pass" else "auto", loss_chunk_tokens=9)
    plan, _ = make_plan(cfg, "cpu", torch.float32, clip=clip, choices=choices)
    assert plan.grad_mode == mode
    mt = build_model(cfg, weights=tmp_path / "hf", device="cpu", adamw=adamw, plan=plan)
    trained = [p for n, p in hf.named_parameters() if p.requires_grad]
    unused = _unused(hf, kind)
    groups = _decay_groups(hf, adamw.weight_decay)
    opt = torch.optim.AdamW(groups, lr=adamw.lr, betas=adamw.betas, eps=adamw.eps, fused=True)
    assert trained

    def reference_loss(model, mbs):
        n = sum(mb.num_label_tokens for mb in mbs)
        total = 0.0
        for mb in mbs:
            loss = _loss_sum(model, kind, mb) / n
            loss.backward()
            total += loss.item()
        return total

    def batches(step):
        return [vlm_batch(kind, seed=10 * step + m, starts=[3 + 7 * m, 11]) for m in range(2)]

    start = {k: p.detach().clone() for k, p in saved_parameters(hf).items()}
    final = steps_against_plain_loop(hf, mt, opt, adamw.lr, clip, batches, reference_loss)
    for k, p in saved_parameters(hf).items():
        atol = 2 * 3 * adamw.lr if KEY_BIAS.search(k) else 1e-5
        torch.testing.assert_close(final[k], p.detach(), rtol=1e-4, atol=atol, msg=lambda m, k=k: f"{k}: {m}")
        changed = not torch.equal(final[k], start[k])
        assert changed != (k in unused), k  # every weight that gets a gradient moved


def _unused(hf, kind) -> set[str]:
    """The checkpoint keys no loss reaches in transformers' model (one backward tells)."""
    mb = vlm_batch(kind)
    _loss_sum(hf, kind, mb).backward()
    out = {k for k, p in saved_parameters(hf).items() if p.grad is None}
    hf.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("kind", ["llava", "idefics3", "qwen2_5_vl", "qwen3_vl", "llava_next", "gemma3"])
def test_image_features_are_at_the_image_tokens(kind, tmp_path):
    """The image decides the logits after its tokens, never before them (causal attention), and
    the loss; moving its tokens moves the features with them, as in transformers."""
    hf = tiny_vlm(kind)
    mt = _megatrain(hf, tmp_path)
    mb = vlm_batch(kind, rows=1, starts=[10])
    other = vlm_batch(kind, rows=1, starts=[10], seed=1)
    other.images = vlm_batch(kind, rows=1, seed=7).images  # the same tokens, another image
    a, b = mt.engine.logits(mb), mt.engine.logits(other)
    assert torch.equal(a[:, :10], b[:, :10])
    assert (a[:, 10:] - b[:, 10:]).abs().amax(-1).min() > 1e-4  # every position from the image on
    losses = [mt.engine.eval_loss([x])[0].item() for x in (mb, other)]
    assert losses[0] != losses[1]
    moved = vlm_batch(kind, rows=1, starts=[25])
    moved.images = mb.images
    got = mt.engine.logits(moved)
    torch.testing.assert_close(got, hf(**hf_inputs(kind, moved)).logits, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got[:, 25:], a[:, 25:])


@pytest.mark.parametrize("kind", ["llava", "qwen2_5_vl", "qwen3_vl", "llava_next", "gemma3"])
@pytest.mark.parametrize("projector", [False, True], ids=["all-frozen", "projector-trained"])
def test_a_frozen_tower_is_never_stepped(kind, projector, tmp_path):
    """freeze_vision_tower (the default): three steps leave every tower weight bitwise as loaded,
    with no gradient and no AdamW moments; the projector moves only when it trains, the language
    model always."""
    hf = tiny_vlm(kind)
    mt = _megatrain(hf, tmp_path, tower=False, projector=projector)
    before = fp32_parameters(mt.state)
    for step in range(3):
        mt.engine.forward_backward([vlm_batch(kind, seed=step)])
        graded = set(mt.engine.named_grads())
        norm, coef = mt.engine.clip_grad_norm(1.0)
        mt.engine.step(1e-2, coef)
    after = fp32_parameters(mt.state)
    embed = mt.state.units[0]
    tower_keys = [p.key for p in embed.params if any(w in p.key for w in TOWER)]
    proj_keys = [p.key for p in embed.params if any(w in p.key for w in PROJECTOR)]
    assert tower_keys and proj_keys and ("image_newline" in proj_keys) == (kind == "llava_next")
    frozen = {p.key for p in embed.params if not p.train}
    assert set(tower_keys) <= frozen and bool(set(proj_keys) & frozen) != projector
    for k in tower_keys:
        assert torch.equal(after[k], before[k]), k
    for which in ("exp_avg", "exp_avg_sq"):  # never written: the optimizer skips frozen tensors
        flat = mt.state.flat(embed, which)
        assert all(not flat[p.offset : p.offset + p.numel].any() for p in embed.params if p.key in tower_keys)
    for k in proj_keys:
        assert torch.equal(after[k], before[k]) != projector, k
    lm = _lm_key(after)
    assert not torch.equal(after[lm], before[lm])
    assert not set(tower_keys) & graded and bool(set(proj_keys) & graded) == projector


def _lm_key(params) -> str:
    return next(k for k in params if "layers.0.self_attn.q_proj.weight" in k and "vision" not in k)


@pytest.mark.parametrize("kind", VLMS)
def test_export_loads_in_transformers_with_the_same_logits(kind, tmp_path):
    """One step, then out under transformers' names and class: from_pretrained loads the
    image-text-to-text model, whose logits on images are megatrain's."""
    hf = tiny_vlm(kind)
    mt = _megatrain(hf, tmp_path)
    mb = vlm_batch(kind)
    mt.engine.forward_backward([mb])
    mt.engine.step(1e-2, None)
    save_hf_checkpoint(mt.state, mt.cfg, tmp_path / "out", dtype=torch.float32, progress=False)
    back = transformers.AutoModelForImageTextToText.from_pretrained(
        tmp_path / "out", attn_implementation="sdpa"
    )
    assert type(back) is type(hf)
    with torch.no_grad():
        ref = back.eval()(**hf_inputs(kind, mb)).logits
    torch.testing.assert_close(mt.engine.logits(mb), ref, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(ref, hf(**hf_inputs(kind, mb)).logits)


@pytest.mark.parametrize("kind", ["qwen2_5_vl", "qwen3_vl"])
def test_text_only_micro_batches_train_a_vision_language_model(kind, tmp_path):
    """A micro-batch without images (a text conversation in a multimodal dataset) runs the language
    model alone, as transformers does without pixel values (Qwen3-VL's without DeepStack features),
    in a step beside one with images."""
    from megatrain.data.batch import MicroBatch

    hf = tiny_vlm(kind)
    mt = _megatrain(hf, tmp_path)
    ids = torch.randint(0, IMAGE - 4, (2, 16), generator=torch.Generator().manual_seed(3))
    mb = MicroBatch(ids, ids.clone())
    torch.testing.assert_close(mt.engine.logits(mb), hf(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    mbs = [mb, vlm_batch(kind)]
    loss, _ = mt.engine.forward_backward(mbs)
    ref_loss, ref = _reference_grads(hf, kind, mbs)
    assert loss.item() == pytest.approx(ref_loss, rel=1e-6)
    _assert_grads_match(mt.engine.named_grads(), ref)


def test_the_plan_counts_the_tower_its_activations_and_its_refetch():
    """The tower is part of the embedding unit: its weights and AdamW moments in the host state's
    count, its weights in the fetch windows; its forward on a micro-batch's images is a phase of
    its own, and a trained tower's graph and second fetch weigh on the embedding's backward."""
    from megatrain.planning.footprint import phase_peaks
    from megatrain.planning.placement import Batch, Machine, plan

    hf = tiny_vlm("qwen2_5_vl")
    frozen = ModelConfig.from_hf(hf.config)
    trained = frozen.with_vision(False, False)
    total = sum(p.numel() for p in hf.parameters())
    assert trained.num_params == total > frozen.num_params  # frozen tensors are no parameters
    batch = Batch(micro_batch_tokens=512, micro_batches=2, seq_len=256, compute_bytes=2, clip=True, rows=2)
    machine = Machine(device="cuda", gpu_bytes=2**34, host_bytes=2**36)
    peaks = {}
    for name, cfg in (("frozen", frozen), ("trained", trained)):
        p = plan(cfg, batch, machine, Choices(gpu_state="off"), None)
        assert p.host["fp32 weights + AdamW moments"] >= 12 * total
        peaks[name] = phase_peaks(cfg, batch, p)
    # the tower's graph of 4 x 512 vision tokens through 3 layers of width 32, and its weights again
    grows = peaks["trained"]["embedding"] - peaks["frozen"]["embedding"]
    assert grows >= 3 * 4 * 512 * 2 * (14.4 * 32 + 2.5 * 48), grows
    assert peaks["frozen"]["forward"] >= 4 * 512 * 2 * (9.0 * 32 + 48)


def test_the_plan_bounds_llava_next_tower_tokens_by_its_tiles():
    """LLaVA-NeXT's tower runs on the base image and each tile (every one with its CLS), its image
    tokens unpadded to the image's aspect: the plan's tower tokens per image token bound
    transformers' own counts for images of every shape, and grow with the grids' tiles."""
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    from megatrain.models.vision import tower_shape

    hf = tiny_vlm("llava_next")
    per = tower_shape(ModelConfig.from_hf(hf.config).vision)[0]
    sizes = [(48, 24), (20, 64), (64, 64), (8, 64), (64, 8), (32, 32), (1, 100), (100, 1)]
    ratios = []
    for h, w in sizes:
        crops = image_size_to_num_patches((h, w), hf.config.image_grid_pinpoints, 32)
        pixels = {"pixel_values": torch.randn(1, crops, 3, 32, 32), "image_sizes": torch.tensor([[h, w]])}
        with torch.no_grad():
            tokens = hf.model.get_image_features(**pixels).pooler_output[0].shape[0]
        ratios.append(crops * 17 / tokens)
        assert ratios[-1] <= per, (h, w, crops, tokens)
    assert max(ratios) > 3  # a thin image's rows unpadded away: more than LLaVA's bound of 2
    wider = transformers.LlavaNextConfig(**{**hf.config.to_dict(), "image_grid_pinpoints": [[96, 96]]})
    assert tower_shape(ModelConfig.from_hf(wider).vision)[0] == pytest.approx(per * 10 / 5)


def test_gemma3_images_attend_within_themselves_in_packed_rows(tmp_path):
    """Gemma 3's image tokens attend to their whole image (bidirectionally, the sliding layers'
    window still bounding the way back), the rest causally: a packed row of two documents, each
    with an image, gives each document the logits transformers gives it alone; and these are not
    the causal model's (transformers without token types)."""
    from megatrain.data.batch import MicroBatch

    hf = tiny_vlm("gemma3")
    mt = _megatrain(hf, tmp_path)
    docs = [vlm_batch("gemma3", rows=1, length=20, seed=s, starts=[a]) for s, a in ((1, 5), (2, 9))]
    n = [d.input_ids.shape[1] for d in docs]
    packed = MicroBatch(
        torch.cat([d.input_ids for d in docs], 1),
        torch.cat([d.labels for d in docs], 1),
        position_ids=torch.cat([torch.arange(k) for k in n])[None],
        document_ids=torch.cat([torch.full((k,), i) for i, k in enumerate(n)])[None],
        images={"pixel_values": torch.cat([d.images["pixel_values"] for d in docs])},
    )
    got = mt.engine.logits(packed)
    with torch.no_grad():
        ref = torch.cat([hf(**hf_inputs("gemma3", d)).logits for d in docs], 1)
        causal = hf(input_ids=docs[0].input_ids, **docs[0].images).logits
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert (got[:, 5 : n[0]] - causal[:, 5:]).abs().amax() > 1e-2  # from the image's first token on


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_gemma3_images_through_flex_attention_match_transformers(monkeypatch, tmp_path):
    """The masks CUDA takes (FlexAttention, run here eagerly, its CPU refusal lifted as in
    test_attention.py, which checks the block tables): images across a 128-token block edge give
    transformers' logits and gradients."""
    import torch.nn.attention.flex_attention as fa

    monkeypatch.setattr(fa, "_validate_device", lambda *a: None)
    hf = tiny_vlm("gemma3")
    mt = _megatrain(hf, tmp_path)
    mt.engine.flex_masks = True
    mb = vlm_batch("gemma3", length=300, starts=[126, 254])
    torch.testing.assert_close(
        mt.engine.logits(mb), hf(**hf_inputs("gemma3", mb)).logits, rtol=1e-5, atol=2e-5
    )
    loss = _loss_sum(hf, "gemma3", mb) / mb.num_label_tokens
    loss.backward()
    assert mt.engine.forward_backward([mb])[0].item() == pytest.approx(loss.item(), rel=1e-6)
    ref = {k: p.grad for k, p in saved_parameters(hf).items()}
    for k, g in mt.engine.named_grads().items():
        torch.testing.assert_close(g, ref[k], rtol=1e-4, atol=1e-6, msg=lambda m, k=k: f"{k}: {m}")


def test_the_plan_counts_gemma3_pooled_patches():
    """Gemma 3's tower sees every patch of an image, its projector pools them into
    `mm_tokens_per_image` image tokens: the plan's tower tokens per image token are the
    tower's sequence over the features transformers gives an image."""
    from megatrain.models.vision import tower_shape

    hf = tiny_vlm("gemma3")
    pixels = torch.randn(1, 3, 32, 32)
    with torch.no_grad():
        seq = hf.model.vision_tower(pixel_values=pixels).last_hidden_state.shape[1]
        feats = hf.model.get_image_features(pixel_values=pixels).pooler_output.shape[1]
    assert (seq, feats) == (16, FEATURES["gemma3"])
    assert tower_shape(ModelConfig.from_hf(hf.config).vision)[0] == seq / feats
