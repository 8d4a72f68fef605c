"""bench/vision.py's inputs on the CPU: megatrain's vision data path and TRL's vision collator read
the file both systems train on as the same samples, token for token and pixel for pixel, each
exactly the image's tokens plus --text-tokens long, for each family's smoke shape. Skipped where
TRL or datasets are not installed (the GPU machine gets them as wheels, bench/README.md), the
Qwen2.5-VL shape where torchvision is not (its processor needs it)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
import vision  # noqa: E402  (bench/ is not a package)

from megatrain.config import TrainConfig  # noqa: E402
from megatrain.data import build_samples  # noqa: E402
from megatrain.data.vision import VisionData, load_processor  # noqa: E402


@pytest.mark.parametrize("shape", ["llava_1_5_7b", "qwen2_5_vl_7b"])
def test_both_systems_read_the_same_tokens_and_pixels(shape, tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    for module, _ in vision.family(vision.SHAPES[shape]).needs:
        pytest.importorskip(module)
    import _trl_vision
    from transformers import AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    args = vision.parse_args(["--smoke", "--shape", shape])
    model, data, _ = vision.write_inputs(tmp_path, vision.SHAPES[args.shape], args)
    processor = load_processor(model)
    cfg = TrainConfig(model_config=str(model), dataset=str(data), max_length=args.seq, output_dir="unused")
    mine = VisionData(processor)
    samples = build_samples(cfg, processor.tokenizer, vision=mine)

    rows = list(_trl_vision.dataset(data))
    collate = DataCollatorForVisionLanguageModeling(AutoProcessor.from_pretrained(model))
    batch = collate(rows)  # one batch of all: padded only if lengths differ
    assert len(samples) == len(rows) == args.batch * args.accum * args.steps
    assert batch["input_ids"].tolist() == [s.input_ids for s in samples]
    assert batch["attention_mask"].all() and batch["input_ids"].shape[1] == args.seq
    image = processor.image_token_id
    tokens = vision.image_tokens(vision.SHAPES[args.shape], args.image_size)
    assert all(s.input_ids.count(image) == tokens for s in samples)
    pixels = mine.pixels([[(f"{i}", s.images)] for i, s in enumerate(samples)])
    assert pixels.keys() == {
        k for k in batch if k not in ("input_ids", "attention_mask", "labels", "mm_token_type_ids")
    }
    assert all(torch.equal(pixels[k], batch[k]) for k in pixels)
    assert pixels["pixel_values"].std() > 0.1  # the random images, not a blank
