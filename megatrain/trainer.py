"""The training loop: batch, forward and backward sweeps, clip, optimizer, log, checkpoint.

`_train` is the step loop, read top to bottom. `_setup` checks the inputs (`_check_inputs`),
builds the model and takes output_dir over; what it returns, a `_Run`, holds the run's parts and
its phases: `log_step`, `evaluate`, `save`, `export` (output_dir/final) and `close`.

The machinery lives elsewhere: io/checkpoint.py (save, prune, resume), io/outputs.py (the rules
of output_dir, when to save, disk space), io/ownership.py (the run's lock on output_dir),
guard.py (signals, non-finite steps), plan.py (the memory preflight), planning/memory.py
(plan.json), metrics.py (metrics.jsonl, progress bar, the experiment trackers), evaluation.py
(eval loss, the best checkpoint).
"""

from __future__ import annotations

import contextlib
import math
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from . import STARTED
from .checks import check_outputs, run_warnings, shared_prompts_refused
from .config import TrainConfig, parse_size, warmup_of
from .data import Batcher, load_tokenizer, pad_token_id
from .data.prompts import prompt_samples
from .data.vision import VisionData, load_processor
from .determinism import full_determinism
from .devices import resolve_device
from .engine.optim import AdamWConfig
from .engine.schedule import lr_at
from .errors import ConfigError
from .evaluation import Evaluator
from .guard import NonFiniteGuard, SignalGuard
from .io.checkpoint import HISTORY, Checkpoint, TrainerState, open_checkpoint, prune_checkpoints, resume_path
from .io.outputs import OutputDir, SaveSchedule, interval_steps
from .io.ownership import RunLock
from .io.partition import check_shared, save_checkpoint, save_model
from .io.pretrained import local_models
from .io.weights import fills_apart
from .metrics import MetricsLogger, SilentLogger, mean_metrics, show_progress
from .models import attention
from .models.config import ModelConfig
from .models.family import describe
from .parallel.distributed import Collective
from .parallel.processgroup import start
from .plan import preflight, rollout_memory
from .planning.memory import PLAN_FILE, MemoryRecord
from .planning.placement import Machine, Plan
from .profiling import profiled
from .rl import rewards
from .rl.offpolicy import resumed_pending
from .rl.rollout import Rollout, check_cache, resumed_rollout
from .runtime import TrainableModel, WeightsFill, build_model, resolve_dtype, weights_part
from .stages import (
    Reference,
    batch_shape,
    build_stage_samples,
    grpo_prompts,
    grpo_reference,
    objective_of,
    reference_model_pass,
    same_architecture,
    stage_model,
    steps_of_epoch,
)
from .trackers import RunInfo

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerFast

PLAN_PART = "the memory plan"  # of the "ready for step" line: preflight, its probe of a layer included
BESIDE = f"; beside {PLAN_PART}: "  # and what ran beside it, not in its total (`_policy_fill`)
# Settings whose change between a checkpoint and its resume makes the continuation differ from
# an uninterrupted run; changing them is allowed, with a warning.
# fmt: off
RESUME_SENSITIVE = (
    "model_name_or_path", "model_config", "dataset", "dataset_format", "max_length", "packing", "shuffle", "seed", "per_device_train_batch_size",
    "total_train_batch_size", "learning_rate", "lr_scheduler_type", "warmup_steps", "warmup_ratio",
    "max_steps", "num_train_epochs", "weight_decay", "adam_beta1", "adam_beta2", "adam_epsilon", "max_grad_norm",
    "freeze_vision_tower", "freeze_multi_modal_projector",
    # the stages' (preference, grpo)
    "stage", "beta", "loss_type", "loss_weights", "label_smoothing", "discopop_tau",
    "simpo_gamma", "cpo_alpha", "desirable_weight", "undesirable_weight", "max_prompt_length",
    "max_completion_length", "truncation_mode", "ref_model_name_or_path", "num_generations", "num_iterations",
    "temperature", "top_p", "top_k", "epsilon", "epsilon_high", "use_bias_correction_kl", "scale_rewards",
    "mask_truncated_completions", "reward_funcs", "reward_weights", "steps_per_generation", "generation_batch_size",
    "max_staleness", "vllm_importance_sampling_correction", "vllm_importance_sampling_mode",
    "vllm_importance_sampling_clip_max", "vllm_importance_sampling_clip_min", "off_policy_mask_threshold",
)
# fmt: on
# Of those, what a resume refuses to change (another model, other data, another objective: no
# continuation of the checkpoint's run) unless resume_with_changes says so.
RESUME_FIXED = ("model_name_or_path", "model_config", "dataset", "stage")


