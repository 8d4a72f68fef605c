"""A run's output_dir: what a run may write there, when it saves, and whether that fits.

* **A used directory.** A fresh run (not resuming) refuses an output_dir that holds a previous
  run's outputs (checkpoint-N, metrics.jsonl, final/), as Hugging Face's scripts do, unless
  `overwrite_output_dir: true`. Even then nothing is deleted silently: the previous
  checkpoints stay (pruning only ever touches this run's lineage; a checkpoint of a step this
  run also saves is replaced), the run's own files (metrics.jsonl, train_config.json,
  plan.json; grpo's completions.jsonl, eval_completions.jsonl) are renamed aside (`metrics-<time>.jsonl`), and final/ is replaced at the end; a
  message lists all of this, naming each checkpoint that stays and each that is replaced (so
  does a resume, for another run's checkpoints beside its own). train_config.json and
  plan.json alone do not make a directory a used one (a fresh run keeps them aside as well).
* **Every name is checked before step one** (`check_names`): a checkpoint-N the schedule saves
  that is not a megatrain checkpoint, a run file that is not a file, final/ that megatrain did
  not write, are refused before training, not found at save time.
* **final/** is replaced only if it is a model directory megatrain wrote (its manifest says
  so); anything else there is refused before training starts.
* **metrics.jsonl on resume** is trimmed to the checkpoint's step only if it records the
  checkpoint's run (its record of that step equals the checkpoint's log_history entry);
  otherwise it is renamed aside (with train_config.json and plan.json) and a new one starts.
* **Disk space.** Before training, the bytes the run will write (the checkpoints that coexist
  under save_total_limit, one more while a new one is written, and final/ in save_dtype) are
  compared with the free space; too little is refused with the numbers (preflight_check=false:
  a warning).
* **When to save** (`SaveSchedule`): Hugging Face's save_strategy and save_steps.
"""

from __future__ import annotations

import json
import math
import os
import secrets
import time
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, ConfigError, OutputError
from ..planning.memory import PLAN_FILE
from ..planning.placement import fmt_bytes
from ..trackers import is_eval
from . import manifest
from .checkpoint import (
    TRAIN_CONFIG,
    Checkpoint,
    TrainerState,
    checkpoint_bytes,
    checkpoint_dir,
    checkpoint_step,
    checkpoint_target,
    lineages,
    list_checkpoints,
    remove_temporaries,
    run_id_of,
)
from .writing import AtomicDir, free_bytes, same_file_system

METRICS, FINAL = "metrics.jsonl", "final"
COMPLETIONS, EVAL_COMPLETIONS = "completions.jsonl", "eval_completions.jsonl"  # grpo's samples
# One run's own files, kept aside together.
RUN_FILES = (METRICS, TRAIN_CONFIG, PLAN_FILE, COMPLETIONS, EVAL_COMPLETIONS)


def new_run_id() -> str:
    """A lineage id: the UTC start time (readable, sortable) and a random suffix."""
    return time.strftime("%Y%m%d-%H%M%S", time.gmtime()) + "-" + secrets.token_hex(3)


def interval_steps(value: int | float, total_steps: int) -> int:
    """The steps a save_steps or eval_steps value means in a run of `total_steps`: a whole
    number as it is; a fraction (< 1) of the run rounded up, as in transformers, once
    floating-point noise is dropped (0.07 x 100 is 7 steps, not 8)."""
    return int(value) if value >= 1 else math.ceil(round(value * total_steps, 9))


@dataclass(frozen=True)
class SaveSchedule:
    """Which steps write a checkpoint (a signal always does, whatever this says)."""

    every: int
    """Save every this many steps (0: never during training)."""
    at_end: bool
    """Save the last step, so training can be continued (false for save_strategy=no)."""
    total_steps: int

    @classmethod
    def of(cls, cfg, total_steps: int, steps_per_epoch: int) -> SaveSchedule:
        if cfg.save_strategy == "no":
            return cls(0, False, total_steps)
        if cfg.save_strategy == "epoch":
            return cls(steps_per_epoch, True, total_steps)
        return cls(interval_steps(cfg.save_steps, total_steps), True, total_steps)

    def due(self, step: int) -> bool:
        return bool(self.every and step % self.every == 0) or (self.at_end and step == self.total_steps)

    def saves(self, step: int, start: int = 0) -> bool:
        """Whether a run continuing from step `start` writes checkpoint-`step` (signals aside)."""
        return start < step <= self.total_steps and self.due(step)

    def count(self, start: int) -> int:
        """Checkpoints written after step `start` (signals aside)."""
        n = self.total_steps // self.every - start // self.every if self.every else 0
        return n + int(
            self.at_end
            and start < self.total_steps
            and not (self.every and self.total_steps % self.every == 0)
        )


