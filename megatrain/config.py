"""The training configuration: one YAML file plus `key=value` overrides, with Hugging Face
TrainingArguments names wherever one exists (transformers 5's forms, its older names kept).
Unknown keys and bad values are refused with a message that names them.

Where relative paths lead: an input path written in the config file (PATH_KEYS) is relative to
the file's directory; only where nothing is there does it lead from the working directory, as
Hugging Face's tools read every path (so a path to another run's outputs, such as the chat
example's `output/quickstart/final`, still works). A file in the working directory never takes
the place of one beside the config. `output_dir` is relative to the working directory, as in
Hugging Face's TrainingArguments, wherever it is written. A path given as `key=value` on the
command line is relative to the working directory."""

from __future__ import annotations

import ast
import dataclasses
import inspect
import math
import os
import re
import types
import typing
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml

from .data.samples import SPLIT
from .engine.schedule import SCHEDULES
from .errors import ConfigError
from .host import moments as moment_formats
from .trackers import reporters

if typing.TYPE_CHECKING:
    from .objectives.grpo import GRPOConfig
    from .objectives.preference import PreferenceConfig
    from .objectives.reward import RewardConfig

DATASET_FORMATS = ("auto", "text", "tokens", "messages", "sharegpt", "alpaca", "prompt_completion")
# The fields `columns` may map to a file's columns (LlamaFactory's names for alpaca's: prompt is
# its instruction, query its input, response its output).
COLUMN_FIELDS = (
    "text", "input_ids", "labels", "prompt", "completion", "query", "response", "system", "history", "messages",
)  # fmt: skip
# YAML 1.1 reads on/off/yes/no/true/false as booleans, so `gpu_state: off` arrives as False. For
# string-choice keys where a boolean has one obvious meaning, it is read as that choice.
BOOLEAN_CHOICES = {
    "gpu_state": {False: "off", True: "auto"},
    "report_to": {False: "none"},
    "save_strategy": {False: "no"},
    "eval_strategy": {False: "no"},
}
SEED_LIMIT = 2**32  # what transformers' set_seed (numpy) accepts; seeds are derived from it by arithmetic
# TrainingArguments and TRL names a user may bring that megatrain does not take, each with why and
# what to use instead (the refusal names them all at once, rather than "unknown" one at a time).
_NO_LOADER = "megatrain tokenizes every sample before step one, in its own process: there is no data loader"
_HUB = "megatrain writes local Hugging Face directories (output_dir/final); upload one with `hf upload`"
NOT_TAKEN = {
    "bf16": "megatrain's compute precision is compute_dtype (auto: bfloat16 on CUDA, float32 on the CPU)",
    "fp16": "megatrain computes in bfloat16 or float32 (compute_dtype), which need no loss scaling",
    "tf32": "float32 compute (compute_dtype: float32) is exact float32; bfloat16 is the fast path",
    "deepspeed": "megatrain places every byte itself (docs/memory.md); no DeepSpeed config is read",
    "fsdp": "megatrain's several-GPU training is its own data parallel (docs/parallel.md), under torchrun",
    "ddp_backend": "megatrain's data parallel picks NCCL on GPUs and gloo on CPUs (docs/parallel.md)",
    "ddp_find_unused_parameters": "megatrain's data parallel reduces every gradient itself (docs/parallel.md)",
    "local_rank": "torchrun gives each process its rank (LOCAL_RANK); a config names none",
    "gradient_checkpointing": "megatrain recomputes each layer's forward in its backward by design; the "
    "plan keeps the last layers' graphs where memory allows (keep_layers)",
    "gradient_checkpointing_kwargs": "megatrain recomputes each layer's forward in its backward by design",
    "use_liger_kernel": "megatrain's loss head never forms a whole step's logits (docs/architecture.md)",
    "dataloader_num_workers": _NO_LOADER,
    "dataloader_pin_memory": _NO_LOADER,
    "dataset_num_proc": _NO_LOADER,
    "remove_unused_columns": "megatrain reads its format's fields (see columns) and leaves the other columns (grpo "
    "hands them to the reward functions)",
    "save_safetensors": "megatrain writes safetensors, always",
    "push_to_hub": _HUB,
    "hub_model_id": _HUB,
    "logging_dir": "tensorboard's event files go to output_dir/runs",
    "max_seq_length": "TRL's name before 0.20; it is max_length",
    "dataset_name": "the dataset key names a file, a directory or a Hub dataset: dataset: <org/name>",
    "dataset_text_field": "name the text column with columns: {text: <column>}",
    "assistant_only_loss": "megatrain takes the loss on assistant turns (and completions) by default; "
    "train_on_prompt: true takes it on every token",
    "completion_only_loss": "megatrain takes the loss on completions (and assistant turns) by default; "
    "train_on_prompt: true takes it on every token",
    "rpo_alpha": "TRL 1.x removed it: write loss_type: [sigmoid, sft] with loss_weights: [1.0, <rpo_alpha>]",
    "reference_free": "TRL 1.x removed it: DPO compares with a reference model; stage simpo (or orpo) "
    "needs none",
}
# megatrain's own keys that are gone, each with why (refused in one line, as NOT_TAKEN's are).
RETIRED = {
    "host_weight_copy": "the master weights' bf16 half is the copy now: every fetch in bf16 reads it, "
    "2 bytes a parameter, at no extra host memory (docs/memory.md); remove the key",
    "rollout_host_copy": "the rollout's streamed layers are fetched from the master weights' bf16 half "
    "now, 2 bytes a parameter, with no copy to make (docs/grpo.md); remove the key",
}
# TRL 1.16's default learning rate of each stage's trainer (the others': 1e-6).
STAGE_LEARNING_RATES = {"sft": 2e-5, "rm": 1e-4}
SAVE_STRATEGIES = ("steps", "epoch", "no")  # Hugging Face's, less "best"
EVAL_STRATEGIES = ("no", "steps", "epoch")
# Input paths of a config file, resolved against its directory (see the module docstring).
# Keys whose default is the stage's (TRL's differ between its trainers): left out when unset.
STAGE_DEFAULTS = ("beta", "max_completion_length", "loss_type", "num_generations", "truncation_mode")
# The stages that sample completions (rl/rollout.py); their settings (`rl_settings`).
RL_STAGES = ("grpo", "rloo")
# Keys of one of them that TRL's trainer of the other lacks: each refused there, with why.
STAGE_ONLY = {
    "loss_type": ("grpo", "RLOO's loss is one: per completion, averaged over a micro-batch's completions"),
    "scale_rewards": (
        "grpo",
        "RLOO's advantage is the leave-one-out baseline; normalize_advantages scales it",
    ),
    "normalize_advantages": ("rloo", "GRPO scales its advantages by scale_rewards"),
    "reward_clip_range": ("rloo", "GRPOTrainer clips no rewards"),
    "use_bias_correction_kl": ("grpo", "RLOO puts the KL in the reward, not the loss"),
    **{
        key: ("grpo", "TRL's RLOOTrainer has no importance-sampling correction nor off-policy mask")
        for key in (
            "max_staleness",
            "vllm_importance_sampling_correction",
            "vllm_importance_sampling_mode",
            "vllm_importance_sampling_clip_max",
            "vllm_importance_sampling_clip_min",
            "off_policy_mask_threshold",
        )
    },
}
# Keys TRL 1.x's preference trainers lack (stages grpo and rloo keep theirs): refused under each
# stage of objectives.preference.TOKENISATION and under rm (whose RewardConfig lacks
# truncation_mode too), with what its TRL 1.16 trainer does instead (WHY_DROPPED: by the stage's
# tokenisation rule; rm's by its name).
DROPPED_BY_TRL1 = ("max_prompt_length", "max_completion_length")
DROPPED_BY_REWARD = (*DROPPED_BY_TRL1, "truncation_mode")
_ONE_BOUND = "bounded by max_length alone, cut as truncation_mode says (docs/preference.md)"
WHY_DROPPED = {
    "joint": "TRL 1.x's DPOTrainer and KTOTrainer have none: prompt + completion are tokenised together "
    f"and {_ONE_BOUND}",
    "answer": "TRL 1.16's ORPOTrainer and CPOTrainer have none for a causal LM: prompt + completion are "
    "bounded by max_length alone, the prompt kept whole and the completion cut at its end (docs/preference.md)",
    "rm": "TRL 1.16's RewardConfig has none: chosen and rejected are tokenised whole (prompt + completion "
    "together), and a pair with a sequence over max_length is left out, not cut (docs/reward.md)",
}


