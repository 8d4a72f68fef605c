"""`megatrain chat MODEL_DIR`: talk to a trained model from the terminal, to check a fine-tune
without writing Python.

MODEL_DIR is a Hugging Face model directory: a run's final/, an export, a checkpoint-N (its fp32
weights, config.json and tokenizer), or a run's output_dir (its final/). The model is loaded by
transformers and answers with `generate`, its tokens streamed as they come. The conversation
is rendered with the tokenizer's chat template (`--raw`: the text continued as it is), and an
answer ends at EOS or at the token that closes the template's assistant turns. The tokenizer
is the directory's, else that of the run which wrote it (its train_config.json), else
`--tokenizer`.

A vision-language model (an image-text-to-text model) talks through its processor: `--image
PATH` (repeatable) goes with the first message, `/image PATH` in the loop with the next one;
the images stay in the conversation with their messages.

`--prompt TEXT` answers once and exits, as does text piped into stdin; on a terminal the loop
keeps the conversation (`/reset` forgets it, `/exit` or Ctrl-D ends it) with line editing and
input history; Ctrl-C stops an answer. A conversation that outgrows the model's context
(`max_position_embeddings`, less `--max-new-tokens` for the answer) forgets its oldest exchanges,
saying so; a message too long alone is refused in one line.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

import torch

from .errors import ConfigError, MegatrainError, first_line
from .io.checkpoint import TRAIN_CONFIG

EXIT, RESET, IMAGE = "/exit", "/reset", "/image"


def model_dir(path: str | Path) -> Path:
    """The model directory `path` names: itself, or the final/ of a run's output_dir."""
    p = Path(path)
    if not p.is_dir():
        raise ConfigError(f"{p}: no such directory (a run's final/, an export or a checkpoint-N)")
    if not (p / "config.json").is_file() and (p / "final" / "config.json").is_file():
        return p / "final"
    if not (p / "config.json").is_file():
        raise ConfigError(
            f"{p}: no config.json, not a model directory (a run's final/, an export or a checkpoint-N)"
        )
    return p


def find_tokenizer(directory: Path, given: str | None = None):
    """The tokenizer `given`, else the model directory's, else that of the run that wrote it
    (tokenizer_name_or_path or model_name_or_path in its train_config.json, beside the model or
    in the output_dir above it). ConfigError naming what was looked at when there is none."""
    from .data import load_tokenizer

    if given:
        return load_tokenizer(given)
    tok = load_tokenizer(directory, optional=True)
    if tok is not None:
        return tok
    for config in (directory / TRAIN_CONFIG, directory.parent / TRAIN_CONFIG):
        if config.is_file():
            run = json.loads(config.read_text())
            for key in ("tokenizer_name_or_path", "model_name_or_path"):
                if run.get(key) and Path(run[key]).exists():
                    tok = load_tokenizer(run[key], optional=key == "model_name_or_path")
                    if tok is not None:
                        return tok
    raise ConfigError(
        f"{directory}: no tokenizer here or in its run's {TRAIN_CONFIG} (pass --tokenizer PATH)"
    )


