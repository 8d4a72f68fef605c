"""What the training stage (`stage`) changes in a run: the samples it reads and how they are
batched, the objective the engine computes, and, for the preference stages that compare with a
reference model (dpo, kto), the reference pass; for grpo with a KL term, the reference policy's
weights (`grpo_reference`). (grpo's rollouts: rl/rollout.py.)

The reference pass: before the first step, one forward-only sweep over the training and eval
samples computes each sample's summed completion log-probs under the reference model, the initial
policy unless ref_model_name_or_path names another. Nothing of a second model stays in memory:
on a fresh run the policy's engine makes the pass before it trains; otherwise (a resume, or
another reference model) a model of the reference's weights is built, swept and closed before the
policy is built. The values go to output_dir/reference/ (safetensors, written atomically with a
checksummed manifest, marked with a fingerprint of the data and the reference), which a resume
reads instead of sweeping again. Each sample carries its values as `Sample.extra`.
"""

from __future__ import annotations

import hashlib
import time
from array import array
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm.auto import tqdm

from .data import Batcher, build_samples
from .data.preference import (
    CHOSEN,
    COMPLETION,
    KL,
    REJECTED,
    build_preference_pairs,
    build_reward_pairs,
    build_unpaired_examples,
    pair_sample,
    score_sample,
    unpaired_sample,
)
from .data.prompts import Prompt, build_prompts
from .data.samples import Sample
from .data.sources import resolve_dataset
from .errors import CheckpointError, ConfigError
from .io import manifest
from .io.weights import parameters_in
from .io.writing import AtomicDir
from .models.config import ModelConfig
from .objectives.base import Objective
from .objectives.grpo import GRPO, GRPOConfig
from .objectives.reward import Reward
from .objectives.rloo import RLOO, RLOOConfig
from .objectives.sequence_sums import Preference

REFERENCE_DIR = "reference"
REFERENCE_FILE = "logps.safetensors"


def build_stage_samples(
    cfg,
    tokenizer,
    vocab_size: int | None,
    key: str,
    batch_size: int,
    warn=print,
    pad_id: int = 0,
    vision=None,
) -> list[Sample]:
    """The samples of `cfg.<key>` (dataset or eval_dataset) for the run's stage: labelled
    sequences (sft) or preference samples (data/preference.py; rm's scored where `pad_id`, the
    run's padding, says); `batch_size` groups KTO's KL sequences as its batches will. `vision`: a
    vision-language model's processor (data/vision.py), which reads the images of its data."""
    pref = cfg.preference()
    if pref is None:
        return build_samples(cfg, tokenizer, vocab_size, key=key, warn=warn, vision=vision)
    paths = [f.path for f in resolve_dataset(cfg, key)]
    if pref.stage == "rm":
        return [
            score_sample(p, pad_id) for p in build_reward_pairs(paths, tokenizer, cfg.max_length, vocab_size)
        ]
    limits = pref.limits(cfg.max_length)
    if pref.stage == "kto":
        kl = batch_size if pref.needs_kl else None
        return [unpaired_sample(e) for e in build_unpaired_examples(paths, tokenizer, limits, kl, vocab_size)]
    return [pair_sample(p) for p in build_preference_pairs(paths, tokenizer, limits, vocab_size, vision)]


# The stages a vision-language model trains with (the others' data and rollouts take no images).
VISION_STAGES = ("sft", "dpo")