def rl_settings(stage: str):
    """The settings dataclass of a stage that samples completions (imported when asked: torch)."""
    if stage == "rloo":
        from .objectives.rloo import RLOOConfig

        return RLOOConfig
    from .objectives.grpo import GRPOConfig

    return GRPOConfig


def _default(key: str):
    """TrainConfig's default of `key`."""
    return TrainConfig.__dataclass_fields__[key].default


def _stage_keys(cfg, settings) -> dict:
    """The keys of a stage's settings dataclass, from the config; those in STAGE_DEFAULTS left
    to the stage's default when unset."""
    return {
        f.name: getattr(cfg, f.name)
        for f in fields(settings)
        if hasattr(cfg, f.name) and not (f.name in STAGE_DEFAULTS and getattr(cfg, f.name) is None)
    }


PATH_KEYS = (
    "model_name_or_path",
    "model_config",
    "tokenizer_name_or_path",
    "dataset_info",
    "ref_model_name_or_path",
)
DATASET_KEYS = ("dataset", "eval_dataset")  # paths, or names registered in a dataset_info.json


@dataclass
class TrainConfig:
    # --- model
    model_name_or_path: str | None = None
    """Hugging Face model directory (config.json + safetensors, single or sharded), or a Hub
    repository's name (org/name) where no local path has that name: its config, safetensors,
    tokenizer and generation config are fetched to the Hugging Face cache (HF_HOME,
    HF_HUB_OFFLINE and HF_TOKEN apply)."""
    model_revision: str | None = None
    """The Hub revision (branch, tag or commit) of model_name_or_path's repository, and of the
    other keys' where they name the same one; default main. A local directory has none."""
    model_config: str | None = None
    """A config.json (or directory holding one, or a Hub repository's name): train from random
    initialisation."""
    tokenizer_name_or_path: str | None = None
    """Tokenizer directory, tokenizer.json or Hub repository's name; defaults to
    model_name_or_path (pre-tokenised data needs none)."""
    # --- data
    dataset: str | list[str] | None = None
    """JSONL/JSON/Parquet file(s), a directory with dataset_info.json, names in it, or a Hub
    dataset's name (org/name, read by `datasets.load_dataset`: the hub extra) where no local path
    has that name."""
    dataset_config: str | None = None
    """A Hub dataset's configuration (load_dataset's name, TRL's dataset_config); default its
    only or default one."""
    dataset_train_split: str = "train"
    """The split of a Hub dataset that `dataset` reads (TRL's name)."""
    dataset_test_split: str = "test"
    """The split of a Hub dataset that `eval_dataset` reads (TRL's name)."""
    dataset_format: str = "auto"
    """auto, text, tokens (pre-tokenised: ids below the model's vocab_size), messages, sharegpt,
    alpaca, prompt_completion."""
    dataset_info: str | None = None
    """Path of a LlamaFactory-style dataset_info.json registry."""
    columns: dict[str, str] | None = None
    """The dataset's column names where they are not the format's, as LlamaFactory's `columns`:
    field -> column, e.g. {prompt: question, completion: answer}. Fields: text, input_ids,
    labels, prompt, completion, messages, system; alpaca's query, response, history (prompt is
    its instruction). Applies to the files dataset and eval_dataset name directly (a registered
    dataset has its own)."""
    max_length: int = 1024
    """Tokens per sequence (TRL 1.16's default); longer samples are truncated, split or refused (see truncation).
    Beyond the model's max_position_embeddings: a warning (RoPE scaling may extend the context on
    purpose)."""
    packing: bool = False
    """Concatenate samples into full sequences without cross-document attention (FlexAttention on
    CUDA: no sequence x sequence mask)."""
    train_on_prompt: bool = False
    """Also take the loss on system/user turns of chat data."""
    truncation: bool | str = True
    """Samples longer than max_length: true keeps their first max_length tokens, false refuses
    them (an error naming file:line), split trains on all of them in consecutive windows of
    max_length tokens that overlap by one, so every token but a sample's first is a target once
    (chat prompts stay masked; each window is a sample of its own). Plain text with packing is
    always split."""
    shuffle: bool = True
    """Shuffle samples each epoch (seeded); false keeps file order exactly."""
    # --- post-training stage (TRL's names and defaults, 1.16)
    stage: str = "sft"
    """sft (supervised fine-tuning); dpo, kto, orpo or simpo (preference optimisation on TRL's
    preference formats; per_device_train_batch_size then counts pairs, or KTO examples, and
    max_length bounds each sequence); rm (a reward model: TRL 1.16's RewardTrainer on the pairs
    of those formats, each sequence tokenised whole and a pair over max_length left out, a score
    head in place of the LM head, exported as transformers' sequence-classification model); grpo (completions sampled by the policy, scored by
    reward_funcs; per_device_train_batch_size counts completions); rloo (grpo's rollouts, TRL
    1.16's RLOO loss: docs/rloo.md)."""
    beta: float | None = None
    """Preference stages: the implicit reward's temperature (ipo: tau; orpo: lambda), default
    0.1; grpo: the coefficient of the per-token KL term to the reference policy (the initial
    one, or ref_model_name_or_path), default 0; rloo: of the KL penalty in the reward, default
    0.05."""
    loss_type: str | list[str] | None = None
    """dpo: sigmoid (default), hinge, ipo, exo_pair, nca_pair, robust, bco_pair, sppo_hard, aot,
    aot_unpaired, discopop, apo_zero, apo_down, sft, sigmoid_norm, or a list of them summed with
    loss_weights (RPO: [sigmoid, sft]); kto: kto
    (default) or apo_zero_unpaired; simpo: simpo; grpo: dapo (default), grpo, bnpo, dr_grpo."""
    loss_weights: list[float] | None = None
    """dpo: one weight per loss_type in the list (default 1 each)."""
    label_smoothing: float = 0.0
    """dpo/simpo: the probability that a preference label is flipped (robust, aot, simpo); exo_pair's
    epsilon (> 0 there)."""
    discopop_tau: float = 0.05
    """dpo loss_type discopop: its temperature."""
    simpo_gamma: float = 0.5
    """simpo: the target reward margin."""
    cpo_alpha: float = 1.0
    """simpo: weight of the chosen completions' NLL (0: pure SimPO)."""
    desirable_weight: float = 1.0
    """kto: weight of the desirable (label true) examples' losses."""
    undesirable_weight: float = 1.0
    """kto: weight of the undesirable examples' losses."""
    max_prompt_length: int | None = 512
    """grpo, rloo: prompt tokens kept (their last ones); null: all. Not in dpo, kto, orpo, simpo or
    rm (TRL 1.x: max_length alone bounds a sequence)."""
    max_completion_length: int | None = None
    """grpo, rloo: the most tokens a completion is sampled to, default 512 (TRL 1.16). Not in dpo,
    kto, orpo, simpo or rm."""
    truncation_mode: str | None = None
    """dpo, kto, orpo, simpo: what of a prompt + completion over max_length is kept, keep_start
    (the default: TRL 1.16's DPOConfig; kto's, orpo's and simpo's only one, as their TRL 1.16
    trainers) or keep_end (dpo). Not in rm (TRL 1.16's RewardTrainer leaves a pair over
    max_length out)."""
    precompute_ref_log_probs: bool = True
    """dpo/kto: the reference log-probs come from one forward pass over the training and eval data
    before the first step, stored in output_dir/reference/ (a resume reads them). megatrain always
    precomputes (a frozen reference gives the same numbers every step); false is accepted."""
    ref_model_name_or_path: str | None = None
    """dpo/kto, and grpo with beta > 0: the reference model's directory or Hub repository (the
    same architecture); default: the initial policy (model_name_or_path)."""
    num_generations: int | None = None
    """grpo: completions sampled per prompt (a group), default 8 (rloo: 2)."""
    num_generations_eval: int | None = None
    """grpo: completions sampled per eval prompt at an evaluation (1 allowed: its group's std is
    then 0, as in TRL); default num_generations."""
    temperature: float = 1.0
    """grpo: the sampling temperature (the loss divides the logits by it too)."""
    top_p: float = 1.0
    """grpo: nucleus sampling's probability mass."""
    top_k: int | None = None
    """grpo: sample among the k most likely tokens; null or 0: all."""
    use_bias_correction_kl: bool = True
    """grpo with beta > 0: weight each token's KL term by its importance ratio (TRL 1.x's default);
    false: TRL 0.x's unweighted term."""
    epsilon: float = 0.2
    """grpo: the clip's lower bound on the probability ratio (1 - epsilon)."""
    epsilon_high: float | None = None
    """grpo: the clip's upper bound (1 + epsilon_high); default epsilon."""
    scale_rewards: str | bool = "group"
    """grpo: advantages divided by the group's reward std (group), the batch's (batch), or not
    (none)."""
    mask_truncated_completions: bool = False
    """grpo: leave completions cut at max_completion_length out of the loss."""
    num_iterations: int = 1
    """grpo: times each generation batch is trained on, each time over its steps_per_generation
    micro-batches (the ratio's denominator is then the sampling policy's log-probs, stored with
    the rollout)."""
    steps_per_generation: int | None = None
    """grpo: micro-batches of per_device_train_batch_size completions a generation batch is split
    into, as TRL counts them; default gradient_accumulation_steps (one generation batch an
    optimizer step). 2 x gradient_accumulation_steps: one sampling for two optimizer steps; 1:
    gradient_accumulation_steps samplings a step, each of per_device_train_batch_size
    completions (less GPU memory for the rollout). Not with generation_batch_size."""
    generation_batch_size: int | None = None
    """grpo: completions sampled at a time over all processes, a multiple of
    per_device_train_batch_size x processes (TRL's); default per_device_train_batch_size x
    processes x steps_per_generation. Not with steps_per_generation."""
    max_staleness: int = 0
    """grpo: how many optimizer steps the weights that sample a generation batch may lag behind
    those it trains from (TRL's async GRPO's name). 0: none, every batch sampled on-policy. 1: the
    batches a step starts are sampled by the weights the step before started from, so their
    rollout need not wait for that step's host AdamW (it runs while they sample), corrected in the
    loss by the `vllm_importance_sampling_*` keys (docs/grpo.md). More is not built."""
    vllm_importance_sampling_correction: bool = True
    """grpo, max_staleness 1: weight each completion token's policy term by the importance ratio of
    the trainer's log-prob to the stale sampler's (TRL's correction of vLLM's sampler)."""
    vllm_importance_sampling_mode: str = "sequence_mask"
    """grpo, max_staleness 1: the ratio per token or per completion (its log-prob differences
    summed), clipped to [clip_min, clip_max] or set to 0 outside them: token_truncate, token_mask,
    sequence_truncate or sequence_mask (TRL's)."""
    vllm_importance_sampling_clip_max: float | None = 3.0
    """grpo, max_staleness 1: the ratio's upper bound (null: none)."""
    vllm_importance_sampling_clip_min: float | None = None
    """grpo, max_staleness 1: the ratio's lower bound (null: none)."""
    off_policy_mask_threshold: float | None = None
    """grpo: leave out of the loss each completion with a negative advantage whose mean per-token
    KL from the sampling policy to the policy exceeds this (DeepSeek-V3.2's off-policy sequence
    mask, TRL's; null: off)."""
    share_prompts: bool = False
    """grpo, rloo: the update computes each prompt once for the completions of it in the step
    (in one row with them, each completion reading its tokens), not once a completion: at
    128-token prompts and 8 completions of 256, 29% fewer tokens through the layers. The loss
    equals the unshared one to rounding, not to the bit (docs/grpo.md). Not with sliding-window
    attention, a mixture of experts' load-balancing loss or images."""
    rollout_resident_layers: int | str = "auto"
    """grpo: decoder layers the rollout's policy keeps on the GPU in the compute dtype; the others
    are streamed through it in every forward (the prefill and each decode step), the KV cache on
    the GPU. auto: every layer where the update's plan still fits beside the whole policy, else
    the most that leave it one (`megatrain plan` says how many stream); a number keeps that many
    (every layer where it is more)."""
    rollout_engine: str = "megatrain"
    """grpo: what samples the rollouts. megatrain: the rollout engine (one KV cache for the
    generation batch allocated once, a batched prefill of the distinct prompts, each decode step a
    CUDA graph where the whole policy is on the GPU, each completion's tokens drawn on the GPU from
    its own stream). generate: transformers' `generate` (`rollout_cache`). Both sample the same
    streams; docs/grpo.md has the figures."""
    rollout_compile: bool = True
    """grpo, `rollout_engine: megatrain`: the decode step compiled by torch.compile (its small
    kernels fused) before its CUDA graphs are captured, on CUDA with the whole policy on the GPU;
    compiled once a run for every span (about 50 s at the 7B shape; a decode step 7.3 ms instead
    of 10.4, docs/grpo.md). A step that does not compile is sampled eagerly, with a warning."""
    rollout_cache: str = "dynamic"
    """grpo, `rollout_engine: generate`: its KV cache. dynamic: transformers' default, grown a token
    at a time. static: transformers' StaticCache, allocated up front for every completion at its
    batch's prompt width + max_completion_length, with which `generate` compiles the decoding step
    on CUDA (torch.compile, CUDA graphs): the whole policy on the GPU only (not with streamed
    rollout layers), models whose transformers class takes a static cache and compiles."""
    center_rewards_coefficient: float | None = None
    """rm: weight of mean((chosen + rejected)^2) added to the loss, which centres the rewards on
    0 (TRL's RewardConfig; null: none)."""
    reward_funcs: str | list[str] | None = None
    """grpo: reward functions, built in (exact_match, format, length), module:function with
    TRL's signature (prompts, completions, completion_ids and the dataset's columns -> floats or
    None), or a reward model's directory or Hub name (docs/reward.md)."""
    reward_weights: list[float] | None = None
    """grpo: one weight per reward function (default 1 each)."""
    normalize_advantages: bool = False
    """rloo: scale the advantages to mean 0 and std 1 over the generation batch."""
    reward_clip_range: list[float] | None = None
    """rloo: [low, high] each completion's reward is clamped to (before the KL penalty)."""
    # --- schedule
    output_dir: str = "output"
    """Where metrics.jsonl, train_config.json, plan.json, checkpoint-N/ and final/ go; relative to
    the working directory (also in a config file)."""
    overwrite_output_dir: bool = False
    """Start a new run in an output_dir that holds a previous run's outputs (refused otherwise).
    Nothing is deleted: its checkpoints stay (this run never prunes them; one of a step this run
    saves is replaced, as the run says when it starts), metrics.jsonl, train_config.json (and
    grpo's completions.jsonl, eval_completions.jsonl) are renamed aside, its final/ is replaced at
    the end. (transformers 5 dropped this key; megatrain
    keeps it.)"""
    max_steps: int = -1
    """Optimizer steps; overrides num_train_epochs when > 0."""
    num_train_epochs: float = 1.0
    """Epochs to train when max_steps is -1 (fractions allowed)."""
    per_device_train_batch_size: int = 1
    """Sequences per micro-batch."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step; all of them pass a layer in one visit."""
    learning_rate: float | None = None
    """Peak learning rate of AdamW. Default: the stage's in TRL 1.16, 2e-5 for sft, 1e-4 for rm,
    1e-6 for the others (dpo, kto, orpo, simpo, grpo, rloo)."""
    weight_decay: float = 0.0
    """Decoupled weight decay; never applied to biases and norm weights."""
    adam_beta1: float = 0.9
    """AdamW beta1."""
    adam_beta2: float = 0.999
    """AdamW beta2."""
    adam_epsilon: float = 1e-8
    """AdamW epsilon."""
    optim: str = "adamw_torch"
    """How AdamW stores its moments, by Hugging Face's names: adamw_torch or adamw_torch_fused (fp32,
    torch's AdamW, 12 bytes of state a parameter with the fp32 master), adamw_8bit, adamw_bnb_8bit
    or paged_adamw_8bit (bitsandbytes' 8-bit blockwise moments, ~6.03 bytes), adamw_anyprecision
    (the moments' dtypes in optim_args: bfloat16 for both, 8 bytes); paged_adamw_32bit is fp32.
    The master weights stay exact fp32 in every mode; a resume keeps the mode it saved in
    (docs/memory.md)."""
    optim_args: str | None = None
    """adamw_anyprecision's "key=value,key=value" (Hugging Face's form): momentum_dtype and
    variance_dtype, float32 (the default) or bfloat16; use_kahan_summation false."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this; 0 disables clipping."""
    lr_scheduler_type: str = "linear"
    """constant, constant_with_warmup, linear or cosine (transformers' semantics)."""
    warmup_steps: int | float = 0
    """Linear warmup: a whole number of steps, or a fraction (< 1) of all steps, as in
    transformers 5 (overrides warmup_ratio when > 0)."""
    warmup_ratio: float = 0.0
    """Warmup as a fraction of all steps (transformers 4's name: warmup_steps below 1 says the same)."""
    seed: int = 42
    """Seeds random init, shuffling and everything else (0 <= seed < 2**32)."""
    # --- logging and checkpoints
    logging_steps: int | float = 10
    """Print a log line every N steps (TRL 1.16's default: 10), or every such fraction (< 1) of the
    run, when there is no progress bar (metrics.jsonl gets every step)."""
    report_to: str | list[str] = "none"
    """Experiment trackers: none, all (every one installed), or one or a list of tensorboard,
    wandb, mlflow, trackio (YAML's false/no/off read as none)."""
    profile_steps: int | list[int] | None = None
    """Steps to trace with torch.profiler (each step's rollout, scoring and update):
    output_dir/profile/step-N.json.gz (a Chrome trace: Perfetto, chrome://tracing) and step-N.txt
    (the ops and kernels by device time). The profiler slows the steps it traces."""
    run_name: str | None = None
    """The run's name in the experiment trackers (default: its run id, which checkpoints carry)."""
    project: str | None = None
    """The trackers' project (W&B project, MLflow experiment, Trackio project); default
    WANDB_PROJECT or MLFLOW_EXPERIMENT_NAME where set, else megatrain."""
    save_strategy: str = "steps"
    """When to save checkpoints: steps (every save_steps), epoch (at the end of each epoch) or
    no (none; a stopped run still saves; YAML's no/false: no). With steps or epoch the last step
    is saved too."""
    save_steps: int | float = 0
    """With save_strategy steps: every N steps, or a fraction < 1 of all steps (0: only the last)."""
    save_only_model: bool = False
    """Checkpoints hold the fp32 weights only (4 bytes per parameter, not 12 with fp32 moments); they cannot
    be resumed. A checkpoint saved on SIGTERM/SIGINT is always complete."""
    save_total_limit: int | None = None
    """Keep only this run's newest N checkpoint-* directories (None: keep all); the best one
    (metric_for_best_model) is never deleted, nor another run's."""
    save_dtype: str = "bfloat16"
    """dtype of the exported Hugging Face weights: bfloat16 or float32."""
    save_final_model: bool = True
    """Export the model to output_dir/final after the last step (false: the checkpoints, if any,
    hold the run's weights; for a disk with room for the checkpoints or a disk tier but not for
    another copy of the model, and for benchmarks)."""
    resume_from_checkpoint: str | bool | None = None
    """true: continue from the newest checkpoint of the run that saved last in output_dir; a path:
    from that checkpoint. Resume is exact. Settings changed since the checkpoint are named in a
    warning; another model, dataset or stage is refused (see resume_with_changes)."""
    resume_with_changes: bool = False
    """Resume even where model_name_or_path, model_config, dataset or stage differ from the
    checkpoint's run (its train_config.json): its weights, optimizer state and step continue on
    the new settings, which is then no longer an exact resume."""
    max_shard_size: str | int = "5GB"
    """Largest safetensors file in checkpoints and exports: bytes, or "500MB", "5GB", "2GiB"."""
    disable_tqdm: bool | None = None
    """Progress bar on a terminal (None), always off (true) or on (false)."""
    max_consecutive_nonfinite: int = 3
    """Steps with a non-finite loss or gradient norm are skipped; stop after this many in a row."""
    preflight_check: bool = True
    """Refuse a run that the memory estimate (`megatrain plan`) or the free disk space says cannot
    fit (false: warn). Disk: the checkpoints that coexist (save_total_limit + 1 while one is
    written, 12 bytes per parameter each with fp32 moments, ~6 with adamw_8bit's) plus final/ in save_dtype."""
    # --- mixture of experts: the model config's keys, as transformers names them
    output_router_logits: bool | None = None
    """MoE models: add router_aux_loss_coef x the load-balancing loss to the loss (default: the
    model's config.json, false on the Hub's). Refused for DeepSeek, which has no such loss in
    transformers."""
    router_aux_loss_coef: float | None = None
    """MoE models: weight of the load-balancing loss (default: the model's config.json). Both keys
    are saved in the checkpoints' and final/'s config.json."""
    # --- vision-language models: LlamaFactory's keys
    freeze_vision_tower: bool = True
    """Vision-language models: keep the vision tower as loaded, never stepped (false: train it with
    the language model, its weights and AdamW moments in host memory like theirs). Qwen3-VL's
    tower holds its position grid and DeepStack mergers too, as LlamaFactory's does."""
    freeze_multi_modal_projector: bool = True
    """Vision-language models: keep the multi-modal projector (LLaVA's `multi_modal_projector`,
    Idefics3's `connector`, Qwen2-VL's `visual.merger`) as loaded (false: train it)."""
    # --- evaluation
    eval_dataset: str | list[str] | None = None
    """Held-out data in any form `dataset` takes (same format, chat handling and packing); grpo:
    prompts, each sampled num_generations_eval times and scored (eval_reward, ...), and TRL's loss
    of those completions (eval_loss, eval_entropy, ...)."""
    eval_strategy: str | None = None
    """no, steps or epoch; default: steps when eval_dataset is set, else no (YAML's no/false: no)."""
    eval_steps: int | float | None = None
    """Steps between evaluations, or a fraction (< 1) of the run; default: save_steps when set,
    else 0.1. The last step is always evaluated."""
    eval_on_start: bool = False
    """Also evaluate before the first step (a baseline; not repeated on resume)."""
    per_device_eval_batch_size: int | None = None
    """Sequences per evaluation micro-batch (grpo: completions sampled at a time); default:
    per_device_train_batch_size."""
    load_best_model_at_end: bool = False
    """Export final/ from the checkpoint with the best metric_for_best_model (its checksums
    verified first). Needs save_strategy equal to eval_strategy and, with steps, save_steps a
    multiple of eval_steps."""
    metric_for_best_model: str | None = None
    """eval_loss (or loss; grpo also eval_reward or reward): track best_metric and
    best_model_checkpoint, which save_total_limit never deletes; default eval_loss (grpo:
    eval_reward) with load_best_model_at_end."""
    greater_is_better: bool | None = None
    """Whether a larger metric is better; default: false for a loss (transformers' rule)."""
    # --- hardware
    device: str = "auto"
    """auto, cpu, cuda, cuda:N."""
    compute_dtype: str = "auto"
    """auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float32."""
    torch_compile: bool | None = None
    """Compile the decoder layer with torch.compile; default: on for CUDA, off on the CPU."""
    full_determinism: bool = False
    """Bitwise repeatable runs on a GPU too: PyTorch's strict deterministic mode (the attention
    backward's deterministic algorithm, cuDNN's attention left out) and cuBLAS's
    CUBLAS_WORKSPACE_CONFIG (set to :4096:8 unless given). On the CPU runs repeat without it
    (docs/training.md)."""
    offload_activations: bool | None = None
    """Layer-boundary activations in host memory: true (all), false (none), or None (auto: on the
    GPU as far as it holds them, the leading layers' beyond that in host memory)."""
    mlp_tile_tokens: int | None = None
    """Tokens per tile of the decoder layer's MLP, computed over the sequence a tile at a time so
    its intermediates never exist for the whole sequence: 0 never tiles; default (None): the plan
    tiles only where one layer's untiled working set does not fit, as large as fits."""
    gpu_state: str = "auto"
    """auto: GPU memory the streaming leaves free holds the leading layers' fp32 state (stepped
    there), the last layers' graphs and gradients, where the plan says it pays; off: the GPU
    holds only the streaming working set (all state and gradients in host memory). YAML's
    unquoted off/false/no are read as off, on/true/yes as auto."""
    gradient_placement: str = "auto"
    """Where gradients wait for the clip norm: auto (the plan decides), gpu, host, or two_pass (a
    norm-only backward, then one that steps each layer as it lands: no storage, more compute)."""
    gpu_step_units: int | str = 0
    """Units (embedding, layers, head, in forward order after any GPU-resident ones) whose fp32
    state, kept in host memory, is copied to the GPU, stepped there and copied back at each step,
    beside the CPU optimizer stepping the rest; their gradients wait on the GPU. 0: none; auto:
    the fewest the plan's cost model puts within 2% of its fastest count that leaves the allocator
    12 GiB (15% of a smaller card) free, where gradients are held for the clip (none with several
    processes, on the CPU, or in a two-pass or immediate step), with the last layers' graphs kept
    from the forward sweep where that saves 1% of the step and fits under the stepped units' GPU
    peak. CUDA, one process. Opt-in: it spends GPU memory that `gpu_state: off` otherwise leaves
    free."""
    embedding_rows: bool | None = None
    """Step the embedding's table in host memory and fetch only the rows a step looks up: the
    host optimizer computes those rows first, so the next forward sweep can start, and the whole
    table later, in the backward sweep, where it otherwise idles; the same numbers (docs/memory.md).
    Default (auto): where `gpu_step_units: auto` plans and the cost model puts it 1% faster; true:
    always (CUDA, one process, untied embeddings, gradients held for the clip); false: never."""
    update_order: str = "auto"
    """How the update visits layers and micro-batches. layer: each layer passes every micro-batch
    in one visit, the layers whose graphs are not kept recomputed in the backward; micro_batch:
    each micro-batch's forward, loss and backward through every layer in turn, every layer's graph
    of it kept, nothing recomputed (every unit's state on the GPU, one process; the same numbers to
    the bit). auto: micro_batch where the plan holds every unit on the GPU with those graphs beside
    it and its cost model puts it faster (a step of several micro-batches, `gpu_state: auto`)."""
    max_gpu_memory: str | int | None = None
    """GPU memory the run may use, e.g. "70GiB" (default: what is free on the card at start); the
    plan keeps 3% of it free for the allocator."""
    max_host_memory: str | int | None = None
    """Host memory the run may use, e.g. "1.5TB" (default: MemAvailable at start); the plan keeps
    5% of it free for the kernel and the driver."""
    offload_dir: str | list[str] | None = None
    """A local disk's folder (DeepSpeed's `nvme_path`) for the disk tier: where host memory cannot
    hold the state, the plan puts the AdamW moments of the fewest last units that make the run fit
    there, in a file that never has a name in it (scratch: nothing is left behind, and a resume
    rebuilds it from its checkpoint), read and written with O_DIRECT where its file system takes
    it. Several drives: a list of folders, one per drive (two on one file system are refused), or
    one string of comma-separated folders (`offload_dir=/nvme0/t,/nvme1/t` on the command line; a
    folder whose name holds a comma only in a list); the tier's blocks are striped over them
    round-robin. Relative to the working directory. One process per machine for now."""
    max_disk_memory: str | int | None = None
    """Disk the tier may take in offload_dir, e.g. "500GB", in all its folders together (default:
    the free space at start; with several folders, their number x the least free in one)."""
    nproc_per_node: int = 1
    """Data parallel over this many processes (GPUs) per machine, started by `megatrain train`
    itself, one copy of the host state for all of a machine's; the global batch is
    per_device_train_batch_size x gradient_accumulation_steps x processes. Under torchrun the
    world is torchrun's."""
    nnodes: int | None = None
    """Machines of a data-parallel world, each running nproc_per_node processes and holding in
    host memory only its processes' part of the fp32 state (the state partitioned, the traffic
    sharded). Default: torchrun's machines, else 1. A larger number simulates machines: with
    `megatrain train` on one machine, nnodes x nproc_per_node processes as nnodes machines (under
    torchrun, a multiple of its machines). `megatrain plan` plans one machine's part."""
    ddp_traffic: str = "auto"
    """plain: every process copies whole units to its GPU and gradients are all-reduced; sharded:
    each copies 1/N of every unit and the N processes all-gather the rest on their GPUs,
    gradients are reduce-scattered (each receives its 1/N); auto: plain on one machine, sharded
    when the state is partitioned over machines (plain cannot be)."""
    ddp_timeout: int = 1800
    """Seconds a rank waits for the others at a collective before stopping with an error."""
    extra: dict[str, Any] = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.learning_rate is None:  # a number from here on: what a run and its checkpoints record
            self.learning_rate = STAGE_LEARNING_RATES.get(self.stage, 1e-6)
        self.validate()
        self._validate_eval()
        self._validate_stage()  # last: its owners import torch, which the checks above never wait for

    def validate(self) -> None:
        def bad(key, why):
            raise ConfigError(f"{key}: {why} (got {getattr(self, key)!r})")

        for f in fields(self):
            # NaN passes every comparison below, and no float key has a meaning for infinity.
            if isinstance(getattr(self, f.name), float) and not math.isfinite(getattr(self, f.name)):
                bad(f.name, "must be a finite number")
        if (self.model_name_or_path is None) == (self.model_config is None):
            raise ConfigError("set exactly one of model_name_or_path (weights) or model_config (random init)")
        for k in (
            "max_length",
            "per_device_train_batch_size",
            "gradient_accumulation_steps",
            "nproc_per_node",
            "ddp_timeout",
        ):
            if getattr(self, k) < 1:
                bad(k, "must be >= 1")
        if self.max_steps == 0 or self.max_steps < -1:
            bad("max_steps", "must be > 0, or -1 to use num_train_epochs")
        if self.num_train_epochs <= 0:
            bad("num_train_epochs", "must be > 0")
        if self.learning_rate < 0:
            bad("learning_rate", "must be >= 0")
        if self.weight_decay < 0:
            bad("weight_decay", "must be >= 0")
        for k in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, k) < 1.0:
                bad(k, "must be in [0, 1)")
        if self.adam_epsilon <= 0:
            bad("adam_epsilon", "must be > 0")
        self.moments()  # optim and optim_args name a format
        if self.router_aux_loss_coef is not None and self.router_aux_loss_coef < 0:
            bad("router_aux_loss_coef", "must be >= 0")
        if self.max_grad_norm < 0:
            bad("max_grad_norm", "must be >= 0 (0 disables clipping)")
        if self.lr_scheduler_type not in SCHEDULES:
            bad("lr_scheduler_type", f"must be one of {', '.join(SCHEDULES)}")
        if not 0 <= self.seed < SEED_LIMIT:
            bad("seed", "must be in [0, 2**32)")
        self.warmup_steps = _steps_or_fraction(self, "warmup_steps", zero=True)
        self.logging_steps = _steps_or_fraction(self, "logging_steps", zero=False)
        if not 0.0 <= self.warmup_ratio < 1.0:
            bad("warmup_ratio", "must be in [0, 1)")
        if isinstance(self.truncation, str) and self.truncation != SPLIT:
            bad("truncation", "must be true (cut), false (refuse) or split (windows)")
        if self.truncation == SPLIT and self.max_length < 2:
            bad("max_length", "must be >= 2 with truncation: split (a window holds a token and its target)")
        if self.dataset_format not in DATASET_FORMATS:
            bad("dataset_format", f"must be one of {', '.join(DATASET_FORMATS)}")
        for k, v in (self.columns or {}).items():
            if k not in COLUMN_FIELDS:
                bad("columns", f"{k!r} is not a field (fields: {', '.join(COLUMN_FIELDS)})")
            if not isinstance(v, str):
                bad("columns", f"{k}'s column must be a name, got {v!r}")
        self.report_to = reporters(self.report_to)
        self.profile_steps = _profile_steps(self)
        if self.save_strategy not in SAVE_STRATEGIES:
            bad("save_strategy", f"must be one of {', '.join(SAVE_STRATEGIES)}")
        self.save_steps = _steps_or_fraction(self, "save_steps", zero=True)
        if self.save_total_limit is not None and self.save_total_limit < 1:
            bad("save_total_limit", "must be >= 1")
        if self.save_dtype not in ("bfloat16", "float32"):
            bad("save_dtype", "must be bfloat16 or float32")
        try:
            parse_size(self.max_shard_size)
        except ValueError as e:
            bad("max_shard_size", str(e))
        if self.max_consecutive_nonfinite < 1:
            bad("max_consecutive_nonfinite", "must be >= 1")
        if isinstance(self.resume_from_checkpoint, str) and not self.resume_from_checkpoint.strip():
            bad("resume_from_checkpoint", "must be true, false or a checkpoint directory")
        if self.mlp_tile_tokens is not None and self.mlp_tile_tokens < 0:
            bad("mlp_tile_tokens", "must be a number of tokens >= 0 (0: never tile)")
        if self.gpu_state not in ("auto", "off"):
            bad("gpu_state", "must be auto or off")
        if self.gradient_placement not in ("auto", "gpu", "host", "two_pass"):
            bad("gradient_placement", "must be auto, gpu, host or two_pass")
        if self.update_order not in ("auto", "layer", "micro_batch"):
            bad("update_order", "must be auto, layer or micro_batch")
        if self.gpu_step_units != "auto" and (
            isinstance(self.gpu_step_units, str) or self.gpu_step_units < 0
        ):
            bad("gpu_step_units", "must be auto or a number of units >= 0 (0: none)")
        if self.rollout_resident_layers != "auto" and (
            isinstance(self.rollout_resident_layers, str) or self.rollout_resident_layers < 0
        ):
            bad("rollout_resident_layers", "must be auto or a number of layers >= 0")
        for k in ("max_gpu_memory", "max_host_memory", "max_disk_memory"):
            if getattr(self, k) is not None:
                try:
                    parse_size(getattr(self, k))
                except ValueError as e:
                    bad(k, str(e))
        if self.compute_dtype not in ("auto", "bfloat16", "float32"):
            bad("compute_dtype", "must be auto, bfloat16 or float32")
        if self.nnodes is not None and self.nnodes < 1:
            bad("nnodes", "must be >= 1")
        self.world()  # a ddp_traffic that the machines cannot have is refused now
        if self.offload_dir is not None and self.world().ranks > 1:
            bad(
                "offload_dir",
                "the disk tier is built for one process per machine (nproc_per_node 1, one machine)",
            )
        folders = self.offload_dirs()
        if self.offload_dir is not None and not (folders and all(d.strip() for d in folders)):
            bad("offload_dir", "expected a folder, or several: a list or comma-separated, none empty")
        where = [os.path.abspath(d) for d in folders]
        for i, d in enumerate(where):
            if d in where[:i]:
                bad("offload_dir", f"{folders[i]} is given twice: give each drive's folder once")
        if self.embedding_rows is not None and not isinstance(self.embedding_rows, bool):
            bad("embedding_rows", "must be true, false or auto")
        if self.embedding_rows and self.world().ranks > 1:
            bad("embedding_rows", "is built for one process (nproc_per_node 1, one machine); set it false")
        if self.max_disk_memory is not None and self.offload_dir is None:
            bad("max_disk_memory", "needs offload_dir (the folder the disk tier goes to)")

    def _validate_stage(self) -> None:
        """The stage and its keys, checked by their owners (objectives/, rl/), which import torch:
        a default value (an sft run's) needs none of them."""
        default = {f.name: f.default for f in fields(self)}
        if self.stage != default["stage"]:
            from .objectives.preference import STAGES

            if self.stage not in ("sft", *RL_STAGES, "rm", *STAGES):
                raise ConfigError(
                    f"stage: must be sft, grpo, rloo, rm or one of {', '.join(STAGES)} (got {self.stage!r})"
                )
        for key, (stage, why) in STAGE_ONLY.items():
            if self.stage in RL_STAGES and self.stage != stage and getattr(self, key) != default[key]:
                raise ConfigError(
                    f"{key}: is stage {stage}'s, not in TRL's trainer of stage {self.stage}: {why} "
                    f"(got {getattr(self, key)!r})"
                )
        if (self.rollout_engine, self.rollout_cache) != (default["rollout_engine"], default["rollout_cache"]):
            from .rl.rollout import ROLLOUT_CACHES, ROLLOUT_ENGINES

            if self.rollout_engine not in ROLLOUT_ENGINES:
                raise ConfigError(
                    f"rollout_engine: must be one of {', '.join(ROLLOUT_ENGINES)} (got {self.rollout_engine!r})"
                )
            if self.rollout_cache not in ROLLOUT_CACHES:
                raise ConfigError(
                    f"rollout_cache: must be one of {', '.join(ROLLOUT_CACHES)} (got {self.rollout_cache!r})"
                )
            if self.rollout_cache != "dynamic" and self.rollout_engine != "generate":
                raise ConfigError(
                    "rollout_cache: is the KV cache of rollout_engine: generate (the megatrain engine has its own)"
                )
        if self.stage != default["stage"]:
            from .objectives.preference import TOKENISATION

            why = WHY_DROPPED.get(TOKENISATION.get(self.stage, self.stage))
            for key in (DROPPED_BY_REWARD if self.stage == "rm" else DROPPED_BY_TRL1) if why else ():
                if getattr(self, key) != default[key]:
                    raise ConfigError(f"{key}: not in stage {self.stage}: {why} (got {getattr(self, key)!r})")
        if self.share_prompts and self.stage not in RL_STAGES:
            raise ConfigError(f"share_prompts: shares the prompts of sampled completions (stage grpo or rloo), "
                              f"not stage {self.stage}'s rows")  # fmt: skip
        self.preference()  # the preference keys, checked by their owner
        self.grpo()

    def moments(self) -> moment_formats.Moments:
        """How AdamW stores its moments, as optim and optim_args say (host/moments.py)."""
        return moment_formats.resolve(self.optim, self.optim_args)

    def offload_dirs(self) -> list[str]:
        """offload_dir's folders, one per drive: a list as given, a string cut at its commas
        (none: no disk tier)."""
        if isinstance(self.offload_dir, str):
            return [d.strip() for d in self.offload_dir.split(",")]
        return list(self.offload_dir or [])

    def preference(self) -> PreferenceConfig | RewardConfig | None:
        """The settings of a stage that trains on preference data (rm's: RewardConfig); None for
        sft, grpo and rloo."""
        if self.stage == "sft" or self.stage in RL_STAGES:
            return None
        from .objectives.preference import PreferenceConfig
        from .objectives.reward import RewardConfig

        settings = RewardConfig if self.stage == "rm" else PreferenceConfig
        return settings(**_stage_keys(self, settings))

    def grpo(self, processes: int | None = None) -> GRPOConfig | None:
        """The rollout stage's settings (grpo's GRPOConfig, rloo's RLOOConfig, one) for a world
        of `processes` (default: the world these settings describe; under torchrun, pass the
        run's); None for the other stages."""
        if self.stage not in RL_STAGES:
            return None
        settings = rl_settings(self.stage)
        return settings(**_stage_keys(self, settings), processes=processes or self.world().ranks)

    def world(self):
        """The data-parallel world these settings describe: nnodes machines (1 unless set) of
        nproc_per_node processes (layout.Layout; under torchrun the world is torchrun's)."""
        from .parallel.layout import resolve

        machines = self.nnodes or 1
        return resolve(self.ddp_traffic, self.nproc_per_node * machines, machines)

    def require_dataset(self) -> None:
        """Training needs data (planning does not)."""
        if self.dataset is None:
            raise ConfigError("dataset: required (a JSONL/JSON/Parquet file or a dataset_info.json name)")

    def _validate_eval(self) -> None:
        """The evaluation keys, with their derived defaults; transformers' rules for
        load_best_model_at_end (checkpoints must be evaluated ones)."""

        def bad(key, why):
            raise ConfigError(f"{key}: {why} (got {getattr(self, key)!r})")

        if self.eval_strategy is None:
            self.eval_strategy = "steps" if self.eval_dataset else "no"
        if self.eval_strategy not in EVAL_STRATEGIES:
            bad("eval_strategy", f"must be one of {', '.join(EVAL_STRATEGIES)}")
        evaluating = self.eval_strategy != "no"
        if evaluating and not self.eval_dataset:
            bad("eval_strategy", "needs an eval_dataset to evaluate on")
        if self.eval_strategy == "steps" and self.eval_steps is None:
            self.eval_steps = self.save_steps if self.save_steps > 0 else 0.1
        if self.eval_steps is not None:
            self.eval_steps = _steps_or_fraction(self, "eval_steps", zero=False)
        if self.per_device_eval_batch_size is None:
            self.per_device_eval_batch_size = self.per_device_train_batch_size
        if self.per_device_eval_batch_size < 1:
            bad("per_device_eval_batch_size", "must be >= 1")
        if self.load_best_model_at_end and not self.save_final_model:
            raise ConfigError(
                "load_best_model_at_end: exports the best checkpoint's weights; needs save_final_model"
            )
        if self.load_best_model_at_end and (why := self._best_model_schedule_problem()):
            raise ConfigError(f"load_best_model_at_end: {why}")
        # grpo's evaluation samples and scores (TRL's eval_reward, the default), then takes the
        # loss of what it sampled; the other stages' take a loss.
        computed = ("reward", "loss") if self.stage in RL_STAGES else ("loss",)
        if self.load_best_model_at_end and self.metric_for_best_model is None:
            self.metric_for_best_model = f"eval_{computed[0]}"
        if self.metric_for_best_model is not None:
            if self.metric_for_best_model not in [f"eval_{c}" for c in computed] + list(computed):
                stage = (
                    f"s evaluation computes with stage {self.stage}"
                    if self.stage in RL_STAGES
                    else " evaluation computes"
                )
                names = " or ".join(f"eval_{c}" for c in computed)
                bad("metric_for_best_model", f"must be {names} (the metric{stage})")
            if not evaluating:
                bad("metric_for_best_model", "needs evaluation (set eval_dataset)")
            if self.greater_is_better is None:
                self.greater_is_better = not self.metric_for_best_model.endswith("loss")

    def _best_model_schedule_problem(self) -> str | None:
        """Why load_best_model_at_end cannot work with these schedules, if it cannot. As in
        transformers, every checkpoint must be an evaluated one: save_strategy is eval_strategy,
        and with steps the saves are a subset of the evaluations. (Per epoch both happen at the
        end of every epoch and after the last step.)"""
        if self.eval_strategy == "no":
            return "needs evaluation (set eval_dataset)"
        if self.save_strategy != self.eval_strategy:
            return (
                f"needs save_strategy and eval_strategy to be the same (got {self.save_strategy} and "
                f"{self.eval_strategy}): every checkpoint must be an evaluated one"
            )
        if self.eval_strategy == "epoch":
            return None
        if self.save_steps == 0:
            return f"needs save_steps, a round multiple of eval_steps ({self.eval_steps})"
        if self.eval_steps < 1 or self.save_steps < 1:
            return (
                f"needs save_steps and eval_steps in steps, not fractions ({self.save_steps}, "
                f"{self.eval_steps}), to line up"
            )
        if self.save_steps % self.eval_steps:
            return f"save_steps {self.save_steps} must be a round multiple of eval_steps {self.eval_steps}"
        return None

    # ----------------------------------------------------------------- loading
    @classmethod
    def load(cls, path: str | Path | None, overrides: list[str] = ()) -> TrainConfig:
        """Read a YAML config and apply `key=value` overrides (values parsed as YAML)."""
        raw: dict[str, Any] = {}
        if path is not None:
            p = Path(path)
            if not p.is_file():
                raise ConfigError(f"{p}: config file does not exist")
            try:
                raw = yaml.load(p.read_text(), Loader=_StrictLoader) or {}
            except yaml.YAMLError as e:
                raise ConfigError(_yaml_error(p, e)) from None
            if not isinstance(raw, dict):
                raise ConfigError(f"{p}: expected a mapping of key: value at the top level")
            _resolve_paths(raw, p.parent)
        given: dict[str, str] = {}
        for ov in overrides:
            if "=" not in ov:
                raise ConfigError(f"override {ov!r}: expected key=value")
            k, v = ov.split("=", 1)
            k = k.strip()
            if k in given:  # as a key given twice in the YAML file is: which one was meant?
                raise ConfigError(f"override {k}: given twice ({given[k]!r} and {ov!r}); give it once")
            given[k] = ov
            try:
                raw[k] = yaml.load(v, Loader=_StrictLoader) if v != "" else None
            except yaml.YAMLError:
                raw[k] = v
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainConfig:
        known = {f.name: f for f in fields(cls) if f.name != "extra"}
        unknown = [k for k in raw if k not in known]
        retired = [k for k in unknown if k in RETIRED]
        if retired:
            raise ConfigError("; ".join(f"config key {k!r} is retired: {RETIRED[k]}" for k in retired))
        not_taken = [k for k in unknown if k in NOT_TAKEN]
        if len(not_taken) == 1:
            k = not_taken[0]
            raise ConfigError(f"config key {k!r} (Hugging Face's) is not taken: {NOT_TAKEN[k]}")
        if not_taken:
            why = "; ".join(f"{k!r}: {NOT_TAKEN[k]}" for k in not_taken)
            raise ConfigError(
                f"config keys of Hugging Face's that megatrain does not take (remove them): {why}"
            )
        if unknown:
            import difflib

            k = unknown[0]
            close = difflib.get_close_matches(k, known, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key {k!r}{hint}")
        hints = typing.get_type_hints(cls)
        kwargs = {
            k: _coerce(k, BOOLEAN_CHOICES.get(k, {}).get(v, v) if isinstance(v, bool) else v, hints[k])
            for k, v in raw.items()
        }
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        d.pop("extra", None)
        return d


def warmup_of(cfg: TrainConfig, total_steps: int) -> int:
    """The warmup of a run of `total_steps`: warmup_steps (steps, or a fraction of the run) when
    it is > 0, else warmup_ratio's share of the run."""
    from .io.outputs import interval_steps

    return interval_steps(cfg.warmup_steps or cfg.warmup_ratio, total_steps)


def _steps_or_fraction(cfg: TrainConfig, key: str, zero: bool) -> int | float:
    """`key`'s value checked as transformers 5 reads these keys: a whole number of steps (an int,
    even when written 10.0) or a fraction of the run below 1; 0 only where `zero` allows it."""
    value = getattr(cfg, key)
    low = "0" if zero else "1"
    if not ((0 <= value < 1 and (zero or value > 0)) or (value >= 1 and float(value).is_integer())):
        raise ConfigError(
            f"{key}: must be a whole number of steps >= {low}, or a fraction of the run in "
            f"{'[0' if zero else '(0'}, 1) (got {value!r})"
        )
    return int(value) if value >= 1 or value == 0 else value


def _profile_steps(cfg: TrainConfig) -> list[int]:
    """profile_steps as a sorted list of step numbers >= 1 (one number or a list of them)."""
    value = cfg.profile_steps
    steps = [] if value is None else [value] if not isinstance(value, list) else value
    if any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in steps):
        raise ConfigError(f"profile_steps: must be a step number >= 1 or a list of them (got {value!r})")
    return sorted(set(steps))


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGT])(i?))?B?\s*$", re.IGNORECASE)


