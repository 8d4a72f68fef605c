"""Tiny random Hugging Face models for parity tests."""

from __future__ import annotations

import contextlib
import functools
import random

import torch
import transformers

FAMILY_CONFIGS = {
    "llama": lambda **kw: transformers.LlamaConfig(**kw),
    "mistral": lambda **kw: transformers.MistralConfig(**kw),
    "qwen2": lambda **kw: transformers.Qwen2Config(**kw),
    "qwen3": lambda **kw: transformers.Qwen3Config(**kw),
    "mixtral": lambda **kw: transformers.MixtralConfig(**kw),
    "qwen2_moe": lambda **kw: transformers.Qwen2MoeConfig(**kw),
    "qwen3_moe": lambda **kw: transformers.Qwen3MoeConfig(**kw),
    "olmoe": lambda **kw: transformers.OlmoeConfig(**kw),
}
# Families built by model_type, with what makes their tiny versions exercise their differences:
# short sliding windows, alternating layer kinds, logit and embedding scales far from 1.
GEMMA = dict(head_dim=16, query_pre_attn_scalar=16, sliding_window=8, final_logit_softcapping=3.0)
FAMILY_OVERRIDES = {
    "gemma2": dict(GEMMA, attn_logit_softcapping=2.0),
    "gemma3_text": dict(GEMMA, layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "phi3": dict(pad_token_id=0),  # a padding row: nn.Embedding gives it no gradient
    "olmo2": {},
    "cohere": dict(logit_scale=0.5, use_qk_norm=False),
    "granite": dict(
        embedding_multiplier=2.0, logits_scaling=3.0, residual_multiplier=0.5, attention_multiplier=0.3
    ),
    "starcoder2": dict(sliding_window=8),
    "gpt_neox": {},
    "phi": {},
    "stablelm": {},
}
# Mixture-of-experts shapes: 8 experts (Mixtral 4), top-2, small experts; Qwen2-MoE's shared
# expert. The aux loss is on, with a coefficient large enough to move the gradients.
# gpt-oss: a sliding layer (window 8) and a full one, YaRN over an original context of 32, and
# a SwiGLU limit low enough that the clamps cut some of the tiny model's activations.
GPT_OSS_ROPE = dict(
    rope_type="yarn", factor=8.0, beta_fast=32.0, beta_slow=1.0, truncate=False, rope_theta=150000.0
)
MOE_CONFIGS = {
    "mixtral": dict(num_local_experts=4, intermediate_size=48),
    "qwen2_moe": dict(num_experts=8, moe_intermediate_size=32, shared_expert_intermediate_size=40),
    "qwen3_moe": dict(num_experts=8, moe_intermediate_size=32, norm_topk_prob=True),
    "olmoe": dict(num_experts=8, intermediate_size=32),
    "gpt_oss": dict(
        num_local_experts=8,
        intermediate_size=32,
        head_dim=16,
        sliding_window=8,
        swiglu_limit=1.0,
        rope_parameters=dict(GPT_OSS_ROPE, original_max_position_embeddings=32),
    ),
}
MOE_COMMON = dict(num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.5)
# DeepSeek-V2/V3 shapes (latent attention: qk head 24 = 16 + 8 rotary, v head 12; 8 experts of
# 32, top-2, a dense first layer), by case: q through its low-rank path or q_proj, experts chosen
# among the best of several groups or all, YaRN (its attention factor and softmax mscale not 1),
# interleaved rotary pairs or halves, V2's softmax routers.
DEEPSEEK_COMMON = dict(
    num_hidden_layers=3,
    num_key_value_heads=4,
    kv_lora_rank=16,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=12,
    moe_intermediate_size=32,
    n_routed_experts=8,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    rms_norm_eps=1e-2,  # not the latent norms' fixed 1e-6
)
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 64,
    "mscale": 1.0,
    "mscale_all_dim": 0.5,
}
DEEPSEEK_CONFIGS = {
    "v3": (
        "deepseek_v3",
        dict(q_lora_rank=16, n_group=2, topk_group=1, routed_scaling_factor=2.5, rope_parameters=YARN),
    ),
    "v3-q-proj-halves": (
        "deepseek_v3",
        dict(
            q_lora_rank=None,
            n_group=1,
            topk_group=1,
            rope_interleave=False,
            norm_topk_prob=False,
            attention_bias=True,
        ),
    ),
    "v2-lite": (
        "deepseek_v2",
        dict(q_lora_rank=None, topk_method="greedy", n_shared_experts=2, routed_scaling_factor=1.5),
    ),
    "v2-groups": (
        "deepseek_v2",
        dict(
            q_lora_rank=16, topk_method="group_limited_greedy", n_group=4, topk_group=2, norm_topk_prob=True
        ),
    ),
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
    if family in ("mistral", "mixtral"):
        kw["sliding_window"] = 8  # short enough to matter in tests
    kw.update(FAMILY_OVERRIDES.get(family, {}))
    if family in MOE_CONFIGS:
        kw.update(num_hidden_layers=2, **MOE_COMMON, **MOE_CONFIGS[family])
    if family in DEEPSEEK_CONFIGS:
        family, extra = DEEPSEEK_CONFIGS[family]
        kw.update(**DEEPSEEK_COMMON, **extra)
    kw.update(overrides)
    if family in FAMILY_CONFIGS:
        cfg = FAMILY_CONFIGS[family](**kw)
    else:
        cfg = transformers.AutoConfig.for_model(family, **kw)
    cfg._attn_implementation = "eager"
    return cfg


def tiny_hf_model(family="llama", tied=False, seed=0, attn_implementation="eager", **overrides):
    """A tiny random transformers model. `attn_implementation="same"`: the kernel megatrain runs,
    so a comparison measures megatrain, not two attention kernels (SDPA, or eager where
    transformers has no SDPA for the family, as for Gemma 2's soft-capped scores)."""
    torch.manual_seed(seed)
    cfg = tiny_config(family, tied, **overrides)
    if attn_implementation == "same":
        from transformers import MODEL_FOR_CAUSAL_LM_MAPPING

        sdpa = getattr(MODEL_FOR_CAUSAL_LM_MAPPING[type(cfg)], "_supports_sdpa", False)
        attn_implementation = "sdpa" if sdpa else "eager"
    cfg._attn_implementation = attn_implementation
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation=attn_implementation
    ).float()
    # Random norms and biases too, so their gradients are checked against something nontrivial.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.normal_(1.0 if "norm" in n else 0.0, 0.1)
        for n, b in model.named_buffers():
            if n.endswith("e_score_correction_bias"):  # DeepSeek-V3: it changes which experts are chosen
                b.normal_(0.0, 0.5)
    return model.eval()