def _metrics_record(path: Path, step: int) -> dict | None:
    """The optimizer step's record of `step` in a metrics.jsonl (not an evaluation's), if any."""
    found = None
    with open(path) as f:
        for line in f:
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if isinstance(rec, dict) and rec.get("step") == step and not is_eval(rec):
                found = rec
    return found


def _records_run_of(path: Path, ts: TrainerState) -> bool:
    """Whether metrics.jsonl was written by the run that saved `ts`: its record of the
    checkpoint's step is the one in the checkpoint's log_history (step_time_s is unique; an
    evaluation's record of the same step has none of these keys, so it is not compared)."""
    history = (r for r in reversed(ts.log_history) if not is_eval(r))
    want = next((r for r in history if r.get("step") == ts.global_step), None)
    got = _metrics_record(path, ts.global_step)
    keys = ("step", "loss", "grad_norm", "tokens", "step_time_s")
    return want is not None and got is not None and all(want.get(k) == got.get(k) for k in keys)


def _aside(paths: list[Path]) -> list[str]:
    """Rename a previous run's files to `<stem>-<time>[-n]<suffix>`, one time for all (the first
    file's modification time), the same free `n` for all. Returns the new names."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(paths[0].stat().st_mtime))
    for n in range(1, 1000):
        tag = stamp if n == 1 else f"{stamp}-{n}"
        new = [p.with_name(f"{p.stem}-{tag}{p.suffix}") for p in paths]
        if not any(p.exists() for p in new):
            for old, p in zip(paths, new, strict=True):
                os.replace(old, p)
            return [p.name for p in new]
    raise OutputError(f"{paths[0]}: cannot find a free name to keep it under")


class OutputDir:
    """The rules of one run's output_dir. Construct it before anything is written: it refuses
    what the rules forbid (ConfigError/OutputError, one line). `take_over()` then makes the
    directory this run's and returns what the user should be told."""

    def __init__(self, cfg, resume: Checkpoint | None):
        self.path = Path(cfg.output_dir)
        self.cfg, self.resume = cfg, resume
        self.run_id = resume.trainer_state.run_id if resume else new_run_id()
        # The rule final/ is written under at the end, checked now rather than after training.
        why_not = (
            "training replaces only a model directory megatrain wrote: move it or choose another output_dir"
        )
        AtomicDir(self.path / FINAL, manifest.MODEL, why_not=why_not).check_target()
        self.replaced: list[str] = []
        """Other runs' checkpoints at steps this run saves (check_names finds them)."""
        self.previous = [p.name for _, p in list_checkpoints(self.path)]
        self.previous += [n for n in (METRICS, FINAL) if (self.path / n).exists()]
        if resume is None and self.previous and not cfg.overwrite_output_dir:
            listed = ", ".join(self.previous[:3] + (["..."] if len(self.previous) > 3 else []))
            raise ConfigError(
                f"output_dir: {self.path} holds a previous run ({listed}); continue it with "
                "resume_from_checkpoint=true, start a new run there with overwrite_output_dir=true "
                "(nothing is deleted), or choose another output_dir"
            )

    def check_names(self, schedule: SaveSchedule) -> None:
        """Refuse (OutputError, one line) a name this run writes that holds what it may not
        replace: a checkpoint-N the schedule saves that is not a megatrain checkpoint, a run file
        (metrics.jsonl, train_config.json, plan.json) that is not a file, TensorBoard's runs/
        that is not a directory (final/ was checked on construction). Notes the checkpoints of
        other runs that this run's saves replace."""
        if not self.path.is_dir():
            return
        start = self.resume.trainer_state.global_step if self.resume else 0
        for p in sorted(self.path.iterdir()):
            step = checkpoint_step(p.name)
            if step is None or not schedule.saves(step, start):
                continue
            try:
                checkpoint_target(self.path, step).check_target()
            except OutputError as e:
                raise OutputError(f"{e} (this run saves step {step})") from None
            if self.of_another_run(step):
                self.replaced.append(p.name)
        for name in RUN_FILES:
            p = self.path / name
            if (p.exists() or p.is_symlink()) and not p.is_file():
                raise OutputError(
                    f"{p}: exists and is not a file; this run writes its {name} there: move it away"
                )
        runs = self.path / "runs"
        if self.cfg.report_to == "tensorboard" and runs.exists() and not runs.is_dir():
            raise OutputError(f"{runs}: exists and is not a directory; TensorBoard writes its events there")

    def of_another_run(self, step: int) -> bool:
        """Whether output_dir holds another run's checkpoint of `step` (one this run's save of that
        step replaces)."""
        path = checkpoint_dir(self.path, step)
        try:
            return path.is_dir() and run_id_of(path) != self.run_id
        except CheckpointError:
            return False  # not a megatrain checkpoint: check_names refused it

    def check_disk_space(self, num_params: int, schedule: SaveSchedule, tier: int = 0, warn=print) -> None:
        """Refuse (warn, with preflight_check=false) a run whose checkpoints and final/ would not
        fit in the free space of output_dir's file system; `tier`: the disk tier's bytes, which
        share it where offload_dir is on the same file system (of several folders: the share the
        stripe puts in each one there, about 1/N of the tier)."""
        cfg = self.cfg
        ckpt = checkpoint_bytes(num_params, cfg.save_only_model, cfg.moments())
        saves = schedule.count(self.resume.trainer_state.global_step if self.resume else 0)
        existing = len(lineages(self.path).get(self.run_id, [])) if self.resume else 0
        # Pruning runs after a new checkpoint is committed: keep + 1 exist for a moment.
        at_once = min(saves, max(1, cfg.save_total_limit + 1 - existing)) if cfg.save_total_limit else saves
        final = num_params * (2 if cfg.save_dtype == "bfloat16" else 4) if cfg.save_final_model else 0
        folders = cfg.offload_dirs()
        there = sum(same_file_system(self.path, Path(d)) for d in folders) if tier else 0
        shared = -(-tier * there // len(folders)) if there else 0
        need, free = at_once * ckpt + final + shared, free_bytes(self.path)
        if need <= free:
            return
        msg = (
            f"not enough disk space in {self.path}: this run writes up to {fmt_bytes(need)} "
            f"({at_once} checkpoint(s) of {fmt_bytes(ckpt)} at once"
            + (f", final/ {fmt_bytes(final)} in {cfg.save_dtype}" if final else "")
            + (f", the disk tier in offload_dir {fmt_bytes(shared)}" if shared else "")
            + f"), {fmt_bytes(free)} free; lower save_total_limit, set save_only_model=true "
            "or save_strategy=no, or choose another output_dir (preflight_check=false runs anyway)"
        )
        if cfg.preflight_check:
            raise OutputError(msg)
        warn(f"megatrain: warning: {msg}")

    def take_over(self) -> list[str]:
        """Create output_dir, clear what an interrupted save left, keep a previous run's files
        aside, and write train_config.json (the trainer writes plan.json). Returns messages for
        the user."""
        self.path.mkdir(parents=True, exist_ok=True)
        remove_temporaries(self.path)
        notes = []
        metrics = self.path / METRICS
        ts = self.resume.trainer_state if self.resume else None
        if ts is None or (metrics.exists() and not _records_run_of(metrics, ts)):
            old = [self.path / n for n in RUN_FILES if (self.path / n).exists()]
            if old:
                kept = ", ".join(f"{p.name} as {new}" for p, new in zip(old, _aside(old), strict=True))
                notes.append(f"megatrain: kept the previous run's {kept}")
        if self.resume is None and self.previous:
            checkpoints = [n for n in self.previous if n.startswith("checkpoint-")]
            if checkpoints:
                notes.append(f"megatrain: overwrite_output_dir: a previous run's {self._fate(checkpoints)}")
            if FINAL in self.previous:
                notes.append(
                    f"megatrain: overwrite_output_dir: {self.path / FINAL} will be replaced at the end"
                )
        runs = lineages(self.path)
        others = [n for rid, found in runs.items() if rid != self.run_id for _, n in found]
        if self.resume and others:
            newer = list(runs)[-1] != self.run_id
            notes.append(
                f"megatrain: resuming run {self.run_id}; {self.path} also holds {'a newer' if newer else 'another'} "
                f"run's {self._fate([p.name for p in others])}"
            )
        (self.path / TRAIN_CONFIG).write_text(json.dumps(self.cfg.to_dict(), indent=2) + "\n")
        return notes

    def _fate(self, checkpoints: list[str]) -> str:
        """What becomes of other runs' `checkpoints`: kept, or replaced by a save of this run."""
        kept = [n for n in checkpoints if n not in self.replaced]
        replaced = [n for n in checkpoints if n in self.replaced]
        said = [f"{', '.join(kept)}: left as they are (never pruned by this run)"] if kept else []
        if replaced:
            said.append(f"{', '.join(replaced)}: replaced by this run's checkpoint of the same step")
        return "; ".join(said)
