"""Tiny random vision-language models (transformers' image-text-to-text classes) for parity tests,
and micro-batches of tokens with image tokens and the images' pixel values beside them."""

from __future__ import annotations

import re

import torch
import transformers

IMAGE = 96  # the image token of every tiny model: the last row of the text vocabulary (97)
TEXT = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=112,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    rms_norm_eps=1e-6,
    initializer_range=0.2,  # large enough that gradients are far from zero
)
# Each family's tiny tower, and the image inputs one image of it takes (`image_inputs`): LLaVA's
# CLIP (32x32 images in 8x8 patches: 16 features, the CLS cropped), Idefics3's SigLIP (the same
# patches, pixel-shuffled 2x2: 4 features), Qwen2.5-VL's windowed ViT (32x32 images in 4x4
# patches merged 2x2: 16 features, windows of 2x2 merged patches and one full-attention block),
# Qwen3-VL's ViT (the same patches; its learned 4x4 position grid interpolated to the image's 8x8,
# DeepStack features of its first and last blocks).
CLIP = dict(
    model_type="clip_vision_model",
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=3,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
    projection_dim=32,
    initializer_range=0.2,
)
SIGLIP = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=2,
    image_size=32,
    patch_size=8,
)
QWEN_VIT = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=16,
    fullatt_block_indexes=[1],
    initializer_range=0.2,
)
QWEN3_VIT = dict(
    depth=3,
    hidden_size=32,
    intermediate_size=48,
    num_heads=2,
    out_hidden_size=64,
    patch_size=4,
    spatial_merge_size=2,
    temporal_patch_size=2,
    num_position_embeddings=16,
    deepstack_visual_indexes=[0, 2],
    initializer_range=0.2,
)
# Qwen3-VL's language model: Qwen3's (q/k norms), its M-RoPE's frequencies interleaved over the
# three axes; its two DeepStack features go to the first two of its three layers.
QWEN3_TEXT = dict(
    head_dim=16,
    rope_parameters=dict(
        rope_type="default", rope_theta=10000.0, mrope_section=[4, 2, 2], mrope_interleaved=True
    ),
)
# A key bias shifts all of a query's scores alike: the softmax ignores it, and its gradient is
# rounding noise (1e-9) that AdamW normalises into steps of up to the learning rate; two sums of
# another order step it elsewhere. Compared to within those steps.
KEY_BIAS = re.compile(r"k_proj\.bias$|attn\.qkv\.bias$")
# LLaVA-NeXT's tiles: 32x32 crops of a grid of up to 2x2 (and the base image, each 16 features),
# unpadded to the image's aspect with a newline after each row of features.
PINPOINTS = [[32, 64], [64, 32], [64, 64]]
# Its images' (height, width) in the tests' micro-batches: both tiled 2x1 or 1x2 (3 crops); the
# first keeps its 8x4 grid (56 tokens with the base image's 16 and 8 newlines), the second is
# unpadded from 4x8 to 2x8 (34).
NEXT_SIZES = [(48, 24), (20, 64)]
# Image tokens per image, or of each image in turn (transformers refuses a count that is not its own).
FEATURES = {
    "llava": 16,
    "idefics3": 4,
    "smolvlm": 4,
    "qwen2_5_vl": 16,
    "qwen3_vl": 16,
    "llava_next": (56, 34),
    "gemma3": 4,
}
VLMS = ["llava", "llava-tied", "idefics3", "smolvlm", "qwen2_5_vl", "qwen3_vl", "llava_next", "gemma3"]
# Gemma 3's language model: sliding layers around a global one, a window shorter than an image
# (3 < its 4 tokens: an image's last token does not see its first there), SigLIP's 16 patches
# average-pooled 2x2 into 4 image tokens.
GEMMA3_TEXT = dict(
    head_dim=16,
    query_pre_attn_scalar=16,
    sliding_window=3,
    final_logit_softcapping=3.0,
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
)


