"""The probe's choices that need no device: the row length its attention kernel is timed at."""

from __future__ import annotations

import pytest
import torch
from helpers import tiny_config

from megatrain.models.config import ModelConfig
from megatrain.planning.probe import ATTENTION_PROBE_TOKENS, SCORE_COPIES, attention_probe_tokens

GiB = 2**30


@pytest.mark.parametrize("free_gib", [78, 139])
def test_fp32_attention_probe_fits_the_card_and_bf16_keeps_the_long_row(free_gib):
    """An fp32 row of 32k tokens holds 34 GB of scores a copy for eight heads: on an 80 GB card
    the probe itself ran out of memory before any tiny fp32 model could plan."""
    cfg = ModelConfig.from_hf(
        tiny_config("qwen2", True, hidden_size=256, num_attention_heads=8, num_key_value_heads=2)
    )
    free = free_gib * GiB
    assert attention_probe_tokens(cfg, torch.bfloat16, free) == ATTENTION_PROBE_TOKENS
    tokens = attention_probe_tokens(cfg, torch.float32, free)
    scores = SCORE_COPIES * cfg.num_attention_heads * 4 * tokens**2
    assert tokens < ATTENTION_PROBE_TOKENS and tokens % 1024 == 0
    assert scores <= free / 4 < SCORE_COPIES * cfg.num_attention_heads * 4 * (tokens + 1024) ** 2
    assert attention_probe_tokens(cfg, torch.float32, 4096 * GiB) == ATTENTION_PROBE_TOKENS
    assert attention_probe_tokens(cfg, torch.float32, GiB // 1024) == 1024  # never below one block row
