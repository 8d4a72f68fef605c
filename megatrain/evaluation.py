"""Evaluation during training, with Hugging Face Trainer semantics: when to evaluate
(eval_strategy, eval_steps), the loss over the whole eval set, and which checkpoint is the best
(metric_for_best_model, for load_best_model_at_end and pruning).

eval_loss is the training loss's definition over the eval set: (sum of token losses) / (number
of label tokens); eval_perplexity = exp(eval_loss). The eval set is batched as the training data
is (same max_length and packing, so sequences have training shapes) but in file order, every
sample exactly once, the last micro-batch possibly short. gradient_accumulation_steps
micro-batches of per_device_eval_batch_size pass each layer in one visit, as a training step's
do, so the weights cross to the GPU once per such chunk. Evaluation draws no random numbers and
touches no optimizer state: a run with evaluation trains exactly as one without.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .checkpoint import TrainerState, checkpoint_dir
from .data import Batcher, build_samples, pad_token_id


class Evaluator:
    """The evaluation of one run. Building it tokenizes and checks eval_dataset (so bad eval data
    stops the run before anything is written); with eval_strategy `no` it never evaluates."""

    def __init__(self, cfg, tokenizer, total_steps: int, steps_per_epoch: int):
        self.batcher: Batcher | None = None
        self.interval = 0
        if cfg.eval_strategy != "no":
            samples = build_samples(cfg, tokenizer, key="eval_dataset")
            self.num_samples = len(samples)
            self.batcher = Batcher(
                samples,
                batch_size=cfg.per_device_eval_batch_size,
                grad_accum=cfg.gradient_accumulation_steps,
                max_length=cfg.max_length,
                packing=cfg.packing,
                shuffle=False,
                pad_id=pad_token_id(tokenizer),
                drop_last=False,
            )
            if cfg.eval_strategy == "epoch":
                self.interval = steps_per_epoch
            elif cfg.eval_steps >= 1:
                self.interval = cfg.eval_steps
            else:  # a fraction of the run rounds up, as in transformers (but 0.07 x 100 is 7, not 8)
                self.interval = math.ceil(round(cfg.eval_steps * total_steps, 9))
        self.total_steps = total_steps
        self.on_start = cfg.eval_on_start
        metric = cfg.metric_for_best_model
        self.metric = None if metric is None else metric if metric.startswith("eval_") else f"eval_{metric}"
        self.greater_is_better = bool(cfg.greater_is_better)
        self.output_dir = Path(cfg.output_dir)
        self.best_metric: float | None = None
        self.best_step: int | None = None
        self.best_checkpoint: Path | None = None
        self._last: dict[str, Any] | None = None  # the latest evaluation's record

    @property
    def enabled(self) -> bool:
        return self.batcher is not None

    def due(self, step: int) -> bool:
        """Whether to evaluate after `step` optimizer steps: every interval and after the last
        step; at step 0 (before training) only with eval_on_start."""
        if not self.enabled:
            return False
        if step == 0:
            return self.on_start
        return step % self.interval == 0 or step == self.total_steps

    def evaluate(self, engine, step: int, epoch: float, progress: Callable[[int], Any]) -> dict[str, Any]:
        """The eval loss of the model as it is after `step` steps, as a metrics record with
        Hugging Face names. `progress(total)` makes a tqdm-like bar over the eval chunks."""
        t0 = time.perf_counter()
        # Summed on the device in float64, so large eval sets neither drift nor sync per chunk.
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        n_label = n_tokens = 0
        with progress(self.batcher.steps_per_epoch) as bar:
            for micro_batches in self.batcher.epoch_steps():
                loss_sum, n = engine.eval_loss(micro_batches)
                total += loss_sum.double()
                n_label += n
                n_tokens += sum(mb.num_tokens for mb in micro_batches)
                bar.update(1)
        loss = total.item() / n_label  # the one host sync
        dt = time.perf_counter() - t0
        record = {
            "step": step,
            "epoch": epoch,
            "eval_loss": loss if math.isfinite(loss) else None,  # JSON has no NaN
            "eval_perplexity": math.exp(loss) if loss < 700 else None,
            "eval_runtime": dt,
            "eval_samples_per_second": self.num_samples / dt,
            "eval_tokens_per_s": n_tokens / dt,
            "eval_label_tokens": n_label,
        }
        self._last = record
        return record

    # ------------------------------------------------------------------ best checkpoint
    def checkpointed(self, step: int) -> None:
        """checkpoint-`step` is being saved: it becomes the best if it was just evaluated and
        beats the best so far. Only evaluated checkpoints compete (load_best_model_at_end makes
        every checkpoint an evaluated one)."""
        if self.metric is None or self._last is None or self._last["step"] != step:
            return
        value = self._last[self.metric]
        if value is None:
            return
        if self.best_metric is None or (
            value > self.best_metric if self.greater_is_better else value < self.best_metric
        ):
            self.best_metric, self.best_step = value, step
            self.best_checkpoint = checkpoint_dir(self.output_dir, step)

    def state(self) -> dict[str, Any]:
        """The TrainerState fields (Hugging Face names) that carry the best checkpoint."""
        best = self.best_checkpoint
        return {
            "best_metric": self.best_metric,
            "best_global_step": self.best_step,
            "best_model_checkpoint": None if best is None else str(best),
        }

    def restore(self, ts: TrainerState, warn: Callable[[str], None]) -> None:
        """Continue with the best checkpoint of a resumed run's trainer state."""
        if ts.best_model_checkpoint is None or ts.best_global_step is None:
            return
        if not Path(ts.best_model_checkpoint).is_dir():
            warn(
                f"megatrain: warning: the best checkpoint {ts.best_model_checkpoint} of the resumed run "
                "no longer exists; ignoring it"
            )
            return
        self.best_metric, self.best_step = ts.best_metric, ts.best_global_step
        self.best_checkpoint = Path(ts.best_model_checkpoint)
