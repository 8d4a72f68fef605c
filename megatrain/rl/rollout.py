"""The rollouts of `stage: grpo` and `stage: rloo`: a generation batch of prompts sampled
`num_generations` times by the policy as it is, scored by the reward functions, turned into
micro-batches of prompt + completion for the engine and advantages by the stage's rule
(objectives/grpo.py, objectives/rloo.py: RLOO's after the log-probs, which its KL penalty needs);
and evaluation (`evaluate`).

A generation batch is per_device_train_batch_size x steps_per_generation completions a process
(TRL's; by default gradient_accumulation_steps slices, one generation batch an optimizer step),
shuffled and split into steps_per_generation micro-batches (`generation_order`) and trained on
num_iterations times over (TRL's buffered generation): micro-batch m of the run (0-based,
gradient_accumulation_steps a step) starts a new one where m is a multiple of
steps_per_generation x num_iterations, and is its slice m mod steps_per_generation. A step's
generation batches are all sampled before it trains, with the weights it starts from (with
`max_staleness: 1`, those the step before started from, and each token's log-prob under them kept
for the loss's correction: offpolicy.py); their metrics go with the step that sampled them (their
mean where it sampled several), as TRL logs them.

Sampling is the rollout engine (decode.py; `rollout_engine: generate`: transformers' `generate`)
on a transformers model built on the device in the compute dtype from the host state's current
weights, freed after the rollout (rl/policy.py): the whole policy, or where the plan says it does
not fit beside the cache (`Plan.rollout_layers`), its first layers, the others streamed through
the device in every forward, each decode step advancing every completion by a token. Its prompts
are left-padded into one batch, each repeated num_generations times in a row (TRL's order). Each
completion is sampled from a stream of its own (sampling.py: temperature, top_k, top_p as
transformers' warpers apply them), seeded with `row_seed(seed, step, the prompt's index in the
dataset, the completion's index in its group)` (with, after the step, the micro-batch it starts
at for a generation batch that does not start its step): a completion is a function of the seed,
the step, its prompt and the weights, whatever else is in the batch. So a resumed run samples what
the uninterrupted one did, and any number of processes sample what one does. A completion ends at
its first end token (the tokenizer's EOS or the chat template's end of turn), included; one that
reaches max_completion_length is truncated. Rank r takes the r-th block of a generation batch's
prompts; advantages see every rank's rewards.

Where the loss needs them, each generation batch carries per-token log-probs, computed once after
sampling (MicroBatch.token_extra): the sampling policy's (where the policy moves before its last
micro-batch: `GRPOConfig.needs_old_logps`) by the engine's own forward sweep over its
micro-batches, the loss's computation, so the ratio is 1 until the policy moves; the reference
policy's (beta > 0) by a transformers model built on the device from the reference weights
(stages.grpo_reference), as the sampling model is (its layers streamed as the sampling model's),
and freed before the step. A checkpoint taken
where the next step goes on with a generation batch holds it (ROLLOUT_FILE, every rank's
micro-batches with their advantages and log-probs), and a resume trains on it: the weights moved
since it was sampled, so sampling it again would not give it back.

Evaluation (`evaluate`) samples the eval prompts num_generations_eval times from streams of its
own, scores them, writes them to eval_completions.jsonl, and takes TRL's eval-mode loss of them
by the engine's forward sweep (objectives/grpo.py: GRPO.eval_sums, eval_metrics).

With `rollout_engine: generate`, the decode's KV cache is `rollout_cache` (`check_cache` says
where each applies): dynamic, transformers' default, grown a token at a time; or static,
transformers' StaticCache, with which `generate` compiles the decoding step on CUDA. The sampler,
the stop tokens and the cut are the same either way.
"""

from __future__ import annotations

import contextlib
import io
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from ..data.batch import IGNORE_INDEX, MicroBatch
from ..data.chat import end_of_turn_id
from ..data.prompts import Prompt
from ..errors import CheckpointError, ConfigError
from ..io.outputs import COMPLETIONS, EVAL_COMPLETIONS
from ..metrics import RecordFile
from ..objectives import rloo
from ..objectives.grpo import (
    ADVANTAGE,
    OLD_LOGP,
    REF_LOGP,
    SAMPLER_LOGP,
    TOKENS_PER_STEP,
    GRPOConfig,
    advantages,
    eval_metrics,
    log_probs,
)
from ..objectives.offpolicy import combine, sampling_metrics, sampling_stats
from ..objectives.rloo import RLOOConfig, sequence_kl
from .decode import Decoder, supports
from .offpolicy import PENDING_FILE, Sampled, Snapshot, StaleSampler, load_ranks
from .policy import PolicyModel
from .rewards import RewardFunc, score
from .sampling import RowSampler, Warpers, row_seed

