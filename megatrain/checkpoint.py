"""Resumable training checkpoints.

Layout of `output_dir/checkpoint-{step}/` (format 1):

    model.safetensors            fp32 master weights, Hugging Face keys (`model.layers.0...`);
                                 shards `model-0000i-of-0000N.safetensors` + index when large.
                                 With config.json beside it this is a loadable HF model.
    optimizer.safetensors        fp32 AdamW moments, keys `exp_avg.<hf key>` and
                                 `exp_avg_sq.<hf key>`; sharded the same way. Keyed by parameter,
                                 not by the host layout, so the layout may change between versions.
    config.json                  the model config (plus generation_config.json)
    trainer_state.json           global_step, epoch, log_history tail (Hugging Face names), and
                                 what resuming needs: optimizer_step (AdamW's bias-correction
                                 count: skipped steps do not advance it), lr_scheduler (schedule
                                 parameters and step), data_state (Batcher.state_dict()),
                                 nonfinite_streak; with metric_for_best_model, best_metric,
                                 best_global_step and best_model_checkpoint (HF names)
    rng_state.pt                 python `random`, torch CPU and CUDA generator states
    train_config.json            the run's configuration
    tokenizer files              when the run has a tokenizer (chat template included)

A checkpoint is written into a dot-named temporary directory in output_dir, fsynced and renamed
into place (weights.commit_dir), so a checkpoint-N directory is either complete or absent, and
killing the process at any moment leaves the previous checkpoints intact. Pruned checkpoints
are renamed to a dot name before they are deleted, for the same reason.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import re
import shutil
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .errors import CheckpointError, ConfigError
from .models.config import ModelConfig
from .state import HostState, build_units
from .weights import (
    TensorReader,
    _atomic_dir,
    checkpoint_files,
    commit_dir,
    write_model_config,
    write_sharded,
)

FORMAT = 1
TRAINER_STATE = "trainer_state.json"
RNG_STATE = "rng_state.pt"
TRAIN_CONFIG = "train_config.json"
HISTORY = 1000  # log_history records kept in trainer_state.json (metrics.jsonl has them all)
_NAME = re.compile(r"^checkpoint-(\d+)$")
_TEMPORARY = re.compile(r"^\.(checkpoint-\d+|final)\.(tmp|old|del)-")


@dataclass
class TrainerState:
    """Where a run stands after `global_step` optimizer steps (`trainer_state.json`)."""

    global_step: int
    epoch: float
    max_steps: int
    optimizer_step: int
    """AdamW steps taken (its bias correction); less than global_step when steps were skipped."""
    lr_scheduler: dict[str, Any]
    """type, learning_rate, warmup_steps, total_steps and last_step of the schedule."""
    data_state: dict[str, Any]
    """Batcher.state_dict(): the position in the data."""
    nonfinite_streak: int = 0
    log_history: list[dict[str, Any]] = field(default_factory=list)
    best_metric: float | None = None
    """metric_for_best_model of the best evaluated checkpoint so far."""
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    """output_dir/checkpoint-N of the best checkpoint (pruning never deletes it)."""

    def to_json(self) -> dict[str, Any]:
        out = {"format": FORMAT, **dataclasses.asdict(self)}
        # Hugging Face's name for the learning rate, so tools that read its log_history work.
        out["log_history"] = [
            {("learning_rate" if k == "lr" else k): v for k, v in r.items()} for r in self.log_history
        ]
        return out

    @classmethod
    def read(cls, path: Path) -> TrainerState:
        try:
            raw = json.loads(path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: missing (not a megatrain checkpoint)") from None
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise CheckpointError(f"{path}: unreadable ({e})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        if raw.get("format") != FORMAT:
            raise CheckpointError(
                f"{path}: checkpoint format {raw.get('format')!r}, this version reads {FORMAT}"
            )
        types = {
            "global_step": int,
            "epoch": (int, float),
            "max_steps": int,
            "optimizer_step": int,
            "lr_scheduler": dict,
            "data_state": dict,
            "nonfinite_streak": int,
            "log_history": list,
        }
        for key, tp in types.items():
            if not isinstance(raw.get(key), tp) or isinstance(raw.get(key), bool):
                raise CheckpointError(
                    f"{path}: {key!r} is missing or not a {getattr(tp, '__name__', 'number')}"
                )
        optional = {"best_metric": (int, float), "best_global_step": int, "best_model_checkpoint": str}
        for key, tp in optional.items():
            if raw.get(key) is not None and (not isinstance(raw[key], tp) or isinstance(raw[key], bool)):
                raise CheckpointError(f"{path}: {key!r} is not a {getattr(tp, '__name__', 'number')}")
        return cls(**{k: raw[k] for k in types}, **{k: raw.get(k) for k in optional})


# ---------------------------------------------------------------------------- finding
def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `checkpoint-N` directory in output_dir, oldest first. Temporary
    and half-deleted directories have dot names and never match."""
    d = Path(output_dir)
    if not d.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in d.iterdir() if (m := _NAME.match(p.name)) and p.is_dir()]
    return sorted(found)


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """Where the checkpoint after `step` optimizer steps goes."""
    return Path(output_dir) / f"checkpoint-{step}"


