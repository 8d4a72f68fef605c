"""Decoder models: each family's block as Hugging Face builds it, one file per family, parameter
names that are the checkpoint's keys, all built straight from a `config.json`.

* config.py: `ModelConfig`, read from a config.json (fast block or generic path, MoE and latent
  attention specs, MXFP4 checkpoints refused or decoded: mxfp4.py).
* base.py: the interface a family implements (`Family`: templates, inputs, checkpoint keys);
  family.py: which family runs a model, and what is built from it (templates, parameter count).
* decoder.py (Llama-style blocks), gemma.py, phi3.py, olmo2.py, cohere.py, moe.py, gpt_oss.py,
  deepseek.py: the fast blocks; hf.py: the generic path through transformers' own modules;
  vision.py: vision-language models (the tower and projector in the embedding unit).
* attention.py: causal, windowed and packed attention; routing.py: the MoE load-balancing loss
  across streamed layers; compiling.py: torch.compile for the hot functions.

Every module here builds on config.py; what reading a config takes from the modules above it
(DeepSeek's router rules, the generic path's checks, the parameter count) is handed to it below,
so that no module of the package imports one that imports it.
"""

from . import config, deepseek, family, hf, vision

config.HOOKS = config.Hooks(
    deepseek_moe=deepseek.moe_spec,
    generic_attention=hf.generic_attention,
    skeleton=hf.skeleton,
    count_params=family.count_params,
    vision=vision.vision_spec,
)