ROLLOUT_FILE = "rollout.pt"  # in a checkpoint taken before a rollout's last step
EVAL_STREAM = -1  # row_seed's step for evaluation's completions: no optimizer step has it
SHUFFLE_STREAM = -2  # row_seed's step for the order a generation batch is split in
# The reference pass's fp32 logits at once: a micro-batch's rows are forwarded in slices under it
# (a row at least), so its peak past the weights is a few times this, not rows x length x vocab.
REFERENCE_LOGIT_BYTES = 2**30
ROLLOUT_CACHES = ("dynamic", "static")  # the `rollout_cache` values (rollout_engine: generate)
ROLLOUT_ENGINES = ("megatrain", "generate")  # the `rollout_engine` values


def check_cache(cache: str, hf_config, streamed: bool) -> None:
    """Refuse a static rollout cache (`rollout_cache: static`) where it cannot apply, in one line:
    beside streamed layers (`streamed`: the plan's rollout_layers keep fewer than all), whose fetches
    are forward hooks with stream and event calls that a compiled, CUDA-graphed decoding step would
    trace or replay without them; and for a model whose transformers class does not take a
    StaticCache or compile (transformers 5 has no `_supports_static_cache`: a class that builds its
    own cache drops `cache_implementation`, one with `_can_compile_fullgraph` False is not held to
    compiling)."""
    if cache != "static":
        return
    if streamed:
        raise ConfigError(
            "rollout_cache: static needs the whole policy on the GPU, and this plan streams some of its "
            "layers (rollout_resident_layers); use rollout_cache: dynamic"
        )
    import transformers

    cls = transformers.AutoModelForCausalLM._model_mapping[type(hf_config)]
    if not (cls._supports_default_dynamic_cache() and cls._can_compile_fullgraph):
        raise ConfigError(
            f"rollout_cache: static is not supported by transformers' {hf_config.model_type}; use dynamic"
        )


def new_generation(micro: int, cfg: GRPOConfig) -> bool:
    """Whether micro-batch `micro` of the run (0-based, gradient_accumulation_steps a step) is
    the first on a new generation batch: one every steps_per_generation x num_iterations."""
    return micro % cfg.micro_batches_per_generation == 0


def generation_order(seed: int, generation: int, rows: int) -> torch.Tensor:
    """The order a process's `rows` rows of generation batch `generation` (its index in the run:
    micro-batch // micro_batches_per_generation) are trained in, before the split into
    steps_per_generation micro-batches: TRL's shuffle_sequence_dict, a random permutation, drawn
    from a generator of its own seeded by (the run's seed, the generation batch), never the global
    one, so a resume and every process draw it alike."""
    g = torch.Generator().manual_seed(row_seed(seed, SHUFFLE_STREAM, generation))
    return torch.randperm(rows, generator=g)


def continues(step: int, cfg: GRPOConfig) -> bool:
    """Whether the step after `step` trains on the generation batch `step` trained on."""
    return not new_generation(step * cfg.gradient_accumulation_steps, cfg)


def resumed_rollout(checkpoint: Path, step: int, cfg: GRPOConfig, world) -> list[MicroBatch] | None:
    """This rank's micro-batches of the rollout a checkpoint after step `step` holds, where the
    next step trains on it again; None where it samples (or the checkpoint has none: one of
    another num_iterations or steps_per_generation, and the next step samples)."""
    path = Path(checkpoint) / ROLLOUT_FILE
    if not continues(step, cfg) or not path.is_file():
        return None
    ranks = load_ranks(path)
    if len(ranks) != world.world_size:
        raise CheckpointError(
            f"{path}: a rollout of {len(ranks)} processes with steps left to train; resume it with "
            f"{len(ranks)} processes, or from a checkpoint taken after a rollout's last step"
        )
    return [MicroBatch(**fields) for fields in ranks[world.rank]]


