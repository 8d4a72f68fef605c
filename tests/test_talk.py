"""`megatrain chat`: one answer (--prompt, piped stdin) is what transformers' `generate` gives
for the same greedy settings, for a model directory, a checkpoint-N (the run's tokenizer found
through its train_config.json) and an output_dir; the conversation loop keeps its history;
bad inputs are one line. A tiny random Llama and the repository's example tokenizer."""

from __future__ import annotations

import io
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from helpers import tiny_config
from test_checkpoint import make_run, one_thread  # noqa: F401 (fixture)
from test_cli import run_cli

from megatrain.config import TrainConfig
from megatrain.talk import Chat, converse, find_tokenizer, load_model
from megatrain.trainer import train

TOKENIZER = Path(__file__).resolve().parents[1] / "examples" / "tokenizer"
QUESTION = "Where does Pip live?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama saved by transformers, with the example tokenizer beside it."""
    from transformers import AutoModelForCausalLM

    d = tmp_path_factory.mktemp("chat") / "model"
    torch.manual_seed(0)
    cfg = tiny_config("llama", vocab_size=1893, bos_token_id=0, eos_token_id=2)
    AutoModelForCausalLM.from_config(cfg).save_pretrained(d)
    for f in TOKENIZER.iterdir():
        shutil.copy(f, d / f.name)
    return d


