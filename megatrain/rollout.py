"""GRPO's rollouts (`stage: grpo`): per optimizer step, the step's prompts sampled
`num_generations` times by the policy as it is, scored by the reward functions, turned into
advantages and micro-batches of prompt + completion for the engine (objectives/grpo.py).

Sampling is transformers' `generate` (do_sample, temperature, top_p, top_k, max_new_tokens =
max_completion_length) on a transformers model built on the device in the compute dtype from the
host state's current weights, freed after the rollout: the whole policy visits the device once a
step. The prompts of a step are left-padded into one batch, each repeated num_generations times in
a row (TRL's order). Step s samples from torch's generator seeded with `sampling_seed(seed, s)`
(the run's own generators untouched), so a step's completions are a function of the seed, the
step and the weights: `generate` after `torch.manual_seed(sampling_seed(seed, s))` gives the same,
and a resumed run samples what the uninterrupted one did. A completion
ends at its first end token (the tokenizer's EOS or the chat template's end of turn), included;
one that reaches max_completion_length is truncated. Rank r takes the r-th block of a step's
prompts; advantages see every rank's rewards.

Not built yet: layers streamed per decode step for models whose bf16 weights and cache do not fit
the device beside the plan's allocations (the plan does not count the rollout model yet), and
a compiled or static-cache decode.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch

from .data.batch import IGNORE_INDEX, MicroBatch
from .data.chat import end_of_turn_id
from .data.prompts import Prompt
from .objectives.grpo import GRPOConfig, advantages
from .rewards import RewardFunc, score


def sampling_seed(seed: int, step: int) -> int:
    """The seed step `step` (1-based) samples its completions with."""
    return (seed * 1_000_003 + step) % 2**63


class Rollout:
    def __init__(self, grpo: GRPOConfig, prompts: list[Prompt], funcs: list[RewardFunc], tokenizer,
                 model, device, dtype, world, batch_size: int, pad_id: int, out: Path | None, log_every: int,
                 seed: int):  # fmt: skip
        self.seed = seed
        self.cfg, self.prompts, self.funcs, self.tokenizer = grpo, prompts, funcs, tokenizer
        self.model, self.device, self.dtype, self.world = model, device, dtype, world
        self.batch_size, self.pad_id = batch_size, pad_id
        self.completions_file = None if out is None else Path(out) / "completions.jsonl"
        self.log_every = log_every
        eos = tokenizer.eos_token_id if tokenizer is not None else model.cfg.hf_config.eos_token_id
        stops = [
            t for t in (eos if isinstance(eos, list) else [eos]) if t is not None
        ]  # pre-tokenised: the model's
        eot = end_of_turn_id(tokenizer) if tokenizer is not None else None
        self.stops = stops + ([eot] if eot is not None and eot not in stops else [])
        self.metrics: dict[str, float] = {}
        self.memory: dict[str, int] = {}
        """The most GPU memory a rollout added to the engine's (`rollout_gpu_added`), for plan.json."""

    # ------------------------------------------------------------------ one step
    def step(self, prompt_batches: list[MicroBatch], step: int) -> list[MicroBatch]:
        """The micro-batches of optimizer step `step` from its prompt batch (this rank's prompts)."""
        (pb,) = prompt_batches
        prompts = [self.prompts[i] for i in pb.units for _ in range(self.cfg.num_generations)]
        t0 = time.perf_counter()
        completions, truncated = self.generate([p.ids for p in prompts], sampling_seed(self.seed, step))
        t1 = time.perf_counter()
        rewards = self._score(prompts, completions)
        t2 = time.perf_counter()
        every = self.world.each(rewards) if self.world.world_size > 1 else [rewards]
        _, adv, metrics = advantages(self.cfg, torch.cat(every))
        first = sum(len(r) for r in every[: self.world.rank])
        adv = adv[first : first + len(rewards)]
        self.metrics = metrics | self._metrics(torch.cat(every), completions, truncated)
        self.metrics.update({"time/rollout_s": t1 - t0, "time/scoring_s": t2 - t1})
        if self.completions_file is not None and (step % self.log_every == 0 or step == 1):
            self._write(step, prompts, completions, truncated, rewards, adv)
        rows = [(p.ids, c, bool(t)) for p, c, t in zip(prompts, completions, truncated)]
        return [
            self._micro_batch(rows[a : a + self.batch_size], adv[a : a + self.batch_size])
            for a in range(0, len(rows), self.batch_size)
        ]

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], seed: int) -> tuple[list[list[int]], list[bool]]:
        """Sampled completions (each cut after its first end token) and whether each was cut at
        max_completion_length instead."""
        devices = [self.device] if self.device.type == "cuda" else []
        with torch.random.fork_rng(devices=devices), self._measured():
            model = self._policy()
            torch.manual_seed(seed)
            return self._sample(model, prompt_ids)

    @contextlib.contextmanager
    def _measured(self):
        """The GPU memory the rollout adds to what the engine holds (`memory`); the allocator's peak
        counter starts again after it, so the run's recorded peak is the update's, as planned."""
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
            self.memory["rollout_gpu_added"] = max(self.memory.get("rollout_gpu_added", 0), added)
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(self.device)

    def _sample(self, model, prompt_ids: list[list[int]]) -> tuple[list[list[int]], list[bool]]:
        width = max(len(p) for p in prompt_ids)
        ids = torch.full((len(prompt_ids), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompt_ids):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        out = model.generate(
            ids.to(self.device),
            attention_mask=mask.to(self.device),
            do_sample=True,
            temperature=self.cfg.temperature,
            top_p=self.cfg.top_p,
            top_k=self.cfg.top_k or 0,
            max_new_tokens=self.cfg.max_completion_length,
            eos_token_id=self.stops or None,
            pad_token_id=self.pad_id,
        )[:, width:].cpu()
        del model
        completions, truncated = [], []
        for row in out.tolist():
            end = next((i for i, t in enumerate(row) if t in self.stops), None)
            completions.append(row if end is None else row[: end + 1])
            truncated.append(end is None)
        return completions, truncated

    def _policy(self):
        """A transformers model of the host state's current weights, on the device."""
        import transformers

        self.model.transport.synchronize()  # the optimizer may still be writing the last step
        cfg = self.model.cfg.hf_config
        with torch.device(self.device):  # its random initialisation is overwritten below
            model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=self.dtype)
        own = model.state_dict()  # the model's tensors (a tied head is the embedding's)
        # One tensor at a time, converted on the way: never a second copy of the policy on the device.
        for name, value in self.model.state.named_parameters():
            own[name].copy_(value, non_blocking=True)
        return model.eval()

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
        """TRL's per-function rewards and completion lengths (this rank's lengths)."""
        out = {}
        for j, f in enumerate(self.funcs):
            col = rewards[:, j]
            out[f"rewards/{f.name}/mean"] = float(col.nanmean())
            out[f"rewards/{f.name}/std"] = float(col[~col.isnan()].std()) if (~col.isnan()).sum() > 1 else 0.0
        lengths = torch.tensor([len(c) for c in completions], dtype=torch.float64)
        done = lengths[~torch.tensor(truncated)]
        out.update({
            "completions/mean_length": float(lengths.mean()),
            "completions/min_length": float(lengths.min()),
            "completions/max_length": float(lengths.max()),
            "completions/clipped_ratio": float(sum(truncated)) / len(truncated),
            "completions/mean_terminated_length": float(done.mean()) if len(done) else 0.0,
        })  # fmt: skip
        return out

    def _write(self, step, prompts, completions, truncated, rewards, adv) -> None:
        """Sample completions with their rewards to output_dir/completions.jsonl (the main rank's)."""
        if not self.world.is_main:
            return
        texts = self.tokenizer.batch_decode(completions, skip_special_tokens=True) if self.tokenizer else None
        with open(self.completions_file, "a") as f:
            for i, p in enumerate(prompts):
                rec = {
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
                f.write(json.dumps(rec) + "\n")

    # ------------------------------------------------------------------ batches
    def _micro_batch(self, rows, adv: torch.Tensor) -> MicroBatch:
        """Prompt + completion rows, right-padded; labels on the completion tokens in the loss."""
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
        return MicroBatch(
            torch.tensor(ids),
            torch.tensor(labels),
            attention_mask=None if bool(mask.all()) else mask,
            extra=adv.double()[:, None],
        )
