#!/usr/bin/env python3
"""The vision-language example: a tiny LLaVA and the pictures whose colour it learns to name.

    python examples/vision/make_example.py           # write the model to output/vision-model (--out)
    python examples/vision/make_example.py --data    # (re)write the shipped data.jsonl and images/
    python examples/vision/make_example.py --check   # compare the shipped data with a fresh one

The model (not shipped: 2.5 MB of random weights, made in a second) is transformers'
LlavaForConditionalGeneration: a CLIP tower (2 layers, width 64, 32x32 pictures in 8x8 patches:
16 image tokens), its two-layer projector, and a Llama of the quickstart's shape
(examples/tiny-llama) over the example tokenizer with an `<image>` token added; its processor
renders TRL's content parts with a ChatML template. The data: 36 pictures of a red, green or blue
square, disc or triangle on white, and 72 conversations asking the colour of each. Everything
follows from the seeds below.
"""

from __future__ import annotations

import argparse
import filecmp
import json
import random
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent
TOKENIZER = HERE.parent / "tokenizer"
LLAMA = HERE.parent / "tiny-llama" / "config.json"
MODEL = ROOT / "output" / "vision-model"
DATA_SEED, MODEL_SEED = 97531, 13579
PICTURES, CHATS = 36, 72
SIZE = 32
COLOURS = {"red": (220, 30, 30), "green": (30, 170, 60), "blue": (40, 60, 220)}
SHAPES = ("square", "disc", "triangle")
QUESTIONS = ("What colour is it?", "Which colour do you see?", "What colour is the shape?")
IMAGE = "<image>"
# ChatML with the quickstart's BOS; an image part is written as the image token.
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['content'] is string %}{{ m['content'] }}{% else %}{% for p in m['content'] %}"
    "{% if p['type'] == 'image' %}<image>{% else %}{{ p['text'] }}{% endif %}{% endfor %}{% endif %}"
    "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def picture(colour: tuple[int, int, int], shape: str, rng: random.Random):
    """A SIZE x SIZE picture: one shape of `colour` somewhere on white."""
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    draw = ImageDraw.Draw(img)
    r = rng.randint(7, 12)
    x, y = rng.randint(r, SIZE - 1 - r), rng.randint(r, SIZE - 1 - r)
    if shape == "square":
        draw.rectangle((x - r, y - r, x + r, y + r), fill=colour)
    elif shape == "disc":
        draw.ellipse((x - r, y - r, x + r, y + r), fill=colour)
    else:
        draw.polygon([(x, y - r), (x - r, y + r), (x + r, y + r)], fill=colour)
    return img


def write_data(folder: Path) -> None:
    """data.jsonl and images/ in `folder`: each conversation asks about one picture."""
    rng = random.Random(DATA_SEED)
    (folder / "images").mkdir(parents=True, exist_ok=True)
    kinds = []
    for i in range(PICTURES):
        colour, shape = list(COLOURS)[i % 3], SHAPES[(i // 3) % 3]
        picture(COLOURS[colour], shape, rng).save(folder / "images" / f"{i:02d}.png", optimize=True)
        kinds.append((colour, shape))
    with open(folder / "data.jsonl", "w") as f:
        for _ in range(CHATS):
            i = rng.randrange(PICTURES)
            colour = kinds[i][0]
            user = [{"type": "image"}, {"type": "text", "text": rng.choice(QUESTIONS)}]
            answer = [{"type": "text", "text": f"It is {colour}."}]
            record = {
                "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
                "images": [f"images/{i:02d}.png"],
            }
            f.write(json.dumps(record) + "\n")


def write_model(out: Path) -> None:
    """The tiny LLaVA with random weights of MODEL_SEED and its processor, into `out`."""
    import torch
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(TOKENIZER)
    tok.add_special_tokens({"additional_special_tokens": [IMAGE]})
    images = transformers.CLIPImageProcessor(
        size={"shortest_edge": SIZE}, crop_size={"height": SIZE, "width": SIZE}
    )
    processor = transformers.LlavaProcessor(
        image_processor=images,
        tokenizer=tok,
        patch_size=8,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
        image_token=IMAGE,
        chat_template=TEMPLATE,
    )
    text = json.loads(LLAMA.read_text())
    text.update(vocab_size=len(tok))
    config = transformers.LlavaConfig(
        text_config=text,
        vision_config=dict(
            model_type="clip_vision_model",
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=SIZE,
            patch_size=8,
            projection_dim=64,
        ),
        image_token_id=tok.convert_tokens_to_ids(IMAGE),
        vision_feature_layer=-1,
        tie_word_embeddings=text.get("tie_word_embeddings", False),
    )
    torch.manual_seed(MODEL_SEED)
    model = transformers.LlavaForConditionalGeneration(config)
    model.save_pretrained(out)
    processor.save_pretrained(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--data", action="store_true", help="rewrite the shipped data instead")
    ap.add_argument("--check", action="store_true", help="compare the shipped data with a fresh one")
    ap.add_argument(
        "--out", type=Path, default=MODEL, help=f"where the model goes ({MODEL.relative_to(ROOT)})"
    )
    args = ap.parse_args()
    if args.check:
        with tempfile.TemporaryDirectory() as tmp:
            write_data(Path(tmp))
            names = ["data.jsonl", *(f"images/{p.name}" for p in sorted((Path(tmp) / "images").iterdir()))]
            _, bad, missing = filecmp.cmpfiles(HERE, tmp, names, shallow=False)
            if bad or missing:
                print(f"differs from the generator: {bad + missing}", file=sys.stderr)
                return 1
        print("the shipped data is the generator's")
        return 0
    if args.data:
        write_data(HERE)
        print(f"wrote {HERE / 'data.jsonl'} and {HERE / 'images'}")
        return 0
    write_model(args.out)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
