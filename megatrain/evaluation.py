"""Evaluation during training, with Hugging Face Trainer semantics: when to evaluate
(eval_strategy, eval_steps), the loss over the whole eval set (grpo: completions sampled for its
prompts and scored, TRL's eval metrics, `rollout.Rollout.evaluate`), and which checkpoint is the
best (metric_for_best_model, for load_best_model_at_end and pruning).

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

from .data import Batcher
from .errors import CheckpointError
from .host.state import HostState
from .io import manifest
from .io.checkpoint import TrainerState, checkpoint_dir, run_id_of
from .io.outputs import interval_steps
from .io.reader import checkpoint_files
from .io.weights import load_hf_weights
from .metrics import mean_metrics
from .models.config import ModelConfig
from .stages import build_stage_samples, grpo_prompts, in_order


class Evaluator:
    """The evaluation of one run. Building it tokenizes and checks eval_dataset (so bad eval data
    stops the run before anything is written); with eval_strategy `no` it never evaluates."""

    def __init__(
        self,
        cfg,
        tokenizer,
        total_steps: int,
        steps_per_epoch: int,
        vocab_size: int | None = None,
        pad_id: int = 0,
        warn: Callable[[str], None] = print,
        vision=None,
    ):
        """`vocab_size` bounds the eval data's token ids (the model's); `pad_id` pads its
        micro-batches (the training data's); `warn` hears of rows dropped from it; `vision` reads
        the images of a vision-language model's data (data/vision.py)."""
        self.batcher: Batcher | None = None
        self.prompts = None  # grpo: the eval prompts, sampled and scored
        self.batch_size = cfg.per_device_eval_batch_size
        self.interval = 0
        if cfg.eval_strategy != "no" and cfg.grpo() is not None:
            self.prompts = grpo_prompts(cfg, tokenizer, vocab_size, "eval_dataset")
            self.num_samples = len(self.prompts)
        elif cfg.eval_strategy != "no":
            samples = build_stage_samples(
                cfg,
                tokenizer,
                vocab_size,
                "eval_dataset",
                cfg.per_device_eval_batch_size,
                warn,
                pad_id,
                vision,
            )
            self.num_samples = len(samples)
            pixels = vision.pixels if vision is not None else None
            self.batcher = in_order(cfg, samples, cfg.per_device_eval_batch_size, pad_id, pixels)
        if self.enabled:
            if cfg.eval_strategy == "epoch":
                self.interval = steps_per_epoch
            else:
                self.interval = interval_steps(cfg.eval_steps, total_steps)
        self.total_steps = total_steps
        self.perplexity = cfg.stage == "sft"  # exp(loss) means something for a token loss only
        self.on_start = cfg.eval_on_start
        self.load_best_at_end = cfg.load_best_model_at_end
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
        return self.batcher is not None or self.prompts is not None

    def due(self, step: int) -> bool:
        """Whether to evaluate after `step` optimizer steps: every interval and after the last
        step; at step 0 (before training) only with eval_on_start."""
        if not self.enabled:
            return False
        if step == 0:
            return self.on_start
        return step % self.interval == 0 or step == self.total_steps

    def evaluate(
        self, engine, step: int, epoch: float, progress: Callable[[int], Any], rollout=None
    ) -> dict[str, Any]:
        """The eval loss of the model as it is after `step` steps (grpo: its eval rewards, sampled
        by `rollout`), as a metrics record with Hugging Face names. `progress(total)` makes a
        tqdm-like bar over the eval chunks."""
        if self.prompts is not None:
            return self._evaluate_rollouts(rollout, step, epoch, progress)
        t0 = time.perf_counter()
        # In a data-parallel world rank r takes every r-th chunk; the sums meet at the end.
        world = engine.collective
        # Summed on the device in float64, so large eval sets neither drift nor sync per chunk.
        # loss, its count (label tokens; micro-batches for a preference stage), label tokens, tokens
        sums = torch.zeros(4, dtype=torch.float64, device=engine.device)
        mine = range(world.rank, self.batcher.steps_per_epoch, world.world_size)
        with progress(len(mine)) as bar:
            for i, micro_batches in enumerate(self.batcher.epoch_steps()):
                if i % world.world_size != world.rank:
                    continue
                loss_sum, n = engine.eval_loss(micro_batches)
                sums[0] += loss_sum.double()
                sums[1] += n
                sums[2] += sum(mb.num_label_tokens for mb in micro_batches)
                sums[3] += sum(mb.num_tokens for mb in micro_batches)
                bar.update(1)
        for _ in range(-(-self.batcher.steps_per_epoch // world.world_size) - len(mine)):
            engine.keep_pace()  # the ranks' sweeps pair up (sharded: their weight gathers do)
        total, count, n_label, n_tokens = world.sum_(sums).tolist()  # the one host sync
        n_label, n_tokens = int(n_label), int(n_tokens)
        loss = total / count
        metrics = mean_metrics(engine.objective.take_metrics(), world, prefix="eval_")
        dt = time.perf_counter() - t0
        record = {
            "step": step,
            "epoch": epoch,
            "eval_loss": loss if math.isfinite(loss) else None,  # JSON has no NaN
            "eval_perplexity": math.exp(loss) if loss < 700 and self.perplexity else None,
            "eval_runtime": dt,
            "eval_samples_per_second": self.num_samples / dt,
            "eval_tokens_per_s": n_tokens / dt,
            "eval_label_tokens": n_label,
            **metrics,
        }
        self._last = record
        return record

    def _evaluate_rollouts(self, rollout, step: int, epoch: float, progress) -> dict[str, Any]:
        """grpo: the eval prompts' completions sampled and scored (TRL's eval_ metrics)."""
        t0 = time.perf_counter()
        metrics = rollout.evaluate(self.prompts, self.batch_size, progress, step)
        dt = time.perf_counter() - t0
        record = {
            "step": step,
            "epoch": epoch,
            **{f"eval_{k}": v for k, v in metrics.items()},
            "eval_runtime": dt,
            "eval_samples_per_second": self.num_samples / dt,
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
        """Continue with the best checkpoint of a resumed run's trainer state, if it is still
        there and still this run's (another run in the same output_dir may have replaced a
        checkpoint of the same step)."""
        if ts.best_model_checkpoint is None or ts.best_global_step is None:
            return
        best = Path(ts.best_model_checkpoint)
        try:
            ours = best.is_dir() and run_id_of(best) == ts.run_id
        except CheckpointError:  # no readable trainer_state.json: not a checkpoint any more
            ours = False
        if not ours:
            warn(
                f"megatrain: warning: the best checkpoint {best} of the resumed run no longer exists "
                "or was replaced by another run's; ignoring it"
            )
            return
        self.best_metric, self.best_step = ts.best_metric, ts.best_global_step
        self.best_checkpoint = best

    def load_best(self, state: HostState, model_cfg: ModelConfig, progress: bool) -> str | None:
        """With load_best_model_at_end, put the best checkpoint's weights (checked against its
        manifest) into `state`, which holds the last step's, so that final/ is the best model.
        Returns what to tell the user; None when there is nothing to load."""
        best = self.best_checkpoint
        if not self.load_best_at_end or best is None:
            return None
        if self.best_step != self.total_steps:
            manifest.verify(best, only={f.name for f in checkpoint_files(best).values()}, progress=progress)
            load_hf_weights(state, best, model_cfg, progress=progress)
        return f"megatrain: final/ is the best checkpoint, {best.name} ({self.metric} {self.best_metric:.4f})"