def seed_everything(seed: int) -> None:
    """Seed Python's and torch's global generators (a resume then restores their saved states)."""
    random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: TrainConfig) -> Path | None:
    """Train as `cfg` says; returns the exported model directory (`output_dir/final`; None with
    save_final_model false).

    Raises MegatrainError subclasses for bad inputs (before anything is written),
    guard.TrainingInterrupted after a signal (its checkpoint saved) and guard.DivergedError
    when steps keep producing non-finite losses. Started by torchrun (or launch.py), this
    process is one rank of a data-parallel world (distributed.py).
    """
    cfg.require_dataset()
    cfg = local_models(cfg)  # Hub names: their files fetched, or found in the cache
    seed_everything(cfg.seed)
    with full_determinism(cfg.full_determinism):  # before the first CUDA kernel
        world, device = start(resolve_device(cfg.device), cfg.ddp_timeout, cfg.ddp_traffic, cfg.nnodes)
        try:
            check_outputs(cfg)  # output_dir must be a directory before the lock is made in it
            # The run owns output_dir until it ends: a second run there is refused. One lock for
            # the world: its writer (the other ranks write only what the writer coordinates).
            with RunLock(cfg.output_dir) if world.is_main else contextlib.nullcontext() as lock:
                if lock is not None and lock.note:
                    print(lock.note)
                return _train(cfg, world, device)
        finally:
            world.close()


@dataclass
class _Inputs:
    """A run's inputs, every one checked before anything is written (`_check_inputs`)."""

    model_cfg: ModelConfig
    resume: Checkpoint | None
    outputs: OutputDir
    tokenizer: PreTrainedTokenizerFast | None
    samples: list
    prompts: list | None  # grpo: the prompts the samples are, with their columns
    reward_funcs: list | None  # grpo
    resumed_rollout: list | None  # grpo: the rollout a resume trains on again
    resumed_pending: dict | None  # grpo, max_staleness 1: the batches a resume's next steps start
    batcher: Batcher
    total_steps: int
    warmup: int
    evaluator: Evaluator
    plan: Plan
    machine: Machine
    saves: SaveSchedule
    fill: WeightsFill | None  # the policy's host state, filled beside the plan (`_policy_fill`)


