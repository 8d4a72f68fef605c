"""Resumable training checkpoints.

Layout of `output_dir/checkpoint-{step}/` (format 1):

    model.safetensors            fp32 master weights, Hugging Face keys (`model.layers.0...`);
                                 shards `model-0000i-of-0000N.safetensors` + index when large.
                                 With config.json beside it this is a loadable HF model.
    optimizer.safetensors        AdamW moments, keys `exp_avg.<hf key>` and `exp_avg_sq.<hf key>`
                                 in their format's dtype (fp32, bf16, 8-bit codes with
                                 `exp_avg_absmax.<hf key>` and `exp_avg_sq_absmax.<hf key>`, fp32
                                 per 256 elements: host/moments.py); sharded the same way. Keyed by
                                 parameter, not by the host layout, so the layout may change
                                 between versions.
    config.json                  the model config (plus generation_config.json)
    trainer_state.json           global_step, epoch, log_history tail (Hugging Face names), the
                                 run_id of the run (lineage) that wrote it, and what resuming
                                 needs: optimizer_step (AdamW's bias-correction count: skipped
                                 steps do not advance it), lr_scheduler (schedule parameters and
                                 step), data_state (Batcher.state_dict()), nonfinite_streak,
                                 optimizer_moments (the moments' format: a resume keeps it); with
                                 metric_for_best_model, best_metric, best_global_step and
                                 best_model_checkpoint (HF names)
    rng_state.pt                 python `random`, torch CPU and CUDA generator states
    train_config.json            the run's configuration
    tokenizer files              when the run has a tokenizer (chat template included)
    rollout.pt                   grpo, taken before a rollout's last step: the rollout
                                 (rl/rollout.py), which the resumed run trains on again
    megatrain_manifest.json      size and CRC-32 of every file above (manifest.py), verified at
                                 resume; checkpoints written before it existed resume unverified

With save_only_model the optimizer and RNG files are left out (`weights_only` in
trainer_state.json): such a checkpoint is a loadable model, but it cannot be resumed.

A checkpoint is written into a dot-named temporary directory in output_dir, fsynced and renamed
into place (writing.AtomicDir), so a checkpoint-N directory is either complete or absent, and
killing the process at any moment leaves the previous checkpoints intact. Pruned checkpoints
are renamed to a dot name before they are deleted, for the same reason.

*Lineage.* Every run has a run_id (a fresh run makes one; a resumed run carries on its
checkpoint's), recorded in each checkpoint's trainer_state.json. Pruning deletes only the
running lineage's checkpoints, and `resume_from_checkpoint: true` picks the newest checkpoint
of the lineage that saved most recently. Checkpoints from before run ids form one lineage.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import random
import re
import shutil
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import torch

from ..errors import CheckpointError, ConfigError
from ..host.moments import FP32, Moments, named
from ..host.state import HostState, build_units, checkpoint_entries, moment_entries
from ..models.config import ModelConfig
from . import manifest
from .reader import TensorReader, checkpoint_files
from .weights import read_generation_config, write_model_config
from .writing import ST_DTYPES, AtomicDir

FORMAT = 1
TRAINER_STATE = "trainer_state.json"
RNG_STATE = "rng_state.pt"
TRAIN_CONFIG = "train_config.json"
HISTORY = 1000  # log_history records kept in trainer_state.json (metrics.jsonl has them all)
_NAME = re.compile(r"^checkpoint-(\d+)$")
# Also the temporaries of the run's small files written by rename (metrics.jsonl, plan.json).
_TEMPORARY = re.compile(r"^\.(checkpoint-\d+|final|metrics\.jsonl|plan\.json)\.(tmp|old|del)-")


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
    run_id: str | None = None
    """The lineage: the run that started from scratch and every resume of it (None: before ids)."""
    weights_only: bool = False
    """Saved with save_only_model: no optimizer or RNG state, so it cannot be resumed."""
    best_metric: float | None = None
    """metric_for_best_model of the best evaluated checkpoint so far."""
    best_global_step: int | None = None
    best_model_checkpoint: str | None = None
    """output_dir/checkpoint-N of the best checkpoint (pruning never deletes it)."""
    objective_state: dict[str, Any] = field(default_factory=dict)
    """What the objective carries from step to step (`Objective.state_dict`); empty for the
    built-in ones."""
    optimizer_moments: str = FP32.name
    """How optimizer.safetensors stores the moments (`Moments.name`: fp32, bf16, 8bit; a
    checkpoint from before `optim` holds fp32 ones)."""

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
            raise CheckpointError(f"{path}: unreadable, the file is corrupt ({e})") from None
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
        # Fields added after format 1 was first written: absent from older checkpoints.
        optional = {
            "run_id": str,
            "weights_only": bool,
            "best_metric": (int, float),
            "best_global_step": int,
            "best_model_checkpoint": str,
            "objective_state": dict,
            "optimizer_moments": str,
        }
        for key, tp in optional.items():
            v = raw.get(key)
            if v is not None and (not isinstance(v, tp) or (tp is not bool and isinstance(v, bool))):
                raise CheckpointError(f"{path}: {key!r} is not a {getattr(tp, '__name__', 'number')}")
        present = {k: raw[k] for k in optional if raw.get(k) is not None}
        return cls(**{k: raw[k] for k in types}, **present)


def checkpoint_bytes(num_params: int, weights_only: bool = False, moments: Moments = FP32) -> int:
    """Tensor bytes of a checkpoint: fp32 weights, and the AdamW moments unless weights only (an
    absmax's partial blocks, one per tensor, not counted)."""
    return num_params * 4 + (0 if weights_only else math.ceil(num_params * moments.bytes_per_param))


# ---------------------------------------------------------------------------- finding
def list_checkpoints(output_dir: str | Path) -> list[tuple[int, Path]]:
    """(step, path) of every `checkpoint-N` directory in output_dir, oldest first. Temporary
    and half-deleted directories have dot names and never match."""
    d = Path(output_dir)
    if not d.is_dir():
        return []
    found = [(step, p) for p in d.iterdir() if (step := checkpoint_step(p.name)) is not None and p.is_dir()]
    return sorted(found)


def checkpoint_step(name: str) -> int | None:
    """N of a name `checkpoint-N`; None for any other name."""
    m = _NAME.match(name)
    return int(m.group(1)) if m else None


def checkpoint_dir(output_dir: str | Path, step: int) -> Path:
    """Where the checkpoint after `step` optimizer steps goes."""
    return Path(output_dir) / f"checkpoint-{step}"


def run_id_of(path: Path) -> str | None:
    """The lineage of a checkpoint (None for one from before run ids). Raises CheckpointError
    when its trainer_state.json is missing or unreadable (not a megatrain checkpoint)."""
    return TrainerState.read(path / TRAINER_STATE).run_id


def lineages(output_dir: str | Path) -> dict[str | None, list[tuple[int, Path]]]:
    """The megatrain checkpoints in output_dir by lineage, oldest first within each; the
    lineage that saved most recently comes last. Directories that are not megatrain
    checkpoints (no readable trainer_state.json) belong to none and are never touched."""
    found: dict[str | None, list[tuple[int, Path]]] = {}
    latest: dict[str | None, int] = {}
    for step, path in list_checkpoints(output_dir):
        try:
            run_id = run_id_of(path)
        except CheckpointError:
            continue
        found.setdefault(run_id, []).append((step, path))
        mtime = (path / TRAINER_STATE).stat().st_mtime_ns
        latest[run_id] = max(latest.get(run_id, 0), mtime)
    # Ties (coarse file times) go to the later-started run: run ids begin with their start time.
    return {k: found[k] for k in sorted(found, key=lambda k: (latest[k], k or ""))}


def resume_path(cfg) -> Path | None:
    """The checkpoint `cfg.resume_from_checkpoint` names: None when not resuming, for `true`
    the newest checkpoint (by step) of the lineage that saved last in output_dir, else the
    given directory."""
    value = cfg.resume_from_checkpoint
    if value is None or value is False or (isinstance(value, str) and value.lower() in ("false", "no")):
        return None
    if value is True or (isinstance(value, str) and value.lower() in ("true", "yes", "latest")):
        found = lineages(cfg.output_dir)
        latest = list(found.values())[-1][-1] if found else (-1, None)
        # A newer checkpoint whose trainer_state.json is broken is not passed over in silence.
        for step, path in reversed(list_checkpoints(cfg.output_dir)):
            if step > latest[0] and (path / TRAINER_STATE).exists():
                try:
                    TrainerState.read(path / TRAINER_STATE)
                except CheckpointError as e:
                    raise CheckpointError(
                        f"resume_from_checkpoint: {e}; resume from another checkpoint by naming it "
                        f"(resume_from_checkpoint=DIR), or move {path.name} away"
                    ) from None
        if latest[1] is None:
            raise ConfigError(f"resume_from_checkpoint: no checkpoint-* directory in {cfg.output_dir}")
        return latest[1]
    path = Path(value)
    if not path.is_dir():
        raise ConfigError(f"resume_from_checkpoint: {path} is not a directory")
    return path


def remove_temporaries(output_dir: Path) -> None:
    """Delete what an interrupted save, prune, metrics trim or plan.json write left behind
    (dot-named; never a checkpoint). Only the run holding output_dir's lock (ownership.py) calls
    it, so no other run is writing there."""
    for p in output_dir.iterdir():
        if _TEMPORARY.match(p.name):
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)