def parse_size(value: str | int) -> int:
    """Bytes from an int or a size string as Hugging Face writes them ("5GB" = 5e9 bytes,
    "2GiB" = 2 * 2**30); raises ValueError for anything else or a size < 1 byte."""
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    else:
        m = _SIZE.match(str(value))
        if not m:
            raise ValueError("expected bytes or a size such as 500MB, 5GB or 2GiB")
        num, unit, binary = m.groups()
        power = "KMGT".find(unit.upper()) + 1 if unit else 0
        n = int(float(num) * (1024 if binary else 1000) ** power)
    if n < 1:
        raise ValueError("must be at least 1 byte")
    return n


def _resolve_paths(raw: dict[str, Any], base: Path) -> None:
    """Resolve the input paths a config file in directory `base` holds (see the module docstring).
    A dataset key's entries one by one: a list, or one string of comma-separated entries."""
    for k in PATH_KEYS + ("resume_from_checkpoint",):
        if isinstance(raw.get(k), str):
            raw[k] = _relative(raw[k], base)
    for k in DATASET_KEYS:
        value = raw.get(k)
        if isinstance(value, str) and "," in value and not _beside(value, base):
            value = [e.strip() for e in value.split(",") if e.strip()]  # as resolve_dataset splits it
        if isinstance(value, str):
            raw[k] = _relative(value, base, dataset=True)
        elif isinstance(value, list):
            raw[k] = [_relative(d, base, dataset=True) if isinstance(d, str) else d for d in value]