class Chat:
    """A model, its tokenizer and a conversation; `answer` streams each reply to `out`."""

    def __init__(
        self,
        model,
        tokenizer,
        raw: bool = False,
        system: str | None = None,
        max_new_tokens: int = 256,
        temperature: float | None = None,
        top_p: float | None = None,
        out: TextIO | None = None,
        processor=None,
    ):
        from .data.chat import end_of_turn_id

        self.model, self.tok, self.out = model, tokenizer, out or sys.stdout
        # A vision-language model's processor renders the conversation and its images.
        self.processor = processor
        self.render = processor if processor is not None else tokenizer
        self.raw = raw or not getattr(self.render, "chat_template", None)
        self.system = system
        self.messages: list[dict] = []
        self.pending: list = []  # images for the next message (Pillow images)
        self.pixels: dict = {}  # the image inputs of the conversation being answered
        self.options = generation_options(model, tokenizer, max_new_tokens, temperature, top_p)
        self.context = context_length(model)
        # An answer ends where the template closes the assistant's turn, whatever the model's EOS.
        eot = None if self.raw else end_of_turn_id(tokenizer, self.render)
        if eot is not None and eot not in self.options["eos_token_id"]:
            self.options["eos_token_id"].append(eot)

    def input_ids(self, text: str) -> torch.Tensor:
        """The tokens the model continues: the conversation so far and `text` in the chat
        template with the assistant's turn opened, or `text` alone (raw). The oldest exchanges
        are forgotten, with a note on stderr, until it leaves the answer its room in the model's
        context; MegatrainError if `text` alone does not."""
        room = None if self.context is None else self.context - self.options["max_new_tokens"]
        if self.raw:
            ids = self.tok(text)["input_ids"]
        else:
            ids = self._templated(text)
            while room is not None and len(ids) > room and self.messages:
                self.messages = self.messages[2:]  # the oldest exchange: a question and its answer
                print(f"megatrain chat: the conversation outgrew the model's context of {self.context} "
                      "tokens: its oldest exchange is forgotten", file=sys.stderr)  # fmt: skip
                ids = self._templated(text)
        if room is not None and len(ids) > room:
            where = "" if self.raw else " in the chat template"
            raise MegatrainError(
                f"the message is {len(ids)} tokens{where}; the model's context of {self.context} holds "
                f"{max(room, 0)} beside the answer's {self.options['max_new_tokens']} (--max-new-tokens)"
            )
        return torch.tensor([ids])

    def attach(self, path: str | Path) -> None:
        """An image for the next message (a vision-language model's); MegatrainError naming the
        file when it is not one Pillow reads, or the model takes no images."""
        from .data.vision import decode

        if self.processor is None:
            raise MegatrainError(f"{path}: the model is a text model (images need a vision-language one)")
        self.pending.append(decode(str(path), "--image"))

    def _user(self, text: str) -> dict:
        if not self.pending:
            return {"role": "user", "content": text}
        parts = [{"type": "image", "image": im} for im in self.pending]
        return {"role": "user", "content": [*parts, {"type": "text", "text": text}]}

    def _templated(self, text: str) -> list[int]:
        system = [{"role": "system", "content": self.system}] if self.system else []
        messages = [*system, *self.messages, self._user(text)]
        if self.processor is None:
            rendered = self.tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)
            return rendered["input_ids"]
        # The processor expands each image's placeholder into its tokens, as in training.
        prompt = self.processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        images = [
            p["image"]
            for m in messages
            if isinstance(m["content"], list)
            for p in m["content"]
            if "image" in p
        ]
        enc = self.processor(
            text=[prompt], images=[images] if images else None, add_special_tokens=False, return_tensors="pt"
        )
        self.pixels = {k: v for k, v in enc.items() if k not in ("input_ids", "attention_mask")}
        return enc["input_ids"][0].tolist()

    def answer(self, text: str) -> str:
        """Generate the reply to `text`, streamed to `out`; returns it (kept in the conversation)."""
        from transformers import TextStreamer

        out = self.out

        class Printer(TextStreamer):
            def on_finalized_text(self, text: str, stream_end: bool = False) -> None:
                out.write(text + ("\n" if stream_end else ""))
                out.flush()

        ids = self.input_ids(text).to(self.model.device)
        pixels = {k: v.to(self.model.device) for k, v in self.pixels.items()}
        streamer = Printer(self.tok, skip_prompt=True, skip_special_tokens=True)
        with torch.inference_mode():
            full = self.model.generate(
                ids, attention_mask=torch.ones_like(ids), streamer=streamer, **pixels, **self.options
            )
        reply = self.tok.decode(full[0, ids.shape[1] :], skip_special_tokens=True)
        if not self.raw:
            self.messages += [self._user(text), {"role": "assistant", "content": reply}]
            self.pending = []
        return reply