def saved_parameters(model) -> dict[str, torch.nn.Parameter]:
    """A transformers model's parameters under the keys `save_pretrained` writes them with
    (GPT-NeoX's `lm_head` is `embed_out` in its checkpoints)."""
    from transformers.core_model_loading import revert_weight_conversion

    out = revert_weight_conversion(model, dict(model.named_parameters()))
    assert all(isinstance(p, torch.nn.Parameter) for p in out.values())
    return out


def assert_trained_alike(final, reference, lr: float, bulk=1e-5, strays=1e-3) -> None:
    """Two fp32 runs of the same few AdamW steps, in another order of rounding, agree: every entry
    but a fraction `strays` within `bulk` (+ 1e-4 relative), and every entry within one step's lr.

    AdamW moves an entry whose clipped gradient is near its eps, or whose moments nearly cancel, by
    a fraction of lr that its gradient's last bits decide, so a handful of entries land apart by up
    to a fair part of a step. Measured over the preference stages' tests on AVX2 and AVX512 builds
    of the same kernels: at most 12 of 55,744 entries over 1e-5, the farthest 0.2 x lr apart."""
    assert final.keys() == reference.keys(), set(final) ^ set(reference)
    off = total = 0
    for k, p in reference.items():
        d = (final[k] - p.detach()).abs()
        off += int((d > bulk + 1e-4 * p.detach().abs()).sum())
        total += d.numel()
        assert d.max() <= lr, f"{k}: an entry {float(d.max()):.3g} apart (lr {lr})"
    assert off <= strays * total, f"{off} of {total} entries over {bulk}"


# --------------------------------------------------------------------------- tiny tokenizers
CHATML_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)
TOKENIZER_SPECIALS = [
    "<pad>", "<s>", "</s>", "<|im_start|>", "<|im_end|>",
    "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
]  # fmt: skip
_TEXT = (
    "the of and to in is you that it he was for on are as with his they at be this have from or one "
    "had by word but not what all were we when your can said there use an each which she do how their "
    "if will up other about out many then them these so some her would make like him into time has look "
    "two more write go see number no way could people my than first water been call who oil its now "
    "find long down day did get come made may part over new sound take only little work know place year "
    "live me back give most very after thing our just name good sentence man think say great where help "
    "through much before line right too mean old any same tell boy follow came want show also around "
    "form three small set put end does another well large must big even such because turn here why ask "
    "went men read need land different home us move try kind hand picture again change off play spell "
    "air away animal house point page letter mother answer found study still learn should america world "
    "hello hi question user assistant system sure thanks yes"
)


