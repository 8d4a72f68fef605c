"""Vision-language SFT throughput and memory: `megatrain train` with `stage: sft` (the vision tower
and projector frozen, megatrain's default) beside TRL's SFTTrainer (bench/_trl_vision.py: bf16
weights on the GPU, TRL's defaults for vision-language SFT) on the same random-weight shape and
the same image chats, in one call.

    python bench/vision.py --shape llava_1_5_7b --image-size 448 --text-tokens 448 --batch 8 --accum 2 --steps 6
    python bench/vision.py --shape qwen2_5_vl_7b --image-size 448 --text-tokens 448 --batch 8 --accum 2 --steps 6
    python bench/vision.py --smoke --out /tmp/vision-smoke   # the CPU: a tiny LLaVA, both systems
    python bench/vision.py --smoke --shape qwen2_5_vl_7b     # a tiny Qwen2.5-VL (needs torchvision)

Shapes (`SHAPES`, each of a `FAMILIES` entry, which owns its processor, config and image tokens):
`llava_1_5_7b` is LLaVA-1.5-7B's (llava-hf/llava-1.5-7b-hf's config.json: CLIP ViT-L/14 at 336 px,
every image resized to it, 576 image tokens, a Llama-2-7B language model, 7.06 B parameters);
`qwen2_5_vl_7b` is Qwen2.5-VL-7B-Instruct's (Qwen/Qwen2.5-VL-7B-Instruct's config.json: a 32-block
windowed ViT, 14 px patches merged 2x2, a Qwen2-7B language model, 8.29 B parameters), its
images at their own size: the image processor's min and max pixels are both the image's, so a
square `--image-size` image (a multiple of 28) is (side / 28)^2 image tokens, 256 at 448 px.
Both systems read images through the model's processor (megatrain's data/vision.py, TRL's
vision collator); Qwen2.5-VL's processor cannot be built without torchvision in transformers 5
(its video processor), LLaVA's CLIP image processor needs only Pillow and numpy. The first thing
the command does is import what its shape and systems need (`require`), naming what is missing.

Inputs, written once into a temporary folder and read by both systems: the model directory
(config.json and the processor's files: a word-level tokenizer, `t{i}` being token i, so every
text has an exact token count; ChatML turns, the image part the family's (`<image>`, Qwen's
`<|vision_start|><|image_pad|><|vision_end|>`); the family's image processor), `--batch * --accum
* --steps` random-pixel PNG images of `--image-size` square, and a JSONL of TRL's vision format
(`messages` with an image part and an `images` column), one image per sample, each sample exactly
`--text-tokens` text tokens (the chat template's included: six, and Qwen's two around the image)
beside its image tokens. megatrain's tokens per step and TRL's collated sample length are both
checked against that length (a run whose counts differ is an error row).

tokens/s counts every token of a sample (text and image tokens) and images/s its images, over the
steps after the first `--warmup`, each step from the end of the one before (megatrain's
`step_time_s`; TRL's between `on_step_end` callbacks), so both include fetching the step's
batches: TRL's collator decodes and processes the images there. TRL's compute alone
(`on_step_begin` to `on_step_end`) is in the JSON. Peaks: megatrain's from plan.json beside the
plan's; TRL's the allocator's peak and the process's VmHWM. Each row is printed as its run
finishes; writes {stamp}_{tag}.json/.md into --out.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(1, str(HERE.parent))  # the repository
from _megatrain_run import train  # noqa: E402
from _report import write_once  # noqa: E402

WARMUP = 2  # steps left out of the rates (--warmup)
# Each shape's family (`FAMILIES`), language model, tower and tokenizer words (`words` plus the
# tokens `processor` adds, within the vocabulary); `smoke`: the tiny shape `--smoke` runs for it.
SHAPES = {
    # llava-hf/llava-1.5-7b-hf's config.json, LlamaConfig's and CLIPVisionConfig's defaults for the rest
    "llava_1_5_7b": dict(
        family="llava", smoke="tiny",
        text=dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                  num_key_value_heads=32, max_position_embeddings=4096, rms_norm_eps=1e-5, vocab_size=32064),
        vision=dict(hidden_size=1024, intermediate_size=4096, num_hidden_layers=24, num_attention_heads=16,
                    image_size=336, patch_size=14, projection_dim=768),
        words=32000,
    ),
    "tiny": dict(
        family="llava",
        text=dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, vocab_size=320),
        vision=dict(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=2,
                    image_size=32, patch_size=8, projection_dim=32),
        words=256,
    ),
    # Qwen/Qwen2.5-VL-7B-Instruct's config.json (its `rope_scaling` {"type": "mrope", ...} is
    # transformers 5's `rope_parameters`; its vision `in_chans` is `in_channels`), words its BPE's
    # 151643 (<|endoftext|> is 151643); Qwen2_5_VLConfig's defaults for the rest
    "qwen2_5_vl_7b": dict(
        family="qwen2_5_vl", smoke="qwen2_5_vl_tiny",
        text=dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, max_position_embeddings=128000, rms_norm_eps=1e-6, vocab_size=152064,
                  max_window_layers=28, hidden_act="silu",
                  rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[16, 24, 24])),
        vision=dict(depth=32, hidden_size=1280, intermediate_size=3420, num_heads=16, patch_size=14,
                    spatial_merge_size=2, temporal_patch_size=2, window_size=112, in_channels=3,
                    fullatt_block_indexes=[7, 15, 23, 31], out_hidden_size=3584, hidden_act="silu",
                    tokens_per_second=2),
        words=151643,
    ),
    # 8 px patches merged 2x2 (16 px an image token), windows of 2x2 merged patches, one
    # full-attention block of two; the head's 16 rotary dimensions in M-RoPE's 2 + 3 + 3 pairs
    "qwen2_5_vl_tiny": dict(
        family="qwen2_5_vl",
        text=dict(hidden_size=64, intermediate_size=112, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=1024, rms_norm_eps=1e-6, vocab_size=320,
                  rope_parameters=dict(rope_type="default", rope_theta=1e6, mrope_section=[2, 3, 3])),
        vision=dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=8,
                    spatial_merge_size=2, temporal_patch_size=2, window_size=32, in_channels=3,
                    fullatt_block_indexes=[1], out_hidden_size=64, hidden_act="silu"),
        words=256,
    ),
}  # fmt: skip
SMOKE = dict(image_size=48, text_tokens=40, batch=4, accum=1, steps=4)  # and the shape's `smoke`
TURN, END = "<|im_start|>", "<|im_end|>"
TURN_TOKENS = 3  # TURN, the role, END of each of the two turns
# What the systems import (module, why); a family's own beside them (`Family.needs`).
NEEDS = dict(
    common=(("torch", "both systems"), ("transformers", "both systems"), ("numpy", "the images"),
            ("PIL", "the images: Pillow")),
    trl=(("trl", "TRL's SFTTrainer"), ("datasets", "TRL's dataset")),
)  # fmt: skip


def template(part: tuple[str, ...]) -> str:
    """ChatML whose turns take TRL's content parts, an image part written as the tokens `part`."""
    return (
        "{% for m in messages %}"
        + TURN
        + "{{ m['role'] }}\n{% if m['content'] is string %}{{ m['content'] }}"
        "{% else %}{% for p in m['content'] %}{% if p['type'] == 'image' %}" + "".join(part) + "{% else %}"
        "{{ p['text'] }}{% endif %}{% endfor %}{% endif %}" + END + "\n{% endfor %}"
        "{% if add_generation_prompt %}" + TURN + "assistant\n{% endif %}"
    )


