"""The data pipeline: local tokenizers, dataset files -> labelled samples -> micro-batches.

tok = load_tokenizer(path)
samples = build_samples(cfg, tok)
batcher = Batcher(samples, batch_size=..., grad_accum=..., max_length=..., packing=...,
                  shuffle=..., seed=..., pad_id=pad_token_id(tok))
micro_batches = batcher.next_step()
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .batching import Batcher, pack_rows
    from .samples import Sample, build_samples
    from .tokenizer import load_tokenizer, pad_token_id

# Each name's module, imported on first use: reading a config (data.samples' names) must not wait
# for torch and transformers.
_HOMES = {
    "Batcher": "batching",
    "pack_rows": "batching",
    "Sample": "samples",
    "build_samples": "samples",
    "load_tokenizer": "tokenizer",
    "pad_token_id": "tokenizer",
}
__all__ = ["Batcher", "Sample", "build_samples", "load_tokenizer", "pack_rows", "pad_token_id"]


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