def _check_inputs(
    cfg: TrainConfig, world: Collective, device: torch.device, compute_dtype, timings: dict[str, float]
) -> _Inputs:
    """Read and check everything a run takes (model, checkpoint, output_dir, tokenizer, data, eval
    data, memory plan, disk space), raising a one-line error at the first fault, before anything
    is written. `timings` gets the memory plan's seconds (its probe of a layer on the device) and
    those of the policy's weights that it waited for (`_policy_fill`)."""
    main = world.is_main
    say = print if main else lambda text: None  # every rank meets the same: the first one tells
    model_cfg = ModelConfig.from_json(cfg.model_name_or_path or cfg.model_config).with_router(
        cfg.output_router_logits, cfg.router_aux_loss_coef
    )
    tok_path = cfg.tokenizer_name_or_path or cfg.model_name_or_path
    # A model directory without tokenizer files is fine for pre-tokenised data.
    tokenizer = load_tokenizer(tok_path, optional=not cfg.tokenizer_name_or_path) if tok_path else None
    if tokenizer is None and cfg.dataset_format not in ("tokens", "auto"):
        raise ConfigError("tokenizer_name_or_path: required for text and chat datasets")
    pad_id = pad_token_id(tokenizer, model_cfg.vocab_size, getattr(model_cfg.hf_config, "pad_token_id", None))
    model_cfg = stage_model(cfg, model_cfg, pad_id)  # rm: a score head; a vision tower frozen or not
    vision = None  # a vision-language model's processor: its data's images (data/vision.py)
    if model_cfg.vision is not None:
        if tok_path is None:
            raise ConfigError(
                "tokenizer_name_or_path: a vision-language model needs its processor's directory"
            )
        vision = VisionData(load_processor(tok_path))
    ckpt_path = resume_path(cfg)
    resume = (
        open_checkpoint(ckpt_path, model_cfg, show_progress(cfg.disable_tqdm) and main, cfg.moments())
        if ckpt_path
        else None
    )
    fixed = resume.changed_settings(cfg.to_dict(), RESUME_FIXED) if resume else []
    if fixed and not cfg.resume_with_changes:
        raise ConfigError(
            f"resume_from_checkpoint: {resume.path} is another run's model, data or stage ({'; '.join(fixed)}); "
            "resume_with_changes: true continues from it anyway"
        )
    outputs = OutputDir(cfg, resume)  # refuses a used output_dir, a final/ megatrain did not write
    prompts, reward_funcs, resumed, pending = None, None, None, None
    grpo = cfg.grpo(world.world_size)  # the generation batch is counted over the run's processes
    if grpo is not None:
        prompts, reward_funcs = (
            grpo_prompts(cfg, tokenizer, model_cfg.vocab_size),
            rewards.load(cfg.reward_funcs, device, compute_dtype),
        )
        samples = prompt_samples(prompts)
        if resume:  # taken in the middle of a rollout's num_iterations steps, it holds the rollout
            resumed = resumed_rollout(resume.path, resume.trainer_state.global_step, grpo, world)
            pending = resumed_pending(resume.path, world)
    else:
        samples = build_stage_samples(
            cfg,
            tokenizer,
            model_cfg.vocab_size,
            "dataset",
            cfg.per_device_train_batch_size,
            say,
            pad_id,
            vision,
        )
    batch_size, grad_accum = batch_shape(cfg, grpo)
    batcher = Batcher(
        samples,
        batch_size=batch_size,
        grad_accum=grad_accum,
        max_length=cfg.max_length,
        packing=cfg.packing,
        shuffle=cfg.shuffle,
        seed=cfg.seed,
        ranks=world.world_size,
        pad_id=pad_id,
        pixels=vision.pixels if vision is not None else None,
    )
    steps_per_epoch = steps_of_epoch(cfg, grpo, batcher.steps_per_epoch)
    total_steps = cfg.max_steps if cfg.max_steps > 0 else math.ceil(cfg.num_train_epochs * steps_per_epoch)
    if resume and resume.trainer_state.global_step > total_steps:
        raise ConfigError(
            f"max_steps: {resume.path} is at step {resume.trainer_state.global_step}, past the {total_steps} "
            "steps this run trains for (raise max_steps or num_train_epochs)"
        )
    # Tokenizes eval_dataset now: bad eval data stops the run before anything is written.
    evaluator = Evaluator(
        cfg, tokenizer, total_steps, steps_per_epoch, model_cfg.vocab_size, batcher.pad_id, say, vision
    )
    if reward_funcs is not None:  # what each built-in reads, in every prompt, before step one
        rewards.check_columns(reward_funcs, prompts + (evaluator.prompts or []))
    if why := shared_prompts_refused(cfg, model_cfg):
        raise ConfigError(why)
    warmup = warmup_of(cfg, total_steps)
    for warning in run_warnings(cfg, model_cfg, total_steps, warmup):
        say(f"megatrain: warning: {warning}")
    # Where every byte lives, decided before anything is allocated; refuses a run that cannot fit.
    docs = batcher.packed_lengths  # attention stays inside packed documents: its cost
    span = attention.span(docs, model_cfg.windows) if docs else None
    fill = _policy_fill(cfg, model_cfg, resume, world)
    t = time.monotonic()
    plan, machine = preflight(
        model_cfg, cfg, device, compute_dtype.itemsize, world=world.layout, attention_span=span, fill=fill
    )
    waited = fill.waited if fill is not None else 0.0
    timings[PLAN_PART] = time.monotonic() - t - waited
    if fill is not None:
        timings[weights_part(fill.weights)] = waited
    if grpo is not None:
        check_cache(cfg.rollout_cache, model_cfg.hf_config, streamed=plan.rollout_layers is not None)
    saves = SaveSchedule.of(cfg, total_steps, steps_per_epoch)
    outputs.check_names(saves)  # refuses a checkpoint-N the run saves that is not megatrain's
    outputs.check_disk_space(model_cfg.num_params, saves, plan.disk)  # refuses a run the disk cannot hold
    return _Inputs(
        model_cfg,
        resume,
        outputs,
        tokenizer,
        samples,
        prompts,
        reward_funcs,
        resumed,
        pending,
        batcher,
        total_steps,
        warmup,
        evaluator,
        plan,
        machine,
        saves,
        fill,
    )


