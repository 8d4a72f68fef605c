"""Tiny random Hugging Face models for parity tests."""

from __future__ import annotations

import torch
import transformers

FAMILY_CONFIGS = {
    "llama": lambda **kw: transformers.LlamaConfig(**kw),
    "mistral": lambda **kw: transformers.MistralConfig(**kw),
    "qwen2": lambda **kw: transformers.Qwen2Config(**kw),
    "qwen3": lambda **kw: transformers.Qwen3Config(**kw),
}


def tiny_config(family: str = "llama", tied: bool = False, **overrides):
    kw = dict(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=112,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        tie_word_embeddings=tied,
        initializer_range=0.2,  # large enough that gradients are far from zero
    )
    if family == "qwen3":
        kw["head_dim"] = 24  # Qwen3 decouples head_dim from hidden/heads
    if family == "mistral":
        kw["sliding_window"] = 8  # short enough to matter in tests
    kw.update(overrides)
    cfg = FAMILY_CONFIGS[family](**kw)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_hf_model(family="llama", tied=False, seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = tiny_config(family, tied, **overrides)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").float()
    # Random norms and biases too, so their gradients are checked against something nontrivial.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.normal_(1.0 if "norm" in n else 0.0, 0.1)
    return model.eval()
