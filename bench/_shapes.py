"""The model shapes bench/ runs: dense Llama shapes and mixture-of-experts ones (with their
transformers configs), shared by bench.py, multigpu.py and memory.py.

`ffn` is each expert's intermediate size; `experts` routed experts, `topk` per token. The two
real shapes: OLMoE-1B-7B (allenai/OLMoE-1B-7B-0924's config.json) and a ~15B Qwen3-MoE (Qwen3-30B-A3B's
layer, 24 layers instead of 48).
"""

from __future__ import annotations

from typing import Any

DENSE_SHAPES: dict[str, dict[str, int]] = {
    # 3.61 B, the model of the performance notes
    "A": dict(hidden=3072, layers=28, heads=24, kv=8, ffn=8192, vocab=128256),
    # 8.03 B, Llama-3.1-8B's shape
    "B": dict(hidden=4096, layers=32, heads=32, kv=8, ffn=14336, vocab=128256),
    # 11.52 B, B with 48 layers: under the 11.63 B that bf16 moments fit in one H200's 128 GiB host
    "B11": dict(hidden=4096, layers=48, heads=32, kv=8, ffn=14336, vocab=128256),
    # 18.7 B and 20.3 B: Llama shapes past what an 80 GB GPU held with every gradient on it
    "B18": dict(hidden=6144, layers=44, heads=48, kv=8, ffn=16384, vocab=128256),
    "B20": dict(hidden=6144, layers=48, heads=48, kv=8, ffn=16384, vocab=128256),
    # 28.1 B: its fp32 weights and moments (314 GiB) 1.25x a 256 GiB host, for the disk tier
    "B28": dict(hidden=6144, layers=68, heads=48, kv=8, ffn=16384, vocab=128256),
    # Qwen2.5-7B's, -14B's and -32B's shapes (without the q/k/v biases: 0.01% of the parameters)
    "Q7": dict(hidden=3584, layers=28, heads=28, kv=4, ffn=18944, vocab=152064),
    "Q14": dict(hidden=5120, layers=48, heads=40, kv=8, ffn=13824, vocab=152064),
    "Q32": dict(hidden=5120, layers=64, heads=40, kv=8, ffn=27648, vocab=152064),
    # a 120B-class layer shape, a few layers; the same layers 122 B parameters in all
    "X120": dict(hidden=12288, layers=4, heads=96, kv=8, ffn=28672, vocab=128256),
    "X120-full": dict(hidden=12288, layers=86, heads=96, kv=8, ffn=28672, vocab=128256),
    "L70": dict(hidden=8192, layers=80, heads=64, kv=8, ffn=28672, vocab=128256),  # Llama-3.1-70B's
    "tiny": dict(hidden=128, layers=2, heads=4, kv=2, ffn=256, vocab=512),
    # 0.25 B: large enough for whole 64 MiB blocks of the disk tier, small enough to train on a CPU
    "S": dict(hidden=1024, layers=12, heads=16, kv=4, ffn=4096, vocab=32000),
}

MOE_SHAPES: dict[str, dict[str, Any]] = {
    # 6.9 B parameters, 1.3 B active per token
    "olmoe-1b-7b": dict(family="olmoe", hidden=2048, layers=16, heads=16, kv=16, ffn=1024, vocab=50304, experts=64, topk=8),
    # 15.6 B parameters, 1.9 B active per token
    "qwen3-moe-15b": dict(
        family="qwen3_moe", hidden=2048, layers=24, heads=32, kv=4, head_dim=128, ffn=768, vocab=151936, experts=128, topk=8
    ),
    # openai/gpt-oss-20b's config.json (20.9 B): sinks, alternating 128-token windows, 32 biased experts
    "gpt-oss-20b": dict(
        family="gpt_oss", hidden=2880, layers=24, heads=64, kv=8, head_dim=64, ffn=2880, vocab=201088, experts=32, topk=4
    ),
    # deepseek-ai/DeepSeek-V2-Lite's config.json (15.7 B): latent attention, 2 shared experts, dense first layer
    "deepseek-v2-lite": dict(
        family="deepseek_v2", hidden=2048, layers=27, heads=16, kv=16, head_dim=192, ffn=1408, vocab=102400,
        experts=64, topk=6,
    ),
    "moe-tiny": dict(family="olmoe", hidden=128, layers=2, heads=4, kv=2, ffn=64, vocab=512, experts=8, topk=2),
}  # fmt: skip


def is_moe(shape: dict[str, Any]) -> bool:
    return "experts" in shape


def moe_config(shape: dict[str, Any], seq: int, **extra: Any):
    """The transformers config of an MoE shape (random init), trained with the aux loss on, as
    OLMoE and Qwen-MoE were: every system computes the router's load-balancing loss."""
    import transformers

    common = dict(
        hidden_size=shape["hidden"],
        num_hidden_layers=shape["layers"],
        num_attention_heads=shape["heads"],
        num_key_value_heads=shape["kv"],
        vocab_size=shape["vocab"],
        num_experts=shape["experts"],
        num_experts_per_tok=shape["topk"],
        output_router_logits=True,
        max_position_embeddings=max(seq, 4096),
        tie_word_embeddings=False,
        pad_token_id=None,  # random tokens, no padding (and ZeRO-3's partitioned init has no pad row)
        **extra,
    )
    if shape["family"] == "olmoe":
        cfg = transformers.OlmoeConfig(intermediate_size=shape["ffn"], **common)
    elif shape["family"] == "gpt_oss":
        common["num_local_experts"] = common.pop("num_experts")
        cfg = transformers.GptOssConfig(intermediate_size=shape["ffn"], head_dim=shape["head_dim"], **common)
    elif shape["family"] == "deepseek_v2":
        common.update(output_router_logits=False)  # transformers has no aux loss for DeepSeek
        common.update(n_routed_experts=common.pop("num_experts"), n_shared_experts=2, first_k_dense_replace=1)
        cfg = transformers.DeepseekV2Config(
            moe_intermediate_size=shape["ffn"],
            intermediate_size=10944,  # the dense first layer's
            q_lora_rank=None,
            kv_lora_rank=512,
            qk_nope_head_dim=128,
            qk_rope_head_dim=64,
            v_head_dim=128,
            topk_method="greedy",
            **common,
        )
    else:
        cfg = transformers.Qwen3MoeConfig(
            moe_intermediate_size=shape["ffn"], head_dim=shape["head_dim"], norm_topk_prob=True, **common
        )
    cfg._attn_implementation = "sdpa"
    return cfg


def model_config(shape: dict[str, Any]):
    """megatrain's config of an MoE shape: its parameter counts are the model's own."""
    from megatrain.models.config import ModelConfig

    return ModelConfig.from_hf(moe_config(shape, 4096))


def inactive_params(shape: dict[str, Any]) -> int:
    """Expert parameters a token does not pass through (0 for a dense shape)."""
    if not is_moe(shape):
        return 0
    cfg = model_config(shape)
    return (shape["layers"] - cfg.moe.dense_layers) * cfg.moe.inactive_params(cfg.hidden_size)
