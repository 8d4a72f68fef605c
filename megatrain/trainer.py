"""The training loop: batch, forward and backward sweeps, clip, optimizer, log, checkpoint."""

from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

import torch

from .config import TrainConfig
from .data import Batcher, build_samples, load_tokenizer
from .errors import ConfigError
from .metrics import MetricsLogger
from .models.config import ModelConfig
from .optim import AdamWConfig, lr_at
from .runtime import build_model, resolve_device
from .weights import save_hf_checkpoint


def seed_everything(seed: int) -> None:
    random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: TrainConfig) -> Path:
    """Train as `cfg` says; returns the exported model directory (`output_dir/final`)."""
    seed_everything(cfg.seed)
    device = resolve_device(cfg.device)

    # Everything that can be wrong with the inputs is checked before anything is written.
    model_cfg = ModelConfig.from_json(cfg.model_name_or_path or cfg.model_config)
    tok_path = cfg.tokenizer_name_or_path or cfg.model_name_or_path
    tokenizer = load_tokenizer(tok_path) if tok_path else None
    if tokenizer is None and cfg.dataset_format not in ("tokens", "auto"):
        raise ConfigError("tokenizer_name_or_path: required for text and chat datasets")
    samples = build_samples(cfg, tokenizer)
    pad_id = _pad_id(tokenizer)
    batcher = Batcher(samples, batch_size=cfg.per_device_train_batch_size,
                      grad_accum=cfg.gradient_accumulation_steps, max_length=cfg.max_length,
                      packing=cfg.packing, shuffle=cfg.shuffle, seed=cfg.seed, pad_id=pad_id)
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * batcher.steps_per_epoch)
    warmup = cfg.warmup_steps or math.ceil(cfg.warmup_ratio * total_steps)

    model = build_model(
        model_cfg,
        weights=cfg.model_name_or_path,
        seed=cfg.seed,
        device=device,
        compute_dtype=cfg.compute_dtype,
        adamw=AdamWConfig(cfg.learning_rate, (cfg.adam_beta1, cfg.adam_beta2), cfg.adam_epsilon, cfg.weight_decay),
        progress=True,
        gpu_state=cfg.gpu_state,
        compile=device.type == "cuda" if cfg.torch_compile is None else cfg.torch_compile,
    )
    engine = model.engine
    out = Path(cfg.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "train_config.json").write_text(json.dumps(cfg.to_dict(), indent=2) + "\n")
    log = MetricsLogger(out, total_steps, 0, cfg.logging_steps, cfg.report_to, cfg.disable_tqdm)
    log.message(
        f"megatrain: {model_cfg.model_type} {model.state.num_params / 1e6:.1f}M params on {device} "
        f"({str(engine.dtype).removeprefix('torch.')}), {len(samples)} samples, {total_steps} steps"
    )

    try:
        t_last = time.perf_counter()
        for step in range(total_steps):
            micro_batches = batcher.next_step()
            loss, n_label = engine.forward_backward(micro_batches)
            grad_norm, coef = engine.clip_grad_norm(cfg.max_grad_norm)
            grad_norm, loss = grad_norm.item(), loss.item()  # the one host sync of the step
            lr = lr_at(step, cfg.learning_rate, cfg.lr_scheduler_type, warmup, total_steps)
            engine.step(lr, coef)

            now = time.perf_counter()
            dt, t_last = now - t_last, now
            tokens = sum(mb.num_tokens for mb in micro_batches)
            log.log({
                "step": step + 1, "loss": loss, "grad_norm": grad_norm, "lr": lr,
                "tokens": tokens, "label_tokens": n_label, "tokens_per_s": tokens / dt,
                "step_time_s": dt, "epoch": batcher.epoch,
            })
        model.transport.synchronize()
        final = save_hf_checkpoint(model.state, model_cfg, out / "final", dtype=torch.bfloat16
                                   if cfg.save_dtype == "bfloat16" else torch.float32, tokenizer=tokenizer)
        log.message(f"megatrain: saved {final}")
        return final
    finally:
        log.close()
        model.close()


def _pad_id(tokenizer) -> int:
    if tokenizer is None:
        return 0
    for tid in (tokenizer.pad_token_id, tokenizer.eos_token_id):
        if tid is not None:
            return int(tid)
    return 0
