"""bench/vision.py's inputs on the CPU: megatrain's vision data path and TRL's vision collator read
the file both systems train on as the same samples, token for token and pixel for pixel, each
exactly the image's tokens plus --text-tokens long. Skipped where TRL or datasets are not
installed (the GPU machine gets them as wheels, bench/README.md)."""

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


def test_both_systems_read_the_same_tokens_and_pixels(tmp_path):
    pytest.importorskip("trl")
    pytest.importorskip("datasets")
    import _trl_vision
    from transformers import AutoProcessor
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    args = vision.parse_args(["--smoke"])
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
    assert all(s.input_ids.count(image) == vision.image_tokens(vision.SHAPES[args.shape]) for s in samples)
    pixels = mine.pixels([[(f"{i}", s.images)] for i, s in enumerate(samples)])
    assert torch.equal(pixels["pixel_values"], batch["pixel_values"])
    assert pixels["pixel_values"].std() > 0.1  # the random images, not a blank