# ---------------------------------------------------------------------------- saving
def _moments(state: HostState):
    """(key, shape) of every tensor of the AdamW moments, `exp_avg.<key>` / `exp_avg_sq.<key>`
    (and an 8-bit format's absmax) parameter by parameter, what gives each (a view of the host
    moments, or the pieces the disk tier reads from its file a block at a time: host/disk.py), and
    each key's dtype."""
    entries, gets, dtypes = [], {}, {}
    tier = state.tier
    for unit in state.units:
        on_disk = tier is not None and tier.holds(unit)
        for f in state.moments.fields:
            flat = None if on_disk else state.flat(unit, f.name)
            for p, (key, start, shape) in zip(unit.params, moment_entries(unit, f)):
                entries.append((key, shape))
                dtypes[key] = getattr(torch, f.dtype)
                if on_disk:
                    gets[key] = partial(tier.pieces, unit, f.name, p.offset, p.offset + p.numel)
                else:
                    gets[key] = partial(torch.Tensor.view, flat[start : start + math.prod(shape)], shape)
    return entries, lambda key: gets[key](), dtypes.__getitem__


def rng_state() -> dict[str, Any]:
    """The global generators a run draws from: Python's `random`, torch CPU, and CUDA if used."""
    out: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out["cuda"] = torch.cuda.get_rng_state_all()
    return out