def tiny_vlm_config(kind: str, image_token_id: int = IMAGE, **text):
    """The composite config of a tiny model: `llava`, `llava-tied`, `idefics3`, `qwen2_5_vl`,
    `qwen3_vl`, `llava_next`, `gemma3`."""
    family, _, tied = kind.partition("-")
    t = dict(TEXT, **text)
    if family == "gemma3":
        cfg = transformers.Gemma3Config(
            text_config=dict(model_type="gemma3_text", **t, **GEMMA3_TEXT),
            vision_config=dict(SIGLIP, model_type="siglip_vision_model", vision_use_head=False),
            mm_tokens_per_image=4,
            image_token_index=image_token_id,
            boi_token_index=image_token_id - 1,
            eoi_token_index=image_token_id - 2,
        )
    elif family == "llava_next":
        cfg = transformers.LlavaNextConfig(
            text_config=dict(model_type="llama", **t),
            vision_config=CLIP,
            image_token_id=image_token_id,
            image_grid_pinpoints=PINPOINTS,
        )
    elif family == "llava":
        cfg = transformers.LlavaConfig(
            text_config=dict(model_type="llama", **t),
            vision_config=CLIP,
            image_token_id=image_token_id,
            tie_word_embeddings=bool(tied),
        )
    elif family in ("idefics3", "smolvlm"):  # SmolVLM is Idefics3's model under its own name
        config = transformers.Idefics3Config if family == "idefics3" else transformers.SmolVLMConfig
        cfg = config(
            text_config=dict(model_type="llama", **t),
            vision_config=SIGLIP,
            image_token_id=image_token_id,
            scale_factor=2,
        )
    elif family == "qwen2_5_vl":
        rope = dict(rope_type="default", rope_theta=10000.0, mrope_section=[2, 3, 3])
        cfg = transformers.Qwen2_5_VLConfig(
            text_config=dict(t, rope_parameters=rope, bos_token_id=1, eos_token_id=2),
            vision_config=QWEN_VIT,
            image_token_id=IMAGE,
            video_token_id=IMAGE - 1,
            vision_start_token_id=IMAGE - 2,
        )
    elif family == "qwen3_vl":
        cfg = transformers.Qwen3VLConfig(
            text_config=dict(t, **QWEN3_TEXT, bos_token_id=1, eos_token_id=2),
            vision_config=QWEN3_VIT,
            image_token_id=IMAGE,
            video_token_id=IMAGE - 1,
            vision_start_token_id=IMAGE - 2,
            vision_end_token_id=IMAGE - 3,
        )
    else:
        raise ValueError(kind)
    return cfg


def tiny_vlm(kind: str, seed: int = 0, **text):
    """A tiny random vision-language model in fp32 (SDPA, as megatrain runs its tower), norms and
    biases random too so that their gradients are checked against something nontrivial."""
    torch.manual_seed(seed)
    cfg = tiny_vlm_config(kind, **text)
    model = transformers.AutoModelForImageTextToText.from_config(cfg, attn_implementation="sdpa").float()
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or "ln_" in n or n.endswith("bias"):
                p.normal_(1.0 if "bias" not in n else 0.0, 0.1)
            elif n.endswith("mm_input_projection_weight"):  # Gemma 3's projector, zeros at init
                p.normal_(0.0, 0.2)
    return model.eval()


def image_inputs(kind: str, images: int, gen: torch.Generator) -> dict[str, torch.Tensor]:
    """Random pixel inputs of `images` images, as the family's processor lays them out."""
    family = kind.partition("-")[0]
    if family in ("llava", "gemma3"):
        return {"pixel_values": torch.randn(images, 3, 32, 32, generator=gen)}
    if family == "llava_next":  # [images, crops, ...], padded to the most crops, and each image's size
        sizes = [NEXT_SIZES[i % len(NEXT_SIZES)] for i in range(images)]
        return {
            "pixel_values": torch.randn(images, 3, 3, 32, 32, generator=gen),
            "image_sizes": torch.tensor(sizes),
        }
    if family in ("idefics3", "smolvlm"):  # [batch, images, ...]; a micro-batch's images as one row of them
        return {"pixel_values": torch.randn(1, images, 3, 32, 32, generator=gen)}
    grid = torch.tensor([[1, 8, 8]] * images)
    return {"pixel_values": torch.randn(64 * images, 96, generator=gen), "image_grid_thw": grid}


def vlm_batch(kind: str, rows: int = 2, length: int = 48, seed: int = 1, starts=None):
    """(input_ids, labels, images): `rows` rows of random text with one image each, its image
    tokens starting at `starts[r]` (default: a different place in each row); labels -100 on the
    first three tokens and on the image tokens, as the data pipeline gives them."""
    from megatrain.data.batch import MicroBatch

    g = torch.Generator().manual_seed(seed)
    n = FEATURES[kind.partition("-")[0]]
    if isinstance(n, tuple):  # images of other sizes: rows long enough for the largest
        length = max(length, max(n) + 40)
    n = [n[r % len(n)] if isinstance(n, tuple) else n for r in range(rows)]
    starts = starts or [3 + 5 * r for r in range(rows)]
    ids = torch.randint(0, IMAGE - 4, (rows, length), generator=g)
    for r, a in enumerate(starts):
        ids[r, a : a + n[r]] = IMAGE
    labels = ids.clone()
    labels[:, :3] = -100
    labels[ids == IMAGE] = -100
    return MicroBatch(ids, labels, images=image_inputs(kind, rows, g))


def hf_inputs(kind: str, mb) -> dict:
    """What transformers' model takes for a micro-batch: ids, the images, and for Qwen2.5-VL,
    Qwen3-VL and Gemma 3 the token types their processors return (which switch Qwen's 3D positions and
    Gemma's bidirectional images on)."""
    kw = dict(input_ids=mb.input_ids, **(mb.images or {}))
    if kind.startswith("qwen"):
        kw["mm_token_type_ids"] = (mb.input_ids == IMAGE).int()
    if kind == "gemma3":
        kw["token_type_ids"] = (mb.input_ids == IMAGE).long()
    return kw


# --------------------------------------------------------------------------- model directories
# A ChatML template whose turns take TRL's content parts, the image part written as `{image}`.
PARTS_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
    "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}{image}{% else %}{{ p['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def tiny_processor(kind: str):
    """The family's processor over the tests' tiny BPE tokenizer (helpers.tiny_tokenizer), its
    image tokens added, sized for the tiny towers: LLaVA's CLIP at 32x32 (16 image tokens),
    Idefics3's at 32x32 without splitting (4), LLaVA-NeXT's in 32x32 crops of the tests' grids,
    Gemma 3's at 32x32 (4)."""
    from helpers import tiny_tokenizer

    family = kind.partition("-")[0]
    tok = tiny_tokenizer("chatml")
    if family == "gemma3":  # the template writes <start_of_image>, expanded into 4 soft tokens
        boi, eoi, soft = "<start_of_image>", "<end_of_image>", "<image_soft_token>"
        tok.add_special_tokens({"additional_special_tokens": [boi, eoi, soft]})
        tok._set_model_specific_special_tokens(
            special_tokens=dict(boi_token=boi, eoi_token=eoi, image_token=soft)
        )
        return transformers.Gemma3Processor(
            image_processor=transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32}),
            tokenizer=tok,
            image_seq_length=4,
            chat_template=PARTS_TEMPLATE.replace("{image}", boi),
        )
    if family == "llava_next":  # torchvision-free: the Pillow image processor
        tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
        images = transformers.LlavaNextImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, image_grid_pinpoints=PINPOINTS
        )
        return transformers.LlavaNextProcessor(
            image_processor=images,
            tokenizer=tok,
            patch_size=8,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            image_token="<image>",
            chat_template=PARTS_TEMPLATE.replace("{image}", "<image>"),
        )
    if family == "llava":
        tok.add_special_tokens({"additional_special_tokens": ["<image>"]})
        images = transformers.CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
        return transformers.LlavaProcessor(
            image_processor=images,
            tokenizer=tok,
            patch_size=8,
            vision_feature_select_strategy="default",
            num_additional_image_tokens=1,
            image_token="<image>",
            chat_template=PARTS_TEMPLATE.replace("{image}", "<image>"),
        )
    if family == "idefics3":
        tok.add_special_tokens({"additional_special_tokens": ["<global-img>"]})
        images = transformers.Idefics3ImageProcessor(
            do_image_splitting=False, size={"longest_edge": 32}, max_image_size={"longest_edge": 32}
        )
        return transformers.Idefics3Processor(
            image_processor=images,
            tokenizer=tok,
            image_seq_len=4,
            chat_template=PARTS_TEMPLATE.replace("{image}", "<image>"),
        )
    raise ValueError(
        f"{kind}: no tiny processor (Qwen2-VL's and Qwen3-VL's need torchvision for their video processors)"
    )


def write_vlm_dir(kind: str, path, seed: int = 0):
    """A model directory as the Hub has one: a tiny random model whose vocabulary is its tiny
    processor's tokenizer, and the processor's files (tokenizer, image processor, chat template)."""
    processor = tiny_processor(kind)
    tok = processor.tokenizer
    image = getattr(tok, "image_token_id", None) or processor.image_token_id  # Gemma 3's: its soft token
    model = tiny_vlm(
        kind,
        seed=seed,
        image_token_id=image,
        vocab_size=len(tok),
        pad_token_id=tok.pad_token_id,
    )
    model.save_pretrained(path)
    processor.save_pretrained(path)
    return model, processor


def write_images(folder, n: int = 4, seed: int = 0) -> list[str]:
    """`n` random PNG images of a few sizes in `folder`; their names."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    names = []
    for i in range(n):
        name = f"{i}.png"
        pixels = (rng.random((24 + 4 * i, 40 - 2 * i, 3)) * 255).astype("uint8")
        Image.fromarray(pixels).save(folder / name)
        names.append(name)
    return names


ANSWERS = ["the water and the house", "a man", "two animals", "a boy with a letter"]


def image_chat(i: int, image: str, text_parts: bool = True) -> dict:
    """A TRL vision record: a user turn with an image and a question, an assistant answer."""
    question = [{"type": "image"}, {"type": "text", "text": "what is in the picture?"}]
    answer = ANSWERS[i % len(ANSWERS)]
    return {
        "messages": [
            {"role": "user", "content": question},
            {"role": "assistant", "content": [{"type": "text", "text": answer}] if text_parts else answer},
        ],
        "images": [image],
    }


def write_image_chats(path, n: int = 12, folder: str = "imgs") -> None:
    """A JSONL of `n` image conversations in `path`, their images in `folder` beside it."""
    import json

    names = write_images(path.parent / folder)
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps(image_chat(i, f"{folder}/{names[i % len(names)]}")) + "\n")