def generated(directory: Path, messages: list[dict] | None, text: str | None = None, n: int = 12) -> str:
    """What transformers' greedy `generate` answers, decoded as the chat prints it: `messages` in
    the chat template, ending at EOS or <|im_end|>; or `text` continued as it is."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TOKENIZER)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    if messages is not None:
        ids = tok.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        eos = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    else:
        ids, eos = tok(text, return_tensors="pt")["input_ids"], [tok.eos_token_id]
    out = model.generate(
        ids, max_new_tokens=n, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id
    )
    answer = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True)
    assert answer.strip(), "a random model's greedy answer: some text, or this test shows nothing"
    return answer


def test_prompt_answers_as_generate_does(model_dir, capsys):
    rc, out, err = run_cli(
        capsys,
        "chat",
        model_dir,
        "--prompt",
        QUESTION,
        "--system",
        "Be brief.",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
    )
    assert rc == 0, err
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": QUESTION}]
    assert out == generated(model_dir, messages) + "\n"
    # --raw continues the text as it is.
    rc, out, err = run_cli(
        capsys,
        "chat",
        model_dir,
        "--prompt",
        "Once upon a time",
        "--raw",
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
    )
    assert rc == 0 and out == generated(model_dir, None, "Once upon a time") + "\n"


def test_answers_end_at_the_templates_end_of_turn(model_dir):
    tok = find_tokenizer(model_dir)
    chat = Chat(load_model(model_dir, "cpu"), tok)
    im_end = tok.convert_tokens_to_ids("<|im_end|>")
    assert chat.options["eos_token_id"] == [2, im_end]
    assert Chat(chat.model, tok, raw=True).options["eos_token_id"] == [2]


def test_piped_stdin_is_one_prompt(model_dir, capsys, monkeypatch):
    monkeypatch.setattr(sys, "stdin", io.StringIO(QUESTION + "\n"))
    rc, out, err = run_cli(capsys, "chat", model_dir, "--max-new-tokens", "12", "--temperature", "0")
    assert rc == 0 and out == generated(model_dir, [{"role": "user", "content": QUESTION}]) + "\n"


def test_conversation_keeps_its_history(model_dir):
    out = io.StringIO()
    chat = Chat(
        load_model(model_dir, "cpu"), find_tokenizer(model_dir), max_new_tokens=12, temperature=0, out=out
    )
    lines = iter([QUESTION, "  ", "And then?", "/reset", "And then?", "/exit", "never read"])
    converse(chat, read=lambda prompt: next(lines))
    first = generated(model_dir, [{"role": "user", "content": QUESTION}])
    second = generated(
        model_dir,
        [
            {"role": "user", "content": QUESTION},
            {"role": "assistant", "content": first},
            {"role": "user", "content": "And then?"},
        ],
    )
    fresh = generated(model_dir, [{"role": "user", "content": "And then?"}])
    assert out.getvalue().splitlines()[1:] == [first, second, fresh]
    assert chat.messages == [
        {"role": "user", "content": "And then?"},
        {"role": "assistant", "content": fresh},
    ]
    # End of input (Ctrl-D) ends the loop too.
    converse(chat, read=lambda prompt: (_ for _ in ()).throw(EOFError))


def test_checkpoint_and_output_dir_with_the_runs_tokenizer(tmp_path, capsys):
    """A checkpoint-N (fp32 weights, its tokenizer removed: the run's is found through its
    train_config.json) and an output_dir (its final/) answer as transformers does with them."""
    base = make_run(
        tmp_path, config=tiny_config("llama", vocab_size=1893, bos_token_id=0, eos_token_id=2).to_dict()
    )
    out = tmp_path / "out"
    base["warmup_steps"] = 0  # a step that changes the weights
    train(TrainConfig(**base, output_dir=str(out), max_steps=1, tokenizer_name_or_path=str(TOKENIZER)))
    capsys.readouterr()
    ckpt = out / "checkpoint-1"
    for f in TOKENIZER.iterdir():
        (ckpt / f.name).unlink()
    assert json.loads((ckpt / "train_config.json").read_text())["tokenizer_name_or_path"] == str(TOKENIZER)
    messages = [{"role": "user", "content": QUESTION}]
    for directory, model in ((ckpt, ckpt), (out, out / "final")):
        rc, stdout, err = run_cli(
            capsys, "chat", directory, "--prompt", QUESTION, "--max-new-tokens", "12", "--temperature", "0"
        )
        assert rc == 0, err
        assert stdout == generated(model, messages) + "\n"


@pytest.mark.parametrize(
    "argv,error",
    [
        (["{tmp}/nothing"], "{tmp}/nothing: no such directory (a run's final/, an export or a checkpoint-N)"),
        (
            ["{tmp}"],
            "{tmp}: no config.json, not a model directory (a run's final/, an export or a checkpoint-N)",
        ),
        (
            ["{model}", "--raw", "--system", "x"],
            "--system: a system message needs the chat template, which --raw leaves out",
        ),
        (
            ["{model}", "--temperature", "-1"],
            "argument --temperature: '-1': must be >= 0.0 (see megatrain chat --help)",
        ),
        (
            ["{model}", "--top-p", "0"],
            "argument --top-p: '0': must be > 0.0 and <= 1.0 (see megatrain chat --help)",
        ),
        (["{model}", "--device", "tpu"], "device: 'tpu' is not a device (auto, cpu, cuda, cuda:N)"),
    ],
)
def test_bad_inputs_are_one_line(tmp_path, capsys, model_dir, argv, error):
    argv = [a.format(tmp=tmp_path, model=model_dir) for a in argv]
    rc, out, err = run_cli(capsys, "chat", *argv, "--prompt", "hi")
    assert rc == 2 and err.splitlines() == [
        "megatrain: error: " + error.format(tmp=tmp_path, model=model_dir)
    ]


def test_no_tokenizer_anywhere_is_one_line(tmp_path, capsys, model_dir):
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in model_dir.iterdir():
        if not f.name.startswith("tokenizer"):
            shutil.copy(f, bare / f.name)
    rc, _, err = run_cli(capsys, "chat", bare, "--prompt", "hi")
    assert rc == 2 and err.splitlines() == [
        f"megatrain: error: {bare}: no tokenizer here or in its run's train_config.json (pass --tokenizer PATH)"
    ]
    rc, out, err = run_cli(
        capsys,
        "chat",
        bare,
        "--prompt",
        QUESTION,
        "--tokenizer",
        TOKENIZER,
        "--max-new-tokens",
        "12",
        "--temperature",
        "0",
    )
    assert rc == 0 and out == generated(model_dir, [{"role": "user", "content": QUESTION}]) + "\n"


def test_tokenizer_without_a_chat_template_continues_the_text(tmp_path, capsys, model_dir):
    plain = tmp_path / "plain"
    shutil.copytree(model_dir, plain)
    config = json.loads((plain / "tokenizer_config.json").read_text())
    del config["chat_template"]
    (plain / "tokenizer_config.json").write_text(json.dumps(config))
    rc, out, err = run_cli(
        capsys, "chat", plain, "--prompt", "Once upon a time", "--max-new-tokens", "12", "--temperature", "0"
    )
    assert rc == 0 and out == generated(model_dir, None, "Once upon a time") + "\n"
    assert "megatrain: the tokenizer has no chat template: the text is continued as it is" in err.splitlines()
    capsys.readouterr()  # what loading the reference model printed
    rc, out, err = run_cli(capsys, "chat", plain, "--prompt", "hi", "--system", "Be brief.")
    assert rc == 2 and err.splitlines() == [
        "megatrain: error: --system: a system message needs the chat template, and the tokenizer has none"
    ]


def test_a_model_transformers_cannot_load_is_one_line(tmp_path, capsys, model_dir):
    broken = tmp_path / "broken"
    shutil.copytree(model_dir, broken)
    for f in broken.glob("*.safetensors"):
        f.unlink()
    rc, _, err = run_cli(capsys, "chat", broken, "--prompt", "hi")
    lines = err.strip().splitlines()
    assert rc == 2 and lines[-1].startswith(
        f"megatrain: error: {broken}: transformers cannot load this model ("
    )
    assert not any(line.startswith("megatrain: error") for line in lines[:-1])


def test_a_long_conversation_forgets_its_oldest_exchanges(model_dir, capsys):
    """The tiny model takes 256 positions: with 12 for the answer, the conversation keeps its
    newest exchanges within 244 tokens, says on stderr when it forgets one, and answers the
    kept conversation as `generate` does."""
    from megatrain.talk import context_length

    out = io.StringIO()
    chat = Chat(
        load_model(model_dir, "cpu"), find_tokenizer(model_dir), max_new_tokens=12, temperature=0, out=out
    )
    assert context_length(chat.model) == 256
    texts = [f"Question {i}: " + "Where does Pip live? " * 12 for i in range(4)]
    history = []
    for text in texts:
        kept_before = len(chat.input_ids(text)[0])  # what the answer's prompt will be
        assert kept_before <= 256 - 12
        history.append((list(chat.messages), chat.answer(text)))
    notes = [line for line in capsys.readouterr().err.splitlines() if "forgotten" in line]
    assert notes and all("model's context of 256 tokens" in n for n in notes)
    assert chat.messages[0]["content"] != texts[0]  # the first exchange is gone
    kept, reply = history[-1]
    assert kept[0]["content"] != texts[0]
    assert reply == generated(model_dir, [*kept, {"role": "user", "content": texts[-1]}])


def test_a_message_longer_than_the_context_is_one_line(model_dir, capsys):
    text = "Where does Pip live? " * 60
    rc, _, err = run_cli(capsys, "chat", model_dir, "--prompt", text, "--max-new-tokens", "12")
    errors = [line for line in err.splitlines() if line.startswith("megatrain: error:")]
    assert rc == 2 and errors == [err.splitlines()[-1]]  # before it: transformers' loading bar
    assert errors[0].startswith("megatrain: error: the message is ")
    assert "tokens in the chat template; the model's context of 256 holds 244 beside the answer's 12" in err
    # In the loop it is said, and the conversation goes on.
    out = io.StringIO()
    chat = Chat(
        load_model(model_dir, "cpu"), find_tokenizer(model_dir), max_new_tokens=12, temperature=0, out=out
    )
    lines = iter([text, QUESTION, "/exit"])
    converse(chat, read=lambda prompt: next(lines))
    said = out.getvalue().splitlines()
    assert said[1].startswith("megatrain chat: the message is ")
    assert said[2] == generated(model_dir, [{"role": "user", "content": QUESTION}])


def test_an_image_goes_with_the_first_message_of_a_vision_language_model(tmp_path, capsys):
    """`--image PATH` on a LLaVA directory: the answer is transformers' greedy `generate` of the
    image-text-to-text model on the processor's inputs for that image and message; a text model
    refuses the option in one line."""
    from transformers import AutoModelForImageTextToText, AutoProcessor
    from vision_helpers import write_images, write_vlm_dir

    write_vlm_dir("llava", tmp_path / "vlm")
    image = tmp_path / "imgs" / write_images(tmp_path / "imgs")[2]
    rc, out, err = run_cli(
        capsys, "chat", tmp_path / "vlm", "--image", image, "--prompt", QUESTION, "--max-new-tokens", "8",
        "--temperature", "0",
    )  # fmt: skip
    assert rc == 0, err
    from PIL import Image

    processor = AutoProcessor.from_pretrained(tmp_path / "vlm")
    model = AutoModelForImageTextToText.from_pretrained(tmp_path / "vlm", dtype=torch.float32)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": QUESTION}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(
        text=[text],
        images=[[Image.open(image).convert("RGB")]],
        add_special_tokens=False,
        return_tensors="pt",
    )
    tok = processor.tokenizer
    eos = [tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")]
    full = model.generate(
        **inputs, max_new_tokens=8, do_sample=False, eos_token_id=eos, pad_token_id=tok.pad_token_id
    )
    answer = tok.decode(full[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    assert answer.strip() and out == answer + "\n"
    # the image decides the answer: another one gives another (the same random model)
    other = tmp_path / "imgs" / "0.png"
    rc, out2, _ = run_cli(
        capsys, "chat", tmp_path / "vlm", "--image", other, "--prompt", QUESTION, "--max-new-tokens", "8",
        "--temperature", "0",
    )  # fmt: skip
    assert rc == 0 and out2 != out


def test_an_image_for_a_text_model_is_one_line(model_dir, tmp_path, capsys):
    rc, out, err = run_cli(capsys, "chat", model_dir, "--image", tmp_path / "x.png", "--prompt", QUESTION)
    assert rc == 2 and err.count("\n") == 1 and "--image" in err and "text model" in err, err