def word_processor_tokenizer(shape: dict, specials: list[str]):
    """bench/_trl_dpo.py's word-level tokenizer (`t{i}` is token i) with ChatML's tokens, the
    family's `specials` and the roles added, within the shape's vocabulary."""
    from _trl_dpo import word_tokenizer

    tok = word_tokenizer(shape["words"])
    tok.add_special_tokens({"additional_special_tokens": [TURN, END, *specials]})
    tok.add_tokens(["user", "assistant"])
    if len(tok) > shape["text"]["vocab_size"]:
        raise ValueError(f"{len(tok)} tokens for a vocabulary of {shape['text']['vocab_size']}")
    return tok


# ------------------------------------------------------------------------------ LLaVA
LLAVA_IMAGE = "<image>"


def llava_image_tokens(shape: dict, side: int) -> int:
    """CLIP's patches at the tower's size (every image resized to it), the CLS feature dropped."""
    v = shape["vision"]
    return (v["image_size"] // v["patch_size"]) ** 2


def llava_processor(shape: dict, side: int):
    """LLaVA's processor, CLIP's image processor at the tower's size."""
    from transformers import CLIPImageProcessorPil, LlavaProcessor

    tok = word_processor_tokenizer(shape, [LLAVA_IMAGE])
    size = shape["vision"]["image_size"]
    images = CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size={"height": size, "width": size})
    return LlavaProcessor(image_processor=images, tokenizer=tok, patch_size=shape["vision"]["patch_size"],
                          vision_feature_select_strategy="default", num_additional_image_tokens=1,
                          image_token=LLAVA_IMAGE, chat_template=template(FAMILIES["llava"].part))  # fmt: skip


