"""Vision-language data (TRL's vision formats): conversations with image parts and an `images`
column, rendered and tokenised by the model's processor; the loss on assistant turns; pixel
inputs made with each micro-batch; bad images named in one line; whole runs that resume exactly
and export a model and processor transformers loads."""

from __future__ import annotations

import json

import pytest
import torch
import transformers
from test_checkpoint import assert_bitwise, metrics, tensors
from vision_helpers import ANSWERS, KEY_BIAS, image_chat, write_image_chats, write_images, write_vlm_dir

from megatrain.config import TrainConfig
from megatrain.data import Batcher, build_samples
from megatrain.data.batch import IGNORE_INDEX
from megatrain.data.vision import TEXT_KEYS, VisionData, decode
from megatrain.errors import DataError
from megatrain.trainer import train

KINDS = ["llava", "idefics3", "llava_next", "gemma3"]


def _cfg(data, **kw) -> TrainConfig:
    base = dict(
        model_config="unused", dataset=str(data), max_length=128, disable_tqdm=True, output_dir="unused"
    )
    return TrainConfig(**(base | kw))


@pytest.fixture(scope="module", params=KINDS)
def model(request, tmp_path_factory):
    """A tiny model directory of the kind, its processor, and an image chat dataset."""
    tmp = tmp_path_factory.mktemp(request.param)
    write_vlm_dir(request.param, tmp / "model")
    write_image_chats(tmp / "data" / "chat.jsonl")
    processor = transformers.AutoProcessor.from_pretrained(tmp / "model")
    return request.param, tmp, processor


@pytest.mark.parametrize("train_on_prompt", [False, True])
def test_tokens_are_the_processors_and_the_loss_is_on_the_answers(model, train_on_prompt):
    """Each sample's ids are what the processor gives for the whole conversation and its images
    (TRL's collation); the labels cover the assistant's answer and end-of-turn token (every token
    with train_on_prompt), never an image token."""
    kind, tmp, processor = model
    data = tmp / "data" / "chat.jsonl"
    samples = build_samples(
        _cfg(data, train_on_prompt=train_on_prompt), processor.tokenizer, vision=VisionData(processor)
    )
    records = [json.loads(line) for line in data.read_text().splitlines()]
    tok = processor.tokenizer
    for s, rec in zip(samples, records):
        images = [decode(str(data.parent / p), "test") for p in rec["images"]]
        text = processor.apply_chat_template(rec["messages"], tokenize=False)
        want = processor(text=[text], images=[images], add_special_tokens=False)["input_ids"][0]
        assert s.input_ids == list(want)
        assert s.images == (str(data.parent / rec["images"][0]),)
        # the placeholder's token, and Gemma 3's image soft tokens it expands into
        image = {processor.image_token_id, getattr(tok, "image_token_id", processor.image_token_id)}
        assert image <= set(s.input_ids) and all(lab not in image for lab in s.labels)
        trained = [t for t, lab in zip(s.input_ids, s.labels) if lab != IGNORE_INDEX]
        if train_on_prompt:
            assert trained == [t for t in s.input_ids if t not in image]
        else:
            answer = rec["messages"][1]["content"][0]["text"]
            assert tok.decode(trained) == answer + "<|im_end|>"


def test_a_micro_batch_carries_its_images_in_token_order(model):
    """The pixel inputs of a micro-batch are the processor's for its rows' images, in row order,
    each image where its tokens are; resuming the batcher gives the same ones."""
    kind, tmp, processor = model
    data = tmp / "data" / "chat.jsonl"
    vision = VisionData(processor)
    samples = build_samples(_cfg(data), processor.tokenizer, vision=vision)
    batcher = Batcher(samples, batch_size=3, grad_accum=2, max_length=128, seed=3, pixels=vision.pixels)
    batcher.next_step()
    state = batcher.state_dict()
    step = batcher.next_step()
    for mb in step:
        images = [decode(samples[i].images[0], "test") for i in mb.units]
        want = processor(images=[[im] for im in images], return_tensors="pt")
        assert mb.images.keys() == {k for k in want if k not in TEXT_KEYS}
        for k, v in mb.images.items():
            assert torch.equal(v, want[k]), k
        counts = (mb.input_ids == processor.image_token_id).sum(1)
        assert (counts > 0).all()
    again = Batcher(samples, batch_size=3, grad_accum=2, max_length=128, seed=3, pixels=vision.pixels)
    again.load_state_dict(state)
    for a, b in zip(step, again.next_step()):
        assert torch.equal(a.input_ids, b.input_ids)
        assert all(torch.equal(a.images[k], b.images[k]) for k in a.images)