def _is_checkpoint(path: Path) -> bool:
    """A checkpoint directory megatrain wrote (with a manifest, or from before manifests)."""
    kind = manifest.kind_of(path)
    if kind is not None:
        return kind == manifest.CHECKPOINT
    try:
        run_id_of(path)
    except CheckpointError:
        return False
    return True


def checkpoint_target(
    output_dir: str | Path, step: int, nbytes: int = 0, progress: bool = False
) -> AtomicDir:
    """The AtomicDir that writes `checkpoint-{step}`: it replaces only a megatrain checkpoint
    (its `check_target()` tells before anything is written)."""
    why_not = "it is not a megatrain checkpoint, so it is never replaced: move it away"
    return AtomicDir(
        checkpoint_dir(output_dir, step), manifest.CHECKPOINT, _is_checkpoint, why_not, nbytes, progress
    )


def save_checkpoint(
    output_dir: Path,
    trainer_state: TrainerState,
    state: HostState,
    model_cfg: ModelConfig,
    train_config: dict[str, Any],
    tokenizer=None,
    generation_from: str | Path | None = None,
    max_shard_bytes: int = 5 * 10**9,
    progress: bool = False,
    write_tensors: Callable[[AtomicDir], None] | None = None,
    files: dict[str, bytes] | None = None,
) -> Path:
    """Write `output_dir/checkpoint-{global_step}` atomically (see the module docstring) and
    return it; `trainer_state.weights_only` leaves the optimizer and RNG state out. An existing
    directory of that name is replaced only if it is a megatrain checkpoint. The host state
    must be current: call `transport.synchronize()` first. `write_tensors(d)` writes the weights
    and moments in place of the whole state's (a state partitioned over machines: partition.py).
    `files`: more files, name -> contents, that a resume reads (grpo's rollout)."""
    nbytes = checkpoint_bytes(state.num_params, trainer_state.weights_only, state.moments)
    with checkpoint_target(output_dir, trainer_state.global_step, nbytes, progress) as d:
        if write_tensors is not None:
            write_tensors(d)
        else:
            params = dict(state.checkpoint_tensors())
            entries = [(k, tuple(v.shape)) for k, v in params.items()]
            d.write_tensors("model", entries, torch.float32, params.__getitem__, max_shard_bytes)
            if not trainer_state.weights_only:
                entries, get, dtype = _moments(state)
                d.write_tensors("optimizer", entries, dtype, get, max_shard_bytes)
        write_model_config(
            d.path, model_cfg, torch.float32, read_generation_config(generation_from), tokenizer
        )
        if tokenizer is not None:
            from ..data.tokenizer import save_tokenizer

            save_tokenizer(tokenizer, d.path)
        if not trainer_state.weights_only:
            # Through Python's file API, so a full disk is an OSError like any other write.
            buffer = io.BytesIO()
            torch.save(rng_state(), buffer)
            (d.path / RNG_STATE).write_bytes(buffer.getvalue())
        for name, contents in (files or {}).items():
            (d.path / name).write_bytes(contents)
        (d.path / TRAIN_CONFIG).write_text(json.dumps(train_config, indent=2) + "\n")
        (d.path / TRAINER_STATE).write_text(json.dumps(trainer_state.to_json(), indent=2) + "\n")
        return d.commit()


