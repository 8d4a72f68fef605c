"""Images in chat data, for vision-language models (TRL's vision formats): conversations whose
content holds image parts (`{"type": "image"}`) and an `images` column (formats.py reads both).

`VisionData` wraps the model's processor (transformers' AutoProcessor of the model directory).
A conversation is rendered with its chat template, the assistant turns found as for text
(chat.py's growing prefixes), and tokenised by the processor a stretch at a time, cut at the
turns' boundaries, so each image's placeholder is expanded into its image tokens exactly as the
processor expands it; the loss is on the assistant turns (every token with `train_on_prompt`),
never on an image token. Images are decoded with Pillow when a sample is built (their tokens
depend on their size) and again when its micro-batch is (`pixels`): host memory holds the
dataset's references to them (paths, bytes), not their pixels.
"""

from __future__ import annotations

import io
from pathlib import Path

from ..errors import ConfigError, DataError
from .batch import IGNORE_INDEX
from .chat import render_with_spans, require_chat_template
from .formats import ImageChat, ImageRef, Messages, with_images

# What a processor gives for text, beside the images' own inputs (Gemma 3's gives token types
# even for images alone): no input of the tower's.
TEXT_KEYS = ("input_ids", "attention_mask", "token_type_ids", "mm_token_type_ids")


def load_processor(path: str | Path):
    """The processor of a local model directory (AutoProcessor), or a ConfigError naming it."""
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(str(path), local_files_only=True)
    except Exception as e:  # transformers raises OSError, ValueError, KeyError... naming no file
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path}: no processor for the vision-language model ({text})") from None
    if not hasattr(processor, "image_processor") or getattr(processor, "image_token", None) is None:
        raise ConfigError(f"{path}: its processor ({type(processor).__name__}) has no image processor")
    return processor


def decode(ref: ImageRef, where: str):
    """An image of the data as a Pillow RGB image; a DataError naming `where` (file:line and the
    field's entry) when it is missing or not an image."""
    from PIL import Image, UnidentifiedImageError

    name = "the image bytes" if isinstance(ref, bytes) else ref
    try:
        with Image.open(io.BytesIO(ref) if isinstance(ref, bytes) else ref) as img:
            return img.convert("RGB")
    except FileNotFoundError:
        raise DataError(f"{where}: {name}: no such file") from None
    except (UnidentifiedImageError, OSError, ValueError) as e:  # corrupt, truncated, not an image
        text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise DataError(f"{where}: {name}: not an image Pillow can read ({text})") from None


class VisionData:
    """A vision-language model's processor, for its data: conversations to tokens and labels
    (`encode`), a micro-batch's images to its pixel inputs (`pixels`)."""

    def __init__(self, processor):
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self.placeholder = processor.image_token  # what the chat template writes for an image
        # The placeholder's token and the model's image token, where they differ (Gemma 3's
        # processor expands `<start_of_image>` into `<image_soft_token>`s): neither is a label.
        model_token = getattr(self.tokenizer, "image_token_id", None)
        self.image_ids = {processor.image_token_id} | ({model_token} if model_token is not None else set())

    def encode(self, items: list[tuple[str, Messages | ImageChat]], train_on_prompt: bool):
        """Token ids and unshifted labels of each (file:line, conversation)."""
        if items:
            require_chat_template(self.processor, items[0][0].rsplit(":", 1)[0])
        return [self._encode(where, item, train_on_prompt) for where, item in items]

    def _encode(self, where: str, item, train_on_prompt: bool) -> tuple[list[int], list[int]]:
        messages, refs = (item.messages, item.images) if isinstance(item, ImageChat) else (item, ())
        full, spans = render_with_spans(self.processor, messages, where)
        images = self._decoded(full, refs, where)
        cuts = sorted({0, len(full), *(x for span in spans for x in span)})
        ids, labels, used = [], [], 0
        for a, b in zip(cuts, cuts[1:]):
            text = full[a:b]
            n = text.count(self.placeholder)
            piece = self._tokens(text, images[used : used + n], where)
            used += n
            trained = train_on_prompt or any(s <= a and b <= e for s, e in spans)
            ids += piece
            labels += [t if trained and t not in self.image_ids else IGNORE_INDEX for t in piece]
        # The stretches are tokenised apart: only where the tokenizer cuts the text at the turns'
        # boundaries anyway are they the whole conversation's tokens.
        tok = self.tokenizer
        whole = tok(full, add_special_tokens=False)["input_ids"]
        pieces = [
            t for a, b in zip(cuts, cuts[1:]) for t in tok(full[a:b], add_special_tokens=False)["input_ids"]
        ]
        if whole != pieces:
            raise DataError(
                f"{where}: the tokenizer merges characters across an assistant turn's boundary, so the "
                "turn's tokens are not its own (a chat template without a token at the turn's edges)"
            )
        return ids, labels

    def pair(self, where: str, prompt, completions, rec: dict, file) -> tuple[list[int], list[list[int]]]:
        """A preference record's prompt ids and completions' ids as TRL 1.16's vision preference
        collation makes them (DataCollatorForVisionPreference): the prompt rendered with the
        generation prompt, its images before its first user turn's text where it has no image
        parts (`prepare_multimodal_messages`), tokenised with them by the processor; each
        completion the text the template writes after it, tokenised apart without special tokens."""
        from .preference import render_completions

        if not isinstance(prompt, list):
            raise DataError(f"{where}: images are read with conversational preference data only")
        item = with_images(prompt, rec, where, file)
        messages, refs = (item.messages, item.images) if isinstance(item, ImageChat) else (item, ())
        text, rendered = render_completions(self.processor, messages, completions, where)
        ids = self._tokens(text, self._decoded(text, refs, where), where)
        return ids, [list(self.tokenizer(c, add_special_tokens=False)["input_ids"]) for c in rendered]

    def _decoded(self, text: str, refs: tuple[ImageRef, ...], where: str) -> list:
        """The images of a rendered text, which must hold one placeholder for each."""
        if text.count(self.placeholder) != len(refs):
            raise DataError(
                f"{where}: images: {len(refs)} images, but the chat template rendered "
                f"{text.count(self.placeholder)} image placeholders ({self.placeholder})"
            )
        return [decode(r, f"{where}: images[{k}]") for k, r in enumerate(refs)]

    def _tokens(self, text: str, images: list, where: str) -> list[int]:
        try:
            out = self.processor(text=[text], images=[images] if images else None, add_special_tokens=False)
        except Exception as e:  # the processor's own checks (image tokens against images)
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"{where}: the processor refused this conversation ({msg})") from None
        return list(out["input_ids"][0])

    def pixels(self, rows: list[list[tuple[str, tuple[ImageRef, ...]]]]) -> dict | None:
        """The pixel inputs of a micro-batch whose rows (in order) hold these samples' images
        ((file:line, images) of each sample of a row): the processor's tensors for them, the
        images in the order of their image tokens; None without images."""
        rows = [
            [decode(r, f"{where}: images[{k}]") for where, refs in row for k, r in enumerate(refs)]
            for row in rows
        ]
        rows = [row for row in rows if row]
        if not rows:
            return None
        out = self.processor(images=rows, return_tensors="pt")
        return {k: v for k, v in out.items() if k not in TEXT_KEYS}