def _policy_fill(cfg: TrainConfig, model_cfg: ModelConfig, resume, world: Collective) -> WeightsFill | None:
    """The policy's host state filled while the plan probes a layer (runtime.WeightsFill), where
    nothing else is read into host memory before the policy is built (the plan counts one model
    there: not beside a reference model's pass, `_reference`, nor grpo's reference copy) and the
    fill draws from no generator but its own (`weights.fills_apart`); None: build_model fills it."""
    weights = resume.path if resume else cfg.model_name_or_path
    pref, rl = cfg.preference(), cfg.grpo()
    reference_pass = pref is not None and pref.needs_reference and (cfg.ref_model_name_or_path or resume)
    if reference_pass or (rl is not None and rl.needs_reference) or not fills_apart(model_cfg, weights):
        return None
    progress = show_progress(cfg.disable_tqdm) and world.is_main
    return WeightsFill(model_cfg, world, cfg.moments(), weights, cfg.seed, progress)


@dataclass
class _Run(_Inputs):
    """A run set up (`_setup`): its checked inputs, the model and what the step loop's phases use
    (evaluate, save, log a step, export, close)."""

    cfg: TrainConfig
    world: Collective
    model: TrainableModel
    memory: MemoryRecord
    log: MetricsLogger | SilentLogger
    nonfinite: NonFiniteGuard
    history: deque[dict]
    run_config: dict
    start: int  # the optimizer steps already taken (a resume's)
    rollout: Rollout | None  # grpo: samples each step's completions
    num_tokens: int = 0  # TRL's `num_tokens`: the tokens trained on so far (a resume's from its history)

    @property
    def main(self) -> bool:
        """Whether this rank writes the outputs and shows progress."""
        return self.world.is_main

    @property
    def out(self) -> Path:
        return self.outputs.path

    def log_step(self, step: int, outcome: dict, lr: float, dt: float, micro_batches) -> None:
        """Optimizer step `step`'s metrics, to the metrics and the log history."""
        record = _step_record(step, outcome, lr, dt, micro_batches, self.world, self.batcher.epoch)
        if self.rollout is not None:  # a generation batch trained again (num_iterations) counts once
            record.update(self.rollout.metrics)
            self.num_tokens += self.rollout.sampled_tokens
            self.rollout.sampled_tokens = 0
        else:
            self.num_tokens += self.world.sum_count(sum(mb.num_input_tokens for mb in micro_batches))
        record["num_tokens"] = self.num_tokens
        self.log.log(record)
        self.history.append(record)

    def evaluate(self, step: int) -> None:
        """Eval loss (grpo: eval rewards) after `step` optimizer steps, to the metrics and the log
        history."""
        record = self.evaluator.evaluate(
            self.model.engine, step, self.batcher.epoch, self.log.progress, self.rollout
        )
        self.log.log_eval(record)
        self.log.exclude_pause()  # the ETA counts training steps only
        self.history.append(record)

    def save(self, step: int, weights_only: bool) -> Path:
        """Checkpoint after `step` optimizer steps, then prune this run's to save_total_limit
        (never the best)."""
        cfg, main = self.cfg, self.main
        if self.rollout is not None:  # max_staleness 1: the next step's batches sampled, to be saved
            self.rollout.settle()
        self.model.transport.synchronize()  # the CUDA optimizer runs behind; the host state must be current
        self.world.barrier()  # every rank's part of the shared state is
        self.evaluator.checkpointed(step)  # is this checkpoint the best so far?
        schedule = dict(
            type=cfg.lr_scheduler_type,
            learning_rate=cfg.learning_rate,
            warmup_steps=self.warmup,
            total_steps=self.total_steps,
            last_step=step,
        )
        trainer_state = TrainerState(
            global_step=step,
            epoch=self.batcher.epoch,
            max_steps=self.total_steps,
            optimizer_step=self.model.state.step,
            lr_scheduler=schedule,
            data_state=self.batcher.state_dict(),
            nonfinite_streak=self.nonfinite.streak,
            log_history=list(self.history),
            run_id=self.outputs.run_id,
            weights_only=weights_only,
            objective_state=self.model.engine.objective.state_dict(),
            optimizer_moments=self.model.state.moments.name,
            **self.evaluator.state(),
        )
        replacing = main and self.outputs.of_another_run(step)  # announced at the start, unless a signal's
        rollout = self.rollout.files(step) if self.rollout is not None and not weights_only else None
        # Every rank: the first one writes a whole state, every machine its part of a partitioned one.
        path = save_checkpoint(
            self.world,
            self.out,
            trainer_state,
            self.model.state,
            self.model_cfg,
            self.run_config,
            tokenizer=self.tokenizer,
            generation_from=cfg.model_name_or_path,
            max_shard_bytes=parse_size(cfg.max_shard_size),
            progress=self.log.interactive,
            files=rollout or None,
        )
        if main:
            prune_checkpoints(
                self.out, cfg.save_total_limit, self.outputs.run_id, protect=self.evaluator.best_checkpoint
            )
            also = " (weights only)" if weights_only else ""
            also += " in place of another run's checkpoint of that step" if replacing else ""
            self.log.message(f"megatrain: saved {path}{also}")
        self.log.exclude_pause()
        return path

    def export(self) -> Path | None:
        """After the last step: the model (the best checkpoint's, with load_best_model_at_end) to
        output_dir/final; None with save_final_model false."""
        world, log = self.world, self.log
        self.model.transport.synchronize()
        world.barrier()
        if not self.cfg.save_final_model:
            if self.main:
                log.message(self.memory.summary())
            return None
        # load_best_model_at_end: every machine's state (part) holds the best checkpoint's weights.
        note = (
            self.evaluator.load_best(self.model.state, self.model_cfg, log.interactive)
            if world.holds_state
            else None
        )
        world.barrier()
        final = save_model(
            world,
            self.model.state,
            self.model_cfg,
            self.out / "final",
            dtype=torch.bfloat16 if self.cfg.save_dtype == "bfloat16" else torch.float32,
            max_shard_bytes=parse_size(self.cfg.max_shard_size),
            tokenizer=self.tokenizer,
            progress=log.interactive,
            generation_from=self.cfg.model_name_or_path,
        )
        if not self.main:
            return final
        if note:
            log.message(note)
        log.message(f"megatrain: saved {final}")
        log.message(self.memory.summary())
        return final

    def close(self, failed: bool) -> None:
        """Write the memory record, close the logger, grpo's record files and the model, every step
        tried."""
        # After an error, what closing meets (the same full disk, most often) is not the one to report.
        record = [lambda: self.memory.write(self.out)] if self.main else []
        rollout = [self.rollout.close] if self.rollout is not None else []
        _close_all(
            [*record, lambda: self.log.close(failed=failed), *rollout, self.model.close], quietly=failed
        )