class Rollout:
    def __init__(self, grpo: GRPOConfig, prompts: list[Prompt], funcs: list[RewardFunc], tokenizer,
                 model, device, dtype, world, batch_size: int, pad_id: int, out: Path | None, log_every: int,
                 seed: int, reference: dict[str, torch.Tensor] | None = None,
                 batches: list[MicroBatch] | None = None, resident_layers: int | None = None,
                 start: int = 0, cache: str = "dynamic",
                 engine: str = "megatrain", compile: bool = False, steps: int | None = None,
                 pending: dict[int, Sampled] | None = None):  # fmt: skip
        self.seed = seed
        self.steps = steps  # the run's optimizer steps (None: no end): the stale sampler's last
        self.stale = StaleSampler(pending)  # max_staleness 1's batches and snapshot (offpolicy.py)
        self.draw: Callable[[], list[MicroBatch]] | None = None  # the Batcher's next prompt batch
        self.sampler_logps: list[list[float]] | None = None  # the last `generate`'s, where asked
        self.engine, self.compile = engine, compile  # rollout_engine, rollout_compile
        self.cache = cache  # rollout_cache (check_cache has allowed it)
        self.resident_layers = resident_layers  # the plan's `rollout_layers` (None: every layer)
        self.reference = reference  # beta > 0: the reference policy's weights (stages.grpo_reference)
        self.batches = batches  # the rollout being trained on (a resume's: `resumed_rollout`)
        self.cfg, self.prompts, self.funcs, self.tokenizer = grpo, prompts, funcs, tokenizer
        self.model, self.device, self.dtype, self.world = model, device, dtype, world
        self.batch_size, self.pad_id = batch_size, pad_id
        # The main rank's record files; a resume after step `start` drops their later records.
        keep = out is not None and world.is_main
        self.completions_file = RecordFile(Path(out) / COMPLETIONS, start) if keep else None
        self.eval_completions_file = RecordFile(Path(out) / EVAL_COMPLETIONS, start) if keep else None
        self.log_every = log_every
        eos = tokenizer.eos_token_id if tokenizer is not None else model.cfg.hf_config.eos_token_id
        stops = [
            t for t in (eos if isinstance(eos, list) else [eos]) if t is not None
        ]  # pre-tokenised: the model's
        eot = end_of_turn_id(tokenizer) if tokenizer is not None else None
        self.stops = stops + ([eot] if eot is not None and eot not in stops else [])
        self.metrics: dict[str, float] = {}
        self.sampled_tokens = 0  # every rank's prompt and completion tokens sampled, not yet logged
        self.streamed = (0, 0)  # the last `generate`'s streamed layers and bytes they fetched
        self.timing: dict[str, float] = {}  # the last `generate`'s time, by part
        self.memory: dict[str, int] = {}
        """The most GPU memory a rollout added to the engine's (`rollout_gpu_added`), for plan.json."""

    # ------------------------------------------------------------------ one step
    def step(self, step: int, draw: Callable[[], list[MicroBatch]]) -> list[MicroBatch]:
        """The gradient_accumulation_steps micro-batches of optimizer step `step`, each the next
        slice of a generation batch (TRL's buffered generation): a new one of this rank's next
        prompts (`draw()`, the Batcher's next prompt batch) where a micro-batch starts one, or
        where a resume has none; else the current one's. A step's metrics are the mean of its
        generation batches' (their times summed), as TRL logs them. max_staleness 1: the new ones
        were sampled by the weights of the step before (offpolicy.py), and the next step's are
        readied here."""
        self.draw = draw
        self.settle()
        ga, slices = self.cfg.gradient_accumulation_steps, self.cfg.steps_per_generation
        sampled, out = [], []
        for micro in range((step - 1) * ga, step * ga):
            if new_generation(micro, self.cfg) or self.batches is None:
                generation = micro // self.cfg.micro_batches_per_generation
                batch = self.stale.pending.pop(generation, None) or self.sample_batch(
                    step, micro % ga, generation
                )
                self.batches = self._finish(batch)
                sampled.append(self.metrics)
            out.append(self.batches[micro % slices])
        self.metrics = _mean_metrics(sampled)
        if self.cfg.stale and (self.steps is None or step < self.steps):
            self.stale.ahead(self, step + 1)
        return out

    def sample_batch(
        self, step: int, offset: int, generation: int, snapshot: Snapshot | None = None
    ) -> Sampled:
        """Generation batch `generation` of this rank's next prompts (`self.draw()`), sampled for
        step `step`'s micro-batch `offset` on by `snapshot`'s policy (None: one of the current
        weights)."""
        (pb,) = self.draw()
        units, g = [int(i) for i in pb.units], self.cfg.num_generations
        t0 = time.perf_counter()
        # A second generation batch of a step has streams of its own (a prompt may be in both).
        where = (step, offset) if offset else (step,)
        seeds = [row_seed(self.seed, *where, i, j) for i in units for j in range(g)]
        policy = snapshot.policy if snapshot is not None else None
        completions, truncated = self.generate([self.prompts[i].ids for i in units for _ in range(g)], seeds,
                                               policy=policy, logps=self.cfg.stale)  # fmt: skip
        metrics = {"time/rollout_s": time.perf_counter() - t0, **self.timing}
        if snapshot is not None:  # its build's wait and times: the first batch's part of the rollout
            built = snapshot.take_timing()
            metrics = metrics | built
            metrics["time/rollout_s"] += built["time/rollout_wait_s"] + built["time/rollout_build_s"]
        # What streaming costs (rl/policy.py): layers fetched every forward, and their bytes.
        metrics.update(zip(("rollout/streamed_layers", "rollout/fetched_bytes"), self.streamed))
        return Sampled(units, step, offset, generation, completions, truncated, self.sampler_logps, metrics)

    def _finish(self, batch: Sampled) -> list[MicroBatch]:
        """A sampled generation batch scored and cut into steps_per_generation micro-batches of
        its rows in `generation_order`, with their advantages and log-probs."""
        prompts = [self.prompts[i] for i in batch.units for _ in range(self.cfg.num_generations)]
        completions, truncated = batch.completions, batch.truncated
        # TRL's num_tokens counts a generation batch once, when sampled (every rank's).
        self.sampled_tokens += self.world.sum_count(
            sum(len(p.ids) for p in prompts) + sum(map(len, completions))
        )
        t1 = time.perf_counter()
        rewards = self._score(prompts, completions)
        t2 = time.perf_counter()
        every = self.world.each(rewards) if self.world.world_size > 1 else [rewards]
        order = generation_order(self.seed, batch.generation, len(prompts)).tolist()
        rows = [(prompts[i].ids, completions[i], bool(truncated[i])) for i in order]
        size = self.batch_size
        batches = [self._micro_batch(rows[a : a + size]) for a in range(0, len(rows), size)]
        # dapo's divisor (TRL's): the generation batch's loss tokens, every rank's, per optimizer step.
        tokens = max(self.world.sum_count(sum(mb.num_label_tokens for mb in batches)), 1)
        for mb in batches:
            mb.extra[:, TOKENS_PER_STEP] = (
                tokens * self.cfg.gradient_accumulation_steps / self.cfg.steps_per_generation
            )
        timing, sampling = {}, {}
        if self.cfg.needs_old_logps or self.cfg.needs_reference or batch.logps is not None:
            t3 = time.perf_counter()
            sampler = None if batch.logps is None else [batch.logps[i] for i in order]
            sampling = self._attach_logps(batches, sampler=sampler)
            timing["time/logps_s"] = time.perf_counter() - t3
        adv, metrics = self._advantages(every, batches, torch.tensor(order))
        self.metrics = metrics | self._metrics(torch.cat(every), completions, truncated) | sampling
        rollout = {k: v for k, v in batch.metrics.items() if not k.startswith("rollout/")}
        self.metrics.update({"time/rollout_s": rollout.pop("time/rollout_s"), "time/scoring_s": t2 - t1})
        self.metrics.update(rollout | timing)
        self.metrics.update({k: v for k, v in batch.metrics.items() if k.startswith("rollout/")})
        step = batch.step
        if self.completions_file is not None and (step % self.log_every == 0 or step == 1):
            for rec in self._records(step, prompts, completions, truncated, rewards, adv):
                self.completions_file.append(rec)
        return batches

    def settle(self) -> None:
        """max_staleness 1: a snapshot's generation batches sampled and its policy freed (before
        an evaluation or a checkpoint: offpolicy.py)."""
        self.stale.settle(self)

    def files(self, step: int) -> dict[str, bytes]:
        """What a checkpoint after step `step` holds of the rollouts, by file name: the current
        generation batch where the next step trains on it again (ROLLOUT_FILE), the batches
        sampled and not trained on (PENDING_FILE). Called by every rank."""
        out = {ROLLOUT_FILE: self.state(step), PENDING_FILE: self.stale.state(self.world)}
        return {k: v for k, v in out.items() if v is not None}

    def _advantages(self, every: list[torch.Tensor], batches: list[MicroBatch], order: torch.Tensor,
                    group: int | None = None) -> tuple[torch.Tensor, dict[str, float]]:  # fmt: skip
        """This rank's advantages, in the order its completions were sampled, by the stage's rule
        (GRPO's; RLOO's, its KL penalty from the micro-batches' log-probs) over `every` rank's
        rewards, and the rule's metrics; each written into `batches`, which hold the rows in
        `order`."""
        world, rewards = self.world, torch.cat(every)
        if isinstance(self.cfg, RLOOConfig):
            kl = sequence_kl(batches)[order.argsort()] if self.cfg.needs_reference else None
            kl = torch.cat(world.each(kl)) if kl is not None and world.world_size > 1 else kl
            _, adv, metrics = rloo.advantages(self.cfg, rewards, group, kl)
        else:
            _, adv, metrics = advantages(self.cfg, rewards, group)
        first = sum(len(r) for r in every[: world.rank])
        adv = adv[first : first + len(every[world.rank])]
        for mb, part in zip(batches, adv[order].split([len(mb.input_ids) for mb in batches])):
            mb.extra[:, ADVANTAGE] = part.double()
        return adv, metrics

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], seeds: list[int], batch_size: int | None = None,
                 bar=None, policy: PolicyModel | None = None,
                 logps: bool = False) -> tuple[list[list[int]], list[bool]]:  # fmt: skip
        """Completions of the prompts, each sampled from its own stream (`seeds`, sampling.py),
        `batch_size` at a time (default: all at once) by one model of the policy (`policy`, a
        snapshot's, inside its `with` block; None: one built of the current weights), each cut
        after its first end token, and whether each was cut at max_completion_length instead.
        `bar` is told of each batch. `logps`: each completion token's log-prob under the sampler
        in `sampler_logps`."""
        if not prompt_ids:
            return [], []
        size, completions, truncated, sampled = batch_size or len(prompt_ids), [], [], []
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self._measured(snapshot=policy is not None):
            owned = policy is None
            policy = self.build_policy() if owned else policy
            t2 = time.perf_counter()
            with policy if owned else contextlib.nullcontext(policy.model) as model:
                for a in range(0, len(prompt_ids), size):
                    c, t, lp = self._sample(
                        model, prompt_ids[a : a + size], seeds[a : a + size], policy.streamed_layers, logps
                    )
                    completions, truncated, sampled = completions + c, truncated + t, sampled + lp
                    if bar is not None:
                        bar.update(1)
            self.streamed = (policy.streamed_layers, policy.fetched_bytes)
            del model, policy  # before the allocator's peak is read
        # Where a rollout's time goes: the last step's host AdamW it waits for, the policy's build
        # from host memory (a snapshot's are counted apart), and the sampling itself (the rest of
        # time/rollout_s is the cutting).
        if not owned:
            self.timing = {}
        self.timing["time/rollout_sample_s"] = time.perf_counter() - t2
        self.sampler_logps = sampled if logps else None
        return completions, truncated

    def build_policy(self) -> PolicyModel:
        """The policy of the host state's current weights on the device, once the last step's
        updates are in (`timing`: the wait and the build)."""
        t0 = time.perf_counter()
        transport = self.model.transport
        transport.wait_updates()  # the optimizer may still be writing the last step
        t1 = time.perf_counter()
        # The units whose state lives on the device are read there, where they are current:
        # not copied back to host memory (with their moments) for the policy's build.
        weights = self.model.state.named_parameters(transport.device_masters())
        policy = self._on_device(weights)
        if self.device.type == "cuda":  # its copies done: the build's time, not the sampling's
            torch.cuda.synchronize(self.device)
        self.timing = {"time/rollout_wait_s": t1 - t0, "time/rollout_build_s": time.perf_counter() - t1}  # fmt: skip
        return policy

    # ------------------------------------------------------------------ evaluation
    def evaluate(self, prompts: list[Prompt], batch_size: int, progress, step: int) -> dict[str, float]:
        """TRL's eval metrics of the policy as it is (without the eval_ prefix): each of `prompts`
        sampled num_generations_eval times, `batch_size` completions at a time, and scored; the reward
        and completion metrics over every rank's completions (rank r samples the r-th block of the
        prompts). Each completion has a stream of evaluation's own, `row_seed(seed, EVAL_STREAM,
        the prompt's index, the completion's index)`: no training stream, and the same at every
        evaluation, so that two evaluations differ by the weights alone. Nothing of the training
        run changes: no random number is drawn from its generators, no rollout state is touched.
        Every rank's completions go to output_dir/eval_completions.jsonl, each with the optimizer
        step evaluated (`step`). `progress(total)` makes a tqdm-like bar over the batches."""
        self.settle()  # a snapshot's batches first: the GPU holds one policy at a time
        g, n, world = self.cfg.num_generations_eval, len(prompts), self.world
        mine = range(world.rank * n // world.world_size, (world.rank + 1) * n // world.world_size)
        rows = [(i, j) for i in mine for j in range(g)]
        seeds = [row_seed(self.seed, EVAL_STREAM, i, j) for i, j in rows]
        with progress(-(-len(rows) // batch_size)) as bar:
            completions, truncated = self.generate([prompts[i].ids for i, _ in rows], seeds, batch_size, bar)
        sampled = [prompts[i] for i, _ in rows]
        rewards = (
            self._score(sampled, completions)
            if rows
            else torch.zeros(0, len(self.funcs), dtype=torch.float64)
        )
        ranks = world.each(rewards) if world.world_size > 1 else [rewards]
        pairs = [(p.ids, c, bool(t)) for p, c, t in zip(sampled, completions, truncated)]
        # TRL's eval batches: this rank's rows in micro-batches of `batch_size`, in order, with the
        # reference's log-probs where beta > 0 (and the policy's, for RLOO's KL penalty).
        batches = [self._micro_batch(pairs[a : a + batch_size]) for a in range(0, len(pairs), batch_size)]
        if self.cfg.needs_reference:
            self._attach_logps(batches, sampling=isinstance(self.cfg, RLOOConfig))
        adv, metrics = self._advantages(ranks, batches, torch.arange(len(pairs)), g)
        records = self._records(step, sampled, completions, truncated, rewards, adv)
        for rec in [r for rank in world.each(records) for r in rank] if world.world_size > 1 else records:
            if self.eval_completions_file is not None:  # the main rank's, every rank's records
                self.eval_completions_file.append(rec)
        losses = self._eval_loss(batches)
        return metrics | self._metrics(torch.cat(ranks), completions, truncated) | losses

    def _eval_loss(self, batches: list[MicroBatch]) -> dict[str, float]:
        """TRL's loss metrics at an evaluation (objectives/grpo.py, rloo.py: eval_metrics) of this
        rank's eval micro-batches, forwarded by the engine gradient_accumulation_steps
        micro-batches a sweep (as evaluation does for the other stages)."""
        engine, world, ga = self.model.engine, self.world, self.cfg.gradient_accumulation_steps
        chunks = [batches[a : a + ga] for a in range(0, len(batches), ga)]
        sums = [x for c in chunks for x in engine.head_outputs(c, engine.objective.eval_sums).cpu().tolist()]
        most = max(world.each(len(chunks))) if world.world_size > 1 else len(chunks)
        for _ in range(most - len(chunks)):
            engine.keep_pace()  # the ranks' sweeps pair up (sharded: their weight gathers do)
        mine = [(mb.input_ids.shape[0], s) for mb, s in zip(batches, sums)]
        rule = rloo.eval_metrics if isinstance(self.cfg, RLOOConfig) else eval_metrics
        return rule(self.cfg, world.each(mine) if world.world_size > 1 else [mine])

    @contextlib.contextmanager
    def _measured(self, snapshot: bool = False):
        """The GPU memory the rollout adds to what the engine holds (`memory`; with a `snapshot`'s
        policy, built before: its bytes too); the allocator's peak counter starts again after it,
        so the run's recorded peak is the update's, as planned."""
        if self.device.type != "cuda":
            yield
            return
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        try:
            yield
        finally:
            added = torch.cuda.max_memory_allocated(self.device) - base
            added += self.memory.get("rollout_snapshot", 0) if snapshot else 0
            self.memory["rollout_gpu_added"] = max(self.memory.get("rollout_gpu_added", 0), added)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def _sample(
        self, model, prompt_ids: list[list[int]], seeds: list[int], streamed: int = 0, logps: bool = False
    ) -> tuple[list[list[int]], list[bool], list[list[float]]]:
        """Completions of `prompt_ids` by `model` (`streamed` of its layers streamed), each cut
        after its first end token, whether each reached max_completion_length instead, and
        (`logps`; else empty) each completion token's log-prob under the warped distribution it
        was drawn from (vLLM's processed logprobs)."""
        cfg = self.cfg
        if self.engine == "megatrain" and supports(model):
            warpers = Warpers(cfg.temperature, cfg.top_k, cfg.top_p)
            graphs = not streamed  # streamed layers: eager steps, paced by their fetches
            decoder = Decoder(
                model, self.device, self.stops, self.pad_id, warpers, graphs, graphs and self.compile, logps
            )
            rows = decoder.sample(prompt_ids, seeds, cfg.max_completion_length)
            drawn = decoder.sampled_logps
        else:
            rows, drawn = self._generate(model, prompt_ids, seeds, logps)
        completions, truncated, out = [], [], []
        for r, row in enumerate(rows):
            end = next((i for i, t in enumerate(row) if t in self.stops), None)
            completions.append(row if end is None else row[: end + 1])
            truncated.append(end is None)
            if logps:
                out.append(drawn[r, : len(completions[-1])].tolist())
        return completions, truncated, out

    def _generate(
        self, model, prompt_ids: list[list[int]], seeds: list[int], logps: bool = False
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """transformers' `generate` (`rollout_engine: generate`): each row's max_completion_length
        new tokens (padding after an end token), the prompts left-padded into one batch, and
        (`logps`) each drawn token's log-prob [rows, tokens]."""
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        cfg = self.cfg
        sampler = RowSampler(seeds, self.device, cfg.temperature, cfg.top_k, cfg.top_p, logps)
        out = model.generate(
            ids.to(self.device),
            attention_mask=mask.to(self.device),
            do_sample=False,  # RowSampler leaves each row its sampled token only
            logits_processor=[sampler],
            max_new_tokens=cfg.max_completion_length,
            eos_token_id=self.stops or None,
            pad_token_id=self.pad_id,
            # static: generate sizes it at width + max_new_tokens and, on CUDA, compiles the decode
            **({"cache_implementation": "static"} if self.cache == "static" else {}),
        )[:, width:]
        drawn = torch.stack(sampler.logps, 1).cpu() if logps else None
        return out.cpu().tolist(), drawn

    def _on_device(self, weights) -> PolicyModel:
        """A transformers model of `weights` ((name, weights) pairs: tensors or the master's
        halves), on the device in the compute dtype, the layers after the plan's `rollout_layers`
        streamed (PolicyModel); a `with` block frees it."""
        return PolicyModel(self.model.cfg.hf_config, weights, self.device, self.dtype, self.resident_layers)

    # ------------------------------------------------------------------ log-probs
    def _attach_logps(
        self, batches: list[MicroBatch], sampling: bool = True, sampler: list[list[float]] | None = None
    ) -> dict[str, float]:
        """Each micro-batch's `token_extra`: the sampling policy's log-probs (OLD_LOGP; not with
        `sampling` False: an evaluation's, whose sampling policy is the policy) and the reference
        policy's (REF_LOGP) of every token, where the loss needs them (0 elsewhere), and a stale
        sampler's own (SAMPLER_LOGP: `sampler`, each row's completion tokens', in the micro-batches'
        order). Returns TRL's metrics of the sampler's correction where OLD_LOGP holds its old
        log-probs (offpolicy.py; else the loss takes them), as TRL takes them when it samples."""
        engine, ga = self.model.engine, self.cfg.gradient_accumulation_steps
        ref = self._reference_logps(batches) if self.cfg.needs_reference and batches else None
        old = None
        if sampling and self.cfg.needs_old_logps:  # a step's micro-batches at a time, as the plan's sweep
            fn, sweeps = engine.objective.token_logps, range(0, len(batches), ga)
            old = [x for a in sweeps for x in engine.head_outputs(batches[a : a + ga], fn)]
            most = max(self.world.each(len(sweeps))) if self.world.world_size > 1 else len(sweeps)
            for _ in range(most - len(sweeps)):
                engine.keep_pace()  # an evaluation's ranks may hold fewer rows: the sweeps pair up
        rows = iter(sampler or [])
        for i, mb in enumerate(batches):
            values = torch.zeros(*mb.input_ids.shape, 2 if sampler is None else 3)
            if old is not None:
                values[..., OLD_LOGP] = old[i].view(mb.input_ids.shape).cpu()
            if ref is not None:
                values[..., REF_LOGP] = ref[i]
            for r in range(len(mb.input_ids) if sampler is not None else 0):
                logps = next(rows)  # a row's last real token is its completion's last
                end = (
                    int(mb.attention_mask[r].sum())
                    if mb.attention_mask is not None
                    else mb.input_ids.shape[1]
                )
                values[r, end - 1 - len(logps) : end - 1, SAMPLER_LOGP] = torch.tensor(logps)
            mb.token_extra = values
        if old is None or sampler is None or not self.cfg.corrects:
            return {}
        stats = [
            sampling_stats(self.cfg, *self._flat(mb, OLD_LOGP, SAMPLER_LOGP), len(mb.input_ids))
            for mb in batches
        ]
        mine = combine(torch.stack(stats).tolist())
        return sampling_metrics(self.world.each(mine) if self.world.world_size > 1 else [mine])

    @staticmethod
    def _flat(mb: MicroBatch, *columns: int) -> list[torch.Tensor]:
        """The `token_extra` columns of a micro-batch and its loss mask, flat [rows x length]."""
        mask = (mb.shifted_labels != IGNORE_INDEX).float().reshape(-1)
        return [mb.token_extra[..., c].reshape(-1) for c in columns] + [mask]

    @torch.no_grad()
    def _reference_logps(self, batches: list[MicroBatch]) -> list[torch.Tensor]:
        """Each micro-batch's per-token log-probs under the reference weights, by a transformers
        model built on the device and freed after."""
        with self._measured():  # the reference model is freed before the step, as the sampling one
            reference = self._on_device(self.reference.items())
            with reference as model:
                out = [self._token_logps(model, mb) for mb in batches]
            del model, reference
        return out

    def _token_logps(self, model, mb: MicroBatch) -> torch.Tensor:
        """[rows, length] log-probs of each next token at logits / temperature under `model`, aligned
        with the shifted labels, from the first position that predicts a completion token on (0
        before it and at the last). Only those positions' logits are made, for as many rows at a
        time as REFERENCE_LOGIT_BYTES allow."""
        rows, length = mb.input_ids.shape
        out = torch.zeros(rows, length)
        labelled = (mb.labels != IGNORE_INDEX).any(0).nonzero()
        if len(labelled) == 0:  # every completion left out of the loss
            return out
        first = int(labelled[0]) - 1
        keep = length - first
        mask = torch.ones_like(mb.input_ids) if mb.attention_mask is None else mb.attention_mask
        following = torch.zeros_like(mb.input_ids)
        following[:, :-1] = mb.input_ids[:, 1:]
        step = max(1, REFERENCE_LOGIT_BYTES // (keep * self.model.cfg.vocab_size * 4))
        for a in range(0, rows, step):
            ids, real = mb.input_ids[a : a + step].to(self.device), mask[a : a + step].to(self.device)
            logits = model(ids, attention_mask=real, use_cache=False, logits_to_keep=keep).logits.float()
            tokens = following[a : a + step, first:].to(self.device)
            out[a : a + step, first:] = log_probs(logits, tokens, self.cfg.temperature)[1].cpu()
            del logits
        out[:, -1] = 0.0  # the last position predicts nothing
        return out

    # ------------------------------------------------------------------ checkpoints
    def state(self, step: int) -> bytes | None:
        """What a checkpoint after step `step` holds of the rollouts (ROLLOUT_FILE): every rank's
        micro-batches of the current rollout when the next step trains on it again, else None.
        Called by every rank."""
        if not continues(step, self.cfg) or self.batches is None:
            return None
        mine = [{k: v for k, v in vars(mb).items() if v is not None} for mb in self.batches]
        buffer = io.BytesIO()
        torch.save(self.world.each(mine) if self.world.world_size > 1 else [mine], buffer)
        return buffer.getvalue()

    # ------------------------------------------------------------------ scoring
    def _score(self, prompts: list[Prompt], completions: list[list[int]]) -> torch.Tensor:
        texts = (
            self.tokenizer.batch_decode(completions, skip_special_tokens=True)
            if self.tokenizer
            else completions
        )
        if prompts[0].conversational:
            texts = [[{"role": "assistant", "content": t}] for t in texts]
        names = [k for p in prompts for k in p.columns]
        columns = {k: [p.columns.get(k) for p in prompts] for k in dict.fromkeys(names)}
        return score(
            self.funcs, [p.prompt for p in prompts], texts, completions, columns, [p.source for p in prompts]
        )

    def _metrics(self, rewards: torch.Tensor, completions, truncated) -> dict[str, float]:
        """TRL's per-function rewards (`rewards`: every rank's) and completion lengths, over every
        rank's completions, as TRL gathers them."""
        out = {}
        for j, f in enumerate(self.funcs):
            col = rewards[:, j]
            out[f"rewards/{f.metric_name}/mean"] = float(col.nanmean())
            out[f"rewards/{f.metric_name}/std"] = (
                float(col[~col.isnan()].std()) if (~col.isnan()).sum() > 1 else 0.0
            )
        mine = [(len(c), bool(t)) for c, t in zip(completions, truncated)]
        every = [x for rank in self.world.each(mine) for x in rank] if self.world.world_size > 1 else mine
        lengths = torch.tensor([n for n, _ in every], dtype=torch.float64)
        cut = torch.tensor([t for _, t in every])
        done = lengths[~cut]
        out.update({
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(cut.double().mean()),
            "completions/mean_terminated_length": float(done.mean()) if len(done) else 0.0,
        })  # fmt: skip
        return out

    def _records(self, step, prompts, completions, truncated, rewards, adv) -> list[dict]:
        """The records of completions.jsonl and eval_completions.jsonl: each completion with its
        prompt, text, token ids, rewards and advantage, and the optimizer step (the one that
        sampled it; an evaluation's, the one evaluated)."""
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True) if self.tokenizer else None
        return [
            {
                "step": step,
                "prompt": p.prompt,
                "completion": texts[i] if texts else None,
                "completion_ids": completions[i],
                "truncated": truncated[i],
                "rewards": {
                    fn.name: (None if r != r else r) for fn, r in zip(self.funcs, rewards[i].tolist())
                },
                "advantage": float(adv[i]),
            }
            for i, p in enumerate(prompts)
        ]

    def close(self) -> None:
        """Close the record files."""
        self.stale.snapshot = None
        for f in (self.completions_file, self.eval_completions_file):
            if f is not None:
                f.close()

    # ------------------------------------------------------------------ batches
    def _micro_batch(self, rows) -> MicroBatch:
        """Prompt + completion rows, right-padded; labels on the completion tokens in the loss
        (`extra`'s advantages: 0 until `_advantages`)."""
        width = max(len(p) + len(c) for p, c, _ in rows)
        ids, labels, real = [], [], []
        for p, c, cut in rows:
            pad = width - len(p) - len(c)
            ids.append(p + c + [self.pad_id] * pad)
            keep = not (cut and self.cfg.mask_truncated_completions)
            labels.append(
                [IGNORE_INDEX] * len(p) + (c if keep else [IGNORE_INDEX] * len(c)) + [IGNORE_INDEX] * pad
            )
            real.append([1] * (len(p) + len(c)) + [0] * pad)
        mask = torch.tensor(real)
        extra = torch.zeros(len(rows), 2, dtype=torch.float64)
        return MicroBatch(
            torch.tensor(ids),
            torch.tensor(labels),
            attention_mask=None if bool(mask.all()) else mask,
            extra=extra,
            prompt_lengths=[len(p) for p, _, _ in rows],
        )


def _mean_metrics(parts: list[dict[str, float]]) -> dict[str, float]:
    """The metrics of a step from those of the generation batches it sampled: none, one's, or
    each one's mean over them (TRL's log), but the times, summed."""
    if len(parts) < 2:
        return parts[0] if parts else {}
    return {k: (sum if k.startswith("time/") else statistics.fmean)(p[k] for p in parts) for k in parts[0]}