@functools.cache
def _bpe_json(bos_post_processor: str) -> str:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = random.Random(0)
    words = _TEXT.split()
    corpus = [" ".join(rng.choices(words, k=10)) + ".\n" for _ in range(400)]
    corpus += [w.capitalize() + "?" for w in words] + ["0 1 2 3 4 5 6 7 8 9 , ! : ;"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=600,
        special_tokens=TOKENIZER_SPECIALS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer)
    bos_id = tok.token_to_id(bos_post_processor)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos_post_processor} $A", special_tokens=[(bos_post_processor, bos_id)]
    )
    return tok.to_str()


def tiny_tokenizer(template: str | None = "chatml"):
    """A byte-level BPE (~600 tokens, trained in milliseconds) that adds a BOS by default, as a
    transformers PreTrainedTokenizerFast. template: "chatml" (<s>/</s>, ChatML turns), "llama3"
    (<|begin_of_text|>/<|eot_id|>, Llama 3 headers), or None (no chat template, <s>/</s>)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if template == "llama3":
        bos, eos, chat = "<|begin_of_text|>", "<|eot_id|>", LLAMA3_TEMPLATE
    else:
        bos, eos, chat = "<s>", "</s>", CHATML_TEMPLATE if template == "chatml" else None
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_bpe_json(bos)), bos_token=bos, eos_token=eos, pad_token="<pad>"
    )
    if chat is not None:
        tok.chat_template = chat
    return tok


@contextlib.contextmanager
def random_kernel_timings():
    """Every timing inductor takes as it compiles (to choose among candidate kernels) replaced by
    a random number, the choices of a busy GPU exaggerated; its caches off, so that each compile
    chooses afresh. (Its own `distort_benchmarking_result` setting is read once, when its
    benchmarking module is first imported: too early for a test.)"""
    from torch._inductor import config
    from torch._inductor.runtime.benchmarking import benchmarker

    timed, calls = benchmarker.benchmark_gpu, []

    def distorted(*args, **kwargs):
        ms = timed(*args, **kwargs)
        calls.append(1)
        return type(ms)(random.random() for _ in ms) if isinstance(ms, (list, tuple)) else random.random()

    benchmarker.benchmark_gpu = distorted
    try:
        with config.patch(fx_graph_cache=False, autotune_local_cache=False, autotune_remote_cache=False):
            yield calls  # one entry per timing taken
    finally:
        del benchmarker.benchmark_gpu  # the class's method again


def llama_layer(rows: int, seq: int, dtype=torch.bfloat16, **shape):
    """One decoder layer of a Llama of `shape` (LlamaConfig's names) through megatrain's family
    template on the GPU (the CPU without one), random weights and input of `rows` x `seq` tokens:
    (call, params, x, inputs, dy), `call(params, x, inputs)` the layer's forward."""
    from torch.func import functional_call

    from megatrain.models.config import ModelConfig
    from megatrain.models.family import family_of

    cfg = ModelConfig.from_hf(transformers.LlamaConfig(num_hidden_layers=1, **shape))
    family = family_of(cfg)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    layer = family.layer(cfg, 0)
    gen = torch.Generator(device=dev).manual_seed(0)
    params = {
        n: (torch.randn(p.shape, device=dev, generator=gen) * 0.02).to(dtype).requires_grad_()
        for n, p in layer.named_parameters()
    }
    pos = torch.arange(seq, device=dev)[None].expand(rows, seq)
    inputs = family.inputs(cfg, dev)(pos, None, seq, dtype, False)["layer"]
    x = torch.randn(rows, seq, cfg.hidden_size, device=dev, dtype=dtype, generator=gen).requires_grad_()

    def call(p, h, inp):
        return functional_call(layer, p, (h,), inp)

    return call, params, x, inputs, torch.randn_like(x)


def hash_bits(*values) -> str:
    """A short digest of the exact bits of tensors (any dtype) and the reprs of other values."""
    import hashlib

    h = hashlib.sha256()
    for v in values:
        if isinstance(v, torch.Tensor):
            h.update(v.detach().contiguous().reshape(-1).view(torch.uint8).cpu().numpy().tobytes())
        else:
            h.update(repr(v).encode())
    return h.hexdigest()[:12]


def fp32_parameters(state, elsewhere=None) -> dict[str, torch.Tensor]:
    """Every parameter's fp32 master weights by transformers' name, made from the host state's
    halves (host/split.py)."""
    from megatrain.host.split import cast

    return {k: cast(v, torch.float32) for k, v in state.named_parameters(elsewhere)}