def _relative(value: str, base: Path, dataset: bool = False) -> str:
    """A path written in a config file in directory `base`: beside the file where it is there,
    else from the working directory where it is there, else as written (an error will name it)."""
    found = _beside(value, base, dataset)
    return str(found) if found is not None else value


def _beside(value: str, base: Path, dataset: bool = False) -> Path | None:
    """Where `value` leads from the config file's directory `base`, or from the working
    directory: the first of the two where something is (for a dataset, also a name registered
    in the dataset_info.json of the directory it names); None where neither has anything."""
    p = Path(value)
    for candidate in (p,) if p.is_absolute() else (base / p, p):
        registry = candidate.parent / "dataset_info.json"
        if candidate.exists() or (dataset and value != p.name and registry.is_file()):
            return candidate
    return None


def _coerce(key: str, value: Any, tp) -> Any:
    """Check `value` against the field's annotation; ints are accepted for floats."""
    options = (
        typing.get_args(tp)
        if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union
        else (tp,)
    )
    if value is None or (value == "auto" and set(options) == {bool, type(None)}):
        # The README's "auto" for true/false/None keys (torch_compile, disable_tqdm...) is None.
        if type(None) in options:
            return None
        raise ConfigError(f"{key}: a value is required")
    for opt in options:
        origin = typing.get_origin(opt) or opt
        if opt is type(None):
            continue
        if origin is bool and isinstance(value, bool):
            return value
        if origin is int and isinstance(value, int) and not isinstance(value, bool):
            return value
        if origin is float and isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise ConfigError(f"{key}: too large for a float") from None
        if origin in (int, float) and isinstance(value, str):
            # YAML 1.1 reads `3e-3` (no dot) as a string; accept what Python reads as a number.
            try:
                return origin(value)
            except ValueError:
                pass
        if origin is str and isinstance(value, str):
            return value
        if origin is list and isinstance(value, list):
            (item,) = typing.get_args(opt) or (str,)
            try:
                return [_coerce(f"{key}[{i}]", x, item) for i, x in enumerate(value)]
            except ConfigError:
                if sum(o is not type(None) for o in options) == 1:  # the item is the problem
                    raise
        if origin is dict and isinstance(value, dict):
            return value
    names = " or ".join(getattr(o, "__name__", str(o)) for o in options if o is not type(None))
    hint = ""
    if isinstance(value, bool) and str in options:
        hint = " (YAML reads unquoted yes/no/on/off/true/false as booleans: quote the value)"
    raise ConfigError(f"{key}: expected {names}, got {value!r}{hint}")