def test_images_as_bytes_and_trl_string_turns(model, tmp_path):
    """Images as bytes in Parquet (a datasets Image column: {"bytes", "path"}) and turns of plain
    strings with an images column (TRL puts the images before the first user turn's text) read as
    the parts-and-paths form does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    kind, tmp, processor = model
    names = write_images(tmp_path / "imgs")
    parts = image_chat(0, f"imgs/{names[1]}")
    raw = (tmp_path / "imgs" / names[1]).read_bytes()
    plain = {
        "messages": [
            [
                {"role": "user", "content": "what is in the picture?"},
                {"role": "assistant", "content": ANSWERS[0]},
            ]
        ],
        "images": [[{"bytes": raw, "path": None}]],
    }
    (tmp_path / "a.jsonl").write_text(json.dumps(parts) + "\n")
    pq.write_table(pa.table(plain), tmp_path / "b.parquet")
    vision = VisionData(processor)
    a = build_samples(_cfg(tmp_path / "a.jsonl"), processor.tokenizer, vision=vision)
    b = build_samples(_cfg(tmp_path / "b.parquet"), processor.tokenizer, vision=vision)
    assert a[0].input_ids == b[0].input_ids and a[0].labels == b[0].labels
    assert b[0].images == (raw,)
    pa, pb = vision.pixels([[("a", a[0].images)]]), vision.pixels([[("b", b[0].images)]])
    assert all(torch.equal(pa[k], pb[k]) for k in pa)


BAD = {
    "missing file": ({"images": ["imgs/nope.png"]}, "images[0]: {dir}/imgs/nope.png: no such file"),
    "not an image": ({"images": ["bad.png"]}, "images[0]: {dir}/bad.png: not an image Pillow can read"),
    "count": ({"images": ["imgs/0.png", "imgs/1.png"]}, "field 'images': 2 images for 1 image parts"),
    "entry": ({"images": [3]}, "field 'images': entry 0 must be a path or image bytes, got int"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_images_are_one_line_naming_file_line_and_field(model, tmp_path, case):
    kind, tmp, processor = model
    write_images(tmp_path / "imgs")
    (tmp_path / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    change, why = BAD[case]
    rows = [image_chat(0, "imgs/0.png"), image_chat(1, "imgs/1.png") | change]
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(DataError) as e:
        build_samples(_cfg(data), processor.tokenizer, vision=VisionData(processor))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{data}:2: "), msg
    assert why.format(dir=tmp_path) in msg, msg


def test_images_of_a_text_model_and_too_long_samples_are_refused(model, tmp_path):
    kind, tmp, processor = model
    data = tmp / "data" / "chat.jsonl"
    with pytest.raises(DataError, match=r"chat.jsonl:1: images: the model is a text model"):
        build_samples(_cfg(data), processor.tokenizer)
    with pytest.raises(
        DataError, match=r"chat.jsonl:1: sample has \d+ tokens with its images', more than max_length 8"
    ):
        build_samples(
            _cfg(data, max_length=8, truncation=True), processor.tokenizer, vision=VisionData(processor)
        )


def _run(tmp, **kw) -> TrainConfig:
    return TrainConfig(**_settings(tmp, **kw))


def _settings(tmp, **kw) -> dict:
    return (
        dict(
            model_name_or_path=str(tmp / "model"),
            dataset=str(tmp / "data" / "chat.jsonl"),
            max_length=128,
            per_device_train_batch_size=2,
            gradient_accumulation_steps=2,
            learning_rate=1e-3,
            lr_scheduler_type="cosine",
            warmup_steps=1,
            max_grad_norm=1.0,
            weight_decay=0.01,
            save_dtype="float32",
            disable_tqdm=True,
            freeze_vision_tower=False,
            freeze_multi_modal_projector=False,
        )
        | kw
    )


def test_a_run_resumes_exactly_and_exports_model_and_processor(model, tmp_path):
    """Five steps with the tower trained, against two, a checkpoint, and three more (a constant
    learning rate: a run of two steps has its own schedule otherwise): the same
    losses and bit for bit the same weights and moments; final/ loads in transformers (model
    and processor) and gives megatrain's logits."""
    kind, tmp, processor = model
    steady = dict(lr_scheduler_type="constant", warmup_steps=0)  # the same schedule whatever max_steps
    ref = train(_run(tmp, output_dir=str(tmp_path / "a"), max_steps=5, **steady))
    train(_run(tmp, output_dir=str(tmp_path / "b"), max_steps=2, save_steps=2, **steady))
    final = train(
        _run(tmp, output_dir=str(tmp_path / "b"), max_steps=5, resume_from_checkpoint=True, **steady)
    )
    got, want = metrics(tmp_path / "b"), metrics(tmp_path / "a")
    assert [r["loss"] for r in got] == [r["loss"] for r in want]
    assert_bitwise(tensors(final), tensors(ref))
    assert_bitwise(tensors(tmp_path / "b" / "checkpoint-5"), tensors(tmp_path / "a" / "checkpoint-5"))
    assert max(r["grad_norm"] for r in want) > 1.0  # clipping was active
    start = tensors(tmp / "model")
    tower = [k for k in start if "vision" in k]
    first = [k for k in tower if ".layers.0." in k]  # the tower's first layer trained
    assert first and all(not torch.equal(start[k], tensors(final)[k]) for k in first)

    back = transformers.AutoModelForImageTextToText.from_pretrained(final).eval()
    proc = transformers.AutoProcessor.from_pretrained(final)
    assert type(proc) is type(processor)
    rec = image_chat(0, str(tmp / "data" / "imgs" / "0.png"))
    text = proc.apply_chat_template(rec["messages"], tokenize=False)
    inputs = proc(
        text=[text],
        images=[[decode(rec["images"][0], "test")]],
        return_tensors="pt",
        add_special_tokens=False,
    )
    with torch.no_grad():
        logits = back(**inputs).logits
    from megatrain.data.batch import MicroBatch
    from megatrain.models.config import ModelConfig
    from megatrain.runtime import build_model

    mt = build_model(ModelConfig.from_json(final), weights=final, device="cpu")
    images = {k: v for k, v in inputs.items() if k not in TEXT_KEYS}
    ids = inputs["input_ids"]
    torch.testing.assert_close(
        mt.engine.logits(MicroBatch(ids, ids, images=images)), logits, rtol=1e-5, atol=1e-5
    )