def _train(cfg: TrainConfig, world: Collective, device: torch.device) -> Path | None:
    run = _setup(cfg, world, device)
    batcher, evaluator, nonfinite, total_steps = run.batcher, run.evaluator, run.nonfinite, run.total_steps
    failed = False
    try:
        with SignalGuard(run.log.message) as stop:
            last = run.resume.path if run.resume else None  # the newest checkpoint of this run
            if run.start == 0 and evaluator.due(0):
                run.evaluate(0)  # eval_on_start: a baseline before the first step
            t_last = time.perf_counter()
            for step in range(run.start, total_steps):
                with profiled(cfg.profile_steps, step + 1, run.out, world.rank, world.world_size):
                    if (
                        run.rollout is not None
                    ):  # grpo: sampled completions, a rollout every num_iterations steps
                        micro_batches = run.rollout.step(step + 1, lambda: batcher.next_step(world.rank))
                    else:
                        micro_batches = batcher.next_step(world.rank)
                    lr = lr_at(step, cfg.learning_rate, cfg.lr_scheduler_type, run.warmup, total_steps)
                    outcome = _optimizer_step(
                        run.model.engine, micro_batches, cfg.max_grad_norm, lr, nonfinite, step + 1
                    )
                now = time.perf_counter()
                dt, t_last = now - t_last, now
                run.log_step(step + 1, outcome, lr, dt, micro_batches)
                nonfinite.check_diverged(step + 1)
                if evaluator.due(step + 1):
                    run.evaluate(step + 1)
                    t_last = time.perf_counter()  # evaluation is not step time
                run.memory.measure(
                    step + 1, **(run.rollout.memory if run.rollout else {})
                )  # evaluation's too

                # Read once (a signal during the save is acted on below), and by every rank alike.
                stopping = world.any(stop.requested)
                if stopping or run.saves.due(step + 1):
                    # A signal's checkpoint is always complete: it exists to be resumed.
                    last = run.save(step + 1, cfg.save_only_model and not stopping)
                    t_last = time.perf_counter()  # saving is not step time
                if stopping:
                    raise stop.interrupted(last)
            # The last step is saved (to train further) unless save_strategy=no; a signal always saves.
            stopping = world.any(stop.requested)
            if (run.saves.at_end or stopping) and (last is None or last.name != f"checkpoint-{total_steps}"):
                last = run.save(total_steps, cfg.save_only_model and not stopping)
            if stopping:
                raise stop.interrupted(last)
        return run.export()
    except BaseException:
        failed = True
        raise
    finally:
        run.close(failed)


