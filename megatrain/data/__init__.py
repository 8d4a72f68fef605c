"""The data pipeline: local tokenizers, dataset files -> labelled samples -> micro-batches.

tok = load_tokenizer(path)
samples = build_samples(cfg, tok)
batcher = Batcher(samples, batch_size=..., grad_accum=..., max_length=..., packing=...,
                  shuffle=..., seed=..., pad_id=pad_token_id(tok))
micro_batches = batcher.next_step()
"""

from .batching import Batcher, pack_rows
from .samples import Sample, build_samples
from .tokenizer import load_tokenizer, pad_token_id

__all__ = ["Batcher", "Sample", "build_samples", "load_tokenizer", "pack_rows", "pad_token_id"]