class _StrictLoader(yaml.SafeLoader):
    """yaml.safe_load, but a key given twice in one mapping is an error, not "last one wins"."""

    def construct_mapping(self, node, deep=False):
        seen: dict = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue  # `<<: *base` may override keys on purpose
            key = self.construct_object(key_node, deep=True)
            try:
                first = seen.get(key)
            except TypeError:
                continue  # an unhashable key: SafeLoader refuses it with its own message
            if first is not None:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r} (first on line {first + 1})", key_node.start_mark
                )
            seen[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def _yaml_error(path: Path, e: yaml.YAMLError) -> str:
    """One line: path:line:column of the problem, what is wrong, and the construct it is in."""
    mark = getattr(e, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark else str(path)
    what = getattr(e, "problem", None) or str(e).splitlines()[0]
    context, cmark = getattr(e, "context", None), getattr(e, "context_mark", None)
    if context and cmark:
        what += f", {context} from line {cmark.line + 1}"
    return f"{where}: not valid YAML: {what}"


def key_docs() -> dict[str, str]:
    """Each TrainConfig key's docstring (the string under its field), on one line: the source
    of `megatrain train --help`."""
    body = ast.parse(inspect.getsource(TrainConfig)).body[0].body
    docs = {}
    for node, nxt in zip(body, body[1:]):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs
