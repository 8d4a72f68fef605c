"""The probe's choices that need no device: the row length its attention kernel is timed at, and
which of its measurements run (each once a process; the tiled layer's only when a plan asks)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from helpers import tiny_config

from megatrain.models.config import ModelConfig
from megatrain.planning import probe
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


def test_each_probe_runs_once_a_process_and_the_tiled_one_only_when_asked(monkeypatch):
    """A plan's layer on CUDA is probed untiled (`layer_probe_for`); its tiled probe runs when a
    plan asks (`LayerProbe.with_tiles`) or a benchmark records the layer (`layer_memory_for`),
    once for the process, on top of the untiled measurement."""
    cfg = ModelConfig.from_hf(tiny_config("llama"))
    runs: list[str] = []
    untiled = probe.LayerMemory(1.0, 2.0, 3.0, 4.0, flops_per_s=5.0)

    def probe_untiled(*args, quiet):
        runs.append("untiled")
        return untiled

    def probe_tiled(measured, *args):
        runs.append("tiled")
        return replace(measured, tiled_graph_per_token=6.0)

    monkeypatch.setattr(probe, "_PROBED", {})
    monkeypatch.setattr(probe, "probe_untiled", probe_untiled)
    monkeypatch.setattr(probe, "probe_tiled", probe_tiled)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    first = probe.layer_probe_for(cfg, "cuda", torch.bfloat16, None, 4096)
    assert isinstance(first, probe.LayerProbe) and first.untiled == untiled and runs == ["untiled"]
    again = probe.layer_probe_for(cfg, "cuda", torch.bfloat16, True, 4096)  # None: compiled, as this
    assert again.untiled is untiled and runs == ["untiled"]
    full = again.with_tiles()
    assert full == replace(untiled, tiled_graph_per_token=6.0) and runs == ["untiled", "tiled"]
    assert first.with_tiles() is full
    assert probe.layer_memory_for(cfg, "cuda", torch.bfloat16, None, 4096) is full
    assert runs == ["untiled", "tiled"]
    probe.layer_probe_for(cfg, "cuda", torch.bfloat16, True, 4096, masked=True)  # another layer's
    assert runs == ["untiled", "tiled", "untiled"]
    assert probe.layer_probe_for(cfg, "cpu", torch.float32, None, 512).tiled_graph_per_token is not None