def stage_model(cfg, model_cfg: ModelConfig, pad_id: int) -> ModelConfig:
    """The model the stage trains: rm's with a score head (its exports score before `pad_id`,
    the run's padding), the others' a causal LM; a vision-language model's tower and projector
    frozen or trained as the run says."""
    model_cfg = model_cfg.with_vision(cfg.freeze_vision_tower, cfg.freeze_multi_modal_projector)
    if model_cfg.vision is not None:
        mt = model_cfg.vision.model_type
        if cfg.stage not in VISION_STAGES:
            raise ConfigError(
                f"stage {cfg.stage}: {mt} is a vision-language model (it trains with {', '.join(VISION_STAGES)})"
            )
        if model_cfg.vision.mrope and cfg.packing:
            raise ConfigError(f"packing: {mt}'s 3D positions (M-RoPE) are not built for packed rows")
    if cfg.stage == "rm":
        return model_cfg.with_score_head(pad_id)
    if model_cfg.num_labels is not None:
        raise ConfigError(
            f"stage {cfg.stage}: model_name_or_path is a sequence-classification model (a reward "
            "model); it trains with stage rm"
        )
    return model_cfg


def grpo_prompts(cfg, tokenizer, vocab_size: int | None, key: str = "dataset") -> list[Prompt]:
    """grpo: the prompts of `cfg.<key>` (dataset or eval_dataset)."""
    return build_prompts(
        [f.path for f in resolve_dataset(cfg, key)], tokenizer, cfg.max_prompt_length, vocab_size
    )


def row_length(cfg) -> int:
    """The most tokens a sequence of the run has: max_length, but for grpo a prompt and a
    completion sampled for it, max_prompt_length (max_length where that is null: no bound) +
    max_completion_length."""
    grpo = cfg.grpo()
    if grpo is None:
        return cfg.max_length
    return (cfg.max_prompt_length or cfg.max_length) + grpo.max_completion_length


def row_length_text(cfg) -> str:
    """`row_length` as a message names it, with the keys it comes from."""
    if cfg.grpo() is None:
        return f"max_length {cfg.max_length}"
    prompt = (
        f"max_prompt_length {cfg.max_prompt_length}"
        if cfg.max_prompt_length
        else f"max_length {cfg.max_length}"
    )
    return f"{prompt} + max_completion_length {cfg.grpo().max_completion_length} = {row_length(cfg)}"


def batch_shape(cfg, grpo: GRPOConfig | None) -> tuple[int, int]:
    """(samples per micro-batch, micro-batches per step) of the training data's Batcher; grpo
    (`cfg.grpo(processes)`) draws one batch of prompts a generation batch, each sampled
    num_generations times into per_device_train_batch_size x steps_per_generation completions."""
    if grpo is None:
        return cfg.per_device_train_batch_size, cfg.gradient_accumulation_steps
    return cfg.per_device_train_batch_size * grpo.steps_per_generation // grpo.num_generations, 1