def prune_checkpoints(
    output_dir: Path, keep: int | None, run_id: str | None, protect: str | Path | None = None
) -> list[Path]:
    """Delete all but the newest `keep` checkpoints (by step) of lineage `run_id`; other runs'
    checkpoints are never touched. Returns those deleted.

    `protect` (the best checkpoint) is never deleted and, as in transformers, counts toward
    `keep` when it is older than the newest `keep`, except that the newest always stays."""
    if keep is None:
        return []
    found = [p for _, p in lineages(output_dir).get(run_id, [])]
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
def _same_setting(old: Any, new: Any) -> bool:
    if isinstance(old, list) and isinstance(new, list):
        return len(old) == len(new) and all(map(_same_setting, old, new))
    if isinstance(old, str) and isinstance(new, str) and old != new:
        return os.path.realpath(old) == os.path.realpath(new)
    return old == new


@dataclass
class Checkpoint:
    """A checkpoint whose every piece has been checked (files, keys, shapes, dtypes, config)."""

    path: Path
    trainer_state: TrainerState
    optimizer: TensorReader
    rng: dict[str, Any]
    train_config: dict[str, Any]
    verified: bool
    """Its files matched the manifest's checksums (False: it has no manifest, from before them)."""

    def changed_settings(self, current: dict[str, Any], keys: Iterable[str]) -> list[str]:
        """`key: old -> new` for settings of `keys` that differ from the checkpoint's run (a path
        written another way that leads to the same place is the same)."""
        return [
            f"{k}: {self.train_config[k]!r} -> {current.get(k)!r}"
            for k in keys
            if k in self.train_config and not _same_setting(self.train_config[k], current.get(k))
        ]

    def load_moments(self, state: HostState) -> None:
        """Load the AdamW moments into `state` (the part of the model it holds), whose master
        weights build_model loaded from this checkpoint's model.safetensors; build_model calls it
        before the transport copies any state to the device (the units the plan keeps there).
        The disk tier's units' moments go to its file, a block at a time (host/disk.py)."""
        tier = state.tier
        for unit in state.units:
            entries = {f.name: list(moment_entries(unit, f)) for f in state.moments.fields}
            if tier is not None and tier.holds(unit):
                tier.fill(unit, entries, self.optimizer.get_range)
                continue
            for which, each in entries.items():
                state.load(unit, which, each, self.optimizer.get_range)

    def restore(self, state: HostState, batcher) -> TrainerState:
        """The rest of what a resume restores, in every process: the optimizer step count, the
        data position into `batcher` and the random generators. Returns the trainer state to
        continue from.

        The data position counts optimizer steps and every rank restores the same generator
        states (the first rank's, which it saved), so a checkpoint resumes exactly in a
        data-parallel world of any size with the same global batch."""
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


def open_checkpoint(
    path: str | Path, model_cfg: ModelConfig, progress: bool = False, moments: Moments = FP32
) -> Checkpoint:
    """Check a checkpoint completely before anything is allocated: trainer state, the moments'
    format (must be `moments`: a resume keeps the optimizer mode), model config (must equal
    `model_cfg`), every weight and moment tensor (present, shape, dtype; the safetensors headers
    are validated against the file sizes), RNG state, and last every file's checksum against the
    manifest. Raises a CheckpointError naming the file at fault."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory does not exist")
    ts = TrainerState.read(path / TRAINER_STATE)
    if ts.weights_only:
        raise CheckpointError(
            f"{path}: saved with save_only_model=true (weights only, no optimizer state), so it cannot "
            f"be resumed; start a new run from its weights with model_name_or_path={path}"
        )
    if ts.optimizer_moments != moments.name:
        try:
            theirs = ", ".join(f"{k}={v}" for k, v in named(ts.optimizer_moments).settings.items())
        except ValueError:
            raise CheckpointError(
                f"{path / TRAINER_STATE}: optimizer_moments {ts.optimizer_moments!r} is unknown"
            ) from None
        raise CheckpointError(
            f"{path}: its AdamW moments are {ts.optimizer_moments} ({theirs}), this run's {moments.name}; "
            f"a run resumes in the optimizer mode it saved (set {theirs}, or start a new run from its weights)"
        )
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
    units = build_units(model_cfg)
    weights = TensorReader(checkpoint_files(path, "model"), path / "model.safetensors")
    for key, shape in checkpoint_entries(units):
        weights.check(key, shape, "F32")
    weights.close()
    optimizer = TensorReader(checkpoint_files(path, "optimizer"), path / "optimizer.safetensors")
    for f in moments.fields:  # per parameter
        st = ST_DTYPES[getattr(torch, f.dtype)]
        for key, _, shape in (e for u in units for e in moment_entries(u, f)):
            optimizer.check(key, shape, st)
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
    verified = manifest.verify(path, progress=progress)
    return Checkpoint(path, ts, optimizer, rng, train_config, verified)