def llava_config(shape: dict, tok):
    """LlavaConfig of the shape (LLaVA-1.5's projector and feature layer)."""
    from transformers import LlavaConfig

    return LlavaConfig(
        text_config=dict(model_type="llama", pad_token_id=tok.pad_token_id, **shape["text"]),
        vision_config=dict(model_type="clip_vision_model", **shape["vision"]),
        image_token_id=tok.convert_tokens_to_ids(LLAVA_IMAGE),
        projector_hidden_act="gelu",
        vision_feature_layer=-2,
        vision_feature_select_strategy="default",
        tie_word_embeddings=False,
    )


# ------------------------------------------------------------------------------ Qwen2.5-VL
QWEN_START, QWEN_IMAGE, QWEN_END, QWEN_VIDEO = (
    "<|vision_start|>",
    "<|image_pad|>",
    "<|vision_end|>",
    "<|video_pad|>",
)


def qwen_factor(shape: dict) -> int:
    """Pixels of an image token's side: a patch, merged spatial_merge_size times."""
    return shape["vision"]["patch_size"] * shape["vision"]["spatial_merge_size"]


def qwen_image_tokens(shape: dict, side: int) -> int:
    """Merged patches of a square image of `side` (a multiple of the factor) at its own size."""
    return (side // qwen_factor(shape)) ** 2


def qwen_processor(shape: dict, side: int):
    """Qwen2.5-VL's processor: Qwen2-VL's image processor with min and max pixels both the
    image's (a square of `side` keeps its size, and any other image is resized to its area),
    Qwen2-VL's video processor (the processor needs one; it needs torchvision)."""
    from transformers import Qwen2_5_VLProcessor, Qwen2VLImageProcessor, Qwen2VLVideoProcessor

    v = shape["vision"]
    grid = dict(patch_size=v["patch_size"], merge_size=v["spatial_merge_size"],
                temporal_patch_size=v["temporal_patch_size"])  # fmt: skip
    tok = word_processor_tokenizer(shape, [QWEN_START, QWEN_END, QWEN_IMAGE, QWEN_VIDEO])
    images = Qwen2VLImageProcessor(size={"shortest_edge": side * side, "longest_edge": side * side}, **grid)
    return Qwen2_5_VLProcessor(image_processor=images, tokenizer=tok, video_processor=Qwen2VLVideoProcessor(**grid),
                               chat_template=template(FAMILIES["qwen2_5_vl"].part))  # fmt: skip


def qwen_config(shape: dict, tok):
    """Qwen2_5_VLConfig of the shape, its special tokens the tokenizer's."""
    from transformers import Qwen2_5_VLConfig

    ids = tok.convert_tokens_to_ids
    return Qwen2_5_VLConfig(
        text_config=dict(
            pad_token_id=tok.pad_token_id, bos_token_id=None, eos_token_id=ids(END), **shape["text"]
        ),
        vision_config=shape["vision"],
        image_token_id=ids(QWEN_IMAGE),
        video_token_id=ids(QWEN_VIDEO),
        vision_start_token_id=ids(QWEN_START),
        vision_end_token_id=ids(QWEN_END),
        tie_word_embeddings=False,
    )


@dataclass(frozen=True)
class Family:
    part: tuple[str, ...]
    """The tokens the chat template writes for an image (one of them the processor's placeholder)."""
    processor: Callable  # (shape, side) -> the processor
    config: Callable  # (shape, tokenizer) -> the composite config
    image_tokens: Callable  # (shape, side) -> image tokens of a square image
    factor: Callable | None = None  # (shape) -> what a side must be a multiple of
    needs: tuple[tuple[str, str], ...] = ()


FAMILIES = {
    "llava": Family((LLAVA_IMAGE,), llava_processor, llava_config, llava_image_tokens),
    "qwen2_5_vl": Family(
        (QWEN_START, QWEN_IMAGE, QWEN_END),
        qwen_processor,
        qwen_config,
        qwen_image_tokens,
        qwen_factor,
        needs=(("torchvision", "Qwen2.5-VL's video processor, which its processor needs in transformers 5"),),
    ),
}


def family(shape: dict) -> Family:
    return FAMILIES[shape["family"]]


def image_tokens(shape: dict, side: int) -> int:
    return family(shape).image_tokens(shape, side)


def template_tokens(shape: dict) -> int:
    """Text tokens the chat template adds to a sample: its two turns' and the image part's but the placeholder."""
    return 2 * TURN_TOKENS + len(family(shape).part) - 1


def processor(shape: dict, side: int):
    return family(shape).processor(shape, side)


def model_config(shape: dict, proc):
    return family(shape).config(shape, proc.tokenizer)


def require(shape: dict, systems: list[str]) -> None:
    """Import what the shape and the systems need; exit naming each missing module and why."""
    needs = [*NEEDS["common"], *family(shape).needs, *(NEEDS["trl"] if "trl" in systems else ())]
    missing = []
    for module, why in needs:
        try:
            importlib.import_module(module)
        except Exception as e:  # not installed, or built for another torch
            first = (str(e).strip().splitlines() or [""])[0]
            missing.append(f"{module}, for {why}: {type(e).__name__} {first}")
    if not missing and any(m == "torchvision" for m, _ in needs):
        from transformers.utils import is_torchvision_available

        if not is_torchvision_available():
            missing.append(
                "torchvision imports, but transformers does not take it (is_torchvision_available)"
            )
    if missing:
        sys.exit(f"bench/vision.py --shape {shape_name(shape)}: cannot run\n  " + "\n  ".join(missing))


def shape_name(shape: dict) -> str:
    return next(k for k, v in SHAPES.items() if v is shape)


def chat(rng: random.Random, words: int, text_tokens: int, image: str, template: int) -> dict:
    """A TRL vision record of exactly `text_tokens` text tokens, `template` of them the chat
    template's: a user turn of the image and a question, an assistant answer, random words t1..
    (t0 is the tokenizer's EOS and padding)."""
    n = text_tokens - template
    if n < 2:
        raise ValueError(f"--text-tokens {text_tokens}: fewer than the template's {template} + 2")
    said = lambda k: " ".join(f"t{rng.randrange(1, words)}" for _ in range(k))  # noqa: E731
    return {
        "messages": [
            {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": said(n // 2)}]},
            {"role": "assistant", "content": [{"type": "text", "text": said(n - n // 2)}]},
        ],
        "images": [image],
    }


def num_params(config) -> int:
    """Every parameter of the composite model (tower, projector, language model)."""
    import torch
    from transformers import AutoModelForImageTextToText

    with torch.device("meta"):
        return sum(p.numel() for p in AutoModelForImageTextToText.from_config(config).parameters())


def write_inputs(d: Path, shape: dict, args) -> tuple[Path, Path, int]:
    """The model directory (config.json, the processor's files), the images and the JSONL of
    chats; and the model's parameters."""
    import numpy as np
    from PIL import Image

    proc = processor(shape, args.image_size)
    config = model_config(shape, proc)
    config.save_pretrained(d / "model")
    proc.save_pretrained(d / "model")
    (d / "imgs").mkdir()
    rng, pixels = random.Random(0), np.random.default_rng(0)
    with open(d / "data.jsonl", "w") as f:
        for i in range(args.batch * args.accum * args.steps):
            side = args.image_size
            Image.fromarray(pixels.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(
                d / f"imgs/{i}.png"
            )
            f.write(
                json.dumps(
                    chat(rng, shape["words"], args.text_tokens, f"imgs/{i}.png", template_tokens(shape))
                )
                + "\n"
            )
    return d / "model", d / "data.jsonl", num_params(config)


def run_megatrain(d: Path, model: Path, data: Path, args) -> dict:
    out = d / "out"
    settings = dict(
        model_config=str(model), tokenizer_name_or_path=str(model), dataset=str(data), stage="sft",
        output_dir=str(out), max_length=args.seq, per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accum, max_steps=args.steps, learning_rate=1e-5,
        save_strategy="no", save_final_model=False, disable_tqdm=True, logging_steps=1, shuffle=False,
    )  # fmt: skip
    rec, steps, plan, log = train(d, "sft", settings, args.megatrain, settings=settings)
    if rec["rc"] != 0:
        return rec
    rec.update(
        step_s=[r["step_time_s"] for r in steps],
        tokens=[r["tokens"] for r in steps],
        samples=[r["samples"] for r in steps],
        losses=[r["loss"] for r in steps],
        plan_step_s=plan["plan"].get("step_time_s"),
        predicted=plan.get("predicted"),
        measured=plan.get("measured"),
        log_tail=log[-2500:],
    )
    if set(rec["tokens"]) != {args.batch * args.accum * args.seq}:
        rec["error"] = f"tokens per step {rec['tokens']}, not {args.batch * args.accum} samples of {args.seq}"
    return rec


def run_trl(d: Path, model: Path, data: Path, args) -> dict:
    out = d / "trl.json"
    cmd = [sys.executable, str(HERE / "_trl_vision.py"), "--model", str(model), "--data", str(data),
           "--batch", str(args.batch), "--accum", str(args.accum), "--steps", str(args.steps),
           "--out", str(out)]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    rec = {"system": "TRL SFTTrainer", "command": " ".join(cmd[1:]), "rc": proc.returncode,
           "wall_s": time.perf_counter() - t0}  # fmt: skip
    if out.exists():
        rec |= json.loads(out.read_text())
    if proc.returncode != 0 or not rec.get("step_s"):
        rec["error"] = rec.get("error") or (proc.stdout + proc.stderr)[-3000:]
    elif rec.get("seq") != args.seq:
        rec["error"] = f"TRL's samples are {rec.get('seq')} tokens, not {args.seq}"
    return rec


# ---------------------------------------------------------------------------------------- report
def figures(r: dict, args) -> dict:
    """(measured, plan's or None) of a run: tokens/s, images/s, step s, GPU peak, host peak."""
    if r["system"] == "megatrain":
        timed, plan = r["step_s"][args.warmup :], r.get("plan_step_s")
        measured, predicted = r.get("measured") or {}, r.get("predicted") or {}
        gpu = (measured.get("gpu_peak_allocated"), predicted.get("gpu_peak_allocated"))
        host = (measured.get("host_peak_rss"), predicted.get("host_peak_rss"))
    else:  # from one step's end to the next (step_end_to_end_s[k] ends step k + 2)
        timed, plan = r["step_end_to_end_s"][args.warmup - 1 :], None
        gpu, host = (r.get("gpu_peak_bytes"), None), (r.get("host_peak_bytes"), None)
    step = sum(timed) / len(timed)
    per_step = args.batch * args.accum
    return dict(
        tokens_per_s=(per_step * args.seq / step, per_step * args.seq / plan if plan else None),
        images_per_s=(per_step / step, per_step / plan if plan else None),
        step_s=(step, plan),
        gpu=gpu,
        host=host,
    )


HEADER = (
    "| system | tokens/s (plan) | images/s (plan) | step s after warm-up (plan) | GPU peak GiB (plan) "
    "| host peak GiB (plan) |\n|---|---|---|---|---|---|"
)
FORMATS = dict(
    tokens_per_s=lambda v: f"{v:,.0f}",
    images_per_s=lambda v: f"{v:.2f}",
    step_s=lambda v: f"{v:.2f}",
    gpu=lambda b: f"{b / 2**30:.1f}",
    host=lambda b: f"{b / 2**30:.1f}",
)


def row(r: dict, args) -> str:
    if r.get("error"):
        return f"| {r['system']} | failed: see the json | | | | |"
    f = figures(r, args)

    def cell(k: str) -> str:
        measured, plan = f[k]
        return (FORMATS[k](measured) if measured else "-") + (f" ({FORMATS[k](plan)})" if plan else "")

    return f"| {r['system']} | " + " | ".join(cell(k) for k in FORMATS) + " |"


def ratios(runs: list[dict], args) -> list[str]:
    """megatrain / TRL of each figure, where both ran."""
    ok = {r["system"]: figures(r, args) for r in runs if not r.get("error")}
    if "megatrain" not in ok or "TRL SFTTrainer" not in ok:
        return []
    a, b = ok["megatrain"], ok["TRL SFTTrainer"]
    names = dict(tokens_per_s="tokens/s", images_per_s="images/s", step_s="step s", gpu="GPU peak",
                 host="host peak")  # fmt: skip
    parts = [f"{name} **{a[k][0] / b[k][0]:.2f}x**" for k, name in names.items() if a[k][0] and b[k][0]]
    return ["megatrain / TRL SFTTrainer: " + ", ".join(parts)]


def sample_tokens(r: dict) -> int | None:
    """A run's tokens per sample: megatrain's tokens over samples of its first step, TRL's collated length."""
    if r["system"] == "megatrain":
        return r["tokens"][0] // r["samples"][0] if r.get("tokens") else None
    return r.get("seq")


def lengths(runs: list[dict], args) -> list[str]:
    """Each run's tokens per sample beside the inputs' (a run whose count differs is an error row)."""
    image = args.seq - args.text_tokens
    told = ", ".join(f"{r['system']} {sample_tokens(r) or '-'}" for r in runs)
    return [f"tokens per sample: {told} (the inputs' {args.seq}: {image} image + {args.text_tokens} text)"]


def table(runs: list[dict], args) -> str:
    extra = lengths(runs, args) + ratios(runs, args)
    return "\n".join([HEADER, *(row(r, args) for r in runs)] + ([""] + extra if extra else []))


# ---------------------------------------------------------------------------------------- main
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="llava_1_5_7b", help=f"{', '.join(SHAPES)}")
    p.add_argument("--image-size", type=int, default=448, help="each image's side in pixels")
    p.add_argument(
        "--text-tokens", type=int, default=448, help="text tokens of a sample, the template's included"
    )
    p.add_argument(
        "--batch", type=int, default=8, help="samples per micro-batch (per_device_train_batch_size)"
    )
    p.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=WARMUP, help="steps left out of the rates (at least 1)")
    p.add_argument("--systems", default="megatrain,trl")
    p.add_argument(
        "--smoke",
        action="store_true",
        help="the CPU: the shape's tiny one, " + " ".join(f"--{k} {v}" for k, v in SMOKE.items()),
    )
    p.add_argument("--megatrain", nargs="*", default=[], help="extra key=value for megatrain")
    p.add_argument("--out", default="bench/results")
    p.add_argument("--tag", help="default: vision-<shape>")
    a = p.parse_args(argv)
    if a.smoke:
        for k, v in SMOKE.items():
            if getattr(a, k) == p.get_default(k):
                setattr(a, k, v)
    if a.shape not in SHAPES:
        p.error(f"--shape {a.shape}: not one of {', '.join(SHAPES)}")
    if a.smoke:
        a.shape = SHAPES[a.shape].get("smoke", a.shape)
    shape = SHAPES[a.shape]
    factor = family(shape).factor
    if factor and a.image_size % factor(shape):
        p.error(f"--image-size {a.image_size}: {a.shape}'s images are a multiple of {factor(shape)} px")
    if not 1 <= a.warmup < a.steps:
        p.error(f"--warmup {a.warmup}: at least 1 and fewer than --steps {a.steps}")
    a.systems = [x for x in a.systems.split(",") if x]
    a.seq = image_tokens(shape, a.image_size) + a.text_tokens
    a.tag = a.tag or f"vision-{a.shape}" + ("-smoke" if a.smoke else "")
    return a


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    shape = SHAPES[args.shape]
    require(shape, args.systems)
    import torch

    runs = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        d = Path(tmp)
        model, data, params = write_inputs(d, shape, args)
        print(HEADER, flush=True)
        for system in args.systems:
            runs.append((run_megatrain if system == "megatrain" else run_trl)(d, model, data, args))
            print(json.dumps({k: v for k, v in runs[-1].items() if k != "log_tail"})[:1500], file=sys.stderr)
            print(row(runs[-1], args), flush=True)
    print("\n".join(lengths(runs, args) + ratios(runs, args)))
    now = datetime.datetime.now(datetime.timezone.utc)
    meta = {
        "date": now.isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "cpus": os.cpu_count(),
        "command": "python bench/vision.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "shape": args.shape,
        "num_params": params,
        "image_size": args.image_size,
        "image_tokens": image_tokens(shape, args.image_size),
        "text_tokens": args.text_tokens,
        "seq": args.seq,
        "samples_per_step": args.batch * args.accum,
        "tokens_per_step": args.batch * args.accum * args.seq,
        "warmup": args.warmup,
        "trained": "megatrain: the language model (tower and projector frozen, its default); "
        "TRL: every parameter (its default)",
    }
    title = f"{now:%Y-%m-%d_%H%M}_{args.tag}: vision-language SFT, " + " beside ".join(
        r["system"] for r in runs
    )
    write_once(
        args.out, args.tag, title, meta, runs, table(runs, args), key="runs", stamp=f"{now:%Y-%m-%d_%H%M}"
    )


if __name__ == "__main__":
    main()
