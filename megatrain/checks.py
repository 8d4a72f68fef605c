"""Checks of a run that need more than the config file alone (the filesystem, installed
packages, the model's config.json, the number of steps), done by the trainer before anything
is written. Errors are one-line ConfigErrors; doubtful but possible settings are warnings."""

from __future__ import annotations

from pathlib import Path

from .engine.optim import lr_at
from .errors import ConfigError
from .models.config import ModelConfig


def check_outputs(cfg) -> None:
    """ConfigError when the run could not write its outputs: `output_dir` (or a parent) is a
    file, or `report_to` names a backend that is not installed."""
    out = Path(cfg.output_dir)
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == out else f"is inside {p}, which is a file"
                raise ConfigError(f"output_dir: {out} {what}, not a directory")
            break
    if cfg.report_to == "tensorboard":
        try:
            from torch.utils.tensorboard import SummaryWriter  # noqa: F401
        except ImportError:
            raise ConfigError(
                "report_to: tensorboard is not installed (pip install tensorboard, or report_to: none)"
            ) from None


def run_warnings(cfg, model_cfg: ModelConfig, total_steps: int, warmup_steps: int) -> list[str]:
    """Settings that are legal but probably not what was meant.

    `max_length` beyond the model's `max_position_embeddings` is a warning, not an error: RoPE
    computes any position, and a user may extend the context on purpose (with or without
    `rope_scaling`); but a model trained at a shorter length is rarely good beyond it.
    """
    warnings = []
    if cfg.max_length > model_cfg.max_position_embeddings:
        warnings.append(
            f"max_length {cfg.max_length} is beyond the model's max_position_embeddings "
            f"{model_cfg.max_position_embeddings}: positions past it were never trained"
        )
    # Every schedule peaks at the step where warmup ends; the run may end before it.
    peak = lr_at(min(warmup_steps, total_steps - 1), 1.0, cfg.lr_scheduler_type, warmup_steps, total_steps)
    if peak < 1.0:
        warnings.append(
            f"warmup of {warmup_steps} steps is not shorter than the run's {total_steps} steps: "
            f"the learning rate never reaches learning_rate {cfg.learning_rate:g}"
        )
    return warnings
