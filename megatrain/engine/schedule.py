"""The learning-rate schedules, as transformers' schedulers give them (no torch: the config
checks a schedule's name before torch loads)."""

from __future__ import annotations

import math


def lr_at(step: int, base_lr: float, schedule: str, warmup_steps: int, total_steps: int) -> float:
    """Learning rate for optimizer step `step` (0-based), as transformers' schedulers give it."""
    if schedule == "constant":  # transformers' "constant" ignores warmup
        return base_lr
    if warmup_steps > 0 and step < warmup_steps:
        return base_lr * (float(step) / float(max(1, warmup_steps)))
    if schedule == "constant_with_warmup":
        return base_lr
    if schedule == "linear":
        return base_lr * max(0.0, float(total_steps - step) / float(max(1, total_steps - warmup_steps)))
    progress = float(step - warmup_steps) / float(max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return base_lr * max(0.0, 0.5 * (1.0 + math.cos(math.pi * progress)))
    raise ValueError(f"unknown lr_scheduler_type {schedule!r}")


SCHEDULES = ("constant", "constant_with_warmup", "linear", "cosine")
