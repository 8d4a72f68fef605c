"""Checks of a run that need more than the config file alone (the filesystem, installed
packages, the model's config.json, the number of steps), done by the trainer before anything
is written. Errors are one-line ConfigErrors; doubtful but possible settings are warnings."""

from __future__ import annotations

from pathlib import Path

from .engine.schedule import lr_at
from .errors import ConfigError
from .models.config import ModelConfig
from .stages import row_length, row_length_text
from .trackers import check_installed


def check_outputs(cfg) -> None:
    """ConfigError when the run could not write its outputs: `output_dir` (or a parent) is a
    file, or `report_to` names a tracker that is not installed."""
    out = Path(cfg.output_dir)
    for p in (out, *out.parents):
        if p.exists():
            if not p.is_dir():
                what = "is a file" if p == out else f"is inside {p}, which is a file"
                raise ConfigError(f"output_dir: {out} {what}, not a directory")
            break
    check_installed(cfg.report_to)


def beyond_positions(length: int, model_cfg: ModelConfig) -> str | None:
    """The caveat for sequences of `length` tokens where that is beyond the model's
    `max_position_embeddings` (None within it).

    A warning, not an error: RoPE computes any position, and a user may extend the context on
    purpose (with or without `rope_scaling`); but a model trained at a shorter length is rarely
    good beyond it.
    """
    if length <= model_cfg.max_position_embeddings:
        return None
    return (
        f"beyond the model's max_position_embeddings {model_cfg.max_position_embeddings}: "
        "positions past it were never trained"
    )


def shared_prompts_refused(cfg, model_cfg: ModelConfig) -> str | None:
    """Why `share_prompts` cannot lay out this model's rows (data/shared.py; None: it can):
    a window counts positions along the row, which the layout moves; a load-balancing loss
    counts every token of every row; images are not in the layout."""
    if not cfg.share_prompts:
        return None
    if any(model_cfg.windows):
        return "share_prompts: the model's sliding-window attention counts along the row, which it reorders"
    if model_cfg.moe is not None and model_cfg.moe.balance_loss:
        return "share_prompts: the experts' load-balancing loss counts each row's prompt tokens"
    if model_cfg.vision is not None:
        return "share_prompts: not built for images"
    return None


def config_warnings(cfg, model_cfg: ModelConfig) -> list[str]:
    """Settings that are legal but probably not what was meant, known from the config and the
    model alone (`megatrain plan` prints them too)."""
    why = beyond_positions(row_length(cfg), model_cfg)
    warnings = [f"{row_length_text(cfg)} is {why}"] if why else []
    if cfg.learning_rate == 0:  # legal, as in transformers and torch: a dry run of the pipeline
        warnings.append("learning_rate is 0: the steps leave the weights as they are")
    return warnings


def run_warnings(cfg, model_cfg: ModelConfig, total_steps: int, warmup_steps: int) -> list[str]:
    """`config_warnings`, and those that need the run's number of steps."""
    warnings = config_warnings(cfg, model_cfg)
    # Every schedule peaks at the step where warmup ends; the run may end before it.
    peak = lr_at(min(warmup_steps, total_steps - 1), 1.0, cfg.lr_scheduler_type, warmup_steps, total_steps)
    if peak < 1.0:
        warnings.append(
            f"warmup of {warmup_steps} steps is not shorter than the run's {total_steps} steps: "
            f"the learning rate never reaches learning_rate {cfg.learning_rate:g}"
        )
    return warnings