def _setup(cfg: TrainConfig, world: Collective, device: torch.device) -> _Run:
    """Check the inputs, build the model, take output_dir over (plan.json, a resume's state, the
    metrics logger) and tell what the run is: everything before the first step, timed by part."""
    timings = {"imports and the command line": time.monotonic() - STARTED}
    t = time.monotonic()
    compute_dtype = resolve_dtype(cfg.compute_dtype, device)
    main = world.is_main  # writes the outputs and shows progress
    planned: dict[str, float] = {}
    inputs = _check_inputs(cfg, world, device, compute_dtype, planned)
    timings["the inputs"] = time.monotonic() - t - sum(planned.values())
    timings.update(planned)
    model_cfg, resume, outputs, batcher = inputs.model_cfg, inputs.resume, inputs.outputs, inputs.batcher
    runs_on = describe(model_cfg)
    rollout = (
        sum(
            rollout_memory(
                cfg,
                model_cfg,
                compute_dtype.itemsize,
                world.world_size,
                inputs.plan.rollout_layers,
            ).values()
        )
        if device.type == "cuda"
        else 0
    )
    model_info = {"model_type": model_cfg.name, "path": runs_on}
    memory = MemoryRecord(inputs.plan, inputs.machine, model_info, rollout_gpu=rollout)
    progress = show_progress(cfg.disable_tqdm) and main

    def build(weights, after_load=None, filled=None) -> TrainableModel:
        return build_model(
            model_cfg,
            weights=weights,
            seed=cfg.seed,
            device=device,
            compute_dtype=compute_dtype,
            adamw=AdamWConfig(
                cfg.learning_rate,
                (cfg.adam_beta1, cfg.adam_beta2),
                cfg.adam_epsilon,
                cfg.weight_decay,
                cfg.moments(),
            ),
            progress=progress,
            plan=inputs.plan,
            machine=inputs.machine,
            compile=cfg.torch_compile,  # None: on for CUDA, off on the CPU
            collective=world,
            after_load=after_load,
            objective=objective_of(cfg, world),
            offload_dir=cfg.offload_dirs(),
            timings=timings,
            filled=filled,
        )

    reference = _reference(cfg, inputs, world, build, progress)
    initial = grpo_reference(cfg, model_cfg, compute_dtype)  # before the policy: its fp32 read is freed
    # a checkpoint holds HF-keyed fp32 weights
    model = build(
        resume.path if resume else cfg.model_name_or_path,
        resume.load_moments if resume else None,
        inputs.fill,
    )
    if reference is not None and reference.missing:  # a fresh run: the policy is still the reference
        reference.compute(model.engine, cfg, batcher.pad_id, world, progress)
    out = outputs.path
    # Every rank has checked the inputs (build_model met them all at a barrier): now one writes.
    notes = outputs.take_over() if main else []  # creates output_dir; a previous run's metrics kept aside
    # What each machine holds of the host state (one part of it each, when partitioned).
    memory.state_bytes = [b for b in world.each(model.state.nbytes if world.holds_state else None) if b]
    memory.tier = model.state.tier
    memory.counters = model.transport.counters
    if main:
        memory.write(out)
        if reference is not None and reference.computed:
            reference.write()
    if reference is not None:
        world.barrier()
        reference.attach()
    check_shared(world, out / PLAN_FILE)  # a partitioned state's machines save into one output_dir
    ts = resume.restore(model.state, batcher) if resume else None
    if ts:
        model.engine.objective.load_state_dict(ts.objective_state)
    start = ts.global_step if ts else 0
    # What a resume compares: the global batch, however many processes shared it.
    run_config = {
        **cfg.to_dict(),
        "total_train_batch_size": batcher.batch_size * batcher.micro_per_step,
        "world_size": world.world_size,
    }
    total_steps = inputs.total_steps
    every = max(1, interval_steps(cfg.logging_steps, total_steps))  # a tiny fraction rounds to 0 steps
    about = RunInfo(outputs.run_id, cfg.run_name, cfg.project, run_config, memory.record())
    log = (
        MetricsLogger(out, total_steps, start, every, cfg.report_to, cfg.disable_tqdm, about)
        if main
        else SilentLogger()
    )
    rollout = None
    if inputs.prompts is not None:
        rollout = Rollout(
            cfg.grpo(world.world_size), inputs.prompts, inputs.reward_funcs, inputs.tokenizer, model, device, compute_dtype, world,
            cfg.per_device_train_batch_size, batcher.pad_id, out, every, cfg.seed, initial, inputs.resumed_rollout,
            resident_layers=inputs.plan.rollout_layers, start=start,
            cache=cfg.rollout_cache, engine=cfg.rollout_engine, compile=cfg.rollout_compile,
            steps=inputs.total_steps, pending=inputs.resumed_pending,
        )  # fmt: skip
    run = _Run(
        **vars(inputs),
        cfg=cfg,
        world=world,
        model=model,
        memory=memory,
        log=log,
        nonfinite=NonFiniteGuard(
            cfg.max_consecutive_nonfinite, ts.nonfinite_streak if ts else 0, log.message
        ),
        history=deque(ts.log_history if ts else [], maxlen=HISTORY),
        run_config=run_config,
        start=start,
        rollout=rollout,
        num_tokens=next((r["num_tokens"] for r in reversed(ts.log_history) if "num_tokens" in r), 0)
        if ts
        else 0,
    )
    _announce(run, device, runs_on, notes, ts)
    if reference is not None:
        log.message(reference.note())
    timings["the rest"] = time.monotonic() - STARTED - sum(timings.values())
    fill = inputs.fill
    beside = f"{BESIDE}{weights_part(fill.weights)} {fill.beside:.1f}" if fill and fill.beside >= 0.05 else ""
    log.message(
        f"megatrain: ready for step {start + 1} {sum(timings.values()):.1f} s after the command: "
        + ", ".join(f"{k} {v:.1f}" for k, v in timings.items() if v >= 0.05)
        + beside
    )
    return run


