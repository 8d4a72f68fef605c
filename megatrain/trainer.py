"""The training loop: batch, forward and backward sweeps, clip, optimizer, log, checkpoint.

The machinery lives elsewhere: checkpoint.py (save, prune, resume), guard.py (signals,
non-finite steps), plan.py (the memory preflight), metrics.py (metrics.jsonl, progress bar,
TensorBoard), evaluation.py (eval loss, the best checkpoint).
"""

from __future__ import annotations

import json
import math
import random
import time
from collections import deque
from pathlib import Path

import torch

from .checkpoint import (
    HISTORY,
    TrainerState,
    open_checkpoint,
    prune_checkpoints,
    remove_temporaries,
    resume_path,
    save_checkpoint,
)
from .config import TrainConfig, parse_size
from .data import Batcher, build_samples, load_tokenizer, pad_token_id
from .errors import ConfigError
from .evaluation import Evaluator
from .guard import NonFiniteGuard, SignalGuard
from .metrics import MetricsLogger
from .models.config import ModelConfig
from .optim import AdamWConfig, lr_at
from .plan import preflight
from .runtime import build_model, resolve_device, resolve_dtype
from .weights import load_hf_weights, save_hf_checkpoint

# Settings whose change between a checkpoint and its resume makes the continuation differ from
# an uninterrupted run; changing them is allowed, with a warning.
# fmt: off
RESUME_SENSITIVE = (
    "dataset", "dataset_format", "max_length", "packing", "shuffle", "seed", "per_device_train_batch_size",
    "gradient_accumulation_steps", "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio",
    "max_steps", "num_train_epochs", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
)
# fmt: on


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's global generators (a resume then restores their saved states)."""
    random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: TrainConfig) -> Path:
    """Train as `cfg` says; returns the exported model directory (`output_dir/final`).

    Raises MegatrainError subclasses for bad inputs (before anything is written),
    guard.TrainingInterrupted after a signal (its checkpoint saved) and guard.DivergedError
    when steps keep producing non-finite losses.
    """
    seed_everything(cfg.seed)
    device = resolve_device(cfg.device)
    compute_dtype = resolve_dtype(cfg.compute_dtype, device)

    # Everything that can be wrong with the inputs is checked before anything is written.
    model_cfg = ModelConfig.from_json(cfg.model_name_or_path or cfg.model_config)
    ckpt_path = resume_path(cfg)
    resume = open_checkpoint(ckpt_path, model_cfg) if ckpt_path else None
    tok_path = cfg.tokenizer_name_or_path or cfg.model_name_or_path
    tokenizer = load_tokenizer(tok_path) if tok_path else None
    if tokenizer is None and cfg.dataset_format not in ("tokens", "auto"):
        raise ConfigError("tokenizer_name_or_path: required for text and chat datasets")
    samples = build_samples(cfg, tokenizer)
    batcher = Batcher(
        samples,
        batch_size=cfg.per_device_train_batch_size,
        grad_accum=cfg.gradient_accumulation_steps,
        max_length=cfg.max_length,
        packing=cfg.packing,
        shuffle=cfg.shuffle,
        seed=cfg.seed,
        pad_id=pad_token_id(tokenizer),
    )
    total_steps = (
        cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * batcher.steps_per_epoch)
    )
    if resume and resume.trainer_state.global_step > total_steps:
        raise ConfigError(
            f"max_steps: {resume.path} is at step {resume.trainer_state.global_step}, past the {total_steps} "
            "steps this run trains for (raise max_steps or num_train_epochs)"
        )
    evaluator = Evaluator(cfg, tokenizer, total_steps, batcher.steps_per_epoch)  # tokenizes eval_dataset
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total_steps)
    schedule = dict(
        type=cfg.lr_scheduler_type,
        learning_rate=cfg.learning_rate,
        warmup_steps=warmup,
        total_steps=total_steps,
    )
    preflight(model_cfg, cfg, device, compute_dtype.itemsize)  # refuses a run that cannot fit

    model = build_model(
        model_cfg,
        weights=resume.path if resume else cfg.model_name_or_path,  # a checkpoint holds HF-keyed fp32 weights
        seed=cfg.seed,
        device=device,
        compute_dtype=compute_dtype,
        adamw=AdamWConfig(
            cfg.learning_rate, (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_epsilon, cfg.weight_decay
        ),
        progress=True,
        gpu_state=cfg.gpu_state,
        compile=cfg.torch_compile,  # None: on for CUDA, off on the CPU
        offload_activations="auto" if cfg.offload_activations is None else cfg.offload_activations,
    )
    engine = model.engine
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    remove_temporaries(out)
    (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    ts = resume.restore(model.state, batcher) if resume else None
    start = ts.global_step if ts else 0
    history = deque(ts.log_history if ts else [], maxlen=HISTORY)
    log = MetricsLogger(out, total_steps, start, cfg.logging_steps, cfg.report_to, cfg.disable_tqdm)
    nonfinite = NonFiniteGuard(cfg.max_consecutive_nonfinite, ts.nonfinite_streak if ts else 0, log.message)
    log.message(
        f"megatrain: {model_cfg.model_type} {model.state.num_params / 1e6:.1f}M params on {device} "
        f"({str(engine.dtype).removeprefix('torch.')}), {len(samples)} samples, {total_steps} steps"
    )
    if resume:
        log.message(f"megatrain: resumed from {resume.path} at step {start}")
        evaluator.restore(ts, log.message)
        changed = resume.changed_settings(cfg.to_dict(), RESUME_SENSITIVE)
        if changed:
            log.message("megatrain: warning: settings changed since the checkpoint: " + "; ".join(changed))

    def evaluate(step: int) -> None:
        """Eval loss after `step` optimizer steps, to the metrics and the log history."""
        record = evaluator.evaluate(engine, step, batcher.epoch, log.progress)
        log.log_eval(record)
        history.append(record)

    def save(step: int) -> Path:
        """Checkpoint after `step` optimizer steps, then prune to save_total_limit (never the best)."""
        model.transport.synchronize()  # the CUDA optimizer runs behind; the host state must be current
        evaluator.checkpointed(step)  # is this checkpoint the best so far?
        trainer_state = TrainerState(
            global_step=step,
            epoch=batcher.epoch,
            max_steps=total_steps,
            optimizer_step=model.state.step,
            lr_scheduler={**schedule, "last_step": step},
            data_state=batcher.state_dict(),
            nonfinite_streak=nonfinite.streak,
            log_history=list(history),
            **evaluator.state(),
        )
        path = save_checkpoint(
            out,
            trainer_state,
            model.state,
            model_cfg,
            cfg.to_dict(),
            tokenizer=tokenizer,
            generation_from=cfg.model_name_or_path,
            max_shard_bytes=parse_size(cfg.max_shard_size),
        )
        prune_checkpoints(out, cfg.save_total_limit, protect=evaluator.best_checkpoint)
        log.message(f"megatrain: saved {path}")
        return path

    try:
        with SignalGuard(log.message) as stop:
            last = resume.path if resume else None  # the newest checkpoint of this run
            if start == 0 and evaluator.due(0):
                evaluate(0)  # eval_on_start: a baseline before the first step
            t_last = time.perf_counter()
            for step in range(start, total_steps):
                micro_batches = batcher.next_step()
                loss, n_label = engine.forward_backward(micro_batches)
                grad_norm, coef = engine.clip_grad_norm(cfg.max_grad_norm)
                grad_norm, loss = grad_norm.item(), loss.item()  # the one host sync of the step
                lr = lr_at(step, cfg.learning_rate, cfg.lr_scheduler_type, warmup, total_steps)
                finite = nonfinite.finite(step + 1, loss, grad_norm)
                if finite:
                    engine.step(lr, coef)
                else:
                    engine.grads = {}  # skip the step: weights and AdamW moments stay as they were

                now = time.perf_counter()
                dt, t_last = now - t_last, now
                tokens = sum(mb.num_tokens for mb in micro_batches)
                record = {
                    "step": step + 1,
                    "loss": loss if finite else None,  # JSON has no NaN
                    "grad_norm": grad_norm if finite else None,
                    "lr": lr,
                    "tokens": tokens,
                    "label_tokens": n_label,
                    "tokens_per_s": tokens / dt,
                    "step_time_s": dt,
                    "epoch": batcher.epoch,
                }
                if not finite:
                    record["skipped"] = True
                log.log(record)
                history.append(record)
                nonfinite.check_diverged(step + 1)
                if evaluator.due(step + 1):
                    evaluate(step + 1)
                    t_last = time.perf_counter()  # evaluation is not step time

                stopping = stop.requested  # read once: a signal during the save is acted on below
                if stopping or (cfg.save_steps and (step + 1) % cfg.save_steps == 0):
                    last = save(step + 1)
                    t_last = time.perf_counter()  # saving is not step time
                if stopping:
                    raise stop.interrupted(last)
            if last is None or last.name != f"checkpoint-{total_steps}":
                last = save(total_steps)  # the last step is always resumable (e.g. to train further)
            if stop.requested:
                raise stop.interrupted(last)
        model.transport.synchronize()
        best = evaluator.best_checkpoint
        if cfg.load_best_model_at_end and best is not None:
            if evaluator.best_step != total_steps:  # the weights in memory are the last step's
                load_hf_weights(model.state, best, model_cfg, progress=log.interactive)
            log.message(
                f"megatrain: final/ is the best checkpoint, {best.name} "
                f"({evaluator.metric} {evaluator.best_metric:.4f})"
            )
        final = save_hf_checkpoint(
            model.state,
            model_cfg,
            out / "final",
            dtype=torch.bfloat16 if cfg.save_dtype == "bfloat16" else torch.float32,
            max_shard_bytes=parse_size(cfg.max_shard_size),
            tokenizer=tokenizer,
            progress=log.interactive,
            generation_from=cfg.model_name_or_path,
        )
        log.message(f"megatrain: saved {final}")
        return final
    finally:
        log.close()
        model.close()