def resume_path(cfg) -> Path | None:
    """The checkpoint `cfg.resume_from_checkpoint` names: None when not resuming, the newest
    checkpoint in output_dir for `true`, else the given directory."""
    value = cfg.resume_from_checkpoint
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("false", "no")):
        return None
    if value is True or (isinstance(value, str) and value.lower() in ("true", "yes", "latest")):
        found = list_checkpoints(cfg.output_dir)
        if not found:
            raise ConfigError(f"resume_from_checkpoint: no checkpoint-* directory in {cfg.output_dir}")
        return found[-1][1]
    path = Path(value)
    if not path.is_dir():
        raise ConfigError(f"resume_from_checkpoint: {path} is not a directory")
    return path


def remove_temporaries(output_dir: Path) -> None:
    """Delete what an interrupted save or prune left behind (dot-named; never a checkpoint).
    Assumes one training run per output_dir."""
    for p in output_dir.iterdir():
        if _TEMPORARY.match(p.name) and p.is_dir():
            shutil.rmtree(p, ignore_errors=True)


# ---------------------------------------------------------------------------- saving
def _moments(state: HostState) -> dict[str, torch.Tensor]:
    """`exp_avg.<key>` / `exp_avg_sq.<key>` -> views of the host moments, parameter by parameter."""
    out = {}
    for unit in state.units:
        for which in ("exp_avg", "exp_avg_sq"):
            flat = state.flat(unit, which)
            for p in unit.params:
                out[f"{which}.{p.key}"] = flat[p.offset : p.offset + p.numel].view(p.shape)
    return out


def rng_state() -> dict[str, Any]:
    """The global generators a run draws from: Python's `random`, torch CPU, and CUDA if used."""
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def save_checkpoint(
    output_dir: Path,
    trainer_state: TrainerState,
    state: HostState,
    model_cfg: ModelConfig,
    train_config: dict[str, Any],
    tokenizer=None,
    generation_from: str | Path | None = None,
    max_shard_bytes: int = 5 * 10**9,
) -> Path:
    """Write `output_dir/checkpoint-{global_step}` atomically (see the module docstring) and
    return it. The host state must be current: call `transport.synchronize()` first."""
    final = checkpoint_dir(output_dir, trainer_state.global_step)
    tmp = _atomic_dir(final)
    try:
        params = dict(state.named_parameters())
        write_sharded(
            tmp,
            "model",
            [(k, tuple(v.shape)) for k, v in params.items()],
            torch.float32,
            params.__getitem__,
            max_shard_bytes,
        )
        moments = _moments(state)
        write_sharded(
            tmp,
            "optimizer",
            [(k, tuple(v.shape)) for k, v in moments.items()],
            torch.float32,
            moments.__getitem__,
            max_shard_bytes,
        )
        write_model_config(tmp, model_cfg, torch.float32, Path(generation_from) if generation_from else None)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        torch.save(rng_state(), tmp / RNG_STATE)
        (tmp / TRAIN_CONFIG).write_text(json.dumps(train_config, indent=2) + "\n")
        (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state.to_json(), indent=2) + "\n")
        commit_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return final