def test_frozen_tower_run_keeps_the_tower_as_loaded(model, tmp_path):
    """The defaults (LlamaFactory's): the tower and projector as loaded in final/, bit for bit;
    the language model trained."""
    kind, tmp, processor = model
    final = train(
        _run(
            tmp,
            output_dir=str(tmp_path / "f"),
            max_steps=2,
            freeze_vision_tower=True,
            freeze_multi_modal_projector=True,
        )
    )
    start, end = tensors(tmp / "model"), tensors(final)
    vision = [k for k in start if "vision" in k or "projector" in k or "connector" in k]
    assert vision and all(torch.equal(start[k], end[k]) for k in vision)
    assert any(not torch.equal(start[k], end[k]) for k in start if k not in vision)


@pytest.mark.slow
def test_two_processes_equal_one(model, tmp_path):
    """Data parallel with gloo, the tower trained: two processes of two micro-batches a step give
    one process's four: the same losses, gradient norms and weights."""
    from test_distributed import assert_same_run, one_and_two

    kind, tmp, _ = model
    base = _settings(tmp, max_steps=3, gradient_accumulation_steps=4)
    torch.set_num_threads(1)
    one_and_two(tmp_path, base)
    assert_same_run(metrics(tmp_path / "two"), metrics(tmp_path / "one"), [1, 2, 3])
    two, one = tensors(tmp_path / "two" / "final"), tensors(tmp_path / "one" / "final")
    assert two.keys() == one.keys()
    for k in one:
        atol = 2 * 3 * base["learning_rate"] if KEY_BIAS.search(k) else 1e-6
        torch.testing.assert_close(two[k], one[k], rtol=1e-5, atol=atol, msg=k)