def _reference(
    cfg: TrainConfig, inputs: _Inputs, world: Collective, build, progress: bool
) -> Reference | None:
    """The run's reference log-probs (None where the stage takes none): read from output_dir,
    or computed now with a model of the reference weights where the policy about to be built
    does not hold them (another reference model, or a resume); a fresh run's policy computes
    them after it is built."""
    pref = cfg.preference()
    if pref is None or not pref.needs_reference:
        return None
    sets = {"train": inputs.samples}
    if inputs.evaluator.enabled:
        sets["eval"] = inputs.evaluator.batcher.samples
    ref = Reference(cfg, sets, inputs.outputs.path, inputs.model_cfg, inputs.batcher.pixels)
    if ref.missing and (cfg.ref_model_name_or_path or inputs.resume):
        path = cfg.ref_model_name_or_path
        if path:
            same_architecture(inputs.model_cfg, ModelConfig.from_json(path), path)
        reference_model_pass(
            ref, lambda: build(path or cfg.model_name_or_path), cfg, inputs.batcher.pad_id, world, progress
        )
    return ref


def _announce(
    run: _Run, device: torch.device, runs_on: str, notes: list[str], ts: TrainerState | None
) -> None:
    """Tell what the run is: the model, where it runs, the plan, what a resume continues (its
    evaluation state restored, the settings changed since its checkpoint)."""
    log, model_cfg, resume, world = run.log, run.model_cfg, run.resume, run.world
    log.message(
        f"megatrain: {model_cfg.name} {run.model.state.num_params / 1e6:.1f}M params on {device} "
        f"({str(run.model.engine.dtype).removeprefix('torch.')}), {len(run.samples)} samples, "
        f"{run.total_steps} steps"
        + (f", data parallel over {world.world_size} processes" if world.world_size > 1 else "")
    )
    log.message(f"megatrain: {model_cfg.name} runs on the {runs_on}")
    for note in notes:
        log.message(note)
    for note in run.plan.notes:
        log.message(f"megatrain: plan: {note}")
    if resume:
        log.message(f"megatrain: resumed from {resume.path} at step {run.start}")
        if not resume.verified:
            log.message(f"megatrain: warning: {resume.path} has no checksums (saved by an older megatrain)")
        run.evaluator.restore(ts, log.message)
        changed = resume.changed_settings(run.run_config, RESUME_SENSITIVE)
        if changed:
            log.message("megatrain: warning: settings changed since the checkpoint: " + "; ".join(changed))