def prune_checkpoints(output_dir: Path, keep: int | None, protect: str | Path | None = None) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (by step); returns those deleted.

    `protect` (the best checkpoint) is never deleted and, as in transformers, counts toward
    `keep` when it is older than the newest `keep`, except that the newest always stays."""
    if keep is None:
        return []
    found = [p for _, p in list_checkpoints(output_dir)]
    older = [p for p in found[:-keep] if protect is not None and p.resolve() == Path(protect).resolve()]
    if older:  # spared, in place of the oldest of the newest `keep`
        found.remove(older[0])
        keep = max(keep - 1, 1)
    doomed = found[:-keep]
    for p in doomed:
        # Rename first: a kill during rmtree must not leave a partial checkpoint-N behind.
        trash = p.with_name(f".{p.name}.del-{os.getpid()}-{time.monotonic_ns()}")
        os.replace(p, trash)
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


# ---------------------------------------------------------------------------- loading
@dataclass
class Checkpoint:
    """A checkpoint whose every piece has been checked (files, keys, shapes, dtypes, config)."""

    path: Path
    trainer_state: TrainerState
    optimizer: TensorReader
    rng: dict[str, Any]
    train_config: dict[str, Any]

    def changed_settings(self, current: dict[str, Any], keys: Iterable[str]) -> list[str]:
        """`key: old -> new` for settings of `keys` that differ from the checkpoint's run."""
        return [
            f"{k}: {self.train_config[k]!r} -> {current[k]!r}"
            for k in keys
            if k in self.train_config and self.train_config[k] != current.get(k)
        ]

    def restore(self, state: HostState, batcher) -> TrainerState:
        """Load the AdamW moments into `state` (whose master weights were loaded from this
        checkpoint's model.safetensors by build_model), the data position into `batcher` and
        the random generators. Returns the trainer state to continue from."""
        for which in ("exp_avg", "exp_avg_sq"):
            for unit in state.units:
                flat = state.flat(unit, which)
                for p in unit.params:
                    flat[p.offset : p.offset + p.numel].view(p.shape).copy_(
                        self.optimizer.get(f"{which}.{p.key}")
                    )
        self.optimizer.close()
        ts = self.trainer_state
        state.step = ts.optimizer_step
        batcher.load_state_dict(ts.data_state)
        random.setstate(self.rng["python"])
        torch.set_rng_state(self.rng["torch"])
        if (
            "cuda" in self.rng
            and torch.cuda.is_available()
            and len(self.rng["cuda"]) == torch.cuda.device_count()
        ):
            torch.cuda.set_rng_state_all(self.rng["cuda"])
        return ts


def open_checkpoint(path: str | Path, model_cfg: ModelConfig) -> Checkpoint:
    """Check a checkpoint completely before anything is allocated: trainer state, model config
    (must equal `model_cfg`), every weight and moment tensor (present, shape, fp32; the
    safetensors headers are validated against the file sizes), RNG state. Raises a
    CheckpointError naming the file at fault."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    ts = TrainerState.read(path / TRAINER_STATE)
    try:
        saved_cfg = ModelConfig.from_json(path / "config.json")
    except ConfigError as e:
        raise CheckpointError(str(e)) from None
    for f in dataclasses.fields(ModelConfig):
        if f.compare and getattr(saved_cfg, f.name) != getattr(model_cfg, f.name):
            raise CheckpointError(
                f"{path / 'config.json'}: {f.name} is {getattr(saved_cfg, f.name)!r}, but the model being "
                f"trained has {getattr(model_cfg, f.name)!r} (a checkpoint of a different model?)"
            )
    # build_units uses meta-device templates: shapes only, nothing is allocated.
    expected = [(p.key, p.shape) for u in build_units(model_cfg) for p in u.params]
    weights = TensorReader(checkpoint_files(path, "model"), path / "model.safetensors")
    for key, shape in expected:
        weights.check(key, shape, "F32")
    weights.close()
    optimizer = TensorReader(checkpoint_files(path, "optimizer"), path / "optimizer.safetensors")
    for key, shape in expected:
        optimizer.check(f"exp_avg.{key}", shape, "F32")
        optimizer.check(f"exp_avg_sq.{key}", shape, "F32")
    try:
        rng = torch.load(path / RNG_STATE, weights_only=True)
        if not {"python", "torch"} <= set(rng):
            raise KeyError("python/torch")
    except FileNotFoundError:
        raise CheckpointError(f"{path / RNG_STATE}: missing") from None
    except Exception as e:  # pickle/zip errors of a corrupt file; their messages run to pages
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise CheckpointError(f"{path / RNG_STATE}: unreadable ({type(e).__name__}: {first})") from None
    try:
        train_config = json.loads((path / TRAIN_CONFIG).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path / TRAIN_CONFIG}: unreadable ({e})") from None
    return Checkpoint(path, ts, optimizer, rng, train_config)