def steps_of_epoch(cfg, grpo: GRPOConfig | None, batches: int) -> int:
    """Optimizer steps of an epoch of `batches` Batcher batches: one a batch, but for grpo, whose
    batches (generation batches) are trained for steps_per_generation x num_iterations
    micro-batches, gradient_accumulation_steps a step (TRL's count: whole steps, at least one)."""
    if grpo is None:
        return batches
    return max(1, batches * grpo.micro_batches_per_generation // cfg.gradient_accumulation_steps)


def grpo_reference(cfg, model_cfg, dtype: torch.dtype) -> dict[str, torch.Tensor] | None:
    """grpo with a KL term (beta > 0): the reference policy's weights in the compute dtype, kept in
    host memory (objectives/grpo.py: `reference_copy_bytes`) for its per-token log-probs:
    ref_model_name_or_path's, else the initial policy's (model_name_or_path's, or the random
    initialisation of the seed). Never a checkpoint's: a resumed run has the reference the run
    started with. None without a KL term."""
    grpo = cfg.grpo()
    if grpo is None or not grpo.needs_reference:
        return None
    path = cfg.ref_model_name_or_path
    if path:
        same_architecture(model_cfg, ModelConfig.from_json(path), path)
    return parameters_in(model_cfg, path or cfg.model_name_or_path, cfg.seed, dtype)


def in_order(cfg, samples: list[Sample], batch_size: int, pad_id: int, pixels=None) -> Batcher:
    """A Batcher over every sample once, in file order, shaped as training's (max_length,
    packing, gradient_accumulation_steps micro-batches a chunk): evaluation's and the reference
    pass's; `pixels` makes their images' inputs (data/vision.py)."""
    return Batcher(
        samples,
        batch_size=batch_size,
        grad_accum=cfg.gradient_accumulation_steps,
        max_length=cfg.max_length,
        packing=cfg.packing,
        shuffle=False,
        pad_id=pad_id,
        drop_last=False,
        pixels=pixels,
    )


def autograd_head(cfg) -> bool:
    """Whether the stage's objective (`objective_of`) takes its loss through autograd over each
    chunk's vocabulary-wide logits (log-probs: grpo, rloo, the preference stages) rather than in
    cross-entropy's one pass; rm's score head is one logit a token. The plan's bytes a logit."""
    pref = cfg.preference()
    return cfg.grpo() is not None or (pref is not None and pref.stage != "rm")


def coupled(cfg) -> str:
    """Why the stage's objective couples a step's micro-batches (`Objective.coupled`, the plan's
    `Batch.coupled`): grpo's as its config says; "" for the others."""
    grpo = cfg.grpo()
    return "" if grpo is None else grpo.couples_micro_batches


def objective_of(cfg, world) -> Objective | None:
    """The stage's objective (None: the engine's default, cross-entropy)."""
    if (grpo := cfg.grpo(world.world_size)) is not None:
        kind = RLOO if isinstance(grpo, RLOOConfig) else GRPO
        return kind(grpo, micro_batches=cfg.gradient_accumulation_steps * world.world_size, collective=world)
    pref = cfg.preference()
    if pref is not None and pref.stage == "rm":
        return Reward(pref)
    return None if pref is None else Preference(pref, collective=world)


class Reference:
    """A run's reference log-probs: read from output_dir/reference/ when they are this data's and
    this reference's, else computed by `compute`; `attach` puts them into the samples."""

    def __init__(self, cfg, sets: dict[str, list[Sample]], output_dir: Path, model_cfg, pixels=None):
        self.pref = cfg.preference()
        self.pixels = pixels  # a vision-language model's: its samples' images to pixel inputs
        self.sets = sets
        self.directory = Path(output_dir) / REFERENCE_DIR
        self.source = cfg.ref_model_name_or_path or cfg.model_name_or_path or f"random init, seed {cfg.seed}"
        self.fingerprint = _fingerprint(sets, self.pref.stage, str(self.source), model_cfg.num_params)
        self.values: dict[str, torch.Tensor] | None = self._stored()
        self.computed = False

    @property
    def wanted(self) -> bool:
        return self.pref.needs_reference

    @property
    def missing(self) -> bool:
        return self.wanted and self.values is None

    @property
    def codes(self) -> tuple[int, ...]:
        """The per-sequence sums stored per sample."""
        if self.pref.stage == "kto":
            return (COMPLETION, KL) if self.pref.needs_kl else (COMPLETION,)
        return (CHOSEN, REJECTED)

    def _stored(self) -> dict[str, torch.Tensor] | None:
        path = self.directory / REFERENCE_FILE
        if not path.is_file():
            return None
        manifest.verify(self.directory)  # a corrupt file is an error, not a reason to recompute
        with safe_open(path, "pt") as f:
            if (f.metadata() or {}).get("fingerprint") != self.fingerprint:
                return None  # another run's data or reference: computed again, then replaced
            return {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 (safe_open is no dict)

    def compute(self, engine, cfg, pad_id: int, world, progress: bool) -> None:
        """One forward sweep over every set's samples (rank r takes every r-th chunk of
        gradient_accumulation_steps micro-batches), each sample's sums summed over ranks."""
        t0 = time.perf_counter()
        values = {}
        for name, samples in self.sets.items():
            size = cfg.per_device_eval_batch_size if name == "eval" else cfg.per_device_train_batch_size
            batcher = in_order(cfg, samples, size, pad_id, self.pixels)
            out = torch.zeros(len(samples), len(self.codes), dtype=torch.float64, device=engine.device)
            chunks = batcher.steps_per_epoch
            mine = range(world.rank, chunks, world.world_size)
            bar = tqdm(
                total=len(mine), desc=f"reference log-probs ({name})", unit="batch", disable=not progress
            )
            for i, mbs in enumerate(batcher.epoch_steps()):
                if i % world.world_size != world.rank:
                    continue
                sums = engine.head_outputs(mbs, engine.objective.sums)
                for mb, s in zip(mbs, sums):
                    k = len(mb.units)
                    cols = [s.logps[c * k : (c + 1) * k] for c in self.codes]
                    out[mb.units] = torch.stack(cols, 1).double()
                bar.update(1)
            bar.close()
            for _ in range(-(-chunks // world.world_size) - len(mine)):
                engine.keep_pace()
            values[name] = world.sum_(out).cpu()  # each sample was computed by one rank
        self.values, self.computed = values, True
        self.seconds = time.perf_counter() - t0

    def write(self) -> Path:
        """output_dir/reference/, atomically, with its manifest."""
        nbytes = sum(v.numel() * 8 for v in self.values.values())
        with AtomicDir(self.directory, manifest.REFERENCE, nbytes=nbytes) as d:
            meta = {"fingerprint": self.fingerprint, "reference": str(self.source), "stage": self.pref.stage}
            save_file({k: v.contiguous() for k, v in self.values.items()}, str(d.path / REFERENCE_FILE), meta)
            return d.commit()

    def note(self) -> str:
        """What the run tells of its reference log-probs."""
        n = sum(len(s) for s in self.sets.values())
        if self.computed:
            return f"megatrain: reference log-probs of {n} samples ({self.source}) in {self.seconds:.1f} s, saved to {self.directory}"
        return f"megatrain: reference log-probs of {n} samples read from {self.directory}"

    def attach(self) -> None:
        """Each sample's extra: its reference sums (after KTO's label)."""
        for name, samples in self.sets.items():
            table = self.values[name]
            if len(table) != len(samples):
                raise CheckpointError(
                    f"{self.directory}: {len(table)} {name} rows for {len(samples)} samples"
                )
            for s, row in zip(samples, table.tolist()):
                s.extra = (*s.extra[:1], *row) if self.pref.stage == "kto" else tuple(row)


def _fingerprint(sets: dict[str, list[Sample]], stage: str, source: str, num_params: int) -> str:
    """What the stored values depend on: every sample's tokens and sums, the stage, the reference."""
    h = hashlib.sha256(f"{stage}|{source}|{num_params}".encode())
    for name, samples in sets.items():
        h.update(f"|{name}:{len(samples)}".encode())
        for s in samples:
            h.update(array("q", s.input_ids).tobytes())
            h.update(array("q", s.slots).tobytes())
            h.update(repr(s.parts).encode())
    return h.hexdigest()


def same_architecture(policy, reference, path: str) -> None:
    """Refuse a reference model whose weights do not fit the policy's layout."""
    keys = ("model_type", "hidden_size", "num_hidden_layers", "vocab_size", "num_params")
    for k in keys:
        a, b = getattr(policy, k, None), getattr(reference, k, None)
        if a != b:
            raise ConfigError(
                f"ref_model_name_or_path: {path} has {k} {b}, the policy {a}; the reference model must "
                "have the policy's architecture"
            )


def reference_model_pass(ref: Reference, build: Callable, cfg, pad_id: int, world, progress: bool) -> None:
    """Compute `ref` with a model of the reference weights, built by `build()` and closed after."""
    model = build()
    try:
        ref.compute(model.engine, cfg, pad_id, world, progress)
    finally:
        model.close()
        del model