def context_length(model) -> int | None:
    """The most positions the model's config says it takes (None where it names none)."""
    cfg = model.config.get_text_config()
    return getattr(cfg, "max_position_embeddings", None) or getattr(cfg, "n_positions", None)


def generation_options(
    model, tokenizer, max_new_tokens: int, temperature: float | None, top_p: float | None
) -> dict:
    """generate()'s arguments: the model's generation_config (its sampling defaults, its EOS ids)
    with the command's settings over them; temperature 0 is greedy decoding."""
    gen = model.generation_config
    eos = gen.eos_token_id if gen.eos_token_id is not None else tokenizer.eos_token_id
    eos = [] if eos is None else list(eos) if isinstance(eos, list) else [eos]
    options: dict = dict(max_new_tokens=max_new_tokens, eos_token_id=eos)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (eos[0] if eos else None)
    if pad is not None:
        options["pad_token_id"] = pad  # else generate() warns that it picks one
    if temperature is not None:
        options["do_sample"] = temperature > 0
        if temperature > 0:
            options["temperature"] = temperature
    if top_p is not None:
        options["top_p"] = top_p
    return options


def is_vision_model(directory: Path) -> bool:
    """Whether a model directory holds a vision-language (image-text-to-text) model."""
    from transformers import MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING, AutoConfig

    try:
        return type(AutoConfig.from_pretrained(str(directory))) in MODEL_FOR_IMAGE_TEXT_TO_TEXT_MAPPING
    except Exception:  # load_model says what is wrong with it
        return False


def load_model(directory: Path, device: str = "auto", dtype: str = "auto"):
    """The model of a directory through transformers (its causal LM, or a vision-language
    model's image-text-to-text model), on `device` in `dtype` (auto: bfloat16 on CUDA, float32
    on the CPU), for inference. ConfigError when transformers cannot load it."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from .devices import resolve_device
    from .runtime import resolve_dtype

    dev = resolve_device(device)
    auto = AutoModelForImageTextToText if is_vision_model(directory) else AutoModelForCausalLM
    try:
        model = auto.from_pretrained(str(directory), dtype=resolve_dtype(dtype, dev))
    except Exception as e:  # transformers' errors are long; the first line says what failed
        raise ConfigError(f"{directory}: transformers cannot load this model ({first_line(e)})") from None
    return model.to(dev).eval()


def converse(chat: Chat, read: Callable[[str], str] = input) -> None:
    """The interactive loop: read a line, answer it; `/reset` forgets the conversation, `/exit`
    or end of input (Ctrl-D) ends it."""
    with contextlib.suppress(ImportError):  # not on every platform
        import readline  # noqa: F401 (input() gets line editing and history)
    more = f", {IMAGE} PATH adds an image to the next message" if chat.processor is not None else ""
    chat.out.write(f"megatrain chat: {EXIT} or Ctrl-D ends, {RESET} forgets the conversation{more}\n")
    while True:
        try:
            text = read("> ")
        except EOFError:
            chat.out.write("\n")
            return
        if text.strip() == EXIT:
            return
        if text.strip() == RESET:
            chat.messages.clear()
            chat.pending.clear()
            continue
        if text.strip().startswith(IMAGE + " "):
            try:
                chat.attach(text.strip()[len(IMAGE) :].strip())
            except MegatrainError as e:
                chat.out.write(f"megatrain chat: {e}\n")
            continue
        if text.strip():
            try:
                chat.answer(text)
            except KeyboardInterrupt:  # Ctrl-C stops an answer (forgotten), not the conversation
                chat.out.write("\n(interrupted)\n")
            except MegatrainError as e:  # a message too long: said, and the conversation goes on
                chat.out.write(f"megatrain chat: {e}\n")