# ---------------------------------------------------------------------------- dpo with images
def _image_pairs(folder, n: int = 8) -> list[dict]:
    """TRL's vision preference records: a prompt turn with an image, two answers, the images."""
    names = write_images(folder / "imgs")
    return [
        {
            "prompt": [
                {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is it?"}]}
            ],
            "chosen": [{"role": "assistant", "content": ANSWERS[i % 4]}],
            "rejected": [{"role": "assistant", "content": ANSWERS[(i + 1) % 4] + " and more"}],
            "images": [f"imgs/{names[i % len(names)]}"],
        }
        for i in range(n)
    ]


def test_dpo_pairs_are_trls_vision_collation(model, tmp_path):
    """Each pair's two sequences (prompt + chosen, prompt + rejected) and where their completions
    start are what TRL's DataCollatorForVisionPreference makes of the record, and its micro-batch
    carries the prompt's image once for each sequence, as TRL's does."""
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    from megatrain.data.preference import Limits, build_preference_pairs, pair_sample

    kind, tmp, processor = model
    records = _image_pairs(tmp_path)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    vision = VisionData(processor)
    pairs = build_preference_pairs([data], processor.tokenizer, Limits(128, rule="joint"), vision=vision)
    collate = DataCollatorForVisionPreference(processor=processor)
    for pair, rec in zip(pairs, records):
        image = decode(str(tmp_path / rec["images"][0]), "test")
        out = collate([{**json.loads(json.dumps(rec)), "images": [image]}])
        for row, seq in enumerate((pair.chosen, pair.rejected)):
            real = out["attention_mask"][row].bool()
            assert seq.input_ids == out["input_ids"][row][real].tolist()
            assert seq.prompt_length == int((~out["completion_mask"][row].bool() & real).sum())
        assert pair.images == (str(tmp_path / rec["images"][0]),)
    samples = [pair_sample(p) for p in pairs]
    mb = Batcher(
        samples, batch_size=2, grad_accum=1, max_length=128, shuffle=False, pixels=vision.pixels
    ).next_step()[0]
    images = [decode(samples[i].images[0], "test") for i in mb.units] * 2  # chosen rows, then rejected
    want = collate([{**records[i], "images": [images[k]]} for k, i in enumerate(mb.units)])
    for k, v in mb.images.items():
        assert torch.equal(v, want[k]), k


def test_dpo_with_images_trains_from_transformers_reference_logps(model, tmp_path):
    """stage dpo on image pairs, the projector trained: the reference log-probs it stores are
    transformers' summed completion log-probs of the initial model on each pair with its image,
    and the run's first loss is log 2 (the policy is the reference), then falls."""
    import math

    from safetensors.torch import load_file

    kind, tmp, processor = model
    records = _image_pairs(tmp_path)
    data = tmp_path / "pairs.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in records))
    run = _run(
        tmp, dataset=str(data), stage="dpo", output_dir=str(tmp_path / "out"), max_steps=4, learning_rate=5e-3
    )
    run = TrainConfig(**{**run.to_dict(), "freeze_multi_modal_projector": False, "freeze_vision_tower": True})
    train(run)
    stored = load_file(tmp_path / "out" / "reference" / "logps.safetensors")["train"]
    hf = transformers.AutoModelForImageTextToText.from_pretrained(tmp / "model").eval()
    from megatrain.data.preference import Limits, build_preference_pairs

    pairs = build_preference_pairs(
        [data], processor.tokenizer, Limits(128, rule="joint"), vision=VisionData(processor)
    )
    for i, pair in enumerate(pairs):
        pixels = VisionData(processor).pixels([[("t", pair.images)]])
        for code, seq in enumerate((pair.chosen, pair.rejected)):
            ids = torch.tensor([seq.input_ids])
            # TRL passes Gemma 3's token types (its bidirectional images) to the model
            types = {"token_type_ids": (ids == hf.config.image_token_id).long()} if kind == "gemma3" else {}
            with torch.no_grad():
                logits = hf(input_ids=ids, **pixels, **types).logits[0, :-1].double()
            logps = torch.log_softmax(logits, -1).gather(1, ids[0, 1:, None])[:, 0]
            want = logps[seq.prompt_length - 1 :].sum()
            assert float(stored[i, code]) == pytest.approx(float(want), rel=1e-5)
    losses = [r["loss"] for r in metrics(tmp_path / "out") if "loss" in r]
    assert losses[0] == pytest.approx(math.log(2), rel=1e-5) and losses[-1] < losses[0]


@pytest.mark.slow
def test_the_vision_example_learns_the_colours(tmp_path):
    """examples/vision.yaml on the model its setup builds: the shipped data is its generator's,
    and after the run the model names the colour of every picture of a colour it was shown."""
    import subprocess
    import sys
    from pathlib import Path

    from megatrain.talk import Chat, load_model

    root = Path(__file__).resolve().parents[1]
    script = root / "examples" / "vision" / "make_example.py"
    for args in (["--check"], ["--out", str(tmp_path / "model")]):
        subprocess.run([sys.executable, script, *args], check=True, capture_output=True)
    overrides = [f"model_name_or_path={tmp_path / 'model'}", f"output_dir={tmp_path / 'out'}"]
    cfg = TrainConfig.load(root / "examples" / "vision.yaml", overrides)
    final = train(cfg)
    assert metrics(tmp_path / "out")[-1]["loss"] < 0.05
    processor = transformers.AutoProcessor.from_pretrained(final)
    model = load_model(final, "cpu")
    chat = Chat(model, processor.tokenizer, processor=processor, max_new_tokens=6, temperature=0.0)
    colours = ("red", "green", "blue")
    for i in range(9):
        chat.messages.clear()
        chat.attach(root / "examples" / "vision" / "images" / f"{i:02d}.png")
        assert chat.answer("What colour is it?") == f"It is {colours[i % 3]}.", i