def _close_all(steps: list[Callable[[], object]], quietly: bool) -> None:
    """Run every closing step, then raise the first one's error unless `quietly`."""
    first = None
    for step in steps:
        try:
            step()
        except Exception as e:
            first = first or e
    if first is not None and not quietly:
        raise first


def _optimizer_step(engine, micro_batches, max_grad_norm: float, lr: float, nonfinite, step: int) -> dict:
    """One optimizer step over `micro_batches`: forward, backward, clip, AdamW (skipped where the
    loss or the gradient norm is not finite, the weights and moments left as they were). Its
    loss, gradient norm, label tokens, router metrics (MoE) and whether it was finite."""
    loss, _ = engine.forward_backward(micro_batches)
    grad_norm, coef = engine.clip_grad_norm(max_grad_norm)  # None: known after the step
    loss = loss.item()  # the one host sync of the step
    router = engine.aux_metrics()  # MoE: aux loss and expert load (known with the loss)
    objective = engine.objective.take_metrics()  # a preference stage's rewards, log-probs, ...
    if grad_norm is None and math.isfinite(loss):
        # No clipping: the backward sweep runs in `step`, each unit stepped as it lands (one whose
        # gradient is not finite is left as it was).
        grad_norm = engine.step(lr, coef).item()
        finite = nonfinite.finite(step, loss, grad_norm)
    else:
        grad_norm = grad_norm.item() if grad_norm is not None else math.nan
        finite = nonfinite.finite(step, loss, grad_norm)
        if finite:
            engine.step(lr, coef)
        else:
            engine.skip_step()  # weights and AdamW moments stay as they were
    return dict(loss=loss, grad_norm=grad_norm, router=router, objective=objective, finite=finite)


def _step_record(
    step: int, outcome: dict, lr: float, dt: float, micro_batches, world: Collective, epoch
) -> dict:
    """The metrics record of optimizer step `step` (1-based), summed over the world's processes."""
    finite = outcome["finite"]
    tokens = world.sum_count(sum(mb.num_tokens for mb in micro_batches))
    # What the step's tokens were: rows of max_length and, packed, the documents in them.
    rows = world.sum_count(sum(mb.input_ids.shape[0] for mb in micro_batches))
    samples = world.sum_count(sum(mb.num_samples for mb in micro_batches))
    label_tokens = world.sum_count(sum(mb.num_label_tokens for mb in micro_batches))
    record = {
        "step": step,
        "loss": outcome["loss"] if finite else None,  # JSON has no NaN
        "grad_norm": outcome["grad_norm"] if finite else None,
        "lr": lr,
        "tokens": tokens,
        "label_tokens": label_tokens,
        "rows": rows,
        "samples": samples,
        "tokens_per_s": tokens / dt,
        "step_time_s": dt,
        "epoch": epoch,
        **outcome["router"],
        **mean_metrics(outcome["objective"], world),
    }
    if not finite:
        record["skipped"] = True
    return record
